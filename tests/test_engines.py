"""The engines beyond SLURM, without a cluster: the Kubernetes (JobSet) and SkyPilot files parsed and checked for
what a restart needs, and scripts/torchrun_job.sh, the command both run on each node, with a fake torchrun: it
passes SIGTERM on as a container's first process must, and turns a stop into exit 75. The real trainings under
each engine's variables: tests/e2e/test_engine_runs.py. The Ray script's own check before Ray starts; its
run under Ray: tests/e2e/test_ray.py."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from conftest import REPO

JOBSET = REPO / "scripts" / "kubernetes" / "jobset.yaml"
SKYPILOT = REPO / "scripts" / "skypilot" / "train.yaml"
JOB_SCRIPT = REPO / "scripts" / "torchrun_job.sh"
STOP_CODE = 75  # job.StopSignals.PREEMPTED_EXIT_CODE


def pod_spec(manifest: dict) -> dict:
    return manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def container_env(container: dict) -> dict:
    """name -> value, or the downward-API field it comes from."""
    return {
        item["name"]: item.get("value") or item["valueFrom"].get("fieldRef", {}).get("fieldPath")
        for item in container["env"]
    }


def test_the_jobset_restarts_a_stopped_pod_without_counting_it_and_keeps_its_run_folder():
    manifest = yaml.safe_load(JOBSET.read_text())
    job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod = pod_spec(manifest)
    container = pod["containers"][0]
    env = container_env(container)
    # exit 75 and a disruption (eviction, a drained node) are replaced, not counted
    rules = job["podFailurePolicy"]["rules"]
    stop = next(rule for rule in rules if "onExitCodes" in rule)
    assert stop["action"] == "Ignore" and stop["onExitCodes"]["values"] == [STOP_CODE]
    assert stop["onExitCodes"]["containerName"] == container["name"]
    assert any(
        rule["action"] == "Ignore" and rule["onPodConditions"][0]["type"] == "DisruptionTarget"
        for rule in rules
        if "onPodConditions" in rule
    )
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy's condition
    assert manifest["spec"]["failurePolicy"]["maxRestarts"] >= 1
    # the job's shape: one pod per node, its index the node rank, node 0 the rendezvous
    assert job["completionMode"] == "Indexed"
    assert job["parallelism"] == job["completions"] == int(env["PET_NNODES"])
    assert env["PET_NODE_RANK"].endswith("['batch.kubernetes.io/job-completion-index']")
    assert env["PET_MASTER_ADDR"] == "$(JOB_NAME)-node-0-0.$(JOB_NAME)"
    assert manifest["spec"]["network"]["enableDNSHostnames"]
    assert int(env["PET_NPROC_PER_NODE"]) == container["resources"]["limits"]["nvidia.com/gpu"]
    # the run folder and the W&B run id: the job's name, the same at every restart
    assert env["JOB_NAME"] == "metadata.labels['jobset.sigs.k8s.io/jobset-name']"
    assert env["OUTPUT_DIR"] == "/runs/$(JOB_NAME)" and env["WANDB_RUN_ID"] == "$(JOB_NAME)"
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert mounts["runs"] == "/runs" and "persistentVolumeClaim" in volumes["runs"]
    assert mounts["dshm"] == "/dev/shm" and volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    # the job script, given the run's own arguments; a grace period for the stop's checkpoint
    assert container["command"] == ["scripts/torchrun_job.sh"]
    assert "--config" in container["args"]
    assert pod["terminationGracePeriodSeconds"] >= 120
    # torchrun SIGKILLs its workers this long after passing SIGTERM on: inside the grace period
    script = JOB_SCRIPT.read_text()
    shutdown = re.search(r"TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-(\d+)", script)
    assert shutdown and 60 <= int(shutdown.group(1)) < pod["terminationGracePeriodSeconds"]


def test_the_skypilot_task_maps_its_variables_to_torchrun_s_and_recovers_a_stop():
    task = yaml.safe_load(SKYPILOT.read_text())
    recovery = task["resources"]["job_recovery"]
    assert STOP_CODE in recovery["recover_on_exit_codes"]
    assert recovery["max_restarts_on_errors"] >= 1
    run = task["run"]
    for pet, sky in [
        ("PET_NNODES", "$SKYPILOT_NUM_NODES"),
        ("PET_NODE_RANK", "$SKYPILOT_NODE_RANK"),
        ("PET_NPROC_PER_NODE", "$SKYPILOT_NUM_GPUS_PER_NODE"),
    ]:
        assert f"export {pet}={sky}\n" in run
    assert 'export PET_MASTER_ADDR=$(echo "$SKYPILOT_NODE_IPS" | head -n1)' in run
    # the managed job's id is the same across its recoveries: the run folder and the W&B run
    assert "export OUTPUT_DIR=$RUNS/$SKYPILOT_TASK_ID" in run
    assert "export WANDB_RUN_ID=$SKYPILOT_TASK_ID" in run
    assert re.search(r"^exec scripts/torchrun_job\.sh ", run, re.MULTILINE)
    assert task["num_nodes"] == 2 and task["workdir"] == "."


FAKE_TORCHRUN = """#!/bin/bash
# a torchrun that records its arguments and stands in for a training: on SIGTERM it "saves" (writes
# preempted.json, as the run does) and exits 1, as torchrun does whatever its workers' codes
echo "$@" > "$FAKE_LOG"
echo "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT" > "$FAKE_LOG.shutdown_timeout"
trap 'sleep 0.3; echo "{}" > "${MARKER_DIR:-$OUTPUT_DIR}/preempted.json"; exit 1' TERM
touch "$FAKE_LOG.started"
while true; do sleep 0.05; done
"""


@pytest.fixture
def fake_torchrun(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(FAKE_TORCHRUN)
    (bin_dir / "torchrun").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_LOG": str(tmp_path / "torchrun.log"),
        "OUTPUT_DIR": str(tmp_path / "run"),
    }
    (tmp_path / "run").mkdir()
    return env, tmp_path


def start_job(env, *args):
    return subprocess.Popen(
        [str(JOB_SCRIPT), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def wait_for(path, timeout=10):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_the_job_script_passes_sigterm_on_and_a_stop_exits_75(fake_torchrun):
    """As a container's process 1 would be signalled: only the script gets SIGTERM. torchrun gets it
    too, the run folder and --resume latest come first, and the stop (preempted.json) is exit 75."""
    env, tmp_path = fake_torchrun
    job = start_job(env, "--config", "train/configs/tiny.yaml")
    wait_for(tmp_path / "torchrun.log.started")
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=10) == STOP_CODE, job.stdout.read()
    args = (tmp_path / "torchrun.log").read_text().split()
    assert args == [
        "--rdzv-conf",
        "timeout=600",  # RDZV_TIMEOUT_S's default: torchrun's rendezvous gives up then
        "train/main.py",
        "--output_dir",
        env["OUTPUT_DIR"],
        "--resume",
        "latest",
        "--config",
        "train/configs/tiny.yaml",
    ]
    # the stop's time reaches torchrun itself, in its environment (it SIGKILLs the workers after it)
    assert (tmp_path / "torchrun.log.shutdown_timeout").read_text().strip() == "270"


def test_the_job_script_keeps_torchrun_s_code_when_the_run_did_not_stop_on_a_signal(fake_torchrun):
    env, tmp_path = fake_torchrun
    (tmp_path / "bin" / "torchrun").write_text("#!/bin/bash\nexit 1\n")
    assert start_job(env).wait(timeout=10) == 1
    (tmp_path / "bin" / "torchrun").write_text("#!/bin/bash\nexit 0\n")
    assert start_job(env).wait(timeout=10) == 0
    without_folder = {k: v for k, v in env.items() if k != "OUTPUT_DIR"}
    job = start_job(without_folder)
    assert job.wait(timeout=10) != 0
    assert b"set OUTPUT_DIR to the run folder" in job.stdout.read()


def test_on_object_storage_the_job_script_stages_on_the_node_and_finds_the_stop_there(
    fake_torchrun,
):
    """OUTPUT_DIR a bucket's URL: the run is written in STAGING_DIR first (train/storage.py), where a
    stop's preempted.json is, so a stop is still exit 75."""
    env, tmp_path = fake_torchrun
    staging = tmp_path / "staging"
    staging.mkdir()
    env = {
        **env,
        "OUTPUT_DIR": "s3://bucket/run",
        "STAGING_DIR": str(staging),
        "MARKER_DIR": str(staging),
    }
    job = start_job(env)
    wait_for(tmp_path / "torchrun.log.started")
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=10) == STOP_CODE, job.stdout.read()
    args = (tmp_path / "torchrun.log").read_text().split()
    assert args[2:7] == [
        "train/main.py",
        "--output_dir",
        "s3://bucket/run",
        "--staging_dir",
        str(staging),
    ]


def test_on_object_storage_a_stop_that_torchrun_reports_as_1_is_75_from_the_staging_folder(
    fake_torchrun,
):
    """torchrun ends with 1 whatever its workers said; a stop it passed on (the workers' own
    SIGTERM, not the script's: stopped_on stays empty) leaves preempted.json in STAGING_DIR when
    OUTPUT_DIR is a bucket's URL, never in OUTPUT_DIR (s3://... is no local path). Exit 75, as the
    engines are told to restart on."""
    env, tmp_path = fake_torchrun
    staging = tmp_path / "staging"
    staging.mkdir()
    (tmp_path / "bin" / "torchrun").write_text(
        '#!/bin/bash\necho "{}" > "$STAGING_DIR/preempted.json"\nexit 1\n'
    )
    env = {**env, "OUTPUT_DIR": "s3://bucket/run", "STAGING_DIR": str(staging)}
    job = start_job(env)
    assert job.wait(timeout=20) == STOP_CODE, job.stdout.read()
    assert (staging / "preempted.json").exists()


def test_the_rendezvous_watcher_counts_every_node_s_key_the_last_one_included(tmp_path):
    """scripts/rendezvous.py on node 2 of 3, against a store standing in for torchrun's on node 0:
    with node 0's key set by hand and node 2's by the watcher, 2 of 3 have joined (node 1 is the one
    missing); once node 1's key is set, 3 of 3, and the watcher ends."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    address = f"127.0.0.1:{store.port}"
    store.set("torchrun_job/joined/0", "1")
    state = tmp_path / "rendezvous"
    env = {
        **os.environ,
        "PET_NNODES": "3",
        "PET_NODE_RANK": "2",
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(store.port),
        "RDZV_TIMEOUT_S": "60",
    }
    watcher = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "rendezvous.py"), str(state)],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    try:

        def says(expected: str) -> bool:
            deadline = time.monotonic() + 10  # counted every second
            while time.monotonic() < deadline:
                if state.exists() and state.read_text() == expected:
                    return True
                time.sleep(0.05)
            return False

        assert says(f"2 3 {address}\n"), state.read_text()
        store.set("torchrun_job/joined/1", "1")
        assert watcher.wait(timeout=10) == 0
        assert state.read_text() == f"3 3 {address}\n"
    finally:
        watcher.kill()
        watcher.wait()


def test_the_ray_script_refuses_a_bad_flag_in_one_line_before_ray_starts(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "ray" / "train.py"), "--", "--lr", "-1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: lr must be > 0 (got -1.0)"]
