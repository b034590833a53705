"""Checkpoints: the format, in both directions (the transaction that writes them is saving.py's).

    <output_dir>/checkpoints/step_00000100/     a committed checkpoint: the files of its parts
        model.safetensors  optimizer.pt  train_state.json  data.json  rng_rank{r}.pt  [buffers_rank{r}.pt]
        [scaler.json]  [ema...]
        (sharded, FSDP: model/ and optimizer/, torch.distributed.checkpoint folders with a file per process)
        config.yaml (the resolved config)   manifest.json (last: the run's geometry, parts, sizes, checksums)
    <output_dir>/checkpoints/step_00000200.tmp/ being written, or left by a crash: never loaded
    <output_dir>/model.safetensors              the exported model at the end of training

A checkpoint holds named parts. Each part is of one kind, a small class below that knows its files, saves and
loads itself, and says what happens on another world size:
    Weights      a module's weights, <name>.safetensors, by the writer
    Sharded      a sharded (FSDP) model's or optimizer's state, <name>/, every process its shards (DCP)
    PerProcess   a state of each process, <name>_rank{r}.pt (this process's RNG, a stream's position, its
                 BatchNorm statistics where the ranks keep their own: buffers.py)
    Plain        any state_dict() of plain values or tensors, <name>.json or <name>.pt, by the writer
A save is one transaction (saving.py: tmp folder, every process writes its parts, all vote, the manifest last,
one rename publishes, then older checkpoints are pruned; the recovery of a crash between two renames). Here: the
parts, what a manifest records, reading back, the export and the file helpers. Reading back (load_checkpoint)
checks every part before any is changed. Which checkpoint to resume and what must match is resume.py's policy.
The template owns this format instead of `accelerator.save_state`, which writes straight into its final folder,
pickles RNG states, and trains on after a refused RNG file.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import random
import shutil
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_file, save_model

from adapters import (
    is_adapted,
    merged_weights,
    peft_format,
    trainable_weights,
    write_adapter_config,
)
from buffers import RankBuffers, ranks_keep_their_own, shared_buffers
from errors import CheckpointError, first_line
from hangs import patiently
from lm import save_tokenizer
from plumbing import collectively
from run_folder import LAYOUT, MANIFEST, RunFolder


@dataclass
class TrainState:
    """Where training is (a checkpoint part). Samples seen = step x global batch; the data position
    is its own part (batches.py, streaming.py)."""

    step: int = 0  # optimizer steps completed
    tracker_run_id: str = ""  # the W&B run to continue on resume
    # the LR schedule's horizon, fixed at the run's first start (see config.py)
    lr_decay_steps: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            setattr(self, f.name, state.get(f.name, f.default))


class ProcessRNG:
    """This process's random generators (Python, NumPy, torch, CUDA), as tensors and lists
    (weights_only)."""

    def state_dict(self) -> dict:
        np_state = np.random.get_state()
        version, words, gauss = random.getstate()
        state = {
            "python": [version, list(words), gauss],
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "torch": torch.get_rng_state(),
        }
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


# ---------------------------------------------------------------- the kinds of part


class Weights:
    """A module's weights as <name>.safetensors (tied weights stored once), written by the
    writer."""

    bound_to_world_size = False  # the same file at any world size

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def files(self, name: str, ranks: range) -> list[str]:
        return [f"{name}.safetensors"]

    def nbytes(self, ranks: range) -> int:
        return tensor_bytes(self.module.state_dict())

    def save(self, folder: Path, name: str, plumbing, writer: bool) -> None:
        if writer:
            save_safetensors(self.module, folder / f"{name}.safetensors")

    def check(self, folder: Path, name: str, plumbing) -> None:
        check_weights(folder / f"{name}.safetensors", self.module)

    def load(self, folder: Path, name: str, plumbing) -> None:
        load_model(self.module, str(folder / f"{name}.safetensors"))  # via CPU, copied in place

    def snapshot(self, folder: Path, name: str, process_group) -> StagedWeights:
        """A copy in CPU memory, to be written later (a background save, saving.py)."""
        weights, tied = without_tied_copies(self.module, cpu_copy(self.module.state_dict()))
        return StagedWeights(weights, tied)


class Trainable(Weights):
    """What trains of a module with adapters (adapters.py): the adapters' weights (and the buffers),
    as <name>.safetensors. The frozen weights are not saved: a resume rebuilds them from their
    source (the hub, --init_from, the seed) as the run's start did."""

    def nbytes(self, ranks: range) -> int:
        return tensor_bytes(trainable_weights(self.module))

    def save(self, folder: Path, name: str, plumbing, writer: bool) -> None:
        if writer:
            save_safetensors(
                cpu_copy(trainable_weights(self.module)), folder / f"{name}.safetensors"
            )

    def check(self, folder: Path, name: str, plumbing) -> None:
        check_weights(folder / f"{name}.safetensors", self.module, trainable_weights(self.module))

    def load(self, folder: Path, name: str, plumbing) -> None:
        saved = load_file(str(folder / f"{name}.safetensors"))
        with torch.no_grad():
            for key, tensor in trainable_weights(self.module).items():
                tensor.copy_(saved[key])

    def snapshot(self, folder: Path, name: str, process_group) -> StagedWeights:
        return StagedWeights(cpu_copy(trainable_weights(self.module)), {})


class StagedWeights(Weights):
    """Weights copied to CPU memory at the step of the save: the file save_model would write."""

    def __init__(self, weights: dict, tied: dict):
        self.weights = weights
        self.tied = tied

    def save(self, folder: Path, name: str, plumbing, writer: bool) -> None:
        if writer:
            save_safetensors(self.weights, folder / f"{name}.safetensors", self.tied)


class Sharded:
    """A sharded (FSDP) model's weights, or with `optimizer` that optimizer's state: every process
    writes and reads its own shards through torch.distributed.checkpoint (DCP), as the folder
    <name>/ (a .distcp file per process, and .metadata). DCP reshards on a resume at another world
    size."""

    bound_to_world_size = False

    def __init__(self, module, optimizer=None, trainable_only: bool = False):
        self.module = module
        self.optimizer = optimizer
        # a model with adapters: only what trains (Trainable's rule, shard by shard)
        self.trainable_only = trainable_only

    def files(self, name: str, ranks: range) -> list[str]:
        return []  # DCP names its own files: the manifest lists what it wrote

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        if self.optimizer is None:
            state = get_model_state_dict(self.module, options=self._options())
            return only_trainable(self.module, state) if self.trainable_only else state
        return get_optimizer_state_dict(self.module, self.optimizer)

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # not strict with adapters: load_state_dict gets the adapters only (DCP's load has already
        # refused a checkpoint missing any of them)
        return StateDictOptions(
            ignore_frozen_params=self.trainable_only, strict=not self.trainable_only
        )

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if self.optimizer is None:
            set_model_state_dict(self.module, state, options=self._options())
        else:
            set_optimizer_state_dict(self.module, self.optimizer, state)

    def nbytes(self, ranks: range) -> int:
        return tensor_bytes(
            self.state_dict()
        )  # a DTensor counts whole: the shards of all processes

    def save(self, folder: Path, name: str, plumbing, writer: bool) -> None:
        # collective: every process its shards, rank 0 the metadata
        self._dcp(folder, name, load=False)

    def check(self, folder: Path, name: str, plumbing) -> None:
        if not (folder / name).is_dir():
            raise sharding_mismatch(folder, name, saved="unsharded", now="sharded")

    def load(self, folder: Path, name: str, plumbing) -> None:
        self._dcp(folder, name, load=True)

    def snapshot(self, folder: Path, name: str, process_group) -> StagedSharded:
        """This process's shards copied to CPU memory (DCP's own stager: DTensors stay DTensors),
        written later by dcp.save with its collectives on `process_group`, a gloo group apart from
        training's (a background save, saving.py)."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(False, False, False, False))  # synchronous, unpinned
        try:
            staged = stager.stage(self.state_dict())
        finally:
            stager.close()
        return StagedSharded(staged, process_group)

    def _dcp(self, folder: Path, name: str, load: bool) -> None:
        """DCP reports a failure on any process to all of them as one BaseException: re-raised here
        as the first process's error."""
        import torch.distributed.checkpoint as dcp

        try:
            if load:
                dcp.load({name: self}, checkpoint_id=folder / name)
            else:
                dcp.save({name: self}, checkpoint_id=folder / name)
        except dcp.api.CheckpointException as e:
            raise first_failure(e) from None


class StagedSharded(Sharded):
    """A sharded part's state copied to CPU memory at the step of the save, written by the
    background writer (parts are written one after another there, so the collectives of two DCP
    saves never interleave)."""

    def __init__(self, staged: dict, process_group):
        self.staged = staged
        self.process_group = process_group

    def save(self, folder: Path, name: str, plumbing, writer: bool) -> None:
        import torch.distributed.checkpoint as dcp

        try:
            dcp.save(
                {name: self.staged}, checkpoint_id=folder / name, process_group=self.process_group
            )
        except dcp.api.CheckpointException as e:
            raise first_failure(e) from None


def first_failure(error) -> Exception:
    """DCP reports the failures of all processes as one exception: the first one's."""
    failure = next(iter(error.failures.values()))[0]
    return failure if isinstance(failure, Exception) else RuntimeError(str(failure))


class PerProcess:
    """A state each process has its own of, as <name>_rank{r}.pt, written and read by that process.
    On another world size there is no state for the new processes: a part `bound_to_world_size` (a
    stream's position) refuses the resume, any other (the RNG) starts afresh."""

    def __init__(self, state, bound_to_world_size: bool):
        self.state = state
        self.bound_to_world_size = bound_to_world_size

    def files(self, name: str, ranks: range) -> list[str]:
        return [f"{name}_rank{rank}.pt" for rank in ranks]

    def nbytes(self, ranks: range) -> int:
        return tensor_bytes(self.state.state_dict()) * len(ranks)

    def save(self, folder: Path, name: str, plumbing, writer: bool) -> None:
        write_file(folder / f"{name}_rank{plumbing.process_index}.pt", self.state.state_dict())

    def check(self, folder: Path, name: str, plumbing) -> None:
        read_file(folder / f"{name}_rank{plumbing.process_index}.pt")

    def load(self, folder: Path, name: str, plumbing) -> None:
        self.state.load_state_dict(read_file(folder / f"{name}_rank{plumbing.process_index}.pt"))

    def snapshot(self, folder: Path, name: str, process_group) -> PerProcess:
        return PerProcess(Frozen(cpu_copy(self.state.state_dict())), self.bound_to_world_size)


class Plain:
    """Any object with state_dict() / load_state_dict(), written by the writer: <name>.json if its
    state is plain values, else <name>.pt (tensors, read back weights_only)."""

    bound_to_world_size = False

    def __init__(self, state):
        self.state = state

    def files(self, name: str, ranks: range) -> list[str]:
        return []  # .json or .pt, decided by the state when it is written

    def nbytes(self, ranks: range) -> int:
        return tensor_bytes(self.state.state_dict())

    def save(self, folder: Path, name: str, plumbing, writer: bool) -> None:
        if not writer:
            return
        state = self.state.state_dict()
        # decided before encoding, not by json.dumps failing on the first tensor: a failed encode
        # leaves the state in a reference cycle of json's encoder (its circular-reference markers,
        # held by its nested functions and the error's frames) that only the cyclic GC frees, so a
        # background save's staged optimizer state outlived its save (+1 copy per save, measured)
        if not is_json(state):
            write_file(folder / f"{name}.pt", state)
            return
        write_file(folder / f"{name}.json", json.dumps(state, indent=2).encode())

    def check(self, folder: Path, name: str, plumbing) -> None:
        self._saved = read_file(self._path(folder, name))

    def load(self, folder: Path, name: str, plumbing) -> None:
        self.state.load_state_dict(self._saved)

    @staticmethod
    def _path(folder: Path, name: str) -> Path:
        json_file = folder / f"{name}.json"
        return json_file if json_file.is_file() else folder / f"{name}.pt"

    def snapshot(self, folder: Path, name: str, process_group) -> Plain:
        return Plain(Frozen(cpu_copy(self.state.state_dict())))


def is_json(value) -> bool:
    """Whether a state is plain values JSON keeps as they are (no tensors, no tuples)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_json(v) for k, v in value.items())
    if type(value) is list:
        return all(is_json(item) for item in value)
    return False


class Frozen:
    """A state as it was when copied: what a background save writes while training goes on."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state


def cpu_copy(value):
    """A state's copy in CPU memory (tensors copied, containers rebuilt, plain values copied)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: cpu_copy(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(cpu_copy(item) for item in value)
    return copy.deepcopy(value)


def as_part(value):
    """The kind of part for a value given to checkpoint_parts: a module's weights, or plain
    state."""
    if isinstance(value, (Weights, Sharded, PerProcess, Plain)):
        return value
    if isinstance(value, torch.nn.Module):
        return Weights(value)
    return Plain(value)


def checkpoint_parts(plumbing, model, optimizer, **others) -> dict:
    """The named parts a checkpoint saves and a resume restores: the model and optimizer (sharded
    under FSDP), each rank's buffers where the ranks keep their own, the ones given, this process's
    RNG, and fp16's loss scaler. A fork adds its own in
    one line, before the resume: parts["ema"] = ema_model."""
    module = plumbing.unwrap_model(model, keep_torch_compile=False)
    adapted = is_adapted(module)  # LoRA: only the adapters train, and are saved
    if is_sharded(module):  # no process holds all of it: each writes its shards
        model_part = Sharded(module, trainable_only=adapted)
        parts = {"model": model_part, "optimizer": Sharded(module, optimizer)}
    else:
        parts = {
            "model": Trainable(module) if adapted else Weights(module),
            "optimizer": Plain(optimizer),
        }
    if ranks_keep_their_own(model, plumbing.num_processes):
        # BatchNorm's running statistics without DDP's broadcast: each rank's own (buffers.py); on
        # another world size every rank starts from the model part's (rank 0's)
        parts["buffers"] = PerProcess(RankBuffers(module), bound_to_world_size=False)
    parts.update(others)
    parts["rng"] = PerProcess(ProcessRNG(), bound_to_world_size=False)
    if plumbing.scaler is not None:
        parts["scaler"] = plumbing.scaler
    return parts


def is_sharded(module) -> bool:
    # imported by whatever sharded the model (1.2 s to import)
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def sharding_mismatch(folder: Path, name: str, saved: str, now: str) -> CheckpointError:
    return CheckpointError(
        f"{folder} holds {name} {saved} and this run's is {now} (fsdp, or the accelerate config): resume with "
        f"the setting it was saved with, or start a new run from its weights with --init_from "
        f"(python scripts/consolidate.py makes one file of them)"
    )


# ---------------------------------------------------------------- what a manifest records


def run_geometry(plumbing, cfg) -> dict:
    """How the run splits its global batch; a resume needs the same global_batch and block_size, not
    the rest."""
    return {
        "world_size": plumbing.num_processes,
        "batch_size": cfg.batch_size,
        "grad_accum_steps": cfg.grad_accum_steps,
        "global_batch": cfg.global_batch(plumbing.num_processes),
        # the shipped LM's data key; None for a fork whose data.py declares none
        "block_size": getattr(cfg, "block_size", None),
        "optimizer": cfg.optimizer,
        # 0: every weight trains and is saved; else only LoRA adapters of this rank (adapters.py)
        "lora_r": cfg.lora_r,
    }


def tensor_bytes(state) -> int:
    """The bytes of the tensors in a state (dicts, lists, tuples), a shared storage counted once."""
    storages = {}

    def visit(value):
        if isinstance(value, torch.Tensor):
            if hasattr(value, "full_tensor"):  # a DTensor: its whole size, all shards
                storages[id(value)] = value.numel() * value.element_size()
            else:
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(state)
    return sum(storages.values())


# ---------------------------------------------------------------- read back


def read_manifest(folder: Path) -> dict:
    """What publish wrote: step, run (geometry and data identity), parts, files (bytes, xxh3_64)."""
    return read_file(Path(folder) / MANIFEST)


def checkpoint_problem(folder: Path) -> str | None:
    """What is wrong with a checkpoint folder (no manifest, a missing, truncated or altered file),
    or None."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"no readable {MANIFEST} (not a checkpoint, or its save never finished)"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != expected["bytes"]:
            return f"{name} is missing or not {expected['bytes']} bytes"
        if file_digest(path) != expected["xxh3_64"]:
            return f"{name} does not match its checksum (the file was altered or corrupted)"
    return None


def load_checkpoint(plumbing, folder: Path, parts: dict, same_world_size: bool) -> None:
    """Restore every part in place, after checking each against this run first (weights' names and
    shapes, sharded or not, every file readable): a refusal leaves everything as it was. On another
    world size, per-process parts are not read (the policy, resume.py, has refused those bound to
    the world size)."""
    kinds = {name: as_part(part) for name, part in parts.items()}
    if not same_world_size:
        kinds = {name: part for name, part in kinds.items() if not isinstance(part, PerProcess)}
    for name, part in kinds.items():
        if not isinstance(part, Sharded) and (folder / name).is_dir():
            raise sharding_mismatch(folder, name, saved="sharded", now="unsharded")
        part.check(folder, name, plumbing)
    for name, part in kinds.items():
        try:
            part.load(folder, name, plumbing)
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            raise CheckpointError(
                f"{folder}: its part '{name}' does not fit this run: {first_line(e)}"
            ) from None


def check_weights(path: Path, module: torch.nn.Module, expected: dict | None = None) -> None:
    """Raise listing mismatched names/shapes, before load_state_dict copies any tensor. `expected`:
    the tensors the file must hold (default: the module's whole state)."""
    if expected is None:
        expected = module.state_dict()
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as e:
        raise CheckpointError(f"{path} is not a safetensors file: {e}") from None
    problems = [f"unexpected {key}" for key in shapes if key not in expected]
    for key in shapes:
        if key in expected and shapes[key] != tuple(expected[key].shape):
            problems.append(f"{key} {list(shapes[key])} vs model {list(expected[key].shape)}")
    stored = set(shapes)
    for group in tied_weights(module):  # tied weights are stored once
        if set(group) & set(shapes):
            stored |= set(group)
    problems += [f"missing {key}" for key in expected if key not in stored]
    if not problems:
        return
    more = f" (+{len(problems) - 4} more)" if len(problems) > 4 else ""
    raise CheckpointError(
        f"{path} does not fit this model: {'; '.join(problems[:4])}{more}; build the model as it was saved "
        f"(the config.yaml beside it: model, n_layer, n_embd, bias, ...)"
    )


def load_weights_file(module: torch.nn.Module, path: Path) -> None:
    """A weights file (checked first) into a module, sharded or not. A module with LoRA adapters:
    the file is the model's without them (an earlier run's export), loaded into the frozen
    weights; the adapters keep their fresh start."""
    adapted = is_adapted(module)
    # a layer with an adapter keeps its own weight as <layer>.base_layer.weight
    names = {name.replace(".base_layer.", "."): name for name in module.state_dict()}
    without_adapters = {
        plain: module.state_dict()[name] for plain, name in names.items() if ".lora_" not in name
    }
    check_weights(path, module, without_adapters if adapted else None)
    if not is_sharded(module) and not adapted:
        load_model(module, str(path))
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    weights = load_file(str(path))  # every process reads the whole file and keeps its shards
    for group in tied_weights(module):  # the file holds one name of each tied group
        stored = next(weights[name] for name in group if name in weights)
        weights.update({name: stored for name in group})
    weights = {names.get(name, name): tensor for name, tensor in weights.items()}
    options = StateDictOptions(full_state_dict=is_sharded(module), strict=not adapted)
    set_model_state_dict(module, weights, options=options)


def tied_weights(module) -> list[list[str]]:
    """Groups of names that share one parameter (GPT's wte.weight and lm_head.weight): a file holds
    one."""
    names = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return [group for group in names.values() if len(group) > 1]


# ---------------------------------------------------------------- export


def export_model(plumbing, model, cfg) -> Path:
    """The trained weights as model.safetensors in the run folder (this node's, for a run on object
    storage: uploaded with the run files), with the buffers the evaluations used (BatchNorm's
    statistics: rank 0's, or the ranks' mean; buffers.py)."""

    def save_extras(folder):
        save_tokenizer(cfg, folder)

    adapted = is_adapted(plumbing.unwrap_model(model, keep_torch_compile=False))
    with shared_buffers(model, plumbing.num_processes):
        if adapted and not cfg.merge_adapter:
            return write_adapter(plumbing, model, cfg, save_extras)
        return write_export(plumbing, model, cfg.run_dir, save_extras, merge_adapters=adapted)


def write_adapter(plumbing, model, cfg, save_extras) -> Path:
    """A LoRA run's export: the adapter as peft saves it, adapter_model.safetensors and
    adapter_config.json (naming the base model), with the tokenizer, in the run folder (collective:
    a sharded adapter is gathered from every process first). PeftModel.from_pretrained(base model,
    run folder) loads it."""
    path = RunFolder.of(cfg).path("adapter")
    module = plumbing.unwrap_model(model, keep_torch_compile=False)
    if is_sharded(module):
        adapter = gathered_weights(module, trainable_only=True)
    else:
        adapter = cpu_copy(trainable_weights(module))

    def write():
        if not plumbing.is_main_process:
            return
        tmp = path.parent / "adapter.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_adapter_config(tmp, module, cfg)
        save_extras(tmp)
        save_safetensors(peft_format(adapter), tmp / path.name)
        for file in sorted(tmp.iterdir(), key=lambda f: f.suffix == ".safetensors"):  # weights last
            umask_mode(file)
            os.replace(file, path.parent / file.name)
        tmp.rmdir()

    with patiently("the export"):
        collectively(plumbing, f"exporting {path}", write)
    return path


def write_export(
    plumbing, model, output_dir: str, save_extras=None, merge_adapters: bool = False
) -> Path:
    """The trained weights as <output_dir>/model.safetensors, written by the main process
    (collective). A sharded model is gathered whole first, in the main process's CPU memory: the
    file is the same as an unsharded run's. A Hugging Face model is saved in its own layout too
    (config.json beside it), and `save_extras(folder)` adds files to it (its tokenizer):
    from_pretrained(output_dir) loads both."""
    path = Path(output_dir) / LAYOUT["export"]
    tmp = path.with_name(path.name + ".tmp")
    module = plumbing.unwrap_model(model, keep_torch_compile=False)
    weights = module
    metadata = None
    if merge_adapters:  # --merge_adapter: the weights a model without adapters loads
        whole = gathered_weights(module) if is_sharded(module) else cpu_copy(module.state_dict())
        weights, metadata = without_tied_copies(module, merged_weights(module, whole))
    elif is_sharded(module):
        weights, metadata = full_weights(module)

    def write_safetensors():
        save_safetensors(weights, tmp, metadata)
        os.replace(tmp, path)

    def write_pretrained():
        shutil.rmtree(tmp, ignore_errors=True)
        module.save_pretrained(tmp, state_dict=None if weights is module else weights)
        if save_extras is not None:
            save_extras(tmp)
        # the weights last
        for file in sorted(tmp.iterdir(), key=lambda f: f.suffix == ".safetensors"):
            umask_mode(file)
            os.replace(file, path.parent / file.name)
        tmp.rmdir()

    def write():
        if not plumbing.is_main_process:
            return
        if hasattr(module, "save_pretrained"):
            write_pretrained()
        else:
            write_safetensors()

    with patiently("the export"):  # gathering and writing the whole model takes a while
        collectively(plumbing, f"exporting {path}", write)
    return path


def full_weights(module) -> tuple[dict, dict]:
    """A sharded model's whole state dict on the main process ({} elsewhere; collective), and the
    tied names left out, as save_model leaves them out (it keeps the first in sorted order and notes
    {dropped: kept})."""
    return without_tied_copies(module, gathered_weights(module))


def gathered_weights(module, trainable_only: bool = False) -> dict:
    """A sharded model's whole state dict (or only what trains: its adapters) in the main process's
    CPU memory, {} elsewhere (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only
    )
    state = get_model_state_dict(module, options=options)
    return only_trainable(module, state) if trainable_only else state


def only_trainable(module, state: dict) -> dict:
    """The state's entries that train (trainable_weights' names). ignore_frozen_params alone keeps
    the second name of a tied frozen weight (the GPT's lm_head, a hub model's tied head): the whole
    embedding, in every adapter checkpoint."""
    trainable = trainable_weights(module).keys()
    return {name: value for name, value in state.items() if name in trainable}


def without_tied_copies(module, state: dict) -> tuple[dict, dict]:
    """The state without the second names of tied weights, and {dropped: kept}, as save_model
    stores them (it keeps the first name in sorted order)."""
    dropped = {}
    for group in tied_weights(module):
        kept, *others = sorted(group)
        dropped.update({name: kept for name in others})
    return {name: tensor for name, tensor in state.items() if name not in dropped}, dropped


# ---------------------------------------------------------------- files


def save_safetensors(weights, path: Path, metadata: dict | None = None) -> None:
    """A module's weights (or a state dict) as safetensors, with the mode any other file gets here
    (umask): safetensors creates its files 0600, which teammates on a shared filesystem could not
    read."""
    if isinstance(weights, torch.nn.Module):
        save_model(weights, str(path))
    else:
        save_file(weights, str(path), metadata=metadata or None)
    umask_mode(path)


def umask_mode(path: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_file(path: Path, data) -> None:
    """Bytes as they are, anything else with torch.save; on disk (fsync) before a manifest can name
    it."""
    with open(path, "wb") as f:
        if isinstance(data, bytes):
            f.write(data)
        else:
            torch.save(data, f)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def read_file(path: Path):
    """A .json file, or a tensor file through torch.load restricted to tensors and plain containers
    (a pickle that would run code is refused); anything else is a one-line CheckpointError naming
    the file."""
    try:
        if path.suffix == ".json":
            return json.loads(path.read_text())
        return torch.load(path, "cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path.parent} has no {path.name}: not a checkpoint, or not of this run"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(
            f"{path} refused: not a plain tensor file ({first_line(e)})"
        ) from None


def file_digest(path: Path) -> str:
    digest = xxhash.xxh3_64()  # ~10 GB/s: checksumming costs far less than writing
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
