"""The CPU time each role of a parameter-server job takes an iteration, across two emulated hosts, at one link rate:
what a what-if of the network alone leaves on each host (replay/ps_cpu.py's floor rests on it).

Each role (servers, workers) of the plain job (as benchmarks/mxnet_multihost.py launches it, no dprorun) runs under
/usr/bin/time; a launch of --steps iterations and one of --steps + 100, differenced, give the CPU time per iteration
without the start-up and exit. Rounds interleave the server counts; medians per host and role.

usage: sudo python benchmarks/mxnet_role_cpu.py [--servers 1,2] [--reps 2] [--rate 1gbit] [--cpus 0.9] [--model mlp]
       [--script-args '--width 600']
Last line: per server count, the busiest host's CPU ms an iteration and the iteration.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mxnet_multihost import plain_shell  # noqa: E402  (the same plain job)

EXTRA_STEPS = 100


def launch(cluster, model: str, script_args: str, servers_per_host: int,
           steps: int) -> tuple[float, dict[tuple[int, str], float]]:
    """(worker 0's median iteration ms, {(host, role): CPU seconds, the host's roles of that kind together})."""
    shell = plain_shell(model, script_args, steps, servers_per_host, timed="/usr/bin/time -f 'CPU %U %S ROLE'")
    results = cluster.run(["bash", "-c", shell], 600, dict(os.environ, OMP_NUM_THREADS="1"))
    cpu: dict[tuple[int, str], float] = {}
    iteration = None
    for host, result in enumerate(results):
        for user, system, role in re.findall(r"CPU ([0-9.]+) ([0-9.]+) (\w+)", result.stderr):
            cpu[(host, role)] = cpu.get((host, role), 0.0) + float(user) + float(system)
        found = re.search(r"median iteration ([0-9.]+) ms", result.stdout)
        if found:
            iteration = float(found.group(1))
    if iteration is None:
        raise SystemExit("plain launch failed: " + " | ".join(r.stderr[-800:] for r in results))
    return iteration, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="1,2", help="servers per host, each count a row")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--cpus", type=float, default=0.9)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--script-args", default="", help="more arguments for examples/mxnet_gluon.py")
    args = parser.parse_args()
    from emulated_cluster import EmulatedCluster

    counts = [int(c) for c in args.servers.split(",")]
    per_iteration: dict[int, dict[tuple[int, str], list[float]]] = {c: {} for c in counts}
    iterations: dict[int, list[float]] = {c: [] for c in counts}
    with EmulatedCluster(2, args.cpus, rate=args.rate) as cluster:
        for rep in range(args.reps):
            for count in counts[rep % len(counts):] + counts[:rep % len(counts)]:
                short_ms, short = launch(cluster, args.model, args.script_args, count, args.steps)
                long_ms, long = launch(cluster, args.model, args.script_args, count, args.steps + EXTRA_STEPS)
                iterations[count] += [short_ms, long_ms]
                for key in long:
                    per_iteration[count].setdefault(key, []).append(
                        1000.0 * (long[key] - short.get(key, 0.0)) / EXTRA_STEPS)
    print(f"{'servers/host':>12} {'host':>5} {'role':>7} {'CPU ms an iteration (rounds)':>30} {'median':>7}")
    last = []
    for count in counts:
        hosts: dict[int, float] = {}
        for (host, role), values in sorted(per_iteration[count].items()):
            median = statistics.median(values)
            hosts[host] = hosts.get(host, 0.0) + median
            print(f"{count:12d} {host:5d} {role:>7} {' / '.join(f'{v:.1f}' for v in values):>30} {median:7.1f}")
        busiest = max(hosts, key=hosts.get)
        iteration = statistics.median(iterations[count])
        print(f"{count:12d} host {busiest} (busiest): {hosts[busiest]:.1f} ms of CPU an iteration over "
              f"{args.cpus:g} cores: at least {hosts[busiest] / args.cpus:.1f} ms; iteration {iteration:.1f} ms")
        last.append(f"{count} a host: {hosts[busiest]:.1f} ms CPU, iteration {iteration:.1f} ms")
    print(f"{args.model} at {args.rate}, busiest host: " + "; ".join(last))


if __name__ == "__main__":
    main()
