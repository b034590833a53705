"""Evaluation: model.py's eval metrics over exactly the eval set, every eval_every steps, and the standard
benchmarks of lm-evaluation-harness on the export at the end (--eval_tasks; harness.py).

Exact under any sharding: the eval sampler pads the last batches so every rank has as many, and
gather_for_metrics drops the copies; each column is summed over the samples, the sums turned into
metrics once (model.py's eval_metrics), so accuracy is right / samples and a loss is per item over
the whole set, not a mean of per-batch means."""

from __future__ import annotations

from pathlib import Path

import torch

import task
from buffers import shared_buffers
from hangs import patiently
from harness import evaluate_folder
from plumbing import collectively


@torch.no_grad()
def evaluate(model, eval_loaders: dict, plumbing, cfg) -> dict:
    """model.py's eval metrics over exactly the eval set, as eval_<metric>, computed on every rank. A
    mixture's: over all its sources' eval sets together, and each source's as eval_<metric>/<name>."""
    model.eval()
    sums = {}  # (source, column): the column's sum over the source's eval set
    # every rank evaluates with the buffers the export holds (BatchNorm's statistics; buffers.py)
    with shared_buffers(model, plumbing.num_processes):
        for source, eval_loader in eval_loaders.items():
            for batch in eval_loader:
                # model.py's, per sample: of the forward's output, and of what it generates
                columns = task.batch_columns(model, batch, cfg)
                # the sampler pads the last batches so every rank has as many; gather_for_metrics
                # drops the copies
                for name, values in plumbing.gather_for_metrics(columns).items():
                    sums[source, name] = sums.get((source, name), 0.0) + values.sum()
    model.train()
    # one device-to-host copy
    totals = dict(zip(sums, torch.stack(list(sums.values())).tolist(), strict=True))
    names = dict.fromkeys(name for _, name in totals)
    overall = {name: sum(v for (_, n), v in totals.items() if n == name) for name in names}
    metrics = {f"eval_{key}": value for key, value in task.eval_metrics(overall, cfg).items()}
    for source in eval_loaders:
        if source:  # a mixture's source
            own = {name: value for (s, name), value in totals.items() if s == source}
            metrics.update(
                {f"eval_{k}/{source}": v for k, v in task.eval_metrics(own, cfg).items()}
            )
    return metrics


def evaluate_export(plumbing, cfg) -> dict:
    """The eval_tasks scores of the run's export as {"lm_eval/<task>/<metric>": value}, computed by
    the main process while the others wait (collective; an error is an error on every process)."""
    tasks = [name for name in cfg.eval_tasks.split(",") if name]

    def score_the_export() -> dict:
        if not plumbing.is_main_process:
            return {}
        _, scores, _ = evaluate_folder(
            Path(cfg.run_dir),
            task.build_model,
            tasks,
            cfg.eval_task_path,
            cfg.eval_limit or None,
            plumbing.device,
        )
        return {f"lm_eval/{name}": value for name, value in scores.items()}

    with patiently("the evaluations"):  # the others wait up to dist_timeout_s
        return collectively(plumbing, "lm-evaluation-harness", score_the_export)
