"""The real TP2 ``vllm serve`` under faults, without a restart: malformed inits, a trainer whose rank 0
is SIGKILLed at each phase of an update, a second trainer taking over, and completions running
across updates under each pause mode.

After every fault the engine serves exactly the previous weights or the new ones (checked by
generation), ``/weight_info`` names what is served, and a fresh trainer job's refit is served
(checked by generation against transformers). The servers are the ones ``test_server_refit.py``
(TP2) and ``test_server_tp1.py`` (TP1) use; the malformed inits and a trainer killed mid-update run
at both sizes.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import vllm_harness as T
from fault_jobs import KILL_PHASES, alternating_job, killed_job, takeover_job
from vllm_jobs import DTYPE, LOGPROB_ATOL, NEW_TOKENS, PROMPT, hf_fsdp_job, model_for

from reshard_core.testing.world import WorldError, run_world

pytestmark = pytest.mark.slow

CONFIG = T.tiny_llama_config(dtype=DTYPE)


def _serving(server) -> list[int]:
    return server.completions(PROMPT, NEW_TOKENS)[0]


def _version(server) -> str:
    with urllib.request.urlopen(server.url + "/weight_info", timeout=30) as answer:
        return json.loads(answer.read())["weight_version"]


def _fresh_job_is_served(server, seed: int) -> None:
    """A new 2-rank FSDP2 job refits the engine with ``model_for(seed)``; the engine then generates
    what transformers does on those weights."""
    [rounds, _] = run_world(hf_fsdp_job, 2, server.url, server.model_dir, 0, "llama", [seed], timeout=600)
    tokens, logprobs, received = rounds[0]
    check = T.check_greedy(
        model_for(CONFIG, seed), PROMPT, tokens, logprobs, logprob_atol=LOGPROB_ATOL, tie_atol=LOGPROB_ATOL
    )
    assert check.ok, f"seed {seed}: {check}"
    assert _serving(server) == tokens
    assert all(got == held > 0 for got, held in received.values()), received


def _init(server, init_info: dict) -> str:
    with pytest.raises(T.VLLMServerError) as info:
        server.post("/init_weight_transfer_engine", {"init_info": init_info}, timeout=120)
    return str(info.value)


@pytest.mark.parametrize("tp", [2, 1])
def test_malformed_inits_leave_no_stale_reply_and_a_valid_job_then_works(request, tp: int) -> None:
    server = request.getfixturevalue(f"llama_tp{tp}_server")
    before, version = _serving(server), _version(server)
    good = {"master_address": "127.0.0.1", "master_port": 29999, "trainer_world_size": 2}
    first = _init(server, {**good, "trainer_world_size": "two"})
    assert (
        "init_weight_transfer_engine failed on every worker: reshard: init_info.trainer_world_size must be "
        "a positive integer, got 'two'"
    ) in first, first
    second = _init(server, {**good, "bogus_field": 1})
    assert "init_weight_transfer_engine failed on every worker: " in second, second
    assert "bogus_field" in second and "trainer_world_size" not in second, second  # its own error only
    assert _serving(server) == before and _version(server) == version
    _fresh_job_is_served(server, 31)


@pytest.mark.parametrize(
    "tp, phase", [(2, phase) for phase in KILL_PHASES] + [(1, "mid-update")], ids=lambda v: str(v)
)
def test_a_trainer_whose_rank_0_is_killed_leaves_old_weights_and_a_fresh_job_works(
    request, tp: int, phase: str, tmp_path: Path
) -> None:
    server = request.getfixturevalue(f"llama_tp{tp}_server")
    before, version = _serving(server), _version(server)
    with pytest.raises(WorldError, match=r"ranks 0 \(exit code -9\) died without reporting"):
        run_world(killed_job, 2, server.url, server.model_dir, phase, 41, str(tmp_path), timeout=300)
    survivor = (tmp_path / "rank1.txt").read_text()
    assert survivor.startswith("TransportError: transfer group rank 1: vLLM "), survivor
    assert "rank 0, its host, exited or stalled" in survivor, survivor  # names the dead rank
    assert _version(server) == version
    if phase != "in-pause":  # paused: generation waits for the next trainer's init, checked below
        assert _serving(server) == before, f"{phase}: the engine serves neither the old weights nor the new"
    _fresh_job_is_served(server, 42 + KILL_PHASES.index(phase))


def test_a_second_trainer_takes_over_the_first_is_told_and_a_third_works(llama_tp2_server, tmp_path) -> None:
    server = llama_tp2_server
    go, done = tmp_path / "go", tmp_path / "done"
    job_a: list = []

    def run_a() -> None:
        try:
            job_a.append(
                run_world(takeover_job, 2, server.url, server.model_dir, [51], str(tmp_path), str(go),
                          str(done), timeout=600)  # fmt: skip
            )
        except Exception as exc:  # reported below
            job_a.append(exc)

    thread = threading.Thread(target=run_a)
    thread.start()
    deadline = time.monotonic() + 300
    while not go.exists() and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert go.exists(), f"job A did not get its first update through: {job_a}"
    _fresh_job_is_served(server, 52)  # job B takes the engine over while A is still connected
    done.touch()
    thread.join(timeout=300)
    texts = job_a[0]
    assert isinstance(texts, list), texts
    for text in texts:  # every rank of A, at once (no timeout), the same words
        assert text.startswith("ReshardError: reshard: superseded by a newer trainer"), text
    assert texts[0] == texts[1]
    _fresh_job_is_served(server, 53)


LONG = 32
"""Tokens per completion across updates: long enough that a completion spans an update."""


@pytest.fixture(scope="module")
def references(llama_tp2_server) -> dict[int, list[int]]:
    """The engine's greedy ``LONG`` tokens with each of two models loaded (each checked against
    transformers on its first tokens)."""
    out = {}
    for seed in (61, 62):
        _fresh_job_is_served(llama_tp2_server, seed)
        out[seed] = llama_tp2_server.completions(PROMPT, LONG)[0]
    assert out[61] != out[62]
    return out


MODES = ["wait", "abort", "keep", None]


@pytest.mark.timeout(900)
def test_completions_across_updates_under_each_pause_mode(llama_tp2_server, references) -> None:
    """Completions run one after another while one trainer job alternates the two models, 6 updates
    half a second apart under each pause mode in turn. Under "wait" (the default) and "abort" no
    completion mixes the two models (an aborted one is a prefix of one model's); under "keep" and
    None they may (printed). The last model sent is then the one served."""
    server = llama_tp2_server
    mode: dict[str, object] = {"now": "before"}
    results: dict[object, list[list[int]]] = {m: [] for m in MODES}
    stop = threading.Event()

    def ask() -> None:  # one client, a short breath between requests: the trainer needs the CPU too
        while not stop.is_set():
            began = mode["now"]
            try:
                tokens = T.completions(server.url, server.model_dir, PROMPT, LONG)[0]
            except T.VLLMServerError:  # an aborted request may come back as an error
                tokens = []
            if began == mode["now"] and began in results:  # wholly inside one mode's updates
                results[began].append(tokens)
            time.sleep(0.2)

    def on_event(rank: int, kind: str, data: object) -> None:
        mode["now"] = data

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        [seconds, _] = run_world(
            alternating_job, 2, server.url, server.model_dir, [61, 62], MODES, 6, 0.5, timeout=600,
            on_event=on_event,
        )  # fmt: skip
    finally:
        stop.set()
        asker.join(timeout=120)
    assert server.completions(PROMPT, LONG)[0] == references[62]  # the last model sent
    for pause in MODES:
        whole = [r for r in results[pause] if len(r) == LONG]
        mixed = [r for r in whole if r not in references.values()]
        partial = [r for r in results[pause] if len(r) < LONG]
        print(f"pause={pause}: {len(results[pause])} completions, {len(mixed)} mixed, {len(partial)} cut "
              f"short; update seconds {seconds[str(pause)]}")  # fmt: skip
        assert len(seconds[str(pause)]) == 6 and len(results[pause]) >= 3, pause
        if pause in ("wait", "abort"):
            assert not mixed, f"pause={pause}: {len(mixed)} of {len(whole)} completions mixed the two models"
        if pause == "wait":
            assert not partial, f"pause='wait' cut {len(partial)} completions short"
        for short in partial:
            assert any(ref[: len(short)] == short for ref in references.values()), short
