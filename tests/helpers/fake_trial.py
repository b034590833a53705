"""A stand-in for a training run, for scripts/sweep.py's quick tests: the contract the sweep's driver relies on,
in milliseconds instead of seconds. The real runs are in tests/e2e/test_sweep.py.

    python tests/helpers/fake_trial.py --output_dir DIR [--resume latest] [--lr X] ... [any --key value]

Writes DIR/metrics.jsonl as train/main.py does: a training row per step, an eval row (eval_loss = lr x 100 +
1 / step, so a bigger lr is worse) every 4 steps, 12 steps of 0.05 s; on SIGTERM, DIR/preempted.json and exit
75 (a preempted run); DIR/argv.jsonl gets each launch's flags. FAKE_FAIL_ONCE=path: the first trial to
create `path` fails after step 2, with an `error:` line and exit 1.
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
    with open(run / "argv.jsonl", "a") as f:
        f.write(json.dumps(argv) + "\n")

    def preempted(*_):
        (run / "preempted.json").write_text(json.dumps({"step": step, "signal": "SIGTERM"}))
        sys.exit(75)

    step = 0
    signal.signal(signal.SIGTERM, preempted)
    lr = float(flags.get("--lr", "0.01"))
    fail_once = os.environ.get("FAKE_FAIL_ONCE")
    fails = bool(fail_once) and not Path(fail_once).exists()
    if fails:
        Path(fail_once).touch()
    with open(run / "metrics.jsonl", "a", buffering=1) as metrics:
        for step in range(1, STEPS + 1):
            time.sleep(0.05)
            metrics.write(json.dumps({"step": step, "loss": 1.0 / step}) + "\n")
            if step % EVAL_EVERY == 0:
                metrics.write(json.dumps({"step": step, "eval_loss": lr * 100 + 1.0 / step}) + "\n")
            if fails and step == 2:
                print(f"error: loss is nan at step {step}: training diverged", file=sys.stderr)
                sys.exit(1)


if __name__ == "__main__":
    main()
