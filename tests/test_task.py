"""What the template asks of the fork's files (train/task.py), for any task: the start-up checks say what is
wrong in one line that points into the fork's files; and any dataset gets a content identity for resuming
(batches.data_identity): an image folder's files, a plain torch Dataset's samples."""

import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import task
from batches import content_digest, loss_weights
from errors import ConfigError
from run_config import config_class

RunConfig = config_class()  # TrainConfig and model.py's and data.py's own keys


def classifier_columns(output, batch):
    right = output.logits.argmax(-1) == batch["labels"]
    losses = F.cross_entropy(output.logits, batch["labels"], reduction="none")
    return {"samples": torch.ones(len(right)), "loss": losses, "right": right.double()}


def classifier_metrics(sums, cfg):
    return {"loss": sums["loss"] / sums["samples"], "accuracy": sums["right"] / sums["samples"]}


def model_returning(loss_of):
    model = torch.nn.Module()
    logits = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))

    def forward(pixels, labels):
        return SimpleNamespace(logits=logits, loss=loss_of(logits, labels))

    model.forward = forward
    return model


BATCH = {"pixels": torch.zeros(4, 1), "labels": torch.tensor([0, 1, 2, 1])}


def check_contract(monkeypatch, model, eval_columns, eval_metrics, loss_items=None):
    """task.check_loss_contract with these as the fork's eval_columns, eval_metrics and loss_items
    (None: a classifier's, each micro-batch's mean weighs the same)."""
    monkeypatch.setattr(task, "eval_columns", eval_columns)
    monkeypatch.setattr(task, "eval_metrics", eval_metrics)
    monkeypatch.setattr(task, "loss_counter", lambda: loss_items)
    task.check_loss_contract(model, BATCH, RunConfig())


def test_loss_items_must_count_one_whole_number(monkeypatch):
    agreeing = model_returning(lambda logits, labels: F.cross_entropy(logits, labels))
    counted = lambda batch: torch.tensor(4)  # noqa: E731
    check_contract(monkeypatch, agreeing, classifier_columns, classifier_metrics, counted)
    weighed = lambda batch: torch.tensor(4.0)  # noqa: E731
    with pytest.raises(ConfigError, match=r"loss_items\(batch\) must return how many items"):
        check_contract(monkeypatch, agreeing, classifier_columns, classifier_metrics, weighed)


def test_a_classifier_whose_loss_is_its_evaluations_passes_and_one_that_differs_is_refused(
    monkeypatch,
):
    agreeing = model_returning(lambda logits, labels: F.cross_entropy(logits, labels))
    check_contract(monkeypatch, agreeing, classifier_columns, classifier_metrics)
    doubled = model_returning(lambda logits, labels: 2 * F.cross_entropy(logits, labels))
    with pytest.raises(ConfigError, match=r"^train/model.py: the model's .loss \(") as error:
        check_contract(monkeypatch, doubled, classifier_columns, classifier_metrics)
    assert "\n" not in str(error.value)
    # a task that reports no loss is not held to one; a model without .loss is
    check_contract(monkeypatch, doubled, classifier_columns, lambda sums, cfg: {"accuracy": 1.0})
    silent = model_returning(lambda logits, labels: None)
    with pytest.raises(ConfigError, match=r"must return an object whose .loss is the scalar"):
        check_contract(monkeypatch, silent, classifier_columns, classifier_metrics)


def test_columns_that_are_not_one_value_per_sample_are_refused_by_name(monkeypatch):
    model = model_returning(lambda logits, labels: F.cross_entropy(logits, labels))

    def per_token(output, batch):  # a causal LM's habit: (batch, positions), not (batch,)
        return {"loss": torch.zeros(4, 7)}

    with pytest.raises(
        ConfigError, match=r"eval_columns' 'loss' must be one value per sample, shape \(4,\)"
    ):
        check_contract(monkeypatch, model, per_token, classifier_metrics)


def test_an_error_inside_the_forks_evaluation_names_its_file_and_line(tmp_path, monkeypatch):
    # a fork's train/model.py whose eval_columns indexes a classifier's labels as a causal LM's
    fork_file = tmp_path / "train" / "model.py"
    fork_file.parent.mkdir()
    fork_file.write_text(
        "def eval_columns(output, batch):\n    return {'x': batch['labels'][:, 1:]}\n"
    )
    module = types.ModuleType("fork_model")
    exec(compile(fork_file.read_text(), str(fork_file), "exec"), module.__dict__)
    model = model_returning(lambda logits, labels: F.cross_entropy(logits, labels))
    with pytest.raises(ConfigError, match=r"^train/model.py:2: IndexError: too many indices"):
        check_contract(monkeypatch, model, module.eval_columns, classifier_metrics)


def test_a_fork_file_missing_a_name_is_one_line_naming_the_file_and_the_name(monkeypatch):
    fork_model = types.ModuleType("model")
    fork_model.build_model = lambda cfg: None
    fork_model.eval_metrics = lambda sums, cfg: {}
    monkeypatch.setitem(sys.modules, "model", fork_model)
    with pytest.raises(
        ConfigError, match=r"^train/model.py defines no eval_columns\(output, batch\)"
    ):
        task.check_fork_files(RunConfig())


def test_the_model_checks_its_own_keys_at_start_up(monkeypatch):
    """The shipped GPT's checks are model.py's check_config, run with the template's."""
    with pytest.raises(
        ConfigError, match=r"^n_embd must be divisible by n_head \(3\) \(got 100\)$"
    ):
        task.check_fork_files(RunConfig(n_embd=100, n_head=3))
    fork_model = types.ModuleType("model")
    fork_model.build_model = lambda cfg: None
    fork_model.eval_columns = lambda output, batch: {}
    fork_model.eval_metrics = lambda sums, cfg: {}
    monkeypatch.setitem(sys.modules, "model", fork_model)  # a fork without check_config: none run
    task.check_fork_files(RunConfig(n_embd=100, n_head=3))


def write_images(folder, seed):
    rng = np.random.default_rng(seed)
    for name in ("cat", "dog"):
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(3):
            pixels = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / name / f"{i}.png")


def test_an_image_folders_identity_is_its_files_content(tmp_path):
    import datasets

    folder = tmp_path / "images"
    write_images(folder, seed=0)

    def digest():
        table = datasets.load_dataset(
            "imagefolder", data_dir=str(folder), cache_dir=str(tmp_path / "c")
        )
        return content_digest(table["train"])

    before = digest()
    assert digest() == before
    # the same file names, other pixels: the Arrow table holds only the paths, the files changed
    write_images(folder, seed=1)
    assert digest() != before


def test_a_plain_torch_datasets_identity_is_its_samples():
    data = torch.arange(24.0).view(12, 2)
    same = content_digest(torch.utils.data.TensorDataset(data.clone()))
    assert content_digest(torch.utils.data.TensorDataset(data)) == same
    changed = data.clone()
    changed[7, 1] += 1
    assert content_digest(torch.utils.data.TensorDataset(changed)) != same


def test_sync_batchnorm_converts_every_batchnorm_and_refuses_a_model_without_one():
    from buffers import persistent_buffers, sync_batchnorm

    cnn = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    converted = sync_batchnorm(cnn)
    assert isinstance(converted[1], torch.nn.SyncBatchNorm)
    assert set(persistent_buffers(converted)) == {
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    }
    with pytest.raises(ConfigError, match=r"^sync_batchnorm is on and the model has no BatchNorm"):
        sync_batchnorm(torch.nn.Linear(2, 2))


def plumbing_of(num_processes, other_ranks_items=0):
    """A stand-in for the plumbing's reduce: this rank's sum plus what the other ranks hold."""
    return SimpleNamespace(
        device=torch.device("cpu"),
        num_processes=num_processes,
        reduce=lambda tensor, op: tensor + other_ranks_items if op == "sum" else None,
    )


def test_loss_weights_make_the_step_a_mean_over_every_counted_item(monkeypatch):
    """Worked by hand: this rank's micro-batches count 3 and 5 tokens, the other rank's 8 in all; the step's
    mean over 16 tokens weighs a micro-batch's mean by its tokens x 2 ranks x 2 micro-batches / 16 (the
    backward divides by 2 micro-batches, DDP by 2 ranks): 0.75 and 1.25. Equal counts: exactly 1.0 each."""
    monkeypatch.setattr(task, "loss_counter", lambda: lambda batch: batch["counted"])
    batches = [{"counted": torch.tensor(3)}, {"counted": torch.tensor(5)}]
    weights = loss_weights(batches, plumbing_of(2, other_ranks_items=8))
    assert weights.dtype == torch.float64 and weights.tolist() == [0.75, 1.25]
    equal = [{"counted": torch.tensor(4)}, {"counted": torch.tensor(4)}]
    assert loss_weights(equal, plumbing_of(2, other_ranks_items=8)).tolist() == [1.0, 1.0]
    one_rank = [{"counted": 1}, {"counted": 2}, {"counted": 3}]  # plain ints, one process
    assert loss_weights(one_rank, plumbing_of(1)).tolist() == [0.5, 1.0, 1.5]
    one_item = [{"counted": 1}, {"counted": 0}]  # one counted token in the whole step
    assert loss_weights(one_item, plumbing_of(1)).tolist() == [2.0, 0.0]
    nothing_counted = [{"counted": 0}, {"counted": 0}]  # every label masked: no division by 0
    assert loss_weights(nothing_counted, plumbing_of(1)).tolist() == [0.0, 0.0]
    monkeypatch.setattr(task, "loss_counter", lambda: None)  # a task without loss_items
    assert loss_weights(batches, plumbing_of(2, 8)).tolist() == [1.0, 1.0]


def test_the_fork_files_optional_names_are_used_where_defined(monkeypatch):
    """tokens_per_sample, identity and loss_items are optional: the fork's when it defines them, None
    when not; the required ones are passed straight through."""
    fork_model = types.ModuleType("model")
    fork_data = types.ModuleType("data")
    monkeypatch.setitem(sys.modules, "model", fork_model)
    monkeypatch.setitem(sys.modules, "data", fork_data)
    cfg = RunConfig(block_size=24)
    assert task.tokens_per_sample(cfg) is None
    assert task.data_identity("a dataset") is None
    assert task.loss_counter() is None
    fork_model.tokens_per_sample = lambda cfg: cfg.block_size * 2
    fork_data.identity = lambda dataset: f"digest of {dataset}"
    fork_model.loss_items = len
    assert task.tokens_per_sample(cfg) == 48
    assert task.data_identity("a dataset") == "digest of a dataset"
    assert task.loss_counter() is len
    fork_model.build_model = lambda cfg: ("model for", cfg.block_size)
    fork_data.build_datasets = lambda cfg: ("datasets for", cfg.block_size)
    fork_data.collate = lambda samples: ("batch of", samples)
    fork_data.packer = lambda cfg: ("packer for", cfg.block_size)
    assert task.build_model(cfg) == ("model for", 24)
    assert task.build_datasets(cfg) == ("datasets for", 24)
    assert task.collate([1, 2]) == ("batch of", [1, 2])
    assert task.packer(cfg) == ("packer for", 24)


def test_the_shipped_lm_counts_a_block_per_sample():
    assert task.tokens_per_sample(RunConfig(block_size=64)) == 64


def complete_fork(monkeypatch):
    fork_model = types.ModuleType("model")
    fork_model.build_model = lambda cfg: None
    fork_model.eval_columns = lambda output, batch: {}
    fork_model.eval_metrics = lambda sums, cfg: {}
    fork_data = types.ModuleType("data")
    fork_data.build_datasets = lambda cfg: None
    fork_data.collate = lambda samples: None
    monkeypatch.setitem(sys.modules, "model", fork_model)
    monkeypatch.setitem(sys.modules, "data", fork_data)
    return fork_model, fork_data


def test_streaming_needs_a_packer_and_an_old_signature_is_named(monkeypatch):
    fork_model, fork_data = complete_fork(monkeypatch)
    task.check_fork_files(RunConfig())  # complete for a map-style dataset
    with pytest.raises(ConfigError) as error:
        task.check_fork_files(RunConfig(streaming=True))
    assert str(error.value) == (
        "train/data.py defines no packer(cfg), which packs streamed documents (--streaming) "
        '(README "Make it yours"; examples/ has one for each task)'
    )
    fork_data.packer = lambda cfg: None
    task.check_fork_files(RunConfig(streaming=True))
    fork_model.eval_metrics = lambda sums: {}  # an older fork's signature
    with pytest.raises(ConfigError, match=r"^train/model.py defines no eval_metrics\(sums, cfg\)"):
        task.check_fork_files(RunConfig())
    fork_model.eval_metrics = "not a function"
    with pytest.raises(ConfigError, match=r"^train/model.py defines no eval_metrics\(sums, cfg\)"):
        task.check_fork_files(RunConfig())


def test_a_models_own_identity_joins_the_runs_under_model_names(monkeypatch):
    """model.py's optional identity(model): its entries as model/<name>, what a resume must find
    unchanged; a model.py without one adds nothing."""
    built = torch.nn.Linear(2, 2)
    fork_model = types.SimpleNamespace(
        identity=lambda model: {"reference": f"{model.in_features}x"}
    )
    monkeypatch.setattr(task, "fork_file", lambda name: fork_model)
    assert task.model_identity(built) == {"model/reference": "2x"}
    monkeypatch.setattr(task, "fork_file", lambda name: types.SimpleNamespace())
    assert task.model_identity(built) == {}


def test_dataset_not_given_is_the_data_files_default_or_none(monkeypatch):
    """--dataset "" becomes data.py's DEFAULT_DATASET where it has one (so config.yaml says what was
    read); a value given is kept; a data.py without one keeps "" (its own data, or none)."""
    from run_config import config_class

    cfg = config_class()()
    shipped_like = types.SimpleNamespace(DEFAULT_DATASET="python_stdlib")
    monkeypatch.setattr(task, "fork_file", lambda name: shipped_like)
    assert task.with_data_default(cfg).dataset == "python_stdlib"
    given = type(cfg)(dataset="corpus.jsonl")
    assert task.with_data_default(given).dataset == "corpus.jsonl"
    monkeypatch.setattr(task, "fork_file", lambda name: types.SimpleNamespace())
    assert task.with_data_default(cfg).dataset == ""


class Watch:
    """The hang watch's phase notes, recorded."""

    def __init__(self):
        self.phases = []

    def at(self, phase):
        self.phases.append(phase)


def test_a_rollout_makes_the_step_s_micro_batches_and_its_values_and_without_one_they_pass(
    monkeypatch,
):
    """model.py's optional rollout(model, micro_batches, cfg, step) gets exactly what the loop has
    (the prepared model, the fetched micro-batches, the config, the steps done) and what it returns
    is what the step trains on and logs; the hang watch names it. Without one: as fetched, no
    values, no phase."""
    model = torch.nn.Linear(2, 2)
    fetched = [{"ids": torch.tensor([1])}, {"ids": torch.tensor([2])}]
    cfg = RunConfig()
    seen = {}

    def rollout(model, micro_batches, cfg, step):
        seen.update(model=model, micro_batches=micro_batches, cfg=cfg, step=step)
        return [{"ids": batch["ids"] * 10} for batch in micro_batches], {"reward": 0.5}

    watch = Watch()
    files = {"model": types.SimpleNamespace(rollout=rollout), "data": types.SimpleNamespace()}
    monkeypatch.setattr(task, "fork_file", files.__getitem__)
    made, values = task.rollout(model, fetched, cfg, 7, watch)
    assert seen == {"model": model, "micro_batches": fetched, "cfg": cfg, "step": 7}
    assert [batch["ids"].item() for batch in made] == [10, 20] and values == {"reward": 0.5}
    assert watch.phases == ["rollout (model.py)"]
    watch = Watch()
    monkeypatch.setattr(task, "fork_file", lambda name: types.SimpleNamespace())
    assert task.rollout(model, fetched, cfg, 7, watch) == (fetched, {})
    assert watch.phases == []


def test_a_rollout_that_takes_other_arguments_is_one_line_at_start_up(monkeypatch):
    def rollout(model, batches, cfg):  # the step left out, micro_batches misnamed
        return batches, {}

    with pytest.raises(ConfigError) as refused:
        task.check_rollout(types.SimpleNamespace(rollout=rollout))
    assert str(refused.value) == (
        "train/model.py: rollout must take (model, micro_batches, cfg, step) and return "
        '(micro_batches, {name: value}) (README "Make it yours"; examples/rl has one)'
    )

    def right(model, micro_batches, cfg, step):
        return micro_batches, {}

    task.check_rollout(types.SimpleNamespace(rollout=right))
    task.check_rollout(types.SimpleNamespace())  # none: nothing to check
    # and check_fork_files runs it on model.py
    fork_model = types.SimpleNamespace(**vars(sys.modules["model"]), rollout=rollout)
    monkeypatch.setitem(sys.modules, "model", fork_model)
    with pytest.raises(ConfigError, match=r"rollout must take"):
        task.check_fork_files(RunConfig())


# ---------------------------------------------------------------- generate_columns


def generating_fork(monkeypatch, generate_columns, eval_columns=None):
    """A fork's model.py with this generate_columns (and eval_columns, or none), the classifier's
    metrics: sys.modules' `model`, as task.fork_file imports it."""
    fork_model = types.ModuleType("model")
    fork_model.build_model = lambda cfg: None
    fork_model.eval_metrics = lambda sums, cfg: dict(sums)
    fork_model.generate_columns = generate_columns
    if eval_columns is not None:
        fork_model.eval_columns = eval_columns
        fork_model.eval_metrics = classifier_metrics
    monkeypatch.setitem(sys.modules, "model", fork_model)
    return fork_model


class Wrapped(torch.nn.Module):
    """A model in a wrapper, as DDP holds it (.module)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, **batch):
        return self.module(**batch)


def test_generate_columns_join_the_forward_s_columns_on_the_model_itself(monkeypatch):
    """Each eval batch: eval_columns of the forward's output and generate_columns of the model
    itself (DDP's wrapper taken off), one dict of columns; the start-up check sums them."""
    model = model_returning(lambda logits, labels: F.cross_entropy(logits, labels))
    seen = []

    def generate_columns(model_given, batch, cfg):
        seen.append((model_given, batch, cfg))
        return {"said_right": torch.tensor([1.0, 0.0, 1.0, 1.0])}

    generating_fork(monkeypatch, generate_columns, classifier_columns)
    cfg = RunConfig()
    columns = task.batch_columns(Wrapped(model), BATCH, cfg)
    assert sorted(columns) == ["loss", "right", "said_right", "samples"]
    # the model itself (not the wrapper), the eval batch and the run's config, as given
    assert len(seen) == 1 and seen[0][0] is model and seen[0][1] is BATCH and seen[0][2] is cfg
    assert columns["said_right"].tolist() == [1.0, 0.0, 1.0, 1.0]
    task.check_loss_contract(Wrapped(model), BATCH, RunConfig())  # a loss that agrees: passes


def test_the_fork_s_generate_columns_gets_the_model_itself_from_under_compile_and_ddp(monkeypatch):
    """torch.compile's wrapper (._orig_mod) is taken off as DDP's is (.module), in either order:
    the fork's generate_columns gets the very module model.py built (its .rl, its generate)."""
    model = torch.nn.Linear(1, 1)
    seen = []

    def generate_columns(model_given, batch, cfg):
        seen.append(model_given)
        return {"said": torch.ones(4)}

    generating_fork(monkeypatch, generate_columns, classifier_columns)
    compiled = torch.compile(model)  # lazy: nothing is compiled until it runs
    for wrapper in (compiled, Wrapped(compiled), torch.compile(Wrapped(model))):
        task.generate_columns(wrapper, BATCH, RunConfig())
    assert len(seen) == 3 and all(given is model for given in seen)


def test_an_eval_that_only_generates_needs_no_eval_columns_and_no_forward(monkeypatch):
    """RL's eval: generate_columns alone; check_fork_files asks for no eval_columns, and neither the
    start-up check nor an evaluation runs the forward on its batches."""

    def forward_never(**batch):
        raise AssertionError("the forward ran on an eval batch")

    model = torch.nn.Module()
    model.forward = forward_never
    generating_fork(monkeypatch, lambda model, batch, cfg: {"prompts": torch.ones(4)})
    task.check_fork_files(RunConfig())
    task.check_loss_contract(model, BATCH, RunConfig())
    assert list(task.batch_columns(model, BATCH, RunConfig())) == ["prompts"]


def test_a_task_that_only_generates_still_has_its_loss_items_checked_at_start_up(monkeypatch):
    """No forward on its eval batches, but its training batches' loss_items still weigh each step:
    a count that is no whole number is the same line as any task's, at start-up."""
    model = torch.nn.Module()
    fork_model = generating_fork(monkeypatch, lambda model, batch, cfg: {"prompts": torch.ones(4)})
    fork_model.loss_items = lambda batch: 2.5
    with pytest.raises(ConfigError) as refused:
        task.check_loss_contract(model, BATCH, RunConfig())
    assert str(refused.value) == (
        "train/model.py: loss_items(batch) must return how many items .loss averages over, one "
        "whole number (got a torch.float32 tensor of shape ())"
    )


@pytest.mark.parametrize(
    "columns, line",
    [
        (
            {"said": torch.ones(3)},
            "train/model.py: generate_columns' 'said' must be one value per sample, shape (4,), "
            "to be summed over exactly the eval set (got (3,))",
        ),
        (
            [torch.ones(4)],
            "train/model.py: generate_columns must return a dict {name: tensor of shape (batch,)} "
            "(got list)",
        ),
        (
            {"right": torch.ones(4)},
            "train/model.py: eval_columns and generate_columns both give 'right': name each "
            "column once (they are summed into one eval set's sums)",
        ),
    ],
)
def test_generate_columns_that_break_the_contract_are_one_line_at_start_up(
    monkeypatch, columns, line
):
    model = model_returning(lambda logits, labels: F.cross_entropy(logits, labels))
    generating_fork(monkeypatch, lambda model, batch, cfg: columns, classifier_columns)
    with pytest.raises(ConfigError) as e:
        task.check_loss_contract(model, BATCH, RunConfig())
    assert str(e.value) == line


def test_generate_columns_that_take_other_arguments_is_one_line_at_start_up(monkeypatch):
    generating_fork(monkeypatch, lambda model, batch: {})
    with pytest.raises(ConfigError) as e:
        task.check_fork_files(RunConfig())
    assert str(e.value) == (
        "train/model.py: generate_columns must take (model, batch, cfg) and return "
        '{name: tensor of shape (batch,)} (README "Make it yours"; examples/rl has one)'
    )


# ---------------------------------------------------------------- the start-up checks' whole lines


def test_the_fork_s_settings_are_the_dataclasses_its_files_define(monkeypatch):
    class ModelConfig:
        pass

    class DataConfig:
        pass

    files = {
        "model": types.SimpleNamespace(ModelConfig=ModelConfig),
        "data": types.SimpleNamespace(Other=DataConfig),
    }
    monkeypatch.setattr(task, "fork_file", files.__getitem__)
    assert task.fork_settings() == {"model": ModelConfig}
    files["data"] = types.SimpleNamespace(DataConfig=DataConfig)
    assert task.fork_settings() == {"model": ModelConfig, "data": DataConfig}
    files["model"] = types.SimpleNamespace()
    assert task.fork_settings() == {"data": DataConfig}


def test_loss_items_that_fail_or_do_not_count_are_whole_lines(monkeypatch):
    def failing(batch):
        return batch["counted"]

    monkeypatch.setattr(task, "loss_counter", lambda: failing)
    with pytest.raises(ConfigError) as refused:
        task.check_loss_items({"labels": torch.zeros(2)})
    # this test's file is no fork file: the line names model.py, where loss_items lives
    assert str(refused.value) == (
        "train/model.py: loss_items(batch) failed on an eval batch: KeyError: 'counted'"
    )
    for returned, said in (
        (torch.tensor([3, 4]), "a torch.int64 tensor of shape (2,)"),
        (2.5, "a torch.float32 tensor of shape ()"),
        (torch.tensor(1 + 2j), "a torch.complex64 tensor of shape ()"),
    ):
        monkeypatch.setattr(task, "loss_counter", lambda returned=returned: lambda batch: returned)
        with pytest.raises(ConfigError) as refused:
            task.check_loss_items({})
        assert str(refused.value) == (
            "train/model.py: loss_items(batch) must return how many items .loss averages over, one "
            f"whole number (got {said})"
        )
    monkeypatch.setattr(task, "loss_counter", lambda: lambda batch: 7)
    task.check_loss_items({})


def test_columns_that_are_no_dict_or_not_one_value_per_sample_are_whole_lines():
    for columns, got in (([1.0], "list"), ({}, "dict"), (None, "NoneType")):
        with pytest.raises(ConfigError) as refused:
            task.check_columns(columns, 4, "eval_columns")
        assert str(refused.value) == (
            "train/model.py: eval_columns must return a dict {name: tensor of shape (batch,)} "
            f"(got {got})"
        )
    for values, got in (
        (torch.zeros(4, 7), "(4, 7)"),
        ([0.0] * 4, "list"),
        (torch.zeros(3), "(3,)"),
    ):
        with pytest.raises(ConfigError) as refused:
            task.check_columns({"right": torch.zeros(4), "loss": values}, 4, "generate_columns")
        assert str(refused.value) == (
            "train/model.py: generate_columns' 'loss' must be one value per sample, shape (4,), to "
            f"be summed over exactly the eval set (got {got})"
        )
    task.check_columns({"loss": torch.zeros(4)}, 4, "eval_columns")


def test_the_fork_s_line_closest_to_a_failure_is_named_and_only_train_s_files_count(tmp_path):
    def raised_in(path, source) -> BaseException:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
        namespace = {}
        exec(compile(source, str(path), "exec"), namespace)
        try:
            namespace["f"]()
        except Exception as e:  # noqa: BLE001
            return e

    fork = raised_in(tmp_path / "train" / "data.py", "def f():\n    x = 1\n    return {}['a']\n")
    assert task.where_in_fork_files(fork) == "train/data.py:3"
    elsewhere = raised_in(tmp_path / "lib" / "model.py", "def f():\n    return {}['a']\n")
    assert task.where_in_fork_files(elsewhere) == "train/model.py"
    not_a_fork_file = raised_in(tmp_path / "train" / "other.py", "def f():\n    return {}['a']\n")
    assert task.where_in_fork_files(not_a_fork_file) == "train/model.py"
