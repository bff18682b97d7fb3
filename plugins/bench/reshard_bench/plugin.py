"""Hook module of reshard-bench (entry point ``reshard``: ``bench``): adds ``reshard demo`` and
``reshard bench`` to the CLI. Importing it imports neither torch nor the commands' work, so
``reshard --help`` stays quick; each command imports what it runs when it runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from reshard_core import hookimpl

if TYPE_CHECKING:
    import typer

RESHARD_PLUGIN_API = 1


@hookimpl
def reshard_register_commands(app: typer.Typer) -> None:
    """``reshard demo``, then ``reshard bench``."""
    from . import bench_cmd, demo_cmd

    demo_cmd.register(app)
    bench_cmd.register(app)
