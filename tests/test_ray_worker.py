"""scripts/ray/train.py's worker, on a cluster of two nodes of two workers each, faked where Ray
answers (its context) and where the child starts (subprocess.run): each child's torch environment
is the rank Ray gave its worker, LOCAL_RANK the rank within its node (a device index on a GPU node:
the worker's global rank there would name a GPU the node does not have), GROUP_RANK its node's."""

import importlib.util
import sys
import types

import pytest

from conftest import REPO

pytest.importorskip("ray.train", reason="pip install -r requirements-ray.txt")


def ray_script():
    spec = importlib.util.spec_from_file_location(
        "ray_train", REPO / "scripts" / "ray" / "train.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class FakeContext:
    """Ray Train's context of the worker with this global rank, on 2 nodes of 2 workers."""

    def __init__(self, rank: int):
        self.rank = rank

    def get_world_rank(self):
        return self.rank

    def get_world_size(self):
        return 4

    def get_local_rank(self):
        return self.rank % 2

    def get_local_world_size(self):
        return 2

    def get_node_rank(self):
        return self.rank // 2


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_each_ray_worker_s_child_gets_its_rank_within_its_node(monkeypatch, rank):
    import ray.train

    script = ray_script()
    started = {}

    def run(command, env, cwd, preexec_fn):
        started.update(command=command, env=env, cwd=cwd)
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(ray.train, "get_context", lambda: FakeContext(rank))
    monkeypatch.setattr(script.subprocess, "run", run)
    monkeypatch.setattr(script, "rendezvous_port", lambda rank: 29123)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    config = {"entry": "train/main.py", "args": ["--max_steps", "3"], "cwd": str(REPO)}
    script.run_a_rank(config)
    env = started["env"]
    expected = {
        "RANK": str(rank),
        "WORLD_SIZE": "4",
        "LOCAL_RANK": str(rank % 2),
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": str(rank // 2),
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29123",
    }
    assert {name: env[name] for name in expected} == expected
    assert started["command"] == [sys.executable, "train/main.py", "--max_steps", "3"]


def test_every_rank_s_child_gets_the_port_rank_0_found_free(monkeypatch):
    """rendezvous_port on the four workers, with Ray's process group faked where it carries objects
    (broadcast_object_list from rank 0, which calls first): rank 0 binds a free port, and the three
    others get that port, not their own 0. Rank 0's port is read from the socket it bound."""
    import socket

    import torch.distributed as dist

    script = ray_script()
    sent, bound = [], []
    real_socket = socket.socket

    class Recorded(real_socket):
        def bind(self, address):
            super().bind(address)
            bound.append(self.getsockname()[1])

    def broadcast_object_list(objects, src):
        assert src == 0
        if not sent:
            sent.append(list(objects))  # rank 0's
        else:
            objects[:] = sent[0]

    monkeypatch.setattr(script.socket, "socket", Recorded)
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
    ports = [script.rendezvous_port(rank) for rank in range(4)]
    assert len(bound) == 1 and bound[0] > 0
    assert ports == bound * 4
