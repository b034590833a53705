# Sourced by the sbatch scripts beside it: the environment every node of a job needs. Edit it once for your cluster.

# Your Python environment: the repository's .venv if there is one (python -m venv .venv && .venv/bin/pip install
# -r requirements.txt), else whatever VENV names; replace with `module load ...` / `conda activate ...` if you use those.
VENV=${VENV:-.venv}
if [ -f "$VENV/bin/activate" ]; then source "$VENV/bin/activate"; fi

export CONFIG=${CONFIG:-train/configs/gpt2_small.yaml}
export OUTPUT_DIR=${OUTPUT_DIR:-runs/${SLURM_JOB_NAME}}            # on a filesystem every node sees
# GPUs per node follow the allocation: `sbatch --gpus-per-node=4 ...` changes the directive and this together
export GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
export MAIN_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)   # rendezvous on the first node
export MAIN_PORT=${MAIN_PORT:-29500}

# Datasets: compute nodes usually have no internet. Prepare the config's data once on a login node, into a cache
# on shared storage (python data/prepare.py --config "$CONFIG" with the same HF_HOME), then train offline from it:
# a missing dataset is then a one-line error at once instead of minutes of hub retries.
export HF_HOME=${HF_HOME:-$HOME/.cache/huggingface}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}

# Launchers forward only SIGTERM/SIGINT/SIGHUP/SIGQUIT by default: without SIGUSR1 here, --signal kills the
# launcher and orphans the workers. Give the checkpoint 2 minutes before the workers are SIGKILLed.
export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}                              # INFO when debugging a hang (docs/multi-node.md)
# export NCCL_SOCKET_IFNAME=ib0                                    # pin the network interface (docs/multi-node.md)

# a stop on SIGUSR1/SIGTERM leaves preempted.json (launchers report it as exit 1): requeue to continue
requeue_if_preempted() {
    if [ -f "$OUTPUT_DIR/preempted.json" ]; then scontrol requeue "$SLURM_JOB_ID"; fi
}
