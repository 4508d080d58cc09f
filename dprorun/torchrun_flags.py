"""torchrun's own flags as dprorun reads them (a torchrun launch line runs as it is): those honoured, those handed to
torch elastic's agent (config.ElasticAgentOptions), those accepted and said to change nothing (`torchrun_notes`)."""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from dprorun.config import ElasticAgentOptions


def add_torchrun_arguments(run) -> None:
    """torchrun's flags for where output goes and how its agent runs: --local-ranks-filter and --role are honoured;
    --rdzv-conf's join_timeout is read as --join-timeout; the rest are accepted and said to change nothing (dprorun
    tees each rank's output, prefixed, and keeps it in RUN/logs)."""
    run.add_argument("--local-ranks-filter", "--local_ranks_filter", dest="local_ranks_filter", default=None,
                     metavar="RANKS", help="as torchrun's: the console shows only these local ranks' output "
                                           "(e.g. 0 or 0,1); every rank's is kept in RUN/logs")
    run.add_argument("--role", default="default", help="as torchrun's: the ranks' role name (ROLE_NAME)")
    run.add_argument("--rdzv-conf", "--rdzv_conf", dest="rdzv_conf", default="", metavar="KEY=VALUE,...",
                     help="as torchrun's: join_timeout is read as --join-timeout; other keys change nothing")
    for flags, dest in ((("--tee",), "tee"), (("--redirects", "-r"), "redirects"), (("--log-dir", "--log_dir"),
                        "log_dir"), (("--monitor-interval", "--monitor_interval"), "monitor_interval"),
                        (("--start-method", "--start_method"), "start_method"),
                        (("--local-addr", "--local_addr"), "local_addr")):
        run.add_argument(*flags, dest=dest, default=None, help="as torchrun's; accepted, changes nothing here")
    run.add_argument("--run-path", "--run_path", dest="run_path", action="store_true",
                     help="as torchrun's; accepted (the script runs with Python either way)")
    run.add_argument("--logs-specs", "--logs_specs", dest="logs_specs", default=None,
                     help="as torchrun's; accepted, changes nothing here (dprorun's logs: RUN/logs)")
    # torchrun's agent settings (torch >= 2.12), handed to torch elastic as they are (config.ElasticAgentOptions)
    run.add_argument("--numa-binding", "--numa_binding", dest="numa_binding", default=None,
                     choices=("node", "socket", "exclusive", "core-complex"),
                     help="as torchrun's: bind each rank to CPUs near its GPU (needs CUDA GPUs)")
    run.add_argument("--signals-to-handle", "--signals_to_handle", dest="signals_to_handle", default=None,
                     help="as torchrun's: signals the agent forwards to the ranks (comma-separated)")
    for stream in ("stdout", "stderr"):
        run.add_argument(f"--duplicate-{stream}-filters", f"--duplicate_{stream}_filters",
                         dest=f"duplicate_{stream}_filters", default="",
                         help=f"as torchrun's: {stream} lines with these words (comma-separated) copied to a file")
    run.add_argument("--virtual-local-rank", "--virtual_local_rank", dest="virtual_local_rank", action="store_true",
                     help="as torchrun's: LOCAL_RANK 0 in every rank, each seeing its own GPU only")
    run.add_argument("--event-log-handler", "--event_log_handler", dest="event_log_handler", default=None,
                     help="as torchrun's: a registered handler of torch elastic's events")
    run.add_argument("--shutdown-timeout", "--shutdown_timeout", dest="shutdown_timeout", type=int, default=None,
                     help="as torchrun's: seconds from SIGTERM to SIGKILL when the ranks are stopped (dprorun: 5)")


def torchrun_notes(args: argparse.Namespace) -> list[str]:
    """What dprorun did with torchrun's flags that change nothing here, to say at launch."""
    given = [f"--{dest.replace('_', '-')}" for dest in ("tee", "redirects", "log_dir", "monitor_interval",
                                                         "start_method", "local_addr") if getattr(args, dest, None)]
    given += ["--run-path"] if getattr(args, "run_path", False) else []
    given += ["--logs-specs"] if getattr(args, "logs_specs", None) else []
    notes = [f"torchrun's {', '.join(given)} accepted, changing nothing here: dprorun tees each rank's output to the "
             "console with a [rankN]: prefix and keeps it in the run directory's logs/"] if given else []
    conf = set(rdzv_conf(args))
    if conf - {"join_timeout"}:
        notes.append(f"torchrun's --rdzv-conf {', '.join(sorted(conf - {'join_timeout'}))} accepted, changing "
                     "nothing here: dprorun's rendezvous waits --join-timeout (or --rdzv-conf join_timeout)")
    return notes


def rdzv_conf(args: argparse.Namespace) -> dict[str, str]:
    """torchrun's --rdzv-conf KEY=VALUE,... as a dict."""
    return dict(item.partition("=")[::2] for item in (args.rdzv_conf or "").split(",") if item)


def console_ranks(value: Optional[str]) -> Optional[list[int]]:
    if not value:
        return None
    try:
        return sorted({int(rank) for rank in value.split(",") if rank.strip()})
    except ValueError:
        raise ValueError(f"--local-ranks-filter {value!r}: local ranks separated by commas (e.g. 0 or 0,1)") from None


def agent_options(args: argparse.Namespace) -> ElasticAgentOptions:
    """torchrun's agent flags as given; --numa-binding refused where there is no CUDA GPU to bind near (torchrun's
    ranks fail then: "Torch not compiled with CUDA enabled"), --virtual-local-rank and the rest for the default
    backend only."""
    def words(value: str) -> list[str]:
        return [w.strip() for w in (value or "").split(",") if w.strip()]

    agent = ElasticAgentOptions(numa_binding=args.numa_binding, signals_to_handle=args.signals_to_handle,
                                duplicate_stdout_filters=words(args.duplicate_stdout_filters),
                                duplicate_stderr_filters=words(args.duplicate_stderr_filters),
                                virtual_local_rank=args.virtual_local_rank, event_log_handler=args.event_log_handler,
                                shutdown_timeout_s=args.shutdown_timeout, max_restarts=args.max_restarts or None)
    if (args.max_restarts or 0) < 0:
        raise ValueError(f"--max-restarts {args.max_restarts}: a number of restarts, 0 or more")
    if args.max_restarts and args.launcher == "torchrun":
        print("dprorun: warning: --max-restarts under --launcher torchrun: torchrun's static rendezvous hands a "
              "restarted attempt the store of the attempt before, whose ranks' addresses the new ranks may read and "
              "fail to connect to (gloo's 'connectFullMesh failed'); dprorun's default launcher gives each attempt "
              "a store of its own", file=sys.stderr, flush=True)
    if agent.numa_binding:
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--numa-binding {agent.numa_binding}: it binds each rank to the CPUs near its GPU, and "
                             "this machine has no CUDA GPU (torchrun's ranks fail the same way); leave it out")
    if agent.given() and args.backend != "ddp":
        raise ValueError("torchrun's --numa-binding, --signals-to-handle, --duplicate-*-filters, --virtual-local-rank, "
                         "--event-log-handler, --shutdown-timeout and --max-restarts set torch elastic's agent, which "
                         f"--backend {args.backend} does not launch through; leave them out")
    return agent
