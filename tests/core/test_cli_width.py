"""Every ``reshard`` table reads at 80 columns: no line of its output is longer (COLUMNS=80)."""

from __future__ import annotations

from pathlib import Path

import pytest
from reshard_bench import bench_cmd, demo_cmd

from reshard_core.cli.main import main

WIDTH = 80
FIXTURES = Path(__file__).parent / "fixtures"


def longest_line(text: str) -> int:
    return max(len(line) for line in text.splitlines())


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit):
        main(list(argv))
    return capsys.readouterr().out


@pytest.fixture(autouse=True)
def narrow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", str(WIDTH))


PLUGIN_COMMANDS = [
    ("plugins", "list"),
    ("plugins", "list", "--all"),
    ("plugins", "list", "--check"),
    ("doctor",),
]
COMMANDS = [
    ["formats", "list"],
    "plan --model llama3-8b --src tp=2,pp=2 --dst tp=4".split(),
    "plan --model llama3-8b --src tp=2,pp=2 --dst tp=4 --src-format megatron --dst-format vllm".split(),
]


@pytest.mark.parametrize("argv", PLUGIN_COMMANDS, ids=" ".join)
def test_plugin_tables_fit_80_columns(plugin_fixtures, capsys, argv):
    # Broken, conflicting and long-named fixture plugins make the longest cells.
    plugin_fixtures("broken_plugin", "good_plugins", "broken_transport", "conflicts")
    out = run_cli(capsys, *argv)
    assert all(name in out for name in ("broken", "hooked", "notservice", "wrongtype", "twin", "dupe"))
    assert longest_line(out) <= WIDTH, out


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_command_output_fits_80_columns(fresh_plugin_manager, capsys, argv):
    out = run_cli(capsys, *argv)
    assert out.count("\n") > 5
    assert longest_line(out) <= WIDTH, out


def bench_report(megatron: bool) -> dict:
    ours = {
        "refit_seconds": 0.01234,
        "floor_seconds": 0.01011,
        "floor_with_local_seconds": 0.01111,
        "layout_floor_seconds": 0.01122,
        "layout_copy_bytes": 120_000_000,
        "bytes_remote": 190_000_000,
        "bytes_local": 95_000_000,
        "verified": True,
    }
    done = {"finished": True, "seconds": 0.5123, "verified": False, "deadline": 60.0}
    rows = [
        {
            "pair": "tp=2,pp=2,dp=1->tp=4,dp=1",
            "ours": ours,
            "floor_ratio": 1.22,
            "floor_with_local_ratio": 1.11,
            "layout_floor_ratio": 1.1,
            "megatron": done,
            "speedup": 41.5,
            "speedup_bound": 46.1,
            "of_bound": 0.9,
        },
        {"pair": "tp=4->tp=2,dp=2", "ours": None, "megatron": {"finished": False, "deadline": 120.0}},
    ]
    options = {
        "model": "megatron-gpt",
        "size": "bench",
        "dtype": "bf16",
        "world": 4,
        "transport": "gloo",
        "reps": 5,
    }
    return {"options": options, "model_bytes": 380_000_000, "megatron_core": megatron, "rows": rows}


@pytest.mark.parametrize("megatron", [False, True])
def test_bench_tables_fit_80_columns(capsys, megatron):
    bench_cmd._print(bench_report(megatron))
    out = capsys.readouterr().out
    assert longest_line(out) <= WIDTH, out
    assert ("did not" in out and "0.512 (NOT" in out and "90%" in out) is megatron
    assert "layout" in out and "1.10×" in out and "120" in out


def test_demo_table_fits_80_columns(capsys):
    report = {
        "model": "megatron-gpt",
        "dtype": "bf16",
        "world_size": 4,
        "transport": "gloo",
        "refit_seconds": 0.0123,
        "batches": 3,
        "src": {"layout": "tp=2,pp=2", "style": "megatron-style attributes"},
        "dst": {"layout": "tp=2,dp=2", "style": "declared"},
        "bytes_moved": 123_000_000,
        "bytes_remote": 100_000_000,
        "bytes_local": 23_000_000,
        "messages": 12,
        "first_refit_seconds": 1.2,
        "prepare_seconds": 0.3,
        "gb_per_s": 1.23,
        "plan_reused": True,
        "verified": True,
        "elements_checked": 123_456_789,
        "problems": [],
    }
    demo_cmd._print(report)
    out = capsys.readouterr().out
    assert longest_line(out) <= WIDTH, out
    assert "yes, all 123,456,789 elements equal the source" in out
