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

With packing false, each conversation is a row of its own, padded to its batch's longest (as TRL's
SFTTrainer does by default), cut to block_size too.

A split named validation (or test) is the eval set: a hub dataset's, or a local folder's by the names
`datasets` gives splits (train.jsonl and validation.jsonl, or folders train/ and validation/, or
dev, test, ...); without one, eval_fraction of the conversations. The start-up output says which, in
one line (`eval set: ...`). The eval loss is per assistant token over exactly those conversations.

JSON files are read with the json module, each value as written: each message's role and content (a
string, or OpenAI's list of parts when they are all text: joined, one line apart). A bad line is one
line naming the file and the line; a conversation that ends on a user's turn (nothing answers it)
trains all the same, said once with the count.

The rendering, the assistant masks, the reading of files and the eval set are the chat toolkit's
(train/chat.py, which examples/preference uses too); the packing and the SFT rows are this file's.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch

from chat import (
    chat_tokenizer,
    checked_conversation,
    encode,
    read_splits,
    say,
    train_and_eval,
)
from errors import ConfigError

MESSAGES = "messages"  # chat data: a list of {"role", "content"}
PROMPT, RESPONSE = "prompt", "response"  # instruction data: one exchange
COLUMNS = ("input_ids", "labels", "position_ids")


@dataclass
class DataConfig:
    """The chat data's own keys (the template joins them to its own: YAML, --flags, --help)."""

    # tokens per packed block: several conversations to a block, one longer than it is cut
    block_size: int = 1024
    # several conversations to a block_size block; false: one conversation a row, padded to its
    # batch's longest (TRL SFTTrainer's default; packing trained 1.5x the tokens/s, bench/sft_packing.py)
    packing: bool = True


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
    each (block_size,) (packing false: a conversation each, up to block_size)."""
    train, held_out = train_and_eval(load_conversations(cfg), cfg, "conversation")
    pack = functools.partial(
        pack_conversations,
        tokenizer=chat_tokenizer(cfg),
        block_size=cfg.block_size,
        packing=cfg.packing,
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
    """The model's keyword arguments. Packed blocks are all block_size long: as they are. Rows of
    one conversation (packing false) are padded to the batch's longest, the padding a sequence of
    its own (positions from 0, as a block's end is) that no label counts."""
    longest = max(len(sample["input_ids"]) for sample in samples)
    padding = {"input_ids": 0, "labels": -100}  # any id: padding is masked, attends to itself
    batch = {}
    for name in COLUMNS:
        rows = []
        for sample in samples:
            missing = longest - len(sample[name])
            if name == "position_ids":
                filler = torch.arange(missing)
            else:
                filler = torch.full((missing,), padding[name])
            rows.append(torch.cat([sample[name].long(), filler]))
        batch[name] = torch.stack(rows)
    return batch


# ---------------------------------------------------------------- conversations to blocks


def pack_conversations(rows: dict, tokenizer, block_size: int, packing: bool = True) -> dict:
    """A batch of conversations (datasets' batched map) as packed blocks, in order: a conversation
    goes whole into the current block if it fits, else starts the next one (cut to block_size if it
    alone is longer). Without packing, each conversation is a block of its own, unpadded (collate
    pads a batch). "cut" counts, per block, the conversations cut."""
    blocks = {name: [] for name in (*COLUMNS, "cut")}
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id or 0  # any id: padding is masked and attends to itself
    padded_to = block_size if packing else 0  # 0: no padding
    block = empty_block()
    for messages in conversations(rows):
        input_ids, labels = encode(messages, tokenizer)
        cut = len(input_ids) > block_size
        input_ids, labels = input_ids[:block_size], labels[:block_size]
        full = len(block["input_ids"]) + len(input_ids) > block_size
        if block["input_ids"] and (full or not packing):
            add_padded(blocks, block, padded_to, pad_id)
            block = empty_block()
        block["input_ids"] += input_ids
        block["labels"] += labels
        block["position_ids"] += list(range(len(input_ids)))
        block["cut"] += int(cut)
    if block["input_ids"]:
        add_padded(blocks, block, padded_to, pad_id)
    return blocks


def empty_block() -> dict:
    return {"input_ids": [], "labels": [], "position_ids": [], "cut": 0}


def add_padded(blocks: dict, block: dict, block_size: int, pad_id: int) -> None:
    """The block, its tail padded to block_size (if shorter) as one more sequence of its own
    (positions from 0) that nothing counts, added to the batch's blocks."""
    missing = max(0, block_size - len(block["input_ids"]))
    block["input_ids"] += [pad_id] * missing
    block["labels"] += [-100] * missing
    block["position_ids"] += list(range(missing))
    for name, values in block.items():
        blocks[name].append(values)


def conversations(rows: dict) -> list[list[dict]]:
    """The batch's conversations as message lists: a chat dataset's `messages` (each message's role
    and content, its text parts joined), or one exchange made of `prompt` and `response`."""
    if MESSAGES in rows:
        return [checked_conversation(messages, "a conversation") for messages in rows[MESSAGES]]
    return [
        [{"role": "user", "content": str(prompt)}, {"role": "assistant", "content": str(response)}]
        for prompt, response in zip(rows[PROMPT], rows[RESPONSE], strict=True)
    ]


def warn_of_cut_conversations(blocks, name: str, block_size: int) -> None:
    cut = sum(blocks["cut"])
    if cut:
        say(
            f"warning: {cut} {name} conversation(s) longer than block_size {block_size} tokens "
            f"were cut to it (their end is not trained on): raise block_size to keep them whole",
            file=sys.stderr,
        )


# ---------------------------------------------------------------- reading the conversations


@functools.cache
def load_conversations(cfg):
    """The splits, checked to hold `messages`, or `prompt` and `response`; each conversation
    checked (one line naming where), and those that end on a user's turn counted in one warning."""
    splits = read_splits(cfg, chat_row)  # a local JSON file's rows: chat_row's, naming the line
    columns = splits[cfg.dataset_split].column_names
    if MESSAGES not in columns and not {PROMPT, RESPONSE} <= set(columns):
        raise no_chat_columns(f"'{cfg.dataset}'", columns)
    if MESSAGES in columns:
        unanswered = 0
        for name, split in splits.items():
            where = cfg.dataset if len(splits) == 1 else f"split '{name}'"
            unanswered += check_turns(split[MESSAGES], where)
        if unanswered:
            say(
                f"warning: {unanswered} conversation(s) of {cfg.dataset} end on a user's turn, "
                "which nothing answers: it is not trained on (end each on the assistant's answer)",
                file=sys.stderr,
            )
    return splits


def no_chat_columns(dataset: str, columns) -> ConfigError:
    return ConfigError(
        f"dataset {dataset} has neither a '{MESSAGES}' column (chat: a list of {{role, content}}) "
        f"nor '{PROMPT}' and '{RESPONSE}' columns (columns: {', '.join(columns)})"
    )


def check_turns(all_messages: list, where: str) -> int:
    """Every conversation is checked (checked_conversation), one line naming it; returns how many
    end on a user's turn."""
    unanswered = 0
    for row, messages in enumerate(all_messages):
        conversation = checked_conversation(messages, f"{where}, conversation {row + 1}")
        unanswered += conversation[-1]["role"] == "user"
    return unanswered


def chat_row(value: dict, where: str) -> dict:
    """A JSON file's row as given (chat.read_splits reads the file): {"messages": the checked
    conversation} or {"prompt", "response"} as strings. A bad one is one line naming the file and
    the line."""
    if MESSAGES in value:
        return {MESSAGES: checked_conversation(value[MESSAGES], where)}
    if {PROMPT, RESPONSE} <= set(value):
        return {PROMPT: str(value[PROMPT]), RESPONSE: str(value[RESPONSE])}
    raise no_chat_columns(where, value)
