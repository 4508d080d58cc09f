"""The hooks' one way to speak: a warning line on the rank's stderr, prefixed with its rank."""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional


def warn(message: str, rank: Optional[int] = None) -> None:
    """`rank`: the session's (an MXNet worker's is the kvstore's, known once it exists), else the launcher's."""
    rank = rank if rank is not None else os.environ.get("RANK", os.environ.get("HOROVOD_RANK", "?"))
    print(f"[dprorun rank {rank}] warning: {message}", file=sys.stderr, flush=True)


def as_the_callers(call: Callable[..., Any], *args, **kwargs) -> Any:
    """call(*args, **kwargs) from a wrapper the hooks put around a library's function (DDP's __init__): the Python
    warnings it raises name the script's line that called the wrapper, as they would without it (torch's
    "`broadcast_buffers` is deprecated" named dprorun/runtime/ddp.py). Each is re-raised once the call returns."""
    import warnings

    raised: list = []
    try:
        with warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("always")
            return call(*args, **kwargs)
    finally:  # also where the call raised: its warnings came first
        caller = sys._getframe(2)  # the script's frame, above the wrapper that called this
        for item in raised:
            if item.filename == __file__:  # a warning at the library's caller (stacklevel=2): the script's line
                where, line, scope = caller.f_code.co_filename, caller.f_lineno, caller.f_globals
            else:
                where, line = item.filename, item.lineno
                scope = {"__name__": os.path.splitext(os.path.basename(where))[0]}
            warnings.warn_explicit(item.message, item.category, where, line, module=scope["__name__"],
                                   registry=scope.setdefault("__warningregistry__", {}))
