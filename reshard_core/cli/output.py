"""Shared CLI output helpers: exit codes, one-line errors on stderr, plain JSON on stdout.

The names in ``__all__`` are what a plugin's commands (``reshard_register_commands``) use to behave
like the core's: same exit codes, same one-line errors, same JSON.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_USAGE",
    "console",
    "error_message",
    "one_line",
    "optional_bytes",
    "print_error",
    "print_json",
    "print_warning",
    "require_transport",
]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) collapsed to one space."""
    return " ".join(text.split())


def error_message(exc: BaseException) -> str:
    """``error: <message>`` on one line; the exception type stands in for an empty message."""
    return f"error: {one_line(str(exc)) or type(exc).__name__}"


def print_error(exc: BaseException) -> None:
    """Write ``error_message(exc)`` to stderr."""
    sys.stderr.write(error_message(exc) + "\n")
    sys.stderr.flush()


def print_warning(text: str) -> None:
    """Write ``warning: <text>`` on one line to stderr."""
    sys.stderr.write(f"warning: {one_line(text)}\n")
    sys.stderr.flush()


def print_json(data: Any) -> None:
    """Write ``data`` to stdout as indented JSON with sorted keys, and nothing else."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    sys.stdout.flush()


def console() -> Console:
    """A rich console on the current ``sys.stdout`` (made per call so captured output works)."""
    return Console(file=sys.stdout)


def optional_bytes(text: str | None) -> int | None:
    """A byte size option (``64MiB``, ``1e9``) or None when the option was not given."""
    if text is None:
        return None
    from .sizes import parse_bytes

    return parse_bytes(text)


def require_transport(name: str) -> None:
    """Unknown transport: ``PluginError`` (usage); known but unavailable here: exit 1 with the reason."""
    import typer

    from ..errors import ReshardError
    from ..transport.registry import get_transport

    reason = get_transport(name).unavailable_reason()
    if reason is not None:
        print_error(ReshardError(f"transport '{name}' is unavailable here: {reason}"))
        raise typer.Exit(EXIT_FAILURE)
