"""A verifiable task a tiny model can learn on CPU, written offline, for the RL example (examples/rl):
put 2 to 4 words in alphabetical order.

    python scripts/sort_words_task.py runs/sort_words

OUT_DIR gets two folders of JSON lines, each split as `datasets` names them (train.jsonl and
validation.jsonl, the eval set):

    prompts/  {"prompt": "sort: river alpha maple", "answer": "alpha maple river"}   for RL
    sft/      {"messages": [user: the same prompt, assistant: the answer]}             for SFT first

The words are the tiny chat model's ten (scripts/tiny_chat_model.py), each starting with its own
letter, so the order is the first letters' and a 2-layer model can learn it. The answer is checked
exactly, and in part: examples/rl/model.py's rewards give credit for each word in its place and for
answering with the prompt's words, so completions of one prompt score differently even when none
is right (a group whose completions all score the same carries no gradient in GRPO). The prompts
of the two folders are drawn apart (another seed), and the validation prompts are none of the
training ones.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

# tiny_chat_model.WORDS: each starts with its own letter
WORDS = ["alpha", "river", "stone", "cloud", "maple", "tiger", "ocean", "ember", "lunar", "pixel"]


def sort_prompt(rng: random.Random) -> tuple[str, str]:
    """(prompt, answer): 2 to 4 different words, and the same words in alphabetical order."""
    words = rng.sample(WORDS, rng.randint(2, 4))
    return "sort: " + " ".join(words), " ".join(sorted(words))


def write_prompts(folder: Path, train: int = 512, validation: int = 64, seed: int = 0) -> Path:
    """folder/train.jsonl and folder/validation.jsonl: {"prompt", "answer"} rows, no validation
    prompt among the training ones."""
    rng = random.Random(seed)
    rows = {}
    while len(rows) < train + validation:
        prompt, answer = sort_prompt(rng)
        rows.setdefault(prompt, answer)
    items = list(rows.items())
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", items[:train]), ("validation", items[train:])):
        lines = [json.dumps({"prompt": prompt, "answer": answer}) for prompt, answer in part]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def write_sft_chats(folder: Path, train: int = 512, validation: int = 64, seed: int = 1) -> Path:
    """The same task as conversations for examples/chat_sft: folder/train.jsonl, validation.jsonl."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name, count in (("train", train), ("validation", validation)):
        lines = []
        for _ in range(count):
            prompt, answer = sort_prompt(rng)
            messages = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": answer},
            ]
            lines.append(json.dumps({"messages": messages}))
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="the folder to write (new or empty)")
    args = parser.parse_args(argv)
    if args.out_dir.exists() and any(args.out_dir.iterdir()):
        print(f"error: {args.out_dir} is not empty: pass a new or empty folder", file=sys.stderr)
        return 2
    prompts = write_prompts(args.out_dir / "prompts")
    chats = write_sft_chats(args.out_dir / "sft")
    print(f"wrote {prompts} (RL: --dataset {prompts}) and {chats} (SFT: --dataset {chats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
