"""Chat fine-tuning's two layouts, timed on the same conversations: packed (examples/chat_sft/data.py:
several whole conversations to a block, positions restarting at each, block-diagonal attention
through Hugging Face's packed-sequence mask) against padded (each conversation alone, the batch
padded to its longest, with an attention mask, as most SFT code does by default).

    python bench/sft_packing.py                      # CPU: a small Llama, 192 conversations
    python bench/sft_packing.py --device cuda --layers 8 --width 512 --conversations 2048
    python bench/sft_packing.py --pairs              # preference pairs: is packing them worth it?

Both train on every conversation once, forward, backward and an AdamW step per batch, in an order
that alternates layouts round by round; reported: the assistant tokens trained per second (the
work that counts), the positions computed per assistant token (padding and prompts included), and
the ratio. The lengths follow a log-normal of median 120 tokens (16 to 500), a third of each
conversation the answer, as chat data's do. The conversations are made of token ids directly: the
chat template's rendering is data.py's (tests/test_example_data.py holds it); here only the layouts'
cost is measured.
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def conversations(count: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(token ids, labels) per conversation: the prompt's labels -100, the answer's its ids."""
    rng = random.Random(seed)
    made = []
    for _ in range(count):
        length = int(min(500, max(16, rng.lognormvariate(4.8, 0.7))))
        answer = max(1, length // 3)
        ids = [rng.randrange(4, 1000) for _ in range(length)]
        made.append((ids, [-100] * (length - answer) + ids[-answer:]))
    return made


def pairs(count: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Preference pairs as a DPO batch holds them: per pair two sequences, the prompt then the chosen
    completion, the prompt then the rejected one (labels: the completion's ids), adjacent. Prompts
    log-normal of median 60 tokens, each completion of median 120 (ultrafeedback-like: completions
    longer than prompts), each sequence at most 500."""
    rng = random.Random(seed)
    made = []
    for _ in range(count):
        prompt = [
            rng.randrange(4, 1000)
            for _ in range(int(min(250, max(8, rng.lognormvariate(4.1, 0.7)))))
        ]
        for _side in ("chosen", "rejected"):
            length = int(min(500 - len(prompt), max(4, rng.lognormvariate(4.8, 0.6))))
            completion = [rng.randrange(4, 1000) for _ in range(length)]
            made.append((prompt + completion, [-100] * len(prompt) + completion))
    return made


def packed_batches(convs, block_size: int, batch_size: int) -> list[dict]:
    """data.py's layout: whole conversations in order, a block closed when the next does not fit,
    its tail padding as a sequence of its own; blocks batch_size at a time."""
    blocks, block = [], {"input_ids": [], "labels": [], "position_ids": []}

    def close():
        missing = block_size - len(block["input_ids"])
        block["input_ids"] += [0] * missing
        block["labels"] += [-100] * missing
        block["position_ids"] += list(range(missing))
        blocks.append({k: list(v) for k, v in block.items()})
        for v in block.values():
            v.clear()

    for ids, labels in convs:
        ids, labels = ids[:block_size], labels[:block_size]
        if len(block["input_ids"]) + len(ids) > block_size:
            close()
        block["input_ids"] += ids
        block["labels"] += labels
        block["position_ids"] += list(range(len(ids)))
    close()
    return [
        {k: torch.tensor([b[k] for b in blocks[i : i + batch_size]]) for k in blocks[0]}
        for i in range(0, len(blocks), batch_size)
    ]


def padded_batches(convs, batch_size: int) -> list[dict]:
    batches = []
    for i in range(0, len(convs), batch_size):
        group = convs[i : i + batch_size]
        longest = max(len(ids) for ids, _ in group)
        input_ids = torch.zeros(len(group), longest, dtype=torch.long)
        labels = torch.full((len(group), longest), -100)
        mask = torch.zeros(len(group), longest, dtype=torch.long)
        for row, (ids, labs) in enumerate(group):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(ids)] = torch.tensor(labs)
            mask[row, : len(ids)] = 1
        batches.append({"input_ids": input_ids, "labels": labels, "attention_mask": mask})
    return batches


def model(args):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=args.width,
        intermediate_size=4 * args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.width // 64),
        num_key_value_heads=max(1, args.width // 64),
        max_position_embeddings=args.block_size,
        use_cache=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(args.device)


def one_pass(net, optimizer, batches, device) -> float:
    start = time.perf_counter()
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        net(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--conversations", type=int, default=192)
    parser.add_argument("--block_size", type=int, default=512)
    parser.add_argument("--blocks_per_batch", type=int, default=2)
    parser.add_argument("--conversations_per_batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--pairs",
        action="store_true",
        help="preference pairs (two sequences each, --conversations/2 pairs) in place of conversations",
    )
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    convs = pairs(args.conversations // 2) if args.pairs else conversations(args.conversations)
    counted = sum(sum(label != -100 for label in labels[1:]) for _, labels in convs)
    layouts = {
        "packed": packed_batches(convs, args.block_size, args.blocks_per_batch),
        "padded": padded_batches(convs, args.conversations_per_batch),
    }
    net = model(args)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    one_pass(net, optimizer, layouts["packed"][:2], args.device)  # warm-up
    times = {name: [] for name in layouts}
    for round_number in range(args.rounds):
        order = list(layouts) if round_number % 2 == 0 else list(reversed(layouts))
        for name in order:
            times[name].append(one_pass(net, optimizer, layouts[name], args.device))
    for name, batches in layouts.items():
        positions = sum(b["input_ids"].numel() for b in batches)
        best = min(times[name])
        print(
            f"{name}: {len(batches)} batches, {positions / counted:.2f} positions per assistant "
            f"token, {counted / best:,.0f} assistant tokens/s (best of {args.rounds} passes, "
            f"{best:.1f} s)"
        )
    ratios = [p / q for p, q in zip(times["padded"], times["packed"], strict=True)]
    print(
        f"packed / padded speed: {min(times['padded']) / min(times['packed']):.2f}x "
        f"(per round {min(ratios):.2f}x to {max(ratios):.2f}x)"
    )


if __name__ == "__main__":
    main()
