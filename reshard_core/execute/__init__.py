"""Execute a rank's plan: packed messages per peer and batch, local copies, transforms, in-place landing."""

from .executor import execute_plan
from .pool import StagingPool
from .stats import ExecStats

__all__ = ["ExecStats", "StagingPool", "execute_plan"]
