"""Checkpoints and exact resume under real failures, against the uninterrupted baseline run.

Every scenario interrupts a 2-process `accelerate launch` run with the baseline's config, relaunches
it with `--resume latest`, and requires the final weights to be bitwise equal to the baseline's and
every logged loss to match. Faults come from tests/helpers/faulty_main.py, never from shipped code.
"""

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import (
    FAULTY_MAIN,
    accelerate_cmd,
    assert_matches_baseline,
    base_env,
    baseline_args,
    launch_accelerate,
    read_metrics,
    run_python,
    tiny_args,
    torchrun_cmd,
)

pytestmark = pytest.mark.slow


def resume(run_dir, corpus, tmp_path):
    return launch_accelerate(
        [*baseline_args(run_dir, corpus), "--resume", "latest"], tmp_path
    ).check()


def test_keep_last_and_layout_of_the_baseline(baseline):
    root = baseline.output_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [
        "step_00000016",
        "step_00000024",
    ]  # keep_last 2 of 8/16/24
    manifest = json.loads((root / "step_00000024" / "manifest.json").read_text())
    assert {
        "model.safetensors",
        "optimizer.pt",
        "rng_rank0.pt",
        "rng_rank1.pt",
        "train_state.json",
        "data.json",
        "config.yaml",
    } == set(manifest["files"])
    state = json.loads((root / "step_00000024" / "train_state.json").read_text())
    assert (state["step"], manifest["run"]["world_size"], manifest["run"]["global_batch"]) == (
        24,
        2,
        16,
    )
    position = json.loads((root / "step_00000024" / "data.json").read_text())
    assert position == {
        "micro_batches": 24 * 2,
        "samples_per_micro_batch": 8,
    }  # 2 ranks x 4, 2 micro-steps a step


def launch_in_background(cmd: list[str], env: dict) -> subprocess.Popen:
    """A launch in a session of its own, as a scheduler starts a job: its group is the job's to signal."""
    return subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )


def signal_at_step(job: subprocess.Popen, run_dir, step: int, signum: int) -> tuple[str, float]:
    """Once `step` is logged, send `signum` to the job's process group; returns its output and how long it
    took to end after the signal."""
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (run_dir / "metrics.jsonl").exists():
            time.sleep(0.2)
        while time.time() < deadline and len(losses_logged(run_dir)) < step:
            time.sleep(0.05)
        os.killpg(job.pid, signum)
        signalled = time.time()
        output, _ = job.communicate(timeout=60)
        return output, time.time() - signalled
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


# one launcher each (the stops are the same code on both paths, stopping.py): this test accelerate's and
# main.py's, the kill -9 below torchrun's and the torch path's
def test_sigterm_to_the_launcher_with_loader_workers_checkpoints_and_resumes_exactly(
    tmp_path, corpus, baseline
):
    """What SLURM or Kubernetes does to a job, on the setting GPU jobs use (DataLoader workers): SIGTERM to
    the launcher's process group. Torch elastic passes it on to each worker's process group, loader workers
    included; they leave it to their training process, which checkpoints at the next logging step and exits
    75, and the run resumes bitwise (accelerate launch, main.py)."""
    run_dir = tmp_path / "run"
    args = baseline_args(run_dir, corpus, num_workers=2)
    env = base_env(tmp_path, RECORD_EXIT=tmp_path / "exits")
    cmd = accelerate_cmd(args, script=FAULTY_MAIN)
    output, took = signal_at_step(launch_in_background(cmd, env), run_dir, 5, signal.SIGTERM)
    # inside torch elastic's 30 s before it SIGKILLs workers
    assert took < 25, f"took {took:.1f}s to stop"
    assert "DataLoader worker" not in output and "[rank" not in output, output[-3000:]
    exits = {p.name: json.loads(p.read_text()) for p in (tmp_path / "exits").iterdir()}
    assert exits == {"rank0.json": 75, "rank1.json": 75}, output[-3000:]
    marker = json.loads((run_dir / "preempted.json").read_text())
    assert 5 <= marker["step"] < 24, output[-2000:]
    assert (run_dir / "checkpoints" / f"step_{marker['step']:08d}" / "manifest.json").exists()
    resume_args = [*args, "--resume", "latest"]
    resumed = launch_accelerate(resume_args, tmp_path).check()
    assert f"(step {marker['step']})" in resumed.output
    assert not (run_dir / "preempted.json").exists()  # the requeued run clears the marker
    launches = json.loads((run_dir / "run_info.json").read_text())["launches"]
    assert (
        len(launches) == 2 and launches[0]["started"] <= launches[1]["started"]
    )  # the first one kept
    assert "--resume" not in launches[0]["command"] and "--resume" in launches[1]["command"]
    assert_matches_baseline(run_dir, baseline)


def losses_logged(run_dir) -> list[dict]:
    return [row for row in read_metrics(run_dir) if "loss" in row]


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid` (read from /proc)."""
    children = []
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                fields = open(f"/proc/{stat}/stat").read().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            if int(fields[1]) == pid:
                children.append(int(stat))
    return children


def session_of(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[3])


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited: only its exit status is left


def test_a_launcher_killed_with_kill_9_leaves_no_worker_and_the_run_resumes_exactly(
    tmp_path, corpus, baseline
):
    """kill -9 of the launcher's whole process group (an OOM kill, a lost terminal), here torchrun
    running the torch path (resumed by accelerate launch, bitwise all the same): torch elastic starts
    each worker in a session of its own, so the workers survive it. They notice within a second that their
    launcher is gone, stop together at the next logging step with a checkpoint, and exit, freeing the run
    folder; the next --resume latest continues bitwise."""
    run_dir = tmp_path / "run"
    # 24 steps of a second: orphans would run 20 s more
    env = base_env(tmp_path, FAULT_SLOW_S=1.0)
    cmd = torchrun_cmd(baseline_args(run_dir, corpus), script=FAULTY_MAIN)
    env["FAULTY_ENTRY"] = "torch_ddp"
    launcher = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    workers = []
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (run_dir / "metrics.jsonl").exists():
            time.sleep(0.2)
        while time.time() < deadline and len(losses_logged(run_dir)) < 4:
            time.sleep(0.05)
        workers = children_of(launcher.pid)
        assert len(workers) == 2 and all(session_of(w) != launcher.pid for w in workers), workers
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher's group: not the workers' sessions
        killed = time.time()
        while time.time() - killed < 30 and any(alive(w) for w in workers):
            time.sleep(0.1)
        took = time.time() - killed
        output, _ = launcher.communicate(
            timeout=30
        )  # the workers held its output open until they ended
    finally:
        for worker in workers:
            if alive(worker):
                os.kill(worker, signal.SIGKILL)
    assert not any(alive(w) for w in workers) and took < 8, f"workers still alive after {took:.1f}s"
    assert "on the launcher's exit, checkpoint saved" in output, output[-2000:]
    marker = json.loads((run_dir / "preempted.json").read_text())
    assert 4 <= marker["step"] < 24, marker
    resumed = resume(run_dir, corpus, tmp_path)  # the lock was freed with the workers
    assert f"(step {marker['step']})" in resumed.output
    assert_matches_baseline(run_dir, baseline)


def test_sigusr1_without_a_launcher_exits_75_after_a_checkpoint(tmp_path, corpus):
    """Also: a stop inside a --profile_steps window writes the trace of the steps it recorded."""
    run_dir = tmp_path / "run"
    stopped = run_python(
        tiny_args(run_dir, corpus, max_steps=12, save_every=0, profile_steps="4:8"),
        tmp_path,
        script=FAULTY_MAIN,
        env_extra={"FAULT_STEP": 5, "FAULT_ACTION": "sigusr1"},
    )
    assert stopped.returncode == 75, stopped.tail()
    assert json.loads((run_dir / "preempted.json").read_text())["signal"] == "SIGUSR1"
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000005"]
    assert not (run_dir / "model.safetensors").exists()  # stopped, not finished
    trace = json.loads((run_dir / "profile" / "rank0.steps_4-5.pt.trace.json").read_text())
    spans = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("train step ")}
    assert {"train step 4", "train step 5"} <= spans, spans


def test_resume_into_a_different_model_is_a_one_line_error(tmp_path, corpus, baseline):
    """(A different world size or batch geometry is refused the same way: tests/test_checkpoint.py.)"""
    checkpoint = baseline.output_dir / "checkpoints" / "step_00000016"
    # one process, the baseline's global batch
    wider = run_python(
        [*baseline_args(tmp_path / "a", corpus, n_embd=96, batch_size=8), "--resume", checkpoint],
        tmp_path,
    )
    assert wider.returncode != 0
    errors = [line for line in wider.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "does not fit this model" in errors[0], wider.tail()


def samples_per_step(ids_dir, world, batch, accum, steps):
    """The sorted sample indices of each optimizer step, from what every rank loaded (in order; a loader's
    read-ahead adds a few at the end, beyond the last step)."""
    drawn = [json.loads((ids_dir / f"rank{r}.json").read_text()) for r in range(world)]
    return [
        sorted(i for rank in drawn for i in rank[k * accum * batch : (k + 1) * accum * batch])
        for k in range(steps)
    ]


def test_a_resume_on_another_world_size_trains_on_the_same_samples(
    tmp_path, corpus, four_processes
):
    """Saved by 4 processes x batch 4; resumed by 2 x 8 (Accelerate), and by 1 x 8 with 2 accumulation steps
    (the torch path): every later step trains on exactly the uninterrupted run's samples, and the losses
    agree to float-summation tolerance (not bitwise: the gradient sums run over other groupings)."""
    common = dict(max_steps=8, save_every=4, eval_every=8)
    expected = samples_per_step(four_processes.output_dir.parent / "ids", 4, 4, 1, 8)[4:]
    checkpoint = four_processes.output_dir / "checkpoints" / "step_00000004"
    two = launch_accelerate(
        [*tiny_args(tmp_path / "two", corpus, batch_size=8, **common), "--resume", checkpoint],
        tmp_path,
        script=FAULTY_MAIN,
        env_extra={"RECORD_SAMPLES": tmp_path / "two_ids"},
    ).check()
    one = run_python(
        [
            *tiny_args(tmp_path / "one", corpus, batch_size=8, grad_accum_steps=2, **common),
            "--resume",
            checkpoint,
        ],
        tmp_path,
        script=FAULTY_MAIN,
        env_extra={"RECORD_SAMPLES": tmp_path / "one_ids", "FAULTY_ENTRY": "torch_ddp"},
    ).check()
    assert "world_size 4 -> 2, batch_size 4 -> 8: the same global batch" in two.output
    assert "world_size 4 -> 1, batch_size 4 -> 8, grad_accum_steps 1 -> 2" in one.output
    assert samples_per_step(tmp_path / "two_ids", 2, 8, 1, 4) == expected
    assert samples_per_step(tmp_path / "one_ids", 1, 8, 2, 4) == expected
    for run in (two, one):
        losses = run.losses()
        assert sorted(losses) == list(range(5, 9))
        for step, loss in losses.items():
            assert loss == pytest.approx(four_processes.losses()[step], rel=1e-5), (
                step,
                run.output_dir,
            )
