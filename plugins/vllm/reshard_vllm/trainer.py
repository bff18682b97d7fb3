"""The trainer side: vLLM's ``TrainerWeightTransferEngine`` for backend ``"reshard"``.

On every trainer rank::

    info = ReshardTrainerInitInfo("10.0.0.1", 29600, trainer_world_size, rank=rank)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
    engine.send_weights()          # after every optimizer step

``source`` is anything ``reshard_core.refit`` accepts as a source (a Megatron-Core ``GPTModel`` under
any TP/PP/EP, an FSDP2 or DTensor transformers model, a plain module, a list of pipeline chunks),
bare or wrapped in vLLM's ``ModuleSource``. Rank 0 hosts the transfer group's store and drives the
engine through ``client`` (``HTTPVLLMWeightSyncClient``, ``RayVLLMWeightSyncClient``, or
``LLMClient`` for an offline ``LLM``); vLLM's control calls block until the workers are done, so
rank 0 issues them on a side thread while it sends its own slices. Each rank sends only the slices
the workers hold; nothing is gathered.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import reshard_core
from reshard_core import MissingDependency, ReshardError

from .plugin import INSTALL_VLLM
from .verdict import SUPERSEDED_KEY, Verdict, agree, failed, ok
from .vllm_private import wrapped_module

try:
    from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine
except ModuleNotFoundError as exc:
    raise MissingDependency(__name__, "vllm", INSTALL_VLLM) from exc


@dataclass
class ReshardTrainerInitInfo(TrainerInitInfo):
    """Where the transfer group meets (rank 0 hosts it) and how many trainer ranks there are."""

    backend: ClassVar[str] = "reshard"
    master_address: str
    master_port: int
    trainer_world_size: int
    timeout: float = 60.0
    transport: str = "gloo"


PAUSE_MODES = ("wait", "abort", "keep")
"""vLLM's ``/pause`` modes (``send_weights(pause=...)``); None does not pause."""


class ReshardTrainerWeightTransferEngine(TrainerWeightTransferEngine[ReshardTrainerInitInfo]):
    """Sends one trainer rank's slices to the vLLM workers that hold them.

    Every outcome is agreed by the trainer's ranks (small rounds through the transfer group's store,
    hosted by rank 0): ``trainer_init`` and ``send_weights`` return on every rank or raise on every
    rank, with the first failure's text (a rank's own error, the engine's reply, a rank that died)."""

    init_info_cls = ReshardTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.model = model_of(source)
        self.info: ReshardTrainerInitInfo | None = None
        self.group: reshard_core.TransferGroup | None = None
        self.last: Verdict | None = None
        """Every rank's outcome of the last ``send_weights`` (bytes each worker received)."""
        self.report: reshard_core.RefitReport | None = None
        """This rank's ``RefitReport`` of the last ``send_weights`` (None when its refit failed)."""

    @classmethod
    def trainer_init(
        cls, init_info: ReshardTrainerInitInfo, *, client: Any, source: Any = None
    ) -> ReshardTrainerWeightTransferEngine:
        """Join the transfer group with the engine's workers (collective over the trainer ranks; rank 0
        also asks the engine to join; a newer trainer's init takes the engine over from an older
        one). Raises ``ReshardError`` on every trainer rank, naming what failed on either side."""
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.info = init_info
        worker_info = {
            "master_address": init_info.master_address,
            "master_port": init_info.master_port,
            "trainer_world_size": init_info.trainer_world_size,
            "timeout": init_info.timeout,
            "transport": init_info.transport,
        }
        with _Background(
            client.init_weight_transfer_engine if engine.is_sender else None, worker_info, init_info.timeout
        ) as call:
            try:
                engine.group = reshard_core.TransferGroup.join(
                    init_info.master_address, init_info.master_port, rank=init_info.rank, size=None,
                    job_ranks=range(init_info.trainer_world_size), timeout=init_info.timeout,
                )  # fmt: skip
            except ReshardError as exc:
                call.wait()  # the engine's own error names the cause (a worker that failed to join)
                note = call.failure_note()
                if getattr(exc, "refusal", ""):  # the engine refused, and said why: once is enough
                    note = ""
                raise ReshardError(f"reshard: trainer_init failed: {exc}{note}") from exc
            call.wait()
        mine = call.outcome("init_weight_transfer_engine")
        if engine.is_sender and not mine:  # a trainer that died while the engine was paused left it so
            mine = _attempt(_Pauser.of(client).resume, "resume")
        try:
            engine._agree_trainers(mine, "trainer_init")
        except ReshardError:
            engine.shutdown()
            raise
        return engine

    def send_weights(
        self,
        version: str | None = None,
        *,
        delta: bool = False,
        cast: bool = False,
        pause: str | None = "wait",
        ignore: Sequence[str] = (),
    ) -> Verdict:
        """Refit the engine from ``source``: every trainer rank sends its slices, the workers apply the
        update together or keep their previous weights together. Returns every rank's outcome;
        raises ``ReshardError`` on every trainer rank when any rank (trainer or worker) failed.

        ``version`` is recorded by the engine together with the new weights (``/weight_info``).
        ``delta=True`` sends only what changed since the last update each worker confirmed
        (``reshard_core.refit(..., delta=True)``). ``cast=True`` converts each tensor to the
        engine's dtype on the way (vLLM's CPU backend serves an fp32 checkpoint as bf16).
        ``pause``: how rank 0 pauses generation while the engine applies the update (the weights
        arrive while generation goes on; they change only in ``finish_weight_update``), in vLLM's
        ``/pause`` modes: ``"wait"`` (default) lets the requests in flight finish on the old weights
        and queues new ones until the update is applied, so no completion mixes two models;
        ``"abort"`` ends the requests in flight at once; ``"keep"`` freezes them and continues them
        on the new weights (no request is lost, but their tokens come from both models); None does
        not pause (requests in flight may mix the two models). ``ignore``: names (fnmatch patterns) of
        tensors that either side has and the other side's format does not map, left out of the update
        on both sides (``refit(..., ignore=...)``; a tensor the engine needs stays an error). Every
        trainer rank passes the same arguments."""
        if self.group is None or self.info is None:
            raise ReshardError(
                "reshard: send_weights() before trainer_init(); initialise the transfer engine first"
            )
        if pause is not None and pause not in PAUSE_MODES:
            modes = ", ".join(PAUSE_MODES)
            raise ReshardError(f"reshard: pause must be one of {modes} or None, got {pause!r}")
        if isinstance(ignore, str) or not all(isinstance(name, str) for name in ignore):
            raise ReshardError(f"reshard: ignore must be a list of tensor names or patterns, got {ignore!r}")
        start = time.perf_counter()
        self.report = None
        pauser = _Pauser.of(self.client) if self.is_sender else None
        ready = self._superseded() or (pauser.refusal(pause) if pauser is not None else "")
        self._agree_trainers(ready, "start of the update")  # nothing touched yet
        started = False
        try:
            mine = _attempt(self.client.start_weight_update, "start_weight_update") if self.is_sender else ""
            started = self.is_sender and not mine
            self._agree_trainers(mine, "start_weight_update")
            started = False  # from here on the engine closes a failed update itself (rpc_guard)
            verdict = self._transfer(version, delta, cast, tuple(ignore))
            self._apply(version, pauser, pause)
        finally:
            if started:  # the other ranks failed: close the update rank 0 opened
                _attempt(lambda: self.client.finish_weight_update(None), "finish_weight_update")
        verdict.seconds = time.perf_counter() - start
        return verdict

    def _apply(self, version: str | None, pauser: _Pauser | None, pause: str | None) -> None:
        """Rank 0 has the engine apply the update every worker received (``finish_weight_update``),
        inside a pause of generation; every trainer rank then agrees on how that went."""
        mine = ""
        if pauser is not None:
            paused = False
            if pause is not None:
                mine = _attempt(lambda: pauser.pause(pause), "pause")
                paused = not mine
            if not mine:
                mine = _attempt(lambda: self.client.finish_weight_update(version), "finish_weight_update")
            if paused:
                mine = _attempt(pauser.resume, "resume") or mine
        self._agree_trainers(mine, "end of the update")

    def _transfer(self, version: str | None, delta: bool, cast: bool, ignore: tuple[str, ...]) -> Verdict:
        """The refit and its verdict round, with rank 0's ``update_weights`` call alongside."""
        control = self.client.update_weights if self.is_sender else None
        update = {"version": version, "delta": delta, "cast": cast, "ignore": list(ignore)}
        # a failing worker answers after its refit timed out and its verdict round did: wait that long
        with _Background(control, update, 2 * self.info.timeout + 10) as call:
            mine = ok()
            try:
                self.report = reshard_core.refit(
                    self.model, None, group=self.group, transport=self.info.transport,
                    timeout=self.info.timeout, delta=delta, cast=cast, ignore=ignore,
                )  # fmt: skip
            except Exception as exc:
                mine = failed(exc)
            self.last = verdict = agree(self.group, mine, what="vLLM weight update")
            call.wait()
        if verdict.failures:  # the engine closed the update on every worker (rpc_guard)
            raise ReshardError(self._superseded() or verdict.message())
        self._agree_trainers(call.outcome("update_weights"), "update_weights")
        return verdict

    def _superseded(self) -> str:
        """The error text when a newer trainer's init took the engine over, else ""."""

        def read(store: Any) -> str:
            return store.get(SUPERSEDED_KEY).decode() if store.check([SUPERSEDED_KEY]) else ""

        try:
            by = self.group.ask_store(read)
        except Exception:  # the store is gone or stalled: the next round names its host
            return ""
        if not by:
            return ""
        return (
            f"reshard: superseded by a newer trainer (its group meets at {by}); this job can no longer "
            "update the engine"
        )

    def _agree_trainers(self, mine: str, what: str) -> None:
        """Raise on every trainer rank when any of them failed (``mine``: this rank's error, or "")."""
        texts = self.group.gather_text(mine, what=f"vLLM {what}", ranks=range(self.info.trainer_world_size))
        failures = [(rank, text) for rank, text in enumerate(texts) if text]
        if failures:
            rank, text = failures[0]
            raise ReshardError(f"{text} (trainer rank {rank})")

    def shutdown(self) -> None:
        """Leave the transfer group (the engine leaves it when the next trainer initialises)."""
        if self.group is not None:
            self.group.close()
        self.group = None


def model_of(source: Any) -> Any:
    """The model behind ``source``: a module (or list of pipeline chunks), or vLLM's ``ModuleSource``."""
    if source is None:
        raise ReshardError("reshard: trainer_init needs source= (the trainer's model or a ModuleSource)")
    model = wrapped_module(source)
    modules = model if isinstance(model, (list, tuple)) else [model]
    import torch

    if not modules or not all(isinstance(m, torch.nn.Module) for m in modules):
        raise ReshardError(
            "reshard: source must be a torch module, a list of them or a ModuleSource, "
            f"got {type(source).__name__}"
        )
    return model


class LLMClient:
    """vLLM's weight-sync client protocol over an offline ``LLM`` in this process (``LLM`` itself takes
    its requests wrapped: ``{"init_info": ...}``, ``{"update_info": ...}``)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


class _Background:
    """Runs one blocking control call (``fn(arg)``) on a side thread while this rank moves data."""

    def __init__(self, fn: Any, arg: Any, grace: float = 60.0) -> None:
        self.fn, self.arg, self.grace = fn, arg, grace
        self.pool: ThreadPoolExecutor | None = None
        self.future: Future | None = None

    def __enter__(self) -> _Background:
        if self.fn is not None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-vllm-control")
            self.future = self.pool.submit(self.fn, self.arg)
        return self

    def __exit__(self, *exc: Any) -> None:
        """Give the call up to ``grace`` seconds to finish (its client may not be used concurrently,
        e.g. an offline ``LLM``), then leave it: a call stuck in the engine must not hang the trainer."""
        if self.pool is not None:
            self.wait()
            self.pool.shutdown(wait=False)

    def wait(self) -> None:
        """Until the call has answered, or ``grace`` seconds passed."""
        if self.future is not None:
            try:
                self.future.result(timeout=self.grace)
            except Exception:  # its outcome() says what happened
                pass

    def failure_note(self) -> str:
        """The engine's own error, when the call already failed."""
        if self.future is None or not self.future.done() or self.future.exception() is None:
            return ""
        name = getattr(self.fn, "__name__", "call")
        return f" (the engine's {name} failed: {_describe(self.future.exception())})"

    def outcome(self, what: str) -> str:
        """"" when the call succeeded (or there was none), else the failure in the engine's words."""
        if self.future is None:
            return ""
        if not self.future.done():
            return f"reshard: the engine's {what} did not answer within {self.grace:g} s"
        exc = self.future.exception()
        return "" if exc is None else f"reshard: the engine's {what} failed: {_describe(exc)}"


class _Pauser:
    """Pauses and resumes generation through what the client reaches: vLLM's HTTP server (``/pause``,
    ``/resume`` at its ``base_url``), a client with ``pause_generation``/``resume_generation``, or
    nothing for an offline ``LLM`` (it generates only between the caller's own calls)."""

    def __init__(self, pause: Any, resume: Any) -> None:
        self._pause, self._resume = pause, resume

    @classmethod
    def of(cls, client: Any) -> _Pauser:
        if hasattr(client, "pause_generation") and hasattr(client, "resume_generation"):
            return cls(lambda mode: client.pause_generation(mode=mode), client.resume_generation)
        base = getattr(client, "base_url", None)
        if isinstance(base, str):
            base = base.rstrip("/")
            # as long as the client waits for the engine's other calls (vLLM's HTTP client: 300 s)
            wait = float(getattr(client, "timeout", None) or 300.0)
            return cls(
                lambda mode: _post(f"{base}/pause?mode={mode}", wait), lambda: _post(f"{base}/resume", wait)
            )
        if isinstance(client, LLMClient):
            return cls(lambda mode: None, lambda: None)
        return cls(None, lambda: None)

    def refusal(self, mode: str | None) -> str:
        """Why ``pause=mode`` cannot be done through this client ("" when it can)."""
        if mode is None or self._pause is not None:
            return ""
        return (
            f"reshard: pause={mode!r}, but this client cannot pause generation: pass pause=None, or a "
            "client with pause_generation and resume_generation"
        )

    def pause(self, mode: str) -> None:
        self._pause(mode)

    def resume(self) -> None:
        self._resume()


def _post(url: str, timeout: float) -> None:
    """POST to the engine's server, waiting at most ``timeout`` s (its error body, if any, in the
    raised error)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=timeout):
            pass
    except urllib.error.HTTPError as exc:
        raise ReshardError(f"HTTP {exc.code}: {exc.read()[:500].decode(errors='replace')}") from None


def _attempt(call: Any, what: str) -> str:
    """"" when ``call()`` succeeds, else its failure as one line of text."""
    try:
        call()
    except Exception as exc:
        return f"reshard: the engine's {what} failed: {_describe(exc)}"
    return ""


def _describe(exc: BaseException) -> str:
    """An engine error in one line; an HTTP error with the server's own message."""
    response = getattr(exc, "response", None)
    text = str(exc)
    if response is not None:
        try:
            text = f"HTTP {response.status_code}: {response.json()['error']['message']}"
        except Exception:
            text = f"HTTP {response.status_code}: {response.text[:500]}"
    return text.strip().replace("\n", " ") or type(exc).__name__
