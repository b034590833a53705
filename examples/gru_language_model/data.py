"""A GRU language model's data (copy it over train/data.py, with its model.py): reviews in a CSV file (or
JSON lines) whose text column the config names, each document started by a marker token instead of ended by
one, held out by a hash of its text. Its contract is the template's data.py's: build_datasets, packer (for
--streaming), collate."""

from __future__ import annotations

import functools
import itertools
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from errors import ConfigError
from lm import load_tokenizer

START = 2  # bytes: STX starts every document


@dataclass
class DataConfig:
    """The text data's own keys (the template joins them to its own: YAML, --flags, --help)."""

    # the column holding the raw text
    text_column: str = "text"
    # tokens (bytes) per training sample
    block_size: int = 128


def check_config(cfg) -> None:
    """The data's keys, at start-up: one line naming the key."""
    if not cfg.dataset:
        raise ConfigError("dataset: pass --dataset, a JSON lines or CSV file (or a folder of them)")
    if cfg.block_size <= 0:
        raise ConfigError(f"block_size must be > 0 (got {cfg.block_size!r})")
    if cfg.text_column == "":
        raise ConfigError(f"text_column must not be empty (got {cfg.text_column!r})")


def build_datasets(cfg):
    import datasets

    path = Path(cfg.dataset)  # one file, or a folder of them
    files = sorted(str(p) for p in path.glob("*.*")) if path.is_dir() else [cfg.dataset]
    builder = "csv" if files[0].endswith(".csv") else "json"
    try:
        splits = datasets.load_dataset(
            builder, data_files={"train": files}, streaming=cfg.streaming
        )
    except Exception as e:
        raise ConfigError(f"dataset '{cfg.dataset}' cannot be read as {builder}: {e}") from None
    documents = splits["train"]
    pack = packer(cfg)

    def held_out(document) -> bool:
        return zlib.crc32(str(document[cfg.text_column]).encode()) % 20 == 0

    def kept(document) -> bool:
        return not held_out(document)

    train, evaluation = documents.filter(kept), documents.filter(held_out)
    if cfg.streaming:
        columns = list(next(iter(evaluation)))
        blocks = evaluation.map(pack, batched=True, remove_columns=columns)
        first = list(itertools.islice(blocks, cfg.streaming_eval_blocks))
        return train, datasets.Dataset.from_list(first).with_format("torch")
    train = train.map(pack, batched=True, remove_columns=train.column_names)
    evaluation = evaluation.map(pack, batched=True, remove_columns=evaluation.column_names)
    return train.with_format("torch"), evaluation.with_format("torch")


def packer(cfg):
    tokenizer = load_tokenizer(cfg.tokenizer_name)
    return functools.partial(
        pack, column=cfg.text_column, length=cfg.block_size, tokenizer=tokenizer
    )


def pack(documents: dict, column: str, length: int, tokenizer) -> dict:
    tokens = []
    for text in documents[column]:
        if tokenizer is None:
            tokens += [START, *str(text).encode()]
        else:
            tokens += [
                tokenizer.eos_token_id,
                *tokenizer(str(text), add_special_tokens=False)["input_ids"],
            ]
    n = len(tokens) // length
    return {"input_ids": np.array(tokens[: n * length], dtype=np.int32).reshape(n, length)}


def collate(samples: list[dict]) -> dict:
    input_ids = torch.stack([sample["input_ids"] for sample in samples]).long()
    return {"input_ids": input_ids, "labels": input_ids}
