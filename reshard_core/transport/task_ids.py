"""Task ids: the number each submitted message carries (``CopyService.submit_send(..., task_id)``).

Both sides derive a message's id alike, and every message of a refit has its own, so a one-sided
transport can match a send to its receive by id. Anything else that moves messages over a
transport the way a refit does (``reshard bench``'s wire floor) numbers them the same way.
"""

from __future__ import annotations

_RANK_BITS = 20
_SEQ_BITS = 20


def message_task_id(batch: int, src_rank: int, dst_rank: int, seq: int = 0) -> int:
    """The task id of message ``seq`` from ``src_rank`` to ``dst_rank`` in ``batch``; the same on
    both sides and distinct for every message of a refit."""
    return (((batch << _SEQ_BITS) | seq) << (2 * _RANK_BITS)) | (src_rank << _RANK_BITS) | dst_rank
