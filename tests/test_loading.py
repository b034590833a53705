"""The loading procedure (train/batches.py's load_data, build_batches, RunData.first_eval_batch), in
process on the torch plumbing with a faked world: who fills the datasets cache first, the one-step check at
the plumbing's world size, each rank's samples of every micro-batch and of the eval loader, the options the
DataLoaders get, the eval batch that checks the loss contract."""

from contextlib import contextmanager

import datasets
import pytest
import torch

import batches
import task
from errors import ConfigError
from profiling import StartClock
from run_config import config_class
from torch_ddp import TorchDDP

RunConfig = config_class()  # TrainConfig and model.py's and data.py's own keys


class Rank(TorchDDP):
    """The torch plumbing as rank `rank` of `world` sees it (no process group), recording which process
    goes first and every DataLoader it prepares."""

    def __init__(self, cfg, world=1, rank=0):
        super().__init__(cfg)
        self.num_processes, self.process_index = world, rank
        self.events, self.prepared = [], []

    @contextmanager
    def main_process_first(self, first=None):
        self.events.append("job's first process")
        with super().main_process_first(first):
            yield
        self.events.append("after")

    @contextmanager
    def local_main_process_first(self):
        self.events.append("node's first process")
        # TorchDDP's own, not the recording main_process_first above
        with TorchDDP.main_process_first(self, first=self.is_local_main_process):
            yield
        self.events.append("after")

    def prepare(self, *objects):
        self.prepared += objects
        return super().prepare(*objects)


def rows(samples):
    """task.collate's stand-in (independent of data.py): the samples' input_ids, stacked."""
    return {"input_ids": torch.stack([sample["input_ids"] for sample in samples])}


@pytest.fixture
def collate(monkeypatch):
    monkeypatch.setattr(task, "collate", rows)


@pytest.fixture
def clock(monkeypatch):
    """A fresh start clock in place of the process's: the phases build_batches marks."""
    clock = StartClock()
    monkeypatch.setattr(batches, "start_clock", clock)
    return clock


def samples(n, offset=0):
    return [{"input_ids": torch.tensor([offset + i, offset + i + 1])} for i in range(n)]


@pytest.mark.parametrize(
    "shared_filesystem, goes_first",
    [(True, "job's first process"), (False, "node's first process")],
)
def test_load_data_builds_the_datasets_first_on_one_process_per_job_or_per_node(
    monkeypatch, shared_filesystem, goes_first
):
    cfg = RunConfig(
        seed=3,
        dataset="data/x.jsonl",
        batch_size=4,
        grad_accum_steps=2,
        shared_filesystem=shared_filesystem,
    )
    plumbing = Rank(cfg, world=2)
    train, evaluation = samples(16), samples(3, offset=100)

    def build_datasets(given):
        assert given is cfg
        plumbing.events.append("build")
        return train, evaluation

    monkeypatch.setattr(task, "build_datasets", build_datasets)
    data = batches.load_data(cfg, plumbing)
    assert plumbing.events == [goes_first, "build", "after"]
    assert data.train_set is train and data.eval_sets == {"": evaluation}
    # the identity of these 16 samples, under this seed and dataset
    assert (data.identity["seed"], data.identity["dataset"], data.identity["train_blocks"]) == (
        3,
        "data/x.jsonl",
        16,
    )
    other_train = samples(16, offset=1)
    monkeypatch.setattr(task, "build_datasets", lambda given: (other_train, evaluation))
    assert batches.load_data(cfg, plumbing).identity["data_digest"] != data.identity["data_digest"]


def test_load_data_refuses_a_train_set_short_of_one_step_at_the_plumbings_world_size(monkeypatch):
    """2 processes x batch_size 4 x grad_accum_steps 2 = 16 samples a step: 15 is too few (1 process: 8)."""
    cfg = RunConfig(batch_size=4, grad_accum_steps=2)
    monkeypatch.setattr(task, "build_datasets", lambda given: (samples(15), samples(2)))
    assert len(batches.load_data(cfg, Rank(cfg, world=1)).train_set) == 15
    with pytest.raises(ConfigError) as error:
        batches.load_data(cfg, Rank(cfg, world=2))
    assert str(error.value) == (
        "dataset: 15 training samples is too few for one optimizer step at world size 2 x batch_size 4 x "
        "grad_accum_steps 2 = 16 samples"
    )


def blocks(n):
    """n packed blocks, row i = [i, 100 + i]: what the shipped data.py makes (the fast reader's kind)."""
    return datasets.Dataset.from_dict({"input_ids": [[i, 100 + i] for i in range(n)]})


def test_each_rank_of_two_gets_its_share_of_every_micro_batch_in_the_documented_order(
    collate, clock
):
    """40 blocks, batch_size 3, grad_accum_steps 2, a world of 2: 12 samples a step, 3 whole steps (36
    samples) an epoch, each a permutation seeded by seed + epoch (EpochSampler's docstring). Micro-batch m
    holds samples 6m .. 6m + 5 of the epoch's order; rank r the 3 from 6m + 3r (Accelerate's split)."""
    cfg = RunConfig(seed=7, batch_size=3, grad_accum_steps=2, num_workers=0)
    train = blocks(40)
    for rank in range(2):
        plumbing = Rank(cfg, world=2, rank=rank)
        stream, _ = batches.build_batches(cfg, plumbing, batches.RunData(train, {"": []}, {}))
        drawn = [next(stream)["input_ids"].tolist() for _ in range(8)]  # 6 of epoch 0, 2 of epoch 1
        expected = []
        for epoch in (0, 1):
            order = torch.randperm(40, generator=torch.Generator().manual_seed(7 + epoch)).tolist()
            for m in range(6):
                share = order[6 * m + 3 * rank : 6 * m + 3 * rank + 3]
                expected.append([[i, 100 + i] for i in share])
        assert drawn == expected[:8], rank
        assert stream.state_dict() == {"micro_batches": 8, "samples_per_micro_batch": 6}
        assert stream.epoch == 8 * 6 / 36
    assert list(clock.phases) == ["data"]  # the restart report's start_data_s


def test_the_dataloaders_get_the_runs_loader_options(collate):
    cfg = RunConfig(seed=11, batch_size=3, grad_accum_steps=2, num_workers=0)
    plumbing = Rank(cfg, world=2)
    evaluation = samples(10, offset=1000)
    stream, _ = batches.build_batches(
        cfg, plumbing, batches.RunData(blocks(40), {"": evaluation}, {})
    )
    eval_loader, train_loader = plumbing.prepared  # the eval loaders are prepared first
    assert isinstance(train_loader.dataset, batches.ArrowBlocks)  # plain blocks: the fast reader
    assert train_loader.sampler is stream.sampler and len(stream.sampler) == 36
    assert train_loader.drop_last is True and eval_loader.drop_last is False  # eval: every sample
    assert eval_loader.dataset is evaluation
    for loader in (train_loader, eval_loader):
        assert loader.batch_size == 3 and loader.num_workers == 0 and loader.collate_fn is rows
        assert loader.generator.initial_seed() == 11


def test_each_rank_evaluates_its_share_of_each_eval_set_padded_to_whole_batches(collate):
    """10 eval samples, batch_size 3, a world of 2: global batches of 6; rank 0 gets samples 0-2 and 6-8,
    rank 1 samples 3-5 and 9, completed with the pass's first two (0, 1), as Accelerate pads."""
    cfg = RunConfig(batch_size=3, grad_accum_steps=2, num_workers=0)
    evaluation = {"a": samples(10, offset=1000), "b": samples(4, offset=2000)}
    shares = {0: [[0, 1, 2], [6, 7, 8]], 1: [[3, 4, 5], [9, 0, 1]]}
    for rank, expected in shares.items():
        _, eval_loaders = batches.build_batches(
            cfg, Rank(cfg, world=2, rank=rank), batches.RunData(blocks(40), evaluation, {})
        )
        assert list(eval_loaders) == ["a", "b"]
        seen = [batch["input_ids"][:, 0].tolist() for batch in eval_loaders["a"]]
        assert seen == [[1000 + i for i in batch] for batch in expected], rank
        assert [batch["input_ids"][:, 0].tolist() for batch in eval_loaders["b"]] == [
            [2000, 2001, 2002] if rank == 0 else [2003, 2000, 2001]
        ]


@pytest.mark.shipped  # the shipped data.py's stream of documents
def test_a_streamed_run_draws_each_process_its_own_micro_batches_of_blocks(tmp_path, clock):
    from conftest import write_corpus
    from run_config import load_config
    from streaming import StreamBatches

    corpus = write_corpus(tmp_path / "corpus.jsonl", n_docs=40)
    cfg = load_config(
        ["--dataset", str(corpus), "--streaming", "true", "--block_size", "16"]
        + ["--batch_size", "2", "--shuffle_buffer", "8", "--streaming_eval_blocks", "4"]
    )
    documents, evaluation = task.build_datasets(cfg)
    plumbing = Rank(cfg, world=2, rank=1)
    stream, eval_loaders = batches.build_batches(
        cfg, plumbing, batches.RunData(documents, {"": evaluation}, {})
    )
    assert isinstance(stream, StreamBatches) and stream.rank == 1 and stream.dataset == str(corpus)
    assert next(stream)["input_ids"].shape == (2, 16)  # batch_size x block_size
    # rank 1 of 2 evaluates eval blocks 2 and 3 of the 4
    (eval_batch,) = list(eval_loaders[""])
    assert eval_batch["input_ids"].tolist() == [evaluation[i]["input_ids"].tolist() for i in (2, 3)]
    assert list(clock.phases) == ["data"]


def test_the_first_eval_batch_is_the_first_sources_first_two_samples_on_the_device(collate):
    evaluation = {"a": samples(5, offset=10), "b": samples(5, offset=20)}
    data = batches.RunData(None, evaluation, {})
    batch = data.first_eval_batch(torch.device("meta"))  # a device other than the samples'
    assert list(batch) == ["input_ids"] and batch["input_ids"].device.type == "meta"
    assert data.first_eval_batch("cpu")["input_ids"].tolist() == [[10, 11], [11, 12]]
    one = batches.RunData(None, {"": samples(1, offset=7)}, {})  # fewer than two: what there is
    assert one.first_eval_batch("cpu")["input_ids"].tolist() == [[7, 8]]
