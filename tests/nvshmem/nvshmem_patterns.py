"""Message lists for schedule tests (and a hypothesis strategy of random small ones).

Realistic ones: a GPT-like model resharded between TP×DP layouts.

Ranks are ``dp * tp + tp_index`` (TP fastest, as Megatron orders them), colocated on one world.
Each logical tensor is sharded on one dim (column-parallel dim 0, row-parallel dim 1, gated fc1
with ``partition_stride=2``) or replicated. A destination rank takes a region locally when it holds
it on the source side, else from the source DP replica picked round-robin by (tensor, receiver),
like Megatron's refit. Tensors are grouped into batches; one packed message per (src, dst, batch),
the batch being the message's order index in its pair.
"""

from __future__ import annotations

from collections import defaultdict

from hypothesis import strategies as st
from reshard_nvshmem.schedule import Message, StagingConfig


def gpt_tensors(n_tensors: int, hidden: int = 1024, ffn: int = 2816, vocab: int = 32000, kv: int = 256):
    """``n_tensors`` (name, rows, cols, shard_dim or None, stride) records: embedding, then layers."""
    layer = [
        ("qkv", hidden + 2 * kv, hidden, 0, 1),
        ("proj", hidden, hidden, 1, 1),
        ("fc1", 2 * ffn, hidden, 0, 2),
        ("fc2", hidden, ffn, 1, 1),
        ("norm1", 1, hidden, None, 1),
        ("norm2", 1, hidden, None, 1),
    ]
    out = [("embedding", vocab, hidden, 0, 1)]
    i = 0
    while len(out) < n_tensors:
        name, rows, cols, dim, stride = layer[i % len(layer)]
        out.append((f"layers.{i // len(layer)}.{name}", rows, cols, dim, stride))
        i += 1
    return out


def holding(size: int, world: int, stride: int, index: int) -> list[tuple[int, int]]:
    """Intervals of a dim of ``size`` that TP rank ``index`` of ``world`` holds (Megatron stride)."""
    chunk = size // (world * stride)
    return [((index + k * world) * chunk, (index + k * world + 1) * chunk) for k in range(stride)]


def overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    return sum(max(0, min(a1, b1) - max(a0, b0)) for a0, a1 in a for b0, b1 in b)


def tp_dp_messages(
    world: int = 64,
    src_tp: int = 4,
    dst_tp: int = 8,
    n_tensors: int = 2000,
    itemsize: int = 2,
    batches: int = 4,
    **shape: int,
) -> list[Message]:
    """Messages of one refit from TP``src_tp`` × DP to TP``dst_tp`` × DP over ``world`` ranks;
    ``shape`` overrides ``gpt_tensors``' sizes (hidden, ffn, vocab, kv)."""
    src_dp, dst_dp = world // src_tp, world // dst_tp
    tensors = gpt_tensors(n_tensors, **shape)
    per_batch = -(-len(tensors) // batches)
    volume: dict[tuple[int, int, int], int] = defaultdict(int)
    for t, (_name, rows, cols, dim, stride) in enumerate(tensors):
        if dim is None:
            continue  # replicated on both sides: always a local copy
        size, other = (rows, cols) if dim == 0 else (cols, rows)
        for j in range(dst_tp):
            want = holding(size, dst_tp, stride, j)
            for i in range(src_tp):
                n = overlap(want, holding(size, src_tp, stride, i)) * other * itemsize
                if not n:
                    continue
                holders = [dp * src_tp + i for dp in range(src_dp)]
                for dst in range(j, world, dst_tp):
                    if dst in holders:
                        continue  # local copy
                    src = holders[(t + dst // dst_tp + dst) % src_dp]
                    volume[(src, dst, t // per_batch)] += n
    assert dst_dp  # layouts must tile the world
    orders: dict[tuple[int, int], int] = defaultdict(int)
    out = []
    for (src, dst, _batch), n in sorted(volume.items()):
        out.append(Message(src, dst, orders[(src, dst)], n))
        orders[(src, dst)] += 1
    return out


@st.composite
def transfer_sets(draw, align: int | None = None, min_piece: int | None = None):
    """``(messages, world, config)``: a few random messages between up to 6 ranks, tiny slots (at
    least one aligned region per possible sender)."""
    world = draw(st.integers(2, 6))
    align = align or draw(st.sampled_from([1, 16, 64]))
    cfg = StagingConfig(
        slot_bytes=align * draw(st.integers(world, 64)),
        slots=draw(st.integers(1, 3)),
        align=align,
        min_piece=min_piece or draw(st.sampled_from([1, 32, 100])),
    )
    counts: dict[tuple[int, int], int] = defaultdict(int)
    msgs = []
    rank = st.integers(0, world - 1)
    for src, dst, nbytes in draw(st.lists(st.tuples(rank, rank, st.integers(0, 3000)), max_size=16)):
        if src != dst:
            msgs.append(Message(src, dst, counts[(src, dst)], nbytes))
            counts[(src, dst)] += 1
    return msgs, world, cfg
