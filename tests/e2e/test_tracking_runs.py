"""Trackers end to end: W&B offline from 2 processes, run continuity on resume, TensorBoard, fallbacks, plots."""

import json
import os
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
from test_profiling import said_size  # noqa: E402
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


def test_a_two_process_run_reports_to_wandb_offline_tensorboard_its_restart_report_and_profile(
    tmp_path, corpus
):
    """What a run reports, from 2 processes: W&B offline and TensorBoard (the main process only), the
    restart report, and a --profile_steps window's trace per rank."""
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
            profile_steps="3:4",
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
    # the logging steps, and step 1's restart report (written after the first step)
    assert sorted(steps) == [1, 2, 4, 6, 8] and steps[1]["start"] == 1 and "loss" not in steps[1]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "step_time_s"):
        assert key in steps[8], key
    assert "eval_loss" in steps[4] and "eval_perplexity" in steps[8]
    jsonl = {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}
    logged = {s: steps[s]["loss"] for s in steps if "loss" in steps[s]}
    assert logged == jsonl  # the same numbers in both places
    # the restart report: its phases add up to its time to the first step (the steps lost on a resume:
    # the crashed run below)
    (start,) = [row for row in read_metrics(out) if "start" in row]
    assert (start["start"], start["step"], start["resumed_from_step"], start["steps_lost"]) == (
        1,
        1,
        0,
        0,
    )
    phases = {key: value for key, value in start.items() if key.endswith("_s") and key != "start_s"}
    expected = {"start_imports_s", "start_process_group_s", "start_data_s", "start_first_step_s"}
    assert expected <= set(phases) and abs(sum(phases.values()) - start["start_s"]) < 0.05, start
    line = next(line for line in result.output.splitlines() if line.startswith("start 1: "))
    assert f"{start['start_s']:.1f} s to the first step (imports" in line, line
    # the profiler window: one trace per rank, holding steps 3 and 4 and no other, each with its forward
    # and backward
    for rank in (0, 1):
        spans, ops = trace_spans(out / "profile" / f"rank{rank}.steps_3-4.pt.trace.json")
        assert sorted(spans) == [3, 4], sorted(spans)
        for step in (3, 4):
            inside = {op["name"] for op in ops if spans[step][0] <= op["ts"] <= spans[step][1]}
            assert {"aten::embedding", "EmbeddingBackward0"} <= inside, (rank, step)
    # what a person sees of the window: one line naming both ranks' traces and their size on disk; the
    # profiler's own lines (Kineto's USDT:) in each rank's log
    assert "USDT" not in result.output
    (said,) = [line for line in result.output.splitlines() if line.startswith("profile: ")]
    assert f"traced in {out / 'profile'} (2 files, " in said, said
    assert "rank{0..1}.steps_3-4.pt.trace.json" in said, said
    files, size, rounding = said_size(said)
    traces = list((out / "profile").glob("*.pt.trace.json"))
    assert files == len(traces) == 2
    assert abs(size - sum(os.path.getsize(trace) for trace in traces)) <= rounding, said
    assert_no_secrets(out)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "accelerate-template")).Reload()
    assert [e.step for e in events.Scalars("loss")] == [2, 4, 6, 8]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx(
        [jsonl[s] for s in (2, 4, 6, 8)]
    )


def trace_spans(trace_file) -> tuple[dict[int, tuple[float, float]], list[dict]]:
    """A profiler trace's ({step: (start, end) of its `train step N` span}, its other events)."""
    events = [e for e in json.loads(trace_file.read_text())["traceEvents"] if e.get("ph") == "X"]
    spans = {
        int(e["name"].split()[-1]): (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e["name"].startswith("train step ")
    }
    return spans, [e for e in events if not e["name"].startswith("train step ")]


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
