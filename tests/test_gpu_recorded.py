"""GPU paths on a run directory that dprorun itself recorded on a GPU machine (one NVIDIA H200, torch 2.11+cu130,
`benchmarks/gpu_check.py`): resnet_small, 2 ranks sharing the GPU over gloo (gloo all-reduces CUDA tensors
through host copies). Rank logs were left out; everything else is as written at job end.

These inputs cannot be made on a machine without a GPU, so the readers, memory model and replayer are checked on
them here: CUPTI kernels and memcpys on CUDA streams, NVML samples, CUDA memory, replay of a GPU job."""
import json
import os
import subprocess
import sys
import tarfile

import pytest

from conftest import REPO
from dprorun.memory import run_memory
from dprorun.replay.predict import predict_run
from dprorun.summary import summarize
from dprorun.trace.rundir import load_run

ARCHIVE = os.path.join(REPO, "tests", "data", "gpu_h200_resnet_small_np2_gloo.tgz")


@pytest.fixture(scope="module")
def gpu_run_dir(tmp_path_factory):
    target = tmp_path_factory.mktemp("gpu_run")
    with tarfile.open(ARCHIVE) as archive:
        archive.extractall(target, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return str(target)


def test_cupti_kernels_and_memcpys_are_read_per_cuda_stream(gpu_run_dir):
    run = load_run(gpu_run_dir)
    assert sorted(run.ranks) == [0, 1] and not run.problems
    for trace in run.ranks.values():
        gpu_ops = [op for op in trace.ops if op.stream.startswith("cuda:0/")]
        assert len(gpu_ops) > 500
        assert all(op.device == "cuda:0" and op.source == "kineto" and op.end_us >= op.start_us for op in gpu_ops)
        names = {op.name for op in gpu_ops}
        # gloo on CUDA tensors: device-to-host and host-to-device copies around each all-reduce
        assert any(n.startswith("Memcpy DtoH") for n in names) and any(n.startswith("Memcpy HtoD") for n in names)
        assert any("gemm" in n or "conv" in n.lower() for n in names)
        # kernels belong to the profiled iterations the CPU side ran
        assert {op.iteration for op in gpu_ops} - {-1} <= set(trace.profiled_iterations)
        comm = [op for op in trace.ops if op.kind.value == "COMM" and op.tensor == "bucket0"]
        assert comm and all(op.nbytes == 608104 for op in comm)


def test_nvml_samples_of_the_gpu(gpu_run_dir):
    run = load_run(gpu_run_dir)
    for trace in run.ranks.values():
        assert trace.meta["nvml_status"] == "ok: gpu0 NVIDIA H200"
        gpu = [s for s in trace.samples if s.source == "gpu"]
        assert len(gpu) >= 5
        assert all({"gpu_util_pct", "mem_used_bytes", "power_w"} <= set(s.values) for s in gpu)
        assert max(s.values["mem_used_bytes"] for s in gpu) > 0


def test_cuda_peak_memory_estimate_within_5_percent(gpu_run_dir):
    """Before the steady-memory part (cuBLAS workspaces etc.) the estimate was 83 % below the measured peak."""
    rows = run_memory(load_run(gpu_run_dir))
    for row in rows:
        assert row["device"] == "cuda" and row["complete"]
        assert row["parts"]["other_steady"] > 32 * 2 ** 20  # cuBLAS workspaces of a Hopper GPU
        assert abs(row["error_pct"]) <= 5.0, row


def test_replay_of_the_gpu_job_matches_its_measured_iteration(gpu_run_dir):
    run = load_run(gpu_run_dir)
    measured = summarize(run)["iteration_time_ms"]
    predicted = predict_run(run).predicted_iteration_time_ms
    assert abs(predicted / measured - 1) <= 0.05, (predicted, measured)


def test_dpro_cli_on_the_gpu_run(gpu_run_dir, tmp_path):
    out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "summary", gpu_run_dir, "--json"],
                         capture_output=True, text=True, check=True, timeout=120)
    doc = json.loads(out.stdout)
    assert doc["world_size"] == 2 and all(m["device"] == "cuda" for m in doc["memory"])
    timeline = tmp_path / "trace.json"
    subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "timeline", gpu_run_dir, "-o", str(timeline)],
                   capture_output=True, text=True, check=True, timeout=120)
    events = json.loads(timeline.read_text())["traceEvents"]
    threads = {e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    assert any(t.startswith("cuda:0/") for t in threads)
    # dpro replay of a GPU run also replays its profiled steps at kernel level, on the run's alignment (one read)
    out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", gpu_run_dir],
                         capture_output=True, text=True, check=True, timeout=300)
    line = next(x for x in out.stdout.splitlines() if x.startswith("kernel level: 3 profiled step(s)"))
    assert "median |error| 1." in line or "median |error| 2." in line, line


def test_gpu_check_figures_on_the_recorded_run(gpu_run_dir):
    """benchmarks/gpu_check.py's own logic (readings and the table's figures) on the recorded GPU run, with a
    stand-in torchrun median: what a lent GPU would print is computed by the same code."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        from gpu_check import figures, inspect
    finally:
        sys.path.pop(0)
    row = {"config": "recorded", "measured_ms": 10.0}
    row.update(inspect(gpu_run_dir))
    fig = figures(row)
    predicted = row["replay"]["predicted_iteration_time_ms"]
    assert fig["replay_error_pct"] == pytest.approx(100 * (predicted / 10.0 - 1), abs=0.01)
    assert fig["gpu_ops"] > 500 and fig["gpu_samples"] >= 5
    assert abs(fig["memory_error_pct"]) <= 5.0
    assert fig["self_check"] in ("agrees", "uncertain", "disagrees", "unchecked") and len(fig["spread_ms"]) == 2
    assert fig["critical_path_top"] and fig["window_vs_torchrun_pct"] is not None
    assert fig["tracker_backends"] and "undefined" not in fig["tracker_backends"]  # the transport each recorded


def test_the_two_gpu_ranks_replay_as_one_kernel_level_graph(gpu_run_dir):
    """`dpro import-kineto RUN_DIR`: both ranks' CPU threads, CUDA runtime calls and GPU streams in one graph per
    profiled step, joined through gloo's collectives on its worker threads (their exchange: after the copy to the
    host has been synchronized), on the run's own clock offsets. The steady steps replay within 5 % and the time
    rank 1 waited for rank 0 in the collectives comes back within 0.2 ms."""
    out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "import-kineto", gpu_run_dir, "--json"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    rows = {row["step"]: row for row in doc["steps"]}
    assert set(rows) == {60, 61, 62} and "step 63" in doc["skipped"][0]  # 63: the profiler's cut-short last step
    for step in (61, 62):
        row = rows[step]
        assert row["collectives"] == 3  # two buffer broadcasts and the gradients' all-reduce
        assert row["replayed_ms"] == pytest.approx(row["measured_ms"], rel=0.05)
        waited = row["waited_in_collectives_ms"]
        assert waited["measured"][1] > 0.5  # rank 1 waited for rank 0 ...
        assert waited["replayed"][1] == pytest.approx(waited["measured"][1], abs=0.2)  # ... and does in the replay
        assert any("clocks from the run's alignment" in n for n in row["notes"])
    path = [item["op"] for item in rows[62]["critical_path"]["top"]]
    assert any(op.startswith("r0.") for op in path) and any(op.startswith("r1.") for op in path)
