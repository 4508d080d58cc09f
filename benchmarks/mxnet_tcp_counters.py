"""The network side of a plain MXNet PS job across two emulated hosts: each host's TCP counters (`nstat`: segments
sent, retransmitted, fast retransmits, timeouts) and its link's tbf statistics (drops, overlimits) read before and
after each launch, at each count of servers per host, counts interleaved. Asks whether more server processes a host
lose packets (they did not: RESULTS.md, session 22).

usage: sudo python benchmarks/mxnet_tcp_counters.py [--counts 1,2] [--reps 2] [--rate 1gbit] [--cpus 0.9]
Needs root (namespaces, tc, cgroups) and the MXNet environment (scripts/install-mxnet).
Last line: per count, the median iteration and the retransmitted share of the segments sent.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
sys.path.insert(0, HERE)
from mxnet_multihost import plain_shell  # noqa: E402

TCP_COUNTERS = ("TcpOutSegs", "TcpRetransSegs", "TcpExtTCPFastRetrans", "TcpExtTCPTimeouts")


def host_counters(cluster, k: int) -> dict[str, int]:
    """Host k's TCP counters (its namespace's, since it was made) and its link's tbf drops and overlimits."""
    ns = cluster.host_ns(k)
    text = subprocess.run(["ip", "netns", "exec", ns, "nstat", "-az"], capture_output=True, text=True).stdout
    out = {}
    for name in TCP_COUNTERS:
        found = re.search(rf"^{name}\s+(\d+)", text, re.M)
        out[name] = int(found.group(1)) if found else 0
    text = subprocess.run(["tc", "-n", ns, "-s", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout
    found = re.search(r"dropped (\d+), overlimits (\d+)", text)
    out["tbf dropped"], out["tbf overlimits"] = (int(found.group(1)), int(found.group(2))) if found else (0, 0)
    return out


def launch(cluster, per_host: int, steps: int) -> tuple[float, list[dict[str, int]]]:
    """The plain job once: worker 0's median iteration (ms) and each host's counters' change over the launch."""
    before = [host_counters(cluster, k) for k in range(cluster.hosts)]
    results = cluster.run(["bash", "-c", plain_shell("mlp", "", steps, per_host)], 600,
                          dict(os.environ, OMP_NUM_THREADS="1"))
    after = [host_counters(cluster, k) for k in range(cluster.hosts)]
    found = [re.search(r"median iteration ([0-9.]+) ms", r.stdout) for r in results]
    times = [float(f.group(1)) for f in found if f]
    if not times:
        raise SystemExit("plain launch failed: " + " | ".join(r.stderr[-800:] for r in results))
    return times[0], [{key: a[key] - b[key] for key in a} for a, b in zip(after, before)]


def main() -> None:
    from emulated_cluster import EmulatedCluster

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="1,2", help="servers per host, interleaved")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--cpus", type=float, default=0.9)
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    rows: dict[int, list[tuple[float, list[dict[str, int]]]]] = {c: [] for c in counts}
    with EmulatedCluster(2, args.cpus, rate=args.rate) as cluster:
        for rep in range(args.reps):
            for count in counts[rep % len(counts):] + counts[:rep % len(counts)]:
                rows[count].append(launch(cluster, count, args.steps))
    keys = (*TCP_COUNTERS, "tbf dropped", "tbf overlimits")
    print(f"{'per host':>8} {'round':>5} {'ms':>7} {'host':>4} " + " ".join(f"{k:>20}" for k in keys))
    for count in counts:
        for rep, (ms, hosts) in enumerate(rows[count]):
            for k, delta in enumerate(hosts):
                print(f"{count:8d} {rep:5d} {ms:7.2f} {k:4d} " + " ".join(f"{delta[key]:20d}" for key in keys))
    summary = []
    for count in counts:
        sent = sum(h["TcpOutSegs"] for _, hosts in rows[count] for h in hosts)
        lost = sum(h["TcpRetransSegs"] for _, hosts in rows[count] for h in hosts)
        summary.append(f"{count} a host {statistics.median(ms for ms, _ in rows[count]):.2f} ms, "
                       f"{lost} of {sent} segments retransmitted ({100 * lost / max(sent, 1):.3f} %)")
    print(f"TCP across two hosts ({args.rate}): " + "; ".join(summary))


if __name__ == "__main__":
    main()
