"""A round of small tensors outside the plan's batches (verify's digests, delta's confirm and
announce rounds): one message per peer and direction, tagged past the last batch."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import TransportError
from ..transport.copy_service import CopyService
from ..transport.task_ids import message_task_id


def side_round(
    transport: CopyService,
    rank: int,
    index: int,
    sends: Mapping[int, torch.Tensor],
    recvs: Mapping[int, torch.Tensor],
    what: str,
) -> None:
    """Send ``sends[peer]`` to each of its peers and receive into ``recvs[peer]`` from each of its,
    in one round of ``transport``, tagged as batch ``index`` (every peer must use the same index for
    the round). A failure is a ``TransportError`` prefixed ``rank R, <what>: ``."""
    for peer, buffer in recvs.items():
        transport.submit_recv(buffer, peer, message_task_id(index, peer, rank))
    for peer, tensor in sends.items():
        transport.submit_send(tensor, peer, message_task_id(index, rank, peer))
    try:
        transport.start().wait()
    except TransportError as exc:
        raise TransportError(f"rank {rank}, {what}: {exc}") from exc


def exchange_device(transport: CopyService) -> torch.device:
    """Where the digest tensors travel on ``transport``: the current GPU for a CUDA-only one."""
    if transport.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
