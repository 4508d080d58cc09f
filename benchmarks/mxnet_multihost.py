"""Parameter-server replay across hosts: `dprorun --backend mxnet --hosts` on two emulated hosts (each a network
namespace with its own 1 Gbit/s link and CPU quota: scripts/emulated_cluster.py) against the same job launched
plainly across them, interleaved rounds, medians.

Per round:
  plain     on each host, MXNet's roles with their DMLC_* variables (the scheduler on host 0; per host
            --servers servers and one worker), no dprorun; worker 0 prints the median iteration of the second half;
            also with one server per host fewer where --servers > 1 (the servers what-if's truth)
  profile   `dprorun --backend mxnet --hosts emu0:1,emu1:1 --servers S`, then `dpro replay --json` on node 0's run
            directory as run (and with --servers for the what-if); with --compare-with CHECKOUT each also by that
            checkout's code (before/after on the same profiles)
  rates     with --rates R1,R2: the plain launch again with every link re-shaped to each rate, the truth of the
            profile's `--bandwidth-scale R/--rate` what-if
Needs root (namespaces, tc, cgroups) and the MXNet environment (scripts/install-mxnet).

usage: sudo python benchmarks/mxnet_multihost.py [--model mlp] [--script-args '--optimizer adam'] [--servers 1]
       [--reps 3] [--steps 40] [--cpus 0.9] [--rate 1gbit] [--rates 3gbit,10gbit] [--compare-with CHECKOUT] [--keep DIR]
       python benchmarks/mxnet_multihost.py --from DIR[,DIR] [--compare-with CHECKOUT] [--links hosts]
       [--host-cores N|auto]
       (the kept profiles replayed again, this checkout's replays with those options)
       sudo python benchmarks/mxnet_multihost.py --plain-sweep 1,2,3 [--reps 4] [--cpus ..] [--rate ..]
       (plain launches only, at each count of servers per host, the counts' order rotated per round: what the
       server count alone does to the job)
Last line: the as-run error of the medians (with --rates, the bandwidth what-ifs' errors after it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mxnet_replay_accuracy import add_kept_arguments  # noqa: E402  (the PS benchmarks' shared options)
EXAMPLE = os.path.join(REPO, "examples", "mxnet_gluon.py")
PORT = 29710


def mxnet_python() -> str:
    from dprorun.config import JobConfig
    from dprorun.launch_ps import mxnet_python as find

    return find(JobConfig(command=["python"]))


def plain_shell(model: str, script_args: str, steps: int, servers_per_host: int, timed: str = "") -> str:
    """The shell line every emulated host runs for the plain job: MXNet's roles with their DMLC_* variables (the
    scheduler on host 0, the servers and one worker on each); `timed` (with ROLE in it) put before each server's and
    worker's command (e.g. /usr/bin/time)."""
    script = f"{mxnet_python()} -u {EXAMPLE} --steps {steps} --model {model} {script_args}"
    env = (f"DMLC_PS_ROOT_URI={{master_addr}} DMLC_PS_ROOT_PORT={PORT} DMLC_NUM_SERVER={2 * servers_per_host} "
           f"DMLC_NUM_WORKER=2 DMLC_NODE_HOST={{addr}} DMLC_INTERFACE=eth0")
    server, worker = (f"{timed.replace('ROLE', role)} {script}".strip() for role in ("server", "worker"))
    roles = " ".join(f"DMLC_ROLE=server {server} & " for _ in range(servers_per_host))
    return (f"export {env}; if [ {{node_rank}} = 0 ]; then DMLC_ROLE=scheduler {script} & fi; {roles}"
            f"DMLC_ROLE=worker {worker}; wait")


def plain_ms(cluster, args, servers_per_host: int) -> float:
    return shell_median_ms(cluster, plain_shell(args.model, args.script_args, args.steps, servers_per_host))


def shell_median_ms(cluster, shell: str) -> float:
    """`shell` run on every emulated host (the servers' OpenMP at one thread); worker 0's printed median (ms)."""
    results = cluster.run(["bash", "-c", shell], 600, dict(os.environ, OMP_NUM_THREADS="1"))
    for result in results:
        found = re.search(r"median iteration ([0-9.]+) ms", result.stdout)
        if found:
            return float(found.group(1))
    raise SystemExit("plain launch failed: " + " | ".join(r.stderr[-800:] for r in results))


def profile(cluster, args, base: str) -> str:
    """The dprorun profile across both hosts into base/node<k>; returns node 0's run directory."""
    run = os.path.join(base, "node{node_rank}")
    results = cluster.run([sys.executable, "-m", "dprorun.cli", "--backend", "mxnet", "--hosts",
                           f"{cluster.hostname(0)}:1,{cluster.hostname(1)}:1", "--servers", str(args.servers), "-q",
                           "--overwrite", "--warmup", "10", "--active", "15", "--clean", str(args.steps - 30),
                           "--run-dir", run, "python", EXAMPLE, "--steps", str(args.steps), "--model", args.model,
                           *args.script_args.split()],
                          600, dict(os.environ, OMP_NUM_THREADS="1"))
    if any(r.returncode for r in results):
        raise SystemExit("dprorun failed: " + " | ".join(r.stderr[-1500:] for r in results))
    return os.path.join(base, "node0")


def replays(node0: str, servers: int, compare_with: str | None, options: tuple[str, ...] = (),
            scales: tuple[float, ...] = ()) -> dict[str, float]:
    """{"as run", "fewer servers" (one per host fewer), "bandwidth x<k>" (each of `scales`), "clean"} of node 0's run
    directory (ms); with `compare_with` (a checkout) also each by that checkout's code ("as run, other checkout",
    ...); `options` go to this checkout's `dpro replay` calls."""
    out = {}
    fewer = ["--servers", str(2 * (servers - 1))]
    whatifs = [("as run", []), ("fewer servers", fewer)]
    whatifs += [(f"bandwidth x{k:g}", ["--bandwidth-scale", f"{k:g}"]) for k in scales]
    for label, extra in whatifs:
        for code, checkout in (("", REPO), (", other checkout", compare_with)):
            if (label == "fewer servers" and servers < 2) or not checkout:
                continue
            doc = json.loads(subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", node0, "--json",
                                             *extra, *(options if checkout == REPO else ())],
                                            capture_output=True, text=True, check=True, cwd=checkout,
                                            env=dict(os.environ, PYTHONPATH=checkout)).stdout)
            out[label + code] = doc["predicted_iteration_ms"]
            out["clean"] = doc["clean_ms"]
    return out


def gbit(rate: str) -> float:
    """A tc rate (e.g. 3gbit, 500mbit) in Gbit/s."""
    found = re.fullmatch(r"([0-9.]+)([kmg]?)bit", rate.strip().lower())
    if not found:
        raise SystemExit(f"a rate such as 1gbit or 500mbit, not {rate!r}")
    return float(found.group(1)) * {"k": 1e-6, "m": 1e-3, "g": 1.0, "": 1e-9}[found.group(2)]


def rate_scales(base: str, rates: list[str]) -> tuple[float, ...]:
    return tuple(round(gbit(rate) / gbit(base), 6) for rate in rates)


def measure(args: argparse.Namespace, options: tuple[str, ...]) -> list[dict]:
    """Interleaved rounds on the emulated hosts: {plain, fewer (plain with one server per host fewer), run_dir,
    replays} each; kept in --keep DIR/rounds.json with the profiles' run directories."""
    from emulated_cluster import EmulatedCluster

    rounds = []
    keep = os.path.abspath(args.keep) if args.keep else None
    with EmulatedCluster(2, args.cpus, rate=args.rate, pin_cores=args.pin) as cluster, \
            tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            plain = plain_ms(cluster, args, args.servers)
            fewer = plain_ms(cluster, args, args.servers - 1) if args.servers > 1 else None
            node0 = profile(cluster, args, os.path.join(keep, f"round-{rep}") if keep else tmp)
            at_rates = {}
            for rate in args.rates:  # the same job launched plainly with other links: the bandwidth what-ifs' truth
                cluster.set_rate(rate)
                at_rates[rate] = plain_ms(cluster, args, args.servers)
            cluster.set_rate(args.rate)
            rounds.append({"plain": plain, "fewer": fewer, "run_dir": node0 if keep else None, "at_rates": at_rates,
                           "replays": replays(node0, args.servers, args.compare_with, options,
                                              rate_scales(args.rate, args.rates))})
            if keep:
                with open(os.path.join(keep, "rounds.json"), "w") as handle:
                    json.dump({"servers": args.servers, "model": args.model, "script_args": args.script_args,
                               "cpus": args.cpus, "pin": args.pin, "rate": args.rate,
                               "rates": args.rates, "rounds": rounds}, handle, indent=1)
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--script-args", default="", metavar="'ARGS'",
                        help="more arguments for examples/mxnet_gluon.py (e.g. '--width 600 --optimizer adam')")
    parser.add_argument("--servers", type=int, default=1, help="servers per host")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--cpus", type=float, default=0.9, help="each emulated host's CPU quota (cores)")
    parser.add_argument("--rate", default="1gbit", help="each emulated host's link (tc tbf rate)")
    parser.add_argument("--pin", action="store_true",
                        help="each host's processes on a core of their own (taskset), under the same quota")
    parser.add_argument("--rates", default="", metavar="RATE[,RATE...]",
                        help="per round, the job also launched plainly with every link at each of these rates: the "
                             "truth of the profile's `--bandwidth-scale` what-ifs (rate / --rate)")
    parser.add_argument("--plain-sweep", default=None, metavar="S[,S...]",
                        help="no profile: plain launches at each count of servers per host, interleaved")
    add_kept_arguments(parser)
    parser.add_argument("--links", default=None, choices=("shared", "hosts", "per-node"),
                        help="replay with `dpro replay --links` (this checkout's replays only)")
    args = parser.parse_args()
    args.rates = [rate for rate in args.rates.split(",") if rate]
    options = (("--links", args.links) if args.links else ()) + (("--host-cores", args.host_cores)
                                                                 if args.host_cores else ())
    if args.plain_sweep:
        return plain_sweep(args, [int(s) for s in args.plain_sweep.split(",")])
    if args.kept:
        rounds = []
        for kept_dir in args.kept.split(","):  # several --keep runs (of one --servers): their rounds together
            with open(os.path.join(kept_dir, "rounds.json")) as handle:
                kept = json.load(handle)
            args.servers, args.rate, args.rates = kept["servers"], kept.get("rate", "1gbit"), kept.get("rates", [])
            rounds += kept["rounds"]
        for r in rounds:
            r["replays"] = replays(r["run_dir"], args.servers, args.compare_with, options,
                                   rate_scales(args.rate, args.rates))
    else:
        rounds = measure(args, options)
    report(rounds, args)


def plain_sweep(args: argparse.Namespace, counts: list[int]) -> None:
    """Plain launches only: per round every count of servers per host, the order rotated from round to round; a
    table of the medians and each against the first count's."""
    from emulated_cluster import EmulatedCluster

    times: dict[int, list[float]] = {count: [] for count in counts}
    with EmulatedCluster(2, args.cpus, rate=args.rate, pin_cores=args.pin) as cluster:
        for rep in range(args.reps):
            for count in counts[rep % len(counts):] + counts[:rep % len(counts)]:
                times[count].append(plain_ms(cluster, args, count))
            print(f"round {rep}: " + ", ".join(f"{c} per host {times[c][-1]:.2f} ms" for c in counts), flush=True)
    base = statistics.median(times[counts[0]])
    print(f"{'servers per host':>16} {'plain ms (rounds)':>40} {'median':>8} {'vs ' + str(counts[0]):>8} "
          f"{'ms more':>8}")
    for count in counts:
        median = statistics.median(times[count])
        print(f"{count:16d} {' / '.join(f'{x:.1f}' for x in times[count]):>40} {median:8.2f} "
              f"{100 * (median / base - 1):+7.1f}% {median - base:+8.2f}")
    print(f"plain across two hosts ({args.model}, {args.cpus} cores{', pinned' if args.pin else ''}, {args.rate}), "
          "servers per host "
          + "/".join(map(str, counts)) + ": " + " / ".join(f"{statistics.median(times[c]):.2f}" for c in counts)
          + " ms")


def report(rounds: list[dict], args: argparse.Namespace) -> None:
    plain = [r["plain"] for r in rounds]
    fewer = [r["fewer"] for r in rounds if r["fewer"] is not None]
    column = {key: [r["replays"][key] for r in rounds if key in r["replays"]]
              for key in ("as run", "as run, other checkout", "fewer servers", "fewer servers, other checkout",
                          "clean")}
    replays_, cleans = column["as run"], column["clean"]
    print(f"{'kind':28} {'plain ms (rounds)':>30} {'median':>8} {'replay ms (rounds)':>30} {'median':>8} "
          f"{'error %':>8}")
    rows = [("as run", plain, replays_)] + ([("as run, other checkout", plain, column["as run, other checkout"])]
                                           if column["as run, other checkout"] else [])
    rows += [("servers -1 per host", fewer, column["fewer servers"])] if fewer else []
    rows += ([("servers -1, other checkout", fewer, column["fewer servers, other checkout"])]
             if column["fewer servers, other checkout"] else [])
    for rate, scale in zip(args.rates, rate_scales(args.rate, args.rates)):
        label = f"bandwidth x{scale:g}"
        for suffix in ("", ", other checkout"):
            pairs = [(r["at_rates"][rate], r["replays"][label + suffix]) for r in rounds
                     if rate in r.get("at_rates", {}) and label + suffix in r["replays"]]
            if pairs:
                rows.append((f"{label} ({rate}){suffix}", [t for t, _ in pairs], [p for _, p in pairs]))
    for kind, truth, pred in rows:
        t, p = statistics.median(truth), statistics.median(pred)
        print(f"{kind:28} {' / '.join(f'{x:.1f}' for x in truth):>30} {t:8.2f} "
              f"{' / '.join(f'{x:.1f}' for x in pred):>30} {p:8.2f} {100 * (p / t - 1):+8.1f}")
    print(f"clean iterations of the profiled runs: {' / '.join(f'{x:.1f}' for x in cleans)} ms")
    t, p = statistics.median(plain), statistics.median(replays_)
    print(f"as run across two hosts: replay {p:.2f} ms vs plain {t:.2f} ms ({100 * (p / t - 1):+.1f} %)")
    bandwidth = [(kind, 100 * (statistics.median(pred) / statistics.median(truth) - 1))
                 for kind, truth, pred in rows if kind.startswith("bandwidth x") and "other" not in kind]
    if bandwidth:
        print("bandwidth what-ifs across two hosts: " + ", ".join(f"{kind} {err:+.1f} %" for kind, err in bandwidth))


if __name__ == "__main__":
    main()
