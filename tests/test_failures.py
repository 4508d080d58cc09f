"""Failure paths of the launcher: a hanging rank under --timeout, a port already in use."""
import os
import socket

import psutil

from conftest import EXAMPLES, run_dprorun

HANG = """
import time
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(3600)  # marker-{marker}
dist.barrier()
"""


def test_timeout_stops_a_hanging_job(tmp_path):
    marker = "hang-765432"
    script = tmp_path / "hang.py"
    script.write_text(HANG.replace("{marker}", marker) + f"\n# {marker}\n")
    proc, elapsed = run_dprorun(["-np", "2", "--timeout", "5", "python", str(script), marker], tmp_path / "run",
                                timeout=60)
    assert proc.returncode == 124 and "timed out after 5 s (--timeout)" in proc.stderr
    assert elapsed < 5 + 15
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []


def test_port_in_use_is_one_clear_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc, elapsed = run_dprorun(["-np", "2", "--master-port", str(port), "python",
                                     os.path.join(EXAMPLES, "mlp_many_layers.py"), "--steps", "2"], tmp_path / "run",
                                    timeout=60)
    assert proc.returncode == 1 and f"port {port} on 127.0.0.1 is already in use" in proc.stderr
    assert "Traceback" not in proc.stderr and elapsed < 30


def test_a_rank_killed_by_sigkill_is_named_with_its_signal(tmp_path):
    marker = "554433"
    proc, elapsed = run_dprorun(["-np", "2", "--warmup", "1", "--active", "2", "--kineto-iters", "1", "--clean", "1",
                                 "python", os.path.join(EXAMPLES, "mlp_many_layers.py"), "--steps", "40",
                                 "--fail-at-step", "8", "--fail-mode", "sigkill", "--seed", marker],
                                tmp_path / "run", timeout=90)
    assert proc.returncode == 137 and "rank 1 (local rank 1" in proc.stderr and "SIGKILL" in proc.stderr
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []
    assert (tmp_path / "run" / "rank_1" / "events.json").exists()  # written at the end of its window


def test_profiler_failure_disables_profiling_and_training_continues(tmp_path):
    import json

    proc, _ = run_dprorun(["-np", "2", "--warmup", "1", "--active", "3", "--clean", "1", "-q", "python",
                           os.path.join(EXAMPLES, "mlp_many_layers.py"), "--steps", "10"], tmp_path / "run",
                          env={"DPRO_TEST_FAULT": "profiler"}, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "profiling disabled, training continues" in proc.stderr
    assert "median iteration time" in proc.stdout  # the script ran to its end
    events = json.loads((tmp_path / "run" / "rank_0" / "events.json").read_text())
    assert events["disabled"] and any("injected profiler failure" in w for w in events["warnings"])


def test_trace_over_the_size_cap_is_dropped_with_a_warning(tmp_path):
    import json

    proc, _ = run_dprorun(["-np", "2", "--warmup", "1", "--active", "3", "--clean", "1", "-q", "python",
                           os.path.join(EXAMPLES, "mlp_many_layers.py"), "--steps", "10"], tmp_path / "run",
                          env={"DPRO_MAX_TRACE_MB": "0.01"}, timeout=90)
    assert proc.returncode == 0
    assert not (tmp_path / "run" / "rank_0" / "kineto_trace.json").exists()
    events = json.loads((tmp_path / "run" / "rank_0" / "events.json").read_text())
    assert any("exceeds the cap" in w for w in events["warnings"]) and events["comm"]
