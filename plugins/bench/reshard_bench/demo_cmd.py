"""``reshard demo``: the main job. Spawns a local Gloo world, builds a GPT in a training layout and in
an inference layout, refits it, verifies every destination element against the source, and reports.

Exit codes: 0 verified, 1 verification failed or a rank failed, 2 bad arguments.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from reshard_core import ReshardError
from reshard_core.cli.output import EXIT_FAILURE, console, optional_bytes, print_error, print_json

from .commands import checked_options, world_status

PHASES = ("spawning", "building", "refitting", "verifying")
_PHASE_TEXT = {
    "spawning": "spawning {world} processes",
    "building": "building the source and destination models",
    "refitting": "refitting (plan, then a warm refit)",
    "verifying": "verifying every destination element",
}


def demo_command(
    world_size: Annotated[int, typer.Option("--world-size", "-n", help="Processes in the local world.")] = 4,
    src: Annotated[
        str | None,
        typer.Option(
            help="Training layout, e.g. fsdp=4 or tp=2,pp=2 (default: fsdp=<world>, "
            "or tp=2,pp=2 for megatron-gpt)."
        ),
    ] = None,
    dst: Annotated[
        str | None, typer.Option(help="Inference layout, e.g. tp=4 or tp=2,dp=2 (default: tp=2).")
    ] = None,
    model: Annotated[str, typer.Option(help="tiny, small, or megatron-gpt (needs megatron-core).")] = "small",
    transport: Annotated[str, typer.Option(help="Transport plugin name.")] = "gloo",
    max_batch_bytes: Annotated[str | None, typer.Option(help="Staging budget per batch, e.g. 4MiB.")] = None,
    dtype: Annotated[str, typer.Option(help="bf16 or fp32.")] = "bf16",
    timeout: Annotated[float, typer.Option(help="Seconds the whole demo may take.")] = 180.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
) -> None:
    """Refit a GPT between two layouts in a local Gloo world and verify every element."""
    from .demo import DemoOptions, check_options, default_layouts

    def build() -> DemoOptions:
        if model == "megatron-gpt":
            _need_megatron()
        defaults = default_layouts(world_size, model)
        opts = DemoOptions(
            model=model, src=src or defaults[0], dst=dst or defaults[1], world=world_size,
            transport=transport, max_batch_bytes=optional_bytes(max_batch_bytes), dtype=dtype,
            timeout=min(60.0, timeout),
        )  # fmt: skip
        check_options(opts)
        return opts

    opts = checked_options(build, transport)
    report = _run(opts, timeout)
    if as_json:
        print_json(report)
    else:
        _print(report)
    if not report["verified"]:
        problems = report["problems"]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        print_error(ReshardError(f"verification failed: {problems[0]}{more}"))
        raise typer.Exit(EXIT_FAILURE)


def _need_megatron() -> None:
    from .pairs import megatron_available

    if not megatron_available():
        raise ValueError("--model megatron-gpt needs megatron-core: pip install megatron-core==0.16.1 einops")


def _run(opts: Any, timeout: float) -> dict[str, Any]:
    """Spawn the world with a spinner on stderr that follows the slowest rank's phase."""
    from .demo import demo_rank, summarize
    from .worlds import spawn_world

    phase = {r: 0 for r in range(opts.world)}
    with world_status("demo", _PHASE_TEXT["spawning"].format(world=opts.world)) as status:

        def on_event(rank: int, kind: str, data: Any) -> None:
            if kind == "phase":
                phase[rank] = PHASES.index(data)
                status.update(_PHASE_TEXT[PHASES[min(phase.values())]].format(world=opts.world))

        results = spawn_world(demo_rank, opts.world, opts, on_event=on_event, timeout=timeout,
                              pg_timeout=max(opts.timeout * 2, 60.0))  # fmt: skip
    return summarize(opts, results)


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _print(r: dict[str, Any]) -> None:
    table = Table(
        title=f"reshard demo: GPT '{r['model']}' ({r['dtype']}), {r['world_size']} processes, "
        f"transport {r['transport']}",
        box=box.SIMPLE_HEAD,
        show_header=False,
    )
    table.add_column("what")
    table.add_column("value")
    seconds = r["refit_seconds"]
    batches = f"{r['batches']} batch" + ("es" if r["batches"] != 1 else "")
    rows = [
        ("source", f"{r['src']['layout']}  ({r['src']['style']})"),
        ("destination", f"{r['dst']['layout']}  ({r['dst']['style']})"),
        ("moved", f"{_mb(r['bytes_moved'])}: {_mb(r['bytes_remote'])} sent, {_mb(r['bytes_local'])} local"),
        ("messages", f"{r['messages']} in {batches}"),
        ("first refit", f"{r['first_refit_seconds']:.3f} s (plan {r['prepare_seconds']:.3f} s)"),
        ("warm refit", f"{seconds:.4f} s, {r['gb_per_s']:.2f} GB/s" + (", plan reused" * r["plan_reused"])),
        ("verified", f"yes, all {r['elements_checked']:,} elements equal the source" if r["verified"]
         else f"NO: {len(r['problems'])} weights differ"),
    ]  # fmt: skip
    for row in rows:
        table.add_row(*row)
    console().print(table)


def register(app: typer.Typer) -> None:
    """Add ``reshard demo`` to ``app``."""
    app.command("demo")(demo_command)
