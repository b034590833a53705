"""hangs.py's line and straggler rule, in one process (the launches: tests/e2e/test_hangs.py)."""

import json
import time
from types import SimpleNamespace

import pytest
import torch

import hangs
from run_config import config_class

RunConfig = config_class()  # TrainConfig and model.py's and data.py's own keys


def watch_of(world_size: int, notes: dict, rank: int = 0, **cfg) -> hangs.Watch:
    """A Watch of `rank` in a world of `world_size`, without a process group: the notes the others
    published are given."""
    plumbing = SimpleNamespace(process_index=rank, num_processes=world_size, device="cpu")
    watch = hangs.Watch(plumbing, RunConfig(output_dir="runs/x", **cfg))
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


def test_a_lost_peer_is_named_lost_and_a_live_rank_elsewhere_is_not_named():
    """A node gone: its ranks never answer (lost); a live rank woken by the alarm outside a
    collective (rank 1) is not at fault and not named; nothing says "timed out"."""
    notes = {
        0: {"phase": "backward", "step": 7, "waiting_in_a_collective": True},
        1: {"phase": "optimizer", "step": 7, "waiting_in_a_collective": False},
    }
    watch = watch_of(4, notes)
    gone = RuntimeError(
        "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"
    )
    assert not hangs.timed_out(gone)
    assert hangs.describe(watch, gone) == (
        "a collective in backward (step 7) failed on rank(s) 0: rank(s) 2, 3 lost (gone without "
        "a word: killed, or their node down) (each rank's note and stack: runs/x/hangs)"
    )
    reset = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    assert not hangs.timed_out(reset)


class Store:
    """The job's store as hangs.py uses it, in memory; `gone`: its node is down."""

    def __init__(self):
        self.values, self.gone = {}, False

    def _up(self):
        if self.gone:
            raise ConnectionResetError("Connection reset by peer")

    def set(self, key, value):
        self._up()
        self.values[key] = value.encode() if isinstance(value, str) else value

    def add(self, key, amount):
        self._up()
        self.values[key] = int(self.values.get(key, 0)) + amount
        return self.values[key]

    def check(self, keys):
        self._up()
        return all(key in self.values for key in keys)

    def get(self, key):
        self._up()
        return self.values[key]


def test_exactly_one_rank_says_the_line_and_without_the_store_each_node_s_local_rank_0(
    tmp_path, monkeypatch
):
    """Every rank that sees the failure explains it; the first to claim the line in the store says
    it and the others say nothing. Without the store (its node gone) the local rank 0 says a line
    that names the store's node as gone."""
    monkeypatch.setattr(hangs, "ANSWER_WAIT_S", 0.2)
    store = Store()
    gone = RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    # rank 0 is failing too (as it does, at the same time, in its own process)
    store.set(
        "note/0", json.dumps({"phase": "backward", "step": 3, "waiting_in_a_collective": True})
    )
    said = []
    for rank in (1, 0):  # rank 1 claims the line first
        plumbing = SimpleNamespace(process_index=rank, num_processes=4, device="cpu")
        watch = hangs.Watch(plumbing, RunConfig(output_dir=str(tmp_path)))
        watch.store = store
        monkeypatch.setattr(hangs, "_watch", watch)
        said.append(hangs.explain(gone))
    assert said[0][1] and not said[1][1], said
    assert said[0][0].startswith("a collective in backward (step 3) failed on rank(s) 0, 1: ")
    assert "rank(s) 2, 3 lost" in said[0][0]
    assert "alarm" in store.values  # wakes the ranks that saw nothing
    assert (tmp_path / "hangs" / "rank0.json").exists()

    store.gone = True
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    for local_rank, says_it in (("1", False), ("0", True)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        plumbing = SimpleNamespace(process_index=2 + int(local_rank), num_processes=4, device="cpu")
        watch = hangs.Watch(plumbing, RunConfig(output_dir=str(tmp_path)))
        watch.store = store
        monkeypatch.setattr(hangs, "_watch", watch)
        line, says = hangs.explain(gone)
        assert says == says_it
    assert line == (
        "a collective in start-up (step 0) lost a peer on rank(s) 2, and the job's store at "
        f"10.0.0.1:29500 with it: the main node is gone (killed, or down) (this rank's note: "
        f"{tmp_path / 'hangs'})"
    )


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


def test_each_rank_s_own_data_and_forward_times_fill_its_row_of_the_straggler_table():
    """What each rank timed alone (watch.timed) goes into its own row of the table the ranks
    all-reduce: rank 1, whose data came 0.3 s late, is the one named, with its own seconds."""
    watches = [watch_of(2, {}, rank=rank) for rank in (0, 1)]
    for watch, data_s in zip(watches, (0.0, 0.3), strict=True):
        watch.window_started = time.perf_counter() - 1.0
        with watch.timed("data"):
            time.sleep(data_s)
        with watch.timed("forward"):
            time.sleep(0.02)
    tables = []

    def all_reduce(tensor, how):  # the sum over the ranks, once both have given theirs
        tables.append(tensor.clone())
        return sum(tables)

    for watch in reversed(watches):
        watch.plumbing.reduce = all_reduce
    row = [watch.stragglers() for watch in reversed(watches)][-1]  # rank 0's, after rank 1's
    assert row["straggler_rank"] == row["slowest_rank"] == 1, row
    assert 0.3 <= row["straggler_data_s"] < 0.5 and 0.02 <= row["straggler_forward_s"] < 0.2
    assert 0.02 <= row["median_rank_s"] < 0.2  # rank 0's data and forward
    assert watches[0].alone_s == {"data": 0.0, "forward": 0.0}  # a new window starts


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


def test_a_rank_s_hang_note_names_the_step_it_is_training_and_is_written_to_its_file(
    tmp_path, monkeypatch
):
    """After step_done(3) the rank trains step 4: a collective failing in its forward is noted as
    step 4 (3 steps done, plus the one under way), in the store and in hangs/rank1.json."""
    monkeypatch.setattr(hangs, "ANSWER_WAIT_S", 0.1)
    monkeypatch.setattr(hangs, "set_collective_timeout", lambda seconds: None)
    plumbing = SimpleNamespace(process_index=1, num_processes=2, device="cpu")
    watch = hangs.Watch(plumbing, RunConfig(output_dir=str(tmp_path)))
    watch.store = Store()
    monkeypatch.setattr(hangs, "_watch", watch)
    for step in (1, 2, 3):
        watch.at("data")
        watch.step_done(step)
    watch.at("forward")
    hangs.explain(RuntimeError("Timed out waiting 60000ms"))
    written = json.loads((tmp_path / "hangs" / "rank1.json").read_text())
    assert (written["rank"], written["step"], written["phase"]) == (1, 4, "forward")
    assert written["waiting_in_a_collective"] is True
    assert json.loads(watch.store.values["note/1"]) == written


def test_a_slower_rank_that_costs_under_a_tenth_of_the_window_is_no_straggler():
    """Rank 1 is 3 times slower than rank 0 (0.3 s against 0.1 s) and over STRAGGLER_MIN_S (0.1 s)
    behind, but in a 10 s window its 0.2 s is 2% of the time, under STRAGGLER_COST (10%: 1 s)."""
    watch = watch_of(2, {})
    watch.plumbing.reduce = lambda tensor, how: torch.tensor([[0.05, 0.05], [0.25, 0.05]])
    watch.window_started = time.perf_counter() - 10.0
    row = watch.stragglers()
    assert row["slowest_rank"] == 1 and abs(row["slowest_rank_s"] - 0.3) < 1e-6
    assert "straggler_rank" not in row


def test_nccl_s_watchdog_timeout_is_a_timeout_not_a_lost_peer():
    """NCCL's watchdog words a timed-out collective without "timed out" (ProcessGroupNCCL.cpp:
    "Watchdog caught collective operation timeout: ... ran for N milliseconds before timing out");
    the line must say timed out, and name the rank that did not arrive, not call ranks lost."""
    notes = {
        0: {"phase": "backward", "step": 7, "waiting_in_a_collective": True},
        1: {"phase": "data", "step": 7, "waiting_in_a_collective": False},
    }
    watch = watch_of(2, notes, step_timeout_s=600)
    nccl = RuntimeError(
        "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42, "
        "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600000 "
        "milliseconds before timing out."
    )
    assert hangs.timed_out(nccl)
    assert hangs.describe(watch, nccl) == (
        "a collective in backward (step 7) timed out (step_timeout_s 600) on rank(s) 0: "
        "rank 1 did not arrive: it was in data (step 7) (each rank's note and stack: runs/x/hangs)"
    )


# ---------------------------------------------------------------- the watch's own pieces, one by one


def test_a_watch_starts_noting_start_up_and_alone_it_shares_nothing(monkeypatch):
    import os
    import socket

    monkeypatch.setattr(hangs, "_watch", None)
    watch = watch_of(1, {}, rank=0)
    assert watch.note == {
        "rank": 0,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "step": 0,
        "phase": "start-up",
    }
    assert (watch.store, watch.listener, watch.training, watch.completed) == (None, None, False, 0)
    assert watch.alone_s == {"data": 0.0, "forward": 0.0}
    assert hangs._watch is watch
    assert watch.stragglers() == {}  # one process: no table
    watch.stop()  # no listener: nothing to stop


def test_without_a_watch_or_its_store_nothing_is_explained_and_saves_wait_as_they_are(monkeypatch):
    monkeypatch.setattr(hangs, "_watch", None)
    assert hangs.explain(RuntimeError("Timed out")) is None
    with hangs.patiently("a checkpoint save"):
        pass
    hangs.stop_watching()
    watch = watch_of(2, {})  # no process group: no store
    monkeypatch.setattr(hangs, "_watch", watch)
    assert hangs.explain(RuntimeError("Timed out")) is None


def test_without_a_store_the_steps_keep_the_timeout_they_have(monkeypatch):
    set_to = []
    monkeypatch.setattr(hangs, "set_collective_timeout", set_to.append)
    watch = watch_of(2, {})
    watch.step_done(1)
    with watch.patient("the export"):
        assert watch.note["phase"] == "the export"
    assert (
        set_to == []
        and watch.training
        and watch.note["phase"] == ("the end of the step (logging votes, eval, checkpoint)")
    )
    watch = watch_of(2, {})
    watch.store = object()
    with watch.patient("a checkpoint save"):  # before the first step: start-up's timeout stays
        pass
    assert set_to == []


def test_timed_out_reads_any_case_and_the_line_when_every_rank_was_waiting():
    assert hangs.timed_out(RuntimeError("Socket TIMEOUT after 60 s"))
    assert not hangs.timed_out(None)
    notes = {
        rank: {"phase": "backward", "step": 2, "waiting_in_a_collective": True} for rank in (0, 1)
    }
    watch = watch_of(2, notes, step_timeout_s=30)
    assert hangs.describe(watch, RuntimeError("timed out")) == (
        "a collective in backward (step 2) timed out (step_timeout_s 30) on rank(s) 0, 1: every rank "
        "was waiting (each rank's note and stack: runs/x/hangs)"
    )
    # nobody's note came back: this rank, where it is, is the one named waiting
    alone = watch_of(3, {}, rank=2)
    alone.note.update(step=5, phase="forward")
    assert hangs.describe(alone, RuntimeError("Connection closed by peer")) == (
        "a collective in forward (step 5) failed on rank(s) 2: rank(s) 0, 1, 2 lost (gone without "
        "a word: killed, or their node down) (each rank's note and stack: runs/x/hangs)"
    )
    everyone = watch_of(1, {0: {"phase": "data", "step": 1, "waiting_in_a_collective": True}})
    assert "rank(s) none lost" in hangs.describe(everyone, RuntimeError("Connection reset"))


def test_a_note_is_written_even_when_the_store_is_gone(tmp_path):
    watch = hangs.Watch(
        SimpleNamespace(process_index=1, num_processes=2, device="cpu"),
        RunConfig(output_dir=str(tmp_path / "run")),
    )
    watch.store = Store()
    watch.store.gone = True
    watch.publish({"rank": 1, "phase": "data"})
    assert watch.store_gone
    assert (tmp_path / "run" / "hangs" / "rank1.json").read_text() == (
        '{\n  "rank": 1,\n  "phase": "data"\n}\n'
    )
    assert watch.notes() == {}  # asking a store that is gone: what this rank knows, nothing


def test_the_notes_are_those_published_and_the_line_is_claimed_once(monkeypatch):
    monkeypatch.setattr(hangs, "ANSWER_WAIT_S", 0.05)
    watch = watch_of(3, {})
    del watch.notes  # the real one
    watch.store = Store()
    watch.store.set("note/0", json.dumps({"step": 1}))
    watch.store.set("note/2", json.dumps({"step": 2}))
    assert watch.notes() == {0: {"step": 1}, 2: {"step": 2}}
    assert watch.claims_the_line() is True
    assert watch.claims_the_line() is False  # the second to ask
    watch.store.gone = True
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert watch.claims_the_line() is False and watch.store_gone
    monkeypatch.delenv("LOCAL_RANK")
    assert watch.claims_the_line() is True  # no LOCAL_RANK: this process is its node's first


def test_the_first_data_batch_of_a_start_is_timed_as_the_data_position(monkeypatch):
    from profiling import start_clock

    phases = []
    monkeypatch.setattr(start_clock, "phase", lambda name: phases.append(name) or _nothing())
    watch = watch_of(2, {})
    with watch.timed("data"):
        pass
    watch.step_done(1)
    with watch.timed("data"):
        pass
    assert phases == ["data position"]
    assert (watch.note["step"], watch.note["phase"]) == (2, "data")  # step 1 done: step 2's data


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Exited(Exception):
    pass


def test_a_rank_woken_by_the_alarm_publishes_where_it_is_and_ends_its_process(
    tmp_path, monkeypatch
):
    """The listening thread's work, run here: the alarm is in the store, so this rank publishes its
    note (not waiting in a collective, with its main thread's stack), waits SILENT_WAIT_S while the
    line is said, and exits 1."""
    store = Store()
    store.set("alarm", "0")
    monkeypatch.setattr(hangs, "job_store", lambda timeout_s: store)
    waited, exits = [], []
    monkeypatch.setattr(hangs.time, "sleep", waited.append)

    def exit_(code):
        exits.append(code)
        raise Exited

    monkeypatch.setattr(hangs.os, "_exit", exit_)
    watch = hangs.Watch(
        SimpleNamespace(process_index=1, num_processes=2, device="cpu"),
        RunConfig(output_dir=str(tmp_path)),
    )
    watch.store = store
    watch.at("forward")
    with pytest.raises(Exited):
        watch._answer_alarm()
    assert waited == [hangs.SILENT_WAIT_S] == [15.0] and exits == [1]
    note = json.loads(store.values["note/1"])
    assert note["phase"] == "forward" and note["waiting_in_a_collective"] is False
    assert any("test_a_rank_woken_by_the_alarm" in frame for frame in note["stack"])
    assert len(note["stack"]) <= 12
    # the main thread saw the failure first: it has it in hand, the thread says nothing
    del store.values["note/1"]
    watch.saw_failure = True
    watch._answer_alarm()
    assert "note/1" not in store.values and exits == [1]


def test_the_listening_thread_ends_with_the_job_or_its_store(monkeypatch):
    store = Store()  # no alarm
    monkeypatch.setattr(hangs, "job_store", lambda timeout_s: store)
    watch = watch_of(2, {})
    watch.closed.set()  # the job is ending
    watch._answer_alarm()
    store.gone = True
    watch.closed.clear()
    watch._answer_alarm()  # the store went with the job: nothing raised
    assert "note/0" not in store.values


def test_the_job_s_store_is_asked_as_a_client_under_this_attempt_s_prefix(monkeypatch):
    from datetime import timedelta

    made = {}

    def tcp_store(host, port, **options):
        made.update(host=host, port=port, **options)
        return "the store"

    monkeypatch.setattr(hangs.dist, "TCPStore", tcp_store)
    monkeypatch.setattr(hangs.dist, "PrefixStore", lambda prefix, store: (prefix, store))
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert hangs.job_store(90) == ("attempt_2/hangs", "the store")
    assert made == {
        "host": "10.0.0.1",
        "port": 29500,
        "is_master": False,
        "timeout": timedelta(seconds=90),
        "wait_for_workers": False,
    }
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert hangs.job_store(90)[0] == "attempt_0/hangs"
    set_to = []
    monkeypatch.setattr(hangs.dist.distributed_c10d, "_set_pg_timeout", set_to.append)
    hangs.set_collective_timeout(60)
    assert set_to == [timedelta(seconds=60)]


def test_a_watch_in_a_process_group_listens_on_a_daemon_thread_that_answers_the_alarm(
    tmp_path, monkeypatch
):
    """With a process group and more than one process: the job's store (a client asked with
    dist_timeout_s), and a daemon thread that, once another rank raises the alarm, publishes this
    rank's note with the main thread's stack (here: this test) and ends the process."""
    import torch.distributed as dist

    store, asked = Store(), []
    monkeypatch.setattr(hangs, "job_store", lambda timeout_s: asked.append(timeout_s) or store)
    monkeypatch.setattr(hangs, "SILENT_WAIT_S", 0.0)
    exits = []
    monkeypatch.setattr(hangs.os, "_exit", exits.append)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        lone = watch_of(1, {}, dist_timeout_s=77)  # one process: nothing to listen for
        assert lone.store is None and lone.listener is None and asked == []
        watch = hangs.Watch(
            SimpleNamespace(process_index=1, num_processes=2, device="cpu"),
            RunConfig(output_dir=str(tmp_path), dist_timeout_s=77),
        )
        assert watch.store is store and watch.listener.daemon and watch.listener.is_alive()
        time.sleep(0.1)  # the thread asks the store, finds no alarm, waits ALARM_CHECK_S
        store.set("alarm", "0")
        watch.listener.join(timeout=5)
        assert not watch.listener.is_alive() and exits == [1]
        assert asked == [77, 77]  # the watch's client, the thread's own
        note = json.loads(store.values["note/1"])
        assert note["waiting_in_a_collective"] is False
        assert any("answers_the_alarm" in frame for frame in note["stack"])  # the main thread's
        quiet = hangs.Watch(
            SimpleNamespace(process_index=1, num_processes=2, device="cpu"),
            RunConfig(output_dir=str(tmp_path), dist_timeout_s=77),
        )
        store.values.pop("alarm")
        quiet.stop()  # the job ends: the thread with it
        assert not quiet.listener.is_alive()
    finally:
        dist.destroy_process_group()


def test_after_a_step_the_note_says_that_step_ended():
    watch = watch_of(2, {})
    watch.step_done(3)
    assert (watch.note["step"], watch.note["phase"]) == (
        3,
        "the end of the step (logging votes, eval, checkpoint)",
    )


class Clock:
    """hangs.time with a perf_counter that says what the test sets."""

    def __init__(self, now):
        self.now = now

    def perf_counter(self):
        return self.now

    monotonic = perf_counter


def straggler_row(monkeypatch, table, window_s=2.0, **cfg):
    """The stragglers row of rank 0 in a world of len(table), the ranks' (data, forward) seconds
    exact (float64), over a window of window_s seconds; the reduce only sums."""
    monkeypatch.setattr(hangs, "time", Clock(100.0))
    watch = watch_of(len(table), {}, **cfg)
    watch.window_started = 100.0 - window_s
    watch.plumbing.reduce = lambda tensor, how: {"sum": torch.tensor(table, dtype=torch.float64)}[
        how
    ]
    return watch.stragglers()


def test_the_slowest_rank_and_the_others_median_are_found_wherever_it_is(monkeypatch):
    row = straggler_row(monkeypatch, [[0.9, 0.0], [0.1, 0.0], [0.3, 0.0], [0.5, 0.0]])
    assert (row["slowest_rank"], row["median_rank_s"]) == (0, 0.3)  # of 0.1, 0.3, 0.5
    row = straggler_row(monkeypatch, [[0.1, 0.0], [0.3, 0.0], [0.9, 0.0], [0.5, 0.0], [0.2, 0.0]])
    assert (row["slowest_rank"], row["median_rank_s"]) == (2, 0.25)  # of 0.1, 0.3, 0.5, 0.2
    assert row["straggler_rank"] == 2 and row["straggler_data_s"] == 0.9


def test_a_straggler_s_edges_are_strict(monkeypatch):
    """By hand, in a 2 s window (its 10%: 0.2 s), factor 2: exactly twice as slow is not a straggler,
    nor a lag of exactly 0.2 s, nor one of exactly STRAGGLER_MIN_S; a lag under STRAGGLER_MIN_S is
    not, however large the two times together."""
    assert "straggler_rank" not in straggler_row(monkeypatch, [[0.25, 0.0], [0.25, 0.25]])
    assert "straggler_rank" in straggler_row(monkeypatch, [[0.25, 0.0], [0.25, 0.26]])
    assert "straggler_rank" not in straggler_row(monkeypatch, [[0.0, 0.0], [0.2, 0.0]])
    monkeypatch.setattr(hangs, "STRAGGLER_MIN_S", 0.25)
    assert "straggler_rank" not in straggler_row(monkeypatch, [[0.0, 0.0], [0.25, 0.0]], 1.0)
    monkeypatch.setattr(hangs, "STRAGGLER_MIN_S", 0.1)
    assert "straggler_rank" not in straggler_row(monkeypatch, [[0.04, 0.0], [0.12, 0.0]], 1.0)


def test_each_window_starts_where_the_last_report_ended(monkeypatch):
    clock = Clock(100.0)
    monkeypatch.setattr(hangs, "time", clock)
    watch = watch_of(2, {})  # its window starts now: 100.0
    watch.plumbing.reduce = lambda tensor, how: torch.tensor([[0.0, 0.0], [0.5, 0.0]])
    clock.now = 110.0  # 10 s later: a lag of 0.5 s is 5%, no straggler
    assert "straggler_rank" not in watch.stragglers()
    clock.now = 112.0  # 2 s after the report: 25%
    assert watch.stragglers()["straggler_rank"] == 1


class LateStore(Store):
    """The notes of the other ranks arrive `after` seconds after the first question."""

    def __init__(self, after):
        super().__init__()
        self.after, self.first, self.late = after, None, {}

    def check(self, keys):
        import time as real_time

        self.first = self.first or real_time.monotonic()
        if real_time.monotonic() - self.first >= self.after:
            self.values.update(self.late)
        return super().check(keys)


def test_the_notes_are_waited_for_until_they_all_came(monkeypatch):
    monkeypatch.setattr(hangs, "ANSWER_WAIT_S", 3.0)
    watch = watch_of(2, {})
    del watch.notes
    watch.store = LateStore(after=0.2)
    watch.store.late = {"note/0": b'{"step": 1}', "note/1": b'{"step": 2}'}
    assert watch.notes() == {0: {"step": 1}, 1: {"step": 2}}


def test_explain_notes_the_error_raises_the_alarm_and_the_second_rank_says_nothing(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(hangs, "ANSWER_WAIT_S", 0.05)
    store = Store()
    said = []
    for rank in (1, 0):
        watch = hangs.Watch(
            SimpleNamespace(process_index=rank, num_processes=2, device="cpu"),
            RunConfig(output_dir=str(tmp_path), step_timeout_s=60),
        )
        watch.store = store
        monkeypatch.setattr(hangs, "_watch", watch)
        said.append(hangs.explain(RuntimeError("Timed out waiting 60000ms\nrest")))
        assert watch.saw_failure is True
        assert store.values["alarm"] == str(rank).encode()  # who raised it
    assert said[1] == ("", False)
    assert said[0][1] and " timed out (step_timeout_s 60) on rank(s) " in said[0][0]
    note = json.loads(store.values["note/1"])
    assert (note["error"], note["waiting_in_a_collective"]) == ("Timed out waiting 60000ms", True)


class NoAlarm(Store):
    """A store whose node went down between this rank's note and its alarm."""

    def set(self, key, value):
        if key == "alarm":
            raise ConnectionResetError("Connection reset by peer")
        super().set(key, value)


def test_a_store_lost_before_the_alarm_makes_the_local_rank_0_say_the_store_s_node_is_gone(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(hangs, "ANSWER_WAIT_S", 0.05)
    monkeypatch.setenv("LOCAL_RANK", "0")
    watch = hangs.Watch(
        SimpleNamespace(process_index=1, num_processes=2, device="cpu"),
        RunConfig(output_dir=str(tmp_path)),
    )
    watch.store = NoAlarm()
    watch.store.add("speaker", 1)  # another rank claimed the line in the store
    monkeypatch.setattr(hangs, "_watch", watch)
    line, says = hangs.explain(RuntimeError("Connection closed by peer"))
    assert watch.store_gone and says
    assert "and the job's store at " in line and "the main node is gone" in line


@pytest.mark.parametrize(
    "local_rank, store_gone, says",
    [("0", True, True), ("1", True, False), ("0", False, False)],
)
def test_after_the_launchers_sigterm_only_a_node_that_lost_the_main_node_says_its_line(
    local_rank, store_gone, says, tmp_path, monkeypatch, capsys
):
    """A rank whose collective fails after its launcher's SIGTERM: with the job's store alive, the
    SIGTERM means one of this node's ranks failed first with a line of its own, so the rank that
    claimed the job's line says nothing; with the store gone, the main node's launcher is gone too,
    and the SIGTERM came because a silent local rank ended while this one waited on it in a
    collective: the node's local rank 0 says the line, exit 1, or no node says anything (1 run in 8
    of test_two_node.py's main-node kill, under load)."""
    import job

    monkeypatch.setattr(hangs, "ANSWER_WAIT_S", 0.05)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    watch = hangs.Watch(
        SimpleNamespace(process_index=2, num_processes=4, device="cpu"),
        RunConfig(output_dir=str(tmp_path)),
    )
    watch.store = Store()
    watch.store.gone = store_gone
    monkeypatch.setattr(hangs, "_watch", watch)
    monkeypatch.setattr(job.stop_signals, "signal_name", "SIGTERM")
    hang = hangs.explain(RuntimeError("Connection closed by peer"))
    # the store alive: this rank claims the line, and the SIGTERM says another rank spoke first
    assert hang[1] is (local_rank == "0")
    with pytest.raises(SystemExit) as exited:
        job.exit_after_a_failed_collective(*hang)
    assert exited.value.code == 1
    said = capsys.readouterr().err.splitlines()
    if not says:
        assert said == []
        return
    assert len(said) == 1 and said[0].startswith("error: a collective in "), said
    assert "lost a peer on rank(s) 2, and the job's store at 10.0.0.1:29500 with it" in said[0]
    assert "the main node is gone (killed, or down)" in said[0]
