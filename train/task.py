"""The task seam: the one place the template reaches the fork's two files, model.py and data.py.

The task (a causal LM, an image classifier, a text classifier, ...) is whatever model.py and data.py
declare; the loop, the evaluation, the checkpoints and the logs reach them only through the functions
below, by these names (README "Make it yours"):

    model.py  build_model(cfg) -> nn.Module   forward(**batch) returns an object with .loss: what
                                              training minimises, a scalar (the mean over the batch)
              loss_items(batch)               optional: how many items .loss averages over in this
                                              batch (an LM: its counted tokens), so each step's loss
                                              is the mean over all its items (loss_weights, below);
                                              without it every micro-batch's mean weighs the same
              eval_columns(output, batch)     {name: tensor of shape (batch,)}: per-sample values the
                                              template sums over exactly the eval set (the copies that
                                              pad the last batches dropped, every rank the same sums)
              generate_columns(model, batch,  optional: more such columns from what the model
                               cfg)           generates (free-running, not teacher-forced): an
                                              answer's exact match, a reward, BLEU's counts. `model`
                                              is the model itself (DDP's wrapper taken off; FSDP2's
                                              shards stay: generate with synced_gpus). Every rank
                                              calls it on as many batches. A task whose eval only
                                              generates (RL) may leave eval_columns out: its eval
                                              batches then see no forward
              eval_metrics(sums, cfg)         {name: float} from those sums, logged as eval_<name>:
                                              e.g. accuracy = correct / samples, F1 from counts
              tokens_per_sample(cfg)          optional: a sample's tokens, for tokens/s, tokens_seen
                                              and MFU (without it: samples/s and samples_seen only)
              check_config(cfg)               optional: the model's own checks of its config keys,
                                              at start-up (raise errors.ConfigError naming the key)
              identity(model) -> dict         optional: what a resume must find unchanged of the
                                              model built (e.g. a reference's weight digest)
              ModelConfig                     optional: a dataclass of the model's own keys (config.py
                                              adds them to the template's: YAML, --flags, --help)
              CHAT_MODEL = True               optional: scripts/sample.py talks to it with --chat
                                              (the prompt a user's turn); the summary says so
              rollout(model, micro_batches,   optional: the step's micro-batches made into what it
                      cfg, step)              trains on, each step before loss_items counts them:
                                              RL generates from the current policy (`model`: the
                                              model itself, as generate_columns gets it) and
                                              rewards it (examples/rl). Returns
                                              (micro_batches, {name: float}): the values are the
                                              step's own, logged on its line (the same on every
                                              rank). Every rank calls it at every step, so it may
                                              run collectives
    data.py   build_datasets(cfg)             (train, eval): map-style datasets of samples
              collate(samples) -> dict        the model's keyword arguments
              packer(cfg)                     only with --streaming (streaming.py packs documents)
              identity(dataset) -> str        optional: what a resume must find unchanged, for data the
                                              template cannot digest itself (batches.data_identity)
              DataConfig                      optional: a dataclass of the data's own keys
              check_config(cfg)               optional: the data's own checks of its keys
              DEFAULT_DATASET                 optional: --dataset when not given (else "")

lm.py holds the causal LM's answers (the shipped files call them); examples/ holds other tasks'.
Below them, the checks that hold the two files to this at start-up, in one line each.
"""

from __future__ import annotations

import importlib
import inspect
import math
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from adapters import add_lora, check_targets_under_fsdp, target_names
from blocks import checkpoint_activations
from buffers import sync_batchnorm
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


def generate_columns(model, batch: dict, cfg) -> dict:
    """model.py's optional `generate_columns(model, batch, cfg)` on the model itself (unwrapped):
    per-sample columns of what it generates; {} without one."""
    generated = getattr(fork_file("model"), "generate_columns", None)
    if generated is None:
        return {}
    return generated(unwrapped(model), batch, cfg)


def teacher_forced() -> bool:
    """Whether model.py's eval runs the forward on each eval batch (it has eval_columns): a task
    whose eval only generates (RL's prompts) has no loss to compute on them."""
    return callable(getattr(fork_file("model"), "eval_columns", None))


def batch_columns(model, batch: dict, cfg) -> dict:
    """One eval batch's per-sample columns: eval_columns of the forward's output, and
    generate_columns' of what the model generates (either may be absent, not both)."""
    columns = eval_columns(model(**batch), batch) if teacher_forced() else {}
    return {**columns, **generate_columns(model, batch, cfg)}


def unwrapped(model):
    """The model itself, as model.py built it: DDP's wrapper and torch.compile's taken off (FSDP2
    shards the model in place: it stays sharded, and generate must keep every rank's forwards in
    step, synced_gpus)."""
    while True:
        inner = getattr(model, "module", None)
        if inner is None:  # not `or`: a compiled module's truth is its len(), which raises
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def eval_metrics(sums: dict, cfg) -> dict:
    return fork_file("model").eval_metrics(sums, cfg)


def packer(cfg):
    return fork_file("data").packer(cfg)


def loss_counter():
    """model.py's `loss_items(batch)`, or None: the task does not say what its loss averages over."""
    return getattr(fork_file("model"), "loss_items", None)


def rollout(model, micro_batches: list, cfg, step: int, watch) -> tuple[list, dict]:
    """model.py's optional `rollout(model, micro_batches, cfg, step)`: the micro-batches the step
    trains on, and values of the step's own for its log line; without one, the micro-batches as
    fetched and no values. It gets the model itself (DDP's wrapper off: generate is the
    module's). `step`: the optimizer steps done (a resume knows it: RL seeds its sampling with
    it). A hang in it is named as the rollout's (hangs.py)."""
    fork_rollout = getattr(fork_file("model"), "rollout", None)
    if fork_rollout is None:
        return micro_batches, {}
    watch.at("rollout (model.py)")
    return fork_rollout(unwrapped(model), micro_batches, cfg, step)


def tokens_per_sample(cfg) -> int | None:
    """model.py's `tokens_per_sample(cfg)`, or None where the task counts no tokens (images)."""
    count = getattr(fork_file("model"), "tokens_per_sample", None)
    if count is None:
        return None
    return count(cfg)


def sample_flags(cfg) -> str | None:
    """scripts/sample.py's flags for this task's export, as the run's summary prints them: a chat
    model's (model.py's CHAT_MODEL) with --chat, a causal LM's (it counts tokens) without, and None
    where the model writes no text (images)."""
    if getattr(fork_file("model"), "CHAT_MODEL", False):
        return '--chat --prompt "..."'
    return '--prompt "..."' if tokens_per_sample(cfg) is not None else None


def model_identity(model) -> dict:
    """model.py's optional `identity(model) -> {name: value}`: what a resume must find unchanged of the
    model as built (a preference run's reference weights), kept in each checkpoint's manifest beside
    the data's identity, as model/<name>; {} without it."""
    identity = getattr(fork_file("model"), "identity", None)
    if identity is None:
        return {}
    return {f"model/{name}": value for name, value in identity(model).items()}


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
    """model.py's model, with the template's options applied: LoRA adapters (--lora_r), BatchNorm
    over every rank's samples (--sync_batchnorm; GPUs: checks.py), each block recomputed in backward
    (--activation_checkpointing)."""
    model = build_model(cfg)
    if cfg.lora_r:  # the model frozen, LoRA adapters on its target layers train (adapters.py)
        model = add_lora(model, cfg)
    if cfg.sync_batchnorm:
        model = sync_batchnorm(model)
    if cfg.activation_checkpointing:
        checkpoint_activations(model)
    return model


# ---------------------------------------------------------------- the checks at start-up


def check_fork_files(cfg) -> None:
    """Every name the template uses is defined in model.py and data.py: a fork that missed one is
    told which, in one line, before anything starts. Then the model's own checks of the config."""
    required = {module: dict(names) for module, names in REQUIRED.items()}
    if cfg.streaming:
        required["data"]["packer"] = (("cfg",), "which packs streamed documents (--streaming)")
    generates = getattr(fork_file("model"), "generate_columns", None)
    if generates is not None:
        if not takes(generates, ("model", "batch", "cfg")):
            raise ConfigError(
                "train/model.py: generate_columns must take (model, batch, cfg) and return "
                '{name: tensor of shape (batch,)} (README "Make it yours"; examples/rl has one)'
            )
        # an eval that only generates (RL's) needs no eval_columns
        del required["model"]["eval_columns"]
    for module_name, names in required.items():
        module = fork_file(module_name)
        for name, (arguments, what) in names.items():
            function = getattr(module, name, None)
            if not callable(function) or not takes(function, arguments):
                raise ConfigError(
                    f"train/{module_name}.py defines no {name}({', '.join(arguments)}), {what} "
                    f'(README "Make it yours"; examples/ has one for each task)'
                )
    check_rollout(fork_file("model"))
    for module_name in ("model", "data"):  # each file's own checks of its own keys
        own_checks = getattr(fork_file(module_name), "check_config", None)
        if own_checks is not None:
            own_checks(cfg)
    if cfg.lora_r:
        check_adapters(cfg)


def check_rollout(module) -> None:
    """model.py's optional rollout takes what the loop gives it: one line at start-up, not a
    TypeError at the first step."""
    rollout = getattr(module, "rollout", None)
    if rollout is not None and not takes(rollout, ("model", "micro_batches", "cfg", "step")):
        raise ConfigError(
            "train/model.py: rollout must take (model, micro_batches, cfg, step) and return "
            '(micro_batches, {name: value}) (README "Make it yours"; examples/rl has one)'
        )


def with_data_default(cfg):
    """The config with data.py's DEFAULT_DATASET where --dataset was not given (the shipped LM's:
    python_stdlib); a fork's data.py without one keeps "" (its own data, or none)."""
    default = getattr(fork_file("data"), "DEFAULT_DATASET", "")
    if cfg.dataset or not default:
        return cfg
    return replace(cfg, dataset=default)


def check_adapters(cfg) -> None:
    """--lora_r: peft is installed, --lora_targets names linear layers of the model, and under FSDP
    they lie in the blocks it shards. On the model built without memory (the meta device; a hub
    model from its config alone), before any process group."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ConfigError(
            "lora_r: LoRA adapters need peft: pip install -r requirements.txt (peft is listed there)"
        ) from None
    with torch.device("meta"):
        model = build_model(replace(cfg, model_weights="config"))
    targets = target_names(model, cfg)
    if cfg.fsdp != "no":
        check_targets_under_fsdp(model, targets)


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
    """On one eval batch: the model returns a .loss, eval_columns (and generate_columns) give one
    value per sample, and where the task reports a loss, it is the .loss the model trains on. Anything else is one line
    that names the fork's file and line, not a traceback from inside the template."""
    model.eval()
    forward = teacher_forced()
    try:
        samples = len(next(iter(batch.values())))
        columns = {}
        if forward:
            output = model(**batch)
            columns = eval_columns(output, batch)
            check_columns(columns, samples, "eval_columns")
        generated = generate_columns(model, batch, cfg)
        if generated or not forward:
            check_columns(generated, samples, "generate_columns")
        both = sorted(set(columns) & set(generated))
        if both:
            raise ConfigError(
                f"train/model.py: eval_columns and generate_columns both give '{both[0]}': "
                "name each column once (they are summed into one eval set's sums)"
            )
        columns.update(generated)
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
    check_loss_items(batch)
    if not forward:  # no forward on eval batches: the training batches' .loss is the step's
        return
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


def check_loss_items(batch: dict) -> None:
    """model.py's loss_items, where it has one, counts: one whole number for the batch."""
    count = loss_counter()
    if count is None:
        return
    try:
        items = torch.as_tensor(count(batch))
    except Exception as e:
        raise ConfigError(
            f"{where_in_fork_files(e)}: loss_items(batch) failed on an eval batch: "
            f"{type(e).__name__}: {first_line(e)}"
        ) from None
    if items.numel() != 1 or items.is_floating_point() or items.is_complex():
        raise ConfigError(
            "train/model.py: loss_items(batch) must return how many items .loss averages over, one "
            f"whole number (got a {items.dtype} tensor of shape {tuple(items.shape)})"
        )


def check_columns(columns, samples: int, function: str) -> None:
    """What eval_columns (or generate_columns) returned: a dict of one value per sample."""
    if not isinstance(columns, dict) or not columns:
        raise ConfigError(
            f"train/model.py: {function} must return a dict {{name: tensor of shape (batch,)}} "
            f"(got {type(columns).__name__})"
        )
    for name, values in columns.items():
        if not isinstance(values, torch.Tensor) or tuple(values.shape) != (samples,):
            shape = (
                tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            )
            raise ConfigError(
                f"train/model.py: {function}' '{name}' must be one value per sample, shape "
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
