"""chat.py's helpers one by one, in one process: the lines the examples' data say and refuse with, the
splits a dataset's eval set is found in, JSON read as the examples read it, the end of a completion, and
the model context managers (their values worked by hand). Through the examples' own data.py:
tests/test_example_data.py, tests/test_preference.py, tests/test_rl.py."""

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import chat
from conftest import END_OF_TURN_ONLY_WITHOUT_A_PROMPT
from errors import ConfigError


def refused(function, *args) -> str:
    with pytest.raises(ConfigError) as error:
        function(*args)
    return str(error.value)


def test_the_data_s_lines_come_from_the_first_process_alone(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    chat.say("said alone")
    monkeypatch.setenv("RANK", "0")
    chat.say("said by rank 0")
    monkeypatch.setenv("RANK", "1")
    chat.say("not said")
    assert capsys.readouterr().out == "said alone\nsaid by rank 0\n"


def test_counted_nouns_take_an_s_except_one():
    assert [chat.counted(n, "pair") for n in (0, 1, 2)] == ["0 pairs", "1 pair", "2 pairs"]


@pytest.mark.parametrize(
    "split, splits, eval_split",
    [
        ("train", ("train", "validation", "test"), "validation"),
        ("train", ("train", "test"), "test"),
        ("train", ("train",), None),
        ("train_prefs", ("train_prefs", "test_prefs", "validation"), "test_prefs"),
        ("train_prefs", ("train_prefs", "validation_prefs", "test_prefs"), "validation_prefs"),
        ("train_prefs", ("train_prefs", "test"), "test"),
        ("dev", ("dev", "validation"), "validation"),
        ("validation", ("validation", "test"), "test"),
        ("validation", ("validation",), None),
    ],
)
def test_the_eval_split_is_the_sibling_then_validation_then_test(split, splits, eval_split):
    cfg = SimpleNamespace(dataset_split=split)
    assert chat.eval_split_name(dict.fromkeys(splits), cfg) == eval_split


def test_a_row_is_named_by_its_line_or_its_place():
    def row_of(row, where):
        return {"where": where}

    assert chat.named_row({"where": "a.jsonl line 7"}, 3, "hub/x", row_of) == {
        "where": "a.jsonl line 7"
    }
    assert chat.named_row({"text": "hi"}, 3, "hub/x (train split)", row_of) == {
        "where": "hub/x (train split) row 4"
    }


def test_messages_are_checked_and_their_text_parts_joined_a_line_apart():
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    messages = [
        {"role": "user", "content": parts, "name": "dropped"},
        {"role": "assistant", "content": "three"},
    ]
    assert chat.checked_conversation(messages, "x line 1") == [
        {"role": "user", "content": "one\ntwo"},
        {"role": "assistant", "content": "three"},
    ]
    needs = "dataset: x line 1: every message needs a 'role' and a 'content' string"
    for bad in ([["user", "hi"]], [{"content": "hi"}], [{"role": 1, "content": "hi"}]):
        assert refused(chat.checked_messages, bad, "x line 1") == needs
    for content in (9, None, [], [{"type": "text", "text": 9}], [{"type": "text"}]):
        assert refused(
            chat.checked_messages, [{"role": "user", "content": content}], "x line 1"
        ) == (needs + " (or a list of text parts)")
    image = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": "a.png"}]
    assert refused(chat.checked_messages, [{"role": "user", "content": image}], "x line 1") == (
        "dataset: x line 1: a message has a part of type 'image_url'; chat fine-tuning here reads "
        "text alone (a content string, or parts of type 'text', which are joined)"
    )
    assert refused(chat.checked_messages, [{"role": "user", "content": ["raw"]}], "x line 1") == (
        "dataset: x line 1: a message has a part of type None; chat fine-tuning here reads text "
        "alone (a content string, or parts of type 'text', which are joined)"
    )
    assert chat.checked_messages(None, "x line 1") == []
    assert refused(chat.checked_conversation, [{"role": "user", "content": "hi"}], "x line 2") == (
        "dataset: x line 2 has no assistant turn, nothing to learn from (roles: user)"
    )
    assert refused(chat.checked_conversation, [], "x line 3") == (
        "dataset: x line 3 has no assistant turn, nothing to learn from (roles: none)"
    )
    system_and_user = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    assert refused(chat.checked_conversation, system_and_user, "x line 4") == (
        "dataset: x line 4 has no assistant turn, nothing to learn from (roles: system, user)"
    )
    greeting_only = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]
    assert refused(chat.checked_conversation, greeting_only, "x line 5") == (
        "dataset: x line 5 has no assistant turn after its first turn, which nothing prompts: "
        "nothing to learn from (roles: assistant, user)"
    )


def test_json_lines_and_arrays_are_read_value_by_value_with_where_each_one_is(tmp_path):
    lines = tmp_path / "rows.jsonl"
    # a BOM, a blank line, a raw U+2028 inside a string (one line of JSON lines, not two)
    lines.write_text('\ufeff{"a": "x"}\n\n{"a": "y\u2028z"}\n', encoding="utf-8")
    assert chat.json_values(lines) == [
        (f"{lines} line 1", {"a": "x"}),
        (f"{lines} line 3", {"a": "y\u2028z"}),
    ]
    array = tmp_path / "rows.json"
    array.write_text('  [{"a": 1}, {"a": 2}]')
    assert chat.json_values(array) == [
        (f"{array} entry 1", {"a": 1}),
        (f"{array} entry 2", {"a": 2}),
    ]
    one_object = tmp_path / "one.json"
    one_object.write_text('{"a": 1}\n')
    assert chat.json_values(one_object) == [(f"{one_object} line 1", {"a": 1})]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{"a": \n')
    assert refused(chat.json_values, bad) == (
        f"dataset: {bad} line 2 is not valid JSON: Expecting value (column 7)"
    )
    bad_array = tmp_path / "bad.json"
    bad_array.write_text('[{"a": 1},\n {"a" 2}]')
    assert refused(chat.json_values, bad_array) == (
        f"dataset: {bad_array} line 2 is not valid JSON: Expecting ':' delimiter (column 7)"
    )
    listed = tmp_path / "listed.jsonl"
    listed.write_text('{"a": 1}\n[1, 2]\n')
    assert refused(chat.json_rows, listed, lambda value, where: value) == (
        f"dataset: {listed} line 2 is a JSON list, not an object"
    )
    assert chat.json_rows(lines, lambda value, where: {"where": where, **value}) == [
        {"where": f"{lines} line 1", "a": "x"},
        {"where": f"{lines} line 3", "a": "y\u2028z"},
    ]


def test_json_files_whose_rows_differ_or_hold_none_are_one_line(tmp_path):
    def row_of(value, where):
        return value

    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"prompt": "a", "answer": "b"}\n{"prompt": "c"}\n')
    assert refused(chat.json_table, [mixed], row_of) == (
        f"dataset: {mixed} mixes rows of different columns: (prompt) and (prompt, answer)"
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    other = tmp_path / "other.jsonl"
    other.write_text("")
    assert refused(chat.json_table, [empty, other], row_of) == (
        f"dataset: {empty}, {other} holds no rows"
    )
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "notes.txt").write_text("x")
    assert refused(chat.read_local, folder, row_of) == (
        f"dataset '{folder}' holds no .csv, .json, .jsonl, .parquet file"
    )


def test_a_json_table_s_columns_are_strings_and_conversations(tmp_path):
    from datasets import Features, Value

    features = chat.row_features({"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    message = {"role": Value("string"), "content": Value("string")}
    assert features == Features({"prompt": Value("string"), "messages": [message]})
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a", "answer": "9"}\n{"prompt": "b", "answer": "x"}\n')
    table = chat.read_local(rows, lambda value, where: value)
    assert list(table) == ["train"]
    assert table["train"].to_list() == [
        {"prompt": "a", "answer": "9"},
        {"prompt": "b", "answer": "x"},
    ]


def test_a_split_that_is_not_there_or_data_that_cannot_be_read_is_one_line(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a"}\n')
    cfg = SimpleNamespace(dataset=str(rows), dataset_config="", dataset_split="test")
    assert refused(chat.read_splits, cfg, lambda value, where: value) == (
        f"dataset_split 'test' is not a split of '{rows}' (splits: train)"
    )
    cfg.dataset_split = "train"
    assert chat.read_splits(cfg, lambda value, where: value)["train"].to_list() == [{"prompt": "a"}]
    table = tmp_path / "rows.csv"
    table.write_bytes(b'prompt\n"unclosed\n')
    cfg.dataset = str(table)
    assert refused(chat.read_splits, cfg, lambda value, where: value).startswith(
        f"dataset '{table}' could not be read: "
    )


def test_the_completion_counts_up_to_and_with_its_first_end_of_turn():
    completion = torch.tensor([[5, 2, 7, 2], [5, 5, 5, 5], [3, 5, 9, 9]])
    assert chat.up_to_the_end(completion, [2, 3]).tolist() == [
        [1, 1, 0, 0],
        [1, 1, 1, 1],
        [1, 0, 0, 0],
    ]


def test_generation_defaults_are_set_aside_within_and_back_after_even_on_an_error():
    from transformers import GenerationConfig

    own = GenerationConfig(top_k=7, min_p=0.2)
    model = SimpleNamespace(generation_config=own)
    with chat.without_model_defaults(model):
        assert model.generation_config.top_k == GenerationConfig().top_k
        assert model.generation_config.min_p is None
    assert model.generation_config is own
    with pytest.raises(OSError), chat.without_model_defaults(model):
        raise OSError("disk")
    assert model.generation_config is own
    assert chat.sharded(nn.Linear(2, 2)) is False


def gpt2_of_learned_positions():
    """A tiny GPT-2 from a config (offline), in float64: learned positions, so a prompt whose
    positions are shifted generates other tokens (a rotary model sees only relative positions)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=40, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config).double().eval()


def greedy_by_hand(model, prompt: list[int], end: int, max_new_tokens: int) -> list[int]:
    """The test's own greedy decode of one prompt, alone: no padding, no cache, positions 0, 1, ...
    (the model's own default), the argmax token by token, up to and with the end."""
    new = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([prompt + new])).logits
            new.append(int(logits[0, -1].argmax()))
            if new[-1] == end:
                break
    return new


PROMPTS = [[5, 17, 9], [7, 3, 29, 12, 18, 27, 33], [11, 4, 38, 21, 6]]  # left-padded: 4, 0, 2 pads


def greedy_of_padded(model, end: int, pad: int, max_new_tokens: int) -> list[list[int]]:
    """chat.greedy on PROMPTS as one left-padded batch, each row up to and with its end."""
    longest = max(map(len, PROMPTS))
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in PROMPTS])
    with torch.no_grad():
        said = chat.greedy(model, ids, mask, [end], pad, max_new_tokens).tolist()
    return [row[: row.index(end) + 1] if end in row else row for row in said]


def test_greedy_on_a_left_padded_batch_is_each_prompt_s_own_argmax_from_position_0():
    model = gpt2_of_learned_positions()
    by_hand = [greedy_by_hand(model, prompt, end=0, max_new_tokens=8) for prompt in PROMPTS]
    assert len({tuple(tokens) for tokens in by_hand}) == 3  # the prompts decode differently
    assert greedy_of_padded(model, end=0, pad=1, max_new_tokens=8) == by_hand
    # an end of turn each prompt says: greedy stops there (its row padded after)
    end = by_hand[1][2]
    by_hand = [greedy_by_hand(model, prompt, end=end, max_new_tokens=8) for prompt in PROMPTS]
    assert greedy_of_padded(model, end=end, pad=1, max_new_tokens=8) == by_hand


def test_greedy_pads_each_row_after_its_end_and_stops_when_every_row_has_ended():
    """The whole output: each row its own argmax tokens up to and with its first end of turn
    (any of `ends`), then pad_id; as long as the longest row, max_new_tokens if one never ends."""
    model = gpt2_of_learned_positions()
    pad, width = 1, max(map(len, PROMPTS))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    alone = [greedy_by_hand(model, prompt, end=-1, max_new_tokens=5) for prompt in PROMPTS]
    firsts = [tokens[0] for tokens in alone]
    assert len(set(firsts)) == 3  # each row says its own first token
    for ends in (firsts[1:], firsts):  # the first row never ends / every row ends at once
        expected = []
        for tokens in alone:
            ended = next((k for k, token in enumerate(tokens) if token in ends), None)
            expected.append(tokens if ended is None else tokens[: ended + 1])
        longest = max(map(len, expected))
        expected = [tokens + [pad] * (longest - len(tokens)) for tokens in expected]
        with torch.no_grad():
            assert chat.greedy(model, ids, mask, ends, pad, 5).tolist() == expected
    assert longest == 1


def test_greedy_decodes_with_the_key_value_cache_even_when_training_turned_it_off():
    """The examples build their models with config.use_cache False (training); generate is asked
    for the cache itself: after the prompts' forward, each forward reads one new token."""
    model = gpt2_of_learned_positions()
    model.config.use_cache = False
    widths = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].size(1)), with_kwargs=True
    )
    ids = torch.tensor([[5, 17, 9, 21]])
    with torch.no_grad():
        said = chat.greedy(model, ids, torch.ones_like(ids), [39], 1, max_new_tokens=4)
    assert widths == [4] + [1] * (said.size(1) - 1)


def test_greedy_is_the_plain_argmax_whatever_the_model_s_generation_config_says():
    """A hub model's generation_config (here: suppress the first token greedy says, penalise
    repeats) is set aside: greedy is still the test's own argmax, and the config is back after."""
    from transformers import GenerationConfig

    model = gpt2_of_learned_positions()
    by_hand = [greedy_by_hand(model, prompt, end=0, max_new_tokens=8) for prompt in PROMPTS]
    own = GenerationConfig(suppress_tokens=[by_hand[0][0]], repetition_penalty=5.0)
    model.generation_config = own
    assert greedy_of_padded(model, end=0, pad=1, max_new_tokens=8) == by_hand
    assert model.generation_config is own


def test_a_sharded_model_generates_with_synced_gpus(monkeypatch):
    """Under FSDP2 (sharded: here forced) generate keeps every rank's forwards in step."""
    asked = []

    def generate(input_ids, **kwargs):
        asked.append(kwargs)
        return torch.cat([input_ids, torch.zeros(len(input_ids), 2, dtype=torch.long)], -1)

    model = SimpleNamespace(generation_config=None, generate=generate)
    ids = torch.tensor([[3, 4]])
    for sharded in (True, False):
        # whether the model generating is sharded: asked of that model
        monkeypatch.setattr(
            chat, "sharded", lambda asked, sharded=sharded: asked is model and sharded
        )
        assert chat.greedy(model, ids, torch.ones_like(ids), [0], 1, 2).tolist() == [[0, 0]]
    assert [kwargs["synced_gpus"] for kwargs in asked] == [True, False]


def test_the_reference_is_a_frozen_copy_in_eval_mode_and_the_model_is_untouched():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)).train()
    frozen = chat.frozen_copy(model)
    assert not frozen.training and not frozen[1].training
    assert not any(p.requires_grad for p in frozen.parameters())
    assert model.training and all(p.requires_grad for p in model.parameters())
    assert torch.equal(frozen[0].weight, model[0].weight)
    assert frozen[0].weight.data_ptr() != model[0].weight.data_ptr()


def test_evaluated_puts_every_module_in_eval_and_gives_each_its_own_mode_back():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    model.train()
    model[0].eval()  # one child already in eval mode
    with pytest.raises(OSError), chat.evaluated(model):
        assert [m.training for m in model.modules()] == [False, False, False]
        raise OSError("disk")
    assert [m.training for m in model.modules()] == [True, False, True]


def test_adapters_are_switched_off_within_and_as_they_were_after():
    from peft import LoraConfig, inject_adapter_in_model

    with pytest.raises(RuntimeError) as none:
        with chat.adapters_off(nn.Sequential(nn.Linear(2, 2))):
            pass
    assert str(none.value) == (
        "the reference is the model with its LoRA adapters off (lora_r), but it has none"
    )
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    inject_adapter_in_model(LoraConfig(r=1, target_modules=["0", "1"]), model)
    model[1]._disable_adapters = True  # one already off
    with chat.adapters_off(model):
        assert model[0]._disable_adapters and model[1]._disable_adapters
    assert (model[0]._disable_adapters, model[1]._disable_adapters) == (False, True)
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)


def test_the_weights_digest_is_xxh3_of_names_dtypes_shapes_and_bytes_in_name_order():
    import xxhash

    weights = {"w": torch.tensor([1.0]), "b": torch.tensor([2, 3], dtype=torch.int16)}
    by_hand = xxhash.xxh3_64()
    by_hand.update(b"b torch.int16 (2,)")
    by_hand.update(struct.pack("<hh", 2, 3))
    by_hand.update(b"w torch.float32 (1,)")
    by_hand.update(struct.pack("<f", 1.0))
    assert chat.weights_digest(weights) == by_hand.hexdigest()
    assert chat.weights_digest(dict(reversed(weights.items()))) == by_hand.hexdigest()
    transposed = {"w": torch.arange(6.0).reshape(2, 3).t()}  # not contiguous: read in its order
    assert chat.weights_digest(transposed) == chat.weights_digest(
        {"w": torch.tensor([[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]])}
    )


def test_a_tokenizer_without_a_chat_template_or_bytes_is_one_line(tmp_path, bpe_tokenizer):
    assert refused(chat.chat_tokenizer, SimpleNamespace(tokenizer_name="bytes")) == (
        "tokenizer: chat fine-tuning needs a Hugging Face tokenizer with a chat template: pass "
        "--hf_model CHECKPOINT (its own tokenizer) or --tokenizer NAME_OR_FOLDER"
    )
    assert refused(chat.chat_tokenizer, SimpleNamespace(tokenizer_name=str(bpe_tokenizer))) == (
        f"tokenizer '{bpe_tokenizer}' has no chat template to render conversations with (an "
        "instruct or chat checkpoint has one; a base model's tokenizer often not: set "
        "tokenizer.chat_template and save it, or use the instruct checkpoint's tokenizer)"
    )


def test_a_conversation_that_opens_with_the_assistant_learns_its_later_turns_alone(chat_tokenizer):
    """A greeting before the user's first turn: context, masked (nothing prompts it; transformers
    refuses to render the empty conversation before it). The later assistant turns are learned as
    the template's {% generation %} marks them, read by transformers."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    messages = [
        {"role": "assistant", "content": "hello, what shall I sort?"},
        {"role": "user", "content": "sort: b a"},
        {"role": "assistant", "content": "a b"},
    ]
    input_ids, labels = chat.encode(messages, tokenizer)
    marked = tokenizer.apply_chat_template(
        messages, return_dict=True, return_assistant_tokens_mask=True
    )
    assert input_ids == marked["input_ids"]
    # the marks' first run of 1s is the greeting's: not learned; the second is the answer's
    mask = marked["assistant_masks"]
    greeting_ends = mask.index(0, mask.index(1))
    learned = [0] * greeting_ends + mask[greeting_ends:]
    assert sum(learned) > 0 and sum(learned) < sum(mask)
    assert labels == [t if m else -100 for t, m in zip(input_ids, learned, strict=True)]


def test_each_reply_s_end_of_turn_is_learned_where_the_template_writes_it_without_a_prompt(
    chat_tokenizer,
):
    """A template that ends the last assistant turn only where no generation prompt is asked for,
    by `add_generation_prompt == false` (as some do; `None` is not false to it): the conversation's
    tokens are apply_chat_template's, and each reply is learned with its end of turn."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    tokenizer.chat_template = END_OF_TURN_ONLY_WITHOUT_A_PROMPT
    messages = [
        {"role": "user", "content": "sort: b a"},
        {"role": "assistant", "content": "a b"},
        {"role": "user", "content": "sort: d c"},
        {"role": "assistant", "content": "c d"},
    ]
    input_ids, labels = chat.encode(messages, tokenizer)
    whole = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert input_ids == whole
    learned = [token for token in labels if token != -100]
    assert tokenizer.decode(learned) == "a b<|im_end|>\nc d<|im_end|>\n"


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_tokenizer(chat_tokenizer):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    # a template that writes how many messages follow first: each turn changes the first tokens
    tokenizer.chat_template = (
        "{{ messages | length }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert refused(chat.encode, messages, tokenizer) == (
        f"tokenizer '{tokenizer.name_or_path}': its chat template does not render a conversation "
        "turn by turn as prefixes of one another (it rewrites earlier turns), so the assistant's "
        "tokens cannot be told from the prompt's"
    )


def test_the_eval_set_is_said_in_one_line(tmp_path, capsys, monkeypatch):
    import datasets

    monkeypatch.delenv("RANK", raising=False)
    rows = datasets.Dataset.from_dict({"x": [str(n) for n in range(10)]})
    cfg = SimpleNamespace(dataset="d", dataset_split="train", eval_fraction=0.2)
    train, held_out = chat.train_and_eval({"train": rows}, cfg, "row")
    assert (len(train), len(held_out)) == (8, 2)
    assert sorted([*train["x"], *held_out["x"]]) == sorted(rows["x"])
    named = {"train": rows, "test": rows.select([0])}
    train, held_out = chat.train_and_eval(named, cfg, "row")
    assert (len(train), list(held_out["x"])) == (10, ["0"])
    assert capsys.readouterr().out == (
        "eval set: 20% of d's train split held out (eval_fraction; 2 rows)\n"
        "eval set: the test split of d (1 row)\n"
    )


def test_only_the_train_and_eval_splits_are_checked_each_row_named(tmp_path):
    import datasets

    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"x": ["a", "b"]}),
            "test": datasets.Dataset.from_dict({"x": ["c"]}),
            "extra": datasets.Dataset.from_dict({"x": ["d"]}),
        }
    )
    cfg = SimpleNamespace(dataset="hub/x", dataset_split="train")
    checked = chat.checked_splits(splits, cfg, lambda row, where: {"where": where}, "row")
    assert {name: list(rows["where"]) for name, rows in checked.items()} == {
        "train": ["hub/x (train split) row 1", "hub/x (train split) row 2"],
        "test": ["hub/x (test split) row 1"],
    }
    # the split's own columns are dropped: a row is what row_of made of it alone
    assert {name: rows.column_names for name, rows in checked.items()} == {
        "train": ["where"],
        "test": ["where"],
    }
    alone = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"x": ["a"]})})
    checked = chat.checked_splits(alone, cfg, lambda row, where: {"where": where}, "row")
    assert list(checked["train"]["where"]) == ["hub/x row 1"]


def test_rows_of_files_yields_what_json_rows_reads_file_after_file(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text('{"x": "1"}\n')
    second.write_text('{"x": "2"}\n{"x": "3"}\n')
    rows = chat.rows_of_files([str(first), str(second)], lambda value, where: value, "key")
    assert list(rows) == [{"x": "1"}, {"x": "2"}, {"x": "3"}]
    assert json.loads(first.read_text()) == {"x": "1"}
    assert Path(first).exists()


def test_the_check_of_each_split_is_said_on_its_progress_bar(capfd):
    import datasets

    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"x": ["a"]}),
            "test": datasets.Dataset.from_dict({"x": ["b"]}),
        }
    )
    cfg = SimpleNamespace(dataset="hub/x", dataset_split="train")
    chat.checked_splits(splits, cfg, lambda row, where: {"where": where}, "prompts")
    said = capfd.readouterr().err
    assert "checking the train prompts: 100%" in said
    assert "checking the test prompts: 100%" in said


def test_the_held_out_rows_are_those_of_a_fixed_seed_0_whatever_the_run_s_seed():
    """eval_fraction of the split held out by datasets' train_test_split with seed 0 (not the run's
    seed): the first 30% of NumPy's default_rng(0) permutation of 10 rows, the rest in its order."""
    import datasets
    import numpy as np

    rows = datasets.Dataset.from_dict({"x": [str(n) for n in range(10)]})
    cfg = SimpleNamespace(dataset="d", dataset_split="train", eval_fraction=0.3, seed=7)
    permutation = [str(n) for n in np.random.default_rng(0).permutation(10)]
    train, held_out = chat.train_and_eval({"train": rows}, cfg, "row")
    assert list(held_out["x"]) == permutation[:3]
    assert list(train["x"]) == permutation[3:]


def test_a_hub_dataset_is_read_by_its_name_and_configuration_and_its_errors_in_one_line(
    monkeypatch,
):
    """A --dataset that is no local path goes to datasets.load_dataset(name, configuration or
    None); its splits listed when dataset_split is not one; its failure's first line said."""
    import datasets

    asked = []
    found = {"train": ["a"], "validation": ["b"]}

    def load_dataset(*args, **kwargs):
        asked.append((args, kwargs))
        return found

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    cfg = SimpleNamespace(dataset="owner/name", dataset_config="", dataset_split="train")
    assert chat.read_splits(cfg, lambda value, where: value) is found
    cfg.dataset_config = "main"
    assert chat.read_splits(cfg, lambda value, where: value) is found
    assert asked == [(("owner/name", None), {}), (("owner/name", "main"), {})]
    cfg.dataset_split = "dev"
    assert refused(chat.read_splits, cfg, lambda value, where: value) == (
        "dataset_split 'dev' is not a split of 'owner/name' (splits: train, validation)"
    )

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'owner/name' on the Hub (offline)\nmore detail")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    assert refused(chat.read_splits, cfg, lambda value, where: value) == (
        "dataset 'owner/name' could not be read: Couldn't reach 'owner/name' on the Hub (offline)"
    )


def test_a_json_number_in_a_column_of_strings_is_read_as_its_text(tmp_path):
    """Each column is typed by its kind (row_features), not inferred from the values: a number in
    a column of scalars is its text, "1" and "22" (datasets' own inference would make it int64)."""
    from datasets import Value

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"n": 1, "prompt": "a"}\n{"n": 22, "prompt": "b"}\n')
    table = chat.json_table([rows], lambda value, where: value)
    assert table.features["n"] == Value("string")
    assert table.to_list() == [{"n": "1", "prompt": "a"}, {"n": "22", "prompt": "b"}]


def test_the_end_of_turn_of_a_template_that_takes_only_user_and_assistant_turns(chat_tokenizer):
    """Mistral's template (v0.3's shape): it refuses any role but user then assistant, and ends a
    reply with EOS: the end of turn is EOS alone, found with a user's and an assistant's turn."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
        "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}"
        "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
        "{% endif %}{% endfor %}"
    )
    assert chat.end_of_turn_ids(tokenizer) == {tokenizer.convert_tokens_to_ids("<|endoftext|>")}


def test_the_end_of_turn_is_the_first_special_token_after_the_reply_not_the_conversation_s_end(
    chat_tokenizer,
):
    """Phi-3's shape: each reply ends with its end of turn and a newline, and a conversation
    without the generation prompt ends with EOS too: the end of turn is <|im_end|> (the first
    special token after the reply), and EOS."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
        "'<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% else %}"
        "{{ eos_token }}{% endif %}"
    )
    ids = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert chat.end_of_turn_ids(tokenizer) == set(ids)
    # Qwen's instruct tokenizers: EOS is <|im_end|>, the padding <|endoftext|> (special too); a
    # conversation written with <|endoftext|> last: only the first special token after the reply
    # ends it, <|im_end|> alone
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|endoftext|>"
    assert ids[1] in tokenizer.all_special_ids
    tokenizer.chat_template = tokenizer.chat_template.replace("eos_token", "'<|endoftext|>'")
    assert chat.end_of_turn_ids(tokenizer) == {ids[0]}


def test_the_end_of_turn_is_found_without_the_bos_a_llama_tokenizer_adds(chat_tokenizer):
    """A tokenizer that puts <s> first in what it encodes (Llama's): the text after the reply is
    encoded without it, so the end of turn is <|im_end|> (and EOS), not <s>."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    assert tokenizer("x")["input_ids"][0] == bos
    ids = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert chat.end_of_turn_ids(tokenizer) == set(ids)


def test_only_a_sharded_model_in_a_group_of_two_or_more_generates_in_step(monkeypatch):
    """sharded: an FSDP2 module (here a stand-in class for FSDPModule) in a process group of more
    than one process; not at world size 1, not without a group, not a plain model under DDP."""
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    class Sharded(nn.Linear):
        pass

    monkeypatch.setattr(fsdp, "FSDPModule", Sharded)
    world = {"size": 1, "group": True}
    monkeypatch.setattr(dist, "is_initialized", lambda: world["group"])
    monkeypatch.setattr(dist, "get_world_size", lambda *group: world["size"])
    said = {}
    for size in (1, 2, 3):
        world["size"] = size
        said[size] = (chat.sharded(Sharded(2, 2)), chat.sharded(nn.Linear(2, 2)))
    world["group"] = False
    said["no group"] = (chat.sharded(Sharded(2, 2)), chat.sharded(nn.Linear(2, 2)))
    assert said == {
        1: (False, False),
        2: (True, False),
        3: (True, False),
        "no group": (False, False),
    }
