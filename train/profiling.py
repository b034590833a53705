"""Where the time goes: a profiler window on demand, and where each start's seconds went.

The profiler window (--profile_steps START:END): steps START to END, both included and numbered as the
logs number them, recorded by torch.profiler on every rank into the run folder:

    <output_dir>/profile/rank0.steps_3-5.pt.trace.json     Chrome trace: chrome://tracing, ui.perfetto.dev,
                                                           or TensorBoard's profiler plugin (--logdir profile)
    <output_dir>/profile/rank0.steps_3-5.memory.pickle     CUDA only: the memory history of the same steps
                                                           (drag it into pytorch.org/memory_viz)

Each step is one `train step N` span, so the window's steps are easy to find, and its forward and backward
are the operators inside. Outside the window the profiler does not exist: the loop pays one integer
comparison per step. A run stopped inside the window writes what it recorded (at exit).

--oom_snapshot (CUDA): the memory history is recorded from the first step, and an out-of-memory error
writes `<output_dir>/profile/rank{r}.oom.memory.pickle` before the job's one `error:` line names it. The
CUDA parts are untested on the CPU machines the suite runs on (the window's trace is tested).

The restart report: every start times its phases (the clock below: imports, checks, process group, data,
model, compiled-code cache, checkpoint download and load, data position, trackers, first step) and, after
its first step, writes one metrics.jsonl row and one console line (tracking.MetricsLogger.start_report),
with the steps lost since the checkpoint it resumed from.
"""

from __future__ import annotations

import atexit
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from errors import ConfigError

PROFILE_FOLDER = "profile"
MEMORY_HISTORY_ENTRIES = (
    200_000  # CUDA allocation events kept (the newest): a few hundred MB at most
)


def profile_window(cfg) -> tuple[int, int] | None:
    """--profile_steps as (START, END), both included; None when off. A bad value is ConfigError."""
    if not cfg.profile_steps:
        return None
    start, colon, end = cfg.profile_steps.partition(":")
    problem = None
    if not (colon and start.strip().isdigit() and end.strip().isdigit()):
        problem = "must be START:END, the first and the last step to record, e.g. 10:12"
    elif not 1 <= int(start) <= int(end):
        problem = "needs 1 <= START <= END"
    elif int(start) > cfg.max_steps:
        problem = f"starts after max_steps ({cfg.max_steps}): the window would never open"
    if problem:
        raise ConfigError(f"profile_steps {problem} (got {cfg.profile_steps!r})")
    return int(start), int(end)


class ProfilerWindow:
    """torch.profiler over the steps of --profile_steps, on this rank. `step_done(step)` after each
    optimizer step; the window opens after step START - 1 (or here, when the run starts or resumes
    inside it) and closes after step END, or at exit."""

    def __init__(self, cfg, plumbing, resumed_step: int):
        self.window = profile_window(cfg)  # (START, END), or None
        self.folder = Path(cfg.run_dir) / PROFILE_FOLDER
        self.rank = plumbing.process_index
        self.profiler = None
        self.step_span = None
        self.first_recorded = 0
        self.last_recorded = 0  # the last step done inside the window
        # --oom_snapshot: the history from the first step, for an out-of-memory error's snapshot
        self.keep_memory_history = cfg.oom_snapshot and torch.cuda.is_available()
        if self.keep_memory_history:
            start_memory_history()
        if self.window is not None and self.window[0] - 1 <= resumed_step < self.window[1]:
            self._open(resumed_step + 1)

    def step_done(self, step: int) -> None:
        if self.window is None:
            return
        if self.profiler is not None:
            self.step_span.__exit__(None, None, None)
            self.last_recorded = step
            if step >= self.window[1]:
                self.close()
                return
            self.step_span = torch.profiler.record_function(f"train step {step + 1}")
            self.step_span.__enter__()
        elif step == self.window[0] - 1:
            self._open(step + 1)

    def _open(self, first_step: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            start_memory_history()
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self.profiler.__enter__()
        self.first_recorded = first_step
        self.last_recorded = first_step - 1
        self.step_span = torch.profiler.record_function(f"train step {first_step}")
        self.step_span.__enter__()
        atexit.register(self.close)  # a run stopped inside the window keeps what it recorded

    def close(self) -> None:
        """Write the trace (and the memory history) of the steps recorded. Idempotent."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        if self.step_span is not None:
            self.step_span.__exit__(None, None, None)
            self.step_span = None
        profiler.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"rank{self.rank}.steps_{self.first_recorded}-{self.last_recorded}"
        profiler.export_chrome_trace(str(self.folder / f"{name}.pt.trace.json"))
        if torch.cuda.is_available():
            torch.cuda.memory._dump_snapshot(str(self.folder / f"{name}.memory.pickle"))
            if not self.keep_memory_history:
                torch.cuda.memory._record_memory_history(enabled=None)


def start_memory_history() -> None:
    torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)


def write_oom_snapshot(run_dir: str) -> str | None:
    """After a CUDA out-of-memory error with --oom_snapshot: the memory history, for the error's line."""
    if not (run_dir and torch.cuda.is_available()):
        return None
    folder = Path(run_dir) / PROFILE_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{os.environ.get('RANK', '0')}.oom.memory.pickle"
    torch.cuda.memory._dump_snapshot(str(path))
    return str(path)


# ---------------------------------------------------------------- the restart report's clock


class StartClock:
    """This process's start, phase by phase. `lap(name)`: the time since the previous lap was `name`'s
    (less what `phase` timed inside it); `phase(name)`: the time inside is `name`'s, wherever it nests.
    Both add up, so a phase met twice (data: loading, then the loaders) is one figure."""

    def __init__(self):
        self.begun = process_started()
        self.last_lap = self.begun
        self.nested = 0.0
        self.phases: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.time()
        self._add(name, now - self.last_lap - self.nested)
        self.last_lap = now
        self.nested = 0.0

    @contextmanager
    def phase(self, name: str):
        began = time.time()
        try:
            yield
        finally:
            took = time.time() - began
            self._add(name, took)
            self.nested += took

    def finish(self, row: dict) -> dict:
        """The restart report's row: `row` (tracking.py's: the start's number, the step it resumed from,
        the steps lost) with the seconds since the process started and each phase's, after the first
        step's lap."""
        self.lap("first step")
        phases = {f"start_{name.replace(' ', '_')}_s": took for name, took in self.phases.items()}
        rounded = {key: round(took, 3) for key, took in phases.items()}
        return {**row, "start_s": round(time.time() - self.begun, 3), **rounded}

    def _add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + max(seconds, 0.0)


def restart_line(row: dict) -> str:
    """The restart report's console line, from its row."""
    phases = [
        f"{key[len('start_') : -len('_s')].replace('_', ' ')} {took:.1f} s"
        for key, took in row.items()
        if key.startswith("start_") and key.endswith("_s") and key != "start_s" and took >= 0.05
    ]
    line = f"start {row['start']}: {row['start_s']:.1f} s to the first step ({', '.join(phases)})"
    if row["resumed_from_step"]:
        line += f"; resumed at step {row['resumed_from_step']}, {row['steps_lost']} steps lost"
    if "compile_graphs_compiled" in row:
        compiled, cached = row["compile_graphs_compiled"], row["compile_graphs_cached"]
        line += f"; {compiled} graphs compiled, {cached} from the kept cache"
    return line


def process_started() -> float:
    """When this process started, in time.time()'s seconds: from /proc on Linux (so that the imports
    count; to 10 ms), else now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


start_clock = StartClock()  # the process's one: the modules that do a phase mark it
