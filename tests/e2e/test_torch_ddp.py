"""The pure-torch path: torchrun, one plain process and mp.spawn; bitwise equality with the Accelerate path."""

import pytest
import torch

from conftest import (
    TORCH_DDP,
    baseline_args,
    launch_accelerate,
    launch_torchrun,
    load_weights,
    run_python,
    tiny_args,
)

pytestmark = pytest.mark.slow

# the configuration: amplifies any difference in how a global batch is summed (a strided split drifted
# by 1e-3 in 25 steps)
BITWISE = dict(
    max_steps=100, grad_accum_steps=2, dropout=0.1, lr=2e-3, eval_every=50, save_every=50
)


def test_torchrun_and_accelerate_are_bitwise_identical(tmp_path, corpus):
    """Same config on 2 CPU processes: every logged loss, eval loss and final weight exactly equal (==)."""
    accelerate = launch_accelerate(tiny_args(tmp_path / "acc", corpus, **BITWISE), tmp_path).check()
    torchrun = launch_torchrun(tiny_args(tmp_path / "ddp", corpus, **BITWISE), tmp_path).check()
    a, b = accelerate.losses(), torchrun.losses()
    assert sorted(a) == list(range(1, 101)) and a == b
    eval_a = [r["eval_loss"] for r in accelerate.metrics() if "eval_loss" in r]
    assert len(eval_a) == 2 and eval_a == [
        r["eval_loss"] for r in torchrun.metrics() if "eval_loss" in r
    ]
    wa, wb = (
        load_weights(tmp_path / "acc/model.safetensors"),
        load_weights(tmp_path / "ddp/model.safetensors"),
    )
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (tmp_path / "ddp" / "checkpoints" / "step_00000100" / "manifest.json").exists()


def test_an_accelerate_checkpoint_resumes_on_the_torch_path_exactly_under_mp_spawn(
    tmp_path, corpus, baseline
):
    """One checkpoint format and one data split for both plumbings: the torch path, started from Python with
    `python train/torch_ddp.py --spawn 2` (no launcher), continues the Accelerate run's steps 17-24 bitwise (dropout
    masks included: every rank resumes its own RNG on its own samples). (One plain process on the torch path:
    test_resume.py's world-size test; torchrun: the bitwise test above.)"""
    checkpoint = baseline.output_dir / "checkpoints" / "step_00000016"
    resumed = run_python(
        ["--spawn", 2, *baseline_args(tmp_path / "run", corpus), "--resume", checkpoint],
        tmp_path,
        script=TORCH_DDP,
    ).check()
    assert "(step 16)" in resumed.output
    assert resumed.losses() == {s: v for s, v in baseline.losses().items() if s > 16}
    reference, replayed = (
        load_weights(d / "model.safetensors") for d in (baseline.output_dir, tmp_path / "run")
    )
    assert all(torch.equal(reference[k], replayed[k]) for k in reference)
