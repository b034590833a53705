"""Start-up checks of what a config names: data files and folders, hub datasets, Hugging Face models and
tokenizers; and of the launch (a multi-node job started without a launcher that joins its nodes). They
run in job.load_checked_config, before any process group: a wrong name or an unreadable file is one
`error:` line naming the key, not a traceback (or the hub client's retries) later. data.py and
streaming.py use `unreadable_data` for data that fails as it is read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from errors import ConfigError, first_line
from lm import uses_hub_model, vocab_size


def check_devices(cfg) -> None:
    """What needs a kind of device this machine lacks."""
    if cfg.sync_batchnorm and not torch.cuda.is_available():
        raise ConfigError(
            "sync_batchnorm needs CUDA GPUs (SyncBatchNorm reduces each batch's statistics over NCCL; "
            "on CPU the gloo backend cannot run it): leave it off here, broadcast_buffers keeps the "
            "ranks' statistics rank 0's (got true)"
        )
    if cfg.oom_snapshot and not torch.cuda.is_available():
        raise ConfigError(
            "oom_snapshot needs CUDA GPUs (it records the CUDA allocator's history): leave it off "
            "here (got true)"
        )


# what each engine sets when it starts a job on several nodes, and how this script is launched there
# (docs/multi-node.md has the table of each engine's variables)
MULTI_NODE_ENGINES = {
    "PET_NNODES": "Kubeflow Trainer or PyTorchJob: torchrun train/main.py, which reads PET_*",
    "SLURM_STEP_NUM_NODES": "SLURM: one launcher per node, as scripts/slurm/accelerate_2node.sbatch",
    "SKYPILOT_NUM_NODES": (
        "SkyPilot: torchrun --nnodes $SKYPILOT_NUM_NODES --node_rank $SKYPILOT_NODE_RANK "
        "--master_addr <the first of $SKYPILOT_NODE_IPS> train/main.py"
    ),
}


def check_launch(environ=os.environ) -> None:
    """No silent world size 1: a multi-node environment whose process was started alone (e.g.
    accelerate launch, which ignores PET_*, or python train/main.py under srun) would train one copy
    per node, each overwriting the others' files."""
    if int(environ.get("WORLD_SIZE") or 1) > 1:
        return
    said = []
    for name, launch in MULTI_NODE_ENGINES.items():
        if name.startswith("SLURM") and "SLURM_STEP_ID" not in environ:
            continue  # the batch script itself, not a job step
        if int(environ.get(name) or 1) > 1:
            said.append((f"{name}={environ[name]}", launch))
    if "MASTER_ADDR" in environ and "WORLD_SIZE" not in environ:
        said.append(
            (f"MASTER_ADDR={environ['MASTER_ADDR']} without WORLD_SIZE", "a launcher sets both")
        )
    if said:
        found = ", ".join(name for name, _ in said)
        raise ConfigError(
            f"a multi-node environment ({found}) started this process at world size 1: every node "
            f"would train alone and overwrite the others' files; launch it with {said[0][1]}"
        )


def check_model_and_tokenizer(cfg) -> None:
    """Resolve a Hugging Face model's config and tokenizer now (small files, or the local cache
    offline): a wrong name, or a tokenizer the model cannot embed, is one line before any process
    group or download of weights."""
    if not uses_hub_model(cfg) and cfg.tokenizer_name == "bytes":
        return
    model_config = None
    if uses_hub_model(cfg):
        from transformers import AutoConfig

        try:
            model_config = AutoConfig.from_pretrained(cfg.hf_model)
        except Exception as e:  # offline, a wrong name or folder, no access
            raise ConfigError(
                f"hf_model '{cfg.hf_model}' could not be loaded: {first_line(e)}"
            ) from None
    try:
        tokens = vocab_size(cfg)
    except ConfigError as e:
        default = (
            ""
            if cfg.tokenizer
            else " (the model's own, by default: pass --tokenizer NAME_OR_FOLDER)"
        )
        raise ConfigError(f"{e}{default}") from None
    if model_config is None:
        return
    if cfg.model_weights == "pretrained" and os.path.isdir(cfg.hf_model):
        check_model_folder(cfg.hf_model, model_config)
    embedded = model_config.vocab_size
    if tokens > embedded:
        raise ConfigError(
            f"tokenizer has {tokens} tokens, more than the {embedded} that model '{cfg.hf_model}' embeds "
            f"(got {cfg.tokenizer_name!r})"
        )
    # the shipped LM's data key (a fork's data.py may declare none)
    block_size = getattr(cfg, "block_size", None)
    positions = getattr(model_config, "max_position_embeddings", None) or block_size
    if block_size and block_size > positions:
        raise ConfigError(
            f"block_size must be <= the model's {positions} positions (got {block_size})"
        )


DATA_FILE_SUFFIXES = (".txt", ".json", ".jsonl", ".csv", ".parquet")


def check_dataset_name(dataset: str) -> None:
    """--dataset is a local file or folder, or a name for data.py (a hub dataset, a built-in
    corpus). A value that looks like a path must exist: said at once, rather than after the hub
    client's retries (26 s offline)."""
    if dataset == "":
        raise ConfigError("dataset must not be empty (got '')")
    if os.path.exists(dataset):
        return
    first_part = dataset.split("/")[0]
    looks_like_a_path = (
        dataset.startswith(("/", "./", "../", "~"))
        or dataset.endswith(DATA_FILE_SUFFIXES)
        or dataset.count("/") > 1
        or ("/" in dataset and os.path.isdir(first_part))
    )
    if not looks_like_a_path:
        if "/" in dataset:  # owner/name: a hub dataset
            check_hub_dataset(dataset)
        return
    hint = ""
    if os.path.isdir(first_part):
        hint = f" (there is a local folder '{first_part}/': a typo in the path?)"
    raise ConfigError(f"dataset is not an existing file or folder{hint} (got {dataset!r})")


def unreadable_data(dataset: str, error: Exception) -> ConfigError:
    """One line for data that cannot be read, naming the file and line at fault when the reader does not
    (a local JSON lines file: the first line that does not parse)."""
    where = ""
    path = Path(dataset)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(path.rglob("*.jsonl"))
    else:
        files = []
    for file in (f for f in files if f.suffix == ".jsonl"):
        line = first_bad_json_line(file)
        if line:
            where = f" ({file}, line {line})"
            break
    cause = error.__cause__ or error
    return ConfigError(f"dataset '{dataset}' cannot be read{where}: {first_line(cause)}")


def first_bad_json_line(file: Path) -> int | None:
    with open(file, "rb") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except ValueError:
                return number
    return None


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def check_model_folder(folder: str, model_config) -> None:
    """A local Hugging Face model folder must hold weights, and (safetensors) weights of the shapes its
    config.json describes: said in one line now, not as transformers' mismatch table after the process
    group has started. The model is built on the meta device: no memory, no time."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    present = [name for name in WEIGHT_FILES if os.path.isfile(os.path.join(folder, name))]
    if not present:
        raise ConfigError(
            f"hf_model '{folder}' has a config.json and no weights ({' or '.join(WEIGHT_FILES[::2])}): pass "
            f"--model_weights config to train its architecture from fresh weights"
        )
    if present[0] == "model.safetensors":
        files = [os.path.join(folder, "model.safetensors")]
    elif present[0] == "model.safetensors.index.json":
        index = json.loads(Path(folder, present[0]).read_text())
        files = sorted({os.path.join(folder, name) for name in index["weight_map"].values()})
    else:
        return  # pickled weights: read only by loading them
    with torch.device("meta"):
        expected = {
            k: tuple(v.shape)
            for k, v in AutoModelForCausalLM.from_config(model_config).state_dict().items()
        }
    problems = []
    for file in files:
        with safe_open(file, framework="pt") as weights:
            for key in weights.keys():
                shape = tuple(weights.get_slice(key).get_shape())
                if key in expected and expected[key] != shape:
                    problems.append(f"{key} {list(shape)} vs {list(expected[key])}")
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ConfigError(
            f"hf_model '{folder}': its weights do not fit its config.json ({model_config.model_type}): "
            f"{'; '.join(problems[:3])}{more}"
        )


HUB_TIMEOUT_S = (
    5  # one question to the hub at start-up, instead of its client's retries (25 s offline)
)


def hub_is_offline() -> bool:
    return any(
        os.environ.get(v, "0") not in ("0", "") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def check_hub_dataset(name: str) -> None:
    """Ask the hub once, in at most HUB_TIMEOUT_S, whether the dataset is there. Not there: one line now.
    The hub cannot be reached: with a local copy, this process goes on offline (datasets then reads the
    copy at once); without one, one line now rather than after the client's retries."""
    if hub_is_offline():
        return
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        HfApi().dataset_info(name, timeout=HUB_TIMEOUT_S)
        return
    except RepositoryNotFoundError:
        raise ConfigError(
            f"dataset '{name}' is not on the hub (or is private or gated: log in with `hf auth login`)"
        ) from None
    except Exception as e:  # no network, a timeout, a proxy: the hub cannot be reached
        unreachable = first_line(e)
    owner, repo = name.split("/", 1)
    cached = [
        Path(constants.HF_HUB_CACHE) / f"datasets--{owner}--{repo}",
        Path(os.environ.get("HF_DATASETS_CACHE", Path(constants.HF_HOME) / "datasets"))
        / f"{owner}___{repo}",
    ]
    if not any(folder.exists() for folder in cached):
        raise ConfigError(
            f"dataset '{name}' could not be loaded: the hub cannot be reached ({unreachable}) and there is no "
            f"local copy (set HF_HUB_OFFLINE=1 to use the cache without asking the hub)"
        )
    os.environ["HF_HUB_OFFLINE"] = "1"  # read by datasets when it is imported, after this check
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
