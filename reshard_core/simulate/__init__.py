"""Offline planning from layout descriptions: thousands of simulated ranks in one process.

``simulate(get_model("llama3-8b"), parse_parallel("tp=8,pp=2"), parse_parallel("tp=4"))`` builds
both sides' layout table, plans the ranks and checks the plans (``check_plans``); ``replay``
applies plans to real tensors in one process (a reference executor for tests).
"""


from ..lazy import lazy_exports
from .parallel import Parallel, parse_parallel

_LAZY = {  # imported on first use: they import torch, ``parallel`` does not
    "CheckReport": "check",
    "check_plans": "check",
    "build_table": "layouts",
    "replay": "replay",
    "RankStats": "run",
    "SimulationReport": "run",
    "simulate": "run",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


__all__ = [
    "CheckReport",
    "Parallel",
    "RankStats",
    "SimulationReport",
    "build_table",
    "check_plans",
    "parse_parallel",
    "replay",
    "simulate",
]
