"""Ray Train: the training job under Ray's TorchTrainer, each Ray worker running train/main.py (the
same train(), the same config) as its child process, with the rank Ray gave it.

    python scripts/ray/train.py --workers 16 --gpus_per_worker 1 -- --output_dir s3://bucket/run \\
        --config train/configs/gpt2_small.yaml --mixed_precision bf16
    python scripts/ray/train.py --workers 2 -- --output_dir /shared/run --max_steps 200  # CPU

Everything after `--` is train/main.py's flags; `--resume latest` is added, so that a restarted
worker group continues from the run's newest checkpoint (the first start has none). An optional
install: `python -m pip install -r requirements-ray.txt`. Under an existing cluster, RAY_ADDRESS
names it (`ray job submit -- python scripts/ray/train.py ...`); without one, a local Ray is started.

What Ray brings is what an engine brings: the workers placed on the cluster's nodes (ScalingConfig),
their ranks, and a restart of the whole group when one worker fails (FailureConfig(max_failures)):
the restarted group resumes from the template's own checkpoints, in a run folder every node sees (a
shared filesystem, or a bucket: --output_dir s3://...; docs/checkpoints.md). Ray's own checkpoints
and metrics (ray.train.report) are not used: the run folder and the trackers hold them, as under any
other launcher.

Why a child process, not train() in the worker itself: Ray runs a worker's training function in a
thread of its actor, where no signal handler can be installed (the template's stop on SIGTERM, with
its checkpoint) and where an exit is not the process's. In a child process each rank is the process
the template is written for (its stop signals, its one error line, its exit codes, the run folder's
lock), exactly as under torchrun. The child is killed with its worker (PR_SET_PDEATHSIG): a worker
group that Ray tears down leaves no rank behind to hold the run folder. Its process group is its
own, on a port rank 0 picks and sends to the others over Ray's.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ENTRY = Path(__file__).resolve().parents[2] / "train" / "main.py"
PR_SET_PDEATHSIG = 1


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This script's flags, and train/main.py's (after `--`)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="training processes (ranks)")
    parser.add_argument("--gpus_per_worker", type=float, default=0, help="0: CPU workers")
    parser.add_argument(
        "--max_failures", type=int, default=3, help="worker group restarts before the job fails"
    )
    parser.add_argument("--entry", default=str(ENTRY), help="the script each worker runs")
    at = argv.index("--") if "--" in argv else len(argv)
    return parser.parse_args(argv[:at]), argv[at + 1 :]


def main(argv: list[str] | None = None) -> int:
    args, train_args = parse(sys.argv[1:] if argv is None else argv)
    # a refused flag is one line here, before Ray starts: a worker group restarted on it would only
    # fail again
    sys.path.insert(0, str(ENTRY.parent))
    from job import load_config_or_exit

    load_config_or_exit([*train_args, "--resume", "latest"], lease=False)  # rank 0 takes it
    try:
        import ray.train
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError:
        print(
            "error: Ray Train is an optional install: "
            "python -m pip install -r requirements-ray.txt",
            file=sys.stderr,
        )
        return 2
    trainer = TorchTrainer(
        train_loop_per_worker=run_a_rank,
        train_loop_config={
            "entry": args.entry,
            "args": [*train_args, "--resume", "latest"],
            # relative paths in the flags are the caller's (Ray's workers run elsewhere)
            "cwd": os.getcwd(),
        },
        # gloo: Ray's own process group only carries the port of ours (rendezvous_port)
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ray.train.ScalingConfig(
            num_workers=args.workers,
            use_gpu=args.gpus_per_worker > 0,
            resources_per_worker={"GPU": args.gpus_per_worker} if args.gpus_per_worker else None,
        ),
        run_config=ray.train.RunConfig(
            failure_config=ray.train.FailureConfig(max_failures=args.max_failures)
        ),
    )
    try:
        trainer.fit()
    except Exception as e:  # the group failed more than max_failures times: its last cause
        print(f"error: the Ray job failed: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
        return 1
    return 0


def run_a_rank(config: dict) -> None:
    """One Ray worker: train/main.py as a child process with this worker's rank; a failed rank is a
    failed worker (Ray then restarts the group, which resumes from the newest checkpoint)."""
    import ray.train

    context = ray.train.get_context()
    rank = context.get_world_rank()
    env = {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(context.get_world_size()),
        "LOCAL_RANK": str(context.get_local_rank()),
        "LOCAL_WORLD_SIZE": str(context.get_local_world_size()),
        "GROUP_RANK": str(context.get_node_rank()),
        "MASTER_ADDR": os.environ["MASTER_ADDR"],  # rank 0's node, as Ray set it
        "MASTER_PORT": str(rendezvous_port(rank)),
    }
    command = [sys.executable, config["entry"], *config["args"]]
    code = subprocess.run(
        command, env=env, cwd=config["cwd"], preexec_fn=die_with_this_worker
    ).returncode
    if code != 0:
        raise RuntimeError(f"rank {rank}: {Path(config['entry']).name} exited with {code}")


def rendezvous_port(rank: int) -> int:
    """A free port on rank 0's node for the children's process group (Ray's own holds
    MASTER_PORT), sent to every rank over Ray's process group."""
    import torch.distributed as dist

    port = [0]
    if rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = [s.getsockname()[1]]
    dist.broadcast_object_list(port, src=0)
    return port[0]


def die_with_this_worker() -> None:
    """In the child, before it runs: SIGKILL when the worker that started it dies (Ray tearing the
    group down), so that no rank outlives its group holding the run folder's lock. Linux."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
