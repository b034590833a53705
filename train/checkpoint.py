"""Checkpoints: their layout, the save transaction, the final export (reading them back: resume.py).

    <output_dir>/checkpoints/step_00000100/     a committed checkpoint: one file (or one per process) per part
        model.safetensors  optimizer.pt  train_state.json  data.json  rng_rank{r}.pt  [scaler.json]  [ema...]
        (sharded, FSDP: model/ and optimizer/, torch.distributed.checkpoint folders with a file per process)
        config.yaml (the resolved config)   manifest.json (last: the run's geometry, names, sizes, xxh3 checksums)
    <output_dir>/checkpoints/step_00000200.tmp/ being written, or left by a crash: never loaded
    <output_dir>/model.safetensors              the exported model at the end of training

A checkpoint holds named state parts, objects with state_dict() / load_state_dict() (checkpoint_parts). A save
is one transaction: tmp folder, every process writes its parts, all vote (a failure on any process is an error
on every process, job.collectively), the manifest last, one rename publishes, then older ones are pruned.
The main process writes the shared files; on node-local disks (`--shared_filesystem false`) each node's local
main process does. Both plumbings use these functions: a checkpoint of one resumes under the other. The template
owns the format instead of `accelerator.save_state`, which writes straight into its final folder, pickles RNG
states, and trains on after a refused RNG file (RELIABILITY.md, measured).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import xxhash
import yaml
from safetensors.torch import save_file, save_model

from config import ConfigError
from job import collectively, is_writer

STEP_PREFIX = "step_"
COMMITTED_NAME = re.compile(r"step_\d{8}")  # not step_N.tmp (being written) nor step_N.stale (being replaced)


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed (missing, damaged, or from another run): one line, exit 2."""


@dataclass
class TrainState:
    """Where training is (a checkpoint part). Samples seen = step x global batch; the data position: data.py."""

    step: int = 0  # optimizer steps completed
    tracker_run_id: str = ""  # the W&B run to continue on resume
    lr_decay_steps: int = 0  # the LR schedule's horizon, fixed at the run's first start (see config.py)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            setattr(self, f.name, state.get(f.name, f.default))


class ProcessRNG:
    """This process's random generators (Python, NumPy, torch, CUDA), as tensors and lists (weights_only)."""

    per_process = True  # written by every process, as <name>_rank{r}.pt

    def state_dict(self) -> dict:
        np_state = np.random.get_state()
        version, words, gauss = random.getstate()
        state = {"python": [version, list(words), gauss],
                 "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]], "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict) -> None:
        version, words, gauss = state["python"]
        random.setstate((version, tuple(words), gauss))
        name, keys, *rest = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
        torch.set_rng_state(state["torch"])
        if torch.cuda.is_available() and "cuda" in state:
            torch.cuda.set_rng_state_all(state["cuda"])


class ShardedState:
    """A sharded (FSDP) model's weights, or with `optimizer` that optimizer's state: every process writes and reads
    its own shards through torch.distributed.checkpoint (DCP), which reshards on a resume at another world size."""

    sharded = True  # written as the folder <name>/: a .distcp file per process, and .metadata

    def __init__(self, model, optimizer=None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        if self.optimizer is None:
            return get_model_state_dict(self.model)
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        if self.optimizer is None:
            set_model_state_dict(self.model, state)
        else:
            set_optimizer_state_dict(self.model, self.optimizer, state)


def is_sharded(module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # imported by whatever sharded the model (1.2 s to import)
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def tied_weights(module) -> list[list[str]]:
    """Groups of names that share one parameter (GPT's wte.weight and lm_head.weight): a weights file holds one."""
    names = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def checkpoint_parts(plumbing, **parts) -> dict:
    """The named parts a checkpoint saves and a resume restores: the ones given, this process's RNG, and
    fp16's loss scaler. A fork adds its own in one line, before the resume: parts["ema"] = ema_model."""
    model = plumbing.unwrap_model(parts["model"], keep_torch_compile=False)
    if is_sharded(model):  # no process holds all of it: each writes its shards
        parts["model"], parts["optimizer"] = ShardedState(model), ShardedState(model, parts["optimizer"])
    parts["rng"] = ProcessRNG()
    if plumbing.scaler is not None:
        parts["scaler"] = plumbing.scaler
    return parts


def run_geometry(plumbing, cfg) -> dict:
    """How the run splits its global batch; a resume needs the same global_batch and block_size, not the rest."""
    return {"world_size": plumbing.num_processes, "batch_size": cfg.batch_size, "grad_accum_steps":
            cfg.grad_accum_steps, "global_batch": cfg.batch_size * cfg.grad_accum_steps * plumbing.num_processes,
            "block_size": cfg.block_size}


def checkpoint_root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def committed_checkpoints(output_dir: str) -> list[Path]:
    """Complete checkpoints, oldest first. A folder without a manifest (a crash mid-save) is ignored."""
    found = [p for p in checkpoint_root(output_dir).glob(f"{STEP_PREFIX}*")
             if COMMITTED_NAME.fullmatch(p.name) and (p / "manifest.json").is_file()]
    return sorted(found)  # zero-padded step numbers sort as text


def latest_checkpoint(output_dir: str) -> Path | None:
    return next(reversed(committed_checkpoints(output_dir)), None)


# ---------------------------------------------------------------- save


def save_checkpoint(plumbing, cfg, parts: dict, step: int, identity: dict) -> Path:
    """Write, vote, publish by rename, prune. Collective: call on all ranks; a failure anywhere raises everywhere."""
    final = checkpoint_root(cfg.output_dir) / f"{STEP_PREFIX}{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    writer = is_writer(plumbing, cfg)
    collectively(plumbing, f"creating {tmp}", lambda: writer and (shutil.rmtree(tmp, ignore_errors=True),
                                                                  tmp.mkdir(parents=True)))

    def write_parts():
        for name, part in parts.items():
            write_part(tmp, name, part, plumbing, writer)
        if writer:  # provenance: the whole resolved config
            _write_file(tmp / "config.yaml", yaml.safe_dump(asdict(cfg), sort_keys=False).encode())

    collectively(plumbing, f"saving the checkpoint of step {step} to {tmp}", write_parts,
                 on_failure=lambda: writer and shutil.rmtree(tmp, ignore_errors=True))
    ranks = range(plumbing.num_processes)
    if not cfg.shared_filesystem:  # this node's copy holds this node's ranks (torchrun sets these variables)
        per_node, node = int(os.environ.get("LOCAL_WORLD_SIZE", len(ranks))), int(os.environ.get("GROUP_RANK", "0"))
        ranks = range(node * per_node, (node + 1) * per_node)
    per_process = [name for name, part in parts.items() if getattr(part, "per_process", False)]
    about = {"step": step, "run": {**run_geometry(plumbing, cfg), **identity}, "parts": sorted(parts)}
    collectively(plumbing, f"committing {final}", lambda: writer and (
        _publish(tmp, final, [f"{name}_rank{r}.pt" for name in per_process for r in ranks], about),
        prune_checkpoints(cfg.output_dir, cfg.keep_last)))
    return final


def write_part(folder: Path, name: str, part, plumbing, writer: bool) -> None:
    """A module as <name>.safetensors, a sharded part as <name>/ and a per-process part as <name>_rank{r}.pt by every
    process, any other part by the writer: <name>.json if its state is plain values, else <name>.pt (tensors, read
    back weights_only)."""
    if getattr(part, "sharded", False):  # collective: every process writes its shards, rank 0 the metadata
        sharded_io(folder, name, part)
    elif getattr(part, "per_process", False):
        _write_file(folder / f"{name}_rank{plumbing.process_index}.pt", part.state_dict())
    elif not writer:
        return
    elif isinstance(part, torch.nn.Module):
        save_safetensors(plumbing.unwrap_model(part, keep_torch_compile=False), folder / f"{name}.safetensors")
    else:
        state = part.state_dict()
        try:
            _write_file(folder / f"{name}.json", json.dumps(state, indent=2).encode())
        except TypeError:  # not JSON (raised before the file is opened): it holds tensors
            _write_file(folder / f"{name}.pt", state)


def sharded_io(folder: Path, name: str, part, load: bool = False) -> None:
    """torch.distributed.checkpoint's save or load of a sharded part as <folder>/<name>/ (collective). It reports a
    failure on any process to all of them as one BaseException: re-raised here as the first process's error."""
    import torch.distributed.checkpoint as dcp

    try:
        (dcp.load if load else dcp.save)({name: part}, checkpoint_id=folder / name)
    except dcp.api.CheckpointException as e:
        error = next(iter(e.failures.values()))[0]
        raise error if isinstance(error, Exception) else RuntimeError(str(error)) from None


def _publish(tmp: Path, final: Path, expected: list[str], about: dict) -> None:
    """Manifest last, then one rename: a checkpoint is either complete under its final name or absent."""
    missing = [name for name in expected if not (tmp / name).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint of step {about['step']} is missing {', '.join(missing)}: is output_dir "
                              f"on a filesystem every node sees? If not, pass --shared_filesystem false")
    files = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "xxh3_64": file_digest(p)}
             for p in sorted(tmp.rglob("*")) if p.is_file()}
    _write_file(tmp / "manifest.json", json.dumps({**about, "files": files}, indent=2).encode())
    if final.exists():  # the same step saved again (a resumed run): keep the old one until the swap
        stale = final.with_name(final.name + ".stale")
        os.replace(final, stale)
        os.replace(tmp, final)
        shutil.rmtree(stale)
    else:
        os.replace(tmp, final)
    directory = os.open(final.parent, os.O_RDONLY)  # the rename itself, durable
    os.fsync(directory)
    os.close(directory)


def recover_interrupted_swap(output_dir: str) -> None:
    """A crash between _publish's two renames leaves step_N.stale (the old committed copy) and no step_N:
    put it back. Called by the writer at start-up, under the run folder's lock."""
    for stale in checkpoint_root(output_dir).glob(f"{STEP_PREFIX}*.stale"):
        final = stale.with_suffix("")
        shutil.rmtree(stale) if final.exists() else os.replace(stale, final)


def prune_checkpoints(output_dir: str, keep_last: int) -> None:
    """Delete all but the newest `keep_last` committed checkpoints, and leftovers of crashed saves."""
    for old in committed_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old)
    for leftover in [*checkpoint_root(output_dir).glob("*.tmp"), *checkpoint_root(output_dir).glob("*.stale")]:
        shutil.rmtree(leftover, ignore_errors=True)  # called right after a commit: no save is in flight


def save_safetensors(weights, path: Path, metadata: dict | None = None) -> None:
    """A module's weights (or a state dict) as safetensors, with the mode any other file gets here (umask): safetensors
    creates its files 0600, which teammates on a shared filesystem could not read."""
    if isinstance(weights, torch.nn.Module):
        save_model(weights, str(path))
    else:
        save_file(weights, str(path), metadata=metadata or None)
    _umask_mode(path)


def _umask_mode(path: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _write_file(path: Path, data) -> None:
    """Bytes as they are, anything else with torch.save; on disk (fsync) before a manifest can name it."""
    with open(path, "wb") as f:
        f.write(data) if isinstance(data, bytes) else torch.save(data, f)
        f.flush()
        os.fsync(f.fileno())


def file_digest(path: Path) -> str:
    digest = xxhash.xxh3_64()  # ~10 GB/s: checksumming costs far less than writing
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------- export


def export_model(plumbing, model, output_dir: str) -> Path:
    """The trained weights as <output_dir>/model.safetensors, written by the main process (collective). A sharded
    model is gathered whole first, in the main process's CPU memory: the file is the same as an unsharded run's.
    A Hugging Face model is saved in its own layout too (config.json beside it): from_pretrained(output_dir)."""
    path = Path(output_dir) / "model.safetensors"
    tmp = path.with_name(path.name + ".tmp")
    module = plumbing.unwrap_model(model, keep_torch_compile=False)
    weights, metadata = full_weights(module) if is_sharded(module) else (module, None)

    def write():
        if not hasattr(module, "save_pretrained"):
            save_safetensors(weights, tmp, metadata)
            return os.replace(tmp, path)
        shutil.rmtree(tmp, ignore_errors=True)
        module.save_pretrained(tmp, state_dict=None if weights is module else weights)
        for file in sorted(tmp.iterdir(), key=lambda f: f.suffix == ".safetensors"):  # the weights last
            _umask_mode(file)
            os.replace(file, path.parent / file.name)
        tmp.rmdir()

    collectively(plumbing, f"exporting {path}", lambda: plumbing.is_main_process and write())
    return path


def full_weights(module) -> tuple[dict, dict]:
    """A sharded model's whole state dict on the main process ({} elsewhere; collective), and the tied names left
    out, as save_model leaves them out (it keeps the first in sorted order and notes {dropped: kept})."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    dropped = {name: sorted(group)[0] for group in tied_weights(module) for name in sorted(group)[1:]}
    return {name: tensor for name, tensor in state.items() if name not in dropped}, dropped
