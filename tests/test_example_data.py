"""The examples' bad data, read through their own data.py as a fork runs it: one line naming where,
at start-up, never a crash mid-training. A label cell that is empty or not an integer names the
file, the line and the column; a label outside a dataset's classes likewise; an image folder with one
class says so, an empty class folder is one warning line; a truncated image names its file (also
when a DataLoader worker meets it). The chat example: its masks against the chat template's own
marks of the assistant's tokens, its packing (and without it, one conversation a row), a local
folder's validation file as the eval set, messages as written (text parts joined, a "9" kept a
string), and its bad input (no chat columns, a conversation without an assistant turn, a malformed
line, an image part, a tokenizer without a chat template), each line naming the file and the line."""

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from conftest import example_file, write_chats
from errors import ConfigError, the_line


def example_data(name: str):
    """The example's data.py as a module of its own (train/data.py keeps the name `data`)."""
    return example_file(name, "data")


@dataclass(frozen=True)
class Cfg:
    dataset: str
    dataset_config: str = ""
    dataset_split: str = "train"
    text_column: str = "text"
    eval_fraction: float = 0.34
    image_size: int = 32  # the image example's DataConfig
    max_length: int = 128  # the text example's DataConfig
    tokenizer_name: str = "bytes"
    block_size: int = 64
    packing: bool = True  # the chat example's DataConfig


def write_csv(path: Path, labels: list[str]) -> Path:
    rows = ["text,label", *(f"review number {i},{label}" for i, label in enumerate(labels))]
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize(
    "labels, problem",
    [
        (["0", "1", "", "1"], "the label is empty; every row needs its class"),
        (["pos", "neg", "", "pos"], "the label is empty; every row needs its class"),
        (["0", "1", "1.5", "0"], "the label 1.5 is not an integer"),
    ],
)
def test_a_bad_label_cell_is_one_line_naming_the_file_the_line_and_the_column(
    tmp_path, labels, problem
):
    text = example_data("text_classification")
    reviews = write_csv(tmp_path / "reviews.csv", labels)
    with pytest.raises(ConfigError) as refused:
        text.load_texts(Cfg(str(reviews)))
    assert str(refused.value).startswith(
        f"dataset: {reviews}, line 4 (row 3 after the header), column 'label': {problem}"
    )


def test_a_bad_label_in_the_second_file_of_a_folder_names_that_file(tmp_path):
    text = example_data("text_classification")
    write_csv(tmp_path / "a.csv", ["0", "1", "0"])
    second = write_csv(tmp_path / "b.csv", ["1", ""])
    with pytest.raises(
        ConfigError, match=rf"^dataset: {second}, line 3 \(row 2 after the header\)"
    ):
        text.load_texts(Cfg(str(tmp_path)))


def test_a_label_outside_a_dataset_s_named_classes_is_named():
    import datasets

    text = example_data("text_classification")
    classes = datasets.ClassLabel(names=["neg", "pos"])
    assert text.label_problem(1, classes) is None
    for outside in (2, -1):
        assert text.label_problem(outside, classes) == (
            f"the label {outside} is outside the classes 0..1 (neg, pos)"
        )


def write_image(path: Path, color: int) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (color, 0, 0)).save(path)
    return path


def test_an_image_folder_with_one_class_says_so(tmp_path):
    images = example_data("image_classification")
    for i in range(4):
        write_image(tmp_path / "photos" / "cat" / f"{i}.png", i)
    with pytest.raises(ConfigError) as refused:
        images.load_images(Cfg(str(tmp_path / "photos")))
    assert str(refused.value) == (
        f"dataset '{tmp_path / 'photos'}': {tmp_path / 'photos'} has one class folder (cat); a "
        "classifier needs two or more, one subfolder per class"
    )


def test_an_empty_class_folder_is_one_warning_line(tmp_path, capsys):
    images = example_data("image_classification")
    for name in ("cat", "dog"):
        for i in range(3):
            write_image(tmp_path / "photos" / name / f"{i}.png", i)
    (tmp_path / "photos" / "bird").mkdir()
    splits = images.load_images(Cfg(str(tmp_path / "photos")))
    assert splits["train"].features["label"].names == ["cat", "dog"]
    said = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert said == [
        f"warning: class folder {tmp_path / 'photos' / 'bird'} holds no image: it is not a class "
        "of this run"
    ]


def test_a_truncated_image_names_its_file_also_from_a_loader_worker(tmp_path):
    images = example_data("image_classification")
    for name in ("cat", "dog"):
        for i in range(3):
            write_image(tmp_path / "photos" / name / f"{i}.jpg", 40 * i)
    broken = tmp_path / "photos" / "dog" / "1.jpg"
    broken.write_bytes(broken.read_bytes()[:200])  # cut short, as a failed copy leaves it
    train, _ = images.build_datasets(Cfg(str(tmp_path / "photos")))
    loader = torch.utils.data.DataLoader(
        train, batch_size=6, collate_fn=images.collate, num_workers=1
    )
    with pytest.raises(Exception) as refused:
        next(iter(loader))
    assert the_line(refused.value).startswith(f"image {broken} cannot be read: ")


# ---------------------------------------------------------------- the chat example (chat_sft)


def test_chat_masks_count_exactly_the_assistant_s_tokens_as_the_template_marks_them(
    tmp_path, chat_tokenizer
):
    """data.py finds the assistant's tokens turn by turn (prefixes of the rendering); the template's
    {% generation %} marks, read by transformers, say the same, for every conversation."""
    from transformers import AutoTokenizer

    chat = example_data("chat_sft")
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    rows = [
        json.loads(line) for line in write_chats(tmp_path / "chats.jsonl").read_text().splitlines()
    ]
    assert any(len(row["messages"]) > 3 for row in rows)  # multi-turn ones too
    for row in rows:
        input_ids, labels = chat.encode(row["messages"], tokenizer)
        marked = tokenizer.apply_chat_template(
            row["messages"], return_dict=True, return_assistant_tokens_mask=True
        )
        assert input_ids == marked["input_ids"]
        expected = [
            t if m else -100 for t, m in zip(input_ids, marked["assistant_masks"], strict=True)
        ]
        assert labels == expected
        assert sum(m for m in marked["assistant_masks"]) > 0


def test_chat_packing_keeps_conversations_whole_in_order_with_their_own_positions(
    tmp_path, chat_tokenizer
):
    from transformers import AutoTokenizer

    chat = example_data("chat_sft")
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    rows = [
        json.loads(line) for line in write_chats(tmp_path / "chats.jsonl").read_text().splitlines()
    ]
    encoded = [chat.encode(row["messages"], tokenizer) for row in rows[:40]]
    block_size = 64
    blocks = chat.pack_conversations(
        {"messages": [row["messages"] for row in rows[:40]]}, tokenizer, block_size
    )
    assert all(len(ids) == block_size for ids in blocks["input_ids"])
    # read back: a conversation starts where the positions restart at 0
    found = []
    for ids, labels, positions in zip(
        blocks["input_ids"], blocks["labels"], blocks["position_ids"], strict=True
    ):
        starts = [i for i, p in enumerate(positions) if p == 0] + [block_size]
        for start, end in zip(starts, starts[1:], strict=False):
            found.append((ids[start:end], labels[start:end]))
    # the last piece of each block is its padding (no label counts), unless the block is full
    conversations = [piece for piece in found if any(label != -100 for label in piece[1])]
    longer = [pair for pair in encoded if len(pair[0]) > block_size]
    assert sum(blocks["cut"]) == len(longer)
    expected = [(ids[:block_size], labels[:block_size]) for ids, labels in encoded]
    # (a conversation cut before its first answer counts nothing: it is left out of both)
    assert conversations == [pair for pair in expected if any(label != -100 for label in pair[1])]


def llama_style(chat_tokenizer):
    """The chat tokenizer made to add a BOS, as Llama's does: `tokenizer(text)` puts <s> first, and
    the chat template writes {{ bos_token }} at the start itself."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template
    assert tokenizer("hi")["input_ids"][0] == bos  # where rendering twice would show
    return tokenizer


def test_a_tokenizer_that_adds_a_bos_renders_one_bos_as_the_chat_template_does(
    tmp_path, chat_tokenizer
):
    """transformers' own apply_chat_template(tokenize=True) gives the ids: exactly one BOS, first."""
    chat = example_data("chat_sft")
    tokenizer = llama_style(chat_tokenizer)
    rows = [
        json.loads(line)
        for line in write_chats(tmp_path / "chats.jsonl", n=6).read_text().splitlines()
    ]
    for row in rows:
        input_ids, _ = chat.encode(row["messages"], tokenizer)
        expected = tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True)
        assert input_ids == expected["input_ids"]
        assert (
            input_ids.count(tokenizer.bos_token_id) == 1 and input_ids[0] == tokenizer.bos_token_id
        )


def test_conversations_that_exactly_fill_a_block_are_one_block_each_at_its_own_positions(
    chat_tokenizer,
):
    """The lengths and positions from encoding each conversation alone: two whose lengths sum to
    block_size are one block, no padding, positions range(len_1) then range(len_2); one exactly
    block_size long is a block of its own, not cut (no warning)."""
    from transformers import AutoTokenizer

    chat = example_data("chat_sft")
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    first = exchange("say river", "ok")["messages"]
    second = exchange("say river river river river river", "ok")["messages"]
    lengths = [len(chat.encode(messages, tokenizer)[0]) for messages in (first, second)]
    assert lengths[0] != lengths[1]
    block_size = sum(lengths)
    blocks = chat.pack_conversations({"messages": [first, second]}, tokenizer, block_size)
    assert len(blocks["input_ids"]) == 1
    alone = [chat.encode(messages, tokenizer)[0] for messages in (first, second)]
    assert blocks["input_ids"][0] == alone[0] + alone[1]  # no padding
    assert blocks["position_ids"][0] == list(range(lengths[0])) + list(range(lengths[1]))
    assert blocks["cut"] == [0]
    exactly = chat.pack_conversations({"messages": [second]}, tokenizer, lengths[1])
    assert exactly["input_ids"] == [alone[1]] and exactly["cut"] == [0]


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"text": "hello"}], "has neither a 'messages' column"),
        (
            [{"messages": [{"role": "user", "content": "hi"}]}],
            "chats.jsonl line 1 has no assistant turn",
        ),
        ([{"messages": [{"role": "user"}]}], "every message needs a 'role' and a 'content'"),
    ],
)
def test_chat_data_without_conversations_is_one_line(tmp_path, chat_tokenizer, rows, message):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows * 4))
    chat = example_data("chat_sft")
    with pytest.raises(ConfigError) as error:
        chat.build_datasets(Cfg(dataset=str(path), tokenizer_name=str(chat_tokenizer)))
    assert message in the_line(error.value)


def test_a_tokenizer_without_a_chat_template_is_one_line(tmp_path, bpe_tokenizer):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": "a", "response": "b"}) + "\n" for _ in range(4)))
    chat = example_data("chat_sft")
    with pytest.raises(ConfigError) as error:
        chat.build_datasets(Cfg(dataset=str(path), tokenizer_name=str(bpe_tokenizer)))
    assert "has no chat template" in the_line(error.value)


def test_prompt_and_response_columns_are_one_exchange(tmp_path, chat_tokenizer):
    path = tmp_path / "pairs.jsonl"
    pairs = [{"prompt": f"upper: w{i}", "response": f"W{i}"} for i in range(12)]
    path.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    chat = example_data("chat_sft")
    train, held_out = chat.build_datasets(
        Cfg(dataset=str(path), tokenizer_name=str(chat_tokenizer))
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    counted = [
        tokenizer.decode([t for t in block["labels"].tolist() if t != -100])
        for part in (train, held_out)
        for block in part
    ]
    answers = "".join(counted)
    assert all(f"W{i}<|im_end|>" in answers for i in range(12))
    assert "upper" not in answers


# ---------------------------------------------------------------- the chat example's local files


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def exchange(question: str, answer: str, **extra) -> dict:
    turns = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": turns, **extra}


def answered_in(blocks, tokenizer) -> list[str]:
    """What each conversation in the blocks is trained to say: its counted tokens, decoded (a
    conversation starts where the positions restart at 0; padding counts nothing)."""
    said = []
    for block in blocks:
        positions, labels = block["position_ids"].tolist(), block["labels"].tolist()
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        for start, end in zip(starts, starts[1:], strict=False):
            counted = [t for t in labels[start:end] if t != -100]
            if counted:
                said.append(tokenizer.decode(counted))
    return said


def answers(rows: list[dict]) -> list[str]:
    """What the template marks as each conversation's answers (ChatML: content, then <|im_end|>)."""
    return [
        "".join(m["content"] + "<|im_end|>\n" for m in row["messages"] if m["role"] == "assistant")
        for row in rows
    ]


@pytest.mark.parametrize(
    "layout",
    [
        {"train": "train.jsonl", "validation": "validation.jsonl"},
        {"train": "train/part-0.jsonl", "validation": "validation/part-0.jsonl"},
        {"train": "chats_train.jsonl", "validation": "chats_dev.jsonl"},  # datasets' own names
    ],
    ids=["files", "folders", "dev"],
)
def test_a_local_folder_s_validation_file_is_the_eval_set_and_the_start_up_says_so(
    tmp_path, chat_tokenizer, capsys, layout
):
    """Before: the folder was one train split, and 5% of it was held out, without a word."""
    from transformers import AutoTokenizer

    folder = tmp_path / "chats"
    train_rows = [exchange(f"upper: w{i}", f"W{i}") for i in range(30)]
    eval_rows = [exchange(f"reverse: w{i}", f"{i}w") for i in range(12)]
    write_jsonl(folder / layout["train"], train_rows)
    write_jsonl(folder / layout["validation"], eval_rows)
    chat = example_data("chat_sft")
    train, held_out = chat.build_datasets(
        Cfg(dataset=str(folder), tokenizer_name=str(chat_tokenizer), eval_fraction=0.05)
    )
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    assert sorted(answered_in(held_out, tokenizer)) == sorted(answers(eval_rows))
    assert sorted(answered_in(train, tokenizer)) == sorted(answers(train_rows))  # none held out
    out = capsys.readouterr().out
    assert f"eval set: the validation split of {folder} (12 conversations)\n" in out


def test_a_file_without_a_validation_split_holds_eval_fraction_out_and_says_so(
    tmp_path, chat_tokenizer, capsys
):
    from transformers import AutoTokenizer

    rows = [exchange(f"upper: w{i}", f"W{i}") for i in range(40)]
    path = write_jsonl(tmp_path / "chats.jsonl", rows)
    chat = example_data("chat_sft")
    train, held_out = chat.build_datasets(
        Cfg(dataset=str(path), tokenizer_name=str(chat_tokenizer), eval_fraction=0.1)
    )
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    held = answered_in(held_out, tokenizer)
    assert len(held) == 4 and sorted(held + answered_in(train, tokenizer)) == sorted(answers(rows))
    assert (
        f"eval set: 10% of {path}'s train split held out (eval_fraction; 4 conversations)\n"
        in capsys.readouterr().out
    )


def test_messages_are_read_as_written_and_text_parts_are_joined(tmp_path, chat_tokenizer):
    """OpenAI's list of parts in one conversation made datasets type every content as JSON, and read
    another conversation's answer "9" as the number 9 (its error then named that one)."""
    from transformers import AutoTokenizer

    parts = [{"type": "text", "text": "what is"}, {"type": "text", "text": "4 + 5?"}]
    asked_in_parts = [{"role": "user", "content": parts}, {"role": "assistant", "content": "9"}]
    rows = [
        exchange("what is 4 + 5?", "9"),
        {"messages": asked_in_parts},
        exchange("and 1 + 1?", "2", source="quiz"),  # a key of its own: not read
    ] * 4
    path = write_jsonl(tmp_path / "chats.jsonl", rows)
    chat = example_data("chat_sft")
    train, held_out = chat.build_datasets(
        Cfg(dataset=str(path), tokenizer_name=str(chat_tokenizer), eval_fraction=0.25)
    )
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    said = answered_in(train, tokenizer) + answered_in(held_out, tokenizer)
    assert sorted(said) == sorted(["9<|im_end|>\n"] * 8 + ["2<|im_end|>\n"] * 4)
    # the parts, joined a line apart, are what the template renders as the user's turn
    joined = [{"role": "user", "content": "what is\n4 + 5?"}, {"role": "assistant", "content": "9"}]
    expected = tokenizer.apply_chat_template(joined, tokenize=True, return_dict=True)["input_ids"]
    as_read = chat.chat_row(rows[1], f"{path} line 2")["messages"]
    assert chat.encode(as_read, tokenizer)[0] == expected


IMAGE_PART = {
    "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "cat.png"}}]},
        {"role": "assistant", "content": "a cat"},
    ]
}


@pytest.mark.parametrize(
    "third_line, said",
    [
        ('{"messages": [{"role": "user", "content": "hi"}', "line 3 is not valid JSON: Expecting"),
        (
            json.dumps(IMAGE_PART),
            "line 3: a message has a part of type 'image_url'; chat fine-tuning here reads text",
        ),
        ('{"messages": [{"role": "user", "content": 9}]}', "line 3: every message needs a 'role'"),
    ],
    ids=["malformed", "image part", "number"],
)
def test_a_bad_line_is_one_line_naming_the_file_and_the_line(
    tmp_path, chat_tokenizer, third_line, said
):
    good = json.dumps(exchange("upper: a", "A"))
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join([good, good, third_line, good]) + "\n")
    chat = example_data("chat_sft")
    with pytest.raises(ConfigError) as error:
        chat.build_datasets(Cfg(dataset=str(path), tokenizer_name=str(chat_tokenizer)))
    assert the_line(error.value).startswith(f"dataset: {path} {said}")


def test_conversations_that_end_on_a_user_turn_are_one_warning_with_their_count(
    tmp_path, chat_tokenizer, capsys
):
    asked_again = [*exchange("upper: a", "A")["messages"], {"role": "user", "content": "and b?"}]
    unanswered = {"messages": asked_again}
    folder = tmp_path / "chats"
    write_jsonl(folder / "train.jsonl", [exchange("upper: b", "B")] * 6 + [unanswered] * 3)
    write_jsonl(folder / "validation.jsonl", [unanswered, exchange("upper: c", "C")])
    chat = example_data("chat_sft")
    chat.build_datasets(Cfg(dataset=str(folder), tokenizer_name=str(chat_tokenizer)))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "user's turn" in line]
    assert warnings == [
        f"warning: 4 conversation(s) of {folder} end on a user's turn, which nothing answers: it "
        "is not trained on (end each on the assistant's answer)"
    ]


def test_unpacked_each_row_is_one_conversation_padded_to_its_batch_s_longest(
    tmp_path, chat_tokenizer, chat_llama
):
    """packing false, as TRL's SFTTrainer by default: a batch's rows are its conversations, each as
    the chat template renders it (its labels the tokens the template marks as the assistant's),
    padded to the longest with nothing counted, and a model sees each as it sees it alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    chats = write_chats(tmp_path / "all.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in chats]
    folder = tmp_path / "chats"
    write_jsonl(folder / "train.jsonl", rows[:40])
    write_jsonl(folder / "validation.jsonl", rows[40:48])
    chat = example_data("chat_sft")
    cfg = Cfg(dataset=str(folder), tokenizer_name=str(chat_tokenizer), block_size=128)
    train, held_out = chat.build_datasets(replace(cfg, packing=False))
    assert (len(train), len(held_out)) == (40, 8)
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    batch = chat.collate([train[i] for i in range(8)])
    marked = [
        tokenizer.apply_chat_template(
            row["messages"], return_dict=True, return_assistant_tokens_mask=True
        )
        for row in rows[:8]
    ]
    longest = max(len(m["input_ids"]) for m in marked)
    assert batch["input_ids"].shape == (8, longest)
    for row, expected in enumerate(marked):
        ids, mask = expected["input_ids"], expected["assistant_masks"]
        length = len(ids)
        assert batch["input_ids"][row, :length].tolist() == ids
        labels = [t if m else -100 for t, m in zip(ids, mask, strict=True)]
        assert batch["labels"][row].tolist() == labels + [-100] * (longest - length)
        # one conversation: its positions from 0, the padding after it a sequence of its own
        positions = list(range(length)) + list(range(longest - length))
        assert batch["position_ids"][row].tolist() == positions
    model = AutoModelForCausalLM.from_pretrained(chat_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        for row, expected in enumerate(marked):
            alone = model(input_ids=torch.tensor([expected["input_ids"]])).logits[0]
            torch.testing.assert_close(logits[row, : len(alone)], alone, rtol=1e-4, atol=1e-5)
    packed, _ = chat.build_datasets(cfg)
    assert len(packed) < len(train)  # packed: several conversations to a block


# ---------------------------------------------------------------- the chat data's lines, whole


def test_the_chat_data_s_start_up_lines_are_whole(tmp_path, capsys, monkeypatch):
    chat = example_data("chat_sft")
    with pytest.raises(ConfigError) as error:
        chat.check_config(Cfg(dataset=""))
    assert str(error.value) == (
        "dataset: pass --dataset, chat JSON lines or prompt/response rows (a file, a folder, or a "
        "hub name)"
    )
    with pytest.raises(ConfigError) as error:
        chat.check_config(Cfg(dataset="x.jsonl", block_size=0))
    assert str(error.value) == "block_size must be > 0 (got 0)"
    chat.check_config(Cfg(dataset="x.jsonl", block_size=1))
    with pytest.raises(ConfigError) as error:
        chat.chat_row({"text": "hello", "label": 1}, "f.jsonl line 2")
    assert str(error.value) == (
        "dataset f.jsonl line 2 has neither a 'messages' column (chat: a list of {role, content}) "
        "nor 'prompt' and 'response' columns (columns: text, label)"
    )
    assert chat.chat_row({"prompt": 1, "response": 2.5, "x": 0}, "w") == {
        "prompt": "1",
        "response": "2.5",
    }
    # a hub dataset's conversations, named by split and place; a conversation ending on the user
    monkeypatch.delenv("RANK", raising=False)
    ok = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert chat.check_turns([ok, [*ok, {"role": "user", "content": "c"}]], "split 'train'") == 1
    with pytest.raises(ConfigError) as error:
        chat.check_turns([ok, ok, [{"role": "user", "content": "a"}]], "split 'test'")
    assert str(error.value) == (
        "dataset: split 'test', conversation 3 has no assistant turn, nothing to learn from "
        "(roles: user)"
    )
    chat.warn_of_cut_conversations({"cut": [0, 2, 1]}, "train", 64)
    chat.warn_of_cut_conversations({"cut": [0, 0]}, "eval", 64)
    assert capsys.readouterr().err == (
        "warning: 3 train conversation(s) longer than block_size 64 tokens were cut to it (their "
        "end is not trained on): raise block_size to keep them whole\n"
    )


def test_collate_pads_each_row_as_a_sequence_of_its_own_that_nothing_counts():
    """By hand: rows of 3 and 1 tokens; the second padded with id 0, label -100, positions 0, 1."""
    chat = example_data("chat_sft")
    rows = [
        {
            "input_ids": torch.tensor([5, 6, 7]),
            "labels": torch.tensor([-100, 6, 7]),
            "position_ids": torch.tensor([0, 1, 2]),
        },
        {
            "input_ids": torch.tensor([8], dtype=torch.int32),
            "labels": torch.tensor([8]),
            "position_ids": torch.tensor([0]),
        },
    ]
    batch = chat.collate(rows)
    assert {name: value.tolist() for name, value in batch.items()} == {
        "input_ids": [[5, 6, 7], [8, 0, 0]],
        "labels": [[-100, 6, 7], [8, -100, -100]],
        "position_ids": [[0, 1, 2], [0, 0, 1]],
    }
    assert all(value.dtype == torch.int64 for value in batch.values())


def test_a_block_s_padding_id_is_the_tokenizer_s_then_eos_then_0(chat_tokenizer):
    """A packed block of one short conversation, padded to 64: with the tokenizer's pad id, its
    EOS where it has none, 0 where it has neither; labels -100 and positions from 0 there."""
    from transformers import AutoTokenizer

    chat = example_data("chat_sft")
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    tokenizer.eos_token = "<|im_end|>"  # an EOS other than id 0 (as Qwen's instruct tokenizers)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    ids, labels = chat.encode(messages, tokenizer)
    missing = 64 - len(ids)
    eos = tokenizer.eos_token_id
    assert tokenizer.pad_token_id is None and eos == tokenizer.convert_tokens_to_ids("<|im_end|>")
    for pad, expected in ((None, eos), ("<|im_start|>", None)):
        if pad:
            tokenizer.pad_token = pad
            expected = tokenizer.convert_tokens_to_ids(pad)
        blocks = chat.pack_conversations({"messages": [messages]}, tokenizer, 64)
        assert blocks["input_ids"] == [ids + [expected] * missing]
        assert blocks["labels"] == [labels + [-100] * missing]
        assert blocks["position_ids"] == [list(range(len(ids))) + list(range(missing))]

    class NoPadNoEos:
        pad_token_id = None
        eos_token_id = None

        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def apply_chat_template(self, *args, **kwargs):
            return tokenizer.apply_chat_template(*args, **kwargs)

        def __call__(self, *args, **kwargs):
            return tokenizer(*args, **kwargs)

    blocks = chat.pack_conversations({"messages": [messages]}, NoPadNoEos(), 64)
    assert blocks["input_ids"] == [ids + [0] * missing]


def test_each_part_s_packing_is_said_on_its_bar_and_its_cut_conversations_in_one_whole_line(
    tmp_path, chat_tokenizer, capfd
):
    """Two train conversations and one eval conversation longer than block_size (64), their lengths
    transformers' apply_chat_template's: one warning line a part, whole, naming the part and
    block_size; datasets' progress bar of each part's packing says what it packs (default: "Map")."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    long, short = exchange("say " + "river " * 80, "ok"), exchange("upper: a", "A")
    lengths = [
        len(
            tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )
        for row in (long, short)
    ]
    assert lengths[0] > 64 > lengths[1]
    folder = tmp_path / "chats"
    write_jsonl(folder / "train.jsonl", [long, short, long, short, short])
    write_jsonl(folder / "validation.jsonl", [short, long])
    chat = example_data("chat_sft")
    chat.build_datasets(Cfg(dataset=str(folder), tokenizer_name=str(chat_tokenizer)))
    err = capfd.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("warning:")] == [
        f"warning: {count} {part} conversation(s) longer than block_size 64 tokens were cut to it "
        "(their end is not trained on): raise block_size to keep them whole"
        for count, part in ((2, "train"), (1, "eval"))
    ]
    bars = err.replace("\r", "\n").splitlines()
    for part, rows_done in (("train", "5/5"), ("eval", "2/2")):
        said = f"packing {part} conversations: 100%"
        assert any(bar.startswith(said) and rows_done in bar for bar in bars), bars


def test_a_prompt_and_response_row_is_the_user_s_turn_then_the_assistant_s_as_the_template_has_them(
    tmp_path, chat_tokenizer
):
    """packing false, a row a conversation: each pair's tokens and labels are transformers'
    apply_chat_template's of [user: prompt, assistant: response] (its assistant mask the labels)."""
    from transformers import AutoTokenizer

    folder = tmp_path / "pairs"
    train_pairs = [{"prompt": "upper: w1", "response": "W1"}, {"prompt": "say 7", "response": "7"}]
    eval_pairs = [{"prompt": "reverse: ab", "response": "ba"}]
    write_jsonl(folder / "train.jsonl", train_pairs)
    write_jsonl(folder / "validation.jsonl", eval_pairs)
    chat = example_data("chat_sft")
    train, held_out = chat.build_datasets(
        Cfg(dataset=str(folder), tokenizer_name=str(chat_tokenizer), packing=False)
    )
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)

    def rendered(pairs):
        rows = []
        for pair in pairs:
            messages = [
                {"role": "user", "content": pair["prompt"]},
                {"role": "assistant", "content": pair["response"]},
            ]
            marked = tokenizer.apply_chat_template(
                messages, return_dict=True, return_assistant_tokens_mask=True
            )
            ids, mask = marked["input_ids"], marked["assistant_masks"]
            rows.append((ids, [t if m else -100 for t, m in zip(ids, mask, strict=True)]))
        return sorted(rows)

    for part, pairs in ((train, train_pairs), (held_out, eval_pairs)):
        got = sorted((row["input_ids"].tolist(), row["labels"].tolist()) for row in part)
        assert got == rendered(pairs)


def test_packing_on_its_own_checks_each_conversation_and_takes_prompts_and_responses_in_pairs(
    chat_tokenizer,
):
    """build_datasets checks every conversation before (load_conversations), and a dataset's batch
    holds its columns equally long; pack_conversations called alone checks them itself: a
    conversation without an assistant turn is one line, and prompts without as many responses are
    refused, not cut to the shorter column."""
    from transformers import AutoTokenizer

    chat = example_data("chat_sft")
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    with pytest.raises(ConfigError) as error:
        chat.pack_conversations({"messages": [[{"role": "user", "content": "hi"}]]}, tokenizer, 64)
    assert str(error.value) == (
        "dataset: a conversation has no assistant turn, nothing to learn from (roles: user)"
    )
    with pytest.raises(ValueError, match=r"zip\(\) argument 2 is shorter than argument 1"):
        chat.pack_conversations({"prompt": ["a", "b"], "response": ["A"]}, tokenizer, 64)


def test_a_conversation_of_no_tokens_after_a_cut_one_leaves_its_block_s_cut_count(chat_tokenizer):
    """A template that writes the contents alone (no markup): a conversation of two empty turns is
    no tokens, and joins the full block of the cut conversation before it; that block still counts
    the cut one (the warning's count is the blocks' sum). By hand: block_size 8, two conversations
    cut to the answer's first 8 tokens, one block each."""
    from transformers import AutoTokenizer

    chat = example_data("chat_sft")
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    answer = "river " * 20
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    assert len(ids) > 8
    long = [{"role": "user", "content": ""}, {"role": "assistant", "content": answer}]
    empty = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
    blocks = chat.pack_conversations({"messages": [long, empty, long]}, tokenizer, 8)
    assert blocks["input_ids"] == [ids[:8], ids[:8]] and blocks["labels"] == [ids[:8], ids[:8]]
    assert blocks["cut"] == [1, 1]
