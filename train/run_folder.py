"""The run folder, one object: where each of a run's files is, which checkpoints it holds and which is
the newest committed one, its lock, and the requeue marker.

    <output_dir>/
        config.yaml  run_info.json  metrics.jsonl       what the run was and what it reported (tracking.py)
        checkpoints/step_00000300/                       committed checkpoints: manifest.json last (saving.py)
        model.safetensors (+ config.json, tokenizer)     the export (checkpoint.export_model)
        adapter_model.safetensors (+ adapter_config.json) a LoRA run's export instead (checkpoint.write_adapter)
        compile_cache/                                   compiled code, for a resume (compiling.py)
        hangs/rank{r}.json                               where a hung rank was (hangs.py)
        profile/                                         --profile_steps traces, --oom_snapshot (profiling.py)
        evals/step_N.json                                lm-evaluation-harness scores (harness.py)
        preempted.json                                   the requeue marker: stopped on a signal, requeue me
        .lock                                            one job per folder (flock)

On a local disk (or a shared filesystem every node sees) the run is written where the user named it.
On object storage (--output_dir s3://bucket/run, any fsspec URL) each node writes the same layout in
a staging folder of its own, and storage.BucketFolder, this class's bucket side, uploads it: the
checkpoints, the run files, and the lease that keeps one job per URL. Everything else asks the run
folder where things are; storage.open_run_folder(cfg) gives the one the config names.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from errors import ConfigError

URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://")  # output_dir on object storage: s3://, gs://, ...
LAYOUT = {
    "config": "config.yaml",
    "run_info": "run_info.json",
    "metrics": "metrics.jsonl",
    "checkpoints": "checkpoints",
    "export": "model.safetensors",
    "compile_cache": "compile_cache",
    "hangs": "hangs",
    "profile": "profile",
    "evals": "evals",
    "adapter": "adapter_model.safetensors",  # a LoRA run's export, as peft names it
    "requeue_marker": "preempted.json",
    "lock": ".lock",
}
RUNS_ROOT = Path("runs")  # where a run without --output_dir goes: runs/run_001, runs/run_002, ...
RUN_NAME = re.compile(r"run_(\d+)")
STEP_PREFIX = "step_"
COMMITTED_NAME = re.compile(r"step_\d{8}")  # step_00000300: zero-padded, they sort as text
MANIFEST = "manifest.json"  # written last: a checkpoint folder without one was never committed
_held_locks = []  # open until the process exits: closing the file would release the lock


def is_url(output_dir: str) -> bool:
    """Whether output_dir names object storage (any fsspec URL) rather than a folder."""
    return bool(URL.match(output_dir))


def run_numbers() -> list[int]:
    """The numbers of the runs under runs/ (run_001 -> 1), in no order."""
    return [int(m.group(1)) for p in RUNS_ROOT.glob("run_*") if (m := RUN_NAME.fullmatch(p.name))]


def numbered_run(number: int) -> str:
    return str(RUNS_ROOT / f"run_{number:03d}")


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def step_of(checkpoint: Path | str) -> int:
    return int(Path(str(checkpoint)).name[len(STEP_PREFIX) :])


class RunFolder:
    """A run folder on this node's disk: `root` is what the user named, `local` where this process
    writes it (the same folder, or for a run on object storage this node's staging folder), and
    `shared` whether all nodes write one `local` (a shared filesystem) or each node its own."""

    bucket = None  # storage.BucketFolder's: the object store behind the staging folder

    def __init__(self, output_dir: str, staging_dir: str = "", shared_filesystem: bool = True):
        self.root = output_dir
        self.on_bucket = is_url(output_dir)
        self.local = Path(staging_folder(output_dir, staging_dir) if self.on_bucket else output_dir)
        self.shared = shared_filesystem and not self.on_bucket

    @classmethod
    def of(cls, cfg) -> RunFolder:
        return cls(cfg.output_dir, cfg.staging_dir, cfg.shared_filesystem)

    def path(self, what: str) -> Path:
        """Where `what` (a key of LAYOUT) is in this node's folder."""
        return self.local / LAYOUT[what]

    def checkpoint(self, step: int) -> Path:
        return self.path("checkpoints") / step_name(step)

    def checkpoints(self) -> list[Path]:
        """The committed checkpoints in this node's folder, oldest first. A folder without a
        manifest (a crash mid-save) is not one."""
        found = [
            path
            for path in self.path("checkpoints").glob(f"{STEP_PREFIX}*")
            if COMMITTED_NAME.fullmatch(path.name) and (path / MANIFEST).is_file()
        ]
        return sorted(found)

    def newest(self) -> Path | str | None:
        """The run's newest committed checkpoint (on object storage: its URL, BucketFolder's)."""
        return next(reversed(self.checkpoints()), None)

    # ---------------------------------------------------------------- what a bucket adds (BucketFolder)

    def take_lease(self) -> None:
        """One job per run folder: on a disk, the lock (below) keeps it."""

    def upload_run_files(self, at_the_end: bool = False) -> str | None:
        """Where the run files were uploaded to: on a disk, nowhere (None)."""
        return None

    # ---------------------------------------------------------------- one job per folder

    def lock(self) -> None:
        """Take <folder>/.lock for as long as this process lives (freed by the kernel when it
        dies), or raise ConfigError naming the holder."""
        path = self.path("lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "a process that has not written its name yet"
            lock.close()
            raise ConfigError(
                f"output_dir '{self.local}' is in use by another job ({holder}); wait for it to "
                f"end, or choose another output_dir"
            ) from None
        lock.truncate(0)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        lock.write(f"host {os.uname().nodename}, pid {os.getpid()}, started {started}\n")
        lock.flush()
        _held_locks.append(lock)

    def try_lock(self) -> bool:
        """Whether this process holds the folder's lock, taking it if it is free."""
        if not _held_locks:
            try:
                self.lock()
            except (ConfigError, OSError):
                return False
        return True

    # ---------------------------------------------------------------- the requeue marker

    def mark_for_requeue(self, step: int, signal_name: str, checkpoint: str | None) -> None:
        """preempted.json: launchers report any worker's exit as 1, so a requeue script tells
        "stopped on a signal, requeue me" apart from a failure by this file. The next start removes
        it (clear_requeue_marker)."""
        record = {"step": step, "signal": signal_name, "checkpoint": checkpoint}
        self.local.mkdir(parents=True, exist_ok=True)
        self.path("requeue_marker").write_text(json.dumps(record) + "\n")

    def clear_requeue_marker(self) -> None:
        self.path("requeue_marker").unlink(missing_ok=True)


def held_run_folder() -> str:
    """The run folder whose lock this process holds, or ""."""
    if not _held_locks:
        return ""
    return str(Path(_held_locks[0].name).parent)


def staging_folder(url: str, staging_dir: str) -> str:
    """The local folder a node writes a run on object storage in: --staging_dir, or one named after
    the URL in the system's temporary folder. It must be this node's own: the run folder's lock
    refuses a second node on the same one."""
    if staging_dir:
        return staging_dir
    parts = urlsplit(url)
    return os.path.join(
        tempfile.gettempdir(), "train-staging", parts.scheme, parts.netloc + parts.path
    )
