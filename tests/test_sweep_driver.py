"""scripts/sweep.py's driver against a stand-in trial (tests/helpers/fake_trial.py: metrics rows in
milliseconds, SIGTERM -> preempted.json and exit 75): pruning, a failed trial, the driver's own stop and
restart, the summary. Real runs of the template, killed and resumed bitwise: tests/e2e/test_sweep.py."""

import contextlib
import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import optuna
import pytest
import yaml

from conftest import REPO
from test_sweep_inputs import sweep_script

FAKE = [sys.executable, str(REPO / "tests" / "helpers" / "fake_trial.py")]


def write_space(path, **space) -> str:
    path.write_text(yaml.safe_dump({"objective": "eval_loss", **space}))
    return str(path)


def driver_argv(sweep_dir, space: str, trials: int) -> list[str]:
    """The driver's flags over the stand-in trial, polling fast."""
    return [
        *("--sweep_dir", str(sweep_dir), "--space", space, "--trials", str(trials)),
        *("--poll_s", "0.02", "--", *FAKE),
    ]


def trials_of(sweep_dir) -> list:
    storage = f"sqlite:///{sweep_dir / 'study.db'}"
    return optuna.load_study(study_name=sweep_dir.name, storage=storage).get_trials()


def launches(run_dir) -> list[list[str]]:
    return [json.loads(line) for line in (run_dir / "argv.jsonl").read_text().splitlines()]


@pytest.fixture
def own_signals():
    """The driver runs in this process and installs its SIGTERM/SIGINT handlers: put pytest's back.
    Yields signal_when(ready, send): a thread that calls send() (a signal to the driver) once ready()
    holds, stopped and joined before the handlers are put back, so that no signal outlives its test.
    One sent after a failed test reached the handler this process inherited: mutmut's fork server
    exits 0 on SIGTERM (a failed test read as a surviving mutant) and SIGKILLs its other children."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    over = threading.Event()
    threads = []

    def signal_when(ready, send) -> None:
        def watch():
            while not ready():
                if over.wait(0.01):
                    return
            send()

        threads.append(threading.Thread(target=watch, daemon=True))
        threads[-1].start()

    yield signal_when
    over.set()
    for thread in threads:
        thread.join()
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def rows_logged(run_dir, rows: int):
    """Whether the trial in run_dir has logged `rows` metrics rows (for signal_when)."""
    metrics = run_dir / "metrics.jsonl"
    return lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= rows


def sigterm_to_the_driver() -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler does


@contextlib.contextmanager
def console_input_is_a_pipe():
    """This process's file descriptor 0 a pipe, as the trials would inherit it (pytest may run with
    /dev/null there already)."""
    try:
        saved = os.dup(0)
    except OSError:  # none open (mutmut's stats run has none): closed again after
        saved = None
    read_end, write_end = os.pipe()  # read_end may be 0 itself, where none was open
    os.dup2(read_end, 0)
    try:
        yield
    finally:
        if saved is None:
            os.close(0)
        else:
            os.dup2(saved, 0)
            os.close(saved)
        for fd in {read_end, write_end} - {0}:
            os.close(fd)


def test_a_failed_trial_is_recorded_once_and_pruned_ones_get_sigterm(
    tmp_path, capsys, own_signals, monkeypatch
):
    sweep_dir = tmp_path / "pruning"
    # every eval_loss is over 20 (lr x 100): ThresholdPruner(upper=10) prunes each trial at its first
    space = write_space(
        tmp_path / "space.yaml",
        parameters={"lr": {"low": 0.2, "high": 0.5}},
        pruner={"name": "ThresholdPruner", "upper": 10.0},
    )
    monkeypatch.setenv("FAKE_FAIL_ONCE", str(tmp_path / "failed"))
    argv = driver_argv(sweep_dir, space, trials=3)
    with console_input_is_a_pipe():
        assert sweep_script().main(argv) == 0
    out = capsys.readouterr().out
    # the driver's input is a pipe (a terminal, in a shell), yet no trial reads it: a trial's
    # breakpoint() or a prompt of a library would take the keys typed to the driver
    for n in range(3):
        assert (sweep_dir / f"trial_{n:03d}" / "stdin.txt").read_text() == os.devnull
    failed, *pruned = trials_of(sweep_dir)
    # the first trial failed after training began: recorded with its line, never run again
    assert failed.state.name == "FAIL" and failed.user_attrs["error"].startswith(
        "error: loss is nan at step 2"
    )
    assert "trial 0: failed (exit 1): error: loss is nan at step 2" in out
    assert len(launches(sweep_dir / "trial_000")) == 1
    for trial in pruned:  # SIGTERM at the first eval row: the trial's own stop, with its checkpoint
        assert trial.state.name == "PRUNED" and sorted(trial.intermediate_values) == [4]
        run_dir = sweep_dir / f"trial_{trial.number:03d}"
        assert json.loads((run_dir / "preempted.json").read_text())["step"] >= 4
        flags = launches(run_dir)[0]
        assert flags[flags.index("--lr") + 1] == repr(trial.params["lr"])
        assert flags[flags.index("--wandb_group") + 1] == "pruning"
        assert flags[flags.index("--run_name") + 1] == f"pruning-{trial.number:03d}"
        # its start and its pruning said; the value pruned at: the stand-in's lr x 100 + 1/4
        lr = trial.params["lr"]
        assert f"sweep: trial {trial.number}: lr {lr!r}\n" in out
        said = f"pruned at step 4 (eval_loss {lr * 100 + 1 / 4:.4g}); it checkpointed"
        assert f"sweep: trial {trial.number}: {said}\n" in out
        # its log: the command it ran, first
        log = (sweep_dir / "logs" / f"trial_{trial.number:03d}.log").read_text()
        assert log.startswith(f"$ {' '.join(FAKE)} --lr {lr!r} --output_dir {run_dir} ")
    # trials.csv: the failed trial without a value or a step (it failed before its first eval), each
    # pruned one with the value it was pruned at, at step 4
    rows = (sweep_dir / "trials.csv").read_bytes().decode().splitlines()
    lrs = [t.params["lr"] for t in [failed, *pruned]]
    assert rows[1] == f"0,fail,,,{lrs[0]!r},{sweep_dir / 'trial_000'}"
    for n in (1, 2):
        value = f"{lrs[n] * 100 + 1 / 4:.4g}"
        assert rows[n + 1] == f"{n},pruned,{value},4,{lrs[n]!r},{sweep_dir / f'trial_{n:03d}'}"
    # the summary: the table (trials.csv too) and the plot
    table = [line.split()[:2] for line in out.splitlines()]
    assert ["0", "fail"] in table and ["1", "pruned"] in table and ["2", "pruned"] in table
    assert (
        (sweep_dir / "trials.csv")
        .read_text()
        .startswith("trial,state,eval_loss,step,lr,run folder")
    )
    assert (sweep_dir / "objective.png").stat().st_size > 0


def test_sigterm_stops_the_driver_with_its_trial_which_the_next_start_resumes(
    tmp_path, capsys, own_signals, monkeypatch
):
    # --sweep_dir given relative to the folder the driver starts in (the third start's differs)
    monkeypatch.chdir(tmp_path)
    sweep_dir = Path("stopped")
    space = write_space(tmp_path / "space.yaml", parameters={"lr": {"low": 1e-3, "high": 1e-2}})
    argv = driver_argv(sweep_dir, space, trials=2)
    first = sweep_dir / "trial_000"
    own_signals(rows_logged(first, 3), sigterm_to_the_driver)  # once it has trained a few steps
    # started as `python scripts/sweep.py ...` starts it: main() reads the command line
    script = str(REPO / "scripts" / "sweep.py")
    monkeypatch.setattr(sys, "argv", [script, *argv])
    assert sweep_script().main() == 75
    said = capsys.readouterr().out
    assert "stopped on SIGTERM: the running trial checkpointed; go on with: python " in said
    # the command it prints, pasted, carries the sweep on: the driver's own
    go_on = shlex.split(said.split("go on with: ")[1].splitlines()[0])
    assert go_on == ["python", script, *argv]
    assert [t.state.name for t in trials_of(sweep_dir)] == ["RUNNING"]
    assert (first / "preempted.json").exists()  # the trial got it, and checkpointed
    # started again, and stopped again once the resumed launch has logged 3 rows of its own: the
    # same stop (exit 75, the trial left running), not a finished sweep's summary and exit 0
    logged = len((first / "metrics.jsonl").read_text().splitlines())
    own_signals(rows_logged(first, logged + 3), sigterm_to_the_driver)
    assert sweep_script().main(go_on[2:]) == 75
    said = capsys.readouterr().out
    assert "trial 0: resuming from its last checkpoint" in said
    assert "stopped on SIGTERM: the running trial checkpointed; go on with: python " in said
    assert [t.state.name for t in trials_of(sweep_dir)] == ["RUNNING"]
    assert (first / "preempted.json").exists()
    # started a third time, from another folder (the same sweep as ../stopped): the interrupted
    # trial resumes in its own folder (--resume latest), then the sweep goes on
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert sweep_script().main(driver_argv(Path("..") / "stopped", space, trials=2)) == 0
    resumed_in = Path("..") / "stopped" / "trial_000"
    assert f"trial 0: resuming from its last checkpoint ({resumed_in})" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path)
    assert [t.state.name for t in trials_of(sweep_dir)] == ["COMPLETE", "COMPLETE"]
    again = launches(first)
    assert len(again) == 3 and "--resume" not in again[0]
    assert again[1][-2:] == again[2][-2:] == ["--resume", "latest"]
    assert len(launches(sweep_dir / "trial_001")) == 1


def test_a_launch_command_that_cannot_train_stops_the_sweep_in_one_line(
    tmp_path, capsys, own_signals
):
    """A typo in the script's name: the first trial fails before any metrics row, and no trial has finished,
    so every trial would: one line naming the trial's own error and its output, exit 2."""
    space = write_space(tmp_path / "space.yaml", parameters={"lr": {"low": 1e-3, "high": 1e-2}})
    broken = [sys.executable, str(REPO / "train" / "mian.py")]
    argv = ["--sweep_dir", str(tmp_path / "broken"), "--space", space, "--", *broken]
    assert sweep_script().main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "error: the launch command failed before training (trial 0, exit 2): "
    )
    assert "mian.py" in err[0] and f"{tmp_path / 'broken' / 'logs' / 'trial_000.log'}" in err[0]
    assert [t.state.name for t in trials_of(tmp_path / "broken")] == ["FAIL"]


def first_draws(seed: int, space: dict) -> dict:
    """What Optuna's own RandomSampler(seed) draws first, in a study of its own, over `space`'s
    ranges."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    ranges = {
        key: optuna.distributions.FloatDistribution(spec["low"], spec["high"])
        for key, spec in space["parameters"].items()
    }
    return study.ask(ranges).params


def test_a_random_sweep_draws_what_optunas_sampler_draws_seeded_by_the_trials_held(
    tmp_path, own_signals
):
    """sampler: random, seed: 7. The first driver's trial 0 has RandomSampler(seed=7)'s first draw;
    a driver started again on the same sweep (1 trial held) draws RandomSampler(seed=8)'s first,
    not trial 0's values a second time."""
    space = {"parameters": {"lr": {"low": 1e-3, "high": 1e-2}}, "sampler": "random", "seed": 7}
    path = write_space(tmp_path / "space.yaml", **space)
    sweep_dir = tmp_path / "seeded"
    assert sweep_script().main(driver_argv(sweep_dir, path, trials=1)) == 0
    assert sweep_script().main(driver_argv(sweep_dir, path, trials=2)) == 0
    trials = trials_of(sweep_dir)
    assert [t.params for t in trials] == [first_draws(7, space), first_draws(8, space)]


@pytest.mark.parametrize(
    "sampler, kind, other",
    [
        ("tpe", optuna.samplers.TPESampler, optuna.samplers.RandomSampler),
        ("random", optuna.samplers.RandomSampler, optuna.samplers.TPESampler),
    ],
)
def test_each_sampler_draws_what_optunas_draws_once_the_study_has_ten_trials(
    tmp_path, own_signals, sampler, kind, other
):
    """TPE draws its first 10 trials as a RandomSampler would; from the 11th, its model's. A study
    holding 10 finished trials (added directly), seed 3: the driver's trial 10 is Optuna's own
    sampler's (seeded 3 + 10) draw after the same 10, which the other sampler's is not."""
    ranges = {"lr": optuna.distributions.FloatDistribution(1e-3, 1e-2)}
    lrs = [1e-3 + 9e-4 * n for n in range(10)]
    history = [
        optuna.trial.create_trial(params={"lr": lr}, distributions=ranges, value=lr * 100)
        for lr in lrs
    ]

    def draw_after_history(sampler_class) -> dict:
        study = optuna.create_study(sampler=sampler_class(seed=13))
        study.add_trials(history)
        return study.ask(ranges).params

    expected = draw_after_history(kind)
    assert expected != draw_after_history(other)
    sweep_dir = tmp_path / "held"
    sweep_dir.mkdir()
    storage = f"sqlite:///{sweep_dir / 'study.db'}"
    optuna.create_study(study_name="held", storage=storage).add_trials(history)
    space = write_space(
        tmp_path / "space.yaml",
        parameters={"lr": {"low": 1e-3, "high": 1e-2}},
        sampler=sampler,
        seed=3,
    )
    assert sweep_script().main(driver_argv(sweep_dir, space, trials=11)) == 0
    assert trials_of(sweep_dir)[10].params == expected


def test_a_maximize_sweep_takes_each_trial_s_last_eval_and_calls_the_highest_best(
    tmp_path, capsys, own_signals
):
    """The stand-in trial's eval rows are lr x 100 + 1 / step at steps 4, 8 and 12: a trial's value is
    the last, lr x 100 + 1/12 (its first would be lr x 100 + 1/4), and under direction: maximize
    the best trial is the one with the larger lr."""
    space = write_space(
        tmp_path / "space.yaml",
        parameters={"lr": {"low": 1e-3, "high": 1e-2}},
        direction="maximize",
        sampler="random",
    )
    sweep_dir = tmp_path / "maximize"
    assert sweep_script().main(driver_argv(sweep_dir, space, trials=2)) == 0
    trials = trials_of(sweep_dir)
    for trial in trials:
        assert trial.value == pytest.approx(trial.params["lr"] * 100 + 1 / 12)
    best = max(trials, key=lambda t: t.params["lr"])
    assert f"best: trial {best.number}, eval_loss {best.value:.4g} " in capsys.readouterr().out


def test_a_trial_preempted_under_a_launcher_that_exits_1_is_resumed_not_failed(
    tmp_path, capsys, own_signals, monkeypatch
):
    """accelerate launch and torchrun exit 1 for a run stopped on a signal; the run's preempted.json
    tells it apart from a failure: the trial is launched again with --resume latest, and completes.
    Its start is said with each of its two values."""
    monkeypatch.setenv("FAKE_PREEMPT_ONCE", str(tmp_path / "preempted_once"))
    parameters = {"lr": {"low": 1e-3, "high": 1e-2}, "warmup_steps": {"low": 0, "high": 9}}
    space = write_space(tmp_path / "space.yaml", parameters=parameters)
    sweep_dir = tmp_path / "requeued"
    assert sweep_script().main(driver_argv(sweep_dir, space, trials=1)) == 0
    out = capsys.readouterr().out
    (trial,) = trials_of(sweep_dir)
    lr, warmup = trial.params["lr"], trial.params["warmup_steps"]
    assert f"sweep: trial 0: lr {lr!r}, warmup_steps {warmup}\n" in out
    assert "trial 0: preempted, resuming it (1/3)" in out
    assert trial.state.name == "COMPLETE"
    first, again = launches(sweep_dir / "trial_000")
    assert "--resume" not in first and again[-2:] == ["--resume", "latest"]


def test_a_restarted_driver_resumes_its_trial_only_once_the_old_workers_let_go_of_it(
    tmp_path, capsys, own_signals
):
    """A killed driver's trial may still have workers writing its checkpoint, holding the run
    folder's .lock: the next driver says it waits, and launches the resume only after the lock is
    let go (here by another open file description of the lock, released 0.6 s after the driver
    said it waits: past its next 0.5 s poll, whatever the machine's load)."""
    space = write_space(tmp_path / "space.yaml", parameters={"lr": {"low": 1e-3, "high": 1e-2}})
    sweep_dir = tmp_path / "held"
    argv = driver_argv(sweep_dir, space, trials=1)
    first = sweep_dir / "trial_000"
    own_signals(rows_logged(first, 3), sigterm_to_the_driver)
    assert sweep_script().main(argv) == 75
    capsys.readouterr()
    held = open(first / ".lock", "a")  # let go by the timer
    fcntl.flock(held, fcntl.LOCK_EX)
    released = []

    def let_go():
        released.append(time.time())
        held.close()

    driver = sweep_script()
    say = driver.say

    def say_then_let_go(text: str) -> None:
        say(text)
        if text.startswith("waiting for the earlier trial's processes"):
            threading.Timer(0.6, let_go).start()

    driver.say = say_then_let_go
    never_said = threading.Timer(15.0, let_go)  # the test fails below, not at the driver's deadline
    never_said.start()
    assert driver.main(argv) == 0
    never_said.cancel()
    assert "waiting for the earlier trial's processes to let go of" in capsys.readouterr().out
    assert len(launches(first)) == 2
    # argv.jsonl is appended to once per launch, at its start: the resume's
    assert (first / "argv.jsonl").stat().st_mtime >= released[0]


# the stand-in trial, except that a launch after the first fails before training (no metrics row)
FAILS_AFTER_THE_FIRST = [
    sys.executable,
    "-c",
    "import os, runpy, sys\n"
    "marker = os.environ['FAKE_FIRST_DONE']\n"
    "if os.path.exists(marker):\n"
    "    print('error: CUDA out of memory', file=sys.stderr)\n"
    "    sys.exit(3)\n"
    "open(marker, 'w').close()\n"
    f"sys.argv = [{FAKE[1]!r}, *sys.argv[1:]]\n"
    f"runpy.run_path({FAKE[1]!r}, run_name='__main__')\n",
]


def test_a_trial_that_fails_before_training_after_one_finished_is_recorded_and_the_sweep_goes_on(
    tmp_path, capsys, own_signals, monkeypatch
):
    """The launch command has worked once: a later trial's failure is that trial's (exit 3, its
    `error:` line), not a wrong command; the sweep goes on, exit 0, and the summary names it."""
    monkeypatch.setenv("FAKE_FIRST_DONE", str(tmp_path / "first_done"))
    space = write_space(tmp_path / "space.yaml", parameters={"lr": {"low": 1e-3, "high": 1e-2}})
    sweep_dir = tmp_path / "later"
    argv = [
        *("--sweep_dir", str(sweep_dir), "--space", space, "--trials", "2", "--poll_s", "0.02"),
        *("--", *FAILS_AFTER_THE_FIRST),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sweep_script().main(argv) == 0
    # the failure is told as one (optuna infers FAIL from no value too, with a warning)
    assert not [w for w in caught if "could not be cast" in str(w.message)]
    out = capsys.readouterr().out
    first, second = trials_of(sweep_dir)
    assert (first.state.name, second.state.name) == ("COMPLETE", "FAIL")
    assert second.user_attrs["error"] == "error: CUDA out of memory"
    log = sweep_dir / "logs" / "trial_001.log"
    assert (
        f"sweep: trial 1: failed (exit 3): error: CUDA out of memory (its output: {log})\n" in out
    )
    assert "sweep: trial 1 failed: error: CUDA out of memory\n" in out  # the summary's


def rows_then_exit_0(
    rows: list[dict], first_launch_runs_the_stand_in: bool = False, exit_code: int = 0
) -> list[str]:
    """A launch command that writes these metrics rows and exits 0 (after the stand-in's whole
    run, for the first launch of a sweep, where FAKE_FIRST_DONE says), or exit_code with an
    `error:` line."""
    code = (
        "import json, os, pathlib, runpy, sys\n"
        "run = pathlib.Path(sys.argv[sys.argv.index('--output_dir') + 1])\n"
        "marker = os.environ.get('FAKE_FIRST_DONE', '')\n"
        f"if {first_launch_runs_the_stand_in} and not os.path.exists(marker):\n"
        "    open(marker, 'w').close()\n"
        f"    sys.argv = [{FAKE[1]!r}, *sys.argv[1:]]\n"
        f"    runpy.run_path({FAKE[1]!r}, run_name='__main__')\n"
        "    sys.exit(0)\n"
        "run.mkdir(parents=True, exist_ok=True)\n"
        f"(run / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\\n' for r in {rows!r}))\n"
        f"if {exit_code}:\n"
        "    print('error: the loss is nan', file=sys.stderr)\n"
        f"    sys.exit({exit_code})\n"
    )
    return [sys.executable, "-c", code]


def test_an_objective_no_eval_row_has_stops_the_sweep_naming_what_they_have(
    tmp_path, capsys, own_signals
):
    """objective: accuracy, but the eval rows hold eval_loss and eval_perplexity: the first trial
    fails with that line, and with no trial finished the sweep stops on it, exit 2."""
    space = write_space(
        tmp_path / "space.yaml",
        parameters={"lr": {"low": 1e-3, "high": 1e-2}},
        objective="accuracy",
    )
    sweep_dir = tmp_path / "objective"
    rows = [{"step": 1, "loss": 3.0}, {"step": 4, "eval_loss": 2.0, "eval_perplexity": 7.39}]
    argv = [
        *("--sweep_dir", str(sweep_dir), "--space", space, "--trials", "2", "--poll_s", "0.02"),
        *("--", *rows_then_exit_0(rows)),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sweep_script().main(argv) == 2
    assert not [w for w in caught if "could not be cast" in str(w.message)]  # told as failed
    error = "no eval row of trial 0 has 'accuracy' (they have: eval_loss, eval_perplexity)"
    assert capsys.readouterr().err == f"error: objective: {error}\n"
    (trial,) = trials_of(sweep_dir)
    assert trial.state.name == "FAIL" and trial.user_attrs["error"] == error


def test_a_later_trial_without_the_objective_is_failed_and_the_sweep_goes_on(
    tmp_path, capsys, own_signals, monkeypatch
):
    """The first trial finished (the stand-in's eval_loss); the second's rows hold no eval row
    with eval_loss: failed with that line (they have: none), said, and the sweep ends, exit 0."""
    monkeypatch.setenv("FAKE_FIRST_DONE", str(tmp_path / "first_done"))
    space = write_space(tmp_path / "space.yaml", parameters={"lr": {"low": 1e-3, "high": 1e-2}})
    sweep_dir = tmp_path / "later_objective"
    rows = [{"step": 1, "loss": 3.0}, {"step": 4, "eval_accuracy": 0.5}]
    argv = [
        *("--sweep_dir", str(sweep_dir), "--space", space, "--trials", "2", "--poll_s", "0.02"),
        *("--", *rows_then_exit_0(rows, first_launch_runs_the_stand_in=True)),
    ]
    assert sweep_script().main(argv) == 0
    error = "no eval row of trial 1 has 'eval_loss' (they have: none)"
    assert f"sweep: trial 1: failed: {error}\n" in capsys.readouterr().out
    first, second = trials_of(sweep_dir)
    assert (first.state.name, second.state.name) == ("COMPLETE", "FAIL")
    assert second.user_attrs["error"] == error


def test_an_eval_step_logged_again_is_reported_once_with_its_first_value(
    tmp_path, capsys, own_signals
):
    """A run that logs an eval row at a step already reported (as a resumed run does with the rows up
    to its checkpoint): the step keeps its first value, and a new step after it in the same read is
    still reported. Evals 3.0 and 7.0 at step 4, 2.0 and 9.0 at step 8, then exit 0: the trial's
    evals 3.0 and 2.0, its value 2.0."""
    space = write_space(tmp_path / "space.yaml", parameters={"lr": {"low": 1e-3, "high": 1e-2}})
    sweep_dir = tmp_path / "again"
    evals = ((4, 3.0), (4, 7.0), (8, 2.0), (8, 9.0))
    rows = [{"step": step, "eval_loss": value} for step, value in evals]
    argv = [
        *("--sweep_dir", str(sweep_dir), "--space", space, "--trials", "1", "--poll_s", "0.02"),
        *("--", *rows_then_exit_0(rows)),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sweep_script().main(argv) == 0
    assert not [w for w in caught if "already reported" in str(w.message)]  # reported once
    (trial,) = trials_of(sweep_dir)
    assert trial.state.name == "COMPLETE" and trial.value == 2.0
    assert trial.intermediate_values == {4: 3.0, 8: 2.0}
    assert "sweep: trial 0: eval_loss 2\n" in capsys.readouterr().out


def test_the_summary_table_and_csv_by_hand(tmp_path, capsys, own_signals):
    """Two complete trials of the stand-in: each value lr x 100 + 1/12 (its last eval, at step 12),
    written to 4 significant digits, the lr as its flag, the run folder; printed in columns and
    written to trials.csv. --summary prints it again without running anything."""
    space = write_space(
        tmp_path / "space.yaml",
        parameters={"lr": {"low": 1e-3, "high": 1e-2}},
        sampler="random",
    )
    sweep_dir = tmp_path / "runs" / "summary"  # as docs/sweeps.md's runs/sweep_lr, on a fresh clone
    assert sweep_script().main(driver_argv(sweep_dir, space, trials=2)) == 0
    capsys.readouterr()
    lrs = [t.params["lr"] for t in trials_of(sweep_dir)]
    rows = [
        [
            str(n),
            "complete",
            f"{lr * 100 + 1 / 12:.4g}",
            "12",
            repr(lr),
            str(sweep_dir / f"trial_{n:03d}"),
        ]
        for n, lr in enumerate(lrs)
    ]
    header = ["trial", "state", "eval_loss", "step", "lr", "run folder"]
    csv_text = (sweep_dir / "trials.csv").read_bytes().decode()  # csv's own \r\n kept
    assert csv_text == "".join(",".join(row) + "\r\n" for row in [header, *rows])
    assert sweep_script().main(["--sweep_dir", str(sweep_dir), "--summary"]) == 0
    out = capsys.readouterr().out.splitlines()
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(6)]
    table = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    assert out[:3] == table
    best = min(range(2), key=lambda n: lrs[n])
    value = f"{lrs[best] * 100 + 1 / 12:.4g}"
    assert out[3] == (
        f"sweep: best: trial {best}, eval_loss {value} (lr {lrs[best]!r}): "
        f"{sweep_dir / f'trial_{best:03d}'}"
    )


ALWAYS_PREEMPTED = [
    sys.executable,
    "-c",
    "import pathlib, sys\n"
    "run = pathlib.Path(sys.argv[sys.argv.index('--output_dir') + 1])\n"
    "run.mkdir(parents=True, exist_ok=True)\n"
    "(run / 'preempted.json').write_text('{}')\n"
    "print('stopped by the scheduler')\n"
    "sys.exit(1)\n",
]


def test_a_trial_preempted_again_and_again_is_resumed_three_times_then_failed(
    tmp_path, capsys, own_signals
):
    """Under a launcher that exits 1 (preempted.json written each time, no metrics row): resumed
    1/3, 2/3, 3/3, then failed; nothing trained and no trial finished: the command is called wrong,
    one line, exit 2."""
    space = write_space(tmp_path / "space.yaml", parameters={"lr": {"low": 1e-3, "high": 1e-2}})
    sweep_dir = tmp_path / "preempted"
    argv = [
        *("--sweep_dir", str(sweep_dir), "--space", space, "--trials", "2", "--poll_s", "0.02"),
        *("--", *ALWAYS_PREEMPTED),
    ]
    assert sweep_script().main(argv) == 2
    out, err = capsys.readouterr()
    said = [line for line in out.splitlines() if "preempted" in line]
    assert said == [f"sweep: trial 0: preempted, resuming it ({n}/3)" for n in (1, 2, 3)]
    log = sweep_dir / "logs" / "trial_000.log"
    assert err == (
        "error: the launch command failed before training (trial 0, exit 1): stopped by the "
        f"scheduler (its output: {log})\n"
    )
    assert log.read_text().count("--resume latest") == 3  # four launches, three of them resumes
    assert [t.state.name for t in trials_of(sweep_dir)] == ["FAIL"]


def test_a_run_folder_still_held_after_the_wait_is_one_line(tmp_path, monkeypatch, capsys):
    """A free folder (or one never locked) is taken at once; one whose lock stays held past the wait
    (FREE_FOLDER_WAIT_S, 1.2 s here: three polls half a second apart) is refused naming the folder
    and the wait, the wait said once."""
    module = sweep_script()
    run_dir = tmp_path / "trial_000"
    run_dir.mkdir()
    module.wait_until_free(run_dir)  # no .lock
    (run_dir / ".lock").touch()
    module.wait_until_free(run_dir)  # nobody holds it
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(module, "FREE_FOLDER_WAIT_S", 1.2)
    with open(run_dir / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        began = time.monotonic()
        with pytest.raises(module.SweepError) as refused:
            module.wait_until_free(run_dir)
        assert 1.2 <= time.monotonic() - began < 10
    assert str(refused.value) == (
        f"{run_dir} is still in use by the processes of an earlier driver after 1.2 s"
    )
    assert capsys.readouterr().out == (
        f"sweep: waiting for the earlier trial's processes to let go of {run_dir}\n"
    )


def test_a_run_folder_let_go_during_the_wait_is_taken_at_the_next_poll(tmp_path):
    """Let go 0.2 s into the wait: taken at the next poll, 0.5 s in (well before 1.5 s)."""
    module = sweep_script()
    run_dir = tmp_path / "trial_000"
    run_dir.mkdir()
    held = open(run_dir / ".lock", "a")
    fcntl.flock(held, fcntl.LOCK_EX)
    threading.Timer(0.2, held.close).start()
    began = time.monotonic()
    module.wait_until_free(run_dir)
    assert 0.2 <= time.monotonic() - began < 1.2


# the stand-in trial, which first writes its pid where FAKE_PID says
PID_THEN_FAKE = [
    sys.executable,
    "-c",
    "import os, runpy, sys\n"
    "open(os.environ['FAKE_PID'], 'w').write(str(os.getpid()))\n"
    f"sys.argv = [{FAKE[1]!r}, *sys.argv[1:]]\n"
    f"runpy.run_path({FAKE[1]!r}, run_name='__main__')\n",
]


def test_ctrl_c_stops_the_driver_with_exit_130_and_sends_the_trial_nothing(
    tmp_path, capsys, own_signals, monkeypatch
):
    """Ctrl-C at a terminal reaches the driver and the trial (one process group): here SIGINT to
    the driver, then to the trial 0.1 s later. The driver sends the trial no SIGTERM of its own (the
    stand-in would write preempted.json on one), leaves it running in the study for the next start,
    and exits 130 (SIGTERM: 75)."""
    pid_file = tmp_path / "trial.pid"
    monkeypatch.setenv("FAKE_PID", str(pid_file))
    space = write_space(tmp_path / "space.yaml", parameters={"lr": {"low": 1e-3, "high": 1e-2}})
    sweep_dir = tmp_path / "ctrl_c"
    first = sweep_dir / "trial_000"

    def ctrl_c():
        os.kill(os.getpid(), signal.SIGINT)
        threading.Event().wait(0.1)
        os.kill(int(pid_file.read_text()), signal.SIGINT)

    own_signals(rows_logged(first, 3), ctrl_c)
    argv = [
        *("--sweep_dir", str(sweep_dir), "--space", space, "--trials", "2", "--poll_s", "0.02"),
        *("--", *PID_THEN_FAKE),
    ]
    assert sweep_script().main(argv) == 130
    out = capsys.readouterr().out
    assert "sweep: stopped on SIGINT: the running trial checkpointed; go on with: python " in out
    # the flags main() was given (not this process's command line): the same driver again (the
    # stand-in's code spans lines: shlex quotes it whole, to the end of what the driver said)
    assert shlex.split(out.split("go on with: ")[1])[2:] == argv
    assert not (first / "preempted.json").exists()
    assert [t.state.name for t in trials_of(sweep_dir)] == ["RUNNING"]


def test_a_trial_another_driver_is_running_is_left_to_it(tmp_path, capsys, own_signals):
    """Two drivers share a study (--storage): a RUNNING trial whose driver is another machine's is
    not resumed here, nor one asked for by a driver that died before it named itself; they count
    among the study's trials, so --trials 4 adds one. In the summary they have no value, no step,
    no lr (none drawn here) and the run folder they were given, or none."""
    space = write_space(tmp_path / "space.yaml", parameters={"lr": {"low": 1e-3, "high": 1e-2}})
    sweep_dir = tmp_path / "shared"
    argv = driver_argv(sweep_dir, space, trials=1)
    assert sweep_script().main(argv) == 0  # trial 0, this driver's, complete
    study = optuna.load_study(study_name="shared", storage=f"sqlite:///{sweep_dir / 'study.db'}")
    elsewhere = study.ask()
    elsewhere.set_user_attr("driver", f"another-host:{sweep_dir.resolve()}")
    elsewhere.set_user_attr("run_dir", str(tmp_path / "elsewhere" / "trial_001"))
    study.ask()  # trial 2: no driver, no run folder
    capsys.readouterr()
    assert sweep_script().main(driver_argv(sweep_dir, space, trials=4)) == 0
    assert "resuming" not in capsys.readouterr().out
    states = [t.state.name for t in trials_of(sweep_dir)]
    assert states == ["COMPLETE", "RUNNING", "RUNNING", "COMPLETE"]
    assert not (tmp_path / "elsewhere").exists()
    assert len(launches(sweep_dir / "trial_003")) == 1
    rows = (sweep_dir / "trials.csv").read_bytes().decode().splitlines()
    assert rows[2:4] == [f"1,running,,,,{tmp_path / 'elsewhere' / 'trial_001'}", "2,running,,,,"]


def test_a_trial_that_failed_after_its_evals_shows_its_last_eval_in_the_summary(
    tmp_path, capsys, own_signals
):
    """Evals 2.5, 2.25 and 2.125 at steps 4, 8 and 12, then exit 1: failed with no value of its
    own, its row in trials.csv the last eval, 2.125, at step 12."""
    space = write_space(tmp_path / "space.yaml", parameters={"lr": {"low": 1e-3, "high": 1e-2}})
    sweep_dir = tmp_path / "failed_late"
    evals = {4: 2.5, 8: 2.25, 12: 2.125}
    rows = [{"step": step, "eval_loss": value} for step, value in evals.items()]
    argv = [
        *("--sweep_dir", str(sweep_dir), "--space", space, "--trials", "1", "--poll_s", "0.02"),
        *("--", *rows_then_exit_0(rows, exit_code=1)),
    ]
    assert sweep_script().main(argv) == 0
    (trial,) = trials_of(sweep_dir)
    assert trial.state.name == "FAIL" and trial.value is None
    assert trial.intermediate_values == evals
    row = (sweep_dir / "trials.csv").read_bytes().decode().splitlines()[1]
    assert row == f"0,fail,2.125,12,{trial.params['lr']!r},{sweep_dir / 'trial_000'}"
    assert "sweep: trial 0 failed: error: the loss is nan\n" in capsys.readouterr().out


def test_the_best_trial_is_said_with_each_of_its_values(tmp_path, capsys):
    """--summary over a study of two trials in two parameters (added to it directly, nothing run):
    the best (lowest eval_loss) named with both of its values, as flags."""
    import optuna.distributions as d

    module = sweep_script()
    sweep_dir = tmp_path / "two"
    sweep_dir.mkdir()
    space = {
        "objective": "eval_loss",
        "direction": "minimize",
        "sampler": "tpe",
        "seed": 0,
        "pruner": "none",
        "parameters": {"lr": {"low": 1e-3, "high": 1e-2}, "warmup_steps": {"low": 0, "high": 9}},
    }
    (sweep_dir / module.SWEEP_FILE).write_text(yaml.safe_dump({"space": space, "command": ["x"]}))
    study = optuna.create_study(study_name="two", storage=f"sqlite:///{sweep_dir / 'study.db'}")
    ranges = {"lr": d.FloatDistribution(1e-3, 1e-2), "warmup_steps": d.IntDistribution(0, 9)}
    for value, lr, warmup in ((2.5, 0.004, 3), (1.5, 0.002, 7)):
        study.add_trial(
            optuna.trial.create_trial(
                value=value,
                params={"lr": lr, "warmup_steps": warmup},
                distributions=ranges,
                user_attrs={"run_dir": f"runs/{lr}"},
                intermediate_values={4: value},
            )
        )
    plotted = []
    real = module.plot
    module.plot = lambda trials, *given: plotted.append(given) or real(trials, *given)
    assert module.main(["--sweep_dir", str(sweep_dir), "--summary"]) == 0
    # the plot of the sweep's objective and direction, in its folder
    assert plotted == [("eval_loss", "minimize", sweep_dir / "objective.png")]
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == [
        "trial",
        "state",
        "eval_loss",
        "step",
        "lr",
        "warmup_steps",
        "run",
        "folder",
    ]
    assert "sweep: best: trial 1, eval_loss 1.5 (lr 0.002, warmup_steps 7): runs/0.002" in out


# a launch that ends its run (exit 0, one eval row) whatever the driver sends it, and the first time
# it runs, stops its driver as a scheduler would while it ends
SIGNALS_ITS_DRIVER_ONCE = [
    sys.executable,
    "-c",
    "import json, os, pathlib, signal, sys\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "run = pathlib.Path(sys.argv[sys.argv.index('--output_dir') + 1])\n"
    "run.mkdir(parents=True, exist_ok=True)\n"
    "(run / 'metrics.jsonl').write_text(json.dumps({'step': 4, 'eval_loss': 0.5}) + '\\n')\n"
    "marker = pathlib.Path(os.environ['FAKE_SIGNALLED'])\n"
    "if not marker.exists():\n"
    "    marker.touch()\n"
    "    os.kill(os.getppid(), signal.SIGTERM)\n",
]


def test_a_driver_stopped_as_its_trial_ends_exits_75_before_the_next_and_the_next_start_runs_it(
    tmp_path, capsys, own_signals, monkeypatch
):
    """SIGTERM reaches the driver as its first of two trials ends (the trial completes anyway): the
    sweep is not over, so the driver starts no other trial and exits 75, as a preempted job must
    for its scheduler to requeue it (exit 0 says done); started again, it runs the second."""
    monkeypatch.setenv("FAKE_SIGNALLED", str(tmp_path / "signalled"))
    space = write_space(tmp_path / "space.yaml", parameters={"lr": {"low": 1e-3, "high": 1e-2}})
    sweep_dir = tmp_path / "between"
    argv = [
        *("--sweep_dir", str(sweep_dir), "--space", space, "--trials", "2", "--poll_s", "0.02"),
        *("--", *SIGNALS_ITS_DRIVER_ONCE),
    ]
    assert sweep_script().main(argv) == 75
    out = capsys.readouterr().out
    assert "sweep: trial 0: eval_loss 0.5\n" in out
    assert "sweep: stopped on SIGTERM: before its next trial; go on with: python " in out
    assert [t.state.name for t in trials_of(sweep_dir)] == ["COMPLETE"]
    assert not (sweep_dir / "trial_001").exists()
    assert sweep_script().main(argv) == 0
    assert [t.state.name for t in trials_of(sweep_dir)] == ["COMPLETE", "COMPLETE"]


def test_a_driver_stopped_while_no_trial_runs_launches_none_and_exits_75(
    tmp_path, capsys, own_signals
):
    """The signal handler called as the kernel calls it while no trial runs (nothing to pass the
    signal on to): before the first trial, and after one has ended."""
    import argparse

    module = sweep_script()
    space = write_space(tmp_path / "space.yaml", parameters={"lr": {"low": 1e-3, "high": 1e-2}})
    sweep_dir = tmp_path / "early"
    args = argparse.Namespace(
        sweep_dir=str(sweep_dir), space=space, command=["--", *FAKE], storage="", study_name=""
    )
    args.poll_s, args.argv = 0.02, []
    module.take_driver_lock(sweep_dir).close()
    before_any = module.Sweep(args)
    before_any._stop(signal.SIGTERM, None)
    assert before_any.run(1) == 75
    assert "sweep: stopped on SIGTERM: before its next trial" in capsys.readouterr().out
    assert trials_of(sweep_dir) == [] and not (sweep_dir / "trial_000").exists()
    after_one = module.Sweep(args)
    assert after_one.run(1) == 0
    after_one._stop(signal.SIGTERM, None)
    assert after_one.run(2) == 75
    assert "sweep: stopped on SIGTERM: before its next trial" in capsys.readouterr().out
    assert [t.state.name for t in trials_of(sweep_dir)] == ["COMPLETE"]
    assert not (sweep_dir / "trial_001").exists()


def test_what_the_driver_said_before_a_kill_9_is_in_its_log(tmp_path):
    """The driver's output a file (nohup, a scheduler's log), no PYTHONUNBUFFERED, and its process
    group SIGKILLed during its second trial: the line that told the first trial's value is in the
    log (each line is written out as said: a kill leaves no buffer to write)."""
    space = write_space(tmp_path / "space.yaml", parameters={"lr": {"low": 1e-3, "high": 1e-2}})
    sweep_dir = tmp_path / "killed"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    log = tmp_path / "driver.log"
    with open(log, "w") as output:
        driver = subprocess.Popen(
            [sys.executable, str(REPO / "scripts" / "sweep.py"), *driver_argv(sweep_dir, space, 2)],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    second = sweep_dir / "trial_001" / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not second.exists() and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    first = trials_of(sweep_dir)[0]
    assert f"sweep: trial 0: eval_loss {first.value:.4g}\n" in log.read_text()
