"""Resume: choose the checkpoint (the newest intact one, or the one named), verify it, check it fits
this run, and restore it; or start a new run, from scratch or from --init_from's weights.

Everything is checked before anything is modified: the manifest's sizes and checksums, the batch
geometry and the data identity (the data position is only exact if they match), every weight's
name and shape. Every file is read with safetensors or torch.load(weights_only=True): a crafted
pickle is a one-line CheckpointError naming the file, and its code never runs.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import fields
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_model

from checkpoint import (
    CheckpointError,
    TrainState,
    committed_checkpoints,
    file_digest,
    latest_checkpoint,
    recover_interrupted_swap,
    set_rng_state,
)
from config import ConfigError, first_line
from job import collectively, is_writer


def resume_or_start(plumbing, cfg, model, optimizer, identity: dict, log) -> TrainState:
    """Restore the checkpoint that --resume names (or the newest intact one), or start at step 0
    (from --init_from's weights if given). Collective; any refusal is an error on every process."""
    writer = is_writer(plumbing, cfg)
    collectively(plumbing, "recovering checkpoints", lambda: writer and recover_interrupted_swap(cfg.output_dir))
    if not cfg.resume and latest_checkpoint(cfg.output_dir) is not None:
        raise ConfigError(f"output_dir '{cfg.output_dir}' already holds checkpoints; pass --resume latest to "
                          f"continue that run, or choose another output_dir")
    folder = collectively(plumbing, "choosing the checkpoint", lambda: checkpoint_to_resume(cfg, log.warn),
                          CheckpointError)
    if folder is None:
        if cfg.resume:
            log.info(f"resume: no intact checkpoint in {cfg.output_dir} yet, starting fresh")
        if cfg.init_from:
            source = collectively(plumbing, "init_from", lambda: init_weights(plumbing, model, cfg.init_from),
                                  CheckpointError)
            log.info(f"init_from: weights of {source}, starting at step 0 with a fresh optimizer")
        state = TrainState()
    else:
        state = collectively(plumbing, f"resuming from {folder}",
                             lambda: load_checkpoint(plumbing, cfg, folder, model, optimizer, identity),
                             CheckpointError)
        _check_same_step_everywhere(plumbing, state.step)
        log.info(f"resume: {folder} (step {state.step})")
    keep_lr_horizon(cfg, state, log)
    return state


def keep_lr_horizon(cfg, state: TrainState, log) -> None:
    """The LR schedule's horizon is set at a run's first start and kept by every resume, so that raising
    max_steps extends a run at min_lr instead of silently re-stretching the cosine; lr_decay_steps changes it."""
    if state.lr_decay_steps and not cfg.lr_decay_steps:
        cfg.lr_decay_steps = state.lr_decay_steps
        if cfg.max_steps != cfg.lr_decay_steps:
            log.info(f"lr schedule: its horizon stays at step {cfg.lr_decay_steps} (min_lr after it) while "
                     f"max_steps is {cfg.max_steps}; pass --lr_decay_steps {cfg.max_steps} to stretch it instead")
    cfg.lr_decay_steps = state.lr_decay_steps = cfg.decay_steps


def checkpoint_to_resume(cfg, warn) -> Path | None:
    if not cfg.resume:
        return None
    if cfg.resume == "latest":
        for folder in reversed(committed_checkpoints(cfg.output_dir)):
            problem = checkpoint_problem(folder)
            if problem is None:
                return folder
            warn(f"skipping damaged checkpoint {folder}: {problem}; trying the one before")
        return None
    problem = checkpoint_problem(Path(cfg.resume))
    if problem is not None:
        hint = (f"; it is a run folder: pass --output_dir {cfg.resume} --resume latest"
                if (Path(cfg.resume) / "checkpoints").is_dir() else "")
        raise CheckpointError(f"cannot resume from {cfg.resume}: {problem}{hint}")
    return Path(cfg.resume)


def checkpoint_problem(folder: Path) -> str | None:
    """What is wrong with a checkpoint folder (no manifest, a missing, truncated or altered file), or None."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "no readable manifest.json (not a checkpoint, or its save never finished)"
    for name, expected in files.items():
        expected = expected if isinstance(expected, dict) else {"bytes": expected}  # manifests before checksums
        path = folder / name
        if not path.is_file() or path.stat().st_size != expected["bytes"]:
            return f"{name} is missing or not {expected['bytes']} bytes"
        if "xxh3_64" in expected and file_digest(path) != expected["xxh3_64"]:
            return f"{name} does not match its checksum (the file was altered or corrupted)"
    return None


def load_checkpoint(plumbing, cfg, folder: Path, model, optimizer, identity: dict) -> TrainState:
    """Restore weights, optimizer, scaler and this process's RNG; return the train state.

    Everything is checked before anything is modified: the batch geometry and the data identity (the
    data position is only exact if they match), and every weight's name and shape.
    """
    folder = Path(folder)
    saved = _read_json(folder / "train_state.json")
    now = {"world_size": plumbing.num_processes, "batch_size": cfg.batch_size,
           "grad_accum_steps": cfg.grad_accum_steps, "block_size": cfg.block_size}
    changed = [f"{k} {saved.get(k)} -> {v}" for k, v in now.items() if saved.get(k) != v]
    if changed:
        raise CheckpointError(f"{folder} was saved with a different run geometry ({', '.join(changed)}); "
                              f"an exact resume needs the same world size, batch_size, grad_accum_steps "
                              f"and block_size")
    if saved["step"] > cfg.max_steps:
        raise CheckpointError(f"{folder} is at step {saved['step']}, past max_steps {cfg.max_steps}: pass "
                              f"--max_steps {saved['step']} or more to resume it")
    changed = [f"{k} {saved[k]!r} -> {v!r}" for k, v in identity.items() if k in saved and saved[k] != v]
    if changed:
        raise CheckpointError(f"{folder} was saved for other data ({', '.join(changed)}): resuming would continue "
                              f"a different data order; to change them on purpose, start a new run with "
                              f"--init_from {folder}")
    module = plumbing.unwrap_model(model, keep_torch_compile=False)
    _check_weights(folder / "model.safetensors", module)
    rng_file = folder / f"rng_rank{plumbing.process_index}.pt"
    rng = _load_tensors(rng_file, "cpu")
    optimizer_state = _load_tensors(folder / "optimizer.pt", "cpu")  # load_state_dict moves it to the params
    load_model(module, str(folder / "model.safetensors"))  # via CPU; copied into the params in place
    try:
        optimizer.load_state_dict(optimizer_state)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{folder / 'optimizer.pt'} does not fit this optimizer: {e}") from None
    scaler = getattr(plumbing, "scaler", None)
    if scaler is not None:
        scaler.load_state_dict(_load_tensors(folder / "scaler.pt", "cpu"))
    set_rng_state(rng, rng_file)
    return TrainState(**{f.name: saved[f.name] for f in fields(TrainState) if f.name in saved})


def init_weights(plumbing, model, source: str) -> Path:
    """Load only the weights of a checkpoint folder, a run folder (its export, else its newest checkpoint)
    or a .safetensors file; the shapes are checked first."""
    path = Path(source)
    if path.is_dir():
        newest = latest_checkpoint(source)
        path = path / "model.safetensors" if (path / "model.safetensors").is_file() or newest is None \
            else newest / "model.safetensors"
    module = plumbing.unwrap_model(model, keep_torch_compile=False)
    if not path.is_file():
        raise CheckpointError(f"init_from: {path} does not exist")
    _check_weights(path, module)
    load_model(module, str(path))
    return path


def _check_same_step_everywhere(plumbing, step: int) -> None:
    """On node-local disks each node picks its own newest checkpoint; they must be the same step.
    All ranks agree iff mean(step^2) == mean(step)^2 (two all-reduces, no gather needed)."""
    values = torch.tensor([step, step * step], dtype=torch.float64, device=plumbing.device)
    mean, mean_square = plumbing.reduce(values, "mean").tolist()
    if mean_square != mean * mean:
        raise CheckpointError(f"processes resumed from different steps (this one: {step}); a node is missing its "
                              f"newest checkpoint: pass --resume with the same checkpoint folder on every node")


def _check_weights(path: Path, module: torch.nn.Module) -> None:
    """Raise listing mismatched names/shapes, before load_state_dict copies any tensor."""
    expected = module.state_dict()
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:
        raise CheckpointError(f"{path} is not a safetensors file: {e}") from None
    problems = [f"unexpected {k}" for k in shapes if k not in expected]
    problems += [f"{k} {list(shapes[k])} vs model {list(expected[k].shape)}" for k in shapes
                 if k in expected and shapes[k] != tuple(expected[k].shape)]
    stored_storage = {expected[k].data_ptr() for k in shapes if k in expected}  # tied weights are stored once
    problems += [f"missing {k}" for k, t in expected.items() if k not in shapes
                 and t.data_ptr() not in stored_storage]
    if problems:
        raise CheckpointError(f"{path} does not fit this model: {'; '.join(problems[:4])}"
                              + (f" (+{len(problems) - 4} more)" if len(problems) > 4 else ""))


def _load_tensors(path: Path, map_location):
    """torch.load restricted to tensors and plain containers: a pickle that would run code is refused."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path} refused: not a plain tensor file ({first_line(e)})") from None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent} is not a checkpoint: no {path.name}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
