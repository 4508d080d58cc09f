"""The parameter server's own knobs as a search: the number of servers and MXNET_KVSTORE_BIGARRAY_BOUND (the size,
in elements, from which a key is split over every server). Each candidate re-places the keys as MXNet's kvstore
would (replay/ps_topology.py's placement pass) and is replayed on the PS graph (replay/ps.py); the ranking chooses
which candidates get a real trial window (`dprorun --autotune --backend mxnet` runs the top two and keeps the
fastest measured if it beats the job's own setting). Server counts are searched up to twice the job's (at least 4);
on one host the replay does not tell a server's own transport work from the shared loopback (its prediction says
so), which the trial window then measures."""
from __future__ import annotations

import time

from dprorun.replay.ps import PSModel, PSWhatIf, predict_ps, server_work_ms
from dprorun.replay.ps_cpu import SPINNING_EVIDENCE, spinning_servers
from dprorun.replay.ps_topology import key_parts
from dprorun.strategy import Decision, Strategy

BOUNDS = (50_000, 100_000, 200_000, 500_000, 1_000_000, 4_000_000, 100_000_000)


def server_counts(model: PSModel) -> list[int]:
    return sorted(set(range(1, max(4, 2 * model.servers) + 1)))


def rank_ps_knobs(model: PSModel, bounds=BOUNDS, servers=None, top: int = 2) -> list[Strategy]:
    """The `top` (servers, bound) settings by replayed iteration time, best first, each a Strategy whose baseline is
    the replay of the job as it ran; settings that place every key as the job's own do, or gain less than 1 %,
    are left out."""
    started = time.monotonic()

    def placement(count: int, bound: int) -> tuple:
        return count, [key_parts(k, count, bound) for k in model.keys]

    baseline = predict_ps(model).iteration_ms
    seen, scored = [placement(model.servers, model.bigarray_bound)], []
    for count in servers or server_counts(model):
        for bound in bounds:
            placed = placement(count, bound)
            if placed in seen:
                continue
            seen.append(placed)
            whatif = PSWhatIf(servers=count, bigarray_bound=bound)
            scored.append((predict_ps(model, whatif).iteration_ms, count, bound))
    scored.sort()
    out = []
    for predicted, count, bound in scored[:top]:
        if predicted >= baseline * 0.99:
            break
        choice = (f"{count} servers, " if count != model.servers else "") + f"MXNET_KVSTORE_BIGARRAY_BOUND={bound}"
        decision = Decision("tensor_partition", choice, round(baseline, 4), round(predicted, 4),
                            f"as run: {model.servers} servers, bound {model.bigarray_bound}")
        out.append(Strategy(mxnet_bigarray_bound=bound, mxnet_servers=count if count != model.servers else None,
                            baseline_ms=round(baseline, 4), predicted_ms=round(predicted, 4), decisions=[decision],
                            search={"evaluations": len(scored) + 1, "seconds": round(time.monotonic() - started, 3),
                                    "world_size": model.workers, "servers": model.servers, "framework": "mxnet"}))
    return out


def server_threads_candidate(model: PSModel, best: "Strategy | None") -> "Strategy | None":
    """One OpenMP thread a server (OMP_NUM_THREADS=1 in the servers' environment), with the best knobs found (or
    the job's own), where a busy host's servers took far more CPU than their work (replay/ps_cpu.spinning_servers):
    for a trial window, since the replay cannot price the CPU their threads would leave to the workers."""
    as_run = predict_ps(model)
    found = spinning_servers(model.host_cpu, server_work_ms(model, as_run.device_busy_ms))
    if not found:
        return None
    baseline = round(as_run.iteration_ms, 4)
    predicted = best.predicted_ms if best is not None else baseline
    choice = "OMP_NUM_THREADS=1 for the servers" + (f" with {best.decisions[0].choice}" if best is not None else "")
    decision = Decision("server_threads", choice, baseline, predicted,
                        f"not priced by the replay ({found[0].describe()}; {SPINNING_EVIDENCE}): measured in a "
                        "trial window")
    return Strategy(mxnet_bigarray_bound=best.mxnet_bigarray_bound if best is not None else None,
                    mxnet_servers=best.mxnet_servers if best is not None else None, mxnet_server_threads=1,
                    baseline_ms=baseline, predicted_ms=predicted, decisions=[decision],
                    search={"framework": "mxnet", "measured_only": True, "world_size": model.workers,
                            "servers": model.servers})
