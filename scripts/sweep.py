"""A hyperparameter sweep whose every trial is a normal run of your launch command, and which survives
being killed (Optuna: the study, its sampler and pruner; the trials are plain runs of the template).

    python scripts/sweep.py --space sweep.yaml --sweep_dir runs/sweep_lr --trials 12 -- \\
        accelerate launch --config_file accelerate_configs/8gpu.yaml train/main.py --config train/configs/gpt2_124m.yaml
    python scripts/sweep.py --sweep_dir runs/sweep_lr          # after a kill or a requeue: carries on
    python scripts/sweep.py --sweep_dir runs/sweep_lr --summary    # the table and the plot, no trials

The space, a YAML file (docs/sweeps.md has a longer one):

    objective: eval_loss              # a key of the trials' eval rows in metrics.jsonl
    direction: minimize               # or maximize
    parameters:                       # any config key, your model.py's and data.py's own too
      lr: {low: 3.0e-4, high: 3.0e-2, log: true}
      warmup_steps: {low: 0, high: 100}          # integers when low and high are
      optimizer: {choices: [adamw, muon]}
    sampler: tpe                      # tpe | random, seeded by `seed`
    seed: 0
    pruner: {name: MedianPruner, n_startup_trials: 3}   # any of optuna.pruners, or none (the default)

Each trial is the launch command with the trial's values as --flags (kept in its config.yaml), its own
--output_dir <sweep_dir>/trial_NNN, --wandb_group <the sweep's name> and --run_name <sweep>-NNN: one
after the other, each with every GPU the command asks for, any launcher, any number of processes or nodes.
The driver follows the trial's metrics.jsonl: every eval row's objective is reported to the study, and
when the pruner says so the trial gets SIGTERM, so that it checkpoints and exits 75 as any preempted run
does (it can be resumed by hand later). The training code knows nothing of the sweep. A trial's value is
its last eval row's objective (the evaluation at max_steps).

The study lives in <sweep_dir>/study.db (SQLite). Killed (even with kill -9 of its whole process group)
and started again, the driver reruns no finished trial, and resumes the one it was running from that
trial's last checkpoint (--resume latest), which then ends bitwise as it would have uninterrupted.
SIGTERM to the driver (a preempted job) passes to the running trial, waits for its checkpoint and exits 75.
Past one machine: --storage postgresql://user:password@host/db (pip install psycopg2-binary) lets a
driver on each machine (or each node group) share one study; each resumes only its own trials.

A trial that fails (exit code other than 0 or 75) is recorded as failed, with its `error:` line, and the
sweep goes on; one that fails before training while no trial has finished stops the sweep (the launch
command itself is wrong). Each trial's output: <sweep_dir>/logs/trial_NNN.log.

The launch command must pass SIGTERM on to the training (accelerate launch, torchrun and python do; a
shell script must `exec` its launcher).
"""

from __future__ import annotations

import argparse
import csv
import fcntl
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "train"))

from errors import ConfigError  # noqa: E402
from run_config import coerce, config_class, unknown_key_hint  # noqa: E402 - the run's keys, the fork's too

SPACE_KEYS = {"objective", "direction", "parameters", "sampler", "seed", "pruner"}
RANGE_KEYS = {"low", "high", "log", "step"}
DIRECTIONS = ("minimize", "maximize")
SAMPLERS = ("tpe", "random")
# flags the driver sets for each trial: the launch command must leave them to it
SET_BY_THE_SWEEP = ("output_dir", "resume", "wandb_group", "run_name")
PREEMPTED_EXIT_CODE = 75  # a run stopped on a signal with a checkpoint (train/job.py)
INTERRUPTED_EXIT_CODE = 130
REQUEUES_PER_TRIAL = 3  # a trial preempted alone (not the driver) is resumed this many times
FREE_FOLDER_WAIT_S = 120  # a killed trial's workers checkpoint and let go of its folder (README)
SWEEP_FILE = "sweep.yaml"  # the space and the launch command, as the sweep was started


class SweepError(Exception):
    """A refused input, or a sweep that cannot go on: one line, exit 2."""


# ---------------------------------------------------------------- the space


def read_space(path: Path) -> dict:
    """The space file, checked: every key known (the run's and the fork's), every range non-empty."""
    try:
        space = yaml.safe_load(path.read_text())
    except OSError as e:
        raise SweepError(f"--space: cannot read {path} ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise SweepError(f"--space: {path} is not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(space, dict):
        raise SweepError(f"--space: {path} must hold a mapping (objective, parameters, ...)")
    unknown = sorted(set(space) - SPACE_KEYS)
    if unknown:
        raise SweepError(
            f"{path}: unknown key '{unknown[0]}' (known: {', '.join(sorted(SPACE_KEYS))})"
        )
    space = {"direction": "minimize", "sampler": "tpe", "seed": 0, "pruner": "none", **space}
    if not isinstance(space.get("objective"), str) or not space["objective"]:
        raise SweepError(f"{path}: objective must name a metric of the eval rows, e.g. eval_loss")
    if space["direction"] not in DIRECTIONS:
        raise SweepError(
            f"{path}: direction must be minimize or maximize (got {space['direction']!r})"
        )
    if space["sampler"] not in SAMPLERS:
        raise SweepError(
            f"{path}: sampler must be one of {', '.join(SAMPLERS)} (got {space['sampler']!r})"
        )
    parameters = space.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        raise SweepError(
            f"{path}: parameters must map at least one config key to its range or choices"
        )
    types = {f.name: f.type for f in config_fields()}
    for key, spec in parameters.items():
        check_parameter(path, key, spec, types)
    pruner_of(space)  # a pruner Optuna does not know, or arguments it does not take
    return space


def config_fields():
    try:
        from dataclasses import fields

        return fields(config_class())
    except ConfigError as e:  # the fork's model.py or data.py declares its keys wrongly
        raise SweepError(str(e)) from None


def check_parameter(path: Path, key: str, spec, types: dict) -> None:
    where = f"{path}: parameters.{key}"
    if key not in types:
        raise SweepError(f"{where}: unknown config key '{key}'{unknown_key_hint(key, types)}")
    if key in SET_BY_THE_SWEEP:
        raise SweepError(f"{where}: {key} is set by the sweep for each trial")
    type_name = types[key] if isinstance(types[key], str) else types[key].__name__
    if not isinstance(spec, dict):
        raise SweepError(
            f"{where} must be {{low: .., high: ..}} or {{choices: [..]}} (got {spec!r})"
        )
    if "choices" in spec:
        check_choices(where, key, spec, type_name)
    else:
        check_range(where, key, spec, type_name)


def check_choices(where: str, key: str, spec: dict, type_name: str) -> None:
    if set(spec) != {"choices"}:
        raise SweepError(f"{where}: choices goes alone (got {', '.join(sorted(spec))})")
    if not isinstance(spec["choices"], list) or not spec["choices"]:
        raise SweepError(f"{where}: choices must be a non-empty list")
    for choice in spec["choices"]:
        # a trial's dataset is its flag's string; a mixture written as a YAML list is no value
        # Optuna stores
        if key == "dataset" and not isinstance(choice, str):
            raise SweepError(
                f"{where}: each choice is one string: a path, a hub name or a mixture "
                f"'PATH:WEIGHT,...' (got {choice!r})"
            )
        typed(where, key, choice, type_name)


def check_range(where: str, key: str, spec: dict, type_name: str) -> None:
    unknown = sorted(set(spec) - RANGE_KEYS)
    if unknown or not {"low", "high"} <= set(spec):
        raise SweepError(
            f"{where} must be {{low: .., high: ..}} (with log or step) or {{choices: [..]}}"
        )
    if type_name not in ("int", "float"):
        raise SweepError(f"{where}: {key} is a {type_name}: give it choices, not a range")
    low, high = (typed(where, key, spec[end], type_name) for end in ("low", "high"))
    if not low < high:
        raise SweepError(f"{where}: the range is empty (low {low!r} must be < high {high!r})")
    if spec.get("log") and low <= 0:
        raise SweepError(f"{where}: a log range needs low > 0 (got {low!r})")
    if spec.get("log") and "step" in spec:
        raise SweepError(f"{where}: log and step do not go together")
    if "step" in spec and not (isinstance(spec["step"], (int, float)) and spec["step"] > 0):
        raise SweepError(f"{where}: step must be > 0 (got {spec['step']!r})")


def typed(where: str, key: str, value, type_name: str):
    try:
        return coerce(key, value, type_name)
    except ConfigError as e:
        raise SweepError(f"{where}: {e}") from None


def distributions(space: dict) -> dict:
    """Each parameter as Optuna's distribution: an int range for an int key, a float range else."""
    import optuna.distributions as d

    types = {f.name: f.type for f in config_fields()}
    found = {}
    for key, spec in space["parameters"].items():
        type_name = types[key] if isinstance(types[key], str) else types[key].__name__
        if "choices" in spec:
            found[key] = d.CategoricalDistribution(
                [choice_value(key, c, type_name) for c in spec["choices"]]
            )
        elif type_name == "int":
            step = int(spec.get("step", 1))
            found[key] = d.IntDistribution(
                int(spec["low"]), int(spec["high"]), log=bool(spec.get("log")), step=step
            )
        else:
            low, high = float(spec["low"]), float(spec["high"])
            found[key] = d.FloatDistribution(
                low, high, log=bool(spec.get("log")), step=spec.get("step")
            )
    return found


def choice_value(key: str, choice, type_name: str):
    """A choice as Optuna stores it and the trial's flag writes it: of the key's type (YAML's "8"
    for an int key is 8); a dataset as written, for the trial to parse (its parsed mixture, a tuple
    of sources, is no value Optuna stores)."""
    if key == "dataset":
        return choice
    return coerce(key, choice, type_name)


def pruner_of(space: dict):
    import optuna

    pruner = space["pruner"]
    if pruner in ("none", None):
        return optuna.pruners.NopPruner()
    if not isinstance(pruner, dict) or not isinstance(pruner.get("name"), str):
        raise SweepError(
            f"pruner must be none or {{name: MedianPruner, ...its arguments}} (got {pruner!r})"
        )
    arguments = {key: value for key, value in pruner.items() if key != "name"}
    kind = getattr(optuna.pruners, pruner["name"], None)
    if not (isinstance(kind, type) and issubclass(kind, optuna.pruners.BasePruner)):
        raise SweepError(
            f"pruner: optuna.pruners has no pruner {pruner['name']!r} (MedianPruner, ...)"
        )
    try:
        return kind(**arguments)
    except (TypeError, ValueError) as e:
        raise SweepError(f"pruner: {pruner['name']}({e})") from None


def as_flag(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


# ---------------------------------------------------------------- the sweep


class Sweep:
    """One driver of a study: the trials it starts, follows, prunes and resumes."""

    def __init__(self, args):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.dir = Path(args.sweep_dir)  # made by take_driver_lock; --summary makes nothing
        self.name = args.study_name or self.dir.resolve().name
        self.poll_s = args.poll_s
        # the driver's own command, which carries the sweep on when started again
        self.again = shlex.join(["python", sys.argv[0], *args.argv])
        self.space, self.command = settled(self.dir, args)
        storage = args.storage or f"sqlite:///{self.dir.resolve() / 'study.db'}"
        self.study = optuna.create_study(
            storage=storage,
            study_name=self.name,
            direction=self.space["direction"],
            pruner=pruner_of(self.space),
            load_if_exists=True,
        )
        # seeded by the trials the study already holds: a restarted driver (or a second one) does not
        # draw the first trials' values again
        seed = self.space["seed"] + len(self.study.get_trials(deepcopy=False))
        kind = (
            optuna.samplers.TPESampler
            if self.space["sampler"] == "tpe"
            else optuna.samplers.RandomSampler
        )
        self.study.sampler = kind(seed=seed)
        self.driver = f"{socket.gethostname()}:{self.dir.resolve()}"
        self.running = None  # the trial's launcher (subprocess.Popen)
        # SIGTERM or SIGINT to the driver: stop after the trial's checkpoint
        self.stop_signal = None

    # ------------------------------------------------------------ the loop

    def run(self, trials: int) -> int:
        """Resume this driver's interrupted trials, then start new ones until the study holds
        `trials`. Returns the exit code."""
        import optuna

        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        interrupted = [
            t
            for t in self.study.get_trials(
                deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)
            )
            if t.user_attrs.get("driver") == self.driver
        ]
        for frozen in interrupted:
            where = self.dir / f"trial_{frozen.number:03d}"
            say(f"trial {frozen.number}: resuming from its last checkpoint ({where})")
            # the running trial of the driver that died, reported to again (Optuna keeps it by id)
            trial = optuna.trial.Trial(self.study, frozen._trial_id)
            if self.run_trial(trial, frozen.params, resume=True) == "stopped":
                return self.stopped()
        while len(self.study.get_trials(deepcopy=False)) < trials:
            if self.stop_signal is not None:  # between two trials: the sweep is not over
                return self.stopped(running=False)
            trial = self.study.ask(distributions(self.space))
            trial.set_user_attr("driver", self.driver)
            trial.set_user_attr("run_dir", str(self.dir / f"trial_{trial.number:03d}"))
            if self.run_trial(trial, trial.params, resume=False) == "stopped":
                return self.stopped()
        self.summarize()
        return 0

    def run_trial(self, trial, params: dict, resume: bool) -> str:
        """One trial to its end: complete, pruned, failed, or "stopped" (the driver was asked to stop;
        the trial is left running in the study, for the next driver to resume)."""
        # found from --sweep_dir as given now, not as recorded: a driver started again from another
        # folder (`cd ..`, then runs/sweep_lr for sweep_lr) resumes the same trial folder
        run_dir = self.dir / f"trial_{trial.number:03d}"
        flags = [item for key, value in params.items() for item in (f"--{key}", as_flag(value))]
        command = [
            *self.command,
            *flags,
            *("--output_dir", str(run_dir), "--wandb_group", self.name),
            *("--run_name", f"{self.name}-{trial.number:03d}"),
        ]
        shown = ", ".join(f"{key} {as_flag(value)}" for key, value in params.items())
        requeues = 0
        while True:
            if resume:
                command_now = [*command, "--resume", "latest"]
                wait_until_free(run_dir)
            else:
                command_now = command
                say(f"trial {trial.number}: {shown}")
            code, pruned_at, rows = self.follow(trial, command_now, run_dir)
            if pruned_at is not None:
                self.study.tell(trial, state=self.states().PRUNED)
                said = f"{self.objective} {rows[-1]:.4g}"
                say(f"trial {trial.number}: pruned at step {pruned_at} ({said}); it checkpointed")
                return "pruned"
            if code == 0:
                return self.finished(trial, run_dir, rows)
            if self.stop_signal is not None:
                return "stopped"  # whatever its launcher says, the next driver resumes it
            # accelerate launch and torchrun exit 1 for a preempted run: its marker tells
            preempted = code == PREEMPTED_EXIT_CODE or (run_dir / "preempted.json").exists()
            if preempted and requeues < REQUEUES_PER_TRIAL:
                requeues += 1  # this trial alone was preempted: requeued, as a scheduler would
                say(
                    f"trial {trial.number}: preempted, resuming it ({requeues}/{REQUEUES_PER_TRIAL})"
                )
                resume = True
                continue
            return self.failed(trial, run_dir, code)

    def follow(self, trial, command: list[str], run_dir: Path):
        """Launch `command` and follow its metrics.jsonl: each eval row's objective reported to the
        study, SIGTERM when the pruner says so. Returns (exit code, the step it was pruned at or None,
        the objective values reported)."""
        log_path = self.dir / "logs" / f"trial_{trial.number:03d}.log"
        log_path.parent.mkdir(exist_ok=True)
        # {step: objective} reported so far (a resumed trial's earlier ones too)
        reported = dict(self.frozen(trial.number).intermediate_values)
        pruned_at = None
        with open(log_path, "a") as log:
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            self.running = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
            metrics = MetricsFollower(run_dir / "metrics.jsonl")
            while True:
                code = self.running.poll()
                for row in metrics.new_rows():
                    value = row.get(self.objective)
                    if pruned_at is not None or row.get("step") in reported:
                        continue  # pruned: what it logs on its way out is not reported
                    if not isinstance(value, (int, float)):
                        continue
                    reported[row["step"]] = float(value)
                    trial.report(float(value), row["step"])
                    if pruned_at is None and code is None and trial.should_prune():
                        pruned_at = row["step"]
                        self.running.send_signal(signal.SIGTERM)  # it checkpoints and exits 75
                if code is not None:
                    break
                time.sleep(self.poll_s)
        self.running = None
        values = [reported[step] for step in sorted(reported)]
        return code, pruned_at, values

    def finished(self, trial, run_dir: Path, values: list[float]) -> str:
        if not values:
            rows = MetricsFollower(run_dir / "metrics.jsonl").new_rows()
            keys = sorted({key for row in rows if "eval_loss" in row for key in row} - {"step"})
            error = f"no eval row of trial {trial.number} has '{self.objective}' "
            error += f"(they have: {', '.join(keys) or 'none'})"
            trial.set_user_attr("error", error)
            self.study.tell(trial, state=self.states().FAIL)
            if not self.any_complete():
                raise SweepError(f"objective: {error}")
            say(f"trial {trial.number}: failed: {error}")
            return "failed"
        self.study.tell(trial, values[-1])
        say(f"trial {trial.number}: {self.objective} {values[-1]:.4g}")
        return "complete"

    def failed(self, trial, run_dir: Path, code: int) -> str:
        log_path = self.dir / "logs" / f"trial_{trial.number:03d}.log"
        error = error_line(log_path) or f"exit code {code}"
        trial.set_user_attr("error", error)
        self.study.tell(trial, state=self.states().FAIL)
        trained = bool(MetricsFollower(run_dir / "metrics.jsonl").new_rows())
        if not trained and not self.any_complete():
            raise SweepError(
                f"the launch command failed before training (trial {trial.number}, exit {code}): "
                f"{error} (its output: {log_path})"
            )
        say(f"trial {trial.number}: failed (exit {code}): {error} (its output: {log_path})")
        return "failed"

    def stopped(self, running: bool = True) -> int:
        where = "the running trial checkpointed" if running else "before its next trial"
        say(f"stopped on {self.stop_signal}: {where}; go on with: {self.again}")
        return INTERRUPTED_EXIT_CODE if self.stop_signal == "SIGINT" else PREEMPTED_EXIT_CODE

    def _stop(self, signum, _frame) -> None:
        self.stop_signal = signal.Signals(signum).name
        if self.running is not None and signum == signal.SIGTERM:
            self.running.send_signal(signal.SIGTERM)  # Ctrl-C reaches the trial from the terminal

    def frozen(self, number: int):
        return next(t for t in self.study.get_trials(deepcopy=False) if t.number == number)

    @property
    def objective(self) -> str:
        return self.space["objective"]

    def states(self):
        import optuna

        return optuna.trial.TrialState

    def any_complete(self) -> bool:
        return bool(self.study.get_trials(deepcopy=False, states=(self.states().COMPLETE,)))

    # ------------------------------------------------------------ the summary

    def summarize(self) -> None:
        """The trials as a table (printed, and trials.csv), and objective.png: each trial's objective
        with the best so far, and each trial's eval curve (pruned trials end early)."""
        trials = self.study.get_trials(deepcopy=False)
        keys = list(self.space["parameters"])
        header = ["trial", "state", self.objective, "step", *keys, "run folder"]
        table = []
        for t in trials:
            steps = sorted(t.intermediate_values)
            value = (
                t.value
                if t.value is not None
                else (t.intermediate_values[steps[-1]] if steps else None)
            )
            table.append(
                [
                    str(t.number),
                    t.state.name.lower(),
                    "" if value is None else f"{value:.4g}",
                    str(steps[-1]) if steps else "",
                    *(as_flag(t.params[key]) if key in t.params else "" for key in keys),
                    t.user_attrs.get("run_dir", ""),
                ]
            )
        with open(self.dir / "trials.csv", "w", newline="") as f:
            csv.writer(f).writerows([header, *table])
        widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
        for row in [header, *table]:
            cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
            print("  ".join(cells).rstrip())  # noqa: T201
        complete = [t for t in trials if t.state == self.states().COMPLETE]
        if complete:
            best = self.study.best_trial
            said = ", ".join(f"{key} {as_flag(value)}" for key, value in best.params.items())
            where = best.user_attrs.get("run_dir")
            say(f"best: trial {best.number}, {self.objective} {best.value:.4g} ({said}): {where}")
        failed = [t for t in trials if "error" in t.user_attrs]
        for t in failed:
            say(f"trial {t.number} failed: {t.user_attrs['error']}")
        plot(trials, self.objective, self.space["direction"], self.dir / "objective.png")


class MetricsFollower:
    """The rows a trial's metrics.jsonl gained since the last call (whole lines only)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0

    def new_rows(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        rows = []
        for line in complete.decode().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        return rows


def settled(folder: Path, args) -> tuple[dict, list[str]]:
    """The space and the launch command: as given, recorded in <sweep_dir>/sweep.yaml at the first start;
    a restart may leave them out, and may not change them."""
    record_path = folder / SWEEP_FILE
    recorded = yaml.safe_load(record_path.read_text()) if record_path.exists() else None
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    space = read_space(Path(args.space)) if args.space else None
    if recorded is None:
        if space is None or not command:
            raise SweepError(
                f"{folder} holds no sweep yet: give --space FILE and the launch command after --"
            )
        given = " ".join(command).replace("=", " ").split()
        for key in SET_BY_THE_SWEEP:
            if f"--{key}" in given:
                raise SweepError(
                    f"the launch command sets --{key}: the sweep sets it for each trial"
                )
        record_path.write_text(
            yaml.safe_dump({"space": space, "command": command}, sort_keys=False)
        )
        return space, command
    if space is not None and space != recorded["space"]:
        raise SweepError(
            f"--space differs from the space {folder} was started with ({record_path}): use another --sweep_dir"
        )
    if command and command != recorded["command"]:
        raise SweepError(
            f"the launch command differs from the one {folder} was started with "
            f"({record_path}): use another --sweep_dir"
        )
    return recorded["space"], recorded["command"]


def wait_until_free(run_dir: Path) -> None:
    """A killed driver's trial: its workers (under torch elastic, in sessions of their own) checkpoint
    and exit once their launcher is gone. Wait for them to let go of the run folder's lock."""
    lock_path = run_dir / ".lock"
    if not lock_path.exists():
        return
    deadline = time.monotonic() + FREE_FOLDER_WAIT_S
    said = False
    with open(lock_path, "a") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(lock, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SweepError(
                        f"{run_dir} is still in use by the processes of an earlier driver after {FREE_FOLDER_WAIT_S} s"
                    ) from None
                if not said:
                    say(f"waiting for the earlier trial's processes to let go of {run_dir}")
                    said = True
                time.sleep(0.5)


def error_line(log_path: Path) -> str:
    """The trial's `error: ...` line (the template's one line), else its last line."""
    try:
        lines = [
            line.strip()
            for line in log_path.read_text(errors="replace").splitlines()
            if line.strip()
        ]
    except OSError:
        return ""
    errors = [line for line in lines if line.startswith("error:")]
    return (errors[-1] if errors else lines[-1] if lines else "")[:300]


def plot(trials, objective: str, direction: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    figure = drawing(trials, objective, direction)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def drawing(trials, objective: str, direction: str):
    """objective.png's figure: each complete trial's objective and the best so far, and every trial's
    eval curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, (by_trial, curves) = plt.subplots(1, 2, figsize=(12, 4.5))
    # trial numbers and steps are whole: no tick at trial 0.5
    by_trial.xaxis.set_major_locator(MaxNLocator(integer=True))
    curves.xaxis.set_major_locator(MaxNLocator(integer=True))
    done = [(t.number, t.value) for t in trials if t.value is not None]
    if done:
        pick = min if direction == "minimize" else max
        best, best_so_far = math.nan, []
        for _, value in done:
            best = value if math.isnan(best) else pick(best, value)
            best_so_far.append(best)
        by_trial.plot([n for n, _ in done], [v for _, v in done], "o", label="trial")
        by_trial.plot([n for n, _ in done], best_so_far, "-", label="best so far")
        by_trial.legend()
    by_trial.set(xlabel="trial", ylabel=objective, title=f"{objective} per complete trial")
    for t in trials:
        steps = sorted(t.intermediate_values)
        if steps:
            style = "--" if t.state.name == "PRUNED" else "-"
            curves.plot(
                steps,
                [t.intermediate_values[s] for s in steps],
                style,
                label=f"{t.number} {t.state.name.lower()}",
            )
    curves.set(xlabel="step", ylabel=objective, title="eval curves (dashed: pruned)")
    if len(trials) <= 12:
        curves.legend(fontsize="small")
    figure.tight_layout()
    return figure


def say(line: str) -> None:
    print(f"sweep: {line}", flush=True)  # noqa: T201 - the driver's log


def main(argv: list[str] | None = None) -> int:
    # --help: the docstring's first paragraph, the options, then the rest of it, its lines as written
    summary, _, details = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(
        description=summary,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=details,
    )
    parser.add_argument(
        "--sweep_dir", required=True, help="the sweep's folder: study.db, trial_NNN/, logs/"
    )
    parser.add_argument(
        "--space", default="", help="the space's YAML file (the first start; kept in sweep.yaml)"
    )
    parser.add_argument(
        "--trials",
        type=int,
        default=20,
        help="trials in the study, all states counted (default: %(default)s)",
    )
    parser.add_argument(
        "--storage", default="", help="a database URL for the study (default: sqlite in sweep_dir)"
    )
    parser.add_argument("--study_name", default="", help="default: the sweep folder's name")
    parser.add_argument(
        "--summary", action="store_true", help="print the table and write the plot, run nothing"
    )
    parser.add_argument(
        "--poll_s",
        type=float,
        default=1.0,
        help="seconds between reads of the trial's metrics.jsonl (default: %(default)s)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the launch command")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if args.trials < 1:
            raise SweepError(f"--trials must be >= 1 (got {args.trials})")
        if args.summary:  # while a driver runs, too
            Sweep(args).summarize()
            return 0
        lock = take_driver_lock(Path(args.sweep_dir))
        code = Sweep(args).run(args.trials)
        lock.close()
        return code
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)  # noqa: T201 - the one line
        return 2


def take_driver_lock(folder: Path):
    """One driver per sweep folder (the kernel frees the lock when the driver dies)."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = open(folder / "driver.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        raise SweepError(
            f"{folder} is driven by another driver ({lock.read().strip()}): one per sweep folder"
        ) from None
    lock.truncate(0)
    lock.write(f"host {socket.gethostname()}, pid {os.getpid()}\n")
    lock.flush()
    return lock


if __name__ == "__main__":
    sys.exit(main())
