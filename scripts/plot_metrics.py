"""Plot loss and throughput curves from one or more metrics.jsonl files, without any tracker.

    python scripts/plot_metrics.py runs/run_001                         # writes runs/run_001/metrics.png
    python scripts/plot_metrics.py runs/acc runs/ddp --out compare.png  # e.g. the Accelerate vs torch paths

Each argument is a run folder or a metrics.jsonl file; curves are labelled by folder name.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_rows(path: Path) -> list[dict]:
    path = path / "metrics.jsonl" if path.is_dir() else path
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(runs: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, (loss_ax, speed_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, rows in runs.items():
        train = [r for r in rows if "loss" in r]
        evals = [r for r in rows if "eval_loss" in r]
        line, = loss_ax.plot([r["step"] for r in train], [r["loss"] for r in train], label=f"{label} train")
        if evals:
            loss_ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o--", color=line.get_color(),
                         label=f"{label} eval")
        speed_ax.plot([r["step"] for r in train if "tokens_per_s" in r],
                      [r["tokens_per_s"] for r in train if "tokens_per_s" in r], label=label)
    loss_ax.set(xlabel="step", ylabel="loss", title="loss")
    speed_ax.set(xlabel="step", ylabel="tokens/s (all processes)", title="throughput")
    for ax in (loss_ax, speed_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders or metrics.jsonl files")
    parser.add_argument("--out", type=Path, help="PNG to write (default: metrics.png beside the first run)")
    args = parser.parse_args(argv)
    runs = {(p if p.is_dir() else p.parent).name or str(p): read_rows(p) for p in args.runs}
    first = args.runs[0]
    out = args.out or (first if first.is_dir() else first.parent) / "metrics.png"
    plot(runs, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
