"""LoRA adapters (train/adapters.py), in one process: only the adapters train and sit in the
optimizer; a checkpoint's model part holds them alone and restores them; the export loads with
peft's own PeftModel.from_pretrained, and merged with transformers' from_pretrained, with the
trained model's logits, and two exports of one adapter (in two processes) are the same files; the
targets by name, the start-up line of what trains, and the one-line refusals at start-up. (Training
on 2 processes, the kill and resume under DDP and FSDP2: tests/e2e/test_lora_runs.py.)"""

import json
import sys

import pytest
import torch
import torch.nn as nn

import checkpoint
import task
from adapters import trainable_weights
from conftest import base_env, run
from errors import ConfigError
from job import load_checked_config
from optim import build_optimizer
from run_config import config_class
from torch_ddp import TorchDDP

RunConfig = config_class()  # TrainConfig and model.py's and data.py's own keys

GPT = dict(n_layer=2, n_head=2, n_embd=16, block_size=8)


def trained_a_little(model, steps: int = 2, vocab: int = 256):
    """A few AdamW steps, so the adapters' B (zero at the start) is not zero."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, 8), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def test_only_the_adapters_of_the_blocks_linear_layers_train_and_sit_in_the_optimizer():
    cfg = RunConfig(**GPT, lora_r=4)
    torch.manual_seed(0)
    model = task.training_model(cfg)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    # every linear layer of each block (attention qkv and proj, MLP fc and proj): A and B each
    layers = {"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"}
    expected = {
        f"blocks.{block}.{layer}.lora_{ab}.default.weight"
        for block in range(2)
        for layer in layers
        for ab in "AB"
    }
    assert trainable == expected
    # lora_alpha not given (0): the scale is 16 / r, as before it could be told from a given 16
    scales = {m.scaling["default"] for m in model.modules() if hasattr(m, "scaling")}
    assert scales == {16 / 4}
    optimizer = build_optimizer(model, cfg)
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in model.parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trained_a_little(model)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert any(
        not torch.equal(p, torch.zeros_like(p))
        for n, p in model.named_parameters()
        if "lora_B" in n
    )


def test_a_checkpoint_holds_the_adapters_alone_and_restores_them(tmp_path):
    cfg = RunConfig(**GPT, lora_r=4, output_dir=str(tmp_path / "run"))
    torch.manual_seed(0)
    model = trained_a_little(task.training_model(cfg))
    plumbing = TorchDDP(cfg)
    parts = checkpoint.checkpoint_parts(plumbing, model, build_optimizer(model, cfg))
    assert isinstance(parts["model"], checkpoint.Trainable)
    folder = tmp_path / "step"
    folder.mkdir()
    parts["model"].save(folder, "model", plumbing, writer=True)
    saved = checkpoint.load_file(str(folder / "model.safetensors"))
    assert set(saved) == set(trainable_weights(model)) and all(".lora_" in name for name in saved)
    full = sum(t.numel() for t in model.state_dict().values())
    assert sum(t.numel() for t in saved.values()) < full / 4
    torch.manual_seed(0)
    fresh = task.training_model(cfg)  # the frozen weights from the seed, the adapters fresh
    parts = checkpoint.checkpoint_parts(plumbing, fresh, build_optimizer(fresh, cfg))
    parts["model"].check(folder, "model", plumbing)
    parts["model"].load(folder, "model", plumbing)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


def test_the_export_loads_with_peft_and_merged_with_from_pretrained(
    tmp_path, tiny_llama, bpe_tokenizer
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(1))
    for merge in (False, True):
        run_dir = tmp_path / f"merge_{merge}"
        cfg = RunConfig(
            hf_model=str(tiny_llama),
            tokenizer=str(bpe_tokenizer),
            block_size=8,
            lora_r=4,
            merge_adapter=merge,
            output_dir=str(run_dir),
        )
        torch.manual_seed(0)
        model = trained_a_little(task.training_model(cfg), vocab=300).eval()
        with torch.no_grad():
            expected = model(input_ids=ids).logits
        path = checkpoint.export_model(TorchDDP(cfg), model, cfg)
        base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        if merge:
            assert path.name == "model.safetensors"
            loaded = AutoModelForCausalLM.from_pretrained(run_dir, dtype=torch.float32).eval()
            assert not any("lora" in name for name in loaded.state_dict())
        else:
            assert path.name == "adapter_model.safetensors"
            assert (run_dir / "adapter_config.json").is_file()
            loaded = PeftModel.from_pretrained(base, run_dir).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        # the run's adapters changed the model: the base alone gives other logits (PeftModel
        # put the adapters into `base` itself: a fresh copy)
        alone = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
        with torch.no_grad():
            assert not torch.allclose(alone(input_ids=ids).logits, expected, atol=1e-4)


@pytest.mark.parametrize("alpha, scale", [(12.0, 3.0), (0.0, 4.0)])  # 0: not given, 16
def test_the_merged_export_is_w_plus_alpha_over_r_times_b_a_from_the_checkpoint_s_adapters(
    tmp_path, alpha, scale
):
    """LoRA's scale, worked by hand (Hu et al. 2021: h = W x + alpha / r B A x): each merged weight of
    the export equals the base weight plus alpha / r times the product of the B and A the checkpoint
    holds, and adapter_config.json says the run's r and alpha."""
    from safetensors.torch import load_file

    cfg = RunConfig(**GPT, lora_r=4, lora_alpha=alpha, output_dir=str(tmp_path / "run"))
    torch.manual_seed(0)
    model = trained_a_little(task.training_model(cfg))
    plumbing = TorchDDP(cfg)
    parts = checkpoint.checkpoint_parts(plumbing, model, build_optimizer(model, cfg))
    (tmp_path / "step").mkdir()
    parts["model"].save(tmp_path / "step", "model", plumbing, writer=True)
    adapters = load_file(str(tmp_path / "step" / "model.safetensors"))
    torch.manual_seed(0)
    base = task.build_model(RunConfig(**GPT)).state_dict()  # the frozen weights, from the seed
    (tmp_path / "run").mkdir()
    unmerged = checkpoint.export_model(plumbing, model, cfg)
    config = json.loads((unmerged.parent / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, alpha or 16.0)
    merged_cfg = RunConfig(
        **GPT, lora_r=4, lora_alpha=alpha, merge_adapter=True, output_dir=str(tmp_path / "merged")
    )
    (tmp_path / "merged").mkdir()
    merged = load_file(str(checkpoint.export_model(TorchDDP(merged_cfg), model, merged_cfg)))
    adapted = sorted({name.split(".lora_")[0] for name in adapters})
    assert adapted  # every linear layer of the blocks
    for layer in adapted:
        a = next(t for n, t in adapters.items() if n.startswith(f"{layer}.lora_A")).double()
        b = next(t for n, t in adapters.items() if n.startswith(f"{layer}.lora_B")).double()
        assert b.abs().sum() > 0  # trained: B is zero at the start
        expected = base[f"{layer}.weight"].double() + scale * (b @ a)
        torch.testing.assert_close(merged[f"{layer}.weight"].double(), expected, rtol=0, atol=1e-6)


def test_a_lora_checkpoint_of_a_model_with_batchnorm_restores_its_trained_statistics(tmp_path):
    """BatchNorm's running statistics are no parameter and need no gradient, yet training moves them:
    an adapter checkpoint that kept only what requires gradients would resume them at their start
    (mean 0, variance 1) and evaluate with statistics the run never had."""
    from adapters import add_lora

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))

    cfg = RunConfig(lora_r=2, lora_targets="0,3", output_dir=str(tmp_path / "run"))
    model = add_lora(build(), cfg).train()
    optimizer = build_optimizer(model, cfg)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = 2 + 3 * torch.randn(16, 6, generator=generator)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    statistics = {n: b.clone() for n, b in model.named_buffers()}
    assert not torch.equal(statistics["1.running_mean"], torch.zeros(8))
    assert int(statistics["1.num_batches_tracked"]) == 3
    plumbing = TorchDDP(cfg)
    parts = checkpoint.checkpoint_parts(plumbing, model, optimizer)
    (tmp_path / "step").mkdir()
    parts["model"].save(tmp_path / "step", "model", plumbing, writer=True)
    fresh = add_lora(build(), cfg)
    parts = checkpoint.checkpoint_parts(plumbing, fresh, build_optimizer(fresh, cfg))
    parts["model"].load(tmp_path / "step", "model", plumbing)
    for name, value in statistics.items():
        assert torch.equal(dict(fresh.named_buffers())[name], value), name
    # and the frozen base weights are not in it: they come from the build
    saved = checkpoint.load_file(str(tmp_path / "step" / "model.safetensors"))
    assert "0.base_layer.weight" not in saved and "1.running_var" in saved


def test_targets_by_name_and_bad_ones_are_one_line_at_start_up(tmp_path):
    torch.manual_seed(0)
    model = task.training_model(RunConfig(**GPT, lora_r=2, lora_targets="qkv"))
    adapted = {n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad}
    assert adapted == {"blocks.0.attn.qkv", "blocks.1.attn.qkv"}
    flags = ["--n_layer", "2", "--n_head", "2", "--n_embd", "16", "--lora_r", "2"]
    flags += ["--output_dir", str(tmp_path / "run")]
    with pytest.raises(
        ConfigError,
        match=r"^lora_targets: 'q_proj' matches no linear layer of GPT \(its linear layers are "
        r"named fc, lm_head, proj, qkv\)",
    ) as error:
        load_checked_config([*flags, "--lora_targets", "q_proj"])
    assert "\n" not in str(error.value)
    with pytest.raises(
        ConfigError,
        match=r"^lora_targets: under fsdp, adapters go in the transformer blocks only .* lm_head is outside them",
    ):
        load_checked_config([*flags, "--lora_targets", "lm_head", "--fsdp", "full"])
    with pytest.raises(ConfigError, match=r"^merge_adapter needs lora_r > 0"):
        load_checked_config(["--merge_adapter", "true"])


def test_lora_targets_match_whole_dotted_names_and_several_names_adapt_their_union():
    """Hand-listed: 'proj' is the layer named proj, not q_proj or out_proj that end with the same
    letters (peft's own rule: the name or its last dotted parts), and 'proj,fc' adapts both."""
    from adapters import add_lora

    model = nn.ModuleDict(
        {
            "attn": nn.ModuleDict({"q_proj": nn.Linear(4, 4), "proj": nn.Linear(4, 4)}),
            "mlp": nn.ModuleDict({"fc": nn.Linear(4, 4), "out_proj": nn.Linear(4, 4)}),
        }
    )
    adapted = add_lora(model, RunConfig(lora_r=2, lora_targets="proj,fc"))
    names = {n.split(".lora_")[0] for n, p in adapted.named_parameters() if p.requires_grad}
    assert names == {"attn.proj", "mlp.fc"}


LLAMA_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IDS = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(1))


def exported_llama_adapter(run_dir, tiny_llama, bpe_tokenizer):
    """A LoRA run of the tiny Llama (r 4, alpha 8, dropout 0.1), trained a little and exported as
    an adapter: (its config, the trained model, its logits on `IDS`, the export's path)."""
    cfg = RunConfig(
        hf_model=str(tiny_llama),
        tokenizer=str(bpe_tokenizer),
        block_size=8,
        lora_r=4,
        lora_alpha=8.0,
        lora_dropout=0.1,
        output_dir=str(run_dir),
    )
    torch.manual_seed(0)
    model = trained_a_little(task.training_model(cfg), vocab=300).eval()
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    return cfg, model, logits, checkpoint.export_model(TorchDDP(cfg), model, cfg)


def test_the_adapter_export_is_what_peft_saves_and_names_the_run_s_base_model_and_dropout(
    tmp_path, tiny_llama, bpe_tokenizer
):
    """Against peft's own save_pretrained of the same adapter (get_peft_model on the same base):
    the same tensor names and shapes; adapter_config.json holds the run's dropout and --hf_model,
    so AutoPeftModelForCausalLM loads it from the folder alone, with the trained logits."""
    from peft import AutoPeftModelForCausalLM, LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    cfg, model, expected, path = exported_llama_adapter(run_dir, tiny_llama, bpe_tokenizer)
    dropouts = [m.lora_dropout["default"] for m in model.modules() if isinstance(m, LoraLayer)]
    assert len(dropouts) == 2 * len(LLAMA_LAYERS)  # 2 blocks
    assert all(type(d) is nn.Dropout and d.p == 0.1 for d in dropouts)
    written = json.loads((run_dir / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == str(tiny_llama)
    assert (written["r"], written["lora_alpha"], written["lora_dropout"]) == (4, 8.0, 0.1)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    peft_own = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=list(LLAMA_LAYERS))
    )
    peft_own.save_pretrained(tmp_path / "peft")
    theirs = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    ours = load_file(str(path))
    assert {n: t.shape for n, t in ours.items()} == {n: t.shape for n, t in theirs.items()}
    loaded = AutoPeftModelForCausalLM.from_pretrained(run_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=IDS).logits, expected, rtol=1e-5, atol=1e-5)


def test_scripts_read_a_lora_run_s_adapter_export_back_with_the_trained_logits(
    tmp_path, tiny_llama, bpe_tokenizer
):
    """harness.adapted_model, what scripts/evaluate.py and sample.py load a LoRA run with: the
    trained model's own logits, not the base's (B is zero at the start)."""
    import harness

    cfg, _, expected, _ = exported_llama_adapter(tmp_path / "run", tiny_llama, bpe_tokenizer)
    loaded = harness.adapted_model(tmp_path / "run", cfg, task.build_model).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=IDS).logits, expected, rtol=1e-5, atol=1e-5)


def test_the_gpts_merged_export_is_a_plain_gpt_with_the_trained_logits(tmp_path):
    cfg = RunConfig(**GPT, lora_r=4, merge_adapter=True, output_dir=str(tmp_path / "run"))
    torch.manual_seed(0)
    model = trained_a_little(task.training_model(cfg)).eval()
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    (tmp_path / "run").mkdir()  # the run's folder, made at its start
    path = checkpoint.export_model(TorchDDP(cfg), model, cfg)
    plain = task.build_model(RunConfig(**GPT)).eval()  # no adapters: the names a GPT has
    checkpoint.load_weights_file(plain, path)
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_resuming_a_full_checkpoint_as_an_adapter_run_or_the_reverse_is_one_line(tmp_path):
    from errors import CheckpointError
    from resume import check_same_run

    full, adapter = RunConfig(**GPT), RunConfig(**GPT, lora_r=8)
    plumbing = TorchDDP(full)
    for saved, now, said in ((full, adapter, "every weight (lora_r 0)"), (adapter, full, "rank 8")):
        about = {"step": 4, "run": checkpoint.run_geometry(plumbing, saved)}
        check_same_run(tmp_path, about, checkpoint.run_geometry(plumbing, saved), saved, {})
        with pytest.raises(CheckpointError, match="was saved training") as error:
            check_same_run(tmp_path, about, checkpoint.run_geometry(plumbing, now), now, {})
        assert said in str(error.value) and "\n" not in str(error.value)


def test_init_from_a_plain_export_loads_the_frozen_weights_of_a_model_with_adapters(tmp_path):
    """--init_from an earlier run's export with --lora_r: the file has no adapters and names each layer's weight
    as the plain model does; it is checked against the frozen weights, loaded into them (the tied embedding
    and head both), and the adapters keep their fresh start. A file of another shape is refused first."""
    from safetensors.torch import save_model

    cfg = RunConfig(**GPT, lora_r=4)
    torch.manual_seed(1)
    plain = task.build_model(RunConfig(**GPT))
    path = tmp_path / "model.safetensors"
    save_model(plain, str(path))
    torch.manual_seed(2)
    adapted = task.training_model(cfg)
    fresh_adapters = {k: v.clone() for k, v in trainable_weights(adapted).items()}
    checkpoint.load_weights_file(adapted, path)
    loaded = adapted.state_dict()
    for name, tensor in plain.state_dict().items():
        adapted_name = name if name in loaded else name.replace(".weight", ".base_layer.weight")
        adapted_name = (
            adapted_name if adapted_name in loaded else name.replace(".bias", ".base_layer.bias")
        )
        assert torch.equal(loaded[adapted_name], tensor), name
    assert all(torch.equal(trainable_weights(adapted)[k], v) for k, v in fresh_adapters.items())
    other = task.build_model(RunConfig(**{**GPT, "n_embd": 32}))
    wrong = tmp_path / "wider.safetensors"
    save_model(other, str(wrong))
    with pytest.raises(
        checkpoint.CheckpointError, match=r"wider.safetensors does not fit this model: "
    ):
        checkpoint.load_weights_file(task.training_model(cfg), wrong)


def test_an_adapter_checkpoint_part_counts_and_stages_the_adapters_alone():
    torch.manual_seed(0)
    model = trained_a_little(task.training_model(RunConfig(**GPT, lora_r=4)))
    part = checkpoint.Trainable(model)
    adapters = trainable_weights(model)
    assert part.nbytes(range(2)) == sum(t.numel() * t.element_size() for t in adapters.values())
    staged = part.snapshot(None, "model", None)
    assert staged.tied == {} and staged.weights.keys() == adapters.keys()
    assert all(
        torch.equal(staged.weights[k], v) and staged.weights[k] is not v
        for k, v in adapters.items()
    )


# a LoRA export in a process of its own: what the process's string hashing orders, it orders
EXPORT = """
import sys
import torch
sys.path.insert(0, "train")
import checkpoint, task
from run_config import config_class
from torch_ddp import TorchDDP
cfg = config_class()(n_layer=2, n_head=2, n_embd=16, block_size=8, lora_r=4, output_dir=sys.argv[1])
torch.manual_seed(0)
checkpoint.export_model(TorchDDP(cfg), task.training_model(cfg), cfg)
"""


def test_two_exports_of_the_same_adapter_are_the_same_files(tmp_path):
    """adapter_config.json's target_modules was a set's order, which changes from process to process
    (PYTHONHASHSEED): a resumed run's adapter folder differed from the uninterrupted one's though its
    weights were the same bytes."""
    folders = []
    for seed in (1, 2):
        folder = tmp_path / f"hash_seed_{seed}"
        env = base_env(tmp_path, PYTHONHASHSEED=seed)
        done = run([sys.executable, "-c", EXPORT, str(folder)], env, timeout=120)
        assert done.returncode == 0, done.stdout
        folders.append(folder)
    names = sorted(p.name for p in folders[0].iterdir())
    assert names == sorted(p.name for p in folders[1].iterdir())
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(names)
    for name in names:
        assert (folders[0] / name).read_bytes() == (folders[1] / name).read_bytes(), name
    written = json.loads((folders[0] / "adapter_config.json").read_text())["target_modules"]
    expected = [f"blocks.{b}.{layer}" for b in (0, 1) for layer in ("attn.proj", "attn.qkv")]
    expected += [f"blocks.{b}.{layer}" for b in (0, 1) for layer in ("mlp.fc", "mlp.proj")]
    assert written == sorted(expected)


def test_a_lora_run_says_its_trainable_parameters_at_start_up():
    """The start-up lines say how many parameters train (the adapters: r x (in + out) for each
    adapted layer, counted here from the GPT's sizes) of how many in all; a run without adapters
    trains all of them and says nothing more."""
    from types import SimpleNamespace

    from tracking import run_info, run_info_lines

    plumbing = SimpleNamespace(num_processes=1, mixed_precision="no")
    data = SimpleNamespace(train_set=range(10), eval_sets={"": range(2)})
    width, r = GPT["n_embd"], 4
    # per block: attn.qkv (width -> 3 width), attn.proj (width -> width), mlp.fc (width -> 4
    # width), mlp.proj (4 width -> width)
    per_block = r * ((width + 3 * width) + (width + width) + 2 * (width + 4 * width))
    adapters = GPT["n_layer"] * per_block
    plain = sum(p.numel() for p in task.build_model(RunConfig(**GPT)).parameters())
    cfg = RunConfig(**GPT, lora_r=r)
    lines = run_info_lines(run_info(cfg, plumbing, task.training_model(cfg), data))
    total = plain + adapters
    said = f"trainable: {adapters:,} parameters of {total:,} ({adapters / total:.1%})"
    assert [line for line in lines if line.startswith("trainable")] == [said]
    full = run_info_lines(run_info(RunConfig(**GPT), plumbing, task.build_model(cfg), data))
    assert not [line for line in full if "trainable" in line]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)


class Blocks(nn.Module):
    """Two blocks (FSDP's units) and four linear layers outside them."""

    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head, self.stem, self.tail, self.neck = (nn.Linear(2, 2) for _ in range(4))


def test_under_fsdp_adapters_outside_the_blocks_are_one_whole_line_naming_three():
    from adapters import check_targets_under_fsdp

    model = Blocks()
    check_targets_under_fsdp(model, ["blocks.0.fc", "blocks.1.fc"])
    targets = ["blocks.0.fc", "head", "stem", "blocks.1.fc", "tail", "neck"]
    with pytest.raises(ConfigError) as refused:
        check_targets_under_fsdp(model, targets)
    assert str(refused.value) == (
        "lora_targets: under fsdp, adapters go in the transformer blocks only (FSDP's units); "
        "head, stem, tail is outside them (got blocks.0.fc, head, stem...)"
    )


def test_a_model_without_blocks_says_lora_r_and_fsdp_need_them_in_whole_lines():
    from adapters import check_targets_under_fsdp, target_names

    bare = nn.Sequential(nn.Linear(2, 2))
    for check, needed_for in (
        (lambda: target_names(bare, RunConfig(lora_r=2)), "lora_r"),
        (lambda: check_targets_under_fsdp(bare, ["0"]), "fsdp"),
    ):
        with pytest.raises(ConfigError) as refused:
            check()
        assert str(refused.value) == (
            f"model: {needed_for} works block by block, and Sequential._no_split_modules names no "
            "block class of it: set it to the class of the model's repeated layer"
        )


def test_peft_s_task_type_only_for_a_hub_model_and_no_adapters_without_peft(monkeypatch):
    from adapters import add_lora, is_adapted, lora_config

    assert lora_config(RunConfig(lora_r=2), ["fc"]).task_type is None
    assert lora_config(RunConfig(lora_r=2, hf_model="some/llama"), ["fc"]).task_type == "CAUSAL_LM"
    adapted = add_lora(Blocks(), RunConfig(lora_r=2))
    assert is_adapted(adapted) and not is_adapted(Blocks())
    monkeypatch.delitem(sys.modules, "peft.tuners.tuners_utils")  # peft never imported
    assert not is_adapted(adapted)


def test_merged_weights_keep_the_base_weights_dtype():
    """W + scale x B A is computed in float64 and written back in the weight's own dtype."""
    from adapters import add_lora, merged_weights

    torch.manual_seed(0)
    model = add_lora(Blocks(), RunConfig(lora_r=2))
    merged = merged_weights(model, model.state_dict())
    assert {tensor.dtype for tensor in merged.values()} == {torch.float32}
    assert "blocks.0.fc.weight" in merged and not any(".lora_" in name for name in merged)
