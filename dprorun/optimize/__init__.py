"""Optimizer: strategy search over graph passes on the replay model (dPRO Algorithm 1)."""
from dprorun.optimize.search import BudgetError, MemoryModel, optimize

__all__ = ["BudgetError", "MemoryModel", "optimize"]
