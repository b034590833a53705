"""The shipped data.py: local formats through `datasets`, cached packing, the stdlib corpus, one packer.
(The data order, which is the template's: test_batches.py.)"""

import json
import os

import pandas as pd
import pytest
import torch

import data
from conftest import REPO, SESSION_HF_HOME, run_python, write_corpus
from errors import ConfigError
from run_config import config_class

RunConfig = config_class()  # TrainConfig and model.py's and data.py's own keys


# the shipped data.py: a fork that replaces it adapts or deletes these
pytestmark = pytest.mark.shipped


def cfg_for(dataset, **kw):
    return RunConfig(dataset=str(dataset), block_size=16, **kw)


def texts(n=40):
    return [
        f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 3 for i in range(n)
    ]


@pytest.mark.parametrize("kind", ["txt", "jsonl", "csv", "parquet", "folder"])
def test_local_formats_give_packed_blocks(tmp_path, kind):
    docs = texts()
    if kind == "txt":
        path = tmp_path / "corpus.txt"
        path.write_text("\n".join(docs))
    elif kind == "jsonl":
        path = tmp_path / "corpus.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    elif kind == "csv":
        path = tmp_path / "corpus.csv"
        pd.DataFrame({"text": docs}).to_csv(path, index=False)
    elif kind == "parquet":
        path = tmp_path / "corpus.parquet"
        pd.DataFrame({"text": docs}).to_parquet(path)
    else:
        path = tmp_path / "shards"
        path.mkdir()
        for i in range(2):
            (path / f"part{i}.jsonl").write_text(
                "".join(json.dumps({"text": d}) + "\n" for d in docs[i::2])
            )
    train, evaluation = data.build_datasets(cfg_for(path, eval_fraction=0.1))
    total_bytes = sum(len(d.encode()) + 1 for d in docs)
    assert len(train) + len(evaluation) <= total_bytes // 16
    assert len(train) > 5 * len(evaluation) > 0
    batch = data.collate([train[0], train[1]])
    assert batch["input_ids"].shape == (2, 16) and batch["input_ids"].dtype == torch.long
    assert torch.equal(batch["labels"], batch["input_ids"])
    decoded = bytes(train[0]["input_ids"].tolist()).decode()
    assert "document" in decoded or "fox" in decoded or "lazy" in decoded


def test_packing_is_cached_between_runs(tmp_path):
    path = write_corpus(tmp_path / "c.jsonl")
    first, _ = data.build_datasets(cfg_for(path))
    files = [f["filename"] for f in first.cache_files]
    stamps = [os.stat(f).st_mtime_ns for f in files]
    second, _ = data.build_datasets(cfg_for(path))
    assert [f["filename"] for f in second.cache_files] == files  # same map cache, not a new one
    assert [os.stat(f).st_mtime_ns for f in files] == stamps  # and not rewritten
    assert torch.equal(first[5]["input_ids"], second[5]["input_ids"])


def test_eval_split_does_not_move_with_the_seed(tmp_path):
    path = write_corpus(tmp_path / "c.jsonl")
    _, eval_a = data.build_datasets(cfg_for(path, seed=1))
    _, eval_b = data.build_datasets(cfg_for(path, seed=2))
    assert torch.equal(eval_a[:]["input_ids"], eval_b[:]["input_ids"])


def test_bad_datasets_are_one_line_errors(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"body": "x" * 400}) + "\n")
    with pytest.raises(
        ConfigError, match="text_column 'text' is not a column .* \\(columns: body\\)"
    ):
        data.build_datasets(cfg_for(path))
    odd = tmp_path / "mixed"
    odd.mkdir()
    (odd / "a.txt").write_text("hello")
    (odd / "b.csv").write_text("text\nhello\n")
    with pytest.raises(ConfigError, match="single type"):
        data.build_datasets(cfg_for(odd))
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text("".join(json.dumps({"text": "ab"}) + "\n" for _ in range(30)))
    with pytest.raises(ConfigError, match="no eval block of block_size 16|no train block"):
        data.build_datasets(cfg_for(tiny))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"text": "x" * 400}) + '\n{"text": "unterminated\n')
    with pytest.raises(
        ConfigError, match=f"dataset '{broken}' cannot be read as json files: "
    ) as error:
        data.build_datasets(cfg_for(broken))
    assert "\n" not in str(error.value)


def test_python_stdlib_corpus_is_written_once(tmp_path):
    target = data.write_python_stdlib_corpus(tmp_path)
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    assert len(rows) > 50 and {"text", "path"} <= set(rows[0])
    assert any(r["path"] == "os.py" for r in rows)
    stamp = target.stat().st_mtime_ns
    assert (
        data.write_python_stdlib_corpus(tmp_path) == target and target.stat().st_mtime_ns == stamp
    )


def test_hub_name_offline_is_a_fast_clear_error(tmp_path):
    result = run_python(
        ["--dataset", "someone/no-such-dataset", "--output_dir", tmp_path / "out"],
        tmp_path,
        timeout=120,
    )
    assert result.returncode == 2, result.tail()
    assert (
        "error: dataset 'someone/no-such-dataset' could not be loaded from the hub (HF_HUB_OFFLINE"
        in result.output
    ), result.tail()
    assert not (tmp_path / "out").exists()


def test_prepare_script_fills_the_cache_a_run_then_reuses(tmp_path):
    path = write_corpus(tmp_path / "c.jsonl")
    result = run_python(
        ["--dataset", path, "--block_size", 16],
        tmp_path,
        script=REPO / "data" / "prepare.py",
        timeout=120,
    ).check()
    assert "train and" in result.output and "cached for training" in result.output
    before = set(SESSION_HF_HOME.rglob("*.arrow"))
    train, _ = data.build_datasets(cfg_for(path))
    # the run packed nothing new: it reused the cache
    assert set(SESSION_HF_HOME.rglob("*.arrow")) == before
    assert {f["filename"] for f in train.cache_files} <= {str(p) for p in before}


def test_the_data_identity_follows_the_text_and_nothing_else(tmp_path):
    """A resume checks the data by its content (batches.content_digest over the packed tokens): one
    letter changed in one document, the same length, gives another identity; the same text
    written again elsewhere gives the same one."""
    from batches import data_identity

    def identity_of(folder, documents):
        folder.mkdir()
        path = folder / "corpus.jsonl"
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
        cfg = cfg_for(path)
        identity = data_identity(cfg, data.build_datasets(cfg)[0])
        identity.pop("dataset")  # the path: told apart here on purpose
        return identity

    original = texts()
    changed = list(original)
    changed[17] = changed[17].replace("lazy", "lacy")
    assert len(changed[17]) == len(original[17])
    same = identity_of(tmp_path / "a", original)
    assert identity_of(tmp_path / "b", original) == same
    assert identity_of(tmp_path / "c", changed)["data_digest"] != same["data_digest"]
