"""Streaming (`--streaming true`): a corpus read as a stream, for text bigger than memory or disk.

Each process reads its own share of the documents (datasets' `split_dataset_by_node`: whole files
when their number divides by the world size, else every world_size-th document), so no document is
trained on twice in an epoch and none is left out. It packs them as it reads, `DOCUMENTS_PER_READ`
at a time, with data.py's packer (the one the map-style path and the eval set use), and draws blocks
at random from a buffer of `shuffle_buffer` blocks whose generator is seeded by (seed, epoch, rank).
At the end of its share a process starts its next epoch alone: the stream never ends, so no process
waits at an epoch boundary for the others.

There is no index to skip by, so the position is the stream's whole state, saved by every process in
every checkpoint: the source's position (datasets' `IterableDataset.state_dict()`), the buffer and
its generator. A resume continues with exactly the blocks the uninterrupted run would have drawn
(its buffer is restored, not refilled as datasets' own shuffle does); each process owns a share, so
it needs the same world size."""

from __future__ import annotations

import copy

import numpy as np
import torch

import task
from checks import unreadable_data
from errors import ConfigError
from mixture import apportion, spread
from sources import source_config

DOCUMENTS_PER_READ = 64  # documents packed together (a fast tokenizer's batch call)


class StreamBatches:
    """This process's endless stream of training micro-batches (next(batches)), and a checkpoint
    part written by every process. Each block drawn has a sample id, (epoch, blocks packed before it
    by this process)."""

    def __init__(self, documents, cfg, plumbing, source_index: int | None = None):
        from datasets.distributed import split_dataset_by_node

        self.documents = split_dataset_by_node(
            documents, rank=plumbing.process_index, world_size=plumbing.num_processes
        )
        self.dataset = cfg.dataset
        self.rank = plumbing.process_index
        self.device = plumbing.device
        self.pack = task.packer(cfg)
        # the packer's block length (a data.py key: the shipped LM's); 0 where the fork has none
        self.block_size = getattr(cfg, "block_size", 0)
        self.batch_size = cfg.batch_size
        self.buffer_size = cfg.shuffle_buffer
        # a mixture's sources draw from generators of their own
        self.seed_entropy = [cfg.seed] if source_index is None else [cfg.seed, source_index]
        self._start_epoch(0)

    @property
    def epoch(self) -> int:
        """This process's completed passes over its share."""
        return self._epoch

    def __next__(self) -> dict:
        blocks = [self.next_block()[1] for _ in range(self.batch_size)]
        return as_batch(blocks, self.device)

    def next_block(self) -> tuple[tuple[int, int], np.ndarray]:
        """(sample id, block): a random block of the buffer, the buffer topped up from the source
        first."""
        while True:
            if not self._source_done and len(self._buffer) < self.buffer_size:
                self._read()
            elif self._buffer:
                pick = int(torch.randint(len(self._buffer), (), generator=self._generator))
                self._buffer[pick], self._buffer[-1] = self._buffer[-1], self._buffer[pick]
                return self._buffer.pop()
            elif self._packed == 0:
                raise ConfigError(
                    f"dataset: process {self.rank}'s share of the stream gives no block of block_size "
                    f"{self.block_size} tokens: too little text for this world size"
                )
            else:
                self._start_epoch(self._epoch + 1)

    def _start_epoch(self, epoch: int, source_state: dict | None = None) -> None:
        self._epoch = epoch
        self._packed = 0
        self._source_done = False
        self._buffer = []
        entropy = [*self.seed_entropy, epoch, self.rank]
        seed = np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0]
        self._generator = torch.Generator().manual_seed(int(seed) >> 1)
        self.documents.set_epoch(epoch)
        if source_state is not None:  # takes effect at the next iter(), for this epoch only
            self.documents.load_state_dict(source_state)
        self._source_state = source_state
        self._documents = iter(self.documents)

    def _read(self) -> None:
        rows = []
        try:
            for document in self._documents:
                rows.append(document)
                if len(rows) == DOCUMENTS_PER_READ:
                    break
            else:
                self._source_done = True
        except (
            Exception
        ) as e:  # a malformed line half-way through a file: one line, not a traceback
            raise unreadable_data(self.dataset, e) from None
        # just after the last row read
        self._source_state = copy.deepcopy(self.documents.state_dict())
        if not rows:
            return
        columns = {key: [row[key] for row in rows] for key in rows[0]}
        blocks = np.asarray(self.pack(columns)["input_ids"])
        ids = [(self._epoch, self._packed + i) for i in range(len(blocks))]
        self._buffer += list(zip(ids, blocks, strict=True))
        self._packed += len(blocks)

    def state_dict(self) -> dict:
        if self._buffer:
            blocks = np.stack([block for _, block in self._buffer])
        else:
            blocks = np.zeros((0, self.block_size))
        return {
            "epoch": self._epoch,
            "packed": self._packed,
            "source_done": self._source_done,
            "source": self._source_state,
            "buffer": torch.from_numpy(blocks.astype(np.int64)),
            "buffer_ids": [list(sample_id) for sample_id, _ in self._buffer],
            "generator": self._generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self._start_epoch(state["epoch"], state["source"])
        self._packed = state["packed"]
        self._source_done = state["source_done"]
        ids = [tuple(sample_id) for sample_id in state["buffer_ids"]]
        self._buffer = list(zip(ids, state["buffer"].numpy(), strict=True))
        self._generator.set_state(state["generator"])


def as_batch(blocks: list[np.ndarray], device) -> dict:
    """Blocks in, the model's inputs on the device out (data.py's collate)."""
    stacked = torch.from_numpy(np.stack(blocks))  # a copy: writable
    batch = task.collate([{"input_ids": block} for block in stacked])
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def stream_batches(train_set, cfg, plumbing):
    """This process's stream of micro-batches: one stream (StreamBatches), or a mixture's
    (MixedStream)."""
    if not cfg.mixture:
        return StreamBatches(train_set, cfg, plumbing)
    streams = {}
    for index, source in enumerate(cfg.mixture):
        documents = train_set.parts[source.name]
        streams[source.name] = StreamBatches(
            documents, source_config(cfg, source), plumbing, source_index=index
        )
    weights = [source.weight for source in cfg.mixture]
    return MixedStream(streams, weights, cfg, plumbing)


class MixedStream:
    """A mixture's streamed sources, one StreamBatches each, drawn in the weights' proportions.
    Sample i of this process's micro-batch m is sample ((m * world_size + rank) * batch_size + i) of
    the run, whose source the mixture's spread fixes (mixture.py): every global batch holds each
    source's share to within a sample or two. A source that runs out starts its next epoch alone. The
    position: micro-batches drawn, and each source's stream state (the same world size to resume)."""

    PASS_STEPS = 1024  # optimizer steps per pass of the spread: the shares are exact over each

    def __init__(self, streams: dict, weights: list[float], cfg, plumbing):
        self.streams = streams
        self.sources = list(streams.values())
        self.drawn = [
            stream for stream, weight in zip(self.sources, weights, strict=True) if weight > 0
        ]
        self.rank = plumbing.process_index
        self.world_size = plumbing.num_processes
        self.batch_size = cfg.batch_size
        self.device = plumbing.device
        samples_per_step = cfg.global_batch(plumbing.num_processes)
        self.labels = spread(apportion(weights, samples_per_step * self.PASS_STEPS))
        self.micro_batches = 0

    @property
    def epoch(self) -> int:
        """Passes completed over every source drawn from (the slowest one's)."""
        return min(stream.epoch for stream in self.drawn)

    def __next__(self) -> dict:
        first = (self.micro_batches * self.world_size + self.rank) * self.batch_size
        blocks = []
        for sample in range(first, first + self.batch_size):
            source = self.labels[sample % len(self.labels)]
            blocks.append(self.sources[source].next_block()[1])
        self.micro_batches += 1
        return as_batch(blocks, self.device)

    def state_dict(self) -> dict:
        sources = {name: stream.state_dict() for name, stream in self.streams.items()}
        return {"micro_batches": self.micro_batches, "sources": sources}

    def load_state_dict(self, state: dict) -> None:
        self.micro_batches = state["micro_batches"]
        for name, stream in self.streams.items():
            stream.load_state_dict(state["sources"][name])
