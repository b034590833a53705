"""The task seam: the one place the template reaches the fork's two files, model.py and data.py.

The task (a causal LM, an image classifier, a text classifier, ...) is whatever model.py and data.py
declare; the loop, the evaluation, the checkpoints and the logs reach them only through the functions
below, by these names (README "Make it yours"):

    model.py  build_model(cfg) -> nn.Module   forward(**batch) returns an object with .loss: what
                                              training minimises, a scalar (the mean over the batch)
              eval_columns(output, batch)     {name: tensor of shape (batch,)}: per-sample values the
                                              template sums over exactly the eval set (the copies that
                                              pad the last batches dropped, every rank the same sums)
              eval_metrics(sums, cfg)         {name: float} from those sums, logged as eval_<name>:
                                              e.g. accuracy = correct / samples, F1 from counts
              tokens_per_sample(cfg)          optional: a sample's tokens, for tokens/s, tokens_seen
                                              and MFU (without it: samples/s and samples_seen only)
              check_config(cfg)               optional: the model's own checks of its config keys,
                                              at start-up (raise errors.ConfigError naming the key)
              ModelConfig                     optional: a dataclass of the model's own keys (config.py
                                              adds them to the template's: YAML, --flags, --help)
    data.py   build_datasets(cfg)             (train, eval): map-style datasets of samples
              collate(samples) -> dict        the model's keyword arguments
              packer(cfg)                     only with --streaming (streaming.py packs documents)
              identity(dataset) -> str        optional: what a resume must find unchanged, for data the
                                              template cannot digest itself (batches.data_identity)
              DataConfig                      optional: a dataclass of the data's own keys

lm.py holds the causal LM's answers (the shipped files call them); examples/ holds other tasks'.
Below them, the checks that hold the two files to this at start-up, in one line each.
"""

from __future__ import annotations

import importlib
import inspect
import math
import traceback
from pathlib import Path

import torch

from blocks import checkpoint_activations
from buffers import shared_buffers, sync_batchnorm
from errors import ConfigError, first_line

REQUIRED = {  # name: (its arguments, what it gives)
    "model": {
        "build_model": (("cfg",), "the model to train"),
        "eval_columns": (("output", "batch"), "the per-sample evaluation columns"),
        "eval_metrics": (("sums", "cfg"), "the reported eval metrics from the columns' sums"),
    },
    "data": {
        "build_datasets": (("cfg",), "the (train, eval) datasets"),
        "collate": (("samples",), "a batch of the model's keyword arguments"),
    },
}
FORK_FILES = {"model.py", "data.py"}
# the dataclasses of the fork's own config keys, by file
SETTINGS = {"model": "ModelConfig", "data": "DataConfig"}


def fork_file(name: str):
    """model.py or data.py, imported where it is first used (a fork's file may be missing a name
    that check_fork_files reports in one line)."""
    return importlib.import_module(name)


# ---------------------------------------------------------------- what the template calls


def build_model(cfg):
    return fork_file("model").build_model(cfg)


def build_datasets(cfg):
    return fork_file("data").build_datasets(cfg)


def collate(samples: list) -> dict:
    return fork_file("data").collate(samples)


def eval_columns(output, batch: dict) -> dict:
    return fork_file("model").eval_columns(output, batch)


def eval_metrics(sums: dict, cfg) -> dict:
    return fork_file("model").eval_metrics(sums, cfg)


def packer(cfg):
    return fork_file("data").packer(cfg)


def tokens_per_sample(cfg) -> int | None:
    """model.py's `tokens_per_sample(cfg)`, or None where the task counts no tokens (images)."""
    count = getattr(fork_file("model"), "tokens_per_sample", None)
    if count is None:
        return None
    return count(cfg)


def data_identity(dataset) -> str | None:
    """data.py's `identity(dataset)`, or None: the template digests the dataset itself."""
    identity = getattr(fork_file("data"), "identity", None)
    if identity is None:
        return None
    return identity(dataset)


def fork_settings() -> dict[str, type]:
    """The dataclasses of the fork's own config keys, by the file that declares them ({"model":
    ModelConfig, "data": DataConfig}, those it defines)."""
    found = {}
    for module_name, class_name in SETTINGS.items():
        settings = getattr(fork_file(module_name), class_name, None)
        if settings is not None:
            found[module_name] = settings
    return found


def training_model(cfg):
    """model.py's model, with the template's options applied: BatchNorm over every rank's samples
    (--sync_batchnorm; GPUs: checks.py), each block recomputed in backward
    (--activation_checkpointing)."""
    model = build_model(cfg)
    if cfg.sync_batchnorm:
        model = sync_batchnorm(model)
    if cfg.activation_checkpointing:
        checkpoint_activations(model)
    return model


@torch.no_grad()
def evaluate(model, eval_loaders: dict, plumbing, cfg) -> dict:
    """model.py's eval metrics over exactly the eval set, as eval_<metric>, computed on every rank. A
    mixture's: over all its sources' eval sets together, and each source's as eval_<metric>/<name>."""
    model.eval()
    sums = {}  # (source, column): the column's sum over the source's eval set
    # every rank evaluates with the buffers the export holds (BatchNorm's statistics; buffers.py)
    with shared_buffers(model, plumbing.num_processes):
        for source, eval_loader in eval_loaders.items():
            for batch in eval_loader:
                columns = eval_columns(model(**batch), batch)  # model.py's: per sample
                # the sampler pads the last batches so every rank has as many; gather_for_metrics
                # drops the copies
                for name, values in plumbing.gather_for_metrics(columns).items():
                    sums[source, name] = sums.get((source, name), 0.0) + values.sum()
    model.train()
    # one device-to-host copy
    totals = dict(zip(sums, torch.stack(list(sums.values())).tolist(), strict=True))
    names = dict.fromkeys(name for _, name in totals)
    overall = {name: sum(v for (_, n), v in totals.items() if n == name) for name in names}
    metrics = {f"eval_{key}": value for key, value in eval_metrics(overall, cfg).items()}
    for source in eval_loaders:
        if source:  # a mixture's source
            own = {name: value for (s, name), value in totals.items() if s == source}
            metrics.update({f"eval_{k}/{source}": v for k, v in eval_metrics(own, cfg).items()})
    return metrics


# ---------------------------------------------------------------- the checks at start-up


def check_fork_files(cfg) -> None:
    """Every name the template uses is defined in model.py and data.py: a fork that missed one is
    told which, in one line, before anything starts. Then the model's own checks of the config."""
    required = {module: dict(names) for module, names in REQUIRED.items()}
    if cfg.streaming:
        required["data"]["packer"] = (("cfg",), "which packs streamed documents (--streaming)")
    for module_name, names in required.items():
        module = fork_file(module_name)
        for name, (arguments, what) in names.items():
            function = getattr(module, name, None)
            if not callable(function) or not takes(function, arguments):
                raise ConfigError(
                    f"train/{module_name}.py defines no {name}({', '.join(arguments)}), {what} "
                    f'(README "Make it yours"; examples/ has one for each task)'
                )
    model_checks = getattr(fork_file("model"), "check_config", None)
    if model_checks is not None:
        model_checks(cfg)


def takes(function, arguments: tuple) -> bool:
    """Whether `function` can be called with these arguments: an older fork's eval_metrics(sums)
    is said at start-up, not a TypeError at the first evaluation."""
    try:
        inspect.signature(function).bind(*arguments)
    except (TypeError, ValueError):
        return False
    return True


@torch.no_grad()
def check_loss_contract(model, batch: dict, cfg) -> None:
    """On one eval batch: the model returns a .loss, eval_columns gives one value per sample, and
    where the task reports a loss, it is the .loss the model trains on. Anything else is one line
    that names the fork's file and line, not a traceback from inside the template."""
    model.eval()
    try:
        output = model(**batch)
        columns = eval_columns(output, batch)
        samples = len(next(iter(batch.values())))
        check_columns(columns, samples)
        sums = {name: values.double().sum().item() for name, values in columns.items()}
        metrics = eval_metrics(sums, cfg)
    except ConfigError:
        raise
    except Exception as e:  # the fork's code failed on its own eval batch
        raise ConfigError(
            f"{where_in_fork_files(e)}: {type(e).__name__}: {first_line(e)} (on an eval batch, at start-up)"
        ) from None
    finally:
        model.train()
    loss = getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError(
            "train/model.py: the model's forward(**batch) must return an object whose .loss is the scalar "
            f"loss training minimises (got .loss = {type(loss).__name__})"
        )
    reported = metrics.get("loss")
    if reported is None or math.isclose(loss.item(), reported, rel_tol=1e-3, abs_tol=1e-4):
        return
    raise ConfigError(
        f"train/model.py: the model's .loss ({loss.item():.4f}) is not the loss its eval_columns and "
        f"eval_metrics report ({reported:.4f}) on the same eval batch: training would minimise one "
        f"number and evaluation report another (a causal LM: shift the labels by one, as "
        f"lm.causal_lm_loss does)"
    )


def check_columns(columns, samples: int) -> None:
    if not isinstance(columns, dict) or not columns:
        raise ConfigError(
            "train/model.py: eval_columns must return a dict {name: tensor of shape (batch,)} "
            f"(got {type(columns).__name__})"
        )
    for name, values in columns.items():
        if not isinstance(values, torch.Tensor) or tuple(values.shape) != (samples,):
            shape = (
                tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            )
            raise ConfigError(
                f"train/model.py: eval_columns' '{name}' must be one value per sample, shape "
                f"({samples},), to be summed over exactly the eval set (got {shape})"
            )


def where_in_fork_files(error: BaseException) -> str:
    """The fork's line closest to the failure ('train/model.py:42'), or 'train/model.py' if none
    of its frames is in the trace."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        path = Path(frame.filename)
        if path.name in FORK_FILES and path.parent.name == "train":
            return f"train/{path.name}:{frame.lineno}"
    return "train/model.py"
