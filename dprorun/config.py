"""Configuration dataclasses: what the CLI parses into, and what reaches each rank through DPRO_* variables."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping, Optional

ENV_PREFIX = "DPRO_"


def _parse_float_list(text: str) -> list[float]:
    text = text.strip()
    return [float(part) for part in text.split(",") if part.strip()] if text else []


@dataclass
class ProfileConfig:
    """What the hooks in each rank record. Travels to ranks as DPRO_* environment variables."""

    run_dir: str = ""
    job_id: str = ""
    warmup: int = 5  # iterations before the profiled window
    # profiled iterations: 15 leaves 11 without the profiler (its 3, and the one its export disturbs, are left
    # out) for the replay's per-iteration statistics, which want >= 10
    active: int = 15
    clean: int = 10  # iterations after the window timed without the profiler (the run's own reference; 5 scattered too widely to judge by)
    kineto: bool = True  # run torch.profiler during the window
    kineto_iters: int = 3  # the profiler runs for the first N active iterations only (it costs 10-30 %)
    record_shapes: bool = False  # costs 6-25 % per profiled iteration on small CPU models
    param_hooks: bool = True  # per-parameter gradient-ready times
    comm_hook: bool = True  # time every bucket with a DDP comm hook (off: DDP's built-in all-reduce)
    sample_interval_s: float = 0.2  # psutil / NVML sampling period
    comm_detail: str = "bucket"  # "bucket" (hook + gloo span) or "ring" (explicit chunked ring)
    launch_host: str = ""  # hostname of the node that owns the run directory
    max_trace_mb: float = 512.0  # a rank's trace larger than this is dropped with a warning
    min_free_mb: float = 256.0  # traces are not written when they would leave less free disk than this
    dry_run: bool = False  # stop the job after the window
    measure_variants: bool = False  # rank 0 times eager / torch.compile / bf16 on its model after the window
    horovod_timeline: str = ""  # Horovod: the coordinator's timeline path, recorded in the detailed tier only
    clock_skew_us: list[float] = field(default_factory=list)  # test knob: per-rank clock shift
    fake_hosts: list[str] = field(default_factory=list)  # test knob: per-rank host name
    test_fault: str = ""  # test knob: "profiler" makes the profiler fail inside the window; "tf-stop-crash:N"
    # aborts worker 1 inside TensorFlow's profiler stop in launch attempts 1..N (launch.relaunch_after_tf_stop_crash)
    launch_attempt: int = 1  # which launch of the job this is (a job relaunched after TensorFlow's profiler crashed)

    _ENV = {
        "run_dir": "RUN_DIR",
        "job_id": "JOB_ID",
        "warmup": "WARMUP",
        "active": "ACTIVE",
        "clean": "CLEAN",
        "kineto": "KINETO",
        "kineto_iters": "KINETO_ITERS",
        "record_shapes": "RECORD_SHAPES",
        "param_hooks": "PARAM_HOOKS",
        "comm_hook": "COMM_HOOK",
        "sample_interval_s": "SAMPLE_INTERVAL_S",
        "comm_detail": "COMM_DETAIL",
        "launch_host": "LAUNCH_HOST",
        "max_trace_mb": "MAX_TRACE_MB",
        "min_free_mb": "MIN_FREE_MB",
        "dry_run": "DRY_RUN",
        "measure_variants": "MEASURE_VARIANTS",
        "horovod_timeline": "HOROVOD_TIMELINE",
        "clock_skew_us": "TEST_CLOCK_SKEW_US",
        "fake_hosts": "TEST_HOSTS",
        "test_fault": "TEST_FAULT",
        "launch_attempt": "LAUNCH_ATTEMPT",
    }

    def to_env(self) -> dict[str, str]:
        env = {ENV_PREFIX + "ENABLED": "1"}
        for attr, suffix in self._ENV.items():
            value = getattr(self, attr)
            if isinstance(value, bool):
                text = "1" if value else "0"
            elif isinstance(value, list):
                text = ",".join(str(v) for v in value)
            else:
                text = str(value)
            env[ENV_PREFIX + suffix] = text
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "ProfileConfig":
        cfg = cls()
        for attr, suffix in cls._ENV.items():
            raw = environ.get(ENV_PREFIX + suffix)
            if raw is None:
                continue
            current = getattr(cfg, attr)
            try:
                if isinstance(current, bool):
                    value = raw.strip().lower() in ("1", "true", "yes", "on")
                elif isinstance(current, int):
                    value = int(raw)
                elif isinstance(current, float):
                    value = float(raw)
                elif attr == "clock_skew_us":
                    value = _parse_float_list(raw)
                elif attr == "fake_hosts":
                    value = [h.strip() for h in raw.split(",") if h.strip()]
                else:
                    value = raw
            except ValueError as exc:
                raise ValueError(f"{ENV_PREFIX}{suffix}={raw!r}: {exc}") from None
            setattr(cfg, attr, value)
        cfg.check()
        return cfg

    def check(self) -> None:
        """ValueError naming what is wrong with the window (the CLI says it before launching; a rank given bad
        DPRO_* variables runs unprofiled with it)."""
        if self.warmup < 0 or self.active < 1 or self.clean < 0 or self.kineto_iters < 0:
            raise ValueError(f"the profiling window needs --warmup >= 0, --active >= 1, --clean >= 0, --kineto-iters "
                             f">= 0 (given {self.warmup}, {self.active}, {self.clean}, {self.kineto_iters})")
        if self.comm_detail not in ("bucket", "ring"):
            raise ValueError(f"comm detail must be 'bucket' or 'ring', not {self.comm_detail!r}")

    def skew_for(self, rank: int) -> float:
        return self.clock_skew_us[rank] if rank < len(self.clock_skew_us) else 0.0

    def host_for(self, rank: int, real_host: str) -> str:
        return self.fake_hosts[rank] if rank < len(self.fake_hosts) else real_host


@dataclass
class ElasticAgentOptions:
    """torchrun's settings of its agent (torch >= 2.12's flags), handed to torch elastic as they are: the default
    backend's launch only (launch._launch_elastic; the torchrun launcher gets them as flags)."""

    numa_binding: Optional[str] = None  # --numa-binding: node | socket | exclusive | core-complex (needs CUDA)
    signals_to_handle: Optional[str] = None  # --signals-to-handle: signals the agent forwards, comma-separated
    duplicate_stdout_filters: list[str] = field(default_factory=list)  # --duplicate-stdout-filters
    duplicate_stderr_filters: list[str] = field(default_factory=list)  # --duplicate-stderr-filters
    virtual_local_rank: bool = False  # --virtual-local-rank: LOCAL_RANK 0 in every rank, one GPU visible each
    event_log_handler: Optional[str] = None  # --event-log-handler
    shutdown_timeout_s: Optional[int] = None  # --shutdown-timeout: SIGTERM to SIGKILL at teardown (dprorun: 5 s)
    max_restarts: Optional[int] = None  # --max-restarts: torch elastic restarts the ranks after a failure (None: 0)

    def given(self) -> bool:
        return self != ElasticAgentOptions()


@dataclass
class LaunchConfig:
    """Where and how the ranks start: the launch engine's settings (torch elastic, horovodrun, the PS roles)."""

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = None
    hosts: list[str] = field(default_factory=list)
    launcher: str = "elastic"  # "elastic" (torch.distributed.elastic in-process) or "torchrun"
    backend: str = "ddp"  # ddp | horovod | tf | mxnet
    timeout_s: Optional[float] = None
    join_timeout_s: Optional[float] = None  # rendezvous: how long node 0 waits for the others (900 s multi-node)
    servers: int = 1  # --backend mxnet: parameter servers
    mxnet_python: str = ""  # --backend mxnet: the interpreter of the roles ("": found at launch)
    role: str = "default"  # the ranks' ROLE_NAME (torchrun's --role)
    console_ranks: Optional[list[int]] = None  # local ranks whose output the console shows (None: all)
    agent: ElasticAgentOptions = field(default_factory=ElasticAgentOptions)  # torchrun's agent flags, handed on

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


TIMELINE_MODES = ("auto", "window", "job", "off")


@dataclass
class HorovodConfig:
    """What goes to horovodrun (--backend horovod)."""

    args: list[str] = field(default_factory=list)  # fusion threshold, cycle time
    timeline: str = "auto"  # one of TIMELINE_MODES: Horovod's timeline over the window's detailed iterations, the
    # whole job, none, or auto (window for horovod.tensorflow scripts, none for horovod.torch: launch._launch_horovod)
    ssh_args: list[str] = field(default_factory=list)  # ssh identity / port / NICs (multi-host)


@dataclass
class OutputConfig:
    """Where the run goes and what is printed."""

    run_dir: str = ""
    quiet: bool = False
    json_summary: bool = False


@dataclass
class PredictConfig:
    """--dry-run: the world size and bandwidth to predict for (None: as run)."""

    np: Optional[int] = None
    bandwidth_gbit: Optional[float] = None


@dataclass
class AutotuneConfig:
    """--autotune: the search and the rule that keeps its strategy."""

    enabled: bool = False
    min_gain: float = 0.01  # a strategy is kept only when measured faster by more than this fraction
    variants: bool = True  # the profiling phase times torch.compile / bf16 (op fusion, precision)
    allow_bf16: bool = False  # bf16 autocast changes the numerics: searched only when the user says so
    memory_budget_bytes: Optional[int] = None
    max_trials: int = 3  # Horovod / TF / MXNet: the best-ranked knob settings that get a real trial window
    # measured rounds before a strategy is kept: the winning trial and the job's own settings each measured again
    # (rounds - 1 more windows each, interleaved), kept only if faster in every round (launch-to-launch noise)
    rounds: int = 2


@dataclass
class JobConfig:
    """One dprorun invocation, as parsed from the command line: the command and one config per concern."""

    command: list[str]
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    horovod: HorovodConfig = field(default_factory=HorovodConfig)
    predict: PredictConfig = field(default_factory=PredictConfig)
    autotune: AutotuneConfig = field(default_factory=AutotuneConfig)
    strategy_file: Optional[str] = None  # --strategy / autotune's trials: applied by the hooks (DPRO_STRATEGY)
    low_disk: Optional[str] = None  # decided at launch: why profiling is off (too little free disk), or None


def profile_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(ENV_PREFIX + "ENABLED", "") == "1"


def horovod_knob_args(threshold_mb: Optional[float], cycle_ms: Optional[float]) -> list[str]:
    """horovodrun's flags for a fusion threshold and a cycle time (None: left to horovodrun)."""
    out = []
    if threshold_mb is not None:
        out += ["--fusion-threshold-mb", f"{threshold_mb:g}"]
    if cycle_ms is not None:
        out += ["--cycle-time-ms", f"{cycle_ms:g}"]
    return out
