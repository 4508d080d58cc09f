"""Seconds from a signal sent to a Horovod job's whole process group (`kill -TERM -PGID`, as a container runtime or a
batch system stops a job; SIGINT as a terminal's Ctrl-C) to the launcher's exit, under plain horovodrun, dprorun
--backend horovod, and (--before DIR) the dprorun of another checkout, in alternating rounds. The job
(examples/horovod_mlp.py, 2 ranks) runs long; the signal goes 1 s after dprorun's window (horovodrun: after 8 s).

    python benchmarks/group_signal_stop.py [--reps 10] [--before /tmp/wt_before] [--signal SIGTERM]

Last line: `seconds to exit (median / max): horovodrun A / B, dprorun C / D, ...`; ranks left running are counted.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "horovod_mlp.py")


def one_stop(launcher: str, tree: str, signum: int, run_dir: str) -> tuple[float, int, int]:
    """(seconds from the group signal to the launcher's exit, its exit code, ranks still running after it)."""
    job = ["-np", "2", "python", SCRIPT, "--steps", "100000"]
    if launcher == "horovodrun":
        cmd = ["horovodrun", "--gloo", *job]
    else:
        cmd = [sys.executable, "-m", "dprorun.cli", "--backend", "horovod", "--run-dir", run_dir, "--warmup", "2",
               "--active", "4", *job]
    env = dict(os.environ, PYTHONPATH=tree) if tree else dict(os.environ)
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, cwd=tempfile.gettempdir())
    started = time.monotonic()
    window = os.path.join(run_dir, "rank_1", "events.json")
    while time.monotonic() - started < 90 and (launcher == "horovodrun" and time.monotonic() - started < 8
                                               or launcher != "horovodrun" and not os.path.exists(window)):
        time.sleep(0.2)
    time.sleep(1.0)
    sent = time.monotonic()
    os.killpg(proc.pid, signum)
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    seconds = time.monotonic() - sent
    left = subprocess.run(["pgrep", "-f", f"{SCRIPT} --steps 100000"], capture_output=True, text=True).stdout.split()
    for pid in left:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    return seconds, code, len(left)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--before", default="", help="a checkout of the code before, run as a third launcher")
    parser.add_argument("--signal", default="SIGTERM", choices=("SIGTERM", "SIGINT"))
    args = parser.parse_args()
    launchers = {"horovodrun": "", "dprorun": REPO} | ({"dprorun-before": args.before} if args.before else {})
    seconds: dict[str, list[float]] = {name: [] for name in launchers}
    left: dict[str, int] = {name: 0 for name in launchers}
    print("| round | launcher | seconds to exit | exit code | ranks left |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.reps):
            for name, tree in launchers.items():
                took, code, running = one_stop(name, tree, getattr(signal, args.signal),
                                               os.path.join(tmp, f"{name}-{round_}"))
                seconds[name].append(took)
                left[name] += running
                print(f"| {round_} | {name} | {took:.1f} | {code} | {running} |", flush=True)
    print("seconds to exit (median / max): " + ", ".join(
        f"{name} {statistics.median(v):.1f} / {max(v):.1f} ({left[name]} ranks left)" for name, v in seconds.items()))


if __name__ == "__main__":
    main()
