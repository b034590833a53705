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
    assert "--space differs from the space" in refusal(tmp_path, capsys, other)
    line = refusal(tmp_path, capsys, GOOD, command=[*LAUNCH, "--max_steps", "5"])
    assert "the launch command differs from the one" in line
    empty = tmp_path / "empty"
    code = module.main(["--sweep_dir", str(empty), "--trials", "1"])
    assert code == 2 and "holds no sweep yet: give --space" in capsys.readouterr().err
