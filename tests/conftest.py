"""Shared test set-up: skip ``@pytest.mark.gpu`` tests without CUDA; plugin-manager isolation fixtures."""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

PLUGIN_FIXTURES = Path(__file__).parent / "core" / "fixtures"
"""Fake plugin distributions (``*.dist-info`` + modules), one folder per scenario."""


RANK_PRELOAD = (
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
)
"""What most test worlds' ranks import: the rank fork server imports it once (``world.preload``)."""


def pytest_configure(config: pytest.Config) -> None:
    from reshard_core.testing.world import preload

    preload(*RANK_PRELOAD)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # only when a GPU test was collected: keeps collection cheap

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def fresh_plugin_manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A plugin manager rebuilt from scratch for this test (and forgotten after it), env knobs unset."""
    from reshard_core.entry_points import DISABLE_ENV
    from reshard_core.plugin_status import STRICT_ENV
    from reshard_core.plugins import reset_plugin_manager

    monkeypatch.delenv(STRICT_ENV, raising=False)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    reset_plugin_manager()
    yield
    reset_plugin_manager()


@pytest.fixture
def plugin_fixtures(
    monkeypatch: pytest.MonkeyPatch, fresh_plugin_manager: None
) -> Iterator[Callable[..., list[Path]]]:
    """``use("good_plugins", ...)``: only those fixture folders' distributions are installed.

    The folders go on ``sys.path`` and ``importlib.metadata.entry_points`` sees their entry points
    only, so listings are exact whatever else this machine has installed. Fixture modules imported
    during the test are dropped from ``sys.modules`` afterwards.
    """

    def use(*names: str) -> list[Path]:
        paths = [PLUGIN_FIXTURES / name for name in names]
        for path in paths:
            monkeypatch.syspath_prepend(str(path))

        def entry_points(group: str | None = None) -> list[importlib.metadata.EntryPoint]:
            eps = [ep for dist in importlib.metadata.distributions(path=[str(p) for p in paths])
                   for ep in dist.entry_points]
            return [ep for ep in eps if group is None or ep.group == group]

        monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
        return paths

    yield use
    fixture_root = str(PLUGIN_FIXTURES)
    for name, module in list(sys.modules.items()):
        if (getattr(module, "__file__", None) or "").startswith(fixture_root):
            del sys.modules[name]
