"""What a benchmark report must say besides its numbers: why the Megatron-Core comparison was
skipped, and which repeated measurements disagree so much that their medians mean little.

Both are pure functions of the options and the rows (no torch), shown by ``reshard bench`` on
stderr and kept in the JSON report (``megatron_skipped``, ``warnings``).
"""

from __future__ import annotations

from typing import Any

SPREAD_LIMIT = 2.0
"""Slowest over fastest repetition above which a measurement is flagged (a loaded machine)."""

TIMER_NOISE = 0.002
"""Seconds below which repetitions are not compared: a round with nothing on the wire takes
microseconds, and its spread says nothing about the machine."""


def megatron_skip_reason(megatron: bool, model: str, resolved_model: str) -> str | None:
    """Why Megatron-Core's refit is not compared (None when it is): the option, the model kind, or
    megatron-core missing."""
    if not megatron:
        return "--no-megatron was given"
    if resolved_model == "megatron-gpt":
        return None
    if model == "auto":
        return "megatron-core is not installed (pip install megatron-core==0.16.1 einops)"
    return f"--model {model} is not a Megatron-Core model (use --model megatron-gpt or auto)"


def spread_warnings(rows: list[dict[str, Any]], limit: float = SPREAD_LIMIT) -> list[str]:
    """One line per measurement whose repetitions differ by more than ``limit``× (slowest/fastest)."""
    out = []
    for row in rows:
        ours, megatron = row.get("ours") or {}, row.get("megatron") or {}
        series = (("refit", ours.get("refit_runs")), ("wire floor", ours.get("floor_runs")),
                  ("layout floor", ours.get("layout_floor_runs")),
                  ("Megatron-Core", megatron.get("runs")))  # fmt: skip
        for what, runs in series:
            if not runs or min(runs) <= 0 or max(runs) < TIMER_NOISE:
                continue
            ratio = max(runs) / min(runs)
            if ratio > limit:
                out.append(
                    f"{row['pair']}: {what} repetitions disagree by {ratio:.1f}× (fastest {min(runs):.3f} s, "
                    f"slowest {max(runs):.3f} s): the machine is probably loaded, medians are unreliable"
                )
    return out
