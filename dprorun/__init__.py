"""dprorun: profile and optimize distributed deep-learning training (the dPRO design) on stock libraries."""
__version__ = "0.1.0"

__all__ = ["__version__"]
