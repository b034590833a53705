#!/usr/bin/env bash
# One node's part of a job under an engine that starts a command on every node (Kubernetes: JobSet, Kubeflow
# Trainer; SkyPilot): torchrun, which takes the job's shape from PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
# PET_MASTER_ADDR and PET_MASTER_PORT (Kubeflow Trainer sets them; scripts/kubernetes/jobset.yaml and
# scripts/skypilot/train.yaml set them from what their engine gives), then train/main.py.
#
#   OUTPUT_DIR=/runs/my-run scripts/torchrun_job.sh --config train/configs/gpt2_small.yaml --mixed_precision bf16
#
# OUTPUT_DIR: the run folder, on storage every node sees and named after the job, so that a restarted pod or a
# recovered cluster finds its checkpoints (--resume latest continues them; the first start has none).
# What a container's first process must do that torchrun alone does not:
# - pass SIGTERM on. Kubernetes signals the container's process 1 only, and a process 1 without a handler
#   ignores it: the job would be SIGKILLed at the end of its grace period with nothing saved.
# - exit 75 after a stop on a signal. torchrun reports any worker's exit as 1, so the stop's own code is lost;
#   the run's preempted.json (written on such a stop, removed by the next start) tells, and 75 is the code the
#   engines are told to restart on without counting a failure.
# - give the stop its time. On SIGTERM torchrun passes it to the workers, then SIGKILLs them after
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s by default): less than a stop can take (up to log_every steps, then
#   the checkpoint). Keep it under the engine's grace period (scripts/kubernetes/jobset.yaml: 300 s).
# - say what it waits for. torchrun waits silently for every node to join (up to 600 s by default); here it
#   gives up after RDZV_TIMEOUT_S (600 s by default; say more where nodes start slowly), and until the last
#   node joins scripts/rendezvous.py says every 30 s how many have, of how many. A rendezvous that times out
#   ends with one `error:` line naming them, exit 1. A stop while it waits (SIGTERM: the pod evicted, the job
#   cancelled) is one `error:` line saying so, how many had joined and after how long, and exit 75 like any
#   stop (130 on Ctrl-C, as the training's own): nothing trained, nothing failed, the job can start again.
set -u
: "${OUTPUT_DIR:?set OUTPUT_DIR to the run folder, the same at every restart of the job}"
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-270}
export RDZV_TIMEOUT_S=${RDZV_TIMEOUT_S:-600}
cd "$(dirname "$0")/.."  # the repository root

# OUTPUT_DIR may be object storage (s3://bucket/run, train/storage.py): each node then writes the run in
# STAGING_DIR first, on its own disk, and that is where a stop leaves preempted.json
run_dir=$OUTPUT_DIR
staging=()
case "$OUTPUT_DIR" in
*://*)
    run_dir=${STAGING_DIR:-/tmp/train-staging/run}
    staging=(--staging_dir "$run_dir")
    ;;
esac

rendezvous=$(mktemp)
python scripts/rendezvous.py "$rendezvous" &
watcher=$!
started=$SECONDS
torchrun --rdzv-conf "timeout=$RDZV_TIMEOUT_S" train/main.py --output_dir "$OUTPUT_DIR" \
    ${staging[@]+"${staging[@]}"} --resume latest "$@" &
launcher=$!
stopped_on=""  # the signal that stopped the job, for the line after a stop before every node joined
trap 'stopped_on=SIGTERM; kill -TERM "$launcher" 2>/dev/null' TERM
trap 'stopped_on=SIGINT; kill -TERM "$launcher" 2>/dev/null' INT
# a trapped signal ends `wait` early: wait again until torchrun itself has exited
while true; do
    wait "$launcher"
    code=$?
    kill -0 "$launcher" 2>/dev/null || break
done
waited=$((SECONDS - started))
kill "$watcher" 2>/dev/null
read -r joined nodes address <"$rendezvous" 2>/dev/null || joined=""
rm -f "$rendezvous"
if [ -f "$run_dir/preempted.json" ]; then
    exit 75
fi
if [ -n "$stopped_on" ] && [ -n "$joined" ] && [ "$joined" != "$nodes" ]; then
    # torchrun, stopped while its rendezvous waited, says nothing of it: not a timeout, a stop
    echo "error: stopped on $stopped_on while waiting for the job's nodes: $joined of $nodes had" \
        "joined at $address after $waited s (this is node ${PET_NODE_RANK:-0}); nothing trained yet" >&2
    if [ "$stopped_on" = SIGINT ]; then
        exit 130
    fi
    exit 75
fi
if [ "$code" -ne 0 ] && [ -n "$joined" ] && [ "$joined" != "$nodes" ]; then
    echo "error: the job's nodes never all joined: $joined of $nodes reached $address within" \
        "RDZV_TIMEOUT_S=$RDZV_TIMEOUT_S s; start the missing ones (or check PET_MASTER_ADDR and" \
        "PET_MASTER_PORT), then restart the job" >&2
    exit 1
fi
exit "$code"
