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


def study_of(values, pruned=()):
    """Trials 0, 1, ... with these values (None: a pruned trial, its evals only), evals at steps 4
    and 8."""
    study = optuna.create_study()
    for number, value in enumerate(values):
        evals = {4: 10.0 + number, 8: 9.0 + number}
        if number in pruned:
            trial = optuna.trial.create_trial(
                state=optuna.trial.TrialState.PRUNED, intermediate_values={4: evals[4]}
            )
        else:
            trial = optuna.trial.create_trial(value=value, intermediate_values=evals)
        study.add_trial(trial)
    return study


@pytest.mark.parametrize(
    "direction, best",
    [("minimize", [3.0, 1.0, 1.0, 0.5]), ("maximize", [3.0, 3.0, 3.0, 3.0])],
)
def test_each_trial_s_objective_and_the_best_so_far_by_hand(direction, best):
    """Values 3, 1, (pruned), 2, 0.5: the complete trials 0, 1, 3, 4 with their values, and the
    best so far; every trial's eval curve, the pruned one dashed."""
    import matplotlib.pyplot as plt

    study = study_of([3.0, 1.0, None, 2.0, 0.5], pruned={2})
    figure = sweep_script().drawing(study.trials, "accuracy", direction)
    by_trial, curves = figure.axes
    values, so_far = by_trial.get_lines()
    assert list(values.get_xdata()) == [0, 1, 3, 4] and values.get_linestyle() == "None"
    assert list(values.get_ydata()) == [3.0, 1.0, 2.0, 0.5]
    assert list(so_far.get_xdata()) == [0, 1, 3, 4] and list(so_far.get_ydata()) == best
    assert [t.get_text() for t in by_trial.get_legend().get_texts()] == ["trial", "best so far"]
    assert (by_trial.get_xlabel(), by_trial.get_ylabel()) == ("trial", "accuracy")
    assert by_trial.get_title() == "accuracy per complete trial"
    lines = curves.get_lines()
    assert [list(line.get_xdata()) for line in lines] == [[4, 8], [4, 8], [4], [4, 8], [4, 8]]
    assert [list(line.get_ydata()) for line in lines][:3] == [[10.0, 9.0], [11.0, 10.0], [12.0]]
    assert [line.get_linestyle() for line in lines] == ["-", "-", "--", "-", "-"]
    labels = [t.get_text() for t in curves.get_legend().get_texts()]
    assert labels == ["0 complete", "1 complete", "2 pruned", "3 complete", "4 complete"]
    assert (curves.get_xlabel(), curves.get_ylabel()) == ("step", "accuracy")
    assert curves.get_title() == "eval curves (dashed: pruned)"
    plt.close(figure)


def test_twelve_curves_get_a_legend_and_thirteen_do_not():
    import matplotlib.pyplot as plt

    script = sweep_script()
    for count, legend in ((12, True), (13, False)):
        figure = script.drawing(study_of([1.0] * count).trials, "eval_loss", "minimize")
        assert (figure.axes[1].get_legend() is not None) == legend, count
        plt.close(figure)


def test_a_sweep_with_no_complete_trial_draws_no_values():
    import matplotlib.pyplot as plt

    figure = sweep_script().drawing(study_of([None], pruned={0}).trials, "eval_loss", "minimize")
    by_trial, curves = figure.axes
    assert by_trial.get_lines() == [] and by_trial.get_legend() is None
    assert len(curves.get_lines()) == 1
    plt.close(figure)


def test_the_plot_is_a_1200_by_450_png(tmp_path):
    """figsize 12 x 4.5 inches at 100 dots an inch."""
    from PIL import Image

    path = tmp_path / "objective.png"
    sweep_script().plot(study_of([2.0, 1.0]).trials, "eval_loss", "minimize", path)
    with Image.open(path) as image:
        assert (image.format, image.size) == ("PNG", (1200, 450))


def test_the_plot_draws_the_objective_and_direction_it_is_given(tmp_path, monkeypatch):
    """plot() hands drawing() the sweep's objective and direction (its axis labels, its best so
    far): read from the figure it saves."""
    module = sweep_script()
    drawn = []
    real = module.drawing

    def recorded(trials, objective, direction):
        figure = real(trials, objective, direction)
        drawn.append((objective, direction, list(figure.axes[0].get_lines()[1].get_ydata())))
        return figure

    monkeypatch.setattr(module, "drawing", recorded)
    module.plot(study_of([2.0, 3.0]).trials, "accuracy", "maximize", tmp_path / "objective.png")
    assert drawn == [("accuracy", "maximize", [2.0, 3.0])]
