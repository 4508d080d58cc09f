"""A Gluon job whose DataLoader worker processes are terminated mid-job, launched again and again under dprorun.

`examples/mxnet_gluon.py --loader-workers 2` makes a new DataLoader every 8 steps: each dropped loader's pool
sends SIGTERM to its processes, forks of the worker. The hooks once let that signal stop the worker (exit 143) or
leave the pool waiting forever for a process that never ran its handler (a hang). Each launch's outcome: exit code,
a hang (still running after --timeout s: dprorun stopped, every role with it), processes of the job left behind.

--fail-at-step N: worker 1 raises at step N, so the launcher stops the other roles with SIGTERM, which reaches
each worker's process group, its loader's processes included. The outcome then adds the launch's seconds and
whether a role outlived the SIGTERM until torch elastic's SIGKILL 30 s later (a stopping worker's pool forked
new processes, and MXNet's prepare-fork handler waited for a pull that never ends).

usage: python benchmarks/mxnet_loader_forks.py [--reps 12] [--timeout 80] [--fail-at-step 17] [--busy]
(--busy: a busy loop on one core beside the launches)
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


def launch(run_dir: str, timeout: float, fail_at_step: int) -> str:
    cmd = [sys.executable, "-m", "dprorun.cli", "--run-dir", run_dir, "--backend", "mxnet", "-np", "2", "--servers",
           "1", "--warmup", "3", "--active", "6", "--kineto-iters", "3", "--clean", "4", "python", SCRIPT,
           "--steps", "24", "--model", "mlp", "--loader-workers", "2"]
    if fail_at_step >= 0:
        cmd += ["--fail-at-step", str(fail_at_step)]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        outcome = f"exit {proc.returncode}"
        if fail_at_step >= 0:
            killed = "Unable to shutdown" in output  # torch elastic's SIGKILL after its 30 s
            outcome += f", {time.monotonic() - started:.1f} s" + (", a role SIGKILLed" if killed else "")
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
    parser.add_argument("--fail-at-step", type=int, default=-1, help="worker 1 raises at this step")
    parser.add_argument("--busy", action="store_true", help="a busy loop on one core beside the launches")
    args = parser.parse_args()
    outcomes = []
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    print("| launch | outcome |\n|---|---|")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.reps):
                outcomes.append(launch(os.path.join(tmp, f"run{i}"), args.timeout, args.fail_at_step))
                print(f"| {i + 1} | {outcomes[-1]} |", flush=True)
    finally:
        if busy is not None:
            busy.kill()
    if args.fail_at_step >= 0:
        clean = sum(o.startswith("exit 1,") and "SIGKILL" not in o and "left behind" not in o for o in outcomes)
        print(f"loader forks, worker failing at step {args.fail_at_step}: {clean} of {len(outcomes)} launches "
              "stopped (exit 1) without a SIGKILL, nothing left behind")
    else:
        print(f"loader forks: {sum(o == 'exit 0' for o in outcomes)} of {len(outcomes)} launches exited 0 with "
              "nothing left behind")


if __name__ == "__main__":
    main()
