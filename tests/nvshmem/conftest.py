"""Put this folder on ``sys.path`` so tests import its helpers (``nvshmem_patterns``, ``nvshmem_sim``)
under pytest's importlib import mode; the names are prefixed to stay clear of other folders' helpers."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
