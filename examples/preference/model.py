"""Preference tuning of a chat model (DPO and its family): a Hugging Face causal LM, the policy, learns
to give its chosen completions more probability than its rejected ones, against a reference that
never moves. Copy this file over train/model.py, and its data.py over train/data.py (README
"Preference tuning"). It starts from an SFT run's export: --hf_model RUN (merged with
--merge_adapter true if that run trained adapters), or any chat model's name or folder.

The losses, per pair, with pi and ref the policy's and the reference's log-prob of a completion
given its prompt (the sum over its tokens), n its token count, _c the chosen's and _r the rejected's:

    sigmoid  DPO (Rafailov et al. 2023, "Direct Preference Optimization", arXiv:2305.18290), with
             cDPO's label smoothing eps (Mitchell 2023, "A note on DPO with noisy preferences"):
                 h = (pi_c - ref_c) - (pi_r - ref_r)
                 loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
    ipo      IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
             Preferences", arXiv:2310.12036, eq. 17), length-normalised as TRL computes it (per
             token; the paper's results use that form, TRL's comment says):
                 h_avg = (pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r
                 loss = (h_avg - 1 / (2 beta))^2
    simpo    SimPO (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free
             Reward", arXiv:2405.14734), no reference:
                 loss = -log sigmoid(beta (pi_c / n_c - pi_r / n_r) - gamma)

The model's .loss is the mean of its batch's pair losses, and loss_items counts the pairs: a step's
loss is the mean over all its pairs on all ranks, whatever the accumulation or world size.

A completion's implicit reward is beta (pi - ref) (SimPO: beta pi / n). The eval, over exactly the
eval set: the loss, the reward accuracy (the share of pairs whose chosen's reward is above the
rejected's; a tie is not), the mean reward margin (chosen's minus rejected's), the mean chosen and
rejected log-probs (pi) and the reference's mean chosen log-prob, the same at every evaluation of a
run: its reference never moves.

The reference is the model the run starts from (--hf_model's weights as loaded), never drifting:
    - with --lora_r, that same model with its LoRA adapters off (no copy: the frozen base is what
      it was at the start);
    - otherwise a frozen copy made in build_model: it costs a full copy of the weights on each
      process, in fp32 (4 bytes a parameter: a 7B model's 28 GB, not sharded under FSDP; LoRA
      needs none). It is kept out of the model's module tree: not in its state_dict, parameters,
      optimizer or checkpoints (rebuilt from --hf_model at every start), moved to the policy's
      device at its first use, always in eval mode;
    - SimPO has none.
identity(model) gives the template the reference's weight digest, kept in each checkpoint's
manifest: a resume against other reference weights is refused in one line (resume.py).

build_model returns the Hugging Face model itself, so the export, LoRA's adapter names and
generate() are the SFT example's, and scripts/sample.py --chat talks to the result.
"""

from __future__ import annotations

import math
import os
import types
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from chat import adapters_off, evaluated, frozen_copy, say, weights_digest
from errors import ConfigError
from lm import hugging_face_model, uses_hub_model

# a chat model: the run's summary prints scripts/sample.py's command with --chat
CHAT_MODEL = True
LOSSES = ("sigmoid", "ipo", "simpo")
SIDES = ("chosen", "rejected")


@dataclass
class ModelConfig:
    """The preference loss's own keys (the template joins them to its own: YAML, --flags, --help)."""

    # sigmoid (DPO), ipo (IPO, per-token log-ratios) or simpo (SimPO: no reference model)
    preference_loss: str = "sigmoid"
    # how strongly the policy is held to the reference (> 0): DPO's usual 0.1; IPO's tau; SimPO's
    # scale of its rewards (its paper uses 2 to 10)
    beta: float = 0.1
    # cDPO: the chance a pair's preference is the wrong way round, in [0, 0.5) (sigmoid only)
    label_smoothing: float = 0.0
    # SimPO's target margin between the chosen's and the rejected's rewards (TRL's default)
    simpo_gamma: float = 0.5


def check_config(cfg) -> None:
    """The model's keys, at start-up: one line naming the key."""
    if not uses_hub_model(cfg):
        raise ConfigError(
            "hf_model: preference tuning starts from a Hugging Face chat model, usually an SFT "
            "run's export: pass --hf_model RUN_FOLDER_OR_NAME"
        )
    if os.path.isfile(os.path.join(cfg.hf_model, "adapter_config.json")):
        # transformers would load the base with the adapter on: with --lora_r the reference (the
        # adapters off) would be the base, not the SFT model the run starts from
        raise ConfigError(
            f"hf_model: '{cfg.hf_model}' holds a LoRA adapter, not a whole model: export the SFT "
            "run merged (--merge_adapter true) and pass that folder, the reference must be the "
            "SFT model itself"
        )
    if cfg.init_from:
        raise ConfigError(
            "init_from: the reference is the weights the run starts from, loaded from --hf_model; "
            "pass the SFT run's exported folder as --hf_model instead (with --merge_adapter true "
            f"if it trained adapters) (got {cfg.init_from!r})"
        )
    if cfg.model_weights != "pretrained":
        raise ConfigError(
            "model_weights: preference tuning starts from trained weights, its reference (got "
            f"{cfg.model_weights!r})"
        )
    if cfg.preference_loss not in LOSSES:
        raise ConfigError(
            f"preference_loss must be one of {', '.join(LOSSES)} (got {cfg.preference_loss!r})"
        )
    if not (math.isfinite(cfg.beta) and cfg.beta > 0):
        raise ConfigError(f"beta must be > 0 (DPO's usual 0.1) (got {cfg.beta!r})")
    if not 0 <= cfg.label_smoothing < 0.5:
        raise ConfigError(f"label_smoothing must be in [0, 0.5) (got {cfg.label_smoothing!r})")
    if cfg.label_smoothing and cfg.preference_loss != "sigmoid":
        raise ConfigError(
            "label_smoothing is cDPO's, for preference_loss sigmoid only (got "
            f"{cfg.label_smoothing!r} with {cfg.preference_loss})"
        )
    if not math.isfinite(cfg.simpo_gamma):
        raise ConfigError(f"simpo_gamma must be a finite number (got {cfg.simpo_gamma!r})")


# ---------------------------------------------------------------- the model


@dataclass
class Preference:
    """What the model's preference forward needs beyond its weights: the run's config, and the
    frozen copy of the start's weights (None: with LoRA the reference is the model with its
    adapters off, and SimPO has none). A plain attribute of the model, not a submodule: the copy
    stays out of the model's state_dict, parameters, optimizer and checkpoints."""

    cfg: object
    frozen: nn.Module | None


@dataclass
class PreferenceOutput:
    """The preference forward's output: .loss, and per pair what the eval reports."""

    loss: torch.Tensor  # the mean of the pair losses: what training minimises
    losses: torch.Tensor  # (pairs,)
    chosen_rewards: torch.Tensor  # (pairs,) implicit rewards: beta (pi - ref); SimPO beta pi / n
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor  # (pairs,) pi: the policy's summed completion log-probs
    rejected_logps: torch.Tensor
    ref_chosen_logps: torch.Tensor | None  # (pairs,) ref; None: SimPO has no reference
    ref_rejected_logps: torch.Tensor | None


def build_model(cfg) -> nn.Module:
    """The Hugging Face causal LM, its forward taking pairs as well (preference_forward)."""
    model = hugging_face_model(cfg)
    model.config.use_cache = False  # no key/value cache while training (generate() asks for one)
    frozen = None
    if cfg.preference_loss != "simpo" and not cfg.lora_r:
        frozen = frozen_copy(model)  # before the forward below is set: the copy keeps its own
    model.preference = Preference(cfg, frozen)
    # The model stays the Hugging Face model (its export, LoRA's adapter names and generate() are
    # the SFT example's); only this instance's forward learns pairs. Bound with MethodType, as
    # Accelerate's mixed precision rebinds it: it wraps model.forward.__func__ in autocast. A
    # wrapper module would rename every weight (wrapper.policy.model...) and hide generate().
    model.forward = types.MethodType(preference_forward, model)
    return model


def preference_forward(self, **batch):
    """The model's forward. With a batch of pairs (data.py's collate: chosen_* and rejected_*),
    the PreferenceOutput of its chosen and rejected sequences run as one batch; with anything else
    (generation, sampling), the Hugging Face model's own forward."""
    if "chosen_input_ids" not in batch:
        return type(self).forward(self, **batch)
    cfg = self.preference.cfg
    # one batch: rows 0..pairs-1 the chosen, then the rejected (collate padded them alike)
    both = {
        name: torch.cat([batch[f"chosen_{name}"], batch[f"rejected_{name}"]])
        for name in ("input_ids", "attention_mask", "labels")
    }
    reference = None
    if cfg.preference_loss != "simpo":
        # the reference first: the policy's pass is then the last forward before backward, as
        # FSDP's and activation checkpointing's hooks expect of a training forward
        with torch.no_grad():
            reference = completion_logps(reference_logits(self, both), both["labels"])[0]
    logits = (
        type(self)
        .forward(self, input_ids=both["input_ids"], attention_mask=both["attention_mask"])
        .logits
    )
    policy, tokens = completion_logps(logits, both["labels"])
    return preference_output(cfg, policy, reference, tokens)


def reference_logits(model: nn.Module, both: dict) -> torch.Tensor:
    """The reference's logits: the frozen copy's (moved to the batch's device at first use), or
    with LoRA the model's with its adapters off; in eval mode (no dropout) either way."""
    inputs = {"input_ids": both["input_ids"], "attention_mask": both["attention_mask"]}
    frozen = model.preference.frozen
    if frozen is not None:
        if next(frozen.parameters()).device != both["input_ids"].device:
            frozen.to(both["input_ids"].device)
        return frozen(**inputs).logits
    with adapters_off(model), evaluated(model):
        return type(model).forward(model, **inputs).logits


def completion_logps(logits: torch.Tensor, labels: torch.Tensor):
    """(sums, counts), each (rows,): a sequence's log-prob of its completion, the sum over the
    tokens its labels count (not -100) of log p(token | what precedes it), and how many. Position t
    predicts labels[t + 1]. In fp32, one row at a time: a whole batch's fp32 logits at a 150k
    vocabulary would be gigabytes."""
    targets = labels[:, 1:]
    counted = targets != -100
    sums = []
    # unbind, not logits[row]: indexing's backward fills a zero gradient of the whole batch's logits
    # for each row (at a 32k vocabulary, 3x the step's log-prob time: bench/README.md)
    for row, whole_row in enumerate(logits.unbind(0)):
        row_logits = whole_row[:-1].float()
        picked = row_logits.gather(-1, targets[row].clamp(min=0)[:, None]).squeeze(-1)
        log_probs = picked - row_logits.logsumexp(-1)
        sums.append(torch.where(counted[row], log_probs, 0.0).sum())
    return torch.stack(sums), counted.sum(-1)


def preference_output(cfg, policy, reference, tokens) -> PreferenceOutput:
    """The pair losses and what eval reports, from each row's completion log-prob (policy and
    reference: chosen rows, then rejected rows) and its token count."""
    chosen, rejected = policy.chunk(2)
    ref_chosen, ref_rejected = reference.chunk(2) if reference is not None else (None, None)
    chosen_tokens, rejected_tokens = tokens.chunk(2)
    losses, chosen_rewards, rejected_rewards = pair_losses(
        cfg, chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens
    )
    return PreferenceOutput(
        loss=losses.mean(),
        losses=losses,
        chosen_rewards=chosen_rewards.detach(),
        rejected_rewards=rejected_rewards.detach(),
        chosen_logps=chosen.detach(),
        rejected_logps=rejected.detach(),
        ref_chosen_logps=ref_chosen,
        ref_rejected_logps=ref_rejected,
    )


def pair_losses(cfg, chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens):
    """(losses, chosen_rewards, rejected_rewards), each (pairs,): the module docstring's formulas,
    from the policy's and the reference's completion log-probs (sums) and the token counts."""
    beta = cfg.beta
    if cfg.preference_loss == "simpo":
        chosen_rewards = beta * chosen / chosen_tokens
        rejected_rewards = beta * rejected / rejected_tokens
        losses = -F.logsigmoid(chosen_rewards - rejected_rewards - cfg.simpo_gamma)
        return losses, chosen_rewards, rejected_rewards
    chosen_ratio = chosen - ref_chosen
    rejected_ratio = rejected - ref_rejected
    if cfg.preference_loss == "ipo":
        per_token = chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens
        losses = (per_token - 1 / (2 * beta)) ** 2
    else:  # sigmoid: DPO, cDPO with label smoothing
        h = chosen_ratio - rejected_ratio
        eps = cfg.label_smoothing
        losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    return losses, beta * chosen_ratio, beta * rejected_ratio


# ---------------------------------------------------------------- what the template asks


def loss_items(batch: dict) -> int:
    """The pairs the batch's .loss averages over."""
    return batch["chosen_input_ids"].size(0)


# No tokens_per_sample: a pair's rows are padded to its batch's longest, no fixed count; the run
# reports pairs (samples) a second.


def eval_columns(output, batch: dict) -> dict:
    """Per pair, summed over exactly the eval set by the template."""
    columns = {
        "pairs": torch.ones_like(output.losses),
        "loss": output.losses,
        "reward_accuracy": (output.chosen_rewards > output.rejected_rewards).float(),
        "reward_margin": output.chosen_rewards - output.rejected_rewards,
        "chosen_logps": output.chosen_logps,
        "rejected_logps": output.rejected_logps,
    }
    if output.ref_chosen_logps is not None:
        columns["ref_chosen_logps"] = output.ref_chosen_logps
    return {name: values.detach().double() for name, values in columns.items()}


def eval_metrics(sums: dict, cfg) -> dict:
    """Each column's mean per pair over the eval set: loss (the .loss training minimises),
    reward_accuracy, reward_margin, chosen_logps, rejected_logps, ref_chosen_logps."""
    pairs = max(sums["pairs"], 1.0)
    return {name: total / pairs for name, total in sums.items() if name != "pairs"}


def identity(model) -> dict:
    """{"reference": the digest of the reference's weights} (SimPO: {}, it has none): what a resume
    must find unchanged (task.model_identity). The frozen copy's weights, or with LoRA the base
    weights as built (named as without adapters: the same weights give the same digest). Said
    once at start-up, by the first process."""
    preference = model.preference
    if preference.cfg.preference_loss == "simpo":
        say("reference: none (simpo is reference-free)")
        return {}
    if preference.frozen is not None:
        weights = preference.frozen.state_dict()
        count = sum(p.numel() for p in preference.frozen.parameters())
        gib = sum(p.numel() * p.element_size() for p in preference.frozen.parameters()) / 2**30
        what = (
            f"a frozen copy of {preference.cfg.hf_model} as loaded ({count:,} parameters, "
            f"{gib:.2f} GiB on each process)"
        )
    else:
        weights = {
            name.replace(".base_layer.", "."): tensor
            for name, tensor in model.state_dict().items()
            if ".lora_" not in name
        }
        what = f"{preference.cfg.hf_model} with its LoRA adapters off (no copy)"
    digest = weights_digest(weights)
    say(f"reference: {what}, weights digest {digest}")
    return {"reference": digest}
