"""GPU path check: real DDP jobs on a GPU under dprorun, side by side with unprofiled torchrun runs.

What it checks (one machine, one GPU is enough):
  * CUPTI kernels: the Kineto trace of each rank holds GPU kernels on CUDA streams, NCCL kernels for NCCL jobs
  * NVML: samples carry GPU utilisation/memory (or the recorded reason they do not)
  * peak memory: estimated vs torch.cuda.max_memory_allocated
  * replay: predicted iteration time (dpro replay) vs the measured median of an unprofiled torchrun run
Configurations: NCCL with one rank per GPU (as many ranks as GPUs), and 2 ranks sharing one GPU over gloo
(gloo all-reduces CUDA tensors through host copies; NCCL refuses two ranks on one GPU).

usage: python benchmarks/gpu_check.py [--keep DIR] [--steps 120]
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
    return {"ranks": ranks, "memory": memory, "replay": predicted, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", default="", help="keep the run directories here")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--json-out", default="", help="write every reading here")
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
    configs = [("resnet_small", gpus, nccl), ("transformer_small", gpus, nccl),
               ("mlp_many_layers", gpus, nccl), ("resnet_small", 2, "gloo")]
    keep = args.keep or tempfile.mkdtemp(prefix="dpro_gpu_")
    results = []
    for example, nproc, backend in configs:
        name = f"{example}_np{nproc}_{backend}"
        run_dir = os.path.join(keep, name)
        row = {"config": name, "measured_ms": measured_ms(example, nproc, backend, args.steps)}
        if profile(example, nproc, backend, args.steps, run_dir):
            try:
                row.update(inspect(run_dir))
            except Exception as exc:  # report and go on: one broken reading must not lose the others
                row["error"] = f"{type(exc).__name__}: {exc}"
        results.append(row)
        print(json.dumps(row, default=str)[:4000], flush=True)
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(results, handle, indent=1, default=str)
    print(f"\n{'config':32} {'torchrun':>9} {'dPRO':>8} {'err':>7} {'kernels':>8} {'nccl':>5} {'nvml':>5} "
          f"{'mem est':>9} {'mem meas':>9}")
    errors = []
    for row in results:
        predicted = (row.get("replay") or {}).get("predicted_iteration_time_ms")
        measured = row.get("measured_ms")
        err = (predicted - measured) / measured * 100 if predicted and measured else None
        if err is not None:
            errors.append(abs(err))
        rank0 = (row.get("ranks") or {}).get(0, {})
        mem0 = (row.get("memory") or [{}])[0]
        print(f"{row['config']:32} {measured or float('nan'):9.3f} {predicted or float('nan'):8.3f} "
              f"{err if err is not None else float('nan'):+6.1f}% {rank0.get('gpu_ops', 0):8d} "
              f"{rank0.get('nccl_kernels', 0):5d} {rank0.get('gpu_samples', 0):5d} "
              f"{(mem0.get('estimated_peak_bytes') or 0) / 2**20:8.1f}M {(mem0.get('measured_peak_bytes') or 0) / 2**20:8.1f}M")
    print(f"median |replay error| on GPU: {statistics.median(errors):.1f} % over {len(errors)} configurations"
          if errors else "median |replay error| on GPU: no configuration produced both numbers")


if __name__ == "__main__":
    main()
