"""Preference tuning (examples/preference) end to end, installed as a fork does, as a team runs it: SFT
first (examples/chat_sft on the tiny chat Llama, its export a Hugging Face folder), then DPO from that
export (--hf_model RUN), 2 processes, gradient accumulation 2, on a local folder whose validation.jsonl is
the eval set (7 pairs: the ranks and batches do not divide it). Each check against a number worked out
another way:
    - the run starts from the SFT run: the step-1 loss is log 2 (the policy is its reference, the
      paper's starting point), the manifest keeps the digest of the SFT export's weights, computed
      here from the file, and the reference's eval log-probs are an independent computation from the
      SFT export, each validation pair alone;
    - the reference never moves: eval_ref_chosen_logps is the same, bitwise, at every evaluation,
      under DDP with a frozen copy, under FSDP2 with a frozen copy and with LoRA adapters off (whose
      digest is the frozen copy's: the same weights), and under DDP with LoRA;
    - the eval is exact: the last evaluation's loss, reward accuracy, margin and log-probs equal the
      same computation from the run's export and the SFT export, over exactly the validation pairs;
    - it learns (the loss below log 2, the reward accuracy above a half), and scripts/sample.py --chat
      talks to the result;
    - the torch path (torchrun), one rank SIGKILLed after the mid-run checkpoint, then resumed: the
      Accelerate run's losses, evaluations and export, to the bit;
    - a resume against another reference (--hf_model the base model) is refused in one line;
    - 1 process x 4 pairs x 2 micro-batches and 2 x 2 x 2 give each step's loss and gradient norm
      to fp32 rounding (loss_items: the pairs).
"""

import json
import math
import random
import shlex
import shutil
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

PREFERENCE = REPO / "examples" / "preference"
CHAT_SFT = REPO / "examples" / "chat_sft"
STEPS = 12
BETA = 0.1
WORDS = ["river", "stone", "cloud", "ember", "maple", "harbor", "lantern", "meadow"]


def write_pairs(folder: Path) -> Path:
    """train.jsonl (48 pairs) and validation.jsonl (7): "reverse: <words>", the chosen answer the
    words reversed, the rejected one them in their order; prompts and completions of different
    lengths, some prompts as chat messages with a system turn."""
    rng = random.Random(0)

    def pair(i: int) -> dict:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
        question = f"reverse: {words}"
        prompt = question
        if i % 3 == 0:
            prompt = [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": question},
            ]
        return {"prompt": prompt, "chosen": words[::-1], "rejected": words}

    folder.mkdir(parents=True)
    for name, count in (("train", 48), ("validation", 7)):
        rows = [pair(i) for i in range(count)]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


class Pipeline:
    """The SFT run, then the preference fork that starts from its export."""

    def __init__(self, root: Path, chat_llama: Path):
        self.root = root
        self.chat_llama = chat_llama
        self.pairs = write_pairs(root / "pairs")
        sft_fork = fork_with(root / "sft", CHAT_SFT / "model.py", CHAT_SFT / "data.py")
        self.sft = root / "sft_run"
        chats = write_chats(root / "chats.jsonl")
        sft_args = tiny_args(
            self.sft,
            chats,
            hf_model=chat_llama,
            block_size=128,
            batch_size=4,
            max_steps=8,
            save_every=8,
            eval_every=8,
            lr=3e-3,
        )
        run_python(sft_args, root, script=sft_fork / "train" / "main.py").check()
        self.fork = fork_with(root / "dpo", PREFERENCE / "model.py", PREFERENCE / "data.py")

    def args(self, output_dir: Path, **overrides) -> list[str]:
        values = dict(
            hf_model=self.sft,
            block_size=128,
            batch_size=2,
            grad_accum_steps=2,
            max_steps=STEPS,
            save_every=STEPS // 2,
            eval_every=STEPS // 3,
            warmup_steps=2,
            lr=1e-3,
            weight_decay=0,
            beta=BETA,
        )
        values.update(overrides)
        return tiny_args(output_dir, self.pairs, config=TINY, **values)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, chat_llama):
    return Pipeline(tmp_path_factory.mktemp("preference"), chat_llama)


@pytest.fixture(scope="module")
def trained(pipeline):
    """DPO from the SFT export under accelerate launch: 2 processes (DDP), a frozen reference."""
    script = pipeline.fork / "train" / "main.py"
    return launch_accelerate(
        pipeline.args(pipeline.root / "dpo_run"), pipeline.root, script=script
    ).check()


# ---------------------------------------------------------------- computed another way


def hub_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def completion_logp(model, tokenizer, prompt: list[dict], completion: list[dict]) -> float:
    """The completion's log-prob after the prompt: the conversation alone through the chat template,
    float64 log_softmax, each completion token's log-prob summed here."""
    prompt_ids = tokenizer.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    ids = tokenizer.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)
    ids = ids["input_ids"]
    assert ids[: len(prompt_ids)] == prompt_ids and len(ids) <= 128  # not cut: all of it counts
    with torch.no_grad():
        log_probs = model(input_ids=torch.tensor([ids])).logits[0].double().log_softmax(-1)
    return sum(log_probs[t - 1, ids[t]].item() for t in range(len(prompt_ids), len(ids)))


def validation_logps(model_folder: Path, pairs: Path) -> list[tuple[float, float]]:
    """(chosen, rejected) completion log-probs of each validation pair under the model in the folder."""
    from transformers import AutoTokenizer

    model = hub_model(model_folder)
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    logps = []
    for line in (pairs / "validation.jsonl").read_text().splitlines():
        row = json.loads(line)
        prompt = row["prompt"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        chosen, rejected = (
            completion_logp(model, tokenizer, prompt, [{"role": "assistant", "content": row[side]}])
            for side in ("chosen", "rejected")
        )
        logps.append((chosen, rejected))
    return logps


def independent_dpo_eval(policy_folder: Path, reference_folder: Path, pairs: Path) -> dict:
    """DPO's eval metrics over the validation pairs, from the two exports (Rafailov et al. 2023):
    reward beta (log pi - log ref), loss -log sigmoid(reward_c - reward_r)."""
    policy = validation_logps(policy_folder, pairs)
    reference = validation_logps(reference_folder, pairs)
    rows = []
    for (pi_c, pi_r), (ref_c, ref_r) in zip(policy, reference, strict=True):
        margin = BETA * (pi_c - ref_c) - BETA * (pi_r - ref_r)
        loss = math.log1p(math.exp(-margin))
        rows.append((loss, margin > 0, margin, pi_c, pi_r, ref_c))
    count = len(rows)
    names = ("loss", "reward_accuracy", "reward_margin", "chosen_logps", "rejected_logps")
    means = {name: sum(float(row[i]) for row in rows) / count for i, name in enumerate(names)}
    means["ref_chosen_logps"] = sum(row[5] for row in rows) / count
    return means


def weights_digest_of(folder: Path) -> str:
    """The reference's weight digest as the example's docstring defines it (xxh3_64 over the tensors
    by name, each with its dtype and shape), of the model loaded from the folder."""
    import xxhash

    digest = xxhash.xxh3_64()
    weights = hub_model(folder).state_dict()
    for name in sorted(weights):
        tensor = weights[name].contiguous()
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def evals(run_dir: Path) -> list[dict]:
    return [row for row in read_metrics(run_dir) if "eval_loss" in row]


def manifest_identity(run_dir: Path) -> dict:
    newest = sorted((run_dir / "checkpoints").iterdir())[-1]
    return json.loads((newest / "manifest.json").read_text())["run"]


# ---------------------------------------------------------------- the tests


def test_it_starts_from_the_sft_run_and_learns_against_a_reference_that_never_moves(
    pipeline, trained
):
    output = trained.output
    assert f"reference: a frozen copy of {pipeline.sft} as loaded" in output, output[-3000:]
    # the run records what it started from: the digest of the SFT export's weights
    digest = weights_digest_of(pipeline.sft)
    assert f"weights digest {digest}" in output
    assert manifest_identity(trained.output_dir)["model/reference"] == digest
    # at step 1 the policy is its reference: every pair's loss is log 2, the mean too
    losses = trained.losses()
    assert losses[1] == pytest.approx(math.log(2), abs=1e-6)
    rows = evals(trained.output_dir)
    assert [row["step"] for row in rows] == [4, 8, 12]
    # the reference's log-probs: bitwise the same at every evaluation, and the SFT export's
    assert len({row["eval_ref_chosen_logps"] for row in rows}) == 1
    sft_logps = validation_logps(pipeline.sft, pipeline.pairs)
    sft_chosen = sum(chosen for chosen, _ in sft_logps) / len(sft_logps)
    assert rows[0]["eval_ref_chosen_logps"] == pytest.approx(sft_chosen, rel=1e-5)
    # the last evaluation, over exactly the 7 validation pairs, from the two exports
    independent = independent_dpo_eval(trained.output_dir, pipeline.sft, pipeline.pairs)
    last = rows[-1]
    for name, value in independent.items():
        assert last[f"eval_{name}"] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    # it learns: the chosen answers gain on the rejected ones
    assert last["eval_loss"] < math.log(2) - 0.05 and last["eval_reward_accuracy"] > 0.5, rows
    assert losses[STEPS] < math.log(2) - 0.05, losses


def test_sample_py_chats_with_the_result(pipeline, trained):
    samples = [line for line in trained.output.splitlines() if line.startswith("samples: ")]
    command = f'python scripts/sample.py {trained.output_dir} --chat --prompt "..."'
    assert samples == [f"samples: {command}"]
    pasted = shlex.split(command.replace("...", "reverse: river stone"))
    script = pipeline.fork / "scripts" / "sample.py"
    answer = run_python([*pasted[2:], "--temperature", "0"], pipeline.root, script=script).check()
    assert answer.output.strip() and "reverse: river stone" not in answer.output, answer.output


def test_the_torch_path_killed_and_resumed_ends_bitwise_as_the_accelerate_run(
    pipeline, trained, tmp_path
):
    run_dir = tmp_path / "torch_path"
    args = pipeline.args(run_dir)
    env = {"FAULT_STEP": STEPS // 2 + 3, "FAULT_ACTION": "sigkill", "FAULT_RANK": 1}
    env.update(FAULT_ONCE=tmp_path / "sigkill.once", FAULTY_ENTRY="torch_ddp")
    faulty = pipeline.fork / "tests" / "helpers" / FAULTY_MAIN.name
    killed = launch_torchrun(args, tmp_path, script=faulty, env_extra=env)
    assert killed.returncode != 0
    resumed = launch_torchrun(
        [*args, "--resume", "latest"],
        tmp_path,
        script=faulty,
        env_extra={"FAULTY_ENTRY": "torch_ddp"},
    ).check()
    assert f"(step {STEPS // 2})" in resumed.output
    written = read_metrics(run_dir)
    assert {r["step"]: r["loss"] for r in written if "loss" in r} == trained.losses()
    assert evals(run_dir) == evals(trained.output_dir)
    weights = load_weights(run_dir / "model.safetensors")
    baseline = load_weights(trained.output_dir / "model.safetensors")
    assert weights.keys() == baseline.keys() and weights
    assert all(weights[key].equal(baseline[key]) for key in weights)


def test_a_resume_against_another_reference_is_one_line(pipeline, trained, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained.output_dir, run_dir)
    script = pipeline.fork / "train" / "main.py"
    args = [
        "--output_dir",
        run_dir,
        "--resume",
        "latest",
        "--max_steps",
        STEPS * 2,
        "--hf_model",
        pipeline.chat_llama,  # the base model, not the SFT run it started from
    ]
    refused = launch_accelerate(args, tmp_path, script=script)
    said = [line for line in refused.output.splitlines() if line.startswith("error: ")]
    assert refused.returncode != 0 and len(said) == 1, refused.output[-3000:]
    assert "reference" in said[0], said
    assert max(row["step"] for row in read_metrics(run_dir)) == STEPS  # nothing trained


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "frozen_copy"])
def test_under_fsdp2_the_reference_never_moves(pipeline, trained, tmp_path, lora):
    """The torch path with --fsdp full (Accelerate's FSDP plugin needs GPUs): the reference's eval
    log-probs bitwise the same at each evaluation, and the DDP run's (the same SFT export); with
    LoRA the reference is the base with the adapters off, whose digest is the frozen copy's."""
    run_dir = tmp_path / "run"
    extra = dict(lora_r=4, lora_alpha=8, lr=1e-2) if lora else {}
    args = pipeline.args(run_dir, max_steps=4, eval_every=2, save_every=4, **extra)
    done = launch_torchrun(
        [*args, "--fsdp", "full"], tmp_path, script=pipeline.fork / "train" / "torch_ddp.py"
    )
    done.check()
    if lora:
        assert f"reference: {pipeline.sft} with its LoRA adapters off (no copy)" in done.output
    reference = manifest_identity(trained.output_dir)["model/reference"]
    assert manifest_identity(run_dir)["model/reference"] == reference
    rows = evals(run_dir)
    assert [row["step"] for row in rows] == [2, 4]
    assert rows[0]["eval_ref_chosen_logps"] == rows[1]["eval_ref_chosen_logps"]
    ddp = evals(trained.output_dir)[0]["eval_ref_chosen_logps"]
    assert rows[0]["eval_ref_chosen_logps"] == pytest.approx(ddp, rel=1e-6)
    # and the policy moved away from it
    assert rows[1]["eval_chosen_logps"] != rows[1]["eval_ref_chosen_logps"]


def test_accumulation_and_world_size_change_only_rounding(pipeline, tmp_path):
    """With LoRA under DDP (the reference: the adapters off). One process of 4 pairs x 2 micro-batches
    against 2 processes of 2 x 2: the same 8 pairs a step, the same mean over them."""
    script = pipeline.fork / "train" / "main.py"
    lora = dict(max_steps=3, eval_every=1, save_every=3, lora_r=4, lora_alpha=8, lr=1e-2)
    one = pipeline.args(tmp_path / "one", batch_size=4, **lora)
    two = pipeline.args(tmp_path / "two", batch_size=2, **lora)
    launch_accelerate(one, tmp_path, num_processes=1, script=script).check()
    launch_accelerate(two, tmp_path, num_processes=2, script=script).check()
    rows = {name: read_metrics(tmp_path / name) for name in ("one", "two")}
    for key in ("loss", "grad_norm"):
        values = {
            name: {r["step"]: r[key] for r in written if key in r} for name, written in rows.items()
        }
        assert sorted(values["one"]) == [1, 2, 3]
        for step, value in values["one"].items():
            assert values["two"][step] == pytest.approx(value, rel=2e-5), (key, step)
    for written in rows.values():
        references = {r["eval_ref_chosen_logps"] for r in written if "eval_loss" in r}
        assert len(references) == 1
