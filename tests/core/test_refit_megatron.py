"""``refit`` between real Megatron-Core ``GPTModel`` layouts (CPU, gated MLP, one 4-rank Gloo world).

Per case the source is built from seed 7 and the destination from seed 8 (so every weight starts
wrong); after the refit every destination parameter and buffer must equal, bit for bit, a third
model built from seed 7 in the destination layout by Megatron itself — a reference that owes
nothing to reshard's extractors. Dense: TP2→TP4, TP4→TP1, TP2PP2→TP1PP1, TP1→TP2PP2. MoE
(SequentialMLP experts, router ``expert_bias`` buffer): EP2→EP1, EP1→TP2EP2.
"""

from __future__ import annotations

import pytest
import torch

from reshard_core.testing.world import run_world

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow

WORLD = 4
DENSE = dict(num_layers=2)
MOE = dict(num_layers=2, num_moe_experts=4, expert_bias=True, bias=False)  # MoE bias needs expert TP 1
CASES = {  # name: ((tp, pp, ep) source, (tp, pp, ep) destination, model kwargs)
    "tp2->tp4": ((2, 1, 1), (4, 1, 1), DENSE),
    "tp4->tp1": ((4, 1, 1), (1, 1, 1), DENSE),
    "tp2pp2->tp1pp1": ((2, 2, 1), (1, 1, 1), DENSE),
    "tp1->tp2pp2": ((1, 1, 1), (2, 2, 1), DENSE),
    "ep2->ep1": ((1, 1, 2), (1, 1, 1), MOE),
    "ep1->tp2ep2": ((1, 1, 1), (2, 1, 2), MOE),
}


def _weights(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _differing(model, reference) -> list[str]:
    got, want = _weights(model), _weights(reference)
    assert got.keys() == want.keys()
    return sorted(n for n in want if not torch.equal(got[n], want[n]))


def _world(rank: int, world: int) -> dict:
    import reshard_core
    from reshard_core.testing.models import build_gpt, build_pg_collection, init_megatron

    init_megatron()
    out = {}
    for name, (src_layout, dst_layout, kwargs) in CASES.items():
        src = build_gpt(build_pg_collection(*src_layout), seed=7, **kwargs)
        dst = build_gpt(build_pg_collection(*dst_layout), seed=8, **kwargs)
        reference = build_gpt(build_pg_collection(*dst_layout), seed=7, **kwargs)
        before = _differing(dst, reference)
        pointers = {n: t.data_ptr() for n, t in _weights(dst).items()}
        first = reshard_core.refit(src, dst, timeout=60)
        after_first = _differing(dst, reference)
        with torch.no_grad():
            for t in _weights(dst).values():
                t.zero_()
        second = reshard_core.refit(src, dst, timeout=60)
        out[name] = {
            "weights": len(pointers),
            "before": before,
            "after_first": after_first,
            "after_second": _differing(dst, reference),
            "reused": (first.reused_plan, second.reused_plan),
            "pointers_kept": pointers == {n: t.data_ptr() for n, t in _weights(dst).items()},
            "bytes": (first.bytes_sent, first.bytes_received, first.bytes_local),
        }
        if name == "tp2->tp4":  # a byte budget far below the model's size: many batches, same result
            with torch.no_grad():
                for t in _weights(dst).values():
                    t.zero_()
            report = reshard_core.refit(src, dst, max_batch_bytes=16 * 1024, timeout=60)
            out["budget"] = {"batches": report.batches, "after": _differing(dst, reference),
                             "model_bytes": sum(t.nbytes for t in _weights(reference).values())}  # fmt: skip
    reshard_core.clear_caches()
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(_world, WORLD, timeout=400, pg_timeout=120)


@pytest.mark.parametrize("case", CASES)
def test_every_destination_weight_equals_the_source_bit_for_bit(results, case):
    for rank, out in enumerate(results):
        facts = out[case]
        assert len(facts["before"]) == facts["weights"], (rank, "a weight started equal")
        assert facts["after_first"] == [], (rank, facts["after_first"])
        assert facts["after_second"] == [], (rank, facts["after_second"])


@pytest.mark.parametrize("case", CASES)
def test_the_second_refit_reuses_the_plan_and_keeps_destination_storage(results, case):
    for out in results:
        assert out[case]["reused"] == (False, True)
        assert out[case]["pointers_kept"]


def test_tp2_to_tp4_moves_bytes_over_the_wire_and_locally(results):
    sent = sum(out["tp2->tp4"]["bytes"][0] for out in results)
    received = sum(out["tp2->tp4"]["bytes"][1] for out in results)
    local = [out["tp2->tp4"]["bytes"][2] for out in results]
    assert sent == received > 0
    assert all(n > 0 for n in local)  # every TP4 rank holds part of its slice already


def test_a_budget_below_the_model_size_gives_several_batches_and_the_same_result(results):
    for out in results:
        facts = out["budget"]
        assert facts["model_bytes"] > 16 * 1024
        assert facts["batches"] > 1
        assert facts["after"] == []
