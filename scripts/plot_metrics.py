"""Plot the curves of one or more runs from their metrics.jsonl files, without any tracker: loss,
learning rate, gradient norm, throughput, and every metric the task's evaluation reports (a
classifier's accuracy, F1 and per-class values included).

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


TRAINING_PANELS = [
    ("loss", "loss"),
    ("lr", "learning rate"),
    ("grad_norm", "gradient norm (before clipping)"),
]


def panels_of(runs: dict[str, list[dict]]) -> list[tuple[str, list[str]]]:
    """(title, the keys it plots): loss (train and eval), learning rate, gradient norm, throughput in
    the unit the task counts (tokens/s, or samples/s for a classifier), then every other metric the
    task's evaluation reports, a per-class family (eval_accuracy/<class>, eval_f1/<class>) in one
    panel each."""
    keys = {key for rows in runs.values() for row in rows for key in row}
    panels = [(title, [key]) for key, title in TRAINING_PANELS]
    panels[0][1].append("eval_loss")
    speed = "tokens_per_s" if "tokens_per_s" in keys else "samples_per_s"
    panels.append((f"{speed.replace('_per_s', '')}/s (all processes)", [speed]))
    reported = sorted(key for key in keys if key.startswith("eval_") and key != "eval_loss")
    families: dict[str, list[str]] = {}
    for key in reported:
        family = key.split("/", 1)[0] + ("/<class>" if "/" in key else "")
        families.setdefault(family, []).append(key)
    panels += [
        (f"{family.removeprefix('eval_')} (eval)", members) for family, members in families.items()
    ]
    return panels


def plot(runs: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    panels = panels_of(runs)
    columns = 2 if len(panels) <= 4 else 3
    rows_of_panels = -(-len(panels) // columns)
    fig, axes = plt.subplots(
        rows_of_panels, columns, figsize=(6 * columns, 4 * rows_of_panels), squeeze=False
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    used_axes = list(axes.flat)[: len(panels)]
    for number, (label, rows) in enumerate(runs.items()):
        color = colors[number % len(colors)]  # one color per run, train and eval alike
        for ax, (_title, keys) in zip(used_axes, panels, strict=True):
            for index, key in enumerate(keys):
                points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
                if not points:
                    continue
                steps, values = zip(*points, strict=True)
                marker = "o" if key.startswith("eval_") else ""
                name = key if len(keys) > 1 else ""
                ax.plot(
                    steps,
                    values,
                    marker + styles[index % len(styles)],
                    color=color,
                    label=f"{label} {name}".strip(),
                )
    for ax, (title, keys) in zip(used_axes, panels, strict=True):
        ax.set(xlabel="step", ylabel=keys[0] if len(keys) == 1 else "", title=title)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
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
