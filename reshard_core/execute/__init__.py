"""Execute a rank's plan: packed messages per peer and batch, local copies, transforms, in-place landing."""

from .executor import execute_plan
from .memo import ExecMemo
from .pool import StagingPool
from .stats import ExecStats

__all__ = ["ExecMemo", "ExecStats", "StagingPool", "execute_plan"]
