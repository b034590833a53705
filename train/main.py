"""Train a model with Hugging Face Accelerate: one file, read top to bottom.

    python train/main.py                                                  # 1 process (CPU or 1 GPU)
    accelerate launch --config_file accelerate_configs/cpu.yaml train/main.py     # 2 CPU processes
    accelerate launch --config_file accelerate_configs/8gpu.yaml train/main.py --config train/configs/gpt2_small.yaml
    accelerate launch --config_file accelerate_configs/2node.yaml --machine_rank 0 ... train/main.py   # each node
    accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml train/main.py ...   # FSDP2 (2node_hsdp: HSDP)
    torchrun --nproc_per_node 8 train/main.py --fsdp full --mixed_precision bf16         # the same, any launcher
    ... train/main.py --resume latest                                     # continue where the last run stopped

Flags are the keys of config.TrainConfig and of your model.py's and data.py's own dataclasses
(`--help` lists them). The same loop runs without Accelerate in torch_ddp.py (torchrun), for
comparison. To train your own model and data, replace model.py and data.py with your own (task.py
is where the template reaches them); nothing here should need to change.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch
from torch.distributed.elastic.multiprocessing.errors import record

# THE FORK'S model.py and data.py, reached through the seam (task.py lists what is used)
import task
from batches import build_batches, load_data, loss_weights
from checkpoint import PerProcess, TrainState, checkpoint_parts, export_model
from compiling import compile_and_keep
from compiling import report as compile_report
from evaluation import evaluate, evaluate_export
from hangs import Watch
from job import claim_run_folder, load_config_or_exit, run_or_exit
from optim import build_optimizer, set_lr
from plumbing import Plumbing, build_accelerator
from profiling import ProfilerWindow, Throughput
from resume import TrainingDiverged, resume_or_start
from saving import Checkpointer
from stopping import stop_signals
from tracking import MetricsLogger, new_run_id, run_info


# an unexpected exception's traceback goes into the launcher's summary, not only the worker's log
@record
def main(argv: list[str] | None = None) -> None:
    cfg = load_config_or_exit(argv)  # a bad value stops here: no process group, no folder, no data
    run_or_exit(train, cfg, build_accelerator)


def train(cfg, accelerator: Plumbing) -> int:
    """THE training loop; returns the process exit code (0, or StopSignals' code after a signal).
    `cfg`: the run's config (config.TrainConfig's keys and the fork's own, run_config.py).
    `accelerator`: an accelerate.Accelerator (plumbing.build_accelerator), or torch_ddp.TorchDDP;
    what is used of it is plumbing.Plumbing."""
    # ---------------------------------------------------------------- setup
    seed_everything(cfg.seed)  # the same model init on every rank
    # data.py's datasets (a mixture's: each source's), prepared by one process first
    data = load_data(cfg, accelerator)
    # settles output_dir and locks it: one job per run folder
    cfg = claim_run_folder(cfg, accelerator, data.identity)
    log = MetricsLogger(cfg, accelerator)  # writes on the main process, a no-op elsewhere
    # where this rank is, for the line that names a hung rank, and its timing against the others'
    watch = Watch(accelerator, cfg)
    # each process's share of every global batch, on the device; one eval loader per source
    batches, eval_loaders = build_batches(cfg, accelerator, data)
    # ---------------------------------------------------------------- model and optimizer
    # model.py's model, with the template's options (sync_batchnorm, activation_checkpointing)
    model = task.training_model(cfg)
    # what a resume must find unchanged: the data, and what model.py says of the model it built
    # (its optional identity(model): a preference run's reference weights)
    identity = {**data.identity, **task.model_identity(model)}
    optimizer = build_optimizer(model, cfg)
    # prepare: wraps the model in DDP (or shards it, FSDP, and points the optimizer at the shards)
    model, optimizer = accelerator.prepare(model, optimizer)
    if accelerator.scaler is None:
        # accelerate's optimizer wrapper only steps fp16's loss scaler; without one it costs
        # 0.3 ms a step
        optimizer = getattr(optimizer, "optimizer", optimizer)
    # the model's .loss, eval_columns and eval_metrics agree on an eval batch (one line if not)
    task.check_loss_contract(model, data.first_eval_batch(accelerator.device), cfg)
    plain_model = accelerator.unwrap_model(model, keep_torch_compile=False)
    # --compile: block by block, the compiled code kept in the run folder (compiling.py)
    kept_cache = compile_and_keep(cfg, accelerator, plain_model)
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
    # also lists the kept compiled code at each save, for a resume's check (compiling.py)
    checkpointer = Checkpointer(accelerator, cfg, parts, identity, log, kept_cache)
    # a resumed run continues its W&B run
    state.tracker_run_id = state.tracker_run_id or new_run_id()
    log.start(cfg, state.step, run_info(cfg, accelerator, plain_model, data))
    log.start_trackers(state.tracker_run_id, state.step)
    throughput = Throughput(
        cfg.global_batch(accelerator.num_processes),
        task.tokens_per_sample(cfg),  # None: the task counts samples only (images)
        plain_model,  # its FLOPs per token, for MFU (blocks.flops_per_token)
        accelerator.num_processes,
        accelerator.mixed_precision,
    )
    # --profile_steps START:END: a torch.profiler trace of those steps, per rank (profiling.py)
    profiler = ProfilerWindow(cfg, accelerator, resumed_step=state.step)
    # from now on a signal means: checkpoint at the next logging step, then stop
    stop_signals.loop_running = True
    # counted on the device: no sync per step
    bad_grad_steps = torch.zeros((), device=accelerator.device)
    # ---------------------------------------------------------------- loop
    model.train()
    while state.step < cfg.max_steps:
        step_loss = torch.zeros((), device=accelerator.device)
        # the watch notes each phase (where a hang is) and times data and forward, what a rank
        # does alone (a straggler)
        with watch.timed("data"):
            micro_batches = [next(batches) for _ in range(cfg.grad_accum_steps)]
        # model.py's optional rollout: RL generates from the current policy and rewards it; its
        # values (rewards, lengths) go on the step's line. Without one: as fetched, no values
        micro_batches, rollout_values = task.rollout(model, micro_batches, cfg, state.step, watch)
        # each micro-batch's share of the step, by the items (tokens) its loss counts against all
        # the step's, on every rank: 1.0 each where they count the same (batches.loss_weights)
        watch.at("loss weights")  # the step's items summed over the ranks: a collective
        weights = loss_weights(micro_batches, accelerator)
        for batch, weight in zip(micro_batches, weights, strict=True):
            # DDP's gradient all-reduce runs on the last micro-step only
            with accelerator.accumulate(model):
                with watch.timed("forward"):
                    loss = model(**batch).loss
                loss = loss * weight.to(loss.dtype)
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
        profiler.step_done(state.step)  # opens and closes the window
        throughput.step()
        is_last = state.step == cfg.max_steps
        stopping = False
        saving = (cfg.save_every and state.step % cfg.save_every == 0) or is_last
        # the loop waits for the GPU here only, so it runs ahead
        if state.step % cfg.log_every == 0 or saving:
            # over micro-steps, then over ranks; checked before every save, so no broken
            # weights are committed
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
                    **rollout_values,  # model.py's rollout's, of this step
                },
            )
            # a checkpoint written in the background is published once all ranks have written it
            checkpointer.commit_if_written()
            # the same reduced values on every rank: all stop
            if not math.isfinite(mean_loss) or bad_grads:
                raise TrainingDiverged(state.step, mean_loss, cfg)
            # collective: every rank stops at the same step
            stopping = stop_signals.requested(accelerator)
        log.advance()
        if state.step % cfg.eval_every == 0 or is_last:
            log.log(state.step, evaluate(model, eval_loaders, accelerator, cfg))
        if saving or stopping:
            checkpointer.save(state.step)  # with async_save, written while training goes on
        if stopping:
            profiler.close(every_rank=True)  # a window still open: its traces, and their line
            path = checkpointer.finish()  # written, voted and published before the exit
            log.stopped(state.step, stop_signals.signal_name, str(path))  # the vote's cause
            log.close()
            return stop_signals.exit_code
        if state.step % cfg.eval_every == 0 or saving:
            throughput.restart()  # eval and checkpoint time is not training throughput
    # ---------------------------------------------------------------- save
    # the last checkpoint published first: a full disk names the checkpoint, not the export
    checkpointer.finish()
    # with the buffers (BatchNorm's statistics) the evaluations used, and the tokenizer beside a
    # Hugging Face model; on object storage, uploaded with the run files (storage.py)
    path = export_model(accelerator, model, cfg)
    if cfg.eval_tasks:  # lm-evaluation-harness on the export, by the main process (harness.py)
        log.log(state.step, evaluate_export(accelerator, cfg))
    # wall time, the final and best evaluation, the next commands
    log.finished(state.step, path)
    # finishes the trackers (the process group is closed by job.run_or_exit, on every way out)
    log.close()
    return 0


# ---------------------------------------------------------------- helpers used by train()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (FSDP's gradient norm); any other tensor as it is."""
    if hasattr(tensor, "full_tensor"):
        return tensor.full_tensor()
    return tensor


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


if __name__ == "__main__":
    main()
