"""What a newcomer meets in the first hour, through the real entry points: the error torchrun shows,
extending a run, a fork whose model breaks the loss contract. (A fork's whole task, for each of examples/:
tests/e2e/test_examples.py.)
(Also first-hour checks, folded into runs that exist anyway: file modes and run_info in
test_accelerate.py, a quiet W&B in test_tracking_runs.py, the debug preset in test_reliability.py.)"""

import pytest

from conftest import (
    REPO,
    TORCH_DDP,
    launch_torchrun,
    read_metrics,
    run_python,
    tiny_args,
)

pytestmark = pytest.mark.slow


def test_the_torchrun_summary_ends_with_our_error(tmp_path, corpus):
    """(accelerate launch: tests/e2e/test_accelerate.py::test_bad_value_through_the_launcher)"""
    result = launch_torchrun(
        [*tiny_args(tmp_path / "run", corpus), "--lr", "-1"], tmp_path, script=TORCH_DDP
    )
    assert result.returncode != 0
    lines = result.output.splitlines()
    assert sum(line.startswith("error: lr must be > 0") for line in lines) == 1
    # the launcher's summary ("Root Cause") closes the output: our line is in it, not 40 lines up
    assert any("error: lr must be > 0 (got -1.0)" in line for line in lines[-12:]), "\n".join(
        lines[-15:]
    )


def test_extending_a_run_keeps_the_lr_horizon_and_a_run_ends_with_its_summary(tmp_path, corpus):
    run_dir = tmp_path / "run"
    first = run_python(
        tiny_args(run_dir, corpus, max_steps=20, save_every=10, eval_every=5, warmup_steps=2),
        tmp_path,
    ).check()
    # the summary: the last and the best evaluation as metrics.jsonl has them, the next commands
    evaluations = [row for row in read_metrics(run_dir) if "eval_loss" in row]
    best = min(evaluations, key=lambda row: row["eval_loss"])
    summary = first.output[first.output.index("done: step 20 in ") :]
    assert f"final eval (step 20): eval_loss {evaluations[-1]['eval_loss']:.4g}" in summary
    assert f"best eval_loss: {best['eval_loss']:.4g} at step {best['step']}" in summary
    assert f"model: {run_dir / 'model.safetensors'}" in summary
    assert f"--output_dir {run_dir} --resume latest --max_steps 40" in summary
    # (a max_steps below the checkpoint's step is refused: tests/test_checkpoint.py)
    extended = run_python(
        [*tiny_args(run_dir, corpus, max_steps=30, warmup_steps=2), "--resume", "latest"], tmp_path
    ).check()
    assert "its horizon stays at step 20 (min_lr after it) while max_steps is 30" in extended.output
    lrs = {row["step"]: row["lr"] for row in read_metrics(run_dir) if "lr" in row}
    # tiny.yaml's min_lr, not re-stretched
    assert all(lrs[step] == pytest.approx(3e-4) for step in range(21, 31))


@pytest.mark.shipped  # subclasses the shipped GPT (the contract itself: tests/test_lm.py)
def test_a_fork_model_whose_loss_forgets_the_shift_stops_at_start_up(tmp_path, corpus):
    wrapper = tmp_path / "unshifted.py"
    wrapper.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO / 'train')!r})\n"
        "import torch.nn.functional as F\n"
        "import main, model\n"
        "class Unshifted(model.GPT):\n"
        "    def forward(self, input_ids, labels=None):\n"
        "        out = super().forward(input_ids)\n"
        "        out.loss = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())  # no next-token shift\n"
        "        return out\n"
        "main.task.build_model = lambda cfg: Unshifted(256, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd, 0.0)\n"
        "main.main()\n"
    )
    result = run_python(tiny_args(tmp_path / "run", corpus), tmp_path, script=wrapper)
    assert result.returncode == 2 and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: train/model.py: the model's .loss (")
    assert "is not the loss its eval_columns and eval_metrics report" in errors[0]
