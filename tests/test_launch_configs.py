"""Every shipped accelerate config is accepted by accelerate's own loader and has the topology it claims."""

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.launch import prepare_multi_gpu_env

from conftest import NEEDS_BLOCKS, REPO, model_declares_blocks
from model import build_model
from run_config import config_class

RunConfig = config_class()


CONFIGS = REPO / "accelerate_configs"

EXPECTED = {  # file: (distributed_type, machines, processes in the whole job, mixed precision)
    "cpu.yaml": ("MULTI_GPU", 1, 2, "no"),
    "single_gpu.yaml": ("NO", 1, 1, "bf16"),
    "8gpu.yaml": ("MULTI_GPU", 1, 8, "bf16"),
    "2node.yaml": ("MULTI_GPU", 2, 16, "bf16"),
    "fsdp_8gpu.yaml": ("FSDP", 1, 8, "bf16"),
    "2node_hsdp.yaml": ("FSDP", 2, 16, "bf16"),
}


def test_every_config_is_covered():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_topology(name):
    config = load_config_from_file(str(CONFIGS / name))
    distributed_type, machines, processes, precision = EXPECTED[name]
    assert str(config.distributed_type).split(".")[-1] == distributed_type
    assert (config.num_machines, config.num_processes, str(config.mixed_precision)) == (
        machines,
        processes,
        precision,
    )
    assert config.use_cpu is False  # use_cpu selects accelerate's single-process CPU launcher
    assert config.machine_rank == 0


@pytest.mark.parametrize(
    "name, replicas, shards", [("fsdp_8gpu.yaml", None, None), ("2node_hsdp.yaml", "2", "8")]
)
def test_the_fsdp_configs_launch_fsdp2_sharded_by_the_models_blocks(
    name, replicas, shards, monkeypatch
):
    """What `accelerate launch` hands the processes (accelerate's own launcher code, without starting them), and
    the FSDP plugin an Accelerator builds from it: FSDP2, one shard unit per model._no_split_modules block, and
    for HSDP a 2 x 8 (replicate x shard) mesh. (FSDP itself needs GPUs: on CPU accelerate falls back to DDP.)"""
    args = launch_command_parser().parse_args(
        ["--config_file", str(CONFIGS / name), "train/main.py"]
    )
    _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    assert (env["ACCELERATE_USE_FSDP"], env["FSDP_VERSION"], env["ACCELERATE_MIXED_PRECISION"]) == (
        "true",
        "2",
        "bf16",
    )
    assert env.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE") == replicas
    assert env.get("PARALLELISM_CONFIG_DP_SHARD_SIZE") == shards
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    if not model_declares_blocks():
        pytest.skip(NEEDS_BLOCKS)
    model = build_model(RunConfig(n_layer=2, n_head=2, n_embd=16, block_size=8))
    plugin.set_auto_wrap_policy(model)  # accelerate wraps what the model's _no_split_modules names
    wrapped = plugin.auto_wrap_policy.keywords["transformer_layer_cls"]
    assert [c.__name__ for c in wrapped] == model._no_split_modules


@pytest.mark.parametrize("name", ["2node.yaml", "2node_hsdp.yaml"])
def test_two_node_config_names_the_rendezvous_the_user_overrides(name):
    config = load_config_from_file(str(CONFIGS / name))
    assert config.main_process_ip and config.main_process_port
    text = (CONFIGS / name).read_text()
    for key in ("machine_rank", "main_process_ip", "main_process_port"):
        assert f"{key}:" in text and "OVERRIDE" in text.split(f"{key}:")[1].splitlines()[0]
