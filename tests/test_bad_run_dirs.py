"""`dpro` on damaged run directories: one clear error naming the file and the problem, exit 2, no traceback."""
import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO


def dpro(*args):
    return subprocess.run([sys.executable, "-m", "dprorun.offline_cli", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=60)


def damaged_copy(mlp_run, tmp_path):
    run_dir, _ = mlp_run
    target = tmp_path / "run"
    shutil.copytree(run_dir, target)
    return target


def test_truncated_events_file(mlp_run, tmp_path):
    run = damaged_copy(mlp_run, tmp_path)
    path = run / "rank_1" / "events.json"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    out = dpro("summary", str(run))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert str(path) in out.stderr and "truncated JSON" in out.stderr


def test_truncated_profiler_trace(mlp_run, tmp_path):
    run = damaged_copy(mlp_run, tmp_path)
    path = run / "rank_0" / "kineto_trace.json"
    path.write_bytes(path.read_bytes()[:5000])
    out = dpro("summary", str(run))
    assert out.returncode == 2 and str(path) in out.stderr and "truncated" in out.stderr


@pytest.mark.parametrize("change,needle", [({"version": 99}, "unsupported events version 99"),
                                           ({"job_id": "another-job"}, "mixed runs"),
                                           ({"rank": 0}, "lies in the folder of rank 1"),
                                           ({"comm": [[1, 0, 0, "x", 1, 2]]}, "non-numeric")])
def test_wrong_version_mixed_job_and_bad_records(mlp_run, tmp_path, change, needle):
    run = damaged_copy(mlp_run, tmp_path)
    path = run / "rank_1" / "events.json"
    doc = json.loads(path.read_text())
    doc.update(change)
    path.write_text(json.dumps(doc))
    out = dpro("summary", str(run))
    assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr


def test_missing_rank_is_reported_not_fatal(mlp_run, tmp_path):
    run = damaged_copy(mlp_run, tmp_path)
    shutil.rmtree(run / "rank_1")
    out = dpro("summary", str(run), "--json")
    assert out.returncode == 0
    summary = json.loads(out.stdout)
    assert summary["missing_ranks"] == [1] and summary["ranks_recorded"] == [0]
