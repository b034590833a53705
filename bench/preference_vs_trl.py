"""Preference tuning's speed against TRL's DPOTrainer: the template run as a fork runs it
(examples/preference/*.py copied over train/, `python train/main.py`, 1 process) and trl.DPOTrainer,
on the same tiny chat Llama, the same pairs in the same order, the same beta, batch, learning rate,
optimizer and threads; then what the reference costs in each.

    python bench/preference_vs_trl.py                     # CPU, ~5 min: 3 rounds of 5 runs
    python bench/preference_vs_trl.py --rounds 1 --no_reference_cost   # template and TRL, ~1 min
    python bench/preference_vs_trl.py --layers 8 --width 512 --threads 16        # a bigger model

Each run is a process of its own (OMP_NUM_THREADS and torch.set_num_threads both --threads); a
round runs the template, TRL, then the reference's variants, one after another, so that the
machine's drift hits every side. Timed: the steady-state optimizer steps (the first --warm left
out), each step's wall time from step end to step end: data, forward (reference and policy),
backward, clipping, the AdamW step and the step's log row. The template's come from its
metrics.jsonl (log_every 1: step_time_s per step); TRL's from a TrainerCallback's clock at
on_step_end (logging_steps 1 too). Reported per side: pairs/s, completion tokens/s (the tokens
scored, chosen and rejected) and tokens/s (every real token of both sequences, prompts included,
padding not); the ratio template / TRL per round, overall (all rounds' counted steps together),
and step by step (each step trains the same batch on both sides).

Matched: a random 4-layer Llama of width 256 (2.8 M parameters; its tokenizer and ChatML template
are scripts/tiny_chat_model.py's, 322 tokens), fp32, no dropout (Llama's attention dropout is 0;
TRL disables dropout too); 96 pairs of a user prompt and two answers of log-normal lengths in words
(median 12 prompt words, 18 answer words, the two answers drawn apart; this tokenizer makes ~5
tokens of a word: a sequence's median is ~190 tokens, ~100 of them the answer, the longest ~390),
as strings for the template and as TRL's conversational shape for TRL (the same rendering:
tests/test_preference.py); DPO's sigmoid loss, beta 0.1; batch 8 pairs, padded to the batch's
longest sequence; max_length = block_size 512 (no pair is cut); AdamW (fused, both), betas (0.9,
0.999), weight decay 0, a constant learning rate of 1e-4, gradient clipping at 1.0; no gradient
checkpointing (TRL's DPOConfig turns it on by default; the template's is off), no bf16 (TRL's
default where the CPU has it; the template runs fp32), no eval, no checkpoint inside the timed
steps. TRL reads the pairs in the template's order (its EpochSampler's permutation, sequential
sampling in TRL), so both train on the same batches, checked by their token counts: their losses
agree at every step (step 1 is log 2 for both, the policy being its reference; the later steps
check that the optimizers and data orders match).

The reference's cost: the template with the frozen full copy (--lora_r 0: the runs above), with
LoRA (r 16 on every linear layer of the blocks: the reference is the same model with its adapters
off) and with SimPO (no reference); TRL with the reference live (ref_model=None: TRL loads a second
copy from the policy's folder) and with precompute_ref_log_probs (one no-grad pass over the
training pairs before training, timed apart, then steps with no reference forward). The template
has no precompute mode.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SEED = 1337  # the template's default seed: its EpochSampler's permutation is randperm(seed + epoch)


# ---------------------------------------------------------------- the model and the pairs


def make_model(folder: Path, args) -> Path:
    """A random Llama of --layers and --width with tiny_chat_model.py's tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(REPO / "scripts"))
    import tiny_chat_model

    tokenizer = tiny_chat_model.with_chat_template(
        tiny_chat_model.train_bpe_tokenizer(tiny_chat_model.stdlib_texts())
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.width,
        intermediate_size=2 * args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.width // 64),
        num_key_value_heads=max(1, args.width // 64),
        max_position_embeddings=args.block_size,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def words() -> list[str]:
    """The distinct words of the standard library modules the tokenizer was trained on."""
    sys.path.insert(0, str(REPO / "scripts"))
    import tiny_chat_model

    text = " ".join(tiny_chat_model.stdlib_texts())
    return sorted(set(re.findall(r"[a-z]{3,12}", text)))


def make_pairs(count: int, seed: int) -> list[dict]:
    """Pairs of strings: a prompt and two different answers, lengths log-normal in words."""
    rng = random.Random(seed)
    vocabulary = words()

    def text(median: float, low: int, high: int) -> str:
        n = int(min(high, max(low, rng.lognormvariate(math.log(median), 0.6))))
        return " ".join(rng.choice(vocabulary) for _ in range(n))

    pairs = []
    while len(pairs) < count:
        pair = {"prompt": text(12, 2, 30), "chosen": text(18, 1, 40), "rejected": text(18, 1, 40)}
        if pair["chosen"] != pair["rejected"]:  # the template refuses a pair whose two are one
            pairs.append(pair)
    return pairs


def conversational(pair: dict) -> dict:
    """TRL's conversational shape of a string pair (the template reads strings as these turns)."""
    return {
        "prompt": [{"role": "user", "content": pair["prompt"]}],
        "chosen": [{"role": "assistant", "content": pair["chosen"]}],
        "rejected": [{"role": "assistant", "content": pair["rejected"]}],
    }


def token_counts(pair: dict, tokenizer) -> tuple[int, int, int]:
    """(completion tokens of both answers, tokens of both sequences, the longer sequence)."""
    turns = conversational(pair)

    def tokens(messages, **kwargs) -> int:
        return len(
            tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
        )

    prompt = tokens(turns["prompt"], add_generation_prompt=True)
    lengths = [tokens(turns["prompt"] + turns[side]) for side in COMPLETIONS]
    return sum(n - prompt for n in lengths), sum(lengths), max(lengths)


COMPLETIONS = ("chosen", "rejected")


def template_order(pairs: int) -> list[int]:
    """The template's first epoch: batches.EpochSampler's permutation (1 process)."""
    import torch

    return torch.randperm(pairs, generator=torch.Generator().manual_seed(SEED)).tolist()


# ---------------------------------------------------------------- the two sides


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


def make_fork(root: Path) -> Path:
    """A copy of the repository's tracked files with examples/preference/*.py over train/, as a fork
    installs the example (tests/conftest.py's fork_with)."""
    fork = root / "fork"
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    for name in listed.stdout.split():
        if (REPO / name).is_file():
            (fork / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, fork / name)
    for name in ("model.py", "data.py"):
        shutil.copy(REPO / "examples" / "preference" / name, fork / "train" / name)
    return fork


def run_template(args, work: Path, fork: Path, name: str, extra: list[str]) -> dict:
    """`python train/main.py` in the fork, one process; its metrics.jsonl's per-step rows."""
    out = work / "runs" / name
    command = [
        sys.executable, "train/main.py",
        "--hf_model", str(work / "model"),
        "--dataset", str(work / "pairs"),
        "--block_size", str(args.block_size),
        "--batch_size", str(args.batch_size),
        "--max_steps", str(args.steps),
        "--lr", str(args.lr), "--min_lr", str(args.lr), "--warmup_steps", "0",
        "--weight_decay", "0", "--beta1", "0.9", "--beta2", "0.999", "--max_grad_norm", "1.0",
        "--beta", str(args.beta),
        "--log_every", "1", "--eval_every", "1000000", "--save_every", "0",
        "--compile", "false", "--seed", str(SEED),
        "--output_dir", str(out),
        *extra,
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
    return {
        "times": [steps[s]["step_time_s"] for s in range(1, args.steps + 1)],
        "losses": [steps[s]["loss"] for s in range(1, args.steps + 1)],
        "wall": wall,
    }


def run_trl(args, work: Path, name: str, precompute: bool) -> dict:
    """This file as --trl_worker, in a process of its own; what it wrote."""
    out = work / "runs" / f"{name}.json"
    command = [
        sys.executable, __file__, "--trl_worker", str(out),
        "--work", str(work), "--steps", str(args.steps), "--batch_size", str(args.batch_size),
        "--block_size", str(args.block_size), "--lr", str(args.lr), "--beta", str(args.beta),
        "--threads", str(args.threads),
    ] + (["--precompute"] if precompute else [])  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(
        command, env=environment(args.threads, work), capture_output=True, text=True
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"TRL run {name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return {**json.loads(out.read_text()), "wall": wall}


def trl_worker(args) -> None:
    """One DPOTrainer run: per step its wall time (on_step_end to on_step_end), loss and the
    batch's token counts; with --precompute, the precomputation pass's time."""
    import torch

    torch.set_num_threads(args.threads)
    import datasets
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    work = Path(args.work)
    model_dir = str(work / "model")
    pairs = [json.loads(line) for line in (work / "pairs" / "train.jsonl").read_text().splitlines()]
    ordered = [conversational(pairs[i]) for i in template_order(len(pairs))]
    ordered = ordered[: args.steps * args.batch_size]
    marks, losses, tokens, precompute = [], [], [], []

    class Clock(TrainerCallback):
        def on_train_begin(self, *_, **__):
            marks.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            marks.append(time.perf_counter())

    class Timed(trl.DPOTrainer):
        def _precompute_ref_logps(self, *a, **k):
            started = time.perf_counter()
            result = super()._precompute_ref_logps(*a, **k)
            precompute.append(time.perf_counter() - started)
            return result

        def compute_loss(self, model, inputs, *a, **k):
            loss = super().compute_loss(model, inputs, *a, **k)
            losses.append(loss.detach())
            completion = inputs["completion_mask"].sum().item()
            tokens.append((completion, inputs["attention_mask"].sum().item()))
            return loss

    config = trl.DPOConfig(
        output_dir=str(work / "runs" / "trl_out"),
        beta=args.beta,
        loss_type=["sigmoid"],
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        max_steps=args.steps,
        max_length=args.block_size,
        precompute_ref_log_probs=args.precompute,
        train_sampling_strategy="sequential",  # the template's order, already applied
        gradient_checkpointing=False,  # DPOConfig's default is True; the template's is off
        bf16=False,  # DPOConfig's default where bf16 is available: the template runs fp32
        use_cpu=True,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=SEED,
    )
    trainer = Timed(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        ref_model=None,  # TRL loads the reference from the policy's path, or precomputes
        args=config,
        train_dataset=datasets.Dataset.from_list(ordered),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[Clock()],
    )
    trainer.train()
    Path(args.trl_worker).write_text(
        json.dumps(
            {
                "times": [b - a for a, b in itertools.pairwise(marks)],
                "losses": [loss.item() for loss in losses],
                "tokens": tokens,
                "precompute_s": precompute[0] if precompute else None,
                "threads": torch.get_num_threads(),
            }
        )
    )


# ---------------------------------------------------------------- figures

# the runs of a round, in order: (name, side, template flags or TRL's precompute)
LIVE = ("template", "template", [])
TRL_LIVE = ("TRL", "trl", False)
REFERENCE_RUNS = (
    ("template LoRA", "template", ["--lora_r", "16", "--lora_alpha", "32"]),
    ("template SimPO", "template", ["--preference_loss", "simpo"]),
    ("TRL precompute", "trl", True),
)
LABELS = {
    "template": "template, frozen full copy (`--lora_r 0`)",
    "TRL": "TRL `DPOTrainer`, `ref_model` live",
    "template LoRA": "template, LoRA r 16: the adapters off, no copy",
    "template SimPO": "template, SimPO: no reference",
    "TRL precompute": "TRL, `precompute_ref_log_probs=True`: the training steps",
}


def rates(runs: list[dict], steps: list[tuple[int, int]], args) -> dict:
    """pairs/s, completion tokens/s, tokens/s and the median step over the counted steps (after
    --warm) of all these runs together."""
    times = [t for run in runs for t in run["times"][args.warm :]]
    counted = [c for _ in runs for c in steps[args.warm :]]
    seconds = sum(times)
    return {
        "pairs_s": len(times) * args.batch_size / seconds,
        "completion_s": sum(c for c, _ in counted) / seconds,
        "tokens_s": sum(t for _, t in counted) / seconds,
        "step_ms": 1000 * statistics.median(times),
        "pair_ms": 1000 * seconds / (len(times) * args.batch_size),
    }


def step_ratios(ours: dict, theirs: dict, args) -> list[float]:
    """Per counted step, our time over theirs: the same batch on both sides."""
    pairs = zip(ours["times"][args.warm :], theirs["times"][args.warm :], strict=True)
    return [a / b for a, b in pairs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--warm", type=int, default=2, help="first steps left out of the timing")
    parser.add_argument("--batch_size", type=int, default=8, help="pairs per step")
    parser.add_argument("--block_size", type=int, default=512, help="max_length: prompt + answer")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--no_reference_cost", action="store_true", help="template and TRL live only"
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument("--work", default="", help=argparse.SUPPRESS)
    parser.add_argument("--trl_worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--precompute", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args)
        return
    work = Path(tempfile.mkdtemp(prefix="preference_vs_trl_"))
    try:
        figures(args, work)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def figures(args, work: Path) -> None:
    import safetensors.torch
    from transformers import AutoTokenizer

    started = time.perf_counter()
    make_model(work / "model", args)
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    count = args.steps * args.batch_size  # one epoch: every pair trained once, by both
    pairs = make_pairs(count + 8, seed=0)
    (work / "pairs").mkdir()
    for split, rows in (("train", pairs[:count]), ("validation", pairs[count:])):
        with open(work / "pairs" / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    counts = [token_counts(pair, tokenizer) for pair in pairs[:count]]
    longest = max(c[2] for c in counts)
    if longest > args.block_size:
        sys.exit(f"a pair is {longest} tokens, over block_size {args.block_size}")
    order = template_order(count)
    steps = []  # (completion tokens, tokens) of each step's batch, both sequences of each pair
    for s in range(args.steps):
        batch = [counts[i] for i in order[s * args.batch_size : (s + 1) * args.batch_size]]
        steps.append((sum(c[0] for c in batch), sum(c[1] for c in batch)))
    fork = make_fork(work)
    weights = safetensors.torch.load_file(str(work / "model" / "model.safetensors"))
    print(
        f"model: a random Llama, {args.layers} layers, width {args.width}, "
        f"{sum(w.numel() for w in weights.values()):,} parameters, {len(tokenizer)} tokens; "
        f"{count} pairs, {args.batch_size} a step, {args.steps} steps a run ({args.warm} left "
        f"out), {args.threads} threads; a sequence's median {statistics.median(c[1] for c in counts) / 2:.0f} "
        f"tokens, {statistics.median(c[0] for c in counts) / 2:.0f} of them the answer; the longest "
        f"{longest}",
        flush=True,
    )
    kinds = [LIVE, TRL_LIVE] + ([] if args.no_reference_cost else list(REFERENCE_RUNS))
    runs = {name: [] for name, _, _ in kinds}
    for r in range(args.rounds):
        for name, side, how in kinds:
            tag = f"{name.replace(' ', '_')}_{r}"
            if side == "template":
                run = run_template(args, work, fork, tag, how)
            else:
                run = run_trl(args, work, tag, precompute=how)
                if [tuple(t) for t in run["tokens"]] != steps:
                    print(f"warning: {name}'s batches are not the template's (token counts differ)")
            runs[name].append(run)
        ours, theirs = runs["template"][-1], runs["TRL"][-1]
        a, b = rates([ours], steps, args), rates([theirs], steps, args)
        print(
            f"round {r + 1}: template {a['pairs_s']:.2f} pairs/s (median step "
            f"{a['step_ms']:.0f} ms), TRL {b['pairs_s']:.2f} pairs/s ({b['step_ms']:.0f} ms): "
            f"template / TRL {a['pairs_s'] / b['pairs_s']:.3f}, median of per-step ratios "
            f"{1 / statistics.median(step_ratios(ours, theirs, args)):.3f}; "
            + ", ".join(
                f"{name} {rates([runs[name][-1]], steps, args)['pair_ms']:.1f} ms/pair"
                for name in runs
            ),
            flush=True,
        )

    ours, theirs = rates(runs["template"], steps, args), rates(runs["TRL"], steps, args)
    per_round = [
        rates([x], steps, args)["pairs_s"] / rates([y], steps, args)["pairs_s"]
        for x, y in zip(runs["template"], runs["TRL"], strict=True)
    ]
    per_step = [
        1 / q
        for x, y in zip(runs["template"], runs["TRL"], strict=True)
        for q in step_ratios(x, y, args)
    ]
    print(f"\n{args.rounds} rounds, {args.steps - args.warm} counted steps each:")
    print("| side | pairs/s | completion tokens/s | tokens/s | median step |")
    print("|---|---|---|---|---|")
    for name, t in (("template", ours), ("TRL", theirs)):
        print(
            f"| {LABELS[name]} | {t['pairs_s']:.2f} | {t['completion_s']:,.0f} | "
            f"{t['tokens_s']:,.0f} | {t['step_ms']:.0f} ms |"
        )
    print(
        f"template / TRL, pairs/s (= tokens/s: the same batches): **{ours['pairs_s'] / theirs['pairs_s']:.3f}** "
        f"(rounds: {', '.join(f'{x:.3f}' for x in per_round)}; the same batch step by step, median "
        f"{statistics.median(per_step):.3f}, {min(per_step):.2f} to {max(per_step):.2f})"
    )
    ours_losses = [x["losses"] for x in runs["template"]]
    theirs_losses = [y["losses"] for y in runs["TRL"]]
    worst = max(
        abs(a - b)
        for x, y in zip(ours_losses, theirs_losses, strict=True)
        for a, b in zip(x, y, strict=True)
    )
    print(
        f"loss at step 1: template {ours_losses[0][0]:.7f}, TRL {theirs_losses[0][0]:.7f} "
        f"(log 2 = {math.log(2):.7f}); at step {args.steps}: template {ours_losses[0][-1]:.7f}, "
        f"TRL {theirs_losses[0][-1]:.7f}; the largest difference at any step of any round: "
        f"{worst:.1e}",
        flush=True,
    )
    if args.no_reference_cost:
        print(f"bench: {time.perf_counter() - started:.0f} s")
        return
    print("\n| run | ms per pair | pairs/s | against the template's frozen copy |")
    print("|---|---|---|---|")
    for name in runs:
        t = rates(runs[name], steps, args)
        print(
            f"| {LABELS[name]} | {t['pair_ms']:.1f} | {t['pairs_s']:.2f} | "
            f"{t['pair_ms'] / ours['pair_ms']:.3f} |"
        )
    passes = [run["precompute_s"] for run in runs["TRL precompute"]]
    pass_s = statistics.median(passes)
    trained = rates(runs["TRL precompute"], steps, args)["pair_ms"] * count / 1000
    print(
        f"TRL's precomputation pass (before training, {count} pairs in batches of "
        f"{args.batch_size}): median {pass_s:.2f} s ({', '.join(f'{p:.2f}' for p in passes)}), "
        f"{1000 * pass_s / count:.1f} ms per pair; with it, one epoch of {count} pairs costs "
        f"{pass_s + trained:.1f} s against {theirs['pair_ms'] * count / 1000:.1f} s live"
    )
    print(f"bench: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
