"""The optimizer and the learning-rate schedule, shared by both plumbings.

A fork changes the optimizer in build_optimizer and the schedule in lr_at. The loop calls
set_lr(optimizer, lr_at(step, cfg)) before each optimizer step; checkpoints save the optimizer's
state_dict, so its state must be tensors and plain values (it is read back with weights_only=True).
"""

from __future__ import annotations

import math

import torch

from config import TrainConfig


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; matrices and embeddings decay, biases and norm weights (1-D tensors) do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # fused: one kernel per step instead of several per tensor, on CPUs too (5% of a small model's
    # CPU step, bench/throughput.py); nanoGPT fuses on CUDA only
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.min_lr at lr_decay_steps (min_lr after it).
    A pure function of the step, so both plumbings and a resumed run agree (no scheduler object to
    checkpoint)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.decay_steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (cfg.lr - cfg.min_lr)


def set_lr(optimizer, lr: float) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
