"""Large runs: a 72-rank run directory made from a real 2-rank run (dprorun.synth.replicate_run_dir) is read in
parallel with op-level detail for a few ranks, aligned by the linear program (injected offsets recovered), and
replayed with collapsed rings and folded what-if curves; with every rank alike the collapsed ring gives the
step-level ring's prediction."""
import random

import pytest

from dprorun.analysis import RunAnalysis
from dprorun.replay import comm as replay_comm, predict as replay_predict
from dprorun.report_data import build_report
from dprorun.synth import replicate_run_dir
from dprorun.trace import rundir


@pytest.fixture(scope="module")
def large_run(mlp_run, tmp_path_factory):
    target = str(tmp_path_factory.mktemp("scale") / "run72")
    offsets = replicate_run_dir(str(mlp_run[0]), 72, target, random.Random(3))
    return target, offsets


def test_large_run_read_aligned_and_reported(large_run):
    target, offsets = large_run
    analysis = RunAnalysis(target)
    run = analysis.run
    assert sorted(run.ranks) == list(range(72)) and not run.missing_ranks
    detailed = {r for r, t in run.ranks.items() if any(op.source == "kineto" and op.stream == "main" for op in t.ops)}
    assert detailed == set(range(rundir.DETAIL_RANKS))
    assert any(p.startswith("large run") for p in run.problems)
    assert all(any(op.phase == "transmit" for op in t.ops) for t in run.ranks.values())  # collectives: every rank
    alignment = analysis.alignment
    assert alignment.constraint_rows < 72 * 71  # rows grow with ranks x collectives, not with rank pairs
    # injected offsets recovered within 50 us, or else the alignment says so: a rank further off has a stated
    # interval at least that wide and the alignment is marked approximate (no silent wrong offset). One clean-clone
    # run (session 17) found one rank 526 us off here, on the real 2-rank run it replicates; not reproduced since.
    errors = {rank: abs(alignment.offsets_us[rank] - (offsets[0] - offset)) for rank, offset in offsets.items()}
    loose = {rank: (round(err, 1), alignment.uncertainty_us.get(rank)) for rank, err in errors.items() if err >= 50.0}
    assert len(loose) <= len(offsets) // 10, (loose, alignment.warnings)
    for rank, (err, width) in loose.items():
        assert alignment.approximate and width is not None and width >= err, (rank, err, width, alignment.warnings)
    data = build_report(analysis, whatif_time_budget_s=30.0)
    assert data["whatif"]["folded"] and len(data["whatif"]["world_size"]) >= 3
    assert {op[0] for op in data["measured_timeline"]["ops"]} <= set(range(16))
    assert any("one op per rank" in note for note in analysis.prediction.notes)


def test_sequential_and_parallel_reads_agree(large_run):
    target, _ = large_run
    one = rundir.load_run(target, workers=1)
    two = rundir.load_run(target, workers=2)
    assert sorted(one.ranks) == sorted(two.ranks)
    for rank in (0, 9, 71):
        assert [(o.name, o.start_us, o.end_us) for o in one.ranks[rank].ops] == \
               [(o.name, o.start_us, o.end_us) for o in two.ranks[rank].ops]


def test_collapsed_ring_gives_the_step_level_as_run_prediction(mlp_run, monkeypatch):
    """With every rank alike (the representative model), the collapsed ring (one op per rank after the last ready
    rank) and the step ring finish together. With stragglers they differ: a step ring lets an early rank start its
    first steps (2.6 % on one real 2-rank run, benchmarks/RESULTS.md), which is why rings are collapsed only
    beyond 64 built ranks."""
    model = replay_predict.representative(RunAnalysis(str(mlp_run[0])).model)
    stepwise = replay_predict.predict(model).predicted_iteration_time_ms
    monkeypatch.setattr(replay_comm, "COLLAPSE_FROM_RANKS", 0)
    collapsed = replay_predict.predict(model)
    assert any("one op per rank" in note for note in collapsed.notes)
    assert collapsed.predicted_iteration_time_ms == pytest.approx(stepwise, rel=1e-6)
