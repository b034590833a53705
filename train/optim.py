"""The optimizer and the learning-rate schedule, shared by both plumbings.

`--optimizer adamw` (the default): AdamW on every parameter. `--optimizer muon`: Muon (torch.optim.Muon,
as in nanochat and the modded-nanogpt speedruns) on the weight matrices of the transformer blocks, AdamW on
everything else (embeddings, the head, norms, biases), stepped together as one optimizer. Each kind of
group has its own peak LR key (lr for AdamW's, muon_lr for Muon's) and follows the same warmup and cosine.

A fork changes the optimizer in build_optimizer and the schedule in lr_at. The loop calls
set_lr(optimizer, step, cfg) before each optimizer step; checkpoints save the optimizer's
state_dict, so its state must be tensors and plain values (it is read back with weights_only=True).
"""

from __future__ import annotations

import math

import torch

from blocks import transformer_blocks
from config import TrainConfig


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "muon":
        return build_muon(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    return adamw(params, cfg)


def adamw(params: list, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; matrices and embeddings decay, biases and norm weights (1-D tensors) do not."""
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    groups = [group for group in groups if group["params"]]
    # fused: one kernel per step instead of several per tensor, on CPUs too (5% of a small model's
    # CPU step, bench/throughput.py); nanoGPT fuses on CUDA only
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)


def build_muon(model: torch.nn.Module, cfg: TrainConfig) -> MuonWithAdamW:
    """Muon for the 2-D weights inside the transformer blocks (the hidden matrices), AdamW for the
    rest: the embeddings and the head are lookups and a classifier, not hidden transforms, and Muon
    only takes matrices."""
    in_blocks = {
        id(p)
        for block in transformer_blocks(model, "optimizer muon")
        for p in block.parameters()
        if p.requires_grad
    }
    params = [p for p in model.parameters() if p.requires_grad]
    hidden = [p for p in params if id(p) in in_blocks and p.dim() == 2]
    rest = [p for p in params if not (id(p) in in_blocks and p.dim() == 2)]
    muon = torch.optim.Muon(
        hidden,
        lr=cfg.muon_lr,
        momentum=cfg.muon_momentum,
        weight_decay=cfg.muon_weight_decay,
    )
    for group in muon.param_groups:
        group["peak_lr"] = "muon_lr"  # the config key set_lr scales (a name: a checkpoint keeps it)
    return MuonWithAdamW(muon, adamw(rest, cfg))


class MuonWithAdamW(torch.optim.Optimizer):
    """Two optimizers stepped as one: one list of param groups (Muon's, then AdamW's: the same group
    dicts, so set_lr and a gradient scaler reach both), one state_dict, so the loop, Accelerate's
    prepare and the checkpoint treat it as any optimizer."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW):
        self.muon = muon
        self.adamw = adamw
        super().__init__(muon.param_groups + adamw.param_groups, defaults={})
        # the base class re-made each group's params list: the two optimizers must see the same dicts
        self.muon.param_groups = self.param_groups[: len(muon.param_groups)]
        self.adamw.param_groups = self.param_groups[len(muon.param_groups) :]

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.muon.step()
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        # load_state_dict replaced each optimizer's group dicts: point ours at the new ones
        self.param_groups = self.muon.param_groups + self.adamw.param_groups


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.min_lr at lr_decay_steps (min_lr after it).
    A pure function of the step, so both plumbings and a resumed run agree (no scheduler object to
    checkpoint)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.decay_steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (cfg.lr - cfg.min_lr)


def set_lr(optimizer, step: int, cfg: TrainConfig) -> float:
    """Every param group at this step of the schedule, scaled to its own peak (the config key in
    the group's "peak_lr": muon_lr for Muon's, lr for the rest). Returns lr's value."""
    lr = lr_at(step, cfg)
    for group in optimizer.param_groups:
        peak_key = group.get("peak_lr", "lr")
        # lr's own groups take lr itself: scaling it by lr / lr could move it by a rounding
        group["lr"] = lr if peak_key == "lr" else lr * getattr(cfg, peak_key) / cfg.lr
    return lr
