"""The chat example's generate_columns (examples/chat_sft): each whole assistant turn generated
greedily from its conversation before it, counted per turn and matched token for token. A rigged
model (its end-of-turn logit raised at every position) answers every turn with the end of turn
alone, so the test knows which turns match without the example's code: the empty answers. Packed
blocks (several conversations a row, positions restarting) and one conversation a row (padded) give
the same counts; a turn cut at block_size is not counted. An oracle model (its next token set after
each token of one answer) says that answer to every turn: exact with its end of turn, a prefix of it
not, and the batch's longest turn too. (End to end, tests/e2e/test_rl_runs.py
compares the SFT run's eval_answer_exact with the export's own greedy decode, turn by turn.)"""

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from conftest import example_file
from errors import ConfigError


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


def batch_of(data_file, tokenizer, packing: bool, conversations=CONVERSATIONS) -> dict:
    blocks = data_file.pack_conversations(
        {"messages": conversations}, tokenizer, BLOCK_SIZE, packing=packing
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

    stops = []

    def recording(model, prompt_ids, prompt_mask, ends, pad_id, max_new_tokens):
        stops.append((ends, pad_id))
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
    # greedy stops each at the end of turn (<|im_end|> or EOS), padding with the first
    ends = sorted({tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id})
    assert stops == [(ends, ends[0])]


def saying_next(model, following: dict[int, int]):
    """An oracle: the model's next token after each token of `following` is the one it names, as
    a hook on the whole model sets its logits (whatever the cache gives it: a function of the
    last input token alone); after any other token, the model's own."""

    def forced(module, args, kwargs, output):
        logits = output.logits.clone()
        ids = kwargs["input_ids"][:, -logits.size(1) :]  # generate keeps the last position's alone
        for token, next_token in following.items():
            logits[..., next_token] += 1000.0 * (ids == token)
        output.logits = logits
        return output

    model.register_forward_hook(forced, with_kwargs=True)
    return model


# the oracle says "text width" and the end of turn to any assistant turn
ORACLE_CONVERSATIONS = [
    chat("sort: width text", "text width"),  # 1 turn, said exactly, with its end of turn
    chat("first", "text"),  # 1 turn, said and then not ended ("text width"): not exact
    chat("one", "text width", "two", "no"),  # 2 turns, the first exact
]
ORACLE_EXPECTED = {"turns": [1, 1, 2], "turns_exact": [1, 0, 1]}


def test_a_turn_is_exact_with_its_end_of_turn_and_the_longest_turn_can_be(rigged):
    """An oracle model that answers every turn "text width" and its end of turn (the chain of next
    tokens read off the first conversation's labelled tokens): the turns that say exactly that are
    exact, "text" (its tokens said, then more instead of the end) is not; the exact turn is the
    batch's longest, so greedy needs room for all of its tokens."""
    model_file, data_file, cfg, _, tokenizer = rigged
    batch = batch_of(data_file, tokenizer, packing=False, conversations=ORACLE_CONVERSATIONS)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokens = batch["input_ids"][0].tolist()
    first = (batch["labels"][0] != -100).nonzero()[0].item()
    chain = tokens[
        first - 1 : tokens.index(end, first) + 1
    ]  # the generation prompt's last, the answer
    assert len(set(chain)) == len(chain)  # a chain: each token names one next
    said = [tokenizer.encode(text + "<|im_end|>") for text in ("text width", "text", "no")]
    assert said[0] == chain[1:] and len(said[0]) > max(len(said[1]), len(said[2]))  # the longest
    model = model_file.build_model(cfg).eval()
    saying_next(model, dict(zip(chain, chain[1:], strict=False)))
    columns = model_file.generate_columns(model, batch, cfg)
    assert {name: values.tolist() for name, values in columns.items()} == ORACLE_EXPECTED


def test_a_sharded_rank_without_a_whole_turn_still_generates_once(rigged, monkeypatch):
    """Under FSDP2 (sharded: here forced) every rank runs as many generate calls, so a batch
    without a whole turn runs one of a single token, counting nothing; every call with
    synced_gpus."""
    import chat

    model_file, data_file, cfg, _, tokenizer = rigged
    asked = []

    def generate(input_ids, **kwargs):  # no process group here: what it is asked, no more
        asked.append({"input_ids": input_ids, **kwargs})
        new = kwargs["generation_config"].max_new_tokens
        return torch.cat([input_ids, torch.zeros(len(input_ids), new, dtype=torch.long)], -1)

    recording = SimpleNamespace(generation_config=None, generate=generate)
    # sharded: asked of the model generating
    monkeypatch.setattr(model_file, "sharded", lambda model: model is recording)
    monkeypatch.setattr(chat, "sharded", lambda model: model is recording)
    # the cut turn and the one past the block's end: no whole turn in either row
    no_whole_turn = batch_of(data_file, tokenizer, packing=False, conversations=CONVERSATIONS[3:])
    columns = model_file.generate_columns(recording, no_whole_turn, cfg)
    assert {name: values.tolist() for name, values in columns.items()} == {
        "turns": [0, 0],
        "turns_exact": [0, 0],
    }
    assert len(asked) == 1
    assert asked[0]["generation_config"].max_new_tokens == 1
    assert asked[0]["input_ids"].shape == (1, 1) and asked[0]["synced_gpus"] is True
    # one token of the first row, attended, with the run's ends of turn and padding (the
    # tokenizer has no padding of its own: the first end)
    assert asked[0]["attention_mask"].tolist() == [[1]]
    ends = sorted({tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id})
    assert asked[0]["generation_config"].eos_token_id == ends
    assert asked[0]["generation_config"].pad_token_id == ends[0]


def test_an_eval_set_without_a_whole_turn_reports_the_per_token_metrics_alone(rigged):
    model_file, _, cfg, _, _ = rigged
    sums = {"loss": 6.0, "correct": 3.0, "tokens": 4.0, "turns": 0.0, "turns_exact": 0.0}
    metrics = model_file.eval_metrics(sums, cfg)
    assert metrics == pytest.approx({"loss": 1.5, "correct": 0.75, "perplexity": math.exp(1.5)})


# ---------------------------------------------------------------- the rest of the chat model's file


def test_the_chat_model_s_keys_items_columns_and_block_by_hand(rigged):
    """Its start-up line whole; the items its .loss averages over (the labelled next tokens); the
    eval's sums per row from logits worked by hand (two tokens, equal logits: ln 2 each, the argmax
    token 0); a packed block's positions, none unpacked; the model without a training cache."""
    model_file, _, cfg, model, tokenizer = rigged
    with pytest.raises(ConfigError) as e:
        model_file.check_config(Cfg(hf_model=""))
    assert str(e.value) == (
        "hf_model: chat fine-tuning starts from a Hugging Face causal LM: pass --hf_model "
        "NAME_OR_FOLDER (e.g. Qwen/Qwen2.5-0.5B-Instruct)"
    )
    model_file.check_config(cfg)  # a hub model: no line
    labels = torch.tensor([[-100, 5, 6, -100], [1, -100, 7, 8]])  # the first label is no target
    assert int(model_file.loss_items({"labels": labels})) == 4
    output = SimpleNamespace(logits=torch.zeros(2, 3, 2))
    columns = model_file.eval_columns(
        output, {"labels": torch.tensor([[-100, 1, 0], [-100, -100, 0]])}
    )
    assert {name: values.tolist() for name, values in columns.items()} == {
        "tokens": [2.0, 1.0],
        "loss": pytest.approx([2 * math.log(2), math.log(2)]),
        "accuracy": [1.0, 1.0],
    }
    assert model_file.tokens_per_sample(SimpleNamespace(packing=True, block_size=96)) == 96
    assert model_file.tokens_per_sample(SimpleNamespace(packing=False, block_size=96)) is None
    # built here, not the fixture's: training's forward runs without the key/value cache
    assert model_file.build_model(cfg).config.use_cache is False
    ends = sorted(
        {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    )  # the tokenizer has no padding of its own: the first end pads
    assert tokenizer.pad_token_id is None
    assert model_file.turn_ends(cfg) == (ends, ends[0])


def test_prompts_are_left_padded_with_the_pad_id_and_masked_there():
    model_file = example_file("chat_sft", "model")
    ids, mask = model_file.left_padded([torch.tensor([4, 5, 6]), torch.tensor([7])], pad_id=9)
    assert ids.tolist() == [[4, 5, 6], [9, 9, 7]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert ids.dtype == mask.dtype == torch.int64
    ids, mask = model_file.left_padded([torch.tensor([4])], pad_id=9)  # one turn alone
    assert (ids.tolist(), mask.tolist()) == ([[4]], [[1]])


def test_whole_turns_are_labelled_runs_with_an_end_from_their_conversation_s_start():
    """By hand: a row of two packed conversations (positions restart at 4) and a row whose one
    labelled run has no end of turn (cut at the block's end): (row, conversation's first position,
    the turn's first, one past its end)."""
    model_file = example_file("chat_sft", "model")
    end, x = 2, -100
    batch = {
        "input_ids": torch.tensor([[9, 9, 5, 2, 9, 9, 6, 2], [9, 5, 6, 7, 7, 7, 7, 7]]),
        "labels": torch.tensor([[x, x, 5, 2, x, x, 6, 2], [x, 5, 6, 7, 7, 7, 7, 7]]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7]]),
    }
    assert model_file.whole_turns(batch, [end]) == [(0, 0, 2, 4), (0, 4, 6, 8)]
    # an end of turn inside a run: the turn ends with it, what follows in the run is not a turn
    batch["labels"][1] = torch.tensor([x, 5, 2, 7, x, x, x, x])
    batch["input_ids"][1] = torch.tensor([9, 5, 2, 7, 9, 9, 9, 9])
    assert model_file.whole_turns(batch, [end])[-1] == (1, 0, 1, 3)
    # a run from the row's first position (a fork's data may label it): a turn from there
    batch["labels"][1] = torch.tensor([5, 2, x, x, x, x, x, x])
    batch["input_ids"][1] = torch.tensor([5, 2, 9, 9, 9, 9, 9, 9])
    assert model_file.whole_turns(batch, [end])[-1] == (1, 0, 0, 2)
