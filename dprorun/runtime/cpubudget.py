"""How much CPU a rank has and how much of it its computation uses: the cores this process may run on (its
affinity, capped by a cgroup CPU quota), the ranks of the job on this host, and torch's intra-op threads.

The replay gives communication its own devices. That holds for a network or a GPU transport; on a CPU job whose
ranks keep every core busy computing, gloo's threads (copies, reductions, socket handling) take their CPU from
the backward instead. `cpu_budget()` records what is needed to tell the two apart; calibration adds how much
CPU the transport itself burns per all-reduce.
"""
from __future__ import annotations

import os
import time
from typing import Optional


def _cpu_cgroup_dir(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[tuple[str, str]]:
    """(the folder of this process's CPU cgroup, "v1" or "v2"); None when none is readable."""
    try:
        with open(proc_cgroup) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        path = path.lstrip("/")
        if controllers == "":  # v2 unified hierarchy
            for base in (root, os.path.join(root, "unified")):
                if os.path.isfile(os.path.join(base, path, "cpu.max")):
                    return os.path.join(base, path), "v2"
        elif "cpu" in controllers.split(","):
            base = os.path.join(root, controllers)
            if not os.path.isdir(base):
                base = os.path.join(root, "cpu")
            if os.path.isfile(os.path.join(base, path, "cpu.cfs_quota_us")):
                return os.path.join(base, path), "v1"
    return None


def cgroup_quota_cores(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[float]:
    """The CPU quota of this process's cgroup in cores (cgroup v2 cpu.max or v1 cfs_quota/period); None when
    unlimited or unreadable."""
    found = _cpu_cgroup_dir(proc_cgroup, root)
    return None if found is None else _quota_in(*found)


def _quota_in(folder: str, kind: str) -> Optional[float]:
    """The quota in cores of the cgroup at `folder` ("v1" or "v2"); None when unlimited or unreadable."""
    try:
        if kind == "v2":
            with open(os.path.join(folder, "cpu.max")) as handle:
                quota, period = handle.read().split()[:2]
            return float(quota) / float(period) if quota != "max" and float(period) > 0 else None
        with open(os.path.join(folder, "cpu.cfs_quota_us")) as handle:
            quota_us = float(handle.read().strip())
        with open(os.path.join(folder, "cpu.cfs_period_us")) as handle:
            period_us = float(handle.read().strip())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def cgroup_cpu_stat(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[dict]:
    """This process's CPU cgroup's counters (the host's, in a container or an emulated host): {"nr_periods",
    "nr_throttled", "throttled_us"} (and "usage_us" under v2); None where there is no quota to throttle by."""
    found = _cpu_cgroup_dir(proc_cgroup, root)
    if found is None or _quota_in(*found) is None:
        return None
    folder, kind = found
    try:
        with open(os.path.join(folder, "cpu.stat")) as handle:
            raw = dict(line.split()[:2] for line in handle if len(line.split()) >= 2)
        out = {"nr_periods": int(raw["nr_periods"]), "nr_throttled": int(raw["nr_throttled"])}
        if kind == "v2":
            out["throttled_us"] = int(raw.get("throttled_usec", 0))
            out["usage_us"] = int(raw.get("usage_usec", 0))
        else:
            out["throttled_us"] = int(raw.get("throttled_time", 0)) // 1000
    except (OSError, KeyError, ValueError):
        return None
    return out


def process_cpu_s() -> float:
    """The CPU seconds this process has used, every thread, user and system, to the nanosecond
    (CLOCK_PROCESS_CPUTIME_ID: the scheduler's own sum; os.times() counts clock ticks, 10 ms each, as much as a
    PS role's whole CPU time an iteration)."""
    return time.process_time()


def cpu_budget(compute_threads: Optional[int] = None) -> dict:
    """{"cores": CPUs this process may use, "local_ranks": ranks of the job on this host, "cores_per_rank",
    "compute_threads": torch's intra-op threads (or `compute_threads`: a TensorFlow worker's),
    "spare_cores": cores_per_rank - compute_threads}."""
    try:
        cores = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cores = float(os.cpu_count() or 1)
    quota = cgroup_quota_cores()
    if quota is not None:
        cores = min(cores, quota)
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
                             or os.environ.get("HOROVOD_LOCAL_SIZE") or 1))
    threads = compute_threads
    if threads is None:
        try:
            import torch

            threads = int(torch.get_num_threads())
        except Exception:  # torch absent (a Horovod job without it): assume one computing thread
            threads = 1
    per_rank = cores / local_ranks
    return {"cores": round(cores, 3), "cgroup_quota_cores": quota, "local_ranks": local_ranks,
            "cores_per_rank": round(per_rank, 3), "compute_threads": threads,
            "spare_cores": round(per_rank - threads, 3)}


def oversubscription_warning(budget: dict) -> str:
    """A warning when torch computes with clearly more threads than the rank has cores (a container's CPU
    quota that torch does not read, or several ranks per host without OMP_NUM_THREADS): the threads then wait
    for each other and the profile measures that. Empty when it does not apply."""
    try:
        threads, per_rank = int(budget["compute_threads"]), float(budget["cores_per_rank"])
    except (KeyError, TypeError, ValueError):
        return ""
    if threads <= max(1.0, per_rank) * 1.5:
        return ""
    where = f"cgroup quota {budget['cgroup_quota_cores']:g} cores" if budget.get("cgroup_quota_cores") else \
        f"{budget.get('cores', '?'):g} cores"
    return (f"torch computes with {threads} threads on {per_rank:g} core(s) per rank ({where}, "
            f"{budget.get('local_ranks', 1)} rank(s) on this host): set OMP_NUM_THREADS or torch.set_num_threads "
            f"to about {max(1, int(per_rank))}")
