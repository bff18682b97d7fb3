"""reshard-vllm as users meet it: listed by ``reshard plugins list``, registered for vLLM by its entry
point, and cheap to import (no vLLM until one of its vLLM classes is used)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points


def test_plugins_list_shows_reshard_vllm_available_without_importing_vllm() -> None:
    code = (
        "import sys\n"
        "from reshard_core.cli.main import main\n"
        "try:\n    main(['plugins', 'list', '--json', '--check'])\n"
        "except SystemExit as exc:\n    assert exc.code in (0, None), exc.code\n"
        "print('vllm imported:', 'vllm' in sys.modules, file=sys.stderr)\n"
    )
    out = _python(code)
    records = {r["name"]: r for r in json.loads(out.stdout)}
    assert records["vllm"]["distribution"] == "reshard-vllm"
    assert (records["vllm"]["status"], records["vllm"]["reason"]) == ("available", None)
    assert out.stderr.strip().endswith("vllm imported: False")  # importing vLLM patches torch


def test_vllm_loads_the_backend_through_its_general_plugins_entry_point() -> None:
    [ep] = [e for e in entry_points(group="vllm.general_plugins") if e.name == "reshard"]
    assert ep.value == "reshard_vllm.registration:register"


def test_importing_reshard_vllm_imports_no_vllm_until_a_vllm_class_is_used() -> None:
    code = (
        "import sys, reshard_vllm, reshard_vllm.plugin; print('vllm' in sys.modules); "
        "from reshard_vllm import ReshardTrainerInitInfo; "
        "from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory as F; "
        "print(ReshardTrainerInitInfo.backend, 'reshard' in F._registry)"
    )
    out = _python(code)
    assert out.stdout.split() == ["False", "reshard", "True"]


def _python(code: str) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter (this one may have imported vLLM already)."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
