"""Shared test helpers: launch the real entry points through the real launchers, on CPU, offline.

Every subprocess gets a timeout, a free port, OMP_NUM_THREADS=1 and offline W&B / HF settings, and
a failure shows the tail of its output. Runs shrink the shipped tiny preset (train/configs/tiny.yaml)
rather than inventing a config, and train on a small local text file so each launch takes seconds.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
MAIN = REPO / "train" / "main.py"
TORCH_DDP = REPO / "train" / "torch_ddp.py"
FAULTY_MAIN = REPO / "tests" / "helpers" / "faulty_main.py"
CPU_CONFIG = REPO / "accelerate_configs" / "cpu.yaml"
TINY = REPO / "train" / "configs" / "tiny.yaml"
# a chat template that ends the last assistant turn only where no generation prompt is asked for,
# by `add_generation_prompt == false`, as some in use do (None is not false to it)
END_OF_TURN_ONLY_WITHOUT_A_PROMPT = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{%- if m['role'] != 'assistant' or not loop.last or add_generation_prompt == false %}"
    "{{ '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(tmp_root: Path, **extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        # TORCHINDUCTOR_: where compiled code is kept is the run's own choice (compiling.py)
        if not k.startswith(
            ("WANDB_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "TORCHINDUCTOR_")
        )
    }
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONFAULTHANDLER="1",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_DIR=str(tmp_root),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(SESSION_HF_HOME),
        TOKENIZERS_PARALLELISM="false",
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


SESSION_HF_HOME = Path(os.environ.get("PYTEST_HF_HOME", "/tmp/accelerate-template-tests-hf"))
# the same offline settings for code the tests run in-process (datasets reads them at import)
os.environ.update(HF_HOME=str(SESSION_HF_HOME), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")


def tiny_args(output_dir: Path, dataset: Path, config: Path = TINY, **overrides) -> list[str]:
    """The shipped tiny preset (or another `config`), shrunk to a few dozen steps on a small local
    corpus."""
    values = dict(
        output_dir=output_dir,
        dataset=dataset,
        block_size=32,
        batch_size=4,
        max_steps=24,
        warmup_steps=4,
        log_every=1,
        eval_every=12,
        save_every=8,
        keep_last=2,
        dist_timeout_s=60,
    )
    values.update(overrides)
    args = ["--config", str(config)]
    for key, value in values.items():
        if value is not None:  # None: a key this task's files do not declare (block_size)
            args += [f"--{key}", str(value)]
    return args


def fork_with(root: Path, model_py: Path, data_py: Path) -> Path:
    """A copy of the repository (its git-tracked files) in root/fork, with train/model.py and
    train/data.py replaced by these, as a fork installs its own task."""
    fork = root / "fork"
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    files = listed.stdout.split() if listed.returncode == 0 else []
    if not files:  # not a git checkout: the folders a fork has
        folders = ("train", "tests", "data", "accelerate_configs", "examples")
        files = [
            str(p.relative_to(REPO)) for f in folders for p in (REPO / f).rglob("*") if p.is_file()
        ]
    for name in files:
        if "__pycache__" in name or not (REPO / name).is_file():
            continue
        (fork / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, fork / name)
    shutil.copy(model_py, fork / "train" / "model.py")
    shutil.copy(data_py, fork / "train" / "data.py")
    return fork


def example_file(example: str, file: str):
    """examples/<example>/<file>.py as a module of its own, named <example>_<file> (train/ keeps the
    names `model` and `data` for the shipped files)."""
    spec = importlib.util.spec_from_file_location(
        f"{example}_{file}", REPO / "examples" / example / f"{file}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# the last line of a worker's traceback
WORKER_EXCEPTION = re.compile(r"(\[rank\d+\]:\s*)?\w+(Error|Exception): ")
WORKER_CRASH = re.compile(
    r"terminate called|what\(\):|Fatal Python error|Segmentation fault|core dumped"
)
LAUNCHER_FILE = re.compile(r"accelerate/commands/launch\.py|torch/distributed/run\.py")
LAUNCHER_VERDICT = re.compile(r"^\s*(rank|exitcode|traceback)\s*:")


class Run:
    """A finished launch: exit code, output, and what it wrote."""

    def __init__(self, proc: subprocess.CompletedProcess, output_dir: Path | None):
        self.returncode, self.output, self.output_dir = proc.returncode, proc.stdout, output_dir

    def tail(self, n: int = 40) -> str:
        """Any `error:` or crash line, then the workers' last lines and the launcher's verdict per rank. The
        launcher's own traceback is left out: its 40 lines would hide what the workers printed last."""
        lines = self.output.splitlines()
        launcher = next(
            (
                i
                for i, line in enumerate(lines)
                if line.startswith("Traceback")
                and any(LAUNCHER_FILE.search(below) for below in lines[i + 1 : i + 4])
            ),
            len(lines),
        )
        errors = [
            line
            for line in lines
            if line.startswith("error:")
            or WORKER_EXCEPTION.match(line)
            or WORKER_CRASH.search(line)
        ]
        verdict = [line for line in lines[launcher:] if LAUNCHER_VERDICT.search(line)]
        return "\n".join(errors + ["..."] + lines[:launcher][-n:] + verdict)

    def check(self, expected: int = 0) -> Run:
        assert self.returncode == expected, (
            f"exit code {self.returncode}, expected {expected}\n{self.tail()}"
        )
        return self

    def metrics(self) -> list[dict]:
        return read_metrics(self.output_dir)

    def losses(self) -> dict[int, float]:
        return {row["step"]: row["loss"] for row in self.metrics() if "loss" in row}


def read_metrics(output_dir: Path) -> list[dict]:
    return [
        json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    ]


def _output_dir_of(args: list[str]) -> Path | None:
    return Path(args[args.index("--output_dir") + 1]) if "--output_dir" in args else None


def run(
    cmd: list[str], env: dict, timeout: float = 240, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """Run to the end; past `timeout`, kill the launch's whole process group (its workers too: left running,
    they would slow every later test) and fail with its last lines. Torch elastic starts each worker in a
    session of its own, out of the group's reach: every process of the launch carries a marker in its
    environment, and those are killed too, so a worker left behind by its launcher cannot hold the output
    pipe open and keep the test waiting forever."""
    marker = f"{os.getpid()}.{time.monotonic_ns()}"
    with subprocess.Popen(
        cmd,
        cwd=cwd,
        env={**env, LAUNCH_MARKER: marker},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    ) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # PYTHONFAULTHANDLER: every process prints where it hangs
            kill_launch(proc.pid, marker, signal.SIGABRT)
            try:
                out, _ = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                kill_launch(proc.pid, marker, signal.SIGKILL)
                out, _ = proc.communicate(timeout=30)
            pytest.fail(
                f"timed out after {timeout}s: {' '.join(map(str, cmd))}\n"
                + "\n".join(out.splitlines()[-80:])
            )
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


LAUNCH_MARKER = "TEST_LAUNCH_MARKER"  # in every process a test launches, for kill_launch


def kill_launch(group: int, marker: str, signum: int) -> None:
    """Signal a launch's process group and every process whose environment carries its marker."""
    try:
        os.killpg(group, signum)
    except ProcessLookupError:
        pass
    wanted = f"{LAUNCH_MARKER}={marker}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            marked = wanted in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if marked:
            try:
                os.kill(int(pid), signum)
            except ProcessLookupError:
                pass


CRASH_EXIT = re.compile(r"exitcode\s*:\s*-(6|11)\b")  # SIGABRT, SIGSEGV: signals no test sends


def launch(cmd: list[str], env: dict, timeout: float, output_dir: Path | None) -> Run:
    """Run a launch; if a worker crashed natively (SIGABRT/SIGSEGV) or the launch hung past its timeout,
    run it once more from the same starting folder, with a warning. Measured here: about one launch in
    several hundred has a worker abort with no Python error (gloo over this sandbox's network stack); a
    crash of the template's own would crash again."""
    before = None
    can_run_again = True
    if output_dir is not None and output_dir.exists():
        before = Path(tempfile.mkdtemp(prefix="before-launch-")) / "run"
        try:
            shutil.copytree(output_dir, before, symlinks=True)
        except shutil.Error:  # another live job is writing the folder (a save renamed mid-copy)
            before, can_run_again = None, False  # no snapshot to start a second launch from
    try:
        result = Run(run(cmd, env, timeout), output_dir)
    except pytest.fail.Exception as hung:
        # measured here: a DataLoader worker forked while another thread of its training process held
        # a native lock deadlocks at its start (one launch in about two full suites); a hang of the
        # template's own hangs again, and the second launch fails the test
        if not can_run_again or not str(hung).startswith("timed out after"):
            raise
        result = Run(subprocess.CompletedProcess(cmd, -6, str(hung)), output_dir)
        why = f"a launch hung; launching once more:\n{str(hung)[-1500:]}"
    else:
        why = f"a worker crashed natively; launching once more:\n{result.tail(15)}"
    if (
        result.returncode == 0
        or not can_run_again
        or not (result.returncode in (-6, -11) or CRASH_EXIT.search(result.output))
    ):
        return result
    warnings.warn(why, stacklevel=3)
    if output_dir is not None:
        shutil.rmtree(output_dir, ignore_errors=True)
        if before is not None:
            shutil.copytree(before, output_dir, symlinks=True)
    return Run(run(with_new_port(cmd), env, timeout), output_dir)


def with_new_port(cmd: list[str]) -> list[str]:
    return [
        str(free_port()) if i and cmd[i - 1] == "--main_process_port" else part
        for i, part in enumerate(cmd)
    ]


def accelerate_cmd(
    args: list[str],
    num_processes: int = 2,
    script: Path = MAIN,
    port: int | None = None,
    config: Path = CPU_CONFIG,
    launcher_args: list[str] = (),
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--num_processes",
        str(num_processes),
        "--main_process_port",
        str(port or free_port()),
        *launcher_args,
        str(script),
        *map(str, args),
    ]


def launch_accelerate(
    args: list[str],
    tmp_root: Path,
    num_processes: int = 2,
    script: Path = MAIN,
    env_extra: dict | None = None,
    timeout: float = 240,
    **kw,
) -> Run:
    cmd = accelerate_cmd(args, num_processes, script, **kw)
    return launch(cmd, base_env(tmp_root, **(env_extra or {})), timeout, _output_dir_of(args))


def launch_torchrun(
    args: list[str],
    tmp_root: Path,
    nproc: int = 2,
    script: Path = TORCH_DDP,
    env_extra: dict | None = None,
    timeout: float = 240,
    launcher_args: list[str] = (),
) -> Run:
    cmd = torchrun_cmd(args, nproc, script, launcher_args)
    return launch(cmd, base_env(tmp_root, **(env_extra or {})), timeout, _output_dir_of(args))


def torchrun_cmd(
    args: list[str], nproc: int = 2, script: Path = TORCH_DDP, launcher_args: list[str] = ()
) -> list[str]:
    launcher = list(launcher_args) or ["--standalone"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher,
        "--nproc_per_node",
        str(nproc),
        str(script),
        *map(str, args),
    ]


def run_python(
    args: list[str],
    tmp_root: Path,
    script: Path = MAIN,
    env_extra: dict | None = None,
    timeout: float = 240,
) -> Run:
    cmd = [sys.executable, str(script), *map(str, args)]
    return launch(cmd, base_env(tmp_root, **(env_extra or {})), timeout, _output_dir_of(args))


def write_corpus(path: Path, n_docs: int = 60, doc_bytes: int = 160) -> Path:
    """Deterministic, learnable text: stdlib source lines, as JSON lines."""
    import sysconfig

    source = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n_docs):
            start = (i * 397) % max(1, len(source) - doc_bytes)
            f.write(json.dumps({"text": source[start : start + doc_bytes], "id": i}) + "\n")
    return path


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """~9.6 KB: 270 train blocks of 32 bytes at eval_fraction 0.05 (about 2 epochs in 24 steps)."""
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl")


@pytest.fixture(scope="session")
def baseline(tmp_path_factory, corpus) -> Run:
    """The reference run most end-to-end tests compare against: 2 processes, 24 steps, dropout,
    gradient accumulation, checkpoints every 8 steps. Run once per session."""
    out = tmp_path_factory.mktemp("baseline") / "run"
    return launch_accelerate(baseline_args(out, corpus), out.parent).check()


def assert_matches_baseline(run_dir, baseline):
    reference, resumed = (
        load_weights(baseline.output_dir / "model.safetensors"),
        load_weights(run_dir / "model.safetensors"),
    )
    assert reference.keys() == resumed.keys()
    different = [k for k in reference if not torch.equal(reference[k], resumed[k])]
    assert not different, f"weights differ from the uninterrupted run: {different[:3]}"
    losses = {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}
    assert losses == baseline.losses()  # every step 1..24, interrupted part and replayed part alike


@pytest.fixture(scope="session")
def four_processes(tmp_path_factory, corpus) -> Run:
    """One launcher, 4 processes, batch 4, no dropout, 8 steps (checkpoints at 4 and 8), each rank recording the
    sample ids it loads: the reference of the two-"node" runs and of resuming on another world size."""
    out = tmp_path_factory.mktemp("four") / "run"
    args = tiny_args(out, corpus, max_steps=8, save_every=4, eval_every=8, dist_timeout_s=30)
    return launch_accelerate(
        args,
        out.parent,
        num_processes=4,
        script=FAULTY_MAIN,
        env_extra={"RECORD_SAMPLES": out.parent / "ids"},
    ).check()


def baseline_args(output_dir: Path, corpus: Path, **overrides) -> list[str]:
    return tiny_args(output_dir, corpus, dropout=0.1, grad_accum_steps=2, **overrides)


def script(name: str):
    """scripts/<name>.py as a module (scripts/ is not put on the path: its evaluate.py would shadow the
    `evaluate` package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the tiny Hugging Face models, tokenizers and chats are made as users make theirs
# (python scripts/tiny_chat_model.py OUT_DIR), by the same functions
tiny_chat_model = script("tiny_chat_model")
save_tiny_llama = tiny_chat_model.save_tiny_llama
write_chats = tiny_chat_model.write_chats


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory, corpus) -> Path:
    """A byte-level BPE tokenizer of 320 tokens (more than a byte holds), trained offline on the test corpus
    and saved as a Hugging Face tokenizer folder; its EOS is <|endoftext|>."""
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    folder = tmp_path_factory.mktemp("bpe")
    tiny_chat_model.train_bpe_tokenizer(texts).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, bpe_tokenizer) -> Path:
    from transformers import AutoTokenizer

    return save_tiny_llama(
        tmp_path_factory.mktemp("llama"), len(AutoTokenizer.from_pretrained(bpe_tokenizer))
    )


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory, bpe_tokenizer) -> Path:
    """The BPE tokenizer with ChatML's two special tokens and a chat template whose {% generation %}
    marks what the assistant says (tiny_chat_model.CHAT_TEMPLATE), saved as a folder."""
    from transformers import AutoTokenizer

    tokenizer = tiny_chat_model.with_chat_template(AutoTokenizer.from_pretrained(bpe_tokenizer))
    folder = tmp_path_factory.mktemp("chat_tokenizer")
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def chat_llama(tmp_path_factory, chat_tokenizer) -> Path:
    """A tiny Llama sized to the chat tokenizer (128 positions), with its tokenizer beside it (as a hub
    checkpoint is): --hf_model FOLDER alone is enough."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer)
    return tiny_chat_model.save_chat_model(tmp_path_factory.mktemp("chat_llama"), tokenizer)


def model_declares_blocks() -> bool:
    """Whether model.py's model names its repeated blocks (_no_split_modules), which FSDP shards and
    activation checkpointing recomputes one by one. A fork's model without blocks skips those tests."""
    from model import build_model
    from run_config import config_class

    RunConfig = config_class()

    model = build_model(RunConfig(n_layer=1, n_head=2, n_embd=16, block_size=8))
    return bool(getattr(model, "_no_split_modules", None))


NEEDS_BLOCKS = "model.py's model declares no blocks (_no_split_modules): FSDP and activation checkpointing need them"
