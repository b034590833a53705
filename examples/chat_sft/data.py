"""Instruction and chat data for fine-tuning a causal LM (supervised fine-tuning, SFT), only the
assistant's tokens counted. Copy this file over train/data.py, and its model.py over train/model.py
(examples/README.md).

    chats.jsonl             {"messages": [{"role": "system", "content": "..."},
                                          {"role": "user", "content": "..."},
                                          {"role": "assistant", "content": "..."}, ...]}
    pairs.jsonl (or .csv, .json, .parquet; or a folder of them)
                            {"prompt": "...", "response": "..."}: a user turn and its answer
    owner/name              a hub dataset with either columns (--dataset_config, --dataset_split)

Each conversation goes through the tokenizer's chat template (--tokenizer; by default the --hf_model
checkpoint's own), as the model will see it when it chats. The system and user turns and the
template's own markup are masked (label -100): the loss, its gradient and the eval loss count the
assistant's tokens only, each the same weight (model.py's loss_items). Conversations are packed,
whole and in order, several to a block_size-token block; each keeps its own positions, from 0, and
the model attends within it only (Hugging Face's causal LMs build that block-diagonal mask from the
restarting position_ids). The end of a block is padding, masked too. Packing against padding each
conversation to the batch's longest: bench/sft_packing.py (packing trains 1.5x the assistant
tokens a second there, on CPU). A conversation longer than block_size is cut to it, with one warning line.

A split named validation (or test) is the eval set; without one, eval_fraction of the conversations.
The eval loss is per assistant token over exactly those conversations.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from errors import ConfigError, first_line
from lm import load_tokenizer

MESSAGES = "messages"  # chat data: a list of {"role", "content"}
PROMPT, RESPONSE = "prompt", "response"  # instruction data: one exchange
BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
COLUMNS = ("input_ids", "labels", "position_ids")


@dataclass
class DataConfig:
    """The chat data's own keys (the template joins them to its own: YAML, --flags, --help)."""

    # tokens per packed block: several conversations to a block, one longer than it is cut
    block_size: int = 1024


def check_config(cfg) -> None:
    """The data's keys, at start-up: one line naming the key."""
    if not cfg.dataset:
        raise ConfigError(
            "dataset: pass --dataset, chat JSON lines or prompt/response rows (a file, a folder, or a "
            "hub name)"
        )
    if cfg.block_size <= 0:
        raise ConfigError(f"block_size must be > 0 (got {cfg.block_size!r})")


def build_datasets(cfg):
    """(train, eval): map-style datasets of packed blocks {"input_ids", "labels", "position_ids"},
    each (block_size,)."""
    splits = load_conversations(cfg)
    train = splits[cfg.dataset_split]
    held_out = next((splits[s] for s in ("validation", "test") if s in splits), None)
    if held_out is None:  # a fixed split seed: changing `seed` must not move conversations
        split = train.train_test_split(test_size=cfg.eval_fraction, seed=0)
        train, held_out = split["train"], split["test"]
    pack = functools.partial(
        pack_conversations, tokenizer=chat_tokenizer(cfg), block_size=cfg.block_size
    )
    packed = {}
    for name, part in (("train", train), ("eval", held_out)):
        blocks = part.map(
            pack,
            batched=True,
            remove_columns=part.column_names,
            desc=f"packing {name} conversations",
        )
        warn_of_cut_conversations(blocks, name, cfg.block_size)
        packed[name] = blocks.select_columns(list(COLUMNS)).with_format("torch")
    return packed["train"], packed["eval"]


def collate(samples: list[dict]) -> dict:
    """The model's keyword arguments: the blocks as they are (fixed length: nothing to pad)."""
    return {name: torch.stack([sample[name] for sample in samples]).long() for name in COLUMNS}


# ---------------------------------------------------------------- conversations to blocks


def pack_conversations(rows: dict, tokenizer, block_size: int) -> dict:
    """A batch of conversations (datasets' batched map) as packed blocks, in order: a conversation
    goes whole into the current block if it fits, else starts the next one (cut to block_size if it
    alone is longer). "cut" counts, per block, the conversations cut."""
    blocks = {name: [] for name in (*COLUMNS, "cut")}
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id or 0  # any id: padding is masked and attends to itself
    block = empty_block()
    for messages in conversations(rows):
        input_ids, labels = encode(messages, tokenizer)
        cut = len(input_ids) > block_size
        input_ids, labels = input_ids[:block_size], labels[:block_size]
        if len(block["input_ids"]) + len(input_ids) > block_size:
            add_padded(blocks, block, block_size, pad_id)
            block = empty_block()
        block["input_ids"] += input_ids
        block["labels"] += labels
        block["position_ids"] += list(range(len(input_ids)))
        block["cut"] += int(cut)
    if block["input_ids"]:
        add_padded(blocks, block, block_size, pad_id)
    return blocks


def empty_block() -> dict:
    return {"input_ids": [], "labels": [], "position_ids": [], "cut": 0}


def add_padded(blocks: dict, block: dict, block_size: int, pad_id: int) -> None:
    """The block, its tail padded as one more sequence of its own (positions from 0) that nothing
    counts, added to the batch's blocks."""
    missing = block_size - len(block["input_ids"])
    block["input_ids"] += [pad_id] * missing
    block["labels"] += [-100] * missing
    block["position_ids"] += list(range(missing))
    for name, values in block.items():
        blocks[name].append(values)


def encode(messages: list[dict], tokenizer) -> tuple[list[int], list[int]]:
    """(token ids, labels) of one conversation through the chat template: each assistant turn's
    tokens are its labels, everything else -100. An assistant turn is what the template adds from
    the conversation up to it with the generation prompt (`<|im_start|>assistant\\n`, masked) to
    the conversation with that turn: its content and the end of turn, which the model must learn
    to say to stop."""
    input_ids, labels = [], []
    for turn, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = render(tokenizer, messages[:turn], add_generation_prompt=True)
        answered = render(tokenizer, messages[: turn + 1], add_generation_prompt=False)
        if prompt[: len(input_ids)] != input_ids or answered[: len(prompt)] != prompt:
            raise ConfigError(
                f"tokenizer '{tokenizer.name_or_path}': its chat template does not render a "
                "conversation turn by turn as prefixes of one another (it rewrites earlier turns), "
                "so the assistant's tokens cannot be told from the prompt's"
            )
        labels += [-100] * (len(prompt) - len(input_ids)) + answered[len(prompt) :]
        input_ids = answered
    return input_ids, labels


def render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """The conversation's tokens as the chat template writes them (its special tokens, BOS too)."""
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def conversations(rows: dict) -> list[list[dict]]:
    """The batch's conversations as message lists: a chat dataset's `messages`, or one exchange made
    of `prompt` and `response`."""
    if MESSAGES in rows:
        return [list(messages or []) for messages in rows[MESSAGES]]
    return [
        [{"role": "user", "content": str(prompt)}, {"role": "assistant", "content": str(response)}]
        for prompt, response in zip(rows[PROMPT], rows[RESPONSE], strict=True)
    ]


def warn_of_cut_conversations(blocks, name: str, block_size: int) -> None:
    cut = sum(blocks["cut"])
    if cut and os.environ.get("RANK", "0") == "0":
        print(  # noqa: T201 - the data's warning, from the first process
            f"warning: {cut} {name} conversation(s) longer than block_size {block_size} tokens "
            f"were cut to it (their end is not trained on): raise block_size to keep them whole",
            file=sys.stderr,
        )


# ---------------------------------------------------------------- reading the conversations


def chat_tokenizer(cfg):
    """The tokenizer, which must have a chat template: the conversations are rendered as the model
    will see them when it chats."""
    tokenizer = load_tokenizer(cfg.tokenizer_name)
    if tokenizer is None:
        raise ConfigError(
            "tokenizer: chat fine-tuning needs a Hugging Face tokenizer with a chat template: pass "
            "--hf_model CHECKPOINT (its own tokenizer) or --tokenizer NAME_OR_FOLDER"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"tokenizer '{cfg.tokenizer_name}' has no chat template to render conversations with "
            "(an instruct or chat checkpoint has one; a base model's tokenizer often not: set "
            "tokenizer.chat_template and save it, or use the instruct checkpoint's tokenizer)"
        )
    return tokenizer


@functools.cache
def load_conversations(cfg):
    """The splits, checked to hold `messages`, or `prompt` and `response`."""
    import datasets

    try:
        if os.path.exists(cfg.dataset):
            path = Path(cfg.dataset)
            files = (
                [path]
                if path.is_file()
                else sorted(p for p in path.rglob("*") if p.suffix in BUILDERS)
            )
            builder = BUILDERS.get(files[0].suffix) if files else None
            if builder is None:
                raise ConfigError(f"dataset '{cfg.dataset}' holds no {', '.join(BUILDERS)} file")
            splits = datasets.load_dataset(builder, data_files={"train": [str(f) for f in files]})
        else:
            splits = datasets.load_dataset(cfg.dataset, cfg.dataset_config or None)
    except ConfigError:
        raise
    except Exception as e:  # a malformed file, offline, a wrong name
        raise ConfigError(f"dataset '{cfg.dataset}' could not be read: {first_line(e)}") from None
    if cfg.dataset_split not in splits:
        raise ConfigError(
            f"dataset_split '{cfg.dataset_split}' is not a split of '{cfg.dataset}' "
            f"(splits: {', '.join(splits)})"
        )
    columns = splits[cfg.dataset_split].column_names
    if MESSAGES not in columns and not {PROMPT, RESPONSE} <= set(columns):
        raise ConfigError(
            f"dataset '{cfg.dataset}' has neither a '{MESSAGES}' column (chat: a list of "
            f"{{role, content}}) nor '{PROMPT}' and '{RESPONSE}' columns (columns: "
            f"{', '.join(columns)})"
        )
    if MESSAGES in columns:
        for name, split in splits.items():
            check_turns(split[MESSAGES], cfg.dataset if len(splits) == 1 else f"split '{name}'")
    return splits


def check_turns(all_messages: list, where: str) -> None:
    """Every conversation has an assistant turn (else there is nothing to learn from it), and every
    turn a role and a content: one line naming the conversation, at start-up."""
    for row, messages in enumerate(all_messages):
        roles = [
            message.get("role") if isinstance(message, dict) else None for message in messages or []
        ]
        if None in roles or not all(isinstance(m.get("content"), str) for m in messages):
            raise ConfigError(
                f"dataset: {where}, conversation {row + 1}: every message needs a 'role' and a "
                "'content' string"
            )
        if "assistant" not in roles:
            raise ConfigError(
                f"dataset: {where}, conversation {row + 1} has no assistant turn, nothing to learn "
                f"from (roles: {', '.join(roles) or 'none'})"
            )
