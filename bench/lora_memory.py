"""LoRA against full fine-tuning of the same model: trainable parameters, optimizer state, a
checkpoint's model and optimizer bytes, and peak memory over a few training steps, each mode in a
fresh process (peak memory is per process).

    python bench/lora_memory.py                         # CPU: the shipped GPT, 8 layers, width 512
    python bench/lora_memory.py --device cuda --n_layer 12 --n_embd 768 --block_size 1024

The model, the optimizer and the checkpoint parts are the template's own (task.training_model,
optim.build_optimizer, checkpoint.checkpoint_parts), so the figures are what a run holds.
Peak memory: on CPU the process's maximum resident set above what it held before the model was
built (Python, torch and peft imported in both modes), torch.cuda.max_memory_allocated on a GPU.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[1] / "train"


def measure(args) -> dict:
    sys.path.insert(0, str(TRAIN))
    import peft  # noqa: F401 - imported in both modes: the same interpreter before the model is built
    import torch

    import checkpoint
    import task
    from optim import build_optimizer
    from run_config import config_class
    from torch_ddp import TorchDDP

    cfg = config_class()(
        n_layer=args.n_layer,
        n_head=args.n_embd // 64,
        n_embd=args.n_embd,
        block_size=args.block_size,
        lora_r=args.lora_r,
        output_dir="/tmp/lora-memory-bench",
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.manual_seed(0)
    model = task.training_model(cfg).to(args.device)
    optimizer = build_optimizer(model, cfg)
    generator = torch.Generator().manual_seed(0)
    for _ in range(args.steps):
        ids = torch.randint(0, 256, (args.batch_size, args.block_size), generator=generator)
        ids = ids.to(args.device)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    parts = checkpoint.checkpoint_parts(TorchDDP(cfg), model, optimizer)
    ranks = range(1)
    if args.device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated()
    else:
        # the peak resident set above the interpreter's with its imports, before the model
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "optimizer_bytes": checkpoint.tensor_bytes(optimizer.state_dict()),
        "checkpoint_bytes": parts["model"].nbytes(ranks) + parts["optimizer"].nbytes(ranks),
        "peak_bytes": peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--n_layer", type=int, default=8)
    parser.add_argument("--n_embd", type=int, default=512)
    parser.add_argument("--block_size", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16, help="LoRA's rank")
    parser.add_argument("--lora_r", type=int, default=-1, help=argparse.SUPPRESS)  # one measurement
    args = parser.parse_args()
    if args.lora_r >= 0:
        print(json.dumps(measure(args)))
        return
    rows = {}
    for name, rank in (("full", 0), (f"LoRA r={args.rank}", args.rank)):
        command = [sys.executable, __file__, *sys.argv[1:], "--lora_r", str(rank)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        rows[name] = json.loads(done.stdout.strip().splitlines()[-1])
    mib = 1 << 20
    print(
        "| | parameters | trainable | optimizer state | checkpoint (model + optimizer) | peak memory |"
    )
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        print(
            f"| {name} | {row['parameters']:,} | {row['trainable']:,} | "
            f"{row['optimizer_bytes'] / mib:.1f} MiB | {row['checkpoint_bytes'] / mib:.1f} MiB | "
            f"{row['peak_bytes'] / mib:.0f} MiB |"
        )
    full, lora = rows.values()
    print(
        f"LoRA / full: optimizer {lora['optimizer_bytes'] / full['optimizer_bytes']:.4f}, "
        f"checkpoint {lora['checkpoint_bytes'] / full['checkpoint_bytes']:.4f}, "
        f"peak {lora['peak_bytes'] / full['peak_bytes']:.2f}"
    )


if __name__ == "__main__":
    main()
