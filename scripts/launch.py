"""`accelerate launch`, as the template's own processes end: the same arguments, the workers' output as
it comes, and the job's exit code and one line, which the launcher otherwise buries.

    python scripts/launch.py --config_file accelerate_configs/cpu.yaml train/main.py [flags]

Under `accelerate launch` (and torchrun) the training processes stop as the README says (75 after a
preemption's checkpoint, 130 after Ctrl-C's, 2 on a refused input, each failure in one `error:` line), but
the launcher reports every such end as its own failure: exit 1, with a ~40-line ChildFailedError summary
(or, on Ctrl-C and SIGTERM, a SignalException traceback) after the line that matters. This runs the
launcher as a child, passes SIGTERM and SIGUSR1 on to it (and has it pass SIGUSR1 on to the workers,
which torch elastic's launcher does not by default; Ctrl-C reaches every process of the terminal's group
by itself), prints every line but the launcher's own traceback, summary and log lines, and exits
with the code the job meant: the failed worker's exit code from the summary, else the stop the workers
reported, else the launcher's.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass

# frames only the launcher runs: its entry points, and torch elastic's agent, whose signal handler raises
# SignalException wherever the launcher happens to be (in its metrics wrapper, its monitor loop, ...)
LAUNCHER_FRAME = re.compile(
    r"accelerate/commands/launch\.py"
    r"|torch/distributed/(run|launcher)"
    r"|torch/distributed/elastic/(agent|metrics|multiprocessing/api)"
)
LAUNCHER_LOG = re.compile(r"^[WEI]\d{4} [\d:.]+ \d+ .*torch/distributed/")
EXIT_CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
STOPPED = re.compile(r"^(stopping at step \d+|stopped during start-up) on (SIGTERM|SIGUSR1|SIGINT)")
STOP_CODES = {"SIGTERM": 75, "SIGUSR1": 75, "SIGINT": 130}


def main(argv: list[str]) -> int:
    command = [sys.executable, "-m", "accelerate.commands.launch", *argv]
    launcher = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=launcher_environment(os.environ),
    )

    def pass_on(signum, _frame):
        launcher.send_signal(signum)

    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGUSR1, pass_on)
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # the launcher and the workers get Ctrl-C themselves
    relayed = relay(launcher.stdout, sys.stdout)
    code = launcher.wait()
    if code == 0:
        return 0
    if relayed.failed_code is not None and relayed.failed_code > 1:  # 2, 75, 130: the worker's own
        return relayed.failed_code
    return relayed.stopped_code or code


def launcher_environment(environment) -> dict:
    """The environment, with SIGUSR1 among the signals torch elastic's launcher passes on to the
    workers (PET_SIGNALS_TO_HANDLE, by default SIGTERM, SIGINT, SIGHUP and SIGQUIT): SIGUSR1 (SLURM's
    --signal=USR1@N) would otherwise kill the launcher, and the workers would stop on its death, not
    on the preemption (no preempted.json, and exit -10 from here)."""
    handled = environment.get("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    names = [name.strip() for name in handled.split(",") if name.strip()]
    if "SIGUSR1" not in names:
        names.append("SIGUSR1")
    return {**environment, "PET_SIGNALS_TO_HANDLE": ",".join(names)}


@dataclass
class Relayed:
    stopped_code: int | None = None  # the stop the workers reported (75, 130)
    failed_code: int | None = (
        None  # the first failed worker's exit code, from the launcher's summary
    )


def relay(lines, out) -> Relayed:
    """Writes each line to `out` but the launcher's own: its log lines, and from the first traceback whose
    frames are the launcher's, everything after (its SignalException, ChildFailedError summary). A worker's
    traceback is written whole. Reads the exit codes the output tells on the way."""
    relayed = Relayed()
    root_cause = False
    held: list[str] = []  # a traceback's first lines, until its frames say whose it is
    launchers = False  # inside the launcher's traceback and summary: to the end
    for line in lines:
        if (match := STOPPED.match(line)) is not None:
            relayed.stopped_code = STOP_CODES[match.group(2)]
        root_cause = root_cause or line.startswith("Root Cause")  # the summary's first failure
        if root_cause and relayed.failed_code is None and (match := EXIT_CODE.match(line)):
            relayed.failed_code = int(match.group(1))
        if launchers or LAUNCHER_LOG.match(line):
            continue
        if line.startswith("Traceback (most recent call last)") or held:
            held.append(line)
            if LAUNCHER_FRAME.search(line):
                launchers = True
            elif len(held) > 4:
                out.writelines(held)
                held = []
            continue
        out.write(line)
        out.flush()
    out.writelines([] if launchers else held)
    return relayed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
