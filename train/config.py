"""TrainConfig: every knob of a run, typed, loadable from YAML, overridable on the command line.

    python train/main.py --config train/configs/tiny.yaml --lr 3e-4 --max_steps 200

Precedence: dataclass defaults < --config YAML < --key value flags. Every value's type and range is checked in
`validate()`; what needs a file or the hub (a dataset, model or tokenizer name, a checkpoint to resume) is
checked next by job.check_inputs, still before any process group, port or output folder exists. A bad value is
a ConfigError: one line naming the key (`error: ...`, exit code 2). `--help` lists every key with the comment
written next to it below. This module reads nothing but the YAML file it is given.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import sys
from dataclasses import dataclass, fields

import yaml

from errors import ConfigError

TRACKERS = ("none", "wandb", "tensorboard")


@dataclass(frozen=True)  # settled once, after the resume decision (main.train); read-only after
class TrainConfig:
    # ---- run
    output_dir: str = ""  # the run folder; "" = a new runs/run_NNN (with --resume latest: the newest one)
    seed: int = 1337  # model init, data order and dropout all derive from it
    resume: str = ""  # "" = start fresh, "latest" = newest complete checkpoint in output_dir (or fresh), or a folder
    init_from: str = ""  # start a NEW run (step 0, new optimizer) from these weights: a checkpoint, run folder or file
    # ---- tracking
    tracker: str = "none"  # none | wandb | tensorboard, or several comma-separated ("wandb,tensorboard")
    project: str = "accelerate-template"  # W&B / TensorBoard project name (WANDB_PROJECT wins if set)
    run_name: str = ""  # "" = the last part of output_dir
    wandb_entity: str = ""  # W&B team or user; "" = WANDB_ENTITY or your default entity
    wandb_tags: str = ""  # comma-separated W&B tags
    wandb_group: str = ""  # W&B group, e.g. one name for the runs of a sweep
    # ---- data
    dataset: str = "python_stdlib"  # "python_stdlib" (offline corpus), a local file/folder, or a hub name
    dataset_config: str = ""  # hub dataset configuration name, if it has several
    text_column: str = "text"  # the column holding the raw text
    eval_fraction: float = 0.05  # share of documents held out when the dataset has no validation split
    block_size: int = 128  # tokens (bytes) per training sample
    num_workers: int = 0  # DataLoader worker processes per rank; 0 loads in the training process
    streaming: bool = False  # read the dataset as a stream (bigger than memory or disk), packed as it is read
    shuffle_buffer: int = 1000  # streaming: blocks held per process to draw from at random
    streaming_eval_blocks: int = 256  # streaming: the eval set is the first this many blocks of held-out text
    # ---- model
    model: str = "gpt"  # gpt (the built-in, sized below) or a Hugging Face causal LM: hub name or local folder
    model_weights: str = "pretrained"  # Hugging Face models: pretrained (fine-tune) | config (fresh weights: pretrain)
    tokenizer: str = ""  # "" = the model's own (gpt: bytes); bytes; or a Hugging Face tokenizer: hub name or folder
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads; must divide n_embd
    n_embd: int = 128  # width of the residual stream
    dropout: float = 0.0  # 0.0 for pretraining, 0.1+ when fine-tuning small data
    bias: bool = False  # gpt: biases in its linear and norm layers, as GPT-2 has; without them (nanoGPT's default)
    #                     it trains as well and 3% faster on CPU, with half the parameter tensors
    compile: bool = False  # torch.compile the model (GPU; needs a working compiler toolchain)
    # ---- optimisation
    max_steps: int = 300  # optimizer steps of the whole run
    batch_size: int = 16  # samples per process and micro-step; global batch = batch_size * grad_accum_steps * processes
    grad_accum_steps: int = 1  # micro-steps per optimizer step
    lr: float = 2e-3  # peak learning rate, reached after warmup_steps, then cosine to min_lr at lr_decay_steps
    min_lr: float = 2e-4  # final learning rate, ~lr/10 as in Chinchilla
    lr_decay_steps: int = 0  # the schedule's horizon (min_lr from there on); 0 = max_steps of the run's first start,
    #                          which a resume keeps, so raising max_steps extends a run at min_lr (set this to stretch)
    warmup_steps: int = -1  # linear warmup from 0 to lr; -1 = lr_decay_steps // 10
    weight_decay: float = 0.1  # AdamW decay on matmul/embedding weights only; biases and norms are not decayed
    beta1: float = 0.9  # AdamW
    beta2: float = 0.95  # AdamW; 0.95 is the usual choice for transformers
    max_grad_norm: float = 1.0  # clip the global grad norm to this; 0 disables clipping
    mixed_precision: str = ""  # "" = the launcher's (accelerate config or --mixed_precision, else no); no | bf16 | fp16
    #                             set here, it wins over the launcher (fp16 needs a GPU and uses a grad scaler)
    # ---- cadence
    log_every: int = 10  # steps between metrics.jsonl rows / tracker logs
    eval_every: int = 100  # steps between evaluations on the whole eval set (also run at the last step)
    save_every: int = 100  # steps between checkpoints (also saved at the last step); 0 = only at the end
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted after a newer one is committed
    # ---- distributed
    dist_timeout_s: int = 1800  # collective timeout; raise it if one node prepares data much longer than others
    fsdp: str = "no"  # torch_ddp.py: no (DDP) | full (FSDP2: each block and the root sharded over all processes)
    #                   | hybrid (HSDP: sharded in a node, replicated across nodes); main.py: the accelerate config's
    activation_checkpointing: bool = False  # recompute each block's activations in backward: less memory, ~1/3 slower
    find_unused_parameters: bool = False  # DDP: true only if some parameters get no gradient in a step (slower)
    static_graph: bool = False  # DDP: the same parameters get gradients every step; skips per-step bookkeeping
    gradient_as_bucket_view: bool = False  # DDP: gradients are views into the all-reduce buckets: less memory
    bucket_cap_mb: int = 25  # DDP: all-reduce bucket size; bigger suits fast links, smaller overlaps more of backward
    broadcast_buffers: bool = True  # DDP: copy rank 0's buffers (BatchNorm statistics) to all ranks at each forward
    shared_filesystem: bool = True  # output_dir and the HF cache are one filesystem all nodes see (NFS, Lustre);
    #                                 false: node-local disks, data prepared and checkpoints kept on every node

    @property
    def run_label(self) -> str:
        return self.run_name or os.path.basename(os.path.normpath(self.output_dir))

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer or ("bytes" if self.model == "gpt" else self.model)

    @property
    def decay_steps(self) -> int:
        return self.lr_decay_steps or self.max_steps

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps >= 0 else self.decay_steps // 10

    def ddp_options(self) -> dict:
        """DistributedDataParallel's keyword arguments on both plumbings: those set away from their defaults (DDP's
        own), as accelerate passes them (torch 2.13 warns that broadcast_buffers is deprecated whenever it is given)."""
        keys = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view", "bucket_cap_mb",
                "broadcast_buffers")
        return {key: getattr(self, key) for key in keys if getattr(self, key) != getattr(TrainConfig, key)}

    def trackers(self) -> list[str]:
        return [t for t in self.tracker.split(",") if t and t != "none"]

    def validate(self) -> None:
        """Raise ConfigError on the first bad value, naming its key."""
        for key in ("max_steps", "batch_size", "grad_accum_steps", "block_size", "n_layer", "n_head",
                    "n_embd", "log_every", "eval_every", "keep_last", "dist_timeout_s", "bucket_cap_mb",
                    "shuffle_buffer", "streaming_eval_blocks"):
            _require(key, getattr(self, key) > 0, "must be > 0", getattr(self, key))
        for key in ("weight_decay", "max_grad_norm", "save_every", "num_workers", "min_lr", "lr_decay_steps"):
            _require(key, getattr(self, key) >= 0, "must be >= 0", getattr(self, key))
        _require("lr", self.lr > 0, "must be > 0", self.lr)
        _require("min_lr", self.min_lr <= self.lr, f"must be <= lr ({self.lr})", self.min_lr)
        horizon = f"lr_decay_steps ({self.lr_decay_steps})" if self.lr_decay_steps else f"max_steps ({self.max_steps})"
        _require("warmup_steps", -1 <= self.warmup_steps < self.decay_steps,
                 f"must be -1 (auto) or in [0, {horizon})", self.warmup_steps)
        _require("dropout", 0 <= self.dropout < 1, "must be in [0, 1)", self.dropout)
        _require("eval_fraction", 0 < self.eval_fraction < 1, "must be in (0, 1)", self.eval_fraction)
        for key in ("beta1", "beta2"):
            _require(key, 0 <= getattr(self, key) < 1, "must be in [0, 1)", getattr(self, key))
        _require("n_embd", self.n_embd % self.n_head == 0,
                 f"must be divisible by n_head ({self.n_head})", self.n_embd)
        _require("mixed_precision", self.mixed_precision in ("", "no", "bf16", "fp16"),
                 "must be one of no, bf16, fp16 (or '' for the launcher's)", self.mixed_precision)
        _require("fsdp", self.fsdp in ("no", "full", "hybrid"), "must be one of no, full, hybrid", self.fsdp)
        _require("fsdp", self.fsdp == "no" or self.shared_filesystem, "needs shared_filesystem true (every process "
                 "writes its shards into one checkpoint folder)", self.fsdp)
        for name in self.tracker.split(","):
            _require("tracker", name in TRACKERS, f"entries must be among {', '.join(TRACKERS)}", self.tracker)
        _require("text_column", self.text_column != "", "must not be empty", self.text_column)
        _require("model_weights", self.model_weights in ("pretrained", "config"), "must be pretrained or config",
                 self.model_weights)
        _require("bias", self.model == "gpt" or not self.bias, "applies to the built-in gpt only (a Hugging Face "
                 "model's own config says whether it has biases)", self.bias)
        _require("num_workers", not (self.streaming and self.num_workers), "must be 0 with streaming (the stream "
                 "is read in the training process, where its position is saved)", self.num_workers)


def _require(key: str, ok: bool, problem: str, value) -> None:
    if not ok:
        raise ConfigError(f"{key} {problem} (got {value!r})")


# ---------------------------------------------------------------- loading


def load_config(argv: list[str] | None = None) -> TrainConfig:
    """Defaults < --config YAML < --key value flags. Raises ConfigError on any bad key or value."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(usage())  # noqa: T201 - --help is for the terminal
        sys.exit(0)
    config_file, overrides = _split_argv(argv)
    values = _read_yaml(config_file) if config_file else {}
    values.update(overrides)
    types = {f.name: f.type for f in fields(TrainConfig)}
    typed = {}
    for key, raw in values.items():
        if key not in types:
            close = difflib.get_close_matches(key, types, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown key '{key}'{hint}")
        typed[key] = _coerce(key, raw, types[key])
    cfg = TrainConfig(**typed)
    cfg.validate()
    return cfg


def saved_config(path) -> TrainConfig:
    """The config a run saved (its config.yaml), unchecked: its data need not exist where the weights are used.
    Keys this version does not know are left out."""
    values = _read_yaml(str(path))
    known = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{key: value for key, value in values.items() if key in known})


def _split_argv(argv: list[str]) -> tuple[str | None, dict[str, str]]:
    config_file, overrides, i = None, {}, 0
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
        raise ConfigError(f"config: {path} must hold a mapping of key: value, not {type(values).__name__}")
    return values or {}


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _coerce(key: str, raw, type_name: str):
    """Turn a YAML value or a CLI string into the field's type, or raise ConfigError naming the key."""
    exact = not isinstance(raw, bool)  # YAML's true is no number, and no string either
    if type_name == "bool" and (not exact or str(raw).lower() in _TRUE + _FALSE):
        return raw if not exact else str(raw).lower() in _TRUE
    if type_name == "int" and exact and not isinstance(raw, float) and re.fullmatch(r"[+-]?\d+", str(raw).strip()):
        return int(raw)
    if type_name == "float" and exact and isinstance(raw, (int, float, str)):
        try:
            return float(raw)
        except ValueError:
            pass
    if type_name == "str" and (raw is None or exact and isinstance(raw, (str, int, float))):
        return "" if raw is None else str(raw)
    raise ConfigError(f"{key} must be {'an' if type_name == 'int' else 'a'} {type_name} (got {raw!r})")


def usage() -> str:
    """--help text: each key with its type, default and the comment beside it in TrainConfig."""
    comments, key = {}, None
    for line in inspect.getsource(TrainConfig).splitlines():  # a field's comment, with its continuation lines
        if field := re.match(r"^\s+(\w+): \w+ = .*?#\s*(.*)$", line):
            key, comments[field[1]] = field[1], field[2]
        elif (more := re.match(r"^\s+#\s{2,}(.*)$", line)) and key:  # not a "# ---- section" line
            comments[key] += " " + more[1]
        else:
            key = None
    program = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else "train/main.py"
    lines = [f"usage: {program} [--config FILE.yaml] [--key value ...]", ""]
    for f in fields(TrainConfig):
        lines.append(f"  --{f.name:<17} {f.type:<5} default {f.default!r:<24} {comments.get(f.name, '')}")
    return "\n".join(lines)
