"""A run on object storage: --output_dir s3://bucket/run (or any fsspec URL: gs://, az://, file://).

Each node writes the run in a local folder first, its staging folder (--staging_dir; by default one
named after the URL in the system's temporary folder), and the checkpoints and run files are
uploaded from there. Object stores cannot rename a folder, so a checkpoint is not published by a
rename as on a filesystem (saving.py) but by its manifest, written last:

    every process     writes its files into its own staging folder (checkpoints/step_N.tmp/rank{r}),
                      uploads them to <url>/checkpoints/step_N/, then uploads the list of what it
                      uploaded, with sizes and checksums, as step_N/uploaded/rank{r}.json
    all vote          (saving.py: a failed write or upload anywhere is an error everywhere)
    main process      merges the lists, checks that every expected file arrived, uploads
                      step_N/manifest.json last, prunes, uploads the run files

A step without a manifest is a save that never finished (a process killed mid-upload): it is never
resumed from, and removed after the next commit. Pruning deletes a checkpoint's manifest before its
files, so a half-deleted checkpoint is an unfinished one, and it never touches the newest committed
one. A resume downloads the newest committed checkpoint into the staging folder and checks every
file against the manifest's size and checksum before loading it: a damaged one is skipped with a
warning and the one before is tried.

The run files (config.yaml, run_info.json, metrics.jsonl, preempted.json, the export) are written in
the staging folder and uploaded by the main process after each commit and when the run ends (a
resume downloads them first, so a restarted pod continues them). The compile cache, the hang notes
and W&B's own files stay in the staging folder.

The filesystems are fsspec's, an optional install (requirements-storage.txt): s3fs for s3://, gcsfs
for gs://, adlfs for az://. Credentials and endpoints come from their usual environment
(AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, GOOGLE_APPLICATION_CREDENTIALS, ...). A bucket mounted as a
folder by a FUSE driver (s3fs-fuse, gcsfuse, mountpoint-s3) renames by copy-then-delete: pass the
bucket's URL instead of the mount's path.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from checkpoint import COMMITTED_NAME, MANIFEST, STEP_PREFIX, checkpoint_problem, file_digest
from config import is_url
from errors import CheckpointError, ConfigError, first_line

UPLOADED = "uploaded"  # step_N/uploaded/rank{r}.json: what process r uploaded
RUN_FILES_NOT_UPLOADED = (".lock",)


def check_output_dir(output_dir: str) -> None:
    """At start-up, before any process group: a run on object storage can be kept there."""
    if not is_url(output_dir):
        return
    problem = url_problem(output_dir)
    if problem is not None:
        raise ConfigError(f"output_dir {problem} (got {output_dir!r})")


def url_problem(url: str) -> str | None:
    """Why a run cannot be kept at `url` (checked at start-up, before any process group), or None:
    the filesystem's package missing, the URL malformed, the bucket absent or unreachable."""
    try:
        bucket = Bucket(url)
    except ImportError:
        return f"needs {package_for(url)}, an optional install: pip install {package_for(url)}"
    except (ValueError, TypeError) as e:
        return f"is not a URL fsspec can open ({first_line(e)})"
    return bucket.reachability_problem()


def package_for(url: str) -> str:
    """The package that gives fsspec a URL's protocol: s3fs for s3://, gcsfs for gs://, ..."""
    try:
        from fsspec.registry import known_implementations
    except ImportError:
        return "fsspec"
    protocol = url.split("://")[0]
    known = known_implementations.get(protocol, {"class": "fsspec"})
    return known["class"].split(".")[0]


class Bucket:
    """The run folder at a URL, through fsspec: the checkpoints' upload, commit, listing, download
    and pruning, and the run files."""

    def __init__(self, url: str):
        import fsspec  # optional: only a run on object storage needs it

        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        if "file" in self.fs.protocol:  # file://: folders made as on object stores, where none are
            self.fs.auto_mkdir = True

    def reachability_problem(self) -> str | None:
        try:
            if self.fs.protocol[0] in ("s3", "s3a", "gs", "gcs") and not self.fs.exists(
                self.root.split("/")[0]
            ):
                return "names a bucket that does not exist (or that these credentials cannot see)"
            self.fs.exists(self.root)
        except Exception as e:  # any client's error: credentials, endpoint, permissions
            return f"cannot be reached: {first_line(e)}"
        return None

    def step_url(self, step: int) -> str:
        return f"{self.url}/checkpoints/{step_name(step)}"

    def _step(self, name: str) -> str:
        return f"{self.root}/checkpoints/{name}"

    # ---------------------------------------------------------------- saving

    def clear_step(self, step: int) -> None:
        """Before a save of `step`: remove what an earlier save of the same step left (a resumed run
        saving it again, or an unfinished save's files), its manifest first."""
        folder = self._step(step_name(step))
        self.fs.invalidate_cache()
        if self.fs.exists(f"{folder}/{MANIFEST}"):
            self.fs.rm(f"{folder}/{MANIFEST}")
        if self.fs.exists(folder):
            self.fs.rm(folder, recursive=True)

    def upload(self, local: Path, step: int, rank: int) -> None:
        """Upload every file of this process's staging folder, then the list of them (with sizes
        and checksums) that the commit merges into the manifest."""
        folder = self._step(step_name(step))
        files = {}
        for path in sorted(local.rglob("*")):
            if path.is_file():
                name = path.relative_to(local).as_posix()
                files[name] = {"bytes": path.stat().st_size, "xxh3_64": file_digest(path)}
                self.fs.put_file(str(path), f"{folder}/{name}")
        listing = json.dumps(files, indent=2).encode()
        self.fs.pipe_file(f"{folder}/{UPLOADED}/rank{rank}.json", listing)

    def commit(self, step: int, world_size: int, expected: list[str], about: dict) -> None:
        """After every process's vote: the manifest, written last, from every process's list."""
        folder = self._step(step_name(step))
        listings = [f"{folder}/{UPLOADED}/rank{rank}.json" for rank in range(world_size)]
        self.fs.invalidate_cache()
        found = self.fs.cat(listings, on_error="omit")
        files = {}
        for listing in listings:
            if listing not in found:
                raise CheckpointError(
                    f"checkpoint of step {step}: {listing} never arrived (a process's upload "
                    "was lost)"
                )
            files.update(json.loads(found[listing]))
        missing = [name for name in expected if name not in files]
        if missing:
            raise CheckpointError(
                f"checkpoint of step {step} is missing {', '.join(missing)} on {self.url}"
            )
        manifest = json.dumps({**about, "files": dict(sorted(files.items()))}, indent=2)
        self.fs.pipe_file(f"{folder}/{MANIFEST}", manifest.encode())

    def committed(self) -> list[str]:
        """The committed checkpoints' names (step_N, a manifest present), oldest first."""
        self.fs.invalidate_cache()
        manifests = self.fs.glob(f"{self.root}/checkpoints/{STEP_PREFIX}*/{MANIFEST}")
        names = [manifest.rstrip("/").split("/")[-2] for manifest in manifests]
        return sorted(name for name in names if COMMITTED_NAME.fullmatch(name))

    def newest(self) -> str | None:
        """The newest committed checkpoint's URL (None before the first)."""
        committed = self.committed()
        return f"{self.url}/checkpoints/{committed[-1]}" if committed else None

    def prune(self, keep_last: int) -> None:
        """Delete all but the newest `keep_last` committed checkpoints (each manifest first), and
        unfinished saves. Called right after a commit: no save is in flight."""
        committed = self.committed()
        for name in committed[:-keep_last]:
            self.fs.rm(f"{self._step(name)}/{MANIFEST}")
            self.fs.rm(self._step(name), recursive=True)
        if not self.fs.exists(f"{self.root}/checkpoints"):
            return
        for folder in self.fs.ls(f"{self.root}/checkpoints", detail=False):
            name = folder.rstrip("/").split("/")[-1]
            if name not in committed:
                self.fs.rm(folder, recursive=True)

    # ---------------------------------------------------------------- resuming

    def download_newest(self, checkpoints: Path, log) -> Path | None:
        """Download the newest committed checkpoint whose files all match its manifest into
        `checkpoints` (emptied first), or None if there is none."""
        shutil.rmtree(checkpoints, ignore_errors=True)
        for name in reversed(self.committed()):
            local = checkpoints / name
            started = time.perf_counter()
            manifest = json.loads(self.fs.cat_file(f"{self._step(name)}/{MANIFEST}"))
            names = [*manifest["files"], MANIFEST]
            for file in names:
                (local / file).parent.mkdir(parents=True, exist_ok=True)
            self.fs.get(
                [f"{self._step(name)}/{file}" for file in names],
                [str(local / file) for file in names],
            )
            problem = checkpoint_problem(local)
            if problem is None:
                size = sum(entry["bytes"] for entry in manifest["files"].values())
                seconds = time.perf_counter() - started
                log.info(
                    f"downloaded {self.url}/checkpoints/{name}: {size / 1e6:.1f} MB in "
                    f"{seconds:.1f} s"
                )
                return local
            log.warn(
                f"skipping damaged checkpoint {self.url}/checkpoints/{name}: {problem}; trying "
                "the one before"
            )
            shutil.rmtree(local)
        return None

    # ---------------------------------------------------------------- the run files

    def upload_run_files(self, run_dir: str) -> None:
        """The run folder's own files (not its folders), the exported weights last."""
        files = [
            p
            for p in Path(run_dir).iterdir()
            if p.is_file() and p.name not in RUN_FILES_NOT_UPLOADED
        ]
        for path in sorted(files, key=lambda p: (p.suffix == ".safetensors", p.name)):
            self.fs.put_file(str(path), f"{self.root}/{path.name}")

    def download_run_files(self, run_dir: str) -> None:
        """Before a resume's first log line: the run files as the last commit left them (a new pod's
        staging folder is empty), so that metrics.jsonl and the launches in run_info.json go on."""
        self.fs.invalidate_cache()
        if not self.fs.exists(self.root):
            return
        for entry in self.fs.ls(self.root, detail=True):
            name = entry["name"].rstrip("/").split("/")[-1]
            if entry["type"] == "file" and not name.endswith(".safetensors"):
                self.fs.get_file(entry["name"], os.path.join(run_dir, name))


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"  # zero-padded: they sort as text
