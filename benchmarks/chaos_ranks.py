"""The processes a chaos soak (``chaos_soak.py``) runs and attacks: one rank each, started by the soak
with ``python chaos_ranks.py trainer|world RANK WORLD PORT ...`` (``MASTER_PORT``-style: each job is
its own ``torch.distributed`` world, like a torchrun job).

- ``trainer``: a rank of an FSDP2 trainer job that refits a vLLM server through reshard-vllm. It
  reads one JSON command per line on stdin (``init``, ``update``, ``exit``) and answers each with one
  JSON line on stdout. A command may carry a fault for this rank: it then kills (SIGKILL) or stops
  (SIGSTOP) itself at that phase of the call, after printing ``{"event": "fault"}``.
- ``world``: a rank of a 4-rank Gloo world whose training loop refits a sharded tensor step after
  step and retries a step whose refit failed. Its steps and faults come on the command line (JSON);
  after each attempt it prints its outcome, and whether its destination shard then holds exactly
  the step's source. A refit that fails because a peer is gone ends the loop: the job is restarted.

Every line a rank prints is ``{"rank": r, "event": ..., ...}``; a rank prints nothing else on stdout.
Faults are where a real one would strike (``PHASES``): a rank does not know it is being attacked
beyond the hook that stops or kills it.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests" / "vllm"), str(HERE.parent / "tests" / "families")]

PHASES = ("init", "start", "mid-transfer", "after-transfer", "after-pause", "finish")
"""Where a trainer rank is struck: during ``trainer_init``; after ``/start_weight_update`` answered;
where its transport starts the transfer; after its transfer, before the verdict round; after
``/pause`` answered (generation paused), before ``/finish_weight_update``; while that call runs."""
RANK_ONE_PHASES = ("init", "mid-transfer", "after-transfer")
"""The phases a trainer rank other than 0 goes through (rank 0 alone drives the engine's calls)."""
TIMEOUT = 5.0
"""Seconds of every refit's and ``trainer_init``'s timeout here."""


def say(rank: int, event: str, **data: Any) -> None:
    print(json.dumps({"rank": rank, "event": event, **data}), flush=True)


def strike(rank: int, how: str, phase: str) -> None:
    """Stop or kill this process now (after saying so)."""
    say(rank, "fault", how=how, phase=phase, at=time.time())
    os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)


def outcome(fn) -> tuple[str, float]:
    start = time.monotonic()
    try:
        fn()
        text = "ok"
    except Exception as exc:  # noqa: BLE001 - every error is an outcome the soak compares
        text = f"{type(exc).__name__}: {exc}"
    return text, time.monotonic() - start


# ------------------------------------------------------------------ cross-job trainer


def config_of(kind: str) -> Any:
    """The tiny transformers config of model ``kind``: "llama" and "qwen3_moe" as the vLLM tests
    build them, or a family of ``tests/families/tiny.py``."""
    if kind in ("llama", "qwen3_moe"):
        from vllm_jobs import _config

        return _config(kind)
    import tiny

    return tiny.config(kind)


def model_of(kind: str, seed: int) -> Any:
    """The transformers model of ``kind`` with the seeded weights of one version (the trainer's and
    the soak's reference)."""
    if kind in ("llama", "qwen3_moe"):
        from vllm_jobs import model_for

        return model_for(config_of(kind), seed)
    import tiny

    return tiny.hf_model(kind, seed)


def _fsdp_model(kind: str) -> Any:
    from torch.distributed.fsdp import fully_shard

    model = model_of(kind, 0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _load(model: Any, kind: str, seed: int) -> None:
    """The FSDP2 ``model``'s parameters and buffers become ``model_of(kind, seed)``'s (collective)."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = model_of(kind, seed)
    values = dict(full.named_parameters()) | dict(full.named_buffers())
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            value = values[name].detach()
            if isinstance(tensor, DTensor):
                value = distribute_tensor(value, tensor.device_mesh, tensor.placements)
            tensor.copy_(value)


def trainer(rank: int, world: int, url: str, kind: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    model = _fsdp_model(kind)
    engine = None
    for line in sys.stdin:
        command = json.loads(line)
        fault = command.get("fault") if command.get("fault", {}).get("rank") == rank else None
        if command["op"] == "init":
            if engine is not None:
                engine.shutdown()
            engine, text, seconds = _init(rank, world, url, model, fault)
            say(rank, "init", outcome=text, seconds=seconds)
        elif command["op"] == "update":
            _load(model, kind, command["seed"])
            if fault is not None:
                _arm(rank, engine, fault)
            send = engine.send_weights
            text, seconds = outcome(lambda send=send, version=command["version"]: send(version=version))
            say(rank, "update", update=command["update"], outcome=text, seconds=seconds)
        elif command["op"] == "exit":
            break
    if engine is not None:
        outcome(engine.shutdown)
    say(rank, "exit")


def _init(rank: int, world: int, url: str, model: Any, fault: dict | None) -> tuple[Any, str, float]:
    import torch.distributed as dist
    from reshard_vllm import ReshardTrainerInitInfo
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from reshard_core.testing.world import free_port

    box = [free_port() if rank == 0 else 0]
    dist.broadcast_object_list(box, src=0)
    info = ReshardTrainerInitInfo("127.0.0.1", box[0], world, rank=rank, timeout=TIMEOUT)
    if fault is not None:  # somewhere inside trainer_init (or at its end)
        timer = threading.Timer(fault["delay"], strike, (rank, fault["how"], "init"))
        timer.daemon = True
        timer.start()
    engine = None

    def init() -> None:
        nonlocal engine
        engine = WeightTransferTrainerFactory.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model)
        )

    text, seconds = outcome(init)
    return engine, text, seconds


def _arm(rank: int, engine: Any, fault: dict) -> None:
    """Make this rank stop or die at ``fault["phase"]`` of its next ``send_weights``."""
    from reshard_gloo.transport import GlooCopyService

    import reshard_core

    how, phase = fault["how"], fault["phase"]
    client = engine.client

    def then_strike(call):
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            result = call(*args, **kwargs)
            strike(rank, how, phase)
            return result

        return wrapped

    if phase == "start":
        client.start_weight_update = then_strike(client.start_weight_update)
    elif phase == "mid-transfer":
        GlooCopyService.start = lambda self: strike(rank, how, phase)
    elif phase == "after-transfer":
        reshard_core.refit = then_strike(reshard_core.refit)
    elif phase == "after-pause":
        client.finish_weight_update = lambda *a, **k: strike(rank, how, phase)
    elif phase == "finish":
        finish = client.finish_weight_update

        def struck_while_finishing(*args: Any, **kwargs: Any) -> None:
            threading.Thread(target=finish, args=args, kwargs=kwargs, daemon=True).start()
            time.sleep(fault["delay"])
            strike(rank, how, phase)

        client.finish_weight_update = struck_while_finishing
    else:
        raise ValueError(f"unknown phase {phase!r}")


# ------------------------------------------------------------------ one-world retry loop

ROWS, COLS = 64, 48


def source_of(step: int):
    """The step's full source tensor (every rank can compute it)."""
    import torch

    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * (step + 1) / 7.0


def world_loop(rank: int, world: int, steps: list[dict]) -> None:
    """Refit ``source_of(step)`` (rows over every rank) into a destination of columns over every rank,
    in reverse rank order; retry a step whose refit failed, unless a peer is gone."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import reshard_core
    from reshard_core import declare_layout

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    src, dst = nn.Module(), nn.Module()
    src.w = nn.Parameter(torch.zeros(ROWS // world, COLS))
    dst.w = nn.Parameter(torch.zeros(ROWS, COLS // world))
    declare_layout(src.w, dim=0, ranks=tuple(range(world)))
    declare_layout(dst.w, dim=1, ranks=tuple(reversed(range(world))))
    me = world - 1 - rank  # this rank's column block of the destination
    for plan in steps:
        step, fault = plan["step"], plan.get("fault")
        full = source_of(step)
        with torch.no_grad():
            src.w.copy_(full.chunk(world)[rank])
        for attempt in (1, 2):
            source: Any = src
            mine = fault is not None and fault["rank"] == rank and attempt == 1
            if mine and fault["how"] == "local-error":
                source = {"w": src.w}  # not a module: this rank's own error, raised before any data moves
            elif mine:
                _strike_in_refit(rank, fault)
            text, seconds = outcome(lambda s=source: reshard_core.refit(s, dst, timeout=TIMEOUT, verify=True))
            exact = bool(torch.equal(dst.w.detach(), full.chunk(world, dim=1)[me])) if text == "ok" else None
            say(rank, "attempt", step=step, attempt=attempt, outcome=text, seconds=seconds, exact=exact)
            if text == "ok" or _peer_gone(text):
                break
        if text != "ok":
            break
    say(rank, "exit")


def _strike_in_refit(rank: int, fault: dict) -> None:
    """Stop or kill this rank at ``fault["phase"]`` of its next refit: where its transport starts
    ("mid-transfer"), or as the refit begins ("start")."""
    from reshard_gloo.transport import GlooCopyService

    import reshard_core

    how, phase = fault["how"], fault["phase"]
    if phase == "mid-transfer":
        GlooCopyService.start = lambda self: strike(rank, how, phase)
    else:
        refit = reshard_core.refit

        def struck(*args: Any, **kwargs: Any) -> Any:
            strike(rank, how, phase)
            return refit(*args, **kwargs)

        reshard_core.refit = struck


def _peer_gone(text: str) -> bool:
    """Whether a refit's error says a peer stalled or died (the group cannot refit again)."""
    return text.startswith(("TransportError", "PeerFailed", "BrokenGroup", "StoreSilent"))


def main(argv: list[str]) -> None:
    faulthandler.enable(all_threads=True)  # a crash says where each thread was
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the soak asks a hung rank where it hangs
    role, rank, world, port = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    random.seed(rank)
    if role == "trainer":
        trainer(rank, world, argv[4], argv[5])
    elif role == "world":
        world_loop(rank, world, json.loads(argv[4]))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
