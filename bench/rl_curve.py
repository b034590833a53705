"""Does the RL example learn? Its greedy eval pass rate from the SFT model it starts at, over a few
hundred steps, for several seeds: the template as a fork runs it (examples/rl/*.py copied over
train/, `python train/main.py`, 1 process), from a tiny chat model that the chat example fine-tuned on
the sorting task.

    python bench/rl_curve.py                              # CPU, ~4.5 min: the SFT, then 3 seeds
    python bench/rl_curve.py --seeds 1 --steps 100        # ~1 min
    python bench/rl_curve.py --lr 3e-4 --temperature 1    # other settings, as flags

The start: scripts/tiny_chat_model.py's random 2-layer Llama of width 32 (ChatML), fine-tuned by the
template's examples/chat_sft fork on scripts/sort_words_task.py's sft/ chats for --sft_steps steps
(bench/rl_vs_trl.py's make_inputs, shared). The SFT export's greedy pass rate over the eval prompts
(the task's validation split, --eval_prompts of them) is counted here, each prompt alone through
the chat template and transformers' generate, scored by the fork's own reward functions: the
curve's step 0 (the template has no evaluation before its first step). Then, for each seed
(1337 + r: the data order and the sampling), the RL fork from that export for --steps steps with an
evaluation every --eval_every steps (the template's: greedy, over exactly the eval prompts):
eval_pass_rate (exact_answer's share) and eval_reward (the weighted reward) at each. Each seed's
export is counted here again and must equal its last evaluation, so step 0 and the curve are one
measurement.

The rewards (examples/rl/model.py): exact_answer (1 or 0), word_order (the share of the answer's
words in their place: partial credit) and same_words (the format: the prompt's words, each once),
weights 1, 0.5, 0.25. The partial credit keeps a group's completions apart when none is exact (a
group that scores all alike carries no gradient), and the start is a model within reach of the
skill: 250 SFT steps answer about a third of the eval prompts greedily (sampled at temperature 0.7,
about one completion in eight is exact), so most groups hold better and worse completions.

The defaults, and why (each measured on this project's 2-core CPU, bench/README.md):
16 prompts x G 8 a step (128 completions): the rise over 300 steps is larger and smoother than
bench/rl_vs_trl.py's 8 x 8 (+0.18 against +0.15, 3 seeds each), though 8 x 8 gets more per
completion; temperature 0.7 and a constant lr of 1e-4 (3e-4 broke the SFT model first: at
temperature 1, pass rate 0.32 -> 0.05 at step 50, the policy no longer ending its turn, since
word_order costs nothing for words after the answer's); 300 steps; 256 eval prompts (one prompt is
0.004 of the pass rate; at the task's default 64, 0.016, and those 64 are easier: 0.39 for the SFT);
dr_grpo without std scaling; 1 thread (2 OpenMP threads on a busy 2-core machine wait on each other:
~10x slower steps seen).

Printed: the settings, per evaluation the pass rate of each seed, their mean and the mean reward,
the SFT's at step 0; then the rise (the last evaluation's pass rate over the SFT's) per seed, its
mean and spread (min, max, standard deviation), and the wall time of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rl_vs_trl import SEED, example_model, make_inputs, run_template, weights_of  # noqa: E402


def greedy_eval(args, model_folder: Path, fork: Path, prompts: Path) -> dict:
    """The pass rate and the mean reward of the folder's model over the eval prompts: each prompt
    alone (no padding) through its chat template, greedy, its text up to the end of turn, scored
    by the fork's reward functions with --reward_weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    example = example_model(fork)
    from chat import end_of_turn_ids  # the fork's train/chat.py, on the path example_model set

    functions, weights = example.reward_functions(), weights_of(args)
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    ends = sorted(end_of_turn_ids(tokenizer))
    rows = [json.loads(x) for x in (prompts / "validation.jsonl").read_text().splitlines() if x]
    passed, reward = 0.0, 0.0
    for row in rows:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}],
            add_generation_prompt=True,
            return_tensors="pt",
        )
        ids = ids if torch.is_tensor(ids) else ids["input_ids"]
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                eos_token_id=ends,
                pad_token_id=ends[0],
            )
        new = out[0, ids.size(1) :].tolist()
        text = tokenizer.decode(new[: next((i for i, t in enumerate(new) if t in ends), len(new))])
        passed += functions["exact_answer"](text, row["answer"])
        reward += sum(w * functions[name](text, row["answer"]) for name, w in weights.items())
    return {"eval_pass_rate": passed / len(rows), "eval_reward": reward / len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="run r seeded 1337 + r")
    parser.add_argument("--steps", type=int, default=300, help="RL optimizer steps per run")
    parser.add_argument("--eval_every", type=int, default=50, help="steps between evaluations")
    parser.add_argument("--eval_prompts", type=int, default=256, help="the eval set's prompts")
    parser.add_argument("--sft_steps", type=int, default=250, help="the starting model's SFT")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--num_generations", type=int, default=8, help="G: completions a prompt")
    parser.add_argument("--max_new_tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--lr", type=float, default=1e-4, help="constant, no warmup")
    parser.add_argument("--rl_loss", default="dr_grpo", choices=("grpo", "dr_grpo", "dapo"))
    parser.add_argument("--scale_rewards", default="none", choices=("group", "batch", "none"))
    parser.add_argument("--reward_weights", default="exact_answer:1,word_order:0.5,same_words:0.25")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = parser.parse_args()
    args.seed = SEED
    os.environ["TQDM_DISABLE"] = "1"  # save_pretrained's bar, in this process
    work = Path(tempfile.mkdtemp(prefix="rl_curve_"))
    try:
        curve(args, work)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def curve(args, work: Path) -> None:
    started = time.perf_counter()
    inputs = make_inputs(args, work, validation=args.eval_prompts)
    fork, prompts = inputs["rl_fork"], work / "task" / "prompts"
    sft = greedy_eval(args, work / "sft", fork, prompts)
    print(
        f"start: the tiny chat Llama after {args.sft_steps} SFT steps of examples/chat_sft on the "
        f"sort task ({inputs['sft_s']:.0f} s; eval loss {inputs['sft_eval_loss']:.3f}): greedy "
        f"pass rate {sft['eval_pass_rate']:.3f}, reward {sft['eval_reward']:.3f} over "
        f"{args.eval_prompts} eval prompts\nRL: {args.prompts} prompts x G {args.num_generations} "
        f"a step, {args.steps} steps, eval every {args.eval_every}, max_new_tokens "
        f"{args.max_new_tokens}, temperature {args.temperature}, constant lr {args.lr}, "
        f"{args.rl_loss} (scale_rewards {args.scale_rewards}), rewards {args.reward_weights}, "
        f"{args.threads} threads",
        flush=True,
    )
    runs = []
    for r in range(args.seeds):
        args.seed = SEED + r
        run = run_template(args, work, fork, f"seed_{r}", ("--eval_every", str(args.eval_every)))
        evals = {row["step"]: row for row in run["evals"]}
        last = greedy_eval(args, run["out"], fork, prompts)
        if abs(last["eval_pass_rate"] - evals[args.steps]["eval_pass_rate"]) > 1e-9:
            sys.exit(
                f"seed {args.seed}: the export's greedy pass rate {last['eval_pass_rate']} is not "
                f"the last evaluation's {evals[args.steps]['eval_pass_rate']}"
            )
        runs.append({"evals": evals, "wall": run["wall"], "seed": args.seed})
        passes = [evals[s]["eval_pass_rate"] for s in sorted(evals)]
        print(
            f"seed {args.seed}: {run['wall']:.0f} s; pass rate "
            f"{' '.join(f'{x:.3f}' for x in passes)}",
            flush=True,
        )
    report(args, sft, runs)
    print(f"bench: {time.perf_counter() - started:.0f} s")


def report(args, sft: dict, runs: list[dict]) -> None:
    steps = sorted(runs[0]["evals"])
    seeds = " | ".join(f"seed {run['seed']}" for run in runs)
    print(f"\n| step | {seeds} | mean pass rate | mean reward |")
    print("|---" * (len(runs) + 3) + "|")
    same = " | ".join(f"{sft['eval_pass_rate']:.3f}" for _ in runs)
    print(f"| 0 (SFT) | {same} | {sft['eval_pass_rate']:.3f} | {sft['eval_reward']:.3f} |")
    for step in steps:
        passes = [run["evals"][step]["eval_pass_rate"] for run in runs]
        rewards = [run["evals"][step]["eval_reward"] for run in runs]
        print(
            f"| {step} | {' | '.join(f'{x:.3f}' for x in passes)} | "
            f"{statistics.fmean(passes):.3f} | {statistics.fmean(rewards):.3f} |"
        )
    rises = [run["evals"][steps[-1]]["eval_pass_rate"] - sft["eval_pass_rate"] for run in runs]
    spread = statistics.stdev(rises) if len(rises) > 1 else float("nan")
    print(
        f"\nrise of the pass rate, SFT {sft['eval_pass_rate']:.3f} to step {steps[-1]}: mean "
        f"**{statistics.fmean(rises):+.3f}** (seeds {', '.join(f'{x:+.3f}' for x in rises)}; "
        f"min {min(rises):+.3f}, max {max(rises):+.3f}, std {spread:.3f}); one eval prompt is "
        f"{1 / args.eval_prompts:.4f}; each run's wall time "
        f"{', '.join(str(round(run['wall'])) + ' s' for run in runs)}"
    )


if __name__ == "__main__":
    main()
