"""A text classifier: a Hugging Face encoder (BERT's architecture) with a classification head, and its task
(accuracy, F1). Copy this file over train/model.py, and its data.py over train/data.py (examples/README.md).

    --hf_model CHECKPOINT  fine-tune a hub checkpoint (e.g. google-bert/bert-base-uncased) or a local folder;
                           its tokenizer comes with it
    (no --hf_model)        a small BERT built from a config sized by n_layer, n_head, n_embd (fresh weights,
                           no download), with the tokenizer --tokenizer names

What the template uses of it (train/task.py): build_model, the model's .loss (transformers' cross-entropy
over the batch), eval_columns, eval_metrics. No tokens_per_sample: batches are padded to their longest text,
so throughput is samples/s. The encoder's layers (BertLayer) are its blocks: FSDP and
activation_checkpointing shard and recompute them one by one.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from data import class_names, text_tokenizer
from lm import uses_hub_model

CLASSES: list[str] = []  # the class names, in label order: set by build_model, read by eval_metrics


def build_model(cfg) -> nn.Module:
    from transformers import AutoModelForSequenceClassification, BertConfig

    CLASSES[:] = class_names(cfg)
    if uses_hub_model(cfg):  # --hf_model CHECKPOINT: its weights, a new head for these classes
        return AutoModelForSequenceClassification.from_pretrained(
            cfg.hf_model, num_labels=len(CLASSES), dtype=torch.float32
        )
    config = BertConfig(
        vocab_size=len(text_tokenizer(cfg)),
        hidden_size=cfg.n_embd,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        intermediate_size=4 * cfg.n_embd,
        max_position_embeddings=max(cfg.block_size, 512),
        hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.dropout,
        num_labels=len(CLASSES),
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


def eval_metrics(sums: dict) -> dict:
    """Loss and accuracy over every eval text; F1 of each class (f1/<class>), their mean (f1_macro), and
    for two classes `f1`, the second class's (the positive one, as GLUE reports it)."""
    samples = max(sums["samples"], 1.0)
    metrics = {"loss": sums["loss"] / samples, "accuracy": sums["right"] / samples}
    f1 = {}
    for index, name in enumerate(CLASSES):
        tp, fp, fn = (sums.get(f"{kind}_{index}", 0.0) for kind in ("tp", "fp", "fn"))
        f1[name] = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0
    metrics.update({f"f1/{name}": value for name, value in f1.items()})
    metrics["f1_macro"] = sum(f1.values()) / max(len(f1), 1)
    if len(CLASSES) == 2:
        metrics["f1"] = f1[CLASSES[1]]
    return metrics
