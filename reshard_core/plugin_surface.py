"""The plugin surface: what a plugin may import from reshard_core.

Contract: a plugin (a package under ``plugins/``, or any outside distribution) imports from
reshard_core only the names listed in the ``__all__`` of a module in ``SURFACE_MODULES``, by their
public names (never one starting with ``_``). Everything else in reshard_core may change without
notice. ``docs/plugins.md`` describes the names; ``import_violations`` finds the imports that break
the contract (``tests/core/test_plugin_surface.py`` runs it over every plugin in this repository).

Override hooks of a base class (``P2PCopyService._issue`` and the like) are part of that class's
documented subclass protocol, not imports, and are not checked here.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util

CORE = "reshard_core"

SURFACE_MODULES: tuple[str, ...] = (
    "reshard_core",  # the data model, errors, extension points (hookimpl, CopyService, ReshardTransform)
    "reshard_core.extract",  # extractors: the context, the tensor walk, the built-in chain, DTensor helpers
    "reshard_core.formats",  # model formats, the vLLM format's names included
    "reshard_core.transport",  # transports: CopyService and the point-to-point base with its helpers
    "reshard_core.simulate",  # the offline planner: layouts from parallel sizes, plans without a world
    "reshard_core.cli.output",  # for commands added by ``reshard_register_commands``: exit codes, printing
    "reshard_core.testing.world",  # local multi-process worlds (the one spawner) and rank outcomes
    "reshard_core.testing.models",  # deterministic, layout-independent Megatron GPT / FSDP2 / TP models
)


def surface_names(module: str) -> tuple[str, ...]:
    """The names a plugin may import from surface module ``module`` (its ``__all__``)."""
    if module not in SURFACE_MODULES:
        raise ValueError(f"{module} is not a plugin surface module")
    return tuple(importlib.import_module(module).__all__)


def is_private(name: str) -> bool:
    """True for ``_name``; dunders such as ``__version__`` are public."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def import_violations(source: str, filename: str = "<string>") -> list[str]:
    """``"file:line: why"`` for every import from reshard_core in ``source`` that the contract forbids:
    a module off the surface, a name outside its module's ``__all__``, a ``_``-prefixed name, a star
    import, or an attribute of an imported core module (``reshard_core.X``) that is not in its
    ``__all__``. Relative imports (inside the plugin itself) are not checked."""
    tree = ast.parse(source, filename)
    found: set[tuple[int, str]] = set()

    def flag(node: ast.AST, why: str) -> None:
        found.add((node.lineno, why))

    bound: dict[str, str] = {}  # local name -> the core module it refers to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _is_core(node.module):
            for alias in node.names:
                if problems := _name_problems(node.module, alias.name):
                    flag(node, f"imports {alias.name} from {node.module}: {'; '.join(problems)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if not _is_core(alias.name):
                    continue
                if alias.name not in SURFACE_MODULES:
                    flag(node, f"imports {alias.name}, which is not on the plugin surface")
                bound[alias.asname or CORE] = alias.name if alias.asname else CORE
        elif isinstance(node, ast.Call) and _names_import_module(node.func):
            target = node.args[0] if node.args else None
            if isinstance(target, ast.Constant) and isinstance(target.value, str) and _is_core(target.value):
                if target.value not in SURFACE_MODULES:
                    flag(node, f"imports {target.value}, which is not on the plugin surface")
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        chain = [] if id(node) in inner else _attribute_chain(node)
        if chain and chain[0] in bound and (why := _chain_problem(bound[chain[0]], chain[1:])):
            flag(node, why)
    return [f"{filename}:{line}: {why}" for line, why in sorted(found)]


def _is_core(module: str | None) -> bool:
    return module is not None and (module == CORE or module.startswith(CORE + "."))


def _name_problems(module: str, name: str) -> list[str]:
    """Why a plugin may not take ``name`` from ``module`` (empty when it may)."""
    if name == "*":
        return ["star imports hide which names a plugin uses"]
    problems = [f"{name} is private"] if is_private(name) else []
    if module not in SURFACE_MODULES:
        problems.append(f"{module} is not on the plugin surface")
    elif name not in surface_names(module):
        problems.append(f"{name} is not in {module}.__all__")
    return problems


def _chain_problem(module: str, attributes: list[str]) -> str | None:
    """Why ``module.a.b…`` breaks the contract, or None: a surface name ends the check, a submodule
    is followed, anything else must have been a surface name."""
    for attribute in attributes:
        if module in SURFACE_MODULES and attribute in surface_names(module):
            return None
        if not _is_module(f"{module}.{attribute}"):
            return f"uses {module}.{attribute}: {'; '.join(_name_problems(module, attribute))}"
        module = f"{module}.{attribute}"
    return None if module in SURFACE_MODULES else f"uses {module}, which is not on the plugin surface"


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _names_import_module(func: ast.expr) -> bool:
    """True for ``importlib.import_module`` and a bare ``import_module``."""
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name == "import_module"


def _attribute_chain(node: ast.AST) -> list[str]:
    """``["a", "b", "c"]`` for the expression ``a.b.c``; [] for anything that is not such a chain."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not parts or not isinstance(node, ast.Name):
        return []
    return [node.id, *reversed(parts)]
