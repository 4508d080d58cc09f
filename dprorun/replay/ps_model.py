"""The PS model of a run directory (MXNet kvstore dist_sync or dist_async: the mode the hooks saw): `build_ps_model`
reads the workers' events, profiles and calibration and the servers' server.json once each, and fits the costs so
that the graph of replay/ps.py replays the job as it ran.

Costs: alpha and the link bandwidth are fitted so that the same topology replays the end-of-window calibration
(round trips of 4 KiB - 16 MiB through the job's kvstore) as measured, then scaled by one level so that the
profiled iterations replay to their own length (every key in flight at once, against one at a time); the server
update is a linear fit of the timed updates; the servers' merging of each arriving push and their copy of each pull's
response are priced from the copy and add each server's engine was probed with, by size; the compute ops come from
mx.profiler, scaled (one factor) so that the job as it ran replays to its own iterations without the profiler: the
clean ones where there are 5 or more, else the window's. Where the transfers alone, at the profiled iterations'
level, replay longer than those (the profiled iterations' transfers ran slow on a noisy host), the compute takes the
profiler's usual inflation (x0.8) and the link level is refitted to them instead, and the notes say so.
"""
from __future__ import annotations

import functools
import json
import os
import statistics
from dataclasses import replace
from typing import Optional

import numpy as np

from dprorun.fsutil import TraceError, UnanswerableError
from dprorun.layout import CLEAN_FILE, EVENTS_FILE, MX_PROFILE_FILE, PRIMARY_REPLACED, PS_CALIBRATION_KEY_BASE, \
    node_offset_us, rank_dir, server_dir
from dprorun.replay.engine import replay
from dprorun.replay.ps_cpu import busy_hosts, read_host_cpu
from dprorun.replay.ps import OPTIMIZER_NOT_LOADED, PSModel, PSWhatIf, WorkerOps, calibration_graph, ps_graph
from dprorun.replay.ps_topology import LOOPBACK_GBIT, PSKey
from dprorun.stats import median, ranges_text
from dprorun.trace.mxprofile import COPY_OP, NOT_COMPUTE, MXOp, comm_phases, numbered_files, \
    read_mx_profile_checked, read_server_docs, read_server_updates
from dprorun.trace.rundir import inference_cadence_warning, inference_set_aside


def is_ps_run(run_dir: str) -> bool:
    try:
        with open(os.path.join(run_dir, "manifest.json")) as handle:
            return json.load(handle).get("backend") == "mxnet"
    except (OSError, ValueError):
        return os.path.isdir(server_dir(run_dir, 0))


def _load(path: str) -> dict:
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError) as exc:
        raise TraceError(path, f"unreadable ({type(exc).__name__}: {exc})") from None


def build_ps_model(run_dir: str, host_cores: Optional[int] = None) -> PSModel:
    """Read the workers' events, profiles and calibration and the servers' updates; fit the costs; scale compute.
    `host_cores`: the cores a host's roles share in the replay (fitted so, too): None or 0 each role's work as if on a
    core of its own (the default), -1 the cores the hooks recorded, N that many."""
    workers = {r: _load(path) for r, path in numbered_files(run_dir, rank_dir, EVENTS_FILE).items()}
    cleans = {r: _load(path) for r in workers  # each worker's clean.json, where it wrote one
              if os.path.exists(path := os.path.join(rank_dir(run_dir, r), CLEAN_FILE))}
    if not workers:
        raise TraceError(run_dir, f"no worker recorded events (rank_0/{EVENTS_FILE})")
    first = workers[0]
    tracker = next((t for t in first.get("trackers", []) if t.get("framework") == "mxnet"), None)
    if tracker is None or not tracker.get("keys") or not first.get("iteration_starts_us"):
        local = [] if tracker is None or tracker.get("kvstore") else tracker.get("local_kvstores") or []
        raise TraceError(run_dir, "worker 0 recorded no iteration with kvstore keys: the hooks count "
                         "gluon.Trainer.step or Module.update calls on a dist kvstore, or else push/pull cycles of "
                         "a script that pushes by hand; this one made none on a dist kvstore"
                         + (f" (its kvstore was {', '.join(repr(k) for k in local)}: each worker trained on its own, "
                            "nothing reached the servers; kvstore='dist_sync' shares the gradients)" if local else ""))
    notes: list[str] = _cut_notes(first) + _worker_warnings(workers)
    keys = _window_keys(tracker["keys"], int(tracker.get("window_iterations") or 0), notes)
    read_from = len(notes)
    ops, window, clean = _read_workers(run_dir, workers, cleans, keys, notes)
    if not ops:  # what the workers warned of and what reading their profiles met
        said = "".join(f"; {note}" for note in _worker_warnings(workers) + notes[read_from:])
        raise UnanswerableError(f"{run_dir}: no worker has a complete profiled iteration in {MX_PROFILE_FILE} "
                                f"(give --kineto-iters 3 or more, and --warmup 1 or more){said}")
    server_docs = read_server_docs(run_dir)  # read once: updates, hosts, probes
    update_fit, copy_fit, add_fit = _server_costs(run_dir, workers, server_docs, tracker, notes)
    calibration = _calibration(workers)
    hosts, worker_hosts, server_hosts = _role_hosts(server_docs, workers)
    model = PSModel(workers=int(tracker.get("workers", len(workers))), servers=int(tracker.get("servers", 1)),
                    bigarray_bound=int(tracker.get("bigarray_bound", 1_000_000)), keys=keys, worker_ops=ops,
                    link_slots=max(1, int(tracker.get("cores") or 1)),
                    update_us=update_fit, alpha_us=0.0, bytes_per_us=125.0, calibration=calibration,
                    window_iterations_us=window, clean_iterations_us=clean, notes=notes, copy_us=copy_fit,
                    add_us=add_fit, sync="async" not in str(tracker.get("kvstore", "")),
                    push_ratio=_push_ratio(tracker.get("gradient_compression"), notes))
    if not model.sync:
        notes.append(f"{tracker.get('kvstore')}: each push is updated on its own as it reaches its server and the "
                     "pusher's pull answered after it; the workers meet only on the servers' engines and the links "
                     "(loopback, 2 models, 3 rounds: 1 server of 2 within 1 % as a ratio to the as-run replay, a "
                     "big-array bound of 100000 -4.5 % on a conv net and -13 % on an MLP)")
    model.host_cpu = read_host_cpu(workers, cleans, server_docs, hosts, worker_hosts, server_hosts)
    if host_cores:
        model.host_cores = model.link_slots if host_cores < 0 else host_cores
        notes.append(f"each host's {model.host_cores} cores shared by its workers' compute, its loopback's transfers "
                     "and its servers' engines (--host-cores; on loopback, 2 cores, 5 models, 8 rounds: the what-ifs "
                     "were no closer than without it)")
    if len(hosts) > 1:  # the roles' hosts, for the "hosts" links (a what-if: the job is fitted on one medium)
        model.hosts, model.worker_hosts, model.server_hosts = hosts, worker_hosts, server_hosts
    if calibration:
        model.alpha_us, model.bytes_per_us = fit_links(model)
    else:
        failed = [w for w in first.get("warnings", []) if w.startswith("kvstore calibration failed")]
        cause = failed[0] if failed else "the job ended before the end of the window"
        notes.append(f"warning: no kvstore calibration ({cause}): links priced at 1 Gbit/s, no latency")
    model.profiled_iteration_us = median(w.period_us for w in ops.values())
    if model.profiled_iteration_us:
        model.link_level = fit_link_level(model, model.profiled_iteration_us)
        notes += link_level_notes(model.link_level, "the calibration's bandwidth" if calibration
                                  else "the 1 Gbit/s assumed without a calibration")
    # the reference the compute is scaled to: the clean iterations (no profiler, no hooks' work) when there are
    # enough of them, else the window's iterations without the profiler
    model.reference = "clean" if len(clean) >= 5 else "window"
    if model.measured_iteration_us is not None:
        model.compute_scale = fit_compute_scale(model, model.measured_iteration_us)
        if model.compute_scale <= COMPUTE_SCALE_FLOOR * 1.5:
            _refit_links_to_reference(model)
    notes += _host_notes(model, hosts)
    if window and clean:
        gap = median(window) / median(clean) - 1
        if abs(gap) > 0.05:
            notes.append(f"the window's iterations without the profiler ({median(window) / 1000:.2f} ms) and the "
                         f"clean ones after it ({median(clean) / 1000:.2f} ms) differ by {100 * gap:+.1f} %: the "
                         f"prediction follows the {model.reference} ones"
                         + (" (no profiler and no hook work in them)" if model.reference == "clean" else ""))
    if model.measured_iteration_us:  # the self-check every prediction states (ps.predict_ps)
        model.fitted_as_run_us = replay(ps_graph(model, PSWhatIf())).iteration_time_us
    return model


def _window_keys(recorded: list[dict], window_iterations: int, notes: list[str]) -> list[PSKey]:
    """The keys pushed in most of the window's iterations (counted by the hooks; every key in a run of an older
    dprorun or one that ended before its window): a key pushed only before or after the window (a layer frozen
    there) or in few of its iterations is not priced."""
    pushed = [k for k in recorded if not window_iterations
              or 2 * int(k.get("window_pushes", window_iterations)) >= window_iterations] or recorded
    left = [k for k in recorded if k not in pushed]
    if left:
        notes.append(f"{len(left)} of the {len(recorded)} kvstore keys ({sum(int(k['bytes']) for k in left):,} "
                     f"bytes) were pushed in fewer than half of the window's {window_iterations} iterations (a layer "
                     "frozen there, or a key the script pushes now and then): not priced")
    return [PSKey(int(k["key"]), int(k["bytes"]), int(k.get("elements", k["bytes"] // 4)), int(k["priority"]),
                  k["pull_bytes"] / k["bytes"] if k.get("pull_bytes") and k["bytes"] else 1.0) for k in pushed]


# the share of its bytes a push carries under MXNet's gradient compression (2-bit: 16 values to a float32 word)
COMPRESSED_PUSH = {"2bit": 1 / 16, "1bit": 1 / 32}


def _push_ratio(compression: Optional[str], notes: list[str]) -> float:
    """The share of a key's bytes each push carries under the kvstore's gradient compression (the hooks record it
    from set_gradient_compression); said in `notes`."""
    if not compression or compression == "none":
        return 1.0
    ratio = COMPRESSED_PUSH.get(compression)
    if ratio is None:
        notes.append(f"warning: the kvstore compresses its gradients ({compression!r}), a kind the replay does not "
                     "know: its pushes are priced at their whole bytes")
        return 1.0
    notes.append(f"the kvstore compresses its gradients ({compression}): each push carries 1/{round(1 / ratio)} of "
                 "its key's bytes (the pulls, the servers' merging and updates the whole); the calibration pushed "
                 "compressed as well")
    return ratio


def _worker_warnings(workers: dict[int, dict]) -> list[str]:
    """What the hooks warned of on the workers (each text's first line once, with the workers that said it), but
    for what the model says itself (a model switch's cut: _cut_notes; a failed calibration)."""
    said: dict[str, list[int]] = {}
    for r, events in sorted(workers.items()):
        for warning in events.get("warnings", []):
            line = str(warning).splitlines()[0] if warning else ""
            if line and not line.startswith((PRIMARY_REPLACED, "kvstore calibration failed")):
                said.setdefault(line, []).append(r)
    return [f"worker{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {line}"
            for line, ranks in said.items()]


def _cut_notes(events: dict) -> list[str]:
    """The hooks' warning where worker 0's profiling ended early (the script went on to train another model or
    another set of parameters): the figures rest on the iterations before it."""
    if events.get("window", {}).get("cut_at") is None:
        return []
    return [f"warning: {w}" for w in events.get("warnings", []) if w.startswith(PRIMARY_REPLACED)]


def _cut_at(events: dict) -> Optional[int]:
    """The iteration from which the job trained something else (see _cut_notes), or None."""
    cut = events.get("window", {}).get("cut_at")
    return None if cut is None else int(cut)


def _host_notes(model: PSModel, hosts: list[str]) -> list[str]:
    """What the roles' hosts mean for the figures: a host whose CPU held the job back, the roles across hosts."""
    notes = [f"the CPU held the job back on {h.describe()}: each role's work is replayed at the time it took "
             "there, the waits for the CPU included"
             for h in busy_hosts(model.host_cpu)]
    if len(hosts) > 1:
        notes.append(f"the roles ran on {len(hosts)} hosts ({', '.join(hosts)}): every transfer is priced on one "
                     "medium fitted to the job's own calibration; `--links hosts` puts what crosses hosts on each "
                     f"host's NIC and the rest on its loopback ({LOOPBACK_GBIT} Gbit/s; it replayed the job as it ran "
                     "65 % slow on two emulated hosts); a what-if with fewer servers says how far it was off there")
    return notes


def _read_workers(run_dir: str, workers: dict, cleans: dict[int, dict], keys: list[PSKey],
                  notes: list[str]) -> tuple[dict[int, WorkerOps], list[float], list[float]]:
    """(each worker's profiled iteration, the window's unprofiled iterations, the clean ones) of every worker;
    what could not be read said in `notes`."""
    ops = {}
    for r, events in workers.items():
        profile = os.path.join(rank_dir(run_dir, r), MX_PROFILE_FILE)
        if os.path.exists(profile):
            profiled, unfinished = read_mx_profile_checked(profile)
            profiled = _before_cut(profiled, events)
            if unfinished:
                notes.append(f"{profile}: the profiler's dump was never finished (its worker was stopped, or left "
                             "after its script raised): read to its last complete event")
            measured = worker_ops_from_profile(r, profiled, keys)
            notes += irregular_phases(r, profiled, keys)
            if measured is not None:
                ops[r] = measured
            else:
                notes.append(f"worker {r}: no complete profiled iteration in {profile}; the other workers' stand "
                             "in for it")
    # iterations under the script's own profiler (runtime/script_profiler.py) on any worker: left out where others
    # remain (as the reader does for the other frameworks)
    marked = set().union(*(set(events.get("script_profiler_iterations", []))
                           | set((cleans.get(r) or {}).get("script_profiler_iterations", []))
                           for r, events in workers.items()))
    # iterations holding a validation pass (and on MXNet the drained one after): left out as well
    aside = {r: inference_set_aside(events) for r, events in workers.items()}
    window_all = [t for r, e in workers.items() for t in _unprofiled_window(e, aside[r])]
    clean_all = [t for r, e in workers.items() for t in _clean_iterations(cleans.get(r), e, aside[r])]
    window = [t for r, e in workers.items() for t in _unprofiled_window(e, marked | aside[r])] or window_all
    clean = [t for r, e in workers.items() for t in _clean_iterations(cleans.get(r), e, marked | aside[r])] or clean_all
    if len(window) < len(window_all) or len(clean) < len(clean_all):
        notes.append(f"iterations {', '.join(map(str, sorted(marked)))} ran (in part) under the script's own "
                     "profiler: left out of the window's and the clean iterations' statistics")
    validating = sorted(set().union(*aside.values()))
    if validating:
        notes.append(f"iterations {ranges_text(validating)} left out of the window's and the clean iterations' "
                     "statistics: forward passes outside autograd's recording (a validation pass) in them or in the "
                     "one before")
    notes += sorted({f"warning: {w}" for w in map(inference_cadence_warning, workers.values()) if w})
    return ops, window, clean


def irregular_phases(rank: int, ops: list[MXOp], keys: list[PSKey]) -> list[str]:
    """A warning where a worker's push/pulls do not fall into one group per iteration (comm_phases): the groups
    between the profile's first and last differ in size, or far fewer groups than the keys' push/pulls make. A
    push/pull that overlaps the next iteration's forward does that (a key the next forward does not read: a head
    the step did not use, in a script that alternates heads), and the iteration read from the profile is then
    uncertain."""
    comm = [op for op in ops if op.is_kvstore]
    groups = comm_phases(comm, ops)
    sizes = [len(g) for g in groups]
    inner = sizes[1:-1] or sizes
    per_iteration = (2 if any(op.name.endswith("Push") for op in comm) else 1) * max(1, len(keys))
    common = max(inner.count(n) for n in set(inner)) if inner else 0
    if not comm or (2 * common >= len(inner) and 2 * per_iteration * len(groups) >= len(comm)):
        return []
    shown = ", ".join(map(str, sizes[:8])) + (", ..." if len(sizes) > 8 else "")
    return [f"warning: worker {rank}'s profile: its {len(comm)} push/pulls fall into groups of {shown} where an "
            f"iteration has {per_iteration}: one overlapped the next iteration's forward (a key that forward does "
            "not read, e.g. a head the step did not use), so the iteration read from the profile, and the figures "
            "built on it, are uncertain"]


def worker_ops_from_profile(rank: int, ops: list[MXOp], keys: list[PSKey]) -> Optional[WorkerOps]:
    """The worker's iterations in its profile: each ends with one push/pull per key (grouped in start order);
    medians over the complete ones (compute ops between the previous iteration's copies and this one's last push
    start, this one's copies, the gap to the next iteration's first op), and where each push started among them:
    an imperative (non-hybridized) net's pushes start as its backward makes each gradient, beside the rest of it."""
    groups = comm_phases([op for op in ops if op.is_kvstore], ops)
    compute = [op for op in ops if not op.is_kvstore and op.name not in NOT_COMPUTE]
    iterations = []
    for j in range(1, len(groups)):
        iteration = _profiled_iteration(groups, j, compute)
        if iteration is not None:
            iterations.append(iteration)
    if not iterations:
        return None
    shapes = {}
    for it in iterations:
        shapes.setdefault((tuple(name for name, _ in it["ops"]), len(it["cuts"])), []).append(it)
    chosen = max(shapes.values(), key=len)  # the most frequent op sequence; durations: medians per position
    if len(chosen) == 1 < len(iterations):  # no sequence repeats (a worker with several contexts interleaves their
        # ops anew every iteration): the iteration of the median period
        chosen = [sorted(iterations, key=lambda it: it["period"])[(len(iterations) - 1) // 2]]
    names = [name for name, _ in chosen[0]["ops"]]
    chain = [(name, statistics.median(it["ops"][i][1] for it in chosen)) for i, name in enumerate(names)]
    total_bytes = sum(k.nbytes for k in keys)
    cuts = [int(statistics.median(it["cuts"][i] for it in chosen)) for i in range(len(chosen[0]["cuts"]))]
    return WorkerOps(rank=rank, ops=chain, dispatch_us=median(it["dispatch"] for it in chosen),
                     tail_us=median(it["tail"] + max(0.0, it["lead"]) for it in chosen),
                     copy_us_per_byte=median(it["copy"] for it in chosen) / max(total_bytes, 1),
                     profiled_iterations=len(chosen), period_us=median(it["period"] for it in chosen),
                     push_after=cuts if any(c < len(chain) for c in cuts) else [])


def _profiled_iteration(groups: list[list[MXOp]], j: int, compute: list[MXOp]) -> Optional[dict]:
    """Iteration j of the profile (see worker_ops_from_profile), or None where it is incomplete."""
    previous_end = max(op.end_us for op in groups[j - 1])
    starts = sorted(op.start_us for op in groups[j])
    start, last_start = starts[0], starts[-1]
    after_prev = [op for op in compute if op.start_us >= previous_end - 1.0]
    copies_prev = [op for op in after_prev if op.name == COPY_OP and op.start_us < start]
    body = [op for op in after_prev if op.name != COPY_OP and op.end_us <= last_start + 1.0]
    if not body:
        return None
    copies_end = max((op.end_us for op in copies_prev if op.end_us <= body[0].start_us), default=previous_end)
    own_end = max(op.end_us for op in groups[j])
    next_ops = [op for op in compute if op.start_us >= own_end - 1.0]
    copies = [op for op in next_ops if op.name == COPY_OP]
    following = [op for op in next_ops if op.name != COPY_OP]
    if not following:
        return None
    copies = [op for op in copies if op.end_us <= following[0].start_us]
    chain: list[tuple[str, float]] = []
    ends: list[float] = []
    cursor = body[0].start_us
    for op in body:
        if op.start_us > cursor:
            chain.append(("(between ops)", op.start_us - cursor))
            ends.append(op.start_us)
        chain.append((op.name, op.duration_us))
        cursor = max(cursor, op.end_us)
        ends.append(cursor)
    # each push (in start order) after the chain's nodes that had ended by its start
    cuts = [sum(1 for e in ends if e <= t + 1.0) for t in starts]
    before_first = max((e for e in ends if e <= start + 1.0), default=body[0].start_us)
    copy_end = max((op.end_us for op in copies), default=own_end)
    return {"ops": chain, "cuts": cuts, "dispatch": max(0.0, start - before_first),
            "tail": max(0.0, following[0].start_us - copy_end), "copy": sum(op.duration_us for op in copies),
            "lead": body[0].start_us - copies_end, "period": following[0].start_us - body[0].start_us}


def _unprofiled_window(events: dict, skip: set[int]) -> list[float]:
    """The window's iterations without the profiler: after the profiled ones and the one their dump disturbed,
    before the end-of-window work; none of `skip`."""
    window = events.get("window", {})
    warmup, active = int(window.get("warmup", 0)), int(window.get("active", 0))
    profiled = window.get("kineto_iterations") or []
    starts = events.get("iteration_starts_us", [])
    first = (max(profiled) + 2) if profiled else warmup
    disturbed = set(events.get("disturbed_iterations", [])) | skip
    last = min(warmup + active - 1, len(starts) - 1, _cut_at(events) or len(starts))
    return [starts[i + 1] - starts[i] for i in range(first, last) if i not in disturbed]


def _clean_iterations(clean: Optional[dict], events: dict, skip: set[int]) -> list[float]:
    """A worker's clean iterations (µs) from its clean.json (None: it wrote none), before any cut (_cut_at); none
    of `skip`."""
    starts = (clean or {}).get("iteration_starts_us", [])
    first = int((clean or {}).get("first_iteration", 0))
    disturbed, cut = set(events.get("disturbed_iterations", [])) | skip, _cut_at(events)
    # the first is iteration W+K, inside which the end-of-window work (calibration, files) ran: not clean
    return [starts[j + 1] - starts[j] for j in range(1, len(starts) - 1)
            if first + j not in disturbed and (cut is None or first + j < cut)]


def _before_cut(ops: list[MXOp], events: dict) -> list[MXOp]:
    """The profile's operators before the iteration that ends with the set-up of what the job trained next (its
    forward and backward are the new model's already): the profiled iterations of what the window profiled."""
    cut, starts = _cut_at(events), events.get("iteration_starts_us", [])
    if cut is None or not 0 < cut <= len(starts):
        return ops
    end_us = starts[cut - 1] - float(events.get("clock", {}).get("test_skew_us", 0.0))
    return [op for op in ops if op.start_us < end_us]


def _server_updates(run_dir: str, workers: dict, server_docs: dict[int, dict]) -> list[tuple[int, float]]:
    """(bytes, µs) of the servers' updates of model keys inside the workers' window."""
    shift = {r: node_offset_us(rank_dir(run_dir, r)) for r in workers}  # other hosts' workers: node 0's clock
    lo = min(w["window"]["start_us"] + shift[r] for r, w in workers.items() if w.get("window", {}).get("start_us"))
    hi = max((w["window"]["end_us"] or lo) + shift[r] for r, w in workers.items()
             if w.get("window", {}).get("start_us"))
    updates, _ = read_server_updates(run_dir, server_docs)
    return [(u.nbytes, u.end_us - u.start_us) for u in updates
            if u.key < PS_CALIBRATION_KEY_BASE and lo <= u.start_us <= hi]


def _server_costs(run_dir: str, workers: dict, server_docs: dict[int, dict], tracker: dict,
                  notes: list[str]) -> tuple[tuple[float, float], tuple, tuple]:
    """(update a + b x bytes, the engine's copy and add by size) of the servers: fitted to their timed updates and
    taken from their probes; where the optimizer ran on the workers (update_on_kvstore False: no updater reaches the
    servers' hooks), the merging priced from the workers' probe of the same engine and the update as the copy of
    the summed pushes into the stored value, which is what such a server does."""
    failed = sorted(s for s, doc in server_docs.items() if doc.get("optimizer_error"))
    if failed:
        notes.append(OPTIMIZER_NOT_LOADED.format(servers=", ".join(map(str, failed)),
                                                 error=server_docs[failed[0]]["optimizer_error"]))
    updates = _server_updates(run_dir, workers, server_docs)
    update_fit = _linear_fit(updates) if updates else (0.0, 0.0)
    copy_fit, add_fit = _server_memory(server_docs)
    probes = {r: {"memory": t.get("engine_probe")} for r, events in workers.items()
              for t in events.get("trackers", []) if t.get("framework") == "mxnet" and t.get("engine_probe")}
    workers_update = tracker.get("update_on_kvstore") is False or tracker.get("optimizer_on_servers") is False
    if workers_update and not updates and not copy_fit and probes:
        copy_fit, add_fit = _server_memory(probes)
        update_fit = (0.0, copy_fit[-1][1] / copy_fit[-1][0])
        why = ("update_on_kvstore False" if tracker.get("update_on_kvstore") is False else
               "the kvstore was given no optimizer: the script updates on the workers")
        notes.append(f"the optimizer ran on the workers ({why}): the servers sum the pushes and store "
                     "the sum, priced from the workers' probe of the same engine (their copy and add by size); no "
                     "server CPU is recorded (no updater reaches the hooks)")
        return update_fit, copy_fit, add_fit
    if not updates:
        notes.append("no server recorded its updates: the servers' update time is taken as 0")
    if server_docs and not copy_fit:
        notes.append("no server probed its copy and add speed (no updater reached the servers' hooks, or a run of an "
                     "older dprorun): the merging of each push and the copy into each pull's response are not priced "
                     "on the servers")
    return update_fit, copy_fit, add_fit


def _server_memory(server_docs: dict[int, dict]) -> tuple[tuple[tuple[float, float], ...],
                                                             tuple[tuple[float, float], ...]]:
    """(copy, add) of the servers' engine: per probed size (bytes, µs), the median over the servers that probed it
    (failed probes, zeros, left out); ps_topology.engine_us prices any size from them."""
    by_size: dict[float, list[tuple[float, float]]] = {}
    for doc in server_docs.values():
        for row in doc.get("memory") or []:
            if len(row) >= 3 and row[0] > 0 and row[1] > 0 and row[2] > 0:
                by_size.setdefault(float(row[0]), []).append((float(row[1]), float(row[2])))
    sizes = sorted(by_size)
    return (tuple((b, statistics.median(c for c, _ in by_size[b])) for b in sizes),
            tuple((b, statistics.median(a for _, a in by_size[b])) for b in sizes))


def _role_hosts(server_docs: dict[int, dict], workers: dict) -> tuple[list[str], list[int], list[int]]:
    """(the hosts' names, each worker's host index, each server's host index) from the workers' events and the
    servers' server.json; servers that wrote none are left out (a what-if places them round-robin)."""
    worker_names = {r: str(events.get("host", "")) for r, events in workers.items()}
    server_names = {s: str(doc.get("host", "")) for s, doc in server_docs.items()}
    names = sorted((set(worker_names.values()) | set(server_names.values())) - {""})
    index = {name: k for k, name in enumerate(names)}
    servers = [index.get(server_names.get(s, ""), 0) for s in range(max(server_names, default=-1) + 1)]
    return names, [index.get(worker_names[r], 0) for r in sorted(worker_names)], servers


def _linear_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """a + b x through the per-size medians (least squares; b >= 0, a >= 0)."""
    by_size: dict[float, list[float]] = {}
    for x, y in points:
        by_size.setdefault(x, []).append(y)
    xs = np.array(sorted(by_size), dtype=float)
    ys = np.array([statistics.median(by_size[x]) for x in xs])
    if len(xs) == 1 or np.ptp(xs) == 0:
        return float(ys.mean()), 0.0
    b, a = np.polyfit(xs, ys, 1)
    if b < 0:
        return float(ys.mean()), 0.0
    return max(0.0, float(a)), float(b)


def _calibration(workers: dict) -> list[tuple[int, float, int]]:
    rows: dict[tuple[int, int], list[float]] = {}
    for events in workers.values():
        for row in events.get("calibration") or []:
            if len(row) >= 3:
                rows.setdefault((int(row[0]), int(row[2])), []).append(float(row[1]))
    return [(b, statistics.median(ts), p) for (b, p), ts in sorted(rows.items())]


# the alpha the calibration's slope is measured at: of the size fitted (100-450 us here), so that the order in which
# the servers' engines take their ops, which a 1 us alpha can flip, is the order of the fitted model
ALPHA_PROBE_US = 100.0


def fit_links(model: PSModel) -> tuple[float, float]:
    """(alpha µs, bytes/µs) with which the topology replays the calibration round trips closest (relative least
    squares over a bandwidth grid; alpha, which enters each round trip's critical path a fixed number of times,
    solved for each bandwidth)."""
    best = None
    for gbit in np.geomspace(0.05, 400.0, 90):
        bw = gbit * 1e9 / 8 / 1e6
        trial = replace(model, alpha_us=0.0, bytes_per_us=bw)
        base = np.array([replay(calibration_graph(trial, b, p)).iteration_time_us for b, _, p in model.calibration])
        probe = replace(trial, alpha_us=ALPHA_PROBE_US)
        slope = np.array([replay(calibration_graph(probe, b, p)).iteration_time_us for b, _, p in model.calibration])
        slope = np.maximum(slope - base, 1e-9) / ALPHA_PROBE_US
        measured = np.array([t for _, t, _ in model.calibration])
        weights = 1.0 / measured ** 2
        alpha = max(0.0, float(np.sum(weights * slope * (measured - base)) / np.sum(weights * slope * slope)))
        error = float(np.sum(weights * (base + alpha * slope - measured) ** 2))
        if best is None or error < best[0]:
            best = (error, alpha, bw)
    return best[1], best[2]


LINK_LEVELS = (0.05, 20.0)  # the factors on the calibrated bandwidth the link level is fitted between


def link_level_notes(level: float, reference: str = "the calibration's bandwidth") -> list[str]:
    """What the fitted link level says: a factor far from the calibration's (`reference`: what the level is a factor
    of), or one at the end of its range (the profile then does not say how fast the job's transfers ran)."""
    if level >= LINK_LEVELS[1]:
        return [f"warning: the profiled iterations replay as long as they ran even with the transfers at x{level:g} "
                f"of {reference}: the compute, as profiled, fills them (the transfers hidden behind "
                "it), so the profile does not say how fast the job's transfers ran; they are priced at that level, "
                "and a what-if that moves transfers (servers, workers, big-array bound, a bandwidth ratio) shows the "
                "compute's side only (an absolute --bandwidth does not use the level)"]
    if level <= LINK_LEVELS[0]:
        return [f"warning: the profiled iterations replay shorter than they ran even with the transfers at x{level:g} "
                f"of {reference}: something the graph does not hold waited in them (a loaded host, "
                "a worker's own waits); what-ifs that move transfers price them at that level"]
    if not 0.5 <= level <= 2.0:
        return [f"the job's own transfers ran at x{level:.2f} of {reference}" + (
            " (transfers of every key at once, against one key at a time with nothing else running)"
            if reference == "the calibration's bandwidth" else "")]
    return []


def fit_link_level(model: PSModel, profiled_us: float, compute_scale: float = 1.0) -> float:
    """The factor on the calibrated bandwidth with which the profiled iterations (compute as profiled, or scaled by
    `compute_scale`) replay to `profiled_us`: the job's transfers as they ran, all keys at once and the compute's
    threads beside them (bisection on a log scale; the replay gets faster as the factor grows)."""
    def replayed(level: float) -> float:
        return replay(ps_graph(replace(model, compute_scale=compute_scale, link_level=level),
                               PSWhatIf())).iteration_time_us

    lo, hi = LINK_LEVELS
    if replayed(hi) >= profiled_us:
        return hi
    if replayed(lo) <= profiled_us:
        return lo
    for _ in range(30):
        mid = (lo * hi) ** 0.5
        if replayed(mid) > profiled_us:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5


def fit_compute_scale(model: PSModel, target_us: float, rounds: int = 6) -> float:
    """The factor on the profiled compute with which the job as it ran replays to `target_us` (its iterations
    without the profiler): the replay is monotone in it, so a few fixed-point rounds usually settle it, and a
    bisection does where they do not (each factor replayed once)."""
    compute = statistics.median(w.compute_us + w.tail_us + w.copy_us_per_byte * sum(k.nbytes for k in model.keys)
                                for w in model.worker_ops.values())
    @functools.lru_cache(maxsize=None)
    def replayed(factor: float) -> float:
        return replay(ps_graph(replace(model, compute_scale=factor), PSWhatIf())).iteration_time_us

    scale = 1.0
    for _ in range(rounds):
        exposed = replayed(scale) - scale * compute
        scale = max(COMPUTE_SCALE_FLOOR, (target_us - exposed) / max(compute, 1e-9))
    if abs(replayed(scale) - target_us) <= 0.005 * target_us or replayed(COMPUTE_SCALE_FLOOR) >= target_us:
        return scale
    # not settled (the compute partly hidden behind the transfers moves the iteration less than its own length):
    # bisection on a log scale between the floor and a factor that replays longer than the target
    low, high = COMPUTE_SCALE_FLOOR, max(2.0 * scale, 1.0)
    while replayed(high) < target_us and high < 1e3:
        low, high = high, 2.0 * high
    for _ in range(24):
        middle = (low * high) ** 0.5
        low, high = (middle, high) if replayed(middle) < target_us else (low, middle)
    return min((low, high), key=lambda factor: abs(replayed(factor) - target_us))


COMPUTE_SCALE_FLOOR = 0.05
# unprofiled / profiled compute of this backend's workers where the compute fit settles (0.5-0.88 in the runs of
# benchmarks/mxnet_replay_accuracy.py): mx.profiler's usual inflation, the prior when the fit cannot settle
USUAL_COMPUTE_SCALE = 0.8


def _refit_links_to_reference(model: PSModel) -> None:
    """The communication alone, at the level the profiled iterations gave it, replays longer than the run's own
    iterations without the profiler (the profiled iterations' transfers ran slower than the clean ones': a noisy
    host): the compute cannot be scaled to fit. The compute takes the profiler's usual inflation and the link level
    is refitted to the reference instead; said in the notes (the split between the two is then less certain)."""
    target = model.measured_iteration_us
    before = model.link_level
    model.compute_scale = USUAL_COMPUTE_SCALE
    model.link_level = fit_link_level(model, target, USUAL_COMPUTE_SCALE)
    _close_a_step_of_the_link_fit(model, target)
    model.notes.append(
        f"the transfers of the profiled iterations (link level x{before:.2f} of the calibration) replay longer than "
        f"the run's own {model.reference} iterations ({target / 1000:.2f} ms) even with no compute: the link level "
        f"was refitted to them (x{model.link_level:.2f}) with the profiled compute scaled x{model.compute_scale:.2f} "
        f"(x{USUAL_COMPUTE_SCALE}, the profiler's usual inflation here, where that fits); how the iteration splits "
        "between compute and communication is less certain than usual")


def _close_a_step_of_the_link_fit(model: PSModel, target_us: float) -> None:
    """The replay is a discrete schedule: where a transfer's order flips, it jumps (4 % on the suite's MLP) and no
    link level replays to the target. The compute, at the fitted level or 3 % either side of it, closes what is left
    (kept when it is closer and stays a real share of the profile: at the floor the compute fit reads "no compute").
    """
    fitted_us = replay(ps_graph(model, PSWhatIf())).iteration_time_us
    if abs(fitted_us - target_us) <= 0.01 * target_us:
        return
    best = (abs(fitted_us - target_us), model.link_level, model.compute_scale)
    for level in (model.link_level * 0.97, model.link_level, model.link_level * 1.03):  # either side of the step
        at_level = replace(model, link_level=level)
        scale = fit_compute_scale(at_level, target_us)
        error = abs(replay(ps_graph(replace(at_level, compute_scale=scale), PSWhatIf())).iteration_time_us - target_us)
        if scale > COMPUTE_SCALE_FLOOR * 1.5 and error < best[0]:
            best = (error, level, scale)
    _, model.link_level, model.compute_scale = best
