"""Where the job runs: the node count, node rank, master address and port a cluster scheduler already knows.

`detect_scheduler(environ)` reads them from the variables SLURM sets in a job step (`srun dprorun ...`, one task
per node) or that Kubernetes' training operator sets in a PyTorchJob / TrainJob pod, and returns None elsewhere.
The CLI uses them for the flags left out (explicit flags win). Nothing here keeps state; `scontrol` is asked only
to expand a SLURM node list (and for a node's address when its name does not resolve), with a pure-Python
expansion of the node list when it is missing or fails.
"""
from __future__ import annotations

import itertools
import re
import socket
import subprocess
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

SCONTROL_TIMEOUT_S = 5.0  # scontrol retries for a minute when it cannot read slurm.conf: never wait that long
SLURM_PORT_BASE = 20000  # below Linux's ephemeral ports (32768-60999)


@dataclass
class SchedulerEnv:
    """What one dprorun process learns from the scheduler about the job it belongs to."""

    scheduler: str  # "slurm" or "pytorchjob"
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: Optional[int]  # None: a free port (single-node)
    job_id: Optional[str]  # names the run directory and the rendezvous alike on every node; None: dprorun's default
    hosts: list[str] = field(default_factory=list)  # the job's nodes, first one first (Horovod's host list)
    in_step: bool = True  # SLURM: this process is one task of an srun step (False: the batch script itself)
    description: str = ""  # one line saying what was taken from where

    @property
    def scheduler_name(self) -> str:
        return {"slurm": "SLURM", "pytorchjob": "Kubernetes PyTorchJob"}.get(self.scheduler, self.scheduler)


# ---- SLURM node lists ----------------------------------------------------------------------------------------

def split_host_expressions(nodelist: str) -> list[str]:
    """'n[1-3,5],m7' -> ['n[1-3,5]', 'm7']: split on the commas outside brackets."""
    parts, depth, current = [], 0, []
    for char in nodelist:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"SLURM node list {nodelist!r}: ']' without '['")
        if char == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise ValueError(f"SLURM node list {nodelist!r}: '[' without ']'")
    parts.append("".join(current).strip())
    return [part for part in parts if part]


def expand_range_set(ranges: str, nodelist: str) -> list[str]:
    """'1-3,5' -> ['1', '2', '3', '5']; '098-101' keeps the lower bound's width: ['098', ..., '101']."""
    numbers = []
    for item in ranges.split(","):
        low, _, high = item.strip().partition("-")
        high = high or low
        if not (low.isdigit() and high.isdigit()) or int(high) < int(low):
            raise ValueError(f"SLURM node list {nodelist!r}: invalid range {item.strip()!r}")
        numbers += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return numbers


def expand_host_expression(expression: str, nodelist: str) -> list[str]:
    """'rack[1-2]n[01,03]' -> rack1n01, rack1n03, rack2n01, rack2n03 (every bracket group, in order)."""
    pieces = re.split(r"\[([^\]]*)\]", expression)  # literal, ranges, literal, ranges, ..., literal
    choices = [[piece] if index % 2 == 0 else expand_range_set(piece, nodelist)
               for index, piece in enumerate(pieces)]
    return ["".join(parts) for parts in itertools.product(*choices)]


def expand_nodelist_python(nodelist: str) -> list[str]:
    """The hosts of a SLURM node list, as `scontrol show hostnames` prints them: order kept, ranges expanded."""
    hosts = []
    for expression in split_host_expressions(nodelist):
        hosts += expand_host_expression(expression, nodelist)
    if not hosts:
        raise ValueError(f"SLURM node list {nodelist!r} names no host")
    return hosts


def run_scontrol(scontrol: Optional[str], args: list[str]) -> Optional[str]:
    """scontrol's standard output, or None when it is missing, fails, says nothing, or takes too long."""
    if not scontrol:
        return None
    try:
        proc = subprocess.run([scontrol] + args, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    return proc.stdout


def expand_nodelist(nodelist: str, scontrol: Optional[str] = "scontrol") -> list[str]:
    """`scontrol show hostnames NODELIST` when it works (it knows this SLURM's syntax), else the Python expansion."""
    output = run_scontrol(scontrol, ["show", "hostnames", nodelist])
    hosts = output.split() if output else []
    return hosts or expand_nodelist_python(nodelist)


def resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
        return True
    except (OSError, UnicodeError):
        return False


def node_address(host: str, scontrol: Optional[str] = "scontrol",
                 resolvable: Callable[[str], bool] = resolves) -> str:
    """The address to reach a SLURM node at: its name when that resolves, else its NodeAddr from slurm.conf
    (`scontrol show node`: several emulated nodes on one machine, or nodes named apart from their DNS names)."""
    if resolvable(host):
        return host
    output = run_scontrol(scontrol, ["-o", "show", "node", host]) or ""
    match = re.search(r"(?:^|\s)NodeAddr=(\S+)", output)
    return match.group(1) if match and match.group(1) != "(null)" else host


def slurm_port(job_id: int, step_id: int) -> int:
    """The rendezvous port of a SLURM job step, the same on every node: 20000 + (job id mod 1000) x 10 + step mod 10
    (steps run one after another in a batch script get different ports)."""
    return SLURM_PORT_BASE + (job_id % 1000) * 10 + step_id % 10


# ---- detection -----------------------------------------------------------------------------------------------

def _integer(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


def _first_name(environ: Mapping[str, str], *names: str) -> Optional[str]:
    """The first of `names` set to a non-empty value."""
    return next((name for name in names if environ.get(name, "").strip()), None)


def _first(environ: Mapping[str, str], *names: str) -> Optional[str]:
    """The value of the first of `names` set to a non-empty value."""
    name = _first_name(environ, *names)
    return environ[name].strip() if name else None


def detect_slurm(environ: Mapping[str, str], scontrol: Optional[str] = "scontrol") -> Optional[SchedulerEnv]:
    """Inside a SLURM allocation (SLURM_JOB_ID, SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST set).

    In an srun step every node runs one dprorun: node count, node rank and nodes are the step's. In the batch
    script itself (no SLURM_STEP_ID) only this node runs dprorun: a single-node job (Horovod still gets the job's
    nodes as hosts, as horovodrun starts the other nodes' ranks itself)."""
    job = _first(environ, "SLURM_JOB_ID", "SLURM_JOBID")
    if not job or not all(environ.get(name, "").strip()
                          for name in ("SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST")):
        return None
    if not job.isdigit():
        raise ValueError(f"SLURM_JOB_ID={job!r} is not a number")
    job_hosts = expand_nodelist(environ["SLURM_JOB_NODELIST"], scontrol)
    step = _first(environ, "SLURM_STEP_ID", "SLURM_STEPID")
    if step is None or not step.isdigit():  # the batch script, or an interactive / extern step: this node alone
        return SchedulerEnv(
            scheduler="slurm", nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=None,
            job_id=f"slurm-{job}", hosts=job_hosts, in_step=False,
            description=(f"SLURM job {job} (batch script, outside srun): this node only"
                         + (f"; `srun dprorun ...` runs on all {len(job_hosts)} nodes of the job"
                            if len(job_hosts) > 1 else "")))
    nnodes = _integer(environ, "SLURM_STEP_NUM_NODES" if "SLURM_STEP_NUM_NODES" in environ else "SLURM_NNODES")
    node_rank = _integer(environ, "SLURM_NODEID")
    tasks_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
    tasks = _integer(environ, tasks_name) if environ.get(tasks_name, "").strip() else nnodes
    if tasks != nnodes:
        raise ValueError(f"SLURM step {job}.{step} runs {tasks} tasks on {nnodes} nodes: dprorun needs one task "
                         f"per node (srun --ntasks-per-node=1 dprorun -np N ...) and starts the N ranks itself")
    step_hosts = expand_nodelist(_first(environ, "SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"], scontrol)
    if len(step_hosts) != nnodes or not 0 <= node_rank < nnodes:
        raise ValueError(f"SLURM step {job}.{step}: node {node_rank} of {nnodes} does not match its node list "
                         f"({','.join(step_hosts)})")
    if nnodes == 1:
        master_addr, master_port, where = "127.0.0.1", None, "a single node"
    else:
        master_addr = node_address(step_hosts[0], scontrol)
        master_port = slurm_port(int(job), int(step))
        shown = step_hosts[0] if master_addr == step_hosts[0] else f"{step_hosts[0]} ({master_addr})"
        where = f"node {node_rank} of {nnodes} ({','.join(step_hosts)}), master {shown}:{master_port}"
    job_id = f"slurm-{job}" if int(step) == 0 else f"slurm-{job}.{step}"
    return SchedulerEnv(scheduler="slurm", nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
                        master_port=master_port, job_id=job_id, hosts=job_hosts, in_step=True,
                        description=f"SLURM job {job} step {step}: {where}, job id {job_id}")


def _pytorchjob_nnodes(raw: str) -> int:
    """PET_NNODES: '2', or the elastic form 'min:max' (accepted only when fixed, e.g. '2:2')."""
    low, _, high = raw.strip().partition(":")
    try:
        low_n, high_n = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"PET_NNODES={raw!r} is not a number of nodes") from None
    if low_n != high_n:
        raise ValueError(f"PET_NNODES={raw!r}: an elastic node range; dprorun needs a fixed number of nodes "
                         "(give --nnodes, --node-rank and --master-addr)")
    return low_n


def _pytorchjob_master(environ: Mapping[str, str]) -> tuple[Optional[str], Optional[str], list[str]]:
    """(address, port text, the variables they came from): PET_MASTER_*, else MASTER_*, else PET_RDZV_ENDPOINT."""
    addr_name = _first_name(environ, "PET_MASTER_ADDR", "MASTER_ADDR")
    port_name = _first_name(environ, "PET_MASTER_PORT", "MASTER_PORT")
    endpoint = _first(environ, "PET_RDZV_ENDPOINT") or ""
    endpoint_host, _, endpoint_port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
    address = environ[addr_name].strip() if addr_name else endpoint_host or None
    port = environ[port_name].strip() if port_name else endpoint_port or None
    sources = [addr_name or ("PET_RDZV_ENDPOINT" if address else None),
               port_name or ("PET_RDZV_ENDPOINT" if port else None)]
    return address, port, [name for name in dict.fromkeys(sources) if name]


def detect_pytorchjob(environ: Mapping[str, str]) -> Optional[SchedulerEnv]:
    """A pod of a Kubernetes PyTorchJob (training operator) or TrainJob (Kubeflow Trainer).

    torchrun's variables (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT; set by the Trainer and by
    the training operator >= 1.7) win; without them, the operator's MASTER_ADDR, MASTER_PORT, WORLD_SIZE (the
    number of pods) and RANK (the pod's index) in a pod (KUBERNETES_SERVICE_HOST set) that is not itself a rank
    of a launcher (no LOCAL_RANK)."""
    torchrun_style = bool(_first(environ, "PET_NNODES")) and bool(_first(environ, "PET_NODE_RANK", "RANK"))
    operator_style = (bool(_first(environ, "KUBERNETES_SERVICE_HOST")) and "LOCAL_RANK" not in environ
                      and all(_first(environ, name) for name in ("MASTER_ADDR", "WORLD_SIZE", "RANK")))
    if not torchrun_style and not operator_style:
        return None
    if torchrun_style:
        nnodes = _pytorchjob_nnodes(environ["PET_NNODES"])
        rank_name = "PET_NODE_RANK" if _first(environ, "PET_NODE_RANK") else "RANK"
        taken = ["PET_NNODES", rank_name]
    else:
        nnodes, rank_name, taken = _integer(environ, "WORLD_SIZE"), "RANK", ["WORLD_SIZE", "RANK"]
    node_rank = _integer(environ, rank_name)
    master_addr, port_text, sources = _pytorchjob_master(environ)
    taken += sources
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"PyTorchJob: node rank {node_rank} ({rank_name}) is outside 0..{nnodes - 1}")
    if nnodes > 1 and not master_addr:
        raise ValueError("PyTorchJob: the number of nodes is set but no master address (MASTER_ADDR or "
                         "PET_MASTER_ADDR)")
    try:
        master_port = int(port_text) if port_text else None
    except ValueError:
        raise ValueError(f"PyTorchJob: master port {port_text!r} is not a number") from None
    if nnodes == 1:  # this pod alone: its ranks meet on the loopback, on a free port
        master_addr, master_port, where = "127.0.0.1", None, "a single node"
    else:
        where = f"node {node_rank} of {nnodes}, master {master_addr}:{master_port or 29500}"
    return SchedulerEnv(scheduler="pytorchjob", nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
                        master_port=master_port, job_id=None, hosts=[], in_step=True,
                        description=f"Kubernetes PyTorchJob: {where} (from {', '.join(taken)})")


def detect_scheduler(environ: Mapping[str, str], scontrol: Optional[str] = "scontrol") -> Optional[SchedulerEnv]:
    """The job's layout from SLURM or a Kubernetes PyTorchJob, or None outside both. Raises ValueError when the
    variables are there but unusable (several tasks per node, an elastic node range, a bad number).
    `scontrol`: the command that expands SLURM node lists (None: the Python expansion only)."""
    return detect_slurm(environ, scontrol) or detect_pytorchjob(environ)


def horovod_plan(env: SchedulerEnv) -> tuple[list[str], str]:
    """Horovod under a scheduler: dprorun runs once and horovodrun starts every node's ranks (over ssh), so the
    host list is the job's nodes ([] for a one-node job: horovodrun starts the ranks here, without ssh); with the
    line saying so. An srun step over several nodes would start horovodrun on each of them: refused."""
    if env.scheduler == "slurm" and env.in_step and env.nnodes > 1:
        raise ValueError(f"--backend horovod: run dprorun once (in the batch script, or srun -N1 -n1), not in a "
                         f"{env.nnodes}-node srun step: horovodrun starts the ranks on each of the job's nodes")
    job = f"{env.scheduler_name} (job id {env.job_id})" if env.job_id else env.scheduler_name
    if len(env.hosts) > 1:
        return list(env.hosts), f"{job}: horovodrun on the job's nodes {','.join(env.hosts)}"
    if env.nnodes > 1:
        raise ValueError(f"--backend horovod in a {env.nnodes}-node {env.scheduler_name} job: its hosts are not "
                         "known here; give --hosts host1:slots,host2:slots")
    return [], f"{job}: horovodrun on this node"
