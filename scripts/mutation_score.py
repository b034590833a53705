"""A mutation score from a real tool: mutmut 3 breaks one module of train/ at a time, every way its operators
allow (an unbiased sample of breaks, not one chosen beside the tests), and runs the quick tier's tests that
reach each broken function. Not part of the suite: it takes minutes per module.

    pip install mutmut==3.8.1
    python scripts/mutation_score.py                 # every module below, into docs/mutation-score.json
    python scripts/mutation_score.py sources optim   # some of them (the others' rows are kept)
    python scripts/mutation_score.py --table         # the json's counts as docs/mutation-score.md's table
    python scripts/mutation_score.py --since main~5   # only the functions changed since that commit: the
                                                      # score of new code, before a stop (nothing saved)

mutmut names a mutant by its file's path and matches it to a function by the function's __module__; train/'s
modules are imported by their own names (`import config`), so each module is run in a scratch copy of the
repository with train/'s files at its root (pytest's pythonpath there puts them first, and train/ last: its
data files stay where the tests look, the mutated modules are the ones imported). What survives is listed per
module; docs/mutation-score.md keeps each survivor's triage (a test added, or why the mutant is
equivalent). scripts/mutations.py stays for end-to-end behaviour (kills mid-save, resumes, launchers).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# module of train/: the quick-tier tests that reach its logic
MODULES = {
    "config": ["tests/test_config.py", "tests/test_launch_configs.py"],
    "sources": ["tests/test_mixture.py", "tests/test_config.py"],
    "mixture": ["tests/test_mixture.py"],
    "batches": [
        "tests/test_batches.py",
        "tests/test_mixture.py",
        "tests/test_loading.py",  # load_data, build_batches, RunData.first_eval_batch
        "tests/test_task.py",  # loss_weights
    ],
    "task": [
        "tests/test_task.py",
        "tests/test_lm.py",
        "tests/test_adapters.py",
        "tests/test_data.py",
        "tests/test_generate_columns.py",  # generate_columns, batch_columns, teacher_forced
    ],
    "buffers": ["tests/test_sharding.py", "tests/test_task.py"],
    "optim": ["tests/test_schedule.py"],
    "resume": ["tests/test_checkpoint.py", "tests/test_sharding.py"],
    "storage": ["tests/test_storage.py"],
    "checkpoint": [
        "tests/test_checkpoint.py",
        "tests/test_saving.py",
        "tests/test_sharding.py",
        "tests/test_adapters.py",
    ],
    "profiling": ["tests/test_profiling.py", "tests/test_tracking.py"],  # Throughput: test_tracking
    "adapters": ["tests/test_adapters.py", "tests/test_preference.py"],
    "lm": ["tests/test_lm.py", "tests/test_model.py", "tests/test_hugging_face.py"],
    "checks": [
        "tests/test_checks.py",
        "tests/test_hugging_face.py",
        "tests/test_config.py",
        "tests/test_profiling.py",  # check_devices
    ],
    "hangs": ["tests/test_hang_watch.py"],
    "run_folder": [
        "tests/test_run_folder.py",
        "tests/test_saving.py",
        "tests/test_storage.py",
        "tests/test_checkpoint.py",
    ],
    "blocks": [
        "tests/test_sharding.py",
        "tests/test_model.py",
        "tests/test_lm.py",
        "tests/test_tracking.py",  # flops_per_token
    ],
    "plumbing": ["tests/test_plumbing.py", "tests/test_sharding.py", "tests/test_engines.py"],
    "chat": [
        "tests/test_chat.py",
        "tests/test_example_data.py",
        "tests/test_preference.py",
        "tests/test_rl.py",
        "tests/test_hugging_face.py",  # end_of_turn_ids, through scripts/sample.py
        "tests/test_generate_columns.py",  # greedy, up_to_the_end
    ],
    # scripts (OUTSIDE): the tests that load them in their own process
    "sweep": [
        "tests/test_sweep_inputs.py",
        "tests/test_sweep_driver.py",
        "tests/test_sweep_plot.py",
    ],
    "launch": ["tests/test_stop_signals.py"],
    # the examples' files (OUTSIDE) that a quick test loads in its own process (conftest.example_file);
    # the GRU's, and the image and text classifiers' models, are run only by forks' trainings
    "chat_sft_data": ["tests/test_example_data.py", "tests/test_generate_columns.py"],
    "chat_sft_model": ["tests/test_generate_columns.py"],
    "text_classification_data": ["tests/test_example_data.py", "tests/test_classifier_data.py"],
    "image_classification_data": [
        "tests/test_example_data.py",
        "tests/test_image_folder_console.py",
        "tests/test_classifier_data.py",
    ],
    "preference_data": ["tests/test_preference.py"],
    "preference_model": ["tests/test_preference.py"],
    "rl_data": ["tests/test_rl.py"],
    "rl_model": ["tests/test_rl.py"],
}
# outside train/: the name its tests import it by, and its file. Tests load a script or an example by
# path under that name (test_sweep_inputs.py's sweep_script, conftest.example_file's <example>_<file>);
# the scratch copy puts it at the root under that name and leaves a stand-in at its path (SHIM)
OUTSIDE = {
    "sweep": "scripts/sweep.py",
    "launch": "scripts/launch.py",
    **{
        f"{example}_{file}": f"examples/{example}/{file}.py"
        for example in (
            "chat_sft",
            "text_classification",
            "image_classification",
            "preference",
            "rl",
        )
        for file in ("data", "model")
    },
}
# where the issue names part of a module, only these functions are mutated (mutmut's names: x_f for a
# function, x\u01c1Class\u01c1method for a method); the rest of the module is reached end to end
SCOPE = {
    # resume's checks: not the procedure that runs them (start, start_fresh, downloads)
    "resume": [
        "x_check_sources",
        "x_lr_horizon",
        "x_checkpoint_to_resume",
        "x_resume_from",
        "x_check_same_run",
        "x_adapter_mismatch",
        "x_init_weights",
        "x_check_same_step_everywhere",
        "x\u01c1TrainingDiverged\u01c1*",
    ],
    # storage's manifest logic and its start-up check and error wording: not the deadline machinery
    # (bounded waits out real seconds) nor the S3 lease, which tests/e2e/test_object_storage.py runs
    # against an S3 server behind a fault proxy
    "storage": [
        "x_check_output_dir",
        "x_url_problem",
        "x_package_for",
        "x\u01c1Bucket\u01c1step_url",
        "x\u01c1Bucket\u01c1_step",
        "x\u01c1Bucket\u01c1clear_step",
        "x\u01c1Bucket\u01c1upload",
        "x\u01c1Bucket\u01c1commit",
        "x\u01c1Bucket\u01c1committed",
        "x\u01c1Bucket\u01c1newest",
        "x\u01c1Bucket\u01c1prune",
        "x\u01c1Bucket\u01c1download_newest",
        "x_failed_condition",
        "x_client_options",
        "x_store_problem",
    ],
    # the checkpoint's parts and its manifest and weight checks: not the export writers
    "checkpoint": [
        "x\u01c1TrainState\u01c1*",
        "x\u01c1ProcessRNG\u01c1*",
        "x\u01c1Weights\u01c1*",
        "x\u01c1Trainable\u01c1*",
        "x\u01c1PerProcess\u01c1*",
        "x\u01c1Plain\u01c1*",
        "x\u01c1Frozen\u01c1*",
        "x_is_json",
        "x_cpu_copy",
        "x_as_part",
        "x_checkpoint_parts",
        "x_sharding_mismatch",
        "x_run_geometry",
        "x_tensor_bytes",
        "x_read_manifest",
        "x_checkpoint_problem",
        "x_check_weights",
        "x_load_weights_file",
        "x_tied_weights",
    ],
}
# tests that cannot pass with mutmut's copies in the module (each mutant is a function of the file, beside
# the one it replaces): deselected in that module's measurement only
DESELECT = {
    # the reward functions are the file's functions of (completion, answer): mutmut's copies are too
    "rl_model": [
        "tests/test_rl.py::test_each_bad_rl_key_is_its_whole_line[unknown-reward]",
        "tests/test_rl.py::test_the_reward_functions_are_the_file_s_functions_of_completion_and_answer",
    ],
}
REPORT = REPO / "docs" / "mutation-score.md"
RESULTS = REPO / "docs" / "mutation-score.json"  # the measured counts and survivors, per module
# run in the scratch folder: the diff of each mutant named on stdin, as JSON
SHOW_DIFFS = """
import json, sys
from mutmut.mutation.diff_apply import find_mutant, get_diff_for_mutant
names = sys.stdin.read().split()
paths = {}
diffs = {}
for name in names:
    module = name.split(".")[0]
    if module not in paths:
        paths[module] = find_mutant(name).path
    diffs[name] = get_diff_for_mutant(name, path=paths[module])
print(json.dumps(diffs))
"""
# what stands at a script's or an example's own path in the scratch copy: the mutated file at the root,
# run as this file (its module name, its __file__: the paths it finds from there are the repository's);
# where that is absent (a fork's copy of the file, tests/conftest.fork_with), the file's own code
SHIM = """\"\"\"mutation_score.py's stand-in: {name}.py at the root, mutated, run as this file.\"\"\"
import pathlib as _pathlib

_mutated = _pathlib.Path(__file__).resolve().parents[{depth}] / "{name}.py"
_code = _mutated.read_text() if _mutated.is_file() else {original!r}
exec(compile(_code, str(_mutated), "exec", dont_inherit=True))
"""
STATUS = re.compile(r"^\s*(\S+__mutmut_\d+): (.+)$")


def source_of(module: str) -> str:
    """The module's file in the repository."""
    return OUTSIDE.get(module, f"train/{module}.py")


def scratch_copy(module: str, tests: list[str]) -> Path:
    """The repository's tracked files, train/'s modules also at the root (and a script or example
    measured, under the name its tests import it by, with SHIM at its own path), and mutmut's
    settings."""
    folder = Path(tempfile.mkdtemp(prefix=f"mutation-{module}-"))
    listed = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    )
    for name in listed.stdout.split():
        source = REPO / name
        if source.is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, folder / name)
    for path in (REPO / "train").glob("*.py"):
        shutil.copy2(path, folder / path.name)
    if module in OUTSIDE:
        own = Path(OUTSIDE[module])
        original = (REPO / own).read_text()
        (folder / f"{module}.py").write_text(original)
        depth = len(own.parts) - 1  # scripts/sweep.py: the root is parents[1]
        (folder / own).write_text(SHIM.format(name=module, depth=depth, original=original))
    settings = folder / "pyproject.toml"
    text = settings.read_text()
    paths = 'pythonpath = ["train", "tests/helpers"]'
    assert paths in text, "pyproject.toml no longer puts train/ on pytest's path as expected"
    # the root (the mutated copies) first; train/ last, for what imports by path
    settings.write_text(text.replace(paths, 'pythonpath = [".", "tests/helpers", "train"]'))
    selection = "\n    ".join(tests)
    deselected = "".join(f"    --deselect\n    {test}\n" for test in DESELECT.get(module, []))
    (folder / "setup.cfg").write_text(
        "[mutmut]\n"
        "source_paths = .\n"
        f"only_mutate = {module}.py\n"
        f"pytest_add_cli_args_test_selection =\n    {selection}\n"
        "pytest_add_cli_args =\n    -m\n    not slow\n    -p\n    no:cacheprovider\n"
        f"{deselected}"
        # workers forked from a process that imported torch inherit its OpenMP threads' state and
        # spin until the CPU limit: a false "timeout"; a fork server that imported nothing is clean
        "process_isolation = forkserver\n"
    )
    return folder


def mangled(function: str) -> str:
    """mutmut's name of a function ("f" -> "x_f", "Class.method" -> "x\u01c1Class\u01c1method")."""
    if "." in function:
        return "x\u01c1" + function.replace(".", "\u01c1")
    return f"x_{function}"


def readable(mutant: str) -> str:
    """A mutant's function as `functions` names it: module.x_f__mutmut_3 -> f."""
    name = mutant.split("__mutmut_")[0].split(".", 1)[1]
    return name.removeprefix("x_").removeprefix("x\u01c1").replace("\u01c1", ".")


def run_module(module: str, tests: list[str], functions: list[str] | None = None) -> dict:
    """mutmut over the module (its SCOPE), or over these functions only."""
    folder = scratch_copy(module, tests)
    began = time.monotonic()
    chosen = [mangled(function) for function in functions] if functions else SCOPE.get(module, [])
    patterns = [f"{module}.{function}__mutmut_*" for function in chosen]
    run = subprocess.run(
        [sys.executable, "-m", "mutmut", "run", *patterns],
        cwd=folder,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # mutmut runs a worker per core
    )
    results = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    statuses = {}
    for line in results.stdout.splitlines():
        if match := STATUS.match(line):
            status = match.group(2).strip()
            if status != "not checked":  # outside the scope
                statuses[match.group(1)] = status
    if not statuses:
        # mutmut hides the output of its first, unmutated run ("failed to collect stats"): the
        # tests run again as it ran them, to name the one that failed
        deselected = [arg for test in DESELECT.get(module, []) for arg in ("--deselect", test)]
        again = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "--tb=short", "-m", "not slow"]
            + ["-p", "no:cacheprovider", "--rootdir=.", *tests, *deselected],
            cwd=folder / "mutants",
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        shutil.rmtree(folder, ignore_errors=True)
        raise SystemExit(
            f"{module}: mutmut gave no results:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}\n"
            f"the tests run again (exit {again.returncode}):\n{again.stdout[-4000:]}"
        )
    unkilled = [name for name, status in statuses.items() if status in ("survived", "no tests")]
    # every diff from one process (`mutmut show` per mutant re-reads the whole state each time)
    shown = subprocess.run(
        [sys.executable, "-c", SHOW_DIFFS],
        cwd=folder,
        input="\n".join(unkilled),
        capture_output=True,
        text=True,
        check=True,
    )
    diffs = json.loads(shown.stdout)
    survivors = {}
    for name in unkilled:
        diff = [
            line
            for line in diffs[name].splitlines()
            if line[:1] in "+-" and not line.startswith(("+++", "---"))
        ]
        survivors[name] = {"status": statuses[name], "diff": diff}
    shutil.rmtree(folder, ignore_errors=True)
    counts = {}
    by_function = {}  # where the timeouts and survivors sit
    for name, status in statuses.items():
        counts[status] = counts.get(status, 0) + 1
        seen = by_function.setdefault(readable(name), {})
        seen[status] = seen.get(status, 0) + 1
    return {
        "counts": counts,
        "by_function": by_function,
        "survivors": survivors,
        "minutes": (time.monotonic() - began) / 60,
    }


def killed_share(counts: dict) -> float:
    """Killed (a test failed, or timed out) of the mutants a test could judge."""
    killed = counts.get("killed", 0) + counts.get("timeout", 0)
    judged = killed + counts.get("survived", 0) + counts.get("no tests", 0)
    return killed / judged if judged else 0.0


def table(measured: dict) -> str:
    """The counts per module, as docs/mutation-score.md shows them."""
    rows = [
        "| module | mutated | tests | mutants | killed | survived | no tests | killed share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for module in MODULES:
        if module not in measured:
            continue
        counts = measured[module]["counts"]
        killed = counts.get("killed", 0) + counts.get("timeout", 0)
        timeouts = f" ({counts['timeout']} by timeout)" if counts.get("timeout") else ""
        scope = "the functions SCOPE names" if module in SCOPE else "all of it"
        if "of" in measured[module]:  # a run stopped part-way: its judged mutants of the module's
            scope = f"in part: {sum(counts.values())} of {measured[module]['of']} mutants run"
        tests = ", ".join(Path(test).name for test in MODULES[module])
        rows.append(
            f"| {module} | {scope} | {tests} | {sum(counts.values())} | {killed}{timeouts} | "
            f"{counts.get('survived', 0)} | {counts.get('no tests', 0)} | {killed_share(counts):.0%} |"
        )
    return "\n".join(rows)


def merged(before: dict, again: dict) -> dict:
    """A module's counts with some functions measured again: theirs replaced, the others kept."""
    by_function = {
        function: seen
        for function, seen in before["by_function"].items()
        if function not in again["by_function"]
    }
    by_function.update(again["by_function"])
    survivors = {
        name: survivor
        for name, survivor in before["survivors"].items()
        if readable(name) not in again["by_function"]
    }
    survivors.update(again["survivors"])
    counts = {}
    for seen in by_function.values():
        for status, number in seen.items():
            counts[status] = counts.get(status, 0) + number
    minutes = before["minutes"] + again["minutes"]
    merged_row = {
        "counts": counts,
        "by_function": by_function,
        "survivors": survivors,
        "minutes": minutes,
    }
    if "of" in before:  # still a module measured in part
        merged_row["of"] = before["of"]
    return merged_row


def changed_functions(module: str, since: str) -> list[str]:
    """The functions and methods of train/<module>.py (f, Class.method) whose lines changed since the
    commit `since` (git diff against the working tree): what a stop adds or edits."""
    import ast

    diff = subprocess.run(
        ["git", "diff", "-U0", since, "--", source_of(module)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    changed = set()
    for match in re.finditer(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", diff, re.MULTILINE):
        start, count = int(match.group(1)), int(match.group(2) or 1)
        changed.update(range(start, start + max(count, 1)))
    if not changed:
        return []
    tree = ast.parse((REPO / source_of(module)).read_text())
    found = []

    def visit(nodes, owner: str | None) -> None:
        for node in nodes:
            if isinstance(node, ast.ClassDef):
                visit(node.body, node.name)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = set(range(node.lineno, node.end_lineno + 1))
                if lines & changed:
                    found.append(f"{owner}.{node.name}" if owner else node.name)

    visit(tree.body, None)
    return found


def since_score(since: str) -> int:
    """mutmut over the functions changed since `since`, module by module; printed, not saved."""
    totals = {}
    for module, tests in MODULES.items():
        functions = changed_functions(module, since)
        if not functions:
            continue
        print(f"{module}: {', '.join(functions)}", flush=True)
        try:
            measured = run_module(module, tests, functions)
        except (
            SystemExit
        ) as nothing:  # no mutant in these functions (a changed constant, a docstring)
            print(f"{module}: {str(nothing).splitlines()[0]}", flush=True)
            continue
        counts = measured["counts"]
        print(f"{module}: {killed_share(counts):.0%} killed {counts}", flush=True)
        for name, survivor in measured["survivors"].items():
            print(f"  {survivor['status']}: {name}: {' '.join(survivor['diff'])[:200]}")
        for status, number in counts.items():
            totals[status] = totals.get(status, 0) + number
    if not totals:
        print(f"no function of the measured modules changed since {since}")
        return 0
    print(f"since {since}: {killed_share(totals):.0%} killed {totals}")
    return 0


def save(module: str, result: dict, merge: bool) -> dict:
    """Write this module's row into the json, read again under a lock: runs of other modules may have
    written theirs since this one started (each run takes minutes to hours), and theirs are kept."""
    with open(Path(tempfile.gettempdir()) / "mutation-score.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        measured = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        measured[module] = merged(measured[module], result) if merge else result
        RESULTS.write_text(json.dumps(measured, indent=1) + "\n")
    return measured[module]["counts"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help=f"of {', '.join(MODULES)} (default: every one)")
    parser.add_argument(
        "--table", action="store_true", help="print the measured counts, run nothing"
    )
    parser.add_argument(
        "--functions",
        nargs="+",
        help="measure these functions of one module again (f, Class.method) and merge them in",
    )
    parser.add_argument(
        "--since",
        metavar="REF",
        help="mutate only the functions changed since this commit, in every module; print the score",
    )
    args = parser.parse_args()
    if args.since:
        sys.exit(since_score(args.since))
    unknown = [module for module in args.modules if module not in MODULES]
    if unknown:
        parser.error(f"no module {unknown[0]!r} is measured (choose from {', '.join(MODULES)})")
    if args.table:
        print(table(json.loads(RESULTS.read_text())))
        return
    for module in args.modules or list(MODULES):
        print(
            f"{module}: mutating {source_of(module)}, tests {' '.join(MODULES[module])}", flush=True
        )
        result = run_module(module, MODULES[module], args.functions)
        counts = save(module, result, merge=bool(args.functions))
        print(f"{module}: {killed_share(counts):.0%} killed {counts}", flush=True)
    print(f"results: {RESULTS}; the survivors' triage goes into {REPORT}")


if __name__ == "__main__":
    main()
