"""What produced a run, recorded in its run_info.json: the software and hardware it ran on (the same on
every rank: compare them between nodes, docs/multi-node.md "Troubleshooting"), and how each start was
launched, so that it can be launched again the same way."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch


def git(*args: str) -> str:
    """A git command's output, run in the repository this template was started from."""
    return subprocess.run(
        ["git", *args],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout


def git_state() -> tuple[str, bool | None]:
    """(revision, whether tracked files have uncommitted changes); ("unknown", None) outside a git
    checkout."""
    try:
        revision = git("rev-parse", "--short=12", "HEAD").strip()
        changed = git("status", "--porcelain", "--untracked-files=no").strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown", None
    return revision, bool(changed)


def environment_info() -> dict:
    """What to compare between nodes, or between two runs that should agree (docs/multi-node.md
    "Troubleshooting")."""
    import platform

    import accelerate
    import datasets

    revision, dirty = git_state()
    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "datasets": datasets.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "git": revision,
        "git_dirty": dirty,
        "host": os.uname().nodename,
    }


LAUNCH_ENVIRONMENT = (  # the variables a launcher or scheduler sets that change what a run does
    "ACCELERATE_",
    "FSDP_",
    "PARALLELISM_CONFIG_",
    "PET_",
    "TORCHELASTIC_",
    "SLURM_",
    "NCCL_",
    "CUDA_VISIBLE_DEVICES",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "HF_",
)


SECRET = re.compile(r"TOKEN|KEY|SECRET|PASS|AUTH|CREDENTIAL", re.IGNORECASE)  # never written down


def launch_record() -> dict:
    """Enough to launch this start again the same way: this process's command and its launcher's (with
    the accelerate config file it named), the launcher's and scheduler's variables, the installed packages,
    and the uncommitted changes of the repository (the diff and the untracked files' names)."""
    import importlib.metadata

    launcher = process_command(os.getppid())
    packages = {dist.metadata["Name"]: dist.version for dist in importlib.metadata.distributions()}
    environment = {
        key: value
        for key, value in os.environ.items()
        if key.startswith(LAUNCH_ENVIRONMENT) and not SECRET.search(key)
    }
    return {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": os.uname().nodename,
        "command": [sys.executable, *sys.argv],
        "launcher_command": launcher,
        "launcher_config": launcher_config(launcher),
        "environment": dict(sorted(environment.items())),
        "packages": dict(sorted(packages.items(), key=lambda item: item[0].lower())),
        **git_changes(),
    }


def process_command(pid: int) -> list[str] | None:
    """A process's command line (Linux), or None."""
    try:
        arguments = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return [argument.decode(errors="replace") for argument in arguments if argument]


def launcher_config(launcher: list[str] | None) -> dict | None:
    """The accelerate config file the launcher was given (--config_file), as {path: its text}."""
    if not launcher or "--config_file" not in launcher:
        return None
    index = launcher.index("--config_file") + 1
    if index >= len(launcher):
        return None
    path = launcher[index]
    try:
        return {path: Path(path).read_text()}
    except OSError:  # a relative path from another working directory, or gone
        return {path: None}


def git_changes() -> dict:
    """The repository's uncommitted changes: `git diff HEAD` and the untracked files' names (None outside
    a git checkout)."""
    try:
        diff = git("diff", "HEAD")
        untracked = git("ls-files", "--others", "--exclude-standard").splitlines()
    except (
        OSError,
        subprocess.SubprocessError,
    ):  # not a git checkout (a copy, an installed package)
        return {"git_diff": None, "git_untracked": None}
    return {"git_diff": diff, "git_untracked": untracked}


# ---------------------------------------------------------------- the commands a run prints

# the launchers whose command a printed command keeps, by how their command line starts: the
# executable's name (argv[1] after the interpreter), or python -m's module
LAUNCHERS = {"accelerate": "accelerate", "torchrun": "torchrun", "launch.py": None}
LAUNCHER_MODULES = ("torch.distributed.run", "accelerate.commands.launch")


def relaunch_command(*flags: str) -> str:
    """This script launched again the way this start was, with `flags` for the script: the launcher
    and its options (accelerate launch, torchrun, scripts/launch.py above either) kept, the script's
    own flags replaced, so that a command the run prints works when pasted. Reads the parent
    processes' command lines (Linux); without them, `python <script>`."""
    script = sys.argv[0]
    prefix = ["python", script]
    if "--spawn" in sys.argv:  # torch_ddp.py --spawn N: its processes are its own children
        spawned = sys.argv[sys.argv.index("--spawn") + 1 : sys.argv.index("--spawn") + 2]
        prefix += ["--spawn", *spawned]
    pid = os.getpid()
    for _ in range(3):  # scripts/launch.py > accelerate launch > this process, at most
        pid = parent_of(pid)
        launcher = launcher_prefix(process_command(pid) if pid else None, script)
        if launcher is None:
            break
        prefix = [*launcher, script]
    return shlex.join([*prefix, *flags])


def launcher_prefix(command: list[str] | None, script: str) -> list[str] | None:
    """A launcher's command up to the script it starts, as a person types it; None when `command`
    is not a launcher of `script`."""
    if not command or script not in command[1:]:
        return None
    before_script = command[: command.index(script, 1)]
    if len(before_script) < 2:
        return None
    program = os.path.basename(before_script[1])
    if program in LAUNCHERS:
        shown = LAUNCHERS[program] or f"python {before_script[1]}"
        return [*shown.split(), *before_script[2:]]
    if before_script[1] == "-m" and len(before_script) > 2 and before_script[2] in LAUNCHER_MODULES:
        return ["python", *before_script[1:]]
    return None


def parent_of(pid: int) -> int | None:
    """A process's parent (Linux), or None."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"^PPid:\s*(\d+)", status, re.MULTILINE)
    return int(found.group(1)) if found and found.group(1) != "0" else None
