"""The engines' contracts on loopback, with the commands their files run (scripts/kubernetes/jobset.yaml,
scripts/skypilot/train.yaml): two Kubernetes "pods", each running scripts/torchrun_job.sh as its process 1 with
the variables the JobSet gives it (torchrun reads PET_*, as under a Kubeflow TrainJob), and two SkyPilot
"nodes" running the task's own `run` script with SkyPilot's variables. What cannot run here: the engines
themselves (no cluster), their DNS (the rendezvous is 127.0.0.1), GPUs (1 CPU process per node)."""

import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest
import yaml
from test_two_node import finish

from conftest import REPO, base_env, free_port, load_weights, read_metrics, tiny_args

pytestmark = pytest.mark.slow

JOBSET = REPO / "scripts" / "kubernetes" / "jobset.yaml"
SKYPILOT = REPO / "scripts" / "skypilot" / "train.yaml"
JOB = "test-job"
# 12 steps after the step-4 checkpoint: the test's SIGTERM reaches the ranks before the run ends, even
# on a loaded machine (with 8 steps, a run once finished before the signal came)
STEPS = dict(max_steps=16, save_every=4, eval_every=8, dist_timeout_s=60)


def run_args(corpus, tmp_path) -> list[str]:
    """The run's own arguments (the job script adds --output_dir and --resume latest)."""
    args = [str(a) for a in tiny_args(tmp_path / "unused", corpus, **STEPS)]
    at = args.index("--output_dir")
    return args[:at] + args[at + 2 :]


def pod_env(tmp_path, node_rank: int, port: int) -> dict:
    """A pod's variables as the JobSet gives them: the downward API's job name and completion index,
    $(VAR) expanded in order, as the kubelet does; /runs is the test's folder, the rendezvous
    127.0.0.1 (no cluster DNS), 1 process per node (no GPUs)."""
    container = yaml.safe_load(JOBSET.read_text())
    container = container["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    container = container["containers"][0]
    env = base_env(tmp_path)
    for item in container["env"]:
        source = item.get("valueFrom", {})
        if "secretKeyRef" in source:
            continue
        field = source.get("fieldRef", {}).get("fieldPath", "")
        if "jobset-name" in field:
            value = JOB
        elif "job-completion-index" in field:
            value = str(node_rank)
        else:
            value = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], item["value"])
        env[item["name"]] = value.replace("/runs", str(tmp_path / "runs"))
    env.update(PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(port), PET_NPROC_PER_NODE="1")
    env["HF_HOME"] = base_env(tmp_path)["HF_HOME"]  # the session's, with its prepared data
    return env


def start_pods(tmp_path, corpus) -> list[subprocess.Popen]:
    port = free_port()
    command = [str(REPO / "scripts" / "torchrun_job.sh"), *run_args(corpus, tmp_path)]
    return [
        subprocess.Popen(
            command,
            cwd=REPO,
            env=pod_env(tmp_path, rank, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]


def same_run(run_dir, reference) -> None:
    losses = {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}
    expected = {r["step"]: r["loss"] for r in read_metrics(reference) if "loss" in r}
    assert sorted(losses) == list(range(1, STEPS["max_steps"] + 1)) and losses == expected
    weights, reference_weights = (
        load_weights(run_dir / "model.safetensors"),
        load_weights(reference / "model.safetensors"),
    )
    assert all((weights[k] == reference_weights[k]).all() for k in reference_weights)


def test_kubernetes_pods_train_as_one_job_and_a_stopped_pod_s_restart_resumes_bitwise(
    tmp_path, corpus
):
    """Two pods make one world of 2 (run folder /runs/<job name>, W&B run id the job's name). Then
    the same job again, and SIGTERM to pod 1's process 1 after the step-4 checkpoint (an eviction):
    every rank stops at the next logging step with a checkpoint, both pods exit 75 (the code the
    JobSet replaces a pod on without counting a failure), and the pods started again with the same
    command resume: the losses and weights of the uninterrupted job, bitwise."""
    whole = tmp_path / "whole"
    outputs = finish(start_pods(whole, corpus))
    reference = whole / "runs" / JOB
    assert (reference / "model.safetensors").exists(), outputs[0][-3000:]
    info = (reference / "run_info.json").read_text()
    assert '"processes": 2' in info and '"PET_NNODES": "2"' in info

    stopped = tmp_path / "stopped"
    pods = start_pods(stopped, corpus)
    run_dir = stopped / "runs" / JOB
    deadline = time.time() + 180
    while not (run_dir / "checkpoints" / "step_00000004" / "manifest.json").exists():
        assert time.time() < deadline and all(pod.poll() is None for pod in pods)
        time.sleep(0.1)
    pods[1].send_signal(signal.SIGTERM)  # the kubelet signals the container's process 1 only
    outputs = finish(pods)
    assert [pod.returncode for pod in pods] == [75, 75], outputs[1][-3000:]
    assert (run_dir / "preempted.json").exists()
    outputs = finish(start_pods(stopped, corpus))
    assert "resume: " in outputs[0], outputs[0][-3000:]
    assert not (run_dir / "preempted.json").exists()
    same_run(run_dir, reference)
    # the tracker run (W&B's id): the job's name, from the first start on (WANDB_RUN_ID)
    states = sorted((run_dir / "checkpoints").glob("step_*/train_state.json"))
    assert states and {json.loads(s.read_text())["tracker_run_id"] for s in states} == {JOB}


def test_skypilot_nodes_run_the_task_s_own_script_and_train_as_one_job(tmp_path, corpus):
    """The task's `run` script on two "nodes" with SkyPilot's variables (its envs: the test's run
    arguments and folder): one world of 2, the run folder named by SKYPILOT_TASK_ID, and the same
    losses and weights as the 2 Kubernetes pods, bitwise."""
    task = yaml.safe_load(SKYPILOT.read_text())
    port = free_port()
    nodes = []
    for rank in (0, 1):
        env = base_env(tmp_path)
        env.update({key: str(value) for key, value in task["envs"].items()})
        env.update(
            SKYPILOT_NUM_NODES="2",
            SKYPILOT_NODE_RANK=str(rank),
            SKYPILOT_NUM_GPUS_PER_NODE="1",  # CPU: one process per node
            SKYPILOT_NODE_IPS="127.0.0.1\n127.0.0.1",
            SKYPILOT_TASK_ID="sky-managed-test_1-0",
            MASTER_PORT=str(port),
            RUNS=str(tmp_path / "runs"),
            CONFIG=str(REPO / "train" / "configs" / "tiny.yaml"),
            TRAIN_ARGS=" ".join(run_args(corpus, tmp_path)[2:]),  # after --config tiny.yaml
        )
        nodes.append(
            subprocess.Popen(
                ["bash", "-c", task["run"]],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    outputs = finish(nodes)
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:]
    run_dir = tmp_path / "runs" / "sky-managed-test_1-0"
    kubernetes = tmp_path / "kubernetes"
    finish(start_pods(kubernetes, corpus))
    same_run(run_dir, kubernetes / "runs" / JOB)
    assert os.path.exists(run_dir / "checkpoints" / f"step_{STEPS['max_steps']:08d}")


@pytest.mark.parametrize("present", [0, 1])
def test_a_node_that_never_joins_is_said_while_waiting_and_in_one_line_at_the_timeout(
    tmp_path, corpus, present
):
    """Pod `present` starts, its peer never does: while torchrun waits, the job script says how many
    nodes joined, of how many (the main node's own pod, or none where the main node is the missing
    one); at RDZV_TIMEOUT_S one `error:` line, exit 1. Before: nothing for torch's whole wait."""
    port = free_port()
    env = {**pod_env(tmp_path, present, port), "RDZV_TIMEOUT_S": "9"}
    command = [str(REPO / "scripts" / "torchrun_job.sh"), *run_args(corpus, tmp_path)]
    started = time.monotonic()
    done = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    took = time.monotonic() - started
    lines = done.stderr.splitlines() + done.stdout.splitlines()
    joined = 1 - present  # node 0's own watcher reaches its store; node 1's reaches nothing
    waiting = [line for line in lines if line.startswith("waiting for the job's nodes")]
    assert waiting and all(
        f": {joined} of 2 joined at 127.0.0.1:{port} (this is node {present};" in line
        for line in waiting
    ), done.stderr[-3000:]
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == [
        f"error: the job's nodes never all joined: {joined} of 2 reached 127.0.0.1:{port} within "
        "RDZV_TIMEOUT_S=9 s; start the missing ones (or check PET_MASTER_ADDR and PET_MASTER_PORT), "
        "then restart the job"
    ], done.stderr[-3000:]
    assert done.returncode == 1
    assert took < 60, f"{took:.0f} s"


def test_a_stop_while_waiting_for_a_node_is_one_line_that_says_so_and_exit_75(tmp_path, corpus):
    """Pod 0 starts, its peer never does, and the kubelet's SIGTERM comes while torchrun waits for it
    (the pod evicted, the job cancelled): one `error:` line saying that the job was stopped while
    waiting, how many nodes had joined and after how long (the test's own clock), and exit 75 like
    any stop. Before: the timeout's line ("within RDZV_TIMEOUT_S=600 s" after a few seconds), exit 1."""
    port = free_port()
    command = [str(REPO / "scripts" / "torchrun_job.sh"), *run_args(corpus, tmp_path)]
    started = time.monotonic()
    pod = subprocess.Popen(
        command,
        cwd=REPO,
        env=pod_env(tmp_path, 0, port),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(pod.stdout), daemon=True)
    reader.start()
    deadline = started + 60
    while not any(line.startswith("waiting for the job's nodes: 1 of 2") for line in lines):
        assert time.monotonic() < deadline and pod.poll() is None, "".join(lines)[-3000:]
        time.sleep(0.1)
    time.sleep(3)  # torchrun waiting a while, far from its RDZV_TIMEOUT_S (600 s)
    pod.send_signal(signal.SIGTERM)  # the kubelet signals the container's process 1 only
    waited = time.monotonic() - started
    assert pod.wait(timeout=60) == 75, "".join(lines)[-3000:]
    reader.join(timeout=10)
    errors = [line.rstrip("\n") for line in lines if line.startswith("error:")]
    assert len(errors) == 1, "".join(lines)[-3000:]
    said = re.fullmatch(
        rf"error: stopped on SIGTERM while waiting for the job's nodes: 1 of 2 had joined at "
        rf"127\.0\.0\.1:{port} after (\d+) s \(this is node 0\); nothing trained yet",
        errors[0],
    )
    assert said, errors[0]
    assert abs(int(said.group(1)) - waited) <= 2, (errors[0], waited)
