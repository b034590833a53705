"""The plumbing contract (train/plumbing.py) is code: both plumbings satisfy it, and it names exactly what the
training code uses of them. TorchDDP's own pieces, in one process."""

import ast
import inspect
import typing

import pytest
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from conftest import REPO
from plumbing import Plumbing
from run_config import config_class
from torch_ddp import Autocast, ShardedLoader, TorchDDP

RunConfig = config_class()


# the code the contract serves: every module of train/ but the two plumbings themselves
USERS = sorted(
    path.name
    for path in (REPO / "train").glob("*.py")
    if path.name not in ("plumbing.py", "torch_ddp.py")
)
METHODS = [
    name
    for name, member in vars(Plumbing).items()
    if inspect.isfunction(member) and not name.startswith("_")
]
ATTRIBUTES = list(typing.get_type_hints(Plumbing))


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


def members_used_by_the_training_code() -> set[str]:
    """Every attribute read through a name `accelerator` or `plumbing` (or `self.plumbing`) in USERS."""
    used = set()
    for name in USERS:
        for node in ast.walk(ast.parse((REPO / "train" / name).read_text())):
            if isinstance(node, ast.Attribute):
                owner = node.value
                if isinstance(owner, ast.Attribute) and owner.attr == "plumbing":
                    used.add(node.attr)
                elif isinstance(owner, ast.Name) and owner.id in ("accelerator", "plumbing"):
                    used.add(node.attr)
    return used


def test_the_contract_names_exactly_what_the_training_code_uses():
    assert members_used_by_the_training_code() == set(METHODS) | set(ATTRIBUTES)


@pytest.mark.parametrize("which", ["accelerate", "torch"])
def test_both_plumbings_satisfy_the_contract_with_compatible_signatures(which, accelerator):
    plumbing = accelerator if which == "accelerate" else TorchDDP(RunConfig())
    assert isinstance(plumbing, Plumbing)
    for name in METHODS:
        wanted = inspect.signature(getattr(Plumbing, name))
        params = [p for p in wanted.parameters.values() if p.name != "self"]
        args = [
            object() for p in params if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty
        ]
        kwargs = {
            p.name: object()
            for p in params
            if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is not p.empty
        }
        # raises TypeError if it does not fit
        inspect.signature(getattr(plumbing, name)).bind(*args, **kwargs)


def test_prepare_takes_any_objects_like_accelerate():
    plumbing = TorchDDP(RunConfig())
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    prepared = plumbing.prepare(model, optimizer, scheduler, DataLoader(range(8), batch_size=2))
    assert len(prepared) == 4 and prepared[1] is optimizer and prepared[2] is scheduler
    assert isinstance(prepared[3], ShardedLoader) and [b.tolist() for b in prepared[3]] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]
    assert plumbing.prepare(model) is model  # one object in, one out


def test_bf16_wraps_the_module_and_unwrap_model_takes_every_wrapper_off():
    plumbing = TorchDDP(RunConfig(mixed_precision="bf16"))
    model = torch.nn.Linear(4, 4)
    prepared = plumbing.prepare(model)
    assert isinstance(prepared, Autocast) and prepared(torch.ones(2, 4)).dtype == torch.bfloat16
    assert plumbing.unwrap_model(prepared, keep_torch_compile=False) is model
    assert plumbing.unwrap_model(torch.compile(prepared), keep_torch_compile=False) is model


def test_gather_for_metrics_takes_nested_data_and_keeps_no_state():
    plumbing = TorchDDP(RunConfig())
    data = {"loss": torch.arange(3.0), "pair": (torch.ones(2), [torch.zeros(1)])}
    gathered = plumbing.gather_for_metrics(data)
    assert torch.equal(gathered["loss"], data["loss"]) and isinstance(gathered["pair"], tuple)
    assert isinstance(gathered["pair"][1], list) and torch.equal(
        gathered["pair"][1][0], torch.zeros(1)
    )
    # rank 0's view of 2 processes (no process group): 5 eval samples in global batches of 2 x 2, so the last
    # global batch holds 1 real sample and 3 repeats. Only there is anything dropped, however often it is called.
    plumbing.num_processes = 2
    loader = plumbing.prepare(DataLoader(torch.arange(5.0), batch_size=2))
    kept = []
    for batch in loader:
        first, again = plumbing.gather_for_metrics(batch), plumbing.gather_for_metrics(batch)
        assert torch.equal(first, again)
        kept.append(first)
    assert [k.tolist() for k in kept] == [[0.0, 1.0], [4.0]]
    # outside the last batch: all
    assert torch.equal(plumbing.gather_for_metrics(torch.ones(2)), torch.ones(2))


# ---------------------------------------------------------------- what both plumbings stand on


class Voting:
    """A plumbing whose all-reduce adds `others` (the failures the other processes report) to this
    process's, and records what it was asked."""

    device = torch.device("cpu")

    def __init__(self, others: int):
        self.others, self.asked = others, []

    def reduce(self, tensor, reduction):
        self.asked.append((tensor.item(), tensor.device, reduction))
        return tensor + self.others


def test_collectively_returns_fn_s_value_when_every_process_succeeded():
    from plumbing import collectively

    voting = Voting(others=0)
    failures = []
    assert collectively(voting, "saving", lambda: 5, on_failure=lambda: failures.append(1)) == 5
    assert voting.asked == [(0.0, torch.device("cpu"), "sum")] and failures == []


def test_collectively_raises_on_every_process_when_one_failed():
    from errors import ConfigError, RunError
    from plumbing import collectively

    def disk_full():
        raise OSError("disk full\nthe rest of the message")

    failures = []
    with pytest.raises(RunError) as here:
        collectively(Voting(0), "saving", disk_full, on_failure=lambda: failures.append(1))
    assert str(here.value) == "saving: disk full" and failures == [1]
    voting = Voting(others=1)  # this process succeeded, another one did not
    with pytest.raises(RunError) as elsewhere:
        collectively(voting, "saving", lambda: 5, on_failure=lambda: failures.append(2))
    assert str(elsewhere.value) == "saving failed on another process" and failures == [1, 2]
    assert voting.asked == [(0.0, torch.device("cpu"), "sum")]
    with pytest.raises(ConfigError) as typed:
        collectively(Voting(1), "reading", lambda: 5, error_type=ConfigError)
    assert str(typed.value) == "reading failed on another process"
    refused = ConfigError("output_dir is in use")

    def refuse():
        raise refused

    with pytest.raises(ConfigError) as same:  # already of the type asked: raised as it is
        collectively(Voting(0), "locking", refuse, error_type=ConfigError)
    assert same.value is refused
    voting = Voting(0)
    with pytest.raises(RunError):
        collectively(voting, "saving", disk_full)
    assert voting.asked == [(1.0, torch.device("cpu"), "sum")]  # this process's failure, counted


def test_the_writer_is_the_main_process_or_each_node_s_first():
    from types import SimpleNamespace

    from plumbing import is_writer

    local_first = SimpleNamespace(is_main_process=False, is_local_main_process=True)
    assert is_writer(local_first, shared_filesystem=True) is False
    assert is_writer(local_first, shared_filesystem=False) is True
    main = SimpleNamespace(is_main_process=True, is_local_main_process=False)
    assert is_writer(main, shared_filesystem=True) is True


def test_a_world_the_launcher_did_not_start_is_refused_in_one_line(monkeypatch):
    from errors import ConfigError
    from plumbing import check_world_size

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    check_world_size(1)
    with pytest.raises(ConfigError) as refused:
        check_world_size(2)
    assert str(refused.value) == (
        "the launcher started 1 processes but this one sees a world of 2: they would train "
        "independently and overwrite each other's files"
    )
    monkeypatch.setenv("WORLD_SIZE", "4")
    check_world_size(4)
    with pytest.raises(
        ConfigError, match=r"^the launcher started 4 processes but this one sees a "
    ):
        check_world_size(1)


def test_the_process_group_is_destroyed_after_a_pause_and_only_when_there_is_one(monkeypatch):
    import plumbing

    happened = []
    monkeypatch.setattr(plumbing.time, "sleep", lambda seconds: happened.append(seconds))
    monkeypatch.setattr(plumbing.dist, "destroy_process_group", lambda: happened.append("destroy"))
    monkeypatch.setattr(plumbing.dist, "is_initialized", lambda: False)
    plumbing.close_process_group()
    assert happened == []
    monkeypatch.setattr(plumbing.dist, "is_initialized", lambda: True)
    plumbing.close_process_group()
    assert happened == [0.05, "destroy"]


def test_the_accelerator_is_built_from_the_config_on_cpu(tmp_path, monkeypatch):
    """What build_accelerator hands accelerate.Accelerator, recorded instead of building one: on a
    machine without CUDA a gloo CPU group, the launcher's precision unless the config names one, the
    config's accumulation without syncing to the loader, blocking batch copies, the trackers or
    None, the run folder; under a launcher of 2 the process group first, with dist_timeout_s."""
    import accelerate

    import plumbing

    built, started, checked = {}, [], []

    class Recorder:
        num_processes = 2

        def __init__(self, **kwargs):
            built.update(kwargs)

    monkeypatch.setattr(accelerate, "Accelerator", Recorder)
    monkeypatch.setattr(plumbing.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(plumbing, "init_process_group", started.append)
    monkeypatch.setattr(plumbing, "check_world_size", checked.append)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = RunConfig(output_dir=str(tmp_path / "run"), grad_accum_steps=3, dist_timeout_s=123)
    assert isinstance(plumbing.build_accelerator(cfg), Recorder)
    assert (started, checked) == ([], [2])
    assert built["cpu"] is True and built["mixed_precision"] is None
    plugin = built["gradient_accumulation_plugin"]
    assert (plugin.num_steps, plugin.sync_with_dataloader) == (3, False)
    assert built["dataloader_config"].non_blocking is False
    assert built["log_with"] is None and built["project_dir"] == str(tmp_path / "run")
    assert built["kwargs_handlers"][0].to_kwargs() == {}  # the defaults: nothing changed
    assert (built["fsdp_plugin"], built["parallelism_config"]) == (None, None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = RunConfig(
        output_dir=str(tmp_path / "run"),
        mixed_precision="bf16",
        tracker="tensorboard",
        dist_timeout_s=123,
        static_graph=True,
    )
    plumbing.build_accelerator(cfg)
    assert started == [123] and built["mixed_precision"] == "bf16"
    assert built["log_with"] == ["tensorboard"]
    assert built["kwargs_handlers"][0].to_kwargs() == {"static_graph": True}


def test_the_process_group_starts_on_the_launcher_s_store_under_this_attempt_s_prefix(monkeypatch):
    """What init_process_group asks of torch.distributed, recorded: the store at MASTER_ADDR:PORT for
    WORLD_SIZE processes (hosted by rank 0 unless the elastic agent hosts it), keys under
    attempt_<restart>, gloo on CPUs; NCCL on GPUs, each process on its LOCAL_RANK's GPU first."""
    from datetime import timedelta

    import plumbing

    asked = []

    def tcp_store(host, port, world_size, **options):
        asked.append(("store", host, port, world_size, options))
        return "tcp"

    monkeypatch.setattr(plumbing.dist, "TCPStore", tcp_store)
    monkeypatch.setattr(plumbing.dist, "PrefixStore", lambda prefix, store: (prefix, store))
    monkeypatch.setattr(
        plumbing.dist,
        "init_process_group",
        lambda backend, **options: asked.append(("group", backend, options)),
    )
    monkeypatch.setattr(plumbing.torch.cuda, "is_available", lambda: False)
    environ = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    plumbing.init_process_group(90)
    timeout = timedelta(seconds=90)
    store_options = {"is_master": True, "timeout": timeout, "multi_tenant": True}
    group_options = {"store": ("attempt_0", "tcp"), "rank": 0, "world_size": 4, "timeout": timeout}
    assert asked == [
        ("store", "10.0.0.1", 29500, 4, store_options),
        ("group", "gloo", group_options),
    ]
    asked.clear()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    plumbing.init_process_group(90)
    assert asked[0][4]["is_master"] is False and asked[1][2]["store"] == ("attempt_3", "tcp")
    asked.clear()
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    devices = []
    monkeypatch.setattr(plumbing.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(plumbing.torch.cuda, "set_device", devices.append)
    plumbing.init_process_group(90)
    assert devices == [1] and asked[0][4]["is_master"] is False
    assert asked[1][1] == "nccl" and asked[1][2]["rank"] == 2
    monkeypatch.delenv("LOCAL_RANK")
    plumbing.init_process_group(90)
    assert devices == [1, 0]
