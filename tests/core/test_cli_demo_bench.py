"""``reshard demo`` and ``reshard bench`` end to end (spawned Gloo worlds), usage errors, exit codes."""

from __future__ import annotations

import json
import math

import pytest
from reshard_bench import bench_cmd, demo_cmd
from reshard_bench.gpt import PRESETS, tp_placement

from reshard_core.cli.main import main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    out, err = capsys.readouterr()
    return info.value.code or 0, out, err


@pytest.mark.slow
def test_demo_refits_fsdp2_into_tp_and_verifies_every_element(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = _run(capsys, "demo", "--model", "tiny", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["verified"] and report["problems"] == []
    assert report["src"] == {"layout": "fsdp=4", "style": "fsdp2"}
    assert report["dst"] == {"layout": "tp=2,dp=2", "style": "declared"}
    assert report["plan_reused"]
    assert report["bytes_moved"] == report["bytes_remote"] + report["bytes_local"] > 0
    # every rank checks what it holds: TP-split weights once per replica, the rest on all 4 ranks
    held = {n: math.prod(s) * (2 if tp_placement(n) else 4) for n, s in PRESETS["tiny"].tensors().items()}
    assert report["elements_checked"] == sum(held.values())
    demo_cmd._print(report)  # the human table of this real report reads at 80 columns
    table = capsys.readouterr().out
    assert "verified" in table and max(len(line) for line in table.splitlines()) <= 80, table


@pytest.mark.slow
def test_bench_compares_with_the_wire_floor_and_megatron_core(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    pytest.importorskip("megatron.core")
    argv = "bench --size tiny --pair tp=2->tp=4 --reps 2 --warmup 0 --model megatron-gpt --json"
    code, out, err = _run(capsys, *argv.split())
    assert code == 0, err
    report = json.loads(out)
    assert report["megatron_core"] is True and report["megatron_skipped"] is None
    for line in report["warnings"]:  # repetitions 2x apart on a loaded machine are said on stderr
        assert f"warning: {line}" in err
    (row,) = report["rows"]
    ours, megatron = row["ours"], row["megatron"]
    assert row["pair"] == "tp=2->tp=4"
    assert ours["verified"] and ours["plan_reused"] and len(ours["refit_runs"]) == 2
    assert ours["floor_bytes"] == ours["bytes_remote"] > 0  # the floor moves exactly what the refit sends
    assert ours["floor_with_local_seconds"] > 0
    assert megatron["finished"] and megatron["verified"] and len(megatron["runs"]) == 2
    assert row["floor_ratio"] == ours["refit_seconds"] / ours["floor_seconds"]
    assert row["speedup"] == megatron["seconds"] / ours["refit_seconds"]
    assert row["speedup_bound"] == megatron["seconds"] / ours["floor_with_local_seconds"]
    assert row["of_bound"] == row["speedup"] / row["speedup_bound"]
    # the layout floor copies every local byte and packs the row-parallel column slices it sends
    assert ours["layout_copy_bytes"] > ours["bytes_local"] > 0 and len(ours["layout_floor_runs"]) == 2
    assert row["layout_floor_ratio"] == ours["refit_seconds"] / ours["layout_floor_seconds"]
    bench_cmd._print(report)  # the human tables of this real report read at 80 columns
    tables = capsys.readouterr().out
    assert "against Megatron-Core's refit" in tables and "these layouts force" in tables, tables
    assert max(len(line) for line in tables.splitlines()) <= 80, tables


USAGE_ERRORS = [
    ("demo --src tp=3", "bad layout 'tp=3': 3 ranks do not divide a world of 4"),
    ("demo --model huge", "unknown model 'huge'; choose from tiny, small, bench, megatron-gpt"),
    ("demo --dst tp=2,ep=2", "bad layout 'tp=2,ep=2': this model takes tp, pp, dp and fsdp (not ep)"),
    ("demo --src fsdp=2,tp=2", "bad layout 'fsdp=2,tp=2': fsdp cannot be combined with tp or pp here"),
    ("demo --max-batch-bytes lots", "bad byte size 'lots': use e.g. 4096, 64MiB or 1GB"),
    ("demo --world-size 1", "--world-size must be at least 2, got 1"),
    ("bench --pair tp=2", "bad layout pair 'tp=2': expected SRC->DST, e.g. tp=2->tp=4"),
    ("bench --size huge", "unknown size 'huge'; choose from tiny, small, bench"),
    ("bench --pair fsdp=4->tp=4", "layout 'fsdp=4': the benchmark builds tp, pp and dp layouts"),
]


@pytest.mark.parametrize(("argv", "message"), USAGE_ERRORS)
def test_bad_arguments_are_one_line_usage_errors(capsys, argv, message):
    code, out, err = _run(capsys, *argv.split())
    assert (code, out, err) == (2, "", f"error: {message}\n")


def test_an_unknown_transport_is_a_usage_error(capsys):
    code, _, err = _run(capsys, "demo", "--transport", "carrier-pigeon")
    assert code == 2
    assert err.startswith("error: unknown transport 'carrier-pigeon'; known transports: ")
    assert "gloo" in err


def test_a_verification_failure_exits_1_naming_what_differs(capsys, monkeypatch):
    from reshard_bench import demo_cmd
    from reshard_bench.demo import DemoOptions, summarize

    def rank_result(r: int) -> dict:
        counts = {"bytes_sent": 8, "bytes_local": 2, "messages": 1, "batches": 1}
        return {
            "rank": r, "styles": ("fsdp2", "declared"), "elements": 10, "cold_seconds": 0.5,
            "warm_seconds": 0.25, "cold": {"seconds": {"plan": 0.1}, "reused_plan": False, **counts},
            "warm": {"seconds": {}, "reused_plan": True, **counts},
            "problems": [f"w: 3 of 10 elements differ on rank {r}"] if r else [],
        }  # fmt: skip

    ranks = [rank_result(r) for r in range(2)]
    report = summarize(DemoOptions(model="tiny", src="fsdp=2", dst="tp=2", world=2), ranks)
    assert (report["bytes_moved"], report["refit_seconds"], report["verified"]) == (20, 0.25, False)
    monkeypatch.setattr(demo_cmd, "_run", lambda opts, timeout: report)
    code, out, err = _run(capsys, "demo", "--world-size", "2", "--model", "tiny")
    assert code == 1
    assert "NO: 1 weights differ" in out
    assert err == "error: verification failed: w: 3 of 10 elements differ on rank 1\n"
