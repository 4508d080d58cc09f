"""The one median the project uses (robust: this kind of machine has outlier iterations several times typical), and
iteration numbers written as ranges."""
from __future__ import annotations

import statistics
from typing import Iterable, Optional


def median(values: Iterable[float], default: Optional[float] = None) -> Optional[float]:
    """The median of `values`, or `default` when there are none."""
    values = list(values)
    return float(statistics.median(values)) if values else default


def ranges_text(values: list[int]) -> str:
    """[2, 3, 4, 7] -> "2-4, 7" (sorted values)."""
    parts, start = [], None
    for i, value in enumerate(values):
        if start is None:
            start = value
        if i + 1 == len(values) or values[i + 1] != value + 1:
            parts.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ", ".join(parts)
