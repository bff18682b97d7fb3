"""The floors a refit is measured against.

- The wire floor: the byte volumes a refit moves between each pair of ranks, sent as one message
  per pair over the same transport, with nothing else to do (no packing, no unpacking, no local
  copies). A refit's time divided by it says how much of it is overhead beyond moving its bytes.
  The same round with the plan's local-copy volume copied (one memcpy) while it is on the wire is a
  second, fuller floor: where ranks share few cores, local copies compete with the wire for them.
- The memcpy floor: every rank copies the bytes it receives and the bytes it copies locally, each
  as one memcpy, all ranks at once: what a same-host refit of these volumes could cost with one copy
  per byte and no transport at all (the floor a shared-memory transport is held to).
- The layout floor: the wire floor's round with, while it is on the wire, the copies the layouts
  force instead of one memcpy (``LayoutCopies``): local regions copied view to view, and every
  remote region that is strided on this rank's side copied once into or out of a contiguous buffer.
  The floors above copy contiguous bytes; a refit between these layouts cannot (a row-parallel
  weight's TP shards are column slices), so this one says how much of a refit's time over the
  +local floor is the layouts' and how much is the refit's own (per-tensor messages, the start and
  closing rounds, the model check).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from reshard_core import CopyService, OpKind, RankPlan, SplitView, TransferOp
from reshard_core.transport import message_task_id


def local_volume(plan: RankPlan) -> int:
    """Bytes this rank's plan copies locally per refit."""
    return sum(plan.bytes_of(op) for op in plan.ops if op.kind is OpKind.LOCAL)


def pair_volumes(plan: RankPlan) -> tuple[dict[int, int], dict[int, int]]:
    """``(sends, receives)``: bytes this rank's plan sends to / receives from each peer per refit."""
    sends: dict[int, int] = {}
    recvs: dict[int, int] = {}
    for op in plan.ops:
        if op.kind is OpKind.SEND:
            sends[op.peer] = sends.get(op.peer, 0) + plan.bytes_of(op)
        elif op.kind is OpKind.RECV:
            recvs[op.peer] = recvs.get(op.peer, 0) + plan.bytes_of(op)
    return sends, recvs


class WireFloor:
    """One preallocated, pre-touched buffer per peer and direction; ``run()`` moves them all in one
    round of ``transport`` (a collective with every peer of the plan), running ``during()`` while the
    round is on the wire: e.g. ``copy_local``, one memcpy of ``local`` bytes."""

    def __init__(
        self, transport: CopyService, rank: int, sends: dict[int, int], recvs: dict[int, int], local: int = 0
    ):
        self.transport = transport
        self.rank = rank
        self.sends = {peer: torch.ones(n, dtype=torch.uint8) for peer, n in sorted(sends.items())}
        self.recvs = {peer: torch.zeros(n, dtype=torch.uint8) for peer, n in sorted(recvs.items())}
        self.local_src = torch.ones(local, dtype=torch.uint8)
        self.local_dst = torch.zeros(local, dtype=torch.uint8)

    @property
    def nbytes(self) -> int:
        """Bytes this rank sends per round."""
        return sum(b.numel() for b in self.sends.values())

    def copy_local(self) -> None:
        """One memcpy of the plan's local-copy volume."""
        self.local_dst.copy_(self.local_src)

    def run(self, during: Callable[[], None] | None = None) -> None:
        for peer, buf in self.sends.items():
            self.transport.submit_send(buf, peer, message_task_id(0, self.rank, peer))
        for peer, buf in self.recvs.items():
            self.transport.submit_recv(buf, peer, message_task_id(0, peer, self.rank))
        flight = self.transport.start()
        if during is not None:
            during()
        flight.wait()


class LayoutCopies:
    """The copies a refit of ``plan`` cannot avoid on this rank, each once, in the access pattern
    the layouts impose: every LOCAL op view to view; every SEND op whose source region is strided
    into a contiguous buffer (a pack); every RECV op whose destination region is strided from one
    (an unpack). Contiguous remote regions need no copy (they can go on the wire as they lie).

    Reads come from ``src_tensors`` (the session's own); writes go to clones of the destination
    tensors (same shape and strides, so the same access pattern), never to the models."""

    def __init__(
        self,
        plan: RankPlan,
        src_tensors: Mapping[str, torch.Tensor | None],
        dst_tensors: Mapping[str, torch.Tensor | None],
    ) -> None:
        clones: dict[str, torch.Tensor | SplitView] = {}

        def target(name: str) -> torch.Tensor | SplitView:
            if name not in clones:
                clones[name] = _zeros_like(dst_tensors[name])
            return clones[name]

        def source(op: TransferOp) -> torch.Tensor:
            name = (plan.source_names or {}).get(op.name, op.name)  # a tied destination reads another name
            return _region(src_tensors[name], op.src_local, op.sizes, name)

        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for op in plan.ops:
            if op.kind is OpKind.LOCAL:
                self.copies.append((_region(target(op.name), op.dst_local, op.sizes, op.name), source(op)))
            elif op.kind is OpKind.SEND:
                src = source(op)
                if not src.is_contiguous():
                    self.copies.append((torch.zeros(op.sizes, dtype=src.dtype, device=src.device), src))
            else:
                dst = _region(target(op.name), op.dst_local, op.sizes, op.name)
                if not dst.is_contiguous():
                    self.copies.append((dst, torch.ones(op.sizes, dtype=dst.dtype, device=dst.device)))
        self.nbytes = sum(dst.numel() * dst.dtype.itemsize for dst, _ in self.copies)
        """Bytes copied per ``run()``."""

    @torch.no_grad()  # sources are Parameters that require grad, as a refit reads them
    def run(self) -> None:
        for dst, src in self.copies:
            dst.copy_(src)


def _region(
    tensor: torch.Tensor | SplitView, offsets: tuple[int, ...], sizes: tuple[int, ...], name: str
) -> torch.Tensor:
    """The view of the box at ``offsets`` of extent ``sizes`` in a local tensor (no copy);
    ``ValueError`` for a box of a split view that spans several of its blocks."""
    if isinstance(tensor, SplitView):
        view = tensor.region(offsets, sizes)
        if not isinstance(view, torch.Tensor):
            where = f"{name}'s region at {tuple(offsets)}"
            raise ValueError(f"the layout floor copies plain regions; {where} spans blocks of a split view")
        return view
    return tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]


def _zeros_like(tensor: torch.Tensor | SplitView) -> torch.Tensor | SplitView:
    """A zeroed tensor of ``tensor``'s shape, strides, dtype and device (a split view's base cloned)."""
    if isinstance(tensor, SplitView):
        return SplitView(_zeros_like(tensor.base), tensor.groups)
    out = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device)
    return out.zero_()


class MemcpyFloor:
    """Preallocated, pre-touched buffers for this rank's received and local volumes; ``run()`` copies
    each once."""

    def __init__(self, received: int, local: int) -> None:
        self.src = torch.ones(received + local, dtype=torch.uint8)
        self.dst = torch.zeros(received + local, dtype=torch.uint8)
        self.split = received

    def run(self) -> None:
        self.dst[: self.split].copy_(self.src[: self.split])
        self.dst[self.split :].copy_(self.src[self.split :])
