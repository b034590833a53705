"""The run folder (train/run_folder.py) in one process: its names, which checkpoints count as committed,
the lock's holder line, the requeue marker, the staging folder of a run on object storage. The values
are written out by hand."""

import json
import os
import re
from pathlib import Path

import pytest

import run_folder
from errors import ConfigError
from run_folder import RunFolder


@pytest.mark.parametrize(
    "output_dir, on_bucket",
    [
        ("s3://bucket/run", True),
        ("gs://bucket", True),
        ("file:///tmp/run", True),
        ("a+b.c-d://x", True),
        ("runs/x", False),
        ("/abs/runs/x", False),
        ("s3:/bucket", False),
        ("3s://bucket", False),
        ("run://", True),
        ("./s3://x", False),
    ],
)
def test_an_output_dir_is_object_storage_when_it_starts_with_a_scheme(output_dir, on_bucket):
    assert run_folder.is_url(output_dir) is on_bucket


def test_runs_are_numbered_three_digits_and_only_run_folders_count(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("run_001", "run_012", "run_1234", "run_x", "run_3a", "other", "xrun_005"):
        (tmp_path / "runs" / name).mkdir(parents=True)
    assert sorted(run_folder.run_numbers()) == [1, 12, 1234]
    assert run_folder.numbered_run(7) == "runs/run_007"
    assert run_folder.numbered_run(1234) == "runs/run_1234"


def test_a_step_s_folder_name_is_eight_digits_and_reads_back():
    assert run_folder.step_name(300) == "step_00000300"
    assert run_folder.step_name(0) == "step_00000000"
    assert run_folder.step_of("runs/x/checkpoints/step_00000300") == 300
    assert run_folder.step_of(Path("step_00001234")) == 1234


def test_where_each_file_is_on_a_disk_and_for_a_run_on_object_storage():
    local = RunFolder("runs/x")
    assert local.root == "runs/x" and local.local == Path("runs/x")
    assert (local.on_bucket, local.shared) == (False, True)
    assert local.path("metrics") == Path("runs/x/metrics.jsonl")
    assert local.path("requeue_marker") == Path("runs/x/preempted.json")
    assert local.checkpoint(3) == Path("runs/x/checkpoints/step_00000003")
    assert RunFolder("runs/x", shared_filesystem=False).shared is False
    on_bucket = RunFolder("s3://bucket/run", "/stage", shared_filesystem=True)
    assert on_bucket.root == "s3://bucket/run" and on_bucket.local == Path("/stage")
    assert (on_bucket.on_bucket, on_bucket.shared) == (True, False)
    assert on_bucket.take_lease() is None and on_bucket.upload_run_files() is None


def test_the_staging_folder_is_the_one_given_or_named_after_the_url(monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", "/scratch")
    assert run_folder.staging_folder("s3://bucket/team/run", "/mine") == "/mine"
    assert run_folder.staging_folder("s3://bucket/team/run", "") == (
        "/scratch/train-staging/s3/bucket/team/run"
    )
    assert run_folder.staging_folder("gs://b", "") == "/scratch/train-staging/gs/b"


def test_only_step_folders_of_eight_digits_with_a_manifest_file_are_checkpoints(tmp_path):
    folder = RunFolder(str(tmp_path / "run"))
    assert folder.checkpoints() == [] and folder.newest() is None
    root = tmp_path / "run" / "checkpoints"
    for name in ("step_00000010", "step_00000002", "step_12", "step_00000003x"):
        (root / name).mkdir(parents=True)
        (root / name / "manifest.json").write_text("{}")
    (root / "step_00000005").mkdir()  # a crash mid-save: no manifest
    (root / "step_00000004" / "manifest.json").mkdir(parents=True)  # not a file
    (root / "other_00000007").mkdir()
    (root / "other_00000007" / "manifest.json").write_text("{}")
    assert folder.checkpoints() == [root / "step_00000002", root / "step_00000010"]
    assert folder.newest() == root / "step_00000010"


@pytest.fixture
def no_held_locks(monkeypatch):
    """This process holds no run folder's lock; the ones a test takes are let go after it."""
    held = []
    monkeypatch.setattr(run_folder, "_held_locks", held)
    yield held
    for lock in held:
        lock.close()


HOLDER = re.compile(
    rf"host {re.escape(os.uname().nodename)}, pid {os.getpid()}, "
    r"started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\n"
)


def test_the_lock_names_its_holder_and_a_second_job_is_refused_naming_it(tmp_path, no_held_locks):
    assert run_folder.held_run_folder() == ""
    path = tmp_path / "new" / "run"
    lock_file = path / ".lock"
    RunFolder(str(path)).lock()
    assert HOLDER.fullmatch(lock_file.read_text()), lock_file.read_text()
    assert run_folder.held_run_folder() == str(path)
    assert RunFolder(str(path)).try_lock()  # held already: not taken twice
    first = no_held_locks.pop()  # as if another process held it (its own open file)
    assert not RunFolder(str(path)).try_lock()
    with pytest.raises(ConfigError) as refused:
        RunFolder(str(path)).lock()
    first.close()
    assert str(refused.value) == (
        f"output_dir '{path}' is in use by another job ({lock_file.read_text().strip()}); wait "
        f"for it to end, or choose another output_dir"
    )


def test_a_lock_held_before_its_holder_wrote_its_name_says_so_and_a_stale_name_is_replaced(
    tmp_path, no_held_locks
):
    import fcntl

    path = tmp_path / "run"
    path.mkdir()
    (path / ".lock").write_text("host gone, pid 1, started long ago\nmore\n")
    RunFolder(str(path)).lock()  # nobody holds it: the stale line goes
    assert HOLDER.fullmatch((path / ".lock").read_text())
    other = tmp_path / "other"
    other.mkdir()
    with open(other / ".lock", "a+") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ConfigError) as refused:
            RunFolder(str(other)).lock()
    assert str(refused.value) == (
        f"output_dir '{other}' is in use by another job (a process that has not written its name "
        f"yet); wait for it to end, or choose another output_dir"
    )


def test_the_requeue_marker_records_the_stop_and_the_next_start_removes_it(tmp_path):
    folder = RunFolder(str(tmp_path / "a" / "run"))
    folder.mark_for_requeue(7, "SIGTERM", "runs/x/checkpoints/step_00000007")
    marker = tmp_path / "a" / "run" / "preempted.json"
    assert marker.read_text().endswith("}\n")
    assert json.loads(marker.read_text()) == {
        "step": 7,
        "signal": "SIGTERM",
        "checkpoint": "runs/x/checkpoints/step_00000007",
    }
    folder.clear_requeue_marker()
    assert not marker.exists()
    folder.clear_requeue_marker()  # nothing to remove: no error


def test_the_config_s_folder_and_a_marker_in_a_folder_that_exists(tmp_path):
    from types import SimpleNamespace

    cfg = SimpleNamespace(output_dir=str(tmp_path), staging_dir="", shared_filesystem=False)
    folder = RunFolder.of(cfg)
    assert (folder.local, folder.shared) == (tmp_path, False)  # each node its own disk
    folder.mark_for_requeue(3, "SIGUSR1", None)  # the run folder is there already
    assert json.loads((tmp_path / "preempted.json").read_text()) == {
        "step": 3,
        "signal": "SIGUSR1",
        "checkpoint": None,
    }
