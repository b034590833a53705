"""Checkpoints: the run folder's layout, an atomic commit protocol, exact resume, the final export.

    <output_dir>/checkpoints/step_00000100/     a committed checkpoint (has manifest.json)
        model.safetensors   optimizer.pt   [scaler.pt]   rng_rank{r}.pt (one per process)
        train_state.json    config.yaml (the resolved config)   manifest.json (last: file names and sizes)
    <output_dir>/checkpoints/step_00000200.tmp/ being written, or left by a crash: never loaded
    <output_dir>/model.safetensors              the exported model at the end of training

Who writes: with `shared_filesystem` (the default) the main process writes the shared files and
commits; on node-local disks (`--shared_filesystem false`) each node's local main process does, so
every node holds a complete copy of each checkpoint (its own ranks' RNG files included).

Both plumbings (Accelerate and torch_ddp.py) use these functions, so a checkpoint written by one
resumes under the other. The template owns the format instead of calling `accelerator.save_state`:
save_state writes straight into its final folder, pickles RNG states, and logs a refused RNG file at
INFO and trains on (RELIABILITY.md, measured). Here every tensor file loads with
`weights_only=True` or safetensors, a bad file is a one-line CheckpointError naming it, and a folder
only gets its final name once every process has written its part. (A fork that moves to FSDP or
DeepSpeed should call `accelerator.save_state(tmp)` inside `save_checkpoint` for the sharded state.)
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_model, save_model

from config import first_line

STEP_PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or resumed; the message is one line."""


@dataclass
class TrainState:
    """Where training is. Everything else (epoch, position in the epoch) is derived from `step`."""

    step: int = 0  # optimizer steps completed
    samples_seen: int = 0
    tokens_seen: int = 0
    epoch: int = 0
    tracker_run_id: str = ""  # the W&B run to continue on resume


def checkpoint_root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def committed_checkpoints(output_dir: str) -> list[Path]:
    """Complete checkpoints, oldest first. A folder without a manifest (a crash mid-save) is ignored."""
    root = checkpoint_root(output_dir)
    found = [p for p in root.glob(f"{STEP_PREFIX}*") if p.is_dir() and not p.name.endswith(".tmp")
             and (p / "manifest.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def latest_checkpoint(output_dir: str) -> Path | None:
    found = committed_checkpoints(output_dir)
    return found[-1] if found else None


# ---------------------------------------------------------------- save


def save_checkpoint(plumbing, cfg, model, optimizer, state: TrainState) -> Path:
    """Write, check every process succeeded, publish by rename, prune. Collective: call on all ranks."""
    root = checkpoint_root(cfg.output_dir)
    final = root / f"{STEP_PREFIX}{state.step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    writer = plumbing.is_main_process if cfg.shared_filesystem else plumbing.is_local_main_process
    if writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    plumbing.wait_for_everyone()  # the folder exists before anyone writes into it
    error = None
    try:
        if writer:
            write_shared_files(tmp, plumbing, cfg, model, optimizer, state)
        _save_tensors(rng_state(), tmp / f"rng_rank{plumbing.process_index}.pt")
    except OSError as e:
        error = e
    # a barrier cannot tell success from failure: count the processes that failed instead
    failed = plumbing.reduce(torch.tensor(float(error is not None), device=plumbing.device), "sum")
    if failed.item() > 0:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        where = f": {error}" if error else " on another process"
        raise CheckpointError(f"saving the checkpoint of step {state.step} to {final} failed{where}")
    if writer:
        ranks = range(plumbing.num_processes) if cfg.shared_filesystem else ranks_on_this_node(plumbing.num_processes)
        _publish(tmp, final, ranks, state.step)
        prune_checkpoints(cfg.output_dir, cfg.keep_last)
    plumbing.wait_for_everyone()  # nobody reads or resumes from a checkpoint before it is committed
    return final


def write_shared_files(folder: Path, plumbing, cfg, model, optimizer, state: TrainState) -> None:
    """What one process writes for everyone: weights, optimizer, grad scaler, train state."""
    save_model(plumbing.unwrap_model(model, keep_torch_compile=False), str(folder / "model.safetensors"))
    _save_tensors(optimizer.state_dict(), folder / "optimizer.pt")
    scaler = getattr(plumbing, "scaler", None)
    if scaler is not None:
        _save_tensors(scaler.state_dict(), folder / "scaler.pt")
    train_state = {**asdict(state), "world_size": plumbing.num_processes, "batch_size": cfg.batch_size,
                   "grad_accum_steps": cfg.grad_accum_steps, "block_size": cfg.block_size,
                   "seed": cfg.seed, "dataset": cfg.dataset}
    _write_file(folder / "train_state.json", json.dumps(train_state, indent=2).encode())
    _write_file(folder / "config.yaml", yaml.safe_dump(asdict(cfg), sort_keys=False).encode())  # provenance


def ranks_on_this_node(world_size: int) -> range:
    """Global ranks launched on this node (torchrun, and so accelerate launch, set these variables)."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    node = int(os.environ.get("GROUP_RANK", "0"))
    return range(node * per_node, (node + 1) * per_node)


def _publish(tmp: Path, final: Path, ranks, step: int) -> None:
    """Manifest last, then one rename: a checkpoint is either complete under its final name or absent."""
    expected = [f"rng_rank{r}.pt" for r in ranks]
    missing = [name for name in expected if not (tmp / name).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint of step {step} is missing {', '.join(missing)}: is output_dir on a "
                              f"filesystem every node sees? If not, pass --shared_filesystem false")
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
    _write_file(tmp / "manifest.json", json.dumps({"step": step, "files": files}, indent=2).encode())
    if final.exists():  # the same step saved again (a resumed run): keep the old one until the swap
        stale = final.with_name(final.name + ".stale")
        os.replace(final, stale)
        os.replace(tmp, final)
        shutil.rmtree(stale)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)


def prune_checkpoints(output_dir: str, keep_last: int) -> None:
    """Delete all but the newest `keep_last` committed checkpoints, and leftovers of crashed saves."""
    for old in committed_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old)
    for leftover in [*checkpoint_root(output_dir).glob("*.tmp"), *checkpoint_root(output_dir).glob("*.stale")]:
        shutil.rmtree(leftover, ignore_errors=True)  # called right after a commit: no save is in flight


def _save_tensors(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- load


def load_checkpoint(plumbing, cfg, folder: Path, model, optimizer) -> TrainState:
    """Restore weights, optimizer, scaler and this process's RNG; return the train state.

    Everything is checked before anything is modified: the manifest, the world size and batch
    geometry (the data position is only exact if they match), and every weight's name and shape.
    """
    folder = Path(folder)
    saved = _read_json(folder / "train_state.json")
    _verify_manifest(folder)
    now = {"world_size": plumbing.num_processes, "batch_size": cfg.batch_size,
           "grad_accum_steps": cfg.grad_accum_steps, "block_size": cfg.block_size}
    changed = [f"{k} {saved.get(k)} -> {v}" for k, v in now.items() if saved.get(k) != v]
    if changed:
        raise CheckpointError(f"{folder} was saved with a different run geometry ({', '.join(changed)}); "
                              f"an exact resume needs the same world size, batch_size, grad_accum_steps "
                              f"and block_size")
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
    _check_same_step_everywhere(plumbing, saved["step"])
    return TrainState(**{f.name: saved[f.name] for f in fields(TrainState) if f.name in saved})


def _check_same_step_everywhere(plumbing, step: int) -> None:
    """On node-local disks each node picks its own newest checkpoint; they must be the same step.
    All ranks agree iff mean(step^2) == mean(step)^2 (two all-reduces, no gather needed)."""
    values = torch.tensor([step, step * step], dtype=torch.float64, device=plumbing.device)
    mean, mean_square = plumbing.reduce(values, "mean").tolist()
    if mean_square != mean * mean:
        raise CheckpointError(f"processes resumed from different steps (this one: {step}); a node is missing its "
                              f"newest checkpoint: pass --resume with the same checkpoint folder on every node")


def _verify_manifest(folder: Path) -> None:
    manifest = _read_json(folder / "manifest.json")
    for name, size in manifest.get("files", {}).items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            raise CheckpointError(f"{path} is missing or has the wrong size (manifest says {size} bytes)")


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


# ---------------------------------------------------------------- RNG, as tensors and plain lists


def rng_state() -> dict:
    np_state = np.random.get_state()
    version, words, gauss = random.getstate()
    state = {"python": [version, list(words), gauss],
             "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]], "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, source: Path) -> None:
    try:
        version, words, gauss = state["python"]
        random.setstate((version, tuple(words), gauss))
        name, keys, *rest = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
        torch.set_rng_state(state["torch"])
        if torch.cuda.is_available() and "cuda" in state:
            torch.cuda.set_rng_state_all(state["cuda"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{source} holds no usable RNG state: {e}") from None


# ---------------------------------------------------------------- preemption


class Preemption:
    """SIGTERM (SLURM, Kubernetes) or SIGUSR1 (SLURM's --signal) asks for a checkpoint and a clean stop.

    The handler only records the signal; the loop asks every rank at each logging step (every
    `log_every` steps, where it syncs with the GPU anyway), so all ranks stop at the same step even
    when the signal reaches them at different moments.
    """

    EXIT_CODE = 75  # EX_TEMPFAIL, "try again later": stopped early with a checkpoint, requeue me

    def __init__(self):
        self.signal_name = None
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, self._remember)

    def _remember(self, signum, _frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def requested(self, plumbing) -> bool:
        flag = torch.tensor(float(self.signal_name is not None), device=plumbing.device)
        return plumbing.reduce(flag, "sum").item() > 0  # collective, and a CPU-GPU sync


# ---------------------------------------------------------------- export


def export_model(plumbing, model, output_dir: str) -> Path:
    """The trained weights as <output_dir>/model.safetensors (main process; collective barrier)."""
    path = Path(output_dir) / "model.safetensors"
    if plumbing.is_main_process:
        tmp = path.with_name(path.name + ".tmp")
        save_model(plumbing.unwrap_model(model, keep_torch_compile=False), str(tmp))  # no _orig_mod. prefixes
        os.replace(tmp, path)
    plumbing.wait_for_everyone()
    return path
