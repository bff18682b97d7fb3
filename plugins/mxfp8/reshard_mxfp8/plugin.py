"""Hook module of reshard-mxfp8 (entry point ``reshard``: ``mxfp8``).

- ``reshard_extract_tensor``: a destination weight converted by ``make_mxfp8`` is reported with its
  original layout, ``tensor=None`` and ``source=<MXFP8Destination>``; using it as a refit source is an
  error. A DTensor param whose local tensor is a TE ``MXFP8Tensor``/``Float8Tensor`` (FSDP2 with TE
  quantized primary weights, duck-typed) is described by ``te_extract.extract_te_param``.
- ``reshard_transforms``: attaches one ``MXFP8ReshardTransform`` for a destination model holding
  MXFP8 destinations, claiming the patterns they were made with.
"""

from __future__ import annotations

import sys

from reshard_core import hookimpl

RESHARD_PLUGIN_API = 1


def unavailable_reason() -> str | None:
    """The pure-PyTorch MXFP8 format works everywhere; TE and FlashInfer are optional accelerators."""
    return None


@hookimpl
def reshard_extract_tensor(qualname, tensor, owner, model, side, context):
    """Specs for MXFP8 destinations and TE quantized DTensor params; None for anything else.

    Neither kind can exist before its module was imported, so a plain refit imports neither.
    """
    from reshard_core.extract import is_dtensor

    destinations = sys.modules.get(f"{__package__}.destinations")
    dest = None if destinations is None else getattr(tensor, destinations.MARKER, None)
    if dest is not None:
        from reshard_core import ExtractError, TensorSpec

        if side != "dst":
            raise ExtractError(
                f"tensor '{qualname}' is an MXFP8 destination (make_mxfp8) and cannot be a refit source"
            )
        return [TensorSpec(dest.meta, dest.layout, None, source=dest)]
    if not is_dtensor(tensor):
        return None
    from .te_extract import extract_te_param

    return extract_te_param(qualname, tensor, context)


@hookimpl
def reshard_transforms(model, specs):
    """An ``MXFP8ReshardTransform`` over the MXFP8 destinations among ``specs``, or None."""
    destinations = sys.modules.get(f"{__package__}.destinations")
    if destinations is None:  # no MXFP8 destination was ever made in this process
        return None
    from .transform import MXFP8ReshardTransform

    dests = {s.meta.name: s.source for s in specs if isinstance(s.source, destinations.MXFP8Destination)}
    if not dests:
        return None
    rules = list(dict.fromkeys(rule for d in dests.values() for rule in d.rules))
    return MXFP8ReshardTransform(rules=rules, destinations=dests)
