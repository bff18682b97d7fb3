"""Chaos soak: an RL-shaped refit loop under random faults, checked after every step.

    python benchmarks/chaos_soak.py --seed S --updates N --faults F [--kind llama] [--minutes M]
                                    [--parts cross-job one-world]

Two parts, each with its share of the faults (two thirds cross-job), at steps and phases drawn from
``--seed``:

- **cross-job**: a real ``vllm serve`` (CPU, TP2, the tests' fault-injection worker extension) that
  2-rank FSDP2 trainer jobs (``chaos_ranks.py trainer``) refit ``N`` times. Faults: SIGKILL or
  SIGSTOP (then SIGKILL) of a trainer rank, the store host (rank 0) included, at a phase of an update
  (``chaos_ranks.PHASES``: init, start, mid-transfer, after transfer, after pause, during finish);
  the job restarted and re-initialised; a second job taking over; a malformed HTTP call; an engine
  worker's call failing (start, update, rollback, finish, init).
- **one-world**: a 4-rank Gloo world (``chaos_ranks.py world``) refitting a sharded tensor ``N``
  times, retrying a failed step. Faults: a rank's own error; a rank SIGKILLed or SIGSTOPped (rank 0:
  a stalled store host) as a refit starts or mid-transfer, after which the world is respawned.

Invariants, checked after every step; a violation is recorded with the seed, step, fault and phase
and what was seen (the run goes on, to find more):

- the engine serves exactly the last version it reported (``/weight_info``), checked by greedy
  generation against transformers on that version's weights; a failed update keeps the previous
  version (an update struck during finish may land or not), a successful one serves its own;
- every rank of a job raised alike or succeeded alike, and a successful refit of the world left
  every destination shard bit-exact;
- no rank hangs: after a fault every other rank answers within ``HANG_BOUND`` seconds, and every
  surviving process exits with status 0;
- at the end, no ``/dev/shm`` segment, engine file descriptor, thread or process, or child process
  of the soak is left behind, and the engine's RSS does not grow (its slope per update is reported).

The last line reads ``soak: ... violations V ... leaks K ...``; the exit status is 1 on any violation
or leak. ``run()`` is the same soak against a server the caller started (the CI test's).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from chaos_parts import Engine, Job, Resources
from chaos_ranks import PHASES, RANK_ONE_PHASES, TIMEOUT

SEEDS = (11, 12, 13)
"""The weights versions cycle through (each a reference model, built once)."""
HANG_BOUND = 2 * TIMEOUT + 2
"""Seconds a trainer rank may take to answer after a fault: ``send_weights`` spans the transfer and the
engine's verdict, each bounded by the timeout (a world rank's refit: ``TIMEOUT + 2``)."""
WORKER_CALLS = ("start", "update", "rollback", "finish", "init")
MALFORMED = (
    ("/init_weight_transfer_engine", b'{"init_info": {"master_address": "127.0.0.1", "master_port": 1, '
     b'"trainer_world_size": "two"}}'),
    ("/init_weight_transfer_engine", b'{"init_info": {"bogus_field": 1}}'),
    ("/update_weights", b"not json at all"),
    ("/finish_weight_update", b'{"weight_version": {"nested": [1, 2]}}'),
    ("/init_weight_transfer_engine", b'{"init_info": {"master_address": "127.0.0.1", "master_port": "x", '
     b'"trainer_world_size": 2}}'),
)  # fmt: skip
"""Calls a confused or hostile client sends: each must be refused, and change nothing."""


@dataclass(frozen=True)
class Options:
    seed: int = 0
    updates: int = 40
    faults: int = 15
    kind: str = "llama"
    minutes: float = 0.0  # 0: no time limit
    parts: tuple[str, ...] = ("cross-job", "one-world")
    only: str = ""  # "KIND[@PHASE][:RANK]": every cross-job fault is this one (to replay a violation)


@dataclass(frozen=True)
class Fault:
    kind: str  # kill, stop, restart, takeover, malformed, worker, local-error
    phase: str = ""
    rank: int = 0
    delay: float = 0.0
    detail: str = ""

    def label(self) -> str:
        who = f" rank {self.rank}" if self.kind in ("kill", "stop", "local-error") else ""
        return f"{self.kind}{who}" + (f" @ {self.phase}" if self.phase else "")


@dataclass
class Tally:
    seed: int
    served: int = 0
    injected: Counter = field(default_factory=Counter)
    survived: int = 0
    violations: list[str] = field(default_factory=list)
    violated: set[tuple[str, int]] = field(default_factory=set)  # (part, step)
    respawns: int = 0

    def violate(self, part: str, step: int, fault: Fault | None, what: str) -> None:
        label = fault.label() if fault else "no fault"
        self.violated.add((part, step))
        self.violations.append(f"seed {self.seed} {part} step {step} ({label}): {what}")
        print(f"VIOLATION {self.violations[-1]}", flush=True)


# ------------------------------------------------------------------ plans


def cross_plan(rng: random.Random, updates: int, faults: int, only: str = "") -> dict[int, Fault]:
    kinds = ["kill", "stop", "kill", "stop", "restart", "takeover", "malformed", "worker"]
    steps = rng.sample(range(1, updates), min(faults, updates - 1))
    plan = {}
    if only:
        kind, _, rest = only.partition("@")
        phase, _, rank = rest.partition(":")
        return {s: Fault(kind, phase, int(rank or 0), delay=round(rng.uniform(0.0, 0.4), 3)) for s in steps}
    for step in steps:
        kind = rng.choice(kinds)
        if kind in ("kill", "stop"):
            rank = rng.choice((0, 0, 1))
            phase = rng.choice(PHASES if rank == 0 else RANK_ONE_PHASES)
            plan[step] = Fault(kind, phase, rank, delay=round(rng.uniform(0.0, 0.4), 3))
        elif kind == "worker":
            plan[step] = Fault(kind, rng.choice(WORKER_CALLS), detail=rng.choice(("1", "0,1")))
        elif kind == "malformed":
            plan[step] = Fault(kind, detail=str(rng.randrange(len(MALFORMED))))
        else:
            plan[step] = Fault(kind)
    return plan


def world_plan(rng: random.Random, steps: int, faults: int) -> dict[int, Fault]:
    plan = {}
    for step in rng.sample(range(1, steps), min(faults, steps - 1)):
        kind = rng.choice(("local-error", "kill", "stop"))
        rank = rng.randrange(4)
        phase = "" if kind == "local-error" else rng.choice(("start", "mid-transfer"))
        plan[step] = Fault(kind, phase, rank)
    return plan


# ------------------------------------------------------------------ cross-job


class CrossJob:
    """The trainer jobs refitting one engine, step by step (see the module docstring)."""

    def __init__(self, engine: Engine, resources: Resources, tally: Tally, kind: str) -> None:
        self.engine, self.resources, self.tally, self.kind = engine, resources, tally, kind
        self.job: Job | None = None
        self.last: str | None = None  # the version the engine must serve
        self.paused = False  # generation paused by a trainer struck after /pause, until the next init
        self.allowed: set[str] = set()  # what the engine may serve once generation resumes

    def start(self, step: int, fault: Fault | None = None) -> Job | None:
        """A fresh job, initialised (``fault``: a kill or stop during ``trainer_init``). Returns the job,
        or None when its init failed or was struck (checked alike; the job ended)."""
        job = Job("trainer", 2, [self.engine.url, self.kind])
        command: dict = {"op": "init"}
        if fault is not None:
            command["fault"] = {"rank": fault.rank, "how": fault.kind, "delay": fault.delay}
        job.send(command)
        answers = job.gather("init", [0, 1], 120)
        if fault is not None:  # the victim may be struck only after its init answered
            job.gather("fault", [fault.rank], fault.delay + 5.0)
        ok = self._alike(step, fault, "init", answers, job, expect_ok=True if fault is None else None)
        if ok and fault is None:
            if self.paused:  # the new trainer's init resumed generation: check what it serves now
                self.paused = False
                self.check(step, fault, self.allowed)
            return job
        self._end(job, step, fault)
        return None

    def _alike(self, step: int, fault: Fault | None, what: str, answers: dict, job: Job, expect_ok) -> bool:
        """Every rank not struck answered ``what``, alike, and within ``HANG_BOUND`` of a fault;
        ``expect_ok``: True (must succeed), False (must fail) or None (either, alike)."""
        waiting = [r for r in (0, 1) if r not in job.struck]
        missing = [r for r in waiting if r not in answers]
        if missing:
            self.tally.violate("cross-job", step, fault, f"rank(s) {missing} never answered {what}: "
                               + " | ".join(job.stacks(r) for r in missing))  # fmt: skip
            return False
        outcomes = {r: answers[r].data["outcome"] for r in waiting}
        oks = {text == "ok" for text in outcomes.values()}
        if len(oks) > 1:
            self.tally.violate("cross-job", step, fault, f"ranks did not {what} alike: {outcomes}")
            return False
        ok = oks.pop() if oks else False
        if expect_ok is not None and ok != expect_ok:
            self.tally.violate(
                "cross-job", step, fault, f"{what} {'failed' if not ok else 'succeeded'}: {outcomes}"
            )
            return False
        if job.struck_at is not None:
            late = {r: round(answers[r].at - job.struck_at, 1) for r in waiting
                    if answers[r].at - job.struck_at > HANG_BOUND}  # fmt: skip
            if late:
                self.tally.violate(
                    "cross-job", step, fault, f"ranks answered {what} late after the fault: {late}"
                )
                return False
        return ok or expect_ok is not True

    def _end(self, job: Job, step: int, fault: Fault | None) -> None:
        for r, code in job.end().items():
            if code != 0:
                self.tally.violate(
                    "cross-job", step, fault, f"trainer rank {r} exited with {code}: {job.tail(r)}"
                )
        if job is self.job:
            self.job = None

    def update(self, step: int, seed: int, fault: Fault | None = None) -> bool | None:
        """Send version ``step`` (weights of ``seed``) with the job, possibly struck; check the ranks.
        Returns whether it landed (None: the ranks disagreed or hung)."""
        version = f"u{step}-s{seed}"
        self.engine.seeds[version] = seed
        command = {"op": "update", "update": step, "seed": seed, "version": version}
        if fault is not None and fault.kind in ("kill", "stop"):
            command["fault"] = {
                "rank": fault.rank,
                "how": fault.kind,
                "phase": fault.phase,
                "delay": fault.delay,
            }
        job = self.job
        job.send(command)
        answers = job.gather("update", [0, 1], 300 if fault is None else 60)
        if not self._alike(step, fault, "update", answers, job, expect_ok=True if fault is None else None):
            return None
        landed = all(a.data["outcome"] == "ok" for a in answers.values())
        if landed:
            self.last = version
            self.tally.served += 1
        return landed

    def check(self, step: int, fault: Fault | None, allowed: set[str]) -> bool:
        if self.paused:
            return True  # generation resumes with the next trainer's init; checked then
        seen = self.engine.check(allowed)
        if seen:
            self.tally.violate("cross-job", step, fault, seen)
            return False
        self.last = self.engine.version()
        return True

    def step(self, step: int, fault: Fault | None) -> bool:
        """One step; True when nothing was violated."""
        before = len(self.tally.violations)
        seed = SEEDS[step % len(SEEDS)]
        if fault is not None and fault.kind in ("kill", "stop") and fault.phase == "init":
            if self.job is not None:
                self._end(self.job, step, fault)
            self.start(step, fault)
            self.check(step, fault, {self.last})
            return len(self.tally.violations) == before
        if fault is not None and fault.kind == "restart" and self.job is not None:
            self._end(self.job, step, fault)
        if self.job is None:
            self.job = self.start(step)
            if self.job is None:
                return False
            self.check(step, fault, {self.last})
        if fault is not None and fault.kind == "takeover":
            old, self.job = self.job, self.start(step)
            if self.job is None:
                self._end(old, step, fault)
                return False
            old.send({"op": "update", "update": step, "seed": seed, "version": f"stale-{step}"})
            self._alike(step, fault, "update", old.gather("update", [0, 1], 60), old, expect_ok=False)
            self._end(old, step, fault)
            self.check(step, fault, {self.last})
        elif fault is not None and fault.kind == "malformed":
            route, body = MALFORMED[int(fault.detail)]
            status, answer = self.engine.post(route, body)
            if status < 400:
                self.tally.violate(
                    "cross-job", step, fault, f"{route} accepted a malformed body: {status} {answer[:200]}"
                )
            self.check(step, fault, {self.last})
        elif fault is not None and fault.kind == "worker":
            status, answer = self.engine.post("/collective_rpc", json.dumps(
                {"method": "reshard_arm_fault", "args": [fault.phase, fault.detail]}).encode())  # fmt: skip
            if status >= 400:
                self.tally.violate(
                    "cross-job", step, fault, f"arming the fault failed: {status} {answer[:200]}"
                )
            elif fault.phase == "init":
                self.job.send({"op": "init"})
                self._alike(
                    step, fault, "init", self.job.gather("init", [0, 1], 120), self.job, expect_ok=False
                )
                self._end(self.job, step, fault)
            else:
                previous = self.last
                if self.update(step, seed, fault) is not False:
                    self.tally.violate(
                        "cross-job", step, fault, "an update with an injected worker fault did not fail"
                    )
                self.check(step, fault, {previous})
        if fault is not None and fault.kind in ("kill", "stop"):
            previous = self.last
            landed = self.update(step, seed, fault)
            self._end(self.job, step, fault)
            allowed = {previous} | ({f"u{step}-s{seed}"} if fault.phase == "finish" else set())
            if fault.rank == 0 and fault.phase in ("after-pause", "finish") and not landed:
                self.paused, self.allowed = True, allowed  # the next trainer's init resumes generation
            self.check(step, fault, allowed)
            return len(self.tally.violations) == before
        if self.job is None:
            self.job = self.start(step)
            if self.job is None:
                return False
            self.check(step, fault, {self.last})
        if self.update(step, seed) and self.check(step, fault, {f"u{step}-s{seed}"}):
            self.resources.sample(step)
        return len(self.tally.violations) == before

    def close(self, step: int) -> None:
        if self.job is not None:
            self._end(self.job, step, None)


def cross_job(
    opts: Options, engine: Engine, resources: Resources, tally: Tally, faults: int, deadline: float
) -> None:
    plan = cross_plan(random.Random(opts.seed), opts.updates, faults, opts.only)
    soak = CrossJob(engine, resources, tally, opts.kind)
    soak.last = engine.version()
    soak.step(0, None)  # a first version the engine serves and the reference knows
    for step in range(1, opts.updates):
        if time.monotonic() > deadline:
            break
        fault = plan.get(step)
        if fault is not None:
            tally.injected[("cross-job", fault.kind, fault.phase)] += 1
        ok = soak.step(step, fault)
        if fault is not None and ok:
            tally.survived += 1
        print(
            f"cross-job step {step}: {fault.label() if fault else 'update'} {'ok' if ok else 'VIOLATED'}",
            flush=True,
        )
    soak.close(opts.updates)


# ------------------------------------------------------------------ one world


def one_world(opts: Options, tally: Tally, faults: int, deadline: float) -> None:
    plan = world_plan(random.Random(opts.seed + 1), opts.updates, faults)
    for fault in plan.values():
        tally.injected[("one-world", fault.kind, fault.phase)] += 1
    struck = set(plan)
    pending = list(range(opts.updates))
    while pending and time.monotonic() < deadline:
        steps = [{"step": s, "fault": _world_fault(plan.get(s))} for s in pending]
        job = Job("world", 4, [json.dumps(steps)])
        done = _watch_world(job, tally, plan)
        for step in sorted(done):
            plan.pop(step, None)
            if step in struck and ("one-world", step) not in tally.violated:
                tally.survived += 1
            print(f"one-world step {step}: ok", flush=True)
        pending = [s for s in pending if s not in done]
        if pending:  # the world died at this step: respawned, it redoes the step, the fault spent
            plan.pop(pending[0], None)
            tally.respawns += 1
            print(f"one-world step {pending[0]}: world respawned", flush=True)


def _world_fault(fault: Fault | None) -> dict | None:
    if fault is None:
        return None
    return {"rank": fault.rank, "how": fault.kind, "phase": fault.phase}


def _watch_world(job: Job, tally: Tally, plan: dict[int, Fault]) -> set[int]:
    """Follow one world until its ranks exit; check every attempt once each rank not struck reported
    it; return the steps it completed."""
    done: set[int] = set()
    attempts: dict[tuple[int, int], dict[int, dict]] = {}
    checked: set[tuple[int, int]] = set()
    exited: set[int] = set()
    while len(exited | job.struck) < 4:
        try:
            found = job.events.get(timeout=HANG_BOUND + 30)
        except queue.Empty:
            tally.violate("one-world", min(plan, default=-1), None, f"no rank said anything for "
                          f"{HANG_BOUND + 30} s: " + " | ".join(job.tail(r) for r in job.live))  # fmt: skip
            break
        if found.event == "fault":
            job.strike(found)
        elif found.event == "exit":
            exited.add(found.rank)
        elif found.event == "attempt":
            key = (found.data["step"], found.data["attempt"])
            attempts.setdefault(key, {})[found.rank] = {**found.data, "at": found.at}
        for key, ranks in attempts.items():
            if key in checked or len(ranks) < 4 - len(job.struck):
                continue
            checked.add(key)
            fault = plan.get(key[0])
            if _check_attempt(tally, key, ranks, fault, job.struck_at) and all(
                a["outcome"] == "ok" for a in ranks.values()
            ):
                done.add(key[0])
                tally.served += 1
    for r, code in job.end(seconds=TIMEOUT + 10).items():
        if code != 0:
            tally.violate(
                "one-world",
                max(done, default=-1) + 1,
                None,
                f"world rank {r} exited with {code}: {job.tail(r, 60)}",
            )
    return done


def _check_attempt(tally: Tally, key: tuple[int, int], ranks: dict[int, dict], fault: Fault | None,
                   struck_at: float | None) -> bool:  # fmt: skip
    step, attempt = key
    outcomes = {r: a["outcome"] for r, a in ranks.items()}
    if len({text == "ok" for text in outcomes.values()}) > 1:
        tally.violate("one-world", step, fault, f"attempt {attempt}: ranks did not refit alike: {outcomes}")
        return False
    inexact = [r for r, a in ranks.items() if a["outcome"] == "ok" and not a["exact"]]
    if inexact:
        tally.violate(
            "one-world", step, fault, f"attempt {attempt}: ranks {inexact} hold other values than the source"
        )
        return False
    if struck_at is not None:
        late = {
            r: round(a["at"] - struck_at, 2) for r, a in ranks.items() if a["at"] - struck_at > TIMEOUT + 2
        }
        if late:
            tally.violate(
                "one-world", step, fault, f"attempt {attempt}: ranks answered late after the fault: {late}"
            )
            return False
    return True


# ------------------------------------------------------------------ the run


def run(
    opts: Options, url: str, model_dir: str, engine_pids, atol: float = 1e-3
) -> tuple[Tally, list[str], float]:
    """The soak against a running server; returns its tally, the leaks, and the engine's RSS slope."""
    tally = Tally(opts.seed)
    engine = Engine(url, model_dir, opts.kind, atol)
    resources = Resources(engine_pids)
    deadline = time.monotonic() + (opts.minutes * 60 if opts.minutes else 1e9)
    cross = opts.faults - opts.faults // 3 if "one-world" in opts.parts else opts.faults
    if "cross-job" in opts.parts:
        cross_job(opts, engine, resources, tally, cross, deadline)
    if "one-world" in opts.parts:
        one_world(opts, tally, opts.faults - cross if "cross-job" in opts.parts else opts.faults, deadline)
    leaks = resources.leaks()
    return tally, leaks, resources.rss_slope()


def summary(tally: Tally, leaks: list[str], slope: float, seconds: float) -> str:
    kinds = ", ".join(f"{part}:{kind}{'@' + phase if phase else ''}={n}"
                      for (part, kind, phase), n in sorted(tally.injected.items()))  # fmt: skip
    return (
        f"soak: seed {tally.seed} updates served {tally.served} faults {sum(tally.injected.values())} "
        f"survived {tally.survived} respawns {tally.respawns} violations {len(tally.violations)} "
        f"leaks {len(leaks)} rss_slope {slope / (1 << 20):+.3f} MiB/update in {seconds:.0f} s [{kinds}]"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--updates", type=int, default=40, help="updates per part")
    parser.add_argument("--faults", type=int, default=15, help="faults in all (two thirds cross-job)")
    parser.add_argument(
        "--kind", default="llama", help="llama, qwen3_moe or a family of tests/families/tiny.py"
    )
    parser.add_argument("--minutes", type=float, default=0.0, help="stop after this long (0: no limit)")
    parser.add_argument(
        "--parts", nargs="+", default=["cross-job", "one-world"], choices=["cross-job", "one-world"]
    )
    parser.add_argument("--only", default="", help="every cross-job fault is this one: KIND[@PHASE][:RANK]")
    args = parser.parse_args(argv)
    parts = tuple(args.parts)
    opts = Options(args.seed, args.updates, args.faults, args.kind, args.minutes, parts, args.only)
    start = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a soak ended from outside stops its server
    if "cross-job" in opts.parts:
        with served(opts.kind) as server:
            tally, leaks, slope = run(opts, server.url, server.model_dir, server.pids, atol(opts.kind))
    else:
        tally, leaks, slope = run(opts, "", "", lambda: [], atol(opts.kind))
    for line in tally.violations + [f"LEAK {leak}" for leak in leaks]:
        print(line)
    print(summary(tally, leaks, slope, time.monotonic() - start), flush=True)
    return 1 if tally.violations or leaks else 0


def atol(kind: str) -> float:
    import tiny

    return tiny.LOGPROB_ATOL.get(kind, 1e-3)


def served(kind: str):
    """A TP2 ``vllm serve`` of ``kind`` (dummy weights, float32 but for the families' own dtypes)
    with the tests' fault-injection worker extension."""
    import tempfile

    from chaos_ranks import config_of
    from vllm_harness import VLLMServer, write_model_dir

    tests = Path(__file__).resolve().parents[1] / "tests" / "vllm"
    extension = {"PYTHONPATH": os.pathsep.join(p for p in (str(tests), os.environ.get("PYTHONPATH")) if p)}
    config = config_of(kind)
    model_dir = write_model_dir(Path(tempfile.mkdtemp(prefix="chaos-")) / kind, config)
    dtype = str(getattr(config, "dtype", "float32")).removeprefix("torch.")
    import tiny

    extra = ["--worker-extension-cls", "fault_injection.FaultInjection", *tiny.SERVER_ARGS.get(kind, [])]
    return VLLMServer(model_dir, tp=2, weight_transfer_backend="reshard", startup_timeout=600, dtype=dtype,
                      extra_args=extra, env=extension)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
