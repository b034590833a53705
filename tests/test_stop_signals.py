"""A stop signal that reaches a DataLoader worker leaves it to the training process (job.py).

Launchers and schedulers signal whole process groups or job steps, loader workers included; the
training process must live on to checkpoint, so its workers must too. These run real DataLoaders with
worker processes under each start method: `fork` (Linux's default before Python 3.14), where a worker
starts with torch's SIGTERM handler and its parent is the training process; `spawn`, where it starts
with Python's defaults; and `forkserver` (3.14's default), where its parent is the fork server.
"""

import os
import signal
import subprocess
import time

import pytest
import torch
from torch.utils.data import DataLoader

import job

STOPS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def loader(start_method: str, monkeypatch) -> DataLoader:
    """A loader with the options main.py gives its loaders, under `start_method`."""
    monkeypatch.setattr(job.multiprocessing, "get_start_method", lambda allow_none: start_method)
    options = job.loader_worker_options(num_workers=2)
    return DataLoader(list(range(64)), batch_size=4, num_workers=2, **options)


def send_from_another_process(signum: int, pids: list[int]) -> None:
    """As a launcher or a scheduler does: the sender is not the workers' parent."""
    subprocess.run(["kill", f"-{signum}", *map(str, pids)], check=True)


@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_loader_workers_outlive_stop_signals_and_every_batch_still_comes(start_method, monkeypatch):
    batches = iter(loader(start_method, monkeypatch))
    first = next(batches)
    workers = [worker.pid for worker in batches._workers]
    for signum in STOPS:
        send_from_another_process(signum, workers)
    time.sleep(0.5)  # a worker that dies of it is gone by now
    dead = [pid for pid in workers if not alive(pid)]
    assert not dead, f"loader workers {dead} died of a stop signal meant for their trainer"
    # the training process's own iteration goes on to the end, every sample once
    assert torch.cat([first, *batches]).tolist() == list(range(64))


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_loader_worker_still_ends_on_its_own_process_sigterm(start_method, monkeypatch):
    """torch ends a worker that does not finish with SIGTERM from the training process (at shutdown), and
    so does multiprocessing at the training process's exit: that one still ends it, at once. Under
    forkserver the worker's parent is the fork server, not the training process (a worker that took
    SIGTERM from its parent only would hang the training process's exit)."""
    batches = iter(loader(start_method, monkeypatch))
    next(batches)
    worker = batches._workers[0]
    os.kill(worker.pid, signal.SIGTERM)  # from the training process
    worker.join(timeout=5)
    assert worker.exitcode == 0, "a loader worker did not end on its own process's SIGTERM"
    batches._shutdown_workers()
