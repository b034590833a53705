"""The signals that stop a job: SIGTERM (SLURM, Kubernetes), SIGUSR1 (SLURM's --signal), Ctrl-C,
and the death of the launcher (its parent process gone, or the console pipe it read broken). During
start-up the job stops at once (Preempted); in the loop the ranks vote at logging steps and all stop
at the same step, with a checkpoint (main.py). A DataLoader's worker processes leave these signals to
their training process, which checkpoints first (loader_worker_options). How the job then ends, and
with which code: job.py."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import sys
import threading
import time
from multiprocessing import context as mp_context

import torch

LAUNCHER_CHECK_S = 1.0  # how often a worker checks that its launcher is alive
LAUNCHER_LOST = "the launcher's exit"  # a stop's cause, as a signal's name would be
STOP_CAUSES = ("SIGTERM", "SIGUSR1", "SIGINT", LAUNCHER_LOST)


class Preempted(BaseException):  # not an Exception: nothing may catch it on the way out
    """A stop signal that arrived before the loop started: there is nothing new to checkpoint."""


class StopSignals:
    """SIGTERM (SLURM, Kubernetes), SIGUSR1 (SLURM's --signal), Ctrl-C, and the death of the process that
    launched this one: checkpoint and stop. During start-up, stop at once (Preempted); in the loop the ranks
    vote at logging steps and all stop at the same step. 2nd Ctrl-C: now."""

    # EX_TEMPFAIL, "try again later": stopped early with a checkpoint, requeue me
    PREEMPTED_EXIT_CODE = 75
    INTERRUPTED_EXIT_CODE = 130  # Ctrl-C: stopped with a checkpoint, but nobody asked for a requeue

    def __init__(self):
        self.signal_name = None
        self.loop_running = False

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        self._watch_launcher()
        self._watch_console()

    def _watch_launcher(self) -> None:
        """A launcher (accelerate launch, torchrun, mp.spawn, a shell) that dies without stopping its workers
        (kill -9, the OOM killer, a closed terminal) leaves them running on their own, in sessions of their
        own, holding the run folder's lock and the GPUs. Each worker checks once a second that its parent is
        still the process that started it; when it is not, it stops as on SIGTERM: a checkpoint at the next
        logging step, taken by all ranks together, then exit 75. (Under --max_restarts the agent is alive
        and restarts the workers itself; under SLURM, slurmstepd is the parent and ends the step.)"""
        launcher = os.getppid()
        if launcher == 1:  # started by init (a container's entry point): nothing to watch
            return

        def watch():
            while os.getppid() == launcher:
                time.sleep(LAUNCHER_CHECK_S)
            self._launcher_lost()

        threading.Thread(target=watch, name="launcher-watch", daemon=True).start()

    def _watch_console(self) -> None:
        """A worker's console is often a pipe that its launcher reads (scripts/launch.py, a sweep's
        driver, `| tee`). When that reader is killed, the worker's next print fails on the broken pipe
        (EPIPE), before the check above sees its parent gone: a crash with no checkpoint, its peers
        left waiting in a collective. So a broken console is the launcher's loss too: a stop with a
        checkpoint, and from then on the console writes to /dev/null."""
        # SIGPIPE would kill the process on the write: make it the error handled below (Python's
        # own default, which a library may have undone)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if stream is not None and not isinstance(stream, _Console):  # None: no console at all
                setattr(sys, name, _Console(stream, self._launcher_lost))

    def _launcher_lost(self) -> None:
        if self.signal_name is None:  # the first stop's cause is the one said
            self.signal_name = LAUNCHER_LOST
            os.kill(os.getpid(), signal.SIGTERM)  # handled in the main thread, like any stop

    def _on_signal(self, signum, _frame) -> None:
        if signum == signal.SIGINT and self.signal_name == "SIGINT":
            raise KeyboardInterrupt  # the second Ctrl-C
        self.signal_name = self.signal_name or signal.Signals(signum).name
        if not self.loop_running:
            raise Preempted(self.signal_name)

    def requested(self, plumbing) -> bool:
        """The vote, at a logging step: whether any rank got a stop, and which (a rank that got
        none takes the first rank's cause, so that all say and exit alike)."""
        votes = torch.zeros(len(STOP_CAUSES), device=plumbing.device)
        if self.signal_name is not None:
            votes[STOP_CAUSES.index(self.signal_name)] = 1
        causes = plumbing.reduce(votes, "sum").tolist()  # collective, and a CPU-GPU sync
        if not any(causes):
            return False
        first_cause = next(cause for cause, count in zip(STOP_CAUSES, causes, strict=True) if count)
        self.signal_name = self.signal_name or first_cause
        return True

    @property
    def exit_code(self) -> int:
        return (
            self.INTERRUPTED_EXIT_CODE if self.signal_name == "SIGINT" else self.PREEMPTED_EXIT_CODE
        )


stop_signals = StopSignals()


class _Console:
    """sys.stdout or sys.stderr: a write that finds the pipe broken calls `broken` once and sends the
    descriptor to /dev/null (every later write, C++'s and the exit's flush included, then succeeds)."""

    def __init__(self, stream, broken):
        self._stream = stream
        self._broken = broken

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._lost()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._lost()

    def _lost(self) -> None:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self._stream.fileno())
        os.close(null)
        self._broken()

    def __getattr__(self, name: str):  # fileno, isatty, buffer, encoding, ...: the stream's own
        return getattr(self._stream, name)


# ---------------------------------------------------------------- DataLoader workers leave the stops to it

# what every process of a job may be sent: its training processes handle them, their loader workers not
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def loader_worker_options(num_workers: int) -> dict:
    """The DataLoader options that keep a stop signal from killing the loader workers.

    A preemption signals every process of a worker's group, its DataLoader workers included: torch
    elastic (accelerate launch, torchrun) passes SIGTERM to each worker's process group, SLURM
    signals every process of the step, Ctrl-C the terminal's foreground group. A loader worker dies
    of it (torch's SIGTERM handler in a worker dies on any sender but its parent), and the training
    process then fails on "DataLoader worker is killed by signal" before it reaches the checkpoint
    the signal asked for: everything since the last checkpoint is lost. So each worker starts with
    the stop signals blocked (until its init below, whatever the start method) and leaves them to
    the training process, which checkpoints, stops, and ends its workers itself."""
    if not num_workers:
        return {}  # no worker processes (and DataLoader refuses a context without them)
    method = multiprocessing.get_start_method(allow_none=True)
    method = method or multiprocessing.get_all_start_methods()[0]  # the default one
    # this process: a worker's parent under fork and spawn, not under forkserver
    trainer = os.getpid()
    return {
        "multiprocessing_context": _CONTEXTS[method](),
        "worker_init_fn": functools.partial(loader_worker_leaves_stops_to_its_trainer, trainer),
    }


def loader_worker_leaves_stops_to_its_trainer(trainer: int, worker_id: int) -> None:
    """A loader worker's `worker_init_fn`: ignore SIGINT and SIGUSR1, and take a SIGTERM from the
    training process only (torch ends a worker that does not finish with one, and so does
    multiprocessing at the training process's exit)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a pending one is dropped
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # Blocked, SIGTERM stays pending until the thread below takes it and reads who sent it (a
    # Python handler is not told).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(
        target=_end_on_sigterm_from, args=(trainer,), name="sigterm-filter", daemon=True
    ).start()


def _end_on_sigterm_from(trainer: int) -> None:
    while True:
        sender = signal.sigwaitinfo({signal.SIGTERM}).si_pid
        if sender == trainer:
            os._exit(0)  # as torch's handler does: the trainer is shutting its workers down


class _StartsWithStopsBlocked:
    """A worker process starts with the stop signals blocked, which it inherits (fork, spawn) until
    its init takes them over: one that comes while it starts (seconds, under spawn) waits for it.
    They are held in this process only while it starts the worker, then delivered as usual."""

    def start(self):
        held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


class _ForkProcess(_StartsWithStopsBlocked, mp_context.ForkProcess):
    pass


class _SpawnProcess(_StartsWithStopsBlocked, mp_context.SpawnProcess):
    pass


class _ForkServerProcess(_StartsWithStopsBlocked, mp_context.ForkServerProcess):
    pass


class _ForkContext(mp_context.ForkContext):
    Process = _ForkProcess


class _SpawnContext(mp_context.SpawnContext):
    Process = _SpawnProcess


class _ForkServerContext(mp_context.ForkServerContext):
    Process = _ForkServerProcess


_CONTEXTS = {"fork": _ForkContext, "spawn": _SpawnContext, "forkserver": _ForkServerContext}
