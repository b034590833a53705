"""The template's promises, kept for every task in examples/ (an image classifier with BatchNorm, a text
classifier on a Hugging Face encoder, a GRU language model without blocks), each installed as a fork does:
its model.py and data.py copied over train/'s in a copy of the repository. The shipped causal LM keeps the
same promises in the rest of the suite. For each example, with 2 processes and an eval set whose size the
ranks and batches do not divide:
    - it learns, and main.py (accelerate launch) and torch_ddp.py (torchrun) train it bitwise alike
      (the GRU's task and data are the shipped LM's: test_torch_ddp.py);
    - each eval metric equals an independent computation over exactly the eval set, from the export;
    - the W&B offline run holds the task's own metrics;
    - a SIGTERM (checkpoint, exit 75) and a SIGKILL of one rank each resume to the same bits;
    - BatchNorm with broadcast_buffers off (the image classifier trains so): each rank's statistics
      resume with it, and the evaluation and the export use the same (the ranks' mean);
    - FSDP2 trains it where the model declares blocks (skipped, with the reason, where not).
"""

import csv
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import (
    REPO,
    TINY,
    base_env,
    fork_with,
    launch_accelerate,
    launch_torchrun,
    load_weights,
    read_metrics,
    run,
    tiny_args,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from wandb_reader import read_run  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLES = REPO / "examples"
INDEPENDENT_EVAL = REPO / "tests" / "helpers" / "independent_eval.py"


def make_fork(root: Path, example: str) -> Path:
    """A copy of the repository with train/model.py and train/data.py replaced by the example's."""
    return fork_with(root, EXAMPLES / example / "model.py", EXAMPLES / example / "data.py")


def write_images(folder: Path) -> Path:
    """Three classes of 24x24 images told apart by where a bright square sits, in noise (37 each)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for name, column in {"left": 0, "middle": 8, "right": 16}.items():
        (folder / name).mkdir(parents=True)
        for i in range(37):
            pixels = rng.integers(0, 140, (24, 24, 3), dtype=np.uint8)
            pixels[8:16, column : column + 8] += 100
            Image.fromarray(pixels).save(folder / name / f"{i:03d}.png")
    return folder


WORDS = {
    "pos": ["great", "fine", "lovely", "superb", "good", "moving"],
    "neg": ["dull", "awful", "bad", "boring", "weak", "poor"],
}
FILLER = ["the", "film", "was", "a", "story", "and", "acting", "plot", "quite", "really"]


def write_reviews(path: Path) -> Path:
    """230 reviews of 5 to 11 words, labelled pos or neg by the three words of feeling they hold: texts of
    different lengths, so batches are padded."""
    rng = random.Random(0)
    with open(path, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["text", "label"])
        for _ in range(230):
            label = rng.choice(["pos", "neg"])
            words = [rng.choice(FILLER) for _ in range(rng.randint(2, 8))]
            for _ in range(3):
                words.insert(rng.randint(0, len(words)), rng.choice(WORDS[label]))
            writer.writerow([" ".join(words), label])
    return path


def write_word_tokenizer(reviews: Path, folder: Path) -> Path:
    """The reviews' words as a Hugging Face tokenizer folder, made offline as the README tells a user
    to (scripts/word_tokenizer.py)."""
    result = run(
        [sys.executable, str(REPO / "scripts/word_tokenizer.py"), str(reviews), str(folder)],
        base_env(folder.parent),
        timeout=120,
    )
    assert result.returncode == 0 and f"--tokenizer {folder}" in result.stdout, result.stdout
    return folder


def write_lm_reviews(path: Path) -> Path:
    with open(path, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["stars", "review"])
        for i in range(300):
            writer.writerow([5, f"review {i}: " + "good value, would buy again. " * 3])
    return path


def example_args(example: str, root: Path) -> list[str]:
    """Each example's data, written here, and the flags that train it in a few seconds."""
    if example == "image_classification":
        data = ["--dataset", write_images(root / "shapes"), "--eval_fraction", 0.2, "--lr", 3e-3]
        # each rank keeps its own BatchNorm statistics (DDP's default copies rank 0's at every
        # forward): the harder path, whose per-rank checkpoints, resume and export it tests
        data += ["--broadcast_buffers", "false"]
    elif example == "text_classification":
        reviews = write_reviews(root / "reviews.csv")
        tokenizer = write_word_tokenizer(reviews, root / "tokenizer")
        data = [
            "--dataset",
            reviews,
            "--tokenizer",
            tokenizer,
            "--eval_fraction",
            0.2,
            "--lr",
            3e-3,
        ]
        data += ["--layers", 1, "--hidden_width", 32, "--heads", 2]
    else:
        data = [
            "--dataset",
            write_lm_reviews(root / "lm.csv"),
            "--text_column",
            "review",
            "--lr",
            1e-2,
        ]
        data += ["--layers", 1]
    return [str(value) for value in data]


class Example:
    def __init__(self, name: str, root: Path):
        self.name, self.root = name, root
        # a BERT from fresh weights is slow to leave chance (measured: ~60 steps of 16 reviews with
        # AdamW at 1e-3), so it trains longer, and is held to less: its loss falls below chance's
        self.steps = 32 if name == "text_classification" else 16
        self.learns_to = 0.98 if name == "text_classification" else 0.8
        self.fork = make_fork(root, name)
        self.config = TINY  # its lm: section left out where the fork does not declare it
        self.data = example_args(name, root)
        self.main = self.fork / "train" / "main.py"
        self.torch_ddp = self.fork / "train" / "torch_ddp.py"
        self.faulty = self.fork / "tests" / "helpers" / "faulty_main.py"

    def args(self, output_dir: Path, **overrides) -> list[str]:
        half = self.steps // 2
        values = dict(max_steps=self.steps, save_every=half, eval_every=half, warmup_steps=2)
        values["batch_size"] = 4
        # the shipped LM's data key: only the GRU's data.py declares it
        values["block_size"] = 32 if self.name == "gru_language_model" else None
        values.update(overrides)
        return [*tiny_args(output_dir, Path("unused"), config=self.config, **values), *self.data]


@pytest.fixture(
    scope="module", params=["image_classification", "text_classification", "gru_language_model"]
)
def example(request, tmp_path_factory):
    return Example(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def trained(example):
    """The example's baseline: accelerate launch, 2 processes, W&B offline."""
    run_dir = example.root / "baseline"
    args = [*example.args(run_dir), "--tracker", "wandb"]
    return launch_accelerate(args, example.root, script=example.main).check()


def same_bits(run_dir: Path, baseline_dir: Path) -> None:
    """The same losses, eval metrics and exported weights, to the bit."""
    losses = {row["step"]: row["loss"] for row in read_metrics(run_dir) if "loss" in row}
    expected = {row["step"]: row["loss"] for row in read_metrics(baseline_dir) if "loss" in row}
    assert losses == expected
    evals, expected_evals = (
        {
            row["step"]: row
            for row in read_metrics(folder)
            if "eval_accuracy" in row or "eval_loss" in row
        }
        for folder in (run_dir, baseline_dir)
    )
    assert evals and evals == expected_evals
    weights, baseline = (
        load_weights(run_dir / "model.safetensors"),
        load_weights(baseline_dir / "model.safetensors"),
    )
    assert weights.keys() == baseline.keys()
    assert all(weights[key].equal(baseline[key]) for key in weights), "the exported weights differ"


def test_it_learns_and_both_paths_train_it_bitwise_alike(example, trained):
    losses = trained.losses()
    steps = example.steps
    first = sum(losses[s] for s in (1, 2, 3)) / 3
    last = sum(losses[s] for s in (steps - 2, steps - 1, steps)) / 3
    assert last < example.learns_to * first, losses
    if example.name == "gru_language_model":
        return  # its task and data path are the shipped LM's, whose two paths test_torch_ddp.py holds
    torch_path = example.root / "torch_path"
    launch_torchrun(example.args(torch_path), example.root, script=example.torch_ddp).check()
    same_bits(torch_path, trained.output_dir)


def test_each_eval_metric_is_an_independent_count_over_exactly_the_eval_set(example, trained):
    rows = read_metrics(trained.output_dir)
    reported = next(row for row in reversed(rows) if any(key.startswith("eval_") for key in row))
    result = run(
        [sys.executable, str(INDEPENDENT_EVAL), str(example.fork), str(trained.output_dir)],
        base_env(example.root),
    )
    assert result.returncode == 0, result.stdout[-3000:]
    independent = json.loads(result.stdout.strip().splitlines()[-1])
    info = json.loads((trained.output_dir / "run_info.json").read_text())
    assert (
        info["eval_samples"] % (2 * 4) != 0
    )  # the last batches are padded, and the copies dropped
    if example.name == "gru_language_model":
        assert reported["eval_loss"] == pytest.approx(independent["loss"], rel=1e-5)
        return
    # every metric the task reports, each against its independent count: none left unchecked
    checked = {
        key.removeprefix("eval_"): v for key, v in reported.items() if key.startswith("eval_")
    }
    per_class = "accuracy/" if example.name == "image_classification" else "f1/"
    assert any(key.startswith(per_class) for key in checked), checked
    if example.name == "text_classification":
        assert {"f1", "f1_macro"} <= set(checked), checked
    for key, value in checked.items():
        tolerance = {"rel": 1e-5} if key == "loss" else {"abs": 1e-12}  # loss: float32 sums
        assert value == pytest.approx(independent[key], **tolerance), key
    (wandb_run,) = [read_run(p) for p in trained.output_dir.glob("wandb/offline-run-*/run-*.wandb")]
    logged = [row for row in wandb_run["history"] if "eval_accuracy" in row]
    assert [row["eval_accuracy"] for row in logged][-1] == reported["eval_accuracy"]
    assert all(f"eval_{key}" in logged[-1] for key in checked)


def test_a_preemption_then_a_killed_rank_each_resume_to_the_same_bits(example, trained):
    """One run through both faults: SIGTERM to every rank at step 5, a checkpoint at 5, exit 75;
    --resume latest, then a SIGKILL of rank 1 three steps after the mid-run checkpoint, the job
    fails, that checkpoint stays; --resume latest again ends bitwise as the baseline. The
    classifiers' data (decoded images, padded texts) and models; the GRU's task and data path are
    the shipped LM's (packed blocks, lm.py's loss), whose resumes tests/e2e/test_resume.py holds."""
    if example.name == "gru_language_model":
        pytest.skip("a causal LM's packed blocks resume as the shipped LM's do (test_resume.py)")
    run_dir = example.root / "faulted_run"
    args = example.args(run_dir)
    env = {"FAULT_STEP": 5, "FAULT_ACTION": "sigterm", "FAULT_ONCE": example.root / "sigterm.once"}
    preempted = launch_accelerate(args, example.root, script=example.faulty, env_extra=env)
    # a rank exits 75 once the checkpoint is published (the launcher itself reports 1; it may stop
    # the other rank with its own SIGTERM before that one's exit is seen, after the save)
    assert "exitcode  : 75" in preempted.output, preempted.tail()
    assert json.loads((run_dir / "preempted.json").read_text())["step"] == 5
    middle = example.steps // 2
    env = {"FAULT_STEP": middle + 3, "FAULT_ACTION": "sigkill", "FAULT_RANK": 1}
    env["FAULT_ONCE"] = example.root / "sigkill.once"
    resume_args = [*args, "--resume", "latest"]
    killed = launch_accelerate(resume_args, example.root, script=example.faulty, env_extra=env)
    assert killed.returncode != 0 and "(step 5)" in killed.output, killed.tail()
    resumed = launch_accelerate(resume_args, example.root, script=example.main).check()
    assert f"(step {middle})" in resumed.output
    same_bits(run_dir, trained.output_dir)


def test_fsdp2_trains_it_where_the_model_declares_blocks(example):
    if example.name != "text_classification":
        pytest.skip(
            f"{example.name}'s model declares no blocks (_no_split_modules): FSDP has no unit to shard"
        )
    run_dir = example.root / "fsdp"
    args = [*example.args(run_dir, max_steps=8), "--fsdp", "full"]
    trained = launch_torchrun(args, example.root, script=example.torch_ddp).check()
    losses = trained.losses()
    assert len(losses) == 8 and all(np.isfinite(list(losses.values())))
    assert any("eval_f1" in row for row in read_metrics(run_dir))
    assert (run_dir / "model.safetensors").exists()


def test_batchnorm_without_broadcast_buffers_checkpoints_each_rank_and_exports_their_mean(
    example, trained
):
    """The image classifier trains with broadcast_buffers off (example_args): each rank keeps its
    own running statistics, checkpointed per rank (a SIGTERM and a SIGKILL resume them to the same
    bits: test_a_preemption_then_a_killed_rank_...), and the export holds their mean over the ranks,
    as the last checkpoint holds them per rank: an independent number, not the evaluation's (which
    uses the same statistics; the evaluation equals the export's: test_each_eval_metric_...)."""
    if example.name != "image_classification":
        pytest.skip(f"{example.name} has no BatchNorm")
    run_dir = trained.output_dir
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    ranks = [load_weights_pt(last / f"buffers_rank{r}.pt") for r in (0, 1)]
    exported = load_weights(run_dir / "model.safetensors")
    statistics = [n for n in ranks[0] if n.endswith(("running_mean", "running_var"))]
    assert statistics and any(not ranks[0][n].equal(ranks[1][n]) for n in statistics)
    for name in statistics:
        mean = (ranks[0][name].double() + ranks[1][name].double()) / 2
        assert torch.allclose(exported[name].double(), mean, rtol=1e-6, atol=1e-7), name


def load_weights_pt(path: Path) -> dict:
    import torch

    return torch.load(path, weights_only=True)


def test_sample_py_on_a_classifier_s_run_is_one_line(example, trained):
    """scripts/sample.py samples causal LMs: on a classifier's run it says so in one line (it was a
    TypeError traceback), and on the GRU language model it samples."""
    result = run(
        [sys.executable, str(example.fork / "scripts" / "sample.py"), str(trained.output_dir)],
        base_env(example.root),
    )
    if example.name == "gru_language_model":
        assert result.returncode == 0, result.stdout[-3000:]
        return
    lines = [line for line in result.stdout.splitlines() if line.startswith(("error", "Traceback"))]
    assert result.returncode == 1
    assert len(lines) == 1 and lines[0].startswith(
        f"error: sample.py samples causal language models, and the model of {trained.output_dir} "
        "is not one"
    ), result.stdout[-3000:]
