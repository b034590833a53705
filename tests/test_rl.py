"""The RL example (examples/rl: GRPO, DAPO, Dr. GRPO), through its own files as a fork runs them, each
against a number worked out another way: each loss and its gradient against the formula written here
in float64, token by token, each sequence run alone (no padding); a step's loss over micro-batches and
two ranks, weighed by the template's loss_weights, against the formula over the whole step; the
advantages against each group's rewards worked out here from the decoded completions (statistics'
mean and stdev); the log-probs recorded at generation against a forward of the same tokens by the
policy as it is at that step (after an update, not before); the same (seed, step, prompt) giving the
same tokens; each sampled token the argmax of its tempered, top_p-filtered log-probs plus Gumbel noise
from its completion's own seed, both worked out here; a prompt's completions the same alone and at
another row of a padded batch; each split's prompt_index against the file's order; the eval's
pass_rate and completion_tokens against an oracle model's known completion; Gumbel-max's
frequencies against softmax(logits / temperature); and each bad input's one line. No download: the
tiny chat Llama of conftest."""

import hashlib
import json
import math
import statistics
import types
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from conftest import example_file
from errors import ConfigError, RunError


def example(name: str):
    """The example's model.py or data.py as a module of its own (train/ keeps `model` and `data`)."""
    return example_file("rl", name)


@dataclass(frozen=True)
class Cfg:
    """The keys the example's files read: the template's, and its ModelConfig's."""

    hf_model: str = ""
    dataset: str = ""
    dataset_config: str = ""
    dataset_split: str = "train"
    eval_fraction: float = 0.25
    model_weights: str = "pretrained"
    init_from: str = ""
    lora_r: int = 0
    fsdp: str = "no"
    seed: int = 1337
    rl_loss: str = "grpo"
    reward_weights: str = "exact_answer:1,word_order:0.5,same_words:0.25"
    num_generations: int = 3
    max_new_tokens: int = 6
    temperature: float = 0.7
    top_p: float = 1.0
    scale_rewards: str = "group"
    epsilon: float = 0.2
    epsilon_high: float = 0.28
    beta: float = 0.0
    updates_per_rollout: int = 1

    @property
    def tokenizer_name(self) -> str:
        return self.hf_model


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ---------------------------------------------------------------- the losses, in float64

# a step's rows, by hand: prompts of different lengths (left-padded in the batch), completions of
# max_new_tokens tokens of which the first `counted` count (the rest follow the end of the turn)
PROMPTS = [[5, 17, 9, 40, 41], [7, 3, 99, 12, 18, 27, 33, 2]]
COUNTED = [[6, 2, 4], [1, 5, 6]]  # per prompt, per completion (G = 3)
ADVANTAGES = [[1.2, -0.7, -0.5], [0.3, 0.9, -1.2]]


def hand_rows(vocab: int, cfg) -> list[dict]:
    """The rows: prompt, completion (max_new_tokens ids), counted, advantage, and offsets that make
    old and reference log-probs differ from the policy's (some ratios beyond the clip range)."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for p, prompt in enumerate(PROMPTS):
        for g in range(cfg.num_generations):
            completion = torch.randint(10, vocab, (cfg.max_new_tokens,), generator=generator)
            offsets = (
                torch.rand(cfg.max_new_tokens, generator=generator, dtype=torch.float64) - 0.5
            ) * 0.8
            to_ref = torch.rand(cfg.max_new_tokens, generator=generator, dtype=torch.float64) - 0.5
            rows.append(
                {
                    "prompt": prompt,
                    "completion": completion.tolist(),
                    "counted": COUNTED[p][g],
                    "advantage": ADVANTAGES[p][g],
                    "old_offset": offsets.tolist(),
                    "ref_offset": to_ref.tolist(),
                }
            )
    return rows


def alone_logps(model, row: dict, temperature: float) -> list:
    """Each counted completion token's log-prob, the sequence run alone (no padding), float64
    log_softmax of logits / temperature: a list of 0-d tensors (with their graph)."""
    ids = torch.tensor([row["prompt"] + row["completion"][: row["counted"]]])
    logits = type(model).forward(model, input_ids=ids).logits[0].double()
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    start = len(row["prompt"])
    return [log_probs[start + t - 1, ids[0, start + t]] for t in range(row["counted"])]


def formula_loss(model, rows: list[dict], cfg, old: dict, ref: dict):
    """The module docstring's formula, token by token, in float64: old[i] and ref[i] the row's old
    and reference log-probs (lists of floats)."""
    per_row = []
    for i, row in enumerate(rows):
        terms = []
        for t, logp in enumerate(alone_logps(model, row, cfg.temperature)):
            old_t = (
                logp.detach()
                if cfg.updates_per_rollout == 1
                else torch.tensor(old[i][t], dtype=torch.float64)
            )
            ratio = torch.exp(logp - old_t)
            a = row["advantage"]
            clipped = torch.clamp(ratio, 1 - cfg.epsilon, 1 + cfg.epsilon_high)
            term = -torch.minimum(ratio * a, clipped * a)
            if cfg.beta > 0:
                d = torch.tensor(ref[i][t], dtype=torch.float64) - logp
                term = term + cfg.beta * (torch.exp(d) - d - 1)
            terms.append(term)
        per_row.append(terms)
    if cfg.rl_loss == "grpo":
        return sum(sum(terms) / len(terms) for terms in per_row) / len(per_row)
    total = sum(sum(terms) for terms in per_row)
    if cfg.rl_loss == "dapo":
        return total / sum(len(terms) for terms in per_row)
    return total / (len(per_row) * cfg.max_new_tokens)  # dr_grpo


def old_and_ref(model, rows, cfg) -> tuple[dict, dict]:
    """The rows' old and reference log-probs: the policy's now, offset by hand."""
    old, ref = {}, {}
    with torch.no_grad():
        for i, row in enumerate(rows):
            logps = [float(x) for x in alone_logps(model, row, cfg.temperature)]
            old[i] = [x + o for x, o in zip(logps, row["old_offset"], strict=False)]
            ref[i] = [x + o for x, o in zip(logps, row["ref_offset"], strict=False)]
    return old, ref


def example_batch(rows: list[dict], cfg, old: dict, ref: dict, pad: int = 0) -> dict:
    """The rows as the example's rollout gives them to the forward: prompts left-padded, each
    completion whole (its tokens after the end of turn masked), advantages, old and reference
    log-probs (0 where not counted), and items (loss_items)."""
    longest = max(len(row["prompt"]) for row in rows)
    ids, attention, mask, olds, refs = [], [], [], [], []
    for i, row in enumerate(rows):
        padding = longest - len(row["prompt"])
        ids.append([pad] * padding + row["prompt"] + row["completion"])
        attention.append([0] * padding + [1] * (len(row["prompt"]) + cfg.max_new_tokens))
        mask.append([1] * row["counted"] + [0] * (cfg.max_new_tokens - row["counted"]))
        filler = [0.0] * (cfg.max_new_tokens - row["counted"])
        olds.append(old[i] + filler)
        refs.append(ref[i] + filler)
    counted = sum(row["counted"] for row in rows) if cfg.rl_loss == "dapo" else len(rows)
    batch = {
        "input_ids": torch.tensor(ids),
        "attention_mask": torch.tensor(attention),
        "completion_mask": torch.tensor(mask),
        "advantages": torch.tensor([row["advantage"] for row in rows], dtype=torch.float64),
        "old_logps": torch.tensor(olds, dtype=torch.float64),
        "items": torch.tensor(counted),
    }
    if cfg.beta > 0:  # the rollout computes reference log-probs only for the KL penalty
        batch["ref_logps"] = torch.tensor(refs, dtype=torch.float64)
    return batch


def float64_model(chat_llama, cfg):
    model = example("model").build_model(cfg).double()
    model.train()
    return model


def gradients(model, loss) -> dict:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def relative_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    scale = max(v.abs().max().item() for v in b.values())
    return max((a[k] - b[k]).abs().max().item() for k in a) / scale


SETTINGS = [
    {"rl_loss": loss, "updates_per_rollout": updates, "beta": beta}
    for loss in ("grpo", "dapo", "dr_grpo")
    for updates, beta in ((1, 0.0), (2, 0.1))
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(map(str, s.values())))
def test_each_loss_and_its_gradient_equal_the_formula_in_float64(chat_llama, setting):
    cfg = Cfg(hf_model=str(chat_llama), **setting)
    model = float64_model(chat_llama, cfg)
    rows = hand_rows(model.config.vocab_size, cfg)
    old, ref = old_and_ref(model, rows, cfg)
    loss = model(**example_batch(rows, cfg, old, ref)).loss
    got = gradients(model, loss)
    expected = formula_loss(model, rows, cfg, old, ref)
    wanted = gradients(model, expected)
    assert loss.dtype == torch.float64
    assert abs(loss.item() - expected.item()) <= 1e-12 * max(abs(expected.item()), 1e-3), (
        loss.item(),
        expected.item(),
    )
    assert relative_difference(got, wanted) < 1e-10
    if cfg.updates_per_rollout > 1:  # the offsets put some ratios beyond the clip range
        clipped = [abs(o) > 0.2 for row in rows for o in row["old_offset"][: row["counted"]]]
        assert any(clipped) and not all(clipped)


def test_a_dapo_micro_batch_of_one_counted_token_is_that_token_s_term(chat_llama):
    """dapo divides by the micro-batch's counted tokens, even when there is one."""
    cfg = Cfg(hf_model=str(chat_llama), rl_loss="dapo", updates_per_rollout=2, beta=0.1)
    model = float64_model(chat_llama, cfg)
    row = {**hand_rows(model.config.vocab_size, cfg)[0], "counted": 1}
    old, ref = old_and_ref(model, [row], cfg)
    loss = model(**example_batch([row], cfg, old, ref)).loss
    expected = formula_loss(model, [row], cfg, old, ref)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12, abs=1e-15)


class TwoRanks:
    """The plumbing loss_weights uses, for one of two ranks: the step's items summed over both."""

    device = torch.device("cpu")
    num_processes = 2

    def __init__(self, other_items: int):
        self.other_items = other_items

    def reduce(self, tensor, op):
        assert op == "sum"
        return tensor + self.other_items


@pytest.mark.parametrize("rl_loss", ["grpo", "dapo", "dr_grpo"])
def test_a_step_over_micro_batches_and_ranks_is_the_formula_over_the_whole_step(
    chat_llama, rl_loss, monkeypatch
):
    """2 ranks x 2 micro-batches x 3 rows of different token counts: each rank's loss is what the
    loop backpropagates (sum of weight x .loss / micro-batches), DDP averages the ranks; the
    result is the formula over all 12 rows at once."""
    import batches
    import task

    cfg = Cfg(hf_model=str(chat_llama), rl_loss=rl_loss, updates_per_rollout=2, beta=0.1)
    model = float64_model(chat_llama, cfg)
    rows = hand_rows(model.config.vocab_size, cfg) * 2
    rows = [dict(row, counted=max(1, (row["counted"] + i) % 7)) for i, row in enumerate(rows)]
    old, ref = old_and_ref(model, rows, cfg)
    parts = [list(range(k, k + 3)) for k in (0, 3, 6, 9)]  # rank 0: parts 0, 1; rank 1: 2, 3
    micro = [
        example_batch(
            [rows[i] for i in part],
            cfg,
            {n: old[i] for n, i in enumerate(part)},
            {n: ref[i] for n, i in enumerate(part)},
        )
        for part in parts
    ]
    rl_model = example("model")
    monkeypatch.setattr(task, "fork_file", lambda name: rl_model)
    items = [int(rl_model.loss_items(batch)) for batch in micro]
    step_loss = 0
    for rank in (0, 1):
        mine = micro[2 * rank : 2 * rank + 2]
        other = sum(items) - sum(items[2 * rank : 2 * rank + 2])
        weights = batches.loss_weights(mine, TwoRanks(other))
        rank_loss = sum(w * model(**b).loss for w, b in zip(weights, mine, strict=True)) / 2
        step_loss = step_loss + rank_loss / 2  # DDP's mean over the ranks
    got = gradients(model, step_loss)
    expected = formula_loss(model, rows, cfg, old, ref)
    wanted = gradients(model, expected)
    assert abs(step_loss.item() - expected.item()) <= 1e-12 * abs(expected.item())
    assert relative_difference(got, wanted) < 1e-10


# ---------------------------------------------------------------- the rollout

SORTS = [("sort: river alpha", "alpha river"), ("sort: maple ocean ember", "ember maple ocean")]


def prompt_batch(cfg, pairs=SORTS, indices=None) -> dict:
    """A micro-batch of prompts as the example's data.py makes it, the pairs' prompt_index
    `indices` (else 0, 1, ...: their places)."""
    data = example("data")
    from chat import chat_tokenizer

    tokenizer = chat_tokenizer(cfg)
    indices = range(len(pairs)) if indices is None else indices
    rows = []
    for (prompt, answer), index in zip(pairs, indices, strict=True):
        row = data.prompt_row({"prompt": prompt, "answer": answer}, "by hand")
        rows.append({**data.encode_prompt(row, tokenizer), "prompt_index": index})
    return data.collate(rows)


def characters(completion: str, answer: str) -> float:
    """A reward that differs between random completions: their length in characters."""
    return float(len(completion))


def with_reward(monkeypatch, function):
    """The example's model.py with one more reward function, as a fork writes one in it."""
    rl_model = example("model")
    function.__module__ = rl_model.__name__
    monkeypatch.setattr(rl_model, function.__name__, function, raising=False)
    return rl_model


def decoded(tokenizer, tokens: list[int]) -> str:
    """A completion as text, by the test's own reading: up to its first end of turn."""
    ends = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    cut = next((t for t, token in enumerate(tokens) if token in ends), len(tokens))
    return tokenizer.decode(tokens[:cut])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_each_group_s_rewards_against_its_mean(chat_llama, scale, monkeypatch):
    rl_model = with_reward(monkeypatch, characters)
    cfg = Cfg(
        hf_model=str(chat_llama),
        reward_weights="characters:0.5",
        scale_rewards=scale,
        num_generations=4,
        max_new_tokens=8,
    )
    model = rl_model.build_model(cfg)
    micro = [prompt_batch(cfg), prompt_batch(cfg, SORTS[::-1])]
    trained, values = rl_model.rollout(model, micro, cfg, step=0)
    tokenizer = model.rl.tokenizer
    rewards = []
    for batch in trained:
        prompt = batch["input_ids"].size(1) - cfg.max_new_tokens
        for row in batch["input_ids"][:, prompt:].tolist():
            rewards.append(0.5 * len(decoded(tokenizer, row)))
    groups = [rewards[k : k + 4] for k in range(0, len(rewards), 4)]
    assert len({tuple(group) for group in groups}) > 1 and all(len(set(g)) > 1 for g in groups)
    expected = []
    for group in groups:
        mean = statistics.mean(group)
        std = {"group": statistics.stdev(group), "batch": statistics.stdev(rewards), "none": None}
        for reward in group:
            scale_by = 1.0 if std[scale] is None else std[scale] + 1e-4
            expected.append((reward - mean) / scale_by)
    got = torch.cat([batch["advantages"] for batch in trained]).tolist()
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert values["reward"] == pytest.approx(statistics.mean(rewards), rel=1e-12)
    assert values["reward_std"] == pytest.approx(statistics.stdev(rewards), rel=1e-9)


def forward_logps(model, batch: dict, temperature: float) -> list[list[float]]:
    """Each counted completion token's log-prob by a forward of the whole row alone, float32."""
    out = []
    with torch.no_grad():
        for ids, attention, mask in zip(
            batch["input_ids"], batch["attention_mask"], batch["completion_mask"], strict=True
        ):
            counted = int(mask.sum())
            kept = ids[attention.bool()][: len(ids[attention.bool()]) - len(mask) + counted]
            logits = type(model).forward(model, input_ids=kept[None]).logits[0]
            log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
            start = len(kept) - counted
            out.append([log_probs[start + t - 1, kept[start + t]].item() for t in range(counted)])
    return out


def test_the_log_probs_recorded_at_generation_are_the_current_policy_s(chat_llama):
    """Step 0's rollout records what the model gives its tokens; after an update (the weights moved
    by hand), step 1's records what the moved model gives, not the model before."""
    rl_model = example("model")
    cfg = Cfg(hf_model=str(chat_llama), num_generations=3, max_new_tokens=8)
    model = rl_model.build_model(cfg)
    micro = [prompt_batch(cfg)]
    for step in (0, 1):
        (batch,), _ = rl_model.rollout(model, micro, cfg, step=step)
        recorded = batch["old_logps"]
        wanted = forward_logps(model, batch, cfg.temperature)
        for row, logps in enumerate(wanted):
            assert recorded[row, : len(logps)].tolist() == pytest.approx(logps, abs=2e-5)
        before = wanted
        with torch.no_grad():  # an update
            generator = torch.Generator().manual_seed(step)
            for _, parameter in sorted(model.named_parameters()):
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    stale = forward_logps(model, batch, cfg.temperature)  # the model after another update
    assert (
        max(
            abs(a - b)
            for r, s in zip(before, stale, strict=True)
            for a, b in zip(r, s, strict=True)
        )
        > 1e-3
    )


def test_with_lora_the_reference_is_the_base_model_loaded_fresh_after_the_adapters_moved(
    chat_llama,
):
    """beta > 0 with --lora_r: the reference's log-probs are those of --hf_model's own weights, loaded
    here without peft and each row run alone in float64, after the adapters have trained (lora_B,
    zero at the start, moved by hand: at step 1 adapters on and off give the same logits)."""
    from types import SimpleNamespace

    from adapters import add_lora

    rl_model = example("model")
    cfg = Cfg(hf_model=str(chat_llama), lora_r=4, beta=0.1, max_new_tokens=6)
    model = rl_model.build_model(cfg)
    adapter = SimpleNamespace(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_targets="")
    model = add_lora(model, SimpleNamespace(**vars(adapter), hf_model=str(chat_llama)))
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for name, parameter in sorted(model.named_parameters()):
            if "lora_B" in name:
                parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    rows = hand_rows(len(rl_model.chat_tokenizer(cfg)), cfg)
    batch = example_batch(rows, cfg, *old_and_ref(model, rows, cfg))
    prompt = batch["input_ids"].size(1) - cfg.max_new_tokens
    group = {
        "prompt_ids": batch["input_ids"][:, :prompt],
        "prompt_mask": batch["attention_mask"][:, :prompt],
        "completion": batch["input_ids"][:, prompt:],
        "mask": batch["completion_mask"],
    }
    with torch.no_grad():
        reference = rl_model.reference_logps(model, group, cfg)
    base = example("model").build_model(replace(cfg, lora_r=0, beta=0.0))
    # the adapters changed the policy: a reference with them on would differ
    assert reference_is_the_base_s(reference, rows, base, model, cfg.temperature) > 1e-2


def reference_is_the_base_s(reference, rows, base, policy, temperature: float) -> float:
    """Each row's reference log-probs are the base model's, each row run alone in float64; returns
    how far the policy's own log-probs are from them (the most, over the rows' tokens)."""
    base = base.double().eval()
    policy = policy.double().eval()
    moved = 0.0
    for i, row in enumerate(rows):
        with torch.no_grad():
            expected = [float(x) for x in alone_logps(base, row, temperature)]
            now = [float(x) for x in alone_logps(policy, row, temperature)]
        assert reference[i, : row["counted"]].tolist() == pytest.approx(expected, abs=2e-5), i
        moved = max(moved, *(abs(a - b) for a, b in zip(now, expected, strict=True)))
    return moved


def hand_group(model, cfg) -> tuple[list[dict], dict]:
    """hand_rows as a rollout's group: prompts (left-padded), completions and their masks."""
    rows = hand_rows(model.config.vocab_size, cfg)
    batch = example_batch(rows, cfg, *old_and_ref(model, rows, cfg))
    prompt = batch["input_ids"].size(1) - cfg.max_new_tokens
    group = {
        "prompt_ids": batch["input_ids"][:, :prompt],
        "prompt_mask": batch["attention_mask"][:, :prompt],
        "completion": batch["input_ids"][:, prompt:],
        "mask": batch["completion_mask"],
    }
    return rows, group


def test_without_lora_the_reference_is_the_model_as_loaded_not_the_policy_after_it_moved(
    chat_llama,
):
    """beta > 0, no --lora_r: the reference's log-probs are --hf_model's own weights' (loaded here
    again, each row run alone in float64), after the policy's weights moved (by hand): not the
    policy's now."""
    rl_model = example("model")
    cfg = Cfg(hf_model=str(chat_llama), beta=0.1, max_new_tokens=6)
    model = rl_model.build_model(cfg)
    with torch.no_grad():  # an update
        generator = torch.Generator().manual_seed(0)
        for _, parameter in sorted(model.named_parameters()):
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    rows, group = hand_group(model, cfg)
    with torch.no_grad():
        reference = rl_model.reference_logps(model, group, cfg)
    base = example("model").build_model(replace(cfg, beta=0.0))
    # the policy moved: its own log-probs as the reference would differ
    assert reference_is_the_base_s(reference, rows, base, model, cfg.temperature) > 1e-2


def test_a_frozen_reference_is_copied_only_for_kl_without_lora_and_training_keeps_no_cache(
    chat_llama,
):
    """The frozen reference costs a second model's memory: it is copied only with beta > 0 and no
    --lora_r (LoRA's reference is the base, its adapters off), frozen and equal to the weights
    loaded; at beta 0 there is none. Training's forward keeps no key/value cache (generate asks
    for its own)."""
    from transformers import AutoModelForCausalLM

    rl_model = example("model")
    for beta, lora_r in ((0.0, 0), (0.1, 4), (0.0, 4)):
        cfg = Cfg(hf_model=str(chat_llama), beta=beta, lora_r=lora_r)
        assert rl_model.build_model(cfg).rl.frozen is None, (beta, lora_r)
    model = rl_model.build_model(Cfg(hf_model=str(chat_llama), beta=0.1))
    loaded = dict(AutoModelForCausalLM.from_pretrained(chat_llama).named_parameters())
    frozen = dict(model.rl.frozen.named_parameters())
    assert frozen.keys() == loaded.keys()
    for name, parameter in frozen.items():
        assert not parameter.requires_grad
        assert torch.equal(parameter, loaded[name]), name
    ids = torch.tensor([[5, 9, 14, 3, 7]])
    with torch.no_grad():
        assert model(input_ids=ids).past_key_values is None


def test_a_bf16_model_s_token_log_probs_are_taken_in_fp32():
    """bf16 logits (a bf16 model's): each completion token's log-prob is log_softmax(logits /
    temperature) in fp32, against float64's of the same logits (bf16's 8-bit mantissa would be off
    by ~1e-2). Position t's logits predict token t + 1."""
    rl_model = example("model")
    generator = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(2, 7, 50, generator=generator)).to(torch.bfloat16)
    input_ids = torch.randint(0, 50, (2, 7), generator=generator)
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones(2, 7, dtype=torch.long),
        "completion_mask": torch.ones(2, 3, dtype=torch.long),
    }

    def forward(**inputs):
        return types.SimpleNamespace(logits=logits)

    got = rl_model.token_logps(forward, batch, Cfg(temperature=0.7))
    log_probs = torch.log_softmax(logits[:, 3:6].double() / 0.7, dim=-1)
    expected = log_probs.gather(-1, input_ids[:, 4:, None]).squeeze(-1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)


def test_the_frozen_reference_moves_to_the_completions_device_at_its_first_use(chat_llama):
    """The frozen copy is built where the model is loaded (the CPU) and goes to the device the
    rollout's completions are on (an accelerator's; here "meta", which runs a forward's shapes
    without values) when it first scores them; the policy stays where it is. (Eager attention:
    the default sdpa mask reads a value, which a meta tensor has not.)"""
    rl_model = example("model")
    cfg = Cfg(hf_model=str(chat_llama), beta=0.1, max_new_tokens=6)
    model = rl_model.build_model(cfg)
    frozen = model.rl.frozen
    frozen.config._attn_implementation = "eager"
    assert next(frozen.parameters()).device.type == "cpu"
    _, group = hand_group(model, cfg)
    on_meta = {name: tensor.to("meta") for name, tensor in group.items()}
    with torch.no_grad():
        reference = rl_model.reference_logps(model, on_meta, cfg)
    assert {p.device.type for p in frozen.parameters()} == {"meta"}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert reference.device.type == "meta" and reference.shape == group["completion"].shape


def test_the_same_seed_step_and_prompt_give_the_same_tokens_and_leave_the_rng_alone(chat_llama):
    rl_model = example("model")
    cfg = Cfg(hf_model=str(chat_llama), num_generations=4, max_new_tokens=8, temperature=1.0)
    model = rl_model.build_model(cfg)
    # the same prompts twice: as the same rows of the split (indices 0, 1), then as other rows
    micro = [prompt_batch(cfg), prompt_batch(cfg), prompt_batch(cfg, indices=[5, 6])]
    rng = torch.get_rng_state()
    (a0, a1, a2), _ = rl_model.rollout(model, micro, cfg, step=5)
    assert torch.equal(torch.get_rng_state(), rng)  # training's own draws (dropout) unchanged
    torch.manual_seed(99)  # whatever the global RNG holds
    (b0, _, b2), _ = rl_model.rollout(model, micro, cfg, step=5)
    (c0, _, _), _ = rl_model.rollout(model, micro, cfg, step=6)
    assert torch.equal(a0["input_ids"], b0["input_ids"]) and torch.equal(
        a2["input_ids"], b2["input_ids"]
    )
    # one row of the split twice in a step samples alike (the module docstring says so)
    assert torch.equal(a0["input_ids"], a1["input_ids"])
    # the prompt's index and the step are in the seed: the same prompts, other tokens
    assert not torch.equal(a0["input_ids"], a2["input_ids"])
    assert not torch.equal(a0["input_ids"], c0["input_ids"])
    # and the completion's place in its group: a group's completions differ
    assert len({tuple(row) for row in a0["input_ids"][:4].tolist()}) > 1


def completion_seed(seed: int, step: int, prompt: int, completion: int) -> int:
    """A completion's sampling seed, as the module docstring defines it (rollout_seed), by hand."""
    digest = hashlib.sha256(f"{seed}/{step}/{prompt}/{completion}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


def top_p_log_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """log_softmax(logits / temperature) over the smallest set of the likeliest tokens whose
    probability reaches top_p (a token is kept while the mass before it is below top_p), -inf
    elsewhere: by hand, in float64."""
    probabilities = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(probabilities, descending=True)
    before = torch.cumsum(probabilities[order], dim=0) - probabilities[order]
    kept = torch.zeros_like(probabilities, dtype=torch.bool)
    kept[order[before < top_p]] = True
    kept_logits = torch.where(kept, logits.double() / temperature, -math.inf)
    return torch.log_softmax(kept_logits, dim=-1)


def test_each_sampled_token_is_the_argmax_of_its_log_probs_plus_its_own_seed_s_gumbel_noise(
    chat_llama,
):
    """Completion g of prompt p at step s: its token t is argmax(log_softmax(top_p(logits /
    temperature)) - log(-log U_t)), U_t the t-th torch.rand(vocab) of a generator seeded with
    the completion's seed (sha256 of "seed/s/p/g", by hand), the logits by a forward of the row
    alone (no padding, no cache), top_p by hand: every token of every completion."""
    rl_model = example("model")
    cfg = Cfg(
        hf_model=str(chat_llama), num_generations=3, max_new_tokens=8, temperature=0.7, top_p=0.9
    )
    model = rl_model.build_model(cfg)
    indices, step = [7, 3], 4
    batch = prompt_batch(cfg, indices=indices)
    (trained,), _ = rl_model.rollout(model, [batch], cfg, step=step)
    width = batch["prompt_ids"].size(1)
    excluded, checked = 0, 0
    for row, (ids, mask) in enumerate(
        zip(trained["input_ids"], trained["completion_mask"], strict=True)
    ):
        prompt, g = row // cfg.num_generations, row % cfg.num_generations
        alone = batch["prompt_ids"][prompt][batch["prompt_mask"][prompt].bool()].tolist()
        completion = ids[width:].tolist()
        seed = completion_seed(cfg.seed, step, indices[prompt], g)
        generator = torch.Generator().manual_seed(seed)
        for t in range(int(mask.sum())):
            with torch.no_grad():
                sequence = torch.tensor([alone + completion[:t]])
                logits = type(model).forward(model, input_ids=sequence).logits[0, -1].float()
            log_probs = top_p_log_probs(logits, cfg.temperature, cfg.top_p)
            uniforms = torch.rand(logits.size(-1), generator=generator)
            gumbel = -torch.log(-torch.log(uniforms.double()))
            assert completion[t] == int(torch.argmax(log_probs + gumbel)), (row, t)
            excluded += int(torch.isinf(log_probs).sum())
            checked += 1
    assert checked > 2 * cfg.num_generations and excluded > 0  # top_p left tokens out


def test_the_completion_seed_is_sha256_s_first_8_bytes_little_endian_with_the_top_bit_dropped():
    """rollout_seed against sha256 worked here: the first 8 bytes of the digest, little-endian, mod
    2^63 (the top bit dropped), over inputs of which some have that bit set. The sampling test
    above cannot see that bit: a CPU torch.Generator seeds from the low 32 bits only, but a CUDA
    one takes all 64, so a seed off in its top bit samples other tokens there."""
    rl_model = example("model")
    top_bit_set = 0
    for step in (0, 3):
        for prompt in (0, 7, 12):
            for g in range(4):
                digest = hashlib.sha256(f"1337/{step}/{prompt}/{g}".encode()).digest()
                whole = int.from_bytes(digest[:8], "little")
                top_bit_set += whole >= 2**63
                assert rl_model.rollout_seed(1337, step, prompt, g) == whole & (2**63 - 1)
    assert top_bit_set > 0  # the mod changed some


# three prompts of different lengths: the middle one is left-padded in a batch of all three
AROUND = [
    ("sort: river alpha", "alpha river"),
    ("sort: maple ocean ember tiger cloud lunar", "cloud ember lunar maple ocean tiger"),
    ("sort: maple ocean ember", "ember maple ocean"),
]


def test_each_split_s_prompts_are_indexed_0_1_2_in_the_file_s_order(chat_llama, tmp_path):
    """prompt_index, the prompt's identity its completions are seeded from, is its place in its
    split: 0, 1, ... down train.jsonl, and again down validation.jsonl (the eval set)."""
    train_answers = ["alpha river", "ember maple", "cloud", "a b", "tiger"]
    eval_answers = ["ocean", "lunar pixel", "river"]
    for name, answers in (("train", train_answers), ("validation", eval_answers)):
        rows = [{"prompt": f"sort: {answer}", "answer": answer} for answer in answers]
        write_jsonl(tmp_path / "prompts" / f"{name}.jsonl", rows)
    cfg = Cfg(hf_model=str(chat_llama), dataset=str(tmp_path / "prompts"))
    train, held_out = example("data").build_datasets(cfg)
    for split, answers in ((train, train_answers), (held_out, eval_answers)):
        assert [row["prompt_index"] for row in split] == list(range(len(answers)))
        assert [bytes(row["answer_bytes"]).decode() for row in split] == answers


def test_a_prompt_samples_the_same_tokens_alone_and_in_a_batch_at_another_row(chat_llama):
    """Prompt 12 of the split, G = 4: alone (a batch of one, no padding) and as the third row of a
    batch with a shorter and a longer prompt (left-padded), in the second micro-batch: the same
    completions, token for token."""
    rl_model = example("model")
    cfg = Cfg(hf_model=str(chat_llama), num_generations=4, max_new_tokens=10, temperature=1.0)
    model = rl_model.build_model(cfg)
    step, groups = 3, cfg.num_generations
    (alone,), _ = rl_model.rollout(model, [prompt_batch(cfg, AROUND[2:], [12])], cfg, step)
    before = prompt_batch(cfg, SORTS, [40, 41])
    batch = prompt_batch(cfg, AROUND, [30, 31, 12])
    assert batch["prompt_mask"][2].min() == 0  # padded there
    (_, among), _ = rl_model.rollout(model, [before, batch], cfg, step)

    def completions(trained: dict, first_row: int) -> list[list[int]]:
        width = trained["completion_mask"].size(1)
        rows = []
        for row in range(first_row, first_row + groups):
            counted = int(trained["completion_mask"][row].sum())
            rows.append(trained["input_ids"][row, -width:][:counted].tolist())
        return rows

    wanted = completions(alone, 0)
    assert completions(among, 2 * groups) == wanted
    assert len({tuple(tokens) for tokens in wanted}) > 1  # a group's completions differ
    assert completions(among, 0) != wanted  # another prompt, other tokens


@pytest.mark.parametrize("temperature, top_p", [(0.7, 1.0), (1.0, 0.7)])
def test_gumbel_max_samples_the_tempered_top_p_distribution(temperature, top_p):
    """20000 rows of one 4-token logits vector, each its own seed: each token's count within 5
    binomial standard deviations of softmax(logits / temperature) (renormalised over top_p's
    tokens, by hand), a token top_p leaves out never; the next token (each row's second draw)
    so too, and independent of the first: the share of rows drawing the same token twice is
    sum p^2."""
    rl_model = example("model")
    logits = torch.tensor([2.0, 1.5, 0.8, -0.4])
    expected = torch.exp(top_p_log_probs(logits, temperature, top_p))
    if top_p < 1:  # probabilities 0.50, 0.30, 0.15, 0.05: 0.7 keeps the first two
        assert expected[2:].tolist() == [0.0, 0.0] and expected[:2].min() > 0.3
    rows = 20000
    sampler = rl_model.GumbelSampler(range(1000, 1000 + rows), temperature, top_p)
    scores = logits.repeat(rows, 1)
    draws = [sampler(None, scores).argmax(-1) for _ in range(2)]
    for tokens in draws:
        counts = torch.bincount(tokens, minlength=4).double()
        bound = 5 * torch.sqrt(rows * expected * (1 - expected))
        assert torch.all((counts - rows * expected).abs() <= bound), (counts, rows * expected)
    same = (draws[0] == draws[1]).double().mean().item()
    p_same = float((expected**2).sum())
    assert abs(same - p_same) <= 5 * math.sqrt(p_same * (1 - p_same) / rows), (same, p_same)


@pytest.mark.parametrize("rl_loss", ["grpo", "dapo", "dr_grpo"])
def test_a_completion_counts_up_to_and_with_its_end_of_turn_and_items_count_the_loss_s(
    chat_llama, rl_loss
):
    """completion_mask: each completion's tokens up to its first end of turn and that token (which
    the model must learn to say), all of them where none ends; items: the tokens (dapo) or the
    completions (grpo, dr_grpo) its .loss averages over."""
    rl_model = example("model")
    cfg = Cfg(hf_model=str(chat_llama), rl_loss=rl_loss, num_generations=4, max_new_tokens=12)
    model = rl_model.build_model(cfg)
    tokenizer = model.rl.tokenizer
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():  # the random model says <|im_end|> now and then
        model.lm_head.weight[end] *= 12
    (batch,), values = rl_model.rollout(model, [prompt_batch(cfg)], cfg, step=0)
    ends = {end, tokenizer.eos_token_id}
    expected, unended = [], 0
    for row in batch["input_ids"][:, -cfg.max_new_tokens :].tolist():
        first = next((t for t, token in enumerate(row) if token in ends), None)
        unended += first is None
        counted = cfg.max_new_tokens if first is None else first + 1
        expected.append([1] * counted + [0] * (cfg.max_new_tokens - counted))
    assert batch["completion_mask"].tolist() == expected
    lengths = [sum(row) for row in expected]
    assert min(lengths) < cfg.max_new_tokens == max(lengths)  # some end, some are cut
    tokens = sum(lengths)
    assert int(rl_model.loss_items(batch)) == (tokens if rl_loss == "dapo" else len(expected))
    assert values["completion_tokens"] == tokens / len(expected)
    assert values["completion_tokens_max"] == max(lengths)
    assert values["clipped_share"] == unended / len(expected)


def test_updates_per_rollout_reuses_a_rollout_and_generates_at_its_steps(chat_llama):
    rl_model = example("model")
    cfg = Cfg(hf_model=str(chat_llama), updates_per_rollout=2, max_new_tokens=8)
    model = rl_model.build_model(cfg)
    micro = [prompt_batch(cfg)]
    (a,), _ = rl_model.rollout(model, micro, cfg, step=2)
    (b,), _ = rl_model.rollout(model, [prompt_batch(cfg, SORTS[::-1])], cfg, step=3)
    (c,), _ = rl_model.rollout(model, micro, cfg, step=4)
    assert b is a and c is not a
    assert torch.equal(a["old_logps"], b["old_logps"])


def test_after_its_end_of_turn_a_completion_is_the_tokenizer_s_padding(chat_llama, tmp_path):
    """A tokenizer with a padding token of its own, not an end of turn (here <|im_start|>, as a
    fork's tokenizer may declare one): each sampled completion is its tokens up to and with its
    first end of turn, then that padding token to the batch's width, read here from the saved
    tokenizer; generation stops where the last row ends, so the width is the longest row's."""
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "padded"
    shutil.copytree(chat_llama, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = "<|im_start|>"
    tokenizer.save_pretrained(folder)
    pad = AutoTokenizer.from_pretrained(folder).pad_token_id
    ends = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    assert pad not in ends  # the padding is not an end of turn: the two are told apart
    rl_model = example("model")
    cfg = Cfg(hf_model=str(folder), num_generations=4, max_new_tokens=12)
    model = rl_model.build_model(cfg)
    with torch.no_grad():  # the random model says <|im_end|> often: most rows end early
        model.lm_head.weight[tokenizer.convert_tokens_to_ids("<|im_end|>")] *= 20
    (batch,), _ = rl_model.rollout(model, [prompt_batch(cfg)], cfg, step=0)
    width = batch["completion_mask"].size(1)
    padded, lengths = 0, []
    for row in batch["input_ids"][:, -width:].tolist():
        first = next((t for t, token in enumerate(row) if token in ends), None)
        counted = width if first is None else first + 1
        lengths.append(counted)
        assert row[counted:] == [pad] * (width - counted), row
        padded += width - counted
    assert padded > 0  # some rows ended before the others
    assert width == max(lengths)


def test_with_beta_the_rollout_s_reference_log_probs_and_kl_are_the_start_s_weights(chat_llama):
    """beta = 0.5 (> 0, < 1), the policy moved by hand after it was built: each rollout row's
    ref_logps are the log-probs of the weights as loaded (--hf_model loaded again here, each row
    run alone), and the step's kl is k3 of those against the moved policy's own log-probs (each
    row alone too), summed over the counted tokens over their number: both worked here."""
    rl_model = example("model")
    cfg = Cfg(hf_model=str(chat_llama), beta=0.5, num_generations=3, max_new_tokens=8)
    model = rl_model.build_model(cfg)
    with torch.no_grad():  # an update: the policy is no longer the reference
        generator = torch.Generator().manual_seed(0)
        for _, parameter in sorted(model.named_parameters()):
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    (batch,), values = rl_model.rollout(model, [prompt_batch(cfg)], cfg, step=0)
    base = example("model").build_model(replace(cfg, beta=0.0))
    reference = forward_logps(base, batch, cfg.temperature)
    policy = forward_logps(model, batch, cfg.temperature)
    k3_sum, tokens = 0.0, 0
    for row, (ref, now) in enumerate(zip(reference, policy, strict=True)):
        assert batch["ref_logps"][row, : len(ref)].tolist() == pytest.approx(ref, abs=2e-5), row
        for r, p in zip(ref, now, strict=True):
            k3_sum += math.exp(r - p) - (r - p) - 1
            tokens += 1
    assert k3_sum / tokens > 1e-3  # the policy moved: a KL left out (0) would differ
    assert values["kl"] == pytest.approx(k3_sum / tokens, rel=1e-3)


def test_generation_s_share_is_the_step_before_s_generation_seconds_over_the_time_between(
    chat_llama, monkeypatch
):
    """A clock by hand (the module's perf_counter): step 0's rollout starts at 100 s and its
    generation ends at 103 s, step 1's starts at 110 s: step 1's generation_share is 3 / 10."""
    rl_model = example("model")
    readings = iter([100.0, 103.0, 110.0, 111.5])
    monkeypatch.setattr(
        rl_model, "time", types.SimpleNamespace(perf_counter=lambda: next(readings))
    )
    cfg = Cfg(hf_model=str(chat_llama), num_generations=2, max_new_tokens=4)
    model = rl_model.build_model(cfg)
    _, first = rl_model.rollout(model, [prompt_batch(cfg)], cfg, step=0)
    _, second = rl_model.rollout(model, [prompt_batch(cfg)], cfg, step=1)
    assert "generation_share" not in first  # no step before
    assert second["generation_share"] == pytest.approx(3 / 10, rel=1e-12)


def greedy_alone(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """The test's own greedy decode of one prompt, run alone (no padding, no cache): the argmax
    token by token, up to the first end of turn."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    ends = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    new = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = type(model).forward(model, input_ids=torch.tensor([ids + new])).logits
            token = int(logits[0, -1].argmax())
            if token in ends:
                break
            new.append(token)
    return tokenizer.decode(new)


def test_the_eval_is_each_prompt_s_greedy_completion_scored_over_exactly_the_eval_set(chat_llama):
    """Prompts of different lengths in batches of 2 (left-padded), answers chosen so that one
    completion is exact, one has its words reversed and one is unrelated: the eval metrics equal
    the test's own greedy decode of each prompt alone, scored by the test's own arithmetic."""
    rl_model = example("model")
    cfg = Cfg(hf_model=str(chat_llama), max_new_tokens=10)
    model = rl_model.build_model(cfg).eval()
    tokenizer = model.rl.tokenizer
    prompts = ["sort: river alpha", "sort: maple ocean ember tiger", "sort: cloud", "sort: a b c"]
    said = [greedy_alone(model, tokenizer, prompt, cfg.max_new_tokens) for prompt in prompts]
    answers = [said[0], " ".join(said[1].split()[::-1]) or "x", "pixel lunar", said[3] + " extra"]
    sums = {}
    for k in (0, 2):
        batch = prompt_batch(cfg, list(zip(prompts[k : k + 2], answers[k : k + 2], strict=True)))
        for name, values in rl_model.generate_columns(model, batch, cfg).items():
            sums[name] = sums.get(name, 0.0) + values.sum().item()
    metrics = rl_model.eval_metrics(sums, cfg)
    exact, order, same = [], [], []
    for text, answer in zip(said, answers, strict=True):
        words, wanted = text.split(), answer.split()
        exact.append(1.0 if words == wanted else 0.0)
        order.append(sum(1 for a, b in zip(words, wanted, strict=False) if a == b) / len(wanted))
        same.append(1.0 if sorted(words) == sorted(wanted) else 0.0)
    assert exact[0] == 1.0 and exact[2] == 0.0
    rewards = [e + 0.5 * o + 0.25 * s for e, o, s in zip(exact, order, same, strict=True)]
    assert metrics["reward"] == pytest.approx(sum(rewards) / 4, rel=1e-12)
    assert metrics["pass_rate"] == sum(exact) / 4
    assert metrics["reward_word_order"] == pytest.approx(sum(order) / 4, rel=1e-12)
    assert metrics["reward_same_words"] == sum(same) / 4


def saying(model, tokens: list[int]):
    """An oracle: after each token of `tokens` the model says the next (its logits set by hooks on
    its embedding, which reads the input ids, and its head, whatever calls its forward); after any
    other token, its own."""
    following = dict(zip(tokens, tokens[1:], strict=False))
    seen = {}
    model.model.embed_tokens.register_forward_pre_hook(lambda m, args: seen.update(ids=args[0]))

    def forced(module, args, logits):
        logits = logits.clone()
        ids = seen["ids"][:, -logits.size(1) :]  # generate keeps the last position's alone
        for token, next_token in following.items():
            logits[..., next_token] += 1000.0 * (ids == token)
        return logits

    model.lm_head.register_forward_hook(forced)
    return model


def test_the_eval_s_pass_rate_and_tokens_need_no_weighted_exact_answer_and_count_the_end(
    chat_llama,
):
    """With --reward_weights word_order:1 (no exact_answer in it), pass_rate is still the share of
    greedy completions that are their answer; completion_tokens count the end of turn, here EOS,
    which is also the padding: an oracle says "42" and EOS to every prompt, 2 + 1 tokens."""
    rl_model = example("model")
    cfg = Cfg(hf_model=str(chat_llama), max_new_tokens=6, reward_weights="word_order:1")
    model = rl_model.build_model(cfg).eval()
    tokenizer = model.rl.tokenizer
    assert model.rl.pad_id == tokenizer.eos_token_id  # the tokenizer has no padding of its own
    asked = [{"role": "user", "content": "?"}]
    prompt_end = tokenizer.encode(
        tokenizer.apply_chat_template(asked, add_generation_prompt=True, tokenize=False)
    )  # every prompt ends as the generation prompt does
    forty_two = tokenizer.encode("42")
    assert len(forty_two) == 2
    saying(model, [prompt_end[-1], *forty_two, tokenizer.eos_token_id])
    prompts = ["sort: river alpha", "sort: maple ocean ember tiger"]
    answers = ["42", "41"]
    said = [greedy_alone(model, tokenizer, prompt, cfg.max_new_tokens) for prompt in prompts]
    assert said == ["42", "42"]  # the test's own decode: the oracle says what it was told
    batch = prompt_batch(cfg, list(zip(prompts, answers, strict=True)))
    columns = rl_model.generate_columns(model, batch, cfg)
    # one value per prompt (what the template gathers and sums over exactly the eval set)
    assert {name: values.tolist() for name, values in columns.items()} == {
        "prompts": [1.0, 1.0],
        "reward": [1.0, 0.0],
        "completion_tokens": [3.0, 3.0],
        "reward_word_order": [1.0, 0.0],
        "reward_exact_answer": [1.0, 0.0],
    }
    sums = {name: values.sum().item() for name, values in columns.items()}
    metrics = rl_model.eval_metrics(sums, cfg)
    passed = [text == answer for text, answer in zip(said, answers, strict=True)]
    assert metrics["pass_rate"] == sum(passed) / 2 == 0.5
    assert metrics["reward"] == metrics["reward_word_order"] == 0.5  # "42": 1 word of 1 in place
    assert metrics["completion_tokens"] == 3.0  # "4", "2" and EOS


def test_the_eval_s_columns_are_on_the_batch_s_device_float64(chat_llama, monkeypatch):
    """The eval batch on an accelerator (here "meta"), the rewards worked out on the CPU: every
    column comes back on the batch's device (where the template gathers them), in float64, one
    value per prompt. The completions are given (generate stands in: a forward on "meta" has no
    tokens to score): "42" and its end of turn, and "42" twice, never ended ("4242")."""
    rl_model = example("model")
    cfg = Cfg(hf_model=str(chat_llama), max_new_tokens=4, reward_weights="word_order:1")
    model = rl_model.build_model(cfg)
    tokenizer = model.rl.tokenizer
    forty_two = tokenizer.encode("42")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    completion = torch.tensor([[*forty_two, end, end], forty_two * 2])

    def given(model, prompt_ids, prompt_mask, rl, seeds=None):
        assert seeds is None  # greedy
        mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
        return {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion": completion,
            "mask": mask,
            "logps": None,
        }

    monkeypatch.setattr(rl_model, "generate", given)
    batch = prompt_batch(cfg, [("sort: river alpha", "42"), ("sort: maple ocean", "4242 river")])
    on_meta = {
        **batch,
        "prompt_ids": batch["prompt_ids"].to("meta"),
        "prompt_mask": batch["prompt_mask"].to("meta"),
    }
    on_cpu = rl_model.generate_columns(model, batch, cfg)
    assert {name: values.tolist() for name, values in on_cpu.items()} == {
        "prompts": [1.0, 1.0],
        "reward": [1.0, 0.5],  # "4242": 1 of "4242 river"'s 2 words in its place
        "completion_tokens": [3.0, 4.0],
        "reward_word_order": [1.0, 0.5],
        "reward_exact_answer": [1.0, 0.0],
    }
    on_device = rl_model.generate_columns(model, on_meta, cfg)
    assert sorted(on_device) == sorted(on_cpu)
    for name, values in on_device.items():
        assert values.device.type == "meta" and values.dtype == torch.float64, name
        assert values.shape == (2,), name


# ---------------------------------------------------------------- bad input, one line


def test_a_reward_function_not_in_the_file_is_one_line_naming_the_ones_found(chat_llama):
    cfg = Cfg(hf_model=str(chat_llama), reward_weights="exact_answer:1,correctness:2")
    with pytest.raises(ConfigError) as e:
        example("model").check_config(cfg)
    line = str(e.value)
    assert "\n" not in line and line.startswith("reward_weights:") and "'correctness'" in line
    assert "found: exact_answer, same_words, word_order" in line
    assert ConfigError.exit_code == 2


@pytest.mark.parametrize(
    "key, value, said",
    [
        ("num_generations", 1, "num_generations must be >= 2"),
        ("rl_loss", "ppo", "rl_loss must be one of grpo, dapo, dr_grpo"),
        ("scale_rewards", "rank", "scale_rewards must be one of"),
        ("reward_weights", "exact_answer:lots", "exact_answer's weight must be a finite number"),
        ("top_p", 0.0, "top_p must be in (0, 1]"),
    ],
)
def test_each_bad_rl_key_is_one_line_naming_it(chat_llama, key, value, said):
    cfg = replace(Cfg(hf_model=str(chat_llama)), **{key: value})
    with pytest.raises(ConfigError, match=None) as e:
        example("model").check_config(cfg)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_a_prompt_too_long_for_max_new_tokens_is_one_line_naming_it(chat_llama, tmp_path):
    dataset = write_jsonl(
        tmp_path / "prompts.jsonl",
        [{"prompt": "sort: a b", "answer": "a b"}] * 3
        + [{"prompt": "sort: " + "river " * 8, "answer": "x"}],
    )
    cfg = Cfg(hf_model=str(chat_llama), dataset=str(dataset), max_new_tokens=100)
    with pytest.raises(ConfigError) as e:
        example("data").check_config(cfg)
    line = str(e.value)
    assert line.startswith("max_new_tokens:") and f"{dataset} line 4" in line and "128" in line
    assert "lower max_new_tokens to" in line and "\n" not in line
    example("data").check_config(replace(cfg, max_new_tokens=8))  # room enough: no line


@pytest.mark.parametrize(
    "rows, said",
    [
        ([{"prompt": "sort: a b", "solution": "a b"}], "line 1 needs an 'answer'"),
        (
            [
                {
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "yo"},
                    ],
                    "answer": "x",
                }
            ],
            "line 1: its prompt ends on the assistant's turn",
        ),
    ],
)
def test_a_prompts_file_without_answers_is_one_line(chat_llama, tmp_path, rows, said):
    dataset = write_jsonl(tmp_path / "bad.jsonl", rows * 4)
    cfg = Cfg(hf_model=str(chat_llama), dataset=str(dataset))
    with pytest.raises(ConfigError) as e:
        example("data").check_config(cfg)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_a_hub_style_table_without_an_answer_column_is_one_line(chat_llama, tmp_path):
    dataset = tmp_path / "prompts.csv"
    dataset.write_text("prompt,solution\nsort: b a,a b\nsort: c a,a c\n")
    cfg = Cfg(hf_model=str(chat_llama), dataset=str(dataset))
    with pytest.raises(ConfigError) as e:
        example("data").check_config(cfg)
    assert "has no 'answer' column" in str(e.value) and "columns: prompt, solution" in str(e.value)


def broken(completion: str, answer: str) -> float:
    raise ValueError("cannot parse")


def not_a_number(completion: str, answer: str) -> float:
    return math.nan


@pytest.mark.parametrize(
    "function, said",
    [
        (broken, "raised ValueError: cannot parse"),
        (not_a_number, "returned nan, not a finite number"),
    ],
)
def test_a_reward_function_that_fails_at_run_time_is_one_line_naming_it_and_the_prompt(
    chat_llama, monkeypatch, function, said
):
    rl_model = with_reward(monkeypatch, function)
    cfg = Cfg(hf_model=str(chat_llama), reward_weights=f"{function.__name__}:1")
    model = rl_model.build_model(cfg)
    with pytest.raises(RunError) as e:
        rl_model.rollout(model, [prompt_batch(cfg)], cfg, step=0)
    line = str(e.value)
    assert line.startswith(f"reward function {function.__name__} {said}") and "\n" not in line
    assert "on the prompt 'user\\nsort: river alpha" in line
    assert RunError.exit_code == 1


def test_a_failing_reward_s_line_cuts_the_prompt_at_200_characters(chat_llama):
    """A prompt of 300 characters: the line shows its first 200 as the user's turn reads, the role's
    name and a newline then the prompt (the chat template's markup left out)."""
    rl_model = example("model")
    cfg = Cfg(hf_model=str(chat_llama))
    prompt = "sort: " + " ".join(["river", "alpha", "maple", "ocean", "ember"] * 12)[:294]
    assert len(prompt) == 300
    batch = prompt_batch(cfg, [("sort: river alpha", "x"), (prompt, "y")])
    rl = types.SimpleNamespace(tokenizer=rl_model.chat_tokenizer(cfg))
    with pytest.raises(RunError) as e:
        rl_model.checked_reward(rl, broken, "broken", "alpha", "y", batch, 1)
    shown = ("user\n" + prompt)[:200]
    assert str(e.value) == (
        f"reward function broken raised ValueError: cannot parse, on the prompt {shown!r} "
        "(completion 'alpha')"
    )


def hand_scored(cfg, completions: list[str]) -> tuple[types.SimpleNamespace, dict]:
    """What score reads, by hand: SORTS' two prompts as data.py makes them, each repeated for its
    share of `completions` (rows prompt-major, as the rollout's), each completion its text's tokens,
    <|im_end|>, then EOS padding (the mask 1 up to and with the <|im_end|>)."""
    from chat import chat_tokenizer

    tokenizer = chat_tokenizer(cfg)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    batch = prompt_batch(cfg)
    repeat = len(completions) // len(SORTS)
    encoded = [tokenizer.encode(text, add_special_tokens=False) + [im_end] for text in completions]
    width = max(len(tokens) for tokens in encoded) + 1  # every row padded, the longest too
    padding = tokenizer.eos_token_id
    generated = {
        "prompt_ids": batch["prompt_ids"].repeat_interleave(repeat, dim=0),
        "prompt_mask": batch["prompt_mask"].repeat_interleave(repeat, dim=0),
        "answer_bytes": batch["answer_bytes"],
        "completion": torch.tensor([t + [padding] * (width - len(t)) for t in encoded]),
        "mask": torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in encoded]),
    }
    ends = [im_end, tokenizer.eos_token_id]
    return types.SimpleNamespace(tokenizer=tokenizer, ends=ends), generated


def fails_on_the_second(completion: str, answer: str) -> float:
    """A reward that raises on the second of SORTS' prompts alone (by its answer)."""
    if answer == SORTS[1][1]:
        raise ValueError("cannot parse")
    return 1.0


def nan_on_the_second(completion: str, answer: str) -> float:
    """A reward that gives no number on the second of SORTS' prompts alone (by its answer)."""
    return math.nan if answer == SORTS[1][1] else 1.0


@pytest.mark.parametrize(
    "function, said",
    [
        (fails_on_the_second, "raised ValueError: cannot parse"),
        (nan_on_the_second, "returned nan, not a finite number"),
    ],
)
def test_a_reward_that_fails_on_the_second_prompt_names_that_prompt_alone(
    chat_llama, monkeypatch, function, said
):
    """Two prompts, the reward fine on the first and failing on the second: the line names the
    second prompt as the user wrote it (its role, its text, the generation prompt's role; SORTS[1]
    by hand), not the batch's prompts run together, and the second's completion."""
    rl_model = with_reward(monkeypatch, function)
    cfg = Cfg(hf_model=str(chat_llama))
    rl, generated = hand_scored(cfg, ["alpha river", "ember maple ocean"])
    rl.weights = {function.__name__: 1.0}
    with pytest.raises(RunError) as e:
        rl_model.score(rl, generated)
    assert str(e.value) == (
        f"reward function {function.__name__} {said}, on the prompt "
        "'user\\nsort: maple ocean ember\\nassistant' (completion 'ember maple ocean')"
    )


def test_without_a_rollout_the_seam_gives_the_micro_batches_as_fetched():
    """The shipped model.py has no rollout: the loop's call is a no-op (the same list, no values)."""
    import task

    class Watch:
        def at(self, phase):
            raise AssertionError("no rollout: nothing to note")

    micro = [{"input_ids": torch.zeros(1, 2)}]
    got, values = task.rollout(None, micro, None, 0, Watch())
    assert got is micro and values == {}


def test_a_rollout_that_takes_other_arguments_is_one_line_at_start_up():
    import types

    import task

    def rollout(model, micro_batches, cfg):  # the step left out
        return micro_batches, {}

    with pytest.raises(ConfigError) as e:
        task.check_rollout(types.SimpleNamespace(rollout=rollout))
    assert "rollout must take (model, micro_batches, cfg, step)" in str(e.value)
    task.check_rollout(example("model"))  # the example's: no line
    task.check_rollout(types.SimpleNamespace())  # none: nothing to check


# ---------------------------------------------------------------- the data, line by line


def data_refusal(function, *args) -> str:
    with pytest.raises(ConfigError) as e:
        function(*args)
    return str(e.value)


def test_collate_pads_prompts_left_with_0_and_answers_right_with_minus_1():
    """Two prompts of 3 and 1 tokens, answers of 1 and 3 bytes: by hand."""
    batch = example("data").collate(
        [
            {"prompt_ids": [7, 8, 9], "answer_bytes": [97], "prompt_index": 4},
            {"prompt_ids": [5], "answer_bytes": [98, 195, 169], "prompt_index": "11"},
        ]
    )
    assert {name: value.tolist() for name, value in batch.items()} == {
        "prompt_ids": [[7, 8, 9], [0, 0, 5]],
        "prompt_mask": [[1, 1, 1], [0, 0, 1]],
        "answer_bytes": [[97, -1, -1], [98, 195, 169]],
        "prompt_index": [4, 11],
    }
    assert all(value.dtype == torch.int64 for value in batch.values())


def test_an_answer_holding_the_byte_0_comes_back_whole_through_collate(chat_llama):
    """The answers "a\\x00b" (byte 0 is valid UTF-8: the NUL character) and "café" (a 2-byte
    character) through data.py's rows and collate (-1 the padding) and back as text: the padding
    alone is dropped, the 0 kept."""
    cfg = Cfg(hf_model=str(chat_llama))
    batch = prompt_batch(cfg, [("sort: b a", "a\x00b"), ("sort: river alpha", "café")])
    assert batch["answer_bytes"].tolist() == [[97, 0, 98, -1, -1], [99, 97, 102, 195, 169]]
    assert example("model").answers_of(batch["answer_bytes"]) == ["a\x00b", "café"]


def test_a_prompt_row_is_a_user_s_turn_or_a_chat_and_its_answer_a_string():
    data = example("data")
    user = [{"role": "user", "content": "sort: b a"}]
    assert data.prompt_row({"prompt": "sort: b a", "answer": 12}, "f line 1") == {
        "prompt": user,
        "answer": "12",
        "where": "f line 1",
    }
    chat_rows = [{"role": "system", "content": "be brief"}, *user]
    for key in ("prompt", "messages"):  # TRL's shape, and a chat
        assert data.prompt_row({key: chat_rows, "answer": 1.5}, "f line 2") == {
            "prompt": chat_rows,
            "answer": "1.5",
            "where": "f line 2",
        }
    # "prompt" before "messages" where a row has both
    both = {"prompt": "first", "messages": chat_rows, "answer": "x"}
    assert data.prompt_row(both, "w")["prompt"] == [{"role": "user", "content": "first"}]
    # the prompt's bytes and the answer's UTF-8 bytes, by hand: é is 0xC3 0xA9
    assert data.encode_prompt({"prompt": user, "answer": "é a"}, SimpleTokenizer()) == {
        "prompt_ids": [1, 2, 3],
        "answer_bytes": [0xC3, 0xA9, 0x20, 0x61],
    }


class SimpleTokenizer:
    """A chat template stand-in: every conversation with the generation prompt is [1, 2, 3]."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt is True and tokenize is False
        return "rendered"

    def __call__(self, text, add_special_tokens):
        assert text == "rendered" and add_special_tokens is False
        return {"input_ids": [1, 2, 3]}


@pytest.mark.parametrize(
    "row, said",
    [
        (
            {"prompt": "sort: a b", "solution": "a b"},
            "dataset: f line 3 needs an 'answer' and a 'prompt' (or 'messages'): the prompt the "
            "model answers and the answer the rewards check (it has: prompt, solution)",
        ),
        (
            {"answer": "a b"},
            "dataset: f line 3 needs an 'answer' and a 'prompt' (or 'messages'): the prompt the "
            "model answers and the answer the rewards check (it has: answer)",
        ),
        (
            {},
            "dataset: f line 3 needs an 'answer' and a 'prompt' (or 'messages'): the prompt the "
            "model answers and the answer the rewards check (it has: nothing)",
        ),
        (
            {"prompt": [], "answer": "x"},
            "dataset: f line 3: its prompt must be a string or a list of messages",
        ),
        (
            {"prompt": 7, "answer": "x"},
            "dataset: f line 3: its prompt must be a string or a list of messages",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "yo"},
                ],
                "answer": "x",
            },
            "dataset: f line 3: its prompt ends on the assistant's turn, not the user's: the "
            "model answers the last turn",
        ),
        (  # three turns: the last one's role is named (the second's is the user's)
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "yo"},
                ],
                "answer": "x",
            },
            "dataset: f line 3: its prompt ends on the assistant's turn, not the user's: the "
            "model answers the last turn",
        ),
        (  # a chat's bad message is named by the row it is in
            {"messages": [{"role": "user"}], "answer": "x"},
            "dataset: f line 3: every message needs a 'role' and a 'content' string (or a list "
            "of text parts)",
        ),
        (
            {"prompt": ["hi"], "answer": "x"},
            "dataset: f line 3: every message needs a 'role' and a 'content' string",
        ),
        (
            {"prompt": "hi", "answer": True},
            "dataset: f line 3: its answer must be a string or a number (got bool)",
        ),
        (
            {"prompt": "hi", "answer": ["a"]},
            "dataset: f line 3: its answer must be a string or a number (got list)",
        ),
        (
            {"prompt": "hi", "answer": None},
            "dataset: f line 3: its answer must be a string or a number (got NoneType)",
        ),
    ],
)
def test_each_bad_prompt_row_is_its_whole_line(row, said):
    assert data_refusal(example("data").prompt_row, row, "f line 3") == said


def test_the_data_s_start_up_lines_whole(chat_llama, tmp_path):
    """No dataset; a table without a prompt column; a table without an answer column."""
    data = example("data")
    assert data_refusal(data.check_config, Cfg(hf_model=str(chat_llama))) == (
        "dataset: pass --dataset, prompts with a prompt (or messages) and an answer column (a "
        "JSON lines file or a folder: python scripts/sort_words_task.py OUT writes one)"
    )
    no_prompt = tmp_path / "no_prompt.csv"
    no_prompt.write_text("question,answer\nsort: b a,a b\n")
    assert data_refusal(
        data.check_config, Cfg(hf_model=str(chat_llama), dataset=str(no_prompt))
    ) == (
        f"dataset '{no_prompt}' has no 'prompt' or 'messages' column: RL with verifiable "
        "rewards needs prompts and the answers the rewards check (columns: question, answer)"
    )
    no_answer = tmp_path / "no_answer.csv"
    no_answer.write_text("prompt,solution\nsort: b a,a b\n")
    assert data_refusal(
        data.check_config, Cfg(hf_model=str(chat_llama), dataset=str(no_answer))
    ) == (
        f"dataset '{no_answer}' has no 'answer' column: RL with verifiable rewards needs "
        "prompts and the answers the rewards check (columns: prompt, solution)"
    )


def test_the_longest_prompt_and_max_new_tokens_fit_the_model_s_positions_exactly(
    chat_llama, tmp_path
):
    """The tiny chat Llama has 128 positions; the longest prompt's tokens counted here by
    transformers' own apply_chat_template: max_new_tokens up to 128 minus them is let through,
    one more is the whole line; a prompt of 128 tokens or more leaves no room at all."""
    from transformers import AutoTokenizer

    data = example("data")
    tokenizer = AutoTokenizer.from_pretrained(chat_llama)
    long_prompt = "sort: " + "river " * 8

    def tokens(prompt: str) -> int:
        messages = [{"role": "user", "content": prompt}]
        return len(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )

    dataset = write_jsonl(
        tmp_path / "prompts.jsonl",
        [{"prompt": "sort: a b", "answer": "a b"}, {"prompt": long_prompt, "answer": "x"}] * 2,
    )
    longest = tokens(long_prompt)
    assert longest > tokens("sort: a b")
    cfg = Cfg(hf_model=str(chat_llama), dataset=str(dataset), eval_fraction=0.5)
    data.check_config(replace(cfg, max_new_tokens=128 - longest))  # exactly fills: no line
    said = data_refusal(data.check_config, replace(cfg, max_new_tokens=129 - longest))
    assert said.startswith(f"max_new_tokens: {129 - longest} after the longest prompt ({dataset} ")
    assert said.endswith(
        f": {longest} tokens) is 129 positions, beyond the model's 128: lower max_new_tokens to "
        f"{128 - longest} or shorten the prompt"
    )
    huge = write_jsonl(
        tmp_path / "huge.jsonl",
        [{"prompt": "sort: a b", "answer": "a b"}] * 3
        + [{"prompt": "river " * 200, "answer": "x"}],
    )
    filled = tokens("river " * 200)
    assert filled > 128
    said = data_refusal(data.check_config, replace(cfg, dataset=str(huge), max_new_tokens=1))
    assert said == (
        f"max_new_tokens: 1 after the longest prompt ({huge} line 4: {filled} tokens) is "
        f"{filled + 1} positions, beyond the model's 128: the prompt alone fills them: shorten "
        "the prompt"
    )


def prompt_tokens(chat_llama, messages: list[dict]) -> list[int]:
    """A prompt's tokens as transformers' own apply_chat_template writes them, the assistant's
    turn begun."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_llama)
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


def test_a_prompt_too_long_in_the_eval_split_alone_is_one_line_naming_it(chat_llama, tmp_path):
    """The eval set is generated from too: its longest prompt is checked as the train split's
    are. Train's prompts fit; validation.jsonl's line 2 is one token too many for 128 positions."""
    folder = tmp_path / "prompts"
    write_jsonl(folder / "train.jsonl", [{"prompt": "sort: a b", "answer": "a b"}] * 3)
    long_prompt = "sort: " + "river " * 8
    write_jsonl(
        folder / "validation.jsonl",
        [{"prompt": "sort: b a", "answer": "a b"}, {"prompt": long_prompt, "answer": "river"}],
    )
    # the tiny chat Llama's 128 positions (conftest); the prompt's tokens counted by transformers
    longest = len(prompt_tokens(chat_llama, [{"role": "user", "content": long_prompt}]))
    short = len(prompt_tokens(chat_llama, [{"role": "user", "content": "sort: a b"}]))
    max_new_tokens = 129 - longest  # one position past 128 after the long prompt
    assert short + max_new_tokens <= 128  # the train split's prompts alone fit
    cfg = Cfg(hf_model=str(chat_llama), dataset=str(folder), max_new_tokens=max_new_tokens)
    assert data_refusal(example("data").check_config, cfg) == (
        f"max_new_tokens: {max_new_tokens} after the longest prompt ({folder / 'validation.jsonl'} "
        f"line 2: {longest} tokens) is 129 positions, beyond the model's 128: lower "
        f"max_new_tokens to {128 - longest} or shorten the prompt"
    )


def model_folder(folder: Path, config: dict) -> str:
    """A model's folder holding only its config.json, as AutoConfig reads it."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(
    "longest, max_new_tokens, fix",
    [
        # 40 positions: a prompt of 39 tokens leaves room for 1 new token
        (39, 2, "lower max_new_tokens to 1 or shorten the prompt"),
        # a prompt of 40 tokens leaves none: no max_new_tokens helps
        (40, 1, "the prompt alone fills them: shorten the prompt"),
    ],
)
def test_the_fix_said_for_a_room_of_1_and_of_0(tmp_path, longest, max_new_tokens, fix):
    data = example("data")
    model = model_folder(tmp_path / "model", {"model_type": "llama", "max_position_embeddings": 40})
    cfg = Cfg(hf_model=model, max_new_tokens=max_new_tokens)
    train = data.Part(rows=[], lengths=[(12, "f line 1"), (longest, "f line 2")])
    held_out = data.Part(rows=[], lengths=[(5, "g line 1")])
    # 39 + 2 = 40 + 1 = 41 positions, past 40
    assert data_refusal(data.check_room, cfg, train, held_out) == (
        f"max_new_tokens: {max_new_tokens} after the longest prompt (f line 2: {longest} tokens) "
        f"is 41 positions, beyond the model's 40: {fix}"
    )


def test_a_model_whose_config_has_no_max_position_embeddings_leaves_nothing_to_check(tmp_path):
    """T5's config has no max_position_embeddings (its positions are relative): no line, whatever
    the lengths."""
    data = example("data")
    model = model_folder(tmp_path / "t5", {"model_type": "t5"})
    cfg = Cfg(hf_model=model, max_new_tokens=10**6)
    assert data.check_room(cfg, data.Part(rows=[], lengths=[(10**6, "f line 1")])) is None


def test_a_file_of_messages_and_answers_without_a_prompt_column_is_read(chat_llama, tmp_path):
    """A Parquet table (read by datasets, not row by row as JSON is) whose chats are in a messages
    column: each row's prompt is its chat through the chat template, its answer's bytes."""
    import datasets

    chats = {
        "train": [
            ([{"role": "user", "content": "sort: b a"}], "a b"),
            (
                [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "sort: d c"},
                ],
                "c d",
            ),
        ],
        "validation": [([{"role": "user", "content": "sort: f e"}], "e f")],
    }
    folder = tmp_path / "chats"
    folder.mkdir()
    for split, rows in chats.items():
        table = [{"messages": messages, "answer": answer} for messages, answer in rows]
        datasets.Dataset.from_list(table).to_parquet(str(folder / f"{split}.parquet"))
    cfg = Cfg(hf_model=str(chat_llama), dataset=str(folder))
    train, held_out = example("data").build_datasets(cfg)
    for part, split in ((train, "train"), (held_out, "validation")):
        assert [row["prompt_ids"] for row in part] == [
            prompt_tokens(chat_llama, messages) for messages, _ in chats[split]
        ]
        # the answers' UTF-8 bytes, by hand: "a b" is 0x61 0x20 0x62
        assert [row["answer_bytes"] for row in part] == [
            list(answer.encode()) for _, answer in chats[split]
        ]
    assert train[0]["answer_bytes"] == [0x61, 0x20, 0x62]


def hub(monkeypatch, configs: dict):
    """datasets.load_dataset as the hub answers for a dataset of these configurations, offline:
    {configuration: {split: rows}}; no configuration named is refused, as the hub refuses it for
    a dataset of several."""
    import datasets

    def load_dataset(name, configuration=None):
        if configuration not in configs:
            raise ValueError(
                f"Config name is missing. Please pick one among the available configs: "
                f"{list(configs)}"
            )
        return datasets.DatasetDict(
            {
                split: datasets.Dataset.from_list(rows)
                for split, rows in configs[configuration].items()
            }
        )

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)


def sorts(*words: str) -> list[dict]:
    return [{"prompt": f"sort: {w}", "answer": " ".join(sorted(w.split()))} for w in words]


def test_a_hub_dataset_s_configuration_is_the_one_read(chat_llama, monkeypatch):
    hub(
        monkeypatch,
        {
            "easy": {"train": sorts("b a"), "validation": sorts("d c")},
            "hard": {"train": sorts("z y x", "q p o"), "validation": sorts("k j i")},
        },
    )
    cfg = Cfg(hf_model=str(chat_llama), dataset="owner/sorting", dataset_config="hard")
    train, held_out = example("data").build_datasets(cfg)
    # the hard configuration's answers, sorted by hand
    assert [bytes(row["answer_bytes"]).decode() for row in train] == ["x y z", "o p q"]
    assert [bytes(row["answer_bytes"]).decode() for row in held_out] == ["i j k"]


def test_the_check_of_each_split_s_prompts_is_said_on_its_progress_bar(
    chat_llama, monkeypatch, capfd
):
    hub(monkeypatch, {None: {"train": sorts("b a", "d c"), "test": sorts("f e")}})
    cfg = Cfg(hf_model=str(chat_llama), dataset="owner/progress")
    example("data").build_datasets(cfg)
    bars = capfd.readouterr().err
    # chat.checked_splits' bar: "checking the {split} {noun}", the noun the example's own
    assert "checking the train prompts: 100%" in bars
    assert "checking the test prompts: 100%" in bars


# ---------------------------------------------------------------- the RL keys, line by line


@pytest.mark.parametrize(
    "overrides, said",
    [
        (
            {"hf_model": ""},
            "hf_model: RL starts from a Hugging Face chat model, best one fine-tuned on the task "
            "(examples/chat_sft): pass --hf_model RUN_FOLDER_OR_NAME",
        ),
        ({"rl_loss": "ppo"}, "rl_loss must be one of grpo, dapo, dr_grpo (got 'ppo')"),
        (
            {"scale_rewards": "rank"},
            "scale_rewards must be one of group, batch, none (got 'rank')",
        ),
        (
            {"num_generations": 1},
            "num_generations must be >= 2: a completion's advantage is its reward against its "
            "group's mean, which a group of one always equals (got 1)",
        ),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1 (got 0)"),
        ({"temperature": 0.0}, "temperature must be > 0 (got 0.0)"),
        ({"temperature": math.inf}, "temperature must be > 0 (got inf)"),
        ({"top_p": 0.0}, "top_p must be in (0, 1] (got 0.0)"),
        ({"top_p": 1.5}, "top_p must be in (0, 1] (got 1.5)"),
        ({"epsilon": -0.1}, "epsilon must be a finite number >= 0 (got -0.1)"),
        ({"epsilon_high": math.nan}, "epsilon_high must be a finite number >= 0 (got nan)"),
        ({"beta": math.inf}, "beta must be a finite number >= 0 (got inf)"),
        ({"updates_per_rollout": 0}, "updates_per_rollout must be >= 1 (got 0)"),
        pytest.param(
            {"reward_weights": "exact_answer:1, correctness:2"},
            "reward_weights: no reward function 'correctness' in train/model.py (found: "
            "exact_answer, same_words, word_order; a reward function takes (completion, answer))",
            id="unknown-reward",
        ),
        (
            {"reward_weights": "exact_answer:inf"},
            "reward_weights: exact_answer's weight must be a finite number (got 'inf'), as in "
            "exact_answer:1,same_words:0.25",
        ),
        (
            {"reward_weights": "word_order:0.5:1"},
            "reward_weights: word_order's weight must be a finite number (got '0.5:1'), as in "
            "exact_answer:1,same_words:0.25",
        ),
        (
            {"reward_weights": "word_order:x"},
            "reward_weights: word_order's weight must be a finite number (got 'x'), as in "
            "exact_answer:1,same_words:0.25",
        ),
        (
            {"beta": 0.1, "init_from": "runs/sft"},
            "init_from: with beta > 0 the reference is the weights the run starts from, loaded "
            "from --hf_model: pass that folder as --hf_model instead (got 'runs/sft')",
        ),
    ],
)
def test_each_bad_rl_key_is_its_whole_line(overrides, said):
    cfg = replace(Cfg(hf_model="some/model"), **overrides)
    with pytest.raises(ConfigError) as e:
        example("model").check_config(cfg)
    assert str(e.value) == said


def test_the_edges_of_the_rl_keys_are_let_through_and_weights_read_as_written(tmp_path):
    model = example("model")
    edges = dict(
        num_generations=2,
        max_new_tokens=1,
        temperature=1e-6,
        top_p=1.0,
        epsilon=0.0,
        epsilon_high=0.0,
        beta=0.0,
        updates_per_rollout=1,
    )
    model.check_config(replace(Cfg(hf_model="some/model"), **edges))
    cfg = replace(Cfg(hf_model="x"), reward_weights=" exact_answer : 2 ,same_words:,word_order:-1")
    assert model.reward_weights(cfg) == {"exact_answer": 2.0, "same_words": 1.0, "word_order": -1.0}
    adapter = tmp_path / "sft"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        model.check_config(replace(Cfg(hf_model=str(adapter)), beta=0.1))
    assert str(e.value) == (
        f"hf_model: '{adapter}' holds a LoRA adapter, not a whole model: export the SFT run "
        "merged (--merge_adapter true): with beta > 0 the reference is the model itself"
    )
    model.check_config(replace(Cfg(hf_model=str(adapter)), beta=0.0))  # no reference: no line
    model.check_config(replace(Cfg(hf_model=str(tmp_path)), beta=0.1))  # a whole model's folder


# ---------------------------------------------------------------- the step's numbers, by hand


def test_the_rewards_by_hand():
    model = example("model")
    assert model.exact_answer(" alpha  river ", "alpha river") == 1.0
    assert model.exact_answer("river alpha", "alpha river") == 0.0
    # 2 of the answer's 3 words in their place; the completion's extra word counts nothing
    assert model.word_order("a b x d", "a b c") == 2 / 3
    assert model.word_order("", "") == 0.0  # no words wanted: 0 of at least 1
    assert model.same_words("b a", "a b") == 1.0
    assert model.same_words("a a b", "a b") == 0.0


def test_the_reward_functions_are_the_file_s_functions_of_completion_and_answer():
    """Its other functions (reward_weights(cfg), check_config(cfg), ...) are not rewards."""
    assert sorted(example("model").reward_functions()) == [
        "exact_answer",
        "same_words",
        "word_order",
    ]


def test_the_step_s_values_from_its_totals_by_hand():
    """Rewards 1, 2, 4 of three completions (sum 7, squares 21): mean 7/3, the unbiased std
    statistics.stdev gives; 9 tokens, the longest 5, one clipped; KL 0.6 over 12 tokens; the step
    before generated 2 s of the 4 s since its start."""
    model = example("model")
    totals = {
        "count": 3.0,
        "reward_sum": 7.0,
        "reward_squares": 21.0,
        "tokens": 9.0,
        "clipped": 1.0,
        "kl_sum": 0.6,
        "kl_tokens": 12.0,
        "previous_generation_s": 2.0,
        "scores": {"exact_answer": 1.0, "word_order": 2.5},
        "longest": 5.0,
    }
    rl = types.SimpleNamespace(previous=(10.0, 2.0), cfg=types.SimpleNamespace(beta=0.1))
    values = model.step_values(totals, rl, started=14.0)
    assert values == pytest.approx(
        {
            "reward": 7 / 3,
            "reward_std": statistics.stdev([1, 2, 4]),
            "reward_exact_answer": 1 / 3,
            "reward_word_order": 2.5 / 3,
            "completion_tokens": 3.0,
            "completion_tokens_max": 5.0,
            "clipped_share": 1 / 3,
            "generation_share": 0.5,
            "kl": 0.05,
        },
        rel=1e-12,
    )
    # the first step: no step before; beta 0: no KL; no KL tokens: KL over at least 1
    no_kl_tokens = {**totals, "kl_tokens": 0.0}
    first = model.step_values(no_kl_tokens, types.SimpleNamespace(previous=None, cfg=rl.cfg), 14.0)
    assert "generation_share" not in first and first["kl"] == 0.6
    rl.cfg.beta = 0.0
    assert "kl" not in model.step_values(totals, rl, 14.0)
    # one completion: no n - 1 = 0 to divide by; a variance rounded below 0 is 0
    assert model.batch_std({"count": 1.0, "reward_sum": 2.0, "reward_squares": 4.0}) == 0.0
    assert model.batch_std({"count": 2.0, "reward_sum": 2.0, "reward_squares": 2.0 - 1e-15}) == 0
    # two completions, rewards 0 and 1: n - 1 = 1
    two = {"count": 2.0, "reward_sum": 1.0, "reward_squares": 1.0}
    assert model.batch_std(two) == pytest.approx(statistics.stdev([0, 1]), rel=1e-12)
    # a step shorter than a second: generation's share of it as it is
    rl.previous = (10.0, 0.25)
    short = {**totals, "previous_generation_s": 0.25}
    assert model.step_values(short, rl, 10.5)["generation_share"] == pytest.approx(0.5)


def test_the_step_s_totals_over_two_groups_by_hand():
    """Two micro-batches' groups of two completions (ends of turn 3 and 4): the counts, sums and KL
    of both, in float64 (rewards 1.05, 0.35, 0.15, 1.1: float32 would round them), worked here."""
    model = example("model")
    rl = types.SimpleNamespace(
        weights={"exact_answer": 1.0, "word_order": 0.5}, ends=[3, 4], previous=(10.0, 1.5)
    )
    zero = torch.zeros(2, 4, dtype=torch.float64)
    groups = [
        {
            "completion": torch.tensor([[5, 6, 3, 0], [5, 6, 7, 8]]),  # the second never ends
            "mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),
            "rewards": torch.tensor([1.05, 0.35], dtype=torch.float64),
            "scores": {
                "exact_answer": torch.tensor([1.0, 0.0], dtype=torch.float64),
                "word_order": torch.tensor([0.1, 0.7], dtype=torch.float64),
            },
            "logps": zero,
            "ref_logps": torch.tensor(
                [[0.1, -0.2, 0.3, 9.0], [0.2, 0.2, -0.1, 0.05]], dtype=torch.float64
            ),
        },
        {
            "completion": torch.tensor([[3, 0, 0, 0], [5, 4, 0, 0]]),  # both end
            "mask": torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0]]),
            "rewards": torch.tensor([0.15, 1.1], dtype=torch.float64),
            "scores": {
                "exact_answer": torch.tensor([0.0, 1.0], dtype=torch.float64),
                "word_order": torch.tensor([0.3, 0.2], dtype=torch.float64),
            },
            "logps": zero,
            "ref_logps": torch.tensor(
                [[0.4, 9.0, 9.0, 9.0], [-0.3, 0.1, 9.0, 9.0]], dtype=torch.float64
            ),
        },
    ]
    counted = [0.1, -0.2, 0.3, 0.2, 0.2, -0.1, 0.05, 0.4, -0.3, 0.1]  # ref - logps, masked in
    totals = model.step_totals(groups, rl, torch.nn.Linear(1, 1))
    assert totals.pop("scores") == pytest.approx(
        {"exact_answer": 2.0, "word_order": 1.3}, rel=1e-12
    )
    assert totals == pytest.approx(
        {
            "count": 4.0,
            "reward_sum": 1.05 + 0.35 + 0.15 + 1.1,
            "reward_squares": 1.05**2 + 0.35**2 + 0.15**2 + 1.1**2,
            "tokens": 3.0 + 4.0 + 1.0 + 2.0,
            "clipped": 1.0,
            "kl_sum": sum(math.exp(d) - d - 1 for d in counted),
            "kl_tokens": 10.0,
            "previous_generation_s": 1.5,
            "longest": 4.0,
        },
        rel=1e-12,
    )


def test_the_eval_metrics_and_items_by_hand():
    model = example("model")
    sums = {"prompts": 4.0, "reward": 2.0, "reward_exact_answer": 1.0, "completion_tokens": 10.0}
    assert model.eval_metrics(sums, None) == {
        "reward": 0.5,
        "reward_exact_answer": 0.25,
        "completion_tokens": 2.5,
        "pass_rate": 0.25,
    }
    assert model.eval_metrics({"prompts": 0.0, "reward": 0.0}, None) == {"reward": 0.0}
    assert model.eval_metrics({"prompts": 1.0, "reward": 0.5}, None) == {"reward": 0.5}
    assert model.loss_items({"items": torch.tensor(7), "prompt_ids": torch.zeros(3, 2)}) == 7
    assert model.loss_items({"prompt_ids": torch.zeros(3, 2)}) == 3
    answers = torch.tensor([[97, 98, -1], [195, 169, 32]])
    assert model.answers_of(answers) == ["ab", "é "]
    rl = types.SimpleNamespace(weights={"exact_answer": 2.0, "word_order": 0.5})
    scores = {
        "exact_answer": torch.tensor([1.0, 0.0], dtype=torch.float64),
        "word_order": torch.tensor([0.5, 1.0], dtype=torch.float64),
        "same_words": torch.tensor([9.0, 9.0], dtype=torch.float64),  # not weighed: no weight
    }
    assert model.weighted(rl, scores).tolist() == [2.25, 0.5]


def test_the_rollout_scores_only_the_weighted_functions_and_the_eval_adds_exact_answer(
    chat_llama,
):
    """Four completions by hand, two a prompt (rows prompt-major), --reward_weights word_order
    alone: score (the rollout's call) gives word_order's 1, 0, 1/3, 1 against alpha river and
    ember maple ocean, and no other function's (a fork's exact_answer that the task cannot meet
    must not run in training); with_pass (the eval's call) adds exact_answer's 1, 0, 0, 1."""
    rl_model = example("model")
    cfg = Cfg(hf_model=str(chat_llama), reward_weights="word_order:1")
    completions = ["alpha river", "river alpha", "ember ocean maple", "ember maple ocean"]
    rl, generated = hand_scored(cfg, completions)
    rl.weights = rl_model.reward_weights(cfg)
    scores = rl_model.score(rl, generated)
    assert {name: values.tolist() for name, values in scores.items()} == {
        "word_order": [1.0, 0.0, 1 / 3, 1.0],
    }
    scores = rl_model.score(rl, generated, with_pass=True)
    assert {name: values.tolist() for name, values in scores.items()} == {
        "word_order": [1.0, 0.0, 1 / 3, 1.0],
        "exact_answer": [1.0, 0.0, 0.0, 1.0],
    }


def test_a_sampler_given_other_rows_than_seeds_is_one_line():
    sampler = example("model").GumbelSampler([1, 2], temperature=1.0, top_p=1.0)
    with pytest.raises(RuntimeError) as e:
        sampler(None, torch.zeros(3, 5))
    assert str(e.value) == "3 rows to sample, 2 seeds"


def test_a_micro_batch_s_advantages_are_float32_on_the_rows_device_by_hand():
    """Two prompts' groups of two, float64 rewards 1, 0 and 0.5, 0.5: each group's mean 0.5, the
    first's unbiased std sqrt(0.5), the second's 0; the advantages (reward - 0.5) / (std + 1e-4)
    worked here, as float32 (the loss's dtype), one a row, on the rows' device."""
    model = example("model")
    cfg = Cfg(num_generations=2, scale_rewards="group")
    group = {
        "prompt_ids": torch.tensor([[7, 8], [7, 8], [9, 9], [9, 9]]),
        "prompt_mask": torch.ones(4, 2, dtype=torch.int64),
        "completion": torch.tensor([[5, 3], [6, 3], [5, 3], [5, 3]]),
        "mask": torch.ones(4, 2, dtype=torch.int64),
        "rewards": torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=torch.float64),
        "logps": torch.zeros(4, 2),
    }
    batch = model.training_batch(group, cfg, {})
    assert batch["advantages"].dtype == torch.float32
    assert batch["advantages"].device == batch["input_ids"].device
    scaled = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert batch["advantages"].tolist() == pytest.approx([scaled, -scaled, 0.0, 0.0], rel=1e-6)
    assert batch["items"].item() == 4
    # the completions on "meta", standing in for an accelerator, the rewards on the CPU: the
    # advantages go to the rows' device
    on_meta = {key: value.to("meta") if key != "rewards" else value for key, value in group.items()}
    batch = model.training_batch(on_meta, cfg, {})
    assert batch["advantages"].device.type == "meta" and batch["items"].device.type == "meta"
    assert batch["advantages"].dtype == torch.float32


def rank_group(rank: int) -> dict:
    """Rank 0's completions: 3 tokens (ended), 2 tokens (not); rank 1's: one of 4 tokens, not
    ended."""
    if rank == 0:
        return {
            "completion": torch.tensor([[5, 6, 3], [5, 6, 0]]),
            "mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
            "rewards": torch.tensor([1.0, 0.25], dtype=torch.float64),
            "scores": {"exact_answer": torch.tensor([1.0, 0.0], dtype=torch.float64)},
            "logps": torch.zeros(2, 3, dtype=torch.float64),
            "ref_logps": torch.tensor([[0.5, 0.0, 0.0], [0.0, 0.0, 9.0]], dtype=torch.float64),
        }
    return {
        "completion": torch.tensor([[5, 6, 7, 8]]),
        "mask": torch.tensor([[1, 1, 1, 1]]),
        "rewards": torch.tensor([0.5], dtype=torch.float64),
        "scores": {"exact_answer": torch.tensor([0.5], dtype=torch.float64)},
        "logps": torch.tensor([[0.25, 0.0, 0.0, 0.0]], dtype=torch.float64),
        "ref_logps": torch.tensor([[-0.25, 0.0, 0.0, 0.0]], dtype=torch.float64),
    }


def rank_rl(previous_generation_s: float):
    return types.SimpleNamespace(
        weights={"exact_answer": 1.0}, ends=[3], previous=(10.0, previous_generation_s)
    )


def summed_on_two_ranks(rank: int, store_path: str, folder: str) -> None:
    """One of two gloo processes: its own group's step_totals, written as JSON."""
    out = Path(folder) / f"rank{rank}.json"
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        rl = rank_rl([1.0, 4.0][rank])
        totals = example("model").step_totals([rank_group(rank)], rl, torch.nn.Linear(1, 1))
        Path(out).write_text(json.dumps(totals))
    finally:
        dist.destroy_process_group()


def test_the_step_s_totals_are_summed_over_two_processes_by_hand(tmp_path):
    """A real gloo group of 2 on CPU, each rank its own completions: every sum is both ranks'
    (3 completions, rewards 1 + 0.25 + 0.5, 3 + 2 + 4 tokens, 2 not ended, KL over 5 + 4 tokens of
    e^0.5 - 1.5 and e^-0.5 - 0.5: -0.25 - 0.25), the longest is the max (4, rank 1's), the last
    generation's seconds the ranks' mean (1 and 4: 2.5), and the same on both ranks: the totals
    one process gives over both ranks' completions."""
    kl = (math.exp(0.5) - 0.5 - 1) + (math.exp(-0.5) + 0.5 - 1)
    expected = {
        "count": 3.0,
        "reward_sum": 1.75,
        "reward_squares": 1.0 + 0.0625 + 0.25,
        "tokens": 9.0,
        "clipped": 2.0,
        "kl_sum": kl,
        "kl_tokens": 9.0,
        "previous_generation_s": 2.5,
        "scores": {"exact_answer": 1.5},
        "longest": 4.0,
    }

    def check(totals: dict) -> None:
        assert list(totals) == list(expected)
        assert totals.pop("scores") == pytest.approx(expected["scores"], rel=1e-12)
        assert totals == pytest.approx(
            {key: value for key, value in expected.items() if key != "scores"}, rel=1e-12
        )

    # one process, no process group, both ranks' completions
    model = example("model")
    check(model.step_totals([rank_group(0), rank_group(1)], rank_rl(2.5), torch.nn.Linear(1, 1)))
    # fresh interpreters (spawn): a fork of this process would inherit torch's thread pools
    store = tmp_path / "store"
    torch.multiprocessing.spawn(summed_on_two_ranks, args=(str(store), str(tmp_path)), nprocs=2)
    for rank in range(2):
        check(json.loads((tmp_path / f"rank{rank}.json").read_text()))


@pytest.mark.parametrize("beta", [0.0, -0.1])
def test_no_reference_identity_without_kl(beta, capsys):
    model = torch.nn.Module()
    model.rl = types.SimpleNamespace(cfg=Cfg(hf_model="org/chat-7b", beta=beta), frozen=None)
    assert example("model").identity(model) == {}
    assert capsys.readouterr().out == ""


def test_the_reference_s_identity_is_the_frozen_copy_s_weights_or_the_base_without_lora(
    monkeypatch, capsys
):
    """beta 0.5: with a frozen copy, its own state_dict is digested; without one (LoRA), the
    policy's weights with the adapters' left out and '.base_layer.' named as the plain layer's
    (the names and tensors a model without LoRA has). The digest stubbed to record what it got;
    the start-up line worked here."""
    model_py = example("model")
    seen = []
    monkeypatch.setattr(model_py, "weights_digest", lambda w: seen.append(w) or f"d{len(seen)}")
    frozen = torch.nn.Linear(2, 1, bias=False)
    policy = torch.nn.Module()
    policy.rl = types.SimpleNamespace(cfg=Cfg(hf_model="org/chat-7b", beta=0.5), frozen=frozen)
    assert model_py.identity(policy) == {"reference": "d1"}
    assert list(seen[0]) == ["weight"] and torch.equal(seen[0]["weight"], frozen.weight)
    assert capsys.readouterr().out == (
        "reference: a frozen copy of org/chat-7b as loaded, weights digest d1\n"
    )
    lora = torch.nn.Module()
    lora.q = torch.nn.Module()
    lora.q.base_layer = torch.nn.Linear(2, 2, bias=False)
    lora.q.lora_A = torch.nn.Linear(2, 1, bias=False)
    lora.norm = torch.nn.LayerNorm(2)
    lora.rl = types.SimpleNamespace(cfg=Cfg(hf_model="org/chat-7b", beta=0.5), frozen=None)
    assert model_py.identity(lora) == {"reference": "d2"}
    assert sorted(seen[1]) == ["norm.bias", "norm.weight", "q.weight"]
    assert torch.equal(seen[1]["q.weight"], lora.q.base_layer.weight)
    assert capsys.readouterr().out == (
        "reference: org/chat-7b with its LoRA adapters off (no copy), weights digest d2\n"
    )
