"""The import graph of ``reshard_core`` and of every plugin has no circle, counting every import:
at module level, inside functions (deferred) and under ``TYPE_CHECKING``. A circle is reported as
its files and the imports that close it. Also: no package folder is named ``build`` or ``dist``
(linters and import-graph tools skip such folders by default)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _packages() -> list[tuple[Path, Path]]:
    """``(import root, package folder)`` of the core and of each plugin."""
    found = [(ROOT, ROOT / "reshard_core")]
    for plugin in sorted((ROOT / "plugins").iterdir()):
        found += [(plugin, p) for p in sorted(plugin.glob("reshard_*")) if (p / "__init__.py").is_file()]
    return found


def _modules() -> dict[str, Path]:
    out = {}
    for base, package in _packages():
        for path in package.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that module ``name`` imports (a package's ``__init__`` counts as one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def ours(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(ours(full) if full in modules else ours(base))
        elif isinstance(node, ast.Import):
            found.update(ours(alias.name) for alias in node.names)
    return {m for m in found if m is not None and m != name}


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_import_circle_in_the_core_or_any_plugin():
    modules = _modules()
    assert "reshard_core.session" in modules and "reshard_ipc.transport" in modules
    edges = {name: _imports(name, path, modules) for name, path in modules.items()}
    report = []
    for circle in _circles(edges):
        ties = [f"{a} -> {b}" for a in circle for b in sorted(edges[a] & set(circle))]
        report.append(f"{len(circle)} modules: " + "; ".join(ties))
    assert report == [], "\n".join(report)


def test_the_circle_finder_finds_a_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(edges) == [["a", "b", "c"]]


def test_no_package_folder_is_named_build_or_dist():
    folders = [p for _, package in _packages() for p in [package, *package.rglob("*")] if p.is_dir()]
    named = [str(p.relative_to(ROOT)) for p in folders if p.name in ("build", "dist")]
    assert named == []
