"""BF16 Megatron-Core GPT → persistent MXFP8 destinations through ``refit`` in a 4-rank Gloo world.

Per scenario (layout × form × mode): source built from seed 7, destination from seed 8 with its
linear/embedding weights turned into MXFP8 buffers by ``make_mxfp8``, and a reference built from seed
7 in the destination layout by Megatron itself. After each refit every MXFP8 destination must hold
exactly ``quantize(reference local weight)`` (data bytes, valid scale bytes, dequantized values), every
other weight must equal the reference bit for bit, and buffers keep their ``data_ptr``. Between the two
refits source and reference are doubled (every scale must change) and the buffers are scribbled on.

Layouts: TP2→TP4 (hidden 128: every slice block-aligned), TP4→TP1 (hidden 64: ``linear_proj`` arrives
in 16-column slices, exercising the BF16 fallback and the accumulator), and non-colocated TP2 on
ranks 0-1 → TP1 (×2 replicas) on ranks 2-3, where ranks 0-1 pass the transform themselves.
"""

from __future__ import annotations

import pytest
import torch

from reshard_core.testing.world import run_world

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow

WORLD = 4
PATTERNS = (
    "*linear_qkv.weight", "*linear_proj.weight", "*linear_fc1.weight", "*linear_fc2.weight",
    "output_layer.weight", "embedding.word_embeddings.weight",
)  # fmt: skip
LAYOUTS = {  # name: (source (tp, rank_offset, size), destination (tp, rank_offset, size), hidden)
    "tp2->tp4": ((2, 0, 4), (4, 0, 4), 128),
    "tp4->tp1": ((4, 0, 4), (1, 0, 4), 64),
    "tp2@01->tp1@23": ((2, 0, 2), (1, 2, 2), 128),
}
FORMS = ("pair", "flashinfer")
MODES = ("receiver", "sender")
SCENARIOS = [(lay, form, mode) for lay in LAYOUTS for form in FORMS for mode in MODES]


def _model(layout, seed, hidden):
    from reshard_core.testing.models import build_gpt, build_pg_collection

    tp, offset, size = layout
    pgs = build_pg_collection(tp, rank_offset=offset, size=size)
    return build_gpt(pgs, seed=seed, num_layers=1, hidden_size=hidden, dtype=torch.bfloat16)


def _check(dst, reference) -> list[str]:
    """Names whose destination differs from the reference (MXFP8 ones: from quantize(reference))."""
    from reshard_mxfp8 import dequantize, destinations_of, quantize, unswizzle_128x4, valid_scale_shape

    bad = []
    want = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    dests = destinations_of(dst)
    for name, dest in dests.items():
        data, scale = quantize(want[name].detach())
        rows, cols = valid_scale_shape(data.shape)
        got_scale = dest.scale
        if dest.swizzled:
            got_scale = unswizzle_128x4(got_scale, *scale.shape)
        ok = (
            torch.equal(dest.data.view(torch.uint8), data)
            and torch.equal(got_scale[:rows, :cols], scale[:rows, :cols])
            and torch.equal(got_scale, scale)  # padding stays zero
            and torch.equal(dest.values(), dequantize(data, scale))
        )
        if not ok:
            bad.append(name)
    for name, t in {**dict(dst.named_parameters()), **dict(dst.named_buffers())}.items():
        if name not in dests and not torch.equal(t, want[name]):
            bad.append(name)
    return sorted(bad)


def _pointers(dst):
    from reshard_mxfp8 import destinations_of

    return {n: (id(d), d.data.data_ptr(), d.scale.data_ptr()) for n, d in destinations_of(dst).items()}


def _scenario(rank, layout, form, mode):
    from reshard_mxfp8 import MXFP8ReshardTransform, destinations_of, make_mxfp8

    import reshard_core

    src_layout, dst_layout, hidden = LAYOUTS[layout]
    src = _model(src_layout, 7, hidden)
    dst = _model(dst_layout, 8, hidden)
    reference = _model(dst_layout, 7, hidden)
    plain = _model(dst_layout, 9, hidden) if (form, mode) == ("pair", "receiver") else None
    transform = None
    if dst is not None:
        made = make_mxfp8(dst, PATTERNS, form=form, mode=mode)
        assert set(made) == set(destinations_of(dst)) and len(made) == 6
    elif src is not None:
        transform = MXFP8ReshardTransform(PATTERNS, mode=mode)
    before = _pointers(dst) if dst is not None else {}
    first = reshard_core.refit(src, dst, transform=transform, timeout=60)
    after_first = _check(dst, reference) if dst is not None else []
    with torch.no_grad():
        for model in (src, reference):
            for t in model.parameters() if model is not None else ():
                t.mul_(2)
        for d in destinations_of(dst).values() if dst is not None else ():
            d.data.view(torch.uint8).fill_(0x55)
            index = d._scale_rows()  # the valid entries (positions in the 1-D swizzled layout)
            if d.swizzled:
                d.scale[index.reshape(-1)] = 3
            else:
                index.fill_(3)
    second = reshard_core.refit(src, dst, transform=transform, timeout=60)
    baseline = None
    if (form, mode) == ("pair", "receiver"):  # same layouts, no MXFP8: the plain BF16 wire
        baseline = reshard_core.refit(src, plain, timeout=60).bytes_sent
    out = {
        "after_first": after_first,
        "after_second": _check(dst, reference) if dst is not None else [],
        "pointers_kept": dst is None or before == _pointers(dst),
        "reused": second.reused_plan,
        "bytes": (first.bytes_sent, second.bytes_sent, baseline),
    }
    reshard_core.clear_caches()
    return out


def _world(rank: int, world: int) -> dict:
    from reshard_core.testing.models import init_megatron

    init_megatron()
    return {scenario: _scenario(rank, *scenario) for scenario in SCENARIOS}


@pytest.fixture(scope="module")
def results():
    return run_world(_world, WORLD, timeout=400, pg_timeout=120)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=["-".join(s) for s in SCENARIOS])
def test_mxfp8_destinations_equal_the_quantized_source_after_each_refit(results, scenario):
    for rank, out in enumerate(results):
        facts = out[scenario]
        assert facts["after_first"] == [], (rank, facts["after_first"])
        assert facts["after_second"] == [], (rank, facts["after_second"])
        assert facts["pointers_kept"], rank
        assert facts["reused"], rank


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sender_mode_puts_fewer_bytes_on_the_wire(results, layout):
    totals = {}
    for form in FORMS:
        for mode in MODES:
            sent = [out[(layout, form, mode)]["bytes"] for out in results]
            totals[form, mode] = sum(s[0] for s in sent)
            assert sum(s[1] for s in sent) == totals[form, mode]  # the second refit sends the same
    baseline = sum(out[(layout, "pair", "receiver")]["bytes"][2] for out in results)
    for form in FORMS:
        assert totals[form, "receiver"] == baseline  # receiver mode: the BF16 wire, unchanged
        assert totals[form, "sender"] < totals[form, "receiver"]
    print(f"\n{layout} bytes sent (all ranks): baseline {baseline}, {totals}")
