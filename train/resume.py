"""Resume: the policy. Which checkpoint (the newest intact one, or the one named), what must match
this run (global batch, block size, data, parts, world size where a part is bound to it), the
refusals, and starting a new run from --init_from's weights. Reading and writing the files is
checkpoint.py's."""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from checkpoint import (
    as_part,
    checkpoint_problem,
    load_checkpoint,
    load_weights_file,
    read_manifest,
    run_geometry,
)
from errors import CheckpointError, ConfigError, RunError
from plumbing import collectively, is_writer
from profiling import start_clock
from run_folder import LAYOUT, RunFolder
from saving import recover_interrupted_swap
from storage import open_run_folder


def check_sources(cfg) -> None:
    """--resume and --init_from name something that exists (before any process group)."""
    if cfg.resume not in ("", "latest") and not os.path.isdir(cfg.resume):
        raise ConfigError(f"resume must be '', 'latest' or an existing folder (got {cfg.resume!r})")
    if cfg.require_resume and cfg.resume != "latest":
        raise ConfigError(f"require_resume needs --resume latest (got resume {cfg.resume!r})")
    local = cfg.output_dir and not RunFolder.of(cfg).on_bucket
    if cfg.require_resume and local and not os.path.isdir(cfg.output_dir):
        raise ConfigError(
            f"output_dir '{cfg.output_dir}' does not exist, and require_resume refuses to start a "
            "new run there (mistyped?)"
        )
    if cfg.init_from and not os.path.exists(cfg.init_from):
        raise ConfigError(
            f"init_from is not an existing checkpoint, run folder or .safetensors file (got {cfg.init_from!r})"
        )


def resume_or_start(plumbing, cfg, parts: dict, identity: dict, log):
    """Restore every part from the checkpoint --resume names (or the newest intact one), or start at
    step 0 (from --init_from's weights if given). Collective; any refusal is an error on every
    process. Returns the run's config as settled by the resume (the LR horizon a resumed run
    keeps)."""
    start(plumbing, cfg, parts, identity, log)
    start_clock.lap("checkpoint load")  # the restart report's (profiling.py)
    state = parts["train_state"]
    state.lr_decay_steps = lr_horizon(cfg, state.lr_decay_steps, log)
    return replace(cfg, lr_decay_steps=state.lr_decay_steps)


def start(plumbing, cfg, parts: dict, identity: dict, log) -> None:
    """Restore the checkpoint to resume, or start fresh (or from --init_from's weights)."""
    run_folder = open_run_folder(cfg)
    writer = is_writer(plumbing, run_folder.shared)

    def recover():
        if writer:
            recover_interrupted_swap(run_folder)

    collectively(plumbing, "recovering checkpoints", recover)
    if not cfg.resume and run_folder.newest() is not None:
        raise ConfigError(
            f"output_dir '{cfg.output_dir}' already holds checkpoints; pass --resume latest to continue that "
            f"run, or choose another output_dir"
        )
    on_object_storage = run_folder.on_bucket and cfg.resume == "latest"
    if on_object_storage:  # each node's writer downloads the newest intact one (storage.py)
        with start_clock.phase("checkpoint download"):
            collectively(
                plumbing,
                f"downloading the newest checkpoint of {cfg.output_dir}",
                lambda: download_newest(plumbing, run_folder, writer, log),
                CheckpointError,
            )
    folder = collectively(
        plumbing,
        "choosing the checkpoint",
        lambda: checkpoint_to_resume(cfg, run_folder, log.warn),
        CheckpointError,
    )
    if folder is not None:
        note = collectively(
            plumbing,
            f"resuming from {folder}",
            lambda: resume_from(plumbing, cfg, folder, parts, identity),
            CheckpointError,
        )
        step = parts["train_state"].step
        check_same_step_everywhere(plumbing, step)
        if on_object_storage:
            collectively(
                plumbing, "removing the downloaded checkpoint", lambda: forget(folder, writer)
            )
            folder = run_folder.bucket.step_url(step)
        log.info(f"resume: {folder} (step {step}){note}")
        return
    start_fresh(plumbing, cfg, parts, log)


def start_fresh(plumbing, cfg, parts: dict, log) -> None:
    """No checkpoint to resume: step 0, from --init_from's weights if given (or refused, with
    --require_resume)."""
    if cfg.resume and cfg.require_resume:
        raise CheckpointError(
            f"resume: no intact checkpoint in {cfg.output_dir} to resume, and require_resume "
            "refuses to start fresh"
        )
    if cfg.resume:
        log.info(
            f"resume: no intact checkpoint in {cfg.output_dir} yet, starting fresh (is the folder "
            "right? --require_resume true refuses instead)"
        )
    if cfg.init_from:
        module = as_part(parts["model"]).module  # Weights or Sharded
        source = collectively(
            plumbing, "init_from", lambda: init_weights(module, cfg.init_from), CheckpointError
        )
        log.info(f"init_from: weights of {source}, starting at step 0 with a fresh optimizer")


class TrainingDiverged(RunError):
    """The loss or the gradients went nan or inf. Stop: going on would only save broken weights."""

    def __init__(self, step: int, loss: float, cfg):
        last_checkpoint = open_run_folder(cfg).newest()
        what = f"loss is {loss}" if not math.isfinite(loss) else "the gradient norm was not finite"
        where = (
            f"resume from {last_checkpoint}"
            if last_checkpoint
            else "no checkpoint was saved; start again"
        )
        super().__init__(
            f"{what} at step {step}: training diverged; {where} with a lower lr or more warmup_steps"
        )


def download_newest(plumbing, run_folder, writer: bool, log) -> None:
    """A run on object storage: this node's writer downloads the newest checkpoint whose files match
    its manifest into the staging folder, where every process of the node then finds it; the main
    process also the run files, which the resumed run continues."""
    if not writer:
        return
    run_folder.bucket.download_newest(run_folder.path("checkpoints"), log)
    if plumbing.is_main_process:
        run_folder.bucket.download_run_files(str(run_folder.local))


def forget(downloaded: Path, writer: bool) -> None:
    """A downloaded checkpoint, once every process has loaded it: the bucket keeps the original."""
    if writer:
        shutil.rmtree(downloaded)


def lr_horizon(cfg, saved_horizon: int, log) -> int:
    """The LR schedule's horizon is set at a run's first start and kept by every resume, so that
    raising max_steps extends a run at min_lr instead of silently re-stretching the cosine;
    lr_decay_steps changes it."""
    if cfg.lr_decay_steps or not saved_horizon:
        return cfg.decay_steps
    if cfg.max_steps != saved_horizon:
        log.info(
            f"lr schedule: its horizon stays at step {saved_horizon} (min_lr after it) while max_steps is "
            f"{cfg.max_steps}; pass --lr_decay_steps {cfg.max_steps} to stretch it instead"
        )
    return saved_horizon


def checkpoint_to_resume(cfg, run_folder, warn) -> Path | None:
    if not cfg.resume:
        return None
    if cfg.resume == "latest":  # in this node's folder (a bucket's newest is downloaded there)
        for folder in reversed(run_folder.checkpoints()):
            problem = checkpoint_problem(folder)
            if problem is None:
                return folder
            warn(f"skipping damaged checkpoint {folder}: {problem}; trying the one before")
        return None
    problem = checkpoint_problem(Path(cfg.resume))
    if problem is None:
        return Path(cfg.resume)
    hint = ""
    if (Path(cfg.resume) / LAYOUT["checkpoints"]).is_dir():
        hint = f"; it is a run folder: pass --output_dir {cfg.resume} --resume latest"
    raise CheckpointError(f"cannot resume from {cfg.resume}: {problem}{hint}")


def resume_from(plumbing, cfg, folder: Path, parts: dict, identity: dict) -> str:
    """Check everything that must match, then restore every part. Returns a note for the log: what
    changed (another world size with the same global batch)."""
    folder = Path(folder)
    about = read_manifest(folder)
    if "parts" not in about:
        raise CheckpointError(
            f"{folder} was written before checkpoints had state parts: start a new run from its weights with "
            f"--init_from {folder}"
        )
    saved = about["run"]
    now = run_geometry(plumbing, cfg)
    check_same_run(folder, about, now, cfg, identity)
    missing = [name for name in parts if name not in about["parts"]]
    if missing:
        raise CheckpointError(
            f"{folder} has no part {', '.join(missing)} (it holds {', '.join(about['parts'])}): start a new "
            f"run with --init_from"
        )
    same_world = saved["world_size"] == plumbing.num_processes
    bound = [name for name, part in parts.items() if as_part(part).bound_to_world_size]
    if not same_world and bound:
        raise CheckpointError(
            f"{folder} was saved by {saved['world_size']} processes, each with its own {', '.join(bound)} "
            f"position (a stream's): resume it with {saved['world_size']} processes, or start a new run from "
            f"its weights with --init_from"
        )
    load_checkpoint(plumbing, folder, parts, same_world)
    if same_world:
        return ""
    keys = ("world_size", "batch_size", "grad_accum_steps")
    changes = ", ".join(
        f"{key} {saved[key]} -> {now[key]}" for key in keys if saved[key] != now[key]
    )
    return f"; {changes}: the same global batch and samples in every step, a fresh per-process random state"


def check_same_run(folder: Path, about: dict, now: dict, cfg, identity: dict) -> None:
    """Refuse a checkpoint whose global batch, block size or data differ from this run's, or that is
    past max_steps: the data position would not continue exactly."""
    saved = about["run"]
    if any(saved[key] != now[key] for key in ("global_batch", "block_size")):
        raise CheckpointError(
            f"{folder} was saved with global batch {saved['global_batch']} (world size x batch_size x "
            f"grad_accum_steps) and block_size {saved['block_size']}, this run has {now['global_batch']} "
            f"and {now['block_size']}: an exact resume needs both unchanged (world size, batch_size and "
            f"grad_accum_steps may change, not their product)"
        )
    saved_optimizer = saved.get("optimizer", "adamw")  # checkpoints from before --optimizer
    if saved_optimizer != cfg.optimizer:
        raise CheckpointError(
            f"{folder} was saved with optimizer {saved_optimizer}, this run uses {cfg.optimizer}: its "
            f"state would not fit; to switch, start a new run from its weights with --init_from {folder}"
        )
    saved_rank = saved.get("lora_r", 0)  # checkpoints from before --lora_r
    if saved_rank != cfg.lora_r:
        raise CheckpointError(adapter_mismatch(folder, saved_rank, cfg.lora_r))
    if about["step"] > cfg.max_steps:
        raise CheckpointError(
            f"{folder} is at step {about['step']}, past max_steps {cfg.max_steps}: pass --max_steps "
            f"{about['step']} or more to resume it"
        )
    # a value unknown on either side (None: a hub revision offline) is no difference
    changed = [
        f"{key} {saved[key]!r} -> {value!r}"
        for key, value in identity.items()
        if saved.get(key) is not None and value is not None and saved[key] != value
    ]
    of_the_model = [line for line in changed if line.startswith("model/")]
    if of_the_model:  # model.py's identity(model): e.g. a preference run's reference weights
        raise CheckpointError(
            f"{folder} was saved with another model ({', '.join(of_the_model)}): resuming would "
            f"train against something else; to change it on purpose, start a new run with --init_from {folder}"
        )
    if changed:
        raise CheckpointError(
            f"{folder} was saved for other data ({', '.join(changed)}): resuming would continue a different "
            f"data order; to change them on purpose, start a new run with --init_from {folder}"
        )


def adapter_mismatch(folder, saved_rank: int, rank: int) -> str:
    def what(r):
        return f"LoRA adapters of rank {r} (lora_r {r})" if r else "every weight (lora_r 0)"

    return (
        f"{folder} was saved training {what(saved_rank)}, and this run trains {what(rank)}: its "
        f"model and optimizer parts would not fit; resume with lora_r {saved_rank}, or start a new "
        f"run from its weights with --init_from"
    )


def init_weights(module, source: str) -> Path:
    """Load only the weights of a checkpoint folder, a run folder (its export, else its newest
    checkpoint) or a .safetensors file; the shapes are checked first."""
    path = Path(source)
    if path.is_dir():
        newest = RunFolder(source).newest()
        exported = path / LAYOUT["export"]
        path = exported if exported.is_file() or newest is None else newest / LAYOUT["export"]
    if not path.is_file():
        raise CheckpointError(f"init_from: {path} does not exist")
    load_weights_file(module, path)
    return path


def check_same_step_everywhere(plumbing, step: int) -> None:
    """Each node may pick its own newest checkpoint (node-local disks); all agree iff mean(step²) ==
    mean(step)²."""
    values = torch.tensor([step, step * step], dtype=torch.float64, device=plumbing.device)
    mean, mean_square = plumbing.reduce(values, "mean").tolist()
    if mean_square != mean * mean:
        raise CheckpointError(
            f"processes resumed from different steps (this one: {step}); a node is missing its newest "
            f"checkpoint: pass --resume with the same checkpoint folder on every node"
        )
