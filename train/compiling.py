"""torch.compile that pays for itself: block by block, with the compiled code kept in the run folder.

    --compile auto     (the default) on where CUDA is present, off on a CPU
    --compile true     compile here too (a C++ toolchain on CPU: gcc or clang)
    --compile false    eager

Regional: each transformer block (the class `_no_split_modules` names, the unit FSDP and activation
checkpointing already use) is compiled in place, and every block shares one compiled graph, so the
compile time does not grow with depth (torchtitan compiles this way; Accelerate calls it regional
compilation). A model without blocks (a fork's) is compiled whole. In place (nn.Module.compile): no
wrapper module, so state_dict names, DDP, FSDP2 and checkpoints are unchanged.

Kept: inductor's cache folder (the generated code, the C++ libraries or Triton kernels, the graph and
autograd caches) is <output_dir>/compile_cache, unless TORCHINDUCTOR_CACHE_DIR is set. A resume or
requeue of the run finds every graph there and compiles nothing again. Measured on this project's
2-core CPU (the default model, bench/compile.py): cold 22 s, from the kept folder 2 s.
torch.compiler.save_cache_artifacts was measured too: its bytes hold no C++ libraries, so a CPU
resume from them still takes 14 s of compiling.

Checked: the kept folder holds MANIFEST.json, each file's size and sha256, brought up to date by the
process that writes the run folder (plumbing.is_writer) before each checkpoint, the point a resume
starts from. Before anything compiles, a resume checks the folder against it (KeptCache.check): a
file cut short, garbled or missing (an interrupted copy of the run folder leaves its libraries cut
short; inductor then fails in the C++ compiler at the first step, or reloads garbled graphs with a
traceback each) sets the whole folder aside as compile_cache.damaged, with one warning line, and the
run compiles cold. A file the manifest does not list was written after the last checkpoint by a run
that was then stopped, maybe killed while writing it (the C++ compiler writes its library in place):
it is removed, and its graph compiles again. A folder named by TORCHINDUCTOR_CACHE_DIR is the user's
and is neither checked nor changed.

Dynamo's counters say what happened: `report()` gives how many graphs were compiled and how many came
from the cache, logged in metrics.jsonl (compile_graphs_compiled, compile_graphs_cached).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from blocks import transformer_blocks
from errors import ConfigError
from plumbing import is_writer
from profiling import start_clock
from run_folder import RunFolder

MANIFEST = "MANIFEST.json"
SET_ASIDE_SUFFIX = ".damaged"
# inductor's lock files, and its files being written (".<pid>.<thread>.tmp", then renamed)
NOT_CACHED = ("locks",)


def compile_wanted(setting: str) -> bool:
    """config.compile: auto | true | false."""
    if setting == "auto":
        return torch.cuda.is_available()
    return setting == "true"


def compile_model(plain_model: torch.nn.Module) -> None:
    """Compile the model's blocks (or all of it) in place, inside whatever prepare() wrapped it in
    (DDP, FSDP), which needs nothing more. Call after the model's first eager forward (the loss
    contract check, on a batch of 2): a graph first traced at that size would be traced again with a
    dynamic batch dimension, which runs slower; and after keep_compiled_code."""
    try:
        blocks = transformer_blocks(plain_model, "regional compilation")
    except ConfigError:
        blocks = [plain_model]  # no blocks declared: the whole model, one graph
    for block in blocks:
        block.compile()


def compile_and_keep(cfg, plumbing, plain_model: torch.nn.Module) -> KeptCache | None:
    """--compile: the model compiled block by block (compile_model), its compiled code kept in the
    run folder and checked before any rank reads it (keep_compiled_code). The kept cache, for the
    checkpointer to list at each save; None when nothing is compiled or the user keeps the cache."""
    start_clock.lap("model")  # the restart report's: built, wrapped and checked (profiling.py)
    if not compile_wanted(cfg.compile):
        return None
    folder = RunFolder.of(cfg)
    writer = is_writer(plumbing, folder.shared)
    if cfg.shared_filesystem:
        writer_goes_first = plumbing.main_process_first
    else:
        writer_goes_first = plumbing.local_main_process_first
    kept_cache = keep_compiled_code(folder.path("compile_cache"), writer, writer_goes_first)
    compile_model(plain_model)  # block by block, in place
    start_clock.lap("compiled code cache")  # the compiling itself: in the first step
    return kept_cache


def keep_compiled_code(
    folder: Path, writer: bool, writer_goes_first: Callable[[], AbstractContextManager]
) -> KeptCache | None:
    """Point inductor's cache at the run folder, unless the user pointed it somewhere (then None).
    Read by inductor at each use, so setting it before the first compile is enough. `writer`: this
    process checks the folder (the others wait for it in `writer_goes_first`) and keeps its
    manifest."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return None
    folder = Path(folder).absolute()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    kept = KeptCache(folder, writer)
    with writer_goes_first():
        damaged = kept.check()
    if damaged:
        # by the writer of each node's folder, which may not be the process that logs
        print(f"warning: {damaged}", file=sys.stderr, flush=True)  # noqa: T201
    return kept


class KeptCache:
    """The run folder's compile cache and its manifest: {relative path: [size, sha256]}. Files are
    named by a hash of what they hold and never rewritten, so a file's digest is taken once."""

    def __init__(self, folder: Path, writer: bool):
        self.folder = folder
        self.writer = writer
        self.listed: dict[str, list] = {}
        self.graphs_listed = 0  # graphs compiled in this process at the last record()

    def check(self) -> str | None:
        """On the writer, before any process compiles: the warning if the folder was set aside."""
        if not self.writer or not self.folder.is_dir():
            return None
        damage = self.damage()
        if damage is None:
            return None
        set_aside = self.folder.with_name(self.folder.name + SET_ASIDE_SUFFIX)
        shutil.rmtree(set_aside, ignore_errors=True)  # an older damaged folder
        self.folder.rename(set_aside)
        self.listed = {}
        return (
            f"the kept compile cache {self.folder} is damaged ({damage}); set aside as "
            f"{set_aside.name}, compiling cold"
        )

    def damage(self) -> str | None:
        """What is wrong with the folder against its manifest, or None; removes unlisted files."""
        try:
            listed = json.loads((self.folder / MANIFEST).read_text())
        except FileNotFoundError:
            listed = {}  # no checkpoint was written: nothing was recorded
        except (OSError, ValueError) as error:
            return f"{MANIFEST} unreadable: {error}"
        for name, (size, digest) in sorted(listed.items()):
            path = self.folder / name
            if not path.is_file():
                return f"{name} missing"
            if path.stat().st_size != size:
                return f"{name}: {path.stat().st_size} bytes, {size} written"
            if sha256(path) != digest:
                return f"{name}: its content changed"
        for path in self.cached_files():
            if path.relative_to(self.folder).as_posix() not in listed:
                path.unlink()
        self.listed = listed
        return None

    def record(self) -> None:
        """On the writer, before a checkpoint: the manifest lists every file now there when graphs
        were compiled since the last record (every rank has compiled what the steps and
        evaluations so far needed: their collectives came after)."""
        from torch._dynamo.utils import counters

        graphs_compiled = counters["inductor"]["fxgraph_cache_miss"]
        if not self.writer or graphs_compiled == self.graphs_listed:
            return
        self.graphs_listed = graphs_compiled
        for path in self.cached_files():
            name = path.relative_to(self.folder).as_posix()
            if name not in self.listed:
                self.listed[name] = [path.stat().st_size, sha256(path)]
        partial = self.folder / f".{MANIFEST}.{os.getpid()}.tmp"
        partial.write_text(json.dumps(self.listed, indent=0, sort_keys=True))
        partial.replace(self.folder / MANIFEST)

    def cached_files(self) -> list[Path]:
        """Inductor's files: not the manifest, its locks or a file being written."""
        return [
            path
            for path in self.folder.rglob("*")
            if path.is_file()
            and path.name != MANIFEST
            and not path.name.startswith(".")
            and path.relative_to(self.folder).parts[0] not in NOT_CACHED
        ]


def sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def report() -> dict:
    """Graphs compiled and graphs found in the cache, so far in this process (forward and backward
    count apart); {} when nothing was compiled."""
    if "torch._dynamo" not in sys.modules:  # nothing was compiled, and importing it takes 1 s
        return {}
    from torch._dynamo.utils import counters

    compiled = counters["inductor"]["fxgraph_cache_miss"]
    cached = counters["inductor"]["fxgraph_cache_hit"]
    if not compiled and not cached:
        return {}
    return {"compile_graphs_compiled": compiled, "compile_graphs_cached": cached}
