"""GPU path check: real DDP jobs on a GPU under dprorun, side by side with unprofiled torchrun runs.

What it checks (one machine, one GPU is enough):
  * CUPTI kernels: the Kineto trace of each rank holds GPU kernels on CUDA streams, NCCL kernels for NCCL jobs
  * NVML: samples carry GPU utilisation/memory (or the recorded reason they do not)
  * peak memory: estimated vs torch.cuda.max_memory_allocated
  * replay: predicted iteration time (dpro replay) vs the measured median of unprofiled torchrun runs
    (--rounds interleaved torchrun / dprorun pairs per configuration, medians), with the replay's self-check
    against the run's own clean iterations and its p10-p90 spread
  * window overhead: the profiled window's iterations (CUPTI on in its first iterations) and the clean ones
    after the window (CUPTI torn down) against torchrun
  * the critical path's top ops (which kernels / ops gate the iteration), the alignment's uncertainty
Configurations: NCCL with one rank per GPU (as many ranks as GPUs), and 2 ranks sharing one GPU over gloo
(gloo all-reduces CUDA tensors through host copies; NCCL refuses two ranks on one GPU). With one GPU the NCCL
rows are single-rank jobs: the 2-rank gloo row is the distributed check, said in the output.

A time budget (--budget-s, default 400 s) is checked before each step: a step that would not fit is skipped
and said; every finished reading is written to --json-out after each configuration, so a run cut short keeps
what it measured.

usage: python benchmarks/gpu_check.py [--keep DIR] [--steps 120] [--rounds 2] [--budget-s 400]
Prints a table; last line: the median replay error over the configurations.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def figures(row: dict) -> dict:
    """The table's figures from one configuration's readings (also what the tests check on a recorded run)."""
    replay = row.get("replay") or {}
    summary = row.get("summary") or {}
    measured = row.get("measured_ms")
    predicted = replay.get("predicted_iteration_time_ms")
    window, clean = summary.get("iteration_time_ms"), summary.get("clean_iteration_time_ms")
    mem = (row.get("memory") or [{}])[0]

    def pct(a, b):
        return round(100 * (a / b - 1), 2) if a and b else None
    rank0 = (row.get("ranks") or {}).get(0) or (row.get("ranks") or {}).get("0") or {}
    top = ((replay.get("critical_path") or {}).get("top") or [])[:5]
    return {"replay_error_pct": pct(predicted, measured), "window_vs_torchrun_pct": pct(window, measured),
            "clean_vs_torchrun_pct": pct(clean, measured), "kineto_overhead_pct": summary.get("kineto_overhead_pct"),
            "memory_error_pct": mem.get("error_pct"), "gpu_ops": rank0.get("gpu_ops", 0),
            "nccl_kernels": rank0.get("nccl_kernels", 0), "gpu_samples": rank0.get("gpu_samples", 0),
            "self_check": (replay.get("self_check") or {}).get("status"), "spread_ms": replay.get("spread_ms"),
            "critical_path_top": [r.get("op") for r in top],
            "max_uncertainty_us": (replay.get("alignment") or {}).get("max_uncertainty_us"),
            "tracker_backends": row.get("tracker_backends")}


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    started = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env=dict(os.environ, KINETO_LOG_LEVEL="6", PYTHONPATH=REPO + os.pathsep +
                                   os.environ.get("PYTHONPATH", "")))
    print(f"$ {' '.join(cmd)}  -> rc {proc.returncode} in {time.time() - started:.1f}s", flush=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", flush=True)
    return proc


def measured_ms(example: str, nproc: int, backend: str, steps: int) -> float | None:
    proc = run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                os.path.join(REPO, "examples", f"{example}.py"), "--steps", str(steps), "--backend", backend], 300)
    found = re.search(r"median iteration time: ([0-9.]+) ms", proc.stdout)
    return float(found.group(1)) if found else None


def profile(example: str, nproc: int, backend: str, steps: int, run_dir: str) -> bool:
    warmup, clean = steps // 2, max(5, steps // 8)
    active = steps - warmup - clean - 2
    proc = run([sys.executable, "-m", "dprorun.cli", "-np", str(nproc), "--run-dir", run_dir, "--warmup", str(warmup),
                "--active", str(active), "--clean", str(clean), "python",
                os.path.join(REPO, "examples", f"{example}.py"), "--steps", str(steps), "--backend", backend], 300)
    print(proc.stdout[-2500:], flush=True)
    return proc.returncode == 0


def inspect(run_dir: str) -> dict:
    """What the GPU paths recorded, read through the trace model every stage uses."""
    from dprorun.memory import run_memory
    from dprorun.trace.rundir import load_run

    run = load_run(run_dir)
    ranks = {}
    for rank, trace in sorted(run.ranks.items()):
        gpu_ops = [op for op in trace.ops if op.stream.startswith("cuda:")]
        gpu_samples = [s for s in trace.samples if s.source.startswith("gpu")]
        ranks[rank] = {
            "gpu_ops": len(gpu_ops),
            "gpu_streams": sorted({op.stream for op in gpu_ops}),
            "nccl_kernels": sum("nccl" in op.name.lower() for op in gpu_ops),
            "comm_ops": sum(op.kind.value == "COMM" for op in trace.ops),
            "memcpy_ops": sum(op.name.startswith("Memcpy") for op in gpu_ops),
            "nvml": trace.meta.get("nvml_status"),
            "gpu_samples": len(gpu_samples),
            "gpu_sample_keys": sorted({k for s in gpu_samples for k in s.values}),
            "warnings": trace.warnings[:5],
        }
    memory = run_memory(run)
    replay = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", run_dir, "--json"],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    predicted = json.loads(replay.stdout) if replay.returncode == 0 else {"error": replay.stderr[-2000:]}
    with open(os.path.join(run_dir, "summary.json")) as handle:
        summary = json.load(handle)
    backends = sorted({str(t.get("backend")) for trace in run.ranks.values() for t in trace.meta.get("trackers", [])})
    return {"ranks": ranks, "memory": memory, "replay": predicted, "summary": summary, "tracker_backends": backends}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", default="", help="keep the run directories here")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--json-out", default="", help="write every reading here")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved torchrun / dprorun pairs per config")
    parser.add_argument("--budget-s", type=float, default=400.0, help="skip steps that would pass this budget")
    parser.add_argument("--rehearse-on-cpu", action="store_true",
                        help="without a GPU: run the same steps over gloo on the CPU (checks this script only)")
    args = parser.parse_args()
    import torch

    if torch.cuda.is_available():
        gpus, nccl = torch.cuda.device_count(), "nccl"
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {gpus} x {torch.cuda.get_device_name(0)}, "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    elif args.rehearse_on_cpu:
        gpus, nccl = 1, "gloo"
    else:
        print("no GPU: nothing to check (this benchmark needs CUDA; --rehearse-on-cpu checks the script)")
        return
    # the last: init_process_group() without a backend (torch picks NCCL for CUDA tensors at the first collective;
    # session 47's reading of such a group: the trackers should record "nccl", the calibration run on the GPU)
    configs = [("resnet_small", 2, "gloo"), ("transformer_small", gpus, nccl), ("embedding_adam", gpus, nccl),
               ("resnet_small", gpus, nccl), ("mlp_many_layers", gpus, nccl), ("mlp_many_layers", gpus, "none")]
    if gpus == 1:
        print("one GPU: the 2-rank job is gloo over CUDA tensors (NCCL refuses two ranks on one GPU); the NCCL "
              "rows are single-rank jobs", flush=True)
    keep = args.keep or tempfile.mkdtemp(prefix="dpro_gpu_")
    results = []
    started = time.time()
    step_cost: dict[str, float] = {}

    def fits(what: str) -> bool:
        left = args.budget_s - (time.time() - started)
        if left < step_cost.get(what, 30.0) * 1.2:
            print(f"budget: {left:.0f} s left, skipping {what}", flush=True)
            return False
        return True

    for example, nproc, backend in configs:
        name = f"{example}_np{nproc}_{backend}"
        row = {"config": name, "measured_runs_ms": [], "profiles": 0}
        profiled_dir = None
        for k in range(args.rounds):  # interleaved: torchrun, dprorun, torchrun, ...
            if fits("torchrun"):
                t = time.time()
                value = measured_ms(example, nproc, backend, args.steps)
                step_cost["torchrun"] = time.time() - t
                if value is not None:
                    row["measured_runs_ms"].append(value)
            run_dir = os.path.join(keep, f"{name}_r{k}")
            if fits("dprorun"):
                t = time.time()
                if profile(example, nproc, backend, args.steps, run_dir):
                    profiled_dir = run_dir
                    row["profiles"] += 1
                step_cost["dprorun"] = time.time() - t + 10.0
        if profiled_dir is not None:
            try:
                row.update(inspect(profiled_dir))
            except Exception as exc:  # report and go on: one broken reading must not lose the others
                row["error"] = f"{type(exc).__name__}: {exc}"
        row["measured_ms"] = statistics.median(row["measured_runs_ms"]) if row["measured_runs_ms"] else None
        row["figures"] = figures(row)
        results.append(row)
        print(json.dumps(row["figures"], default=str), flush=True)
        if args.json_out:  # after every configuration: a run cut short keeps what it measured
            with open(args.json_out, "w") as handle:
                json.dump(results, handle, indent=1, default=str)
    print(f"\n{'config':32} {'torchrun':>9} {'dPRO':>8} {'err':>7} {'window':>7} {'clean':>7} {'kernels':>8} "
          f"{'nccl':>5} {'nvml':>5} {'mem est':>9} {'mem meas':>9}  self-check / critical path")
    errors = []
    for row in results:
        predicted = (row.get("replay") or {}).get("predicted_iteration_time_ms")
        measured = row.get("measured_ms")
        err = (predicted - measured) / measured * 100 if predicted and measured else None
        if err is not None:
            errors.append(abs(err))
        rank0 = (row.get("ranks") or {}).get(0, {})
        mem0 = (row.get("memory") or [{}])[0]
        fig = row["figures"]
        window = fig["window_vs_torchrun_pct"]
        clean = fig["clean_vs_torchrun_pct"]
        print(f"{row['config']:32} {measured or float('nan'):9.3f} {predicted or float('nan'):8.3f} "
              f"{err if err is not None else float('nan'):+6.1f}% "
              f"{window if window is not None else float('nan'):+6.1f}% "
              f"{clean if clean is not None else float('nan'):+6.1f}% {rank0.get('gpu_ops', 0):8d} "
              f"{rank0.get('nccl_kernels', 0):5d} {rank0.get('gpu_samples', 0):5d} "
              f"{(mem0.get('estimated_peak_bytes') or 0) / 2**20:8.1f}M {(mem0.get('measured_peak_bytes') or 0) / 2**20:8.1f}M"
              f"  {fig['self_check']} / {', '.join(str(op) for op in fig['critical_path_top'][:3])}")
    print(f"median |replay error| on GPU: {statistics.median(errors):.1f} % over {len(errors)} configurations"
          if errors else "median |replay error| on GPU: no configuration produced both numbers")


if __name__ == "__main__":
    main()
