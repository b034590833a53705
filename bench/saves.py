"""How long training waits for a checkpoint: saved in the loop (--async_save false) against saved in the
background (--async_save true, the default), side by side, on the real training job.

    python bench/saves.py                              # 85M parameters (12 layers, width 768), 2 processes
    python bench/saves.py --processes 1 --rounds 2
    python bench/saves.py -- --n_layer 4 --n_embd 128  # any train/main.py flags after --

Each round launches train/main.py twice through accelerate launch (CPU config, or the one GPU config
when CUDA is present), once per setting, with a save every other step, and reads what each save cost
the loop from its log line ("training waited X s"). The first save of a run is left out (it pays for
the first allocation of its CPU copies). Reported: the median seconds training waited per save, each
setting's, their ratio, and the seconds the background writes took.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL_85M = ["--n_layer", "12", "--n_head", "12", "--n_embd", "768", "--block_size", "256"]
WAITED = re.compile(
    r"checkpoint: \S+ \(training waited ([\d.]+) s(?:; written in the background in ([\d.]+) s)?"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--saves", type=int, default=4, help="saves per run (the first is left out)"
    )
    parser.add_argument("train_args", nargs="*", help="train/main.py flags (after --)")
    args = parser.parse_args()
    train_args = args.train_args or MODEL_85M
    waited = {"false": [], "true": []}
    written = []
    for _ in range(args.rounds):
        for setting in waited:
            seconds = run(args, train_args, setting)
            waited[setting] += [blocked for blocked, _ in seconds[1:]]
            written += [took for _, took in seconds[1:] if took is not None]
    print(report(args, train_args, waited, written))  # noqa: T201 - the bench's output


def run(args, train_args: list[str], setting: str) -> list[tuple[float, float | None]]:
    steps = 2 * args.saves
    config = "single_gpu.yaml" if on_gpu() else "cpu.yaml"
    with tempfile.TemporaryDirectory() as folder:
        command = [
            sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(REPO / "accelerate_configs" / config),
            "--num_processes", str(args.processes),
            "--main_process_port", "0" if args.processes == 1 else "29517",
            str(REPO / "train" / "main.py"),
            "--output_dir", folder, "--batch_size", "2", "--max_steps", str(steps),
            "--save_every", "2", "--log_every", "1", "--eval_every", str(steps), "--keep_last", "1",
            "--async_save", setting, *train_args,
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"async_save {setting} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    found = WAITED.findall(done.stdout + done.stderr)
    return [(float(blocked), float(took) if took else None) for blocked, took in found]


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def report(args, train_args, waited: dict, written: list) -> str:
    in_loop = statistics.median(waited["false"])
    background = statistics.median(waited["true"])
    lines = [
        f"{args.processes} process(es), flags {' '.join(train_args)}; {len(waited['true'])} saves each",
        f"training waited per save, saved in the loop:       {in_loop:.3f} s (median)",
        f"training waited per save, saved in the background: {background:.3f} s (median)",
        f"in the loop / in the background:                   {in_loop / max(background, 1e-6):.1f}x",
    ]
    if written:
        lines.append(
            f"the background writes took:                        {statistics.median(written):.3f} s (median)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
