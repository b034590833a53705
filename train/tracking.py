"""What a run reports: metrics.jsonl, config.yaml, console lines, a progress bar, and trackers.

`MetricsLogger` is a no-op off the main process, so the loop calls it on every rank without a
single `if rank == 0`. The progress bar shows on each node's local main process.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import yaml
from tqdm.auto import tqdm

from config import TrainConfig, to_dict

PREEMPTED_MARKER = "preempted.json"


class MetricsLogger:
    def __init__(self, cfg: TrainConfig, is_main: bool, is_local_main: bool):
        self.cfg, self.enabled, self.show_progress = cfg, is_main, is_local_main
        self.output_dir = Path(cfg.output_dir)
        self.metrics_file = None
        self.bar = None

    def start(self, step: int, run_info: dict) -> None:
        """Write config.yaml and run_info.json; keep metrics.jsonl rows up to `step` (a resume re-logs the rest)."""
        if self.show_progress:
            # disable=None: no bar when stderr is not a terminal (CI, SLURM logs); the log lines remain
            self.bar = tqdm(total=self.cfg.max_steps, initial=step, desc="train", unit="step",
                            dynamic_ncols=True, mininterval=1.0, disable=None)
        if not self.enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(self.cfg), sort_keys=False))
        (self.output_dir / "run_info.json").write_text(json.dumps(run_info, indent=2) + "\n")
        (self.output_dir / PREEMPTED_MARKER).unlink(missing_ok=True)  # this run is the requeued one
        path = self.output_dir / "metrics.jsonl"
        kept = [line for line in _read_lines(path) if json.loads(line).get("step", 0) <= step]
        path.write_text("".join(kept))
        self.metrics_file = open(path, "a", buffering=1)  # line-buffered: readable while training runs
        for key, value in run_info.items():
            self.info(f"{key}: {value}")

    def log(self, step: int, metrics: dict) -> None:
        """One metrics.jsonl row and one console line."""
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.metrics_file.write(json.dumps(row) + "\n")
        self.info(" | ".join([f"step {step}/{self.cfg.max_steps}"] + [_fmt(k, v) for k, v in row.items()
                                                                      if k != "step"]))

    def preempted(self, step: int, signal_name: str, checkpoint: str) -> None:
        """Leave <output_dir>/preempted.json: launchers report any worker's exit as 1, so a requeue
        script tells "stopped on a signal, with a checkpoint" apart from a failure by this file."""
        if self.enabled:
            record = {"step": step, "signal": signal_name, "checkpoint": checkpoint}
            (self.output_dir / PREEMPTED_MARKER).write_text(json.dumps(record) + "\n")
        self.info(f"stopping at step {step} on {signal_name}: resume with --resume latest")

    def advance(self, loss: float | None = None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def info(self, message: str) -> None:
        if self.enabled:
            tqdm.write(message)  # prints above the progress bar instead of through it

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.metrics_file is not None:
            self.metrics_file.close()


class Throughput:
    """Tokens/s and samples/s over the training time since the last report (eval and saves excluded)."""

    def __init__(self, samples_per_step: int, tokens_per_step: int):
        self.samples_per_step, self.tokens_per_step = samples_per_step, tokens_per_step
        self.restart()

    def restart(self) -> None:
        self.start, self.steps = time.perf_counter(), 0

    def step(self) -> None:
        self.steps += 1

    def report(self) -> dict:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        rates = {"tokens_per_s": self.steps * self.tokens_per_step / elapsed,
                 "samples_per_s": self.steps * self.samples_per_step / elapsed,
                 "step_time_s": elapsed / max(self.steps, 1)}
        self.restart()
        return rates


def _read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True) if path.exists() else []


def _plain(value):
    value = value.item() if hasattr(value, "item") else value
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _fmt(key: str, value) -> str:
    if isinstance(value, float):
        return f"{key} {value:.4g}" if abs(value) < 1e4 else f"{key} {value:,.0f}"
    return f"{key} {value}"


def git_revision() -> str:
    head = Path(__file__).resolve().parents[1] / ".git" / "HEAD"
    try:
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            return (head.parent / ref[5:]).read_text().strip()[:12]
        return ref[:12]
    except OSError:
        return "unknown"


def environment_info() -> dict:
    import accelerate
    import torch

    return {"torch": torch.__version__, "accelerate": accelerate.__version__, "git": git_revision(),
            "host": os.uname().nodename}
