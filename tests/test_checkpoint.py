"""Checkpoint protocol, in one process: round trip, atomic layout, pruning, integrity, and refusing bad files."""

import json
import os
import pickle

import pytest
import torch

import checkpoint
import resume as resuming
from checkpoint import CheckpointError, TrainState, latest_checkpoint
from config import RunError, TrainConfig
from model import build_model
from optim import build_optimizer


class OneProcess:
    """The plumbing members checkpoint.py uses, for a single process without a process group."""

    device = torch.device("cpu")
    is_main_process = is_local_main_process = True
    num_processes, process_index = 1, 0

    def wait_for_everyone(self):
        pass

    def reduce(self, tensor, reduction="mean"):
        return tensor

    def unwrap_model(self, model, keep_torch_compile=True):
        return model


IDENTITY = {"seed": 1337, "dataset": "corpus.jsonl", "train_blocks": 100, "data_fingerprint": "abc"}


def save_checkpoint(plumbing, cfg, model, optimizer, state):
    return checkpoint.save_checkpoint(plumbing, cfg, model, optimizer, state, IDENTITY)


def load_checkpoint(plumbing, cfg, folder, model, optimizer, identity=IDENTITY):
    problem = resuming.checkpoint_problem(folder)
    if problem and "refused" not in problem:
        raise CheckpointError(problem)
    return resuming.load_checkpoint(plumbing, cfg, folder, model, optimizer, identity)


def setup(tmp_path, **kw):
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), n_layer=1, n_head=2, n_embd=16, block_size=8,
                      keep_last=2, **kw)
    torch.manual_seed(0)
    model = build_model(cfg)
    optimizer = build_optimizer(model, cfg)
    model(input_ids=torch.randint(0, 256, (2, 8)), labels=torch.randint(0, 256, (2, 8))).loss.backward()
    optimizer.step()  # the optimizer has state worth saving
    return cfg, model, optimizer


def test_round_trip_restores_weights_optimizer_rng_and_state(tmp_path):
    cfg, model, optimizer = setup(tmp_path)
    state = TrainState(step=7, samples_seen=112, tokens_seen=896, epoch=1, tracker_run_id="abc123")
    torch.manual_seed(42)
    path = save_checkpoint(OneProcess(), cfg, model, optimizer, state)
    expected_draw = torch.rand(3)
    assert path.name == "step_00000007" and latest_checkpoint(cfg.output_dir) == path
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "optimizer.pt", "rng_rank0.pt", "train_state.json",
                                      "config.yaml"}
    assert all(len(entry["xxh3_64"]) == 16 for entry in manifest["files"].values())

    _, fresh_model, fresh_optimizer = setup(tmp_path / "other")
    with torch.no_grad():
        for p in fresh_model.parameters():
            p.add_(1.0)
    torch.manual_seed(0)
    restored = load_checkpoint(OneProcess(), cfg, path, fresh_model, fresh_optimizer)
    assert restored == state
    for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    exp_avg = lambda opt: [s["exp_avg"] for s in opt.state_dict()["state"].values()]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(exp_avg(optimizer), exp_avg(fresh_optimizer), strict=True))
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG continues where it was saved


def test_keep_last_prunes_after_commit_and_latest_ignores_partial_folders(tmp_path):
    cfg, model, optimizer = setup(tmp_path)
    for step in (2, 4, 6):
        save_checkpoint(OneProcess(), cfg, model, optimizer, TrainState(step=step))
    root = checkpoint.checkpoint_root(cfg.output_dir)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000006"]
    (root / "step_00000008.tmp").mkdir()  # a crash mid-save
    (root / "step_00000009").mkdir()  # a folder without a manifest
    assert latest_checkpoint(cfg.output_dir).name == "step_00000006"
    save_checkpoint(OneProcess(), cfg, model, optimizer, TrainState(step=10))
    assert sorted(p.name for p in root.iterdir()) == ["step_00000006", "step_00000009", "step_00000010"]


def test_saving_the_same_step_again_replaces_it(tmp_path):
    cfg, model, optimizer = setup(tmp_path)
    save_checkpoint(OneProcess(), cfg, model, optimizer, TrainState(step=3))
    path = save_checkpoint(OneProcess(), cfg, model, optimizer, TrainState(step=3, samples_seen=9))
    assert json.loads((path / "train_state.json").read_text())["samples_seen"] == 9
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_00000003"]


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    cfg, model, optimizer = setup(tmp_path)
    good = save_checkpoint(OneProcess(), cfg, model, optimizer, TrainState(step=1))

    def disk_full(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_model", disk_full)
    with pytest.raises(RunError, match="saving the checkpoint of step 2 .*: .*No space left"):
        save_checkpoint(OneProcess(), cfg, model, optimizer, TrainState(step=2))
    assert [p.name for p in good.parent.iterdir()] == [good.name]
    assert latest_checkpoint(cfg.output_dir) == good


def forge_manifest(path, name):
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": (path / name).stat().st_size, "xxh3_64": checkpoint.file_digest(path / name)}
    (path / "manifest.json").write_text(json.dumps(manifest))


class Payload:
    """Unpickling this runs `touch SENTINEL`: what a crafted checkpoint file would do."""

    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


@pytest.mark.parametrize("name", ["optimizer.pt", "rng_rank0.pt"])
def test_a_malicious_pickle_is_refused_and_does_not_run(tmp_path, name):
    cfg, model, optimizer = setup(tmp_path)
    path = save_checkpoint(OneProcess(), cfg, model, optimizer, TrainState(step=1))
    sentinel = tmp_path / "SENTINEL"
    (path / name).write_bytes(pickle.dumps(Payload(sentinel), protocol=2))
    forge_manifest(path, name)  # a forger rewrites the manifest too
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(OneProcess(), cfg, path, model, optimizer)
    assert f"{path / name} refused: not a plain tensor file" in str(error.value)
    assert "\n" not in str(error.value)
    assert not sentinel.exists()


def test_a_tampered_or_truncated_file_fails_the_manifest(tmp_path):
    cfg, model, optimizer = setup(tmp_path)
    path = save_checkpoint(OneProcess(), cfg, model, optimizer, TrainState(step=1))
    data = (path / "optimizer.pt").read_bytes()
    (path / "optimizer.pt").write_bytes(data[: len(data) // 2])
    assert resuming.checkpoint_problem(path) == f"optimizer.pt is missing or not {len(data)} bytes"
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF  # same size, one byte changed
    (path / "optimizer.pt").write_bytes(bytes(flipped))
    assert "optimizer.pt does not match its checksum" in resuming.checkpoint_problem(path)


def test_a_checkpoint_of_another_shape_is_refused_before_anything_changes(tmp_path):
    cfg, model, optimizer = setup(tmp_path)
    path = save_checkpoint(OneProcess(), cfg, model, optimizer, TrainState(step=1))
    wider = TrainConfig(**{**cfg.__dict__, "n_embd": 32})
    other = build_model(wider)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"does not fit this model: .*wte.weight|does not fit this model"):
        load_checkpoint(OneProcess(), wider, path, other, build_optimizer(other, wider))
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def test_a_different_world_size_or_batch_is_refused(tmp_path):
    cfg, model, optimizer = setup(tmp_path)
    path = save_checkpoint(OneProcess(), cfg, model, optimizer, TrainState(step=1))
    two = OneProcess()
    two.num_processes = 2
    with pytest.raises(CheckpointError, match=r"different run geometry \(world_size 1 -> 2\)"):
        load_checkpoint(two, cfg, path, model, optimizer)
    bigger = TrainConfig(**{**cfg.__dict__, "batch_size": 32})
    with pytest.raises(CheckpointError, match="batch_size 16 -> 32"):
        load_checkpoint(OneProcess(), bigger, path, model, optimizer)


def test_a_folder_that_is_not_a_checkpoint(tmp_path):
    cfg, model, optimizer = setup(tmp_path)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("hello")
    assert "no readable manifest.json" in resuming.checkpoint_problem(junk)
    path = save_checkpoint(OneProcess(), cfg, model, optimizer, TrainState(step=1))
    (path / "model.safetensors").write_bytes(pickle.dumps({"weights": 1}))
    forge_manifest(path, "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors is not a safetensors file"):
        load_checkpoint(OneProcess(), cfg, path, model, optimizer)


class Log:
    def __init__(self):
        self.lines = []

    def info(self, message):
        self.lines.append(message)

    def warn(self, message):
        self.lines.append(f"warning: {message}")


def resume(cfg, model, optimizer, identity=IDENTITY):
    log = Log()
    return resuming.resume_or_start(OneProcess(), cfg, model, optimizer, identity, log), log


def test_a_crash_between_the_two_renames_of_a_resave_leaves_a_resumable_folder(tmp_path):
    cfg, model, optimizer = setup(tmp_path)
    save_checkpoint(OneProcess(), cfg, model, optimizer, TrainState(step=4))
    path = save_checkpoint(OneProcess(), cfg, model, optimizer, TrainState(step=8))
    os.replace(path, path.with_name(path.name + ".stale"))  # the first rename happened, then the crash
    assert latest_checkpoint(cfg.output_dir).name == "step_00000004"  # .stale is never parsed as a step
    cfg.resume = "latest"
    state, _ = resume(cfg, model, optimizer)
    assert state.step == 8 and latest_checkpoint(cfg.output_dir) == path  # put back at start-up
    save_checkpoint(OneProcess(), cfg, model, optimizer, TrainState(step=12))  # pruning copes too


def test_latest_skips_a_damaged_newest_checkpoint_and_an_explicit_path_is_refused(tmp_path):
    cfg, model, optimizer = setup(tmp_path)
    save_checkpoint(OneProcess(), cfg, model, optimizer, TrainState(step=4))
    newest = save_checkpoint(OneProcess(), cfg, model, optimizer, TrainState(step=8))
    data = bytearray((newest / "model.safetensors").read_bytes())
    data[-1] ^= 0x01
    (newest / "model.safetensors").write_bytes(bytes(data))
    cfg.resume = "latest"
    state, log = resume(cfg, model, optimizer)
    assert state.step == 4
    assert any(f"skipping damaged checkpoint {newest}: model.safetensors does not match its checksum" in line
               for line in log.lines), log.lines
    cfg.resume = str(newest)
    with pytest.raises(CheckpointError, match=f"cannot resume from {newest}: model.safetensors does not match"):
        resume(cfg, model, optimizer)
    cfg.resume = cfg.output_dir  # a run folder, not a checkpoint
    with pytest.raises(CheckpointError, match="it is a run folder: pass --output_dir .* --resume latest"):
        resume(cfg, model, optimizer)


@pytest.mark.parametrize("key, value", [("seed", 7), ("dataset", "other.jsonl"), ("train_blocks", 99),
                                        ("data_fingerprint", "def")])
def test_resume_refuses_other_data_and_init_from_takes_the_weights_only(tmp_path, key, value):
    cfg, model, optimizer = setup(tmp_path)
    path = save_checkpoint(OneProcess(), cfg, model, optimizer, TrainState(step=5))
    cfg.resume = "latest"
    with pytest.raises(CheckpointError, match=f"saved for other data \\({key} .* -> {value!r}\\).*--init_from"):
        resume(cfg, model, optimizer, {**IDENTITY, key: value})
    fresh_cfg, fresh_model, fresh_optimizer = setup(tmp_path / "new", init_from=str(path))
    with torch.no_grad():
        next(fresh_model.parameters()).add_(1.0)
    own_moments = fresh_optimizer.state_dict()["state"][0]["exp_avg"].clone()
    state, log = resume(fresh_cfg, fresh_model, fresh_optimizer, {**IDENTITY, key: value})
    assert state.step == 0 and any("init_from" in line for line in log.lines)
    assert all(torch.equal(a, b) for a, b in zip(fresh_model.parameters(), model.parameters(), strict=True))
    assert torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"], own_moments)  # not the checkpoint's


def test_any_failure_on_a_process_fails_the_save_everywhere(tmp_path, monkeypatch):
    cfg, model, optimizer = setup(tmp_path)

    def broken_state(*_args):
        raise TypeError("cannot pickle 'generator' object")  # not an OSError: before, the others waited forever

    monkeypatch.setattr(checkpoint, "rng_state", broken_state)
    with pytest.raises(RunError, match="cannot pickle"):
        save_checkpoint(OneProcess(), cfg, model, optimizer, TrainState(step=1))
    assert not list(checkpoint.checkpoint_root(cfg.output_dir).iterdir())


def test_a_failed_publish_is_one_line(tmp_path, monkeypatch):
    cfg, model, optimizer = setup(tmp_path)

    def read_only(*_args):
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(checkpoint.os, "replace", read_only)
    with pytest.raises(RunError, match="committing .*step_00000001: .*Permission denied"):
        save_checkpoint(OneProcess(), cfg, model, optimizer, TrainState(step=1))


def test_a_resume_keeps_the_lr_horizon_unless_lr_decay_steps_is_given(tmp_path):
    cfg, model, optimizer = setup(tmp_path, max_steps=20)
    save_checkpoint(OneProcess(), cfg, model, optimizer, TrainState(step=20, lr_decay_steps=20))
    cfg.resume, cfg.max_steps = "latest", 40
    state, log = resume(cfg, model, optimizer)
    assert cfg.decay_steps == state.lr_decay_steps == 20  # extended at min_lr
    assert any("pass --lr_decay_steps 40 to stretch it" in line for line in log.lines), log.lines
    cfg.lr_decay_steps = 40
    state, _ = resume(cfg, model, optimizer)
    assert cfg.decay_steps == state.lr_decay_steps == 40  # stretched, on purpose
    cfg.max_steps = 10
    with pytest.raises(CheckpointError, match="is at step 20, past max_steps 10: pass --max_steps 20 or more"):
        resume(cfg, model, optimizer)
