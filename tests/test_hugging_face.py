"""Hugging Face models and tokenizers, in one process and offline: packing with a BPE tokenizer, models from a
local folder, the one-line refusals at start-up, and scripts/sample.py. (Training on 2 processes, resume and the
from_pretrained export: tests/e2e/test_hugging_face_runs.py.)"""

import importlib.util
import json
import shutil
from dataclasses import asdict

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

import data
import lm
from checkpoint import save_safetensors
from conftest import REPO, run_python, save_tiny_llama
from errors import ConfigError
from job import load_checked_config
from model import build_model
from run_config import config_class, load_config

RunConfig = config_class()  # TrainConfig and model.py's and data.py's own keys


def sample_script():
    spec = importlib.util.spec_from_file_location("sample", REPO / "scripts" / "sample.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.shipped
def test_documents_end_with_eos_and_ids_take_the_narrowest_unsigned_type(corpus, bpe_tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(bpe_tokenizer)
    texts = ["def f(x):\n    return x", "import os"]
    packed = data.pack({"text": texts}, block_size=4, text_column="text", tokenizer=tokenizer)[
        "input_ids"
    ]
    expected = [
        t
        for text in texts
        for t in [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    ]
    assert (
        packed.dtype == np.uint16
        and packed.reshape(-1).tolist() == expected[: len(expected) // 4 * 4]
    )
    assert [data.token_dtype(n) for n in (256, 257, 65536, 65537)] == [
        np.uint8,
        np.uint16,
        np.uint16,
        np.uint32,
    ]
    cfg = load_config(
        ["--dataset", str(corpus), "--block_size", "32", "--tokenizer", str(bpe_tokenizer)]
    )
    train, _ = data.build_datasets(cfg)
    # on disk: 2 bytes a token, not 8
    assert str(train.features["input_ids"].feature.dtype) == "uint16"
    # the GPT fits it
    assert lm.vocab_size(cfg) == 320 and build_model(cfg).lm_head.weight.shape[0] == 320
    assert data.pack({"text": ["ab"]}, "text", 1)["input_ids"].dtype == np.uint8  # bytes, as before


def test_a_hugging_face_model_from_a_folder_pretrained_or_fresh(corpus, bpe_tokenizer, tiny_llama):
    args = [
        "--dataset",
        str(corpus),
        "--block_size",
        "32",
        "--hf_model",
        str(tiny_llama),
        "--tokenizer",
        str(bpe_tokenizer),
    ]
    pretrained = build_model(load_config(args))
    saved = pretrained.state_dict()
    assert (
        type(pretrained).__name__ == "LlamaForCausalLM"
        and saved["model.embed_tokens.weight"].dtype == torch.float32
    )
    torch.manual_seed(1)
    fresh = build_model(load_config([*args, "--model_weights", "config"]))
    assert not torch.equal(
        fresh.state_dict()["model.embed_tokens.weight"], saved["model.embed_tokens.weight"]
    )
    ids = torch.randint(0, 320, (2, 32))
    output = pretrained(input_ids=ids, labels=ids)
    assert output.logits.shape == (2, 32, 320) and torch.isfinite(output.loss)


def test_a_bf16_model_folder_trains_fp32_weights(tmp_path, corpus, bpe_tokenizer, tiny_llama):
    """A checkpoint saved in bf16 (most hub models are): torch's own dtype of every parameter built
    is float32, as the optimizer must step them (the folder's config.json says bfloat16)."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "bf16"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    assert load_file(folder / "model.safetensors")["lm_head.weight"].dtype == torch.bfloat16
    args = ["--dataset", str(corpus), "--block_size", "32", "--hf_model", str(folder)]
    built = build_model(load_config([*args, "--tokenizer", str(bpe_tokenizer)]))
    assert {p.dtype for p in built.parameters()} == {torch.float32}


def test_block_size_may_be_exactly_the_model_s_positions(corpus, bpe_tokenizer, tiny_llama):
    """The positions read from the folder's config.json (64): block_size 64 is accepted, 65 not."""
    positions = json.loads((tiny_llama / "config.json").read_text())["max_position_embeddings"]
    flags = ["--dataset", str(corpus), "--hf_model", str(tiny_llama)]
    flags += ["--tokenizer", str(bpe_tokenizer)]
    assert load_checked_config([*flags, "--block_size", str(positions)]).block_size == positions
    with pytest.raises(ConfigError, match=f"block_size must be <= the model's {positions}"):
        load_checked_config([*flags, "--block_size", str(positions + 1)])


def test_a_model_built_for_a_tokenizer_embeds_its_added_tokens_too(corpus, chat_tokenizer):
    """By hand: the BPE's 320 tokens and the chat template's two added ones (<|im_start|> 320,
    <|im_end|> 321, outside tokenizer.vocab_size): 322 rows, so every id the chat data holds embeds."""
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    assert tokenizer.vocab_size == 320
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 321
    cfg = load_config(["--dataset", str(corpus), "--tokenizer", str(chat_tokenizer)])
    assert lm.vocab_size(cfg) == 322


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--hf_model", "nobody/no-such-model"],
            "hf_model 'nobody/no-such-model' could not be loaded",
        ),
        (
            ["--tokenizer", "nobody/no-such-tokenizer"],
            "tokenizer 'nobody/no-such-tokenizer' could not be loaded",
        ),
        (
            ["--hf_model", "LLAMA"],
            "tokenizer '.*llama.*' could not be loaded: .*the model's own, by default: pass --tok",
        ),
        (
            ["--hf_model", "SMALL_LLAMA", "--tokenizer", "BPE"],
            "tokenizer has 320 tokens, more than the 100 that model",
        ),
        (
            ["--hf_model", "LLAMA", "--tokenizer", "BPE", "--block_size", "65"],
            "block_size must be <= the model's 64",
        ),
        (["--model_weights", "random"], "model_weights must be one of pretrained, config"),
    ],
)
def test_a_bad_model_or_tokenizer_is_one_line_before_anything_starts(
    flags, message, tmp_path, corpus, bpe_tokenizer, tiny_llama
):
    folders = {"LLAMA": tiny_llama, "BPE": bpe_tokenizer, "SMALL_LLAMA": tmp_path / "small"}
    if "SMALL_LLAMA" in flags:
        save_tiny_llama(folders["SMALL_LLAMA"], vocab_size=100)
    flags = [str(folders.get(flag, flag)) for flag in flags]
    with pytest.raises(ConfigError, match=message) as refused:
        load_checked_config(["--dataset", str(corpus), "--block_size", "32", *flags])
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("damage", ["other_shape", "narrower_weight", "no_weights", "unknown_type"])
def test_a_model_folder_that_cannot_be_loaded_as_configured_is_one_line_exit_2(
    damage, tmp_path, corpus, bpe_tokenizer, tiny_llama
):
    """Weights of another shape than config.json (also one that differs in its second dimension
    only, by hand), a config and no weights, a config transformers does not know: one line naming
    the folder and what does not fit, exit 2, before any process group."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    if damage == "other_shape":
        config["intermediate_size"] = 48  # the MLP's matrices in the file are 64 wide
        expected = f"hf_model '{folder}': its weights do not fit its config.json \\(llama\\): "
        expected += r".*\[64, 32\] vs \[48, 32\]"
    elif damage == "narrower_weight":  # the file's, in its second dimension only
        weights = load_file(folder / "model.safetensors")
        weights["model.layers.1.mlp.down_proj.weight"] = torch.zeros(32, 48)  # [32, 64] in config
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        expected = r".*model.layers.1.mlp.down_proj.weight \[32, 48\] vs \[32, 64\]"
    elif damage == "no_weights":
        (folder / "model.safetensors").unlink()
        expected = f"hf_model '{folder}' has a config.json and no weights .*--model_weights config"
    else:
        config["model_type"] = "no-such-architecture"
        expected = f"hf_model '{folder}' could not be loaded: "
    (folder / "config.json").write_text(json.dumps(config))
    flags = ["--dataset", str(corpus), "--block_size", "32", "--hf_model", str(folder)]
    flags += ["--tokenizer", str(bpe_tokenizer), "--output_dir", str(tmp_path / "run")]
    with pytest.raises(ConfigError, match=expected) as refused:
        load_checked_config(flags)
    assert "\n" not in str(refused.value)
    if damage == "other_shape":  # through the real entry point: exit 2, one line, nothing written
        result = run_python(flags, tmp_path, timeout=120)
        errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
        assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.output
        assert not (tmp_path / "run").exists()


def write_run_folder(folder, cfg):
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(asdict(cfg)))
    torch.manual_seed(0)
    save_safetensors(build_model(cfg), folder / "model.safetensors")
    return folder


@pytest.mark.shipped
def test_sample_gives_the_same_text_for_the_same_seed_and_refuses_weights_of_another_shape(
    tmp_path,
):
    sample = sample_script()
    cfg = RunConfig(n_layer=1, n_head=2, n_embd=16, block_size=16)
    run = write_run_folder(tmp_path / "run", cfg)
    _, model, tokenizer = sample.load_trained(run)
    texts = [sample.generate(model, tokenizer, 16, "def ", 40, 0.8, 20, seed) for seed in (0, 0, 1)]
    assert texts[0] == texts[1] != texts[2] and texts[0]
    greedy = [
        sample.generate(model, tokenizer, 16, "", 5, temperature=0, top_k=0, seed=seed)
        for seed in (0, 9)
    ]
    assert greedy[0] == greedy[1]  # temperature 0: the likeliest token, whatever the seed
    wider = write_run_folder(
        tmp_path / "wider", RunConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)
    )
    (run / "model.safetensors").write_bytes((wider / "model.safetensors").read_bytes())
    with pytest.raises(
        ConfigError,
        match="does not fit this model: .*proj.weight \\[32, 32\\] vs model \\[16, 16\\]",
    ):
        sample.load_trained(run)


def test_sample_works_with_a_hugging_face_model_and_its_tokenizer(
    tmp_path, bpe_tokenizer, tiny_llama
):
    sample = sample_script()
    run = write_run_folder(
        tmp_path / "run",
        RunConfig(hf_model=str(tiny_llama), tokenizer=str(bpe_tokenizer), block_size=32),
    )
    _, model, tokenizer = sample.load_trained(run)
    first, again = (
        sample.generate(model, tokenizer, 32, "import", 12, 1.0, 0, 5) for _ in range(2)
    )
    assert first == again and isinstance(first, str)


def test_sample_chats_through_the_template_and_stops_at_the_end_of_the_turn(chat_tokenizer):
    """--chat: the message goes in as the template writes a user's turn with the assistant's begun,
    and the reply ends before the template's end-of-turn token (or EOS), which is not printed."""
    from transformers import AutoTokenizer

    sample = sample_script()
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    written = "<|im_start|>user\nupper: alpha<|im_end|>\n<|im_start|>assistant\n"
    expected = tokenizer(written, add_special_tokens=False)["input_ids"]
    assert sample.chat_prompt(tokenizer, "upper: alpha") == expected
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert sample.end_of_turn_ids(tokenizer) == {end_of_turn, tokenizer.eos_token_id}
    # a model that says "W", "X", then ends its turn, then would go on: the reply is "WX"
    script = [*tokenizer("WX", add_special_tokens=False)["input_ids"], end_of_turn]
    script += tokenizer("YZ", add_special_tokens=False)["input_ids"]

    class Scripted(torch.nn.Module):
        def forward(self, input_ids):
            said = input_ids.shape[1] - len(expected)
            logits = torch.zeros(1, input_ids.shape[1], len(tokenizer))
            logits[0, -1, script[said]] = 1.0
            return type("Output", (), {"logits": logits})

    reply = sample.generate(Scripted(), tokenizer, 64, "upper: alpha", 10, 0.0, 0, 0, chat=True)
    assert reply == "WX"
    with pytest.raises(ConfigError, match="chat template"):
        sample.chat_prompt(None, "hi")


def test_every_documented_sample_command_is_one_sample_py_takes(tmp_path):
    """The README, sample.py's docstring and the chat example wrote `--chat "text"`, which sample.py
    refuses (--chat takes no value). Each command as written goes through sample.py's own argument
    parser to the run folder (one that does not exist here), where a refused one stops first."""
    import re
    import shlex

    sample = sample_script()
    documents = [REPO / "README.md", REPO / "scripts" / "sample.py"]
    for folder, pattern in (("examples", "*.py"), ("examples", "*.md"), ("docs", "*.md")):
        documents += sorted((REPO / folder).rglob(pattern))
    commands = [
        (document.name, command)
        for document in documents
        for command in re.findall(r"python scripts/sample\.py ([^`\n]+)", document.read_text())
    ]
    assert any("--chat" in command for _, command in commands)
    absent = str(tmp_path / "absent_run")
    for document, command in commands:
        written = shlex.split(command, comments=True)
        arguments = [absent if a.startswith(("runs/", "RUN")) else a for a in written]
        with pytest.raises(SystemExit) as stopped:
            sample.main(arguments)
        past_the_arguments = f"error: {absent} has no config.yaml: pass a run folder or one of its"
        assert str(stopped.value.code).startswith(past_the_arguments), (document, command)


def test_pretrained_weights_are_the_folder_s_and_fresh_ones_from_a_bf16_config_are_fp32(
    tmp_path, corpus, bpe_tokenizer, tiny_llama
):
    """--model_weights pretrained reads the folder's own tensors (compared with the safetensors file
    read directly); --model_weights config builds fresh fp32 weights even where config.json says
    bfloat16 (transformers' from_config would build bf16)."""
    from transformers import AutoModelForCausalLM

    args = ["--dataset", str(corpus), "--block_size", "32", "--tokenizer", str(bpe_tokenizer)]
    pretrained = lm.hugging_face_model(load_config([*args, "--hf_model", str(tiny_llama)]))
    on_disk = load_file(tiny_llama / "model.safetensors")
    assert torch.equal(
        pretrained.state_dict()["model.embed_tokens.weight"], on_disk["model.embed_tokens.weight"]
    )
    folder = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    fresh = lm.hugging_face_model(
        load_config([*args, "--hf_model", str(folder), "--model_weights", "config"])
    )
    assert {p.dtype for p in fresh.parameters()} == {torch.float32}


def test_a_tokenizer_without_eos_cannot_pack_documents_and_the_export_saves_the_tokenizer(
    tmp_path, corpus, bpe_tokenizer
):
    tokenizer = AutoTokenizer.from_pretrained(bpe_tokenizer)
    tokenizer.eos_token = None
    no_eos = tmp_path / "no_eos"
    tokenizer.save_pretrained(no_eos)
    with pytest.raises(ConfigError) as error:
        lm.packing_tokenizer(str(no_eos))
    assert str(error.value) == (
        f"tokenizer '{no_eos}' has no EOS token to end documents with: set its eos_token"
    )
    # the export's folder: the tokenizer's files, which encode as the original does; none for bytes
    args = ["--dataset", str(corpus), "--block_size", "32"]
    exported = tmp_path / "export"
    exported.mkdir()
    lm.save_tokenizer(load_config([*args, "--tokenizer", "bytes"]), exported)
    assert list(exported.iterdir()) == []
    lm.save_tokenizer(load_config([*args, "--tokenizer", str(bpe_tokenizer)]), exported)
    text = "def f(x):\n    return x"
    original = AutoTokenizer.from_pretrained(bpe_tokenizer)
    assert AutoTokenizer.from_pretrained(exported)(text)["input_ids"] == original(text)["input_ids"]
