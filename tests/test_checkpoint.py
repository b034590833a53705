"""Checkpoint parts and protocol, in one process: round trip, a fork's own part, atomic layout, pruning,
integrity, refusing bad files, and resuming on another world size."""

import json
import os
import pickle
from dataclasses import replace

import pytest
import torch
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader

import checkpoint
import resume as resuming
import saving
from batches import EpochSampler, TrainBatches
from checkpoint import TrainState
from errors import CheckpointError, ConfigError, RunError
from model import build_model
from optim import build_optimizer
from run_config import config_class
from run_folder import RunFolder
from torch_ddp import TorchDDP

RunConfig = config_class()  # TrainConfig and model.py's and data.py's own keys


IDENTITY = {"seed": 1337, "dataset": "corpus.jsonl", "train_blocks": 100, "data_digest": "abc"}


class Job:
    """What train() checkpoints, built small: a model, an optimizer with state, a train state and a data
    position, behind the torch path's plumbing with one process (no process group)."""

    def __init__(self, tmp_path, world_size=1, **kw):
        self.cfg = RunConfig(
            **{
                "output_dir": str(tmp_path / "run"),
                "n_layer": 1,
                "n_head": 2,
                "n_embd": 16,
                "block_size": 8,
                "keep_last": 2,
                **kw,
            }
        )
        self.plumbing = TorchDDP(self.cfg)
        # rank 0's view of a bigger world, without a process group
        self.plumbing.num_processes = world_size
        torch.manual_seed(0)
        self.model = build_model(self.cfg)
        self.optimizer = build_optimizer(self.model, self.cfg)
        self.model(
            input_ids=torch.randint(0, 256, (2, 8)), labels=torch.randint(0, 256, (2, 8))
        ).loss.backward()
        self.optimizer.step()  # the optimizer has state worth saving
        self.state = TrainState()
        micro_batch = self.cfg.batch_size * world_size
        sampler = EpochSampler(
            1000, seed=1, samples_per_step=micro_batch * self.cfg.grad_accum_steps
        )
        self.data = TrainBatches(
            DataLoader(range(1000), batch_size=self.cfg.batch_size, sampler=sampler),
            sampler,
            micro_batch,
        )
        self.parts = checkpoint.checkpoint_parts(
            self.plumbing,
            model=self.model,
            optimizer=self.optimizer,
            train_state=self.state,
            data=self.data,
        )

    def save(self, step, **state):
        self.state.load_state_dict({"step": step, **state})
        self.data.micro_batches = step * self.cfg.grad_accum_steps
        return save_checkpoint(self.plumbing, self.cfg, self.parts, step, IDENTITY)

    def load(self, folder, identity=IDENTITY):
        problem = checkpoint.checkpoint_problem(folder)
        if problem and "refused" not in problem:
            raise CheckpointError(problem)
        return resuming.resume_from(self.plumbing, self.cfg, folder, self.parts, identity)

    def resume(self, identity=IDENTITY):
        log = Log()
        self.cfg = resuming.resume_or_start(self.plumbing, self.cfg, self.parts, identity, log)
        return self.state, log

    def set(self, **changes):
        self.cfg = replace(self.cfg, **changes)  # the config is frozen: a change is a new one


class Log:
    def __init__(self):
        self.lines = []

    def info(self, message):
        self.lines.append(message)

    def warn(self, message):
        self.lines.append(f"warning: {message}")


def same_tensors(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_round_trip_restores_every_part(tmp_path):
    job = Job(tmp_path)
    torch.manual_seed(42)
    path = job.save(7, tracker_run_id="abc123", lr_decay_steps=30)
    expected_draw = torch.rand(3)
    assert path.name == "step_00000007" and RunFolder(job.cfg.output_dir).newest() == path
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {
        "model.safetensors",
        "optimizer.pt",
        "rng_rank0.pt",
        "train_state.json",
        "data.json",
        "config.yaml",
    }
    assert manifest["parts"] == ["data", "model", "optimizer", "rng", "train_state"]
    assert manifest["run"] == {
        "world_size": 1,
        "batch_size": 16,
        "grad_accum_steps": 1,
        "global_batch": 16,
        "block_size": 8,
        "optimizer": "adamw",
        "lora_r": 0,
        **IDENTITY,
    }
    assert all(len(entry["xxh3_64"]) == 16 for entry in manifest["files"].values())
    assert json.loads((path / "data.json").read_text()) == {
        "micro_batches": 7,
        "samples_per_micro_batch": 16,
    }

    fresh = Job(tmp_path / "other")
    with torch.no_grad():
        for p in fresh.model.parameters():
            p.add_(1.0)
    torch.manual_seed(0)
    assert fresh.load(path) == ""
    assert fresh.state == TrainState(step=7, tracker_run_id="abc123", lr_decay_steps=30)
    assert fresh.data.micro_batches == 7
    assert same_tensors(job.model.state_dict(), fresh.model.state_dict())
    exp_avg = lambda opt: [s["exp_avg"] for s in opt.state_dict()["state"].values()]  # noqa: E731
    assert all(
        torch.equal(a, b)
        for a, b in zip(exp_avg(job.optimizer), exp_avg(fresh.optimizer), strict=True)
    )
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG continues where it was saved


def test_a_part_a_fork_registers_is_saved_restored_bitwise_and_pruned_with_the_rest(tmp_path):
    job = Job(tmp_path)
    ema = AveragedModel(job.model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    job.parts["ema"] = ema  # the one line a fork writes
    for step in (2, 4, 6):
        with torch.no_grad():
            for p in job.model.parameters():
                p.mul_(0.5)
        ema.update_parameters(job.model)
        job.save(step)
    root = RunFolder(job.cfg.output_dir).path("checkpoints")
    assert sorted(p.name for p in root.iterdir()) == [
        "step_00000004",
        "step_00000006",
    ]  # keep_last=2
    assert (
        "ema.safetensors"
        in json.loads((root / "step_00000006" / "manifest.json").read_text())["files"]
    )

    fresh = Job(tmp_path / "fresh")
    fresh_ema = AveragedModel(
        fresh.model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    )
    fresh.parts["ema"] = fresh_ema
    fresh.load(root / "step_00000006")
    assert same_tensors(fresh_ema.state_dict(), ema.state_dict())  # n_averaged included
    assert not same_tensors(fresh_ema.module.state_dict(), fresh.model.state_dict())

    without_ema = Job(tmp_path / "plain")
    # a part the run does not have is left alone
    assert without_ema.load(root / "step_00000006") == ""
    with pytest.raises(
        CheckpointError, match="has no part ema .*it holds data, model, optimizer, rng, train_state"
    ):
        fresh.load(Job(tmp_path / "x").save(2))


def test_another_world_size_with_the_same_global_batch_resumes_and_another_global_batch_is_refused(
    tmp_path,
):
    path = Job(tmp_path, world_size=1, batch_size=16).save(5)
    torch.manual_seed(123)
    four = Job(tmp_path / "four", world_size=4, batch_size=4)
    torch.manual_seed(123)
    expected_draw = torch.rand(2)
    torch.manual_seed(123)
    note = four.load(path)
    assert (
        "world_size 1 -> 4, batch_size 16 -> 4" in note and "fresh per-process random state" in note
    )
    assert four.state.step == 5 and four.data.micro_batches == 5  # 5 micro-batches of 16 samples
    assert torch.equal(torch.rand(2), expected_draw)  # the saved RNG of rank 0 of 1 was not applied
    accumulating = Job(tmp_path / "accumulating", world_size=1, batch_size=8, grad_accum_steps=2)
    accumulating.load(path)
    assert accumulating.data.micro_batches == 10  # 10 micro-batches of 8 samples
    for world_size, batch_size in [(2, 16), (1, 8)]:
        with pytest.raises(
            CheckpointError, match=f"global batch 16 .* this run has {world_size * batch_size}"
        ):
            Job(tmp_path / f"w{world_size}", world_size=world_size, batch_size=batch_size).load(
                path
            )
    # same global batch
    longer = Job(tmp_path / "longer", world_size=2, batch_size=8, block_size=16)
    with pytest.raises(CheckpointError, match="block_size 8, this run has 16 and 16"):
        longer.load(path)


def test_keep_last_prunes_after_commit_and_latest_ignores_partial_folders(tmp_path):
    job = Job(tmp_path)
    for step in (2, 4, 6):
        job.save(step)
    root = RunFolder(job.cfg.output_dir).path("checkpoints")
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000006"]
    (root / "step_00000008.tmp").mkdir()  # a crash mid-save
    (root / "step_00000009").mkdir()  # a folder without a manifest
    assert RunFolder(job.cfg.output_dir).newest().name == "step_00000006"
    job.save(10)
    assert sorted(p.name for p in root.iterdir()) == [
        "step_00000006",
        "step_00000009",
        "step_00000010",
    ]


def test_saving_the_same_step_again_replaces_it(tmp_path):
    job = Job(tmp_path)
    job.save(3)
    path = job.save(3, tracker_run_id="second")
    assert json.loads((path / "train_state.json").read_text())["tracker_run_id"] == "second"
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_00000003"]


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    job = Job(tmp_path)
    good = job.save(1)

    def disk_full(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_model", disk_full)
    with pytest.raises(
        RunError, match="no space left on .*checkpoints .*: the checkpoint of step 2 was not"
    ):
        job.save(2)
    assert [p.name for p in good.parent.iterdir()] == [good.name]
    assert RunFolder(job.cfg.output_dir).newest() == good


def test_a_save_that_cannot_fit_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    job = Job(tmp_path)
    good = job.save(1)
    needed = saving.checkpoint_bytes(job.parts, range(1))
    written = sum(p.stat().st_size for p in good.rglob("*") if p.is_file())
    assert (
        0.9 * written < needed < written + (512 << 10)
    )  # the estimate: the tensors, and 256 KiB more
    monkeypatch.setattr(saving, "free_bytes", lambda folder: needed - 1)
    refusal = (
        "not enough space on .*checkpoints for the checkpoint of step 2: .* free, it needs about"
    )
    with pytest.raises(RunError, match=refusal) as error:
        job.save(2)
    assert "\n" not in str(error.value)
    assert [p.name for p in good.parent.iterdir()] == [
        good.name
    ]  # no tmp folder, the last one intact


def forge_manifest(path, name):
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name] = {
        "bytes": (path / name).stat().st_size,
        "xxh3_64": checkpoint.file_digest(path / name),
    }
    (path / "manifest.json").write_text(json.dumps(manifest))


class Payload:
    """Unpickling this runs `touch SENTINEL`: what a crafted checkpoint file would do."""

    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


@pytest.mark.parametrize("name", ["optimizer.pt", "rng_rank0.pt"])
def test_a_malicious_pickle_is_refused_and_does_not_run(tmp_path, name):
    job = Job(tmp_path)
    path = job.save(1)
    sentinel = tmp_path / "SENTINEL"
    (path / name).write_bytes(pickle.dumps(Payload(sentinel), protocol=2))
    forge_manifest(path, name)  # a forger rewrites the manifest too
    with pytest.raises(CheckpointError) as error:
        job.load(path)
    assert f"{path / name} refused: not a plain tensor file" in str(error.value)
    assert "\n" not in str(error.value)
    assert not sentinel.exists()


def test_a_part_whose_state_does_not_fit_is_one_line(tmp_path):
    job = Job(tmp_path)
    path = job.save(1)
    (path / "data.json").write_text(json.dumps({"position": 3}))
    forge_manifest(path, "data.json")
    with pytest.raises(
        CheckpointError, match=r"its part 'data' does not fit this run: 'micro_batches'"
    ):
        job.load(path)


def test_a_tampered_or_truncated_file_fails_the_manifest(tmp_path):
    path = Job(tmp_path).save(1)
    data = (path / "optimizer.pt").read_bytes()
    (path / "optimizer.pt").write_bytes(data[: len(data) // 2])
    assert (
        checkpoint.checkpoint_problem(path) == f"optimizer.pt is missing or not {len(data)} bytes"
    )
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF  # same size, one byte changed
    (path / "optimizer.pt").write_bytes(bytes(flipped))
    assert "optimizer.pt does not match its checksum" in checkpoint.checkpoint_problem(path)


def test_a_checkpoint_of_another_shape_is_refused_before_anything_changes(tmp_path):
    path = Job(tmp_path).save(1)
    wider = Job(tmp_path / "wider", n_embd=32)
    before = {k: v.clone() for k, v in wider.model.state_dict().items()}
    refusal = r"does not fit this model: .* vs model .*; build the model as it was saved \(the config.yaml beside it"
    with pytest.raises(CheckpointError, match=refusal):
        wider.load(path)
    assert same_tensors(before, wider.model.state_dict())


@pytest.mark.shipped
def test_a_checkpoint_with_biases_is_refused_by_the_model_without(tmp_path):
    with_biases = Job(tmp_path / "with_biases", bias=True).save(1)
    with pytest.raises(
        CheckpointError, match=r"unexpected blocks.0.attn.qkv.bias; .*config.yaml beside it: .*bias"
    ):
        Job(tmp_path / "without").load(with_biases)


def test_a_folder_that_is_not_a_checkpoint(tmp_path):
    job = Job(tmp_path)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("hello")
    assert "no readable manifest.json" in checkpoint.checkpoint_problem(junk)
    path = job.save(1)
    (path / "model.safetensors").write_bytes(pickle.dumps({"weights": 1}))
    forge_manifest(path, "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors is not a safetensors file"):
        job.load(path)


def test_a_crash_between_the_two_renames_of_a_resave_leaves_a_resumable_folder(tmp_path):
    job = Job(tmp_path)
    job.save(4)
    path = job.save(8)
    # the first rename happened, then the crash
    os.replace(path, path.with_name(path.name + ".stale"))
    # .stale is never parsed as a step
    assert RunFolder(job.cfg.output_dir).newest().name == "step_00000004"
    job.set(resume="latest")
    state, _ = job.resume()
    assert (
        state.step == 8 and RunFolder(job.cfg.output_dir).newest() == path
    )  # put back at start-up
    job.save(12)  # pruning copes too


def test_latest_skips_a_damaged_newest_checkpoint_and_an_explicit_path_is_refused(tmp_path):
    job = Job(tmp_path)
    job.save(4)
    newest = job.save(8)
    data = bytearray((newest / "model.safetensors").read_bytes())
    data[-1] ^= 0x01
    (newest / "model.safetensors").write_bytes(bytes(data))
    job.set(resume="latest")
    state, log = job.resume()
    assert state.step == 4
    assert any(
        f"skipping damaged checkpoint {newest}: model.safetensors does not match its checksum"
        in line
        for line in log.lines
    ), log.lines
    job.set(resume=str(newest))
    with pytest.raises(
        CheckpointError, match=f"cannot resume from {newest}: model.safetensors does not match"
    ):
        job.resume()
    job.set(resume=job.cfg.output_dir)  # a run folder, not a checkpoint
    with pytest.raises(
        CheckpointError, match="it is a run folder: pass --output_dir .* --resume latest"
    ):
        job.resume()


@pytest.mark.parametrize(
    "key, value",
    [("seed", 7), ("dataset", "other.jsonl"), ("train_blocks", 99), ("data_digest", "def")],
)
def test_resume_refuses_other_data_and_init_from_takes_the_weights_only(tmp_path, key, value):
    job = Job(tmp_path)
    path = job.save(5)
    job.set(resume="latest")
    with pytest.raises(
        CheckpointError, match=f"saved for other data \\({key} .* -> {value!r}\\).*--init_from"
    ):
        job.resume({**IDENTITY, key: value})
    fresh = Job(tmp_path / "new", init_from=str(path))
    with torch.no_grad():
        next(fresh.model.parameters()).add_(1.0)
    own_moments = fresh.optimizer.state_dict()["state"][0]["exp_avg"].clone()
    state, log = fresh.resume({**IDENTITY, key: value})
    assert state.step == 0 and any("init_from" in line for line in log.lines)
    assert same_tensors(fresh.model.state_dict(), job.model.state_dict())
    # not the checkpoint's
    assert torch.equal(fresh.optimizer.state_dict()["state"][0]["exp_avg"], own_moments)


def test_any_failure_on_a_process_fails_the_save_everywhere(tmp_path, monkeypatch):
    job = Job(tmp_path)

    def broken_state(*_args):
        # not an OSError: before, the others waited forever
        raise TypeError("cannot pickle 'generator' object")

    monkeypatch.setattr(checkpoint.ProcessRNG, "state_dict", broken_state)
    with pytest.raises(RunError, match="cannot pickle"):
        job.save(1)
    root = RunFolder(job.cfg.output_dir).path("checkpoints")
    assert not root.exists() or not list(root.iterdir())


def test_a_failed_publish_is_one_line(tmp_path, monkeypatch):
    job = Job(tmp_path)

    def read_only(*_args):
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(checkpoint.os, "replace", read_only)
    with pytest.raises(RunError, match="committing .*step_00000001: .*Permission denied"):
        job.save(1)


def test_a_resume_keeps_the_lr_horizon_unless_lr_decay_steps_is_given(tmp_path):
    job = Job(tmp_path, max_steps=20)
    job.save(20, lr_decay_steps=20)
    job.set(resume="latest", max_steps=40)
    state, log = job.resume()
    assert job.cfg.decay_steps == state.lr_decay_steps == 20  # extended at min_lr
    assert any("pass --lr_decay_steps 40 to stretch it" in line for line in log.lines), log.lines
    job.set(lr_decay_steps=40)
    state, _ = job.resume()
    assert job.cfg.decay_steps == state.lr_decay_steps == 40  # stretched, on purpose
    job.set(max_steps=10)
    with pytest.raises(
        CheckpointError, match="is at step 20, past max_steps 10: pass --max_steps 20 or more"
    ):
        job.resume()


def test_a_checkpoint_from_before_state_parts_points_to_init_from(tmp_path):
    job = Job(tmp_path)
    path = job.save(3)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["parts"], manifest["run"]  # what the template wrote before checkpoints had parts
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        CheckpointError, match=f"written before checkpoints had state parts: .*--init_from {path}"
    ):
        job.load(path)


def test_a_fresh_run_refuses_an_output_dir_with_checkpoints(tmp_path):
    Job(tmp_path).save(4)
    with pytest.raises(
        ConfigError, match="already holds checkpoints; pass --resume latest to continue that run"
    ):
        Job(tmp_path).resume()  # resume: "" (a new run) into a folder that has one
    assert Job(tmp_path, resume="latest").resume()[0].step == 4


def save_checkpoint(plumbing, cfg, parts: dict, step: int, identity: dict):
    """One save as the loop's Checkpointer makes it, written before returning: its folder."""
    transaction = saving.begin(plumbing, cfg, parts, step, identity)
    transaction.run()
    return transaction.final


# ---------------------------------------------------------------- resume's checks, each line whole


def run_checked(tmp_path, saved_run: dict, step: int = 5, identity=IDENTITY, **cfg):
    """resuming.check_same_run against a manifest's `run` of this geometry and these keys."""
    geometry = {"global_batch": 16, "block_size": 8}
    about = {"run": {**geometry, **IDENTITY, **saved_run}, "step": step}
    resuming.check_same_run(tmp_path, about, geometry, RunConfig(**cfg), identity)


def refusal(call) -> str:
    with pytest.raises(CheckpointError) as error:
        call()
    return str(error.value)


def test_check_same_run_refuses_another_optimizer_or_adapter_rank_in_its_whole_line(tmp_path):
    run_checked(
        tmp_path, {}
    )  # a checkpoint from before --optimizer and --lora_r: adamw, every weight
    assert refusal(lambda: run_checked(tmp_path, {}, optimizer="muon")) == (
        f"{tmp_path} was saved with optimizer adamw, this run uses muon: its state would not fit; to "
        f"switch, start a new run from its weights with --init_from {tmp_path}"
    )
    assert refusal(lambda: run_checked(tmp_path, {}, lora_r=4)) == (
        f"{tmp_path} was saved training every weight (lora_r 0), and this run trains LoRA adapters of "
        "rank 4 (lora_r 4): its model and optimizer parts would not fit; resume with lora_r 0, or start "
        "a new run from its weights with --init_from"
    )
    assert refusal(lambda: run_checked(tmp_path, {"lora_r": 8}, lora_r=4)).startswith(
        f"{tmp_path} was saved training LoRA adapters of rank 8 (lora_r 8), and this run trains LoRA "
        "adapters of rank 4 (lora_r 4)"
    )
    run_checked(tmp_path, {"lora_r": 8, "optimizer": "muon"}, lora_r=8, optimizer="muon")


def test_a_checkpoint_at_max_steps_resumes_and_one_past_it_is_refused(tmp_path):
    run_checked(tmp_path, {}, step=20, max_steps=20)
    assert refusal(lambda: run_checked(tmp_path, {}, step=21, max_steps=20)) == (
        f"{tmp_path} is at step 21, past max_steps 20: pass --max_steps 21 or more to resume it"
    )


def test_other_data_names_every_changed_key_and_an_unknown_value_is_no_change(tmp_path):
    other = {**IDENTITY, "seed": 7, "train_blocks": 99, "data_digest": None}
    assert refusal(lambda: run_checked(tmp_path, {}, identity=other)) == (
        f"{tmp_path} was saved for other data (seed 1337 -> 7, train_blocks 100 -> 99): resuming would "
        f"continue a different data order; to change them on purpose, start a new run with --init_from "
        f"{tmp_path}"
    )


def test_checkpoint_to_resume_returns_the_named_checkpoint_or_says_why_not(tmp_path):
    job = Job(tmp_path)
    path = job.save(3)
    named = replace(job.cfg, resume=str(path))
    assert resuming.checkpoint_to_resume(named, RunFolder(job.cfg.output_dir), print) == path
    assert resuming.checkpoint_to_resume(replace(job.cfg, resume=""), None, print) is None
    (path / "manifest.json").unlink()
    assert refusal(lambda: resuming.checkpoint_to_resume(named, None, print)) == (
        f"cannot resume from {path}: {checkpoint.checkpoint_problem(path)}"
    )


def test_init_weights_takes_a_run_folders_export_else_its_newest_checkpoints(tmp_path):
    job = Job(tmp_path)
    older = job.save(2)
    newest = job.save(4)
    run = job.cfg.output_dir
    assert resuming.init_weights(build_model(job.cfg), run) == newest / "model.safetensors"
    assert resuming.init_weights(build_model(job.cfg), str(older)) == older / "model.safetensors"
    export = RunFolder(run).path("export")
    export.parent.mkdir(parents=True, exist_ok=True)
    export.write_bytes((older / "model.safetensors").read_bytes())
    assert resuming.init_weights(build_model(job.cfg), run) == export
    empty = tmp_path / "empty"
    empty.mkdir()
    assert refusal(lambda: resuming.init_weights(build_model(job.cfg), str(empty))) == (
        f"init_from: {empty / 'model.safetensors'} does not exist"
    )


class StepsOnTwoRanks:
    """A plumbing whose reduce averages this rank's values with another rank's, as an all-reduce mean
    does (in float64: an integer mean would truncate)."""

    device = torch.device("cpu")

    def __init__(self, other_step):
        self.other = torch.tensor([other_step, other_step**2], dtype=torch.float64)

    def reduce(self, values, op):
        assert op == "mean" and values.dtype == torch.float64
        return (values + self.other) / 2


def test_every_process_must_resume_from_the_same_step():
    resuming.check_same_step_everywhere(StepsOnTwoRanks(12), 12)
    assert refusal(lambda: resuming.check_same_step_everywhere(StepsOnTwoRanks(12), 10)) == (
        "processes resumed from different steps (this one: 10); a node is missing its newest checkpoint: "
        "pass --resume with the same checkpoint folder on every node"
    )


def test_training_diverged_says_what_went_wrong_and_where_to_resume(tmp_path):
    cfg = RunConfig(output_dir=str(tmp_path / "run"))
    assert str(resuming.TrainingDiverged(7, float("nan"), cfg)) == (
        "loss is nan at step 7: training diverged; no checkpoint was saved; start again with a lower lr "
        "or more warmup_steps"
    )
    job = Job(tmp_path)
    newest = job.save(4)
    assert str(resuming.TrainingDiverged(9, 2.5, job.cfg)) == (
        f"the gradient norm was not finite at step 9: training diverged; resume from {newest} with a "
        "lower lr or more warmup_steps"
    )


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            {"resume": "/no/such/folder"},
            "resume must be '', 'latest' or an existing folder (got '/no/such/folder')",
        ),
        ({"require_resume": True}, "require_resume needs --resume latest (got resume '')"),
        (
            {"require_resume": True, "resume": "latest", "output_dir": "/no/such/run"},
            "output_dir '/no/such/run' does not exist, and require_resume refuses to start a new run there "
            "(mistyped?)",
        ),
        (
            {"init_from": "/no/such/model.safetensors"},
            "init_from is not an existing checkpoint, run folder or .safetensors file (got "
            "'/no/such/model.safetensors')",
        ),
    ],
)
def test_check_sources_refuses_in_its_whole_line(flags, line):
    with pytest.raises(ConfigError) as error:
        resuming.check_sources(RunConfig(**flags))
    assert str(error.value) == line


def test_check_sources_accepts_what_exists(tmp_path):
    resuming.check_sources(
        RunConfig(resume="latest", require_resume=True, output_dir=str(tmp_path))
    )
    resuming.check_sources(
        RunConfig(resume="latest", require_resume=True, output_dir="s3://bucket/run")
    )
    resuming.check_sources(RunConfig(resume=str(tmp_path), init_from=str(tmp_path)))


class Position:
    """A stream's position: each process its own, meaningless on another world size."""

    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def test_resume_from_refuses_a_missing_part_and_a_position_bound_to_the_world_size(tmp_path):
    job = Job(tmp_path, batch_size=4)
    job.parts["stream"] = checkpoint.PerProcess(Position(7), bound_to_world_size=True)
    path = job.save(3)
    same = Job(tmp_path / "same", batch_size=4)
    same.parts["stream"] = checkpoint.PerProcess(Position(), bound_to_world_size=True)
    assert same.load(path) == "" and same.parts["stream"].state.value == 7
    wider = Job(tmp_path / "wider", world_size=2, batch_size=2)
    wider.parts["stream"] = checkpoint.PerProcess(Position(), bound_to_world_size=True)
    assert refusal(lambda: wider.load(path)) == (
        f"{path} was saved by 1 processes, each with its own stream position (a stream's): resume it "
        "with 1 processes, or start a new run from its weights with --init_from"
    )
    more = Job(tmp_path / "more", batch_size=4)
    more.parts["ema"] = checkpoint.Plain(Position())
    more.parts["extra"] = checkpoint.Plain(Position())
    parts = ", ".join(sorted(job.parts))  # the manifest lists them by name
    assert refusal(lambda: more.load(path)) == (
        f"{path} has no part ema, extra (it holds {parts}): start a new run with --init_from"
    )


def test_the_note_of_a_resume_on_another_world_size_names_what_changed(tmp_path):
    path = Job(tmp_path, world_size=1, batch_size=8, grad_accum_steps=2).save(4)
    longer = Job(tmp_path / "longer", world_size=1, batch_size=8, grad_accum_steps=2, block_size=16)
    assert refusal(lambda: longer.load(path)).startswith(f"{path} was saved with global batch 16 ")
    note = Job(tmp_path / "two", world_size=2, batch_size=8, grad_accum_steps=1).load(path)
    assert note == (
        "; world_size 1 -> 2, grad_accum_steps 2 -> 1: the same global batch and samples in every step, a "
        "fresh per-process random state"
    )


# ---------------------------------------------------------------- the parts, their sizes and copies


def test_tensor_bytes_counts_each_storage_once_through_any_container():
    weights = torch.zeros(4)  # 16 bytes
    view = weights[:2]  # the same storage
    ids = torch.zeros(3, dtype=torch.int64)  # 24 bytes
    state = {"a": weights, "b": [view, (ids, {"c": ids})], "step": 3}
    assert checkpoint.tensor_bytes(state) == 16 + 24
    assert checkpoint.tensor_bytes({}) == 0


def test_each_parts_size_is_what_it_writes(tmp_path):
    job = Job(tmp_path)
    # the GPT's parameters, the tied embedding and head once (parameters() lists a shared one once)
    parameter_bytes = sum(p.numel() * p.element_size() for p in job.model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in job.model.buffers())
    assert parameter_bytes <= job.parts["model"].nbytes(range(1)) <= parameter_bytes + buffer_bytes
    assert job.parts["model"].nbytes(range(4)) == job.parts["model"].nbytes(range(1))  # one file
    rng = job.parts["rng"]
    one = rng.nbytes(range(1))
    assert one > 0 and rng.nbytes(range(3)) == 3 * one  # a file per process
    optimizer_state = job.optimizer.state_dict()
    assert job.parts["optimizer"].nbytes(range(2)) == checkpoint.tensor_bytes(optimizer_state)


def test_a_snapshot_is_a_copy_that_later_changes_do_not_reach():
    state = {
        "step": 3,
        "history": [1, 2],
        "nested": {"k": [torch.ones(2)]},
        "pair": (1, torch.zeros(1)),
    }
    copied = checkpoint.cpu_copy(state)
    state["history"].append(3)
    state["nested"]["k"][0].add_(1)
    state["pair"][1].add_(5)
    assert copied["history"] == [1, 2] and copied["nested"]["k"][0].tolist() == [1.0, 1.0]
    assert type(copied["pair"]) is tuple and copied["pair"][1].tolist() == [0.0]

    class Counter:
        def __init__(self):
            self.seen = {"samples": [1]}

        def state_dict(self):
            return self.seen

    counter = Counter()
    frozen = checkpoint.PerProcess(counter, bound_to_world_size=True).snapshot(None, "c", None)
    counter.seen["samples"].append(2)
    assert frozen.state.state_dict() == {"samples": [1]} and frozen.bound_to_world_size is True
    plain = checkpoint.Plain(counter).snapshot(None, "c", None)
    counter.seen["samples"].append(3)
    assert plain.state.state_dict() == {"samples": [1, 2]}


def test_is_json_takes_plain_values_only():
    assert checkpoint.is_json({"a": [1, 2.5, "x", None, True, {"b": []}]})
    for not_plain in ({"a": (1, 2)}, {"a": [torch.zeros(1)]}, {1: "a"}, [b"bytes"], torch.zeros(1)):
        assert not checkpoint.is_json(not_plain), not_plain


def test_an_older_train_state_takes_the_defaults_of_what_it_lacks():
    state = TrainState()
    state.load_state_dict(
        {"step": 12}
    )  # a checkpoint from before tracker_run_id and lr_decay_steps
    assert (state.step, state.tracker_run_id, state.lr_decay_steps) == (12, "", 0)


def test_the_parts_of_a_model_whose_ranks_keep_their_own_buffers_and_of_fp16(tmp_path):
    cfg = RunConfig(output_dir=str(tmp_path / "run"))
    plumbing = TorchDDP(cfg)
    plumbing.num_processes = 2  # rank 0's view of two processes, no process group
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    parts = checkpoint.checkpoint_parts(plumbing, model, optimizer, train_state=TrainState())
    assert list(parts) == ["model", "optimizer", "buffers", "train_state", "rng"]
    buffers_part = parts["buffers"]
    assert isinstance(buffers_part, checkpoint.PerProcess) and not buffers_part.bound_to_world_size
    assert set(buffers_part.state.state_dict()) == {
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    }
    assert buffers_part.state.module is model and parts["model"].module is model
    assert not parts["rng"].bound_to_world_size
    plumbing.num_processes = 1
    plumbing.scaler = torch.amp.GradScaler("cpu")
    parts = checkpoint.checkpoint_parts(plumbing, model, optimizer)
    assert (
        list(parts) == ["model", "optimizer", "rng", "scaler"]
        and parts["scaler"] is plumbing.scaler
    )


def test_a_file_with_many_wrong_shapes_names_four_and_counts_the_rest(tmp_path):
    from safetensors.torch import save_file

    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2, bias=False) for _ in range(6)])
    path = tmp_path / "other.safetensors"
    save_file({f"{i}.weight": torch.zeros(3, 3) for i in range(6)}, str(path))
    with pytest.raises(CheckpointError) as error:
        checkpoint.check_weights(path, model)
    message = str(error.value)
    assert message.count("[3, 3] vs model [2, 2]") == 4 and " (+2 more); " in message, message
    save_file({f"{i}.weight": torch.zeros(3, 3) for i in range(4)}, str(path))
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2, bias=False) for _ in range(4)])
    with pytest.raises(CheckpointError) as error:
        checkpoint.check_weights(path, model)
    assert "more)" not in str(error.value) and str(error.value).count("[3, 3] vs model [2, 2]") == 4


def test_tied_weights_are_the_groups_of_one_parameter_under_several_names(tmp_path):
    gpt = Job(tmp_path).model
    groups = checkpoint.tied_weights(gpt)
    assert len(groups) == 1 and len(groups[0]) == 2  # the embedding and the head
    assert checkpoint.tied_weights(torch.nn.Linear(2, 2)) == []


def test_another_model_identity_is_refused_before_the_data_s_and_names_the_model(tmp_path):
    """model.py's identity(model) (a preference run's reference digest) is kept in the manifest as
    model/<name>: a resume that builds another one is refused in one line naming it, even where the
    data changed too."""
    rebuilt = {**IDENTITY, "seed": 7, "model/reference": "def"}
    saved = {"model/reference": "abc"}
    assert refusal(lambda: run_checked(tmp_path, saved, identity=rebuilt)) == (
        f"{tmp_path} was saved with another model (model/reference 'abc' -> 'def'): resuming would "
        f"train against something else; to change it on purpose, start a new run with --init_from "
        f"{tmp_path}"
    )
