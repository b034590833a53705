"""Train a model with Hugging Face Accelerate: one file, read top to bottom.

    python train/main.py                                                  # 1 process (CPU or 1 GPU)
    accelerate launch --config_file accelerate_configs/cpu.yaml train/main.py     # 2 CPU processes
    accelerate launch --config_file accelerate_configs/8gpu.yaml train/main.py --config train/configs/gpt2_small.yaml
    accelerate launch --config_file accelerate_configs/2node.yaml --machine_rank 0 ... train/main.py   # each node
    accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml train/main.py ...   # FSDP2 (2node_hsdp: HSDP)
    ... train/main.py --resume latest                                     # continue where the last run stopped

Flags are the keys of config.TrainConfig (`--help` lists them). The same loop runs without
Accelerate in torch_ddp.py (torchrun), for comparison. To train your own model and data, edit the
marked fork points in model.py and data.py; nothing here should need to change.
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

from checkpoint import TrainState, checkpoint_parts, export_model, latest_checkpoint, save_checkpoint
from config import ConfigError, RunError, TrainConfig
from data import EpochSampler, TrainBatches, build_datasets, collate, data_identity, fast_reader
from job import check_world_size, claim_run_folder, init_process_group, load_config_or_exit, run_or_exit, stop_signals
from model import build_model, causal_lm_loss, checkpoint_activations, next_token_counts
from optim import build_optimizer, lr_at, set_lr
from plumbing import Plumbing
from resume import resume_or_start
from streaming import StreamBatches
from tracking import MetricsLogger, Throughput, environment_info, flops_per_token, new_run_id


@record  # an unexpected exception's traceback goes into the launcher's summary, not only the worker's log
def main(argv: list[str] | None = None) -> None:
    cfg = load_config_or_exit(argv)  # a bad value stops here: no process group, no folder, no data
    run_or_exit(train, cfg, build_accelerator)


def build_accelerator(cfg: TrainConfig):
    from accelerate import Accelerator
    from accelerate.utils import (
        DataLoaderConfiguration,
        DistributedDataParallelKwargs,
        FullyShardedDataParallelPlugin,
        GradientAccumulationPlugin,
    )

    if cfg.fsdp != "no":
        raise ConfigError("fsdp is torch_ddp.py's switch; main.py shards as its accelerate config says "
                          "(accelerate launch --config_file accelerate_configs/fsdp_8gpu.yaml train/main.py)")
    fsdp, fsdp_plugin = os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true", None
    if fsdp and os.environ.get("FSDP_VERSION", "1") != "2":
        raise ConfigError("accelerate config: set fsdp_version: 2 (FSDP1's state dicts are not the sharded "
                          "checkpoint parts this template saves)")
    if fsdp and (cfg.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION")) == "bf16":
        # accelerate's FSDP2 would reduce gradients in bf16 too: in fp32, as the torch path does (and torchtitan)
        fsdp_plugin = FullyShardedDataParallelPlugin(mixed_precision_policy=dict(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.bfloat16))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        init_process_group(cfg.dist_timeout_s)  # restart-safe (job.py); the Accelerator adopts it

    accelerator = Accelerator(
        # Measured: on a machine without a GPU, Accelerator() leaves every launched process believing it
        # is rank 0 of 1 (N independent trainings writing one folder); cpu=True makes them a gloo group.
        cpu=not torch.cuda.is_available(),
        # None: the launcher's setting (ACCELERATE_MIXED_PRECISION, from the accelerate config) decides
        mixed_precision=cfg.mixed_precision or None,
        # sync_with_dataloader=False: an optimizer step may straddle two epochs, exactly as on the torch path
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=cfg.grad_accum_steps,
                                                                sync_with_dataloader=False),
        # asynchronous host-to-GPU batch copies (pinned memory); accelerate's default blocks the host on each
        # batch (measured on an H100 with bench/throughput.py: 1.08x the bare loop with it)
        dataloader_config=DataLoaderConfiguration(non_blocking=torch.cuda.is_available()),
        kwargs_handlers=[DistributedDataParallelKwargs(**cfg.ddp_options())],
        fsdp_plugin=fsdp_plugin,  # None: accelerate's own, from the accelerate config (or no FSDP)
        log_with=cfg.trackers() or None,  # started later, by MetricsLogger, on the main process only
        project_dir=cfg.output_dir,  # TensorBoard writes under <output_dir>/<project>/
    )
    check_world_size(accelerator.num_processes)
    return accelerator


def train(cfg: TrainConfig, accelerator: Plumbing) -> int:
    """THE training loop; returns the process exit code (0, or StopSignals' code after a signal). `accelerator`:
    an accelerate.Accelerator, or torch_ddp.TorchDDP; what is used of it is plumbing.Plumbing."""
    # ---------------------------------------------------------------- setup
    seed_everything(cfg.seed)  # the same model init on every rank
    # ---------------------------------------------------------------- data
    # rank 0 fills the datasets cache and the others reuse it; on node-local disks, once per node
    first = accelerator.main_process_first if cfg.shared_filesystem else accelerator.local_main_process_first
    with first():
        train_set, eval_set = build_datasets(cfg)
    global_batch = cfg.batch_size * cfg.grad_accum_steps * accelerator.num_processes
    check_data_size(train_set, global_batch, cfg)
    claim_run_folder(cfg, accelerator)  # settles output_dir and locks it: one job per run folder
    # a loader draws its worker seeds from `generator`, not from the global RNG that dropout uses
    loader_args = dict(batch_size=cfg.batch_size, collate_fn=collate, num_workers=cfg.num_workers,
                       pin_memory=torch.cuda.is_available(), generator=torch.Generator().manual_seed(cfg.seed))
    sampler = train_loader = None  # streaming: each process reads its own share of the stream (streaming.py)
    if not cfg.streaming:
        sampler = EpochSampler(len(train_set), cfg.seed, global_batch)  # the order: a function of (seed, epoch)
        train_loader = DataLoader(fast_reader(train_set), sampler=sampler, drop_last=True, **loader_args)
    eval_loader = DataLoader(fast_reader(eval_set), **loader_args)
    # ---------------------------------------------------------------- model and optimizer
    log = MetricsLogger(cfg, accelerator)  # writes on the main process, a no-op elsewhere
    model = build_model(cfg)
    if cfg.activation_checkpointing:
        checkpoint_activations(model)
    optimizer = build_optimizer(model, cfg)
    # prepare: wraps the model in DDP (or shards it, FSDP, and points the optimizer at the shards); each loader gives
    # this rank its share of every global batch, on the device
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    if accelerator.scaler is None:  # accelerate's optimizer wrapper steps fp16's loss scaler, else it costs 0.3 ms/step
        optimizer = getattr(optimizer, "optimizer", optimizer)
    batches = StreamBatches(train_set, cfg, accelerator) if cfg.streaming else \
        TrainBatches(train_loader, sampler, cfg.batch_size * accelerator.num_processes)
    check_loss_contract(model, eval_set, accelerator.device)  # the model's .loss is the loss evaluate() reports
    if cfg.compile:
        model = torch.compile(model)
    seed_everything(cfg.seed + accelerator.process_index)  # dropout masks differ per rank, as they should
    # ---------------------------------------------------------------- resume
    state = TrainState()
    parts = checkpoint_parts(accelerator, model=model, optimizer=optimizer, train_state=state, data=batches)
    # a fork's own state is one more line here, e.g. parts["ema"] = ema_model: saved, restored and pruned with the rest
    identity = data_identity(cfg, train_set)  # what a resume must find unchanged
    resume_or_start(accelerator, cfg, parts, identity, log)
    state.tracker_run_id = state.tracker_run_id or new_run_id()  # a resumed run continues its W&B run
    plain_model = accelerator.unwrap_model(model, keep_torch_compile=False)
    log.start(state.step, {"output_dir": cfg.output_dir, **environment_info(), "processes": accelerator.num_processes,
                           "mixed_precision": accelerator.mixed_precision,
                           "global_batch_size": global_batch, "tokens_per_step": global_batch * cfg.block_size,
                           "train_samples": "streamed" if cfg.streaming else len(train_set),
                           "eval_samples": len(eval_set),
                           "parameters": sum(p.numel() for p in plain_model.parameters())})
    log.start_trackers(state.tracker_run_id, state.step)
    throughput = Throughput(global_batch, global_batch * cfg.block_size, flops_per_token(plain_model),
                            accelerator.num_processes, accelerator.mixed_precision)
    stop_signals.loop_running = True  # from now on a signal means: checkpoint at the next logging step, then stop
    bad_grad_steps = torch.zeros((), device=accelerator.device)  # counted on the device: no sync per step
    # ---------------------------------------------------------------- loop
    model.train()
    while state.step < cfg.max_steps:
        step_loss = torch.zeros((), device=accelerator.device)
        for _ in range(cfg.grad_accum_steps):
            with accelerator.accumulate(model):  # DDP's gradient all-reduce runs on the last micro-step only
                loss = model(**next(batches)).loss
                accelerator.backward(loss)  # divides by grad_accum_steps (and scales, for fp16)
                step_loss += loss.detach() / cfg.grad_accum_steps
                if accelerator.sync_gradients:  # the last micro-step: clip, set this step's LR, update
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or math.inf)
                    grad_norm = full_tensor(grad_norm)  # FSDP: a DTensor; the same value on every rank
                    bad_grad_steps += ~torch.isfinite(grad_norm)
                    lr = set_lr(optimizer, lr_at(state.step, cfg))
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
        state.step += 1
        throughput.step()
        is_last, stopping = state.step == cfg.max_steps, False
        saving = (cfg.save_every and state.step % cfg.save_every == 0) or is_last
        if state.step % cfg.log_every == 0 or saving:  # the loop waits for the GPU here only, so it can run ahead
            # over micro-steps, then over ranks; checked before every save, so no broken weights are ever committed
            mean_loss, bad_grads = accelerator.reduce(torch.stack([step_loss, bad_grad_steps]), "mean").tolist()
            log.log(state.step, {"loss": mean_loss, "lr": lr, "grad_norm": grad_norm, "epoch": batches.epoch,
                                 "tokens_seen": state.step * global_batch * cfg.block_size, **throughput.report()})
            if not math.isfinite(mean_loss) or bad_grads:  # the same reduced values on every rank: all stop here
                raise TrainingDiverged(state.step, mean_loss, latest_checkpoint(cfg.output_dir))
            stopping = stop_signals.requested(accelerator)  # collective: every rank stops at the same step
        log.advance()
        if state.step % cfg.eval_every == 0 or is_last:
            log.log(state.step, evaluate(model, eval_loader, accelerator))
        if saving or stopping:
            path = save_checkpoint(accelerator, cfg, parts, state.step, identity)
            log.info(f"checkpoint: {path}")
        if stopping:
            log.stopped(state.step, stop_signals.signal_name or "a signal on another rank", str(path))
            log.close()
            return stop_signals.exit_code
        if state.step % cfg.eval_every == 0 or saving:
            throughput.restart()  # eval and checkpoint time is not training throughput
    # ---------------------------------------------------------------- save
    path = export_model(accelerator, model, cfg.output_dir)
    log.info(f"model: {path}")
    log.close()  # finishes the trackers (the process group is closed by job.run_or_exit, on every way out)
    return 0


# ---------------------------------------------------------------- helpers used by train()


@torch.no_grad()
def evaluate(model, eval_loader, accelerator) -> dict:
    """Loss (per token), perplexity and next-token accuracy over exactly the eval set, computed on every rank."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # loss sum, tokens, right guesses
    for batch in eval_loader:
        per_sample = next_token_counts(model(**batch).logits, batch["labels"])
        # the sampler pads the last batches so every rank has as many; gather_for_metrics drops the copies
        totals += accelerator.gather_for_metrics(per_sample).sum(0)
    model.train()
    loss_sum, tokens, right = totals.tolist()
    metrics = {"eval_loss": loss_sum / tokens, "eval_perplexity": math.exp(min(loss_sum / tokens, 50)),
               "eval_accuracy": right / tokens}
    # a task metric of your own goes here, computed from the same gathered per-sample values
    return metrics


@torch.no_grad()
def check_loss_contract(model, eval_set, device) -> None:
    """Training minimises the model's .loss, evaluate() recomputes it per sample from .logits (exact under
    sharding): a fork whose loss differs (no next-token shift) would train on one number and report another."""
    batch = {k: v.to(device) for k, v in collate([eval_set[i] for i in range(min(2, len(eval_set)))]).items()}
    model.eval()
    output = model(**batch)
    model.train()
    expected = causal_lm_loss(output.logits, batch["labels"]).mean()
    if output.loss is None or not torch.allclose(output.loss.float(), expected, rtol=1e-3, atol=1e-4):
        got = "None" if output.loss is None else f"{output.loss.item():.4f}"
        raise ConfigError(f"model: its .loss ({got}) is not the next-token cross-entropy of its .logits "
                          f"({expected.item():.4f}) that evaluation reports: shift the labels by one in the "
                          f"model's loss (model.causal_lm_loss does), or change evaluate() in main.py to match")


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def check_data_size(train_set, global_batch: int, cfg: TrainConfig) -> None:
    """A stream has no length: a share too small for one block is said when it runs dry (streaming.py)."""
    if not cfg.streaming and len(train_set) < global_batch:
        raise ConfigError(f"dataset: {len(train_set)} training blocks is too few for one optimizer step at "
                          f"world size {global_batch // cfg.batch_size // cfg.grad_accum_steps} x batch_size "
                          f"{cfg.batch_size} x grad_accum_steps {cfg.grad_accum_steps} = {global_batch} blocks")


class TrainingDiverged(RunError):
    """The loss or the gradients went nan or inf. Stop: going on would only save broken weights."""

    def __init__(self, step: int, loss: float, last_checkpoint: Path | None):
        what = f"loss is {loss}" if not math.isfinite(loss) else "the gradient norm was not finite"
        where = f"resume from {last_checkpoint}" if last_checkpoint else "no checkpoint was saved; start again"
        super().__init__(f"{what} at step {step}: training diverged; {where} with a lower lr or more warmup_steps")


if __name__ == "__main__":
    main()
