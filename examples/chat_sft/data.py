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
"""

from __future__ import annotations

import functools
import json
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
EVAL_SPLITS = ("validation", "test")  # the first a dataset has is its eval set
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
    splits = load_conversations(cfg)
    train = splits[cfg.dataset_split]
    named = next((s for s in EVAL_SPLITS if s in splits and s != cfg.dataset_split), None)
    if named:
        held_out = splits[named]
        said = f"the {named} split of {cfg.dataset} ({conversations_counted(held_out)})"
    else:  # a fixed split seed: changing `seed` must not move conversations
        split = train.train_test_split(test_size=cfg.eval_fraction, seed=0)
        train, held_out = split["train"], split["test"]
        said = (
            f"{cfg.eval_fraction * 100:g}% of {cfg.dataset}'s {cfg.dataset_split} split held out "
            f"(eval_fraction; {conversations_counted(held_out)})"
        )
    say(f"eval set: {said}")
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


def conversations_counted(split) -> str:
    count = len(split)
    return f"{count} conversation" if count == 1 else f"{count} conversations"


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


def say(line: str, file=sys.stdout) -> None:
    """A line of the data's at start-up, from the first process alone."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=file)  # noqa: T201 - the data's own lines, before the run's log starts


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
    """The splits, checked to hold `messages`, or `prompt` and `response`; each conversation
    checked (one line naming where), and those that end on a user's turn counted in one warning."""
    import datasets

    try:
        if os.path.exists(cfg.dataset):
            splits = read_local(Path(cfg.dataset))
        else:
            splits = datasets.load_dataset(cfg.dataset, cfg.dataset_config or None)
    except ConfigError:
        raise
    except Exception as e:  # a file that cannot be read, offline, a wrong name
        raise ConfigError(f"dataset '{cfg.dataset}' could not be read: {first_line(e)}") from None
    if cfg.dataset_split not in splits:
        raise ConfigError(
            f"dataset_split '{cfg.dataset_split}' is not a split of '{cfg.dataset}' "
            f"(splits: {', '.join(splits)})"
        )
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


def checked_conversation(messages, where: str) -> list[dict]:
    """The conversation as the chat template takes it: each message's role and its content as one
    string. Every message needs both, and one turn must be the assistant's (else there is nothing
    to learn from it): one line naming `where`, at start-up."""
    conversation = []
    for message in messages or []:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ConfigError(
                f"dataset: {where}: every message needs a 'role' and a 'content' string"
            )
        conversation.append({"role": message["role"], "content": text_of(message, where)})
    roles = [message["role"] for message in conversation]
    if "assistant" not in roles:
        raise ConfigError(
            f"dataset: {where} has no assistant turn, nothing to learn from (roles: "
            f"{', '.join(roles) or 'none'})"
        )
    return conversation


def text_of(message: dict, where: str) -> str:
    """A message's content as one string: a string, or a list of text parts (OpenAI's shape,
    [{"type": "text", "text": ...}]) joined a line apart, as vLLM joins them. Any other part (an
    image) is one line: this example trains on text."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else []
    kinds = [part.get("type") if isinstance(part, dict) else None for part in parts]
    other = next((kind for kind in kinds if kind != "text"), "text")
    if parts and other != "text":
        raise ConfigError(
            f"dataset: {where}: a message has a part of type {other!r}; chat fine-tuning here "
            "reads text alone (a content string, or parts of type 'text', which are joined)"
        )
    texts = [part.get("text") for part in parts]
    if not parts or not all(isinstance(text, str) for text in texts):
        raise ConfigError(
            f"dataset: {where}: every message needs a 'role' and a 'content' string (or a list "
            "of text parts)"
        )
    return "\n".join(texts)


# ---------------------------------------------------------------- local files


def read_local(path: Path):
    """A local file (the train split), or a folder whose files are split by the names `datasets`
    gives splits (train.jsonl, validation.jsonl, dev.csv, folders train/ and test/, ...; files
    with other names: train), as datasets' DatasetDict."""
    import datasets
    from datasets.data_files import DataFilesDict, get_data_patterns

    if path.is_file():
        found = {"train": [path]}
    elif not any(p.suffix in BUILDERS for p in path.rglob("*")):
        found = {}
    else:
        patterns = DataFilesDict.from_patterns(get_data_patterns(str(path)), base_path=str(path))
        found = {
            str(split): [Path(f) for f in files if Path(f).suffix in BUILDERS]
            for split, files in patterns.items()
        }
    found = {split: files for split, files in found.items() if files}
    if not found:
        raise ConfigError(f"dataset '{path}' holds no {', '.join(BUILDERS)} file")
    return datasets.DatasetDict({split: read_split(files) for split, files in found.items()})


def read_split(files: list[Path]):
    """A split's files as one table: JSON read here (json_table), CSV and Parquet by `datasets`."""
    import datasets

    if all(BUILDERS[file.suffix] == "json" for file in files):
        return json_table(files)
    builder = BUILDERS[files[0].suffix]
    return datasets.load_dataset(builder, data_files={"train": [str(f) for f in files]})["train"]


def json_table(files: list[Path]):
    """JSON files' rows as one table, read with the json module (json_rows), not with datasets'
    JSON reader, which types a column by all its rows: one conversation's list of parts made it
    read another's answer "9" as the number 9. Cached as datasets caches its own reader's tables,
    so the packing after it is cached too: the table's key is the files' content."""
    import datasets
    import xxhash

    rows = [row for file in files for row in json_rows(file)]  # a bad row: its line, here
    kinds = {tuple(row) for row in rows}
    if len(kinds) != 1:
        raise ConfigError(
            f"dataset: {', '.join(map(str, files))} "
            + ("holds no rows" if not kinds else "mixes chat rows with prompt/response rows")
        )
    digest = xxhash.xxh3_64()
    for file in files:
        digest.update(file.read_bytes())
    return datasets.Dataset.from_generator(
        rows_of_files,
        features=table_features(chat=MESSAGES in rows[0]),
        gen_kwargs={"files": [str(file) for file in files], "content": digest.hexdigest()},
    )


def table_features(chat: bool):
    """The table's columns, typed: strings, whatever JSON type a value could be read as."""
    from datasets import Features, Value

    if chat:
        return Features({MESSAGES: [{"role": Value("string"), "content": Value("string")}]})
    return Features({PROMPT: Value("string"), RESPONSE: Value("string")})


def rows_of_files(files: list[str], content: str):
    """datasets.Dataset.from_generator's generator (`content`, the files' digest, is only its cache
    key: datasets hashes these arguments)."""
    for file in files:
        yield from json_rows(Path(file))


def json_rows(path: Path) -> list[dict]:
    """A JSON lines file's rows (or a .json file's array's), each as given: {"messages": the
    checked conversation} or {"prompt", "response"} as strings. A bad one is one line naming the
    file and the line (an array's: its entry)."""
    rows = []
    for where, row in json_values(path):
        if isinstance(row, dict) and MESSAGES in row:
            rows.append({MESSAGES: checked_conversation(row[MESSAGES], where)})
        elif isinstance(row, dict) and {PROMPT, RESPONSE} <= set(row):
            rows.append({PROMPT: str(row[PROMPT]), RESPONSE: str(row[RESPONSE])})
        elif isinstance(row, dict):
            raise no_chat_columns(where, row)
        else:
            raise ConfigError(f"dataset: {where} is a JSON {type(row).__name__}, not an object")
    return rows


def json_values(path: Path) -> list[tuple[str, object]]:
    """(where, value) for each JSON value of the file: each line of JSON lines (blank lines
    skipped), or each entry of a .json file that holds one array."""
    text = path.read_text(encoding="utf-8-sig")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        entries = parsed(text, path)
        return [(f"{path} entry {n}", entry) for n, entry in enumerate(entries, start=1)]
    # "\n" alone ends a line of JSON lines (a string may hold a raw U+2028, which splitlines splits)
    lines = enumerate(text.split("\n"), start=1)
    return [(f"{path} line {n}", parsed(line, path, n)) for n, line in lines if line.strip()]


def parsed(text: str, path: Path, line: int = 0):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"dataset: {path} line {line or e.lineno} is not valid JSON: {e.msg} (column {e.colno})"
        ) from None
