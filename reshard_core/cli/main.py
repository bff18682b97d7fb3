"""The ``reshard`` command: builds the typer app from the core commands (``plugins``, ``doctor``,
``plan``, ``formats``) and plugins' ``reshard_register_commands`` hooks (``demo`` and ``bench`` come
from reshard-bench's), and turns ``ReshardError`` and typer's usage errors (an unknown option, a
missing one, a value of the wrong type) into one line on stderr. Only typer's own names are used
(typer 0.29 and newer vendor click: no click is installed or imported).

Exit codes: 0 ok, 1 failure, 2 usage error.
"""

from __future__ import annotations

from collections.abc import Sequence

import typer
from typer.exceptions import TyperException

from ..errors import PluginError, ReshardError
from ..plugin_status import strict_mode
from ..plugins import get_plugin_manager
from . import doctor_cmd, formats_cmd, plan_cmd, plugins_cmd
from .output import EXIT_FAILURE, EXIT_USAGE, print_error, print_warning

CORE_COMMAND_MODULES = (plugins_cmd, doctor_cmd, plan_cmd, formats_cmd)
"""The core's command modules, registered in this order; each has ``register(app: typer.Typer)``."""


def register_plugin_commands(app: typer.Typer) -> None:
    """Call every plugin's ``reshard_register_commands(app=app)``.

    Each implementation is called on its own, so one failing plugin only loses its own commands
    (a warning on stderr); in strict mode the failure raises ``PluginError``.
    """
    caller = get_plugin_manager().hook.reshard_register_commands
    for impl in reversed(caller.get_hookimpls()):
        try:
            impl.function(**{arg: app for arg in impl.argnames})
        except Exception as exc:
            message = (
                f"plugin '{impl.plugin_name}' failed to register its commands: {type(exc).__name__}: {exc}"
            )
            if strict_mode():
                raise PluginError(message) from exc
            print_warning(message)


def build_app() -> typer.Typer:
    """The root ``reshard`` app with every command available in this installation."""
    app = typer.Typer(
        name="reshard",
        help="Move model weights between parallel layouts, exactly and fast.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    for module in CORE_COMMAND_MODULES:
        module.register(app)
    register_plugin_commands(app)
    return app


_USAGE_ERRORS = (TyperException, typer.Abort)


def _usage_error(exc: Exception) -> int:
    """Show a typer error (usage, missing or bad value, abort) as one line; its exit code."""
    if type(exc).__name__ == "NoArgsIsHelpError":  # a bare group: typer printed its help already
        return EXIT_USAGE
    if isinstance(exc, typer.Abort):  # Ctrl-C at a prompt
        print_error(ReshardError("aborted"))
        return EXIT_FAILURE
    ctx = getattr(exc, "ctx", None)
    where = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    print_error(ReshardError(exc.format_message() + where))
    return int(getattr(exc, "exit_code", EXIT_USAGE))


def main(argv: Sequence[str] | None = None) -> None:
    """Run the CLI on ``argv`` (default: ``sys.argv[1:]``); always ends in ``SystemExit``."""
    try:
        app = build_app()
        code = app(args=list(argv) if argv is not None else None, prog_name="reshard", standalone_mode=False)
    except ReshardError as exc:
        print_error(exc)
        raise SystemExit(EXIT_FAILURE) from None
    except _USAGE_ERRORS as exc:
        raise SystemExit(_usage_error(exc)) from None
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
