"""The chat toolkit a fork's files import, as lm.py is the causal LM's: what every example that trains
a chat model needs of its data, whatever its loss (examples/chat_sft: supervised fine-tuning;
examples/preference: DPO and its family).

    chat_tokenizer(cfg)                     the tokenizer, which must have a chat template
    render(tokenizer, messages, ...)        a conversation's tokens as the chat template writes them
    encode(messages, tokenizer)             (ids, labels): each assistant turn's tokens, the rest -100
    checked_messages / checked_conversation a conversation as the template takes it, each message's
                                            role and its content as one string (text parts joined),
                                            a bad one named in one line
    read_splits(cfg, row_of)                --dataset's splits: a local file or folder (JSON read as
                                            written, each row through the example's row_of, a bad
                                            line named) or a hub dataset
    train_and_eval(splits, cfg, noun)       the train split and the eval set, said in one line
                                            (eval_split_name: which split is the eval set, if any)
    say(line)                               a line of the data's at start-up, first process only
    end_of_turn_ids(tokenizer)              the tokens that end an assistant's turn (<|im_end|>, EOS)
    greedy(model, prompt_ids, ...)          each left-padded prompt's greedy continuation, to its
                                            end of turn (eval: generate_columns, task.py)
    up_to_the_end(completion, ends)         what counts of each completion: up to and with its end

and what a model that is tuned against a reference needs of it (examples/rl; examples/preference
has the same in its own model.py):

    frozen_copy(model)                      the reference: a frozen copy, in eval mode
    adapters_off(model) / evaluated(model)  the model with its LoRA adapters off / in eval mode, within
    weights_digest(weights)                 xxh3_64 of a state dict: what a resume must find unchanged

Nothing here knows about losses: each example's model.py does. Nothing here imports the fork's files.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

from errors import ConfigError, first_line
from lm import load_tokenizer

BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
EVAL_SPLITS = ("validation", "test")  # the first a dataset has is its eval set


def say(line: str, file=None) -> None:
    """A line of the data's at start-up, from the first process alone (`file`: sys.stdout as it is
    when called, or another stream)."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=file)  # noqa: T201 - the data's own lines, before the run's log starts


# ---------------------------------------------------------------- the tokenizer and the rendering


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


def render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """The conversation's tokens as the chat template writes them (its special tokens, BOS too)."""
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode(messages: list[dict], tokenizer) -> tuple[list[int], list[int]]:
    """(token ids, labels) of one conversation through the chat template: each assistant turn's
    tokens are its labels, everything else -100. An assistant turn is what the template adds from
    the conversation up to it with the generation prompt (`<|im_start|>assistant\\n`, masked) to
    the conversation with that turn: its content and the end of turn, which the model must learn
    to say to stop. An assistant turn that opens the conversation is not learned."""
    input_ids, labels = [], []
    for turn, message in enumerate(messages):
        # an assistant turn that opens the conversation (a greeting) has nothing before it that
        # prompts it: it is context, not learned (templates refuse to render the empty prefix)
        if message.get("role") != "assistant" or turn == 0:
            continue
        prompt = render(tokenizer, messages[:turn], add_generation_prompt=True)
        answered = render(tokenizer, messages[: turn + 1], add_generation_prompt=False)
        if prompt[: len(input_ids)] != input_ids or answered[: len(prompt)] != prompt:
            raise not_prefixes(tokenizer)
        labels += [-100] * (len(prompt) - len(input_ids)) + answered[len(prompt) :]
        input_ids = answered
    return input_ids, labels


def not_prefixes(tokenizer) -> ConfigError:
    return ConfigError(
        f"tokenizer '{tokenizer.name_or_path}': its chat template does not render a "
        "conversation turn by turn as prefixes of one another (it rewrites earlier turns), "
        "so the assistant's tokens cannot be told from the prompt's"
    )


# ---------------------------------------------------------------- checking conversations


def checked_conversation(messages, where: str) -> list[dict]:
    """checked_messages, and one turn must be the assistant's (else there is nothing to learn from
    it): one line naming `where`, at start-up."""
    conversation = checked_messages(messages, where)
    roles = [message["role"] for message in conversation]
    if "assistant" not in roles:
        raise ConfigError(
            f"dataset: {where} has no assistant turn, nothing to learn from (roles: "
            f"{', '.join(roles) or 'none'})"
        )
    if "assistant" not in roles[1:]:
        raise ConfigError(
            f"dataset: {where} has no assistant turn after its first turn, which nothing prompts: "
            f"nothing to learn from (roles: {', '.join(roles)})"
        )
    return conversation


def checked_messages(messages, where: str) -> list[dict]:
    """The messages as the chat template takes them: each one's role and its content as one string.
    Every message needs both: one line naming `where`, at start-up."""
    conversation = []
    for message in messages or []:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ConfigError(
                f"dataset: {where}: every message needs a 'role' and a 'content' string"
            )
        conversation.append({"role": message["role"], "content": text_of(message, where)})
    return conversation


def text_of(message: dict, where: str) -> str:
    """A message's content as one string: a string, or a list of text parts (OpenAI's shape,
    [{"type": "text", "text": ...}]) joined a line apart, as vLLM joins them. Any other part (an
    image) is one line: these examples train on text."""
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


# ---------------------------------------------------------------- the splits


def read_splits(cfg, row_of):
    """--dataset's splits as datasets' DatasetDict: a local file or folder (read_local; each JSON
    row as `row_of(value, where)` makes it) or a hub dataset (--dataset_config); dataset_split must
    be one of them. Anything that cannot be read is one line."""
    import datasets

    try:
        if os.path.exists(cfg.dataset):
            splits = read_local(Path(cfg.dataset), row_of)
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
    return splits


def train_and_eval(splits, cfg, noun: str):
    """(train, eval) of the splits: dataset_split, and the eval set (eval_split_name), else
    eval_fraction of dataset_split held out. The start-up says which, in one line, counting the
    eval set's rows in `noun`s ("conversation": 1 conversation, 12 conversations)."""
    train = splits[cfg.dataset_split]
    named = eval_split_name(splits, cfg)
    if named:
        held_out = splits[named]
        said = f"the {named} split of {cfg.dataset} ({counted(len(held_out), noun)})"
    else:  # a fixed split seed: changing `seed` must not move rows between the two
        split = train.train_test_split(test_size=cfg.eval_fraction, seed=0)
        train, held_out = split["train"], split["test"]
        said = (
            f"{cfg.eval_fraction * 100:g}% of {cfg.dataset}'s {cfg.dataset_split} split held out "
            f"(eval_fraction; {counted(len(held_out), noun)})"
        )
    say(f"eval set: {said}")
    return train, held_out


def counted(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def eval_split_name(splits, cfg) -> str | None:
    """The split that is the eval set, if the dataset has one: dataset_split's sibling (train_prefs:
    test_prefs, as ultrafeedback_binarized names them), else a split named validation or test."""
    siblings = [cfg.dataset_split.replace("train", name) for name in EVAL_SPLITS]
    candidates = [*siblings, *EVAL_SPLITS] if "train" in cfg.dataset_split else EVAL_SPLITS
    return next((s for s in candidates if s in splits and s != cfg.dataset_split), None)


def checked_splits(splits, cfg, row_of, noun: str) -> dict:
    """{split: rows} of the dataset_split and its eval split (if it has one), each row through
    `row_of(row, where)`, `where` naming it for later lines: its line (a local JSON file's, which
    row_of read already) or its place in the split. Only these two are read: a hub dataset may have
    other splits (ultrafeedback_binarized's _sft, _gen)."""
    checked = {}
    for name in filter(None, (cfg.dataset_split, eval_split_name(splits, cfg))):
        where = cfg.dataset if len(splits) == 1 else f"{cfg.dataset} ({name} split)"
        checked[name] = splits[name].map(
            named_row,
            with_indices=True,
            fn_kwargs={"where": where, "row_of": row_of},
            remove_columns=splits[name].column_names,
            desc=f"checking the {name} {noun}",
        )
    return checked


def named_row(row: dict, index: int, where: str, row_of) -> dict:
    return row_of(row, row.get("where") or f"{where} row {index + 1}")


# ---------------------------------------------------------------- local files


def read_local(path: Path, row_of):
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
    tables = {split: read_split(files, row_of) for split, files in found.items()}
    return datasets.DatasetDict(tables)


def read_split(files: list[Path], row_of):
    """A split's files as one table: JSON read here (json_table), CSV and Parquet by `datasets`."""
    import datasets

    if all(BUILDERS[file.suffix] == "json" for file in files):
        return json_table(files, row_of)
    builder = BUILDERS[files[0].suffix]
    return datasets.load_dataset(builder, data_files={"train": [str(f) for f in files]})["train"]


def json_table(files: list[Path], row_of):
    """JSON files' rows as one table, read with the json module (json_rows), not with datasets'
    JSON reader, which types a column by all its rows: one conversation's list of parts made it
    read another's answer "9" as the number 9. Each column is typed by its kind (row_features).
    Cached as datasets caches its own reader's tables, so what is computed from it is cached too:
    the table's key is the files' content (and row_of's code, which datasets hashes)."""
    import datasets
    import xxhash

    rows = [row for file in files for row in json_rows(file, row_of)]  # a bad row: its line, here
    shapes = {tuple((name, isinstance(value, list)) for name, value in row.items()) for row in rows}
    if len(shapes) != 1:
        columns = " and ".join(sorted("(" + ", ".join(name for name, _ in s) + ")" for s in shapes))
        raise ConfigError(
            f"dataset: {', '.join(map(str, files))} "
            + ("holds no rows" if not shapes else f"mixes rows of different columns: {columns}")
        )
    digest = xxhash.xxh3_64()
    for file in files:
        digest.update(file.read_bytes())
    return datasets.Dataset.from_generator(
        rows_of_files,
        features=row_features(rows[0]),
        gen_kwargs={
            "files": [str(f) for f in files],
            "row_of": row_of,
            "content": digest.hexdigest(),
        },
    )


def row_features(row: dict):
    """The table's columns, typed whatever JSON type a value could be read as: a string, or a
    conversation (a list of {role, content} strings), as row_of gives them."""
    from datasets import Features, Value

    message = {"role": Value("string"), "content": Value("string")}
    return Features(
        {
            name: [message] if isinstance(value, list) else Value("string")
            for name, value in row.items()
        }
    )


def rows_of_files(files: list[str], row_of, content: str):
    """datasets.Dataset.from_generator's generator (`content`, the files' digest, is only its cache
    key: datasets hashes these arguments)."""
    for file in files:
        yield from json_rows(Path(file), row_of)


def json_rows(path: Path, row_of) -> list[dict]:
    """A JSON lines file's rows (or a .json file's array's), each as `row_of(value, where)` makes
    it: strings and checked conversations, a bad one one line naming the file and the line (an
    array's: its entry)."""
    rows = []
    for where, value in json_values(path):
        if not isinstance(value, dict):
            raise ConfigError(f"dataset: {where} is a JSON {type(value).__name__}, not an object")
        rows.append(row_of(value, where))
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


# ---------------------------------------------------------------- the end of a turn


def end_of_turn_ids(tokenizer) -> set[int]:
    """The tokens that end an assistant's turn: what the template writes after a reply (its first
    special token there, e.g. <|im_end|>), and EOS. (scripts/sample.py --chat stops on the same.)"""
    replied = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
    asked = tokenizer.apply_chat_template(replied[:1], add_generation_prompt=True, tokenize=False)
    whole = tokenizer.apply_chat_template(replied, tokenize=False)
    after_reply = whole[len(asked) :].split("!", 1)[-1]
    special = set(tokenizer.all_special_ids)
    ending = [
        i for i in tokenizer(after_reply, add_special_tokens=False)["input_ids"] if i in special
    ]
    return {*ending[:1], tokenizer.eos_token_id} - {None}


# ---------------------------------------------------------------- generating


def greedy(
    model, prompt_ids, prompt_mask, ends: list[int], pad_id: int, max_new_tokens: int, processors=()
):
    """(rows, new tokens): each prompt's greedy continuation, up to max_new_tokens or its end of
    turn (then pad_id): the argmax of the logits, or of what `processors` (transformers' logits
    processors, in order) make of them (a sampler as the last makes it sampling: examples/rl).
    The prompts are left-padded (prompt_mask 0), each one's positions counted from its first
    token, as training counts them, so a prompt generates alike whatever its padding. Only these
    keys decide (the model's own generation_config, a hub model's sampling defaults, is left
    out), and under FSDP2 every rank runs as many forwards (synced_gpus)."""
    from transformers import GenerationConfig, LogitsProcessorList

    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        # every other knob neutral: the model's own generation_config fills only what is unset
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        min_p=None,
        typical_p=1.0,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        eos_token_id=ends,
        pad_token_id=pad_id,
        use_cache=True,
    )
    with without_model_defaults(model):
        output = model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),
            generation_config=config,
            logits_processor=LogitsProcessorList(processors),
            synced_gpus=sharded(model),
        )
    return output[:, prompt_ids.size(1) :]


def up_to_the_end(completion, ends: list[int]):
    """(rows, tokens) 1 for each token up to and with the first end of turn (all of them where
    none ends), 0 after."""
    import torch

    is_end = torch.isin(completion, torch.tensor(ends, device=completion.device)).long()
    ended_before = is_end.cumsum(-1) - is_end
    return (ended_before == 0).long()


@contextmanager
def without_model_defaults(model):
    """generate fills what its config leaves unset from the model's generation_config (a hub
    model's min_p, top_k, ...): within, the model has none, so the run's keys alone decide."""
    from transformers import GenerationConfig

    kept = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = kept


def sharded(model) -> bool:
    """Whether the model is sharded over several ranks (FSDP2): generate then keeps every rank's
    decode forwards in step (synced_gpus), or a rank that finished first would leave the others
    waiting in a collective."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule) and dist.is_initialized() and dist.get_world_size() > 1


# ---------------------------------------------------------------- the reference


def frozen_copy(model):
    """The reference: a copy of the model as loaded, frozen (no gradients), in eval mode."""
    import copy

    frozen = copy.deepcopy(model).eval()
    frozen.requires_grad_(False)
    return frozen


@contextmanager
def adapters_off(model):
    """Every peft LoRA layer of the model skips its adapters within (the base model alone), and is
    as it was after. Only the flag the layers read: peft's own enable_adapters(False) and
    disable_adapter() also set requires_grad False on the adapters and set_adapter True on the way
    back, which would unfreeze what the run froze or freeze what it trains."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:  # never the policy itself as its own reference: it would move with it
        raise RuntimeError(
            "the reference is the model with its LoRA adapters off (lora_r), but it has none"
        )
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, was in zip(layers, before, strict=True):
            layer._disable_adapters = was


@contextmanager
def evaluated(model):
    """The model in eval mode within (no dropout), each module's own mode back after."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def weights_digest(weights: dict) -> str:
    """xxh3_64 of the tensors, by name, with their dtypes and shapes."""
    import torch
    import xxhash

    digest = xxhash.xxh3_64()
    for name in sorted(weights):
        tensor = weights[name].detach().cpu().contiguous()
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()
