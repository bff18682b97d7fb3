"""Import every module of every installed reshard distribution; fail on a missing package.

Run by ``.ci/run`` in the main command's fresh environment, where only the distributions' declared
dependencies are installed. A module may need an optional dependency that is absent only if it says
so clearly: it raises ``reshard_core.errors.MissingDependency`` for a package that its distribution
declares as an extra. Any other import failure (a ``ModuleNotFoundError`` above all) fails the check.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import pkgutil
import re
import sys
import time


def reshard_distributions() -> dict[str, list[str]]:
    """Distribution name -> its top-level import packages, for every installed ``reshard-*``."""
    packages: dict[str, list[str]] = {}
    for top, dists in md.packages_distributions().items():
        for dist in dists:
            if dist.lower().startswith("reshard"):
                packages.setdefault(dist, []).append(top)
    return packages


def optional_requirements(dist: str) -> set[str]:
    """Normalised names of the packages ``dist`` declares only behind an extra."""
    names = set()
    for req in md.requires(dist) or []:
        if "extra ==" in req:
            names.add(_normalise(re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0]))
    return names


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def module_names(package: str) -> list[str]:
    root = importlib.import_module(package)
    names = [package]
    for info in pkgutil.walk_packages(getattr(root, "__path__", []), prefix=f"{package}."):
        names.append(info.name)
    return names


def main() -> int:
    from reshard_core.errors import MissingDependency

    dists = reshard_distributions()
    if not dists:
        print("import check: no reshard distribution is installed", file=sys.stderr)
        return 1
    problems: list[str] = []
    counts: dict[str, int] = {}
    optional: list[str] = []
    start = time.perf_counter()
    for dist, packages in sorted(dists.items()):
        extras = optional_requirements(dist)
        for package in sorted(packages):
            try:
                names = module_names(package)
            except Exception as exc:
                problems.append(f"{dist}: {package}: {type(exc).__name__}: {exc}")
                continue
            for name in names:
                counts[dist] = counts.get(dist, 0) + 1
                try:
                    importlib.import_module(name)
                except MissingDependency as exc:
                    optional.append(f"{name} ({exc.distribution})")
                    if _normalise(exc.distribution) not in extras:
                        problems.append(
                            f"{dist}: {name} needs {exc.distribution}, which {dist} does not declare "
                            f"as an extra ({exc})"
                        )
                except Exception as exc:
                    problems.append(f"{dist}: {name}: {type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - start
    summary = ", ".join(f"{dist} {n}" for dist, n in sorted(counts.items()))
    print(f"import check: {sum(counts.values())} modules imported in {seconds:.1f} s ({summary})")
    if optional:
        print(f"import check: {len(optional)} need an optional package absent here: {', '.join(optional)}")
    for problem in problems:
        print(f"import check: FAILED {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
