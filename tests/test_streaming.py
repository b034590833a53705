"""The streamed training data (train/streaming.py), in process: shares, order, and the position as state."""

import io
import json
from types import SimpleNamespace

import pytest
import torch

from config import ConfigError, load_config
from data import build_datasets, token_stream
from streaming import StreamBatches


def streaming_config(corpus, *flags):
    return load_config(["--dataset", str(corpus), "--streaming", "true", "--block_size", "16", "--batch_size", "2",
                        "--shuffle_buffer", "8", "--streaming_eval_blocks", "4", *flags])


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


def test_each_process_packs_its_own_share_and_together_they_cover_every_document_once(corpus):
    cfg = streaming_config(corpus)
    documents, _ = build_datasets(cfg)
    texts = [doc["text"] for doc in documents]  # the training documents, in the stream's order
    for rank in range(2):
        drawn, _ = one_epoch(StreamBatches(documents, cfg, process(rank)))
        packed = torch.cat([torch.from_numpy(block) for _, block in sorted(drawn, key=lambda item: item[0])])
        # a single file is shared document by document: rank r reads documents r, r + 2, ...
        share = torch.from_numpy(token_stream(texts[rank::2]).copy())
        assert packed.tolist() == share[:len(packed)].tolist()
        assert len(share) - len(packed) < cfg.block_size  # only the tail that makes no whole block is left out
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
    assert [i for (_, i), _ in other] != first_order[:len(other)]


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


def test_the_eval_set_is_held_out_text_whatever_its_position(corpus):
    cfg = streaming_config(corpus)
    documents, evaluation = build_datasets(cfg)
    assert len(evaluation) == 4 and evaluation[0]["input_ids"].shape == (16,)
    train_texts = {doc["text"] for doc in documents}
    eval_bytes = bytes(torch.cat([evaluation[i]["input_ids"] for i in range(4)]).tolist())
    held_out = [json.loads(line)["text"] for line in corpus.read_text().splitlines()
                if json.loads(line)["text"] not in train_texts]
    assert held_out and eval_bytes.decode("utf-8", "replace").startswith(held_out[0][:8])


def test_a_stream_without_the_text_column_or_with_loader_workers_is_a_one_line_error_at_start_up(tmp_path, corpus):
    with pytest.raises(ConfigError, match="text_column 'body' is not a column of .* \\(columns: text, id\\)"):
        streaming_config(corpus, "--text_column", "body")
    with pytest.raises(ConfigError, match="num_workers must be 0 with streaming"):
        streaming_config(corpus, "--num_workers", "2")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="dataset '.*empty.jsonl' cannot be read as json files"):
        streaming_config(empty)
