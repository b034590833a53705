"""The plumbing contract: what train(), checkpoint.py, resume.py, tracking.py and job.py ask of the object
that knows about processes and devices. `accelerate.Accelerator` satisfies it as it is; `torch_ddp.TorchDDP`
implements it with plain torch.distributed. Nothing else of either is used (tests/test_plumbing.py checks
both directions), so a new plumbing (FSDP, another launcher) implements exactly these members.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Plumbing(Protocol):
    device: torch.device  # where this process's model and batches live
    num_processes: int
    process_index: int  # global rank
    is_main_process: bool  # global rank 0: writes the run's files, logs to trackers
    is_local_main_process: bool  # local rank 0: the progress bar, per-node files
    mixed_precision: str  # "no" | "bf16" | "fp16", as resolved (the launcher's setting or the config's)
    sync_gradients: bool  # inside accumulate(): whether this micro-step ends an optimizer step
    scaler: torch.amp.GradScaler | None  # fp16's loss scaler (a checkpoint part when present)
    trackers: list  # the started trackers (tracking.py finishes them)

    def prepare(self, *objects: Any) -> Any:
        """Models: to the device and wrapped (DDP). DataLoaders: this rank's share of every global batch (whole
        per-rank batches in rank order), on the device. Anything else: returned as is. One object in, one out."""

    def accumulate(self, model: torch.nn.Module) -> AbstractContextManager:
        """Around each micro-step: sets sync_gradients, and skips the gradient all-reduce until the last one."""

    def backward(self, loss: torch.Tensor) -> None:
        """loss / grad_accum_steps, backward (scaled, under fp16)."""

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        """Clip the (unscaled) gradients; returns the total norm before clipping."""

    def reduce(self, tensor: torch.Tensor, reduction: str) -> torch.Tensor:
        """All-reduce ("sum" or "mean": always say which, Accelerate's default differs) across processes."""

    def gather_for_metrics(self, data: Any) -> Any:
        """Tensors (in tuples, lists, dicts) of every process, concatenated in rank order; in an eval loader's last
        batch, without the samples the loader repeated to give every process a full batch. No other state."""

    def main_process_first(self) -> AbstractContextManager:
        """The body runs on the main process before all others (e.g. filling a cache)."""

    def local_main_process_first(self) -> AbstractContextManager:
        """The same, once per node."""

    def unwrap_model(self, model: torch.nn.Module, keep_torch_compile: bool) -> torch.nn.Module:
        """The user's module inside whatever prepare() and torch.compile wrapped it in (keep_torch_compile=False)."""

    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Start the configured trackers (main process only)."""

    def log(self, values: dict, step: int | None = None) -> None:
        """A row of metrics to every started tracker."""

    def end_training(self) -> None:
        """Finish the trackers and wait for every process."""
