"""Offline planning from layout descriptions: thousands of simulated ranks in one process.

``simulate(get_model("llama3-8b"), parse_parallel("tp=8,pp=2"), parse_parallel("tp=4"))`` builds
both sides' layout table, plans the ranks and checks the plans (``check_plans``); ``replay``
applies plans to real tensors in one process (a reference executor for tests).
"""

from .check import CheckReport, check_plans
from .layouts import build_table
from .parallel import Parallel, parse_parallel
from .replay import replay
from .run import RankStats, SimulationReport, simulate

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
