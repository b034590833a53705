"""scripts/sweep.py end to end: trials that are normal runs of the launch command, a driver killed with its
whole process group and started again (no finished trial rerun, the interrupted one resumed and ending
bitwise as the same trial run straight through), W&B runs grouped by sweep, pruning by SIGTERM, and a
failed trial recorded as failed."""

import json
import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
import yaml

from conftest import FAULTY_MAIN, MAIN, REPO, base_env, read_metrics, run, tiny_args

sys.path.insert(0, str(REPO / "tests" / "helpers"))
from wandb_reader import read_run  # noqa: E402

pytestmark = pytest.mark.slow

SWEEP = REPO / "scripts" / "sweep.py"


def trial_args(corpus, **overrides) -> list[str]:
    """tiny_args without --output_dir: the sweep gives each trial its own."""
    args = [str(a) for a in tiny_args("unused", corpus, **overrides)]
    at = args.index("--output_dir")
    return args[:at] + args[at + 2 :]


def write_space(path, **space) -> str:
    path.write_text(yaml.safe_dump(space))
    return str(path)


def study_of(sweep_dir) -> optuna.Study:
    return optuna.load_study(
        study_name=sweep_dir.name, storage=f"sqlite:///{sweep_dir / 'study.db'}"
    )


def test_a_killed_driver_resumes_its_trial_bitwise_and_reruns_no_finished_one(tmp_path, corpus):
    sweep_dir = tmp_path / "lr_sweep"
    space = write_space(
        tmp_path / "space.yaml",
        objective="eval_loss",
        parameters={"lr": {"low": 1e-3, "high": 1e-2, "log": True}},
    )
    args = trial_args(corpus, max_steps=16, eval_every=8, save_every=8)
    launch = [sys.executable, str(FAULTY_MAIN), *args]
    driver_cmd = [sys.executable, str(SWEEP), "--sweep_dir", str(sweep_dir), "--space", space]
    driver_cmd += ["--trials", "2", "--poll_s", "0.2", "--", *launch]
    # a logging step lasts 0.1 s: the kill lands inside the second trial, after its checkpoint at 8
    env = base_env(tmp_path, FAULT_SLOW_S=0.1)
    driver = subprocess.Popen(
        driver_cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    second = sweep_dir / "trial_001"
    deadline = time.time() + 180
    while time.time() < deadline and driver.poll() is None:
        if (second / "metrics.jsonl").exists() and max(
            (r["step"] for r in read_metrics(second)), default=0
        ) >= 11:
            break
        time.sleep(0.1)
    os.killpg(driver.pid, signal.SIGKILL)  # the driver and the trial it runs, at once
    first_output, _ = driver.communicate(timeout=30)
    assert "trial 0: eval_loss" in first_output and "trial 1: eval_loss" not in first_output, (
        first_output
    )
    assert not (second / "model.safetensors").exists()
    # started again, with the same command line
    again = run(driver_cmd, env, timeout=180)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "trial 1: resuming from its last checkpoint" in again.stdout, again.stdout
    study = study_of(sweep_dir)
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    launches = [
        json.loads((sweep_dir / f"trial_{n:03d}" / "run_info.json").read_text())["launches"]
        for n in (0, 1)
    ]
    assert len(launches[0]) == 1  # the finished trial was not run again
    assert len(launches[1]) == 2 and "--resume" in launches[1][1]["command"]
    assert "(step 8)" in (sweep_dir / "logs" / "trial_001.log").read_text()
    # the interrupted trial ends bitwise as the same trial run straight through, outside any sweep
    lr = trials[1].params["lr"]
    assert yaml.safe_load((second / "config.yaml").read_text())["lr"] == lr
    straight = tmp_path / "straight"
    straight_args = [*args, "--lr", repr(lr), "--output_dir", str(straight)]
    direct = run([sys.executable, str(MAIN), *straight_args], base_env(tmp_path))
    assert direct.returncode == 0, direct.stdout[-2000:]
    assert (second / "model.safetensors").read_bytes() == (
        straight / "model.safetensors"
    ).read_bytes()

    def logged(folder):
        rows = read_metrics(folder)
        return [(r["step"], r.get("loss"), r.get("eval_loss")) for r in rows if "start" not in r]

    assert logged(second) == logged(straight)
    assert (
        trials[1].value
        == [row for row in read_metrics(straight) if "eval_loss" in row][-1]["eval_loss"]
    )
    # the summary: the table (trials.csv too) and the plot
    assert "best: trial" in again.stdout and (sweep_dir / "objective.png").stat().st_size > 0
    rows = (sweep_dir / "trials.csv").read_text().splitlines()
    assert rows[0].startswith("trial,state,eval_loss,step,lr") and rows[2].startswith("1,complete,")


def test_a_pruned_trial_checkpoints_a_failed_one_is_recorded_and_a_broken_command_is_one_line(
    tmp_path, corpus
):
    sweep_dir = tmp_path / "pruning"
    # ThresholdPruner(lower=100): every first evaluation is below it, so every trial that gets there is pruned
    space = write_space(
        tmp_path / "space.yaml",
        objective="eval_loss",
        parameters={"warmup_steps": {"choices": [1, 2]}},
        pruner={"name": "ThresholdPruner", "lower": 100.0},
    )
    args = trial_args(corpus, max_steps=40, eval_every=4, save_every=0, tracker="wandb")
    # the first trial's loss goes nan at step 3: it fails (exit 1); the second trains until it is pruned
    env = base_env(tmp_path, FAULT_NAN_STEP=3, FAULT_ONCE=tmp_path / "once")
    driver = [
        sys.executable,
        str(SWEEP),
        "--sweep_dir",
        str(sweep_dir),
        "--space",
        space,
        "--trials",
        "2",
    ]
    result = run(
        [*driver, "--poll_s", "0.2", "--", sys.executable, str(FAULTY_MAIN), *args],
        env,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    failed, pruned = study_of(sweep_dir).get_trials()
    assert failed.state.name == "FAIL" and "training diverged" in failed.user_attrs["error"]
    assert "trial 0: failed (exit 1): error: loss is nan at step 3" in result.stdout
    assert pruned.state.name == "PRUNED" and sorted(pruned.intermediate_values)[0] == 4
    # SIGTERM, as a preemption: the trial checkpointed, and could be resumed by hand
    marker = json.loads((sweep_dir / "trial_001" / "preempted.json").read_text())
    assert 4 <= marker["step"] < 40 and (sweep_dir / "trial_001" / "checkpoints").is_dir()
    # each trial is a W&B run in the sweep's group, its parameters in its config
    wandb_run = read_run(
        next((sweep_dir / "trial_001" / "wandb").glob("offline-run-*/run-*.wandb"))
    )
    assert (
        wandb_run["group"] == "pruning"
        and wandb_run["config"]["warmup_steps"] == pruned.params["warmup_steps"]
    )
    assert wandb_run["config"]["run_name"] == "pruning-001"
    table = result.stdout.splitlines()
    assert any(line.split()[:2] == ["0", "fail"] for line in table)
    assert any(
        line.split()[:3] == ["1", "pruned", f"{pruned.intermediate_values[4]:.4g}"]
        for line in table
    )
    # a launch command that cannot train at all (a typo in the script's name) stops the sweep at its
    # first trial, in one line
    broken = [sys.executable, str(REPO / "train" / "mian.py"), *args]
    stopped = run(
        [*driver[:2], "--sweep_dir", str(tmp_path / "broken"), "--space", space, "--", *broken], env
    )
    assert stopped.returncode == 2
    said = stopped.stdout.strip().splitlines()
    assert said[-1].startswith(
        "error: the launch command failed before training (trial 0, exit 2): "
    )
    assert "mian.py" in said[-1] and not (tmp_path / "broken" / "trial_001").exists()
