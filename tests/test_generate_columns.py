"""The chat example's generate_columns (examples/chat_sft): each whole assistant turn generated
greedily from its conversation before it, counted per turn and matched token for token. A rigged
model (its end-of-turn logit raised at every position) answers every turn with the end of turn
alone, so the test knows which turns match without the example's code: the empty answers. Packed
blocks (several conversations a row, positions restarting) and one conversation a row (padded) give
the same counts; a turn cut at block_size is not counted. (End to end, tests/e2e/test_rl_runs.py
compares the SFT run's eval_answer_exact with the export's own greedy decode, turn by turn.)"""

from dataclasses import dataclass

import pytest
import torch

from conftest import example_file


@dataclass(frozen=True)
class Cfg:
    """The keys the chat example's files read."""

    hf_model: str = ""
    model_weights: str = "pretrained"
    init_from: str = ""
    lora_r: int = 0
    generate_eval: bool = True

    @property
    def tokenizer_name(self) -> str:
        return self.hf_model


def ending_at_once(model, end_id: int):
    """The model with its end-of-turn logit raised by 100 at every position: greedy says it first."""

    def raise_the_end(module, inputs, logits):
        logits = logits.clone()
        logits[..., end_id] += 100.0
        return logits

    model.lm_head.register_forward_hook(raise_the_end)
    return model


def chat(*turns: str) -> list[dict]:
    roles = ["user", "assistant"] * len(turns)
    return [{"role": role, "content": text} for role, text in zip(roles, turns, strict=False)]


CONVERSATIONS = [
    chat("sort: alpha beta", ""),  # 1 turn, matches (the answer is the end of turn alone)
    chat("hello", "hello there friend"),  # 1 turn, no match
    chat("first", "", "second", "a longer answer of words"),  # 2 turns, the first matches
    chat("word " * 150, "cut"),  # the prompt alone fills the block: the turn is cut, not counted
    chat("short", "many words " * 60),  # its answer runs past the block's end: not counted
]
EXPECTED = {"turns": [1, 1, 2, 0, 0], "turns_exact": [1, 0, 1, 0, 0]}
BLOCK_SIZE = 128


@pytest.fixture(scope="module")
def rigged(chat_llama):
    model_file = example_file("chat_sft", "model")
    data_file = example_file("chat_sft", "data")
    cfg = Cfg(hf_model=str(chat_llama))
    model = model_file.build_model(cfg).eval()
    tokenizer = data_file.chat_tokenizer(cfg)
    ending_at_once(model, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return model_file, data_file, cfg, model, tokenizer


def batch_of(data_file, tokenizer, packing: bool) -> dict:
    blocks = data_file.pack_conversations(
        {"messages": CONVERSATIONS}, tokenizer, BLOCK_SIZE, packing=packing
    )
    rows = [
        {name: torch.tensor(blocks[name][k]) for name in data_file.COLUMNS}
        for k in range(len(blocks["input_ids"]))
    ]
    return data_file.collate(rows)


def test_each_conversation_a_row_counts_its_whole_turns_and_those_generated_exactly(rigged):
    model_file, data_file, cfg, model, tokenizer = rigged
    batch = batch_of(data_file, tokenizer, packing=False)
    assert batch["input_ids"].size(0) == len(CONVERSATIONS)
    columns = model_file.generate_columns(model, batch, cfg)
    assert {name: values.tolist() for name, values in columns.items()} == EXPECTED
    metrics = model_file.eval_metrics(
        {"loss": 1.0, "tokens": 4.0, **{k: float(sum(v)) for k, v in EXPECTED.items()}}, cfg
    )
    assert metrics["answer_exact"] == 2 / 4
    assert "turns" not in metrics and "turns_exact" not in metrics  # not divided per token


def test_packed_blocks_count_the_same_turns_each_from_its_own_conversation(rigged):
    model_file, data_file, cfg, model, tokenizer = rigged
    batch = batch_of(data_file, tokenizer, packing=True)
    assert batch["input_ids"].size(0) < len(CONVERSATIONS)  # several conversations to a block
    columns = model_file.generate_columns(model, batch, cfg)
    assert columns["turns"].sum().item() == sum(EXPECTED["turns"])
    assert columns["turns_exact"].sum().item() == sum(EXPECTED["turns_exact"])


def test_generate_eval_false_generates_nothing(rigged):
    model_file, data_file, _, model, tokenizer = rigged
    batch = batch_of(data_file, tokenizer, packing=True)
    assert model_file.generate_columns(model, batch, Cfg(generate_eval=False)) == {}


def test_the_prompts_are_each_turn_s_conversation_before_it(rigged, monkeypatch):
    """What greedy is asked to continue: for each whole turn, its conversation up to the turn, as
    the chat template renders it with the generation prompt (left-padded rows, mask 1 over it)."""
    model_file, data_file, cfg, model, tokenizer = rigged
    asked = []

    def recording(model, prompt_ids, prompt_mask, ends, pad_id, max_new_tokens):
        for ids, mask in zip(prompt_ids, prompt_mask, strict=True):
            asked.append(ids[mask.bool()].tolist())
        return torch.full((len(prompt_ids), max_new_tokens), pad_id)

    monkeypatch.setattr(model_file, "greedy", recording)
    model_file.generate_columns(model, batch_of(data_file, tokenizer, packing=True), cfg)
    expected = []
    for messages in CONVERSATIONS[:3]:
        for turn, message in enumerate(messages):
            if message["role"] == "assistant":
                expected.append(
                    tokenizer.apply_chat_template(messages[:turn], add_generation_prompt=True)
                )
    expected = [ids if isinstance(ids, list) else ids["input_ids"] for ids in expected]
    assert asked == expected
