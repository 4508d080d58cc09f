"""The hooks' one way to speak: a warning line on the rank's stderr, prefixed with its rank."""
from __future__ import annotations

import os
import sys
from typing import Optional


def warn(message: str, rank: Optional[int] = None) -> None:
    """`rank`: the session's (an MXNet worker's is the kvstore's, known once it exists), else the launcher's."""
    rank = rank if rank is not None else os.environ.get("RANK", os.environ.get("HOROVOD_RANK", "?"))
    print(f"[dprorun rank {rank}] warning: {message}", file=sys.stderr, flush=True)
