"""What a person sees under the headline command, through scripts/launch.py (accelerate launch as a child):
a refused input is its one `error:` line and exit 2, SIGTERM a checkpoint and exit 75, Ctrl-C (SIGINT to the
terminal's whole process group) a checkpoint and exit 130, and no launcher traceback or summary in any of
them. Under bare `accelerate launch` the workers do the same, and the launcher says 1 (README). Killed
with its reader (a sweep's driver's process group), the workers checkpoint and go."""

import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
from test_resume import alive, children_of

from conftest import FAULTY_MAIN, REPO, base_env, read_metrics, tiny_args

pytestmark = pytest.mark.slow
LAUNCH = [sys.executable, str(REPO / "scripts" / "launch.py"), "--config_file"]
LAUNCH += [str(REPO / "accelerate_configs" / "cpu.yaml"), str(REPO / "train" / "main.py")]


def test_a_refused_input_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run(
        [*LAUNCH, "--lr", "-1"],
        cwd=REPO,
        env=base_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2, said
    assert said == ["error: lr must be > 0 (got -1.0)"]


@pytest.mark.parametrize(
    "stop, code", [(signal.SIGTERM, 75), (signal.SIGUSR1, 75), (signal.SIGINT, 130)]
)
def test_a_stop_is_a_checkpoint_and_the_job_s_own_code_with_no_launcher_traceback(
    tmp_path, corpus, stop, code
):
    out = tmp_path / "run"
    # SIGTERM's run is continued below with the command it prints: a horizon it reaches in seconds,
    # far enough that the signal always comes first
    max_steps = 120 if stop == signal.SIGTERM else 2000
    args = tiny_args(out, corpus, max_steps=max_steps, save_every=1000, eval_every=50)
    job = subprocess.Popen(
        [*LAUNCH, *map(str, args)],
        cwd=REPO,
        env=base_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").exists() or len(read_metrics(out)) < 3:
        assert time.monotonic() < deadline and job.poll() is None, "the job never trained"
        time.sleep(0.1)
    if stop == signal.SIGINT:
        os.killpg(job.pid, stop)  # Ctrl-C: the terminal signals its whole foreground group
    else:
        job.send_signal(stop)  # a scheduler's SIGTERM or SIGUSR1, to the command it started
    output, _ = job.communicate(timeout=120)
    assert job.returncode == code, output[-3000:]
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-3000:]
    name = stop.name
    # the command to continue names the launcher it was started with, and no --config: the run's
    # own config.yaml is where a resume starts from
    said = f"on {name}, checkpoint saved: continue with "
    continue_with = next(line for line in output.splitlines() if said in line).split(said)[1]
    launched_as = ["python", *LAUNCH[1:]]  # as a person types it
    assert continue_with == shlex.join(
        [*launched_as, "--output_dir", str(out), "--resume", "latest"]
    )
    # the checkpoint is the step it stopped at
    stopped_at = max(row["step"] for row in read_metrics(out))
    newest = sorted(p.name for p in (out / "checkpoints").iterdir())[-1]
    assert newest == f"step_{stopped_at:08d}", output[-3000:]
    # a scheduler's SIGTERM or SIGUSR1 (SLURM's --signal) is a preemption to requeue; Ctrl-C is not
    assert (out / "preempted.json").exists() == (stop != signal.SIGINT)
    if stop == signal.SIGTERM:
        every_printed_command_works_when_pasted(continue_with, out, tmp_path, stopped_at)


def every_printed_command_works_when_pasted(continue_with, out, tmp_path, stopped_at):
    """The stop line's command, then the summary's commands, each run as printed: the first ends
    the run at its max_steps (the preset's block_size and the run's flags from its config.yaml), the
    second trains on to twice that with the cosine stretched to the new horizon."""
    resumed = paste(continue_with, tmp_path)
    assert f"done: step 120 (this start: steps {stopped_at + 1}-120 in " in resumed, resumed[-3000:]
    # the summary's other commands, as printed: the curves drawn, text written from the export
    curves = next(line for line in resumed.splitlines() if line.startswith("curves: "))
    assert "wrote " in paste(curves.split(": ", 1)[1], tmp_path)
    samples = next(line for line in resumed.splitlines() if line.startswith("samples: "))
    assert paste(samples.split(": ", 1)[1], tmp_path).strip()
    train_on = next(
        line for line in resumed.splitlines() if line.startswith("train on to step 240")
    )
    trained_on = paste(train_on.split(": ", 1)[1], tmp_path)
    # its summary's best evaluation is the run's, over its starts (steps 50, 100, 120 before this one)
    losses = {row["step"]: row["eval_loss"] for row in read_metrics(out) if "eval_loss" in row}
    assert sorted(losses) == [50, 100, 120, 150, 200, 240]
    best_step = min(losses, key=losses.get)
    assert f"best eval_loss: {losses[best_step]:.4g} at step {best_step}" in trained_on
    lrs = {row["step"]: row["lr"] for row in read_metrics(out) if "lr" in row}
    assert max(lrs) == 240
    # tiny.yaml's lr 3e-3 and min_lr 3e-4, warmup_steps 4 (tiny_args): cosine over 240 steps from 120 on
    for step in (121, 180, 239):
        progress = (step - 1 - 4) / (240 - 4)  # set_lr at the update that makes step `step`
        expected = 3e-4 + 0.5 * (3e-3 - 3e-4) * (1 + math.cos(math.pi * progress))
        assert lrs[step] == pytest.approx(expected, rel=1e-6), (step, lrs[step], expected)


def paste(command: str, tmp_path) -> str:
    """A printed command, run as a person pastes it in the repository's folder: its output."""
    done = subprocess.run(
        shlex.split(command),
        cwd=REPO,
        env=base_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    return output


def test_killed_with_the_reader_of_its_output_the_workers_checkpoint_where_they_stop(
    tmp_path, corpus
):
    """docs/sweeps.md's trial command, its driver's process group SIGKILLed mid-trial: scripts/launch.py
    and accelerate launch die at once, and the pipe the workers print to (launch.py read it) has no
    reader left. Each worker's next print fails on the broken pipe: the launcher's loss, as when its
    parent is gone, so both stop at the same step with a checkpoint, write no hang note, and exit 75
    within seconds; --resume latest continues from that step. Before: rank 0 died of the
    BrokenPipeError without a checkpoint (a step_N.tmp left at times), rank 1 wrote hangs/rank1.json
    and lingered 12-27 s, and the trial resumed 10 steps back."""
    out = tmp_path / "run"
    args = tiny_args(out, corpus, max_steps=40, save_every=10, eval_every=1000)
    # a logging step of 0.1 s: the kill lands mid-run, between two checkpoints
    env = base_env(tmp_path, FAULT_SLOW_S=0.1, RECORD_EXIT=tmp_path / "exits")
    launch = [*LAUNCH[:-1], str(FAULTY_MAIN)]  # train/main.py with the slow steps
    job = subprocess.Popen(
        [*launch, *map(str, args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    workers = []
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() or steps_logged(out) < 13:
            assert time.monotonic() < deadline and job.poll() is None, "the job never trained"
            time.sleep(0.05)
        # scripts/launch.py -> accelerate launch -> the 2 workers, each in a session of its own
        (accelerate,) = children_of(job.pid)
        workers = children_of(accelerate)
        assert len(workers) == 2, workers
        killed_at_step = steps_logged(out)
        os.killpg(job.pid, signal.SIGKILL)  # the driver's group: launch.py and accelerate launch
        job.stdout.close()  # the driver's end of its pipe: with launch.py's, nobody reads
        job.wait(timeout=30)
        killed = time.monotonic()
        while time.monotonic() - killed < 30 and any(alive(w) for w in workers):
            time.sleep(0.1)
        took = time.monotonic() - killed
    finally:
        for worker in workers:
            if alive(worker):
                os.kill(worker, signal.SIGKILL)
    assert took < 8, f"workers still alive {took:.1f} s after the kill"
    exits = {p.name: json.loads(p.read_text()) for p in (tmp_path / "exits").iterdir()}
    assert exits == {"rank0.json": 75, "rank1.json": 75}  # a preemption's stop, on both
    # the checkpoint is the step they stopped at: the last step trained, a step or two past the kill
    stopped_at = steps_logged(out)
    assert killed_at_step <= stopped_at <= killed_at_step + 3, (killed_at_step, stopped_at)
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["step_00000010", f"step_{stopped_at:08d}"]  # no .tmp, keep_last 2
    assert not (out / "hangs").exists()
    resumed = subprocess.run(
        [*launch, "--output_dir", str(out), "--resume", "latest"],
        cwd=REPO,
        env=base_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    said = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, said[-3000:]
    assert f"resume: {out / 'checkpoints' / f'step_{stopped_at:08d}'} (step {stopped_at})" in said
    assert f"done: step 40 (this start: steps {stopped_at + 1}-40 in " in said, said[-3000:]


def steps_logged(out) -> int:
    return max((row["step"] for row in read_metrics(out) if "loss" in row), default=0)
