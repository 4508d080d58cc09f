"""Real 2-rank DDP jobs through dprorun (gloo on CPU), not mocked."""
import json
import os
import subprocess
import sys

import psutil
import pytest

from conftest import EXAMPLES, REPO, run_dprorun
from dprorun.trace.model import OpKind
from dprorun.trace.rundir import load_run


def test_profiled_run_leaves_manifest_and_rank_traces(mlp_run):
    run_dir, proc = mlp_run
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["status"] == "completed" and manifest["exit_code"] == 0
    assert manifest["ranks_with_traces"] == [0, 1]
    for rank in (0, 1):
        files = set(os.listdir(run_dir / f"rank_{rank}"))
        assert {"events.json", "kineto_trace.json", "samples.json"} <= files
    assert "iteration time (median)" in proc.stdout
    assert f"run directory {run_dir}" in proc.stdout
    assert "[rank0]:" in proc.stdout  # rank-prefixed output


def test_every_bucket_of_every_profiled_iteration_has_comm_with_bytes_and_params(mlp_run):
    run_dir, _ = mlp_run
    run = load_run(str(run_dir))
    for rank, trace in run.ranks.items():
        # 6 active iterations, the profiler on for the first 2; iteration 5 (profiler export) left out
        assert trace.profiled_iterations == [3, 4, 6, 7, 8]
        assert trace.meta["kineto_iterations"] == [3, 4] and trace.meta["disturbed_iterations"] == [5, 9]
        assert len(trace.buckets) > 1, "1 MB buckets must split this model into several buckets"
        params_in_buckets = [p for b in trace.buckets for p in b.params]
        assert sorted(params_in_buckets) == sorted(trace.param_order)
        for bucket in trace.buckets:
            assert bucket.nbytes == sum(trace.param_bytes[p] for p in bucket.params)
        for iteration in trace.profiled_iterations:
            comm = [op for op in trace.ops if op.iteration == iteration and op.kind is OpKind.COMM
                    and op.source == "hooks"]
            assert sorted(int(op.tensor[len("bucket"):]) for op in comm) == sorted(b.index for b in trace.buckets)
            profiled = iteration in trace.meta["kineto_iterations"]
            for op in comm:
                assert op.nbytes > 0 and op.end_us > op.start_us
                assert op.phase == ("transmit" if profiled else "queue+transmit")
            queues = [op for op in trace.ops if op.iteration == iteration and op.kind is OpKind.QUEUE]
            assert len(queues) == (len(comm) if profiled else 0)
            kinds = {op.kind for op in trace.ops if op.iteration == iteration and op.source == "kineto"}
            if profiled:
                assert {OpKind.FW, OpKind.BW, OpKind.UPDATE} <= kinds
            else:
                assert kinds == set()
        # per-parameter gradient-ready times are taken in the profiler's iterations only
        assert len(trace.grad_ready) == len(trace.meta["kineto_iterations"]) * len(trace.param_order)


def test_summary_json_from_disk(mlp_run):
    run_dir, _ = mlp_run
    out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "summary", str(run_dir), "--json"],
                         capture_output=True, text=True, check=True, cwd=REPO)
    summary = json.loads(out.stdout)
    assert summary["world_size"] == 2
    assert summary["iteration_time_ms"] > 0 and summary["clean_iteration_time_ms"] > 0
    for row in summary["ranks"]:
        assert row["compute_ms"] > 0 and row["comm_ms"] > 0
        for part in ("forward_ms", "backward_ms", "update_ms"):  # medians of parts: each within the whole
            assert 0 < row[part] <= row["compute_ms"]
        assert row["nvml"].startswith("unavailable")


def test_failing_rank_stops_group_is_named_and_traces_kept(tmp_path):
    marker = "987654"  # a seed no other process uses: finds leftover ranks of this job
    proc, elapsed = run_dprorun(["-np", "2", "--warmup", "1", "--active", "3", "python",
                                 os.path.join(EXAMPLES, "mlp_many_layers.py"), "--steps", "50",
                                 "--fail-at-step", "5", "--fail-rank", "1", "--seed", marker], tmp_path / "run",
                                timeout=60)
    assert proc.returncode == 1
    assert "rank 1 (local rank 1" in proc.stderr and "injected failure at step 5" in proc.stderr
    failed_at = os.path.getmtime(tmp_path / "run" / "rank_1" / "events.json")
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    finished_at = os.path.getmtime(tmp_path / "run" / "manifest.json")
    assert finished_at - failed_at < 10.0, "dprorun must stop the group within 10 s of the failure"
    assert manifest["status"] == "failed" and manifest["failed_rank"] == 1
    assert (tmp_path / "run" / "rank_0" / "events.json").exists()
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []
    run = load_run(str(tmp_path / "run"))
    assert run.ranks[0].profiled_iterations  # what rank 0 recorded is readable


def test_remote_rank_traces_are_gathered_over_the_process_group(tmp_path):
    proc, _ = run_dprorun(["-np", "2", "--warmup", "1", "--active", "2", "--clean", "1", "python",
                           os.path.join(EXAMPLES, "mlp_many_layers.py"), "--steps", "6"], tmp_path / "run",
                          env={"DPRO_TEST_HOSTS": "hostA,hostB"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "run" / "rank_1" / "GATHERED_FROM").read_text() == "hostB"
    assert not (tmp_path / "run" / "rank_0" / "GATHERED_FROM").exists()
    run = load_run(str(tmp_path / "run"))
    assert run.ranks[1].host == "hostB" and run.ranks[0].host == "hostA"


def test_examples_run_unchanged_under_plain_torchrun():
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          os.path.join(EXAMPLES, "transformer_small.py"), "--steps", "3"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "median iteration time" in out.stdout


def test_bad_command_is_a_clear_error(tmp_path):
    proc, _ = run_dprorun(["-np", "2", "no-such-program-xyz"], tmp_path / "run", timeout=30)
    assert proc.returncode == 2 and "training command not found" in proc.stderr
    proc, _ = run_dprorun(["-np", "2"], tmp_path / "run2", timeout=30)
    assert proc.returncode == 2 and "no training command" in proc.stderr
