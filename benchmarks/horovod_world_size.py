"""Horovod world-size prediction: a `dprorun --backend horovod` profile on 2 emulated hosts, `dpro replay --np 3`
and `--np 4` on it, and plain `horovodrun -H` jobs on 2, 3 and 4 hosts, interleaved --reps times (medians).

The emulated cluster is the one benchmarks/dryrun_world_size.py uses (scripts/emulated_cluster.py: one network
namespace per host with its own --cpus quota and --rate link, one rank per host), with an sshd per host:
horovodrun, started on host 0, reaches the other hosts by ssh as on a real cluster.

usage: OMP_NUM_THREADS=1 sudo python benchmarks/horovod_world_size.py [--reps 3] [--steps 40]
Last line: the largest |error| for 3 and for 4 hosts.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from dryrun_world_size import REPO, EmulatedCluster, host_output

EXAMPLE = os.path.join(REPO, "examples", "horovod_mlp.py")


def hosts_flag(cluster: EmulatedCluster) -> str:
    return ",".join(f"{cluster.addr(k)}:1" for k in range(cluster.hosts))


def ssh_flags(cluster: EmulatedCluster) -> list[str]:
    return ["--ssh-identity-file", cluster.ssh_identity, "--network-interfaces", "eth0"]


def measure(hosts: int, args, env: dict) -> float:
    with EmulatedCluster(hosts, args.cpus, args.rate, ssh=True) as cluster:
        out = host_output(cluster.run(["horovodrun", "-np", str(hosts), "-H", hosts_flag(cluster), "--gloo",
                                       *ssh_flags(cluster), sys.executable, EXAMPLE, "--steps", str(args.steps)],
                                      900, env, hosts=[0]))
    return float(re.search(r"median iteration time: ([0-9.]+) ms", out).group(1))


def profile_and_predict(args, env: dict, run_dir: str) -> tuple[float, float, float, float]:
    """(the profiled run's own iteration time, replayed as run, for 3 hosts, for 4 hosts)."""
    with EmulatedCluster(2, args.cpus, args.rate, ssh=True) as cluster:
        host_output(cluster.run([sys.executable, "-m", "dprorun.cli", "--backend", "horovod", "--hosts",
                                 hosts_flag(cluster), *ssh_flags(cluster), "-q", "--run-dir", run_dir, "python",
                                 EXAMPLE, "--steps", str(args.steps)], 900, dict(env, DPRO_REPORT="0"), hosts=[0]))
    out = []
    for np_flag in ([], ["--np", "3"], ["--np", "4"]):
        res = subprocess.run([sys.executable, "-m", "dprorun.offline_cli", "replay", run_dir, "--json", *np_flag],
                             capture_output=True, text=True, check=True, timeout=600)
        doc = json.loads(res.stdout)
        if not out:
            out.append(doc["measured_iteration_time_ms"])
        out.append(doc["predicted_iteration_time_ms"])
    return tuple(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--cpus", type=float, default=0.45, help="CPU quota per host")
    parser.add_argument("--rate", default="1gbit", help="each host's link")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    rows = {k: [] for k in ("own", "p2", "p3", "p4", "m2", "m3", "m4")}
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory() as tmp:
            own, p2, p3, p4 = profile_and_predict(args, env, os.path.join(tmp, "run"))
        for key, value in (("own", own), ("p2", p2), ("p3", p3), ("p4", p4)):
            rows[key].append(value)
        for hosts in (2, 3, 4):
            rows[f"m{hosts}"].append(measure(hosts, args, env))
        print("round: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rows.items()), flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"emulated hosts: {args.cpus:g} CPU and a {args.rate} link each, one rank per host, {args.reps} rounds")
    print("| hosts | horovodrun ms | predicted ms | error |")
    print("|---|---|---|---|")
    errors = {}
    for n in (2, 3, 4):
        errors[n] = 100 * (med[f"p{n}"] / med[f"m{n}"] - 1)
        print(f"| {n} | {med[f'm{n}']:.2f} | {med[f'p{n}']:.2f} | {errors[n]:+.1f} % |")
    print(f"(the profiled 2-host run's own iterations: {med['own']:.2f} ms)")
    print(f"Horovod world-size prediction from 2 hosts: np 3 error {errors[3]:+.1f} %, np 4 error {errors[4]:+.1f} %")


if __name__ == "__main__":
    main()
