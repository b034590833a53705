"""What a run reports: metrics.jsonl, config.yaml, console lines, a progress bar, and trackers.

`MetricsLogger` is a no-op off the main process, so the loop calls it on every rank without an `if
rank == 0`; the progress bar shows on each node's local main process. Trackers (W&B, TensorBoard) go
through the plumbing's tracking API (`init_trackers`, `log`); every row also goes to metrics.jsonl,
readable without any tracker."""

from __future__ import annotations

import atexit
import importlib.util
import json
import math
import os
import secrets
import time
from dataclasses import asdict

import yaml
from tqdm.auto import tqdm

import task
from compiling import report as compile_report
from config import TrainConfig
from errors import first_line
from plumbing import is_writer
from profiling import restart_line, start_clock
from provenance import environment_info, launch_record, relaunch_command
from sharding import fsdp_setting
from storage import StoreError, open_run_folder


class MetricsLogger:
    def __init__(self, cfg: TrainConfig, plumbing):
        self.cfg = cfg
        self.plumbing = plumbing
        self.enabled = plumbing.is_main_process
        self.show_progress = plumbing.is_local_main_process
        # on object storage: this node's staging folder, the bucket behind it (storage.py)
        self.folder = open_run_folder(cfg)
        self.metrics_file = None
        self.bar = None
        self.tracker_failed = False
        self.started = time.monotonic()  # for the summary's wall time
        self.evaluations: list[dict] = []  # the run's eval rows, for the summary
        self.first_step = 0  # the step this start began at
        self.restart: dict | None = None  # the restart report's row, once start() knows the step

    def start(self, cfg: TrainConfig, step: int, run_info: dict) -> None:
        """Write config.yaml (the config as the resume settled it) and run_info.json; keep
        metrics.jsonl rows up to `step` (a resume re-logs the rest)."""
        self.cfg = cfg
        if self.show_progress:
            # disable=None: no bar when stderr is not a terminal (CI, SLURM logs); the
            # log lines remain
            self.bar = tqdm(
                total=self.cfg.max_steps,
                initial=step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                mininterval=1.0,
                disable=None,
            )
            # this run is the requeued one (on object storage, each node's)
            self.folder.clear_requeue_marker()
        if not self.enabled:
            return
        self.folder.local.mkdir(parents=True, exist_ok=True)
        self.folder.path("config").write_text(yaml.safe_dump(asdict(self.cfg), sort_keys=False))
        info_file = self.folder.path("run_info")
        # how each start was launched, the first one's kept by every resume and requeue
        previous = (
            json.loads(info_file.read_text()).get("launches", []) if info_file.exists() else []
        )
        launches = [*previous, launch_record()]
        info_file.write_text(json.dumps({**run_info, "launches": launches}, indent=2) + "\n")
        path = self.folder.path("metrics")
        logged = path.read_text().splitlines(keepends=True) if path.exists() else []
        # what the starts before this one trained past the checkpoint it resumes from
        steps_logged = [_step_of(line) for line in logged]
        last_logged = max((step for step in steps_logged if math.isfinite(step)), default=0)
        self.restart = {
            "step": step + 1,  # written after this start's first step
            "start": len(launches),
            "resumed_from_step": step,
            "steps_lost": max(0, int(last_logged) - step),
        }
        # a resume re-logs the rest
        kept = [line for line in logged if _step_of(line) <= step]
        path.write_text("".join(kept))
        # the earlier starts' evaluations too: the summary's best is the run's
        self.evaluations = [row for row in map(json.loads, kept) if is_evaluation(row)]
        self.first_step = step
        # line-buffered: readable while training runs
        self.metrics_file = open(path, "a", buffering=1)
        # trackers are finished on every way out, errors included (W&B hangs otherwise)
        atexit.register(self.close_at_exit)
        for line in run_info_lines(run_info):
            self.info(line)

    def start_trackers(self, run_id: str, resumed_step: int) -> None:
        """Start the configured trackers on the main process. W&B: a resumed run rewinds its W&B run
        to the checkpoint's step; a server without rewind gets a plain resume, one that cannot be
        reached offline mode."""
        self._start_trackers(run_id, resumed_step)
        start_clock.lap("trackers")  # the restart report's: since the checkpoint was loaded

    def _start_trackers(self, run_id: str, resumed_step: int) -> None:
        names = self.cfg.trackers()
        if "wandb" in names and importlib.util.find_spec("wandb") is None:
            self.warn(
                "tracker wandb: the wandb package is not installed (pip install wandb); not logging to W&B"
            )
            names.remove("wandb")
        if not names or not self.enabled:
            return
        project = os.environ.get("WANDB_PROJECT") or self.cfg.project
        first = wandb_init_kwargs(self.cfg, run_id, resumed_step)
        attempts = [
            first,
            *([wandb_init_kwargs(self.cfg, run_id, 0)] if resumed_step else []),
            {**first, "mode": "offline"},
        ]  # offline keeps the rewind: `wandb sync` applies it
        for number, wandb_kwargs in enumerate(attempts, 1):
            try:
                self.plumbing.init_trackers(
                    project, config=asdict(self.cfg), init_kwargs={"wandb": wandb_kwargs}
                )
                break
            # no API key, no network, server down, no rewind: training goes on
            except Exception as e:
                if "wandb" not in names:
                    raise
                finish_trackers(self.plumbing)
                import wandb

                wandb.teardown()  # the failed run still holds its id in W&B's service process
                then = (
                    "trackers off (metrics.jsonl goes on)"
                    if number == len(attempts)
                    else "logging to W&B offline instead"
                    if number == len(attempts) - 1
                    else "trying a resume without rewinding the W&B run"
                )
                self.warn(f"W&B could not start ({first_line(e)}); {then}")
        wandb_run = next((t.tracker for t in self.plumbing.trackers if t.name == "wandb"), None)
        if wandb_run is not None and wandb_run.settings.mode == "offline":
            self.info(
                f"W&B is offline: upload this run later with `wandb sync {wandb_run.dir.rsplit('/', 1)[0]}`"
            )

    def log(self, step: int, metrics: dict) -> None:
        """One metrics.jsonl row and one console line."""
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        if is_evaluation(row):
            self.evaluations.append(row)
        self.metrics_file.write(json.dumps(row) + "\n")
        self._to_trackers(row, step)
        if self.bar is not None and row.get("loss") is not None:
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", refresh=False)
        self.info(
            " | ".join(
                [f"step {step}/{self.cfg.max_steps}"]
                + [_fmt(k, v) for k, v in watched(row).items() if k != "step"]
            )
        )

    def stopped(self, step: int, signal_name: str, checkpoint: str) -> None:
        """A stop on a signal, with a checkpoint. Except after Ctrl-C, leave the requeue marker."""
        self.close_bar()  # the line below is the last on the screen
        # the process that writes the run folder: on node-local disks and object storage (staging
        # folders), each node's, for each node's job script to read
        if is_writer(self.plumbing, self.folder.shared) and signal_name != "SIGINT":
            self.folder.mark_for_requeue(step, signal_name, checkpoint)
        self.info(
            f"stopping at step {step} on {signal_name}, checkpoint saved: continue with "
            + relaunch_command("--output_dir", self.cfg.output_dir, "--resume", "latest")
        )

    def finished(self, step: int, model_path) -> None:
        """The run's summary, once it has exported: this start's wall time, the last and the best
        evaluation of the whole run, where the model is, and the next commands, each as it can be
        pasted (the launcher included; a resume reads the run's config.yaml): scripts/sample.py's
        with the flags of the task's model, where it writes text (task.sample_flags)."""
        self.close_bar()  # the summary is the last thing on the screen
        minutes, seconds = divmod(round(time.monotonic() - self.started), 60)
        took = f"in {minutes} min {seconds} s"
        if self.first_step:  # a resumed run: what this start trained, the evaluations are the run's
            took = f"(this start: steps {self.first_step + 1}-{step} {took})"
        lines = [f"done: step {step} {took}"]
        if self.evaluations:
            last = self.evaluations[-1]
            said = [_fmt(k, v) for k, v in watched(last).items() if k != "step"]
            lines.append(f"final eval (step {last['step']}): {' | '.join(said)}")
            scored = [row for row in self.evaluations if "eval_loss" in row]
            if scored:
                best = min(scored, key=lambda row: row["eval_loss"])
                lines.append(f"best eval_loss: {best['eval_loss']:.4g} at step {best['step']}")
        run = self.cfg.output_dir
        lines.append(f"model: {model_path}")
        lines.append(f"curves: python scripts/plot_metrics.py {run}")
        sample_flags = task.sample_flags(self.cfg)
        if sample_flags:
            lines.append(f"samples: python scripts/sample.py {run} {sample_flags}")
        further = str(2 * step)
        lines.append(
            f"train on to step {further} (the LR schedule stretched to it): "
            + relaunch_command(
                "--output_dir",
                run,
                "--resume",
                "latest",
                "--max_steps",
                further,
                "--lr_decay_steps",
                further,
            )
        )
        for line in lines:
            self.info(line)

    def advance(self) -> None:
        """After each step (and its logging): the progress bar; after this start's first, the
        restart report."""
        if self.bar is not None:
            self.bar.update(1)
            if self.bar.n >= self.bar.total:  # its last step: the bar stays above what follows
                self.close_bar()
        if self.restart is not None:
            self.report_start()

    def close_bar(self) -> None:
        """Close the progress bar: its last state is printed once, where the console is now. Every
        line after it (the summary, a stop's line) is then the last thing on the screen: an open bar
        is drawn again below each line tqdm.write prints. Idempotent."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def report_start(self) -> None:
        """The restart report (profiling.py): one metrics.jsonl row and one line, after this start's
        first step."""
        row, self.restart = self.restart, None
        # with the graphs compiled, and the kept ones found
        row = {**start_clock.finish(row), **compile_report()}
        self.metrics_file.write(json.dumps(row) + "\n")
        self._to_trackers(row, row["step"])
        self.info(restart_line(row))

    def _to_trackers(self, row: dict, step: int) -> None:
        if self.plumbing.trackers and not self.tracker_failed:
            try:
                self.plumbing.log(
                    {k: v for k, v in row.items() if v is not None and k != "step"}, step=step
                )
            except Exception as e:  # a tracker's trouble never stops training
                self.tracker_failed = True
                self.warn(
                    f"tracker logging failed ({first_line(e)}); metrics.jsonl continues, trackers stop"
                )

    def info(self, message: str) -> None:
        if self.enabled:
            tqdm.write(message)  # prints above the progress bar instead of through it

    def warn(self, message: str) -> None:
        self.info(f"warning: {message}")

    def close_at_exit(self) -> None:
        """close() on a way out that has said its line already: a failed upload is a warning."""
        try:
            self.close()
        except StoreError as e:
            self.warn(str(e))

    def close(self) -> None:
        """Idempotent: called at the end, on preemption, and at exit."""
        self.close_bar()
        if self.metrics_file is not None:
            self.metrics_file.close()
            self.metrics_file = None
            # on object storage: the run files as they end, the export among them
            uploaded_to = self.folder.upload_run_files(at_the_end=True)
            if uploaded_to:
                self.info(f"run files uploaded to {uploaded_to}")
        finish_trackers(self.plumbing)


def wandb_init_kwargs(cfg: TrainConfig, run_id: str, resumed_step: int) -> dict:
    """wandb.init arguments: the run id from the checkpoint continues the same W&B run after a
    resume, rewound to the checkpoint's step (`resume_from`). Entity, tags and group fall back to
    WANDB_ENTITY / WANDB_TAGS / WANDB_RUN_GROUP; the API key only ever comes from WANDB_API_KEY or
    `wandb login`."""
    # quiet: no ~25-line summary at the end of every run (the offline sync hint is
    # printed by start_trackers)
    kwargs = {"name": cfg.run_label, "dir": cfg.run_dir, "settings": {"quiet": True}}
    if resumed_step:
        kwargs["resume_from"] = f"{run_id}?_step={resumed_step}"
    else:
        kwargs.update(id=run_id, resume="allow")
    optional = {
        "entity": cfg.wandb_entity,
        "group": cfg.wandb_group,
        "tags": [t for t in cfg.wandb_tags.split(",") if t],
    }
    return {**kwargs, **{k: v for k, v in optional.items() if v}}


def new_run_id() -> str:
    """A new run's tracker id: WANDB_RUN_ID when the job sets it (from the job's name, so that every
    restart of a Kubernetes pod or a SkyPilot recovery logs to one run, even before the first
    checkpoint holds the id), else a random one."""
    chosen = os.environ.get("WANDB_RUN_ID", "")
    return chosen or secrets.token_hex(4)  # os.urandom: drawing it does not move the training RNG


def finish_trackers(plumbing) -> None:
    for tracker in plumbing.trackers:
        try:
            tracker.finish()
        except Exception:  # a tracker whose start failed has nothing to finish
            pass
    plumbing.trackers.clear()


# what a person watches of a training row on the console (metrics.jsonl and the trackers keep every
# field): the loss, the lr, the task's rate (tokens/s where it counts tokens, else samples/s), MFU
WATCHED = ("loss", "lr", "tokens_per_s", "mfu")
WATCHED_WITHOUT_TOKENS = ("loss", "lr", "samples_per_s")


def watched(row: dict) -> dict:
    """A training row's watched fields, and anything it says that is not routine (a straggler, a
    compile); an evaluation's overall metrics, not each class's or source's (eval_accuracy/<class>,
    eval_loss/<source>: metrics.jsonl and the trackers keep them), counted by kind; any other row
    (lm-evaluation-harness scores) whole."""
    if "grad_norm" not in row:
        said = {k: v for k, v in row.items() if not is_breakdown(k)}
        if len(said) < len(row):
            said["+"] = f"{breakdown_counts(row)} in metrics.jsonl"
        return said
    fields = WATCHED if "tokens_per_s" in row else WATCHED_WITHOUT_TOKENS
    routine = {"grad_norm", "epoch", "samples_seen", "tokens_seen", "samples_per_s", "step_time_s"}
    routine |= {"peak_rss_gib", "peak_mem_gib", "tokens_per_s", "mfu"}
    routine |= {"slowest_rank", "slowest_rank_s", "median_rank_s"}  # straggler_rank is said
    said = {k: v for k, v in row.items() if k in fields}
    said.update({k: v for k, v in row.items() if k not in routine and k not in said})
    return said


def is_breakdown(key: str) -> bool:
    """An eval metric of one class or one source (evaluation.evaluate's eval_<metric>/<name>)."""
    return key.startswith("eval_") and "/" in key


def breakdown_counts(row: dict) -> str:
    """What an eval row's breakdown holds, by kind: "12 per source" (a mixture's sources are the
    names every source's eval_loss/<name> gives), "10 per class" (the rest: model.py's
    <metric>/<class>), or both."""
    keys = [key for key in row if is_breakdown(key)]
    sources = {key.removeprefix("eval_loss/") for key in keys if key.startswith("eval_loss/")}
    per_source = sum(any(key.endswith(f"/{source}") for source in sources) for key in keys)
    kinds = [(per_source, "per source"), (len(keys) - per_source, "per class")]
    return ", ".join(f"{count} {kind}" for count, kind in kinds if count)


# the start-up block: one line per group of run_info.json's keys (all of them: run_info.json)
RUN_INFO_LINES = {
    "environment": (
        "python",
        "torch",
        "accelerate",
        "datasets",
        "cuda",
        "nccl",
        "git",
        "git_dirty",
        "host",
    ),
    "job": ("processes", "mixed_precision", "fsdp", "global_batch_size", "parameters"),
    "data": ("train_samples", "eval_samples", "tokens_per_sample"),
}


def run_info_lines(run_info: dict) -> list[str]:
    """output_dir, then a few lines of `key value` pairs; an unknown value (None) is left out, and a
    key of a fork's own gets a line of its own."""
    lines = [f"output_dir: {run_info.get('output_dir')}"]
    grouped = {key for keys in RUN_INFO_LINES.values() for key in keys}
    grouped |= {"output_dir", "trainable_parameters"}
    for title, keys in RUN_INFO_LINES.items():
        pairs = [f"{key} {run_info[key]}" for key in keys if run_info.get(key) is not None]
        if pairs:
            lines.append(f"{title}: {', '.join(pairs)}")
    trained, total = run_info.get("trainable_parameters"), run_info.get("parameters")
    if trained is not None and trained < total:  # LoRA's adapters, or a model with frozen layers
        lines.append(f"trainable: {trained:,} parameters of {total:,} ({trained / total:.1%})")
    lines += [f"{key}: {value}" for key, value in run_info.items() if key not in grouped]
    return lines


def _step_of(line: str) -> float:
    """A row's step; a line torn by a crash mid-write counts as past every step, so it is
    dropped."""
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return math.inf


def _plain(value):
    value = value.item() if hasattr(value, "item") else value
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _fmt(key: str, value) -> str:
    if isinstance(value, float):
        return f"{key} {value:.4g}" if abs(value) < 1e4 else f"{key} {value:,.0f}"
    return f"{key} {value}"


def run_info(cfg: TrainConfig, plumbing, plain_model, data) -> dict:
    """What run_info.json and the first log lines say about the run (`data`: batches.RunData)."""
    return {
        "output_dir": cfg.output_dir,
        **environment_info(),
        "processes": plumbing.num_processes,
        "mixed_precision": plumbing.mixed_precision,
        "fsdp": fsdp_setting(cfg),  # and where it was set: --fsdp or the accelerate config
        "global_batch_size": cfg.global_batch(plumbing.num_processes),
        "tokens_per_sample": task.tokens_per_sample(cfg),
        "train_samples": "streamed" if cfg.streaming else len(data.train_set),
        "eval_samples": sum(len(eval_set) for eval_set in data.eval_sets.values()),
        "parameters": sum(p.numel() for p in plain_model.parameters()),
        "trainable_parameters": sum(p.numel() for p in plain_model.parameters() if p.requires_grad),
    }


def is_evaluation(row: dict) -> bool:
    """An eval row of metrics.jsonl: the task's eval_<metric>s (eval_loss for the LM, any for a fork)."""
    return any(key.startswith("eval_") for key in row)
