"""FSDP2 as this template runs it, on both paths, set by the run config on any launcher.

    --fsdp full      every transformer block, then the root, sharded over all processes
    --fsdp hybrid    HSDP: sharded over the processes of a node, replicated across the nodes
                     (a replicate x shard mesh: the all-gathers stay on a node's links)
    bf16             bf16 compute, fp32 gradient reduction (as torchtitan), on both paths

The torch path (torch_ddp.py) calls fully_shard itself, over `mesh_shape`. The Accelerate path hands
accelerate a plugin (`accelerate_fsdp`): from --fsdp, whatever started the process (accelerate
launch, torchrun, an engine's own worker start, which never reads an accelerate config), or else
from an accelerate config's fsdp_config (accelerate launch --config_file
accelerate_configs/fsdp_8gpu.yaml). When both speak, --fsdp wins; run_info.json records the sharding
used and where it was set (`fsdp_setting`), and the accelerate config's variables beside it
(provenance.LAUNCH_ENVIRONMENT). Accelerate shards GPU processes only (on CPU it runs DDP whatever
its config says), so --fsdp on main.py without CUDA is refused in one line: the torch path shards on
CPU too.
"""

from __future__ import annotations

import os

import torch

from config import MUON_UNDER_FSDP
from errors import ConfigError


def mesh_shape(fsdp: str, num_processes: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The device mesh's shape and dimension names: (shard,) for full, (replicate, shard) for
    hybrid, a node's processes (LOCAL_WORLD_SIZE, set by every launcher) per shard group."""
    if fsdp != "hybrid":
        return (num_processes,), ("shard",)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", num_processes))
    return (num_processes // per_node, per_node), ("replicate", "shard")


def accelerate_config_shards() -> bool:
    """Whether an accelerate config (through accelerate launch) asks for FSDP."""
    return os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"


def fsdp_setting(cfg) -> str:
    """The sharding a run uses and where it was set, for run_info.json."""
    if cfg.fsdp != "no":
        return f"{cfg.fsdp} (--fsdp)"
    if accelerate_config_shards():
        hybrid = int(os.environ.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE") or 1) > 1
        return f"{'hybrid' if hybrid else 'full'} (accelerate config)"
    return "no"


def accelerate_fsdp(cfg):
    """The Accelerator's fsdp_plugin and parallelism_config: (None, None) without sharding, and
    for an accelerate config's FSDP in fp32 (accelerate builds its own plugin from the config)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    if cfg.fsdp == "no" and not accelerate_config_shards():
        return None, None
    if cfg.fsdp != "no" and not torch.cuda.is_available():
        raise ConfigError(
            f"fsdp {cfg.fsdp} on main.py needs CUDA GPUs: accelerate shards GPU processes only (on "
            f"CPU it would run DDP); on CPU the torch path shards: torchrun --nproc_per_node N "
            f"train/torch_ddp.py --fsdp {cfg.fsdp}"
        )
    if cfg.optimizer == "muon":
        raise ConfigError(MUON_UNDER_FSDP)
    if cfg.fsdp == "no" and os.environ.get("FSDP_VERSION", "1") != "2":
        raise ConfigError(
            "accelerate config: set fsdp_version: 2 (FSDP1's state dicts are not the sharded "
            "checkpoint parts this template saves)"
        )
    precision = cfg.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    policy = None
    if precision == "bf16":
        # accelerate's FSDP2 would reduce gradients in bf16 too: in fp32, as the torch path does
        policy = dict(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.bfloat16
        )
    if cfg.fsdp == "no":  # the accelerate config's, with the fp32 reduction
        plugin = FullyShardedDataParallelPlugin(mixed_precision_policy=policy) if policy else None
        return plugin, None
    # what accelerate_configs/fsdp_8gpu.yaml's fsdp_config says, field by field
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",  # model._no_split_modules: one unit a block
        reshard_after_forward=True,
        state_dict_type="SHARDED_STATE_DICT",
        cpu_ram_efficient_loading=False,
        activation_checkpointing=False,  # --activation_checkpointing does it, on both paths
        mixed_precision_policy=policy,
    )
    if cfg.fsdp == "full":
        return plugin, None
    from accelerate.parallelism_config import ParallelismConfig

    (replicas, shards), _ = mesh_shape("hybrid", int(os.environ.get("WORLD_SIZE", "1")))
    return plugin, ParallelismConfig(dp_replicate_size=replicas, dp_shard_size=shards)
