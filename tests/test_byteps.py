"""BytePS: comm.json reader, the partition-pipeline replay, `dpro import-byteps` and the bpslaunch drop-in.

Recorded files (../shared/fixtures/byteps, real BytePS traces) are used where present; constructed files with
known queueing cover the rest (BytePS cannot be built here: it needs CUDA), and a stand-in `bpslaunch` that
writes a comm.json exercises the drop-in's plumbing (environment, run directory, exit codes)."""
import json
import os
import stat
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from dprorun.fsutil import TraceError
from dprorun.replay.pipeline import pipeline_summary, predict_steps, reconstruct_step, step_times
from dprorun.trace.byteps import read_byteps_comm
from dprorun.trace.model import OpKind

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(os.path.dirname(REPO), "shared", "fixtures", "byteps")
needs_fixtures = pytest.mark.skipif(not os.path.isdir(FIXTURES),
                                    reason=f"recorded BytePS traces not present ({FIXTURES})")
PID = "Comm.byteps.Gradient.w"


def constructed_events(steps: int = 3, partitions: int = 4, reduce_us: float = 100.0, push_us: float = 400.0,
                       step_gap_us: float = 5000.0) -> list[dict]:
    """A root GPU's trace: per step every partition enters REDUCE at once (so partition k waits k x reduce_us),
    then PUSH (one at a time), PULL (fixed 50 µs after its PUSH) and BROADCAST (20 µs)."""
    events = []
    t0 = 1_600_000_000_000_000.0
    for step in range(steps):
        base = t0 + step * step_gap_us
        jitter = 10.0 * step  # steps differ a little, as real ones do
        push_free = base
        last_end = base
        for p in range(partitions):
            r_start, r_end = base + 10.0, base + 10.0 + (p + 1) * (reduce_us + jitter)
            push_start = r_end + 5.0
            push_begin = max(push_start, push_free)
            push_end = push_begin + push_us
            push_free = push_end
            pull_end = push_end + 50.0
            b_start, b_end = pull_end + 2.0, pull_end + 22.0
            for stage, a, b in (("REDUCE", r_start, r_end), ("PUSH", push_start, push_end),
                                ("PULL", push_end, pull_end), ("BROADCAST", b_start, b_end)):
                events.append({"ph": "X", "pid": PID, "tid": str(p), "name": f"{PID}.{stage}", "ts": a,
                               "dur": b - a, "cat": "Comm", "args": {"name": PID}})
            last_end = max(last_end, b_end)
        events.append({"ph": "X", "pid": PID, "tid": "total", "name": PID, "ts": base, "dur": last_end - base,
                       "cat": "Comm", "args": {"name": PID}})
    return events


def constructed_worker_events(root_events: list[dict], lag_us: float = 50.0) -> list[dict]:
    """A non-root GPU of the same machine and steps: REDUCE with the root, then COPYH2D starting lag_us after
    the root's PULL of the same partition ends (what it waits for), then BROADCAST."""
    events = []
    pulls = sorted((e for e in root_events if e["name"].endswith(".PULL")), key=lambda e: e["ts"])
    reduces = sorted((e for e in root_events if e["name"].endswith(".REDUCE")), key=lambda e: e["ts"])
    for pull, red in zip(pulls, reduces):
        start = pull["ts"] + pull["dur"] + lag_us
        for stage, a, b in (("REDUCE", red["ts"], red["ts"] + red["dur"]), ("COPYH2D", start, start + 15.0),
                            ("BROADCAST", start + 17.0, start + 37.0)):
            events.append({"ph": "X", "pid": PID, "tid": pull["tid"], "name": f"{PID}.{stage}", "ts": a,
                           "dur": b - a, "cat": "Comm", "args": {"name": PID}})
    for total in (e for e in root_events if e["tid"] == "total"):
        events.append(dict(total, dur=total["dur"] + lag_us + 15.0))  # ends with its last BROADCAST
    return events


def write_comm(path: str, events: list[dict]) -> str:
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f, indent=4)
    return path


def test_constructed_trace_separates_queueing_from_service(tmp_path):
    bt = read_byteps_comm(write_comm(str(tmp_path / "comm.json"), constructed_events()))
    assert bt.role == "root" and bt.steps == 3 and bt.partitions == {"byteps.Gradient.w": 4}
    assert bt.stages == ["REDUCE", "PUSH", "PULL", "BROADCAST"]
    assert all(op.iteration in (0, 1, 2) and op.source == "byteps" for op in bt.trace.ops)
    assert {op.chunk for op in bt.trace.ops} == {0, 1, 2, 3}
    times = step_times(bt, 0)
    reduce = [times.stages[("byteps.Gradient.w", p)][0] for p in range(4)]
    assert [r[0] for r in reduce] == ["REDUCE"] * 4
    assert [round(r[1]) for r in reduce] == [100, 100, 100, 100]  # service: one partition's work
    assert round(times.waiting_us["reduce"]) == 100 + 200 + 300  # partition k queued k x 100 µs
    pushes = [times.stages[("byteps.Gradient.w", p)][1][1] for p in range(4)]
    assert [round(x) for x in pushes] == [400] * 4


def test_replay_reproduces_a_step_and_predicts_the_others(tmp_path):
    bt = read_byteps_comm(write_comm(str(tmp_path / "comm.json"), constructed_events()))
    for step in range(3):
        again = reconstruct_step(bt, step)
        assert abs(again.error) < 1e-6, (step, again.predicted_us, again.measured_us)
    predictions = predict_steps(bt)
    assert len(predictions) == 3 and all(abs(p.error) < 0.02 for p in predictions)
    faster = predict_steps(bt, {"PUSH": 0.5})
    assert all(f.predicted_us < p.predicted_us for f, p in zip(faster, predictions))
    # 4 pushes of 400 µs back to back dominate: halving them saves close to 4 x 200 µs
    saved = predictions[0].predicted_us - faster[0].predicted_us
    assert 600 < saved <= 800


def test_one_machines_gpus_replayed_together(tmp_path):
    """A non-root GPU waits for the root's PULL of each partition: the machine replay links them, reproduces the
    machine's step, and a faster network reaches the non-root GPU's end too."""
    from dprorun.replay.pipeline import machine_graph, machine_step_times, machine_summary, predict_machine_steps
    from dprorun.replay.engine import replay

    root_events = constructed_events()
    root = read_byteps_comm(write_comm(str(tmp_path / "root.json"), root_events), rank=0)
    worker = read_byteps_comm(write_comm(str(tmp_path / "worker.json"), constructed_worker_events(root_events)),
                              rank=1)
    assert (root.role, worker.role) == ("root", "worker")
    gpus = machine_step_times(root, [worker], 1)
    assert {key: mark for key, mark in gpus[1].after_root.items()} == {
        ("byteps.Gradient.w", p): ("COPYH2D", pytest.approx(50.0)) for p in range(4)}
    assert replay(machine_graph(gpus)).iteration_time_us == pytest.approx(gpus[0].span_us, abs=1.0)
    as_run = predict_machine_steps(root, [worker])
    faster = predict_machine_steps(root, [worker], {"PUSH": 0.5})
    assert all(abs(p.error) < 0.02 for p in as_run)
    assert all(f.predicted_us < p.predicted_us - 600 for f, p in zip(faster, as_run))
    doc = machine_summary([worker, root], {"PUSH": 0.5})
    assert doc["linked_partitions"] == [4] and doc["whatif"]["predicted_sync_ms"] < doc["whatif"]["as_run_sync_ms"]
    with pytest.raises(ValueError, match="exactly one root"):
        machine_summary([worker, worker])


def test_byteps_push_and_pull_run_on_the_parameter_server_topology(tmp_path):
    """The root GPU's PUSH and PULL are the PS topology of the one graph (replay/ps_topology.py): the network pass
    scales them as the stage what-if does; the servers and the other workers were not recorded, so placement and
    worker-count questions say why they cannot be answered."""
    from dprorun.fsutil import UnanswerableError
    from dprorun.replay.engine import replay
    from dprorun.replay.pipeline import machine_graph, scale_stages
    from dprorun.replay.ps_topology import plan_of, set_placement, set_ps_network, set_workers

    bt = read_byteps_comm(write_comm(str(tmp_path / "comm.json"), constructed_events()))
    graph = machine_graph([step_times(bt, 1)])
    plan = plan_of(graph)
    assert len(plan.order) == 4 and plan.links.layout == "worker-side"
    assert any(name.startswith("push byteps.Gradient.w.p0.s0") for name in graph.names)
    faster = replay(set_ps_network(graph, bandwidth_scale=2.0)).iteration_time_us
    staged = replay(scale_stages(graph, {"PUSH": 0.5, "PULL": 0.5})).iteration_time_us
    assert faster == pytest.approx(staged, rel=1e-12) and faster < replay(graph).iteration_time_us
    with pytest.raises(UnanswerableError, match="servers are not in the files"):
        set_placement(graph, servers=2)
    with pytest.raises(UnanswerableError, match="one worker was recorded"):
        set_workers(graph, 2)


def test_cut_short_file_keeps_complete_events_and_bad_files_are_named(tmp_path):
    path = write_comm(str(tmp_path / "comm.json"), constructed_events())
    text = open(path).read()
    cut = tmp_path / "cut.json"
    cut.write_text(text[: int(len(text) * 0.7)])
    bt = read_byteps_comm(str(cut))
    assert bt.truncated and 0 < len(bt.trace.ops) < 3 * 4 * 4
    (tmp_path / "empty.json").write_text('{"traceEvents": [')
    with pytest.raises(TraceError, match="no complete event"):
        read_byteps_comm(str(tmp_path / "empty.json"))
    (tmp_path / "other.json").write_text('[{"ph": "X"}]')
    with pytest.raises(TraceError, match="not a BytePS comm.json"):
        read_byteps_comm(str(tmp_path / "other.json"))
    with pytest.raises(TraceError, match="cannot be read"):
        read_byteps_comm(str(tmp_path / "missing.json"))
    one_step = read_byteps_comm(write_comm(str(tmp_path / "one.json"), constructed_events(steps=1)))
    with pytest.raises(ValueError, match="needs at least 2"):
        predict_steps(one_step)


GOOD = json.dumps({"traceEvents": constructed_events(steps=3, partitions=2)})


@settings(max_examples=150, deadline=None)
@given(st.integers(min_value=0, max_value=len(GOOD)), st.lists(st.tuples(st.integers(0, len(GOOD) - 1),
                                                                         st.integers(0, 255)), max_size=6))
def test_damaged_comm_json_is_read_or_refused_by_name(tmp_path_factory, cut, flips):
    """Cut short anywhere and with bytes changed: a BytePSTrace, or a TraceError naming the file; the replay of
    what was read answers or says why it cannot (ValueError), never anything else."""
    data = bytearray(GOOD[:cut].encode())
    for at, value in flips:
        if at < len(data):
            data[at] = value
    path = tmp_path_factory.mktemp("damaged") / "comm.json"
    path.write_bytes(bytes(data))
    try:
        bt = read_byteps_comm(str(path))
    except TraceError as exc:
        assert str(path) in str(exc)
        return
    try:
        pipeline_summary(bt, {"PUSH": 0.5})
    except ValueError as exc:
        assert "step" in str(exc)


@needs_fixtures
def test_recorded_worker_and_root_traces():
    worker = read_byteps_comm(os.path.join(FIXTURES, "comm.json.gz"))
    root = read_byteps_comm(os.path.join(FIXTURES, "comm3.json.gz"))
    assert worker.role == "worker" and root.role == "root"
    assert worker.steps == root.steps == 11
    assert worker.partitions == root.partitions == {"byteps.Whole.Gradient": 60}
    assert len(worker.trace.ops) == 7 * 60 * 11 and len(root.trace.ops) == 6 * 60 * 11
    assert all(op.iteration >= 0 for op in root.trace.ops)
    assert {op.kind for op in worker.trace.ops if op.phase.startswith("coordinate")} == {OpKind.QUEUE}
    for bt in (worker, root):
        assert abs(reconstruct_step(bt, 4).error) < 0.005
    summary = pipeline_summary(root, {"PUSH": 0.5, "PULL": 0.5})
    assert summary["bottleneck"] == "PULL"
    # each step predicted from the other ten steps' medians (measured: max 4.8 %)
    assert summary["leave_one_out_error_pct"]["max"] < 8.0
    assert summary["whatif"]["predicted_sync_ms"] < 0.7 * summary["whatif"]["as_run_sync_ms"]
    from dprorun.replay.pipeline import machine_summary

    machine = machine_summary([worker, root], {"PUSH": 0.5, "PULL": 0.5})  # two GPUs of one machine, one job
    assert machine["linked_partitions"] == [60]  # every partition of the non-root GPU waits for a root PULL
    assert machine["leave_one_out_error_pct"]["max"] < 8.0  # measured: 4.75 %
    assert machine["whatif"]["predicted_sync_ms"] < 0.7 * machine["whatif"]["as_run_sync_ms"]
    unchanged = pipeline_summary(worker, {"PUSH": 0.5})
    assert unchanged["whatif"]["predicted_sync_ms"] == unchanged["whatif"]["as_run_sync_ms"]
    assert any("root" in note for note in unchanged["whatif"]["notes"])


def test_dpro_import_byteps_command(tmp_path):
    path = write_comm(str(tmp_path / "comm.json"), constructed_events())
    out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "import-byteps", path, "--stage-scale",
                          "PUSH=0.5", "-o", str(tmp_path / "trace.json")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "bottleneck stage: PUSH" in out.stdout and "what-if (PUSH x0.5)" in out.stdout
    assert "the files together" not in out.stdout  # one file: no machine replay
    assert json.load(open(tmp_path / "trace.json"))["traceEvents"]
    js = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "import-byteps", path, "--json"],
                        capture_output=True, text=True)
    assert json.loads(js.stdout)["role"] == "root"
    bad = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "import-byteps", path, "--stage-scale",
                          "PUSH=-1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "FACTOR > 0" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "import-byteps",
                              str(tmp_path / "nope.json")], capture_output=True, text=True)
    assert missing.returncode == 2 and "nope.json: cannot be read" in missing.stderr


FAKE_BPSLAUNCH = """#!{python}
# stand-in for BytePS's bpslaunch: records its environment, writes GPU 0's comm.json, exits FAKE_RC
import json, os, shutil, sys
with open(os.environ["FAKE_LOG"], "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": {{k: v for k, v in os.environ.items() if k.startswith("BYTEPS_")}}}}, f)
if os.environ.get("BYTEPS_TRACE_ON") == "1" and os.environ.get("FAKE_WRITE", "1") == "1":
    target = os.path.join(os.environ["BYTEPS_TRACE_DIR"], "0")
    os.makedirs(target, exist_ok=True)
    shutil.copyfile(os.environ["FAKE_COMM"], os.path.join(target, "comm.json"))
if os.environ.get("FAKE_SLEEP"):  # a job still running: stopped by the signal dprorun passes on
    import signal, time
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    open(os.environ["FAKE_SLEEP"], "w").close()
    time.sleep(60)
sys.exit(int(os.environ.get("FAKE_RC", "0")))
"""


@pytest.fixture
def fake_bpslaunch(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "bpslaunch"
    exe.write_text(FAKE_BPSLAUNCH.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    comm = write_comm(str(tmp_path / "source_comm.json"), constructed_events())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BYTEPS_", "DMLC_", "DPRO_"))}
    env.update({"PATH": os.path.join(REPO, "launchers") + os.pathsep + str(bindir) + os.pathsep + env["PATH"],
                "FAKE_LOG": str(tmp_path / "log.json"), "FAKE_COMM": comm, "DMLC_ROLE": "worker",
                "PYTHONPATH": os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))})  # this tree's dprorun
    return env


def _shim(args, env, cwd):
    return subprocess.run([sys.executable, os.path.join(REPO, "launchers", "bpslaunch"), *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_bpslaunch_dropin_traces_a_worker_and_keeps_exit_codes(tmp_path, fake_bpslaunch):
    env = dict(fake_bpslaunch, DPRO_RUN_DIR=str(tmp_path / "run"))
    proc = _shim(["python3", "train.py"], env, str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    seen = json.load(open(tmp_path / "log.json"))
    assert seen["argv"] == ["python3", "train.py"]
    assert seen["env"]["BYTEPS_TRACE_ON"] == "1"
    assert seen["env"]["BYTEPS_TRACE_DIR"] == str(tmp_path / "run" / "byteps")
    assert (seen["env"]["BYTEPS_TRACE_START_STEP"], seen["env"]["BYTEPS_TRACE_END_STEP"]) == ("10", "20")
    assert os.path.isfile(tmp_path / "run" / "byteps" / "0" / "comm.json")
    assert "bottleneck stage: PUSH" in proc.stdout
    manifest = json.load(open(tmp_path / "run" / "manifest.json"))
    assert manifest["exit_code"] == 0 and manifest["framework"] == "byteps"

    # a failing job: its exit code comes back and what it wrote is kept; the user's trace settings win
    own = tmp_path / "own_traces"
    env = dict(fake_bpslaunch, DPRO_RUN_DIR=str(tmp_path / "run2"), FAKE_RC="3", BYTEPS_TRACE_DIR=str(own),
               BYTEPS_TRACE_END_STEP="7")
    proc = _shim(["python3", "train.py"], env, str(tmp_path))
    assert proc.returncode == 3
    seen = json.load(open(tmp_path / "log.json"))
    assert seen["env"]["BYTEPS_TRACE_DIR"] == str(own) and seen["env"]["BYTEPS_TRACE_END_STEP"] == "7"
    assert os.path.isfile(own / "0" / "comm.json") and os.path.isfile(tmp_path / "run2" / "byteps" / "0" / "comm.json")
    assert json.load(open(tmp_path / "run2" / "manifest.json"))["exit_code"] == 3


def test_bpslaunch_dropin_without_traces_servers_and_no_bytePS(tmp_path, fake_bpslaunch):
    env = dict(fake_bpslaunch, DPRO_RUN_DIR=str(tmp_path / "run"), FAKE_WRITE="0")
    proc = _shim(["python3", "train.py"], env, str(tmp_path))
    assert proc.returncode == 0 and "no BytePS comm.json was written" in proc.stderr
    server = dict(fake_bpslaunch, DMLC_ROLE="server", DPRO_RUN_DIR=str(tmp_path / "server_run"))
    proc = _shim([], server, str(tmp_path))
    assert proc.returncode == 0 and "BYTEPS_TRACE_ON" not in json.load(open(tmp_path / "log.json"))["env"]
    assert not os.path.exists(tmp_path / "server_run")
    alone = dict(fake_bpslaunch, PATH=os.path.join(REPO, "launchers") + os.pathsep + "/usr/bin:/bin")
    proc = _shim(["python3", "train.py"], alone, str(tmp_path))
    assert proc.returncode == 2 and "bpslaunch was not found" in proc.stderr
    named = dict(alone, DPRO_REAL_BPSLAUNCH=str(tmp_path / "bin" / "bpslaunch"), DPRO_RUN_DIR=str(tmp_path / "r3"))
    proc = _shim(["python3", "train.py"], named, str(tmp_path))
    assert proc.returncode == 0 and os.path.isfile(tmp_path / "r3" / "byteps" / "0" / "comm.json")


def test_dprorun_backend_byteps(tmp_path, fake_bpslaunch):
    proc = subprocess.run([sys.executable, "-m", "dprorun.cli", "--backend", "byteps", "--run-dir",
                           str(tmp_path / "run"), "python3", "train.py"], env=fake_bpslaunch, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert os.path.isfile(tmp_path / "run" / "byteps" / "0" / "comm.json") and "bottleneck stage" in proc.stdout
    assert json.load(open(tmp_path / "log.json"))["argv"] == ["python3", "train.py"]
    refused = subprocess.run([sys.executable, "-m", "dprorun.cli", "--backend", "byteps", "-np", "4", "--autotune",
                              "python3", "train.py"], env=fake_bpslaunch, cwd=str(tmp_path), capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "-np, --autotune: not with --backend byteps" in refused.stderr


def test_bpslaunch_dropin_passes_sigterm_on_and_keeps_the_traces(tmp_path, fake_bpslaunch):
    import signal
    import time

    started = tmp_path / "started"
    env = dict(fake_bpslaunch, DPRO_RUN_DIR=str(tmp_path / "run"), FAKE_SLEEP=str(started))
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "launchers", "bpslaunch"), "python3", "train.py"],
                            env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists()
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and time.monotonic() - began < 30
    assert "interrupted by signal" in err and os.path.isfile(tmp_path / "run" / "byteps" / "0" / "comm.json")
    assert json.load(open(tmp_path / "run" / "manifest.json"))["exit_code"] == 143
