"""Standard evaluations end to end: --eval_tasks at the end of a 2-process run (the scores in metrics.jsonl,
the run folder and its W&B run), and scripts/evaluate.py on a checkpoint of it later (its own step's file,
and the same W&B run), with a local task in the harness's format (tests/test_harness.py checks the scores
against a hand computation)."""

import json
import sys
from pathlib import Path

import pytest

from conftest import REPO, base_env, launch_accelerate, run, tiny_args
from test_harness import needs_harness, write_task

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from wandb_reader import read_run  # noqa: E402

pytestmark = [pytest.mark.slow, needs_harness]


def test_eval_tasks_at_the_end_of_training_and_the_script_on_a_checkpoint(tmp_path, corpus):
    task = write_task(tmp_path)
    out = tmp_path / "run"
    args = tiny_args(
        out, corpus, max_steps=8, save_every=4, keep_last=3, tracker="wandb", block_size=32
    )
    trained = launch_accelerate(
        [*args, "--eval_tasks", task, "--eval_task_path", tmp_path], tmp_path
    ).check()
    last = trained.metrics()[-1]
    assert last["step"] == 8 and 0 <= last[f"lm_eval/{task}/acc"] <= 1
    written = json.loads((out / "evals" / "step_00000008.json").read_text())
    assert written["scores"] == {f"{task}/acc": last[f"lm_eval/{task}/acc"]}
    assert written["harness"][task]["sample_len"] == 10
    (training_run,) = [read_run(p) for p in out.glob("wandb/offline-run-*/run-*.wandb")]
    logged = [row for row in training_run["history"] if f"lm_eval/{task}/acc" in row]
    assert len(logged) == 1 and logged[0]["_step"] == 8
    # later: a checkpoint of the same run, scored by the script into its own step's file and W&B run
    script = [
        sys.executable,
        str(REPO / "scripts/evaluate.py"),
        str(out / "checkpoints/step_00000004"),
    ]
    result = run([*script, "--tasks", task, "--task_path", str(tmp_path)], base_env(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:]
    assert f"{task}/acc: " in result.stdout and "W&B: logged to run " in result.stdout
    earlier = json.loads((out / "evals" / "step_00000004.json").read_text())
    assert earlier["step"] == 4 and f"{task}/acc" in earlier["scores"]
    runs = [read_run(p) for p in sorted(out.glob("wandb/offline-run-*/run-*.wandb"))]
    assert {r["run_id"] for r in runs} == {training_run["run_id"]}  # the same W&B run, continued
    scored = [row for r in runs for row in r["history"] if row.get("trained_step") == 4]
    assert scored and scored[0][f"lm_eval/{task}/acc"] == earlier["scores"][f"{task}/acc"]
