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
        '"dataset_split": source.split or cfg.dataset_split,',
        '"dataset_split": cfg.dataset_split,',
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
        'return self.fs.glob(f"{self.root}/checkpoints/{STEP_PREFIX}*/{MANIFEST}")',
        'return self.fs.glob(f"{self.root}/checkpoints/{STEP_PREFIX}*/*")',
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
        "train/batches.py",
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
        "train/chat.py",
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
    Break(
        "scripts/launch.py: SIGUSR1 left out of the signals the launcher passes on",
        "scripts/launch.py",
        '        names.append("SIGUSR1")',
        "        pass",
        (
            "tests/e2e/test_launch.py::test_a_stop_is_a_checkpoint_and_the_job_s_own_code_with_no_launcher_traceback",
        ),
        quick=False,
    ),
    Break(
        "Ray: a worker's LOCAL_RANK is its global rank",
        "scripts/ray/train.py",
        '"LOCAL_RANK": str(context.get_local_rank()),',
        '"LOCAL_RANK": str(context.get_world_rank()),',
        ("tests/test_ray_worker.py",),
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
    # ---- issue 50, item 1: blind break audit. These rows were written BLIND to the tests: from
    # README.md, docs/ and the code under train/, scripts/ and examples/ only, the tests chosen by
    # their collected names (pytest --collect-only), never by reading them.
    # A1: the step's loss weights and the LM loss
    Break(
        "blind50 A1: loss weights drop the accumulation factor (a micro-batch weighs 1/grad_accum too little)",
        "train/batches.py",
        "share = items * plumbing.num_processes * steps",
        "share = items * plumbing.num_processes",
        ("tests/test_task.py::test_loss_weights_make_the_step_a_mean_over_every_counted_item",),
    ),
    Break(
        "blind50 A1: loss weights drop the world-size factor (every rank's step is 1/world too small)",
        "train/batches.py",
        "share = items * plumbing.num_processes * steps",
        "share = items * steps",
        ("tests/test_task.py::test_loss_weights_make_the_step_a_mean_over_every_counted_item",),
    ),
    Break(
        "blind50 A1: the step's items are averaged over the ranks, not summed",
        "train/batches.py",
        'step_items = plumbing.reduce(items.sum(), "sum")',
        'step_items = plumbing.reduce(items.sum(), "mean")',
        ("tests/test_task.py::test_loss_weights_make_the_step_a_mean_over_every_counted_item",),
    ),
    Break(
        "blind50 A1: loss weights divide by this rank's items, not the step's over all ranks (no all-reduce)",
        "train/batches.py",
        "return share.double() / step_items.clamp(min=1).double()",
        "return share.double() / items.sum().clamp(min=1).double()",
        ("tests/test_task.py::test_loss_weights_make_the_step_a_mean_over_every_counted_item",),
    ),
    Break(
        "blind50 A1: the LM loss's last position is a target (token 0), not ignored",
        "train/lm.py",
        "targets = F.pad(labels[:, 1:], (0, 1), value=-100)",
        "targets = F.pad(labels[:, 1:], (0, 1), value=0)",
        (
            "tests/test_model.py::test_the_loss_is_the_mean_over_counted_tokens_and_bitwise_the_old_one_on_packed_blocks",
            "tests/test_model.py::test_shapes_and_loss_at_init_is_uniform",
        ),
    ),
    Break(
        "blind50 A1: counted_targets counts the unshifted labels (one target too many per sample)",
        "train/lm.py",
        "return (labels[:, 1:] != -100).sum()",
        "return (labels != -100).sum()",
        (
            "tests/test_task.py::test_the_shipped_lm_counts_a_block_per_sample",
            "tests/test_model.py::test_the_loss_is_the_mean_over_counted_tokens_and_bitwise_the_old_one_on_packed_blocks",
        ),
    ),
    Break(
        "blind50 A1: the LM loss divides by the unshifted labels' count (wrong one of labels/targets)",
        "train/lm.py",
        "mean_count = (targets != -100).sum().clamp(min=1) / targets.size(0)",
        "mean_count = (labels != -100).sum().clamp(min=1) / targets.size(0)",
        (
            "tests/test_model.py::test_the_loss_is_the_mean_over_counted_tokens_and_bitwise_the_old_one_on_packed_blocks",
        ),
    ),
    Break(
        "blind50 A1: a batch with no counted target gives a NaN loss (clamp dropped)",
        "train/lm.py",
        "mean_count = (targets != -100).sum().clamp(min=1) / targets.size(0)",
        "mean_count = (targets != -100).sum() / targets.size(0)",
        (
            "tests/test_lm.py::test_a_batch_with_no_counted_target_has_loss_zero_and_a_zero_gradient",
        ),
    ),
    Break(
        "blind50 A1: the logged loss is the sum over micro-steps, not their mean",
        "train/main.py",
        "step_loss += loss.detach() / cfg.grad_accum_steps",
        "step_loss += loss.detach()",
        (
            "tests/e2e/test_loss_weights.py::test_accumulation_and_ranks_give_the_full_batch_gradient_of_the_mean_over_counted_tokens",
        ),
        quick=False,
    ),
    # A2: chat rendering, assistant masks and packing
    Break(
        "blind50 A2: render adds the tokenizer's special tokens again (a second BOS before each turn)",
        "train/chat.py",
        'return tokenizer(text, add_special_tokens=False)["input_ids"]',
        'return tokenizer(text)["input_ids"]',
        (
            "tests/test_example_data.py::test_a_tokenizer_that_adds_a_bos_renders_one_bos_as_the_chat_template_does",
        ),
    ),
    Break(
        "blind50 A2: a conversation that exactly fills the rest of a block starts a new one (> became >=)",
        "examples/chat_sft/data.py",
        'full = len(block["input_ids"]) + len(input_ids) > block_size',
        'full = len(block["input_ids"]) + len(input_ids) >= block_size',
        (
            "tests/test_example_data.py::test_conversations_that_exactly_fill_a_block_are_one_block_each_at_its_own_positions",
        ),
    ),
    Break(
        "blind50 A2: packed conversations' positions continue across the block (they attend to each other)",
        "examples/chat_sft/data.py",
        'block["position_ids"] += list(range(len(input_ids)))',
        'block["position_ids"] += list(range(len(block["position_ids"]), len(block["input_ids"])))',
        (
            "tests/test_example_data.py::test_conversations_that_exactly_fill_a_block_are_one_block_each_at_its_own_positions",
            "tests/test_example_data.py::test_chat_packing_keeps_conversations_whole_in_order_with_their_own_positions",
        ),
    ),
    Break(
        "blind50 A2: a packed block's padding is labelled with the pad token (padding trains)",
        "examples/chat_sft/data.py",
        'block["labels"] += [-100] * missing',
        'block["labels"] += [pad_id] * missing',
        (
            "tests/test_example_data.py::test_chat_packing_keeps_conversations_whole_in_order_with_their_own_positions",
            "tests/test_example_data.py::test_chat_masks_count_exactly_the_assistant_s_tokens_as_the_template_marks_them",
        ),
    ),
    Break(
        "blind50 A2: packing false still packs (the 'not packing' case of the new-block condition dropped)",
        "examples/chat_sft/data.py",
        'if block["input_ids"] and (full or not packing):',
        'if block["input_ids"] and full:',
        (
            "tests/test_example_data.py::test_unpacked_each_row_is_one_conversation_padded_to_its_batch_s_longest",
        ),
    ),
    Break(
        "blind50 A2: unpacked rows are padded to block_size, not to their batch's longest",
        "examples/chat_sft/data.py",
        "padded_to = block_size if packing else 0  # 0: no padding",
        "padded_to = block_size",
        (
            "tests/test_example_data.py::test_unpacked_each_row_is_one_conversation_padded_to_its_batch_s_longest",
        ),
    ),
    Break(
        "blind50 A2: collate pads an unpacked row's labels with token 0 (padding trains)",
        "examples/chat_sft/data.py",
        'padding = {"input_ids": 0, "labels": -100}',
        'padding = {"input_ids": 0, "labels": 0}',
        (
            "tests/test_example_data.py::test_unpacked_each_row_is_one_conversation_padded_to_its_batch_s_longest",
        ),
    ),
    Break(
        "blind50 A2: the unanswered count looks at a conversation's first turn, not its last",
        "examples/chat_sft/data.py",
        'unanswered += conversation[-1]["role"] == "user"',
        'unanswered += conversation[0]["role"] == "user"',
        (
            "tests/test_example_data.py::test_conversations_that_end_on_a_user_turn_are_one_warning_with_their_count",
        ),
    ),
    Break(
        "blind50 A2: a message's text parts are joined with nothing between them",
        "train/chat.py",
        'return "\\n".join(texts)',
        'return "".join(texts)',
        (
            "tests/test_example_data.py::test_messages_are_read_as_written_and_text_parts_are_joined",
        ),
    ),
    Break(
        "blind50 A2: a conversation exactly block_size long is counted as cut (> became >=)",
        "examples/chat_sft/data.py",
        "cut = len(input_ids) > block_size",
        "cut = len(input_ids) >= block_size",
        (
            "tests/test_example_data.py::test_conversations_that_exactly_fill_a_block_are_one_block_each_at_its_own_positions",
        ),
    ),
    # A3: LoRA
    Break(
        "blind50 A3: --lora_dropout is ignored (the adapters' dropout is always peft's default 0)",
        "train/adapters.py",
        "        lora_dropout=cfg.lora_dropout,\n",
        "",
        (
            "tests/test_adapters.py::test_the_adapter_export_is_what_peft_saves_and_names_the_run_s_base_model_and_dropout",
        ),
    ),
    Break(
        "blind50 A3: adapter_config.json does not name the base model",
        "train/adapters.py",
        "config = lora_config(cfg, adapted, base_model=cfg.hf_model or None)",
        "config = lora_config(cfg, adapted)",
        (
            "tests/test_adapters.py::test_the_adapter_export_is_what_peft_saves_and_names_the_run_s_base_model_and_dropout",
        ),
    ),
    Break(
        "blind50 A3: by default the adapters go on the linear layers outside the blocks (condition inverted)",
        "train/adapters.py",
        "return [name for name, module in linear.items() if id(module) in inside]",
        "return [name for name, module in linear.items() if id(module) not in inside]",
        (
            "tests/test_adapters.py::test_only_the_adapters_of_the_blocks_linear_layers_train_and_sit_in_the_optimizer",
        ),
    ),
    Break(
        "blind50 A3: --lora_targets matches a name's suffix without the dot ('proj' adapts q_proj)",
        "train/adapters.py",
        'matched = [name for name in linear if name == wanted or name.endswith(f".{wanted}")]',
        "matched = [name for name in linear if name.endswith(wanted)]",
        (
            "tests/test_adapters.py::test_lora_targets_match_whole_dotted_names_and_several_names_adapt_their_union",
            "tests/test_adapters.py::test_targets_by_name_and_bad_ones_are_one_line_at_start_up",
        ),
    ),
    Break(
        "blind50 A3: only the last --lora_targets name gets adapters",
        "train/adapters.py",
        "chosen += [name for name in matched if name not in chosen]",
        "chosen = [name for name in matched if name not in chosen]",
        (
            "tests/test_adapters.py::test_lora_targets_match_whole_dotted_names_and_several_names_adapt_their_union",
            "tests/test_adapters.py::test_targets_by_name_and_bad_ones_are_one_line_at_start_up",
        ),
    ),
    Break(
        "blind50 A3: the merged export keeps peft's base_layer names (from_pretrained leaves them random)",
        "train/adapters.py",
        'return {name.replace(".base_layer.", "."): tensor for name, tensor in merged.items()}',
        "return merged",
        (
            "tests/test_adapters.py::test_the_gpts_merged_export_is_a_plain_gpt_with_the_trained_logits",
            "tests/test_adapters.py::test_the_export_loads_with_peft_and_merged_with_from_pretrained",
        ),
    ),
    Break(
        "blind50 A3: the exported adapter keeps the '.default.' in its names (peft loads no weights)",
        "train/adapters.py",
        'PEFT_PREFIX + name.replace(suffix, "."): tensor.contiguous()',
        "PEFT_PREFIX + name: tensor.contiguous()",
        (
            "tests/test_adapters.py::test_the_adapter_export_is_what_peft_saves_and_names_the_run_s_base_model_and_dropout",
            "tests/test_adapters.py::test_the_export_loads_with_peft_and_merged_with_from_pretrained",
        ),
    ),
    Break(
        "blind50 A3: the adapter checkpoint part holds every parameter, frozen ones too",
        "train/adapters.py",
        "state = {name: p for name, p in module.named_parameters() if p.requires_grad}",
        "state = {name: p for name, p in module.named_parameters()}",
        (
            "tests/test_adapters.py::test_a_checkpoint_holds_the_adapters_alone_and_restores_them",
            "tests/test_adapters.py::test_an_adapter_checkpoint_part_counts_and_stages_the_adapters_alone",
        ),
    ),
    Break(
        "blind50 A3: a full checkpoint resumes as an adapter run (lora_r 0 saved is not compared)",
        "train/resume.py",
        "    if saved_rank != cfg.lora_r:\n",
        "    if saved_rank and saved_rank != cfg.lora_r:\n",
        (
            "tests/test_adapters.py::test_resuming_a_full_checkpoint_as_an_adapter_run_or_the_reverse_is_one_line",
        ),
    ),
    Break(
        "blind50 A3: --merge_adapter inverted (merged by default, the adapter alone when asked to merge)",
        "train/checkpoint.py",
        "if adapted and not cfg.merge_adapter:",
        "if adapted and cfg.merge_adapter:",
        (
            "tests/test_adapters.py::test_the_export_loads_with_peft_and_merged_with_from_pretrained",
        ),
    ),
    Break(
        "blind50 A3: a checkpoint's adapters are read back with lora_B left under peft's file names",
        "train/adapters.py",
        'for matrix in ("lora_A", "lora_B"):',
        'for matrix in ("lora_A",):',
        (
            "tests/test_adapters.py::test_scripts_read_a_lora_run_s_adapter_export_back_with_the_trained_logits",
        ),
    ),
    # A4: scripts/launch.py and the stop signals
    Break(
        "blind50 A4: launch.py: a refused input (exit 2) exits with the launcher's 1 (> 1 became > 2)",
        "scripts/launch.py",
        "if relayed.failed_code is not None and relayed.failed_code > 1:",
        "if relayed.failed_code is not None and relayed.failed_code > 2:",
        ("tests/e2e/test_launch.py::test_a_refused_input_is_one_line_and_exit_2",),
        quick=False,
    ),
    Break(
        "blind50 A4: launch.py: a SIGUSR1 stop exits 130, not 75 (no requeue)",
        "scripts/launch.py",
        'STOP_CODES = {"SIGTERM": 75, "SIGUSR1": 75, "SIGINT": 130}',
        'STOP_CODES = {"SIGTERM": 75, "SIGUSR1": 130, "SIGINT": 130}',
        (
            "tests/e2e/test_launch.py::test_a_stop_is_a_checkpoint_and_the_job_s_own_code_with_no_launcher_traceback[10-75]",
        ),
        quick=False,
    ),
    Break(
        "blind50 A4: launch.py does not pass SIGUSR1 on (SLURM's --signal=USR1 kills launch.py alone)",
        "scripts/launch.py",
        "    signal.signal(signal.SIGUSR1, pass_on)\n",
        "",
        (
            "tests/e2e/test_launch.py::test_a_stop_is_a_checkpoint_and_the_job_s_own_code_with_no_launcher_traceback[10-75]",
        ),
        quick=False,
    ),
    Break(
        "blind50 A4: launch.py: a stop exits with the launcher's code, not the workers' 75/130",
        "scripts/launch.py",
        "return relayed.stopped_code or code",
        "return code or relayed.stopped_code",
        (
            "tests/e2e/test_launch.py::test_a_stop_is_a_checkpoint_and_the_job_s_own_code_with_no_launcher_traceback[15-75]",
        ),
        quick=False,
    ),
    Break(
        "blind50 A4: launch.py: a SignalException raised in elastic's metrics wrapper is printed",
        "scripts/launch.py",
        'r"|torch/distributed/elastic/(agent|metrics|multiprocessing/api)"',
        'r"|torch/distributed/elastic/(agent|multiprocessing/api)"',
        (
            "tests/test_stop_signals.py::test_scripts_launch_drops_the_launcher_s_traceback_wherever_the_signal_lands",
        ),
    ),
    Break(
        "blind50 A4: launch.py: the held first lines of the launcher's traceback are printed at the end",
        "scripts/launch.py",
        "out.writelines([] if launchers else held)",
        "out.writelines(held)",
        (
            "tests/test_stop_signals.py::test_scripts_launch_drops_the_launcher_s_traceback_wherever_the_signal_lands",
        ),
    ),
    Break(
        "blind50 A4: launch.py: a stop during start-up is not read as a stop (exit 1, not 75)",
        "scripts/launch.py",
        'STOPPED = re.compile(r"^(stopping at step \\d+|stopped during start-up) on (SIGTERM|SIGUSR1|SIGINT)")',
        'STOPPED = re.compile(r"^(stopping at step \\d+) on (SIGTERM|SIGUSR1|SIGINT)")',
        (
            "tests/test_stop_signals.py::test_scripts_launch_reads_a_stop_during_start_up_as_that_stop",
        ),
    ),
    Break(
        "blind50 A4: a rank that got no signal takes SIGTERM, not the cause the others voted (exit codes differ)",
        "train/stopping.py",
        "first_cause = next(cause for cause, count in zip(STOP_CAUSES, causes, strict=True) if count)",
        "first_cause = STOP_CAUSES[0]",
        (
            "tests/test_stop_signals.py::test_a_rank_that_got_no_signal_takes_the_cause_the_others_voted_and_its_exit_code",
        ),
    ),
    Break(
        "blind50 A4: a stop during start-up leaves no requeue marker (preempted compared with 130)",
        "train/job.py",
        "preempted = stop_signals.exit_code == stop_signals.PREEMPTED_EXIT_CODE",
        "preempted = stop_signals.exit_code == stop_signals.INTERRUPTED_EXIT_CODE",
        ("tests/e2e/test_reliability.py::test_sigterm_during_start_up_is_a_clean_preemption",),
        quick=False,
    ),
    # A5: the examples' metrics
    Break(
        "blind50 A5: text classification's F1 leaves out the false negatives",
        "examples/text_classification/model.py",
        "f1[name] = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0",
        "f1[name] = 2 * tp / (2 * tp + fp) if tp + fp + fn else 0.0",
        (
            "tests/e2e/test_examples.py::test_each_eval_metric_is_an_independent_count_over_exactly_the_eval_set[text_classification]",
        ),
        quick=False,
    ),
    Break(
        "blind50 A5: text classification's false positives count the true negatives",
        "examples/text_classification/model.py",
        'columns[f"fp_{index}"] = ((predicted == index) & (labels != index)).double()',
        'columns[f"fp_{index}"] = ((predicted != index) & (labels != index)).double()',
        (
            "tests/e2e/test_examples.py::test_each_eval_metric_is_an_independent_count_over_exactly_the_eval_set[text_classification]",
        ),
        quick=False,
    ),
    Break(
        "blind50 A5: image classification's per-class accuracy is over all images, not the class's",
        "examples/image_classification/model.py",
        'metrics[f"accuracy/{name}"] = sums[f"right_{index}"] / of_class',
        'metrics[f"accuracy/{name}"] = sums[f"right_{index}"] / samples',
        (
            "tests/e2e/test_examples.py::test_each_eval_metric_is_an_independent_count_over_exactly_the_eval_set[image_classification]",
        ),
        quick=False,
    ),
    Break(
        "blind50 A5: image classification's right_<class> counts every right image (class mask dropped)",
        "examples/image_classification/model.py",
        'columns[f"right_{index}"] = (of_class & right).double()',
        'columns[f"right_{index}"] = right.double()',
        (
            "tests/e2e/test_examples.py::test_each_eval_metric_is_an_independent_count_over_exactly_the_eval_set[image_classification]",
        ),
        quick=False,
    ),
    Break(
        "blind50 A5: the LM's perplexity is exp of the summed loss, not the per-token loss",
        "train/lm.py",
        'metrics["perplexity"] = math.exp(min(metrics["loss"], 50))',
        'metrics["perplexity"] = math.exp(min(sums["loss"], 50))',
        ("tests/test_lm.py::test_every_column_but_tokens_is_reported_per_token",),
    ),
    Break(
        "blind50 A5: the LM's eval columns compare each position with its own label (no shift)",
        "train/lm.py",
        "    targets = labels[:, 1:]\n",
        "    targets = labels[:, :-1]\n",
        ("tests/test_lm.py::test_eval_columns_are_exact_in_any_chunking_and_ignore_masked_labels",),
    ),
    Break(
        "blind50 A5: a mixture's per-source eval metrics are over the other sources (== became !=)",
        "train/evaluation.py",
        "own = {name: value for (s, name), value in totals.items() if s == source}",
        "own = {name: value for (s, name), value in totals.items() if s != source}",
        (
            "tests/e2e/test_mixture_runs.py::test_a_map_style_mixture_resumes_on_another_world_size_and_evaluates_each_source_exactly",
        ),
        quick=False,
    ),
    Break(
        "blind50 A5: the eval's token count is floored at the wrong place (tokens divided by itself)",
        "train/lm.py",
        'metrics = {name: total / tokens for name, total in sums.items() if name != "tokens"}',
        "metrics = {name: total / tokens for name, total in sums.items()}",
        ("tests/test_lm.py::test_every_column_but_tokens_is_reported_per_token",),
    ),
    # A6: Hugging Face model and tokenizer checks
    Break(
        "blind50 A6: a tokenizer exactly as large as the model's vocabulary is refused (> became >=)",
        "train/checks.py",
        "if tokens > embedded:",
        "if tokens >= embedded:",
        (
            "tests/test_hugging_face.py::test_a_bad_model_or_tokenizer_is_one_line_before_anything_starts",
            "tests/test_hugging_face.py::test_a_hugging_face_model_from_a_folder_pretrained_or_fresh",
        ),
    ),
    Break(
        "blind50 A6: block_size equal to the model's positions is refused (> became >=)",
        "train/checks.py",
        "if block_size and block_size > positions:",
        "if block_size and block_size >= positions:",
        ("tests/test_hugging_face.py::test_block_size_may_be_exactly_the_model_s_positions",),
    ),
    Break(
        "blind50 A6: the positions check reads GPT-2's n_positions only (a Llama's block_size is unchecked)",
        "train/checks.py",
        'positions = getattr(model_config, "max_position_embeddings", None) or block_size',
        'positions = getattr(model_config, "n_positions", None) or block_size',
        (
            "tests/test_hugging_face.py::test_a_bad_model_or_tokenizer_is_one_line_before_anything_starts",
        ),
    ),
    Break(
        "blind50 A6: a local model folder's weights are checked under model_weights config, not pretrained",
        "train/checks.py",
        'if cfg.model_weights == "pretrained" and os.path.isdir(cfg.hf_model):',
        'if cfg.model_weights == "config" and os.path.isdir(cfg.hf_model):',
        (
            "tests/test_hugging_face.py::test_a_model_folder_that_cannot_be_loaded_as_configured_is_one_line_exit_2",
        ),
    ),
    Break(
        "blind50 A6: a folder's weight shapes are compared by their first dimension only",
        "train/checks.py",
        "if key in expected and expected[key] != shape:",
        "if key in expected and expected[key][0] != shape[0]:",
        (
            "tests/test_hugging_face.py::test_a_model_folder_that_cannot_be_loaded_as_configured_is_one_line_exit_2[narrower_weight]",
        ),
    ),
    Break(
        "blind50 A6: --hf_model's pretrained weights load in their saved dtype, not fp32",
        "train/lm.py",
        "return AutoModelForCausalLM.from_pretrained(cfg.hf_model, dtype=torch.float32)",
        "return AutoModelForCausalLM.from_pretrained(cfg.hf_model)",
        ("tests/test_hugging_face.py::test_a_bf16_model_folder_trains_fp32_weights",),
    ),
    Break(
        "blind50 A6: the vocabulary a model is built for leaves out the tokenizer's added tokens",
        "train/lm.py",
        "    return len(tokenizer)\n",
        "    return tokenizer.vocab_size\n",
        (
            "tests/test_hugging_face.py::test_a_model_built_for_a_tokenizer_embeds_its_added_tokens_too",
        ),
    ),
    Break(
        "blind50 A6: a tokenizer without an EOS passes the packing check if it has a BOS",
        "train/lm.py",
        "if tokenizer is not None and tokenizer.eos_token_id is None:",
        "if tokenizer is not None and tokenizer.bos_token_id is None:",
        (
            "tests/test_hugging_face.py::test_documents_end_with_eos_and_ids_take_the_narrowest_unsigned_type",
        ),
    ),
    Break(
        "blind50 A6: the '(the model's own, by default ...)' hint is said when --tokenizer was given",
        "train/checks.py",
        "            if cfg.tokenizer\n",
        "            if not cfg.tokenizer\n",
        (
            "tests/test_hugging_face.py::test_a_bad_model_or_tokenizer_is_one_line_before_anything_starts",
        ),
    ),
    Break(
        "blind50 A6: a --tokenizer named without --hf_model is not checked at start-up",
        "train/checks.py",
        'if not uses_hub_model(cfg) and cfg.tokenizer_name == "bytes":',
        "if not uses_hub_model(cfg):",
        (
            "tests/test_hugging_face.py::test_a_bad_model_or_tokenizer_is_one_line_before_anything_starts",
        ),
    ),
    # ---- issue 50, item 1: blind break audit, part B. These rows were written BLIND to the tests
    # (a helper that read only README.md, docs/ and the code under train/ and scripts/, never tests/):
    # the tests are chosen by their collected names (pytest --collect-only), not by reading them.
    # B1: sweeps (scripts/sweep.py)
    Break(
        "blind50 B1: a restarted driver resumes the other drivers' interrupted trials, not its own",
        "scripts/sweep.py",
        'if t.user_attrs.get("driver") == self.driver',
        'if t.user_attrs.get("driver") != self.driver',
        (
            "tests/test_sweep_driver.py::test_sigterm_stops_the_driver_with_its_trial_which_the_next_start_resumes",
        ),
    ),
    Break(
        "blind50 B1: a resumed trial is launched without --resume latest (it starts over, or is refused)",
        "scripts/sweep.py",
        'command_now = [*command, "--resume", "latest"]',
        "command_now = command",
        (
            "tests/test_sweep_driver.py::test_sigterm_stops_the_driver_with_its_trial_which_the_next_start_resumes",
        ),
    ),
    Break(
        "blind50 B1: the sampler's seed is not advanced by the trials held: a restarted driver redraws "
        "the first values",
        "scripts/sweep.py",
        'seed = self.space["seed"] + len(self.study.get_trials(deepcopy=False))',
        'seed = self.space["seed"]',
        (
            "tests/test_sweep_driver.py::test_a_random_sweep_draws_what_optunas_sampler_draws_"
            "seeded_by_the_trials_held",
        ),
    ),
    Break(
        "blind50 B1: the sampler is not seeded (seed: in the space does nothing)",
        "scripts/sweep.py",
        "self.study.sampler = kind(seed=seed)",
        "self.study.sampler = kind()",
        (
            "tests/test_sweep_driver.py::test_a_random_sweep_draws_what_optunas_sampler_draws_"
            "seeded_by_the_trials_held",
        ),
    ),
    Break(
        "blind50 B1: a trial the pruner stops gets no SIGTERM (it trains to the end)",
        "scripts/sweep.py",
        "                        self.running.send_signal(signal.SIGTERM)  # it checkpoints and exits 75\n",
        "",
        (
            "tests/test_sweep_driver.py::test_a_failed_trial_is_recorded_once_and_pruned_ones_get_sigterm",
        ),
    ),
    Break(
        "blind50 B1: a pruned trial is recorded as failed",
        "scripts/sweep.py",
        "self.study.tell(trial, state=self.states().PRUNED)",
        "self.study.tell(trial, state=self.states().FAIL)",
        (
            "tests/test_sweep_driver.py::test_a_failed_trial_is_recorded_once_and_pruned_ones_get_sigterm",
        ),
    ),
    Break(
        "blind50 B1: a trial's value is its first eval row's objective, not its last",
        "scripts/sweep.py",
        "self.study.tell(trial, values[-1])",
        "self.study.tell(trial, values[0])",
        (
            "tests/test_sweep_driver.py::test_a_maximize_sweep_takes_each_trial_s_last_eval_and_"
            "calls_the_highest_best",
        ),
    ),
    Break(
        "blind50 B1: a first trial that fails mid-training stops the sweep as if the command were wrong",
        "scripts/sweep.py",
        "if not trained and not self.any_complete():",
        "if not self.any_complete():",
        (
            "tests/test_sweep_driver.py::test_a_failed_trial_is_recorded_once_and_pruned_ones_get_sigterm",
            "tests/test_sweep_driver.py::test_a_launch_command_that_cannot_train_stops_the_sweep_in_one_line",
        ),
    ),
    Break(
        "blind50 B1: a trial preempted under accelerate launch/torchrun (exit 1, preempted.json) is "
        "failed, not requeued",
        "scripts/sweep.py",
        'preempted = code == PREEMPTED_EXIT_CODE or (run_dir / "preempted.json").exists()',
        "preempted = code == PREEMPTED_EXIT_CODE",
        (
            "tests/test_sweep_driver.py::test_a_trial_preempted_under_a_launcher_that_exits_1_"
            "is_resumed_not_failed",
        ),
    ),
    Break(
        "blind50 B1: a maximize study is created minimizing (the space's direction dropped)",
        "scripts/sweep.py",
        '            direction=self.space["direction"],\n',
        "",
        (
            "tests/test_sweep_driver.py::test_a_maximize_sweep_takes_each_trial_s_last_eval_and_"
            "calls_the_highest_best",
        ),
    ),
    Break(
        "blind50 B1: the driver's SIGTERM is not passed to the running trial (it waits for it to finish)",
        "scripts/sweep.py",
        "if self.running is not None and signum == signal.SIGTERM:",
        "if self.running is not None and signum == signal.SIGINT:",
        (
            "tests/test_sweep_driver.py::test_sigterm_stops_the_driver_with_its_trial_which_the_next_start_resumes",
        ),
    ),
    Break(
        "blind50 B1: a killed driver's trial is resumed without waiting for its old workers to let go",
        "scripts/sweep.py",
        "                wait_until_free(run_dir)\n",
        "",
        (
            "tests/test_sweep_driver.py::test_a_restarted_driver_resumes_its_trial_only_once_"
            "the_old_workers_let_go_of_it",
        ),
    ),
    # B2: the profiler window and the restart report
    Break(
        "blind50 B2: a one-step window (--profile_steps 3:3) is refused",
        "train/profiling.py",
        "elif not 1 <= int(start) <= int(end):",
        "elif not 1 <= int(start) < int(end):",
        (
            "tests/test_profiling.py::test_profile_steps_are_checked_in_one_line_naming_the_key",
            "tests/test_profiling.py::test_the_window_s_edges_and_its_refusals_are_exact",
        ),
    ),
    Break(
        "blind50 B2: the window opens a step late (step START is not traced)",
        "train/profiling.py",
        "elif step == self.window[0] - 1:",
        "elif step == self.window[0]:",
        (
            "tests/test_profiling.py::test_the_window_records_its_steps_and_a_start_inside_it_records_the_rest",
            "tests/test_profiling.py::test_the_window_s_edges_and_its_refusals_are_exact",
        ),
    ),
    Break(
        "blind50 B2: the window closes a step late (END + 1 is traced)",
        "train/profiling.py",
        "if step >= self.window[1]:",
        "if step > self.window[1]:",
        (
            "tests/test_profiling.py::test_the_window_records_its_steps_and_a_start_inside_it_records_the_rest",
            "tests/test_profiling.py::test_the_window_s_edges_and_its_refusals_are_exact",
        ),
    ),
    Break(
        "blind50 B2: a run resumed from step START - 1 never opens the window",
        "train/profiling.py",
        "self.window[0] - 1 <= resumed_step < self.window[1]",
        "self.window[0] <= resumed_step < self.window[1]",
        (
            "tests/test_profiling.py::test_a_run_resumed_from_the_step_before_the_window_traces_"
            "all_of_it",
        ),
    ),
    Break(
        "blind50 B2: the trace's name and line give the first step twice (the last step recorded not kept)",
        "train/profiling.py",
        "            self.last_recorded = step\n",
        "",
        (
            "tests/test_profiling.py::test_the_window_records_its_steps_and_a_start_inside_it_records_the_rest",
            "tests/test_profiling.py::test_a_run_says_where_its_traces_went_and_keeps_the_profiler_s_lines_off_the_console",
        ),
    ),
    Break(
        "blind50 B2: a run stopped inside the window writes no trace (the exit's close not registered)",
        "train/profiling.py",
        "        atexit.register(self.close)  # a run stopped inside the window keeps what it recorded\n",
        "",
        (
            "tests/test_profiling.py::test_a_process_that_exits_inside_the_window_writes_the_"
            "steps_it_recorded",
        ),
    ),
    Break(
        "blind50 B2: the profile line's file count and size are the ranks' mean, not their sum",
        "train/profiling.py",
        'files, size = self.plumbing.reduce(mine, "sum").tolist()',
        'files, size = self.plumbing.reduce(mine, "mean").tolist()',
        (
            "tests/e2e/test_tracking_runs.py::test_a_two_process_run_reports_to_wandb_offline_tensorboard_its_restart_report_and_profile",
        ),
        quick=False,
    ),
    Break(
        "blind50 B2: a lap counts the time of the phases nested in it again (phases sum past the start)",
        "train/profiling.py",
        "self._add(name, now - self.last_lap - self.nested)",
        "self._add(name, now - self.last_lap)",
        (
            "tests/test_profiling.py::test_the_start_clock_s_phases_add_up_to_its_time_wherever_they_nest",
        ),
    ),
    Break(
        "blind50 B2: 'start N: X s to the first step' counts from the last lap, not the process's start",
        "train/profiling.py",
        '"start_s": round(time.time() - self.begun, 3)',
        '"start_s": round(time.time() - self.last_lap, 3)',
        (
            "tests/test_profiling.py::test_the_start_clock_s_phases_add_up_to_its_time_wherever_they_nest",
            "tests/test_profiling.py::test_the_restart_line_says_each_phase_the_steps_lost_and_the_compile",
        ),
    ),
    Break(
        "blind50 B2: the restart line says 'resumed at step' on a fresh start and not on a resume",
        "train/profiling.py",
        'if row["resumed_from_step"]:',
        'if not row["resumed_from_step"]:',
        (
            "tests/test_profiling.py::test_the_restart_line_says_each_phase_the_steps_lost_and_the_compile",
        ),
    ),
    Break(
        "blind50 B2: starts are numbered from 0 (the earlier launches, not this one counted)",
        "train/tracking.py",
        '"start": len(launches),',
        '"start": len(previous),',
        (
            "tests/test_tracking.py::test_a_resume_reports_the_steps_trained_past_its_checkpoint_"
            "as_lost",
        ),
    ),
    Break(
        "blind50 B2: a resumed start reports one step lost fewer than it lost",
        "train/tracking.py",
        '"steps_lost": max(0, int(last_logged) - step),',
        '"steps_lost": max(0, int(last_logged) - step - 1),',
        (
            "tests/test_tracking.py::test_a_resume_reports_the_steps_trained_past_its_checkpoint_"
            "as_lost",
        ),
    ),
    # B3: object storage (train/storage.py)
    Break(
        "blind50 B3: the default deadline no longer grows with the bytes moved (1 s per 20 MB dropped)",
        "train/storage.py",
        "return DEADLINE_FLOOR_S + nbytes / SLOWEST_BYTES_PER_S",
        "return DEADLINE_FLOOR_S",
        ("tests/test_storage.py::test_the_default_deadline_is_120_s_plus_1_s_per_20_mb",),
    ),
    Break(
        "blind50 B3: a checkpoint's upload gets the deadline of an empty exchange (its bytes not passed)",
        "train/storage.py",
        'self.bounded(f"the checkpoint of step {step} was not uploaded{INTACT}", put, nbytes)',
        'self.bounded(f"the checkpoint of step {step} was not uploaded{INTACT}", put)',
        ("tests/test_storage.py::test_an_uploads_and_a_downloads_deadline_grow_with_their_bytes",),
    ),
    Break(
        "blind50 B3: after a first store failure every later exchange is tried again (each waits its deadline)",
        "train/storage.py",
        '        if _failures:\n            raise StoreError(_failures[0], cause="")\n',
        "",
        (
            "tests/test_storage.py::test_after_the_store_failed_nothing_more_is_tried_and_the_same_line_comes_at_once",
        ),
    ),
    Break(
        "blind50 B3: the first take of the lease is unconditional (a second job overwrites a live lease)",
        "train/storage.py",
        '        if self.bucket.bounded(lost, lambda: self._put(IfNoneMatch="*")):\n'
        "            return self._keep()\n        seen",
        "        if self.bucket.bounded(lost, lambda: self._put()):\n            return self._keep()\n        seen",
        (
            "tests/e2e/test_object_storage.py::test_a_second_job_on_a_bucket_run_in_use_is_refused_in_one_line_and_the_lease_is_let_go",
        ),
        quick=False,
    ),
    Break(
        "blind50 B3: the takeover of a stale lease is unconditional (both takers win)",
        "train/storage.py",
        "if not self.bucket.bounded(lost, lambda: self._put(IfMatch=etag)):",
        "if not self.bucket.bounded(lost, lambda: self._put()):",
        (
            "tests/e2e/test_object_storage.py::test_two_jobs_taking_over_one_stale_lease_at_once_exactly_one_wins",
        ),
        quick=False,
    ),
    Break(
        "blind50 B3: a lease seen renewed is taken as stale (and an unchanged one refused)",
        "train/storage.py",
        "if seen is not None and now is not None and now[0] != seen[0]:",
        "if seen is not None and now is not None and now[0] == seen[0]:",
        (
            "tests/e2e/test_object_storage.py::test_a_second_job_on_a_bucket_run_in_use_is_refused_in_one_line_and_the_lease_is_let_go",
        ),
        quick=False,
    ),
    Break(
        "blind50 B3: the lease is renewed every store_lease_s, not every third of it (a live run looks stale)",
        "train/storage.py",
        "while not self.done.wait(self.lease_s / 3):",
        "while not self.done.wait(self.lease_s):",
        ("tests/test_storage.py::test_the_lease_is_renewed_every_third_of_store_lease_s",),
    ),
    Break(
        "blind50 B3: a job's end does not delete its lease (the next job waits store_lease_s)",
        "train/storage.py",
        "        deleting.start()\n        deleting.join(timeout=LEASE_RELEASE_S)\n",
        "",
        (
            "tests/e2e/test_object_storage.py::test_a_second_job_on_a_bucket_run_in_use_is_refused_in_one_line_and_the_lease_is_let_go",
        ),
        quick=False,
    ),
    Break(
        "blind50 B3: a commit does not check that every expected file arrived",
        "train/storage.py",
        "missing = [name for name in expected if name not in files]",
        "missing = []",
        ("tests/test_storage.py::test_a_commit_checks_every_listing_and_every_expected_file",),
    ),
    Break(
        "blind50 B3: a commit merges rank 0's listing only",
        "train/storage.py",
        'listings = [f"{folder}/{UPLOADED}/rank{rank}.json" for rank in range(world_size)]',
        'listings = [f"{folder}/{UPLOADED}/rank{rank}.json" for rank in range(1)]',
        (
            "tests/test_storage.py::test_a_commit_names_a_process_whose_upload_never_arrived",
            "tests/test_storage.py::test_a_commit_checks_every_listing_and_every_expected_file",
        ),
    ),
    Break(
        "blind50 B3: the final upload's failure does not say how to finish the job (at_the_end dropped)",
        "train/storage.py",
        "self.bucket.upload_run_files(str(self.local), at_the_end=at_the_end)",
        "self.bucket.upload_run_files(str(self.local))",
        (
            "tests/e2e/test_object_storage.py::test_a_store_gone_during_the_final_upload_names_the_export_on_disk_and_the_command",
        ),
        quick=False,
    ),
    Break(
        "blind50 B3: pruning keeps one committed checkpoint more than keep_last",
        "train/storage.py",
        "for name in committed[:-keep_last]:",
        "for name in committed[: -keep_last - 1]:",
        (
            "tests/test_storage.py::test_a_checkpoint_on_object_storage_is_committed_by_its_manifest_and_pruned_manifest_first[False]",
            "tests/test_storage.py::test_a_checkpoint_on_object_storage_is_committed_by_its_manifest_and_pruned_manifest_first[True]",
        ),
    ),
    Break(
        "blind50 B3: pruning deletes a checkpoint's files before its manifest",
        "train/storage.py",
        '                self.fs.rm(f"{self._step(name)}/{MANIFEST}")\n',
        "",
        ("tests/test_storage.py::test_pruning_deletes_a_checkpoints_manifest_before_its_files",),
    ),
    Break(
        "blind50 B3: a resume downloads the oldest committed checkpoint, not the newest",
        "train/storage.py",
        "for name in reversed(self.committed()):",
        "for name in self.committed():",
        (
            "tests/test_storage.py::test_a_resume_skips_a_damaged_checkpoint_with_a_warning_and_takes_the_one_before",
            "tests/test_storage.py::test_a_download_empties_the_local_folder_and_logs_its_size_and_time",
        ),
    ),
    # B4: the hang watch (train/hangs.py)
    Break(
        "blind50 B4: after the first step training keeps the long dist_timeout_s (a hang is caught in 30 min)",
        "train/hangs.py",
        "        if not self.training and self.store is not None:\n"
        "            set_collective_timeout(self.cfg.step_timeout_s)\n",
        "        if not self.training and self.store is not None:\n"
        "            set_collective_timeout(self.cfg.dist_timeout_s)\n",
        (
            "tests/test_hang_watch.py::test_a_save_or_the_export_waits_the_long_timeout_and_training_gets_step_timeout_back",
        ),
    ),
    Break(
        "blind50 B4: a save waits the short step_timeout_s (a slow write is called a hang)",
        "train/hangs.py",
        "set_collective_timeout(self.cfg.dist_timeout_s)",
        "set_collective_timeout(self.cfg.step_timeout_s)",
        (
            "tests/test_hang_watch.py::test_a_save_or_the_export_waits_the_long_timeout_and_training_gets_step_timeout_back",
        ),
    ),
    Break(
        "blind50 B4: the hang note's step is the previous step (at() off by one)",
        "train/hangs.py",
        "self.note.update(step=self.completed + 1, phase=phase)",
        "self.note.update(step=self.completed, phase=phase)",
        (
            "tests/test_hang_watch.py::test_a_rank_s_hang_note_names_the_step_it_is_training_"
            "and_is_written_to_its_file",
        ),
    ),
    Break(
        "blind50 B4: the steps done are never counted: every note says step 1",
        "train/hangs.py",
        "        self.completed = step\n",
        "",
        (
            "tests/test_hang_watch.py::test_a_rank_s_hang_note_names_the_step_it_is_training_"
            "and_is_written_to_its_file",
        ),
    ),
    Break(
        "blind50 B4: the straggler's median includes the slowest rank itself",
        "train/hangs.py",
        "median = statistics.median(alone[:slowest] + alone[slowest + 1 :])",
        "median = statistics.median(alone)",
        (
            "tests/test_hang_watch.py::test_a_straggler_is_named_only_when_it_is_slower_by_the_factor_and_costs_time",
        ),
    ),
    Break(
        "blind50 B4: a straggler is named when it costs 0.1 s OR 10% (and, dropped)",
        "train/hangs.py",
        "costly = lag_s > STRAGGLER_MIN_S and lag_s > STRAGGLER_COST * window_s",
        "costly = lag_s > STRAGGLER_MIN_S or lag_s > STRAGGLER_COST * window_s",
        (
            "tests/test_hang_watch.py::test_a_slower_rank_that_costs_under_a_tenth_of_the_window_"
            "is_no_straggler",
        ),
    ),
    Break(
        "blind50 B4: straggler_factor dropped: any slower rank that costs time is named",
        "train/hangs.py",
        "if alone[slowest] > self.cfg.straggler_factor * median and costly:",
        "if alone[slowest] > median and costly:",
        (
            "tests/test_hang_watch.py::test_a_straggler_is_named_only_when_it_is_slower_by_the_factor_and_costs_time",
        ),
    ),
    Break(
        "blind50 B4: the ranks' times are not reset after a logging step (they add up over the run)",
        "train/hangs.py",
        "        self.alone_s = dict.fromkeys(self.alone_s, 0.0)\n",
        "",
        (
            "tests/test_hang_watch.py::test_a_straggler_is_named_only_when_it_is_slower_by_the_factor_and_costs_time",
            "tests/test_hang_watch.py::test_each_rank_s_own_data_and_forward_times_fill_its_row_of_the_straggler_table",
        ),
    ),
    Break(
        "blind50 B4: the timeout line names the waiting ranks as 'did not arrive' and not the late one",
        "train/hangs.py",
        'elif not note.get("waiting_in_a_collective"):',
        'elif note.get("waiting_in_a_collective"):',
        (
            "tests/test_hang_watch.py::test_the_line_names_the_ranks_that_did_not_arrive_and_where_they_were",
        ),
    ),
    Break(
        "blind50 B4: the timeout line quotes dist_timeout_s as the step timeout",
        "train/hangs.py",
        'how = f"timed out (step_timeout_s {watch.cfg.step_timeout_s})"',
        'how = f"timed out (step_timeout_s {watch.cfg.dist_timeout_s})"',
        (
            "tests/test_hang_watch.py::test_the_line_names_the_ranks_that_did_not_arrive_and_where_they_were",
        ),
    ),
    Break(
        "blind50 B4: NCCL's 'Watchdog caught collective operation timeout' is read as a lost peer",
        "train/hangs.py",
        'return "timed out" in message or "timeout" in message',
        'return "timed out" in message',
        ("tests/test_hang_watch.py::test_nccl_s_watchdog_timeout_is_a_timeout_not_a_lost_peer",),
    ),
    Break(
        "blind50 B4: the lost-peer line names the ranks that answered, not the silent ones",
        "train/hangs.py",
        "silent = [rank for rank in range(watch.world_size) if rank not in notes]",
        "silent = [rank for rank in range(watch.world_size) if rank in notes]",
        (
            "tests/test_hang_watch.py::test_a_lost_peer_is_named_lost_and_a_live_rank_elsewhere_is_not_named",
        ),
    ),
    Break(
        "blind50 B4: no hangs/rank{r}.json is written (the note goes to the store only)",
        "train/hangs.py",
        '        (folder / f"rank{self.rank}.json").write_text(encoded + "\\n")\n',
        "",
        (
            "tests/test_hang_watch.py::test_a_rank_s_hang_note_names_the_step_it_is_training_"
            "and_is_written_to_its_file",
        ),
    ),
    # B5: FSDP settings on the torch path (train/torch_ddp.py, train/sharding.py, train/blocks.py)
    Break(
        "blind50 B5: torch path FSDP under bf16 reduces gradients in bf16 (reduce_dtype dropped)",
        "train/torch_ddp.py",
        "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)",
        "MixedPrecisionPolicy(param_dtype=torch.bfloat16)",
        (
            "tests/test_sharding.py::test_every_fsdp_unit_on_the_torch_path_gets_torch_s_own_"
            "policy_for_the_precision",
        ),
    ),
    Break(
        "blind50 B5: torch path FSDP under bf16 computes in fp32 (param_dtype dropped)",
        "train/torch_ddp.py",
        "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)",
        "MixedPrecisionPolicy(reduce_dtype=torch.float32)",
        (
            "tests/test_sharding.py::test_every_fsdp_unit_on_the_torch_path_gets_torch_s_own_"
            "policy_for_the_precision",
        ),
    ),
    Break(
        "blind50 B5: torch path FSDP: the bf16 policy is applied when the run is NOT bf16",
        "train/torch_ddp.py",
        '            if self.mixed_precision == "bf16"\n            else MixedPrecisionPolicy()',
        '            if self.mixed_precision != "bf16"\n            else MixedPrecisionPolicy()',
        (
            "tests/test_sharding.py::test_every_fsdp_unit_on_the_torch_path_gets_torch_s_own_"
            "policy_for_the_precision",
        ),
    ),
    Break(
        "blind50 B5: torch path FSDP: the blocks are not units of their own (the root alone is sharded)",
        "train/torch_ddp.py",
        "            fully_shard(block, mesh=mesh, mp_policy=policy)\n",
        "            pass\n",
        (
            "tests/test_sharding.py::test_fsdp_shards_each_block_and_the_root_and_the_optimizer_steps_the_shards_with_checkpointing",
        ),
    ),
    Break(
        "blind50 B5: torch path FSDP: the blocks get no mixed-precision policy (fp32 blocks under bf16)",
        "train/torch_ddp.py",
        "            fully_shard(block, mesh=mesh, mp_policy=policy)\n",
        "            fully_shard(block, mesh=mesh)\n",
        (
            "tests/test_sharding.py::test_every_fsdp_unit_on_the_torch_path_gets_torch_s_own_"
            "policy_for_the_precision",
        ),
    ),
    Break(
        "blind50 B5: torch path FSDP: blocks keep their gathered weights after forward (reshard off)",
        "train/torch_ddp.py",
        "            fully_shard(block, mesh=mesh, mp_policy=policy)\n",
        "            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=False)\n",
        (
            "tests/test_sharding.py::test_after_a_forward_each_block_on_the_torch_path_is_back_"
            "to_its_shards",
        ),
    ),
    Break(
        "blind50 B5: the optimizer steps the unsharded parameters fully_shard replaced (the model never trains)",
        "train/torch_ddp.py",
        'group["params"] = [sharded[names[id(p)]] for p in group["params"]]',
        "pass",
        (
            "tests/test_sharding.py::test_fsdp_shards_each_block_and_the_root_and_the_optimizer_steps_the_shards_with_checkpointing",
        ),
    ),
    Break(
        "blind50 B5: --fsdp hybrid's mesh has its dimensions swapped (nodes x processes per node reversed)",
        "train/sharding.py",
        'return (num_processes // per_node, per_node), ("replicate", "shard")',
        'return (per_node, num_processes // per_node), ("replicate", "shard")',
        (
            "tests/test_sharding.py::test_fsdp_on_main_py_under_torchrun_is_the_accelerate_config_s_fsdp[hybrid-2node_hsdp.yaml]",
            "tests/test_launch_configs.py::test_the_fsdp_configs_launch_fsdp2_sharded_by_the_models_blocks[2node_hsdp.yaml-2-8]",
        ),
    ),
    Break(
        "blind50 B5: --fsdp hybrid reads WORLD_SIZE as a node's processes (it shards over all: full)",
        "train/sharding.py",
        'per_node = int(os.environ.get("LOCAL_WORLD_SIZE", num_processes))',
        'per_node = int(os.environ.get("WORLD_SIZE", num_processes))',
        (
            "tests/test_sharding.py::test_fsdp_on_main_py_under_torchrun_is_the_accelerate_config_s_fsdp[hybrid-2node_hsdp.yaml]",
            "tests/test_launch_configs.py::test_the_fsdp_configs_launch_fsdp2_sharded_by_the_models_blocks[2node_hsdp.yaml-2-8]",
        ),
    ),
    Break(
        "blind50 B5: Accelerate's FSDP under bf16 reduces gradients in bf16 (reduce_dtype dropped)",
        "train/sharding.py",
        "param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.bfloat16",
        "param_dtype=torch.bfloat16, output_dtype=torch.bfloat16",
        (
            "tests/test_sharding.py::test_accelerates_fsdp_reduces_gradients_in_fp32_under_bf16_as_the_torch_path_does",
        ),
    ),
    Break(
        "blind50 B5: Accelerate's --fsdp plugin does not reshard after forward",
        "train/sharding.py",
        "        reshard_after_forward=True,\n",
        "        reshard_after_forward=False,\n",
        (
            "tests/test_launch_configs.py::test_the_fsdp_configs_launch_fsdp2_sharded_by_the_models_blocks[fsdp_8gpu.yaml-None-None]",
            "tests/test_sharding.py::test_fsdp_on_main_py_under_torchrun_is_the_accelerate_config_s_fsdp[full-fsdp_8gpu.yaml]",
        ),
    ),
    Break(
        "blind50 B5: blocks are found by their exact class only (a sharded FSDPBlock is not a block)",
        "train/blocks.py",
        "if names & {cls.__name__ for cls in type(module).__mro__}",
        "if type(module).__name__ in names",
        (
            "tests/test_sharding.py::test_fsdp_shards_each_block_and_the_root_and_the_optimizer_steps_the_shards_with_checkpointing",
            "tests/test_lm.py::test_a_model_without_named_blocks_cannot_be_checkpointed_or_sharded_and_says_why",
        ),
    ),
    # B6: Ray and the job scripts
    Break(
        "blind50 B6: Ray: each child's LOCAL_RANK is its world rank",
        "scripts/ray/train.py",
        '"LOCAL_RANK": str(context.get_local_rank()),',
        '"LOCAL_RANK": str(rank),',
        ("tests/test_ray_worker.py",),
    ),
    Break(
        "blind50 B6: Ray: LOCAL_WORLD_SIZE is the world size (hybrid sharding sees one node)",
        "scripts/ray/train.py",
        '"LOCAL_WORLD_SIZE": str(context.get_local_world_size()),',
        '"LOCAL_WORLD_SIZE": str(context.get_world_size()),',
        ("tests/test_ray_worker.py",),
    ),
    Break(
        "blind50 B6: Ray: every child is told it is on node 0 (GROUP_RANK)",
        "scripts/ray/train.py",
        '"GROUP_RANK": str(context.get_node_rank()),',
        '"GROUP_RANK": "0",',
        ("tests/test_ray_worker.py",),
    ),
    Break(
        "blind50 B6: Ray: rank 0's port is not sent to the others (their process group never forms)",
        "scripts/ray/train.py",
        "    dist.broadcast_object_list(port, src=0)\n",
        "",
        ("tests/test_ray_worker.py::test_every_rank_s_child_gets_the_port_rank_0_found_free",),
    ),
    Break(
        "blind50 B6: Ray: a restarted worker group does not resume (--resume latest dropped)",
        "scripts/ray/train.py",
        '"args": [*train_args, "--resume", "latest"],',
        '"args": train_args,',
        (
            "tests/test_engines.py::test_the_ray_script_refuses_a_bad_flag_in_one_line_before_ray_starts",
            "tests/e2e/test_ray.py::test_a_worker_killed_under_ray_is_restarted_and_the_run_resumes_bitwise",
        ),
        quick=False,
    ),
    Break(
        "blind50 B6: Ray: --max_failures is ignored (Ray's default: no restart)",
        "scripts/ray/train.py",
        "failure_config=ray.train.FailureConfig(max_failures=args.max_failures)",
        "failure_config=ray.train.FailureConfig()",
        (
            "tests/e2e/test_ray.py::test_a_worker_killed_under_ray_is_restarted_and_the_run_resumes_bitwise",
        ),
        quick=False,
    ),
    Break(
        "blind50 B6: torchrun_job.sh looks for preempted.json in OUTPUT_DIR, not the staging folder "
        "(s3: exit 1, not 75)",
        "scripts/torchrun_job.sh",
        'if [ -f "$run_dir/preempted.json" ]; then',
        'if [ -f "$OUTPUT_DIR/preempted.json" ]; then',
        (
            "tests/test_engines.py::test_on_object_storage_a_stop_that_torchrun_reports_as_1_"
            "is_75_from_the_staging_folder",
        ),
    ),
    Break(
        "blind50 B6: torchrun_job.sh does not pass SIGTERM on to torchrun",
        "scripts/torchrun_job.sh",
        "trap 'stopped_on=SIGTERM; kill -TERM \"$launcher\" 2>/dev/null' TERM",
        "trap 'stopped_on=SIGTERM' TERM",
        ("tests/test_engines.py::test_the_job_script_passes_sigterm_on_and_a_stop_exits_75",),
    ),
    Break(
        "blind50 B6: torchrun_job.sh stops waiting at the signal, before torchrun has exited",
        "scripts/torchrun_job.sh",
        '    kill -0 "$launcher" 2>/dev/null || break\n',
        "    break\n",
        ("tests/test_engines.py::test_the_job_script_passes_sigterm_on_and_a_stop_exits_75",),
    ),
    Break(
        "blind50 B6: torchrun_job.sh exits 0 whatever torchrun said",
        "scripts/torchrun_job.sh",
        'exit "$code"',
        "exit 0",
        (
            "tests/test_engines.py::test_the_job_script_keeps_torchrun_s_code_when_the_run_did_not_stop_on_a_signal",
        ),
    ),
    Break(
        "blind50 B6: torchrun_job.sh gives torchrun no rendezvous timeout (RDZV_TIMEOUT_S ignored: 600 s)",
        "scripts/torchrun_job.sh",
        'torchrun --rdzv-conf "timeout=$RDZV_TIMEOUT_S" train/main.py',
        "torchrun train/main.py",
        (
            "tests/e2e/test_engine_runs.py::test_a_node_that_never_joins_is_said_while_waiting_and_in_one_line_at_the_timeout[0]",
        ),
        quick=False,
    ),
    Break(
        "blind50 B6: rendezvous.py never counts the last node (says N-1 of N joined)",
        "scripts/rendezvous.py",
        'joined = sum(store.check([f"{KEY}{i}"]) for i in range(nodes))',
        'joined = sum(store.check([f"{KEY}{i}"]) for i in range(nodes - 1))',
        (
            "tests/test_engines.py::test_the_rendezvous_watcher_counts_every_node_s_key_the_last_"
            "one_included",
        ),
    ),
    Break(
        "blind50 B6: SLURM: the rendezvous is on the last node of the allocation, not the first",
        "scripts/slurm/job_env.sh",
        "| head -n 1)   # rendezvous on the first node",
        "| tail -n 1)   # rendezvous on the first node",
        ("tests/test_slurm.py::test_torchrun_script_uses_c10d_rendezvous_on_the_first_node",),
    ),
    Break(
        "blind50 B6: SLURM: SIGUSR1 is not passed on by the launchers (--signal=USR1@300 kills the launcher)",
        "scripts/slurm/job_env.sh",
        "export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        "export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        (
            "tests/test_slurm.py::test_each_launcher_handles_the_signal_the_sbatch_directive_"
            "asks_slurm_for",
        ),
    ),
    Break(
        "blind50 B6: SLURM: every accelerate launcher says it is machine 0",
        "scripts/slurm/accelerate_2node.sbatch",
        '--machine_rank "$SLURM_NODEID"',
        "--machine_rank 0",
        ("tests/test_slurm.py::test_accelerate_script_starts_one_launcher_per_node",),
    ),
    Break(
        "blind50 B6: Kubernetes: a pod stopped on a signal (exit 75) counts as a failure",
        "scripts/kubernetes/jobset.yaml",
        "                  values: [75]",
        "                  values: [1]",
        (
            "tests/test_engines.py::test_the_jobset_restarts_a_stopped_pod_without_counting_it_and_keeps_its_run_folder",
        ),
    ),
    Break(
        "blind50 B6: SkyPilot: the rendezvous address is the last node's IP",
        "scripts/skypilot/train.yaml",
        'echo "$SKYPILOT_NODE_IPS" | head -n1',
        'echo "$SKYPILOT_NODE_IPS" | tail -n1',
        (
            "tests/test_engines.py::test_the_skypilot_task_maps_its_variables_to_torchrun_s_and_recovers_a_stop",
        ),
    ),
    Break(
        "blind50 B6: SkyPilot: a stop (exit 75) is not recovered",
        "scripts/skypilot/train.yaml",
        "recover_on_exit_codes: [75]",
        "recover_on_exit_codes: []",
        (
            "tests/test_engines.py::test_the_skypilot_task_maps_its_variables_to_torchrun_s_and_recovers_a_stop",
        ),
    ),
    # ---- issue 52, "Done means": blind break audit of the RL example. These rows were written BLIND
    # to the tests (a helper that read only the issue, README, examples/rl/, train/task.py's rollout,
    # train/chat.py and scripts/sort_words_task.py; the tests' names from --collect-only, never their text).
    Break(
        "blind52: advantages normalised over the wrong rows (view(G, -1): strided groups, not a prompt's G)",
        "examples/rl/model.py",
        'rewards = group["rewards"].view(-1, cfg.num_generations)',
        'rewards = group["rewards"].view(cfg.num_generations, -1)',
        (
            "tests/test_rl.py::test_advantages_are_each_group_s_rewards_against_its_mean[group]",
            "tests/test_rl.py::test_advantages_are_each_group_s_rewards_against_its_mean[batch]",
            "tests/test_rl.py::test_advantages_are_each_group_s_rewards_against_its_mean[none]",
        ),
    ),
    Break(
        "blind52: the old log-probs are the policy's now, not generation's (updates_per_rollout > 1 never clips)",
        "examples/rl/model.py",
        'old = batch["old_logps"] if cfg.updates_per_rollout > 1 else logps.detach()',
        "old = logps.detach()",
        (
            "tests/test_rl.py::test_each_loss_and_its_gradient_equal_the_formula_in_float64[grpo-2-0.1]",
            "tests/test_rl.py::test_each_loss_and_its_gradient_equal_the_formula_in_float64[dapo-2-0.1]",
            "tests/test_rl.py::test_each_loss_and_its_gradient_equal_the_formula_in_float64[dr_grpo-2-0.1]",
            "tests/test_rl.py::test_updates_per_rollout_reuses_a_rollout_and_generates_at_its_steps",
        ),
    ),
    Break(
        "blind52: the sampling seed leaves out the step (every step draws the same random numbers)",
        "examples/rl/model.py",
        "rollout_seed(cfg.seed, step, prompt, g)",
        "rollout_seed(cfg.seed, 0, prompt, g)",
        (
            "tests/test_rl.py::test_the_same_seed_step_and_prompt_give_the_same_tokens_and_leave_the_rng_alone",
            "tests/test_rl.py::test_updates_per_rollout_reuses_a_rollout_and_generates_at_its_steps",
        ),
    ),
    Break(
        "blind52: grpo sums the completions' token means where it should average them (G x batch too large)",
        "examples/rl/model.py",
        "loss = (summed.sum(-1) / mask.sum(-1).clamp(min=1)).mean()",
        "loss = (summed.sum(-1) / mask.sum(-1).clamp(min=1)).sum()",
        (
            "tests/test_rl.py::test_each_loss_and_its_gradient_equal_the_formula_in_float64[grpo-1-0.0]",
            "tests/test_rl.py::test_a_step_over_micro_batches_and_ranks_is_the_formula_over_the_whole_step[grpo]",
        ),
    ),
    Break(
        "blind52: dapo's items count completions, so its normaliser is per micro-batch's tokens, not the step's",
        "examples/rl/model.py",
        'counted = group["mask"].sum() if cfg.rl_loss == "dapo" else len(group["rewards"])',
        'counted = len(group["rewards"])',
        (
            "tests/test_rl.py::test_a_step_over_micro_batches_and_ranks_is_the_formula_over_the_whole_step[dapo]",
            "tests/test_rl.py::test_a_completion_counts_up_to_and_with_its_end_of_turn_and_items_count_the_"
            "loss_s[dapo]",
        ),
    ),
    Break(
        "blind52: the clip's upper side uses epsilon, not epsilon_high (DAPO's clip-higher ignored)",
        "examples/rl/model.py",
        "ratio.clamp(1 - cfg.epsilon, 1 + cfg.epsilon_high)",
        "ratio.clamp(1 - cfg.epsilon, 1 + cfg.epsilon)",
        (
            "tests/test_rl.py::test_each_loss_and_its_gradient_equal_the_formula_in_float64[grpo-2-0.1]",
            "tests/test_rl.py::test_each_loss_and_its_gradient_equal_the_formula_in_float64[dapo-2-0.1]",
            "tests/test_rl.py::test_each_loss_and_its_gradient_equal_the_formula_in_float64[dr_grpo-2-0.1]",
        ),
    ),
    Break(
        "blind52: the k3 KL's log-ratio has its sign flipped (log pi/ref, not log ref/pi)",
        "examples/rl/model.py",
        'to_reference = batch["ref_logps"] - logps',
        'to_reference = logps - batch["ref_logps"]',
        (
            "tests/test_rl.py::test_each_loss_and_its_gradient_equal_the_formula_in_float64[grpo-2-0.1]",
            "tests/test_rl.py::test_each_loss_and_its_gradient_equal_the_formula_in_float64[dapo-2-0.1]",
            "tests/test_rl.py::test_each_loss_and_its_gradient_equal_the_formula_in_float64[dr_grpo-2-0.1]",
        ),
    ),
    Break(
        "blind52: the completion mask stops one short: the end-of-turn token is not trained",
        "train/chat.py",  # up_to_the_end, which the RL example imports
        "ended_before = is_end.cumsum(-1) - is_end",
        "ended_before = is_end.cumsum(-1)",
        (
            "tests/test_rl.py::test_a_completion_counts_up_to_and_with_its_end_of_turn_and_items_count_the_"
            "loss_s[grpo]",
        ),
    ),
    Break(
        "blind52: --reward_weights' weights are ignored (every reward function weighs 1)",
        "examples/rl/model.py",
        "return sum(weight * scores[name] for name, weight in rl.weights.items())",
        "return sum(scores[name] for name in rl.weights)",
        (
            "tests/test_rl.py::test_advantages_are_each_group_s_rewards_against_its_mean[group]",
            "tests/test_rl.py::test_advantages_are_each_group_s_rewards_against_its_mean[none]",
            "tests/test_rl.py::test_the_eval_is_each_prompt_s_greedy_completion_scored_over_exactly_the_eval_set",
        ),
    ),
    Break(
        "blind52: the eval samples (seed 0) instead of taking the greedy completion",
        "examples/rl/model.py",
        "rl, seeds=None)",
        'rl, seeds=[0] * batch["prompt_ids"].size(0))',
        (
            "tests/test_rl.py::test_the_eval_is_each_prompt_s_greedy_completion_scored_over_exactly_the_eval_set",
        ),
    ),
    Break(
        "blind52: the eval's pass_rate counts same_words (the format), not exact_answer",
        "examples/rl/model.py",
        'PASS = "exact_answer"',
        'PASS = "same_words"',
        (
            "tests/test_rl.py::test_the_eval_is_each_prompt_s_greedy_completion_scored_over_exactly_the_eval_set",
        ),
    ),
    Break(
        "blind52: the step's totals are not all-reduced (batch std, logged reward over this rank only)",
        "examples/rl/model.py",
        "        dist.all_reduce(shared)\n",
        "",
        (
            "tests/test_rl.py::test_advantages_are_each_group_s_rewards_against_its_mean[batch]",
            "tests/e2e/test_rl_runs.py::test_it_logs_its_rollouts_each_step_and_its_eval_is_the_export_s_"
            "greedy_count",
        ),
        quick=False,
    ),
    Break(
        "blind52: the training forward drops left padding's positions (rows count from the padding)",
        "examples/rl/model.py",
        "position_ids=positions)",
        "position_ids=None)",
        (
            "tests/test_rl.py::test_the_log_probs_recorded_at_generation_are_the_current_policy_s",
            "tests/test_rl.py::test_each_loss_and_its_gradient_equal_the_formula_in_float64[grpo-1-0.0]",
        ),
    ),
    Break(
        "blind52: with LoRA the reference pass keeps the adapters on (the reference is the policy, KL 0)",
        "examples/rl/model.py",
        "    with adapters_off(policy):\n",
        "    with torch.no_grad():\n",
        (
            "tests/test_rl.py::test_with_lora_the_reference_is_the_base_model_loaded_fresh_after_the_adapters_"
            "moved",
            "tests/test_rl.py::test_each_loss_and_its_gradient_equal_the_formula_in_float64[grpo-2-0.1]",
            "tests/test_rl.py::test_each_loss_and_its_gradient_equal_the_formula_in_float64[dapo-2-0.1]",
            "tests/e2e/test_rl_runs.py::test_under_fsdp2_ranks_of_different_lengths_finish_and_the_reference_"
            "never_drifts",
        ),
        quick=False,
    ),
    Break(
        "rl e2e: under FSDP2 generate runs without synced_gpus (a rank whose completions end first stops "
        "its decode forwards: the others hang in the all-gather)",
        "train/chat.py",
        "synced_gpus=sharded(model),",
        "synced_gpus=False,",
        (
            "tests/e2e/test_rl_runs.py::test_under_fsdp2_ranks_of_different_lengths_finish_and_the_reference_"
            "never_drifts",
        ),
        quick=False,
    ),
    Break(
        "rl e2e: the reference is the policy itself, not a frozen copy (it moves with training: KL stays 0)",
        "examples/rl/model.py",
        "frozen = frozen_copy(model) if cfg.beta > 0",
        "frozen = model if cfg.beta > 0",
        (
            "tests/e2e/test_rl_runs.py::test_under_fsdp2_ranks_of_different_lengths_finish_and_the_reference_"
            "never_drifts",
        ),
        quick=False,
    ),
    # ---- issue 52 item 3: RL sampling that does not depend on the layout (each completion its own
    # seed from (seed, step, prompt index, g), Gumbel-max noise from its own generator)
    Break(
        "layout52: the rank back in the sampling seed (another world size samples other completions)",
        "examples/rl/model.py",
        "rollout_seed(cfg.seed, step, prompt, g)",
        'rollout_seed(cfg.seed, step, f"{dist.get_rank() if dist.is_initialized() else 0}/{prompt}", g)',
        (
            "tests/e2e/test_rl_runs.py::test_one_process_of_4_prompts_samples_and_trains_as_two_"
            "processes_of_2",
        ),
        quick=False,
    ),
    Break(
        "layout52: one generator (the first row's) draws the whole batch's noise",
        "examples/rl/model.py",
        "        uniforms = torch.stack(\n"
        "            [\n"
        "                torch.rand(scores.size(-1), generator=generator, device=scores.device)\n"
        "                for generator in self.generators\n"
        "            ]\n"
        "        )\n",
        "        uniforms = torch.rand(scores.shape, generator=self.generators[0], device=scores.device)\n",
        (
            "tests/test_rl.py::test_each_sampled_token_is_the_argmax_of_its_log_probs_plus_its_own_seed_"
            "s_gumbel_noise",
            "tests/test_rl.py::test_a_prompt_samples_the_same_tokens_alone_and_in_a_batch_at_another_row",
        ),
    ),
    Break(
        "layout52: the noise does not advance per token (each row's generator seeded anew each step)",
        "examples/rl/model.py",
        "        if self.generators is None:  # on the device of the scores, at the first token\n",
        "        if True:\n",
        (
            "tests/test_rl.py::test_each_sampled_token_is_the_argmax_of_its_log_probs_plus_its_own_seed_"
            "s_gumbel_noise",
            "tests/test_rl.py::test_gumbel_max_samples_the_tempered_top_p_distribution",
        ),
    ),
    Break(
        "layout52: the prompt index is the row's place in its micro-batch, not the prompt's in its split",
        "examples/rl/model.py",
        'for prompt in batch["prompt_index"].tolist()',
        'for prompt in range(batch["prompt_ids"].size(0))',
        (
            "tests/test_rl.py::test_a_prompt_samples_the_same_tokens_alone_and_in_a_batch_at_another_row",
            "tests/test_rl.py::test_the_same_seed_step_and_prompt_give_the_same_tokens_and_leave_the_rng_alone",
        ),
    ),
    # ---- blind audit (issue 52): eval columns from generated text (generate_columns, chat.greedy,
    # the chat example's answer_exact, the RL eval), written without reading tests/
    Break(
        "blind52g task: generate_columns gets the DDP-wrapped model (model.rl, generate: AttributeError under DDP)",
        "train/task.py",
        "return generated(unwrapped(model), batch, cfg)",
        "return generated(model, batch, cfg)",
        (
            "tests/test_task.py::test_generate_columns_join_the_forward_s_columns_on_the_model_itself",
        ),
    ),
    Break(
        "blind52g task: unwrapped takes DDP off but not torch.compile's wrapper (sharded() false under compile)",
        "train/task.py",
        "        if inner is None:  # not `or`: a compiled module's truth is its len(), which raises\n"
        '            inner = getattr(model, "_orig_mod", None)\n',
        "",
        (
            "tests/test_task.py::test_generate_columns_join_the_forward_s_columns_on_the_model_itself",
            "tests/test_task.py::test_the_fork_s_generate_columns_gets_the_model_itself_from_under_compile_and_ddp",
        ),
    ),
    Break(
        "blind52g task: the forward still runs on eval batches of a task that only generates (RL's prompts)",
        "train/task.py",
        "    columns = eval_columns(model(**batch), batch) if teacher_forced() else {}\n",
        "    output = model(**batch)\n    columns = eval_columns(output, batch) if teacher_forced() else {}\n",
        (
            "tests/test_task.py::test_an_eval_that_only_generates_needs_no_eval_columns_and_no_forward",
            "tests/test_rl.py::test_the_eval_is_each_prompt_s_greedy_completion_scored_over_exactly_the_eval_set",
        ),
    ),
    Break(
        "blind52g task: batch_columns drops generate_columns' columns (no eval_answer_exact, RL's eval empty)",
        "train/task.py",
        "    return {**columns, **generate_columns(model, batch, cfg)}\n",
        "    return columns\n",
        (
            "tests/test_task.py::test_generate_columns_join_the_forward_s_columns_on_the_model_itself",
            "tests/e2e/test_rl_runs.py::test_the_sft_run_s_answer_exact_is_the_export_s_own_greedy_count_turn_by_turn",
        ),
        quick=False,
    ),
    Break(
        "blind52g task: a fork with generate_columns and no eval_columns is refused at start-up",
        "train/task.py",
        '        del required["model"]["eval_columns"]\n',
        "",
        (
            "tests/test_task.py::test_an_eval_that_only_generates_needs_no_eval_columns_and_no_forward",
        ),
    ),
    Break(
        "blind52g task: generate_columns(model, batch) without cfg passes the start-up's signature check",
        "train/task.py",
        'takes(generates, ("model", "batch", "cfg"))',
        'takes(generates, ("model", "batch"))',
        (
            "tests/test_task.py::test_generate_columns_that_take_other_arguments_is_one_line_at_start_up",
        ),
    ),
    Break(
        "blind52g task: generate_columns' shapes unchecked at start-up when eval_columns exists too",
        "train/task.py",
        "if generated or not forward:",
        "if not forward:",
        (
            "tests/test_task.py::test_generate_columns_that_break_the_contract_are_one_line_at_start_up",
        ),
    ),
    Break(
        "blind52g task: one column named by both eval_columns and generate_columns is not refused (one silently wins)",
        "train/task.py",
        "        if both:\n",
        "        if len(both) > 1:\n",
        (
            "tests/test_task.py::test_generate_columns_that_break_the_contract_are_one_line_at_start_up",
        ),
    ),
    Break(
        "blind52g task: a generate-only task's loss_items is not checked at start-up (traceback at step 1)",
        "train/task.py",
        "    check_loss_items(batch)\n"
        "    if not forward:  # no forward on eval batches: the training batches' .loss is the step's\n"
        "        return\n",
        "    if not forward:  # no forward on eval batches: the training batches' .loss is the step's\n"
        "        return\n"
        "    check_loss_items(batch)\n",
        (
            "tests/test_task.py::test_an_eval_that_only_generates_needs_no_eval_columns_and_no_forward",
            "tests/test_task.py::test_loss_items_that_fail_or_do_not_count_are_whole_lines",
            "tests/test_task.py::test_loss_items_must_count_one_whole_number",
            "tests/test_task.py::test_a_task_that_only_generates_still_has_its_loss_items_checked_at_start_up",
        ),
    ),
    Break(
        "blind52g evaluation: eval columns not gathered (each rank's own sums; padding copies kept)",
        "train/evaluation.py",
        "plumbing.gather_for_metrics(columns).items()",
        "columns.items()",
        (
            "tests/e2e/test_rl_runs.py::test_it_logs_its_rollouts_each_step_and_its_eval_is_the_export_s_greedy_count",
            "tests/e2e/test_rl_runs.py::test_the_sft_run_s_answer_exact_is_the_export_s_own_greedy_count_turn_by_turn",
        ),
        quick=False,
    ),
    Break(
        "blind52g chat: greedy's positions count from 1 (a prompt generates unlike training)",
        "train/chat.py",
        "position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),",
        "position_ids=prompt_mask.cumsum(-1),",
        (
            "tests/test_chat.py::test_greedy_on_a_left_padded_batch_is_each_prompt_s_own_argmax_from_position_0",
            "tests/test_generate_columns.py::test_each_conversation_a_row_counts_its_whole_turns_and_those_generated_exactly",
            "tests/e2e/test_rl_runs.py::test_the_sft_run_s_answer_exact_is_the_export_s_own_greedy_count_turn_by_turn",
        ),
        quick=False,
    ),
    Break(
        "blind52g chat: greedy keeps the model's generation_config (a hub model's repetition_penalty decodes)",
        "train/chat.py",
        "    with without_model_defaults(model):\n",
        "    if True:\n",
        (
            "tests/test_chat.py::test_greedy_is_the_plain_argmax_whatever_the_model_s_generation_config_says",
            "tests/test_generate_columns.py::test_each_conversation_a_row_counts_its_whole_turns_and_those_generated_exactly",
            "tests/test_chat.py::test_generation_defaults_are_set_aside_within_and_back_after_even_on_an_error",
        ),
    ),
    Break(
        "blind52g chat: without_model_defaults never gives the model its generation_config back",
        "train/chat.py",
        "        model.generation_config = kept\n",
        "        pass\n",
        (
            "tests/test_chat.py::test_generation_defaults_are_set_aside_within_and_back_after_even_on_an_error",
        ),
    ),
    Break(
        "blind52g chat: up_to_the_end leaves out the end of turn itself",
        "train/chat.py",
        "ended_before = is_end.cumsum(-1) - is_end",
        "ended_before = is_end.cumsum(-1)",
        ("tests/test_chat.py::test_the_completion_counts_up_to_and_with_its_first_end_of_turn",),
    ),
    Break(
        "blind52g chat: greedy without synced_gpus (FSDP2: a rank done first leaves the others in a collective)",
        "train/chat.py",
        "synced_gpus=sharded(model),",
        "synced_gpus=False,",
        (
            "tests/test_chat.py::test_a_sharded_model_generates_with_synced_gpus",
            "tests/test_generate_columns.py::test_each_conversation_a_row_counts_its_whole_turns_and_those_generated_exactly",
        ),
    ),
    Break(
        "blind52g chat: sharded() false at 2 processes (FSDP2 on 2 ranks generates without synced_gpus: a hang)",
        "train/chat.py",
        "dist.get_world_size() > 1",
        "dist.get_world_size() > 2",
        (
            "tests/e2e/test_rl_runs.py::test_under_fsdp2_ranks_of_different_lengths_finish_and_the_reference_never_drifts",
        ),
        quick=False,
    ),
    Break(
        "blind52g sft: a packed conversation's prompt starts at the block's start (earlier conversations in it)",
        "examples/chat_sft/model.py",
        "first - positions[first], first, ending + 1))",
        "0, first, ending + 1))",
        (
            "tests/test_generate_columns.py::test_packed_blocks_count_the_same_turns_each_from_its_own_conversation",
            "tests/test_generate_columns.py::test_the_prompts_are_each_turn_s_conversation_before_it",
        ),
    ),
    Break(
        "blind52g sft: the answer is compared without its end of turn (a turn that rambles on counts exact)",
        "examples/chat_sft/model.py",
        "first - positions[first], first, ending + 1))",
        "first - positions[first], first, ending))",
        (
            "tests/test_generate_columns.py::test_a_turn_is_exact_with_its_end_of_turn_and_the_longest_turn_can_be",
            "tests/test_generate_columns.py::test_each_conversation_a_row_counts_its_whole_turns_and_those_generated_exactly",
            "tests/e2e/test_rl_runs.py::test_the_sft_run_s_answer_exact_is_the_export_s_own_greedy_count_turn_by_turn",
        ),
        quick=False,
    ),
    Break(
        "blind52g sft: a turn cut at the block's end (no end of turn) is counted",
        "examples/chat_sft/model.py",
        "if tokens[i] in ends), None)",
        "if tokens[i] in ends), k - 1)",
        (
            "tests/test_generate_columns.py::test_each_conversation_a_row_counts_its_whole_turns_and_those_generated_exactly",
            "tests/test_generate_columns.py::test_packed_blocks_count_the_same_turns_each_from_its_own_conversation",
        ),
    ),
    Break(
        "blind52g sft: greedy gets one token too few (the longest turn's end of turn never generated)",
        "examples/chat_sft/model.py",
        "max_new_tokens=longest)",
        "max_new_tokens=longest - 1)",
        (
            "tests/test_generate_columns.py::test_a_turn_is_exact_with_its_end_of_turn_and_the_longest_turn_can_be",
            "tests/test_generate_columns.py::test_each_conversation_a_row_counts_its_whole_turns_and_those_generated_exactly",
            "tests/e2e/test_rl_runs.py::test_the_sft_run_s_answer_exact_is_the_export_s_own_greedy_count_turn_by_turn",
        ),
        quick=False,
    ),
    Break(
        "blind52g sft: a row's exact turns overwritten, not summed (a packed block counts its last turn only)",
        "examples/chat_sft/model.py",
        "exact[row] += float(",
        "exact[row] = float(",
        (
            "tests/test_generate_columns.py::test_packed_blocks_count_the_same_turns_each_from_its_own_conversation",
            "tests/test_generate_columns.py::test_each_conversation_a_row_counts_its_whole_turns_and_those_generated_exactly",
        ),
    ),
    Break(
        "blind52g sft: left padding attended (the shorter prompts read pad tokens)",
        "examples/chat_sft/model.py",
        "mask = torch.zeros_like(ids)",
        "mask = torch.ones_like(ids)",
        (
            "tests/test_generate_columns.py::test_the_prompts_are_each_turn_s_conversation_before_it",
            "tests/test_generate_columns.py::test_each_conversation_a_row_counts_its_whole_turns_and_those_generated_exactly",
        ),
    ),
    Break(
        "blind52g sft: answer_exact divides exact turns by assistant tokens, not turns",
        "examples/chat_sft/model.py",
        'sums["turns_exact"] / sums["turns"]',
        'sums["turns_exact"] / sums["tokens"]',
        (
            "tests/test_generate_columns.py::test_each_conversation_a_row_counts_its_whole_turns_and_those_generated_exactly",
            "tests/e2e/test_rl_runs.py::test_the_sft_run_s_answer_exact_is_the_export_s_own_greedy_count_turn_by_turn",
        ),
        quick=False,
    ),
    Break(
        "blind52g sft: a rank whose eval batch holds no whole turn skips the dummy generate (FSDP2 hang)",
        "examples/chat_sft/model.py",
        "if sharded(model):",
        "if False:",
        (
            "tests/test_generate_columns.py::test_a_sharded_rank_without_a_whole_turn_still_generates_once",
            "tests/test_generate_columns.py::test_each_conversation_a_row_counts_its_whole_turns_and_those_generated_exactly",
        ),
    ),
    Break(
        "blind52g sft: an eval set without a whole turn divides by zero (0 turns: ZeroDivisionError at the eval)",
        "examples/chat_sft/model.py",
        'if sums.get("turns"):',
        'if "turns" in sums:',
        (
            "tests/test_generate_columns.py::test_an_eval_set_without_a_whole_turn_reports_the_per_token_metrics_alone",
            "tests/test_generate_columns.py::test_each_conversation_a_row_counts_its_whole_turns_and_those_generated_exactly",
            "tests/test_generate_columns.py::test_generate_eval_false_generates_nothing",
        ),
    ),
    Break(
        "blind52g sft: the turn counts join the per-token metrics (eval_turns, eval_turns_exact per token)",
        "examples/chat_sft/model.py",
        "for name in sums if name not in GENERATED}",
        "for name in sums}",
        (
            "tests/test_generate_columns.py::test_each_conversation_a_row_counts_its_whole_turns_and_those_generated_exactly",
            "tests/e2e/test_chat_sft.py::test_it_learns_and_its_eval_is_per_assistant_token_over_exactly_the_held_out_conversations",
        ),
        quick=False,
    ),
    Break(
        "blind52g rl: the eval scores without exact_answer (no eval_pass_rate unless it is a weighted reward)",
        "examples/rl/model.py",
        "score(rl, generated, with_pass=True)",
        "score(rl, generated)",
        (
            "tests/test_rl.py::test_the_eval_s_pass_rate_and_tokens_need_no_weighted_exact_answer_and_count_the_end",
            "tests/test_rl.py::test_the_eval_is_each_prompt_s_greedy_completion_scored_over_exactly_the_eval_set",
        ),
    ),
    Break(
        "blind52g rl: the eval's completion_tokens count non-pad tokens (the end of turn lost where pad is EOS)",
        "examples/rl/model.py",
        '"completion_tokens": generated["mask"].sum(-1),',
        '"completion_tokens": (generated["completion"] != rl.pad_id).sum(-1),',
        (
            "tests/test_rl.py::test_the_eval_s_pass_rate_and_tokens_need_no_weighted_exact_answer_and_count_the_end",
            "tests/test_rl.py::test_the_eval_is_each_prompt_s_greedy_completion_scored_over_exactly_the_eval_set",
        ),
    ),
    Break(
        "blind52g rl: eval_metrics divides by completion tokens, not prompts (eval_reward, pass_rate per token)",
        "examples/rl/model.py",
        'prompts = max(sums["prompts"], 1.0)',
        'prompts = max(sums["completion_tokens"], 1.0)',
        (
            "tests/test_rl.py::test_the_eval_is_each_prompt_s_greedy_completion_scored_over_exactly_the_eval_set",
            "tests/e2e/test_rl_runs.py::test_it_logs_its_rollouts_each_step_and_its_eval_is_the_export_s_greedy_count",
        ),
        quick=False,
    ),
    # ---- blind audit (issue 52): RL sampling independent of the layout (per-completion seeds,
    # GumbelSampler, data.py's prompt_index), written without reading tests/
    Break(
        "blind52s rl: the seed leaves out the completion's place g (a prompt's G completions identical, advantages 0)",
        "examples/rl/model.py",
        'text = f"{seed}/{step}/{prompt}/{completion}".encode()',
        'text = f"{seed}/{step}/{prompt}".encode()',
        (
            "tests/test_rl.py::test_the_same_seed_step_and_prompt_give_the_same_tokens_and_leave_the_rng_alone",
            "tests/test_rl.py::test_each_sampled_token_is_the_argmax_of_its_log_probs_plus_its_own_seed_s_gumbel_noise",
        ),
    ),
    Break(
        "blind52s rl: the seeds listed g-major while the rows are prompt-major (a row samples with another "
        "prompt's seed)",
        "examples/rl/model.py",
        '        for prompt in batch["prompt_index"].tolist()\n        for g in range(groups)\n',
        '        for g in range(groups)\n        for prompt in batch["prompt_index"].tolist()\n',
        (
            "tests/test_rl.py::test_a_prompt_samples_the_same_tokens_alone_and_in_a_batch_at_another_row",
            "tests/test_rl.py::test_each_sampled_token_is_the_argmax_of_its_log_probs_plus_its_own_seed_s_gumbel_noise",
        ),
    ),
    Break(
        "blind52s rl: --seed left out of the completions' seeds (runs of other seeds sample alike)",
        "examples/rl/model.py",
        "rollout_seed(cfg.seed, step, prompt, g)",
        "rollout_seed(0, step, prompt, g)",
        (
            "tests/test_rl.py::test_the_same_seed_step_and_prompt_give_the_same_tokens_and_leave_the_rng_alone",
            "tests/test_rl.py::test_each_sampled_token_is_the_argmax_of_its_log_probs_plus_its_own_seed_s_gumbel_noise",
        ),
    ),
    Break(
        "blind52s rl: GumbelSampler leaves out the temperature (samples at temperature 1)",
        "examples/rl/model.py",
        "tempered = scores.to(torch.promote_types(scores.dtype, torch.float32)) / self.temperature",
        "tempered = scores.to(torch.promote_types(scores.dtype, torch.float32))",
        (
            "tests/test_rl.py::test_gumbel_max_samples_the_tempered_top_p_distribution",
            "tests/test_rl.py::test_each_sampled_token_is_the_argmax_of_its_log_probs_plus_its_own_seed_s_gumbel_noise",
        ),
    ),
    Break(
        "blind52s rl: generate builds the sampler without --top_p (top_p 1: the whole vocabulary sampled)",
        "examples/rl/model.py",
        "processors = [recorder, GumbelSampler(seeds, cfg.temperature, cfg.top_p)]",
        "processors = [recorder, GumbelSampler(seeds, cfg.temperature, 1.0)]",
        (
            "tests/test_rl.py::test_gumbel_max_samples_the_tempered_top_p_distribution",
            "tests/test_rl.py::test_each_sampled_token_is_the_argmax_of_its_log_probs_plus_its_own_seed_s_gumbel_noise",
        ),
    ),
    Break(
        "blind52s rl: the recorder runs after the sampler (old log-probs of the noisy scores)",
        "examples/rl/model.py",
        "processors = [recorder, GumbelSampler(seeds, cfg.temperature, cfg.top_p)]",
        "processors = [GumbelSampler(seeds, cfg.temperature, cfg.top_p), recorder]",
        (
            "tests/test_rl.py::test_the_log_probs_recorded_at_generation_are_the_current_policy_s",
            "tests/test_rl.py::test_each_sampled_token_is_the_argmax_of_its_log_probs_plus_its_own_seed_s_gumbel_noise",
        ),
    ),
    Break(
        "blind52s rl: the Gumbel noise's sign flipped (argmax of log p - G: not a sample of p)",
        "examples/rl/model.py",
        "return self.log_probs(scores) - torch.log(-torch.log(uniforms))",
        "return self.log_probs(scores) + torch.log(-torch.log(uniforms))",
        (
            "tests/test_rl.py::test_gumbel_max_samples_the_tempered_top_p_distribution",
            "tests/test_rl.py::test_each_sampled_token_is_the_argmax_of_its_log_probs_plus_its_own_seed_s_gumbel_noise",
        ),
    ),
    Break(
        "blind52s rl: generate samples again from the noisy scores (do_sample on: the global RNG decides)",
        "train/chat.py",  # greedy, which the RL example's generate calls with its sampler
        "do_sample=False,",
        "do_sample=bool(processors),",
        (
            "tests/test_rl.py::test_the_same_seed_step_and_prompt_give_the_same_tokens_and_leave_the_rng_alone",
            "tests/test_rl.py::test_each_sampled_token_is_the_argmax_of_its_log_probs_plus_its_own_seed_s_gumbel_noise",
        ),
    ),
    Break(
        "blind52s data: every prompt's prompt_index is 0 (all prompts draw the same noise: correlated samples)",
        "examples/rl/data.py",
        'rows = rows.add_column("prompt_index", list(range(len(rows))))',
        'rows = rows.add_column("prompt_index", [0] * len(rows))',
        (
            "tests/test_rl.py::test_each_split_s_prompts_are_indexed_0_1_2_in_the_file_s_order",
            "tests/test_rl.py::test_a_prompt_samples_the_same_tokens_alone_and_in_a_batch_at_another_row",
            "tests/test_rl.py::test_the_same_seed_step_and_prompt_give_the_same_tokens_and_leave_the_rng_alone",
        ),
    ),
    Break(
        "fault54 hangs: a node that lost the main node stays silent after its launcher's SIGTERM (no "
        "node says the job's line, 1 run in 8 of the main-node kill)",
        "train/job.py",
        'if says_it and (stop_signals.signal_name != "SIGTERM" or main_node_gone()):',
        'if says_it and stop_signals.signal_name != "SIGTERM":',
        (
            "tests/test_hang_watch.py::test_after_the_launchers_sigterm_only_a_node_that_lost_the_main_node_says_its_line",
        ),
    ),
    Break(
        "fault55 chat: a conversation that opens with the assistant's turn is a transformers traceback "
        "(the empty conversation before it rendered)",
        "train/chat.py",
        'if message.get("role") != "assistant" or turn == 0:',
        'if message.get("role") != "assistant":',
        (
            "tests/test_chat.py::test_a_conversation_that_opens_with_the_assistant_learns_its_later_turns_alone",
        ),
    ),
    Break(
        "fault55 preference: a pair whose prompt is an empty list is a transformers traceback, not its "
        "one line",
        "examples/preference/data.py",
        "if isinstance(value, list) and value:",
        'if isinstance(value, list) and (value or column == "prompt"):',
        ("tests/test_preference.py::test_a_bad_pair_is_one_line_naming_its_line",),
    ),
    Break(
        "fault56 sweep: a sweep over data mixtures is a TypeError traceback (the parsed mixture, a "
        "tuple of sources, handed to Optuna's storage)",
        "scripts/sweep.py",
        'if key == "dataset":\n        return choice\n    return coerce(key, choice, type_name)',
        "return coerce(key, choice, type_name)",
        (
            "tests/test_sweep_inputs.py::test_a_sweep_over_datasets_stores_each_choice_as_written_and_flags_it_so",
        ),
    ),
    Break(
        "fault57 sweep: a driver stopped between two trials prints the summary and exits 0 (a "
        "scheduler requeues a 75: the sweep stays short of its trials)",
        "scripts/sweep.py",
        "while len(self.study.get_trials(deepcopy=False)) < trials:\n"
        "            if self.stop_signal is not None:  # between two trials: the sweep is not over\n"
        "                return self.stopped(running=False)",
        "while len(self.study.get_trials(deepcopy=False)) < trials and self.stop_signal is None:",
        (
            "tests/test_sweep_driver.py::test_a_driver_stopped_as_its_trial_ends_exits_75_before_the_next_and_the_next_start_runs_it",
            "tests/test_sweep_driver.py::test_a_driver_stopped_while_no_trial_runs_launches_none_and_exits_75",
        ),
    ),
    Break(
        "fault58 sweep: the driver's lines are not flushed: killed with its process group while its "
        "output is a file, it loses what it said (the tests' PYTHONUNBUFFERED hid it)",
        "scripts/sweep.py",
        'print(f"sweep: {line}", flush=True)',
        'print(f"sweep: {line}")',
        ("tests/test_sweep_driver.py::test_what_the_driver_said_before_a_kill_9_is_in_its_log",),
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
