"""World-size prediction: `dprorun --dry-run` on 2 hosts predicts 3 and 4 hosts; real runs measure them.

Runs on an emulated cluster (scripts/emulated_cluster.py): every host is a network namespace with its own CPU
quota (--cpus, default 0.45 of a core, so 4 hosts use 1.8 of this machine's 2 cores and no rank waits for a
core: compute contention is avoided, not modelled) and its own full-duplex --rate link to a switch. One rank per
host. Each round, interleaved: the dry run (`dprorun --dry-run --nnodes 2 -np 2 --local-np 1`: 2 ranks
profiled, 4 predicted, printed as `predicted iteration time`), `dpro replay RUN --np 3` on its run directory,
then plain torchrun jobs on 2, 3 and 4 hosts (each prints its median iteration time). Medians over --reps rounds.

--script-args passes extra arguments to every launch of the examples; --compare-with DIR also dry-runs each round
with the dprorun of another checkout (DIR: its hooks and its replay) and prints its predictions beside.

usage: sudo python benchmarks/dryrun_world_size.py [--examples mlp_many_layers,...] [--reps 3]
       [--script-args "..."] [--compare-with DIR] [--largest 3 --cpus 0.6]
"""
import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

from emulated_cluster import EmulatedCluster  # noqa: E402

PORT = 29620


def host_output(results) -> str:
    failed = [r for r in results if r.returncode != 0]
    if failed:
        raise RuntimeError(f"host {failed[0].node_rank} exited {failed[0].returncode}: {failed[0].stderr[-2000:]}")
    return results[0].stdout


def script_path(example: str) -> str:
    """An example's name, or a script's path from the repository root (ending in .py: benchmarks/shapes/x.py)."""
    return os.path.join(REPO, example) if example.endswith(".py") else os.path.join(REPO, "examples", f"{example}.py")


def measure(example: str, hosts: int, args, env: dict) -> float:
    with EmulatedCluster(hosts, args.cpus, args.rate) as cluster:
        out = host_output(cluster.run(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "{nnodes}", "--node-rank", "{node_rank}",
             "--master-addr", "{master_addr}", "--master-port", str(PORT), "--nproc-per-node", "1",
             script_path(example), "--steps", str(args.steps),
             *shlex.split(args.script_args)], 900, env))
    return float(re.search(r"median iteration time: ([0-9.]+) ms", out).group(1))


def dry_run(example: str, args, env: dict, run_dir: str) -> tuple[float, float, float]:
    """(measured 2-rank iteration time of the profiled run, predicted for 4, predicted for 3)."""
    with EmulatedCluster(2, args.cpus, args.rate) as cluster:
        out = host_output(cluster.run(
            [sys.executable, "-m", "dprorun.cli", "--dry-run", "--nnodes", "{nnodes}", "--node-rank", "{node_rank}",
             "--master-addr", "{master_addr}", "--master-port", str(PORT + 1), "-np", "2", "--local-np", "1",
             "--run-dir", os.path.join(run_dir, "node{node_rank}"), "python",
             script_path(example), "--steps", "40", *shlex.split(args.script_args)],
            900, env))
    four = float(re.search(r"predicted iteration time: ([0-9.]+) ms", out).group(1))
    profiled = float(re.search(r"measured iteration time ([0-9.]+) ms", out).group(1))
    res = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", os.path.join(run_dir, "node0"),
                          "--np", "3", "--json"], capture_output=True, text=True, check=True, timeout=600, env=env)
    return profiled, four, json.loads(res.stdout)["predicted_iteration_time_ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default="mlp_many_layers,resnet_small,transformer_small")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--cpus", type=float, default=0.45, help="CPU quota per host")
    parser.add_argument("--rate", default="1gbit", help="each host's link")
    parser.add_argument("--script-args", default="", help="extra arguments of every example launch")
    parser.add_argument("--compare-with", help="a checkout of another dprorun: its dry runs too")
    parser.add_argument("--largest", type=int, choices=(3, 4), default=4,
                        help="measure up to this many hosts (3: a quota of up to 0.66 CPU a host fits 2 cores)")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.join(REPO, "examples"), DPRO_REPORT="0")
    # PYTHONSAFEPATH: `python -m` would put the working directory (this checkout) ahead of PYTHONPATH
    other_env = dict(env, PYTHONSAFEPATH="1",
                     PYTHONPATH=os.pathsep.join([os.path.abspath(args.compare_with), env["PYTHONPATH"]])) \
        if args.compare_with else None
    print(f"emulated hosts: {args.cpus:g} CPU and a {args.rate} link each, one rank per host, {args.reps} rounds")
    print(f"{'example':18} {'np':>3} {'measured':>9} {'predicted':>9} {'err':>7}   (2-rank: torchrun / profiled)")
    errors = {n: [] for n in range(3, args.largest + 1)}
    for example in args.examples.split(","):
        rows = {k: [] for k in ("m2", "m3", "m4", "profiled", "p3", "p4", "o3", "o4")}
        for _ in range(args.reps):
            with tempfile.TemporaryDirectory() as tmp:
                profiled, p4, p3 = dry_run(example, args, env, tmp)
            if other_env is not None:
                with tempfile.TemporaryDirectory() as tmp:
                    _, o4, o3 = dry_run(example, args, other_env, tmp)
                rows["o4"].append(o4)
                rows["o3"].append(o3)
            rows["profiled"].append(profiled)
            rows["p4"].append(p4)
            rows["p3"].append(p3)
            for hosts in range(2, args.largest + 1):
                rows[f"m{hosts}"].append(measure(example, hosts, args, env))
        med = {k: statistics.median(v) for k, v in rows.items() if v}
        for n in errors:
            err = 100 * (med[f"p{n}"] / med[f"m{n}"] - 1)
            errors[n].append(err)
            other = f"   other: {med[f'o{n}']:.2f} ({100 * (med[f'o{n}'] / med[f'm{n}'] - 1):+.1f} %)" \
                if f"o{n}" in med else ""
            print(f"{example:18} {n:3d} {med[f'm{n}']:9.2f} {med[f'p{n}']:9.2f} {err:+6.1f}%   "
                  f"({med['m2']:.2f} / {med['profiled']:.2f}){other}", flush=True)
    worst = max(abs(e) for v in errors.values() for e in v)
    print("dry-run world-size prediction from 2 ranks: "
          + ", ".join(f"np {n} |error| max {max(abs(e) for e in errors[n]):.1f} %" for n in sorted(errors, reverse=True))
          + f", overall max {worst:.1f} %")


if __name__ == "__main__":
    main()
