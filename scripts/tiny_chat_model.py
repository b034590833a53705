"""A tiny chat model folder made offline in seconds, to try chat fine-tuning (examples/chat_sft) end to end
without the hub, and to see what a local --hf_model folder must hold.

    python scripts/tiny_chat_model.py runs/tiny_chat

OUT_DIR gets what a hub chat checkpoint has: config.json and model.safetensors (a 2-layer
Llama-architecture causal LM with random weights, 128 positions), the tokenizer (tokenizer.json and
tokenizer_config.json: a byte-level BPE of 320 tokens trained on a few of your Python's standard library
modules, plus ChatML's <|im_start|> and <|im_end|>) and its chat template (chat_template.jinja). Beside
them, chats.jsonl: 96 short conversations to fine-tune on (the assistant reverses or upper-cases a word).
AutoModelForCausalLM and AutoTokenizer .from_pretrained(OUT_DIR) load it, and with examples/chat_sft
installed `--hf_model OUT_DIR --dataset OUT_DIR/chats.jsonl --block_size 128` fine-tunes it. The tests make their tiny
models and chats with these same functions (tests/conftest.py).
"""

from __future__ import annotations

# torch, tokenizers and transformers are imported where they are used: a refused input is said at once
import argparse
import json
import random
import sys
import sysconfig
from pathlib import Path

# small, stable modules of every Python: ~60 KB of text, a fraction of a second of BPE training
STDLIB_MODULES = ("textwrap.py", "string.py", "shlex.py", "fnmatch.py", "bisect.py", "colorsys.py")
VOCAB_SIZE = 320  # more than a byte holds, so that merges are learned and used
EOS = "<|endoftext|>"
# ChatML, as many instruct models write it, with {% generation %} around what the assistant says:
# transformers' return_assistant_tokens_mask reads those marks (the tests use them as an independent
# view of the tokens examples/chat_sft/data.py counts, which finds them itself, turn by turn)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endgeneration %}"
    "{%- else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHAT_POSITIONS = 128  # the conversations of write_chats are up to ~110 tokens
WORDS = ["alpha", "river", "stone", "cloud", "maple", "tiger", "ocean", "ember", "lunar", "pixel"]


def stdlib_texts() -> list[str]:
    """The source of a few standard library modules: text on every machine, no download."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text() for name in STDLIB_MODULES]


def train_bpe_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE tokenizer of `vocab_size` tokens trained on `texts` with the `tokenizers`
    library, as a Hugging Face tokenizer (its EOS is <|endoftext|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        # every byte, seen in the texts or not: any text can be encoded
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # its bars are blank lines on a pipe; the script says one line
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)


def with_chat_template(tokenizer):
    """The tokenizer with ChatML's two special tokens and CHAT_TEMPLATE (saved as chat_template.jinja)."""
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_llama(
    folder: Path, vocab_size: int, seed: int = 0, positions: int = 64, **token_ids
) -> Path:
    """A 2-layer Llama-style causal LM made from a config (41 k parameters at 320 tokens), random
    weights, saved as a Hugging Face model folder (config.json, generation_config.json,
    model.safetensors). `token_ids` (bos_token_id, eos_token_id) go into both configs; without them
    they are Llama's defaults (1 and 2). They change no weight (a pad_token_id would: Llama's
    embedding zeroes that row and never trains it)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        **token_ids,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def save_chat_model(folder: Path, tokenizer, positions: int = CHAT_POSITIONS) -> Path:
    """A tiny Llama sized to the chat tokenizer, with the tokenizer beside it as a hub checkpoint
    has it: --hf_model FOLDER alone is enough. Its configs name the tokenizer's own special tokens,
    as a hub chat model's do: generation ends at <|im_end|> (the end of an assistant's turn) or
    <|endoftext|> (EOS, also the padding), so transformers' generate and TRL stop where the
    template's generation does (train/chat.py's end_of_turn_ids); there is no BOS."""
    from transformers import GenerationConfig

    ends = sorted({tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id})
    save_tiny_llama(
        folder, len(tokenizer), positions=positions, bos_token_id=None, eos_token_id=ends
    )
    # the padding in generation's config only (in the model's, the embedding would zero EOS's row)
    GenerationConfig(eos_token_id=ends, pad_token_id=tokenizer.eos_token_id).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_chats(path: Path, n: int = 96) -> Path:
    """Learnable conversations as chat JSON lines: the user gives a word and an instruction, the
    assistant answers it reversed or upper-cased; some with a system turn, some with two exchanges,
    of different lengths (so micro-batches count different numbers of assistant tokens)."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(n):
            messages = []
            if i % 3 == 0:
                messages.append({"role": "system", "content": "Be brief."})
            for _ in range(1 + (i % 4 == 0)):
                word = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 2)))
                if rng.random() < 0.5:
                    messages.append({"role": "user", "content": f"reverse: {word}"})
                    messages.append({"role": "assistant", "content": word[::-1]})
                else:
                    messages.append({"role": "user", "content": f"upper: {word}"})
                    messages.append({"role": "assistant", "content": word.upper()})
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def refusal(out_dir: Path) -> str | None:
    """Why OUT_DIR cannot be written, or None: it must be new or an empty folder (nothing of yours is
    overwritten)."""
    if out_dir.exists() and not out_dir.is_dir():
        return f"{out_dir} is a file: pass a new or empty folder"
    if out_dir.is_dir() and any(out_dir.iterdir()):
        return f"{out_dir} is not empty: pass a new or empty folder (nothing is overwritten)"
    return None


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        # argparse's own refusal is a usage line and "prog: error: ..."; the template's is one line
        self.exit(2, f"error: {message} (usage: python scripts/tiny_chat_model.py OUT_DIR)\n")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="the model folder to write (new or empty)")
    args = parser.parse_args(argv)
    problem = refusal(args.out_dir)
    if problem is None:
        try:
            args.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            problem = f"cannot create {args.out_dir}: {e.strerror}"
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from transformers.utils import logging

    logging.disable_progress_bar()  # save_pretrained's bar: the script says one line
    tokenizer = with_chat_template(train_bpe_tokenizer(stdlib_texts()))
    save_chat_model(args.out_dir, tokenizer)
    chats = write_chats(args.out_dir / "chats.jsonl")
    run_dir = f"{args.out_dir}_sft"
    print(
        f"wrote {args.out_dir} (a random 2-layer Llama, its {len(tokenizer)}-token tokenizer with a "
        f"chat template) and {chats}; after `cp examples/chat_sft/*.py train/`, fine-tune it: "
        f"python train/main.py --hf_model {args.out_dir} --dataset {chats} "
        f"--block_size {CHAT_POSITIONS} --output_dir {run_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
