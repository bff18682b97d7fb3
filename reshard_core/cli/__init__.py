"""The ``reshard`` command line (typer + rich). Entry point: ``reshard_core.cli.main:main``."""
