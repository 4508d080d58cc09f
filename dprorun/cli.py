"""`dprorun`: a drop-in for torchrun that profiles the job. Parses the command line into a JobConfig."""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import uuid
from typing import Optional, Sequence

from dprorun import __version__
from dprorun.argtypes import mark_command, non_negative_float, positive_float
from dprorun.fsutil import TraceError
from dprorun.procs import StdoutThatOutlivesItsReader, python_flag_without_the_hooks, refuse_script_from_stdin
from dprorun.config import AutotuneConfig, HorovodConfig, JobConfig, LaunchConfig, OutputConfig, PredictConfig, \
    TIMELINE_MODES, ProfileConfig, horovod_knob_args
from dprorun.scheduler_env import SchedulerEnv, detect_scheduler, horovod_plan
from dprorun.torchrun_flags import add_torchrun_arguments, agent_options, console_ranks, rdzv_conf, torchrun_notes

USAGE_EXAMPLE = "dprorun -np 2 python examples/mlp_many_layers.py --steps 30"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dprorun",
        description="Launch a distributed training job like torchrun, profile it (compute, per-bucket "
                    "communication, host/GPU samples) and gather every rank's trace into one run directory.",
        epilog=f"example: {USAGE_EXAMPLE}")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _job_arguments(parser.add_argument_group("job"))
    add_torchrun_arguments(parser.add_argument_group("torchrun's other flags (a torchrun launch line runs as it is)"))
    _mxnet_arguments(parser.add_argument_group("mxnet (with --backend mxnet)"))
    _horovod_arguments(parser.add_argument_group("horovod (with --backend horovod)"))
    _profiling_arguments(parser.add_argument_group("profiling"))
    _mode_arguments(parser.add_argument_group("modes"))
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true",
                     help="print the end-of-job summary as JSON, alone on stdout (the ranks' output goes to stderr); "
                          "a run with no summary prints its outcome")
    out.add_argument("-q", "--quiet", action="store_true", help="no summary at the end")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training command, e.g. python train.py")
    return parser


def _ranks_per_node(value: str) -> int:
    """-np: a number, or torchrun's auto / cpu / gpu (xpu, ...), counted by torchrun's own rule (a GPU each where
    one is asked or seen, else a core each)."""
    try:
        return int(value)
    except ValueError:
        pass
    from torch.distributed.run import determine_local_world_size

    try:
        return determine_local_world_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r}: a number of ranks, or auto, cpu or gpu ({exc})") from None


def _job_arguments(job) -> None:
    job.add_argument("-np", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=_ranks_per_node, default=1,
                     help="ranks on this node (default 1); as torchrun's, also auto, cpu or gpu (one a core or a GPU)")
    # torchrun's spellings with underscores too (--nproc_per_node=8), and its --standalone (one node, a local
    # rendezvous: dprorun's default), so a launch line written for torchrun runs as it is
    job.add_argument("--standalone", action="store_true",
                     help="as torchrun's: one node with a local rendezvous (the default here; --nnodes must be 1)")
    job.add_argument("-m", "--module", action="store_true",
                     help="as torchrun's: the command is a Python module to run (python -m MODULE ARGS)")
    job.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, metavar="HOST[:PORT]",
                     help="as torchrun's: read as --master-addr / --master-port (nodes are ranked by --node-rank)")
    job.add_argument("--rdzv-backend", "--rdzv_backend", default=None, help="accepted as torchrun's (c10d)")
    job.add_argument("--rdzv-id", "--rdzv_id", default=None, help="as torchrun's: the job id (--job-id)")
    job.add_argument("--max-restarts", "--max_restarts", type=int, default=None,
                     help="as torchrun's: after a rank fails, torch elastic stops every rank and starts them again, "
                          "this many times at most (default 0); the run keeps the last attempt's profile, an earlier "
                          "attempt's files go to RUN/failed_attempt_<n>/ (--backend ddp)")
    # --nnodes, --node-rank, --master-addr, --master-port: None when left out, then SLURM's or a PyTorchJob's values
    job.add_argument("--nnodes", type=_node_count, default=None,
                     help="number of nodes (torchrun-style multi-node; default 1, or SLURM's / a PyTorchJob's); "
                          "torchrun's MIN:MAX only as a fixed count (N:N)")
    job.add_argument("--node-rank", "--node_rank", type=int, default=None,
                     help="this node's index (0 owns the run directory; default 0, or the scheduler's)")
    job.add_argument("--master-addr", "--master_addr", default=None,
                     help="address of node 0 (default 127.0.0.1, or the scheduler's)")
    job.add_argument("--master-port", "--master_port", type=int, default=None,
                     help="port on node 0 (default: a free port, or the scheduler's)")
    job.add_argument("-H", "--hosts", default="",
                     help="host1:slots,host2:slots (horovodrun's -H); run the same command on every host and each "
                          "finds its node rank here (sets --nnodes, --node-rank, --master-addr, -np)")
    job.add_argument("--launcher", choices=("elastic", "torchrun"), default="elastic",
                     help="elastic: torch.distributed.elastic in this process (default); torchrun: hand the "
                          "launch to the torchrun CLI")
    job.add_argument("--backend", choices=("ddp", "horovod", "byteps", "tf", "mxnet"), default="ddp",
                     help="framework of the job: ddp (torch.distributed), horovod (run through horovodrun), "
                          "byteps (run through bpslaunch, one per machine and role, with BytePS's tracing), tf "
                          "(TensorFlow MultiWorkerMirroredStrategy workers, TF_CONFIG set per worker) or mxnet "
                          "(MXNet kvstore parameter server: a scheduler, --servers servers and -np workers)")
    job.add_argument("--timeout", type=positive_float, default=None, help="stop the job after this many seconds")
    job.add_argument("--join-timeout", type=positive_float, default=None,
                     help="seconds to wait for every node to join (default 900 multi-node, 60 single-node)")


def _node_count(value: str) -> int:
    """--nnodes N, or torchrun's elastic MIN:MAX where both are N (dprorun profiles a fixed set of nodes)."""
    low, _, high = value.partition(":")
    try:
        nodes = int(low)
        if high and int(high) != nodes:
            raise argparse.ArgumentTypeError(
                f"{value}: torchrun's elastic node range; dprorun runs (and profiles) a fixed number of nodes: give "
                f"--nnodes N (or N:N)")
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: a number of nodes (or N:N)") from None
    return nodes


def _mxnet_arguments(mxg) -> None:
    mxg.add_argument("--servers", type=int, default=1,
                     help="parameter servers per node (default 1; across hosts every node starts this many)")
    mxg.add_argument("--mxnet-python", default=None,
                     help="the Python the roles run with when the command starts with python (default: "
                          "$DPRO_MXNET_PYTHON, else this Python if it imports mxnet, else the environment "
                          "scripts/install-mxnet made)")


def _horovod_arguments(hvd) -> None:
    hvd.add_argument("--fusion-threshold-mb", type=non_negative_float, default=None,
                     help="horovodrun --fusion-threshold-mb")
    hvd.add_argument("--cycle-time-ms", type=positive_float, default=None, help="horovodrun --cycle-time-ms")
    hvd.add_argument("--ssh-identity-file", default=None,
                     help="horovodrun --ssh-identity-file (multi-host: horovodrun reaches the other hosts by ssh)")
    hvd.add_argument("--ssh-port", type=int, default=None, help="horovodrun --ssh-port")
    hvd.add_argument("--network-interfaces", default=None,
                     help="horovodrun --network-interfaces (the NICs its ranks talk over, e.g. eth0)")
    hvd.add_argument("--horovod-timeline", choices=TIMELINE_MODES, default="auto",
                     help="Horovod's timeline: window (the profiling window's detailed iterations; it needs Horovod's "
                          "dynamic timeline mode, which slowed Horovod's jobs here by 14-20 %% for the whole job), job "
                          "(the whole job), off, or auto (default: window for horovod.tensorflow scripts, whose "
                          "all-reduce spans come from it; off for horovod.torch, whose hooks time every all-reduce)")
    hvd.add_argument("--horovod-full-timeline", action="store_true", help="the same as --horovod-timeline job")
    hvd.add_argument("--horovodrun-flag", dest="horovodrun_flags", action="append", default=[], metavar="FLAG[=V]",
                     help="one more horovodrun flag, given as it is (e.g. --horovodrun-flag=--cache-capacity=1024); "
                          "launchers/horovodrun passes Horovod's tuning and runner flags so")


def _profiling_arguments(prof) -> None:
    prof.add_argument("--run-dir", default="", help="run directory (default dpro_runs/<job-id>)")
    prof.add_argument("--job-id", default="", help="job id (default: time + random suffix)")
    prof.add_argument("--overwrite", action="store_true",
                      help="replace a run directory that already holds a run (default: refuse, keeping it)")
    prof.add_argument("--warmup", type=int, default=None, help="iterations before the profiled window (5)")
    prof.add_argument("--active", type=int, default=None, help="profiled iterations (15)")
    prof.add_argument("--clean", type=int, default=None,
                      help="iterations timed after the window without the profiler (10)")
    prof.add_argument("--no-kineto", action="store_true", help="do not run torch.profiler in the window")
    prof.add_argument("--kineto-iters", type=int, default=None,
                      help="run torch.profiler for the first N active iterations only (3)")
    prof.add_argument("--record-shapes", action="store_true", help="record op input shapes (slower)")
    prof.add_argument("--no-param-hooks", action="store_true", help="do not record per-parameter grad times")
    prof.add_argument("--no-comm-hook", action="store_true",
                      help="keep DDP's built-in all-reduce (buckets are then timed only by the profiler)")
    prof.add_argument("--measure-variants", action="store_true",
                      help="after the window, rank 0 times its model eager, under torch.compile and under bf16 "
                           "autocast (for the optimizer's op-fusion and precision passes; --autotune does this)")
    prof.add_argument("--comm-detail", choices=("bucket", "ring"), default=None,
                      help="bucket: per-bucket queue/transmission (default); ring: explicit chunked ring")


def _mode_arguments(modes) -> None:
    modes.add_argument("--dry-run", action="store_true",
                       help="run only the profiling window, stop the ranks, print the predicted iteration time "
                            "for -np ranks (which may exceed what this machine holds; see --local-np)")
    modes.add_argument("--local-np", type=int, default=None,
                       help="with --dry-run: ranks actually launched here (default: -np)")
    modes.add_argument("--bandwidth", default=None, help="with --dry-run: predict for this link bandwidth")
    modes.add_argument("--autotune", action="store_true",
                       help="profile a window, search a strategy, try it, and run the job with it only if it is "
                            "measured faster (never-regress)")
    modes.add_argument("--autotune-min-gain", type=float, default=0.01, metavar="FRACTION",
                       help="keep the strategy only when the trial is faster by more than this (default 0.01)")
    modes.add_argument("--autotune-trials", type=int, default=3, metavar="N",
                       help="with --autotune on Horovod, TensorFlow and MXNet jobs: at most N of the knob settings "
                            "the replay ranks best get a real trial window (default 3)")
    modes.add_argument("--autotune-rounds", type=int, default=2, metavar="N",
                       help="with --autotune: a trial that beats the profile is confirmed in N-1 more rounds (the "
                            "job's own settings, then the trial's, each a window again); it is kept only if faster "
                            "in every round (default 2; 1: one comparison, at the mercy of launch-to-launch noise)")
    modes.add_argument("--allow-bf16", action="store_true",
                       help="with --autotune: the search may choose bf16 autocast (it changes the training's "
                            "numerics; without this flag a bf16 gain is only reported)")
    modes.add_argument("--no-compute-passes", action="store_true",
                       help="with --autotune: do not time torch.compile and bf16 autocast on the model (no op "
                            "fusion or precision pass; saves the compile time)")
    modes.add_argument("--strategy", default=None, metavar="FILE",
                       help="run with a strategy.json (from dpro optimize or an earlier --autotune)")
    modes.add_argument("--memory-budget", default=None, help="with --autotune: per-rank peak memory, e.g. 8GiB")


def _parse_hosts(spec: str) -> list[tuple[str, int]]:
    hosts = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, slots = item.partition(":")
        hosts.append((name, int(slots) if slots else 1))
    return hosts


def _node_rank_for(hosts: list[tuple[str, int]]) -> int:
    names = {socket.gethostname(), socket.getfqdn(), "localhost", "127.0.0.1"}
    for index, (name, _) in enumerate(hosts):
        if name in names:
            return index
    raise ValueError(f"this host ({socket.gethostname()}) is not in --hosts "
                     f"{','.join(h for h, _ in hosts)}; run dprorun on each listed host")


def profile_config_from_env_and_args(args: argparse.Namespace) -> ProfileConfig:
    cfg = ProfileConfig.from_env(os.environ)  # DPRO_* variables are defaults; flags win
    for attr in ("warmup", "active", "clean", "comm_detail", "kineto_iters"):
        value = getattr(args, attr)
        if value is not None:
            setattr(cfg, attr, value)
    if args.no_kineto:
        cfg.kineto = False
    if args.record_shapes:
        cfg.record_shapes = True
    if args.no_param_hooks:
        cfg.param_hooks = False
    if args.no_comm_hook:
        cfg.comm_hook = False
    if args.measure_variants:
        cfg.measure_variants = True
    cfg.check()
    return cfg


def horovod_arguments(args: argparse.Namespace) -> list[str]:
    """horovodrun's fusion knobs: the command line's, else the strategy's (--strategy)."""
    threshold, cycle = args.fusion_threshold_mb, args.cycle_time_ms
    if args.strategy:
        from dprorun.strategy import load_strategy

        strategy = load_strategy(args.strategy)
        threshold = threshold if threshold is not None else strategy.horovod_fusion_threshold_mb
        cycle = cycle if cycle is not None else strategy.horovod_cycle_time_ms
    return horovod_knob_args(threshold, cycle)


LAUNCH_DEFAULTS = (("nnodes", "--nnodes", 1), ("node_rank", "--node-rank", 0),
                   ("master_addr", "--master-addr", "127.0.0.1"), ("master_port", "--master-port", None))


def apply_scheduler(args: argparse.Namespace) -> Optional[SchedulerEnv]:
    """Under SLURM or a Kubernetes PyTorchJob (dprorun/scheduler_env.py) the launch flags left out take the
    scheduler's values (explicit flags win; --hosts turns detection off), then torchrun's defaults. Horovod gets the
    job's nodes as --hosts. Says on stderr what was taken."""
    scheduler = None if args.hosts else detect_scheduler(os.environ)
    if scheduler is not None:
        given = [flag for attr, flag, _ in LAUNCH_DEFAULTS if getattr(args, attr) is not None]
        line = scheduler.description
        if args.backend == "horovod":
            hosts, line = horovod_plan(scheduler)
            args.hosts = ",".join(f"{host}:{args.nproc}" for host in hosts)  # then as --hosts: horovodrun -H
        for attr, _, _ in LAUNCH_DEFAULTS:
            if getattr(args, attr) is None:
                setattr(args, attr, getattr(scheduler, attr))
        print(f"dprorun: {line}" + (f" ({', '.join(given)} given: the flags win)" if given else ""),
              file=sys.stderr, flush=True)
    for attr, _, default in LAUNCH_DEFAULTS:
        if getattr(args, attr) is None:
            setattr(args, attr, default)
    if not args.hosts and args.nnodes >= 1 and not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"node rank {args.node_rank} is outside 0..{args.nnodes - 1} (--nnodes {args.nnodes})")
    return scheduler


def _torchrun_rendezvous(args: argparse.Namespace) -> bool:
    """torchrun's rendezvous flags on a launch line: the endpoint read as the master's address and port (explicit
    --master-* flags win), the id as the job id; True where nodes were left to the rendezvous to rank (no
    --node-rank), which dprorun does not do across nodes."""
    if args.rdzv_id and not args.job_id:
        args.job_id = args.rdzv_id
    endpoint = args.rdzv_endpoint
    if not endpoint:
        return False
    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
    if args.master_addr is None:
        args.master_addr = host
    if port and args.master_port is None:
        args.master_port = int(port)
    return args.node_rank is None


def job_from_args(args: argparse.Namespace) -> JobConfig:
    """argv (parsed) -> one JobConfig: a config per concern, each built and checked by its own function."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ValueError(f"no training command given; example: {USAGE_EXAMPLE}")
    if args.module:
        command = [sys.executable, "-m", *command]
    if args.standalone:
        if (args.nnodes or 1) > 1:
            raise ValueError(f"--standalone runs one node, not --nnodes {args.nnodes} (as under torchrun)")
        args.nnodes = 1  # explicit: a scheduler's node count (SLURM) does not replace it
    unranked = _torchrun_rendezvous(args)
    scheduler = apply_scheduler(args)
    if unranked and scheduler is None and args.nnodes > 1:
        raise ValueError(f"--rdzv-endpoint with --nnodes {args.nnodes}: dprorun ranks the nodes itself; give each "
                         "node its --node-rank (0 on the node that keeps the run directory)")
    predict_np = _local_np(args)
    job = JobConfig(command=command, launch=launch_config(args),
                    output=OutputConfig(quiet=args.quiet, json_summary=args.json), horovod=horovod_config(args),
                    autotune=autotune_config(args), strategy_file=_strategy_file(args))
    refuse_script_from_stdin(command, 3 if args.backend == "mxnet" else job.launch.nproc_per_node)
    job.profile = profile_config_from_env_and_args(args)
    if args.backend == "mxnet" and args.kineto_iters is None and "DPRO_KINETO_ITERS" not in os.environ:
        # mx.profiler costs MXNet's operators little (profiled iterations were no slower), and the PS model wants
        # several complete profiled iterations: the first 8 of the window
        job.profile.kineto_iters = min(8, job.profile.active)
    job.profile.dry_run = job.profile.dry_run or args.dry_run
    job.predict = PredictConfig(np=predict_np or job.launch.world_size)
    if args.bandwidth:
        from dprorun.offline_cli import parse_bandwidth

        job.predict.bandwidth_gbit = parse_bandwidth(args.bandwidth)
    job_id = args.job_id or job.profile.job_id or (scheduler.job_id if scheduler else None)
    if not job_id and job.launch.nnodes > 1:  # every node must name the job alike, as torchrun's --rdzv-id does
        job_id = f"job-{job.launch.master_addr}-{job.launch.master_port}".replace(":", "_")
    job_id = job_id or (time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6])
    job.profile.job_id = job_id
    job.output.run_dir = os.path.abspath(args.run_dir or job.profile.run_dir or os.path.join("dpro_runs", job_id))
    job.profile.run_dir = job.output.run_dir
    job.profile.launch_host = socket.gethostname()
    return job


PYTHON_OPTIONS_WITH_VALUE = ("-W", "-X", "--check-hash-based-pycs")


def _check_script_exists(command: list[str]) -> None:
    """`python SCRIPT ...` run here with a SCRIPT that is not there: said before any rank starts (each rank's python
    would say "can't open file", exit 2, and dprorun could name no cause); -m, -c and other programs are left to run."""
    if not os.path.basename(command[0]).startswith("python"):
        return
    words = iter(command[1:])
    for word in words:
        if word in PYTHON_OPTIONS_WITH_VALUE:
            next(words, None)
        elif word in ("-m", "-c", "-") or word.startswith(("-m", "-c")):
            return
        elif not word.startswith("-"):
            if not os.path.exists(word):
                raise FileNotFoundError(f"the training script {word!r} does not exist (in {os.getcwd()}): {command[0]} "
                                 "would fail to open it on every rank")
            return


def _local_np(args: argparse.Namespace) -> Optional[int]:
    """--dry-run --local-np L: L ranks run here, the prediction is for -np x --nnodes (returned; else None)."""
    if args.nproc < 1 or args.nnodes < 1:
        raise ValueError("-np and --nnodes must be at least 1")
    if args.local_np is None:
        return None
    if not args.dry_run:
        raise ValueError("--local-np goes with --dry-run")
    if args.local_np < 1:
        raise ValueError("--local-np must be at least 1")
    predict_np, args.nproc = args.nproc * args.nnodes, args.local_np
    return predict_np


def launch_config(args: argparse.Namespace) -> LaunchConfig:
    """Where the ranks start: the launch flags (after the scheduler's defaults), --hosts, the PS roles."""
    launch = LaunchConfig(nproc_per_node=args.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                          master_addr=args.master_addr, master_port=args.master_port, launcher=args.launcher,
                          backend=args.backend, timeout_s=args.timeout, join_timeout_s=args.join_timeout,
                          role=args.role, console_ranks=console_ranks(args.local_ranks_filter),
                          agent=agent_options(args))
    join = rdzv_conf(args).get("join_timeout")
    if join and launch.join_timeout_s is None:
        launch.join_timeout_s = float(join)
    if args.hosts:
        hosts = _parse_hosts(args.hosts)
        slots = {s for _, s in hosts}
        if len(slots) != 1:
            raise ValueError("--hosts: every host needs the same number of slots")
        launch.hosts = [h for h, _ in hosts]
        launch.nnodes, launch.nproc_per_node = len(hosts), slots.pop()
        # Horovod: horovodrun on this host starts every host's ranks (over ssh), so dprorun runs once, here
        launch.node_rank = 0 if args.backend == "horovod" else _node_rank_for(hosts)
        launch.master_addr = hosts[0][0]
        launch.master_port = launch.master_port or 29500
    if launch.nnodes > 1 and launch.master_port is None:
        launch.master_port = 29500
    if args.backend == "mxnet":
        if args.servers < 1:
            raise ValueError("--servers must be at least 1")
        launch.servers = args.servers
        launch.mxnet_python = args.mxnet_python or ""
    elif args.servers != 1:
        raise ValueError("--servers goes with --backend mxnet")
    return launch


def horovod_config(args: argparse.Namespace) -> HorovodConfig:
    """horovodrun's knobs and ssh settings (--backend horovod; empty otherwise)."""
    if args.backend != "horovod":
        return HorovodConfig()
    ssh = (["--ssh-identity-file", os.path.abspath(args.ssh_identity_file)] if args.ssh_identity_file else []) + \
        (["--ssh-port", str(args.ssh_port)] if args.ssh_port else []) + \
        (["--network-interfaces", args.network_interfaces] if args.network_interfaces else [])
    timeline = "job" if args.horovod_full_timeline else args.horovod_timeline
    return HorovodConfig(args=horovod_arguments(args) + list(args.horovodrun_flags), timeline=timeline, ssh_args=ssh)


def autotune_config(args: argparse.Namespace) -> AutotuneConfig:
    if args.autotune and args.dry_run:
        raise ValueError("--autotune and --dry-run are separate modes")
    if args.autotune and args.strategy:
        raise ValueError("--autotune searches its own strategy; --strategy runs a given one")
    if not 0 <= args.autotune_min_gain < 1:
        raise ValueError("--autotune-min-gain is a fraction in [0, 1)")
    if args.autotune_trials < 1:
        raise ValueError("--autotune-trials is at least 1")
    if args.autotune_rounds < 1:
        raise ValueError("--autotune-rounds is at least 1")
    if args.allow_bf16 and not args.autotune:
        raise ValueError("--allow-bf16 goes with --autotune (dpro optimize has its own --allow-bf16)")
    budget = None
    if args.memory_budget:
        from dprorun.offline_cli import parse_bytes

        budget = parse_bytes(args.memory_budget)
    return AutotuneConfig(enabled=args.autotune, min_gain=args.autotune_min_gain, variants=not args.no_compute_passes,
                          allow_bf16=args.allow_bf16, memory_budget_bytes=budget, max_trials=args.autotune_trials,
                          rounds=args.autotune_rounds)


def _strategy_file(args: argparse.Namespace) -> Optional[str]:
    if not args.strategy:
        return None
    from dprorun.strategy import load_strategy

    load_strategy(args.strategy)  # a bad file is an error now, not a warning in every rank
    return os.path.abspath(args.strategy)


def run_byteps(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """--backend byteps: BytePS starts its processes itself (bpslaunch per machine and role, DMLC_* variables), so
    dprorun hands the command to bpslaunch with tracing on (dprorun/byteps_launch.py); launch options do not
    apply."""
    from dprorun.byteps_launch import run

    command = [c for c in args.command]
    if command and command[0] == "--":
        command = command[1:]
    given = [flag for flag, on in (("-np", args.nproc != 1), ("--nnodes", args.nnodes not in (None, 1)),
                                   ("--hosts", args.hosts),
                                   ("--dry-run", args.dry_run), ("--autotune", args.autotune),
                                   ("--strategy", args.strategy)) if on]
    if given:
        parser.error(f"{', '.join(given)}: not with --backend byteps (bpslaunch runs once per machine and role, "
                     "as set by DMLC_ROLE, DMLC_NUM_WORKER, ...); give the training command and --run-dir")
    environ = dict(os.environ)
    if args.run_dir:
        environ["DPRO_RUN_DIR"] = os.path.abspath(args.run_dir)
    launchers = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launchers")
    return run(command, shim_dir=launchers, environ=environ)


TORCHRUN_MODULES = ("torch.distributed.run",)
TORCH_LAUNCH_MODULE = "torch.distributed.launch"  # torchrun's deprecated predecessor: `--local-rank=N` to the script
OTHER_LAUNCHERS = {"mpirun": "dprorun --backend horovod -np N python train.py (Horovod), or dprorun -np N ...",
                   "mpiexec": "dprorun --backend horovod -np N python train.py (Horovod), or dprorun -np N ...",
                   "bpslaunch": "dprorun --backend byteps ... (or launchers/bpslaunch)",
                   "deepspeed": "dprorun -np N python train.py for a DDP script (DeepSpeed's engine is not profiled)"}
LOCAL_RANK_MACRO = "${local_rank}"  # torch elastic's agent puts each rank's local rank in its arguments


def torchrun_argv(argv: Sequence[str]) -> list[str]:
    """A torchrun launch line (its flags, then the script and its arguments) as dprorun's argv: the flags as they
    are (dprorun's parser reads torchrun's), then `--` and the command, a script run with this Python as torchrun
    runs it (unless --no-python or -m)."""
    parser = build_parser()
    parser.prog = "torchrun (dprorun)"
    parser.add_argument("--no-python", "--no_python", dest="no_python", action="store_true",
                        help="as torchrun's: run the command itself, not with Python")
    argv = mark_command(parser, argv)
    args = parser.parse_args(argv)
    command = list(args.command[1:]) if args.command[:1] == ["--"] else list(args.command)
    if not command:
        parser.error("no training script given")
    head = [a for a in argv[:len(argv) - len(args.command)] if a not in ("--no-python", "--no_python")]
    if not args.no_python and not args.module:
        command = [sys.executable] + command  # torchrun runs the script with Python
    return head + ["--"] + command


def torch_launch_argv(argv: Sequence[str]) -> list[str]:
    """A `python -m torch.distributed.launch` line as dprorun's argv: torchrun's flags, and, as that launcher does
    unless --use-env is given, `--local-rank=<the rank's local rank>` right after the script (scripts written for it
    parse that argument; torch elastic's agent fills it in per rank)."""
    argv = list(argv)
    use_env = any(a in ("--use-env", "--use_env") for a in argv)
    line = torchrun_argv([a for a in argv if a not in ("--use-env", "--use_env")])
    if use_env:
        return line
    split = line.index("--")
    command = line[split + 1:]
    module = any(a in ("-m", "--module") for a in line[:split])
    if command[0] != sys.executable and not module:
        raise ValueError("torch.distributed.launch with --no-python needs --use-env, as the launcher itself says: "
                         "the rank's local rank is then in LOCAL_RANK")
    script_end = 1 if module else 2  # the module's name (run as python -m), or the interpreter and the script
    return line[:split + 1] + command[:script_end] + [f"--local-rank={LOCAL_RANK_MACRO}"] + command[script_end:]


def _nested_launcher(command: Sequence[str]) -> tuple[str, list[str]]:
    """(launcher, its arguments) where the command is itself a launcher (`dprorun torchrun ...`, `dprorun python -m
    torch.distributed.run ...`, horovodrun, mpirun); ("", []) otherwise."""
    words = [w for w in command if w != "--"][:3]
    if not words:
        return "", []
    start = command.index(words[0])
    name = os.path.basename(words[0])
    if name in ("torchrun", "horovodrun") or name in OTHER_LAUNCHERS:
        return name, list(command[start + 1:])
    if name == "accelerate-launch" or (name == "accelerate" and len(words) > 1 and words[1] == "launch"):
        return "accelerate", list(command[start + (1 if name == "accelerate-launch" else 2):])
    if name == "fabric" and words[1:2] == ["run"]:  # Lightning Fabric's CLI (`lightning run model` before it)
        return "fabric", list(command[start + 2:])
    if name == "lightning" and words[1:3] == ["run", "model"]:
        return "fabric", list(command[start + 3:])
    if name.startswith("python") and len(words) > 2 and words[1] == "-m" and \
            (words[2] in TORCHRUN_MODULES or words[2] in OTHER_LAUNCHERS or words[2] == TORCH_LAUNCH_MODULE):
        return ("torchrun" if words[2] in TORCHRUN_MODULES else words[2]), list(command[start + 3:])
    return "", []


def _own_flags_last(own: list[str], launch_line: list[str]) -> list[str]:
    """A launch line read as dprorun's argv (its flags, `--`, the command) with dprorun's own flags after its flags:
    where both set one (`dprorun --dry-run -np 8 --local-np 2 accelerate launch --num_processes 2 ...`), dprorun's
    own, the more explicit, wins (the launch line's count had made that a prediction for 2)."""
    split = launch_line.index("--") if "--" in launch_line else len(launch_line)
    return launch_line[:split] + own + launch_line[split:]


def main(argv: Optional[Sequence[str]] = None) -> int:
    if not isinstance(sys.stdout, StdoutThatOutlivesItsReader):  # `dprorun ... | head`
        sys.stdout, sys.stderr = StdoutThatOutlivesItsReader(sys.stdout), StdoutThatOutlivesItsReader(sys.stderr)
    parser = build_parser()
    argv = mark_command(parser, sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    launcher, launcher_args = _nested_launcher(args.command)
    own = argv[:len(argv) - len(args.command)]
    if launcher == "torchrun":  # `dprorun [options] torchrun ...`: the launch line read as dprorun's own
        args = parser.parse_args(_own_flags_last(own, torchrun_argv(launcher_args)))
    elif launcher == TORCH_LAUNCH_MODULE:
        try:
            args = parser.parse_args(_own_flags_last(own, torch_launch_argv(launcher_args)))
        except ValueError as exc:
            parser.error(str(exc))
    elif launcher == "horovodrun":  # as launchers/horovodrun reads it
        from dprorun.launch_lines import horovodrun_argv

        horovod_argv, env = horovodrun_argv(launcher_args)
        os.environ.update(env)
        args = parser.parse_args(_own_flags_last(own, horovod_argv))
    elif launcher in ("accelerate", "fabric"):  # their launchers would start ranks of their own inside a rank
        from dprorun.launch_lines import accelerate_launch_argv, fabric_run_argv

        line_argv, env = (accelerate_launch_argv if launcher == "accelerate" else fabric_run_argv)(launcher_args)
        os.environ.update(env)
        args = parser.parse_args(_own_flags_last(own, line_argv))
    elif launcher:
        parser.error(f"the command is a launcher ({launcher}): dprorun launches the ranks itself, and one launched "
                     f"inside a rank would start ranks the hooks never see; run {OTHER_LAUNCHERS[launcher]}")
    if args.backend == "byteps":
        return run_byteps(args, parser)
    try:
        job = job_from_args(args)
        if launcher == "fabric":  # Fabric() checks its devices and nodes against the ranks' world: dprorun's own
            os.environ.update(LT_DEVICES=str(job.launch.nproc_per_node), LT_NUM_NODES=str(job.launch.nnodes))
        if not job.launch.hosts:
            _check_script_exists(job.command)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(str(exc))
        return 2
    except (TraceError, FileNotFoundError) as exc:
        print(f"dprorun: error: {exc}", file=sys.stderr)
        return 2
    for note in torchrun_notes(args):
        print(f"dprorun: {note}", file=sys.stderr)
    flag = python_flag_without_the_hooks(job.command)
    if flag:
        print(f"dprorun: warning: the ranks' python runs with {flag}: dprorun's hooks, a sitecustomize on PYTHONPATH, "
              "cannot load, and the job runs unprofiled (as under torchrun); drop the flag to profile it",
              file=sys.stderr)
    if job.launch.node_rank == 0:  # node 0 owns the run directory (others may share its filesystem)
        from dprorun.layout import claim_run_dir

        problem = claim_run_dir(job.output.run_dir, overwrite=args.overwrite)
        if problem:
            print(f"dprorun: error: {problem}", file=sys.stderr)
            return 2
    from dprorun.launch import launch
    from dprorun.finalize import finalize_run

    try:
        if job.autotune.enabled:
            from dprorun.autotune import run_autotune

            return run_autotune(job, launch, finalize_run)
        result = launch(job)
        return finalize_run(job, result)
    except (ValueError, FileNotFoundError) as exc:
        print(f"dprorun: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a launch (which stops the ranks itself): the job-end analysis
        print(f"\ndprorun: interrupted (SIGINT); the run directory is kept: {job.output.run_dir} (`dpro summary` and "
              "`dpro report` analyze what it holds)", file=sys.stderr)
        return 130


def console_main(argv: Optional[Sequence[str]] = None) -> int:
    """`dprorun` as a command: main(), then the collector kept off the objects this process holds for its teardown.
    The launcher holds torch's module graph (torch elastic imports torch); collecting its cycles at interpreter exit
    took 0.25 s of every command's end (measured: 0.45 s from the summary to the exit, 0.2 s frozen). Nothing the
    launcher wrote waits on a finalizer: its files are closed where written, and the interpreter still flushes
    stdout and stderr. The drop-in launchers (launchers/) end the same way, with the argv they translated."""
    code = main(argv)
    import gc

    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(console_main())
