"""lr_at: linear warmup, then cosine to min_lr; optimizer groups."""

import math

import pytest
import torch

from config import TrainConfig
from model import build_model
from optim import build_optimizer, lr_at


def test_warmup_peak_and_cosine_end():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert lr_at(0, cfg) == pytest.approx(0.1)  # first step already trains
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)  # half-way through the cosine
    assert lr_at(110, cfg) == pytest.approx(0.1)
    values = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_no_warmup():
    cfg = TrainConfig(lr=2.0, min_lr=0.0, warmup_steps=0, max_steps=4)
    assert [lr_at(s, cfg) for s in range(5)] == pytest.approx(
        [1 + math.cos(math.pi * s / 4) for s in range(5)]
    )


def test_decay_only_on_matrices():
    cfg = TrainConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, weight_decay=0.1)
    model = build_model(cfg)
    decay, no_decay = build_optimizer(model, cfg).param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(
        p.dim() == 1 for p in no_decay["params"]
    )
    counted = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert counted == sum(p.numel() for p in model.parameters())  # the tied embedding counted once
    assert isinstance(decay["params"][0], torch.nn.Parameter)


def test_the_schedule_ends_at_its_horizon_and_warmup_follows_it():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, max_steps=200, lr_decay_steps=100)
    assert cfg.warmup == 10  # lr_decay_steps // 10
    assert lr_at(100, cfg) == pytest.approx(0.1)
    assert all(lr_at(s, cfg) == pytest.approx(0.1) for s in range(100, 200))  # extended at min_lr
