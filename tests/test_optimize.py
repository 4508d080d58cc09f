"""The optimizer's passes and search on small constructed job models whose best strategy is known, the strategy
file, and `dpro optimize` on a real run."""
import json
import subprocess
import sys

import pytest

from dprorun.fsutil import TraceError
from dprorun.optimize import BudgetError, MemoryModel, optimize
from dprorun.optimize.passes import best_partitions
from dprorun.replay.template import BucketInfo, CommModel, JobModel, RankTemplate
from dprorun.strategy import Decision, Strategy, load_strategy, save_strategy
from dprorun.trace.rundir import load_run

MiB = 1 << 20


def _model(sizes: dict[str, int], ready: dict[str, float], buckets: list[list[str]], forward_us=10_000.0,
           backward_us=20_000.0, alpha_us=0.0, bandwidth_bytes_per_us=1000.0, world=2, channels=1) -> JobModel:
    template = RankTemplate(0, forward_us=forward_us, loss_us=0.0, backward_segments_us=[backward_us],
                            bucket_ready_order=[], update_us=1000.0, tail_us=0.0, enqueue_cost_us=0.0,
                            backward_us=backward_us, iterations_used=10, measured_iteration_us=0.0)
    infos = [BucketInfo(f"bucket{k}", sum(sizes[p] for p in group), list(group), 0.0)
             for k, group in enumerate(buckets)]
    comm = CommModel(alpha_us=alpha_us, bandwidth_bytes_per_us=bandwidth_bytes_per_us, source="constructed")
    return JobModel(world, {0: template, 1: template}, infos, sizes, ready, comm, None, channels=channels)


def test_tensor_fusion_splits_a_bucket_so_its_first_half_overlaps_the_backward_pass():
    # A is ready half-way through backward, B at its end; each takes 8 ms to all-reduce (2 ranks, 2 steps of
    # 4 ms). One bucket: 10 + 20 + 16 + 1 = 47 ms. Two buckets: A's sync (18 ms) overlaps backward's second half
    # (10 ms) and pushes B's back by 6 ms: 10 + 20 + 6 + 8 + 1 = 45 ms... unless B goes first: it cannot, it is
    # ready last. Best: [A], [B].
    sizes = {"A": 8_000_000, "B": 8_000_000}
    model = _model(sizes, {"A": 0.5, "B": 1.0}, [["A", "B"]], bandwidth_bytes_per_us=1000.0)
    strategy = optimize(model, caps_mb=())
    assert strategy.buckets == [["A"], ["B"]]
    assert strategy.predicted_ms < strategy.baseline_ms
    assert strategy.decisions and strategy.decisions[0].pass_name == "tensor_fusion"
    assert strategy.decisions[0].gain_ms == pytest.approx(strategy.baseline_ms - strategy.predicted_ms, abs=1e-3)


def test_tensor_fusion_merges_tiny_buckets_when_latency_dominates():
    names = [f"p{k}" for k in range(6)]
    sizes = {n: 4096 for n in names}
    ready = {n: 0.95 + 0.01 * k for k, n in enumerate(names)}  # all at the end of backward: nothing to overlap
    model = _model(sizes, ready, [[n] for n in names], alpha_us=2000.0, bandwidth_bytes_per_us=1e5)
    strategy = optimize(model, caps_mb=())
    assert strategy.buckets == [names]  # one bucket: one latency instead of six
    assert all(d.pass_name == "tensor_fusion" for d in strategy.decisions)
    assert strategy.predicted_ms < strategy.baseline_ms - 4 * 2 * 2.0  # at least 4 syncs x 2 steps x 2 ms saved


def test_tensor_partition_k_star_from_a_partial_replay():
    """A single-stage ring: pieces share the link's bandwidth and each adds its steps' latency. With one
    channel (one collective at a time, NCCL-like) k* = 1. With two (gloo's two worker threads) one piece's step
    latency hides behind the other's bytes on the link: k* = 2 saves exactly one step latency of the two."""
    sizes = {"A": 16 * MiB}
    wire = 2 * (16 * MiB / 2 / 1000.0)  # 2 steps, half the tensor each, 1000 bytes/µs
    one = _model(sizes, {"A": 1.0}, [["A"]], alpha_us=500.0, channels=1)
    k, times = best_partitions(one, 16 * MiB)
    assert k == 1 and times[1] == pytest.approx(wire + 2 * 500.0) and times[2] == pytest.approx(wire + 4 * 500.0)
    assert not optimize(one, caps_mb=()).partitions
    two = _model(sizes, {"A": 1.0}, [["A"]], alpha_us=500.0, channels=2)
    k, times = best_partitions(two, 16 * MiB)
    assert k == 2 and times[1] == pytest.approx(wire + 2 * 500.0) and times[2] == pytest.approx(wire + 500.0)
    strategy = optimize(two, caps_mb=())
    assert strategy.partitions == {"bucket0": 2}
    assert strategy.decisions[-1].pass_name == "tensor_partition"
    assert strategy.baseline_ms - strategy.predicted_ms == pytest.approx(0.5, abs=0.01)


def test_op_fusion_and_bf16_follow_their_measured_ratios_and_the_critical_path():
    """Compute-bound: compiling (measured forward x0.5, backward x0.75) saves 5 + 5 ms; bf16, measured slower
    (as on CPUs without bf16 units), is not chosen. Communication-bound: a backward twice as fast only waits
    longer for a synchronisation that starts at its beginning, so compiling is not worth it."""
    sizes = {"A": 1000}
    variants = {"eager": {"forward_us": 100.0, "backward_us": 200.0},
                "compiled": {"forward_us": 50.0, "backward_us": 150.0},
                "bf16": {"forward_us": 120.0, "backward_us": 260.0}}
    compute_bound = _model(sizes, {"A": 1.0}, [["A"]], bandwidth_bytes_per_us=1000.0)
    compute_bound.compute_variants = variants
    strategy = optimize(compute_bound, caps_mb=())
    assert strategy.compiled_modules == [""] and strategy.precision == "fp32"
    assert strategy.baseline_ms - strategy.predicted_ms == pytest.approx(5 + 5, abs=0.01)
    assert [d.pass_name for d in strategy.decisions] == ["op_fusion"]

    comm_bound = _model({"A": 40_000_000}, {"A": 0.0}, [["A"]], bandwidth_bytes_per_us=1000.0)
    comm_bound.compute_variants = {**variants, "compiled": {"forward_us": 100.0, "backward_us": 100.0}}
    strategy = optimize(comm_bound, caps_mb=())
    assert strategy.compiled_modules == [] and strategy.predicted_ms == pytest.approx(strategy.baseline_ms)
    # bf16 measured faster: chosen only when allowed (it changes the numerics); otherwise recommended
    fast_bf16 = _model(sizes, {"A": 1.0}, [["A"]], bandwidth_bytes_per_us=1000.0)
    fast_bf16.compute_variants = {**variants, "bf16": {"forward_us": 50.0, "backward_us": 100.0}}
    assert optimize(fast_bf16, caps_mb=(), allow_bf16=True).precision == "bf16"
    strategy = optimize(fast_bf16, caps_mb=())
    assert strategy.precision == "fp32" and "--allow-bf16" in strategy.search["recommendations"][0]
    assert any("not applied" in line for line in strategy.summary_lines())
    # nothing measured: neither pass is offered
    plain = _model(sizes, {"A": 1.0}, [["A"]])
    assert optimize(plain, caps_mb=()).compiled_modules == []


def test_op_fusion_per_block_keeps_the_overlap_that_a_whole_compiled_model_loses():
    """Two blocks of 8 MB gradients; each all-reduce takes 8 ms (2 ranks, 1000 bytes/µs, one channel).
    Eager (forward 10, backward 20 ms): block 1's bucket syncs at 20-28, block 0's at 30-38, update: 39 ms.
    Whole model compiled (x0.7): every gradient at the end of one backward graph (21 ms), both syncs after it:
    21 + 16 + 1 = 38 ms. Each block compiled (x0.8): block 1's gradients at the end of its graph (16 ms), sync
    16-24, block 0's at 24, sync 24-32: 33 ms. The search picks the blocks."""
    from dprorun.optimize.search import whatif_for
    from dprorun.replay.predict import replay_once

    sizes = {"1.a": 4_000_000, "1.b": 4_000_000, "0.a": 4_000_000, "0.b": 4_000_000}
    ready = {"1.a": 0.25, "1.b": 0.5, "0.a": 0.75, "0.b": 1.0}
    model = _model(sizes, ready, [["1.a", "1.b"], ["0.a", "0.b"]], bandwidth_bytes_per_us=1000.0)
    model.compute_variants = {"eager": {"forward_us": 100.0, "backward_us": 200.0},
                              "compiled": {"forward_us": 70.0, "backward_us": 140.0},
                              "compiled_blocks": {"forward_us": 80.0, "backward_us": 160.0, "blocks": ["0", "1"]}}
    assert model.block_param_groups(["0", "1"]) == [["0.a", "0.b"], ["1.a", "1.b"]]
    buckets = [["1.a", "1.b"], ["0.a", "0.b"]]
    times = {regions: replay_once(model, whatif_for(Strategy(buckets=buckets, compiled_modules=list(regions)),
                                                    model))[0] / 1000 for regions in ((), ("",), ("0", "1"))}
    assert times[()] == pytest.approx(39.0) and times[("",)] == pytest.approx(38.0)
    assert times[("0", "1")] == pytest.approx(33.0)
    strategy = optimize(model, caps_mb=())
    assert strategy.compiled_modules == ["0", "1"] and strategy.predicted_ms <= 33.0 + 1e-6
    assert "each of the 2 blocks" in strategy.decisions[0].choice


def _memory_rows(activations: int) -> MemoryModel:
    return MemoryModel([{"parts": {"at_ddp_init": 100 * MiB, "optimizer_state": 0, "other_steady": 0,
                                   "gradients": 10 * MiB, "activations": activations, "extra": 0}}])


def test_the_updates_temporaries_floor_the_memory_passes():
    """The optimizer step's temporaries (foreach Adam's square root of its second moment) are live after the
    activations are freed: accumulation and re-computation shrink the activations, not the step's peak."""
    rows = _memory_rows(80 * MiB).rows
    rows[0]["parts"]["update_transient"] = 30 * MiB
    memory = MemoryModel(rows)
    assert memory.peak_bytes(Strategy()) == 190 * MiB  # the activations set the peak as the job runs
    assert memory.peak_bytes(Strategy(accumulation_steps=4)) == 140 * MiB  # 20 MiB of activations < 30 MiB
    model = _model({"A": MiB, "B": MiB}, {"A": 0.5, "B": 1.0}, [["A", "B"]], bandwidth_bytes_per_us=1e7)
    with pytest.raises(BudgetError, match="exceeds the budget"):
        optimize(model, memory, 135 * MiB, caps_mb=())


def test_memory_budget_picks_the_fastest_pass_under_the_budget():
    sizes = {"A": MiB, "B": MiB}
    # communication is negligible: accumulation costs nothing, re-computation repeats forward work
    model = _model(sizes, {"A": 0.5, "B": 1.0}, [["A", "B"]], bandwidth_bytes_per_us=1e7)
    memory = _memory_rows(80 * MiB)
    budget = 160 * MiB  # peak 190 MiB; needs activations <= 50 MiB: k >= 2
    strategy = optimize(model, memory, budget, caps_mb=())
    assert strategy.accumulation_steps == 2 and strategy.recompute_segments == 0
    assert strategy.predicted_peak_bytes <= budget
    assert strategy.decisions[0].pass_name == "accumulation" and "budget" in strategy.decisions[0].note
    # a slow network makes accumulation's lost overlap dearer than re-computing a short forward pass
    # (A: 3 MiB, 31 ms to sync, ready half-way through a 40 ms backward: accumulation leaves only 10 ms of the
    # last micro-batch's backward to hide it, re-computation adds 0.5 ms of forward)
    slow = _model({"A": 3 * MiB, "B": MiB}, {"A": 0.5, "B": 1.0}, [["A"], ["B"]], forward_us=1000.0,
                  backward_us=40_000.0, bandwidth_bytes_per_us=100.0)
    strategy = optimize(slow, memory, budget, caps_mb=())
    assert strategy.recompute_segments == 2 and strategy.accumulation_steps == 1
    with pytest.raises(BudgetError, match="exceeds the budget"):
        optimize(model, memory, 105 * MiB, caps_mb=())


def test_a_job_already_at_its_best_keeps_its_settings():
    names = [f"p{k}" for k in range(4)]
    sizes = {n: 4096 for n in names}
    model = _model(sizes, {n: 1.0 for n in names}, [names], alpha_us=500.0, bandwidth_bytes_per_us=1e5)
    strategy = optimize(model)
    assert strategy.is_default() and not strategy.decisions
    assert any("already the best" in line for line in strategy.summary_lines())


def test_resnet50_shaped_16_rank_search_is_fast_and_gains():
    from dprorun.synth import resnet50_job_model

    strategy = optimize(resnet50_job_model(16, bandwidth_gbit=10.0))
    assert strategy.search["seconds"] < 60
    assert strategy.predicted_ms < strategy.baseline_ms


def test_strategy_file_round_trip_and_errors(tmp_path, monkeypatch):
    import dprorun

    original = Strategy(buckets=[["a", "b"], ["c"]], partitions={"bucket1": 4}, accumulation_steps=2,
                        decisions=[Decision("tensor_fusion", "merge", 10.0, 9.0)], baseline_ms=10.0, predicted_ms=9.0)
    path = str(tmp_path / "strategy.json")
    save_strategy(original, path)
    loaded = load_strategy(path)
    assert loaded.buckets == original.buckets and loaded.partitions == {"bucket1": 4}
    assert loaded.decisions[0].gain_ms == 1.0
    assert dprorun.strategy() is None
    monkeypatch.setenv("DPRO_STRATEGY", path)
    assert dprorun.strategy().accumulation_steps == 2
    doc = json.loads(open(path).read())
    for bad, problem in (({**doc, "version": 99}, "schema version"), ({**doc, "buckets": [1, 2]}, "buckets"),
                         ({**doc, "partitions": {"bucket0": 0}}, "partitions")):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(TraceError, match=problem):
            load_strategy(str(tmp_path / "bad.json"))


def test_dpro_optimize_on_a_real_run(mlp_run, tmp_path):
    mlp_run = str(mlp_run[0])
    out = tmp_path / "strategy.json"
    proc = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "optimize", mlp_run, "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "predicted iteration time" in proc.stdout
    strategy = load_strategy(str(out))
    assert strategy.baseline_ms > 0 and strategy.predicted_ms <= strategy.baseline_ms
    proc = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "optimize", mlp_run, "--memory-budget",
                           "1MiB"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "exceeds the budget" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("channels", [1, 2])
def test_symmetric_replay_of_identical_ranks_equals_the_full_replay(channels):
    from dprorun.replay.whatif import WhatIf
    from dprorun.replay.synthesize import synthesize
    from dprorun.replay.predict import replay_once, representative
    from dprorun.synth import resnet50_job_model

    model = resnet50_job_model(8, bandwidth_gbit=10.0)
    model.channels = channels
    whatifs = [WhatIf(), WhatIf(bucket_mb=2.0), WhatIf(bucket_mb=50.0, partitions=3), WhatIf(world_size=16),
               WhatIf(bandwidth_gbit=1.0, bucket_mb=5.0, accumulation_steps=2)]
    from dprorun.replay.engine import replay

    for whatif in whatifs:
        full_graph = synthesize(model, whatif, [], fold=False)
        full = replay(full_graph).iteration_time_us
        sym, report = replay_once(representative(model), whatif)
        assert sym == pytest.approx(full, rel=1e-9), whatif
        assert replay_once(model, whatif)[0] == pytest.approx(full, rel=1e-9)  # folded by itself: one template
        assert report["path"]  # a critical path of the one built rank
        world = whatif.world_size or model.world_size
        assert synthesize(representative(model), whatif, []).size * world == \
            pytest.approx(full_graph.size, rel=0.01)


def test_a_ring_of_repeating_ranks_is_folded_exactly(mlp_run):
    """N ranks synthesised from m measured ones (round-robin) repeat every m ranks around the ring: with N a
    multiple of m only m are built, and every prediction equals the full graph's."""
    from dprorun.replay.engine import replay
    from dprorun.replay.build import build_job_model
    from dprorun.replay.whatif import WhatIf
    from dprorun.replay.synthesize import synthesize

    model = build_job_model(load_run(str(mlp_run[0])))
    assert len(model.templates) == 2
    for whatif in (WhatIf(world_size=4), WhatIf(world_size=8, bucket_mb=0.5), WhatIf(world_size=6, partitions=2),
                   WhatIf(world_size=3)):
        for sample in [None] + model.samples[:2]:
            folded = synthesize(model, whatif, [], sample)
            full = synthesize(model, whatif, [], sample, fold=False)
            assert folded.meta["ranks_built"] == (2 if whatif.world_size % 2 == 0 else whatif.world_size)
            assert replay(folded).iteration_time_us == pytest.approx(replay(full).iteration_time_us, rel=1e-9)


def test_the_search_at_16_ranks_compares_candidates_on_symmetric_replays():
    from dprorun.synth import resnet50_job_model

    strategy = optimize(resnet50_job_model(16, bandwidth_gbit=10.0))
    assert strategy.search["symmetric_replays"] is True
    assert "warning" not in strategy.search
    assert strategy.predicted_ms < strategy.baseline_ms  # both from full replays


def test_communication_passes_stay_out_where_the_transport_shares_the_compute_cores(mlp_run):
    """A CPU transport on busy cores (loopback, every core computing): the replay does not price its cost, so
    the search leaves the bucket layout alone unless asked; with a separate transport it searches as before."""
    from dprorun.replay.build import build_job_model

    model = build_job_model(load_run(str(mlp_run[0])))
    model.transport = {"shares_cores": True, "transport_cpu_share": 0.55}
    kept = optimize(model)
    assert not any(d.pass_name in ("tensor_fusion", "tensor_partition") for d in kept.decisions)
    assert kept.search["comm_passes"].startswith("off: the job's transport is CPU work")
    forced = optimize(model, comm_passes=True)
    model.transport = {"shares_cores": False, "transport_cpu_share": 0.04}
    auto = optimize(model)
    assert "comm_passes" not in auto.search and "comm_passes" not in forced.search
    assert [d.choice for d in auto.decisions] == [d.choice for d in forced.decisions]
