"""The kernel-level local DFG (graph/kernels.py): CPU threads, CUDA runtime calls and GPU streams of one profiled
step, on a real recorded GPU DDP trace (../shared/fixtures) and on constructed traces whose timing is known."""
import json
import subprocess
import sys

import pytest

from conftest import fixture_path
from dprorun.graph.kernels import activity_of_step, kernel_dfg, replay_step
from dprorun.replay.engine import replay
from dprorun.trace.kineto import read_kineto

PID = 100


def constructed_trace(path, kernels=20, kernel_us=100.0, launch_every_us=10.0, nccl=True):
    """A GPU-bound step: the main thread launches `kernels` matmuls back to back (a 5 us cudaLaunchKernel each),
    then (with `nccl`) waits on the NCCL stream for the compute stream and launches an all-reduce kernel, then
    blocks in cudaDeviceSynchronize until the GPU is done."""
    events, t, gpu_free, corr = [], 10.0, 0.0, 1
    cpu = lambda name, a, b: {"ph": "X", "cat": "cpu_op", "name": name, "pid": PID, "tid": PID, "ts": a, "dur": b - a}
    runtime = lambda name, a, b, c: {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": PID, "tid": PID,
                                     "ts": a, "dur": b - a, "args": {"correlation": c}}
    kernel = lambda name, a, d, c, stream: {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream,
                                            "ts": a, "dur": d, "args": {"correlation": c, "stream": stream,
                                                                        "device": 0}}
    for _ in range(kernels):
        events.append(cpu("aten::mm", t, t + launch_every_us))
        events.append(runtime("cudaLaunchKernel", t + 2, t + 7, corr))
        start = max(t + 9, gpu_free)
        events.append(kernel("ampere_sgemm_128x64_nn", start, kernel_us, corr, 7))
        gpu_free = start + kernel_us
        t += launch_every_us
        corr += 1
    if nccl:
        events.append(cpu("c10d::allreduce_", t, t + 20))
        events.append(runtime("cudaStreamWaitEvent", t + 2, t + 4, corr))
        corr += 1
        events.append(runtime("cudaLaunchKernel", t + 10, t + 15, corr))
        start = gpu_free + 3.0  # after the compute stream's last kernel
        events.append(kernel("ncclKernel_AllReduce_RING_LL_Sum_float", start, 300.0, corr, 40))
        gpu_free = start + 300.0
        corr += 1
        t += 20
    sync_end = max(gpu_free, t + 1) + 4.0
    events.append(cpu("aten::item", t, sync_end + 2))
    events.append(runtime("cudaDeviceSynchronize", t + 1, sync_end, corr))
    step_end = sync_end + 10
    events.append({"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": PID, "tid": PID,
                   "ts": 0.0, "dur": step_end})
    with open(path, "w") as handle:
        json.dump({"traceEvents": events, "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 2}},
                  handle)
    return str(path), step_end


def test_a_gpu_bound_step_replays_and_answers_kernel_what_ifs(tmp_path):
    path, step_us = constructed_trace(tmp_path / "trace.json")
    trace = read_kineto(path)
    as_run = replay_step(trace, 1)
    # the NCCL kernel's 3 us after the event it waits for is not modelled (no cross-stream latency)
    assert as_run.replayed_us == pytest.approx(step_us, abs=5.0)
    assert as_run.start_error_us < 1.0  # every kernel starts where the launches, stream order and waits put it
    dfg = kernel_dfg(activity_of_step(trace, 1))
    assert "1 runtime calls waited for the GPU, 1 stream waits linked" in dfg.notes
    path_names = [dfg.graph.names[n] for n in replay(dfg.graph).critical_path]
    assert any("ampere_sgemm" in n for n in path_names) and any("ncclKernel" in n for n in path_names)
    # GPU-bound: halving the matmul kernels saves about half their 2 ms; halving the CPU ops saves little
    faster_kernels = replay_step(trace, 1, {"ampere_sgemm*": 0.5}).replayed_us
    assert step_us - faster_kernels == pytest.approx(20 * 50.0, rel=0.05)
    faster_cpu = replay_step(trace, 1, {"aten::mm": 0.5}).replayed_us
    assert step_us - faster_cpu < 0.05 * step_us


def test_a_cpu_bound_step_gains_nothing_from_faster_kernels(tmp_path):
    path, step_us = constructed_trace(tmp_path / "trace.json", kernel_us=4.0, launch_every_us=50.0, nccl=False)
    trace = read_kineto(path)
    assert replay_step(trace, 1).replayed_us == pytest.approx(step_us, abs=1.0)
    assert replay_step(trace, 1, {"ampere_sgemm*": 0.5}).replayed_us == pytest.approx(step_us, rel=0.01)
    assert replay_step(trace, 1, {"aten::mm": 0.5}).replayed_us < 0.6 * step_us


def test_the_recorded_gpu_ddp_step_is_explained_by_its_launches_and_streams():
    trace = read_kineto(fixture_path("kineto-gpu", "nccl_parser_config_nccl_data.json.gz"))
    for step, a, b in trace.steps:
        result = replay_step(trace, step)
        assert result.replayed_us == pytest.approx(b - a, rel=0.01)
        assert result.start_error_us < 5.0  # median over ~1,250 GPU ops per step (0.5 us when recorded)
        assert set(result.gpu_busy_us) == {"rank0.cuda:0/s7", "rank0.cuda:0/s40"}
    dfg = kernel_dfg(activity_of_step(trace, 5))
    kinds = dfg.graph.stats()["kinds"]
    assert kinds["COMM"] >= 5 and kinds["BW"] > 1000  # NCCL kernels; backward kernels and the autograd thread
    names = [dfg.graph.names[n] for n in replay(dfg.graph).critical_path]
    assert any("evaluate_function" in n for n in names)  # through the autograd engine's thread, not a wait
    # CPU-bound (39 ms of kernels in a 220 ms step): halving every kernel changes little, the CPU ops a lot
    step = replay_step(trace, 5).replayed_us
    kernels = replay_step(trace, 5, {"*Kernel*": 0.5, "*kernel*": 0.5, "*gemm*": 0.5}).replayed_us
    cpu = replay_step(trace, 5, {"aten::*": 0.5}).replayed_us
    assert kernels > 0.98 * step and cpu < 0.9 * step


def test_dpro_import_kineto_prints_each_step_and_the_what_if(tmp_path):
    path, _ = constructed_trace(tmp_path / "trace.json")
    out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "import-kineto", path, "--op-scale",
                          "ampere_sgemm*=0.5", "--json"], capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout)
    assert doc["steps"][0]["whatif_ms"] < doc["steps"][0]["replayed_ms"] - 0.9
    bad = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "import-kineto", path, "--op-scale",
                          "nosuchkernel=0.5"], capture_output=True, text=True)
    assert bad.returncode != 0 and "no op or kernel matches ['nosuchkernel']" in bad.stderr


def test_a_trace_whose_waits_were_filtered_out_is_flagged():
    """A sampled trace (its synchronize and stream-wait calls filtered out): the GPU ops start far from where the
    launches put them, and the replay says its GPU timing is not backed."""
    trace = read_kineto(fixture_path("kineto-gpu", "trace_filter_sampled_rank-1.json.gz"))
    result = replay_step(trace, trace.steps[0][0])
    assert result.start_error_us > 1000.0
    assert any(n.startswith("warning") and "no synchronize or stream-wait calls" in n for n in result.notes)
