"""``reshard bench``'s notes: why Megatron-Core was skipped, and repetitions that disagree by > 2×."""

from __future__ import annotations

import pytest
from reshard_bench.bench_cmd import print_notes
from reshard_bench.notes import megatron_skip_reason, spread_warnings


@pytest.mark.parametrize(
    ("megatron", "model", "resolved", "reason"),
    [
        (True, "megatron-gpt", "megatron-gpt", None),
        (True, "auto", "megatron-gpt", None),
        (False, "auto", "megatron-gpt", "--no-megatron was given"),
        (True, "auto", "gpt", "megatron-core is not installed (pip install megatron-core==0.16.1 einops)"),
        (True, "gpt", "gpt", "--model gpt is not a Megatron-Core model (use --model megatron-gpt or auto)"),
    ],
)
def test_the_skip_reason_names_the_cause(megatron, model, resolved, reason):
    assert megatron_skip_reason(megatron, model, resolved) == reason


def test_repetitions_more_than_twice_apart_are_flagged_and_others_not():
    rows = [
        {"pair": "tp=2->tp=4", "ours": {"refit_runs": [0.1, 0.25], "floor_runs": [0.05, 0.1]},
         "megatron": {"runs": [1.0, 3.0]}},
        {"pair": "tp=1->tp=4", "ours": None, "megatron": {"finished": False}},
        {"pair": "tp=1->tp=2", "ours": {"floor_runs": [0.00001, 0.00004]}},  # nothing on the wire
    ]  # fmt: skip
    assert spread_warnings(rows) == [
        "tp=2->tp=4: refit repetitions disagree by 2.5× (fastest 0.100 s, slowest 0.250 s): the machine is "
        "probably loaded, medians are unreliable",
        "tp=2->tp=4: Megatron-Core repetitions disagree by 3.0× (fastest 1.000 s, slowest 3.000 s): the "
        "machine is probably loaded, medians are unreliable",
    ]  # the floor's exactly 2x is within the limit; microseconds are timer noise, not a loaded machine


def test_the_notes_go_to_stderr_as_warnings(capsys):
    print_notes({"megatron_skipped": "--no-megatron was given", "warnings": ["a: b"]})
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "warning: Megatron-Core comparison skipped: --no-megatron was given\nwarning: a: b\n"
    print_notes({"megatron_skipped": None, "warnings": []})
    assert capsys.readouterr() == ("", "")
