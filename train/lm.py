"""The causal language model task: what the shipped model.py and data.py (and a fork's LM) use.

A causal LM's `model(**batch)` returns an object with `.loss` (the mean next-token loss it trains
on) and `.logits` (batch, time, vocab), as Hugging Face's models do. Around that, this module keeps
the LM's answers to what the template asks of a task (task.py):
    - the next-token loss (`causal_lm_loss`), the per-sample evaluation columns (`eval_columns`,
      per token: `token_columns`) and the metrics from their sums (`token_metrics`: loss, accuracy,
      perplexity);
    - tokenizers (`--tokenizer`: bytes, or a Hugging Face name or folder) and Hugging Face causal
      LMs (`--hf_model NAME`, which the shipped model.py's build_model builds instead of its GPT).
Nothing here imports model.py or data.py: they import from here. What a config names (data files,
hub datasets, Hugging Face models and tokenizers) is checked at start-up in checks.py.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from errors import ConfigError, first_line

BYTE_VOCAB_SIZE = 256  # the "bytes" tokenizer: every UTF-8 byte is a token, nothing to download


# ---------------------------------------------------------------- the loss and the evaluation columns


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss over the batch's counted targets, a scalar: position t predicts
    labels[t + 1], and a label of -100 (a masked prompt, padding) is not counted. A mean over
    tokens, not over samples, so a sample weighs by the tokens it counts, as in the step's loss
    (batches.loss_weights, with `counted_targets` below as the count)."""
    # the targets move left, not the logits: the last position gets an ignored target, and the
    # logits are not copied (a sliced view would be, by reshape; 0.4 ms of a 100 ms CPU step)
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    flat_logits = logits.float().flatten(0, 1)
    per_token = F.cross_entropy(flat_logits, targets.flatten(), ignore_index=-100, reduction="none")
    per_sample = per_token.view_as(targets).sum(dim=1)
    # the sum over tokens / the count, written as the mean over samples of (a sample's sum / the
    # mean count): where every sample counts the same (packed blocks) that is, to the bit, the mean
    # of per-sample means this template computed before, so earlier runs' losses stay bitwise
    mean_count = (targets != -100).sum().clamp(min=1) / targets.size(0)
    return (per_sample / mean_count).mean()


def counted_targets(labels: torch.Tensor) -> torch.Tensor:
    """How many next-token targets causal_lm_loss counts in a batch: model.py's `loss_items`."""
    return (labels[:, 1:] != -100).sum()


@torch.no_grad()
def token_columns(logits: torch.Tensor, labels: torch.Tensor, max_floats: int = 2**26) -> dict:
    """Per-sample sums over next-token predictions, each a float64 tensor of shape (batch,), by
    name. A new metric is one more column here: e.g. `"top5": (chunk.topk(5).indices ==
    wanted[..., None]).any(-1)`, reported by eval_metrics as top5 per token. Upcasts at most
    `max_floats` logits to fp32 at once (256 MiB): at a 150k vocabulary, a batch's fp32 logits would
    be gigabytes."""
    predictions = logits[:, :-1]  # views: nothing is copied yet
    targets = labels[:, 1:]
    columns = {"tokens": [], "loss": [], "accuracy": []}
    positions_per_chunk = max(1, max_floats // (logits.size(0) * logits.size(-1)))
    for start in range(0, targets.size(1), positions_per_chunk):
        chunk = predictions[:, start : start + positions_per_chunk].float()
        wanted = targets[:, start : start + positions_per_chunk]
        counted = wanted != -100
        losses = F.cross_entropy(chunk.transpose(1, 2), wanted, ignore_index=-100, reduction="none")
        columns["tokens"].append(counted)
        columns["loss"].append(losses)
        columns["accuracy"].append((chunk.argmax(-1) == wanted) & counted)
    return {name: torch.cat(parts, dim=1).double().sum(dim=1) for name, parts in columns.items()}


def token_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The causal LM's reported values (model.py's `eval_metrics`) from the eval set's sums of
    token_columns: every column per token, and the perplexity."""
    tokens = max(sums["tokens"], 1.0)
    metrics = {name: total / tokens for name, total in sums.items() if name != "tokens"}
    # capped: a diverged run stays finite
    metrics["perplexity"] = math.exp(min(metrics["loss"], 50))
    return metrics


# ---------------------------------------------------------------- tokenizers


@functools.cache
def load_tokenizer(name: str):
    """None for "bytes" (every UTF-8 byte a token), else a Hugging Face tokenizer by hub name or
    local folder."""
    if name == "bytes":
        return None
    from transformers import AutoTokenizer  # imported only when used

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except Exception as e:  # offline, a wrong name or folder: all the same to the user
        raise ConfigError(f"tokenizer '{name}' could not be loaded: {first_line(e)}") from None
    return tokenizer


def packing_tokenizer(name: str):
    """load_tokenizer's, for packing documents into blocks: it must have an EOS token to end each
    document with (a classifier's tokenizer need not)."""
    tokenizer = load_tokenizer(name)
    if tokenizer is not None and tokenizer.eos_token_id is None:
        raise ConfigError(
            f"tokenizer '{name}' has no EOS token to end documents with: set its eos_token"
        )
    return tokenizer


def vocab_size(cfg) -> int:
    """Tokens the configured tokenizer can produce: what a model built from scratch must embed."""
    tokenizer = load_tokenizer(cfg.tokenizer_name)
    if tokenizer is None:
        return BYTE_VOCAB_SIZE
    return len(tokenizer)


# ---------------------------------------------------------------- Hugging Face models


def uses_hub_model(cfg) -> bool:
    """--hf_model NAME: model.py builds that Hugging Face model instead of its own."""
    return cfg.hf_model != ""


def hugging_face_model(cfg) -> nn.Module:
    """--hf_model NAME: its pretrained weights (fine-tuning), or its architecture with fresh weights
    (model_weights: config), in fp32: mixed precision casts for compute, the optimizer steps fp32
    weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.model_weights == "pretrained":
        return AutoModelForCausalLM.from_pretrained(cfg.hf_model, dtype=torch.float32)
    model_config = AutoConfig.from_pretrained(cfg.hf_model)
    return AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)


def save_tokenizer(cfg, folder) -> None:
    """Beside an exported Hugging Face model: its tokenizer's files, so
    AutoTokenizer.from_pretrained(folder) loads what the run trained with ("bytes" has no files)."""
    tokenizer = load_tokenizer(cfg.tokenizer_name)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
