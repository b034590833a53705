"""A stop signal that reaches a DataLoader worker leaves it to the training process (stopping.py).

Launchers and schedulers signal whole process groups or job steps, loader workers included; the
training process must live on to checkpoint, so its workers must too. These run real DataLoaders with
worker processes under each start method: `fork` (Linux's default before Python 3.14), where a worker
starts with torch's SIGTERM handler and its parent is the training process; `spawn`, where it starts
with Python's defaults; and `forkserver` (3.14's default), where its parent is the fork server.
"""

import importlib.util
import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch.utils.data import DataLoader

import job
import stopping
from conftest import REPO

STOPS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def loader(start_method: str, monkeypatch) -> DataLoader:
    """A loader with the options main.py gives its loaders, under `start_method`."""
    monkeypatch.setattr(
        stopping.multiprocessing, "get_start_method", lambda allow_none: start_method
    )
    options = stopping.loader_worker_options(num_workers=2)
    return DataLoader(list(range(64)), batch_size=4, num_workers=2, **options)


def send_from_another_process(signum: int, pids: list[int]) -> None:
    """As a launcher or a scheduler does: the sender is not the workers' parent."""
    subprocess.run(["kill", f"-{signum}", *map(str, pids)], check=True)


@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_loader_workers_outlive_stop_signals_and_every_batch_still_comes(start_method, monkeypatch):
    batches = iter(loader(start_method, monkeypatch))
    first = next(batches)
    workers = [worker.pid for worker in batches._workers]
    for signum in STOPS:
        send_from_another_process(signum, workers)
    time.sleep(0.5)  # a worker that dies of it is gone by now
    dead = [pid for pid in workers if not alive(pid)]
    assert not dead, f"loader workers {dead} died of a stop signal meant for their trainer"
    # the training process's own iteration goes on to the end, every sample once
    assert torch.cat([first, *batches]).tolist() == list(range(64))


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_loader_worker_still_ends_on_its_own_process_sigterm(start_method, monkeypatch):
    """torch ends a worker that does not finish with SIGTERM from the training process (at shutdown), and
    so does multiprocessing at the training process's exit: that one still ends it, at once. Under
    forkserver the worker's parent is the fork server, not the training process (a worker that took
    SIGTERM from its parent only would hang the training process's exit)."""
    batches = iter(loader(start_method, monkeypatch))
    next(batches)
    worker = batches._workers[0]
    os.kill(worker.pid, signal.SIGTERM)  # from the training process
    worker.join(timeout=5)
    assert worker.exitcode == 0, "a loader worker did not end on its own process's SIGTERM"
    batches._shutdown_workers()


def test_a_loader_worker_killed_from_outside_is_one_line_and_exit_1(tmp_path):
    """The out-of-memory killer's SIGKILL to a DataLoader worker (here the worker kills itself on its
    third sample): job.run_or_exit turns torch's RuntimeError into one `error:` line, exit 1. torch
    says "is killed by signal" or "exited unexpectedly", as its signal handler or its poll sees it first."""
    script = tmp_path / "dies.py"
    script.write_text(
        "import os, signal, sys\n"
        f"sys.path.insert(0, {str(REPO / 'train')!r})\n"
        "import torch\n"
        "from torch.utils.data import DataLoader\n"
        "import job\n"
        "class Dies(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n"
        "        return 100\n"
        "    def __getitem__(self, index):\n"
        "        if index == 2:\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n"
        "        return index\n"
        "def train(cfg, plumbing):\n"
        "    for _ in DataLoader(Dies(), num_workers=1):\n"
        "        pass\n"
        "job.run_or_exit(train, None, lambda cfg: None)\n"
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1, result.stderr[-2000:]
    # torch's RuntimeError ("DataLoader worker (pid N) is killed by signal"), or under load the reset
    # of the connection that hands the batch over first: the same line
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "a data loader worker died, most often of the out-of-memory killer" in lines[0], lines
    assert "--resume latest" in lines[0]


def test_a_reset_connection_inside_the_loader_is_a_dead_worker_and_elsewhere_an_oserror():
    """What the training process meets when the worker dies while handing a batch over."""

    def raised_in(filename: str) -> ConnectionResetError:
        code = compile(
            "raise ConnectionResetError(104, 'Connection reset by peer')", filename, "exec"
        )
        try:
            exec(code)
        except ConnectionResetError as e:
            return e

    inside = raised_in(os.path.join("site-packages", "torch", "utils", "data", "dataloader.py"))
    line = str(job.loader_connection_lost(inside))
    assert line.startswith(
        "a DataLoader worker's connection was lost ([Errno 104] Connection reset"
    )
    assert "a data loader worker died" in line
    assert job.loader_connection_lost(raised_in("train/storage.py")) is None  # a store's, say
    ended = EOFError()  # the other way the handshake with a dead worker fails
    ended.__traceback__ = inside.__traceback__
    assert str(job.loader_connection_lost(ended)).startswith(
        "a DataLoader worker's connection was lost (EOFError): a data loader worker died"
    )
    assert job.loader_connection_lost(OSError(28, "No space left on device")) is None


RAISED_AGAIN = {
    # torch's SIGCHLD handler raising again where the issue saw it: a non-zero rank's exit_with_error,
    # at its signal.signal(...) call
    "at signal.signal": (
        "1",
        "real_signal = job.signal.signal\n"
        "def signal_once(*args):\n"
        "    if not raised:\n"
        "        raised.append(1)\n"
        "        raise again\n"
        "    return real_signal(*args)\n"
        "job.signal.signal = signal_once\n",
    ),
    # rank 0, while it prints its line
    "at the line": (
        "0",
        "import builtins\n"
        "real_print = builtins.print\n"
        "def print_once(*args, **kwargs):\n"
        "    if not raised:\n"
        "        raised.append(1)\n"
        "        raise again\n"
        "    return real_print(*args, **kwargs)\n"
        "builtins.print = print_once\n",
    ),
    # in the cleanup that runs while the first error goes up (the process group's close)
    "at the cleanup": (
        "0",
        "def close_once():\n"
        "    if not raised:\n"
        "        raised.append(1)\n"
        "        raise again\n"
        "job.close_process_group = close_once\n",
    ),
}


@pytest.mark.parametrize("where", sorted(RAISED_AGAIN))
def test_a_dead_loader_worker_raised_again_inside_the_error_path_is_still_one_line(tmp_path, where):
    """The race itself: torch's SIGCHLD handler raises "DataLoader worker (pid N) is killed by signal"
    a second time while the first is being reported (forced here at three places of the error
    path). Still exactly one `error:` line, exit 1, no traceback."""
    rank, injection = RAISED_AGAIN[where]
    script = tmp_path / "raises_again.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(REPO / 'train')!r})\n"
        "import job\n"
        "job.OTHER_RANKS_ERROR_DELAY_S = 0.1\n"
        "death = 'DataLoader worker (pid 4242) is killed by signal: Killed. '\n"
        "again = RuntimeError(death)\n"
        "raised = []\n"
        "def arm():\n" + textwrap.indent(injection, "    ") + "def train(cfg, plumbing):\n"
        "    arm()  # from here on, the error path is where the raise comes\n"
        "    raise RuntimeError(death)\n"
        "job.run_or_exit(train, None, lambda cfg: None)\n"
    )
    env = {**os.environ, "RANK": rank}
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1, result.stderr[-2000:]
    assert lines == [
        "error: DataLoader worker (pid 4242) is killed by signal: Killed: a data loader worker "
        "died, most often of the out-of-memory killer (fewer --num_workers, or less memory per "
        "sample); the last checkpoint is intact: --resume latest"
    ], result.stderr[-3000:]


class OtherRankVoted:
    """The vote's all-reduce as a rank that got no signal sees it: the other rank's vote for
    `cause` (one count in STOP_CAUSES' order), this rank's own zeros added."""

    device = torch.device("cpu")

    def __init__(self, cause: str):
        self.others = torch.tensor([float(c == cause) for c in stopping.STOP_CAUSES])

    def reduce(self, votes, op):
        assert op == "sum"
        return votes + self.others


@pytest.mark.parametrize("cause, code", [("SIGINT", 130), ("SIGUSR1", 75), ("SIGTERM", 75)])
def test_a_rank_that_got_no_signal_takes_the_cause_the_others_voted_and_its_exit_code(cause, code):
    """By hand, the README's codes: Ctrl-C on one rank makes every rank exit 130 (no requeue), a
    preemption's signal 75; the rank without a signal says and exits as the one that got it."""
    signals = stopping.StopSignals()  # this rank: no signal
    assert signals.requested(OtherRankVoted(cause)) is True
    assert (signals.signal_name, signals.exit_code) == (cause, code)
    assert stopping.StopSignals().requested(OtherRankVoted("none")) is False


SITE = "/usr/lib/python3.11/site-packages"
STOPPED = (
    "stopping at step 7 on SIGTERM, checkpoint saved: continue with python scripts/launch.py ...\n"
)


def launch_script():
    spec = importlib.util.spec_from_file_location("launch", REPO / "scripts" / "launch.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["launch"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def traceback_from(*frames: str, last: str) -> list[str]:
    lines = ["Traceback (most recent call last):\n"]
    for frame in frames:
        lines += [f'  File "{frame}", line 86, in somewhere\n', "    start = time.time()\n"]
        lines += ["            ^^^^^^^^^^^\n"]
    return [*lines, last + "\n"]


@pytest.mark.parametrize(
    "where_the_signal_lands",
    [
        # its entry point, its monitor loop, and (as in a CI run) its metrics wrapper, where the
        # signal handler's frame comes second
        [f"{SITE}/accelerate/commands/launch.py"],
        [f"{SITE}/torch/distributed/elastic/agent/server/api.py"],
        [
            f"{SITE}/torch/distributed/elastic/metrics/api.py",
            f"{SITE}/torch/distributed/elastic/multiprocessing/api.py",
        ],
        # in the wrapper's own put_metric, just after the wrapped call returned, then a second
        # signal while the wrapper handles the first (under SLURM the launcher gets SIGTERM twice:
        # the step's own, and launch.py's pass-on): two metrics frames fill the lines held (the
        # handler's frame is the 8th line), so the metrics frames alone must say whose it is
        [
            f"{SITE}/torch/distributed/elastic/metrics/api.py",
            f"{SITE}/torch/distributed/elastic/metrics/api.py",
            f"{SITE}/torch/distributed/elastic/multiprocessing/api.py",
        ],
    ],
)
def test_scripts_launch_drops_the_launcher_s_traceback_wherever_the_signal_lands(
    where_the_signal_lands,
):
    signal_exception = (
        "torch.distributed.elastic.multiprocessing.api.SignalException: got signal: 15"
    )
    output = [
        "step 7/120 | loss 4.26\n",
        STOPPED,
        *traceback_from(*where_the_signal_lands, last=signal_exception),
        "\n",
        "During handling of the above exception, another exception occurred:\n",
        *traceback_from(f"{SITE}/torch/distributed/run.py", last="ChildFailedError:"),
        "  exitcode  : 75 (pid: 31151)\n",
    ]
    written = io.StringIO()
    relayed = launch_script().relay(output, written)
    assert written.getvalue() == "step 7/120 | loss 4.26\n" + STOPPED
    assert relayed.stopped_code == 75


@pytest.mark.parametrize("signal_name, code", [("SIGTERM", 75), ("SIGUSR1", 75), ("SIGINT", 130)])
def test_scripts_launch_reads_a_stop_during_start_up_as_that_stop(signal_name, code):
    """The README's codes, by hand: 75 after a preemption's signal, 130 after Ctrl-C, also when the
    job stopped before its first step (job.py's start-up line) and the launcher's summary has no Root
    Cause to read a worker's code from."""
    stopped = (
        f"stopped during start-up on {signal_name}: nothing trained yet; start again with: "
        "python scripts/launch.py ...\n"
    )
    signal_exception = (
        "torch.distributed.elastic.multiprocessing.api.SignalException: got signal: 15"
    )
    output = [
        stopped,
        *traceback_from(f"{SITE}/torch/distributed/run.py", last=signal_exception),
    ]
    written = io.StringIO()
    relayed = launch_script().relay(output, written)
    assert written.getvalue() == stopped
    assert (relayed.stopped_code, relayed.failed_code) == (code, None)


def test_scripts_launch_writes_a_worker_s_traceback_whole():
    """A bug in the job is the person's to read: its traceback passes through, then the launcher's
    summary (Root Cause, the failed worker's exit code) is dropped and read."""
    workers = traceback_from(
        str(REPO / "train" / "main.py"),
        str(REPO / "train" / "loop.py"),
        f"{SITE}/torch/distributed/distributed_c10d.py",
        last="RuntimeError: a bug",
    )
    summary = traceback_from(f"{SITE}/torch/distributed/run.py", last="ChildFailedError:")
    summary += ["Root Cause (first observed failure):\n", "  exitcode  : 1 (pid: 2)\n"]
    written = io.StringIO()
    relayed = launch_script().relay([*workers, *summary], written)
    assert written.getvalue() == "".join(workers)
    assert relayed.failed_code == 1 and relayed.stopped_code is None


@pytest.mark.parametrize(
    "handled, passed_on",
    [
        (None, "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"),
        ("SIGTERM, SIGINT,,", "SIGTERM,SIGINT,SIGUSR1"),
        ("SIGUSR1,SIGTERM", "SIGUSR1,SIGTERM"),
    ],
)
def test_scripts_launch_has_the_launcher_pass_sigusr1_on_too(handled, passed_on):
    environment = {"PATH": "/bin"} if handled is None else {"PET_SIGNALS_TO_HANDLE": handled}
    launched = launch_script().launcher_environment(environment)
    assert launched == {**environment, "PET_SIGNALS_TO_HANDLE": passed_on}


@pytest.mark.parametrize(
    "output, launcher_code, code",
    [
        (["step 1\n"], 0, 0),  # the job ended well
        (["Root Cause (first observed failure):\n", "  exitcode  : 2 (pid: 9)\n"], 1, 2),
        ([STOPPED, "Root Cause (first observed failure):\n", "  exitcode  : 1 (pid: 9)\n"], 1, 75),
        (["stopping at step 3 on SIGINT, checkpoint saved\n"], 1, 130),
        (["Root Cause (first observed failure):\n", "  exitcode  : 1 (pid: 9)\n"], 1, 1),
        (["killed\n"], -9, -9),  # nothing said: the launcher's own code
    ],
)
def test_scripts_launch_exits_with_the_code_the_job_meant(monkeypatch, output, launcher_code, code):
    """main() runs `python -m accelerate.commands.launch ARGS` with SIGUSR1 passed on, relays its
    output, passes SIGTERM and SIGUSR1 on to it, leaves Ctrl-C to the process group, and exits with
    the worker's own code (2, 75, 130) over the launcher's 1."""
    launch = launch_script()
    started, sent, handlers = [], [], {}

    class Launcher:
        def __init__(self, command, **options):
            started.append((command, options))
            self.stdout = iter(output)

        def send_signal(self, signum):
            sent.append(signum)

        def wait(self):
            return launcher_code

    monkeypatch.setattr(launch.subprocess, "Popen", Launcher)
    monkeypatch.setattr(launch.signal, "signal", handlers.__setitem__)
    monkeypatch.setattr(launch.sys, "stdout", io.StringIO())
    assert launch.main(["--config_file", "c.yaml", "train/main.py"]) == code
    ((command, options),) = started
    assert command == [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "c.yaml",
        "train/main.py",
    ]
    assert options["stdout"] == subprocess.PIPE and options["stderr"] == subprocess.STDOUT
    assert options["text"] is True and "SIGUSR1" in options["env"]["PET_SIGNALS_TO_HANDLE"]
    assert handlers[signal.SIGINT] == signal.SIG_IGN
    handlers[signal.SIGTERM](signal.SIGTERM, None)
    handlers[signal.SIGUSR1](signal.SIGUSR1, None)
    assert sent == [signal.SIGTERM, signal.SIGUSR1]


def test_scripts_launch_decides_whose_traceback_it_is_from_its_first_four_lines():
    """By hand: a launcher frame within the first four lines held after `Traceback` makes it the
    launcher's (dropped to the end); a fifth line without one makes it the worker's (written, and what
    follows too); a worker's traceback cut short at the end is still written; an exit code outside
    the summary's Root Cause is not the failed worker's."""
    worker = '  File "/home/me/train/main.py", line 3, in f\n'
    launcher = f'  File "{SITE}/torch/distributed/run.py", line 9, in main\n'
    fifth_is_launchers = ["Traceback (most recent call last):\n", worker, "    g()\n", "    ^^^\n"]
    fifth_is_launchers += [launcher, "    raise\n", "ChildFailedError:\n"]
    written = io.StringIO()
    launch_script().relay(["before\n", *fifth_is_launchers], written)
    assert written.getvalue() == "before\n"
    sixth_is_launchers = ["Traceback (most recent call last):\n", worker, "    g()\n", worker]
    sixth_is_launchers += ["    h()\n", launcher, "    raise\n", "RuntimeError: x\n"]
    written = io.StringIO()
    launch_script().relay(sixth_is_launchers, written)
    assert written.getvalue() == "".join(sixth_is_launchers)
    cut_short = ["Traceback (most recent call last):\n", worker, "RuntimeError: x\n"]
    written = io.StringIO()
    relayed = launch_script().relay([*cut_short, "  exitcode  : 2 (pid: 9)\n"], written)
    assert written.getvalue() == "".join(cut_short) + "  exitcode  : 2 (pid: 9)\n"
    assert relayed.failed_code is None  # no Root Cause: not the summary's
