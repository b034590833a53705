"""Streaming (`--streaming true`): a corpus read as a stream, for text bigger than memory or disk.

Each process reads its own share of the documents (datasets' `split_dataset_by_node`: whole files when their
number divides by the world size, else every world_size-th document), so no document is trained on twice in an
epoch and none is left out. It tokenizes them on the fly (data.token_stream, the map-style path's tokenizer),
packs the tokens into blocks, and draws blocks at random from a buffer of `shuffle_buffer` blocks whose
generator is seeded by (seed, epoch, rank). At the end of its share a process starts its next epoch alone:
the stream never ends, so no process waits at an epoch boundary for the others.

There is no index to skip by, so the position is the stream's whole state, saved by every process in every
checkpoint: the source's position (datasets' `IterableDataset.state_dict()`), the tokens not yet packed, the
buffer and its generator. A resume continues with exactly the blocks the uninterrupted run would have drawn (its
buffer is restored, not refilled as datasets' own shuffle does); each process owns a share, so it needs the
same world size.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from config import ConfigError
from data import load_tokenizer, token_dtype, token_stream, vocab_size

DOCUMENTS_PER_READ = 64  # documents tokenized together (a fast tokenizer's batch call)


class StreamBatches:
    """This process's endless stream of training micro-batches (next(batches)), and a checkpoint part written by
    every process. Each block drawn has a sample id, (epoch, blocks packed before it by this process)."""

    per_process = True  # <name>_rank{r}.pt
    same_world_size = True  # a resume on another world size cannot continue it exactly

    def __init__(self, documents, cfg, plumbing):
        from datasets.distributed import split_dataset_by_node

        self.documents = split_dataset_by_node(documents, rank=plumbing.process_index,
                                               world_size=plumbing.num_processes)
        self.rank, self.device = plumbing.process_index, plumbing.device
        self.tokenizer, self._dtype = load_tokenizer(cfg.tokenizer_name), token_dtype(vocab_size(cfg))
        self.text_column, self.block_size, self.batch_size = cfg.text_column, cfg.block_size, cfg.batch_size
        self.buffer_size, self.seed = cfg.shuffle_buffer, cfg.seed
        self._start_epoch(0)

    @property
    def epoch(self) -> int:  # this process's completed passes over its share
        return self._epoch

    def __next__(self) -> dict:
        input_ids = torch.from_numpy(np.stack([self.next_block()[1] for _ in range(self.batch_size)])).long()
        input_ids = input_ids.to(self.device, non_blocking=True)
        return {"input_ids": input_ids, "labels": input_ids}

    def next_block(self) -> tuple[tuple[int, int], np.ndarray]:
        """(sample id, block): a random block of the buffer, the buffer topped up from the source first."""
        while True:
            if not self._source_done and len(self._buffer) < self.buffer_size:
                self._read()
            elif self._buffer:
                pick = int(torch.randint(len(self._buffer), (), generator=self._generator))
                self._buffer[pick], self._buffer[-1] = self._buffer[-1], self._buffer[pick]
                return self._buffer.pop()
            elif self._packed == 0:
                raise ConfigError(f"dataset: process {self.rank}'s share of the stream gives no block of "
                                  f"block_size {self.block_size} tokens: too little text for this world size")
            else:
                self._start_epoch(self._epoch + 1)

    def _start_epoch(self, epoch: int, source_state: dict | None = None) -> None:
        self._epoch, self._packed, self._source_done = epoch, 0, False
        self._pending, self._buffer = np.zeros(0, dtype=self._dtype), []
        seed = np.random.SeedSequence([self.seed, epoch, self.rank]).generate_state(1, np.uint64)[0]
        self._generator = torch.Generator().manual_seed(int(seed) >> 1)
        self.documents.set_epoch(epoch)
        if source_state is not None:  # takes effect at the next iter(), for this epoch only
            self.documents.load_state_dict(source_state)
        self._source_state, self._documents = source_state, iter(self.documents)

    def _read(self) -> None:
        texts = []
        for document in self._documents:
            texts.append(document[self.text_column])
            if len(texts) == DOCUMENTS_PER_READ:
                break
        else:
            self._source_done = True  # the tokens left over make no whole block: dropped, as map-style drops them
        self._source_state = copy.deepcopy(self.documents.state_dict())  # just after the last document read
        tokens = np.concatenate([self._pending, token_stream(texts, self.tokenizer)])
        n_blocks = len(tokens) // self.block_size
        blocks = tokens[:n_blocks * self.block_size].reshape(n_blocks, self.block_size)
        self._buffer += [((self._epoch, self._packed + i), block) for i, block in enumerate(blocks)]
        self._packed += n_blocks
        self._pending = tokens[n_blocks * self.block_size:]

    def state_dict(self) -> dict:
        blocks = np.stack([block for _, block in self._buffer]) if self._buffer else np.zeros((0, self.block_size))
        return {"epoch": self._epoch, "packed": self._packed,
                "source_done": self._source_done, "source": self._source_state,
                "pending": torch.from_numpy(self._pending.astype(np.int64)),
                "buffer": torch.from_numpy(blocks.astype(np.int64)),
                "buffer_ids": [list(sample_id) for sample_id, _ in self._buffer],
                "generator": self._generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self._start_epoch(state["epoch"], state["source"])
        self._packed = state["packed"]
        self._source_done, self._pending = state["source_done"], state["pending"].numpy().astype(self._dtype)
        self._buffer = [(tuple(sample_id), block) for sample_id, block
                        in zip(state["buffer_ids"], state["buffer"].numpy().astype(self._dtype), strict=True)]
        self._generator.set_state(state["generator"])
