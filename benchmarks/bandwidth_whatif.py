"""Absolute-bandwidth what-if for DDP: `dpro replay RUN --bandwidth B` of a job profiled on links of one rate, against
the same job run plainly on links of rate B.

Runs on an emulated cluster (scripts/emulated_cluster.py): 2 hosts, one rank each, every host a network namespace
with its own CPU quota (--cpus) and a full-duplex link of the round's rate to a switch (the 1 Gbit/s namespace of
scripts/with-netns-1gbit puts both directions of every transfer through one tbf, which is no full-duplex link).
Each round, interleaved, for every rate R in --rates: `dprorun` on links of rate R (the profile), and plain torchrun
on links of rate R (the truth). Then every profile is replayed at every other rate (`--bandwidth`), and its own rate
(the as-run check). Medians over --reps rounds.

usage: sudo python benchmarks/bandwidth_whatif.py [--examples mlp_many_layers,...] [--rates 1gbit,3gbit]
       [--reps 2] [--script-args "..."] [--dprorun-args "--warmup 30"] [--keep DIR]
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

from dryrun_world_size import REPO, EmulatedCluster, host_output

PORT = 29640


def script(example: str, args) -> list[str]:
    return [os.path.join(REPO, "examples", f"{example}.py"), "--steps", str(args.steps), *shlex.split(args.script_args)]


def plain(example: str, rate: str, args, env: dict) -> float:
    with EmulatedCluster(2, args.cpus, rate) as cluster:
        out = host_output(cluster.run(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "{nnodes}", "--node-rank", "{node_rank}",
             "--master-addr", "{master_addr}", "--master-port", str(PORT), "--nproc-per-node", "1",
             *script(example, args)], 900, env))
    return float(re.search(r"median iteration time: ([0-9.]+) ms", out).group(1))


def profile(example: str, rate: str, args, env: dict, run_dir: str) -> str:
    with EmulatedCluster(2, args.cpus, rate) as cluster:
        host_output(cluster.run(
            [sys.executable, "-m", "dprorun.cli", "--nnodes", "{nnodes}", "--node-rank", "{node_rank}",
             "--master-addr", "{master_addr}", "--master-port", str(PORT + 1), "-np", "1",
             "--run-dir", os.path.join(run_dir, "node{node_rank}"), "-q", *shlex.split(args.dprorun_args), "python",
             *script(example, args)],
            900, env))
    return os.path.join(run_dir, "node0")


def replay_ms(run_dir: str, rate: str, env: dict) -> float:
    bandwidth = rate.replace("gbit", "Gbit").replace("mbit", "Mbit")
    res = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", run_dir, "--bandwidth", bandwidth,
                          "--json"], capture_output=True, text=True, check=True, timeout=600, env=env)
    return json.loads(res.stdout)["predicted_iteration_time_ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default="mlp_many_layers,resnet_small")
    parser.add_argument("--rates", default="1gbit,3gbit")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--cpus", type=float, default=0.9, help="CPU quota per host")
    parser.add_argument("--script-args", default="", help="extra arguments of every example launch")
    parser.add_argument("--dprorun-args", default="", help="extra dprorun options of the profiles (e.g. '--warmup 30')")
    parser.add_argument("--keep", help="keep the profiles' run directories under this folder")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.join(REPO, "examples"), DPRO_REPORT="0")
    rates = args.rates.split(",")
    print(f"emulated hosts: 2, {args.cpus:g} CPU each, one rank per host; rates {rates}; {args.reps} rounds")
    print(f"{'example':18} {'profiled at':>11} {'replayed at':>11} {'measured':>9} {'replayed':>9} {'err':>7}")
    errors = []
    for example in args.examples.split(","):
        measured = {r: [] for r in rates}
        replayed = {(p, r): [] for p in rates for r in rates}
        for rep in range(args.reps):
            for rate in rates:  # interleaved: a profile and a plain run at each rate
                with tempfile.TemporaryDirectory() as tmp:
                    root = os.path.join(args.keep, f"{example}-{rate}-{rep}") if args.keep else tmp
                    run_dir = profile(example, rate, args, env, root)
                    for target in rates:
                        replayed[(rate, target)].append(replay_ms(run_dir, target, env))
                measured[rate].append(plain(example, rate, args, env))
        for (profiled_at, target), values in replayed.items():
            truth, guess = statistics.median(measured[target]), statistics.median(values)
            err = 100 * (guess / truth - 1)
            if profiled_at != target:
                errors.append(err)
            print(f"{example:18} {profiled_at:>11} {target:>11} {truth:9.2f} {guess:9.2f} {err:+6.1f}%"
                  f"{'' if profiled_at != target else '   (as run)'}   measured {measured[target]}", flush=True)
    print(f"bandwidth what-if (another rate than profiled): median |error| "
          f"{statistics.median(abs(e) for e in errors):.1f} %, max {max(abs(e) for e in errors):.1f} %")


if __name__ == "__main__":
    main()
