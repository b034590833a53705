"""A GRU language model, no transformer blocks (FSDP and activation_checkpointing are refused in one line).
Copy this file over train/model.py, and its data.py over train/data.py (examples/README.md). Its task is the
causal LM's: lm.py's loss and per-token evaluation (loss, accuracy, perplexity), a block's tokens per sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from lm import causal_lm_loss, token_columns, token_metrics, vocab_size


@dataclass
class ModelConfig:
    """The GRU's own keys (the template joins them to its own: YAML, --flags, --help)."""

    # GRU layers
    layers: int = 4
    # width of the embedding and of the GRU's hidden state
    hidden_width: int = 128
    # dropout between GRU layers
    dropout: float = 0.0


def build_model(cfg) -> nn.Module:
    return GRULanguageModel(
        vocab_size(cfg), width=cfg.hidden_width, layers=cfg.layers, dropout=cfg.dropout
    )


def eval_columns(output, batch: dict) -> dict:
    """The causal LM's per-token sums, as the shipped model.py reports them (lm.token_columns)."""
    return token_columns(output.logits, batch["labels"])


def eval_metrics(sums: dict, cfg) -> dict:
    return token_metrics(sums)


def tokens_per_sample(cfg) -> int:
    return cfg.block_size


@dataclass
class Output:
    loss: torch.Tensor | None
    logits: torch.Tensor


class GRULanguageModel(nn.Module):
    # no _no_split_modules: a GRU has no repeated block to shard or recompute one by one

    def __init__(self, vocab: int, width: int, layers: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.gru = nn.GRU(width, width, num_layers=layers, batch_first=True, dropout=dropout)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, labels=None) -> Output:
        hidden, _ = self.gru(self.embed(input_ids))
        logits = self.head(hidden)
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels)
        return Output(loss=loss, logits=logits)
