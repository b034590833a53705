"""LoRA adapters (--lora_r > 0): low-rank updates trained on a frozen model, through Hugging Face's
`peft`.

peft's `inject_adapter_in_model` puts a LoRA layer around each target nn.Linear, in place: the
model keeps its class, its forward and its blocks, so FSDP, activation checkpointing and
torch.compile see the model they would see without adapters, and only the adapters' parameters
require gradients. From there the template needs nothing of its own for them: the optimizer takes
the parameters that require gradients (optim.py), a checkpoint's model part holds only those (the
frozen weights come back from where they came from: the hub, --init_from, the seed; checkpoint.py),
and the export is the adapter in peft's own format, or merged into the weights (--merge_adapter).

Which layers: every nn.Linear inside the model's transformer blocks by default (the attention and
MLP projections: the blocks `_no_split_modules` names), or --lora_targets' names, matched as peft
matches them (a module's name or its last dotted parts).
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from blocks import transformer_blocks
from errors import ConfigError

ADAPTER_NAME = "default"  # peft's name for a model's one adapter
# peft's key prefix in adapter_model.safetensors, which PeftModel.from_pretrained expects
PEFT_PREFIX = "base_model.model."
DEFAULT_LORA_ALPHA = 16.0  # lora_alpha's value where it is not given (config.py: 0)


def add_lora(model: nn.Module, cfg) -> nn.Module:
    """The model with a LoRA adapter on each target layer, every other weight frozen."""
    from peft import inject_adapter_in_model

    return inject_adapter_in_model(lora_config(cfg, target_names(model, cfg)), model)


def lora_config(cfg, targets: list[str], base_model: str | None = None):
    """peft's LoraConfig: the run's rank, scale and dropout on these layers (full module names)."""
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha or DEFAULT_LORA_ALPHA,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        bias="none",
        base_model_name_or_path=base_model,
        task_type="CAUSAL_LM" if cfg.hf_model else None,
    )


def target_names(model: nn.Module, cfg) -> list[str]:
    """The full names of the linear layers that get an adapter; a --lora_targets name that matches
    none is one line naming the model's linear layers."""
    linear = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    if not cfg.lora_targets:  # the attention and MLP projections: every linear layer in a block
        inside = {id(m) for block in transformer_blocks(model, "lora_r") for m in block.modules()}
        return [name for name, module in linear.items() if id(module) in inside]
    chosen = []
    for wanted in [name.strip() for name in cfg.lora_targets.split(",") if name.strip()]:
        matched = [name for name in linear if name == wanted or name.endswith(f".{wanted}")]
        if not matched:
            kinds = sorted({name.rsplit(".", 1)[-1] for name in linear})
            raise ConfigError(
                f"lora_targets: '{wanted}' matches no linear layer of {type(model).__name__} (its "
                f"linear layers are named {', '.join(kinds)}) (got {cfg.lora_targets!r})"
            )
        chosen += [name for name in matched if name not in chosen]
    return chosen


def check_targets_under_fsdp(model: nn.Module, targets: list[str]) -> None:
    """FSDP shards the model block by block, the rest (embeddings, the head) as one root unit where
    the shipped GPT's head shares its weight with the embedding: an adapter there would wrap one of
    the two names of one sharded parameter. Adapters inside the blocks only, under FSDP."""
    inside = {id(m) for block in transformer_blocks(model, "fsdp") for m in block.modules()}
    modules = dict(model.named_modules())
    outside = [name for name in targets if id(modules[name]) not in inside]
    if outside:
        raise ConfigError(
            f"lora_targets: under fsdp, adapters go in the transformer blocks only (FSDP's units); "
            f"{', '.join(outside[:3])} is outside them (got {', '.join(targets[:3])}...)"
        )


def is_adapted(module: nn.Module) -> bool:
    """Whether the model carries peft adapters (peft is imported by whoever added them)."""
    peft_tuners = sys.modules.get("peft.tuners.tuners_utils")
    if peft_tuners is None:
        return False
    return any(isinstance(m, peft_tuners.BaseTunerLayer) for m in module.modules())


# ---------------------------------------------------------------- the export


def peft_format(trainable: dict) -> dict:
    """The adapter's weights under the names peft saves them with: PeftModel.from_pretrained(base,
    folder) loads them (`...q_proj.lora_A.default.weight` -> `base_model.model....q_proj.lora_A.weight`)."""
    suffix = f".{ADAPTER_NAME}."
    return {
        PEFT_PREFIX + name.replace(suffix, "."): tensor.contiguous()
        for name, tensor in trainable.items()
    }


def from_peft_format(saved: dict) -> dict:
    """peft_format's names back to the model's (`lora_A.weight` -> `lora_A.default.weight`)."""
    renamed = {}
    for name, tensor in saved.items():
        name = name.removeprefix(PEFT_PREFIX)
        for matrix in ("lora_A", "lora_B"):
            name = name.replace(f".{matrix}.", f".{matrix}.{ADAPTER_NAME}.")
        renamed[name] = tensor
    return renamed


def merged_weights(model: nn.Module, weights: dict) -> dict:
    """The whole model's weights (`weights`: its state dict, gathered) with each adapter merged into
    its layer (W + scale x B A, as peft's merge does) and named as in the model without adapters."""
    from peft.tuners.lora import LoraLayer

    if not weights:  # a process other than the main one, under FSDP: it writes nothing
        return {}
    merged = {name: tensor for name, tensor in weights.items() if ".lora_" not in name}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        a = weights[f"{name}.lora_A.{ADAPTER_NAME}.weight"].double()
        b = weights[f"{name}.lora_B.{ADAPTER_NAME}.weight"].double()
        base = merged[f"{name}.base_layer.weight"]
        scale = module.scaling[ADAPTER_NAME]
        merged[f"{name}.base_layer.weight"] = (base.double() + scale * (b @ a)).to(base.dtype)
    return {name.replace(".base_layer.", "."): tensor for name, tensor in merged.items()}


def write_adapter_config(folder, model: nn.Module, cfg) -> None:
    """adapter_config.json: the layers that have an adapter, and the base model (the hub name or
    folder it was fine-tuned from)."""
    from peft.tuners.lora import LoraLayer

    adapted = [name for name, module in model.named_modules() if isinstance(module, LoraLayer)]
    config = lora_config(cfg, adapted, base_model=cfg.hf_model or None)
    # peft keeps them as a set, written in an order that changes from process to process (string
    # hashing): sorted, the same adapter is the same file, as its weights are
    config.target_modules = sorted(config.target_modules)
    config.save_pretrained(str(folder))


def trainable_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """What trains: the parameters that require gradients (the adapters), and the buffers, which
    training may change too (BatchNorm's statistics)."""
    saved = module.state_dict(keep_vars=True)  # persistent buffers only, as a checkpoint keeps
    state = {name: p for name, p in module.named_parameters() if p.requires_grad}
    state.update({name: b for name, b in module.named_buffers() if b is not None})
    return {name: tensor.detach() for name, tensor in state.items() if name in saved}
