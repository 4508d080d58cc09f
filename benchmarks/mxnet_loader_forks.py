"""A Gluon job whose DataLoader worker processes are terminated mid-job, launched again and again under dprorun.

`examples/mxnet_gluon.py --loader-workers 2` makes a new DataLoader every 8 steps: each dropped loader's pool
sends SIGTERM to its processes, forks of the worker. The hooks once let that signal stop the worker (exit 143) or
leave the pool waiting forever for a process that never ran its handler (a hang). Each launch's outcome: exit code,
a hang (still running after --timeout s: dprorun stopped, every role with it), processes of the job left behind.

usage: python benchmarks/mxnet_loader_forks.py [--reps 12] [--timeout 80]
"""
import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "mxnet_gluon.py")


def launch(run_dir: str, timeout: float) -> str:
    cmd = [sys.executable, "-m", "dprorun.cli", "--run-dir", run_dir, "--backend", "mxnet", "-np", "2", "--servers",
           "1", "--warmup", "3", "--active", "6", "--kineto-iters", "3", "--clean", "4", "python", SCRIPT,
           "--steps", "24", "--model", "mlp", "--loader-workers", "2"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        proc.communicate(timeout=timeout)
        outcome = f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # dprorun stops every role, then exits
        try:
            proc.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        outcome = "hung"
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", f"{SCRIPT} --steps 24"], capture_output=True, text=True).stdout.split()
    for pid in left:
        os.kill(int(pid), signal.SIGKILL)
    return outcome + (f", {len(left)} processes left behind" if left else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--timeout", type=float, default=80.0)
    args = parser.parse_args()
    outcomes = []
    print("| launch | outcome |\n|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.reps):
            outcomes.append(launch(os.path.join(tmp, f"run{i}"), args.timeout))
            print(f"| {i + 1} | {outcomes[-1]} |", flush=True)
    print(f"loader forks: {sum(o == 'exit 0' for o in outcomes)} of {len(outcomes)} launches exited 0 with nothing "
          "left behind")


if __name__ == "__main__":
    main()
