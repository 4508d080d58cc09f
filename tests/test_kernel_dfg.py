"""The kernel-level local DFG (graph/kernels.py): CPU threads, CUDA runtime calls and GPU streams of one profiled
step, on a real recorded GPU DDP trace (../shared/fixtures) and on constructed traces whose timing is known."""
import gzip
import json
import os
import subprocess
import sys

import pytest

from conftest import fixture_path
from dprorun.fsutil import UnanswerableError
from dprorun.graph.kernels import activity_of_step, job_kernel_dfg, kernel_dfg, replay_job_step, replay_step
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


# ---- the job: ranks joined through their NCCL kernels --------------------------------------------------------------
def two_rank_traces(tmp_path, kernel_us=(100.0, 150.0), shifts=(0.0, 7000.0), nccl=(True, True)):
    """Two ranks of a GPU-bound step that start together: each launches 20 matmuls (rank r's take kernel_us[r]),
    then an all-reduce that starts on both GPUs once the slower rank's matmuls are done (the faster rank's NCCL
    kernel spins until then) and moves data for 300 us, then synchronizes. Rank r's clock reads true time +
    shifts[r]. Returns (paths, the step's true length, rank 0's wait in the all-reduce)."""
    def compute_end(us):
        t, gpu_free = 10.0, 0.0
        for _ in range(20):
            gpu_free = max(t + 9, gpu_free) + us
            t += 10.0
        return t, gpu_free

    ready = [max(compute_end(us)[1], compute_end(us)[0] + 15 + 2) for us in kernel_us]
    nccl_end = max(r for r, on in zip(ready, nccl) if on) + 300.0
    paths, step_us = [], None
    for rank, (us, shift) in enumerate(zip(kernel_us, shifts)):
        events, t, gpu_free, corr = [], 10.0, 0.0, 1
        cpu = lambda name, a, b: {"ph": "X", "cat": "cpu_op", "name": name, "pid": PID, "tid": PID, "ts": a + shift,
                                  "dur": b - a}
        runtime = lambda name, a, b, c: {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": PID, "tid": PID,
                                         "ts": a + shift, "dur": b - a, "args": {"correlation": c}}
        kernel = lambda name, a, d, c, stream: {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream,
                                                "ts": a + shift, "dur": d,
                                                "args": {"correlation": c, "stream": stream, "device": rank}}
        for _ in range(20):
            events.append(cpu("aten::mm", t, t + 10))
            events.append(runtime("cudaLaunchKernel", t + 2, t + 7, corr))
            start = max(t + 9, gpu_free)
            events.append(kernel("ampere_sgemm_128x64_nn", start, us, corr, 7))
            gpu_free, t, corr = start + us, t + 10, corr + 1
        gpu_end = gpu_free
        if nccl[rank]:
            events.append(cpu("c10d::allreduce_", t, t + 20))
            events.append(runtime("cudaStreamWaitEvent", t + 2, t + 4, corr))
            events.append(runtime("cudaLaunchKernel", t + 10, t + 15, corr + 1))
            events.append(kernel("ncclKernel_AllReduce_RING_LL_Sum_float", ready[rank], nccl_end - ready[rank],
                                 corr + 1, 40))
            gpu_end, corr, t = nccl_end, corr + 2, t + 20
        sync_end = max(gpu_end, t + 1) + 4.0
        events.append(cpu("aten::item", t, sync_end + 2))
        events.append(runtime("cudaDeviceSynchronize", t + 1, sync_end, corr))
        step_us = sync_end + 10
        events.append({"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": PID, "tid": PID,
                       "ts": shift, "dur": step_us})
        path = tmp_path / f"rank{rank}.json"
        with open(path, "w") as handle:
            json.dump({"traceEvents": events, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2}},
                      handle)
        paths.append(str(path))
    return paths, step_us, ready[1] - ready[0]


def test_two_ranks_joined_through_their_all_reduce_replay_the_step_and_its_straggler(tmp_path):
    paths, step_us, wait_us = two_rank_traces(tmp_path)
    traces = [read_kineto(p) for p in paths]
    as_run = replay_job_step(traces, 1)
    assert as_run.offsets_us[1] == pytest.approx(-7000.0, abs=1.0)  # from the all-reduce's end on both clocks
    assert as_run.measured_us == pytest.approx(step_us, abs=1.0)
    assert as_run.replayed_us == pytest.approx(step_us, abs=5.0)
    assert max(as_run.start_error_us) < 1.0
    assert wait_us == pytest.approx(1000.0, abs=20.0)  # rank 1's matmuls take 50 us longer, 20 of them
    assert as_run.waited_measured_us[0] == pytest.approx(wait_us, abs=1.0) and as_run.waited_measured_us[1] < 1.0
    assert as_run.waited_replayed_us[0] == pytest.approx(wait_us, abs=5.0)
    # rank 0 alone, its all-reduce as measured (the wait inside it), replays the same step
    assert replay_step(traces[0], 1).replayed_us == pytest.approx(step_us, abs=5.0)
    # the straggler what-if: rank 1's GPU as fast as rank 0's saves rank 0's wait; rank 0's as slow changes nothing
    faster = replay_job_step(traces, 1, rank_scale={1: 100.0 / 150.0})
    assert step_us - faster.replayed_us == pytest.approx(wait_us, rel=0.02)
    assert faster.waited_replayed_us[0] < 5.0
    slower = replay_job_step(traces, 1, rank_scale={0: 1.5})
    assert slower.replayed_us == pytest.approx(step_us, abs=5.0)
    path = [as_run.critical_path["top"][k]["op"] for k in range(len(as_run.critical_path["top"]))]
    assert any(op.startswith("r1.") and "sgemm" in op for op in path)  # the slower rank's kernels gate the step


def test_ranks_whose_nccl_kernels_do_not_pair_up_are_refused_with_the_reason(tmp_path):
    paths, _, _ = two_rank_traces(tmp_path, nccl=(True, False))
    with pytest.raises(UnanswerableError, match="do not pair up one to one"):
        job_kernel_dfg([read_kineto(p) for p in paths], 1)
    same = [read_kineto(paths[0]), read_kineto(paths[0])]
    with pytest.raises(UnanswerableError, match="one trace per rank"):
        job_kernel_dfg(same, 1)


def test_the_recorded_gpu_ddp_rank_and_its_shifted_copy_align_and_replay_as_one_job(tmp_path):
    """Rank 0 of a recorded 2-GPU DDP job and a copy of it as rank 1 with its clock 12,345.6 us ahead (a
    constructed peer: the fixture holds one rank): the offset comes back from the NCCL kernels' ends, the joined
    graph replays each step as rank 0 alone does, and a slower GPU on rank 1 shows up as rank 0's wait."""
    source = fixture_path("kineto-gpu", "nccl_parser_config_nccl_data.json.gz")
    with gzip.open(source, "rt") as handle:
        doc = json.load(handle)
    doc["distributedInfo"]["rank"] = 1
    for event in doc["traceEvents"]:
        if "ts" in event:
            event["ts"] += 12345.6
    with open(tmp_path / "rank1.json", "w") as handle:
        json.dump(doc, handle)
    traces = [read_kineto(source), read_kineto(str(tmp_path / "rank1.json"))]
    for step, a, b in traces[0].steps:
        result = replay_job_step(traces, step)
        assert result.offsets_us[1] == pytest.approx(-12345.6, abs=1.0)
        assert max(result.offset_uncertainty_us) < 1.0
        assert result.collectives == 7  # 2 broadcasts and 5 all-reduces a step
        assert result.replayed_us == pytest.approx(replay_step(traces[0], step).replayed_us, rel=1e-4)
        assert max(result.start_error_us) < 5.0
    slow = replay_job_step(traces, 5, rank_scale={1: 2.0})
    assert slow.waited_replayed_us[0] > 1000.0 and slow.waited_replayed_us[1] < 10.0


def test_two_ranks_of_a_larger_job_are_joined_with_a_warning():
    """Ranks 0 and 1 of a 128-rank job, sampled: their SendRecv kernels pair by count but not by timing; the
    replay says the clocks disagree, that ranks are missing, and that the GPU timing is not backed."""
    traces = [read_kineto(fixture_path("kineto-gpu", f"trace_filter_sampled_rank-{r}.json.gz")) for r in (0, 1)]
    result = replay_job_step(traces, 551)
    warnings = [n for n in result.notes if n.startswith("warning")]
    assert any("2 of the job's 128 ranks" in n for n in warnings)
    assert any("disagree with one offset" in n for n in warnings)


def test_dpro_import_kineto_of_several_ranks_prints_the_job_and_its_what_if(tmp_path):
    paths, step_us, wait_us = two_rank_traces(tmp_path)
    out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "import-kineto", *paths, "--rank-scale",
                          "1=0.6667", "--json"], capture_output=True, text=True, check=True)
    row = json.loads(out.stdout)["steps"][0]
    assert row["ranks"] == [0, 1] and row["collectives"] == 1
    assert row["whatif_ms"] == pytest.approx((step_us - wait_us) / 1000, abs=0.02)
    text = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "import-kineto", *paths],
                          capture_output=True, text=True, check=True).stdout
    assert "waited for peers, measured/replayed: rank 0 1.00/1.00 ms" in text
    bad = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "import-kineto", paths[0], "--rank-scale",
                          "1=2"], capture_output=True, text=True)
    assert bad.returncode != 0 and "one trace per rank" in bad.stderr
    run_dir = tmp_path / "run"  # a run directory: rank_K/kineto_trace.json
    for rank, path in enumerate(paths):
        (run_dir / f"rank_{rank}").mkdir(parents=True)
        os.replace(path, run_dir / f"rank_{rank}" / "kineto_trace.json")
    out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "import-kineto", str(run_dir), "--json"],
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["steps"][0]["replayed_ms"] == pytest.approx(step_us / 1000, abs=0.01)
