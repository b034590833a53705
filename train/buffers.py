"""A model's buffers across ranks: BatchNorm's running statistics, and any other state a model keeps
in its state_dict beside its parameters.

Training mode normalizes with each batch's statistics; evaluation and the export use the running
statistics, which each rank updates from its own batches. Which ones count:

    broadcast_buffers true (DDP's default)  DDP copies rank 0's to every rank at each training
                                            forward; rank 0's are the model's (the checkpoint's, the
                                            export's), and every rank evaluates with rank 0's.
    broadcast_buffers false, or FSDP        each rank keeps its own: each rank's are checkpointed
                                            with it (`buffers_rank<r>.pt`) and restored to it, and the
                                            evaluation and the export use their mean over the ranks.
    sync_batchnorm true (GPUs)              SyncBatchNorm computes each batch's statistics over every
                                            rank's samples: the ranks' running statistics stay equal.

Either way the evaluation and the export use the same buffers, and an evaluation leaves each rank's
own as they were: a run evaluated every 10 steps trains exactly as one evaluated every 100.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from errors import ConfigError


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers its state_dict holds (running statistics), not the non-persistent ones a model
    recomputes (a rotary cache, a causal mask)."""
    found = {}
    for prefix, submodule in module.named_modules():
        for name, buffer in submodule.named_buffers(recurse=False):
            if buffer is not None and name not in submodule._non_persistent_buffers_set:
                found[f"{prefix}.{name}" if prefix else name] = buffer
    return found


def ranks_keep_their_own(prepared_model: nn.Module, num_processes: int) -> bool:
    """Whether the ranks' buffers may differ: more than one process, a model with buffers, and no DDP
    broadcast of rank 0's (broadcast_buffers off, or FSDP, which broadcasts nothing)."""
    if num_processes == 1 or not persistent_buffers(prepared_model):
        return False
    return not getattr(prepared_model, "broadcast_buffers", False)


class RankBuffers:
    """This rank's buffers as a checkpoint part's state (checkpoint.PerProcess)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def state_dict(self) -> dict[str, torch.Tensor]:
        return persistent_buffers(self.module)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, buffer in persistent_buffers(self.module).items():
            buffer.copy_(state[name])


@contextmanager
def shared_buffers(prepared_model: nn.Module, num_processes: int):
    """Inside, every rank holds the buffers the export holds (module docstring): rank 0's, or where
    the ranks keep their own, their mean (floating-point ones; a count like BatchNorm's
    num_batches_tracked is the same on every rank). After, each rank's own again."""
    buffers = persistent_buffers(prepared_model)
    if num_processes == 1 or not buffers:
        yield
        return
    own = {name: buffer.clone() for name, buffer in buffers.items()}
    average = ranks_keep_their_own(prepared_model, num_processes)
    with torch.no_grad():
        for buffer in buffers.values():
            if average and buffer.is_floating_point():
                dist.all_reduce(buffer)  # a sum: gloo has no average
                buffer.div_(num_processes)
            else:
                dist.broadcast(buffer, src=0)
    try:
        yield
    finally:
        with torch.no_grad():
            for name, buffer in buffers.items():
                buffer.copy_(own[name])


def sync_batchnorm(model: nn.Module) -> nn.Module:
    """--sync_batchnorm: every BatchNorm layer a SyncBatchNorm (checks.py refuses it without CUDA)."""
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        raise ConfigError(
            "sync_batchnorm is on and the model has no BatchNorm layer to synchronize (got true)"
        )
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)
