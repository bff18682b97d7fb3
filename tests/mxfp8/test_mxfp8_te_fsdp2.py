"""TE quantized FSDP2 params (``te_extract``) as refit sources, with the CPU stand-in for TE's MXFP8Tensor.

Source (2-rank Gloo, ``fully_shard``): ``0.weight`` (128, 64) stays quantized (64-row shards of the
stand-in); ``1.weight`` (96, 128) splits into 48-row pieces, so the stand-in (like TE) falls back to
plain bf16 shards. Destinations: plain replicated BF16 weights (value-exact against
``dequantize(quantize(full))``), and MXFP8 ``make_mxfp8(..., mode="sender")`` (byte-exact for the
quantized param: TE planes shipped as they are). A second refit after overwriting the planes in place
checks ``refresh_source``. Also: missing rowwise plane (error, then opt-in), unit tests of swizzled /
unpadded scales and a Float8Tensor look-alike, and a GPU test against real TE.
"""

from __future__ import annotations

import pytest
import torch

from reshard_core.testing.world import run_world

SHAPES = ((128, 64), (96, 128))  # (out, in) of 0.weight and 1.weight
WORLD = 2


def _full(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(torch.bfloat16) for s in SHAPES]


def _plain_model(weights=None) -> torch.nn.Module:
    m = torch.nn.Sequential(*(torch.nn.Linear(k, n, bias=False) for n, k in SHAPES)).to(torch.bfloat16)
    for lin, w in zip(m, weights or (), strict=False):
        lin.weight.data.copy_(w)
    return m


def _fsdp_source(weights, *, rowwise=True, columnwise=False, model=None) -> torch.nn.Module:
    from te_standin import StandInMXFP8Tensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    m = model if model is not None else _plain_model()
    for lin, w in zip(m, weights, strict=True):
        q = StandInMXFP8Tensor.quantized(w, rowwise=rowwise, columnwise=columnwise)
        lin.weight = torch.nn.Parameter(q)
    mesh = init_device_mesh("cpu", (WORLD,))
    for lin in m:
        fully_shard(lin, mesh=mesh)
    return fully_shard(m, mesh=mesh)


def _overwrite(src, weights, rank) -> None:
    """Put the quantization of ``weights`` into the source params IN PLACE (planes or plain shards)."""
    from reshard_mxfp8 import dequantize, quantize
    from te_standin import StandInMXFP8Tensor, _copy_planes

    for lin, w in zip(src, weights, strict=True):
        local = lin.weight._local_tensor
        rows = -(-w.shape[0] // WORLD)
        piece = w[rank * rows : (rank + 1) * rows]
        if isinstance(local, StandInMXFP8Tensor):
            _copy_planes(local, StandInMXFP8Tensor.quantized(piece))
        else:
            local.copy_(dequantize(*quantize(piece)))


def _refit_bf16(rank, world):
    from reshard_mxfp8 import dequantize, quantize
    from te_standin import StandInMXFP8Tensor

    from reshard_core.api import clear_caches, refit

    src = _fsdp_source(_full(1))
    kinds = [type(lin.weight._local_tensor).__name__ for lin in src]
    assert kinds == ["StandInMXFP8Tensor", "Tensor"], kinds
    assert isinstance(src[0].weight._local_tensor, StandInMXFP8Tensor)
    dst = _plain_model()
    out = []
    for seed in (1, 2):
        if seed == 2:
            _overwrite(src, _full(2), rank)
        report = refit(src, dst)
        pairs = zip(dst, _full(seed), strict=True)
        ok = [torch.equal(lin.weight, dequantize(*quantize(w))) for lin, w in pairs]
        out.append((ok, report.bytes_sent))
    clear_caches()
    return out


@pytest.mark.slow
def test_te_fsdp2_to_bf16_value_exact_and_refreshed():
    results = run_world(_refit_bf16, WORLD)
    bf16_bytes = sum(n // WORLD * k * 2 for n, k in SHAPES)  # each rank sends its shard to the other
    assert bf16_bytes == 20480
    for per_refit in results:
        assert per_refit == [([True, True], bf16_bytes), ([True, True], bf16_bytes)]


def _refit_mxfp8(rank, world, ship_planes):
    import reshard_mxfp8.transform as transform_module
    from reshard_mxfp8 import configure_te_extraction, dequantize, destinations_of, make_mxfp8, quantize

    from reshard_core.api import clear_caches, refit

    shipped = []  # ops whose wire came straight from the TE planes (SEND and LOCAL)
    real = transform_module.te_wire_planes

    def counting(op, view):
        planes = real(op, view)
        shipped.append(planes is not None)
        return planes

    transform_module.te_wire_planes = counting
    previous = configure_te_extraction(ship_planes=ship_planes)
    src = _fsdp_source(_full(1))
    dst = _plain_model()
    make_mxfp8(dst, ["*.weight"], form="pair", mode="sender")
    out = []
    for seed in (1, 2):
        if seed == 2:
            _overwrite(src, _full(2), rank)
        report = refit(src, dst)
        dests = destinations_of(dst)
        checks = []
        for name, w in zip(("0.weight", "1.weight"), _full(seed), strict=True):
            data, scale = quantize(w)
            d = dests[name]
            rows, cols = w.shape[0], w.shape[1] // 32
            same_bytes = torch.equal(d.data.view(torch.uint8), data) and torch.equal(
                d.scale[:rows, :cols], scale[:rows, :cols]
            )
            checks.append((same_bytes, torch.equal(d.values(), dequantize(data, scale))))
        out.append((checks, report.bytes_sent, sum(shipped)))
        shipped.clear()
    clear_caches()
    configure_te_extraction(**previous)
    transform_module.te_wire_planes = real
    return out


@pytest.mark.slow
@pytest.mark.parametrize("ship_planes", [True, False])
def test_te_fsdp2_to_mxfp8_sender_byte_exact(ship_planes):
    results = run_world(_refit_mxfp8, WORLD, ship_planes)
    mx_bytes = sum(n // WORLD * (k + k // 32) for n, k in SHAPES)  # data + valid scale rows
    assert mx_bytes == 10560  # vs 20480 in BF16
    for per_refit in results:
        for checks, sent, shipped in per_refit:
            assert sent == mx_bytes
            # 0.weight: one SEND (to the other rank) and one LOCAL op per rank cut from the planes
            assert shipped == (2 if ship_planes else 0)
            if not ship_planes:  # requantized from the dequantized buffer: value-exact
                assert checks[0][1] is True and checks[1][1] is True
                continue
            # 0.weight (quantized shards): the TE planes themselves, byte-exact; 1.weight (plain bf16
            # fallback shards, requantized by the sender): value-exact (bytes may differ, mxfp8.md A.3)
            assert checks[0] == (True, True)
            assert checks[1][1] is True


def _missing_rowwise(rank, world):
    from reshard_mxfp8 import configure_te_extraction, dequantize, quantize

    from reshard_core.api import clear_caches, refit
    from reshard_core.errors import PlanError

    weights = [_full(1)[0]]
    src = _fsdp_source(weights, rowwise=False, columnwise=True, model=_plain_model()[:1])
    dst = _plain_model()[:1]
    try:
        refit(src, dst)
        message = None
    except PlanError as exc:  # every rank raises the same error, naming the ranks that found it
        message = str(exc)
    previous = configure_te_extraction(allow_columnwise=True)
    try:
        refit(src, dst)
    finally:
        configure_te_extraction(**previous)
        clear_caches()
    want = dequantize(*quantize(weights[0], columnwise=True), columnwise=True)
    return message, torch.equal(dst[0].weight, want)


@pytest.mark.slow
def test_te_fsdp2_missing_rowwise_plane_errors_unless_allowed():
    for message, ok in run_world(_missing_rowwise, WORLD):
        assert message == (
            "ranks [0, 1]: tensor '0.weight': TE MXFP8 param has no rowwise plane (only columnwise); "
            "rowwise values cannot "
            "be rebuilt exactly from it. Call reshard_mxfp8.configure_te_extraction(allow_columnwise=True) "
            "to accept columnwise-derived values"
        )
        assert ok


def test_te_source_swizzled_unpadded_scales_and_plane_slices():
    from reshard_mxfp8 import dequantize, quantize, swizzle_128x4
    from reshard_mxfp8.te_extract import TESource, te_wire_planes
    from te_standin import StandInMXFP8Tensor

    from reshard_core.plan.ops import OpKind, TransferOp

    w = _full(3)[0]
    data, scale = quantize(w)
    unpadded = StandInMXFP8Tensor(tuple(w.shape), (data, scale[:128, :2].clone()))
    swizzled = StandInMXFP8Tensor(tuple(w.shape), (data, swizzle_128x4(scale)), swizzled=True)
    for t in (unpadded, swizzled):
        src = TESource("w", t, "mxfp8", torch.empty(w.shape, dtype=torch.bfloat16))
        src.refresh_source()
        assert torch.equal(src.buffer, dequantize(data, scale))
        op = TransferOp(OpKind.SEND, "w", 1, (32, 32), (64, 32), (32, 32), (0, 0))
        planes = te_wire_planes(op, src.buffer[32:96, 32:64])
        assert torch.equal(planes[0], data[32:96, 32:64]) and torch.equal(planes[1], scale[32:96, 1:2])
        misaligned = TransferOp(OpKind.SEND, "w", 1, (0, 16), (64, 32), (0, 16), (0, 0))
        assert te_wire_planes(misaligned, src.buffer[:64, 16:48]) is None
    assert te_wire_planes(op, torch.empty(64, 32)) is None  # not a TE source


class _Float8LookAlike:
    """Fields of TE's ``Float8Tensor`` (per-tensor scale): enough for the duck-typed extractor."""

    def __init__(self, x: torch.Tensor, scale: float) -> None:
        self._data = (x.float() * scale).to(torch.float8_e4m3fn).view(torch.uint8)
        self._scale_inv = torch.tensor([1.0 / scale])
        self._fp8_dtype = "DType.kFloat8E4M3"
        self.device = x.device


def test_float8_lookalike_dequantizes_like_te():
    from reshard_mxfp8.te_extract import TESource, te_kind

    x = _full(4)[0]
    f8 = _Float8LookAlike(x, 16.0)
    assert te_kind(f8) == "float8"
    src = TESource("w", f8, "float8", torch.empty(x.shape, dtype=torch.bfloat16))
    src.refresh_source()
    want = (f8._data.view(torch.float8_e4m3fn).float() * (1.0 / 16.0)).to(torch.bfloat16)
    assert torch.equal(src.buffer, want)


def test_blockwise_fp8_and_nvfp4_are_refused_not_read_as_mxfp8():
    from reshard_mxfp8.te_extract import te_kind
    from te_standin import StandInFloat8BlockwiseQTensor, StandInMXFP8Tensor, StandInNVFP4Tensor

    from reshard_core.extract import ExtractError

    cases = [
        (StandInFloat8BlockwiseQTensor((256, 128)), "StandInFloat8BlockwiseQTensor"),
        (StandInFloat8BlockwiseQTensor((256, 128), two_d=True), "StandInFloat8BlockwiseQTensor"),
        (StandInNVFP4Tensor((256, 128)), "StandInNVFP4Tensor"),
    ]
    for t, type_name in cases:
        with pytest.raises(ExtractError) as err:
            te_kind(t, "layers.0.fc1.weight")
        assert str(err.value) == (
            f"tensor 'layers.0.fc1.weight': TE quantized tensor of type {type_name} is not supported; "
            f"reshard reads TE MXFP8Tensor and Float8Tensor params only (blockwise FP8 and NVFP4 scales "
            f"are not MXFP8)"
        )
    # TE's own class names decide before the fields: a class named like TE's blockwise tensor is refused
    blockwise = type("Float8BlockwiseQTensor", (), {"__module__": "transformer_engine.pytorch.tensor"})()
    blockwise._rowwise_scale_inv = blockwise._columnwise_scale_inv = torch.ones(1)
    with pytest.raises(ExtractError, match="type Float8BlockwiseQTensor is not supported"):
        te_kind(blockwise, "w")
    assert te_kind(StandInMXFP8Tensor.quantized(_full(6)[0])) == "mxfp8"
    assert te_kind(torch.ones(2)) is None


def _te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    # TE's MXFP8 quantizer needs Blackwell (SM100+)
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _te_available(), reason="needs Transformer Engine on SM100+")
def test_extractor_on_real_te_mxfp8_tensor():
    import transformer_engine.pytorch as te  # noqa: F401
    import transformer_engine_torch as tex
    from reshard_mxfp8 import dequantize, quantize
    from reshard_mxfp8.te_extract import TESource, te_kind
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

    w = _full(5)[0].cuda()
    q = MXFP8Quantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True)(w)
    assert te_kind(q) == "mxfp8"
    src = TESource("w", q, "mxfp8", torch.empty(w.shape, dtype=torch.bfloat16, device="cuda"))
    src.refresh_source()
    data, scale = quantize(w.cpu())
    assert torch.equal(src.buffer.cpu(), dequantize(data, scale))
    assert torch.equal(src.buffer, q.dequantize(dtype=torch.bfloat16))
    got_data, got_scale = src.rowwise_planes()
    assert torch.equal(got_data.cpu(), data) and torch.equal(got_scale.cpu(), scale[:128, :2])
