"""The NVSHMEM side: lazy import, bootstrap from a torch.distributed group, symmetric slots and
signal words, and the ``StreamOps`` the engine drives (puts, signals and waits on two CUDA streams).

Nothing here imports nvshmem4py at module import time; ``load_nvshmem()`` does, once.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from reshard_core import TransportError

from .exchange import broadcast_bytes
from .schedule import StagingConfig
from .slots import SignalLedger

INSTALL_HINT = "nvshmem4py is not installed (pip install nvshmem4py-cu12)"


@functools.cache
def load_nvshmem() -> tuple[Any, str | None]:
    """``(nvshmem.core, None)``, or ``(None, one-line reason)`` when it cannot be imported."""
    try:
        return importlib.import_module("nvshmem.core"), None
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "nvshmem":
            return None, INSTALL_HINT
        return None, f"nvshmem4py failed to import: {exc}"
    except Exception as exc:  # a broken install must not break the plugin listing
        return None, f"nvshmem4py failed to import: {type(exc).__name__}: {' '.join(str(exc).split())}"


def _cuda_core() -> Any:
    """The cuda.core namespace that has ``Device``: ``cuda.core`` from 0.4 on, ``cuda.core.experimental``
    in 0.3 (the pinned version), where ``import cuda.core`` succeeds but has no ``Device``."""
    try:
        module = importlib.import_module("cuda.core")
        if hasattr(module, "Device"):
            return module
    except ImportError:
        pass
    return importlib.import_module("cuda.core.experimental")


class NvshmemRuntime:
    """Process-wide NVSHMEM bootstrap shared by every service (NVSHMEM has one PE set per process)."""

    users = 0
    owned = False
    ranks: tuple[int, ...] | None = None

    @classmethod
    def acquire(cls, nv: Any, group: dist.ProcessGroup | None) -> None:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        ranks = tuple(dist.get_global_rank(group or dist.group.WORLD, g) for g in range(size))
        if cls.users and ranks != cls.ranks:
            raise TransportError(f"NVSHMEM already runs over ranks {cls.ranks}; this group is {ranks}")
        if not cls.users:
            if _is_initialised(nv):  # initialised by the application: use it, never finalize it
                if (nv.my_pe(), nv.n_pes()) != (rank, size):
                    raise TransportError(
                        f"NVSHMEM was initialised elsewhere as PE {nv.my_pe()} of {nv.n_pes()}, "
                        f"but this rank is {rank} of {size} in the transport's group"
                    )
                cls.owned = False
            else:
                _init_from_group(nv, group, rank, size)
                cls.owned = True
            cls.ranks = ranks
        cls.users += 1

    @classmethod
    def release(cls, nv: Any) -> None:
        cls.users -= 1
        if not cls.users and cls.owned:
            cls.owned, cls.ranks = False, None
            nv.finalize()


def _is_initialised(nv: Any) -> bool:
    """Whether the application already initialised NVSHMEM in this process."""
    try:
        nv.get_version()  # loads the host library, which the status query needs
        status = nv.init_status()
    except Exception:
        return False
    return _status_code(status) in _INITIALISED


# nvshmemx_init_status_t: NOT_INITIALIZED 0, IS_BOOTSTRAPPED 1, IS_INITIALIZED 2, LIMITED_MPG 3, FULL_MPG 4
_INITIALISED = frozenset({2, 3, 4})
_STATUS_NAMES = {"STATUS_IS_INITIALIZED": 2, "STATUS_LIMITED_MPG": 3, "STATUS_FULL_MPG": 4}


def _status_code(status: Any) -> int | None:
    """``nvshmem.core.init_status()`` as the C enum's int: nvshmem4py returns a plain int; an enum
    (``.value`` / ``.name``) is accepted too."""
    if isinstance(status, int):
        return int(status)
    value = getattr(status, "value", None)
    if isinstance(value, int):
        return value
    return _STATUS_NAMES.get(getattr(status, "name", None))


def _init_from_group(nv: Any, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
    """UID bootstrap: rank 0 creates the unique id, the group broadcasts its bytes (no pickle)."""
    import numpy as np

    uid = nv.get_unique_id(empty=rank != 0)
    raw = np.asarray(uid._data).view(np.uint8)  # the id struct's bytes, aliased
    raw[:] = np.frombuffer(broadcast_bytes(raw.tobytes() if rank == 0 else None, raw.nbytes, group), np.uint8)
    device = _cuda_core().Device(torch.cuda.current_device())
    device.set_current()
    nv.init(device=device, uid=uid, rank=rank, nranks=size, initializer_method="uid")


class SymmetricStaging:
    """This PE's receive slots and signal words (``arrivals[slots]`` then ``credits[n_pes]``), and
    the engine's ``StreamOps`` on them. Construction and ``free()`` are collective.

    Memory, init and free go through ``nvshmem.core``; the per-piece calls go straight to
    ``nvshmem.bindings`` (nvshmem4py's 1:1 mirror of the C API) with raw pointers and stream
    handles, which spares a run thousands of Python ``Buffer`` objects and checks."""

    def __init__(self, nv: Any, config: StagingConfig, group: dist.ProcessGroup | None):
        self.nv, self.config, self.group = nv, config, group
        self.me, n_pes = dist.get_rank(group), dist.get_world_size(group)
        self.device = torch.device("cuda", torch.cuda.current_device())  # where tensors must live
        self._c = importlib.import_module("nvshmem.bindings")
        self._add, self._ge = int(nv.SignalOp.SIGNAL_ADD), int(nv.ComparisonType.CMP_GE)
        self.slot_bufs = [nv.buffer(config.slot_bytes) for _ in range(config.slots)]
        self.signal_buf = nv.buffer(8 * (config.slots + n_pes))
        self._slot_ptrs = [int(b.handle) for b in self.slot_bufs]
        self._signals = int(self.signal_buf.handle)
        self.slot_views = [_as_bytes(b) for b in self.slot_bufs]
        self.signal_view = _as_bytes(self.signal_buf).view(torch.int64)
        self.signal_view.zero_()
        torch.cuda.synchronize()
        dist.barrier(group=group)  # every PE zeroed its words before anyone signals into them
        self.ledger = SignalLedger(config.slots)
        self.recv_stream = torch.cuda.Stream()
        self._sends: dict[int, torch.cuda.Stream] = {}  # one stream per receiver, made on first use
        self._active: list[torch.cuda.Stream] = []

    def _send(self, peer: int) -> int:
        if peer not in self._sends:
            self._sends[peer] = torch.cuda.Stream()
        stream = self._sends[peer]
        if stream not in self._active:  # first use in this run: order it after the caller's work
            stream.wait_stream(torch.cuda.current_stream())
            self._active.append(stream)
        return stream.cuda_stream

    def _word(self, index: int) -> int:
        return self._signals + 8 * index

    # StreamOps --------------------------------------------------------------------------------
    def grant(self, peer: int) -> None:
        word = self._word(self.config.slots + self.me)
        self._c.signal_op_on_stream(word, 1, self._add, peer, self.recv_stream.cuda_stream)

    def wait_credit(self, peer: int, value: int) -> None:
        word = self._word(self.config.slots + peer)
        self._c.signal_wait_until_on_stream(word, self._ge, value, self._send(peer))

    def put(self, peer: int, src: torch.Tensor, slot: int, offset: int) -> None:
        dst = self._slot_ptrs[slot] + offset
        self._c.putmem_signal_on_stream(
            dst, src.data_ptr(), src.numel(), self._word(slot), 1, self._add, peer, self._send(peer)
        )

    def wait_arrival(self, slot: int, value: int) -> None:
        self._c.signal_wait_until_on_stream(self._word(slot), self._ge, value, self.recv_stream.cuda_stream)

    def unpack(self, slot: int, pieces: Sequence[tuple[torch.Tensor, int]]) -> None:
        view = self.slot_views[slot]
        with torch.cuda.stream(self.recv_stream):  # one fused launch for the round's pieces
            torch._foreach_copy_([dst for dst, _ in pieces], [view[o : o + dst.numel()] for dst, o in pieces])

    # run boundaries ---------------------------------------------------------------------------
    def begin(self) -> None:
        """Our streams start after the caller's pending work on the tensors (send streams when
        first used in the run)."""
        self.recv_stream.wait_stream(torch.cuda.current_stream())
        self._active = []

    def end(self) -> list[torch.cuda.Event]:
        """Events recorded after the run's operations on the receive stream (first) and on every send
        stream it used: its completion, held by the run's handle, since the next run's ``begin()``
        forgets these streams while this run may still be in flight."""
        events = []
        for stream in (self.recv_stream, *self._active):
            events.append(torch.cuda.Event())
            events[-1].record(stream)
        return events

    def finish(self, timeout: float, events: list[torch.cuda.Event]) -> None:
        """Return once ``events`` (``end()``'s) completed, or raise naming what is missing after
        ``timeout`` s; the caller's stream is then ordered after the run's unpacks."""
        deadline = time.monotonic() + timeout
        while not all(e.query() for e in events):
            if time.monotonic() > deadline:
                raise TransportError(f"nvshmem run timed out after {timeout:.0f} s: {self.stalled()}")
            time.sleep(0.0005)
        torch.cuda.current_stream().wait_event(events[0])  # not the stream: a later run may be on it

    def stalled(self) -> str:
        """Which signals are short of what this rank's ledger expects."""
        words = self.signal_view.cpu().tolist()
        slots = self.config.slots
        arrivals = enumerate(self.ledger.arrivals)
        late = [f"slot {j} has {words[j]} of {n} pieces" for j, n in arrivals if words[j] < n]
        world = self.group or dist.group.WORLD
        late += [
            f"rank {dist.get_global_rank(world, p)} freed {words[slots + p]} of {n} slots"
            for p, n in sorted(self.ledger.credits.items())
            if words[slots + p] < n
        ]
        return "; ".join(late) or "no signal is short (a stream is stuck elsewhere)"

    def free(self) -> None:
        """Release the symmetric memory (collective)."""
        torch.cuda.synchronize()
        for buf in (*self.slot_bufs, self.signal_buf):
            self.nv.free(buf)
        self.slot_bufs, self.slot_views, self.signal_view = [], [], None


def _as_bytes(buf: Any) -> torch.Tensor:
    return torch.utils.dlpack.from_dlpack(buf).view(torch.uint8)
