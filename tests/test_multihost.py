"""Two hosts that share nothing but a network: an emulated cluster (scripts/emulated_cluster.py: one network
namespace, CPU quota and 1 Gbit link per host). Each node gets its own run directory, as on two machines; the
traces must reach node 0's over the job's process group, and a world-size dry run must predict from them."""
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

from emulated_cluster import EmulatedCluster  # noqa: E402


def _cluster_unavailable() -> str:
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, cgroups)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    probe = subprocess.run(["ip", "netns", "add", "dprotestprobe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create network namespaces here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "dprotestprobe"], capture_output=True)
    if not (os.path.isfile("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") or os.path.isdir("/sys/fs/cgroup/unified")
            or os.path.isfile("/sys/fs/cgroup/cgroup.controllers")):
        return "no cgroup cpu controller"
    return ""


UNAVAILABLE = _cluster_unavailable()


@pytest.mark.skipif(bool(UNAVAILABLE), reason=UNAVAILABLE)
def test_two_hosts_gather_into_node0_and_dry_run_predicts_four(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with EmulatedCluster(2, 0.9) as cluster:
        results = cluster.run(
            [sys.executable, "-m", "dprorun.cli", "--dry-run", "--nnodes", "{nnodes}", "--node-rank", "{node_rank}",
             "--master-addr", "{master_addr}", "--master-port", "29640", "-np", "2", "--local-np", "1", "--json",
             "--warmup", "2", "--active", "6", "--clean", "2", "--run-dir", str(tmp_path / "node{node_rank}"),
             "python", os.path.join(REPO, "examples", "mlp_many_layers.py"), "--steps", "20"], 240, env)
    assert [r.returncode for r in results] == [0, 0], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    # rank 1's files were sent over the network (the hosts share a hostname, so only the token test tells)
    assert (node0 / "rank_1" / "GATHERED_FROM").is_file() and (node0 / "rank_1" / "events.json").is_file()
    assert not any(node0.glob(".gather-*")), "the gather token is removed"
    assert (node1 / "rank_1" / "events.json").is_file() and not (node1 / "rank_0").exists()
    import json

    prediction = json.loads((node0 / "prediction.json").read_text())
    assert prediction["world_size"] == 4 and prediction["predicted_iteration_time_ms"] > 0
    assert prediction["comm_model"]["collective_us"] >= 0 and prediction["comm_model"]["alpha_us"] > 0
    assert "predicted iteration time" in results[0].stdout or "predicted_iteration_time_ms" in results[0].stdout
