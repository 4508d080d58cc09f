"""dprorun on a real SLURM: a two-node cluster on this machine (scripts/slurm-cluster: munged, slurmctld and two
slurmd, nodes n1 and n2, both this host). `srun -N2 -n2 dprorun -np 1 ...` with no launch flags must take the node
count, node rank, master address and port and the run directory from SLURM, and node 0's run directory must end
with both ranks' traces; `sbatch examples/sbatch_ddp.sh` must do the same. Skipped, with the script's reason, where
the daemons cannot start (not root, no apt-get / slurm-wlm, ports taken); the daemons are stopped by pid after."""
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO
from test_scheduler_env import NODE_LISTS

SCRIPT = os.path.join(REPO, "scripts", "slurm-cluster")
EXAMPLE = os.path.join(REPO, "examples", "mlp_many_layers.py")
WINDOW = ["--warmup", "2", "--active", "4", "--clean", "2"]  # profiling flags only: 8 steps profile and time
STEPS = ["--steps", "12"]
JOB_TIMEOUT_S = 150

pytestmark = pytest.mark.slow  # every test here needs the cluster (a few seconds to start; apt-get the first time)


def _free_port_base() -> int:
    """A base port with it and the next two free (slurmctld, slurmd n1, slurmd n2)."""
    for base in range(17000, 17300, 10):
        try:
            for port in range(base, base + 3):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no three free ports in 17000-17300")


def _recorded_pids(state_dir: str) -> dict:
    try:
        with open(os.path.join(state_dir, "pids")) as handle:
            return {name: int(pid) for name, pid in (line.split() for line in handle if line.strip())}
    except OSError:
        return {}


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (a stopped daemon whose parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The running cluster: the environment for srun / sbatch (SLURM_CONF, this Python's dprorun on PATH)."""
    if os.geteuid() != 0:
        pytest.skip("the emulated SLURM nodes need root (slurmd runs as root; installing slurm-wlm needs apt-get)")
    state = str(tmp_path_factory.mktemp("slurm-state"))
    env = dict(os.environ, DPRO_SLURM_DIR=state, DPRO_SLURM_PORT=str(_free_port_base()),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for name in [n for n in env if n.startswith(("SLURM_", "PET_"))]:
        env.pop(name)  # a test run inside a SLURM job must not hand its own job to the cluster's jobs
    try:  # 600 s: the first start installs slurm-wlm and munge (apt-get)
        started = subprocess.run([SCRIPT, "start"], env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as exc:
        started = subprocess.CompletedProcess(exc.cmd, 124, "", f"{SCRIPT} start ran past {exc.timeout:g} s")
    if started.returncode != 0:
        pids = _recorded_pids(state)
        subprocess.run([SCRIPT, "stop"], env=env, capture_output=True, text=True, timeout=120)
        assert not [pid for pid in pids.values() if _running(pid)], "a daemon survived a failed start"
        lines = started.stderr.strip().splitlines()
        reason = " | ".join([line for line in lines if "fatal" in line][:1] + lines[-1:]) or \
            f"exit {started.returncode}"
        pytest.skip(f"the two-node SLURM cluster could not start: {reason}")
    pids = _recorded_pids(state)
    env["SLURM_CONF"] = os.path.join(state, "slurm.conf")
    try:
        yield env
    finally:
        stopped = subprocess.run([SCRIPT, "stop"], env=env, capture_output=True, text=True, timeout=120)
        survivors = {name: pid for name, pid in pids.items() if _running(pid)}
        assert stopped.returncode == 0 and not survivors, (stopped.stderr, survivors)


def _dprorun() -> list:
    console = os.path.join(os.path.dirname(sys.executable), "dprorun")
    return [console] if os.access(console, os.X_OK) else [sys.executable, "-m", "dprorun.cli"]


def _assert_both_ranks_in_node0_dir(cwd, output: str) -> str:
    """Both nodes named SLURM's job, node 0's run directory dpro_runs/slurm-<job> holds both ranks' traces."""
    lines = re.findall(r"dprorun: SLURM job (\d+) step 0: node (\d) of 2 \(n1,n2\), master n1 \(127\.0\.0\.1\):(\d+), "
                       r"job id (slurm-\d+)", output)
    assert sorted(node for _, node, _, _ in lines) == ["0", "1"], output[-4000:]
    job, _, port, job_id = lines[0]
    assert job_id == f"slurm-{job}" and int(port) == 20000 + (int(job) % 1000) * 10
    run_dir = cwd / "dpro_runs" / job_id
    for rank in (0, 1):
        assert (run_dir / f"rank_{rank}" / "events.json").is_file(), sorted(p.name for p in run_dir.iterdir())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["nnodes"] == 2 and manifest["node_rank"] == 0
    assert manifest["ranks_with_traces"] == [0, 1]
    assert f"dprorun: run directory {run_dir}" in output
    return job


def test_scontrol_and_python_expand_node_lists_alike(slurm):
    from dprorun.scheduler_env import expand_nodelist_python

    for nodelist, hosts in NODE_LISTS:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], env=slurm, capture_output=True, text=True,
                             timeout=30)
        assert out.stdout.split() == hosts == expand_nodelist_python(nodelist), (nodelist, out.stderr)


def test_srun_two_nodes_without_launch_flags(slurm, tmp_path):
    proc = subprocess.run(["srun", "-N2", "-n2", "--time=5"] + _dprorun() + ["-np", "1"] + WINDOW
                          + ["python", EXAMPLE] + STEPS,
                          cwd=tmp_path, env=slurm, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    _assert_both_ranks_in_node0_dir(tmp_path, output)


def _wait_for_job(job: str, env: dict, timeout_s: float) -> str:
    """Poll the job until it has left the running states (sbatch --wait polls at growing intervals, up to 32 s);
    returns its state line (JobState=..., ExitCode=...)."""
    deadline = time.monotonic() + timeout_s
    while True:
        shown = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True,
                               timeout=30).stdout
        state = re.search(r"JobState=(\S+)", shown)
        if state and state.group(1) not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return " ".join(re.findall(r"(?:JobState|ExitCode|Reason)=\S+", shown))
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
            raise AssertionError(f"job {job} still {state.group(1) if state else '?'} after {timeout_s:g} s")
        time.sleep(0.5)


def test_sbatch_example_on_two_nodes(slurm, tmp_path):
    env = dict(slurm, DPRO_WARMUP="2", DPRO_ACTIVE="4", DPRO_CLEAN="2")  # sbatch passes the environment on
    proc = subprocess.run(["sbatch", "--time=5", os.path.join(REPO, "examples", "sbatch_ddp.sh"), "python", EXAMPLE]
                          + STEPS, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    submitted = re.search(r"Submitted batch job (\d+)", proc.stdout)
    assert proc.returncode == 0 and submitted, proc.stdout + proc.stderr
    job = submitted.group(1)
    state = _wait_for_job(job, env, JOB_TIMEOUT_S)
    log = tmp_path / f"dprorun-ddp-{job}.out"  # the example's #SBATCH --output
    output = log.read_text() if log.exists() else ""
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, state + "\n" + output[-4000:]
    assert _assert_both_ranks_in_node0_dir(tmp_path, output) == job
