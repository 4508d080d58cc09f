#!/bin/bash
# Profile a DDP job on two SLURM nodes: `sbatch examples/sbatch_ddp.sh [TRAINING COMMAND...]`
# (default command: python examples/mlp_many_layers.py --steps 30, from the directory sbatch ran in).
#
# srun starts one dprorun per node (--ntasks-per-node=1); each takes the node count, its node rank, the master
# address (the first node) and port (from the job id) from SLURM and starts -np ranks on its node. Every rank's
# traces end up in node 0's run directory, dpro_runs/slurm-<job id>/ (other nodes send theirs over the network).
# DPRORUN_NP ranks per node (default 1: one per GPU on GPU nodes, e.g. DPRORUN_NP=8); the profiling window can be
# set through the environment sbatch passes on (DPRO_WARMUP, DPRO_ACTIVE, DPRO_CLEAN).
#SBATCH --job-name=dprorun-ddp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --time=00:15:00
#SBATCH --output=dprorun-ddp-%j.out
set -euo pipefail

if [[ $# -eq 0 ]]; then
    set -- python examples/mlp_many_layers.py --steps 30
fi
srun --ntasks-per-node=1 dprorun -np "${DPRORUN_NP:-1}" "$@"
