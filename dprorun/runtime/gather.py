"""The end-of-window work (`finish_job_window`: clock probes (probes.py), calibration (calibration.py), events
written) and the gather: every rank's trace files into the run directory of rank 0's node, over the job's own
process group; after the clean iterations, their start times (`exchange_clean_starts`).

No shared filesystem is assumed. Ranks whose host is rank 0's host have already written into the run directory
(it is on their disk); the others send a bundle (see packing.py: JSON header + bytes, no pickle) over a
dedicated gloo group that only this job's ranks are members of, and rank 0 writes it atomically.
"""
from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Optional

from dprorun.fsutil import atomic_write_bytes, atomic_write_json, make_private_dir
from dprorun.runtime.cpubudget import cpu_budget, oversubscription_warning
from dprorun.layout import CLEAN_FILE, rank_dir
from dprorun.runtime.calibration import calibrate_allreduce, calibrate_horovod, calibrate_horovod_dtypes, \
    calibrate_under_compute, horovod_wire_dtypes
from dprorun.runtime.log import warn
from dprorun.runtime.packing import BundleError, pack_files, unpack_files
from dprorun.runtime.probes import probe_clocks

if TYPE_CHECKING:
    from dprorun.runtime.session import RankSession

HOST_BYTES = 256


def _host_tensor(host: str):
    import torch

    raw = host.encode()[:HOST_BYTES]
    buf = torch.zeros(HOST_BYTES, dtype=torch.uint8)
    buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    return buf


def _host_from_tensor(buf) -> str:
    raw = bytes(buf.tolist())
    return raw.rstrip(b"\0").decode(errors="replace")


def finish_job_window(session: RankSession, timeout_s: float = 120.0) -> None:
    """At the end of the window, on every rank: clock probes, events written, traces gathered to rank 0."""
    if session.framework == "mxnet":  # parameter-server workers of one host: each writes into the run directory
        if session.rank == 0:
            print("[dprorun] window done: kvstore calibration and writing the traces", file=sys.stderr, flush=True)
        from dprorun.runtime.mxnet import calibrate_kvstore, probe_engine

        tracker = session.profiler_backend
        try:
            session.records.calibration = calibrate_kvstore(tracker) if tracker is not None else []
        except Exception as exc:  # the cost model then relies on the profile alone
            session.records.warnings.append(f"kvstore calibration failed: {type(exc).__name__}: {exc}")
        # no optimizer on the servers (the Trainer's on the workers, or a script updating by hand): the servers'
        # hooks never run, so the engine is probed here
        if tracker is not None and (tracker.update_on_kvstore is False or not tracker.optimizer_on_servers):
            try:
                tracker.engine_probe = probe_engine(tracker)
            except Exception as exc:
                session.records.warnings.append(f"the engine's copy/add probe failed: {type(exc).__name__}: {exc}")
        _write_events_keeping_step(session)
        return
    if session.framework == "tf":  # TensorFlow workers of one host: each writes into the run directory
        _finish_tf_window(session, timeout_s)
        return
    import torch.distributed as dist

    if session.rank == 0:
        print("[dprorun] window done: clock probes, calibration and gathering the traces", file=sys.stderr,
              flush=True)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        horovod = horovod_running()
        if horovod:
            _record_cpu_budget(session)
            try:
                session.records.calibration = calibrate_horovod(session)
                session.records.calibration_dtypes = calibrate_horovod_dtypes(
                    horovod_wire_dtypes(session.records.buckets))
            except Exception as exc:  # the cost model then relies on Horovod's timeline
                session.records.warnings.append(f"Horovod all-reduce calibration failed: {exc}")
        _write_events_keeping_step(session)
        if horovod:
            gather_horovod_to_rank0(session)
        return
    peers_still_there(dist)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    try:
        probe_clocks(session, group)
    except Exception as exc:  # alignment falls back to trace-only evidence
        session.records.warnings.append(f"clock probes failed: {exc}")
    _record_cpu_budget(session)
    try:
        session.records.calibration = calibrate_allreduce(session)
        session.records.calibration_under_compute = calibrate_under_compute(session)
    except Exception as exc:  # the cost model then relies on the trace alone
        session.records.warnings.append(f"all-reduce calibration failed: {exc}")
    _write_events_keeping_step(session)
    gather_to_rank0(session, group)
    session.window_group = group  # released after the clean iterations (exchange_clean_starts)


def peers_still_there(dist) -> None:
    """Raise, naming it, where a rank left (raised, was killed) after its last collective of the window: the group
    made next waits for it in the store for its whole timeout (120 s; across nodes no agent stops this rank
    meanwhile), where the script's own next collective fails at once on gloo's closed connection. A barrier on the
    script's gloo group fails so too; NCCL would wait for its watchdog instead, as the script's collective would."""
    if dist.get_backend() != "gloo":
        return
    try:
        dist.barrier()
    except RuntimeError as exc:
        reason = str(exc).split(" This is typically", 1)[0].strip()
        raise RuntimeError(f"a rank left before the end-of-window gather: {reason}") from exc


VARIANTS_WAIT_S = 1800.0  # rank 0 timing compute variants (torch.compile of the model and of each block): minutes


def hold_ranks_while_rank0_measures(session: RankSession):
    """A barrier, on a group of dprorun's own made now while the ranks are lined up, that the ranks meet at once rank 0
    has timed the compute variants (--measure-variants, --autotune); None where there is no torch group to hold.
    Without it the other ranks went on to the script's next collective and waited there for rank 0 (2-6 s on the
    suite's models), past a short timeout the script gave its process group (3 s: a job torchrun runs failed under
    --autotune, "Timed out waiting 3000ms")."""
    if session.framework != "torch" or horovod_running():
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=VARIANTS_WAIT_S))
    return lambda: dist.barrier(group=group)


TEARDOWN_WAIT_S = 60.0  # how long a rank tearing its group down waits for the others before going on alone


def _teardown_wait_s() -> float:
    return float(os.environ.get("DPRO_TEARDOWN_WAIT_S", TEARDOWN_WAIT_S))


def _skipped(work: str) -> str:
    return f"the end-of-window work that needs every rank ({work}) was skipped; each rank keeps its own files"


def ranks_meet_at_teardown(session: RankSession) -> Optional[str]:
    """The script is tearing its default group down while end-of-window work (collectives) is still due: do all
    ranks get there? Each rank says so in the launcher's rendezvous store (not over the group, which a rank may be
    blocked in) and waits up to DPRO_TEARDOWN_WAIT_S seconds (60) for the others. A rank missing then (a rank
    still inside one of the script's collectives, after an error in another's training thread: the script's
    teardown is what lets its collective fail; before, this rank waited in the gather's group set-up meanwhile and a
    job torchrun ended in 6 s ran over 5 minutes), or one that gave up before this rank came: the reason, and the
    work is skipped on every rank. None: every rank came, the work runs (as where there is no store to ask)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return _horovod_ranks_meet(session) if horovod_running() else None
    store = dist.distributed_c10d._get_default_store()
    world, wait_s = dist.get_world_size(), _teardown_wait_s()
    prefix = f"dprorun/{session.cfg.job_id}/{session.cfg.launch_attempt}/teardown"
    store.set(f"{prefix}/{session.rank}", str(session.iteration))
    skipped = _skipped("clock probes, calibration, gather, the clean iterations' exchange")
    try:
        store.wait([f"{prefix}/{rank}" for rank in range(world)], timedelta(seconds=wait_s))
    except Exception:  # the store's timeout
        store.set(f"{prefix}/gave-up", str(session.rank))
        missing = [rank for rank in range(world) if not store.check([f"{prefix}/{rank}"])]
        return (f"rank(s) {missing} did not reach the process group's teardown within {wait_s:.0f} s of rank "
                f"{session.rank} (at iteration {session.iteration}): a rank failed or is still inside a collective; "
                f"{skipped} (DPRO_TEARDOWN_WAIT_S: seconds to wait)")
    if store.check([f"{prefix}/gave-up"]):
        return (f"rank {store.get(f'{prefix}/gave-up').decode()} stopped waiting for the others at the process "
                f"group's teardown before rank {session.rank} came; {skipped}")
    return None


def _horovod_ranks_meet(session: RankSession) -> Optional[str]:
    """Horovod's shutdown with end-of-window work due: a one-float all-reduce started asynchronously and polled
    for DPRO_TEARDOWN_WAIT_S seconds (Horovod's collectives have no timeout: a rank stuck in one of the step's
    all-reduces, whose peer's training thread raised, waits for the peer's shutdown, which waited in the
    calibration's first all-reduce for it, for good). Not done then (or Horovod already shut down by a peer): the
    reason, and the work is skipped; the peer's pending all-reduce fails at this rank's shutdown."""
    import torch

    hvd = sys.modules["horovod.torch"]
    wait_s = _teardown_wait_s()
    skipped = _skipped("calibration, gather, the clean iterations' exchange")
    try:
        handle = hvd.allreduce_async(torch.zeros(1), name="dprorun.teardown.meet")
        deadline = time.monotonic() + wait_s
        while not hvd.poll(handle):
            if time.monotonic() > deadline:
                return (f"another rank did not reach Horovod's shutdown within {wait_s:.0f} s of rank {session.rank} "
                        f"(at iteration {session.iteration}): a rank failed or is still inside a collective; "
                        f"{skipped} (DPRO_TEARDOWN_WAIT_S: seconds to wait)")
            time.sleep(0.05)
        hvd.synchronize(handle)
    except Exception as exc:  # Horovod shut down by a peer that stopped waiting
        return f"Horovod's ranks could not meet at its shutdown ({type(exc).__name__}: {str(exc)[:120]}); {skipped}"
    return None


def _record_cpu_budget(session: RankSession) -> None:
    """The rank's cores and torch's compute threads; a warning (printed by each host's first rank) where the
    threads clearly outnumber the cores, e.g. several ranks per host without OMP_NUM_THREADS under horovodrun."""
    try:
        session.records.cpu_budget = cpu_budget()
        oversubscribed = oversubscription_warning(session.records.cpu_budget)
        if oversubscribed:
            session.records.warnings.append(oversubscribed)
            if session.local_rank == 0:
                warn(oversubscribed)
    except Exception as exc:  # informative only
        session.records.warnings.append(f"CPU budget unreadable: {exc}")


def _finish_tf_window(session: RankSession, timeout_s: float) -> None:
    """TensorFlow workers (MultiWorkerMirroredStrategy or horovod.tensorflow): calibration, CPU budget, events;
    then, for the strategy's workers, probes and the gather over a side group."""
    if session.rank == 0:
        print("[dprorun] window done: calibration and writing the traces", file=sys.stderr, flush=True)
    from dprorun.runtime.horovod_tf import HorovodTFTracker, calibrate_horovod_tf, horovod_tf_running
    from dprorun.runtime.tf import calibrate_tf, tf_compute_threads

    horovod = isinstance(session.profiler_backend, HorovodTFTracker)
    try:
        if horovod:
            session.records.calibration = calibrate_horovod_tf() if horovod_tf_running() else []
        else:
            session.records.calibration = calibrate_tf(session.profiler_backend)
    except Exception as exc:  # the cost model then relies on the profile alone
        session.records.warnings.append(f"TensorFlow all-reduce calibration failed: {type(exc).__name__}: {exc}")
    try:
        session.records.cpu_budget = cpu_budget(tf_compute_threads())
    except Exception as exc:  # informative only
        session.records.warnings.append(f"CPU budget unreadable: {exc}")
    if horovod:  # horovod.tensorflow: no rendezvous store for a side group; every worker writes on its host
        _write_events_keeping_step(session)
        _note_remote_horovod_tf(session)
        return
    group = side_group(session, timeout_s)
    if group is not None:
        try:
            probe_clocks(session, group)
        except Exception as exc:  # alignment falls back to trace-only evidence
            session.records.warnings.append(f"clock probes failed: {exc}")
    _write_events_keeping_step(session)
    if group is not None:
        gather_to_rank0(session, group)
        session.window_group = group  # released after the clean iterations (exchange_clean_starts)


def _note_remote_horovod_tf(session: RankSession) -> None:
    """horovod.tensorflow jobs across hosts: their workers' files stay on their hosts (no gather channel yet)."""
    hvd = sys.modules.get("horovod.tensorflow")
    try:
        across_hosts = hvd is not None and hvd.local_size() < hvd.size()
    except Exception:
        across_hosts = False
    if across_hosts:
        session.records.warnings.append("horovod.tensorflow across hosts: the workers' traces stay in the run directory "
                                        "of their own host (copy them into rank 0's to analyse the whole job)")


def side_group(session: RankSession, timeout_s: float):
    """The world as a gloo process group, for workers of a framework that has no torch process group of its own
    (TensorFlow): made over the launcher's rendezvous store (the torch elastic agent's, MASTER_ADDR / MASTER_PORT,
    which dprorun's launch gives every worker), it carries the clock probes, the gather to rank 0's node and the
    clean iterations' start times as in DDP jobs. None (and the reason recorded) where there is none."""
    if session.world_size < 2:
        return None
    if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        session.records.warnings.append("no rendezvous store in the environment (MASTER_ADDR / MASTER_PORT): no "
                                        "clock probes, and ranks on other hosts keep their traces there")
        return None
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method="env://", rank=session.rank, world_size=session.world_size,
                                    timeout=timedelta(seconds=timeout_s))
        return dist.group.WORLD
    except Exception as exc:
        session.records.warnings.append(f"no process group for the clock probes and the gather: "
                                        f"{type(exc).__name__}: {exc}")
        return None


def _write_events_keeping_step(session: RankSession) -> None:
    """Write the events; a local failure (a full disk) is recorded, not raised: the collectives that follow
    must run on every rank alike, or the others wait for this one."""
    try:
        session.write_events()
    except OSError as exc:
        session.records.warnings.append(f"the events could not be written before the gather: {exc}")
        warn(session.records.warnings[-1])


def gather_to_rank0(session: RankSession, group) -> None:
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    rank = dist.get_rank()
    hosts = [torch.zeros(HOST_BYTES, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(hosts, _host_tensor(session.host), group=group)
    host_names = [_host_from_tensor(h) for h in hosts]
    remote = not _sees_rank0_run_dir(session, group)
    if session.cfg.fake_hosts and host_names[rank] != host_names[0]:
        remote = True  # test knob DPRO_TEST_HOSTS: ranks on a pretend other host send, as if on another disk
    payload = _own_bundle(session) if remote else b""
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=group)
    session.remote_ranks = [src for src in range(world) if int(sizes[src].item()) > 0]
    if rank == 0:
        for src in range(1, world):
            size = int(sizes[src].item())
            if size <= 0:
                continue
            buf = torch.empty(size, dtype=torch.uint8)
            dist.recv(buf, src=src, group=group)
            _write_bundle(session, src, host_names[src], buf.numpy().tobytes())
    elif remote:
        dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst=0, group=group)
    dist.barrier(group=group)
    session.gathered_hosts = host_names


LOCATION_BYTES = 4096


def _sees_rank0_run_dir(session: RankSession, group) -> bool:
    import torch.distributed as dist

    def broadcast(buf):
        dist.broadcast(buf, src=0, group=group)

    return _sees_run_dir_of_rank0(session, dist.get_rank() == 0, broadcast, lambda: dist.barrier(group=group))


def _sees_run_dir_of_rank0(session: RankSession, is_rank0: bool, broadcast, barrier) -> bool:
    """Whether this rank's files already sit in rank 0's run directory: rank 0 writes a random token there and
    broadcasts its path and contents; a rank whose own directory is rank_<r> under that path and that reads the
    same token shares rank 0's disk. Hostnames are not evidence (containers and network namespaces share them;
    two hosts on one shared filesystem need no copy). `broadcast(uint8 tensor)` from rank 0 and `barrier()` are
    the job's transport (torch.distributed or Horovod)."""
    import secrets

    import torch

    buf = torch.zeros(LOCATION_BYTES, dtype=torch.uint8)
    token_path = None
    if is_rank0:
        token = secrets.token_hex(16)
        token_path = os.path.join(session.cfg.run_dir, f".gather-{token}")
        try:
            atomic_write_bytes(token_path, token.encode())
            raw = f"{os.path.realpath(session.cfg.run_dir)}\n{token}".encode()
            if len(raw) <= LOCATION_BYTES:
                buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        except OSError as exc:
            warn(f"could not write the gather token ({exc}); every rank sends its traces")
    broadcast(buf)
    run_dir, _, token = bytes(buf.tolist()).rstrip(b"\0").decode(errors="replace").partition("\n")
    local = False
    if run_dir and token:
        own_dir = os.path.realpath(session.rank_dir)
        try:
            with open(os.path.join(run_dir, f".gather-{token}"), "rb") as handle:
                local = handle.read().decode() == token and os.path.dirname(own_dir) == run_dir
        except OSError:
            local = False
    barrier()
    if token_path:
        try:
            os.unlink(token_path)
        except OSError:
            pass
    return local


def _own_bundle(session: RankSession) -> bytes:
    files = {}
    for name in sorted(os.listdir(session.rank_dir)):
        path = os.path.join(session.rank_dir, name)
        if os.path.isfile(path) and not name.startswith("."):
            with open(path, "rb") as handle:
                files[name] = handle.read()
    return pack_files(files)


def horovod_running() -> bool:
    """A Horovod job with more than one rank (its collectives are the gather channel then)."""

    hvd = sys.modules.get("horovod.torch")
    try:
        return hvd is not None and hvd.is_initialized() and hvd.size() > 1
    except Exception:
        return False


def gather_horovod_to_rank0(session: RankSession) -> None:
    """Horovod jobs (no torch.distributed): the same locality test and bundles over Horovod's own collectives:
    a broadcast for the token, an allgather of host names, and an alltoall whose splits send each remote rank's
    bundle to rank 0 only (every rank also sends itself one byte, so that no tensor is empty)."""

    import torch

    hvd = sys.modules["horovod.torch"]
    rank, world = hvd.rank(), hvd.size()
    hosts = hvd.allgather(_host_tensor(session.host).unsqueeze(0), name="dprorun.gather.hosts")
    host_names = [_host_from_tensor(hosts[r]) for r in range(world)]

    def broadcast(buf):
        buf.copy_(hvd.broadcast(buf, root_rank=0, name="dprorun.gather.token"))

    remote = not _sees_run_dir_of_rank0(session, rank == 0, broadcast,
                                        lambda: hvd.allreduce(torch.zeros(1), name="dprorun.gather.barrier"))
    if session.cfg.fake_hosts and host_names[rank] != host_names[0]:
        remote = True  # test knob DPRO_TEST_HOSTS: ranks on a pretend other host send, as if on another disk
    payload = _own_bundle(session) if remote and rank != 0 else b""
    splits = torch.zeros(world, dtype=torch.int32)
    splits[0] += len(payload)
    splits[rank] += 1
    # slices go out in rank order: the bundle for rank 0 (empty on rank 0 itself), then the byte to itself
    tensor = torch.frombuffer(bytearray(payload) + b"\0", dtype=torch.uint8)
    received, received_splits = hvd.alltoall(tensor, splits=splits, name="dprorun.gather.bundles")
    if rank == 0:
        blob = received.numpy().tobytes()
        offset = 0
        for src, count in enumerate(int(n) for n in received_splits.tolist()):
            if src != 0 and count > 0:
                _write_bundle(session, src, host_names[src], blob[offset:offset + count])
                session.remote_ranks.append(src)
            offset += count
    session.gathered_hosts = host_names


def exchange_clean_starts(session: RankSession, complete: bool) -> None:
    """After the clean iterations (or when the script tears down its group inside them): every rank's clean
    iteration start times, and which of those iterations ran under the script's own profiler, go to rank 0, which
    writes clean.json for the ranks whose files are on another disk (the others wrote their own). One small
    fixed-size all-gather over the window's gloo group (Horovod's own allgather in Horovod jobs); the group is
    released afterwards."""
    import math

    import torch

    own = session.clean_document(complete=complete)
    count = session.cfg.clean + 1  # C+1 start times, the complete flag, C+1 flags: under the script's profiler
    width = 2 * count + 1
    row = torch.full((width,), math.nan, dtype=torch.float64)
    starts = own["iteration_starts_us"][:count]
    if starts:
        row[: len(starts)] = torch.tensor(starts, dtype=torch.float64)
    row[count] = 1.0 if complete else 0.0
    first = own["first_iteration"]
    marked = set(session.records.script_profiler_iterations)
    row[count + 1:] = torch.tensor([1.0 if first + k in marked else 0.0 for k in range(count)], dtype=torch.float64)
    group = session.window_group
    session.window_group = None
    if group is not None:
        import torch.distributed as dist

        rows = [torch.empty(width, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row, group=group)
        # every rank past the all-gather before any tears the group down: a gloo pair torn down while the other
        # side still reads from it has aborted a rank (SIGABRT) on this machine
        dist.barrier(group=group)
        dist.destroy_process_group(group)
    elif horovod_running():
        hvd = sys.modules["horovod.torch"]
        gathered = hvd.allgather(row.unsqueeze(0), name="dprorun.clean.starts")
        rows = [gathered[r] for r in range(gathered.shape[0])]
    else:
        return
    if session.rank != 0:
        return
    for src in session.remote_ranks:
        values = [float(x) for x in rows[src][:count].tolist() if not math.isnan(x)]
        marks = [first + k for k, flag in enumerate(rows[src][count + 1:].tolist()) if flag > 0.5]
        doc = session.clean_document(rank=src, starts=values, complete=bool(rows[src][count].item() > 0.5),
                                     script_marks=marks)
        target = make_private_dir(rank_dir(session.cfg.run_dir, src))
        atomic_write_json(os.path.join(target, CLEAN_FILE), doc)


def _write_bundle(session: RankSession, src: int, host: str, blob: bytes) -> None:
    try:
        files = unpack_files(blob)
    except BundleError as exc:
        warn(f"trace bundle from rank {src} ({host}) rejected: {exc}")
        return
    target = make_private_dir(rank_dir(session.cfg.run_dir, src))
    for name, data in files.items():
        atomic_write_bytes(os.path.join(target, name), data)
    atomic_write_bytes(os.path.join(target, "GATHERED_FROM"), host.encode())
