"""Reinforcement learning with verifiable rewards (GRPO, DAPO, Dr. GRPO) of a chat model: each step,
the current policy answers each prompt num_generations (G) times, plain Python functions score each
completion against the prompt's reference answer, and the policy learns to make the completions that
scored above their group's mean likelier. Copy this file over train/model.py, and its data.py over
train/data.py (README "RL with verifiable rewards"). It starts from a chat model (--hf_model), best
one already fine-tuned on the task (examples/chat_sft): a model that never answers gets no reward.

The step (the template's loop calls `rollout` between fetching the step's micro-batches of prompts
and counting their items, task.py; then the forward below on each micro-batch it returns):

    rollout    no grad, eval mode: for each micro-batch of B prompts, G completions each, sampled
               with transformers' generate (--temperature, --top_p, --max_new_tokens; each row's
               own noise, GumbelSampler); each token's log-prob at generation (log_softmax(logits /
               temperature), as TRL scores them), recorded while generate runs. The rewards:
               r = sum_k w_k f_k(completion, answer) over --reward_weights (name:weight, the
               functions below). The advantage of completion i of
               prompt g (--scale_rewards; TRL's GRPOTrainer, eps = 1e-4):
                   group  A_i = (r_i - mean_g r) / (std_g r + eps)     (GRPO, Shao et al. 2024,
                                                                       DeepSeekMath, arXiv:2402.03300)
                   batch  A_i = (r_i - mean_g r) / (std r + eps)       std over the step's completions
                                                                       on every rank (Hu 2025,
                                                                       REINFORCE++)
                   none   A_i = r_i - mean_g r                         (Dr. GRPO, Liu et al. 2025,
                                                                       arXiv:2503.20783: no std)
               std is the unbiased (n - 1) one. With --beta > 0, the reference's token log-probs too.
    forward    per completion token t of completion i (mask m_it: the tokens up to and with the end
               of turn; a completion that never ends, all of them), pi_it the policy's log-prob now,
               old_it the one at generation (--updates_per_rollout > 1; else pi_it itself, detached,
               so the ratio is 1 and its gradient the policy gradient's, as TRL does):
                   ratio_it = exp(pi_it - old_it)
                   l_it = -min(ratio_it A_i, clip(ratio_it, 1 - epsilon, 1 + epsilon_high) A_i)
                          + beta k3_it,  k3_it = exp(ref_it - pi_it) - (ref_it - pi_it) - 1
               (PPO's clipped objective, Schulman et al. 2017; the k3 estimator of KL(pi || ref),
               Schulman 2020, as GRPO uses it; epsilon_high: DAPO's clip-higher.) The loss of the
               step, --rl_loss (TRL's loss_type of the same names):
                   grpo     mean over the step's completions of (sum_t m_it l_it / sum_t m_it)
                            (GRPO: each completion's token mean, then the mean over completions)
                   dapo     sum over the step's completion tokens of l_it / the step's completion
                            tokens (DAPO, Yu et al. 2025, arXiv:2503.14476: token-level)
                   dr_grpo  sum over the step's completion tokens of l_it / (max_new_tokens x the
                            step's completions) (Dr. GRPO: a constant normaliser, no length bias)
               "The step's": across its micro-batches and ranks, through loss_items (the template
               weighs micro-batch b by its items over the step's, batches.loss_weights): each
               micro-batch's .loss is its own mean (grpo: over its completions; dapo: over its
               tokens; dr_grpo: its token sum / (max_new_tokens x its completions)), and
               loss_items counts completions (grpo, dr_grpo) or tokens (dapo).

Sampling is reproducible without any state in the checkpoint, and does not depend on the layout:
completion g of a prompt draws its noise from its own generator, seeded with rollout_seed(seed,
step, the prompt's index in its split, g) (GumbelSampler: Gumbel-max over the tempered, top_p-
filtered log-probs), the step being the template's count of optimizer steps, which a resume
restores; the global RNG is never drawn from. So a prompt at a step samples the same tokens at any
world size, per-device batch and accumulation, whatever row and micro-batch it lands in, to the
rounding of the logits (a batch of other shapes rounds its matmuls otherwise: a token whose two best
noisy scores tie to that rounding may differ); a resume, on the same or another number of processes,
samples the same tokens. Two copies of one prompt (the same index) in one step would sample alike.
--updates_per_rollout U > 1 generates at every U-th step and trains the next U - 1 steps on the same
completions (their old log-probs and advantages fixed at generation; the prompts fetched at those steps
are not used), as TRL's num_iterations does. That rollout is kept in memory, not in the checkpoint: a
resume between two generations generates anew from the resumed policy (not bitwise the run that went
on); with U = 1 (the default) nothing is kept.

Under FSDP2 every rank must run as many decode forwards (each gathers the shards): generate runs with
synced_gpus, which all-reduces "this rank is done" each token and keeps a finished rank's forwards
going until every rank is done. Under DDP each rank stops when its own completions end.

The eval (generate_columns, which the template calls on each eval batch), over exactly the eval
prompts, greedy (one completion each): the mean reward and each reward function's mean, pass_rate
(the share whose exact_answer is 1) and the completion's tokens.
Each step's line: reward (the mean), reward_std, each reward_<function>'s mean, completion_tokens
(mean) and completion_tokens_max, clipped_share (completions that reached max_new_tokens without
ending), generation_share (of the step before: generation's seconds over the time from that step's
rollout to this one's, so evaluations and checkpoints in between count), and with beta > 0, kl (k3
at generation, per token); all over every rank's completions.

The reference (beta > 0) is the model the run starts from, as examples/preference's: with --lora_r
the model with its adapters off, else a frozen copy (4 bytes a parameter on each process, not
sharded), its digest in each checkpoint's manifest (identity).
"""

from __future__ import annotations

import hashlib
import inspect
import math
import os
import sys
import time
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from chat import (
    adapters_off,
    chat_tokenizer,
    end_of_turn_ids,
    evaluated,
    frozen_copy,
    greedy,
    say,
    up_to_the_end,
    weights_digest,
)
from errors import ConfigError, RunError, first_line
from lm import hugging_face_model, uses_hub_model

# a chat model: the run's summary prints scripts/sample.py's command with --chat
CHAT_MODEL = True
LOSSES = ("grpo", "dapo", "dr_grpo")
SCALES = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL's: a group whose rewards are all equal has advantages 0, not 0 / 0
PASS = "exact_answer"  # eval's pass_rate: the share of prompts this reward function gives 1


@dataclass
class ModelConfig:
    """The RL keys (the template joins them to its own: YAML, --flags, --help)."""

    # grpo (each completion's token mean, then their mean), dapo (the mean over the step's tokens)
    # or dr_grpo (the step's token sum / (max_new_tokens x completions))
    rl_loss: str = "grpo"
    # the reward: name:weight,... of the reward functions in this file, f(completion, answer)
    reward_weights: str = "exact_answer:1,word_order:0.5,same_words:0.25"
    # completions per prompt (G >= 2: the advantage is a completion's reward against its group's)
    num_generations: int = 4
    # tokens a completion may have, at most (a longer one is cut: clipped_share)
    max_new_tokens: int = 24
    # sampling temperature (> 0); the log-probs are the tempered distribution's, as TRL's
    temperature: float = 1.0
    # nucleus sampling: the smallest set of tokens whose probability reaches top_p (1: all)
    top_p: float = 1.0
    # the advantage's scale: group (GRPO: each group's std), batch (the step's std), none (Dr. GRPO)
    scale_rewards: str = "group"
    # the clip range's lower side: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon: float = 0.2
    # the clip range's upper side (DAPO's clip-higher: 0.28)
    epsilon_high: float = 0.2
    # the KL penalty's weight (k3 to the reference, the start's weights); 0: no reference
    beta: float = 0.0
    # optimizer steps on each rollout's completions (> 1: old log-probs from generation, clipped)
    updates_per_rollout: int = 1


# ---------------------------------------------------------------- the rewards
# Plain functions of (completion, answer) -> float, named in --reward_weights: a completion is the
# text the model answered (its end of turn left out), the answer the prompt's reference (data.py).
# These score the sorting task of scripts/sort_words_task.py; a fork writes its own beside them.


def exact_answer(completion: str, answer: str) -> float:
    """1 if the completion is the answer (spaces aside), else 0."""
    return float(completion.split() == answer.split())


def word_order(completion: str, answer: str) -> float:
    """Partial credit: the share of the answer's words that the completion has in their place."""
    wanted = answer.split()
    said = completion.split()
    return sum(a == b for a, b in zip(said, wanted, strict=False)) / max(len(wanted), 1)


def same_words(completion: str, answer: str) -> float:
    """The format: 1 if the completion says the answer's words, each once, in any order."""
    return float(sorted(completion.split()) == sorted(answer.split()))


def reward_functions() -> dict:
    """The reward functions of this file: its functions whose arguments are (completion, answer)."""
    module = sys.modules[__name__]
    found = {}
    for name, function in vars(module).items():
        if inspect.isfunction(function) and function.__module__ == module.__name__:
            if list(inspect.signature(function).parameters) == ["completion", "answer"]:
                found[name] = function
    return found


def reward_weights(cfg) -> dict[str, float]:
    """--reward_weights as {name: weight}, each name a reward function of this file."""
    found = reward_functions()
    weights = {}
    for part in (p.strip() for p in cfg.reward_weights.split(",")):
        name, _, weight = part.partition(":")
        name = name.strip()
        if name not in found:
            raise ConfigError(
                f"reward_weights: no reward function {name!r} in train/model.py (found: "
                f"{', '.join(sorted(found)) or 'none'}; a reward function takes (completion, answer))"
            )
        try:
            weights[name] = float(weight) if weight.strip() else 1.0
        except ValueError:
            weights[name] = math.nan
        if not math.isfinite(weights[name]):
            raise ConfigError(
                f"reward_weights: {name}'s weight must be a finite number (got {weight!r}), as in "
                "exact_answer:1,same_words:0.25"
            )
    return weights


def check_config(cfg) -> None:
    """The RL keys, at start-up: one line naming the key."""
    if not uses_hub_model(cfg):
        raise ConfigError(
            "hf_model: RL starts from a Hugging Face chat model, best one fine-tuned on the task "
            "(examples/chat_sft): pass --hf_model RUN_FOLDER_OR_NAME"
        )
    reward_weights(cfg)
    if cfg.rl_loss not in LOSSES:
        raise ConfigError(f"rl_loss must be one of {', '.join(LOSSES)} (got {cfg.rl_loss!r})")
    if cfg.scale_rewards not in SCALES:
        raise ConfigError(
            f"scale_rewards must be one of {', '.join(SCALES)} (got {cfg.scale_rewards!r})"
        )
    if cfg.num_generations < 2:
        raise ConfigError(
            f"num_generations must be >= 2: a completion's advantage is its reward against its "
            f"group's mean, which a group of one always equals (got {cfg.num_generations})"
        )
    if cfg.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1 (got {cfg.max_new_tokens})")
    if not (math.isfinite(cfg.temperature) and cfg.temperature > 0):
        raise ConfigError(f"temperature must be > 0 (got {cfg.temperature!r})")
    if not 0 < cfg.top_p <= 1:
        raise ConfigError(f"top_p must be in (0, 1] (got {cfg.top_p!r})")
    for key in ("epsilon", "epsilon_high", "beta"):
        value = getattr(cfg, key)
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{key} must be a finite number >= 0 (got {value!r})")
    if cfg.updates_per_rollout < 1:
        raise ConfigError(f"updates_per_rollout must be >= 1 (got {cfg.updates_per_rollout})")
    if cfg.beta > 0:
        check_reference(cfg)


def check_reference(cfg) -> None:
    """beta > 0: the reference is the weights the run starts from, loaded from --hf_model."""
    if os.path.isfile(os.path.join(cfg.hf_model, "adapter_config.json")):
        raise ConfigError(
            f"hf_model: '{cfg.hf_model}' holds a LoRA adapter, not a whole model: export the SFT "
            "run merged (--merge_adapter true): with beta > 0 the reference is the model itself"
        )
    if cfg.init_from:
        raise ConfigError(
            "init_from: with beta > 0 the reference is the weights the run starts from, loaded "
            f"from --hf_model: pass that folder as --hf_model instead (got {cfg.init_from!r})"
        )


# ---------------------------------------------------------------- the model


@dataclass
class RL:
    """What the model's RL forward and the rollout need beyond its weights. A plain attribute of
    the model, not a submodule: the frozen reference stays out of its state_dict and optimizer."""

    cfg: object
    frozen: nn.Module | None  # the reference's copy (beta > 0, no LoRA)
    tokenizer: object
    ends: list[int]  # the tokens that end a turn
    pad_id: int
    weights: dict  # {reward function: weight}
    cached: tuple | None = None  # (step generated at, micro-batches, values): updates_per_rollout
    previous: tuple | None = None  # (the last rollout's start, its generation's seconds)


@dataclass
class RLOutput:
    """The forward's output on a rollout's micro-batch: the .loss the step minimises."""

    loss: torch.Tensor


def build_model(cfg) -> nn.Module:
    """The Hugging Face causal LM, its forward taking RL's batches as well (rl_forward)."""
    model = hugging_face_model(cfg)
    model.config.use_cache = False  # no key/value cache while training (generate asks for one)
    frozen = frozen_copy(model) if cfg.beta > 0 and not cfg.lora_r else None
    tokenizer = chat_tokenizer(cfg)
    ends = sorted(end_of_turn_ids(tokenizer))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ends[0]
    model.rl = RL(cfg, frozen, tokenizer, ends, pad_id, reward_weights(cfg))
    # bound to this instance, as examples/preference does: the model stays the Hugging Face model
    # (its export, LoRA's names, generate()), and Accelerate's autocast wraps this forward
    model.forward = types.MethodType(rl_forward, model)
    return model


def rl_forward(self, **batch):
    """The model's forward: a rollout's micro-batch (advantages) gives the policy loss, anything
    else (generate's own calls) the Hugging Face model's forward. (The eval's prompts see no
    forward: generate_columns generates from them.)"""
    if "advantages" in batch:
        return policy_loss(self, batch)
    return type(self).forward(self, **batch)


def policy_loss(model, batch: dict) -> RLOutput:
    """The micro-batch's .loss (module docstring): the clipped objective per token, with the KL
    penalty, reduced as --rl_loss says."""
    cfg = model.rl.cfg
    logps = token_logps(lambda **inputs: type(model).forward(model, **inputs), batch, cfg)
    old = batch["old_logps"] if cfg.updates_per_rollout > 1 else logps.detach()
    ratio = torch.exp(logps - old)
    advantages = batch["advantages"][:, None].to(logps.dtype)
    clipped = ratio.clamp(1 - cfg.epsilon, 1 + cfg.epsilon_high)
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    if cfg.beta > 0:
        to_reference = batch["ref_logps"] - logps
        per_token = per_token + cfg.beta * (torch.exp(to_reference) - to_reference - 1)
    mask = batch["completion_mask"].to(logps.dtype)
    summed = per_token * mask
    if cfg.rl_loss == "grpo":
        loss = (summed.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    elif cfg.rl_loss == "dapo":
        loss = summed.sum() / mask.sum().clamp(min=1)
    else:  # dr_grpo
        loss = summed.sum() / (mask.size(0) * cfg.max_new_tokens)
    return RLOutput(loss=loss)


def token_logps(forward, batch: dict, cfg) -> torch.Tensor:
    """(rows, completion tokens): each completion token's log-prob given what precedes it, of the
    tempered distribution log_softmax(logits / temperature), in fp32 at least (float64 for a
    float64 model), one row at a time (a batch's fp32 logits at a 150k vocabulary are gigabytes).
    Positions count from each row's first prompt token (left padding), as generate counts them."""
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    prompt = input_ids.size(1) - batch["completion_mask"].size(1)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions)
    logits = logits.logits
    targets = input_ids[:, prompt:]
    rows = []
    # unbind, not logits[row]: indexing's backward fills a zero gradient of the whole batch's logits
    # for each row (examples/preference's completion_logps, bench/README.md)
    for row, whole_row in enumerate(logits.unbind(0)):
        scaled = whole_row[prompt - 1 : -1]
        scaled = scaled.to(torch.promote_types(scaled.dtype, torch.float32)) / cfg.temperature
        picked = scaled.gather(-1, targets[row][:, None]).squeeze(-1)
        rows.append(picked - scaled.logsumexp(-1))
    return torch.stack(rows)


# ---------------------------------------------------------------- generation


class GenerationLogps:
    """A logits processor that changes nothing and records each sampled token's log-prob: at each
    step, the tempered log_softmax of the raw logits (it runs before GumbelSampler, which applies
    top_p), gathered at the token sampled from it when the next step shows it (finish: the last
    one)."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.last = None
        self.logps = []

    def __call__(self, input_ids, scores):
        if self.last is not None:
            self.logps.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.last = (scores.float() / self.temperature).log_softmax(-1)
        return scores

    def finish(self, completion: torch.Tensor) -> torch.Tensor:
        if self.last is not None and len(self.logps) < completion.size(1):
            self.logps.append(self.last.gather(-1, completion[:, -1:]).squeeze(-1))
        return torch.stack(self.logps, dim=1)


class GumbelSampler:
    """The last logits processor of a sampled generate, which then decodes greedily (the argmax of
    what this returns): row r's token at step t is

        argmax_v [ log_softmax(top_p(logits_t / temperature))_v + G_rtv ],  G_rtv = -log(-log U_rtv)

    U_rt the t-th torch.rand(vocab) of row r's own torch.Generator (on the scores' device), seeded
    with seeds[r]; top_p as transformers' TopPLogitsWarper (the least likely tokens whose total is
    at most 1 - top_p get -inf). The argmax of log-probs plus independent Gumbel(0, 1) noise is an
    exact sample of that distribution (the Gumbel-max trick; Maddison, Tarlow, Minka 2014, A*
    sampling), so this samples what generate's temperature, top_p and multinomial sampled before
    (U's 24 bits cap G at 16.6: a bias below 1e-7). Each call draws one vector per row from the
    row's generator alone: a row's t-th token uses its t-th draw whatever rows sit beside it, their
    padding or the batch's size. Cost: one draw of the vocabulary per row per token (on a GPU, a
    small kernel each)."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float):
        self.seeds = list(seeds)
        self.temperature = temperature
        self.top_p = top_p
        self.generators = None

    def __call__(self, input_ids, scores):
        if self.generators is None:  # on the device of the scores, at the first token
            self.generators = [
                torch.Generator(device=scores.device).manual_seed(seed) for seed in self.seeds
            ]
        if len(self.generators) != scores.size(0):
            raise RuntimeError(f"{scores.size(0)} rows to sample, {len(self.generators)} seeds")
        uniforms = torch.stack(
            [
                torch.rand(scores.size(-1), generator=generator, device=scores.device)
                for generator in self.generators
            ]
        )
        return self.log_probs(scores) - torch.log(-torch.log(uniforms))

    def log_probs(self, scores: torch.Tensor) -> torch.Tensor:
        """log_softmax(top_p(scores / temperature)) in fp32 at least: what the noise is added to."""
        from transformers import TopPLogitsWarper

        tempered = scores.to(torch.promote_types(scores.dtype, torch.float32)) / self.temperature
        if self.top_p < 1:
            tempered = TopPLogitsWarper(self.top_p)(None, tempered)
        return tempered.log_softmax(-1)


def generate(model, prompt_ids, prompt_mask, rl, seeds: list[int] | None = None) -> dict:
    """Completions of the prompts (one each; repeat them for groups): row r sampled with the run's
    temperature and top_p from its own seed, seeds[r] (GumbelSampler), or greedy (seeds None).
    Either way generate decodes greedily (do_sample False): the sampling is the processors'.
    {"completion": (rows, tokens), "mask": what counts of each (up to and with its end of turn),
    "logps": each sampled token's log-prob at generation (sampled only), "prompt_ids",
    "prompt_mask"}."""
    cfg = rl.cfg
    sampled = seeds is not None
    recorder = GenerationLogps(cfg.temperature)
    processors = []
    if sampled:
        processors = [recorder, GumbelSampler(seeds, cfg.temperature, cfg.top_p)]
    completion = greedy(
        model, prompt_ids, prompt_mask, rl.ends, rl.pad_id, cfg.max_new_tokens, processors
    )
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion": completion,
        "mask": up_to_the_end(completion, rl.ends),
        "logps": recorder.finish(completion) if sampled else None,
    }


def rollout_seed(seed: int, step: int, prompt: int, completion: int) -> int:
    """The sampling seed of one completion: the first 8 bytes (little-endian) of
    sha256("{seed}/{step}/{prompt}/{completion}"), mod 2^63; `prompt` the prompt's index in its
    split (data.py's prompt_index), `completion` its place g in the prompt's group (0 to G - 1).
    Nothing of the layout (rank, micro-batch, row): a prompt samples the same completions at any
    world size, batch size and accumulation."""
    text = f"{seed}/{step}/{prompt}/{completion}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") % 2**63


# ---------------------------------------------------------------- scoring


def completion_texts(rl, generated: dict) -> list[str]:
    """Each completion as text: its tokens before its end of turn."""
    texts = []
    for tokens, mask in zip(generated["completion"], generated["mask"], strict=True):
        kept = tokens[: int(mask.sum())].tolist()
        texts.append(rl.tokenizer.decode([t for t in kept if t not in rl.ends]))
    return texts


def score(rl, generated: dict, with_pass: bool = False) -> dict[str, torch.Tensor]:
    """{reward function: (rows,) float64}, each of --reward_weights' (and exact_answer's, for the
    eval's pass_rate), on the completions. A function that raises or gives no finite number is one
    line naming it and the prompt (RunError: exit 1)."""
    found = reward_functions()
    names = list(rl.weights) + ([PASS] if with_pass and PASS in found else [])
    texts = completion_texts(rl, generated)
    rows = len(texts)
    answers = answers_of(generated["answer_bytes"])
    repeat = rows // len(answers)  # a prompt's G completions are G rows in a row
    scores = {name: torch.zeros(rows, dtype=torch.float64) for name in dict.fromkeys(names)}
    for row, text in enumerate(texts):
        answer = answers[row // repeat]
        for name in scores:
            scores[name][row] = checked_reward(rl, found[name], name, text, answer, generated, row)
    return scores


def checked_reward(rl, function, name, text, answer, generated, row) -> float:
    try:
        value = float(function(text, answer))
    except Exception as e:
        raise RunError(
            f"reward function {name} raised {type(e).__name__}: {first_line(e)}, on the prompt "
            f"{prompt_text(rl, generated, row)!r} (completion {text!r})"
        ) from None
    if not math.isfinite(value):
        raise RunError(
            f"reward function {name} returned {value}, not a finite number, on the prompt "
            f"{prompt_text(rl, generated, row)!r} (completion {text!r})"
        )
    return value


def prompt_text(rl, generated: dict, row: int) -> str:
    """The prompt of a row, as the user wrote it (the chat template's markup left out)."""
    ids = generated["prompt_ids"][row][generated["prompt_mask"][row].bool()].tolist()
    return rl.tokenizer.decode(ids, skip_special_tokens=True).strip()[:200]


def answers_of(answer_bytes: torch.Tensor) -> list[str]:
    """data.py's answers back as text: each row's UTF-8 bytes, -1 the padding."""
    return [bytes(b for b in row.tolist() if b >= 0).decode("utf-8") for row in answer_bytes]


def weighted(rl, scores: dict) -> torch.Tensor:
    """(rows,) the reward: sum over --reward_weights of weight x that function's score."""
    return sum(weight * scores[name] for name, weight in rl.weights.items())


# ---------------------------------------------------------------- the rollout


def rollout(policy, micro_batches: list[dict], cfg, step: int) -> tuple[list[dict], dict]:
    """The step's micro-batches of prompts made into what it trains on (task.py calls it each
    step, with the model itself: DDP's wrapper off; module docstring): G completions each from
    the current policy, their rewards and advantages, and the step's values for its log line."""
    rl = policy.rl
    generated_at = step - step % cfg.updates_per_rollout
    if rl.cached is not None and rl.cached[0] == generated_at:
        return rl.cached[1], rl.cached[2]
    started = time.perf_counter()
    groups = []
    with torch.no_grad(), evaluated(policy):
        for batch in micro_batches:
            groups.append(sample_groups(policy, batch, rl, generated_at))
        generation_s = time.perf_counter() - started
        for group in groups:
            group["scores"] = score(rl, group)
            group["rewards"] = weighted(rl, group["scores"])
            if cfg.beta > 0:
                group["ref_logps"] = reference_logps(policy, group, cfg)
    totals = step_totals(groups, rl, policy)
    values = step_values(totals, rl, started)
    batches = [training_batch(group, cfg, totals) for group in groups]
    rl.previous = (started, generation_s)
    rl.cached = (generated_at, batches, values) if cfg.updates_per_rollout > 1 else None
    return batches, values


def sample_groups(policy, batch: dict, rl, step: int) -> dict:
    """G completions of each prompt of a micro-batch: rows prompt-major (prompt p's are rows p G to
    p G + G - 1), completion g of prompt p sampled from rollout_seed(seed, step, its prompt_index,
    g): the same tokens wherever the prompt sits (rank, micro-batch, row)."""
    cfg = rl.cfg
    groups = cfg.num_generations
    prompt_ids = batch["prompt_ids"].repeat_interleave(groups, dim=0)
    prompt_mask = batch["prompt_mask"].repeat_interleave(groups, dim=0)
    seeds = [
        rollout_seed(cfg.seed, step, prompt, g)
        for prompt in batch["prompt_index"].tolist()
        for g in range(groups)
    ]
    generated = generate(policy, prompt_ids, prompt_mask, rl, seeds)
    generated["answer_bytes"] = batch["answer_bytes"]
    return generated


def reference_logps(policy, group: dict, cfg) -> torch.Tensor:
    """The reference's token log-probs of the completions (beta > 0): the frozen copy's (moved to
    the policy's device at first use), or with LoRA the policy's with its adapters off."""
    batch = sequences(group)
    frozen = policy.rl.frozen
    if frozen is not None:
        device = group["completion"].device
        if next(frozen.parameters()).device != device:
            frozen.to(device)
        return token_logps(frozen, batch, cfg)
    with adapters_off(policy):
        return token_logps(lambda **inputs: type(policy).forward(policy, **inputs), batch, cfg)


def sequences(group: dict) -> dict:
    """A group's prompts and completions as one sequence a row: input_ids, attention_mask (the
    prompt's, then 1 over the completion, as generate attended) and completion_mask."""
    completion = group["completion"]
    return {
        "input_ids": torch.cat([group["prompt_ids"], completion], dim=1),
        "attention_mask": torch.cat([group["prompt_mask"], torch.ones_like(completion)], dim=1),
        "completion_mask": group["mask"],
    }


def step_totals(groups: list[dict], rl, policy) -> dict:
    """The step's sums over every rank's completions (one all-reduce; the longest: another):
    count, reward and its square, each function's score, tokens, clipped, KL and its tokens."""
    names = list(rl.weights)
    local = torch.zeros(8 + len(names), dtype=torch.float64)
    longest = torch.zeros((), dtype=torch.float64)
    for group in groups:
        rewards, mask = group["rewards"], group["mask"]
        tokens = mask.sum(-1).double().cpu()
        ends = torch.tensor(rl.ends, device=mask.device)
        ended = torch.isin(group["completion"], ends).any(-1).cpu()
        local[0] += len(rewards)
        local[1] += rewards.sum()
        local[2] += (rewards**2).sum()
        local[3] += tokens.sum()
        local[4] += (~ended).sum().item()
        if "ref_logps" in group:
            to_reference = (group["ref_logps"] - group["logps"]).double()
            k3 = torch.exp(to_reference) - to_reference - 1
            local[5] += (k3 * mask).sum().item()
            local[6] += mask.sum().item()
        for k, name in enumerate(names):
            local[8 + k] += group["scores"][name].sum()
        longest = torch.maximum(longest, tokens.max())
    if rl.previous is not None:
        local[7] = rl.previous[1]
    device = next(policy.parameters()).device
    shared, longest = local.to(device), longest.to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(shared)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        shared[7] /= dist.get_world_size()
    shared = shared.cpu().tolist()
    return {
        "count": shared[0],
        "reward_sum": shared[1],
        "reward_squares": shared[2],
        "tokens": shared[3],
        "clipped": shared[4],
        "kl_sum": shared[5],
        "kl_tokens": shared[6],
        "previous_generation_s": shared[7],
        "scores": dict(zip(names, shared[8:], strict=True)),
        "longest": longest.item(),
    }


def batch_std(totals: dict) -> float:
    """The unbiased std of the step's rewards, every rank's."""
    count = totals["count"]
    mean = totals["reward_sum"] / count
    variance = (totals["reward_squares"] - count * mean**2) / max(count - 1, 1)
    return math.sqrt(max(variance, 0.0))


def step_values(totals: dict, rl, started: float) -> dict:
    """The step's line: reward and its std, each function's mean, the completions' lengths, the
    clipped share, generation's share of the step before, and KL (beta > 0)."""
    count = totals["count"]
    values = {
        "reward": totals["reward_sum"] / count,
        "reward_std": batch_std(totals),
        **{f"reward_{name}": total / count for name, total in totals["scores"].items()},
        "completion_tokens": totals["tokens"] / count,
        "completion_tokens_max": totals["longest"],
        "clipped_share": totals["clipped"] / count,
    }
    if rl.previous is not None:
        values["generation_share"] = totals["previous_generation_s"] / max(
            started - rl.previous[0], 1e-9
        )
    if rl.cfg.beta > 0:
        values["kl"] = totals["kl_sum"] / max(totals["kl_tokens"], 1)
    return values


def training_batch(group: dict, cfg, totals: dict) -> dict:
    """A micro-batch to train on: the sequences, the advantages (module docstring), the old (and
    reference) log-probs, and `items`, what its .loss averages over (loss_items)."""
    rewards = group["rewards"].view(-1, cfg.num_generations)
    advantages = rewards - rewards.mean(-1, keepdim=True)
    if cfg.scale_rewards == "group":
        advantages = advantages / (rewards.std(-1, keepdim=True) + STD_EPS)
    elif cfg.scale_rewards == "batch":
        advantages = advantages / (batch_std(totals) + STD_EPS)
    batch = sequences(group)
    device = batch["input_ids"].device
    batch["advantages"] = advantages.reshape(-1).to(device=device, dtype=torch.float32)
    batch["old_logps"] = group["logps"]
    if "ref_logps" in group:
        batch["ref_logps"] = group["ref_logps"]
    counted = group["mask"].sum() if cfg.rl_loss == "dapo" else len(group["rewards"])
    batch["items"] = torch.as_tensor(counted, dtype=torch.int64, device=device)
    return batch


# ---------------------------------------------------------------- what the template asks


def loss_items(batch: dict):
    """What the micro-batch's .loss averages over: the rollout's count (completions, or dapo's
    tokens); an eval batch's prompts."""
    if "items" in batch:
        return batch["items"]
    return batch["prompt_ids"].size(0)


def generate_columns(model, batch: dict, cfg) -> dict:
    """Per eval prompt, one greedy completion, scored: the prompt (1), its reward, each reward
    function's score (exact_answer's too, for pass_rate) and its tokens, summed over exactly the
    eval set (task.py). The eval generates only: no eval_columns, no forward on these batches."""
    rl = model.rl
    generated = generate(model, batch["prompt_ids"], batch["prompt_mask"], rl, seeds=None)
    generated["answer_bytes"] = batch["answer_bytes"]
    scores = score(rl, generated, with_pass=True)
    rewards = weighted(rl, scores)
    columns = {
        "prompts": torch.ones_like(rewards),
        "reward": rewards,
        "completion_tokens": generated["mask"].sum(-1),
        **{f"reward_{name}": values for name, values in scores.items()},
    }
    device = batch["prompt_ids"].device
    return {name: values.double().to(device) for name, values in columns.items()}


def eval_metrics(sums: dict, cfg) -> dict:
    """Each column's mean per prompt over the eval set; pass_rate: exact_answer's mean."""
    prompts = max(sums["prompts"], 1.0)
    metrics = {name: total / prompts for name, total in sums.items() if name != "prompts"}
    if f"reward_{PASS}" in metrics:
        metrics["pass_rate"] = metrics[f"reward_{PASS}"]
    return metrics


def identity(model) -> dict:
    """{"reference": its weights' digest} with beta > 0 (else {}): what a resume must find
    unchanged (task.model_identity). Said once at start-up, by the first process."""
    rl = model.rl
    if rl.cfg.beta <= 0:
        return {}
    if rl.frozen is not None:
        weights = rl.frozen.state_dict()
        what = f"a frozen copy of {rl.cfg.hf_model} as loaded"
    else:
        weights = {
            name.replace(".base_layer.", "."): tensor
            for name, tensor in model.state_dict().items()
            if ".lora_" not in name
        }
        what = f"{rl.cfg.hf_model} with its LoRA adapters off (no copy)"
    digest = weights_digest(weights)
    say(f"reference: {what}, weights digest {digest}")
    return {"reference": digest}
