"""The preference example (examples/preference: DPO, IPO, SimPO), through its own files as a fork runs
them, each against a number worked out another way: the losses from their papers' formulas in
float64; the model's output on a padded batch of pairs against each sequence run alone with the
completion's token log-probs summed by hand; the reference's log-probs bitwise the same after the
policy trains, with a frozen copy and with LoRA adapters switched off (which the reference pass
leaves on); the reference's digest; the rendering (the scored tokens are the assistant's answer);
each bad input's one line; and TRL's DPOTrainer on the same model, pairs and beta (pip install -r
requirements-trl.txt)."""

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from conftest import END_OF_TURN_ONLY_WITHOUT_A_PROMPT, REPO, example_file
from errors import ConfigError

PREFERENCE = REPO / "examples" / "preference"


def example(name: str):
    """The example's model.py or data.py as a module of its own (train/ keeps `model` and `data`)."""
    return example_file("preference", name)


@dataclass(frozen=True)
class Cfg:
    """The keys the example's files read: the template's, and its ModelConfig's and DataConfig's."""

    hf_model: str = ""
    dataset: str = ""
    dataset_config: str = ""
    dataset_split: str = "train"
    eval_fraction: float = 0.25
    block_size: int = 128
    model_weights: str = "pretrained"
    init_from: str = ""
    lora_r: int = 0
    lora_alpha: float = 0.0
    lora_dropout: float = 0.0
    lora_targets: str = ""
    fsdp: str = "no"
    preference_loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    @property
    def tokenizer_name(self) -> str:
        return self.hf_model


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


# pairs of different lengths, in each shape the example reads: conversations (TRL's), a system turn,
# strings, and ultrafeedback_binarized's chosen and rejected that repeat the prompt's turn
PAIRS = [
    {
        "prompt": [user("reverse: river stone")],
        "chosen": [assistant("enots revir")],
        "rejected": [assistant("river stone")],
    },
    {
        "prompt": [{"role": "system", "content": "Be brief."}, user("upper: maple")],
        "chosen": [assistant("MAPLE")],
        "rejected": [assistant("maple, in capitals: MAPLE, as you asked")],
    },
    {"prompt": "upper: tiger ocean", "chosen": "TIGER OCEAN", "rejected": "tiger"},
    {
        "prompt": "reverse: ember",
        "chosen": [user("reverse: ember"), assistant("rebme")],
        "rejected": [user("reverse: ember"), assistant("ember ember ember")],
    },
]


def as_conversation(pair: dict) -> dict:
    """The pair as the test reads it, independently of data.py: prompt turns, completion turns."""
    prompt = [user(pair["prompt"])] if isinstance(pair["prompt"], str) else pair["prompt"]
    conversation = {"prompt": prompt}
    for side in ("chosen", "rejected"):
        turns = pair[side]
        turns = [assistant(turns)] if isinstance(turns, str) else turns
        conversation[side] = turns[len(prompt) :] if turns[: len(prompt)] == prompt else turns
    return conversation


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def batch_of(pairs: list[dict], tokenizer, block_size: int = 128) -> dict:
    """The example's collated batch of these pairs, through its own data.py."""
    data = example("data")
    rows = []
    for n, pair in enumerate(pairs):
        encoded = data.encode_pair(data.pair_row(pair, f"pair {n}"), tokenizer, block_size)
        rows.append({name: torch.tensor(encoded[name]) for name in data.COLUMNS})
    return data.collate(rows)


def perturbed(model, scale: float = 0.05):
    """The model's weights moved by a fixed random amount (a policy that has left its reference)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, parameter in sorted(model.named_parameters()):
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    return model


def hub_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def alone(model, tokenizer, prompt: list[dict], completion: list[dict]) -> tuple[float, int]:
    """(log-prob, tokens) of the completion after the prompt: the sequence run alone (no padding),
    float64 log_softmax, the completion's token log-probs summed here. The prompt and completion
    tokens as the tokenizer's chat template gives them."""
    prompt_ids = tokenizer.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    ids = tokenizer.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    with torch.no_grad():
        logits = type(model).forward(model, input_ids=torch.tensor([ids])).logits[0]
    log_probs = logits.double().log_softmax(-1)
    total = sum(log_probs[t - 1, ids[t]].item() for t in range(len(prompt_ids), len(ids)))
    return total, len(ids) - len(prompt_ids)


# ---------------------------------------------------------------- the losses, by their papers


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def paper_loss(kind, beta, eps, gamma, pi_c, pi_r, ref_c, ref_r, n_c, n_r) -> float:
    """One pair's loss as each paper writes it (the module docstring's formulas), in float64."""
    if kind == "sigmoid":  # DPO (Rafailov et al. 2023), cDPO's label smoothing
        h = (pi_c - ref_c) - (pi_r - ref_r)
        return -(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h)
    if kind == "ipo":  # IPO (Azar et al. 2023), per-token log-ratios as TRL
        h_avg = (pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r
        return (h_avg - 1 / (2 * beta)) ** 2
    # SimPO (Meng et al. 2024)
    return -log_sigmoid(beta * (pi_c / n_c - pi_r / n_r) - gamma)


def paper_rewards(kind, beta, pi_c, pi_r, ref_c, ref_r, n_c, n_r) -> tuple[float, float]:
    if kind == "simpo":
        return beta * pi_c / n_c, beta * pi_r / n_r
    return beta * (pi_c - ref_c), beta * (pi_r - ref_r)


# fixed numbers: summed log-probs of the policy and the reference, and token counts (h of each sign)
FIXED = {
    "pi_c": [-12.5, -40.0, -3.25, -7.0],
    "pi_r": [-15.0, -38.5, -9.75, -6.5],
    "ref_c": [-13.0, -39.0, -4.0, -7.5],
    "ref_r": [-14.0, -39.5, -9.0, -6.0],
    "n_c": [5, 17, 2, 3],
    "n_r": [6, 15, 4, 3],
}


@pytest.mark.parametrize(
    "kind, beta, eps, gamma",
    [
        ("sigmoid", 0.1, 0.0, 0.5),
        ("sigmoid", 0.5, 0.2, 0.5),
        ("ipo", 0.1, 0.0, 0.5),
        ("ipo", 2.0, 0.0, 0.5),
        ("simpo", 2.0, 0.0, 0.5),
        ("simpo", 0.1, 0.0, 1.2),
    ],
)
def test_each_loss_is_its_paper_s_formula_in_float64(kind, beta, eps, gamma):
    model = example("model")
    cfg = Cfg(preference_loss=kind, beta=beta, label_smoothing=eps, simpo_gamma=gamma)
    given = {name: torch.tensor(values, dtype=torch.float64) for name, values in FIXED.items()}
    losses, chosen_rewards, rejected_rewards = model.pair_losses(
        cfg,
        given["pi_c"],
        given["pi_r"],
        given["ref_c"],
        given["ref_r"],
        given["n_c"],
        given["n_r"],
    )
    for i in range(4):
        numbers = [FIXED[name][i] for name in ("pi_c", "pi_r", "ref_c", "ref_r", "n_c", "n_r")]
        expected = paper_loss(kind, beta, eps, gamma, *numbers)
        assert abs(losses[i].item() - expected) < 1e-12, (i, losses[i].item(), expected)
        chosen, rejected = paper_rewards(kind, beta, *numbers)
        assert abs(chosen_rewards[i].item() - chosen) < 1e-12
        assert abs(rejected_rewards[i].item() - rejected) < 1e-12


# ---------------------------------------------------------------- the model's output


@pytest.mark.parametrize(
    "kind, beta, eps",
    [("sigmoid", 0.1, 0.0), ("sigmoid", 0.3, 0.25), ("ipo", 0.5, 0.0), ("simpo", 2.0, 0.0)],
)
def test_a_padded_batch_gives_each_pair_what_its_sequences_give_alone(chat_llama, kind, beta, eps):
    """Pairs of different lengths, chosen and rejected padded to one length and run as one batch:
    the loss, reward accuracy, margin and log-probs are those of each sequence run alone."""
    from transformers import AutoTokenizer

    model_py = example("model")
    tokenizer = AutoTokenizer.from_pretrained(chat_llama)
    cfg = Cfg(hf_model=str(chat_llama), preference_loss=kind, beta=beta, label_smoothing=eps)
    model = perturbed(model_py.build_model(cfg))
    batch = batch_of(PAIRS, tokenizer)
    lengths = batch["chosen_attention_mask"].sum(1).tolist()
    lengths += batch["rejected_attention_mask"].sum(1).tolist()
    assert len(set(lengths)) > 4  # padding: the rows are of different lengths
    with torch.no_grad():
        output = model(**batch)
    policy, reference = perturbed(hub_model(chat_llama)), hub_model(chat_llama)
    expected = {"loss": [], "accuracy": [], "margin": [], "pi_c": [], "pi_r": [], "ref_c": []}
    for pair in map(as_conversation, PAIRS):
        pi_c, n_c = alone(policy, tokenizer, pair["prompt"], pair["chosen"])
        pi_r, n_r = alone(policy, tokenizer, pair["prompt"], pair["rejected"])
        ref_c, _ = alone(reference, tokenizer, pair["prompt"], pair["chosen"])
        ref_r, _ = alone(reference, tokenizer, pair["prompt"], pair["rejected"])
        numbers = (pi_c, pi_r, ref_c, ref_r, n_c, n_r)
        expected["loss"].append(paper_loss(kind, beta, eps, 0.5, *numbers))
        chosen, rejected = paper_rewards(kind, beta, *numbers)
        expected["accuracy"].append(float(chosen > rejected))
        expected["margin"].append(chosen - rejected)
        expected["pi_c"].append(pi_c)
        expected["pi_r"].append(pi_r)
        expected["ref_c"].append(ref_c)
    assert 0 < sum(expected["accuracy"]) < len(PAIRS)  # some pairs each way: accuracy is tested
    columns = model_py.eval_columns(output, batch)
    found = {
        "loss": columns["loss"],
        "accuracy": columns["reward_accuracy"],
        "margin": columns["reward_margin"],
        "pi_c": columns["chosen_logps"],
        "pi_r": columns["rejected_logps"],
    }
    if kind != "simpo":
        found["ref_c"] = columns["ref_chosen_logps"]
    for name, values in found.items():
        torch.testing.assert_close(
            values, torch.tensor(expected[name], dtype=torch.float64), rtol=0, atol=2e-5, msg=name
        )
    assert abs(output.loss.item() - sum(expected["loss"]) / len(PAIRS)) < 2e-5
    # the template's eval: the columns' sums over the set, turned into metrics; its loss is .loss
    sums = {name: values.sum().item() for name, values in columns.items()}
    metrics = model_py.eval_metrics(sums, cfg)
    assert abs(metrics["loss"] - output.loss.item()) < 1e-6
    assert metrics["reward_accuracy"] == sum(expected["accuracy"]) / len(PAIRS)
    assert model_py.loss_items(batch) == len(PAIRS)


def test_the_eval_s_metrics_are_each_column_s_mean_per_pair_and_not_the_pair_count():
    """The template's eval sums each column over the set; the metrics are those sums per pair,
    worked here, with one pair alone (its own numbers) as with several."""
    eval_metrics = example("model").eval_metrics
    sums = {
        "pairs": 1.0,
        "loss": 0.75,
        "reward_accuracy": 1.0,
        "reward_margin": 0.5,
        "chosen_logps": -12.0,
        "rejected_logps": -15.0,
        "ref_chosen_logps": -13.0,
    }
    assert eval_metrics(sums, Cfg()) == {
        "loss": 0.75,
        "reward_accuracy": 1.0,
        "reward_margin": 0.5,
        "chosen_logps": -12.0,
        "rejected_logps": -15.0,
        "ref_chosen_logps": -13.0,
    }
    sums = {"pairs": 4.0, "loss": 3.0, "reward_accuracy": 3.0, "reward_margin": -1.0}
    assert eval_metrics(sums, Cfg(preference_loss="simpo")) == {
        "loss": 0.75,
        "reward_accuracy": 0.75,
        "reward_margin": -0.25,
    }


def test_the_padded_rows_go_in_with_their_attention_mask(tmp_path, chat_tokenizer):
    """A GPT-2 chat model whose config names a pad token (0, collate's filler): transformers warns
    that the input "may be padded" when a padded row comes without its attention mask, as the
    model's own forward shows here. The policy's and the reference's passes give the batch's mask
    with the rows: no such line. (With the padding at the end, a causal model's numbers would be
    the same without it.)"""
    import logging

    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=128, n_embd=16, n_layer=1, n_head=2, pad_token_id=0
    )
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    model = example("model").build_model(Cfg(hf_model=str(tmp_path)))
    batch = batch_of(PAIRS, tokenizer)
    assert (batch["chosen_attention_mask"][:, -1] == 0).any()  # a row ends in padding
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with torch.no_grad():
            logging.Logger.warning_once.cache_clear()  # transformers says each warning once
            model(input_ids=batch["chosen_input_ids"])
            assert any("may be padded" in line for line in said)  # the line, seen here
            said.clear()
            logging.Logger.warning_once.cache_clear()
            model(**batch)
    finally:
        logger.removeHandler(handler)
    assert not any("may be padded" in line for line in said), said


def test_without_pairs_the_forward_is_the_hugging_face_model_s(chat_llama):
    """Generation and sampling call the model with input_ids alone: its own forward, unchanged."""
    model = example("model").build_model(Cfg(hf_model=str(chat_llama)))
    ids = torch.tensor([[5, 9, 14, 3, 7]])
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids).logits, hub_model(chat_llama)(input_ids=ids).logits, rtol=0, atol=0
        )
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 8)
    # training's forward keeps no key/value cache (generate() above asks for its own)
    assert model(input_ids=ids).past_key_values is None


def test_a_completion_s_log_prob_is_the_sum_of_its_counted_tokens_log_softmax():
    """completion_logps against log_softmax and the label picked here, position t predicting label
    t + 1, -100 not counted; the token ids include 0 (GPT-2's "!", a Llama's <unk>) as a counted
    label, and the labels' -100 at the padding as at the prompt."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=generator)
    labels = torch.tensor([[-100, -100, 0, 4, 0], [-100, 3, 1, -100, -100]])
    sums, counts = example("model").completion_logps(logits, labels)
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    expected = [
        log_probs[0, 1, 0] + log_probs[0, 2, 4] + log_probs[0, 3, 0],
        log_probs[1, 0, 3] + log_probs[1, 1, 1],
    ]
    torch.testing.assert_close(sums.double(), torch.stack(expected), rtol=0, atol=1e-5)
    assert counts.tolist() == [3, 2]


# ---------------------------------------------------------------- the reference never moves


def train_steps(model, batch, steps: int = 3) -> None:
    """A few AdamW steps on the preference loss, on what the template's optimizer takes: the
    parameters that require gradients."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    model.train()
    for _ in range(steps):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def log_probs(model, batch) -> dict:
    model.eval()
    with torch.no_grad():
        output = model(**batch)
    model.train()
    return {
        "policy": (output.chosen_logps, output.rejected_logps),
        "reference": (output.ref_chosen_logps, output.ref_rejected_logps),
    }


def test_the_frozen_reference_stays_bitwise_while_the_policy_trains_and_is_not_in_the_model(
    chat_llama, chat_tokenizer
):
    from transformers import AutoTokenizer

    model_py = example("model")
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    model = model_py.build_model(Cfg(hf_model=str(chat_llama)))
    batch = batch_of(PAIRS, tokenizer)
    with torch.no_grad():
        start = model(**batch)
    # at the start the policy is its reference: each pair's DPO loss is log 2, and no chosen's
    # reward is above its rejected's (a tie is not, as TRL counts it)
    assert start.losses.tolist() == pytest.approx([math.log(2)] * len(PAIRS), abs=1e-6)
    assert model_py.eval_columns(start, batch)["reward_accuracy"].sum() == 0
    before = log_probs(model, batch)
    train_steps(model, batch)
    after = log_probs(model, batch)
    assert not torch.equal(after["policy"][0], before["policy"][0])  # the policy moved
    for was, now in zip(before["reference"], after["reference"], strict=True):
        assert torch.equal(was, now)  # the reference did not, to the bit
    # and it is the model as loaded (an independent run of the hub model alone)
    pair = as_conversation(PAIRS[0])
    expected, _ = alone(hub_model(chat_llama), tokenizer, pair["prompt"], pair["chosen"])
    assert abs(after["reference"][0][0].item() - expected) < 2e-5
    # out of the model's tree: its state_dict, parameters (the optimizer's) and modules are the
    # Hugging Face model's alone
    plain = hub_model(chat_llama)
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in plain.parameters())
    assert len(list(model.modules())) == len(list(plain.modules()))
    frozen = model.preference.frozen
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())


def test_the_frozen_reference_moves_to_the_batch_s_device_at_its_first_use_only(
    chat_llama, chat_tokenizer
):
    """build_model leaves the copy where it was loaded (the CPU); the template then moves the model
    alone to the GPU. Here the copy is on 'meta', another device than the batch's CPU: the first
    forward moves it to the batch's device once (its move recorded, the weights as loaded put back),
    and its log-probs are then the policy's (at the start the two are one model); the next forward
    moves nothing."""
    import copy

    from transformers import AutoTokenizer

    model_py = example("model")
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    model = model_py.build_model(Cfg(hf_model=str(chat_llama)))
    frozen = model.preference.frozen
    loaded = copy.deepcopy(frozen)
    frozen.to("meta")
    moves = []

    def to(device):
        moves.append(device)
        for mine, kept in zip(frozen.modules(), loaded.modules(), strict=True):
            mine._parameters.update(kept._parameters)
            mine._buffers.update(kept._buffers)
        return frozen

    frozen.to = to
    batch = batch_of(PAIRS[:1], tokenizer)
    with torch.no_grad():
        output = model(**batch)
    assert moves == [torch.device("cpu")]
    assert next(frozen.parameters()).device == torch.device("cpu")
    # at the start the policy is its reference: the same log-probs, the policy's from its own pass
    torch.testing.assert_close(output.ref_chosen_logps, output.chosen_logps, rtol=0, atol=1e-6)
    torch.testing.assert_close(output.ref_rejected_logps, output.rejected_logps, rtol=0, atol=1e-6)
    with torch.no_grad():
        model(**batch)
    assert moves == [torch.device("cpu")]  # on the batch's device already: not moved again


def lora_cfg(chat_llama, **overrides) -> Cfg:
    return Cfg(hf_model=str(chat_llama), lora_r=4, lora_alpha=8.0, **overrides)


def test_with_lora_the_reference_is_the_model_with_adapters_off_and_the_pass_leaves_them_on(
    chat_llama, chat_tokenizer
):
    """The template adds adapters after build_model (adapters.add_lora): the reference is then the
    same model with its adapters skipped, no copy. After training, its log-probs are bitwise those
    of the start and the base model's alone; the reference pass leaves the adapters on (the
    policy's log-probs after it equal those before) and what trains as it was."""
    from transformers import AutoTokenizer

    from adapters import add_lora

    model_py = example("model")
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    cfg = lora_cfg(chat_llama)
    model = add_lora(model_py.build_model(cfg), cfg)
    assert model.preference.frozen is None  # no copy with LoRA
    batch = batch_of(PAIRS, tokenizer)
    before = log_probs(model, batch)
    train_steps(model, batch)
    trains = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trains and all(".lora_" in name for name in trains)
    chosen_rows = {
        "input_ids": batch["chosen_input_ids"],
        "attention_mask": batch["chosen_attention_mask"],
    }
    model.eval()
    with torch.no_grad():
        policy_before = model(**chosen_rows).logits  # the model's own forward: adapters on
        evaluated = model(**batch)  # the reference pass runs inside
        policy_after = model(**chosen_rows).logits
    model.train()
    assert torch.equal(policy_before, policy_after)  # the adapters are on again
    # a training forward with dropout in the model: the reference pass runs in eval mode (its
    # log-probs those of the eval forward, to the bit) and leaves the model training
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.5
    output = model(**batch)
    assert torch.equal(output.ref_chosen_logps, evaluated.ref_chosen_logps)
    assert all(module.training for module in model.modules())
    assert output.loss.requires_grad and not output.ref_chosen_logps.requires_grad
    assert {name for name, p in model.named_parameters() if p.requires_grad} == trains
    assert not torch.equal(evaluated.chosen_logps, before["policy"][0])  # the adapters trained
    for was, now in zip(
        before["reference"], (evaluated.ref_chosen_logps, evaluated.ref_rejected_logps), strict=True
    ):
        assert torch.equal(was, now)
    pair = as_conversation(PAIRS[1])
    expected, _ = alone(hub_model(chat_llama), tokenizer, pair["prompt"], pair["chosen"])
    assert abs(evaluated.ref_chosen_logps[1].item() - expected) < 2e-5


def test_the_reference_digest_follows_the_reference_weights_not_the_policy(
    chat_llama, chat_tokenizer, capsys
):
    from transformers import AutoTokenizer

    from adapters import add_lora

    model_py = example("model")
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    batch = batch_of(PAIRS[:2], tokenizer)
    model = model_py.build_model(Cfg(hf_model=str(chat_llama)))
    digest = model_py.identity(model)["reference"]
    said = capsys.readouterr().out
    assert f"reference: a frozen copy of {chat_llama} as loaded (" in said
    assert f"weights digest {digest}\n" in said
    train_steps(model, batch)
    assert model_py.identity(model) == {"reference": digest}  # the policy trained: unchanged
    with torch.no_grad():
        next(model.preference.frozen.parameters())[0, 0] += 1e-3
    assert model_py.identity(model)["reference"] != digest  # other reference weights
    # with LoRA: the base weights as built, named as without adapters (the same digest)
    cfg = lora_cfg(chat_llama)
    adapted = add_lora(model_py.build_model(cfg), cfg)
    assert model_py.identity(adapted) == {"reference": digest}
    assert "with its LoRA adapters off (no copy), weights digest" in capsys.readouterr().out
    train_steps(adapted, batch)
    assert model_py.identity(adapted) == {"reference": digest}  # the adapters trained: unchanged
    with torch.no_grad():
        adapted.model.layers[0].self_attn.q_proj.base_layer.weight[0, 0] += 1e-3
    assert model_py.identity(adapted)["reference"] != digest
    simpo = model_py.build_model(Cfg(hf_model=str(chat_llama), preference_loss="simpo"))
    assert simpo.preference.frozen is None and model_py.identity(simpo) == {}
    assert capsys.readouterr().out.endswith("reference: none (simpo is reference-free)\n")


def test_the_frozen_copy_s_size_is_its_bytes_in_gib(monkeypatch, capsys):
    """The start-up line's size of the frozen copy: a stand-in on 'meta' (no memory) of
    3 x 2^28 fp32 weights and 2^28 bf16 ones, by hand 2^30 parameters and
    3 x 2^28 x 4 + 2^28 x 2 bytes = 3.5 x 2^30 bytes, 3.50 GiB (its digest stubbed: meta has no
    bytes to hash)."""
    model_py = example("model")
    frozen = torch.nn.Module()
    frozen.wide = torch.nn.Parameter(torch.empty(3 * 2**28, device="meta"), requires_grad=False)
    half = torch.empty(2**28, device="meta", dtype=torch.bfloat16)
    frozen.narrow = torch.nn.Parameter(half, requires_grad=False)
    monkeypatch.setattr(model_py, "weights_digest", lambda weights: "0123abcd")
    model = torch.nn.Module()
    model.preference = model_py.Preference(Cfg(hf_model="org/chat-7b"), frozen)
    assert model_py.identity(model) == {"reference": "0123abcd"}
    assert capsys.readouterr().out == (
        "reference: a frozen copy of org/chat-7b as loaded (1,073,741,824 parameters, 3.50 GiB on "
        "each process), weights digest 0123abcd\n"
    )


# ---------------------------------------------------------------- the data


def scored(batch: dict, side: str, row: int) -> list[int]:
    return [t for t in batch[f"{side}_labels"][row].tolist() if t != -100]


def test_only_the_completion_s_tokens_are_scored_and_they_are_the_assistant_s_answer(
    chat_tokenizer,
):
    """Each pair through the chat template: the prompt's tokens (with the generation prompt) are
    the template's own, and the scored tokens decode to the assistant's answer and its end of
    turn, whatever shape the pair came in (a string, turns, turns that repeat the prompt)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    batch = batch_of(PAIRS, tokenizer)
    answers = {
        "chosen": ["enots revir", "MAPLE", "TIGER OCEAN", "rebme"],
        "rejected": [
            "river stone",
            "maple, in capitals: MAPLE, as you asked",
            "tiger",
            "ember ember ember",
        ],
    }
    for row, pair in enumerate(map(as_conversation, PAIRS)):
        prompt = tokenizer.apply_chat_template(
            pair["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for side in ("chosen", "rejected"):
            assert tokenizer.decode(scored(batch, side, row)) == f"{answers[side][row]}<|im_end|>\n"
            ids = batch[f"{side}_input_ids"][row].tolist()
            assert ids[: len(prompt)] == prompt
            assert batch[f"{side}_labels"][row, : len(prompt)].eq(-100).all()
            length = int(batch[f"{side}_attention_mask"][row].sum())
            assert batch[f"{side}_labels"][row, length:].eq(-100).all()  # padding: not scored


def test_a_local_folder_s_validation_file_is_the_eval_set_and_long_completions_are_cut(
    tmp_path, chat_llama, capsys
):
    data = example("data")
    folder = tmp_path / "pairs"
    long_answer = "a long answer " * 20
    train_rows = [
        {"prompt": f"upper: w{i}", "chosen": f"W{i}", "rejected": long_answer if i < 3 else f"w{i}"}
        for i in range(10)
    ]
    write_jsonl(folder / "train.jsonl", train_rows)
    write_jsonl(folder / "validation.jsonl", train_rows[5:8])
    cfg = Cfg(hf_model=str(chat_llama), dataset=str(folder), block_size=40)
    train, held_out = data.build_datasets(cfg)
    assert (len(train), len(held_out)) == (10, 3)
    assert all(len(row["rejected_input_ids"]) <= 40 for row in train)
    out, err = capsys.readouterr()
    assert f"eval set: the validation split of {folder} (3 pairs)\n" in out
    assert err.count("warning:") == 1
    assert (
        "warning: 3 train completion(s) were cut to fit block_size 40 tokens with their prompt (their "
        "end is not scored): raise block_size to keep them whole\n"
    ) in err


def test_a_completion_of_block_size_tokens_is_whole_and_each_cut_completion_counts(
    tmp_path, chat_llama, capfd
):
    """block_size the tokens of a pair's prompt and chosen answer together, by transformers'
    apply_chat_template: that answer is kept whole and not counted as cut; a pair with both answers
    longer counts 2, one with its chosen alone longer 1 (one warning line for the part: 3). Each
    part's tokenizing says so on its progress bar (datasets' default: "Map"), and the tokenized
    pairs' cache file (datasets' own, on disk) holds their tokens, not their text again."""
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_llama)

    def tokens(messages, **kwargs):
        return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)[
            "input_ids"
        ]

    edge = {"prompt": "upper: maple tiger", "chosen": "MAPLE TIGER", "rejected": "maple"}
    prompt = tokens([user(edge["prompt"])], add_generation_prompt=True)
    whole = tokens([user(edge["prompt"]), assistant(edge["chosen"])])
    block_size = len(whole)
    assert len(tokens([user(edge["prompt"]), assistant(edge["rejected"])])) < block_size
    long = "river stone " * 10
    assert len(tokens([user("say"), assistant(long)])) > block_size
    both_long = {"prompt": "say", "chosen": long, "rejected": long + "again"}
    chosen_long = {"prompt": "say", "chosen": long, "rejected": "no"}
    folder = tmp_path / "pairs"
    write_jsonl(folder / "train.jsonl", [edge, both_long, chosen_long])
    write_jsonl(folder / "validation.jsonl", [edge])
    cfg = Cfg(hf_model=str(chat_llama), dataset=str(folder), block_size=block_size)
    train, held_out = example("data").build_datasets(cfg)
    for row in (train[0], held_out[0]):
        assert row["chosen_input_ids"].tolist() == whole
        assert row["chosen_labels"].tolist() == [-100] * len(prompt) + whole[len(prompt) :]
    err = capfd.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("warning:")] == [
        f"warning: 3 train completion(s) were cut to fit block_size {block_size} tokens with their "
        "prompt (their end is not scored): raise block_size to keep them whole"
    ]
    bars = err.replace("\r", "\n").splitlines()
    for part, rows_done in (("train", "3/3"), ("eval", "1/1")):
        said = f"tokenizing {part} pairs: 100%"
        assert any(bar.startswith(said) and rows_done in bar for bar in bars), bars
    for part in (train, held_out):
        (cache,) = part.cache_files
        written = datasets.Dataset.from_file(cache["filename"]).column_names
        assert sorted(written) == sorted(["cut", *example("data").COLUMNS])


def test_a_sibling_split_is_the_eval_set(chat_llama):
    """ultrafeedback_binarized's train_prefs has its eval set in test_prefs (not test)."""
    from chat import eval_split_name

    splits = dict.fromkeys(["train_prefs", "train_sft", "test_prefs", "test_sft"])
    assert eval_split_name(splits, Cfg(dataset_split="train_prefs")) == "test_prefs"
    assert eval_split_name({"train": 0, "test": 0}, Cfg()) == "test"
    assert eval_split_name({"train": 0, "other": 0}, Cfg()) is None


def bad_pairs(tmp_path, third) -> Path:
    good = {"prompt": "upper: a", "chosen": "A", "rejected": "a"}
    return write_jsonl(tmp_path / "pairs.jsonl", [good, good, third, good])


@pytest.mark.parametrize(
    "third, said",
    [
        (
            {"prompt": "upper: b", "chosen": "B", "rejected": "B"},
            "line 3: its chosen and rejected completions are the same: a pair must differ to say "
            "which answer is preferred",
        ),
        (
            {"prompt": "upper: b", "chosen": "B", "answer": "b"},
            "line 3 has no 'rejected': a preference pair is a prompt, a chosen and a rejected "
            "completion (it has: prompt, chosen, answer)",
        ),
        (
            {"prompt": "upper: b", "chosen": [user("upper: c"), assistant("C")], "rejected": "b"},
            "line 3: its chosen does not answer the prompt: what follows the prompt's turns must be "
            "the assistant's (roles: user, assistant)",
        ),
        (
            {"prompt": "upper: b", "chosen": 7, "rejected": "b"},
            "line 3: its chosen must be a string or a list of chat messages (got int)",
        ),
        (
            {},
            "line 3 has no 'prompt' or 'chosen' or 'rejected': a preference pair is a prompt, a "
            "chosen and a rejected completion (it has: nothing)",
        ),
        (
            {"prompt": 7, "chosen": "B", "rejected": "b"},
            "line 3: its prompt must be a string or a list of chat messages (got int)",
        ),
        (
            {"prompt": [], "chosen": "B", "rejected": "b"},
            "line 3: its prompt must be a string or a list of chat messages (got an empty list)",
        ),
        (
            {"prompt": "upper: b", "chosen": [], "rejected": "b"},
            "line 3: its chosen must be a string or a list of chat messages (got an empty list)",
        ),
        (
            {"prompt": "upper: b", "chosen": [user("upper: b")], "rejected": "b"},
            "line 3: its chosen does not answer the prompt: what follows the prompt's turns must be "
            "the assistant's (roles: user)",
        ),
        (
            {"prompt": "upper: b", "chosen": [{"content": "B"}], "rejected": "b"},
            "line 3: every message needs a 'role' and a 'content' string",
        ),
    ],
    ids=[
        "chosen is rejected",
        "no rejected",
        "not an answer",
        "a number",
        "no column",
        "a number for a prompt",
        "no prompt turn",
        "no chosen turn",
        "the prompt alone",
        "no role",
    ],
)
def test_a_bad_pair_is_one_line_naming_its_line(tmp_path, chat_llama, third, said):
    path = bad_pairs(tmp_path, third)
    with pytest.raises(ConfigError) as refused:
        example("data").build_datasets(Cfg(hf_model=str(chat_llama), dataset=str(path)))
    assert str(refused.value) == f"dataset: {path} {said}"


# a template that rewrites the conversation (its count of turns first: refused at the first pair),
# and one that writes the contents alone, an empty one nothing
COUNTING = "{{ messages | length }}{% for m in messages %}{{ m['content'] + '\\n' }}{% endfor %}"
CONTENTS = (
    "{% for m in messages %}{% if m['content'] %}{{ m['content'] + '\\n' }}{% endif %}{% endfor %}"
)


@pytest.mark.parametrize(
    "template, third, said",
    [
        (
            COUNTING,
            {"prompt": "upper: b", "chosen": "B", "rejected": "b"},
            "tokenizer '{tokenizer}': its chat template does not render a conversation turn by turn "
            "as prefixes of one another (it rewrites earlier turns), so the assistant's tokens "
            "cannot be told from the prompt's",
        ),
        (
            CONTENTS,
            {"prompt": "upper: b", "chosen": "", "rejected": "b"},
            "dataset: {path} line 3: its chosen completion renders to no token",
        ),
    ],
    ids=["not prefixes", "no token"],
)
def test_a_pair_its_chat_template_cannot_split_is_one_line(
    tmp_path, chat_tokenizer, template, third, said
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    tokenizer.chat_template = template
    folder = tmp_path / "tokenizer"
    tokenizer.save_pretrained(folder)
    path = bad_pairs(tmp_path, third)
    with pytest.raises(ConfigError) as refused:
        example("data").build_datasets(Cfg(hf_model=str(folder), dataset=str(path)))
    assert str(refused.value) == said.format(tokenizer=folder, path=path)


def test_a_completion_s_end_of_turn_is_the_one_the_template_writes_without_a_generation_prompt(
    chat_tokenizer,
):
    """A template that ends the last assistant turn only where no generation prompt is asked for,
    by `add_generation_prompt == false` (as some do): the pair's tokens are apply_chat_template's
    of the conversation, its scored tokens the answer and its end of turn."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    tokenizer.chat_template = END_OF_TURN_ONLY_WITHOUT_A_PROMPT
    data = example("data")
    pair = {"prompt": "upper: b", "chosen": "B", "rejected": "b"}
    encoded = data.encode_pair(data.pair_row(pair, "pair 1"), tokenizer, 128)
    prompt = tokenizer.apply_chat_template(
        [user("upper: b")], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    for side, answer in (("chosen", "B"), ("rejected", "b")):
        whole = tokenizer.apply_chat_template(
            [user("upper: b"), assistant(answer)], tokenize=True, return_dict=True
        )["input_ids"]
        assert encoded[f"{side}_input_ids"] == whole
        assert encoded[f"{side}_labels"] == [-100] * len(prompt) + whole[len(prompt) :]
        assert tokenizer.decode(whole[len(prompt) :]) == f"{answer}<|im_end|>\n"


def test_a_table_without_a_pair_s_columns_names_the_columns_it_has(tmp_path, chat_llama):
    path = tmp_path / "pairs.csv"
    path.write_text("prompt,chosen,score\nupper: a,A,1\nupper: b,B,2\n")
    with pytest.raises(ConfigError) as refused:
        example("data").build_datasets(Cfg(hf_model=str(chat_llama), dataset=str(path)))
    assert str(refused.value) == (
        f"dataset '{path}' has no 'rejected' column: a preference pair is a prompt, a chosen and a "
        "rejected completion (columns: prompt, chosen, score)"
    )


def test_a_prompt_that_leaves_no_room_for_its_completion_is_one_line(tmp_path, chat_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_llama)
    question = "upper: " + "many words " * 10
    prompt_tokens = len(
        tokenizer.apply_chat_template(
            [user(question)], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )
    path = bad_pairs(tmp_path, {"prompt": question, "chosen": "B", "rejected": "b"})
    block_size = prompt_tokens  # the prompt fills it: 0 tokens left for the completion
    cfg = Cfg(hf_model=str(chat_llama), dataset=str(path), block_size=block_size)
    with pytest.raises(ConfigError) as refused:
        example("data").build_datasets(cfg)
    assert str(refused.value) == (
        f"dataset: {path} line 3: its prompt is {prompt_tokens} tokens, which leaves its chosen "
        f"completion no token in block_size {block_size}: raise block_size (it bounds a prompt "
        "and a completion together)"
    )
    # one more token: the completion keeps its first (never a pair of 0 tokens)
    data = example("data")
    both = data.build_datasets(replace(cfg, block_size=block_size + 1))
    kept = [len(scored(data.collate([row]), "chosen", 0)) for part in both for row in part]
    assert min(kept) == 1


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            {"dataset": ""},
            "dataset: pass --dataset, preference pairs with prompt, chosen and "
            "rejected columns (a JSON lines file, a folder, or a hub name such as "
            "HuggingFaceH4/ultrafeedback_binarized with --dataset_split train_prefs)",
        ),
        ({"block_size": 0}, "block_size must be > 0 (got 0)"),
    ],
)
def test_the_data_s_keys_are_refused_in_one_line(overrides, line):
    cfg = replace(Cfg(hf_model="m", dataset="pairs.jsonl"), **overrides)
    with pytest.raises(ConfigError) as refused:
        example("data").check_config(cfg)
    assert str(refused.value) == line


def test_a_block_size_of_one_token_is_a_size():
    """block_size must be > 0: 1 passes the start-up check (a pair then finds its prompt too long)."""
    example("data").check_config(Cfg(hf_model="m", dataset="pairs.jsonl", block_size=1))


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            {"hf_model": ""},
            "hf_model: preference tuning starts from a Hugging Face chat model, "
            "usually an SFT run's export: pass --hf_model RUN_FOLDER_OR_NAME",
        ),
        (
            {"init_from": "runs/sft"},
            "init_from: the reference is the weights the run starts from, "
            "loaded from --hf_model; pass the SFT run's exported folder as --hf_model instead (with "
            "--merge_adapter true if it trained adapters) (got 'runs/sft')",
        ),
        (
            {"model_weights": "config"},
            "model_weights: preference tuning starts from trained "
            "weights, its reference (got 'config')",
        ),
        (
            {"preference_loss": "dpo"},
            "preference_loss must be one of sigmoid, ipo, simpo (got 'dpo')",
        ),
        ({"beta": 0.0}, "beta must be > 0 (DPO's usual 0.1) (got 0.0)"),
        ({"beta": -0.1}, "beta must be > 0 (DPO's usual 0.1) (got -0.1)"),
        ({"label_smoothing": 0.5}, "label_smoothing must be in [0, 0.5) (got 0.5)"),
        (
            {"label_smoothing": 0.1, "preference_loss": "ipo"},
            "label_smoothing is cDPO's, for preference_loss sigmoid only (got 0.1 with ipo)",
        ),
        ({"simpo_gamma": math.inf}, "simpo_gamma must be a finite number (got inf)"),
    ],
)
def test_the_model_s_keys_are_refused_in_one_line(overrides, line):
    cfg = replace(Cfg(hf_model="m", dataset="pairs.jsonl"), **overrides)
    with pytest.raises(ConfigError) as refused:
        example("model").check_config(cfg)
    assert str(refused.value) == line


@pytest.mark.parametrize(
    "overrides",
    [
        {"preference_loss": "sigmoid", "label_smoothing": 0.1},  # cDPO
        {"preference_loss": "ipo", "label_smoothing": 0.0},
        {"preference_loss": "simpo", "label_smoothing": 0.0, "beta": 2.0},
    ],
)
def test_label_smoothing_is_accepted_with_sigmoid_and_its_zero_with_each_loss(overrides):
    example("model").check_config(replace(Cfg(hf_model="m", dataset="pairs.jsonl"), **overrides))


def test_an_sft_run_s_adapter_folder_is_refused_as_the_start(tmp_path):
    """transformers loads an adapter folder as its base with the adapter on: the reference would
    then be the base model (adapters off), not the SFT model (LLaMA-Factory #8459's bug)."""
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError) as refused:
        example("model").check_config(Cfg(hf_model=str(tmp_path)))
    assert str(refused.value) == (
        f"hf_model: '{tmp_path}' holds a LoRA adapter, not a whole model: export the SFT run merged "
        "(--merge_adapter true) and pass that folder, the reference must be the SFT model itself"
    )


# ---------------------------------------------------------------- TRL, on the same model and pairs


def test_the_loss_and_reward_accuracy_are_trl_s_dpo_trainer_s(tmp_path, chat_llama):
    """TRL's DPOTrainer on the same tiny model, pairs and beta: its loss and reward metrics on one
    batch, with a policy that has left its reference (at the very first step the two are the same
    model and every DPO loss is log 2)."""
    trl = pytest.importorskip("trl", reason="python -m pip install -r requirements-trl.txt")
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_llama)
    pairs = [as_conversation(pair) for pair in PAIRS]  # TRL's conversational shape
    beta = 0.1
    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=beta,
        per_device_train_batch_size=len(pairs),
        report_to=[],
        use_cpu=True,
        max_length=None,
        bf16=False,  # TRL's default on a machine with bf16: its reference would run in it, ours fp32
    )
    trainer = trl.DPOTrainer(
        model=perturbed(hub_model(chat_llama)),
        ref_model=hub_model(chat_llama),
        args=args,
        train_dataset=datasets.Dataset.from_list(pairs),
        processing_class=tokenizer,
    )
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(pairs))])
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, inputs).item()
    trl_metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    model_py = example("model")
    model = perturbed(model_py.build_model(Cfg(hf_model=str(chat_llama), beta=beta)))
    output = model(**batch_of(pairs, tokenizer))
    columns = model_py.eval_columns(output, {})
    assert abs(output.loss.item() - trl_loss) < 1e-5, (output.loss.item(), trl_loss)
    assert columns["reward_accuracy"].mean().item() == trl_metrics["rewards/accuracies"]
    assert 0 < trl_metrics["rewards/accuracies"] < 1
    for ours, theirs in [
        ("reward_margin", "rewards/margins"),
        ("chosen_logps", "logps/chosen"),
        ("rejected_logps", "logps/rejected"),
    ]:
        assert abs(columns[ours].mean().item() - trl_metrics[theirs]) < 1e-4, ours
