"""Which peers share this host: decided at set-up, through the group's store, and proven by a probe.

Three rounds through the store (``P2PCopyService.share``), no collective:

1. every rank says who it is: its host identity (hostname, kernel boot id and the ``host`` label of
   ``IpcOptions``), pid, pid namespace and the GPUs it sees (UUIDs, for CUDA IPC). Ranks with the
   same identity are candidates;
2. every rank with candidates creates its segment (a channel per candidate) and publishes its name
   and a random nonce;
3. every rank maps each candidate's segment, checks the nonce, and says which it could map. A pair
   shares memory when both of its ranks mapped the other's segment; every other pair is on
   different hosts for this transport (two containers of one machine without a shared ``/dev/shm``
   land here: found by the probe, not assumed). Then every creator unlinks its segment.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .channel import HEADER_BYTES, Channel
from .cuda_ipc import visible_gpus
from .options import IpcOptions
from .segment import Segment

NONCE_BYTES = 16


@dataclass(frozen=True)
class Peer:
    """A rank this one shares memory with: the channel to it (in our segment), the channel from it
    (in its segment) and, when it runs in our pid namespace, its pid (to notice it died)."""

    rank: int
    out: Channel
    inbound: Channel
    pid: int | None
    gpus: tuple[str, ...] = ()
    """The GPUs the peer sees (UUIDs): where a CUDA send to it can be handed over as a handle."""


@dataclass(frozen=True)
class Link:
    """What set-up found: ``peers`` by rank, the segments mapped (ours first, if any), and why a
    candidate of this host could not be reached through memory (``refused``)."""

    peers: dict[int, Peer]
    segments: tuple[Segment, ...]
    refused: dict[int, str]
    gpus: tuple[str, ...] = ()
    """The GPUs this process sees, by device index (UUIDs)."""


def identity(options: IpcOptions) -> str:
    """This process's host, as ranks compare it: hostname, boot id and the user's label."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}|{boot}|{options.host}"


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def connect(service: Any, serial: int, options: IpcOptions) -> Link:
    """Set up the shared-memory links of ``service`` (an ``IpcCopyService``); collective over its
    group's members, through its store. ``serial`` tells this transport apart from earlier ones."""
    gpus = visible_gpus() if options.cuda_ipc else []
    me = {"host": identity(options), "pid": os.getpid(), "pidns": _pid_namespace(), "gpus": gpus}
    who = {r: json.loads(v) for r, v in service.share(f"ipc/{serial}/who", json.dumps(me).encode()).items()}
    candidates = sorted(r for r, w in who.items() if r != service.rank and w["host"] == me["host"])

    own, nonce, problem = None, secrets.token_bytes(NONCE_BYTES), ""
    if candidates:
        try:
            own = Segment.create(HEADER_BYTES + len(candidates) * options.channel_bytes)
            own.data[:NONCE_BYTES].copy_(_bytes(nonce))
        except OSError as exc:  # /dev/shm missing or full: this rank's pairs use the fallback
            problem = f"rank {service.rank} could not create its segment: {exc}"
    mine = {"name": own.name if own else "", "nonce": nonce.hex(), "peers": candidates, "problem": problem}
    offers = {
        r: json.loads(v) for r, v in service.share(f"ipc/{serial}/segment", json.dumps(mine).encode()).items()
    }

    mapped: dict[int, Segment] = {}
    refused: dict[int, str] = {}
    for rank in candidates:
        offer = offers[rank]
        if not offer["name"]:
            refused[rank] = offer["problem"] or f"rank {rank} has no segment"
            continue
        try:
            segment = Segment.open(offer["name"])
        except OSError as exc:
            refused[rank] = f"cannot map rank {rank}'s segment: {exc.strerror or exc}"
            continue
        if bytes(segment.data[:NONCE_BYTES].tolist()) != bytes.fromhex(offer["nonce"]):
            segment.close()
            refused[rank] = f"rank {rank}'s segment name maps to another segment here"
            continue
        mapped[rank] = segment
    done = {
        r: json.loads(v)
        for r, v in service.share(f"ipc/{serial}/mapped", json.dumps(sorted(mapped)).encode()).items()
    }
    if own is not None:
        own.unlink()  # every candidate has mapped it or given up: nothing of ours stays in /dev/shm

    peers: dict[int, Peer] = {}
    for rank in candidates:
        if rank in mapped and service.rank not in done[rank]:
            refused[rank] = f"rank {rank} cannot map this rank's segment"
        if rank in refused:
            if rank in mapped:
                mapped.pop(rank).close()
            continue
        theirs = offers[rank]["peers"].index(service.rank)
        same_ns = who[rank]["pidns"] == me["pidns"] and bool(me["pidns"])
        peers[rank] = Peer(
            rank,
            Channel(
                own, _offset(candidates.index(rank), options), options.slots, options.slot_bytes, sending=True
            ),
            Channel(mapped[rank], _offset(theirs, options), options.slots, options.slot_bytes, sending=False),
            who[rank]["pid"] if same_ns else None,
            tuple(who[rank]["gpus"]),
        )
    if own is not None and not peers:  # no candidate could use it
        own.close()
        own = None
    segments = ((own,) if own is not None else ()) + tuple(mapped.values())
    return Link(peers, segments, refused, tuple(gpus))


def _offset(index: int, options: IpcOptions) -> int:
    return HEADER_BYTES + index * options.channel_bytes


def _bytes(raw: bytes):
    import torch

    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)
