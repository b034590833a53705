"""Resume: choose the checkpoint (the newest intact one, or the one named), verify it, check it fits this run,
and restore its parts; or start a new run, from scratch or from --init_from's weights. Every file is read with
safetensors, json or torch.load(weights_only=True): a crafted pickle is a one-line CheckpointError naming the
file, and its code never runs.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model

from checkpoint import (
    CheckpointError,
    TrainState,
    committed_checkpoints,
    file_digest,
    is_sharded,
    latest_checkpoint,
    recover_interrupted_swap,
    run_geometry,
    sharded_io,
    tied_weights,
)
from config import ConfigError, first_line
from job import collectively, is_writer


def resume_or_start(plumbing, cfg, parts: dict, identity: dict, log) -> None:
    """Restore every part from the checkpoint --resume names (or the newest intact one), or start at step 0
    (from --init_from's weights if given). Collective; any refusal is an error on every process."""
    writer = is_writer(plumbing, cfg)
    collectively(plumbing, "recovering checkpoints", lambda: writer and recover_interrupted_swap(cfg.output_dir))
    if not cfg.resume and latest_checkpoint(cfg.output_dir) is not None:
        raise ConfigError(f"output_dir '{cfg.output_dir}' already holds checkpoints; pass --resume latest to "
                          f"continue that run, or choose another output_dir")
    folder = collectively(plumbing, "choosing the checkpoint", lambda: checkpoint_to_resume(cfg, log.warn),
                          CheckpointError)
    state = parts["train_state"]
    if folder is None:
        if cfg.resume:
            log.info(f"resume: no intact checkpoint in {cfg.output_dir} yet, starting fresh")
        if cfg.init_from:
            source = collectively(plumbing, "init_from", lambda: init_weights(plumbing, parts["model"], cfg.init_from),
                                  CheckpointError)
            log.info(f"init_from: weights of {source}, starting at step 0 with a fresh optimizer")
    else:
        note = collectively(plumbing, f"resuming from {folder}",
                            lambda: load_checkpoint(plumbing, cfg, folder, parts, identity), CheckpointError)
        _check_same_step_everywhere(plumbing, state.step)
        log.info(f"resume: {folder} (step {state.step}){note}")
    keep_lr_horizon(cfg, state, log)


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
            if (problem := checkpoint_problem(folder)) is None:
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
        files = json.loads((folder / "manifest.json").read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "no readable manifest.json (not a checkpoint, or its save never finished)"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != expected["bytes"]:
            return f"{name} is missing or not {expected['bytes']} bytes"
        if file_digest(path) != expected["xxh3_64"]:
            return f"{name} does not match its checksum (the file was altered or corrupted)"
    return None


def load_checkpoint(plumbing, cfg, folder: Path, parts: dict, identity: dict) -> str:
    """Restore every part in place, after checking all that can be checked first: the manifest's global batch
    and block size (the data position is exact only if they match), the data identity, that every part is
    there, every weight's name and shape. With another world size, per-process parts (RNG) start afresh;
    the returned note says so, for the log."""
    folder = Path(folder)
    about = _read(folder / "manifest.json")
    if "parts" not in about:
        raise CheckpointError(f"{folder} was written before checkpoints had state parts: start a new run from its "
                              f"weights with --init_from {folder}")
    saved, now = about["run"], run_geometry(plumbing, cfg)
    if any(saved[k] != now[k] for k in ("global_batch", "block_size")):
        raise CheckpointError(f"{folder} was saved with global batch {saved['global_batch']} (world size x "
                              f"batch_size x grad_accum_steps) and block_size {saved['block_size']}, this run "
                              f"has {now['global_batch']} and {now['block_size']}: an exact resume needs both "
                              f"unchanged (world size, batch_size and grad_accum_steps may change, not their product)")
    if about["step"] > cfg.max_steps:
        raise CheckpointError(f"{folder} is at step {about['step']}, past max_steps {cfg.max_steps}: pass "
                              f"--max_steps {about['step']} or more to resume it")
    if changed := [f"{k} {saved[k]!r} -> {v!r}" for k, v in identity.items() if k in saved and saved[k] != v]:
        raise CheckpointError(f"{folder} was saved for other data ({', '.join(changed)}): resuming would continue "
                              f"a different data order; to change them on purpose, start a new run with "
                              f"--init_from {folder}")
    if missing := [name for name in parts if name not in about["parts"]]:
        raise CheckpointError(f"{folder} has no part {', '.join(missing)} (it holds {', '.join(about['parts'])}): "
                              f"start a new run with --init_from")
    same_world = saved["world_size"] == plumbing.num_processes
    if not same_world and (bound := [name for name, part in parts.items() if getattr(part, "same_world_size", 0)]):
        raise CheckpointError(f"{folder} was saved by {saved['world_size']} processes, each with its own "
                              f"{', '.join(bound)} position (a stream's): resume it with {saved['world_size']} "
                              f"processes, or start a new run from its weights with --init_from")
    states = {name: _read_part(folder, name, part, plumbing) for name, part in parts.items()
              if same_world or not getattr(part, "per_process", False)}
    for name, state in states.items():
        try:
            if getattr(parts[name], "sharded", False):  # collective; DCP reshards to this run's processes
                sharded_io(folder, name, parts[name], load=True)
            elif isinstance(parts[name], torch.nn.Module):  # via CPU; copied into the parameters in place
                load_model(plumbing.unwrap_model(parts[name], keep_torch_compile=False), str(state))
            else:
                parts[name].load_state_dict(state)
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"{folder}: its part '{name}' does not fit this run: {first_line(e)}") from None
    if same_world:
        return ""
    changed = ", ".join(f"{k} {saved[k]} -> {now[k]}" for k in ("world_size", "batch_size", "grad_accum_steps")
                        if saved[k] != now[k])
    return f"; {changed}: the same global batch and samples in every step, a fresh per-process random state"


def _read_part(folder: Path, name: str, part, plumbing):
    """A part's saved state (for a module: its weights file, checked against the module)."""
    if getattr(part, "per_process", False):
        return _read(folder / f"{name}_rank{plumbing.process_index}.pt")
    if getattr(part, "sharded", False) != (folder / name).is_dir():
        saved, now = ("sharded", "unsharded") if (folder / name).is_dir() else ("unsharded", "sharded")
        raise CheckpointError(f"{folder} holds {name} {saved} and this run's is {now} (fsdp, or the accelerate "
                              f"config): resume with the setting it was saved with, or start a new run from "
                              f"its weights with --init_from (python scripts/consolidate.py makes one file of them)")
    if getattr(part, "sharded", False):
        return folder / name
    if isinstance(part, torch.nn.Module):
        check_weights(folder / f"{name}.safetensors", plumbing.unwrap_model(part, keep_torch_compile=False))
        return folder / f"{name}.safetensors"
    json_file = folder / f"{name}.json"
    return _read(json_file if json_file.is_file() else folder / f"{name}.pt")  # loaded on the CPU


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
    check_weights(path, module)
    if is_sharded(module):  # every process reads the whole file and keeps its shards
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        weights = load_file(str(path))
        for group in tied_weights(module):  # the file holds one name of each tied group
            weights.update({name: next(weights[n] for n in group if n in weights) for name in group})
        set_model_state_dict(module, weights, options=StateDictOptions(full_state_dict=True))
    else:
        load_model(module, str(path))
    return path


def _check_same_step_everywhere(plumbing, step: int) -> None:
    """Each node may pick its own newest checkpoint (node-local disks); all agree iff mean(step²) == mean(step)²."""
    values = torch.tensor([step, step * step], dtype=torch.float64, device=plumbing.device)
    mean, mean_square = plumbing.reduce(values, "mean").tolist()
    if mean_square != mean * mean:
        raise CheckpointError(f"processes resumed from different steps (this one: {step}); a node is missing its "
                              f"newest checkpoint: pass --resume with the same checkpoint folder on every node")


def check_weights(path: Path, module: torch.nn.Module) -> None:
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
    stored = set(shapes) | {name for group in tied_weights(module) if set(group) & set(shapes) for name in group}
    problems += [f"missing {k}" for k in expected if k not in stored]  # tied weights are stored once
    if problems:
        raise CheckpointError(f"{path} does not fit this model: {'; '.join(problems[:4])}"
                              + (f" (+{len(problems) - 4} more)" if len(problems) > 4 else "")
                              + "; build the model as it was saved (the config.yaml beside it: model, n_layer, "
                                "n_embd, bias, ...)")


def _read(path: Path):
    """A .json file, or a tensor file through torch.load restricted to tensors and plain containers (a pickle that
    would run code is refused); anything else is a one-line CheckpointError naming the file."""
    try:
        return json.loads(path.read_text()) if path.suffix == ".json" else torch.load(path, "cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent} has no {path.name}: not a checkpoint, or not of this run") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path} refused: not a plain tensor file ({first_line(e)})") from None
