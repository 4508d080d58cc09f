"""Predictions of recorded runs under 25 what-ifs, to compare two checkouts of the replayer (a refactor must not
move them). Each run's model is replayed for every what-if on the op-level graph and its coarsened view, for the
median durations and the first two measured iterations.

    # in each checkout (PYTHONPATH makes the checkout's dprorun the one imported):
    PYTHONPATH=. python benchmarks/replay_refactor_check.py RUN_DIR... --out /tmp/after.json
    python benchmarks/replay_refactor_check.py --compare /tmp/before.json /tmp/after.json

Parameter-server runs (`dprorun --backend mxnet`) get the PS what-ifs (`PS_WHATIFS`, model fitted once per run), and
`--byteps FILE...` adds recorded BytePS comm.json files (every step predicted from the others, as run and with
the stage what-ifs).

The comparison prints every prediction that moved (relative difference over 1e-9) and, last, the largest
difference.
"""
import argparse
import json

WHATIFS = {
    "as run": {}, "bucket 1MB": {"bucket_mb": 1}, "bucket 4MB": {"bucket_mb": 4}, "partitions 2": {"partitions": 2},
    "np 4": {"world_size": 4}, "np 3": {"world_size": 3}, "np 1": {"world_size": 1}, "np 96": {"world_size": 96},
    "1 Gbit": {"bandwidth_gbit": 1.0}, "bandwidth x0.5": {"bandwidth_scale": 0.5},
    "latency 100us": {"latency_us": 100.0}, "1 Gbit + np 4": {"bandwidth_gbit": 1.0, "world_size": 4},
    "1 Gbit + bucket 4MB": {"bandwidth_gbit": 1.0, "bucket_mb": 4},
    "partitions 2 + latency": {"partitions": 2, "latency_us": 50.0},
    "accumulate 2": {"accumulation_steps": 2}, "recompute 2": {"recompute_segments": 2},
    "variant 0.8/0.9": {"forward_scale": 0.8, "backward_scale": 0.9},
    "variant + bucket 4MB": {"forward_scale": 0.8, "backward_scale": 0.9, "bucket_mb": 4},
    "variant + accumulate 2": {"forward_scale": 0.8, "backward_scale": 0.9, "accumulation_steps": 2},
    "variant + recompute 2": {"forward_scale": 0.8, "backward_scale": 0.9, "recompute_segments": 2},
    "accumulate 2 + recompute 2": {"accumulation_steps": 2, "recompute_segments": 2},
    "op scale": {"op_scale": {"aten::linear": 0.5, "*Backward0": 0.7}},
    "op scale + bucket 4MB": {"op_scale": {"aten::linear": 0.5, "*Backward0": 0.7}, "bucket_mb": 4},
    "daydream": {"baseline": "daydream"}, "daydream 1 Gbit": {"baseline": "daydream", "bandwidth_gbit": 1.0},
}

PS_WHATIFS = {
    "as run": {}, "servers 1": {"servers": 1}, "servers 3": {"servers": 3}, "bound 1000": {"bigarray_bound": 1000},
    "bound 100000": {"bigarray_bound": 100000}, "workers 4": {"workers": 4}, "workers 3": {"workers": 3},
    "bandwidth x0.5": {"bandwidth_scale": 0.5}, "1 Gbit": {"bandwidth_gbit": 1.0}, "per-node": {"links": "per-node"},
    "per-node + servers 1": {"links": "per-node", "servers": 1},
    "workers 4 + servers 3 + 1 Gbit": {"workers": 4, "servers": 3, "bandwidth_gbit": 1.0},
}
BYTEPS_WHATIFS = {"as run": None, "push+pull x0.5": {"PUSH": 0.5, "PULL": 0.5}, "reduce x0.5": {"REDUCE": 0.5},
                  "copyd2h x2 + push x0.7": {"COPYD2H": 2.0, "PUSH": 0.7}}


def ps_predictions(run: str) -> dict:
    from dprorun.replay.ps import PSWhatIf, predict_ps
    from dprorun.replay.ps_model import build_ps_model

    model = build_ps_model(run)
    out = {}
    for name, kwargs in PS_WHATIFS.items():
        try:
            times = [predict_ps(model, PSWhatIf(**kwargs)).iteration_ms * 1000]
        except Exception as exc:
            times = f"{type(exc).__name__}: {exc}"
        out[f"{run.rstrip('/').split('/')[-1]} | ps {name}"] = times
    return out


def byteps_predictions(paths: list[str]) -> dict:
    from dprorun.replay.pipeline import predict_steps
    from dprorun.trace.byteps import read_byteps_comm

    out = {}
    for path in paths:
        trace = read_byteps_comm(path)
        for name, scale in BYTEPS_WHATIFS.items():
            out[f"{path.split('/')[-1]} | byteps {name}"] = [p.predicted_us for p in predict_steps(trace, scale)]
    return out


def byteps_machine_predictions(root: str, others: list[str]) -> dict:
    """A machine's files replayed together (the root GPU's first), from constructed or recorded files."""
    from dprorun.replay.pipeline import predict_machine_steps
    from dprorun.trace.byteps import read_byteps_comm

    traces = [read_byteps_comm(path, rank=r) for r, path in enumerate([root, *others])]
    return {f"machine {root.split('/')[-1]} | byteps {name}": [p.predicted_us for p in
                                                             predict_machine_steps(traces[0], traces[1:], scale)]
            for name, scale in BYTEPS_WHATIFS.items()}


def predictions(runs: list[str]) -> dict:
    from dprorun.analysis import RunAnalysis
    from dprorun.replay.engine import replay
    from dprorun.replay.synthesize import synthesize
    from dprorun.replay.whatif import WhatIf

    from dprorun.replay.ps_model import is_ps_run

    out = {}
    for run in runs:
        if is_ps_run(run):
            out.update(ps_predictions(run))
            continue
        model = RunAnalysis(run).model
        for name, kwargs in WHATIFS.items():
            for detail in ("ops", "coarse"):
                try:
                    times = [replay(synthesize(model, WhatIf(**kwargs), [], sample, detail=detail)).iteration_time_us
                             for sample in [None] + model.samples[:2]]
                except Exception as exc:  # a what-if the run cannot answer: both checkouts must say so alike
                    times = f"{type(exc).__name__}: {exc}"
                out[f"{run.rstrip('/').split('/')[-1]} | {name} | {detail}"] = times
    return out


def compare(before: dict, after: dict) -> float:
    print(f"{'prediction':60s} {'before ms':>10s} {'after ms':>10s} {'diff %':>10s}")
    worst = 0.0
    for key in before:
        a, b = before[key], after.get(key)
        if isinstance(a, str) or isinstance(b, str) or b is None:
            if a != b:
                print(f"{key:60s} {str(a)[:30]:>10s} {str(b)[:30]:>10s}")
                worst = float("inf")
            continue
        diff = max(abs(x - y) / x for x, y in zip(a, b))
        worst = max(worst, diff)
        if diff > 1e-9:
            print(f"{key:60s} {a[0] / 1000:10.3f} {b[0] / 1000:10.3f} {100 * diff:10.6f}")
    print(f"{len(before)} predictions x {len(next(iter(before.values())))} replays; largest difference: "
          f"{100 * worst:.2e} %")
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*")
    parser.add_argument("--byteps", nargs="*", default=[], metavar="COMM_JSON")
    parser.add_argument("--byteps-machine", nargs="*", default=[], metavar="COMM_JSON",
                        help="one machine's files, the root GPU's first")
    parser.add_argument("--out")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        with open(args.compare[0]) as a, open(args.compare[1]) as b:
            compare(json.load(a), json.load(b))
        return
    doc = predictions(args.runs)
    doc.update(byteps_predictions(args.byteps))
    if args.byteps_machine:
        doc.update(byteps_machine_predictions(args.byteps_machine[0], args.byteps_machine[1:]))
    with open(args.out, "w") as handle:
        json.dump(doc, handle)
    print(f"{len(doc)} predictions written to {args.out}")


if __name__ == "__main__":
    main()
