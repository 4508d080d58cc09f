"""dprorun: profile and optimize distributed deep-learning training (the dPRO design) on stock libraries.

`dprorun.strategy()` returns the optimizer's strategy this job runs with (None outside dprorun or without one).
"""
__version__ = "0.1.0"

from dprorun import strategy  # noqa: E402  (callable module: dprorun.strategy())

__all__ = ["__version__", "strategy"]
