"""A fork's model.py, written as a user of the template would (tests/e2e/test_first_hour.py copies it over
train/model.py): a GRU language model, no transformer blocks, the contract of the template's model.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from lm import causal_lm_loss, vocab_size


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
