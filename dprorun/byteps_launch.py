"""`bpslaunch` under dprorun: run BytePS's own launcher with its communication tracing on, keep the traces in a
run directory and print the per-stage analysis when the job ends (launchers/bpslaunch is the drop-in).

BytePS starts one `bpslaunch` per machine and role (DMLC_ROLE = worker / server / scheduler), each with its own
environment; there is nothing to gather across machines, so each worker machine keeps its own run directory.
On a worker, BYTEPS_TRACE_ON=1 makes every local GPU write $BYTEPS_TRACE_DIR/<local rank>/comm.json once it
reaches BYTEPS_TRACE_END_STEP; dprorun sets the directory inside the run directory (a directory the user chose
is kept and its traces copied in) and a default window (steps 10-20) unless the user set one. Servers and the
scheduler run unchanged. The job's exit code is returned as is (128 + the signal when SIGINT/SIGTERM stopped it:
they are passed on to bpslaunch); traces written before a failure or a stop are kept.
"""
from __future__ import annotations

import glob
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional, Sequence

from dprorun.fsutil import TraceError, atomic_write_json

TRACE_DEFAULTS = {"BYTEPS_TRACE_START_STEP": "10", "BYTEPS_TRACE_END_STEP": "20"}


@dataclass
class BytePSLaunch:
    command: list[str]
    run_dir: str
    real_launcher: str
    role: str
    env: dict[str, str] = field(default_factory=dict)  # what dprorun adds to the job's environment


def find_real_bpslaunch(skip_dir: str, environ: dict[str, str]) -> Optional[str]:
    """The first `bpslaunch` on the environment's PATH that is not dprorun's shim (DPRO_REAL_BPSLAUNCH wins)."""
    explicit = environ.get("DPRO_REAL_BPSLAUNCH")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    skip = os.path.realpath(skip_dir)
    for entry in environ.get("PATH", "").split(os.pathsep):
        if not entry or os.path.realpath(entry) == skip:
            continue
        candidate = os.path.join(entry, "bpslaunch")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def plan(command: Sequence[str], environ: dict[str, str], shim_dir: str) -> BytePSLaunch:
    real = find_real_bpslaunch(shim_dir, environ)
    if real is None:
        raise RuntimeError("BytePS's bpslaunch was not found on PATH (install BytePS, or set DPRO_REAL_BPSLAUNCH "
                           "to its path)")
    role = environ.get("DMLC_ROLE", "worker")
    run_dir = environ.get("DPRO_RUN_DIR") or os.path.join(
        "dpro_runs", time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6])
    env: dict[str, str] = {}
    if role == "worker":
        env["BYTEPS_TRACE_ON"] = "1"
        if not environ.get("BYTEPS_TRACE_DIR"):
            env["BYTEPS_TRACE_DIR"] = os.path.abspath(os.path.join(run_dir, "byteps"))
        for key, value in TRACE_DEFAULTS.items():
            if not environ.get(key):
                env[key] = value
    return BytePSLaunch(list(command), run_dir, real, role, env)


def collect(launch: BytePSLaunch, environ: dict[str, str]) -> list[str]:
    """The comm.json files of this machine's GPUs, copied into the run directory when written elsewhere."""
    trace_dir = environ.get("BYTEPS_TRACE_DIR") or launch.env.get("BYTEPS_TRACE_DIR", "")
    found = sorted(glob.glob(os.path.join(trace_dir, "*", "comm.json"))) if trace_dir else []
    inside = os.path.abspath(os.path.join(launch.run_dir, "byteps"))
    kept = []
    for path in found:
        if os.path.abspath(path).startswith(inside + os.sep):
            kept.append(path)
            continue
        target = os.path.join(inside, os.path.basename(os.path.dirname(path)), "comm.json")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(path, target)
        kept.append(target)
    return kept


def run(command: Sequence[str], shim_dir: str, environ: Optional[dict[str, str]] = None) -> int:
    environ = dict(os.environ if environ is None else environ)
    try:
        launch = plan(command, environ, shim_dir)
    except RuntimeError as exc:
        print(f"bpslaunch (dprorun): error: {exc}", file=sys.stderr)
        return 2
    from dprorun.procs import call_forwarding_signals

    if launch.role != "worker":  # servers and the scheduler: BytePS as is
        code, signum, _ = call_forwarding_signals([launch.real_launcher, *launch.command], environ)
        return 128 + signum if signum is not None else code
    os.makedirs(launch.run_dir, exist_ok=True)
    started = time.time()
    manifest = {"framework": "byteps", "role": launch.role, "command": launch.command,
                "launcher": launch.real_launcher, "env_added": launch.env, "started": started}
    atomic_write_json(os.path.join(launch.run_dir, "manifest.json"), manifest, indent=2)
    print(f"[dprorun] BytePS worker: tracing steps {environ.get('BYTEPS_TRACE_START_STEP') or launch.env.get('BYTEPS_TRACE_START_STEP')}"
          f"-{environ.get('BYTEPS_TRACE_END_STEP') or launch.env.get('BYTEPS_TRACE_END_STEP')}, run directory "
          f"{launch.run_dir}", file=sys.stderr)
    code, signum, _ = call_forwarding_signals([launch.real_launcher, *launch.command], {**environ, **launch.env})
    if signum is not None:  # SIGINT/SIGTERM went to bpslaunch too; what the GPUs wrote is still collected
        code = 128 + signum
        print(f"[dprorun] interrupted by signal {signum}; collecting what was written", file=sys.stderr)
    traces = collect(launch, environ)
    manifest.update({"exit_code": code, "ended": time.time(), "traces": traces})
    atomic_write_json(os.path.join(launch.run_dir, "manifest.json"), manifest, indent=2)
    if not traces:
        print(f"[dprorun] no BytePS comm.json was written (BytePS writes it when a GPU reaches "
              f"BYTEPS_TRACE_END_STEP; did the job run that many steps?); run directory {launch.run_dir} kept",
              file=sys.stderr)
        return code
    from dprorun.offline_cli import main as dpro_main

    print(f"[dprorun] job exited {code}; BytePS traces of {len(traces)} GPU(s) in {launch.run_dir}", file=sys.stderr)
    try:
        analysis = dpro_main(["import-byteps", *traces])
    except TraceError as exc:  # defensive: dpro_main reports its own errors
        print(f"[dprorun] {exc}", file=sys.stderr)
        analysis = 2
    if code == 0 and analysis != 0:
        print(f"[dprorun] the traces could not be analysed (above); they are kept in {launch.run_dir}",
              file=sys.stderr)
        return analysis
    return code
