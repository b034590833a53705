"""The job around the loop: its run folder (a fresh runs/run_NNN unless --output_dir names one),
locked by one job at a time (flock on <output_dir>/.lock, freed by the kernel when the holder dies;
which filesystems honour it: README), the checks every value gets before any process group starts,
and how the job ends: 0 finished, 2 a refused input (config, run folder in use, checkpoint that
does not fit), 75 preempted with a checkpoint (requeue me), 130 stopped by Ctrl-C, 1 any other
failure; at most one `error: ...` line per job, and no process left waiting on one that failed.
The signals that stop it: stopping.py."""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint import read_manifest, run_geometry
from checks import check_dataset_name, check_devices, check_launch, check_model_and_tokenizer
from config import TrainConfig
from errors import CheckpointError, ConfigError, RunError, first_line, the_line
from hangs import SILENT_WAIT_S, main_node_gone, stop_watching
from hangs import explain as explain_hang
from harness import check_tasks
from plumbing import close_process_group, collectively, is_writer
from profiling import profile_window, start_clock, write_oom_snapshot
from provenance import relaunch_command
from resume import check_same_run, check_sources
from run_config import load_config
from run_folder import RUNS_ROOT, RunFolder, held_run_folder, numbered_run, run_numbers, step_of
from stopping import Preempted, StopSignals, stop_signals
from storage import check_output_dir, open_run_folder
from task import check_fork_files, with_data_default

# Long enough for a slow rank 0 to fail too and the launcher (it polls every 0.1 s) to
# stop the rest.
OTHER_RANKS_ERROR_DELAY_S = 5.0
LOADER_DEATH = "DataLoader worker (pid"  # how torch's RuntimeError for a dead loader worker starts
LOADER_DIED = (
    "a data loader worker died, most often of the out-of-memory killer (fewer --num_workers, or "
    "less memory per sample); the last checkpoint is intact: --resume latest"
)
LOADER_RAISES_TOLERATED = 64  # a dead worker's error raised again this often on the way out: exit


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
        cfg = replace(cfg, output_dir=numbered_run(int(number_everywhere.item())))
        if cfg.resume == "latest":
            check_the_newest_run_fits(cfg, plumbing, identity)
    folder = RunFolder.of(cfg)
    writer = is_writer(plumbing, folder.shared)

    def lock():
        if writer:
            folder.lock()

    collectively(plumbing, "locking the run folder", lock, ConfigError)
    return cfg


def check_the_newest_run_fits(cfg, plumbing, identity: dict) -> None:
    """The newest run folder, picked for --resume latest, must hold a run of this geometry and data: else
    say which folder was looked at, what differs, and how to choose."""
    newest = RunFolder.of(cfg).newest()
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
    numbers = run_numbers()
    if newest and numbers:
        return max(numbers)
    number = max(numbers, default=0) + 1
    RUNS_ROOT.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            Path(numbered_run(number)).mkdir()
            return number
        except FileExistsError:  # another job took it a moment ago
            number += 1


# ---------------------------------------------------------------- how a job ends: one exit code, at most one line


def load_config_or_exit(argv, lease: bool = True) -> TrainConfig:
    """The checked config, or `error: ...` and exit 2: before any process group, port or folder
    exists. `lease`: on object storage, take the run's lease (rank 0; a check alone does not)."""
    start_clock.lap("imports")  # the restart report's phases (profiling.py)
    try:
        cfg = load_checked_config(argv, lease)
    except ConfigError as e:
        exit_with_error(e)
    start_clock.lap("checks")
    return cfg


def load_checked_config(argv, lease: bool = True) -> TrainConfig:
    """load_config's types and ranges, then what needs a file or the hub."""
    cfg = with_data_default(load_config(argv))  # --dataset not given: data.py's default, if any
    check_fork_files(cfg)  # model.py and data.py define what the template uses
    check_sources(cfg)  # --resume, --init_from
    # on object storage: the package it needs, the bucket
    check_output_dir(cfg.output_dir, cfg.upload_timeout_s)
    if lease and os.environ.get("RANK", "0") == "0":
        # on object storage: one job per URL, as the lock keeps one per folder (storage.py)
        open_run_folder(cfg).take_lease()
    check_devices(cfg)  # sync_batchnorm, oom_snapshot: GPUs only
    profile_window(cfg)  # --profile_steps START:END
    check_launch()  # a multi-node environment that started this process alone
    # each source of a mixture, or the one dataset
    for path in [source.path for source in cfg.mixture] or [cfg.dataset]:
        if path:  # "": a fork's data.py that names its own data, or reads none
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
        start_clock.lap("process group")
        code = train_fn(cfg, plumbing)
    except Preempted:
        code = stopped_before_training(cfg, plumbing)
    except KeyboardInterrupt:  # the second Ctrl-C: stop now, without a checkpoint
        code = StopSignals.INTERRUPTED_EXIT_CODE
    except (ConfigError, RunError, OSError) as e:  # OSError: a full disk or a permission problem
        exit_with_error(loader_connection_lost(e) or e)
    except EOFError as e:  # a loader worker gone mid-handshake (loader_connection_lost); else a bug
        if loader_connection_lost(e) is None:
            raise
        exit_with_error(loader_connection_lost(e))
    except torch.OutOfMemoryError as e:  # a RuntimeError: before the clause below
        exit_with_error(out_of_memory(e, cfg))
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
    local = cfg.run_dir or held_run_folder()  # the folder claimed on the way, if any
    preempted = stop_signals.exit_code == stop_signals.PREEMPTED_EXIT_CODE
    folder = RunFolder(local) if local else None
    if rank0 and folder and preempted and folder.try_lock():
        newest = folder.newest()
        step = 0 if newest is None else step_of(newest)
        checkpoint = None if newest is None else str(newest)
        folder.mark_for_requeue(step, stop_signals.signal_name, checkpoint)
    said = f"stopped during start-up on {stop_signals.signal_name}: nothing trained yet; "
    said += f"start again with: {relaunch_command(*sys.argv[1:])}"
    print(said, file=sys.stderr)  # noqa: T201 - the job's one line
    return stop_signals.exit_code


def out_of_memory(error: torch.OutOfMemoryError, cfg) -> RunError:
    """The GPU ran out of memory: one line, with what to change, and with --oom_snapshot the memory
    history written first (profiling.py)."""
    said = f"out of GPU memory ({first_line(error)}): lower batch_size (raising grad_accum_steps "
    said += "keeps the global batch), or turn on activation_checkpointing"
    snapshot = write_oom_snapshot(cfg.run_dir or held_run_folder()) if cfg.oom_snapshot else None
    if snapshot:
        return RunError(f"{said}; what held the memory: {snapshot} (pytorch.org/memory_viz)")
    return RunError(f"{said}; --oom_snapshot records what held it")


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
    return RunError(f"{message}: {LOADER_DIED}")


def loader_connection_lost(error: BaseException) -> RunError | None:
    """A loader worker killed while it hands a batch over: the training process may meet the reset
    (or the end) of the connection that passes the batch's shared memory before torch's handler
    names the death (seen under load). The same one line as dead_loader_worker's."""
    if not isinstance(error, (ConnectionError, EOFError)):
        return None
    frames = traceback.extract_tb(error.__traceback__)
    if not any(f"{os.sep}utils{os.sep}data{os.sep}" in frame.filename for frame in frames):
        return None
    how = first_line(error) or type(error).__name__
    return RunError(f"a DataLoader worker's connection was lost ({how}): {LOADER_DIED}")


def lost_a_peer(error: RuntimeError) -> bool:
    """Whether a collective failed because another process is gone (not a bug of this one)."""
    message = str(error).lower()
    return isinstance(error, dist.DistError) or "gloo" in message or "nccl" in message


def exit_after_a_failed_collective(line: str, says_it: bool) -> None:
    """Exit 1 after a collective failed: the line is said once per job, by the rank hangs.explain
    chose. Its wait for the others' notes gave the launcher time to stop this node if one of its
    ranks failed first, with a line of its own: then this one says nothing. The other ranks wait
    for their launcher to stop them (were one to end first, its launcher would stop the one saying
    the line). With the main node gone, its launcher and the store with it, this node's line is the
    only one: said even after the launcher's SIGTERM, which a silent local rank's end (after
    SILENT_WAIT_S) brings while this rank still waits in a collective on it."""
    if says_it and (stop_signals.signal_name != "SIGTERM" or main_node_gone()):
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
    # the launchers' failure summary shows the worker's TORCHELASTIC_ERROR_FILE as its "Root
    # Cause": our line
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        extra = {"py_callstack": line, "timestamp": str(int(time.time()))}
        Path(path).write_text(json.dumps({"message": {"message": line, "extraInfo": extra}}))
    sys.exit(code)
