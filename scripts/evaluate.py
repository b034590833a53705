"""Score a trained model on standard benchmarks with lm-evaluation-harness (an optional install:
pip install -r requirements-eval.txt).

    python scripts/evaluate.py runs/run_001 --tasks hellaswag,arc_easy,piqa
    python scripts/evaluate.py runs/run_001/checkpoints/step_00000200 --tasks lambada_openai --limit 500
    python scripts/evaluate.py runs/run_001 --tasks my_task --task_path my_tasks/   # your own YAML tasks

A run folder is scored on its export (model.safetensors), a checkpoint folder on its weights; the built-in
GPT and Hugging Face models alike, with the run's tokenizer (train/harness.py). The scores are written into
the run folder (evals/step_N.json) and, when the run logged to W&B, to the same W&B run (as lm_eval/<task>/
<metric> against trained_step). The harness's datasets come from the Hugging Face hub (or its local cache).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))

import harness  # noqa: E402
from errors import ConfigError  # noqa: E402
from run_config import saved_config  # noqa: E402
from task import build_model  # noqa: E402 - model.py's, through the seam
from tracking import wandb_init_kwargs  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="a run folder or a checkpoint folder")
    parser.add_argument("--tasks", required=True, help="comma-separated harness task names")
    parser.add_argument("--task_path", default="", help="a folder (or file) of your own YAML tasks")
    parser.add_argument("--limit", type=int, default=0, help="at most this many examples per task")
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device)
    args = parser.parse_args(argv)
    tasks = [task for task in args.tasks.split(",") if task]
    try:
        harness.check_tasks("--tasks", tasks, args.task_path)
        step, scores, _ = harness.evaluate_folder(
            args.folder, build_model, tasks, args.task_path, args.limit or None, args.device
        )
    except ConfigError as e:  # a bad input, exit 2, as the training refuses one
        print(f"error: {e}", file=sys.stderr)  # noqa: T201 - the script's one line
        sys.exit(e.exit_code)
    for name, value in scores.items():
        print(f"{name}: {value:.4f}")  # noqa: T201 - the script's output
    log_to_wandb(args.folder, step, scores)


def log_to_wandb(folder: Path, step: int, scores: dict) -> None:
    """The scores into the W&B run the training logged to, if it did: its id is in the checkpoint."""
    run, state = harness.run_and_checkpoint(folder)
    cfg = saved_config(run / "config.yaml")
    if "wandb" not in cfg.trackers() or not state.get("tracker_run_id"):
        return
    import wandb

    cfg = replace(cfg, output_dir=str(run))  # the folder may have moved since
    try:
        # the project the training logged to: WANDB_PROJECT wins over the config's, as in tracking.py
        project = os.environ.get("WANDB_PROJECT") or cfg.project
        wandb_run = wandb.init(
            project=project, **wandb_init_kwargs(cfg, state["tracker_run_id"], 0)
        )
        wandb_run.define_metric("trained_step")
        wandb_run.define_metric("lm_eval/*", step_metric="trained_step")
        wandb_run.log({**{f"lm_eval/{k}": v for k, v in scores.items()}, "trained_step": step})
        wandb_run.finish()
        print(f"W&B: logged to run {state['tracker_run_id']}")  # noqa: T201
    except Exception as e:  # no server, no key: the scores are in the run folder all the same
        print(f"warning: W&B: {str(e).splitlines()[0]}; the scores are in {run / 'evals'}")  # noqa: T201


if __name__ == "__main__":
    main()
