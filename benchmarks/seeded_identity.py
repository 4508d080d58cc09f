"""Does dprorun change the training? Seeded jobs (benchmarks/shapes/seeded_session55.py) launched plainly and under
dprorun; each rank writes its loss sum, a hash of its final weights and its generators' next draws, and the two
launches' files must be identical.

    python benchmarks/seeded_identity.py [--only ddp,lightning,horovod,tf,mxnet,...]

Plain launches: torchrun (DDP, Lightning), horovodrun, two TF workers with their TF_CONFIG, MXNet's scheduler,
2 servers and 2 workers in MXNet's environment. Prints a table and, last, "identical: N of M".
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "shapes", "seeded_session55.py")
MODES = ["ddp", "ddp-view", "ddp-static", "ddp-unused", "ddp-accum", "ddp-bf16", "lightning", "horovod", "tf", "mxnet"]
BACKEND = {"horovod": "horovod", "tf": "tf", "mxnet": "mxnet"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def mxnet_python() -> str:
    from dprorun.config import JobConfig
    from dprorun.launch_ps import mxnet_python as find

    return find(JobConfig(command=["python"]))


def plain(mode: str, out: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DPRO", "PYTHONPATH"))}
    if mode == "tf":
        ports = [free_port(), free_port()]
        cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
        workers = [subprocess.Popen([sys.executable, SCRIPT, mode, out], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True, env=dict(env, TF_CONFIG=json.dumps(
                                        {"cluster": cluster, "task": {"type": "worker", "index": i}})))
                   for i in range(2)]
        errors = [w.communicate(timeout=600)[1] for w in workers]
        return subprocess.CompletedProcess([], max(w.returncode for w in workers), "", "".join(errors))
    if mode == "mxnet":
        python = mxnet_python()
        env.update(DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(free_port()), DMLC_NUM_SERVER="2",
                   DMLC_NUM_WORKER="2", DMLC_NODE_HOST="127.0.0.1", DMLC_INTERFACE="lo")
        roles = [subprocess.Popen([python, SCRIPT, mode, out], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True, env=dict(env, DMLC_ROLE=role))
                 for role in ("scheduler", "server", "server", "worker", "worker")]
        errors = [r.communicate(timeout=600)[1] for r in roles]
        return subprocess.CompletedProcess([], max(r.returncode for r in roles), "", "".join(errors))
    if mode == "horovod":
        cmd = ["horovodrun", "-np", "2", "-H", "localhost:2", sys.executable, SCRIPT, mode, out]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT, mode,
               out]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if done.returncode != 0 and "SIGABRT" in done.stderr:  # torch 2.13's gloo abort at exit (not the training)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    return done


def profiled(mode: str, out: str, run_dir: str) -> subprocess.CompletedProcess:
    backend = ["--backend", BACKEND[mode]] if mode in BACKEND else []
    servers = ["--servers", "2"] if mode == "mxnet" else []
    cmd = [sys.executable, "-m", "dprorun.cli", "--run-dir", run_dir, "-q", *backend, "-np", "2", *servers,
           "python", SCRIPT, mode, out]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=dict(os.environ, DPRO_REPORT="0"))


def files(out: str) -> list[str]:
    return [open(os.path.join(out, name)).read().strip() for name in sorted(os.listdir(out))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(MODES))
    args = parser.parse_args()
    rows, same = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.only.split(","):
            a, b = os.path.join(tmp, mode, "plain"), os.path.join(tmp, mode, "dprorun")
            os.makedirs(a)
            os.makedirs(b)
            first, second = plain(mode, a), profiled(mode, b, os.path.join(tmp, mode, "run"))
            if first.returncode or second.returncode:
                rows.append((mode, f"failed (plain {first.returncode}, dprorun {second.returncode})", "", "no"))
                print(first.stderr[-1500:], second.stderr[-1500:], file=sys.stderr)
                continue
            plain_files, dpro_files = files(a), files(b)
            identical = len(plain_files) == 2 and plain_files == dpro_files
            same += identical
            rows.append((mode, plain_files[0], dpro_files[0] if dpro_files else "-", "yes" if identical else "NO"))
    print("| job | plain launch, rank 0 (loss sum, weights, next draws) | dprorun, rank 0 | identical (every rank) |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"identical: {same} of {len(rows)}")


if __name__ == "__main__":
    main()
