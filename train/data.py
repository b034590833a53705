"""Data: text in through Hugging Face `datasets`, tokenized (bytes, or a Hugging Face tokenizer), packed into blocks.

FORK POINT 2: to train on your own data, replace the body of `build_datasets` (and `tokenize`). The loop needs
two map-style datasets whose items `collate` turns into the model's keyword arguments (`input_ids`, `labels`)
(with `streaming`: a datasets IterableDataset of documents for training, which streaming.py packs).
The plumbing's `prepare` shards them across processes: nothing in this file looks at ranks.

`dataset` (a config key) selects the text:
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
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Sampler

from config import DATA_FILE_SUFFIXES, ConfigError, first_line

DATA_DIR = Path(__file__).resolve().parents[1] / "data"  # the repo's data/ folder
BYTE_VOCAB_SIZE = 256  # the default "tokenizer": every UTF-8 byte is a token, nothing to download
_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


# >>> FORK POINT 2: build_datasets, tokenize
def build_datasets(cfg):
    """(train, eval) map-style datasets of packed `block_size`-token blocks. With `streaming`, train is the stream
    of documents itself (streaming.py packs it as it reads) and eval its first `streaming_eval_blocks` blocks."""
    splits = load_text(cfg)
    train_text, eval_text = _train_eval_split(splits, cfg)
    pack = functools.partial(tokenize, block_size=cfg.block_size, text_column=cfg.text_column,
                             tokenizer=load_tokenizer(cfg.tokenizer_name))
    if cfg.streaming:
        import datasets

        blocks = eval_text.map(pack, batched=True, remove_columns=list(next(iter(eval_text))))
        evaluation = datasets.Dataset.from_list(list(itertools.islice(blocks, cfg.streaming_eval_blocks)))
        return train_text.select_columns([cfg.text_column]), _some_blocks("eval", evaluation, cfg)
    train, evaluation = (text.map(pack, batched=True, remove_columns=text.column_names, desc=f"tokenizing {name} text")
                         for name, text in (("train", train_text), ("eval", eval_text)))
    return _some_blocks("train", train, cfg), _some_blocks("eval", evaluation, cfg)


def _some_blocks(name: str, blocks, cfg):
    if len(blocks) == 0:
        raise ConfigError(f"dataset '{cfg.dataset}' gives no {name} block of block_size {cfg.block_size} tokens: "
                          f"too little text")
    return blocks.with_format("torch")


def tokenize(batch: dict, block_size: int, text_column: str, tokenizer=None) -> dict:
    """A batch of documents as `block_size`-token blocks (the tail is dropped)."""
    stream = token_stream(batch[text_column], tokenizer)
    n_blocks = len(stream) // block_size
    return {"input_ids": stream[:n_blocks * block_size].reshape(n_blocks, block_size)}
# <<< FORK POINT 2


def token_stream(texts: list, tokenizer=None) -> np.ndarray:
    """The documents' tokens one after another, each document ended by the tokenizer's EOS (bytes: a newline), in
    the narrowest unsigned type that holds the vocabulary (bytes: 1 per token). Empty documents are skipped."""
    texts = [str(text) for text in texts if text]
    if tokenizer is None:
        return np.frombuffer(b"".join(text.encode("utf-8") + b"\n" for text in texts), dtype=np.uint8)
    documents = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return np.fromiter(itertools.chain.from_iterable(ids + [tokenizer.eos_token_id] for ids in documents),
                       dtype=token_dtype(len(tokenizer)))


def token_dtype(vocab_size: int):
    return next(dtype for dtype in (np.uint8, np.uint16, np.uint32) if vocab_size <= np.iinfo(dtype).max + 1)


@functools.cache
def load_tokenizer(name: str):
    """None for "bytes" (every UTF-8 byte a token), else a Hugging Face tokenizer by hub name or local folder."""
    if name == "bytes":
        return None
    from transformers import AutoTokenizer  # imported only when used

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except Exception as e:  # offline, a wrong name or folder: all the same to the user
        raise ConfigError(f"tokenizer '{name}' could not be loaded: {first_line(e)}") from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer '{name}' has no EOS token to end documents with: set its eos_token")
    return tokenizer


def vocab_size(cfg) -> int:
    tokenizer = load_tokenizer(cfg.tokenizer_name)
    return BYTE_VOCAB_SIZE if tokenizer is None else len(tokenizer)


def data_identity(cfg, train_set) -> dict:
    """What a resume must find unchanged for the data order to continue exactly where it stopped."""
    if cfg.streaming:
        return {"seed": cfg.seed, "dataset": cfg.dataset, "streaming": True, "tokenizer": cfg.tokenizer_name,
                "shuffle_buffer": cfg.shuffle_buffer}
    return {"seed": cfg.seed, "dataset": cfg.dataset, "train_blocks": len(train_set),
            "data_fingerprint": getattr(train_set, "_fingerprint", None)}  # datasets' hash of data and processing


class ArrowBlocks(torch.utils.data.Dataset):
    """Packed blocks read as numpy views of datasets' memory-mapped Arrow cache, as nanoGPT reads its memmap: no
    copy of the data, no per-row formatting (a DataLoader batch of 8 x 64 tokens: 554 -> 144 us, measured).
    `fast_reader` decides when a dataset qualifies."""

    def __init__(self, dataset):
        self.dataset, self._views = dataset, None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getstate__(self) -> dict:  # to a spawned loader worker: the dataset, not the views (they would be copied)
        return {"dataset": self.dataset, "_views": None}

    def __getitem__(self, index: int) -> dict:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        if self._views is None:  # one view per Arrow chunk, and where each chunk starts
            chunks = self.dataset.data.table.column("input_ids").chunks
            views = [chunk.flatten().to_numpy(zero_copy_only=True).reshape(len(chunk), -1) for chunk in chunks]
            self._views = views, np.cumsum([0] + [len(view) for view in views])
        views, starts = self._views
        chunk_of = np.searchsorted(starts, indices, side="right") - 1
        return [{"input_ids": torch.from_numpy(views[c][i - starts[c]].astype(np.int64))}
                for c, i in zip(chunk_of, indices, strict=True)]


def fast_reader(dataset):
    """ArrowBlocks over `dataset` if it is what build_datasets makes (a datasets.Dataset holding only fixed-length
    token blocks, in storage order); any other dataset (a fork's own, a filtered view) as it is."""
    import datasets

    if not isinstance(dataset, datasets.Dataset) or dataset._indices is not None or \
            dataset.column_names != ["input_ids"]:
        return dataset
    return ArrowBlocks(dataset)


def collate(samples: list[dict]) -> dict:
    """Stack samples into the model's inputs; a causal LM's labels are its inputs (it shifts them)."""
    input_ids = torch.stack([s["input_ids"] for s in samples]).long()
    return {"input_ids": input_ids, "labels": input_ids}


def load_text(cfg):
    """A DatasetDict with a 'train' split (and a validation split if the source has one)."""
    import datasets  # heavy import kept out of config validation

    source = cfg.dataset
    if source == "python_stdlib":
        source = str(write_python_stdlib_corpus())
    if os.path.exists(source):
        files = _data_files(source)
        builder = _BUILDERS[Path(files[0]).suffix]
        try:
            splits = datasets.load_dataset(builder, data_files={"train": files}, streaming=cfg.streaming)
        except Exception as e:  # a malformed line, a wrong encoding: name the file type and the first cause
            cause = e.__cause__ or e
            raise ConfigError(f"dataset '{source}' cannot be read as {builder} files: {first_line(cause)}") from None
    else:
        try:
            splits = datasets.load_dataset(source, cfg.dataset_config or None, streaming=cfg.streaming)
        except Exception as e:  # offline, unknown name, no access: all the same to the user
            offline = any(os.environ.get(v, "0") not in ("0", "") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
            offline = " (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set)" if offline else ""
            raise ConfigError(f"dataset '{source}' could not be loaded from the hub{offline}: "
                              f"{first_line(e)}") from None
    columns = splits["train"].column_names or list(next(iter(splits["train"]), {}))  # a stream: its first row's
    if cfg.text_column not in columns:
        raise ConfigError(f"text_column '{cfg.text_column}' is not a column of '{cfg.dataset}' "
                          f"(columns: {', '.join(columns)})")
    return splits


def _data_files(path: str) -> list[str]:
    files = [path] if os.path.isfile(path) else sorted(str(p) for p in Path(path).rglob("*")
                                                         if p.suffix in DATA_FILE_SUFFIXES)
    suffixes = {_BUILDERS.get(Path(f).suffix) for f in files}
    if not files or None in suffixes or len(suffixes) > 1:
        raise ConfigError(f"dataset '{path}' must be one or more files of a single type among "
                          f"{', '.join(DATA_FILE_SUFFIXES)}")
    return files


def _train_eval_split(splits, cfg):
    for name in ("validation", "test"):
        if name in splits:
            return splits["train"], splits[name]
    if cfg.streaming:  # no index to split by: a document is held out by a hash of its text, whatever its position
        def held_out(document) -> bool:
            return zlib.crc32(str(document[cfg.text_column]).encode()) % 10_000 < cfg.eval_fraction * 10_000

        return splits["train"].filter(lambda doc: not held_out(doc)), splits["train"].filter(held_out)
    # a fixed split seed: changing `seed` must not move documents between train and eval
    held_out = splits["train"].train_test_split(test_size=cfg.eval_fraction, seed=0, shuffle=True)
    return held_out["train"], held_out["test"]


def write_python_stdlib_corpus(folder: Path = DATA_DIR / "python_stdlib") -> Path:
    """Write this Python's top-level stdlib modules as JSON lines, once; return the file."""
    target = folder / "stdlib.jsonl"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tmp = folder / f".stdlib.jsonl.{os.getpid()}.tmp"  # several local ranks may race here: rename is atomic
    with open(tmp, "w") as out:
        for path in sorted(stdlib.glob("*.py")):
            text = path.read_text(encoding="utf-8", errors="replace")
            out.write(json.dumps({"text": text, "path": path.name}) + "\n")
    os.replace(tmp, target)
    return target


# ---------------------------------------------------------------- data order (shared, not a fork point)


class EpochSampler(Sampler[int]):
    """Each epoch a fresh permutation of the dataset, seeded by (seed + epoch), cut to whole global batches: a
    function of (seed, epoch, global batch) alone. World size, per-process batch and accumulation only decide
    who computes a sample, never in which step, so both plumbings, and a resume on another world size with
    the same global batch, train on the same samples in the same steps."""

    def __init__(self, num_samples: int, seed: int, samples_per_step: int):
        self.dataset_size, self.seed, self.epoch, self._start = num_samples, seed, 0, 0
        self.num_samples = num_samples - num_samples % samples_per_step  # the tail is left out, a new one each epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def start_next_pass_at(self, sample: int) -> None:
        """The next pass (only) begins at this sample of the epoch: a mid-epoch resume skips by index."""
        self._start = sample

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.dataset_size, generator=generator)[self._start:self.num_samples]
        self._start = 0
        return iter(order.tolist())

    def __len__(self) -> int:
        return self.num_samples


class TrainBatches:
    """The endless stream of this process's training micro-batches (next(batches)), and a checkpoint part whose
    state is one number, `micro_batches`: global micro-batches consumed (of `samples_per_micro_batch` samples,
    all processes together). Saved with that size, so a resume whose micro-batch differs (another world size or
    accumulation, the same global batch) converts it and continues with the uninterrupted run's next sample."""

    def __init__(self, loader, sampler: EpochSampler, samples_per_micro_batch: int):
        self.loader, self.sampler, self.samples_per_micro_batch = loader, sampler, samples_per_micro_batch
        self.micro_batches = 0
        self._stream = None

    @property
    def epoch(self) -> float:  # epochs done, fractional: 1.5 is half-way through the second
        return self.micro_batches * self.samples_per_micro_batch / len(self.sampler)

    def __next__(self) -> dict:
        if self._stream is None:
            self._stream = self._batches_from(self.micro_batches * self.samples_per_micro_batch)
        batch = next(self._stream)
        self.micro_batches += 1
        return batch

    def _batches_from(self, samples_consumed: int):
        epoch, start = divmod(samples_consumed, len(self.sampler))
        while True:
            self.loader.set_epoch(epoch)  # Accelerate's loader keeps its own epoch count and passes it on to ours
            self.sampler.start_next_pass_at(start)
            yield from self.loader
            epoch, start = epoch + 1, 0

    def state_dict(self) -> dict:
        return {"micro_batches": self.micro_batches, "samples_per_micro_batch": self.samples_per_micro_batch}

    def load_state_dict(self, state: dict) -> None:
        samples = state["micro_batches"] * state["samples_per_micro_batch"]
        if samples % self.samples_per_micro_batch:
            raise ValueError(f"{samples} samples consumed is not a whole number of micro-batches of "
                             f"{self.samples_per_micro_batch}: the global batch changed")
        self.micro_batches, self._stream = samples // self.samples_per_micro_batch, None
