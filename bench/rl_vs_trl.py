"""RL with verifiable rewards against TRL's GRPOTrainer: the template run as a fork runs it
(examples/rl/*.py copied over train/, `python train/main.py`, 1 process) and trl.GRPOTrainer, on the
same SFT'd tiny chat Llama, the same prompts in the same order, the same rewards, G, completion
length, temperature, loss, learning rate and threads: the reward curve of each, the completion
tokens generated per second, the step time and the share of it spent generating.

    python bench/rl_vs_trl.py                          # CPU, ~3.5 min: SFT, then 3 rounds of both sides
    python bench/rl_vs_trl.py --rounds 1 --steps 60 --every 10   # ~1 min
    python bench/rl_vs_trl.py --rl_loss grpo --scale_rewards group   # GRPO's loss and advantages

The starting model (both sides): scripts/tiny_chat_model.py's random 2-layer Llama of width 32
(322-token tokenizer, ChatML), fine-tuned by the template's examples/chat_sft fork on
scripts/sort_words_task.py's sft/ chats (--sft_steps, default 250 as in README's RL section: a
random model never answers, so every reward would be 0). The prompts: the task's prompts/train.jsonl,
in the template's order (its EpochSampler's permutation of each epoch, 1 process; TRL is given them in
that order, epochs concatenated, with shuffle_dataset False, so step s trains the same prompts on both
sides: checked from the answers TRL hands its reward functions). Round r seeds both sides 1337 + r
(the data order and the sampling), so the rounds are seeds of the curve, and the sides alternate
which runs first. The rewards:
examples/rl/model.py's exact_answer, word_order and same_words, imported from the fork's train/model.py
(the file the template runs) and wrapped to TRL's signature (completions and dataset columns as
keyword arguments: the completion's content and the row's answer), with the weights --reward_weights
gives the template (TRL's reward_weights). Matched: G (num_generations), prompts a step
(TRL's per_device_train_batch_size counts completions: prompts x G, gradient_accumulation_steps 1,
so one generation per optimizer step, steps_per_generation 1), max_new_tokens (TRL's
max_completion_length), temperature, top_p 1, top_k 0, no min_p, no repetition penalty, epsilon 0.2
both sides, beta 0 (no reference), one update per rollout (TRL's num_iterations 1), --rl_loss (TRL's
loss_type of the same name) and --scale_rewards, AdamW betas (0.9, 0.999), weight decay 0, a constant
learning rate, clipping at 1.0, fp32 (bf16 False), no gradient checkpointing, no vLLM, report_to none,
the same end-of-turn tokens (TRL stops on the tokenizer's EOS and the model's generation_config
eos_token_id: the tiny model's folder names the template's end_of_turn_ids, <|endoftext|> and
<|im_end|>, and the SFT export keeps them; checked). Not matched: the sampling RNG (the template
seeds each completion from (seed, step, prompt index, completion index), TRL draws from its global RNG), so the two
sides sample different completions, and only the curves' shapes can be compared, not their values
step by step.

Timed: each optimizer step end to end (rollout, rewards, advantages, forward, backward, clipping,
AdamW, the log row), the first --warm steps left out: the template's from its metrics.jsonl
(--log_every 1: step_time_s), TRL's from a TrainerCallback's clock at on_step_end (logging_steps 1).
Generation: TRL's _generate_single_turn wrapped by a clock (the padded prompts through generate to the
completions cut at their end of turn); the template logs generation_share, generation's seconds of a
step over the time from that step's rollout start to the next one's (logged on the next step's row);
TRL's share is computed the same way from its generation clock. A step's generation seconds, for the
template, are its share times its step_time_s (the rollout-to-rollout time and the step-end-to-step-end
time are one period). Generated tokens: each completion's tokens up to and with its end of turn (all
of them when it never ends) - the template's completion_tokens x completions, TRL's completion_ids.
Reported per side: steps/s, the median step, completion tokens/s over the step time and over the
generation time alone, the generation share; the ratios template / TRL; and the reward curve (mean
over rounds, windows of --every steps).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SEED = 1337  # the template's default seed: its EpochSampler's permutation is randperm(seed + epoch)


# ---------------------------------------------------------------- the model, the task, the forks


def environment(threads: int, work: Path) -> dict:
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WANDB_MODE": "offline",
        "TOKENIZERS_PARALLELISM": "false",
        "TQDM_DISABLE": "1",
        "HF_DATASETS_CACHE": str(work / "datasets_cache"),
        "PYTHONWARNINGS": "ignore",
    }


def make_fork(root: Path, example: str) -> Path:
    """A copy of the repository's tracked files with examples/<example>/*.py over train/, as a fork
    installs the example (tests/conftest.py's fork_with)."""
    fork = root / f"fork_{example}"
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    for name in listed.stdout.split():
        if (REPO / name).is_file():
            (fork / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, fork / name)
    for name in ("model.py", "data.py"):
        shutil.copy(REPO / "examples" / example / name, fork / "train" / name)
    return fork


def script(name: str):
    """scripts/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_inputs(args, work: Path, validation: int = 64) -> dict:
    """The tiny chat model, the sort task (`validation` eval prompts), the two forks, and the SFT
    run both sides start from."""
    tiny = script("tiny_chat_model")
    task = script("sort_words_task")
    tokenizer = tiny.with_chat_template(tiny.train_bpe_tokenizer(tiny.stdlib_texts()))
    tiny.save_chat_model(work / "tiny", tokenizer)
    task.write_prompts(work / "task" / "prompts", validation=validation)
    task.write_sft_chats(work / "task" / "sft")
    sft_fork, rl_fork = make_fork(work, "chat_sft"), make_fork(work, "rl")
    started = time.perf_counter()
    command = [
        sys.executable, "train/main.py",
        "--hf_model", str(work / "tiny"), "--dataset", str(work / "task" / "sft"),
        "--block_size", "128", "--max_steps", str(args.sft_steps),
        "--eval_every", "1000000", "--save_every", "0", "--compile", "false",
        "--output_dir", str(work / "sft"),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=sft_fork, env=environment(args.threads, work), capture_output=True, text=True
    )
    if done.returncode != 0:
        sys.exit(f"SFT run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = [json.loads(x) for x in (work / "sft" / "metrics.jsonl").read_text().splitlines()]
    evals = [row for row in rows if "eval_loss" in row]
    return {
        "rl_fork": rl_fork,
        "sft_s": time.perf_counter() - started,
        "sft_eval_loss": evals[-1]["eval_loss"] if evals else float("nan"),
    }


def template_order(prompts: int, seed: int, count: int, batch: int) -> list[int]:
    """The first `count` prompts the template trains: batches.EpochSampler's permutation of each
    epoch (randperm(seed + epoch), 1 process), the tail that makes no whole batch left out."""
    import torch

    order, epoch = [], 0
    while len(order) < count:
        generator = torch.Generator().manual_seed(seed + epoch)
        order += torch.randperm(prompts, generator=generator)[: prompts - prompts % batch].tolist()
        epoch += 1
    return order[:count]


def step_answers(work: Path, args) -> list[list[str]]:
    """Each step's answers in the template's order, each prompt's G times in a row (TRL's rows)."""
    rows = train_prompts(work)
    count = args.steps * args.prompts
    ordered = [rows[i]["answer"] for i in template_order(len(rows), args.seed, count, args.prompts)]
    return [
        [
            a
            for a in ordered[s * args.prompts : (s + 1) * args.prompts]
            for _ in range(args.num_generations)
        ]
        for s in range(args.steps)
    ]


def train_prompts(work: Path) -> list[dict]:
    lines = (work / "task" / "prompts" / "train.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


# ---------------------------------------------------------------- the two sides


def run_template(args, work: Path, fork: Path, name: str, extra: tuple[str, ...] = ()) -> dict:
    """`python train/main.py` in the RL fork, one process (`extra` flags after the bench's, so they
    win); per step its metrics.jsonl row's figures, and its evaluations."""
    out = work / "runs" / name
    command = [
        sys.executable, "train/main.py",
        "--hf_model", str(work / "sft"), "--dataset", str(work / "task" / "prompts"),
        "--batch_size", str(args.prompts), "--num_generations", str(args.num_generations),
        "--max_new_tokens", str(args.max_new_tokens), "--temperature", str(args.temperature),
        "--top_p", "1.0", "--rl_loss", args.rl_loss, "--scale_rewards", args.scale_rewards,
        "--reward_weights", args.reward_weights, "--beta", "0", "--epsilon", "0.2",
        "--epsilon_high", "0.2", "--updates_per_rollout", "1",
        "--max_steps", str(args.steps),
        "--lr", str(args.lr), "--min_lr", str(args.lr), "--warmup_steps", "0",
        "--weight_decay", "0", "--beta1", "0.9", "--beta2", "0.999", "--max_grad_norm", "1.0",
        "--log_every", "1", "--eval_every", "1000000", "--save_every", "0",
        "--compile", "false", "--seed", str(args.seed),
        "--output_dir", str(out), *extra,
    ]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(
        command, cwd=fork, env=environment(args.threads, work), capture_output=True, text=True
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"template run {name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {row["step"]: row for row in rows if "step_time_s" in row}
    evals = [row for row in rows if "eval_pass_rate" in row]
    every = range(1, args.steps + 1)
    completions = args.prompts * args.num_generations
    times = [steps[s]["step_time_s"] for s in every]
    # generation_share on step s + 1's row is step s's; step s's generation seconds: share x its time
    shares = [steps[s + 1].get("generation_share") for s in range(1, args.steps)] + [None]
    return {
        "times": times,
        "rewards": [steps[s]["reward"] for s in every],
        "scores": {name: [steps[s][f"reward_{name}"] for s in every] for name in weights_of(args)},
        "tokens": [steps[s]["completion_tokens"] * completions for s in every],
        "shares": shares,
        "generation_s": [None if q is None else q * t for q, t in zip(shares, times, strict=True)],
        "final_eval": evals[-1] if evals else {},
        "evals": evals,
        "out": out,
        "wall": wall,
    }


def run_trl(args, work: Path, fork: Path, name: str) -> dict:
    """This file as --trl_worker, in a process of its own; what it wrote."""
    out = work / "runs" / f"{name}.json"
    command = [
        sys.executable, __file__, "--trl_worker", str(out), "--work", str(work),
        "--fork", str(fork),
        *(f"--{key}={getattr(args, key)}" for key in SHARED),
    ]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(
        command, env=environment(args.threads, work), capture_output=True, text=True
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"TRL run {name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return {**json.loads(out.read_text()), "wall": wall}


def weights_of(args) -> dict[str, float]:
    """--reward_weights as {name: weight}, parsed as the template parses them."""
    weights = {}
    for part in args.reward_weights.split(","):
        name, _, weight = part.partition(":")
        weights[name.strip()] = float(weight) if weight.strip() else 1.0
    return weights


def example_model(fork: Path):
    """The fork's train/model.py (examples/rl/model.py), imported as the template imports it."""
    sys.path.insert(0, str(fork / "train"))
    spec = importlib.util.spec_from_file_location("rl_example_model", fork / "train" / "model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def trl_reward(function, name: str, log: list, answers: list):
    """The example's f(completion, answer) -> float as TRL calls a reward function: completions
    (conversational: a list of one assistant message each) and the dataset's columns, each a list
    with a row per completion; each call's scores kept in `log`."""

    def reward(completions, answer, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        scores = [float(function(text, a)) for text, a in zip(texts, answer, strict=True)]
        log.append(scores)
        answers.append(list(answer))
        return scores

    reward.__name__ = name  # TRL names its metrics rewards/<__name__>/mean
    return reward


def trl_worker(args) -> None:
    """One GRPOTrainer run: per step its wall time (on_step_end to on_step_end), each reward
    function's scores, and its generation's start, seconds and tokens."""
    import torch

    torch.set_num_threads(args.threads)
    import datasets
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    work, fork = Path(args.work), Path(args.fork)
    example = example_model(fork)
    from chat import end_of_turn_ids  # the fork's train/chat.py, on the path example_model set

    model_dir = str(work / "sft")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # TRL ends a completion at the tokenizer's EOS and the model's generation_config eos_token_id:
    # the tiny model's folder names the template's ends there (scripts/tiny_chat_model.py), which
    # the SFT export keeps; checked, not set
    ends = model.generation_config.eos_token_id
    ends = [ends] if isinstance(ends, int) else list(ends or [])
    if sorted(ends) != sorted(end_of_turn_ids(tokenizer)):
        sys.exit(f"the SFT export's generation_config ends at {ends}, not the template's ends")
    rows = train_prompts(work)
    count = args.steps * args.prompts
    ordered = [rows[i] for i in template_order(len(rows), args.seed, count, args.prompts)]
    dataset = datasets.Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
            for r in ordered
        ]
    )
    weights = weights_of(args)
    found = example.reward_functions()
    scores = {name: [] for name in weights}
    answers = []  # each call's answer column: which prompts the step trained
    reward_funcs = [trl_reward(found[name], name, scores[name], answers) for name in weights]
    marks, starts, generation_s, tokens = [], [], [], []

    class Clock(TrainerCallback):
        def on_train_begin(self, *_, **__):
            marks.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            marks.append(time.perf_counter())

    class Timed(trl.GRPOTrainer):
        def _generate_single_turn(self, *a, **k):
            started = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(*a, **k)
            starts.append(started)
            generation_s.append(time.perf_counter() - started)
            tokens.append(sum(len(ids) for ids in completion_ids))
            return completion_ids, logprobs

    config = trl.GRPOConfig(
        output_dir=str(work / "runs" / "trl_out"),
        # TRL's batch counts completions: prompts x G, one generation per optimizer step
        per_device_train_batch_size=args.prompts * args.num_generations,
        gradient_accumulation_steps=1,
        num_generations=args.num_generations,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        loss_type=args.rl_loss,
        scale_rewards=args.scale_rewards,
        reward_weights=list(weights.values()),
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.2,
        num_iterations=1,
        mask_truncated_completions=False,
        shuffle_dataset=False,  # the template's order, already applied
        use_vllm=False,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        max_steps=args.steps,
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=True,
        logging_steps=1,
        log_completions=False,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=args.seed,
    )
    trainer = Timed(
        model=model,
        reward_funcs=reward_funcs,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()
    times = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    shares = [g / (b - a) for g, a, b in zip(generation_s, starts, starts[1:], strict=False)]
    per_step = {name: [statistics.fmean(call) for call in calls] for name, calls in scores.items()}
    rewards = [
        sum(weights[name] * per_step[name][s] for name in weights) for s in range(len(times))
    ]
    Path(args.trl_worker).write_text(
        json.dumps(
            {
                "times": times,
                "rewards": rewards,
                "scores": per_step,
                "tokens": tokens,
                "shares": shares + [None],
                "generation_s": generation_s,
                "threads": torch.get_num_threads(),
                "answers": answers[:: len(weights)],
            }
        )
    )


# ---------------------------------------------------------------- figures

# the flags a TRL worker gets as they are
SHARED = (
    "steps", "prompts", "num_generations", "max_new_tokens", "temperature", "lr", "rl_loss",
    "scale_rewards", "reward_weights", "threads", "seed",
)  # fmt: skip


def side_figures(runs: list[dict], args) -> dict:
    """Over the counted steps (after --warm) of these runs together: steps/s, the median step,
    completion tokens/s over the steps and over generation, the generation share."""
    counted = range(args.warm, args.steps)
    seconds = sum(run["times"][s] for run in runs for s in counted)
    tokens = sum(run["tokens"][s] for run in runs for s in counted)
    # the share needs the next step's rollout: the last step has none
    timed = [(run, s) for run in runs for s in counted if run["generation_s"][s] is not None]
    timed = [(run, s) for run, s in timed if run["shares"][s] is not None]
    generating = sum(run["generation_s"][s] for run, s in timed)
    return {
        "steps_s": len(runs) * len(counted) / seconds,
        "step_ms": 1000 * statistics.median(run["times"][s] for run in runs for s in counted),
        "tokens_s": tokens / seconds,
        "generation_tokens_s": sum(run["tokens"][s] for run, s in timed) / generating,
        "share": statistics.fmean(run["shares"][s] for run, s in timed),
        "tokens_per_completion": tokens
        / (len(runs) * len(counted) * args.prompts * args.num_generations),
    }


def curve(runs: list[dict], key: str, args) -> list[float]:
    """Per window of --every steps, the mean over rounds and steps of a per-step value."""
    windows = range(0, args.steps, args.every)
    return [
        statistics.fmean(v for run in runs for v in run[key][w : w + args.every]) for w in windows
    ]


def print_curve(runs: dict, args, title: str) -> None:
    ours, theirs = curve(runs["template"], "rewards", args), curve(runs["TRL"], "rewards", args)
    print(f"\n{title}")
    print("| steps | " + " | ".join(f"{w + 1}-{min(w + args.every, args.steps)}"
                                    for w in range(0, args.steps, args.every)) + " |")  # fmt: skip
    print("|---" * (len(ours) + 1) + "|")
    print("| template | " + " | ".join(f"{x:.3f}" for x in ours) + " |")
    print("| TRL | " + " | ".join(f"{x:.3f}" for x in theirs) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="round r: both sides seeded 1337 + r")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    parser.add_argument("--warm", type=int, default=2, help="first steps left out of the timing")
    parser.add_argument("--every", type=int, default=20, help="steps per window of the curve")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--num_generations", type=int, default=8, help="G: completions a prompt")
    parser.add_argument("--max_new_tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--rl_loss", default="dr_grpo", choices=("grpo", "dr_grpo", "dapo"))
    parser.add_argument("--scale_rewards", default="none", choices=("group", "batch", "none"))
    parser.add_argument("--reward_weights", default="exact_answer:1,word_order:0.5,same_words:0.25")
    parser.add_argument("--sft_steps", type=int, default=250, help="the starting model's SFT")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument("--work", default="", help=argparse.SUPPRESS)
    parser.add_argument("--fork", default="", help=argparse.SUPPRESS)
    parser.add_argument("--trl_worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=SEED, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args)
        return
    os.environ["TQDM_DISABLE"] = "1"  # save_pretrained's bar, in this process
    work = Path(tempfile.mkdtemp(prefix="rl_vs_trl_"))
    try:
        figures(args, work)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def figures(args, work: Path) -> None:
    started = time.perf_counter()
    inputs = make_inputs(args, work)
    fork = inputs["rl_fork"]
    print(
        f"model: the tiny chat Llama after {args.sft_steps} SFT steps of examples/chat_sft on the "
        f"sort task ({inputs['sft_s']:.0f} s; eval loss {inputs['sft_eval_loss']:.3f}); "
        f"{args.prompts} prompts x G {args.num_generations} a step, {args.steps} steps a run "
        f"({args.warm} left out of the timing), max_new_tokens {args.max_new_tokens}, temperature "
        f"{args.temperature}, lr {args.lr}, {args.rl_loss} (scale_rewards {args.scale_rewards}), "
        f"{args.threads} threads",
        flush=True,
    )
    runs = {"template": [], "TRL": []}
    for r in range(args.rounds):
        order = ("template", "TRL") if r % 2 == 0 else ("TRL", "template")
        args.seed = SEED + r  # the data order and the sampling: another seed each round
        for side in order:
            tag = f"{side}_{r}"
            if side == "template":
                run = run_template(args, work, fork, tag)
            else:
                run = run_trl(args, work, fork, tag)
            if len(run["times"]) != args.steps:
                sys.exit(f"{side} ran {len(run['times'])} steps, not {args.steps}")
            wanted = step_answers(work, args)
            if side == "TRL" and run["answers"] != wanted:
                pairs = enumerate(zip(run["answers"], wanted, strict=False))
                first = next(
                    (s for s, (a, b) in pairs if a != b), min(len(wanted), len(run["answers"]))
                )
                sys.exit(f"TRL's step {first + 1} trained other prompts than the template's")
            runs[side].append(run)
        a, b = side_figures(runs["template"][-1:], args), side_figures(runs["TRL"][-1:], args)
        print(
            f"round {r + 1} ({' then '.join(order)}): template {a['steps_s']:.2f} steps/s "
            f"(median {a['step_ms']:.0f} ms, generation {a['share']:.0%}), TRL "
            f"{b['steps_s']:.2f} steps/s ({b['step_ms']:.0f} ms, {b['share']:.0%}): template / "
            f"TRL {a['steps_s'] / b['steps_s']:.3f}; wall {runs['template'][-1]['wall']:.0f} s "
            f"and {runs['TRL'][-1]['wall']:.0f} s",
            flush=True,
        )
        print_curve({k: v[-1:] for k, v in runs.items()}, args, f"round {r + 1}'s reward:")

    ours, theirs = side_figures(runs["template"], args), side_figures(runs["TRL"], args)
    print(f"\n{args.rounds} rounds, {args.steps - args.warm} counted steps each:")
    print(
        "| side | steps/s | median step | completion tokens/s (step) | completion tokens/s "
        "(generation) | generation share | tokens a completion |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, t in (("template", ours), ("TRL `GRPOTrainer`", theirs)):
        print(
            f"| {name} | {t['steps_s']:.2f} | {t['step_ms']:.0f} ms | {t['tokens_s']:,.0f} | "
            f"{t['generation_tokens_s']:,.0f} | {t['share']:.1%} | "
            f"{t['tokens_per_completion']:.1f} |"
        )
    per_round = [
        side_figures([x], args)["steps_s"] / side_figures([y], args)["steps_s"]
        for x, y in zip(runs["template"], runs["TRL"], strict=True)
    ]
    print(
        f"template / TRL: steps/s **{ours['steps_s'] / theirs['steps_s']:.3f}** (rounds "
        f"{', '.join(f'{x:.3f}' for x in per_round)}), completion tokens/s over the step "
        f"**{ours['tokens_s'] / theirs['tokens_s']:.3f}**, over generation "
        f"**{ours['generation_tokens_s'] / theirs['generation_tokens_s']:.3f}**"
    )
    print_curve(
        runs, args, f"the reward (mean over {args.rounds} rounds, {args.every}-step windows):"
    )
    for name in weights_of(args):
        t_curve = curve([{"v": x["scores"][name]} for x in runs["template"]], "v", args)
        r_curve = curve([{"v": x["scores"][name]} for x in runs["TRL"]], "v", args)
        print(
            f"{name}: template {t_curve[0]:.3f} -> {t_curve[-1]:.3f}, TRL {r_curve[0]:.3f} -> "
            f"{r_curve[-1]:.3f} (first and last window)"
        )
    final = [run["final_eval"].get("eval_pass_rate") for run in runs["template"]]
    print(f"template's final greedy eval pass rate per round (64 prompts): {final}")
    print(f"TRL threads: {runs['TRL'][0]['threads']}; bench: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
