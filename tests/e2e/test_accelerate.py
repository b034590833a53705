"""The Accelerate path end to end: real `accelerate launch` runs on CPU, read back and compared."""

import json
import math
import os
import stat

import pytest
import torch
import yaml
from safetensors.torch import load_model

import batches
import data
from conftest import (
    FAULTY_MAIN,
    REPO,
    launch_accelerate,
    read_metrics,
    run_python,
    tiny_args,
    write_corpus,
)
from evaluation import evaluate
from model import build_model
from run_config import load_config
from torch_ddp import TorchDDP

pytestmark = pytest.mark.slow


def test_trains_writes_metrics_config_and_a_loadable_model(baseline):
    out = baseline.output_dir
    metrics = read_metrics(out)
    train_rows = [r for r in metrics if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 25))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "step_time_s", "epoch"):
        assert key in train_rows[-1]
    first, last = train_rows[:3], train_rows[-3:]
    assert sum(r["loss"] for r in last) < 0.8 * sum(r["loss"] for r in first), [
        r["loss"] for r in train_rows
    ]
    assert train_rows[-1]["epoch"] >= 1  # the run crossed an epoch boundary
    eval_rows = [r for r in metrics if "eval_loss" in r]
    assert [r["step"] for r in eval_rows] == [12, 24]
    info = json.loads((out / "run_info.json").read_text())
    assert info["processes"] == 2 and info["global_batch_size"] == 16
    for key in (
        "python",
        "torch",
        "accelerate",
        "datasets",
        "cuda",
        "nccl",
        "git",
        "git_dirty",
        "mixed_precision",
    ):
        # what docs/multi-node.md "Troubleshooting" says to compare between nodes
        assert key in info, key
    # how it was launched, to launch it again the same way
    launch = info["launches"][0]
    assert len(info["launches"]) == 1 and launch["command"][1:3] == [
        str(REPO / "train" / "main.py"),
        "--config",
    ]
    assert "accelerate.commands.launch" in launch["launcher_command"]
    config_file = str(REPO / "accelerate_configs" / "cpu.yaml")
    assert launch["launcher_config"] == {
        config_file: (REPO / "accelerate_configs" / "cpu.yaml").read_text()
    }
    assert launch["packages"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert (
        launch["environment"]["WORLD_SIZE"] == "2"
        and "git_diff" in launch
        and "git_untracked" in launch
    )
    umask = os.umask(0)
    os.umask(umask)
    for path in (
        out / "model.safetensors",
        out / "checkpoints" / "step_00000024" / "model.safetensors",
    ):
        # safetensors alone makes it 0600
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path
    saved_cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert saved_cfg["grad_accum_steps"] == 2 and saved_cfg["output_dir"] == str(out)
    # config.yaml reloads as-is
    assert load_config(["--config", str(out / "config.yaml")]).dropout == 0.1

    # the exported model loads into a fresh model and gives the logged eval loss over the eval set,
    # which has an odd number of samples: counting a padded duplicate would move the mean
    cfg = load_config(["--config", str(out / "config.yaml")])
    _, eval_set = data.build_datasets(cfg)
    assert len(eval_set) % (cfg.batch_size * 2) != 0, (
        "the eval set must not divide evenly into 2 ranks' batches"
    )
    model = build_model(cfg)
    # strict: every tensor (tied ones are stored once)
    load_model(model, str(out / "model.safetensors"))
    loader = torch.utils.data.DataLoader(eval_set, batch_size=5, collate_fn=data.collate)
    metrics = evaluate(
        model, {"": loader}, TorchDDP(cfg), cfg
    )  # one dataset: its eval set, unnamed
    assert metrics["eval_loss"] == pytest.approx(eval_rows[-1]["eval_loss"], rel=1e-5)
    assert metrics["eval_accuracy"] == pytest.approx(eval_rows[-1]["eval_accuracy"], rel=1e-5)


def test_each_rank_trains_on_its_own_part_of_every_global_batch(corpus, four_processes):
    """What each of the session's 4 processes loaded (batch 4, 8 steps): rank r gets samples [4r, 4r + 4) of every
    global batch of 16, in the sampler's order, so no sample is seen twice and none is skipped."""
    cfg = load_config(tiny_args(four_processes.output_dir.parent / "probe", corpus))
    order = list(
        batches.EpochSampler(len(data.build_datasets(cfg)[0]), cfg.seed, samples_per_step=16)
    )
    loaded = [
        json.loads((four_processes.output_dir.parent / "ids" / f"rank{r}.json").read_text())
        for r in range(4)
    ]
    for step in range(8):  # (a loader's read-ahead records a few more at the end)
        global_batch = order[step * 16 : (step + 1) * 16]
        assert [rank[step * 4 : (step + 1) * 4] for rank in loaded] == [
            global_batch[r * 4 : (r + 1) * 4] for r in range(4)
        ]


def test_one_and_four_processes_agree_at_the_same_global_batch(tmp_path, corpus, four_processes):
    """1 process x batch 16 against 4 x 4 (the session's 4-process run): the same samples in every step, so
    the losses agree to float-summation tolerance."""
    one = run_python(
        tiny_args(tmp_path / "one", corpus, batch_size=16, max_steps=8, save_every=4, eval_every=8),
        tmp_path,
    ).check()
    a, b = one.losses(), four_processes.losses()
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), (step, a[step], b[step])


def test_bad_value_through_the_launcher(tmp_path, corpus):
    out = tmp_path / "run"
    out.mkdir()
    run = launch_accelerate([*tiny_args(out, corpus), "--lr", "-1"], tmp_path)
    assert run.returncode != 0
    lines = run.output.splitlines()
    assert sum(line.startswith("error: lr must be > 0 (got -1.0)") for line in lines) == 1, (
        run.tail()
    )
    # and again in the launcher's closing summary ("Root Cause"), where it is seen, not 40 lines up
    assert any("error: lr must be > 0 (got -1.0)" in line for line in lines[-12:]), "\n".join(
        lines[-15:]
    )
    assert list(out.iterdir()) == []


def test_dataset_too_small_for_one_step(tmp_path):
    small = write_corpus(tmp_path / "small.jsonl", n_docs=20, doc_bytes=40)
    out = tmp_path / "run"
    run = run_python(tiny_args(out, small, batch_size=16, grad_accum_steps=4), tmp_path)
    assert run.returncode != 0
    assert (
        "training samples is too few for one optimizer step at world size 1 x batch_size 16 x "
        "grad_accum_steps 4 = 64 samples" in run.output
    ), run.tail()
    assert not out.exists()


def test_a_diverged_loss_stops_the_run_before_it_saves_broken_weights(tmp_path, corpus):
    """nan on one rank from step 6; the next check is step 8, a save step between logging steps (10)."""
    run_dir = tmp_path / "run"
    args = tiny_args(run_dir, corpus, max_steps=12, save_every=4, log_every=10)
    # one rank's loss: the mean is nan
    run = launch_accelerate(
        args, tmp_path, script=FAULTY_MAIN, env_extra={"FAULT_NAN_STEP": 6, "FAULT_RANK": 1}
    )
    assert run.returncode != 0
    errors = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: loss is nan at step 8: training diverged; resume from "
        f"{run_dir / 'checkpoints' / 'step_00000004'} with a lower lr or more warmup_steps"
    ], run.tail()
    losses = run.losses()
    # JSON has no nan
    assert sorted(losses) == [4, 8] and math.isfinite(losses[4]) and losses[8] is None
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [
        "step_00000004"
    ]  # step 8 never committed
    assert not (run_dir / "model.safetensors").exists()
    # the advice works: resume from step 4 with a lower lr and more warmup
    resumed = launch_accelerate(
        [*args, "--lr", 1e-3, "--warmup_steps", 8, "--resume", "latest"], tmp_path
    ).check()
    assert "(step 4)" in resumed.output
    assert sorted(resumed.losses()) == [4, 8, 10, 12] and all(resumed.losses().values())
    assert (run_dir / "model.safetensors").exists()


def test_the_launch_config_sets_the_precision_unless_the_training_config_does(tmp_path, corpus):
    """single_gpu.yaml says bf16: that is what the run uses (bf16 autocast works on CPU too), unless the
    training config names a precision itself."""
    single_gpu = REPO / "accelerate_configs" / "single_gpu.yaml"
    for name, extra, expected in (
        ("launcher", [], "bf16"),
        ("explicit", ["--mixed_precision", "no"], "no"),
    ):
        out = tmp_path / name
        launch_accelerate(
            [*tiny_args(out, corpus, max_steps=5, save_every=0), *extra],
            tmp_path,
            num_processes=1,
            config=single_gpu,
        ).check()
        assert json.loads((out / "run_info.json").read_text())["mixed_precision"] == expected, name
    assert "wins over the launcher" in load_config.__globals__["usage"]()
