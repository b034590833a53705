"""Config: YAML + CLI precedence, and one clear line for every bad input."""

import re
import sys
import time

import pytest

from config import ADAPTERS_ONLY, TrainConfig
from conftest import REPO, base_env, free_port, run, run_python
from errors import ConfigError
from job import load_checked_config
from run_config import config_class, load_config

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
    # the line names the file the key came from
    with pytest.raises(ConfigError) as refused:
        load_config(["--config", str(typo)])
    assert str(refused.value) == f"unknown key 'max_step' in {typo} (did you mean 'max_steps'?)"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "-1"], "error: lr must be > 0 (got -1.0)"),
        (["--config", "{broken}"], "error: config: "),
        (["--lora_r", "0", "--lora_alpha", "32"], "error: lora_alpha needs lora_r > 0 (lora_r 0 "),
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

    import run_config
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
    run_config.config_class.cache_clear()
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
        help_text = run_config.usage()
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
        run_config.config_class.cache_clear()
        with pytest.raises(
            ConfigError, match=r"^train/data.py's Clashing: key 'lr' is already TrainConfig's"
        ):
            load_config([])
    finally:
        run_config.config_class.cache_clear()


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
    """Loading a config (run_config.py; config.py's checks of types and ranges) imports neither datasets nor
    transformers (what needs them is checked by job.load_checked_config, still before any process group). It
    reads the fork's files for their own keys (model.py's ModelConfig, data.py's DataConfig), which import
    neither at module level."""
    probe = (
        "import sys; sys.path.insert(0, 'train'); from run_config import load_config; "
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


# ------------------------------------------------------------- every check, its whole line and its edge
# Written out by hand, not read from config.py's tables: each refused value with the whole line a person
# reads, and the value just inside the edge, accepted.

REFUSED = [
    # every key that must be > 0, at 0
    *[
        ([f"--{key}", "0"], f"{key} must be > 0 (got {shown})")
        for key, shown in [
            ("max_steps", "0"),
            ("batch_size", "0"),
            ("grad_accum_steps", "0"),
            ("log_every", "0"),
            ("eval_every", "0"),
            ("keep_last", "0"),
            ("dist_timeout_s", "0"),
            ("step_timeout_s", "0"),
            ("bucket_cap_mb", "0"),
            ("shuffle_buffer", "0"),
            ("streaming_eval_blocks", "0"),
            ("store_lease_s", "0"),
            ("lr", "0.0"),
            ("muon_lr", "0.0"),
        ]
    ],
    # every key that must be >= 0, at -1
    *[
        ([f"--{key}", "-1"], f"{key} must be >= 0 (got {shown})")
        for key, shown in [
            ("weight_decay", "-1.0"),
            ("max_grad_norm", "-1.0"),
            ("save_every", "-1"),
            ("num_workers", "-1"),
            ("min_lr", "-1.0"),
            ("lr_decay_steps", "-1"),
            ("muon_weight_decay", "-1.0"),
            ("eval_limit", "-1"),
            ("upload_timeout_s", "-1"),
            ("lora_r", "-1"),
        ]
    ],
    (["--eval_fraction", "0"], "eval_fraction must be in (0, 1) (got 0.0)"),
    (["--eval_fraction", "1"], "eval_fraction must be in (0, 1) (got 1.0)"),
    (["--beta1", "1"], "beta1 must be in [0, 1) (got 1.0)"),
    (["--beta2", "-0.1"], "beta2 must be in [0, 1) (got -0.1)"),
    (["--muon_momentum", "1"], "muon_momentum must be in [0, 1) (got 1.0)"),
    (["--lora_dropout", "1"], "lora_dropout must be in [0, 1) (got 1.0)"),
    (["--fsdp", "zero3"], "fsdp must be one of no, full, hybrid (got 'zero3')"),
    (
        ["--model_weights", "random"],
        "model_weights must be one of pretrained, config (got 'random')",
    ),
    (
        ["--tracker", "wandb,mlflow"],
        "tracker entries must be among none, wandb, tensorboard (got 'wandb,mlflow')",
    ),
    (["--min_lr", "0.01", "--lr", "0.001"], "min_lr must be <= lr (0.001) (got 0.01)"),
    (
        ["--warmup_steps", "-2"],
        "warmup_steps must be -1 (auto) or in [0, max_steps (300)) (got -2)",
    ),
    (
        ["--fsdp", "full", "--shared_filesystem", "false"],
        "fsdp needs shared_filesystem true (every process writes its shards into one checkpoint folder) "
        "(got 'full')",
    ),
    (
        ["--streaming", "true", "--num_workers", "2"],
        "num_workers must be 0 with streaming (the stream is read in the training process, where its "
        "position is saved) (got 2)",
    ),
    (["--dataset_split", ""], "dataset_split must not be empty (got '')"),
    (
        ["--optimizer", "muon", "--fsdp", "hybrid"],
        "optimizer muon cannot run under FSDP: Muon orthogonalizes each whole weight matrix, and FSDP2 "
        "gives each process a shard of it (train with DDP, or with optimizer adamw)",
    ),
    (["--lora_r", "8", "--lora_alpha", "-1"], "lora_alpha must be > 0 (0: not given) (got -1.0)"),
    # given without adapters: a full fine-tune that ignores them, refused; 16 too, the scale that
    # lora_alpha's "not given" (0) stands for
    (["--lora_alpha", "16"], f"lora_alpha {ADAPTERS_ONLY} (got 16.0)"),
    (["--lora_r", "0", "--lora_alpha", "32"], f"lora_alpha {ADAPTERS_ONLY} (got 32.0)"),
    (["--lora_targets", "q_proj"], f"lora_targets {ADAPTERS_ONLY} (got 'q_proj')"),
    (["--lora_dropout", "0.1"], f"lora_dropout {ADAPTERS_ONLY} (got 0.1)"),
    (["--merge_adapter", "true"], f"merge_adapter {ADAPTERS_ONLY} (got True)"),
    (["--straggler_factor", "1"], "straggler_factor must be > 1 (got 1.0)"),
]


@pytest.mark.parametrize("argv, line", REFUSED, ids=[" ".join(argv) for argv, _ in REFUSED])
def test_every_check_refuses_with_its_whole_line(argv, line):
    with pytest.raises(ConfigError) as error:
        load_config(argv)
    assert str(error.value) == line


@pytest.mark.shipped  # the shipped data.py's own keys, checked by its check_config
@pytest.mark.parametrize(
    "argv, line",
    [
        (["--block_size", "0"], "block_size must be > 0 (got 0)"),
        (["--text_column", ""], "text_column must not be empty (got '')"),
    ],
)
def test_the_shipped_data_keys_are_checked_in_data_py(argv, line):
    import data

    data.check_config(load_config(["--block_size", "1"]))  # the edge, accepted
    with pytest.raises(ConfigError) as error:
        data.check_config(load_config(argv))
    assert str(error.value) == line
    with pytest.raises(ConfigError) as error:  # through the start-up checks, as a run meets it
        load_checked_config(argv)
    assert str(error.value) == line


@pytest.mark.parametrize(
    "argv",
    [
        ["--min_lr", "0.001", "--lr", "0.001"],  # min_lr may equal lr
        ["--warmup_steps", "-1"],
        ["--warmup_steps", "0"],
        ["--warmup_steps", "299"],
        ["--eval_fraction", "0.999"],
        ["--beta1", "0", "--beta2", "0.9999", "--muon_momentum", "0", "--lora_dropout", "0"],
        ["--fsdp", "full"],  # shared_filesystem is true by default
        ["--lora_r", "0", "--lora_alpha", "0"],  # 0: not given
        ["--lora_r", "8", "--lora_alpha", "0"],  # not given: 16
        ["--lora_r", "1", "--merge_adapter", "true"],
        ["--straggler_factor", "1.01"],
        ["--tracker", "none"],
        ["--tracker", "wandb,tensorboard"],
        ["--streaming", "true", "--num_workers", "0"],
        ["--shared_filesystem", "false"],  # without FSDP, each node may keep its own folder
        ["--optimizer", "muon"],  # under DDP
        ["--lora_r", "4", "--lora_alpha", "0.5"],
        ["--weight_decay", "0", "--save_every", "0", "--upload_timeout_s", "0", "--min_lr", "0"],
    ],
)
def test_the_value_at_each_edge_is_accepted(argv):
    load_config(argv)


def test_ddp_options_are_the_keys_set_away_from_ddps_defaults():
    assert load_config([]).ddp_options() == {}
    argv = ["--static_graph", "true", "--bucket_cap_mb", "50", "--broadcast_buffers", "false"]
    assert load_config(argv).ddp_options() == {
        "static_graph": True,
        "bucket_cap_mb": 50,
        "broadcast_buffers": False,
    }
    argv = ["--find_unused_parameters", "true", "--gradient_as_bucket_view", "true"]
    assert load_config(argv).ddp_options() == {
        "find_unused_parameters": True,
        "gradient_as_bucket_view": True,
    }


def test_trackers_global_batch_and_the_warmup_horizon():
    assert load_config(["--tracker", "wandb,none,tensorboard"]).trackers() == [
        "wandb",
        "tensorboard",
    ]
    assert load_config(["--tracker", "none"]).trackers() == []
    assert load_config(["--batch_size", "3", "--grad_accum_steps", "2"]).global_batch(4) == 24
    cfg = load_config(["--max_steps", "100", "--lr_decay_steps", "50"])
    assert (cfg.decay_steps, cfg.warmup) == (50, 5)


@pytest.mark.parametrize(
    "raw, type_name, value",
    [
        ("yes", "bool", True),
        ("Off", "bool", False),
        (True, "bool", True),
        (False, "bool", False),
        ("-3", "int", -3),
        (7, "int", 7),
        ("1.5", "float", 1.5),
        (2, "float", 2.0),
        ("1.5", "str", "1.5"),
        ("MixedCase", "str", "MixedCase"),
        (True, "str", "true"),  # YAML's true, for a key of choices like compile
        (None, "str", ""),
        (3, "str", "3"),
    ],
)
def test_coerce_turns_yaml_and_flag_values_into_the_keys_type(raw, type_name, value):
    from run_config import coerce

    coerced = coerce("key", raw, type_name)
    assert coerced == value and type(coerced) is type(value)


@pytest.mark.parametrize(
    "raw, type_name, line",
    [
        ("maybe", "bool", "key must be a bool (got 'maybe')"),
        (1.5, "int", "key must be an int (got 1.5)"),
        (True, "int", "key must be an int (got True)"),
        ("x", "float", "key must be a float (got 'x')"),
        (True, "float", "key must be a float (got True)"),
        ([1, 2], "str", "key must be a str (got [1, 2])"),
    ],
)
def test_coerce_refuses_with_one_line(raw, type_name, line):
    from run_config import coerce

    with pytest.raises(ConfigError) as error:
        coerce("key", raw, type_name)
    assert str(error.value) == line


def test_the_dataset_key_is_parsed_into_its_sources():
    from run_config import coerce
    from sources import Source

    assert coerce("dataset", "a.jsonl:1,b.jsonl:3", "str") == (
        Source("a.jsonl", 1.0, "a"),
        Source("b.jsonl", 3.0, "b"),
    )


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--lr"], "lr needs a value (--lr VALUE)"),
        (
            ["--lr", "--max_steps", "3"],
            "lr needs a value (--lr VALUE; got the next flag --max_steps)",
        ),
        (["--lr", "--max_steps"], "lr needs a value (--lr VALUE; got the next flag --max_steps)"),
        (["--zzqqxx", "1"], "unknown key 'zzqqxx'"),  # nothing close: no "did you mean"
        (["--max_step", "1"], "unknown key 'max_step' (did you mean 'max_steps'?)"),
    ],
)
def test_flag_errors_are_their_whole_line(argv, line):
    with pytest.raises(ConfigError) as error:
        load_config(argv)
    assert str(error.value) == line


def test_the_arguments_default_to_the_command_line_and_help_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train/main.py", "--lr", "0.5", "--min_lr", "0"])
    assert load_config().lr == 0.5
    for flag in ("-h", "--help"):
        with pytest.raises(SystemExit) as stop:
            load_config([flag])
        assert stop.value.code == 0
        assert capsys.readouterr().out.startswith("usage: train/main.py [--config FILE.yaml]")


def test_bad_yaml_files_are_their_whole_line(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("lr: 0.1\nbatch_size: [1, 2\n")
    with pytest.raises(ConfigError) as error:
        load_config(["--config", str(broken)])
    assert (
        str(error.value)
        == f"config: {broken}:3: invalid YAML: expected ',' or ']', but got '<stream end>'"
    )
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"lr: 0.1\x00\n")
    with pytest.raises(ConfigError) as error:
        load_config(["--config", str(binary)])
    assert str(error.value).startswith(
        f"config: {binary}: invalid YAML: unacceptable character #x0000"
    )
    listing = tmp_path / "list.yaml"
    listing.write_text("- lr\n- 0.1\n")
    with pytest.raises(ConfigError) as error:
        load_config(["--config", str(listing)])
    assert str(error.value) == f"config: {listing} must hold a mapping of key: value, not list"
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing set yet\n")
    assert load_config(["--config", str(empty)]) == load_config([])


def test_a_run_s_config_yaml_reloads_with_the_lora_keys_it_did_not_give(tmp_path):
    """config.yaml holds every key, the LoRA keys of a run without adapters too: as not given."""
    import dataclasses

    import yaml

    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(dataclasses.asdict(load_config(["--batch_size", "4"]))))
    reloaded = load_config(["--config", str(saved)])
    assert (reloaded.batch_size, reloaded.lora_r, reloaded.lora_alpha) == (4, 0, 0.0)


def test_saved_config_reads_what_a_run_wrote_and_leaves_out_unknown_keys(tmp_path):
    from run_config import saved_config
    from sources import Source

    saved = tmp_path / "config.yaml"
    saved.write_text("lr: 0.01\ndataset: a.jsonl:1,b.jsonl:3\na_key_of_a_later_version: 5\n")
    cfg = saved_config(saved)
    assert cfg.lr == 0.01 and cfg.max_steps == 300
    assert cfg.dataset == (Source("a.jsonl", 1.0, "a"), Source("b.jsonl", 3.0, "b"))
    assert not hasattr(cfg, "a_key_of_a_later_version")
    saved.write_text("dataset: owner/name\n")
    assert saved_config(saved).dataset == "owner/name"


def test_usage_names_the_script_and_shows_each_keys_line(monkeypatch):
    """The program's name as the user ran it (relative), or train/main.py when run otherwise; each key's
    line: name, type, default, its whole comment (lines joined by one space); a fork's keys under their
    file's heading after a blank line, a key without a comment shown without one."""
    import dataclasses

    import run_config

    monkeypatch.setattr(sys, "argv", [str(REPO / "scripts" / "x.py")])
    monkeypatch.chdir(REPO)
    lines = run_config.usage().split("\n")
    assert lines[0] == "usage: scripts/x.py [--config FILE.yaml] [--key value ...]"
    assert lines[1] == ""
    monkeypatch.setattr(sys, "argv", ["/usr/bin/accelerate"])
    assert run_config.usage().startswith("usage: train/main.py [--config FILE.yaml]")
    timeout = next(line for line in lines if line.startswith("  --upload_timeout_s"))
    assert timeout.split(maxsplit=4)[1:] == [
        "int",
        "default",
        "0",
        "a run on object storage: the deadline of each checkpoint's upload, and of any other exchange "
        "with the store; past it the run says so in one line and exits 1. 0 = derived: 120 s, plus 1 s "
        "per 20 MB of the files (a store slower than that is not answering) (train/storage.py)",
    ]

    @dataclasses.dataclass
    class ModelConfig:
        width: int = 8

    monkeypatch.setattr(run_config, "fork_settings", lambda: {"model": ModelConfig})
    lines = run_config.usage().split("\n")
    heading = lines.index("  train/model.py's ModelConfig:")
    assert (
        lines[heading - 1] == ""
        and lines[heading + 1].rstrip() == "  --width             int   default 8"
    )


def test_a_type_without_a_name_is_shown_as_written():
    import dataclasses

    from run_config import type_name_of

    @dataclasses.dataclass
    class Declared:
        plain: int = 1
        optional: int | None = None  # a type object without __name__

    plain, optional = dataclasses.fields(Declared)
    assert type_name_of(plain) == "int"
    assert type_name_of(optional) == "int | None"


def test_a_resume_starts_from_the_runs_own_config_then_the_file_then_the_flags(
    tmp_path, monkeypatch
):
    """`--output_dir RUN --resume latest`, the command a run prints, continues RUN as it was
    configured: its config.yaml is below --config and the flags, and without --output_dir the newest
    runs/run_NNN's is read (the run --resume latest takes)."""
    import yaml

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    saved = {"batch_size": 32, "lr": 0.002, "max_steps": 50, "resume": "", "init_from": "gone"}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    resumed = load_config(["--output_dir", str(run_dir), "--resume", "latest"])
    assert (resumed.batch_size, resumed.lr, resumed.max_steps) == (32, 0.002, 50)
    # how this start resumes is its own command's: never the saved resume or init_from
    assert (resumed.resume, resumed.init_from) == ("latest", "")
    preset = tmp_path / "preset.yaml"
    preset.write_text("lr: 0.005\n")
    argv = ["--output_dir", str(run_dir), "--resume", "latest", "--config", str(preset)]
    layered = load_config([*argv, "--max_steps", "80"])
    assert (layered.batch_size, layered.lr, layered.max_steps) == (32, 0.005, 80)
    # an earlier version's full run saved lora_alpha's default: its resume is no LoRA key given
    (run_dir / "config.yaml").write_text(yaml.safe_dump({**saved, "lora_r": 0, "lora_alpha": 16.0}))
    assert load_config(["--output_dir", str(run_dir), "--resume", "latest"]).lora_alpha == 0
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    # no resume: the run's config is not read
    assert load_config(["--output_dir", str(run_dir)]).batch_size == RunConfig().batch_size
    # without --output_dir, the newest numbered run's
    monkeypatch.chdir(tmp_path)
    for number, batch_size in ((1, 16), (12, 24), (3, 48)):
        folder = tmp_path / "runs" / f"run_{number:03d}"
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text(yaml.safe_dump({"batch_size": batch_size}))
    assert load_config(["--resume", "latest"]).batch_size == 24
    # a key the run saved that this template does not know names the run's file
    (run_dir / "config.yaml").write_text("n_layers: 2\n")
    with pytest.raises(ConfigError) as refused:
        load_config(["--output_dir", str(run_dir), "--resume", "latest"])
    assert str(refused.value).startswith(
        f"unknown key 'n_layers' in {run_dir / 'config.yaml'} (the run's own config, which a resume "
        "starts from)"
    )


@pytest.mark.shipped  # the shipped GPT's keys, named in config.py for the line after a fork
def test_the_shipped_model_keys_config_names_are_the_shipped_model_py_s(capsys):
    import dataclasses

    import data
    import model
    import run_config

    for module in (model, data):
        settings = getattr(module, run_config.SETTINGS[module.__name__])
        declared = tuple(field.name for field in dataclasses.fields(settings))
        assert run_config.SHIPPED_KEYS[module.__name__] == declared
    # the shipped model.py declares them: the section applies
    debug = load_config(["--config", str(REPO / "train" / "configs" / "debug.yaml")])
    assert (debug.n_layer, debug.n_head, debug.n_embd, debug.block_size) == (1, 2, 32, 64)
    assert capsys.readouterr().err == ""


def test_every_preset_loads_after_a_fork_and_a_gpt_key_elsewhere_is_named(
    tmp_path, monkeypatch, capsys
):
    """After `cp examples/<any>/*.py train/`, each shipped preset loads: its `lm:` section (the
    shipped causal LM's keys) is left out in one note naming the file and the keys; the same key outside
    the section is refused naming its file and whose key it is."""
    import dataclasses
    import types

    import run_config
    import task

    @dataclasses.dataclass
    class ModelConfig:
        # the fork's own
        hidden_width: int = 128

    fork_model = types.ModuleType("model")
    fork_model.ModelConfig = ModelConfig
    monkeypatch.setattr(task, "fork_file", {"model": fork_model, "data": None}.get)
    monkeypatch.delenv("RANK", raising=False)
    run_config.config_class.cache_clear()
    try:
        for preset in sorted((REPO / "train" / "configs").glob("*.yaml")):
            cfg = load_config(["--config", str(preset)])
            assert not hasattr(cfg, "n_layer")
            assert not hasattr(cfg, "block_size")
            note = capsys.readouterr().err.strip()
            assert note.startswith(
                f"note: {preset}'s lm: section (block_size, n_layer, n_head, n_embd"
            )
            assert note.endswith(
                "is the shipped causal LM's; this train/model.py and data.py do not declare those "
                "keys, so they are left out"
            )
            assert len(note.splitlines()) == 1
        mine = tmp_path / "mine.yaml"
        mine.write_text("n_layer: 2\nlr: 0.01\n")
        with pytest.raises(ConfigError) as refused:
            load_config(["--config", str(mine)])
        assert str(refused.value) == (
            f"unknown key 'n_layer' in {mine}: a key of the shipped causal LM (train/model.py's "
            "ModelConfig as the template ships it), which this train/model.py does not declare (a "
            "preset keeps such keys in its lm: section)"
        )
        with pytest.raises(ConfigError) as refused:
            load_config(["--block_size", "64"])
        assert str(refused.value).startswith(
            "unknown key 'block_size': a key of the shipped causal LM (train/data.py's DataConfig"
        )
        # a fork's run saved by an earlier version, when block_size and text_column were the
        # template's keys: its resume leaves them out
        old_run = tmp_path / "old_run"
        old_run.mkdir()
        (old_run / "config.yaml").write_text("block_size: 128\ntext_column: text\nlr: 0.02\n")
        resumed = load_config(["--output_dir", str(old_run), "--resume", "latest"])
        assert resumed.lr == 0.02 and not hasattr(resumed, "block_size")
        # a key in the section that is no key of the shipped LM is a typo, refused like any other
        mine.write_text("lm:\n  n_layers: 2\n")
        with pytest.raises(ConfigError) as refused:
            load_config(["--config", str(mine)])
        assert str(refused.value) == f"unknown key 'n_layers' in {mine}"
    finally:
        run_config.config_class.cache_clear()
