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

Dynamo's counters say what happened: `report()` gives how many graphs were compiled and how many came
from the cache, logged in metrics.jsonl (compile_graphs_compiled, compile_graphs_cached).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from errors import ConfigError
from lm import transformer_blocks

CACHE_FOLDER = "compile_cache"


def compile_wanted(setting: str) -> bool:
    """config.compile: auto | true | false."""
    if setting == "auto":
        return torch.cuda.is_available()
    return setting == "true"


def compile_model(plain_model: torch.nn.Module, output_dir: str) -> None:
    """Compile the model's blocks (or all of it) in place, inside whatever prepare() wrapped it in
    (DDP, FSDP), which needs nothing more. Call after the model's first eager forward (the loss
    contract check, on a batch of 2): a graph first traced at that size would be traced again with a
    dynamic batch dimension, which runs slower."""
    keep_compiled_code(output_dir)
    try:
        blocks = transformer_blocks(plain_model, "regional compilation")
    except ConfigError:
        blocks = [plain_model]  # no blocks declared: the whole model, one graph
    for block in blocks:
        block.compile()


def keep_compiled_code(output_dir: str) -> None:
    """Point inductor's cache at the run folder, unless the user pointed it somewhere. Read by
    inductor at each use, so setting it before the first compile is enough."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(output_dir, CACHE_FOLDER).absolute())


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
