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
       (more models: conv-2ctx (2 contexts a worker), handloop-2bit (2-bit compressed pushes), mlp-async,
       conv-async (dist_async), conv-validate-10 (a validation pass every 10 steps); workers-update, frozen,
       embedding, frozen-later (the first layer frozen after 5 steps): examples/mxnet_variants.py;
       deep-imperative, rmsprop-schedule, loader-workers: benchmarks/shapes/mx_shapes.py; lstm-clip-adam:
       benchmarks/shapes/mx_session36.py; mobilenet-zoo, pushpull-hand: benchmarks/shapes/mx_session43.py;
       sparse-embedding: examples/mxnet_sparse_embedding.py, a row-sparse table)
       [--reps 3] [--steps 60] [--bound 100000] [--omp N] [--compare-with CHECKOUT] [--keep DIR | --from DIR]
With --keep DIR the profiles' run directories and the plain launches' figures are kept (DIR/rounds.json); --from DIR
(or DIR1,DIR2: several runs' rounds together) replays those profiles again with this code (no launch): a model change
measured on the same rounds.
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
# (label, servers, big-array bound) of the plain launches: the profiled configuration and the what-ifs
CONFIGS = (("as run", 2, None), ("servers 1", 1, None), ("bound", 2, BOUND))
MODELS = {"conv": ["--model", "conv"], "mlp": ["--model", "mlp", "--width", "600"],
          # each batch split over 2 contexts (as a multi-GPU worker; the sum of each key over them before its push)
          "conv-2ctx": ["--model", "conv", "--contexts", "2"],
          "mlp-adam": ["--model", "mlp", "--width", "600", "--optimizer", "adam"],
          # the kvstore's asynchronous mode: each push updated on its own (not in the default set)
          "mlp-async": ["--model", "mlp", "--width", "600", "--kvstore", "dist_async"],
          "conv-async": ["--model", "conv", "--kvstore", "dist_async"],
          # a validation pass (4 forward batches outside autograd.record) every 10 steps, untimed by the script
          "conv-validate-10": ["--model", "conv", "--validate-every", "10"],
          # examples/mxnet_variants.py: the optimizer on the workers, frozen layers, an embedding table
          "workers-update": ["--update-on-kvstore", "0"], "frozen": ["--freeze"], "embedding": ["--embedding"],
          # the first layer trained for 5 steps, then frozen (before the window)
          "frozen-later": ["--freeze-at", "5"],
          # the Module API (Module.fit, string keys), a symbolic MLP: examples/mxnet_module.py
          "module": ["--width", "512"],
          # hand-written kv.push / kv.pull per parameter, the optimizer on the servers: examples/mxnet_kvstore_loop.py
          "handloop": ["--width", "512"],
          # the same with the pushed gradients 2-bit compressed (kv.set_gradient_compression)
          "handloop-2bit": ["--width", "512", "--compression", "2bit"],
          # benchmarks/shapes/mx_shapes.py: shapes the model was not tuned on
          "deep-imperative": ["--deep"], "rmsprop-schedule": ["--rmsprop"], "loader-workers": ["--loader-workers", "2"],
          # benchmarks/shapes/mx_session36.py: an LSTM language model, clipping between allreduce_grads and update
          "lstm-clip-adam": [],
          # benchmarks/shapes/mx_session37.py: a model-zoo ResNet-18 (static_alloc), the dist_sync_device kvstore
          "resnet18-zoo": ["--zoo"], "device-kv": ["--device-kv"],
          # benchmarks/shapes/mx_session38.py: grad_req "add" over 2 micro-batches, deferred input sizes with Adam
          "accumulate-2": ["--accumulate", "2"], "deferred-adam": ["--deferred"],
          # benchmarks/shapes/mx_session39.py: static_alloc, NAG with multi_precision and a FactorScheduler
          "static-nag": [],
          # benchmarks/shapes/mx_session43.py: a model-zoo MobileNet (83 small keys), gradients averaged with
          # kv.pushpull by hand and an updater on the workers
          "mobilenet-zoo": [], "pushpull-hand": ["--pushpull"],
          # examples/mxnet_sparse_embedding.py: a row-sparse table pushed by rows, pulled with row_sparse_pull
          "sparse-embedding": [],
          # benchmarks/shapes/mx_session50.py: a language model whose decoder shares the embedding's weight (Adam);
          # an MLP whose every 11th batch is short (40 of 96), the optimizer on the workers
          "tied-lm": [], "ragged-batches": ["--ragged"],
          # benchmarks/shapes/mx_session51.py: an optimizer class of the script's own, run on the workers (on the
          # servers MXNet cannot load it: dprorun warns, and that job trains nothing as written)
          "own-optimizer-workers": ["--on-workers"],
          # benchmarks/shapes/mx_session52.py: an MLP with dropout trained under autograd.record(train_mode=False)
          "predict-mode": [],
          # benchmarks/shapes/mx_session64.py: a conv net under mxnet.contrib.amp with bfloat16 on the CPU
          "amp-bf16": ["--amp-bf16"]}
SCRIPTS = {"module": os.path.join(REPO, "examples", "mxnet_module.py"),
           **{name: os.path.join(REPO, "examples", "mxnet_variants.py") for name in ("workers-update", "frozen",
                                                                                   "embedding", "frozen-later")},
           **{name: os.path.join(REPO, "examples", "mxnet_kvstore_loop.py") for name in ("handloop", "handloop-2bit")},
           **{name: os.path.join(REPO, "benchmarks", "shapes", "mx_shapes.py") for name in ("deep-imperative",
                                                                                          "rmsprop-schedule",
                                                                                          "loader-workers")},
           "lstm-clip-adam": os.path.join(REPO, "benchmarks", "shapes", "mx_session36.py"),
           **{name: os.path.join(REPO, "benchmarks", "shapes", "mx_session37.py") for name in ("resnet18-zoo",
                                                                                            "device-kv")},
           **{name: os.path.join(REPO, "benchmarks", "shapes", "mx_session38.py") for name in ("accumulate-2",
                                                                                            "deferred-adam")},
           "static-nag": os.path.join(REPO, "benchmarks", "shapes", "mx_session39.py"),
           **{name: os.path.join(REPO, "benchmarks", "shapes", "mx_session43.py") for name in ("mobilenet-zoo",
                                                                                            "pushpull-hand")},
           "sparse-embedding": os.path.join(REPO, "examples", "mxnet_sparse_embedding.py"),
           **{name: os.path.join(REPO, "benchmarks", "shapes", "mx_session50.py") for name in ("tied-lm",
                                                                                            "ragged-batches")},
           "own-optimizer-workers": os.path.join(REPO, "benchmarks", "shapes", "mx_session51.py"),
           "predict-mode": os.path.join(REPO, "benchmarks", "shapes", "mx_session52.py"),
           "amp-bf16": os.path.join(REPO, "benchmarks", "shapes", "mx_session64.py")}


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


def profile(model: str, net: str, run_dir: str, servers: int = 2, bound: int | None = None) -> None:
    """`dprorun --backend mxnet -np 2 --servers 2` (or `servers`; with MXNET_KVSTORE_BIGARRAY_BOUND=`bound`) of the
    model into `run_dir`."""
    cmd = wrap(net, [sys.executable, "-m", "dprorun.cli", "--backend", "mxnet", "-np", "2", "--servers", str(servers),
                     "--run-dir", run_dir, "-q", "--warmup", "10", "--active", "20", "--clean", str(STEPS - 40),
                     "python", example(model), "--steps", str(STEPS), *MODELS[model]])
    env = dict(os.environ, **({"MXNET_KVSTORE_BIGARRAY_BOUND": str(bound)} if bound else {}))
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600, env=env)
    if done.returncode != 0:
        raise SystemExit(f"dprorun failed: {done.stderr[-2000:]}")


def replays(run_dir: str, compare_with: str | None = None, options: tuple[str, ...] = ()) -> dict[str, float]:
    """{"as run", "servers 1", "bound", "window", "clean", "scale"}: the replays of a profile and the run's own
    iterations (ms); with `compare_with` (a checkout) also each replay by that checkout's code ("as run, other
    checkout", ...); `options` go to this checkout's `dpro replay` calls."""
    out = {}
    whatifs = (("as run", []), ("servers 1", ["--servers", "1"]), ("bound", ["--bigarray-bound", str(BOUND)]))
    for label, extra in whatifs:
        for code, checkout in (("", REPO), (", other checkout", compare_with)):
            if not checkout:
                continue
            doc = json.loads(subprocess.run(
                [sys.executable, "-m", "dprorun.offline_cli", "replay", run_dir, "--json", *extra,
                 *(options if checkout == REPO else [])],
                capture_output=True, text=True, check=True, cwd=checkout,
                env=dict(os.environ, PYTHONPATH=checkout)).stdout)
            out[label + code] = doc["predicted_iteration_ms"]
            if not code:
                out["window"], out["clean"] = doc["window_ms"], doc["clean_ms"]
                out["scale"] = doc["model"]["compute_scale"]
    return out


def measure(args: argparse.Namespace, options: tuple[str, ...]) -> list[dict]:
    """The interleaved rounds: per network, model and round the plain launches of each configuration and one profile
    (its run directory under --keep, else a temporary one, replayed at once). Returns the rounds as recorded in
    --keep's rounds.json: {net, model, plain: {label: ms}, run_dir, replays}."""
    rounds = []
    keep = os.path.abspath(args.keep) if args.keep else None
    for net in args.nets.split(","):
        for model in args.models.split(","):
            for rep in range(args.reps):  # interleaved: plain launches and profiles alternate
                # the configurations' order rotated from round to round: none always comes first, right after the
                # previous round's profile (the tied model's first launch was 15 % slower in both rounds of a run)
                turn = rep % len(CONFIGS)
                plain = {label: plain_ms(model, servers, net, bound)
                         for label, servers, bound in CONFIGS[turn:] + CONFIGS[:turn]}
                with tempfile.TemporaryDirectory() as tmp:
                    run_dir = os.path.join(keep, f"{net}-{model}-{rep}") if keep else os.path.join(tmp, "run")
                    profile(model, net, run_dir)
                    rounds.append({"net": net, "model": model, "plain": plain, "run_dir": run_dir if keep else None,
                                   "replays": replays(run_dir, args.compare_with, options)})
                if keep:
                    with open(os.path.join(keep, "rounds.json"), "w") as handle:
                        json.dump(rounds, handle, indent=1)
    return rounds


def report(rounds: list[dict], compare: bool) -> None:
    """The tables (medians over rounds per network and model) and the last line."""
    configs = [label for label, _, _ in CONFIGS]
    codes = ("", ", other checkout") if compare else ("",)
    rows, overheads, ratios = [], [], []
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rounds:
        groups.setdefault((r["net"], r["model"]), []).append(r)
    for (net, model), group in groups.items():
        plain = {label: [r["plain"][label] for r in group] for label in configs}
        predicted = {label + code: [r["replays"][label + code] for r in group] for label in configs for code in codes}
        overheads.append((net, model, statistics.median(plain["as run"]),
                          *(statistics.median(r["replays"][k] for r in group) for k in ("window", "clean", "scale"))))
        for label, code in ((label, code) for label in configs for code in codes):
            truth = statistics.median(plain[label])
            spread = 100 * (max(plain[label]) - min(plain[label])) / truth
            pred = statistics.median(predicted[label + code])
            kind = ("as run (2 servers)" if label == "as run" else (
                "what-if: 1 server" if label == "servers 1" else f"what-if: bound {BOUND}")) + code
            rows.append((net, model, kind, truth, spread, pred, 100 * (pred / truth - 1)))
            if label != "as run":  # the what-if against the as-run row, measured and replayed: free of its offset
                # also paired per round (each round's launches against each other: free of drift between rounds)
                paired = [(r["plain"][label] / r["plain"]["as run"],
                           r["replays"][label + code] / r["replays"]["as run" + code]) for r in group]
                ratios.append((net, model, kind, truth / statistics.median(plain["as run"]),
                               pred / statistics.median(predicted["as run" + code]),
                               statistics.median(m for m, _ in paired), statistics.median(p for _, p in paired)))
    print(f"{'net':9} {'model':9} {'kind':38} {'plain ms':>9} {'spread %':>8} {'replay ms':>9} {'error %':>8}")
    for net, model, kind, truth, spread, pred, error in rows:
        print(f"{net:9} {model:9} {kind:38} {truth:9.2f} {spread:8.1f} {pred:9.2f} {error:+8.1f}")
    print(f"\n{'net':9} {'model':9} {'what-if / as run':38} {'measured':>9} {'replayed':>9} {'error %':>8} "
          f"{'paired: measured':>16} {'replayed':>9} {'error %':>8}")
    for net, model, kind, measured, replayed, pair_measured, pair_replayed in ratios:
        print(f"{net:9} {model:9} {kind:38} {measured:9.3f} {replayed:9.3f} {100 * (replayed / measured - 1):+8.1f} "
              f"{pair_measured:16.3f} {pair_replayed:9.3f} {100 * (pair_replayed / pair_measured - 1):+8.1f}")
    print(f"\n{'net':9} {'model':9} {'plain ms':>9} {'window ms':>9} {'clean ms':>9} {'hooks %':>8} {'compute x':>9}")
    for net, model, plain_median, window, clean, scale in overheads:
        print(f"{net:9} {model:9} {plain_median:9.2f} {window:9.2f} {clean:9.2f} "
              f"{100 * (window / plain_median - 1):+8.1f} {scale:9.2f}")
    rows = [r for r in rows if not r[2].endswith("other checkout")]  # the last line: this checkout's code
    as_run = [abs(r[-1]) for r in rows if r[2].startswith("as run")]
    whatifs = [abs(r[-1]) for r in rows if not r[2].startswith("as run")]
    ratio_errors = [abs(100 * (p / m - 1)) for _, _, kind, m, p, _, _ in ratios if not kind.endswith("other checkout")]
    paired_errors = [abs(100 * (p / m - 1)) for _, _, kind, _, _, m, p in ratios if not kind.endswith("other checkout")]
    print(f"as run: median |error| {statistics.median(as_run):.1f} % (max {max(as_run):.1f}); what-ifs: median "
          f"|error| {statistics.median(whatifs):.1f} % (max {max(whatifs):.1f}), as ratios to the as-run row "
          f"{statistics.median(ratio_errors):.1f} % (max {max(ratio_errors):.1f}), paired per round "
          f"{statistics.median(paired_errors):.1f} % (max {max(paired_errors):.1f}) over {len(rows)} rows")


def add_kept_arguments(parser: argparse.ArgumentParser) -> None:
    """The PS benchmarks' options for comparing models on the same rounds: --compare-with, --keep, --from,
    --host-cores."""
    parser.add_argument("--compare-with", default=None, metavar="CHECKOUT",
                        help="also replay each profile with the dprorun code of this checkout (a before/after on the "
                             "same runs, e.g. a git worktree of an earlier commit)")
    parser.add_argument("--keep", default=None, metavar="DIR",
                        help="keep each profile's run directory and the rounds' figures (DIR/rounds.json)")
    parser.add_argument("--from", dest="kept", default=None, metavar="DIR[,DIR...]",
                        help="launch nothing (no root needed): replay the profiles kept by earlier --keep DIRs with "
                             "this code (and --compare-with's) against the plain launches recorded with them")
    parser.add_argument("--host-cores", default=None, metavar="N|auto",
                        help="replay with `dpro replay --host-cores` (this checkout's replays only)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="conv,mlp,mlp-adam")
    parser.add_argument("--nets", default="loopback")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=STEPS, help="iterations per launch (plain: the median of the "
                        "second half; profiled: 10 warm-up, 20 in the window, the rest clean)")
    parser.add_argument("--bound", type=int, default=BOUND, metavar="ELEMENTS",
                        help="the big-array bound what-if (and its plain launch): 100000 unless given")
    parser.add_argument("--omp", type=int, default=None, metavar="N",
                        help="OMP_NUM_THREADS=N for every role of every launch, plain and profiled (the servers' "
                        "OpenMP threads spin on the workers' cores otherwise: sparse-embedding)")
    add_kept_arguments(parser)
    args = parser.parse_args()
    globals()["STEPS"] = args.steps
    if args.omp:
        os.environ["OMP_NUM_THREADS"] = str(args.omp)
    globals()["BOUND"] = args.bound
    globals()["CONFIGS"] = tuple((label, servers, args.bound if bound else None) for label, servers, bound in CONFIGS)
    options = ("--host-cores", args.host_cores) if args.host_cores else ()
    if args.kept:
        rounds = []
        for kept in args.kept.split(","):  # several --keep runs: their rounds together
            with open(os.path.join(kept, "rounds.json")) as handle:
                rounds += json.load(handle)
        for r in rounds:
            r["replays"] = replays(r["run_dir"], args.compare_with, options)
    else:
        rounds = measure(args, options)
    report(rounds, bool(args.compare_with))

if __name__ == "__main__":
    main()
