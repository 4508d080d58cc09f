"""Memory budget on a real job: a budget below the measured peak makes the search choose re-computation or
gradient accumulation, and the job run with that strategy is measured under the budget.

mlp_many_layers with a large batch (activations dominate the rank's memory), 2 ranks on CPU. Peak = the
process's peak resident set (VmHWM) over the job, per rank. Steps: profile; `dpro optimize --memory-budget
B` with B = --fraction x the measured peak; run the job with the strategy (re-computation is applied by the
hooks; gradient accumulation by the example itself through `dprorun.strategy()`); compare. Also each memory
pass forced on its own, to show both against the same budget.

usage: python benchmarks/memory_budget.py [--batch-size 8192] [--fraction 0.8]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP = os.path.join(REPO, "examples", "mlp_many_layers.py")
MiB = 1 << 20


def run(run_dir: str, args, extra: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-m", "dprorun.cli", "-np", "2", "-q", "--run-dir", run_dir,
                           "--warmup", "3", "--active", "5", "--clean", "2", *extra, "python", MLP, "--steps",
                           str(args.steps), "--batch-size", str(args.batch_size)],
                          capture_output=True, text=True, cwd=REPO, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-2000:]}")
    summary = json.loads(subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "summary", run_dir, "--json"],
                                        capture_output=True, text=True, check=True).stdout)
    rows = summary["memory"]
    return {"measured": max(r["measured_peak_bytes"] for r in rows),
            "estimated": max(r["estimated_peak_bytes"] for r in rows),
            "iteration_ms": summary.get("iteration_time_ms")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--fraction", type=float, default=0.8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = run(os.path.join(tmp, "base"), args, [])
        budget = int(args.fraction * base["measured"])
        res = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "optimize", os.path.join(tmp, "base"),
                              "--memory-budget", str(budget), "--json", "-o", os.path.join(tmp, "s.json")],
                             capture_output=True, text=True, cwd=REPO)
        if res.returncode != 0:
            raise RuntimeError(res.stderr)
        strategy = json.loads(res.stdout)
        rows = [("as run", base, None)]
        chosen = run(os.path.join(tmp, "chosen"), args, ["--strategy", os.path.join(tmp, "s.json")])
        rows.append(("search's choice", chosen, strategy))
        for name, fields in (("recompute 4", {"recompute_segments": 4}), ("accumulate 4", {"accumulation_steps": 4})):
            path = os.path.join(tmp, f"{name.replace(' ', '_')}.json")
            with open(path, "w") as handle:
                json.dump({"version": 1, **fields}, handle)
            rows.append((name, run(os.path.join(tmp, name.replace(" ", "_")), args, ["--strategy", path]), fields))
    print(f"budget {budget / MiB:.1f} MiB = {args.fraction:g} x measured peak {base['measured'] / MiB:.1f} MiB "
          f"(batch {args.batch_size})")
    print(f"{'run':16} {'estimated MiB':>13} {'measured MiB':>12} {'under budget':>12} {'iteration ms':>12}  strategy")
    for name, r, strat in rows:
        what = ""
        if strat is not None and "decisions" in strat:
            what = "; ".join(f"{d['pass_name']}: {d['choice']}" for d in strat["decisions"])
        elif strat is not None:
            what = json.dumps(strat)
        print(f"{name:16} {r['estimated'] / MiB:13.1f} {r['measured'] / MiB:12.1f} "
              f"{'yes' if r['measured'] <= budget else 'NO':>12} {r['iteration_ms'] or float('nan'):12.2f}  {what}")
    print(f"memory budget: the search's strategy measured {chosen['measured'] / MiB:.1f} MiB against a budget of "
          f"{budget / MiB:.1f} MiB ({'under' if chosen['measured'] <= budget else 'OVER'})")


if __name__ == "__main__":
    main()
