"""--autotune and --strategy on real 2-rank jobs: the strategy reaches DDP through the hooks with no change to
the script, the never-regress rule reverts, and a job with nothing to tune keeps its settings."""
import json
import os

import pytest

from conftest import EXAMPLES, run_dprorun
from dprorun.strategy import Strategy, save_strategy
from dprorun.trace.rundir import load_run

pytestmark = pytest.mark.slow
MLP = os.path.join(EXAMPLES, "mlp_many_layers.py")
WINDOW = ["--warmup", "3", "--active", "6", "--kineto-iters", "1", "--clean", "2"]


def _phases(run_dir) -> dict:
    with open(os.path.join(run_dir, "autotune.json")) as handle:
        return {p["phase"]: p for p in json.load(handle)["phases"]}


def test_strategy_file_is_applied_by_the_hooks(mlp_run, tmp_path):
    """Groups of the real model's parameters in gradient-ready order become DDP's buckets (per-bucket caps), one
    bucket's all-reduce runs in 3 pieces through the comm hook, a submodule is torch.compile'd and the model runs
    under bf16 autocast; training runs to the end."""
    run = load_run(str(mlp_run[0]))
    trace = run.ranks[0]
    ready = sorted({name for _, name, _ in trace.grad_ready},
                   key=lambda n: min(t for _, m, t in trace.grad_ready if m == n))
    groups = [ready[:10], ready[10:30], ready[30:]]
    path = tmp_path / "strategy.json"
    save_strategy(Strategy(buckets=groups, partitions={"bucket1": 3}, compiled_modules=["2"], precision="bf16"),
                  str(path))
    run_dir = tmp_path / "run"
    proc, _ = run_dprorun(["-np", "2", "-q", "--strategy", str(path), *WINDOW, "python", MLP, "--steps", "14"],
                          run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "median iteration time" in proc.stdout
    events = json.load(open(run_dir / "rank_0" / "events.json"))
    applied = events["strategy"]["applied"]
    assert len(applied["bucket_cap_mb_list"]) == 3 and applied["partitions"] == {"bucket1": 3}
    assert applied["compiled_modules"] == ["2"] and applied["precision"] == "bf16 autocast on cpu"
    buckets = load_run(str(run_dir)).ranks[0].buckets
    assert sorted(len(b.params) for b in buckets) == sorted(len(g) for g in groups)
    assert {frozenset(b.params) for b in buckets} == {frozenset(g) for g in groups}


KEYWORD_MODEL_SCRIPT = """
import torch, torch.distributed as dist, torch.nn as nn
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)


class Net(nn.Module):  # called with keywords only, as Hugging Face models are
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))

    def forward(self, *, features):
        return self.body(features)


model = nn.parallel.DistributedDataParallel(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 64), torch.randint(0, 4, (32,))
for step in range(14):
    opt.zero_grad(); nn.functional.cross_entropy(model(features=x), y).backward(); opt.step()
print("trained", step + 1, "steps")
"""


def test_compute_variants_are_measured(tmp_path):
    """--measure-variants: rank 0 times the real model eager / torch.compile / bf16 after the window (training
    then continues to the end with its state restored), on the batch it was called with, keywords included (a
    model called as model(features=x) was timed with no arguments: every variant a TypeError). (A strategy's
    compiled_modules and bf16 reach the model through the hooks: test_strategy_file_is_applied_by_the_hooks.)"""
    run_dir = tmp_path / "measured"
    script = tmp_path / "keywords.py"
    script.write_text(KEYWORD_MODEL_SCRIPT)
    proc, _ = run_dprorun(["-np", "2", "-q", "--measure-variants", *WINDOW, "python", str(script)],
                          run_dir, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trained 14 steps" in proc.stdout
    variants = json.load(open(run_dir / "rank_0" / "variants.json"))["variants"]
    assert variants["eager"]["forward_us"] > 0 and variants["eager"]["backward_us"] > 0
    for name in ("compiled", "bf16"):  # measured, or the reason it could not be (e.g. no C++ compiler)
        assert variants[name].get("forward_us", 0) > 0 or variants[name]["error"]
    assert "no blocks" in variants["compiled_blocks"]["error"]  # an MLP of Linear layers has no blocks
    assert not (run_dir / "rank_1" / "variants.json").exists()
    model = load_run(str(run_dir))
    from dprorun.replay.build import build_job_model

    assert build_job_model(model).compute_scales("eager") == (1.0, 1.0)


def test_a_second_trial_drops_only_the_compute_passes(mlp_run):
    from dprorun.autotune import _without_compute_passes
    from dprorun.strategy import Decision

    run = load_run(str(mlp_run[0]))
    both = Strategy(bucket_cap_mb=5.0, compiled_modules=[""], precision="bf16",
                    decisions=[Decision("tensor_fusion", "DDP bucketing at 5 MB", 20.0, 18.0),
                               Decision("op_fusion", "torch.compile the model", 18.0, 17.0),
                               Decision("mixed_precision", "bf16 autocast", 17.0, 16.0)])
    reduced = _without_compute_passes(both, run)
    assert reduced.compiled_modules == [] and reduced.precision == "fp32" and reduced.bucket_cap_mb == 5.0
    assert [d.pass_name for d in reduced.decisions] == ["tensor_fusion"] and reduced.predicted_ms > 0
    only_compute = Strategy(compiled_modules=[""], decisions=[both.decisions[1]])
    assert _without_compute_passes(only_compute, run) is None  # nothing would be left to try
    assert _without_compute_passes(Strategy(bucket_cap_mb=5.0, decisions=[both.decisions[0]]), run) is None


def test_bad_strategy_file_is_a_clear_error(tmp_path):
    path = tmp_path / "strategy.json"
    path.write_text(json.dumps({"version": 7}))
    proc, _ = run_dprorun(["-np", "2", "--strategy", str(path), "python", MLP], tmp_path / "run")
    assert proc.returncode == 2 and "schema version 7" in proc.stderr and "Traceback" not in proc.stderr


def test_autotune_trials_must_be_at_least_one(tmp_path):
    proc, _ = run_dprorun(["-np", "2", "--autotune", "--autotune-trials", "0", "python", MLP], tmp_path / "run")
    assert proc.returncode == 2 and "--autotune-trials is at least 1" in proc.stderr and "Traceback" not in proc.stderr


def test_autotune_reverts_when_the_trial_is_not_faster_enough(tmp_path):
    run_dir = tmp_path / "run"
    # a required gain of 95 % cannot be met: whatever the search finds must be reverted (never-regress)
    # (no compute variants timed: torch.compile's measurement has a test of its own)
    proc, _ = run_dprorun(["-np", "2", "--autotune", "--autotune-min-gain", "0.95", "--no-compute-passes", *WINDOW,
                           "python", MLP,
                           "--steps", "24", "--bucket-mb", "25"], run_dir, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    phases = _phases(run_dir)
    assert {"profiling", "searching", "deciding", "running", "done"} <= set(phases)
    assert phases["deciding"]["keep"] is False
    assert "reverting" in proc.stdout or "already the best" in proc.stdout
    assert os.path.exists(run_dir / "strategy.json")
    events = json.load(open(run_dir / "rank_0" / "events.json"))
    assert events["strategy"] is None  # the job ran with its own settings
    assert os.path.isdir(run_dir / "autotune" / "profile" / "rank_1")


def test_autotune_keeps_a_job_that_has_nothing_to_tune(tmp_path):
    run_dir = tmp_path / "run"
    # one rank, one bucket: no communication to hide and no per-bucket cost to save (and no compute variants
    # timed: whether torch.compile pays off on this model is a measurement, tested on its own)
    proc, _ = run_dprorun(["-np", "1", "--autotune", "--no-compute-passes", *WINDOW, "python", MLP, "--steps", "16", "--bucket-mb", "100"],
                          run_dir, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "already the best found; keeping them" in proc.stdout
    phases = _phases(run_dir)
    assert phases["deciding"]["keep"] is False and "trial" not in phases
    assert not os.path.exists(run_dir / "autotune" / "trial")
