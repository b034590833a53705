"""--profile_steps end to end: a Chrome trace per rank holding exactly the window's steps, each with its
forward and backward, kept when the run stops inside the window; and the restart report each start
writes (profiling.py)."""

import json

import pytest

from conftest import FAULTY_MAIN, launch_accelerate, read_metrics, tiny_args

pytestmark = pytest.mark.slow

FORWARD_OP = "aten::embedding"  # the GPT's first operator
BACKWARD_OP = "EmbeddingBackward0"  # autograd's node for it


def spans_and_ops(trace_file) -> tuple[dict[int, tuple[float, float]], list[dict]]:
    """({step: (start, end) of its `train step N` span}, the trace's other events)."""
    events = json.loads(trace_file.read_text())["traceEvents"]
    spans, others = {}, []
    for event in events:
        name = event.get("name", "")
        if name.startswith("train step ") and event.get("ph") == "X":
            spans[int(name.split()[-1])] = (event["ts"], event["ts"] + event["dur"])
        elif event.get("ph") == "X":
            others.append(event)
    return spans, others


def ops_inside(ops: list[dict], span: tuple[float, float]) -> set[str]:
    return {op["name"] for op in ops if span[0] <= op["ts"] <= span[1]}


def test_a_profile_window_traces_its_steps_on_each_rank_and_a_stop_inside_it_keeps_them(
    tmp_path, corpus
):
    run_dir = tmp_path / "run"
    args = tiny_args(run_dir, corpus, max_steps=8, save_every=0, eval_every=8, profile_steps="3:5")
    # every rank is sent SIGTERM at step 4, inside the window: it checkpoints and stops
    stopped = launch_accelerate(
        args, tmp_path, script=FAULTY_MAIN, env_extra={"FAULT_STEP": 4, "FAULT_ACTION": "sigterm"}
    )
    # the workers' 75 (accelerate launch itself says 1: README "Exit codes")
    assert json.loads((run_dir / "preempted.json").read_text())["step"] == 4, stopped.tail()
    profile = run_dir / "profile"
    assert sorted(p.name for p in profile.iterdir()) == [
        "rank0.steps_3-4.pt.trace.json",
        "rank1.steps_3-4.pt.trace.json",
    ]
    for rank in (0, 1):
        spans, ops = spans_and_ops(profile / f"rank{rank}.steps_3-4.pt.trace.json")
        assert {3, 4} <= set(spans) and not set(spans) & {1, 2}, sorted(spans)
        for step in (3, 4):  # each step's span holds its forward and its backward
            inside = ops_inside(ops, spans[step])
            assert FORWARD_OP in inside and BACKWARD_OP in inside, (rank, step, sorted(inside)[:20])
    # the restart report: its phases add up to its time to the first step (the steps lost on a
    # resume: tests/e2e/test_tracking_runs.py; a start inside the window: tests/test_profiling.py)
    (row,) = [row for row in read_metrics(run_dir) if "start" in row]
    assert (row["start"], row["step"], row["resumed_from_step"], row["steps_lost"]) == (1, 1, 0, 0)
    phases = {key: value for key, value in row.items() if key.endswith("_s") and key != "start_s"}
    expected = {"start_imports_s", "start_process_group_s", "start_data_s", "start_first_step_s"}
    assert expected <= set(phases) and abs(sum(phases.values()) - row["start_s"]) < 0.05, row
    line = next(line for line in stopped.output.splitlines() if line.startswith("start 1: "))
    assert f"{row['start_s']:.1f} s to the first step (imports" in line, line
