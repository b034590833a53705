"""Per-step time of one model and batch three ways, in one run, interleaved so machine noise cancels:

    bare        a plain single-process torch loop (forward, backward, clip, AdamW step), no template
    accelerate  train/main.py's train() with an Accelerator (1 process)
    torch       the same train() with torch_ddp.TorchDDP (1 process)

    python bench/throughput.py                                   # tiny preset, 3 repeats (CPU: ~2 min)
    python bench/throughput.py --repeats 5 --steps 80 --config train/configs/tiny.yaml --batch_size 32
    python bench/throughput.py --quick                           # seconds: what the test suite runs

Any further flags are TrainConfig flags, shared by all three. It prints, per variant, the median step
time, tokens/s and the share of step time spent waiting for the data loader, then the ratios
accelerate/bare and torch/accelerate; `--out FILE` also writes them as JSON. Step times are the
`step_time_s` windows of metrics.jsonl (log_every steps each) after the first window, which holds
start-up, allocator warm-up and compilation. The loader wait is the time spent in `next()` on the
training stream (data.TrainBatches), measured by wrapping it from outside, as the tests inject faults.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "train"))

VARIANTS = ("bare", "accelerate", "torch")


def main(argv: list[str]) -> None:
    opts, train_args = parse(argv)
    if opts["variant"]:
        result = measure(opts["variant"], train_args, Path(opts["workdir"]))
        Path(opts["out"]).write_text(json.dumps(result))
        return
    runs = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as workdir:
        for repeat in range(opts["repeats"]):
            order = VARIANTS[repeat % 3:] + VARIANTS[:repeat % 3]  # rotate who goes first
            for variant in order:
                out = Path(workdir) / f"{variant}-{repeat}.json"
                cmd = [sys.executable, __file__, "--variant", variant, "--workdir", f"{workdir}/{variant}-{repeat}",
                       "--out", str(out), *train_args]
                subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
                runs[variant].append(json.loads(out.read_text()))
    summary = summarize(runs)
    print(report(summary, opts["repeats"]))
    if opts["out"]:
        Path(opts["out"]).write_text(json.dumps(summary, indent=2) + "\n")


def parse(argv: list[str]) -> tuple[dict, list[str]]:
    opts = {"variant": "", "workdir": "", "out": "", "repeats": 3}
    steps, rest, i = 60, [], 0
    while i < len(argv):
        key = argv[i].removeprefix("--")
        if key == "quick":
            opts["repeats"], steps, i = 1, 20, i + 1
            continue
        if key in ("variant", "workdir", "out", "repeats", "steps"):
            value = argv[i + 1]
            if key == "steps":
                steps = int(value)
            else:
                opts[key] = int(value) if key == "repeats" else value
        else:
            rest += argv[i:i + 2]
        i += 2
    defaults = ["--config", str(REPO / "train/configs/tiny.yaml"), "--max_steps", str(steps), "--log_every", "5",
                "--warmup_steps", "2", "--eval_every", str(10 * steps), "--save_every", "0"]
    return opts, defaults + rest


def measure(variant: str, train_args: list[str], workdir: Path) -> dict:
    """Run one variant in this process; return its steady-state step time and loader wait."""
    import data
    import main as accelerate_main
    import torch_ddp
    from config import load_config

    args = [*train_args, "--output_dir", str(workdir)]
    cfg = load_config(args)
    waits = []

    def timed(next_batch):
        def timed_next(*args):
            start = time.perf_counter()
            batch = next_batch(*args)
            waits.append(time.perf_counter() - start)
            return batch
        return timed_next

    if variant == "bare":
        windows = bare_loop(cfg, timed)
    else:
        data.TrainBatches.__next__ = timed(data.TrainBatches.__next__)
        entry = accelerate_main.main if variant == "accelerate" else torch_ddp.main
        try:
            entry(args)
        except SystemExit as e:
            if e.code:
                raise
        rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
        windows = [r["step_time_s"] for r in rows if "step_time_s" in r]
    steady = windows[1:] or windows
    step_time = statistics.mean(steady)
    warm_micro_batches = (len(windows) - len(steady)) * cfg.log_every * cfg.grad_accum_steps
    steady_wait = sum(waits[warm_micro_batches:]) / max(1, len(steady) * cfg.log_every)
    tokens = cfg.batch_size * cfg.grad_accum_steps * cfg.block_size
    return {"step_time_s": step_time, "tokens_per_s": tokens / step_time, "loader_wait_frac": steady_wait / step_time}


def bare_loop(cfg, timed) -> list[float]:
    """The reference: what a hand-written single-process loop does per step, nothing more."""
    import torch
    from torch.utils.data import DataLoader

    from data import EpochSampler, build_datasets, collate
    from model import build_model
    from optim import build_optimizer

    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_set, _ = build_datasets(cfg)
    sampler = EpochSampler(len(train_set), cfg.seed, cfg.batch_size * cfg.grad_accum_steps)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, collate_fn=collate, drop_last=True,
                        num_workers=cfg.num_workers, pin_memory=device.type == "cuda")
    model = build_model(cfg).to(device)
    model = torch.compile(model) if cfg.compile else model
    optimizer = build_optimizer(model, cfg)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.mixed_precision == "bf16")

    def endless():
        for epoch in range(10**9):
            sampler.set_epoch(epoch)
            yield from loader

    batches = endless()
    next_batch = timed(lambda: next(batches))
    windows, start = [], time.perf_counter()
    for step in range(1, cfg.max_steps + 1):
        for _ in range(cfg.grad_accum_steps):
            batch = {k: v.to(device, non_blocking=True) for k, v in next_batch().items()}
            with autocast:
                loss = model(**batch).loss
            (loss / cfg.grad_accum_steps).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % cfg.log_every == 0:
            loss.item()  # a logging loop syncs here; time is read after it
            now = time.perf_counter()
            windows.append((now - start) / cfg.log_every)
            start = now
    return windows


def summarize(runs: dict) -> dict:
    summary = {}
    for variant, results in runs.items():
        summary[variant] = {key: statistics.median(r[key] for r in results) for key in results[0]}
    summary["accelerate_over_bare"] = summary["accelerate"]["step_time_s"] / summary["bare"]["step_time_s"]
    summary["torch_over_accelerate"] = summary["torch"]["step_time_s"] / summary["accelerate"]["step_time_s"]
    return summary


def report(summary: dict, repeats: int) -> str:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    lines = [f"device: {device}; median of {repeats} interleaved repeats", "",
             f"{'variant':<11} {'step ms':>9} {'tokens/s':>12} {'loader wait':>12}"]
    for variant in VARIANTS:
        r = summary[variant]
        lines.append(f"{variant:<11} {1e3 * r['step_time_s']:>9.2f} {r['tokens_per_s']:>12,.0f} "
                     f"{100 * r['loader_wait_frac']:>11.2f}%")
    lines += ["", f"accelerate / bare:   {summary['accelerate_over_bare']:.3f}  (target <= 1.03)",
              f"torch / accelerate:  {summary['torch_over_accelerate']:.3f}  (target 0.97 .. 1.03)"]
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
