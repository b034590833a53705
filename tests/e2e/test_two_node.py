"""Two "nodes" on one machine: two launchers with machine ranks 0 and 1 on 127.0.0.1, 2 CPU processes each.

Compared with one launcher of 4 processes: bitwise the same losses and weights, one metrics.jsonl,
one set of checkpoints. Also: a node that dies mid-run, and a launch whose world size does not add up.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import (
    LAUNCHER_FILE,
    MAIN,
    REPO,
    TORCH_DDP,
    base_env,
    free_port,
    launch_accelerate,
    load_weights,
    read_metrics,
    tiny_args,
)

pytestmark = pytest.mark.slow

TWO_NODE = REPO / "accelerate_configs" / "2node.yaml"
STEPS = dict(max_steps=8, save_every=4, eval_every=8, dist_timeout_s=30)


def two_node_args(output_dir, corpus, **overrides):
    return [str(a) for a in tiny_args(output_dir, corpus, **{**STEPS, **overrides})]


def accelerate_node(rank, port, args):
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(TWO_NODE),
        "--num_processes",
        "4",
        "--num_machines",
        "2",
        "--machine_rank",
        str(rank),
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
        "--mixed_precision",
        "no",
        str(MAIN),
        *args,
    ]


def torchrun_node(rank, port, args):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "2",
        "--node_rank",
        str(rank),
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"127.0.0.1:{port}",
        "--rdzv_id",
        "two-node-test",
        str(TORCH_DDP),
        *args,
    ]


def start(cmd, tmp_path):
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=base_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(procs, timeout=240):
    deadline, outputs = time.time() + timeout, []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for p in procs:
                # PYTHONFAULTHANDLER: every process prints where it hangs
                os.killpg(p.pid, signal.SIGABRT)
            time.sleep(5)
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            tails = ["\n".join((p.communicate()[0] or "").splitlines()[-40:]) for p in procs]
            pytest.fail(
                "a node did not finish in time\n"
                + "\n".join(f"--- node {rank}:\n{tail}" for rank, tail in enumerate(tails))
            )
        outputs.append(out)
    return outputs


def kill_node(launcher):
    """SIGKILL a launcher and its workers at once, as a node failure would. (torchrun starts each worker
    in its own session: killing the launcher's process group alone leaves them training as orphans.)"""
    workers = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(launcher.pid)], capture_output=True, text=True
    )
    for pid in [launcher.pid, *map(int, workers.stdout.split())]:
        os.kill(pid, signal.SIGKILL)


def run_two_nodes(make_cmd, args, tmp_path):
    port = free_port()
    outputs = finish([start(make_cmd(rank, port, args), tmp_path) for rank in (0, 1)])
    return outputs


def assert_same_run(output_dir, reference, resumed=False):
    """Bitwise: the same 4 ranks, the same split of every global batch, the same reductions. After a resume on
    more than 2 processes, to the last bits only: DDP all-reduces the first step of every start in one bucket
    in parameter order and later steps in buckets rebuilt in backward order, and with 3 or more addends a
    different chunking sums in another order (2 addends commute: 2-process resumes are bitwise)."""
    losses = {r["step"]: r["loss"] for r in read_metrics(output_dir) if "loss" in r}
    assert sorted(losses) == list(range(1, 9))
    if resumed:
        assert losses == pytest.approx(reference.losses(), rel=1e-6, abs=0)
        return
    assert losses == reference.losses()
    weights, expected = (
        load_weights(output_dir / "model.safetensors"),
        load_weights(reference.output_dir / "model.safetensors"),
    )
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


def test_two_torchrun_nodes_with_c10d_rendezvous(tmp_path, corpus, four_processes):
    out = tmp_path / "run"
    outputs = run_two_nodes(torchrun_node, two_node_args(out, corpus), tmp_path)
    for rank, text in enumerate(outputs):
        assert "Traceback" not in text, f"node {rank}:\n{text[-3000:]}"
    assert_same_run(out, four_processes)  # the torch path on 2 nodes matches Accelerate on 1


def kill_a_node_after_step_4(out, args, tmp_path, dead: int) -> str:
    """Both nodes train; once step 4's checkpoint is published, node `dead`'s launcher and workers
    are SIGKILLed. The live node must stop with an error well inside dist_timeout_s + start-up (not
    a hang): its output."""
    port = free_port()
    nodes = [start(accelerate_node(rank, port, args), tmp_path) for rank in (0, 1)]
    deadline = time.time() + 180
    while (
        time.time() < deadline
        and not (out / "checkpoints" / "step_00000004" / "manifest.json").exists()
    ):
        time.sleep(0.1)
    kill_node(nodes[dead])
    killed = time.time()
    live = nodes[1 - dead]
    said = finish([live], timeout=90)[0]
    assert live.returncode != 0
    assert time.time() - killed < 60, said[-3000:]
    nodes[dead].communicate()
    return said


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


def worker_tracebacks(output: str) -> list[str]:
    """Tracebacks other than the launcher's own (its summary of a failed worker)."""
    lines = output.splitlines()
    return [
        line
        for i, line in enumerate(lines)
        if "Traceback" in line
        and not any(LAUNCHER_FILE.search(below) for below in lines[i + 1 : i + 4])
    ]


def test_a_dead_node_stops_the_other_in_bounded_time_and_both_resume(
    tmp_path, corpus, four_processes
):
    """Node 1 dies: the live node says exactly one line, naming ranks 2 and 3 lost (not timed
    out, and no live rank named). Both nodes resume from the last checkpoint."""
    out = tmp_path / "run"
    args = two_node_args(out, corpus)
    said = kill_a_node_after_step_4(out, args, tmp_path, dead=1)
    lines = error_lines(said)
    assert len(lines) == 1, said[-3000:]
    assert "rank(s) 2, 3 lost (gone without a word: killed, or their node down)" in lines[0]
    assert "timed out" not in lines[0] and "did not arrive" not in lines[0]
    assert not worker_tracebacks(said), said[-3000:]
    outputs = run_two_nodes(accelerate_node, [*args, "--resume", "latest"], tmp_path)
    assert "resume: " in outputs[0], outputs[0][-3000:]
    for rank, text in enumerate(outputs):
        assert "Traceback" not in text, f"node {rank}:\n{text[-3000:]}"
    # two accelerate launchers, one world of 4 (the torch path's launchers: bitwise the 4-process
    # launch's, test_two_torchrun_nodes_...)
    assert '"processes": 4' in (out / "run_info.json").read_text()
    latest = out / "checkpoints" / "step_00000008"
    assert sorted(p.name for p in latest.glob("rng_rank*.pt")) == [
        f"rng_rank{r}.pt" for r in range(4)
    ]
    assert_same_run(out, four_processes, resumed=True)


def test_when_the_main_node_dies_the_other_says_one_line_naming_the_store_s_node_gone(
    tmp_path, corpus
):
    """Node 0 dies, and the job's store (its launcher holds it) with it: node 1 says one line, from
    its local rank 0, that names the main node gone; no worker traceback."""
    out = tmp_path / "run"
    said = kill_a_node_after_step_4(out, two_node_args(out, corpus), tmp_path, dead=0)
    lines = error_lines(said)
    assert len(lines) == 1, said[-3000:]
    assert "the main node is gone (killed, or down)" in lines[0], lines[0]
    assert not worker_tracebacks(said), said[-3000:]


def test_a_world_that_does_not_add_up_stops_at_once(tmp_path, corpus):
    """The measured pitfall: an Accelerator built without cpu=True on a machine without a GPU leaves
    every launched process believing it is rank 0 of 1. The start-up guard must stop them all."""
    wrapper = tmp_path / "no_cpu_flag.py"
    wrapper.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO / 'train')!r})\n"
        "import accelerate, main\n"
        "Original = accelerate.Accelerator\n"
        "accelerate.Accelerator = lambda **kw: Original(**{**kw, 'cpu': False})\n"
        "main.main()\n"
    )
    out = tmp_path / "run"
    result = launch_accelerate(two_node_args(out, corpus), tmp_path, script=wrapper)
    assert result.returncode != 0
    assert "the launcher started 2 processes but this one sees a world of 1" in result.output, (
        result.tail()
    )
    assert not (out / "metrics.jsonl").exists()


def test_node_local_disks_keep_a_checkpoint_copy_per_node_and_resume(
    tmp_path, corpus, four_processes
):
    """--shared_filesystem false: each node's local main process commits a full copy on its own disk
    (here: a separate folder per node), holding its own ranks' RNG files; both resume from them."""
    port = free_port()
    disks = [tmp_path / "node0", tmp_path / "node1"]
    args = [two_node_args(disk, corpus, shared_filesystem="false") for disk in disks]
    finish([start(accelerate_node(rank, port, args[rank]), tmp_path) for rank in (0, 1)])
    for rank, disk in enumerate(disks):
        latest = disk / "checkpoints" / "step_00000008"
        mine = [f"rng_rank{r}.pt" for r in (2 * rank, 2 * rank + 1)]
        assert sorted(p.name for p in latest.glob("rng_rank*.pt")) == mine
        assert (latest / "model.safetensors").exists() and (latest / "manifest.json").exists()
    assert_same_run(disks[0], four_processes)  # metrics.jsonl: written on node 0
    assert not (disks[1] / "metrics.jsonl").exists()
    port = free_port()
    outputs = finish(
        [
            start(accelerate_node(rank, port, [*args[rank], "--resume", "latest"]), tmp_path)
            for rank in (0, 1)
        ]
    )
    assert "resume: " in outputs[0] and "(step 8)" in outputs[0], outputs[0][-3000:]
