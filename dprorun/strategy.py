"""The optimizer's output: a versioned strategy that the hooks apply on restart and a training script can read.

strategy.json (schema version 1):
  buckets             gradient groups as parameter-name lists, in gradient-ready order (tensor fusion), or null
                      for DDP's own bucketing at `bucket_cap_mb`
  bucket_cap_mb       DDP's bucket cap to start from (null: the job's own)
  partitions          {"bucket<k>": pieces}: a bucket's all-reduce split into that many pieces (tensor partition)
  recompute_segments  activation checkpointing of the model in that many segments (0: none)
  accumulation_steps  micro-batches per optimizer step (needs the script's cooperation: printed, and readable
                      through `dprorun.strategy()`)
  precision           "fp32" or "bf16" (the hooks run the forward under bf16 autocast; searched with
                      --allow-bf16, from the model's measured bf16 timings)
  compiled_modules    names of submodules ("" for the whole model) whose forward the hooks torch.compile (op
                      fusion of that region; the search offers the whole model, from its measured timings)
  horovod_fusion_threshold_mb, horovod_cycle_time_ms
                      Horovod jobs: passed to horovodrun (--fusion-threshold-mb, --cycle-time-ms) on restart
  horovod_groups      Horovod jobs: grouped allreduce, DistributedOptimizer(groups=) as parameter-name lists
                      (applied by the hooks; not searched yet)
  tf_bytes_per_pack_mb
                      TensorFlow jobs: the all-reduce pack size (CommunicationOptions bytes_per_pack) the hooks
                      give MultiWorkerMirroredStrategy on restart (0: one pack)
  tf_xla              TensorFlow jobs: XLA auto-clustering on every worker (TF_XLA_FLAGS, given by the launcher on
                      restart): op fusion the replay cannot price, so --autotune measures it in a trial window
  mxnet_bigarray_bound
                      MXNet parameter-server jobs: MXNET_KVSTORE_BIGARRAY_BOUND (elements from which a key is split
                      over every server) that the launcher gives every role on restart
  mxnet_servers       MXNet parameter-server jobs: how many servers the launcher starts on restart (all nodes
                      together; across hosts a multiple of the nodes)
  mxnet_server_threads
                      MXNet parameter-server jobs: OMP_NUM_THREADS the launcher gives the servers on restart (their
                      OpenMP threads spin on the workers' cores: replay/ps_cpu.py), measured by --autotune in a
                      trial window, not priced by the replay
  decisions           each pass's decision with its predicted iteration time before and after
A training script that wants to cooperate (gradient accumulation) calls `dprorun.strategy()`, which reads the
file named by DPRO_STRATEGY (set by dprorun for the ranks), or returns None.
"""
from __future__ import annotations

import json
import os
import sys
import types
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from dprorun.fsutil import TraceError, atomic_write_json, read_json

SCHEMA_VERSION = 1
ENV_VAR = "DPRO_STRATEGY"


@dataclass
class Decision:
    """One step of the search: which pass, what it chose, and the predicted iteration time around it."""

    pass_name: str
    choice: str
    before_ms: float
    after_ms: float
    note: str = ""

    @property
    def gain_ms(self) -> float:
        return round(self.before_ms - self.after_ms, 4)

    def to_json(self) -> dict:
        return {**asdict(self), "gain_ms": self.gain_ms}


@dataclass
class Strategy:
    buckets: Optional[list[list[str]]] = None
    bucket_cap_mb: Optional[float] = None
    partitions: dict[str, int] = field(default_factory=dict)
    recompute_segments: int = 0
    accumulation_steps: int = 1
    precision: str = "fp32"
    compiled_modules: list[str] = field(default_factory=list)
    horovod_fusion_threshold_mb: Optional[float] = None  # Horovod jobs: HOROVOD_FUSION_THRESHOLD
    horovod_cycle_time_ms: Optional[float] = None  # Horovod jobs: HOROVOD_CYCLE_TIME
    horovod_groups: Optional[list[list[str]]] = None  # Horovod jobs: DistributedOptimizer(groups=), by name
    tf_bytes_per_pack_mb: Optional[float] = None  # TensorFlow jobs: CommunicationOptions(bytes_per_pack)
    tf_xla: bool = False  # TensorFlow jobs: XLA auto-clustering (TF_XLA_FLAGS) on every worker
    mxnet_bigarray_bound: Optional[int] = None  # MXNet PS jobs: MXNET_KVSTORE_BIGARRAY_BOUND
    mxnet_servers: Optional[int] = None  # MXNet PS jobs: the number of servers (all nodes together)
    mxnet_server_threads: Optional[int] = None  # MXNet PS jobs: the servers' OMP_NUM_THREADS
    baseline_ms: Optional[float] = None  # the job as it ran, replayed
    predicted_ms: Optional[float] = None  # with this strategy
    predicted_peak_bytes: Optional[int] = None
    memory_budget_bytes: Optional[int] = None
    decisions: list[Decision] = field(default_factory=list)
    source_run: str = ""
    search: dict[str, Any] = field(default_factory=dict)  # rounds, evaluations, seconds
    version: int = SCHEMA_VERSION

    def is_default(self) -> bool:
        return (self.buckets is None and self.bucket_cap_mb is None and not self.partitions
                and self.recompute_segments == 0 and self.accumulation_steps == 1 and self.precision == "fp32"
                and not self.compiled_modules
                and self.horovod_fusion_threshold_mb is None and self.horovod_cycle_time_ms is None
                and not self.horovod_groups and self.tf_bytes_per_pack_mb is None and not self.tf_xla
                and self.mxnet_bigarray_bound is None and self.mxnet_servers is None
                and self.mxnet_server_threads is None)

    def to_json(self) -> dict:
        doc = asdict(self)
        doc["decisions"] = [d.to_json() for d in self.decisions]
        return doc

    @classmethod
    def from_json(cls, doc: dict, path: str = "strategy") -> "Strategy":
        if not isinstance(doc, dict):
            raise TraceError(path, "a strategy is a JSON object")
        version = doc.get("version")
        if version != SCHEMA_VERSION:
            raise TraceError(path, f"strategy schema version {version!r}; this dprorun reads {SCHEMA_VERSION}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(doc) - known)
        if unknown:  # a misspelt knob would otherwise be dropped without a word
            raise TraceError(path, f"unknown setting(s) {', '.join(map(repr, unknown))}; a strategy has "
                                   f"{', '.join(sorted(known - {'version', 'decisions', 'search', 'source_run'}))}")
        values = {k: v for k, v in doc.items() if k in known and k != "decisions"}
        _check_ranges(values, path)
        buckets = values.get("buckets")
        if buckets is not None and not (isinstance(buckets, list) and
                                        all(isinstance(g, list) and all(isinstance(p, str) for p in g)
                                            for g in buckets)):
            raise TraceError(path, "buckets must be a list of lists of parameter names")
        parts = values.get("partitions") or {}
        if not isinstance(parts, dict) or not all(isinstance(v, int) and v >= 1 for v in parts.values()):
            raise TraceError(path, "partitions must map bucket keys to integers >= 1")
        hgroups = values.get("horovod_groups")
        if hgroups is not None and not (isinstance(hgroups, list) and all(
                isinstance(g, list) and all(isinstance(p, str) for p in g) for g in hgroups)):
            raise TraceError(path, "horovod_groups must be a list of lists of parameter names")
        compiled = values.get("compiled_modules") or []
        if not (isinstance(compiled, list) and all(isinstance(m, str) for m in compiled)):
            raise TraceError(path, "compiled_modules must be a list of module names")
        if values.get("precision", "fp32") not in ("fp32", "bf16"):
            raise TraceError(path, f"precision {values.get('precision')!r}: fp32 or bf16")
        decisions = []
        for d in doc.get("decisions", []):
            d = {k: v for k, v in d.items() if k in Decision.__dataclass_fields__}
            decisions.append(Decision(**d))
        return cls(**values, decisions=decisions)

    def summary_lines(self) -> list[str]:
        lines = []
        if self.baseline_ms is not None and self.predicted_ms is not None:
            gain = 100 * (1 - self.predicted_ms / self.baseline_ms) if self.baseline_ms else 0.0
            lines.append(f"predicted iteration time: {self.baseline_ms:.2f} ms as run -> {self.predicted_ms:.2f} ms "
                         f"with the strategy ({gain:+.1f} % faster)")
        for d in self.decisions:
            after = f"{d.after_ms:.2f} ms" if d.after_ms is not None else "not predicted"
            lines.append(f"  {d.pass_name}: {d.choice} ({d.before_ms:.2f} -> {after}"
                         f"{', ' + d.note if d.note else ''})")
        if self.accumulation_steps > 1:
            lines.append(f"  needs the script: accumulate gradients over {self.accumulation_steps} micro-batches "
                         "(batch / steps each, no_sync() for all but the last); dprorun.strategy() returns this")
        for note in self.search.get("recommendations", []):
            lines.append(f"  not applied: {note}")
        if self.search.get("caution"):
            lines.append(f"  caution: {self.search['caution']}")
        if self.is_default():
            lines.append("  the job's own settings are already the best found: nothing to change")
        return lines


def transport_caution(model) -> dict:
    """{"caution": ...} for a knob search's strategies where the job's transport ran on the cores its ranks compute
    on (a JobModel's `transport`, replay/predict.py says it of every what-if that moves communication): the knobs'
    predicted gains are then optimistic (a TF job on loopback: 0.25 MB packs predicted 8.3 % faster, measured 6 %
    slower, session 41), and the trial windows decide; {} otherwise."""
    transport = getattr(model, "transport", None) or {}
    if not transport.get("shares_cores"):
        return {}
    return {"caution": f"{shared_transport(transport)}: more or smaller collectives cost more than the replay "
                       "predicts, so these gains are optimistic; the trial windows decide"}


def shared_transport(transport: dict) -> str:
    """How a search says that the job's transport ran on its ranks' compute cores (a JobModel's `transport`)."""
    return (f"the job's transport is CPU work on the cores its ranks compute on (its all-reduces kept it busy "
            f"{100 * transport.get('transport_cpu_share', 0):.0f} % of their time)")


# knob -> (least value, whether the least is allowed): a hand-edited strategy out of range is refused, named
KNOB_RANGES = {"bucket_cap_mb": (0, False), "recompute_segments": (0, True), "accumulation_steps": (1, True),
               "horovod_fusion_threshold_mb": (0, True), "horovod_cycle_time_ms": (0, False),
               "tf_bytes_per_pack_mb": (0, True), "mxnet_bigarray_bound": (1, True), "mxnet_servers": (1, True),
               "mxnet_server_threads": (1, True)}


def _check_ranges(values: dict, path: str) -> None:
    for knob, (least, allowed) in KNOB_RANGES.items():
        value = values.get(knob)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < least or \
                (value == least and not allowed):
            raise TraceError(path, f"{knob} {value!r}: must be {'at least' if allowed else 'above'} {least}")


def save_strategy(strategy: Strategy, path: str) -> None:
    atomic_write_json(path, strategy.to_json(), indent=2)


def load_strategy(path: str) -> Strategy:
    return Strategy.from_json(read_json(path), path)


def current() -> Optional[Strategy]:
    """For training scripts: the strategy dprorun runs this job with (None outside dprorun or without one).
    Also callable as `dprorun.strategy()`."""
    path = os.environ.get(ENV_VAR)
    if not path:
        return None
    return load_strategy(path)


def strategy_json(strategy_: Strategy) -> str:
    return json.dumps(strategy_.to_json(), indent=2)


class _CallableModule(types.ModuleType):
    """`dprorun.strategy` is this module; calling it returns current() (the API issue 6 names)."""

    def __call__(self) -> Optional[Strategy]:
        return current()


sys.modules[__name__].__class__ = _CallableModule
