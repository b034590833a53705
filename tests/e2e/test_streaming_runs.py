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
