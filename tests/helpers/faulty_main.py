"""train/main.py with faults injected from outside the shipped code (used by the end-to-end tests).

Environment variables, each optional, read once at start-up:
    FAULT_STEP=k          act at the k-th logging step of this process (step k with --log_every 1)
    FAULT_RANK=r          only on global rank r (default: every rank)
    FAULT_ACTION=sigterm  send SIGTERM to this process (a preemption: checkpoint and exit)
                 sigusr1  send SIGUSR1 (SLURM's advance warning with --signal)
                 sigint   send SIGINT (Ctrl-C)
                 sigkill  SIGKILL this process (a crashed node)
    FAULT_STARTUP=action  the same actions, while the datasets are being prepared (start-up)
    FAULT_SAVE_AT=name    SIGKILL this process inside a checkpoint save, at the point `name`:
                          after_model | after_parts | before_publish
    FAULT_SAVE_NUMBER=n   ... inside the n-th save of this process (default 1)
    FAULT_ONCE=path       only if this file does not exist yet (it is created): a relaunch runs clean
    FAULT_NAN_STEP=k      from optimizer step k on, the training loss is nan (a diverged run)
    FAULT_INF_GRAD_STEP=k at optimizer step k, the gradients are inf while the loss stays finite
    FAULT_KILL_EVENT=n    SIGKILL at the n-th event of this process: a collective decision (start-up,
                          each phase of a save, export), a logging step, the writer's save between
                          the weights and the optimizer, pruning (after a publish), preparing the data
                          (fuzzing, see test_kill_fuzz)
    FAULT_DISK_FULL_STEP=k  writing the metrics row of step k fails with ENOSPC (a full disk outside a save)
    FAULTY_ENTRY=torch_ddp  run train/torch_ddp.py's main() instead of train/main.py's
    FAULT_SKIP_SPACE_CHECK=1  no free-space check before a save: the write itself meets the full disk
    FAULT_SLOW_S=s        sleep s seconds at each logging step: a run long enough to be interrupted mid-way
    FAULT_SLOW_WRITE_S=s  a background save's writer sleeps s seconds before the optimizer's part: a save
                          stays in flight for the next logging steps (only the FAULT_SAVE_NUMBER-th, if set)
    FAULT_HANG_BATCH=n    this rank's n-th micro-batch never comes (a stalled loader): the others wait in their
                          next collective
    FAULT_SLOW_DATA_S=s   every batch comes late on this rank (a straggler): s seconds, or 3 times the rank's own
                          time between two batches if longer (a slow model's step)
    FAULT_STORE_RESET_AT=text  the store's reset of a connection is read by the event loop just after aiohttp
                          handed the first request whose URL holds `text` to it, before the request's first
                          byte: its body's writer task fails on the closing transport, and nobody retrieves that
                          error (the race a store gone mid-upload meets at times: a kept-alive connection reset
                          as a retry takes it)
    RECORD_SAMPLES=dir    each rank writes the train sample indices (streaming: block ids) it drew to dir/rank{r}.json
    RECORD_ADAPTERS=dir   after the resume (or the fresh start), each rank writes the adapter weights it holds
                          (under FSDP: its own shards) to dir/rank{r}.pt
    RECORD_EXIT=dir       each rank writes the code it exits with to dir/rank{r}.json (a launcher stopped
                          by a signal reports none)
"""

import json
import os
import signal
import sys
from pathlib import Path

SIGNALS = {
    "sigterm": signal.SIGTERM,
    "sigusr1": signal.SIGUSR1,
    "sigint": signal.SIGINT,
    "sigkill": signal.SIGKILL,
}

TRAIN_DIR = Path(__file__).resolve().parents[2] / "train"
sys.path.insert(0, str(TRAIN_DIR))

import checkpoint  # noqa: E402
import job  # noqa: E402
import main  # noqa: E402
import resume  # noqa: E402
import saving  # noqa: E402
import stopping  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))


def armed() -> bool:
    if "FAULT_RANK" in os.environ and int(os.environ["FAULT_RANK"]) != RANK:
        return False
    once = os.environ.get("FAULT_ONCE")
    if once:
        if os.path.exists(f"{once}.rank{RANK}"):
            return False
        Path(f"{once}.rank{RANK}").touch()
    return True


def inject_step_fault(step: int, action: str) -> None:
    original = stopping.StopSignals.requested
    boundaries = {"n": 0}

    def requested(self, plumbing):
        boundaries["n"] += 1
        if boundaries["n"] == step and armed():
            os.kill(os.getpid(), SIGNALS[action])
        return original(self, plumbing)

    stopping.StopSignals.requested = requested


def inject_save_fault(point: str, save_number: int) -> None:
    saves = {"n": 0}
    original_start = saving.Transaction.__init__

    def counting_start(self, *args, **kwargs):  # a save begins, in the loop or in the background
        saves["n"] += 1
        original_start(self, *args, **kwargs)

    saving.Transaction.__init__ = counting_start

    def due() -> bool:
        return saves["n"] == save_number and armed()

    def die_after(fn):
        def wrapper(*args, **kwargs):
            result = fn(*args, **kwargs)
            if due():
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        return wrapper

    if point == "after_model":
        checkpoint.save_safetensors = die_after(checkpoint.save_safetensors)
    elif point == "after_parts":  # after this process wrote its last part
        original_write = saving.write_part

        def write_part(folder, name, *args):
            original_write(folder, name, *args)
            if name == "rng" and due():
                os.kill(os.getpid(), signal.SIGKILL)

        saving.write_part = write_part
    elif point == "before_publish":
        original = saving.publish

        def publish(tmp, *args):
            if due():
                os.kill(os.getpid(), signal.SIGKILL)
            return original(tmp, *args)

        saving.publish = publish


def inject_nan_loss(step: int) -> None:
    original_build = main.task.build_model

    def build_model(cfg):
        model = original_build(cfg)
        if armed():
            first_bad_call = (step - 1) * cfg.grad_accum_steps + 1
            calls = {"n": 0}

            def poison(module, args, output):
                if module.training:
                    calls["n"] += 1
                    if calls["n"] >= first_bad_call:
                        output.loss = output.loss * float("nan")
                return output

            model.register_forward_hook(poison)
        return model

    main.task.build_model = build_model


def inject_startup_signal(action: str) -> None:
    original_build = main.task.build_datasets

    def build_datasets(cfg):
        if armed():
            os.kill(os.getpid(), SIGNALS[action])
        return original_build(cfg)

    main.task.build_datasets = build_datasets


def inject_inf_grads(step: int) -> None:
    original_build = main.task.build_model

    def build_model(cfg):
        model = original_build(cfg)
        if armed():
            calls = {"n": 0}

            def blow_up(grad):
                calls["n"] += 1  # once per micro-step
                return grad * float("inf") if calls["n"] == step * cfg.grad_accum_steps else grad

            next(model.parameters()).register_hook(blow_up)
        return model

    main.task.build_model = build_model


def kill_at_event(n: int) -> None:
    """Count the moments where a crash hurts most and SIGKILL this process at the n-th."""
    events = {"n": 0}

    def counted(fn, counts=lambda *args: True):
        def wrapper(*args, **kwargs):
            if counts(*args):
                events["n"] += 1
                if events["n"] == n and armed():
                    os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)

        return wrapper

    counted_collectively = counted(job.collectively)
    job.collectively = checkpoint.collectively = resume.collectively = counted_collectively
    saving.collectively = counted_collectively
    # mid-save on the writer (in the background with async_save): its weights are written, the
    # optimizer's state not yet
    saving.write_part = counted(
        saving.write_part,
        lambda folder, name, part, plumbing, writer: writer and name == "optimizer",
    )
    saving.prune_checkpoints = counted(saving.prune_checkpoints)
    stopping.StopSignals.requested = counted(stopping.StopSignals.requested)
    main.task.build_datasets = counted(main.task.build_datasets)


def slow_down(seconds: float) -> None:
    import time

    original = stopping.StopSignals.requested

    def requested(self, plumbing):
        time.sleep(seconds)
        return original(self, plumbing)

    stopping.StopSignals.requested = requested


def slow_background_writes(seconds: float) -> None:
    import threading
    import time

    original = saving.write_part
    only_save = int(os.environ.get("FAULT_SAVE_NUMBER", "0"))  # 0: every save
    saves = {"n": 0}

    def write_part(folder, name, *args):
        if name == "optimizer" and threading.current_thread().name == "checkpoint-writer":
            saves["n"] += 1
            if only_save in (0, saves["n"]):
                time.sleep(seconds)
        original(folder, name, *args)

    saving.write_part = write_part


def delay_batches(seconds: float, from_call: int = 1, times_own_step: float = 0.0) -> None:
    """Each micro-batch from the from_call-th on comes late on this rank: `seconds` late, or
    `times_own_step` times this rank's own time between two batches (its forward, backward and
    step), whichever is longer, so that any model, fast or slow, lags by more than the straggler
    rule's factor."""
    import time

    from batches import TrainBatches
    from streaming import StreamBatches

    calls = {"n": 0, "returned": None}
    is_armed = armed()

    def late(original):
        def next_batch(self):
            calls["n"] += 1
            if is_armed and calls["n"] >= from_call:
                own = 0.0 if calls["returned"] is None else time.perf_counter() - calls["returned"]
                time.sleep(max(seconds, times_own_step * own))
            batch = original(self)
            calls["returned"] = time.perf_counter()
            return batch

        return next_batch

    TrainBatches.__next__ = late(TrainBatches.__next__)
    StreamBatches.__next__ = late(StreamBatches.__next__)


def inject_disk_full(step: int) -> None:
    import tracking

    original_log = tracking.MetricsLogger.log

    def log(self, at_step, metrics):
        if at_step == step and self.enabled and armed():
            raise OSError(28, "No space left on device", str(self.folder.path("metrics")))
        return original_log(self, at_step, metrics)

    tracking.MetricsLogger.log = log


def reset_the_store_connection_at(url_text: str) -> None:
    from aiohttp import client_reqrep

    original_send = client_reqrep.ClientRequest.send
    done = {"reset": False}

    async def send(self, conn):
        response = await original_send(self, conn)
        if url_text in str(self.url) and not done["reset"]:
            done["reset"] = True
            # as the loop reading the peer's reset now: the transport is closing when the writer task
            # (created by send, not started yet: Python < 3.12) takes its first step
            conn.protocol.transport.abort()
        return response

    client_reqrep.ClientRequest.send = send


def record_samples(folder: str) -> None:
    """Wrap the train dataset so each rank records the indices it actually loaded and trained on (streaming: the
    ids of the blocks it drew)."""
    import torch

    import batches
    from streaming import StreamBatches

    drawn = []

    class Recording(torch.utils.data.Dataset):
        def __init__(self, dataset):
            self.dataset = dataset

        def __len__(self):
            return len(self.dataset)

        def __getitem__(self, index):
            drawn.append(int(index))
            return self.dataset[index]

    original_build, original_train, original_next_block = (
        main.task.build_datasets,
        main.train,
        StreamBatches.next_block,
    )

    def build_datasets(cfg):
        train_set, eval_set = original_build(cfg)
        return (train_set if cfg.streaming else Recording(train_set)), eval_set

    # streaming: a block's id is (epoch, blocks this process packed before it)
    def next_block(
        self,
    ):
        sample_id, block = original_next_block(self)
        drawn.append(list(sample_id))
        return sample_id, block

    def train(cfg, plumbing):
        code = original_train(cfg, plumbing)
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"rank{RANK}.json").write_text(json.dumps(drawn))
        return code

    # the data identity hashes a torch Dataset's samples: take them from the dataset itself, unrecorded, so
    # only what the loader drew is recorded and the identity is the unwrapped run's
    original_digest = batches.content_digest

    def content_digest(dataset, *args, **kwargs):
        if isinstance(dataset, Recording):
            dataset = dataset.dataset
        return original_digest(dataset, *args, **kwargs)

    main.task.build_datasets, main.train, StreamBatches.next_block = (
        build_datasets,
        train,
        next_block,
    )
    batches.content_digest = content_digest


def record_adapters(folder: str) -> None:
    """Each rank's own adapter tensors as the resume left them: a sharded one's local shard, which is what
    accelerate PR #4206 found reset on all ranks but the first."""
    import torch

    original = main.resume_or_start

    def resume_or_start(plumbing, cfg, parts, identity, log):
        settled = original(plumbing, cfg, parts, identity, log)
        module = parts["model"].module
        held = {
            name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for name, p in module.named_parameters()
            if p.requires_grad
        }
        Path(folder).mkdir(parents=True, exist_ok=True)
        torch.save(held, Path(folder) / f"rank{RANK}.pt")
        return settled

    main.resume_or_start = resume_or_start


if __name__ == "__main__":
    if "FAULT_STEP" in os.environ:
        inject_step_fault(int(os.environ["FAULT_STEP"]), os.environ.get("FAULT_ACTION", "sigterm"))
    if "FAULT_SAVE_AT" in os.environ:
        inject_save_fault(
            os.environ["FAULT_SAVE_AT"], int(os.environ.get("FAULT_SAVE_NUMBER", "1"))
        )
    if "FAULT_NAN_STEP" in os.environ:
        inject_nan_loss(int(os.environ["FAULT_NAN_STEP"]))
    if "FAULT_STARTUP" in os.environ:
        inject_startup_signal(os.environ["FAULT_STARTUP"])
    if "FAULT_INF_GRAD_STEP" in os.environ:
        inject_inf_grads(int(os.environ["FAULT_INF_GRAD_STEP"]))
    if "FAULT_KILL_EVENT" in os.environ:
        kill_at_event(int(os.environ["FAULT_KILL_EVENT"]))
    if "FAULT_DISK_FULL_STEP" in os.environ:
        inject_disk_full(int(os.environ["FAULT_DISK_FULL_STEP"]))
    if os.environ.get("FAULT_SKIP_SPACE_CHECK") == "1":
        saving.check_space = lambda *args: None
    if "FAULT_SLOW_S" in os.environ:
        slow_down(float(os.environ["FAULT_SLOW_S"]))
    if "FAULT_SLOW_WRITE_S" in os.environ:
        slow_background_writes(float(os.environ["FAULT_SLOW_WRITE_S"]))
    if "FAULT_HANG_BATCH" in os.environ:
        delay_batches(1e9, from_call=int(os.environ["FAULT_HANG_BATCH"]))
    if "FAULT_SLOW_DATA_S" in os.environ:
        delay_batches(float(os.environ["FAULT_SLOW_DATA_S"]), times_own_step=3.0)
    if "FAULT_STORE_RESET_AT" in os.environ:
        reset_the_store_connection_at(os.environ["FAULT_STORE_RESET_AT"])
    if "RECORD_SAMPLES" in os.environ:
        record_samples(os.environ["RECORD_SAMPLES"])
    if "RECORD_ADAPTERS" in os.environ:
        record_adapters(os.environ["RECORD_ADAPTERS"])
    entry = main.main
    if os.environ.get("FAULTY_ENTRY") == "torch_ddp":
        import torch_ddp

        entry = torch_ddp.main
    try:
        entry()
    except SystemExit as stop:  # every way the entry points end but a kill
        if "RECORD_EXIT" in os.environ:
            folder = Path(os.environ["RECORD_EXIT"])
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"rank{RANK}.json").write_text(json.dumps(stop.code))
        raise
