"""Faults that used to lose work or block a job: each one injected for real, through the real entry points.

Start-up signals, Ctrl-C, non-finite values between logging steps, a second job on the same run
folder, changed data on resume, a torn metrics file, a malformed data file, a full disk outside a
checkpoint, the default run folder, and elastic restarts by the launchers.
"""

import json
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from conftest import (
    FAULTY_MAIN,
    MAIN,
    REPO,
    TINY,
    accelerate_cmd,
    assert_matches_baseline,
    base_env,
    baseline_args,
    launch_accelerate,
    read_metrics,
    run,
    run_python,
    tiny_args,
)

pytestmark = pytest.mark.slow


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


def checkpoints(run_dir) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def wait_for_rows(run_dir, rows: int, process, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= rows:
            return
        time.sleep(0.05)
    raise AssertionError(
        f"no {rows} metrics rows in {run_dir} (process exit code {process.poll()})"
    )


def test_sigterm_during_start_up_is_a_clean_preemption(tmp_path, corpus):
    run_dir = tmp_path / "run"
    run_python(tiny_args(run_dir, corpus, max_steps=6, save_every=3), tmp_path).check()
    args = [*tiny_args(run_dir, corpus, max_steps=12, save_every=3), "--resume", "latest"]
    stopped = run_python(args, tmp_path, script=FAULTY_MAIN, env_extra={"FAULT_STARTUP": "sigterm"})
    assert stopped.returncode == 75, stopped.tail()
    assert (
        "stopped during start-up on SIGTERM" in stopped.output and "Traceback" not in stopped.output
    )
    # the same command again, as it can be pasted
    again = shlex.join(["python", str(FAULTY_MAIN), *map(str, args)])
    assert f"nothing trained yet; start again with: {again}" in stopped.output
    marker = json.loads((run_dir / "preempted.json").read_text())
    assert marker["step"] == 6 and marker["checkpoint"].endswith("step_00000006")
    # under a launcher, every rank gets the signal while the datasets are prepared
    fresh = tmp_path / "fresh"
    stopped = launch_accelerate(
        [*tiny_args(fresh, corpus, max_steps=6), "--resume", "latest"],
        tmp_path,
        script=FAULTY_MAIN,
        env_extra={"FAULT_STARTUP": "sigterm"},
    )
    assert "exitcode  : 75" in stopped.output, stopped.tail()
    assert json.loads((fresh / "preempted.json").read_text()) == {
        "step": 0,
        "signal": "SIGTERM",
        "checkpoint": None,
    }


def test_inf_gradients_with_a_finite_loss_stop_before_the_save(tmp_path, corpus):
    run_dir = tmp_path / "run"
    # the loss of step 4 is finite
    diverged = run_python(
        tiny_args(run_dir, corpus, max_steps=12, save_every=4, log_every=10),
        tmp_path,
        script=FAULTY_MAIN,
        env_extra={"FAULT_INF_GRAD_STEP": 4},
    )
    assert diverged.returncode == 1
    assert error_lines(diverged.output) == [
        "error: the gradient norm was not finite at step 4: training diverged; no checkpoint was saved; start "
        "again with a lower lr or more warmup_steps"
    ], diverged.tail()
    assert checkpoints(run_dir) == []


def test_a_second_job_on_the_same_run_folder_is_refused_until_the_first_dies(tmp_path, corpus):
    run_dir = tmp_path / "run"
    args = tiny_args(run_dir, corpus, max_steps=5000, save_every=5)
    first = subprocess.Popen(
        [sys.executable, str(MAIN), *map(str, args)],
        env=base_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_rows(run_dir, 6, first)
        started = time.time()
        # the same geometry (one process): only the lock can refuse it
        second = run_python([*args, "--resume", "latest"], tmp_path)
        assert time.time() - started < 60
        assert second.returncode != 0
        errors = error_lines(second.output)
        assert (
            len(errors) == 1
            and f"output_dir '{run_dir}' is in use by another job (host " in errors[0]
        ), second.tail()
        assert f"pid {first.pid}, started " in errors[0]
        rows = len(read_metrics(run_dir))
        wait_for_rows(run_dir, rows + 2, first)  # the first job's files were left alone: it goes on
    finally:
        first.kill()
        first.wait()
    newest = max(
        int(name.split("_")[1]) for name in checkpoints(run_dir) if not name.endswith(".tmp")
    )
    resumed = run_python(
        [*tiny_args(run_dir, corpus, max_steps=newest + 2), "--resume", "latest"], tmp_path
    )
    assert f"(step {newest})" in resumed.check().output  # a killed holder's lock is free again


def test_resume_refuses_changed_data_and_init_from_starts_over(tmp_path, corpus):
    run_dir = tmp_path / "run"
    run_python(
        tiny_args(run_dir, corpus, max_steps=4, save_every=4, warmup_steps=1), tmp_path
    ).check()
    refused = run_python(
        [*tiny_args(run_dir, corpus, max_steps=8, seed=7), "--resume", "latest"], tmp_path
    )
    assert refused.returncode == 2
    assert error_lines(refused.output) == [
        f"error: {run_dir / 'checkpoints' / 'step_00000004'} was saved for other data (seed 1337 -> 7): resuming "
        f"would continue a different data order; to change them on purpose, start a new run with --init_from "
        f"{run_dir / 'checkpoints' / 'step_00000004'}"
    ], refused.tail()
    # other data (its refusal on resume: tests/test_checkpoint.py), on purpose
    other = tmp_path / "other.jsonl"
    other.write_text(
        "".join(
            json.dumps({"text": json.loads(line)["text"].upper()}) + "\n"
            for line in corpus.read_text().splitlines()
        )
    )
    fresh = run_python(
        [*tiny_args(tmp_path / "new", other, max_steps=4, warmup_steps=1), "--init_from", run_dir],
        tmp_path,
    ).check()
    assert f"init_from: weights of {run_dir / 'model.safetensors'}" in fresh.output
    assert [r["step"] for r in read_metrics(tmp_path / "new") if "loss" in r] == [1, 2, 3, 4]


def test_a_full_disk_outside_a_checkpoint_is_one_line_and_no_rank_waits(tmp_path, corpus):
    run_dir = tmp_path / "run"
    started = time.time()
    failed = launch_accelerate(
        tiny_args(run_dir, corpus),
        tmp_path,
        script=FAULTY_MAIN,
        env_extra={"FAULT_DISK_FULL_STEP": 5, "FAULT_RANK": 0},
    )
    assert failed.returncode != 0 and time.time() - started < 60
    assert error_lines(failed.output) == [
        f"error: [Errno 28] No space left on device: '{run_dir / 'metrics.jsonl'}'"
    ], failed.tail()


def checkpoint_size(args) -> int:
    """About what one checkpoint of this run holds: the weights and AdamW's two moments, plus small files."""
    from model import build_model
    from run_config import load_config

    model = build_model(load_config(args))
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters()) + (64 << 10)


def mount_small_disk(folder, size_bytes: int) -> None:
    folder.mkdir()
    size = f"size={size_bytes // 1024}k"
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")


def test_a_checkpoint_that_does_not_fit_names_the_full_disk_on_two_processes(tmp_path, corpus):
    """Before a save, the space it needs is checked against the folder's free space; a write that still
    meets a full disk says so. Either way one line, the previous checkpoints intact, no step trained past
    the save that failed, and no rank left waiting. The disk: a tmpfs with room for two and a half
    checkpoints (keep_last 2: the third does not fit beside them)."""
    small_disk = tmp_path / "small_disk"
    sizing = tiny_args(tmp_path / "sizing", corpus, n_layer=2, n_embd=64)
    mount_small_disk(small_disk, int(2.5 * checkpoint_size(sizing)))
    try:
        check_full_disk_cases(tmp_path, corpus, small_disk)
    finally:
        subprocess.run(["umount", "-l", str(small_disk)], check=False)


def check_full_disk_cases(tmp_path, corpus, small_disk) -> None:
    for name, fault in (("checked", {}), ("unchecked", {"FAULT_SKIP_SPACE_CHECK": 1})):
        run_dir = small_disk / name
        args = tiny_args(
            run_dir, corpus, max_steps=24, save_every=8, keep_last=2, n_layer=2, n_embd=64
        )
        started = time.time()
        failed = launch_accelerate(args, tmp_path, script=FAULTY_MAIN, env_extra=fault)
        assert failed.returncode != 0 and time.time() - started < 90, failed.tail()
        errors = error_lines(failed.output)
        assert len(errors) == 1, failed.tail()
        if name == "checked":
            assert errors[0].startswith(
                f"error: not enough space on {run_dir / 'checkpoints'} for the checkpoint of step 24: "
            )
            assert "it needs about" in errors[0]
        else:
            assert errors[0].startswith(f"error: no space left on {run_dir / 'checkpoints'} (")
            assert (
                "the checkpoint of step 24 was not saved, the previous one is intact" in errors[0]
            )
        checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        assert checkpoints == ["step_00000008", "step_00000016"], checkpoints  # no .tmp left
        assert (
            max(row["step"] for row in read_metrics(run_dir)) == 24
        )  # nothing trained past the failed save
        assert not (run_dir / "model.safetensors").exists()
        shutil.rmtree(run_dir)  # room for the next case


def test_without_output_dir_each_run_gets_a_new_numbered_folder(tmp_path, corpus):
    """The README's train command (here with the debug preset) works twice."""
    readme = run(
        accelerate_cmd(["--config", REPO / "train/configs/debug.yaml", "--dataset", corpus]),
        base_env(tmp_path),
        cwd=tmp_path,
    )
    assert readme.returncode == 0 and "output_dir: runs/run_001" in readme.stdout, readme.stdout[
        -2000:
    ]
    args = [
        "--config",
        TINY,
        "--dataset",
        corpus,
        "--block_size",
        32,
        "--batch_size",
        4,
        "--max_steps",
        2,
    ]
    cmd = [sys.executable, str(MAIN), *map(str, args)]
    result = run(cmd, base_env(tmp_path), cwd=tmp_path)
    assert result.returncode == 0 and "output_dir: runs/run_002" in result.stdout, result.stdout[
        -2000:
    ]
    for number in (1, 2):
        assert (tmp_path / "runs" / f"run_00{number}" / "model.safetensors").exists()
    result = run([*cmd, "--max_steps", "4", "--resume", "latest"], base_env(tmp_path), cwd=tmp_path)
    assert (
        result.returncode == 0 and "resume: runs/run_002/checkpoints/step_00000002" in result.stdout
    ), result.stdout[-2000:]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["run_001", "run_002"]
    # another run's geometry: the newest run folder does not fit it, and the refusal says which folder
    other = run(
        [*cmd, "--batch_size", "8", "--max_steps", "6", "--resume", "latest"],
        base_env(tmp_path),
        cwd=tmp_path,
    )
    errors = error_lines(other.stdout)
    assert other.returncode == 2 and len(errors) == 1, other.stdout[-2000:]
    assert (
        "--resume latest without --output_dir took the newest run, runs/run_002, which is another run"
        in errors[0]
    )
    assert (
        "global batch 4" in errors[0] and "Pass --output_dir to name the run to resume" in errors[0]
    )


# accelerate launch's --max_restarts (torch elastic's agent, as torchrun's --max-restarts; torchrun's restart of
# a pod: tests/e2e/test_engine_runs.py)
def test_the_launcher_restarts_killed_workers_and_they_resume_exactly(tmp_path, corpus, baseline):
    run_dir = tmp_path / "run"
    args = [*baseline_args(run_dir, corpus), "--resume", "latest"]
    fault = {
        "FAULT_STEP": 13,
        "FAULT_RANK": 1,
        "FAULT_ACTION": "sigkill",
        "FAULT_ONCE": tmp_path / "once",
    }
    restarted = launch_accelerate(
        args,
        tmp_path,
        script=FAULTY_MAIN,
        env_extra=fault,
        launcher_args=["--max_restarts", "2"],
    ).check()
    assert "resume: " in restarted.output and "(step 8)" in restarted.output, restarted.tail()
    assert_matches_baseline(run_dir, baseline)
