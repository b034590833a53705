"""A model's repeated blocks, and what the template does with them: FSDP shards them one by one
(sharding.py, torch_ddp.py), activation checkpointing recomputes them, torch.compile compiles them
(compiling.py), Muon orthogonalizes their matrices (optim.py); and training FLOPs per token for MFU.

Any task's model: a model names its block class in `_no_split_modules`, as Hugging Face models do.
"""

from __future__ import annotations

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from errors import ConfigError


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
