"""Ray Train (scripts/ray/train.py): the baseline's 2-process run under Ray's TorchTrainer with 2 CPU
workers, one worker's rank SIGKILLed mid-run; Ray restarts the worker group, which resumes from the
run's own newest checkpoint, and the run ends bitwise equal to the one accelerate launch ran, every
step logged once. The optional install it needs: pip install -r requirements-ray.txt."""

import sys

import pytest

from conftest import FAULTY_MAIN, REPO, assert_matches_baseline, base_env, baseline_args, run

pytestmark = pytest.mark.slow
pytest.importorskip("ray.train", reason="pip install -r requirements-ray.txt")
RAY_TRAIN = REPO / "scripts" / "ray" / "train.py"


def test_a_worker_killed_under_ray_is_restarted_and_the_run_resumes_bitwise(
    tmp_path, corpus, baseline
):
    out = tmp_path / "run"
    env = base_env(
        tmp_path,
        # rank 1 dies at step 13 once; the restarted group runs clean
        FAULT_ACTION="sigkill",
        FAULT_STEP=13,
        FAULT_RANK=1,
        FAULT_ONCE=tmp_path / "killed-once",
        RAY_USAGE_STATS_ENABLED=0,  # no network here
        RAY_ADDRESS="",  # a local Ray, started and stopped by the script
    )
    cmd = [
        sys.executable,
        RAY_TRAIN,
        "--workers",
        "2",
        "--max_failures",
        "1",
        "--entry",
        FAULTY_MAIN,
        "--",
        *baseline_args(out, corpus),
    ]
    result = run([str(part) for part in cmd], env, timeout=400)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "faulty_main.py exited with -9" in result.stdout  # the kill, seen by Ray
    assert f"resume: {out}/checkpoints/step_00000008 (step 8)" in result.stdout
    assert_matches_baseline(out, baseline)  # weights, and the loss of every step 1..24
