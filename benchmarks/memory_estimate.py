"""Peak-memory estimate vs measured, per example (CPU: peak RSS of the warm-up iterations, read before the
profiler allocates its buffers; GPU runs compare with torch.cuda.max_memory_allocated).

usage: python benchmarks/memory_estimate.py [--examples ...] [--script-args "--optimizer adam"]
"""
import argparse
import os
import subprocess
import sys
import tempfile

from dprorun.memory import run_memory
from dprorun.trace.rundir import load_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default="mlp_many_layers,resnet_small,transformer_small")
    parser.add_argument("--script-args", default="", help="extra arguments for every example (e.g. '--optimizer adamw')")
    args = parser.parse_args()
    print(f"{'example':18} {'rank':>4} {'at init MB':>10} {'optim MB':>8} {'steady+ MB':>10} {'grads MB':>8} {'activ MB':>8} "
          f"{'update MB':>9} {'estimate MB':>11} {'measured MB':>11} {'err':>7}")
    errors = []
    for example in args.examples.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = os.path.join(tmp, "run")
            subprocess.run([sys.executable, "-m", "dprorun.cli", "-np", "2", "--run-dir", run_dir, "-q",
                            "--warmup", "5", "--active", "4", "--clean", "1", "python",
                            os.path.join(REPO, "examples", f"{example}.py"), "--steps", "12", *args.script_args.split()],
                           check=True, capture_output=True, cwd=REPO, timeout=600)
            for row in run_memory(load_run(run_dir)):
                parts = {k: (v or 0) / 2 ** 20 for k, v in row["parts"].items()}
                errors.append(abs(row["error_pct"]))
                print(f"{example:18} {row['rank']:4d} {parts['at_ddp_init']:10.1f} {parts['optimizer_state']:8.1f} "
                      f"{parts['other_steady']:10.1f} {parts['gradients']:8.1f} {parts['activations']:8.1f} "
                      f"{parts.get('update_transient', 0):9.1f} {row['estimated_peak_bytes'] / 2 ** 20:11.1f} {row['measured_peak_bytes'] / 2 ** 20:11.1f} "
                      f"{row['error_pct']:+6.1f}%", flush=True)
    print(f"peak-memory estimate |error|: max {max(errors):.1f} %")


if __name__ == "__main__":
    main()
