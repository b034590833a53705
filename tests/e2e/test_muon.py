"""--optimizer muon: both plumbings on 2 CPU processes (DDP), bitwise alike and bitwise after a resume; the
refusals (another optimizer's checkpoint, FSDP) in one line."""

import pytest
import torch

from conftest import (
    launch_accelerate,
    launch_torchrun,
    load_weights,
    model_declares_blocks,
    run_python,
    tiny_args,
)

# Muon takes the weight matrices of the model's blocks (_no_split_modules)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not model_declares_blocks(), reason="model.py's model declares no blocks"),
]

MUON = dict(optimizer="muon", max_steps=16, save_every=8, eval_every=8, grad_accum_steps=2)


def test_muon_is_bitwise_alike_on_both_plumbings_and_resumes_exactly(tmp_path, corpus):
    """Accelerate trains 16 steps; the torch path continues its step-8 checkpoint: Muon's momentum
    and AdamW's moments restored, and steps 9-16 and the final weights the same to the bit (the two
    plumbings alike, and the resume exact, in one)."""
    accelerate = launch_accelerate(tiny_args(tmp_path / "acc", corpus, **MUON), tmp_path).check()
    losses = accelerate.losses()
    assert sorted(losses) == list(range(1, 17))
    assert losses[16] < losses[1] - 0.5  # it trains
    final = load_weights(tmp_path / "acc/model.safetensors")
    checkpoint = tmp_path / "acc/checkpoints/step_00000008"
    resumed = launch_torchrun(
        [*tiny_args(tmp_path / "resumed", corpus, **MUON), "--resume", checkpoint], tmp_path
    ).check()
    assert resumed.losses() == {step: v for step, v in losses.items() if step > 8}
    replayed = load_weights(tmp_path / "resumed/model.safetensors")
    assert final.keys() == replayed.keys()
    assert all(torch.equal(final[k], replayed[k]) for k in final)
    # an AdamW run cannot take Muon's state
    other = run_python(
        [
            *tiny_args(tmp_path / "adamw", corpus, **{**MUON, "optimizer": "adamw"}),
            "--batch_size",
            8,
            "--resume",
            checkpoint,
        ],
        tmp_path,
    )
    errors = [line for line in other.output.splitlines() if line.startswith("error: ")]
    assert other.returncode != 0 and len(errors) == 1, other.tail()
    assert "saved with optimizer muon, this run uses adamw" in errors[0]


def test_muon_under_accelerates_fsdp_is_refused_in_one_line(tmp_path, corpus):
    """The accelerate config turns FSDP on (as its FSDP configs do): refused before any process group."""
    run = run_python(
        tiny_args(tmp_path / "run", corpus, optimizer="muon"),
        tmp_path,
        env_extra={"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"},
    )
    assert run.returncode == 2, run.tail()
    lines = run.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: optimizer muon cannot run under FSDP")
    assert not (tmp_path / "run").exists()
