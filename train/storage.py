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

A store that fails under a run is one line, never a wait without end. Each request has connect and
read timeouts (S3: 10 s and 60 s, three attempts with backoff, botocore's standard retries), and
every exchange with the store (a checkpoint's upload, the commit, the run files, a download) has a
deadline: --upload_timeout_s, or by default 120 s plus 1 s per 20 MB it moves. A store that refuses
or drops connections (gone), that accepts them and never answers (stalled), a bucket deleted
mid-run, or credentials that stop working: `error:` naming what was not uploaded, exit 1 (a
StoreError), and nothing more is tried on the way out. What was committed before stays intact.

One job per run: on s3:// the main process writes <url>/.lease with a conditional put
(If-None-Match) and renews it every third of --store_lease_s; a second job finds it renewed and is
refused in one line, a requeued job whose predecessor was killed finds it stale within
store_lease_s and takes it over (If-Match: one taker wins). Other stores have no conditional put
here: two jobs on one URL are not excluded there, said in one warning line.

The filesystems are fsspec's, an optional install (requirements-storage.txt): s3fs for s3://, gcsfs
for gs://, adlfs for az://. Credentials and endpoints come from their usual environment
(AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, GOOGLE_APPLICATION_CREDENTIALS, ...). A bucket mounted as a
folder by a FUSE driver (s3fs-fuse, gcsfuse, mountpoint-s3) renames by copy-then-delete: pass the
bucket's URL instead of the mount's path.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import threading
import time
from functools import partial
from pathlib import Path

from checkpoint import checkpoint_problem, file_digest
from errors import CheckpointError, ConfigError, RunError, first_line
from run_folder import COMMITTED_NAME, MANIFEST, STEP_PREFIX, RunFolder, is_url, step_name

UPLOADED = "uploaded"  # step_N/uploaded/rank{r}.json: what process r uploaded
RUN_FILES_NOT_UPLOADED = (".lock",)
LEASE = ".lease"  # <url>/.lease: the job that owns the run (its host, pid and start)
LEASE_RELEASE_S = 10.0  # at most this long at exit to let the lease go
LEASE_HELD = "TRAIN_STORE_LEASE_HOLDER"  # set where this process holds it, for its children
# each request to S3: a store that takes longer to accept a connection, or to answer, is retried
# (standard mode: 3 attempts with backoff), then failed
S3_CLIENT_CONFIG = {
    "connect_timeout": 10,
    "read_timeout": 60,
    "retries": {"max_attempts": 3, "mode": "standard"},
}
S3FS_RETRIES = 2  # s3fs's own retries of a timed-out request, on top of botocore's
# an exchange's deadline when upload_timeout_s is 0: the floor, plus the time its bytes take at
# the slowest rate a working store gives
DEADLINE_FLOOR_S = 120.0
SLOWEST_BYTES_PER_S = 20e6
_failures: list[str] = []  # this process's first store failure: nothing is tried after it


class StoreError(RunError):
    """The object store failed under the run (gone, stalled, bucket deleted, credentials refused):
    one line naming what was not uploaded, exit 1. `cause`: the store's part of the line."""

    def __init__(self, line: str, cause: str = ""):
        super().__init__(line)
        self.cause = cause


def store_failed() -> bool:
    """Whether the store already failed in this process (the exit uploads nothing more)."""
    return bool(_failures)


def check_output_dir(output_dir: str, upload_timeout_s: float = 0) -> None:
    """At start-up, before any process group: a run on object storage can be kept there."""
    if not is_url(output_dir):
        return
    problem = url_problem(output_dir, upload_timeout_s)
    if problem is not None:
        raise ConfigError(f"output_dir {problem} (got {output_dir!r})")


def url_problem(url: str, upload_timeout_s: float = 0) -> str | None:
    """Why a run cannot be kept at `url` (checked at start-up, before any process group), or None:
    the filesystem's package missing, the URL malformed, the bucket absent or unreachable."""
    try:
        bucket = Bucket(url, upload_timeout_s)
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
    and pruning, and the run files. Every exchange with the store runs under a deadline
    (`bounded`): one that does not finish in time, or fails, raises StoreError."""

    def __init__(self, url: str, upload_timeout_s: float = 0):
        import fsspec  # optional: only a run on object storage needs it

        self.url = url.rstrip("/")
        self.upload_timeout_s = upload_timeout_s
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **client_options(self.url))
        if "file" in self.fs.protocol:  # file://: folders made as on object stores, where none are
            self.fs.auto_mkdir = True
        if hasattr(self.fs, "retries"):
            self.fs.retries = S3FS_RETRIES
        loop = getattr(self.fs, "loop", None)  # an async filesystem's (s3fs): fsspec's event loop
        if loop is not None:
            loop.set_exception_handler(without_unclaimed_connection_errors)

    def reachability_problem(self) -> str | None:
        def look():
            if not self.bucket_exists():
                return "names a bucket that does not exist (or that these credentials cannot see)"
            self.fs.exists(self.root)
            return None

        try:
            return self.bounded("the start-up check", look)
        except StoreError as e:
            return f"cannot be reached: {e.cause}"

    def bucket_exists(self) -> bool:
        """Whether the bucket is there (stores without buckets: always)."""
        if self.fs.protocol[0] not in ("s3", "s3a", "gs", "gcs"):
            return True
        self.fs.invalidate_cache()
        return self.fs.exists(self.root.split("/")[0])

    def deadline_s(self, nbytes: int = 0) -> float:
        """How long an exchange moving `nbytes` may take (module docstring)."""
        if self.upload_timeout_s:
            return float(self.upload_timeout_s)
        return DEADLINE_FLOOR_S + nbytes / SLOWEST_BYTES_PER_S

    def bounded(self, lost: str, fn, nbytes: int = 0):
        """fn() under the deadline, in a thread of its own (a stalled request never returns). Any
        failure, or the deadline passed: StoreError naming `lost`, what was not done. After a
        first failure nothing more is tried: the same error at once."""
        if _failures:
            raise StoreError(_failures[0], cause="")
        outcome = {}

        def run():
            try:
                outcome["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - passed on to the caller's thread
                outcome["error"] = e

        thread = threading.Thread(target=run, name="object-store", daemon=True)
        thread.start()
        deadline = self.deadline_s(nbytes)
        thread.join(timeout=deadline)
        if thread.is_alive():
            knob = "upload_timeout_s" if self.upload_timeout_s else "the default upload_timeout_s"
            cause = f"it did not answer within {deadline:.0f} s ({knob})"
        elif "error" in outcome:
            cause = store_problem(outcome["error"])
        else:
            return outcome["value"]
        self.fail(cause, lost)

    def fail(self, cause: str, lost: str) -> None:
        """The one line: the store's failure, then what was not done; remembered (bounded)."""
        line = f"object storage {self.url} failed: {cause}; {lost}"
        _failures.append(line)
        raise StoreError(line, cause=cause)

    def step_url(self, step: int) -> str:
        return f"{self.url}/checkpoints/{step_name(step)}"

    def _step(self, name: str) -> str:
        return f"{self.root}/checkpoints/{name}"

    # ---------------------------------------------------------------- saving

    def clear_step(self, step: int) -> None:
        """Before a save of `step`: remove what an earlier save of the same step left (a resumed run
        saving it again, or an unfinished save's files), its manifest first."""
        folder = self._step(step_name(step))

        def clear():
            self.fs.invalidate_cache()
            if self.fs.exists(f"{folder}/{MANIFEST}"):
                self.fs.rm(f"{folder}/{MANIFEST}")
            if self.fs.exists(folder):
                self.fs.rm(folder, recursive=True)

        self.bounded(f"the checkpoint of step {step} was not saved{INTACT}", clear)

    def upload(self, local: Path, step: int, rank: int) -> None:
        """Upload every file of this process's staging folder, then the list of them (with sizes
        and checksums) that the commit merges into the manifest."""
        folder = self._step(step_name(step))
        paths = [path for path in sorted(local.rglob("*")) if path.is_file()]

        def put():
            files = {}
            for path in paths:
                name = path.relative_to(local).as_posix()
                files[name] = {"bytes": path.stat().st_size, "xxh3_64": file_digest(path)}
                self.fs.put_file(str(path), f"{folder}/{name}")
            listing = json.dumps(files, indent=2).encode()
            self.fs.pipe_file(f"{folder}/{UPLOADED}/rank{rank}.json", listing)

        nbytes = sum(path.stat().st_size for path in paths)
        self.bounded(f"the checkpoint of step {step} was not uploaded{INTACT}", put, nbytes)

    def commit(self, step: int, world_size: int, expected: list[str], about: dict) -> None:
        """After every process's vote: the manifest, written last, from every process's list."""
        folder = self._step(step_name(step))
        listings = [f"{folder}/{UPLOADED}/rank{rank}.json" for rank in range(world_size)]

        def read_listings():
            self.fs.invalidate_cache()
            return self.fs.cat(listings, on_error="omit")

        lost = f"the checkpoint of step {step} was not committed{INTACT}"
        found = self.bounded(lost, read_listings)
        if len(found) < len(listings) and not self.bounded(lost, self.bucket_exists):
            self.fail("the bucket no longer exists (deleted?)", lost)
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
        self.bounded(lost, lambda: self.fs.pipe_file(f"{folder}/{MANIFEST}", manifest.encode()))

    def committed(self) -> list[str]:
        """The committed checkpoints' names (step_N, a manifest present), oldest first."""

        def glob():
            self.fs.invalidate_cache()
            return self.fs.glob(f"{self.root}/checkpoints/{STEP_PREFIX}*/{MANIFEST}")

        manifests = self.bounded("its checkpoints could not be listed", glob)
        names = [manifest.rstrip("/").split("/")[-2] for manifest in manifests]
        return sorted(name for name in names if COMMITTED_NAME.fullmatch(name))

    def newest(self) -> str | None:
        """The newest committed checkpoint's URL (None before the first)."""
        committed = self.committed()
        return f"{self.url}/checkpoints/{committed[-1]}" if committed else None

    def prune(self, keep_last: int, just_committed: int) -> None:
        """Delete all but the newest `keep_last` committed checkpoints (each manifest first), and
        unfinished saves. Called right after a commit: no save is in flight."""
        committed = self.committed()

        def delete():
            for name in committed[:-keep_last]:
                self.fs.rm(f"{self._step(name)}/{MANIFEST}")
                self.fs.rm(self._step(name), recursive=True)
            if not self.fs.exists(f"{self.root}/checkpoints"):
                return
            for folder in self.fs.ls(f"{self.root}/checkpoints", detail=False):
                name = folder.rstrip("/").split("/")[-1]
                if name not in committed:
                    self.fs.rm(folder, recursive=True)

        lost = (
            f"the checkpoint of step {just_committed} is committed, older ones were not pruned; "
            "--resume latest once the store answers"
        )
        self.bounded(lost, delete)

    # ---------------------------------------------------------------- resuming

    def download_newest(self, checkpoints: Path, log) -> Path | None:
        """Download the newest committed checkpoint whose files all match its manifest into
        `checkpoints` (emptied first), or None if there is none."""
        shutil.rmtree(checkpoints, ignore_errors=True)
        for name in reversed(self.committed()):
            local = checkpoints / name
            started = time.perf_counter()
            lost = f"the checkpoint {name} could not be downloaded"
            manifest_file = f"{self._step(name)}/{MANIFEST}"
            manifest = json.loads(self.bounded(lost, partial(self.fs.cat_file, manifest_file)))
            names = [*manifest["files"], MANIFEST]
            for file in names:
                (local / file).parent.mkdir(parents=True, exist_ok=True)
            size = sum(entry["bytes"] for entry in manifest["files"].values())
            sources = [f"{self._step(name)}/{file}" for file in names]
            self.bounded(lost, partial(self.fs.get, sources, [str(local / f) for f in names]), size)
            problem = checkpoint_problem(local)
            if problem is None:
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

    def upload_run_files(self, run_dir: str, at_the_end: bool = False) -> None:
        """The run folder's own files (not its folders), the exported weights last. At the end, a
        failure's line says where they are and how to finish the job."""
        files = [
            p
            for p in Path(run_dir).iterdir()
            if p.is_file() and p.name not in RUN_FILES_NOT_UPLOADED
        ]
        files.sort(key=lambda p: (p.suffix == ".safetensors", p.name))

        def put():
            for path in files:
                self.fs.put_file(str(path), f"{self.root}/{path.name}")

        names = ", ".join(path.name for path in files)
        lost = f"the run files ({names}) were not uploaded; they are in {run_dir}"
        if at_the_end:
            lost += (
                f"; to finish the job once the store answers: --output_dir {self.url} --resume "
                "latest (it resumes the last checkpoint, exports and uploads)"
            )
        else:
            lost += "; --resume latest once the store answers"
        self.bounded(lost, put, sum(path.stat().st_size for path in files))

    def download_run_files(self, run_dir: str) -> None:
        """Before a resume's first log line: the run files as the last commit left them (a new pod's
        staging folder is empty), so that metrics.jsonl and the launches in run_info.json go on."""

        def get():
            self.fs.invalidate_cache()
            if not self.fs.exists(self.root):
                return
            for entry in self.fs.ls(self.root, detail=True):
                name = entry["name"].rstrip("/").split("/")[-1]
                wanted = not name.endswith(".safetensors") and name != LEASE
                if entry["type"] == "file" and wanted:
                    self.fs.get_file(entry["name"], os.path.join(run_dir, name))

        self.bounded("the run files could not be downloaded", get)


def open_run_folder(cfg) -> RunFolder:
    """The run folder the config names: on this node's disk, or on object storage (BucketFolder)."""
    folder = RunFolder.of(cfg)
    return BucketFolder(cfg) if folder.on_bucket else folder


class BucketFolder(RunFolder):
    """A run on object storage: this node's staging folder (RunFolder's layout), and the bucket
    behind it, which holds the committed checkpoints, the run files and the lease."""

    def __init__(self, cfg):
        super().__init__(cfg.output_dir, cfg.staging_dir, cfg.shared_filesystem)
        self.bucket = Bucket(cfg.output_dir, cfg.upload_timeout_s)
        self.lease_s = cfg.store_lease_s

    def newest(self) -> str | None:
        return self.bucket.newest()

    def take_lease(self) -> None:
        """The main process, at start-up: the run's lease (one job per URL), or a warning line
        where the store has no conditional put."""
        if os.environ.get(LEASE_HELD):  # by the process that started this one (mp.spawn)
            return
        lease = Lease(self.bucket, self.lease_s)
        if not lease.supported():
            say(
                f"warning: a second job on {self.root} is not refused: only s3:// has the "
                "conditional put this template's lease uses (each node's staging folder is locked)"
            )
            return
        lease.take(say)
        os.environ[LEASE_HELD] = lease.holder  # inherited by the processes this one starts

    def upload_run_files(self, at_the_end: bool = False) -> str | None:
        """The run files as they are (the export among them at the end); nothing after a store's
        failure."""
        if store_failed():
            return None
        self.bucket.upload_run_files(str(self.local), at_the_end=at_the_end)
        return self.root


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # noqa: T201 - before the run's logger exists


class Lease:
    """One job per run on object storage (module docstring): <url>/.lease, taken with a conditional
    put, renewed by a thread every third of `lease_s`, deleted when the job ends."""

    def __init__(self, bucket: Bucket, lease_s: int):
        self.bucket = bucket
        self.lease_s = lease_s
        self.bucket_name, _, self.key = f"{bucket.root}/{LEASE}".partition("/")
        self.etag = None
        self.done = threading.Event()
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        self.holder = f"host {os.uname().nodename}, pid {os.getpid()}, started {started}"

    def supported(self) -> bool:
        """Only S3's conditional put is used here (If-None-Match, If-Match)."""
        return self.bucket.fs.protocol[0] in ("s3", "s3a")

    def take(self, say) -> None:
        """Take the lease, or raise ConfigError naming the job that holds it. A lease that nobody
        renews for `lease_s` (its job was killed) is taken over; `say` tells of the wait."""
        lost = "the run's lease could not be taken"
        if self.bucket.bounded(lost, lambda: self._put(IfNoneMatch="*")):
            return self._keep()
        seen = self.bucket.bounded(lost, self._read)
        if seen is not None:
            say(
                f"waiting up to {self.lease_s} s (store_lease_s) for {self.bucket.url} to be free: "
                f"its lease is held by {seen[1]} (a job still running, or one killed without "
                "letting go)"
            )
        waited = time.monotonic()
        while time.monotonic() - waited < self.lease_s + self.lease_s / 3:
            time.sleep(max(0.5, self.lease_s / 10))
            now = self.bucket.bounded(lost, self._read)
            if now is None:  # let go meanwhile: take it as new
                if self.bucket.bounded(lost, lambda: self._put(IfNoneMatch="*")):
                    return self._keep()
                now = self.bucket.bounded(lost, self._read)
            if seen is not None and now is not None and now[0] != seen[0]:
                raise ConfigError(
                    f"output_dir '{self.bucket.url}' is in use by another job ({now[1]}: it renews "
                    "its lease); wait for it to end, or choose another output_dir"
                )
            seen = seen or now
        etag = seen[0]
        if not self.bucket.bounded(lost, lambda: self._put(IfMatch=etag)):  # one taker wins
            raise ConfigError(
                f"output_dir '{self.bucket.url}' was taken over by another job a moment ago; "
                "choose another output_dir"
            )
        return self._keep()

    def _keep(self) -> None:
        threading.Thread(target=self._renew, name="store-lease", daemon=True).start()
        atexit.register(self.release)

    def _renew(self) -> None:
        while not self.done.wait(self.lease_s / 3):
            try:
                etag = self.etag
                if not self._put(IfMatch=etag):
                    print(  # noqa: T201 - once, from a thread of its own
                        f"warning: the lease of {self.bucket.url} was taken by another job (this "
                        "one renewed it too late)",
                        flush=True,
                    )
                    return
            except Exception:  # noqa: BLE001, S112 - a store gone: the uploads say it, not this
                continue

    def release(self) -> None:
        """At the job's end (any way out but a kill): the next job starts at once."""
        if self.done.is_set():
            return
        self.done.set()
        if store_failed():
            return
        # best effort, and briefly: a store that does not answer now must not hold the exit (the next
        # job then takes the lease over once it is stale)
        deleting = threading.Thread(target=self._delete, name="store-lease", daemon=True)
        deleting.start()
        deleting.join(timeout=LEASE_RELEASE_S)

    def _delete(self) -> None:
        try:
            self.bucket.fs.rm(f"{self.bucket_name}/{self.key}")
        except Exception:  # noqa: BLE001, S110 - the lease then expires by itself
            pass

    def _put(self, **condition) -> bool:
        """Write the lease if `condition` holds; False if it did not."""
        # the renewal time makes each renewal's ETag new (an ETag is the content's MD5)
        lease = {"holder": self.holder, "lease_s": self.lease_s, "renewed": time.time()}
        body = json.dumps(lease).encode()
        try:
            answer = self.bucket.fs.call_s3(
                "put_object", Bucket=self.bucket_name, Key=self.key, Body=body, **condition
            )
        except Exception as e:
            if failed_condition(e):
                return False
            raise
        self.etag = answer["ETag"]
        return True

    def _read(self) -> tuple[str, str] | None:
        """The lease's (etag, holder), or None if there is none."""
        path = f"{self.bucket_name}/{self.key}"
        self.bucket.fs.invalidate_cache()
        try:
            etag = self.bucket.fs.info(path)["ETag"]
            holder = json.loads(self.bucket.fs.cat_file(path)).get("holder", "an unknown job")
        except FileNotFoundError:
            return None
        return etag, holder


def failed_condition(error: BaseException) -> bool:
    """Whether a conditional put was refused (the object exists, or has another ETag)."""
    seen = error
    while seen is not None:
        if isinstance(seen, FileExistsError):
            return True
        text = str(seen)
        if "PreconditionFailed" in text or "ConditionalRequestConflict" in text or "412" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


INTACT = "; the checkpoints committed before it are intact: --resume latest once the store answers"


def without_unclaimed_connection_errors(loop, context: dict) -> None:
    """The store's event loop's handler of errors that nobody awaited. When a connection is reset
    just as aiohttp hands it a request (a kept-alive one, taken by a retry as the store goes away),
    the request fails and is retried or said in the run's one line, but its body's writer task
    fails too, on the closing transport, and nobody retrieves that error: asyncio would print it
    when the task is garbage-collected, "Task exception was never retrieved" and a traceback among
    the run's lines. Such a connection error is dropped; anything else is logged as before."""
    unclaimed = "never retrieved" in context.get("message", "")
    if unclaimed and isinstance(context.get("exception"), ConnectionError):
        return
    loop.default_exception_handler(context)


def client_options(url: str) -> dict:
    """The filesystem's options: on S3, each request's timeouts and retries."""
    if url.split("://")[0] in ("s3", "s3a"):
        return {"config_kwargs": S3_CLIENT_CONFIG}
    return {}


def store_problem(error: BaseException) -> str:
    """What a store's error means, in words: gone, stalled, bucket deleted, credentials refused."""
    chain = []
    seen = error
    while seen is not None and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    names = " ".join(type(e).__name__ for e in chain)
    text = " ".join(str(e) for e in chain)
    if "NoSuchBucket" in names + text or "bucket does not exist" in text.lower():
        return "the bucket no longer exists (deleted?)"
    credentials = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "AccessDenied")
    if any(word in names + text for word in credentials) or "PermissionError" in names:
        return "it refused these credentials (expired, rotated or revoked?)"
    if "EndpointConnectionError" in names or "ConnectionRefused" in names + text:
        return "it refused the connection (the store is gone, or its address changed)"
    if "Timeout" in names:  # ReadTimeoutError, ConnectTimeoutError, TimeoutError, ...
        return "it accepted the connection but did not answer (stalled)"
    if any(word in names for word in ("ConnectionClosed", "Disconnected", "IncompleteRead")):
        return "it closed the connection mid-request (the store is gone?)"
    return first_line(error)
