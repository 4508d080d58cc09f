"""How a 2-rank DDP job whose rank 1 fails ends: seconds from start to exit, the exit code and the rank named as
the cause, under plain torchrun, dprorun, and (--before DIR) the dprorun of another checkout, in alternating
rounds. Three scripts:

- early: rank 1 raises before init_process_group while rank 0 waits for it in the store (in C++);
- last-step: rank 1 raises after the window's last step while rank 0 goes on to the end-of-window gather;
- restarts: a script that resumes from its snapshot, rank 1 failing in attempts 0 and 1, with --max-restarts 3
  (torchrun's own launch line; dprorun refused the flag before session 58);
- nodes-last-step, nodes-restarts: last-step and restarts as two nodes of one rank each on this host (node 1
  started first, node 0 a second later; seconds until both exit, exit codes node 0/node 1, the cause node 1 named).

    python benchmarks/failure_teardown.py [--reps 3] [--before /tmp/wt_before] [--cases early,last-step,restarts,...]

Last line: `median seconds to exit: early torchrun A / dprorun B, last-step ..., restarts ...`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from dprorun.procs import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

EARLY = """
import os
import torch.distributed as dist
if os.environ["RANK"] == "1":
    raise FileNotFoundError("shard_1.bin is missing on this rank")
dist.init_process_group("gloo")
"""
WINDOW = ["--warmup", "1", "--active", "2", "--kineto-iters", "1", "--clean", "1"]
CASES = {  # name -> (script, extra environment, torchrun flags, dprorun flags)
    "early": ("early", {}, [], []),
    "last-step": ("fault_tolerant", {"FAIL_AT": "2"}, [], WINDOW),
    "restarts": ("fault_tolerant", {}, ["--max-restarts", "3"], ["--max-restarts", "3"] + WINDOW),
    "nodes-last-step": ("fault_tolerant", {"FAIL_AT": "2"}, [], WINDOW),
    "nodes-restarts": ("fault_tolerant", {"FAIL_AT": "2"}, ["--max-restarts", "3"], ["--max-restarts", "3"] + WINDOW),
}
LIMIT_S = 300


def scripts(folder: str) -> dict[str, str]:
    from test_failures import FAULT_TOLERANT  # the test suite's fault-tolerant script, as torchrun's tutorial has it

    paths = {}
    for name, text in (("early", EARLY), ("fault_tolerant", FAULT_TOLERANT)):
        paths[name] = os.path.join(folder, name + ".py")
        with open(paths[name], "w") as handle:
            handle.write(text)
    return paths


def cause(stderr: str, run_dir: str) -> str:
    """The rank named as the cause: dprorun's error line, its manifest (0 with restarts), or torchrun's root cause."""
    said = re.search(r"dprorun: error: rank (\d+) .*?(exited with code \d+|was killed by signal \w+)", stderr)
    if said:
        return f"rank {said.group(1)} {said.group(2).replace('exited with ', '').replace('was killed by ', '')}"
    root = re.search(r"Root Cause.*?rank\s*: (\d+).*?exitcode\s*: (-?\d+)", stderr, re.S)
    if root:
        return f"rank {root.group(1)} code {root.group(2)}"
    try:
        with open(os.path.join(run_dir, "manifest.json")) as handle:
            return f"{len(json.load(handle).get('relaunches', []))} restarts named"
    except OSError:
        return "-"


def command(kind: str, case: str, run_dir: str, node_rank: int) -> list[str]:
    """The launch line of one node (node_rank -1: the job on one node, 2 ranks)."""
    _, _, torchrun_flags, dprorun_flags = CASES[case]
    if node_rank < 0:
        nodes = ["--nproc-per-node" if kind == "torchrun" else "-np", "2"]
    else:
        nodes = ["--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port",
                 str(free_port(count=2)) if node_rank == 1 else "{port}"]
        nodes += ["--nproc-per-node", "1"] if kind == "torchrun" else ["-np", "1", "--join-timeout", "60"]
    if kind == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *nodes, *torchrun_flags]
    return [sys.executable, "-m", "dprorun.cli", "--run-dir", os.path.join(run_dir, "run"), *nodes, *dprorun_flags]


def launch(kind: str, case: str, paths: dict, folder: str, before: str) -> tuple[float, str, str]:
    """(seconds until every node's launcher exited, exit code(s), cause named by the node of the failing rank)."""
    script, env_extra, _, _ = CASES[case]
    run_dir = tempfile.mkdtemp(dir=folder)
    env = dict(os.environ, SNAPSHOT=os.path.join(run_dir, "snapshot.pt"), DPRO_REPORT="0", **env_extra)
    cwd = before if kind == "before" else REPO
    if kind != "torchrun":
        env["PYTHONPATH"] = cwd
    lines = [command(kind, case, run_dir, -1)]
    if case.startswith("nodes-"):
        node1 = command(kind, case, run_dir, 1)
        port = node1[node1.index("--master-port") + 1]
        lines = [node1, [arg.replace("{port}", port) for arg in command(kind, case, run_dir, 0)]]
    start = time.monotonic()
    procs = []
    for line in lines:
        procs.append(subprocess.Popen(line + [paths[script]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, cwd=cwd, env=env, start_new_session=True))
        time.sleep(1.0 if len(lines) > 1 else 0)
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=max(1.0, LIMIT_S - (time.monotonic() - start)))[1])
        except subprocess.TimeoutExpired:  # torchrun's restarted attempts can hang connecting (its rendezvous' defect)
            for other in procs:
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)  # the launcher and its ranks
                    other.communicate()
            return time.monotonic() - start, "-1", f"hung: stopped after {LIMIT_S} s"
    elapsed = time.monotonic() - start
    codes = "/".join(str(p.returncode) for p in reversed(procs))  # node 0's first
    return elapsed, codes, cause(outputs[0], os.path.join(run_dir, "run"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--before", default="", help="a checkout of the code before, run as a third launcher")
    args = parser.parse_args()
    kinds = ["torchrun", "dprorun"] + (["before"] if args.before else [])
    cases = args.cases.split(",")
    results: dict[tuple[str, str], list] = {}
    with tempfile.TemporaryDirectory() as folder:
        paths = scripts(folder)
        for rep in range(args.reps):
            for case in cases:
                for kind in kinds:
                    results.setdefault((case, kind), []).append(launch(kind, case, paths, folder, args.before))
                    print(f"round {rep + 1} {case:15s} {kind:8s} {results[(case, kind)][-1]}", file=sys.stderr)
    print(f"{'case':15s} {'launcher':9s} {'median s':>9s} {'min-max s':>13s}  exit codes  cause named")
    for case in cases:
        for kind in kinds:
            rows = results[(case, kind)]
            seconds = [r[0] for r in rows]
            print(f"{case:15s} {kind:9s} {statistics.median(seconds):9.1f} {min(seconds):6.1f}-{max(seconds):<6.1f} "
                  f"{','.join(str(r[1]) for r in rows):11s} {'; '.join(sorted({r[2] for r in rows}))}")
    print("median seconds to exit: " + ", ".join(
        f"{case} " + " / ".join(f"{kind} {statistics.median(r[0] for r in results[(case, kind)]):.1f}"
                                for kind in kinds) for case in cases))


if __name__ == "__main__":
    main()
