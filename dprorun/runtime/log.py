"""The hooks' one way to speak: a warning line on the rank's stderr, prefixed with its rank."""
from __future__ import annotations

import os
import sys


def warn(message: str) -> None:
    rank = os.environ.get("RANK", os.environ.get("HOROVOD_RANK", "?"))
    print(f"[dprorun rank {rank}] warning: {message}", file=sys.stderr, flush=True)
