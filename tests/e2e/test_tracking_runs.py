"""Trackers end to end: W&B offline from 2 processes, run continuity on resume, TensorBoard, fallbacks, plots."""

import sys
import time
from pathlib import Path

import pytest

from conftest import (
    FAULTY_MAIN,
    REPO,
    base_env,
    launch_accelerate,
    read_metrics,
    run,
    run_python,
    tiny_args,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from wandb_reader import read_run  # noqa: E402

pytestmark = pytest.mark.slow

SECRETS = {
    "WANDB_API_KEY": "local-0123456789abcdef0123456789abcdef01234567",
    "HF_TOKEN": "hf_secretTOKEN4242",
}


def offline_runs(output_dir):
    return sorted((output_dir / "wandb").glob("offline-run-*"))


def assert_no_secrets(folder):
    for path in folder.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            for secret in SECRETS.values():
                assert secret.encode() not in data, f"{secret} written to {path}"


def test_wandb_offline_two_processes_and_tensorboard(tmp_path, corpus):
    out = tmp_path / "run"
    result = launch_accelerate(
        tiny_args(
            out,
            corpus,
            max_steps=8,
            log_every=2,
            eval_every=4,
            save_every=0,
            tracker="wandb,tensorboard",
        ),
        tmp_path,
        env_extra={**SECRETS, "WANDB_SILENT": "false"},
    ).check()
    wandb_lines = [line for line in result.output.splitlines() if line.startswith("wandb:")]
    # was ~25: summary, sparklines
    assert len(wandb_lines) <= 3 and "wandb sync" in result.output, wandb_lines
    runs = offline_runs(out)
    assert len(runs) == 1, runs  # the main process only: rank 1 created no run
    run_files = list(runs[0].glob("run-*.wandb"))
    wandb_run = read_run(run_files[0])
    assert wandb_run["exit_code"] == 0  # finish() ran
    assert (
        wandb_run["config"]["lr"] == 3e-3 and wandb_run["config"]["tracker"] == "wandb,tensorboard"
    )
    steps = {row["_step"]: row for row in wandb_run["history"]}
    assert sorted(steps) == [2, 4, 6, 8]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "step_time_s"):
        assert key in steps[8], key
    assert "eval_loss" in steps[4] and "eval_perplexity" in steps[8]
    jsonl = {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}
    assert {s: steps[s]["loss"] for s in steps} == jsonl  # the same numbers in both places
    assert_no_secrets(out)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "accelerate-template")).Reload()
    assert [e.step for e in events.Scalars("loss")] == [2, 4, 6, 8]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx(
        [jsonl[s] for s in (2, 4, 6, 8)]
    )


def test_a_crashed_run_resumes_its_wandb_run_rewound_to_the_checkpoint(tmp_path, corpus):
    out = tmp_path / "run"
    args = tiny_args(
        out, corpus, max_steps=10, log_every=1, eval_every=100, save_every=4, tracker="wandb"
    )
    # rank 1 dies; rank 0, which holds the W&B run, sees its peer gone and exits with its records flushed
    crashed = launch_accelerate(
        [*args, "--resume", "latest"],
        tmp_path,
        script=FAULTY_MAIN,
        env_extra={
            "FAULT_STEP": 7,
            "FAULT_RANK": 1,
            "FAULT_ACTION": "sigkill",
            "FAULT_ONCE": tmp_path / "x",
        },
    )
    assert crashed.returncode != 0 and "starting fresh" in crashed.output
    launch_accelerate([*args, "--resume", "latest"], tmp_path).check()
    first, second = (read_run(next(p.glob("run-*.wandb"))) for p in offline_runs(out))
    # offline, W&B writes a second folder with the same id
    assert first["run_id"] == second["run_id"]
    assert all(p.name.endswith(first["run_id"]) for p in offline_runs(out))
    crashed_steps = [r["_step"] for r in first["history"]]
    # steps after the checkpoint at 4
    assert crashed_steps[:4] == [1, 2, 3, 4] and max(crashed_steps) > 4
    # the resumed run asks W&B to rewind to step 4, so the steps it logs again replace the crashed run's
    assert second["config"]["_wandb"]["branch_point"] == {"run_id": first["run_id"], "step": 4}
    assert [r["_step"] for r in second["history"]] == list(range(5, 11))
    # the restart report, in W&B as in metrics.jsonl: rank 1 died after step 7 was logged, so the
    # resume from step 4 lost steps 5 to 7
    resumed_start = next(row for row in second["history"] if "start" in row)
    assert (resumed_start["_step"], resumed_start["start"]) == (5, 2)
    assert (resumed_start["resumed_from_step"], resumed_start["steps_lost"]) == (4, 3)
    assert next(row for row in first["history"] if "start" in row)["steps_lost"] == 0
    logged = [row for row in read_metrics(out) if "start" in row]
    assert [(row["start"], row["steps_lost"]) for row in logged] == [(1, 0), (2, 3)]


def short_wandb_run(out, corpus, tmp_path, env):
    """4 steps with --tracker wandb in one process, under the W&B settings in `env`."""
    args = tiny_args(
        out, corpus, max_steps=4, warmup_steps=1, save_every=0, eval_every=4, tracker="wandb"
    )
    return run_python(args, tmp_path, env_extra=env, timeout=180).check()


def test_wandb_without_credentials_falls_back_to_offline_and_trains(tmp_path, corpus):
    out = tmp_path / "run"
    env = {
        "WANDB_MODE": "online",
        "HOME": tmp_path,
        "WANDB_CONFIG_DIR": tmp_path / "cfg",
        "WANDB_API_KEY": "",
    }
    result = short_wandb_run(out, corpus, tmp_path, env)
    assert "warning: W&B could not start" in result.output and "offline instead" in result.output
    assert len(offline_runs(out)) == 1 and (out / "model.safetensors").exists()


def test_an_unreachable_wandb_server_costs_the_init_timeout_then_goes_offline(tmp_path, corpus):
    out = tmp_path / "run"
    env = {
        "WANDB_MODE": "online",
        "HOME": tmp_path,
        "WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567",
        "WANDB_BASE_URL": "http://127.0.0.1:9",
        "WANDB_INIT_TIMEOUT": 5,
    }  # port 9: nothing listens
    started = time.time()
    result = short_wandb_run(out, corpus, tmp_path, env)
    assert time.time() - started < 90
    assert "warning: W&B could not start" in result.output and "offline instead" in result.output
    [offline] = offline_runs(out)
    assert read_run(next(offline.glob("run-*.wandb")))["exit_code"] == 0


def test_plot_helper_writes_a_png(tmp_path, baseline):
    out = tmp_path / "curves.png"
    result = run(
        [
            sys.executable,
            str(REPO / "scripts/plot_metrics.py"),
            str(baseline.output_dir),
            "--out",
            str(out),
        ],
        base_env(tmp_path),
        timeout=120,
    )
    assert result.returncode == 0, result.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
