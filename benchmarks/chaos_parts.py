"""What a chaos soak (``chaos_soak.py``) drives and watches: the processes of one job (``Job``), the
engine it checks after every step (``Engine``), and the resources it must not leak (``Resources``).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RANKS = str(HERE / "chaos_ranks.py")
sys.path[:0] = [str(HERE.parent / "tests" / "vllm"), str(HERE.parent / "tests" / "families")]

PROMPT = [5, 17, 33, 2, 99, 100, 7, 8]
NEW_TOKENS = 8


@dataclass
class Event:
    rank: int
    event: str
    data: dict
    at: float  # time.monotonic() when the soak read it


class Job:
    """The processes of one job (``python chaos_ranks.py ROLE RANK WORLD PORT *args``), each in its
    own process, like a torchrun job's; their JSON lines arrive as ``Event``s in one queue."""

    def __init__(self, role: str, world: int, args: list[str], env: dict[str, str] | None = None) -> None:
        from reshard_core.testing.world import free_port

        port = str(free_port())
        environ = {**os.environ, **(env or {})}
        self.procs = [
            subprocess.Popen([sys.executable, RANKS, role, str(r), str(world), port, *args], env=environ,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(world)
        ]  # fmt: skip
        self.events: queue.Queue[Event] = queue.Queue()
        self.stderr: dict[int, list[str]] = {r: [] for r in range(world)}
        self.struck: set[int] = set()  # ranks a fault stopped or killed
        self.struck_at: float | None = None  # when the soak heard of the first
        for r, p in enumerate(self.procs):
            threading.Thread(target=self._read, args=(r, p), daemon=True).start()
            threading.Thread(target=self._drain, args=(r, p), daemon=True).start()

    def _read(self, rank: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.events.put(Event(rank, data.pop("event"), data, time.monotonic()))

    def _drain(self, rank: int, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            self.stderr[rank] = (self.stderr[rank] + [line])[-120:]

    @property
    def live(self) -> list[int]:
        return [r for r, p in enumerate(self.procs) if r not in self.struck and p.poll() is None]

    def send(self, command: dict) -> None:
        """Write ``command`` to every rank not struck."""
        for r in self.live:
            try:
                self.procs[r].stdin.write(json.dumps(command) + "\n")
                self.procs[r].stdin.flush()
            except OSError:
                pass

    def strike(self, event: Event) -> None:
        """Note a rank's ``fault`` event: it stopped or died."""
        self.struck.add(event.rank)
        if self.struck_at is None:
            self.struck_at = event.at

    def gather(self, event: str, ranks: list[int], seconds: float) -> dict[int, Event]:
        """The next ``event`` of each of ``ranks`` (those that sent one within ``seconds``); a rank
        that reports a ``fault`` on the way is dropped from the wait."""
        out: dict[int, Event] = {}
        deadline = time.monotonic() + seconds
        waiting = set(ranks)
        while waiting - set(out):
            try:
                found = self.events.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    break
                continue
            if found.event == "fault":
                self.strike(found)
                if event != "fault":
                    waiting.discard(found.rank)
                else:
                    out[found.rank] = found
            elif found.rank in waiting and found.event == event:
                out[found.rank] = found
        return out

    def kill(self, rank: int) -> None:
        try:
            self.procs[rank].send_signal(signal.SIGKILL)
        except OSError:
            pass

    def end(self, seconds: float = 30.0) -> dict[int, int | None]:
        """Ask the ranks still running to exit; kill those struck (stopped ones included), and any rank
        not gone after ``seconds``. Returns each unstruck rank's exit status (None: it had to be
        killed)."""
        for r in self.struck:
            self.kill(r)
        self.send({"op": "exit"})
        for p in self.procs:
            if p.stdin:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        codes: dict[int, int | None] = {}
        deadline = time.monotonic() + seconds
        for r, p in enumerate(self.procs):
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
                if r not in self.struck:
                    codes[r] = p.returncode
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                codes[r] = None
        return codes

    def stacks(self, rank: int) -> str:
        """Where a rank that did not answer is: its threads' stacks (it prints them on SIGUSR1)."""
        try:
            self.procs[rank].send_signal(signal.SIGUSR1)
        except OSError:
            return self.tail(rank)
        time.sleep(1.0)
        return "".join(self.stderr[rank][-60:])

    def tail(self, rank: int, lines: int = 12) -> str:
        return "".join(self.stderr[rank][-lines:])


@dataclass
class Engine:
    """The vLLM server under the soak: what it says it serves, and whether it generates exactly that."""

    url: str
    model_dir: str
    kind: str
    atol: float
    seeds: dict[str, int] = field(default_factory=dict)  # version → the seed of its weights
    _references: dict[int, Any] = field(default_factory=dict)

    def version(self) -> str:
        with urllib.request.urlopen(self.url + "/weight_info", timeout=30) as answer:
            return json.loads(answer.read())["weight_version"]

    def check(self, allowed: set[str]) -> str:
        """Empty when the engine serves one of ``allowed`` and generates exactly what that version's
        weights generate in transformers; else what was seen."""
        from vllm_harness import check_greedy, completions

        try:
            version = self.version()
            tokens, logprobs = completions(self.url, self.model_dir, PROMPT, NEW_TOKENS)
        except Exception as exc:  # noqa: BLE001 - an engine that stopped answering is what is seen
            return f"engine did not answer: {type(exc).__name__}: {exc}"
        if version not in allowed:
            return f"engine reports version {version!r}, expected one of {sorted(allowed)}"
        seed = self.seeds.get(version)
        if seed is None:  # what the engine started with: no reference to compare with
            return ""
        check = check_greedy(self.reference(seed), PROMPT, tokens, logprobs, logprob_atol=self.atol,
                             tie_atol=self.atol)  # fmt: skip
        return "" if check.ok else f"engine serving {version!r} does not generate its weights': {check}"

    def reference(self, seed: int) -> Any:
        from chaos_ranks import model_of

        if seed not in self._references:
            self._references[seed] = model_of(self.kind, seed).float()
        return self._references[seed]

    def post(self, route: str, body: bytes) -> tuple[int, str]:
        """POST raw ``body``; ``(HTTP status, answer)`` (an error status is an answer here)."""
        request = urllib.request.Request(
            self.url + route, data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as answer:
                return answer.status, answer.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")


class Resources:
    """What the soak must leave as it found: ``/dev/shm`` segments, the engine's file descriptors,
    threads and child processes, this process's children; and the engine's memory per update."""

    def __init__(self, engine_pids) -> None:
        self.engine_pids = engine_pids  # a callable: the engine's live pids
        self.shm = self._shm()
        self.children = set(self._children())
        self.rss: list[tuple[int, int]] = []  # (update, engine RSS bytes)
        self.counts: list[tuple[int, dict[str, int]]] = []  # (update, the engine's fds, threads, ...)

    @staticmethod
    def _shm() -> set[str]:
        try:
            return set(os.listdir("/dev/shm"))
        except OSError:
            return set()

    def engine(self) -> dict[str, int]:
        """The engine's file descriptors, threads and processes, summed over its processes."""
        pids = self.engine_pids()
        fds = threads = 0
        for pid in pids:
            try:
                fds += len(os.listdir(f"/proc/{pid}/fd"))
                status = Path(f"/proc/{pid}/status").read_text()
                threads += int(
                    next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:"))
                )
            except (OSError, StopIteration, ValueError):
                continue
        return {"fds": fds, "threads": threads, "processes": len(pids)}

    def _ends(self) -> tuple[dict[str, int], dict[str, int]]:
        """The engine's counts over the first and over the last fifth of the updates (medians)."""
        fifth = max(len(self.counts) // 5, 2)

        def median(samples: list[tuple[int, dict[str, int]]]) -> dict[str, int]:
            return {k: sorted(c[k] for _, c in samples)[len(samples) // 2] for k in samples[0][1]}

        return median(self.counts[:fifth]), median(self.counts[-fifth:])

    def trend(self) -> str:
        """The engine's counts over the first and last updates, for the summary."""
        if len(self.counts) < 5:
            return "engine counts: too few updates"
        first, last = self._ends()
        return "engine " + ", ".join(f"{k} {first[k]}→{last[k]}" for k in first)

    def sample(self, update: int) -> None:
        from vllm_harness import rss_bytes

        self.counts.append((update, self.engine()))
        self.rss.append((update, rss_bytes(self.engine_pids())))

    def rss_slope(self) -> float:
        """Bytes per update of the engine's RSS (least squares over the samples after the first fifth)."""
        points = self.rss[len(self.rss) // 5 :]
        if len(points) < 3:
            return 0.0
        n = len(points)
        mx = sum(x for x, _ in points) / n
        my = sum(y for _, y in points) / n
        var = sum((x - mx) ** 2 for x, _ in points)
        return sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0

    def _children(self) -> list[int]:
        """This process's live descendants that are not the engine's."""
        from vllm_harness import process_tree

        engine = set(self.engine_pids())
        return [p for p in process_tree(os.getpid()) if p != os.getpid() and p not in engine]

    def leaks(self) -> list[str]:
        """Every resource left behind: new ``/dev/shm`` segments, the engine's growth in fds, threads or
        processes since its first update (beyond a small slack), new child processes of this one, and
        an engine RSS slope over 1 MiB/update."""
        out = []
        new = self._shm() - self.shm
        if new:  # another process's may come and go: a leak is one still there a moment later
            time.sleep(2.0)
            new = sorted(new & self._shm())
        if new:
            out.append(f"/dev/shm segments left: {new[:5]}")
        if len(self.counts) >= 5:  # medians after updates: a trainer's group may still be closing
            first, last = self._ends()
            for what, slack in (("fds", 16), ("threads", 8), ("processes", 0)):
                if last[what] > first[what] + slack:
                    out.append(f"engine {what}: {first[what]} in the first updates, {last[what]} in the last")
        children = sorted(set(self._children()) - self.children)
        if children:
            out.append(f"child processes left: {children}")
        slope = self.rss_slope()
        if slope > 1 << 20:
            out.append(f"engine RSS grows {slope / (1 << 20):.2f} MiB per update")
        return out
