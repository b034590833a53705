"""lr_at: linear warmup, then cosine to min_lr; optimizer groups."""

import math

import pytest
import torch

from model import build_model
from optim import build_optimizer, lr_at, set_lr
from run_config import config_class

RunConfig = config_class()


def test_warmup_peak_and_cosine_end():
    cfg = RunConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert lr_at(0, cfg) == pytest.approx(0.1)  # first step already trains
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)  # half-way through the cosine
    assert lr_at(110, cfg) == pytest.approx(0.1)
    values = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_no_warmup():
    cfg = RunConfig(lr=2.0, min_lr=0.0, warmup_steps=0, max_steps=4)
    assert [lr_at(s, cfg) for s in range(5)] == pytest.approx(
        [1 + math.cos(math.pi * s / 4) for s in range(5)]
    )


def test_decay_only_on_matrices():
    cfg = RunConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, weight_decay=0.1)
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
    cfg = RunConfig(lr=1.0, min_lr=0.1, max_steps=200, lr_decay_steps=100)
    assert cfg.warmup == 10  # lr_decay_steps // 10
    assert lr_at(100, cfg) == pytest.approx(0.1)
    assert all(lr_at(s, cfg) == pytest.approx(0.1) for s in range(100, 200))  # extended at min_lr


@pytest.mark.shipped  # names the shipped GPT's modules
def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    cfg = RunConfig(
        n_layer=2, n_head=2, n_embd=16, block_size=8, optimizer="muon", bias=True, lr=1e-3
    )
    model = build_model(cfg)
    optimizer = build_optimizer(model, cfg)
    muon_groups, adamw_groups = optimizer.muon.param_groups, optimizer.adamw.param_groups
    assert optimizer.param_groups == muon_groups + adamw_groups
    in_blocks = {id(p) for block in model.blocks for p in block.parameters()}
    muon_params = [p for group in muon_groups for p in group["params"]]
    adamw_params = [p for group in adamw_groups for p in group["params"]]
    assert muon_params and all(p.dim() == 2 and id(p) in in_blocks for p in muon_params)
    # the embeddings (tied to the head) and the blocks' norms and biases: AdamW's
    assert any(p is model.wte.weight for p in adamw_params)
    assert all(p.dim() == 1 or id(p) not in in_blocks for p in adamw_params)
    every = [id(p) for p in muon_params + adamw_params]
    assert sorted(every) == sorted(id(p) for p in model.parameters())  # each once
    # one schedule, each group at its own peak
    lr = set_lr(optimizer, cfg.warmup, cfg)
    assert lr == pytest.approx(cfg.lr)
    assert [g["lr"] for g in muon_groups] == [pytest.approx(cfg.muon_lr)]
    assert all(g["lr"] == pytest.approx(cfg.lr) for g in adamw_groups)
    set_lr(optimizer, cfg.decay_steps, cfg)
    assert muon_groups[0]["lr"] == pytest.approx(cfg.muon_lr * cfg.min_lr / cfg.lr)


def test_each_optimizer_gets_its_own_hyperparameters_from_the_config():
    """Muon's groups take muon_momentum and muon_weight_decay, AdamW's take beta1, beta2 and
    weight_decay (none on 1-D tensors): set apart so that a swap of any two shows."""
    cfg = RunConfig(
        n_layer=1,
        n_head=2,
        n_embd=16,
        block_size=8,
        optimizer="muon",
        bias=True,
        weight_decay=0.123,
        muon_weight_decay=0.0456,
        muon_momentum=0.789,
        beta1=0.81,
        beta2=0.97,
    )
    optimizer = build_optimizer(build_model(cfg), cfg)
    (muon_group,) = optimizer.muon.param_groups
    assert muon_group["weight_decay"] == 0.0456 and muon_group["momentum"] == 0.789
    decays = sorted(group["weight_decay"] for group in optimizer.adamw.param_groups)
    assert decays == [0.0, 0.123]
    assert all(group["betas"] == (0.81, 0.97) for group in optimizer.adamw.param_groups)
    for group in optimizer.adamw.param_groups:
        undecayed = group["weight_decay"] == 0.0
        assert all((p.dim() < 2) == undecayed for p in group["params"])


@pytest.mark.shipped  # the shipped GPT's blocks
def test_muon_with_adamw_saves_and_loads_as_one_optimizer():
    cfg = RunConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, optimizer="muon")
    torch.manual_seed(0)
    model = build_model(cfg)
    optimizer = build_optimizer(model, cfg)
    tokens = torch.randint(0, 256, (4, 8))
    for _ in range(2):
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state = optimizer.state_dict()
    restored = build_optimizer(model, cfg)
    restored.load_state_dict(state)
    set_lr(restored, 5, cfg)  # reaches the loaded groups of both
    assert restored.muon.param_groups[0]["lr"] == pytest.approx(
        lr_at(5, cfg) * cfg.muon_lr / cfg.lr
    )
    momentum = next(iter(restored.muon.state.values()))["momentum_buffer"]
    assert torch.equal(momentum, next(iter(optimizer.muon.state.values()))["momentum_buffer"])


def test_set_lr_gives_lr_groups_the_schedule_exactly():
    """AdamW's groups (with or without Muon beside them) take lr_at itself, never lr_at * lr / lr, which
    differs in the last bit at 9 of the default job's 300 steps: the AdamW path stays as it was, bitwise."""
    cfg = RunConfig(n_layer=1, n_head=2, n_embd=16, block_size=8)
    optimizer = build_optimizer(build_model(cfg), cfg)
    for step in range(cfg.max_steps):
        assert set_lr(optimizer, step, cfg) == lr_at(step, cfg)
        assert all(group["lr"] == lr_at(step, cfg) for group in optimizer.param_groups)
