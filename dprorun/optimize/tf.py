"""TensorFlow's own knob as a search: the all-reduce pack size (CommunicationOptions bytes_per_pack), each
candidate replayed with TensorFlow's packing (`WhatIf.bucket_mb` on a TF run: `whatif.tf_repacked`), ranked by
predicted iteration time. As for Horovod, the ranking chooses which candidates get a real trial window
(`dprorun --autotune --backend tf` runs the top two and keeps the fastest measured if it beats the job's own
setting); the replay alone does not decide.

XLA (op fusion: auto-clustering, `Strategy.tf_xla`) has no price in the replay (what it fuses, and what it costs to
compile, is known only by running it), so it is always a candidate of its own, measured in a trial window like the
others and kept only if faster: on the bundled custom loop on this 2-core CPU it ran 16x slower (RESULTS.md)."""
from __future__ import annotations

import time

from dprorun.fsutil import UnanswerableError
from dprorun.layout import TF_XLA_AUTO_JIT
from dprorun.replay.predict import replay_once
from dprorun.replay.template import JobModel
from dprorun.replay.whatif import MB, WhatIf, tf_repacked
from dprorun.strategy import Decision, Strategy, transport_caution

PACKS_MB = (0.0, 0.25, 1.0, 4.0, 16.0, 64.0)


def rank_tf_packs(model: JobModel, packs_mb=PACKS_MB, top: int = 2) -> list[Strategy]:
    """The `top` pack sizes by replayed iteration time, best first, each a Strategy whose baseline is the replay
    of the pack size the job ran with; sizes within 1 % of it are not offered, nor sizes that make the same
    packs as the job's own."""
    if model.framework != "tf":
        raise UnanswerableError("the pack size applies to TensorFlow runs only")
    started = time.monotonic()
    as_run_mb = (model.bucket_cap_mb or 0.0)
    as_run_packs = [list(b.params) for b in model.buckets]
    baseline_us, _ = replay_once(model, WhatIf(bucket_mb=as_run_mb))
    scored = []
    for pack_mb in packs_mb:
        whatif = WhatIf(bucket_mb=pack_mb)
        if tf_repacked(model, int(pack_mb * MB)) == as_run_packs:
            continue
        t, _ = replay_once(model, whatif)
        scored.append((t, pack_mb))
    scored.sort()
    out = []
    for t, pack_mb in scored[:top]:
        if t >= baseline_us * 0.99:
            break
        decision = Decision("tensor_fusion", f"all-reduce packs of {pack_mb:g} MB (bytes_per_pack)",
                            round(baseline_us / 1000, 4), round(t / 1000, 4), f"as run: {as_run_mb:g} MB")
        out.append(Strategy(tf_bytes_per_pack_mb=pack_mb, baseline_ms=round(baseline_us / 1000, 4),
                            predicted_ms=round(t / 1000, 4), decisions=[decision],
                            search={"evaluations": len(scored) + 1, "seconds": round(time.monotonic() - started, 3),
                                    "world_size": model.world_size, "framework": "tf", **transport_caution(model)}))
    return out


def xla_candidate(model: JobModel, best: "Strategy | None") -> Strategy:
    """XLA auto-clustering on every worker, with the best pack size found (or the job's own): for a trial window,
    since the replay cannot price it."""
    baseline_us, _ = replay_once(model, WhatIf(bucket_mb=model.bucket_cap_mb or 0.0))
    baseline = round(baseline_us / 1000, 4)
    pack = best.tf_bytes_per_pack_mb if best is not None else None
    decision = Decision("op_fusion", f"XLA auto-clustering (TF_XLA_FLAGS={TF_XLA_AUTO_JIT})"
                        + (f" with packs of {pack:g} MB" if pack is not None else ""), baseline,
                        best.predicted_ms if best is not None else baseline,
                        "not priced by the replay (what XLA fuses and its compile time are known only by running "
                        "it): measured in a trial window")
    return Strategy(tf_bytes_per_pack_mb=pack, tf_xla=True, baseline_ms=baseline,
                    predicted_ms=best.predicted_ms if best is not None else baseline, decisions=[decision],
                    search={"framework": "tf", "measured_only": True})
