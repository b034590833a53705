"""Kill fuzz: a 2-process run SIGKILLed at seeded random moments, resumed after each, ends bitwise equal to
the uninterrupted run, with every step logged exactly once.

The moments are events counted by tests/helpers/faulty_main.py (FAULT_KILL_EVENT): preparing the data,
every collective decision (locking the run folder, choosing and loading the checkpoint, each phase of a
save, the export), every logging step, the middle of the writer's save, and pruning (after a publish).
They are drawn by what they interrupt (start-up, training, a save, the export), mostly training, and
placed in the next launch's own count of events: most launches resume from a checkpoint mid-run.
Checkpoints are written in the background (saving.py): a save's events keep their number but straddle
the next logging step (its copy at the save step, the write in a thread, the vote and publish after
the next step's logging vote), so a kill drawn for a save often lands while it is in flight.
KILL_FUZZ_POINTS=50 python -m pytest tests/e2e/test_kill_fuzz.py runs the long version (default 2, for
the suite's time: run the long one after a change to saving or resuming).
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

KILLS = int(os.environ.get("KILL_FUZZ_POINTS", "2"))
MAX_STEPS, SAVE_EVERY = 24, 8  # the baseline's
# what a kill interrupts, and how often: mostly training, so that most launches resume mid-run
MOMENTS = {"start-up": 1, "training": 6, "save": 3, "export": 1}


def checkpointed_step(run_dir) -> int:
    """The step of the newest complete checkpoint: where the next launch resumes."""
    states = sorted((run_dir / "checkpoints").glob("step_*[0-9]/manifest.json"))
    return json.loads(states[-1].read_text())["step"] if states else 0


def kill_event(rng: random.Random, done: int, rank: int) -> tuple[int, str]:
    """A moment of the next launch, resuming at step `done`, as the number of the event of `rank` to kill
    at (faulty_main counts them): start-up (data, lock, recovery, choice, and loading if there is a
    checkpoint), then per step its logging vote, and per save its phases (3; 5 on rank 0, which writes the
    optimizer's state between two of them and prunes after the commit), then the export."""
    startup = 5 if done else 4
    per_save = 5 if rank == 0 else 3

    def step_event(step: int) -> int:  # the logging vote of `step`
        saves_before = (step - 1) // SAVE_EVERY - done // SAVE_EVERY
        return startup + (step - done) + per_save * saves_before

    moment = rng.choices(list(MOMENTS), weights=list(MOMENTS.values()))[0]
    if moment == "start-up":
        return rng.randint(1, startup), moment
    if moment == "training" and done < MAX_STEPS - 1:
        step = rng.randint(done + 1, MAX_STEPS - 1)
        return step_event(step), f"training, step {step}"
    saves = [step for step in range(done + 1, MAX_STEPS + 1) if step % SAVE_EVERY == 0]
    if moment == "save" and saves:
        step = rng.choice(saves)
        return step_event(step) + rng.randint(1, per_save), f"save of step {step}"
    return step_event(MAX_STEPS) + per_save + 1, "export"


def finish_and_compare(run_dir, corpus, tmp_path, baseline, resumed_from: int) -> None:
    """The launch after the last kill of a run: it continues from the newest checkpoint, and the run ends
    bitwise equal to the uninterrupted one, every step logged once, nothing half-written left."""
    final = launch_accelerate(
        [*baseline_args(run_dir, corpus), "--resume", "latest"], tmp_path
    ).check()
    if resumed_from:
        assert f"(step {resumed_from})" in final.output
    assert_matches_baseline(run_dir, baseline)
    steps = [row["step"] for row in read_metrics(run_dir) if "loss" in row]
    assert steps == list(range(1, MAX_STEPS + 1))  # no step trained (or logged) twice
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    assert not list((run_dir / "checkpoints").glob("*.stale"))


def test_kill_at_random_moments_and_resume_each_time(tmp_path, corpus, baseline):
    """Kills drawn over the whole run; at least half of them must leave a checkpoint mid-run that the next
    launch continues training from (else the fuzz would only test resuming a finished run). A kill that
    leaves the run finished (at the export) ends that run: it is compared, and the next kills go to a new
    one."""
    rng = random.Random(20261125)
    runs = 0
    run_dir = tmp_path / "run0"
    moments = []
    for _ in range(KILLS):
        rank = rng.randint(0, 1)
        event, moment = kill_event(rng, checkpointed_step(run_dir), rank)
        crashed = launch_accelerate(
            [*baseline_args(run_dir, corpus), "--resume", "latest"],
            tmp_path,
            script=FAULTY_MAIN,
            env_extra={"FAULT_KILL_EVENT": event, "FAULT_RANK": rank},
        )
        assert crashed.returncode != 0, (
            f"the kill at event {event} ({moment}) on rank {rank} did not happen"
        )
        resumable = checkpointed_step(run_dir)
        moments.append((moment, rank, resumable))
        if resumable == MAX_STEPS:  # this run is done: check it, then fuzz a new one
            finish_and_compare(run_dir, corpus, tmp_path, baseline, resumable)
            runs += 1
            run_dir = tmp_path / f"run{runs}"
    if run_dir.exists():
        finish_and_compare(run_dir, corpus, tmp_path, baseline, checkpointed_step(run_dir))
    # (what was interrupted, the rank killed, the step the next launch resumed from)
    mid_run = [resumed for *_, resumed in moments if 0 < resumed < MAX_STEPS]
    assert len(mid_run) * 2 >= KILLS, f"too few kills left a checkpoint to continue from: {moments}"
