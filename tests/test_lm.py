"""The causal LM task (train/lm.py), tested without the shipped GPT: its evaluation columns and metrics,
block finding, and the start-up check (task.py) holding an LM whose loss forgets the shift."""

import math
from types import SimpleNamespace

import pytest
import torch

from blocks import checkpoint_activations
from errors import ConfigError
from lm import causal_lm_loss, packing_tokenizer, token_columns, token_metrics
from run_config import config_class
from task import check_loss_contract

RunConfig = config_class()


def test_a_model_without_named_blocks_cannot_be_checkpointed_or_sharded_and_says_why():
    with pytest.raises(ConfigError, match=r"Linear._no_split_modules names no block class of it"):
        checkpoint_activations(torch.nn.Linear(2, 2))


def test_eval_columns_are_exact_in_any_chunking_and_ignore_masked_labels():
    torch.manual_seed(0)
    logits = torch.randn(3, 9, 50, dtype=torch.bfloat16)
    labels = torch.randint(0, 50, (3, 9))
    labels[1, 5:] = -100  # a padded sample: its last positions do not count
    whole = token_columns(logits, labels)
    one_position_at_a_time = token_columns(logits, labels, max_floats=1)
    assert whole.keys() == one_position_at_a_time.keys() == {"tokens", "loss", "accuracy"}
    for name in whole:
        assert torch.allclose(whole[name], one_position_at_a_time[name], rtol=1e-12), name
    assert whole["tokens"].tolist() == [8, 4, 8]  # 8 predictions per sample, 4 in the padded one
    # the training loss is the same per-token mean over the batch's counted tokens
    per_token = whole["loss"].sum() / whole["tokens"].sum()
    assert torch.allclose(per_token.float(), causal_lm_loss(logits, labels), rtol=1e-6)
    right = (logits[:, :-1].float().argmax(-1) == labels[:, 1:]).sum().item()
    assert whole["accuracy"].sum().item() == right


def test_every_column_but_tokens_is_reported_per_token():
    metrics = token_metrics({"tokens": 10.0, "loss": 23.0, "accuracy": 4.0, "top5": 7.0})
    assert metrics["loss"] == 2.3 and metrics["accuracy"] == 0.4 and metrics["top5"] == 0.7
    # tokens is the divisor, not a metric: the reported keys, listed by hand
    assert metrics.keys() == {"loss", "accuracy", "top5", "perplexity"}
    assert metrics["perplexity"] == pytest.approx(2.718281828**2.3)


def test_a_batch_with_no_counted_target_has_loss_zero_and_a_zero_gradient():
    """By hand: no (position, next label) pair counts, so the sum over counted tokens is 0 and so is
    its gradient; a step with such a micro-batch (a conversation whose answer fell outside its
    block) moves the weights as the step without it does, instead of making them NaN."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, requires_grad=True)
    nothing_counted = torch.full((2, 5), -100)
    nothing_counted[:, 0] = 3  # a first label is never a target: no position predicts it
    loss = causal_lm_loss(logits, nothing_counted)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_a_loss_without_the_next_token_shift_is_refused_in_one_line():
    torch.manual_seed(0)
    ids = torch.randint(0, 8, (2, 6))
    logits = torch.randn(2, 6, 8)

    def shifted(input_ids, labels):
        return SimpleNamespace(logits=logits, loss=causal_lm_loss(logits, labels).mean())

    def unshifted(input_ids, labels):
        flat = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return SimpleNamespace(logits=logits, loss=flat)

    for forward, refused in ((shifted, False), (unshifted, True)):
        model = torch.nn.Module()
        model.forward = forward
        if not refused:
            check_loss_contract(model, {"input_ids": ids, "labels": ids}, RunConfig())
            continue
        with pytest.raises(
            ConfigError, match=r"is not the loss its eval_columns and eval_metrics report"
        ) as error:
            check_loss_contract(model, {"input_ids": ids, "labels": ids}, RunConfig())
        assert "\n" not in str(error.value)


def test_a_model_without_named_blocks_says_activation_checkpointing_needs_them_in_its_whole_line():
    with pytest.raises(ConfigError) as error:
        checkpoint_activations(torch.nn.Linear(2, 2))
    assert str(error.value) == (
        "model: activation_checkpointing works block by block, and Linear._no_split_modules names no "
        "block class of it: set it to the class of the model's repeated layer"
    )


class Scaled(torch.nn.Module):
    """A block whose forward takes a keyword argument: out = scale * (w * x)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([2.0, 3.0]))

    def forward(self, x, scale=1.0):
        return scale * (self.weight * x)


class TwoScaled(torch.nn.Module):
    _no_split_modules = ["Scaled"]

    def __init__(self):
        super().__init__()
        self.first, self.second = Scaled(), Scaled()


def test_a_checkpointed_block_passes_keyword_arguments_and_trains_weights_of_an_input_without_grad():
    """By hand: y = 5 * (w * x) with x = [1, 4] (a batch, no gradient of its own), so dy/dw = 5 * x =
    [5, 20] and y = [10, 60]. The non-reentrant checkpoint gives the weights their gradient even when no
    input requires one (the reentrant one would leave it None), and takes keyword arguments."""
    model = TwoScaled()
    checkpoint_activations(model)
    x = torch.tensor([1.0, 4.0])
    y = model.first(x, scale=5.0)
    assert y.tolist() == [10.0, 60.0]
    y.sum().backward()
    assert model.first.weight.grad is not None
    assert model.first.weight.grad.tolist() == [5.0, 20.0]
    assert model.second.weight.grad is None  # not run


def test_one_counted_target_is_the_loss_of_that_token_alone():
    """By hand: two samples, one counted target (sample 0's position 0 predicts label 1), its logits
    [0, ln 3, 0, 0]: p = 3 / 6, loss ln 2. Sample 1 counts nothing; the batch's loss is ln 2, not its
    half (the count is at least 1, not more)."""
    logits = torch.zeros(2, 3, 4)
    logits[0, 0, 1] = math.log(3)
    labels = torch.full((2, 3), -100)
    labels[0, 1] = 1
    assert causal_lm_loss(logits, labels).item() == pytest.approx(math.log(2), rel=1e-6)


def test_the_metrics_of_one_token_nothing_counted_and_a_diverged_loss():
    """By hand: one token of loss 3 is loss 3 (the divisor is the token count, at least 1), perplexity
    e^3; nothing counted is 0 everywhere, perplexity 1; a per-token loss of 60 is capped at e^50."""
    one = token_metrics({"tokens": 1.0, "loss": 3.0, "accuracy": 1.0})
    assert one == {"loss": 3.0, "accuracy": 1.0, "perplexity": pytest.approx(math.exp(3))}
    nothing = token_metrics({"tokens": 0.0, "loss": 0.0, "accuracy": 0.0})
    assert nothing == {"loss": 0.0, "accuracy": 0.0, "perplexity": 1.0}
    diverged = token_metrics({"tokens": 2.0, "loss": 120.0, "accuracy": 0.0})
    assert diverged["loss"] == 60.0 and diverged["perplexity"] == math.exp(50)


def test_the_bytes_tokenizer_packs_without_a_tokenizer_object():
    assert packing_tokenizer("bytes") is None
