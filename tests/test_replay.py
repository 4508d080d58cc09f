"""The replayer: engine semantics on constructed graphs, DDP bucketing, what-if behaviour, the CLI."""
import json
from dataclasses import replace
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO
from dprorun.replay.engine import GraphBuilder, critical_path_report, replay
from dprorun.replay.template import BucketInfo, CommModel, JobModel, RankTemplate, ddp_buckets, fit_comm_model
from dprorun.replay.whatif import WhatIf, plan_syncs
from dprorun.replay.predict import predict, predict_replayed, self_check
from dprorun.trace.rundir import load_run


def _forward_backward_sync_update(g: GraphBuilder) -> tuple[int, int, int, int]:
    """a(10) -> b(5) -> d(1) on gpu0, with c(7) on link0 after a and before d."""
    a = g.op("a", "FW", 0, "gpu0", 10)
    b = g.op("b", "BW", 0, "gpu0", 5)
    c = g.op("c", "COMM", 0, "link0", 7)
    d = g.op("d", "UPDATE", 0, "gpu0", 1)
    g.chain([a, b, d])
    g.edge(a, c)
    g.edge(c, d)
    return a, b, c, d


def test_chain_and_parallel_devices():
    g = GraphBuilder()
    a, b, c, d = _forward_backward_sync_update(g)
    result = replay(g.build())
    assert result.iteration_time_us == 18.0  # a(10) -> c(7) overlaps b(5) -> d(1)
    assert result.critical_path == [a, c, d]
    assert list(result.start_us) == [0, 10, 10, 17]


def test_same_device_serialises_in_ready_order_and_path_follows_the_device():
    g = GraphBuilder()
    root = g.op("root", "VIRTUAL", 0, None, 0)
    x = g.op("x", "COMM", 0, "link", 4)
    y = g.op("y", "COMM", 0, "link", 4)
    late = g.op("late", "FW", 0, "cpu", 1)
    z = g.op("z", "COMM", 0, "link", 4)
    g.edge(root, x)
    g.edge(root, y)
    g.edge(root, late)
    g.edge(late, z)
    result = replay(g.build())
    assert result.iteration_time_us == 12.0
    assert result.start_us[z] == 8.0  # ready at 1, but the link is busy until 8
    assert result.critical_path[-1] == z and result.critical_path[-2] in (x, y)  # device-order edge
    report = critical_path_report(g.build(), result)
    assert report["share_pct"]["communication"] > 90


def test_device_with_two_channels():
    g = GraphBuilder()
    ops = [g.op(f"c{k}", "COMM", 0, "gloo", 5, capacity=2) for k in range(4)]
    result = replay(g.build())
    assert result.iteration_time_us == 10.0 and sorted(result.start_us[ops]) == [0, 0, 5, 5]


def test_devices_sharing_a_pool_hold_one_of_its_slots_each():
    """Two processes' devices on a host of one core: their ops take turns on it; with two cores they overlap. The
    op that held the core is on the critical path; a graph rebuilt from a prefix or copied per rank keeps its pools."""
    from dprorun.replay.engine import copy_ranks

    def host(cores: int):
        g = GraphBuilder()
        a = g.op("a", "FW", 0, "proc0", 10)
        b = g.op("b", "FW", 1, "proc1", 4)
        c = g.op("c", "COMM", 0, "link", 3, capacity=2)
        g.edge(a, c)
        for device in ("proc0", "proc1", "link"):
            g.share(device, "cpu", cores)
        return g.build(), (a, b, c)

    graph, (a, b, c) = host(1)
    result = replay(graph)
    assert sorted(result.start_us[[a, b]]) == [0, 10] or sorted(result.start_us[[a, b]]) == [0, 4]
    assert result.iteration_time_us == 17.0  # 10 + 4 + 3, one at a time
    assert result.device_busy_us["cpu"] == 17.0  # busy with its members' ops (a pool runs none of its own)
    assert result.critical_path[-1] == c and len(result.critical_path) >= 2
    two, _ = host(2)
    assert replay(two).iteration_time_us == 13.0  # a and b at once, then c
    assert replay(two).device_busy_us["cpu"] == 8.5  # 17 us of work over 2 cores
    assert np.allclose(replay(two).start_us, replay(two, use_fast=False).start_us)
    prefix = GraphBuilder.prefix_of(graph, 3).build()
    assert replay(prefix).iteration_time_us == 17.0
    copies, _ = copy_ranks(host(1)[0], 3, 2, 2, lambda r: "", lambda r: f"proc{r}")
    copied = copies.build()
    assert all(copied.device_pool[copied.device_names.index(d)] == copied.device_names.index("cpu")
               for d in ("proc0", "proc1"))


def test_execution_graph_and_chrome_trace_of_a_replay():
    from dprorun.replay.engine import execution_graph, replay_chrome_trace

    g = GraphBuilder()
    a, b, c, d = _forward_backward_sync_update(g)
    virtual = g.op("in", "VIRTUAL", 0, None, 0)
    two = [g.op(f"ch{k}", "COMM", 1, "gloo", 4, capacity=2) for k in range(3)]
    g.edge(a, virtual)
    graph = g.build()
    result = replay(graph)
    doc = execution_graph(graph, result)
    ops = {o["id"]: o for o in doc["ops"]}
    assert ops[a]["critical"] and ops[c]["critical"] and not ops[b]["critical"]
    for u, v, kind in doc["edges"]:  # every edge, DFG or device order, is respected by the replayed times
        assert ops[u]["end_us"] <= ops[v]["start_us"] + 1e-9, (u, v, kind)
    device_edges = {(u, v) for u, v, kind in doc["edges"] if kind == "device"}
    assert (a, b) in device_edges and (b, d) in device_edges  # gpu0's order
    assert (two[0], two[2]) in device_edges or (two[1], two[2]) in device_edges  # 2 slots: the third waits
    assert len([1 for u, v, k in doc["edges"] if k == "dfg"]) == 5
    trace = replay_chrome_trace(graph, result)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == graph.size - 1  # the virtual op has no device
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"gpu0", "link0", "gloo [0]", "gloo [1]"} <= lanes


def test_cycle_is_reported():
    g = GraphBuilder()
    a, b = g.op("a", "FW", 0, "x", 1), g.op("b", "FW", 0, "x", 1)
    g.edge(a, b)
    g.edge(b, a)
    with pytest.raises(ValueError, match="cycle"):
        replay(g.build())


def test_compiled_and_python_engines_agree_on_random_graphs(monkeypatch):
    from dprorun.replay import engine

    monkeypatch.setattr(engine, "PYTHON_STEPS_BEFORE_NUMBA", 0)  # the compiled loop from the first replay on
    rng = np.random.default_rng(0)
    for _ in range(5):
        g = GraphBuilder()
        n = 300
        ids = [g.op(f"n{i}", "FW", 0, f"d{rng.integers(4)}" if rng.random() < 0.8 else None,
                    float(rng.uniform(0, 10)), capacity=int(rng.integers(1, 3))) for i in range(n)]
        for v in range(1, n):
            for u in rng.choice(v, size=min(v, 3), replace=False):
                g.edge(ids[int(u)], ids[v])
        if rng.random() < 0.6:  # some devices share a pool of cores
            for d in range(int(rng.integers(1, 4))):
                g.share(f"d{d}", "cores", int(rng.integers(1, 3)))
        graph = g.build()
        fast, slow = replay(graph), replay(graph, use_fast=False)
        assert (fast.engine, slow.engine) == ("numba", "python")
        assert np.allclose(fast.start_us, slow.start_us) and fast.critical_path == slow.critical_path


def test_a_small_jobs_replays_do_not_load_numba():
    """Loading numba and its cached loop takes about 1.4 s, more than a small job's replays take in Python: a
    process loads it once it has taken PYTHON_STEPS_BEFORE_NUMBA queue steps, not before; a graph whose ops
    queue long on one device (quadratic in steps) is stopped at that budget and replayed compiled."""
    code = """
import sys
from dprorun.replay.engine import PYTHON_STEPS_BEFORE_NUMBA, GraphBuilder, replay
g = GraphBuilder()
ops = [g.op(f"n{i}", "FW", 0, "d", 1.0) for i in range(1000)]
for a, b in zip(ops, ops[1:]):
    g.edge(a, b)
chain = g.build()
first = replay(chain).engine
loaded = "numba" in sys.modules
engines = [first] + [replay(chain).engine for _ in range(PYTHON_STEPS_BEFORE_NUMBA // 1000)]
print(first, loaded, engines.index("numba") * 1000 == PYTHON_STEPS_BEFORE_NUMBA, engines[-1])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["python", "False", "True", "numba"], out.stdout
    queued = """
import time
from dprorun.replay.engine import GraphBuilder, replay
g = GraphBuilder()
for i in range(2000):
    g.op(f"n{i}", "FW", 0, "d", 1.0)  # all ready at once on one device: about 2 million queue steps
started = time.perf_counter()
result = replay(g.build())
print(result.engine, result.iteration_time_us, time.perf_counter() - started < 10)
"""
    out = subprocess.run([sys.executable, "-c", queued], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["numba", "2000.0", "True"], out.stdout


def test_ddp_bucketing_reproduces_the_recorded_buckets(mlp_run):
    run_dir, _ = mlp_run
    trace = load_run(str(run_dir)).ranks[0]
    ready_order = [p for b in sorted(trace.buckets, key=lambda b: b.index) for p in b.params]
    expected = [b.params for b in sorted(trace.buckets, key=lambda b: b.index)]
    assert ddp_buckets(ready_order, trace.param_bytes, 1 << 20) == expected  # the job ran with --bucket-mb 1


def test_comm_model_fit_recovers_latency_and_bandwidth():
    world, alpha, bw = 4, 30.0, 250.0
    true = CommModel(alpha, bw, "truth")
    points = [(s, true.allreduce_us(s, world)) for s in (1 << 16, 1 << 20, 4 << 20, 16 << 20)]
    model = fit_comm_model(points, world, [])
    assert model.alpha_us == pytest.approx(alpha, rel=1e-6) and model.bandwidth_bytes_per_us == pytest.approx(bw)


def test_comm_model_splits_a_per_collective_cost_from_the_message_latency():
    """At one world size a fit sees c + 2(N-1)·alpha; the measured message latency separates them, so a larger
    ring adds latency per step but not another copy of the per-collective cost."""
    world, alpha, collective, bw = 2, 40.0, 5000.0, 125.0
    true = CommModel(alpha, bw, "truth", collective_us=collective)
    points = [(s, true.allreduce_us(s, world)) for s in (1 << 20, 4 << 20, 8 << 20)]
    model = fit_comm_model(points, world, [], message_latency_us=alpha)
    assert model.alpha_us == pytest.approx(alpha) and model.collective_us == pytest.approx(collective)
    assert model.allreduce_us(4 << 20, 4) == pytest.approx(collective + 6 * (alpha + (1 << 20) / bw))
    assert model.allreduce_us(4 << 20, 2) == pytest.approx(true.allreduce_us(4 << 20, 2))
    # without a latency measurement everything stays per step (the model of earlier runs)
    legacy = fit_comm_model(points, world, [])
    assert legacy.collective_us == 0 and legacy.alpha_us == pytest.approx((collective + 2 * alpha) / 2)
    # a latency larger than the whole intercept is capped: nothing is left per collective
    capped = fit_comm_model(points, world, [], message_latency_us=1e6)
    assert capped.collective_us == pytest.approx(0) and capped.alpha_us == pytest.approx((collective + 2 * alpha) / 2)


def _toy_model(world=2, transmit_us=4000.0) -> JobModel:
    params = {f"p{k}": 1 << 20 for k in range(8)}
    fractions = {f"p{k}": 1 - (k + 1) / 8 for k in range(8)}
    template = RankTemplate(0, forward_us=3000, loss_us=100, backward_segments_us=[2000, 2000, 2000],
                            bucket_ready_order=["bucket0", "bucket1"], update_us=1000, tail_us=500,
                            enqueue_cost_us=50, backward_us=6000, iterations_used=10, measured_iteration_us=15000)
    buckets = [BucketInfo("bucket0", 4 << 20, [f"p{k}" for k in range(4)], transmit_us),
               BucketInfo("bucket1", 4 << 20, [f"p{k}" for k in range(4, 8)], transmit_us)]
    comm = CommModel(alpha_us=50.0, bandwidth_bytes_per_us=(4 << 20) / (transmit_us - 100.0), source="toy")
    return JobModel(world, {0: template, 1: template}, buckets, params, fractions, comm, 4.0, channels=1)


def test_self_check_does_not_widen_its_tolerance_by_the_replays_own_spread():
    """A replay 25 % off the clean iterations agrees with nothing, however widely its own iterations spread:
    within that spread it is "uncertain" and warned with the difference; beyond it, "disagrees"."""
    class Model:
        clean_iterations_us = [100_000 + 500 * (k % 3) for k in range(12)]
        window_iterations_us = [125_000] * 5
        warmup_iterations_us = [100_000, 101_000, 100_500]  # before the window the job ran as it does after it

    steady = self_check(Model, [101_000] * 8)
    assert steady["status"] == "agrees" and "+0.5 %" in steady["message"] and steady["tolerance_ms"] == 2.01
    settling = self_check(Model, [90_000, 110_000, 125_000, 125_000, 140_000, 160_000])
    assert settling["status"] == "uncertain" and settling["difference_pct"] == 24.38
    assert settling["message"].startswith("warning:") and "+24.4 %" in settling["message"]
    assert "uncertain by about ±20 %" in settling["message"] and "--warmup" in settling["message"]
    off = self_check(Model, [125_000] * 8)
    assert off["status"] == "disagrees" and "window's own iterations ran at 125.00 ms" in off["message"]


def test_a_replay_far_from_the_clean_median_is_not_said_to_agree_however_wide_their_spread():
    """A DDP script that skips its optimizer step every 4th step (session 43): an iteration (an optimizer step) holds
    one forward-backward or two, and its clean iterations spread 12.6-32.3 ms around 13.5 ms. The replay, 40.6 %
    off, was within half that band and printed "agrees"; beyond AGREEMENT_LIMIT it is "uncertain", warned with the
    run's spread."""
    class Model:
        clean_iterations_us = [13_480, 12_580, 32_270, 13_100, 26_900, 12_900, 13_700, 30_100, 13_300]
        window_iterations_us = [19_000] * 5
        warmup_iterations_us = []

    check = self_check(Model, [18_960] * 8)
    assert check["status"] == "uncertain" and check["wide_clean_spread"] and check["message"].startswith("warning:")
    assert "+40.7 %" in check["message"] and "within the run's own spread only" in check["message"]
    assert self_check(Model, [14_000] * 8)["status"] == "agrees"  # +3.9 %: the same band, a close replay


def test_a_job_whose_speed_changed_after_the_window_is_told_so_not_given_a_modelling_error():
    """A TensorFlow fit still speeding up (this VM: warm-up iterations 29-35 ms, window 27-33, clean 20-24): the
    replay follows the window and misses the clean iterations. The warm-up iterations ran before any profiling,
    as the window did: the job's own speed changed, said with the three figures and what to do (before: "a modelling
    error", from the window's profiled iterations)."""
    class Model:
        clean_iterations_us = [22_000 + 300 * (k % 3) for k in range(9)]
        window_iterations_us = [33_400] * 6
        warmup_iterations_us = [31_500, 32_000, 29_000]

    check = self_check(Model, [30_300] * 8)
    assert check["status"] == "disagrees" and check["warmup_ms"] == 31.5
    assert "the job's own speed changed after the window" in check["message"] and "--warmup" in check["message"]
    assert "modelling error" not in check["message"]
    # the job-end summary gave the window against the clean iterations as the hooks' cost (-37.1 % for a batch that
    # grew after the window): no percentage then, and why
    from dprorun.summary import format_summary

    summary = {"job_id": "j", "world_size": 2, "ranks": [], "iteration_time_ms": 33.4, "clean_iteration_time_ms": 22.3,
               "profiler_overhead_pct": 49.8, "kineto_iteration_time_ms": 36.0, "kineto_overhead_pct": 61.4,
               "memory": [], "missing_ranks": [], "self_check": check}
    line = next(x for x in format_summary(summary).splitlines() if x.startswith("iteration time (median)"))
    assert "%" not in line and "no measure of the hooks' cost: the job's own speed changed" in line
    Model.warmup_iterations_us = [22_100, 22_300]  # the warm-up ran as the clean iterations: not the job's speed
    other = self_check(Model, [30_300] * 8)
    assert "modelling error" in other["message"] and not other.get("speed_changed")
    line = next(x for x in format_summary(dict(summary, self_check=other)).splitlines()
                if x.startswith("iteration time (median)"))
    assert "(+49.8 %)" in line and "(+61.4 %)" in line


def test_a_sparse_gradient_keeps_a_bucket_of_its_own_and_is_priced_as_a_gather():
    """DDP gives a sparse gradient a bucket of its own and gloo gathers every rank's indices and values: a
    re-bucketing keeps it alone, and its modelled time grows with N-1 messages of its bytes (a ring all-reduce's
    bytes per rank stay near 2S)."""
    from types import SimpleNamespace

    from dprorun.replay.comm import CommPricing
    from dprorun.replay.whatif import Sync

    order, sizes = ["a", "emb", "b", "c"], {"a": 600, "emb": 10_000, "b": 600, "c": 600}
    assert ddp_buckets(order, sizes, 1000) == [["a", "emb"], ["b", "c"]]
    assert ddp_buckets(order, sizes, 1000, sparse={"emb": 80}) == [["emb"], ["a", "b"], ["c"]]
    comm = CommModel(alpha_us=10.0, bandwidth_bytes_per_us=100.0, source="test", collective_us=20.0)

    def total_us(world, sparse):
        pricing = CommPricing(SimpleNamespace(comm=comm), world, False, False, 1.0, 100.0, 10.0)
        step, _ = pricing.step(Sync("bucket0", 100_000, 1.0, None, sparse=sparse), 1, None)
        return step * 2 * (world - 1)

    assert total_us(2, True) == pytest.approx(20 + 10 + 1000)
    assert total_us(8, True) == pytest.approx(20 + 7 * (10 + 1000))
    assert total_us(8, False) == pytest.approx(20 + 14 * (10 + 100_000 / 8 / 100))
    # in a job model: out of the comm scale; alone in DDP's re-bucketing and in Horovod's fusion
    from dprorun.replay.whatif import comm_scale, horovod_fusion

    model = _toy_model()
    scale = comm_scale(model)
    model.buckets.append(BucketInfo("bucket2", 4096, ["emb"], 3000.0, sparse=True))
    model.param_bytes["emb"], model.param_ready_fraction["emb"] = 8 << 20, 0.5
    assert model.sparse_gradients() == {"emb": 4096} and comm_scale(model) == scale
    rebucketed = predict(model, WhatIf(bucket_mb=100))
    assert rebucketed.buckets == 2 and rebucketed.predicted_iteration_time_ms > 0
    responses = [group for group, _, _ in horovod_fusion(model, threshold_bytes=64 << 20, cycle_us=10_000.0)]
    assert sorted(map(len, responses)) == [1, 8] and ["emb"] in responses


def test_whatif_directions():
    model = _toy_model()
    base = predict(model).predicted_iteration_time_ms
    # as it ran: bucket0 ready at 3.1 + 2 ms, synced 5.1-9.1; bucket1 ready at 7.1 waits for the link, 9.1-13.1;
    # update 13.1-14.1, tail 14.1-14.6
    assert base == pytest.approx(3.1 + 2 + 4 + 4 + 1 + 0.5, abs=0.01)
    assert predict(model, WhatIf(bandwidth_scale=0.5)).predicted_iteration_time_ms > base
    assert predict(model, WhatIf(bandwidth_scale=4)).predicted_iteration_time_ms < base
    assert predict(model, WhatIf(world_size=8)).predicted_iteration_time_ms > base  # more ring steps
    daydream = predict(model, WhatIf(baseline="daydream"))
    assert daydream.predicted_iteration_time_ms < base  # bytes / bandwidth: no latency, no ring
    one_bucket = predict(model, WhatIf(bucket_mb=64))
    assert one_bucket.buckets == 1
    with pytest.raises(ValueError, match="gradient-ready"):
        predict(JobModel(**{**model.__dict__, "param_ready_fraction": {}}), WhatIf(bucket_mb=1))


def test_dpro_replay_cli_on_a_real_run(mlp_run, tmp_path):
    run_dir, _ = mlp_run
    out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", str(run_dir), "--json"],
                         capture_output=True, text=True, cwd=REPO, timeout=180)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["predicted_iteration_time_ms"] > 0 and doc["measured_iteration_time_ms"] > 0
    assert 0.5 < doc["predicted_iteration_time_ms"] / doc["measured_iteration_time_ms"] < 2.0  # sanity only
    assert doc["critical_path"]["top"] and doc["world_size"] == 2
    out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", str(run_dir), "--np", "16",
                          "--bandwidth", "10Gbit", "--bucket-mb", "5", "--partitions", "2",
                          "--exec-graph", str(tmp_path / "exec.json"), "--chrome-trace", str(tmp_path / "trace.json")],
                         capture_output=True, text=True, cwd=REPO, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "predicted iteration time:" in out.stdout and "16 ranks" in out.stdout
    # the busiest devices, compute streams or links, whichever are busier
    assert re.search(r"^device utilisation: (rank\d+\.compute|link\d+->\d+|channel\d+->\d+) \d+ %", out.stdout, re.M)
    predicted_ms = float(out.stdout.split("predicted iteration time:")[1].split()[0])
    graph = json.loads((tmp_path / "exec.json").read_text())
    # the replay of the median iteration (with an even count the prediction averages the middle two)
    assert abs(graph["iteration_time_us"] / 1000 - predicted_ms) < 0.1 * predicted_ms
    assert graph["critical_path"] and any(kind == "device" for _, _, kind in graph["edges"])
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert any(e["ph"] == "X" and e["args"]["critical_path"] for e in trace["traceEvents"])


def test_partial_replay_of_one_tensor_sync():
    from dprorun.replay.predict import sync_time_us

    model = _toy_model()
    one = sync_time_us(model, 4 << 20, world=2, partitions=1)
    assert one == pytest.approx(model.comm.allreduce_us(4 << 20, 2) * 1.0, rel=0.05)
    # pieces on one channel run one after another: same bytes, more per-step latency
    assert sync_time_us(model, 4 << 20, world=2, partitions=4) > one
    assert sync_time_us(model, 4 << 20, world=8) > one


def test_horovod_fusion_what_if_groups_by_cycle_and_threshold():
    """Tensors ready in the same cycle are fused, in ready order, up to the threshold; a response is ready at
    the end of the cycle that picked it up."""
    from dprorun.replay.whatif import horovod_fusion

    model = _toy_model()  # 8 tensors of 1 MiB, ready at 0, 1/8, ..., 7/8 of a 6 ms backward
    model.framework = "horovod"
    order = sorted(model.param_ready_fraction, key=model.param_ready_fraction.get)
    model.horovod_negotiation_us = 100.0
    responses = horovod_fusion(model, threshold_bytes=2 << 20, cycle_us=1500.0)
    assert [group for group, _, _ in responses] == [order[0:2], order[2:4], order[4:6], order[6:8]]
    assert [round(f, 3) for _, f, _ in responses] == [0.25, 0.5, 0.75, 1.0]
    assert [d for _, _, d in responses] == [100.0] * 4  # cycles end within the backward: negotiation only
    one_cycle = horovod_fusion(model, threshold_bytes=64 << 20, cycle_us=10_000.0)
    assert [group for group, _, _ in one_cycle] == [order] and one_cycle[0][1] == 1.0
    assert one_cycle[0][2] == pytest.approx(100.0 + 10_000.0 - 6_000.0)  # the cycle outlasts the backward
    assert len(horovod_fusion(model, threshold_bytes=0, cycle_us=1500.0)) == 8  # fusion off
    model.horovod_knobs = (64 << 20, 10_000.0)
    scaled = predict(model, WhatIf(world_size=4))  # modelled: priced as the responses Horovod's knobs make
    assert scaled.buckets == 1 and any("Horovod fusion at 64 MB" in note for note in scaled.notes)
    assert predict(model, WhatIf(world_size=4, baseline="daydream")).buckets == 2  # one op per measured sync
    no_fusion = predict(model, WhatIf(horovod_fusion_mb=0, horovod_cycle_ms=1.5)).predicted_iteration_time_ms
    fused = predict(model, WhatIf(horovod_fusion_mb=2, horovod_cycle_ms=1.5)).predicted_iteration_time_ms
    assert fused < no_fusion  # fewer syncs: fewer step latencies


def test_horovod_fusion_keeps_each_dtype_in_responses_of_its_own():
    """Horovod fuses only tensors of one dtype (Controller::FuseResponses), passing over another dtype's while the
    bytes fused and passed over fit the threshold; the fusion what-ifs fused a float16 trunk's gradients with a
    float32 head's."""
    from dprorun.replay.whatif import _fuse_cycle, horovod_fusion

    mib = float(1 << 20)
    cycle = [("h0", mib, "float32"), ("t0", mib, "float16"), ("h1", mib, "float32"), ("t1", mib, "float16")]
    assert _fuse_cycle(cycle, 64 * mib) == [["h0", "h1"], ["t0", "t1"]]
    assert _fuse_cycle(cycle, 2 * mib) == [["h0", "h1"], ["t0", "t1"]]  # 1 fused + 1 passed over fit 2 MiB
    assert _fuse_cycle(cycle, 1.5 * mib) == [["h0"], ["t0"], ["h1"], ["t1"]]  # passing over t0 would not fit
    one_dtype = [(name, size, "") for name, size, _ in cycle]
    assert _fuse_cycle(one_dtype, 2 * mib) == [["h0", "t0"], ["h1", "t1"]]
    model = _toy_model()  # 8 tensors of 1 MiB
    model.framework = "horovod"
    model.horovod_negotiation_us = 100.0
    order = sorted(model.param_ready_fraction, key=model.param_ready_fraction.get)
    model.buckets = [replace(b, dtype="float32" if k % 2 else "float16") for k, b in enumerate(model.buckets)]
    dtypes = model.param_dtypes()
    responses = [group for group, _, _ in horovod_fusion(model, threshold_bytes=64 << 20, cycle_us=10_000.0)]
    by_dtype = [sorted(p for p in order if dtypes[p] == d) for d in set(dtypes.values())]
    assert sorted(map(sorted, responses)) == sorted(by_dtype) and len(by_dtype) == 2


def test_horovod_responses_in_a_dtype_gloo_sums_slowly_are_priced_by_their_calibration():
    """gloo sums float16 in software: a Horovod job's float16 responses (a float16 trunk, or hvd.Compression.fp16)
    took 1.28 x a float32 one of the same bytes at 1 Gbit/s, 2.0 x on loopback, and the fusion what-ifs priced
    every byte as the float32 calibration's (a mixed model's what-ifs 4-14 % short). The hooks now time calls in
    each wire dtype against float32 ones; the modelled what-ifs scale that dtype's responses by the ratio."""
    from types import SimpleNamespace

    from dprorun.replay.build import _horovod_dtype_costs
    from dprorun.runtime.calibration import horovod_wire_dtypes

    buckets = {(0, 0): {"nbytes": 4096, "dtype": "float32"}, (0, 1): {"nbytes": 2048, "dtype": "float16"},
               (0, 2): {"nbytes": 100, "dtype": "int64"}}
    assert horovod_wire_dtypes(buckets) == ["float16"]
    compressed = {(0, 0): {"nbytes": 2048, "buffer_nbytes": 4096, "dtype": "float32"}}
    assert horovod_wire_dtypes(compressed) == ["float16"] and horovod_wire_dtypes({(0, 0): {"dtype": "float32"}}) == []
    rank = lambda rows: SimpleNamespace(meta={"calibration_dtypes": rows})  # noqa: E731
    run = SimpleNamespace(ranks={0: rank([["float16", 1 << 22, 90_000.0, 70_000.0]]),
                                 1: rank([["float16", 1 << 22, 88_000.0, 70_000.0]])})
    assert _horovod_dtype_costs(run, [0, 1]) == {"float16": pytest.approx(1.271, abs=1e-3)}
    run.ranks[1] = rank([["float16", 1 << 22, 72_000.0, 70_000.0]])
    run.ranks[0] = rank([["float16", 1 << 22, 73_000.0, 70_000.0]])
    assert _horovod_dtype_costs(run, [0, 1]) == {}  # within 10 %: priced as float32
    model = _toy_model()
    model.framework, model.horovod_knobs = "horovod", (64 << 20, 10_000.0)
    model.buckets = [replace(b, dtype="float16" if k == 0 else "float32") for k, b in enumerate(model.buckets)]
    assert model.wire_dtype("p0") == "float16" and model.wire_dtype("p7") == "float32"
    plain = sorted(sync.nbytes for sync in plan_syncs(model, WhatIf(horovod_fusion_mb=64), [])[0])
    model.dtype_cost = {"float16": 1.5}
    scaled = sorted(sync.nbytes for sync in plan_syncs(model, WhatIf(horovod_fusion_mb=64), [])[0])
    assert plain == [4 << 20, 4 << 20] and scaled == [4 << 20, 6 << 20]


def test_a_transport_on_the_compute_cores_is_named_in_what_if_predictions(mlp_run):
    """CPU transport (its calibration all-reduce keeps it busy) + no spare core -> the what-if says the replay's
    separate communication devices do not hold; a network-bound transport or spare cores -> no caution."""
    from dprorun.replay.build import build_job_model
    from dprorun.replay.template import transport_on_compute_cores

    run_dir, _ = mlp_run
    run = load_run(str(run_dir))

    def set_case(spare: float, cpu_share: float) -> None:
        for trace in run.ranks.values():
            trace.meta["cpu"] = {"cores": 2.0, "local_ranks": 2, "cores_per_rank": 1.0 + spare, "compute_threads": 1,
                                 "spare_cores": spare}
            trace.meta["calibration"] = [[1 << 12, 300.0], [1 << 20, 700.0], [1 << 22, 4000.0]]
            trace.meta["calibration_transport_cpu"] = [[1 << 12, 290.0], [1 << 20, 400.0],
                                                       [1 << 22, 4000.0 * cpu_share]]
            trace.meta["calibration_under_compute"] = [[1 << 20, 7000.0]]

    set_case(0.0, 0.6)  # loopback on 2 cores: gloo copies and reduces on the cores the backward uses
    assert transport_on_compute_cores(run)["shares_cores"]
    model = build_job_model(run)
    caution = [n for n in predict(model, WhatIf(bucket_mb=1)).notes if "caution: the transport runs on the cores" in n]
    assert caution and "a 1 MiB all-reduce took 7.0 ms beside compute vs 0.7 ms idle" in caution[0]
    assert any("caution" in n for n in predict(model, WhatIf(world_size=4)).notes)
    assert not any("caution" in n for n in predict(model).notes)  # the job as it ran is what was measured
    assert predict(model, WhatIf(bucket_mb=1)).comm_model["transport"]["transport_cpu_share"] == 0.6
    set_case(0.0, 0.04)  # a shaped network: the transport mostly waits (the small all-reduce does not decide)
    assert not transport_on_compute_cores(run)["shares_cores"]
    set_case(3.0, 0.6)  # cores to spare
    assert not transport_on_compute_cores(run)["shares_cores"]
    set_case(0.0, 0.6)  # the same numbers on NCCL: the transport is the GPU's, not the cores'
    trackers = {r: list(t.meta.get("trackers", [])) for r, t in run.ranks.items()}
    for trace in run.ranks.values():
        trace.meta["trackers"] = [dict(t, backend="nccl") for t in trace.meta.get("trackers", [])] or \
            [{"framework": "ddp", "backend": "nccl"}]
    assert not transport_on_compute_cores(run)["shares_cores"]
    for r, trace in run.ranks.items():
        trace.meta["trackers"] = trackers[r]
    for trace in run.ranks.values():  # a run that did not record it
        trace.meta.pop("cpu")
    assert transport_on_compute_cores(run) is None


def test_a_ddp_on_process_groups_of_its_own_is_read_from_the_hooks_and_gets_no_world_size_what_if(mlp_run):
    """A script training a replica per subgroup (DDP(process_group=new_group([0, 1])) on 4 ranks): the replay
    joined every rank's buckets into all-reduces across the 4, and its self-check "agreed" (+15.1 %) on a topology
    the job did not have. The hooks record each DDP's group; the replay joins each group's ranks alone (here groups
    of one rank: no transfer between the two) and answers no world-size what-if (the script forms the groups)."""
    from dprorun.fsutil import UnanswerableError
    from dprorun.graph.build import build_global_dfg
    from dprorun.replay.build import build_job_model
    from dprorun.trace.model import ddp_groups

    run_dir, _ = mlp_run
    run = load_run(str(run_dir))
    assert [t["group_ranks"] for t in run.ranks[0].meta["trackers"]] == [[0, 1]]  # recorded by the hooks
    assert ddp_groups(run) == [] and any(op.peer == 1 for op in build_global_dfg(run).nodes if op.rank == 0)
    for r, trace in run.ranks.items():  # each rank a DDP of its own (groups of 1 in a world of 2)
        trace.meta["trackers"] = [dict(t, group_ranks=[r]) for t in trace.meta["trackers"]]
    assert ddp_groups(run) == [[0], [1]]
    assert not any(op.phase in ("send", "recv") for op in build_global_dfg(run).nodes)  # the measured graph
    kept = run.ranks[0].meta["trackers"]
    run.ranks[0].meta["trackers"] = [dict(t, group_ranks=[1]) for t in kept]  # not rank 0's own: not credible
    assert ddp_groups(run) == []
    run.ranks[0].meta["trackers"] = kept
    model = build_job_model(run)
    assert any(n.startswith("the script's DDP all-reduces within process groups of its own ([0], [1])")
               for n in model.notes)
    _, graph, _ = predict_replayed(model)
    assert not [name for name in graph.device_names if name.startswith("link")]
    with pytest.raises(UnanswerableError, match="process groups of its own"):
        predict(model, WhatIf(world_size=4))


def test_a_ddp_job_that_steps_no_torch_optimizer_is_replayed_with_its_update_read_after_the_backward(mlp_run,
                                                                                                    tmp_path):
    """A DDP script stepping an optimizer class of its own (no torch.optim.Optimizer: a Lion written as a plain
    class) or SGD applied in place by hand gave the hooks no update span, and its job had no replay ("no profiled
    iteration has forward, backward and update spans"; benchmarks/shapes/ddp_session52.py --own-optimizer,
    --manual-sgd). The reader now takes each such iteration's update from its backward's last all-reduce to the next
    iteration, and the replay says so. Here: the real 2-rank run with its update spans taken out of the records."""
    import shutil

    from dprorun.replay.build import INFERRED_UPDATE_NOTE, build_job_model
    from dprorun.trace.model import OpKind
    from dprorun.trace.rundir import INFERRED_UPDATE

    run_dir, _ = mlp_run
    as_stepped = predict(build_job_model(load_run(str(run_dir)))).predicted_iteration_time_ms
    copy = tmp_path / "no-optimizer"
    shutil.copytree(run_dir, copy)
    for rank in (0, 1):
        path = copy / f"rank_{rank}" / "events.json"
        doc = json.loads(path.read_text())
        doc["spans"] = [row for row in doc["spans"] if not row[1].startswith("update")]
        path.write_text(json.dumps(doc))
    run = load_run(str(copy))
    for trace in run.ranks.values():
        ends = {i: end for i, _, end in trace.iterations}
        updates = [op for op in trace.ops if op.kind is OpKind.UPDATE and op.stream == "phase"]
        assert updates and all(op.name == INFERRED_UPDATE for op in updates)
        assert trace.meta["inferred_update"] == len(updates) == len(trace.profiled_iterations)
        for op in updates:
            before = [o.args.get("callback_done_us", o.end_us) for o in trace.ops if o.iteration == op.iteration
                      and o.source == "hooks" and (o.kind is OpKind.BW or o.kind in (OpKind.COMM, OpKind.QUEUE))]
            assert op.start_us == min(max(before), ends[op.iteration]) and op.end_us == ends[op.iteration]
    model = build_job_model(run)
    assert INFERRED_UPDATE_NOTE in model.notes
    inferred = predict(model).predicted_iteration_time_ms
    assert abs(inferred / as_stepped - 1) < 0.02, (inferred, as_stepped)  # update + tail: the same span


def test_ddp_buckets_keep_each_gradient_dtype_apart():
    """DDP never puts gradients of two dtypes in one bucket (a bfloat16 trunk under a float32 head: 2 buckets at the
    default 25 MB cap, each dtype with its own first cap); the re-bucketing what-ifs merged them (1 bucket)."""
    order = ["head.b", "head.w", "trunk.b", "trunk.w", "stem.w"]
    sizes = {"head.b": 40, "head.w": 600, "trunk.b": 20, "trunk.w": 300, "stem.w": 300}
    dtypes = {"head.b": "float32", "head.w": "float32", "trunk.b": "bfloat16", "trunk.w": "bfloat16",
              "stem.w": "float32"}
    assert ddp_buckets(order, sizes, 10_000) == [order]
    assert ddp_buckets(order, sizes, 10_000, dtypes=dtypes) == [["head.b", "head.w", "stem.w"],
                                                                ["trunk.b", "trunk.w"]]
    assert ddp_buckets(order, sizes, 500, 100, dtypes=dtypes) == [["head.b", "head.w"], ["trunk.b", "trunk.w"],
                                                                  ["stem.w"]]
    assert ddp_buckets(order, sizes, 700, 30, dtypes=dtypes) == [["head.b"], ["trunk.b", "trunk.w"],
                                                                 ["head.w", "stem.w"]]
    buckets = [BucketInfo("bucket0", 640, ["head.b", "head.w"], 1.0, dtype="float32"),
               BucketInfo("bucket1", 320, ["trunk.b", "trunk.w"], 1.0, dtype="bfloat16")]
    model = JobModel(2, {}, buckets, sizes, {}, CommModel(1.0, 1.0, "test"), 25.0)
    assert model.param_dtypes() == {"head.b": "float32", "head.w": "float32", "trunk.b": "bfloat16",
                                    "trunk.w": "bfloat16"}
    assert JobModel(2, {}, buckets[:1], sizes, {}, CommModel(1.0, 1.0, "test"), 25.0).param_dtypes() is None


def test_a_ring_per_ddp_group_prices_as_the_groups_own_world():
    """Four ranks in two DDP groups of two ([0, 1], [2, 3]): each bucket's all-reduce is a ring of 2 steps within
    its group (no link between the groups), priced as a ring of 2, so every modelled what-if predicts what a
    2-rank job of the same templates predicts (a ring of 4 would send half as many bytes again, in 6 steps);
    replayed with every rank, with one representative rank (the optimizer's symmetric search) and by the
    optimizer's t_sync alike."""
    from dprorun.replay.predict import representative, sync_time_us
    from dprorun.replay.whatif import comm_scale

    pair = _toy_model(world=2)
    groups = replace(_toy_model(world=4), templates={r: pair.templates[0] for r in range(4)},
                     ddp_groups=[[0, 1], [2, 3]])
    assert groups.ring_size == 2
    _, graph, _ = predict_replayed(groups)
    links = {name for name in graph.device_names if name.startswith("link")}
    assert links == {"link0->1", "link1->0", "link2->3", "link3->2"}
    assert {name.split(".s")[-1] for name in graph.names if ".send.bucket0" in name} == {"0", "1"}
    for whatif in (WhatIf(), WhatIf(bandwidth_gbit=1.0), WhatIf(bucket_mb=1.0), WhatIf(partitions=2)):
        expected = predict(pair, whatif).predicted_iteration_time_ms
        assert predict(groups, whatif).predicted_iteration_time_ms == pytest.approx(expected, rel=1e-6), whatif
        assert predict(representative(groups), whatif).predicted_iteration_time_ms == pytest.approx(expected, rel=1e-6)
    # the measured transmissions scale the model as a ring of 2 (read as a ring of 4 they ran 1.5x the bytes)
    assert comm_scale(groups) == comm_scale(pair) > 1.3 * comm_scale(replace(groups, ddp_groups=[]))
    assert sync_time_us(groups, 4 << 20) == pytest.approx(sync_time_us(pair, 4 << 20))


def test_a_rare_slow_clean_iteration_does_not_widen_the_self_checks_tolerance():
    """A TF loop creating a distributed iterator at each epoch's start (1-7 s) among 29 ms steps: two such clean
    iterations of nine made the band 25-1413 ms, and any replay agreed. Iterations over 3 times the median are left
    out of the band (and said), where 5 remain."""
    class Model:
        clean_iterations_us = [29_000 + 300 * (k % 3) for k in range(7)] + [1_400_000, 7_000_000]
        window_iterations_us = [29_500] * 6
        warmup_iterations_us = []

    check = self_check(Model, [45_000] * 8)
    assert check["status"] == "disagrees" and check["clean_left_out"] == 2 and check["clean_p10_p90_ms"][1] < 30
    assert "the run's 7 clean iterations" in check["message"] and "2 more, over 3 times their median" in check["message"]
    assert self_check(Model, [29_500] * 8)["status"] == "agrees"
    Model.clean_iterations_us = [29_000] * 4 + [1_400_000] * 3  # too few regular ones: the band as it is
    assert self_check(Model, [45_000] * 8)["clean_left_out"] == 0


def test_a_forward_that_runs_the_backward_and_steps_is_cut_at_its_steps():
    """trace/rundir.split_forwards_that_step: one forward span holding two optimizer steps (Lightning's manual
    optimization) becomes per step a forward to its first gradient ready, a backward to its last gradient ready or
    bucket handed over, and the step's update; iterations with a backward span, an update outside the forward, or a
    step with nothing ready before it stay as they are."""
    from dprorun.layout import CommRecord
    from dprorun.trace.rundir import split_forwards_that_step

    spans = [[5, "forward0", 0.0, 19_000.0], [5, "update", 9_000.0, 10_000.0], [5, "update", 18_000.0, 19_000.0]]
    ready = [[5, "D.2.bias", 4_000.0], [5, "D.0.weight", 6_000.0], [5, "G.0.weight", 14_000.0]]
    comm = [CommRecord(5, 0, 0, 7_000.0, 7_100.0, 8_500.0), CommRecord(5, 0, 0, 16_000.0, 16_100.0, 17_500.0)]
    cut = split_forwards_that_step(spans, ready, comm)
    assert cut == [[5, "forward0", 0.0, 4_000.0], [5, "backward0", 4_000.0, 7_000.0], [5, "update", 9_000.0, 10_000.0],
                   [5, "forward0", 10_000.0, 14_000.0], [5, "backward0", 14_000.0, 16_000.0],
                   [5, "update", 18_000.0, 19_000.0]]
    as_usual = [[6, "forward0", 0.0, 5_000.0], [6, "backward0", 5_000.0, 9_000.0], [6, "update", 9_500.0, 10_000.0]]
    assert split_forwards_that_step(as_usual, [[6, "w", 6_000.0]], []) == as_usual
    outside = [[7, "forward0", 0.0, 5_000.0], [7, "update", 6_000.0, 7_000.0]]  # no backward span, step after it
    assert split_forwards_that_step(outside, [[7, "w", 3_000.0]], []) == outside
    assert split_forwards_that_step(spans, [[5, "w", 4_000.0]], []) == spans  # the second step: nothing ready


def test_a_backward_run_inside_the_ddp_models_forward_is_named_when_nothing_can_be_replayed():
    """Lightning's manual optimization (a GAN stepping two optimizers in training_step): the training step runs
    inside the DDP wrapper's forward and returns no loss, so the hooks saw a forward span holding the backward and
    the buckets' all-reduces, two update spans and no backward span: "no profiled iteration has forward, backward
    and update spans", with no word of why. The cause is named now (where the reader cannot cut that forward at its
    steps: test_a_forward_that_runs_the_backward_and_steps_is_cut_at_its_steps)."""
    from dprorun.fsutil import UnanswerableError
    from dprorun.replay.measure import HandOvers, measure_rank
    from dprorun.trace.model import Op, OpKind, RankTrace

    trace = RankTrace(rank=0, host="h", iterations=[(5, 0.0, 20_000.0)])
    trace.ops = [Op("forward0", OpKind.FW, 0, 0.0, 19_000.0, iteration=5, stream="phase"),
                 Op("update", OpKind.UPDATE, 0, 9_000.0, 10_000.0, iteration=5, stream="phase"),
                 Op("update", OpKind.UPDATE, 0, 18_000.0, 19_000.0, iteration=5, stream="phase"),
                 Op("allreduce.bucket0", OpKind.COMM, 0, 6_000.0, 8_000.0, iteration=5, stream="comm",
                    tensor="bucket0", phase="queue+transmit")]
    with pytest.raises(UnanswerableError, match="all-reduced inside the DDP model's forward.*manual optimization"):
        measure_rank(trace, [5], HandOvers())
    trace.ops[-1].start_us = 19_500.0  # handed over after the forward: no such cause to name
    with pytest.raises(UnanswerableError) as raised:
        measure_rank(trace, [5], HandOvers())
    assert str(raised.value).endswith("no profiled iteration has forward, backward and update spans")
    # a TensorFlow worker whose steps ran eagerly (Keras's run_eagerly=True): its profile has no gradient scopes
    trace.meta["trackers"] = [{"framework": "tf", "eager_steps": True}]
    with pytest.raises(UnanswerableError, match="the TensorFlow steps ran eagerly .* compile the step"):
        measure_rank(trace, [5], HandOvers())
    # TensorFlow's profiler off in the launch (--no-kineto, or dprorun's last launch after its stop crashed twice)
    trace.meta["trackers"] = [{"framework": "tf"}]
    trace.meta["window"] = {"kineto": False}
    with pytest.raises(UnanswerableError, match="TensorFlow's profiler, the only source .* was off in this launch"):
        measure_rank(trace, [5], HandOvers())


def test_a_bucket_all_reduced_twice_in_an_iteration_is_modelled_by_its_last_round():
    """Micro-batches accumulated without no_sync: every backward all-reduces every bucket. The rounds of a bucket
    were merged from the first's enqueue to the last's end, so a bucket handed over late in the last backward was
    placed at that backward's start, overlapping more than it did: the replay ran 7-11 % under the window's own
    iterations on 4 runs (benchmarks/shapes/ddp_session38.py --accumulate-syncing 2), -2.3 to +0.7 % after."""
    from dprorun.replay.measure import HandOvers, measure_rank
    from dprorun.trace.model import Op, OpKind, RankTrace

    def comm(bucket, start, end):
        return Op(f"allreduce.{bucket}", OpKind.COMM, 0, start, end, iteration=5, stream="comm", tensor=bucket,
                  phase="queue+transmit")

    trace = RankTrace(rank=0, host="h", iterations=[(5, 0.0, 60_000.0)])
    trace.ops = [Op("forward0", OpKind.FW, 0, 0.0, 5_000.0, iteration=5, stream="phase"),
                 Op("backward0", OpKind.BW, 0, 5_000.0, 15_000.0, iteration=5, stream="phase"),
                 Op("forward0", OpKind.FW, 0, 20_000.0, 25_000.0, iteration=5, stream="phase"),
                 Op("backward0", OpKind.BW, 0, 25_000.0, 35_000.0, iteration=5, stream="phase"),
                 Op("update", OpKind.UPDATE, 0, 45_000.0, 55_000.0, iteration=5, stream="phase"),
                 comm("bucket0", 7_000.0, 9_000.0), comm("bucket1", 14_000.0, 19_000.0),
                 comm("bucket0", 27_000.0, 29_000.0), comm("bucket1", 34_000.0, 40_000.0)]
    hand_overs = HandOvers(latest_us={(5, "bucket0", 1): 27_000.0, (5, "bucket1", 1): 34_000.0})
    template, _, transmit = measure_rank(trace, [5], hand_overs)
    assert template.bucket_ready_order == ["bucket0", "bucket1"]
    # the last backward cut where its round handed each bucket over: 2 ms, then 7 ms, then 1 ms
    assert template.backward_segments_us == [2_000.0, 7_000.0, 1_000.0]
    assert transmit[5] == {"bucket0": 2_000.0, "bucket1": 6_000.0}


def test_a_ranks_wait_before_its_forward_for_a_rank_whose_step_started_later_is_not_its_own_time():
    """A GAN stepping its discriminator before the generator's forward (Lightning's manual optimization): the first
    step's all-reduce lies before the modelled forward, in what the rank did before it, wait included. A rank whose
    step started 3 ms after the other's (its step before ended late) handed its round over 3 ms later, and the other
    waited: time neither rank's step holds once the replay starts both at once, and the replay ran up to 31 % over
    the window's own iterations on 2 cores (14 runs; 8.5 % at most after). That wait is out of the early rank's
    accumulate. A rank late from its own work (SAM's longer first pass on one rank) makes the other wait in the
    replay too: that wait stays (taken out, SAM's replay was 5.5 % short: its early rank busier after the round)."""
    from dprorun.replay.measure import enqueues_over_ranks, iteration_slots, measure_rank
    from dprorun.trace.model import Op, OpKind, RankTrace

    def rank_trace(rank: int, step_start: float, first_backward_end: float) -> RankTrace:
        """An iteration: forward, backward, the first round (to 6 ms on the shared clock), an update, the second
        forward and backward and their round, the update; times from the step's start but the first round's end."""
        trace = RankTrace(rank=rank, host="h", iterations=[(5, step_start, 10_000.0)])

        def span(name: str, kind: OpKind, start: float, end: float) -> Op:
            return Op(name, kind, rank, start, end, iteration=5, stream="phase")

        trace.ops = [span("forward0", OpKind.FW, step_start, step_start + 1_000.0),
                     span("backward0", OpKind.BW, step_start + 1_000.0, first_backward_end),
                     span("update", OpKind.UPDATE, 6_000.0, 6_500.0), span("forward0", OpKind.FW, 6_500.0, 7_500.0),
                     span("backward0", OpKind.BW, 7_500.0, 8_500.0), span("update", OpKind.UPDATE, 9_500.0, 10_000.0)]
        for start, end in ((first_backward_end, 6_000.0), (8_500.0, 9_500.0)):
            trace.ops.append(Op("allreduce.bucket0", OpKind.COMM, rank, start, end, iteration=5, stream="comm",
                                tensor="bucket0", phase="queue+transmit"))
        return trace

    def accumulate(traces: dict[int, RankTrace]) -> tuple[float, float]:
        slots = {r: iteration_slots(t, [5]) for r, t in traces.items()}
        hand_overs = enqueues_over_ranks(slots)
        assert hand_overs.latest_us == {(5, "bucket0", 0): 5_000.0, (5, "bucket0", 1): 8_500.0}
        early, _, transmit = measure_rank(traces[0], [5], hand_overs, 1, slots[0])
        late, _, _ = measure_rank(traces[1], [5], hand_overs, 1, slots[1])
        assert transmit[5] == {"bucket0": 1_000.0} and early.forward_us == late.forward_us == 1_000.0
        return early.accumulate_us, late.accumulate_us

    # rank 1's step started 3 ms later, the same work: rank 0's 3 ms wait is out, both ranks 3.5 ms before the forward
    assert accumulate({0: rank_trace(0, 0.0, 2_000.0), 1: rank_trace(1, 3_000.0, 5_000.0)}) == (3_500.0, 3_500.0)
    # both started at once, rank 1's backward 3 ms longer: rank 0 waits for it in the replay too, as it did
    assert accumulate({0: rank_trace(0, 0.0, 2_000.0), 1: rank_trace(1, 0.0, 5_000.0)}) == (6_500.0, 6_500.0)


def test_a_later_rounds_wait_before_the_forward_is_counted_from_the_round_before():
    """LBFGS's step runs its closure (forward, backward, all-reduce) up to 4 times, the last one's forward the
    modelled one. Rank 1's step started 3 ms late (its step before ended late): rank 0 waited 3 ms at the first
    round only, after which both ranks ran from the round's end. Counted from each rank's step start, rank 1 seemed
    3 ms behind at the second round and had 3 ms added: its closures' rounds are counted from the round before."""
    from dprorun.replay.measure import enqueues_over_ranks, iteration_slots, measure_rank
    from dprorun.trace.model import Op, OpKind, RankTrace

    def rank_trace(rank: int, step_start: float) -> RankTrace:
        trace = RankTrace(rank=rank, host="h", iterations=[(5, step_start, 12_500.0)])
        spans = [(OpKind.FW, step_start, step_start + 1_000.0), (OpKind.BW, step_start + 1_000.0, step_start + 2_000.0),
                 (OpKind.FW, 6_000.0, 7_000.0), (OpKind.BW, 7_000.0, 8_000.0), (OpKind.FW, 9_000.0, 10_000.0),
                 (OpKind.BW, 10_000.0, 11_000.0), (OpKind.UPDATE, 12_000.0, 12_500.0)]
        trace.ops = [Op(kind.name.lower(), kind, rank, a, b, iteration=5, stream="phase") for kind, a, b in spans]
        for a, b in ((step_start + 2_000.0, 6_000.0), (8_000.0, 9_000.0), (11_000.0, 12_000.0)):
            trace.ops.append(Op("allreduce.bucket0", OpKind.COMM, rank, a, b, iteration=5, stream="comm",
                                tensor="bucket0", phase="queue+transmit"))
        return trace

    traces = {0: rank_trace(0, 0.0), 1: rank_trace(1, 3_000.0)}
    slots = {r: iteration_slots(t, [5]) for r, t in traces.items()}
    hand_overs = enqueues_over_ranks(slots)
    early, _, _ = measure_rank(traces[0], [5], hand_overs, 1, slots[0])
    late, _, _ = measure_rank(traces[1], [5], hand_overs, 1, slots[1])
    assert (early.accumulate_us, late.accumulate_us) == (6_000.0, 6_000.0)


def test_ddp_s_buffer_broadcast_is_named_in_the_what_ifs_it_is_not_priced_for():
    """DDP broadcasts its modules' buffers (BatchNorm's running statistics: 1,304 bytes for session 43's three-layer
    conv net) from its first rank before every training forward: a collective outside the buckets that the replay
    holds inside the forward as measured. A world-size or bandwidth what-if says so; the job as it ran does not."""
    model = _toy_model()
    model.ddp_buffer_bytes = 1304
    said = "DDP broadcasts its modules' buffers (1.3 KB"
    assert any(said in n for n in predict(model, WhatIf(world_size=4), detail="coarse").notes)
    # the modules holding them named as recorded (a quantization-aware net's are its quantizers' observers too: the
    # note said "BatchNorm's running statistics" of every buffer)
    model.ddp_buffer_owners = ["ConvBnReLU2d", "FusedMovingAvgObsFakeQuantize"]
    [note] = [n for n in predict(model, WhatIf(world_size=4), detail="coarse").notes if said in n]
    assert "(1.3 KB of ConvBnReLU2d, FusedMovingAvgObsFakeQuantize)" in note and "BatchNorm's" not in note
    assert any(said in n for n in predict(model, WhatIf(bandwidth_gbit=1.0), detail="coarse").notes)
    assert not any(said in n for n in predict(model, WhatIf(), detail="coarse").notes)
    model.ddp_buffer_bytes = 0
    assert not any(said in n for n in predict(model, WhatIf(world_size=4), detail="coarse").notes)
