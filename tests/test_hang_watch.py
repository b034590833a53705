"""hangs.py's line and straggler rule, in one process (the launches: tests/e2e/test_hangs.py)."""

import time
from types import SimpleNamespace

import torch

import hangs
from config import TrainConfig


def watch_of(world_size: int, notes: dict, rank: int = 0, **cfg) -> hangs.Watch:
    """A Watch of `rank` in a world of `world_size`, without a process group: the notes the others
    published are given."""
    plumbing = SimpleNamespace(process_index=rank, num_processes=world_size, device="cpu")
    watch = hangs.Watch(plumbing, TrainConfig(output_dir="runs/x", **cfg))
    watch.notes = lambda: notes
    return watch


def test_the_line_names_the_ranks_that_did_not_arrive_and_where_they_were():
    notes = {
        0: {"phase": "backward", "step": 7, "waiting_in_a_collective": True},
        1: {"phase": "data", "step": 7, "waiting_in_a_collective": False},
        3: {"phase": "backward", "step": 7, "waiting_in_a_collective": True},
    }
    watch = watch_of(4, notes, step_timeout_s=60)
    timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 60000ms")
    assert hangs.timed_out(timeout)
    assert hangs.describe(watch, timeout) == (
        "a collective in backward (step 7) timed out (step_timeout_s 60) on rank(s) 0, 3: "
        "rank 1 did not arrive: it was in data (step 7); "
        "rank 2 did not answer (gone: killed, or stuck outside Python) "
        "(each rank's note and stack: runs/x/hangs)"
    )
    gone = RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    assert not hangs.timed_out(gone)
    assert "lost a peer on rank(s) 0, 3" in hangs.describe(watch, gone)


def test_a_straggler_is_named_only_when_it_is_slower_by_the_factor_and_costs_time():
    watch = watch_of(2, {})

    def shared(times):  # what the all-reduce returns: every rank's (data, forward) seconds
        watch.plumbing.reduce = lambda tensor, how: torch.tensor(times)
        watch.window_started = time.perf_counter() - 1.0  # a window of about 1 s
        return watch.stragglers()

    row = shared([[0.01, 0.05], [0.40, 0.05]])
    assert row["straggler_rank"] == row["slowest_rank"] == 1
    assert abs(row["straggler_data_s"] - 0.40) < 1e-6 and abs(row["median_rank_s"] - 0.06) < 1e-6
    # 3x slower, but 20 ms in a 1 s window: a hiccup, not a straggler
    assert "straggler_rank" not in shared([[0.001, 0.009], [0.02, 0.01]])
    # costly, but not straggler_factor (2) times slower
    assert "straggler_rank" not in shared([[0.3, 0.1], [0.5, 0.1]])


def test_a_save_or_the_export_waits_the_long_timeout_and_training_gets_step_timeout_back(
    monkeypatch,
):
    """Around a save (hangs.patiently): dist_timeout_s for a slow write on one rank; after it, also
    when the save fails, the collectives' timeout is step_timeout_s again, so a hang after the first
    checkpoint is named as quickly as one before it."""
    set_to = []
    monkeypatch.setattr(hangs, "set_collective_timeout", set_to.append)
    monkeypatch.setattr(hangs, "_watch", None)  # the watch made here is gone after the test
    watch = watch_of(2, {}, step_timeout_s=60, dist_timeout_s=1800)
    watch.store = object()  # as with a process group
    watch.step_done(1)  # after the first step: training's timeout
    assert set_to == [60]
    with hangs.patiently("a checkpoint save"):
        assert set_to[-1] == 1800 and watch.note["phase"] == "a checkpoint save"
    assert set_to[-1] == 60 and watch.note["phase"] != "a checkpoint save"
    try:
        with hangs.patiently("the export"):
            raise OSError("disk full")
    except OSError:
        pass
    assert set_to == [60, 1800, 60, 1800, 60]
