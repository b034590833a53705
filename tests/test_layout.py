"""The module layout a fork relies on: imports run one way, and the two files a fork replaces (model.py,
data.py) are used by as few places, through as few names, as the contract in their docstrings says."""

import ast

from conftest import REPO

TRAIN = REPO / "train"
FORK_FILES = {"model", "data"}
# what the fork's files may import of train/: the toolkits (lm.py the causal LM's, chat.py a chat
# model's data) and the vocabulary, never the loop
FORK_IMPORTS = {"lm", "chat", "checks", "errors", "config"}
MODULES = {path.stem for path in TRAIN.glob("*.py")}


def imports_of(module: str) -> dict[str, set[str]]:
    """{imported train module: names taken from it} for one module of train/ (module level and inside
    functions alike)."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse((TRAIN / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module in MODULES:
            found.setdefault(node.module, set()).update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    found.setdefault(alias.name, set()).add("*")
    return found


def test_imports_run_one_way():
    graph = {module: set(imports_of(module)) for module in MODULES}
    done, visiting = set(), []

    def visit(module):
        assert module not in visiting, f"an import circle: {' -> '.join([*visiting, module])}"
        if module in done:
            return
        visiting.append(module)
        for imported in graph[module]:
            visit(imported)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_only_the_seam_reaches_the_fork_files_and_the_loop_uses_it_through_few_names():
    # task.py imports model.py and data.py where it first calls them (importlib), so that a name a
    # fork's file lacks is task.py's one-line error at start-up, not an ImportError
    users = {module for module in MODULES - FORK_FILES if imports_of(module).keys() & FORK_FILES}
    assert users == set(), users
    seam = (TRAIN / "task.py").read_text()
    assert 'SETTINGS = {"model": "ModelConfig", "data": "DataConfig"}' in seam
    assert "importlib.import_module(name)" in seam
    # what main.py uses of the seam
    main = ast.parse((TRAIN / "main.py").read_text())
    used = {
        node.attr
        for node in ast.walk(main)
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "task"
    }
    assert used == {
        "training_model",
        "model_identity",
        "check_loss_contract",
        "tokens_per_sample",
        "rollout",  # model.py's optional rollout (RL), once a step
    }, used
    for fork_file in FORK_FILES:  # the fork's files may use the template's helpers, never the loop
        assert imports_of(fork_file).keys() <= FORK_IMPORTS, fork_file


def test_main_imports_from_few_modules():
    """The loop's file reads in one sitting: its set-up is a few finished calls, from few modules."""
    assert len(imports_of("main")) <= 14, sorted(imports_of("main"))


def test_the_error_vocabulary_and_the_config_import_nothing_of_the_template_above_them():
    assert imports_of("errors") == {}
    # config.py, the template's keys, imports nothing of the fork's: run_config.py joins the fork's own
    # keys to them through the seam, which imports nothing above it
    assert set(imports_of("config")) == {"errors", "sources", "run_folder"}
    assert set(imports_of("run_config")) == {"config", "errors", "sources", "task", "run_folder"}
    assert set(imports_of("run_folder")) == {"errors"}
    assert set(imports_of("task")) == {"errors", "blocks", "buffers", "adapters"}
    assert set(imports_of("adapters")) == {"errors", "blocks"}
    assert set(imports_of("sources")) == {"errors"}
