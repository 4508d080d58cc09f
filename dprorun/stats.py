"""The one median the project uses (robust: this kind of machine has outlier iterations several times typical)."""
from __future__ import annotations

import statistics
from typing import Iterable, Optional


def median(values: Iterable[float], default: Optional[float] = None) -> Optional[float]:
    """The median of `values`, or `default` when there are none."""
    values = list(values)
    return float(statistics.median(values)) if values else default
