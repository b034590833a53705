"""A stand-in for a training run, for scripts/sweep.py's quick tests: the contract the sweep's driver relies on,
in milliseconds instead of seconds. The real runs are in tests/e2e/test_sweep.py.

    python tests/helpers/fake_trial.py --output_dir DIR [--resume latest] [--lr X] ... [any --key value]

Writes DIR/metrics.jsonl as train/main.py does: a training row per step, an eval row (eval_loss = lr x 100 +
1 / step, so a bigger lr is worse) every 4 steps, 12 steps of 0.05 s; on SIGTERM, DIR/preempted.json and exit
75 (a preempted run); DIR/argv.jsonl gets each launch's flags, DIR/stdin.txt what its input is.
FAKE_FAIL_ONCE=path: the first trial to create `path` fails after step 2, with an `error:` line and exit 1.
FAKE_PREEMPT_ONCE=path: the first trial to create `path` is stopped after step 2 as under accelerate launch
or torchrun: preempted.json, and exit 1 (the launcher's code). A start removes the preempted.json an earlier
one left, as train/main.py does.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

STEPS = 12
EVAL_EVERY = 4


def main() -> None:
    argv = sys.argv[1:]
    flags = dict(zip(argv[::2], argv[1::2], strict=True))
    run = Path(flags["--output_dir"])
    run.mkdir(parents=True, exist_ok=True)
    (run / "preempted.json").unlink(missing_ok=True)
    with open(run / "argv.jsonl", "a") as f:
        f.write(json.dumps(argv) + "\n")
    # what this process's input is (the sweep's test reads it: /dev/null, not the driver's console)
    (run / "stdin.txt").write_text(os.readlink("/proc/self/fd/0"))

    def preempted(*_):
        (run / "preempted.json").write_text(json.dumps({"step": step, "signal": "SIGTERM"}))
        sys.exit(75)

    step = 0
    signal.signal(signal.SIGTERM, preempted)
    lr = float(flags.get("--lr", "0.01"))
    fails, stops = (
        first_to_create(os.environ.get(name)) for name in ("FAKE_FAIL_ONCE", "FAKE_PREEMPT_ONCE")
    )
    with open(run / "metrics.jsonl", "a", buffering=1) as metrics:
        for step in range(1, STEPS + 1):
            time.sleep(0.05)
            metrics.write(json.dumps({"step": step, "loss": 1.0 / step}) + "\n")
            if step % EVAL_EVERY == 0:
                metrics.write(json.dumps({"step": step, "eval_loss": lr * 100 + 1.0 / step}) + "\n")
            if fails and step == 2:
                print(f"error: loss is nan at step {step}: training diverged", file=sys.stderr)
                sys.exit(1)
            if stops and step == 2:
                (run / "preempted.json").write_text(json.dumps({"step": step, "signal": "SIGTERM"}))
                sys.exit(1)


def first_to_create(path: str | None) -> bool:
    """Whether this launch is the first to create `path` (it creates it)."""
    if not path or Path(path).exists():
        return False
    Path(path).touch()
    return True


if __name__ == "__main__":
    main()
