"""A text classifier: a Hugging Face encoder (BERT's architecture) with a classification head, and its task
(accuracy, F1). Copy this file over train/model.py, and its data.py over train/data.py (examples/README.md).

    --hf_model CHECKPOINT  fine-tune a hub checkpoint (e.g. google-bert/bert-base-uncased) or a local folder;
                           its tokenizer comes with it
    (no --hf_model)        a small BERT built from a config sized by layers, heads, hidden_width (fresh
                           weights, no download), with the tokenizer --tokenizer names

What the template uses of it (train/task.py): build_model, the model's .loss (transformers' cross-entropy
over the batch), eval_columns, eval_metrics. No tokens_per_sample: batches are padded to their longest text,
so throughput is samples/s. The encoder's layers (BertLayer) are its blocks: FSDP and
activation_checkpointing shard and recompute them one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from data import class_names, text_tokenizer
from errors import ConfigError
from lm import uses_hub_model


@dataclass
class ModelConfig:
    """The classifier's own keys (the template joins them to its own: YAML, --flags, --help). The
    sizes apply to the small BERT built without --hf_model; a checkpoint's config has its own."""

    # encoder layers
    layers: int = 4
    # attention heads; must divide hidden_width
    heads: int = 4
    # width of the encoder's hidden states
    hidden_width: int = 128
    # dropout in the encoder (hidden states and attention); 0.1 is BERT's
    dropout: float = 0.0
    # an earlier version's names for these keys
    RENAMED: ClassVar[dict] = {
        "n_layer": "layers",
        "n_head": "heads",
        "n_embd": "hidden_width: the encoder's width",
    }


def check_config(cfg) -> None:
    for key in ("layers", "heads", "hidden_width"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"{key} must be > 0 (got {getattr(cfg, key)!r})")
    if cfg.hidden_width % cfg.heads:
        raise ConfigError(
            f"hidden_width must be divisible by heads ({cfg.heads}) (got {cfg.hidden_width})"
        )
    if not 0 <= cfg.dropout < 1:
        raise ConfigError(f"dropout must be in [0, 1) (got {cfg.dropout!r})")


def build_model(cfg) -> nn.Module:
    from transformers import AutoModelForSequenceClassification, BertConfig

    classes = len(class_names(cfg))
    if uses_hub_model(cfg):  # --hf_model CHECKPOINT: its weights, a new head for these classes
        return AutoModelForSequenceClassification.from_pretrained(
            cfg.hf_model, num_labels=classes, dtype=torch.float32
        )
    config = BertConfig(
        vocab_size=len(text_tokenizer(cfg)),
        hidden_size=cfg.hidden_width,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        intermediate_size=4 * cfg.hidden_width,
        max_position_embeddings=max(cfg.max_length, 512),
        hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.dropout,
        num_labels=classes,
    )
    return AutoModelForSequenceClassification.from_config(config)


@torch.no_grad()
def eval_columns(output, batch: dict) -> dict:
    """Per text: 1 (to count it), its loss, whether it was right; per class, the true positives, false
    positives and false negatives that F1 is computed from."""
    logits = output.logits.float()
    labels = batch["labels"]
    predicted = logits.argmax(-1)
    columns = {
        "samples": torch.ones_like(labels, dtype=torch.float64),
        "loss": F.cross_entropy(logits, labels, reduction="none").double(),
        "right": (predicted == labels).double(),
    }
    for index in range(logits.size(-1)):
        columns[f"tp_{index}"] = ((predicted == index) & (labels == index)).double()
        columns[f"fp_{index}"] = ((predicted == index) & (labels != index)).double()
        columns[f"fn_{index}"] = ((predicted != index) & (labels == index)).double()
    return columns


def eval_metrics(sums: dict, cfg) -> dict:
    """Loss and accuracy over every eval text; F1 of each class (f1/<class>), their mean (f1_macro), and
    for two classes `f1`, the second class's (the positive one, as GLUE reports it)."""
    samples = max(sums["samples"], 1.0)
    metrics = {"loss": sums["loss"] / samples, "accuracy": sums["right"] / samples}
    classes = class_names(cfg)
    f1 = {}
    for index, name in enumerate(classes):
        tp, fp, fn = (sums.get(f"{kind}_{index}", 0.0) for kind in ("tp", "fp", "fn"))
        f1[name] = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0
    metrics.update({f"f1/{name}": value for name, value in f1.items()})
    metrics["f1_macro"] = sum(f1.values()) / max(len(f1), 1)
    if len(classes) == 2:
        metrics["f1"] = f1[classes[1]]
    return metrics
