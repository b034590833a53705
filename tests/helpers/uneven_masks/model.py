"""A test fork's model.py (tests/e2e/test_loss_weights.py): a next-token model in float64, small
enough that a step's gradient can be computed independently to float64 rounding. Its .loss is the
mean over the batch's counted tokens, and loss_items says how many that is, as a fine-tuning
task's model.py does where prompts are masked."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lm import token_columns, token_metrics

VOCAB = 11
WIDTH = 8


@dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, dtype=torch.float64)
        self.head = nn.Linear(WIDTH, VOCAB, dtype=torch.float64)
        # its own generator: the same weights however much of the global RNG the template used
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(
                    torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
                )

    def forward(self, input_ids, labels):
        logits = self.head(torch.tanh(self.embed(input_ids)))
        summed = F.cross_entropy(
            logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="sum"
        )
        return Output(loss=summed / loss_items({"labels": labels}), logits=logits)


def build_model(cfg) -> nn.Module:
    return TinyLM()


def loss_items(batch: dict) -> torch.Tensor:
    return (batch["labels"][:, 1:] != -100).sum()


def eval_columns(output, batch: dict) -> dict:
    return token_columns(output.logits, batch["labels"])


def eval_metrics(sums: dict, cfg) -> dict:
    return token_metrics(sums)
