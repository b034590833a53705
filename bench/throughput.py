"""Per-step time of one model and batch several ways, interleaved in ONE process so machine noise cancels:

    bare        the fastest loop we write by hand: the packed train set as one tensor in memory, batches
                gathered by index (no DataLoader, no collate), forward, backward, clip, LR, AdamW step, a host
                sync at logging steps only (as nanoGPT's train.py feeds its batches)
    accelerate  train/main.py's train() with an Accelerator
    torch       the same train() with torch_ddp.TorchDDP
    streaming   with `--streaming`: the accelerate variant reading the same text as a stream (train/streaming.py:
                tokenized and packed as it is read, each step), instead of the map-style blocks tokenized once
    nanogpt     with `--nanogpt PATH` (a checkout of karpathy/nanoGPT, never copied here): nanoGPT's own
                model.py and its train.py's loop (get_batch from a uint16 memmap of the same bytes,
                configure_optimizers, get_lr, clip), on the same model size, batch and text

Each variant runs in its own thread. The threads start one after another: each one's set-up and first step
run alone. Then a baton lets one thread at a time run a block of `--block` optimizer steps, in an order that
rotates every round, so each round times the variants back to back. The first `--warmup` rounds (allocator,
caches, compilation) are not counted. Reported per variant: the median time per step, tokens/s, the share of
step time spent waiting for the next batch, the final train loss (of the final weights, on the same fixed
sample of training blocks for every variant) and, on GPUs, MFU and peak memory. The ratios accelerate/bare and
torch/accelerate are the MEDIAN OF PER-ROUND RATIOS with their spread (lowest and highest round). Two
back-to-back runs agreeing within 2% is what `--repeat 2` shows.

`--processes N` runs the same interleaving in N processes, started as the default CPU job is (`accelerate launch
--config_file accelerate_configs/cpu.yaml`; on GPUs 8gpu.yaml): every variant is then data-parallel over the N
processes (the bare loop and nanoGPT's with plain DDP, each rank taking its share of every batch), and every
rank runs the same sequence of blocks, so their collectives meet. Rank 0 reports.

    python bench/throughput.py                              # tiny preset, 12 rounds of 10 steps (CPU: ~1 min)
    python bench/throughput.py --rounds 20 --block 10 --n_layer 4 --n_embd 128 --block_size 64 --batch_size 12
    python bench/throughput.py --fixed_cost                 # 1 layer, width 32: per-step overhead in microseconds
    python bench/throughput.py --repeat 2                   # the same measurement twice, back to back
    python bench/throughput.py --processes 2                # 2 processes, launched as the default CPU job is
    python bench/throughput.py --config "" --processes 2    # the default job itself: TrainConfig's defaults
    python bench/throughput.py --startup                    # launch to first optimizer step, 2 processes
    python bench/throughput.py --streaming                  # the streamed corpus against the map-style one
    python bench/throughput.py --quick                      # seconds: the test suite's smoke run
    python bench/throughput.py --nanogpt ../nanoGPT --n_layer 4 --n_head 4 --n_embd 128 --block_size 64 \
        --batch_size 12                                     # the issue's side-by-side config

Any further flags are TrainConfig flags, shared by all the variants; `--out FILE` also writes the
figures as JSON. The loader wait is the time spent in `next()` on the training stream (batches.TrainBatches,
wrapped from outside, as the tests inject faults), and in the bare loop's own batch gathering.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "train"))

VARIANTS = ("bare", "accelerate", "torch")
FIXED_COST_MODEL = [
    "--n_layer",
    "1",
    "--n_head",
    "1",
    "--n_embd",
    "32",
    "--block_size",
    "16",
    "--batch_size",
    "1",
]


def main(argv: list[str]) -> None:
    opts, train_args = parse(argv)
    if opts["startup"]:
        print(startup_report(measure_startup(train_args, opts["startup"])))
        return
    if opts["processes"] > 1 and "WORLD_SIZE" not in os.environ:
        sys.exit(relaunch(argv, opts["processes"]))
    variants = (
        VARIANTS
        + (("streaming",) if opts["streaming"] else ())
        + (("nanogpt",) if opts["nanogpt"] else ())
    )
    reporting = int(os.environ.get("RANK", "0")) == 0
    results = []
    for _ in range(opts["repeat"]):
        results.append(measure(train_args, variants, opts))
        if reporting:
            print(report(results[-1]), end="\n\n", flush=True)
    if opts["repeat"] > 1 and reporting:
        first, second = (r["accelerate_over_bare"]["median"] for r in results[:2])
        print(
            f"back to back: accelerate / bare {first:.3f} then {second:.3f} "
            f"({100 * abs(second - first) / first:.1f}% apart)"
        )
    if opts["out"] and reporting:
        Path(opts["out"]).write_text(
            json.dumps(results if len(results) > 1 else results[0], indent=2) + "\n"
        )


def relaunch(argv: list[str], processes: int) -> int:
    """This script again, in `processes` processes, launched as the template's default job is."""
    config = "8gpu.yaml" if _on_gpu() else "cpu.yaml"
    return subprocess.call(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(REPO / "accelerate_configs" / config),
            "--num_processes",
            str(processes),
            "--main_process_port",
            str(_free_port()),
            __file__,
            *argv,
        ]
    )


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def parse(argv: list[str]) -> tuple[dict, list[str]]:
    opts = {
        "out": "",
        "nanogpt": "",
        "rounds": 12,
        "block": 10,
        "warmup": 2,
        "repeat": 1,
        "startup": 0,
        "streaming": False,
        "processes": 1,
    }
    rest, i = [], 0
    while i < len(argv):
        key = argv[i].removeprefix("--")
        if key == "quick":
            opts.update(rounds=3, block=3, warmup=1)
        elif key == "fixed_cost":
            rest += FIXED_COST_MODEL
        elif key == "streaming" and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
            opts["streaming"] = True
        elif key == "streaming":  # `--streaming false`: the training config's key, not the variant
            rest += argv[i : i + 2]
            i += 1
        elif key == "startup" and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
            opts["startup"] = 3  # launches of each kind
        elif key in opts:
            opts[key] = argv[i + 1] if key in ("out", "nanogpt") else int(argv[i + 1])
            i += 1
        else:
            rest += argv[i : i + 2]
            i += 1
        i += 1
    # the first step of each variant runs before the baton
    steps = 1 + opts["rounds"] * opts["block"]
    defaults = [
        "--config",
        str(REPO / "train/configs/tiny.yaml"),
        "--max_steps",
        str(steps),
        "--log_every",
        str(opts["block"]),
        "--warmup_steps",
        "2",
        "--eval_every",
        str(10 * steps),
        "--save_every",
        "0",
    ]
    return opts, defaults + rest


class Baton:
    """One variant at a time runs `block` optimizer steps, then hands over; the order rotates every round."""

    def __init__(self, names: tuple[str, ...], block: int, rounds: int):
        self.names, self.block, self.rounds = names, block, rounds
        self.cond = threading.Condition()
        self.ready: set[str] = set()
        self.queue: list[str] = []
        self.holder, self.count, self.started, self.round = None, 0, 0.0, 0
        self.seconds = {name: [] for name in names}  # per block
        self.waits = {name: [] for name in names}  # loader wait per block
        self.wait = 0.0
        self.final_loss: dict[str, float] = {}
        self.peak_bytes: dict[str, int] = {}  # GPU memory, highest over the variant's blocks
        self.errors: list[BaseException] = []

    def step(self, name: str) -> None:
        """Called by `name`'s thread after each of its optimizer steps."""
        with self.cond:
            if self.holder == name:
                self.count += 1
                if self.count < self.block:
                    return
                _sync()
                self.seconds[name].append(time.perf_counter() - self.started)
                self.waits[name].append(self.wait)
                self.peak_bytes[name] = max(self.peak_bytes.get(name, 0), _peak_memory(reset=True))
                if len(self.seconds[name]) == self.rounds:
                    return  # its last block: it keeps the baton until its train() has returned (finish)
                self._hand_over()
            else:
                # its first step: set-up is over; the next variant may start its own
                self.ready.add(name)
                self.cond.notify_all()
                if len(self.ready) == len(self.names):
                    self._hand_over()
            self.cond.wait_for(lambda: self.holder == name or self.errors)
            if self.errors:
                raise RuntimeError("stopped: another variant failed")
            _peak_memory(reset=True)  # the next block's peak is this variant's alone
            self.count, self.wait, self.started = 0, 0.0, time.perf_counter()

    def wait_until_ready(self, name: str) -> bool:
        """Until `name` has set up and made its first step; False if a variant failed instead."""
        with self.cond:
            self.cond.wait_for(lambda: name in self.ready or self.errors)
            return not self.errors

    def loader_wait(self, name: str, seconds: float) -> None:
        if self.holder == name:
            self.wait += seconds

    def finish(self, name: str, error: BaseException | None = None) -> None:
        with self.cond:
            if error is not None:
                self.errors.append(error)
                self.cond.notify_all()
            elif self.holder == name:
                self._hand_over()

    def _hand_over(self) -> None:
        """To the next variant in this round's order that has blocks left (rounds rotate who goes first)."""
        self.holder = None
        while any(len(self.seconds[n]) < self.rounds for n in self.names):
            if not self.queue:
                shift = self.round % len(self.names)
                self.queue, self.round = (
                    list(self.names[shift:] + self.names[:shift]),
                    self.round + 1,
                )
            candidate = self.queue.pop(0)
            if len(self.seconds[candidate]) < self.rounds:
                self.holder = candidate
                break
        self.cond.notify_all()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_memory(reset: bool) -> int:
    """Bytes of GPU memory allocated at most since the last reset (0 without a GPU)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    peak = torch.cuda.max_memory_allocated()
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return peak


def measure(train_args: list[str], variants: tuple[str, ...], opts: dict) -> dict:
    """Run the variants interleaved in this process; return per-variant figures and per-round ratios."""
    import torch
    import torch.distributed as dist

    import batches
    import data
    import main as accelerate_main
    import plumbing as plumbing_module
    import streaming
    import torch_ddp
    from blocks import flops_per_token
    from model import build_model
    from plumbing import init_process_group
    from profiling import peak_flops_per_gpu
    from run_config import load_config

    cfg = load_config(train_args)
    configs = {
        name: load_config([*train_args, *(["--streaming", "true"] if name == "streaming" else [])])
        for name in variants
    }  # parsed and checked here, before any thread
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        # once, for every variant: each plumbing would start its own
        init_process_group(cfg.dist_timeout_s)
        plumbing_module.init_process_group = torch_ddp.init_process_group = lambda timeout_s: None
    # it fills the datasets cache, which the other ranks (and the variants) then read
    with _rank_zero_first():
        sample = data.build_datasets(cfg)[0][:FINAL_LOSS_BLOCKS]["input_ids"]
    block = opts["block"]
    baton = Baton(variants, block, opts["rounds"])
    local = threading.local()
    next_batch = {
        stream: stream.__next__ for stream in (batches.TrainBatches, streaming.StreamBatches)
    }

    def timed_next(self):
        start = time.perf_counter()
        batch = next_batch[type(self)](self)
        baton.loader_wait(local.name, time.perf_counter() - start)
        return batch

    def run(name: str, workdir: Path) -> None:
        local.name = name
        error = None
        try:
            cfg = dataclasses.replace(configs[name], output_dir=str(workdir / name))
            if name == "bare":
                bare_loop(cfg, baton, sample)
            elif name == "nanogpt":
                nanogpt_loop(cfg, baton, sample, Path(opts["nanogpt"]), workdir)
            else:
                plumbing = (
                    torch_ddp.TorchDDP(cfg)
                    if name == "torch"
                    else plumbing_module.build_accelerator(cfg)
                )
                accelerate_main.train(cfg, plumbing)
                model = trained[name]
                baton.final_loss[name] = sample_loss(
                    lambda x: model(input_ids=x, labels=x).loss, model, sample
                )
        except BaseException as e:  # noqa: BLE001 - reported after the other threads are released
            error = e
        baton.finish(name, error)

    original_step, original_export, trained = (
        accelerate_main.Throughput.step,
        accelerate_main.export_model,
        {},
    )

    def step(self):
        original_step(self)
        baton.step(local.name)

    def export_model(plumbing, model, cfg):  # train()'s last act: keep its model
        trained[local.name] = plumbing.unwrap_model(model, keep_torch_compile=False)
        return original_export(plumbing, model, cfg)

    with tempfile.TemporaryDirectory() as own_folder:
        shared = [own_folder]
        # the ranks of each variant share one run folder, as a job's ranks do
        if dist.is_initialized():
            dist.broadcast_object_list(shared)
        workdir = Path(shared[0])
        batches.TrainBatches.__next__ = streaming.StreamBatches.__next__ = timed_next
        accelerate_main.Throughput.step, accelerate_main.export_model = step, export_model
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # train()'s log lines
                threads = [
                    threading.Thread(target=run, args=(name, workdir), name=name)
                    for name in variants
                ]
                # set-up and first step alone: collectives meet in one order on every rank,
                for thread in threads:
                    thread.start()  # and datasets' and tokenizers' first calls need no thread safety
                    if not baton.wait_until_ready(thread.name):
                        break
                for thread in (thread for thread in threads if thread.ident is not None):
                    thread.join()
        finally:
            for stream, original in next_batch.items():
                stream.__next__ = original
            accelerate_main.Throughput.step, accelerate_main.export_model = (
                original_step,
                original_export,
            )
        if dist.is_initialized() and not baton.errors:
            dist.barrier()  # every rank is done with rank 0's folder before it goes
    if baton.errors:
        raise baton.errors[0]
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    tokens = cfg.batch_size * cfg.grad_accum_steps * cfg.block_size * world_size
    summary = summarize(baton, opts["warmup"], block, tokens, train_args)
    peak = (
        _on_gpu()
        and cfg.mixed_precision in ("bf16", "fp16")
        and peak_flops_per_gpu(torch.cuda.get_device_name())
    )
    if peak:  # MFU against the dense bf16 peak, as train() logs it (PaLM's FLOPs per token)
        model_flops = flops_per_token(build_model(cfg))
        for name in variants:
            summary[name]["mfu"] = summary[name]["tokens_per_s"] * model_flops / (peak * world_size)
    return summary


@contextlib.contextmanager
def _rank_zero_first():
    import torch.distributed as dist

    waiting = dist.is_initialized() and dist.get_rank() != 0
    if waiting:
        dist.barrier()
    yield
    if dist.is_initialized() and not waiting:
        dist.barrier()


def bare_loop(cfg, baton: Baton, sample) -> None:
    """The reference: what the fastest hand-written loop does per step, nothing more (several processes: plain DDP,
    each rank taking its slice of every global batch)."""
    import torch

    from blocks import transformer_blocks
    from compiling import compile_wanted
    from data import build_datasets
    from model import build_model
    from optim import build_optimizer, set_lr

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    world_size, rank = _world()
    train_set, _ = build_datasets(cfg)
    blocks = train_set[:][
        "input_ids"
    ]  # the whole packed train set as one (N, block_size) int64 tensor
    torch.manual_seed(cfg.seed)
    model = build_model(cfg).to(device)
    optimizer = build_optimizer(model, cfg)
    if compile_wanted(cfg.compile):  # as the template does: each block in place
        for block in transformer_blocks(model, "regional compilation"):
            block.compile()
    model = _ddp(model) if world_size > 1 else model
    autocast = torch.autocast(
        device.type, dtype=torch.bfloat16, enabled=cfg.mixed_precision == "bf16"
    )
    generator = torch.Generator().manual_seed(cfg.seed)
    order, position, global_batch = (
        torch.randperm(len(blocks), generator=generator),
        0,
        cfg.batch_size * world_size,
    )
    for step in range(cfg.max_steps):
        for micro_step in range(cfg.grad_accum_steps):
            start = time.perf_counter()
            if position + global_batch > len(order):
                order, position = torch.randperm(len(blocks), generator=generator), 0
            mine = order[position + rank * cfg.batch_size : position + (rank + 1) * cfg.batch_size]
            x = blocks[mine].to(device, non_blocking=True)
            position += global_batch
            baton.loader_wait("bare", time.perf_counter() - start)
            with _no_sync(model, micro_step < cfg.grad_accum_steps - 1):
                with autocast:
                    loss = model(input_ids=x, labels=x).loss
                (loss / cfg.grad_accum_steps).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        set_lr(optimizer, step, cfg)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % cfg.log_every == 0:
            loss.item()  # a logging loop waits for the device here, and only here
        baton.step("bare")
    plain = getattr(model, "module", model)
    baton.final_loss["bare"] = sample_loss(
        lambda x: plain(input_ids=x, labels=x).loss, plain, sample
    )


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)


def _ddp(model):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else None
    return DistributedDataParallel(model, device_ids=devices)


def _no_sync(model, skip: bool):
    return model.no_sync() if skip and hasattr(model, "no_sync") else contextlib.nullcontext()


def nanogpt_loop(cfg, baton: Baton, sample, checkout: Path, workdir: str) -> None:
    """nanoGPT's train.py loop around nanoGPT's own model.py (imported from the checkout), on the same bytes."""
    import importlib.util
    import math

    import numpy as np
    import torch

    from compiling import compile_wanted
    from data import build_datasets
    from lm import vocab_size

    # ours is `model` too
    spec = importlib.util.spec_from_file_location("nanogpt_model", checkout / "model.py")
    nanogpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nanogpt)
    GPT, GPTConfig = nanogpt.GPT, nanogpt.GPTConfig  # noqa: N806 - nanoGPT's names

    world_size, rank = _world()
    train_set, _ = build_datasets(cfg)
    # nanoGPT's format: the token stream as uint16
    path = Path(workdir) / f"nanogpt_train_{rank}.bin"
    np.asarray(train_set[:]["input_ids"], dtype=np.uint16).reshape(-1).tofile(path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(cfg.seed)
    model = GPT(
        GPTConfig(
            block_size=cfg.block_size,
            vocab_size=vocab_size(cfg),
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_embd=cfg.n_embd,
            dropout=cfg.dropout,
            bias=cfg.bias,
        )
    ).to(device)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.lr, (cfg.beta1, cfg.beta2), device)
    plain = model
    # nanoGPT's train.py compiles the whole model
    model = torch.compile(model) if compile_wanted(cfg.compile) else model
    model = _ddp(model) if world_size > 1 else model
    ctx = torch.autocast(device, dtype=torch.bfloat16, enabled=cfg.mixed_precision == "bf16")

    def get_batch():  # train.py's, as written there
        data = np.memmap(path, dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - cfg.block_size, (cfg.batch_size,))
        x = torch.stack(
            [torch.from_numpy((data[i : i + cfg.block_size]).astype(np.int64)) for i in ix]
        )
        y = torch.stack(
            [torch.from_numpy((data[i + 1 : i + 1 + cfg.block_size]).astype(np.int64)) for i in ix]
        )
        if device == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(
                device, non_blocking=True
            )
        return x.to(device), y.to(device)

    def get_lr(it):  # train.py's
        if it < cfg.warmup:
            return cfg.lr * (it + 1) / (cfg.warmup + 1)
        if it > cfg.decay_steps:
            return cfg.min_lr
        coeff = 0.5 * (1.0 + math.cos(math.pi * (it - cfg.warmup) / (cfg.decay_steps - cfg.warmup)))
        return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)

    start = time.perf_counter()
    x, y = get_batch()
    baton.loader_wait("nanogpt", time.perf_counter() - start)
    for step in range(cfg.max_steps):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(step)
        for micro_step in range(cfg.grad_accum_steps):
            if world_size > 1:  # train.py's way to skip the all-reduce until the last micro-step
                model.require_backward_grad_sync = micro_step == cfg.grad_accum_steps - 1
            with ctx:
                _, loss = model(x, y)
                loss = loss / cfg.grad_accum_steps
            start = time.perf_counter()
            x, y = get_batch()  # train.py fetches the next batch here, while the GPU works
            baton.loader_wait("nanogpt", time.perf_counter() - start)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % cfg.log_every == 0:
            loss.item()
        baton.step("nanogpt")
    baton.final_loss["nanogpt"] = sample_loss(
        lambda x: plain(x[:, :-1].contiguous(), x[:, 1:].contiguous())[1], plain, sample
    )


FINAL_LOSS_BLOCKS = 256  # the first training blocks: one fixed sample, the same for every variant


def sample_loss(loss_of, model, sample) -> float:
    """The final weights' mean next-token loss on `sample` (the same 63 predictions per block for every model): the
    train loss at the end, without the batch-to-batch noise of one logged step."""
    import torch

    model.eval()
    device = next(model.parameters()).device
    with torch.no_grad():
        return statistics.mean(loss_of(chunk.to(device)).item() for chunk in sample.split(32))


def summarize(
    baton: Baton, warmup: int, block: int, tokens_per_step: int, train_args: list[str]
) -> dict:
    variants = tuple(baton.seconds)
    counted = {name: baton.seconds[name][warmup:] for name in variants}
    rounds = min(len(s) for s in counted.values())
    summary = {"rounds": rounds, "block_steps": block, "train_args": train_args}
    for name in variants:
        step_times = [s / block for s in counted[name]]
        waits = [w / s for w, s in zip(baton.waits[name][warmup:], counted[name], strict=True)]
        step = statistics.median(step_times)
        summary[name] = {
            "step_time_s": step,
            "step_time_us": 1e6 * step,
            "tokens_per_s": tokens_per_step / step,
            "loader_wait_frac": statistics.median(waits),
            "final_loss": baton.final_loss[name],
            "peak_mem_gib": baton.peak_bytes.get(name, 0) / 2**30,
        }
    for key, top, bottom in (
        ("accelerate_over_bare", "accelerate", "bare"),
        ("torch_over_accelerate", "torch", "accelerate"),
        ("streaming_over_accelerate", "streaming", "accelerate"),
        ("nanogpt_over_accelerate", "nanogpt", "accelerate"),  # = accelerate's speed-up
        ("nanogpt_over_bare", "nanogpt", "bare"),
    ):
        if top not in counted:
            continue
        ratios = [
            a / b for a, b in zip(counted[top][:rounds], counted[bottom][:rounds], strict=True)
        ]
        summary[key] = {
            "median": statistics.median(ratios),
            "low": min(ratios),
            "high": max(ratios),
        }
    return summary


def report(summary: dict) -> str:
    import torch

    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"CPU, {torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''}"
    )
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    lines = [
        f"device: {device} x {processes} process{'es' if processes > 1 else ''}; {summary['rounds']} "
        f"interleaved rounds of {summary['block_steps']} steps per variant",
        "",
        f"{'variant':<11} {'step':>12} {'tokens/s':>12} {'loader wait':>12} {'final loss':>11}",
    ]
    for name in (name for name in (*VARIANTS, "streaming", "nanogpt") if name in summary):
        r = summary[name]
        step = (
            f"{r['step_time_us']:.0f} us"
            if r["step_time_s"] < 0.01
            else f"{1e3 * r['step_time_s']:.2f} ms"
        )
        gpu = f"  MFU {100 * r['mfu']:.1f}%" if "mfu" in r else ""
        gpu += f"  peak memory {r['peak_mem_gib']:.1f} GiB" if r.get("peak_mem_gib") else ""
        lines.append(
            f"{name:<11} {step:>12} {r['tokens_per_s']:>12,.0f} {100 * r['loader_wait_frac']:>11.2f}% "
            f"{r['final_loss']:>11.4f}{gpu}"
        )
    for key, label, target in (
        ("accelerate_over_bare", "accelerate / bare:  ", "target <= 1.02"),
        ("torch_over_accelerate", "torch / accelerate: ", "target 0.98 .. 1.02"),
        ("streaming_over_accelerate", "streaming / map:    ", "step time, streamed / map-style"),
        ("nanogpt_over_accelerate", "nanogpt / accelerate:", "Accelerate's speed-up; >= 1.10"),
        ("nanogpt_over_bare", "nanogpt / bare:     ", "target >= 1.00"),
    ):
        if key not in summary:
            continue
        r = summary[key]
        lines.append(
            f"{label} {r['median']:.3f}  (rounds {r['low']:.3f} .. {r['high']:.3f}; {target})"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- start-up: launch to the first optimizer step

MINIMAL_SCRIPT = """
import sys, time, torch, datasets
from accelerate import Accelerator
sys.path.insert(0, {train!r})
from model import build_model
from run_config import config_class
cfg = config_class()(block_size={block_size}, n_layer={n_layer}, n_head={n_head}, n_embd={n_embd})
accelerator = Accelerator(cpu=not torch.cuda.is_available())
def encode(batch):  # no closure: datasets caches the result by the function's hash, as it does the template's
    return {{"input_ids": [list(t.encode()[:{block_size}].ljust({block_size}, b" ")) for t in batch["text"]]}}
with accelerator.main_process_first():  # as Accelerate's examples do
    text = datasets.load_dataset("json", data_files={dataset!r})["train"]
    ids = text.map(encode, batched=True, remove_columns=text.column_names)
loader = torch.utils.data.DataLoader(ids.with_format("torch"), batch_size={batch_size})
model = build_model(cfg)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
batch = next(iter(loader))
accelerator.backward(model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss)
optimizer.step()
if accelerator.is_main_process:
    open({marker!r}, "w").write("first step")
"""


def measure_startup(train_args: list[str], launches: int) -> dict:
    """Seconds from the launch command to the first optimizer step (the first metrics row; the minimal script's
    marker file), 2 processes, each launch alone on the machine; the median of `launches`."""
    from run_config import load_config

    cfg = load_config(train_args)
    dataset = (
        cfg.dataset
        if cfg.dataset != "python_stdlib"
        else str(REPO / "data/python_stdlib/stdlib.jsonl")
    )
    accelerate = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(
            REPO / "accelerate_configs/cpu.yaml"
            if not _on_gpu()
            else REPO / "accelerate_configs/8gpu.yaml"
        ),
        "--num_processes",
        "2",
    ]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
    ]
    results: dict[str, list[float]] = {
        "accelerate launch": [],
        "torchrun": [],
        "minimal Accelerate script": [],
    }
    with tempfile.TemporaryDirectory() as workdir:
        for launch in range(launches):
            for kind in results:
                out = Path(workdir) / f"{kind.replace(' ', '_')}_{launch}"
                marker = out / "metrics.jsonl"
                args = [
                    *train_args,
                    "--output_dir",
                    str(out),
                    "--log_every",
                    "1",
                    "--max_steps",
                    "1",
                ]
                if kind == "accelerate launch":
                    cmd = [*accelerate, str(REPO / "train/main.py"), *args]
                elif kind == "torchrun":
                    cmd = [*torchrun, str(REPO / "train/torch_ddp.py"), *args]
                else:
                    out.mkdir(parents=True)
                    script = out / "minimal.py"
                    script.write_text(
                        MINIMAL_SCRIPT.format(
                            train=str(REPO / "train"),
                            dataset=dataset,
                            marker=str(marker),
                            block_size=cfg.block_size,
                            n_layer=cfg.n_layer,
                            n_head=cfg.n_head,
                            n_embd=cfg.n_embd,
                            batch_size=cfg.batch_size,
                        )
                    )
                    cmd = [*accelerate, str(script)]
                started = time.perf_counter()
                process = subprocess.Popen(
                    cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                while not (marker.exists() and marker.stat().st_size) and process.poll() is None:
                    time.sleep(0.01)
                results[kind].append(time.perf_counter() - started)
                process.wait()
    return {kind: statistics.median(seconds) for kind, seconds in results.items()}


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def startup_report(seconds: dict) -> str:
    minimal = seconds["minimal Accelerate script"]
    return "\n".join(
        ["launch to first optimizer step, 2 processes (median):"]
        + [
            f"  {kind:<27} {value:6.2f} s  ({value / minimal:.2f}x the minimal script; target <= 1.2)"
            for kind, value in seconds.items()
        ]
    )


if __name__ == "__main__":
    main(sys.argv[1:])
