"""A GRU language model, no transformer blocks (FSDP and activation_checkpointing are refused in one line).
Copy this file over train/model.py, and its data.py over train/data.py (examples/README.md). Its task is the
causal LM's: lm.py's loss, per-token evaluation (loss, accuracy, perplexity) and tokens per sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

# the causal LM's evaluation and throughput, as the shipped model.py takes them
from lm import causal_lm_loss, eval_columns, eval_metrics, tokens_per_sample, vocab_size  # noqa: F401


def build_model(cfg) -> nn.Module:
    return GRULanguageModel(
        vocab_size(cfg), width=cfg.n_embd, layers=cfg.n_layer, dropout=cfg.dropout
    )


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
            loss = causal_lm_loss(logits, labels).mean()
        return Output(loss=loss, logits=logits)
