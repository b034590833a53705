"""The start-up checks (train/checks.py) in one process: each refusal's whole line, written out by hand,
and what each check lets through. (Through train/main.py, one line and exit 2: tests/test_config.py.)"""

import json
import os
from types import SimpleNamespace

import pytest
import torch

import checks
from errors import ConfigError


def refusal(check, *args) -> str:
    with pytest.raises(ConfigError) as refused:
        check(*args)
    return str(refused.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the lines of a machine without CUDA")
def test_what_needs_cuda_is_refused_on_a_machine_without_it_in_one_whole_line():
    def cfg(sync_batchnorm=False, oom_snapshot=False):
        return SimpleNamespace(sync_batchnorm=sync_batchnorm, oom_snapshot=oom_snapshot)

    checks.check_devices(cfg())
    assert refusal(checks.check_devices, cfg(sync_batchnorm=True)) == (
        "sync_batchnorm needs CUDA GPUs (SyncBatchNorm reduces each batch's statistics over NCCL; "
        "on CPU the gloo backend cannot run it): leave it off here, broadcast_buffers keeps the "
        "ranks' statistics rank 0's (got true)"
    )
    assert refusal(checks.check_devices, cfg(oom_snapshot=True)) == (
        "oom_snapshot needs CUDA GPUs (it records the CUDA allocator's history): leave it off "
        "here (got true)"
    )


AT_WORLD_SIZE_1 = (
    "started this process at world size 1: every node would train alone and overwrite the others' "
    "files; launch it with "
)


@pytest.mark.parametrize(
    "environ, found, launch",
    [
        (
            {"PET_NNODES": "2"},
            "PET_NNODES=2",
            "Kubeflow Trainer or PyTorchJob: torchrun train/main.py, which reads PET_*",
        ),
        (
            {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "3", "WORLD_SIZE": ""},
            "SLURM_STEP_NUM_NODES=3",
            "SLURM: one launcher per node, as scripts/slurm/accelerate_2node.sbatch",
        ),
        (
            {"SKYPILOT_NUM_NODES": "4", "PET_NNODES": "2", "WORLD_SIZE": "1"},
            "PET_NNODES=2, SKYPILOT_NUM_NODES=4",
            "Kubeflow Trainer or PyTorchJob: torchrun train/main.py, which reads PET_*",
        ),
        (
            {"SKYPILOT_NUM_NODES": "2"},
            "SKYPILOT_NUM_NODES=2",
            "SkyPilot: torchrun --nnodes $SKYPILOT_NUM_NODES --node_rank $SKYPILOT_NODE_RANK "
            "--master_addr <the first of $SKYPILOT_NODE_IPS> train/main.py",
        ),
        (
            {"MASTER_ADDR": "10.0.0.1"},
            "MASTER_ADDR=10.0.0.1 without WORLD_SIZE",
            "a launcher sets both",
        ),
    ],
)
def test_a_multi_node_environment_at_world_size_1_is_one_whole_line(environ, found, launch):
    assert refusal(checks.check_launch, environ) == (
        f"a multi-node environment ({found}) {AT_WORLD_SIZE_1}{launch}"
    )


@pytest.mark.parametrize(
    "environ",
    [
        {"PET_NNODES": "", "SKYPILOT_NUM_NODES": "1"},
        {"SLURM_STEP_NUM_NODES": "2"},  # the batch script: no step
        {"MASTER_ADDR": "10.0.0.1", "WORLD_SIZE": "1"},
        {"PET_NNODES": "2", "WORLD_SIZE": "2"},
    ],
)
def test_one_node_a_batch_script_or_a_launched_world_goes_on(environ):
    checks.check_launch(environ)


def test_an_empty_or_missing_dataset_path_is_one_whole_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "corpus.jsonl").write_text("{}\n")
    assert refusal(checks.check_dataset_name, "") == "dataset must not be empty (got '')"
    for existing in ("corpus.jsonl", "data", str(tmp_path / "data")):
        checks.check_dataset_name(existing)
    not_there = "dataset is not an existing file or folder (got {!r})"
    for path in (
        "/no/such/corpus",
        "/corpus",
        "~corpus",
        "a.txt",
        "a.json",
        "a.jsonl",
        "a.csv",
        "a.parquet",
        "owner/name/file",
    ):
        assert refusal(checks.check_dataset_name, path) == not_there.format(path), path
    for path, folder in (("data/corpus", "data"), ("./corpus", "."), ("../corpus", "..")):
        assert refusal(checks.check_dataset_name, path) == (
            f"dataset is not an existing file or folder (there is a local folder '{folder}/': a typo "
            f"in the path?) (got '{path}')"
        )


def test_a_name_or_a_hub_dataset_offline_is_left_to_data_py(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    asked = []
    monkeypatch.setattr(checks, "check_hub_dataset", asked.append)
    checks.check_dataset_name("tinyshakespeare")
    checks.check_dataset_name("owner/name")
    assert asked == ["owner/name"]


@pytest.mark.parametrize(
    "environ, offline",
    [
        ({}, False),
        ({"HF_HUB_OFFLINE": "0"}, False),
        ({"HF_HUB_OFFLINE": ""}, False),
        ({"HF_HUB_OFFLINE": "1"}, True),
        ({"HF_DATASETS_OFFLINE": "true"}, True),
        ({"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "1"}, True),
    ],
)
def test_the_hub_is_offline_when_either_variable_says_so(monkeypatch, environ, offline):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert checks.hub_is_offline() is offline


class Hub:
    """huggingface_hub.HfApi as check_hub_dataset asks it: what dataset_info raises, and the
    questions it got."""

    asked = []
    raises = None

    def dataset_info(self, name, timeout):
        Hub.asked.append((name, timeout))
        if Hub.raises is not None:
            raise Hub.raises


@pytest.fixture
def hub(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub, "HfApi", Hub)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    Hub.asked, Hub.raises = [], None
    return Hub


def test_a_hub_dataset_is_asked_for_once_in_five_seconds_and_a_missing_one_is_one_line(hub):
    from huggingface_hub.errors import RepositoryNotFoundError

    checks.check_hub_dataset("owner/name")
    assert hub.asked == [("owner/name", 5)]
    assert "HF_HUB_OFFLINE" not in os.environ

    class NotThere(RepositoryNotFoundError):
        def __init__(self):  # the hub's answer, without an HTTP response
            Exception.__init__(self, "404 Client Error: Repository Not Found")

    hub.raises = NotThere()
    assert refusal(checks.check_hub_dataset, "owner/gone") == (
        "dataset 'owner/gone' is not on the hub (or is private or gated: log in with `hf auth login`)"
    )


def test_an_unreachable_hub_without_a_copy_is_one_line_and_with_one_goes_on_offline(
    hub, tmp_path, monkeypatch
):
    from huggingface_hub import constants

    hub.raises = ConnectionError("Failed to resolve 'huggingface.co'\nmore")
    assert refusal(checks.check_hub_dataset, "owner/name") == (
        "dataset 'owner/name' could not be loaded: the hub cannot be reached (Failed to resolve "
        "'huggingface.co') and there is no local copy (set HF_HUB_OFFLINE=1 to use the cache "
        "without asking the hub)"
    )
    assert "HF_HUB_OFFLINE" not in os.environ
    for copy in (
        tmp_path / "hub" / "datasets--owner--name",  # the hub's cache
        tmp_path / "home" / "datasets" / "owner___name",  # datasets' own, under HF_HOME
        tmp_path / "mine" / "owner___name",  # datasets' own, where HF_DATASETS_CACHE says
    ):
        if copy.parent.name == "mine":
            monkeypatch.setenv("HF_DATASETS_CACHE", str(copy.parent))
        copy.mkdir(parents=True)
        checks.check_hub_dataset("owner/name")
        assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"
        assert constants.HF_HUB_OFFLINE is True
        copy.rmdir()
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            monkeypatch.delenv(name)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def test_offline_the_hub_is_not_asked(hub, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    checks.check_hub_dataset("owner/name")
    assert hub.asked == []


def test_unreadable_data_names_the_first_line_that_does_not_parse(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a"}\n\n{"text": \n{"text": "b"}\n')
    assert checks.first_bad_json_line(corpus) == 3  # the blank line 2 is skipped, not bad
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "a"}\n\n')
    assert checks.first_bad_json_line(good) is None
    not_utf8 = tmp_path / "latin1.jsonl"
    not_utf8.write_bytes(b'{"text": "a"}\n{"text": "caf\xe9"}\n')
    assert checks.first_bad_json_line(not_utf8) == 2  # read as bytes: the bad line is named
    cause = ValueError("JSON parse error: Missing a name\nsecond line")
    error = RuntimeError("An error occurred while generating the dataset")
    error.__cause__ = cause
    said = str(checks.unreadable_data(str(corpus), error))
    assert said == (
        f"dataset '{corpus}' cannot be read ({corpus}, line 3): JSON parse error: Missing a name"
    )
    plain = checks.unreadable_data(str(good), OSError("disk gone"))
    assert str(plain) == f"dataset '{good}' cannot be read: disk gone"


def test_in_a_folder_the_first_bad_jsonl_file_in_name_order_is_named(tmp_path):
    folder = tmp_path / "shards"
    (folder / "b").mkdir(parents=True)
    (folder / "a.jsonl").write_text('{"x": 1}\n')
    (folder / "b" / "c.jsonl").write_text('{"x": 1}\n{"x"\n')
    (folder / "d.jsonl").write_text("nope\n")
    (folder / "a.txt").write_text("not json\n")
    said = str(checks.unreadable_data(str(folder), ValueError("bad")))
    assert said == f"dataset '{folder}' cannot be read ({folder / 'b' / 'c.jsonl'}, line 2): bad"
    text = tmp_path / "notes.txt"
    text.write_text("not json\n")
    assert str(checks.unreadable_data(str(text), ValueError("bad"))) == (
        f"dataset '{text}' cannot be read: bad"
    )
    assert str(checks.unreadable_data("owner/name", ValueError("bad"))) == (
        "dataset 'owner/name' cannot be read: bad"
    )


def test_a_model_folder_without_weights_or_with_weights_of_other_shapes_is_one_line(tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoConfig, LlamaConfig

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    folder = tmp_path / "model"
    config.save_pretrained(folder)
    config = AutoConfig.from_pretrained(folder)
    assert refusal(checks.check_model_folder, str(folder), config) == (
        f"hf_model '{folder}' has a config.json and no weights (model.safetensors or "
        f"pytorch_model.bin): pass --model_weights config to train its architecture from fresh "
        f"weights"
    )
    # by hand: the shapes a 32-token, 8-wide, 16-inner Llama has, four of them wrong
    right = {
        "model.embed_tokens.weight": [32, 8],
        "model.layers.0.self_attn.q_proj.weight": [8, 8],
        "model.layers.0.mlp.up_proj.weight": [16, 8],
        "model.norm.weight": [8],
        "lm_head.weight": [32, 8],
    }
    wrong = {
        "model.embed_tokens.weight": [33, 8],
        "model.layers.0.self_attn.q_proj.weight": [8, 9],
        "model.layers.0.mlp.up_proj.weight": [17, 8],
        "model.norm.weight": [7],
        "not.in.the.model": [5],
        "lm_head.weight": [32, 8],
    }
    save_file({k: torch.zeros(v) for k, v in right.items()}, folder / "model.safetensors")
    checks.check_model_folder(str(folder), config)  # the shapes fit
    save_file({k: torch.zeros(v) for k, v in wrong.items()}, folder / "model.safetensors")
    said = refusal(checks.check_model_folder, str(folder), config)
    problems = [  # in the file's order: safetensors sorts its keys
        "model.embed_tokens.weight [33, 8] vs [32, 8]",
        "model.layers.0.mlp.up_proj.weight [17, 8] vs [16, 8]",
        "model.layers.0.self_attn.q_proj.weight [8, 9] vs [8, 8]",
        "model.norm.weight [7] vs [8]",
    ]
    fits = f"hf_model '{folder}': its weights do not fit its config.json (llama): "
    assert said == fits + "; ".join(problems[:3]) + " (+1 more)"
    # sharded: the index names the files; three problems, no "more"
    (folder / "model.safetensors").unlink()
    save_file({k: torch.zeros(v) for k, v in list(wrong.items())[:2]}, folder / "one.safetensors")
    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(17, 8)}, folder / "two.safetensors")
    weight_map = {
        "model.embed_tokens.weight": "one.safetensors",
        "model.layers.0.self_attn.q_proj.weight": "one.safetensors",
        "model.layers.0.mlp.up_proj.weight": "two.safetensors",
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    in_file_order = [problems[0], problems[2], problems[1]]  # one.safetensors, then two
    assert refusal(checks.check_model_folder, str(folder), config) == fits + "; ".join(
        in_file_order
    )
    # pickled weights are read only by loading them: nothing to check here
    (folder / "model.safetensors.index.json").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"")
    checks.check_model_folder(str(folder), config)


def model_cfg(**keys):
    """The keys check_model_and_tokenizer reads, as the config gives them by default."""
    defaults = dict(
        hf_model="", tokenizer_name="bytes", tokenizer="", model_weights="pretrained", block_size=32
    )
    return SimpleNamespace(**{**defaults, **keys})


def test_a_hub_model_s_tokenizer_and_positions_are_checked_in_whole_lines(
    tmp_path, monkeypatch, tiny_llama, bpe_tokenizer, chat_tokenizer
):
    checked_folders = []
    monkeypatch.setattr(
        checks, "check_model_folder", lambda folder, c: checked_folders.append(folder)
    )
    checks.check_model_and_tokenizer(model_cfg())  # the GPT on bytes: nothing to resolve
    checks.check_model_and_tokenizer(model_cfg(tokenizer_name=str(bpe_tokenizer)))  # no hub model
    llama = dict(hf_model=str(tiny_llama), tokenizer_name=str(bpe_tokenizer), tokenizer="x")
    checks.check_model_and_tokenizer(model_cfg(**llama, block_size=64))  # 64 positions: all of them
    assert checked_folders == [str(tiny_llama)]  # pretrained weights from a folder: read now
    checks.check_model_and_tokenizer(model_cfg(**llama, model_weights="config"))
    assert checked_folders == [str(tiny_llama)]  # fresh weights: no weights to check
    assert refusal(checks.check_model_and_tokenizer, model_cfg(**llama, block_size=65)) == (
        "block_size must be <= the model's 64 positions (got 65)"
    )
    checks.check_model_and_tokenizer(
        SimpleNamespace(**{**vars(model_cfg(**llama)), "block_size": 0})
    )
    more = {**llama, "tokenizer_name": str(chat_tokenizer)}  # 320 + 2 tokens
    assert refusal(checks.check_model_and_tokenizer, model_cfg(**more)) == (
        f"tokenizer has 322 tokens, more than the 320 that model '{tiny_llama}' embeds "
        f"(got '{chat_tokenizer}')"
    )


def test_a_model_without_a_positions_limit_takes_any_block_size(monkeypatch, bpe_tokenizer):
    import transformers

    cfg = model_cfg(hf_model="hub/model", tokenizer_name=str(bpe_tokenizer), block_size=100_000)
    for unlimited in (
        SimpleNamespace(vocab_size=320, max_position_embeddings=None),
        SimpleNamespace(vocab_size=320),  # a config without the key
    ):
        monkeypatch.setattr(
            transformers.AutoConfig, "from_pretrained", lambda name, unlimited=unlimited: unlimited
        )
        checks.check_model_and_tokenizer(cfg)
    without_the_key = SimpleNamespace(**{k: v for k, v in vars(cfg).items() if k != "block_size"})
    checks.check_model_and_tokenizer(without_the_key)  # a fork's data.py may declare none


def test_a_model_or_tokenizer_that_cannot_be_loaded_is_one_line_naming_it(tmp_path):
    from transformers import AutoConfig

    missing = tmp_path / "missing"
    said = refusal(checks.check_model_and_tokenizer, model_cfg(hf_model=str(missing)))
    with pytest.raises(Exception) as transformers_says:  # what transformers says, its first line
        AutoConfig.from_pretrained(str(missing))
    first = str(transformers_says.value).strip().splitlines()[0]
    assert said == f"hf_model '{missing}' could not be loaded: {first}"
    tokenizer = tmp_path / "no_tokenizer"
    tokenizer.mkdir()
    own = model_cfg(tokenizer_name=str(tokenizer))  # the model's own, by default
    said = refusal(checks.check_model_and_tokenizer, own)
    assert said.startswith(f"tokenizer '{tokenizer}' could not be loaded: ")
    hint = " (the model's own, by default: pass --tokenizer NAME_OR_FOLDER)"
    assert said.endswith(hint)
    named = model_cfg(tokenizer_name=str(tokenizer), tokenizer=str(tokenizer))
    assert refusal(checks.check_model_and_tokenizer, named) == said.removesuffix(hint)
