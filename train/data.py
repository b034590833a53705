"""The data. THIS FILE IS YOURS: replace it whole with your own (README "Make it yours").

What the rest of train/ uses of it, and nothing else:
    build_datasets(cfg) -> (train, eval)
        Map-style: two datasets of samples (anything `collate` takes), with len() and indexing.
        With cfg.streaming: train is a datasets.IterableDataset of *documents*, which streaming.py splits
        between processes, packs with `packer(cfg)` as it reads, and shuffles; eval is map-style, as above.
    packer(cfg) -> pack(documents) -> {"input_ids": array of shape (blocks, block_size)}
        A batch of documents (a dict of columns, as datasets' batched map gives it) in, token blocks out.
        The one packer of the run: train and eval, map-style and streamed, all go through it.
    collate(samples) -> dict
        A list of samples in, one batch out: the model's keyword arguments (here input_ids and labels).
Nothing here looks at ranks: the plumbing gives each process its share. The dataset's identity for
resuming (a digest of its content) is taken by batches.data_identity. A
mixture of datasets (--dataset a.jsonl:0.7,b.jsonl:0.3; mixture.py) calls build_datasets once per
source, with that source in cfg.dataset, cfg.dataset_config, cfg.dataset_split and cfg.text_column:
nothing here needs to know about mixtures.

This one reads text through Hugging Face `datasets` and packs it into `block_size`-token blocks, tokenized as
UTF-8 bytes or by a Hugging Face tokenizer (--tokenizer). `dataset` (a config key) selects the text:
    python_stdlib                 the .py files of this Python's standard library, read at run time
                                  (about 4.7 MB on CPython 3.11): offline, on every machine
    path/to/file.{txt,jsonl,json,csv,parquet} or a folder of such files
    owner/name                    a hub dataset (needs network, or a copy in the local HF cache)
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from checks import DATA_FILE_SUFFIXES, unreadable_data
from errors import ConfigError, first_line
from lm import packing_tokenizer

DATA_DIR = Path(__file__).resolve().parents[1] / "data"  # the repo's data/ folder
# what --dataset is when not given (task.py puts it in the config, so config.yaml says what was read)
DEFAULT_DATASET = "python_stdlib"
BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass
class DataConfig:
    """The causal LM's own data keys (config.py adds them to the template's: YAML, --flags, --help)."""

    # the column holding the raw text
    text_column: str = "text"
    # tokens (bytes) per training sample
    block_size: int = 128


def check_config(cfg) -> None:
    """DataConfig's keys, at start-up (the template checks only its own)."""
    if cfg.block_size <= 0:
        raise ConfigError(f"block_size must be > 0 (got {cfg.block_size!r})")
    if cfg.text_column == "":
        raise ConfigError(f"text_column must not be empty (got {cfg.text_column!r})")


def build_datasets(cfg):
    """(train, eval) datasets of packed `block_size`-token blocks. With `streaming`, train is the
    stream of documents itself, and eval the first `streaming_eval_blocks` blocks of the held-out
    documents."""
    splits = load_text(cfg)
    train_text, eval_text = train_eval_split(splits, cfg)
    pack = packer(cfg)
    if cfg.streaming:
        import datasets

        try:
            first_row = next(iter(eval_text), {})
            # packed as the training stream is, a few documents at a time: reading ahead for datasets'
            # default batch of 1000 held-out documents would read much of the stream at start-up
            blocks = eval_text.map(
                pack, batched=True, batch_size=64, remove_columns=list(first_row)
            )
            first_blocks = list(itertools.islice(blocks, cfg.streaming_eval_blocks))
        except Exception as e:  # a malformed line among the first held-out documents
            raise unreadable_data(cfg.dataset, e) from None
        evaluation = datasets.Dataset.from_list(first_blocks)
        return train_text.select_columns([cfg.text_column]), some_blocks("eval", evaluation, cfg)
    train = train_text.map(
        pack, batched=True, remove_columns=train_text.column_names, desc="tokenizing train text"
    )
    evaluation = eval_text.map(
        pack, batched=True, remove_columns=eval_text.column_names, desc="tokenizing eval text"
    )
    return some_blocks("train", train, cfg), some_blocks("eval", evaluation, cfg)


def packer(cfg):
    """`pack` bound to the values it reads. datasets fingerprints the function with its arguments to
    name its cache: binding only these (not the whole config) keeps the cache when output_dir or lr
    changes."""
    return functools.partial(
        pack,
        text_column=cfg.text_column,
        block_size=cfg.block_size,
        tokenizer=packing_tokenizer(cfg.tokenizer_name),
    )


def pack(documents: dict, text_column: str, block_size: int, tokenizer=None) -> dict:
    """A batch of documents as `block_size`-token blocks, one after another (the tail is
    dropped)."""
    tokens = token_stream(documents[text_column], tokenizer)
    n_blocks = len(tokens) // block_size
    blocks = tokens[: n_blocks * block_size].reshape(n_blocks, block_size)
    return {"input_ids": blocks}


def collate(samples: list[dict]) -> dict:
    """Stack samples into the model's inputs; a causal LM's labels are its inputs (it shifts
    them)."""
    input_ids = torch.stack([sample["input_ids"] for sample in samples]).long()
    return {"input_ids": input_ids, "labels": input_ids}


def token_stream(texts: list, tokenizer=None) -> np.ndarray:
    """The documents' tokens one after another, each document ended by the tokenizer's EOS (bytes: a
    newline), in the narrowest unsigned type that holds the vocabulary (bytes: 1 per token). Empty
    documents are skipped."""
    texts = [str(text) for text in texts if text]
    if tokenizer is None:
        encoded = b"".join(text.encode("utf-8") + b"\n" for text in texts)
        return np.frombuffer(encoded, dtype=np.uint8)
    documents = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    ids = itertools.chain.from_iterable(
        document + [tokenizer.eos_token_id] for document in documents
    )
    return np.fromiter(ids, dtype=token_dtype(len(tokenizer)))


def token_dtype(vocab_size: int):
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return dtype
    raise ValueError(f"a vocabulary of {vocab_size} tokens does not fit 32 bits")


def some_blocks(name: str, blocks, cfg):
    if len(blocks) == 0:
        raise ConfigError(
            f"dataset '{cfg.dataset}' gives no {name} block of block_size {cfg.block_size} tokens: "
            f"too little text"
        )
    return blocks.with_format("torch")


# ---------------------------------------------------------------- reading the text


def load_text(cfg):
    """A DatasetDict with the split to train on, cfg.dataset_split (and a validation split if the
    source has one). Local files are one split, 'train'."""
    import datasets  # a heavy import, made only when data is read

    source = cfg.dataset or DEFAULT_DATASET
    if source == "python_stdlib":
        source = str(write_python_stdlib_corpus())
    if os.path.exists(source):
        splits = load_local_files(source, cfg.streaming)
    else:
        try:
            splits = datasets.load_dataset(
                source, cfg.dataset_config or None, streaming=cfg.streaming
            )
        except Exception as e:  # offline, unknown name, no access: all the same to the user
            offline_variables = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
            offline = any(os.environ.get(v, "0") not in ("0", "") for v in offline_variables)
            why = " (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set)" if offline else ""
            raise ConfigError(
                f"dataset '{source}' could not be loaded from the hub{why}: {first_line(e)}"
            ) from None
    if cfg.dataset_split not in splits:
        raise ConfigError(
            f"dataset_split '{cfg.dataset_split}' is not a split of '{cfg.dataset}' "
            f"(splits: {', '.join(splits)})"
        )
    columns = splits[cfg.dataset_split].column_names
    if not columns:  # a stream knows its columns from its first row
        try:
            columns = list(next(iter(splits[cfg.dataset_split]), {}))
        except Exception as e:  # a malformed first line
            raise unreadable_data(cfg.dataset, e) from None
    if cfg.text_column not in columns:
        raise ConfigError(
            f"text_column '{cfg.text_column}' is not a column of '{cfg.dataset}' "
            f"(columns: {', '.join(columns)})"
        )
    return splits


def load_local_files(path: str, streaming: bool):
    import datasets

    files = data_files(path)
    builder = BUILDERS[Path(files[0]).suffix]
    try:
        return datasets.load_dataset(builder, data_files={"train": files}, streaming=streaming)
    # a malformed line, a wrong encoding: name the file type and the first cause
    except Exception as e:
        cause = e.__cause__ or e
        raise ConfigError(
            f"dataset '{path}' cannot be read as {builder} files: {first_line(cause)}"
        ) from None


def data_files(path: str) -> list[str]:
    if os.path.isfile(path):
        files = [path]
    else:
        files = sorted(str(p) for p in Path(path).rglob("*") if p.suffix in DATA_FILE_SUFFIXES)
    builders = {BUILDERS.get(Path(file).suffix) for file in files}
    if not files or None in builders or len(builders) > 1:
        raise ConfigError(
            f"dataset '{path}' must be one or more files of a single type among "
            f"{', '.join(DATA_FILE_SUFFIXES)}"
        )
    return files


def train_eval_split(splits, cfg):
    train = splits[cfg.dataset_split]
    for name in ("validation", "test"):
        if name in splits and name != cfg.dataset_split:
            return train, splits[name]
    if cfg.streaming:
        # no index to split by: a document is held out by a hash of its text, whatever its position
        def held_out(document) -> bool:
            digest = zlib.crc32(str(document[cfg.text_column]).encode())
            return digest % 10_000 < cfg.eval_fraction * 10_000

        def kept(document) -> bool:
            return not held_out(document)

        return train.filter(kept), train.filter(held_out)
    # a fixed split seed: changing `seed` must not move documents between train and eval
    split = train.train_test_split(test_size=cfg.eval_fraction, seed=0, shuffle=True)
    return split["train"], split["test"]


def write_python_stdlib_corpus(folder: Path = DATA_DIR / "python_stdlib") -> Path:
    """Write this Python's top-level stdlib modules as JSON lines, once; return the file."""
    target = folder / "stdlib.jsonl"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    # several local ranks may race here: rename is atomic
    tmp = folder / f".stdlib.jsonl.{os.getpid()}.tmp"
    with open(tmp, "w") as out:
        for path in sorted(stdlib.glob("*.py")):
            text = path.read_text(encoding="utf-8", errors="replace")
            out.write(json.dumps({"text": text, "path": path.name}) + "\n")
    os.replace(tmp, target)
    return target
