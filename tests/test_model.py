"""The default model: shapes, loss at init, and that it can learn."""

import copy
import math

import pytest
import torch

from blocks import checkpoint_activations
from lm import BYTE_VOCAB_SIZE as VOCAB_SIZE
from lm import causal_lm_loss, counted_targets
from model import build_model
from run_config import config_class

RunConfig = config_class()  # TrainConfig and model.py's and data.py's own keys


# the shipped GPT: a fork that swaps the model adapts or deletes these
pytestmark = pytest.mark.shipped


def tiny_cfg(**kw):
    return RunConfig(**{"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, **kw})


def test_shapes_and_loss_at_init_is_uniform():
    torch.manual_seed(0)
    model = build_model(tiny_cfg())
    ids = torch.randint(0, VOCAB_SIZE, (4, 16))
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (4, 16, VOCAB_SIZE)
    assert abs(out.loss.item() - math.log(VOCAB_SIZE)) < 0.3


def test_the_loss_is_the_mean_over_counted_tokens_and_bitwise_the_old_one_on_packed_blocks():
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 7, dtype=torch.float64)
    labels = torch.randint(0, 7, (3, 6))
    masked = labels.clone()
    masked[0, :4] = -100  # a long prompt: 2 counted targets
    masked[1, :2] = -100  # a short one: 4; the third sample counts all 5
    # independent: every counted (position, next label) pair, one mean over all of them
    pairs = [
        (logits[i, t], masked[i, t + 1])
        for i in range(3)
        for t in range(5)
        if masked[i, t + 1] != -100
    ]
    expected = torch.nn.functional.cross_entropy(
        torch.stack([p for p, _ in pairs]), torch.stack([t for _, t in pairs])
    )
    assert len(pairs) == 11 == counted_targets(masked).item()
    # the loss is computed in fp32 (logits.float())
    assert abs(causal_lm_loss(logits, masked).item() - expected.item()) < 1e-6
    # packed blocks, every sample counting the same: to the bit the mean of per-sample means
    # that earlier versions trained on (their runs' losses stay bitwise)
    logits32 = torch.randn(8, 33, 50)
    blocks = torch.randint(0, 50, (8, 33))
    per_token = torch.nn.functional.cross_entropy(
        logits32[:, :-1].transpose(1, 2), blocks[:, 1:], reduction="none"
    )
    old = (per_token.sum(dim=1) / torch.full((8,), 32)).mean()
    assert torch.equal(causal_lm_loss(logits32, blocks), old)


@pytest.mark.parametrize("bias", [False, True])
def test_bias_switches_the_biases_of_every_linear_and_norm_layer(bias):
    model = build_model(tiny_cfg(bias=bias))
    names = [name for name, _ in model.named_parameters() if name.endswith(".bias")]
    # per block: qkv, proj, fc, mlp proj, 2 norms; plus the final norm (the tied output layer never has one)
    assert len(names) == (2 * 6 + 1 if bias else 0)
    ids = torch.randint(0, VOCAB_SIZE, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(parameter.grad is not None for parameter in model.parameters())


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = build_model(tiny_cfg())
    ids = torch.randint(0, VOCAB_SIZE, (2, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(60):
        loss = model(input_ids=ids, labels=ids).loss
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.2 * first


def test_weights_are_tied_and_stay_tied_through_safetensors(tmp_path):
    from safetensors.torch import load_model, save_model

    model = build_model(tiny_cfg())
    assert model.lm_head.weight is model.wte.weight
    save_model(model, str(tmp_path / "m.safetensors"))
    loaded = build_model(tiny_cfg())
    load_model(loaded, str(tmp_path / "m.safetensors"))
    assert loaded.lm_head.weight is loaded.wte.weight and torch.equal(
        loaded.wte.weight, model.wte.weight
    )


def test_activation_checkpointing_recomputes_the_same_loss_and_gradients_with_the_same_weight_names():
    torch.manual_seed(0)
    plain = build_model(tiny_cfg(dropout=0.1))
    recomputed = copy.deepcopy(plain)
    checkpoint_activations(recomputed)
    ids = torch.randint(0, VOCAB_SIZE, (4, 16))
    losses = []
    for model in (plain, recomputed):
        torch.manual_seed(1)  # the same dropout masks, replayed in the recomputation
        losses.append(model(input_ids=ids, labels=ids).loss)
        losses[-1].backward()
    assert torch.equal(losses[0], losses[1])
    assert all(
        torch.equal(a.grad, b.grad)
        for a, b in zip(plain.parameters(), recomputed.parameters(), strict=True)
    )
    # checkpoints and exports unchanged
    assert plain.state_dict().keys() == recomputed.state_dict().keys()


def test_compile_makes_each_block_a_region_of_its_own_and_a_model_without_blocks_one():
    """Regional compilation: each transformer block is compiled in place as its own region (the same
    code for every block, so the cost does not grow with depth), never the whole model as one graph;
    a model that declares no blocks is compiled whole. Compiling is lazy: nothing runs here."""
    from compiling import compile_model

    model = build_model(RunConfig(n_layer=3, n_head=2, n_embd=16, block_size=8))
    compile_model(model)
    assert all(block._compiled_call_impl is not None for block in model.blocks)
    assert model._compiled_call_impl is None, "the whole model was compiled as one graph"
    without_blocks = torch.nn.Sequential(torch.nn.Linear(4, 4))
    compile_model(without_blocks)
    assert without_blocks._compiled_call_impl is not None
