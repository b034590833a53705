"""A streamed corpus through `accelerate launch` on 2 CPU processes: interrupted mid-epoch and resumed, it trains on
exactly the uninterrupted run's blocks and ends bitwise equal to it."""

import json
import shutil

import pytest

from conftest import FAULTY_MAIN, launch_accelerate, run_python, tiny_args

pytestmark = pytest.mark.slow


def test_a_streaming_run_interrupted_mid_epoch_resumes_on_the_same_blocks_and_ends_bitwise_equal(
    tmp_path, corpus, bpe_tokenizer
):
    def args(out):  # a 320-token BPE vocabulary: the stream holds uint16 tokens
        return tiny_args(
            out,
            corpus,
            streaming="true",
            tokenizer=bpe_tokenizer,
            shuffle_buffer=32,
            streaming_eval_blocks=8,
            dropout=0.1,
            grad_accum_steps=2,
            max_steps=20,
            save_every=10,
            eval_every=10,
        )

    def drawn(folder, rank):
        return [
            tuple(sample_id)
            for sample_id in json.loads((tmp_path / folder / f"rank{rank}.json").read_text())
        ]

    whole = launch_accelerate(
        args(tmp_path / "whole"),
        tmp_path,
        script=FAULTY_MAIN,
        env_extra={"RECORD_SAMPLES": tmp_path / "whole_ids"},
    ).check()
    # interrupted just after its step-10 checkpoint (how a run stops, SIGTERM or kill, is tested in test_resume.py)
    shutil.copytree(
        tmp_path / "whole" / "checkpoints" / "step_00000010",
        tmp_path / "run" / "checkpoints" / "step_00000010",
    )
    resumed = launch_accelerate(
        [*args(tmp_path / "run"), "--resume", "latest"],
        tmp_path,
        script=FAULTY_MAIN,
        env_extra={"RECORD_SAMPLES": tmp_path / "resumed_ids"},
    ).check()
    assert "(step 10)" in resumed.output

    for rank in range(2):
        expected = drawn("whole_ids", rank)
        assert len(expected) == 20 * 2 * 4 and len(set(expected)) == len(expected)
        # the run crosses epochs of this process's share
        assert len({epoch for epoch, _ in expected}) > 1
        after = drawn("resumed_ids", rank)
        assert after == expected[10 * 2 * 4 :]
        # resumed mid-epoch, with a buffer to restore
        assert after[0][0] == expected[10 * 2 * 4 - 1][0]
    weights = [(tmp_path / name / "model.safetensors").read_bytes() for name in ("run", "whole")]
    assert weights[0] == weights[1]
    assert [r["loss"] for r in resumed.metrics() if "loss" in r] == [
        r["loss"] for r in whole.metrics() if r.get("step", 0) > 10 and "loss" in r
    ]

    # each process owns a share of the stream: another world size cannot continue it, and says so at once
    # the same global batch on 1 process
    other_world = run_python(
        [*args(tmp_path / "run"), "--max_steps", "30", "--batch_size", "8", "--resume", "latest"],
        tmp_path,
    )
    errors = [line for line in other_world.output.splitlines() if line.startswith("error: ")]
    assert (
        other_world.returncode != 0 and len(errors) == 1 and "saved by 2 processes" in errors[0]
    ), other_world.tail()


def write_lines(path, texts):
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))


def test_a_streamed_corpus_changed_before_a_resume_is_refused_in_one_line(tmp_path):
    """A streamed run records what it reads (its files' names, sizes and content); a resume on a rewritten
    file is refused, pointing to --init_from."""
    texts = [f"doc {i}: " + "the quick brown fox jumps. " * (1 + i % 3) for i in range(400)]
    corpus = tmp_path / "corpus.jsonl"
    write_lines(corpus, texts)
    args = tiny_args(
        tmp_path / "run", corpus, streaming="true", shuffle_buffer=8, max_steps=6, save_every=3
    )
    args += ["--streaming_eval_blocks", "4", "--eval_every", "6"]
    run_python(args, tmp_path).check()
    write_lines(corpus, [text.upper() for text in texts])  # rewritten: the same size
    changed = run_python([*args, "--max_steps", "9", "--resume", "latest"], tmp_path)
    errors = [line for line in changed.output.splitlines() if line.startswith("error: ")]
    assert changed.returncode == 2 and len(errors) == 1, changed.tail()
    assert "was saved for other data (stream_files " in errors[0] and "--init_from" in errors[0]


@pytest.mark.shipped  # the shipped data.py reads the first row and builds the eval set as it does
def test_a_malformed_streamed_line_is_one_line_naming_the_file_at_start_up_and_half_way(tmp_path):
    """A malformed line is one line naming the file and the line: at start-up (the first row, read by
    data.py) and half-way (a later read, by streaming.py), the checkpoints before it intact."""
    texts = [f"doc {i}: " + "the quick brown fox jumps. " * (1 + i % 3) for i in range(400)]
    broken = tmp_path / "broken"
    broken.mkdir()
    write_lines(broken / "a.jsonl", texts[:200])
    lines = (broken / "a.jsonl").read_text().splitlines()
    first_bad = tmp_path / "first.jsonl"
    first_bad.write_text("\n".join(["{not json", *lines[1:]]) + "\n")
    at_start = run_python(tiny_args(tmp_path / "start", first_bad, streaming="true"), tmp_path)
    errors = [line for line in at_start.output.splitlines() if line.startswith("error: ")]
    assert at_start.returncode == 2 and "Traceback" not in at_start.output, at_start.tail()
    assert len(errors) == 1 and f"({first_bad}, line 1)" in errors[0], errors

    # half-way: a third file, read after the first two (the reader parses a file in 10 MB blocks, so a bad
    # line fails its whole block: here, all of c.jsonl)
    write_lines(broken / "b.jsonl", texts[200:])
    lines[4] = '{"text": "unterminated'
    (broken / "c.jsonl").write_text("\n".join(lines) + "\n")
    half = tiny_args(tmp_path / "half", broken, streaming="true", shuffle_buffer=8, max_steps=400)
    # the eval set: the first few held-out documents, all in a.jsonl
    half += ["--save_every", "5", "--streaming_eval_blocks", "4", "--eval_fraction", "0.2"]
    half_way = launch_accelerate(half, tmp_path)
    errors = [line for line in half_way.output.splitlines() if line.startswith("error: ")]
    assert half_way.returncode != 0 and len(errors) == 1, half_way.tail()
    assert f"({broken / 'c.jsonl'}, line 5)" in errors[0], errors
    saved = sorted((tmp_path / "half" / "checkpoints").glob("step_*"))
    assert saved and all((folder / "manifest.json").exists() for folder in saved), (
        saved
    )  # trained first
