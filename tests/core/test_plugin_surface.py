"""The plugin surface (``reshard_core.plugin_surface``, ``docs/plugins.md``): every plugin in
``plugins/`` imports from reshard_core only the names the surface modules list, the lists name real
public objects, the check catches each kind of forbidden import, and the core imports no plugin."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from reshard_core.plugin_surface import SURFACE_MODULES, import_violations, is_private, surface_names

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_FILES = sorted(
    path
    for path in (ROOT / "plugins").glob("*/**/*.py")
    if not any(p.endswith(".egg-info") for p in path.parts)
)
PLUGIN_PACKAGES = sorted({path.parent.name for path in (ROOT / "plugins").glob("*/reshard_*/__init__.py")})


def test_the_plugins_are_found():
    assert {"reshard_gloo", "reshard_mxfp8", "reshard_nccl", "reshard_nvshmem", "reshard_vllm"} <= set(
        PLUGIN_PACKAGES
    )
    assert len(PLUGIN_FILES) > len(PLUGIN_PACKAGES)


def test_every_plugin_imports_only_the_surface():
    found = []
    for path in PLUGIN_FILES:
        found += import_violations(path.read_text(), str(path.relative_to(ROOT)))
    assert found == []


@pytest.mark.parametrize("module", SURFACE_MODULES)
def test_each_surface_module_lists_public_names_that_exist(module):
    names = surface_names(module)
    assert names and len(set(names)) == len(names)
    assert [n for n in names if is_private(n)] == []
    imported = importlib.import_module(module)
    assert [n for n in names if not hasattr(imported, n)] == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (  # the Gloo transport's import before the surface existed
            "from reshard_core.transport.p2p import (\n    _ABANDONED,\n    InFlight,\n)\n",
            [
                "f.py:1: imports InFlight from reshard_core.transport.p2p: reshard_core.transport.p2p is "
                "not on the plugin surface",
                "f.py:1: imports _ABANDONED from reshard_core.transport.p2p: _ABANDONED is private; "
                "reshard_core.transport.p2p is not on the plugin surface",
            ],
        ),
        (
            "def extract():\n    from reshard_core.specs import TensorSpec\n",
            [
                "f.py:2: imports TensorSpec from reshard_core.specs: reshard_core.specs is not on the plugin "
                "surface"
            ],
        ),
        (
            "from reshard_core.extract import iter_tensors, walk_everything\n",
            [
                "f.py:1: imports walk_everything from reshard_core.extract: walk_everything is not in "
                "reshard_core.extract.__all__"
            ],
        ),  # fmt: skip
        (
            "from reshard_core import _EXPORTS\n",
            [
                "f.py:1: imports _EXPORTS from reshard_core: _EXPORTS is private; _EXPORTS is not in "
                "reshard_core.__all__"
            ],
        ),  # fmt: skip
        (
            "from reshard_core import *\n",
            ["f.py:1: imports * from reshard_core: star imports hide which names a plugin uses"],
        ),
        (
            "import reshard_core\n\nreshard_core.TransferGroup\nreshard_core.plan.ops.TransferOp\n",
            [
                "f.py:4: uses reshard_core.plan.ops.TransferOp: reshard_core.plan.ops is not on the plugin "
                "surface"
            ],
        ),
        (
            "import reshard_core.transport as t\n\nt.P2PCopyService\nt.p2p.describe_failure\n",
            [
                "f.py:4: uses reshard_core.transport.p2p.describe_failure: reshard_core.transport.p2p is not "
                "on the plugin surface"
            ],
        ),  # fmt: skip
        (
            "import reshard_core.plan.ops\n",
            ["f.py:1: imports reshard_core.plan.ops, which is not on the plugin surface"],
        ),
        (
            "import importlib\n\nimportlib.import_module('reshard_core.extract.builtin')\n",
            ["f.py:3: imports reshard_core.extract.builtin, which is not on the plugin surface"],
        ),
    ],
)
def test_a_forbidden_import_is_named_with_its_line(source, expected):
    assert import_violations(source, "f.py") == expected


def test_surface_and_relative_imports_pass():
    source = (
        "import reshard_core\nimport reshard_core.extract\n"
        "from reshard_core import TransportError, __version__\n"
        "from reshard_core.transport import P2PCopyService\n"
        "from . import streams\nfrom ._impl import _helper\n"
        "reshard_core.refit\nreshard_core.simulate\nreshard_core.extract.iter_tensors\n"
    )
    assert import_violations(source, "f.py") == []


def test_the_core_imports_no_plugin():
    found = []
    for path in sorted((ROOT / "reshard_core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module or ""]
            else:
                continue
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {m}"
                for m in modules
                if m.split(".")[0] in PLUGIN_PACKAGES
            ]
    assert found == []
