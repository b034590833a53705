"""scripts/sweep.py end to end: trials that are normal runs of the launch command, a driver killed with its
whole process group and started again (no finished trial rerun, the interrupted one resumed and ending
bitwise as the same trial run straight through), W&B runs grouped by sweep. Pruning, failed trials, the
driver's own stop, against a stand-in trial: tests/test_sweep_driver.py."""

import json
import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
import yaml

from conftest import FAULTY_MAIN, REPO, base_env, read_metrics, run, tiny_args

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
        # one value: both trials have the same parameters, so the first, run straight through, is
        # what the second, killed and resumed, must end as
        parameters={"lr": {"choices": [0.004]}},
    )
    args = trial_args(corpus, max_steps=16, eval_every=8, save_every=8, tracker="wandb")
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
    # the interrupted trial ends bitwise as the same trial run straight through
    first = sweep_dir / "trial_000"
    assert (
        yaml.safe_load((second / "config.yaml").read_text())["lr"]
        == trials[1].params["lr"]
        == 0.004
    )
    assert (second / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()

    def logged(folder):
        rows = read_metrics(folder)
        return [(r["step"], r.get("loss"), r.get("eval_loss")) for r in rows if "start" not in r]

    assert logged(second) == logged(first) and trials[1].value == trials[0].value
    # each trial is a W&B run in the sweep's group, its parameters in its config (the resume's record:
    # the killed launch's was cut short by the SIGKILL)
    records = [read_run(p) for p in (second / "wandb").glob("offline-run-*/run-*.wandb")]
    (resumed,) = [record for record in records if record["run_id"]]
    assert resumed["group"] == "lr_sweep" and resumed["config"]["lr"] == 0.004
    assert resumed["config"]["run_name"] == "lr_sweep-001"
    # the summary: the table (trials.csv too) and the plot
    assert "best: trial" in again.stdout and (sweep_dir / "objective.png").stat().st_size > 0
    rows = (sweep_dir / "trials.csv").read_text().splitlines()
    assert rows[0].startswith("trial,state,eval_loss,step,lr") and rows[2].startswith("1,complete,")
