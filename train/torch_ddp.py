"""The same training run without Accelerate: TorchDDP implements the plumbing contract (plumbing.py)
by hand.

    python train/torch_ddp.py --config train/configs/tiny.yaml                    # one plain process
    torchrun --standalone --nproc_per_node 2 train/torch_ddp.py --config train/configs/tiny.yaml
    torchrun --nnodes 2 --nproc_per_node 8 --node_rank 0 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        train/torch_ddp.py ...                                                    # on each node
    python train/torch_ddp.py --spawn 2 ...          # mp.spawn, for people who launch from Python
    torchrun ... train/torch_ddp.py --fsdp full      # FSDP2 (--fsdp hybrid: HSDP, sharded per node)

It runs `train()` from main.py (one loop, two plumbings) with the same config, data, model,
optimizer, schedule, checkpoints and metrics.jsonl, and splits each global batch across ranks as
Accelerate does: with one config the two paths log bitwise-identical losses and end with identical
weights (tests/e2e/test_torch_ddp.py). """

from __future__ import annotations

import os
import socket
import sys
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler

from blocks import transformer_blocks
from config import TrainConfig
from errors import ConfigError
from job import exit_with_error, load_config_or_exit, run_or_exit
from main import train
from plumbing import check_world_size, init_process_group
from sharding import mesh_shape


class TorchDDP:
    """Process group, device, DDP, sharded loaders, accumulation, collectives: Accelerator's job, by
    hand."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.num_processes = int(os.environ.get("WORLD_SIZE", "1"))
        self.process_index = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.is_main_process = self.process_index == 0
        self.is_local_main_process = local_rank == 0
        self.device = (
            torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        )
        self.distributed = self.num_processes > 1 or (
            cfg.fsdp != "no" and "MASTER_ADDR" in os.environ
        )
        if self.distributed:
            init_process_group(cfg.dist_timeout_s)
            check_world_size(dist.get_world_size())
        # torchrun has no precision setting of its own
        self.mixed_precision = cfg.mixed_precision or "no"
        # fp16, the one precision that needs a loss scaler, is refused on this path (main)
        self.scaler = None
        self.sync_gradients = True
        self.trackers = []
        self._micro_step = 0
        # while a loader yields an eval set's padded last batch: its real samples
        self._real_samples = None

    def prepare(self, *objects):
        names = {
            id(p): n
            for obj in objects
            if isinstance(obj, torch.nn.Module)
            for n, p in obj.named_parameters()
        }
        prepared = tuple(self._prepare(obj) for obj in objects)
        # fully_shard replaced each parameter by a sharded one: the optimizer must step those
        if self.cfg.fsdp != "no":
            sharded = {
                n: p
                for obj in prepared
                if isinstance(obj, torch.nn.Module)
                for n, p in obj.named_parameters()
            }
            for optimizer in (obj for obj in prepared if isinstance(obj, torch.optim.Optimizer)):
                for group in optimizer.param_groups:
                    group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        return prepared[0] if len(prepared) == 1 else prepared

    def _prepare(self, obj):
        if isinstance(obj, DataLoader):
            return ShardedLoader(obj, self)
        if not isinstance(obj, torch.nn.Module):
            return obj  # optimizers, LR schedulers: used as they are
        model = obj.to(self.device)
        if self.cfg.fsdp != "no":
            return self._shard(model)
        if self.mixed_precision == "bf16":
            model = Autocast(model, self.device.type)
        if self.distributed:  # broadcasts rank 0's weights, then all-reduces gradients in backward
            model = DDP(
                model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                **self.cfg.ddp_options(),
            )
        return model

    def _shard(self, model):
        """FSDP2: every transformer block, then the root, sharded over a 1-D mesh (full) or, for
        hybrid, over the processes of a node and replicated across nodes (a 2-D mesh). bf16: bf16
        compute, fp32 gradient reduction."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not self.distributed:
            raise ConfigError(
                "fsdp needs a process group: launch with torchrun --nproc_per_node N (N >= 1)"
            )
        shape, names = mesh_shape(self.cfg.fsdp, self.num_processes)
        mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.mixed_precision == "bf16"
            else MixedPrecisionPolicy()
        )
        # one all-gather per block in forward and in backward
        for block in transformer_blocks(model, "fsdp"):
            fully_shard(block, mesh=mesh, mp_policy=policy)
        return fully_shard(model, mesh=mesh, mp_policy=policy)

    @contextmanager
    def accumulate(self, model):
        """No gradient all-reduce (or reduce-scatter) but on the last micro-step: one per optimizer
        step."""
        self._micro_step += 1
        self.sync_gradients = self._micro_step % self.cfg.grad_accum_steps == 0
        # FSDP2 has no no_sync(): it is told whether to reduce-scatter the gradients
        if self.cfg.fsdp != "no":
            model.set_requires_gradient_sync(self.sync_gradients)
            yield
        else:
            with model.no_sync() if self.distributed and not self.sync_gradients else nullcontext():
                yield

    def backward(self, loss: torch.Tensor) -> None:
        # the step's gradient is the micro-steps' mean
        (loss / self.cfg.grad_accum_steps).backward()

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        # FSDP: a DTensor, as accelerate returns it
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def reduce(self, tensor: torch.Tensor, reduction: str) -> torch.Tensor:
        if not self.distributed:
            return tensor
        total = tensor.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total / self.num_processes if reduction == "mean" else total

    def gather_for_metrics(self, data):
        return map_tensors(self._gather, data)

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            parts = [torch.empty_like(tensor) for _ in range(self.num_processes)]
            dist.all_gather(parts, tensor.contiguous())
            tensor = torch.cat(parts)  # rank order is sample order (ShardedLoader)
        return tensor if self._real_samples is None else tensor[: self._real_samples]

    @contextmanager
    def main_process_first(self, first: bool | None = None):
        """The body runs on `first` (default: rank 0) before every other process, e.g. to fill a
        cache."""
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

    def unwrap_model(self, model, keep_torch_compile: bool = False):
        """The user's module inside torch.compile's wrapper (always removed), DDP and Autocast."""
        module = getattr(model, "_orig_mod", model)
        while isinstance(module, (DDP, Autocast)):
            module = module.module
        return module

    def init_trackers(
        self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None
    ) -> None:
        """Accelerate's own tracker classes (W&B, TensorBoard), created on the main process only."""
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        if not self.is_main_process:
            return
        for name in self.cfg.trackers():
            tracker_class, kwargs = LOGGER_TYPE_TO_CLASS[name], (init_kwargs or {}).get(name, {})
            logging_dir = [self.cfg.run_dir] if tracker_class.requires_logging_directory else []
            self.trackers.append(tracker_class(project_name, *logging_dir, **kwargs))
            self.trackers[-1].start()
            self.trackers[-1].store_init_configuration(config)

    def log(self, values: dict, step: int | None = None) -> None:
        for tracker in self.trackers:
            tracker.log(values, step=step)


def map_tensors(fn, data):
    """fn applied to every tensor in nested dicts, tuples and lists."""
    if isinstance(data, dict):
        return {key: map_tensors(fn, value) for key, value in data.items()}
    if isinstance(data, (tuple, list)):
        return type(data)(map_tensors(fn, value) for value in data)
    return fn(data) if isinstance(data, torch.Tensor) else data


class Autocast(torch.nn.Module):
    """bf16: the wrapped module's forward runs under torch.autocast, as Accelerate runs a prepared
    model's."""

    def __init__(self, module: torch.nn.Module, device_type: str):
        super().__init__()
        self.module = module
        self.device_type = device_type

    def forward(self, *args, **kwargs):
        with torch.autocast(device_type=self.device_type, dtype=torch.bfloat16):
            return self.module(*args, **kwargs)


class ShardedLoader:
    """A DataLoader's batches as this rank's share of each global batch, on the device (a prepared
    loader)."""

    def __init__(self, loader: DataLoader, plumbing: TorchDDP):
        self.plumbing = plumbing
        self.sampler = loader.sampler
        self.batches = RankBatches(
            loader.sampler,
            loader.batch_size,
            plumbing.num_processes,
            plumbing.process_index,
            loader.drop_last,
        )
        self.loader = DataLoader(
            loader.dataset,
            batch_sampler=self.batches,
            collate_fn=loader.collate_fn,
            num_workers=loader.num_workers,
            pin_memory=loader.pin_memory,
            generator=loader.generator,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
        )

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        device, last = self.plumbing.device, len(self.loader) - 1
        for index, batch in enumerate(self.loader):
            self.plumbing._real_samples = (
                self.batches.real_samples_in_last if index == last else None
            )
            yield map_tensors(lambda tensor: tensor.to(device, non_blocking=True), batch)
        self.plumbing._real_samples = None


class RankBatches(Sampler[list[int]]):
    """This rank's batch of every global batch, as Accelerate's BatchSamplerShard splits it: rank r
    holds samples [r * batch_size, (r+1) * batch_size). An incomplete last global batch is dropped
    (drop_last) or completed with the pass's first samples, so that every rank gets a full batch
    (gather_for_metrics drops them)."""

    def __init__(self, sampler, batch_size: int, world: int, rank: int, drop_last: bool):
        self.sampler = sampler
        self.batch_size = batch_size
        self.rank = rank
        self.drop_last = drop_last
        self.span = batch_size * world

    def __iter__(self):
        indices = list(self.sampler)
        if self.drop_last:
            indices = indices[: len(indices) - len(indices) % self.span]
        elif indices:
            indices += [indices[i % len(indices)] for i in range(-len(indices) % self.span)]
        for start in range(self.rank * self.batch_size, len(indices), self.span):
            yield indices[start : start + self.batch_size]

    def __len__(self) -> int:
        return len(self.sampler) // self.span + (self.real_samples_in_last is not None)

    @property
    def real_samples_in_last(self) -> int | None:
        return None if self.drop_last else len(self.sampler) % self.span or None


# ---------------------------------------------------------------- entry points


@record  # an unexpected exception's traceback goes into torchrun's summary
def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    processes = _pop_spawn(argv)
    cfg = load_config_or_exit(argv)  # checked once, before any process starts
    if cfg.mixed_precision == "fp16":
        exit_with_error(
            ConfigError(
                "mixed_precision fp16 needs a GradScaler, which torch_ddp.py leaves out: "
                "use bf16, or main.py"
            )
        )
    if not processes:
        run_or_exit(train, cfg, TorchDDP)  # exits; the process group is closed on every way out
    with socket.socket() as s:  # a free port for the spawned processes' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(processes, argv, port), nprocs=processes, join=True)


def _spawned(rank: int, world_size: int, argv: list[str], port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    run_or_exit(train, load_config_or_exit(argv), TorchDDP)


def _pop_spawn(argv: list[str]) -> int:
    if "--spawn" not in argv:
        return 0
    i = argv.index("--spawn")
    value = argv[i + 1] if i + 1 < len(argv) else ""
    if not value.isdigit() or int(value) < 1:
        exit_with_error(ConfigError(f"spawn must be a process count (got {value!r})"))
    del argv[i : i + 2]
    return int(value)


if __name__ == "__main__":
    main()
