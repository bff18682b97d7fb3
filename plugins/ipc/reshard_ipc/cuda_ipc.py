"""CUDA IPC for the ``ipc`` transport: a CUDA send between ranks of one host is handed over as a
handle to the sender's own memory, and the receiver copies its bytes straight out of it (one
device copy; nothing goes through host memory).

The handle is torch's (``torch.multiprocessing.reductions``: a CUDA IPC memory handle plus torch's
reference counting, so the sender's block outlives the receiver's use of it), pickled into one slot
of the channel. GPUs are named by UUID: the sender's device index means nothing in a receiver that
sees other GPUs (``CUDA_VISIBLE_DEVICES``), so set-up tells each rank which GPUs its peers see
(``visible_gpus``), a sender hands over a handle only where the peer sees its GPU, and the
receiver opens it on its own index of that GPU.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import torch

_DEVICE_ARG = 6  # the storage's device index in ``reduce_tensor``'s arguments


def visible_gpus() -> list[str]:
    """UUIDs of the GPUs this process sees, by device index (none without CUDA)."""
    try:
        if not torch.cuda.is_available():
            return []
        return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    except Exception:  # a broken CUDA install: no CUDA IPC
        return []


def export(data: torch.Tensor, gpus: Sequence[str]) -> bytes:
    """The handle of ``data`` (CUDA bytes) for a receiver. Waits for the current stream first, so
    everything queued before the send has written ``data`` when the receiver reads it."""
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.current_stream(data.device).synchronize()
    _, args = reduce_tensor(data)
    return pickle.dumps((gpus[data.device.index], args))


def copy_out(blob: bytes, target: torch.Tensor, gpus: Sequence[str]) -> int:
    """Copy the sender's bytes named by ``blob`` into ``target`` (flat uint8, CUDA or CPU) and wait
    until the copy is done (the sender may reuse its memory once told); returns the bytes copied.
    ``gpus``: this process's ``visible_gpus()``."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuid, args = pickle.loads(blob)
    args: list[Any] = list(args)
    args[_DEVICE_ARG] = gpus.index(uuid)  # the sender's GPU as this process numbers it
    remote = rebuild_cuda_tensor(*args)
    if remote.numel() != target.numel():
        return remote.numel()
    with torch.cuda.device(remote.device):
        target.copy_(remote)
    for device in {remote.device, target.device}:  # done before the sender hears it may reuse it
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return remote.numel()
