"""Preference pairs for tuning a chat model (DPO, IPO, SimPO: model.py): a prompt and two
completions, the one people preferred (chosen) and the other (rejected). Copy this file over
train/data.py, and its model.py over train/model.py (README "Preference tuning").

    pairs.jsonl (or .json; .csv, .parquet: strings; or a folder of them)
        {"prompt": "...", "chosen": "...", "rejected": "..."}       a user's turn and two answers
        {"prompt": [{"role": "user", "content": "..."}, ...],
         "chosen": [{"role": "assistant", "content": "..."}],
         "rejected": [{"role": "assistant", "content": "..."}]}    conversations (TRL's shape)
    owner/name  a hub dataset with those columns (--dataset_config, --dataset_split), e.g.
                HuggingFaceH4/ultrafeedback_binarized --dataset_split train_prefs (its eval set:
                test_prefs), whose chosen and rejected are whole conversations that repeat the
                prompt's turn: the completion is what follows the prompt's turns

Each column is a string (the prompt a user's turn, a completion the assistant's) or a list of chat
messages, read as chat.py reads them (text parts joined; JSON lines as written, a bad line named).
Each pair goes through the tokenizer's chat template (chat.py): the prompt with the generation
prompt (`<|im_start|>assistant\\n`), then the prompt and each completion; a completion's tokens are
what the second adds to the first (its end of turn included), and only they are scored (labels -100
elsewhere). block_size bounds prompt + completion: a longer completion is cut to fit (one warning
line with the count); a prompt that leaves a completion no token is refused, naming the pair.

A split named validation or test (or dataset_split's sibling: train_prefs' test_prefs) is the eval
set, else eval_fraction of the pairs, held out with a fixed seed; the start-up says which.

One pair a row, padded: collate pads a batch's chosen and rejected sequences to its longest (right
padding, attention_mask 0, labels -100) and gives them to the model as chosen_input_ids,
chosen_attention_mask, chosen_labels and rejected_... . Packing several pairs to a row was not
built: a pair's log-prob is a sum over one sequence, and with padding no sum can cross into another
sequence (packed pairs did, trl #2469); the chat example's packing gain (bench/sft_packing.py) has
not been measured for pairs.

Bad input is one line at start-up: a missing prompt, chosen or rejected (naming the columns there
are), a pair whose chosen is its rejected, a completion that is not the assistant's answer to the
prompt, a prompt that leaves no room for a completion in block_size (each naming the pair).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch

from chat import (
    chat_tokenizer,
    checked_messages,
    checked_splits,
    not_prefixes,
    read_splits,
    render,
    say,
    train_and_eval,
)
from errors import ConfigError

PAIR = ("prompt", "chosen", "rejected")  # a row's columns
COMPLETIONS = ("chosen", "rejected")
# what a pair is, per row: its two sequences, each the prompt and a completion, and their labels
COLUMNS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")


@dataclass
class DataConfig:
    """The preference data's own keys (the template joins them to its own: YAML, --flags, --help)."""

    # tokens of a prompt and one completion together, at most: a longer completion is cut to fit
    # (one warning line with the count); a prompt that leaves it no token is refused
    block_size: int = 1024


def check_config(cfg) -> None:
    """The data's keys, at start-up: one line naming the key."""
    if not cfg.dataset:
        raise ConfigError(
            "dataset: pass --dataset, preference pairs with prompt, chosen and rejected columns (a "
            "JSON lines file, a folder, or a hub name such as "
            "HuggingFaceH4/ultrafeedback_binarized with --dataset_split train_prefs)"
        )
    if cfg.block_size <= 0:
        raise ConfigError(f"block_size must be > 0 (got {cfg.block_size!r})")


def build_datasets(cfg):
    """(train, eval): map-style datasets of pairs, each {chosen_input_ids, chosen_labels,
    rejected_input_ids, rejected_labels}, up to block_size tokens each, unpadded (collate pads)."""
    train, held_out = train_and_eval(load_pairs(cfg), cfg, "pair")
    tokenizer = chat_tokenizer(cfg)
    encoded = {}
    for name, part in (("train", train), ("eval", held_out)):
        rows = part.map(
            encode_pair,
            fn_kwargs={"tokenizer": tokenizer, "block_size": cfg.block_size},
            remove_columns=part.column_names,
            desc=f"tokenizing {name} pairs",
        )
        cut = sum(rows["cut"])
        if cut:
            say(
                f"warning: {cut} {name} completion(s) were cut to fit block_size "
                f"{cfg.block_size} tokens with their prompt (their end is not scored): raise "
                "block_size to keep them whole",
                file=sys.stderr,
            )
        encoded[name] = rows.select_columns(list(COLUMNS)).with_format("torch")
    return encoded["train"], encoded["eval"]


def collate(samples: list[dict]) -> dict:
    """The model's keyword arguments: each side's input_ids, attention_mask and labels, (pairs,
    longest), chosen and rejected padded to one length (the model runs them as one batch). The
    padding is at the end: no label counts it, no token attends to it."""
    longest = max(len(sample[f"{side}_input_ids"]) for sample in samples for side in COMPLETIONS)
    batch = {}
    for side in COMPLETIONS:
        rows = {"input_ids": [], "attention_mask": [], "labels": []}
        for sample in samples:
            ids = sample[f"{side}_input_ids"].long()
            missing = longest - len(ids)
            rows["input_ids"].append(torch.cat([ids, torch.zeros(missing, dtype=torch.long)]))
            mask = [torch.ones(len(ids), dtype=torch.long), torch.zeros(missing, dtype=torch.long)]
            rows["attention_mask"].append(torch.cat(mask))
            filler = torch.full((missing,), -100, dtype=torch.long)
            rows["labels"].append(torch.cat([sample[f"{side}_labels"].long(), filler]))
        batch.update({f"{side}_{name}": torch.stack(values) for name, values in rows.items()})
    return batch


# ---------------------------------------------------------------- pairs to tokens


def encode_pair(row: dict, tokenizer, block_size: int) -> dict:
    """One pair's two sequences through the chat template: the prompt's tokens (with the generation
    prompt), then each completion's, what rendering the prompt and the completion adds to them.
    Labels: the completion's tokens, -100 for the prompt's. "cut": how many of the two were cut to
    fit block_size."""
    prompt = render(tokenizer, row["prompt"], add_generation_prompt=True)
    encoded = {"cut": 0}
    for side in COMPLETIONS:
        whole = render(tokenizer, row["prompt"] + row[side], add_generation_prompt=False)
        if whole[: len(prompt)] != prompt:
            raise not_prefixes(tokenizer)
        if len(whole) == len(prompt):
            raise ConfigError(f"dataset: {row['where']}: its {side} completion renders to no token")
        if len(prompt) >= block_size:  # never a completion of 0 tokens: its mean would be 0/0
            raise ConfigError(
                f"dataset: {row['where']}: its prompt is {len(prompt)} tokens, which leaves its "
                f"{side} completion no token in block_size {block_size}: raise block_size (it "
                "bounds a prompt and a completion together)"
            )
        encoded["cut"] += len(whole) > block_size
        kept = whole[:block_size]
        encoded[f"{side}_input_ids"] = kept
        encoded[f"{side}_labels"] = [-100] * len(prompt) + kept[len(prompt) :]
    return encoded


# ---------------------------------------------------------------- reading the pairs


@functools.cache
def load_pairs(cfg):
    """The dataset_split and its eval split (if it has one) as pairs of conversations, {prompt,
    chosen, rejected, where}, each checked (pair_row), `where` naming the pair for later lines."""
    splits = read_splits(cfg, pair_row)  # a local JSON file's rows: pair_row's, naming the line
    columns = splits[cfg.dataset_split].column_names
    missing = [name for name in PAIR if name not in columns]
    if missing:
        raise ConfigError(
            f"dataset '{cfg.dataset}' has no {' or '.join(map(repr, missing))} column: a preference "
            f"pair is a prompt, a chosen and a rejected completion (columns: {', '.join(columns)})"
        )
    return checked_splits(splits, cfg, pair_row, "pairs")


def pair_row(row: dict, where: str) -> dict:
    """One pair as conversations: the prompt's turns, and each completion's, what follows them (a
    completion that repeats the prompt's turns, as ultrafeedback_binarized's do, has them taken
    off). One line naming `where` for a missing column, a completion that is not the assistant's
    answer to the prompt, or a pair whose two completions are the same."""
    missing = [name for name in PAIR if name not in row]
    if missing:
        raise ConfigError(
            f"dataset: {where} has no {' or '.join(map(repr, missing))}: a preference pair is a "
            f"prompt, a chosen and a rejected completion (it has: {', '.join(row) or 'nothing'})"
        )
    prompt = as_messages(row["prompt"], "user", where, "prompt")
    pair = {"prompt": prompt, "where": where}
    for side in COMPLETIONS:
        messages = as_messages(row[side], "assistant", where, side)
        if messages[: len(prompt)] == prompt and len(messages) > len(prompt):
            messages = messages[len(prompt) :]
        if messages[0]["role"] != "assistant":
            roles = ", ".join(message["role"] for message in messages)
            raise ConfigError(
                f"dataset: {where}: its {side} does not answer the prompt: what follows the "
                f"prompt's turns must be the assistant's (roles: {roles})"
            )
        pair[side] = messages
    if pair["chosen"] == pair["rejected"]:
        raise ConfigError(
            f"dataset: {where}: its chosen and rejected completions are the same: a pair must differ "
            "to say which answer is preferred"
        )
    return pair


def as_messages(value, role: str, where: str, column: str) -> list[dict]:
    """A column's value as chat messages: a string is one message of `role`, a list is messages
    (chat.checked_messages: each a role and a content string), at least one (transformers'
    apply_chat_template refuses an empty conversation)."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value:
        return checked_messages(value, where)
    got = "an empty list" if value == [] else type(value).__name__
    raise ConfigError(
        f"dataset: {where}: its {column} must be a string or a list of chat messages (got {got})"
    )
