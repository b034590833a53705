"""A run on object storage (storage.py), in one process, through fsspec's file:// filesystem (the
same calls s3:// makes; tests/e2e/test_object_storage.py runs them against an S3 server): a
checkpoint is committed by its manifest, written last from every process's list of its uploads; a
save that never finished is never resumed from and is removed by the next commit; a resume takes the
newest checkpoint whose files match their manifest; the start-up check names a missing package in
one line."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import storage
from checkpoint import MANIFEST
from config import config_class
from errors import ConfigError, RunError
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
    assert "step_00000003" in warning and "model.safetensors does not match its checksum" in warning
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
    with pytest.raises(ConfigError, match=r"^output_dir is not a URL fsspec can open"):
        storage.check_output_dir("nosuch://bucket/run")
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
