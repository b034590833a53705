"""The job around the loop: its run folder (a fresh runs/run_NNN unless --output_dir names one), locked by one
job at a time (flock on <output_dir>/.lock, freed by the kernel when the holder dies; which filesystems honour
it: README), decisions every process takes together, the signals that stop it, and how it ends: 0 finished,
2 a refused input (config, run folder in use, checkpoint that does not fit), 75 preempted with a checkpoint
(requeue me), 130 stopped by Ctrl-C, 1 any other failure; at most one `error: ...` line per job, and no
process left waiting on one that failed.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from config import ConfigError, RunError, TrainConfig, first_line, load_config
from tracking import write_preempted_marker

# Long enough for a slow rank 0 to fail too and the launcher (it polls every 0.1 s) to stop the rest.
OTHER_RANKS_ERROR_DELAY_S = 5.0
RUNS_ROOT = Path("runs")
RUN_NAME = re.compile(r"run_(\d+)")
_held_locks = []  # open until the process exits: closing the file would release the lock


def collectively(plumbing, action: str, fn, error_type=RunError, on_failure=None):
    """Run fn on every process; if it raised on any of them, every process raises error_type. (A process that
    raised alone would leave the others waiting in their next collective until a timeout.)"""
    error, result = None, None
    try:
        result = fn()
    except Exception as e:  # any failure, not only OSError: the others must not wait for this one
        error = e
    failed = plumbing.reduce(torch.tensor(float(error is not None), device=plumbing.device), "sum").item()
    if failed:
        if on_failure is not None:
            on_failure()
        if isinstance(error, error_type):
            raise error
        raise error_type(f"{action}: {first_line(error)}" if error else f"{action} failed on another process")
    return result


def is_writer(plumbing, cfg) -> bool:
    """Whether this process writes the run folder's shared files (once per job, or once per node)."""
    return plumbing.is_main_process if cfg.shared_filesystem else plumbing.is_local_main_process


def claim_run_folder(cfg, plumbing) -> None:
    """Settle cfg.output_dir (the same on every process) and lock it for this job."""
    if not cfg.output_dir:
        number = _pick_run_number(cfg.resume == "latest") if plumbing.is_main_process else 0
        number = int(plumbing.reduce(torch.tensor(float(number), device=plumbing.device), "sum").item())
        cfg.output_dir = str(RUNS_ROOT / f"run_{number:03d}")
    writer = is_writer(plumbing, cfg)
    collectively(plumbing, "locking the run folder", lambda: writer and lock_run_folder(cfg.output_dir), ConfigError)


def init_process_group(timeout_s: int) -> None:
    """torch.distributed's env:// start (NCCL on GPUs, gloo on CPUs), with the store's keys under a prefix per
    elastic restart: under --max_restarts every attempt shares one store, and a restarted worker could read the
    dead attempt's peer addresses (gloo connectFullMesh "Connection refused", seen here under load). Accelerate
    adopts a process group that already exists."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # before NCCL: one GPU per process
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # else rank 0 hosts it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_hosts_store, timeout=timedelta(seconds=timeout_s),
                          multi_tenant=True)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=dist.PrefixStore(
        f"attempt_{attempt}", store), rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))


def _pick_run_number(newest: bool) -> int:
    """The newest runs/run_NNN (to resume it), or a new one, created here so that two jobs never share it."""
    numbers = [int(m.group(1)) for p in RUNS_ROOT.glob("run_*") if (m := RUN_NAME.fullmatch(p.name))]
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


def lock_run_folder(output_dir: str) -> None:
    """Take <output_dir>/.lock for as long as this process lives, or raise ConfigError naming the holder."""
    path = Path(output_dir) / ".lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = open(path, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "a process that has not written its name yet"
        lock.close()
        raise ConfigError(f"output_dir '{output_dir}' is in use by another job ({holder}); wait for it to end, "
                          f"or choose another output_dir") from None
    lock.truncate(0)
    lock.write(f"host {os.uname().nodename}, pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    lock.flush()
    _held_locks.append(lock)


# ---------------------------------------------------------------- stop signals


class Preempted(BaseException):  # not an Exception: nothing may catch it on the way out
    """A stop signal that arrived before the loop started: there is nothing new to checkpoint."""


class StopSignals:
    """SIGTERM (SLURM, Kubernetes), SIGUSR1 (SLURM's --signal), Ctrl-C: checkpoint and stop. During start-up, stop at
    once (Preempted); in the loop the ranks vote at logging steps and all stop at the same step. 2nd Ctrl-C: now."""

    PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL, "try again later": stopped early with a checkpoint, requeue me
    INTERRUPTED_EXIT_CODE = 130  # Ctrl-C: stopped with a checkpoint, but nobody asked for a requeue

    def __init__(self):
        self.signal_name, self.loop_running = None, False

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        if signum == signal.SIGINT and self.signal_name == "SIGINT":
            raise KeyboardInterrupt  # the second Ctrl-C
        self.signal_name = self.signal_name or signal.Signals(signum).name
        if not self.loop_running:
            raise Preempted(self.signal_name)

    def requested(self, plumbing) -> bool:
        flag = torch.tensor(float(self.signal_name is not None), device=plumbing.device)
        return plumbing.reduce(flag, "sum").item() > 0  # collective, and a CPU-GPU sync

    @property
    def exit_code(self) -> int:
        return self.INTERRUPTED_EXIT_CODE if self.signal_name == "SIGINT" else self.PREEMPTED_EXIT_CODE


stop_signals = StopSignals()


# ---------------------------------------------------------------- how a job ends: one exit code, at most one line


def load_config_or_exit(argv) -> TrainConfig:
    try:
        return load_config(argv)
    except ConfigError as e:
        exit_with_error(e)


def check_world_size(num_processes: int) -> None:
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != num_processes:
        raise ConfigError(f"the launcher started {launched} processes but this one sees a world of "
                          f"{num_processes}: they would train independently and overwrite each other's files")


def run_or_exit(train_fn, cfg, make_plumbing) -> None:
    """Run a training job and turn every way it ends into an exit code (module docstring) and at most one line."""
    stop_signals.install()  # before anything slow starts: a signal during start-up is a clean stop too
    plumbing = None
    try:
        plumbing = make_plumbing(cfg)
        code = train_fn(cfg, plumbing)
    except Preempted:
        code = stopped_before_training(cfg, plumbing)
    except KeyboardInterrupt:  # the second Ctrl-C: stop now, without a checkpoint
        code = StopSignals.INTERRUPTED_EXIT_CODE
    except (ConfigError, RunError, OSError) as e:  # OSError: a full disk or a permission problem, on any write
        exit_with_error(e)
    except RuntimeError as e:
        if not isinstance(e, dist.DistError) and "gloo" not in str(e).lower() and "nccl" not in str(e).lower():
            raise  # a bug: its traceback is the useful output
        # a peer process died or hung; that process (or the launcher's summary) says why
        exit_with_error(RunError(f"lost contact with another process ({first_line(e)})"))
    finally:
        close_process_group()
    sys.exit(code)


def close_process_group() -> None:
    """Destroy the process group once gloo's worker threads are idle. A worker that has just run a collective frees
    its tensors under the group's lock, and needs the GIL for that; the group's destructor takes that lock holding
    the GIL. Destroyed right after a collective, a process can hang at exit (seen here: a rank stuck for good in
    ~ProcessGroupGloo, its peer long gone). So: release the GIL a moment first, then destroy."""
    if dist.is_initialized():
        time.sleep(0.05)
        dist.destroy_process_group()


def stopped_before_training(cfg, plumbing) -> int:
    """A signal during start-up: nothing new to save. Leave the requeue marker if the run folder is ours."""
    rank0 = plumbing.is_main_process if plumbing is not None else os.environ.get("RANK", "0") == "0"
    if rank0 and cfg.output_dir and stop_signals.exit_code == stop_signals.PREEMPTED_EXIT_CODE \
            and try_lock_run_folder(cfg.output_dir):
        from checkpoint import latest_checkpoint  # checkpoint.py imports this module

        newest = latest_checkpoint(cfg.output_dir)
        write_preempted_marker(cfg.output_dir, int(newest.name.split("_")[1]) if newest else 0,
                               stop_signals.signal_name, str(newest) if newest else None)
    print(f"stopped during start-up on {stop_signals.signal_name}: nothing trained yet; "  # noqa: T201
          f"start again with --resume latest", file=sys.stderr)
    return stop_signals.exit_code


def exit_with_error(error: Exception) -> None:
    """Print `error: ...` and exit with the error's code, once per job rather than once per rank: rank 0 speaks at
    once and the others wait first. If rank 0 failed too, the launcher kills them before they repeat it; an error
    that is theirs alone (a file missing on one node) still shows."""
    if os.environ.get("RANK", "0") != "0":
        if stop_signals.signal_name == "SIGTERM":  # the launcher is already stopping the job for another rank
            sys.exit(getattr(error, "exit_code", 1))
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's kill is not a preemption here
        time.sleep(OTHER_RANKS_ERROR_DELAY_S)
    print(f"error: {error}", file=sys.stderr)  # noqa: T201 - our messages, and OSError's, are one line
    # the launchers' failure summary shows the worker's TORCHELASTIC_ERROR_FILE as its "Root Cause": our line
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        extra = {"py_callstack": f"error: {error}", "timestamp": str(int(time.time()))}
        Path(path).write_text(json.dumps({"message": {"message": f"error: {error}", "extraInfo": extra}}))
    sys.exit(getattr(error, "exit_code", 1))
