"""The plumbing contract, and what every plumbing shares.

`Plumbing` is what train(), checkpoint.py, resume.py, tracking.py and job.py ask of the object that
knows about processes and devices. `accelerate.Accelerator` satisfies it as it is;
`torch_ddp.TorchDDP` implements it with plain torch.distributed. Nothing else of either is used
(tests/test_plumbing.py checks both directions), so a new plumbing implements exactly these members.

Below it, the helpers both plumbings stand on: starting and closing the process group, a decision
every process takes together (`collectively`), and who writes the run folder's shared files
(`is_writer`)."""

from __future__ import annotations

import os
import time
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from errors import ConfigError, RunError, first_line
from sharding import accelerate_fsdp


@runtime_checkable
class Plumbing(Protocol):
    device: torch.device  # where this process's model and batches live
    num_processes: int
    process_index: int  # global rank
    is_main_process: bool  # global rank 0: writes the run's files, logs to trackers
    is_local_main_process: bool  # local rank 0: the progress bar, per-node files
    # "no" | "bf16" | "fp16", as resolved (the launcher's setting or the config's)
    mixed_precision: str
    sync_gradients: bool  # inside accumulate(): whether this micro-step ends an optimizer step
    scaler: torch.amp.GradScaler | None  # fp16's loss scaler (then a checkpoint part)
    trackers: list  # the started trackers (tracking.py finishes them)

    def prepare(self, *objects: Any) -> Any:
        """Modules: to the device, wrapped (DDP) or sharded (FSDP). DataLoaders: on the device, this
        rank's share of every global batch (whole per-rank batches in rank order). Anything else as
        it is. One object in, one out; several, a tuple."""

    def accumulate(self, model: torch.nn.Module) -> AbstractContextManager:
        """Around each micro-step: sets sync_gradients, and skips the gradient all-reduce until the
        last one."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of loss / grad_accum_steps (scaled, under fp16)."""

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        """Clips the (unscaled) gradients; returns their total norm before clipping."""

    def reduce(self, tensor: torch.Tensor, reduction: str) -> torch.Tensor:
        """All-reduce, "sum" or "mean" (always say which: Accelerate's default differs). Every
        process must call it."""

    def gather_for_metrics(self, data: Any) -> Any:
        """Tensors (in dicts, tuples, lists) of every process concatenated in rank order; in an eval
        loader's last batch, without the samples it repeated to give every process a full batch. No
        state across calls."""

    def main_process_first(self) -> AbstractContextManager:
        """The body runs on the main process before the others, e.g. to fill a cache they then
        read."""

    def local_main_process_first(self) -> AbstractContextManager:
        """The same, once per node."""

    def unwrap_model(self, model: torch.nn.Module, keep_torch_compile: bool) -> torch.nn.Module:
        """The user's module inside what prepare() and torch.compile wrapped it in (called with
        keep_torch_compile=False)."""

    def init_trackers(
        self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None
    ) -> None:
        """Start the configured trackers, on the main process only."""

    def log(self, values: dict, step: int | None = None) -> None:
        """One row to every started tracker."""


# ---------------------------------------------------------------- the process group


def init_process_group(timeout_s: int) -> None:
    """torch.distributed's env:// start (NCCL on GPUs, gloo on CPUs), with the store's keys under a
    prefix per elastic restart: under --max_restarts every attempt shares one store, and a restarted
    worker could read the dead attempt's peer addresses (gloo connectFullMesh "Connection refused",
    seen here under load). Accelerate adopts a process group that already exists."""
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        # before NCCL: one GPU per process
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # else rank 0 hosts it
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not agent_hosts_store,
        timeout=timeout,
        multi_tenant=True,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    attempt_store = dist.PrefixStore(f"attempt_{attempt}", store)
    dist.init_process_group(
        backend, store=attempt_store, rank=rank, world_size=world_size, timeout=timeout
    )


def close_process_group() -> None:
    """Destroy the process group once gloo's worker threads are idle. A worker that has just run a
    collective frees its tensors under the group's lock, and needs the GIL for that; the group's
    destructor takes that lock holding the GIL. Destroyed right after a collective, a process can
    hang at exit (seen here: a rank stuck for good in ~ProcessGroupGloo, its peer long gone). So:
    release the GIL a moment first, then destroy."""
    if dist.is_initialized():
        time.sleep(0.05)
        dist.destroy_process_group()


def check_world_size(num_processes: int) -> None:
    """The launcher's world size is the one the plumbing sees (else each process would train
    alone)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != num_processes:
        raise ConfigError(
            f"the launcher started {launched} processes but this one sees a world of {num_processes}: "
            f"they would train independently and overwrite each other's files"
        )


# ---------------------------------------------------------------- decisions taken together


def collectively(plumbing, action: str, fn, error_type=RunError, on_failure=None):
    """Run fn on every process; if it raised on any of them, every process raises error_type. (A
    process that raised alone would leave the others waiting in their next collective until a
    timeout.)"""
    error = None
    result = None
    try:
        result = fn()
    except Exception as e:  # any failure, not only OSError: the others must not wait for this one
        error = e
    failed_here = torch.tensor(float(error is not None), device=plumbing.device)
    failed = plumbing.reduce(failed_here, "sum").item()
    if not failed:
        return result
    if on_failure is not None:
        on_failure()
    if isinstance(error, error_type):
        raise error
    if error is not None:
        raise error_type(f"{action}: {first_line(error)}")
    raise error_type(f"{action} failed on another process")


def is_writer(plumbing, shared_filesystem: bool) -> bool:
    """Whether this process writes the run folder's shared files: once per job, or once per node
    when each node has its own disk."""
    if shared_filesystem:
        return plumbing.is_main_process
    return plumbing.is_local_main_process


# ---------------------------------------------------------------- the Accelerate plumbing


def build_accelerator(cfg):
    """The Accelerator that main.train runs with (torch_ddp.py builds the torch twin, TorchDDP)."""
    from accelerate import Accelerator
    from accelerate.utils import (
        DataLoaderConfiguration,
        DistributedDataParallelKwargs,
        GradientAccumulationPlugin,
    )

    # FSDP2: from --fsdp on any launcher, else from the accelerate config (sharding.py)
    fsdp_plugin, parallelism_config = accelerate_fsdp(cfg)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # restart-safe (plumbing.py); the Accelerator adopts it
        init_process_group(cfg.dist_timeout_s)

    accelerator = Accelerator(
        # Measured: on a machine without a GPU, Accelerator() leaves every launched process
        # believing it is rank 0 of 1 (N independent trainings writing one folder); cpu=True makes
        # them a gloo group.
        cpu=not torch.cuda.is_available(),
        # None: the launcher's setting (ACCELERATE_MIXED_PRECISION, from the
        # accelerate config) decides
        mixed_precision=cfg.mixed_precision or None,
        # sync_with_dataloader=False: an optimizer step may straddle two epochs, exactly as on
        # the torch path
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=cfg.grad_accum_steps, sync_with_dataloader=False
        ),
        # asynchronous host-to-GPU batch copies (pinned memory); accelerate's default blocks
        # the host on each batch (measured on an H100 with bench/throughput.py: 1.08x the bare
        # loop with it)
        dataloader_config=DataLoaderConfiguration(non_blocking=torch.cuda.is_available()),
        kwargs_handlers=[DistributedDataParallelKwargs(**cfg.ddp_options())],
        fsdp_plugin=fsdp_plugin,
        parallelism_config=parallelism_config,  # HSDP's replicate x shard mesh
        log_with=cfg.trackers()
        or None,  # started later, by MetricsLogger, on the main process only
        project_dir=cfg.run_dir,  # TensorBoard writes under <output_dir>/<project>/
    )
    check_world_size(accelerator.num_processes)
    return accelerator
