"""``reshard plugins list``: installed plugins, what they provide, and whether they can run here."""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.table import Table

from ..plugins import PluginRecord, plugin_records
from .output import console, print_json

STATUS_STYLE = {
    "available": "green",
    "unavailable": "yellow",
    "error": "red",
    "incompatible": "red",
    "disabled": "dim",
}


def provides(record: PluginRecord) -> str:
    """``transports: a, b`` and ``hooks: x`` on separate lines; ``-`` when it provides nothing."""
    parts = []
    if record.transports:
        parts.append("transports: " + ", ".join(record.transports))
    if record.hooks:
        parts.append("hooks: " + ", ".join(record.hooks))
    return "\n".join(parts) or "-"


def plugins_table(records: list[PluginRecord], title: str = "reshard plugins") -> Table:
    """A rich table with one row per record."""
    table = Table(title=title, box=box.SIMPLE_HEAD)
    table.add_column("name", no_wrap=True)
    table.add_column("distribution", overflow="fold")
    table.add_column("version", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("provides")
    table.add_column("reason", overflow="fold", ratio=1)
    for r in records:
        style = STATUS_STYLE.get(r.status, "")
        table.add_row(
            r.name,
            r.distribution or "(in-process)",
            r.version or "-",
            f"[{style}]{r.status}[/{style}]" if style else r.status,
            provides(r),
            r.reason or "",
        )
    return table


def list_plugins(
    json_output: Annotated[
        bool, typer.Option("--json", help="Print sorted JSON on stdout, nothing else.")
    ] = False,
    include_builtin: Annotated[
        bool, typer.Option("--all", help="Also list the built-in hook modules of reshard-core.")
    ] = False,
) -> None:
    """List installed plugins: name, distribution, version, what they provide, status and reason."""
    records = plugin_records(include_builtin=include_builtin)
    if json_output:
        print_json([r.to_dict() for r in records])
    elif records:
        console().print(plugins_table(records))
    else:
        console().print("no reshard plugins installed")


def register(app: typer.Typer) -> None:
    """Add the ``plugins`` command group to ``app``."""
    plugins_app = typer.Typer(help="Inspect installed reshard plugins.", no_args_is_help=True)
    plugins_app.command("list")(list_plugins)
    app.add_typer(plugins_app, name="plugins")
