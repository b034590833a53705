"""Hangs and stragglers, named (train/hangs.py), on real launches with faults from
tests/helpers/faulty_main.py: a rank whose next batch never comes (FAULT_HANG_BATCH), a rank whose
every batch comes late (FAULT_SLOW_DATA_S)."""

import json
import time

import pytest

from conftest import FAULTY_MAIN, launch_accelerate, read_metrics, tiny_args

pytestmark = pytest.mark.slow

STEP_TIMEOUT_S = 5
# the start-up timeout: the hang must be caught by the step's, far sooner
DIST_TIMEOUT_S = 200


def test_a_rank_whose_data_never_comes_is_named_and_every_rank_exits(tmp_path, corpus):
    """accelerate launch and main.py (the watch is the same code on the torch path: hangs.py, through
    main.train). Rank 1's 7th batch (step 7) never comes; rank 0 waits in step 7's first collective (the
    sum of the step's counted tokens, batches.loss_weights) for step_timeout_s. The job ends long before
    dist_timeout_s, its one error line names rank 1 and
    where it was, and each rank's note is in hangs/, rank 1's with the stack where it is stuck."""
    run_dir = tmp_path / "run"
    args = tiny_args(
        run_dir, corpus, step_timeout_s=STEP_TIMEOUT_S, dist_timeout_s=DIST_TIMEOUT_S, log_every=2
    )
    extra = {"FAULT_HANG_BATCH": 7, "FAULT_RANK": 1}
    started = time.monotonic()
    hung = launch_accelerate(
        args, tmp_path, script=FAULTY_MAIN, env_extra=extra, timeout=DIST_TIMEOUT_S
    )
    took = time.monotonic() - started
    assert hung.returncode != 0
    assert took < DIST_TIMEOUT_S / 2, f"took {took:.0f} s: the start-up timeout applied"
    errors = [line for line in hung.output.splitlines() if line.startswith("error: ")]
    assert errors, hung.tail()
    line = errors[0]
    assert f"timed out (step_timeout_s {STEP_TIMEOUT_S}) on rank(s) 0" in line, line
    assert "rank 1 did not arrive: it was in data (step 7)" in line, line
    assert "a collective in loss weights (step 7)" in line, line
    notes = {
        rank: json.loads((run_dir / "hangs" / f"rank{rank}.json").read_text()) for rank in (0, 1)
    }
    assert notes[0]["waiting_in_a_collective"] and notes[0]["phase"] == "loss weights"
    assert not notes[1]["waiting_in_a_collective"] and notes[1]["phase"] == "data"
    assert any("next_batch" in frame for frame in notes[1]["stack"])  # where it is stuck


def test_a_rank_whose_batches_come_late_is_named_the_straggler(tmp_path, corpus):
    """Every batch of rank 1 comes late, by 400 ms or 3 times its own step if that is longer (a fork's
    slower model: a fixed lag would pass under the rule's factor): at each logging step metrics.jsonl
    names rank 1 the straggler, its time alone against rank 0's, and never names rank 0. (50 ms was
    too close to the first window's warm-up on a loaded 2-core machine, and 150 ms failed half the runs
    on a slower day: rank 0's first forward took more than half of rank 1's lag; now 400 ms.)"""
    LATE_S = 0.4
    run_dir = tmp_path / "run"
    args = tiny_args(run_dir, corpus, max_steps=12, log_every=4, save_every=0, eval_every=12)
    launch_accelerate(
        args, tmp_path, script=FAULTY_MAIN, env_extra={"FAULT_SLOW_DATA_S": LATE_S, "FAULT_RANK": 1}
    ).check()
    rows = [row for row in read_metrics(run_dir) if "slowest_rank" in row]
    assert [row["step"] for row in rows] == [4, 8, 12]
    for row in rows:
        assert row["straggler_rank"] == row["slowest_rank"] == 1, row
        assert row["straggler_data_s"] >= 4 * LATE_S  # 4 steps of one micro-batch each, late
        assert row["slowest_rank_s"] > 2 * row["median_rank_s"]
