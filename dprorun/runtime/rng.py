"""The script's random streams, kept across dprorun's own work inside a rank.

A script seeded for reproducibility (torch.manual_seed, random.seed, numpy.random.seed) draws the same numbers
under dprorun as under torchrun only if nothing dprorun runs in its process draws from them. The end-of-window
work (clock probes, calibration, gathering) runs torch operations in the script's process; one random operand
there moved the global generator, so every dropout mask and shuffle after the window differed from a plain
launch's (losses and parameters at the end of the job too). `script_random_state_kept()` saves the streams
before that work and puts them back after it, whatever the work draws.
"""
from __future__ import annotations

import contextlib
import random
import sys
from typing import Any, Iterator


def _saved_states() -> dict[str, Any]:
    states: dict[str, Any] = {"python": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy"] = numpy.random.get_state()
    torch = sys.modules.get("torch")
    if torch is not None:
        states["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _restore(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    if "numpy" in states:
        sys.modules["numpy"].random.set_state(states["numpy"])
    if "torch" in states:
        torch = sys.modules["torch"]
        torch.set_rng_state(states["torch"])
        if "cuda" in states:
            torch.cuda.set_rng_state_all(states["cuda"])


@contextlib.contextmanager
def script_random_state_kept() -> Iterator[None]:
    """Python's, numpy's (where the script imported it), torch's CPU and initialised CUDA generators: as they
    were on entry, on exit (also when the work raised)."""
    states = _saved_states()
    try:
        yield
    finally:
        _restore(states)
