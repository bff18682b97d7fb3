"""Every layout the gloo refit tests cover, refit again over ``ipc``: those test files run in a
pytest of their own with ``RESHARD_TRANSPORT=ipc`` (the default transport of every ``refit`` and
``prepare`` that names none), so each of their bit-exact checks holds over shared memory too.

Covered: FSDP2 → DTensor TP and TP×FSDP2, non-colocated TP (``test_refit_layouts``); Megatron-Core
GPTModels across TP/PP (``test_refit_megatron``); delta refits on declared layouts and on Megatron,
transformers and vLLM models (``test_delta_refit``, ``test_delta_models``); verified arrivals
(``test_verify``); formats, Megatron and FSDP2 into vLLM's TP and expert layouts
(``test_refit_vllm``, ``test_refit_megatron_vllm``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from reshard_core.options import RefitOptions

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
FILES = (
    "tests/core/test_refit_layouts.py",
    "tests/core/test_refit_megatron.py",
    "tests/core/test_delta_refit.py",
    "tests/core/test_verify.py",
    "tests/formats/test_refit_vllm.py",
    "tests/formats/test_refit_megatron_vllm.py",
    "tests/formats/test_delta_models.py",
)


def test_the_environment_names_the_default_transport(monkeypatch):
    monkeypatch.delenv("RESHARD_TRANSPORT", raising=False)
    assert RefitOptions().transport == "gloo"
    monkeypatch.setenv("RESHARD_TRANSPORT", "ipc")
    assert RefitOptions().transport == "ipc"
    assert RefitOptions(transport="gloo").transport == "gloo"


def _pytest(files: tuple[str, ...], **env: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files],
        cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    return done.returncode, done.stdout


def test_the_gloo_refit_tests_pass_over_ipc():
    code, out = _pytest(FILES, RESHARD_TRANSPORT="ipc")
    tail = "\n".join(out.splitlines()[-30:])
    assert code == 0, tail
    assert " passed" in tail and "failed" not in tail and "error" not in tail, tail


def test_those_refits_do_go_through_ipc():
    """With the ipc transport misconfigured, the same tests fail on it: the run above used it."""
    code, out = _pytest(FILES[:1], RESHARD_TRANSPORT="ipc", RESHARD_IPC_SLOTS="0")
    assert code != 0
    assert "ipc: slots must be between 1 and 64, got 0" in out, out[-3000:]
