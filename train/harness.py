"""Standard evaluations of a trained model with lm-evaluation-harness (`lm_eval`), an optional install:

    pip install -r requirements-eval.txt

`HarnessLM` is the harness's model interface over any causal LM this template trains (the built-in GPT
and Hugging Face models alike) with the run's own tokenizer (bytes or Hugging Face): log-likelihoods of
continuations (multiple choice), rolling log-likelihoods (perplexity tasks) and greedy generation. A
context and its continuation are split into tokens as the harness's own Hugging Face backend splits
them (the whole text encoded once, the context's tokens cut off), so a Hugging Face export scores
as it does under `lm_eval --model hf`. Windows longer than the model's block_size keep their last
block_size tokens, as the harness does.

Used by scripts/evaluate.py (a run or checkpoint folder) and by main.py at the end of training
(--eval_tasks); `run_tasks` returns {"<task>/<metric>": value}."""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model

from adapters import add_lora, from_peft_format, trainable_weights
from checkpoint import check_weights
from errors import ConfigError
from lm import load_tokenizer
from resume import init_weights
from run_config import saved_config
from run_folder import LAYOUT, RunFolder

INSTALL = "pip install -r requirements-eval.txt"


def check_installed(key: str) -> None:
    """A one-line error naming the install command when lm_eval is missing."""
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(f"{key} needs lm-evaluation-harness, an optional install: {INSTALL}")


def task_manager(tasks: list[str], task_path: str):
    """The YAML task files under task_path (a folder or a file), and the harness's own tasks unless
    task_path has every task asked for (indexing the harness's ~15,000 task files takes seconds)."""
    from lm_eval.tasks import TaskManager

    if not task_path:
        return harness_tasks()
    local = TaskManager(include_path=task_path, include_defaults=False)
    if all(task in local.all_tasks for task in tasks):
        return local
    return TaskManager(include_path=task_path)


@functools.cache
def harness_tasks():
    """The harness's own tasks, indexed once per process: the start-up check and the evaluation at
    the end of training share it."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def check_tasks(key: str, tasks: list[str], task_path: str) -> None:
    """Every task name known to the harness (or found under task_path): one line naming the first
    that is not. Takes a few seconds: the harness indexes its task files."""
    check_installed(key)
    if task_path and not Path(task_path).exists():
        raise ConfigError(f"the task path is not an existing file or folder (got {task_path!r})")
    known = task_manager(tasks, task_path).all_tasks
    unknown = [task for task in tasks if task not in known]
    if unknown:
        where = f" or under {task_path}" if task_path else ""
        raise ConfigError(
            f"{key}: no task '{unknown[0]}' in lm-evaluation-harness{where} "
            f"(lm_eval --tasks list shows them)"
        )


def load_trained(folder: Path, build_model):
    """(config, model with the folder's weights in eval mode, tokenizer or None for bytes) of a run
    folder (its export) or a checkpoint folder; a ConfigError if they do not fit."""
    weights = folder / LAYOUT["export"]
    if not (folder / LAYOUT["config"]).is_file():
        raise ConfigError(
            f"{folder} has no config.yaml: pass a run folder or one of its checkpoints"
        )
    cfg = saved_config(folder / LAYOUT["config"])
    if holds_adapter(folder):
        model = adapted_model(folder, cfg, build_model)
        return cfg, model.eval(), load_tokenizer(cfg.tokenizer_name)
    if not weights.is_file():
        hint = (
            f": its shards make one file with python scripts/consolidate.py {folder} OUT.safetensors"
            if (folder / "model" / ".metadata").is_file()
            else " (the run has not finished: pass a checkpoint)"
        )
        raise ConfigError(f"{folder} has no model.safetensors{hint}")
    # the architecture only: the folder's weights replace the first
    cfg = replace(cfg, model_weights="config")
    model = build_model(cfg)
    check_weights(weights, model)  # another shape: one line naming what differs
    load_model(model, str(weights))
    return cfg, model.eval(), load_tokenizer(cfg.tokenizer_name)


def holds_adapter(folder: Path) -> bool:
    """A LoRA run's export (adapter_model.safetensors), or one of its checkpoints (whose model part
    holds the adapters only); not a merged export, which loads as any model does."""
    if (folder / LAYOUT["adapter"]).is_file():
        return True
    weights = folder / LAYOUT["export"]
    if not weights.is_file():
        return False
    with safe_open(str(weights), framework="pt") as f:
        return any(".lora_" in key for key in f.keys())


def adapted_model(folder: Path, cfg, build_model):
    """The base model, from where the run took it (the hub or a folder; --init_from's file), with
    the folder's adapters on it."""
    if not cfg.hf_model and not cfg.init_from:
        raise ConfigError(
            f"{folder} holds LoRA adapters on a model whose frozen weights were its random "
            "initialisation: only the training run rebuilds those; export it with --merge_adapter"
        )
    model = add_lora(build_model(cfg), cfg)
    if cfg.init_from:
        init_weights(model, cfg.init_from)
    if (folder / LAYOUT["adapter"]).is_file():
        adapter = from_peft_format(load_file(str(folder / LAYOUT["adapter"])))
    else:
        adapter = load_file(str(folder / LAYOUT["export"]))
    check_weights_dict(adapter, trainable_weights(model), folder)
    with torch.no_grad():
        for name, tensor in trainable_weights(model).items():
            tensor.copy_(adapter[name])
    return model


def check_weights_dict(saved: dict, expected: dict, folder: Path) -> None:
    differ = sorted(set(saved) ^ set(expected))
    differ += [k for k in expected if k in saved and saved[k].shape != expected[k].shape]
    if differ:
        raise ConfigError(
            f"{folder}'s adapters do not fit the model its config.yaml builds (lora_r, "
            f"lora_targets): {', '.join(differ[:3])}"
        )


def run_and_checkpoint(folder: Path) -> tuple[Path, dict]:
    """(the run folder, the train_state.json of the step the folder's weights are from): a
    checkpoint's own, or for a run folder its newest checkpoint's (the export is the last step's)."""
    folder = Path(folder)
    if folder.parent.name == LAYOUT["checkpoints"]:
        run, checkpoint = folder.parent.parent, folder
    else:
        run, checkpoint = folder, RunFolder(str(folder)).newest()
    state_file = checkpoint / "train_state.json" if checkpoint else None
    state = json.loads(state_file.read_text()) if state_file and state_file.is_file() else {}
    return run, state


def evaluate_folder(folder: Path, build_model, tasks, task_path="", limit=None, device="cpu"):
    """Run the harness on a run's export or a checkpoint's weights, and write the scores into the
    run folder (evals/step_N.json, merged with earlier tasks of the same step). Returns (step,
    {"<task>/<metric>": value}, the harness's results)."""
    cfg, model, tokenizer = load_trained(Path(folder), build_model)
    scores, results = run_tasks(
        model.to(device), tokenizer, context_length(cfg, model), tasks, task_path, limit
    )
    run, state = run_and_checkpoint(folder)
    step = state.get("step", cfg.max_steps)
    path = run / LAYOUT["evals"] / f"step_{step:08d}.json"
    path.parent.mkdir(exist_ok=True)
    written = json.loads(path.read_text()) if path.is_file() else {"step": step, "scores": {}}
    written["scores"].update(scores)
    written.setdefault("harness", {}).update(results["results"])
    written["model"] = str(folder)
    written["lm_eval_version"] = results.get("lm_eval_version")
    path.write_text(json.dumps(written, indent=2, default=str) + "\n")
    return step, scores, results


def context_length(cfg, model) -> int:
    """The tokens the model reads at once: the run's block_size (the shipped LM's data key), else a
    Hugging Face model's positions (a fork that declares no block_size)."""
    block_size = getattr(cfg, "block_size", None)
    if block_size:
        return block_size
    return getattr(getattr(model, "config", None), "max_position_embeddings", 2048)


def run_tasks(
    model, tokenizer, block_size: int, tasks: list[str], task_path: str = "", limit=None
) -> tuple[dict, dict]:
    """Run the harness on `model` (in eval mode). Returns ({"<task>/<metric>": value}, the
    harness's whole results dict, for a file)."""
    from lm_eval import simple_evaluate

    results = simple_evaluate(
        model=harness_model(model, tokenizer, block_size),
        tasks=tasks,
        task_manager=task_manager(tasks, task_path),
        limit=limit,
        log_samples=False,
    )
    scores = {}
    for task, metrics in results["results"].items():
        for name, value in metrics.items():
            # "acc,none": the metric and its filter; stderr and aliases are kept in the file only
            metric, comma, _ = name.partition(",")
            if comma and isinstance(value, (int, float)) and not metric.endswith("_stderr"):
                scores[f"{task}/{metric}"] = float(value)
    return scores, results


def harness_model(model, tokenizer, block_size: int):
    """A HarnessLM that is also the harness's own LM class, as simple_evaluate requires. lm_eval is
    imported here only: an optional install, and 0.3 s that a training start does not need."""
    from lm_eval.api.model import LM

    return type("HarnessLM", (HarnessLM, LM), {})(model, tokenizer, block_size)


class HarnessLM:
    """The harness's LM interface (harness_model adds its base class) over a causal LM whose
    forward(input_ids=...) returns .logits."""

    def __init__(self, model, tokenizer, block_size: int, batch_size: int = 16):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer  # None: bytes
        self.block_size = block_size
        self.batch_size = batch_size
        self.model_device = next(model.parameters()).device

    # ------------------------------------------------------------ tokens

    @property
    def eot_token_id(self) -> int:
        """What ends a document in training (data.token_stream): a newline for bytes."""
        return ord("\n") if self.tokenizer is None else self.tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(tokens).decode("utf-8", errors="replace")
        return self.tokenizer.decode(tokens)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """As the harness's Hugging Face backend: the context's trailing spaces go with the
        continuation, and the continuation's tokens are the whole text's after the context's."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            continuation = context[-spaces:] + continuation
            context = context[:-spaces]
        whole = self.encode(context + continuation)
        context_tokens = self.encode(context)
        return context_tokens, whole[len(context_tokens) :]

    # ------------------------------------------------------------ the harness's requests

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = []
        for request in requests:
            context, continuation = request.args
            if context:
                pairs.append(self.encode_pair(context, continuation))
            else:  # a continuation without context follows the end of a document
                pairs.append(([self.eot_token_id], self.encode(continuation)))
        return self.score(pairs)

    def loglikelihood_rolling(self, requests) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        totals = []
        for request in requests:
            windows = get_rolling_token_windows(
                token_list=self.encode(request.args[0]),
                prefix_token=self.eot_token_id,
                max_seq_len=self.block_size,
                context_len=1,
            )
            pairs = [make_disjoint_window(window) for window in windows]
            totals.append(sum(loglikelihood for loglikelihood, _ in self.score(pairs)))
        return totals

    @torch.no_grad()
    def generate_until(self, requests) -> list[str]:
        """Greedy, up to max_gen_toks (256) tokens or the first of the `until` strings."""
        outputs = []
        for request in requests:
            context, options = request.args
            until = options.get("until") or []
            until = [until] if isinstance(until, str) else until
            tokens = self.encode(context) or [self.eot_token_id]
            new = []
            text = ""
            for _ in range(options.get("max_gen_toks", 256)):
                window = torch.tensor(
                    [(tokens + new)[-self.block_size :]], device=self.model_device
                )
                new.append(int(self.model(input_ids=window).logits[0, -1].argmax()))
                text = self.decode(new)
                if any(stop in text for stop in until):
                    break
            for stop in until:
                text = text.split(stop)[0]
            outputs.append(text)
        return outputs

    # ------------------------------------------------------------ scoring

    @torch.no_grad()
    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log-likelihood of the continuation given the context, whether it is the greedy one),
        in batches of similar lengths, right-padded (a causal model does not look ahead)."""
        results = [None] * len(pairs)
        longest_first = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0] + pairs[i][1]))
        for start in range(0, len(pairs), self.batch_size):
            chosen = longest_first[start : start + self.batch_size]
            # the last block_size tokens of each text are the model's input (the final token
            # only a target)
            inputs = [(pairs[i][0] + pairs[i][1])[-(self.block_size + 1) :][:-1] for i in chosen]
            width = max(len(tokens) for tokens in inputs)
            padded = torch.zeros((len(inputs), width), dtype=torch.long)
            for row, tokens in enumerate(inputs):
                padded[row, : len(tokens)] = torch.tensor(tokens)
            logits = self.model(input_ids=padded.to(self.model_device)).logits.float()
            for row, i in enumerate(chosen):
                continuation = pairs[i][1]
                end = len(inputs[row])
                wanted = torch.tensor(continuation, device=logits.device)
                predicted = logits[row, end - len(continuation) : end].log_softmax(-1)
                loglikelihood = predicted.gather(1, wanted[:, None]).sum().item()
                greedy = bool((predicted.argmax(-1) == wanted).all())
                results[i] = (loglikelihood, greedy)
        return results
