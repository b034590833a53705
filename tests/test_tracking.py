"""Tracking pieces in-process: the FLOPs-per-token formula, the peak table, the logger's no-op mode; and
what a run in a terminal shows last."""

import importlib.util
import json
import os
import select
import shutil
import subprocess
import sys

import pytest
import torch

from blocks import flops_per_token
from conftest import MAIN, REPO, base_env, tiny_args
from model import build_model
from profiling import Throughput, peak_flops_per_gpu
from run_config import config_class
from torch_ddp import TorchDDP
from tracking import MetricsLogger, wandb_init_kwargs

RunConfig = config_class()  # TrainConfig and model.py's and data.py's own keys


@pytest.mark.shipped
@pytest.mark.parametrize("bias", [False, True])
def test_flops_per_token_matches_a_hand_count(bias):
    cfg = RunConfig(n_layer=2, n_head=2, n_embd=8, block_size=4, bias=bias)
    # b: a bias per output (linear) or per feature (norm), if any
    d, L, T, V, b = (
        8,
        2,
        4,
        256,
        int(bias),
    )
    per_block = (
        (d + b * d)
        + (3 * d * d + b * 3 * d)
        + (d * d + b * d)
        + (d + b * d)
        + (4 * d * d + b * 4 * d)
        + (4 * d * d + b * d)
    )
    #   ln_1           qkv                      attn proj          ln_2           fc                      mlp proj
    # tied embedding/output + blocks + final norm; no position table
    params = V * d + L * per_block + (d + b * d)
    expected = 6 * params + 12 * L * d * T
    model = build_model(cfg)
    # the position table is the rest
    assert sum(p.numel() for p in model.parameters()) == params + T * d
    assert model.flops_per_token() == expected == flops_per_token(model)


def test_a_model_without_an_estimate_gets_six_n():
    model = torch.nn.Linear(10, 5)
    assert flops_per_token(model) == 6 * 55


@pytest.mark.parametrize(
    "name, flops",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-40GB", 312e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA GeForce GTX 1080", None),
    ],
)
def test_peak_table(name, flops):
    assert peak_flops_per_gpu(name) == flops


def test_no_mfu_or_gpu_memory_on_cpu_but_the_peak_resident_memory():
    meter = Throughput(
        samples_per_step=8,
        tokens_per_sample=64,
        model=torch.nn.Linear(4, 4),
        num_processes=2,
        mixed_precision="bf16",
    )
    meter.step()
    report = meter.report()
    assert report["tokens_per_s"] > 0 and report["samples_per_s"] > 0 and report["step_time_s"] > 0
    assert "mfu" not in report and "peak_mem_gib" not in report
    assert 0.05 < report["peak_rss_gib"] < 24  # this test process: torch alone is a few hundred MiB


def test_logger_is_a_no_op_off_the_main_process(tmp_path, monkeypatch):
    cfg = RunConfig(output_dir=str(tmp_path / "run"), tracker="wandb")
    monkeypatch.setenv("RANK", "1")  # the view of rank 1 (on another node), without a process group
    monkeypatch.setenv("LOCAL_RANK", "1")
    log = MetricsLogger(cfg, TorchDDP(cfg))
    log.start(log.cfg, 0, {"processes": 2})
    log.start_trackers("abc", 0)
    log.log(1, {"loss": 1.0})
    log.stopped(1, "SIGTERM", "somewhere")
    log.close()
    assert not (tmp_path / "run").exists()


def test_wandb_arguments_come_from_config_and_never_hold_a_key(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "sk-should-not-appear")
    cfg = RunConfig(output_dir=str(tmp_path / "exp1"), wandb_tags="a,b", wandb_group="sweep")
    kwargs = wandb_init_kwargs(cfg, "run123", 0)
    assert kwargs == {
        "name": "exp1",
        "id": "run123",
        "resume": "allow",
        "dir": str(tmp_path / "exp1"),
        "group": "sweep",
        "tags": ["a", "b"],
        "settings": {"quiet": True},
    }
    assert "sk-should-not-appear" not in json.dumps(kwargs)
    # a resume rewinds the W&B run to the checkpoint's step
    rewind = wandb_init_kwargs(cfg, "run123", 40)
    assert (
        rewind["resume_from"] == "run123?_step=40" and "id" not in rewind and "resume" not in rewind
    )


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path):
    cfg = RunConfig(output_dir=str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    torn = '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo'
    (tmp_path / "run" / "metrics.jsonl").write_text(torn)
    log = MetricsLogger(cfg, TorchDDP(cfg))
    log.start(log.cfg, 2, {})  # resumed at step 2: the crash tore the row of step 3 mid-write
    log.log(3, {"loss": 1.25})
    log.close()
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [row["step"] for row in rows] == [1, 2, 3] and rows[-1]["loss"] == 1.25


def test_a_launch_record_holds_the_uncommitted_changes_of_a_dirty_checkout(tmp_path):
    """git_changes reads the checkout the template runs from: here a copy in a fresh repository, changed
    after its commit (one change staged with git add, one not), with one file git does not know yet."""
    import importlib.util
    import subprocess

    (tmp_path / "train").mkdir()
    shutil.copy(REPO / "train" / "provenance.py", tmp_path / "train" / "provenance.py")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "first"], check=True)
    (tmp_path / "train" / "staged.py").write_text("# a staged change\n")
    subprocess.run([*git, "add", "train/staged.py"], check=True)
    with open(tmp_path / "train" / "provenance.py", "a") as changed:
        changed.write("# a local change\n")
    (tmp_path / "notes.txt").write_text("not committed")
    spec = importlib.util.spec_from_file_location(
        "provenance_copy", tmp_path / "train" / "provenance.py"
    )
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    changes = copy.git_changes()
    assert "+# a local change" in changes["git_diff"] and changes["git_untracked"] == ["notes.txt"]
    assert "+# a staged change" in changes["git_diff"], "a staged change is missing from the record"


def test_the_console_line_says_what_a_person_watches_and_metrics_jsonl_keeps_the_rest():
    from tracking import run_info_lines, watched

    routine = {"grad_norm": 0.4, "epoch": 0.1, "samples_seen": 80, "step_time_s": 0.2}
    classifier = {"loss": 0.7, "lr": 1e-3, "samples_per_s": 400.0, **routine}
    assert list(watched(classifier)) == ["loss", "lr", "samples_per_s"]
    lm = {**classifier, "tokens_per_s": 9e4, "tokens_seen": 5120, "mfu": 0.4}
    assert list(watched(lm)) == ["loss", "lr", "tokens_per_s", "mfu"]
    assert list(watched({**lm, "straggler_rank": 3})) == [
        "loss",
        "lr",
        "tokens_per_s",
        "mfu",
        "straggler_rank",
    ]
    evaluation = {
        "eval_loss": 0.5,
        "eval_accuracy": 0.9,
        "eval_accuracy/cat": 1.0,
        "eval_accuracy/dog": 0.8,
    }
    assert watched(evaluation) == {
        "eval_loss": 0.5,
        "eval_accuracy": 0.9,
        "+": "2 per class in metrics.jsonl",
    }
    # a mixture of two sources (one named with a slash), each with its loss and accuracy: per source
    mixture = {"eval_loss": 2.0, "eval_accuracy": 0.3}
    for source in ("code", "web/en"):
        mixture |= {f"eval_loss/{source}": 2.0, f"eval_accuracy/{source}": 0.3}
    assert watched(mixture) == {
        "eval_loss": 2.0,
        "eval_accuracy": 0.3,
        "+": "4 per source in metrics.jsonl",
    }
    # a classifier's mixture: each class overall, and each source's metrics with its own classes
    both = {**evaluation, "eval_loss/a": 0.4, "eval_accuracy/a": 0.9, "eval_accuracy/cat/a": 1.0}
    assert watched(both)["+"] == "3 per source, 2 per class in metrics.jsonl"
    # lm-evaluation-harness scores are what the row is for: said, not counted away
    scores = {"lm_eval/hellaswag/acc": 0.31, "lm_eval/arc_easy/acc": 0.42}
    assert watched(scores) == scores
    info = {"output_dir": "runs/run_001", "torch": "2.13.0", "cuda": None, "processes": 2}
    info |= {"train_samples": 88, "tokens_per_sample": None, "augmentation": "flips"}
    assert run_info_lines(info) == [
        "output_dir: runs/run_001",
        "environment: torch 2.13.0",
        "job: processes 2",
        "data: train_samples 88",
        "augmentation: flips",
    ]


def test_a_new_run_s_tracker_id_is_the_jobs_when_it_sets_wandb_run_id(monkeypatch):
    """Kubernetes and SkyPilot name it after the job (scripts/kubernetes, scripts/skypilot): every restart
    logs to one W&B run, even before a checkpoint holds the id."""
    from tracking import new_run_id

    monkeypatch.setenv("WANDB_RUN_ID", "gpt-small-001")
    assert new_run_id() == "gpt-small-001"
    monkeypatch.delenv("WANDB_RUN_ID")
    first, second = new_run_id(), new_run_id()
    assert len(first) == 8 and first != second


def test_a_wandb_resume_through_the_offline_fallback_keeps_the_rewind(tmp_path):
    """A resumed run whose W&B server refuses (no key, no network): the fallbacks are a resume without
    the rewind, then offline, and offline keeps the rewind to the checkpoint's step (`wandb sync`
    applies it): the steps after the checkpoint are not logged twice."""
    attempts = []

    class Refusing:  # the Accelerator's tracker calls: online refused, offline taken
        is_main_process = is_local_main_process = True
        trackers = []

        def init_trackers(self, project, config, init_kwargs):
            attempts.append(init_kwargs["wandb"])
            if init_kwargs["wandb"].get("mode") != "offline":
                raise RuntimeError("no W&B server")

    cfg = RunConfig(output_dir=str(tmp_path / "run"), tracker="wandb")
    log = MetricsLogger(cfg, Refusing())
    log.start_trackers("run123", 40)
    assert [attempt.get("mode") for attempt in attempts] == [None, None, "offline"]
    assert attempts[0]["resume_from"] == "run123?_step=40"
    assert attempts[1]["id"] == "run123" and "resume_from" not in attempts[1]
    assert attempts[2]["resume_from"] == "run123?_step=40" and "id" not in attempts[2]


def test_the_plot_draws_what_the_task_reports_a_classifiers_accuracy_f1_and_classes(tmp_path):
    """scripts/plot_metrics.py on a classifier's rows: samples/s (it counts no tokens), and a panel
    for each metric its evaluation reports, per-class values together; every panel has a curve."""
    spec = importlib.util.spec_from_file_location("plot_metrics", REPO / "scripts/plot_metrics.py")
    plot_metrics = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_metrics)
    rows = [
        {"step": 10, "loss": 0.9, "lr": 1e-3, "grad_norm": 1.0, "samples_per_s": 50.0},
        {
            "step": 20,
            "eval_loss": 0.7,
            "eval_accuracy": 0.6,
            "eval_accuracy/cat": 0.5,
            "eval_accuracy/dog": 0.7,
            "eval_f1_macro": 0.55,
        },
    ]
    panels = dict(plot_metrics.panels_of({"run": rows}))
    assert panels == {
        "loss": ["loss", "eval_loss"],
        "learning rate": ["lr"],
        "gradient norm (before clipping)": ["grad_norm"],
        "samples/s (all processes)": ["samples_per_s"],
        "accuracy (eval)": ["eval_accuracy"],
        "accuracy/<class> (eval)": ["eval_accuracy/cat", "eval_accuracy/dog"],
        "f1_macro (eval)": ["eval_f1_macro"],
    }
    out = tmp_path / "curves.png"
    plot_metrics.plot({"run": rows}, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def in_a_terminal(cmd: list[str], env: dict, timeout: float = 240) -> str:
    """Everything `cmd` wrote to a pseudo-terminal 120 columns wide (stdout and stderr both), as a person's
    terminal receives it: tqdm's bar shows only on a terminal."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=env, cwd=REPO
    )
    os.close(follower)
    received = b""
    try:
        while select.select([leader], [], [], timeout)[0]:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                break
            if not chunk:
                break
            received += chunk
    finally:
        os.close(leader)
        proc.kill()
        proc.wait()
    return received.decode(errors="replace")


@pytest.mark.slow
def test_in_a_terminal_the_summary_is_the_last_thing_on_the_screen(tmp_path, corpus):
    """The progress bar is drawn again below every line printed while it is open: closed at the last
    step, its final state stays above the last evaluation, the checkpoint and the summary."""
    args = tiny_args(tmp_path / "run", corpus, max_steps=6, eval_every=6, save_every=0)
    screen = in_a_terminal([sys.executable, str(MAIN), *args], base_env(tmp_path))
    assert "train: 100%" in screen, screen[-2000:]  # the bar was there, and finished
    summary = screen.index("done: step 6")
    assert screen.rindex("train: ") < summary, screen[summary - 500 :]


@pytest.mark.parametrize(
    "ancestors, argv, printed",
    [
        # python train/main.py from a shell: the shell is no launcher
        ([["-bash"]], ["train/main.py", "--config", "x.yaml"], "python train/main.py"),
        # accelerate launch, its options kept, the script's own flags replaced
        (
            [
                [
                    "/usr/bin/python3",
                    "/usr/local/bin/accelerate",
                    "launch",
                    "--config_file",
                    "c.yaml",
                    "train/main.py",
                    "--config",
                    "x.yaml",
                ],
                ["-bash"],
            ],
            ["train/main.py", "--config", "x.yaml"],
            "accelerate launch --config_file c.yaml train/main.py",
        ),
        # scripts/launch.py above accelerate launch: the outer command is the one a person typed
        (
            [
                [
                    "/usr/bin/python3",
                    "/usr/local/bin/accelerate",
                    "launch",
                    "--config_file",
                    "c.yaml",
                    "train/main.py",
                ],
                [
                    "/usr/bin/python3",
                    "scripts/launch.py",
                    "--config_file",
                    "c.yaml",
                    "train/main.py",
                    "--lr",
                    "0.1",
                ],
                ["-bash"],
            ],
            ["train/main.py", "--lr", "0.1"],
            "python scripts/launch.py --config_file c.yaml train/main.py",
        ),
        # torchrun, and python -m torch.distributed.run
        (
            [
                [
                    "/usr/bin/python3",
                    "/usr/local/bin/torchrun",
                    "--nproc_per_node",
                    "2",
                    "train/torch_ddp.py",
                    "--fsdp",
                    "full",
                ]
            ],
            ["train/torch_ddp.py", "--fsdp", "full"],
            "torchrun --nproc_per_node 2 train/torch_ddp.py",
        ),
        (
            [["/usr/bin/python3", "-m", "torch.distributed.run", "--standalone", "train/main.py"]],
            ["train/main.py"],
            "python -m torch.distributed.run --standalone train/main.py",
        ),
        # a sweep driver whose trial command holds the script is no launcher of it
        (
            [
                ["/usr/bin/python3", "/usr/local/bin/accelerate", "launch", "train/main.py"],
                [
                    "/usr/bin/python3",
                    "scripts/sweep.py",
                    "--sweep_dir",
                    "s",
                    "--",
                    "accelerate",
                    "launch",
                    "train/main.py",
                ],
            ],
            ["train/main.py"],
            "accelerate launch train/main.py",
        ),
        # torch_ddp.py --spawn N: its processes are its own children, the count kept
        (
            [["/usr/bin/python3", "train/torch_ddp.py", "--spawn", "2", "--lr", "0.1"], ["-bash"]],
            ["train/torch_ddp.py", "--spawn", "2", "--lr", "0.1"],
            "python train/torch_ddp.py --spawn 2",
        ),
    ],
)
def test_a_printed_command_launches_the_run_again_the_way_it_was_launched(
    monkeypatch, ancestors, argv, printed
):
    """provenance.relaunch_command: the launcher and its options as a person types them, then the
    script with the flags the printed line gives (quoted for a shell)."""
    import provenance

    chain = {100 + n: command for n, command in enumerate(ancestors)}  # pid 100: the parent
    monkeypatch.setattr(provenance.os, "getpid", lambda: 99)
    monkeypatch.setattr(provenance, "parent_of", lambda pid: pid + 1 if pid + 1 in chain else None)
    monkeypatch.setattr(provenance, "process_command", chain.get)
    monkeypatch.setattr(provenance.sys, "argv", argv)
    flags = ("--output_dir", "runs/my run", "--resume", "latest")
    assert (
        provenance.relaunch_command(*flags)
        == f"{printed} --output_dir 'runs/my run' --resume latest"
    )


def test_the_parent_of_this_process_is_read_from_proc():
    import provenance

    assert provenance.parent_of(os.getpid()) == os.getppid()
    assert provenance.parent_of(2**22 + 12345) is None  # no such process


def test_a_resumed_runs_summary_gives_the_runs_best_evaluation_and_a_forks_final_eval(
    tmp_path, capsys
):
    """The summary after a resume: the best eval_loss over every start's rows (here the first
    start's, lower than any of this one's), this start's steps, and a final eval line for a task
    whose metrics hold no loss (a classifier's accuracy alone: no best line then)."""
    cfg = RunConfig(output_dir=str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    earlier = [
        {"step": 5, "loss": 2.0},
        {"step": 10, "eval_loss": 0.75, "eval_accuracy": 0.5},
        {"step": 20, "eval_loss": 1.5},  # past the checkpoint: dropped by the resume
    ]
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier))
    log = MetricsLogger(cfg, TorchDDP(cfg))
    log.start(log.cfg, 10, {})  # resumed from the checkpoint of step 10
    log.log(20, {"eval_loss": 1.25})
    log.finished(20, tmp_path / "run" / "model.safetensors")
    log.close()
    said = capsys.readouterr().out
    assert "done: step 20 (this start: steps 11-20 in 0 min " in said
    assert "final eval (step 20): eval_loss 1.25" in said
    assert "best eval_loss: 0.75 at step 10" in said
    # train on: twice the step reached, the cosine stretched to it
    assert "train on to step 40 (the LR schedule stretched to it): python " in said
    assert (
        said.split("train on to step 40")[1]
        .splitlines()[0]
        .endswith("--resume latest --max_steps 40 --lr_decay_steps 40")
    )

    accuracy_only = RunConfig(output_dir=str(tmp_path / "classifier"))
    log = MetricsLogger(accuracy_only, TorchDDP(accuracy_only))
    log.start(log.cfg, 0, {})
    log.log(4, {"eval_accuracy": 0.875})
    log.finished(4, tmp_path / "classifier" / "model.safetensors")
    log.close()
    said = capsys.readouterr().out
    assert "done: step 4 in 0 min " in said
    assert "final eval (step 4): eval_accuracy 0.875" in said
    assert "best eval_loss" not in said


def test_a_resume_reports_the_steps_trained_past_its_checkpoint_as_lost(tmp_path):
    """metrics.jsonl has rows up to step 7 (the run before trained to 7), and the resume starts from
    step 5's checkpoint: steps 6 and 7 are trained again, 2 steps lost. The start is the second
    (run_info.json holds one launch)."""
    cfg = RunConfig(output_dir=str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    rows = [{"step": step, "loss": 1.0 / step} for step in range(1, 8)]
    rows.insert(4, {"step": 4, "eval_loss": 0.5})
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run" / "run_info.json").write_text(json.dumps({"launches": [{"argv": []}]}))
    log = MetricsLogger(cfg, TorchDDP(cfg))
    log.start(log.cfg, 5, {})
    log.close()
    assert log.restart == {"step": 6, "start": 2, "resumed_from_step": 5, "steps_lost": 2}
