"""Unit tests: configuration, atomic files, the bundle format, interval arithmetic, the bootstrap chain."""
import gzip
import json
import os
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from conftest import REPO, ScriptProfilerSession
from dprorun.config import ProfileConfig
from dprorun.fsutil import TraceError, atomic_write_json, read_json
from dprorun.runtime.packing import BundleError, pack_files, unpack_files
from dprorun.summary import overlap_length, union_length


def test_profile_config_round_trips_through_env():
    cfg = ProfileConfig(run_dir="/x", job_id="j", warmup=2, active=7, clean=0, kineto=False,
                        clock_skew_us=[0.0, 5000.0, -3000.0], fake_hosts=["a", "b"])
    back = ProfileConfig.from_env(cfg.to_env())
    assert back == cfg
    assert back.skew_for(2) == -3000.0 and back.skew_for(9) == 0.0
    assert back.host_for(1, "real") == "b" and back.host_for(5, "real") == "real"


@pytest.mark.parametrize("env,needle", [({"DPRO_ACTIVE": "0"}, "active >= 1"),
                                        ({"DPRO_WARMUP": "x"}, "DPRO_WARMUP"),
                                        ({"DPRO_COMM_DETAIL": "tree"}, "comm detail")])
def test_profile_config_rejects_bad_values(env, needle):
    with pytest.raises(ValueError, match=needle):
        ProfileConfig.from_env(env)


def test_atomic_write_is_owner_only_and_leaves_no_temp(tmp_path):
    path = tmp_path / "sub" / "a.json"
    atomic_write_json(str(path), {"x": 1})
    assert read_json(str(path)) == {"x": 1}
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "sub").stat().st_mode & 0o777) == "0o700"
    assert os.listdir(tmp_path / "sub") == ["a.json"]


@pytest.mark.parametrize("content,problem", [(b"", "empty"), (b'{"a": [1, 2', "truncated"),
                                             (b"\xff\xfe\x00garbage", "not text"),
                                             (b"\x1f\x8b\x08\x00broken", "corrupted gzip")])
def test_read_json_names_file_and_problem(tmp_path, content, problem):
    path = tmp_path / "trace.json"
    path.write_bytes(content)
    with pytest.raises(TraceError) as err:
        read_json(str(path))
    assert str(path) in str(err.value) and problem in str(err.value)


def test_read_json_reads_gzip(tmp_path):
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(b'{"ok": true}'))
    assert read_json(str(path)) == {"ok": True}


def test_bundle_round_trip_and_rejects_path_escapes():
    files = {"events.json": b"{}", "kineto_trace.json": b"x" * 1000}
    assert unpack_files(pack_files(files)) == files
    with pytest.raises(BundleError):
        pack_files({"../evil": b""})
    import struct
    import zlib
    header = json.dumps({"files": [{"name": "../../etc/passwd", "size": 1}]}).encode()
    evil = zlib.compress(struct.pack(">Q", len(header)) + header + b"x")
    with pytest.raises(BundleError, match="outside the rank folder"):
        unpack_files(evil)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_bundle_reader_never_crashes_on_garbage(blob):
    try:
        unpack_files(blob)
    except BundleError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300))
def test_bundle_reader_on_mutated_valid_bundle(noise):
    blob = bytearray(pack_files({"events.json": b'{"a": 1}'}))
    for i, b in enumerate(noise[: len(blob)]):
        blob[i] ^= b
    try:
        unpack_files(bytes(blob))
    except BundleError:
        pass


def test_interval_arithmetic():
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4
    assert overlap_length([(0, 10)], [(2, 3), (5, 12)]) == 6
    assert overlap_length([], [(0, 1)]) == 0


def test_bootstrap_chains_existing_sitecustomize(tmp_path):
    user_site = tmp_path / "usersite"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = '1'\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "hooks"), REPO, str(user_site)]),
               DPRO_ENABLED="1", RANK="0", DPRO_RUN_DIR=str(tmp_path / "run"))
    code = ("import os, sys; from dprorun.runtime.bootstrap import session; "
            "print(os.environ.get('USER_SITECUSTOMIZE_RAN'), session() is not None, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "True", "False"]  # chained, installed, and torch not imported eagerly


def test_bootstrap_skips_subprocesses_of_a_rank(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "hooks"), REPO]), DPRO_ENABLED="1",
               RANK="0", DPRO_HOOKED_PID="1", DPRO_RUN_DIR=str(tmp_path))
    code = "from dprorun.runtime.bootstrap import session; print(session() is None)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_ranks_tear_cupti_down_after_the_window_unless_the_user_says_otherwise(monkeypatch):
    """Kineto keeps CUPTI subscribed after the profiler stops unless TEARDOWN_CUPTI=1; measured on an H200 that
    left the rest of the job up to 42 % slower (benchmarks/RESULTS.md, GPU)."""
    from dprorun.config import JobConfig, OutputConfig
    from dprorun.launch import rank_environment

    job = JobConfig(command=["python", "train.py"], output=OutputConfig(run_dir="/tmp/x"))
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    assert rank_environment(job)["TEARDOWN_CUPTI"] == "1"
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")  # e.g. CUDA graphs, where torch itself asks for 0
    assert rank_environment(job)["TEARDOWN_CUPTI"] == "0"


def test_a_console_that_cannot_show_a_character_gets_it_replaced_not_an_exit_2():
    """PYTHONIOENCODING=ascii (or a Latin-1 locale): the summary's first "→" ended dprorun with exit 2 ("'ascii'
    codec can't encode character") after a completed job."""
    import io

    from dprorun.procs import StdoutThatOutlivesItsReader

    raw = io.BytesIO()
    stream = StdoutThatOutlivesItsReader(io.TextIOWrapper(raw, encoding="ascii"))
    stream.write("comm (ready→done) 4.2 µs\n")
    stream.flush()
    assert raw.getvalue() == b"comm (ready?done) 4.2 ?s\n"


def test_lightnings_refusal_of_the_launched_world_says_how_to_launch_it(tmp_path):
    """`dprorun -np 4 python train.py` of a Trainer(devices=2): Lightning refuses the world of 4, as under torchrun;
    the failure now says that Lightning starts its ranks itself (one process launched, or -np its device count)."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from dprorun.config import JobConfig, LaunchConfig, OutputConfig
    from dprorun.launch import _child_failed

    error_file = tmp_path / "error.json"
    refusal = ("ValueError: You set `devices=2` and `num_nodes=1` in Lightning, but the product (2 * 1) does not "
               "match the world size (4).")
    error_file.write_text(json.dumps({"message": {"message": refusal, "extraInfo": {"timestamp": "0"}}}))
    failure = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=str(error_file))
    job = JobConfig(command=["python", "train.py"], launch=LaunchConfig(nproc_per_node=4),
                    output=OutputConfig(run_dir=str(tmp_path)))
    message = _child_failed(ChildFailedError("train", {0: failure}), job, set()).message
    assert "does not match the world size (4)" in message and "Lightning starts its ranks itself" in message


def test_python_flags_that_keep_the_hooks_out_are_told_from_the_scripts_own():
    from dprorun.procs import python_flag_without_the_hooks as flag

    assert flag(["python", "-E", "train.py"]) == "-E (ignores PYTHONPATH)"
    assert flag(["/usr/bin/python3", "-u", "-sI", "train.py"]).startswith("-I ")
    assert flag(["python", "-S", "-m", "pkg.train"]).startswith("-S ")
    for command in (["python", "train.py", "-E"], ["python", "-W", "E", "train.py"], ["python", "-Werror", "t.py"],
                    ["python", "-XE", "t.py"], ["python", "-m", "pkg", "-I"], ["torchrun", "-E"], ["python", "-u"]):
        assert flag(command) == "", command


def test_hooks_installed_with_pip_install_user_are_found(tmp_path, monkeypatch):
    """`pip install --user .` puts the data files under the user's base, not sys.prefix: every launch failed."""
    import site

    from dprorun import procs

    hooks = tmp_path / "userbase" / "share" / "dprorun" / "hooks"
    hooks.mkdir(parents=True)
    (hooks / "sitecustomize.py").write_text("")
    monkeypatch.setattr(procs, "PACKAGE_ROOT", str(tmp_path / "site-packages"))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "usr"))
    monkeypatch.setattr(site, "USER_BASE", str(tmp_path / "userbase"))
    assert procs.hooks_dir() == str(hooks)


def test_ranks_import_dprorun_alone_not_the_folder_that_holds_it(tmp_path, monkeypatch):
    """The folder holding dprorun (this source tree's root; site-packages for an installed dprorun) was put on the
    ranks' PYTHONPATH: a script's own namespace package `examples` got this tree's examples/common.py (ImportError
    under dprorun, not under torchrun), and an MXNet job's interpreter imported dprorun's environment's numpy 2."""
    from dprorun.config import JobConfig, OutputConfig
    from dprorun.launch import rank_environment

    project = tmp_path / "project"
    (project / "examples").mkdir(parents=True)
    (project / "examples" / "common.py").write_text("WHO = 'the project'\n")
    monkeypatch.setenv("PYTHONPATH", str(project))
    job = JobConfig(command=["python", "train.py"], output=OutputConfig(run_dir=str(tmp_path / "run")))
    env = dict(os.environ, **rank_environment(job))
    env.pop("DPRO_ENABLED")  # the import paths alone, no hooks installed
    assert env["PYTHONPATH"].split(os.pathsep) == [os.path.join(REPO, "hooks"), str(project)]
    code = "import dprorun, examples.common as c; print(c.WHO); print(dprorun.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         check=True)
    assert out.stdout.splitlines() == ["the project", os.path.join(REPO, "dprorun", "__init__.py")]


def test_nvml_device_index_wraps_when_ranks_share_gpus(monkeypatch):
    from dprorun.runtime.samplers import _nvml_device_index

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [_nvml_device_index(r, 1) for r in range(3)] == [0, 0, 0]
    assert [_nvml_device_index(r, 2) for r in range(3)] == [0, 1, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert [_nvml_device_index(r, 8) for r in range(3)] == [3, 5, 3]


def test_the_reported_failure_is_the_cause_not_a_rank_stopped_at_teardown():
    """A SIGKILLed rank leaves no error file; the rank the agent then SIGTERMs can carry the earlier timestamp
    (seen in CI): the SIGKILLed one must be named."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from dprorun.launch import _root_failure

    stopped = ProcessFailure(local_rank=0, pid=100, exitcode=-15, error_file="")
    killed = ProcessFailure(local_rank=1, pid=101, exitcode=-9, error_file="")
    stopped.timestamp, killed.timestamp = 10, 11
    rank, failure = _root_failure(ChildFailedError("train", {0: stopped, 1: killed}))
    assert rank == 1 and failure.exitcode == -9
    only_teardown = ChildFailedError("train", {0: stopped})
    assert _root_failure(only_teardown)[0] == 0
    # the survivor's gloo error ("connection closed by peer") can also come first: the killed rank is the cause
    raised = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file="")
    raised.timestamp = 10
    assert _root_failure(ChildFailedError("train", {0: raised, 1: killed}))[0] == 1
    # without a signal, the earliest error wins over the teardown
    other = ProcessFailure(local_rank=2, pid=102, exitcode=1, error_file="")
    other.timestamp = 12
    assert _root_failure(ChildFailedError("train", {0: stopped, 1: raised, 2: other}))[0] == 1
    # a TensorFlow collective that aborted as its peer's socket closed, stamped before the peer's own error (CI):
    # the peer is the cause
    aborted = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file="")
    aborted.timestamp, aborted.message = 10, {"message": "UnavailableError: Graph execution error:\n\nCollective ops "
                                                         "is aborted by: Socket closed"}
    own = ProcessFailure(local_rank=1, pid=101, exitcode=1, error_file="")
    own.timestamp, own.message = 11, {"message": "RuntimeError: injected failure at step 8"}
    assert _root_failure(ChildFailedError("train", {0: aborted, 1: own}))[0] == 1
    # a rank the agent stopped (its SIGTERM sent) and then SIGKILLed, as it waited in C++ for a peer that had failed
    # before init_process_group: the peer's own error is the cause (the SIGKILL was named before)
    waited = ProcessFailure(local_rank=0, pid=100, exitcode=-9, error_file="")
    missing = ProcessFailure(local_rank=1, pid=101, exitcode=1, error_file="")
    waited.timestamp, missing.timestamp = 16, 10
    assert _root_failure(ChildFailedError("train", {0: waited, 1: missing}), {100})[0] == 1
    assert _root_failure(ChildFailedError("train", {0: waited, 1: missing}))[0] == 0  # not stopped: killed first


def test_horovod_jobs_keep_their_thread_settings(monkeypatch):
    """torchrun sets OMP_NUM_THREADS=1 for multi-rank jobs and dprorun does too; horovodrun does not, and a
    profiler must not change the job it profiles."""
    from dprorun.config import JobConfig, LaunchConfig
    from dprorun.launch import rank_environment

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    two = LaunchConfig(nproc_per_node=2)
    assert rank_environment(JobConfig(command=["python", "t.py"], launch=two))["OMP_NUM_THREADS"] == "1"
    two_horovod = LaunchConfig(nproc_per_node=2, backend="horovod")
    assert "OMP_NUM_THREADS" not in rank_environment(JobConfig(command=["python", "t.py"], launch=two_horovod))


def test_fusion_blocks_and_the_per_block_compiled_call_leave_the_model_as_it_was(monkeypatch):
    """Blocks are the composite children of the largest container (a Transformer's layers, a ResNet-like
    Sequential's residual blocks); the per-block variant installs compiled forwards for its call only."""
    import torch
    import torch.nn as nn

    from dprorun.runtime import variants

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, 8)
            layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.encoder(self.embed(x)))

    net = Net()
    assert variants.fusion_blocks(net) == ["encoder.layers.0", "encoder.layers.1", "encoder.layers.2"]
    residual = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU()),
                             nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU()), nn.Flatten())
    assert variants.fusion_blocks(residual) == ["1", "2"]
    assert variants.fusion_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))) == []
    calls = []

    def fake_compile(fn):  # stands for torch.compile (which takes seconds per block on CPU)
        def compiled(*a, **kw):
            calls.append(fn)
            return fn(*a, **kw)
        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    aliases = variants.detached_parameters(net)
    call = variants._compiled_blocks_call(net, variants.fusion_blocks(net), aliases)
    x = torch.randn(2, 5, 4)
    out = call(x)
    assert out.shape == (2, 5, 2) and len(calls) == 3
    assert all("forward" not in net.encoder.layers[k].__dict__ for k in range(3))  # the class's forward again
    out.sum().backward()  # into the aliases (same storage), never the live parameters (DDP's hooks sit there)
    assert all(p.grad is None for p in net.parameters()) and aliases["head.weight"].grad is not None
    assert aliases["head.weight"].data_ptr() == net.head.weight.data_ptr()
    net(x)
    assert len(calls) == 3


@pytest.mark.parametrize("layout, expected", [
    ("v1", 0.45),  # cgroup v1 cpu controller: cfs_quota_us / cfs_period_us (the emulated cluster's hosts)
    ("v2", 1.5),  # cgroup v2: cpu.max "quota period"
    ("v2max", None),  # no limit
    ("none", None),  # unreadable -> None, never an error
])
def test_cgroup_cpu_quota_is_read_from_v1_and_v2(tmp_path, layout, expected):
    from dprorun.runtime.cpubudget import cgroup_quota_cores

    proc = tmp_path / "cgroup"
    root = tmp_path / "fs"
    if layout == "v1":
        proc.write_text("12:pids:/x\n4:cpu:/emu/h0\n0::/ignored\n")
        (root / "cpu" / "emu" / "h0").mkdir(parents=True)
        (root / "cpu" / "emu" / "h0" / "cpu.cfs_quota_us").write_text("4500\n")
        (root / "cpu" / "emu" / "h0" / "cpu.cfs_period_us").write_text("10000\n")
    elif layout.startswith("v2"):
        proc.write_text("0::/job.slice\n")
        (root / "job.slice").mkdir(parents=True)
        (root / "job.slice" / "cpu.max").write_text("max 100000\n" if layout == "v2max" else "150000 100000\n")
    assert cgroup_quota_cores(str(proc), str(root)) == expected


def test_the_cgroups_cpu_counters_are_read_where_a_quota_is_set(tmp_path):
    from dprorun.runtime.cpubudget import cgroup_cpu_stat

    proc = tmp_path / "cgroup"
    proc.write_text("4:cpu:/emu/h0\n")
    folder = tmp_path / "fs" / "cpu" / "emu" / "h0"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text("-1\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    (folder / "cpu.stat").write_text("nr_periods 40\nnr_throttled 12\nthrottled_time 3500000\n")
    assert cgroup_cpu_stat(str(proc), str(tmp_path / "fs")) is None  # no quota: nothing throttles
    (folder / "cpu.cfs_quota_us").write_text("90000\n")
    assert cgroup_cpu_stat(str(proc), str(tmp_path / "fs")) == {"nr_periods": 40, "nr_throttled": 12,
                                                                "throttled_us": 3500}
    v2 = tmp_path / "v2"
    (v2 / "job").mkdir(parents=True)
    (v2 / "job" / "cpu.max").write_text("50000 100000\n")
    (v2 / "job" / "cpu.stat").write_text("usage_usec 900\nnr_periods 5\nnr_throttled 1\nthrottled_usec 70\n")
    proc.write_text("0::/job\n")
    assert cgroup_cpu_stat(str(proc), str(v2)) == {"nr_periods": 5, "nr_throttled": 1, "throttled_us": 70,
                                                   "usage_us": 900}


@pytest.mark.parametrize("budget, warned", [
    ({"compute_threads": 2, "cores_per_rank": 0.45, "cgroup_quota_cores": 0.45, "cores": 0.45, "local_ranks": 1}, True),
    ({"compute_threads": 16, "cores_per_rank": 8.0, "cgroup_quota_cores": None, "cores": 16.0, "local_ranks": 2}, True),
    ({"compute_threads": 1, "cores_per_rank": 1.0, "cgroup_quota_cores": None, "cores": 2.0, "local_ranks": 2}, False),
    ({"compute_threads": 8, "cores_per_rank": 8.0, "cgroup_quota_cores": None, "cores": 16.0, "local_ranks": 2}, False),
    ({}, False),  # not recorded
])
def test_torch_threads_beyond_the_ranks_cores_are_named(budget, warned):
    from dprorun.runtime.cpubudget import oversubscription_warning

    message = oversubscription_warning(budget)
    assert bool(message) == warned
    if warned:
        assert f"{budget['compute_threads']} threads" in message and "OMP_NUM_THREADS" in message


def test_a_failure_message_is_its_first_line_or_the_last_of_a_cpp_traceback():
    """What the launcher prints after 'exited with code 1:': the error's first line, or, for an error raised in C++
    whose message holds that library's traceback (MXNet 1.9.1's 'Compression not supported with PushPull', raised
    by a Gluon Trainer with gradient compression on a dist kvstore), its last line."""
    from types import SimpleNamespace

    from dprorun.procs import error_message

    mxnet = ("MXNetError: Traceback (most recent call last):\n  File \"../src/kvstore/./kvstore_dist.h\", line 262\n"
             "MXNetError: Check failed: gradient_compression_->get_type() == CompressionType: :kNone: Compression "
             "not supported with PushPull\n")
    said = error_message(SimpleNamespace(message={"message": mxnet}))
    assert said.startswith("MXNetError: Check failed") and said.endswith("Compression not supported with PushPull")
    plain = error_message(SimpleNamespace(message="RuntimeError: injected failure\nmore"))
    assert plain == "RuntimeError: injected failure"
    assert error_message(SimpleNamespace(message={"message": "<N/A>"})) == ""
    # TensorFlow: a header line, where, the cause, then the node's note (a Keras fit with jit_compile=True under
    # MultiWorkerMirroredStrategy on CPU; plain TF_CONFIG launches fail alike): was "UnimplementedError: Graph
    # execution error:"
    tf_error = ("UnimplementedError: Graph execution error:\n\nDetected at node StatefulPartitionedCall defined at "
                "(most recent call last):\n  File \"train.py\", line 75, in <module>\n\nCollectives are not yet "
                "implemented for CPU devices when compiling with XLA.\n\t [[{{node StatefulPartitionedCall}}]] "
                "[Op:__inference_train_function_1235]")
    assert error_message(SimpleNamespace(message=tf_error)) == (
        "UnimplementedError: Collectives are not yet implemented for CPU devices when compiling with XLA.")
    from dprorun.procs import error_line

    assert error_line(tf_error) == error_message(SimpleNamespace(message=tf_error))
    # a message of two lines that is no header: both say its first (the summary's line said the second, "more")
    assert error_line("RuntimeError: injected failure\nmore") == plain


def test_compute_variants_leave_a_forward_a_framework_redirected_alone():
    """Lightning routes DDP's forward to training_step by setting the module's `forward` for one call, and that
    redirect undoes itself when called; measuring variants from inside that forward called it, undid it, and the
    job's own step then failed ("missing the required forward function"). Now: not measured, the reason said."""
    import torch
    import torch.nn as nn

    from dprorun.runtime.variants import measure_compute_variants

    calls = []
    net = nn.Linear(4, 2)

    def redirected(x):
        calls.append(x)
        del net.forward  # undone on its first call, as Lightning's redirect is
        return x.sum()

    net.forward = redirected
    out = measure_compute_variants(net, (torch.ones(3, 4),), {}, reps=2)
    assert set(out) == {"eager", "compiled", "compiled_blocks", "bf16"}
    assert all("redirects the model's forward" in v["error"] for v in out.values())
    assert calls == [] and net.forward is redirected


def test_compute_variants_of_a_batch_made_by_autograd_in_the_step():
    """PGD adversarial training: the trained batch, x + delta, was made by autograd in the step (delta asks for a
    gradient), and its graph was freed by the step's backward: every timed backward ran into it ("Trying to backward
    through the graph a second time"), no variant was measured and --autotune turned its compute passes off. The
    batch's tensors are cut from their graphs first (a leaf asking for a gradient stays one)."""
    import torch
    import torch.nn as nn

    from dprorun.runtime.variants import fresh_inputs, measure_compute_variants

    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    delta = torch.zeros(5, 8, requires_grad=True)
    batch = torch.ones(5, 8) + delta
    net(batch).sum().backward()  # the script's own step: the batch's graph is freed
    out = measure_compute_variants(net, (batch,), {}, reps=2, variants=("eager",))
    assert "error" not in out["eager"] and out["eager"]["backward_us"] > 0, out
    kept = fresh_inputs({"x": [batch], "mask": None})
    assert kept["x"][0].grad_fn is None and kept["x"][0].requires_grad and kept["mask"] is None


def test_compute_variants_of_a_dataclass_output_and_of_a_torchscript_model():
    """A model returning a dataclass: the variants' stand-in loss searched dicts, lists and tuples only, "the model's
    output has no floating tensor that requires grad", and none was measured (the DDP tracker's own search, which
    finds it, is shared now). A TorchScript model's forward is an instance attribute, which was told as a training
    framework's redirect: it is named for what it is."""
    import dataclasses

    import torch
    import torch.nn as nn

    from dprorun.runtime.variants import measure_compute_variants

    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return Output(self.fc(x))

    out = measure_compute_variants(Net(), (torch.ones(3, 8),), {}, reps=2, variants=("eager",))
    assert "error" not in out["eager"] and out["eager"]["backward_us"] > 0, out
    scripted = measure_compute_variants(torch.jit.script(nn.Linear(8, 4)), (torch.ones(3, 8),), {}, reps=2,
                                        variants=("eager", "compiled"))
    assert all("a TorchScript module" in v["error"] for v in scripted.values()), scripted


def test_a_collective_made_while_rank_0_is_alone_raises_in_its_thread_only():
    """While rank 0 times the compute variants alone (the other ranks at dprorun's barrier), a torch.distributed
    call the measuring thread makes raises RanksNeededError (a halo exchange in the forward waited for good); a call
    another thread of the script's makes then goes through as before."""
    import threading
    import types

    from dprorun.runtime.watch import RanksNeededError, ScriptUse, _counted_collective

    calls = []
    fake = types.SimpleNamespace(__name__="torch.distributed", all_reduce=lambda *a, **k: calls.append(a))
    use = ScriptUse()
    watched = _counted_collective(fake, "all_reduce", use)
    use.alone, use.alone_thread = "rank 0 times the model's compute variants alone", threading.get_ident()
    with pytest.raises(RanksNeededError, match="calls torch.distributed.all_reduce, which needs the other ranks"):
        watched(1)
    other = threading.Thread(target=watched, args=(2,))
    other.start()
    other.join()
    use.alone = ""
    watched(3)
    assert calls == [(2,), (3,)]


def test_a_call_running_k_steps_splits_at_its_fetches_or_its_first_op_run_k_times():
    """TensorFlow step functions that loop over k steps per call (tf_records._step_starts): the steps start at the
    input fetches where there are k, else at the occurrences of the call's first op that runs k times (a loop over
    tensors the function was given fetches nothing; the loop's set-up op runs once), else k equal parts."""
    from dprorun.trace.model import Op, OpKind
    from dprorun.trace.tf_records import _step_starts
    from dprorun.trace.xplane import TFProfile, name_outside_loop

    def op(name, t):
        return Op(name="X", kind=OpKind.FW, rank=0, start_us=t, end_us=t + 3, args={"op": name})

    ops = [op("range/ReadVariableOp", 1)] + [op(n, t + j * 100) for j in range(3) for n, t in (("dense/MatMul", 6),
                                                                                             ("dense/BiasAdd", 9))]
    assert _step_starts(TFProfile(ops, [], [], [2.0, 101.0, 198.0]), 0.0, 300.0, 3) == [0.0, 101.0, 198.0]
    assert _step_starts(TFProfile(ops, [], []), 0.0, 300.0, 3) == [0.0, 106.0, 206.0]
    assert _step_starts(TFProfile([], [], []), 0.0, 300.0, 3) == [0.0, 100.0, 200.0]
    assert name_outside_loop("while/body/_1/gradient_tape/while/sequential/dense/MatMul") == \
        "gradient_tape/sequential/dense/MatMul"
    assert name_outside_loop("while/body/_1/while/SGD/update_0/mul") == "SGD/update_0/mul"
    assert name_outside_loop("sequential/while_loop/x") == "sequential/while_loop/x"


def test_steps_per_call_are_counted_by_the_fetches_where_the_profile_holds_no_collective():
    """horovod.tensorflow with Keras's steps_per_execution: TensorFlow's profiler records none of Horovod's ops, so
    the calls were read as single steps (a call of 4 steps replayed as one 204 ms iteration; 51 ms a step with the
    split). The input fetches inside each profiled call count its steps; a call the profiler cut short (none) is
    left out of the count; with collectives, the first collective's runs still decide."""
    from dprorun.trace.model import Op, OpKind
    from dprorun.trace.tf_records import _steps_per_call
    from dprorun.trace.xplane import TFProfile

    starts = [0.0, 400.0, 800.0, 1200.0, 1600.0]
    fetches = [t + j * 100 + 2 for t in (400.0, 800.0, 1200.0) for j in range(4)]
    assert _steps_per_call(TFProfile([], [], [], fetches), starts, [0, 1, 2, 3], []) == 4
    assert _steps_per_call(TFProfile([], [], [], []), starts, [1, 2, 3], []) == 1
    reduce = [Op(name="CollectiveReduceV2", kind=OpKind.COMM, rank=0, start_us=t + 50, end_us=t + 60,
                 args={"scope": "CollectiveReduceV2"}) for t in (400.0, 800.0, 1200.0)]
    assert _steps_per_call(TFProfile([], reduce, [], fetches), starts, [1, 2, 3], []) == 1
    # a GAN's step: two step functions called in turn, each all-reducing under the same scope name once: two
    # calls of one step each (the hooks' "step" spans), not a call of two steps
    both = reduce + [Op(name="CollectiveReduceV2", kind=OpKind.COMM, rank=0, start_us=t + 250, end_us=t + 260,
                        args={"scope": "CollectiveReduceV2"}) for t in (400.0, 800.0, 1200.0)]
    calls = [[i, "step", t + s, t + s + 190] for i, t in ((1, 400.0), (2, 800.0), (3, 1200.0)) for s in (0, 200)]
    assert _steps_per_call(TFProfile([], both, [], []), starts, [1, 2, 3], []) == 2
    assert _steps_per_call(TFProfile([], both, [], []), starts, [1, 2, 3], calls) == 1


def test_a_tf_steps_backward_starts_where_gradient_work_does_not_at_its_earliest_gradient_op():
    """TensorFlow runs a gradient op as soon as its inputs exist: one that needs only shapes (an embedding's
    gradient concat) ran in a GRU net's forward and put its backward's start at 2.4 ms of the real 7.7
    (tf_records.backward_start). Recurrent layers' loop gradients ("gradients/...") are backward ops too."""
    from dprorun.trace.model import Op, OpKind
    from dprorun.trace.tf_records import backward_start
    from dprorun.trace.xplane import GRADIENT_SCOPES

    def op(kind, start, dur):
        return Op(name="X", kind=kind, rank=0, start_us=start, end_us=start + dur)

    forward = [op(OpKind.FW, t, 900) for t in range(0, 7000, 1000)]
    early = op(OpKind.BW, 2400, 4)
    backward = [op(OpKind.BW, t, 900) for t in range(7000, 10000, 1000)]
    assert backward_start(forward + [early] + backward, 10000) == 7000
    assert backward_start(forward + backward, 10000) == 7000
    assert backward_start([early], 2404) == 2400
    assert "gradients/while_grad/".startswith(GRADIENT_SCOPES)


def test_tf_micro_batch_calls_belong_to_the_iteration_their_syncing_call_ends():
    """A TensorFlow custom loop accumulating gradients: K calls of a step function that all-reduces nothing, then one
    that all-reduces and applies. Every call was an iteration (a 310 ms step read as three of ~100 ms, the replay
    +145 % off its clean iterations); an iteration now runs from the first call after a syncing call to the end of
    the next syncing one. Where no syncing function is known, every call is an iteration, as before."""
    from dprorun.runtime.tf import TFTracker

    class Session:
        rank_dir, trackers, detail_active = "/nonexistent", [], False

        def __init__(self):
            self.boundaries = []

        def begin_iteration(self):
            self.boundaries.append(len(calls))

        def now_us(self):
            return 0.0

    calls: list[str] = []
    micro, apply = object(), object()
    session = Session()
    tracker = TFTracker(session)
    run = lambda fn, name: tracker.run_step(lambda *a: calls.append(name), fn)  # noqa: E731
    run(micro, "m")  # nothing known to sync yet: every call is an iteration
    run(micro, "m")
    tracker.syncing_functions.add(id(apply))
    for _ in range(3):
        run(micro, "m"), run(micro, "m"), run(apply, "a")
    assert session.boundaries == [0, 1, 2, 5, 8]


def test_a_tf_step_function_first_called_after_the_window_began_is_another_models_and_ends_profiling_there():
    """Keras's compile() makes a new train_function (fine-tuning after fitting the head): a syncing step function
    called for the first time once the window began ends the window (or the clean iterations) at the iteration its
    first call began; one first called in the warm-up does not, nor does a function that all-reduces nothing (Keras's
    test_function), nor a second call. The packs are those of the function the window ran."""
    from dprorun.runtime.tf import TFTracker

    class Session:
        rank_dir, trackers, detail_active, phase, iteration = "/nonexistent", [], False, "warmup", -1

        def __init__(self):
            self.replaced = []

        def begin_iteration(self):
            self.iteration += 1

        def now_us(self):
            return 0.0

        def guard(self, what, fn, *args):
            return fn(*args)

        def mark(self, *_):
            pass

        def primary_replaced(self, first_new, what):
            self.replaced.append(first_new)

    session = Session()
    tracker = TFTracker(session)
    head, test, tuned, again = object(), object(), object(), object()

    def run(function, syncs=True):  # a call; its first one traces it (a syncing function meets the all-reduce)
        def call(*_):
            if syncs:
                tracker.syncing_functions.add(id(function))
                tracker.packs_by_function.setdefault(id(function), [{"tensors": ["g"], "bytes": [id(function) % 97]}])
        tracker.run_step(call, function)

    run(head), run(head), run(test, syncs=False)
    run(tuned)  # compiled again in the warm-up: the window will profile this one
    assert session.replaced == []
    session.phase, session.detail_active = "active", True
    run(tuned), run(test, syncs=False), run(tuned)
    assert session.replaced == [] and tracker.packs == tracker.packs_by_function[id(tuned)]
    run(again)  # compiled again inside the window: its first call began iteration 5
    assert session.replaced == [session.iteration] == [5]
    run(again)
    assert session.replaced == [5] and session.iteration == 6  # a syncing function's first call was an iteration


def test_a_tf_step_functions_gradient_packs_are_its_calls_that_update_new_variables():
    """runtime/tf.py: of a step function's all-reduce calls, the packs are those whose results update trainable
    variables not updated before in the function (two optimizers: both calls; a BatchNorm's moments and a loss: none;
    tf-keras's steps_per_execution, tracing its first step and then the loop of the others: the first copy only);
    none updating, the first call's. The analysis finds each pack's collective by its name, loop scopes aside."""
    from dprorun.runtime.tf import TFTracker
    from dprorun.trace.model import Op, OpKind
    from dprorun.trace.tf_records import pack_collectives

    tracker = TFTracker(type("Session", (), {"rank_dir": "/nonexistent", "trackers": []})())
    calls = [("moments", []), ("trunk", ["dense/kernel", "dense/bias"]), ("head", ["head/kernel"]),
             ("again", ["dense/kernel", "dense/bias"]), ("loss", [])]
    tracker.packs_by_function[7] = [{"tensors": [name], "bytes": [4], "call": k} for k, (name, _) in enumerate(calls)]
    for k, (_, variables) in enumerate(calls):
        tracker.recording = (7, k, 1)
        for variable in variables:
            tracker.applied(variable)
    tracker.window_function = 7
    assert [p["tensors"] for p in tracker.packs] == [["trunk"], ["head"]]
    assert [p["call"] for p in tracker.describe()["packs"]] == [0, 1]
    tracker.applied_calls.clear()
    assert [p["tensors"] for p in tracker.packs] == [["moments"]]  # gradients all-reduced by hand, assigned

    def collective(scope, start):
        return Op(name="CollectiveReduceV2", kind=OpKind.COMM, rank=0, start_us=start, end_us=start + 1,
                  args={"scope": scope})

    colls = [collective(s, t) for t, s in enumerate(["bn/CollectiveReduceV2", "sgd/CollectiveReduceV2",
                                                      "CollectiveReduceV2_1"])]
    packs = [{"collective": "while/sgd/CollectiveReduceV2"}, {"collective": "CollectiveReduceV2_1"}]
    assert pack_collectives(packs, colls) == colls[1:]
    assert pack_collectives([{"collective": "gone"}], colls) == colls[:1]  # not in the profile: in turn


def test_a_third_crash_in_tensorflows_profiler_stop_gives_a_last_launch_without_the_profiler(tmp_path):
    """launch.relaunch_after_tf_stop_crash, the decisions around one failed launch: a worker that died with the stop's
    mark in its folder (a signal, not the launcher's SIGTERM) -> the job again with the profiler, twice; the same in
    the third launch -> the fourth without it (before session 56 the third: two crashes in a row met the CI); the failed launch's folders moved aside each time; a rank stopped by
    the launcher's SIGTERM at teardown, another backend or a job across hosts -> no relaunch."""
    import signal

    from dprorun.config import JobConfig
    from dprorun.launch import relaunch_after_tf_stop_crash
    from dprorun.procs import LaunchResult

    job = JobConfig(command=["python", "train.py"])
    job.output.run_dir, job.launch.backend, job.launch.nproc_per_node = str(tmp_path), "tf", 2

    def crash(rank: int, code: int) -> LaunchResult:
        (tmp_path / f"rank_{rank}").mkdir(exist_ok=True)
        (tmp_path / f"rank_{rank}" / "tf_profiler_stopping").write_text("")
        return LaunchResult(128 - code, "crashed", rank, {rank: {"exitcode": code, "pid": 1}})

    assert relaunch_after_tf_stop_crash(job, crash(1, -signal.SIGSEGV)).startswith("rank(s) [1] died inside")
    assert job.profile.launch_attempt == 2 and job.profile.kineto
    assert (tmp_path / "failed_launch_1" / "rank_1" / "tf_profiler_stopping").exists()
    assert "with the profiler (launch 3 of at most 4" in relaunch_after_tf_stop_crash(job, crash(1, -signal.SIGABRT))
    assert job.profile.launch_attempt == 3 and job.profile.kineto
    assert "without TensorFlow's profiler" in relaunch_after_tf_stop_crash(job, crash(1, -signal.SIGABRT))
    assert job.profile.launch_attempt == 4 and not job.profile.kineto
    assert relaunch_after_tf_stop_crash(job, crash(0, -signal.SIGTERM)) == ""  # stopped at teardown, not a crash
    job.launch.backend = "torch"
    assert relaunch_after_tf_stop_crash(job, crash(1, -signal.SIGSEGV)) == ""
    job.launch.backend, job.launch.nnodes, job.launch.nproc_per_node = "tf", 2, 1
    assert relaunch_after_tf_stop_crash(job, crash(1, -signal.SIGSEGV)) == ""


def test_iterations_under_the_scripts_own_profiler_leave_the_statistics_where_others_remain():
    """trace/rundir.py: the union over ranks of the iterations under the script's own profiler leaves the window's
    and the clean iterations (ops and gradient times too) where others remain; where none remain they stay and the
    run says its figures are of the job under that profiler."""
    from dprorun.trace.model import Op, OpKind, RankTrace, RunTrace
    from dprorun.stats import ranges_text
    from dprorun.trace.rundir import _set_aside_script_profiled

    def rank(r, marks):
        trace = RankTrace(rank=r, host="h", profiled_iterations=list(range(5, 12)),
                          ops=[Op(name="fw", kind=OpKind.FW, rank=r, start_us=i, end_us=i + 1, iteration=i)
                               for i in range(5, 12)],
                          grad_ready=[(i, "w", float(i)) for i in range(5, 12)])
        trace.meta = {"clean_iterations": list(range(12, 16)), "kineto_iterations": [5, 6, 7],
                      "script_profiler_iterations": marks}
        return trace

    run = RunTrace(run_dir="/x", manifest={}, ranks={0: rank(0, [4, 5, 6, 7]), 1: rank(1, [])})
    _set_aside_script_profiled(run)
    for trace in run.ranks.values():  # rank 1 waited for rank 0: its iterations 5-7 leave as well
        assert trace.profiled_iterations == [8, 9, 10, 11] and trace.meta["kineto_iterations"] == []
        assert {op.iteration for op in trace.ops} == {8, 9, 10, 11} and len(trace.grad_ready) == 4
        assert trace.meta["clean_iterations"] == [12, 13, 14, 15]
    assert run.problems == ["iterations 4-7 ran (in part) under the script's own profiler: left out of the "
                            "profiled window's iterations' statistics"]
    everything = list(range(0, 16))
    run = RunTrace(run_dir="/x", manifest={}, ranks={0: rank(0, everything), 1: rank(1, everything)})
    _set_aside_script_profiled(run)
    assert run.ranks[0].profiled_iterations == list(range(5, 12)) and len(run.ranks[1].ops) == 7
    assert run.problems == ["iterations 0-15 ran (in part) under the script's own profiler: every one of the "
                            "profiled window's and the clean iterations did: they stay, and the figures from them "
                            "are of the job under that profiler"]
    assert ranges_text([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"


def test_an_mxnet_error_is_said_by_its_cause_and_the_ps_model_repeats_the_workers_warnings():
    from dprorun.replay.ps_model import _worker_warnings
    from dprorun.runtime.session import exception_text

    mx_error = RuntimeError('Traceback (most recent call last):\n  File "../src/c_api/c_api_profile.cc", line 353\n'
                            "MXNetError: Check failed: profiler->IsEnableOutput(): Profiler hasn't been run.\n")
    assert exception_text(mx_error) == "MXNetError: Check failed: profiler->IsEnableOutput(): Profiler hasn't been run."
    assert exception_text(ValueError("plain\nsecond line")) == "plain\nsecond line"
    workers = {0: {"warnings": ["the script's own mx.profiler was on\ndetail", "only 0"]},
               1: {"warnings": ["the script's own mx.profiler was on", "kvstore calibration failed: x"]}}
    assert _worker_warnings(workers) == ["workers 0, 1: the script's own mx.profiler was on", "worker 0: only 0"]


def test_an_mx_profiler_dump_after_the_scripts_finished_one_is_read_without_its_header(tmp_path):
    """After a script's own dump(finished=True), MXNet writes the next dump without `{"traceEvents": [` (recorded
    from MXNet 1.9.1: the file starts with a comma)."""
    from dprorun.trace.mxprofile import read_mx_profile

    events = [{"name": "FullyConnected", "cat": "operator", "ph": ph, "ts": ts, "pid": 0, "tid": 7}
              for ph, ts in (("B", 100), ("E", 160))]
    path = tmp_path / "mx_profile.json"
    path.write_text(",\n" + ",\n".join(json.dumps(e) for e in events) + '\n\n    ],\n    "displayTimeUnit": "ms"\n}\n')
    ops = read_mx_profile(str(path))
    assert [(op.name, op.start_us, op.end_us) for op in ops] == [("FullyConnected", 100.0, 160.0)]


def test_the_update_meter_reads_the_steps_temporaries_only_when_they_raise_the_peak():
    """runtime/update_memory.py around real optimizer steps, with the device's counters scripted: a step that
    raises the peak leaves its temporaries (peak - allocated after it), one under the earlier peak nothing, a step
    given a closure is not read, and the meter is done after the steps asked for (its hooks are removed outside a
    step: torch iterates over them during one). The GPU's reading (the caching allocator's counters); on CPU the
    step's tensors are counted (next test)."""
    import torch

    from dprorun.memory import peak_from_parts
    from dprorun.runtime.update_memory import UpdateMemoryMeter

    memory: dict = {}
    counts = iter([(100, 50), (160, 70),  # step 1: peak 100 -> 160, 70 left: 90 of temporaries
                   (160, 70), (160, 70),  # step 2: under the earlier peak: nothing read
                   (160, 70), (200, 75)])  # step 4 (step 3 had a closure): 125 of temporaries
    meter = UpdateMemoryMeter(memory, 3, lambda: True, lambda what, fn, *a: fn(*a))
    meter._counts = lambda: next(counts)
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    meter.start()
    meter.cuda = True
    try:
        for step in range(5):
            param.grad = torch.ones(4)
            if step == 2:
                optimizer.step(lambda: torch.tensor(0.0))
            else:
                optimizer.step()
            if step == 0:
                assert memory == {"cuda_update_transient_bytes": 90}
        assert memory == {"cuda_update_transient_bytes": 125} and meter.done  # done after 3 read steps
        meter.stop()
        assert not meter.handles
    finally:
        meter.stop()
    parts = {"at_ddp_init": 100, "optimizer_state": 10, "other_steady": 0, "gradients": 20, "activations": 40,
             "update_transient": 125, "extra": 0}
    assert peak_from_parts(parts) == 255 and peak_from_parts(dict(parts, update_transient=0)) == 170


def test_on_cpu_the_update_meter_counts_the_steps_own_tensors():
    """CPU: the RSS right after a step still holds its freed temporaries (glibc keeps them), so the step's tensors
    are counted: Adam's single-tensor step on CPU makes the square root of its second moment and a quotient of it,
    two temporaries of the parameter's size, while the moments it creates on the first step stay (optimizer state,
    not temporaries); SGD with momentum updates in place and makes none. Nothing is left counting after a step."""
    import torch
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from dprorun.runtime.update_memory import UpdateMemoryMeter

    def temporaries(make_optimizer, steps=2) -> int:
        memory: dict = {}
        param = torch.nn.Parameter(torch.ones(512, 512))  # 1 MiB
        optimizer = make_optimizer([param])
        meter = UpdateMemoryMeter(memory, steps, lambda: True, lambda what, fn, *a: fn(*a))
        meter.start()
        meter.cuda = False
        try:
            for _ in range(steps):
                param.grad = torch.ones(512, 512)
                optimizer.step()
                assert _get_current_dispatch_mode() is None
        finally:
            meter.stop()
        return memory["rss_update_transient_bytes"]

    assert temporaries(lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=False)) == 2 * 512 * 512 * 4
    assert temporaries(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)) == 0
    # a sparse gradient (Adagrad coalesces it): the count must never reach the script's step (a first version raised
    # "Cannot access storage of SparseTensorImpl" in it); its dense temporaries are counted
    memory: dict = {}
    table = torch.nn.Parameter(torch.ones(1000, 16))
    optimizer = torch.optim.Adagrad([table], lr=0.1)
    meter = UpdateMemoryMeter(memory, 2, lambda: True, lambda what, fn, *a: fn(*a))
    meter.start()
    meter.cuda = False
    try:
        for _ in range(2):
            table.grad = torch.sparse_coo_tensor(torch.tensor([[1, 5, 1]]), torch.ones(3, 16), (1000, 16),
                                                 check_invariants=True)
            optimizer.step()
            assert _get_current_dispatch_mode() is None
    finally:
        meter.stop()
    assert memory.get("rss_update_transient_bytes", 0) >= 0 and meter.done


def test_a_script_profiler_start_that_raises_is_not_left_marked_on():
    """runtime/script_profiler.py's wrapper: a start the profiler refused (torch's "Profiler is already enabled",
    a bad log folder) raised into the script as before, but the script's profiler stayed marked on: dprorun's
    waited for its stop to the end of the job and every later iteration was set aside. A start refused while
    another of the script's is on takes nothing back."""
    from dprorun.runtime.script_profiler import _wrap

    class Profiler:
        refuse = False

        def start(self):
            if self.refuse:
                raise RuntimeError("Profiler is already enabled on this thread")

    session = ScriptProfilerSession()
    state = session.script_profiler

    def on(prof):
        if id(prof) not in state.open:
            state.open.add(id(prof))
            session.script_profiler_started()
            return True
        return False

    def off(prof):
        state.open.discard(id(prof))
        if not state.open:
            session.script_profiler_stopped()

    _wrap(session, Profiler, "start", on, off)
    first, refused = Profiler(), Profiler()
    refused.refuse = True
    with pytest.raises(RuntimeError, match="already enabled"):
        refused.start()
    assert not state.on and session.calls == ["started", "stopped"]
    first.start()
    assert state.on
    with pytest.raises(RuntimeError, match="already enabled"):
        Profiler.start(refused)
    assert state.open == {id(first)}  # the one that did start is still on
    with pytest.raises(RuntimeError):  # the same profiler started again, refused: it was on before, it stays on
        first.refuse = True
        first.start()
    assert state.open == {id(first)}


def test_the_hook_bytes_meter_counts_the_hooks_collectives_and_not_the_scripts():
    """runtime/hook_bytes.py: a collective inside the comm hook and one in its future's callback (on the thread
    that completes the future, as PowerSGD's second and third all-reduce) count; the script's own all-reduce on the
    main thread while the bucket is in flight does not. The window's end prices the hooked buckets with the
    measured ratio; a hook whose collectives were never seen leaves them at the gradients' size, said."""
    import threading

    import torch

    from dprorun.runtime.hook_bytes import HookBytesMeter

    class Session:
        iteration = 4

        def __init__(self):
            self.script_use = type("Use", (), {"listeners": []})()
            self.records = type("Records", (), {"warnings": []})()

    session = Session()
    meter = HookBytesMeter(session, lambda: True)
    meter.start()
    assert session.script_use.listeners == [meter.observe]
    first = torch.futures.Future()

    def hook(state, bucket):
        meter.observe("all_reduce", (torch.zeros(100),), {})  # 400 bytes, in the hook
        return first.then(lambda fut: meter.observe("all_reduce", (), {"tensor": torch.zeros(10)}) or fut.value())

    future = meter.call_hook(hook, None, None)
    meter.observe("all_reduce", (torch.zeros(1000),), {})  # the script's loss, main thread: not the hook's
    completer = threading.Thread(target=first.set_result, args=(1,))
    completer.start()
    completer.join()
    future.wait()
    assert meter.bytes_by_iteration == {4: 440} and meter.in_flight == 0
    buckets = {(0, 0): {"nbytes": 2200}, (0, 1): {"nbytes": 2200}, (1, 0): {"nbytes": 80}}
    meter.finish(buckets, {0: "powerSGD_hook"})
    assert buckets[(0, 0)] == {"nbytes": 220, "buffer_nbytes": 2200, "wire_measured": 0.1}
    assert buckets[(1, 0)] == {"nbytes": 80} and session.script_use.listeners == []
    silent = HookBytesMeter(session, lambda: True)
    buckets = {(0, 0): {"nbytes": 2200}}
    silent.finish(buckets, {0: "my_cpp_hook"})
    assert buckets == {(0, 0): {"nbytes": 2200}} and "my_cpp_hook" in session.records.warnings[0]


def test_activation_meter_leaves_out_the_weights_a_layer_saves():
    """A Linear saves its weight for the backward; that storage is held anyway (parameters), so only the input and
    the ReLU's output (which the second Linear saves too: one storage) count as the forward's activations, with the
    frozen layer's weight and a buffer left out as well."""
    import torch

    from dprorun.runtime.activations import SavedTensorMeter

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128))
    model[2].weight.requires_grad_(False)
    model.register_buffer("scale", torch.ones(128))
    inputs = torch.randn(8, 64, requires_grad=True)
    meter = SavedTensorMeter.for_module(model)
    meter.start()
    hidden = torch.relu(model[0](inputs))
    output = model[2](hidden) * model.scale
    saved = meter.stop()
    assert output.requires_grad and saved == inputs.nbytes + hidden.nbytes  # 2,048 + 8,192 bytes
    plain = SavedTensorMeter()  # without the module: the first Linear's weight (64 KiB) and the buffer count too
    plain.start()
    torch.relu(model[0](inputs))
    assert plain.stop() > inputs.nbytes + model[0].weight.nbytes


def test_optimizers_stepped_one_after_another_make_one_update_phase():
    """graph/local.phase_spans: a recommendation model with SparseAdam for its table and AdamW for the rest
    (benchmarks/shapes/ddp_session36.py --two-optimizers) records two update spans after the backward; the phase
    was the last one's (1.05 ms), the first read as DDP's finalize (both: 2.89 ms, the summary's union 2.77). A
    GAN's first update, before the second model's backward, is no part of it."""
    from dprorun.graph.local import phase_spans
    from dprorun.trace.model import Op, OpKind

    def span(kind, start, end):
        return Op(name=kind.value, kind=kind, rank=0, start_us=start, end_us=end)

    spans = {OpKind.FW: [span(OpKind.FW, 0, 10)], OpKind.BW: [span(OpKind.BW, 12, 30)],
             OpKind.UPDATE: [span(OpKind.UPDATE, 31, 33), span(OpKind.UPDATE, 33.5, 36)]}
    first, fw, bw, up = phase_spans(spans)
    assert (up.start_us, up.end_us) == (31, 36)
    gan = {OpKind.FW: [span(OpKind.FW, 0, 10), span(OpKind.FW, 20, 28)],
           OpKind.BW: [span(OpKind.BW, 10, 15), span(OpKind.BW, 28, 40)],
           OpKind.UPDATE: [span(OpKind.UPDATE, 15, 18), span(OpKind.UPDATE, 41, 44)]}
    assert (phase_spans(gan)[3].start_us, phase_spans(gan)[3].end_us) == (41, 44)


def test_calls_taking_turns_in_a_step_make_one_iteration():
    """runtime/turns.StepTurns: a GAN's discriminator and generator, each trained and synchronised on its own, took
    an iteration each. Where a call's start is the boundary (TensorFlow's step functions; the first call of each
    traces it, counted as a call, 't'), an iteration begins at the first call of a run of the first key; where its
    end is (Horovod's optimizers), it ends with the key that closed the turn before. One key alone, a WGAN's 3
    critic calls, a new key after the turns (another model: each call its own again), turns that stop (a key
    called 16 times over), and two models fitted 10 steps each in turn (no step's turns)."""
    from dprorun.runtime.turns import StepTurns

    def starts(keys, traced=()):
        turns, out = StepTurns(), ""
        for j, key in enumerate(keys):
            if j in traced:
                turns.called(key, False)
                out += "t"
                continue
            began = turns.begins(key)
            turns.called(key, began)
            out += "|" if began else "."
        return out

    def ends(keys):
        turns = StepTurns()
        return "".join("|" if turns.ends_with(key) else "." for key in keys)

    assert starts([1, 2] * 4, traced=(0, 1)) == "tt|.|.|."
    assert starts([1, 1, 1, 2] * 3, traced=(0, 3)) == "t||t|...|..."
    assert starts([1] * 5, traced=(0,)) == "t||||"
    assert starts([1, 2, 1, 2, 3, 3]) == "|||.||"
    assert starts([1, 2, 1, 2] + [2] * 20) == "|||" + "." * 15 + "|" * 6
    assert "." not in starts(([1] * 10 + [2] * 10) * 2)
    assert ends([1, 2] * 4) == "||.|.|.|"
    assert ends([1, 1, 2] * 3) == "|||..|..|"
    assert ends([1] * 4) == "||||"


def test_horovods_trained_model_is_the_outermost_module_holding_the_optimizers_parameters():
    """runtime/horovod.trained_roots: Horovod wraps the optimizer, not the model; the modules a validation pass is
    counted on are the outermost ones holding the optimizer's parameters: a wrapper holding the model (not the model
    inside it, nor its layers), not a frozen teacher, and each trained model of two."""
    import torch
    import torch.nn as nn

    from dprorun.runtime.horovod import trained_roots

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    wrapper, teacher, other = Wrapper(), nn.Linear(4, 2), nn.Linear(2, 2)
    optimizer = torch.optim.SGD([*wrapper.parameters(), *other.parameters()], lr=0.1)
    roots = trained_roots(optimizer)
    assert sorted(map(id, roots)) == sorted([id(wrapper), id(other)]) and teacher not in roots


def test_iterations_with_a_validation_pass_are_set_aside_and_on_mxnet_the_one_after():
    """trace/rundir.inference_set_aside: forward passes that train nothing counted per iteration by the hooks. MXNet,
    a validation pass every 10 iterations: that iteration and the next set aside (the pass drained the engine); a
    teacher's forward every iteration, with a validation on top every 10th: only the extra ones; a pass every 3rd
    iteration (more than one in four): part of the job's cadence, nothing set aside; a pass before the first
    iteration (-1) is none of them. PyTorch: the validation iterations alone."""
    from dprorun.trace.rundir import inference_cadence_warning, inference_set_aside

    def events(passes: dict, iterations: int = 30, framework: str = "mxnet") -> dict:
        return {"iteration_starts_us": [1000.0 * i for i in range(iterations + 1)],
                "inference_passes": sorted(passes.items()), "trackers": [{"framework": framework}]}

    assert inference_set_aside(events({9: 4, 19: 4, 29: 4, -1: 4})) == {9, 10, 19, 20, 29}
    teacher = {i: 1 for i in range(30)}
    assert inference_set_aside(events({**teacher, 9: 5, 19: 5})) == {9, 10, 19, 20}
    assert inference_set_aside(events(teacher)) == set()
    every_third = events({i: 4 for i in range(2, 30, 3)})
    assert inference_set_aside(every_third) == set()
    assert inference_cadence_warning(every_third).startswith("forward passes that train nothing (a validation pass) "
                                                             "in 10 of 30 iterations, more than one in four")
    assert inference_cadence_warning(events({9: 4, 19: 4})) == ""
    assert inference_set_aside(events({9: 4, 19: 4}, framework="torch")) == {9, 19}
    assert inference_set_aside({"iteration_starts_us": [0.0, 1.0], "trackers": [{"framework": "torch"}]}) == set()


def test_a_rank_that_is_no_torch_job_never_loads_torch_for_its_files(tmp_path):
    """The rank files name the frameworks the job imported; reading torch's version loaded torch into TensorFlow
    workers (at their exit when the job ended inside the window: torch.library's finalizers then failed)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "hooks"), REPO]), DPRO_ENABLED="1",
               RANK="0", DPRO_RUN_DIR=str(tmp_path / "run"))
    code = ("import json, sys; from dprorun.runtime.bootstrap import session; from dprorun.runtime import rank_files; "
            "s = session(); s.iteration = 7; s.at_exit(); "
            "print(json.dumps([rank_files.versions(), 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    found, torch_loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert not torch_loaded and "torch" not in found and set(found) == {"python", "dprorun"}
    assert "Exception ignored" not in out.stderr
    code = "import torch; from dprorun.runtime.rank_files import versions; print(versions()['torch'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1].startswith("2.")


def test_a_rank_that_raises_leaves_its_stack_in_torchelastics_error_file(tmp_path):
    """The hooks' excepthook writes the rank's error file: through torch's ErrorHandler the stack read
    sys.exc_info(), empty in an excepthook ("NoneType: None"), and its initialize() warned "Unable to enable fault
    handler" under a script whose main() is torch.distributed.elastic's @record."""
    error_file = tmp_path / "error.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "hooks"), REPO]), DPRO_ENABLED="1",
               RANK="0", DPRO_RUN_DIR=str(tmp_path / "run"), TORCHELASTIC_ERROR_FILE=str(error_file))
    script = tmp_path / "train.py"
    script.write_text("from dprorun.runtime.bootstrap import session\nsession()\n\n\ndef load_batch():\n"
                      "    raise ValueError('bad batch 17')\n\n\nload_batch()\n")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert out.returncode == 1 and "ValueError: bad batch 17" in out.stderr
    assert "fault handler" not in out.stderr
    assert "nothing to profile" not in out.stderr  # its error says why, not a guess at the script's wrappers
    message = json.loads(error_file.read_text())["message"]
    assert message["message"] == "ValueError: bad batch 17"
    assert "in load_batch" in message["extraInfo"]["py_callstack"]


def test_a_ddp_iteration_begins_after_an_optimizer_step_or_as_before_without_steps():
    """DDP's iteration boundary (runtime/ddp.DDPTracker._starts_iteration): once the job steps a torch optimizer,
    the first training forward after a step (two views, micro-batches without no_sync: one iteration a step);
    without steps, at a forward after a synchronised one; and after 64 synchronised forwards without a step (a
    script that stepped an optimizer once, then updates by hand), again so: its iterations never stop."""
    from types import SimpleNamespace

    from dprorun.runtime.ddp import MAX_SYNCED_FORWARDS_A_STEP, DDPTracker

    def starts(steps, at, synced, prev_synced=True):
        leading = SimpleNamespace(leading_steps=steps)
        tracker = SimpleNamespace(session=SimpleNamespace(optimizer_steps=leading), steps_at_iteration=at,
                                  synced_forwards=synced, prev_forward_synced=prev_synced)
        return DDPTracker._starts_iteration(tracker)

    assert starts(0, -1, 3) and not starts(0, -1, 3, prev_synced=False)  # no step yet: as before
    assert starts(5, 4, 1) and not starts(5, 5, 1)  # a step since the iteration began, or not
    assert not starts(5, 5, 1, prev_synced=True)  # the second view / micro-batch: the same iteration
    assert starts(5, 5, MAX_SYNCED_FORWARDS_A_STEP) and not starts(5, 5, MAX_SYNCED_FORWARDS_A_STEP, False)


def test_the_iterations_are_the_steps_of_the_most_stepped_optimizer():
    """runtime/steps.LeadingOptimizerSteps: a WGAN's critic stepped every loop and its generator every 5th (the
    generator's steps were iterations of their own: 48 for 40 critic steps); two optimizers stepped once a loop
    each (one iteration a loop); a rare optimizer stepped first; an optimizer replaced by a new one."""
    from dprorun.runtime.steps import STALE_LEADER_STEPS, LeadingOptimizerSteps

    def leading(pattern):
        steps = LeadingOptimizerSteps()
        return "".join("L" if steps.step(ord(name)) else "." for name in pattern), steps

    gan = "D" * 4 + "DG" + ("D" * 4 + "DG") * 7
    marks, steps = leading(gan)
    assert marks.count("L") == 40 == gan.count("D") and all(m == "L" for m, n in zip(marks, gan) if n == "D")
    assert steps.total == 48 and steps.leading_steps == 40
    assert leading("ABCDE" * 10)[0] == "L...." * 10  # per-module optimizers, one step each a loop
    assert leading("GD" + "D" * 4 + "GD" + "D" * 4)[0] == "L.LLLL.LLLLL"  # the rare one stepped first: one loop off
    marks, steps = leading("A" * 20 + "B" * 10)  # A replaced by B: B leads from its STALE_LEADER_STEPS-th step
    assert marks == "L" * 20 + "." * (STALE_LEADER_STEPS - 1) + "L" * (11 - STALE_LEADER_STEPS)
    assert steps.leading_steps == 20 + 11 - STALE_LEADER_STEPS
    steps.new_lead()  # the job trains another DDP model: its optimizer's first step leads
    assert steps.step(ord("C")) and not steps.step(ord("B")) and steps.step(ord("C"))


PENDING_SIGTERM_FORK_SCRIPT = """
import os, signal, sys, threading, time
from types import SimpleNamespace
from dprorun.runtime import bootstrap

marker = sys.argv[1]
sess = SimpleNamespace(pid=os.getpid(), records=SimpleNamespace(warnings=[]),
                       at_exit=lambda: open(marker + ".kept", "w").close())
# every thread blocks SIGTERM: it stays pending in the kernel, as while the main thread sleeps in an fsync
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
signal.signal(signal.SIGTERM, lambda *args: None)
bootstrap._sigterm_watcher(sess)


def fork_in_a_thread():  # a DataLoader pool's handler thread replacing its processes, killed with the group
    pid = os.fork()
    if pid == 0:
        open(marker + ".forked", "w").close()
        os._exit(0)
    os.waitpid(pid, 0)


os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=fork_in_a_thread, daemon=True).start()
time.sleep(0.5)
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])  # the main thread takes the signal now
time.sleep(10)
sys.exit(3)
"""


def test_a_fork_waits_while_a_sigterm_is_pending_in_the_kernel(tmp_path):
    """The MXNet worker's fork hook (runtime/bootstrap._sigterm_watcher): a SIGTERM no thread has taken yet (the
    main thread in uninterruptible sleep, an fsync: the kernel gave it the signal) let a loader's thread fork into
    MXNet's prepare-fork wait for a pull that never ends, with the GIL held: the worker was SIGKILLed 30 s later
    and its last records lost. The fork now waits; the watcher keeps the records and the worker leaves (143)."""
    marker = str(tmp_path / "marker")
    proc = subprocess.run([sys.executable, "-c", PENDING_SIGTERM_FORK_SCRIPT, marker], cwd=REPO, timeout=60,
                          capture_output=True, text=True)
    assert proc.returncode == 128 + 15, proc.stderr
    assert os.path.exists(marker + ".kept") and not os.path.exists(marker + ".forked")


def test_torchscript_modules_take_no_hooks_and_lose_no_profile():
    """A DDP (or Horovod) model built from torch.jit.script'ed layers: registering the module-scope hooks raised
    "register_forward_pre_hook is not supported on ScriptModules" and disabled the whole profile (no replay); Horovod's
    validation-pass hook on the trained model raised the same inside the step hook. Scripted modules are skipped."""
    from types import SimpleNamespace

    import torch
    import torch.nn as nn

    from dprorun.runtime.horovod import HorovodTracker
    from dprorun.runtime.scopes import add_module_scopes

    model = nn.Sequential(nn.Linear(4, 8), torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.ReLU())),
                          nn.Linear(8, 2))
    handles = add_module_scopes(model)
    assert len(handles) == 2 * 2  # the two plain layers: a pre and a post hook each
    model(torch.randn(3, 4))
    for handle in handles:
        handle.remove()
    scripted = torch.jit.script(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    optimizer = torch.optim.SGD(scripted.parameters(), lr=0.1)
    tracker = SimpleNamespace(watched_optimizers=set(), hooked_models=set(), _pre_forward=None,
                              session=SimpleNamespace(records=SimpleNamespace(warnings=[])))
    HorovodTracker.watch_inference(tracker, optimizer)
    assert "takes no forward hook" in tracker.session.records.warnings[0]


def test_a_forward_returning_a_dataclass_has_its_backward_seen():
    """A DDP model returning a dataclass (Output(logits=..., features=...)), which DDP searches for tensors itself:
    the hooks found no output tensor to time the backward from, and the job had no replay ("no profiled iteration
    has forward, backward and update spans")."""
    import dataclasses

    import torch

    from dprorun.runtime.outputs import tensors_requiring_grad

    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor
        extra: dict
        step: int = 0

    w = torch.ones(2, requires_grad=True)
    found: list = []
    tensors_requiring_grad(Output(w * 2, {"aux": [w * 3, torch.zeros(1)]}), found)
    assert len(found) == 2
    tensors_requiring_grad(Output, found)  # the class itself is no output
    assert len(found) == 2

    class Plain:  # an output class of the script's own
        def __init__(self, logits):
            self.logits, self.name = logits, "out"

    tensors_requiring_grad(Plain(w * 4), found)
    assert len(found) == 3
    tensors_requiring_grad(torch.nn.Linear(2, 2), found)  # a module's parameters are no output
    assert len(found) == 3


def test_a_horovod_script_that_shares_no_gradients_is_told_why_nothing_was_profiled():
    """horovod.torch initialised, no hvd.DistributedOptimizer, and no step after calls carrying the gradients (each
    rank trained apart, or a loss averaged alone): the warning said "the training wrapper was built, but no step ran
    through it". (The Horovod tracker joins the session only with a DistributedOptimizer; gradients shared by
    horovod.torch's own calls join the tracker of the script's collectives: tests/test_horovod.py.)"""
    from dprorun.runtime.watch import ScriptUse, nothing_to_profile

    message = nothing_to_profile(ScriptUse(horovod_initialised=True))
    assert "no hvd.DistributedOptimizer was built" in message and "grouped_allreduce" in message
    assert "no hvd.DistributedOptimizer" not in nothing_to_profile(ScriptUse())


def test_gradients_averaged_by_torchs_functional_collectives_are_named_when_nothing_was_profiled(monkeypatch):
    """A script averaging its gradients with torch.distributed._functional_collectives.all_reduce (no DDP) ran
    unprofiled, told only of the broadcasts it also made (benchmarks/shapes/ddp_session52.py --funcol). The
    script's own functional calls are counted now (not those of torch's modules, DTensor's) and named with the
    profiled alternatives."""
    import sys
    import types

    from dprorun.runtime import watch

    fake = types.ModuleType(watch.FUNCTIONAL_MODULE)
    fake.all_reduce = lambda tensor, op, group: ("reduced", tensor)
    monkeypatch.setitem(sys.modules, watch.FUNCTIONAL_MODULE, fake)
    use = watch.ScriptUse()
    watch.watch_functional_collectives(use)
    watch.watch_functional_collectives(use)  # once only
    assert fake.all_reduce("g", "sum", None) == ("reduced", "g")
    torch_module = {"__name__": "torch.distributed.tensor._redistribute", "funcol": fake}
    exec("def redistribute(t):\n    return funcol.all_reduce(t, 'sum', None)", torch_module)
    torch_module["redistribute"]("d")
    assert use.collectives == {"_functional_collectives.all_reduce": 1}
    message = watch.nothing_to_profile(use)
    assert "torch.distributed._functional_collectives.all_reduce x1" in message
    assert "functional collectives (torch.distributed._functional_collectives: a tensor returned" in message
    # gradients all-reduced by hand after each backward, then an update by hand: no optimizer step to close them
    by_hand = watch.ScriptUse(collectives={"all_reduce": 840}, gradient_calls_after_backward=840)
    assert "called 840 of them after its backward passes, and no torch.optim optimizer ever stepped" in \
        watch.nothing_to_profile(by_hand)
    by_hand.steps_after_gradient_calls = 3  # a loss all-reduced for logging in a job that steps: the general words
    assert "these collectives were not that" in watch.nothing_to_profile(by_hand)


def test_an_mxnet_job_on_a_local_kvstore_is_told_its_workers_trained_apart(tmp_path):
    """A Gluon job under --backend mxnet whose Trainer used kvstore 'local': each worker trained on its own and
    nothing reached the servers; the replay's refusal said only "this one made none on a dist kvstore"."""
    from types import SimpleNamespace

    from dprorun.fsutil import TraceError
    from dprorun.replay.ps_model import build_ps_model
    from dprorun.runtime.mxnet import MXTracker

    tracker = SimpleNamespace(local_kvstores=[], _kvstore=None)
    MXTracker.kvstore_created(tracker, SimpleNamespace(type="local"))
    MXTracker.kvstore_created(tracker, SimpleNamespace(type="local"))
    assert tracker.local_kvstores == ["local"] and tracker._kvstore is None
    (tmp_path / "rank_0").mkdir()
    (tmp_path / "rank_0" / "events.json").write_text(json.dumps({
        "rank": 0, "iteration_starts_us": [0.0, 9_000.0, 18_000.0],
        "trackers": [{"framework": "mxnet", "kvstore": "", "local_kvstores": ["local"], "keys": []}]}))
    with pytest.raises(TraceError, match="its kvstore was 'local': each worker trained on its own"):
        build_ps_model(str(tmp_path))


def test_a_torchrun_script_under_horovodrun_is_told_the_launch_that_fits(monkeypatch, capsys):
    """`dprorun --backend horovod` of a torchrun script: horovodrun sets HOROVOD_RANK, not RANK, and torch raised
    "environment variable RANK expected" with no word of why; the hooks say it before the call."""
    from dprorun.runtime.watch import _warn_torchrun_script_under_horovodrun

    monkeypatch.setenv("HOROVOD_RANK", "0")
    monkeypatch.delenv("RANK", raising=False)
    _warn_torchrun_script_under_horovodrun(None, {"backend": "gloo"})
    assert "run it as under torchrun, `dprorun -np N python <script>`" in capsys.readouterr().err
    _warn_torchrun_script_under_horovodrun("tcp://10.0.0.1:1234", {"rank": 0, "world_size": 2})  # its own ranks
    monkeypatch.setenv("RANK", "0")
    _warn_torchrun_script_under_horovodrun(None, {})
    assert capsys.readouterr().err == ""


def test_a_script_of_another_framework_under_the_default_backend_is_told_its_backend(monkeypatch):
    """`dprorun -np 2 python tf_script.py` (no --backend tf): each worker ran MultiWorkerMirroredStrategy alone (no
    TF_CONFIG) and was told only "no distributed training was seen"; now the launch that fits is named. A torch job
    that also loaded TensorFlow (TensorBoard does) keeps the torch advice."""
    import sys
    import types

    from dprorun.runtime.watch import ScriptUse, nothing_to_profile

    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delitem(sys.modules, "horovod.tensorflow", raising=False)  # earlier tests of the suite import it
    monkeypatch.setitem(sys.modules, "tensorflow", types.ModuleType("tensorflow"))
    assert "`dprorun --backend tf -np N ...`" in nothing_to_profile(ScriptUse())
    torch_job = ScriptUse(collectives={"all_reduce": 4}, process_group="a gloo process group of 2 ranks")
    assert "--backend tf" not in nothing_to_profile(torch_job)
    monkeypatch.setenv("DPRO_BACKEND", "tf")  # a DDP script launched with --backend tf: told "no wrapper" before
    assert "trains with torch.distributed, which --backend tf does not profile" in nothing_to_profile(torch_job)
    monkeypatch.setenv("DPRO_BACKEND", "ddp")
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", types.ModuleType("horovod.tensorflow"))
    monkeypatch.delenv("HOROVOD_RANK", raising=False)
    assert "`dprorun --backend horovod -np N ...`" in nothing_to_profile(ScriptUse())


def test_a_rank_that_cannot_import_its_framework_is_told_what_fits():
    """An MXNet script under the default backend failed with "No module named 'mxnet'" alone (MXNet lives in an
    environment of its own that --backend mxnet finds); a missing Horovod or TensorFlow names its installer."""
    from dprorun.launch import missing_module_hint

    assert "--backend mxnet" in missing_module_hint("ModuleNotFoundError: No module named 'mxnet'", "ddp")
    assert "scripts/install-horovod" in missing_module_hint("ModuleNotFoundError: No module named 'horovod.torch'",
                                                            "horovod")
    assert missing_module_hint("ValueError: bad input", "ddp") == ""


def test_a_rank_that_ran_another_python_than_dprorun_is_told_so(tmp_path):
    """`/venv/bin/dprorun -np 2 python train.py` with the venv not activated: the ranks' `python` came from PATH, a
    Python without torch, and the job ended on "No module named 'torch'" with no word of which Python ran."""
    from dprorun.launch import missing_module_hint

    other = tmp_path / "python"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    missing = "ModuleNotFoundError: No module named 'torch'"
    assert f"the ranks ran {other}, another Python than dprorun's" in missing_module_hint(missing, "ddp", [str(other)])
    assert missing_module_hint(missing, "ddp", [sys.executable]) == ""
    # a module this Python lacks too is the script's own matter (a shim on PATH is no evidence of another Python)
    assert missing_module_hint("No module named 'no_such_module_xyz.sub'", "ddp", [str(other)]) == ""
    assert "scripts/install-tf" in missing_module_hint("No module named 'tensorflow'", "tf", [sys.executable])


def test_what_ifs_and_windows_out_of_range_are_refused_at_the_command_line(capsys):
    """`dpro replay --np -2` printed "predicted iteration time: 0.000 ms (-2 ranks)", `--bucket-mb -3` built
    "buckets of up to -3 MB", `--np 0` replayed the job as run; dprorun's `--active 0` launched the job and every rank
    then ran unprofiled. Each is a usage error now, naming the flag."""
    from dprorun import cli, offline_cli

    replay = offline_cli.build_parser()
    for flags, said in ((["--np", "-2"], "--np: -2: must be at least 1"), (["--np", "0"], "must be at least 1"),
                        (["--bucket-mb", "-3"], "--bucket-mb: -3: must be above 0"),
                        (["--bandwidth", "0Gbit"], "must be above 0"), (["--partitions", "0"], "--partitions")):
        with pytest.raises(SystemExit):
            replay.parse_args(["replay", "RUN", *flags])
        assert said in capsys.readouterr().err
    assert replay.parse_args(["replay", "RUN", "--np", "4", "--bucket-mb", "0.5"]).np == 4
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--timeout", "-5", "train.py"])
    assert "--timeout: -5: must be above 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="the profiling window needs"):
        cli.job_from_args(cli.build_parser().parse_args(["--active", "0", "train.py"]))


def test_a_dry_run_says_what_the_ranks_saw():
    """--dry-run printed its prediction without the ranks' warnings: a Horovod job with 2 torch threads on 1 core a
    rank was predicted at 1,414 ms an iteration with no word of why (the summary of a profile run says it). The
    dry run prints them, the ranks that share one together."""
    from dprorun.summary import grouped_rank_warnings

    threads = "torch computes with 2 threads on 1 core(s) per rank: set OMP_NUM_THREADS"
    summary = {"ranks": [{"rank": 0, "warnings": [threads, "only rank 0's"]}, {"rank": 1, "warnings": [threads]}]}
    assert grouped_rank_warnings(summary) == [f"ranks [0, 1]: {threads}", "rank 0: only rank 0's"]


def test_a_hand_edited_strategy_out_of_range_or_misspelt_is_refused(tmp_path):
    """`--strategy` with bucket_cap_mb -5 was applied to DDP as it was ("applied": {"bucket_cap_mb": -5}), and a
    misspelt knob was dropped without a word; both are refused now, naming the knob."""
    from dprorun.fsutil import TraceError
    from dprorun.strategy import Strategy, load_strategy, save_strategy

    path = tmp_path / "s.json"
    save_strategy(Strategy(bucket_cap_mb=4.0, accumulation_steps=2), str(path))
    assert load_strategy(str(path)).bucket_cap_mb == 4.0
    doc = json.loads(path.read_text())
    for change, said in (({"bucket_cap_mb": -5}, "bucket_cap_mb -5: must be above 0"),
                         ({"accumulation_steps": 0}, "accumulation_steps 0: must be at least 1"),
                         ({"bucket_cap": 8}, "unknown setting(s) 'bucket_cap'")):
        path.write_text(json.dumps({**doc, **change}))
        with pytest.raises(TraceError, match=re.escape(said)):
            load_strategy(str(path))


def test_an_engine_deaf_to_the_forwarded_signal_is_stopped_with_everything_under_it(monkeypatch):
    """horovodrun took neither SIGTERM nor SIGINT while a rank sat in Horovod's shutdown (a dprorun job under
    `timeout 200` ran past 10 minutes). An engine still there ENGINE_STOP_GRACE_S after the forwarded signal is
    stopped with every process under it: here a shell ignoring both (its child inherits that) under --timeout 1."""
    import time

    import psutil

    from dprorun import procs

    monkeypatch.setattr(procs, "ENGINE_STOP_GRACE_S", 1.0)
    started = time.monotonic()
    # a duration no other process on the machine uses (a plain `sleep 120` elsewhere was once taken for its child)
    code, signum, timed_out = procs.call_forwarding_signals(
        ["bash", "-c", "trap '' TERM INT; sleep 119.73 & wait; sleep 119.73"], dict(os.environ), timeout_s=1.0)
    assert timed_out and signum is not None and code != 0
    assert time.monotonic() - started < 20
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "119.73"]]


def test_a_missing_training_script_is_said_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    """`dprorun -np 2 python missing.py`: each rank's python said "can't open file" and exited 2, each rank's hooks
    "nothing to profile", and dprorun's own line named no cause; now one line before the launch, exit 2, no run
    directory. Interpreter options are stepped over; -m, -c and other programs are left to run."""
    from dprorun import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["-np", "2", "python", "-u", "-X", "dev", "missing.py", "--lr", "1"]) == 2
    err = capsys.readouterr().err
    assert "the training script 'missing.py' does not exist" in err and not (tmp_path / "dpro_runs").exists()
    (tmp_path / "train.py").write_text("")
    for command in (["python", "train.py"], ["python", "-m", "pkg.train"], ["python", "-c", "pass"],
                    ["./run.sh"], ["python3.11", "-W", "ignore", "train.py"]):
        cli._check_script_exists(command)  # no error


def test_a_torch_distributed_launch_line_reads_as_torchruns_with_the_local_rank_argument():
    """torch.distributed.launch: torchrun's flags, and `--local-rank=${local_rank}` (torch elastic's macro, filled in
    per rank) after the script or the module unless --use-env; --no-python needs --use-env, as the launcher says."""
    import sys as system

    from dprorun.cli import _nested_launcher, torch_launch_argv

    assert _nested_launcher(["python", "-m", "torch.distributed.launch", "t.py"]) == \
        ("torch.distributed.launch", ["t.py"])
    assert torch_launch_argv(["--nproc_per_node=2", "t.py", "--lr", "1"]) == \
        ["--nproc_per_node=2", "--", system.executable, "t.py", "--local-rank=${local_rank}", "--lr", "1"]
    assert torch_launch_argv(["--nproc_per_node=2", "--use_env", "t.py", "--lr", "1"]) == \
        ["--nproc_per_node=2", "--", system.executable, "t.py", "--lr", "1"]
    assert torch_launch_argv(["-m", "pkg.t", "--x"]) == ["-m", "--", "pkg.t", "--local-rank=${local_rank}", "--x"]
    with pytest.raises(ValueError, match="--no-python needs --use-env"):
        torch_launch_argv(["--no-python", "./run.sh"])
    assert torch_launch_argv(["--no_python", "--use-env", "./run.sh"]) == ["--", "./run.sh"]


def test_a_fabric_run_line_reads_as_dprorun_s():
    """Lightning Fabric's `fabric run` (and `lightning run model`): --devices per node into -np (a count, or auto:
    one on CPU), nodes and the main address only across nodes, the LT_* variables Fabric() reads; DataParallel,
    DeepSpeed and FSDP strategies refused."""
    import sys as system

    from dprorun.cli import _nested_launcher
    from dprorun.launch_lines import fabric_run_argv

    assert _nested_launcher(["fabric", "run", "--devices", "2", "t.py"]) == ("fabric", ["--devices", "2", "t.py"])
    assert _nested_launcher(["lightning", "run", "model", "t.py"]) == ("fabric", ["t.py"])
    assert _nested_launcher(["fabric", "consolidate", "ckpt"]) == ("", [])
    assert _nested_launcher(["deepspeed", "--num_gpus", "2", "t.py"])[0] == "deepspeed"  # refused with the launch
    assert _nested_launcher(["mpiexec", "-n", "2", "python", "t.py"])[0] == "mpiexec"  # that fits (cli.main)
    argv, env = fabric_run_argv(["--accelerator", "cpu", "--devices", "2", "--precision", "bf16-mixed", "t.py",
                                 "--lr", "1"])
    assert argv == ["--nproc-per-node", "2", "--", system.executable, "t.py", "--lr", "1"]
    assert env == {"LT_CLI_USED": "1", "LT_DEVICES": "2", "LT_NUM_NODES": "1", "LT_ACCELERATOR": "cpu",
                   "LT_PRECISION": "bf16-mixed"}
    argv, _ = fabric_run_argv(["--accelerator", "cpu", "--devices", "auto", "--num_nodes", "2", "--node_rank", "1",
                               "--main-address", "10.0.0.1", "t.py"])
    assert argv == ["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                    "--master-port", "29400", "--", system.executable, "t.py"]
    for strategy in ("dp", "deepspeed_stage_2", "fsdp"):
        with pytest.raises(SystemExit):
            fabric_run_argv(["--strategy", strategy, "t.py"])
    assert fabric_run_argv(["--strategy", "ddp_find_unused_parameters_true", "t.py"])[1]["LT_STRATEGY"] == \
        "ddp_find_unused_parameters_true"


def test_accelerate_launch_lines_and_configs_read_as_dprorun_s(tmp_path, monkeypatch, capsys):
    """accelerate launch's flags over its config file's settings, as accelerate reads them: --num_processes is the
    job's total over --num_machines; mixed precision and dynamo reach the script in its launcher's variables; FSDP /
    DeepSpeed configs and uneven process counts are refused with why."""
    import sys as system

    from dprorun.cli import _nested_launcher
    from dprorun.launch_lines import accelerate_launch_argv

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no default config here
    assert _nested_launcher(["accelerate", "launch", "t.py"]) == ("accelerate", ["t.py"])
    assert _nested_launcher(["accelerate-launch", "--cpu", "t.py"]) == ("accelerate", ["--cpu", "t.py"])
    assert _nested_launcher(["accelerate", "env"]) == ("", [])
    argv, env = accelerate_launch_argv(["--num-processes", "4", "--num_machines", "2", "--machine_rank", "1",
                                        "--main_process_ip", "10.0.0.1", "--main_process_port", "29501",
                                        "--mixed_precision", "bf16", "--multi_gpu", "t.py", "--lr", "1"])
    assert argv == ["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                    "--master-port", "29501", "--", system.executable, "t.py", "--lr", "1"]
    assert env == {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_CPU": "False",
                   "ACCELERATE_DYNAMO_BACKEND": "NO"}
    config = tmp_path / "c.yaml"
    config.write_text("distributed_type: MULTI_CPU\nnum_processes: 3\nmixed_precision: fp16\nuse_cpu: true\n"
                      "dynamo_config:\n  dynamo_backend: INDUCTOR\n  dynamo_mode: max-autotune\n")
    argv, env = accelerate_launch_argv(["--config_file", str(config), "--mixed_precision", "no", "-m", "pkg.t"])
    assert argv == ["--nproc-per-node", "3", "--", system.executable, "-m", "pkg.t"]
    assert env["ACCELERATE_MIXED_PRECISION"] == "no" and env["ACCELERATE_USE_CPU"] == "True"
    assert env["ACCELERATE_DYNAMO_BACKEND"] == "INDUCTOR" and env["ACCELERATE_DYNAMO_MODE"] == "max-autotune"
    (tmp_path / "hf" / "accelerate").mkdir(parents=True)
    (tmp_path / "hf" / "accelerate" / "default_config.yaml").write_text("distributed_type: DEEPSPEED\n")
    for line, said in ((["t.py"], "distributed_type DEEPSPEED"), (["--config_file", str(config), "--num_processes",
                                                                   "3", "--num_machines", "2", "t.py"],
                                                                  "a whole number of processes a machine"),
                       (["--config_file", str(config), "--rdzv_backend", "c10d", "t.py"], "--rdzv_backend")):
        with pytest.raises(SystemExit):
            accelerate_launch_argv(line)
        assert said in capsys.readouterr().err


def test_dprorun_s_own_flags_win_over_a_nested_launch_line_s():
    """`dprorun --dry-run -np 4 --local-np 2 accelerate launch --num_processes 2 train.py` predicted for 2 ranks: the
    launch line's count, read after dprorun's own flags, replaced -np. dprorun's own flags now come last."""
    from dprorun.cli import _own_flags_last, build_parser, job_from_args, torchrun_argv
    from dprorun.launch_lines import accelerate_launch_argv

    line = accelerate_launch_argv(["--num_processes", "2", "train.py", "--lr", "1"])[0]
    job = job_from_args(build_parser().parse_args(_own_flags_last(["--dry-run", "-np", "4", "--local-np", "2"], line)))
    assert (job.launch.world_size, job.predict.np, job.command[1:]) == (2, 4, ["train.py", "--lr", "1"])
    line = torchrun_argv(["--nproc_per_node=2", "train.py"])
    job = job_from_args(build_parser().parse_args(_own_flags_last(["-np", "3"], line)))
    assert job.launch.world_size == 3 and job.command[1:] == ["train.py"]


def test_a_scripts_own_arguments_are_never_read_as_the_launchers():
    """`dprorun -np 2 python train.py --horovod` was refused: argparse read the script's --horovod as an ambiguous
    abbreviation of dprorun's --horovod-timeline / --horovodrun-flag before the command took it (so --auto, --local,
    --log). The command's words are the script's under every launch line; dprorun's own options, abbreviated too,
    still read before it; an explicit `--` as before."""
    import sys as system

    from dprorun.argtypes import command_start, parse_launch_line
    from dprorun.cli import build_parser, job_from_args, main, torchrun_argv
    from dprorun.launch_lines import accelerate_launch_argv, horovodrun_argv

    own = ["--horovod", "--auto", "--local", "--log", "--clean", "3", "--json", "-h", "-np", "4", "--", "x"]
    parser = build_parser()
    for line in (["--warm", "2", "-np", "2", "python", "train.py", *own], ["--warmup=2", "-np", "2", "--", "python",
                                                                             "train.py", *own]):
        job = job_from_args(parse_launch_line(parser, line))
        assert (job.command, job.launch.world_size, job.profile.warmup) == (["python", "train.py", *own], 2, 2)
        assert job.profile.clean != 3 and not job.output.json_summary
    assert command_start(parser, ["-H", "a:1,b:1", "-q", "-m", "pkg.train", "--auto"]) == 4
    assert command_start(parser, ["-np", "2"]) is None
    assert torchrun_argv(["--nproc_per_node", "2", "t.py", *own]) == \
        ["--nproc_per_node", "2", "--", system.executable, "t.py", *own]
    assert horovodrun_argv(["-np", "2", "python", "t.py", *own])[0][-len(own) - 3:] == ["--", "python", "t.py", *own]
    assert accelerate_launch_argv(["--num_processes", "2", "t.py", *own])[0][-len(own) - 1:] == ["t.py", *own]
    with pytest.raises(SystemExit):  # dprorun's own options are still checked: an ambiguous one before the command
        main(["--auto", "python", "t.py"])


def test_a_modules_copy_and_its_torchscript_leave_the_hooks_own_hooks_out():
    """runtime/copies.py: a module carrying one of the hooks' forward hooks (marked by own_hook: a bound method
    wrapped) beside the script's own hook: copy.deepcopy, pickle and torch.jit.script see the script's hook alone;
    the original keeps both, in their order; a dict of the script's keyed by the same ints is copied whole."""
    import copy
    import operator
    import pickle

    import torch

    from dprorun.runtime.copies import own_hook

    class Counter:
        def __init__(self):
            self.calls, self.lock = 0, __import__("threading").Lock()  # a lock: unpicklable, as the session's

        def pre_forward(self, module, inputs):
            self.calls += 1

    counter, module = Counter(), torch.nn.Sequential(torch.nn.Linear(3, 2))
    ours = module.register_forward_pre_hook(own_hook(counter.pre_forward))
    module[0].register_forward_hook(own_hook(lambda m, i, o: None), always_call=True)
    scripts = module.register_forward_pre_hook(operator.is_)  # the script's own (picklable) hook
    module.table = {ours.id: "the script's", scripts.id: "values"}
    for made in (copy.deepcopy(module), pickle.loads(pickle.dumps(module, protocol=2))):
        assert list(made._forward_pre_hooks) == [scripts.id] and not made[0]._forward_hooks
        assert not made[0]._forward_hooks_always_called and made.table == module.table
    assert list(module._forward_pre_hooks) == [ours.id, scripts.id] and len(module[0]._forward_hooks) == 1
    module.pop(0)  # TorchScript compiles hooks: the script's would not compile either
    module.append(torch.nn.Linear(3, 2))
    scripts.remove()
    scripted = torch.jit.script(module)
    assert not scripted._forward_pre_hooks and list(module._forward_pre_hooks) == [ours.id]
    module(torch.randn(1, 3))
    assert counter.calls == 1


def test_a_buffer_all_reduced_by_hand_is_named_after_the_parameters_it_carries():
    """runtime/gradient_names.py: a call on a parameter's gradient is named after it (by address); a flat buffer
    after the run of not yet named parameters (model order) whose bytes add up to its own; a tensor no run fits (a
    loss) gets no name; a step's all-reduces that carry under half the optimizer's gradient bytes (a loss or a metric
    in a job whose ranks train apart) are no sharing of gradients. Inside the backward, a flat buffer of gradients
    not in .grad yet (a hook on the gradients themselves) is named by the backward's order of the parameters."""
    import torch

    from dprorun.runtime.collectives import SHARED_SHARE
    from dprorun.runtime.gradient_calls import gradient_bytes
    from dprorun.runtime.gradient_names import StepGradientNames

    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    net(torch.randn(5, 4)).sum().backward()
    names = StepGradientNames(net.named_parameters)
    names.read()
    assert names.names_sent(net[0].weight.grad, 48, inside=False) == ["0.weight"]
    flat = torch.cat([net[0].bias.grad, net[1].weight.grad.flatten()])
    assert names.names_sent(flat, flat.numel() * 4, inside=False) == ["0.bias", "1.weight"]
    assert names.names_sent(torch.zeros(1), 4, inside=False) == [] and names.unnamed == ["1.bias"]
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    assert gradient_bytes(optimizer) == sum(names.param_bytes.values()) == 92
    names.reset()
    net[1].bias.grad = None  # inside a backward: the last layer's bias is in .grad, its weight not yet
    net[1].weight.grad = net[0].weight.grad = net[0].bias.grad = None
    net[1].bias.grad = torch.zeros(2)
    names.read()
    assert names.names_sent(torch.zeros(8), 32, inside=True) == ["1.bias", "1.weight"]  # the last layer's flat
    assert names.names_sent(torch.zeros(15), 60, inside=True) == ["0.bias", "0.weight"] and not names.unnamed
    assert 4 < SHARED_SHARE * 92 <= flat.numel() * 4 + 48  # a loss is no sharing; the flat buffer and 0.weight are


def test_a_sharded_steps_collectives_cover_their_whole_tensors_and_price_as_half_an_all_reduce():
    """runtime/collectives.covered: a reduce-scatter covers its input (the list form's chunks, or the flat tensor),
    an all-gather its output, by position or keyword; replay/template.ring_bytes: each sends what an all-reduce of
    half those bytes sends on a ring ((N-1)/N of them per rank), an all-reduce its own."""
    import torch

    from dprorun.replay.template import ring_bytes
    from dprorun.runtime.gradient_calls import covered
    from dprorun.trace.model import Bucket

    flat, shard = torch.zeros(10), torch.zeros(5)
    assert covered("reduce_scatter", (shard, list(flat.chunk(2))), {})[1] == 40
    assert covered("reduce_scatter_tensor", (shard,), {"input": flat})[1] == 40
    assert covered("all_gather_into_tensor", (flat, shard), {})[1] == 40
    # torch 2.13's names for those two (the others its deprecated aliases), and every name the watch patches
    assert covered("reduce_scatter_single", (shard, flat), {})[1] == 40
    assert covered("all_gather_single", (), {"output_tensor": flat, "input_tensor": shard})[1] == 40
    from dprorun.runtime.gradient_calls import HOROVOD_KINDS, TORCH_KINDS
    from dprorun.runtime.watch import ASYNC_OP_POSITION, HOROVOD_COLLECTIVES, SCRIPT_COLLECTIVES

    assert set(TORCH_KINDS) <= set(SCRIPT_COLLECTIVES) & set(ASYNC_OP_POSITION)
    assert set(HOROVOD_KINDS) <= set(HOROVOD_COLLECTIVES)
    assert covered("all_gather", (), {"tensor_list": list(flat.chunk(2)), "tensor": shard})[1] == 40
    tensor, nbytes = covered("all_reduce", (shard,), {})
    assert tensor is shard and nbytes == 20
    assert covered("reduce_scatter", (shard,), {}) == (None, 0)  # no input given: nothing it covers
    assert ring_bytes(Bucket(0, 4000, ["reduce_scatter0"], collective="reduce_scatter")) == 2000
    assert ring_bytes(Bucket(1, 4000, ["all_gather1"], collective="all_gather")) == 2000
    assert ring_bytes(Bucket(2, 4000, ["0.weight"])) == 4000


def test_a_group_made_without_a_backend_is_read_as_its_devices_transport():
    """torch 2.13: init_process_group() without a backend is "undefined" to get_backend (chosen per device at the
    first collective), and "cpu:gloo,cuda:nccl" names the map: each read as the transport of the job's device (they
    were taken as neither gloo nor NCCL: a GPU job's calibration ran on the CPU)."""
    from dprorun.runtime.backends import backend_for, group_backend

    assert backend_for("gloo", "cuda") == "gloo" and backend_for("nccl", "cpu") == "nccl"
    assert backend_for("undefined", "cpu") == "gloo" and backend_for("undefined", "cuda") == "nccl"
    assert backend_for("cpu:gloo,cuda:nccl", "cuda") == "nccl" and backend_for("cpu:gloo", "cpu") == "gloo"
    assert backend_for("cpu:gloo", "cuda") == "cpu:gloo"  # no transport for that device: left as named
    assert group_backend() == "unknown"  # no process group in this process


def test_torchruns_agent_flags_reach_torch_elastic_and_torchrun_alike():
    """torch 2.13's torchrun agent flags, parsed by dprorun's parser (they were "unrecognized arguments"), become
    torch elastic's LaunchConfig fields (the default launcher) and torchrun flags that torchrun's own parser reads back
    to the same values (--launcher torchrun)."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig
    from torch.distributed.run import get_args_parser

    from dprorun.cli import build_parser
    from dprorun.launch import _agent_flags, _agent_settings
    from dprorun.torchrun_flags import agent_options

    args = build_parser().parse_args(["-np", "2", "--virtual-local-rank", "--duplicate-stdout-filters", "loss,acc",
                                      "--signals-to-handle", "SIGTERM,SIGUSR1", "--event-log-handler", "null",
                                      "--shutdown-timeout", "7", "python", "train.py"])
    agent = agent_options(args)
    settings = _agent_settings(agent)
    assert settings == {"virtual_local_rank": True, "duplicate_stdout_filters": ["loss", "acc"],
                        "signals_to_handle": "SIGTERM,SIGUSR1", "event_log_handler": "null", "shutdown_timeout": 7}
    assert set(settings) <= {f.name for f in dataclasses.fields(LaunchConfig)}
    torchrun = get_args_parser().parse_args(_agent_flags(agent) + ["--nproc-per-node", "2", "train.py"])
    assert (torchrun.virtual_local_rank, torchrun.duplicate_stdout_filters, torchrun.signals_to_handle,
            torchrun.event_log_handler, torchrun.shutdown_timeout) == (True, ["loss", "acc"], "SIGTERM,SIGUSR1",
                                                                      "null", 7)
    with pytest.raises(ValueError, match="does not launch through"):
        agent_options(build_parser().parse_args(["--backend", "horovod", "-np", "2", "--shutdown-timeout", "3",
                                                 "python", "train.py"]))


def test_activation_meter_keeps_a_scripts_own_saved_tensor_hooks_in_force():
    """A forward under the script's save_on_cpu (or hooks of its own): autograd calls only the innermost hook pair,
    so the meter's replaced the script's for the metered forward (its pack never called: a GPU job offloading to fit
    kept that forward's activations on the device). The meter now calls the script's pair and counts what it keeps
    on the tensor's device: here the pack's own copies, which the backward unpacks."""
    import torch

    from dprorun.runtime.activations import SavedTensorMeter

    calls = {"pack": 0, "unpack": 0}

    def pack(tensor):
        calls["pack"] += 1
        return ("copied", tensor.clone())

    def unpack(packed):
        calls["unpack"] += 1
        return packed[1]

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128))
    inputs = torch.randn(8, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        meter = SavedTensorMeter.for_module(model)
        meter.start()
        output = model(inputs)
        saved = meter.stop()
    packed = calls["pack"]
    output.sum().backward()
    assert packed >= 4 and calls["unpack"] == packed and inputs.grad is not None
    # the copies of the input, the hidden activations and the weights: the script's pack copied the weights too
    assert saved >= inputs.nbytes + 8 * 256 * 4
    with torch.autograd.graph.save_on_cpu():
        meter = SavedTensorMeter.for_module(model)
        meter.start()
        model(inputs).sum().backward()
        # on the CPU save_on_cpu keeps the tensors themselves: the input and the ReLU's output, as with no hooks
        assert meter.stop() == inputs.nbytes + 8 * 256 * 4


def test_a_script_read_from_standard_input_is_refused_where_ranks_would_share_it(tmp_path):
    """`dprorun -np 2 python - < train.py`: the ranks shared one standard input; each read a part of the script
    (a SyntaxError each) or one read all of it while the other ran an empty script and left, and the first waited
    for it in the rendezvous until the launch's timeout (a hang of 300 s here). Refused before anything starts;
    one rank may read it; a script given as a file, -c or -m behind Python's own options runs as before."""
    import pytest as pt

    from dprorun.argtypes import parse_launch_line
    from dprorun.cli import build_parser, job_from_args

    parser = build_parser()
    for command in (["python", "-"], ["python", "-u", "-", "--steps", "3"], ["python3"], ["python", "-W", "ignore"]):
        with pt.raises(ValueError, match="reads its script from standard input"):
            job_from_args(parse_launch_line(parser, ["-np", "2", *command]))
        with pt.raises(ValueError, match="reads its script from standard input"):
            job_from_args(parse_launch_line(parser, ["--backend", "mxnet", "-np", "1", *command]))
        assert job_from_args(parse_launch_line(parser, ["-np", "1", *command])).command == command
    for command in (["python", "-W", "ignore", "-X", "dev", "train.py"], ["python", "-c", "print(1)"],
                    ["python", "-u", "-m", "pkg.train"], ["train.py", "-"], ["bash", "-"]):
        assert job_from_args(parse_launch_line(parser, ["-np", "2", *command])).command == command


def test_both_commands_say_their_version_and_a_scripts_own_version_flag_stays_the_scripts(capsys):
    import pytest as pt

    from dprorun import __version__
    from dprorun.argtypes import parse_launch_line
    from dprorun.cli import build_parser, job_from_args
    from dprorun.offline_cli import build_parser as build_dpro_parser

    for parser, prog in ((build_parser(), "dprorun"), (build_dpro_parser(), "dpro")):
        with pt.raises(SystemExit) as leaving:
            parser.parse_args(["--version"])
        assert leaving.value.code == 0 and capsys.readouterr().out.strip() == f"{prog} {__version__}"
    job = job_from_args(parse_launch_line(build_parser(), ["-np", "2", "python", "train.py", "--version"]))
    assert job.command == ["python", "train.py", "--version"]


def test_the_dprorun_command_ends_with_its_objects_kept_from_the_collector(monkeypatch):
    """`dprorun` as a command (console_main, the entry point and `python -m dprorun.cli`): main's exit code, then the
    objects it holds frozen, so that the interpreter's teardown does not walk torch's module graph (0.25 s of every
    launch's end)."""
    import gc

    from dprorun import cli

    monkeypatch.setattr(cli, "main", lambda argv=None: 3)
    try:
        assert cli.console_main() == 3 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    setup = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.cfg")).read()
    assert "dprorun = dprorun.cli:console_main" in setup


def test_a_rank_leaving_with_a_message_and_no_exception_is_named_with_its_last_words(tmp_path):
    """`sys.exit("dataset shard 1 is empty")`, `raise SystemExit(...)` or argparse's error leave with a code and no
    exception any hook sees: the launcher said only "exited with code 1". It now quotes the rank's last stderr line,
    passing over dprorun's own lines (its "nothing to profile" warning at exit) and torch's logging; a bare
    exception's type is said without a dangling colon."""
    from dprorun.procs import last_words
    from dprorun.runtime.raised import exception_line

    rank_dir = tmp_path / "logs" / "job_x" / "attempt_0" / "1"
    rank_dir.mkdir(parents=True)
    (rank_dir / "stderr.log").write_text(
        "usage: train.py [-h] --data DATA\ntrain.py: error: the following arguments are required: --data\n"
        "W1206 22:41:35.123000 1855 site-packages/torch/distributed/run.py:874] something\n"
        "[dprorun rank 1] warning: nothing to profile: the job never built a wrapper\n\n")
    assert last_words(str(tmp_path / "logs"), 1) == \
        "its last line on stderr: train.py: error: the following arguments are required: --data"
    assert last_words(str(tmp_path / "logs"), 0) == ""
    assert last_words(str(tmp_path / "none"), 1) == ""
    assert exception_line(KeyboardInterrupt()) == "KeyboardInterrupt"
    assert exception_line(ValueError("bad shard")) == "ValueError: bad shard"


def test_each_failed_attempt_of_a_restarted_job_is_named_by_its_cause(tmp_path):
    """torch elastic's per-attempt folders of a job it restarted: a rank the OOM killer ended (the agent's record of
    the attempt's first failure, no error file) is the cause before its peer's "connection closed"; an error of a
    rank's own is named; where only consequential errors were recorded (the cause on another node), that is said."""
    import json

    from dprorun.launch import CONSEQUENTIAL_ERRORS
    from dprorun.procs import failed_attempts

    def error(attempt: int, local_rank: int, message: str, stamp: int) -> None:
        folder = tmp_path / f"attempt_{attempt}" / str(local_rank)
        folder.mkdir(parents=True)
        (folder / "error.json").write_text(json.dumps({"message": {"message": message,
                                                                   "extraInfo": {"timestamp": str(stamp)}}}))

    error(0, 0, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1222", 10)
    error(1, 0, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1223", 20)
    error(1, 1, "ValueError: a batch of the wrong shape", 21)
    (tmp_path / "attempt_2" / "0").mkdir(parents=True)
    (tmp_path / "attempt_3").mkdir()  # the last attempt: not a failed one
    attempts = failed_attempts(str(tmp_path), 4, CONSEQUENTIAL_ERRORS, [(-9, 1), (1, 0), (1, 0)])
    assert [a.attempt for a in attempts] == [0, 1, 2]
    assert attempts[0].cause == "rank 5 (local rank 1) was killed by signal SIGKILL"
    assert attempts[1].cause == "rank 5 (local rank 1): ValueError: a batch of the wrong shape"
    assert attempts[2].cause.startswith("rank 4 (local rank 0) exited with code 1, no error recorded")
    alone = failed_attempts(str(tmp_path), 4, CONSEQUENTIAL_ERRORS)
    assert alone[0].cause.startswith("a rank elsewhere failed first (rank 4 (local rank 0): RuntimeError")
    assert alone[2].cause.startswith("no rank recorded an error")


def test_each_restart_gets_a_new_rendezvous_store_on_one_node_and_across_nodes():
    """torch elastic restarting the ranks (--max-restarts) calls the rendezvous again; torch's static one handed
    back the same store, whose keys from the attempt before (the dead ranks' gloo addresses) the new ranks read
    ("connectFullMesh failed ... Connection refused"). Each round now has a store of its own, with none of the
    keys before; across nodes node 0's new port reaches the other node through the old store."""
    import threading

    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    from dprorun.launch import LOOPBACK_RENDEZVOUS, NODES_RENDEZVOUS, _register_rendezvous
    from dprorun.procs import free_port

    _register_rendezvous()
    one = rendezvous_handler_registry.create_handler(RendezvousParameters(
        backend=LOOPBACK_RENDEZVOUS, endpoint=f"127.0.0.1:{free_port('127.0.0.1')}", run_id="unit", min_nodes=1,
        max_nodes=1, rank=0, timeout=10))
    first = one.next_rendezvous()
    first.store.set("rank_0", "dead address")
    second = one.next_rendezvous()
    assert second.bootstrap_store_info.master_port != first.bootstrap_store_info.master_port
    assert first.store.check(["rank_0"]) and not second.store.check(["rank_0"])

    endpoint = f"127.0.0.1:{free_port('127.0.0.1')}"
    nodes = [rendezvous_handler_registry.create_handler(RendezvousParameters(
        backend=NODES_RENDEZVOUS, endpoint=endpoint, run_id="unit", min_nodes=2, max_nodes=2, rank=rank,
        timeout=20)) for rank in (0, 1)]
    rounds = {0: [], 1: []}

    def node(rank: int) -> None:
        for _ in range(3):
            info = nodes[rank].next_rendezvous()
            rounds[rank].append(info)
            info.store.set(f"node_{rank}", "here")  # each round's keys, seen by both nodes of that round alone
            info.store.wait([f"node_{1 - rank}"])

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    ports = [[info.bootstrap_store_info.master_port for info in rounds[rank]] for rank in (0, 1)]
    assert len(ports[0]) == 3 and ports[0] == ports[1] and len(set(ports[0])) == 3, ports
    assert all(info.store.num_keys() >= 2 for info in rounds[1])


def test_the_loopback_rendezvous_store_owns_its_listening_socket():
    """dprorun's single-host rendezvous hands TCPStore a socket bound to 127.0.0.1; the store closes that descriptor
    when it goes. The Python socket object kept beside it closed the same number again at garbage collection (a
    ResourceWarning at every job's end under PYTHONWARNINGS or -X dev, and a second close of whatever held the number
    by then, for a second launch in one process). Now the object lets the descriptor go: no warning, and the
    descriptor is closed once, by the store."""
    import gc
    import warnings

    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    from dprorun.launch import LOOPBACK_RENDEZVOUS, _register_rendezvous
    from dprorun.procs import free_port

    _register_rendezvous()
    params = RendezvousParameters(backend=LOOPBACK_RENDEZVOUS, endpoint=f"127.0.0.1:{free_port('127.0.0.1')}",
                                  run_id="unit", min_nodes=1, max_nodes=1, rank=0, timeout=10)
    handler = rendezvous_handler_registry.create_handler(params)
    handler._store.set("key", "value")
    assert handler._store.get("key") == b"value"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        del handler
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]


def test_a_warning_raised_through_the_hooks_ddp_wrapper_names_the_scripts_line(tmp_path):
    """torch warns "`broadcast_buffers` is deprecated" at DistributedDataParallel's caller (stacklevel=2): under
    dprorun that was dprorun/runtime/ddp.py, the hooks' wrapper. A call through `as_the_callers` names the script's
    line again; a warning at the library's own line keeps it."""
    script = tmp_path / "warned.py"
    script.write_text(
        "import warnings\n"
        "from dprorun.runtime.log import as_the_callers\n"
        "def library(x):\n"
        "    warnings.warn('at the caller', FutureWarning, stacklevel=2)\n"
        "    warnings.warn('at its own line', UserWarning)\n"
        "    return x + 1\n"
        "def wrapper(x):\n"
        "    return as_the_callers(library, x)\n"
        "assert wrapper(1) == 2\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{script}:9: FutureWarning: at the caller" in out.stderr
    assert f"{script}:5: UserWarning: at its own line" in out.stderr
