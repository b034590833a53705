"""An image classifier: a small CNN with BatchNorm, and its task (accuracy, per-class accuracy). Copy this
file over train/model.py, and its data.py over train/data.py (examples/README.md).

What the template uses of it (train/task.py): build_model, the model's .loss, eval_columns, eval_metrics, and
ModelConfig, its own config keys (--hidden_width, --dropout).
No tokens_per_sample: throughput is samples/s. No _no_split_modules: there is no repeated block to shard,
so FSDP and activation_checkpointing are refused in one line; DDP and everything else work.

BatchNorm's running statistics are buffers. Under DDP, `broadcast_buffers` (on by default) copies rank 0's
to every rank at each forward, and every rank evaluates and exports rank 0's; --sync_batchnorm computes the
batch statistics over all ranks' samples (GPUs). With broadcast_buffers off, each rank keeps its own
statistics, checkpointed and restored with its rank, and the evaluation and the export use their mean
(train/buffers.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from data import class_names
from errors import ConfigError


@dataclass
class ModelConfig:
    """The classifier's own keys (the template joins them to its own: YAML, --flags, --help)."""

    # width of the hidden layer between the convolutions and the class scores
    hidden_width: int = 128
    # dropout before the last layer; 0.0 = none
    dropout: float = 0.0
    # an earlier version's names for these keys
    RENAMED: ClassVar[dict] = {"n_embd": "hidden_width: the hidden layer's width"}


def check_config(cfg) -> None:
    if cfg.hidden_width <= 0:
        raise ConfigError(f"hidden_width must be > 0 (got {cfg.hidden_width!r})")
    if not 0 <= cfg.dropout < 1:
        raise ConfigError(f"dropout must be in [0, 1) (got {cfg.dropout!r})")


def build_model(cfg) -> nn.Module:
    """The CNN, its head sized by the classes data.py finds."""
    classes = len(class_names(cfg))
    return SmallCNN(classes=classes, width=cfg.hidden_width, dropout=cfg.dropout)


@dataclass
class ClassifierOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor  # (batch, classes)


class SmallCNN(nn.Module):
    """Two conv-BatchNorm-ReLU-pool stages and two linear layers (the PyTorch DDP tutorial's shape)."""

    def __init__(self, classes: int, width: int = 128, dropout: float = 0.0):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, width),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(width, classes),
        )

    def forward(self, pixels, labels=None) -> ClassifierOutput:
        logits = self.head(self.features(pixels))
        loss = None if labels is None else F.cross_entropy(logits.float(), labels)
        return ClassifierOutput(loss=loss, logits=logits)


@torch.no_grad()
def eval_columns(output, batch: dict) -> dict:
    """Per image: 1 (to count it), its loss, whether it was right; and per class, images and right ones."""
    logits = output.logits.float()
    labels = batch["labels"]
    right = logits.argmax(-1) == labels
    columns = {
        "samples": torch.ones_like(labels, dtype=torch.float64),
        "loss": F.cross_entropy(logits, labels, reduction="none").double(),
        "right": right.double(),
    }
    for index in range(logits.size(-1)):
        of_class = labels == index
        columns[f"samples_{index}"] = of_class.double()
        columns[f"right_{index}"] = (of_class & right).double()
    return columns


def eval_metrics(sums: dict, cfg) -> dict:
    """Loss and accuracy over every eval image; accuracy/<class> over each class's (a class with no eval
    image has none)."""
    samples = max(sums["samples"], 1.0)
    metrics = {"loss": sums["loss"] / samples, "accuracy": sums["right"] / samples}
    for index, name in enumerate(class_names(cfg)):
        of_class = sums.get(f"samples_{index}", 0.0)
        if of_class:
            metrics[f"accuracy/{name}"] = sums[f"right_{index}"] / of_class
    return metrics
