"""argparse types the two command lines share: numbers that must be positive (or at least zero), refused at the
command line with the flag named, not carried into a launch or a what-if (`dpro replay --np -2` printed a 0.000 ms
prediction; `--bucket-mb -3` built "buckets of up to -3 MB")."""
from __future__ import annotations

import argparse
from typing import Callable, Union

Number = Union[int, float]


def at_least(cast: Callable[[str], Number], least: Number, strictly: bool = False) -> Callable[[str], Number]:
    """An argparse type: `cast(text)`, which must be >= least (> least where `strictly`)."""
    def parse(text: str) -> Number:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < least or (strictly and value == least):
            raise argparse.ArgumentTypeError(f"{text}: must be {'above' if strictly else 'at least'} {least}")
        return value

    return parse


positive_int = at_least(int, 1)
positive_float = at_least(float, 0.0, strictly=True)
non_negative_int = at_least(int, 0)
non_negative_float = at_least(float, 0.0)
