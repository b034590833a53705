"""Weighted mixtures end to end, on 2 CPU processes: a run killed with SIGKILL resumes bitwise on the
map-style and the streamed paths (from a checkpoint taken mid-epoch of the small source), a map-style
mixture resumes on another world size, and each source's eval loss is exactly its eval set's, computed
here by hand from the exported model."""

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import (
    FAULTY_MAIN,
    TORCH_DDP,
    launch_accelerate,
    load_weights,
    run_python,
    tiny_args,
)

pytestmark = pytest.mark.slow

# global batch 2 x 4 x 2 = 16, half from each source: the small one's ~80 training blocks last 10 steps, so
# the step-12 checkpoint is early in its second epoch, while the big source's first epoch still goes on
MIXTURE = dict(
    max_steps=20,
    save_every=6,
    eval_every=10,
    grad_accum_steps=2,
    shuffle_buffer=64,
    eval_fraction=0.2,  # held-out documents of both sources, streamed too
    keep_last=5,
)


@pytest.fixture(scope="module")
def code_corpus(tmp_path_factory):
    """A second source, with its text in another column: 100 small documents of Python-ish lines (~100
    blocks of 32 bytes)."""
    path = tmp_path_factory.mktemp("code") / "code.jsonl"
    with open(path, "w") as f:
        for i in range(100):
            f.write(json.dumps({"body": f"def f{i}(x):\n    return x * {i}\n"}) + "\n")
    return path


def mixture_args(output_dir, corpus, code_corpus, streaming: bool) -> list[str]:
    sources = f"[{{path: {corpus}, weight: 0.5}}, {{path: {code_corpus}, weight: 0.5, text_column: body}}]"
    return tiny_args(output_dir, sources, **MIXTURE, streaming=streaming)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus, code_corpus):
    """The uninterrupted mixture run, map-style or streamed: launched once, read by every test."""
    runs = {}

    def run_of(streaming: bool):
        if streaming not in runs:
            folder = tmp_path_factory.mktemp("streamed" if streaming else "map_style")
            args = mixture_args(folder / "whole", corpus, code_corpus, streaming)
            runs[streaming] = launch_accelerate(args, folder).check()
        return runs[streaming]

    return run_of


def test_a_killed_streamed_mixture_resumes_bitwise(tmp_path, corpus, code_corpus, uninterrupted):
    """A mixture streamed: each source's stream position resumes with the mixture's. (A map-style
    mixture's position is the run's one number of samples, resumed on another world size below.)"""
    streaming = True
    whole = uninterrupted(streaming)
    evals = [row for row in whole.metrics() if "eval_loss" in row]
    assert [row["step"] for row in evals] == [10, 20]
    assert {"eval_loss/corpus", "eval_loss/code"} <= set(evals[-1])
    killed = launch_accelerate(
        mixture_args(tmp_path / "run", corpus, code_corpus, streaming),
        tmp_path,
        script=FAULTY_MAIN,
        env_extra={"FAULT_STEP": 15, "FAULT_RANK": 1, "FAULT_ACTION": "sigkill"},
    )
    assert killed.returncode != 0
    resumed = launch_accelerate(
        [*mixture_args(tmp_path / "run", corpus, code_corpus, streaming), "--resume", "latest"],
        tmp_path,
    ).check()
    assert "(step 12)" in resumed.output, resumed.tail()
    losses = {row["step"]: row["loss"] for row in resumed.metrics() if "loss" in row}
    assert losses == whole.losses()  # steps 1-12 from the first launch, 13-20 replayed: all equal
    after = [row for row in resumed.metrics() if "eval_loss" in row][-1]
    eval_keys = [key for key in evals[-1] if key.startswith("eval_")]
    assert all(after[key] == evals[-1][key] for key in eval_keys)  # each source's too
    expected, replayed = (
        load_weights(d / "model.safetensors") for d in (whole.output_dir, tmp_path / "run")
    )
    assert all(torch.equal(expected[k], replayed[k]) for k in expected)


def test_a_map_style_mixture_resumes_on_another_world_size_and_evaluates_each_source_exactly(
    tmp_path, corpus, code_corpus, uninterrupted
):
    """Saved by 2 processes x batch 4 x 2 micro-steps; resumed by 1 process x batch 8 x 2 on the torch path:
    the same samples in every step (the losses agree to float-summation tolerance). Then each source's logged
    eval loss and the overall one equal a per-sample computation from the exported model."""
    whole = uninterrupted(False)
    checkpoint = whole.output_dir / "checkpoints" / "step_00000012"
    one = run_python(
        [
            *mixture_args(tmp_path / "one", corpus, code_corpus, False),
            "--batch_size",
            8,
            "--resume",
            checkpoint,
        ],
        tmp_path,
        script=TORCH_DDP,
    ).check()
    assert "world_size 2 -> 1, batch_size 4 -> 8" in one.output
    for step, loss in one.losses().items():
        assert step > 12 and loss == pytest.approx(whole.losses()[step], rel=1e-5), step
    logged = [row for row in whole.metrics() if "eval_loss" in row][-1]
    by_hand = eval_by_hand(whole.output_dir)
    for name, (loss_sum, tokens) in by_hand.items():
        assert logged[f"eval_loss/{name}"] == pytest.approx(loss_sum / tokens, rel=1e-5), name
    overall = sum(s for s, _ in by_hand.values()) / sum(t for _, t in by_hand.values())
    assert logged["eval_loss"] == pytest.approx(overall, rel=1e-5)


def eval_by_hand(run_dir) -> dict:
    """{source: (summed next-token loss, tokens)} over each source's eval set, one sample at a time, with
    the exported weights: no eval loop, no sharding."""
    from checkpoint import load_weights_file
    from data import build_datasets
    from mixture import build_data
    from model import build_model
    from run_config import saved_config

    cfg = saved_config(run_dir / "config.yaml")
    _, eval_sets = build_data(cfg, build_datasets)
    model = build_model(cfg).eval()
    load_weights_file(model, run_dir / "model.safetensors")
    sums = {}
    with torch.no_grad():
        for name, eval_set in eval_sets.items():
            loss_sum, tokens = 0.0, 0
            for i in range(len(eval_set)):
                ids = torch.as_tensor(eval_set[i]["input_ids"]).long()[None]
                logits = model(ids).logits[0, :-1]
                loss_sum += F.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
                tokens += ids.size(1) - 1
            sums[name] = (loss_sum, tokens)
    assert set(sums) == {"corpus", "code"} and all(t for _, t in sums.values())
    return sums
