"""Muon against AdamW on the default job: the eval loss at equal steps, and the step time.

    python bench/optimizers.py                              # the default job (300 steps), each optimizer
    python bench/optimizers.py --muon_lr 0.01,0.02,0.04     # one Muon run per peak LR
    python bench/optimizers.py -- --max_steps 100 --dataset my.jsonl   # after --: train/main.py's flags

Each run is `python train/main.py` in a fresh process and a run folder of its own, one after another (two at
once on a small machine would time each other); the figures are read back from its metrics.jsonl. The step
time is the median of the logged windows after the first (which holds start-up and the first step's work).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MAIN = Path(__file__).resolve().parents[1] / "train" / "main.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--muon_lr", default="0.02", help="comma-separated peak LRs of Muon's runs")
    parser.add_argument("--out", help="also write the figures here, as JSON")
    parser.add_argument("train_flags", nargs="*", help="after --: flags for train/main.py")
    args = parser.parse_args()
    runs = [("adamw", [])]
    for lr in args.muon_lr.split(","):
        runs.append((f"muon (muon_lr {lr})", ["--optimizer", "muon", "--muon_lr", lr]))
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for index, (name, flags) in enumerate(runs):
            output_dir = Path(folder, f"run{index}")
            command = [sys.executable, str(MAIN), "--output_dir", str(output_dir)]
            command += [*flags, *args.train_flags]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            results[name] = figures(output_dir / "metrics.jsonl")
    print(report(results))  # noqa: T201 - the bench's output
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


def figures(metrics: Path) -> dict:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    timed = [row["step_time_s"] for row in rows if "step_time_s" in row][1:]
    evals = {row["step"]: row["eval_loss"] for row in rows if "eval_loss" in row}
    losses = [row["loss"] for row in rows if "loss" in row]
    return {
        "eval_loss": evals,
        "final_train_loss": losses[-1],
        "step_time_s": statistics.median(timed) if timed else None,
    }


def report(results: dict) -> str:
    steps = sorted(next(iter(results.values()))["eval_loss"])
    header = "| optimizer | " + " | ".join(f"eval loss @{s}" for s in steps)
    lines = [header + " | step time | vs adamw |", "|---" * (len(steps) + 3) + "|"]
    reference = results["adamw"]["step_time_s"]
    for name, result in results.items():
        losses = " | ".join(f"{result['eval_loss'].get(s, float('nan')):.4f}" for s in steps)
        step_time = result["step_time_s"]
        lines.append(
            f"| {name} | {losses} | {step_time * 1e3:.1f} ms | {step_time / reference:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
