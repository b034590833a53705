"""The model and its task. THIS FILE IS YOURS: replace it whole with your own (README "Make it yours";
examples/ holds an image classifier's and a text classifier's).

What the rest of train/ uses of it, and nothing else (task.py, the seam, checks it at start-up):
    build_model(cfg) -> torch.nn.Module, whose forward takes the batch `collate` (data.py) makes as
        keyword arguments and returns an object with .loss, the scalar it trains on.
    eval_columns(output, batch) -> {name: tensor of shape (batch,)}: per-sample values, summed by
        the template over exactly the eval set (under sharding too).
    eval_metrics(sums, cfg) -> {name: float}: the reported metrics (logged as eval_<name>) from
        those sums. Where one of them is "loss", it is checked at start-up against the model's
        .loss on an eval batch.
    loss_items(batch) (optional): how many items .loss averages over in the batch (here: tokens
        not masked). With it, each optimizer step minimises the mean over all the step's items, so
        a short answer's tokens weigh no more than a long one's, whatever the accumulation or world
        size; without it, every micro-batch's mean weighs the same.
    tokens_per_sample(cfg) (optional): a sample's tokens, for tokens/s, tokens_seen and MFU.
    ModelConfig (optional): a dataclass of the model's own config keys, with a comment above each
        (its --help line). They are YAML keys and --flags like the template's, read as cfg.<key>.
    check_config(cfg) (optional): the model's own checks of the config, run at start-up before
        anything starts; raise errors.ConfigError naming the key (one line, as the template's
        checks do).
    _no_split_modules (a class attribute of the model): the names of the classes of its repeated
        blocks, as Hugging Face models declare them. Needed only for FSDP (one shard unit per
        block) and activation_checkpointing (recomputed block by block); a model without it
        trains everywhere else.
    flops_per_token() (an optional method of the model): training FLOPs per token, for MFU; else
        6 x parameters.

This one is a causal language model: a small GPT-style decoder in plain torch (nanoGPT's, trimmed),
or with --hf_model NAME a Hugging Face causal LM (a transformers AutoModelForCausalLM fits the
contract as it is). lm.py holds the causal LM's loss, per-token evaluation and tokenizers. The
vocabulary comes from the tokenizer the data uses (lm.vocab_size: bytes, or --tokenizer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from errors import ConfigError
from lm import (
    causal_lm_loss,
    counted_targets,
    hugging_face_model,
    token_columns,
    token_metrics,
    uses_hub_model,
    vocab_size,
)


@dataclass
class ModelConfig:
    """The GPT's own keys (config.py adds them to the template's)."""

    # transformer blocks
    n_layer: int = 4
    # attention heads; must divide n_embd
    n_head: int = 4
    # width of the residual stream
    n_embd: int = 128
    # 0.0 for pretraining, 0.1+ when fine-tuning small data
    dropout: float = 0.0
    # biases in its linear and norm layers, as GPT-2 has; without them (nanoGPT's default) it trains
    # as well and 3% faster on CPU, with half the parameter tensors
    bias: bool = False


def check_config(cfg) -> None:
    """The GPT's own keys (the template checks only its own)."""
    for key in ("n_layer", "n_head", "n_embd"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"{key} must be > 0 (got {getattr(cfg, key)!r})")
    if not 0 <= cfg.dropout < 1:
        raise ConfigError(f"dropout must be in [0, 1) (got {cfg.dropout!r})")
    if uses_hub_model(cfg) and cfg.bias:
        raise ConfigError(
            "bias applies to the built-in GPT only (a Hugging Face model's own config says whether "
            f"it has biases) (got {cfg.bias!r})"
        )
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"n_embd must be divisible by n_head ({cfg.n_head}) (got {cfg.n_embd})")


def build_model(cfg) -> nn.Module:
    """The Hugging Face causal LM --hf_model names, or else the GPT sized by the config (n_layer,
    n_head, n_embd, block_size, dropout, bias)."""
    if uses_hub_model(cfg):
        return hugging_face_model(cfg)
    return GPT(
        vocab_size=vocab_size(cfg),
        block_size=cfg.block_size,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_embd=cfg.n_embd,
        dropout=cfg.dropout,
        bias=cfg.bias,
    )


def eval_columns(output, batch: dict) -> dict:
    """Per sample, sums over its next-token predictions: tokens counted, loss, right guesses
    (lm.token_columns; a new per-token metric is one more column there)."""
    return token_columns(output.logits, batch["labels"])


def eval_metrics(sums: dict, cfg) -> dict:
    """Per token over the eval set: loss and accuracy, and the perplexity (lm.token_metrics)."""
    return token_metrics(sums)


def loss_items(batch: dict) -> torch.Tensor:
    """How many items the model's .loss averages over in this batch: its counted next-token targets
    (labels of -100 are not). The loop weighs each micro-batch by it, so the step's loss is the
    mean over every token the step counts, on all ranks (batches.loss_weights)."""
    return counted_targets(batch["labels"])


def tokens_per_sample(cfg) -> int:
    """What one training sample is worth: a packed block of block_size tokens."""
    return cfg.block_size


@dataclass
class CausalLMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.proj.residual_scaled = True
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # flash attention where the device has it; dropout only while training
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.proj.residual_scaled = True
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    # the unit FSDP shards and activation checkpointing recomputes (Hugging Face's name for it)
    _no_split_modules = ["Block"]

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        dropout: float = 0.0,
        bias: bool = False,
    ):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying: one matrix embeds and un-embeds
        self.apply(self._init_weights)
        # GPT-2: scale the init of layers that write into the residual stream by 1/sqrt(2 * n_layer)
        for module in self.modules():
            if getattr(module, "residual_scaled", False):
                nn.init.normal_(module.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def flops_per_token(self) -> float:
        """Training FLOPs per token as in PaLM (appendix B) and nanoGPT: 6N for the weight matmuls
        (N = parameters without position embeddings; the tied embedding counts, it is the output
        layer), plus 12 * layers * width * context for attention scores and values."""
        n_params = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        n_layer = len(self.blocks)
        width = self.wte.weight.shape[1]
        return 6 * n_params + 12 * n_layer * width * self.block_size

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids, labels=None, **_unused) -> CausalLMOutput:
        T = input_ids.size(1)
        if T > self.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size {self.block_size}")
        positions = torch.arange(T, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels)
        return CausalLMOutput(loss=loss, logits=logits)
