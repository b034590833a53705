"""A test fork's data.py (tests/e2e/test_loss_weights.py): token sequences whose prompts, masked
with -100, have very different lengths, so micro-batches and ranks count very different numbers of
tokens. Exactly one global batch of 8 samples trains."""

from __future__ import annotations

import datasets
import torch

VOCAB = 11  # model.py's

LENGTH = 12
# counted next-token targets per sample: from 2 to 11, uneven across any split into micro-batches
PROMPT_LENGTHS = [10, 0, 9, 1, 7, 0, 10, 3, 2, 5]


def samples() -> dict:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (len(PROMPT_LENGTHS), LENGTH), generator=generator)
    labels = input_ids.clone()
    for row, prompt in enumerate(PROMPT_LENGTHS):
        labels[row, :prompt] = -100
    return {"input_ids": input_ids.tolist(), "labels": labels.tolist()}


def build_datasets(cfg):
    every = datasets.Dataset.from_dict(samples()).with_format("torch")
    return every.select(range(8)), every.select(range(8, len(PROMPT_LENGTHS)))


def collate(rows: list) -> dict:
    return {key: torch.stack([row[key] for row in rows]) for key in ("input_ids", "labels")}
