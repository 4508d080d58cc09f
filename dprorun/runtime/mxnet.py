"""Hooks in the processes of an MXNet kvstore parameter-server job (`dprorun --backend mxnet`), no script change.

They run in MXNet's own environment (numpy 1.23, no torch): standard library and mxnet only.

Workers (DMLC_ROLE=worker):
  iterations  each `gluon.Trainer.step` call starts one, or each `Module.update` call (the Module API, `fit`):
              its entry is the boundary (MXNet runs the ops asynchronously, so the period between two entries is
              the iteration time of a script that waits for its results somewhere, as every training loop does);
  keys        every kvstore `pushpull` / `push` / `pull` call: the key, its bytes, its priority, in call order
              (the profiler's push/pull events carry neither key nor size); a string key (the Module API names
              parameters) is the integer the kvstore gives it: the order of its `init` calls, from 0;
  profiler    `mx.profiler` (operators, imperative and symbolic) over the window's first --kineto-iters
              iterations, dumped as Chrome JSON to rank_<r>/mx_profile.json (trace/mxprofile.py reads it);
  engine      where the optimizer runs on the workers (update_on_kvstore False: the servers' hooks never run), the
              engine's copy and add probed at the keys' sizes at the end of the window (probe_engine);
  calibration at the end of the window every worker pushes and pulls arrays of 4 KiB - 16 MiB through the job's
              own kvstore (keys of their own, the servers' optimizer applied as for the model's keys): the round
              trip the cost model is fitted to.
  A worker's rank is the kvstore's (`kv.rank`, assigned by the scheduler), taken when the kvstore is created.
Servers (DMLC_ROLE=server): the optimizer the workers send (`set_optimizer`) becomes the server's updater; the hooks
  time each call (key, start, end, bytes; the update waited for, not the merge of the pushes before it), probe the
  engine's copy and add speed at each new key size (the merging of each push, the copy into each pull's response;
  in each key's first update, outside its timing), read their CPU seconds at updates 20 ms apart or more (how busy
  a server kept its host: replay/ps_cpu.py), and write server_<r>/server.json when the workers' calibration begins.
"""
from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from dprorun.fsutil import make_private_dir
from dprorun.layout import MX_LAUNCH_INDEX_FILE, MX_PROFILE_FILE, PS_CALIBRATION_KEY_BASE as CALIBRATION_KEY_BASE, \
    SERVER_FILE, SERVER_SCHEMA, server_dir
from dprorun.runtime.cpubudget import cgroup_quota_cores, process_cpu_s
from dprorun.runtime.script_profiler import ProfilerBusy, watch_mxnet
from dprorun.stats import median

if TYPE_CHECKING:
    from dprorun.runtime.session import RankSession

CALIBRATION_SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20, 16 << 20)
CALIBRATION_KEY_NAME = "dprorun.calibration."  # the calibration's keys in a job whose keys are strings
MAX_SERVER_RECORDS = 200_000
CPU_MARK_US = 20_000  # a server's CPU seconds read at its updates at most this often


def _nbytes(array) -> int:
    """The bytes a push or pull of `array` carries: a row-sparse array's rows and their indices (int64), counted from
    its indices (MXNet copies them out, and the rows too where asked: 0.8 ms against 15.3 ms for 50,000 rows of 128),
    else the array's size."""
    import numpy as np

    if _is_row_sparse(array):
        rows = int(array.indices.size)
        return rows * (math.prod(array.shape[1:]) * int(np.dtype(array.dtype).itemsize) + 8)
    return int(array.size) * int(np.dtype(array.dtype).itemsize)


def _is_row_sparse(array) -> bool:
    return getattr(array, "stype", "default") == "row_sparse"


def _dense_nbytes(array) -> int:
    import numpy as np

    return math.prod(array.shape) * int(np.dtype(array.dtype).itemsize)


def _sparse_bytes(entry: dict) -> dict:
    """A row-sparse key's bytes: the median of its pushes' (rows and indices), the table's kept as `dense_bytes`, and
    the median of its pulls' (`pull_bytes`: the rows asked for, at most: MXNet pulls each once)."""
    pushed, pulled = entry.get("row_sparse_push_bytes"), entry.get("row_sparse_pull_bytes")
    if not pushed:
        return {}
    return {"bytes": int(median(pushed)), "dense_bytes": entry["bytes"], "stype": "row_sparse",
            **({"pull_bytes": int(median(pulled))} if pulled else {})}


def _first(value):
    return value[0] if isinstance(value, (list, tuple)) else value


@dataclass
class IterationKeys:
    """The kvstore keys each iteration of a worker pushes: counted over the window's iterations (the replay prices
    the keys most of them pushed: a layer frozen before the window is not priced, nor a key pushed once, such as a
    metric summed through the kvstore), and a lasting change of the set (two iterations in a row) told apart from a
    one-off."""

    current: set[int] = field(default_factory=set)  # the keys pushed in the iteration under way
    stable: frozenset = frozenset()  # the set the last iterations pushed
    changed: Optional[tuple[int, frozenset, bool]] = None  # (iteration, keys, counted in the window): one other set
    window_pushes: dict[int, int] = field(default_factory=dict)  # key -> the window's iterations that pushed it
    window_iterations: int = 0

    def ended(self, iteration: int, in_window: bool, detect: bool) -> Optional[tuple[int, frozenset, frozenset]]:
        """Close the iteration `iteration`; (the first iteration of the new set, the new set, the old one) where
        `detect` and the set changed for good (that iteration's count taken back out of the window's)."""
        pushed, self.current = frozenset(self.current), set()
        if not pushed:
            return None
        if detect and self.stable and pushed != self.stable and self.changed is not None and \
                self.changed[1] == pushed:
            first, _, counted = self.changed
            if counted:
                self._count(pushed, -1)
            change, self.stable, self.changed = (first, pushed, self.stable), pushed, None
            return change
        if not self.stable or pushed == self.stable or not detect:
            self.stable, self.changed = pushed, None
        else:
            self.changed = (iteration, pushed, in_window)
        if in_window:
            self._count(pushed, 1)
        return None

    def _count(self, keys: frozenset, sign: int) -> None:
        self.window_iterations += sign
        for key in keys:
            self.window_pushes[key] = self.window_pushes.get(key, 0) + sign


class MXTracker:
    """One per worker: the kvstore, the keys seen, the profiler."""

    framework = "mxnet"

    def __init__(self, session: "RankSession"):
        self.session = session
        self._kvstore = None  # weakref: a kvstore kept alive past the script's own end aborts the process at exit
        self.kv_type = ""
        self.local_kvstores: list[str] = []  # kvstores of other types the script made (local, device): no servers
        self.keys: dict[int, dict] = {}  # key -> {"bytes", "priority", "order", "calls"}
        self.profiling = False
        self.profile_path = os.path.join(session.rank_dir, MX_PROFILE_FILE)
        self.update_on_kvstore: Optional[bool] = None
        self.string_keys: dict[str, int] = {}  # a string key -> the kvstore's integer for it (init order)
        self.step_calls = 0  # Trainer.step / allreduce_grads / Module.update calls: the iterations, if any
        self.cycle: set[int] = set()  # a script pushing by hand: the keys pushed since this cycle's first push
        self.cycles = 0
        self.pushed = IterationKeys()
        self.compression: Optional[str] = None  # the kvstore's gradient compression ("2bit", "1bit"), if set
        self.engine_probe: list[list[float]] = []  # [bytes, copy µs, add µs]: see probe_engine
        # the script (or its Trainer / Module) gave the kvstore an optimizer (set_optimizer): the servers update
        self.optimizer_on_servers = False
        session.trackers.append(self)

    def describe(self) -> dict:
        return {"framework": "mxnet", "backend": "kvstore", "kvstore": self.kv_type,
                "local_kvstores": self.local_kvstores, "update_on_kvstore": self.update_on_kvstore,
                "optimizer_on_servers": self.optimizer_on_servers,
                "keys": [{"key": k, **v, **_sparse_bytes(v), "window_pushes": self.pushed.window_pushes.get(k, 0)}
                         for k, v in sorted(self.keys.items(), key=lambda kv: kv[1]["order"])],
                "window_iterations": self.pushed.window_iterations,
                "gradient_compression": self.compression,
                "bigarray_bound": int(os.environ.get("MXNET_KVSTORE_BIGARRAY_BOUND", "1000000")),
                "servers": int(os.environ.get("DMLC_NUM_SERVER", "1")),
                "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                "cgroup_quota_cores": cgroup_quota_cores(),  # a host (container) held to fewer cores than it has
                "workers": int(os.environ.get("DMLC_NUM_WORKER", "1")),
                "engine_probe": self.engine_probe,
                "iterations": "Trainer.step / allreduce_grads / Module.update" if self.step_calls else
                ("push/pull cycles (the script pushes by hand)" if self.cycles else "none seen")}

    # ---- kvstore -----------------------------------------------------------------------------------------
    @property
    def kvstore(self):
        return self._kvstore() if self._kvstore is not None else None

    def kvstore_created(self, kv) -> None:
        import weakref

        if not str(kv.type).startswith("dist"):
            if str(kv.type) not in self.local_kvstores:
                self.local_kvstores.append(str(kv.type))
            return
        if self._kvstore is not None:
            return
        self._kvstore = weakref.ref(kv)
        self.kv_type = str(kv.type)
        session = self.session
        rank, world = int(kv.rank), int(kv.num_workers)
        if rank != session.rank and session.phase == "warmup":
            from dprorun.layout import rank_dir

            # the scheduler numbers workers as they register: the log's [worker<i>] is the launch order
            print(f"[dprorun] worker {session.rank} (launch order) is the kvstore's worker {rank}: its traces go "
                  f"to rank_{rank}", file=sys.stderr, flush=True)
            launch_index = session.rank
            session.rank, session.world_size = rank, world
            session.rank_dir = rank_dir(session.cfg.run_dir, rank)
            try:
                make_private_dir(session.rank_dir)
                with open(os.path.join(session.rank_dir, MX_LAUNCH_INDEX_FILE), "w") as handle:
                    handle.write(str(launch_index))
            except OSError:
                pass  # the launcher's failure message then names the launch order alone
            session.skew_us = session.cfg.skew_for(rank)
            self.profile_path = os.path.join(session.rank_dir, MX_PROFILE_FILE)

    def key_init(self, key) -> None:
        """kvstore.init / broadcast: string keys get the kvstore's integers in the order they are initialised (MXNet's
        KVStoreLocal numbers them so; the servers see those integers)."""
        for k in key if isinstance(key, (list, tuple)) else [key]:
            if isinstance(k, str) and k not in self.string_keys:
                self.string_keys[k] = len(self.string_keys)

    def key_call(self, op: str, key, value, priority: int, row_ids=None) -> None:
        keys = key if isinstance(key, (list, tuple)) else [key]
        values = value if isinstance(key, (list, tuple)) else [value]
        for k, v in zip(keys, values):
            if isinstance(k, str):
                k = None if k.startswith(CALIBRATION_KEY_NAME) else self.string_keys.get(k)
            if not isinstance(k, int):
                continue
            if k >= CALIBRATION_KEY_BASE:
                continue
            if op in ("push", "pushpull"):
                if self.step_calls == 0:
                    self._push_cycle(k)
                self.pushed.current.add(k)
            entry = self.keys.get(k)
            first = _first(v)
            if entry is None:
                entry = self.keys[k] = {"bytes": _dense_nbytes(first), "elements": math.prod(first.shape),
                                        "priority": int(priority), "order": len(self.keys), "ops": []}
            if op not in entry["ops"]:
                entry["ops"].append(op)
            if _is_row_sparse(first) and op in ("push", "pushpull"):
                self._sparse_push(entry, first)
            elif op == "row_sparse_pull" and row_ids is not None:
                self._sparse_pull(entry, first, _first(row_ids) if isinstance(key, (list, tuple)) else row_ids)

    def _sparse_push(self, entry: dict, array) -> None:
        """A row-sparse push carries its rows, not the table (MXNet places the key by the table's size, sends the
        rows): their bytes sampled before the window (reading them waits for the array), in it where the window
        came first; the key's bytes are their median (`describe`)."""
        seen = entry.setdefault("row_sparse_push_bytes", [])
        if len(seen) < 64 and (self.session.phase == "warmup" or (self.session.phase == "active" and not seen)):
            seen.append(_nbytes(array))

    def _sparse_pull(self, entry: dict, out, row_ids) -> None:
        """A row_sparse_pull carries the rows asked for (at most: MXNet pulls each once), counted from `row_ids`'
        shape alone (no wait for the array), in the warm-up and the window; their median is the key's `pull_bytes`."""
        import numpy as np

        pulled = entry.setdefault("row_sparse_pull_bytes", [])
        if len(pulled) < 64 and hasattr(row_ids, "shape") and self.session.phase in ("warmup", "active"):
            row = math.prod(out.shape[1:]) * int(np.dtype(out.dtype).itemsize) + 8
            pulled.append(math.prod(row_ids.shape) * row)

    # ---- iterations --------------------------------------------------------------------------------------
    def run_step(self, call, *args, **kwargs):
        self.step_calls += 1
        self.session.guard("reading the iteration's keys", self._iteration_ended)
        self.session.begin_iteration()
        return call(*args, **kwargs)

    def _iteration_ended(self) -> None:
        """The keys the iteration that just ended pushed (IterationKeys); where the set changed for good once the
        window began (a layer frozen or unfrozen: the job trains another set of parameters), profiling ends at the
        first iteration that pushed the new set."""
        session = self.session
        change = self.pushed.ended(session.iteration, session.phase == "active", detect=self.step_calls > 0)
        if change is not None and session.phase in ("active", "clean"):
            first, new, old = change
            session.primary_replaced(first, f"set of parameters (a layer frozen or unfrozen: {len(new)} kvstore "
                                     f"keys pushed a step where {len(old)} were)")

    def _push_cycle(self, key: int) -> None:
        """A script that pushes and pulls by hand (no Trainer.step or Module.update): each push/pull cycle is an
        iteration; the first push of a key already pushed in this cycle starts the next (the iteration is then
        counted from that push, after its forward and backward: the same period, shifted)."""
        if not self.cycle or key in self.cycle:
            self.cycle = set()
            self.cycles += 1
            self._iteration_ended()
            self.session.begin_iteration()
        self.cycle.add(key)

    # ---- profiler ----------------------------------------------------------------------------------------
    def start_profiler(self) -> None:
        import mxnet as mx

        if self.session.script_profiler.on:
            raise ProfilerBusy(self.session.script_profiler.name)
        os.makedirs(self.session.rank_dir, exist_ok=True)
        try:
            mx.profiler.set_config(profile_symbolic=True, profile_imperative=True, profile_memory=False,
                                   profile_api=False, aggregate_stats=False, filename=self.profile_path)
        except mx.base.MXNetError as exc:
            # the script's own profiler ran and dumped with finished=True: MXNet then refuses to restart its
            # periodic dump thread, after it took the configuration (the file name included); the dump that
            # follows has no header (the reader, trace/mxprofile.py, adds it)
            if "auto_remove_" not in str(exc):
                raise
        mx.profiler.set_state("run")
        self.profiling = True

    def stop_profiler(self, write: bool) -> None:
        import mxnet as mx

        if not self.profiling:
            return
        self.profiling = False
        mx.nd.waitall()  # the profiled iterations' operators finish before the profiler stops
        mx.profiler.set_state("stop")
        if write:
            mx.profiler.dump(finished=False)
            if os.path.exists(self.profile_path):
                os.chmod(self.profile_path, 0o600)
                self.session.records.files_written.append(MX_PROFILE_FILE)
            else:
                self.session.records.warnings.append("mx.profiler wrote no file")

    def step(self) -> None:
        return None

    def stop_param_hooks(self) -> None:
        return None

    def detail_tier_started(self) -> None:
        return None

    def window_stopped(self) -> None:
        return None


def patch_mxnet_worker(session: "RankSession") -> MXTracker:
    """Patch Trainer.step (iterations), the kvstore's creation (rank) and its push/pull calls (keys, bytes)."""
    from mxnet.gluon.trainer import Trainer
    from mxnet.kvstore import kvstore as kvstore_module

    tracker = MXTracker(session)
    session.profiler_backend = tracker
    session.framework = "mxnet"
    session.guard("watching the script's profiler", watch_mxnet, session)
    kv_class = kvstore_module.KVStore
    original_init = kv_class.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        session.guard("reading the kvstore's rank", tracker.kvstore_created, self)

    kv_class.__init__ = init
    session.guard("watching the kvstores the script creates", _warn_second_dist_kvstore, tracker,
                  sys.modules["mxnet.kvstore"])
    for op in ("init", "broadcast"):  # broadcast = init + pull (Module.fit with the optimizer on the servers)
        original = getattr(kv_class, op)

        def key_init(self, key, *args, _original=original, **kwargs):
            if self is tracker.kvstore:
                session.guard("recording the kvstore's keys", tracker.key_init, key)
            return _original(self, key, *args, **kwargs)

        setattr(kv_class, op, key_init)
    def is_tracked(kvstore) -> bool:
        """Whether `kvstore` is the job's (the first one seen becomes it)."""
        if tracker._kvstore is None:
            session.guard("reading the kvstore's rank", tracker.kvstore_created, kvstore)
        return kvstore is tracker.kvstore

    def set_gradient_compression(self, compression_params, *args, _original=kv_class.set_gradient_compression,
                                 **kwargs):
        if is_tracked(self):
            tracker.compression = str((compression_params or {}).get("type", "none"))
        return _original(self, compression_params, *args, **kwargs)

    def set_optimizer(self, optimizer, *args, _original=kv_class.set_optimizer, **kwargs):
        if is_tracked(self):  # the servers get the optimizer: they update
            tracker.optimizer_on_servers = True
        return _original(self, optimizer, *args, **kwargs)

    kv_class.set_gradient_compression = set_gradient_compression
    kv_class.set_optimizer = set_optimizer
    for op in ("pushpull", "push", "pull", "row_sparse_pull"):
        original = getattr(kv_class, op)

        def wrapped(self, key, *args, _original=original, _op=op, **kwargs):
            value = args[0] if args else kwargs.get("value", kwargs.get("out"))
            priority = kwargs.get("priority", 0)
            if tracker._kvstore is None:
                session.guard("reading the kvstore's rank", tracker.kvstore_created, self)
            if self is tracker.kvstore and value is not None:
                row_ids = kwargs.get("row_ids", args[2] if len(args) > 2 else None) \
                    if _op == "row_sparse_pull" else None  # row_sparse_pull(key, out, priority, row_ids)
                session.guard("recording a kvstore key", tracker.key_call, _op, key, value, priority, row_ids)
            return _original(self, key, *args, **kwargs)

        setattr(kv_class, op, wrapped)
    from mxnet.module import Module

    _patch_iteration(tracker, Trainer, "step", "_kv_initialized")
    # Trainer.step split in two by the script (gradient clipping: allreduce_grads, clip, update; the optimizer on
    # the workers): an iteration per allreduce_grads (step calls the private _allreduce_grads, not this one)
    _patch_iteration(tracker, Trainer, "allreduce_grads", "_kv_initialized")
    # the Module API: `Module.update` (once per batch in `fit`, after forward_backward)
    _patch_iteration(tracker, Module, "update", "optimizer_initialized")
    _watch_inference(tracker)
    import atexit

    # registered after MXNet's own exit handler (at `import mxnet`), so it runs first: see drain_engine_at_exit
    atexit.register(drain_engine_at_exit, session)
    return tracker


def drain_engine_at_exit(session: "RankSession") -> None:
    """The worker's pending engine operations (the last step's pushes and pulls) finish before MXNet's exit handler
    shuts its engine down. A script that ends without mx.nd.waitall() otherwise hangs at exit now and then, under
    plain MXNet too: one worker waits in the shutdown's WaitForAll for an operation that never completes while the
    other waits for it at the kvstore's closing barrier (examples/mxnet_batchnorm_clip.py: 3 of 3 plain launches
    hung, 0 of 3 under the hooks; benchmarks/mxnet_exit.py). A worker whose script raised (printed by a hook of
    the script's own: ours did not see it) or called sys.exit with a message or a non-zero code leaves at once
    instead, its error noted (runtime/raised.py)."""
    from dprorun.runtime.raised import leave_an_mxnet_worker_that_exited_failing, leave_an_mxnet_worker_that_raised, \
        note_uncaught_at_exit

    if note_uncaught_at_exit(session):
        leave_an_mxnet_worker_that_raised(session)
    leave_an_mxnet_worker_that_exited_failing(session)
    import mxnet as mx

    try:
        mx.nd.waitall()
    except Exception:  # a failed operation: MXNet's own exit handler reports it as it would without the hooks
        pass


def _watch_inference(tracker: MXTracker) -> None:
    """Count the forward passes that autograd does not record (trace/rundir.inference_set_aside): a Gluon block
    called outside `autograd.record()` (the outermost call only: its children run inside it) and a Module's forward
    with is_train=False (Module.score, a validation loop by hand)."""
    from mxnet import autograd
    from mxnet.gluon import Block
    from mxnet.module import Module

    block_call, module_forward = Block.__call__, Module.forward
    inside = [False]

    def call(self, *args):
        if inside[0]:
            return block_call(self, *args)
        inside[0] = True
        try:
            if not autograd.is_recording():
                tracker.session.records.count_inference_pass(tracker.session.iteration)
            return block_call(self, *args)
        finally:
            inside[0] = False

    def forward(self, data_batch, is_train=None):
        if is_train is False or (is_train is None and not getattr(self, "for_training", True)):
            tracker.session.records.count_inference_pass(tracker.session.iteration)
        return module_forward(self, data_batch, is_train)

    Block.__call__, Module.forward = call, forward


SECOND_DIST_KVSTORE = ("the script creates a second dist kvstore ({name!r}) in a process that has "
                       "one ({first!r}): MXNet's parameter server waits for good there (a plain launch of such a "
                       "job hangs too). Create one and pass it on: gluon.Trainer(..., kvstore=kv), Module.fit(kvstore="
                       "kv)")


def _warn_second_dist_kvstore(tracker: MXTracker, kvstore_package) -> None:
    """mxnet.kvstore.create (what mx.kv.create and gluon.Trainer's kvstore='dist_sync' call): a second dist kvstore
    in a process is said before MXNet hangs in it (a script's own mx.kv.create('dist_sync') for its rank, then a
    Trainer given the name instead of the object)."""
    original = kvstore_package.create

    @functools.wraps(original)
    def create(name="local", *args, **kwargs):
        first = tracker.kvstore
        if first is not None and "dist" in str(name):
            problem = SECOND_DIST_KVSTORE.format(name=str(name), first=str(first.type))
            print(f"[dprorun] warning: {problem}", file=sys.stderr, flush=True)
            tracker.session.records.warnings.append(problem)
        return original(name, *args, **kwargs)

    kvstore_package.create = create


def _patch_iteration(tracker: MXTracker, cls, method: str, ready_attr: str) -> None:
    """Each call of cls.method starts an iteration; the first call after the object's `ready_attr` is set says
    whether the optimizer runs on the kvstore's servers."""
    original = getattr(cls, method)

    def patched(self, *args, **kwargs):
        if tracker.update_on_kvstore is None and getattr(self, ready_attr, False):
            tracker.update_on_kvstore = bool(getattr(self, "_update_on_kvstore", False))
        return tracker.run_step(original, self, *args, **kwargs)

    setattr(cls, method, patched)


def calibrate_kvstore(tracker: MXTracker, repeats: int = 5) -> list[list[float]]:
    """[[bytes, µs, server parts], ...]: the median round trip (push, the servers' aggregation and update, pull) of
    `repeats` pushpulls of each size through the job's kvstore, every worker at the same point (the end of the
    window); keys CALIBRATION_KEY_BASE + i."""
    import statistics

    import mxnet as mx

    kv = tracker.kvstore
    if kv is None:
        return []
    bound = int(os.environ.get("MXNET_KVSTORE_BIGARRAY_BOUND", "1000000"))
    servers = int(os.environ.get("DMLC_NUM_SERVER", "1"))
    mx.nd.waitall()
    out = []
    for i, size in enumerate(CALIBRATION_SIZES):
        # a kvstore takes integer or string keys, not both: the job's kind (string keys reach the servers as the
        # integers after the job's own, so the servers write their records at exit instead of at this point)
        key = f"{CALIBRATION_KEY_NAME}{i}" if tracker.string_keys else CALIBRATION_KEY_BASE + i
        count = size // 4
        grad = mx.nd.ones((count,))
        weight = mx.nd.zeros((count,))
        kv.init(key, weight)
        _round_trip(kv, key, grad, weight, tracker.compression)  # the first: the servers' optimizer state is created
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            _round_trip(kv, key, grad, weight, tracker.compression)
            times.append((time.perf_counter() - start) * 1e6)
        out.append([size, statistics.median(times), servers if count >= bound else 1])
    return out


def _round_trip(kv, key, grad, weight, compression: Optional[str]) -> None:
    """One push of `grad` and pull into `weight`, waited for: one pushpull, or, where the kvstore compresses its
    gradients (MXNet refuses pushpull then), a push and a pull, as such a job makes them."""
    if compression and compression != "none":
        kv.push(key, grad)
        kv.pull(key, out=weight)
    else:
        kv.pushpull(key, grad, out=weight)
    weight.wait_to_read()


def probe_engine(tracker: MXTracker) -> list[list[float]]:
    """[bytes, copy µs, add µs] of this worker's engine at its keys' sizes of 64 KiB or more (the largest
    MEMORY_PROBE_MAX_SIZES): for a job whose optimizer runs on the workers (update_on_kvstore False), whose servers
    then sum the pushes with the same engine but never reach the hooks that probe it there."""
    import mxnet as mx

    sizes = sorted({int(k["elements"]) for k in tracker.keys.values() if k["bytes"] >= MEMORY_PROBE_MIN_BYTES})
    return [memory_probe(mx.nd.zeros((n,))) for n in sizes[-MEMORY_PROBE_MAX_SIZES:]]


# ---- servers -------------------------------------------------------------------------------------------------
class ServerRecorder:
    """A server's updater calls, timed: [key, start µs, end µs, bytes]."""

    def __init__(self, run_dir: str, index: int):
        self.run_dir = run_dir
        self.index = index  # launch order; the kvstore's rank replaces it once known
        self.rank: Optional[int] = None
        self.records: list[list] = []
        self.dropped = 0
        self.started_us = time.time_ns() / 1000.0
        self.written = False
        self.updates_written: Optional[int] = None  # the updates in the file as last written before exit
        self.memory: list[list[float]] = []  # the engine's copy and add, probed: [bytes, copy µs, add µs]
        self.cpu_marks: list[list[float]] = [[self.started_us, process_cpu_s()]]  # [epoch µs, CPU s], >= 20 ms apart
        # the optimizer the workers sent, not loaded (`watch_controller_errors`): "<Error>: <message>"
        self.optimizer_error: Optional[str] = None

    def probe(self, array) -> bool:
        """The engine's copy and add probed at this array's size, if it is a size not probed yet (at most
        MEMORY_PROBE_MAX_SIZES of them, each key's first update: in the warm-up or the calibration's discarded first
        round trip), outside the update's timing. True if it probed."""
        nbytes = _nbytes(array)
        if (nbytes < MEMORY_PROBE_MIN_BYTES or len(self.memory) >= MEMORY_PROBE_MAX_SIZES
                or any(row[0] == nbytes for row in self.memory)):
            return False
        try:
            self.memory.append(memory_probe(array))
        except Exception as exc:  # the updates are still written; the replay then prices no merging
            self.memory.append([nbytes, 0.0, 0.0])
            print(f"[dprorun] warning: the server's copy/add probe failed: {exc}", file=sys.stderr)
        return True

    def wrap(self, updater):
        def timed(key, recv, local):
            if self.written and key < CALIBRATION_KEY_BASE:  # the window's updates are in: the job's own pace
                # again (waiting for each update to time it serialises the server's keys; no difference in the
                # job's speed could be measured on this 2-core host: benchmarks/RESULTS.md, session 39)
                updater(key, recv, local)
                self._cpu_mark(time.time_ns() / 1000.0)
                return
            recv.wait_to_read()  # the workers' pushes merged (the server's engine sums them as they arrive)
            start = time.time_ns() / 1000.0
            updater(key, recv, local)
            local.wait_to_read()
            end = time.time_ns() / 1000.0
            # a row-sparse key: the rows the update touched (the pushes' merged rows; the stored table's count would
            # copy its indices at every update, and reading its rows copied it all: 13.9 ms a call for a 26 MB half
            # table), and no probe at the table's size
            sparse = _is_row_sparse(local)
            if len(self.records) < MAX_SERVER_RECORDS:
                self.records.append([int(key), start, end, _nbytes(recv if sparse else local)])
            else:
                self.dropped += 1
            self._cpu_mark(end)
            if not sparse and self.probe(local) and self.written:  # a calibration size: written again, with it
                self.write()
            if key >= CALIBRATION_KEY_BASE and not self.written:
                # the workers' end-of-window calibration has begun: every update of the window is in. Written
                # now, in the calibration's first (discarded) round trip: a server process does not always run
                # its exit handlers (ps-lite may end it from C++)
                self.written = True
                self.write()

        return timed

    def _cpu_mark(self, now_us: float) -> None:
        if now_us - self.cpu_marks[-1][0] >= CPU_MARK_US and len(self.cpu_marks) < MAX_SERVER_RECORDS:
            self.cpu_marks.append([now_us, process_cpu_s()])  # the server's busy share, over the workers' window

    def write(self, at_exit: bool = False) -> None:
        """server.json: the updates up to now and every CPU mark up to now. Written at the end of the window (and
        after each calibration size probed), and again at exit with the same updates as then (the job's later ones
        stay out) and the CPU marks of the clean iterations after the window."""
        rank = self.rank if self.rank is not None else self.index
        folder = server_dir(self.run_dir, rank)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        if not at_exit or self.updates_written is None:
            self.updates_written = len(self.records)
        updates = self.records[:self.updates_written]
        doc = {"schema": SERVER_SCHEMA, "version": 1, "server": rank, "host": os.uname().nodename,
               "pid": os.getpid(), "started_us": self.started_us, "updates": updates, "dropped": self.dropped,
               "memory": self.memory, "cpu_marks": self.cpu_marks, "clock": {"source": "time.time_ns"},
               **({"optimizer_error": self.optimizer_error} if self.optimizer_error else {})}
        path = os.path.join(folder, SERVER_FILE)
        tmp = path + f".{os.getpid()}.tmp"
        with open(tmp, "w") as handle:
            json.dump(doc, handle)
        os.replace(tmp, path)


MEMORY_PROBE_MIN_BYTES = 64 << 10  # smaller keys' merging costs next to nothing
MEMORY_PROBE_MAX_SIZES = 8  # distinct key sizes probed, at most


def memory_probe(array, repeats: int = 5) -> list[float]:
    """[bytes, copy µs, add µs]: the server's engine copying an array of `array`'s size into another and adding one
    to another (medians of `repeats`): what the server does with every push as it arrives (the first worker's
    copied into the merge buffer, the others' added to it) and with every pull (the stored value copied into its
    response). Built from the updater's own array (the server runs inside `import mxnet`: `mx.nd` is not there)."""
    import statistics

    source, target = array.copy(), array.copy()
    target.wait_to_read()
    copy, add = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        source.copyto(target)
        target.wait_to_read()
        copy.append((time.perf_counter() - start) * 1e6)
        start = time.perf_counter()
        target += source
        target.wait_to_read()
        add.append((time.perf_counter() - start) * 1e6)
    return [_nbytes(array), round(statistics.median(copy), 2), round(statistics.median(add), 2)]


def patch_mxnet_server(recorder: ServerRecorder) -> None:
    """The server's updater (what `set_optimizer` installs) timed; the server's rank from its kvstore."""
    from mxnet.kvstore import kvstore as kvstore_module

    kv_class = kvstore_module.KVStore
    original = kv_class._set_updater

    def set_updater(self, updater):
        try:
            recorder.rank = int(self.rank)
        except Exception:
            pass
        return original(self, recorder.wrap(updater))

    kv_class._set_updater = set_updater


def watch_controller_errors(recorder: ServerRecorder) -> None:
    """The server's controller (MXNet's ctypes callback that unpickles the optimizer the workers send) raising: ctypes
    reports it through sys.unraisablehook and the server goes on with no updater, storing the workers' summed pushes
    as the values each pull returns. The error is kept for the analysis to name (replay/ps_model.py), then reported
    as before."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        try:
            if "server_controller" in getattr(unraisable.object, "__qualname__", "") and not recorder.optimizer_error:
                recorder.optimizer_error = f"{type(unraisable.exc_value).__name__}: {unraisable.exc_value}"
        except Exception:
            pass
        previous(unraisable)

    sys.unraisablehook = hook


def install_server(environ) -> Optional[ServerRecorder]:
    """In a server process: record its updates and write them at exit (MXNet's server loop runs inside `import
    mxnet` and ends with sys.exit, so atexit runs); a server that wrote them at the end of the window writes its
    file again there, with the CPU marks of the iterations after the window (the clean ones)."""
    import atexit

    run_dir = environ.get("DPRO_RUN_DIR", "")
    if not run_dir:
        return None
    recorder = ServerRecorder(run_dir, int(environ.get("DPRO_MX_INDEX", "0")))
    watch_controller_errors(recorder)

    def write():
        try:
            recorder.write(at_exit=True)
        except Exception as exc:
            print(f"[dprorun] warning: server {recorder.rank} could not write its updates: {exc}", file=sys.stderr)

    atexit.register(write)
    return recorder
