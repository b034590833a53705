"""scripts/sweep.py's objective.png: what its axes say, read from the figure the script draws."""

import optuna
import pytest

from test_sweep_inputs import sweep_script


def visible_ticks(axis, limits) -> list[float]:
    low, high = sorted(limits)
    return [tick for tick in axis.get_ticklocs() if low <= tick <= high]


@pytest.mark.parametrize("count", [2, 3, 7])
def test_the_trial_and_step_axes_tick_only_whole_numbers(count):
    """A few trials (a small sweep's first plot, where matplotlib's default ticks fall at 0.5, 1.5, ...)
    and eval curves a few steps long: every tick on both x axes is a whole trial or step."""
    study = optuna.create_study()
    for number in range(count):
        evals = {2: 3.0 - 0.1 * number, 4: 2.5 - 0.1 * number}  # two evals, two steps apart
        study.add_trial(optuna.trial.create_trial(value=evals[4], intermediate_values=evals))
    figure = sweep_script().drawing(study.trials, "eval_loss", "minimize")
    figure.canvas.draw()  # the ticks are placed as the saved figure places them
    by_trial, curves = figure.axes
    trial_ticks = visible_ticks(by_trial.xaxis, by_trial.get_xlim())
    step_ticks = visible_ticks(curves.xaxis, curves.get_xlim())
    assert trial_ticks and all(tick == int(tick) for tick in trial_ticks), trial_ticks
    assert step_ticks and all(tick == int(tick) for tick in step_ticks), step_ticks
    # the labels a person reads: "0", "1", ..., never "0.5"
    labels = [label.get_text() for label in by_trial.get_xticklabels() if label.get_text()]
    assert labels and not any("." in label for label in labels), labels
    import matplotlib.pyplot as plt

    plt.close(figure)
