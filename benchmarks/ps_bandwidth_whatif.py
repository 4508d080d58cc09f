"""A parameter-server job profiled on one host's loopback, asked an absolute bandwidth (`dpro replay --bandwidth R`,
one medium, and `--links hosts`, its roles laid over a host per worker), against the same job launched plainly on two
emulated hosts (scripts/emulated_cluster.py: a network namespace each, a full-duplex link of rate R, a CPU quota),
a worker and a server on each (as `dprorun --backend mxnet --hosts a:1,b:1` launches them). Interleaved rounds,
medians.

Per round, per model:
  profile   `dprorun --backend mxnet -np 2 --servers 2` on this machine's loopback (no namespace, no quota), then
            `dpro replay --json --bandwidth R` and `... --links hosts` for each rate R
  plain     on the two emulated hosts, at each rate: MXNet's roles with their DMLC_* variables, worker 0's median
            iteration of the second half
  per node  with --per-node W,S: also a machine per role (`--links per-node`): four emulated hosts, the workers' of W
            cores, the servers' of S (the scheduler beside worker 0), launched plainly at each rate
Needs root (namespaces, tc, cgroups) and the MXNet environment (scripts/install-mxnet).

usage: sudo python benchmarks/ps_bandwidth_whatif.py [--models mlp,conv,wide-adam] [--rates 1gbit,3gbit] [--reps 3]
       [--steps 40] [--cpus 0.9] [--per-node 0.75,0.25] [--keep DIR]
Last line: the median |error| and the max of each layout over every model and rate.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mxnet_multihost import EXAMPLE, PORT, gbit, mxnet_python, plain_ms, shell_median_ms  # noqa: E402

MODELS = {"mlp": ("mlp", ""), "conv": ("conv", ""), "wide-adam": ("mlp", "--width 600 --optimizer adam")}
LAYOUTS = {"one medium": ["--links", "shared"], "hosts": ["--links", "hosts"], "per-node": ["--links", "per-node"]}


def per_node_ms(cluster, model: str, script_args: str, steps: int) -> float:
    """The job launched plainly on four emulated hosts, a role each: workers on hosts 0 and 1 (the scheduler beside
    worker 0), servers on 2 and 3; worker 0's median iteration (ms)."""
    script = f"{mxnet_python()} -u {EXAMPLE} --steps {steps} --model {model} {script_args}"
    shell = (f"export DMLC_PS_ROOT_URI={{master_addr}} DMLC_PS_ROOT_PORT={PORT} DMLC_NUM_SERVER=2 DMLC_NUM_WORKER=2 "
             f"DMLC_NODE_HOST={{addr}} DMLC_INTERFACE=eth0; if [ {{node_rank}} = 0 ]; then DMLC_ROLE=scheduler "
             f"{script} & fi; if [ {{node_rank}} -lt 2 ]; then DMLC_ROLE=worker {script}; else DMLC_ROLE=server "
             f"{script}; fi; wait")
    return shell_median_ms(cluster, shell)


def loopback_profile(model: str, script_args: str, steps: int, run_dir: str) -> None:
    """The job on this machine's loopback under dprorun (2 workers, 2 servers; the servers' OpenMP at 1 thread, as
    the plain launches)."""
    subprocess.run([sys.executable, "-m", "dprorun.cli", "--backend", "mxnet", "-np", "2", "--servers", "2", "-q",
                    "--overwrite", "--warmup", "10", "--active", "15", "--clean", str(steps - 30), "--run-dir",
                    run_dir, "python", EXAMPLE, "--steps", str(steps), "--model", model, *script_args.split()],
                   check=True, capture_output=True, text=True, cwd=REPO, timeout=600,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))


def replayed(run_dir: str, rates: list[str]) -> dict[str, float]:
    """{"<layout> <rate>": ms, "as run": ms, "clean": ms} of a loopback profile."""
    out = {}
    for rate in rates:
        for layout, extra in LAYOUTS.items():
            doc = json.loads(subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", run_dir, "--json",
                                             "--bandwidth", f"{gbit(rate):g}Gbit", *extra], capture_output=True,
                                            text=True, check=True, cwd=REPO).stdout)
            out[f"{layout} {rate}"] = doc["predicted_iteration_ms"]
    doc = json.loads(subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", run_dir, "--json"],
                                    capture_output=True, text=True, check=True, cwd=REPO).stdout)
    out["as run"], out["clean"] = doc["predicted_iteration_ms"], doc["clean_ms"]
    return out


def measure(args: argparse.Namespace) -> list[dict]:
    from emulated_cluster import EmulatedCluster

    rounds = []
    keep = os.path.abspath(args.keep) if args.keep else None
    quotas = [float(x) for x in args.per_node.split(",")] if args.per_node else []
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(EmulatedCluster(2, args.cpus, rate=args.rates[0], tag=f"b{os.getpid() % 9999}"))
        nodes = stack.enter_context(EmulatedCluster(4, 0.0, rate=args.rates[0], tag=f"n{os.getpid() % 9999}",
                                                    host_cpus=[quotas[0]] * 2 + [quotas[1]] * 2)) if quotas else None
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        for rep in range(args.reps):
            for name in args.models:
                model, script_args = MODELS[name]
                plain_args = argparse.Namespace(model=model, script_args=script_args, steps=args.steps)
                plain, per_node = {}, {}
                for rate in (args.rates if rep % 2 == 0 else args.rates[::-1]):
                    cluster.set_rate(rate)
                    plain[rate] = plain_ms(cluster, plain_args, 1)
                    if nodes is not None:
                        nodes.set_rate(rate)
                        per_node[rate] = per_node_ms(nodes, model, script_args, args.steps)
                run_dir = os.path.join(keep or tmp, f"{name}-{rep}")
                loopback_profile(model, script_args, args.steps, run_dir)
                rounds.append({"model": name, "plain": plain, "per_node": per_node,
                               "replays": replayed(run_dir, args.rates), "run_dir": run_dir if keep else None})
                print(f"round {rep} {name}: plain " + ", ".join(f"{r} {ms:.2f}" for r, ms in plain.items())
                      + " | " + ", ".join(f"{k} {v:.2f}" for k, v in rounds[-1]["replays"].items()), flush=True)
                if keep:
                    with open(os.path.join(keep, "rounds.json"), "w") as handle:
                        json.dump({"args": vars(args), "rounds": rounds}, handle, indent=1)
    return rounds


def report(rounds: list[dict], args: argparse.Namespace) -> None:
    print(f"{'model':10} {'rate':7} {'plain, 2 hosts (rounds)':>26} {'median':>8} {'layout':11} "
          f"{'replayed (rounds)':>26} {'median':>8} {'error %':>8}")
    errors: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    for name in args.models:
        mine = [r for r in rounds if r["model"] == name]
        for rate in args.rates:
            truth = [r["plain"][rate] for r in mine]
            for layout in LAYOUTS:
                pred = [r["replays"][f"{layout} {rate}"] for r in mine]
                if layout == "per-node":  # its truth: a machine per role
                    truth = [r["per_node"][rate] for r in mine if rate in r.get("per_node", {})]
                    if not truth:
                        continue
                t, p = statistics.median(truth), statistics.median(pred)
                errors[layout].append(100 * (p / t - 1))
                print(f"{name:10} {rate:7} {' / '.join(f'{x:.1f}' for x in truth):>26} {t:8.2f} {layout:11} "
                      f"{' / '.join(f'{x:.1f}' for x in pred):>26} {p:8.2f} {errors[layout][-1]:+8.1f}")
        print(f"{name:10} loopback profiles as run {' / '.join(str(r['replays']['as run']) for r in mine)} ms, their "
              f"clean iterations {' / '.join(str(r['replays']['clean']) for r in mine)} ms")
    print("loopback profile, absolute bandwidth, against full-duplex hosts: " + ", ".join(
        f"{layout} median |error| {statistics.median(abs(e) for e in errs):.1f} % (max {max(errs, key=abs):+.1f} %)"
        for layout, errs in errors.items() if errs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,conv,wide-adam")
    parser.add_argument("--rates", default="1gbit,3gbit")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--cpus", type=float, default=0.9, help="each emulated host's CPU quota (cores)")
    parser.add_argument("--per-node", default="", metavar="W,S",
                        help="also launch on four hosts, a role each: the workers' hosts W cores, the servers' S")
    parser.add_argument("--keep", default="", metavar="DIR", help="keep the profiles and rounds.json here")
    args = parser.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    args.rates = [r for r in args.rates.split(",") if r]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown models {unknown}: one of {sorted(MODELS)}")
    report(measure(args), args)


if __name__ == "__main__":
    main()
