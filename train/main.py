"""Train a model with Hugging Face Accelerate: one file, read top to bottom.

    python train/main.py                                                  # 1 process (CPU or 1 GPU)
    accelerate launch --config_file accelerate_configs/cpu.yaml train/main.py     # 2 CPU processes
    accelerate launch --config_file accelerate_configs/8gpu.yaml train/main.py --config train/configs/gpt2_small.yaml
    accelerate launch --config_file accelerate_configs/2node.yaml --machine_rank 0 ... train/main.py   # each node
    accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml train/main.py ...   # FSDP2 (2node_hsdp: HSDP)
    torchrun --nproc_per_node 8 train/main.py --fsdp full --mixed_precision bf16         # the same, any launcher
    ... train/main.py --resume latest                                     # continue where the last run stopped

Flags are the keys of config.TrainConfig (`--help` lists them). The same loop runs without
Accelerate in torch_ddp.py (torchrun), for comparison. To train your own model and data, replace
model.py and data.py with your own; nothing here should need to change.
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import numpy as np
import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader

# THE FORK'S: the model, its evaluation and what a sample is worth (task.py lists what is used)
import model as task
from batches import TrainBatches, data_identity, data_order, fast_reader
from buffers import shared_buffers, sync_batchnorm
from checkpoint import PerProcess, TrainState, checkpoint_parts, export_model
from compiling import compile_model, compile_wanted, keep_compiled_code
from compiling import report as compile_report
from config import TrainConfig
from data import build_datasets, collate  # THE FORK'S, with model.py
from errors import ConfigError, RunError
from hangs import Watch
from harness import evaluate_export
from job import (
    claim_run_folder,
    load_config_or_exit,
    loader_worker_options,
    run_or_exit,
    stop_signals,
)
from lm import checkpoint_activations, flops_per_token, save_tokenizer
from mixture import build_data
from optim import build_optimizer, set_lr
from plumbing import Plumbing, check_world_size, init_process_group, is_writer
from provenance import environment_info
from resume import newest_checkpoint, resume_or_start
from saving import Checkpointer
from sharding import accelerate_fsdp, fsdp_setting
from streaming import stream_batches
from task import check_loss_contract, tokens_per_sample
from tracking import MetricsLogger, Throughput, new_run_id


# an unexpected exception's traceback goes into the launcher's summary, not only the worker's log
@record
def main(argv: list[str] | None = None) -> None:
    cfg = load_config_or_exit(argv)  # a bad value stops here: no process group, no folder, no data
    run_or_exit(train, cfg, build_accelerator)


def train(cfg: TrainConfig, accelerator: Plumbing) -> int:  # noqa: C901 - the loop: test_budgets bounds it
    """THE training loop; returns the process exit code (0, or StopSignals' code after a signal).
    `accelerator`: an accelerate.Accelerator, or torch_ddp.TorchDDP; what is used of it is
    plumbing.Plumbing."""
    # ---------------------------------------------------------------- setup
    seed_everything(cfg.seed)  # the same model init on every rank
    # ---------------------------------------------------------------- data
    # one process fills the datasets cache and the others then read it: once per job, or once per
    # node when each node has its own disk
    if cfg.shared_filesystem:
        cache_filler_goes_first = accelerator.main_process_first
    else:
        cache_filler_goes_first = accelerator.local_main_process_first
    with cache_filler_goes_first():
        # data.py's datasets; a mixture (--dataset a:0.7,b:0.3): each source's, the train sets joined
        train_set, eval_sets = build_data(cfg, build_datasets)
    check_data_size(train_set, cfg, accelerator.num_processes)
    global_batch = cfg.global_batch(accelerator.num_processes)
    identity = data_identity(cfg, train_set)  # what a resume must find unchanged
    # settles output_dir and locks it: one job per run folder
    cfg = claim_run_folder(cfg, accelerator, identity)
    log = MetricsLogger(cfg, accelerator)  # writes on the main process, a no-op elsewhere
    # where this rank is, for the line that names a hung rank, and its timing against the others'
    watch = Watch(accelerator, cfg)
    sampler = None
    train_loader = None  # streaming: each process reads its own share of the stream (streaming.py)
    if not cfg.streaming:
        # the order: a function of (seed, epoch); a mixture's also of the weights
        sampler = data_order(cfg, train_set, global_batch)
        train_loader = DataLoader(
            fast_reader(train_set), sampler=sampler, drop_last=True, **loader_options(cfg)
        )
    # one eval set per source of a mixture: each source's loss, and the loss over all of them
    eval_loaders = [DataLoader(fast_reader(s), **loader_options(cfg)) for s in eval_sets.values()]
    # ---------------------------------------------------------------- model and optimizer
    model = task.build_model(cfg)
    if cfg.sync_batchnorm:  # batch statistics over every rank's samples (GPUs: checks.py)
        model = sync_batchnorm(model)
    if cfg.activation_checkpointing:
        checkpoint_activations(model)
    optimizer = build_optimizer(model, cfg)
    # prepare: wraps the model in DDP (or shards it, FSDP, and points the optimizer at the shards);
    # each loader gives this rank its share of every global batch, on the device
    model, optimizer, train_loader, *eval_loaders = accelerator.prepare(
        model, optimizer, train_loader, *eval_loaders
    )
    eval_loaders = dict(zip(eval_sets, eval_loaders, strict=True))
    if accelerator.scaler is None:
        # accelerate's optimizer wrapper only steps fp16's loss scaler; without one it costs 0.3 ms
        # a step
        optimizer = getattr(optimizer, "optimizer", optimizer)
    if cfg.streaming:
        batches = stream_batches(train_set, cfg, accelerator)
    else:
        # a micro-step draws the global batch's share of every process
        batches = TrainBatches(train_loader, sampler, global_batch // cfg.grad_accum_steps)
    # the model's .loss, eval_columns and eval_metrics agree on an eval batch (one line if not)
    check_loss_contract(
        model, first_eval_batch(eval_sets, accelerator.device), task.eval_columns, task.eval_metrics
    )
    plain_model = accelerator.unwrap_model(model, keep_torch_compile=False)
    kept_cache = None
    if compile_wanted(cfg.compile):
        # compiled code is kept in the run folder, checked before any rank reads it (compiling.py)
        writer = is_writer(accelerator, cfg.run_dir_is_shared)
        kept_cache = keep_compiled_code(cfg.run_dir, writer, cache_filler_goes_first)
        compile_model(plain_model)  # block by block, in place
    # dropout masks differ per rank, as they should
    seed_everything(cfg.seed + accelerator.process_index)
    # ---------------------------------------------------------------- resume
    state = TrainState()
    # a stream's position is each process's own, and only resumes at the same world size
    data_part = PerProcess(batches, bound_to_world_size=True) if cfg.streaming else batches
    parts = checkpoint_parts(accelerator, model, optimizer, train_state=state, data=data_part)
    # a fork's own state is one more line here, e.g. parts["ema"] = ema_model: saved, restored and
    # pruned with the rest
    # the config is settled from here on
    cfg = resume_or_start(accelerator, cfg, parts, identity, log)
    checkpointer = Checkpointer(accelerator, cfg, parts, identity, log)
    # a resumed run continues its W&B run
    state.tracker_run_id = state.tracker_run_id or new_run_id()
    log.start(cfg, state.step, run_info(cfg, accelerator, plain_model, train_set, eval_sets))
    log.start_trackers(state.tracker_run_id, state.step)
    throughput = Throughput(
        global_batch,
        tokens_per_sample(cfg),  # None: the task counts samples only (images)
        flops_per_token(plain_model),
        accelerator.num_processes,
        accelerator.mixed_precision,
    )
    # from now on a signal means: checkpoint at the next logging step, then stop
    stop_signals.loop_running = True
    # counted on the device: no sync per step
    bad_grad_steps = torch.zeros((), device=accelerator.device)
    # ---------------------------------------------------------------- loop
    model.train()
    while state.step < cfg.max_steps:
        step_loss = torch.zeros((), device=accelerator.device)
        for _ in range(cfg.grad_accum_steps):
            # DDP's gradient all-reduce runs on the last micro-step only
            with accelerator.accumulate(model):
                # the watch notes each phase (where a hang is) and times data and forward, what a
                # rank does alone (a straggler)
                with watch.timed("data"):
                    batch = next(batches)
                with watch.timed("forward"):
                    loss = model(**batch).loss
                watch.at("backward")  # DDP's gradient all-reduce runs in it
                accelerator.backward(loss)  # divides by grad_accum_steps (and scales, for fp16)
                step_loss += loss.detach() / cfg.grad_accum_steps
                # the last micro-step: clip, set this step's LR, update
                if accelerator.sync_gradients:
                    watch.at("optimizer")
                    max_norm = cfg.max_grad_norm or math.inf
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
                    # FSDP: a DTensor; the same value on every rank
                    grad_norm = full_tensor(grad_norm)
                    bad_grad_steps += ~torch.isfinite(grad_norm)
                    lr = set_lr(optimizer, state.step, cfg)  # each group at its own peak
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
        state.step += 1
        watch.step_done(state.step)  # after the first step: step_timeout_s
        throughput.step()
        is_last = state.step == cfg.max_steps
        stopping = False
        saving = (cfg.save_every and state.step % cfg.save_every == 0) or is_last
        # the loop waits for the GPU here only, so it runs ahead
        if state.step % cfg.log_every == 0 or saving:
            # over micro-steps, then over ranks; checked before every save, so no broken weights are
            # committed
            reduced = accelerator.reduce(torch.stack([step_loss, bad_grad_steps]), "mean")
            mean_loss, bad_grads = reduced.tolist()
            log.log(
                state.step,
                {
                    "loss": mean_loss,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "epoch": batches.epoch,
                    **throughput.seen(state.step),  # samples (and tokens) since step 0
                    **throughput.report(),
                    **compile_report(),  # graphs compiled, and found in the kept cache
                    **watch.stragglers(),  # collective: the slowest rank against the median
                },
            )
            # a checkpoint written in the background is published once all ranks have written it
            checkpointer.commit_if_written()
            # the same reduced values on every rank: all stop
            if not math.isfinite(mean_loss) or bad_grads:
                raise TrainingDiverged(state.step, mean_loss, newest_checkpoint(cfg))
            # collective: every rank stops at the same step
            stopping = stop_signals.requested(accelerator)
        log.advance()
        if state.step % cfg.eval_every == 0 or is_last:
            log.log(state.step, evaluate(model, eval_loaders, accelerator))
        if saving or stopping:
            if kept_cache:  # what this checkpoint resumes with, listed for the resume's check
                kept_cache.record()
            checkpointer.save(state.step)  # with async_save, written while training goes on
        if stopping:
            path = checkpointer.finish()  # written, voted and published before the exit
            log.stopped(state.step, stop_signals.signal_name, str(path))  # the vote's cause
            log.close()
            return stop_signals.exit_code
        if state.step % cfg.eval_every == 0 or saving:
            throughput.restart()  # eval and checkpoint time is not training throughput
    # ---------------------------------------------------------------- save
    # the last checkpoint published first: a full disk names the checkpoint, not the export
    checkpointer.finish()
    # the buffers (BatchNorm's statistics) the evaluations used: rank 0's, or the ranks' mean
    with shared_buffers(model, accelerator.num_processes):
        path = export_model(
            accelerator,
            model,
            cfg.run_dir,  # on object storage, uploaded with the run files (storage.py)
            save_extras=lambda folder: save_tokenizer(cfg, folder),
        )
    log.info(f"model: {path}")
    if cfg.eval_tasks:  # lm-evaluation-harness on the export, by the main process (harness.py)
        log.log(state.step, evaluate_export(accelerator, cfg, task.build_model))
    # finishes the trackers (the process group is closed by job.run_or_exit, on every way out)
    log.close()
    return 0


# ---------------------------------------------------------------- the plumbing: Accelerate


def build_accelerator(cfg: TrainConfig):
    from accelerate import Accelerator
    from accelerate.utils import (
        DataLoaderConfiguration,
        DistributedDataParallelKwargs,
        GradientAccumulationPlugin,
    )

    # FSDP2: from --fsdp on any launcher, else from the accelerate config (sharding.py)
    fsdp_plugin, parallelism_config = accelerate_fsdp(cfg)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # restart-safe (plumbing.py); the Accelerator adopts it
        init_process_group(cfg.dist_timeout_s)

    accelerator = Accelerator(
        # Measured: on a machine without a GPU, Accelerator() leaves every launched process
        # believing it is rank 0 of 1 (N independent trainings writing one folder); cpu=True makes
        # them a gloo group.
        cpu=not torch.cuda.is_available(),
        # None: the launcher's setting (ACCELERATE_MIXED_PRECISION, from the accelerate config)
        # decides
        mixed_precision=cfg.mixed_precision or None,
        # sync_with_dataloader=False: an optimizer step may straddle two epochs, exactly as on the
        # torch path
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=cfg.grad_accum_steps, sync_with_dataloader=False
        ),
        # asynchronous host-to-GPU batch copies (pinned memory); accelerate's default blocks the
        # host on each batch (measured on an H100 with bench/throughput.py: 1.08x the bare loop with
        # it)
        dataloader_config=DataLoaderConfiguration(non_blocking=torch.cuda.is_available()),
        kwargs_handlers=[DistributedDataParallelKwargs(**cfg.ddp_options())],
        fsdp_plugin=fsdp_plugin,
        parallelism_config=parallelism_config,  # HSDP's replicate x shard mesh
        log_with=cfg.trackers()
        or None,  # started later, by MetricsLogger, on the main process only
        project_dir=cfg.run_dir,  # TensorBoard writes under <output_dir>/<project>/
    )
    check_world_size(accelerator.num_processes)
    return accelerator


# ---------------------------------------------------------------- helpers used by train()


@torch.no_grad()
def evaluate(model, eval_loaders: dict, accelerator) -> dict:
    """model.py's eval metrics over exactly the eval set, as eval_<metric>, computed on every rank. A
    mixture's: over all its sources' eval sets together, and each source's as eval_<metric>/<name>."""
    model.eval()
    sums = {}  # (source, column): the column's sum over the source's eval set
    # every rank evaluates with the buffers the export holds (BatchNorm's statistics; buffers.py)
    with shared_buffers(model, accelerator.num_processes):
        for source, eval_loader in eval_loaders.items():
            for batch in eval_loader:
                columns = task.eval_columns(model(**batch), batch)  # model.py's: per sample
                # the sampler pads the last batches so every rank has as many; gather_for_metrics
                # drops the copies
                for name, values in accelerator.gather_for_metrics(columns).items():
                    sums[source, name] = sums.get((source, name), 0.0) + values.sum()
    model.train()
    # one device-to-host copy
    totals = dict(zip(sums, torch.stack(list(sums.values())).tolist(), strict=True))
    names = dict.fromkeys(name for _, name in totals)
    overall = {name: sum(v for (_, n), v in totals.items() if n == name) for name in names}
    metrics = {f"eval_{key}": value for key, value in task.eval_metrics(overall).items()}
    for source in eval_loaders:
        if source:  # a mixture's source
            own = {name: value for (s, name), value in totals.items() if s == source}
            metrics.update({f"eval_{k}/{source}": v for k, v in task.eval_metrics(own).items()})
    return metrics


def loader_options(cfg: TrainConfig) -> dict:
    return {
        "batch_size": cfg.batch_size,
        "collate_fn": collate,
        "num_workers": cfg.num_workers,
        "pin_memory": torch.cuda.is_available(),
        # a loader draws its worker seeds from `generator`, not from the global RNG that dropout
        # uses
        "generator": torch.Generator().manual_seed(cfg.seed),
        # a preemption's signal reaches the loader workers too: they leave it to this process,
        # which checkpoints first
        **loader_worker_options(cfg.num_workers),
    }


def first_eval_batch(eval_sets: dict, device) -> dict:
    """Up to two eval samples (of the first source's) as one batch, on the device: enough to check
    the model's loss contract."""
    eval_set = next(iter(eval_sets.values()))
    batch = collate([eval_set[i] for i in range(min(2, len(eval_set)))])
    return {key: value.to(device) for key, value in batch.items()}


def run_info(cfg: TrainConfig, accelerator, plain_model, train_set, eval_sets) -> dict:
    """What run_info.json and the first log lines say about the run."""
    return {
        "output_dir": cfg.output_dir,
        **environment_info(),
        "processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "fsdp": fsdp_setting(cfg),  # and where it was set: --fsdp or the accelerate config
        "global_batch_size": cfg.global_batch(accelerator.num_processes),
        "tokens_per_sample": tokens_per_sample(cfg),
        "train_samples": "streamed" if cfg.streaming else len(train_set),
        "eval_samples": sum(len(eval_set) for eval_set in eval_sets.values()),
        "parameters": sum(p.numel() for p in plain_model.parameters()),
    }


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (FSDP's gradient norm); any other tensor as it is."""
    if hasattr(tensor, "full_tensor"):
        return tensor.full_tensor()
    return tensor


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def check_data_size(train_set, cfg: TrainConfig, num_processes: int) -> None:
    """A stream has no length: a share too small for one block is said when it runs dry
    (streaming.py)."""
    global_batch = cfg.global_batch(num_processes)
    if cfg.streaming or len(train_set) >= global_batch:
        return
    raise ConfigError(
        f"dataset: {len(train_set)} training samples is too few for one optimizer step at world size "
        f"{num_processes} x batch_size {cfg.batch_size} x grad_accum_steps {cfg.grad_accum_steps} = "
        f"{global_batch} samples"
    )


class TrainingDiverged(RunError):
    """The loss or the gradients went nan or inf. Stop: going on would only save broken weights."""

    def __init__(self, step: int, loss: float, last_checkpoint: Path | str | None):
        what = f"loss is {loss}" if not math.isfinite(loss) else "the gradient norm was not finite"
        where = (
            f"resume from {last_checkpoint}"
            if last_checkpoint
            else "no checkpoint was saved; start again"
        )
        super().__init__(
            f"{what} at step {step}: training diverged; {where} with a lower lr or more warmup_steps"
        )


if __name__ == "__main__":
    main()
