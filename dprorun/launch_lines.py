"""horovodrun's launch line read as dprorun's (`dprorun --backend horovod ...`): what launchers/horovodrun runs, and
what `dprorun horovodrun ...` runs (the launch line behind dprorun, as torchrun's: cli.torchrun_argv).

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
from typing import Sequence

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
    args = parser.parse_args(list(argv))
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
    return out + ["--"] + list(args.command), env
