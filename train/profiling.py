"""Where the time goes: the throughput each log row reports (samples/s, tokens/s, MFU, peak memory), a
profiler window on demand, and where each start's seconds went.

The profiler window (--profile_steps START:END): steps START to END, both included and numbered as the
logs number them, recorded by torch.profiler on every rank into the run folder:

    <output_dir>/profile/rank0.steps_3-5.pt.trace.json     Chrome trace: chrome://tracing, ui.perfetto.dev,
                                                           or TensorBoard's profiler plugin (--logdir profile)
    <output_dir>/profile/rank0.steps_3-5.memory.pickle     CUDA only: the memory history of the same steps
                                                           (drag it into pytorch.org/memory_viz)

Each step is one `train step N` span, so the window's steps are easy to find, and its forward and backward
are the operators inside. Outside the window the profiler does not exist: the loop pays one integer
comparison per step. A run stopped inside the window writes what it recorded (at exit).

When the window closes, the main process says where the traces went in one line, e.g. `profile: steps
3-5 traced in runs/x/profile (2 files, 2.1 MB: rank{0..1}.steps_3-5.pt.trace.json; ...)`, their count
and size summed over every rank. What the profiler's C++ side prints (Kineto's `USDT:` lines at its
start and stop, its warnings) goes to `profile/rank{r}.profiler.log` instead of the console.

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
import ctypes
import os
import resource
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm

from blocks import flops_per_token
from errors import ConfigError
from run_folder import LAYOUT

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
        self.folder = Path(cfg.run_dir) / LAYOUT["profile"]
        # each node's own folder: node-local disks, or a run on object storage (its staging folder)
        self.on_each_node = not cfg.shared_filesystem or cfg.run_dir != cfg.output_dir
        self.plumbing = plumbing
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
                self.close(every_rank=True)
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
        with self.output_to_log():  # Kineto's line at its start
            self.profiler.__enter__()
        self.first_recorded = first_step
        self.last_recorded = first_step - 1
        self.step_span = torch.profiler.record_function(f"train step {first_step}")
        self.step_span.__enter__()
        atexit.register(self.close)  # a run stopped inside the window keeps what it recorded

    def close(self, every_rank: bool = False) -> None:
        """Write the trace (and the memory history) of the steps recorded, and say where in one line.
        `every_rank`: all ranks close together (the window's last step, not an exit), so the line
        counts all their files. Idempotent."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        if self.step_span is not None:
            self.step_span.__exit__(None, None, None)
            self.step_span = None
        name = f"rank{self.rank}.steps_{self.first_recorded}-{self.last_recorded}"
        written = [self.folder / f"{name}.pt.trace.json"]
        with self.output_to_log():  # Kineto's lines at its stop and while the trace is exported
            profiler.__exit__(None, None, None)
            profiler.export_chrome_trace(str(written[0]))
        if torch.cuda.is_available():
            written.append(self.folder / f"{name}.memory.pickle")
            torch.cuda.memory._dump_snapshot(str(written[-1]))
            if not self.keep_memory_history:
                torch.cuda.memory._record_memory_history(enabled=None)
        self.say_written(written, every_rank)

    def say_written(self, written: list[Path], every_rank: bool) -> None:
        """The main process's line: where the traces are, how many files and bytes (every rank's when
        `every_rank`: a collective, which also waits for the slowest rank's files)."""
        files = len(written)
        size = sum(path.stat().st_size for path in written)
        ranks = self.plumbing.num_processes if every_rank else 1
        if ranks > 1:
            mine = torch.tensor([files, size], dtype=torch.int64, device=self.plumbing.device)
            files, size = self.plumbing.reduce(mine, "sum").tolist()
        if not self.plumbing.is_main_process:
            return
        prefix = f"rank{self.rank}."
        if ranks > 1:
            prefix = f"rank{{0..{ranks - 1}}}."
        # the same names on every rank but for the rank's number
        names = [prefix + path.name.split(".", 1)[1] for path in [*written, self.log_file]]
        where = f"{self.folder} on each node" if self.on_each_node else str(self.folder)
        line = f"profile: steps {self.first_recorded}-{self.last_recorded} traced in {where} "
        noun = "file" if files == 1 else "files"
        line += f"({files} {noun}, {readable_size(size)}: {', '.join(names[:-1])}"
        if self.plumbing.num_processes > ranks:  # at exit: the other ranks write their own
            line += ", and each other rank's"
        tqdm.write(f"{line}; the profiler's own messages: {names[-1]})")

    @property
    def log_file(self) -> Path:
        return self.folder / f"rank{self.rank}.profiler.log"

    @contextmanager
    def output_to_log(self):
        """Whatever the process prints meanwhile goes to this rank's profiler.log: Kineto (the
        profiler's C++ side) writes to file descriptor 2 itself, past sys.stderr, so the descriptors are
        redirected. Python's and C's buffers are flushed on both sides, so no console line is lost or
        lands out of order."""
        self.folder.mkdir(parents=True, exist_ok=True)
        flush_all()
        kept = {fd: os.dup(fd) for fd in (1, 2)}
        try:
            with open(self.log_file, "ab") as log:
                for fd in kept:
                    os.dup2(log.fileno(), fd)
                yield
        finally:
            flush_all()
            for fd, copy in kept.items():
                os.dup2(copy, fd)
                os.close(copy)


def flush_all() -> None:
    """Python's stdout and stderr, then C's stdio buffers (fflush(NULL)): what was written so far
    goes where its descriptor points now."""
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)


def readable_size(size: int) -> str:
    """Bytes as a person reads them: 1.2 MB, 830.0 kB (decimal units, as ls -h --si)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def start_memory_history() -> None:
    torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)


def write_oom_snapshot(run_dir: str) -> str | None:
    """After a CUDA out-of-memory error with --oom_snapshot: the memory history, for the error's line."""
    if not (run_dir and torch.cuda.is_available()):
        return None
    folder = Path(run_dir) / LAYOUT["profile"]
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


# ---------------------------------------------------------------- throughput


class Throughput:
    """Samples/s, step time, peak memory, and where the task counts tokens (model.py's
    tokens_per_sample) tokens/s and, on GPUs, MFU; since the last report or restart."""

    def __init__(
        self,
        samples_per_step: int,
        tokens_per_sample: int | None,
        model: torch.nn.Module,
        num_processes: int,
        mixed_precision: str,
    ):
        self.samples_per_step = samples_per_step
        self.tokens_per_step = samples_per_step * tokens_per_sample if tokens_per_sample else None
        self.on_gpu = torch.cuda.is_available()
        peak = peak_flops_per_gpu(torch.cuda.get_device_name()) if self.on_gpu else None
        # MFU is against the bf16 tensor-core peak, so only quoted for bf16/fp16 runs; none on CPU
        self.peak_flops = peak * num_processes if peak and mixed_precision != "no" else None
        self.flops_per_token = flops_per_token(model)  # the model's own estimate, or 6 x parameters
        self.restart()

    def seen(self, step: int) -> dict:
        """What the run has trained on by `step`: samples, and tokens where the task counts them."""
        seen = {"samples_seen": step * self.samples_per_step}
        if self.tokens_per_step:
            seen["tokens_seen"] = step * self.tokens_per_step
        return seen

    def restart(self) -> None:  # after eval and checkpoints, which are not training time
        self.start = time.perf_counter()
        self.steps = 0

    def step(self) -> None:
        self.steps += 1

    def report(self) -> dict:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        rates = {
            "samples_per_s": self.steps * self.samples_per_step / elapsed,
            "step_time_s": elapsed / max(self.steps, 1),
        }
        if self.tokens_per_step:
            rates["tokens_per_s"] = self.steps * self.tokens_per_step / elapsed
        if self.peak_flops and self.tokens_per_step:
            rates["mfu"] = rates["tokens_per_s"] * self.flops_per_token / self.peak_flops
        # this process's (rank 0's, in metrics.jsonl): what DDP replicates and FSDP shards
        if self.on_gpu:
            rates["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        else:  # the process's peak resident memory, libraries included (Linux reports KiB)
            rates["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        self.restart()
        return rates


# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, from the vendors' data sheets. Matched in
# order against torch.cuda.get_device_name(); a GPU that is not listed gets no MFU figure rather
# than a wrong one.
PEAK_BF16_FLOPS = [
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
]


def peak_flops_per_gpu(device_name: str) -> float | None:
    return next((flops for name, flops in PEAK_BF16_FLOPS if name in device_name), None)
