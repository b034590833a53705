"""LoRA adapters (--lora_r) on 2 processes, on the shipped GPT (its frozen weights from the seed):
- FSDP2 (the torch path, torchrun; Accelerate's FSDP plugin needs GPUs): one rank SIGKILLed
  after the step-8 checkpoint, then --resume latest. Each rank's own shards of every adapter
  tensor after the resume equal the uninterrupted run's at step 8 (accelerate PR #4206: every
  rank but the first got its adapter shards back at their initial values), and the run ends
  with the uninterrupted run's losses and export, to the bit;
- DDP (the Accelerate path): the same kill and resume, to the bit;
- a checkpoint holds the adapters and their optimizer state only: against the same GPT's full
  checkpoint (the shared baseline run's), its model and optimizer files are a small fraction.
"""

import importlib.util
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import (
    FAULTY_MAIN,
    NEEDS_BLOCKS,
    REPO,
    baseline_args,
    launch_torchrun,
    load_weights,
    model_declares_blocks,
    read_metrics,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not model_declares_blocks(), reason=NEEDS_BLOCKS),
]

LORA = ["--lora_r", "4", "--lora_alpha", "8"]


def lora_args(output_dir, corpus, *extra):
    return [*baseline_args(output_dir, corpus, max_steps=16, eval_every=8), *LORA, *extra]


def same_bits(run_dir, reference_dir) -> None:
    """Every step's loss, and the exported adapter, as the uninterrupted run's."""
    losses, expected = (
        {row["step"]: row["loss"] for row in read_metrics(folder) if "loss" in row}
        for folder in (run_dir, reference_dir)
    )
    assert losses == expected and len(losses) == 16
    adapter, reference = (
        load_weights(folder / "adapter_model.safetensors") for folder in (run_dir, reference_dir)
    )
    assert adapter.keys() == reference.keys() and adapter
    assert all(torch.equal(adapter[name], reference[name]) for name in adapter)


def step_8_adapters(run_dir, tmp_path) -> dict:
    """The uninterrupted run's adapter tensors at step 8, whole, read from its shards in this
    process by scripts/consolidate.py."""
    spec = importlib.util.spec_from_file_location(
        "consolidate", REPO / "scripts" / "consolidate.py"
    )
    consolidate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(consolidate)
    consolidate.consolidate(
        run_dir / "checkpoints" / "step_00000008", tmp_path / "step_8.safetensors"
    )
    return load_weights(tmp_path / "step_8.safetensors")


@pytest.fixture(scope="module")
def lora_fsdp(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("lora_fsdp") / "run"
    args = lora_args(out, corpus, "--fsdp", "full")
    return launch_torchrun(args, out.parent).check()


def test_fsdp_each_rank_gets_its_own_adapter_shards_back_and_the_run_ends_bitwise(
    tmp_path, corpus, lora_fsdp, baseline
):
    run_dir = tmp_path / "run"
    args = lora_args(run_dir, corpus, "--fsdp", "full")
    env = {"FAULT_STEP": 11, "FAULT_RANK": 1, "FAULT_ACTION": "sigkill"}
    env.update(FAULT_ONCE=tmp_path / "once", FAULTY_ENTRY="torch_ddp")
    killed = launch_torchrun(args, tmp_path, script=FAULTY_MAIN, env_extra=env)
    assert killed.returncode != 0
    record = {"RECORD_ADAPTERS": tmp_path / "adapters", "FAULTY_ENTRY": "torch_ddp"}
    resumed = launch_torchrun(
        [*args, "--resume", "latest"], tmp_path, script=FAULTY_MAIN, env_extra=record
    ).check()
    assert "(step 8)" in resumed.output
    # the shards hold the adapters alone: DCP's metadata lists every tensor the checkpoint holds
    step_8 = lora_fsdp.output_dir / "checkpoints" / "step_00000008" / "model"
    saved = dcp.FileSystemReader(step_8).read_metadata().state_dict_metadata
    assert saved and all(".lora_" in name for name in saved), sorted(saved)[:3]
    expected = step_8_adapters(lora_fsdp.output_dir, tmp_path)
    assert expected and all(".lora_" in name for name in expected)
    for rank in (0, 1):
        held = torch.load(tmp_path / "adapters" / f"rank{rank}.pt", weights_only=True)
        assert held.keys() == expected.keys()
        for name, whole in expected.items():
            # FSDP2 shards dim 0: rank r holds the r-th of 2 chunks
            own = torch.chunk(whole, 2, dim=0)[rank]
            assert torch.equal(held[name], own), (rank, name)
    # lora_B starts at zero: a shard back at its initial value would be all zeros
    assert any(
        not torch.equal(w, torch.zeros_like(w)) for n, w in expected.items() if "lora_B" in n
    )
    same_bits(run_dir, lora_fsdp.output_dir)

    def model_and_optimizer_bytes(run_dir) -> int:
        step_16 = run_dir / "checkpoints" / "step_00000016" / "manifest.json"
        files = json.loads(step_16.read_text())["files"]
        return sum(
            f["bytes"] for name, f in files.items() if name.startswith(("model", "optimizer"))
        )

    # against the same GPT's full checkpoint (the shared baseline run's, unsharded): at width 64,
    # rank 4 adapters are 8% of the parameters, 0.23x the bytes with DCP's own files (at width 512,
    # rank 16: 0.04x, bench/lora_memory.py); a checkpoint that kept a frozen weight would be more
    lora_bytes = model_and_optimizer_bytes(lora_fsdp.output_dir)
    full_bytes = model_and_optimizer_bytes(baseline.output_dir)
    assert lora_bytes < full_bytes / 3, (lora_bytes, full_bytes)
