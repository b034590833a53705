"""A Hugging Face causal LM fine-tuned on conversations (supervised fine-tuning): --hf_model NAME
or a local folder, e.g. Qwen/Qwen2.5-0.5B-Instruct. Copy this file over train/model.py, and its
data.py over train/data.py (examples/README.md, README "Fine-tune a hub model").

Its task is the causal LM's (lm.py) on the assistant's tokens only: data.py masks the rest (-100).
The model's .loss is the mean over the batch's assistant tokens (transformers' own loss), and
loss_items says how many that is, so each optimizer step weighs every assistant token of the step
the same, whatever the accumulation or world size (task.loss_weights). The eval reports loss,
accuracy and perplexity per assistant token. The export is the Hugging Face model folder with the
tokenizer and its chat template: `AutoModelForCausalLM.from_pretrained(run)` (with --lora_r, the
adapter for `PeftModel.from_pretrained`, or merged with --merge_adapter), and
`python scripts/sample.py RUN --chat --prompt "..."` talks to it (CHAT_MODEL: the run's summary
prints that command).
"""

from __future__ import annotations

import torch.nn as nn

from errors import ConfigError
from lm import counted_targets, hugging_face_model, token_columns, token_metrics, uses_hub_model

# a chat model: a prompt goes in as a user's turn through its chat template (task.sample_flags: the
# run's summary prints scripts/sample.py's command with --chat)
CHAT_MODEL = True


def check_config(cfg) -> None:
    if not uses_hub_model(cfg):
        raise ConfigError(
            "hf_model: chat fine-tuning starts from a Hugging Face causal LM: pass --hf_model "
            "NAME_OR_FOLDER (e.g. Qwen/Qwen2.5-0.5B-Instruct)"
        )


def build_model(cfg) -> nn.Module:
    model = hugging_face_model(cfg)
    # no key/value cache while training: with one, transformers does not read the packed
    # conversations' restarting position_ids and would let them attend to each other
    # (generate() still uses a cache: it asks for one itself)
    model.config.use_cache = False
    return model


def loss_items(batch: dict):
    """The assistant tokens the batch's .loss averages over (lm.counted_targets)."""
    return counted_targets(batch["labels"])


def eval_columns(output, batch: dict) -> dict:
    """Per block, sums over the assistant's tokens (the others are -100): lm.token_columns."""
    return token_columns(output.logits, batch["labels"])


def eval_metrics(sums: dict, cfg) -> dict:
    """Per assistant token over the eval set: loss, accuracy, perplexity."""
    return token_metrics(sums)


def tokens_per_sample(cfg) -> int | None:
    """A packed block's positions, padding included (tokens/s is the work done). Unpacked
    (packing false), a row's length is its batch's longest: no fixed count, so the run reports
    conversations (samples) a second."""
    return cfg.block_size if cfg.packing else None
