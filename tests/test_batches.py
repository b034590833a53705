"""The data order both plumbings share (train/batches.py), for any dataset: a seeded permutation per epoch,
Accelerate's split of every global batch, and a resume on another world size."""

import pytest
import torch
from torch.utils.data import DataLoader

import batches
from config import config_class
from torch_ddp import RankBatches, TorchDDP

RunConfig = config_class()  # TrainConfig and model.py's and data.py's own keys


def test_epoch_sampler_is_a_seeded_permutation_per_epoch_cut_to_whole_global_batches():
    sampler = batches.EpochSampler(50, seed=7, samples_per_step=8)
    epoch0 = list(sampler)
    assert len(epoch0) == len(sampler) == 48 and len(set(epoch0)) == 48 and list(sampler) == epoch0
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert (
        epoch1 != epoch0 and len(set(epoch1)) == 48 and set(epoch0) | set(epoch1) == set(range(50))
    )


def test_start_next_pass_at_skips_into_one_pass_only():
    sampler = batches.EpochSampler(50, seed=7, samples_per_step=10)
    sampler.set_epoch(3)
    full = list(sampler)
    sampler.start_next_pass_at(20)
    assert list(sampler) == full[20:]
    assert list(sampler) == full  # once


@pytest.mark.parametrize(
    "n, batch, world, drop_last",
    [
        (103, 4, 2, True),
        (103, 4, 2, False),
        (50, 4, 3, False),
        (5, 4, 2, False),
        (48, 4, 3, False),
        (64, 8, 4, True),
    ],
)
def test_the_torch_path_splits_batches_exactly_as_accelerate(n, batch, world, drop_last):
    """RankBatches against Accelerate's own BatchSamplerShard (what accelerator.prepare uses): the same
    indices in the same order on every rank, padding included, and the same count of real samples."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    sampler = batches.EpochSampler(n, seed=3, samples_per_step=1)
    for rank in range(world):
        ours = RankBatches(sampler, batch, world, rank, drop_last)
        theirs = BatchSamplerShard(BatchSampler(sampler, batch, drop_last), world, rank)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)
    expected_real = None if drop_last or n % (batch * world) == 0 else n % (batch * world)
    assert ours.real_samples_in_last == expected_real


def global_steps(world, batch, accum, steps, start=None, n=90, seed=5):
    """The samples of each optimizer step (all ranks, all micro-steps), through TrainBatches on every rank
    of a world of `world` (each rank's TorchDDP loader, without a process group); `start` resumes from a
    TrainBatches state_dict."""
    global_batch = world * batch * accum
    streams = []
    for rank in range(world):
        plumbing = TorchDDP(RunConfig(batch_size=batch, grad_accum_steps=accum))
        plumbing.num_processes, plumbing.process_index = world, rank  # this rank's view
        sampler = batches.EpochSampler(n, seed, global_batch)
        loader = plumbing.prepare(
            DataLoader(
                torch.arange(n),
                batch_size=batch,
                sampler=sampler,
                drop_last=True,
                collate_fn=lambda ids: {"ids": torch.stack(ids)},
            )
        )
        streams.append(batches.TrainBatches(loader, sampler, batch * world))
        if start is not None:
            streams[-1].load_state_dict(start)
    steps_seen = [
        sorted(torch.cat([next(s)["ids"] for _ in range(accum) for s in streams]).tolist())
        for _ in range(steps)
    ]
    return steps_seen, streams[0].state_dict()


def test_a_resume_on_another_world_size_continues_with_the_same_samples_in_every_step():
    # 90 // 16 = 5 steps an epoch
    uninterrupted, _ = global_steps(world=2, batch=8, accum=1, steps=14)
    _, position = global_steps(world=2, batch=8, accum=1, steps=7)
    assert position == {"micro_batches": 7, "samples_per_micro_batch": 16}
    for world, batch, accum in [(4, 4, 1), (1, 16, 1), (1, 8, 2), (2, 2, 4)]:
        resumed, _ = global_steps(world, batch, accum, steps=7, start=position)
        assert resumed == uninterrupted[7:], (world, batch, accum)
    with pytest.raises(ValueError, match="global batch changed"):
        global_steps(
            world=1,
            batch=6,
            accum=1,
            steps=1,
            start={"micro_batches": 1, "samples_per_micro_batch": 16},
        )
