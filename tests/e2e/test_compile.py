"""--compile: each transformer block compiled in place, on both paths, under DDP and FSDP2, with the
compiled code kept in the run folder so that a resume compiles nothing again (compiling.py).

Compiled kernels fuse and reorder float operations, so a compiled run's losses are compared with the
eager run's within a tolerance (LOSS_TOLERANCE, relative): a resume that lost any state moves them
far more than that."""

import json
import math

import pytest

from compiling import MANIFEST as COMPILE_MANIFEST
from conftest import (
    NEEDS_BLOCKS,
    launch_accelerate,
    launch_torchrun,
    model_declares_blocks,
    read_metrics,
    tiny_args,
)

pytestmark = pytest.mark.slow

# measured on this machine: compiled vs eager differ by at most ~1e-7 relative over 6 steps;
# 1e-4 leaves room for another CPU's vector width, and is far below what a real bug moves
LOSS_TOLERANCE = 1e-4
STEPS = dict(max_steps=6, lr_decay_steps=6, warmup_steps=1, save_every=3, eval_every=3, log_every=1)


def losses(run_dir) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(run_dir) if "loss" in row}


def compile_counts(run_dir) -> list[tuple[int, int, int]]:
    """(step, graphs compiled, graphs from the cache) of each metrics row, as logged."""
    return [
        (row["step"], row["compile_graphs_compiled"], row["compile_graphs_cached"])
        for row in read_metrics(run_dir)
        if "compile_graphs_compiled" in row
    ]


def assert_close(compiled: dict, eager: dict) -> None:
    assert compiled.keys() == eager.keys()
    for step in compiled:
        assert math.isclose(compiled[step], eager[step], rel_tol=LOSS_TOLERANCE), (
            step,
            compiled[step],
            eager[step],
        )


@pytest.fixture(scope="module")
def eager(tmp_path_factory, corpus):
    """The reference both tests compare with: the eager run, Accelerate, 2 processes (DDP). A
    compiled run's kernels differ from eager's within the tolerance; FSDP2's from DDP's by less
    (1.5e-7 relative, tests/e2e/test_fsdp.py)."""
    folder = tmp_path_factory.mktemp("eager")
    run_dir = folder / "eager"
    launch_accelerate(tiny_args(run_dir, corpus, compile="false", **STEPS), folder).check()
    assert not compile_counts(run_dir)  # eager: nothing compiled, nothing reported
    return run_dir


def test_a_compiled_run_resumes_from_its_kept_cache_without_compiling_again(
    tmp_path, corpus, eager
):
    """Accelerate, 2 processes (DDP): a compiled run stopped at step 3 and resumed compiles no graph
    after the resume (dynamo's counters: every graph from the run folder's cache), and its losses
    are the uninterrupted eager run's within the tolerance. The kept cache's manifest lists the
    libraries and graphs inductor wrote."""
    resumed = tmp_path / "resumed"
    first_half = {**STEPS, "max_steps": 3}
    launch_accelerate(tiny_args(resumed, corpus, compile="true", **first_half), tmp_path).check()
    if not compile_counts(resumed) and not model_declares_blocks():
        pytest.skip(
            "this model compiled no graph (dynamo runs it eager: e.g. an nn.GRU): no compiled code to keep"
        )
    assert compile_counts(resumed), "a compiled run reported no compiled graph (compile_graphs_*)"
    assert (resumed / "compile_cache").is_dir()
    first_row = compile_counts(resumed)[0]
    assert first_row[1] > 0 and first_row[2] == 0  # cold: every graph compiled
    resume_args = [*tiny_args(resumed, corpus, compile="true", **STEPS), "--resume", "latest"]
    launch_accelerate(resume_args, tmp_path).check()
    after_resume = [row for row in compile_counts(resumed) if row[0] > 3]
    assert after_resume, compile_counts(resumed)
    for step, compiled, cached in after_resume:
        assert compiled == 0 and cached > 0, (step, compiled, cached)
    # each start's restart report says it: the cold start compiled, the resume found it all kept
    cold, warm = [row for row in read_metrics(resumed) if "start" in row]
    assert cold["compile_graphs_compiled"] > 0 and cold["compile_graphs_cached"] == 0, cold
    assert warm["compile_graphs_compiled"] == 0 and warm["compile_graphs_cached"] > 0, warm
    assert warm["start_first_step_s"] < cold["start_first_step_s"]
    assert_close(losses(resumed), losses(eager))

    # what inductor wrote is what the kept cache's manifest checks before a resume reads it: its
    # compiled libraries and its graphs, each with its size and digest (a damaged one is set aside:
    # tests/test_compiling.py damages each kind)
    listed = json.loads((resumed / "compile_cache" / COMPILE_MANIFEST).read_text())
    written = {
        str(path.relative_to(resumed / "compile_cache"))
        for path in (resumed / "compile_cache").rglob("*")
        if path.is_file() and path.name != COMPILE_MANIFEST
    }
    assert any(name.endswith(".so") for name in listed) and any("fxgraph" in n for n in listed)
    assert set(listed) <= written, sorted(set(listed) - written)[:5]


@pytest.mark.skipif(not model_declares_blocks(), reason=NEEDS_BLOCKS)
def test_regional_compile_under_fsdp2_with_activation_checkpointing_on_the_torch_path(
    tmp_path, corpus, eager
):
    """torchrun, 2 processes, FSDP2 (full), every block recomputed in backward: the blocks compile
    (through the checkpoint) and the losses are the eager DDP run's within the tolerance."""
    args = dict(fsdp="full", activation_checkpointing="true", **STEPS)
    compiled = tmp_path / "compiled"
    launch_torchrun(tiny_args(compiled, corpus, compile="true", **args), tmp_path).check()
    assert compile_counts(compiled)[0][1] > 0
    assert_close(losses(compiled), losses(eager))
