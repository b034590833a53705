"""A weighted mixture of datasets (--dataset a.jsonl:0.7,b.jsonl:0.3; sources.py parses it).

Each source is built by data.py on its own, as if it were the only dataset (sources.source_config),
so a fork's data.py needs nothing new. Which source each training sample comes from is fixed by
the weights alone, before any data is read:

- The run is cut into passes (map-style: of about the sources' total size, in whole global
  batches; streamed: of MixedStream.PASS_STEPS steps). Each source gets a whole-number quota of every pass, its
  weight's share rounded by largest remainder, so over each pass the shares are exact.
- Within a pass the sources' samples are spread evenly (`spread`: the k-th sample of a source
  of quota q sits at (k + 1/2) / q of the pass): after any n samples, each source's count is
  within (S + 1) / 2 of n * weight for S sources, and every global batch holds its share to within
  a sample or two (tests/test_mixture.py).
- A source's own samples come in a fresh permutation per epoch of that source, seeded by (seed,
  source, its epoch). A source that runs out starts its next epoch alone; the others go on.

So sample n of the run is a pure function of (seed, weights, sizes, n), as with EpochSampler: a
resume needs only the number of samples consumed (TrainBatches' one number), on any world size
with the same global batch. Streamed sources use the same spread in streaming.MixedStream."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Sampler

from sources import source_config


def build_data(cfg, build_datasets) -> tuple:
    """(train, {source name: eval set}) from data.py's build_datasets: for one dataset its own
    pair, the eval set under the name ""; for a mixture, each source's, with the training sets
    joined (map-style: a Concatenation; streaming: a Streams of the document streams)."""
    if not cfg.mixture:
        train, evaluation = build_datasets(cfg)
        return train, {"": evaluation}
    trains, evaluations = {}, {}
    for source in cfg.mixture:
        trains[source.name], evaluations[source.name] = build_datasets(source_config(cfg, source))
    if cfg.streaming:
        return Streams(trains), evaluations
    return Concatenation(trains), evaluations


def apportion(weights: list[float], total: int) -> list[int]:
    """`total` split in proportion to `weights` in whole numbers (largest remainder: each share
    within one of its exact value, the sum exact)."""
    exact = np.asarray(weights, dtype=np.float64) / sum(weights) * total
    shares = np.floor(exact).astype(np.int64)
    by_remainder = np.argsort(-(exact - shares), kind="stable")
    shares[by_remainder[: total - int(shares.sum())]] += 1
    return shares.tolist()


def spread(quotas: list[int]) -> np.ndarray:
    """The source of each sample of a pass: source s's k-th sample at (k + 1/2) / quotas[s] of the
    pass (ties to the first source), so every stretch of the pass holds each source's share to
    within a sample or two."""
    due = np.concatenate([(np.arange(quota) + 0.5) / quota for quota in quotas])
    labels = np.concatenate([np.full(quota, s, dtype=np.int64) for s, quota in enumerate(quotas)])
    return labels[np.argsort(due, kind="stable")]


class MixtureSampler(Sampler[int]):
    """EpochSampler's interface (set_epoch, start_next_pass_at, len) over a Concatenation: each
    "epoch" is one pass of the mixture (module docstring); yields indices into the
    concatenation."""

    def __init__(self, sizes: list[int], weights: list[float], seed: int, samples_per_step: int):
        self.sizes = sizes
        self.offsets = np.cumsum([0, *sizes])[:-1]
        self.seed = seed
        self.epoch = 0
        self._start = 0
        whole_steps = max(1, sum(sizes) // samples_per_step)
        self.num_samples = whole_steps * samples_per_step
        self.quotas = apportion(weights, self.num_samples)
        labels = spread(self.quotas)
        self._places = [np.flatnonzero(labels == s) for s in range(len(sizes))]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def start_next_pass_at(self, sample: int) -> None:
        self._start = sample

    def __iter__(self):
        order = self.pass_order(self.epoch)
        start = self._start
        self._start = 0
        return iter(order[start:].tolist())

    def __len__(self) -> int:
        return self.num_samples

    def pass_order(self, pass_index: int) -> np.ndarray:
        """The concatenation's indices of one pass, in order."""
        order = np.empty(self.num_samples, dtype=np.int64)
        for s, (size, quota) in enumerate(zip(self.sizes, self.quotas, strict=True)):
            # the source's draws in this pass, counted from the start of the run
            drawn = pass_index * quota + np.arange(quota)
            epochs = drawn // size
            for epoch in np.unique(epochs):
                mine = epochs == epoch
                picked = self.permutation(s, int(epoch))[drawn[mine] % size]
                order[self._places[s][mine]] = self.offsets[s] + picked
        return order

    def permutation(self, source: int, epoch: int) -> np.ndarray:
        seed = np.random.SeedSequence([self.seed, source, epoch]).generate_state(1, np.uint64)[0]
        generator = torch.Generator().manual_seed(int(seed) >> 1)
        return torch.randperm(self.sizes[source], generator=generator).numpy()


class Concatenation(torch.utils.data.Dataset):
    """The sources' training sets one after another, by name; a batch of indices is read from
    each source in one call (ArrowBlocks' fast path)."""

    def __init__(self, parts: dict):
        self.parts = parts
        self._datasets = list(parts.values())
        self._starts = np.cumsum([0, *(len(part) for part in self._datasets)])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list:
        indices = np.asarray(indices)
        part_of = np.searchsorted(self._starts, indices, side="right") - 1
        samples = [None] * len(indices)
        for part in np.unique(part_of):
            places = np.flatnonzero(part_of == part)
            local = (indices[places] - self._starts[part]).tolist()
            dataset = self._datasets[part]
            if hasattr(dataset, "__getitems__"):
                read = dataset.__getitems__(local)
            else:
                read = [dataset[i] for i in local]
            for place, sample in zip(places, read, strict=True):
                samples[place] = sample
        return samples

    def with_parts(self, convert) -> Concatenation:
        """The same concatenation with `convert` applied to each part (a faster reader)."""
        return Concatenation({name: convert(part) for name, part in self.parts.items()})


class Streams:
    """The sources' document streams, by name (streaming.MixedStream reads them)."""

    def __init__(self, parts: dict):
        self.parts = parts
