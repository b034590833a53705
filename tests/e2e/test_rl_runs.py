"""Reinforcement learning with verifiable rewards (examples/rl) end to end, installed as a fork does, as
a team runs it: a short SFT of the tiny chat Llama on the sorting task's chats (examples/chat_sft, the
task of scripts/sort_words_task.py), then RL from that export (--hf_model RUN), DAPO with a KL to the
reference (beta > 0: a frozen copy), 2 processes, gradient accumulation 2, a checkpoint mid-run and two
evaluations. Each check against a number worked out another way or an uninterrupted run:
    - the run logs its rollout's values at every step, and its eval is exact: the last evaluation's
      pass rate and rewards equal the test's own count from the export (transformers' generate, greedy,
      each validation prompt alone, scored by the test's own comparison with the answer), over exactly
      the validation prompts;
    - the torch path (torchrun), one rank SIGKILLed after the mid-run checkpoint, then resumed: the
      Accelerate run's losses, rollout values (rewards, lengths, KL) and evaluations at every step, its
      export to the bit, and after the resume the same sampled tokens, rank by rank and micro-batch by
      micro-batch (recorded by a wrapper of the fork's rollout: the seeds are the run's counters);
    - FSDP2 (the torch path, --fsdp full, 2 gloo ranks) whose ranks' completions end at different
      lengths (recorded) ends without a hang, and the reference never drifts: step 1's KL is 0 (the
      policy is its reference) and the manifest's reference digest is the SFT export's, computed here.
    - the layout: the same run as 1 process x 4 prompts x 2 micro-batches samples, at every step, the
      same completions of each prompt as the 2 x 2 x 2 run (each completion seeded from its prompt,
      not its rank or row), and logs the same losses, gradient norms and rollout values to fp32
      rounding (DAPO: its normaliser, the step's tokens, spans micro-batches and ranks).
"""

import json
import re
import statistics
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
    script,
    tiny_args,
)

pytestmark = pytest.mark.slow

RL = REPO / "examples" / "rl"
CHAT_SFT = REPO / "examples" / "chat_sft"
STEPS = 12
MAX_NEW_TOKENS = 24  # the longest answer (4 words) is 22 tokens and the end of turn
ROLLOUT_VALUES = (
    "reward",
    "reward_std",
    "reward_exact_answer",
    "reward_word_order",
    "reward_same_words",
    "completion_tokens",
    "completion_tokens_max",
    "clipped_share",
    "kl",
)

# appended to the fork's train/model.py: each rank writes what its rollout sampled at each step
# (RECORD_ROLLOUTS=dir: dir/step{n}_rank{r}.json, n the step being trained), the example unchanged
RECORDER = """

# ---------------------------------------------------------------- tests/e2e/test_rl_runs.py's recorder
import json as _json

_example_rollout = rollout


def rollout(model, micro_batches, cfg, step):
    batches, values = _example_rollout(model, micro_batches, cfg, step)
    folder = os.environ.get("RECORD_ROLLOUTS")
    if folder:
        rank = dist.get_rank() if dist.is_initialized() else 0
        rows = [
            {"input_ids": b["input_ids"].tolist(), "completion_mask": b["completion_mask"].tolist()}
            for b in batches
        ]
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"step{step + 1:03d}_rank{rank}.json"), "w") as f:
            _json.dump(rows, f)
    return batches, values
"""


class Pipeline:
    """The sorting task, the SFT run on its chats, then the RL fork that starts from its export."""

    def __init__(self, root: Path, chat_llama: Path):
        self.root = root
        sort_words_task = script("sort_words_task")
        # 61 validation prompts: neither the ranks nor the eval batches divide them
        self.prompts = sort_words_task.write_prompts(root / "sort" / "prompts", validation=61)
        chats = sort_words_task.write_sft_chats(root / "sort" / "sft", train=256, validation=16)
        self.chats = chats
        sft_fork = fork_with(root / "sft", CHAT_SFT / "model.py", CHAT_SFT / "data.py")
        self.sft = root / "sft_run"
        sft_args = tiny_args(
            self.sft,
            chats,
            hf_model=chat_llama,
            block_size=128,
            batch_size=16,
            max_steps=SFT_STEPS,
            warmup_steps=4,
            save_every=SFT_STEPS,
            eval_every=SFT_STEPS,
            lr=1e-2,
        )
        run_python(sft_args, root, script=sft_fork / "train" / "main.py").check()
        self.fork = fork_with(root / "rl", RL / "model.py", RL / "data.py")
        model_py = self.fork / "train" / "model.py"
        model_py.write_text(model_py.read_text() + RECORDER)

    def args(self, output_dir: Path, **overrides) -> list[str]:
        values = dict(
            hf_model=self.sft,
            block_size=None,  # not a key of the RL files
            batch_size=2,
            grad_accum_steps=2,
            num_generations=4,
            max_new_tokens=MAX_NEW_TOKENS,
            temperature=1.0,
            rl_loss="dapo",
            beta=0.04,
            max_steps=STEPS,
            save_every=STEPS // 2,
            eval_every=STEPS // 2,
            warmup_steps=2,
            lr=2e-4,
            min_lr=2e-5,
            weight_decay=0,
        )
        values.update(overrides)
        return tiny_args(output_dir, self.prompts, config=TINY, **values)


SFT_STEPS = 100  # greedy pass rate about 0.16 on the validation prompts


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, chat_llama):
    return Pipeline(tmp_path_factory.mktemp("rl"), chat_llama)


@pytest.fixture(scope="module")
def trained(pipeline):
    """RL from the SFT export under accelerate launch: 2 processes (DDP), its rollouts recorded."""
    run_dir = pipeline.root / "rl_run"
    return launch_accelerate(
        pipeline.args(run_dir),
        pipeline.root,
        script=pipeline.fork / "train" / "main.py",
        env_extra={"RECORD_ROLLOUTS": pipeline.root / "rollouts"},
    ).check()


# ---------------------------------------------------------------- computed another way


def greedy_answers(model_folder: Path, prompts: list[str]) -> list[str]:
    """Each prompt alone (no padding) through the export's chat template, transformers' generate
    greedy, its text up to the end of the turn."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    ends = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    said = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
        )
        ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                eos_token_id=ends,
                pad_token_id=ends[0],
            )
        new = out[0, ids.size(1) :].tolist()
        new = new[: next((i for i, t in enumerate(new) if t in ends), len(new))]
        said.append(tokenizer.decode(new))
    return said


def scored(text: str, answer: str) -> tuple[float, float, float]:
    """(exact, word order, same words) of a completion against the answer, each word compared here."""
    words, wanted = text.split(), answer.split()
    exact = 1.0 if words == wanted else 0.0
    order = sum(1 for a, b in zip(words, wanted, strict=False) if a == b) / len(wanted)
    same = 1.0 if sorted(words) == sorted(wanted) else 0.0
    return exact, order, same


def reward_of(exact: float, order: float, same: float) -> float:
    return exact + 0.5 * order + 0.25 * same  # the run's default --reward_weights


def independent_eval(model_folder: Path, prompts_folder: Path) -> dict:
    """The pass rate and the rewards over the validation prompts, from the export."""
    lines = (prompts_folder / "validation.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line]
    said = greedy_answers(model_folder, [row["prompt"] for row in rows])
    scores = [scored(text, row["answer"]) for text, row in zip(said, rows, strict=True)]
    count = len(rows)
    return {
        "prompts": count,
        "pass_rate": sum(e for e, _, _ in scores) / count,
        "reward_word_order": sum(o for _, o, _ in scores) / count,
        "reward_same_words": sum(s for _, _, s in scores) / count,
        "reward": sum(reward_of(*score) for score in scores) / count,
    }


def rollout_values_from_tokens(rollouts: dict, tokenizer, step: int) -> dict:
    """A step's logged values worked out from both ranks' recorded completions: each prompt's words
    read back from its tokens and sorted here for the answer, each completion decoded up to its end
    of turn and scored here."""
    ends = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    rewards, lengths, unended = [], [], 0
    for rank in (0, 1):
        for batch in rollouts[f"step{step:03d}_rank{rank}"]:
            width = len(batch["completion_mask"][0])
            for ids, mask in zip(batch["input_ids"], batch["completion_mask"], strict=True):
                prompt = tokenizer.decode(ids[:-width], skip_special_tokens=True)
                words = re.search(r"sort: ([a-z ]+)", prompt).group(1).split()
                completion = ids[-width:]
                counted = next((i + 1 for i, t in enumerate(completion) if t in ends), width)
                assert sum(mask) == counted
                unended += not any(t in ends for t in completion)
                text = tokenizer.decode([t for t in completion[:counted] if t not in ends])
                rewards.append(reward_of(*scored(text, " ".join(sorted(words)))))
                lengths.append(counted)
    return {
        "completions": len(rewards),
        "reward": statistics.mean(rewards),
        "reward_std": statistics.stdev(rewards),
        "completion_tokens": statistics.mean(lengths),
        "completion_tokens_max": max(lengths),
        "clipped_share": unended / len(rewards),
    }


def weights_digest_of(folder: Path) -> str:
    """The reference's weight digest as examples/chat.py's docstring defines it (xxh3_64 over the
    tensors by name, each with its dtype and shape), of the model loaded from the folder."""
    import xxhash
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    digest = xxhash.xxh3_64()
    for name in sorted(weights):
        tensor = weights[name].contiguous()
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def step_rows(run_dir: Path) -> dict[int, dict]:
    return {row["step"]: row for row in read_metrics(run_dir) if "loss" in row}


def evals(run_dir: Path) -> list[dict]:
    return [row for row in read_metrics(run_dir) if "eval_pass_rate" in row]


def recorded(folder: Path) -> dict[str, list]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}


def completions_by_prompt(rollouts: dict, tokenizer, step: int) -> list:
    """A step's sampled completions, whichever rank and micro-batch sampled them: sorted (prompt
    text, its G completions' counted tokens), read from the recorded rows (a prompt's G are G rows
    in a row, each counted up to and with its end of turn)."""
    found = []
    for name in sorted(rollouts):
        if not name.startswith(f"step{step:03d}_"):
            continue
        for batch in rollouts[name]:
            width = len(batch["completion_mask"][0])
            rows = list(zip(batch["input_ids"], batch["completion_mask"], strict=True))
            for first in range(0, len(rows), 4):  # G = 4
                group = rows[first : first + 4]
                prompt = tokenizer.decode(group[0][0][:-width], skip_special_tokens=True)
                completions = [tuple(ids[-width:][: sum(mask)]) for ids, mask in group]
                found.append((prompt, completions))
    return sorted(found)


def manifest_identity(run_dir: Path) -> dict:
    newest = sorted((run_dir / "checkpoints").iterdir())[-1]
    return json.loads((newest / "manifest.json").read_text())["run"]


# ---------------------------------------------------------------- the tests


def test_it_logs_its_rollouts_each_step_and_its_eval_is_the_export_s_greedy_count(
    pipeline, trained
):
    rows = step_rows(trained.output_dir)
    assert sorted(rows) == list(range(1, STEPS + 1))
    for step, row in rows.items():
        for name in ROLLOUT_VALUES:
            assert isinstance(row.get(name), float), (step, name, row)
        assert 0 <= row["clipped_share"] <= 1 and 1 <= row["completion_tokens"] <= MAX_NEW_TOKENS
        assert row["completion_tokens_max"] <= MAX_NEW_TOKENS
        # generation's share of the step before: from step 2 on
        assert (step > 1) == ("generation_share" in row), (step, row)
        if step > 1:
            assert 0 < row["generation_share"] < 1, row
    # groups that differ: some reward spread, hence a gradient
    assert any(row["reward_std"] > 0 for row in rows.values())
    # the rollouts recorded: 2 ranks, each step's 2 micro-batches of 2 prompts x 4 completions
    rollouts = recorded(pipeline.root / "rollouts")
    assert sorted(rollouts) == [f"step{s:03d}_rank{r}" for s in range(1, STEPS + 1) for r in (0, 1)]
    assert all(len(batches) == 2 for batches in rollouts.values())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pipeline.sft)
    for step, row in rows.items():
        worked_out = rollout_values_from_tokens(rollouts, tokenizer, step)
        assert worked_out.pop("completions") == 2 * 2 * 2 * 4  # ranks x micro-batches x prompts x G
        for name, value in worked_out.items():
            assert row[name] == pytest.approx(value, rel=1e-9, abs=1e-12), (step, name)
    written = evals(trained.output_dir)
    assert [row["step"] for row in written] == [STEPS // 2, STEPS]
    independent = independent_eval(trained.output_dir, pipeline.prompts)
    assert independent["prompts"] == 61
    last = written[-1]
    assert last["eval_pass_rate"] == independent["pass_rate"], (last, independent)
    for name in ("reward", "reward_word_order", "reward_same_words"):
        assert last[f"eval_{name}"] == pytest.approx(independent[name], rel=1e-12, abs=1e-12), name
    # the SFT run answers the task at times: the pass rate counts something
    assert independent["pass_rate"] > 0, independent


def test_the_sft_run_s_answer_exact_is_the_export_s_own_greedy_count_turn_by_turn(pipeline):
    """The chat example's generate_columns end to end (16 validation chats packed several to a
    block, in batches of 16 blocks): the SFT run's eval_answer_exact equals
    the share of the validation chats whose answer the export generates token for token
    (transformers' generate, each prompt alone, no padding), up to and with its end of turn, the
    answer's tokens read from the chat template's own rendering."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(pipeline.sft, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(pipeline.sft)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    lines = (pipeline.chats / "validation.jsonl").read_text().splitlines()
    exact = 0
    for line in lines:
        messages = json.loads(line)["messages"]
        prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True)
        prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
        whole = tokenizer.apply_chat_template(messages)
        whole = whole if isinstance(whole, list) else whole["input_ids"]
        answer = whole[len(prompt) : whole.index(end, len(prompt)) + 1]
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=len(answer),
                do_sample=False,
                eos_token_id=[end, tokenizer.eos_token_id],
                pad_token_id=end,
            )
        exact += out[0, len(prompt) :].tolist() == answer
    last = [row for row in read_metrics(pipeline.sft) if "eval_answer_exact" in row][-1]
    assert last["step"] == SFT_STEPS
    assert last["eval_answer_exact"] == exact / len(lines), (last, exact)
    assert 0 < exact < len(lines)  # some answers right, some wrong: the count tells them apart


def test_the_torch_path_killed_and_resumed_ends_bitwise_as_the_accelerate_run(
    pipeline, trained, tmp_path
):
    run_dir = tmp_path / "torch_path"
    args = pipeline.args(run_dir)
    env = {"FAULT_STEP": STEPS // 2 + 2, "FAULT_ACTION": "sigkill", "FAULT_RANK": 1}
    env.update(FAULT_ONCE=tmp_path / "sigkill.once", FAULTY_ENTRY="torch_ddp")
    env.update(RECORD_ROLLOUTS=tmp_path / "before_kill")
    faulty = pipeline.fork / "tests" / "helpers" / FAULTY_MAIN.name
    killed = launch_torchrun(args, tmp_path, script=faulty, env_extra=env)
    assert killed.returncode != 0
    resumed = launch_torchrun(
        [*args, "--resume", "latest"],
        tmp_path,
        script=faulty,
        env_extra={"FAULTY_ENTRY": "torch_ddp", "RECORD_ROLLOUTS": tmp_path / "after_resume"},
    ).check()
    assert f"(step {STEPS // 2})" in resumed.output
    expected, written = step_rows(trained.output_dir), step_rows(run_dir)
    assert sorted(written) == sorted(expected)
    for step in expected:
        for name in ("loss", "grad_norm", *ROLLOUT_VALUES):
            assert written[step][name] == expected[step][name], (step, name)
    assert evals(run_dir) == evals(trained.output_dir)
    # the tokens sampled after the resume: the uninterrupted run's, rank by rank
    after = recorded(tmp_path / "after_resume")
    steps_after = range(STEPS // 2 + 1, STEPS + 1)
    assert sorted(after) == [f"step{s:03d}_rank{r}" for s in steps_after for r in (0, 1)]
    baseline = recorded(pipeline.root / "rollouts")
    assert all(after[name] == baseline[name] for name in after)
    weights = load_weights(run_dir / "model.safetensors")
    exported = load_weights(trained.output_dir / "model.safetensors")
    assert weights.keys() == exported.keys() and weights
    assert all(weights[key].equal(exported[key]) for key in weights)


def test_under_fsdp2_ranks_of_different_lengths_finish_and_the_reference_never_drifts(
    pipeline, tmp_path
):
    """The torch path with --fsdp full (Accelerate's FSDP plugin needs GPUs): generate keeps every
    rank's decode forwards in step (each gathers the shards), whatever its own completions' length;
    and a rank SIGKILLed after the step-2 checkpoint resumes to the uninterrupted run's tokens, rows
    and export."""
    run_dir = tmp_path / "run"
    args = pipeline.args(run_dir, max_steps=4, save_every=2, eval_every=4)
    done = launch_torchrun(
        [*args, "--fsdp", "full"],
        tmp_path,
        script=pipeline.fork / "train" / "torch_ddp.py",
        env_extra={"RECORD_ROLLOUTS": tmp_path / "rollouts"},
        timeout=180,
    ).check()
    killed_dir = tmp_path / "killed"
    killed_args = [*pipeline.args(killed_dir, max_steps=4, save_every=2, eval_every=4)]
    killed_args += ["--fsdp", "full"]
    faulty = pipeline.fork / "tests" / "helpers" / FAULTY_MAIN.name
    env = {"FAULT_STEP": 3, "FAULT_ACTION": "sigkill", "FAULT_RANK": 1}
    env.update(FAULT_ONCE=tmp_path / "sigkill.once", FAULTY_ENTRY="torch_ddp")
    killed = launch_torchrun(killed_args, tmp_path, script=faulty, env_extra=env, timeout=180)
    assert killed.returncode != 0
    resumed = launch_torchrun(
        [*killed_args, "--resume", "latest"],
        tmp_path,
        script=faulty,
        env_extra={"FAULTY_ENTRY": "torch_ddp", "RECORD_ROLLOUTS": tmp_path / "after_resume"},
        timeout=180,
    ).check()
    assert "(step 2)" in resumed.output
    expected, written = step_rows(run_dir), step_rows(killed_dir)
    assert sorted(written) == sorted(expected) == [1, 2, 3, 4]
    for step in expected:
        for name in ("loss", "grad_norm", *ROLLOUT_VALUES):
            assert written[step][name] == expected[step][name], (step, name)
    assert evals(killed_dir) == evals(run_dir)
    after = recorded(tmp_path / "after_resume")
    assert sorted(after) == [f"step{s:03d}_rank{r}" for s in (3, 4) for r in (0, 1)]
    uninterrupted = recorded(tmp_path / "rollouts")
    assert all(after[name] == uninterrupted[name] for name in after)
    weights = load_weights(killed_dir / "model.safetensors")
    exported = load_weights(run_dir / "model.safetensors")
    assert weights.keys() == exported.keys() and weights
    assert all(weights[key].equal(exported[key]) for key in weights)
    # the ranks' completions ended at different lengths: a rank done first had fewer forwards to run
    rollouts = recorded(tmp_path / "rollouts")
    longest = {
        name: [max(sum(row) for row in b["completion_mask"]) for b in batches]
        for name, batches in rollouts.items()
    }
    differed = [
        (step, index)
        for step in range(1, 4)
        for index in range(2)
        if longest[f"step{step:03d}_rank0"][index] != longest[f"step{step:03d}_rank1"][index]
    ]
    assert differed, longest
    # step 1: the policy is its reference
    rows = step_rows(run_dir)
    assert sorted(rows) == [1, 2, 3, 4]
    assert rows[1]["kl"] == pytest.approx(0, abs=1e-9), rows[1]  # measured: 1e-13
    # then the policy moves away from it (measured: 1.3e-3 at step 3, noise aside: 1e-13)
    assert rows[3]["kl"] > 1e-5, rows
    digest = weights_digest_of(pipeline.sft)
    assert f"weights digest {digest}" in done.output
    assert manifest_identity(run_dir)["model/reference"] == digest


def test_one_process_of_4_prompts_samples_and_trains_as_two_processes_of_2(
    pipeline, trained, tmp_path
):
    """The same run as 1 process x 4 prompts x 2 micro-batches (python train/main.py): at every step
    each prompt's 4 completions are the 2 x 2 x 2 run's, token for token, and the losses, gradient
    norms and rollout values are its own to fp32 rounding (measured: loss within 2.1e-7 relative,
    grad_norm 3.1e-7, rewards and lengths 4e-16, KL 1e-9 absolute)."""
    run_dir = tmp_path / "one_process"
    run_python(
        pipeline.args(run_dir, batch_size=4),
        tmp_path,
        script=pipeline.fork / "train" / "main.py",
        env_extra={"RECORD_ROLLOUTS": tmp_path / "rollouts"},
    ).check()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pipeline.sft)
    one, two = recorded(tmp_path / "rollouts"), recorded(pipeline.root / "rollouts")
    assert sorted(one) == [f"step{s:03d}_rank0" for s in range(1, STEPS + 1)]
    for step in range(1, STEPS + 1):
        sampled = completions_by_prompt(one, tokenizer, step)
        assert len(sampled) == 8  # the step's prompts, all of them
        assert sampled == completions_by_prompt(two, tokenizer, step), step
    expected, written = step_rows(trained.output_dir), step_rows(run_dir)
    assert sorted(written) == sorted(expected)
    for step in expected:
        for name in ("loss", "grad_norm", *ROLLOUT_VALUES):
            got, wanted = written[step][name], expected[step][name]
            # KL is a mean of k3 over small differences of log-probs (step 1's is rounding alone,
            # 1e-13: the policy is its reference): its rounding is absolute
            assert got == pytest.approx(wanted, rel=1e-5, abs=1e-8), (step, name, got, wanted)
