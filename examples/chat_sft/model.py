"""A Hugging Face causal LM fine-tuned on conversations (supervised fine-tuning): --hf_model NAME or a
local folder, e.g. Qwen/Qwen2.5-0.5B-Instruct. Copy this file over train/model.py, and its data.py
over train/data.py (examples/README.md, README "Fine-tune a hub model").

Its task is the causal LM's (lm.py) on the assistant's tokens only: data.py masks the rest (-100).
The model's .loss is the mean over the batch's assistant tokens (transformers' own loss), and
loss_items says how many that is, so each optimizer step weighs every assistant token of the step
the same, whatever the accumulation or world size (task.loss_weights). The eval reports loss,
accuracy and perplexity per assistant token (teacher-forced: eval_columns), and answer_exact, the
share of the eval set's assistant turns the model generates token for token, greedily, from the
conversation before each (free-running: generate_columns; --generate_eval false leaves it out). The
export is the Hugging Face model folder with the tokenizer and its chat template:
`AutoModelForCausalLM.from_pretrained(run)` (with --lora_r, the adapter for
`PeftModel.from_pretrained`, or merged with --merge_adapter), and `python scripts/sample.py RUN
--chat --prompt "..."` talks to it (CHAT_MODEL: the run's summary prints that command).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn

from chat import chat_tokenizer, end_of_turn_ids, greedy, sharded
from errors import ConfigError
from lm import counted_targets, hugging_face_model, token_columns, token_metrics, uses_hub_model

# a chat model: a prompt goes in as a user's turn through its chat template (task.sample_flags: the
# run's summary prints scripts/sample.py's command with --chat)
CHAT_MODEL = True
IGNORED = -100  # a label that counts nothing (data.py: everything but the assistant's tokens)
GENERATED = ("turns", "turns_exact")  # generate_columns' columns, counted per turn, not per token


@dataclass
class ModelConfig:
    # each eval also generates every whole assistant turn greedily from the conversation before it
    # and reports the share that comes out token for token (eval_answer_exact, generate_columns);
    # false: the teacher-forced metrics alone (an eval of long answers generates as many tokens)
    generate_eval: bool = True


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


def generate_columns(model, batch: dict, cfg) -> dict:
    """Free-running, where eval_columns is teacher-forced: each assistant turn whole in its row (its
    end of turn in it, not cut at the block's end), generated greedily from everything before it
    in its conversation, with room for its own tokens. Per row: "turns", and "turns_exact", those
    generated token for token up to and with their end of turn. A model can predict each next
    token of an answer well and still drift once it reads its own: eval_answer_exact shows it.
    (--generate_eval false: none.)"""
    rows = batch["input_ids"].size(0)
    device = batch["input_ids"].device
    if not cfg.generate_eval:
        return {}
    ends, pad_id = turn_ends(cfg)
    turns = whole_turns(batch, ends)
    counted = torch.zeros(rows, dtype=torch.float64, device=device)
    exact = torch.zeros(rows, dtype=torch.float64, device=device)
    if not turns:
        if sharded(model):  # every rank generates as often: the others' forwards wait for ours
            greedy(
                model,
                batch["input_ids"][:1, :1],
                torch.ones_like(batch["input_ids"][:1, :1]),
                ends,
                pad_id,
                max_new_tokens=1,
            )
        return {"turns": counted, "turns_exact": exact}
    prompts = [batch["input_ids"][row, start:turn] for row, start, turn, _ in turns]
    answers = [batch["input_ids"][row, turn:end] for row, _, turn, end in turns]
    prompt_ids, prompt_mask = left_padded(prompts, pad_id)
    longest = max(len(answer) for answer in answers)
    said = greedy(model, prompt_ids, prompt_mask, ends, pad_id, max_new_tokens=longest)
    for (row, *_), answer, tokens in zip(turns, answers, said, strict=True):
        counted[row] += 1
        exact[row] += float(torch.equal(tokens[: len(answer)], answer))
    return {"turns": counted, "turns_exact": exact}


@functools.cache
def turn_ends(cfg) -> tuple[list[int], int]:
    """The tokens that end an assistant's turn, and the padding id for generate."""
    tokenizer = chat_tokenizer(cfg)
    ends = sorted(end_of_turn_ids(tokenizer))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ends[0]
    return ends, pad_id


def whole_turns(batch: dict, ends: list[int]) -> list[tuple[int, int, int, int]]:
    """(row, its conversation's first position, the turn's first, one past its end of turn) of each
    assistant turn in the batch: a run of labelled positions (data.py labels the assistant's tokens
    with themselves) that holds an end of turn. A conversation starts where its positions restart
    (position_ids 0: packed blocks hold several)."""
    found = []
    for row, (labels, tokens, positions) in enumerate(
        zip(
            batch["labels"].tolist(),
            batch["input_ids"].tolist(),
            batch["position_ids"].tolist(),
            strict=True,
        )
    ):
        k = 0
        while k < len(labels):
            if labels[k] == IGNORED:
                k += 1
                continue
            first = k
            while k < len(labels) and labels[k] != IGNORED:
                k += 1
            ending = next((i for i in range(first, k) if tokens[i] in ends), None)
            if ending is not None:
                found.append((row, first - positions[first], first, ending + 1))
    return found


def left_padded(prompts: list, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one batch padded on the left (generate continues each from its last token),
    and its attention mask."""
    longest = max(len(prompt) for prompt in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long, device=prompts[0].device)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = prompt
        mask[row, longest - len(prompt) :] = 1
    return ids, mask


def eval_metrics(sums: dict, cfg) -> dict:
    """Per assistant token over the eval set: loss, accuracy, perplexity; and with generate_eval,
    answer_exact: the share of whole assistant turns generated token for token."""
    metrics = token_metrics({name: sums[name] for name in sums if name not in GENERATED})
    if sums.get("turns"):
        metrics["answer_exact"] = sums["turns_exact"] / sums["turns"]
    return metrics


def tokens_per_sample(cfg) -> int | None:
    """A packed block's positions, padding included (tokens/s is the work done). Unpacked
    (packing false), a row's length is its batch's longest: no fixed count, so the run reports
    conversations (samples) a second."""
    return cfg.block_size if cfg.packing else None
