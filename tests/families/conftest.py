"""Make this folder's helpers (``tiny``, ``megatron_families``) and the vLLM test helpers
(``tests/vllm``: ``vllm_harness``, ``vllm_jobs``) importable under importlib mode."""

from __future__ import annotations

import sys
from pathlib import Path

for folder in (Path(__file__).parent, Path(__file__).parent.parent / "vllm"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
