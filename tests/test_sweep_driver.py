"""scripts/sweep.py's driver against a stand-in trial (tests/helpers/fake_trial.py: metrics rows in
milliseconds, SIGTERM -> preempted.json and exit 75): pruning, a failed trial, the driver's own stop and
restart, the summary. Real runs of the template, killed and resumed bitwise: tests/e2e/test_sweep.py."""

import json
import os
import shlex
import signal
import sys
import threading

import optuna
import pytest
import yaml

from conftest import REPO
from test_sweep_inputs import sweep_script

FAKE = [sys.executable, str(REPO / "tests" / "helpers" / "fake_trial.py")]


def write_space(path, **space) -> str:
    path.write_text(yaml.safe_dump({"objective": "eval_loss", **space}))
    return str(path)


def driver_argv(sweep_dir, space: str, trials: int) -> list[str]:
    """The driver's flags over the stand-in trial, polling fast."""
    return [
        *("--sweep_dir", str(sweep_dir), "--space", space, "--trials", str(trials)),
        *("--poll_s", "0.02", "--", *FAKE),
    ]


def trials_of(sweep_dir) -> list:
    storage = f"sqlite:///{sweep_dir / 'study.db'}"
    return optuna.load_study(study_name=sweep_dir.name, storage=storage).get_trials()


def launches(run_dir) -> list[list[str]]:
    return [json.loads(line) for line in (run_dir / "argv.jsonl").read_text().splitlines()]


@pytest.fixture
def own_signals():
    """The driver runs in this process and installs its SIGTERM/SIGINT handlers: put pytest's back."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_a_failed_trial_is_recorded_once_and_pruned_ones_get_sigterm(
    tmp_path, capsys, own_signals, monkeypatch
):
    sweep_dir = tmp_path / "pruning"
    # every eval_loss is over 20 (lr x 100): ThresholdPruner(upper=10) prunes each trial at its first
    space = write_space(
        tmp_path / "space.yaml",
        parameters={"lr": {"low": 0.2, "high": 0.5}},
        pruner={"name": "ThresholdPruner", "upper": 10.0},
    )
    monkeypatch.setenv("FAKE_FAIL_ONCE", str(tmp_path / "failed"))
    argv = driver_argv(sweep_dir, space, trials=3)
    assert sweep_script().main(argv) == 0
    out = capsys.readouterr().out
    failed, *pruned = trials_of(sweep_dir)
    # the first trial failed after training began: recorded with its line, never run again
    assert failed.state.name == "FAIL" and failed.user_attrs["error"].startswith(
        "error: loss is nan at step 2"
    )
    assert "trial 0: failed (exit 1): error: loss is nan at step 2" in out
    assert len(launches(sweep_dir / "trial_000")) == 1
    for trial in pruned:  # SIGTERM at the first eval row: the trial's own stop, with its checkpoint
        assert trial.state.name == "PRUNED" and sorted(trial.intermediate_values) == [4]
        run_dir = sweep_dir / f"trial_{trial.number:03d}"
        assert json.loads((run_dir / "preempted.json").read_text())["step"] >= 4
        flags = launches(run_dir)[0]
        assert flags[flags.index("--lr") + 1] == repr(trial.params["lr"])
        assert flags[flags.index("--wandb_group") + 1] == "pruning"
        assert flags[flags.index("--run_name") + 1] == f"pruning-{trial.number:03d}"
    # the summary: the table (trials.csv too) and the plot
    table = [line.split()[:2] for line in out.splitlines()]
    assert ["0", "fail"] in table and ["1", "pruned"] in table and ["2", "pruned"] in table
    assert (
        (sweep_dir / "trials.csv")
        .read_text()
        .startswith("trial,state,eval_loss,step,lr,run folder")
    )
    assert (sweep_dir / "objective.png").stat().st_size > 0


def test_sigterm_stops_the_driver_with_its_trial_which_the_next_start_resumes(
    tmp_path, capsys, own_signals
):
    sweep_dir = tmp_path / "stopped"
    space = write_space(tmp_path / "space.yaml", parameters={"lr": {"low": 1e-3, "high": 1e-2}})
    argv = driver_argv(sweep_dir, space, trials=2)
    first = sweep_dir / "trial_000"

    def preempt_the_driver():  # as a scheduler does, once the first trial has trained a few steps
        while (
            not (first / "metrics.jsonl").exists()
            or len((first / "metrics.jsonl").read_text().splitlines()) < 3
        ):
            threading.Event().wait(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=preempt_the_driver, daemon=True).start()
    assert sweep_script().main(argv) == 75
    said = capsys.readouterr().out
    assert "stopped on SIGTERM: the running trial checkpointed; go on with: python " in said
    # the command it prints, pasted, carries the sweep on: the driver's own
    go_on = shlex.split(said.split("go on with: ")[1].splitlines()[0])
    assert go_on[2:] == argv
    assert [t.state.name for t in trials_of(sweep_dir)] == ["RUNNING"]
    assert (first / "preempted.json").exists()  # the trial got it, and checkpointed
    # started again: the interrupted trial resumes (--resume latest), then the sweep goes on
    assert sweep_script().main(go_on[2:]) == 0
    assert "trial 0: resuming from its last checkpoint" in capsys.readouterr().out
    assert [t.state.name for t in trials_of(sweep_dir)] == ["COMPLETE", "COMPLETE"]
    again = launches(first)
    assert (
        len(again) == 2 and "--resume" not in again[0] and again[1][-2:] == ["--resume", "latest"]
    )
    assert len(launches(sweep_dir / "trial_001")) == 1


def test_a_launch_command_that_cannot_train_stops_the_sweep_in_one_line(
    tmp_path, capsys, own_signals
):
    """A typo in the script's name: the first trial fails before any metrics row, and no trial has finished,
    so every trial would: one line naming the trial's own error and its output, exit 2."""
    space = write_space(tmp_path / "space.yaml", parameters={"lr": {"low": 1e-3, "high": 1e-2}})
    broken = [sys.executable, str(REPO / "train" / "mian.py")]
    argv = ["--sweep_dir", str(tmp_path / "broken"), "--space", space, "--", *broken]
    assert sweep_script().main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "error: the launch command failed before training (trial 0, exit 2): "
    )
    assert "mian.py" in err[0] and f"{tmp_path / 'broken' / 'logs' / 'trial_000.log'}" in err[0]
    assert [t.state.name for t in trials_of(tmp_path / "broken")] == ["FAIL"]
