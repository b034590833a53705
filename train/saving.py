"""Saving a checkpoint: one transaction, in the loop or in the background (--async_save, the default).

    in the loop          create step_N.tmp, every process writes its parts, vote, publish, prune
    in the background    create step_N.tmp, every process copies its parts to CPU memory (the only
                         time training waits) and goes on training while a thread writes them; at a
                         later logging step, once every process has finished writing: vote, publish,
                         prune

Either way a checkpoint is complete under its final name or absent: the manifest and the rename
(publish, below) run only after every process's write has finished and all voted. At most one save
is in flight: the next save, a stop signal and the end of training first finish it (wait, vote,
publish). A failed write on any process is an error on every process (plumbing.collectively), and the
previous checkpoint stays the newest. A crash while a save is in flight leaves step_N.tmp, never
loaded and removed after the next commit.

On object storage (--output_dir s3://..., storage.py) the phases are the same, each process's files
staged in a folder of its own and uploaded in the write, and the manifest, uploaded last from every
process's list of its uploads, is the commit: objects cannot be renamed.

The format of each part (what a copy in CPU memory of it is, how it is written) is checkpoint.py's;
sharded parts are written by torch.distributed.checkpoint's own async_save, whose collectives run on
a gloo group of their own so that they never interleave with training's.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import shutil
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from checkpoint import (
    Sharded,
    as_part,
    file_digest,
    fsync_dir,
    run_geometry,
    write_file,
)
from errors import CheckpointError, RunError
from hangs import patiently
from plumbing import collectively, is_writer
from run_folder import LAYOUT, MANIFEST, STEP_PREFIX, RunFolder
from storage import open_run_folder

SAID_WAIT_S = 5.0  # a wait for the background write longer than this is said
WRITER_WAIT_AT_EXIT_S = 10.0  # bounded: a write stuck on a dead filesystem must not hold the exit


class Checkpointer:
    """The loop's one handle on saving: save(step) at a save step, commit_if_written() at each
    logging step, finish() before stopping. Every method is collective (all ranks, same step).
    `kept_cache`: the compiled code kept in the run folder (compiling.KeptCache), listed at each
    save as what that checkpoint resumes with."""

    def __init__(self, plumbing, cfg, parts: dict, identity: dict, log, kept_cache=None):
        self.plumbing = plumbing
        self.kept_cache = kept_cache
        self.cfg = cfg
        self.parts = parts
        self.identity = identity
        self.log = log
        self.in_flight: BackgroundSave | None = None
        self.last_path: Path | None = None
        self.dcp_group = None
        # a process that ends with a save in flight (an error elsewhere) lets its write finish
        # first: a thread stopped inside torch's writer at exit aborts the process
        atexit.register(self.wait_for_the_writer)
        sharded = any(isinstance(as_part(part), Sharded) for part in parts.values())
        if cfg.async_save and sharded and dist.is_initialized():
            self.dcp_group = dist.new_group(backend="gloo")  # collective: every rank creates it

    def save(self, step: int) -> None:
        """Save this step's checkpoint: written before returning, or (async_save) copied to CPU
        memory and written in the background."""
        if self.kept_cache:  # what this checkpoint resumes with, listed for the resume's check
            self.kept_cache.record()
        self.finish()  # at most one save in flight
        started = time.perf_counter()
        transaction = begin(self.plumbing, self.cfg, self.parts, step, self.identity)
        with patiently("a checkpoint save"):  # a slow disk on one rank is no hang
            if not self.cfg.async_save:
                transaction.run()
                self.committed(transaction, blocked_s=time.perf_counter() - started)
                return
            self.in_flight = BackgroundSave(transaction, self.dcp_group)
        self.in_flight.blocked_s = time.perf_counter() - started

    def wait_for_the_writer(self) -> None:
        if self.in_flight is not None:
            self.in_flight.thread.join(timeout=WRITER_WAIT_AT_EXIT_S)

    def commit_if_written(self) -> None:
        """At a logging step: publish the save in flight if every process has finished writing it
        (one small all-reduce, only while a save is in flight)."""
        if self.in_flight is None:
            return
        still_writing = float(self.in_flight.thread.is_alive())
        flag = torch.tensor(still_writing, device=self.plumbing.device)
        if self.plumbing.reduce(flag, "sum").item() == 0:
            self.finish()

    def finish(self) -> Path | None:
        """Wait for the save in flight, vote and publish it; returns the newest committed checkpoint
        of this run (None before the first)."""
        if self.in_flight is None:
            return self.last_path
        save, self.in_flight = self.in_flight, None
        waited = time.perf_counter()
        transaction = save.transaction
        with patiently("a checkpoint save"):  # the others wait here for the slowest writer
            save.thread.join(timeout=SAID_WAIT_S)
            if save.thread.is_alive():  # never a silent wait: a slow disk, or a store's upload
                self.log.info(
                    f"waiting for the checkpoint of step {transaction.step} to be written to "
                    f"{transaction.final} ({SAID_WAIT_S:.0f} s so far)"
                )
                save.thread.join()  # bounded: a store's upload has its deadline (storage.py)
            save.blocked_s += time.perf_counter() - waited
            collectively(
                self.plumbing,
                f"saving the checkpoint of step {transaction.step} to {transaction.tmp}",
                save.raise_error,
                on_failure=transaction.remove_tmp,
            )
            collectively(self.plumbing, f"committing {transaction.final}", transaction.commit)
        self.committed(transaction, blocked_s=save.blocked_s, written_s=save.written_s)
        return self.last_path

    def committed(self, transaction, blocked_s: float, written_s: float | None = None) -> None:
        self.last_path = transaction.final
        said = f"checkpoint: {transaction.final} (training waited {blocked_s:.2f} s"
        if written_s is not None:
            said += f"; written in the background in {written_s:.2f} s"
        self.log.info(said + ")")


class BackgroundSave:
    """One save in flight: its parts copied to CPU memory (collectively: a failure there is an error
    on every process), then written by a thread of this process."""

    def __init__(self, transaction: Transaction, dcp_group):
        self.transaction = transaction
        self.error: BaseException | None = None
        self.written_s = 0.0
        self.blocked_s = 0.0
        self.staged = {}

        def create_and_copy():
            transaction.create_tmp()
            for name, part in transaction.parts.items():
                self.staged[name] = as_part(part).snapshot(transaction.tmp, name, dcp_group)

        collectively(transaction.plumbing, f"creating {transaction.tmp}", create_and_copy)
        self.thread = threading.Thread(target=self.write, name="checkpoint-writer", daemon=True)
        self.thread.start()

    def write(self) -> None:
        started = time.perf_counter()
        try:
            self.transaction.write_parts(self.staged)
        except BaseException as e:  # reported by the main thread, on every process (raise_error)
            self.error = e
        self.written_s = time.perf_counter() - started

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


def begin(plumbing, cfg, parts: dict, step: int, identity: dict) -> Transaction:
    """One save's transaction: on a disk, or staged and uploaded to object storage (the one place
    the two ways part)."""
    kind = BucketTransaction if open_run_folder(cfg).on_bucket else Transaction
    return kind(plumbing, cfg, parts, step, identity)


class Transaction:
    """The phases of one save on a disk: create the tmp folder (after a free-space check), write the
    parts, commit (manifest, rename, prune), or remove the tmp folder after a failure anywhere. The
    writer (one process, or one per node on node-local disks) stages every rank's files in one
    folder; BucketTransaction, below, is the same save on object storage."""

    def __init__(self, plumbing, cfg, parts: dict, step: int, identity: dict):
        self.plumbing = plumbing
        self.cfg = cfg
        self.parts = parts
        self.step = step
        self.run_identity = {**run_geometry(plumbing, cfg), **identity}
        self.folder = open_run_folder(cfg)
        self.final = self.folder.checkpoint(step)
        self.tmp = self.final.with_name(self.final.name + ".tmp")
        self.writer = is_writer(plumbing, self.folder.shared)
        self.ranks = node_ranks(plumbing, self.folder.shared)
        self.stages = self.writer  # whether this process has a tmp folder of its own to write

    def run(self) -> None:
        """The whole save, in the loop."""
        collectively(self.plumbing, f"creating {self.tmp}", self.create_tmp)
        collectively(
            self.plumbing,
            f"saving the checkpoint of step {self.step} to {self.tmp}",
            lambda: self.write_parts(self.parts),
            on_failure=self.remove_tmp,
        )
        collectively(self.plumbing, f"committing {self.final}", self.commit)

    def create_tmp(self) -> None:
        if self.stages:
            shutil.rmtree(self.tmp, ignore_errors=True)
            check_space(
                self.folder.path("checkpoints"),
                checkpoint_bytes(self.parts, self.ranks),
                self.step,
            )
            self.tmp.mkdir(parents=True)

    def write_parts(self, parts: dict) -> None:
        try:
            for name, part in parts.items():
                write_part(self.tmp, name, as_part(part), self.plumbing, self.writer)
            if self.writer:  # provenance: the whole resolved config
                config = yaml.safe_dump(asdict(self.cfg), sort_keys=False).encode()
                write_file(self.tmp / LAYOUT["config"], config)
            self.written()
        except Exception as e:
            # torch.save reports a full disk as "enforce fail at inline_container.cc ... unexpected pos"
            folder = self.folder.path("checkpoints")
            if out_of_space(e, folder):
                raise RunError(
                    f"no space left on {folder} ({human_bytes(free_bytes(folder))} free): the "
                    f"checkpoint of step {self.step} was not saved, the previous one is intact; "
                    f"free space (or keep_last fewer), then --resume latest"
                ) from None
            raise

    def written(self) -> None:
        """After this process wrote its files: on a disk they are where the commit renames them."""

    def remove_tmp(self) -> None:
        if self.stages:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def commit(self) -> None:
        if self.writer:
            expected = expected_files(self.parts, self.ranks)
            publish(self.tmp, self.final, expected, self.about())
            prune_checkpoints(self.folder, self.cfg.keep_last)

    def about(self) -> dict:
        """What the manifest says of the checkpoint: its step, the run's geometry and data, its parts."""
        return {"step": self.step, "run": self.run_identity, "parts": sorted(self.parts)}


class BucketTransaction(Transaction):
    """One save on object storage (storage.py): each process stages its own files in a folder of its
    own and uploads them; the main process writes the files a checkpoint holds once, and commits
    with the manifest, written last (every process's list of its uploads, merged)."""

    def __init__(self, plumbing, cfg, parts: dict, step: int, identity: dict):
        super().__init__(plumbing, cfg, parts, step, identity)
        self.bucket = self.folder.bucket
        self.final = self.bucket.step_url(step)
        self.tmp = self.tmp / f"rank{plumbing.process_index}"
        self.writer = plumbing.is_main_process
        self.ranks = range(plumbing.process_index, plumbing.process_index + 1)
        self.stages = True

    def create_tmp(self) -> None:
        if self.writer:
            self.bucket.clear_step(self.step)  # an earlier save of this step, its manifest first
        super().create_tmp()

    def written(self) -> None:
        self.bucket.upload(self.tmp, self.step, self.plumbing.process_index)

    def commit(self) -> None:
        """Each process's staged copy is uploaded: removed. The main process writes the manifest,
        prunes and uploads the run files."""
        shutil.rmtree(self.tmp.parent if self.writer else self.tmp, ignore_errors=True)
        if not self.writer:
            return
        world = range(self.plumbing.num_processes)
        self.bucket.commit(self.step, len(world), expected_files(self.parts, world), self.about())
        self.bucket.prune(self.cfg.keep_last, self.step)
        self.folder.upload_run_files()


def write_part(folder: Path, name: str, part, plumbing, writer: bool) -> None:
    part.save(folder, name, plumbing, writer)


def node_ranks(plumbing, shared_filesystem: bool) -> range:
    """The ranks whose files this writer's copy holds: all, or this node's on node-local disks."""
    ranks = range(plumbing.num_processes)
    if shared_filesystem:
        return ranks
    # torchrun and accelerate set these
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", len(ranks)))
    node = int(os.environ.get("GROUP_RANK", "0"))
    return range(node * per_node, (node + 1) * per_node)


def checkpoint_bytes(parts: dict, ranks: range) -> int:
    """About what a checkpoint of these parts writes: their tensors, plus 256 KiB for the small files
    (plain values, the config, the manifest, torch.save's framing)."""
    return sum(as_part(part).nbytes(ranks) for part in parts.values()) + (256 << 10)


def check_space(folder: Path, needed: int, step: int) -> None:
    """Refuse a save that cannot fit, before anything is written (the previous checkpoint stays)."""
    free = free_bytes(folder)
    if needed > free:
        raise RunError(
            f"not enough space on {folder} for the checkpoint of step {step}: {human_bytes(free)} free, "
            f"it needs about {human_bytes(needed)}; free space (or keep_last fewer), then --resume latest"
        )


def free_bytes(folder: Path) -> int:
    """Free bytes on the filesystem of `folder` (or of its nearest existing parent)."""
    folder = Path(folder)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def out_of_space(error: Exception, folder: Path) -> bool:
    """Whether a failed write failed for space. By the error itself first: torch.save's serializer
    raises a RuntimeError ("unexpected pos") with the file's OSError chained to it, safetensors says
    "os error 28" in its message. Free space measured after the failure is only the last resort: by
    then another rank's cleanup may have freed some (the cause of a raw message in a third of the
    full-disk runs, before)."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen) or "Disk quota exceeded" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return free_bytes(folder) < (1 << 20)  # a write that failed on a full disk, whatever it said


def human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


# ---------------------------------------------------------------- publish, prune, recover


def expected_files(parts: dict, ranks: range) -> list[str]:
    return [file for name, part in parts.items() for file in as_part(part).files(name, ranks)]


def publish(tmp: Path, final: Path, expected: list[str], about: dict) -> None:
    """Manifest last, then one rename: a checkpoint is either complete under its final name or
    absent."""
    missing = [name for name in expected if not (tmp / name).is_file()]
    if missing:
        raise CheckpointError(
            f"checkpoint of step {about['step']} is missing {', '.join(missing)}: is output_dir on a "
            f"filesystem every node sees? If not, pass --shared_filesystem false"
        )
    files = {}
    for path in sorted(tmp.rglob("*")):
        if path.is_file():
            files[str(path.relative_to(tmp))] = {
                "bytes": path.stat().st_size,
                "xxh3_64": file_digest(path),
            }
    write_file(tmp / MANIFEST, json.dumps({**about, "files": files}, indent=2).encode())
    if final.exists():  # the same step saved again (a resumed run): keep the old one until the swap
        stale = final.with_name(final.name + ".stale")
        os.replace(final, stale)
        os.replace(tmp, final)
        shutil.rmtree(stale)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)  # the rename itself, durable


def recover_interrupted_swap(folder: RunFolder) -> None:
    """A crash between publish's two renames leaves step_N.stale (the old committed copy) and no
    step_N: put it back. Called by the writer at start-up, under the run folder's lock."""
    for stale in folder.path("checkpoints").glob(f"{STEP_PREFIX}*.stale"):
        final = stale.with_suffix("")
        if final.exists():
            shutil.rmtree(stale)
        else:
            os.replace(stale, final)


def prune_checkpoints(folder: RunFolder, keep_last: int) -> None:
    """Delete all but the newest `keep_last` committed checkpoints, and leftovers of crashed
    saves."""
    for old in folder.checkpoints()[:-keep_last]:
        shutil.rmtree(old)
    root = folder.path("checkpoints")
    for leftover in [*root.glob("*.tmp"), *root.glob("*.stale")]:
        # called right after a commit: no save is in flight
        shutil.rmtree(leftover, ignore_errors=True)
