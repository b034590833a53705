"""The streamed training data (train/streaming.py), in process: shares, order, and the position as state."""

import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import data
from conftest import write_corpus
from data import build_datasets
from errors import ConfigError
from run_config import load_config
from streaming import DOCUMENTS_PER_READ, StreamBatches


def streaming_config(corpus, *flags):
    return load_config(
        [
            "--dataset",
            str(corpus),
            "--streaming",
            "true",
            "--block_size",
            "16",
            "--batch_size",
            "2",
            "--shuffle_buffer",
            "8",
            "--streaming_eval_blocks",
            "4",
            *flags,
        ]
    )


def process(rank, world=2):
    return SimpleNamespace(process_index=rank, num_processes=world, device=torch.device("cpu"))


def one_epoch(stream):
    """(sample id, block) of every block this process draws in its first epoch."""
    drawn = []
    while True:
        sample_id, block = stream.next_block()
        if sample_id[0] == 1:
            return drawn, sample_id
        drawn.append((sample_id, block))


def test_each_process_packs_its_own_share_and_together_they_cover_every_document_once(tmp_path):
    # several reads per process and epoch
    corpus = write_corpus(tmp_path / "corpus.jsonl", n_docs=300)
    cfg = streaming_config(corpus)
    documents, _ = build_datasets(cfg)
    rows = list(documents)  # the training documents, in the stream's order
    pack = data.packer(cfg)  # the fork's one packer, as the map-style path uses it
    for rank in range(2):
        drawn, _ = one_epoch(StreamBatches(documents, cfg, process(rank)))
        packed = torch.cat(
            [torch.from_numpy(block.copy()) for _, block in sorted(drawn, key=lambda item: item[0])]
        )
        # a single file is shared document by document: rank r reads documents r, r + 2, ..., packed as read
        share = rows[rank::2]
        reads = [
            share[i : i + DOCUMENTS_PER_READ] for i in range(0, len(share), DOCUMENTS_PER_READ)
        ]
        expected = [
            pack({key: [row[key] for row in read] for key in read[0]})["input_ids"]
            for read in reads
        ]
        assert len(reads) > 1
        assert (
            packed.tolist()
            == torch.cat([torch.as_tensor(blocks) for blocks in expected]).flatten().tolist()
        )
        assert sorted(i for (_, i), _ in drawn) == list(range(len(drawn)))  # every block drawn once


def test_the_buffer_draws_another_order_each_epoch_and_per_process(corpus):
    cfg = streaming_config(corpus)
    documents, _ = build_datasets(cfg)
    stream = StreamBatches(documents, cfg, process(0))
    first, _ = one_epoch(stream)
    second = [stream.next_block()[0][1] for _ in range(len(first) - 1)]
    first_order = [i for (_, i), _ in first]
    assert first_order != list(range(len(first)))  # shuffled
    assert second != first_order[1:]
    other, _ = one_epoch(StreamBatches(documents, cfg, process(0, world=1)))
    assert [i for (_, i), _ in other] != first_order[: len(other)]


def test_a_stream_restored_from_its_state_draws_exactly_what_the_original_draws_next(corpus):
    cfg = streaming_config(corpus)
    documents, _ = build_datasets(cfg)
    original = StreamBatches(documents, cfg, process(1))
    for _ in range(13):
        next(original)
    saved = io.BytesIO()
    torch.save(original.state_dict(), saved)  # as a checkpoint holds it, read back weights_only
    restored = StreamBatches(build_datasets(cfg)[0], cfg, process(1))
    restored.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    for _ in range(320):  # across the end of the first epoch
        expected_id, expected_block = original.next_block()
        got_id, got_block = restored.next_block()
        assert got_id == expected_id and (got_block == expected_block).all()
    assert original.epoch == restored.epoch == 1


@pytest.mark.shipped
def test_the_eval_set_is_held_out_text_whatever_its_position(corpus):
    cfg = streaming_config(corpus)
    documents, evaluation = build_datasets(cfg)
    assert len(evaluation) == 4 and evaluation[0]["input_ids"].shape == (16,)
    train_texts = {doc["text"] for doc in documents}
    eval_bytes = bytes(torch.cat([evaluation[i]["input_ids"] for i in range(4)]).tolist())
    held_out = [
        json.loads(line)["text"]
        for line in corpus.read_text().splitlines()
        if json.loads(line)["text"] not in train_texts
    ]
    assert held_out and eval_bytes.decode("utf-8", "replace").startswith(held_out[0][:8])


@pytest.mark.shipped  # the shipped data.py's messages
def test_a_stream_without_the_text_column_or_with_loader_workers_is_a_one_line_error_at_start_up(
    tmp_path, corpus
):
    with pytest.raises(
        ConfigError, match="text_column 'body' is not a column of .* \\(columns: text, id\\)"
    ):
        # reads the first row only
        build_datasets(streaming_config(corpus, "--text_column", "body"))
    with pytest.raises(ConfigError, match="num_workers must be 0 with streaming"):
        streaming_config(corpus, "--num_workers", "2")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="dataset '.*empty.jsonl' cannot be read as json files"):
        build_datasets(streaming_config(empty))


def test_one_packer_makes_every_block_map_style_and_streamed(corpus, monkeypatch):
    """data.packer is the run's one packer: changed, the map-style train and eval blocks, the streamed training
    blocks and the streamed eval set all change the same way."""
    map_cfg = load_config(["--dataset", str(corpus), "--block_size", "16"])
    stream_cfg = streaming_config(corpus)

    def blocks_of(cfg):
        train, evaluation = build_datasets(cfg)
        if not cfg.streaming:
            return [train[:]["input_ids"], evaluation[:]["input_ids"]]
        stream = StreamBatches(train, cfg, process(0))
        drawn = torch.stack([torch.as_tensor(stream.next_block()[1]).long() for _ in range(20)])
        return [drawn, evaluation[:]["input_ids"]]

    before = blocks_of(map_cfg) + blocks_of(stream_cfg)
    original_packer = data.packer

    def reversing_packer(cfg):
        pack = original_packer(cfg)

        def reversed_blocks(documents):
            return {"input_ids": np.asarray(pack(documents)["input_ids"])[:, ::-1].copy()}

        return reversed_blocks

    monkeypatch.setattr(data, "packer", reversing_packer)
    after = blocks_of(map_cfg) + blocks_of(stream_cfg)
    for old, new in zip(before, after, strict=True):
        assert torch.equal(new.long(), old.long().flip(-1))


class CountingStream:
    """A source's stream for MixedStream: block k of it holds (source, k)."""

    def __init__(self, source: int):
        self.source = source
        self.drawn = 0
        self.epoch = 0

    def next_block(self):
        self.drawn += 1
        return (0, self.drawn), np.array([self.source, self.drawn, 0, 0], dtype=np.int64)

    def state_dict(self):
        return {"drawn": self.drawn}

    def load_state_dict(self, state):
        self.drawn = state["drawn"]


def test_a_mixed_stream_restored_from_its_state_draws_exactly_what_the_original_draws_next():
    """Unequal weights (0.61/0.39), whose draw pattern depends on where the stream stands (0.5/0.5
    alternates, and 0.7/0.3 repeats every 10 samples: positions that far apart would look alike):
    the restored mixture continues with the same sources, each source's stream where it stopped."""
    from streaming import MixedStream

    cfg = load_config(["--batch_size", "4"])

    def mixture():
        streams = {"web": CountingStream(0), "code": CountingStream(1)}
        return MixedStream(streams, [0.61, 0.39], cfg, process(0))

    original = mixture()
    for _ in range(7):
        next(original)
    saved = io.BytesIO()
    torch.save(original.state_dict(), saved)
    expected = [next(original)["input_ids"][:, :2].tolist() for _ in range(6)]
    restored = mixture()
    restored.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    assert [next(restored)["input_ids"][:, :2].tolist() for _ in range(6)] == expected
