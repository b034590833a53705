"""Kill fuzz: a 2-process run SIGKILLed at seeded random moments, resumed after each, ends bitwise equal to
the uninterrupted run, with every step logged exactly once.

The moments are events counted by tests/helpers/faulty_main.py (FAULT_KILL_EVENT): preparing the data,
every collective decision (locking the run folder, choosing and loading the checkpoint, each phase of a
save, the export), every logging step, the middle of the writer's save, and pruning (after a publish).
KILL_FUZZ_POINTS=50 python -m pytest tests/e2e/test_kill_fuzz.py runs the long version (default 3).
"""

import json
import os
import random

import pytest

from conftest import (
    FAULTY_MAIN,
    assert_matches_baseline,
    baseline_args,
    launch_accelerate,
    read_metrics,
)

pytestmark = pytest.mark.slow

KILLS = int(os.environ.get("KILL_FUZZ_POINTS", "3"))
MAX_STEPS, SAVE_EVERY = 24, 8  # the baseline's


def events_left(run_dir) -> int:
    """The events a (resumed) run still goes through on rank 1, which has fewer than rank 0: start-up (data,
    lock, recovery, choice, and loading if there is a checkpoint), steps, 3 per save, the export."""
    states = sorted((run_dir / "checkpoints").glob("step_*[0-9]/train_state.json"))
    done = json.loads(states[-1].read_text())["step"] if states else 0
    saves_left = MAX_STEPS // SAVE_EVERY - done // SAVE_EVERY
    return (5 if done else 4) + (MAX_STEPS - done) + 3 * saves_left + 1


def test_kill_at_random_moments_and_resume_each_time(tmp_path, corpus, baseline):
    rng = random.Random(20261123)
    run_dir = tmp_path / "run"
    args = [*baseline_args(run_dir, corpus), "--resume", "latest"]
    moments = []
    for _ in range(KILLS):
        event, rank = rng.randint(1, events_left(run_dir)), rng.randint(0, 1)
        moments.append((event, rank))
        crashed = launch_accelerate(
            args,
            tmp_path,
            script=FAULTY_MAIN,
            env_extra={"FAULT_KILL_EVENT": event, "FAULT_RANK": rank},
        )
        assert crashed.returncode != 0, f"the kill at event {event} on rank {rank} did not happen"
    launch_accelerate(args, tmp_path).check()
    assert_matches_baseline(run_dir, baseline)
    steps = [row["step"] for row in read_metrics(run_dir) if "loss" in row]
    assert steps == list(range(1, MAX_STEPS + 1)), moments  # no step trained (or logged) twice
    assert not list((run_dir / "checkpoints").glob("*.tmp")) and not list(
        (run_dir / "checkpoints").glob("*.stale")
    )
