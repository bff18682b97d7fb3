"""What ``reshard demo`` and ``reshard bench`` share: options checked into a usage error, and a
local world run under a spinner on stderr whose failure is one error line."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import typer
from rich.console import Console
from rich.status import Status

from reshard_core import PluginError, ReshardError
from reshard_core.cli.output import EXIT_FAILURE, EXIT_USAGE, print_error, require_transport

Options = TypeVar("Options")


def checked_options(build: Callable[[], Options], transport: str) -> Options:
    """``build()``'s options once ``transport`` is known here; a ``ValueError`` or ``PluginError`` on
    the way is a usage error (one line, exit 2)."""
    try:
        opts = build()
        require_transport(transport)
    except (ValueError, PluginError) as exc:
        print_error(exc)
        raise typer.Exit(EXIT_USAGE) from None
    return opts


@contextmanager
def world_status(what: str, text: str) -> Iterator[Status]:
    """A spinner on stderr showing ``text`` (update it through the status yielded) while a world runs
    inside; a ``WorldError`` becomes ``error: the <what> world failed: <first failure>`` and exit 1."""
    from reshard_core.testing.world import WorldError  # imports torch: only once a world runs

    err = Console(file=sys.stderr)
    with err.status(text, spinner="dots") as status:
        try:
            yield status
        except WorldError as exc:
            first = next(iter(exc.failures.values()), str(exc).splitlines()[0])
            print_error(ReshardError(f"the {what} world failed: {first}"))
            raise typer.Exit(EXIT_FAILURE) from None
