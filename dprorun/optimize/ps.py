"""The parameter server's own knob as a search: MXNET_KVSTORE_BIGARRAY_BOUND, the size (elements) from which a key
is split over every server. Each candidate re-places the keys as MXNet's kvstore would and is replayed on the PS
graph (replay/ps.py); the ranking chooses which candidates get a real trial window (`dprorun --autotune --backend
mxnet` runs the top two and keeps the fastest measured if it beats the job's own setting)."""
from __future__ import annotations

import time

from dprorun.replay.ps import PSModel, PSWhatIf, predict_ps
from dprorun.replay.ps_topology import key_parts
from dprorun.strategy import Decision, Strategy

BOUNDS = (50_000, 100_000, 200_000, 500_000, 1_000_000, 4_000_000, 100_000_000)


def rank_ps_bounds(model: PSModel, bounds=BOUNDS, top: int = 2) -> list[Strategy]:
    """The `top` bounds by replayed iteration time, best first, each a Strategy whose baseline is the replay of the
    job as it ran; bounds that place every key as the job's own bound does, or gain less than 1 %, are left out."""
    started = time.monotonic()

    def placement(bound: int) -> list:
        return [key_parts(k, model.servers, bound) for k in model.keys]

    baseline = predict_ps(model).iteration_ms
    own = placement(model.bigarray_bound)
    seen, scored = [own], []
    for bound in bounds:
        placed = placement(bound)
        if placed in seen:
            continue
        seen.append(placed)
        scored.append((predict_ps(model, PSWhatIf(bigarray_bound=bound)).iteration_ms, bound))
    scored.sort()
    out = []
    for predicted, bound in scored[:top]:
        if predicted >= baseline * 0.99:
            break
        decision = Decision("tensor_partition", f"MXNET_KVSTORE_BIGARRAY_BOUND={bound}", round(baseline, 4),
                            round(predicted, 4), f"as run: {model.bigarray_bound}")
        out.append(Strategy(mxnet_bigarray_bound=bound, baseline_ms=round(baseline, 4),
                            predicted_ms=round(predicted, 4), decisions=[decision],
                            search={"evaluations": len(scored) + 1, "seconds": round(time.monotonic() - started, 3),
                                    "world_size": model.workers, "servers": model.servers, "framework": "mxnet"}))
    return out
