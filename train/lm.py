"""The causal language model task: what the shipped model.py and data.py (and a fork's LM) use.

A causal LM's `model(**batch)` returns an object with `.loss` (the mean next-token loss it trains
on) and `.logits` (batch, time, vocab), as Hugging Face's models do. Around that, this module keeps
the LM's answers to what the template asks of a task (task.py):
    - the next-token loss (`causal_lm_loss`), the per-sample evaluation columns (`eval_columns`,
      per token) and the metrics from their sums (`eval_metrics`: loss, accuracy, perplexity);
    - what a sample is worth: `tokens_per_sample` (a packed block), FLOPs per token for MFU;
    - finding the transformer blocks (`_no_split_modules`) for FSDP and activation checkpointing;
    - tokenizers (`--tokenizer`: bytes, or a Hugging Face name or folder) and Hugging Face causal
      LMs (`--model NAME`, which the shipped model.py's build_model builds instead of its GPT).
Nothing here imports model.py or data.py: they import from here.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from errors import ConfigError, first_line

BYTE_VOCAB_SIZE = 256  # the "bytes" tokenizer: every UTF-8 byte is a token, nothing to download
# --model's value for model.py's build_model (anything else is a Hugging Face model)
LOCAL_MODEL = "gpt"


# ---------------------------------------------------------------- the loss and the evaluation columns


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-sample mean next-token loss, (batch,). Position t predicts labels[t + 1]; -100 is
    ignored."""
    # the targets move left, not the logits: the last position gets an ignored target, and the
    # logits are not copied (a sliced view would be, by reshape; 0.4 ms of a 100 ms CPU step)
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    flat_logits = logits.float().flatten(0, 1)
    per_token = F.cross_entropy(flat_logits, targets.flatten(), ignore_index=-100, reduction="none")
    per_token = per_token.view_as(targets)
    counted = (targets != -100).sum(dim=1).clamp(min=1)
    return per_token.sum(dim=1) / counted


def eval_columns(output, batch: dict) -> dict:
    """The causal LM's evaluation (model.py's `eval_columns`): per-sample sums over its next-token
    predictions, `tokens`, `loss` and `accuracy`, each a float64 tensor of shape (batch,)."""
    return token_columns(output.logits, batch["labels"])


@torch.no_grad()
def token_columns(logits: torch.Tensor, labels: torch.Tensor, max_floats: int = 2**26) -> dict:
    """Per-sample sums over next-token predictions, each a float64 tensor of shape (batch,), by
    name. A new metric is one more column here: e.g. `"top5": (chunk.topk(5).indices ==
    wanted[..., None]).any(-1)`, reported by eval_metrics as top5 per token. Upcasts at most
    `max_floats` logits to fp32 at once (256 MiB): at a 150k vocabulary, a batch's fp32 logits would
    be gigabytes."""
    predictions = logits[:, :-1]  # views: nothing is copied yet
    targets = labels[:, 1:]
    columns = {"tokens": [], "loss": [], "accuracy": []}
    positions_per_chunk = max(1, max_floats // (logits.size(0) * logits.size(-1)))
    for start in range(0, targets.size(1), positions_per_chunk):
        chunk = predictions[:, start : start + positions_per_chunk].float()
        wanted = targets[:, start : start + positions_per_chunk]
        counted = wanted != -100
        losses = F.cross_entropy(chunk.transpose(1, 2), wanted, ignore_index=-100, reduction="none")
        columns["tokens"].append(counted)
        columns["loss"].append(losses)
        columns["accuracy"].append((chunk.argmax(-1) == wanted) & counted)
    return {name: torch.cat(parts, dim=1).double().sum(dim=1) for name, parts in columns.items()}


def eval_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The causal LM's reported values (model.py's `eval_metrics`) from the eval set's column sums:
    every column per token, and the perplexity."""
    tokens = max(sums["tokens"], 1.0)
    metrics = {name: total / tokens for name, total in sums.items() if name != "tokens"}
    # capped: a diverged run stays finite
    metrics["perplexity"] = math.exp(min(metrics["loss"], 50))
    return metrics


def tokens_per_sample(cfg) -> int:
    """What one training sample is worth in tokens (model.py's `tokens_per_sample`): a packed block."""
    return cfg.block_size


# ---------------------------------------------------------------- blocks and FLOPs


def transformer_blocks(model: nn.Module, needed_for: str) -> list[nn.Module]:
    """The modules whose class `model._no_split_modules` names (Hugging Face models set it; so does
    GPT)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    # by any class in the module's MRO: once sharded, a Block is an FSDPBlock, a subclass of it
    blocks = [
        module
        for module in model.modules()
        if names & {cls.__name__ for cls in type(module).__mro__}
    ]
    if not blocks:
        raise ConfigError(
            f"model: {needed_for} works block by block, and {type(model).__name__}._no_split_modules names "
            f"no block class of it: set it to the class of the model's repeated layer"
        )
    return blocks


def checkpoint_activations(model: nn.Module) -> None:
    """Each block keeps only its input in forward and recomputes the rest in backward (dropout masks
    too)."""
    for block in transformer_blocks(model, "activation_checkpointing"):
        block.forward = recomputed_in_backward(block.forward)


def recomputed_in_backward(forward):
    """forward under torch.utils.checkpoint. A function, not functools.partial: torch.compile traces
    through it (a compiled block then recomputes with its compiled code), and skips a partial of
    checkpoint without a word, leaving the block eager."""

    def checkpointed_forward(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return checkpointed_forward


def flops_per_token(model: nn.Module) -> float:
    """Training FLOPs per token: the model's own estimate if it has one, else 6 x parameters
    (Kaplan)."""
    own_estimate = getattr(model, "flops_per_token", None)
    if callable(own_estimate):
        return own_estimate()
    return 6 * sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- tokenizers


@functools.cache
def load_tokenizer(name: str):
    """None for "bytes" (every UTF-8 byte a token), else a Hugging Face tokenizer by hub name or
    local folder."""
    if name == "bytes":
        return None
    from transformers import AutoTokenizer  # imported only when used

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except Exception as e:  # offline, a wrong name or folder: all the same to the user
        raise ConfigError(f"tokenizer '{name}' could not be loaded: {first_line(e)}") from None
    return tokenizer


def packing_tokenizer(name: str):
    """load_tokenizer's, for packing documents into blocks: it must have an EOS token to end each
    document with (a classifier's tokenizer need not)."""
    tokenizer = load_tokenizer(name)
    if tokenizer is not None and tokenizer.eos_token_id is None:
        raise ConfigError(
            f"tokenizer '{name}' has no EOS token to end documents with: set its eos_token"
        )
    return tokenizer


def vocab_size(cfg) -> int:
    """Tokens the configured tokenizer can produce: what a model built from scratch must embed."""
    tokenizer = load_tokenizer(cfg.tokenizer_name)
    if tokenizer is None:
        return BYTE_VOCAB_SIZE
    return len(tokenizer)


# ---------------------------------------------------------------- Hugging Face models


def uses_hub_model(cfg) -> bool:
    return cfg.model != LOCAL_MODEL


def hugging_face_model(cfg) -> nn.Module:
    """--model NAME: its pretrained weights (fine-tuning), or its architecture with fresh weights
    (model_weights: config), in fp32: mixed precision casts for compute, the optimizer steps fp32
    weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.model_weights == "pretrained":
        return AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    model_config = AutoConfig.from_pretrained(cfg.model)
    return AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)


def save_tokenizer(cfg, folder) -> None:
    """Beside an exported Hugging Face model: its tokenizer's files, so
    AutoTokenizer.from_pretrained(folder) loads what the run trained with ("bytes" has no files)."""
    tokenizer = load_tokenizer(cfg.tokenizer_name)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def check_model_and_tokenizer(cfg) -> None:
    """Resolve a Hugging Face model's config and tokenizer now (small files, or the local cache
    offline): a wrong name, or a tokenizer the model cannot embed, is one line before any process
    group or download of weights."""
    if not uses_hub_model(cfg) and cfg.tokenizer_name == "bytes":
        return
    model_config = None
    if uses_hub_model(cfg):
        from transformers import AutoConfig

        try:
            model_config = AutoConfig.from_pretrained(cfg.model)
        except Exception as e:  # offline, a wrong name or folder, no access
            raise ConfigError(f"model '{cfg.model}' could not be loaded: {first_line(e)}") from None
    try:
        tokens = vocab_size(cfg)
    except ConfigError as e:
        default = (
            ""
            if cfg.tokenizer
            else " (the model's own, by default: pass --tokenizer NAME_OR_FOLDER)"
        )
        raise ConfigError(f"{e}{default}") from None
    if model_config is None:
        return
    if cfg.model_weights == "pretrained" and os.path.isdir(cfg.model):
        check_model_folder(cfg.model, model_config)
    embedded = model_config.vocab_size
    if tokens > embedded:
        raise ConfigError(
            f"tokenizer has {tokens} tokens, more than the {embedded} that model '{cfg.model}' embeds "
            f"(got {cfg.tokenizer_name!r})"
        )
    positions = getattr(model_config, "max_position_embeddings", None) or cfg.block_size
    if cfg.block_size > positions:
        raise ConfigError(
            f"block_size must be <= the model's {positions} positions (got {cfg.block_size})"
        )


DATA_FILE_SUFFIXES = (".txt", ".json", ".jsonl", ".csv", ".parquet")


def check_dataset_name(dataset: str) -> None:
    """--dataset is a local file or folder, or a name for data.py (a hub dataset, a built-in
    corpus). A value that looks like a path must exist: said at once, rather than after the hub
    client's retries (26 s offline)."""
    if dataset == "":
        raise ConfigError("dataset must not be empty (got '')")
    if os.path.exists(dataset):
        return
    first_part = dataset.split("/")[0]
    looks_like_a_path = (
        dataset.startswith(("/", "./", "../", "~"))
        or dataset.endswith(DATA_FILE_SUFFIXES)
        or dataset.count("/") > 1
        or ("/" in dataset and os.path.isdir(first_part))
    )
    if not looks_like_a_path:
        if "/" in dataset:  # owner/name: a hub dataset
            check_hub_dataset(dataset)
        return
    hint = ""
    if os.path.isdir(first_part):
        hint = f" (there is a local folder '{first_part}/': a typo in the path?)"
    raise ConfigError(f"dataset is not an existing file or folder{hint} (got {dataset!r})")


def unreadable_data(dataset: str, error: Exception) -> ConfigError:
    """One line for data that cannot be read, naming the file and line at fault when the reader does not
    (a local JSON lines file: the first line that does not parse)."""
    where = ""
    path = Path(dataset)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(path.rglob("*.jsonl"))
    else:
        files = []
    for file in (f for f in files if f.suffix == ".jsonl"):
        line = first_bad_json_line(file)
        if line:
            where = f" ({file}, line {line})"
            break
    cause = error.__cause__ or error
    return ConfigError(f"dataset '{dataset}' cannot be read{where}: {first_line(cause)}")


def first_bad_json_line(file: Path) -> int | None:
    with open(file, "rb") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except ValueError:
                return number
    return None


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def check_model_folder(folder: str, model_config) -> None:
    """A local Hugging Face model folder must hold weights, and (safetensors) weights of the shapes its
    config.json describes: said in one line now, not as transformers' mismatch table after the process
    group has started. The model is built on the meta device: no memory, no time."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    present = [name for name in WEIGHT_FILES if os.path.isfile(os.path.join(folder, name))]
    if not present:
        raise ConfigError(
            f"model '{folder}' has a config.json and no weights ({' or '.join(WEIGHT_FILES[::2])}): pass "
            f"--model_weights config to train its architecture from fresh weights"
        )
    if present[0] == "model.safetensors":
        files = [os.path.join(folder, "model.safetensors")]
    elif present[0] == "model.safetensors.index.json":
        index = json.loads(Path(folder, present[0]).read_text())
        files = sorted({os.path.join(folder, name) for name in index["weight_map"].values()})
    else:
        return  # pickled weights: read only by loading them
    with torch.device("meta"):
        expected = {
            k: tuple(v.shape)
            for k, v in AutoModelForCausalLM.from_config(model_config).state_dict().items()
        }
    problems = []
    for file in files:
        with safe_open(file, framework="pt") as weights:
            for key in weights.keys():
                shape = tuple(weights.get_slice(key).get_shape())
                if key in expected and expected[key] != shape:
                    problems.append(f"{key} {list(shape)} vs {list(expected[key])}")
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ConfigError(
            f"model '{folder}': its weights do not fit its config.json ({model_config.model_type}): "
            f"{'; '.join(problems[:3])}{more}"
        )


HUB_TIMEOUT_S = (
    5  # one question to the hub at start-up, instead of its client's retries (25 s offline)
)


def hub_is_offline() -> bool:
    return any(
        os.environ.get(v, "0") not in ("0", "") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def check_hub_dataset(name: str) -> None:
    """Ask the hub once, in at most HUB_TIMEOUT_S, whether the dataset is there. Not there: one line now.
    The hub cannot be reached: with a local copy, this process goes on offline (datasets then reads the
    copy at once); without one, one line now rather than after the client's retries."""
    if hub_is_offline():
        return
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        HfApi().dataset_info(name, timeout=HUB_TIMEOUT_S)
        return
    except RepositoryNotFoundError:
        raise ConfigError(
            f"dataset '{name}' is not on the hub (or is private or gated: log in with `hf auth login`)"
        ) from None
    except Exception as e:  # no network, a timeout, a proxy: the hub cannot be reached
        unreachable = first_line(e)
    owner, repo = name.split("/", 1)
    cached = [
        Path(constants.HF_HUB_CACHE) / f"datasets--{owner}--{repo}",
        Path(os.environ.get("HF_DATASETS_CACHE", Path(constants.HF_HOME) / "datasets"))
        / f"{owner}___{repo}",
    ]
    if not any(folder.exists() for folder in cached):
        raise ConfigError(
            f"dataset '{name}' could not be loaded: the hub cannot be reached ({unreachable}) and there is no "
            f"local copy (set HF_HUB_OFFLINE=1 to use the cache without asking the hub)"
        )
    os.environ["HF_HUB_OFFLINE"] = "1"  # read by datasets when it is imported, after this check
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
