"""How often `dprorun --autotune` keeps a strategy on a job whose knobs change little, with one judged round
(the rule before session 41: one window of the job's own settings against one of each candidate) and with two
(a second, interleaved round that must agree), from the same number of launches of each.

The job: the shape of Horovod's pytorch_mnist example (benchmarks/shapes/tutorial_hvd_mnist.py, 87 KB of
gradients: every fusion threshold the search offers holds all of them, as the job's own 128 MB does; only the
cycle time differs, which the replay prices at a few %). Per round, interleaved: `dprorun --backend horovod
--autotune --autotune-rounds R -np 2` for each R of --rounds. What each run's autotune.json says: whether the
search offered candidates, whether one was kept, the gain it was kept on (each round's) and the gain the replay
predicted, and the whole job's window afterwards against the own settings' window(s).

    python benchmarks/autotune_noise.py [--reps 4] [--rounds 1,2]

Last line: `kept: rounds 1 a of n, rounds 2 b of n (runs that offered candidates)`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "shapes", "tutorial_hvd_mnist.py")


def autotune(rounds: int, run_dir: str, epochs: int) -> dict:
    """One `dprorun --autotune` run; what its autotune.json says."""
    cmd = [sys.executable, "-m", "dprorun.cli", "--backend", "horovod", "--autotune", "--autotune-rounds",
           str(rounds), "-np", "2", "-q", "--run-dir", run_dir, "--overwrite", "python", SCRIPT,
           "--epochs", str(epochs)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"autotune failed ({out.returncode}): {out.stderr[-2000:]}")
    with open(os.path.join(run_dir, "autotune.json")) as handle:
        phases = json.load(handle)["phases"]
    by_name = {p["phase"]: p for p in phases}
    search, deciding = by_name.get("searching", {}), by_name.get("deciding", {})
    own = [p["measured_ms"] for p in phases if p["phase"] == "profiling"] + \
        [p["measured_ms"] for p in phases if p["phase"] == "confirming" and p.get("strategy") is None]
    predicted = (1 - search["predicted_ms"] / search["baseline_replay_ms"]) if search.get("predicted_ms") and \
        search.get("baseline_replay_ms") else None
    return {"offered": bool(search.get("decisions")), "kept": bool(deciding.get("keep")),
            "rounds": deciding.get("rounds") or [], "predicted_gain": predicted,
            "final_ms": by_name.get("done", {}).get("measured_ms"), "own_ms": own}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--rounds", default="1,2", help="the --autotune-rounds values, each run once a round")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    settings = [int(r) for r in args.rounds.split(",")]
    results: dict[int, list[dict]] = {r: [] for r in settings}
    with tempfile.TemporaryDirectory(prefix="autotune_noise_") as tmp:
        for rep in range(args.reps):
            for rounds in (settings if rep % 2 == 0 else settings[::-1]):
                row = autotune(rounds, os.path.join(tmp, f"r{rounds}-{rep}"), args.epochs)
                results[rounds].append(row)
                gains = ", ".join(f"{100 * (1 - t / b):+.1f} %" for b, t in row["rounds"]) or "-"
                predicted = f"{100 * row['predicted_gain']:+.1f} %" if row["predicted_gain"] is not None else "-"
                final = f"{row['final_ms']:.2f}" if row["final_ms"] is not None else "-"
                print(f"round {rep}: --autotune-rounds {rounds}: offered {row['offered']}, kept {row['kept']}, "
                      f"predicted {predicted}, measured per round {gains}, own settings "
                      f"{', '.join(f'{ms:.2f}' for ms in row['own_ms'])} ms, kept strategy's run {final} ms",
                      flush=True)
    print()
    print(f"{'--autotune-rounds':>18} {'runs':>5} {'offered':>8} {'kept':>5} {'kept runs: final vs own ms':>30}")
    for rounds in settings:
        rows = results[rounds]
        kept = [r for r in rows if r["kept"] and r["final_ms"] is not None]
        finals = (f"{statistics.median(r['final_ms'] for r in kept):.2f} vs "
                  f"{statistics.median(statistics.median(r['own_ms']) for r in kept):.2f}") if kept else "-"
        print(f"{rounds:>18} {len(rows):>5} {sum(r['offered'] for r in rows):>8} {sum(r['kept'] for r in rows):>5} "
              f"{finals:>30}")
    print("kept: " + ", ".join(f"rounds {r} {sum(x['kept'] for x in results[r])} of "
                               f"{sum(x['offered'] for x in results[r])}" for r in settings)
          + " (runs that offered candidates)")


if __name__ == "__main__":
    main()
