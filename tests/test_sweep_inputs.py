"""scripts/sweep.py's inputs: each bad one is one `error:` line and exit 2, before any trial starts
(the sweeps themselves run in tests/e2e/test_sweep.py)."""

import importlib.util

import pytest
import yaml

from conftest import REPO

LAUNCH = ["--", "python", "train/main.py", "--config", "train/configs/tiny.yaml"]
GOOD = {"objective": "eval_loss", "parameters": {"lr": {"low": 1e-4, "high": 1e-2, "log": True}}}


def sweep_script():
    spec = importlib.util.spec_from_file_location("sweep", REPO / "scripts" / "sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refusal(tmp_path, capsys, space, command=LAUNCH, sweep_dir="sweep") -> str:
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space) if isinstance(space, dict) else space)
    argv = ["--sweep_dir", str(tmp_path / sweep_dir), "--space", str(path), *command]
    code = sweep_script().main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, out, err)
    assert not (tmp_path / sweep_dir / "trial_000").exists()  # no trial started
    return lines[0]


@pytest.mark.parametrize(
    "parameters, said",
    [
        ({"lrr": {"low": 0.1, "high": 1.0}}, "unknown config key 'lrr' (did you mean 'lr'?)"),
        ({"lr": {"low": 0.01, "high": 0.01}}, "the range is empty (low 0.01 must be < high 0.01)"),
        ({"lr": {"low": 0.0, "high": 0.1, "log": True}}, "a log range needs low > 0"),
        ({"lr": {"low": 1e-3}}, "must be {low: .., high: ..}"),
        ({"optimizer": {"low": 1, "high": 2}}, "optimizer is a str: give it choices"),
        ({"batch_size": {"choices": [4, "big"]}}, "batch_size must be an int (got 'big')"),
        ({"warmup_steps": {"choices": []}}, "choices must be a non-empty list"),
        ({"output_dir": {"choices": ["a", "b"]}}, "output_dir is set by the sweep"),
        # the fork's own keys are keys like any other: model.py's n_layer is known
        ({"n_layerz": {"low": 1, "high": 4}}, "(did you mean 'n_layer'?)"),
    ],
)
def test_a_bad_parameter_is_one_line_naming_it(tmp_path, capsys, parameters, said):
    line = refusal(tmp_path, capsys, {"objective": "eval_loss", "parameters": parameters})
    assert said in line and f"parameters.{next(iter(parameters))}" in line, line


@pytest.mark.parametrize(
    "space, said",
    [
        ({**GOOD, "direction": "down"}, "direction must be minimize or maximize"),
        ({**GOOD, "objective": ""}, "objective must name a metric"),
        ({**GOOD, "pruner": {"name": "MedianPrunr"}}, "optuna.pruners has no pruner 'MedianPrunr'"),
        ({**GOOD, "pruner": {"name": "MedianPruner", "startup": 2}}, "pruner: MedianPruner("),
        ({**GOOD, "budget": 3}, "unknown key 'budget'"),
        ({"objective": "eval_loss", "parameters": {}}, "parameters must map at least one"),
        ("objective: [unclosed", "is not valid YAML"),
    ],
)
def test_a_bad_space_is_one_line(tmp_path, capsys, space, said):
    assert said in refusal(tmp_path, capsys, space)


def test_the_launch_command_may_not_set_what_each_trial_gets(tmp_path, capsys):
    line = refusal(tmp_path, capsys, GOOD, command=[*LAUNCH, "--output_dir=runs/x"])
    assert "the launch command sets --output_dir: the sweep sets it for each trial" in line


def test_a_restart_keeps_the_space_and_the_command_it_was_started_with(tmp_path, capsys):
    """The first start records them (sweep.yaml); a restart with others is refused, one without any
    takes the recorded ones."""
    module = sweep_script()
    folder = tmp_path / "sweep"
    folder.mkdir()
    given = tmp_path / "given.yaml"
    given.write_text(yaml.safe_dump(GOOD))
    recorded = {"space": module.read_space(given), "command": LAUNCH[1:]}
    (folder / module.SWEEP_FILE).write_text(yaml.safe_dump(recorded))
    other = {**GOOD, "parameters": {"lr": {"low": 1e-5, "high": 1e-2, "log": True}}}
    record = folder / module.SWEEP_FILE
    assert refusal(tmp_path, capsys, other) == (
        f"error: --space differs from the space {folder} was started with ({record}): use "
        "another --sweep_dir"
    )
    line = refusal(tmp_path, capsys, GOOD, command=[*LAUNCH, "--max_steps", "5"])
    assert line == (
        f"error: the launch command differs from the one {folder} was started with ({record}): "
        "use another --sweep_dir"
    )
    # a first start needs both: the space and the command
    empty = tmp_path / "empty"
    for given_now in [[], ["--space", str(given)], LAUNCH]:
        code = module.main(["--sweep_dir", str(empty), "--trials", "1", *given_now])
        assert code == 2 and capsys.readouterr().err == (
            f"error: {empty} holds no sweep yet: give --space FILE and the launch command after --\n"
        )
        assert not (empty / module.SWEEP_FILE).exists()
    # the space given without the command (or the command without the space): the recorded ones
    assert module.settled(folder, module_args(given, [])) == (recorded["space"], LAUNCH[1:])
    assert module.settled(folder, module_args("", LAUNCH)) == (recorded["space"], LAUNCH[1:])


def test_the_summary_of_a_sweep_folder_that_is_not_there_is_one_line_and_makes_nothing(
    tmp_path, capsys
):
    """--summary of a mistyped folder (its parent missing too): the one line, and no folder left."""
    typo = tmp_path / "runs" / "sweep_lrr"
    code = sweep_script().main(["--sweep_dir", str(typo), "--summary"])
    assert code == 2 and capsys.readouterr().err == (
        f"error: {typo} holds no sweep yet: give --space FILE and the launch command after --\n"
    )
    assert not (tmp_path / "runs").exists()


def module_args(space, command):
    import argparse

    return argparse.Namespace(space=str(space) if space else "", command=list(command))


def test_the_first_start_records_the_space_with_its_defaults_and_the_command(tmp_path):
    module = sweep_script()
    given = tmp_path / "given.yaml"
    given.write_text(yaml.safe_dump(GOOD))
    folder = tmp_path / "sweep"
    folder.mkdir()
    space, command = module.settled(folder, module_args(given, LAUNCH))
    defaults = {"direction": "minimize", "sampler": "tpe", "seed": 0, "pruner": "none"}
    assert (space, command) == ({**defaults, **GOOD}, LAUNCH[1:])
    recorded = yaml.safe_load((folder / module.SWEEP_FILE).read_text())
    assert recorded == {"space": {**defaults, **GOOD}, "command": LAUNCH[1:]}
    assert list(recorded) == ["space", "command"]
    # a command without the leading --, as argparse may leave it, is the same command
    again = tmp_path / "again"
    again.mkdir()
    assert module.settled(again, module_args(given, LAUNCH[1:]))[1] == LAUNCH[1:]


@pytest.mark.parametrize(
    "spec, said",
    [
        (
            {"choices": ["adamw"], "low": 1},
            "parameters.optimizer: choices goes alone (got choices, low)",
        ),
        ({"choices": "adamw"}, "parameters.optimizer: choices must be a non-empty list"),
        (3, "parameters.optimizer must be {low: .., high: ..} or {choices: [..]} (got 3)"),
    ],
)
def test_a_bad_choice_is_its_whole_line(tmp_path, capsys, spec, said):
    space = {"objective": "eval_loss", "parameters": {"optimizer": spec}}
    assert refusal(tmp_path, capsys, space) == f"error: {tmp_path / 'space.yaml'}: {said}"


@pytest.mark.parametrize(
    "spec, said",
    [
        ({"low": 1, "high": 9, "step": 0}, ": step must be > 0 (got 0)"),
        ({"low": 1, "high": 9, "step": "two"}, ": step must be > 0 (got 'two')"),
        ({"low": 1, "high": 9, "step": 2, "log": True}, ": log and step do not go together"),
        (
            {"low": 1, "high": 9, "sigma": 2},
            " must be {low: .., high: ..} (with log or step) or {choices: [..]}",
        ),
        ({"low": 9, "high": 1}, ": the range is empty (low 9 must be < high 1)"),
        ({"low": "few", "high": 9}, ": warmup_steps must be an int (got 'few')"),
        ({"low": -1, "high": 9, "log": True}, ": a log range needs low > 0 (got -1)"),
    ],
)
def test_a_bad_range_is_its_whole_line(tmp_path, capsys, spec, said):
    space = {"objective": "eval_loss", "parameters": {"warmup_steps": spec}}
    where = f"{tmp_path / 'space.yaml'}: parameters.warmup_steps"
    assert refusal(tmp_path, capsys, space) == f"error: {where}{said}"


def test_the_smallest_ranges_pass(tmp_path):
    """Just non-empty, a log range from just above 0, a step of 1 and of 0.5."""
    space = {
        "objective": "eval_loss",
        "parameters": {
            "warmup_steps": {"low": 0, "high": 1, "step": 1},
            "lr": {"low": 1e-9, "high": 2e-9, "log": True},
            "dropout": {"low": 0.0, "high": 0.5, "step": 0.5},
        },
    }
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    assert sweep_script().read_space(path)["parameters"] == space["parameters"]


@pytest.mark.parametrize(
    "space, said",
    [
        (None, "--space: cannot read {path} (No such file or directory)"),
        ("[1, 2]", "--space: {path} must hold a mapping (objective, parameters, ...)"),
        ({**GOOD, "sampler": "grid"}, "{path}: sampler must be one of tpe, random (got 'grid')"),
        ({**GOOD, "direction": "up"}, "{path}: direction must be minimize or maximize (got 'up')"),
        (
            {**GOOD, "pruner": "median"},
            "pruner must be none or {{name: MedianPruner, ...its arguments}} (got 'median')",
        ),
        (
            {**GOOD, "pruner": {"name": 3}},
            "pruner must be none or {{name: MedianPruner, ...its arguments}} (got {{'name': 3}})",
        ),
        (
            {**GOOD, "pruner": {"name": "TYPE_CHECKING"}},
            "pruner: optuna.pruners has no pruner 'TYPE_CHECKING' (MedianPruner, ...)",
        ),
        (
            {"parameters": GOOD["parameters"]},
            "{path}: objective must name a metric of the eval rows, e.g. eval_loss",
        ),
        (
            {**GOOD, "budget": 3, "alpha": 1},
            "{path}: unknown key 'alpha' (known: direction, objective, parameters, pruner, "
            "sampler, seed)",
        ),
    ],
)
def test_a_bad_space_file_is_its_whole_line(tmp_path, capsys, space, said):
    """The line as the script writes it: the path where it names it, the value as given."""
    path = tmp_path / "space.yaml"
    if space is not None:
        path.write_text(yaml.safe_dump(space) if isinstance(space, dict) else space)
    argv = ["--sweep_dir", str(tmp_path / "sweep"), "--space", str(path), *LAUNCH]
    assert sweep_script().main(argv) == 2
    assert capsys.readouterr().err == f"error: {said.format(path=path)}\n"


def test_a_space_file_that_is_not_yaml_is_one_line_with_yaml_s_first_line(tmp_path, capsys):
    path = tmp_path / "space.yaml"
    path.write_text("objective: [eval_loss\nparameters: {}\n")
    with pytest.raises(yaml.YAMLError) as raised:
        yaml.safe_load(path.read_text())
    first = str(raised.value).splitlines()[0]
    argv = ["--sweep_dir", str(tmp_path / "sweep"), "--space", str(path), *LAUNCH]
    assert sweep_script().main(argv) == 2
    assert capsys.readouterr().err == f"error: --space: {path} is not valid YAML ({first})\n"


def test_a_fork_s_config_keys_declared_wrongly_are_the_sweep_s_one_line(
    tmp_path, capsys, monkeypatch
):
    """run_config's refusal of a fork's model.py or data.py keys (ConfigError) is the sweep's one
    line too, word for word."""
    from errors import ConfigError

    said = "train/model.py's ModelConfig: key 'lr' is already TrainConfig's: name it otherwise"

    def refused():
        raise ConfigError(said)

    module = sweep_script()
    monkeypatch.setattr(module, "config_class", refused)
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    argv = ["--sweep_dir", str(tmp_path / "sweep"), "--space", str(path), *LAUNCH]
    assert module.main(argv) == 2
    assert capsys.readouterr().err == f"error: {said}\n"


def test_a_space_s_defaults_are_minimize_tpe_seed_0_and_no_pruner(tmp_path):
    import optuna

    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    module = sweep_script()
    space = module.read_space(path)
    assert space == {"direction": "minimize", "sampler": "tpe", "seed": 0, "pruner": "none", **GOOD}
    assert isinstance(module.pruner_of(space), optuna.pruners.NopPruner)
    assert isinstance(module.pruner_of({"pruner": None}), optuna.pruners.NopPruner)
    median = module.pruner_of({"pruner": {"name": "MedianPruner", "n_startup_trials": 3}})
    assert isinstance(median, optuna.pruners.MedianPruner) and median._n_startup_trials == 3


def test_each_parameter_is_the_optuna_distribution_its_key_s_type_asks_for(tmp_path):
    """By hand: an int key's range is an IntDistribution (its step, its log), a float key's a
    FloatDistribution, choices a CategoricalDistribution of the key's type (YAML's "8" an int)."""
    import optuna.distributions as d

    space = {
        "parameters": {
            "lr": {"low": 1e-4, "high": 1e-2, "log": True},
            "dropout": {"low": 0, "high": 0.5, "step": 0.1},
            "warmup_steps": {"low": 0, "high": 100, "step": 10},
            "batch_size": {"low": 2, "high": 64, "log": True},
            "seed": {"low": 1, "high": 3},
            "optimizer": {"choices": ["adamw", "muon"]},
            "grad_accum_steps": {"choices": ["8", 2]},
        }
    }
    assert sweep_script().distributions(space) == {
        "lr": d.FloatDistribution(1e-4, 1e-2, log=True),
        "dropout": d.FloatDistribution(0.0, 0.5, step=0.1),
        "warmup_steps": d.IntDistribution(0, 100, step=10),
        "batch_size": d.IntDistribution(2, 64, log=True),
        "seed": d.IntDistribution(1, 3),
        "optimizer": d.CategoricalDistribution(["adamw", "muon"]),
        "grad_accum_steps": d.CategoricalDistribution([8, 2]),
    }


def test_a_sweep_over_datasets_stores_each_choice_as_written_and_flags_it_so(tmp_path):
    """A sweep over data mixtures: each choice (a path, or a mixture 'PATH:WEIGHT,...') is the
    string written, which Optuna's storage holds (its parsed sources would not be JSON) and the
    trial's --dataset flag passes on for the trial to parse."""
    import optuna

    mixture = "data/a.jsonl:0.5,data/b.jsonl:0.5"
    path = tmp_path / "space.yaml"
    parameters = {"dataset": {"choices": [mixture, "data/a.jsonl"]}}
    path.write_text(yaml.safe_dump({"objective": "eval_loss", "parameters": parameters}))
    module = sweep_script()
    found = module.distributions(module.read_space(path))
    assert found == {
        "dataset": optuna.distributions.CategoricalDistribution(parameters["dataset"]["choices"])
    }
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}")
    study.sampler = optuna.samplers.RandomSampler(seed=0)
    drawn = {module.as_flag(study.ask(found).params["dataset"]) for _ in range(8)}
    assert drawn == {mixture, "data/a.jsonl"}


def test_a_dataset_choice_written_as_a_list_is_its_whole_line(tmp_path, capsys):
    listed = [{"path": "data/a.jsonl", "weight": 1.0}, {"path": "data/b.jsonl", "weight": 1.0}]
    space = {"objective": "eval_loss", "parameters": {"dataset": {"choices": [listed]}}}
    assert refusal(tmp_path, capsys, space) == (
        f"error: {tmp_path / 'space.yaml'}: parameters.dataset: each choice is one string: a path, "
        f"a hub name or a mixture 'PATH:WEIGHT,...' (got {listed!r})"
    )


def test_a_trial_s_values_as_flags():
    module = sweep_script()
    assert [module.as_flag(v) for v in (True, False, 0.1, 1e-05, 3, "adamw")] == [
        "true",
        "false",
        "0.1",
        "1e-05",
        "3",
        "adamw",
    ]


def test_help_is_the_docstring_whole_around_each_flag_with_its_default(capsys, monkeypatch):
    """--help: the docstring's first paragraph, the flags, then the rest of the docstring, each
    line as written (the example commands and the space's YAML intact), each once."""
    monkeypatch.setenv("COLUMNS", "200")
    module = sweep_script()
    with pytest.raises(SystemExit) as exited:
        module.main(["--help"])
    assert exited.value.code == 0
    shown = capsys.readouterr().out.splitlines()
    written = [line for line in module.__doc__.splitlines() if line.strip()]
    assert [shown.count(line) for line in written] == [1] * len(written)
    at = [shown.index(line) for line in written]
    assert at == sorted(at)
    options = " ".join(" ".join(shown[at[1] + 1 : at[2]]).split())  # between the two paragraphs
    for flag in [
        "--sweep_dir SWEEP_DIR the sweep's folder: study.db, trial_NNN/, logs/",
        "--space SPACE the space's YAML file (the first start; kept in sweep.yaml)",
        "--trials TRIALS trials in the study, all states counted (default: 20)",
        "--storage STORAGE a database URL for the study (default: sqlite in sweep_dir)",
        "--study_name STUDY_NAME default: the sweep folder's name",
        "--summary print the table and write the plot, run nothing",
        "--poll_s POLL_S seconds between reads of the trial's metrics.jsonl (default: 1.0)",
        "command -- the launch command",
    ]:
        assert flag in options, (flag, options)


def test_a_driver_given_only_its_folder_runs_20_trials_reading_metrics_each_second(
    tmp_path, monkeypatch
):
    """The defaults --help states, as the driver gets them (its runs are test_sweep_driver.py's)."""
    module = sweep_script()
    given = {}

    class Driver:
        def __init__(self, args):
            given.update(vars(args))

        def run(self, trials: int) -> int:
            given["run"] = trials
            return 0

    monkeypatch.setattr(module, "Sweep", Driver)
    assert module.main(["--sweep_dir", str(tmp_path / "sweep")]) == 0
    assert (given["run"], given["trials"], given["poll_s"]) == (20, 20, 1.0)
    assert (given["space"], given["storage"], given["study_name"]) == ("", "", "")
    assert given["summary"] is False and given["command"] == []


def test_a_driver_needs_its_folder(capsys):
    with pytest.raises(SystemExit) as exited:
        sweep_script().main(["--trials", "2"])
    assert exited.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]  # "<the script's name>: error: ..."
    assert last.endswith(": error: the following arguments are required: --sweep_dir")


def test_fewer_than_one_trial_is_refused(tmp_path, capsys):
    code = sweep_script().main(["--sweep_dir", str(tmp_path / "s"), "--trials", "0"])
    assert code == 2 and capsys.readouterr().err == "error: --trials must be >= 1 (got 0)\n"


def test_a_trial_s_error_line_is_its_last_error_else_its_last_line(tmp_path):
    module = sweep_script()
    log = tmp_path / "trial.log"
    log.write_text("start\nerror: first\n  error: second  \nTraceback\n\n")
    assert module.error_line(log) == "error: second"
    log.write_text("start\n  Killed  \n\n\n")
    assert module.error_line(log) == "Killed"
    log.write_text("error: " + "x" * 400 + "\n")
    assert module.error_line(log) == "error: " + "x" * 293  # 300 characters
    # a multi-byte character cut short (a progress bar's, killed mid-write): read, replaced
    log.write_bytes(b"step 3 \xe2\x96\nerror: CUDA out of memory \xff\n")
    assert module.error_line(log) == "error: CUDA out of memory \ufffd"
    log.write_text("\n \n")
    assert module.error_line(log) == ""
    assert module.error_line(tmp_path / "none.log") == ""


def test_metrics_rows_are_read_as_whole_lines_once(tmp_path):
    """A row half written is read once it is whole; a line that is not JSON is skipped."""
    module = sweep_script()
    path = tmp_path / "metrics.jsonl"
    follower = module.MetricsFollower(path)
    assert follower.new_rows() == []  # no file yet
    path.write_text('{"step": 1}\nnot json\n{"step": 2, "eval')
    assert follower.new_rows() == [{"step": 1}]
    assert follower.new_rows() == []
    with open(path, "a") as f:
        f.write('_loss": 0.5}\n{"step": 3}\n')
    assert follower.new_rows() == [{"step": 2, "eval_loss": 0.5}, {"step": 3}]
    assert module.MetricsFollower(path).new_rows() == [
        {"step": 1},
        {"step": 2, "eval_loss": 0.5},
        {"step": 3},
    ]


def test_a_second_driver_of_a_sweep_folder_is_refused_naming_the_first(tmp_path):
    import os
    import socket

    module = sweep_script()
    folder = tmp_path / "sweep"
    held = module.take_driver_lock(folder)
    holder = f"host {socket.gethostname()}, pid {os.getpid()}"
    assert (folder / "driver.lock").read_text() == holder + "\n"
    with pytest.raises(module.SweepError) as refused:
        module.take_driver_lock(folder)
    assert str(refused.value) == (
        f"{folder} is driven by another driver ({holder}): one per sweep folder"
    )
    held.close()
    module.take_driver_lock(folder).close()  # let go: the next driver takes it
    assert (folder / "driver.lock").read_text() == holder + "\n"  # written over, not appended
