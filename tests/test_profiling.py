"""profiling.py in one process: the window's edges (a resume inside it records the rest), the start clock's
arithmetic, and the one-line refusals and out-of-memory line (the window across ranks and a stop:
tests/e2e/test_tracking_runs.py; a stop inside it: tests/e2e/test_resume.py)."""

import json
import time
from types import SimpleNamespace

import pytest
import torch

from checks import check_devices
from config import config_class
from conftest import REPO
from errors import ConfigError
from job import out_of_memory
from profiling import ProfilerWindow, StartClock, profile_window, restart_line

RunConfig = config_class()
TRAIN = REPO / "train"


def test_profile_steps_are_checked_in_one_line_naming_the_key():
    assert profile_window(RunConfig(profile_steps="3:5")) == (3, 5)
    assert profile_window(RunConfig()) is None
    for bad, said in [
        ("3-5", "must be START:END"),
        ("5:3", "needs 1 <= START <= END"),
        ("0:2", "needs 1 <= START <= END"),
        ("400:410", "starts after max_steps (300)"),
    ]:
        with pytest.raises(ConfigError, match="^profile_steps ") as refused:
            profile_window(RunConfig(profile_steps=bad))
        assert said in str(refused.value), str(refused.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_the_cuda_switches_are_refused_on_cpu_and_an_oom_is_one_line():
    with pytest.raises(ConfigError, match="^oom_snapshot needs CUDA GPUs"):
        check_devices(RunConfig(oom_snapshot=True))
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore detail")
    line = str(out_of_memory(error, RunConfig(output_dir="run")))
    assert line.startswith("out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB.)")
    assert "lower batch_size" in line and line.endswith("--oom_snapshot records what held it")


def steps(window: ProfilerWindow, first: int, last: int) -> None:
    for step in range(first, last + 1):
        torch.ones(8, 8, requires_grad=True).sum().backward()  # a step's work
        window.step_done(step)


def spans_of(trace) -> list[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return sorted(e["name"] for e in events if e.get("name", "").startswith("train step "))


def test_the_window_records_its_steps_and_a_start_inside_it_records_the_rest(tmp_path):
    rank0 = SimpleNamespace(process_index=0)
    cfg = RunConfig(output_dir=str(tmp_path), profile_steps="3:5", max_steps=8)
    fresh = ProfilerWindow(cfg, rank0, resumed_step=0)
    steps(fresh, 1, 8)
    resumed = ProfilerWindow(cfg, rank0, resumed_step=3)  # opens at once: steps 4 and 5 are left
    steps(resumed, 4, 8)
    after = ProfilerWindow(cfg, rank0, resumed_step=5)  # past the window: nothing
    steps(after, 6, 8)
    found = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert found == ["rank0.steps_3-5.pt.trace.json", "rank0.steps_4-5.pt.trace.json"]
    assert spans_of(tmp_path / "profile" / found[0]) == [f"train step {n}" for n in (3, 4, 5)]
    assert spans_of(tmp_path / "profile" / found[1]) == ["train step 4", "train step 5"]


def test_the_start_clock_s_phases_add_up_to_its_time_wherever_they_nest():
    clock = StartClock()
    clock.begun = clock.last_lap = time.time()
    time.sleep(0.05)
    clock.lap("checks")
    with clock.phase("download"):
        time.sleep(0.05)
    time.sleep(0.05)
    clock.lap("load")  # less the download inside it
    row = clock.finish({"start": 1})
    phases = {key: value for key, value in row.items() if key.endswith("_s") and key != "start_s"}
    assert list(phases) == [
        "start_checks_s",
        "start_download_s",
        "start_load_s",
        "start_first_step_s",
    ]
    assert all(0.04 < phases[f"start_{name}_s"] < 0.2 for name in ("checks", "download", "load"))
    assert abs(sum(phases.values()) - row["start_s"]) < 0.005


def test_the_window_s_edges_and_its_refusals_are_exact():
    assert profile_window(RunConfig(profile_steps="1:1")) == (1, 1)  # the first step alone
    assert profile_window(RunConfig(profile_steps=" 2 : 300 ")) == (2, 300)  # up to max_steps
    for bad in ("a:5", "3:b", "3:", ":5", "3:5:7"):
        with pytest.raises(ConfigError) as refused:
            profile_window(RunConfig(profile_steps=bad))
        assert str(refused.value) == (
            "profile_steps must be START:END, the first and the last step to record, e.g. 10:12 "
            f"(got {bad!r})"
        )


def test_the_restart_line_says_each_phase_the_steps_lost_and_the_compile():
    row = {
        "start": 3,
        "resumed_from_step": 40,
        "steps_lost": 7,
        "start_s": 12.34,
        "start_imports_s": 2.0,
        "start_checks_s": 0.01,  # under 0.05 s: not said
        "start_checkpoint_load_s": 1.25,
        "start_first_step_s": 9.0,
        "compile_graphs_compiled": 0,
        "compile_graphs_cached": 24,
    }
    assert restart_line(row) == (
        "start 3: 12.3 s to the first step (imports 2.0 s, checkpoint load 1.2 s, first step 9.0 s); "
        "resumed at step 40, 7 steps lost; 0 graphs compiled, 24 from the kept cache"
    )
    fresh = {
        "start": 1,
        "resumed_from_step": 0,
        "steps_lost": 0,
        "start_s": 5.0,
        "start_data_s": 5.0,
    }
    assert restart_line(fresh) == "start 1: 5.0 s to the first step (data 5.0 s)"


def test_the_process_s_start_is_read_from_proc():
    """The clock starts when the process did (so that imports count), not when profiling.py was imported."""
    import subprocess
    import sys

    script = "import time; time.sleep(0.5); import profiling; print(profiling.start_clock.begun, time.time())"
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=TRAIN
    ).stdout.split()
    begun, now = float(out[0]), float(out[1])
    assert 0.5 <= now - begun < 5.0, now - begun
