"""Launch lines of other launchers read as dprorun's: horovodrun's (`dprorun --backend horovod ...`: what
launchers/horovodrun runs, and what `dprorun horovodrun ...` runs, as torchrun's: cli.torchrun_argv), and Hugging Face
Accelerate's `accelerate launch` (`dprorun accelerate launch ...`: accelerate_launch_argv, below).

Accepted: -np, -H/--hosts, -hostfile/--hostfile (read into -H), --gloo (the only controller used),
--timeline-filename (the whole job's timeline, copied there: HOROVOD_TIMELINE), --fusion-threshold-mb,
--cycle-time-ms, -i/--ssh-identity-file, -p/--ssh-port, --network-interface(s); the flags that tune Horovod or its
runner without changing what is profiled go to the real horovodrun as given (PASSED_WITH_VALUE, PASSED_SWITCHES).
Refused with why: --mpi / --jsrun (Gloo only), Horovod's own --autotune (it changes the fusion buffer and cycle time
while the job runs: a profile would mix settings; dprorun --autotune tunes them measured), elastic --min-np /
--max-np.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from dprorun.argtypes import parse_launch_line

PASSED_WITH_VALUE = ("--start-timeout", "--output-filename", "--config-file", "--cache-capacity",
                     "--stall-check-warning-time-seconds", "--stall-check-shutdown-time-seconds", "--num-nccl-streams",
                     "--thread-affinity", "--gloo-timeout-seconds", "--log-level", "--binding-args")
PASSED_SWITCHES = ("--disable-cache", "--verbose", "--hierarchical-allreduce", "--no-hierarchical-allreduce",
                   "--hierarchical-allgather", "--no-hierarchical-allgather", "--torus-allreduce",
                   "--no-torus-allreduce", "--no-autotune", "--timeline-mark-cycles", "--no-timeline-mark-cycles",
                   "--no-stall-check", "--stall-check", "--mpi-threads-disable", "--no-mpi-threads-disable", "--tcp",
                   "--log-with-timestamp", "--log-without-timestamp", "--log-hide-timestamp",
                   "--no-log-hide-timestamp", "-prefix-timestamp", "--prefix-output-with-timestamp")
REFUSED = {"--mpi": "dprorun runs Horovod with its Gloo controller only; drop --mpi",
           "--jsrun": "dprorun runs Horovod with its Gloo controller only; drop --jsrun",
           "--autotune": "Horovod's own autotuning changes the fusion buffer and cycle time while the job runs, so a "
                         "profile would mix settings; drop it (dprorun --autotune tunes them by measured trials)",
           "--min-np": "elastic Horovod (--min-np / --max-np) is not profiled: give a fixed -np",
           "--max-np": "elastic Horovod (--min-np / --max-np) is not profiled: give a fixed -np"}


def hostfile_hosts(path: str) -> str:
    """horovodrun's hostfile ("host slots=N" a line, # comments) as -H's host:slots,..."""
    hosts = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            slots = next((w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")), "1")
            hosts.append(f"{words[0]}:{int(slots)}")
    return ",".join(hosts)


def _horovodrun_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="horovodrun (dprorun)", allow_abbrev=False)
    parser.add_argument("-np", "--num-proc", dest="np", type=int, required=True)
    parser.add_argument("-H", "--hosts", dest="hosts", default="")
    parser.add_argument("--gloo", action="store_true")
    parser.add_argument("--timeline-filename", default="")
    parser.add_argument("--fusion-threshold-mb", type=float, default=None)
    parser.add_argument("--cycle-time-ms", type=float, default=None)
    parser.add_argument("-i", "--ssh-identity-file", default=None)
    parser.add_argument("-p", "--ssh-port", type=int, default=None)
    parser.add_argument("-hostfile", "--hostfile", default="")
    parser.add_argument("--network-interfaces", "--network-interface", dest="nics", default=None)
    for flag in PASSED_WITH_VALUE:
        parser.add_argument(flag, dest="passed", action="append", type=lambda v, f=flag: f"{f}={v}")
    for flag in PASSED_SWITCHES:
        parser.add_argument(flag, dest="passed", action="append_const", const=flag)
    for flag in REFUSED:
        parser.add_argument(flag, dest=f"refused_{flag.strip('-').replace('-', '_')}", nargs="?", const=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    return parser


def horovodrun_argv(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """A horovodrun launch line -> (dprorun's argv, the environment it needs: HOROVOD_TIMELINE where a timeline
    file was asked for, which the launch copies the whole job's timeline to). Usage errors exit as argparse's."""
    parser = _horovodrun_parser()
    args = parse_launch_line(parser, argv)
    for flag, why in REFUSED.items():
        if getattr(args, f"refused_{flag.strip('-').replace('-', '_')}", None):
            parser.error(f"{flag}: {why}")
    if not args.command:
        parser.error("no training command given")
    if args.hostfile:
        if args.hosts:
            parser.error("give -H or --hostfile, not both")
        args.hosts = hostfile_hosts(args.hostfile)
    out = ["--backend", "horovod"] + (["--network-interfaces", args.nics] if args.nics else [])
    out += [f"--horovodrun-flag={flag}" for flag in args.passed or ()]
    if args.hosts:
        hosts = [h.split(":") for h in args.hosts.split(",") if h]
        slots = sum(int(h[1]) if len(h) > 1 else 1 for h in hosts)
        if slots != args.np:
            parser.error(f"-np {args.np} does not match the {slots} slots of -H {args.hosts}")
        out += ["--hosts", args.hosts]
    else:
        out += ["-np", str(args.np)]
    for flag, value in (("--fusion-threshold-mb", args.fusion_threshold_mb), ("--cycle-time-ms", args.cycle_time_ms),
                        ("--ssh-identity-file", args.ssh_identity_file), ("--ssh-port", args.ssh_port)):
        if value is not None:
            out += [flag, str(value)]
    env = {}
    if args.timeline_filename:  # the user asked for Horovod's timeline of the whole job, in that file
        out += ["--horovod-full-timeline"]
        env["HOROVOD_TIMELINE"] = os.path.abspath(args.timeline_filename)
    command = list(args.command[1:]) if args.command[:1] == ["--"] else list(args.command)
    return out + ["--"] + command, env


ACCELERATE_REFUSED_SWITCHES = ("--use_fsdp", "--use_deepspeed", "--use_megatron_lm", "--use_xpu", "--tpu",
                               "--tpu_use_cluster", "--same_network", "--enable_cpu_affinity")
ACCELERATE_REFUSED_WITH_VALUE = ("--mpirun_hostfile", "--rdzv_backend", "--max_restarts", "--monitor_interval")
ACCELERATE_REFUSED = ACCELERATE_REFUSED_SWITCHES + ACCELERATE_REFUSED_WITH_VALUE
ACCELERATE_REFUSED_TYPES = ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA", "TPU")


def _accelerate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dprorun accelerate launch", allow_abbrev=False,
                                     description="accelerate launch's line, as dprorun runs it")

    def both(*names: str) -> list[str]:  # accelerate takes --num_processes and --num-processes alike
        return [n for name in names for n in dict.fromkeys((name, name.replace("_", "-")))]
    parser.add_argument(*both("--config_file"), default=None)
    parser.add_argument(*both("--num_processes"), type=int, default=None)
    parser.add_argument(*both("--num_machines"), type=int, default=None)
    parser.add_argument(*both("--machine_rank"), type=int, default=None)
    parser.add_argument(*both("--main_process_ip"), default=None)
    parser.add_argument(*both("--main_process_port"), type=int, default=None)
    parser.add_argument(*both("--mixed_precision"), choices=("no", "fp16", "bf16", "fp8"), default=None)
    parser.add_argument(*both("--dynamo_backend"), default=None)
    parser.add_argument(*both("--dynamo_mode"), default=None)
    parser.add_argument(*both("--dynamo_use_fullgraph"), action="store_true")
    parser.add_argument(*both("--dynamo_use_dynamic"), action="store_true")
    parser.add_argument(*both("--gpu_ids"), default=None)
    parser.add_argument("--cpu", action="store_true")
    for switch in ("--multi_gpu", "--debug", "--quiet", "-q"):  # dprorun launches the ranks; the rest is output
        parser.add_argument(*both(switch), action="store_true")
    parser.add_argument("-m", "--module", action="store_true")
    parser.add_argument(*both("--no_python"), action="store_true")
    for flag in ACCELERATE_REFUSED:
        parser.add_argument(*both(flag), dest=f"refused_{flag.strip('-')}", default=None,
                            **({"action": "store_true"} if flag in ACCELERATE_REFUSED_SWITCHES else {}))
    parser.add_argument("training_script")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def accelerate_config(path: Optional[str]) -> dict:
    """accelerate's config file (YAML; or JSON): the one given, else its default one where it exists
    ($HF_HOME/accelerate/default_config.yaml, HF_HOME defaulting to $XDG_CACHE_HOME/huggingface)."""
    if path is None:
        home = os.environ.get("HF_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")), "huggingface")
        path = os.path.join(home, "accelerate", "default_config.yaml")
        if not os.path.exists(path):
            return {}
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"accelerate's config file {path}: {exc.strerror}") from exc
    if path.endswith(".json"):
        import json

        config = json.loads(text)
    else:
        try:
            import yaml
        except ImportError as exc:
            raise ValueError(f"reading accelerate's config file {path} needs PyYAML (pip install pyyaml)") from exc
        config = yaml.safe_load(text)
    if not isinstance(config, dict):
        raise ValueError(f"accelerate's config file {path}: not a mapping of settings")
    return config


def accelerate_launch_argv(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """`accelerate launch [flags] script [args]` -> (dprorun's argv, the environment accelerate's launcher gives the
    script: ACCELERATE_MIXED_PRECISION, ACCELERATE_USE_CPU, ACCELERATE_DYNAMO_*). The flags override the config
    file's settings, as in accelerate; --num_processes is the job's total, over --num_machines. FSDP, DeepSpeed,
    Megatron-LM and TPU launches are refused (dprorun profiles DDP); so are accelerate's own multi-node launchers'
    flags. Usage errors exit as argparse's."""
    parser = _accelerate_parser()
    args = parse_launch_line(parser, argv)
    refused = [f for f in ACCELERATE_REFUSED if getattr(args, f"refused_{f.strip('-')}") not in (None, False)]
    if refused:
        parser.error(f"{', '.join(refused)}: not under dprorun, which launches and profiles DDP ranks itself; "
                     "drop them (FSDP and DeepSpeed are not profiled)")
    try:
        config = accelerate_config(args.config_file)
    except ValueError as exc:
        parser.error(str(exc))
    kind = str(config.get("distributed_type", "") or "").upper()
    if kind in ACCELERATE_REFUSED_TYPES:
        parser.error(f"accelerate's config asks for distributed_type {kind}: dprorun profiles DDP ranks, not {kind}; "
                     "give a config (--config_file) for MULTI_CPU / MULTI_GPU or none")

    def setting(name: str, default=None):
        value = getattr(args, name)
        return value if value is not None and value is not False else config.get(name, default)
    machines = int(setting("num_machines", 1) or 1)
    out: list[str] = []
    processes = setting("num_processes")
    if processes is not None:
        if int(processes) < 1 or int(processes) % machines:
            parser.error(f"--num_processes {processes} over --num_machines {machines}: a whole number of processes "
                         "a machine is needed")
        out += ["--nproc-per-node", str(int(processes) // machines)]
    if machines > 1:
        out += ["--nnodes", str(machines), "--node-rank", str(setting("machine_rank", 0) or 0)]
    if setting("main_process_ip"):
        out += ["--master-addr", str(setting("main_process_ip"))]
    if setting("main_process_port"):
        out += ["--master-port", str(setting("main_process_port"))]
    dynamo = config.get("dynamo_config") or {}
    env = {"ACCELERATE_MIXED_PRECISION": str(setting("mixed_precision", "no") or "no").lower(),
           "ACCELERATE_USE_CPU": str(bool(args.cpu or config.get("use_cpu", False))),
           "ACCELERATE_DYNAMO_BACKEND": str(args.dynamo_backend or dynamo.get("dynamo_backend", "no")).upper()}
    for name in ("dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic"):
        flag = getattr(args, name) or dynamo.get(name)
        key = "ACCELERATE_" + name.upper()
        if flag:
            env[key] = "True" if flag is True else str(flag)
    if args.debug or config.get("debug"):
        env["ACCELERATE_DEBUG_MODE"] = "true"
    gpu_ids = setting("gpu_ids")
    if gpu_ids not in (None, "all"):
        env["CUDA_VISIBLE_DEVICES"] = str(gpu_ids)
    if args.module and args.no_python:
        parser.error("--module and --no_python cannot be used together (as in accelerate)")
    command = ([] if args.no_python else [sys.executable] + (["-m"] if args.module else []))
    return out + ["--"] + command + [args.training_script] + list(args.training_script_args), env


FABRIC_REFUSED_STRATEGIES = ("dp", "deepspeed", "fsdp")  # prefixes: deepspeed_stage_1, ... too


def _fabric_run_parser() -> argparse.ArgumentParser:
    """Lightning Fabric's `fabric run` (and `lightning run model`) options, as its CLI takes them."""
    parser = argparse.ArgumentParser(prog="fabric run (dprorun)", allow_abbrev=False)
    parser.add_argument("--accelerator", default=None)
    parser.add_argument("--strategy", default=None)
    parser.add_argument("--devices", default="1")
    parser.add_argument("--num-nodes", "--num_nodes", dest="num_nodes", type=int, default=1)
    parser.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0)
    parser.add_argument("--main-address", "--main_address", dest="main_address", default=None)
    parser.add_argument("--main-port", "--main_port", dest="main_port", type=int, default=None)
    parser.add_argument("--precision", default=None)
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


def _fabric_processes(accelerator: Optional[str], devices: str, parser: argparse.ArgumentParser) -> int:
    """The processes `fabric run` starts on this machine for --devices: a count, a list of device ids, or auto (one
    on CPU; every GPU this machine has otherwise)."""
    text = str(devices).strip()
    on_cpu = accelerator == "cpu" or (accelerator in (None, "auto") and not _cuda_count())
    if text == "auto":
        return 1 if on_cpu else max(1, _cuda_count())
    if text.lstrip("-").isdigit():
        count = int(text)
        return _cuda_count() if count == -1 and not on_cpu else count
    ids = [part for part in text.strip("[]").split(",") if part.strip()]
    if ids and all(part.strip().isdigit() for part in ids) and not on_cpu:
        return len(ids)
    parser.error(f"--devices {devices}: give a number of processes (or a list of GPU ids on a GPU machine)")
    return 0


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def fabric_run_argv(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """`fabric run [options] script [args]` (Lightning Fabric's CLI, `lightning run model` before it) -> (dprorun's
    argv, the LT_* variables its launcher gives the script, which Fabric() reads). Under dprorun as it is, the CLI's
    own torchrun started ranks no hook saw, inside a rank of dprorun's. --devices is per node, as in Fabric; DataParallel
    ("dp"), DeepSpeed and FSDP strategies are refused (dprorun profiles DDP)."""
    parser = _fabric_run_parser()
    args = parse_launch_line(parser, argv)
    strategy = str(args.strategy or "")
    if any(strategy.startswith(name) for name in FABRIC_REFUSED_STRATEGIES):
        parser.error(f"--strategy {strategy}: dprorun launches and profiles DDP ranks, not {strategy}; use ddp (or "
                     "ddp_find_unused_parameters_true)")
    if args.num_nodes < 1 or not 0 <= args.node_rank < args.num_nodes:
        parser.error(f"--node-rank {args.node_rank} of --num-nodes {args.num_nodes}: out of range")
    out = ["--nproc-per-node", str(_fabric_processes(args.accelerator, args.devices, parser))]
    if args.num_nodes > 1:
        out += ["--nnodes", str(args.num_nodes), "--node-rank", str(args.node_rank),
                "--master-addr", args.main_address or "127.0.0.1", "--master-port", str(args.main_port or 29400)]
    else:
        out += (["--master-addr", args.main_address] if args.main_address else []) + (
            ["--master-port", str(args.main_port)] if args.main_port else [])
    env = {"LT_CLI_USED": "1", "LT_DEVICES": str(args.devices), "LT_NUM_NODES": str(args.num_nodes)}
    for name in ("accelerator", "strategy", "precision"):
        if getattr(args, name) is not None:
            env[f"LT_{name.upper()}"] = str(getattr(args, name))
    return out + ["--", sys.executable, args.script] + list(args.script_args), env
