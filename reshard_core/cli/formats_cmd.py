"""``reshard formats list``: the model formats refit can map between, in detection order."""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.table import Table

from .output import console, print_json


def list_formats(
    json_output: Annotated[
        bool, typer.Option("--json", help="Print JSON on stdout (detection order), nothing else.")
    ] = False,
) -> None:
    """List model formats: name, the plugin providing it, what it describes, the HF model types it maps."""
    from ..formats.registry import format_providers

    rows = [
        {"name": f.name, "provider": p, "description": f.description, "model_types": _types(f)}
        for f, p in format_providers()
    ]
    if json_output:
        print_json(rows)
        return
    table = Table(title="reshard model formats (detection order)", box=box.SIMPLE_HEAD)
    table.add_column("name", no_wrap=True)
    table.add_column("provider", overflow="fold")
    table.add_column("describes", overflow="fold", ratio=1)
    table.add_column("model types", overflow="fold", ratio=1)
    for row in rows:
        types = row["model_types"]
        listed = "any" if types is None else ", ".join(types)
        table.add_row(row["name"], row["provider"], row["description"], listed)
    console().print(table)


def _types(fmt: object) -> list[str] | None:
    """A format's model types (None: any), whatever a third party's format returns."""
    found = getattr(fmt, "model_types", None)
    types = found() if callable(found) else None
    return None if types is None else [str(t) for t in types]


def register(app: typer.Typer) -> None:
    """Add the ``formats`` command group to ``app``."""
    formats_app = typer.Typer(help="Inspect model formats (naming, fusing and padding conventions).")
    formats_app.command("list")(list_formats)
    app.add_typer(formats_app, name="formats")
