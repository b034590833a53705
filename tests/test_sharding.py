"""FSDP2 on the torch path and sharded checkpoints, in one process (a gloo group of 1, a 1-process mesh): how the
model is sharded, that sharded parts round-trip bitwise through the commit protocol, the export, and the
one-line refusals, and the FSDP plugin main.py gives accelerate from --fsdp. Several processes, HSDP
and resharding: tests/e2e/test_fsdp.py. Also: the DDP knobs."""

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
from accelerate.utils import FullyShardedDataParallelPlugin
from safetensors.torch import load_model

import checkpoint
import resume as resuming
import saving
from blocks import checkpoint_activations, transformer_blocks
from checkpoint import TrainState
from conftest import NEEDS_BLOCKS, REPO, free_port, model_declares_blocks
from errors import CheckpointError, ConfigError
from model import build_model
from optim import build_optimizer
from plumbing import build_accelerator
from run_config import config_class
from sharding import fsdp_setting
from torch_ddp import TorchDDP

RunConfig = config_class()  # TrainConfig and model.py's and data.py's own keys


IDENTITY = {"seed": 1337}


@pytest.fixture
def launched(monkeypatch):
    """The environment torchrun gives one process; the process group is torn down after the test."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    for key, value in dict(RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, LOCAL_WORLD_SIZE=1).items():
        monkeypatch.setenv(key, str(value))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def cfg_for(tmp_path, **kw):
    return RunConfig(
        **{
            "output_dir": str(tmp_path / "run"),
            "n_layer": 2,
            "n_head": 2,
            "n_embd": 16,
            "block_size": 8,
            **kw,
        }
    )


def train_a_step(model, optimizer, seed=0):
    torch.manual_seed(seed)
    tokens = torch.randint(0, 256, (2, 8))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def snapshot(model, optimizer):
    """Weights and every optimizer state tensor, unsharded, as plain copies."""
    weights = {k: full(v).detach().clone() for k, v in model.state_dict().items()}
    state = [{k: full(v).clone() for k, v in s.items()} for s in optimizer.state.values()]
    return weights, state


def sharded_job(tmp_path, **kw):
    if not model_declares_blocks():
        pytest.skip(NEEDS_BLOCKS)
    cfg = cfg_for(tmp_path, fsdp="full", **kw)
    plumbing = TorchDDP(cfg)
    torch.manual_seed(0)
    model = build_model(cfg)
    model, optimizer = plumbing.prepare(model, build_optimizer(model, cfg))
    return cfg, plumbing, model, optimizer


def test_fsdp_shards_each_block_and_the_root_and_the_optimizer_steps_the_shards_with_checkpointing(
    tmp_path, launched
):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if not model_declares_blocks():
        pytest.skip(NEEDS_BLOCKS)
    cfg = cfg_for(tmp_path, fsdp="full")
    plumbing = TorchDDP(cfg)
    model = build_model(cfg)
    # as train() does with --activation_checkpointing true: it composes with FSDP
    checkpoint_activations(model)
    optimizer = build_optimizer(model, cfg)
    model, optimizer = plumbing.prepare(model, optimizer)
    assert isinstance(model, FSDPModule) and all(
        isinstance(block, FSDPModule) for block in transformer_blocks(model, "fsdp")
    )
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert stepped == {
        id(p) for p in model.parameters()
    }  # the sharded parameters, not the ones built
    assert all(isinstance(p, DTensor) for p in model.parameters())
    before = {k: full(v).clone() for k, v in model.state_dict().items()}
    train_a_step(model, optimizer)
    assert not torch.equal(
        before["blocks.0.mlp.fc.weight"], full(model.state_dict()["blocks.0.mlp.fc.weight"])
    )


def test_a_sharded_checkpoint_round_trips_bitwise_inside_the_commit_protocol(tmp_path, launched):
    cfg, plumbing, model, optimizer = sharded_job(tmp_path)
    train_a_step(model, optimizer)
    state = TrainState()
    parts = checkpoint.checkpoint_parts(
        plumbing, model=model, optimizer=optimizer, train_state=state
    )
    assert isinstance(parts["model"], checkpoint.Sharded) and isinstance(
        parts["optimizer"], checkpoint.Sharded
    )
    state.step = 1
    folder = save_checkpoint(plumbing, cfg, parts, 1, IDENTITY)
    saved = snapshot(model, optimizer)
    files = json.loads((folder / "manifest.json").read_text())["files"]
    # each a torch.distributed.checkpoint folder, every file checksummed
    for part in (
        "model",
        "optimizer",
    ):
        assert {f"{part}/.metadata", f"{part}/__0_0.distcp"} <= set(files)
    train_a_step(model, optimizer, seed=1)  # move away from the saved state, then come back
    assert checkpoint.checkpoint_problem(folder) is None
    resuming.resume_from(plumbing, cfg, folder, parts, IDENTITY)
    weights, optimizer_state = snapshot(model, optimizer)
    assert all(torch.equal(weights[k], saved[0][k]) for k in weights)
    assert all(
        torch.equal(a[k], b[k]) for a, b in zip(optimizer_state, saved[1], strict=True) for k in a
    )
    shard = folder / "model" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-8] + b"altered!")
    assert "model/__0_0.distcp does not match its checksum" in checkpoint.checkpoint_problem(folder)


def test_sharded_and_unsharded_checkpoints_refuse_each_other_in_one_line(tmp_path, launched):
    cfg, plumbing, model, optimizer = sharded_job(tmp_path)
    parts = checkpoint.checkpoint_parts(
        plumbing, model=model, optimizer=optimizer, train_state=TrainState()
    )
    sharded = save_checkpoint(plumbing, cfg, parts, 1, IDENTITY)
    unsharded_cfg = cfg_for(tmp_path / "b")
    plain = TorchDDP(unsharded_cfg)
    plain_model = build_model(unsharded_cfg)
    plain_parts = checkpoint.checkpoint_parts(
        plain,
        model=plain_model,
        optimizer=build_optimizer(plain_model, cfg),
        train_state=TrainState(),
    )
    with pytest.raises(
        CheckpointError, match="holds model sharded and this run's is unsharded"
    ) as refused:
        resuming.resume_from(plain, unsharded_cfg, sharded, plain_parts, IDENTITY)
    assert "\n" not in str(refused.value)
    unsharded = save_checkpoint(plain, unsharded_cfg, plain_parts, 1, IDENTITY)
    with pytest.raises(CheckpointError, match="holds model unsharded and this run's is sharded"):
        resuming.resume_from(plumbing, cfg, unsharded, parts, IDENTITY)


def test_the_export_of_a_sharded_model_is_an_ordinary_model_file_and_init_from_reads_it_back(
    tmp_path, launched
):
    cfg, plumbing, model, optimizer = sharded_job(tmp_path)
    train_a_step(model, optimizer)
    (tmp_path / "run").mkdir()
    path = checkpoint.write_export(plumbing, model, cfg.output_dir)
    plain = build_model(cfg)  # no process group needed to use it
    # strict: every weight there, tied ones once, as an unsharded run writes it
    load_model(plain, str(path))
    trained = {k: full(v) for k, v in model.state_dict().items()}
    assert all(torch.equal(v, trained[k]) for k, v in plain.state_dict().items())
    unsharded = tmp_path / "unsharded.safetensors"
    checkpoint.save_safetensors(plain, unsharded)
    assert path.read_bytes() == unsharded.read_bytes()
    fresh = plumbing.prepare(build_model(cfg))
    resuming.init_weights(plumbing.unwrap_model(fresh, keep_torch_compile=False), str(path))
    assert all(torch.equal(full(v), trained[k]) for k, v in fresh.state_dict().items())


def test_fsdp_without_a_launcher_and_on_main_py_are_one_line_errors(tmp_path, monkeypatch):

    # no MASTER_ADDR: no process group to shard over
    plumbing = TorchDDP(cfg_for(tmp_path, fsdp="full"))
    with pytest.raises(ConfigError, match="fsdp needs a process group: launch with torchrun"):
        plumbing.prepare(build_model(plumbing.cfg))
    # accelerate shards GPU processes only: on CPU, --fsdp on main.py says so and names the torch path
    with pytest.raises(
        ConfigError,
        match="fsdp hybrid on main.py needs CUDA GPUs: accelerate shards GPU processes only .* "
        "torchrun --nproc_per_node N train/torch_ddp.py --fsdp hybrid",
    ):
        build_accelerator(cfg_for(tmp_path, fsdp="hybrid"))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match="set fsdp_version: 2"):
        build_accelerator(cfg_for(tmp_path))


def accelerator_arguments(monkeypatch) -> dict:
    """What plumbing.build_accelerator passes to accelerate.Accelerator, recorded instead of building one
    (filled at each call)."""
    import accelerate

    built = {}

    class Recorder:
        num_processes = 1

        def __init__(self, **kwargs):
            built.update(kwargs)

    monkeypatch.setattr(accelerate, "Accelerator", Recorder)
    return built


def plugin_from_the_accelerate_config(name: str, monkeypatch):
    """The FSDP plugin an Accelerator builds from what `accelerate launch --config_file <name>`
    hands its processes (accelerate's own launcher code, without starting them)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(
        ["--config_file", str(REPO / "accelerate_configs" / name), "train/main.py"]
    )
    _validate_launch_command(args)
    with monkeypatch.context() as env:
        for key, value in prepare_multi_gpu_env(args).items():
            if key.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_CONFIG_")):
                env.setenv(key, value)
        return FullyShardedDataParallelPlugin(), prepare_multi_gpu_env(args)


# every field of accelerate's plugin but the mixed precision policy (ours: fp32 reduction, asserted)
FSDP_FIELDS = [
    field.name
    for field in dataclasses.fields(FullyShardedDataParallelPlugin)
    if field.name != "mixed_precision_policy"
]


@pytest.mark.parametrize("fsdp, yaml", [("full", "fsdp_8gpu.yaml"), ("hybrid", "2node_hsdp.yaml")])
def test_fsdp_on_main_py_under_torchrun_is_the_accelerate_config_s_fsdp(
    tmp_path, monkeypatch, fsdp, yaml
):
    """`torchrun train/main.py --fsdp full --mixed_precision bf16` (no accelerate config read: what
    Kubeflow Trainer and SkyPilot start) gives the Accelerator the plugin that `accelerate launch
    --config_file accelerate_configs/fsdp_8gpu.yaml` gives it, field by field and in the blocks it
    wraps, with the fp32 gradient reduction; hybrid on 2 nodes x 8 the same 2 x 8 mesh as
    2node_hsdp.yaml. (The Accelerator is not started: FSDP through accelerate needs GPUs.)"""
    import plumbing as plumbings

    expected, launched = plugin_from_the_accelerate_config(yaml, monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "16" if fsdp == "hybrid" else "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(plumbings, "init_process_group", lambda timeout_s: None)
    monkeypatch.setattr(plumbings, "check_world_size", lambda n: None)
    built = accelerator_arguments(monkeypatch)
    cfg = cfg_for(tmp_path, fsdp=fsdp, mixed_precision="bf16")
    build_accelerator(cfg)
    plugin = built["fsdp_plugin"]
    differ = [f for f in FSDP_FIELDS if getattr(plugin, f) != getattr(expected, f)]
    assert not differ, [(f, getattr(plugin, f), getattr(expected, f)) for f in differ]
    if model_declares_blocks():
        for each in (plugin, expected):
            each.set_auto_wrap_policy(build_model(RunConfig(n_layer=2, n_head=2, n_embd=16)))
        wrapped = plugin.auto_wrap_policy.keywords["transformer_layer_cls"]
        assert wrapped == expected.auto_wrap_policy.keywords["transformer_layer_cls"]
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    mesh = built["parallelism_config"]
    if fsdp == "full":
        assert mesh is None
    else:
        assert (mesh.dp_replicate_size, mesh.dp_shard_size) == (
            int(launched["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"]),
            int(launched["PARALLELISM_CONFIG_DP_SHARD_SIZE"]),
        )
    assert fsdp_setting(cfg) == f"{fsdp} (--fsdp)"


KNOBS = dict(
    static_graph=True, gradient_as_bucket_view=True, bucket_cap_mb=7, broadcast_buffers=False
)


def test_the_ddp_knobs_reach_accelerates_ddp(tmp_path):

    accelerator = build_accelerator(cfg_for(tmp_path, **KNOBS))
    assert {k: v for k, v in accelerator.ddp_handler.to_kwargs().items() if k in KNOBS} == KNOBS


def test_the_ddp_knobs_reach_ddp_on_the_torch_path(tmp_path, launched):
    from plumbing import init_process_group

    cfg = cfg_for(tmp_path, **KNOBS)
    init_process_group(60)
    plumbing = TorchDDP(cfg)
    plumbing.distributed = True  # a group of 1 is still DDP
    ddp = plumbing.prepare(build_model(cfg))
    assert (ddp.static_graph, ddp.gradient_as_bucket_view, ddp.broadcast_buffers) == (
        True,
        True,
        False,
    )
    assert ddp.bucket_bytes_cap == 7 * 1024 * 1024
    # left at DDP's defaults, nothing is passed (nor warned about)
    assert RunConfig().ddp_options() == {}


def test_accelerates_fsdp_reduces_gradients_in_fp32_under_bf16_as_the_torch_path_does(
    tmp_path, monkeypatch
):
    """accelerate's own FSDP2 policy for bf16 reduces in bf16; main.py hands it the torch path's policy. (The plugin
    is built from what `accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml` sets.)"""

    for key, value in dict(
        ACCELERATE_USE_FSDP="true",
        FSDP_VERSION="2",
        ACCELERATE_MIXED_PRECISION="bf16",
        FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP",
    ).items():
        monkeypatch.setenv(key, value)
    built = accelerator_arguments(monkeypatch)
    build_accelerator(cfg_for(tmp_path))
    policy = built["fsdp_plugin"].mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    build_accelerator(cfg_for(tmp_path))
    assert built["fsdp_plugin"] is None  # fp32 throughout: accelerate's own plugin


def save_checkpoint(plumbing, cfg, parts: dict, step: int, identity: dict):
    """One save as the loop's Checkpointer makes it, written before returning: its folder."""
    transaction = saving.begin(plumbing, cfg, parts, step, identity)
    transaction.run()
    return transaction.final


# ---------------------------------------------------------------- a model's buffers across ranks (buffers.py)


class Wrapped(torch.nn.Module):
    """What DDP's wrapper says of itself: whether it copies rank 0's buffers to every rank."""

    def __init__(self, module, broadcast_buffers):
        super().__init__()
        self.module = module
        self.broadcast_buffers = broadcast_buffers


def batchnorm_of_rank(rank: int) -> torch.nn.Module:
    """Running statistics that tell the ranks apart: mean rank + 1, variance 4 (rank + 1), 10 (rank + 1)
    batches tracked; a non-persistent buffer (a cache a model recomputes) beside them."""
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(3))
    model[0].running_mean.fill_(rank + 1.0)
    model[0].running_var.fill_(4.0 * (rank + 1))
    model[0].num_batches_tracked.fill_(10 * (rank + 1))
    model.register_buffer("cache", torch.full((2,), 7.0), persistent=False)
    return model


def buffers_on_two_ranks(rank: int, port: int) -> None:
    import buffers

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = batchnorm_of_rank(rank)
        found = buffers.persistent_buffers(model)
        assert sorted(found) == ["0.num_batches_tracked", "0.running_mean", "0.running_var"]
        # each rank keeps its own (broadcast_buffers false, or FSDP: no attribute): inside, their mean;
        # the count, which is no statistic, rank 0's
        with buffers.shared_buffers(model, 2):
            assert model[0].running_mean.tolist() == [1.5] * 3
            assert model[0].running_var.tolist() == [6.0] * 3
            assert int(model[0].num_batches_tracked) == 10
        assert model[0].running_mean.tolist() == [rank + 1.0] * 3  # each rank's own again
        assert model[0].running_var.tolist() == [4.0 * (rank + 1)] * 3
        assert int(model[0].num_batches_tracked) == 10 * (rank + 1)
        # DDP's broadcast: rank 0's, everywhere
        with buffers.shared_buffers(Wrapped(model, broadcast_buffers=True), 2):
            assert model[0].running_mean.tolist() == [1.0] * 3
            assert model[0].running_var.tolist() == [4.0] * 3
        assert model[0].running_mean.tolist() == [rank + 1.0] * 3
        assert model.cache.tolist() == [7.0, 7.0]  # never exchanged
    finally:
        dist.destroy_process_group()


def test_shared_buffers_are_the_ranks_mean_or_rank_0s_and_each_ranks_own_after():
    """Two gloo processes with different running statistics, against the numbers worked by hand; and one
    process, which exchanges nothing and needs no process group."""
    import buffers

    model = batchnorm_of_rank(0)
    with buffers.shared_buffers(model, 1):
        assert model[0].running_mean.tolist() == [1.0] * 3
    torch.multiprocessing.spawn(buffers_on_two_ranks, args=(free_port(),), nprocs=2)


def test_which_ranks_keep_their_own_buffers_and_a_ranks_buffers_round_trip():
    import buffers

    model = batchnorm_of_rank(0)
    assert not buffers.ranks_keep_their_own(model, 1)  # one process
    assert not buffers.ranks_keep_their_own(torch.nn.Linear(2, 2), 2)  # no buffers
    assert not buffers.ranks_keep_their_own(Wrapped(model, broadcast_buffers=True), 2)
    assert buffers.ranks_keep_their_own(Wrapped(model, broadcast_buffers=False), 2)
    assert buffers.ranks_keep_their_own(model, 2)  # FSDP: no broadcast at all
    saved = {
        name: tensor.clone() for name, tensor in buffers.RankBuffers(model).state_dict().items()
    }
    other = batchnorm_of_rank(1)
    buffers.RankBuffers(other).load_state_dict(saved)
    assert other[0].running_mean.tolist() == [1.0] * 3 and int(other[0].num_batches_tracked) == 10
    assert other[0].running_var.tolist() == [4.0] * 3
    # a persistent buffer of the model itself, a non-persistent one inside a layer: named as state_dict does
    model.register_buffer("scale", torch.ones(1))
    model[0].register_buffer("scratch", torch.zeros(1), persistent=False)
    assert list(buffers.persistent_buffers(model)) == [
        "scale",
        "0.running_mean",
        "0.running_var",
        "0.num_batches_tracked",
    ]


@pytest.mark.parametrize("precision", ["bf16", "no"])
def test_every_fsdp_unit_on_the_torch_path_gets_torch_s_own_policy_for_the_precision(
    tmp_path, launched, precision
):
    """Each fully_shard unit (every block and the root) holds the policy torch's FSDP2 documents for
    bf16 compute with fp32 gradient reduction, MixedPrecisionPolicy(param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32), under bf16, and torch's default MixedPrecisionPolicy() otherwise."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    expected = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    _, _, model, _ = sharded_job(tmp_path, mixed_precision=precision)
    units = [model, *transformer_blocks(model, "fsdp")]
    assert len(units) == 3  # the root and its 2 blocks
    assert [fully_shard.state(unit)._mp_policy for unit in units] == [expected] * 3


def test_after_a_forward_each_block_on_the_torch_path_is_back_to_its_shards(tmp_path, launched):
    """reshard_after_forward: a block's gathered weights are freed once its forward is done (one
    all-gather again in backward), so the peak holds one block unsharded at a time: after the forward
    each block's parameters are the sharded DTensors again, not the gathered tensors."""
    from torch.distributed.tensor import DTensor

    _, _, model, _ = sharded_job(tmp_path)
    tokens = torch.randint(0, 256, (2, 8))
    model(input_ids=tokens, labels=tokens)
    for block in transformer_blocks(model, "fsdp"):
        assert all(isinstance(p, DTensor) for p in block.parameters()), type(block).__name__
