"""saving.Checkpointer in one process: a background save writes the state of the step it was taken
at (training goes on changing it meanwhile), publishes only when finished, keeps at most one save in
flight, and a failed background write is an error that leaves the previous checkpoint the newest."""

from dataclasses import replace

import pytest
import torch

import checkpoint
import saving
from errors import RunError
from run_folder import RunFolder
from test_checkpoint import Job, Log


def weights_of(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def background(job: Job) -> saving.Checkpointer:
    return saving.Checkpointer(job.plumbing, job.cfg, job.parts, {"seed": 1}, Log())


def test_a_background_save_holds_the_state_of_its_step_while_training_changes_it(tmp_path):
    job = Job(tmp_path, async_save=True)
    saver = background(job)
    job.state.step = 1
    at_save = {name: tensor.clone() for name, tensor in job.model.state_dict().items()}
    optimizer_at_save = checkpoint.cpu_copy(job.optimizer.state_dict())
    saver.save(1)
    with torch.no_grad():  # training goes on: the weights and the optimizer's state change
        for parameter in job.model.parameters():
            parameter.add_(1.0)
    for state in job.optimizer.state.values():
        state["exp_avg"].add_(1.0)
    job.state.step = 2
    folder = saver.finish()
    assert folder == RunFolder(job.cfg.output_dir).newest()
    saved = weights_of(folder)
    for name, tensor in saved.items():
        assert torch.equal(tensor, at_save[name]), name
    optimizer_saved = torch.load(folder / "optimizer.pt", weights_only=True)
    for key, state in optimizer_saved["state"].items():
        assert torch.equal(state["exp_avg"], optimizer_at_save["state"][key]["exp_avg"])
    assert checkpoint.read_file(folder / "train_state.json")["step"] == 1
    assert "written in the background" in saver.log.lines[-1]


def test_a_background_save_equals_the_same_save_in_the_loop(tmp_path):
    """The same state saved both ways: every file but the manifest (which names the folder's own
    checksums) and the config (its async_save key) holds the same values."""
    job = Job(tmp_path, async_save=True)
    saver = background(job)
    job.state.step = 3
    saver.save(3)
    in_background = saver.finish()
    loop_cfg = replace(job.cfg, output_dir=str(tmp_path / "in_the_loop"))
    in_the_loop = save_checkpoint(job.plumbing, loop_cfg, job.parts, 3, {"seed": 1})
    assert sorted(p.name for p in in_background.iterdir()) == sorted(
        p.name for p in in_the_loop.iterdir()
    )
    assert weights_of(in_background).keys() == weights_of(in_the_loop).keys()
    for name, tensor in weights_of(in_background).items():
        assert torch.equal(tensor, weights_of(in_the_loop)[name])
    for name in ("train_state.json", "data.json", "optimizer.pt", "rng_rank0.pt"):
        assert str(checkpoint.read_file(in_background / name)) == str(
            checkpoint.read_file(in_the_loop / name)
        ), name


def test_at_most_one_save_in_flight_and_a_failed_write_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch
):
    job = Job(tmp_path, async_save=True)
    saver = background(job)
    saver.save(1)
    saver.save(2)  # publishes step 1 first
    assert [p.name for p in RunFolder(job.cfg.output_dir).checkpoints()] == ["step_00000001"]
    saver.in_flight.thread.join()  # the write of step 2 has finished
    saver.commit_if_written()  # at a logging step: published
    assert saver.in_flight is None
    assert RunFolder(job.cfg.output_dir).newest().name == "step_00000002"

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(saving, "write_part", full_disk)
    monkeypatch.setattr(
        saving, "check_space", lambda *args: None
    )  # the disk fills during the write
    monkeypatch.setattr(saving, "free_bytes", lambda folder: 0)
    saver.save(3)  # the copy to CPU memory succeeds; the write in the background fails
    with pytest.raises(RunError, match="no space left on .*: the checkpoint of step 3 was not"):
        saver.finish()
    assert RunFolder(job.cfg.output_dir).newest().name == "step_00000002"
    assert not list((tmp_path / "run" / "checkpoints").glob("*.tmp"))


def test_a_background_save_checks_the_free_space_before_it_copies_anything(tmp_path, monkeypatch):
    """The default (async_save): with less free space than the checkpoint needs, save() refuses at
    once in one line (before the copy to CPU memory and the write), and the previous checkpoint
    stays the newest, with no tmp folder left."""
    job = Job(tmp_path, async_save=True)
    saver = background(job)
    saver.save(1)
    saver.finish()
    needed = saving.checkpoint_bytes(job.parts, range(1))
    monkeypatch.setattr(saving, "free_bytes", lambda folder: needed // 2)
    snapshots = []
    monkeypatch.setattr(checkpoint.Plain, "snapshot", lambda *args: snapshots.append(args))
    with pytest.raises(RunError, match="not enough space on .* for the checkpoint of step 2: "):
        saver.save(2)
    assert not snapshots  # nothing was copied
    assert RunFolder(job.cfg.output_dir).newest().name == "step_00000001"
    assert not list((tmp_path / "run" / "checkpoints").glob("*.tmp"))


def test_a_background_save_frees_its_staged_copy_once_committed(tmp_path, monkeypatch):
    """At most one staged copy lives at a time: after the next save commits, nothing holds the CPU
    copies of an earlier save's tensors, without the cyclic garbage collector's help (disabled here:
    a copy only it frees is held until it happens to run, +1 staged copy per save on a real job)."""
    import gc
    import weakref

    job = Job(tmp_path, async_save=True, keep_last=1)
    saver = background(job)
    staged = {}  # save number: weak references to the tensors its staging copied
    copy = checkpoint.cpu_copy

    def recorded_copy(value):
        result = copy(value)
        if isinstance(result, torch.Tensor):
            staged.setdefault(job.state.step, []).append(weakref.ref(result))
        return result

    monkeypatch.setattr(checkpoint, "cpu_copy", recorded_copy)
    gc.collect()
    gc.disable()
    try:
        for step in (1, 2, 3):
            job.state.step = step
            saver.save(step)
            saver.finish()
        alive = {step: sum(ref() is not None for ref in refs) for step, refs in staged.items()}
    finally:
        gc.enable()
    assert staged[1] and staged[2], "the saves staged no tensors"
    assert alive == {1: 0, 2: 0, 3: 0}, f"staged tensors still held, per save: {alive}"


def test_a_full_disk_is_recognised_by_the_error_whatever_space_is_free_afterwards(tmp_path):
    """torch.save's and safetensors' own words for a full disk, while the folder has room again (another
    rank's cleanup freed it): the line still says no space, not the serializer's message."""
    chained = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    chained.__context__ = OSError(28, "No space left on device")
    said_so = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    assert saving.out_of_space(chained, tmp_path)
    assert saving.out_of_space(said_so, tmp_path)
    assert not saving.out_of_space(RuntimeError("unexpected pos 704 vs 598"), tmp_path)


def save_checkpoint(plumbing, cfg, parts: dict, step: int, identity: dict):
    """One save as the loop's Checkpointer makes it, written before returning: its folder."""
    transaction = saving.begin(plumbing, cfg, parts, step, identity)
    transaction.run()
    return transaction.final
