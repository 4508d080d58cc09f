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
Needs root (namespaces, tc, cgroups) and the MXNet environment (scripts/install-mxnet).

usage: sudo python benchmarks/mxnet_multihost.py [--model mlp] [--servers 1] [--reps 3] [--steps 40]
       [--compare-with CHECKOUT]
Last line: the as-run error of the medians.
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
EXAMPLE = os.path.join(REPO, "examples", "mxnet_gluon.py")
PORT = 29710


def mxnet_python() -> str:
    from dprorun.config import JobConfig
    from dprorun.launch_ps import mxnet_python as find

    return find(JobConfig(command=["python"]))


def plain_ms(cluster, args, servers_per_host: int) -> float:
    python = mxnet_python()
    script = f"{python} -u {EXAMPLE} --steps {args.steps} --model {args.model}"
    env = (f"DMLC_PS_ROOT_URI={{master_addr}} DMLC_PS_ROOT_PORT={PORT} DMLC_NUM_SERVER={2 * servers_per_host} "
           f"DMLC_NUM_WORKER=2 DMLC_NODE_HOST={{addr}} DMLC_INTERFACE=eth0")
    roles = " ".join(f"DMLC_ROLE=server {script} & " for _ in range(servers_per_host))
    shell = (f"export {env}; if [ {{node_rank}} = 0 ]; then DMLC_ROLE=scheduler {script} & fi; {roles}"
             f"DMLC_ROLE=worker {script}; wait")
    results = cluster.run(["bash", "-c", shell], 600, dict(os.environ, OMP_NUM_THREADS="1"))
    for result in results:
        found = re.search(r"median iteration ([0-9.]+) ms", result.stdout)
        if found:
            return float(found.group(1))
    raise SystemExit("plain launch failed: " + " | ".join(r.stderr[-800:] for r in results))


def profiled(cluster, args, tmp: str) -> dict[str, float]:
    run = os.path.join(tmp, "node{node_rank}")
    results = cluster.run([sys.executable, "-m", "dprorun.cli", "--backend", "mxnet", "--hosts",
                           f"{cluster.hostname(0)}:1,{cluster.hostname(1)}:1", "--servers", str(args.servers), "-q",
                           "--overwrite", "--warmup", "10", "--active", "15", "--clean", str(args.steps - 30),
                           "--run-dir", run, "python", EXAMPLE, "--steps", str(args.steps), "--model", args.model],
                          600, dict(os.environ, OMP_NUM_THREADS="1"))
    if any(r.returncode for r in results):
        raise SystemExit("dprorun failed: " + " | ".join(r.stderr[-1500:] for r in results))
    node0 = os.path.join(tmp, "node0")
    out = {}
    fewer = ["--servers", str(2 * (args.servers - 1))]
    for label, extra in (("as run", []), ("fewer servers", fewer)):
        for code, checkout in (("", REPO), (", other checkout", args.compare_with)):
            if (label == "fewer servers" and args.servers < 2) or not checkout:
                continue
            doc = json.loads(subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", node0, "--json",
                                             *extra], capture_output=True, text=True, check=True, cwd=checkout,
                                            env=dict(os.environ, PYTHONPATH=checkout)).stdout)
            out[label + code] = doc["predicted_iteration_ms"]
            out["clean"] = doc["clean_ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--servers", type=int, default=1, help="servers per host")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--compare-with", default=None, metavar="CHECKOUT",
                        help="also replay each profile with the dprorun code of this checkout (a before/after on the "
                             "same runs, e.g. a git worktree of an earlier commit)")
    args = parser.parse_args()
    from emulated_cluster import EmulatedCluster

    plain, fewer, replays, whatifs, cleans = [], [], [], [], []
    shared, shared_whatifs = [], []  # the same profiles replayed by --compare-with's code
    with EmulatedCluster(2, 0.9) as cluster, tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.reps):  # interleaved
            plain.append(plain_ms(cluster, args, args.servers))
            if args.servers > 1:
                fewer.append(plain_ms(cluster, args, args.servers - 1))
            doc = profiled(cluster, args, tmp)
            replays.append(doc["as run"])
            if args.compare_with:
                shared.append(doc["as run, other checkout"])
            cleans.append(doc["clean"])
            if "fewer servers" in doc:
                whatifs.append(doc["fewer servers"])
                if args.compare_with:
                    shared_whatifs.append(doc["fewer servers, other checkout"])
    print(f"{'kind':28} {'plain ms (rounds)':>30} {'median':>8} {'replay ms (rounds)':>30} {'median':>8} "
          f"{'error %':>8}")
    rows = [("as run", plain, replays)] + ([("as run, other checkout", plain, shared)] if shared else [])
    rows += [("servers -1 per host", fewer, whatifs)] if fewer else []
    rows += [("servers -1, other checkout", fewer, shared_whatifs)] if shared_whatifs else []
    for kind, truth, pred in rows:
        t, p = statistics.median(truth), statistics.median(pred)
        print(f"{kind:28} {' / '.join(f'{x:.1f}' for x in truth):>30} {t:8.2f} "
              f"{' / '.join(f'{x:.1f}' for x in pred):>30} {p:8.2f} {100 * (p / t - 1):+8.1f}")
    print(f"clean iterations of the profiled runs: {' / '.join(f'{x:.1f}' for x in cleans)} ms")
    t, p = statistics.median(plain), statistics.median(replays)
    print(f"as run across two hosts: replay {p:.2f} ms vs plain {t:.2f} ms ({100 * (p / t - 1):+.1f} %)")


if __name__ == "__main__":
    main()
