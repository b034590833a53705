"""The same training run without Accelerate: every method below is something Accelerate did for main.py.

    python train/torch_ddp.py --config train/configs/tiny.yaml                    # one plain process
    torchrun --standalone --nproc_per_node 2 train/torch_ddp.py --config train/configs/tiny.yaml
    torchrun --nnodes 2 --nproc_per_node 8 --node_rank 0 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        train/torch_ddp.py ...                                                    # on each node
    python train/torch_ddp.py --spawn 2 ...          # mp.spawn, for people who launch from Python

It runs `train()` from main.py (one loop, two plumbings) with the same config, data, model, optimizer,
schedule, checkpoints and metrics.jsonl. Both paths draw each epoch's permutation from (seed, epoch),
so every global batch holds the same samples and the losses agree (tests/e2e/test_torch_ddp.py); only
the split across ranks differs (DistributedSampler strides, Accelerate hands out whole batches).
"""

from __future__ import annotations

import functools
import os
import socket
import sys
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from config import ConfigError, TrainConfig
from job import check_world_size, exit_with_error, init_process_group, load_config_or_exit, run_or_exit
from main import train


class TorchDDP:
    """Process group, device, DDP, sharded loaders, accumulation, collectives: Accelerator's job, by hand."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.num_processes = int(os.environ.get("WORLD_SIZE", "1"))
        self.process_index = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.is_main_process, self.is_local_main_process = self.process_index == 0, local_rank == 0
        self.device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # before NCCL: each process on its own GPU
        self.distributed = self.num_processes > 1
        if self.distributed:
            init_process_group(cfg.dist_timeout_s)
            check_world_size(dist.get_world_size())
        self.mixed_precision = cfg.mixed_precision or "no"  # torchrun has no precision setting of its own
        self.scaler = None  # checkpoint.py saves a grad scaler's state when a plumbing has one
        self.sync_gradients = True
        self._micro_step = 0
        self.eval_samples_left = 0  # set by the eval loader; lets gather_for_metrics drop the padding
        self.trackers = []

    def prepare(self, model, optimizer, train_loader, eval_loader):
        model = model.to(self.device)
        if self.distributed:  # broadcasts rank 0's weights, then all-reduces gradients in backward
            model = DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                        find_unused_parameters=self.cfg.find_unused_parameters)
        if self.mixed_precision == "bf16":  # what Accelerate does: autocast around forward
            model.forward = _autocast(model.forward, self.device.type)
        return (model, optimizer, ShardedLoader(train_loader, self, train=True),
                ShardedLoader(eval_loader, self, train=False))

    @contextmanager
    def accumulate(self, model):
        """no_sync() on all but the last micro-step: one gradient all-reduce per optimizer step."""
        self._micro_step += 1
        self.sync_gradients = self._micro_step % self.cfg.grad_accum_steps == 0
        with model.no_sync() if self.distributed and not self.sync_gradients else nullcontext():
            yield

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.cfg.grad_accum_steps).backward()  # the step's gradient is the micro-steps' mean

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def reduce(self, tensor: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        if not self.distributed:
            return tensor
        total = tensor.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total / self.num_processes if reduction == "mean" else total

    def gather_for_metrics(self, tensor: torch.Tensor) -> torch.Tensor:
        """All ranks' values in dataset order, without the copies DistributedSampler padded with."""
        if not self.distributed:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.num_processes)]
        dist.all_gather(parts, tensor.contiguous())
        # rank r held padded positions r, r + world, ...: interleaving restores the order, padding comes last
        ordered = torch.stack(parts, dim=1).flatten(0, 1)
        kept = ordered[:self.eval_samples_left]
        self.eval_samples_left -= len(kept)
        return kept

    @contextmanager
    def main_process_first(self, first: bool | None = None):
        """The body runs on `first` (default: rank 0) before every other process, e.g. to fill a cache."""
        first = self.is_main_process if first is None else first
        if not first:
            self.wait_for_everyone()
        yield
        if first:
            self.wait_for_everyone()

    def local_main_process_first(self):
        return self.main_process_first(first=self.is_local_main_process)  # once per node

    def wait_for_everyone(self) -> None:
        if self.distributed:
            dist.barrier()

    def unwrap_model(self, model, keep_torch_compile: bool = True):
        """The module inside DDP; also inside torch.compile's wrapper when keep_torch_compile is False.
        (train() compiles the prepared model, compile(DDP(module)), so under DDP both wrappers come off.)"""
        if keep_torch_compile and not self.distributed:
            return model
        module = getattr(model, "_orig_mod", model)
        return module.module if isinstance(module, DDP) else module

    def init_trackers(self, project_name: str, config: dict, init_kwargs: dict) -> None:
        """Accelerate's own tracker classes (W&B, TensorBoard), created on the main process only."""
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        if not self.is_main_process:
            return
        for name in self.cfg.trackers():
            tracker_class, kwargs = LOGGER_TYPE_TO_CLASS[name], init_kwargs.get(name, {})
            if tracker_class.requires_logging_directory:
                self.trackers.append(tracker_class(project_name, self.cfg.output_dir, **kwargs))
            else:
                self.trackers.append(tracker_class(project_name, **kwargs))
            self.trackers[-1].start()
            self.trackers[-1].store_init_configuration(config)

    def log(self, values: dict, step: int) -> None:
        for tracker in self.trackers:
            tracker.log(values, step=step)

    def end_training(self) -> None:
        self.wait_for_everyone()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class ShardedLoader:
    """This rank's share of a loader, through DistributedSampler, with batches moved to the device.

    The loop positions its EpochSampler (epoch, samples to skip); this loader passes both on to the
    DistributedSampler, which draws the same permutation from (seed, epoch) and strides it.
    """

    def __init__(self, loader: DataLoader, plumbing: TorchDDP, train: bool):
        self.plumbing, self.train, self.source = plumbing, train, loader.sampler
        self.sampler = ResumableDistributedSampler(loader.dataset, num_replicas=plumbing.num_processes,
                                                   rank=plumbing.process_index, shuffle=train,
                                                   seed=plumbing.cfg.seed, drop_last=train)
        self.loader = DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=self.sampler,
                                 collate_fn=loader.collate_fn, num_workers=loader.num_workers,
                                 pin_memory=loader.pin_memory, drop_last=train, generator=loader.generator)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)  # without it every epoch repeats the first one's order

    def __iter__(self):
        if self.train:
            self.sampler.skip = self.source.pop_skip() // self.plumbing.num_processes
        else:
            self.plumbing.eval_samples_left = len(self.loader.dataset)
        device = self.plumbing.device
        for batch in self.loader:
            yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}

    def __len__(self) -> int:
        return len(self.loader)


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start the next pass part-way, for an exact mid-epoch resume."""

    skip = 0

    def __iter__(self):
        indices = list(super().__iter__())[self.skip:]
        self.skip = 0
        return iter(indices)


def _autocast(forward, device_type: str):
    @functools.wraps(forward)
    def forward_in_bf16(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
            return forward(*args, **kwargs)
    return forward_in_bf16


# ---------------------------------------------------------------- entry points


@record  # an unexpected exception's traceback goes into torchrun's summary
def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    processes = _pop_spawn(argv)
    cfg = load_config_or_exit(argv)  # checked once, before any process starts
    if cfg.mixed_precision == "fp16":
        exit_with_error(ConfigError("mixed_precision fp16 needs a GradScaler, which torch_ddp.py leaves out: "
                                    "use bf16, or main.py"))
    if processes:
        port = _free_port()
        mp.spawn(_spawned, args=(processes, argv, port), nprocs=processes, join=True)
    else:
        run(cfg)


def run(cfg: TrainConfig) -> None:
    run_or_exit(train, cfg, TorchDDP)  # which calls TorchDDP.close (destroy_process_group) on every way out


def _spawned(rank: int, world_size: int, argv: list[str], port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run(load_config_or_exit(argv))


def _pop_spawn(argv: list[str]) -> int:
    if "--spawn" not in argv:
        return 0
    i = argv.index("--spawn")
    value = argv[i + 1] if i + 1 < len(argv) else ""
    if not value.isdigit() or int(value) < 1:
        exit_with_error(ConfigError(f"spawn must be a process count (got {value!r})"))
    del argv[i:i + 2]
    return int(value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
