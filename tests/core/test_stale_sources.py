"""Refits read current sources: Megatron-Core DDP's deferred parameter all-gather is finished first.

The real Megatron-Core 0.16.1 ``DistributedDataParallel`` (``use_distributed_optimizer=True``,
``overlap_param_gather=True``, ``overlap_grad_reduce=True``, two bucket groups) and its own
``DistributedOptimizer`` (Adam) train a small ``GPTModel`` over DP=2 in a 2-rank Gloo world on CPU.
Megatron's forward runs on CPU with ``allow_cpu_forward``'s stubs; the optimizer's constructor is
bridged to CPU while it runs (it checks ``param.type()`` against CUDA type names and allocates a
CUDA scalar), and is stepped directly (the ``ChainedOptimizer`` around it computes a grad norm on
"cuda"). After each ``step()`` every rank holds its own fresh shard and stale copies of the others.

The oracle for the post-step weights is built without Megatron's gather: every rank's own shard of
each bucket's ``param_data``, gathered with ``dist.all_gather``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from reshard_core.extract import ExtractError
from reshard_core.extract.freshness import finish_param_gathers, megatron_ddp, source_refreshers
from reshard_core.testing.world import outcome, run_world

pytestmark = pytest.mark.slow

WORLD = 2
GPT = dict(num_layers=1, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=32,
           vocab_size=32)  # fmt: skip


class DistributedDataParallel:
    """A wrapper named like Megatron's whose forward pre-hook does not close over it (the shape a
    future Megatron-Core could take): reshard finds the hook but cannot reach the wrapper."""

    def __init__(self, module: torch.nn.Module | None = None, groups: list | None = None) -> None:
        self.ddp_config = SimpleNamespace(use_distributed_optimizer=True, overlap_param_gather=True)
        self.bucket_groups, self.expert_parallel_bucket_groups = groups or [], []
        self.module = module
        if module is not None:
            module.register_forward_pre_hook(self._make_forward_pre_hook())

    def _make_forward_pre_hook(self):
        seen: list = []

        def hook(module, *unused):
            seen.append(module)

        return hook


def _refusal(name: str, why: str) -> str:
    return (
        f"source {name}: Megatron-Core DistributedDataParallel with overlap_param_gather=True defers the "
        f"parameter all-gather after optimizer.step() to the next forward, and reshard cannot finish it "
        f"({why}), so the shards of other data-parallel ranks may be stale; pass the "
        f"DistributedDataParallel itself as the source, or set overlap_param_gather=False"
    )


UNREACHABLE = _refusal("Linear", "the wrapper cannot be read from its forward pre-hook")


def test_refuses_a_module_whose_wrapper_hook_cannot_be_followed():
    with pytest.raises(ExtractError) as info:
        source_refreshers([torch.nn.Linear(2, 2), DistributedDataParallel(torch.nn.Linear(2, 2)).module])
    assert str(info.value) == UNREACHABLE


def test_refuses_a_wrapper_without_the_bucket_group_api():
    wrapper = DistributedDataParallel(groups=[SimpleNamespace(param_gather_handle=None)])
    with pytest.raises(ExtractError) as info:
        megatron_ddp(wrapper)
    assert str(info.value) == _refusal(
        "DistributedDataParallel",
        "no bucket group finish_param_sync, bucket group param_gather_dispatched: "
        "not Megatron-Core 0.16's API",
    )


def test_plain_sources_need_nothing():
    assert source_refreshers(None) == []
    assert finish_param_gathers([torch.nn.Linear(2, 2), None]) == 0


# ---------------------------------------------------------------- the real Megatron-Core DDP


def _distributed_optimizer(ddp):
    """Megatron's own ``DistributedOptimizer`` (Adam, no clipping) over ``ddp``, built on CPU."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=0.1, use_distributed_optimizer=True, params_dtype=torch.float32, clip_grad=0.0
    )
    tensor_type, tensor = torch.Tensor.type, torch.tensor
    torch.Tensor.type = lambda t, *a, **k: (
        tensor_type(t, *a, **k) if a or k else tensor_type(t).replace("torch.", "torch.cuda.", 1)
    )
    torch.tensor = lambda *a, device=None, **k: tensor(*a, device="cpu" if device == "cuda" else device, **k)
    try:
        chained = get_megatron_optimizer(config, [ddp])
    finally:
        torch.Tensor.type, torch.tensor = tensor_type, tensor
    (optimizer,) = chained.chained_optimizers
    assert type(optimizer).__name__ == "DistributedOptimizer"
    return optimizer


def _train_step(ddp, optimizer, seed: int) -> None:
    """Megatron's step order: forward (pre-hooks finish the gathers), backward, grad sync, step."""
    import torch.distributed as dist

    from reshard_core.testing.megatron_forward import gpt_inputs

    tokens, positions, mask = gpt_inputs(
        2, 8, GPT["vocab_size"], seed=seed * WORLD + dist.get_rank(), causal=True
    )
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    ddp(tokens, positions, mask, labels=tokens).float().mean().backward()
    ddp.finish_grad_sync()
    assert optimizer.step()[0]


def _post_step(ddp) -> dict[str, torch.Tensor]:
    """Every parameter's post-step value: each rank's own (fresh) shard of every bucket, all-gathered
    here with ``dist.all_gather`` (DP is the world), then cut into parameters by the buffer's map."""
    import torch.distributed as dist

    names = {p: n for n, p in ddp.module.named_parameters()}
    out = {}
    for buffer in ddp.buffers:
        full = buffer.param_data.clone()
        for bucket in buffer.buckets:
            mine = bucket.param_data.chunk(WORLD)[dist.get_rank()].clone()
            shards = [torch.empty_like(mine) for _ in range(WORLD)]
            dist.all_gather(shards, mine)
            full[bucket.offset : bucket.offset + bucket.param_data.numel()] = torch.cat(shards)
        for param, (start, end, _) in buffer.param_index_map.items():
            out[names[param]] = full[start:end].view(param.shape)
    return out


def _wrong(model, expected: dict[str, torch.Tensor]) -> list[str]:
    """Names of ``model``'s parameters that differ from ``expected`` in any bit."""
    from reshard_core.testing.conformance import same_bytes

    params = dict(model.named_parameters())
    assert params.keys() == expected.keys()
    return [n for n, p in params.items() if not same_bytes(p.detach(), expected[n])]


def _count_gathers(ddp) -> list[int]:
    """A one-element list counting the all-gathers ``ddp``'s bucket groups dispatch from now on (by
    Megatron's pre-hooks or by a refit)."""
    count = [0]

    def counted(start):
        def start_param_sync(*args, **kwargs):
            count[0] += 1
            return start(*args, **kwargs)

        return start_param_sync

    for group in ddp.bucket_groups:
        group.start_param_sync = counted(group.start_param_sync)
    return count


def _megatron_world(rank: int, world: int) -> dict:
    from megatron.core.distributed import DistributedDataParallel as MegatronDDP
    from megatron.core.distributed import DistributedDataParallelConfig

    import reshard_core
    from reshard_core.extract import freshness
    from reshard_core.extract.freshness import pending_gathers
    from reshard_core.testing.megatron_forward import allow_cpu_forward, gpt_inputs
    from reshard_core.testing.models import build_gpt, build_pg_collection, init_megatron

    allow_cpu_forward()
    init_megatron()
    pgs = build_pg_collection(tp=1)
    model = build_gpt(pgs, **GPT)
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_param_gather=True, overlap_grad_reduce=True, bucket_size=2000
    )
    ddp = MegatronDDP(model.config, config, model, pg_collection=pgs)
    optimizer = _distributed_optimizer(ddp)
    dst = {key: build_gpt(pgs, seed=7, **GPT) for key in ("stale", "wrapper", "prepared", "bare", "list")}
    gathers = _count_gathers(ddp)
    facts: dict = {"groups": len(ddp.bucket_groups)}

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train_step(ddp, optimizer, seed=1)
    expected = _post_step(ddp)
    facts["changed_by_step"] = sum(not torch.equal(before[n], expected[n]) for n in expected) == len(expected)
    facts["pending_after_step"] = len(pending_gathers(ddp))
    facts["source_wrong_after_step"] = len(_wrong(model, expected))

    refresh = freshness.ParamGatherRefresher.refresh_source
    freshness.ParamGatherRefresher.refresh_source = lambda self: None  # the refit as it was before the fix
    try:
        reshard_core.refit(ddp, dst["stale"])
    finally:
        freshness.ParamGatherRefresher.refresh_source = refresh
    facts["stale_wrong"] = len(_wrong(dst["stale"], expected))
    facts["pending_after_stale_refit"] = len(pending_gathers(ddp))

    gathers[0] = 0
    reshard_core.refit(ddp, dst["wrapper"])
    facts["wrapper_wrong"] = _wrong(dst["wrapper"], expected)
    facts["gathers_by_refit"], facts["pending_after_refit"] = gathers[0], len(pending_gathers(ddp))
    with torch.no_grad():
        ddp(*gpt_inputs(2, 8, GPT["vocab_size"], seed=5, causal=True))
    reshard_core.refit(ddp, dst["wrapper"])
    facts["gathers_by_forward_and_refit_after"] = gathers[0] - facts["gathers_by_refit"]
    facts["wrong_after_forward"] = _wrong(model, expected) + _wrong(dst["wrapper"], expected)

    # A prepared session, and gathers left in flight by the step (as the ChainedOptimizer dispatches
    # them with overlap_param_gather_with_optimizer_step, optimizer.py:1247-1250).
    session = reshard_core.prepare(ddp, dst["prepared"])
    _train_step(ddp, optimizer, seed=2)
    expected = _post_step(ddp)
    facts["prepared_stale_before"] = len(_wrong(model, expected))
    ddp.start_param_sync(force_dispatch=True)
    facts["in_flight"] = sum(g.param_gather_handle is not None for g in ddp.bucket_groups)
    report = session.refit()
    facts["prepared_wrong"], facts["prepared_reused"] = _wrong(dst["prepared"], expected), report.reused_plan
    facts["pending_after_prepared"] = len(pending_gathers(ddp))

    _train_step(ddp, optimizer, seed=3)
    expected = _post_step(ddp)
    facts["bare_stale_before"] = len(_wrong(model, expected))
    reshard_core.refit(ddp.module, dst["bare"])  # the wrapper, reached through its pre-hook
    facts["bare_wrong"] = _wrong(dst["bare"], expected)

    _train_step(ddp, optimizer, seed=4)
    expected = _post_step(ddp)
    facts["list_stale_before"] = len(_wrong(model, expected))
    reshard_core.refit([ddp], dst["list"])
    facts["list_wrong"] = _wrong(dst["list"], expected)

    unreachable = DistributedDataParallel(torch.nn.Linear(2, 2)).module
    facts["refusal"] = outcome(lambda: reshard_core.refit(unreachable, torch.nn.Linear(2, 2)))
    reshard_core.clear_caches()
    return facts


@pytest.fixture(scope="module")
def results() -> list[dict]:
    pytest.importorskip("megatron.core")
    return run_world(_megatron_world, WORLD, timeout=400, pg_timeout=120)


def test_the_step_leaves_other_ranks_shards_stale(results):
    for facts in results:
        assert facts["groups"] == 2 and facts["changed_by_step"]
        assert facts["pending_after_step"] == 2 and facts["source_wrong_after_step"] > 0


def test_without_the_sync_the_destination_holds_stale_shards(results):
    for facts in results:
        assert facts["stale_wrong"] > 0 and facts["pending_after_stale_refit"] == 2


def test_refit_of_the_wrapper_equals_the_post_step_weights_bit_for_bit(results):
    for facts in results:
        assert facts["wrapper_wrong"] == [] and facts["pending_after_refit"] == 0


def test_each_pending_gather_runs_once(results):
    """The refit dispatches each pending group once; the next forward and a second refit none."""
    for facts in results:
        assert facts["gathers_by_refit"] == 2
        assert facts["gathers_by_forward_and_refit_after"] == 0 and facts["wrong_after_forward"] == []


def test_prepared_session_waits_for_gathers_in_flight(results):
    for facts in results:
        assert facts["prepared_stale_before"] > 0 and facts["in_flight"] == 2 and facts["prepared_reused"]
        assert facts["prepared_wrong"] == [] and facts["pending_after_prepared"] == 0


def test_bare_module_and_chunk_list_sources(results):
    for facts in results:
        assert facts["bare_stale_before"] > 0 and facts["bare_wrong"] == []
        assert facts["list_stale_before"] > 0 and facts["list_wrong"] == []


def test_refusal_is_raised_on_every_rank(results):
    for facts in results:
        assert facts["refusal"] == f"PlanError: ranks [0, 1]: {UNREACHABLE}"
