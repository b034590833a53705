"""Config: YAML + CLI precedence, and one clear line for every bad input."""

import re
import sys
import time

import pytest

from config import TrainConfig, config_class, load_config
from conftest import REPO, base_env, free_port, run, run_python
from errors import ConfigError
from job import load_checked_config

RunConfig = config_class()


def test_defaults_yaml_then_cli_precedence(tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("lr: 0.01\nbatch_size: 3\nmixed_precision: 'no'\ncompile: false\n")
    cfg = load_config(["--config", str(yaml_file), "--lr", "5e-4"])
    assert cfg.compile == "false"  # YAML's bool, for a key of choices
    cfg = load_config(["--config", str(yaml_file), "--lr", "5e-4", "--compile=true"])
    assert cfg.lr == 5e-4  # CLI beats YAML
    assert cfg.batch_size == 3  # YAML beats the default
    assert cfg.compile == "true"
    assert cfg.max_steps == RunConfig().max_steps  # untouched default


def test_default_warmup_adapts_to_short_runs():
    for steps in (1, 10, 20, 300):
        cfg = load_config(["--max_steps", str(steps)])
        assert cfg.warmup == steps // 10 and cfg.warmup < steps  # a 10-step smoke run is accepted
    assert load_config(["--max_steps", "20", "--warmup_steps", "5"]).warmup == 5


def test_shipped_presets_load():
    # offline stand-ins for what a preset reads from the hub (a streamed dataset is opened by validation, a tokenizer
    # loaded): every other key and value of every preset is checked as written
    offline = ["--dataset", "python_stdlib", "--dataset_config", "", "--tokenizer", "bytes"]
    for preset in sorted((REPO / "train" / "configs").glob("*.yaml")):
        assert isinstance(load_config(["--config", str(preset), *offline]), TrainConfig), preset


def test_a_staging_dir_must_be_a_local_folder():
    with pytest.raises(
        ConfigError, match=r"^staging_dir must be a local folder \(got .s3://b/x.\)"
    ):
        load_config(["--output_dir", "s3://bucket/run", "--staging_dir", "s3://b/x"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "-1"], "lr must be > 0 (got -1.0)"),
        (["--batch_size", "0"], "batch_size must be > 0 (got 0)"),
        (["--batch_size", "abc"], "batch_size must be an int (got 'abc')"),
        (["--lrr", "0.1"], "unknown key 'lrr' (did you mean 'lr'?)"),
        (
            ["--mixed_precision", "fp8"],
            "mixed_precision must be one of no, bf16, fp16 (or '' for the launcher's)",
        ),
        (["--dataset", "/nonexistent/corpus.jsonl"], "dataset is not an existing file or folder"),
        (["--dataset", "missing.csv"], "dataset is not an existing file or folder"),
        (
            ["--warmup_steps", "500", "--max_steps", "100"],
            "warmup_steps must be -1 (auto) or in [0, max_steps (100))",
        ),
        (
            ["--warmup_steps", "30", "--max_steps", "30"],
            "warmup_steps must be -1 (auto) or in [0, max_steps (30))",
        ),
        (["--init_from", "/no/such/model.safetensors"], "init_from is not an existing checkpoint"),
        (["--n_embd", "100", "--n_head", "3"], "n_embd must be divisible by n_head (3)"),
        (["--tracker", "mlflow"], "tracker entries must be among none, wandb, tensorboard"),
        (["--resume", "/no/such/checkpoint"], "resume must be '', 'latest' or an existing folder"),
        (["--dropout", "1.5"], "dropout must be in [0, 1)"),
        (["--compile", "maybe"], "compile must be one of auto, true, false (got 'maybe')"),
        (["--hf_model", "gpt2", "--bias", "true"], "bias applies to the built-in GPT only"),
        (
            ["--model", "gpt2"],
            "unknown key 'model' (renamed hf_model: a Hugging Face model's hub name",
        ),
        (["--sync_batchnorm", "true"], "sync_batchnorm needs CUDA GPUs (SyncBatchNorm reduces"),
        (["--lr"], "lr needs a value"),
        (
            ["--lr", "--max_steps", "20"],
            "lr needs a value (--lr VALUE; got the next flag --max_steps)",
        ),
        (["--lr_decay_steps", "-5"], "lr_decay_steps must be >= 0"),
        (
            ["--max_steps", "100", "--lr_decay_steps", "50", "--warmup_steps", "60"],
            "warmup_steps must be -1 (auto) or in [0, lr_decay_steps (50))",
        ),
        (["--dataset", "a/b/c"], "dataset is not an existing file or folder"),
        (["stray"], "unexpected argument 'stray'"),
        (["--optimizer", "sgd"], "optimizer must be one of adamw, muon (got 'sgd')"),
        (["--muon_lr", "0"], "muon_lr must be > 0 (got 0.0)"),
        (["--muon_momentum", "1"], "muon_momentum must be in [0, 1) (got 1.0)"),
        (["--optimizer", "muon", "--fsdp", "full"], "optimizer muon cannot run under FSDP"),
        (["--require_resume", "true"], "require_resume needs --resume latest (got resume '')"),
        (
            ["--resume", "latest", "--require_resume", "true", "--output_dir", "runs/no-such-run"],
            "output_dir 'runs/no-such-run' does not exist, and require_resume refuses to start a "
            "new run there (mistyped?)",
        ),
    ],
)
def test_bad_values_name_the_key(argv, message):
    with pytest.raises(ConfigError) as error:
        load_checked_config(argv)  # load_config's ranges, then what needs a file or the hub
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_bad_yaml_files(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("lr: 0.1\nbatch_size: [1, 2\n")
    with pytest.raises(ConfigError, match=r"broken.yaml:\d+: invalid YAML"):
        load_config(["--config", str(broken)])
    listing = tmp_path / "list.yaml"
    listing.write_text("- lr\n- 0.1\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(["--config", str(listing)])
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(["--config", str(tmp_path / "absent.yaml")])
    typo = tmp_path / "typo.yaml"
    typo.write_text("max_step: 10\n")
    with pytest.raises(
        ConfigError, match="unknown key 'max_step' \\(did you mean 'max_steps'\\?\\)"
    ):
        load_config(["--config", str(typo)])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "-1"], "error: lr must be > 0 (got -1.0)"),
        (["--config", "{broken}"], "error: config: "),
    ],
)
def test_entry_point_prints_one_line_exits_2_and_writes_nothing(tmp_path, argv, message):
    out = tmp_path / "existing_run"
    out.mkdir()
    (out / "keep.txt").write_text("previous run")
    if argv[0] == "--config":
        bad = tmp_path / "bad.yaml"
        bad.write_text("lr: [\n")
        argv = ["--config", str(bad)]
    result = run_python([*argv, "--output_dir", out], tmp_path, timeout=60)
    assert result.returncode == 2, result.tail()
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.output
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_an_error_seen_only_by_another_rank_is_still_printed(tmp_path):
    """Ranks other than 0 hold their error back (the launcher usually kills them once rank 0 has said
    it); one that is not killed, because the error is its own, must still say it."""
    result = run_python(
        ["--lr", "-1", "--output_dir", tmp_path / "run"],
        tmp_path,
        timeout=60,
        env_extra={"RANK": 1},
    )
    assert result.returncode == 2, result.tail()
    assert result.output.strip() == "error: lr must be > 0 (got -1.0)"


def test_help_lists_every_key_with_its_comment(tmp_path):
    result = run_python(["--help"], tmp_path, timeout=60).check()
    for key in ("--grad_accum_steps", "--mixed_precision", "--keep_last"):
        assert key in result.output
    assert "micro-steps per optimizer step" in result.output


def test_the_forks_own_keys_join_the_templates_in_yaml_flags_help_and_checks(tmp_path, monkeypatch):
    """A fork declares its knobs in its own files (model.py's ModelConfig, data.py's DataConfig):
    they load like the template's, `--help` lists them with their comments, an earlier name is
    refused in one line naming the new one, a clash with a template key is one line at start-up."""
    import dataclasses
    import types
    from typing import ClassVar

    import config
    import task

    @dataclasses.dataclass
    class ModelConfig:
        # width of the hidden layer
        hidden_width: int = 128
        RENAMED: ClassVar[dict] = {"n_embd": "hidden_width: the hidden layer's width"}

    @dataclasses.dataclass
    class DataConfig:
        # pixels a side
        image_size: int = 32

    fork_model = types.ModuleType("model")
    fork_model.ModelConfig = ModelConfig
    fork_data = types.ModuleType("data")
    fork_data.DataConfig = DataConfig
    monkeypatch.setattr(task, "fork_file", {"model": fork_model, "data": fork_data}.get)
    config.config_class.cache_clear()
    try:
        yaml_file = tmp_path / "run.yaml"
        yaml_file.write_text("hidden_width: 64\nlr: 0.01\n")
        cfg = load_config(["--config", str(yaml_file), "--image_size", "48"])
        assert (cfg.hidden_width, cfg.image_size, cfg.lr, cfg.max_steps) == (64, 48, 0.01, 300)
        assert isinstance(cfg, TrainConfig)
        with pytest.raises(ConfigError, match=r"^image_size must be an int \(got 'big'\)$"):
            load_config(["--image_size", "big"])
        with pytest.raises(
            ConfigError, match=r"^unknown key 'n_embd' \(renamed hidden_width: the hidden layer's"
        ):
            load_config(["--n_embd", "64"])
        help_text = config.usage()
        assert "train/model.py's ModelConfig:" in help_text
        assert re.search(
            r"--hidden_width\s+int\s+default 128\s+width of the hidden layer", help_text
        )
        assert re.search(r"--image_size\s+int\s+default 32\s+pixels a side", help_text)

        # a fork key that is the template's already
        @dataclasses.dataclass
        class Clashing:
            lr: float = 1.0

        fork_data.DataConfig = Clashing
        config.config_class.cache_clear()
        with pytest.raises(
            ConfigError, match=r"^train/data.py's Clashing: key 'lr' is already TrainConfig's"
        ):
            load_config([])
    finally:
        config.config_class.cache_clear()


def test_a_path_typo_that_looks_like_a_hub_name_fails_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpora").mkdir()
    with pytest.raises(
        ConfigError,
        match=r"dataset is not an existing file or folder \(there is a local folder "
        r"'corpora/': a typo in the path\?\)",
    ):
        load_checked_config(["--dataset", "corpora/my_text"])
    # still a hub name
    assert load_checked_config(["--dataset", "owner/name"]).dataset == "owner/name"


@pytest.mark.parametrize("script", ["train/main.py", "train/torch_ddp.py", "data/prepare.py"])
def test_help_names_the_script_and_shows_whole_comments(tmp_path, script):
    result = run_python(["--help"], tmp_path, script=REPO / script).check()
    assert result.output.startswith(f"usage: {script} [--config FILE.yaml]"), result.output[:200]
    line = next(
        line
        for line in result.output.splitlines()
        if line.strip().startswith("--shared_filesystem")
    )
    # the comment's 2nd line too
    assert line.rstrip().endswith("data prepared and checkpoints kept on every node")
    precision = next(
        line for line in result.output.splitlines() if line.strip().startswith("--mixed_precision")
    )
    assert "the launcher's" in precision and "wins over the launcher" in precision


def test_config_reads_no_data_or_hub(tmp_path):
    """config.py checks types and ranges only: loading a config imports neither datasets nor transformers (what
    needs them is checked by job.load_checked_config, still before any process group). It reads the fork's files
    for their own keys (model.py's ModelConfig, data.py's DataConfig), which import neither at module level."""
    probe = (
        "import sys; sys.path.insert(0, 'train'); from config import load_config; "
        "load_config(['--hf_model', 'someone/some-model', '--dataset', 'someone/some-data']); "
        "print(sorted(m for m in ('datasets', 'transformers') if m in sys.modules))"
    )
    result = run([sys.executable, "-c", probe], base_env(tmp_path), timeout=60)
    assert result.returncode == 0 and result.stdout.strip().splitlines()[-1] == "[]", result.stdout


def unreachable_hub_run(tmp_path, name: str):
    """train/main.py with a hub dataset, without HF_HUB_OFFLINE and without a network (the hub's address is
    a closed port on this machine); (its one error line, seconds taken)."""
    env = base_env(tmp_path, HF_ENDPOINT=f"http://127.0.0.1:{free_port()}", HF_HOME=tmp_path / "hf")
    for offline in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        env.pop(offline)
    command = [sys.executable, str(REPO / "train" / "main.py"), "--dataset", "someone/some-corpus"]
    started = time.time()
    result = run([*command, "--output_dir", tmp_path / name], env, timeout=120)
    took = time.time() - started
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stdout[-2000:]
    return errors[0], took


def test_a_hub_dataset_that_cannot_be_reached_fails_in_seconds(tmp_path):
    """One question of at most a few seconds, not the hub client's 25 s of retries: without a local copy,
    one line at once."""
    error, took = unreachable_hub_run(tmp_path, "run")
    assert "the hub cannot be reached" in error and "no local copy" in error
    assert took < 15, f"{took:.0f} s"


@pytest.mark.shipped  # the shipped data.py then reads the copy
def test_an_unreachable_hub_with_a_local_copy_goes_on_offline(tmp_path):
    (tmp_path / "hf" / "hub" / "datasets--someone--some-corpus").mkdir(
        parents=True
    )  # an empty copy
    error, took = unreachable_hub_run(tmp_path, "run")
    assert "could not be loaded from the hub (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set)" in error
    assert took < 15, f"{took:.0f} s"


@pytest.mark.parametrize(
    "environ, named",
    [
        ({"PET_NNODES": "2", "PET_NODE_RANK": "1"}, "PET_NNODES=2"),
        ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2"}, "SLURM_STEP_NUM_NODES=2"),
        ({"SKYPILOT_NUM_NODES": "4"}, "SKYPILOT_NUM_NODES=4"),
        ({"MASTER_ADDR": "10.0.0.1"}, "MASTER_ADDR=10.0.0.1 without WORLD_SIZE"),
        ({"PET_NNODES": "2", "WORLD_SIZE": "1"}, "PET_NNODES=2"),
    ],
)
def test_a_multi_node_environment_at_world_size_1_is_refused(environ, named):
    from checks import check_launch

    with pytest.raises(ConfigError, match=f"a multi-node environment \\({named}.*world size 1"):
        check_launch(environ)


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"PET_NNODES": "2", "WORLD_SIZE": "16", "MASTER_ADDR": "10.0.0.1"},  # torchrun started it
        {"PET_NNODES": "1", "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "1"},
        {"SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2"},  # the batch script, not a job step
        {"SLURM_STEP_ID": "3", "SLURM_STEP_NUM_NODES": "1", "SLURM_NNODES": "2"},  # a 1-node step
    ],
)
def test_a_launch_that_joins_the_nodes_or_one_node_goes_on(environ):
    from checks import check_launch

    check_launch(environ)


def test_a_pod_of_a_two_node_job_started_alone_stops_in_one_line(tmp_path):
    """As under Kubeflow Trainer with `accelerate launch` (which ignores PET_*): exit 2 before any
    process group, one line that names the variable and torchrun."""
    result = run_python(
        ["--output_dir", tmp_path / "run"],
        tmp_path,
        timeout=60,
        env_extra={"PET_NNODES": 2, "PET_NODE_RANK": 1},
    )
    assert result.returncode == 2, result.tail()
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: a multi-node environment (PET_NNODES=2)")
    assert "torchrun train/main.py" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_require_resume_refuses_a_run_folder_without_a_checkpoint_and_the_default_says_so(tmp_path):
    """--resume latest on a folder with no checkpoint (a mistyped --output_dir, a requeue that lost
    its folder) starts fresh, and says so in its line; with --require_resume it is refused, exit 2."""
    empty = tmp_path / "empty-run"
    empty.mkdir()
    args = ["--config", str(REPO / "train/configs/debug.yaml"), "--output_dir", empty]
    refused = run_python([*args, "--resume", "latest", "--require_resume", "true"], tmp_path)
    errors = [line for line in refused.output.splitlines() if line.startswith("error:")]
    assert refused.returncode == 2, refused.tail()
    assert errors == [
        f"error: resume: no intact checkpoint in {empty} to resume, and require_resume refuses "
        "to start fresh"
    ]
    started = run_python([*args, "--resume", "latest", "--max_steps", "2"], tmp_path).check()
    assert (
        f"resume: no intact checkpoint in {empty} yet, starting fresh (is the folder right? "
        "--require_resume true refuses instead)" in started.output
    )
