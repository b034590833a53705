"""TrainConfig: every knob of the template's, typed, with its default, its meaning (the comment above
it, which `--help` shows) and its checks.

Every value's type and range is checked in `validate()`; what needs a file or the hub (a dataset,
model or tokenizer name, a checkpoint to resume) is checked next by job.load_checked_config, still
before any process group, port or output folder exists. A bad value is a ConfigError: one line
naming the key (`error: ...`, exit code 2). How a run's config is put together from YAML files and
flags, with the fork's own keys (model.py's ModelConfig, data.py's DataConfig) joined to these:
run_config.py. This module reads no file and imports nothing of the fork's."""

from __future__ import annotations

import os
from dataclasses import dataclass

from errors import ConfigError
from run_folder import RunFolder, is_url
from sources import Source

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
    # a local file/folder or a hub name; or a weighted mixture of several:
    # "a.jsonl:0.7,owner/name@config:0.3", or in YAML a list of {path, weight, name, config, split,
    # text_column} (docs/data.md). "" = data.py's own default (the shipped LM's: python_stdlib, an
    # offline corpus), or none
    dataset: str = ""
    # hub dataset configuration name, if it has several
    dataset_config: str = ""
    # the split to train on; eval reads the source's validation (or test) split, else holds out
    # eval_fraction of this one
    dataset_split: str = "train"
    # share of documents held out when the dataset has no validation split
    eval_fraction: float = 0.05
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
    # LoRA scale: the update is lora_alpha / lora_r x B A; 0 = not given: 16 (a value given needs
    # lora_r > 0, as lora_dropout and lora_targets do)
    lora_alpha: float = 0.0
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
        _require("dataset_split", self.dataset_split != "", "must not be empty", self.dataset_split)
        if self.optimizer == "muon" and self.fsdp != "no":
            raise ConfigError(MUON_UNDER_FSDP)
        _require("lora_alpha", self.lora_alpha >= 0, "must be > 0 (0: not given)", self.lora_alpha)
        # given without adapters, they would change nothing: a full fine-tune, unsaid
        for key in ("lora_alpha", "lora_dropout", "lora_targets", "merge_adapter"):
            adapters_given = getattr(self, key) and not self.lora_r
            _require(key, not adapters_given, ADAPTERS_ONLY, getattr(self, key))
        factor_ok = self.straggler_factor > 1
        _require("straggler_factor", factor_ok, "must be > 1", self.straggler_factor)


# ---------------------------------------------------------------- what validate() checks

POSITIVE = (
    "max_steps",
    "batch_size",
    "grad_accum_steps",
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


ADAPTERS_ONLY = "needs lora_r > 0 (lora_r 0 trains every weight, without adapters)"
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
