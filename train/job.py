"""The job around the loop: its run folder (a fresh runs/run_NNN unless --output_dir names one),
locked by one job at a time (flock on <output_dir>/.lock, freed by the kernel when the holder dies;
which filesystems honour it: README), decisions every process takes together, the signals that stop
it, and how it ends: 0 finished, 2 a refused input (config, run folder in use, checkpoint that does
not fit), 75 preempted with a checkpoint (requeue me), 130 stopped by Ctrl-C, 1 any other failure;
at most one `error: ...` line per job, and no process left waiting on one that failed."""

from __future__ import annotations

import atexit
import fcntl
import functools
import json
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from dataclasses import replace
from multiprocessing import context as mp_context
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint import latest_checkpoint, read_manifest, run_geometry, step_of
from checks import check_dataset_name, check_devices, check_launch, check_model_and_tokenizer
from config import TrainConfig, is_url, load_config
from errors import CheckpointError, ConfigError, RunError, first_line, the_line
from hangs import SILENT_WAIT_S, stop_watching
from hangs import explain as explain_hang
from harness import check_tasks
from plumbing import close_process_group, collectively, is_writer
from resume import check_same_run, check_sources
from storage import check_output_dir, take_lease
from task import check_fork_files
from tracking import write_preempted_marker

LAUNCHER_CHECK_S = 1.0  # how often a worker checks that its launcher is alive
LAUNCHER_LOST = "the launcher's exit"  # a stop's cause, as a signal's name would be
STOP_CAUSES = ("SIGTERM", "SIGUSR1", "SIGINT", LAUNCHER_LOST)
# Long enough for a slow rank 0 to fail too and the launcher (it polls every 0.1 s) to stop the
# rest.
OTHER_RANKS_ERROR_DELAY_S = 5.0
LOADER_DEATH = "DataLoader worker (pid"  # how torch's RuntimeError for a dead loader worker starts
LOADER_RAISES_TOLERATED = 64  # a dead worker's error raised again this often on the way out: exit
RUNS_ROOT = Path("runs")
RUN_NAME = re.compile(r"run_(\d+)")
_held_locks = []  # open until the process exits: closing the file would release the lock


def claim_run_folder(cfg, plumbing, identity: dict) -> TrainConfig:
    """Settle output_dir (the same on every process) and lock it for this job. Returns the config
    with it. Without --output_dir, --resume latest takes the newest run folder, if that run fits this one
    (`identity`: its data)."""
    if not cfg.output_dir:
        number = 0
        if plumbing.is_main_process:
            number = pick_run_number(newest=cfg.resume == "latest")
        number_everywhere = plumbing.reduce(
            torch.tensor(float(number), device=plumbing.device), "sum"
        )
        cfg = replace(cfg, output_dir=str(RUNS_ROOT / f"run_{int(number_everywhere.item()):03d}"))
        if cfg.resume == "latest":
            check_the_newest_run_fits(cfg, plumbing, identity)
    writer = is_writer(plumbing, cfg.run_dir_is_shared)

    def lock():
        if writer:
            lock_run_folder(cfg.run_dir)

    collectively(plumbing, "locking the run folder", lock, ConfigError)
    return cfg


def check_the_newest_run_fits(cfg, plumbing, identity: dict) -> None:
    """The newest run folder, picked for --resume latest, must hold a run of this geometry and data: else
    say which folder was looked at, what differs, and how to choose."""
    newest = latest_checkpoint(cfg.output_dir)
    if newest is None:
        return
    try:
        check_same_run(newest, read_manifest(newest), run_geometry(plumbing, cfg), cfg, identity)
    except CheckpointError as e:
        raise CheckpointError(
            f"--resume latest without --output_dir took the newest run, {cfg.output_dir}, which is "
            f"another run: {e}. Pass --output_dir to name the run to resume (or a new folder)"
        ) from None


def pick_run_number(newest: bool) -> int:
    """The newest runs/run_NNN (to resume it), or a new one, created here so that two jobs never
    share it."""
    numbers = [
        int(m.group(1)) for p in RUNS_ROOT.glob("run_*") if (m := RUN_NAME.fullmatch(p.name))
    ]
    if newest and numbers:
        return max(numbers)
    number = max(numbers, default=0) + 1
    RUNS_ROOT.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            (RUNS_ROOT / f"run_{number:03d}").mkdir()
            return number
        except FileExistsError:  # another job took it a moment ago
            number += 1


def try_lock_run_folder(output_dir: str) -> bool:
    """Whether this process holds the run folder's lock, taking it if it is free."""
    if not _held_locks:
        try:
            lock_run_folder(output_dir)
        except (ConfigError, OSError):
            return False
    return True


def held_run_folder() -> str:
    """The run folder whose lock this process holds, or ""."""
    if not _held_locks:
        return ""
    return str(Path(_held_locks[0].name).parent)


def lock_run_folder(output_dir: str) -> None:
    """Take <output_dir>/.lock for as long as this process lives, or raise ConfigError naming the
    holder."""
    path = Path(output_dir) / ".lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = open(path, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "a process that has not written its name yet"
        lock.close()
        raise ConfigError(
            f"output_dir '{output_dir}' is in use by another job ({holder}); wait for it to end, "
            f"or choose another output_dir"
        ) from None
    lock.truncate(0)
    lock.write(
        f"host {os.uname().nodename}, pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
    )
    lock.flush()
    _held_locks.append(lock)


# ---------------------------------------------------------------- stop signals


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
            self.signal_name = self.signal_name or LAUNCHER_LOST
            os.kill(os.getpid(), signal.SIGTERM)  # handled in the main thread, like any stop

        threading.Thread(target=watch, name="launcher-watch", daemon=True).start()

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


# ---------------------------------------------------------------- how a job ends: one exit code, at most one line


def load_config_or_exit(argv, lease: bool = True) -> TrainConfig:
    """The checked config, or `error: ...` and exit 2: before any process group, port or folder
    exists. `lease`: on object storage, take the run's lease (rank 0; a check alone does not)."""
    try:
        return load_checked_config(argv, lease)
    except ConfigError as e:
        exit_with_error(e)


def load_checked_config(argv, lease: bool = True) -> TrainConfig:
    """load_config's types and ranges, then what needs a file or the hub."""
    cfg = load_config(argv)
    check_fork_files(cfg)  # model.py and data.py define what the template uses
    check_sources(cfg)  # --resume, --init_from
    # on object storage: the package it needs, the bucket
    check_output_dir(cfg.output_dir, cfg.upload_timeout_s)
    if lease and is_url(cfg.output_dir) and os.environ.get("RANK", "0") == "0":
        take_lease(cfg)  # one job per URL, as the lock is one per folder (storage.py)
    check_devices(cfg)  # sync_batchnorm: GPUs only
    check_launch()  # a multi-node environment that started this process alone
    # each source of a mixture, or the one dataset
    for path in [source.path for source in cfg.mixture] or [cfg.dataset]:
        check_dataset_name(path)
    # a Hugging Face model and tokenizer: their small config files only
    check_model_and_tokenizer(cfg)
    if cfg.eval_tasks:  # installed, and every task known: not found out after the training
        tasks = [task for task in cfg.eval_tasks.split(",") if task]
        check_tasks("eval_tasks", tasks, cfg.eval_task_path)
    return cfg


def run_or_exit(train_fn, cfg, make_plumbing) -> None:
    """Run a training job and turn every way it ends into an exit code (module docstring) and at
    most one line.

    A dead DataLoader worker is reported by torch's SIGCHLD handler, which raises its RuntimeError
    again for every loader child that exits after it (the others, shut down on the way out): at any
    point of the error path, a line half said included. So the first one is kept, the handler is
    put back to the default before anything is said, and a raise met on the way starts the report
    again, once per raise: one line whatever the timing."""
    # before anything slow starts: a signal during start-up is a clean stop too
    stop_signals.install()
    first_death = None
    for _ in range(LOADER_RAISES_TOLERATED):
        try:
            if first_death is None:
                run_and_report(train_fn, cfg, make_plumbing)
            say_a_loader_worker_died(first_death)
        except RuntimeError as again:
            if not str(again).startswith(LOADER_DEATH):
                raise
            first_death = first_death or again
    os._exit(1)  # a loader whose children keep dying: no more words


def say_a_loader_worker_died(error: RuntimeError) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler, which raised, raises no more
    exit_with_error(dead_loader_worker(error))  # (run_and_report's cleanup ran, or was cut short)


def run_and_report(train_fn, cfg, make_plumbing) -> None:
    """run_or_exit's one attempt: the training, and each way out as an exit code and a line."""
    plumbing = None
    try:
        plumbing = make_plumbing(cfg)
        code = train_fn(cfg, plumbing)
    except Preempted:
        code = stopped_before_training(cfg, plumbing)
    except KeyboardInterrupt:  # the second Ctrl-C: stop now, without a checkpoint
        code = StopSignals.INTERRUPTED_EXIT_CODE
    except (ConfigError, RunError, OSError) as e:  # OSError: a full disk or a permission problem
        exit_with_error(e)
    except RuntimeError as e:
        if str(e).startswith(LOADER_DEATH):
            raise  # said by run_or_exit, out of the way of the loader's handler
        if not lost_a_peer(e):
            raise  # a bug: its traceback is the useful output
        hang = explain_hang(e)  # which ranks did not arrive, and where each one was
        if hang is None:  # no watch yet: the peer that died has its own line, this one waits
            line = f"lost contact with another process ({first_line(e)})"
            exit_with_error(RunError(line), another_process_failed=True)
        exit_after_a_failed_collective(*hang)
    finally:
        stop_watching()  # hangs.py's listening thread, before its store goes
        close_process_group()
    sys.exit(code)


def stopped_before_training(cfg, plumbing) -> int:
    """A signal during start-up: nothing new to save. Leave the requeue marker if the run folder is
    ours."""
    rank0 = plumbing.is_main_process if plumbing is not None else os.environ.get("RANK", "0") == "0"
    output_dir = cfg.run_dir or held_run_folder()  # the folder claimed on the way, if any
    preempted = stop_signals.exit_code == stop_signals.PREEMPTED_EXIT_CODE
    if rank0 and output_dir and preempted and try_lock_run_folder(output_dir):
        newest = latest_checkpoint(output_dir)
        if newest is None:
            write_preempted_marker(output_dir, 0, stop_signals.signal_name, None)
        else:
            write_preempted_marker(
                output_dir, step_of(newest), stop_signals.signal_name, str(newest)
            )
    said = f"stopped during start-up on {stop_signals.signal_name}: nothing trained yet; "
    said += "start again with --resume latest"
    print(said, file=sys.stderr)  # noqa: T201 - the job's one line
    return stop_signals.exit_code


def exit_after_flush(code: int) -> None:
    """Run the exit handlers (tracking.MetricsLogger's: the trackers' flush), then exit at once, without
    tearing down a process group whose peer is gone (that can hang)."""
    atexit._run_exitfuncs()
    os._exit(code)


def dead_loader_worker(error: RuntimeError) -> RunError | None:
    """A DataLoader worker killed from outside (the out-of-memory killer's SIGKILL, most often):
    torch's RuntimeError, as one line that says what to do."""
    message = first_line(error).rstrip(".")
    if not message.startswith(LOADER_DEATH):
        return None
    return RunError(
        f"{message}: a data loader worker died, most often of the out-of-memory killer (fewer "
        f"--num_workers, or less memory per sample); the last checkpoint is intact: --resume latest"
    )


def lost_a_peer(error: RuntimeError) -> bool:
    """Whether a collective failed because another process is gone (not a bug of this one)."""
    message = str(error).lower()
    return isinstance(error, dist.DistError) or "gloo" in message or "nccl" in message


def exit_after_a_failed_collective(line: str, says_it: bool) -> None:
    """Exit 1 after a collective failed: the line is said once per job, by the rank hangs.explain
    chose. Its wait for the others' notes gave the launcher time to stop this node if one of its
    ranks failed first, with a line of its own: then this one says nothing. The other ranks wait
    for their launcher to stop them (were one to end first, its launcher would stop the one saying
    the line)."""
    if says_it and stop_signals.signal_name != "SIGTERM":
        say_and_exit(RunError(line))
    if stop_signals.signal_name == "SIGTERM":
        sys.exit(1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if os.environ.get("RANK", "0") == "0":  # rank 0 flushes its trackers first (W&B)
        signal.signal(signal.SIGTERM, lambda *_: exit_after_flush(1))
    time.sleep(SILENT_WAIT_S)
    exit_after_flush(1)


def exit_with_error(error: Exception, another_process_failed: bool = False) -> None:
    """Print `error: ...` and exit with the error's code, once per job rather than once per rank:
    rank 0 speaks at once and the others wait first. If rank 0 failed too, the launcher kills them
    before they repeat it; an error that is theirs alone (a file missing on one node, bad data in
    one rank's share of a stream) still shows, and rank 0's "lost contact" then waits too."""
    code = getattr(error, "exit_code", 1)
    if os.environ.get("RANK", "0") != "0" or another_process_failed:
        # the launcher is already stopping the job for another rank
        if stop_signals.signal_name == "SIGTERM":
            sys.exit(code)
        # the launcher's kill is not a preemption here: the process ends without a word, after its
        # trackers' flush where it holds them (rank 0: W&B keeps the steps it logged)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if another_process_failed and os.environ.get("RANK", "0") == "0":
            signal.signal(signal.SIGTERM, lambda *_: exit_after_flush(code))
        time.sleep(OTHER_RANKS_ERROR_DELAY_S)
    say_and_exit(error)


def say_and_exit(error: Exception) -> None:
    """The job's one line, `error: ...`, and the error's exit code."""
    code = getattr(error, "exit_code", 1)
    line = f"error: {the_line(error)}"
    print(line, file=sys.stderr)  # noqa: T201 - the job's one line
    # the launchers' failure summary shows the worker's TORCHELASTIC_ERROR_FILE as its "Root Cause":
    # our line
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        extra = {"py_callstack": line, "timestamp": str(int(time.time()))}
        Path(path).write_text(json.dumps({"message": {"message": line, "extraInfo": extra}}))
    sys.exit(code)
