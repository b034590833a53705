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
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line torn by a crash mid-write
            continue
    return rows


PANELS = [
    ("loss", "loss"),
    ("lr", "learning rate"),
    ("grad_norm", "gradient norm (before clipping)"),
    ("tokens_per_s", "tokens/s (all processes)"),
]


def plot(runs: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for number, (label, rows) in enumerate(runs.items()):
        color = colors[number % len(colors)]  # one color per run, train and eval alike
        for ax, (key, _title) in zip(axes.flat, PANELS, strict=True):
            steps = [r["step"] for r in rows if r.get(key) is not None]
            ax.plot(
                steps,
                [r[key] for r in rows if r.get(key) is not None],
                color=color,
                label=f"{label} train" if key == "loss" else label,
            )
            if key == "loss" and any("eval_loss" in r for r in rows):
                evals = [r for r in rows if "eval_loss" in r]
                ax.plot(
                    [r["step"] for r in evals],
                    [r["eval_loss"] for r in evals],
                    "o--",
                    color=color,
                    label=f"{label} eval",
                )
    for ax, (key, title) in zip(axes.flat, PANELS, strict=True):
        ax.set(xlabel="step", ylabel=key, title=title)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders or metrics.jsonl files")
    parser.add_argument(
        "--out", type=Path, help="PNG to write (default: metrics.png beside the first run)"
    )
    args = parser.parse_args(argv)
    runs = {(p if p.is_dir() else p.parent).name or str(p): read_rows(p) for p in args.runs}
    first = args.runs[0]
    out = args.out or (first if first.is_dir() else first.parent) / "metrics.png"
    plot(runs, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
