"""The data order both plumbings share (train/batches.py), for any dataset: a seeded permutation per epoch,
Accelerate's split of every global batch, and a resume on another world size."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import batches
from run_config import config_class
from torch_ddp import RankBatches, TorchDDP

RunConfig = config_class()  # TrainConfig and model.py's and data.py's own keys


def test_epoch_sampler_is_a_seeded_permutation_per_epoch_cut_to_whole_global_batches():
    sampler = batches.EpochSampler(50, seed=7, samples_per_step=8)
    epoch0 = list(sampler)
    assert len(epoch0) == len(sampler) == 48 and len(set(epoch0)) == 48 and list(sampler) == epoch0
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert (
        epoch1 != epoch0 and len(set(epoch1)) == 48 and set(epoch0) | set(epoch1) == set(range(50))
    )


def test_start_next_pass_at_skips_into_one_pass_only():
    sampler = batches.EpochSampler(50, seed=7, samples_per_step=10)
    sampler.set_epoch(3)
    full = list(sampler)
    sampler.start_next_pass_at(20)
    assert list(sampler) == full[20:]
    assert list(sampler) == full  # once


@pytest.mark.parametrize(
    "n, batch, world, drop_last",
    [
        (103, 4, 2, True),
        (103, 4, 2, False),
        (50, 4, 3, False),
        (5, 4, 2, False),
        (48, 4, 3, False),
        (64, 8, 4, True),
    ],
)
def test_the_torch_path_splits_batches_exactly_as_accelerate(n, batch, world, drop_last):
    """RankBatches against Accelerate's own BatchSamplerShard (what accelerator.prepare uses): the same
    indices in the same order on every rank, padding included, and the same count of real samples."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    sampler = batches.EpochSampler(n, seed=3, samples_per_step=1)
    for rank in range(world):
        ours = RankBatches(sampler, batch, world, rank, drop_last)
        theirs = BatchSamplerShard(BatchSampler(sampler, batch, drop_last), world, rank)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)
    expected_real = None if drop_last or n % (batch * world) == 0 else n % (batch * world)
    assert ours.real_samples_in_last == expected_real


def global_steps(world, batch, accum, steps, start=None, n=90, seed=5):
    """The samples of each optimizer step (all ranks, all micro-steps), through TrainBatches on every rank
    of a world of `world` (each rank's TorchDDP loader, without a process group); `start` resumes from a
    TrainBatches state_dict."""
    global_batch = world * batch * accum
    streams = []
    for rank in range(world):
        plumbing = TorchDDP(RunConfig(batch_size=batch, grad_accum_steps=accum))
        plumbing.num_processes, plumbing.process_index = world, rank  # this rank's view
        sampler = batches.EpochSampler(n, seed, global_batch)
        loader = plumbing.prepare(
            DataLoader(
                torch.arange(n),
                batch_size=batch,
                sampler=sampler,
                drop_last=True,
                collate_fn=lambda ids: {"ids": torch.stack(ids)},
            )
        )
        streams.append(batches.TrainBatches(loader, sampler, batch * world))
        if start is not None:
            streams[-1].load_state_dict(start)
    steps_seen = [
        sorted(torch.cat([next(s)["ids"] for _ in range(accum) for s in streams]).tolist())
        for _ in range(steps)
    ]
    return steps_seen, streams[0].state_dict()


def test_a_resume_on_another_world_size_continues_with_the_same_samples_in_every_step():
    # 90 // 16 = 5 steps an epoch
    uninterrupted, _ = global_steps(world=2, batch=8, accum=1, steps=14)
    _, position = global_steps(world=2, batch=8, accum=1, steps=7)
    assert position == {"micro_batches": 7, "samples_per_micro_batch": 16}
    for world, batch, accum in [(4, 4, 1), (1, 16, 1), (1, 8, 2), (2, 2, 4)]:
        resumed, _ = global_steps(world, batch, accum, steps=7, start=position)
        assert resumed == uninterrupted[7:], (world, batch, accum)
    with pytest.raises(ValueError, match="global batch changed"):
        global_steps(
            world=1,
            batch=6,
            accum=1,
            steps=1,
            start={"micro_batches": 1, "samples_per_micro_batch": 16},
        )


# ---------------------------------------------------------------- the order, the reader, the identity


def documented_order(num_samples, seed, samples_per_step, epoch):
    """EpochSampler's order as its docstring states it: a permutation seeded by seed + epoch, cut to whole
    global batches."""
    permutation = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch))
    return permutation[: num_samples - num_samples % samples_per_step].tolist()


class EpochLoader:
    """What TrainBatches needs of a loader: set_epoch passed on to the sampler, micro-batches of 2."""

    def __init__(self, sampler):
        self.sampler = sampler

    def set_epoch(self, epoch):
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        order = list(self.sampler)
        return iter([order[i : i + 2] for i in range(0, len(order), 2)])


def test_the_order_is_the_documented_permutation_of_seed_plus_epoch():
    sampler = batches.data_order(RunConfig(seed=7), list(range(50)), samples_per_step=8)
    for epoch in (0, 2):
        sampler.set_epoch(epoch)
        assert list(sampler) == documented_order(50, 7, 8, epoch)


def test_train_batches_continue_from_any_position_through_the_following_epochs():
    """A resume in the middle of epoch 2 (samples 0-11 are one epoch of 12 of 13): the rest of epoch 2, then
    all of epoch 3, as the documented order has them; its state converts to another micro-batch size."""
    sampler = batches.EpochSampler(13, seed=5, samples_per_step=4)
    stream = batches.TrainBatches(EpochLoader(sampler), sampler, samples_per_micro_batch=2)
    stream.load_state_dict({"micro_batches": 4, "samples_per_micro_batch": 7})  # 28 = 2 epochs + 4
    assert stream.micro_batches == 14 and stream.epoch == 28 / 12
    expected = documented_order(13, 5, 4, 2)[4:] + documented_order(13, 5, 4, 3)
    seen = [next(stream) for _ in range(10)]
    assert sum(seen, []) == expected
    assert stream.state_dict() == {"micro_batches": 24, "samples_per_micro_batch": 2}
    with pytest.raises(
        ValueError, match="^6 samples consumed is not a whole number of micro-batches of 4"
    ):
        batches.TrainBatches(EpochLoader(sampler), sampler, 4).load_state_dict(
            {"micro_batches": 3, "samples_per_micro_batch": 2}
        )


def test_too_few_samples_for_one_step_is_one_line_and_a_stream_is_not_counted():
    cfg = RunConfig(batch_size=4, grad_accum_steps=2)
    batches.check_data_size(list(range(16)), cfg, num_processes=2)  # exactly one step
    with pytest.raises(Exception) as error:
        batches.check_data_size(list(range(15)), cfg, num_processes=2)
    assert str(error.value) == (
        "dataset: 15 training samples is too few for one optimizer step at world size 2 x batch_size 4 x "
        "grad_accum_steps 2 = 16 samples"
    )
    batches.check_data_size(
        list(range(15)), RunConfig(batch_size=4, grad_accum_steps=2, streaming=True), 2
    )


def test_loader_options_seed_the_workers_apart_from_dropout():
    import task

    options = batches.loader_options(RunConfig(batch_size=3, num_workers=0, seed=11))
    assert options["batch_size"] == 3 and options["num_workers"] == 0
    assert options["collate_fn"] is task.collate and options["pin_memory"] is False
    assert options["generator"].initial_seed() == 11


def blocks_in_two_chunks():
    import datasets

    first = datasets.Dataset.from_dict({"input_ids": [[i, i + 1, i + 2] for i in range(0, 12, 3)]})
    second = datasets.Dataset.from_dict(
        {"input_ids": [[i, i + 1, i + 2] for i in range(100, 109, 3)]}
    )
    return datasets.concatenate_datasets([first, second])  # 4 + 3 rows in two Arrow chunks


def test_arrow_blocks_read_every_row_across_chunks_as_the_dataset_does():
    import pickle

    dataset = blocks_in_two_chunks()
    assert len(dataset.data.table.column("input_ids").chunks) == 2
    reader = batches.fast_reader(dataset)
    assert isinstance(reader, batches.ArrowBlocks) and len(reader) == 7
    order = [6, 0, 4, 3, 5, 1, 2]
    read = reader.__getitems__(order)
    assert [sample["input_ids"].tolist() for sample in read] == [
        dataset[i]["input_ids"] for i in order
    ]
    assert all(sample["input_ids"].dtype == torch.int64 for sample in read)
    assert reader[4]["input_ids"].tolist() == [100, 101, 102]
    copied = pickle.loads(pickle.dumps(reader))  # to a loader worker: the dataset, no views
    assert copied._views is None and copied[6]["input_ids"].tolist() == [106, 107, 108]


def test_fast_reader_takes_only_plain_blocks_in_storage_order():
    dataset = blocks_in_two_chunks()
    selected = dataset.select([1, 0])
    assert batches.fast_reader(selected) is selected
    labelled = dataset.add_column("labels", list(range(7)))
    assert batches.fast_reader(labelled) is labelled
    plain = [{"input_ids": torch.tensor([1])}]
    assert batches.fast_reader(plain) is plain


def test_the_identity_of_one_dataset_holds_what_a_resume_must_find_unchanged(tmp_path, monkeypatch):
    import task

    samples = [{"input_ids": torch.tensor([i, i + 1])} for i in range(5)]
    identity = batches.data_identity(RunConfig(seed=3, dataset="data/x.jsonl"), samples)
    assert identity == {
        "seed": 3,
        "dataset": "data/x.jsonl",
        "train_blocks": 5,
        "data_digest": batches.sample_digest(samples),
    }
    monkeypatch.setattr(
        task, "data_identity", lambda dataset: 1234
    )  # the fork's own identity, as text
    assert batches.data_identity(RunConfig(seed=3), samples)["data_digest"] == "1234"
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a"}\n')
    streamed = RunConfig(
        seed=3, dataset=str(corpus), streaming=True, shuffle_buffer=64, tokenizer="bytes"
    )
    assert batches.data_identity(streamed, None) == {
        "seed": 3,
        "dataset": str(corpus),
        "streaming": True,
        "tokenizer": "bytes",
        "shuffle_buffer": 64,
        "stream_files": batches.stream_files(str(corpus)),
        "stream_revision": None,  # a local file has no hub revision
    }
    assert (
        batches.stream_files(str(corpus)) is not None and batches.stream_files("owner/name") is None
    )


def test_sample_digest_sees_every_value_and_not_the_key_order():
    def digest(samples):
        return batches.sample_digest(samples)

    base = [{"a": torch.tensor([1, 2]), "b": 1}, {"a": torch.tensor([3, 4]), "b": 0}]
    assert digest(base) == digest(
        [{"b": 1, "a": torch.tensor([1, 2])}, {"b": 0, "a": torch.tensor([3, 4])}]
    )
    changed = [
        # a tensor's value
        [{"a": torch.tensor([1, 2]), "b": 1}, {"a": torch.tensor([3, 5]), "b": 0}],
        [{"a": torch.tensor([1, 2]), "b": 1}, {"a": torch.tensor([3, 4]), "b": 2}],  # a label
        [{"a": torch.tensor([1, 2]), "c": 1}, {"a": torch.tensor([3, 4]), "b": 0}],  # a key
        base[:1],  # a sample fewer
        [{"a": [1, (2, 3)], "b": 1}, {"a": [3, (4, 5)], "b": 0}],  # nested lists: every item
    ]
    digests = {digest(samples) for samples in changed}
    assert digest(base) not in digests and len(digests) == len(changed)
    assert digest([{"a": [1, (2, 3)]}]) != digest([{"a": [1, (2, 4)]}])
    assert digest([{"a": np.array([1, 2])}]) != digest([{"a": np.array([1, 3])}])
    assert batches.sample_digest(iter([1, 2])) == "list_iterator"  # no len(): its type's name

    class Large(torch.utils.data.Dataset):
        def __init__(self, changed_at=None):
            self.changed_at = changed_at

        def __len__(self):
            return 100

        def __getitem__(self, index):
            return index + 1000 * (index == self.changed_at)

    assert batches.sample_digest(Large(), most=10) == batches.sample_digest(
        Large(changed_at=1), most=10
    )
    assert batches.sample_digest(Large(), most=10) != batches.sample_digest(
        Large(changed_at=20), most=10
    )


def test_files_digest_names_sizes_and_contents(tmp_path):
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    a.write_bytes(b"1234")
    b.write_bytes(b"5678")
    files = [str(a), str(b)]
    before = batches.files_digest(files, budget_bytes=1 << 20)
    b.write_bytes(b"5679")  # the same size, another content
    assert batches.files_digest(files, budget_bytes=1 << 20) != before
    # over the budget: every file's name and size, the contents of one in every 2 (a's)
    sampled = batches.files_digest(files, budget_bytes=4)
    b.write_bytes(b"5670")
    assert batches.files_digest(files, budget_bytes=4) == sampled
    a.write_bytes(b"1235")
    assert batches.files_digest(files, budget_bytes=4) != sampled
    b.write_bytes(b"56700")
    assert batches.files_digest(files, budget_bytes=4) != sampled
