"""What the template asks of the fork's two files, and the checks that hold them to it at start-up.

The task (a causal LM, an image classifier, a text classifier, ...) is whatever model.py and data.py
declare; the loop, the evaluation, the checkpoints and the logs only use these names (README "Make it
yours"):

    model.py  build_model(cfg) -> nn.Module   forward(**batch) returns an object with .loss: what
                                              training minimises, a scalar (the mean over the batch)
              eval_columns(output, batch)     {name: tensor of shape (batch,)}: per-sample values the
                                              template sums over exactly the eval set (the copies that
                                              pad the last batches dropped, every rank the same sums)
              eval_metrics(sums)              {name: float} from those sums, logged as eval_<name>:
                                              e.g. accuracy = correct / samples, F1 from counts
              tokens_per_sample(cfg)          optional: a sample's tokens, for tokens/s, tokens_seen
                                              and MFU (without it: samples/s and samples_seen only)
              check_config(cfg)               optional: the model's own checks of its config keys,
                                              at start-up (raise errors.ConfigError naming the key)
    data.py   build_datasets(cfg)             (train, eval): map-style datasets of samples
              collate(samples) -> dict        the model's keyword arguments
              packer(cfg)                     only with --streaming (streaming.py packs documents)
              identity(dataset) -> str        optional: what a resume must find unchanged, for data the
                                              template cannot digest itself (batches.data_identity)

lm.py holds the causal LM's answers (the shipped files import them); examples/ holds other tasks'.
"""

from __future__ import annotations

import importlib
import math
import traceback
from pathlib import Path

import torch

from errors import ConfigError, first_line

REQUIRED = {
    "model": {
        "build_model": "build_model(cfg), the model to train",
        "eval_columns": "eval_columns(output, batch), the per-sample evaluation columns",
        "eval_metrics": "eval_metrics(sums), the reported eval metrics from the columns' sums",
    },
    "data": {
        "build_datasets": "build_datasets(cfg), the (train, eval) datasets",
        "collate": "collate(samples), a batch of the model's keyword arguments",
    },
}
FORK_FILES = {"model.py", "data.py"}


def check_fork_files(cfg) -> None:
    """Every name the template uses is defined in model.py and data.py: a fork that missed one is
    told which, in one line, before anything starts. Then the model's own checks of the config."""
    required = {module: dict(names) for module, names in REQUIRED.items()}
    if cfg.streaming:
        required["data"]["packer"] = "packer(cfg), which packs streamed documents (--streaming)"
    for module_name, names in required.items():
        module = importlib.import_module(module_name)
        for name, what in names.items():
            if not callable(getattr(module, name, None)):
                raise ConfigError(
                    f'train/{module_name}.py defines no {what} (README "Make it yours"; '
                    f"examples/ has one for each task)"
                )
    model_checks = getattr(importlib.import_module("model"), "check_config", None)
    if model_checks is not None:
        model_checks(cfg)


def tokens_per_sample(cfg) -> int | None:
    """model.py's `tokens_per_sample(cfg)`, or None where the task counts no tokens (images)."""
    count = getattr(importlib.import_module("model"), "tokens_per_sample", None)
    if count is None:
        return None
    return count(cfg)


@torch.no_grad()
def check_loss_contract(model, batch: dict, eval_columns, eval_metrics) -> None:
    """On one eval batch: the model returns a .loss, eval_columns gives one value per sample, and
    where the task reports a loss, it is the .loss the model trains on. Anything else is one line
    that names the fork's file and line, not a traceback from inside the template."""
    model.eval()
    try:
        output = model(**batch)
        columns = eval_columns(output, batch)
        samples = len(next(iter(batch.values())))
        check_columns(columns, samples)
        metrics = eval_metrics(
            {name: values.double().sum().item() for name, values in columns.items()}
        )
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
