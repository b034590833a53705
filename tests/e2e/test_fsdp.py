"""FSDP2 and HSDP on the torch path, through torchrun on CPU (gloo): training that matches DDP, sharded checkpoints
that resume bitwise after SIGTERM and kill -9, HSDP on two "nodes", and resharding a 4-process checkpoint onto 2.
(Accelerate's FSDP plugin needs GPUs; its configs are checked in tests/test_launch_configs.py.)"""

import importlib.util
import json
import shutil

import pytest
from test_two_node import STEPS, run_two_nodes, torchrun_node, two_node_args

from conftest import (
    FAULTY_MAIN,
    NEEDS_BLOCKS,
    REPO,
    assert_matches_baseline,
    baseline_args,
    launch_torchrun,
    load_weights,
    model_declares_blocks,
    read_metrics,
    tiny_args,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not model_declares_blocks(), reason=NEEDS_BLOCKS),
]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, corpus):
    """The baseline's run (2 processes, dropout, gradient accumulation, checkpoints every 8 steps), sharded."""
    out = tmp_path_factory.mktemp("fsdp") / "run"
    return launch_torchrun([*baseline_args(out, corpus), "--fsdp", "full"], out.parent).check()


def test_fsdp_trains_like_ddp_and_writes_sharded_checkpoints_and_one_whole_model(
    fsdp_run, baseline
):
    losses = fsdp_run.losses()
    assert sorted(losses) == list(range(1, 25))
    # measured: 1.5e-7 apart at most
    assert losses == pytest.approx(baseline.losses(), rel=1e-5, abs=0)
    evals = [
        [r["eval_loss"] for r in run.metrics() if "eval_loss" in r] for run in (fsdp_run, baseline)
    ]
    assert evals[0] == pytest.approx(evals[1], rel=1e-5, abs=0)
    latest = fsdp_run.output_dir / "checkpoints" / "step_00000024"
    files = set(json.loads((latest / "manifest.json").read_text())["files"])
    # every process wrote its shard, rank 0 the metadata; all checksummed
    for part in (
        "model",
        "optimizer",
    ):
        assert {f"{part}/.metadata", f"{part}/__0_0.distcp", f"{part}/__1_0.distcp"} <= files
    assert "model.safetensors" not in files and "optimizer.pt" not in files
    sharded, replicated = (
        load_weights(run.output_dir / "model.safetensors") for run in (fsdp_run, baseline)
    )
    # the export is the whole model, tied weights once, as DDP writes it
    assert sharded.keys() == replicated.keys()
    assert all((sharded[k] - replicated[k]).abs().max() < 1e-4 for k in sharded)


def test_one_command_turns_a_sharded_checkpoint_into_the_exported_file(tmp_path, fsdp_run):
    """scripts/consolidate.py, here in this process (no process group): step 24's shards are the export, byte for
    byte."""
    spec = importlib.util.spec_from_file_location(
        "consolidate", REPO / "scripts" / "consolidate.py"
    )
    consolidate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(consolidate)
    out = tmp_path / "model.safetensors"
    consolidate.consolidate(fsdp_run.output_dir / "checkpoints" / "step_00000024", out)
    assert out.read_bytes() == (fsdp_run.output_dir / "model.safetensors").read_bytes()


def test_fsdp_resumes_bitwise_after_sigterm_and_after_kill_9(tmp_path, corpus, fsdp_run):
    """SIGTERM on rank 1 at step 11 (checkpoint, exit 75), then kill -9 of rank 0 at step 17 of the resumed run
    (no checkpoint: back to step 16), then a clean resume: the uninterrupted FSDP run's losses and weights, ==."""
    run_dir = tmp_path / "run"
    args = [*baseline_args(run_dir, corpus), "--fsdp", "full"]
    faulty = {"FAULTY_ENTRY": "torch_ddp", "FAULT_ONCE": tmp_path / "once"}
    stopped = launch_torchrun(
        args,
        tmp_path,
        script=FAULTY_MAIN,
        env_extra={**faulty, "FAULT_STEP": 11, "FAULT_RANK": 1, "FAULT_ACTION": "sigterm"},
    )
    assert "exitcode  : 75" in stopped.output, stopped.tail()
    assert json.loads((run_dir / "preempted.json").read_text())["step"] == 11
    # rank 0 got no signal, yet stopped at the same step: it wrote its share of step 11's checkpoint, nothing after
    assert (run_dir / "checkpoints" / "step_00000011" / "rng_rank0.pt").exists()
    assert max(r["step"] for r in read_metrics(run_dir)) == 11
    # saved in the loop this time: the checkpoint of step 16 is published before step 17 (a save in
    # the background is published at a later logging step: tests/e2e/test_async_save.py)
    killed = launch_torchrun(
        [*args, "--resume", "latest", "--async_save", "false"],
        tmp_path,
        script=FAULTY_MAIN,
        env_extra={
            **faulty,
            "FAULT_ONCE": tmp_path / "once_kill",
            "FAULT_STEP": 6,
            "FAULT_RANK": 0,
            "FAULT_ACTION": "sigkill",
        },
    )
    assert killed.returncode != 0 and "(step 11)" in killed.output, killed.tail()
    resumed = launch_torchrun([*args, "--resume", "latest"], tmp_path).check()
    assert "(step 16)" in resumed.output
    assert_matches_baseline(run_dir, fsdp_run)


def test_hsdp_on_two_nodes_trains_and_its_checkpoint_resumes_resharded_on_two_processes(
    tmp_path, corpus, four_processes
):
    """2 torchrun "nodes" x 2 processes, sharded within a node and replicated across: steps 1-4 and a checkpoint;
    that 4-process checkpoint resumed on 2 processes (--fsdp full) at batch 8, the same global batch, to step 8.
    Against the 4-process DDP run (no dropout): the same losses up to float rounding."""
    out = tmp_path / "run"
    # the reference's LR schedule
    args = two_node_args(out, corpus, fsdp="hybrid", lr_decay_steps=8, max_steps=4)
    outputs = run_two_nodes(torchrun_node, args, tmp_path)
    assert "Traceback" not in outputs[0] + outputs[1], outputs[0][-3000:]
    reference = four_processes.losses()
    hsdp = {
        r["step"]: r["loss"]
        for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    }
    assert sorted(hsdp) == [1, 2, 3, 4] and hsdp == pytest.approx(
        {s: reference[s] for s in hsdp}, rel=1e-5, abs=0
    )
    shards = json.loads((out / "checkpoints" / "step_00000004" / "manifest.json").read_text())[
        "files"
    ]
    assert {f"{part}/__{r}_0.distcp" for part in ("model", "optimizer") for r in range(4)} <= set(
        shards
    )

    two = tmp_path / "two"
    shutil.copytree(out / "checkpoints" / "step_00000004", two / "checkpoints" / "step_00000004")
    resharded = launch_torchrun(
        [
            *tiny_args(two, corpus, **STEPS, batch_size=8, fsdp="full", lr_decay_steps=8),
            "--resume",
            "latest",
        ],
        tmp_path,
    ).check()
    assert "world_size 4 -> 2, batch_size 4 -> 8" in resharded.output, resharded.tail()
    assert resharded.losses() == pytest.approx(
        {s: v for s, v in reference.items() if s > 4}, rel=1e-5, abs=0
    )
