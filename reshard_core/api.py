"""The public refit API: ``refit``, ``prepare``, ``clear_caches`` and the ``RefitReport``.

One refit = extract specs from both models → exchange the compact layout table → plan this rank →
execute the plan over a transport. ``prepare`` does everything but the execution and caches the
result (a ``Session``); later refits whose models still look the same on every rank reuse it and
skip extraction, exchange and planning. "Look the same" is checked locally (``fingerprints``) and
agreed on by one tiny all-gather (``coordination.agree``), so a change on any rank makes every rank
rebuild (never a stale plan). ``Session.refit()`` runs a prepared session without walking the
models (each rank checks the tensors it was prepared with, and the ranks agree on one flag): the
fast path for a training loop that prepares once and refits after every step. A rank whose own
checks fail still joins the round and carries its error, so every rank raises it alike.

Where the rest lives: ``options`` (``RefitOptions``), ``session`` (``Session``), ``session_cache``
(the caches), ``preparation.pipeline`` (building a session), ``report`` (``RefitReport``).
"""

from __future__ import annotations

import time
from typing import Any, NoReturn

from . import session_cache
from .coordination import failures
from .coordination.agree import agree
from .coordination.refit_group import view_of
from .errors import ReshardError
from .exchange.option_digests import OPTION_NAMES, check_options, option_digests
from .fingerprints import Model, check_models, model_signature
from .formats import resolve_format
from .options import RefitOptions
from .plan.cache import clear_plan_cache
from .preparation.pipeline import build
from .preparation.sides import agreed_formats, format_code
from .report import RefitReport
from .session import Session

__all__ = ["RefitOptions", "RefitReport", "Session", "clear_caches", "prepare", "refit", "refuse_refit"]


def refit(
    src: Model, dst: Model, options: RefitOptions | None = None, *, version: Any = None, **choices: Any
) -> RefitReport:
    """Copy every weight of ``src`` into ``dst`` across their layouts, in place. Collective over ``group``.

    ``options``: a ``RefitOptions``; keyword ``choices`` (``transport=``, ``group=``, ``ignore=``,
    ``delta=``, … any field of ``RefitOptions``) replace its fields, so ``refit(src, dst,
    transport="nccl")`` and ``refit(src, dst, RefitOptions(transport="nccl"))`` are the same call.

    Either model may be None on a rank that only sends, only receives, or idles. After it returns,
    every destination element equals the source element at the same global coordinate (bit for bit
    when dtypes match; a transform defines its own format). ``cast=True`` accepts a source whose dtype
    differs from its destination's (e.g. an fp32 trainer's router ``expert_bias`` into a bf16 engine):
    the plan carries the destination dtype and the sender converts while packing, so only
    destination-dtype bytes cross the transport (every rank must pass the same ``cast``).
    A failing or vanished peer makes every rank raise ``TransportError`` within ``timeout`` seconds;
    a peer that raised an error of its own is named with that error as soon as it published it.

    Models in different formats (a Megatron-Core ``GPTModel`` and a transformers model, an HF model
    and an engine's fused, padded parameters) are refit through the logical (HF checkpoint) space:
    each side's format maps its parameters onto logical tensors, and only the slices each
    destination rank needs move. Formats are detected (or declared with
    ``reshard_core.declare_format``); ``src_format``/``dst_format`` override them. Models of one
    format (or of none) are refit by their own tensor names.

    ``version``: recorded on this rank's destination modules once all of their tensors landed, and
    read with ``reshard_core.weight_version(dst)`` (None while a refit runs and after one failed).

    ``verify=True`` checks every arrival: each sender checksums the bytes of each tensor slice it
    sends, each receiver recomputes the checksum from the destination region it wrote (a transformed
    tensor: from the received wire bytes) and local copies are checked source against destination;
    a mismatch raises ``ReshardError`` on every rank naming the tensors and the rank pair
    (``verify: rank 0 → rank 2: 1 tensor arrived different from what was sent: w``). Every rank
    must pass the same ``verify``. ``RefitReport.verified_bytes`` says what this rank checked.

    ``delta=True`` moves only what changed since the last refit each receiver confirmed it applied:
    each sender keeps a snapshot of what it sent (memory: the bytes it sends per refit) and sends
    the changed 16-bit words, about 1.3 bytes per changed BF16 element at 1 % density, or a message
    whole where that is smaller; receivers write only the changed words. The first delta refit, and
    any after a failed one, after a plan change or after anything else wrote the destinations, is
    full for the pairs concerned (``RefitReport.delta.note`` says why). The result is the same bit
    for bit. Every rank must pass the same ``delta``; see docs/delta.md.
    """
    start = time.perf_counter()
    o = RefitOptions.of(options, **choices)
    with failures.watched(o.group):
        session, reused = _session(src, dst, o)
        return session.report(session.run(o.cast, version), reused=reused, total=time.perf_counter() - start)


def prepare(src: Model, dst: Model, options: RefitOptions | None = None, **choices: Any) -> Session:
    """Build (or reuse) this rank's refit session. Collective over ``group`` (default: the world).
    ``options`` and keyword ``choices``: as for ``refit``.

    Raises ``PlanError`` on every rank, before any data moves, when the two sides do not match
    (unmatched names, shape or dtype disagreement, holes or double coverage); ``ignore`` (fnmatch
    patterns) and ``tied`` (``{dst_name: src_name}``, e.g. an untied output layer fed from the
    embedding) are the explicit opt-outs. ``src_format``/``dst_format`` (a ``ModelFormat`` or a
    registered name) override the detected model formats; see ``refit``. ``cast=True`` lets a
    source and its destination differ in dtype (see ``refit``). ``verify=True``: every refit of the
    session checks what arrived (see ``refit``). ``delta=True``: its refits move only what changed
    (see ``refit``).
    """
    o = RefitOptions.of(options, **choices)
    with failures.watched(o.group):
        return _session(src, dst, o)[0]


def refuse_refit(error: BaseException, options: RefitOptions | None = None, **choices: Any) -> NoReturn:
    """Take part in a refit that this rank cannot run, carrying ``error``: the rank joins the
    agreement round that the other ranks' ``refit`` opens, with its error, and every rank of the
    group (this one included) raises it alike, naming this rank, before any data moves. Use it when
    a rank's own preparation failed before it could call ``refit`` (its peers would otherwise wait
    out the timeout, and their abandoned collective would break the group for the next refit).
    ``options``/``choices``: the group, transport and timeout, as for ``refit``. Always raises."""
    o = RefitOptions.of(options, **choices)
    reason = error if isinstance(error, ReshardError) else ReshardError(f"{type(error).__name__}: {error}")
    with failures.watched(o.group):
        view_of(o.group)
        digests = (0,) * len(OPTION_NAMES)  # not compared: the error is raised first
        agreed = agree(False, False, False, (0, 0), digests, o.group, o.timeout, error=reason)
        with failures.raised_alike():
            agreed.raise_errors()
    raise reason  # raise_errors raised this rank's own error above; kept for the type checker


def clear_caches() -> None:
    """Forget prepared sessions and cached plans, and close cached transports."""
    session_cache.clear()
    clear_plan_cache()


def _session(src: Model, dst: Model, options: RefitOptions) -> tuple[Session, bool]:
    """``(session, reused)``: the cached session when every rank agrees it is still valid.

    This rank's own checks run first; an error they raise does not leave this rank out of the
    agreement round: it travels inside it, and every rank raises it alike."""
    o = options
    view_of(o.group)  # no group at all: nothing to agree over, and every rank finds that alike
    local = _LocalChecks()
    try:
        local.run(src, dst, o)
    except ReshardError as exc:
        local.error = exc
    agreed = agree(
        local.valid, src is not None, dst is not None, local.codes, local.digests, o.group, o.timeout,
        error=local.error,
    )  # fmt: skip
    with failures.raised_alike():  # from every rank's agreed values: every rank raises these
        agreed.raise_errors()
        check_options(agreed.digests)
        if o.max_batch_bytes is not None and (isinstance(o.max_batch_bytes, bool) or o.max_batch_bytes <= 0):
            raise ReshardError(
                f"max_batch_bytes must be a positive number of bytes or None, got {o.max_batch_bytes!r}"
            )
        if agreed.valid:
            return local.cached, True
        choice = agreed_formats(local.formats, agreed.codes, agreed.sides)
    session = build(src, dst, agreed.sides, o, choice, local.signature)
    if session.delta is not None and local.cached is not None:
        session.delta.origin = "the plan was rebuilt (a model's tensors or layout changed on some rank)"
    session_cache.remember(local.key, session)
    return session, False


class _LocalChecks:
    """What this rank finds on its own before the agreement round (``run`` may raise part-way; the
    defaults then stand for the fields it did not reach, and ``error`` says why)."""

    def __init__(self) -> None:
        self.error: ReshardError | None = None
        self.key: tuple = ()
        self.signature: tuple = ()
        self.cached: Session | None = None
        self.valid = False
        self.formats: tuple = (None, None)
        self.codes: tuple[int, int] = (0, 0)
        self.digests: tuple[int, ...] = (0,) * len(OPTION_NAMES)

    def run(self, src: Model, dst: Model, o: RefitOptions) -> None:
        self.digests = option_digests(o)
        check_models(src, dst)
        self.key = session_cache.session_key(src, dst, o)
        self.signature = (model_signature(src, "source"), model_signature(dst, "destination"))
        self.cached = session_cache.cached(self.key)
        self.formats = (resolve_format(src, o.src_format), resolve_format(dst, o.dst_format))
        self.codes = (format_code(self.formats[0]), format_code(self.formats[1]))
        self.valid = self.cached is not None and self.cached.built_for(src, dst, self.signature)
        if not self.valid:  # a cached session has its transport already
            session_cache.check_transport(o.transport)
