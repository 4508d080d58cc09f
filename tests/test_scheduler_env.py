"""Scheduler detection (dprorun/scheduler_env.py): SLURM node lists and job steps, Kubernetes PyTorchJob pods, and
the CLI taking the launch flags it was not given from them. The environments are set by hand; tests/test_slurm.py
runs the real thing on a two-node SLURM."""
import os
import shutil
import stat
import subprocess

import pytest

from dprorun import cli
from dprorun import scheduler_env
from dprorun.scheduler_env import (detect_scheduler, expand_nodelist, expand_nodelist_python, horovod_plan,
                                   node_address, slurm_port)

NODE_LISTS = [
    ("n[1-3,5],m7", ["n1", "n2", "n3", "n5", "m7"]),
    ("n[01-03]", ["n01", "n02", "n03"]),
    ("z[098-101]", ["z098", "z099", "z100", "z101"]),
    ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
    ("x,y[9-11]", ["x", "y9", "y10", "y11"]),
    ("n[1-2],n1", ["n1", "n2", "n1"]),
    (" n1 , n2 ", ["n1", "n2"]),
    ("n[7]", ["n7"]),
    ("gpu-node[1-2]", ["gpu-node1", "gpu-node2"]),
]


@pytest.mark.parametrize("nodelist,hosts", NODE_LISTS)
def test_python_expands_slurm_node_lists(nodelist, hosts):
    assert expand_nodelist_python(nodelist) == hosts


@pytest.mark.parametrize("nodelist,problem", [("c[5-3]", "invalid range"), ("n[a-b]", "invalid range"),
                                              ("n[1-2", "without"), ("n1]", "without"), ("", "no host"),
                                              ("n[]", "invalid range")])
def test_python_rejects_bad_node_lists_by_name(nodelist, problem):
    with pytest.raises(ValueError, match=problem):
        expand_nodelist_python(nodelist)


def _fake_scontrol(tmp_path, body: str) -> str:
    path = tmp_path / "scontrol"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_scontrol_expands_when_it_works_and_python_otherwise(tmp_path, monkeypatch):
    answering = _fake_scontrol(tmp_path, 'echo "$@" > "$0.args"; printf "h1\\nh2\\n"')
    assert expand_nodelist("h[1-2]", answering) == ["h1", "h2"]
    assert (tmp_path / "scontrol.args").read_text().split() == ["show", "hostnames", "h[1-2]"]
    failing = _fake_scontrol(tmp_path, 'echo "scontrol: fatal: Could not establish a configuration source" >&2; exit 1')
    assert expand_nodelist("n[1-2]", failing) == ["n1", "n2"]
    assert expand_nodelist("n[1-2]", str(tmp_path / "missing")) == ["n1", "n2"]
    monkeypatch.setattr(scheduler_env, "SCONTROL_TIMEOUT_S", 0.5)  # scontrol retries a minute on a bad slurm.conf
    hanging = _fake_scontrol(tmp_path, "sleep 30")
    assert expand_nodelist("n[1-2]", hanging) == ["n1", "n2"]


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol (slurm-client) is not installed")
def test_python_expansion_matches_scontrol():
    """Where this machine's scontrol can expand lists (it needs a readable slurm.conf), both agree."""
    probe = subprocess.run(["scontrol", "show", "hostnames", "n[1-2]"], capture_output=True, text=True, timeout=10)
    if probe.returncode != 0 or probe.stdout.split() != ["n1", "n2"]:
        reason = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"scontrol cannot expand node lists here (no slurm.conf?): {reason}")
    for nodelist, hosts in NODE_LISTS:
        assert expand_nodelist(nodelist) == hosts == expand_nodelist_python(nodelist)


def test_master_address_is_the_node_name_or_its_slurm_node_addr(tmp_path):
    scontrol = _fake_scontrol(tmp_path, 'echo "NodeName=n1 Arch=x86_64 NodeAddr=10.1.2.3 NodeHostName=vm Port=17001"')
    assert node_address("n1", scontrol, resolvable=lambda host: True) == "n1"
    assert node_address("n1", scontrol, resolvable=lambda host: False) == "10.1.2.3"
    assert node_address("n1", None, resolvable=lambda host: False) == "n1"


def slurm_step(node_id: int, **extra: str) -> dict:
    """What srun -N2 -n2 sets in each task (measured on slurm 22.05), job 4321, step 0."""
    env = {"SLURM_JOB_ID": "4321", "SLURM_JOBID": "4321", "SLURM_NNODES": "2", "SLURM_NODEID": str(node_id),
           "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_NODELIST": "node[07-08]", "SLURM_STEP_ID": "0",
           "SLURM_STEPID": "0", "SLURM_STEP_NODELIST": "node[07-08]", "SLURM_STEP_NUM_NODES": "2",
           "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_PROCID": str(node_id), "SLURM_LOCALID": "0"}
    env.update(extra)
    return env


def test_slurm_step_gives_nodes_rank_master_port_and_a_shared_job_id():
    for node_id in (0, 1):
        env = detect_scheduler(slurm_step(node_id), scontrol=None)
        assert (env.scheduler, env.nnodes, env.node_rank) == ("slurm", 2, node_id)
        assert env.master_addr == "node07" and env.master_port == slurm_port(4321, 0) == 23210
        assert env.job_id == "slurm-4321" and env.hosts == ["node07", "node08"] and env.in_step
        assert env.description.startswith(f"SLURM job 4321 step 0: node {node_id} of 2 (node07,node08)")
    later = detect_scheduler(slurm_step(1, SLURM_STEP_ID="3", SLURM_STEPID="3"), scontrol=None)
    assert later.job_id == "slurm-4321.3" and later.master_port == 23213  # a later step: its own directory and port


def test_slurm_step_on_part_of_the_allocation_uses_the_steps_nodes():
    env = detect_scheduler(slurm_step(0, SLURM_JOB_NODELIST="node[07-10]", SLURM_NNODES="2"), scontrol=None)
    assert env.nnodes == 2 and env.master_addr == "node07" and env.hosts == ["node07", "node08", "node09", "node10"]
    single = detect_scheduler(slurm_step(0, SLURM_STEP_NODELIST="node09", SLURM_STEP_NUM_NODES="1",
                                         SLURM_STEP_NUM_TASKS="1", SLURM_NNODES="1"), scontrol=None)
    assert (single.nnodes, single.master_addr, single.master_port) == (1, "127.0.0.1", None)


def test_slurm_batch_script_runs_on_its_node_alone():
    env = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n[1-2]"}
    found = detect_scheduler(env, scontrol=None)
    assert (found.nnodes, found.node_rank, found.master_addr, found.master_port) == (1, 0, "127.0.0.1", None)
    assert found.job_id == "slurm-77" and not found.in_step and found.hosts == ["n1", "n2"]
    assert "srun dprorun" in found.description  # says how to use both nodes
    interactive = detect_scheduler(dict(env, SLURM_STEP_ID="interactive"), scontrol=None)
    assert interactive.nnodes == 1 and not interactive.in_step


def test_slurm_refuses_several_tasks_per_node():
    with pytest.raises(ValueError, match="one task per node"):
        detect_scheduler(slurm_step(0, SLURM_STEP_NUM_TASKS="4", SLURM_NTASKS="4"), scontrol=None)


@pytest.mark.parametrize("missing", ["SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST"])
def test_incomplete_slurm_environment_is_not_slurm(missing):
    env = slurm_step(0)
    env.pop(missing)
    env.pop("SLURM_JOBID" if missing == "SLURM_JOB_ID" else missing, None)
    assert detect_scheduler(env, scontrol=None) is None


def test_no_scheduler():
    assert detect_scheduler({}, scontrol=None) is None
    assert detect_scheduler({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}, scontrol=None) is None
    # torchrun's variables in a rank's own environment are not a PyTorchJob pod
    rank = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "MASTER_ADDR": "a", "WORLD_SIZE": "4", "RANK": "1",
            "LOCAL_RANK": "1"}
    assert detect_scheduler(rank, scontrol=None) is None


# The training operator (kubeflow/training-operator, pkg/controller.v1/pytorch): MASTER_ADDR (<job>-master-0),
# MASTER_PORT, WORLD_SIZE (pods; pods x nprocPerNode since 1.7), RANK (pod index: master 0, worker i -> i + 1), and
# since 1.7 PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE. Kubeflow Trainer (TrainJob): PET_NNODES,
# PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT.
POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "PYTHONUNBUFFERED": "0"}


def test_pytorchjob_pod_of_the_classic_operator():
    env = dict(POD, MASTER_ADDR="train-master-0", MASTER_PORT="23456", WORLD_SIZE="3", RANK="2")
    found = detect_scheduler(env, scontrol=None)
    assert (found.scheduler, found.nnodes, found.node_rank) == ("pytorchjob", 3, 2)
    assert (found.master_addr, found.master_port, found.job_id) == ("train-master-0", 23456, None)
    assert found.description == ("Kubernetes PyTorchJob: node 2 of 3, master train-master-0:23456 "
                                 "(from WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT)")


def test_pytorchjob_pod_with_nproc_per_node_counts_nodes_by_pet_nnodes():
    env = dict(POD, MASTER_ADDR="train-master-0", MASTER_PORT="23456", WORLD_SIZE="16", RANK="1",
               PET_NNODES="2", PET_NODE_RANK="1", PET_NPROC_PER_NODE="8")
    found = detect_scheduler(env, scontrol=None)
    assert (found.nnodes, found.node_rank, found.master_addr, found.master_port) == (2, 1, "train-master-0", 23456)


def test_trainjob_pod_uses_torchruns_pet_variables():
    env = dict(POD, PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK="0",
               PET_MASTER_ADDR="t-node-0-0.t", PET_MASTER_PORT="29400")
    found = detect_scheduler(env, scontrol=None)
    assert (found.nnodes, found.node_rank, found.master_addr, found.master_port) == (2, 0, "t-node-0-0.t", 29400)
    assert "PET_MASTER_ADDR" in found.description


def test_pytorchjob_single_pod_and_bad_values():
    one = detect_scheduler(dict(POD, MASTER_ADDR="j-master-0", MASTER_PORT="23456", WORLD_SIZE="1", RANK="0"),
                           scontrol=None)
    assert (one.nnodes, one.master_addr, one.master_port) == (1, "127.0.0.1", None)
    assert detect_scheduler(dict(PET_NNODES="2:2", PET_NODE_RANK="1", MASTER_ADDR="m"), scontrol=None).nnodes == 2
    with pytest.raises(ValueError, match="elastic"):
        detect_scheduler(dict(PET_NNODES="1:4", PET_NODE_RANK="0", MASTER_ADDR="m"), scontrol=None)
    with pytest.raises(ValueError, match="outside"):
        detect_scheduler(dict(PET_NNODES="2", PET_NODE_RANK="2", MASTER_ADDR="m"), scontrol=None)
    with pytest.raises(ValueError, match="no master address"):
        detect_scheduler(dict(PET_NNODES="2", PET_NODE_RANK="1"), scontrol=None)


def test_horovod_gets_the_jobs_nodes_from_a_batch_script_and_is_refused_in_a_multi_node_step():
    batch = detect_scheduler({"SLURM_JOB_ID": "9", "SLURM_NNODES": "3", "SLURM_NODEID": "0",
                              "SLURM_JOB_NODELIST": "g[1-3]"}, scontrol=None)
    hosts, line = horovod_plan(batch)
    assert hosts == ["g1", "g2", "g3"] and "horovodrun on the job's nodes g1,g2,g3" in line
    with pytest.raises(ValueError, match="run dprorun once"):
        horovod_plan(detect_scheduler(slurm_step(0), scontrol=None))


# ---- the CLI: what it takes from the scheduler, and explicit flags winning ----------------------------------

SCHEDULER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "KUBERNETES_SERVICE_HOST",
                       "DPRO_JOB_ID", "DPRO_RUN_DIR")


@pytest.fixture
def scheduler_env_vars(monkeypatch):
    """A clean environment for the CLI (no SLURM_*, PET_*, MASTER_*), with scontrol left out of detection;
    returns a function that sets variables."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "PET_")) or name in SCHEDULER_VARIABLES:
            monkeypatch.delenv(name)
    monkeypatch.setattr(cli, "detect_scheduler", lambda environ: detect_scheduler(environ, scontrol=None))

    def set_vars(env: dict) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    return set_vars


def job_for(*argv: str):
    return cli.job_from_args(cli.build_parser().parse_args(list(argv) + ["python", "train.py"]))


def test_cli_takes_the_launch_from_a_slurm_step(scheduler_env_vars, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scheduler_env_vars(slurm_step(1))
    job = job_for("-np", "4")
    assert (job.launch.nnodes, job.launch.node_rank, job.launch.master_addr,
            job.launch.master_port) == (2, 1, "node07", 23210)
    assert job.launch.world_size == 8 and job.profile.job_id == "slurm-4321"
    assert job.output.run_dir == str(tmp_path / "dpro_runs" / "slurm-4321")  # the same name on every node
    assert "dprorun: SLURM job 4321 step 0: node 1 of 2" in capsys.readouterr().err


def test_cli_explicit_flags_win_over_the_scheduler(scheduler_env_vars, capsys, tmp_path):
    scheduler_env_vars(slurm_step(1))
    job = job_for("--master-addr", "127.0.0.1", "--master-port", "29610", "--run-dir", str(tmp_path / "r"),
                  "--job-id", "mine")
    assert (job.launch.nnodes, job.launch.node_rank, job.launch.master_addr,
            job.launch.master_port) == (2, 1, "127.0.0.1", 29610)
    assert job.output.run_dir == str(tmp_path / "r") and job.profile.job_id == "mine"
    assert "(--master-addr, --master-port given: the flags win)" in capsys.readouterr().err
    job = job_for("--nnodes", "3", "--node-rank", "2")
    assert (job.launch.nnodes, job.launch.node_rank, job.launch.master_addr) == (3, 2, "node07")
    with pytest.raises(ValueError, match="node rank 1 is outside 0..0"):
        job_for("--nnodes", "1")  # SLURM's node rank 1 does not fit one node: say so instead of hanging


def test_cli_hosts_turns_detection_off(scheduler_env_vars, capsys):
    scheduler_env_vars(slurm_step(1))
    job = job_for("--hosts", "localhost:2")
    assert (job.launch.nnodes, job.launch.node_rank, job.launch.master_addr,
            job.launch.nproc_per_node) == (1, 0, "localhost", 2)
    assert "SLURM" not in capsys.readouterr().err


def test_cli_defaults_outside_a_scheduler(scheduler_env_vars, capsys):
    job = job_for()
    assert (job.launch.nnodes, job.launch.node_rank, job.launch.master_addr,
            job.launch.master_port) == (1, 0, "127.0.0.1", None)
    assert not job.profile.job_id.startswith(("slurm", "job-")) and capsys.readouterr().err == ""


def test_cli_takes_the_launch_from_a_pytorchjob_pod(scheduler_env_vars, capsys):
    scheduler_env_vars(dict(POD, MASTER_ADDR="train-master-0", MASTER_PORT="23456", WORLD_SIZE="2", RANK="1"))
    job = job_for("-np", "2")
    assert (job.launch.nnodes, job.launch.node_rank, job.launch.master_addr,
            job.launch.master_port) == (2, 1, "train-master-0", 23456)
    assert job.profile.job_id == "job-train-master-0-23456"  # every pod names the job alike
    assert "Kubernetes PyTorchJob: node 1 of 2" in capsys.readouterr().err
    job = job_for("--node-rank", "0")
    assert job.launch.node_rank == 0


def test_cli_horovod_under_slurm_uses_the_jobs_nodes_as_hosts(scheduler_env_vars, capsys):
    scheduler_env_vars({"SLURM_JOB_ID": "9", "SLURM_NNODES": "2", "SLURM_NODEID": "0",
                        "SLURM_JOB_NODELIST": "g[1-2]"})
    job = job_for("--backend", "horovod", "-np", "4")
    assert job.launch.hosts == ["g1", "g2"]
    assert (job.launch.nnodes, job.launch.node_rank, job.launch.nproc_per_node) == (2, 0, 4)
    assert job.launch.master_addr == "g1" and job.profile.job_id == "slurm-9"
    assert "horovodrun on the job's nodes g1,g2" in capsys.readouterr().err
    scheduler_env_vars(slurm_step(0))
    with pytest.raises(ValueError, match="run dprorun once"):
        job_for("--backend", "horovod")


def test_a_torchrun_launch_line_parses_as_it_is(monkeypatch):
    """torchrun's spellings: --nproc_per_node=N with underscores (--node_rank, --master_addr, --master_port too),
    --standalone, -m for a module, the rendezvous flags (--rdzv_endpoint/_backend/_id) and --max_restarts; each was
    "unrecognized arguments" before."""
    import sys

    from dprorun.cli import build_parser, job_from_args

    for name in ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_NODEID", "SLURM_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    parser = build_parser()
    job = job_from_args(parser.parse_args(["--standalone", "--nproc_per_node=4", "-m", "pkg.train", "--lr", "1"]))
    assert job.launch.nproc_per_node == 4 and job.launch.nnodes == 1
    assert job.command == [sys.executable, "-m", "pkg.train", "--lr", "1"]
    args = parser.parse_args(["--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1", "--master_port=29500",
                              "--nproc_per_node", "2", "python", "-m", "pkg.train"])
    assert (args.node_rank, args.master_addr, args.master_port, args.module) == (1, "10.0.0.1", 29500, False)
    assert args.command == ["python", "-m", "pkg.train"]
    with pytest.raises(ValueError, match="--standalone runs one node"):
        job_from_args(parser.parse_args(["--standalone", "--nnodes", "2", "train.py"]))
    # torchrun's elastic rendezvous flags: the endpoint as the master, the id as the job id
    job = job_from_args(parser.parse_args(["--nnodes=1", "--nproc_per_node=2", "--rdzv_id=job7", "--rdzv_backend=c10d",
                                           "--rdzv_endpoint=localhost:29400", "--max_restarts=0", "train.py"]))
    assert (job.launch.master_addr, job.launch.master_port, job.profile.job_id) == ("localhost", 29400, "job7")
    job = job_from_args(parser.parse_args(["--nnodes=2", "--node_rank=1", "--rdzv-endpoint=h0:29400", "train.py"]))
    assert (job.launch.master_addr, job.launch.node_rank) == ("h0", 1)
    with pytest.raises(ValueError, match="give each node its --node-rank"):  # never two nodes 0
        job_from_args(parser.parse_args(["--nnodes=2", "--rdzv_endpoint=h0:29400", "train.py"]))
    # torch elastic's restarts handed on (DDP jobs; tests/test_failures.py runs one), refused where no agent launches
    assert job_from_args(parser.parse_args(["--max_restarts=3", "train.py"])).launch.agent.max_restarts == 3
    with pytest.raises(ValueError, match="--max-restarts set torch elastic's agent, which --backend horovod"):
        job_from_args(parser.parse_args(["--max-restarts=3", "--backend", "horovod", "train.py"]))
    assert job_from_args(parser.parse_args(["--nproc_per_node=cpu", "train.py"])).launch.nproc_per_node == \
        os.cpu_count()
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):  # torchrun's "gpu" on a machine without one: its own error, named
            parser.parse_args(["--nproc-per-node", "gpu", "train.py"])
    args = parser.parse_args(["--backend", "horovod", "-np", "2", "-H", "localhost:2", "python", "t.py", "-H", "x"])
    assert args.hosts == "localhost:2" and args.command == ["python", "t.py", "-H", "x"]  # horovodrun's -H
