"""What a newcomer meets in the first hour, through the real entry points: the error torchrun shows,
extending a run, a fork whose model breaks the loss contract, and the template's tests in a fork.
(Also first-hour checks, folded into runs that exist anyway: file modes and run_info in
test_accelerate.py, a quiet W&B in test_tracking_runs.py, the debug preset in test_reliability.py.)"""

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from conftest import (
    REPO,
    TORCH_DDP,
    base_env,
    launch_torchrun,
    read_metrics,
    run,
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


def test_extending_a_run_keeps_the_lr_horizon(tmp_path, corpus):
    run_dir = tmp_path / "run"
    run_python(
        tiny_args(run_dir, corpus, max_steps=20, save_every=10, warmup_steps=2), tmp_path
    ).check()
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
        "main.build_model = lambda cfg: Unshifted(256, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd, 0.0)\n"
        "main.main()\n"
    )
    result = run_python(tiny_args(tmp_path / "run", corpus), tmp_path, script=wrapper)
    assert result.returncode == 2 and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: model: its .loss (")
    assert "is not the next-token cross-entropy of its .logits" in errors[0]


# a GRU language model and CSV reviews, written as a fork's
FORK_FILES = REPO / "tests" / "helpers" / "fork"


def make_fork(root: Path) -> Path:
    """A copy of the repository whose train/model.py and train/data.py are replaced whole by the fork's."""
    fork = root / "fork"
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    files = listed.stdout.split() if listed.returncode == 0 else []
    if not files:  # not a git checkout: the folders a fork has
        folders = ("train", "tests", "data", "accelerate_configs", "scripts", "bench")
        files = [
            str(p.relative_to(REPO)) for f in folders for p in (REPO / f).rglob("*") if p.is_file()
        ]
        files.append("pyproject.toml")
    for name in files:
        if "__pycache__" in name or not (REPO / name).is_file():
            continue
        (fork / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, fork / name)
    shutil.copy(FORK_FILES / "model.py", fork / "train" / "model.py")
    shutil.copy(FORK_FILES / "data.py", fork / "train" / "data.py")
    return fork


def test_a_fork_that_replaced_model_and_data_whole_keeps_every_template_promise(tmp_path):
    """The README's recipe, done whole: model.py and data.py replaced by a fork's own files (a GRU LM, CSV
    reviews with a `review` column). The fork trains on its data, and the template's tests (`-m "not
    shipped"`, the whole tier, slow ones too) pass in it unchanged."""
    fork = make_fork(tmp_path)
    reviews = tmp_path / "reviews.csv"
    with open(reviews, "w", newline="") as out:  # commas inside the text: quoted as CSV does
        writer = csv.writer(out)
        writer.writerow(["stars", "review"])
        for i in range(300):
            writer.writerow([5, f"review {i}: " + "good value, would buy again. " * 3])
    own = [
        *tiny_args(tmp_path / "own", reviews, max_steps=30, eval_every=30, save_every=15),
        *["--text_column", "review", "--lr", "1e-2", "--n_layer", "1"],
    ]
    trained = run_python(own, tmp_path, script=fork / "train" / "main.py").check()
    losses = trained.losses()
    assert losses[30] < 0.6 * losses[1], losses
    with safe_open(str(tmp_path / "own" / "model.safetensors"), "pt") as weights:
        # the fork's model
        assert {"embed.weight", "head.weight", "head.bias"} <= set(weights.keys())

    this_test = (
        "tests/e2e/test_first_hour.py::"
        + test_a_fork_that_replaced_model_and_data_whole_keeps_every_template_promise.__name__
    )
    suite = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not shipped"]
    result = run([*suite, "--deselect", this_test], base_env(tmp_path), cwd=fork, timeout=2400)
    summary = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0, result.stdout[-6000:]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
