"""The pure-torch path: torchrun, one plain process and mp.spawn; equivalence with the Accelerate path."""

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

EQUIVALENCE = dict(max_steps=20, grad_accum_steps=2, eval_every=10, save_every=0)


def test_torchrun_matches_accelerate_step_for_step(tmp_path, corpus):
    """Same seed, data and global batch on 2 CPU processes: the same losses and final weights."""
    accelerate = launch_accelerate(tiny_args(tmp_path / "acc", corpus, **EQUIVALENCE), tmp_path).check()
    torchrun = launch_torchrun(tiny_args(tmp_path / "ddp", corpus, **EQUIVALENCE), tmp_path).check()
    a, b = accelerate.losses(), torchrun.losses()
    assert sorted(a) == sorted(b) == list(range(1, 21))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), (step, a[step], b[step])
    eval_a = [r["eval_loss"] for r in accelerate.metrics() if "eval_loss" in r]
    eval_b = [r["eval_loss"] for r in torchrun.metrics() if "eval_loss" in r]
    assert eval_b == pytest.approx(eval_a, rel=1e-5)
    wa, wb = load_weights(tmp_path / "acc/model.safetensors"), load_weights(tmp_path / "ddp/model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-4, atol=1e-5)
    assert (tmp_path / "ddp" / "config.yaml").exists()
    assert (tmp_path / "ddp" / "checkpoints" / "step_00000020" / "manifest.json").exists()


def test_one_plain_process_and_mp_spawn(tmp_path, corpus):
    one = run_python(tiny_args(tmp_path / "one", corpus, batch_size=8, max_steps=6, save_every=0, eval_every=6),
                     tmp_path, script=TORCH_DDP).check()
    spawned = run_python(["--spawn", 2, *tiny_args(tmp_path / "spawn", corpus, batch_size=4, max_steps=6,
                                                   save_every=0, eval_every=6)],
                         tmp_path, script=TORCH_DDP).check()
    a, b = one.losses(), spawned.losses()
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5)


def test_resume_from_its_own_checkpoint_is_exact(tmp_path, corpus, torch_baseline):
    # a new run resumed from the finished reference run's step-16 checkpoint replays steps 17-24 exactly
    resumed = launch_torchrun([*baseline_args(tmp_path / "run", corpus), "--resume",
                               torch_baseline.output_dir / "checkpoints" / "step_00000016"], tmp_path).check()
    assert resumed.losses() == {s: v for s, v in torch_baseline.losses().items() if s > 16}
    reference, replayed = (load_weights(d / "model.safetensors") for d in (torch_baseline.output_dir, tmp_path / "run"))
    assert all(torch.equal(reference[k], replayed[k]) for k in reference)


def test_an_accelerate_checkpoint_resumes_on_the_torch_path(tmp_path, corpus, baseline):
    """One checkpoint format for both plumbings. Not bitwise (with dropout, the two paths put a global
    batch's samples on different ranks, so the per-rank dropout masks differ), but close."""
    checkpoint = baseline.output_dir / "checkpoints" / "step_00000016"
    resumed = launch_torchrun([*baseline_args(tmp_path / "run", corpus), "--resume", checkpoint], tmp_path).check()
    assert "(step 16)" in resumed.output
    losses, reference = resumed.losses(), baseline.losses()
    assert sorted(losses) == list(range(17, 25))
    assert losses[17] == pytest.approx(reference[17], rel=0.05)
