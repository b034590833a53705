"""Break the template on purpose, one realistic line at a time, and see which tests notice.

    python scripts/mutations.py                 every break below, then a table: caught or not
    python scripts/mutations.py --only NAME ... those breaks only (a name's start is enough)
    python scripts/mutations.py --quick         the breaks whose tests are in the quick tier
    python scripts/mutations.py --list          the breaks and their tests

A test that stays green when the behaviour it names is broken tells the next person that behaviour is
safe. For each break: a copy of the repository's files (tracked and new, not ignored: `git ls-files`)
in a temporary folder, the one edit applied to it (its text must be found exactly once: a break whose
line has moved is reported as such, never skipped), then `python -m pytest -x -q` on the tests that
claim the behaviour, in that copy. "caught" means they turned red; "MISSED" is a gap to close with a
test that fails under that break.

Not part of the default test run (the e2e breaks take a minute each): run it after a change to what
the tests cover, and add a row when you add a promise. Exit code: 1 if any break was missed or could
not be applied, else 0.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600  # per break


@dataclass(frozen=True)
class Break:
    name: str  # what is broken, as a person would say it
    file: str  # relative to the repository
    old: str  # the exact text, found once
    new: str
    tests: tuple[str, ...]  # pytest node ids, relative to the repository
    quick: bool = True  # its tests are in the quick tier (not marked slow)


BREAKS = (
    Break(
        "data identity: only the validity and offsets buffers are hashed, never the token values",
        "train/batches.py",
        "for buffer in chunk.buffers():",
        "for buffer in chunk.buffers()[:2]:",
        ("tests/test_data.py::test_the_data_identity_follows_the_text_and_nothing_else",),
    ),
    Break(
        "a streamed mixture's position is not restored on resume",
        "train/streaming.py",
        '        self.micro_batches = state["micro_batches"]\n',
        "",
        (
            "tests/test_streaming.py::test_a_mixed_stream_restored_from_its_state_draws_exactly_what_"
            "the_original_draws_next",
        ),
    ),
    Break(
        "the step timeout is not restored after a save's long timeout",
        "train/hangs.py",
        "        finally:\n            if self.training and self.store is not None:\n"
        "                set_collective_timeout(self.cfg.step_timeout_s)\n",
        "        finally:\n",
        (
            "tests/test_hang_watch.py::test_a_save_or_the_export_waits_the_long_timeout_and_training_"
            "gets_step_timeout_back",
        ),
    ),
    Break(
        "Muon gets AdamW's weight decay",
        "train/optim.py",
        "weight_decay=cfg.muon_weight_decay,",
        "weight_decay=cfg.weight_decay,",
        (
            "tests/test_schedule.py::test_each_optimizer_gets_its_own_hyperparameters_from_the_config",
        ),
    ),
    Break(
        "each rank writes its straggler times into rank 0's row",
        "train/hangs.py",
        "mine[self.rank] = ",
        "mine[0] = ",
        (
            "tests/test_hang_watch.py::test_each_rank_s_own_data_and_forward_times_fill_its_row_of_"
            "the_straggler_table",
        ),
    ),
    Break(
        "a background save creates its folder without the free-space check",
        "train/saving.py",
        "        def create_and_copy():\n            transaction.create_tmp()\n",
        "        def create_and_copy():\n            transaction.tmp.mkdir(parents=True)\n",
        (
            "tests/test_saving.py::test_a_background_save_checks_the_free_space_before_it_copies_"
            "anything",
        ),
    ),
    Break(
        "every rank that sees a failed collective says the line (finding 15)",
        "train/hangs.py",
        'return self.store.add("speaker", 1) == 1',
        "return True",
        (
            "tests/test_hang_watch.py::test_exactly_one_rank_says_the_line_and_without_the_store_"
            "each_node_s_local_rank_0",
            "tests/e2e/test_two_node.py::test_a_dead_node_stops_the_other_in_bounded_time_and_"
            "both_resume",
        ),
        quick=False,
    ),
    Break(
        "compile: a damaged kept cache is used as it is, not set aside",
        "train/compiling.py",
        "        damage = self.damage()\n",
        "        damage = None\n",
        (
            "tests/test_compiling.py::test_a_damaged_cache_is_set_aside_with_one_warning_and_"
            "compiles_cold",
            "tests/e2e/test_compile.py::test_a_compiled_run_resumes_from_its_kept_cache_without_"
            "compiling_again",
        ),
        quick=False,
    ),
    Break(
        "compile: the kept cache's manifest is not brought up to date before a checkpoint",
        "train/saving.py",
        "            self.kept_cache.record()\n",
        "            pass\n",
        (
            "tests/e2e/test_compile.py::test_a_compiled_run_resumes_from_its_kept_cache_without_"
            "compiling_again",
        ),
        quick=False,
    ),
    Break(
        "compile: the whole model as one graph, not block by block",
        "train/compiling.py",
        "    for block in blocks:\n        block.compile()\n",
        "    plain_model.compile()\n",
        (
            "tests/test_model.py::test_compile_makes_each_block_a_region_of_its_own_and_a_model_"
            "without_blocks_one",
        ),
    ),
    Break(
        "lm-evaluation-harness: rolling log-likelihood over overlapping windows",
        "train/harness.py",
        "pairs = [make_disjoint_window(window) for window in windows]",
        "pairs = list(windows)",
        (
            "tests/test_harness.py::test_rolling_log_likelihood_scores_every_token_once_with_the_"
            "context_its_window_allows",
        ),
    ),
    Break(
        "a mixture source's own split is ignored",
        "train/sources.py",
        "dataset_split=source.split or cfg.dataset_split,",
        "dataset_split=cfg.dataset_split,",
        (
            "tests/test_mixture.py::test_each_source_is_built_with_its_own_split_configuration_and_"
            "text_column",
        ),
    ),
    Break(
        "the launch record misses staged changes (git diff, not git diff HEAD)",
        "train/provenance.py",
        'diff = git("diff", "HEAD")',
        'diff = git("diff")',
        (
            "tests/test_tracking.py::test_a_launch_record_holds_the_uncommitted_changes_of_a_dirty_"
            "checkout",
        ),
    ),
    Break(
        "a background save stages the live tensors, not a copy",
        "train/checkpoint.py",
        'return value.detach().to("cpu", copy=True)',
        'return value.detach().to("cpu")',
        (
            "tests/test_saving.py::test_a_background_save_holds_the_state_of_its_step_while_training_"
            "changes_it",
        ),
    ),
    Break(
        "a background save's staged optimizer state outlives it (finding 9: json tried first)",
        "train/checkpoint.py",
        "        if not is_json(state):\n",
        "        try:\n            json.dumps(state, indent=2)\n        except TypeError:\n",
        ("tests/test_saving.py::test_a_background_save_frees_its_staged_copy_once_committed",),
    ),
    Break(
        "a full disk is judged by the free space after the failure only (finding 16)",
        "train/saving.py",
        "        seen = seen.__cause__ or seen.__context__\n",
        "        seen = None\n",
        (
            "tests/test_saving.py::test_a_full_disk_is_recognised_by_the_error_whatever_space_is_"
            "free_afterwards",
        ),
    ),
    Break(
        "keep_last keeps one checkpoint too many",
        "train/saving.py",
        "for old in folder.checkpoints()[:-keep_last]:",
        "for old in folder.checkpoints()[: -keep_last - 1]:",
        (
            "tests/test_checkpoint.py::test_keep_last_prunes_after_commit_and_latest_ignores_partial_"
            "folders",
        ),
    ),
    Break(
        "the data order is the same every epoch",
        "train/batches.py",
        "generator = torch.Generator().manual_seed(self.seed + self.epoch)",
        "generator = torch.Generator().manual_seed(self.seed)",
        (
            "tests/test_batches.py::test_epoch_sampler_is_a_seeded_permutation_per_epoch_cut_to_whole_"
            "global_batches",
        ),
    ),
    Break(
        "the loss contract is not checked",
        "train/task.py",
        '    reported = metrics.get("loss")\n',
        "    reported = None\n",
        ("tests/test_task.py",),
    ),
    Break(
        "loader workers die of a preemption's SIGTERM (finding 12)",
        "train/stopping.py",
        "    if not num_workers:\n        return {}",
        "    if True:\n        return {}",
        ("tests/test_stop_signals.py",),
    ),
    Break(
        "a dead loader worker is a traceback, not one line (finding 13)",
        "train/job.py",
        "        if str(e).startswith(LOADER_DEATH):\n            raise",
        "        if False:\n            raise",
        (
            "tests/test_stop_signals.py::test_a_loader_worker_killed_from_outside_is_one_line_and_exit_1",
        ),
    ),
    Break(
        "each rank's BatchNorm statistics are not checkpointed (broadcast_buffers off)",
        "train/buffers.py",
        '    return not getattr(prepared_model, "broadcast_buffers", False)',
        "    return False",
        (
            "tests/e2e/test_examples.py::test_batchnorm_without_broadcast_buffers_checkpoints_each_"
            "rank_and_exports_their_mean[image_classification]",
        ),
        quick=False,
    ),
    Break(
        "each rank evaluates with its own BatchNorm statistics, not the export's",
        "train/buffers.py",
        "    if num_processes == 1 or not buffers:\n        yield",
        "    if True:\n        yield",
        (
            "tests/e2e/test_examples.py::test_each_eval_metric_is_an_independent_count_over_exactly_"
            "the_eval_set[image_classification]",
        ),
        quick=False,
    ),
    Break(
        "the RNG is not part of a checkpoint",
        "train/checkpoint.py",
        '    parts["rng"] = PerProcess(ProcessRNG(), bound_to_world_size=False)\n',
        "",
        ("tests/test_checkpoint.py::test_round_trip_restores_every_part",),
    ),
    Break(
        "object storage: a save that never finished (no manifest) counts as committed",
        "train/storage.py",
        'manifests = self.fs.glob(f"{self.root}/checkpoints/{STEP_PREFIX}*/{MANIFEST}")',
        'manifests = self.fs.glob(f"{self.root}/checkpoints/{STEP_PREFIX}*/*")',
        (
            "tests/test_storage.py::test_a_save_that_never_finished_is_not_resumed_from_and_the_next_"
            "commit_removes_it",
        ),
    ),
    Break(
        "object storage: the commit reads the main process's list of uploads alone",
        "train/storage.py",
        'listings = [f"{folder}/{UPLOADED}/rank{rank}.json" for rank in range(world_size)]',
        'listings = [f"{folder}/{UPLOADED}/rank{rank}.json" for rank in range(1)]',
        ("tests/test_storage.py::test_a_commit_names_a_process_whose_upload_never_arrived",),
    ),
    Break(
        "object storage: a downloaded checkpoint is not checked against its manifest",
        "train/storage.py",
        "            problem = checkpoint_problem(local)\n",
        "            problem = None\n",
        (
            "tests/test_storage.py::test_a_resume_skips_a_damaged_checkpoint_with_a_warning_and_takes_"
            "the_one_before",
        ),
    ),
    Break(
        "object storage: a restarted pod does not download the run files (metrics.jsonl starts over)",
        "train/resume.py",
        "        run_folder.bucket.download_run_files(str(run_folder.local))\n",
        "        pass\n",
        (
            "tests/e2e/test_object_storage.py::test_a_run_on_s3_killed_mid_upload_resumes_bitwise_and_"
            "skips_a_damaged_checkpoint",
        ),
        quick=False,
    ),
    Break(
        "Ray: a restarted worker group starts afresh instead of resuming",
        "scripts/ray/train.py",
        '"args": [*train_args, "--resume", "latest"],',
        '"args": train_args,',
        (
            "tests/e2e/test_ray.py::test_a_worker_killed_under_ray_is_restarted_and_the_run_resumes_"
            "bitwise",
        ),
        quick=False,
    ),
    Break(
        "the step's loss weighs each micro-batch's mean alike, whatever it counts",
        "train/main.py",
        "                loss = loss * weight.to(loss.dtype)\n",
        "",
        (
            "tests/e2e/test_loss_weights.py::test_accumulation_and_ranks_give_the_full_batch_gradient_"
            "of_the_mean_over_counted_tokens",
        ),
        quick=False,
    ),
    Break(
        "the step's loss weights forget that DDP averages over ranks",
        "train/task.py",
        "share = items * plumbing.num_processes * steps",
        "share = items * steps",
        (
            "tests/e2e/test_loss_weights.py::test_accumulation_and_ranks_give_the_full_batch_gradient_"
            "of_the_mean_over_counted_tokens",
        ),
        quick=False,
    ),
    Break(
        "the LM's loss is the mean of per-sample means, not per counted token",
        "train/lm.py",
        "mean_count = (targets != -100).sum().clamp(min=1) / targets.size(0)",
        "mean_count = (targets != -100).sum(dim=1).clamp(min=1)",
        (
            "tests/test_model.py::test_the_loss_is_the_mean_over_counted_tokens_and_bitwise_the_old_"
            "one_on_packed_blocks",
        ),
    ),
    Break(
        "the chat data counts the generation prompt as the assistant's",
        "train/chat.py",
        "labels += [-100] * (len(prompt) - len(input_ids)) + answered[len(prompt) :]",
        "labels += [-100] * (len(prompt) - len(input_ids) - 1) + answered[len(prompt) - 1 :]",
        (
            "tests/test_example_data.py::test_chat_masks_count_exactly_the_assistant_s_tokens_as_the_"
            "template_marks_them",
        ),
    ),
    Break(
        "a sharded LoRA checkpoint keeps the frozen weights too",
        "train/checkpoint.py",
        "model_part = Sharded(module, trainable_only=adapted)",
        "model_part = Sharded(module)",
        (
            "tests/e2e/test_lora_runs.py::test_fsdp_each_rank_gets_its_own_adapter_shards_back_and_the_"
            "run_ends_bitwise",
        ),
        quick=False,
    ),
    Break(
        "an unsharded LoRA checkpoint holds the whole model",
        "train/checkpoint.py",
        '"model": Trainable(module) if adapted else Weights(module)',
        '"model": Weights(module)',
        ("tests/test_adapters.py::test_a_checkpoint_holds_the_adapters_alone_and_restores_them",),
    ),
    Break(
        "a restarted sweep driver starts its interrupted trial afresh instead of resuming it",
        "scripts/sweep.py",
        'command_now = [*command, "--resume", "latest"]',
        "command_now = command",
        (
            "tests/e2e/test_sweep.py::test_a_killed_driver_resumes_its_trial_bitwise_and_reruns_no_"
            "finished_one",
        ),
        quick=False,
    ),
    Break(
        "the sweep reports the objective but never asks the pruner",
        "scripts/sweep.py",
        "if pruned_at is None and code is None and trial.should_prune():",
        "if False:",
        (
            "tests/e2e/test_sweep.py::test_a_pruned_trial_checkpoints_a_failed_one_is_recorded_and_a_"
            "broken_command_is_one_line",
        ),
        quick=False,
    ),
    Break(
        "a run resumed inside the profiler window records nothing",
        "train/profiling.py",
        "self.window[0] - 1 <= resumed_step < self.window[1]",
        "self.window[0] - 1 == resumed_step",
        (
            "tests/test_profiling.py::test_the_window_records_its_steps_and_a_start_inside_it_records_"
            "the_rest",
        ),
    ),
    Break(
        "the restart report counts no steps lost",
        "train/tracking.py",
        '"steps_lost": max(0, int(last_logged) - step),',
        '"steps_lost": 0,',
        (
            "tests/e2e/test_tracking_runs.py::test_a_crashed_run_resumes_its_wandb_run_rewound_to_the_"
            "checkpoint",
        ),
        quick=False,
    ),
    Break(
        "a nested phase is counted twice in the restart report",
        "train/profiling.py",
        "self._add(name, now - self.last_lap - self.nested)",
        "self._add(name, now - self.last_lap)",
        (
            "tests/test_profiling.py::test_the_start_clock_s_phases_add_up_to_its_time_wherever_they_"
            "nest",
        ),
    ),
    # written blind to the tests (a helper that read only the README, docs and the code) for the
    # preference example and the first hour's printed commands, resume defaults and presets
    Break(
        "blind: DPO: beta dropped from the chosen-side logsigmoid term",
        "examples/preference/model.py",
        "losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)",
        "losses = -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-beta * h)",
        ("tests/test_preference.py",),
    ),
    Break(
        "blind: IPO: the rejected log-ratio is divided by the chosen's token count",
        "examples/preference/model.py",
        "per_token = chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens",
        "per_token = chosen_ratio / chosen_tokens - rejected_ratio / chosen_tokens",
        ("tests/test_preference.py",),
    ),
    Break(
        "blind: SimPO: the target margin gamma is left out",
        "examples/preference/model.py",
        "losses = -F.logsigmoid(chosen_rewards - rejected_rewards - cfg.simpo_gamma)",
        "losses = -F.logsigmoid(chosen_rewards - rejected_rewards)",
        ("tests/test_preference.py",),
    ),
    Break(
        "blind: the reference is the policy itself, not a frozen copy (it drifts)",
        "examples/preference/model.py",
        "frozen = frozen_copy(model)  # before the forward below is set",
        "frozen = model  # before the forward below is set",
        ("tests/test_preference.py",),
    ),
    Break(
        "blind: LoRA: adapters are left switched off after the reference pass",
        "examples/preference/model.py",
        "layer._disable_adapters = was",
        "layer._disable_adapters = True",
        ("tests/test_preference.py",),
    ),
    Break(
        "blind: chat.py render ignores add_generation_prompt (prompt rendered without the assistant header)",
        "train/chat.py",
        "messages, add_generation_prompt=add_generation_prompt, tokenize=False",
        "messages, tokenize=False",
        ("tests/test_preference.py", "tests/test_example_data.py"),
    ),
    Break(
        "blind: prompt stripped from chosen/rejected conversations one message short",
        "examples/preference/data.py",
        "messages = messages[len(prompt) :]",
        "messages = messages[len(prompt) - 1 :]",
        ("tests/test_preference.py",),
    ),
    Break(
        "blind: collate pads labels with token 0 instead of -100",
        "examples/preference/data.py",
        "filler = torch.full((missing,), -100, dtype=torch.long)",
        "filler = torch.full((missing,), 0, dtype=torch.long)",
        ("tests/test_preference.py",),
    ),
    Break(
        "blind: loss_items counts the padded sequence length, not the pairs",
        "examples/preference/model.py",
        'return batch["chosen_input_ids"].size(0)',
        'return batch["chosen_input_ids"].size(1)',
        ("tests/test_preference.py",),
    ),
    Break(
        "blind: reward accuracy counts a tie as correct",
        "examples/preference/model.py",
        '"reward_accuracy": (output.chosen_rewards > output.rejected_rewards).float(),',
        '"reward_accuracy": (output.chosen_rewards >= output.rejected_rewards).float(),',
        ("tests/test_preference.py",),
    ),
    Break(
        "blind: identity digests the policy's weights instead of the frozen reference's",
        "examples/preference/model.py",
        "weights = preference.frozen.state_dict()",
        "weights = model.state_dict()",
        ("tests/test_preference.py",),
    ),
    # issue 50's unguarded behaviours
    Break(
        "LoRA: lora_alpha ignored (the default scale always)",
        "train/adapters.py",
        "lora_alpha=cfg.lora_alpha or DEFAULT_LORA_ALPHA,",
        "lora_alpha=DEFAULT_LORA_ALPHA,",
        (
            "tests/test_adapters.py::test_the_merged_export_is_w_plus_alpha_over_r_times_b_a_from_the_checkpoint_s_adapters",
        ),
    ),
    Break(
        "LoRA: the merged export adds B A unscaled",
        "train/adapters.py",
        "scale = module.scaling[ADAPTER_NAME]",
        "scale = 1.0",
        (
            "tests/test_adapters.py::test_the_merged_export_is_w_plus_alpha_over_r_times_b_a_from_the_checkpoint_s_adapters",
        ),
    ),
    Break(
        "LoRA: the adapter checkpoint keeps what requires gradients, not BatchNorm's statistics",
        "train/adapters.py",
        "    state.update({name: b for name, b in module.named_buffers() if b is not None})",
        "    pass",
        (
            "tests/test_adapters.py::test_a_lora_checkpoint_of_a_model_with_batchnorm_restores_its_trained_statistics",
        ),
    ),
    Break(
        "object storage: a stale lease is taken over with an unconditional put (both takers win)",
        "train/storage.py",
        "if not self.bucket.bounded(lost, lambda: self._put(IfMatch=etag)):",
        "if not self.bucket.bounded(lost, lambda: self._put()):",
        (
            "tests/e2e/test_object_storage.py::test_two_jobs_taking_over_one_stale_lease_at_once_exactly_one_wins",
        ),
        quick=False,
    ),
    # the preference example end to end (tests/e2e/test_preference_runs.py)
    Break(
        "preference: the reference is the policy itself (e2e: it starts from the SFT run and learns)",
        "examples/preference/model.py",
        "frozen = frozen_copy(model)  # before the forward below is set",
        "frozen = model  # before the forward below is set",
        (
            "tests/e2e/test_preference_runs.py::test_it_starts_from_the_sft_run_and_learns_against_"
            "a_reference_that_never_moves",
        ),
        quick=False,
    ),
    Break(
        "preference: a step's loss is the sum over its pairs, not the mean",
        "examples/preference/model.py",
        "loss=losses.mean(),",
        "loss=losses.sum(),",
        (
            "tests/e2e/test_preference_runs.py::test_accumulation_and_world_size_change_only_"
            "rounding",
        ),
        quick=False,
    ),
    Break(
        "preference: the eval's reference column is the policy's chosen log-probs",
        "examples/preference/model.py",
        'columns["ref_chosen_logps"] = output.ref_chosen_logps',
        'columns["ref_chosen_logps"] = output.chosen_logps',
        ("tests/e2e/test_preference_runs.py::test_under_fsdp2_the_reference_never_moves",),
        quick=False,
    ),
    Break(
        "blind: prompt exactly block_size tokens long is no longer refused (off by one)",
        "examples/preference/data.py",
        "if len(prompt) >= block_size:",
        "if len(prompt) > block_size:",
        ("tests/test_preference.py",),
    ),
    Break(
        "blind: parent_of reads the process's own Pid instead of PPid",
        "train/provenance.py",
        'found = re.search(r"^PPid:\\s*(\\d+)", status, re.MULTILINE)',
        'found = re.search(r"^Pid:\\s*(\\d+)", status, re.MULTILINE)',
        ("tests/test_tracking.py::test_the_parent_of_this_process_is_read_from_proc",),
    ),
    Break(
        "blind: launcher_prefix drops '-m' for python -m torch.distributed.run",
        "train/provenance.py",
        'return ["python", *before_script[1:]]',
        'return ["python", *before_script[2:]]',
        (
            "tests/test_tracking.py::test_a_printed_command_launches_the_run_again_the_way_it_was_launched",
        ),
    ),
    Break(
        "blind: a resume's own config.yaml wins over the --config file",
        "train/run_config.py",
        "values = {**saved, **from_file, **overrides}",
        "values = {**from_file, **saved, **overrides}",
        (
            "tests/test_config.py::test_a_resume_starts_from_the_runs_own_config_then_the_file_then_the_flags",
        ),
    ),
    Break(
        "blind: presets' lm: section: the wrong keys are left out (condition inverted)",
        "train/run_config.py",
        "left_out = [key for key in section if key not in known and key in shipped]",
        "left_out = [key for key in section if key in known and key in shipped]",
        (
            "tests/test_config.py::test_every_preset_loads_after_a_fork_and_a_gpt_key_elsewhere_is_named",
            "tests/test_config.py::test_the_shipped_model_keys_config_names_are_the_shipped_model_py_s",
        ),
    ),
    Break(
        "blind: an unknown key in the --config file is said to come from the run's config.yaml",
        "train/run_config.py",
        'key: f" in {config_file}" for key in from_file',
        'key: f" in {saved_path}" for key in from_file',
        ("tests/test_config.py::test_bad_yaml_files",),
    ),
    Break(
        "blind: 'train on' line doubles this start's first step instead of the last step",
        "train/tracking.py",
        "further = str(2 * step)",
        "further = str(2 * self.first_step)",
        (
            "tests/test_tracking.py::test_a_resumed_runs_summary_gives_the_runs_best_evaluation_and_a_forks_final_eval",
        ),
    ),
    Break(
        "blind: a resume forgets the earlier starts' evaluations (summary's best eval is this start's only)",
        "train/tracking.py",
        "self.evaluations = [row for row in map(json.loads, kept) if is_evaluation(row)]",
        "self.evaluations = []",
        (
            "tests/test_tracking.py::test_a_resumed_runs_summary_gives_the_runs_best_evaluation_and_a_forks_final_eval",
        ),
    ),
    Break(
        "blind: with_data_default condition inverted: DEFAULT_DATASET never put in the config",
        "train/task.py",
        "if cfg.dataset or not default:",
        "if cfg.dataset or default:",
        ("tests/test_task.py::test_dataset_not_given_is_the_data_files_default_or_none",),
    ),
)


def repository_copy(into: Path) -> Path:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    for name in listed.stdout.splitlines():
        source = REPO / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    return into


def apply(copy: Path, broken: Break) -> str | None:
    """The edit, or why it cannot be made."""
    path = copy / broken.file
    text = path.read_text()
    found = text.count(broken.old)
    if found != 1:
        return f"its text is found {found} times in {broken.file} (the line moved: update the row)"
    path.write_text(text.replace(broken.old, broken.new))
    return None


def run(broken: Break) -> tuple[str, float]:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mutation-") as folder:
        copy = repository_copy(Path(folder))
        problem = apply(copy, broken)
        if problem:
            return f"NOT APPLIED: {problem}", 0.0
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
        try:
            result = subprocess.run(
                [*command, *broken.tests], cwd=copy, capture_output=True, timeout=TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return f"caught (its tests ran past {TIMEOUT_S} s)", time.perf_counter() - started
    if result.returncode == 5:
        return "NOT RUN: pytest found none of its tests (renamed?)", time.perf_counter() - started
    verdict = "caught" if result.returncode != 0 else "MISSED"
    return verdict, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=[], help="breaks whose names start so")
    parser.add_argument("--quick", action="store_true", help="only breaks tested in the quick tier")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    chosen = [
        b
        for b in BREAKS
        if (not args.only or any(b.name.startswith(o) for o in args.only))
        and (b.quick or not args.quick)
    ]
    if args.list:
        for broken in chosen:
            print(f"{broken.name}\n    {broken.file}\n    " + "\n    ".join(broken.tests))
        return 0
    rows = []
    for broken in chosen:
        verdict, seconds = run(broken)
        rows.append((broken, verdict, seconds))
        print(f"{verdict:<8} {seconds:6.1f} s  {broken.name}", flush=True)
    print("\n| break | file | tests | result |\n|---|---|---|---|")
    for broken, verdict, seconds in rows:
        tests = ", ".join(test.split("::")[-1] for test in broken.tests)
        print(f"| {broken.name} | {broken.file} | {tests} | {verdict} ({seconds:.0f} s) |")
    return 0 if all(verdict.startswith("caught") for _, verdict, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
