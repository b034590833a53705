"""Hangs and stragglers, named.

A hang: a rank stops calling collectives (a data stall, a deadlock, a dead GPU) and the others wait
in their next one. How long they wait:
    dist_timeout_s    start-up (data preparation, the first step with its compile), checkpoint saves
                      and the export: long, for the slow but healthy
    step_timeout_s    every training step after the first: a hang is caught in minutes, not 30
(the process group's own timeout, switched between the two with torch.distributed's _set_pg_timeout).

Where each rank is: a note of its step and phase (data, loss weights: the step's counted items summed
over the ranks, forward, backward: DDP's gradient all-reduce, optimizer, between steps: logging votes,
eval, the checkpoint) kept up to date by the loop. When a
collective fails on a rank (timed out, or a peer gone), that rank publishes its note in the job's
store and raises the alarm there; a thread on every other rank, asleep on that alarm, wakes and
publishes its own note with its main thread's Python stack (where it is), then ends its process
once the line is said (it is the one stuck, or its next collective would fail too). Every
note goes to <output_dir>/hangs/rank{r}.json as well. The job's one error line is said by one rank,
the first to fail that claims it in the store (a rank that cannot reach the store: the local rank 0
of its node, whose line then says the store's node is gone):
    timed out     the ranks that did not arrive and where each one was; a rank that never answers
                  is named too: gone (killed, or stuck where Python cannot run)
    a peer gone   the ranks that never answered, named lost (killed, or their node down); a live
                  rank that was elsewhere is not at fault and not named
The other ranks say nothing and wait for their launcher to stop them (a rank that ended first would
make its launcher stop the one saying the line).

Stragglers: each rank times what it does alone in a step, with no collective in it under DDP:
waiting for its data and the forward pass (the backward pass includes the gradient all-reduce, where
the fast ranks wait for the slow one). At each logging step the ranks share these times; metrics.jsonl
has the slowest rank and its time against the other ranks' median, and names it `straggler_rank`
when it is more than straggler_factor times slower and that costs 10% of the time or more (and
0.1 s per logging window). Under
FSDP the forward pass gathers weights (a collective), so there a straggler shows in its data time
only.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from errors import first_line
from profiling import start_clock
from run_folder import RunFolder

ANSWER_WAIT_S = 5.0  # how long the rank that saw the failure waits for the others' notes
# how long a rank that does not say the line waits for its launcher to stop it
SILENT_WAIT_S = 3 * ANSWER_WAIT_S
ALARM_CHECK_S = 0.5
# a straggler is named when it costs at least this share of the job's time, and this many seconds
# per logging window (a hiccup of a few milliseconds in a fast step is no straggler)
STRAGGLER_COST = 0.1
STRAGGLER_MIN_S = 0.1
_watch: Watch | None = None  # this process's, once the run folder is known


class Watch:
    """This rank's note of where it is, its share of the straggler timing, and the thread that
    answers another rank's alarm. One per process (train() makes it)."""

    def __init__(self, plumbing, cfg):
        global _watch
        self.plumbing = plumbing
        self.cfg = cfg
        self.rank = plumbing.process_index
        self.world_size = plumbing.num_processes
        self.note = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid()}
        self.note.update(step=0, phase="start-up")
        self.training = False
        self.completed = 0  # optimizer steps done: the phases of a step are noted for the next one
        self.saw_failure = False
        self.store_gone = False  # the job's store did not answer: the node that holds it is gone
        self.alone_s = {"data": 0.0, "forward": 0.0}
        self.gpu_forward_events = []
        self.window_started = time.perf_counter()
        self.store = None
        self.closed = threading.Event()
        self.listener = None
        if self.world_size > 1 and dist.is_initialized():
            self.store = job_store(cfg.dist_timeout_s)
            self.listener = threading.Thread(target=self._answer_alarm, daemon=True)
            self.listener.start()
            atexit.register(self.stop)  # however the process ends (job.py stops it earlier)
        _watch = self

    # ------------------------------------------------------------ where this rank is

    def at(self, phase: str) -> None:
        """Note the phase this rank enters, of the step it is training."""
        self.note.update(step=self.completed + 1, phase=phase)

    @contextmanager
    def timed(self, phase: str):
        """Note the phase, and time what runs inside: what this rank does alone (data, forward)."""
        self.at(phase)
        if phase == "forward" and torch.cuda.is_available():  # the GPU's time, not the launch's
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.gpu_forward_events.append((start, end))
            return
        started = time.perf_counter()
        if phase == "data" and not self.training:
            # this start's first batch: the loader placed at the run's position, its workers
            # started (the restart report's "data position", profiling.py)
            with start_clock.phase("data position"):
                yield
        else:
            yield
        self.alone_s[phase] += time.perf_counter() - started

    def step_done(self, step: int) -> None:
        """After each optimizer step. After the first (data ready, compiled), training's timeout."""
        self.completed = step
        self.note.update(step=step, phase="the end of the step (logging votes, eval, checkpoint)")
        if not self.training and self.store is not None:
            set_collective_timeout(self.cfg.step_timeout_s)
        self.training = True

    @contextmanager
    def patient(self, phase: str):
        """Around a save or the export: the long timeout, for a slow write on one rank."""
        before = self.note["phase"]
        self.note["phase"] = phase
        if self.training and self.store is not None:
            set_collective_timeout(self.cfg.dist_timeout_s)
        try:
            yield
        finally:
            if self.training and self.store is not None:
                set_collective_timeout(self.cfg.step_timeout_s)
            self.note["phase"] = before

    def stop(self) -> None:
        """The listening thread stops (at most ALARM_CHECK_S later)."""
        if self.listener is not None:
            self.closed.set()
            self.listener.join(timeout=2 * ALARM_CHECK_S)

    # ------------------------------------------------------------ stragglers

    def stragglers(self) -> dict:
        """At a logging step (collective): the slowest rank's time alone since the last one, the
        median of the other ranks', and `straggler_rank` if it is more than straggler_factor times
        slower."""
        if self.world_size == 1:
            return {}
        forward_s = self.alone_s["forward"]
        forward_s += sum(start.elapsed_time(end) for start, end in self.gpu_forward_events) / 1000
        mine = torch.zeros(self.world_size, 2, device=self.plumbing.device)
        mine[self.rank] = torch.tensor([self.alone_s["data"], forward_s])
        shared = self.plumbing.reduce(mine, "sum").tolist()  # every rank's (data, forward)
        self.alone_s = dict.fromkeys(self.alone_s, 0.0)
        self.gpu_forward_events = []
        alone = [data + forward for data, forward in shared]
        slowest = max(range(self.world_size), key=alone.__getitem__)
        # the others' median: with two ranks, the other one
        median = statistics.median(alone[:slowest] + alone[slowest + 1 :])
        row = {"slowest_rank": slowest, "slowest_rank_s": alone[slowest], "median_rank_s": median}
        window_s = time.perf_counter() - self.window_started
        self.window_started = time.perf_counter()
        # named when it is slower by the factor and that costs every rank time (STRAGGLER_COST)
        lag_s = alone[slowest] - median
        costly = lag_s > STRAGGLER_MIN_S and lag_s > STRAGGLER_COST * window_s
        if alone[slowest] > self.cfg.straggler_factor * median and costly:
            row["straggler_rank"] = slowest
            data, forward = shared[slowest]
            row["straggler_data_s"] = data
            row["straggler_forward_s"] = forward
        return row

    # ------------------------------------------------------------ a hang

    def publish(self, note: dict) -> None:
        """This rank's note: in the job's store (for the rank that says the error line) and in
        <output_dir>/hangs/rank{r}.json."""
        encoded = json.dumps(note, indent=2)
        try:
            self.store.set(f"note/{self.rank}", encoded)
        except Exception:  # noqa: BLE001 - the store went with its node: the file still tells
            self.store_gone = True
        folder = RunFolder.of(self.cfg).path("hangs")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{self.rank}.json").write_text(encoded + "\n")

    def notes(self) -> dict[int, dict]:
        """The notes published within ANSWER_WAIT_S, by rank."""
        keys = [f"note/{rank}" for rank in range(self.world_size)]
        found = {}
        try:
            deadline = time.monotonic() + ANSWER_WAIT_S
            while time.monotonic() < deadline and not self.store.check(keys):
                time.sleep(0.05)
            for rank, key in enumerate(keys):
                if self.store.check([key]):
                    found[rank] = json.loads(self.store.get(key))
        except Exception:  # noqa: BLE001 - the store is gone: what this rank knows
            self.store_gone = True
        return found

    def claims_the_line(self) -> bool:
        """Whether this rank says the job's error line: the first to ask the store. Without the
        store, each node's local rank 0 (one line in each surviving node's log)."""
        if not self.store_gone:
            try:
                return self.store.add("speaker", 1) == 1
            except Exception:  # noqa: BLE001
                self.store_gone = True
        return os.environ.get("LOCAL_RANK", "0") == "0"

    def _answer_alarm(self) -> None:
        """Looks for another rank's alarm twice a second (a question to the store, answered at once:
        a thread waiting inside the store's client when the process exits would abort it). Then this
        rank's note, with its stack, and the end of this process once the line is said."""
        listener = job_store(self.cfg.dist_timeout_s)  # a client of its own: one per thread
        try:
            while not listener.check(["alarm"]):
                if self.closed.wait(ALARM_CHECK_S):
                    return  # the job is ending
        except Exception:  # noqa: BLE001 - the job ended and its store with it
            return
        if self.saw_failure:
            return  # the main thread has it in hand
        stack = traceback.format_stack(sys._current_frames()[threading.main_thread().ident])
        self.publish({**self.note, "waiting_in_a_collective": False, "stack": stack[-12:]})
        time.sleep(SILENT_WAIT_S)  # while the waiting ranks say the line
        os._exit(1)


def explain(error: RuntimeError) -> tuple[str, bool] | None:
    """A collective failed on this rank (timed out, or a peer gone): publish this rank's note, raise
    the alarm, and, on the rank that claims the line, describe who did not arrive. Returns (the
    line, whether this rank says it); None without a watch (one process, or before the run
    folder)."""
    watch = _watch
    if watch is None or watch.store is None:
        return None
    watch.saw_failure = True
    note = {**watch.note, "waiting_in_a_collective": True, "error": first_line(error)}
    watch.publish(note)
    try:
        watch.store.set("alarm", str(watch.rank))
    except Exception:  # noqa: BLE001 - the store is gone with its node
        watch.store_gone = True
    if not watch.claims_the_line():
        return "", False
    return describe(watch, error), True


def timed_out(error: RuntimeError | None) -> bool:
    """Whether a collective timed out (not a peer gone: its connection closed or reset)."""
    message = str(error).lower()
    return "timed out" in message or "timeout" in message


def describe(watch: Watch, error: RuntimeError) -> str:
    """One line: which collective failed, the ranks that did not arrive (or are lost) and where
    they were."""
    notes = watch.notes()
    waiting = sorted(rank for rank, note in notes.items() if note.get("waiting_in_a_collective"))
    waiting = waiting or [watch.rank]
    first = notes.get(waiting[0], watch.note)
    where = f"a collective in {first['phase']} (step {first['step']})"
    on_ranks = ", ".join(map(str, waiting))
    folder = RunFolder.of(watch.cfg).path("hangs")
    if watch.store_gone:
        store = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        return (
            f"{where} lost a peer on rank(s) {on_ranks}, and the job's store at {store} with it: "
            f"the main node is gone (killed, or down) (this rank's note: {folder})"
        )
    silent = [rank for rank in range(watch.world_size) if rank not in notes]
    if not timed_out(error):
        lost = ", ".join(map(str, silent)) or "none"
        return (
            f"{where} failed on rank(s) {on_ranks}: rank(s) {lost} lost (gone without a word: "
            f"killed, or their node down) (each rank's note and stack: {folder})"
        )
    said = []
    for rank in range(watch.world_size):
        note = notes.get(rank)
        if note is None:
            said.append(f"rank {rank} did not answer (gone: killed, or stuck outside Python)")
        elif not note.get("waiting_in_a_collective"):
            said.append(
                f"rank {rank} did not arrive: it was in {note['phase']} (step {note['step']})"
            )
    how = f"timed out (step_timeout_s {watch.cfg.step_timeout_s})"
    said_all = "; ".join(said) or "every rank was waiting"
    return f"{where} {how} on rank(s) {on_ranks}: {said_all} (each rank's note and stack: {folder})"


def main_node_gone() -> bool:
    """Whether this rank found the job's store gone, and with it the node that held it (rank 0's)."""
    return _watch is not None and _watch.store_gone


def stop_watching() -> None:
    """At the job's end, before the process group goes: the listening thread stops."""
    if _watch is not None:
        _watch.stop()


@contextmanager
def patiently(phase: str):
    """The long timeout around a save or the export (a no-op before a watch exists)."""
    if _watch is None:
        yield
        return
    with _watch.patient(phase):
        yield


def job_store(timeout_s: int):
    """A client of the job's store (the one the process group started with, under the prefix of
    this elastic attempt, as plumbing.init_process_group uses it)."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"attempt_{attempt}/hangs", store)


def set_collective_timeout(seconds: int) -> None:
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))
