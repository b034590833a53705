"""The vocabulary of one-line failures. A job ends on one of these with `error: <message>` and the
class's exit code (job.run_or_exit), never with a traceback: a traceback means a bug in the code,
not in the input."""

from __future__ import annotations


class ConfigError(ValueError):
    """A refused input (a bad value, a run folder in use, data or a model that cannot be read): exit
    2."""

    exit_code = 2


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed (missing, damaged, or from another run): exit 2."""


class RunError(RuntimeError):
    """A failure the run cannot go on from (a full disk, a diverged loss, a lost peer): exit 1."""

    exit_code = 1


def the_line(error: BaseException) -> str:
    """What the job's one line says of an error. One raised in a DataLoader worker comes back as
    "Caught ConfigError in DataLoader worker process 0.", the worker's traceback, then the error's
    own line: that last line, without its type."""
    text = str(error).strip()
    if not (text.startswith("Caught ") and "Original Traceback" in text):
        return text
    last = text.splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last else last


def first_line(error: BaseException) -> str:
    """An exception's message cut to its first line, so that errors passed on stay one line."""
    lines = str(error).strip().splitlines()
    if not lines:
        return type(error).__name__
    return lines[0][:200]
