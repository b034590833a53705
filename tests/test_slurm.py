"""The SLURM scripts, run with fake srun/scontrol/accelerate/torchrun on PATH: the launcher command lines."""

import os
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

SLURM = REPO / "scripts" / "slurm"

SHIMS = {
    # scontrol: the job's hosts, and a record of requeues
    "scontrol": '[ "$1 $2" = "show hostnames" ] && printf "gpu-node-a\\ngpu-node-b\\n" && exit 0\n'
    'echo "scontrol $*" >> "$SHIM_LOG"',
    # srun: run the task once per node, as SLURM would, with that node's variables
    "srun": 'while [ "${1#--}" != "$1" ]; do shift; done\n'
    "for node in $(seq 0 $((SLURM_NNODES - 1))); do\n"
    '    SLURM_NODEID=$node SLURM_PROCID=$node "$@" || exit $?\n'
    "done",
    "accelerate": 'echo "accelerate $*" >> "$SHIM_LOG"',
    "torchrun": 'echo "torchrun $*" >> "$SHIM_LOG"',
}


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in SHIMS.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SHIM_LOG": str(tmp_path / "calls.log"),
        "SLURM_JOB_NODELIST": "gpu-node-[a-b]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "exp",
        "OUTPUT_DIR": str(tmp_path / "run"),
    }
    return env, tmp_path / "calls.log"


def run_script(name, env):
    result = subprocess.run(
        ["bash", str(SLURM / name)], cwd=REPO, env=env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    return result


@pytest.mark.parametrize(
    "name", ["accelerate_2node.sbatch", "torchrun_2node.sbatch", "accelerate_1node.sbatch"]
)
def test_scripts_parse(name):
    subprocess.run(["bash", "-n", str(SLURM / name)], check=True)
    text = (SLURM / name).read_text()
    nodes = 1 if "1node" in name else 2
    for directive in (f"--nodes={nodes}", "--gpus-per-node=8", "--signal=USR1@", "--requeue"):
        assert f"#SBATCH {directive}" in text
    for placeholder in ("##SBATCH --partition=", "##SBATCH --account="):  # one '#' away from active
        assert placeholder in text
    assert "source scripts/slurm/job_env.sh" in text


def test_the_gpu_count_follows_the_allocation_and_data_is_read_offline(fake_slurm):
    env, log = fake_slurm
    # sbatch --gpus-per-node=4
    run_script("accelerate_2node.sbatch", {**env, "SLURM_GPUS_ON_NODE": "4"})
    assert all(
        "--num_machines 2 --num_processes 8" in call for call in log.read_text().splitlines()
    )
    log.unlink()
    run_script("accelerate_1node.sbatch", {**env, "SLURM_NNODES": "1", "SLURM_GPUS_ON_NODE": "4"})
    [call] = log.read_text().splitlines()
    assert call.startswith(
        "accelerate launch --config_file accelerate_configs/8gpu.yaml --num_processes 4 "
    )
    assert call.endswith(f"--output_dir {env['OUTPUT_DIR']} --resume latest")
    job_env = (SLURM / "job_env.sh").read_text()
    assert "export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}" in job_env and "data/prepare.py" in job_env


def test_accelerate_script_starts_one_launcher_per_node(fake_slurm):
    env, log = fake_slurm
    run_script("accelerate_2node.sbatch", env)
    calls = log.read_text().splitlines()
    assert len(calls) == 2
    for node, call in enumerate(calls):
        assert call.startswith("accelerate launch --config_file accelerate_configs/2node.yaml")
        assert "--num_machines 2 --num_processes 16" in call
        assert (
            f"--machine_rank {node} --main_process_ip gpu-node-a --main_process_port 29500" in call
        )
        assert call.endswith(
            f"train/main.py --config train/configs/gpt2_small.yaml --output_dir {env['OUTPUT_DIR']} "
            "--resume latest"
        )


def test_torchrun_script_uses_c10d_rendezvous_on_the_first_node(fake_slurm):
    env, log = fake_slurm
    run_script("torchrun_2node.sbatch", env)
    calls = log.read_text().splitlines()
    assert [c.split("--node_rank ")[1].split()[0] for c in calls] == ["0", "1"]
    for call in calls:
        assert call.startswith("torchrun --nnodes 2 --nproc_per_node 8")
        assert "--rdzv_backend c10d --rdzv_endpoint gpu-node-a:29500 --rdzv_id 4242" in call
        assert "train/torch_ddp.py" in call and call.endswith("--resume latest")


def test_a_preempted_run_is_requeued(fake_slurm):
    env, log = fake_slurm
    Path(env["OUTPUT_DIR"]).mkdir()
    (Path(env["OUTPUT_DIR"]) / "preempted.json").write_text('{"step": 7}')
    run_script("accelerate_2node.sbatch", env)
    assert "scontrol requeue 4242" in log.read_text()


@pytest.mark.parametrize(
    "name", ["accelerate_2node.sbatch", "torchrun_2node.sbatch", "accelerate_1node.sbatch"]
)
def test_each_launcher_handles_the_signal_the_sbatch_directive_asks_slurm_for(fake_slurm, name):
    """`#SBATCH --signal=USR1@300` sends SIGUSR1 to the launcher; torch elastic's launchers pass on
    only the signals in PET_SIGNALS_TO_HANDLE (by default SIGTERM, SIGINT, SIGHUP, SIGQUIT: a SIGUSR1
    would kill the launcher). The signal is read from the directive, the list from each launcher's
    own environment."""
    env, log = fake_slurm
    signal_asked = "SIG" + (SLURM / name).read_text().split("#SBATCH --signal=")[1].split("@")[0]
    assert signal_asked == "SIGUSR1"
    env = {**env, "SLURM_NNODES": "1" if "1node" in name else "2"}
    for launcher in ("accelerate", "torchrun"):  # each records what it was told to handle
        shim = log.parent / "bin" / launcher
        shim.write_text(f'#!/bin/bash\necho "{launcher} $PET_SIGNALS_TO_HANDLE" >> "$SHIM_LOG"\n')
    run_script(name, env)
    calls = log.read_text().splitlines()
    assert len(calls) == int(env["SLURM_NNODES"])
    for call in calls:
        assert signal_asked in call.split()[1].split(","), call
