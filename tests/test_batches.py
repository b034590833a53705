"""The data order both plumbings share (train/batches.py), for any dataset: a seeded permutation per epoch,
Accelerate's split of every global batch, and a resume on another world size."""

from types import SimpleNamespace

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
    # the fork's own identity of the train set, as text
    monkeypatch.setattr(task, "data_identity", lambda dataset: 1000 + len(dataset))
    assert batches.data_identity(RunConfig(seed=3), samples)["data_digest"] == "1005"
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


def test_a_mixtures_identity_is_the_runs_seed_the_shares_and_each_sources_own_under_its_name():
    from mixture import Concatenation
    from sources import parse_dataset

    cfg = RunConfig(seed=4, dataset=parse_dataset("x/a.jsonl:3,y/b.jsonl:1"))
    parts = Concatenation({"a": [1, 2, 3], "b": [4, 5]})
    identity = batches.data_identity(cfg, parts)
    assert sorted(identity) == [
        "a/data_digest",
        "a/dataset",
        "a/train_blocks",
        "b/data_digest",
        "b/dataset",
        "b/train_blocks",
        "dataset",
        "seed",
    ]
    assert identity["seed"] == 4 and identity["dataset"] == "x/a.jsonl:0.75,y/b.jsonl:0.25"
    assert (identity["a/dataset"], identity["a/train_blocks"]) == ("x/a.jsonl", 3)
    assert (identity["b/dataset"], identity["b/train_blocks"]) == ("y/b.jsonl", 2)


def test_a_streamed_hub_dataset_is_identified_by_its_revision_a_local_one_by_its_files(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(batches, "hub_revision", lambda name: f"the commit of {name}")
    hub = RunConfig(dataset="owner/name", streaming=True)
    identity = batches.data_identity(hub, None)
    assert identity["stream_revision"] == "the commit of owner/name"
    assert identity["stream_files"] is None
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a"}\n')
    local = batches.data_identity(RunConfig(dataset=str(corpus), streaming=True), None)
    assert local["stream_revision"] is None and local["stream_files"] is not None


def test_the_hub_revision_is_asked_for_the_name_within_5_seconds_and_none_when_unknown(
    monkeypatch,
):
    import huggingface_hub

    asked = []

    class Hub:
        def dataset_info(self, repo_id, *, revision=None, timeout=None, files_metadata=False):
            asked.append((repo_id, timeout))
            return SimpleNamespace(sha="0123abcd")

    monkeypatch.setattr(huggingface_hub, "HfApi", Hub)
    assert batches.hub_revision("owner/name") == "0123abcd" and asked == [("owner/name", 5)]

    class Offline:
        def dataset_info(self, repo_id, *, timeout=None):
            raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "HfApi", Offline)
    assert batches.hub_revision("owner/name") is None


def test_a_streamed_folders_files_count_by_their_path_in_it_size_and_content(tmp_path):
    import shutil

    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.jsonl").write_text('{"text": "alpha"}\n')
    (folder / "sub" / "b.txt").write_text("beta\n")
    (folder / "notes.md").write_text("not data\n")
    before = batches.stream_files(str(folder))
    # the same files elsewhere: the same digest (names within the folder)
    shutil.copytree(folder, tmp_path / "elsewhere")
    assert batches.stream_files(str(tmp_path / "elsewhere")) == before
    (folder / "notes.md").write_text("no data file: not counted\n")
    assert batches.stream_files(str(folder)) == before
    (folder / "sub" / "b.txt").write_text("bet4\n")  # the same size, another content
    changed = batches.stream_files(str(folder))
    assert changed != before
    (folder / "sub2").mkdir()
    (folder / "sub" / "b.txt").rename(folder / "sub2" / "b.txt")  # the same name, another path
    assert batches.stream_files(str(folder)) not in (before, changed)
    # one file: its name counts too
    one = tmp_path / "one.txt"
    one.write_text("gamma\n")
    digest = batches.stream_files(str(one))
    one.rename(tmp_path / "two.txt")
    assert batches.stream_files(str(tmp_path / "two.txt")) != digest


MIB = 1 << 20


def test_a_file_over_the_limit_is_sampled_in_evenly_spaced_mib_pieces(tmp_path):
    """4 MiB of distinct 4-byte words: 4 pieces of 1 MiB tile it (at 0, 1, 2, 3 MiB); 3 pieces start at 0,
    (4 - 1) / 2 = 1.5 and 3 MiB; a file of exactly the limit is read whole."""
    file = tmp_path / "words.bin"
    content = np.arange(MIB, dtype="<u4").tobytes()
    file.write_bytes(content)
    size = 4 * MIB
    assert batches.sampled_content(file, size, whole_up_to=MIB, pieces=4) == content
    three = batches.sampled_content(file, size, whole_up_to=size - 1, pieces=3)
    half = 3 * MIB // 2
    assert three == content[:MIB] + content[half : half + MIB] + content[3 * MIB :]
    assert batches.sampled_content(file, size, whole_up_to=size, pieces=3) == content


def test_a_file_over_64_mib_is_sampled_as_16_pieces_of_1_mib_from_its_start_to_its_end(tmp_path):
    """A sparse file of 76 MiB (nothing written but a marker at each MiB): 16 pieces evenly spaced from 0
    to 75 MiB start every (76 - 1) / 15 = 5 MiB, at MiB 0, 5, ..., 75."""
    file = tmp_path / "sparse.bin"
    with open(file, "wb") as f:
        f.truncate(76 * MIB)
        for mib in range(76):
            f.seek(mib * MIB)
            f.write(b"MiB %02d" % mib)
    pieces = [b"MiB %02d" % (5 * k) + bytes(MIB - 6) for k in range(16)]
    assert batches.sampled_content(file, 76 * MIB) == b"".join(pieces)


def int_chunks(*chunks, column="x"):
    """A dataset whose int64 column is stored in one Arrow chunk per argument (8 bytes a value)."""
    import datasets

    return datasets.concatenate_datasets(
        [datasets.Dataset.from_dict({column: list(chunk)}) for chunk in chunks]
    )


def test_content_digest_sees_a_selected_views_rows_and_order_and_the_column_names():
    digest = batches.content_digest
    dataset = int_chunks([0, 1], [2, 3])
    assert digest(dataset.select([0, 2, 1])) != digest(dataset.select([2, 0, 1]))
    assert digest(dataset.select([0, 2, 1])) != digest(dataset.select([0, 3, 1]))
    assert digest(dataset) != digest(int_chunks([0, 1], [2, 3], column="y"))  # the same buffers


def test_content_digest_over_its_budget_hashes_one_chunk_in_every_total_over_budget():
    """4 chunks of 16 bytes, 64 in all: within a budget of 64 every chunk counts; over a budget of 32,
    chunks 0 and 2 (one in every 64 / 32 = 2)."""
    digest = batches.content_digest
    base = int_chunks([0, 1], [2, 3], [4, 5], [6, 7])
    second_changed = int_chunks([0, 1], [2, 9], [4, 5], [6, 7])
    third_changed = int_chunks([0, 1], [2, 3], [4, 9], [6, 7])
    assert digest(second_changed, budget_bytes=64) != digest(base, budget_bytes=64)
    assert digest(second_changed, budget_bytes=32) == digest(base, budget_bytes=32)
    assert digest(third_changed, budget_bytes=32) != digest(base, budget_bytes=32)


def image_columns(tmp_path):
    """Two image columns: cells that name a file, one that holds its bytes, empty ones."""
    import datasets

    a, b = tmp_path / "a.png", tmp_path / "b.png"
    a.write_bytes(b"aaaa")
    b.write_bytes(b"bbbb")
    named = {"path": str(a), "bytes": None}
    features = datasets.Features({"image": datasets.Image(), "mask": datasets.Image()})
    columns = {
        "image": [named, {"path": "held.png", "bytes": b"held"}, None],
        "mask": [{"path": str(b), "bytes": None}, None, named],
    }
    return datasets.Dataset.from_dict(columns, features=features), a, b


def test_image_columns_that_name_files_count_those_files(tmp_path):
    dataset, a, b = image_columns(tmp_path)
    # column by column: a (the held bytes and the empty cell name none), then b and a
    assert batches.named_files(dataset) == [str(a), str(b), str(a)]
    before = batches.content_digest(dataset)
    b.write_bytes(b"bbbc")
    assert batches.content_digest(dataset) != before


def test_files_digest_over_its_budget_reads_one_file_in_every_total_over_budget_rounded_up(
    tmp_path,
):
    """6 files of 4 bytes, 24 in all, a budget of 10: one file in every 3 (24 / 10 = 2.4, rounded up):
    files 0 and 3."""
    files = []
    for index in range(6):
        files.append(tmp_path / f"{index}.png")
        files[-1].write_bytes(b"%4d" % index)
    names = [str(file) for file in files]
    before = batches.files_digest(names, budget_bytes=10)
    for unread in (1, 2, 4, 5):
        files[unread].write_bytes(b"none")
    assert batches.files_digest(names, budget_bytes=10) == before
    files[3].write_bytes(b"read")
    assert batches.files_digest(names, budget_bytes=10) != before


def test_sample_digest_of_a_large_dataset_samples_every_size_over_4096th_and_counts_the_size():
    """8192 samples: by default 4096 of them, every second (0, 2, ...)."""
    digest = batches.sample_digest
    base = list(range(8192))
    odd_changed, even_changed = base.copy(), base.copy()
    odd_changed[1] = even_changed[2] = -1
    assert digest(odd_changed) == digest(base) != digest(even_changed)
    # the same values, one sample of 12 or two of 1 and 2: the size tells them apart
    assert digest([12]) != digest([1, 2])


def test_loader_workers_leave_the_stop_signals_to_this_process():
    """With workers, the loader's options carry stopping.py's worker init (this process as the trainer)
    and a start method's context; without, neither (DataLoader refuses a context without workers)."""
    import os

    import stopping

    options = batches.loader_options(RunConfig(num_workers=2))
    init = options["worker_init_fn"]
    assert init.func is stopping.loader_worker_leaves_stops_to_its_trainer
    assert init.args == (os.getpid(),) and options["multiprocessing_context"] is not None
    assert options["num_workers"] == 2
    without = batches.loader_options(RunConfig(num_workers=0))
    assert "worker_init_fn" not in without and "multiprocessing_context" not in without


def test_loss_weights_are_float64_on_the_plumbings_device(monkeypatch):
    """On the device the all-reduce needs (NCCL's: a GPU); the meta device stands in for one here."""
    import task

    plumbing = SimpleNamespace(
        device=torch.device("meta"), num_processes=1, reduce=lambda tensor, op: tensor
    )
    micro_batches = [{"counted": torch.tensor(3)}, {"counted": torch.tensor(5)}]
    monkeypatch.setattr(task, "loss_counter", lambda: lambda batch: batch["counted"])
    counted = batches.loss_weights(micro_batches, plumbing)
    monkeypatch.setattr(task, "loss_counter", lambda: None)  # a task without loss_items: ones
    ones = batches.loss_weights(micro_batches, plumbing)
    for weights in (counted, ones):
        assert weights.shape == (2,) and weights.dtype == torch.float64
        assert weights.device.type == "meta"
