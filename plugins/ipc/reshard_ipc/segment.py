"""POSIX shared-memory segments: created by one rank, mapped by its peers on the same host, and
unlinked as soon as every peer has mapped it (the memory lives on while mapped, and nothing is left
in ``/dev/shm`` however the processes end later).

Between creation and that unlink a creator can still die (SIGKILL). Names carry the creator's pid
(``reshard-ipc-<pid>-<token>``), and every creation first removes the segments of creators that are
gone from this pid namespace (``sweep``); a normal exit unlinks what is still linked (``atexit``).
"""

from __future__ import annotations

import atexit
import mmap
import os
import secrets
from pathlib import Path

import torch

PREFIX = "reshard-ipc-"
SHM_DIR = Path("/dev/shm")
_linked: set[str] = set()  # names this process created and has not unlinked yet


class Segment:
    """A mapped segment: ``data`` is all of it as a flat uint8 tensor, ``words`` as int64s
    (memoryview, for the counters: one aligned 8-byte store or load each)."""

    def __init__(self, name: str, region: mmap.mmap, created: bool) -> None:
        self.name = name
        self.size = len(region)
        self.created = created
        self._map = region
        self.data = torch.frombuffer(region, dtype=torch.uint8)
        self.words = memoryview(region).cast("q")

    @classmethod
    def create(cls, size: int) -> Segment:
        """A new segment of ``size`` bytes, its memory reserved now (so a full ``/dev/shm`` raises
        ``OSError`` here, not SIGBUS on first touch)."""
        import _posixshmem

        sweep()
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        _linked.add(name)
        try:
            os.ftruncate(fd, size)
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            region = mmap.mmap(fd, size)
        except BaseException:
            unlink(name)
            raise
        finally:
            os.close(fd)
        return cls(name, region, created=True)

    @classmethod
    def open(cls, name: str) -> Segment:
        """Map the segment ``name`` another process created (``OSError`` when this host has none)."""
        import _posixshmem

        if not name.startswith(PREFIX) or "/" in name:
            raise OSError(f"not an ipc segment name: {name!r}")
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0o600)
        try:
            region = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return cls(name, region, created=False)

    def unlink(self) -> None:
        """Remove the name (the memory stays mapped where it is); only the creator does."""
        if self.created:
            unlink(self.name)

    def close(self) -> None:
        """Unmap, once nothing views the memory any more (else the mapping ends with the process)."""
        self.unlink()
        self.words.release()
        self.data = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a tensor still views it
            pass


def unlink(name: str) -> None:
    """Remove segment ``name`` if it still exists."""
    import _posixshmem

    _linked.discard(name)
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


def sweep() -> list[str]:
    """Unlink the segments whose creator is no longer running in this pid namespace; their names."""
    if not SHM_DIR.is_dir():
        return []
    removed = []
    for path in SHM_DIR.glob(PREFIX + "*"):
        pid = path.name[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not alive(int(pid)):
            unlink(path.name)
            removed.append(path.name)
    return removed


def alive(pid: int) -> bool:
    """Whether process ``pid`` of this pid namespace runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def ours() -> list[str]:
    """Names in ``/dev/shm`` that belong to this transport (any creator)."""
    return sorted(p.name for p in SHM_DIR.glob(PREFIX + "*")) if SHM_DIR.is_dir() else []


@atexit.register
def _unlink_remaining() -> None:
    for name in list(_linked):
        unlink(name)
