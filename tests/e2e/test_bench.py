"""The benchmark script runs end to end in its quick mode (four variants, the streamed corpus included, interleaved
in each of 2 processes launched as the default CPU job is) and reports every figure (not their values)."""

import json
import sys

import pytest

from conftest import REPO, base_env, model_declares_blocks, run

pytestmark = pytest.mark.slow


def test_quick_benchmark_reports_ratios_throughput_and_loader_wait(tmp_path, corpus):
    # the small test corpus: the final evaluation of each variant stays short
    out = tmp_path / "bench.json"
    result = run(
        [
            sys.executable,
            str(REPO / "bench/throughput.py"),
            "--quick",
            "--streaming",
            "--processes",
            "2",
            "--out",
            str(out),
            "--dataset",
            str(corpus),
            "--block_size",
            "32",
        ],
        base_env(tmp_path),
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    summary = json.loads(out.read_text())
    for variant in ("bare", "accelerate", "torch", "streaming"):
        figures = summary[variant]
        assert figures["step_time_s"] > 0 and figures["tokens_per_s"] > 0
        assert 0 <= figures["loader_wait_frac"] < 1
        assert figures["final_loss"] > 0
    # each ratio: the median of per-round ratios, and its spread
    for ratio in ("accelerate_over_bare", "torch_over_accelerate", "streaming_over_accelerate"):
        assert 0 < summary[ratio]["low"] <= summary[ratio]["median"] <= summary[ratio]["high"]
    assert summary["rounds"] == 2  # --quick: 3 rounds, the first one warm-up
    assert "accelerate / bare:" in result.stdout and "loader wait" in result.stdout
    # rank 0 reports
    assert "x 2 processes" in result.stdout and result.stdout.count("device:") == 1


@pytest.mark.skipif(
    not model_declares_blocks(), reason="Muon takes the weight matrices of the blocks"
)
def test_the_optimizer_bench_reports_eval_losses_and_step_times(tmp_path, corpus):
    out = tmp_path / "optimizers.json"
    train_flags = ["--dataset", str(corpus), "--block_size", "32", "--max_steps", "6"]
    train_flags += ["--eval_every", "3", "--log_every", "2", "--batch_size", "4"]
    command = [sys.executable, str(REPO / "bench/optimizers.py"), "--out", str(out), "--"]
    result = run([*command, *train_flags], base_env(tmp_path), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    figures = json.loads(out.read_text())
    assert set(figures) == {"adamw", "muon (muon_lr 0.02)"}
    for name, result_of_one in figures.items():
        assert list(result_of_one["eval_loss"]) == ["3", "6"], name  # JSON keys
        assert result_of_one["step_time_s"] > 0
    assert "| muon (muon_lr 0.02) |" in result.stdout
