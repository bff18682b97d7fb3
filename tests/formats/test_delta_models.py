"""Delta refits (``refit(..., delta=True)``) on real models over 12 AdamW steps, in one 4-rank Gloo world.

Sources are BF16 model copies of FP32 master weights that ``torch.optim.AdamW`` updates with
random gradients (the RL trainer's setup). After every step one delta refit fills the destination
and one plain refit fills a twin of it; the two must be equal bit for bit (plain refits are exact
against the source, see the other tests here), so every element of the delta destination equals
the source after every refit. Three pairs:

- Megatron-Core ``GPTModel`` TP2 (×DP2) → ``GPTModel`` TP4 (one format);
- Megatron-Core ``GPTModel`` TP2 → ``LlamaForCausalLM`` replicated (Megatron → HF, through formats);
- ``LlamaForCausalLM`` under FSDP2 (4 ranks) → ``LlamaForCausalLM`` replicated (one format);
- ``LlamaForCausalLM`` under FSDP2 → ``GPTModel`` TP2 (HF → Megatron: deltas land in the split
  views of ``linear_qkv``, through a copy of each region).

Each run includes a learning-rate spike (a step that changes most elements: messages go whole), a
step where one rank replaces a destination parameter (its plan changes: every rank rebuilds and
that refit is full, saying why), a plain refit into the delta destination (the next delta refit is
full for it), and, in the Megatron → HF run, a transport failure on one rank in the middle of a
refit (every rank raises; the next refit, over a fresh group, is full and exact).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from reshard_core.testing.world import run_world

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

STEPS = 12
LRS = {3: 1e-1}  # the spike; every other step uses LR
LR = 1e-5
REPLACE_AT, PLAIN_AT, FAIL_AT = 5, 7, 9
BF16 = torch.bfloat16
TIMEOUT = 20.0
PAIRS = ("megatron->megatron", "megatron->hf", "hf->hf", "hf->megatron")


def _gpt(tp: int):
    from reshard_core.testing.models import build_gpt, build_pg_collection

    return build_gpt(
        build_pg_collection(tp=tp), dtype=BF16, normalization="RMSNorm", rope=True, bias=False,
        num_query_groups=4, vocab_size=128,
    )  # fmt: skip


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=8, tie_word_embeddings=False, max_position_embeddings=16,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(BF16)


def _fsdp_llama():
    from torch.distributed.fsdp import fully_shard

    model = _llama()
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _failing_gloo(group):
    """A Gloo transport that, once ``armed``, raises on rank 1 after the first data message it
    received landed (so the refit is partly applied there)."""
    from reshard_gloo.transport import GlooCopyService

    from reshard_core.errors import TransportError

    class FailingGloo(GlooCopyService):
        armed = False

        def _finish(self, ops):
            super()._finish(ops)
            if self.armed and dist.get_rank() == 1 and any(op.kind == "recv" for op in ops):
                self.armed = False
                raise TransportError("injected failure")

    return FailingGloo(group, timeout=TIMEOUT)


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Names of the parameters whose bits differ between two models of one layout."""
    pb = dict(b.named_parameters())
    wrong = []
    for name, p in a.named_parameters():
        x, y = getattr(p, "_local_tensor", p), getattr(pb[name], "_local_tensor", pb[name])
        if not torch.equal(x.view(torch.int16), y.view(torch.int16)):
            wrong.append(name)
    return wrong


def _run(rank: int, src, dst, twin, *, fail: bool) -> list[dict]:
    """12 steps of train → delta refit → plain refit into the twin; one record per step."""
    import reshard_core
    from reshard_core.errors import ReshardError
    from reshard_core.testing.training import MasterWeights

    trainer = MasterWeights(src, LR, seed=1000 + rank)
    group = dist.new_group(backend="gloo")
    # cast: Megatron keeps its norms in FP32 under a BF16 model
    transport = _failing_gloo(group) if fail else "gloo"
    options = dict(group=group, transport=transport, timeout=TIMEOUT, cast=True)
    records = []
    for step in range(STEPS):
        trainer.step(LRS.get(step, LR))
        if step == REPLACE_AT and rank == 2:  # this rank's plan changes: same values, new storage
            name, param = next(iter(dst.named_parameters()))
            param.data = param.data.clone()
        if step == PLAIN_AT:
            reshard_core.refit(src, dst, **options)
        error = ""
        if fail and step == FAIL_AT:
            options["transport"].armed = True
            try:
                reshard_core.refit(src, dst, delta=True, **options)
            except ReshardError as exc:
                error = type(exc).__name__
            dist.barrier()  # over the world group: the refit group is abandoned after a failure
            group = dist.new_group(backend="gloo")
            options.update(group=group, transport=_failing_gloo(group))
        report = reshard_core.refit(src, dst, delta=True, **options)
        reshard_core.refit(src, twin, **options)
        d = report.delta
        records.append(
            dict(
                step=step,
                error=error,
                wrong=_equal(dst, twin),
                sent=report.bytes_sent,
                full=d.full_bytes,
                deltas=d.messages,
                changed=d.changed_words,
                compared=d.compared_words,
                note=d.note,
            )  # fmt: skip
        )
    return records


def _world(rank: int, world: int) -> dict:
    from megatron.core import tensor_parallel

    from reshard_core.testing.models import init_megatron

    init_megatron()
    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    out = {}
    src = _gpt(2)
    out["megatron->megatron"] = _run(rank, src, _gpt(4), _gpt(4), fail=False)
    out["megatron->hf"] = _run(rank, _gpt(2), _llama(), _llama(), fail=True)
    out["hf->hf"] = _run(rank, _fsdp_llama(), _llama(), _llama(), fail=False)
    out["hf->megatron"] = _run(rank, _fsdp_llama(), _gpt(2), _gpt(2), fail=False)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_world(_world, 4, timeout=600)


@pytest.mark.parametrize("pair", PAIRS)
def test_delta_refits_are_bit_exact_every_step_and_move_only_what_changed(runs, pair):
    _sending(runs, pair, 0)
    for rank, per_rank in enumerate(runs):
        records = per_rank[pair]
        assert [r["wrong"] for r in records] == [[]] * STEPS, (rank, pair)
        if not records[0]["full"]:  # this rank sends nothing in this pair
            continue
        first = records[0]
        assert first["deltas"] == 0 and first["sent"] >= first["full"]
        assert "first delta refit of this plan" in first["note"]
        sparse = [r for r in records[1:] if r["step"] not in (*LRS, REPLACE_AT, PLAIN_AT, FAIL_AT)]
        assert all(r["deltas"] > 0 and r["sent"] < r["full"] / 3 for r in sparse), (rank, pair, sparse)
        # the spike changes most words: messages go whole, saying so
        spike = records[min(LRS)]
        assert spike["changed"] > spike["compared"] / 2 and "changed too densely" in spike["note"]


def _sending(runs, pair: str, step: int) -> list[tuple[dict, list[dict]]]:
    """``(record of step, all records)`` of the ranks that send in ``pair`` (at least one)."""
    found = [
        (records[step], records) for records in (per_rank[pair] for per_rank in runs) if records[step]["full"]
    ]
    assert found, f"no rank sends in {pair} at step {step}"
    return found


@pytest.mark.parametrize("pair", PAIRS)
def test_a_rank_whose_plan_changes_makes_that_refit_full_everywhere_saying_why(runs, pair):
    for r, records in _sending(runs, pair, REPLACE_AT):
        assert r["deltas"] == 0 and "the plan was rebuilt" in r["note"], (pair, r)
        assert records[REPLACE_AT + 1]["deltas"] > 0


@pytest.mark.parametrize("pair", PAIRS)
def test_a_plain_refit_into_the_destination_makes_the_next_delta_refit_full_for_it(runs, pair):
    for r, _ in _sending(runs, pair, PLAIN_AT):
        assert r["deltas"] == 0 and "holds no baseline" in r["note"], (pair, r)


def test_after_an_injected_transport_failure_the_next_refit_is_full_and_exact(runs):
    errors = [per_rank["megatron->hf"][FAIL_AT]["error"] for per_rank in runs]
    assert errors[1] == "TransportError" and all(errors), errors
    assert [per_rank["megatron->hf"][FAIL_AT]["wrong"] for per_rank in runs] == [[]] * len(runs)
    for r, _ in _sending(runs, "megatron->hf", FAIL_AT):
        assert r["deltas"] == 0, r
