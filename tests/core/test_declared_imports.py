"""Every shipped module imports at module level only what its own distribution declares.

A package that only arrives through another one (click through typer, or through vLLM in the test
environment) is not declared and fails here: on a fresh machine it may not be there. An import
inside a function is lazy and not checked; an import inside ``try`` is guarded (the modules that
need an optional package raise ``reshard_core.MissingDependency`` there; ``.ci/import_all.py``
checks that in the main command's environment).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PROJECTS = [ROOT, *sorted(p.parent for p in (ROOT / "plugins").glob("*/pyproject.toml"))]


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _normalise(re.split(r"[\s;<>=!~\[(]", requirement.strip(), maxsplit=1)[0])


def declared(project: Path) -> tuple[str, set[str], list[Path]]:
    """(distribution, the distributions it requires, its package folders)."""
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    name = _normalise(meta["name"])
    requires = {_requirement_name(r) for r in meta.get("dependencies", [])}
    packages = [p.parent for p in project.glob("*/__init__.py") if p.parent.name.startswith("reshard")]
    return name, requires | {name}, packages


def module_level_imports(source: str) -> list[tuple[int, str]]:
    """(line, top-level name) of each absolute import that runs when the module is imported and is
    not inside ``try`` or ``if TYPE_CHECKING``."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.Try)):
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.extend((child.lineno, alias.name.split(".")[0]) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.lineno, child.module.split(".")[0]))
            visit(child)

    visit(ast.parse(source))
    return found


def _providers() -> dict[str, set[str]]:
    return {top: {_normalise(d) for d in dists} for top, dists in md.packages_distributions().items()}


@pytest.mark.parametrize("project", PROJECTS, ids=lambda p: p.name if p != ROOT else "reshard-core")
def test_every_module_level_import_is_declared(project: Path) -> None:
    name, requires, packages = declared(project)
    assert packages, f"{name}: no package folder found"
    providers = _providers()
    undeclared = []
    for package in packages:
        for path in sorted(package.rglob("*.py")):
            for line, top in module_level_imports(path.read_text()):
                if top in sys.stdlib_module_names or top == "__future__":
                    continue
                owners = providers.get(top, set())
                if not owners & requires:
                    where = path.relative_to(ROOT)
                    undeclared.append(f"{where}:{line} imports {top} ({', '.join(sorted(owners)) or '?'})")
    assert not undeclared, f"{name} does not declare:\n" + "\n".join(undeclared)


def test_the_check_finds_an_undeclared_import() -> None:
    source = "import os\nimport click\ntry:\n    import vllm\nexcept ImportError:\n    pass\n"
    source += "def f():\n    import megatron\nfrom typing import TYPE_CHECKING\n"
    source += "if TYPE_CHECKING:\n    import rich\n"
    assert module_level_imports(source) == [(1, "os"), (2, "click"), (9, "typing")]
    assert "click" not in declared(ROOT)[1]


def test_no_test_helpers_ship_in_reshard_vllm() -> None:
    """The vLLM server harness (transformers, subprocesses, HTTP) lives in the tests."""
    assert not (ROOT / "plugins" / "vllm" / "reshard_vllm" / "testing.py").exists()
    assert (ROOT / "tests" / "vllm" / "vllm_harness.py").exists()
