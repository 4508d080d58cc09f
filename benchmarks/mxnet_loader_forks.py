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
    [--suite-settings] [--gdb-dir DIR]
(--busy: a busy loop on one core beside the launches; --suite-settings: the suite test's window, which ends at the
step worker 1 fails in; --gdb-dir: gdb's backtraces of every thread of a worker still running 8 s after the failure)
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


def dump_stuck_workers(root_pid: int, gdb_dir: str, label: str) -> int:
    """gdb every thread of the job's MXNet workers still running (their C and Python frames); returns how many."""
    import psutil

    dumped = 0
    for child in psutil.Process(root_pid).children(recursive=True):
        try:
            if child.environ().get("DMLC_ROLE") != "worker" or SCRIPT not in " ".join(child.cmdline()):
                continue
        except psutil.Error:
            continue
        stacks = subprocess.run(["gdb", "-p", str(child.pid), "-batch", "-ex", "thread apply all bt"],
                                capture_output=True, text=True, timeout=60).stdout
        with open(os.path.join(gdb_dir, f"{label}_worker_{child.pid}.txt"), "w") as handle:
            handle.write(stacks)
        dumped += 1
    return dumped


def launch(run_dir: str, args: argparse.Namespace, label: str) -> str:
    steps, active, clean = ("40", "8", "6") if args.suite_settings else ("24", "6", "4")
    cmd = [sys.executable, "-m", "dprorun.cli", "--run-dir", run_dir, "--backend", "mxnet", "-np", "2", "--servers",
           "1", "--warmup", "3", "--active", active, "--kineto-iters", "3", "--clean", clean, "python", SCRIPT,
           "--steps", steps, "--model", "mlp", "--loader-workers", "2"]
    if args.fail_at_step >= 0:
        cmd += ["--fail-at-step", str(args.fail_at_step)]
    started = time.monotonic()
    log_path = run_dir + ".log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
    failed_at, dumped = None, 0
    while proc.poll() is None and time.monotonic() - started < args.timeout:
        time.sleep(0.5)
        if args.gdb_dir and failed_at is None and "injected failure" in open(log_path).read():
            failed_at = time.monotonic()
        if failed_at is not None and not dumped and time.monotonic() - failed_at > 8:  # SIGTERM long sent
            dumped = dump_stuck_workers(proc.pid, args.gdb_dir, label) or -1
    if proc.poll() is not None:
        output = open(log_path).read()
        outcome = f"exit {proc.returncode}"
        if args.fail_at_step >= 0:
            killed = "Unable to shutdown" in output  # torch elastic's SIGKILL after its 30 s
            outcome += f", {time.monotonic() - started:.1f} s" + (", a role SIGKILLed" if killed else "")
            outcome += f", {dumped} stuck worker(s) dumped" if dumped > 0 else ""
    else:
        proc.send_signal(signal.SIGTERM)  # dprorun stops every role, then exits
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        outcome = "hung"
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", f"{SCRIPT} --steps {steps}"], capture_output=True, text=True).stdout.split()
    for pid in left:
        os.kill(int(pid), signal.SIGKILL)
    return outcome + (f", {len(left)} processes left behind" if left else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--timeout", type=float, default=80.0)
    parser.add_argument("--fail-at-step", type=int, default=-1, help="worker 1 raises at this step")
    parser.add_argument("--busy", action="store_true", help="a busy loop on one core beside the launches")
    parser.add_argument("--suite-settings", action="store_true",
                        help="the suite's job: --steps 40 --active 8 --clean 6 (the window ends as worker 1 fails)")
    parser.add_argument("--gdb-dir", help="where a worker still running 8 s after the failure has its threads dumped")
    args = parser.parse_args()
    outcomes = []
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    print("| launch | outcome |\n|---|---|")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.reps):
                outcomes.append(launch(os.path.join(tmp, f"run{i}"), args, f"launch{i + 1}"))
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
