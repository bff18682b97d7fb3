"""Single-process tests of ``make_mxfp8`` and ``MXFP8ReshardTransform`` driven op by op (no process group).

The transform tests cut one weight into hand-made LOCAL ops (aligned and misaligned K ranges) and run
them through ``prepare_send`` → ``finalize_recv`` → ``finalize_tensor`` as the executor does; the
destination must then hold exactly ``quantize(full weight)`` in every form and mode.
"""

from __future__ import annotations

import pytest
import torch
from reshard_mxfp8 import (
    MXFP8ReshardTransform,
    dequantize,
    destinations_of,
    make_mxfp8,
    quantize,
    quantized_on_wire,
    swizzle_128x4,
)

from reshard_core.extract import ExtractError, extract_specs
from reshard_core.plan.ops import OpKind, TransferOp


def _model(out_features=96, in_features=64, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=True))
    return model.to(torch.bfloat16)


def _same(dest, full):
    data, scale = quantize(full)
    want_scale = swizzle_128x4(scale) if dest.swizzled else scale
    return (
        torch.equal(dest.data.view(torch.uint8), data)
        and torch.equal(dest.scale, want_scale)
        and torch.equal(dest.values(), dequantize(data, scale))
    )


@pytest.mark.parametrize("form", ["pair", "flashinfer"])
def test_make_mxfp8_replaces_the_weight_by_persistent_buffers_holding_its_quantization(form):
    model = _model()
    weight = model[0].weight.detach().clone()
    made = make_mxfp8(model, "*.weight", form=form)
    assert list(made) == ["0.weight"] and destinations_of(model) == made
    dest = made["0.weight"]
    assert "weight" not in model[0]._parameters and model[0].weight is dest.data
    assert dest.data.dtype == (torch.float8_e4m3fn if form == "flashinfer" else torch.uint8)
    assert dest.scale.dim() == (1 if form == "flashinfer" else 2)
    assert _same(dest, weight)
    specs = {s.meta.name: s for s in extract_specs(model, "dst")}
    assert specs["0.weight"].tensor is None and specs["0.weight"].source is dest
    assert specs["0.weight"].meta.shape == (96, 64) and specs["0.weight"].meta.dtype == torch.bfloat16
    assert specs["0.bias"].tensor is model[0].bias
    with pytest.raises(ExtractError) as err:
        extract_specs(model, "src")
    assert str(err.value) == (
        "tensor '0.weight' is an MXFP8 destination (make_mxfp8) and cannot be a refit source"
    )


def test_make_mxfp8_errors_name_the_problem():
    with pytest.raises(ValueError) as err:
        make_mxfp8(_model(), "*", form="nvfp4")
    assert str(err.value) == "unknown MXFP8 destination form 'nvfp4'; expected one of pair, flashinfer, te"
    with pytest.raises(ValueError) as err:
        make_mxfp8(_model(), "*", mode="both")
    assert str(err.value) == "unknown MXFP8 conversion mode 'both'; expected one of receiver, sender"
    with pytest.raises(ValueError) as err:
        make_mxfp8(_model(), "*.bias")
    assert str(err.value) == (
        "tensor '0.bias' cannot become an MXFP8 destination: its local shape (96,) needs ndim >= 2 "
        "and a last dim divisible by 32"
    )
    with pytest.raises(ValueError) as err:
        make_mxfp8(_model(in_features=48), "*.weight")
    assert "its local shape (96, 48) needs ndim >= 2" in str(err.value)


def test_the_te_form_without_transformer_engine_is_a_clear_error():
    from reshard_mxfp8.destinations import te_unavailable_reason

    if te_unavailable_reason() is None:
        pytest.skip("Transformer Engine is importable here")
    with pytest.raises(RuntimeError) as err:
        make_mxfp8(_model(), "*.weight", form="te")
    assert str(err.value).startswith(
        "MXFP8 destination form 'te' needs Transformer Engine: transformer_engine is not importable ("
    )


def _op(offsets, sizes):
    return TransferOp(OpKind.LOCAL, "0.weight", 0, offsets, sizes, offsets, offsets)


# a 96x128 weight cut into aligned (K multiple of 32) and misaligned (K ranges of 16/48) boxes
BOXES = [((0, 0), (40, 32)), ((40, 0), (56, 32)), ((0, 32), (96, 16)), ((0, 48), (96, 48)),
         ((0, 96), (96, 32))]  # fmt: skip


def test_the_wire_format_is_a_pure_function_of_mode_and_op():
    assert [quantized_on_wire("sender", _op(*b)) for b in BOXES] == [True, True, False, False, True]
    assert not any(quantized_on_wire("receiver", _op(*b)) for b in BOXES)


@pytest.mark.parametrize("form", ["pair", "flashinfer"])
@pytest.mark.parametrize("mode", ["receiver", "sender"])
def test_local_ops_through_the_transform_give_the_quantized_full_weight(form, mode):
    source = torch.randn(96, 128, dtype=torch.bfloat16) * torch.logspace(-3, 3, 128).to(torch.bfloat16)
    model = _model(96, 128, seed=1)
    dests = make_mxfp8(model, "*.weight", form=form, mode=mode)
    transform = MXFP8ReshardTransform("*.weight", mode=mode, destinations=dests)
    assert transform.should_transform("0.weight") and not transform.should_transform("0.bias")
    pointers = (dests["0.weight"].data.data_ptr(), dests["0.weight"].scale.data_ptr())
    for _ in range(2):
        held = transform.transient_bytes("0.weight")
        wire_bytes = 0
        for offsets, sizes in BOXES:
            op = _op(offsets, sizes)
            box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
            wire = transform.prepare_send("0.weight", op, source[box])
            assert [(tuple(t.shape), t.dtype) for t in wire] == [
                (tuple(t.shape), t.dtype) for t in transform.prepare_recv("0.weight", op)
            ]
            wire_bytes += sum(t.nbytes for t in wire)
            transform.finalize_recv("0.weight", op, wire)
        transform.finalize_tensor("0.weight")
        assert transform.transient_bytes("0.weight") == held
        assert _same(dests["0.weight"], source)
        assert (dests["0.weight"].data.data_ptr(), dests["0.weight"].scale.data_ptr()) == pointers
        source = source * 2
    aligned = 40 * 32 + 56 * 32 + 96 * 32
    expected = source.nbytes if mode == "receiver" else source.nbytes - aligned * 2 + aligned * (1 + 1 / 32)
    assert wire_bytes == expected
    if form == "flashinfer" and mode == "receiver":
        assert held == source.nbytes  # the whole-weight accumulator is announced up front
