"""Chat fine-tuning (examples/chat_sft) installed as a fork does: a Hugging Face causal LM (a tiny
Llama folder with a ChatML tokenizer, made offline) on chat JSON lines, packed several conversations
to a block, only the assistant's tokens counted, with LoRA adapters (--lora_r) merged into the export
(--merge_adapter), 2 processes (DDP) and gradient accumulation 2 (micro-batches and ranks count
different numbers of assistant tokens):
    - it learns, and its eval loss and accuracy are an independent computation from the export
      (AutoModelForCausalLM.from_pretrained of the run folder, the adapters merged): each eval
      conversation alone, not packed, through the chat template, counting the tokens the template's
      {% generation %} marks (transformers' return_assistant_tokens_mask) over exactly the held-out
      conversations;
    - the torch path (torchrun), one rank SIGKILLed after the mid-run checkpoint, then resumed: every
      rank holds the uninterrupted run's adapters of that checkpoint after the resume (accelerate PR
      #4206's failure), and the run ends with the Accelerate run's losses, evaluations and exported
      weights, to the bit. The checkpoints hold the adapters alone. (FSDP2 and adapters:
      tests/e2e/test_lora_runs.py.)
    - what the run says: at start-up the eval set it uses (eval_fraction of the file, as many
      conversations as the independent evaluation holds out) and its trainable parameters (the
      adapters counted by hand from the base model's sizes); in its summary the sample command with
      --chat, which, pasted with a prompt, answers (the reply alone, a chat model's).
"""

import json
import shlex
from pathlib import Path

import pytest
import torch

from conftest import (
    FAULTY_MAIN,
    REPO,
    TINY,
    fork_with,
    launch_accelerate,
    launch_torchrun,
    load_weights,
    read_metrics,
    run_python,
    tiny_args,
    write_chats,
)

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "chat_sft"
STEPS = 16


class ChatFork:
    def __init__(self, root: Path, chat_llama: Path):
        self.root = root
        self.fork = fork_with(root, EXAMPLE / "model.py", EXAMPLE / "data.py")
        self.config = TINY  # its lm: section left out where the fork does not declare it
        self.chats = write_chats(root / "chats.jsonl")
        self.chat_llama = chat_llama

    def args(self, output_dir: Path) -> list[str]:
        values = dict(
            hf_model=self.chat_llama,
            block_size=128,
            batch_size=2,
            grad_accum_steps=2,
            max_steps=STEPS,
            save_every=STEPS // 2,
            eval_every=STEPS // 2,
            warmup_steps=2,
            lr=3e-2,
            eval_fraction=0.1,
            lora_r=8,
            lora_alpha=16,
            # the blocks' projections and the head: a random tiny base learns little through the
            # blocks alone in 16 steps
            lora_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head",
            merge_adapter="true",
        )
        return tiny_args(output_dir, self.chats, config=self.config, **values)


@pytest.fixture(scope="module")
def chat(tmp_path_factory, chat_llama):
    return ChatFork(tmp_path_factory.mktemp("chat_sft"), chat_llama)


@pytest.fixture(scope="module")
def trained(chat):
    run_dir = chat.root / "baseline"
    return launch_accelerate(
        chat.args(run_dir), chat.root, script=chat.fork / "train" / "main.py"
    ).check()


def held_out_conversations(chats: Path):
    import datasets

    every = datasets.load_dataset("json", data_files={"train": [str(chats)]})["train"]
    return every.train_test_split(test_size=0.1, seed=0)["test"]  # data.py's split


def independent_eval(run_dir: Path, chats: Path) -> dict:
    """Loss and accuracy per assistant token over the held-out conversations, one at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(run_dir)
    held_out = held_out_conversations(chats)
    loss, right, counted = 0.0, 0, 0
    for messages in held_out["messages"]:
        marked = tokenizer.apply_chat_template(
            messages, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = torch.tensor([marked["input_ids"]])
        assert ids.shape[1] <= 128  # not cut: the whole conversation counts
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].double()
        targets = ids[0, 1:]
        mask = torch.tensor(marked["assistant_masks"][1:], dtype=torch.bool)
        loss += torch.nn.functional.cross_entropy(
            logits[mask], targets[mask], reduction="sum"
        ).item()
        right += (logits[mask].argmax(-1) == targets[mask]).sum().item()
        counted += int(mask.sum())
    return {"loss": loss / counted, "accuracy": right / counted, "tokens": counted}


def test_it_learns_and_its_eval_is_per_assistant_token_over_exactly_the_held_out_conversations(
    chat, trained
):
    rows = read_metrics(trained.output_dir)
    evals = [row for row in rows if "eval_loss" in row]
    losses = trained.losses()
    assert evals[-1]["eval_loss"] < 0.7 * losses[1], (losses, evals)
    independent = independent_eval(trained.output_dir, chat.chats)
    assert independent["tokens"] > 50
    assert evals[-1]["eval_loss"] == pytest.approx(independent["loss"], rel=1e-5)
    assert evals[-1]["eval_accuracy"] == pytest.approx(independent["accuracy"], abs=1e-9)


def test_the_torch_path_killed_and_resumed_ends_bitwise_as_the_accelerate_run(chat, trained):
    run_dir = chat.root / "torch_path"
    args = chat.args(run_dir)
    adapters = chat.root / "adapters"
    env = {"FAULT_STEP": STEPS // 2 + 3, "FAULT_ACTION": "sigkill", "FAULT_RANK": 1}
    env.update(FAULT_ONCE=chat.root / "sigkill.once", FAULTY_ENTRY="torch_ddp")
    faulty = chat.fork / "tests" / "helpers" / FAULTY_MAIN.name
    killed = launch_torchrun(args, chat.root, script=faulty, env_extra=env)
    assert killed.returncode != 0
    resumed = launch_torchrun(
        [*args, "--resume", "latest"],
        chat.root,
        script=faulty,
        env_extra={"RECORD_ADAPTERS": adapters, "FAULTY_ENTRY": "torch_ddp"},
    ).check()
    assert f"(step {STEPS // 2})" in resumed.output
    # the checkpoint holds the adapters alone, and every rank got them back from it
    middle = trained.output_dir / "checkpoints" / f"step_{STEPS // 2:08d}" / "model.safetensors"
    saved = load_weights(middle)
    assert saved and all(".lora_" in name for name in saved)
    for rank in (0, 1):
        held = torch.load(adapters / f"rank{rank}.pt", weights_only=True)
        assert held.keys() == saved.keys()
        assert all(torch.equal(held[name], saved[name]) for name in saved), rank
    expected = read_metrics(trained.output_dir)
    written = read_metrics(run_dir)
    assert {r["step"]: r["loss"] for r in written if "loss" in r} == trained.losses()
    assert [r for r in written if "eval_loss" in r] == [r for r in expected if "eval_loss" in r]
    weights = load_weights(run_dir / "model.safetensors")
    baseline = load_weights(trained.output_dir / "model.safetensors")
    assert weights.keys() == baseline.keys() and not any("lora" in name for name in weights)
    assert all(weights[key].equal(baseline[key]) for key in weights)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model_type"] == "llama"


def test_the_run_says_its_eval_set_what_trains_and_how_to_talk_to_it(chat, trained):
    from transformers import AutoModelForCausalLM

    output = trained.output
    held_out = len(held_out_conversations(chat.chats))
    said = f"eval set: 10% of {chat.chats}'s train split held out (eval_fraction; {held_out} "
    assert said + "conversations)" in output
    # r x (in + out) for each adapted layer, from the base model's sizes
    sizes = json.loads((chat.chat_llama / "config.json").read_text())
    width, inner, r = sizes["hidden_size"], sizes["intermediate_size"], 8
    key_value = sizes["num_key_value_heads"] * width // sizes["num_attention_heads"]
    attention = 2 * (width + width) + 2 * (width + key_value)  # q_proj, o_proj; k_proj, v_proj
    per_layer = r * (attention + 2 * (width + inner) + (inner + width))  # gate, up; down
    adapters = sizes["num_hidden_layers"] * per_layer + r * (width + sizes["vocab_size"])
    base = AutoModelForCausalLM.from_pretrained(chat.chat_llama).num_parameters()
    total = base + adapters
    assert f"trainable: {adapters:,} parameters of {total:,} ({adapters / total:.1%})" in output
    # the summary's command, as a person pastes it with a prompt of theirs
    samples = [line for line in output.splitlines() if line.startswith("samples: ")]
    command = f'python scripts/sample.py {trained.output_dir} --chat --prompt "..."'
    assert samples == [f"samples: {command}"]
    pasted = shlex.split(command.replace("...", "reverse: river stone"))
    script = chat.fork / "scripts" / "sample.py"  # the fork's: its model.py is the chat one
    answer = run_python([*pasted[2:], "--temperature", "0"], chat.root, script=script).check()
    # the reply alone, as --chat prints it (without it, the prompt comes back continued as text)
    assert "reverse: river stone" not in answer.output, answer.output
