"""The loss a step means (batches.loss_weights): with prompts masked unevenly, the step's gradient is
that of the mean over every token the step counts, whatever the gradient accumulation or the world
size. Checked against an independent computation: the same 8 samples as one batch, in one process,
in float64, with no template code in between (tests/helpers/uneven_masks: a float64 model whose
.loss is a per-token mean and which declares loss_items).

One optimizer step, on both paths: accumulation 4 in one process (main.py, Accelerate), and 2 ranks
x accumulation 2 (torch_ddp.py, torchrun). The logged loss and gradient norm, and the weights after
the AdamW step, agree with the independent ones to float64 rounding. Weighting each micro-batch's
mean alike (the template before this), they are off by percent: the counts run from 2 to 11 tokens
a sample."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import (
    REPO,
    TINY,
    fork_with,
    launch_torchrun,
    load_weights,
    run_python,
    tiny_args,
)

pytestmark = pytest.mark.slow

FORK_FILES = REPO / "tests" / "helpers" / "uneven_masks"
LR = 0.01
BETAS = (0.9, 0.95)
STEP = dict(
    block_size=None,  # the shipped LM's data key: this fork's data.py has none
    max_steps=1,
    lr=LR,
    min_lr=LR,  # the first (only) step at lr itself
    warmup_steps=0,
    beta1=BETAS[0],
    beta2=BETAS[1],
    weight_decay=0.0,
    max_grad_norm=0.0,  # not clipped: the logged norm is the gradient's own
    eval_every=1,
    save_every=0,
)


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def independent_step() -> tuple[float, float, dict]:
    """(loss, gradient norm, weights after one AdamW step): all 8 training samples as one batch, the
    loss summed over every counted next-token target and divided by their count, in float64."""
    fork_model = load(FORK_FILES / "model.py", "uneven_masks_model")
    fork_data = load(FORK_FILES / "data.py", "uneven_masks_data")
    samples = fork_data.samples()
    input_ids = torch.tensor(samples["input_ids"][:8])
    labels = torch.tensor(samples["labels"][:8])
    model = fork_model.TinyLM()
    logits = model(input_ids=input_ids, labels=labels).logits
    targets = labels[:, 1:]
    counted = targets != -100
    per_token = F.cross_entropy(
        logits[:, :-1][counted], targets[counted], reduction="none"
    )  # float64: one row per counted target
    loss = per_token.sum() / counted.sum()
    loss.backward()
    grad_norm = math.sqrt(sum((p.grad.double() ** 2).sum().item() for p in model.parameters()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=0.0)
    optimizer.step()
    return loss.item(), grad_norm, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def fork(tmp_path_factory) -> Path:
    return fork_with(
        tmp_path_factory.mktemp("uneven"), FORK_FILES / "model.py", FORK_FILES / "data.py"
    )


def check_against_independent(run, loss: float, grad_norm: float, weights: dict) -> None:
    row = next(row for row in run.metrics() if "loss" in row)
    assert row["step"] == 1
    # logged through the loop's fp32 accumulator: fp32 rounding (a wrong weighting is off by percent)
    assert row["loss"] == pytest.approx(loss, rel=1e-6)
    assert row["grad_norm"] == pytest.approx(grad_norm, rel=1e-12)
    exported = load_weights(run.output_dir / "model.safetensors")
    assert exported.keys() == weights.keys()
    for name, expected in weights.items():
        torch.testing.assert_close(exported[name], expected, rtol=0, atol=1e-13)


def test_accumulation_and_ranks_give_the_full_batch_gradient_of_the_mean_over_counted_tokens(
    tmp_path, fork
):
    loss, grad_norm, weights = independent_step()
    config = TINY  # its lm: section left out where the fork does not declare it
    accumulated = run_python(
        tiny_args(
            tmp_path / "accum4",
            Path("unused"),
            config=config,
            batch_size=2,
            grad_accum_steps=4,
            **STEP,
        ),
        tmp_path,
        script=fork / "train" / "main.py",
    ).check()
    check_against_independent(accumulated, loss, grad_norm, weights)
    two_ranks = launch_torchrun(
        tiny_args(
            tmp_path / "ranks2",
            Path("unused"),
            config=config,
            batch_size=2,
            grad_accum_steps=2,
            **STEP,
        ),
        tmp_path,
        script=fork / "train" / "torch_ddp.py",
    ).check()
    check_against_independent(two_ranks, loss, grad_norm, weights)
