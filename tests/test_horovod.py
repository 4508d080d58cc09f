"""Horovod: the timeline reader on constructed and real timelines, `dpro import-horovod`, and real horovod.torch
jobs under `dprorun --backend horovod` and the horovodrun drop-in (skipped where Horovod is not installed:
scripts/install-horovod builds it; .ci/run does)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import EXAMPLES, REPO, run_dprorun, start_dprorun_until
from dprorun.fsutil import TraceError
from dprorun.trace.horovod import read_horovod_timeline, timeline_summary
from dprorun.trace.rundir import inference_set_aside, load_run

try:
    import horovod.torch  # noqa: F401

    HOROVOD = None
except Exception as exc:  # ImportError, or a build that does not match this torch
    HOROVOD = f"Horovod is not installed ({type(exc).__name__}); scripts/install-horovod builds it"
needs_horovod = pytest.mark.skipif(HOROVOD is not None, reason=HOROVOD or "")
EXAMPLE = os.path.join(EXAMPLES, "horovod_mlp.py")


def _constructed(path, cut: int = 0, steps: int = 2, open_negotiation: tuple = (), unfinished: tuple = ()):
    """Two steps of three tensors: a and b fused into one response (same transmission span), c alone;
    `open_negotiation`: the (pid, step)s whose negotiation Horovod left without its E; `unfinished`: those whose
    operation has none ("Did Not Finish")."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros": 1000}}]
    for pid, name in ((1, "allreduce.a"), (2, "allreduce.b"), (3, "allreduce.c")):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
    for step in range(steps):
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
            if (pid, step) in unfinished:
                del events[-1]  # the operation's E
            if (pid, step) in open_negotiation:
                del events[-9]  # the negotiation's E
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


def test_a_negotiation_left_open_ends_at_its_operation_and_loses_no_step(tmp_path):
    # Horovod's cached-response path can write a negotiation's B without its E: every later step of that tensor
    # then nested one level deeper, and the reader counted 2 of a real job's 8 steps (CI, session 47)
    path = _constructed(tmp_path / "tl.json", steps=5, open_negotiation=((1, 1), (2, 1), (3, 2)))
    timeline = read_horovod_timeline(str(path))
    assert timeline.steps == 5 and timeline.trace.meta["unbalanced_events_mended"] == 3
    negotiations = [op for op in timeline.trace.ops if op.phase == "negotiate"]
    assert len(negotiations) == 15 and all(op.end_us - op.start_us in (200, 210) for op in negotiations)
    assert [row["span_ms"] for row in timeline_summary(timeline)["per_step"]] == [1.56] * 5
    # an operation without its E (chrome://tracing's "Did Not Finish"): its step ends at the next negotiation
    path = _constructed(tmp_path / "dnf.json", steps=5, unfinished=((3, 1),))
    timeline = read_horovod_timeline(str(path))
    assert timeline.steps == 5 and timeline.trace.meta["unbalanced_events_mended"] == 1
    assert sorted(op.iteration for op in timeline.trace.ops if op.phase == "operation" and op.tensor == "c") == \
        [0, 2, 3, 4]


def test_a_whole_job_tensorflow_timeline_counts_steps_of_the_gradients_only(tmp_path):
    """horovod.tensorflow names its tensors without horovod.torch's "allreduce." prefix, and its eager calls (dprorun's
    calibration: 40 of them at the window's end) by their op type. Counted as steps, they stretched every step of a
    whole-job timeline (HOROVOD_TIMELINE) to the window's end: median step span 3,804 ms for a 120 ms step."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros": 1000}}]
    names = {1: "DistributedGradientTape_Allreduce/cond/HorovodAllreduce_grad_0", 2: "HorovodBroadcast_dense_kernel_0",
             3: "HorovodAllreduce"}
    events += [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}} for pid, name in names.items()]

    def operation(pid, t0, op="ALLREDUCE"):
        return [{"ph": "B", "name": op, "ts": t0, "pid": pid},
                {"ph": "B", "name": f"GLOO_{op}", "ts": t0 + 10, "pid": pid}, {"ph": "E", "ts": t0 + 90, "pid": pid},
                {"ph": "E", "ts": t0 + 100, "pid": pid, "args": {"dtype": "float32", "shape": "[4]"}}]
    events += operation(2, 0, "BROADCAST")
    for step in range(3):
        events += operation(1, 1_000 + step * 10_000)
    for k in range(8):  # the calibration, after the third step
        events += operation(3, 40_000 + k * 200)
    path = tmp_path / "tf_job.json"
    path.write_text(json.dumps(events))
    timeline = read_horovod_timeline(str(path))
    assert timeline.steps == 3 and timeline.tensors == [names[1]]
    assert all(op.iteration == -1 for op in timeline.trace.ops if op.tensor in (names[2], names[3]))
    assert [row["span_ms"] for row in timeline_summary(timeline)["per_step"]] == [0.1, 0.1, 0.1]


def test_truncated_and_foreign_timelines(tmp_path):
    full = tmp_path / "full.json"
    _constructed(full)
    cut = _constructed(tmp_path / "cut.json", cut=len(full.read_text()) * 2 // 3)
    timeline = read_horovod_timeline(str(cut))
    assert timeline.truncated and timeline.steps <= 2
    # cut after the second step's first negotiation, before any tensor's operation closed it (a job's file cut at
    # exit): the summary's rows are whole steps only, and it says how many it left out
    mid_step = _constructed(tmp_path / "mid.json", cut=full.read_text().index('"ts": 10210'))
    timeline = read_horovod_timeline(str(mid_step))
    summary = timeline_summary(timeline)
    assert timeline.steps == 1 and [r["step"] for r in summary["per_step"]] == [0]
    assert summary["unfinished_steps_left_out"] == 1
    (tmp_path / "bad.json").write_text('{"traceEvents": []}')
    with pytest.raises(TraceError, match="not a Horovod timeline"):
        read_horovod_timeline(str(tmp_path / "bad.json"))
    (tmp_path / "garbage.json").write_text("[\n{\"ph\": ")
    with pytest.raises(TraceError, match="no complete event"):
        read_horovod_timeline(str(tmp_path / "garbage.json"))
    proc = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "import-horovod", str(tmp_path / "bad.json")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not a Horovod timeline" in proc.stderr and "Traceback" not in proc.stderr


def _gradient_events(path) -> dict[str, list[dict]]:
    """Each all-reduced tensor's B / E / X events in file order, by the timeline's tensor name."""
    events = json.loads(path.read_text())
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and "name" in e.get("args", {})}
    found: dict[str, list[dict]] = {name: [] for name in names.values() if name.startswith("allreduce.")}
    for e in events:
        if e.get("ph") in ("B", "E", "X") and names.get(e.get("pid")) in found:
            found[names[e["pid"]]].append(e)
    return found


def _operations_written(path) -> int:
    """The most all-reduce operations Horovod's file began for one gradient tensor (B events), closed or not."""
    return max((sum(e["ph"] == "B" and e.get("name") == "ALLREDUCE" for e in events)
                for events in _gradient_events(path).values()), default=0)


def _event_sequences(path) -> str:
    """The phases of the timeline's first two gradient tensors in file order: what a failure's report needs."""
    shown = list(_gradient_events(path).items())[:2]
    return "\n".join(name + ": " + " ".join(f"{e['ph']}:{e.get('name', '')}" for e in events) for name, events in shown)


@needs_horovod
def test_import_a_timeline_from_plain_horovodrun(tmp_path):
    timeline_path = tmp_path / "tl.json"
    for attempt in range(2):  # once more where Horovod's own file lacks steps (its writer's, not the reader's)
        proc = subprocess.run(["horovodrun", "-np", "2", "--gloo", "--timeline-filename", str(timeline_path),
                               sys.executable, EXAMPLE, "--steps", "8", "--depth", "6"], capture_output=True, text=True,
                              timeout=180, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stderr[-2000:]
        written = _operations_written(timeline_path)
        if written >= 7:
            break
    timeline = read_horovod_timeline(str(timeline_path))
    # 8 linear layers: weight + bias each; every step Horovod wrote is read (the last one's E may be missing at exit)
    assert len(timeline.tensors) == 2 * 8 and written - 1 <= timeline.steps <= written and timeline.steps >= 7, \
        (written, _event_sequences(timeline_path))
    assert sorted(t for group in timeline.fused_responses for t in group) == timeline.tensors
    out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "import-horovod", str(timeline_path), "--json",
                          "-o", str(tmp_path / "chrome.json")], capture_output=True, text=True, timeout=60)
    summary = json.loads(out.stdout)
    assert summary["steps"] == timeline.steps and len(summary["per_step"]) == timeline.steps
    assert all(row["transmit_ms"] > 0 for row in summary["per_step"])
    assert json.loads((tmp_path / "chrome.json").read_text())["traceEvents"]


@needs_horovod
def test_dprorun_backend_horovod_and_the_horovodrun_drop_in(tmp_path):
    # OMP_NUM_THREADS=1 in every Horovod job here: horovodrun, unlike torchrun, leaves it unset, and two ranks with
    # two OpenMP threads each on CI's two cores thrash (3-4x slower)
    run_dir = tmp_path / "run"
    proc, _ = run_dprorun(["--backend", "horovod", "--horovod-timeline", "window", "-np", "2", "--warmup", "2",
                           "--active", "5", "--kineto-iters", "2", "--clean", "1", "python", EXAMPLE, "--steps", "10"],
                          run_dir, timeout=180, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "median iteration time" in proc.stdout and "fused responses per step" in proc.stdout
    assert "no clock probes" not in proc.stdout  # one host, one clock: offsets 0 by construction, no probe needed
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
    from dprorun.replay.build import build_job_model

    assert [row[0] for row in run.ranks[0].meta["calibration"]] == [1 << 12, 1 << 16, 1 << 20, 1 << 22]
    model = build_job_model(run)
    assert model.comm.source.startswith("horovod calibration") and model.comm.bandwidth_bytes_per_us > 0, \
        (run.ranks[0].meta["calibration"], model.notes)
    out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", str(run_dir), "--json"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["predicted_iteration_time_ms"] > 0
    fused = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", str(run_dir), "--json", "--np", "4"],
                           capture_output=True, text=True, timeout=300, cwd=REPO)
    doc = json.loads(fused.stdout)  # a world-size what-if prices Horovod's fused responses, not 52 collectives
    assert doc["buckets"] < 52 and any("Horovod fusion at 128 MB" in note for note in doc["notes"])
    copy = tmp_path / "copy.json"
    env = dict(os.environ, DPRO_RUN_DIR=str(tmp_path / "run2"), OMP_NUM_THREADS="1")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the one host\nlocalhost slots=2\n")
    # horovodrun's tuning and runner flags go to the real horovodrun as given (each was "unrecognized" before)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "launchers", "horovodrun"), "-np", "2", "--gloo",
                           "--hostfile", str(hostfile), "--timeline-filename", str(copy), "--fusion-threshold-mb", "1",
                           "--cache-capacity", "0", "--start-timeout", "60", "--log-level", "WARNING",
                           "--no-stall-check", "python", EXAMPLE, "--steps", "6"],
                          capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    refused = subprocess.run([sys.executable, os.path.join(REPO, "launchers", "horovodrun"), "-np", "2", "--autotune",
                              "python", EXAMPLE], capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert refused.returncode == 2 and "a profile would mix settings" in refused.stderr
    # the user asked horovodrun for a timeline: the whole job's (the writer can still hold the last step's events
    # when the job exits, seen under load)
    assert read_horovod_timeline(str(copy)).steps in (5, 6)


SPARSE_SCRIPT = """
import torch, torch.nn as nn
import horovod.torch as hvd
hvd.init(); torch.manual_seed(0)
model = nn.Sequential(nn.EmbeddingBag(5000, 32, mode="sum", sparse=True), nn.Linear(32, 64), nn.Linear(64, 4))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
ids, y = torch.randint(0, 5000, (16, 8)), torch.randint(0, 4, (16,))
for step in range(8):
    opt.zero_grad()
    nn.functional.cross_entropy(model(ids), y).backward()
    opt.step()
    if step == 4:  # a validation pass
        model.eval()
        with torch.no_grad():
            model(ids); model(ids)
        model.train()
head = nn.Linear(8, 4)  # the next model, from the clean iterations on: profiling ends where its optimizer is built
opt = hvd.DistributedOptimizer(torch.optim.SGD(head.parameters(), lr=0.1), named_parameters=head.named_parameters())
for step in range(3):
    opt.zero_grad()
    nn.functional.cross_entropy(head(ids.float()), y).backward()
    opt.step()
"""


@needs_horovod
def test_a_sparse_gradient_under_horovod_is_an_allgather_of_its_rows_timed_in_order(tmp_path):
    """horovod.torch all-gathers a sparse gradient and step() calls its handle instead of synchronize(): the
    record holds the rows' bytes (not the table's) and closes when the gather returns, so the records after it
    close in order (before, each later record took its predecessor's completion). The script then trains another
    model: a DistributedOptimizer built after steps ends the clean iterations there, warned (its records were mixed
    into the window's or the clean ones before). A validation pass after the fifth step: its iteration (4) is set aside."""
    script = tmp_path / "sparse.py"
    script.write_text(SPARSE_SCRIPT)
    run_dir = tmp_path / "run"
    proc, _ = run_dprorun(["--backend", "horovod", "-np", "2", "-q", "--warmup", "2", "--active", "4",
                           "--kineto-iters", "1", "--clean", "2", "python", str(script)], run_dir, timeout=180,
                          env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = json.loads((run_dir / "rank_0" / "events.json").read_text())
    sparse = [b for b in events["buckets"] if b.get("sparse")]
    assert [b["params"] for b in sparse] == [["0.weight"]] and sparse[0]["dense_nbytes"] == 5000 * 32 * 4
    assert sparse[0]["nbytes"] == 16 * 8 * (32 * 4 + 8)  # 128 rows (uncoalesced lookups) and their indices
    for iteration in set(events["window"]["kineto_iterations"]) | {3, 4}:
        records = [c for c in events["comm"] if c[0] == iteration]
        assert len(records) == len(events["buckets"]) and all(c[5] and c[5] >= c[4] for c in records)
    assert events["window"]["cut_at"] == 7
    assert events["inference_passes"] == [[4, 2]] and inference_set_aside(events) == {4}
    assert any("another model (a new hvd.DistributedOptimizer) at iteration 7" in w for w in events["warnings"])


def _short_window_run(script, run_dir):
    """`script` under `dprorun --backend horovod -np 2` with a window of 5 iterations after 2 (the first under the
    profiler) and 2 clean ones; it must succeed."""
    proc, _ = run_dprorun(["--backend", "horovod", "-np", "2", "-q", "--warmup", "2", "--active", "5",
                           "--kineto-iters", "1", "--clean", "2", "python", str(script)], run_dir, timeout=180,
                          env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@needs_horovod
def test_horovod_collectives_the_script_calls_itself_are_timed_not_the_optimizers(tmp_path):
    """A contrastive loss over every rank's features (hvd.allgather) and the loss averaged for logging
    (hvd.allreduce) each step: replayed as compute without a word under a network what-if. The script's calls
    are timed in the window's iterations, once a step each, and so is the all-reduce autograd runs back through
    hvd.allgather (it reaches horovod.torch.mpi_ops directly: untimed before); the DistributedOptimizer's
    all-reduces, which reach horovod.torch.mpi_ops directly too, are not among them."""
    script = tmp_path / "gather.py"
    script.write_text(
        "import torch, torch.nn as nn, horovod.torch as hvd\n"
        "hvd.init(); torch.manual_seed(0); torch.set_num_threads(1)\n"
        "model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 32))\n"
        "opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),\n"
        "                               named_parameters=model.named_parameters())\n"
        "x = torch.randn(32, 64)\n"
        "for step in range(12):\n"
        "    opt.zero_grad()\n"
        "    z = nn.functional.normalize(model(x), dim=1)\n"
        "    logits = z @ hvd.allgather(z, name='features').t()\n"
        "    loss = nn.functional.cross_entropy(logits, torch.arange(32) + 32 * hvd.rank())\n"
        "    loss.backward(); opt.step()\n"
        "    hvd.allreduce(loss.detach(), name='loss')\n")
    run_dir = tmp_path / "run"
    _short_window_run(script, run_dir)
    rows = json.loads((run_dir / "rank_0" / "events.json").read_text())["script_collectives"]
    assert {(row[1], row[2]) for row in rows} == {("horovod.torch.allgather", 1), ("horovod.torch.allreduce", 1),
                                                  ("horovod.torch.allgather (backward)", 1)}
    assert {row[0] for row in rows} == set(range(2, 7))
    from dprorun.replay.build import build_job_model
    from dprorun.replay.predict import predict
    from dprorun.replay.whatif import WhatIf

    model = build_job_model(load_run(str(run_dir)))
    assert model.collectives_outside_packs[0] == ["horovod.torch.allgather", "horovod.torch.allgather (backward)",
                                                  "horovod.torch.allreduce"]
    assert any(n.startswith("caution: ") and "horovod.torch.allgather" in n
               for n in predict(model, WhatIf(bandwidth_gbit=1.0), detail="coarse").notes)


@needs_horovod
def test_a_copy_of_the_model_horovod_trains_is_the_one_horovodrun_makes(tmp_path):
    """copy.deepcopy(model) and torch.save(model) of the model a DistributedOptimizer trains failed under dprorun
    ("cannot pickle '_thread.lock' object": the hooks' forward pre-hook on it, a bound method of the tracker, took
    the session along), and torch.jit.script(model) failed compiling that hook ("UnsupportedNodeError"); a copy
    and TorchScript now leave the hook out (runtime/copies.py) and the original keeps it: a validation pass
    between steps is still counted."""
    script = tmp_path / "copies.py"
    script.write_text(
        "import copy, io, torch, torch.nn as nn, horovod.torch as hvd\n"
        "hvd.init(); torch.manual_seed(0); torch.set_num_threads(1)\n"
        "model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))\n"
        "opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()),\n"
        "                               named_parameters=model.named_parameters())\n"
        "x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))\n"
        "for step in range(12):\n"
        "    opt.zero_grad(); nn.functional.cross_entropy(model(x), y).backward(); opt.step()\n"
        "    ema = copy.deepcopy(model); saved = io.BytesIO(); torch.save(model, saved)\n"
        "    assert sum(len(m._forward_pre_hooks) for m in ema.modules()) == 0 and b'dprorun' not in saved.getvalue()\n"
        "    if step == 4:\n"
        "        with torch.no_grad():\n"
        "            model(x)\n"
        "scripted = torch.jit.script(model)  # TorchScript compiles a module's forward hooks: ours are left out\n"
        "assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 1  # and back on the model\n")
    run_dir = tmp_path / "run"
    _short_window_run(script, run_dir)
    events = json.loads((run_dir / "rank_0" / "events.json").read_text())
    assert events["comm"] and sum(n for _, n in events["inference_passes"]) == 1, events["inference_passes"]


@needs_horovod
def test_a_gan_of_two_distributed_optimizers_is_read_step_by_step(tmp_path):
    """benchmarks/shapes/hvd_session36.py --gan: a DistributedOptimizer each for the discriminator and the generator,
    stepped in turn. Each optimizer step was an iteration (9.40 ms against the script's own 20.67 ms step), and
    the replay failed on the other optimizer's buckets missing from every iteration ("no replay of the job as it
    ran: ('bucket4', 0)"). Now an iteration is the script's step, holding both models' all-reduces. The generator
    samples every 6 steps: passes counted on the model of the optimizer that steps second too."""
    run_dir = tmp_path / "gan"
    proc, _ = run_dprorun(["--backend", "horovod", "-np", "2", "-q", "--warmup", "3", "--active", "6",
                           "--kineto-iters", "2", "--clean", "8", "python",
                           os.path.join(REPO, "benchmarks", "shapes", "hvd_session36.py"), "--gan", "--steps", "22",
                           "--sample-every", "6"],
                          run_dir, timeout=180, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = json.loads((run_dir / "rank_0" / "events.json").read_text())
    assert len(events["buckets"]) == 8  # both models' weights and biases
    # the generator's samples under no_grad after steps 6 and 12 (and 18): counted on the second optimizer's model
    assert events["inference_passes"][:2] == [[6, 1], [12, 1]] and {6, 12} <= inference_set_aside(events)
    for iteration in (4, 5):
        assert len([c for c in events["comm"] if c[0] == iteration]) == 8
    out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", str(run_dir), "--json"],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["self_check"]["status"] in ("agrees", "disagrees", "uncertain")


@needs_horovod
def test_a_strategy_reaches_horovod_through_its_own_knobs_and_a_failing_rank_fails_the_job(tmp_path):
    """One launch for two things: a strategy's fusion threshold and cycle time reach every rank as horovodrun's
    own flags, and a rank that exits non-zero fails the job with horovodrun's code named."""
    from dprorun.strategy import Strategy, save_strategy

    path = tmp_path / "strategy.json"
    save_strategy(Strategy(horovod_fusion_threshold_mb=1.0, horovod_cycle_time_ms=2.5), str(path))
    script = tmp_path / "knobs.py"
    script.write_text("import os\nimport horovod.torch as hvd\nhvd.init()\n"
                      "print('knobs', os.environ.get('HOROVOD_FUSION_THRESHOLD'), os.environ.get('HOROVOD_CYCLE_TIME'))\n"
                      "if hvd.rank() == 1:\n    raise RuntimeError('rank 1 fails on purpose')\n")
    run_dir = tmp_path / "run"
    proc, _ = run_dprorun(["--backend", "horovod", "-np", "2", "--strategy", str(path), "python", str(script)],
                          run_dir, timeout=120, env={"OMP_NUM_THREADS": "1"})
    assert "knobs 1048576 2.5" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    manifest = json.load(open(run_dir / "manifest.json"))
    assert manifest["horovod_args"] == ["--fusion-threshold-mb", "1", "--cycle-time-ms", "2.5"]
    assert proc.returncode != 0 and "horovodrun exited with code" in proc.stderr, proc.stderr[-2000:]
    # named from the hooks' records (before: "its output above names the failing rank", in horovodrun's own words)
    assert "(rank 1 raised RuntimeError: rank 1 fails on purpose)" in proc.stderr, proc.stderr[-2000:]


@needs_horovod
def test_a_rank_raising_before_hvd_init_is_named_with_its_error(tmp_path):
    """A rank missing its data shard raises before hvd.init: its hooks had recorded nothing, so dprorun said only
    "horovodrun exited with code 1 (its output above names the failing rank)", where a DDP job's failing rank is
    named with its error. The rank's error now goes to an error file of its own in the run directory (torch
    elastic's format; horovodrun gives its ranks none), which the launcher reads."""
    script = tmp_path / "early.py"
    script.write_text("import os\nimport horovod.torch as hvd\nif os.environ['HOROVOD_RANK'] == '1':\n"
                      "    raise FileNotFoundError('shard_1.bin is missing on this rank')\nhvd.init()\n")
    run_dir = tmp_path / "run"
    proc, elapsed = run_dprorun(["--backend", "horovod", "-np", "2", "python", str(script)], run_dir, timeout=120)
    assert proc.returncode == 1 and elapsed < 60, proc.stderr[-2000:]
    assert ("horovodrun exited with code 1 (rank 1 raised FileNotFoundError: shard_1.bin is missing on this rank)"
            in proc.stderr), proc.stderr[-2000:]
    assert "no trace was recorded" in proc.stderr  # nothing to analyse: no rank stepped
    assert json.load(open(run_dir / "manifest.json"))["status"] == "failed"


HOROVOD_THREAD_RAISES = """
import threading, torch, torch.nn as nn, torch.nn.functional as F
import horovod.torch as hvd
hvd.init(); torch.manual_seed(0); torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters())
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
def train():
    for step in range(40):
        if step == 8 and hvd.rank() == 0:
            raise RuntimeError("bad batch at step 8")
        opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
worker = threading.Thread(target=train); worker.start(); worker.join()
print("done", flush=True)
hvd.shutdown()
"""


def test_a_shutdown_while_a_rank_waits_in_an_allreduce_ends_in_bounded_time(tmp_path):
    """Rank 0's training thread raises inside the window and its main thread calls hvd.shutdown() while rank 1
    waits in the step's all-reduce, which only that shutdown fails. Plain horovodrun: exit 0 in 11 s. dprorun ran
    the window's calibration first, its first all-reduce waiting for rank 1 (Horovod's have no timeout) for good,
    and horovodrun took no SIGTERM then. Now the ranks meet through an all-reduce polled for DPRO_TEARDOWN_WAIT_S
    seconds first, else the work is skipped: exit 0, the reasons said."""
    script = tmp_path / "thread_raises.py"
    script.write_text(HOROVOD_THREAD_RAISES)
    proc, elapsed = run_dprorun(["--backend", "horovod", "-np", "2", "python", str(script)], tmp_path / "run",
                                timeout=150, env={"OMP_NUM_THREADS": "1", "DPRO_TEARDOWN_WAIT_S": "3"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert elapsed < 60, elapsed
    assert "another rank did not reach Horovod's shutdown within 3 s of rank 0" in proc.stderr, proc.stderr[-2000:]
    assert "[0]<stdout>:done" in proc.stdout and "[1]<stdout>:done" in proc.stdout


def test_an_engines_failure_names_the_rank_whose_error_is_its_own(tmp_path):
    """horovodrun (or torchrun as --launcher) says only that a rank failed: the hooks' records name the rank whose
    script raised first-hand; ranks that failed because of it (Horovod shut down, a gloo peer gone) come after."""
    from dprorun.launch import raised_in_ranks

    for rank, warnings in ((0, ["training script raised HorovodInternalError: Horovod has been shut down."]),
                           (1, ["low disk", "training script raised ValueError: bad batch"])):
        (tmp_path / f"rank_{rank}").mkdir()
        (tmp_path / f"rank_{rank}" / "events.json").write_text(json.dumps({"warnings": warnings}))
    assert raised_in_ranks(str(tmp_path), 4) == "rank 1 raised ValueError: bad batch; then rank(s) [0] failed with it"
    tf_error = ("training script raised AttributeError: in user code:\n\n    File \"train.py\", line 15, in step  *\n"
                "        grads = tape.gradient(loss)\n\n    AttributeError: 'Variable' object has no attribute 'ref'\n")
    for rank in (2, 3):  # TensorFlow's errors carry their traceback: the error's own line is their last
        (tmp_path / f"rank_{rank}").mkdir(exist_ok=True)
        (tmp_path / f"rank_{rank}" / "events.json").write_text(json.dumps({"warnings": [tf_error]}))
    assert raised_in_ranks(str(tmp_path), 4) == ("rank 1 raised ValueError: bad batch; ranks [2, 3] raised "
                                                 "AttributeError: 'Variable' object has no attribute 'ref'; then "
                                                 "rank(s) [0] failed with it")
    for rank in (2, 3):
        (tmp_path / f"rank_{rank}" / "events.json").unlink()
    (tmp_path / "rank_1" / "events.json").write_text("{truncated")
    assert raised_in_ranks(str(tmp_path), 4) == ""  # only consequences left: horovodrun's own output is pointed to
    # Horovod's own failure on every rank (op=hvd.Adasum where Horovod has no MPI): wrapped in HorovodInternalError
    # as a peer's loss is, and nothing was named; it tells of no peer lost: named
    adasum = "training script raised HorovodInternalError: No Adasum operation enabled"
    for rank in (0, 1):
        (tmp_path / f"rank_{rank}" / "events.json").write_text(json.dumps({"warnings": [adasum]}))
    assert raised_in_ranks(str(tmp_path), 4) == "ranks [0, 1] raised HorovodInternalError: No Adasum operation enabled"


@needs_horovod
def test_horovod_autotune_ranks_knobs_by_replay_and_trials_decide(tmp_path):
    """--autotune --backend horovod: a dry-run profile of the real job, (threshold, cycle) candidates ranked by
    the replayed fusion model, a real trial window per candidate with the knobs passed to horovodrun, and the
    fastest measured kept only if it beats the job's own settings; every trial is in autotune.json."""
    from dprorun.optimize.horovod import rank_horovod_knobs
    from dprorun.replay.build import build_job_model

    run_dir = tmp_path / "run"
    window = ["--warmup", "2", "--active", "5", "--kineto-iters", "1", "--clean", "1"]
    # --autotune-trials 1: the best-ranked setting alone gets a trial window (default 3; each costs a launch)
    proc, _ = run_dprorun(["--backend", "horovod", "--autotune", "--autotune-trials", "1", "-np", "2", *window,
                           "python", EXAMPLE, "--steps", "12"], run_dir, timeout=400, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    phases = json.load(open(run_dir / "autotune.json"))["phases"]
    names = [p["phase"] for p in phases]
    assert names[:2] == ["profiling", "searching"] and "deciding" in names and names[-1] == "done"
    trials = [p for p in phases if p["phase"] == "trial"]
    assert len(trials) <= 1
    deciding = next(p for p in phases if p["phase"] == "deciding")
    if trials:  # the replay found candidates: each was run for real with its own knobs
        for trial in trials:
            manifest = json.load(open(os.path.join(trial["run_dir"], "manifest.json")))
            assert "--fusion-threshold-mb" in manifest["horovod_args"] and trial["measured_ms"] > 0
        if deciding["keep"]:  # the fastest trial, then confirmed in a second round (own settings, then it)
            best = min(t["measured_ms"] for t in trials)
            assert deciding["rounds"][0] == [deciding["rounds"][0][0], best] and len(deciding["rounds"]) == 2
            assert all(trial < own for own, trial in deciding["rounds"])
            assert json.load(open(run_dir / "manifest.json"))["horovod_args"]
    else:
        assert deciding["keep"] is False
    # the ranking itself, on the profiled window
    profiled = load_run(str(run_dir / "autotune" / "profile"))
    candidates = rank_horovod_knobs(build_job_model(profiled), top=3)
    assert all(c.predicted_ms < c.baseline_ms for c in candidates)
    assert [c.predicted_ms for c in candidates] == sorted(c.predicted_ms for c in candidates)


@needs_horovod
def test_a_strategy_groups_horovod_allreduces_and_remote_ranks_ship_their_traces(tmp_path):
    """horovod_groups in a strategy become DistributedOptimizer(groups=...) through the hooks (grouped
    allreduce), with no change to the script; its hvd.Compression.fp16 recorded as the half-size bytes it sends.
    The same job declares its ranks on two hosts (DPRO_TEST_HOSTS): with
    no torch.distributed in a Horovod job, a rank whose files are not on rank 0's disk ships them through
    Horovod's own alltoall."""
    from dprorun.strategy import Strategy, save_strategy

    names = [f"{2 * i}.{kind}" for i in range(26) for kind in ("weight", "bias")]
    path = tmp_path / "strategy.json"
    save_strategy(Strategy(horovod_groups=[names[:26], names[26:]]), str(path))
    run_dir = tmp_path / "run"
    proc, _ = run_dprorun(["--backend", "horovod", "-np", "2", "-q", "--strategy", str(path), "--warmup", "2",
                           "--active", "3", "--kineto-iters", "1", "--clean", "1", "python", EXAMPLE, "--steps",
                           "8", "--compression", "fp16"], run_dir, timeout=180,
                          env={"OMP_NUM_THREADS": "1", "DPRO_TEST_HOSTS": "hostA,hostB"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    applied = json.load(open(run_dir / "rank_0" / "events.json"))["strategy"]["applied"]
    assert applied["horovod_groups"] == [26, 26]
    assert (run_dir / "rank_1" / "GATHERED_FROM").read_text() == "hostB"
    assert not (run_dir / "rank_0" / "GATHERED_FROM").exists() and not list(run_dir.glob(".gather-*"))
    run = load_run(str(run_dir))
    assert run.ranks[1].host == "hostB"
    for trace in run.ranks.values():  # each group is one all-reduce, recorded with its parameters and the bytes
        # hvd.Compression.fp16 sends: half the gradients'
        assert len(trace.buckets) == 2 and sorted(len(b.params) for b in trace.buckets) == [26, 26]
        assert all(b.buffer_nbytes == 2 * b.nbytes for b in trace.buckets)
    out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", str(run_dir), "--json"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["buckets"] == 2
    # a horovod.torch job runs without Horovod's timeline by default (its dynamic mode slows every iteration), and
    # says nothing of a missing one; each rank's cores and threads are recorded as for DDP
    assert not (run_dir / "horovod_timeline.json").exists() and "wrote no timeline" not in proc.stderr
    events = json.load(open(run_dir / "rank_1" / "events.json"))
    assert events["cpu"]["local_ranks"] == 2 and events["cpu"]["compute_threads"] == 1
    # the float16 it sends timed against float32 of the same bytes (gloo sums float16 in software)
    [[dtype, nbytes, us, float32_us]] = events["calibration_dtypes"]
    assert dtype == "float16" and nbytes == 1 << 22 and us > 0 and float32_us > 0


def test_the_horovod_timeline_mode_follows_the_framework_unless_asked(monkeypatch):
    """auto: the window's timeline for horovod.tensorflow scripts (their all-reduce spans come from it), none for
    horovod.torch scripts; an explicit mode is kept. A user's HOROVOD_TIMELINE file (as horovodrun users ask for
    one) makes it the whole job's, which the launch copies there: before, the window mode's --timeline-filename
    DYNAMIC took its place and the user's file was never written."""
    from dprorun.config import HorovodConfig, JobConfig
    from dprorun.launch import horovod_timeline_mode

    def mode(script, timeline="auto"):
        return horovod_timeline_mode(JobConfig(command=["python", script, "--steps", "3"],
                                               horovod=HorovodConfig(timeline=timeline)))

    assert mode(os.path.join(EXAMPLES, "horovod_tf.py")) == "window"
    assert mode(os.path.join(EXAMPLES, "horovod_tf_keras.py")) == "window"
    assert mode(EXAMPLE) == "off" and mode("missing.py") == "off"
    assert mode(EXAMPLE, "window") == "window" and mode(os.path.join(EXAMPLES, "horovod_tf.py"), "off") == "off"
    monkeypatch.setenv("HOROVOD_TIMELINE", "/tmp/user_timeline.json")
    assert mode(os.path.join(EXAMPLES, "horovod_tf.py")) == "job" and mode(EXAMPLE) == "job"
    assert mode(EXAMPLE, "window") == "job" and mode(EXAMPLE, "off") == "off"  # off: the variable reaches Horovod
    monkeypatch.setenv("HOROVOD_TIMELINE", "DYNAMIC")  # Horovod's own start/stop mode: no file asked for
    assert mode(os.path.join(EXAMPLES, "horovod_tf.py")) == "window" and mode(EXAMPLE) == "off"


def _horovod_tf() -> str:
    try:
        import horovod.tensorflow  # noqa: F401

        return ""
    except Exception as exc:  # not built with TensorFlow (scripts/install-horovod after scripts/install-tf does)
        return f"horovod.tensorflow is not importable ({type(exc).__name__}: {str(exc)[:80]})"


@pytest.mark.skipif(bool(_horovod_tf()), reason=_horovod_tf() or "")
def test_a_horovod_tensorflow_job_is_profiled_and_replayed(tmp_path):
    """A horovod.tensorflow job (DistributedGradientTape in a tf.function step) under --backend horovod, unchanged:
    its steps found, TensorFlow's profiler over the detailed tier, each gradient's all-reduce from its ready time on
    the worker to its end in Horovod's timeline, a calibration through horovod.tensorflow, and the replay."""
    from dprorun.trace.model import OpKind

    run_dir = tmp_path / "run"
    line = ["--backend", "horovod", "-np", "2", "-q", "--warmup", "3", "--active", "7", "--kineto-iters", "3",
            "--clean", "2", "python", os.path.join(EXAMPLES, "horovod_tf.py"), "--steps", "14", "--width", "64"]
    proc, _ = run_dprorun(line, run_dir, env={"OMP_NUM_THREADS": "1"})
    if "launching the job again without TensorFlow's profiler" in proc.stderr:  # its stop crashed each time (test_tf.py)
        proc, _ = run_dprorun(["--overwrite", *line], run_dir, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "median step" in proc.stdout and "nothing to profile" not in proc.stderr
    events = json.loads((run_dir / "rank_1" / "events.json").read_text())
    tracker = next(t for t in events["trackers"] if t.get("tf"))
    assert tracker["framework"] == "horovod" and tracker["step_functions"] == 1
    assert len(tracker["packs"]) == 8  # the model's 8 gradients, once (the step is traced twice)
    assert max(p["bytes"][0] for p in tracker["packs"]) == 13 * 13 * 64 * 64 * 4  # the dense kernel
    assert [row[0] for row in events["calibration"]] and all(row[1] > 0 for row in events["calibration"])
    run = load_run(str(run_dir))
    profiled = set(events["window"]["kineto_iterations"])
    for rank, trace in run.ranks.items():
        assert (run_dir / f"rank_{rank}" / "xplane.pb").exists()
        comm = [op for op in trace.ops if op.kind is OpKind.COMM and op.tensor.startswith("bucket")]
        assert {op.iteration for op in comm} == profiled, rank
        assert len(comm) == 8 * len(profiled) and all(op.nbytes > 0 and op.end_us > op.start_us for op in comm)
        assert any(op.kind is OpKind.BW and op.source == "xplane" for op in trace.ops)
    out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", str(run_dir), "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert doc["predicted_iteration_time_ms"] > 0 and "horovod" in doc["comm_model"]["source"]
    if "latency-bound" in doc["comm_model"]["source"]:  # eager calls on 2 cores: 12-23 ms each whatever their bytes
        assert any("did not grow with their bytes" in note for note in doc["notes"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["backend"] == "horovod" and summary["horovod"]["steps"] >= 2
    assert summary["self_check"]["replay_ms"] > 0


def test_a_horovod_calibration_whose_scatter_hides_its_bytes_is_priced_as_latency_and_says_so():
    """Calibrations recorded by horovod.tensorflow's eager calls on this 2-core host: 12-23 ms a call from 4 KiB to
    4 MiB in no order of size. A CI host fitted a slope <= 0 from such calls and the model fell back, silently, to
    the trace's one size with no latency; a slope fitted from the scatter priced bytes at 12 Gbit/s as a measure.
    Both are latency-bound now, by name; a calibration that grows with its bytes keeps its line."""
    from dprorun.replay.template import LATENCY_BOUND, horovod_comm_model

    falling = [[4096, 16514.7], [65536, 15054.5], [1048576, 12697.2], [4194304, 13233.1]]
    scattered = [[4096, 14775.5], [65536, 12153.1], [1048576, 22972.9], [4194304, 17055.8]]
    for calibration in (falling, scattered):
        model, negotiation_us = horovod_comm_model(calibration, [], 2, 1000.0)
        assert model.source == LATENCY_BOUND and negotiation_us > 5000
        median_call = sorted(t for _, t in calibration)[1:3]
        assert 2 * negotiation_us + 500 == pytest.approx(sum(median_call) / 2)  # the median call, less half a cycle
        byte_time_4mib = 4194304 / model.bandwidth_bytes_per_us  # 2 ranks: one ring step's bytes, twice over 2
        assert byte_time_4mib >= max(t for _, t in calibration) - min(t for _, t in calibration) - 1
    growing = [[4096, 900.0], [65536, 1300.0], [1048576, 9000.0], [4194304, 35000.0]]
    model, _ = horovod_comm_model(growing, [], 2, 1000.0)
    assert model.source == "horovod calibration (one response per call)"
    assert 4194304 / model.bandwidth_bytes_per_us == pytest.approx(34100, rel=0.05)


def test_a_job_whose_hooks_saw_no_step_says_what_they_need():
    """Hooks installed but no step seen (horovod.tensorflow called eagerly, a TF strategy never run): the job's end
    says what the hooks need to see one."""
    from types import SimpleNamespace

    from dprorun.runtime.session import no_step_seen

    eager_hvd_tf = no_step_seen([SimpleNamespace(framework="horovod", step_functions=set())])
    assert "nothing to profile" in eager_hvd_tf and "@tf.function" in eager_hvd_tf
    assert "strategy.run" in no_step_seen([SimpleNamespace(framework="tf")])
    assert "no step ran" in no_step_seen([SimpleNamespace(framework="ddp")])


def test_a_tf_gradient_read_ready_after_its_horovod_operation_began_is_enqueued_by_that_start():
    """horovod.tensorflow: a tensor's all-reduce runs from its gradient being ready (the TF profile) to the end of its
    operation in Horovod's timeline; a ready time the profile puts after the operation's start (a producing op it
    names otherwise, read from the last op of the scope) is not the tensor's: the operation's start bounds it, so the
    all-reduce keeps its length instead of shrinking to nothing."""
    from dprorun.trace.horovod import HorovodTimeline
    from dprorun.trace.model import Op, OpKind, RankTrace
    from dprorun.trace.tf_records import add_tf_records
    from dprorun.trace.xplane import TFProfile

    packs = [{"tensors": ["dense/kernel/grad:0"], "bytes": [1024], "op": "HorovodAllreduce_k"},
             {"tensors": ["dense/bias/grad:0"], "bytes": [256], "op": "HorovodAllreduce_b"}]
    doc = {"trackers": [{"framework": "horovod", "tf": True, "packs": packs}], "window": {"kineto_iterations": [0]},
           "iteration_starts_us": [0.0, 10_000.0], "grad_ready": [], "spans": [], "comm": []}
    compute = [Op("MatMul", OpKind.FW, 0, 100.0, 1000.0, args={"op": "dense/MatMul"}),
               Op("MatMulGrad", OpKind.BW, 0, 1000.0, 3000.0, args={"op": "dense/kernel/grad"}),
               # the bias's gradient op is named otherwise: its ready time falls back to its scope's last op
               Op("BiasAddGrad", OpKind.BW, 0, 3000.0, 3100.0, args={"op": "dense/bias/BiasAddGrad"}),
               Op("Late", OpKind.BW, 0, 3100.0, 6000.0, args={"op": "dense/bias/later_op"})]
    timeline = RankTrace(rank=0, host="h", ops=[
        Op("allreduce", OpKind.COMM, 0, 3200.0, 5000.0, iteration=0, tensor="scope/HorovodAllreduce_k",
           phase="operation", source="horovod"),
        Op("allreduce", OpKind.COMM, 0, 3300.0, 4000.0, iteration=0, tensor="scope/HorovodAllreduce_b",
           phase="operation", source="horovod")])
    add_tf_records(doc, TFProfile(compute=compute, collectives=[], steps=[(0, 0.0, 10_000.0)]),
                   HorovodTimeline("timeline.json", timeline, ["k", "b"], 1, []))
    comm = {row[2]: row for row in doc["comm"]}
    assert comm[0][3] == 3000.0 and comm[0][-1] == 5000.0  # ready when its gradient op ended
    assert comm[1][3] == 3300.0 and comm[1][-1] == 4000.0  # read ready at 6000: bounded by its operation's start


def test_a_horovod_script_launched_without_horovodrun_is_told_its_ranks_ran_alone(tmp_path):
    """`dprorun -np 2 python horovod_script.py` (no --backend horovod): torch elastic starts the ranks, hvd.init
    finds no horovodrun and each rank trains alone (hvd.size() 1); that was profiled and summarised as a job with no
    word. Now each rank says so at hvd.init and the summary keeps it."""
    proc, _ = run_dprorun(["-np", "2", "--warmup", "2", "--active", "3", "--clean", "2", "python", EXAMPLE,
                           "--steps", "10"], tmp_path / "run", timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = "each of the 2 ranks runs Horovod alone (hvd.size() is 1)"
    assert said in proc.stderr and said in proc.stdout and "dprorun --backend horovod -np 2" in proc.stdout


DDP_IMPORTING_HOROVOD = """
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
import horovod.torch  # imported, never used: as PyTorch-Ignite's idist imports it where Horovod is installed
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
for step in range(20):
    opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
dist.destroy_process_group()
"""


@needs_horovod
def test_a_ddp_job_that_imports_horovod_torch_is_profiled_as_ddp(tmp_path):
    """A DDP script that imports horovod.torch and never uses it (PyTorch-Ignite's trainer does, where Horovod is
    installed): the Horovod tracker was the session's first, the DDP module not its primary, and the job said
    "horovod.torch was initialised, but no hvd.DistributedOptimizer was built" and replayed nothing. The Horovod
    tracker joins the session at the first DistributedOptimizer now."""
    script = tmp_path / "ddp_hvd_import.py"
    script.write_text(DDP_IMPORTING_HOROVOD)
    run_dir = tmp_path / "run"
    proc, _ = run_dprorun(["-np", "2", "--warmup", "2", "--active", "6", "--kineto-iters", "2", "--clean", "6",
                           "python", str(script)], run_dir, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert "hvd.DistributedOptimizer" not in said and "the replay of the job as it ran (" in said, said[-3000:]
    events = json.loads((run_dir / "rank_0" / "events.json").read_text())
    assert [t.get("framework", "ddp") for t in events["trackers"]] == ["ddp"]


@needs_horovod
def test_gradients_a_horovod_script_shares_itself_are_its_buckets(tmp_path):
    """No hvd.DistributedOptimizer: the script averages its gradients with horovod.torch's own calls, here the
    weights' by hvd.allreduce_async_ (each waited for by hvd.synchronize before the step) and the biases' by one
    hvd.grouped_allreduce. It ran unprofiled ("nothing to profile", session 51's shapes); now each call is a bucket
    of the step (runtime/gradient_calls.py), the async ones ended by their synchronize, and the job is replayed."""
    script = tmp_path / "by_hand.py"
    script.write_text(
        "import torch, torch.nn as nn, horovod.torch as hvd\n"
        "hvd.init(); torch.manual_seed(0); torch.set_num_threads(1)\n"
        "model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))\n"
        "hvd.broadcast_parameters(model.state_dict(), root_rank=0)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)\n"
        "weights = [p for n, p in model.named_parameters() if n.endswith('weight')]\n"
        "biases = [p for n, p in model.named_parameters() if n.endswith('bias')]\n"
        "x, y = torch.randn(32, 64), torch.randint(0, 8, (32,))\n"
        "for step in range(12):\n"
        "    opt.zero_grad()\n"
        "    nn.functional.cross_entropy(model(x), y).backward()\n"
        "    handles = [hvd.allreduce_async_(p.grad, op=hvd.Average, name=f'w{i}') for i, p in enumerate(weights)]\n"
        "    for p, g in zip(biases, hvd.grouped_allreduce([p.grad for p in biases], op=hvd.Average, name='b')):\n"
        "        p.grad.copy_(g)\n"
        "    for h in handles:\n"
        "        hvd.synchronize(h)\n"
        "    opt.step()\n")
    run_dir = tmp_path / "run"
    proc = _short_window_run(script, run_dir)
    assert "nothing to profile" not in proc.stderr
    events = json.loads((run_dir / "rank_0" / "events.json").read_text())
    tracker = events["trackers"][0]
    assert (tracker["framework"], tracker["backend"], tracker["asynchronous"], tracker["serial"]) == (
        "collectives", "horovod", True, True)  # the async calls, and the grouped call that returns when done
    assert [b["params"] for b in events["buckets"]] == [["0.weight"], ["2.weight"], ["4.weight"],
                                                        ["0.bias", "2.bias", "4.bias"]]
    assert [b["nbytes"] for b in events["buckets"]] == [64 * 256 * 4, 256 * 256 * 4, 256 * 8 * 4, (256 + 256 + 8) * 4]
    records = [r for r in events["comm"] if r[0] == 3]  # (iteration, ddp, bucket, ready, enqueue, done)
    assert sorted(r[2] for r in records) == [0, 1, 2, 3] and all(r[5] >= r[4] for r in records)
    from dprorun.replay.build import build_job_model
    from dprorun.replay.predict import predict
    from dprorun.replay.whatif import WhatIf

    model = build_job_model(load_run(str(run_dir)))
    assert model.framework == "collectives" and "horovod.torch" in model.bucket_layout_fixed
    prediction = predict(model, WhatIf(), detail="coarse")
    assert prediction.buckets == 4 and model.window_iterations_us
    # replayed from the window's own calls: near the window's iterations (a loose bound: 2 cores, Horovod's cycles)
    window_us = sorted(model.window_iterations_us)[len(model.window_iterations_us) // 2]
    assert 0.5 < prediction.predicted_iteration_time_ms * 1000 / window_us < 1.5
    from dprorun.fsutil import UnanswerableError
    from dprorun.optimize.horovod import rank_horovod_knobs

    with pytest.raises(UnanswerableError, match="own horovod.torch calls"):  # --autotune says why it keeps the job's
        rank_horovod_knobs(model)


@needs_horovod
def test_a_horovod_job_averaging_its_parameters_after_the_step_ends_with_nothing_profiled(tmp_path):
    """Local SGD with horovod.torch: no DistributedOptimizer, the parameters averaged by hvd.allreduce_ every 4th step
    after the step. The averaging was taken for the gradients of the backward before it (the job joined, then had
    no backward spans: "no replay of the job as it ran"), and a Horovod rank left its empty records, so the end
    read them and printed an empty summary. Now: nothing profiled, said, and no records."""
    script = tmp_path / "local_sgd.py"
    script.write_text(
        "import torch, torch.nn as nn, horovod.torch as hvd\n"
        "hvd.init(); torch.manual_seed(0); torch.set_num_threads(1)\n"
        "model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))\n"
        "hvd.broadcast_parameters(model.state_dict(), root_rank=0)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
        "x, y = torch.randn(32, 64), torch.randint(0, 8, (32,))\n"
        "for step in range(16):\n"
        "    opt.zero_grad()\n"
        "    nn.functional.cross_entropy(model(x), y).backward()\n"
        "    opt.step()\n"
        "    if step % 4 == 3:\n"
        "        for q in model.parameters():\n"
        "            hvd.allreduce_(q.data, op=hvd.Average)\n")
    run_dir = tmp_path / "run"
    proc = _short_window_run(script, run_dir)
    assert "nothing was profiled" in proc.stderr and "no hvd.DistributedOptimizer was built" in proc.stderr
    assert "no replay" not in proc.stderr and not (run_dir / "rank_0" / "events.json").exists()


@needs_horovod
def test_a_hangup_stops_a_horovod_job_and_its_profile_is_analysed(tmp_path):
    """SIGHUP (the terminal hung up) killed dprorun at once under --backend horovod: no word, no analysis, and the
    ranks left running. Now it reaches horovodrun as SIGTERM, the ranks stop, and the run is analysed: exit 129."""
    import signal
    import time

    import psutil

    marker, run_dir = "876545", tmp_path / "run"
    proc = start_dprorun_until(["--backend", "horovod", "-np", "2", "--warmup", "1", "--active", "2", "--kineto-iters",
                                "1", "--clean", "1", "-q", "python", os.path.join(EXAMPLES, "horovod_mlp.py"),
                                "--steps", "100000", "--report-last", marker], run_dir, "rank_1/events.json",
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
    proc.send_signal(signal.SIGHUP)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 129 and "interrupted by SIGHUP" in stderr, stderr[-2000:]
    time.sleep(1.0)
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []
    assert json.loads((run_dir / "summary.json").read_text())["ranks_recorded"] == [0, 1]


def test_horovodrun_beside_this_python_is_found_off_path(monkeypatch, tmp_path):
    """`/venv/bin/dprorun --backend horovod ...` with the environment not activated: its horovodrun is not on PATH,
    and the job was refused ("horovodrun was not found: install Horovod")."""
    import dprorun.launch as launch

    beside = tmp_path / "bin"
    beside.mkdir()
    (beside / "horovodrun").write_text("#!/bin/sh\n")
    (beside / "horovodrun").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(beside / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "elsewhere"))
    assert launch.horovodrun_path() == str(beside / "horovodrun")
    (beside / "horovodrun").unlink()
    assert launch.horovodrun_path() is None
