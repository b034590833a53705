"""The model: a small GPT-style decoder over bytes, in plain torch (nanoGPT's, trimmed).

FORK POINT 1: to train your own model, replace the body of `build_model`. The training loop only
relies on the Hugging Face causal-LM contract: `model(input_ids=..., labels=...)` returns an object
with `.loss` (mean next-token loss) and `.logits` (batch, time, vocab). A
`transformers.AutoModelForCausalLM` fits it unchanged.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from config import ConfigError
from data import vocab_size


# >>> FORK POINT 1: build_model
def build_model(cfg) -> nn.Module:
    """The model to train: the built-in GPT sized by the config, or a Hugging Face causal LM (--model)."""
    if cfg.model != "gpt":
        return hugging_face_model(cfg)
    return GPT(vocab_size=vocab_size(cfg), block_size=cfg.block_size, n_layer=cfg.n_layer,
               n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias)
# <<< FORK POINT 1


def hugging_face_model(cfg) -> nn.Module:
    """Its pretrained weights (fine-tuning), or its architecture with fresh weights (model_weights: config), in
    fp32: mixed precision casts for compute, the optimizer steps fp32 master weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.model_weights == "pretrained":
        return AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model), dtype=torch.float32)


@dataclass
class CausalLMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.proj.residual_scaled = True
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # flash attention where the device has it; dropout only while training
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.proj(y.transpose(1, 2).contiguous().view(B, T, C)))


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
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd, bias=bias), nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    _no_split_modules = ["Block"]  # the unit FSDP shards and activation checkpointing recomputes (Hugging Face's name)

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                 dropout: float = 0.0, bias: bool = False):
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
        (N = parameters without position embeddings; the tied embedding counts, it is the output layer),
        plus 12 * layers * width * context for attention scores and values."""
        n_params = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        n_layer, width = len(self.blocks), self.wte.weight.shape[1]
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
        pos = torch.arange(T, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if labels is None else causal_lm_loss(logits, labels).mean()
        return CausalLMOutput(loss=loss, logits=logits)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-sample mean next-token loss, (batch,). Position t predicts labels[t + 1]; -100 is ignored."""
    # the targets move left, not the logits: the last position gets an ignored target, and the logits are not
    # copied (a sliced view would be, by reshape; 0.4 ms of a 100 ms CPU step)
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    per_token = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                                reduction="none").view_as(targets)
    counted = (targets != -100).sum(dim=1).clamp(min=1)
    return per_token.sum(dim=1) / counted


@torch.no_grad()
def next_token_counts(logits: torch.Tensor, labels: torch.Tensor, max_floats: int = 2**26) -> torch.Tensor:
    """Per sample: (summed next-token loss, tokens counted, tokens predicted right), float64, shape (batch, 3); -100
    is ignored. Upcasts at most `max_floats` logits to fp32 at once (256 MiB): at a 150k vocabulary, a batch's
    fp32 logits would be gigabytes."""
    predictions, targets = logits[:, :-1], labels[:, 1:]  # views: nothing is copied yet
    counts = torch.zeros(labels.size(0), 3, dtype=torch.float64, device=logits.device)
    step = max(1, max_floats // (logits.size(0) * logits.size(-1)))  # positions per chunk
    for start in range(0, targets.size(1), step):
        chunk, wanted = predictions[:, start:start + step].float(), targets[:, start:start + step]
        losses = F.cross_entropy(chunk.transpose(1, 2), wanted, ignore_index=-100, reduction="none")
        counted = wanted != -100
        right = (chunk.argmax(-1) == wanted) & counted
        counts += torch.stack([losses.double().sum(1), counted.sum(1), right.sum(1)], dim=1)
    return counts


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules whose class model._no_split_modules names (Hugging Face models set it; so does GPT)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        raise ConfigError(f"model: {type(model).__name__}._no_split_modules must name its transformer block class "
                          f"(FSDP shards and activation_checkpointing recomputes block by block)")
    return blocks


def checkpoint_activations(model: nn.Module) -> None:
    """Each block keeps only its input in forward and recomputes the rest in backward (dropout masks included)."""
    for block in transformer_blocks(model):
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
