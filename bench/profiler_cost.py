"""What --profile_steps costs: outside its window (the loop's one call per step, timed alone), and inside it (the
steps recorded, against the same run's steps around them).

    python bench/profiler_cost.py                      # the default job (tiny preset), 1 process, CPU
    python bench/profiler_cost.py -- --n_layer 12 --n_embd 768 --block_size 256    # any train/main.py flags

One run of train/main.py with --log_every 1 and a window of 5 steps in its middle: each logged step's
step_time_s, inside the window and outside it (the steps before the window and after it, less the first 10,
which warm up). Then ProfilerWindow.step_done outside a window, timed a million times in this process: that
is all the loop pays for the switch on the steps it does not record.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("train_args", nargs="*", help="train/main.py flags, after --")
    args = parser.parse_args()
    first, last = args.steps // 2, args.steps // 2 + 4
    with tempfile.TemporaryDirectory() as folder:
        run = Path(folder) / "run"
        command = [
            sys.executable,
            str(REPO / "train" / "main.py"),
            *("--config", str(REPO / "train" / "configs" / "tiny.yaml")),
            *("--output_dir", str(run), "--max_steps", str(args.steps), "--log_every", "1"),
            *("--eval_every", str(10 * args.steps), "--save_every", "0"),
            *("--profile_steps", f"{first}:{last}"),
            *args.train_args,
        ]
        subprocess.run(command, check=True, capture_output=True, cwd=REPO)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        times = {row["step"]: row["step_time_s"] for row in rows if "step_time_s" in row}
        inside = [
            times[step] for step in range(first + 1, last + 1)
        ]  # the window's first span opens late
        outside = [
            s for step, s in times.items() if step > 10 and not first - 1 <= step <= last + 1
        ]
        traces = sorted(p.name for p in (run / "profile").iterdir())
    sys.path.insert(0, str(REPO / "train"))
    from profiling import ProfilerWindow

    cfg = SimpleNamespace(
        profile_steps="1000000:1000005", oom_snapshot=False, run_dir=".", max_steps=10**9
    )
    window = ProfilerWindow(cfg, SimpleNamespace(process_index=0), resumed_step=0)
    calls = 1_000_000
    per_call_s = timeit.timeit(lambda: window.step_done(123), number=calls) / calls
    median_out = statistics.median(outside)
    print(f"steps outside the window: median {median_out * 1e3:.2f} ms ({len(outside)} steps)")
    print(
        f"steps inside the window:  median {statistics.median(inside) * 1e3:.2f} ms "
        f"({statistics.median(inside) / median_out:.2f}x); traces: {', '.join(traces)}"
    )
    print(
        f"the switch outside a window: {per_call_s * 1e9:.0f} ns a step "
        f"({per_call_s / median_out:.1e} of a step)"
    )


if __name__ == "__main__":
    main()
