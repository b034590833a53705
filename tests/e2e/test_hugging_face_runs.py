"""A Hugging Face model with its own BPE tokenizer, both from local folders, through `accelerate launch` on 2 CPU
processes: trains, resumes bitwise, and its export loads with AutoModelForCausalLM.from_pretrained."""

import shutil

import pytest
import torch
import yaml

from conftest import launch_accelerate, load_weights, tiny_args
from test_hugging_face import sample_script

pytestmark = pytest.mark.slow


def test_a_hugging_face_model_trains_on_two_processes_resumes_bitwise_and_exports_for_from_pretrained(
    tmp_path, corpus, bpe_tokenizer, tiny_llama
):
    from transformers import AutoModelForCausalLM

    def args(out):
        return tiny_args(
            out,
            corpus,
            hf_model=tiny_llama,
            tokenizer=bpe_tokenizer,
            max_steps=8,
            save_every=4,
            eval_every=8,
            dropout=0.1,
        )

    full = launch_accelerate(args(tmp_path / "full"), tmp_path).check()
    losses = full.losses()
    assert sorted(losses) == list(range(1, 9)) and losses[8] < losses[1]
    evaluation = [r for r in full.metrics() if "eval_loss" in r][-1]
    # ln(320) = 5.77 at random
    assert 0 <= evaluation["eval_accuracy"] <= 1 and evaluation["eval_loss"] < 6

    resumed_dir = tmp_path / "resumed"
    shutil.copytree(
        tmp_path / "full" / "checkpoints" / "step_00000004",
        resumed_dir / "checkpoints" / "step_00000004",
    )
    resumed = launch_accelerate([*args(resumed_dir), "--resume", "latest"], tmp_path).check()
    assert "(step 4)" in resumed.output
    assert resumed.losses() == {step: loss for step, loss in losses.items() if step > 4}
    exported, replayed = (
        load_weights(tmp_path / "full" / "model.safetensors"),
        load_weights(resumed_dir / "model.safetensors"),
    )
    assert exported.keys() == replayed.keys() and all(
        torch.equal(exported[k], replayed[k]) for k in exported
    )

    # the Hugging Face layout: config.json beside it
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    assert all(
        torch.equal(tensor, exported[name])
        for name, tensor in model.state_dict().items()
        if name in exported
    )
    # scripts/sample.py reads the run back
    _, trained, _ = sample_script().load_trained(tmp_path / "full")
    assert trained.state_dict().keys() == model.state_dict().keys()
    # a whole model: its tokenizer beside it, so both halves load from the run folder alone
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "full")
    source = AutoTokenizer.from_pretrained(bpe_tokenizer)
    text = "def f(x):\n    return x"
    assert len(tokenizer) == len(source) == 320
    assert tokenizer(text)["input_ids"] == source(text)["input_ids"]
    assert tokenizer.eos_token == source.eos_token
    saved = yaml.safe_load((tmp_path / "full" / "config.yaml").read_text())
    # as given
    assert saved["hf_model"] == str(tiny_llama) and saved["tokenizer"] == str(bpe_tokenizer)
