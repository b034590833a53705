"""How long a stop takes, to size a scheduler's grace period (Kubernetes terminationGracePeriodSeconds, the
T of SLURM's --signal=USR1@T): SIGTERM to the job at its worst moment, just after a logging step, to every
process's exit with the stop's checkpoint committed.

    python bench/stop_time.py                          # the default job (tiny preset), 2 CPU processes
    python bench/stop_time.py --model 85m              # 12 layers, width 768: an 85M-parameter GPT
    python bench/stop_time.py -- --log_every 5         # any train/main.py flags after --
    python bench/stop_time.py --restart                # then the requeue: launch to first step, by phase

The job runs through accelerate launch (CPU config, or the one GPU config when CUDA is present) in its own
process group; once the metrics row of its second logging step is written, the whole group gets SIGTERM,
as a Kubernetes pod's processes or a SLURM step's do. The stop waits for the next logging step (up to
log_every steps), saves, and exits 75. Reported: the step time, the stop's seconds, the checkpoint's size,
and the grace period this suggests (the stop and 50% more). For a GPU job: log_every x step time + 2 x
checkpoint bytes / write bandwidth + 30 s (docs/multi-node.md).

--restart then requeues the stopped job with --resume latest, twice, and times each from its launch to its
first step (its restart report's row, docs/profiling.md, gives the phases): warm, on the same node, and cold,
with an empty datasets cache (a node that has not prepared the data).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = {
    "default": [],
    "85m": ["--n_layer", "12", "--n_head", "12", "--n_embd", "768", "--block_size", "256"],
}


def logged_steps(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [row for row in rows if "loss" in row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="default")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--log_every", type=int, default=10)
    parser.add_argument(
        "--restart",
        action="store_true",
        help="then requeue it twice: warm (this node) and cold (an empty datasets cache), timed",
    )
    parser.add_argument("train_args", nargs="*", help="train/main.py flags, after --")
    args = parser.parse_args()
    gpu = "CUDA_VISIBLE_DEVICES" in os.environ or Path("/dev/nvidia0").exists()
    launch_config = "single_gpu.yaml" if gpu else "cpu.yaml"
    with tempfile.TemporaryDirectory() as folder:
        run = Path(folder) / "run"
        command = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(REPO / "accelerate_configs" / launch_config),
            "--num_processes",
            str(args.processes),
            str(REPO / "train" / "main.py"),
            "--config",
            str(REPO / "train" / "configs" / "tiny.yaml"),
            "--output_dir",
            str(run),
            "--max_steps",
            "100000",
            "--save_every",
            "0",
            "--eval_every",
            "100000",
            "--log_every",
            str(args.log_every),
            *MODELS[args.model],
            *args.train_args,
        ]
        # the launcher SIGKILLs its workers this long after passing SIGTERM on (30 s by default):
        # here, never before the stop is done
        env = {**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3600"}
        job = launch(command, env)
        while len(logged_steps(run / "metrics.jsonl")) < 2:
            if job.poll() is not None:
                sys.exit(
                    f"the job ended before its second logging step:\n{job.stdout.read()[-3000:]}"
                )
            time.sleep(0.01)
        rows = logged_steps(run / "metrics.jsonl")
        step_s = rows[-1]["step_time_s"]
        signalled = time.perf_counter()
        os.killpg(job.pid, signal.SIGTERM)
        output = job.communicate()[0]
        stop_s = time.perf_counter() - signalled
        marker = run / "preempted.json"
        if not marker.exists():
            sys.exit(f"no checkpoint was committed on the stop:\n{output[-3000:]}")
        checkpoint = Path(json.loads(marker.read_text())["checkpoint"])
        size = sum(path.stat().st_size for path in checkpoint.rglob("*") if path.is_file())
        print(f"model {args.model}, {args.processes} processes, log_every {args.log_every}")
        print(f"step time:                 {step_s:.3f} s")
        stopped_at = json.loads(marker.read_text())["step"]
        print(
            f"SIGTERM -> every exit:     {stop_s:.1f} s (signalled after step {rows[-1]['step']}, "
            f"stopped at step {stopped_at} with its checkpoint)"
        )
        print(f"checkpoint:                {size / 2**20:.0f} MiB")
        print(f"grace period (x1.5):       {stop_s * 1.5:.0f} s")
        if args.restart:
            resume = [*command, "--resume", "latest"]
            report_restart("warm", *restart(resume, env, run))
            # a cold restart: another node, whose datasets cache does not hold the prepared data
            cold_env = {**env, "HF_HOME": str(Path(folder) / "fresh_hf_home")}
            report_restart("cold", *restart(resume, cold_env, run))


def launch(command: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def restart(command: list[str], env: dict, run: Path) -> tuple[float, dict]:
    """The requeue: the job launched again with --resume latest, timed from the launch to its restart
    report (written after its first step); then stopped again, with a checkpoint, for the next one."""
    metrics = run / "metrics.jsonl"
    starts_before = sum(1 for row in all_rows(metrics) if "start" in row)
    launched = time.perf_counter()
    job = launch(command, env)
    # (the resumed run rewrites metrics.jsonl without the rows past its checkpoint: count up, not apart)
    while sum(1 for row in all_rows(metrics) if "start" in row) <= starts_before:
        if job.poll() is not None:
            sys.exit(f"the restart ended before its first step:\n{job.stdout.read()[-3000:]}")
        time.sleep(0.01)
    requeue_s = time.perf_counter() - launched
    start_row = [row for row in all_rows(metrics) if "start" in row][-1]
    os.killpg(job.pid, signal.SIGTERM)
    job.communicate()
    return requeue_s, start_row


def all_rows(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # the row being written
            continue
    return rows


def report_restart(kind: str, requeue_s: float, row: dict) -> None:
    phases = {
        key[len("start_") : -len("_s")].replace("_", " "): seconds
        for key, seconds in row.items()
        if key.startswith("start_") and key.endswith("_s") and key != "start_s"
    }
    said = ", ".join(f"{name} {seconds:.2f}" for name, seconds in phases.items())
    print(
        f"{kind} restart: launch -> first step {requeue_s:.1f} s; the main process's start "
        f"{row['start_s']:.1f} s ({said}); {row['steps_lost']} steps lost"
    )


if __name__ == "__main__":
    main()
