"""How often a rank of a short 4-rank DDP job aborts: under dprorun, under dprorun --no-comm-hook, under plain
torchrun, and a plain-torchrun job that starts and stops torch.profiler every 3 iterations (profiler-stress), also
with a Python comm hook like dprorun's (profiler-hook-stress). The held-* launchers run HELD_SCRIPT, a 2-rank DDP
job that leaves its model (and so its gloo group) alive at exit: under plain torchrun (held-torchrun), under dprorun
(held-dprorun, which waits for gloo's worker threads at exit: dprorun/runtime/gloo_exit.py) and under dprorun without
that wait (held-dprorun-nowait, DPRO_GLOO_EXIT_WAIT_S=0); frozen-dprorun and frozen-no-comm-hook run FROZEN_SCRIPT (2
ranks, a trunk of 6 frozen layers under a trained head: one 20 KB bucket) under dprorun's default window, with and
without its comm hook, and frozen-no-stop-wait under dprorun without the wait for gloo's idle worker threads before
the profiler's stop (DPRO_PROFILER_STOP_WAIT_S=0: the code before session 57); --busy N runs N busy loops beside the
launches; --malloc-check runs every launch under glibc's checking allocator (libc_malloc_debug.so, MALLOC_CHECK_=3),
which turns the rare heap corruption into a frequent abort or SIGSEGV.

The job is tests/test_align_graph.py's SHORT_SCRIPT (4 Linear layers, 11 steps, the process group torn down at the
end) with that test's window. Rounds alternate the launchers; each launch's outcome is its exit code and, for a
rank killed by a signal, the line its log holds ("malloc(): ... corrupted", "terminate called without an active
exception").

    python benchmarks/abort_rate.py --reps 12 [--launchers NAME,...] [--core-dumps DIR]
    python benchmarks/abort_rate.py --reps 30 --busy 2 --launchers held-torchrun,held-dprorun,held-dprorun-nowait
    python benchmarks/abort_rate.py --reps 40 --busy 2 --launchers frozen-dprorun,frozen-no-comm-hook --core-dumps DIR
    python benchmarks/abort_rate.py --reps 20 --launchers frozen-dprorun,frozen-no-stop-wait --malloc-check
    (the names above; default: the first four; --core-dumps: launches run in DIR with core files allowed, so that an
    aborting rank leaves a core there (the kernel's core_pattern "core") for gdb)

Last line: `aborted: dprorun A of N, no-comm-hook B of N, torchrun C of N, profiler-stress D of N` (the launchers run).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
from test_align_graph import SHORT_SCRIPT  # noqa: E402
from test_horovod import DDP_IMPORTING_HOROVOD  # noqa: E402

STRESS_SCRIPT = """
import sys, torch, torch.distributed as dist
from torch.profiler import profile, ProfilerActivity
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
if "hook" in sys.argv:  # a Python comm hook as dprorun's: divide, all-reduce, one callback on gloo's thread
    def hook(group, bucket):
        tensor = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])
    model.register_comm_hook(None, hook)
prof = None
for step in range(150):
    if step % 3 == 0:  # at a forward's start, as dprorun's hooks stop it
        if prof is not None:
            prof.stop()
            prof = None
        else:
            prof = profile(activities=[ProfilerActivity.CPU])
            prof.start()
    opt.zero_grad()
    model(torch.randn(32, 256)).sum().backward()
    opt.step()
dist.destroy_process_group()
"""
# session 56's probe: heap corruption in a rank ("malloc(): invalid size (unsorted)") at the window's profiler stop,
# 4 times in about 200 launches of this shape, most beside busy loops
FROZEN_SCRIPT = """
import torch, torch.nn as nn, torch.distributed as dist
dist.init_process_group("gloo")
trunk = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(6)])
net = nn.Sequential(trunk, nn.Linear(512, 10))
for p in trunk.parameters():
    p.requires_grad_(False)
model = nn.parallel.DistributedDataParallel(net)
opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.01)
x, y = torch.randn(128, 512), torch.randint(0, 10, (128,))
for step in range(30):
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
dist.barrier()
del model
dist.destroy_process_group()
"""
# the test's DDP job without its idle `import horovod.torch` (the CI's abort at exit was that job's): its model, and so
# its gloo group, alive at exit
HELD_SCRIPT = "\n".join(line for line in DDP_IMPORTING_HOROVOD.splitlines() if "horovod" not in line)
WINDOW = ["--warmup", "3", "--active", "5", "--kineto-iters", "2", "--clean", "3", "-q"]
CAUSES = ("malloc(): [^\n]*", "killed by signal [A-Z]+", "terminate called without an active exception", "double free[^\n]*",
          "Segmentation fault")


def _allow_core_files() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


MALLOC_DEBUG = {"LD_PRELOAD": "libc_malloc_debug.so.0", "MALLOC_CHECK_": "3"}  # glibc's checking allocator


def launch(launcher: str, tmp: str, index: int, core_dir: str = "", malloc_check: bool = False) -> tuple[int, str]:
    short, stress = os.path.join(tmp, "short.py"), os.path.join(tmp, "stress.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    env = dict(os.environ, DPRO_REPORT="0", **(MALLOC_DEBUG if malloc_check else {}))
    if launcher.startswith("held-"):
        held = os.path.join(tmp, "held.py")
        if launcher == "held-torchrun":
            cmd = torchrun[:-1] + ["2", held]
        else:
            if launcher == "held-dprorun-nowait":
                env["DPRO_GLOO_EXIT_WAIT_S"] = "0"
            cmd = [sys.executable, "-m", "dprorun.cli", "--run-dir", os.path.join(tmp, f"{launcher}-{index}"), "-np",
                   "2", "-q", "python", held]
    elif launcher.startswith("frozen-"):
        if launcher == "frozen-no-stop-wait":  # the profiler's stop not waiting for gloo's idle workers
            env["DPRO_PROFILER_STOP_WAIT_S"] = "0"
        cmd = [sys.executable, "-m", "dprorun.cli", "--run-dir", os.path.join(tmp, f"{launcher}-{index}"), "-np", "2",
               "-q", *(["--no-comm-hook"] if launcher == "frozen-no-comm-hook" else []), "python",
               os.path.join(tmp, "frozen.py")]
    elif launcher in ("dprorun", "no-comm-hook"):
        env.update(DPRO_TEST_HOSTS="h0,h1,h2,h3", DPRO_TEST_CLOCK_SKEW_US="0,5000,-3000,1200")
        cmd = [sys.executable, "-m", "dprorun.cli", "--run-dir", os.path.join(tmp, f"{launcher}-{index}"), "-np", "4",
               *(["--no-comm-hook"] if launcher == "no-comm-hook" else []), *WINDOW, "python", short, "11",
               "teardown"]
    elif launcher == "torchrun":
        cmd = torchrun + [short, "11", "teardown"]
    else:
        cmd = torchrun + [stress] + (["hook"] if launcher == "profiler-hook-stress" else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=core_dir or REPO, env=env, timeout=240,
                             preexec_fn=_allow_core_files if core_dir else None)
    except subprocess.TimeoutExpired:
        return 124, "timed out"
    text = out.stdout + out.stderr
    found = [m.group(0) for cause in CAUSES for m in [re.search(cause, text)] if m]
    return out.returncode, found[0] if found else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--launchers", default="dprorun,no-comm-hook,torchrun,profiler-stress")
    parser.add_argument("--busy", type=int, default=0, help="busy loops run beside the launches")
    parser.add_argument("--core-dumps", default="", help="a folder: launches run there, core files allowed")
    parser.add_argument("--malloc-check", action="store_true",
                        help="launches under glibc's checking allocator (libc_malloc_debug, MALLOC_CHECK_=3)")
    args = parser.parse_args()
    core_dir = os.path.abspath(args.core_dumps) if args.core_dumps else ""
    if core_dir:
        os.makedirs(core_dir, exist_ok=True)
    launchers = args.launchers.split(",")
    aborted = {name: 0 for name in launchers}
    print("| round | launcher | exit code | what the logs say |\n|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "short.py"), "w") as handle:
            handle.write(SHORT_SCRIPT)
        with open(os.path.join(tmp, "stress.py"), "w") as handle:
            handle.write(STRESS_SCRIPT)
        with open(os.path.join(tmp, "held.py"), "w") as handle:
            handle.write(HELD_SCRIPT)
        with open(os.path.join(tmp, "frozen.py"), "w") as handle:
            handle.write(FROZEN_SCRIPT)
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
        try:
            for rep in range(args.reps):
                for name in launchers if rep % 2 == 0 else reversed(launchers):
                    code, cause = launch(name, tmp, rep, core_dir, args.malloc_check)
                    aborted[name] += code != 0
                    print(f"| {rep} | {name} | {code} | {cause} |", flush=True)
        finally:
            for loop in busy:
                loop.kill()
    if core_dir:
        cores = sorted(n for n in os.listdir(core_dir) if n.startswith("core"))
        print(f"core files in {core_dir}: {', '.join(cores) if cores else 'none'}")
    print("aborted: " + ", ".join(f"{name} {aborted[name]} of {args.reps}" for name in launchers))


if __name__ == "__main__":
    main()
