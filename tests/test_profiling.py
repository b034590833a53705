"""profiling.py in one process: the window's edges (a resume inside it records the rest), what a run with a
window shows on the console (one line naming the traces, none of the profiler's own), the start clock's
arithmetic, and the one-line refusals and out-of-memory line (the window across ranks and a stop:
tests/e2e/test_tracking_runs.py; a stop inside it: tests/e2e/test_resume.py). The CUDA parts (the memory
history, the snapshots, the profiler's CUDA activity) against torch's CUDA calls faked: FakeGpu."""

import inspect
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from checks import check_devices
from conftest import MAIN, REPO, base_env, tiny_args
from errors import ConfigError
from job import out_of_memory
from profiling import ProfilerWindow, StartClock, profile_window, restart_line, write_oom_snapshot
from run_config import config_class

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
    rank0 = SimpleNamespace(process_index=0, num_processes=1, is_main_process=True)
    cfg = RunConfig(output_dir=str(tmp_path), profile_steps="3:5", max_steps=8)
    fresh = ProfilerWindow(cfg, rank0, resumed_step=0)
    steps(fresh, 1, 8)
    resumed = ProfilerWindow(cfg, rank0, resumed_step=3)  # opens at once: steps 4 and 5 are left
    steps(resumed, 4, 8)
    after = ProfilerWindow(cfg, rank0, resumed_step=5)  # past the window: nothing
    steps(after, 6, 8)
    found = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert found == [
        "rank0.profiler.log",  # the profiler's own lines, both windows'
        "rank0.steps_3-5.pt.trace.json",
        "rank0.steps_4-5.pt.trace.json",
    ]
    found = found[1:]
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
    spawned = time.time()
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=TRAIN
    ).stdout.split()
    begun, now = float(out[0]), float(out[1])
    # before the sleep, so the imports count; after this process spawned it (/proc's 10 ms ticks);
    # bounded by the spawn, not by a duration, which a loaded machine stretches
    assert spawned - 0.05 <= begun <= now - 0.5, (spawned, begun, now)


SCALES = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}


def said_size(line: str) -> tuple[int, float, float]:
    """The (files, bytes, rounding) a profile line says: its size back in bytes, to its one decimal."""
    files, number, unit = re.search(r"\((\d+) files?, ([\d.]+) (B|kB|MB|GB): ", line).groups()
    return int(files), float(number) * SCALES[unit], 0.05 * SCALES[unit]


@pytest.mark.slow
def test_a_run_says_where_its_traces_went_and_keeps_the_profiler_s_lines_off_the_console(
    tmp_path, corpus
):
    """What a person sees of --profile_steps, stdout and stderr apart (both pipes): one line with the
    folder, the files and their size on disk, in its place among the step lines; Kineto's `USDT:` lines
    in the profile folder's log, not on either stream."""
    out = tmp_path / "run"
    args = tiny_args(out, corpus, max_steps=6, eval_every=6, save_every=0, profile_steps="3:5")
    shown = subprocess.run(
        [sys.executable, str(MAIN), *args],
        env=base_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert shown.returncode == 0, shown.stdout[-3000:] + shown.stderr[-3000:]
    assert "USDT" not in shown.stdout and "USDT" not in shown.stderr, shown.stderr
    lines = shown.stdout.splitlines()
    (said,) = [line for line in lines if line.startswith("profile: ")]
    folder = out / "profile"
    traces = [folder / "rank0.steps_3-5.pt.trace.json"]
    assert sorted(folder.glob("*.pt.trace.json")) == traces
    assert said.startswith(f"profile: steps 3-5 traced in {folder} (1 file, "), said
    assert ": rank0.steps_3-5.pt.trace.json; " in said and said.endswith("rank0.profiler.log)")
    files, size, rounding = said_size(said)
    assert files == len(traces)
    assert abs(size - sum(os.path.getsize(trace) for trace in traces)) <= rounding, said
    # the window closes after step 5's optimizer step, before its log line: between steps 4 and 5
    steps = [line.split(" |")[0] for line in lines if line.startswith("step ")]
    assert steps[:6] == [f"step {n}/6" for n in range(1, 7)], steps
    step_4 = lines.index(next(line for line in lines if line.startswith("step 4/6 |")))
    assert lines[step_4 + 1] == said
    # not lost: the profiler's start and stop, in its log (torch 2.13's Kineto prints them)
    log = (folder / "rank0.profiler.log").read_text()
    assert "profiler_start" in log and "profiler_stop" in log, log


def test_output_to_the_log_keeps_the_console_s_lines_and_their_order_on_pipes(tmp_path):
    """Inside output_to_log, what Python, C's printf and a raw write to descriptor 2 print goes to the
    log; what was printed before it (still in Python's or C's buffers: pipes, no PYTHONUNBUFFERED) and
    after it reaches the console, in order."""
    script = f"""
import ctypes, os, sys
from types import SimpleNamespace
from profiling import ProfilerWindow
cfg = SimpleNamespace(profile_steps="", run_dir={str(tmp_path)!r}, output_dir={str(tmp_path)!r},
                      shared_filesystem=True, oom_snapshot=False)
window = ProfilerWindow(cfg, SimpleNamespace(process_index=0), resumed_step=0)
libc = ctypes.CDLL(None)
print("python before")
libc.printf(b"printf before\\n")
print("python stderr before", file=sys.stderr)
with window.output_to_log():
    print("python inside")
    libc.printf(b"printf inside\\n")
    os.write(2, b"fd 2 inside\\n")
print("python after", flush=True)
libc.printf(b"printf after\\n")
print("python stderr after", file=sys.stderr)
libc.fflush(None)
"""
    env = {k: v for k, v in base_env(tmp_path).items() if k != "PYTHONUNBUFFERED"}
    shown = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=TRAIN,
        check=True,
    )
    assert shown.stdout.splitlines() == [
        "python before",
        "printf before",
        "python after",
        "printf after",
    ]
    assert shown.stderr.splitlines() == ["python stderr before", "python stderr after"]
    log = (tmp_path / "profile" / "rank0.profiler.log").read_text().splitlines()
    assert sorted(log) == ["fd 2 inside", "printf inside", "python inside"]


def test_a_run_resumed_from_the_step_before_the_window_traces_all_of_it(tmp_path):
    """--profile_steps 3:5, resumed from step 2's checkpoint: the next step is 3, the window's first,
    so steps 3, 4 and 5 are traced, as in a fresh run."""
    rank0 = SimpleNamespace(process_index=0, num_processes=1, is_main_process=True)
    cfg = RunConfig(output_dir=str(tmp_path), profile_steps="3:5", max_steps=8)
    resumed = ProfilerWindow(cfg, rank0, resumed_step=2)
    steps(resumed, 3, 8)
    trace = tmp_path / "profile" / "rank0.steps_3-5.pt.trace.json"
    assert trace.exists(), sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert spans_of(trace) == ["train step 3", "train step 4", "train step 5"]


def test_a_process_that_exits_inside_the_window_writes_the_steps_it_recorded(tmp_path):
    """A run stopped (or failed) at step 4 of a 3:6 window: its process exits without the window's
    close, and the trace of steps 3 and 4 is still written, named after them."""
    script = f"""
import sys
from types import SimpleNamespace
import torch
from profiling import ProfilerWindow
cfg = SimpleNamespace(profile_steps="3:6", max_steps=8, run_dir={str(tmp_path)!r},
                      output_dir={str(tmp_path)!r}, shared_filesystem=True, oom_snapshot=False)
rank0 = SimpleNamespace(process_index=0, num_processes=1, is_main_process=True, device="cpu")
window = ProfilerWindow(cfg, rank0, resumed_step=0)
for step in range(1, 5):
    torch.ones(8, 8, requires_grad=True).sum().backward()
    window.step_done(step)
sys.exit(0)
"""
    subprocess.run(
        [sys.executable, "-c", script],
        env=base_env(tmp_path),
        capture_output=True,
        timeout=120,
        cwd=TRAIN,
        check=True,
    )
    trace = tmp_path / "profile" / "rank0.steps_3-4.pt.trace.json"
    assert trace.exists(), sorted(p.name for p in (tmp_path / "profile").iterdir())
    # and the span of step 5, begun when the process stopped
    assert spans_of(trace) == ["train step 3", "train step 4", "train step 5"]


def test_the_process_s_start_is_worked_out_from_its_start_ticks_and_the_uptime(monkeypatch):
    """By hand, from /proc as Linux writes it (a process name may hold ") " itself; field 22 is the
    start in clock ticks since boot): started 5000 ticks at 100 a second = 50 s after boot, the machine
    up 100.5 s at time 1000.0: started at 1000.0 - (100.5 - 50) = 949.5. Unreadable: now."""
    import profiling

    fields = ["S", *[str(n) for n in range(1, 19)], "5000", "77", "88"]  # 19 after the state: 5000
    proc = {
        "/proc/self/stat": f"1234 (a) b) {' '.join(fields)}\n",
        "/proc/uptime": "100.50 380.25\n",
    }

    class Proc:
        def __init__(self, path):
            self.path = path

        def read_text(self):
            if self.path not in proc:
                raise FileNotFoundError(self.path)
            return proc[self.path]

    monkeypatch.setattr(profiling, "Path", Proc)
    monkeypatch.setattr(profiling.os, "sysconf", {"SC_CLK_TCK": 100}.__getitem__)
    monkeypatch.setattr(profiling.time, "time", lambda: 1000.0)
    assert profiling.process_started() == 949.5
    clock = StartClock()
    assert clock.begun == clock.last_lap == 949.5
    proc.clear()
    assert profiling.process_started() == 1000.0


def test_the_clock_rounds_to_milliseconds_adds_a_phase_met_twice_and_floors_at_zero(monkeypatch):
    import profiling

    clock = StartClock()
    clock.begun = 1000.0 - 10.123456
    clock.last_lap = 1000.0
    monkeypatch.setattr(profiling.time, "time", lambda: 1000.0)
    clock._add("data", 1.0)
    clock._add("data", 0.2345678)  # met twice: one figure
    clock._add("clock skew", -1.0)  # a negative interval counts as none
    row = clock.finish({"start": 2})
    assert row == {
        "start": 2,
        "start_s": 10.123,
        "start_data_s": 1.235,
        "start_clock_skew_s": 0.0,
        "start_first_step_s": 0.0,
    }


def test_a_phase_of_exactly_0_05_s_is_said_and_one_under_it_is_not():
    row = {"start": 1, "resumed_from_step": 0, "steps_lost": 0, "start_s": 2.0}
    row |= {"start_data_s": 0.05, "start_model_s": 0.049, "start_first_step_s": 1.0}
    assert restart_line(row) == "start 1: 2.0 s to the first step (data 0.1 s, first step 1.0 s)"


def test_the_window_s_order_and_max_steps_refusals_are_whole_lines_and_max_steps_may_start_it():
    for bad, problem in (
        ("5:3", "needs 1 <= START <= END"),
        ("0:2", "needs 1 <= START <= END"),
        ("301:302", "starts after max_steps (300): the window would never open"),
    ):
        with pytest.raises(ConfigError) as refused:
            profile_window(RunConfig(profile_steps=bad, max_steps=300))
        assert str(refused.value) == f"profile_steps {problem} (got {bad!r})"
    assert profile_window(RunConfig(profile_steps="300:300", max_steps=300)) == (300, 300)


def test_a_run_resumed_two_steps_before_the_window_opens_it_after_the_next_step(tmp_path):
    """Resumed from step 1 with --profile_steps 3:5: step 2 is not traced, the window opens after it."""
    rank0 = SimpleNamespace(process_index=0, num_processes=1, is_main_process=True)
    out = tmp_path / "not" / "made" / "yet"  # the window makes its folders
    cfg = RunConfig(output_dir=str(out), profile_steps="3:5", max_steps=8)
    resumed = ProfilerWindow(cfg, rank0, resumed_step=1)
    assert resumed.profiler is None
    steps(resumed, 2, 8)
    assert sorted(p.name for p in (out / "profile").iterdir()) == [
        "rank0.profiler.log",
        "rank0.steps_3-5.pt.trace.json",
    ]
    trace = out / "profile" / "rank0.steps_3-5.pt.trace.json"
    assert spans_of(trace) == ["train step 3", "train step 4", "train step 5"]
    # record_shapes: each operator's input sizes are in the trace
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("Input Dims" in event.get("args", {}) for event in events)


class PerfClock:
    """profiling.time with a perf_counter the test moves."""

    def __init__(self):
        self.now = 50.0

    def perf_counter(self):
        return self.now


def test_the_throughput_s_rates_by_hand_on_cpu_and_on_a_listed_gpu(monkeypatch):
    """8 samples of 64 tokens a step (512 tokens), 3 steps in 2 s: 12 samples/s, 768 tokens/s, 2/3 s a
    step. On CPU no MFU: the peak resident memory (2 GiB: 2**21 KiB). On 2 H100s in bf16, the model's
    6 x 20 parameters = 120 FLOPs a token: MFU 768 x 120 / (2 x 989e12), and the GPU's peak memory (3
    GiB). A report restarts the count: nothing since, no division by zero."""
    import profiling

    clock = PerfClock()
    monkeypatch.setattr(profiling, "time", clock)
    monkeypatch.setattr(
        profiling.resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=2**21)
    )
    meter = profiling.Throughput(8, 64, torch.nn.Linear(4, 4), 2, "bf16")
    assert meter.seen(5) == {"samples_seen": 40, "tokens_seen": 2560}
    for _ in range(3):
        meter.step()
    clock.now += 2.0
    assert meter.report() == {
        "samples_per_s": 12.0,
        "step_time_s": 2 / 3,
        "tokens_per_s": 768.0,
        "peak_rss_gib": 2.0,
    }
    assert meter.report() == {
        "samples_per_s": 0.0,
        "step_time_s": 1e-9,
        "tokens_per_s": 0.0,
        "peak_rss_gib": 2.0,
    }
    samples_only = profiling.Throughput(8, None, torch.nn.Linear(4, 4), 1, "no")
    assert samples_only.seen(5) == {"samples_seen": 40}
    samples_only.step()
    clock.now += 0.5
    assert samples_only.report() == {"samples_per_s": 16.0, "step_time_s": 0.5, "peak_rss_gib": 2.0}
    monkeypatch.setattr(profiling.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(profiling.torch.cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(profiling.torch.cuda, "max_memory_allocated", lambda: 3 * 2**30)
    on_gpus = profiling.Throughput(8, 64, torch.nn.Linear(4, 4), 2, "bf16")
    assert (on_gpus.peak_flops, on_gpus.flops_per_token) == (2 * 989e12, 120)
    for _ in range(3):
        on_gpus.step()
    clock.now += 2.0
    assert on_gpus.report() == {
        "samples_per_s": 12.0,
        "step_time_s": 2 / 3,
        "tokens_per_s": 768.0,
        "mfu": 768.0 * 120 / (2 * 989e12),
        "peak_mem_gib": 3.0,
    }
    in_fp32 = profiling.Throughput(8, 64, torch.nn.Linear(4, 4), 2, "no")
    assert in_fp32.peak_flops is None  # MFU is against the bf16 peak: none for an fp32 run
    monkeypatch.setattr(profiling.torch.cuda, "get_device_name", lambda: "NVIDIA GeForce GTX 1080")
    assert profiling.Throughput(8, 64, torch.nn.Linear(4, 4), 2, "bf16").peak_flops is None


@pytest.mark.parametrize(
    "size, said",
    [
        (0, "0 B"),
        (999, "999 B"),
        (1000, "1.0 kB"),
        (830_000, "830.0 kB"),
        (999_999, "1000.0 kB"),
        (1_000_000, "1.0 MB"),
        (2_150_000, "2.1 MB"),
        (1_000_000_000, "1.0 GB"),
        (12_340_000_000, "12.3 GB"),
    ],
)
def test_sizes_read_in_decimal_units_with_one_decimal(size, said):
    from profiling import readable_size

    assert readable_size(size) == said


def test_the_window_s_line_counts_every_rank_s_files_and_bytes(tmp_path, capsys):
    """say_written's line, by hand: this rank's trace of 1500 bytes; with every rank (a collective
    that sums [files, bytes]: the other rank's 1 file of 2500 bytes) 2 files, 4.0 kB, named for ranks
    0 to 1; at exit, this rank's alone and each other rank's; nothing from a rank but the main one;
    on node-local disks, each node's folder."""

    class Ranks:
        device = torch.device("cpu")

        def __init__(self, num_processes, is_main_process, others=(0, 0)):
            self.process_index = 0 if is_main_process else 1
            self.num_processes, self.is_main_process = num_processes, is_main_process
            self.others, self.asked = others, []

        def reduce(self, tensor, how):
            self.asked.append((tensor.tolist(), tensor.dtype, tensor.device, how))
            return {"sum": tensor + torch.tensor(self.others)}[how]

    def window(plumbing, **cfg):
        opened = ProfilerWindow(
            RunConfig(output_dir=str(tmp_path), profile_steps="3:5", max_steps=8, **cfg),
            plumbing,
            resumed_step=0,
        )
        opened.first_recorded, opened.last_recorded = 3, 5
        return opened

    folder = tmp_path / "profile"
    folder.mkdir()
    trace = folder / "rank0.steps_3-5.pt.trace.json"
    trace.write_bytes(b"x" * 1500)
    memory = folder / "rank0.steps_3-5.memory.pickle"
    memory.write_bytes(b"x" * 600)
    window(Ranks(1, True)).say_written([trace], every_rank=True)
    assert capsys.readouterr().out == (
        f"profile: steps 3-5 traced in {folder} (1 file, 1.5 kB: rank0.steps_3-5.pt.trace.json; the "
        "profiler's own messages: rank0.profiler.log)\n"
    )
    ranks = Ranks(2, True, others=(1, 2500))
    window(ranks).say_written([trace], every_rank=True)
    assert ranks.asked == [([1, 1500], torch.int64, torch.device("cpu"), "sum")]
    assert capsys.readouterr().out == (
        f"profile: steps 3-5 traced in {folder} (2 files, 4.0 kB: rank{{0..1}}.steps_3-5.pt.trace.json; "
        "the profiler's own messages: rank{0..1}.profiler.log)\n"
    )
    at_exit = Ranks(2, True)
    window(at_exit, shared_filesystem=False).say_written([trace, memory], every_rank=False)
    assert at_exit.asked == []
    assert capsys.readouterr().out == (
        f"profile: steps 3-5 traced in {folder} on each node (2 files, 2.1 kB: "
        "rank0.steps_3-5.pt.trace.json, rank0.steps_3-5.memory.pickle, and each other rank's; the "
        "profiler's own messages: rank0.profiler.log)\n"
    )
    other = Ranks(2, False, others=(1, 1500))
    window(other).say_written([trace], every_rank=True)
    assert len(other.asked) == 1 and capsys.readouterr().out == ""


def test_a_window_that_closes_on_its_last_step_counts_every_rank_and_one_closed_at_exit_not(
    tmp_path, capsys
):
    """Two ranks (the other's reduce adds its 1 file): the window's last step closes it on every rank
    together, so its line counts 2 files; a window closed at exit counts this rank's alone."""

    class TwoRanks:
        device = torch.device("cpu")
        process_index, num_processes, is_main_process = 0, 2, True

        def __init__(self):
            self.reduced = 0

        def reduce(self, tensor, how):
            self.reduced += 1
            return {"sum": tensor + torch.tensor([1, 0])}[how]

    ranks = TwoRanks()
    cfg = RunConfig(output_dir=str(tmp_path / "a"), profile_steps="2:3", max_steps=8)
    steps(ProfilerWindow(cfg, ranks, resumed_step=0), 1, 4)
    assert ranks.reduced == 1
    said = capsys.readouterr().out
    assert said.startswith(f"profile: steps 2-3 traced in {tmp_path / 'a' / 'profile'} (2 files, ")
    assert "rank{0..1}.steps_2-3.pt.trace.json" in said
    ranks = TwoRanks()
    cfg = RunConfig(output_dir=str(tmp_path / "b"), profile_steps="2:5", max_steps=8)
    window = ProfilerWindow(cfg, ranks, resumed_step=0)
    steps(window, 1, 2)
    window.close()  # at exit: this rank's own
    assert ranks.reduced == 0
    said = capsys.readouterr().out
    assert " (1 file, " in said and "rank0.steps_2-2.pt.trace.json, and each other rank's;" in said


class FakeGpu:
    """What profiling.py asks of a CUDA machine, faked on this CPU one: torch.cuda.is_available; the
    allocator's memory history (torch.cuda.memory._record_memory_history and _dump_snapshot, their
    arguments bound to torch's own signatures; a snapshot is 600 bytes); and torch.profiler.profile,
    whose CUDA activity needs a CUDA build (a trace is 1500 bytes). Every call in `calls`, in order."""

    CPU, CUDA = torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA

    def __init__(self, monkeypatch, tmp_path):
        self.available, self.calls = True, []
        self.profile_signature = inspect.signature(torch.profiler.profile.__init__)
        monkeypatch.chdir(tmp_path)  # where a stray relative path would land
        memory = torch.cuda.memory
        monkeypatch.setattr(torch.cuda, "is_available", lambda: self.available)
        history = self.recorder(memory._record_memory_history)
        monkeypatch.setattr(memory, "_record_memory_history", history)
        monkeypatch.setattr(memory, "_dump_snapshot", self.recorder(memory._dump_snapshot, 600))
        monkeypatch.setattr(torch.profiler, "profile", self.profile)

    def recorder(self, real, size=None):
        signature = inspect.signature(real)

        def call(*args, **kwargs):
            asked = signature.bind(*args, **kwargs).arguments  # what the caller passed
            self.calls.append((real.__name__, asked))
            if size:
                Path(asked["filename"]).write_bytes(b"x" * size)

        return call

    def profile(self, **kwargs):
        gpu = self

        class Profile:
            def __enter__(self):
                gpu.calls.append(("profiler start", {}))

            def __exit__(self, *exc):
                gpu.calls.append(("profiler stop", {}))

            def export_chrome_trace(self, path):
                gpu.calls.append(("trace", {"path": path}))
                Path(path).write_bytes(b"x" * 1500)

        asked = self.profile_signature.bind(None, **kwargs)
        asked.apply_defaults()  # torch's: no shapes, and its activities
        asked = asked.arguments
        # none named: torch records what profiler.supported_activities() has, on a GPU CPU and CUDA
        recorded = set(asked.get("activities") or (self.CPU, self.CUDA))
        self.calls.append(("profile", {"activities": recorded, "shapes": asked["record_shapes"]}))
        return Profile()


def cuda_steps(window: ProfilerWindow, gpu: FakeGpu, first: int, last: int) -> None:
    for step in range(first, last + 1):
        window.step_done(step)
        gpu.calls.append(("step done", {"step": step}))


def test_a_window_on_a_gpu_records_the_memory_history_of_its_steps_and_writes_it_beside_the_trace(
    tmp_path, monkeypatch, capsys
):
    """--profile_steps 3:5 on a GPU, by torch's API: the allocator's history starts as the window opens
    (after step 2; the newest 200,000 events, the default context and stacks: "all"), the profiler
    records the CPU and the GPU with the operators' shapes, and after step 5 the history is dumped to
    profile/rank0.steps_3-5.memory.pickle and stopped (enabled=None), after the dump; the line counts
    both files: 1500 + 600 bytes, 2.1 kB."""
    gpu = FakeGpu(monkeypatch, tmp_path)
    rank0 = SimpleNamespace(process_index=0, num_processes=1, is_main_process=True)
    cfg = RunConfig(output_dir=str(tmp_path), profile_steps="3:5", max_steps=8)
    window = ProfilerWindow(cfg, rank0, resumed_step=0)
    cuda_steps(window, gpu, 1, 6)
    folder = tmp_path / "profile"
    assert gpu.calls == [
        ("step done", {"step": 1}),
        ("_record_memory_history", {"max_entries": 200_000}),
        ("profile", {"activities": {FakeGpu.CPU, FakeGpu.CUDA}, "shapes": True}),
        ("profiler start", {}),
        ("step done", {"step": 2}),
        ("step done", {"step": 3}),
        ("step done", {"step": 4}),
        ("profiler stop", {}),
        ("trace", {"path": str(folder / "rank0.steps_3-5.pt.trace.json")}),
        ("_dump_snapshot", {"filename": str(folder / "rank0.steps_3-5.memory.pickle")}),
        ("_record_memory_history", {"enabled": None}),
        ("step done", {"step": 5}),
        ("step done", {"step": 6}),
    ]
    assert capsys.readouterr().out == (
        f"profile: steps 3-5 traced in {folder} (2 files, 2.1 kB: rank0.steps_3-5.pt.trace.json, "
        "rank0.steps_3-5.memory.pickle; the profiler's own messages: rank0.profiler.log)\n"
    )


def test_with_oom_snapshot_the_history_runs_from_the_start_and_the_window_leaves_it_on(
    tmp_path, monkeypatch, capsys
):
    """--oom_snapshot on a GPU: the history starts with the run (before any step), for an
    out-of-memory error's snapshot later; the window 2:2 starts it again as it opens (the same
    arguments) and, once it has dumped rank 1's own snapshot, leaves it on. Rank 1 says nothing."""
    gpu = FakeGpu(monkeypatch, tmp_path)
    rank1 = SimpleNamespace(
        process_index=1, num_processes=2, is_main_process=False, device=torch.device("cpu")
    )
    rank1.reduce = lambda tensor, how: tensor * 2  # the other rank's the same
    cfg = RunConfig(output_dir=str(tmp_path), profile_steps="2:2", max_steps=8, oom_snapshot=True)
    window = ProfilerWindow(cfg, rank1, resumed_step=0)
    assert gpu.calls == [("_record_memory_history", {"max_entries": 200_000})]
    gpu.calls.clear()
    cuda_steps(window, gpu, 1, 3)
    snapshot = tmp_path / "profile" / "rank1.steps_2-2.memory.pickle"
    assert [call for call in gpu.calls if call[0] != "step done"] == [
        ("_record_memory_history", {"max_entries": 200_000}),
        ("profile", {"activities": {FakeGpu.CPU, FakeGpu.CUDA}, "shapes": True}),
        ("profiler start", {}),
        ("profiler stop", {}),
        ("trace", {"path": str(tmp_path / "profile" / "rank1.steps_2-2.pt.trace.json")}),
        ("_dump_snapshot", {"filename": str(snapshot)}),
    ]
    assert snapshot.stat().st_size == 600
    assert capsys.readouterr().out == ""


def test_no_window_and_no_oom_snapshot_on_a_gpu_leaves_the_allocator_alone(tmp_path, monkeypatch):
    """Neither switch on a GPU: no memory history (it costs a little on every allocation), no profiler,
    no profile folder."""
    gpu = FakeGpu(monkeypatch, tmp_path)
    rank0 = SimpleNamespace(process_index=0, num_processes=1, is_main_process=True)
    window = ProfilerWindow(RunConfig(output_dir=str(tmp_path)), rank0, resumed_step=0)
    cuda_steps(window, gpu, 1, 3)
    window.close()
    assert [name for name, _ in gpu.calls] == ["step done"] * 3
    assert not (tmp_path / "profile").exists()


def test_the_count_of_every_rank_s_files_is_reduced_on_the_process_s_own_device(tmp_path, capsys):
    """A collective on GPUs (NCCL) takes tensors on the process's GPU: the [files, bytes] the window's
    line sums go to the reduce on plumbing.device (here the meta device stands for cuda:1)."""

    class Rank1:
        device = torch.device("meta")
        process_index, num_processes, is_main_process = 1, 2, False

        def __init__(self):
            self.devices = []

        def reduce(self, tensor, how):
            self.devices.append(tensor.device)
            return torch.tensor([2, 3000])

    rank1 = Rank1()
    cfg = RunConfig(output_dir=str(tmp_path), profile_steps="3:5", max_steps=8)
    window = ProfilerWindow(cfg, rank1, resumed_step=0)
    window.folder.mkdir()
    trace = window.folder / "rank1.steps_3-5.pt.trace.json"
    trace.write_bytes(b"x" * 1500)
    window.say_written([trace], every_rank=True)
    assert rank1.devices == [torch.device("meta")]
    assert capsys.readouterr().out == ""


def test_an_out_of_memory_error_writes_the_rank_s_memory_history_and_its_line_names_it(
    tmp_path, monkeypatch
):
    """--oom_snapshot on a GPU: the error's one line names <run>/profile/rank{RANK}.oom.memory.pickle,
    written first (the folders made, whatever of them is missing); RANK unset: rank 0's; a second error
    in the same folder writes again. No run folder, or no CUDA: no snapshot, nothing written."""
    gpu = FakeGpu(monkeypatch, tmp_path)
    monkeypatch.setenv("RANK", "3")
    run = tmp_path / "runs" / "x"  # not made yet
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore detail")
    line = str(out_of_memory(error, RunConfig(output_dir=str(run), oom_snapshot=True)))
    snapshot = run / "profile" / "rank3.oom.memory.pickle"
    assert line == (
        "out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB.): lower batch_size "
        "(raising grad_accum_steps keeps the global batch), or turn on activation_checkpointing; "
        f"what held the memory: {snapshot} (pytorch.org/memory_viz)"
    )
    assert gpu.calls == [("_dump_snapshot", {"filename": str(snapshot)})]
    assert snapshot.stat().st_size == 600
    monkeypatch.delenv("RANK")
    gpu.calls.clear()
    rank0 = run / "profile" / "rank0.oom.memory.pickle"
    assert write_oom_snapshot(str(run)) == str(rank0)
    assert gpu.calls == [("_dump_snapshot", {"filename": str(rank0)})]
    gpu.calls.clear()
    assert write_oom_snapshot("") is None
    gpu.available = False
    assert write_oom_snapshot(str(tmp_path / "cpu")) is None
    assert gpu.calls == [] and sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


def test_a_window_closed_before_its_first_step_is_done_is_named_for_no_whole_step(tmp_path, capsys):
    """The window 3:5 opened after step 2, the process ends (its exit handler: close) before step 3 is
    done: steps 3 to 2, none whole; the trace holds step 3's span as far as it went."""
    rank0 = SimpleNamespace(process_index=0, num_processes=1, is_main_process=True)
    cfg = RunConfig(output_dir=str(tmp_path), profile_steps="3:5", max_steps=8)
    window = ProfilerWindow(cfg, rank0, resumed_step=0)
    steps(window, 1, 2)
    torch.ones(8, 8, requires_grad=True).sum().backward()  # step 3's work, cut short
    window.close()
    folder = tmp_path / "profile"
    assert sorted(p.name for p in folder.iterdir()) == [
        "rank0.profiler.log",
        "rank0.steps_3-2.pt.trace.json",
    ]
    assert spans_of(folder / "rank0.steps_3-2.pt.trace.json") == ["train step 3"]
    assert capsys.readouterr().out.startswith(f"profile: steps 3-2 traced in {folder} (1 file, ")
