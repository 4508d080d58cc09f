"""How often an MXNet PS job hangs at exit, plainly and under dprorun, and what dprorun reads of the job's shape.

examples/mxnet_batchnorm_clip.py ends without mx.nd.waitall(), as many scripts do. Launched plainly (scheduler, 2
servers, 2 workers on loopback), such a job sometimes never exits: one worker waits in MXNet's exit handler for an
engine operation, the other at the kvstore's closing barrier. The workers' hooks drain the engine before MXNet's exit
handler runs (runtime/mxnet.py, drain_engine_at_exit). Rounds alternate the plain launch and dprorun's (and, with
--compare-with DIR, the dprorun of another checkout); a launch still running after --timeout seconds counts as
hung and its process group is killed. For each completed dprorun launch the table also says how its iterations were
found, whether the optimizer ran on the servers, and whether the model priced the servers' merging of the pushes.

    python benchmarks/mxnet_exit.py --reps 4 [--configs conv,conv-clip,lstm-clip] [--compare-with DIR]

Last line: `hung at exit: plain A of N, under dprorun B of N`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mxnet_replay_accuracy import REPO, free_port, mxnet_python  # noqa: E402

SCRIPT = os.path.join(REPO, "examples", "mxnet_batchnorm_clip.py")
CONFIGS = {"conv": [], "conv-clip": ["--clip", "1"], "lstm-clip": ["--model", "lstm", "--clip", "1"],
           "conv-1": ["--accumulate", "1"]}
STEPS = 24


def _run(cmd: list[str], timeout: float, cwd: str) -> tuple[bool, str]:
    """(finished in time, stdout). A launch past the timeout gets SIGTERM in its process group (dprorun then stops
    the roles it started, which run in sessions of their own), then SIGKILL."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return True, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        return False, out


def plain(config: str, timeout: float) -> tuple[bool, str]:
    script = f"{mxnet_python()} -u {SCRIPT} --steps {STEPS} {' '.join(CONFIGS[config])}"
    env = (f"DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT={free_port()} DMLC_NUM_SERVER=2 DMLC_NUM_WORKER=2 "
           "DMLC_NODE_HOST=127.0.0.1 DMLC_INTERFACE=lo")
    shell = (f"export {env}; " + " ".join(f"DMLC_ROLE={r} {script} & " for r in ("scheduler", "server", "server"))
             + f"DMLC_ROLE=worker {script} & DMLC_ROLE=worker {script}; wait")
    return _run(["bash", "-c", shell], timeout, REPO)


def under_dprorun(config: str, run_dir: str, timeout: float, checkout: str = REPO) -> tuple[bool, dict]:
    cmd = [sys.executable, "-m", "dprorun.cli", "--run-dir", run_dir, "-q", "--backend", "mxnet", "-np", "2",
           "--servers", "2", "--warmup", "3", "--active", "10", "--kineto-iters", "5", "--clean", "6", "python",
           SCRIPT, "--steps", str(STEPS), *CONFIGS[config]]
    done, out = _run(cmd, timeout, checkout)
    row: dict = {}
    if done and os.path.exists(os.path.join(run_dir, "rank_0", "events.json")):
        tracker = json.load(open(os.path.join(run_dir, "rank_0", "events.json")))["trackers"][0]
        row = {"iterations": tracker["iterations"].split(" (")[0], "on servers": tracker["update_on_kvstore"],
               "engine probe": len(tracker["engine_probe"])}
        summary_path = os.path.join(run_dir, "summary.json")
        if os.path.exists(summary_path):
            notes = json.load(open(summary_path))["as_run"]["notes"]
            row["merging priced"] = not any("not priced on the servers" in n for n in notes)
    return done, row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--configs", default="conv,conv-clip,lstm-clip")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a plain launch counts as hung")
    parser.add_argument("--compare-with", help="a checkout of another dprorun, launched in the same rounds")
    args = parser.parse_args()
    configs = args.configs.split(",")
    counts = {(c, who): [0, 0] for c in configs for who in ("plain", "dprorun", "other")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for config in configs:
                done, out = plain(config, args.timeout)
                counts[config, "plain"][0] += not done
                counts[config, "plain"][1] += 1
                found = re.findall(r"median iteration ([0-9.]+) ms", out)
                print(f"round {rep} {config} plain: {'exited' if done else 'HUNG'} {found}", flush=True)
                launches = [("dprorun", REPO)] + ([("other", args.compare_with)] if args.compare_with else [])
                if rep % 2:
                    launches.reverse()
                for who, checkout in launches:
                    run_dir = os.path.join(tmp, f"{config}-{who}-{rep}")
                    done, row = under_dprorun(config, run_dir, args.timeout + 60, checkout)
                    counts[config, who][0] += not done
                    counts[config, who][1] += 1
                    print(f"round {rep} {config} {who}: {'exited' if done else 'HUNG'} {row}", flush=True)
                    rows.append({"config": config, "who": who, "done": done, **row})
    print("\n| config | plain hung | under dprorun hung" + (" | other checkout hung" if args.compare_with else "")
          + " |")
    print("|---|---|---" + ("|---" if args.compare_with else "") + "|")
    for config in configs:
        cells = [f"{counts[config, who][0]} of {counts[config, who][1]}"
                 for who in ("plain", "dprorun") + (("other",) if args.compare_with else ())]
        print(f"| {config} | " + " | ".join(cells) + " |")
    print("\n| config | launch | iterations | optimizer on the servers | engine probe sizes | merging priced |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        if row["done"] and "iterations" in row:
            print(f"| {row['config']} | {row['who']} | {row['iterations']} | {row['on servers']} | "
                  f"{row['engine probe']} | {row.get('merging priced', '-')} |")
    plain_hung = sum(counts[c, "plain"][0] for c in configs)
    ours_hung = sum(counts[c, "dprorun"][0] for c in configs)
    total = sum(counts[c, "plain"][1] for c in configs)
    print(f"hung at exit: plain {plain_hung} of {total}, under dprorun {ours_hung} of {total}")


if __name__ == "__main__":
    main()
