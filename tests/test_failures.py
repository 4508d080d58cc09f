"""Failure paths: a hanging rank under --timeout, a port already in use, a killed rank, profiler failures, a
disk that fills up, a node that never joins, the rendezvous bound to loopback."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from conftest import EXAMPLES, run_dprorun
from dprorun.procs import free_port
from dprorun.runtime.gloo_exit import GLOO_WORKER_THREAD, gloo_worker_states, wait_for_idle_gloo_workers

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
    assert proc.returncode == 137 and "rank 1 (local rank 1" in proc.stderr and "SIGKILL" in proc.stderr, \
        proc.stderr[-3000:]
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []
    assert (tmp_path / "run" / "rank_1" / "events.json").exists()  # written at the end of its window


ABORT_AT_EXIT = """
import os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
if int(os.environ["RANK"]) == 1:
    # what libstdc++ prints when a C++ thread still runs at exit (a process group kept alive), then the abort
    print("terminate called without an active exception" if "{says}" == "yes" else "bye", file=sys.stderr, flush=True)
    os.abort()
"""


@pytest.mark.parametrize("says", ["yes", "no"])
def test_a_rank_that_aborts_at_exit_is_named_and_the_cause_its_log_shows_is_said(tmp_path, says):
    """A rank killed by SIGABRT: exit code 134 and the rank named; where its log ends with libstdc++'s 'terminate
    called without an active exception' (torch 2.13's gloo group outliving the script, seen with FSDP2), the message
    says what that means and what to do; otherwise no guess."""
    script = tmp_path / "abort.py"
    script.write_text(ABORT_AT_EXIT.replace("{says}", says))
    proc, _ = run_dprorun(["-np", "2", "python", str(script)], tmp_path / "run", timeout=60)
    assert proc.returncode == 134 and "rank 1 (local rank 1" in proc.stderr and "SIGABRT" in proc.stderr, \
        proc.stderr[-3000:]
    hinted = "a C++ thread was still running as the process exited" in proc.stderr
    assert hinted == (says == "yes") and ("dist.destroy_process_group()" in proc.stderr) == (says == "yes")


def _fake_threads(task_dir, states):
    """A /proc/self/task of gloo worker threads in `states` beside one thread of another name."""
    for tid, (name, state) in enumerate([("python3", "R")] + [(GLOO_WORKER_THREAD, s) for s in states]):
        (task_dir / str(tid)).mkdir(parents=True)
        (task_dir / str(tid) / "comm").write_text(name + "\n")
        (task_dir / str(tid) / "stat").write_text(f"{tid} ({name}) {state} 1 1 1 0 -1\n")


def test_the_exit_waits_for_gloo_workers_until_they_sleep_and_no_longer(tmp_path, monkeypatch):
    """runtime/gloo_exit.py: a rank's exit waits while a gloo worker thread runs (it may not yet have dropped the
    work it ran: a late drop after finalization began aborted ranks), bounded; other threads do not count."""
    monkeypatch.setitem(sys.modules, "torch.distributed", sys.modules.get("torch.distributed", object()))
    asleep, running = tmp_path / "asleep", tmp_path / "running"
    _fake_threads(asleep, ["S", "S"])
    _fake_threads(running, ["S", "R"])
    assert sorted(gloo_worker_states(str(running))) == ["R", "S"]
    waited = wait_for_idle_gloo_workers(1.0, str(asleep))
    assert waited is not None and waited < 0.5
    started = time.monotonic()
    assert wait_for_idle_gloo_workers(0.2, str(running)) is None and 0.2 <= time.monotonic() - started < 1.0
    monkeypatch.setenv("DPRO_GLOO_EXIT_WAIT_S", "0")
    assert wait_for_idle_gloo_workers(task_dir=str(running)) == 0.0


def test_the_profilers_stop_waits_for_gloo_workers_first(monkeypatch):
    """A comm hook's callback and the work's teardown still running on a gloo worker thread when the window's
    profile stopped corrupted the rank's heap (SIGSEGV freeing the profile's results, "malloc(): invalid size"):
    benchmarks/abort_rate.py --launchers frozen-dprorun,frozen-no-stop-wait --malloc-check. The stop now waits,
    bounded, for the workers to sleep; DPRO_PROFILER_STOP_WAIT_S=0 turns the wait off."""
    import threading

    from dprorun.runtime import torch_profiler

    calls = []
    monkeypatch.setattr(torch_profiler, "wait_for_idle_gloo_workers", lambda timeout: calls.append(("wait", timeout)))

    class Profile:
        def stop(self):
            calls.append(("stop",))

    profiler = torch_profiler.TorchProfiler(session=None)
    profiler.profile, profiler.thread = Profile(), threading.current_thread()
    profiler.stop_profiler(write=False)
    assert calls == [("wait", torch_profiler.PROFILER_STOP_WAIT_S), ("stop",)] and profiler.profile is None
    monkeypatch.setenv("DPRO_PROFILER_STOP_WAIT_S", "0")
    assert torch_profiler.profiler_stop_wait_s() == 0.0


GLOO_THREADS_AT_EXIT = """
import torch, torch.distributed as dist
from dprorun.runtime.gloo_exit import gloo_worker_states, wait_for_idle_gloo_workers
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
dist.all_reduce(torch.ones(4))
print(len(gloo_worker_states()), wait_for_idle_gloo_workers(5.0) is not None)
dist.destroy_process_group()
"""


def test_a_real_gloo_groups_workers_are_found_and_seen_asleep_after_its_collective(tmp_path):
    """The thread name and /proc states the exit wait reads are torch's: a live gloo group's workers are found
    ("pt_gloo_runloop") and seen asleep once its all-reduce is done."""
    out = subprocess.run([sys.executable, "-c", GLOO_THREADS_AT_EXIT.replace("{port}", str(free_port()))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    workers, idle = out.stdout.split()
    assert int(workers) >= 1 and idle == "True", out.stdout


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


def _tmpfs(tmp_path, size: str):
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs (a full disk cannot be made otherwise)")
    return mount


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MB tmpfs (root only): a filesystem that fills up without touching the machine's disk."""
    import subprocess

    mount = _tmpfs(tmp_path, "24m")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.fixture
def full_disk(tmp_path):
    """A 600 KB tmpfs: full as soon as the ranks write their logs and traces."""
    import subprocess

    mount = _tmpfs(tmp_path, "600k")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_too_little_disk_runs_the_job_unprofiled(small_disk):
    run_dir = small_disk / "run"
    proc, _ = run_dprorun(["-np", "2", "--warmup", "2", "--active", "3", "python",
                           os.path.join(EXAMPLES, "mlp_many_layers.py"), "--steps", "8"], run_dir,
                          env={"DPRO_MIN_FREE_MB": "100"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "profiling and per-rank log files are off" in proc.stderr and "Traceback" not in proc.stderr
    assert "median iteration time" in proc.stdout  # the job ran to its end
    assert not os.path.exists(run_dir / "rank_0" / "events.json")


def test_a_trace_that_would_fill_the_disk_is_dropped_and_training_continues(small_disk):
    """Free space above the threshold at launch, below it once the profiler trace (about 1 MB) is written."""
    import shutil

    free_mb = shutil.disk_usage(small_disk).free / 1e6
    run_dir = small_disk / "run"
    proc, _ = run_dprorun(["-np", "2", "--warmup", "2", "--active", "3", "--kineto-iters", "2", "--clean", "1",
                           "python", os.path.join(EXAMPLES, "mlp_many_layers.py"), "--steps", "8"], run_dir,
                          env={"DPRO_MIN_FREE_MB": f"{free_mb - 0.5:.2f}", "DPRO_REPORT": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "median iteration time" in proc.stdout
    assert not os.path.exists(run_dir / "rank_0" / "kineto_trace.json")
    assert not [f for f in os.listdir(run_dir / "rank_0") if f.endswith(".tmp")]
    events = json.load(open(run_dir / "rank_0" / "events.json"))  # the hooks' own records are kept
    assert any("DPRO_MIN_FREE_MB" in w for w in events["warnings"])


def test_a_node_that_never_joins_is_a_clear_error_in_bounded_time(tmp_path):
    port = free_port(count=2)  # the master port and the nodes' link on the next
    proc, elapsed = run_dprorun(["--nnodes", "2", "--node-rank", "0", "--master-port", str(port), "--join-timeout",
                                 "5", "-np", "1", "python", os.path.join(EXAMPLES, "mlp_many_layers.py")],
                                tmp_path / "run", timeout=120)
    assert proc.returncode == 1 and elapsed < 40
    assert "not every node joined (2 expected)" in proc.stderr and "Traceback" not in proc.stderr


def two_nodes_on_one_run_directory(node: list, run_dir, env: dict, timeout: float, settle_s: float = 0.0,
                                   node0_env: dict = None, node1_code: int = 0):
    """Node 1's dprorun started first (in the background), node 0's once node 1's launcher has begun (its logs
    folder there, then `settle_s`): (node 0's CompletedProcess, node 1's stderr); node 1 stopped if it outlives,
    its exit code `node1_code`."""
    from conftest import REPO

    node1 = subprocess.Popen([sys.executable, "-m", "dprorun.cli", "--run-dir", str(run_dir), "--node-rank", "1",
                              *node], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (run_dir / "logs").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(settle_s)
        proc, _ = run_dprorun(["--node-rank", "0", *node], run_dir, timeout=timeout, env=node0_env)
        _, err1 = node1.communicate(timeout=60)
    finally:
        if node1.poll() is None:
            node1.terminate()
            node1.communicate(timeout=30)
    assert node1.returncode == node1_code, err1[-2000:]
    return proc, err1


def test_node_0_claims_a_run_directory_its_other_node_shares_after_that_node_started(tmp_path):
    """Nodes on a shared filesystem (a SLURM cluster's home or work directory) give one run directory. Node 1
    wrote its "running" manifest there as it started, and node 0, starting a moment later, took the directory for
    an earlier run's, refused it (exit 2) and left node 1 waiting for it (a clean-clone CI run's srun test timed
    out so). Node 0 owns the directory: the other nodes write no manifest."""
    port = free_port(count=2)  # the master port and the nodes' link on the next
    run_dir = tmp_path / "shared"
    node = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "--join-timeout", "60",
            "-np", "1", "-q", "--warmup", "2", "--active", "4", "--clean", "2", "python",
            os.path.join(EXAMPLES, "mlp_many_layers.py"), "--steps", "12"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", DPRO_REPORT="0")
    proc, err1 = two_nodes_on_one_run_directory(node, run_dir, env, timeout=150, settle_s=1.0)
    assert proc.returncode == 0, proc.stderr[-2000:] + err1[-2000:]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (manifest["node_rank"], manifest["status"], manifest["ranks_with_traces"]) == (0, "completed", [0, 1])


def test_single_node_rendezvous_listens_on_loopback_only(tmp_path):
    """The job's store (and so the gather channel's rendezvous) is not reachable from other hosts unless a
    multi-node job asks for it."""
    import subprocess
    import sys

    from conftest import REPO

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "dprorun.cli", "--run-dir", str(run_dir), "-np", "2", "--warmup", "30", "python",
           os.path.join(EXAMPLES, "mlp_many_layers.py"), "--steps", "400"]
    launcher = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        listening = []
        while time.monotonic() < deadline and not listening:
            time.sleep(0.5)
            family = psutil.Process(launcher.pid)
            pids = [family.pid] + [c.pid for c in family.children(recursive=True)]
            listening = [c for c in psutil.net_connections(kind="tcp")
                         if c.status == psutil.CONN_LISTEN and c.pid in pids]
        assert listening, "no listening socket found"
        addresses = {c.laddr.ip for c in listening}
        assert addresses <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, addresses
    finally:
        launcher.terminate()
        launcher.wait(timeout=60)


def test_a_missing_host_in_hosts_is_a_clear_error(tmp_path):
    proc, elapsed = run_dprorun(["--hosts", "node-that-does-not-exist-1:2,node-that-does-not-exist-2:2", "python",
                                 os.path.join(EXAMPLES, "mlp_many_layers.py")], tmp_path / "run", timeout=60)
    assert proc.returncode == 2 and elapsed < 30
    assert "is not in --hosts" in proc.stderr and "Traceback" not in proc.stderr


def test_a_completely_full_disk_loses_traces_not_the_training(full_disk):
    """The threshold bypassed, the run directory's disk fills up completely: trace writes fail inside the hooks
    (profiling disabled), the ranks' own output to their log files is dropped instead of raising, the launcher's
    writes only warn; the job ends with its own exit code."""
    proc, _ = run_dprorun(["-np", "2", "--warmup", "3", "--active", "4", "--kineto-iters", "2", "--clean", "2",
                           "python", os.path.join(EXAMPLES, "mlp_many_layers.py"), "--steps", "14"],
                          full_disk / "run", env={"DPRO_MIN_FREE_MB": "0.3"}, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the run directory is incomplete" in proc.stderr or "no trace" in proc.stderr


OS_EXIT_SCRIPT = """
import ctypes, os, sys, torch, torch.distributed as dist, torch.nn as nn
dist.init_process_group("gloo")
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(8):
    opt.zero_grad(); model(torch.randn(16, 64)).sum().backward(); opt.step()
if sys.argv[1] == "c":
    ctypes.CDLL(None)._exit(0)  # past every handler, as an exit from C code
os._exit(0)
"""


def test_a_script_ending_with_os_exit_inside_the_window_keeps_its_records(tmp_path):
    """os._exit skips Python's exit handlers: a script ending so inside the window lost every record and was told
    it built no supported wrapper. The hooks write the records first now; an exit from C code (nothing runs) is
    said as such, the files it left kept."""
    script = tmp_path / "ends.py"
    script.write_text(OS_EXIT_SCRIPT)
    window = ["--warmup", "2", "--active", "10", "-np", "2", "python", str(script)]
    proc, _ = run_dprorun([*window, "os"], tmp_path / "os", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "os" / "rank_1" / "events.json").exists() and "nothing was profiled" not in proc.stderr
    assert "the job ended at iteration 7 before the end of the profiling window" in proc.stdout
    proc, _ = run_dprorun([*window, "c"], tmp_path / "c", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "left profiler files but no records (events.json)" in proc.stderr and "no rank built" not in proc.stderr


THREAD_RAISES_SCRIPT = """
import threading, torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
def train():
    for step in range(40):
        if step == 3 and dist.get_rank() == 0:
            raise RuntimeError("bad batch at step 3")
        opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
worker = threading.Thread(target=train); worker.start(); worker.join()
dist.destroy_process_group()
"""


def test_a_teardown_while_a_rank_waits_in_a_collective_ends_in_bounded_time(tmp_path):
    """Rank 0's training thread raises inside the profiled iterations, its main thread tears the group down while
    rank 1 waits in the step's all-reduce (the teardown is what fails it). torchrun ends such a job in 6 s with exit
    0; dprorun ran its end-of-window collectives at rank 0's teardown first, waiting for rank 1 (over 5 minutes),
    and exporting the profile from the main thread ended both ranks in SIGSEGV (torch keeps a profile per thread).
    Now a rank tearing down waits DPRO_TEARDOWN_WAIT_S for the others in the store, then goes on alone, and a
    profile its thread left is stopped, not exported: exit 0 as torchrun, each rank's records kept, the reasons
    said."""
    script = tmp_path / "thread_raises.py"
    script.write_text(THREAD_RAISES_SCRIPT)
    proc, elapsed = run_dprorun(["--warmup", "2", "--active", "12", "-np", "2", "python", str(script)],
                                tmp_path / "run", timeout=150, env={"DPRO_TEARDOWN_WAIT_S": "3"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert elapsed < 60, elapsed
    assert "rank(s) [1] did not reach the process group's teardown within 3 s of rank 0" in proc.stderr
    assert "rank 0 stopped waiting for the others at the process group's teardown before rank 1 came" in proc.stderr
    for rank in (0, 1):
        events = json.loads((tmp_path / "run" / f"rank_{rank}" / "events.json").read_text())
        assert len(events["iteration_starts_us"]) >= 3
    assert "without tearing its process group down" not in proc.stdout
    assert "torch.profiler was started in the script's thread" in proc.stderr


FAULT_TOLERANT = """
import os
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
snapshot = os.environ["SNAPSHOT"]
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
start = 0
if os.path.exists(snapshot):  # the snapshot of torchrun's fault-tolerance tutorial: resume where it was taken
    state = torch.load(snapshot)
    model.load_state_dict(state["model"]), opt.load_state_dict(state["opt"])
    start = state["step"]
ddp = torch.nn.parallel.DistributedDataParallel(model)
for step in range(start, 30):
    opt.zero_grad()
    ddp(torch.randn(32, 64)).pow(2).mean().backward()
    opt.step()
    if rank == 0 and step % 10 == 9:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, snapshot + ".tmp")
        os.replace(snapshot + ".tmp", snapshot)
    if rank == 1 and step == int(os.environ.get("FAIL_AT", "12")) and attempt < 2:
        raise RuntimeError(f"injected fault at step {step} in attempt {attempt}")
dist.destroy_process_group()
"""


def test_a_job_torch_elastic_restarts_keeps_the_last_attempts_profile_and_names_each_failure(tmp_path):
    """torchrun's --max-restarts with a script that resumes from its snapshot: rank 1 fails in attempts 0 and 1,
    attempt 2 completes. Each attempt's files stay apart (the run's folders are the last attempt's, the others in
    failed_attempt_<n>/), each failure is named, and attempt 1 connects at all: torch's static rendezvous handed the
    new attempt the store of the one before, whose keys held the dead ranks' addresses (gloo's "connectFullMesh
    failed ... Connection refused" in attempt 1, under torchrun too; dprorun refused --max-restarts before)."""
    script = tmp_path / "fault_tolerant.py"
    script.write_text(FAULT_TOLERANT)
    run = tmp_path / "run"
    proc, _ = run_dprorun(["-np", "2", "--max-restarts", "3", "--warmup", "1", "--active", "2", "--kineto-iters", "1",
                           "--clean", "1", "python", str(script)], run, timeout=240,
                          env={"SNAPSHOT": str(tmp_path / "snapshot.pt"), "DPRO_REPORT": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["message"] == "all ranks finished (attempt 2, after 2 restarts)"
    assert len(manifest["relaunches"]) == 2, manifest["relaunches"]
    for attempt, why in enumerate(manifest["relaunches"]):
        assert f"after attempt {attempt} failed (--max-restarts 3): rank 1 (local rank 1): RuntimeError: injected " \
               f"fault at step 12 in attempt {attempt}" in why, why
        assert f"failed_attempt_{attempt}" in why and f"failed_attempt_{attempt}" in proc.stderr
    # attempt 0 ended its window (steps 0-4) before the fault: its files, complete, set aside with the manifest
    kept = run / "failed_attempt_0"
    assert (kept / "manifest.json").exists()
    assert all((kept / f"rank_{r}" / "events.json").exists() for r in (0, 1))
    assert sorted(os.listdir(run / "failed_attempt_1")) == ["manifest.json", "rank_0", "rank_1"]
    # the run's own folders: attempt 2's, profiled and summarized
    events = json.loads((run / "rank_1" / "events.json").read_text())
    assert not any("injected" in w for w in events.get("warnings", [])), events.get("warnings")
    assert (run / "summary.json").exists() and "dprorun summary" in proc.stdout
    assert "torch elastic restarted the ranks after attempt 1 failed" in (run / "report.html").read_text()


def test_restarts_across_two_nodes_sharing_a_run_directory(tmp_path):
    """Two nodes (one rank each) on a shared run directory, rank 1 failing in attempts 0 and 1 under --max-restarts:
    each attempt meets on a new store (node 0 says its port through the old one; torch's static rendezvous handed
    back the old store's keys, and the restarted ranks failed to connect), both nodes finish attempt 2, and the
    run holds attempt 2's two ranks, the earlier attempts set aside once each (a shared folder: two movers)."""
    script = tmp_path / "fault_tolerant.py"
    script.write_text(FAULT_TOLERANT)
    port = free_port(count=2)
    run_dir = tmp_path / "shared"
    node = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "--join-timeout", "60",
            "-np", "1", "-q", "--max-restarts", "3", "--warmup", "1", "--active", "2", "--kineto-iters", "1",
            "--clean", "1", "python", str(script)]
    # the fault in each attempt's last profiled step: node 0's rank waited in the end-of-window group for the gone
    # peer its 120 s (its agent knows of no failure on node 1), node 1's next attempt gave up joining after 60 s
    faults = {"SNAPSHOT": str(tmp_path / "snapshot.pt"), "FAIL_AT": "2"}
    env = dict(os.environ, PYTHONUNBUFFERED="1", DPRO_REPORT="0", **faults)
    proc, err1 = two_nodes_on_one_run_directory(node, run_dir, env, timeout=200, node0_env=faults)
    assert proc.returncode == 0, proc.stderr[-2000:] + err1[-2000:]
    assert "connectFullMesh" not in proc.stderr + err1
    assert "after attempt 1 failed (--max-restarts 3): rank 1 (local rank 0): RuntimeError: injected fault at step 2" \
        in err1
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["ranks_with_traces"] == [0, 1] and manifest["message"].endswith("(attempt 2, after 2 restarts)")
    for attempt in (0, 1):
        assert sorted(p.name for p in (run_dir / f"failed_attempt_{attempt}").glob("rank_*")) == ["rank_0", "rank_1"]


def test_a_rank_on_another_node_failing_in_the_windows_last_step_ends_the_job_at_once(tmp_path):
    """Two nodes, one rank each, rank 1 raising in the window's last step, no restarts: rank 0, on the other node
    (whose agent knows of no failure), waited in the end-of-window group's store for rank 1 its whole 120 s (node 0
    exited after 126 s). A barrier on the script's group finds rank 1 gone first, and rank 0 says so; torchrun's
    rank 0 fails in the script's next all-reduce (6 s)."""
    script = tmp_path / "fault_tolerant.py"
    script.write_text(FAULT_TOLERANT)
    run_dir = tmp_path / "shared"
    node = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port(count=2)), "--join-timeout",
            "60", "-np", "1", "-q", "--warmup", "1", "--active", "2", "--kineto-iters", "1", "--clean", "1", "python",
            str(script)]
    faults = {"SNAPSHOT": str(tmp_path / "snapshot.pt"), "FAIL_AT": "2"}
    env = dict(os.environ, PYTHONUNBUFFERED="1", DPRO_REPORT="0", **faults)
    started = time.monotonic()
    proc, err1 = two_nodes_on_one_run_directory(node, run_dir, env, timeout=150, node0_env=faults, node1_code=1)
    assert proc.returncode == 1 and time.monotonic() - started < 40, proc.stderr[-2000:]
    assert "error: rank 1 (local rank 0" in err1 and "injected fault at step 2" in err1, err1[-2000:]
    assert "a rank left before the end-of-window gather: " in proc.stderr, proc.stderr[-3000:]
    assert "its error says a peer failed first: a rank on another node, which that node's dprorun names" in \
        proc.stderr, proc.stderr[-3000:]
    events = json.loads((run_dir / "rank_0" / "events.json").read_text())
    assert any("a rank left before the end-of-window gather" in w for w in events["warnings"]), events["warnings"]


def test_a_rank_the_launcher_stops_is_not_said_to_have_had_nothing_to_profile(tmp_path):
    """Rank 1 raises at once; rank 0, still in Python (loading its data, TensorFlow's import), is stopped by the
    agent's SIGTERM. Its exit handler then warned "nothing to profile: the job never built a wrapper the hooks
    support (...)", a paragraph of advice about a job that had only been stopped. A stopped rank says nothing of
    the kind; the failure is named."""
    script = tmp_path / "stopped.py"
    script.write_text("import os, time\nif os.environ['RANK'] == '1':\n"
                      "    raise FileNotFoundError('shard_1.bin is missing on this rank')\ntime.sleep(60)\n")
    proc, elapsed = run_dprorun(["-np", "2", "python", str(script)], tmp_path / "run", timeout=120)
    assert proc.returncode == 1 and elapsed < 30, proc.stderr[-2000:]
    assert "error: rank 1 (local rank 1" in proc.stderr and "shard_1.bin is missing" in proc.stderr
    assert "nothing to profile" not in proc.stderr, proc.stderr[-3000:]


def test_a_job_failing_before_its_first_step_is_not_analysed(tmp_path):
    """Both ranks build their DDP model, then raise before the first step (the data loader's file missing): their
    records were read, aligned and replayed at the job's end, and the command printed an empty summary table and "no
    replay of the job as it ran: ... no profiled iteration" under the error. Now it says there is nothing to analyse;
    the files stay."""
    script = tmp_path / "no_step.py"
    script.write_text("import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
                      "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))\n"
                      "raise FileNotFoundError('train.bin is missing')\n")
    run = tmp_path / "run"
    proc, _ = run_dprorun(["-np", "2", "python", str(script)], run, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "FileNotFoundError: train.bin is missing" in proc.stderr
    assert "dprorun: no rank recorded a training step before the failure: nothing to analyse" in proc.stderr
    assert "reading the traces" not in proc.stderr and "no replay" not in proc.stderr + proc.stdout, proc.stderr
    assert (run / "rank_0" / "events.json").exists() and (run / "manifest.json").exists()


def test_a_rank_failing_before_init_process_group_is_the_cause_and_the_peer_leaves_at_once(tmp_path):
    """Rank 1 raises before init_process_group while rank 0 waits for it in the store (C++, where the hooks' SIGTERM
    handler cannot run): torch elastic's agent SIGKILLed rank 0 30 s after its SIGTERM, and that SIGKILL was named
    as the job's cause (exit 137, 33 s). torchrun names rank 1's error, exit 1, in 3.5 s: so does dprorun now (rank
    0 leaves a second after the SIGTERM; the SIGKILL of a rank the agent stopped is no cause: test_units.py)."""
    script = tmp_path / "early.py"
    script.write_text("import os\nimport torch.distributed as dist\nif os.environ['RANK'] == '1':\n"
                      "    raise FileNotFoundError('shard_1.bin is missing on this rank')\n"
                      "dist.init_process_group('gloo')\n")
    proc, elapsed = run_dprorun(["-np", "2", "python", str(script)], tmp_path / "run", timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "error: rank 1 (local rank 1" in proc.stderr and "FileNotFoundError: shard_1.bin is missing" in proc.stderr
    assert "Unable to shutdown process" not in proc.stderr and elapsed < 20, (elapsed, proc.stderr[-3000:])


def test_a_rank_failing_in_the_windows_last_step_leaves_its_peer_waiting_in_the_gather_for_a_second_only(tmp_path):
    """Rank 1 raises after the window's last step; rank 0 goes on to the end-of-window gather and waited in C++ for
    rank 1 to make the gather's group. The agent SIGKILLed rank 0 30 s after its SIGTERM, named that SIGKILL as the
    cause (exit 137, 35 s) and rank 0's clean iterations were never written. Now a barrier on the script's group
    finds rank 1 gone before the group is made (or, where the agent's SIGTERM comes first, the hooks' watcher thread
    keeps rank 0's records a second after it and ends it): 6 s."""
    script = tmp_path / "fault_tolerant.py"
    script.write_text(FAULT_TOLERANT)
    run = tmp_path / "run"
    proc, elapsed = run_dprorun(["-np", "2", "--warmup", "1", "--active", "2", "--kineto-iters", "1", "--clean", "1",
                                 "python", str(script)], run, timeout=120,
                                env={"SNAPSHOT": str(tmp_path / "snapshot.pt"), "FAIL_AT": "2"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "error: rank 1 (local rank 1" in proc.stderr and "injected fault at step 2" in proc.stderr
    assert "Unable to shutdown process" not in proc.stderr and elapsed < 20, (elapsed, proc.stderr[-3000:])
    events = json.loads((run / "rank_0" / "events.json").read_text())
    assert "stopped by SIGTERM" in events["warnings"] or any(
        "a rank left before the end-of-window gather: " in w for w in events["warnings"]), events["warnings"]
    assert (run / "rank_0" / "clean.json").exists()


ENGINE_COUNTING_SIGNALS = """
import os, signal, subprocess, sys, time
log = sys.argv[1]
def note(signum, frame):
    with open(log, "a") as f:
        f.write(signal.Signals(signum).name + "\\n")
signal.signal(signal.SIGTERM, note)
signal.signal(signal.SIGINT, note)
if not log.endswith(".worker"):  # a worker in the engine's own group, as bpslaunch starts them
    worker = subprocess.Popen([sys.executable, sys.argv[0], log + ".worker"])
    while not os.path.exists(log + ".worker.ready"):
        time.sleep(0.05)
open(log + ".ready", "w").close()
deadline = time.time() + 20
while time.time() < deadline and not (os.path.exists(log) and time.time() > os.path.getmtime(log) + 1):
    time.sleep(0.05)
"""

DPRORUN_RUNNING_AN_ENGINE = """
import os, sys
from dprorun.procs import call_forwarding_signals
code, signum, _ = call_forwarding_signals([sys.executable, sys.argv[1], sys.argv[2]], dict(os.environ))
print(code, signum)
"""


def _engine_under_dprorun(tmp_path, ignoring: tuple = ()):
    """dprorun's engine CLI launch (procs.call_forwarding_signals) of an engine that logs each signal it gets and
    ends 1 s after the last, its worker in its group likewise; dprorun in a session of its own as a terminal's or a
    batch job's, started ignoring the signals `ignoring` (as under nohup); returned once they run."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "engine.py").write_text(ENGINE_COUNTING_SIGNALS)
    log = tmp_path / "signals.log"
    proc = subprocess.Popen([sys.executable, "-c", DPRORUN_RUNNING_AN_ENGINE, str(tmp_path / "engine.py"), str(log)],
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: [signal.signal(s, signal.SIG_IGN) for s in ignoring])
    deadline = time.monotonic() + 30
    while not (tmp_path / "signals.log.ready").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc, log


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_dprorun_s_group_reaches_an_engine_once(tmp_path, signum):
    """`kill -TERM -PGID` (a container or batch stop) or a terminal's Ctrl-C, under --backend horovod: the group's
    signal and dprorun's forwarded one both reached horovodrun, whose handler then deadlocked inside itself (1 in 5
    launches; its ranks trained on 15 s until dprorun stopped the tree). The engine runs in a group of its own: one
    signal, dprorun's, sent to the engine's group (bpslaunch leaves its workers in it: they get it as from a
    terminal). Killed alone, even by SIGKILL, dprorun still stops the engine (its death signal)."""
    proc, log = _engine_under_dprorun(tmp_path)
    os.killpg(proc.pid, signum)
    out, err = proc.communicate(timeout=30)
    assert log.read_text().split() == [signum.name], (out, err)
    deadline = time.monotonic() + 5
    while not (tmp_path / "signals.log.worker").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "signals.log.worker").read_text().split() == [signum.name]
    proc, log = _engine_under_dprorun(tmp_path / "kill")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while not log.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log.read_text().split() == ["SIGTERM"]


def test_ctrl_z_stops_an_engine_with_dprorun_and_fg_resumes_it(tmp_path):
    """With the engine in a group of its own, a terminal's Ctrl-Z (SIGTSTP to dprorun's group) stopped dprorun alone,
    the engine writing on under the shell's prompt; SIGTSTP and SIGCONT are passed on as they come."""
    proc, log = _engine_under_dprorun(tmp_path)
    engine = psutil.Process(proc.pid).children()[0]
    worker = engine.children()[0]
    os.killpg(proc.pid, signal.SIGTSTP)

    def states() -> list[str]:
        return [p.status() for p in (psutil.Process(proc.pid), engine, worker)]

    deadline = time.monotonic() + 10
    while states() != [psutil.STATUS_STOPPED] * 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert states() == [psutil.STATUS_STOPPED] * 3
    os.killpg(proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while psutil.STATUS_STOPPED in states() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert psutil.STATUS_STOPPED not in states()
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert log.read_text().split() == ["SIGTERM"], (out, err)


def test_under_nohup_a_hang_up_leaves_an_engine_running(tmp_path):
    """`nohup dprorun --backend horovod ...`: nohup starts dprorun ignoring SIGHUP, and `nohup horovodrun` outlives a
    hang-up, but dprorun put its own handler in place and forwarded the hang-up as SIGTERM (the job gone 4 s after
    it). A signal dprorun was started ignoring stays ignored, as the engine inherits it."""
    proc, log = _engine_under_dprorun(tmp_path, ignoring=(signal.SIGHUP,))
    os.kill(proc.pid, signal.SIGHUP)
    time.sleep(1.5)
    assert proc.poll() is None and not log.exists()
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert log.read_text().split() == ["SIGTERM"], (out, err)


def test_a_terminal_that_hangs_up_stops_the_job_and_its_profile_is_still_analysed(tmp_path):
    """An ssh session lost: the terminal hangs up, dprorun and its ranks get SIGHUP (torch elastic stops the ranks),
    and every later write to the terminal fails with EIO: the first print ended dprorun with exit 1 and no
    summary.json. Now the analysis runs to its end into nothing, exit 129 (128 + SIGHUP) as for a signal."""
    import pty
    import select

    run_dir = tmp_path / "run"
    pid, terminal = pty.fork()
    if pid == 0:  # the child: dprorun on the terminal, its session's leader
        try:
            os.chdir(os.path.dirname(EXAMPLES))
            os.execv(sys.executable, [sys.executable, "-m", "dprorun.cli", "--run-dir", str(run_dir), "-np", "2",
                                      "--warmup", "2", "--active", "4", "python",
                                      os.path.join(EXAMPLES, "mlp_many_layers.py"), "--steps", "100000"])
        finally:
            os._exit(127)  # never back into the test runner
    seen, deadline = b"", time.monotonic() + 90
    try:
        while b"window done" not in seen and time.monotonic() < deadline:
            if select.select([terminal], [], [], 1.0)[0]:
                seen += os.read(terminal, 65536)
        time.sleep(1.0)  # past the window: clean iterations run
    finally:
        os.close(terminal)  # the terminal goes away: the kernel sends SIGHUP to its session's foreground
    _, status = os.waitpid(pid, 0)
    assert b"window done" in seen, seen[-2000:]
    assert os.waitstatus_to_exitcode(status) == 129
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "SIGHUP" in manifest["message"]
    assert json.loads((run_dir / "summary.json").read_text())["ranks_recorded"] == [0, 1]


def test_a_segfault_under_torch_distributed_debug_detail_names_the_setting(tmp_path):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL: torch 2.13's DistributedDataParallel on gloo segfaults at its construction
    (plain torchrun too); the job ended on "killed by signal SIGSEGV" alone. The setting is named now."""
    script = tmp_path / "train.py"
    script.write_text("import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
                      "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))\n"
                      "model(torch.randn(2, 8)).sum().backward()\ndist.destroy_process_group()\n")
    proc, _ = run_dprorun(["-np", "2", "python", str(script)], tmp_path / "run", timeout=120,
                          env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    if proc.returncode == 0:
        pytest.skip("this torch builds DistributedDataParallel under TORCH_DISTRIBUTED_DEBUG=DETAIL")
    assert proc.returncode == 139 and "TORCH_DISTRIBUTED_DEBUG=DETAIL is set" in proc.stderr, proc.stderr[-2000:]
