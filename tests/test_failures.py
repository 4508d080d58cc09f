"""Failure paths of the launcher: a hanging rank under --timeout, a port already in use."""
import os
import socket
import sys

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
