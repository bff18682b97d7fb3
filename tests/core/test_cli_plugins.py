"""The ``reshard`` CLI: ``plugins list``, ``doctor``, plugin commands, one-line errors and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import typer

from reshard_core.cli.main import CORE_COMMAND_MODULES, build_app, main
from reshard_core.hookspecs import hookimpl
from reshard_core.plugins import register_plugin, reset_plugin_manager

PLUGIN_FIXTURES = Path(__file__).parent / "fixtures"

BROKEN_RECORD = {
    "name": "broken",
    "distribution": "broken-reshard-plugin",
    "version": "0.1",
    "transports": [],
    "hooks": [],
    "status": "error",
    "reason": "RuntimeError: broken on purpose",
}
STRICT_BROKEN_LINE = (
    "error: plugin 'broken' (broken-reshard-plugin 0.1) failed to load: "
    "RuntimeError: broken on purpose (RESHARD_STRICT_PLUGINS=1)\n"
)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``reshard argv`` in this process; returns (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    captured = capsys.readouterr()
    return exit_info.value.code or 0, captured.out, captured.err


def run_installed_cli(
    *argv: str, pythonpath: tuple[str, ...] = (), **env: str
) -> subprocess.CompletedProcess[str]:
    """Run the installed CLI in a fresh interpreter, with extra folders on PYTHONPATH."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_")}
    environ.update(env, COLUMNS="250")
    environ["PYTHONPATH"] = os.pathsep.join([*pythonpath, environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run(
        [sys.executable, "-m", "reshard_core.cli.main", *argv],
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
        check=False,
    )


# (a) a broken plugin distribution put on sys.path of a real `reshard` process.


def test_broken_distribution_is_listed_and_listing_exits_0():
    broken = str(PLUGIN_FIXTURES / "broken_plugin")
    proc = run_installed_cli("plugins", "list", "--json", pythonpath=(broken,))
    assert (proc.returncode, proc.stderr) == (0, "")
    records = json.loads(proc.stdout)
    assert [r for r in records if r["name"] == "broken"] == [BROKEN_RECORD]
    assert [r["name"] for r in records] == sorted(r["name"] for r in records)


def test_broken_distribution_in_strict_mode_exits_1_with_one_line():
    proc = run_installed_cli(
        "plugins", "list", pythonpath=(str(PLUGIN_FIXTURES / "broken_plugin"),), RESHARD_STRICT_PLUGINS="1"
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", STRICT_BROKEN_LINE)


def test_table_names_the_failure(plugin_fixtures, capsys, monkeypatch):
    plugin_fixtures("broken_plugin", "good_plugins")
    monkeypatch.setenv("COLUMNS", "250")
    code, out, err = run_cli(capsys, "plugins", "list", "--check")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    rows = {
        line.split()[0]: (line.split(), lines[i + 1].split())
        for i, line in enumerate(lines[:-1])
        if line.startswith("  ") and not line.startswith("   ")
    }
    assert rows["broken"] == (
        ["broken", "error", "-", "RuntimeError:", "broken", "on", "purpose"],
        ["broken-reshard-plugin", "0.1"],
    )
    assert rows["hooked"] == (
        ["hooked", "unavailable", "transports:", "alpha", "needs", "a", "flux", "capacitor"],
        ["fixture-hooked", "0.2", "hooks:", "plan_tensor,", "register_commands"],
    )
    assert rows["heavy"] == (["heavy", "available", "transports:", "heavy"], ["fixture-transports", "0.3"])
    assert "unchecked" not in out


def test_listing_without_check_names_failures_and_leaves_availability_unchecked(
    plugin_fixtures, capsys, monkeypatch
):
    plugin_fixtures("broken_plugin", "good_plugins")
    monkeypatch.setenv("COLUMNS", "250")
    code, out, err = run_cli(capsys, "plugins", "list")
    assert (code, err) == (0, "")
    statuses = {
        line.split()[0]: line.split()[1:]
        for line in out.splitlines()
        if line.startswith("  ") and not line.startswith("   ")
    }
    assert statuses["broken"] == ["error", "-", "RuntimeError:", "broken", "on", "purpose"]
    assert statuses["hooked"] == ["unchecked", "transports:", "alpha"]
    assert statuses["missing"] == ["unchecked", "transports:", "missing"]
    assert out.splitlines()[-1].strip() == "unchecked: not probed; --check asks each plugin (imports torch)"


def test_check_and_doctor_show_a_broken_transport_entry_point_as_an_error(plugin_fixtures, capsys):
    plugin_fixtures("broken_transport")
    code, out, err = run_cli(capsys, "plugins", "list", "--json", "--check")
    assert (code, err) == (0, "")
    assert {r["name"]: r["status"] for r in json.loads(out)} == {"sad": "error", "wrongtype": "error"}
    code, out, err = run_cli(capsys, "doctor", "--json")
    assert (code, err) == (1, "")
    assert {p["name"]: (p["status"], p["reason"]) for p in json.loads(out)["plugins"]} == {
        "sad": (
            "error",
            "transport 'sad' (fixture-sad 0.5) failed to load: AttributeError: module "
            "'fixture_sad_plugin' has no attribute 'GoneCopyService'",
        ),
        "wrongtype": (
            "error",
            "transport 'wrongtype' (fixture-wrongtype 0.6) points to "
            "fixture_wrongtype_plugin:NOT_A_CLASS, which is not a CopyService subclass",
        ),
    }


TORCH_PROBE = """
import sys
from reshard_core.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code or 0
sys.stderr.write(f"exit={code} torch={'torch' in sys.modules}\\n")
"""


@pytest.mark.parametrize(
    "argv",
    [("--help",), ("plugins", "list", "--json"), ("plugins", "list", "--all"), ("plugins", "list", "--help")],
)
def test_help_and_listing_import_no_torch(argv):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_")}
    proc = subprocess.run(
        [sys.executable, "-c", TORCH_PROBE, *argv],
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
        check=False,
    )
    assert proc.stderr.splitlines()[-1] == "exit=0 torch=False", proc.stderr


def test_strict_mode_in_process(plugin_fixtures, capsys, monkeypatch):
    plugin_fixtures("broken_plugin")
    monkeypatch.setenv("RESHARD_STRICT_PLUGINS", "1")
    assert run_cli(capsys, "plugins", "list", "--json") == (1, "", STRICT_BROKEN_LINE)


def test_json_is_sorted_and_alone_on_stdout(plugin_fixtures, capsys):
    plugin_fixtures("broken_plugin", "api_plugins")
    code, out, err = run_cli(capsys, "plugins", "list", "--json")
    assert (code, err) == (0, "")
    records = json.loads(out)
    assert [r["name"] for r in records] == ["broken", "noapi", "oldapi", "raising", "typo"]
    assert records[0] == BROKEN_RECORD
    assert out == json.dumps(records, indent=2, sort_keys=True) + "\n"


def test_disabled_by_env_in_listing(plugin_fixtures, capsys, monkeypatch):
    plugin_fixtures("broken_plugin")
    monkeypatch.setenv("RESHARD_DISABLE_PLUGINS", "broken")
    monkeypatch.setenv("RESHARD_STRICT_PLUGINS", "1")
    code, out, err = run_cli(capsys, "plugins", "list", "--json")
    assert (code, err) == (0, "")
    assert json.loads(out) == [
        {**BROKEN_RECORD, "status": "disabled", "reason": "disabled by RESHARD_DISABLE_PLUGINS"}
    ]


def test_no_plugins_installed(plugin_fixtures, capsys):
    plugin_fixtures()
    assert run_cli(capsys, "plugins", "list") == (0, "no reshard plugins installed\n", "")
    assert run_cli(capsys, "plugins", "list", "--json") == (0, "[]\n", "")


# (b) hook plugins add commands; a failing one loses only its own commands.


def test_entry_point_plugin_adds_a_command(plugin_fixtures, capsys):
    plugin_fixtures("good_plugins")
    assert run_cli(capsys, "hello", "--who", "tests") == (0, "hello tests from fixture-hooked\n", "")


class Exploding:
    @hookimpl
    def reshard_register_commands(self, app):
        raise RuntimeError("no commands today")


def test_failing_command_hook_warns_and_the_rest_works(plugin_fixtures, capsys, monkeypatch):
    plugin_fixtures("good_plugins")
    register_plugin(Exploding())
    code, out, err = run_cli(capsys, "hello")
    assert (code, out) == (0, "hello world from fixture-hooked\n")
    failure = "plugin 'Exploding' failed to register its commands: RuntimeError: no commands today"
    assert err == f"warning: {failure}\n"
    monkeypatch.setenv("RESHARD_STRICT_PLUGINS", "1")
    monkeypatch.setenv("RESHARD_DISABLE_PLUGINS", "missing,notservice")
    assert run_cli(capsys, "hello") == (1, "", f"error: {failure}\n")


def test_core_commands_are_plain_imports_and_demo_and_bench_come_from_reshard_bench(plugin_fixtures, capsys):
    def commands() -> dict:
        return typer.main.get_command(build_app()).commands

    modules = [m.__name__.rsplit(".", 1)[1] for m in CORE_COMMAND_MODULES]
    assert modules == ["plugins_cmd", "doctor_cmd", "plan_cmd", "formats_cmd"]
    installed = commands()  # this machine's plugins, reshard-bench among them
    assert {"plugins", "doctor", "plan", "formats"} <= set(installed)
    for name in ("demo", "bench"):
        assert installed[name].callback.__module__ == f"reshard_bench.{name}_cmd"
    plugin_fixtures()  # no plugin installed: the core's commands only, and typer's unknown command
    reset_plugin_manager()
    assert sorted(commands()) == ["doctor", "formats", "plan", "plugins"]
    code, _, err = run_cli(capsys, "demo")
    assert code == 2 and "No such command 'demo'" in err


# Exit codes and one-line errors.


def test_usage_errors_exit_2(plugin_fixtures, capsys):
    plugin_fixtures()
    code, out, err = run_cli(capsys, "plugins", "list", "--bogus")
    assert (code, out) == (2, "")
    assert "No such option: --bogus" in err
    assert run_cli(capsys, "nope")[0] == 2
    assert run_cli(capsys)[0] == 2


def test_bad_strict_value_is_one_line(plugin_fixtures, capsys, monkeypatch):
    plugin_fixtures()
    monkeypatch.setenv("RESHARD_STRICT_PLUGINS", "maybe")
    assert run_cli(capsys, "plugins", "list") == (
        1,
        "",
        "error: RESHARD_STRICT_PLUGINS must be 0 or 1, got 'maybe'\n",
    )


# doctor


def test_doctor_json(plugin_fixtures, capsys, monkeypatch):
    plugin_fixtures("good_plugins")
    monkeypatch.setenv("RESHARD_DISABLE_PLUGINS", "missing,notservice")
    code, out, err = run_cli(capsys, "doctor", "--json")
    assert (code, err) == (0, "")
    report = json.loads(out)
    machine = report["machine"]
    assert machine["torch"] == torch.__version__
    assert machine["cuda_available"] is torch.cuda.is_available()
    assert machine["gloo_available"] is True
    assert machine["transports"] == ["alpha", "beta", "heavy", "missing", "notservice"]
    assert sorted(machine) == [
        "cuda_available",
        "cuda_devices",
        "gloo_available",
        "nccl_available",
        "python",
        "reshard_core",
        "torch",
        "torch_cuda_build",
        "transports",
    ]
    hooked = [p for p in report["plugins"] if p["name"] == "hooked"]
    assert hooked == [
        {
            "name": "hooked",
            "distribution": "fixture-hooked",
            "version": "0.2",
            "transports": ["alpha"],
            "hooks": ["reshard_plan_tensor", "reshard_register_commands"],
            "status": "unavailable",
            "reason": "needs a flux capacitor",
            "requires": ["reshard-core>=0.1", "flux-capacitor>=1.21"],
        }
    ]


def test_doctor_exits_1_when_a_plugin_failed(plugin_fixtures, capsys, monkeypatch):
    plugin_fixtures("broken_plugin")
    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = run_cli(capsys, "doctor")
    assert (code, err) == (1, "")
    assert "torch" in out and torch.__version__ in out
    assert "RuntimeError: broken on purpose" in out


# (d) the README install: four plugins, availability on a CPU machine.


@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the CPU-machine statuses")
def test_readme_install_lists_the_four_plugins(fresh_plugin_manager, capsys):
    code, out, err = run_cli(capsys, "plugins", "list", "--json", "--check")
    assert (code, err) == (0, "")
    records = {r["name"]: r for r in json.loads(out)}
    assert {"gloo", "nccl", "nvshmem", "mxfp8"} <= set(records)
    assert {name: records[name]["status"] for name in ("gloo", "mxfp8", "nccl", "nvshmem")} == {
        "gloo": "available",
        "mxfp8": "available",
        "nccl": "unavailable",
        "nvshmem": "unavailable",
    }
    assert records["nccl"]["reason"] and records["nvshmem"]["reason"]
    assert records["gloo"]["transports"] == ["gloo"]
    assert records["nccl"]["transports"] == ["nccl"]
    assert records["nvshmem"]["transports"] == ["nvshmem"]
