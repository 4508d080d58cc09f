"""Parameter-server replay accuracy: `dpro replay` of a `dprorun --backend mxnet` profile vs the job launched plainly.

For each model and network, --reps interleaved rounds of:
  plain     the scheduler, the servers and 2 workers started with MXNet's DMLC_* variables in the MXNet environment,
            no dprorun (worker 0 prints the median iteration of the second half), once per configuration:
            2 servers (the profiled one), 1 server, 2 servers with MXNET_KVSTORE_BIGARRAY_BOUND=BOUND
  profile   `dprorun --backend mxnet -np 2 --servers 2`, then `dpro replay --json` as run, `--servers 1` and
            `--bigarray-bound BOUND` (the what-ifs, against the plain runs of those configurations)
Reported: medians over rounds, the plain launches' spread (max-min over median), the errors; the window's own
iterations without the profiler (hooks on) against the plain launches (the hooks' cost). Networks: loopback, and
with --nets 1gbit a 1 Gbit/s tbf-shaped loopback in a fresh namespace (scripts/with-netns-1gbit).

usage: python benchmarks/mxnet_replay_accuracy.py [--models conv,mlp,mlp-adam,module,handloop] [--nets loopback,1gbit]
       [--reps 3] [--steps 60] [--compare-with CHECKOUT]
With --compare-with CHECKOUT each profile is also replayed by that checkout's code (rows "..., other checkout"):
a before/after of the model on the same profiles, free of launch-to-launch spread.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
NETNS = os.path.join(REPO, "scripts", "with-netns-1gbit")
EXAMPLE = os.path.join(REPO, "examples", "mxnet_gluon.py")
STEPS = 60
BOUND = 100_000
MODELS = {"conv": ["--model", "conv"], "mlp": ["--model", "mlp", "--width", "600"],
          "mlp-adam": ["--model", "mlp", "--width", "600", "--optimizer", "adam"],
          # the Module API (Module.fit, string keys), a symbolic MLP: examples/mxnet_module.py
          "module": ["--width", "512"],
          # hand-written kv.push / kv.pull per parameter, the optimizer on the servers: examples/mxnet_kvstore_loop.py
          "handloop": ["--width", "512"]}
SCRIPTS = {"module": os.path.join(REPO, "examples", "mxnet_module.py"),
           "handloop": os.path.join(REPO, "examples", "mxnet_kvstore_loop.py")}


def example(model: str) -> str:
    return SCRIPTS.get(model, EXAMPLE)


def wrap(net: str, cmd: list[str]) -> list[str]:
    return [NETNS, "--"] + cmd if net == "1gbit" else cmd


def mxnet_python() -> str:
    from dprorun.config import JobConfig
    from dprorun.launch_ps import mxnet_python as find

    return find(JobConfig(command=["python"]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plain_ms(model: str, servers: int, net: str, bound: int | None = None) -> float:
    """Scheduler, servers and 2 workers in one shell (so that a network namespace holds them all)."""
    python = mxnet_python()
    env = (f"DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT={free_port()} DMLC_NUM_SERVER={servers} "
           f"DMLC_NUM_WORKER=2 DMLC_NODE_HOST=127.0.0.1 DMLC_INTERFACE=lo"
           + (f" MXNET_KVSTORE_BIGARRAY_BOUND={bound}" if bound else ""))
    script = f"{python} -u {example(model)} --steps {STEPS} {' '.join(MODELS[model])}"
    roles = ["scheduler"] + ["server"] * servers
    shell = (f"export {env}; " + " ".join(f"DMLC_ROLE={r} {script} & " for r in roles)
             + f"DMLC_ROLE=worker {script} & DMLC_ROLE=worker {script}; wait")
    out = subprocess.run(wrap(net, ["bash", "-c", shell]), capture_output=True, text=True, timeout=600, cwd=REPO)
    found = re.search(r"median iteration ([0-9.]+) ms", out.stdout)
    if not found:
        raise SystemExit(f"plain MXNet launch failed: {out.stdout[-800:]} {out.stderr[-1500:]}")
    return float(found.group(1))


def profiled(model: str, net: str, compare_with: str | None = None) -> dict[str, float]:
    """{"as run", "servers 1", "bound", "window", "clean"}: the replays and the run's own iterations (ms); with
    `compare_with` (a checkout) also each replay by that checkout's code ("as run, other checkout", ...)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        cmd = wrap(net, [sys.executable, "-m", "dprorun.cli", "--backend", "mxnet", "-np", "2", "--servers", "2",
                         "--run-dir", run_dir, "-q", "--warmup", "10", "--active", "20", "--clean", str(STEPS - 40),
                         "python", example(model), "--steps", str(STEPS), *MODELS[model]])
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"dprorun failed: {done.stderr[-2000:]}")
        out = {}
        for label, extra in (("as run", []), ("servers 1", ["--servers", "1"]),
                             ("bound", ["--bigarray-bound", str(BOUND)])):
            for code, checkout in (("", REPO), (", other checkout", compare_with)):
                if not checkout:
                    continue
                doc = json.loads(subprocess.run(
                    [sys.executable, "-m", "dprorun.offline_cli", "replay", run_dir, "--json", *extra],
                    capture_output=True, text=True, check=True, cwd=checkout,
                    env=dict(os.environ, PYTHONPATH=checkout)).stdout)
                out[label + code] = doc["predicted_iteration_ms"]
                if not code:
                    out["window"], out["clean"] = doc["window_ms"], doc["clean_ms"]
                    out["scale"] = doc["model"]["compute_scale"]
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="conv,mlp,mlp-adam")
    parser.add_argument("--nets", default="loopback")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=STEPS, help="iterations per launch (plain: the median of the "
                        "second half; profiled: 10 warm-up, 20 in the window, the rest clean)")
    parser.add_argument("--compare-with", default=None, metavar="CHECKOUT",
                        help="also replay each profile with the dprorun code of this checkout (a before/after on the "
                             "same runs, e.g. a git worktree of an earlier commit)")
    args = parser.parse_args()
    globals()["STEPS"] = args.steps
    rows, overheads = [], []
    configs = (("as run", 2, None), ("servers 1", 1, None), ("bound", 2, BOUND))
    codes = ("", ", other checkout") if args.compare_with else ("",)
    for net in args.nets.split(","):
        for model in args.models.split(","):
            plain: dict[str, list[float]] = {label: [] for label, _, _ in configs}
            predicted: dict[str, list[float]] = {label + code: [] for label, _, _ in configs for code in codes}
            windows, cleans, scales = [], [], []
            for _ in range(args.reps):  # interleaved: plain launches and profiles alternate
                for label, servers, bound in configs:
                    plain[label].append(plain_ms(model, servers, net, bound))
                replays = profiled(model, net, args.compare_with)
                for label in predicted:
                    predicted[label].append(replays[label])
                windows.append(replays["window"])
                cleans.append(replays["clean"])
                scales.append(replays["scale"])
            overheads.append((net, model, statistics.median(plain["as run"]), statistics.median(windows),
                              statistics.median(cleans), statistics.median(scales)))
            for (label, servers, bound), code in ((config, code) for config in configs for code in codes):
                truth = statistics.median(plain[label])
                spread = 100 * (max(plain[label]) - min(plain[label])) / truth
                pred = statistics.median(predicted[label + code])
                kind = ("as run (2 servers)" if label == "as run" else (
                    "what-if: 1 server" if label == "servers 1" else f"what-if: bound {BOUND}")) + code
                rows.append((net, model, kind, truth, spread, pred, 100 * (pred / truth - 1)))
    print(f"{'net':9} {'model':9} {'kind':38} {'plain ms':>9} {'spread %':>8} {'replay ms':>9} {'error %':>8}")
    for net, model, kind, truth, spread, pred, error in rows:
        print(f"{net:9} {model:9} {kind:38} {truth:9.2f} {spread:8.1f} {pred:9.2f} {error:+8.1f}")
    print(f"\n{'net':9} {'model':9} {'plain ms':>9} {'window ms':>9} {'clean ms':>9} {'hooks %':>8} {'compute x':>9}")
    for net, model, plain_median, window, clean, scale in overheads:
        print(f"{net:9} {model:9} {plain_median:9.2f} {window:9.2f} {clean:9.2f} "
              f"{100 * (window / plain_median - 1):+8.1f} {scale:9.2f}")
    rows = [r for r in rows if not r[2].endswith("other checkout")]  # the last line: this checkout's code
    as_run = [abs(r[-1]) for r in rows if r[2].startswith("as run")]
    whatifs = [abs(r[-1]) for r in rows if not r[2].startswith("as run")]
    print(f"as run: median |error| {statistics.median(as_run):.1f} % (max {max(as_run):.1f}); what-ifs: median "
          f"|error| {statistics.median(whatifs):.1f} % (max {max(whatifs):.1f}) over {len(rows)} rows")


if __name__ == "__main__":
    main()
