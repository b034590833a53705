"""The data of a text classifier: texts with a class label, from local files or a Hugging Face dataset, through
the tokenizer --tokenizer names (a hub name or a local folder; by default the --hf_model checkpoint's own). Copy
this file over train/data.py, and its model.py over train/model.py (examples/README.md).

    reviews.csv (or .jsonl, .json, .parquet; or a folder of them)      --dataset reviews.csv
        text,label             the text column: --text_column (default text); the class: LABEL_COLUMN
        "A fine film.",pos     labels may be names or numbers: the classes are their sorted values
    stanfordnlp/imdb, or nyu-mll/glue with --dataset_config sst2 --text_column sentence   (hub datasets)

A split named validation (or test) is the eval set; without one, eval_fraction of the rows. Each text is
tokenized once (datasets caches it), cut to --max_length tokens, and padded per batch to the batch's longest,
with an attention mask: throughput is samples/s (a padded batch's token count is not the work done).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from errors import ConfigError, first_line
from lm import load_tokenizer

LABEL_COLUMN = "label"
BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@dataclass
class DataConfig:
    """The text data's own keys (the template joins them to its own: YAML, --flags, --help)."""

    # tokens kept of each text (the rest is cut)
    max_length: int = 128
    # the column holding each text
    text_column: str = "text"


def check_config(cfg) -> None:
    """The data's keys, at start-up: one line naming the key."""
    if not cfg.dataset:
        raise ConfigError(
            "dataset: pass --dataset, a CSV or JSON lines file of text and label (or a hub name)"
        )
    if cfg.max_length <= 0:
        raise ConfigError(f"max_length must be > 0 (got {cfg.max_length!r})")
    if cfg.text_column == "":
        raise ConfigError(f"text_column must not be empty (got {cfg.text_column!r})")


def build_datasets(cfg):
    """(train, eval): map-style datasets of {"input_ids": (length,), "labels": class}."""
    splits = load_texts(cfg)
    train = splits[cfg.dataset_split]
    held_out = next((splits[s] for s in ("validation", "test") if s in splits), None)
    if held_out is None:  # a fixed split seed: changing `seed` must not move texts between the two
        split = train.train_test_split(test_size=cfg.eval_fraction, seed=0)
        train, held_out = split["train"], split["test"]
    tokenize = functools.partial(
        encode, tokenizer=text_tokenizer(cfg), column=cfg.text_column, max_length=cfg.max_length
    )
    train, held_out = (
        part.map(tokenize, batched=True, remove_columns=part.column_names, desc="tokenizing")
        for part in (train, held_out)
    )
    return train.with_format("torch"), held_out.with_format("torch")


def collate(samples: list[dict]) -> dict:
    """The model's keyword arguments: input_ids padded to the batch's longest, its attention mask (the
    padding's id does not matter: the mask hides it), and labels."""
    longest = max(len(sample["input_ids"]) for sample in samples)
    input_ids = torch.zeros(len(samples), longest, dtype=torch.long)
    attention_mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, sample in enumerate(samples):
        length = len(sample["input_ids"])
        input_ids[row, :length] = sample["input_ids"]
        attention_mask[row, :length] = 1
    labels = torch.stack([torch.as_tensor(sample["labels"]) for sample in samples]).long()
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def class_names(cfg) -> list[str]:
    """The classes, in label order (model.py sizes its head by them and names its per-class F1)."""
    return list(load_texts(cfg)[cfg.dataset_split].features[LABEL_COLUMN].names)


def text_tokenizer(cfg):
    tokenizer = load_tokenizer(cfg.tokenizer_name)
    if tokenizer is None:
        raise ConfigError(
            "tokenizer: a text classifier needs a Hugging Face tokenizer: pass --tokenizer NAME_OR_FOLDER "
            "(e.g. google-bert/bert-base-uncased), or --hf_model CHECKPOINT to use the checkpoint's own"
        )
    return tokenizer


def encode(rows: dict, tokenizer, column: str, max_length: int) -> dict:
    texts = [str(text) for text in rows[column]]
    encoded = tokenizer(texts, truncation=True, max_length=max_length)
    return {"input_ids": encoded["input_ids"], "labels": rows[LABEL_COLUMN]}


@functools.cache
def load_texts(cfg):
    """The splits, with the label column as class labels (cached: class_names asks again)."""
    import datasets

    files = []
    try:
        if os.path.exists(cfg.dataset):
            path = Path(cfg.dataset)
            files = (
                [path]
                if path.is_file()
                else sorted(p for p in path.rglob("*") if p.suffix in BUILDERS)
            )
            builder = BUILDERS.get(files[0].suffix) if files else None
            if builder is None:
                raise ConfigError(f"dataset '{cfg.dataset}' holds no {', '.join(BUILDERS)} file")
            splits = datasets.load_dataset(builder, data_files={"train": [str(f) for f in files]})
        else:
            splits = datasets.load_dataset(cfg.dataset, cfg.dataset_config or None)
    except ConfigError:
        raise
    except Exception as e:  # a malformed file, offline, a wrong name
        raise ConfigError(f"dataset '{cfg.dataset}' could not be read: {first_line(e)}") from None
    if cfg.dataset_split not in splits:
        raise ConfigError(
            f"dataset_split '{cfg.dataset_split}' is not a split of '{cfg.dataset}' (splits: {', '.join(splits)})"
        )
    columns = splits[cfg.dataset_split].column_names
    for key, column in (("text_column", cfg.text_column), ("data.py's LABEL_COLUMN", LABEL_COLUMN)):
        if column not in columns:
            raise ConfigError(
                f"{key} '{column}' is not a column of '{cfg.dataset}' (columns: {', '.join(columns)})"
            )
    check_labels(splits, cfg, files if os.path.exists(cfg.dataset) else [])
    if not isinstance(splits[cfg.dataset_split].features[LABEL_COLUMN], datasets.ClassLabel):
        # names or numbers: classes in sorted order
        splits = splits.class_encode_column(LABEL_COLUMN)
    return splits


def check_labels(splits, cfg, files: list[Path]) -> None:
    """Every row's label, at start-up rather than as a crash mid-training: an empty cell, a number
    that is not an integer, or a value outside a dataset's named classes is one line naming the
    file (or split), the row and the column."""
    for name, split in splits.items():
        feature = split.features[LABEL_COLUMN]
        for row, value in enumerate(split.data.column(LABEL_COLUMN).to_pylist()):
            problem = label_problem(value, feature)
            if problem is not None:
                where = row_in_files(row, files) if files else f"split '{name}', row {row + 1}"
                raise ConfigError(f"dataset: {where}, column '{LABEL_COLUMN}': {problem}")


def label_problem(value, feature) -> str | None:
    import datasets

    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "the label is empty; every row needs its class (a name or an integer)"
    if isinstance(value, float) and not value.is_integer():
        return f"the label {value!r} is not an integer (labels are class names or integers)"
    if isinstance(feature, datasets.ClassLabel) and not 0 <= value < feature.num_classes:
        names = ", ".join(feature.names)
        return f"the label {value} is outside the classes 0..{feature.num_classes - 1} ({names})"
    return None


def row_in_files(row: int, files: list[Path]) -> str:
    """Where the `row`-th row of files read one after another is: the file, and its line (CSV:
    after the header; JSON lines: one a line) or its row."""
    import datasets

    for file in files:
        rows = len(datasets.load_dataset(BUILDERS[file.suffix], data_files=str(file))["train"])
        if row < rows:
            if file.suffix == ".csv":
                return f"{file}, line {row + 2} (row {row + 1} after the header)"
            if file.suffix == ".jsonl":
                return f"{file}, line {row + 1}"
            return f"{file}, row {row + 1}"
        row -= rows
    return f"row {row + 1}"
