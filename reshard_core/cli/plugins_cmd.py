"""``reshard plugins list``: installed plugins, what they provide, and whether they can run here."""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.table import Table

from ..plugin_status import PluginRecord
from ..plugins import plugin_records
from .output import console, print_json

STATUS_STYLE = {
    "available": "green",
    "unavailable": "yellow",
    "error": "red",
    "incompatible": "red",
    "disabled": "dim",
    "unchecked": "dim",
}


UNCHECKED_NOTE = "unchecked: not probed; --check asks each plugin (imports torch)"


def provides(record: PluginRecord) -> str:
    """``transports: a, b`` and ``hooks: x`` on separate lines; ``-`` when it provides nothing.

    Hook names drop their common ``reshard_`` prefix to fit narrow terminals (JSON keeps them whole).
    """
    parts = []
    if record.transports:
        parts.append("transports: " + ", ".join(record.transports))
    if record.hooks:
        parts.append("hooks: " + ", ".join(h.removeprefix("reshard_") for h in record.hooks))
    return "\n".join(parts) or "-"


def plugins_table(records: list[PluginRecord], title: str = "reshard plugins") -> Table:
    """A rich table with one row per record that reads at 80 columns (long cells fold).

    An ``unchecked`` row leaves its reason to one note under the table.
    """
    unchecked = any(r.status == "unchecked" for r in records)
    table = Table(title=title, box=box.SIMPLE_HEAD, caption=UNCHECKED_NOTE if unchecked else None)
    table.add_column("plugin", overflow="fold")
    table.add_column("status", no_wrap=True)
    table.add_column("provides", overflow="fold")
    table.add_column("reason", overflow="fold", ratio=1)
    for r in records:
        style = STATUS_STYLE.get(r.status, "")
        origin = f"{r.distribution} {r.version or '-'}" if r.distribution else "(in-process)"
        table.add_row(
            f"{r.name}\n[dim]{origin}[/dim]",
            f"[{style}]{r.status}[/{style}]" if style else r.status,
            provides(r),
            "" if r.status == "unchecked" else r.reason or "",
        )
    return table


def list_plugins(
    json_output: Annotated[
        bool, typer.Option("--json", help="Print sorted JSON on stdout, nothing else.")
    ] = False,
    include_builtin: Annotated[
        bool, typer.Option("--all", help="Also list the built-in hook module of reshard-core.")
    ] = False,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Load every transport entry point and ask each plugin whether it can run here "
            "(imports torch); without it such plugins are listed as unchecked.",
        ),
    ] = False,
) -> None:
    """List installed plugins: name, distribution, version, what they provide, status and reason.

    Import failures, API mismatches and conflicts show without --check; a broken transport entry
    point or a missing device shows with --check (and in ``reshard doctor``).
    """
    records = plugin_records(include_builtin=include_builtin, check=check)
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
