"""``reshard doctor``: what this machine can run (torch, CUDA, NCCL, Gloo) and what each plugin needs."""

from __future__ import annotations

import importlib.metadata as metadata
import platform
from typing import Annotated, Any

import typer
from rich.table import Table

from .. import __version__
from ..plugin_status import FAILED_STATUSES, PluginRecord
from ..plugins import plugin_records
from ..transport.registry import transport_names
from .output import EXIT_FAILURE, console, print_json
from .plugins_cmd import STATUS_STYLE


def requirements(distribution: str | None) -> list[str]:
    """The declared requirements of ``distribution`` (empty for in-process plugins)."""
    if distribution is None:
        return []
    try:
        return list(metadata.requires(distribution) or [])
    except metadata.PackageNotFoundError:
        return []


def machine_report() -> dict[str, Any]:
    """Versions and backend availability of this machine, as plain data."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    distributed = dist.is_available()
    return {
        "python": platform.python_version(),
        "reshard_core": __version__,
        "torch": torch.__version__,
        "torch_cuda_build": torch.version.cuda,
        "cuda_available": cuda,
        "cuda_devices": torch.cuda.device_count() if cuda else 0,
        "gloo_available": bool(distributed and dist.is_gloo_available()),
        "nccl_available": bool(distributed and cuda and dist.is_nccl_available()),
        "transports": transport_names(),
    }


def plugin_report(record: PluginRecord) -> dict[str, Any]:
    """A plugin record plus the requirements its distribution declares."""
    return {**record.to_dict(), "requires": requirements(record.distribution)}


def doctor(
    json_output: Annotated[
        bool, typer.Option("--json", help="Print sorted JSON on stdout, nothing else.")
    ] = False,
) -> None:
    """Show torch, CUDA, NCCL and Gloo availability and every plugin's status and needs.

    Exits 1 when a plugin failed to load or is incompatible.
    """
    report = machine_report()
    records = plugin_records(check=True)
    plugins = [plugin_report(r) for r in records]
    if json_output:
        print_json({"machine": report, "plugins": plugins})
    else:
        out = console()
        machine = Table(title="machine", show_header=False)
        machine.add_column("what")
        machine.add_column("value", overflow="fold")
        for key, value in report.items():
            machine.add_row(key, ", ".join(value) if isinstance(value, list) else str(value))
        out.print(machine)
        table = Table(title="plugins")
        for column in ("name", "status", "needs", "reason"):
            table.add_column(column, overflow="fold")
        for p in plugins:
            style = STATUS_STYLE.get(p["status"], "")
            table.add_row(
                p["name"],
                f"[{style}]{p['status']}[/{style}]",
                "\n".join(p["requires"]) or "-",
                p["reason"] or "",
            )
        out.print(table if plugins else "no reshard plugins installed")
    if any(r.status in FAILED_STATUSES for r in records):
        raise typer.Exit(EXIT_FAILURE)


def register(app: typer.Typer) -> None:
    """Add the ``doctor`` command to ``app``."""
    app.command("doctor")(doctor)
