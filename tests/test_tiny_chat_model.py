"""scripts/tiny_chat_model.py as a person runs it: one line saying what it wrote and what to run next, a
folder that transformers loads as a chat model (the model, its tokenizer and chat template), chats beside
it; a bad OUT_DIR (a folder that holds files, a file, none given) refused in one `error:` line, exit 2,
with nothing touched."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO, base_env

SCRIPT = REPO / "scripts" / "tiny_chat_model.py"


def run_script(*args, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        cwd=REPO,
        env=base_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_it_writes_a_chat_model_folder_transformers_loads_and_says_what_to_run_next(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "tiny_chat"
    done = run_script(out, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    said = (done.stdout + done.stderr).splitlines()
    assert len(said) == 1 and said[0].startswith(f"wrote {out} "), said
    # the command it prints fits the model: 128 positions, where chat_sft's block_size is 1024
    assert f"--hf_model {out} --dataset {out / 'chats.jsonl'} --block_size 128" in said[0]
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == len(tokenizer) == 322  # 320 BPE tokens and ChatML's two
    conversation = [
        {"role": "user", "content": "reverse: tiger"},
        {"role": "assistant", "content": "regit"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert (
        rendered
        == "<|im_start|>user\nreverse: tiger<|im_end|>\n<|im_start|>assistant\nregit<|im_end|>\n"
    )
    ids = tokenizer.apply_chat_template(conversation)["input_ids"]
    assert tokenizer.decode(ids) == rendered
    assert model(input_ids=torch.tensor([ids])).logits.shape == (1, len(ids), 322)
    # generate (and TRL) stop where the template's generation does, not at Llama's default EOS 2
    # (a byte here); EOS pads; no BOS
    from chat import end_of_turn_ids

    assert model.generation_config.eos_token_id == sorted(end_of_turn_ids(tokenizer))
    assert model.generation_config.pad_token_id == tokenizer.eos_token_id
    assert model.config.eos_token_id == sorted(end_of_turn_ids(tokenizer))
    assert model.config.bos_token_id is None and model.generation_config.bos_token_id is None
    chats = [json.loads(line) for line in (out / "chats.jsonl").read_text().splitlines()]
    assert len(chats) == 96 and all(
        "assistant" in {m["role"] for m in c["messages"]} for c in chats
    )


@pytest.mark.parametrize("bad", ["a folder with a file in it", "a file", "no folder named"])
def test_a_bad_out_dir_is_one_error_line_exit_2_and_nothing_is_touched(bad, tmp_path):
    mine = tmp_path / "mine"
    if bad == "a folder with a file in it":
        mine.mkdir()
        (mine / "notes.txt").write_text("keep me")
    elif bad == "a file":
        mine.write_text("keep me")
    args = [] if bad == "no folder named" else [mine]
    done = run_script(*args, tmp_path=tmp_path)
    said = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 2, said
    assert len(said) == 1 and said[0].startswith("error: "), said
    if args:
        assert str(mine) in said[0]
    kept = mine / "notes.txt" if mine.is_dir() else mine
    assert not mine.exists() or kept.read_text() == "keep me"
    assert {p.name for p in tmp_path.iterdir()} <= {"mine"}  # nothing written beside it either
