"""Checkpoints on object storage, against a real S3 server (moto's, on 127.0.0.1, in this process):
the baseline's 2-process run with --output_dir s3://..., SIGKILLed while a checkpoint is being
uploaded, resumes on a "new pod" (an empty staging folder) from the previous checkpoint and ends
bitwise equal to the uninterrupted run; a damaged newest checkpoint on the bucket is skipped with a
warning; two launchers as two nodes, each staging on its own folder, killed together mid-upload and
restarted on empty ones. The optional install they need: pip install -r requirements-storage.txt."""

import json
import logging
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from test_resume import children_of
from test_two_node import accelerate_node, assert_same_run, finish, two_node_args

from conftest import (
    REPO,
    accelerate_cmd,
    assert_matches_baseline,
    base_env,
    baseline_args,
    free_port,
    launch_accelerate,
    run_python,
)

pytestmark = pytest.mark.slow
INSTALL = "pip install -r requirements-storage.txt"
pytest.importorskip("s3fs", reason=INSTALL)
moto_server = pytest.importorskip("moto.server", reason=INSTALL)
boto3 = pytest.importorskip("boto3", reason=INSTALL)
BUCKET = "runs"


class S3:
    """The server's address and credentials as a job's environment, and a client of it."""

    def __init__(self, endpoint: str):
        self.env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,
        }
        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def keys(self, prefix: str) -> list[str]:
        listed = self.client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
        return sorted(item["Key"] for item in listed.get("Contents", []))

    def steps(self, run: str) -> dict:
        """Each step folder of the run on the bucket, and whether it is committed (has a manifest)."""
        found = {}
        for key in self.keys(f"{run}/checkpoints/"):
            step = key.split("/")[2]
            found[step] = found.get(step, False) or key.endswith("/manifest.json")
        return found

    def download(self, run: str, names: list[str], folder: Path) -> Path:
        folder.mkdir(parents=True)
        for name in names:
            self.client.download_file(BUCKET, f"{run}/{name}", str(folder / name))
        return folder


@pytest.fixture(scope="module")
def s3():
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    store = S3(f"http://{host}:{port}")
    store.client.create_bucket(Bucket=BUCKET)
    yield store
    server.stop()


def start(cmd: list, env: dict) -> subprocess.Popen:
    """A launch left running (the test kills it mid-upload), its output collected."""
    return subprocess.Popen(
        [str(part) for part in cmd],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def descendants(pid: int) -> list[int]:
    found = []
    for child in children_of(pid):
        found += [child, *descendants(child)]
    return found


def hold_the_first_upload_of(prefix: str, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Make the server hold the first object PUT under `prefix` until released: the job is then
    mid-upload for as long as the test wants. Returns (arrived, release)."""
    from moto.s3.models import S3Backend

    arrived, release = threading.Event(), threading.Event()
    put_object = S3Backend.put_object

    def held(self, bucket_name, key_name, *args, **kwargs):
        if key_name.startswith(prefix) and not arrived.is_set():
            arrived.set()
            release.wait(timeout=120)
        return put_object(self, bucket_name, key_name, *args, **kwargs)

    monkeypatch.setattr(S3Backend, "put_object", held)
    return arrived, release


def test_a_run_on_s3_killed_mid_upload_resumes_bitwise_and_skips_a_damaged_checkpoint(
    s3, corpus, baseline, tmp_path, monkeypatch
):
    run = "killed"
    url = f"s3://{BUCKET}/{run}"
    env = base_env(tmp_path, **s3.env)
    arrived, release = hold_the_first_upload_of(f"{run}/checkpoints/step_00000016/", monkeypatch)
    args = [*baseline_args(url, corpus), "--staging_dir", tmp_path / "pod1"]
    with start(accelerate_cmd(args), env) as job:
        assert arrived.wait(timeout=180), "step 16's upload never started"
        # the whole job mid-upload, as a node's loss would: no process says goodbye (torch elastic
        # starts its workers in sessions of their own: each is killed by its pid)
        for pid in [*descendants(job.pid), job.pid]:
            os.kill(pid, signal.SIGKILL)
        output, _ = job.communicate(timeout=60)
    release.set()
    steps = s3.steps(run)
    assert steps["step_00000008"] is True, output[-3000:]
    assert steps["step_00000016"] is False  # some of its files, never its manifest

    # a new pod: an empty staging folder, everything from the bucket
    resumed = launch_accelerate(
        [*args[:-1], tmp_path / "pod2", "--resume", "latest"], tmp_path, env_extra=s3.env
    ).check()
    assert f"resume: {url}/checkpoints/step_00000008 (step 8)" in resumed.output
    downloaded = s3.download(run, ["model.safetensors", "metrics.jsonl"], tmp_path / "after_kill")
    assert_matches_baseline(downloaded, baseline)  # weights and every step's loss
    steps_logged = [row["step"] for row in map(json.loads, open(downloaded / "metrics.jsonl"))]
    assert [s for s in steps_logged if s % 12] == sorted(set(s for s in steps_logged if s % 12))
    # keep_last 2, and the unfinished step 16 replaced by the resumed run's own
    assert s3.steps(run) == {"step_00000016": True, "step_00000024": True}
    assert "launches" in json.loads(
        s3.client.get_object(Bucket=BUCKET, Key=f"{run}/run_info.json")["Body"].read()
    )

    # the newest checkpoint damaged on the bucket (one byte of its weights): skipped, with a warning
    key = f"{run}/checkpoints/step_00000024/model.safetensors"
    data = bytearray(s3.client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[-1] ^= 0xFF
    s3.client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    again = launch_accelerate(
        [*args[:-1], tmp_path / "pod3", "--resume", "latest"], tmp_path, env_extra=s3.env
    ).check()
    assert (
        f"warning: skipping damaged checkpoint {url}/checkpoints/step_00000024: model.safetensors "
        "does not match its checksum" in again.output
    )
    assert f"resume: {url}/checkpoints/step_00000016 (step 16)" in again.output
    redone = s3.download(run, ["model.safetensors", "metrics.jsonl"], tmp_path / "after_damage")
    assert_matches_baseline(redone, baseline)


def test_a_bucket_that_does_not_exist_is_one_line_before_any_process_starts(s3, tmp_path):
    result = run_python(["--output_dir", "s3://no-such-bucket/run"], tmp_path, env_extra=s3.env)
    assert result.returncode == 2
    assert result.output.strip().splitlines() == [
        "error: output_dir names a bucket that does not exist (or that these credentials cannot "
        "see) (got 's3://no-such-bucket/run')"
    ]


def test_two_nodes_each_staging_its_own_files_resume_from_the_bucket_after_both_die(
    s3, corpus, four_processes, tmp_path, monkeypatch
):
    """Two launchers as two nodes, each with its own staging folder (its own disk): every process
    uploads its own files, node 0's main process commits. Both nodes killed while step 8 uploads,
    then restarted on empty staging folders: each node's writer downloads step 4, and the run ends as
    the one-launcher run of 4 processes did."""
    run = "two-nodes"
    url = f"s3://{BUCKET}/{run}"
    arrived, release = hold_the_first_upload_of(f"{run}/checkpoints/step_00000008/", monkeypatch)
    env = base_env(tmp_path, **s3.env)

    def start_nodes(attempt: str, resume: list[str]):
        port = free_port()
        nodes = []
        for rank in (0, 1):
            staging = ["--staging_dir", str(tmp_path / f"{attempt}-node{rank}")]
            cmd = accelerate_node(rank, port, [*two_node_args(url, corpus), *staging, *resume])
            nodes.append(start(cmd, env))
        return nodes

    nodes = start_nodes("first", [])
    assert arrived.wait(timeout=180), "step 8's upload never started"
    for node in nodes:
        for pid in [*descendants(node.pid), node.pid]:
            os.kill(pid, signal.SIGKILL)
        node.communicate(timeout=60)
    release.set()
    assert s3.steps(run) == {"step_00000004": True, "step_00000008": False}

    outputs = finish(start_nodes("restarted", ["--resume", "latest"]))
    for rank, text in enumerate(outputs):
        assert "Traceback" not in text, f"node {rank}:\n{text[-3000:]}"
    assert f"resume: {url}/checkpoints/step_00000004 (step 4)" in outputs[0]
    manifest = json.loads(
        s3.client.get_object(Bucket=BUCKET, Key=f"{run}/checkpoints/step_00000008/manifest.json")[
            "Body"
        ].read()
    )
    assert {f"rng_rank{r}.pt" for r in range(4)} <= set(manifest["files"])
    downloaded = s3.download(run, ["model.safetensors", "metrics.jsonl"], tmp_path / "downloaded")
    assert_same_run(downloaded, four_processes, resumed=True)
