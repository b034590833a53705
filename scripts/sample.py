"""Generate text from a trained model: a run folder (its config.yaml and model.safetensors) or a checkpoint folder.

    python scripts/sample.py runs/run_001 --prompt "def main(" --max_new_tokens 200 --temperature 0.8 --top_k 40
    python scripts/sample.py runs/run_001/checkpoints/step_00000200 --seed 1
    python scripts/sample.py runs/chat_001 --chat --prompt "How do I reverse a list?" --temperature 0

With --chat (a chat model's: a chat run's summary prints the command with it) the prompt is a user's
message: it goes through the tokenizer's chat template (an assistant's turn follows), and the answer
ends at the end of the assistant's turn.

The built-in GPT and Hugging Face models alike, with the run's own tokenizer (bytes or Hugging Face). The same
seed gives the same text. A sharded (FSDP) checkpoint is made one file first with scripts/consolidate.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))

import harness  # noqa: E402
from chat import end_of_turn_ids  # noqa: E402 - the chat examples' end of a turn
from errors import ConfigError  # noqa: E402
from task import build_model  # noqa: E402 - model.py's, through the seam


def load_trained(folder: Path):
    """(config, model with the folder's weights, tokenizer or None for bytes); a ConfigError if they do not fit."""
    return harness.load_trained(folder, build_model)


@torch.no_grad()
def predicts_next_tokens(model) -> bool:
    """Whether the model is a causal LM: token ids in, logits (batch, position, vocabulary) out."""
    try:
        logits = model(input_ids=torch.tensor([[0, 1]])).logits
    except (TypeError, ValueError, RuntimeError, AttributeError, KeyError):
        return False
    return logits.dim() == 3 and logits.shape[:2] == (1, 2)


@torch.no_grad()
def generate(
    model,
    tokenizer,
    block_size: int,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
    chat: bool = False,
) -> str:
    """Sample `max_new_tokens` after the prompt (an empty prompt starts a new document). temperature 0: greedy.
    chat: the prompt is a user's message, through the chat template; the answer stops at the end of its turn."""
    stop_ids = set()
    if chat:
        ids = chat_prompt(tokenizer, prompt)
        stop_ids = end_of_turn_ids(tokenizer)
    elif tokenizer is None:
        ids = list(prompt.encode("utf-8")) or [ord("\n")]
    else:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] or [tokenizer.eos_token_id]
    tokens, generator = torch.tensor([ids]), torch.Generator().manual_seed(seed)
    for _ in range(max_new_tokens):
        logits = model(input_ids=tokens[:, -block_size:]).logits[0, -1].float()
        if temperature == 0:
            next_id = logits.argmax().view(1)
        else:
            logits = logits / temperature
            if top_k:
                logits[logits < logits.topk(min(top_k, logits.numel())).values[-1]] = -torch.inf
            next_id = torch.multinomial(logits.softmax(-1), 1, generator=generator)
        if next_id.item() in stop_ids:
            break
        tokens = torch.cat([tokens, next_id.view(1, 1)], dim=1)
    new = tokens[0, len(ids) :].tolist()
    return (
        bytes(new).decode("utf-8", errors="replace") if tokenizer is None else tokenizer.decode(new)
    )


def chat_prompt(tokenizer, message: str) -> list[int]:
    """A user's message as the chat template writes it, with the assistant's turn begun."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "--chat needs the run's tokenizer to have a chat template (a chat fine-tuning run's has "
            "one: examples/chat_sft); without --chat the prompt is continued as text"
        )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "folder", type=Path, help="a run folder or a checkpoint folder (checkpoints/step_N)"
    )
    parser.add_argument(
        "--prompt", default="", help="the text to continue (default: a new document)"
    )
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="0: always the likeliest token"
    )
    parser.add_argument(
        "--top_k", type=int, default=40, help="sample among the k likeliest tokens; 0: all"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user's message: through the chat template, the reply alone printed",
    )
    args = parser.parse_args(argv)
    if args.temperature < 0 or args.top_k < 0 or args.max_new_tokens < 0:
        parser.error("temperature, top_k and max_new_tokens must be >= 0")
    try:
        cfg, model, tokenizer = load_trained(args.folder)
        if args.chat:
            chat_prompt(tokenizer, "")  # the tokenizer has a chat template
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if not predicts_next_tokens(model):
        sys.exit(
            f"error: sample.py samples causal language models, and the model of {args.folder} is "
            f"not one ({type(model).__name__}: no logits per position over a vocabulary, as a "
            "classifier's are); evaluate it with its task's metrics instead"
        )
    print(
        ("" if args.chat else args.prompt)
        + generate(
            model,
            tokenizer,
            cfg.block_size,
            args.prompt,
            args.max_new_tokens,
            args.temperature,
            args.top_k,
            args.seed,
            chat=args.chat,
        )
    )


if __name__ == "__main__":
    main()
