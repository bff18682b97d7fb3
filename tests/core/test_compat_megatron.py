"""Megatron-Core's own model-swap scenarios through ``reshard_core.compat.megatron`` (CPU, Gloo, 4 ranks).

The scenario list is Megatron's ``tests/unit_tests/resharding/test_model_swap.py`` (GPT, 8 heads, 4
query groups, hidden 32; every layout fills the 4 ranks with data parallelism). Models come as
``[model]`` lists, as Megatron's training loop passes them. Per case the source is built from seed
7 and the destination from seed 8; a third model, built by Megatron from seed 7 in the destination
layout, is the reference. After ``swap_model_weights`` every destination parameter and buffer must
equal the reference bit for bit, and the destination's logits (Megatron's forward on CPU, pipeline
stages chained by hand) must equal the reference's bit for bit and the source's up to float
summation order (a changed TP size reorders sums). MoE models are built for a CPU forward
(allgather token dispatcher, no load-balancing loss) and run with a causal attention mask.

Also covered in the same worlds: a Megatron ``CopyService`` instance as ``refit_method``,
``post_refit``/``refresh_cache`` hooks, the second swap reusing the prepared session with the
destination storage kept. In a world of its own: a destination config asking for inference-optimized
MXFP8 is refused on every rank before any data moves (Megatron's linears cannot run on MXFP8 buffers).
"""

from __future__ import annotations

import pytest
import torch

from reshard_core.testing.world import run_world

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow

WORLD = 4
GPT = dict(hidden_size=32, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64)
DENSE_KW = dict(GPT, num_layers=4, parallel_output=False)
MOE_KW = dict(GPT, num_layers=2, num_moe_experts=4, expert_bias=True, bias=False,  # MoE bias: expert TP 1
              parallel_output=False, cpu_moe_forward=True)  # fmt: skip
DENSE = {  # name: (tp, pp, ep) source, (tp, pp, ep) destination
    "tp2->tp1": ((2, 1, 1), (1, 1, 1)),
    "tp1->tp2": ((1, 1, 1), (2, 1, 1)),
    "tp2->tp4": ((2, 1, 1), (4, 1, 1)),
    "pp2->pp1": ((1, 2, 1), (1, 1, 1)),
    "pp1->pp2": ((1, 1, 1), (1, 2, 1)),
    "tp2pp2->tp1pp1": ((2, 2, 1), (1, 1, 1)),
    "tp1pp2->tp2pp1": ((1, 2, 1), (2, 1, 1)),
}
MOE = {
    "ep2->ep4": ((1, 1, 2), (1, 1, 4)),
    "ep2->ep1": ((1, 1, 2), (1, 1, 1)),
    "ep1->ep2": ((1, 1, 1), (1, 1, 2)),
    "tp2ep2->tp1ep1": ((2, 1, 2), (1, 1, 1)),
    "tp4ep1->tp1ep4": ((4, 1, 1), (1, 1, 4)),
}
MEGATRON_SERVICE_CASES = {"tp2->tp4", "ep2->ep4"}  # these swap through a Megatron CopyService instance
HOOK_CASE = "tp2->tp1"


def _weights(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _differing(model, reference, skip=()) -> list[str]:
    got, want = _weights(model), _weights(reference)
    assert got.keys() == want.keys()
    return sorted(n for n in want if n not in skip and not torch.equal(got[n], want[n]))


def _megatron_service():
    """A Megatron ``CopyService`` subclass (0.16.1's interface: no ``task_id``) over CPU Gloo P2P."""
    import torch.distributed as dist
    from megatron.core.resharding.copy_services.base import CopyService

    class CpuGlooCopyService(CopyService):
        def __init__(self) -> None:
            self.ops: list = []
            self.submitted = 0

        def submit_send(self, src_tensor, dest_rank):
            self.ops.append(dist.P2POp(dist.isend, src_tensor, dest_rank))
            self.submitted += 1

        def submit_recv(self, dest_tensor, src_rank):
            self.ops.append(dist.P2POp(dist.irecv, dest_tensor, src_rank))
            self.submitted += 1

        def run(self):
            if self.ops:
                for work in dist.batch_isend_irecv(self.ops):
                    work.wait()
            self.ops.clear()

    return CpuGlooCopyService()


def _install_hooks(dst, reference) -> dict[str, list[bool]]:
    """Hooks recording, per call, whether every weight had already landed when it ran."""
    calls: dict[str, list[bool]] = {"decoder.post_refit": [], "layer0.refresh_cache": [],
                                    "attention.post_refit": [], "attention.refresh_cache": []}  # fmt: skip

    def hook(key):
        return lambda: calls[key].append(_differing(dst, reference) == [])

    dst.decoder.post_refit = hook("decoder.post_refit")
    dst.decoder.layers[0].refresh_cache = hook("layer0.refresh_cache")
    dst.decoder.layers[0].self_attention.post_refit = hook("attention.post_refit")
    dst.decoder.layers[0].self_attention.refresh_cache = hook("attention.refresh_cache")
    return calls


def _swap_case(name, src_layout, dst_layout, kwargs, *, causal: bool = False) -> dict:
    from reshard_core.compat.megatron import swap_model_weights
    from reshard_core.testing.megatron_forward import gpt_inputs, gpt_logits
    from reshard_core.testing.models import build_gpt, build_pg_collection

    src = build_gpt(build_pg_collection(*src_layout), seed=7, **kwargs)
    dst = build_gpt(build_pg_collection(*dst_layout), seed=8, **kwargs)
    reference = build_gpt(build_pg_collection(*dst_layout), seed=7, **kwargs)
    method = _megatron_service() if name in MEGATRON_SERVICE_CASES else "gloo"
    calls = _install_hooks(dst, reference) if name == HOOK_CASE else None
    facts = {"weights": len(_weights(dst)), "before": _differing(dst, reference)}
    inputs = gpt_inputs(2, 8, 128, causal=causal)
    src_logits, before_logits = gpt_logits(src, *inputs), gpt_logits(dst, *inputs)
    pointers = {n: t.data_ptr() for n, t in _weights(dst).items()}
    first = swap_model_weights([src], [dst], method)
    facts["after_first"] = _differing(dst, reference)
    after_logits, ref_logits = gpt_logits(dst, *inputs), gpt_logits(reference, *inputs)
    facts["logits"] = {
        "scale": src_logits.abs().max().item(),
        "before": (before_logits - src_logits).abs().max().item(),
        "after": (after_logits - src_logits).abs().max().item(),
        "equals_reference": torch.equal(after_logits, ref_logits),
    }
    with torch.no_grad():
        for t in _weights(dst).values():
            t.zero_()
    second = swap_model_weights([src], [dst], method)
    facts["after_second"] = _differing(dst, reference)
    facts["reused"] = (first.reused_plan, second.reused_plan)
    facts["pointers_kept"] = pointers == {n: t.data_ptr() for n, t in _weights(dst).items()}
    facts["remote_bytes"] = first.bytes_sent + first.bytes_received
    if not isinstance(method, str):
        facts["service_ops"] = method.submitted
        facts["transport"] = first.transport
    if calls is not None:
        facts["hooks"] = calls
    return facts


def _mxfp8_world(rank: int, world: int) -> dict:
    """TP2 → TP1 into a destination whose config asks for inference-optimized MXFP8: every rank
    is refused before any data moves, the destination's forward still runs; with reshard's MXFP8 buffers
    in its linears' place (what the set-up used to install) that forward fails."""
    from reshard_mxfp8 import make_mxfp8

    from reshard_core.compat.megatron import clear_all_caches, prepare_swap_model_weights, swap_model_weights
    from reshard_core.compat.megatron_mxfp8 import mxfp8_layers
    from reshard_core.testing.megatron_forward import allow_cpu_forward, gpt_inputs, gpt_logits
    from reshard_core.testing.models import build_gpt, build_pg_collection, init_megatron
    from reshard_core.testing.world import outcome

    init_megatron()
    allow_cpu_forward()
    src = build_gpt(build_pg_collection(2, 1, 1), seed=7, **DENSE_KW)
    dst = build_gpt(build_pg_collection(1, 1, 1), seed=8, **DENSE_KW)
    dst.config.transformer_impl = "inference_optimized"
    dst.config.fp8_recipe = "mxfp8"
    inputs = gpt_inputs(2, 8, 128)
    logits = gpt_logits(dst, *inputs)
    before = {n: (type(t), t.data_ptr(), t.clone()) for n, t in _weights(dst).items()}
    facts = {
        "prepare": outcome(lambda: prepare_swap_model_weights([src], [dst])),
        "swap": outcome(lambda: swap_model_weights([src], [dst], "gloo")),
    }
    now = _weights(dst)
    facts["untouched"] = now.keys() == before.keys() and all(
        (type(t), t.data_ptr()) == before[n][:2] and torch.equal(t, before[n][2]) for n, t in now.items()
    )
    facts["forward_after"] = outcome(lambda: gpt_logits(dst, *inputs))
    facts["same_logits"] = torch.equal(gpt_logits(dst, *inputs), logits)
    facts["layers"] = mxfp8_layers(dst)
    make_mxfp8(dst, [f"{name}.weight" for name, _ in facts["layers"]], form="pair")
    try:
        gpt_logits(dst, *inputs)
        facts["forward_on_mxfp8_buffers"] = "ok"
    except RuntimeError as exc:
        facts["forward_on_mxfp8_buffers"] = f"RuntimeError: {exc}"
    clear_all_caches()
    return facts


def _dense_world(rank: int, world: int) -> dict:
    from reshard_core.compat.megatron import clear_all_caches
    from reshard_core.testing.megatron_forward import allow_cpu_forward
    from reshard_core.testing.models import init_megatron

    init_megatron()
    allow_cpu_forward()
    out = {name: _swap_case(name, s, d, DENSE_KW) for name, (s, d) in DENSE.items()}
    clear_all_caches()
    return out


def _moe_world(rank: int, world: int) -> dict:
    from reshard_core.compat.megatron import clear_all_caches
    from reshard_core.testing.megatron_forward import allow_cpu_forward
    from reshard_core.testing.models import init_megatron

    init_megatron()
    allow_cpu_forward()
    out = {name: _swap_case(name, s, d, MOE_KW, causal=True) for name, (s, d) in MOE.items()}
    clear_all_caches()
    return out


@pytest.fixture(scope="module")
def dense():
    return run_world(_dense_world, WORLD, timeout=500, pg_timeout=120)


@pytest.fixture(scope="module")
def moe():
    return run_world(_moe_world, WORLD, timeout=400, pg_timeout=120)


@pytest.fixture(scope="module")
def mxfp8():
    return run_world(_mxfp8_world, 2, timeout=300, pg_timeout=120)


def _check_bit_exact(results, case):
    for rank, out in enumerate(results):
        facts = out[case]
        assert len(facts["before"]) == facts["weights"], (rank, "a weight started equal")
        assert facts["after_first"] == [], (rank, facts["after_first"])
        assert facts["after_second"] == [], (rank, facts["after_second"])
        assert facts["reused"] == (False, True), rank
        assert facts["pointers_kept"], rank


@pytest.mark.parametrize("case", DENSE)
def test_dense_scenario_is_bit_exact(dense, case):
    _check_bit_exact(dense, case)


def _check_logits(results, case):
    for rank, out in enumerate(results):
        logits = out[case]["logits"]
        assert logits["equals_reference"], rank
        assert logits["before"] > 1.0, (rank, logits)  # the destination started with other weights
        assert logits["after"] <= 1e-4 * logits["scale"], (rank, logits)


@pytest.mark.parametrize("case", DENSE)
def test_dense_scenario_logits_match_the_source(dense, case):
    _check_logits(dense, case)


@pytest.mark.parametrize("case", MOE)
def test_moe_scenario_is_bit_exact(moe, case):
    _check_bit_exact(moe, case)


@pytest.mark.parametrize("case", MOE)
def test_moe_scenario_logits_match_the_source(moe, case):
    _check_logits(moe, case)


@pytest.mark.parametrize("case", sorted(MEGATRON_SERVICE_CASES))
def test_a_megatron_copy_service_instance_moves_the_messages(dense, moe, case):
    results = dense if case in DENSE else moe
    assert sum(out[case]["remote_bytes"] for out in results) > 0
    for out in results:
        assert out[case]["transport"] == "megatron:CpuGlooCopyService"
    assert sum(out[case]["service_ops"] for out in results) > 0


def test_post_refit_hooks_run_once_per_swap_after_the_weights_landed(dense):
    for out in dense:
        assert out[HOOK_CASE]["hooks"] == {
            "decoder.post_refit": [True, True],
            "layer0.refresh_cache": [True, True],
            "attention.post_refit": [True, True],
            "attention.refresh_cache": [],  # post_refit wins where a module defines both
        }


def test_an_mxfp8_destination_config_is_refused_on_every_rank_and_the_destination_still_runs(mxfp8):
    linears = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    expected = sorted(f"decoder.layers.{i}.{m}" for i in range(4) for m in linears)
    for facts in mxfp8:
        assert sorted(name for name, _ in facts["layers"]) == expected
        first, cls = facts["layers"][0]
        refusal = facts["prepare"]
        assert refusal.startswith(
            f"ReshardError: cannot set up MXFP8 weights for {first} ({cls}) (and 15 more linear layers): "
        )
        assert cls in ("ColumnParallelLinear", "RowParallelLinear")
        assert facts["swap"] == refusal
        assert facts["untouched"] and facts["forward_after"] == "ok" and facts["same_logits"]
        # Megatron's own forward on the buffers the refused set-up would have installed
        assert facts["forward_on_mxfp8_buffers"].startswith("RuntimeError: expected ")
        assert "!= unsigned char" in facts["forward_on_mxfp8_buffers"]
