"""Two hosts that share nothing but a network: an emulated cluster (scripts/emulated_cluster.py: one network
namespace, CPU quota and 1 Gbit link per host). Each node gets its own run directory, as on two machines; the
traces must reach node 0's over the job's process group, and a world-size dry run must predict from them."""
import importlib
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
             "python", os.path.join(REPO, "examples", "mlp_many_layers.py"), "--steps", "20",
             "--own-profiler", "9,9,1"], 240, env)  # rank 1's script profiles its step 9 itself: a clean iteration
    assert [r.returncode for r in results] == [0, 0], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    # rank 1's files were sent over the network (the hosts share a hostname, so only the token test tells)
    assert (node0 / "rank_1" / "GATHERED_FROM").is_file() and (node0 / "rank_1" / "events.json").is_file()
    assert not any(node0.glob(".gather-*")), "the gather token is removed"
    assert (node1 / "rank_1" / "events.json").is_file() and not (node1 / "rank_0").exists()
    import json

    # rank 0 writes rank 1's clean.json from the exchange after the clean iterations: with the iterations rank 1 ran
    # under its script's profiler (they leave the clean statistics), as rank 1's own file on node 1 has them
    # (its profiler's schedule prepares during step 7, the window's last: that one is in its events.json)
    marks = json.loads((node1 / "rank_1" / "clean.json").read_text())["script_profiler_iterations"]
    assert marks == [7, 8, 9], marks
    assert json.loads((node0 / "rank_1" / "clean.json").read_text())["script_profiler_iterations"] == [8, 9]
    window_marks = json.loads((node0 / "rank_1" / "events.json").read_text())["script_profiler_iterations"]
    assert 7 in window_marks and set(window_marks) <= set(marks), window_marks
    assert json.loads((node0 / "rank_0" / "clean.json").read_text()).get("script_profiler_iterations", []) == []
    prediction = json.loads((node0 / "prediction.json").read_text())
    assert prediction["world_size"] == 4 and prediction["predicted_iteration_time_ms"] > 0
    # alpha is the probes' message latency, capped by the fitted intercept (0 when the fit's intercept is)
    assert prediction["comm_model"]["collective_us"] >= 0 and prediction["comm_model"]["alpha_us"] >= 0
    assert prediction["comm_model"]["bandwidth_gbit_s"] > 0
    probes = json.loads((node0 / "rank_0" / "events.json").read_text())["clock_probes"]
    assert len(probes) == 40  # rank 0 ping-ponged with rank 1 across the link: the message latency is measured
    assert "predicted iteration time" in results[0].stdout or "predicted_iteration_time_ms" in results[0].stdout
    # each host sees its own CPU quota (0.9 of a core), as a rank on a real machine or container would
    for node, rank in ((node0, 0), (node0, 1)):
        cpu = json.loads((node / f"rank_{rank}" / "events.json").read_text())["cpu"]
        assert cpu["cgroup_quota_cores"] == pytest.approx(0.9) and cpu["cores_per_rank"] == pytest.approx(0.9)


def _missing(module: str, how: str) -> str:
    """Why a test that needs `module` (and the emulated cluster) cannot run here; "" when it can."""
    if UNAVAILABLE:
        return UNAVAILABLE
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, or a build that does not match this torch
        return f"{module} is not importable ({type(exc).__name__}); {how}"
    return ""


HOROVOD_UNAVAILABLE = ("needs sshd (Debian openssh-server) for horovodrun -H between emulated hosts"
                       if not UNAVAILABLE and not os.path.exists("/usr/sbin/sshd") else
                       _missing("horovod.torch", "scripts/install-horovod builds it"))


@pytest.mark.skipif(bool(HOROVOD_UNAVAILABLE), reason=HOROVOD_UNAVAILABLE)
def test_horovod_across_two_hosts_with_separate_disks():
    """dprorun --backend horovod --hosts: horovodrun starts rank 1 on the other emulated host over ssh; that host
    has its own disk at the run directory's path, so rank 1's traces reach node 0 only through Horovod's
    collectives."""
    import json

    private = f"/tmp/dpro-multihost-{os.getpid()}"
    shutil.rmtree(private, ignore_errors=True)
    try:
        with EmulatedCluster(2, 0.9, ssh=True, private_dir=private) as cluster:
            cmd = cluster.in_host(0, [sys.executable, "-m", "dprorun.cli", "--backend", "horovod", "--hosts",
                                      f"{cluster.addr(0)}:1,{cluster.addr(1)}:1", "--ssh-identity-file",
                                      cluster.ssh_identity, "--network-interfaces", "eth0", "-q", "--warmup", "2",
                                      "--active", "4", "--kineto-iters", "1", "--clean", "1", "--run-dir",
                                      os.path.join(private, "run"), "python",
                                      os.path.join(REPO, "examples", "horovod_mlp.py"), "--steps", "12"])
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                                  env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        run = os.path.join(private, "run")
        assert open(os.path.join(run, "rank_1", "GATHERED_FROM")).read() == cluster.hostname(1)
        manifest = json.load(open(os.path.join(run, "manifest.json")))
        assert manifest["world_size"] == 2
        summary = json.load(open(os.path.join(run, "summary.json")))
        assert [r["host"] for r in summary["ranks"]] == ["emu0", "emu1"]
    finally:
        shutil.rmtree(private, ignore_errors=True)


TF_UNAVAILABLE = _missing("tensorflow", "scripts/install-tf installs it")


@pytest.mark.skipif(bool(TF_UNAVAILABLE), reason=TF_UNAVAILABLE)
def test_tensorflow_across_two_hosts_gathers_into_node0_and_aligns(tmp_path):
    """dprorun --backend tf --hosts on each of two emulated hosts (own network namespace, CPU quota, run
    directory): the workers' TF_CONFIG names both hosts, and rank 1's traces reach node 0 over the side gloo
    group, after clock probes across the link; the alignment bounds rank 1's offset (both hosts share this
    machine's clock, so the truth is 0). Without TensorFlow's profiler (--no-kineto): under the hosts' CPU quota
    it crashed at its stop (in its export) in 5 of 8 launches here, 4 of 5 with the eager queue drained and a
    pause before the stop; the launches without it: 0 of 3 crashed."""
    import json

    env = dict(os.environ, OMP_NUM_THREADS="1", TF_NUM_INTEROP_THREADS="1", TF_NUM_INTRAOP_THREADS="1")
    with EmulatedCluster(2, 0.9) as cluster:
        hosts = f"{cluster.hostname(0)}:1,{cluster.hostname(1)}:1"
        results = cluster.run(
            [sys.executable, "-m", "dprorun.cli", "--backend", "tf", "--hosts", hosts, "-q", "--warmup", "2",
             "--active", "5", "--no-kineto", "--clean", "3", "--run-dir", str(tmp_path / "node{node_rank}"),
             "python", os.path.join(REPO, "examples", "tf_custom_loop.py"), "--steps", "14", "--width", "32"],
            400, env)
    assert [r.returncode for r in results] == [0, 0], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    assert (node0 / "rank_1" / "GATHERED_FROM").read_text() == cluster.hostname(1)
    assert (node0 / "rank_1" / "events.json").is_file() and (node0 / "rank_1" / "clean.json").is_file()
    assert (node1 / "rank_1" / "events.json").is_file() and not (node1 / "rank_0").exists()
    assert len(json.loads((node0 / "rank_0" / "events.json").read_text())["clock_probes"]) == 40
    out = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "align", str(node0), "--json"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert set(doc["probe_intervals_us"]) == {"1"}
    assert abs(doc["offsets_us"]["1"]) <= max(50.0, doc["uncertainty_us"]["1"]), doc
    summary = json.loads((node0 / "summary.json").read_text())
    assert [r["host"] for r in summary["ranks"]] == [cluster.hostname(0), cluster.hostname(1)]


def _mxnet_unavailable() -> str:
    if UNAVAILABLE:
        return UNAVAILABLE
    try:
        from dprorun.config import JobConfig
        from dprorun.launch_ps import mxnet_python

        mxnet_python(JobConfig(command=["python"]))
    except FileNotFoundError as exc:
        return str(exc)
    return ""


MXNET_UNAVAILABLE = _mxnet_unavailable()


@pytest.mark.skipif(bool(MXNET_UNAVAILABLE), reason=MXNET_UNAVAILABLE)
def test_mxnet_parameter_server_across_two_hosts(tmp_path):
    """dprorun --backend mxnet --hosts on each of two emulated hosts: the scheduler on node 0, a server and a worker
    on each node (ps-lite over the hosts' link); node 1 measures its clock against node 0's and sends its worker's
    and server's traces to node 0, which replays the job with both servers."""
    import json

    env = dict(os.environ, OMP_NUM_THREADS="1")
    with EmulatedCluster(2, 0.9) as cluster:
        hosts = f"{cluster.hostname(0)}:1,{cluster.hostname(1)}:1"
        results = cluster.run(
            [sys.executable, "-m", "dprorun.cli", "--backend", "mxnet", "--hosts", hosts, "--servers", "1", "-q",
             "--warmup", "3", "--active", "8", "--clean", "6", "--run-dir", str(tmp_path / "node{node_rank}"),
             "python", os.path.join(REPO, "examples", "mxnet_gluon.py"), "--steps", "20", "--model", "mlp"],
            400, env)
    assert [r.returncode for r in results] == [0, 0], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    gathered = {p.parent.name for p in node0.glob("*/GATHERED_FROM")}
    assert len(gathered) == 2 and {n[:5] for n in gathered} == {"rank_", "serve"}  # node 1's worker and server
    assert all((node0 / role / "GATHERED_FROM").read_text() == cluster.hostname(1) for role in gathered)
    assert (node0 / "rank_0" / "events.json").is_file() and (node0 / "rank_1" / "events.json").is_file()
    assert (node0 / "server_0").is_dir() and (node0 / "server_1").is_dir()
    assert not (node1 / "summary.json").exists()
    clocks = json.loads((node0 / "node_clocks.json").read_text())["nodes"]
    assert abs(clocks["1"]["offset_us"]) <= max(50.0, clocks["1"]["uncertainty_us"])  # one machine's clock
    aligned = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "align", str(node0), "--json"],
                             capture_output=True, text=True, cwd=REPO, timeout=120)
    assert aligned.returncode == 0 and json.loads(aligned.stdout)["offsets_us"]["1"] == clocks["1"]["offset_us"]
    summary = json.loads((node0 / "summary.json").read_text())
    assert summary["model"]["workers"] == 2 and summary["model"]["servers"] == 2
    assert summary["as_run"]["predicted_iteration_ms"] > 0
    # the roles' hosts are known (one worker and one server per host): `--links hosts` prices each host's NIC and
    # loopback apart; the job as run is fitted on one medium (better on the servers what-if: benchmarks/RESULTS.md)
    assert summary["model"]["links"] == "shared" and len(summary["model"]["hosts"]) == 2
    assert sorted(summary["model"]["worker_hosts"]) == [0, 1] and sorted(summary["model"]["server_hosts"]) == [0, 1]
    hosts = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", str(node0), "--links", "hosts",
                            "--json"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert hosts.returncode == 0, hosts.stderr
    busy = json.loads(hosts.stdout)["device_busy_ms"]
    assert any(d.endswith(".lo") for d in busy) and any(d.endswith((".tx", ".rx")) for d in busy)


@pytest.mark.skipif(bool(MXNET_UNAVAILABLE), reason=MXNET_UNAVAILABLE)
def test_a_failing_mxnet_worker_stops_both_hosts_and_names_it(tmp_path):
    """A worker raises mid-job on one of two emulated hosts: its node stops its roles and tells the other, which
    stops its own (ps-lite cannot go on without a role); both exit non-zero naming the worker's error, and node 0
    still receives node 1's traces."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with EmulatedCluster(2, 0.9) as cluster:
        hosts = f"{cluster.hostname(0)}:1,{cluster.hostname(1)}:1"
        results = cluster.run(
            [sys.executable, "-m", "dprorun.cli", "--backend", "mxnet", "--hosts", hosts, "-q", "--warmup", "2",
             "--active", "5", "--clean", "3", "--run-dir", str(tmp_path / "node{node_rank}"), "python",
             os.path.join(REPO, "examples", "mxnet_gluon.py"), "--steps", "30", "--model", "mlp",
             "--fail-at-step", "10"], 300, env)
    assert [r.returncode for r in results] == [1, 1], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    for r in results:
        assert "RuntimeError: injected failure at step 10" in r.stderr, r.stderr[-2000:]
    assert "this node's roles were stopped" in "".join(r.stderr for r in results)
    assert len(list((tmp_path / "node0").glob("rank_*/events.json"))) == 2


@pytest.mark.skipif(bool(UNAVAILABLE), reason=UNAVAILABLE)
def test_an_emulated_cluster_takes_a_quota_per_host():
    """`host_cpus`: each host its own CPU quota (a machine per role: the workers' hosts larger than the servers',
    benchmarks/ps_bandwidth_whatif.py --per-node), written to each host's cgroup; quotas that oversubscribe the cores
    or do not match the hosts are refused before anything is made."""
    cores = os.cpu_count() or 1
    quotas = [cores / 2, cores / 4, cores / 4]
    with EmulatedCluster(3, 0.0, host_cpus=quotas) as cluster:
        assert [cluster.cpus(k) for k in range(3)] == quotas
        written = []
        for path in cluster._made_cgroups:
            if os.path.exists(os.path.join(path, "cpu.cfs_quota_us")):  # cgroup v1
                with open(os.path.join(path, "cpu.cfs_quota_us")) as handle:
                    written.append(int(handle.read()) / cluster.cpu_period_us)
            else:  # v2: "quota period"
                with open(os.path.join(path, "cpu.max")) as handle:
                    quota, period = handle.read().split()
                    written.append(int(quota) / int(period))
        assert written == pytest.approx(quotas, rel=0.01)
    with pytest.raises(ValueError, match="oversubscribe"):
        EmulatedCluster(2, 0.0, host_cpus=[cores, 0.5]).__enter__()
    with pytest.raises(ValueError, match="2 quotas for 3 hosts"):
        EmulatedCluster(3, 0.0, host_cpus=[0.5, 0.5]).__enter__()
