"""The data a run trains and evaluates on: loaded, ordered and batched, the same on both plumbings
and at any world size.

- `load_data`: the task's datasets (a mixture's, each source's), prepared by one process first,
  and their identity; `build_batches`: the training batches and the eval loaders, on the device.
- `EpochSampler`: which samples, in which order (a function of the seed, the epoch and the global
  batch); `data_order` picks it, or a mixture's MixtureSampler (mixture.py).
- `TrainBatches`: the endless stream of one process's micro-batches, and its position as a
  checkpoint part.
- `fast_reader`: the packed blocks read straight from datasets' memory-mapped Arrow cache.
- `data_identity`: what a resume must find unchanged for the order to continue exactly where it
  stopped.

(Streamed data has its own stream and position: streaming.py.) None of this depends on what data.py
holds beyond "a map-style dataset of samples"."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

import task
from errors import ConfigError
from mixture import Concatenation, MixtureSampler, build_data
from profiling import start_clock
from sources import describe, source_config
from stopping import loader_worker_options
from streaming import stream_batches


@dataclass
class RunData:
    train_set: object  # a map-style dataset, a stream, or a mixture's (mixture.py)
    eval_sets: dict  # {source name: eval set}; one dataset's under ""
    identity: dict  # what a resume must find unchanged (data_identity)

    def first_eval_batch(self, device) -> dict:
        """Up to two eval samples (of the first source's) as one batch, on the device: enough to
        check the model's loss contract (task.check_loss_contract)."""
        eval_set = next(iter(self.eval_sets.values()))
        batch = task.collate([eval_set[i] for i in range(min(2, len(eval_set)))])
        return {key: value.to(device) for key, value in batch.items()}


def load_data(cfg, plumbing) -> RunData:
    """data.py's datasets (a mixture: each source's, the train sets joined), checked to hold one
    optimizer step."""
    # one process fills the datasets cache and the others then read it: once per job, or once per
    # node when each node has its own disk
    if cfg.shared_filesystem:
        cache_filler_goes_first = plumbing.main_process_first
    else:
        cache_filler_goes_first = plumbing.local_main_process_first
    with cache_filler_goes_first():
        train_set, eval_sets = build_data(cfg, task.build_datasets)
    check_data_size(train_set, cfg, plumbing.num_processes)
    return RunData(train_set, eval_sets, data_identity(cfg, train_set))


def build_batches(cfg, plumbing, data: RunData) -> tuple:
    """(the training batches, {source: eval loader}), prepared: each process draws its share of
    every global batch, on the device. A micro-step draws the global batch's share of every
    process; a stream is each process's own share (streaming.py)."""
    global_batch = cfg.global_batch(plumbing.num_processes)
    eval_loaders = {
        source: plumbing.prepare(DataLoader(fast_reader(eval_set), **loader_options(cfg)))
        for source, eval_set in data.eval_sets.items()
    }
    if cfg.streaming:
        batches = stream_batches(data.train_set, cfg, plumbing)
        start_clock.lap("data")
        return batches, eval_loaders
    # the order: a function of (seed, epoch); a mixture's also of the weights
    sampler = data_order(cfg, data.train_set, global_batch)
    loader = DataLoader(
        fast_reader(data.train_set), sampler=sampler, drop_last=True, **loader_options(cfg)
    )
    batches = TrainBatches(plumbing.prepare(loader), sampler, global_batch // cfg.grad_accum_steps)
    start_clock.lap("data")  # the restart report's: since the process group (profiling.py)
    return batches, eval_loaders


def loader_options(cfg) -> dict:
    return {
        "batch_size": cfg.batch_size,
        "collate_fn": task.collate,
        "num_workers": cfg.num_workers,
        "pin_memory": torch.cuda.is_available(),
        # a loader draws its worker seeds from `generator`, not from the global RNG
        # that dropout uses
        "generator": torch.Generator().manual_seed(cfg.seed),
        # a preemption's signal reaches the loader workers too: they leave it to this process,
        # which checkpoints first
        **loader_worker_options(cfg.num_workers),
    }


def check_data_size(train_set, cfg, num_processes: int) -> None:
    """A stream has no length: a share too small for one block is said when it runs dry
    (streaming.py)."""
    global_batch = cfg.global_batch(num_processes)
    if cfg.streaming or len(train_set) >= global_batch:
        return
    raise ConfigError(
        f"dataset: {len(train_set)} training samples is too few for one optimizer step at world size "
        f"{num_processes} x batch_size {cfg.batch_size} x grad_accum_steps {cfg.grad_accum_steps} = "
        f"{global_batch} samples"
    )


class EpochSampler(Sampler[int]):
    """Each epoch a fresh permutation of the dataset, seeded by (seed + epoch), cut to whole global
    batches: a function of (seed, epoch, global batch) alone. World size, per-process batch and
    accumulation only decide who computes a sample, never in which step, so both plumbings, and a
    resume on another world size with the same global batch, train on the same samples in the same
    steps."""

    def __init__(self, num_samples: int, seed: int, samples_per_step: int):
        self.dataset_size = num_samples
        self.seed = seed
        self.epoch = 0
        self._start = 0
        # the tail that makes no whole global batch is left out: another tail each epoch
        self.num_samples = num_samples - num_samples % samples_per_step

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def start_next_pass_at(self, sample: int) -> None:
        """The next pass (only) begins at this sample of the epoch: a mid-epoch resume skips by
        index."""
        self._start = sample

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.dataset_size, generator=generator)
        start = self._start
        self._start = 0
        return iter(order[start : self.num_samples].tolist())

    def __len__(self) -> int:
        return self.num_samples


class TrainBatches:
    """The endless stream of this process's training micro-batches (next(batches)), and a checkpoint
    part whose state is one number, `micro_batches`: global micro-batches consumed (of
    `samples_per_micro_batch` samples, all processes together). Saved with that size, so a resume
    whose micro-batch differs (another world size or accumulation, the same global batch) converts
    it and continues with the uninterrupted run's next sample."""

    def __init__(self, loader, sampler: EpochSampler, samples_per_micro_batch: int):
        self.loader = loader
        self.sampler = sampler
        self.samples_per_micro_batch = samples_per_micro_batch
        self.micro_batches = 0
        self._stream = None

    @property
    def epoch(self) -> float:
        """Epochs done, fractional: 1.5 is half-way through the second."""
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
            # Accelerate's loader keeps its own epoch count and passes it on to our sampler
            self.loader.set_epoch(epoch)
            self.sampler.start_next_pass_at(start)
            yield from self.loader
            epoch += 1
            start = 0

    def state_dict(self) -> dict:
        return {
            "micro_batches": self.micro_batches,
            "samples_per_micro_batch": self.samples_per_micro_batch,
        }

    def load_state_dict(self, state: dict) -> None:
        samples = state["micro_batches"] * state["samples_per_micro_batch"]
        if samples % self.samples_per_micro_batch:
            raise ValueError(
                f"{samples} samples consumed is not a whole number of micro-batches of "
                f"{self.samples_per_micro_batch}: the global batch changed"
            )
        self.micro_batches = samples // self.samples_per_micro_batch
        self._stream = None


class ArrowBlocks(torch.utils.data.Dataset):
    """Packed blocks read as numpy views of datasets' memory-mapped Arrow cache, as nanoGPT reads
    its memmap: no copy of the data, no per-row formatting (a DataLoader batch of 8 x 64 tokens: 554
    -> 144 us, measured). `fast_reader` decides when a dataset qualifies."""

    def __init__(self, dataset):
        self.dataset = dataset
        self._views = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getstate__(self) -> dict:
        # to a spawned loader worker: the dataset, not the views (they would be copied)
        return {"dataset": self.dataset, "_views": None}

    def __getitem__(self, index: int) -> dict:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        if self._views is None:
            self._views = self._chunk_views()
        views, starts = self._views
        chunk_of = np.searchsorted(starts, indices, side="right") - 1
        samples = []
        for chunk, index in zip(chunk_of, indices, strict=True):
            block = views[chunk][index - starts[chunk]]
            samples.append({"input_ids": torch.from_numpy(block.astype(np.int64))})
        return samples

    def _chunk_views(self) -> tuple[list[np.ndarray], np.ndarray]:
        """One (blocks, block_size) view per Arrow chunk, and the row where each chunk starts."""
        chunks = self.dataset.data.table.column("input_ids").chunks
        views = []
        for chunk in chunks:
            flat = chunk.flatten().to_numpy(zero_copy_only=True)
            views.append(flat.reshape(len(chunk), -1))
        starts = np.cumsum([0] + [len(view) for view in views])
        return views, starts


def data_order(cfg, train_set, samples_per_step: int) -> Sampler[int]:
    """The training samples' order: an EpochSampler over one dataset, or a MixtureSampler over a
    mixture's concatenated sources (mixture.py)."""
    if cfg.mixture:
        sizes = [len(part) for part in train_set.parts.values()]
        weights = [source.weight for source in cfg.mixture]
        return MixtureSampler(sizes, weights, cfg.seed, samples_per_step)
    return EpochSampler(len(train_set), cfg.seed, samples_per_step)


def fast_reader(dataset):
    """ArrowBlocks over `dataset` if it holds only fixed-length token blocks in storage order (what
    the shipped data.py makes); any other dataset (a fork's own, a filtered view) as it is. A
    mixture's concatenation: each of its sources so."""
    import datasets

    if isinstance(dataset, Concatenation):
        return dataset.with_parts(fast_reader)
    if not isinstance(dataset, datasets.Dataset):
        return dataset
    if dataset._indices is not None or dataset.column_names != ["input_ids"]:
        return dataset
    return ArrowBlocks(dataset)


def data_identity(cfg, train_set) -> dict:
    """What a resume must find unchanged for the data order to continue exactly where it stopped. A
    mixture: its sources and weights (as `dataset`), and each source's own identity under its
    name."""
    if cfg.mixture:
        identity = {"seed": cfg.seed, "dataset": describe(cfg.mixture)}
        for source in cfg.mixture:
            own = data_identity(source_config(cfg, source), train_set.parts[source.name])
            own.pop("seed")  # the run's, above
            identity.update({f"{source.name}/{key}": value for key, value in own.items()})
        return identity
    if cfg.streaming:  # no packed data to digest: the source's files (or hub revision) instead
        return {
            "seed": cfg.seed,
            "dataset": cfg.dataset,
            "streaming": True,
            "tokenizer": cfg.tokenizer_name,
            "shuffle_buffer": cfg.shuffle_buffer,
            "stream_files": stream_files(cfg.dataset),
            "stream_revision": None if Path(cfg.dataset).exists() else hub_revision(cfg.dataset),
        }
    return {
        "seed": cfg.seed,
        "dataset": cfg.dataset,
        "train_blocks": len(train_set),
        "data_digest": fork_identity(train_set) or content_digest(train_set),
    }


def fork_identity(dataset) -> str | None:
    """data.py's `identity(dataset)`, where the fork defines one (task.py); else None."""
    identity = task.data_identity(dataset)
    return None if identity is None else str(identity)


def stream_files(dataset: str) -> str | None:
    """A digest of the local files a streamed run reads: every data file's name, size and content (whole up
    to 64 MiB, else 16 evenly spaced MiB of it). None for a hub dataset (its revision counts instead)."""
    import xxhash

    from checks import DATA_FILE_SUFFIXES

    path = Path(dataset)
    if not path.exists():
        return None
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.suffix in DATA_FILE_SUFFIXES)
    digest = xxhash.xxh3_64()
    for file in files:
        size = file.stat().st_size
        name = file.relative_to(path) if path.is_dir() else file.name
        digest.update(f"{name}:{size}".encode())
        digest.update(sampled_content(file, size))
    return digest.hexdigest()


def sampled_content(file: Path, size: int, whole_up_to: int = 64 << 20, pieces: int = 16) -> bytes:
    """A file's bytes, or `pieces` evenly spaced MiB of a bigger one."""
    with open(file, "rb") as f:
        if size <= whole_up_to:
            return f.read()
        sample = []
        for piece in range(pieces):
            f.seek(piece * (size - (1 << 20)) // (pieces - 1))
            sample.append(f.read(1 << 20))
        return b"".join(sample)


def hub_revision(name: str) -> str | None:
    """The commit a hub dataset's name points to now, or None offline (5 s at most): unknown is no change."""
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(name, timeout=5).sha
    except Exception:  # offline, no access: the name and configuration still count
        return None


def content_digest(dataset, budget_bytes: int = 1 << 30) -> str:
    """A digest of a dataset's content. A datasets.Dataset: xxh3 of its Arrow buffers, all of them up
    to `budget_bytes`, an evenly spaced sample of its chunks beyond (about 0.1 s per GiB from the page
    cache), and the files its image or audio columns only name by path (an image folder's). Any other
    dataset (a torch Dataset): its samples' tensors (sample_digest). Content, not datasets'
    `_fingerprint`: that one hashes the functions that made the data with everything they reference,
    so a data.py whose map function reads `cfg` would change it on every resume (cfg.resume differs)."""
    import datasets
    import xxhash

    if not isinstance(dataset, datasets.Dataset):
        return sample_digest(dataset)
    tables = [dataset.data.table]
    if dataset._indices is not None:  # a selected or shuffled view: which rows, in which order
        tables.append(dataset._indices.table)
    chunks = [chunk for table in tables for column in table.columns for chunk in column.chunks]
    total = sum(chunk.nbytes for chunk in chunks)
    every = max(1, -(-total // budget_bytes))  # hash one chunk in `every`
    digest = xxhash.xxh3_64()
    digest.update(str((len(dataset), dataset.column_names, total)).encode())
    for chunk in chunks[::every]:
        for buffer in chunk.buffers():
            if buffer is not None:
                digest.update(memoryview(buffer))
    digest.update(files_digest(named_files(dataset), budget_bytes).encode())
    return digest.hexdigest()


def named_files(dataset) -> list[str]:
    """The files a dataset's image or audio columns name by path without holding their bytes."""
    import datasets

    files = []
    for column, feature in dataset.features.items():
        if isinstance(feature, (datasets.Image, datasets.Audio)):
            cells = dataset.data.table.column(column).to_pylist()
            files += [c["path"] for c in cells if c and c.get("bytes") is None and c.get("path")]
    return files


def files_digest(files: list[str], budget_bytes: int) -> str:
    """xxh3 of the files' names, sizes and contents: every file's up to `budget_bytes` in all, beyond
    that every file's size and an evenly spaced sample of their contents."""
    import xxhash

    digest = xxhash.xxh3_64()
    sizes = [os.path.getsize(file) for file in files]
    every = max(1, -(-sum(sizes) // budget_bytes))
    for index, (file, size) in enumerate(zip(files, sizes, strict=True)):
        digest.update(f"{file}:{size}".encode())
        if index % every == 0:
            digest.update(Path(file).read_bytes())
    return digest.hexdigest()


def sample_digest(dataset, most: int = 4096) -> str:
    """xxh3 of up to `most` evenly spaced samples of any map-style dataset (every sample of a smaller
    one): their tensors' and arrays' bytes, and any other value's repr. A dataset without len() or
    indexing gets its type's name: define data.py's identity(dataset) for it."""
    import xxhash

    digest = xxhash.xxh3_64()
    try:
        size = len(dataset)
        indices = sorted({i * size // most for i in range(most)}) if size > most else range(size)
        digest.update(str(size).encode())
        for index in indices:
            _update(digest, dataset[index])
    except (TypeError, NotImplementedError):
        return type(dataset).__name__
    return digest.hexdigest()


def _update(digest, value) -> None:
    if isinstance(value, dict):
        for key in sorted(value):
            digest.update(str(key).encode())
            _update(digest, value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            _update(digest, item)
    elif isinstance(value, torch.Tensor):
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    elif isinstance(value, np.ndarray):
        digest.update(np.ascontiguousarray(value).tobytes())
    else:
        digest.update(repr(value).encode())


def loss_weights(micro_batches: list[dict], plumbing) -> torch.Tensor:
    """Each micro-batch's weight in its optimizer step, float64 on the device, one per micro-batch.

    The model's .loss is the mean over its micro-batch's items (model.py's `loss_items(batch)`:
    an LM's counted tokens, fewer where prompts are masked). The step must minimise the mean over
    all the items of all its micro-batches on all ranks, or a short answer's tokens weigh more than
    a long one's and accumulation or another world size changes the gradient. The backward already
    averages micro-batches (divides by grad_accum_steps) and DDP averages ranks, so micro-batch b
    weighs items_b x ranks x micro-batches / the step's items: one all-reduce of one number per
    step, before any backward. Where every micro-batch counts the same (packed blocks), each weight
    is exactly 1.0 and nothing changes by a bit. A task without loss_items: 1.0 each."""
    steps = len(micro_batches)
    count = task.loss_counter()
    if count is None:
        return torch.ones(steps, dtype=torch.float64, device=plumbing.device)
    items = torch.stack([torch.as_tensor(count(batch)).reshape(()) for batch in micro_batches])
    items = items.to(device=plumbing.device, dtype=torch.int64)
    step_items = plumbing.reduce(items.sum(), "sum")
    # integers until the division: equal counts give exactly 1.0
    share = items * plumbing.num_processes * steps
    return share.double() / step_items.clamp(min=1).double()
