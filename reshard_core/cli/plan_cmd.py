"""``reshard plan``: simulate a refit's plan offline, in one process, and report per-rank costs.

Exit codes: 0 valid plan, 1 invalid plan or a planning error, 2 bad arguments (a flag, or a JSON
shape file: ``catalogue.shapes`` validates it), always as one ``error:`` line naming the flag, or the
file, the entry and the key.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..catalogue import CONFIGS, get_model, model_names
from ..errors import ReshardError
from .layouts import check_fits, megatron_text, parse_cli_layout
from .output import EXIT_FAILURE, EXIT_USAGE, console, print_error, print_json
from .sizes import parse_bytes

if TYPE_CHECKING:
    from ..simulate.run import SimulationReport

T = TypeVar("T")

FULL_PLAN_LIMIT = 256
"""Plan every rank up to this many; beyond it, a sample plus the busiest candidates."""


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n}"


def plan_command(
    model: Annotated[
        str, typer.Option(help=f"Catalogue model ({', '.join(model_names())}) or a JSON shape file.")
    ],
    src: Annotated[
        str,
        typer.Option(
            help="Source layout in Megatron's meaning (world = tp·pp·cp·dp·fsdp, ep carved out of dp), "
            "e.g. tp=8,pp=4,ep=8,etp=1,dp=16 or fsdp=64."
        ),
    ],
    dst: Annotated[str, typer.Option(help="Destination layout, same form.")],
    dst_offset: Annotated[
        str, typer.Option(metavar="<int>", help="First destination rank (0 = colocated with the source).")
    ] = "0",
    max_batch_bytes: Annotated[str | None, typer.Option(help="Staging budget per batch, e.g. 1GiB.")] = None,
    sample: Annotated[
        str | None,
        typer.Option(
            metavar="<int>",
            help=f"Plan N spread ranks plus the busiest (default: all up to {FULL_PLAN_LIMIT}).",
        ),
    ] = None,
    all_ranks: Annotated[bool, typer.Option("--all-ranks", help="Plan every rank, however many.")] = False,
    allow_uneven: Annotated[
        bool,
        typer.Option("--allow-uneven", help="Plan a TP size that does not divide the heads or query groups."),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
    src_format: Annotated[
        str | None, typer.Option(help="Source model format (megatron, vllm, hf): plan across formats.")
    ] = None,
    dst_format: Annotated[str | None, typer.Option(help="Destination model format, same choices.")] = None,
    cast: Annotated[
        bool,
        typer.Option(
            "--cast", help="Accept tensors whose dtype alone differs (refit(cast=True): fp32 engine routers)."
        ),
    ] = False,
) -> None:
    """Plan a refit offline: per-rank bytes, messages, plan time, metadata size, validity.

    With ``--src-format``/``--dst-format`` (a missing one: megatron) each side is laid out in its
    own format (Megatron-Core, the vLLM convention, transformers under FSDP2); two different formats
    are planned in the logical (HF checkpoint) space, and the report adds what a gather-first
    converter would move. Megatron on both sides is the plan without format flags."""
    from ..simulate.formats import format_table, gather_first_bytes, logical_shapes, shard_to_shard_bytes
    from ..simulate.run import simulate  # torch: imported only when a plan is made

    try:
        offset = _option("--dst-offset", _whole, dst_offset, 0)
        ranks = None if sample is None else _option("--sample", _whole, sample, 1)
        budget = None
        if max_batch_bytes is not None:
            budget = _option("--max-batch-bytes", parse_bytes, max_batch_bytes)
        formats = _formats(model, src_format, dst_format)
        if formats is not None and "megatron" not in formats:  # its Megatron shapes may not exist
            shapes = _option("--model", logical_shapes, CONFIGS[model])
        else:
            shapes = _option("--model", get_model, model)
        src_par, dst_par = _option("--src", parse_cli_layout, src), _option("--dst", parse_cli_layout, dst)
        if not allow_uneven:
            sides = (("--src", src, src_par, src_format), ("--dst", dst, dst_par, dst_format))
            for flag, text, par, fmt in sides:
                if fmt != "vllm":  # vLLM replicates kv heads over TP > query groups; its format checks
                    _option(flag, check_fits, shapes, text, par)
        table = None
        if formats is not None and formats != ("megatron", "megatron"):
            flags = "/".join(f for f, v in (("--src-format", src_format), ("--dst-format", dst_format)) if v)
            table = _option(flags, format_table, CONFIGS[model], src_par, dst_par, *formats, offset)
    except Exception as exc:  # whatever a bad input raises: one line and exit 2, never a traceback
        print_error(exc)
        raise typer.Exit(EXIT_USAGE) from None
    world = max(src_par.world, offset + dst_par.world)
    if all_ranks or (ranks is None and world <= FULL_PLAN_LIMIT) or (ranks is not None and ranks >= world):
        ranks = None
    elif ranks is None:
        ranks = 64
    try:
        with _progress(quiet=(ranks or world) < 16) as bar:
            task = bar.add_task("planning ranks", total=None)
            report = simulate(
                shapes,
                src_par,
                dst_par,
                dst_offset=offset,
                max_batch_bytes=budget,
                sample=ranks,
                progress=lambda done, total: bar.update(task, completed=done, total=total),
                table=table,
                cast=cast,
            )
    except ValueError as exc:
        print_error(exc)
        raise typer.Exit(EXIT_USAGE) from None
    except ReshardError as exc:  # its hint in the command's words
        print_error(ReshardError(str(exc).replace("pass cast=True", "pass --cast")))
        raise typer.Exit(EXIT_FAILURE) from None
    report.src, report.dst = megatron_text(src_par), megatron_text(dst_par)
    report.formats = formats
    if formats is not None and formats[0] != formats[1]:  # within one format nothing is converted
        report.gather_first_bytes = gather_first_bytes(table)
        report.shard_to_shard_bytes = shard_to_shard_bytes(table)
    if as_json:
        print_json(report.to_dict())
    else:
        _print(report)
    if not report.valid:
        if not as_json:
            print_error(ReshardError("plan is not valid: " + "; ".join(report.problems[:3])))
        raise typer.Exit(EXIT_FAILURE)


def _option(flag: str, parse: Callable[..., T], *args: object) -> T:
    """``parse(*args)``, anything it raises re-raised as a ``ValueError`` naming ``flag`` (a
    ``ShapeFileError`` as it is: it names the file, the entry and the key)."""
    from ..catalogue.shapes import ShapeFileError

    try:
        return parse(*args)
    except ShapeFileError:
        raise
    except Exception as exc:
        reason = str(exc) if isinstance(exc, (ValueError, OSError)) else f"{type(exc).__name__}: {exc}"
        raise ValueError(f"{flag}: {reason}") from None


def _whole(text: str, minimum: int) -> int:
    """``text`` as an integer of at least ``minimum``; ``ValueError`` otherwise."""
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number") from None
    if n < minimum:
        raise ValueError(f"must be >= {minimum}, not {n}")
    return n


def _formats(model: str, src_format: str | None, dst_format: str | None) -> tuple[str, str] | None:
    """The (source, destination) formats asked for, a missing one megatron; None when neither is.
    ``ValueError`` naming the flag for an unknown format or a model outside the catalogue."""
    from ..simulate.formats import FORMATS

    given = {f: v for f, v in (("--src-format", src_format), ("--dst-format", dst_format)) if v is not None}
    for flag, name in given.items():
        if name not in FORMATS:
            raise ValueError(
                f"{flag}: unknown format {name!r} for offline planning; use one of {', '.join(FORMATS)}"
            )
    if not given:
        return None
    if model not in CONFIGS:
        raise ValueError(
            f"{'/'.join(given)}: formats plan catalogue models only ({', '.join(sorted(CONFIGS))}), "
            f"not {model!r}"
        )
    return src_format or "megatron", dst_format or "megatron"


def _progress(quiet: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(file=sys.stderr),
        transient=True,
        disable=quiet,
    )


def _print(report: SimulationReport) -> None:
    out = console()
    totals = report.totals()
    moved = totals["bytes_remote_total"] + totals["bytes_local_total"]
    local_share = totals["bytes_local_total"] / moved if moved else 0.0
    summary = Table(
        title=f"reshard plan: {report.model}  {report.src} → {report.dst}"
        + (f"  ({report.formats[0]} → {report.formats[1]})" if report.formats else ""),
        box=box.SIMPLE_HEAD,
        show_header=False,
    )
    summary.add_column("what")
    summary.add_column("value", justify="right")
    remote, local = human(totals["bytes_remote_total"]), human(totals["bytes_local_total"])
    rows = [
        ("ranks (planned)", f"{report.ranks} ({len(report.planned)})"),
        ("tensors / model bytes", f"{report.tensors} / {human(report.model_bytes)}"),
        (
            "metadata per rank (exact / padded)",
            f"{human(report.metadata_bytes)} / {human(report.metadata_bytes_padded)}",
        ),
        (
            "plan CPU s per rank (max / mean)",
            f"{report.plan_seconds_max:.3f} / {report.plan_seconds_mean:.3f}",
        ),
        ("bytes remote / local", f"{remote} / {local} ({local_share:.0%} local)"),
        ("messages (per peer per batch)", f"{totals['messages_total']}"),
        ("send/receive pairs checked", f"{report.pairs_checked}"),
        *_against_gather_first(report),
        ("valid", "yes" if report.valid else "NO"),
    ]
    for row in rows:
        summary.add_row(*row)
    out.print(summary)
    per_rank = Table(title="per rank (busiest first)", box=box.SIMPLE_HEAD)
    for col in ("rank", "sent", "received", "local", "msgs out", "msgs in", "ops", "plan s"):
        per_rank.add_column(col, justify="right")
    shown = sorted(report.planned, key=lambda s: -(s.bytes_sent + s.bytes_received + s.bytes_local))[:16]
    for s in shown:
        per_rank.add_row(
            str(s.rank),
            human(s.bytes_sent),
            human(s.bytes_received),
            human(s.bytes_local),
            str(s.messages_sent),
            str(s.messages_received),
            str(s.ops),
            f"{s.plan_seconds:.3f}",
        )
    out.print(per_rank)
    if len(report.planned) > len(shown):
        out.print(f"({len(report.planned) - len(shown)} more ranks; --json lists all)")


def _against_gather_first(report: SimulationReport) -> list[tuple[str, str]]:
    """The comparison rows of a refit across formats: what it moves in all, every rank (planned or
    not), and what a gather-first converter would."""
    ours, theirs = report.shard_to_shard_bytes, report.gather_first_bytes
    if theirs is None or ours is None:
        return []
    ratio = f" ({theirs / ours:.1f}× ours)" if ours else ""
    return [
        ("shard-to-shard bytes, every rank", human(ours)),
        ("gather-first converter moves", human(theirs) + ratio),
    ]


def register(app: typer.Typer) -> None:
    """Add ``reshard plan`` to ``app``."""
    app.command("plan")(plan_command)
