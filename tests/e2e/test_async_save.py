"""Checkpoints written in the background (--async_save, the default; saving.py), under real faults.

The baseline run (conftest) saves in the background; a run that saves in the loop must end with the
same weights, bit for bit. tests/helpers/faulty_main.py's FAULT_SLOW_WRITE_S makes the writer thread
sleep before the optimizer's part, so that a save stays in flight across the next logging steps:
then a stop signal, or a kill, lands while it is in flight."""

import pytest

from conftest import (
    FAULTY_MAIN,
    assert_matches_baseline,
    baseline_args,
    launch_accelerate,
)

pytestmark = pytest.mark.slow


def checkpoints(run_dir) -> list[str]:
    return sorted(path.name for path in (run_dir / "checkpoints").iterdir())


def test_saving_in_the_loop_trains_the_same_weights_as_saving_in_the_background(
    tmp_path, corpus, baseline
):
    run_dir = tmp_path / "run"
    launch_accelerate(baseline_args(run_dir, corpus, async_save="false"), tmp_path).check()
    assert_matches_baseline(run_dir, baseline)
    assert "training waited" in baseline.output
    assert "written in the background" in baseline.output


def test_sigterm_while_a_save_is_in_flight_finishes_it_then_checkpoints_and_stops(
    tmp_path, corpus, baseline
):
    """The save of step 8 is still being written at step 9, when SIGTERM arrives: the ranks vote to
    stop, the save of step 8 is finished and published, the one of step 9 taken, and the job exits 75;
    the resume from step 9 ends as the uninterrupted run."""
    run_dir = tmp_path / "run"
    stopped = launch_accelerate(
        baseline_args(run_dir, corpus),
        tmp_path,
        script=FAULTY_MAIN,
        env_extra={
            "FAULT_SLOW_WRITE_S": 3,
            "FAULT_STEP": 9,
            "FAULT_ACTION": "sigterm",
            "FAULT_RANK": 1,
        },
    )
    assert "exitcode  : 75" in stopped.output, (
        stopped.tail()
    )  # each rank's, in the launcher's summary
    assert checkpoints(run_dir) == ["step_00000008", "step_00000009"]
    said = stopped.output
    assert said.index("checkpoints/step_00000008 (") < said.index("checkpoints/step_00000009 (")
    resumed = launch_accelerate([*baseline_args(run_dir, corpus), "--resume", "latest"], tmp_path)
    assert "(step 9)" in resumed.check().output
    assert_matches_baseline(run_dir, baseline)


def test_a_kill_while_a_save_is_in_flight_leaves_the_previous_checkpoint_newest(
    tmp_path, corpus, baseline
):
    """Rank 1 is killed at step 17 while the save of step 16 is still being written: step 16 was
    never published (its folder stays .tmp), the resume continues from step 8 and ends bitwise as the
    uninterrupted run."""
    run_dir = tmp_path / "run"
    crashed = launch_accelerate(
        baseline_args(run_dir, corpus),
        tmp_path,
        script=FAULTY_MAIN,
        env_extra={
            "FAULT_SLOW_WRITE_S": 5,
            "FAULT_SAVE_NUMBER": 2,
            "FAULT_STEP": 17,
            "FAULT_ACTION": "sigkill",
            "FAULT_RANK": 1,
        },
    )
    assert crashed.returncode != 0
    assert checkpoints(run_dir) == ["step_00000008", "step_00000016.tmp"]
    resumed = launch_accelerate([*baseline_args(run_dir, corpus), "--resume", "latest"], tmp_path)
    assert "(step 8)" in resumed.check().output
    assert_matches_baseline(run_dir, baseline)
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
