"""What a person sees under the headline command, through scripts/launch.py (accelerate launch as a child):
a refused input is its one `error:` line and exit 2, SIGTERM a checkpoint and exit 75, Ctrl-C (SIGINT to the
terminal's whole process group) a checkpoint and exit 130, and no launcher traceback or summary in any of
them. Under bare `accelerate launch` the workers do the same, and the launcher says 1 (README)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, base_env, read_metrics, tiny_args

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


@pytest.mark.parametrize("stop, code", [(signal.SIGTERM, 75), (signal.SIGINT, 130)])
def test_a_stop_is_a_checkpoint_and_the_job_s_own_code_with_no_launcher_traceback(
    tmp_path, corpus, stop, code
):
    out = tmp_path / "run"
    args = tiny_args(out, corpus, max_steps=2000, save_every=1000, eval_every=1000)
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
        job.send_signal(stop)  # a scheduler's SIGTERM, to the command it started
    output, _ = job.communicate(timeout=120)
    assert job.returncode == code, output[-3000:]
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-3000:]
    name = "SIGINT" if stop == signal.SIGINT else "SIGTERM"
    assert (
        f"on {name}, checkpoint saved: continue with --output_dir {out} --resume latest" in output
    )
    # the checkpoint is the step it stopped at
    stopped_at = max(row["step"] for row in read_metrics(out))
    newest = sorted(p.name for p in (out / "checkpoints").iterdir())[-1]
    assert newest == f"step_{stopped_at:08d}", output[-3000:]
    # a scheduler's SIGTERM is a preemption to requeue; a person's Ctrl-C is not
    assert (out / "preempted.json").exists() == (stop == signal.SIGTERM)
