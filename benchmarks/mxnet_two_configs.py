"""A PS what-if against a profile of its own configuration: which fitted cost moves with the number of servers.

For each model, --reps interleaved rounds of: the plain launches at A (2 servers) and at B (--b-servers, 1 by
default; or A with --b-bound's MXNET_KVSTORE_BIGARRAY_BOUND), then a `dprorun --backend mxnet` profile at each.
Reported (medians over rounds):
  measured   the plain launches' B / A
  what-if    profile A replayed as run and as B (the what-if), as a ratio
  as run     profile B replayed as run, over profile A replayed as run (each fitted to its own run)
  swaps      profile A's what-if with one group of B's fitted costs put in place of A's: the links (alpha,
             bandwidth, level), the compute (the profiled ops and their scale), the servers (update, merge and
             response copies): the group that brings the what-if to B's own as-run replay is what the what-if
             does not predict
  costs      each profile's fitted costs side by side
  vs plain   each profile's as-run replay against the plain launches of its configuration, paired per round (the
             replay is fitted to the profiled run's own iterations: how far those were from a launch without dprorun)
The last line: the what-if's ratio error, and the swap that closes most of it.

usage: python benchmarks/mxnet_two_configs.py [--models conv] [--b-servers 1 | --b-bound 100000] [--reps 3]
       [--keep DIR | --from DIR[,DIR]]
       python benchmarks/mxnet_two_configs.py --multihost KEEP_A,KEEP_B   (two `mxnet_multihost.py --keep` runs at
       two server counts per host, paired round by round: the same analysis across hosts)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import replace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mxnet_replay_accuracy as bench  # noqa: E402  (the launches: plain and profiled)

from dprorun.layout import MX_PROFILE_FILE, rank_dir  # noqa: E402
from dprorun.replay.ps import PSWhatIf, predict_ps  # noqa: E402
from dprorun.replay.ps_model import build_ps_model  # noqa: E402
from dprorun.trace.mxprofile import comm_phases, read_mx_profile  # noqa: E402

# the fitted costs, by group: what a swap puts from profile B into profile A's model
GROUPS = {"links": ("alpha_us", "bytes_per_us", "link_level", "link_slots"),
          "compute": ("worker_ops", "compute_scale"),
          "servers": ("update_us", "copy_us", "add_us")}


def launch_round(model: str, b_servers: int, b_bound: int | None, keep: str, rep: int) -> dict:
    """One round: the plain launches at A and B, then a profile at each; returns its record."""
    plain = {"A": bench.plain_ms(model, 2, "loopback"), "B": bench.plain_ms(model, b_servers, "loopback", b_bound)}
    dirs = {}
    for label, servers, bound in (("A", 2, None), ("B", b_servers, b_bound)):
        dirs[label] = os.path.join(keep, f"{model}-{rep}-{label}")
        bench.profile(model, "loopback", dirs[label], servers=servers, bound=bound)
    return {"model": model, "plain": plain, "dirs": dirs, "b_servers": b_servers, "b_bound": b_bound}


def comm_span_ms(run_dir: str) -> float:
    """Worker 0's profiled iterations: the median span from the first push's start to the last pull's end."""
    ops = read_mx_profile(os.path.join(rank_dir(run_dir, 0), MX_PROFILE_FILE))
    spans = [max(op.end_us for op in g) - min(op.start_us for op in g)
             for g in comm_phases([op for op in ops if op.is_kvstore], ops)]
    return statistics.median(spans[1:] or spans) / 1000


def multihost_records(keep_a: str, keep_b: str) -> list[dict]:
    """Records of two `mxnet_multihost.py --keep` runs paired round by round (node 0's run directories)."""
    runs = []
    for keep in (keep_a, keep_b):
        with open(os.path.join(keep, "rounds.json")) as handle:
            runs.append(json.load(handle))
    a, b = runs
    hosts = 2  # mxnet_multihost.py's two emulated hosts (emu0, emu1)
    return [{"model": f"{a['model']}, 2 hosts", "plain": {"A": x["plain"], "B": y["plain"]},
             "dirs": {"A": x["run_dir"], "B": y["run_dir"]}, "b_servers": b["servers"] * hosts, "b_bound": None}
            for x, y in zip(a["rounds"], b["rounds"])]


def analyse(record: dict) -> dict:
    """The replays and swaps of one round's two profiles (ms, and the fitted costs)."""
    a, b = (build_ps_model(record["dirs"][label]) for label in ("A", "B"))
    whatif = PSWhatIf(servers=record["b_servers"]) if not record["b_bound"] else \
        PSWhatIf(bigarray_bound=record["b_bound"])
    out = {"A as run": predict_ps(a).iteration_ms, "A as B": predict_ps(a, whatif).iteration_ms,
           "B as run": predict_ps(b).iteration_ms}
    for group, fields in GROUPS.items():
        swapped = replace(a, **{name: getattr(b, name) for name in fields})
        out[f"A as B, {group} of B"] = predict_ps(swapped, whatif).iteration_ms
    out["costs"] = {label: {"alpha_us": m.alpha_us, "gbit_s": m.bytes_per_us * 8e-3, "level": m.link_level,
                            "compute_scale": m.compute_scale,
                            "compute_ms": sum(t for w in m.worker_ops.values() for _, t in w.ops)
                            / max(len(m.worker_ops), 1) / 1000,
                            "update_us_per_mb": m.update_us[1] * 1e6, "update_us": m.update_us[0],
                            "measured_ms": (m.measured_iteration_us or 0) / 1000,
                            "profiled_ms": (m.profiled_iteration_us or 0) / 1000,
                            "push_pull_span_ms": comm_span_ms(record["dirs"][label])}
                    for label, m in (("A", a), ("B", b))}
    return out


def report(records: list[dict]) -> None:
    by_model: dict[str, list[dict]] = {}
    for r in records:
        by_model.setdefault(r["model"], []).append(r)
    last = []
    for model, group in by_model.items():
        med = statistics.median
        measured = med(r["plain"]["B"] / r["plain"]["A"] for r in group)
        base = [r["replays"]["A as run"] for r in group]
        print(f"\n{model}: {len(group)} rounds; plain A {med(r['plain']['A'] for r in group):.2f} ms, "
              f"B {med(r['plain']['B'] for r in group):.2f} ms (B / A per round: "
              + ", ".join(f"{r['plain']['B'] / r['plain']['A']:.3f}" for r in group) + ")")
        print(f"{'replay of':34} {'ms':>8} {'/ A as run':>10} {'vs measured B/A %':>18}")
        rows = [k for k in group[0]["replays"] if k != "costs"]
        errors = {}
        for key in rows:
            ratio = med(r["replays"][key] / a for r, a in zip(group, base))
            errors[key] = 100 * (ratio / measured - 1)
            print(f"{key:34} {med(r['replays'][key] for r in group):8.2f} {ratio:10.3f} {errors[key]:+18.1f}")
        as_run = {label: [r["replays"][f"{label} as run"] / r["plain"][label] for r in group] for label in ("A", "B")}
        print("as run against the plain launches (paired per round): " + ", ".join(
            f"{label} {100 * (med(v) - 1):+.1f} % (per round {100 * (min(v) - 1):+.0f} to {100 * (max(v) - 1):+.0f})"
            for label, v in as_run.items()))
        print(f"\n{'fitted cost':18} {'A':>10} {'B':>10}")
        for name in group[0]["replays"]["costs"]["A"]:
            print(f"{name:18} {med(r['replays']['costs']['A'][name] for r in group):10.3f} "
                  f"{med(r['replays']['costs']['B'][name] for r in group):10.3f}")
        swaps = {k: abs(v) for k, v in errors.items() if k.startswith("A as B, ")}
        best = min(swaps, key=swaps.get)
        last.append(f"{model}: what-if {errors['A as B']:+.1f} % of the measured B/A, B's own profile "
                    f"{errors['B as run']:+.1f} %, closest swap '{best[len('A as B, '):]}' {errors[best]:+.1f} %")
    print("\n" + "; ".join(last))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="conv")
    parser.add_argument("--b-servers", type=int, default=1)
    parser.add_argument("--b-bound", type=int, default=None, help="B: 2 servers with this big-array bound")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=bench.STEPS)
    parser.add_argument("--keep", default=None, metavar="DIR")
    parser.add_argument("--from", dest="kept", default=None, metavar="DIR[,DIR...]")
    parser.add_argument("--multihost", default=None, metavar="KEEP_A,KEEP_B",
                        help="pair the rounds of two `mxnet_multihost.py --keep` runs (A: more servers per host, B: "
                             "fewer), round by round, instead of launching")
    args = parser.parse_args()
    bench.STEPS = args.steps
    records = []
    if args.multihost:
        records = multihost_records(*args.multihost.split(","))
    elif args.kept:
        for kept in args.kept.split(","):
            with open(os.path.join(kept, "rounds.json")) as handle:
                records += json.load(handle)
    else:
        keep = os.path.abspath(args.keep) if args.keep else tempfile.mkdtemp(prefix="two_configs_")
        os.makedirs(keep, exist_ok=True)
        b_servers = 2 if args.b_bound else args.b_servers
        for model in args.models.split(","):
            for rep in range(args.reps):
                records.append(launch_round(model, b_servers, args.b_bound, keep, rep))
                with open(os.path.join(keep, "rounds.json"), "w") as handle:
                    json.dump(records, handle, indent=1)
    for r in records:
        r["replays"] = analyse(r)
    report(records)


if __name__ == "__main__":
    main()
