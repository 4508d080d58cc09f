"""Op fusion (torch.compile) and bf16 passes: predicted iteration time from measured variant ratios vs real runs.

Per round and example, interleaved: a 2-rank profile with `--measure-variants` (rank 0 times the model eager,
compiled as a whole, compiled block by block and under bf16 autocast), `dpro replay RUN`, `--compile`,
`--compile-blocks`, `--bf16` on it; then real jobs under `dprorun --strategy` (none / compiled_modules [""] /
compiled_modules = the measured blocks / precision bf16) whose measured time is the example's own
median over the second half of its steps, after the hooks stepped aside. Medians over --reps rounds.

usage: python benchmarks/compute_passes.py [--examples mlp_many_layers,...] [--reps 3] [--steps 60]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {"eager": {}, "compile": {"compiled_modules": [""]}, "blocks": {"compiled_modules": "BLOCKS"},
            "bf16": {"precision": "bf16"}}


def measured_blocks(run_dir: str) -> list[str]:
    """The blocks rank 0 compiled one by one for the "compiled_blocks" variant ([] if the model has none)."""
    with open(os.path.join(run_dir, "rank_0", "variants.json")) as handle:
        return json.load(handle)["variants"].get("compiled_blocks", {}).get("blocks") or []


def run_job(example: str, steps: int, run_dir: str, extra: list[str]) -> str:
    out = subprocess.run([sys.executable, "-m", "dprorun.cli", "-np", "2", "-q", "--run-dir", run_dir, *extra,
                          "python", os.path.join(REPO, "examples", f"{example}.py"), "--steps", str(steps)],
                         capture_output=True, text=True, cwd=REPO, timeout=1200)
    if out.returncode != 0:
        raise RuntimeError(f"{example} {extra}: exit {out.returncode}: {out.stderr[-2000:]}")
    return out.stdout


def predictions(run_dir: str) -> dict[str, float]:
    out = {}
    for name, flags in (("eager", []), ("compile", ["--compile"]), ("blocks", ["--compile-blocks"]),
                        ("bf16", ["--bf16"])):
        res = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", run_dir, "--json", *flags],
                             capture_output=True, text=True, cwd=REPO, timeout=600)
        out[name] = json.loads(res.stdout)["predicted_iteration_time_ms"] if res.returncode == 0 else float("nan")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default="mlp_many_layers,resnet_small,transformer_small")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    print(f"{'example':18} {'variant':8} {'measured':>9} {'predicted':>9} {'err':>7} {'meas. gain':>10} "
          f"{'pred. gain':>10}")
    errors = []
    for example in args.examples.split(","):
        measured = {v: [] for v in VARIANTS}
        predicted = {v: [] for v in VARIANTS}
        for _ in range(args.reps):
            with tempfile.TemporaryDirectory() as tmp:
                run_job(example, 30, os.path.join(tmp, "profile"), ["--measure-variants"])
                for name, value in predictions(os.path.join(tmp, "profile")).items():
                    predicted[name].append(value)
                blocks = measured_blocks(os.path.join(tmp, "profile"))
                for name, fields in VARIANTS.items():
                    extra = []
                    if fields.get("compiled_modules") == "BLOCKS":
                        if not blocks:
                            measured[name].append(float("nan"))
                            continue
                        fields = {"compiled_modules": blocks}
                    if fields:
                        path = os.path.join(tmp, f"{name}.json")
                        with open(path, "w") as handle:
                            json.dump({"version": 1, **fields}, handle)
                        extra = ["--strategy", path]
                    stdout = run_job(example, args.steps, os.path.join(tmp, name), extra)
                    measured[name].append(float(re.search(r"median iteration time: ([0-9.]+) ms", stdout).group(1)))
        m = {v: statistics.median(x) for v, x in measured.items()}
        p = {v: statistics.median(x) for v, x in predicted.items()}
        for name in VARIANTS:
            err = 100 * (p[name] / m[name] - 1)
            if err == err:  # nan: a model without blocks
                errors.append(abs(err))
            print(f"{example:18} {name:8} {m[name]:9.2f} {p[name]:9.2f} {err:+6.1f}% "
                  f"{100 * (1 - m[name] / m['eager']):+9.1f}% {100 * (1 - p[name] / p['eager']):+9.1f}%", flush=True)
    print(f"compute passes: |error| of the predicted iteration time median {statistics.median(errors):.1f} %, "
          f"max {max(errors):.1f} %")


if __name__ == "__main__":
    main()
