"""Trainer jobs that fail on purpose against a running vLLM server (``test_server_faults.py``).

Each runs as a separate job (``run_world``), like the jobs of ``vllm_jobs.py``, and writes each
rank's outcome (``"ok"`` or the error text) to ``<outdir>/rank<r>.txt``, since a job whose rank is
killed returns nothing.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch.distributed as dist
from vllm_jobs import _config, _engine, model_for

KILL_PHASES = ("after-start", "mid-update", "before-finish", "in-pause")
"""Where trainer rank 0 (which drives the engine and hosts the group's store) is SIGKILLed:
after ``/start_weight_update`` answered; while the workers wait for its slices; after the workers
received the update, before rank 0 pauses generation and calls ``/finish_weight_update``; and after
``/pause`` answered, before ``/finish_weight_update`` (generation stays paused until the next
trainer's init resumes it)."""


def _write(outdir: str, rank: int, text: str) -> str:
    Path(outdir, f"rank{rank}.txt").write_text(text)
    return text


def _fsdp_model(seed: int) -> Any:
    from torch.distributed.fsdp import fully_shard

    model = model_for(_config("llama"), seed)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _load(model: Any, seed: int) -> None:
    """Set the FSDP2 ``model``'s weights to ``model_for(seed)``'s (every rank, collective)."""
    import torch
    from torch.distributed.tensor import distribute_tensor

    full = model_for(_config("llama"), seed).state_dict()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(distribute_tensor(full[name], param.device_mesh, param.placements))


def _good_round(engine: Any, rank: int, url: str, model_dir: str, version: str, outdir: str) -> None:
    """One update that must land; rank 0 writes the engine's greedy answer afterwards to
    ``<outdir>/good.json`` (tokens, logprobs) for the test to check against transformers."""
    from vllm_harness import completions
    from vllm_jobs import NEW_TOKENS, PROMPT

    engine.send_weights(version=version)
    if rank == 0:
        tokens, logprobs = completions(url, model_dir, PROMPT, NEW_TOKENS)
        Path(outdir, "good.json").write_text(json.dumps([tokens, logprobs]))
    dist.barrier()


def killed_job(
    rank: int, world: int, url: str, model_dir: str, phase: str, seeds: list[int], outdir: str
) -> str:
    """A fresh job: one good update (``model_for(seeds[0])``, version ``good-<phase>``), then rank 0
    is SIGKILLed at ``phase`` of the next (``model_for(seeds[1])``); every other rank records its
    error."""
    from reshard_core.testing.world import outcome

    model = _fsdp_model(seeds[0])
    engine = _engine(rank, world, url, 0, model, timeout=5)
    _good_round(engine, rank, url, model_dir, f"good-{phase}", outdir)
    _load(model, seeds[1])
    if rank == 0:
        client = engine.client
        if phase == "after-start":
            start = client.start_weight_update

            def start_then_die() -> None:
                start()
                _kill_self()

            client.start_weight_update = start_then_die
        elif phase == "mid-update":
            import reshard_core

            def die_instead_of_sending(*args: Any, **kwargs: Any) -> None:
                time.sleep(1.0)  # the update request has reached the engine; its workers wait for us
                _kill_self()

            reshard_core.refit = die_instead_of_sending
        elif phase == "before-finish":
            engine._apply = lambda *args, **kwargs: _kill_self()
        elif phase == "in-pause":
            client.finish_weight_update = lambda *args, **kwargs: _kill_self()
        else:
            raise ValueError(phase)
    return _write(outdir, rank, outcome(lambda: engine.send_weights(version=f"killed-{phase}")))


def takeover_job(
    rank: int, world: int, url: str, model_dir: str, seeds: list[int], outdir: str, go: str, done: str
) -> str:
    """Job A: one update that lands, then (once ``done`` exists: job B took the engine over) a second
    one, whose outcome every rank records."""
    from reshard_core.testing.world import outcome

    model = _fsdp_model(seeds[0])
    engine = _engine(rank, world, url, 0, model)
    _good_round(engine, rank, url, model_dir, "A-1", outdir)
    if rank == 0:
        Path(go).touch()
    deadline = time.monotonic() + 300
    while not Path(done).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return _write(outdir, rank, outcome(lambda: engine.send_weights(version="A-2")))


def alternating_job(
    rank: int, world: int, url: str, model_dir: str, seeds: list[int], modes: list, rounds: int, gap: float,
    long: int,
) -> dict:
    """First the engine's greedy answer (``long`` tokens, with logprobs) with each model of ``seeds``
    loaded alone, sent as ``emit("references", {seed: answer})``; then, for each pause mode of
    ``modes`` in turn (announced with ``emit("pause", mode)``, then ``emit("pause", "done")``):
    ``rounds`` updates alternating between those models, ``gap`` seconds apart. Returns each mode's
    update seconds."""
    from vllm_harness import completions
    from vllm_jobs import PROMPT

    from reshard_core.testing.world import emit

    model = _fsdp_model(seeds[0])
    engine = _engine(rank, world, url, 0, model)
    references = {}
    for seed in seeds:  # the engine's answer with each model, before any request runs alongside
        _load(model, seed)
        engine.send_weights(version=f"reference-{seed}")
        if rank == 0:
            references[seed] = completions(url, model_dir, PROMPT, long)
        dist.barrier()
    if rank == 0:
        emit("references", references)
    seconds: dict = {}
    for mode in modes:
        dist.barrier()
        if rank == 0:
            emit("pause", mode)
        for k in range(rounds):
            _load(model, seeds[k % len(seeds)])
            sent = engine.send_weights(version=f"{seeds[k % len(seeds)]}", pause=mode)
            seconds.setdefault(str(mode), []).append(round(sent.seconds, 3))
            time.sleep(gap)
    dist.barrier()
    if rank == 0:
        emit("pause", "done")
    engine.shutdown()
    return seconds


WORKER_FAULTS = tuple(
    (call, ranks) for call in ("start", "update", "rollback", "finish", "init") for ranks in ("1", "0,1")
)
"""``(call, workers)``: each engine call failing on worker 1 only, then on both (``fault_injection``)."""


def worker_fault_job(rank: int, world: int, url: str, model_dir: str, seeds: list[int]) -> dict:
    """``send_weights`` before ``trainer_init`` (its outcome: ``"before-init"``); one update that
    lands (``model_for(seeds[0])``, version ``before-faults``); then, with
    ``model_for(seeds[1])`` loaded, each case of ``WORKER_FAULTS`` in turn: rank 0 arms the fault,
    and every rank records the outcome of ``send_weights`` (or, for "init", of a new
    ``trainer_init``); rank 0 then records what the engine serves and its version. Then trainer
    rank 1 fails on its own (``"trainer"``, with its seconds) after a new ``trainer_init``, whose
    group then makes one update that lands (version ``after-faults``). Returns on every rank
    ``{"before-init": text, "outcomes": {case: text}}``, and on rank 0 also ``"good"``,
    ``"served"`` (``{case: [tokens, version]}``) and ``"last"`` (tokens, logprobs, version)."""
    from reshard_vllm import ReshardTrainerWeightTransferEngine
    from vllm_harness import completions, post_json
    from vllm_jobs import NEW_TOKENS, PROMPT

    from reshard_core.testing.world import outcome

    def served() -> list:
        with urllib.request.urlopen(url + "/weight_info", timeout=30) as answer:
            version = json.loads(answer.read())["weight_version"]
        return [*completions(url, model_dir, PROMPT, NEW_TOKENS), version]

    model = _fsdp_model(seeds[0])
    out: dict = {"outcomes": {}, "served": {}}
    uninitialised = ReshardTrainerWeightTransferEngine(client=None, source=model)
    out["before-init"] = outcome(lambda: uninitialised.send_weights())
    engine = _engine(rank, world, url, 0, model, timeout=5)
    engine.send_weights(version="before-faults")
    if rank == 0:
        out["good"] = served()
    _load(model, seeds[1])
    for call, ranks in WORKER_FAULTS:
        case = f"{call}@{ranks}"
        if rank == 0:
            post_json(url + "/collective_rpc", {"method": "reshard_arm_fault", "args": [call, ranks]})
        dist.barrier()
        if call == "init":
            engine.shutdown()
            out["outcomes"][case] = outcome(lambda: _engine(rank, world, url, 0, model, timeout=5))
        else:
            start = time.monotonic()
            out["outcomes"][case] = outcome(lambda case=case: engine.send_weights(version=case))
            out.setdefault("seconds", {})[case] = time.monotonic() - start
        if rank == 0:
            out["served"][case] = served()
        dist.barrier()
    engine = _engine(rank, world, url, 0, model, timeout=5)
    # trainer rank 1 fails on its own (its source is no module): every rank hears it in the refit's
    # start round, the workers too, so nobody waits out the timeout, and the weights stay
    if rank == 1:
        engine.model = {"w": next(model.parameters())}
    start = time.monotonic()
    out["trainer"] = outcome(lambda: engine.send_weights(version="trainer-fault"))
    out["trainer_seconds"] = time.monotonic() - start
    engine.model = model
    if rank == 0:
        out["served"]["trainer"] = served()
    dist.barrier()
    engine.send_weights(version="after-faults")  # the same group refits again
    if rank == 0:
        out["last"] = served()
    engine.shutdown()
    return out
