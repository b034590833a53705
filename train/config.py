"""TrainConfig: every knob of a run, typed, loadable from YAML, overridable on the command line.

    python train/main.py --config train/configs/tiny.yaml --lr 3e-4 --max_steps 200

Precedence: dataclass defaults < --config YAML < --key value flags. Every value's type and range is
checked in `validate()`; what needs a file or the hub (a dataset, model or tokenizer name, a
checkpoint to resume) is checked next by job.load_checked_config, still before any process group, port or
output folder exists. A bad value is a ConfigError: one line naming the key (`error: ...`, exit code
2). `--help` lists every key with the comment written next to it below. The task's own keys (the
GPT's sizes, a classifier's image size) are declared in the fork's files, model.py's ModelConfig and
data.py's DataConfig, and join these in `config_class()`. This module reads nothing but the YAML
file it is given."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import os
import re
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from errors import ConfigError
from run_folder import LAYOUT, RunFolder, is_url, numbered_run, run_numbers
from sources import Source, parse_dataset
from task import fork_settings

TRACKERS = ("none", "wandb", "tensorboard")


# frozen: a value is settled once (a changed value is a new config, dataclasses.replace), in
# main.train before the loop: the run folder, then the LR horizon a resume keeps
@dataclass(frozen=True)
class TrainConfig:
    # ---- run
    # the run folder; "" = a new runs/run_NNN (with --resume latest: the newest one); or object
    # storage, any fsspec URL: s3://bucket/run, gs://... (train/storage.py)
    output_dir: str = ""
    # a run on object storage is written in this node's folder first, then uploaded; "" = one named
    # after output_dir in the system's temporary folder
    staging_dir: str = ""
    # a run on object storage: the deadline of each checkpoint's upload, and of any other exchange
    # with the store; past it the run says so in one line and exits 1. 0 = derived: 120 s, plus
    # 1 s per 20 MB of the files (a store slower than that is not answering) (train/storage.py)
    upload_timeout_s: int = 0
    # a run on object storage: one job per URL, kept by a lease object the job renews every third
    # of this; a requeued job waits up to this long for the lease of a job that was killed
    store_lease_s: int = 30
    # model init, data order and dropout all derive from it
    seed: int = 1337
    # "" = start fresh, "latest" = newest complete checkpoint in output_dir (or fresh), or a folder
    resume: str = ""
    # with --resume latest: refuse (exit 2) when the run holds no checkpoint, instead of starting
    # fresh (a requeue that must continue; a mistyped --output_dir)
    require_resume: bool = False
    # start a NEW run (step 0, new optimizer) from these weights: a checkpoint, run folder or file
    init_from: str = ""
    # ---- tracking
    # none | wandb | tensorboard, or several comma-separated ("wandb,tensorboard")
    tracker: str = "none"
    # W&B / TensorBoard project name (WANDB_PROJECT wins if set)
    project: str = "accelerate-template"
    # "" = the last part of output_dir
    run_name: str = ""
    # W&B team or user; "" = WANDB_ENTITY or your default entity
    wandb_entity: str = ""
    # comma-separated W&B tags
    wandb_tags: str = ""
    # W&B group, e.g. one name for the runs of a sweep
    wandb_group: str = ""
    # ---- data
    # "python_stdlib" (offline corpus), a local file/folder, or a hub name; or a weighted mixture of
    # several: "a.jsonl:0.7,owner/name@config:0.3", or in YAML a list of {path, weight, name, config,
    # split, text_column} (docs/data.md)
    dataset: str = "python_stdlib"
    # hub dataset configuration name, if it has several
    dataset_config: str = ""
    # the split to train on; eval reads the source's validation (or test) split, else holds out
    # eval_fraction of this one
    dataset_split: str = "train"
    # the column holding the raw text
    text_column: str = "text"
    # share of documents held out when the dataset has no validation split
    eval_fraction: float = 0.05
    # tokens (bytes) per training sample
    block_size: int = 128
    # DataLoader worker processes per rank; 0 loads in the training process
    num_workers: int = 0
    # read the dataset as a stream (bigger than memory or disk), packed as it is read
    streaming: bool = False
    # streaming: blocks held per process to draw from at random
    shuffle_buffer: int = 1000
    # streaming: the eval set is the first this many blocks of held-out text
    streaming_eval_blocks: int = 256
    # ---- model
    # a Hugging Face model for model.py to build, hub name or local folder (the shipped model.py:
    # a causal LM); "" = model.py's own (the shipped one: the GPT sized below)
    hf_model: str = ""
    # Hugging Face models: pretrained (fine-tune) | config (fresh weights: pretrain)
    model_weights: str = "pretrained"
    # "" = the hf_model's own (or bytes); bytes; or a Hugging Face tokenizer: hub name or folder
    tokenizer: str = ""
    # ---- adapters (adapters.py; peft's LoRA)
    # LoRA rank: > 0 trains low-rank adapters on the frozen model (only they sit in the optimizer
    # and the checkpoints); 0 = every weight trains
    lora_r: int = 0
    # LoRA scale: the update is lora_alpha / lora_r x B A
    lora_alpha: float = 16.0
    # dropout on the adapters' input
    lora_dropout: float = 0.0
    # the linear layers that get an adapter, comma-separated module names (matched as peft does: the
    # name or its last parts, e.g. q_proj,v_proj); "" = every linear layer in the transformer blocks
    # (attention and MLP projections)
    lora_targets: str = ""
    # with lora_r: export the adapter merged into the weights, loaded as the base model is (else the
    # adapter alone: adapter_model.safetensors + adapter_config.json, for PeftModel.from_pretrained)
    merge_adapter: bool = False
    # torch.compile each transformer block, keeping the compiled code in the run folder for a resume
    # (compiling.py): auto = on with CUDA, off on CPU; true | false
    compile: str = "auto"
    # ---- optimisation
    # optimizer steps of the whole run
    max_steps: int = 300
    # samples per process and micro-step; global batch = batch_size * grad_accum_steps * processes
    batch_size: int = 16
    # micro-steps per optimizer step
    grad_accum_steps: int = 1
    # peak learning rate, reached after warmup_steps, then cosine to min_lr at lr_decay_steps
    lr: float = 2e-3
    # final learning rate, ~lr/10 as in Chinchilla
    min_lr: float = 2e-4
    # the schedule's horizon (min_lr from there on); 0 = max_steps of the run's first start, which a
    # resume keeps, so raising max_steps extends a run at min_lr (set this to stretch)
    lr_decay_steps: int = 0
    # linear warmup from 0 to lr; -1 = lr_decay_steps // 10
    warmup_steps: int = -1
    # AdamW decay on matmul/embedding weights only; biases and norms are not decayed
    weight_decay: float = 0.1
    # AdamW
    beta1: float = 0.9
    # AdamW; 0.95 is the usual choice for transformers
    beta2: float = 0.95
    # adamw | muon: Muon (torch.optim.Muon) on the transformer blocks' weight matrices, AdamW (lr,
    # beta1, beta2, weight_decay) on embeddings, head, norms and biases; both follow one schedule
    optimizer: str = "adamw"
    # muon: peak learning rate of the Muon matrices (min_lr and warmup scale with it)
    muon_lr: float = 0.02
    # muon: momentum (Nesterov)
    muon_momentum: float = 0.95
    # muon: decoupled weight decay of the Muon matrices
    muon_weight_decay: float = 0.0
    # clip the global grad norm to this; 0 disables clipping
    max_grad_norm: float = 1.0
    # "" = the launcher's (accelerate config or --mixed_precision, else no); no | bf16 | fp16 set
    # here, it wins over the launcher (fp16 needs a GPU and uses a grad scaler)
    mixed_precision: str = ""
    # ---- cadence
    # steps between metrics.jsonl rows / tracker logs
    log_every: int = 10
    # steps between evaluations on the whole eval set (also run at the last step)
    eval_every: int = 100
    # steps between checkpoints (also saved at the last step); 0 = only at the end
    save_every: int = 100
    # complete checkpoints kept; older ones are deleted after a newer one is committed
    keep_last: int = 2
    # write checkpoints in the background: training waits only for a copy to CPU memory, and the
    # checkpoint is published at a later logging step once every process has written it (saving.py)
    async_save: bool = True
    # ---- standard evaluations (lm-evaluation-harness: pip install -r requirements-eval.txt)
    # harness tasks run on the export at the end of training, comma-separated, e.g.
    # hellaswag,arc_easy; scripts/evaluate.py runs them on any run or checkpoint later
    eval_tasks: str = ""
    # a folder (or file) of your own harness task YAMLs, for eval_tasks
    eval_task_path: str = ""
    # at most this many examples of each task; 0 = all
    eval_limit: int = 0
    # ---- profiling (profiling.py)
    # START:END: a torch.profiler trace of steps START to END (both included) per rank, in
    # <output_dir>/profile (Chrome trace; TensorBoard reads it); on CUDA also their memory history.
    # "" = off; outside the window it costs nothing
    profile_steps: str = ""
    # CUDA: record the memory history from the first step and write it when the GPU runs out of
    # memory, before the error line (pytorch.org/memory_viz shows what held the memory)
    oom_snapshot: bool = False
    # ---- distributed
    # collective timeout at start-up (data preparation, the first step), saves and the export; raise
    # it if one node prepares data much longer than others
    dist_timeout_s: int = 1800
    # collective timeout of a training step: a rank that stops calling collectives is caught and
    # named this soon (hangs.py)
    step_timeout_s: int = 300
    # metrics.jsonl names a rank straggler_rank when its time alone in a step (data, forward) is this
    # many times the median of the other ranks
    straggler_factor: float = 2.0
    # no (DDP) | full (FSDP2: each block and the root sharded over all processes) | hybrid (HSDP:
    # sharded in a node, replicated across nodes); both paths, any launcher (main.py: GPUs; "no"
    # there leaves it to an accelerate config's fsdp_config) (sharding.py)
    fsdp: str = "no"
    # recompute each block's activations in backward: less memory, ~1/3 slower
    activation_checkpointing: bool = False
    # DDP: true only if some parameters get no gradient in a step (slower)
    find_unused_parameters: bool = False
    # DDP: the same parameters get gradients every step; skips per-step bookkeeping
    static_graph: bool = False
    # DDP: gradients are views into the all-reduce buckets: less memory
    gradient_as_bucket_view: bool = False
    # DDP: all-reduce bucket size; bigger suits fast links, smaller overlaps more of backward
    bucket_cap_mb: int = 25
    # DDP: copy rank 0's buffers (BatchNorm statistics) to all ranks at each forward; false: each
    # rank keeps and checkpoints its own, evaluated and exported as their mean (train/buffers.py)
    broadcast_buffers: bool = True
    # BatchNorm's batch statistics over every rank's samples (SyncBatchNorm; CUDA GPUs only)
    sync_batchnorm: bool = False
    # output_dir and the HF cache are one filesystem all nodes see (NFS, Lustre); false: node-local
    # disks, data prepared and checkpoints kept on every node
    shared_filesystem: bool = True

    @property
    def run_label(self) -> str:
        return self.run_name or os.path.basename(os.path.normpath(self.output_dir))

    @property
    def run_dir(self) -> str:
        """The local folder this process writes the run in: output_dir, or for a run on object
        storage this node's staging folder (run_folder.RunFolder.local)."""
        return str(RunFolder.of(self).local)

    @property
    def mixture(self) -> tuple[Source, ...]:
        """The sources of a mixed dataset; () for one."""
        return self.dataset if isinstance(self.dataset, tuple) else ()

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer or self.hf_model or "bytes"

    def global_batch(self, num_processes: int) -> int:
        """Samples per optimizer step, over all processes: the one place it is computed."""
        return self.batch_size * self.grad_accum_steps * num_processes

    @property
    def decay_steps(self) -> int:
        return self.lr_decay_steps or self.max_steps

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps >= 0 else self.decay_steps // 10

    def ddp_options(self) -> dict:
        """DistributedDataParallel's keyword arguments on both plumbings: those set away from their
        defaults (DDP's own), as accelerate passes them (torch 2.13 warns that broadcast_buffers is
        deprecated whenever it is given)."""
        keys = (
            "find_unused_parameters",
            "static_graph",
            "gradient_as_bucket_view",
            "bucket_cap_mb",
            "broadcast_buffers",
        )
        return {
            key: getattr(self, key)
            for key in keys
            if getattr(self, key) != getattr(TrainConfig, key)
        }

    def trackers(self) -> list[str]:
        return [t for t in self.tracker.split(",") if t and t != "none"]

    def validate(self) -> None:
        """Raise ConfigError on the first bad value, naming its key."""
        for key in POSITIVE:
            _require(key, getattr(self, key) > 0, "must be > 0", getattr(self, key))
        for key in NON_NEGATIVE:
            _require(key, getattr(self, key) >= 0, "must be >= 0", getattr(self, key))
        for key, (low, high, shown) in INTERVALS.items():
            value = getattr(self, key)
            inside = low <= value < high if shown.startswith("[") else low < value < high
            _require(key, inside, f"must be in {shown}", value)
        for key, choices in CHOICES.items():
            _require(
                key, getattr(self, key) in choices, choices_problem(choices), getattr(self, key)
            )
        for name in self.tracker.split(","):
            allowed = f"entries must be among {', '.join(TRACKERS)}"
            _require("tracker", name in TRACKERS, allowed, self.tracker)
        self._validate_relations()

    def _validate_relations(self) -> None:
        """The checks that involve two keys."""
        _require("min_lr", self.min_lr <= self.lr, f"must be <= lr ({self.lr})", self.min_lr)
        horizon = f"max_steps ({self.max_steps})"
        if self.lr_decay_steps:
            horizon = f"lr_decay_steps ({self.lr_decay_steps})"
        warmup_ok = -1 <= self.warmup_steps < self.decay_steps
        warmup_problem = f"must be -1 (auto) or in [0, {horizon})"
        _require("warmup_steps", warmup_ok, warmup_problem, self.warmup_steps)
        sharded_needs_one_folder = self.fsdp == "no" or self.shared_filesystem
        why = "needs shared_filesystem true (every process writes its shards into one checkpoint folder)"
        _require("fsdp", sharded_needs_one_folder, why, self.fsdp)
        _require(
            "staging_dir", not is_url(self.staging_dir), "must be a local folder", self.staging_dir
        )
        workers_ok = not (self.streaming and self.num_workers)
        why = "must be 0 with streaming (the stream is read in the training process, where its position is saved)"
        _require("num_workers", workers_ok, why, self.num_workers)
        _require("text_column", self.text_column != "", "must not be empty", self.text_column)
        _require("dataset_split", self.dataset_split != "", "must not be empty", self.dataset_split)
        if self.optimizer == "muon" and self.fsdp != "no":
            raise ConfigError(MUON_UNDER_FSDP)
        if self.lora_r:
            _require("lora_alpha", self.lora_alpha > 0, "must be > 0", self.lora_alpha)
        merging_needs_lora = not self.merge_adapter or self.lora_r > 0
        _require("merge_adapter", merging_needs_lora, "needs lora_r > 0", self.merge_adapter)
        factor_ok = self.straggler_factor > 1
        _require("straggler_factor", factor_ok, "must be > 1", self.straggler_factor)


# ---------------------------------------------------------------- what validate() checks

POSITIVE = (
    "max_steps",
    "batch_size",
    "grad_accum_steps",
    "block_size",
    "log_every",
    "eval_every",
    "keep_last",
    "dist_timeout_s",
    "step_timeout_s",
    "bucket_cap_mb",
    "shuffle_buffer",
    "streaming_eval_blocks",
    "store_lease_s",
    "lr",
    "muon_lr",
)
NON_NEGATIVE = (
    "weight_decay",
    "max_grad_norm",
    "save_every",
    "num_workers",
    "min_lr",
    "lr_decay_steps",
    "muon_weight_decay",
    "eval_limit",
    "upload_timeout_s",
    "lora_r",
)
INTERVALS = {  # key: (low, high, as the error shows it)
    "eval_fraction": (0, 1, "(0, 1)"),
    "beta1": (0, 1, "[0, 1)"),
    "beta2": (0, 1, "[0, 1)"),
    "muon_momentum": (0, 1, "[0, 1)"),
    "lora_dropout": (0, 1, "[0, 1)"),
}
CHOICES = {
    "mixed_precision": ("", "no", "bf16", "fp16"),
    "fsdp": ("no", "full", "hybrid"),
    "model_weights": ("pretrained", "config"),
    "compile": ("auto", "true", "false"),
    "optimizer": ("adamw", "muon"),
}


# keys an earlier version had, under their new names
# the shipped GPT's own keys (train/model.py's ModelConfig as the template ships it; a test holds the two
# equal): after a fork they are not keys, and the line that refuses one says whose they are
SHIPPED_MODEL_KEYS = ("n_layer", "n_head", "n_embd", "dropout", "bias")
SHIPPED_MODEL_SECTION = "gpt"  # a preset's section of them (train/configs/*.yaml)
RENAMED = {
    "model": "hf_model: a Hugging Face model's hub name or folder; leave it out for model.py's own"
}

MUON_UNDER_FSDP = (
    "optimizer muon cannot run under FSDP: Muon orthogonalizes each whole weight matrix, and FSDP2 "
    "gives each process a shard of it (train with DDP, or with optimizer adamw)"
)


def choices_problem(choices: tuple) -> str:
    named = [choice for choice in choices if choice]
    problem = f"must be one of {', '.join(named)}"
    if "" in choices:
        problem += " (or '' for the launcher's)"
    return problem


def _require(key: str, ok: bool, problem: str, value) -> None:
    if not ok:
        raise ConfigError(f"{key} {problem} (got {value!r})")


# ---------------------------------------------------------------- loading


def load_config(argv: list[str] | None = None) -> TrainConfig:
    """Defaults < the run's own config.yaml (a resume: --resume with the run folder it names) <
    --config YAML < --key value flags. Raises ConfigError on any bad key or value, naming the file a
    key came from."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(usage())  # noqa: T201 - --help is for the terminal
        sys.exit(0)
    config_file, overrides = _split_argv(argv)
    run_config = config_class()
    types = {f.name: f.type for f in fields(run_config)}
    from_file = (
        shipped_model_section(_read_yaml(config_file), config_file, types) if config_file else {}
    )
    # a resume continues the run as it was configured: the commands a run prints need no --config
    saved_path, saved = resumed_run_config({**from_file, **overrides})
    values = {**saved, **from_file, **overrides}
    # where each key came from, for the line that refuses it (a flag: the line itself)
    source = {key: f" in {saved_path}" for key in saved} | {
        key: f" in {config_file}" for key in from_file
    }
    source |= {key: "" for key in overrides}
    typed = {}
    for key, raw in values.items():
        if key not in types:
            raise ConfigError(f"unknown key '{key}'{source[key]}{unknown_key_hint(key, types)}")
        typed[key] = coerce(key, raw, types[key])
    cfg = run_config(**typed)
    cfg.validate()
    return cfg


def resumed_run_config(given: dict) -> tuple[str, dict]:
    """A resume's run folder's config.yaml, as (its path, its values): the defaults a resume
    starts from, so that `--output_dir RUN --resume latest` continues RUN as it was launched. ("",
    {}) when not resuming, or when the run has no config.yaml yet (a first start that stopped
    early)."""
    if not given.get("resume"):
        return "", {}
    output_dir = str(given.get("output_dir") or "")
    if not output_dir and given["resume"] == "latest" and run_numbers():
        output_dir = numbered_run(max(run_numbers()))  # the run --resume latest will take
    if not output_dir:
        return "", {}
    folder = RunFolder(output_dir)
    path = f"{output_dir.rstrip('/')}/{LAYOUT['config']}"
    if folder.on_bucket:
        text = read_from_store(path)
    else:
        text = Path(path).read_text() if Path(path).is_file() else None
    if text is None:
        return "", {}
    values = yaml.safe_load(text) or {}
    # never carried over: how this start resumes is this command's to say
    for key in ("resume", "require_resume", "init_from"):
        values.pop(key, None)
    return f"{path} (the run's own config, which a resume starts from)", values


def read_from_store(url: str) -> str | None:
    """A small file on object storage (fsspec), or None where it cannot be read: the checks that
    follow (storage.check_output_dir) say why in their own line."""
    try:
        import fsspec

        with fsspec.open(url, "r") as f:
            return f.read()
    except Exception:  # noqa: BLE001 - any store's failure: nothing to start from
        return None


def shipped_model_section(values: dict, path: str, known) -> dict:
    """A preset's keys, flat. Its `gpt:` section holds the shipped GPT's sizes (train/model.py's
    ModelConfig as the template ships it): they apply while model.py declares them, and a fork's
    model.py that does not runs without them, saying so in one line (the presets work after any
    fork). Any other key in the section is refused as an unknown key would be."""
    section = values.pop(SHIPPED_MODEL_SECTION, None) or {}
    if not isinstance(section, dict):
        raise ConfigError(
            f"config: {path}'s {SHIPPED_MODEL_SECTION}: section must be a mapping of key: value"
        )
    left_out = [key for key in section if key not in known and key in SHIPPED_MODEL_KEYS]
    if left_out and os.environ.get("RANK", "0") == "0":
        print(  # noqa: T201 - said once, before anything starts
            f"note: {path}'s {SHIPPED_MODEL_SECTION}: section ({', '.join(left_out)}) sizes the shipped "
            f"GPT; this train/model.py does not declare those keys, so they are left out",
            file=sys.stderr,
        )
    applied = {key: value for key, value in section.items() if key not in left_out}
    return {**values, **applied}


def unknown_key_hint(key: str, known) -> str:
    """Where a key went (a renamed one), whose it is (the shipped GPT's, after a fork), or the
    closest known key."""
    renamed = dict(RENAMED)
    for settings in fork_settings().values():
        renamed.update(getattr(settings, "RENAMED", {}))
    if key in renamed:
        return f" (renamed {renamed[key]})"
    if key in SHIPPED_MODEL_KEYS:
        return (
            f": a key of the shipped GPT (train/model.py's ModelConfig as the template ships it), which "
            f"this train/model.py does not declare (a preset keeps them in its {SHIPPED_MODEL_SECTION}: section)"
        )
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


@functools.cache
def config_class() -> type:
    """The run's config: TrainConfig's keys and the fork's own, the fields of model.py's
    ModelConfig and data.py's DataConfig (task.py finds them), as one frozen dataclass. Every key
    is then the same: a YAML key, a --flag, a --help line, saved in config.yaml and compared on
    resume."""
    settings = fork_settings()
    if not settings:
        return TrainConfig
    taken = {f.name: "TrainConfig" for f in fields(TrainConfig)}
    added = []
    for module_name, declared in settings.items():
        where = f"{module_name}.py's {declared.__name__}"
        if not dataclasses.is_dataclass(declared):
            raise ConfigError(f"train/{where} must be a @dataclass of the task's own config keys")
        for f in fields(declared):
            if f.name in taken:
                raise ConfigError(
                    f"train/{where}: key '{f.name}' is already {taken[f.name]}'s: name it otherwise"
                )
            type_name = type_name_of(f)
            if type_name not in ("int", "float", "str", "bool"):
                raise ConfigError(
                    f"train/{where}: key '{f.name}' must be an int, float, str or bool (got {f.type})"
                )
            taken[f.name] = where
            added.append((f.name, type_name, dataclasses.field(default=f.default)))
    return dataclasses.make_dataclass("RunConfig", added, bases=(TrainConfig,), frozen=True)


def saved_config(path) -> TrainConfig:
    """The config a run saved (its config.yaml), unchecked: its data need not exist where the
    weights are used. Keys this version does not know are left out."""
    values = _read_yaml(str(path))
    run_config = config_class()
    known = {f.name for f in fields(run_config)}
    values = {key: value for key, value in values.items() if key in known}
    if "dataset" in values:
        values["dataset"] = parse_dataset(values["dataset"])
    return run_config(**values)


def _split_argv(argv: list[str]) -> tuple[str | None, dict[str, str]]:
    config_file = None
    overrides = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}' (flags look like --key value)")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                given = f"; got the next flag {argv[i + 1]}" if i + 1 < len(argv) else ""
                raise ConfigError(f"{key} needs a value (--{key} VALUE{given})")
            value, i = argv[i + 1], i + 1
        if key == "config":
            config_file = value
        else:
            overrides[key] = value
        i += 1
    return config_file, overrides


def _read_yaml(path: str) -> dict:
    try:
        with open(path) as f:
            values = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"config: cannot read '{path}': {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config: {where}: invalid YAML: {problem}") from None
    if not isinstance(values, (dict, type(None))):  # None: an empty file
        raise ConfigError(
            f"config: {path} must hold a mapping of key: value, not {type(values).__name__}"
        )
    return values or {}


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def coerce(key: str, raw, type_name: str):
    """Turn a YAML value or a CLI string into the field's type, or raise ConfigError naming the
    key."""
    if key == "dataset":
        return parse_dataset(raw)
    exact = not isinstance(raw, bool)  # YAML's true is no number, and no string either
    if type_name == "bool" and (not exact or str(raw).lower() in _TRUE + _FALSE):
        return raw if not exact else str(raw).lower() in _TRUE
    if (
        type_name == "int"
        and exact
        and not isinstance(raw, float)
        and re.fullmatch(r"[+-]?\d+", str(raw).strip())
    ):
        return int(raw)
    if type_name == "float" and exact and isinstance(raw, (int, float, str)):
        try:
            return float(raw)
        except ValueError:
            pass
    if type_name == "str" and isinstance(raw, bool):  # YAML's true, for a key like compile
        return str(raw).lower()
    if type_name == "str" and (raw is None or exact and isinstance(raw, (str, int, float))):
        return "" if raw is None else str(raw)
    raise ConfigError(
        f"{key} must be {'an' if type_name == 'int' else 'a'} {type_name} (got {raw!r})"
    )


def usage() -> str:
    """--help text: each key with its type, default and the comment above it in TrainConfig, then
    the fork's own keys (model.py's ModelConfig, data.py's DataConfig) the same way."""
    program = (
        os.path.relpath(sys.argv[0])
        if sys.argv and sys.argv[0].endswith(".py")
        else "train/main.py"
    )
    lines = [f"usage: {program} [--config FILE.yaml] [--key value ...]", ""]
    for module_name, declared in {"config": TrainConfig, **fork_settings()}.items():
        if declared is not TrainConfig:
            lines += ["", f"  train/{module_name}.py's {declared.__name__}:"]
        comments = comments_above_fields(declared)
        for f in fields(declared):
            lines.append(
                f"  --{f.name:<17} {type_name_of(f):<5} default {f.default!r:<24} "
                f"{comments.get(f.name, '')}"
            )
    return "\n".join(lines)


def type_name_of(field: dataclasses.Field) -> str:
    """A field's type as written: "int" (a name, under `from __future__ import annotations`, or
    the class itself)."""
    if isinstance(field.type, str):
        return field.type
    return getattr(field.type, "__name__", str(field.type))


def comments_above_fields(declared: type) -> dict[str, str]:
    """{key: the comment lines right above its field in the class's source}."""
    comments = {}
    above = []
    for line in inspect.getsource(declared).splitlines():
        comment = re.match(r"^\s+# (?!----)(.*)$", line)  # not a "# ---- section" rule
        field = re.match(r"^\s+(\w+): \w+ = ", line)
        if comment:
            above.append(comment[1])
        elif field:
            comments[field[1]] = " ".join(above)
            above = []
        else:
            above = []
    return comments
