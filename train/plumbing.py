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
    scaler: torch.amp.GradScaler | None  # fp16's loss scaler (then a checkpoint part)
    trackers: list  # the started trackers (tracking.py finishes them)

    # Modules: to the device, wrapped (DDP). DataLoaders: on the device, this rank's share of every global batch
    # (whole per-rank batches in rank order). Anything else as it is. One object in, one out; several, a tuple.
    def prepare(self, *objects: Any) -> Any: ...
    # around each micro-step: sets sync_gradients, and skips the gradient all-reduce until the last micro-step
    def accumulate(self, model: torch.nn.Module) -> AbstractContextManager: ...
    def backward(self, loss: torch.Tensor) -> None: ...  # of loss / grad_accum_steps (scaled, under fp16)
    # clips the (unscaled) gradients; returns their total norm before clipping
    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor: ...
    # all-reduce, "sum" or "mean" (always say which: Accelerate's default differs); every process must call it
    def reduce(self, tensor: torch.Tensor, reduction: str) -> torch.Tensor: ...
    # tensors (in dicts, tuples, lists) of every process concatenated in rank order; in an eval loader's last
    # batch, without the samples it repeated to give every process a full batch. No state across calls.
    def gather_for_metrics(self, data: Any) -> Any: ...
    def main_process_first(self) -> AbstractContextManager: ...  # e.g. to fill a cache the others then read
    def local_main_process_first(self) -> AbstractContextManager: ...  # the same, once per node
    # the user's module inside what prepare() and torch.compile wrapped it in (called with keep_torch_compile=False)
    def unwrap_model(self, model: torch.nn.Module, keep_torch_compile: bool) -> torch.nn.Module: ...
    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None
                      ) -> None: ...  # on the main process only
    def log(self, values: dict, step: int | None = None) -> None: ...  # one row to every started tracker
