"""Prompts with reference answers, for reinforcement learning with verifiable rewards (GRPO, DAPO,
Dr. GRPO: model.py). Copy this file over train/data.py, and its model.py over train/model.py
(README "RL with verifiable rewards").

    prompts.jsonl (or .json; .csv, .parquet: strings; or a folder: train.jsonl, validation.jsonl)
        {"prompt": "sort: river alpha", "answer": "alpha river"}          a user's turn, its answer
        {"messages": [{"role": "system", ...}, {"role": "user", ...}],
         "answer": "..."}                                                  a chat ending on the user
        {"prompt": [{"role": "user", "content": "..."}], "answer": ...}   the same, TRL's shape
    owner/name  a hub dataset with those columns (--dataset_config, --dataset_split)

The answer is whatever the reward functions compare a completion with (model.py: e.g. exact_answer
(completion, answer)): a string (a JSON number is read as its text). Each prompt goes through the
tokenizer's chat template with the generation prompt (`<|im_start|>assistant\\n`), read as chat.py
reads chats (text parts joined; JSON lines as written, a bad line named). The model generates the
completions itself (model.py's rollout): a row holds the prompt's tokens and its answer, nothing to
train on yet. python scripts/sort_words_task.py OUT writes a task a tiny model learns on CPU.

A split named validation or test (or dataset_split's sibling) is the eval set, else eval_fraction of
the prompts, held out with a fixed seed; the start-up says which.

collate pads a batch's prompts on the left (generation continues each from its last token):
prompt_ids and prompt_mask, (prompts, longest); answer_bytes, each answer's UTF-8 bytes padded with
-1, (prompts, longest answer): the template moves a batch's tensors to the device, and the rewards
read the answers back as text; and prompt_index, (prompts,), each prompt's position in its split
(0, 1, ... in the order read, after the eval set is held out): the prompt's identity, from which
model.py seeds its completions (rollout_seed), so a prompt samples alike whatever rank, micro-batch
or row it lands in. One row twice in one step would sample alike both times (the template's steps
never hold a row twice: each is a slice of one epoch's permutation); two rows of the same text are
two indices, sampled independently.

Bad input is one line at start-up (check_config, before any process group): a dataset without an
answer column or without a prompt or messages column (naming the columns there are), a chat that
does not end on the user's turn, and the longest prompt with max_new_tokens beyond the model's
positions (naming the prompt).
"""

from __future__ import annotations

import functools

import torch

from chat import (
    chat_tokenizer,
    checked_messages,
    checked_splits,
    read_splits,
    render,
    train_and_eval,
)
from errors import ConfigError

COLUMNS = ("prompt_ids", "answer_bytes", "prompt_index")  # a row, tokenized


def check_config(cfg) -> None:
    """The data's checks, at start-up: the dataset is given and holds prompts and answers, and the
    longest prompt leaves room for max_new_tokens within the model's positions (one line each)."""
    if not cfg.dataset:
        raise ConfigError(
            "dataset: pass --dataset, prompts with a prompt (or messages) and an answer column (a "
            "JSON lines file or a folder: python scripts/sort_words_task.py OUT writes one)"
        )
    train, held_out = tokenized(prompts_key(cfg))
    check_room(cfg, train, held_out)


def check_room(cfg, *parts) -> None:
    """The longest prompt and max_new_tokens fit the model's positions (its config's
    max_position_embeddings): else generation would run past them."""
    from transformers import AutoConfig

    positions = getattr(AutoConfig.from_pretrained(cfg.hf_model), "max_position_embeddings", None)
    if positions is None:
        return
    longest, where = max(length for part in parts for length in part.lengths)
    if longest + cfg.max_new_tokens > positions:
        room = positions - longest
        fix = f"lower max_new_tokens to {room} or" if room > 0 else "the prompt alone fills them:"
        raise ConfigError(
            f"max_new_tokens: {cfg.max_new_tokens} after the longest prompt ({where}: {longest} "
            f"tokens) is {longest + cfg.max_new_tokens} positions, beyond the model's "
            f"{positions}: {fix} shorten the prompt"
        )


def build_datasets(cfg):
    """(train, eval): map-style datasets of prompts, each {prompt_ids, answer_bytes, prompt_index},
    unpadded."""
    train, held_out = tokenized(prompts_key(cfg))
    return train.rows, held_out.rows


def collate(samples: list[dict]) -> dict:
    """The rollout's keyword arguments: prompt_ids left-padded with 0 (prompt_mask 0 there),
    answer_bytes right-padded with -1, and each prompt's prompt_index."""
    longest = max(len(sample["prompt_ids"]) for sample in samples)
    longest_answer = max(len(sample["answer_bytes"]) for sample in samples)
    ids, mask, answers = [], [], []
    for sample in samples:
        prompt = torch.as_tensor(sample["prompt_ids"], dtype=torch.long)
        missing = longest - len(prompt)
        ids.append(torch.cat([torch.zeros(missing, dtype=torch.long), prompt]))
        mask.append(torch.cat([torch.zeros(missing, dtype=torch.long), torch.ones_like(prompt)]))
        answer = torch.as_tensor(sample["answer_bytes"], dtype=torch.long)
        filler = torch.full((longest_answer - len(answer),), -1, dtype=torch.long)
        answers.append(torch.cat([answer, filler]))
    return {
        "prompt_ids": torch.stack(ids),
        "prompt_mask": torch.stack(mask),
        "answer_bytes": torch.stack(answers),
        "prompt_index": torch.tensor([int(sample["prompt_index"]) for sample in samples]),
    }


# ---------------------------------------------------------------- reading and tokenizing


class Part:
    """A split's prompts as the template takes them (rows), and each prompt's token count with
    where it is (lengths), for the start-up's check of room."""

    def __init__(self, rows, lengths):
        self.rows = rows
        self.lengths = lengths


def prompts_key(cfg) -> tuple:
    """What the prompts depend on, of the config: the read is cached by it (the config itself
    changes after the checks, when the run folder is settled)."""
    return (
        cfg.dataset,
        cfg.dataset_config,
        cfg.dataset_split,
        cfg.eval_fraction,
        cfg.tokenizer_name,
    )


@functools.cache
def tokenized(key: tuple) -> tuple[Part, Part]:
    """(train, eval) Parts: each prompt through the chat template with the generation prompt, each
    answer as UTF-8 bytes, each row's position in its split as its prompt_index."""
    cfg = Key(*key)
    train, held_out = train_and_eval(load_prompts(cfg), cfg, "prompt")
    tokenizer = chat_tokenizer(cfg)
    parts = []
    for name, part in (("train", train), ("eval", held_out)):
        rows = part.map(
            encode_prompt,
            fn_kwargs={"tokenizer": tokenizer},
            desc=f"tokenizing {name} prompts",
        )
        rows = rows.add_column("prompt_index", list(range(len(rows))))
        lengths = [
            (len(ids), where) for ids, where in zip(rows["prompt_ids"], rows["where"], strict=True)
        ]
        parts.append(Part(rows.select_columns(list(COLUMNS)), lengths))
    return parts[0], parts[1]


class Key:
    """The config's keys the reading uses (prompts_key), as chat.py's functions read them."""

    def __init__(self, dataset, dataset_config, dataset_split, eval_fraction, tokenizer_name):
        self.dataset = dataset
        self.dataset_config = dataset_config
        self.dataset_split = dataset_split
        self.eval_fraction = eval_fraction
        self.tokenizer_name = tokenizer_name


def encode_prompt(row: dict, tokenizer) -> dict:
    """A prompt's tokens through the chat template, the assistant's turn begun; its answer's bytes."""
    return {
        "prompt_ids": render(tokenizer, row["prompt"], add_generation_prompt=True),
        "answer_bytes": list(row["answer"].encode("utf-8")),
    }


def load_prompts(cfg):
    """The dataset_split and its eval split (if it has one) as {prompt: messages, answer, where},
    each checked (prompt_row), `where` naming the row for later lines."""
    splits = read_splits(cfg, prompt_row)  # a local JSON file's rows: prompt_row's, naming the line
    columns = splits[cfg.dataset_split].column_names
    if "answer" not in columns or not {"prompt", "messages"} & set(columns):
        missing = "'answer'" if "answer" not in columns else "'prompt' or 'messages'"
        raise ConfigError(
            f"dataset '{cfg.dataset}' has no {missing} column: RL with verifiable rewards needs "
            f"prompts and the answers the rewards check (columns: {', '.join(columns)})"
        )
    return checked_splits(splits, cfg, prompt_row, "prompts")


def prompt_row(row: dict, where: str) -> dict:
    """One prompt as a conversation that ends on the user's turn, and its answer as a string. One
    line naming `where` for a missing column or a chat that does not end on the user's turn."""
    if "answer" not in row or not ("prompt" in row or "messages" in row):
        raise ConfigError(
            f"dataset: {where} needs an 'answer' and a 'prompt' (or 'messages'): the prompt the "
            f"model answers and the answer the rewards check (it has: {', '.join(row) or 'nothing'})"
        )
    value = row["prompt"] if "prompt" in row else row["messages"]
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list) and value:
        messages = checked_messages(value, where)
    else:
        raise ConfigError(f"dataset: {where}: its prompt must be a string or a list of messages")
    if messages[-1]["role"] != "user":
        raise ConfigError(
            f"dataset: {where}: its prompt ends on the {messages[-1]['role']}'s turn, not the "
            "user's: the model answers the last turn"
        )
    answer = row["answer"]
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise ConfigError(
            f"dataset: {where}: its answer must be a string or a number (got "
            f"{type(answer).__name__})"
        )
    return {"prompt": messages, "answer": str(answer), "where": where}
