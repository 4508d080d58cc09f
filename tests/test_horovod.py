"""Horovod: the timeline reader on constructed and real timelines, `dpro import-horovod`, and real horovod.torch
jobs under `dprorun --backend horovod` and the horovodrun drop-in (skipped where Horovod is not installed:
scripts/install-horovod builds it; .ci/run does)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import EXAMPLES, REPO, run_dprorun
from dprorun.fsutil import TraceError
from dprorun.trace.horovod import read_horovod_timeline, timeline_summary
from dprorun.trace.rundir import load_run

try:
    import horovod.torch  # noqa: F401

    HOROVOD = None
except Exception as exc:  # ImportError, or a build that does not match this torch
    HOROVOD = f"Horovod is not installed ({type(exc).__name__}); scripts/install-horovod builds it"
needs_horovod = pytest.mark.skipif(HOROVOD is not None, reason=HOROVOD or "")
EXAMPLE = os.path.join(EXAMPLES, "horovod_mlp.py")


def _constructed(path, cut: int = 0):
    """Two steps of three tensors: a and b fused into one response (same transmission span), c alone."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros": 1000}}]
    for pid, name in ((1, "allreduce.a"), (2, "allreduce.b"), (3, "allreduce.c")):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
    for step in range(2):
        t0 = step * 10_000
        for pid, (tx0, tx1) in ((1, (300, 900)), (2, (300, 900)), (3, (1000, 1500))):
            events += [{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": t0, "pid": pid},
                       {"ph": "X", "name": "0", "ts": t0, "pid": pid, "dur": 0},
                       {"ph": "X", "name": "1", "ts": t0 + 150, "pid": pid, "dur": 0},
                       {"ph": "E", "ts": t0 + 200, "pid": pid},
                       {"ph": "B", "name": "ALLREDUCE", "ts": t0 + 210, "pid": pid},
                       {"ph": "B", "name": "MEMCPY_IN_FUSION_BUFFER", "ts": t0 + 220, "pid": pid},
                       {"ph": "E", "ts": t0 + 290, "pid": pid},
                       {"ph": "B", "name": "GLOO_ALLREDUCE", "ts": t0 + tx0, "pid": pid},
                       {"ph": "E", "ts": t0 + tx1, "pid": pid},
                       {"ph": "B", "name": "MEMCPY_OUT_FUSION_BUFFER", "ts": t0 + tx1 + 5, "pid": pid},
                       {"ph": "E", "ts": t0 + tx1 + 50, "pid": pid},
                       {"ph": "E", "ts": t0 + tx1 + 60, "pid": pid, "args": {"dtype": "float32", "shape": "[256, 4]"}}]
    text = "[\n" + ",\n".join(json.dumps(e) for e in events) + "]"
    with open(path, "w") as handle:
        handle.write(text[:cut] if cut else text)
    return path


def test_reader_maps_phases_fused_responses_and_ready_marks(tmp_path):
    timeline = read_horovod_timeline(_constructed(tmp_path / "tl.json"))
    assert timeline.steps == 2 and timeline.tensors == ["a", "b", "c"] and not timeline.truncated
    assert timeline.fused_responses == [["a", "b"], ["c"]]
    ops = timeline.trace.ops
    phases = {(op.kind.value, op.phase) for op in ops}
    assert {("QUEUE", "negotiate"), ("COMM", "memcpy_in"), ("COMM", "transmit"), ("COMM", "memcpy_out")} <= phases
    transmit = [op for op in ops if op.phase == "transmit"]
    assert all(op.nbytes == 256 * 4 * 4 and op.start_us >= 1000 for op in transmit)
    assert {op.txn_id for op in transmit if op.tensor in ("a", "b") and op.iteration == 0} == {"fused0"}
    assert timeline.ready_marks[("a", 0)] == {0: 1000.0, 1: 1150.0}  # rank 1 was ready 150 us later
    summary = timeline_summary(timeline)
    assert [r["transmit_ms"] for r in summary["per_step"]] == [1.1, 1.1]  # 0.6 (fused, once) + 0.5
    assert timeline.trace.buckets[0].params == ["a", "b"] and timeline.trace.buckets[0].nbytes == 2 * 4096


def test_truncated_and_foreign_timelines(tmp_path):
    full = tmp_path / "full.json"
    _constructed(full)
    cut = _constructed(tmp_path / "cut.json", cut=len(full.read_text()) * 2 // 3)
    timeline = read_horovod_timeline(str(cut))
    assert timeline.truncated and timeline.steps <= 2
    (tmp_path / "bad.json").write_text('{"traceEvents": []}')
    with pytest.raises(TraceError, match="not a Horovod timeline"):
        read_horovod_timeline(str(tmp_path / "bad.json"))
    (tmp_path / "garbage.json").write_text("[\n{\"ph\": ")
    with pytest.raises(TraceError, match="no complete event"):
        read_horovod_timeline(str(tmp_path / "garbage.json"))
    proc = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "import-horovod", str(tmp_path / "bad.json")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not a Horovod timeline" in proc.stderr and "Traceback" not in proc.stderr


@needs_horovod
def test_import_a_timeline_from_plain_horovodrun(tmp_path):
    timeline_path = tmp_path / "tl.json"
    proc = subprocess.run(["horovodrun", "-np", "2", "--gloo", "--timeline-filename", str(timeline_path), sys.executable,
                           EXAMPLE, "--steps", "8", "--depth", "6"], capture_output=True, text=True, timeout=180,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    timeline = read_horovod_timeline(str(timeline_path))
    assert len(timeline.tensors) == 2 * 8 and timeline.steps in (7, 8)  # 8 linear layers: weight + bias each
    assert sorted(t for group in timeline.fused_responses for t in group) == timeline.tensors
    out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "import-horovod", str(timeline_path), "--json",
                          "-o", str(tmp_path / "chrome.json")], capture_output=True, text=True, timeout=60)
    summary = json.loads(out.stdout)
    assert summary["steps"] == timeline.steps and len(summary["per_step"]) == timeline.steps
    assert all(row["transmit_ms"] > 0 for row in summary["per_step"])
    assert json.loads((tmp_path / "chrome.json").read_text())["traceEvents"]


@needs_horovod
def test_dprorun_backend_horovod_and_the_horovodrun_drop_in(tmp_path):
    run_dir = tmp_path / "run"
    proc, _ = run_dprorun(["--backend", "horovod", "-np", "2", "--warmup", "2", "--active", "5", "--kineto-iters",
                           "2", "--clean", "1", "python", EXAMPLE, "--steps", "10"], run_dir, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "median iteration time" in proc.stdout and "fused responses per step" in proc.stdout
    summary = json.load(open(run_dir / "summary.json"))
    # Horovod's timeline is recorded in the window's detailed tier only (--kineto-iters 2): a whole-job timeline
    # made small jobs 20 % slower and the replay predicted that overhead
    assert summary["backend"] == "horovod" and summary["horovod"]["steps"] in (1, 2, 3)
    # per-rank compute traces from the hooks on horovod.torch's DistributedOptimizer, as for DDP
    run = load_run(str(run_dir))
    assert sorted(run.ranks) == [0, 1]
    for trace in run.ranks.values():
        assert len(trace.buckets) == 2 * 26  # one record per tensor: 26 linear layers
        assert {op.kind.value for op in trace.ops if op.stream == "phase"} >= {"FW", "BW", "UPDATE"}
        assert any(op.source == "kineto" for op in trace.ops) and trace.grad_ready
    assert all(row["iteration_time_ms"] for row in summary["ranks"])
    # the cost model's calibration: Horovod's own all-reduces of 4 KiB-4 MiB, timed at the end of the window
    from dprorun.replay.template import build_job_model

    assert [row[0] for row in run.ranks[0].meta["calibration"]] == [1 << 12, 1 << 16, 1 << 20, 1 << 22]
    model = build_job_model(run)
    assert model.comm.source.startswith("horovod calibration") and model.comm.bandwidth_bytes_per_us > 0
    out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", str(run_dir), "--json"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["predicted_iteration_time_ms"] > 0
    fused = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", str(run_dir), "--json", "--np", "4"],
                           capture_output=True, text=True, timeout=300, cwd=REPO)
    doc = json.loads(fused.stdout)  # a world-size what-if prices Horovod's fused responses, not 52 collectives
    assert doc["buckets"] < 52 and any("Horovod fusion at 128 MB" in note for note in doc["notes"])
    copy = tmp_path / "copy.json"
    env = dict(os.environ, DPRO_RUN_DIR=str(tmp_path / "run2"))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "launchers", "horovodrun"), "-np", "2", "--gloo",
                           "--timeline-filename", str(copy), "--fusion-threshold-mb", "1", "python", EXAMPLE,
                           "--steps", "6"], capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the user asked horovodrun for a timeline: the whole job's (the writer can still hold the last step's events
    # when the job exits, seen under load)
    assert read_horovod_timeline(str(copy)).steps in (5, 6)


@needs_horovod
def test_a_failing_horovod_rank_fails_the_job(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import horovod.torch as hvd\nhvd.init()\nraise SystemExit(3 if hvd.rank() == 1 else 0)\n")
    proc, _ = run_dprorun(["--backend", "horovod", "-np", "2", "python", str(script)], tmp_path / "run",
                          timeout=120)
    assert proc.returncode != 0 and "horovodrun exited with code" in proc.stderr


@needs_horovod
def test_a_strategy_reaches_horovod_through_its_own_knobs(tmp_path):
    from dprorun.strategy import Strategy, save_strategy

    path = tmp_path / "strategy.json"
    save_strategy(Strategy(horovod_fusion_threshold_mb=1.0, horovod_cycle_time_ms=2.5), str(path))
    script = tmp_path / "knobs.py"
    script.write_text("import os\nimport horovod.torch as hvd\nhvd.init()\n"
                      "print('knobs', os.environ.get('HOROVOD_FUSION_THRESHOLD'), os.environ.get('HOROVOD_CYCLE_TIME'))\n")
    run_dir = tmp_path / "run"
    proc, _ = run_dprorun(["--backend", "horovod", "-np", "2", "--strategy", str(path), "python", str(script)],
                          run_dir, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "knobs 1048576 2.5" in proc.stdout
    manifest = json.load(open(run_dir / "manifest.json"))
    assert manifest["horovod_args"] == ["--fusion-threshold-mb", "1", "--cycle-time-ms", "2.5"]


@needs_horovod
def test_horovod_autotune_ranks_knobs_by_replay_and_trials_decide(tmp_path):
    """--autotune --backend horovod: a dry-run profile of the real job, (threshold, cycle) candidates ranked by
    the replayed fusion model, a real trial window per candidate with the knobs passed to horovodrun, and the
    fastest measured kept only if it beats the job's own settings; every trial is in autotune.json."""
    from dprorun.optimize.horovod import rank_horovod_knobs
    from dprorun.replay.template import build_job_model

    run_dir = tmp_path / "run"
    window = ["--warmup", "2", "--active", "5", "--kineto-iters", "1", "--clean", "1"]
    proc, _ = run_dprorun(["--backend", "horovod", "--autotune", "-np", "2", *window, "python", EXAMPLE,
                           "--steps", "12"], run_dir, timeout=400, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    phases = json.load(open(run_dir / "autotune.json"))["phases"]
    names = [p["phase"] for p in phases]
    assert names[:2] == ["profiling", "searching"] and "deciding" in names and names[-1] == "done"
    trials = [p for p in phases if p["phase"] == "trial"]
    deciding = next(p for p in phases if p["phase"] == "deciding")
    if trials:  # the replay found candidates: each was run for real with its own knobs
        for trial in trials:
            manifest = json.load(open(os.path.join(trial["run_dir"], "manifest.json")))
            assert "--fusion-threshold-mb" in manifest["horovod_args"] and trial["measured_ms"] > 0
        if deciding["keep"]:
            best = min(t["measured_ms"] for t in trials)
            assert deciding["trial_ms"] == best
            assert json.load(open(run_dir / "manifest.json"))["horovod_args"]
    else:
        assert deciding["keep"] is False
    # the ranking itself, on the profiled window
    profiled = load_run(str(run_dir / "autotune" / "profile"))
    candidates = rank_horovod_knobs(build_job_model(profiled), top=3)
    assert all(c.predicted_ms < c.baseline_ms for c in candidates)
    assert [c.predicted_ms for c in candidates] == sorted(c.predicted_ms for c in candidates)


@needs_horovod
def test_horovod_ranks_on_other_hosts_send_their_traces_over_horovod(tmp_path):
    """No torch.distributed in a Horovod job: a rank whose files are not on rank 0's disk ships them through
    Horovod's own alltoall (pretend hosts make rank 1 remote on this one machine)."""
    run_dir = tmp_path / "run"
    proc, _ = run_dprorun(["--backend", "horovod", "-np", "2", "-q", "--warmup", "2", "--active", "4",
                           "--kineto-iters", "1", "--clean", "1", "python", EXAMPLE, "--steps", "10"], run_dir,
                          timeout=180, env={"DPRO_TEST_HOSTS": "hostA,hostB", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "rank_1" / "GATHERED_FROM").read_text() == "hostB"
    assert not (run_dir / "rank_0" / "GATHERED_FROM").exists() and not list(run_dir.glob(".gather-*"))
    run = load_run(str(run_dir))
    assert run.ranks[1].host == "hostB" and run.ranks[1].buckets


@needs_horovod
def test_a_strategy_groups_horovod_allreduces(tmp_path):
    """horovod_groups in a strategy become DistributedOptimizer(groups=...) through the hooks (grouped
    allreduce), with no change to the script."""
    from dprorun.strategy import Strategy, save_strategy

    names = [f"{2 * i}.{kind}" for i in range(26) for kind in ("weight", "bias")]
    path = tmp_path / "strategy.json"
    save_strategy(Strategy(horovod_groups=[names[:26], names[26:]]), str(path))
    run_dir = tmp_path / "run"
    proc, _ = run_dprorun(["--backend", "horovod", "-np", "2", "-q", "--strategy", str(path), "--warmup", "2",
                           "--active", "3", "--kineto-iters", "1", "--clean", "1", "python", EXAMPLE, "--steps",
                           "8"], run_dir, timeout=180, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    applied = json.load(open(run_dir / "rank_0" / "events.json"))["strategy"]["applied"]
    assert applied["horovod_groups"] == [26, 26]


def _horovod_tf() -> str:
    try:
        import horovod.tensorflow  # noqa: F401

        return ""
    except Exception as exc:  # not built with TensorFlow (scripts/install-horovod after scripts/install-tf does)
        return f"horovod.tensorflow is not importable ({type(exc).__name__}: {str(exc)[:80]})"


@pytest.mark.skipif(bool(_horovod_tf()), reason=_horovod_tf() or "")
def test_a_horovod_tensorflow_job_runs_and_says_what_is_not_profiled(tmp_path):
    """A horovod.tensorflow job under --backend horovod: it runs to the end with its exit code, Horovod's timeline
    of the whole job is kept and summarised, and the job's end says its ops are not profiled (no silent nothing)."""
    run_dir = tmp_path / "run"
    proc, _ = run_dprorun(["--backend", "horovod", "--horovod-full-timeline", "-np", "2", "python",
                           os.path.join(EXAMPLES, "horovod_tf.py"), "--steps", "12", "--width", "64"], run_dir)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "median step" in proc.stdout
    assert "horovod.tensorflow (its ops are not profiled yet" in proc.stdout + proc.stderr
    assert "nothing was profiled" in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["backend"] == "horovod" and summary["horovod"]["steps"] >= 10
    assert summary["horovod"]["tensors"] >= 8  # the model's 8 gradients (and the broadcasts)
