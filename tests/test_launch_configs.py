"""Every shipped accelerate config is accepted by accelerate's own loader and has the topology it claims."""

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from conftest import REPO

CONFIGS = REPO / "accelerate_configs"

EXPECTED = {  # file: (distributed_type, machines, processes in the whole job, mixed precision)
    "cpu.yaml": ("MULTI_GPU", 1, 2, "no"),
    "single_gpu.yaml": ("NO", 1, 1, "bf16"),
    "8gpu.yaml": ("MULTI_GPU", 1, 8, "bf16"),
    "2node.yaml": ("MULTI_GPU", 2, 16, "bf16"),
}


def test_every_config_is_covered():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_topology(name):
    config = load_config_from_file(str(CONFIGS / name))
    distributed_type, machines, processes, precision = EXPECTED[name]
    assert str(config.distributed_type).split(".")[-1] == distributed_type
    assert (config.num_machines, config.num_processes, str(config.mixed_precision)) == (machines, processes, precision)
    assert config.use_cpu is False  # use_cpu selects accelerate's single-process CPU launcher
    assert config.machine_rank == 0


def test_two_node_config_names_the_rendezvous_the_user_overrides():
    config = load_config_from_file(str(CONFIGS / "2node.yaml"))
    assert config.main_process_ip and config.main_process_port
    text = (CONFIGS / "2node.yaml").read_text()
    for key in ("machine_rank", "main_process_ip", "main_process_port"):
        assert f"{key}:" in text and "OVERRIDE" in text.split(f"{key}:")[1].splitlines()[0]
