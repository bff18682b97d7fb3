"""The ``nvshmem`` transport on a machine without CUDA or nvshmem4py: imports, reasons, errors."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from reshard_nvshmem import plugin
from reshard_nvshmem.engine import split_messages
from reshard_nvshmem.exchange import LocalRun
from reshard_nvshmem.symmetric import INSTALL_HINT, load_nvshmem
from reshard_nvshmem.transport import NvshmemCopyService

from reshard_core.errors import TransportError

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


@pytest.fixture
def fresh_import() -> Iterator[None]:
    """Forget the cached nvshmem4py import attempt (and any fake ``nvshmem`` module) around a test."""
    load_nvshmem.cache_clear()
    yield
    load_nvshmem.cache_clear()
    for name in [m for m in sys.modules if m == "nvshmem" or m.startswith("nvshmem.")]:
        del sys.modules[name]


def test_importing_the_package_never_loads_nvshmem_or_cuda_python() -> None:
    code = (
        "import sys, reshard_nvshmem, reshard_nvshmem.transport, reshard_nvshmem.plugin;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'nvshmem' or m.startswith('cuda.core')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_reason_on_this_machine_is_the_missing_cuda() -> None:
    assert NvshmemCopyService.unavailable_reason() == "CUDA is not available"
    assert plugin.unavailable_reason() == "CUDA is not available"


def test_reason_without_nvshmem4py(monkeypatch: pytest.MonkeyPatch, fresh_import: None) -> None:
    if importlib.util.find_spec("nvshmem") is not None:
        pytest.skip("nvshmem4py is installed here")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert INSTALL_HINT == "nvshmem4py is not installed (pip install nvshmem4py-cu12)"
    assert NvshmemCopyService.unavailable_reason() == INSTALL_HINT


def test_reason_with_a_broken_nvshmem4py(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_import: None
) -> None:
    pkg = tmp_path / "nvshmem"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "core.py").write_text("raise OSError('libnvshmem_host.so.3: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert NvshmemCopyService.unavailable_reason() == (
        "nvshmem4py failed to import: OSError: libnvshmem_host.so.3: cannot open shared object file"
    )


def test_constructing_without_cuda_raises_the_reason() -> None:
    with pytest.raises(TransportError) as info:
        NvshmemCopyService()
    assert str(info.value) == "transport 'nvshmem' is unavailable: CUDA is not available"


def test_without_a_process_group_nvshmem_cannot_be_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    monkeypatch.setattr(NvshmemCopyService, "unavailable_reason", classmethod(lambda cls: None))
    with pytest.raises(TransportError) as info:
        NvshmemCopyService()
    assert str(info.value) == (
        "NVSHMEM is not initialised: torch.distributed has no process group to bootstrap it from "
        "(call torch.distributed.init_process_group first)"
    )


def test_bad_staging_configuration_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TransportError) as info:
        NvshmemCopyService(slots=0)
    assert str(info.value) == "nvshmem transport: staging slots must be a positive integer, got 0"
    monkeypatch.setenv("RESHARD_NVSHMEM_SLOT_BYTES", "64MiB")
    with pytest.raises(TransportError, match="RESHARD_NVSHMEM_SLOT_BYTES must be an integer"):
        NvshmemCopyService()


def test_capabilities() -> None:
    assert (NvshmemCopyService.name, NvshmemCopyService.device, NvshmemCopyService.one_sided) == (
        "nvshmem",
        "cuda",
        True,
    )


def test_plugin_listing_and_registry(fresh_plugin_manager: None) -> None:
    from reshard_core.plugins import plugin_records
    from reshard_core.transport.registry import get_transport

    assert get_transport("nvshmem") is NvshmemCopyService
    (record,) = [r for r in plugin_records() if r.name == "nvshmem"]
    assert (record.status, record.reason) == ("unavailable", "CUDA is not available")
    assert record.transports == ("nvshmem",)


def test_cli_listing_shows_why(fresh_plugin_manager: None, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from reshard_core.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["plugins", "list", "--check", "--json"])  # without --check availability is not probed
    assert (exit_info.value.code or 0) == 0
    (entry,) = [r for r in json.loads(capsys.readouterr().out) if r["name"] == "nvshmem"]
    assert (entry["status"], entry["reason"]) == ("unavailable", "CUDA is not available")


def test_split_messages_keys_by_peer_and_order() -> None:
    a, b, c = torch.arange(4, dtype=torch.int32), torch.ones(3, dtype=torch.bfloat16), torch.arange(5.0)
    r1, r2 = torch.empty(2, dtype=torch.int64), torch.empty(6, dtype=torch.uint8)
    sends, recvs, run = split_messages([(a, 2), (c, 1), (b, 2)], [(r1, 0), (r2, 0)])
    assert run == LocalRun(sends=((2, 16), (1, 20), (2, 6)), recvs=((0, 16), (0, 6)))
    assert sorted(sends) == [(1, 0), (2, 0), (2, 1)] and sorted(recvs) == [(0, 0), (0, 1)]
    assert sends[(2, 0)].data_ptr() == a.data_ptr() and sends[(2, 1)].dtype == torch.uint8
    assert recvs[(0, 1)].data_ptr() == r2.data_ptr() and recvs[(0, 0)].numel() == 16
