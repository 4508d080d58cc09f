"""What-if accuracy: profile at one bucket size, predict others, and measure them.

For each example: profile under dprorun with DDP's bucket_cap_mb = --profile-mb, predict the iteration time at
each --predict-mb with `dpro replay --bucket-mb X`, and measure plain torchrun runs at X. --reps interleaved
rounds, medians reported. Also world size: profile at 2 ranks and predict --np-targets (on this 2-core
machine 3+ ranks oversubscribe the cores: the measured runs then include contention the replay does not model,
which the table shows). Each round also measures the profiled setting itself with torchrun and replays it with no
what-if, so the table shows the predicted change (what-if / as run) beside the measured one: a ratio from one
profile and from launches of the same round, which cancels what both sides share (this machine's speed that
minute, the hooks' cost in the profiled window).

With --net 1gbit every launch (profile and measurements) runs in a fresh network namespace whose loopback is
a 1 Gbit/s tbf link (scripts/with-netns-1gbit; needs root): communication then goes over a network rather than
being CPU copies that compete with the backward on these 2 cores.

--script-args passes extra arguments to every launch of the examples (e.g. "--sparse --optimizer adagrad");
--compare-with DIR profiles each round a second time with the dprorun of another checkout (DIR, e.g. a git
worktree of an older commit: its hooks and its replay) and prints its predictions beside this one's.

usage: python benchmarks/whatif_accuracy.py [--examples ...] [--profile-mb 25] [--predict-mb 1,100] [--reps 3]
       [--net loopback|1gbit] [--script-args "..."] [--compare-with DIR]
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
NETNS = os.path.join(REPO, "scripts", "with-netns-1gbit")


def wrap(net: str, cmd: list[str]) -> list[str]:
    return [NETNS, "--"] + cmd if net == "1gbit" else cmd


def measure(example: str, bucket_mb: float, nproc: int, steps: int, net: str, script_args: list[str]) -> float:
    cmd = wrap(net, [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(REPO, "examples", f"{example}.py"), "--steps", str(steps), "--bucket-mb", str(bucket_mb),
           *script_args])
    for attempt in (1, 2):  # a launch that failed (seen: an abort at exit after the result was printed) is retried
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
        found = re.search(r"median iteration time: ([0-9.]+) ms", out.stdout)
        if out.returncode == 0 and found:
            return float(found.group(1))
        print(f"note: torchrun failed (rc {out.returncode}, attempt {attempt}): {out.stderr.strip()[-400:]}",
              file=sys.stderr)
    raise SystemExit("torchrun failed twice")


def predictions(example: str, bucket_mb: float, steps: int, queries: list[list[str]], net: str,
                script_args: list[str], checkout: str = REPO) -> tuple[list[float], bool]:
    """The predicted iteration times for `queries` from one profile (by the dprorun of `checkout`), and whether
    that profile's transport shares the cores its ranks compute on (the replay flags it: its what-ifs are outside
    the model's assumptions)."""
    env = dict(os.environ, PYTHONPATH=checkout, DPRO_REPORT="0")
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        subprocess.run(wrap(net, [sys.executable, "-m", "dprorun.cli", "-np", "2", "--run-dir", run_dir, "-q",
                        "--warmup", str(steps // 4), "--active", str(steps - steps // 4 - 4), "--clean", "2", "python",
                        os.path.join(REPO, "examples", f"{example}.py"), "--steps", str(steps), "--bucket-mb",
                        str(bucket_mb), *script_args]), capture_output=True, text=True, check=True, cwd=checkout,
                       timeout=900, env=env)
        out, shares_cores = [], False
        for query in queries:
            res = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", run_dir, "--json", *query],
                                 capture_output=True, text=True, check=True, cwd=checkout, timeout=600, env=env)
            doc = json.loads(res.stdout)
            out.append(doc["predicted_iteration_time_ms"])
            shares_cores = bool((doc["comm_model"].get("transport") or {}).get("shares_cores"))
        return out, shares_cores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default="mlp_many_layers,resnet_small,transformer_small")
    parser.add_argument("--profile-mb", type=float, default=25.0)
    parser.add_argument("--predict-mb", default="1,100")
    parser.add_argument("--np-targets", default="3")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--net", choices=("loopback", "1gbit"), default="loopback")
    parser.add_argument("--script-args", default="", help="extra arguments of every example launch")
    parser.add_argument("--compare-with", help="a checkout of another dprorun: its own profile and predictions too")
    args = parser.parse_args()
    script_args = shlex.split(args.script_args)
    if args.net == "1gbit" and os.geteuid() != 0:
        raise SystemExit("--net 1gbit needs root (a network namespace with a tbf qdisc)")
    targets = [("bucket_mb", float(x)) for x in args.predict_mb.split(",") if x] + \
              [("np", int(x)) for x in args.np_targets.split(",") if x]
    print(f"network: {args.net}, {args.reps} rounds, profiled at {args.profile_mb:g} MB buckets")
    print(f"{'example':18} {'what-if':>14} {'measured':>9} {'predicted':>9} {'err':>7} {'meas. change':>12} "
          f"{'pred. change':>12} {'diff':>7}" + ("  other: predicted, err" if args.compare_with else ""))
    bucket_errors, change_errors = [], []
    for example in args.examples.split(","):
        measured, predicted, other = run_rounds(example, targets, args, script_args)
        errors, changes = report(example, targets, args, measured, predicted, other)
        bucket_errors += errors
        change_errors += changes
    print(f"bucket-size what-if |error| (profiled at {args.profile_mb:g} MB): median "
          f"{statistics.median(bucket_errors):.1f} %, max {max(bucket_errors):.1f} %; predicted vs measured change: "
          f"median {statistics.median(change_errors):.1f}, max {max(change_errors):.1f} points")


def run_rounds(example: str, targets: list, args, script_args: list[str]) -> tuple[dict, dict, dict]:
    """Per target (and as run): the measured and predicted times of every round (and the other checkout's)."""
    as_run = ("as_run", args.profile_mb)
    measured = {t: [] for t in targets + [as_run]}
    predicted = {t: [] for t in targets + [as_run]}
    other = {t: [] for t in targets + [as_run]}
    flagged = 0
    queries = [["--bucket-mb", str(v)] if k == "bucket_mb" else ["--np", str(v)] for k, v in targets] + [[]]
    for rep in range(args.reps):
        checkouts = [(REPO, predicted)] + ([(os.path.abspath(args.compare_with), other)] if args.compare_with else [])
        for checkout, into in checkouts if rep % 2 == 0 else reversed(checkouts):
            values, shares_cores = predictions(example, args.profile_mb, args.steps, queries, args.net, script_args,
                                               checkout)
            flagged += shares_cores and checkout == REPO
            for t, value in zip(targets + [as_run], values):
                into[t].append(value)
        for kind, value in targets + [as_run]:
            measured[(kind, value)].append(measure(example, value if kind == "bucket_mb" else args.profile_mb,
                                                   value if kind == "np" else 2, args.steps, args.net, script_args))
    measured["flagged"] = flagged
    return measured, predicted, other


def report(example: str, targets: list, args, measured: dict, predicted: dict, other: dict) -> tuple[list, list]:
    """Print the example's rows; the bucket-size rows' |error| and |predicted - measured change|."""
    as_run = ("as_run", args.profile_mb)

    def versus(t, m):
        return f"  {statistics.median(other[t]):9.2f} {100 * (statistics.median(other[t]) / m - 1):+6.1f}%" \
            if other[t] else ""

    base_m, base_p = statistics.median(measured[as_run]), statistics.median(predicted[as_run])
    print(f"{example:18} {f'as run {args.profile_mb:g} MB':>14} {base_m:9.2f} {base_p:9.2f} "
          f"{100 * (base_p / base_m - 1):+6.1f}%{versus(as_run, base_m)}   (transport on the compute cores in "
          f"{measured['flagged']} of {args.reps} profiles)", flush=True)
    errors, change_errors = [], []
    for t in targets:
        m, p = statistics.median(measured[t]), statistics.median(predicted[t])
        err = 100 * (p / m - 1)
        # the change the what-if makes, per round (same profile, same round's launches), then the median
        changes_m = [100 * (a / b - 1) for a, b in zip(measured[t], measured[as_run])]
        changes_p = [100 * (a / b - 1) for a, b in zip(predicted[t], predicted[as_run])]
        cm, cp = statistics.median(changes_m), statistics.median(changes_p)
        if t[0] == "bucket_mb":
            errors.append(abs(err))
            change_errors.append(abs(cp - cm))
        label = f"{t[1]:g} MB buckets" if t[0] == "bucket_mb" else f"np {t[1]}"
        print(f"{example:18} {label:>14} {m:9.2f} {p:9.2f} {err:+6.1f}% {cm:+11.1f}% {cp:+11.1f}% "
              f"{cp - cm:+6.1f}{versus(t, m)}", flush=True)
    return errors, change_errors


if __name__ == "__main__":
    main()
