"""What --compile costs and gives: cold compile seconds whole-model vs regional (block by block, as
train/compiling.py does), warm seconds from the kept cache, step time against eager, and the loss
against eager after the same steps.

    python bench/compile.py                          # the default job's model (836k parameters)
    python bench/compile.py --preset 85m             # 12 layers, width 768 (GPT-2 small's body)
    python bench/compile.py --steps 20 --batch_size 8

Each variant runs in a fresh process (dynamo's in-memory caches would hide a cold start); the cold
ones each get an empty inductor cache folder, and the warm one reuses the regional run's folder, as a
resumed run reuses <output_dir>/compile_cache. "first step" is the seconds of the first training step:
tracing, compiling (or loading) and running it. Eager's first step is the baseline to subtract.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[1] / "train"
PRESETS = {
    "default": dict(n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=16),
    "85m": dict(n_layer=12, n_head=12, n_embd=768, block_size=256, batch_size=2),
}
VARIANTS = ("eager", "whole", "regional", "regional_warm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESETS, default="default")
    parser.add_argument("--steps", type=int, default=20, help="timed steps after the first")
    parser.add_argument("--batch_size", type=int, default=0, help="0: the preset's")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # set in the child processes
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = dict(PRESETS[args.preset])
    if args.batch_size:
        shape["batch_size"] = args.batch_size
    if args.variant:
        print(json.dumps(run_variant(args.variant, shape, args.steps)))  # noqa: T201 - to the parent
        return
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for variant in VARIANTS:
            cache = Path(folder, "regional" if variant.startswith("regional") else variant)
            results[variant] = child(args, variant, cache)
    print(report(args.preset, shape, results))  # noqa: T201 - the bench's output


def child(args, variant: str, cache: Path) -> dict:
    command = [sys.executable, __file__, "--preset", args.preset, "--steps", str(args.steps)]
    command += ["--batch_size", str(args.batch_size), "--variant", variant]
    environment = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        command, env={**os.environ, **environment}, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        sys.exit(f"{variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_variant(variant: str, shape: dict, steps: int) -> dict:
    sys.path.insert(0, str(TRAIN))
    import torch

    from blocks import transformer_blocks
    from model import build_model
    from run_config import config_class

    RunConfig = config_class()

    torch.manual_seed(0)
    cfg = RunConfig(**{k: v for k, v in shape.items() if k != "batch_size"})
    model = build_model(cfg)
    if variant == "whole":
        model.compile()
    elif variant.startswith("regional"):
        for block in transformer_blocks(model, "regional compilation"):
            block.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (shape["batch_size"], cfg.block_size + 1))

    def step() -> float:
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    started = time.perf_counter()
    step()
    first_step = time.perf_counter() - started
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - started)
    return {"first_step_s": first_step, "step_s": statistics.median(times), "loss": loss}


def report(preset: str, shape: dict, results: dict) -> str:
    eager = results["eager"]
    lines = [
        f"preset {preset} {shape}",
        f"{'variant':<15}{'first step s':>13}{'compile s':>11}{'step ms':>9}"
        f"{'eager/step':>11}{'loss rel. diff':>16}",
    ]
    for variant, result in results.items():
        compile_s = result["first_step_s"] - eager["first_step_s"]
        speedup = eager["step_s"] / result["step_s"]
        difference = abs(result["loss"] - eager["loss"]) / abs(eager["loss"])
        lines.append(
            f"{variant:<15}{result['first_step_s']:>13.2f}{compile_s:>11.2f}"
            f"{result['step_s'] * 1000:>9.1f}{speedup:>11.3f}{difference:>16.1e}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
