"""``reshard bench``: warm refit seconds per layout pair against the wire floor and Megatron-Core.

Exit codes: 0 measured and every result verified, 1 a rank failed or a result was not exact,
2 bad arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from reshard_core import ReshardError
from reshard_core.cli.output import (
    EXIT_FAILURE,
    console,
    optional_bytes,
    print_error,
    print_json,
    print_warning,
)

from .commands import checked_options, world_status


def bench_command(
    pair: Annotated[
        list[str] | None,
        typer.Option(
            "--pair",
            help="SRC->DST layouts, repeatable (default: tp=2->tp=4, tp=1->tp=4, "
            "tp=4->tp=2,pp=2, tp=2,pp=2->tp=1); dp fills the world.",
        ),
    ] = None,  # fmt: skip
    model: Annotated[str, typer.Option(help="auto, gpt (pure torch) or megatron-gpt.")] = "auto",
    size: Annotated[str, typer.Option(help="Model size: tiny, small or bench (0.38 GB in bf16).")] = "bench",
    world_size: Annotated[int, typer.Option("--world-size", "-n", help="Processes.")] = 4,
    reps: Annotated[int, typer.Option(help="Timed warm refits per pair (the median is reported).")] = 5,
    warmup: Annotated[int, typer.Option(help="Untimed refits after the first.")] = 1,
    transport: Annotated[str, typer.Option(help="Transport plugin name.")] = "gloo",
    max_batch_bytes: Annotated[str | None, typer.Option(help="Staging budget per batch, e.g. 64MiB.")] = None,
    megatron: Annotated[
        bool, typer.Option("--megatron/--no-megatron", help="Compare with Megatron-Core when installed.")
    ] = True,
    megatron_deadline: Annotated[
        float, typer.Option(help="Seconds a Megatron-Core case may take before it is reported unfinished.")
    ] = 120.0,
    dtype: Annotated[str, typer.Option(help="bf16 or fp32.")] = "bf16",
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
) -> None:
    """Benchmark warm refits: median seconds, the wire floor and the ratio, Megatron-Core's refit."""
    from .refit_bench import DEFAULT_PAIRS, BenchOptions, check_options

    def build() -> BenchOptions:
        opts = BenchOptions(
            model=model, size=size, pairs=tuple(pair or DEFAULT_PAIRS), world=world_size, reps=reps,
            warmup=warmup, transport=transport, max_batch_bytes=optional_bytes(max_batch_bytes),
            megatron=megatron, megatron_deadline=megatron_deadline, dtype=dtype,
        )  # fmt: skip
        check_options(opts)
        return opts

    opts = checked_options(build, transport)
    report = _run(opts)
    print_notes(report)
    if as_json:
        print_json(report)
    else:
        _print(report)
    unverified = [r["pair"] for r in report["rows"] if r["ours"] is not None and not r["ours"]["verified"]]
    if unverified:
        print_error(ReshardError(f"refit result not exact for {', '.join(unverified)}"))
        raise typer.Exit(EXIT_FAILURE)


def print_notes(report: dict[str, Any]) -> None:
    """On stderr: why Megatron-Core was not compared, and each measurement whose repetitions disagree."""
    if report.get("megatron_skipped"):
        print_warning(f"Megatron-Core comparison skipped: {report['megatron_skipped']}")
    for line in report.get("warnings", ()):
        print_warning(line)


def _run(opts: Any) -> dict[str, Any]:
    from .refit_bench import run_bench

    with world_status("benchmark", f"spawning {opts.world} processes") as status:
        return run_bench(opts, on_phase=lambda p: status.update(f"{p[0]}: {p[1]}"))


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _ratio(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.2f}×" if key in row else "-"


def _pair(row: dict[str, Any]) -> str:
    return row["pair"].replace("->", " → ")


Cells = Callable[[dict[str, Any], dict[str, Any]], list[str]]
"""A table's cells after the layouts, from a report row and its ``ours`` part (``{}`` when missing)."""


def _table(title: str, headers: tuple[str, ...], rows: list[dict[str, Any]], cells: Cells) -> Table:
    """A table in the bench's style: one line per pair, the layouts first (they may wrap), then
    ``cells(row, ours)`` under ``headers``, right-aligned."""
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("layouts", overflow="fold")
    for header in headers:
        table.add_column(header, justify="right", no_wrap=True, overflow="fold")
    for row in rows:
        table.add_row(_pair(row), *cells(row, row["ours"] or {}))
    return table


def _print(report: dict[str, Any]) -> None:
    """Our refits against the wire floor, the layout floor and (for another transport) gloo, then
    (when compared) against Megatron-Core, each table narrow enough for 80 columns (two-line
    headers; a long Megatron-Core note folds)."""
    o = report["options"]
    nbytes = report["model_bytes"]
    size = f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"
    size += f" {o['dtype']}"
    title = (f"reshard bench: {o['model']} '{o['size']}' ({size}), {o['world']} processes, "
             f"{o['transport']}, median of {o['reps']} warm refits")  # fmt: skip
    headers = ("refit\ns", "wire\nfloor s", "refit/\nfloor", "+local\nfloor s", "refit/\n(+local)",
               "sent\nMB", "local\nMB", "exact")  # fmt: skip
    rows = report["rows"]
    out = console()
    out.print(_table(title, headers, rows, _floor_cells))
    if any("layout_floor_ratio" in row for row in rows):
        headers = ("refit\ns", "+local\nfloor s", "layout\nfloor s", "refit/\nlayout", "copied\nMB")
        out.print(_table("against the copies these layouts force (same run)", headers, rows, _layout_cells))
    if any("gloo_speedup" in row for row in rows):
        name = o["transport"]
        headers = (f"{name}\ns", "gloo\ns", "gloo/\n" + name, "memcpy\nfloor s", f"{name}/\nfloor")
        out.print(_table(f"{name} against gloo and against the memcpy floor (same run)", headers, rows,
                         _gloo_cells))  # fmt: skip
    if report["megatron_core"]:
        headers = ("reshard\ns", "Megatron-\nCore s", "speed-\nup", "bound", "of\nbound")
        table = _table("against Megatron-Core's refit (same model, layouts and transport)", headers, rows,
                       _megatron_cells)  # fmt: skip
        table.columns[2].no_wrap = False  # "did not finish in N s" folds
        out.print(table)


def _floor_cells(row: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """Our refit against the wire floor and the floor with local copies, the volumes, and the check."""
    return [
        _seconds(ours.get("refit_seconds")),
        _seconds(ours.get("floor_seconds")),
        _ratio(row, "floor_ratio"),
        _seconds(ours.get("floor_with_local_seconds")),
        _ratio(row, "floor_with_local_ratio"),
        f"{ours['bytes_remote'] / 1e6:.0f}" if ours else "-",
        f"{ours['bytes_local'] / 1e6:.0f}" if ours else "-",
        ("yes" if ours["verified"] else "NO") if ours else "-",
    ]


def _layout_cells(row: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """The refit against the layout floor: the wire round with the copies these layouts force (local
    regions view to view, strided remote regions packed or unpacked once) instead of one memcpy."""
    return [
        _seconds(ours.get("refit_seconds")),
        _seconds(ours.get("floor_with_local_seconds")),
        _seconds(ours.get("layout_floor_seconds")),
        _ratio(row, "layout_floor_ratio"),
        f"{ours['layout_copy_bytes'] / 1e6:.0f}" if "layout_copy_bytes" in ours else "-",
    ]


def _gloo_cells(row: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """The transport against gloo on the same models and against the memcpy floor (one copy per
    received or local byte, no transport), all in the same run."""
    return [
        _seconds(ours.get("refit_seconds")),
        _seconds(ours.get("gloo_seconds")),
        _ratio(row, "gloo_speedup"),
        _seconds(ours.get("memcpy_floor_seconds")),
        _ratio(row, "memcpy_ratio"),
    ]


def _megatron_cells(row: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """Megatron-Core's refit, our speed-up over it, the bound (its time over the +local floor: the
    most any refit of these volumes could show) and the share of the bound reached."""
    refit = _seconds(ours.get("refit_seconds"))
    megatron = row["megatron"]
    if megatron is None:
        return [refit, "-", "-", "-", "-"]
    if not megatron["finished"]:
        return [refit, f"did not finish in {megatron['deadline']:g} s", "-", "-", "-"]
    exact = "" if megatron["verified"] else " (NOT exact)"
    return [
        refit,
        f"{megatron['seconds']:.3f}{exact}",
        f"{row['speedup']:.1f}×" if "speedup" in row else "-",
        f"{row['speedup_bound']:.1f}×" if "speedup_bound" in row else "-",
        f"{row['of_bound']:.0%}" if "of_bound" in row else "-",
    ]


def register(app: typer.Typer) -> None:
    """Add ``reshard bench`` to ``app``."""
    app.command("bench")(bench_command)
