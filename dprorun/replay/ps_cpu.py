"""How busy each host's CPU was while a parameter-server job ran its window: the evidence behind (or against) the
replay's what-ifs that change how many processes share a host.

The replay gives every role's work the time it took as profiled. On a host whose cores (or whose CPU quota: a
container, a cgroup) were all busy, that time includes waiting for the CPU the other roles used; a what-if with
fewer or more processes there changes that wait, which nothing in the graph prices. The hooks record each worker's
CPU seconds at every iteration start (events.json `iteration_cpu_s`), each server's at its updates (server.json
`cpu_marks`, written again at exit), and the host's quota counters at the window's phase changes (`host_cpu_stat`:
periods, throttled periods). `read_host_cpu` turns them into each host's busy cores over the clean iterations (else
the window's iterations run without the profiler); `cpu_note` says what that means for a what-if that adds or
removes processes; `cpu_floor` is the shortest iteration those hosts' CPU allows with the roles' work as measured
(their CPU time an iteration over their cores), the bound on a what-if that speeds up the network and leaves every
role's work where it was.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

BUSY_SHARE_WARN = 0.85  # a host this busy (of its cores or quota) is CPU-bound for the what-ifs' purposes
THROTTLED_SHARE_WARN = 0.05  # or one whose quota held its processes back in this share of its periods


@dataclass
class HostCPU:
    host: str
    cores: float  # what the roles may use: the CPU quota where one is set, else the cores of their affinity
    quota: bool  # cores is a cgroup quota
    workers: int
    servers: int
    worker_cores: float  # CPU seconds per second, the host's workers together, over the span
    server_cores: Optional[float]  # the same for its servers (None: a server recorded no CPU marks over the span)
    throttled_share: Optional[float]  # quota periods in which the host was held back, of those in the span
    throttled_ms: Optional[float]  # the time its processes were held back by the quota, per iteration (cgroup's sum)
    span_ms: float  # the span measured: the clean iterations, else the window's without the profiler (a worker here)
    iterations: int = 0  # iterations in the span
    span: str = "window"  # which: "clean" (the iterations after the window) or "window" (its unprofiled ones)

    @property
    def cpu_ms_per_iteration(self) -> Optional[float]:
        """The CPU time the host's roles took an iteration (workers and servers together); None where a server's
        is unknown or no iteration was timed."""
        if self.server_cores is None or not self.iterations:
            return None
        return self.busy_cores * self.span_ms / self.iterations

    @property
    def busy_cores(self) -> float:
        return self.worker_cores + (self.server_cores or 0.0)

    @property
    def busy_share(self) -> float:
        return self.busy_cores / self.cores if self.cores else 0.0

    def describe(self) -> str:
        parts = [f"workers {self.worker_cores:.2f}"]
        parts.append("servers unknown" if self.server_cores is None else f"servers {self.server_cores:.2f}")
        text = (f"{self.host}: {self.busy_cores:.2f} of {self.cores:g} cores busy ({100 * self.busy_share:.0f} %; "
                f"{', '.join(parts)}{'; a CPU quota' if self.quota else ''}")
        if self.throttled_share is not None:
            text += f"; throttled in {100 * self.throttled_share:.0f} % of its quota periods"
        if self.throttled_ms:
            text += f", held back {self.throttled_ms:.1f} ms an iteration"
        span = "the clean iterations" if self.span == "clean" else "the window's iterations without the profiler"
        return text + f"; over {span})"

    def to_json(self) -> dict:
        return {"host": self.host, "cores": self.cores, "quota": self.quota, "workers": self.workers,
                "servers": self.servers, "span": self.span, "worker_cores": round(self.worker_cores, 3),
                "server_cores": None if self.server_cores is None else round(self.server_cores, 3),
                "busy_share": round(self.busy_share, 3),
                "throttled_share": None if self.throttled_share is None else round(self.throttled_share, 3),
                "throttled_ms": None if self.throttled_ms is None else round(self.throttled_ms, 3)}


@dataclass
class _Span:
    """One worker's iterations measured for its host: its starts (its own clock) and CPU seconds, the indices of the
    first and last start used, and the iteration number of index 0 (for the host's quota counters)."""

    starts: list[float]
    cpu: list[float]
    first: int
    last: int
    offset: int
    clean: bool


def _span(events: dict, clean: Optional[dict]) -> Optional[_Span]:
    """The worker's clean iterations (clean.json: no profiler, the iterations the predictions are scaled to) when it
    recorded their CPU, else the window's iterations without the profiler; None where fewer than 2 were timed. Both
    end before a cut (`window.cut_at`: the job trained something else from there, set up in the iteration before)."""
    window = events.get("window") or {}
    cut = None if window.get("cut_at") is None else int(window["cut_at"]) - 1  # the start of the set-up iteration
    starts, cpu = (clean or {}).get("iteration_starts_us") or [], (clean or {}).get("iteration_cpu_s") or []
    offset = int((clean or {}).get("first_iteration", 0))
    last = len(starts) - 1 if cut is None else min(len(starts) - 1, cut - offset)
    if len(cpu) == len(starts) and last >= 3:  # the first holds the end-of-window work: from the second on
        return _Span(starts, cpu, 1, last, offset, True)
    profiled = window.get("kineto_iterations") or []
    first = (max(profiled) + 2) if profiled else int(window.get("warmup", 0)) + 1  # +1: the profiler's stop
    last = int(window.get("warmup", 0)) + int(window.get("active", 0))  # read before the end-of-window work
    last = last if cut is None else min(last, cut)
    cpu = events.get("iteration_cpu_s") or []
    if last - first < 2 or last >= len(cpu):
        return None
    return _Span(events["iteration_starts_us"], cpu, first, last, 0, False)


def _cpu_at(marks: list[list[float]], t_us: float) -> Optional[float]:
    """A server's CPU seconds at time t (linear between its marks); None outside them."""
    for (t0, c0), (t1, c1) in zip(marks, marks[1:]):
        if t0 <= t_us <= t1:
            return c0 if t1 == t0 else c0 + (c1 - c0) * (t_us - t0) / (t1 - t0)
    return None


def _throttled(stats: list[list], first: int, last: int) -> tuple[Optional[float], Optional[float]]:
    """(throttled periods of all periods, throttled ms per iteration) between the counters read at the phase changes
    from iteration first - 1 (the profiler's stop) to last; (None, None) without a quota."""
    inside = [s for s in stats if first - 1 <= int(s[0]) <= last]
    if len(inside) < 2 or int(inside[-1][0]) <= int(inside[0][0]):
        return None, None
    (i0, _, a), (i1, _, b) = inside[0], inside[-1]
    periods = int(b.get("nr_periods", 0)) - int(a.get("nr_periods", 0))
    if periods <= 0:
        return None, None
    held_ms = (int(b.get("throttled_us", 0)) - int(a.get("throttled_us", 0))) / 1000.0 / (int(i1) - int(i0))
    return (int(b.get("nr_throttled", 0)) - int(a.get("nr_throttled", 0))) / periods, held_ms


def _servers_cores(server_docs: dict[int, dict], servers: list[int], t0: float, t1: float) -> Optional[float]:
    """The CPU seconds per second of these servers from t0 to t1 (µs, their host's clock); None where a server's
    marks do not cover the span."""
    cores = 0.0
    for s in servers:
        marks = [[float(t), float(c)] for t, c in server_docs[s].get("cpu_marks") or []]
        c0, c1 = _cpu_at(marks, t0), _cpu_at(marks, t1)
        if c0 is None or c1 is None:
            return None
        cores += (c1 - c0) / ((t1 - t0) / 1e6)
    return cores


def _host_span(workers: dict[int, dict], cleans: dict[int, dict], ranks: list[int], server_docs: dict[int, dict],
               servers: list[int]) -> Optional[tuple[dict[int, _Span], Optional[float]]]:
    """The host's timed workers' spans and its servers' cores over the first one's span: the
    clean iterations where every timed worker and every server (its CPU marks, written at exit) covers them, else the
    window's unprofiled ones; None where no worker of the host was timed."""
    for use_clean in (True, False):
        spans = {r: _span(workers[r], cleans.get(r) if use_clean else None) for r in ranks}
        spans = {r: span for r, span in spans.items() if span is not None}
        if not spans or (use_clean and not all(span.clean for span in spans.values())):
            continue
        span = spans[min(spans)]
        skew = float((workers[min(spans)].get("clock") or {}).get("test_skew_us") or 0.0)  # the servers' have none
        t0, t1 = span.starts[span.first] - skew, span.starts[span.last] - skew
        server_cores = _servers_cores(server_docs, servers, t0, t1)
        if use_clean and server_cores is None:
            continue
        return spans, server_cores
    return None


def read_host_cpu(workers: dict[int, dict], cleans: dict[int, dict], server_docs: dict[int, dict], hosts: list[str],
                  worker_hosts: list[int], server_hosts: list[int]) -> list[HostCPU]:
    """Each host's busy cores over its first timed worker's clean iterations (else its window's unprofiled ones); []
    for a run recorded by a dprorun before these records (or a host with no worker: nothing to time its servers
    against)."""
    names = hosts or [str(workers[min(workers)].get("host", "") or "this host")]
    out = []
    for h, name in enumerate(names):
        ranks = [r for k, r in enumerate(sorted(workers)) if (worker_hosts[k] if k < len(worker_hosts) else 0) == h]
        mine = [s for s in server_docs if (server_hosts[s] if s < len(server_hosts) else 0) == h]
        found = _host_span(workers, cleans, ranks, server_docs, mine)
        if found is None:
            continue
        spans, server_cores = found
        tracker = next((t for t in workers[min(spans)].get("trackers", []) if t.get("framework") == "mxnet"), {})
        quota = tracker.get("cgroup_quota_cores")
        cores = float(quota) if quota else float(tracker.get("cores") or 1)
        worker_cores = sum((sp.cpu[sp.last] - sp.cpu[sp.first]) / ((sp.starts[sp.last] - sp.starts[sp.first]) / 1e6)
                           for sp in spans.values()) * len(ranks) / len(spans)
        span = spans[min(spans)]
        stats = (cleans.get(min(spans)) if span.clean else workers[min(spans)]) or {}
        throttled = _throttled(stats.get("host_cpu_stat") or [], span.offset + span.first, span.offset + span.last)
        out.append(HostCPU(name, cores, bool(quota), len(ranks), len(mine), worker_cores, server_cores,
                           *throttled, (span.starts[span.last] - span.starts[span.first]) / 1000.0,
                           span.last - span.first, "clean" if span.clean else "window"))
    return out


def busy_hosts(host_cpu: list[HostCPU]) -> list[HostCPU]:
    """The hosts whose CPU held the job back: busy near all its cores, or its quota throttling it often."""
    return [h for h in host_cpu if h.busy_share >= BUSY_SHARE_WARN or (h.throttled_share or 0) >= THROTTLED_SHARE_WARN]


@dataclass
class CPUFloor:
    """The shortest iteration the hosts' CPU allows with the roles' work as measured: on the host where it is
    longest, the CPU time its roles took an iteration over the cores (or quota) they had."""

    iteration_us: float
    host: HostCPU

    def describe(self) -> str:
        h = self.host
        cpu = h.cpu_ms_per_iteration or 0.0
        workers, servers = h.worker_cores / h.busy_cores * cpu, (h.server_cores or 0.0) / h.busy_cores * cpu
        return (f"{h.host}'s roles took {cpu:.1f} ms of CPU an iteration (workers {workers:.1f}, servers "
                f"{servers:.1f}) of its {h.cores:g} cores: at least {self.iteration_us / 1000:.2f} ms an iteration")


def cpu_floor(host_cpu: list[HostCPU]) -> Optional[CPUFloor]:
    """The hosts' CPU floor (CPUFloor), from each host's measured CPU time an iteration; None where no host has
    one (a run recorded before these records, a server without CPU marks)."""
    floors = [CPUFloor(h.cpu_ms_per_iteration * 1000.0 / h.cores, h) for h in host_cpu
              if h.cpu_ms_per_iteration and h.cores and h.busy_cores]
    return max(floors, key=lambda f: f.iteration_us, default=None)


def cpu_note(host_cpu: list[HostCPU], servers_change: int, workers_change: int) -> list[str]:
    """A warning where a what-if adds or removes processes (servers, workers) on hosts whose CPU was busy."""
    busy = busy_hosts(host_cpu)
    if not busy or not (servers_change or workers_change):
        return []
    what = " and ".join(f"{abs(n)} {name}{'s' if abs(n) > 1 else ''} {'more' if n > 0 else 'fewer'}"
                        for n, name in ((servers_change, "server"), (workers_change, "worker")) if n)
    return [f"warning: {what} change how the CPU of {', '.join(h.host for h in busy)} is shared "
            f"({'; '.join(h.describe() for h in busy)}): the replay prices each role's work at the time it took as "
            "run, the waits for that CPU included, not the CPU the processes added or removed would take or leave"]


# a busy host's servers whose CPU time an iteration is this many times their work in the replay (pushes handled,
# merges, updates, responses) spend the rest in their own threads: dense jobs here 1.3-1.5x, a row-sparse table
# 4x at 1 server and 10x at 2 (their OpenMP threads waiting in a spin after MXNet's sparse operators)
SPINNING_SERVERS_RATIO = 3.0
SPINNING_SERVERS_SHARE = 0.1  # and the excess at least this share of the host's CPU an iteration
SPINNING_HOST_BUSY = 0.7  # on a host this busy (spinning threads take what is free: 85 % and 82 % seen)


@dataclass
class SpinningServers:
    """A host whose servers took far more CPU than their work (SPINNING_SERVERS_RATIO)."""

    host: HostCPU
    cpu_ms: float  # the host's servers' CPU time an iteration
    work_ms: float  # their work in the replay, an iteration

    def describe(self) -> str:
        return (f"the servers on {self.host.host} took {self.cpu_ms:.1f} ms of CPU an iteration where their work in "
                f"the replay (pushes handled, merges, updates, responses) is {self.work_ms:.1f} ms")


def spinning_servers(host_cpu: list[HostCPU], server_work_ms: dict[int, float]) -> list[SpinningServers]:
    """The hosts (SPINNING_HOST_BUSY) whose servers' CPU time an iteration is SPINNING_SERVERS_RATIO times their
    replayed work or more, the excess SPINNING_SERVERS_SHARE of the host's CPU or more. `server_work_ms`: host index
    (in `host_cpu`'s order) -> its servers' busy time in the replay, per iteration."""
    found = []
    for index, host in enumerate(host_cpu):
        if host.busy_share < SPINNING_HOST_BUSY or not host.iterations or host.server_cores is None:
            continue
        cpu_ms = host.server_cores * host.span_ms / host.iterations
        work_ms = server_work_ms.get(index, 0.0)
        iteration_ms = host.span_ms / host.iterations
        if cpu_ms >= SPINNING_SERVERS_RATIO * work_ms and cpu_ms - work_ms >= SPINNING_SERVERS_SHARE * host.cores * \
                iteration_ms:
            found.append(SpinningServers(host, cpu_ms, work_ms))
    return found


def spinning_note(found: list[SpinningServers]) -> list[str]:
    """What spinning servers mean for the figures, and what to try."""
    if not found:
        return []
    return [f"warning: {'; '.join(f.describe() for f in found)}: the rest is their own threads' (OpenMP threads "
            "waiting in a spin after MXNet's parallel operators, a row-sparse key's especially) on the cores the "
            "workers compute on; every figure keeps that as measured (a what-if with fewer servers does not shed "
            "it). OMP_NUM_THREADS=1 in the servers' environment is what `dprorun --autotune` tries for it "
            f"({SPINNING_EVIDENCE})"]


# examples/mxnet_sparse_embedding.py launched plainly on this project's 2-core VM (RESULTS.md, session 49)
SPINNING_EVIDENCE = ("a row-sparse table on 2 servers and 2 workers sharing 2 cores: 24.6 ms an iteration, 9.2 ms "
                     "with it; 1 server 15.5 -> 8.3 ms; a dense MLP unchanged")
