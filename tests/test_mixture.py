"""Weighted mixtures (train/sources.py, train/mixture.py): the --dataset forms and their one-line errors, the
shares each global batch and each pass get, every source's own epochs, and the order as a pure function of the
position (what an exact resume needs)."""

import json

import numpy as np
import pytest
import torch

import data
from batches import data_identity, data_order, fast_reader
from errors import ConfigError
from mixture import Concatenation, MixtureSampler, apportion, build_data, spread
from run_config import config_class, load_config
from sources import Source, describe, parse_dataset

RunConfig = config_class()  # TrainConfig and model.py's and data.py's own keys


def test_the_compact_form_and_the_yaml_list_give_the_same_sources(tmp_path):
    compact = load_config(["--dataset", "data/web.jsonl:0.7,owner/books@en:0.3"]).dataset
    listed = tmp_path / "mix.yaml"
    listed.write_text(
        "dataset:\n  - {path: data/web.jsonl, weight: 0.7}\n"
        "  - {path: owner/books, config: en, weight: 0.3}\n"
    )
    assert load_config(["--config", str(listed)]).dataset == compact
    assert compact == (
        Source("data/web.jsonl", 0.7, "web"),
        Source("owner/books", 0.3, "books_en", config="en"),
    )
    flow = "[{path: a.txt, weight: 2, name: code, split: validation, text_column: body}, {path: b.txt}]"
    sources = load_config(["--dataset", flow]).mixture
    assert sources[0] == Source("a.txt", 2.0, "code", "", "validation", "body")
    assert sources[1].weight == 1.0  # a weight left out is 1
    assert load_config(["--dataset", "data/one.jsonl"]).mixture == ()  # one source: as always


@pytest.mark.parametrize(
    "value, message",
    [
        (
            "a.jsonl:-0.5,b.jsonl:1",
            "dataset: the weight of 'a.jsonl' must be >= 0 and finite (got -0.5)",
        ),
        ("a.jsonl:0,b.jsonl:0", "dataset: the weights are all 0"),
        ("a.jsonl:x,b.jsonl:1", "dataset: the weight of 'a.jsonl' must be a number (got 'x')"),
        ("a.jsonl:nan,b.jsonl:1", "dataset: the weight of 'a.jsonl' must be >= 0 and finite"),
        ("x/a.jsonl:1,y/a.jsonl:1", "dataset: two sources are named 'a'"),
        ("a.jsonl:1", "dataset: a mixture needs two or more sources"),
        ("[{path: a, wieght: 1}, {path: b}]", "dataset: entry 1 has unknown key 'wieght'"),
        ("[{weight: 1}, {path: b}]", "dataset: entry 1 must be a mapping with a path"),
        (":1,b:1", "dataset: ':1' names no source"),
    ],
)
def test_a_bad_mixture_is_one_line_naming_dataset(value, message):
    with pytest.raises(ConfigError) as error:
        load_config(["--dataset", value])
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_apportion_is_exact_in_total_and_within_one_per_share():
    for weights, total in [([0.7, 0.3], 16), ([1, 1, 1], 100), ([5, 0, 1], 7), ([0.01, 0.99], 3)]:
        shares = apportion(weights, total)
        assert sum(shares) == total
        exact = np.asarray(weights) / sum(weights) * total
        assert np.all(np.abs(np.asarray(shares) - exact) < 1)


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.25, 0.25], [0.9, 0.08, 0.02], [3, 0, 1]])
def test_every_global_batch_holds_each_sources_share_to_within_two_samples(weights):
    """The stated tolerance, for S sources: after any n samples, each source's count is within (S + 1) / 2 of
    n * w (spread's bound: half a sample from rounding its own due times, plus w * S / 2 from the others'),
    so over N steps of G samples its share is within (S + 1) / (2 N G) of w, and exact at the end of each
    pass; in every global batch, within 2 samples of G * w (measured here)."""
    global_batch, steps = 16, 64
    labels = spread(apportion(weights, global_batch * steps))
    shares = np.asarray(weights) / sum(weights)
    bound = (len(weights) + 1) / 2
    counts = np.zeros(len(weights))
    for n, label in enumerate(labels, start=1):
        counts[label] += 1
        assert np.all(np.abs(counts - n * shares) <= bound), (n, counts)
    assert counts.tolist() == apportion(weights, global_batch * steps)  # the pass's quotas, exactly
    for step in range(steps):
        window = labels[step * global_batch : (step + 1) * global_batch]
        per_step = np.bincount(window, minlength=len(weights))
        assert np.all(np.abs(per_step - global_batch * shares) < 2), (step, per_step)


def test_each_source_runs_through_its_own_epochs_and_a_small_one_starts_again_alone():
    """Sizes 40 and 7, weights 0.5/0.5, global batch 8: the pass is 40 samples (5 steps), 20 from each. The
    small source's 20 draws are its epochs 0, 1 (7 each) and 6 of epoch 2: each a permutation of its 7
    samples; the big one is half-way through its first epoch, all different samples."""
    sampler = MixtureSampler([40, 7], [0.5, 0.5], seed=3, samples_per_step=8)
    order = list(sampler)
    assert len(order) == len(sampler) == 40
    big = [i for i in order if i < 40]
    small = [i - 40 for i in order if i >= 40]
    assert len(big) == len(small) == 20 and len(set(big)) == 20
    assert sorted(small[:7]) == sorted(small[7:14]) == list(range(7)) and small[:7] != small[7:14]
    # the next pass continues each source where it was: the big one's second half, the small one's epoch 2
    sampler.set_epoch(1)
    second = list(sampler)
    big2 = [i for i in second if i < 40]
    assert sorted(big + big2) == list(range(40))
    small2 = [i - 40 for i in second if i >= 40]
    assert sorted(small[14:] + small2[:1]) == list(range(7))


def test_the_order_is_a_function_of_the_position_only():
    """What TrainBatches resumes from (samples consumed): the tail of a pass, and the same pass again."""
    sampler = MixtureSampler([30, 11, 5], [0.6, 0.3, 0.1], seed=1, samples_per_step=6)
    sampler.set_epoch(4)
    full = list(sampler)
    sampler.start_next_pass_at(18)
    assert list(sampler) == full[18:]
    again = MixtureSampler([30, 11, 5], [0.6, 0.3, 0.1], seed=1, samples_per_step=6)
    again.set_epoch(4)
    assert list(again) == full
    other_seed = MixtureSampler([30, 11, 5], [0.6, 0.3, 0.1], seed=2, samples_per_step=6)
    other_seed.set_epoch(4)
    assert list(other_seed) != full


def test_concatenation_reads_each_source_and_keeps_the_order():
    first = [{"input_ids": torch.tensor([i])} for i in range(5)]
    second = [{"input_ids": torch.tensor([100 + i])} for i in range(3)]
    joined = Concatenation({"a": first, "b": second})
    assert len(joined) == 8
    read = joined.__getitems__([6, 0, 7, 4, 5])
    assert [int(sample["input_ids"]) for sample in read] == [101, 0, 102, 4, 100]


@pytest.mark.shipped  # reads two corpora with the shipped data.py
def test_a_mixture_of_two_corpora_trains_on_the_weights_shares(tmp_path):
    """Built as main.py builds it: the observed share of each source over 30 steps of 16 samples, told
    apart by their text, is within 1/16 of its weight; the resume identity names both sources."""
    for name, word, docs in (("web", "alpha", 80), ("code", "BETA", 20)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for i in range(docs):
                f.write(json.dumps({"text": f"{word} {i} " * 12}) + "\n")
    mixture = f"{tmp_path / 'web.jsonl'}:0.75,{tmp_path / 'code.jsonl'}:0.25"
    cfg = RunConfig(dataset=load_config(["--dataset", mixture]).dataset, block_size=16)
    train_set, eval_sets = build_data(cfg, data.build_datasets)
    assert list(eval_sets) == ["web", "code"] and all(len(s) for s in eval_sets.values())
    sampler = data_order(cfg, train_set, samples_per_step=16)
    order = list(sampler)
    reader = fast_reader(train_set)
    from_code = []
    for step in range(30):
        samples = reader.__getitems__(order[step * 16 : (step + 1) * 16])
        texts = [bytes(s["input_ids"].tolist()).decode(errors="replace") for s in samples]
        assert all(("alpha" in t) != ("BETA" in t) for t in texts)  # one source per block
        from_code.append(sum("BETA" in t for t in texts))
    assert all(abs(n - 4) <= 1 for n in from_code)  # 16 x 0.25 per step, to within a sample
    assert abs(sum(from_code) / (30 * 16) - 0.25) <= 1 / 16
    identity = data_identity(cfg, train_set)
    assert identity["dataset"].endswith(":0.25") and "code/data_digest" in identity


def test_a_resume_with_other_weights_or_sources_is_refused_in_one_line(tmp_path):
    """The mixture, as shares, is part of the data identity a checkpoint keeps; 7:3 is 0.7:0.3."""
    from dataclasses import replace

    from errors import CheckpointError
    from resume import check_same_run
    from sources import parse_dataset

    parts = Concatenation({"a": [0] * 10, "b": [0] * 5})
    saved_cfg = RunConfig(dataset=parse_dataset("x/a.jsonl:0.7,y/b.jsonl:0.3"))
    geometry = {"global_batch": 16, "block_size": 128, "optimizer": "adamw"}
    about = {"run": {**geometry, **data_identity(saved_cfg, parts)}, "step": 1}
    same = replace(saved_cfg, dataset=parse_dataset("x/a.jsonl:7,y/b.jsonl:3"))
    check_same_run(tmp_path, about, geometry, same, data_identity(same, parts))  # no error
    for other in ("x/a.jsonl:0.5,y/b.jsonl:0.5", "x/a.jsonl:0.7,z/b.jsonl:0.3"):
        cfg = replace(saved_cfg, dataset=parse_dataset(other))
        with pytest.raises(CheckpointError) as error:
            check_same_run(tmp_path, about, geometry, cfg, data_identity(cfg, parts))
        message = str(error.value)
        assert f"dataset 'x/a.jsonl:0.7,y/b.jsonl:0.3' -> '{other}'" in message, message
        assert "--init_from" in message and "\n" not in message


def test_each_source_is_built_with_its_own_split_configuration_and_text_column():
    """data.py sees each source of a mixture as a single dataset: its path, configuration, split and
    text column in the keys it reads, a source without its own taking the run's."""
    flow = (
        "[{path: owner/books, config: en, split: validation, text_column: body, weight: 0.7},"
        " {path: owner/web, weight: 0.3}]"
    )
    cfg = RunConfig(
        dataset=load_config(["--dataset", flow]).dataset, dataset_split="train", text_column="text"
    )
    seen = {}

    def build_datasets(source_cfg):
        seen[source_cfg.dataset] = (
            source_cfg.dataset_config,
            source_cfg.dataset_split,
            source_cfg.text_column,
        )
        return [0] * 10, [0] * 2

    build_data(cfg, build_datasets)
    assert seen == {
        "owner/books": ("en", "validation", "body"),
        "owner/web": ("", "train", "text"),
    }


def test_apportion_gives_the_spare_samples_to_the_largest_remainders():
    """Largest remainder, computed by hand: 0.7/0.3 of 3 is 2.1/0.9, so the spare sample goes to the second
    source (2, 1), not to the larger share (3, 0); equal remainders go to the first sources."""
    assert apportion([0.7, 0.3], 3) == [2, 1]
    assert apportion([0.2, 0.5, 0.3], 7) == [1, 4, 2]  # 1.4, 3.5, 2.1: the spare to 3.5
    assert apportion([1, 1, 1], 100) == [34, 33, 33]
    assert apportion([1, 1, 1, 1], 6) == [2, 2, 1, 1]


def test_a_pass_is_at_least_one_global_batch():
    """Sources smaller than a global batch together: one step per pass, not zero (nor two)."""
    sampler = MixtureSampler([3, 2], [0.5, 0.5], seed=0, samples_per_step=8)
    assert len(sampler) == len(list(sampler)) == 8
    assert apportion([0.5, 0.5], 8) == sampler.quotas == [4, 4]


def test_the_order_of_a_seed_is_pinned():
    """A run's data order is a pure function of (seed, weights, sizes, position): a template change that moves
    it (another seed derivation, another permutation) makes every checkpoint resume into a different stream
    without a word. These values were recorded when the order was made; change them only with a note that
    a resume across the change does not continue the same data."""
    sampler = MixtureSampler([6, 4], [0.5, 0.5], seed=7, samples_per_step=4)
    assert list(sampler) == [1, 9, 2, 7, 4, 8, 3, 6]
    sampler.set_epoch(1)
    assert list(sampler) == [5, 9, 0, 7, 3, 6, 2, 8]
    assert sampler.permutation(0, 0).tolist() == [1, 2, 4, 3, 5, 0]
    assert sampler.permutation(1, 3).tolist() == [1, 2, 0, 3]


def test_concatenation_reads_one_sample_and_parts_without_a_batch_reader():
    class OneAtATime(torch.utils.data.Dataset):  # no __getitems__: read a sample at a time
        def __len__(self):
            return 3

        def __getitem__(self, index):
            return {"input_ids": torch.tensor([100 + index])}

    joined = Concatenation(
        {"a": [{"input_ids": torch.tensor([i])} for i in range(5)], "b": OneAtATime()}
    )
    assert int(joined[6]["input_ids"]) == 101 and int(joined[0]["input_ids"]) == 0
    faster = joined.with_parts(lambda part: [part[i] for i in range(len(part))])
    assert [int(faster[i]["input_ids"]) for i in range(8)] == [0, 1, 2, 3, 4, 100, 101, 102]


def test_build_data_for_one_dataset_and_for_streamed_sources():
    """One dataset: data.py's own pair, its evaluation set under the name ""; a streamed mixture: the document
    streams by source name, for streaming.MixedStream."""
    from mixture import Streams

    seen = []

    def build_datasets(source_cfg):
        seen.append(source_cfg.dataset)
        return f"train of {source_cfg.dataset}", f"eval of {source_cfg.dataset}"

    single = RunConfig(dataset="data/one.jsonl")
    assert build_data(single, build_datasets) == (
        "train of data/one.jsonl",
        {"": "eval of data/one.jsonl"},
    )
    streamed = RunConfig(
        dataset=load_config(["--dataset", "a.jsonl:1,b.jsonl:3"]).dataset, streaming=True
    )
    train, evaluations = build_data(streamed, build_datasets)
    assert isinstance(train, Streams)
    assert train.parts == {"a": "train of a.jsonl", "b": "train of b.jsonl"}
    assert evaluations == {"a": "eval of a.jsonl", "b": "eval of b.jsonl"}
    assert seen == ["data/one.jsonl", "a.jsonl", "b.jsonl"]


def test_each_default_of_a_listed_or_compact_source():
    """A YAML entry's left-out keys: weight 1, the name from the file's or repo's name (with its
    configuration), the rest "" (the run's own key), a null the same as left out; the compact form without a
    weight is weight 1; a path with a colon keeps it (the weight is after the last one); leading spaces
    before a flow list."""
    listed = parse_dataset(
        " [{path: data/web.jsonl}, {path: owner/books, config: en, split: null, text_column: 3}]"
    )
    assert listed == (
        Source("data/web.jsonl", 1.0, "web", "", "", ""),
        Source("owner/books", 1.0, "books_en", "en", "", "3"),
    )
    assert parse_dataset("a.jsonl,b/c.txt") == (
        Source("a.jsonl", 1.0, "a"),
        Source("b/c.txt", 1.0, "c"),
    )
    assert parse_dataset("/data/2024:12/a.jsonl:0.7,b.jsonl:0.3") == (
        Source("/data/2024:12/a.jsonl", 0.7, "a"),
        Source("b.jsonl", 0.3, "b"),
    )
    assert parse_dataset("") == "" and parse_dataset(None) == ""
    assert parse_dataset("owner/name") == "owner/name"


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            "[{path: a, weight: 1}, {path: b",
            "dataset: invalid YAML list: while parsing a flow mapping",
        ),
        (5, "dataset must be a string or a list of sources (got 5)"),
        (
            [{"path": "a", "wieght": 1}, {"path": "b"}],
            "dataset: entry 1 has unknown key 'wieght' (keys: path, weight, name, config, split, text_column)",
        ),
        (
            [{"path": "a"}, "b"],
            "dataset: entry 2 must be a mapping with a path (keys: path, weight, name, config, split, "
            "text_column; got 'b')",
        ),
        (
            [{"path": "a"}, {"path": "b", "split": True}],
            "dataset: entry 2's split must be a string (got True)",
        ),
        (
            [{"path": "a", "split": ["x"]}, {"path": "b"}],
            "dataset: entry 1's split must be a string (got ['x'])",
        ),
        (
            [{"path": "a", "weight": "x"}, {"path": "b"}],
            "dataset: the weight of 'a' must be a number (got 'x')",
        ),
        (
            "a.jsonl:1",
            "dataset: a mixture needs two or more sources (for one, set dataset, dataset_config, "
            "dataset_split and text_column)",
        ),
        ("a.jsonl:inf,b:1", "dataset: the weight of 'a.jsonl' must be >= 0 and finite (got inf)"),
    ],
)
def test_each_bad_source_is_its_whole_line(raw, message):
    """The whole line, every word: what a person reads to fix the value."""
    with pytest.raises(ConfigError) as error:
        parse_dataset(raw)
    assert str(error.value) == message


def test_describe_gives_each_source_its_share_and_what_it_overrides():
    """The line a checkpoint keeps and a resume compares: shares, not raw weights."""
    sources = parse_dataset(
        "[{path: a.jsonl, weight: 3}, {path: owner/b, config: en, weight: 1},"
        " {path: c, split: test, weight: 0}, {path: d, text_column: body, weight: 4}]"
    )
    assert describe(sources) == "a.jsonl:0.375,owner/b@en:0.125,c[test,-]:0,d[-,body]:0.5"


def test_equal_remainders_go_to_the_first_sources_past_sixteen_of_them():
    """Twenty shards, ten of weight 1 then ten of weight 2, share 33 samples: 1.1 and 2.2 each, 30 in whole
    samples, and the 3 spare ones to the largest remainders, 0.2 for all ten heavy shards alike: the first
    three of them (shards 10, 11, 12). NumPy's default sort breaks such ties one way with its AVX-512
    kernel and another without (12, 13, 15 against 19, 17, 16 here), so the pass would change with the
    machine a run resumes on."""
    assert apportion([1] * 10 + [2] * 10, 33) == [1] * 10 + [3, 3, 3] + [2] * 7


class Recording(torch.utils.data.Dataset):
    """Sample i is base + i; every read is recorded: a list for one batch read, an int for one sample."""

    def __init__(self, base: int, size: int):
        self.base, self.size, self.reads = base, size, []

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        self.reads.append(index)
        return self.base + index

    def __getitems__(self, indices):
        self.reads.append(list(indices))
        return [self.base + index for index in indices]


def test_concatenation_reads_a_batch_reader_once_per_part():
    """Parts of 5 and 3 with a batch reader (ArrowBlocks' fast path): concatenation indices 6, 0, 7, 4, 5 are
    the second part's 1, 2, 0 and the first part's 0, 4, each part read in one call with its indices in the
    batch's order, never one sample at a time."""
    first, second = Recording(0, 5), Recording(100, 3)
    joined = Concatenation({"a": first, "b": second})
    assert joined.__getitems__([6, 0, 7, 4, 5]) == [101, 0, 102, 4, 100]
    assert first.reads == [[0, 4]] and second.reads == [[1, 2, 0]]


def test_a_pass_draws_one_permutation_per_source_and_epoch_it_reaches():
    """Sizes 4 and 6, weights 0.5/0.5, global batch 2: passes of 10 samples, 5 from each. Pass 0 draws the
    small source's 0-4 (its epoch 0, and draw 4 of epoch 1) and the big one's 0-4 (epoch 0); pass 1 the
    small one's 5-9 (epochs 1 and 2) and the big one's 5-9 (epochs 0 and 1). One permutation per source and
    epoch, not one per draw (a permutation of a million-sample source per sample would never finish)."""
    sampler = MixtureSampler([4, 6], [0.5, 0.5], seed=0, samples_per_step=2)
    made = []
    permutation = sampler.permutation

    def recorded(source, epoch):
        made.append((source, epoch))
        return permutation(source, epoch)

    sampler.permutation = recorded
    sampler.pass_order(0)
    assert made == [(0, 0), (0, 1), (1, 0)]
    made.clear()
    sampler.pass_order(1)
    assert made == [(0, 1), (0, 2), (1, 0), (1, 1)]


def test_a_part_whose_batch_reader_miscounts_is_an_error():
    """A fork's batch reader that answers fewer or more samples than it was asked for: a ValueError at that
    read, not a batch with a hole (None) or with a sample silently left out."""

    class Miscounting(Recording):
        def __init__(self, answer):
            super().__init__(0, 4)
            self.answer = answer

        def __getitems__(self, indices):
            return self.answer(super().__getitems__(indices))

    for answer in (lambda read: read[:-1], lambda read: [*read, 3]):
        with pytest.raises(ValueError):
            Concatenation({"a": Miscounting(answer)}).__getitems__([0, 1, 2])


def test_a_sampler_with_more_sizes_than_weights_is_an_error():
    """Sizes and weights pair up one to one (data_order builds both from the same named sources); three sizes
    with two weights is a ValueError when the pass is made, not a pass that leaves the third source out."""
    sampler = MixtureSampler([4, 4, 4], [0.5, 0.5], seed=0, samples_per_step=4)
    with pytest.raises(ValueError):
        list(sampler)
