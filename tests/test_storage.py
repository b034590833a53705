"""A run on object storage (storage.py), in one process, through fsspec's file:// filesystem (the
same calls s3:// makes; tests/e2e/test_object_storage.py runs them against an S3 server): a
checkpoint is committed by its manifest, written last from every process's list of its uploads; a
save that never finished is never resumed from and is removed by the next commit; a resume takes the
newest checkpoint whose files match their manifest; the start-up check names a missing package in
one line."""

import importlib.util
import json
import threading
import time
from pathlib import Path

import pytest
import torch

import storage
from checkpoint import MANIFEST
from errors import CheckpointError, ConfigError, RunError
from run_config import config_class
from run_folder import RunFolder
from saving import Checkpointer
from test_checkpoint import Job, Log, same_tensors

RunConfig = config_class()  # TrainConfig and model.py's and data.py's own keys


def bucket_job(tmp_path: Path, staging: str, **kw) -> Job:
    return Job(
        tmp_path,
        output_dir=f"file://{tmp_path}/bucket/run",
        staging_dir=str(tmp_path / staging),
        **kw,
    )


def train_on(job: Job) -> dict:
    """The weights as they are (a copy), then changed as a training step would change them."""
    before = {name: tensor.clone() for name, tensor in job.model.state_dict().items()}
    with torch.no_grad():
        for parameter in job.model.parameters():
            parameter.add_(1.0)
    return before


def steps_in(bucket_root: Path) -> dict:
    """Each step folder on the "bucket", and whether it has a manifest (is committed)."""
    folders = sorted((bucket_root / "checkpoints").iterdir())
    return {folder.name: (folder / MANIFEST).is_file() for folder in folders}


@pytest.mark.parametrize("async_save", [False, True])
def test_a_checkpoint_on_object_storage_is_committed_by_its_manifest_and_pruned_manifest_first(
    tmp_path, async_save
):
    job = bucket_job(tmp_path, "staging", async_save=async_save)
    saver = Checkpointer(job.plumbing, job.cfg, job.parts, {"seed": 1}, Log())
    for step in (1, 2, 3):
        job.state.step = step
        saver.save(step)
        assert saver.finish() == f"{job.cfg.output_dir}/checkpoints/step_{step:08d}"
    root = tmp_path / "bucket" / "run"
    assert steps_in(root) == {"step_00000002": True, "step_00000003": True}  # keep_last 2
    manifest = json.loads((root / "checkpoints" / "step_00000003" / MANIFEST).read_text())
    assert manifest["step"] == 3
    assert {"model.safetensors", "optimizer.pt", "rng_rank0.pt", "config.yaml"} <= set(
        manifest["files"]
    )
    uploaded = json.loads((root / "checkpoints/step_00000003/uploaded/rank0.json").read_text())
    assert uploaded == manifest["files"]  # one process: its list is the manifest's
    # nothing is kept in the staging folder once uploaded
    assert list((tmp_path / "staging" / "checkpoints").iterdir()) == []


def test_a_save_that_never_finished_is_not_resumed_from_and_the_next_commit_removes_it(tmp_path):
    job = bucket_job(tmp_path, "staging")
    job.save(2)
    weights_at_2 = train_on(job)
    # step 4's upload, killed before its manifest: its files are there, not its manifest
    bucket = storage.Bucket(job.cfg.output_dir)
    staged = tmp_path / "killed"
    staged.mkdir()
    (staged / "model.safetensors").write_bytes(b"half an upload")
    bucket.upload(staged, 4, rank=0)
    root = tmp_path / "bucket" / "run"
    assert steps_in(root) == {"step_00000002": True, "step_00000004": False}
    assert bucket.newest() == f"{job.cfg.output_dir}/checkpoints/step_00000002"

    restarted = bucket_job(tmp_path, "new_pod_staging", resume="latest")  # an empty staging folder
    state, log = restarted.resume()
    assert state.step == 2
    assert same_tensors(restarted.model.state_dict(), weights_at_2)
    assert any("resume: file://" in line and "step_00000002 (step 2)" in line for line in log.lines)
    restarted.save(3)
    assert steps_in(root) == {"step_00000002": True, "step_00000003": True}


def test_a_resume_skips_a_damaged_checkpoint_with_a_warning_and_takes_the_one_before(tmp_path):
    job = bucket_job(tmp_path, "staging")
    job.save(2)
    weights_at_2 = train_on(job)
    job.save(3)
    damaged = tmp_path / "bucket/run/checkpoints/step_00000003/model.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF  # the same size, one byte altered
    damaged.write_bytes(bytes(data))

    restarted = bucket_job(tmp_path, "new_pod_staging", resume="latest")
    state, log = restarted.resume()
    assert state.step == 2
    assert same_tensors(restarted.model.state_dict(), weights_at_2)
    warning = next(line for line in log.lines if line.startswith("warning:"))
    assert warning == (
        f"warning: skipping damaged checkpoint {job.cfg.output_dir}/checkpoints/step_00000003: "
        "model.safetensors does not match its checksum (the file was altered or corrupted); trying the one "
        "before"
    )
    # the downloaded copy is gone once loaded: the bucket keeps the original
    assert list((tmp_path / "new_pod_staging" / "checkpoints").iterdir()) == []


def test_a_commit_names_a_process_whose_upload_never_arrived(tmp_path):
    job = bucket_job(tmp_path, "staging", world_size=2)  # rank 0 of 2: rank 1 uploads nothing
    with pytest.raises(RunError, match=r"uploaded/rank1\.json never arrived"):
        job.save(1)
    assert storage.Bucket(job.cfg.output_dir).newest() is None


def test_a_fresh_start_on_a_bucket_that_holds_checkpoints_is_refused(tmp_path):
    bucket_job(tmp_path, "staging").save(2)
    again = bucket_job(tmp_path, "other_staging")
    with pytest.raises(ConfigError, match="already holds checkpoints; pass --resume latest"):
        again.resume()


def test_the_start_up_check_names_the_missing_package_or_the_bad_url_in_one_line(tmp_path):
    # a protocol whose package is not installed here (gcsfs, adlfs, ocifs: none is a dependency)
    protocol, package = next(
        (protocol, package)
        for protocol, package in (("gs", "gcsfs"), ("az", "adlfs"), ("oci", "ocifs"))
        if importlib.util.find_spec(package) is None
    )
    url = f"{protocol}://bucket/run"
    with pytest.raises(ConfigError) as missing:
        storage.check_output_dir(url)
    assert str(missing.value) == (
        f"output_dir needs {package}, an optional install: pip install {package} (got '{url}')"
    )
    with pytest.raises(ConfigError) as malformed:
        storage.check_output_dir("nosuch://bucket/run")
    assert str(malformed.value) == (
        "output_dir is not a URL fsspec can open (Protocol not known: nosuch) (got 'nosuch://bucket/run')"
    )
    storage.check_output_dir(f"file://{tmp_path}/run")  # a folder that does not exist yet is fine
    storage.check_output_dir(str(tmp_path / "run"))  # not a URL: nothing to check here


def test_the_staging_folder_is_named_after_the_url_unless_given():
    cfg = RunConfig(output_dir="s3://bucket/team/run")
    assert cfg.run_dir.endswith("/train-staging/s3/bucket/team/run")
    assert not RunFolder.of(cfg).shared  # each node stages its own
    assert RunConfig(output_dir="s3://b/run", staging_dir="/scratch/run").run_dir == "/scratch/run"
    local = RunConfig(output_dir="/runs/a")
    assert local.run_dir == "/runs/a" and RunFolder.of(local).shared


@pytest.mark.skipif(importlib.util.find_spec("s3fs") is None, reason="pip install s3fs")
@pytest.mark.parametrize(
    "code, message",
    [
        ("InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist in our records."),
        ("ExpiredToken", "The provided token has expired."),
        ("SignatureDoesNotMatch", "The request signature we calculated does not match."),
        ("AccessDenied", "Access Denied"),
    ],
)
def test_credentials_that_stop_working_are_named_as_such(code, message):
    """What S3 answers when credentials stop working mid-run, as s3fs hands it on: one cause."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    answer = {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {}}
    error = translate_boto_error(ClientError(answer, "PutObject"))
    assert storage.store_problem(error) == (
        "it refused these credentials (expired, rotated or revoked?)"
    )


def test_after_the_store_failed_nothing_more_is_tried_and_the_same_line_comes_at_once(
    tmp_path, monkeypatch
):
    """A failure is remembered: the exit's uploads (the run files, the lease) try nothing more."""
    monkeypatch.setattr(storage, "_failures", [])
    bucket = storage.Bucket(f"file://{tmp_path}/bucket/run", upload_timeout_s=1)
    calls = []

    def stalls():
        calls.append(1)
        import time

        time.sleep(5)

    with pytest.raises(
        storage.StoreError, match=r"did not answer within 1 s \(upload_timeout_s\); lost"
    ):
        bucket.bounded("lost", stalls)
    assert storage.store_failed()
    with pytest.raises(storage.StoreError, match="did not answer within 1 s"):
        bucket.bounded("something else", stalls)
    assert calls == [1]


# ---------------------------------------------------------------- each failure's words, and what it says was lost


def error_named(name: str, text: str = "", base=Exception):
    """An exception of a class called `name`, as botocore, aiohttp and s3fs name theirs."""
    return type(name, (base,), {})(text)


def chained(outer: BaseException, inner: BaseException, how: str = "__cause__") -> BaseException:
    setattr(outer, how, inner)
    return outer


@pytest.mark.parametrize(
    "error, words",
    [
        (error_named("NoSuchBucket"), "the bucket no longer exists (deleted?)"),
        (OSError("The specified bucket does not exist"), "the bucket no longer exists (deleted?)"),
        (
            error_named("InvalidAccessKeyId"),
            "it refused these credentials (expired, rotated or revoked?)",
        ),
        (
            OSError("ExpiredToken: the token expired"),
            "it refused these credentials (expired, rotated or revoked?)",
        ),
        (
            PermissionError("Forbidden"),
            "it refused these credentials (expired, rotated or revoked?)",
        ),
        (
            error_named("ClientError", "An error occurred (SignatureDoesNotMatch)"),
            "it refused these credentials (expired, rotated or revoked?)",
        ),
        (
            error_named("AccessDenied"),
            "it refused these credentials (expired, rotated or revoked?)",
        ),
        (error_named("TimeoutError"), "it accepted the connection but did not answer (stalled)"),
        (
            error_named("ConnectionClosedError"),
            "it closed the connection mid-request (the store is gone?)",
        ),
        (
            error_named("EndpointConnectionError"),
            "it refused the connection (the store is gone, or its address changed)",
        ),
        (
            OSError("[Errno 111] ConnectionRefused"),
            "it refused the connection (the store is gone, or its address changed)",
        ),
        (
            error_named("ReadTimeoutError"),
            "it accepted the connection but did not answer (stalled)",
        ),
        (error_named("ConnectTimeout"), "it accepted the connection but did not answer (stalled)"),
        (
            error_named("ServerDisconnectedError"),
            "it closed the connection mid-request (the store is gone?)",
        ),
        (
            error_named("IncompleteRead"),
            "it closed the connection mid-request (the store is gone?)",
        ),
        (OSError("disk quota exceeded\nsecond line"), "disk quota exceeded"),
        # the cause is found down the chain, by __cause__ or by __context__
        (
            chained(OSError("upload failed"), error_named("NoSuchBucket")),
            "the bucket no longer exists (deleted?)",
        ),
        (
            chained(RuntimeError("retry gave up"), error_named("ReadTimeoutError"), "__context__"),
            "it accepted the connection but did not answer (stalled)",
        ),
    ],
)
def test_store_problem_says_what_the_stores_error_means(error, words):
    assert storage.store_problem(error) == words


def test_a_refused_conditional_put_is_told_from_other_failures():
    for refused in (
        FileExistsError("lease"),
        OSError("An error occurred (PreconditionFailed) when calling the PutObject operation"),
        OSError("ConditionalRequestConflict"),
        OSError("HTTP 412"),
        chained(OSError("put failed"), FileExistsError("lease")),
        chained(OSError("put failed"), OSError("PreconditionFailed"), "__context__"),
    ):
        assert storage.failed_condition(refused), refused
    for other in (OSError("connection refused"), chained(OSError("put failed"), ValueError("bad"))):
        assert not storage.failed_condition(other), other


def test_s3_requests_get_timeouts_and_retries_and_other_stores_their_defaults():
    for url in ("s3://bucket/run", "s3a://bucket/run"):
        assert storage.client_options(url) == {"config_kwargs": storage.S3_CLIENT_CONFIG}
    for url in ("gs://bucket/run", "file:///tmp/run", "memory://run"):
        assert storage.client_options(url) == {}
    assert storage.package_for("s3://b/run") == "s3fs"
    assert storage.package_for("gs://b/run") == "gcsfs"
    assert storage.package_for("nosuch://b/run") == "fsspec"


def test_the_start_up_check_gives_the_bucket_its_deadline(monkeypatch):
    made = []

    class Recorded:
        def __init__(self, url, upload_timeout_s):
            made.append((url, upload_timeout_s))

        def reachability_problem(self):
            return None

    monkeypatch.setattr(storage, "Bucket", Recorded)
    storage.check_output_dir("s3://bucket/run", 45)
    storage.check_output_dir("s3://bucket/other")
    assert made == [("s3://bucket/run", 45), ("s3://bucket/other", 0)]


REFUSED = "it refused the connection (the store is gone, or its address changed)"


class Refusing:
    """A filesystem whose every call is refused, as a store that went away refuses them."""

    protocol = ("file",)

    def __getattr__(self, name):
        def refused(*args, **kwargs):
            raise ConnectionRefusedError(111, "Connection refused")

        return refused


def refused_line(tmp_path, monkeypatch, call) -> str:
    monkeypatch.setattr(storage, "_failures", [])
    bucket = storage.Bucket(f"file://{tmp_path}/bucket/run")
    bucket.fs = Refusing()
    with pytest.raises(storage.StoreError) as error:
        call(bucket)
    return str(error.value)


def test_each_exchange_names_what_was_not_done(tmp_path, monkeypatch):
    url = f"file://{tmp_path}/bucket/run"
    prefix = f"object storage {url} failed: {REFUSED}; "
    intact = (
        "; the checkpoints committed before it are intact: --resume latest once the store answers"
    )
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "model.safetensors").write_bytes(b"weights")
    expected = {
        lambda bucket: bucket.clear_step(4): f"the checkpoint of step 4 was not saved{intact}",
        lambda bucket: bucket.upload(
            staged, 4, 0
        ): f"the checkpoint of step 4 was not uploaded{intact}",
        lambda bucket: bucket.commit(
            4, 1, [], {}
        ): f"the checkpoint of step 4 was not committed{intact}",
        lambda bucket: bucket.committed(): "its checkpoints could not be listed",
    }
    for call, lost in expected.items():
        assert refused_line(tmp_path, monkeypatch, call) == prefix + lost


def test_a_prune_or_a_download_that_fails_says_what_is_safe(tmp_path, monkeypatch):
    job = bucket_job(tmp_path, "staging")
    job.save(2)
    monkeypatch.setattr(storage, "_failures", [])
    bucket = storage.Bucket(job.cfg.output_dir)
    committed = bucket.committed()
    monkeypatch.setattr(storage.Bucket, "committed", lambda self: committed)
    prefix = f"object storage {job.cfg.output_dir} failed: {REFUSED}; "
    bucket.fs = Refusing()
    with pytest.raises(storage.StoreError) as error:
        bucket.prune(keep_last=1, just_committed=2)
    assert str(error.value) == (
        prefix
        + "the checkpoint of step 2 is committed, older ones were not pruned; --resume latest once "
        "the store answers"
    )
    monkeypatch.setattr(storage, "_failures", [])
    with pytest.raises(storage.StoreError) as error:
        bucket.download_newest(tmp_path / "downloads", Log())
    assert str(error.value) == prefix + "the checkpoint step_00000002 could not be downloaded"


def test_a_commit_after_the_bucket_was_deleted_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "_failures", [])
    bucket = storage.Bucket(f"file://{tmp_path}/bucket/run")
    monkeypatch.setattr(storage.Bucket, "bucket_exists", lambda self: False)
    with pytest.raises(storage.StoreError) as error:
        bucket.commit(4, 1, [], {"step": 4})  # rank 0's listing is not there
    assert str(error.value) == (
        f"object storage {bucket.url} failed: the bucket no longer exists (deleted?); the checkpoint of "
        "step 4 was not committed; the checkpoints committed before it are intact: --resume latest once "
        "the store answers"
    )


def test_a_commit_checks_every_listing_and_every_expected_file(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "_failures", [])
    bucket = storage.Bucket(f"file://{tmp_path}/bucket/run")

    def asked(self):
        raise AssertionError("every listing arrived: the bucket need not be looked for")

    monkeypatch.setattr(storage.Bucket, "bucket_exists", asked)
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "model.safetensors").write_bytes(b"weights")
    bucket.upload(staged, 4, 0)
    with pytest.raises(CheckpointError) as error:
        bucket.commit(4, 1, ["model.safetensors", "optimizer.pt", "rng_rank0.pt"], {"step": 4})
    assert (
        str(error.value)
        == f"checkpoint of step 4 is missing optimizer.pt, rng_rank0.pt on {bucket.url}"
    )
    monkeypatch.setattr(storage.Bucket, "bucket_exists", lambda self: True)
    with pytest.raises(CheckpointError) as error:
        bucket.commit(4, 2, ["model.safetensors"], {"step": 4})
    assert str(error.value) == (
        f"checkpoint of step 4: {bucket.root}/checkpoints/step_00000004/uploaded/rank1.json never arrived "
        "(a process's upload was lost)"
    )


def test_clear_step_removes_an_earlier_saves_files_and_manifest(tmp_path):
    bucket = storage.Bucket(f"file://{tmp_path}/bucket/run")
    folder = tmp_path / "bucket/run/checkpoints/step_00000004"
    (folder / "sub").mkdir(parents=True)
    (folder / MANIFEST).write_text("{}")
    (folder / "sub" / "shard.bin").write_bytes(b"x")
    bucket.clear_step(4)
    assert not folder.exists()
    bucket.clear_step(5)  # nothing there: nothing to do


def test_a_download_empties_the_local_folder_and_logs_its_size_and_time(tmp_path):
    job = bucket_job(tmp_path, "staging")
    job.save(2)
    bucket = storage.Bucket(job.cfg.output_dir)
    downloads = tmp_path / "downloads"
    (downloads / "step_00000001").mkdir(parents=True)  # a stale download of an older pod
    log = Log()
    local = bucket.download_newest(downloads, log)
    assert local == downloads / "step_00000002" and sorted(downloads.iterdir()) == [local]
    manifest = json.loads((local / MANIFEST).read_text())
    size = sum(entry["bytes"] for entry in manifest["files"].values())
    line = log.lines[0]
    prefix = f"downloaded {job.cfg.output_dir}/checkpoints/step_00000002: {size / 1e6:.1f} MB in "
    assert line.startswith(prefix) and line.endswith(" s")
    assert 0 <= float(line.removeprefix(prefix).removesuffix(" s")) < 60


def test_a_commit_that_cannot_look_for_the_bucket_or_write_the_manifest_names_the_step(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(storage, "_failures", [])
    bucket = storage.Bucket(f"file://{tmp_path}/bucket/run")

    def refused(*args, **kwargs):
        raise ConnectionRefusedError(111, "Connection refused")

    lost = (
        "the checkpoint of step 4 was not committed; the checkpoints committed before it are intact"
    )
    monkeypatch.setattr(storage.Bucket, "bucket_exists", refused)
    with pytest.raises(storage.StoreError) as error:
        bucket.commit(4, 1, [], {"step": 4})  # no listing: is the bucket still there?
    assert str(error.value).startswith(f"object storage {bucket.url} failed: {REFUSED}; {lost}")
    monkeypatch.setattr(storage, "_failures", [])
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "model.safetensors").write_bytes(b"weights")
    bucket.upload(staged, 4, 0)
    monkeypatch.setattr(bucket.fs, "pipe_file", refused)  # the manifest, written last
    with pytest.raises(storage.StoreError) as error:
        bucket.commit(4, 1, ["model.safetensors"], {"step": 4})
    assert str(error.value).startswith(f"object storage {bucket.url} failed: {REFUSED}; {lost}")


def test_an_uploads_and_a_downloads_deadline_grow_with_their_bytes(tmp_path, monkeypatch):
    job = bucket_job(tmp_path, "staging")
    job.save(2)
    bucket = storage.Bucket(job.cfg.output_dir)
    sizes = []
    real = storage.Bucket.bounded

    def recorded(self, lost, fn, nbytes=0):
        sizes.append(nbytes)
        return real(self, lost, fn, nbytes)

    monkeypatch.setattr(storage.Bucket, "bounded", recorded)
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "model.safetensors").write_bytes(b"x" * 1000)
    (staged / "optimizer.pt").write_bytes(b"y" * 234)
    bucket.upload(staged, 5, 0)
    assert sizes == [1234]
    sizes.clear()
    local = bucket.download_newest(tmp_path / "downloads", Log())
    manifest = json.loads((local / MANIFEST).read_text())
    assert max(sizes) == sum(entry["bytes"] for entry in manifest["files"].values())


def test_the_default_deadline_is_120_s_plus_1_s_per_20_mb(tmp_path):
    """The module docstring's formula by hand: 2 GB at 20 MB/s is 100 s, plus the 120 s floor: 220 s;
    an empty exchange gets the floor; --upload_timeout_s, when given, replaces it all."""
    url = f"file://{tmp_path}/bucket/run"
    assert storage.Bucket(url, 0).deadline_s(2_000_000_000) == 220.0
    assert storage.Bucket(url, 0).deadline_s(0) == 120.0
    assert storage.Bucket(url, 45).deadline_s(2_000_000_000) == 45.0


def test_the_lease_is_renewed_every_third_of_store_lease_s(tmp_path, monkeypatch):
    """A lease of 1.5 s is renewed after 0.5 s and again 0.5 s later (a third of it), so a second job,
    which takes it over only after store_lease_s without a renewal, never finds it stale."""
    renewed = []
    monkeypatch.setattr(
        storage.Lease, "_put", lambda self, **condition: renewed.append(time.monotonic()) or True
    )
    lease = storage.Lease(storage.Bucket(f"file://{tmp_path}/bucket/run"), 1.5)
    started = time.monotonic()
    renewing = threading.Thread(target=lease._renew, daemon=True)
    renewing.start()
    while len(renewed) < 2 and time.monotonic() - started < 5:
        time.sleep(0.01)
    lease.done.set()
    renewing.join(timeout=5)
    assert len(renewed) >= 2, renewed
    gaps = [renewed[0] - started, renewed[1] - renewed[0]]
    assert all(0.45 <= gap < 1.25 for gap in gaps), gaps  # every store_lease_s: 1.5 s


def test_pruning_deletes_a_checkpoints_manifest_before_its_files(tmp_path, monkeypatch):
    """A prune stopped half-way leaves an unfinished save (no manifest), never a committed one with
    files missing: for each pruned step, its manifest is the first thing removed (keep_last 1 of
    2 committed: step 1 goes)."""
    root = tmp_path / "bucket" / "run" / "checkpoints"
    for step in (1, 2):
        folder = root / f"step_{step:08d}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"w" * 10)
        (folder / MANIFEST).write_text(json.dumps({"step": step, "files": {}}))
    bucket = storage.Bucket(f"file://{tmp_path}/bucket/run")
    removed = []
    real_rm = bucket.fs.rm

    def rm(path, recursive=False, **kw):
        removed.append(str(path).rstrip("/").split("/checkpoints/")[1])
        return real_rm(path, recursive=recursive, **kw)

    monkeypatch.setattr(bucket.fs, "rm", rm)
    bucket.prune(keep_last=1, just_committed=2)
    assert removed[0] == f"step_00000001/{MANIFEST}", removed
    assert "step_00000001" in removed[1:]
    assert sorted(path.name for path in root.iterdir()) == ["step_00000002"]
