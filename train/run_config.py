"""The run's config as a person gives it: TrainConfig's keys (config.py) and the fork's own (model.py's
ModelConfig, data.py's DataConfig) as one dataclass, filled from YAML files and flags.

    python train/main.py --config train/configs/tiny.yaml --lr 3e-4 --max_steps 200

Precedence: dataclass defaults < the run's own config.yaml (a resume) < --config YAML < --key value
flags. A preset's `lm:` section holds the shipped causal LM's keys, which a fork's files need not
declare. An unknown key is one line naming the file it came from; `--help` lists every key with the
comment written above it. Reads the YAML files it is given and a resumed run's config.yaml, nothing
else."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import os
import re
import sys
from dataclasses import fields
from pathlib import Path

import yaml

from config import TrainConfig
from errors import ConfigError
from run_folder import LAYOUT, RunFolder, numbered_run, run_numbers
from sources import parse_dataset
from task import SETTINGS, fork_settings

# the shipped causal LM's own keys (train/model.py's ModelConfig and data.py's DataConfig as the template
# ships them; a test holds them equal): after a fork they are keys only where the fork's files declare
# them, and the line that refuses one says whose it is
SHIPPED_KEYS = {
    "model": ("n_layer", "n_head", "n_embd", "dropout", "bias"),
    "data": ("text_column", "block_size"),
}
SHIPPED_SECTION = "lm"  # a preset's section of them (train/configs/*.yaml)
# keys an earlier version had, under their new names
RENAMED = {
    "model": "hf_model: a Hugging Face model's hub name or folder; leave it out for model.py's own"
}


# ---------------------------------------------------------------- loading


def load_config(argv: list[str] | None = None) -> TrainConfig:
    """Defaults < the run's own config.yaml (a resume: --resume with the run folder it names) <
    --config YAML < --key value flags. Raises ConfigError on any bad key or value, naming the file a
    key came from."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(usage())  # noqa: T201 - --help is for the terminal
        sys.exit(0)
    config_file, overrides = _split_argv(argv)
    run_config = config_class()
    types = {f.name: f.type for f in fields(run_config)}
    from_file = (
        shipped_lm_section(_read_yaml(config_file), config_file, types) if config_file else {}
    )
    # a resume continues the run as it was configured: the commands a run prints need no --config
    saved_path, saved = resumed_run_config({**from_file, **overrides})
    # the shipped LM's keys a fork does not declare: template keys in earlier versions, so its
    # older runs saved them
    shipped = {key for keys in SHIPPED_KEYS.values() for key in keys}
    saved = {key: value for key, value in saved.items() if key in types or key not in shipped}
    values = {**saved, **from_file, **overrides}
    # where each key came from, for the line that refuses it (a flag: the line itself)
    source = {key: f" in {saved_path}" for key in saved} | {
        key: f" in {config_file}" for key in from_file
    }
    source |= {key: "" for key in overrides}
    typed = {}
    for key, raw in values.items():
        if key not in types:
            raise ConfigError(f"unknown key '{key}'{source[key]}{unknown_key_hint(key, types)}")
        typed[key] = coerce(key, raw, types[key])
    cfg = run_config(**typed)
    cfg.validate()
    return cfg


def resumed_run_config(given: dict) -> tuple[str, dict]:
    """A resume's run folder's config.yaml, as (its path, its values): the defaults a resume
    starts from, so that `--output_dir RUN --resume latest` continues RUN as it was launched. ("",
    {}) when not resuming, or when the run has no config.yaml yet (a first start that stopped
    early)."""
    if not given.get("resume"):
        return "", {}
    output_dir = str(given.get("output_dir") or "")
    newest = not output_dir and given["resume"] == "latest" and run_numbers()
    if newest:  # the run --resume latest will take (job.claim_run_folder checks that it fits)
        output_dir = numbered_run(max(run_numbers()))
    if not output_dir:
        return "", {}
    folder = RunFolder(output_dir)
    path = f"{output_dir.rstrip('/')}/{LAYOUT['config']}"
    if folder.on_bucket:
        text = read_from_store(path)
    else:
        text = Path(path).read_text() if Path(path).is_file() else None
    if text is None:
        return "", {}
    values = yaml.safe_load(text) or {}
    # never carried over: how this start resumes is this command's to say, and the LR horizon is the
    # checkpoint's to keep (resume.lr_horizon: a raised max_steps says what it does to it)
    for key in ("resume", "require_resume", "init_from", "lr_decay_steps"):
        values.pop(key, None)
    # the newest run's folder stays unnamed: claim_run_folder takes it, and says if it does not fit
    if newest:
        values.pop("output_dir", None)
    # a run without adapters: their keys mean nothing (an earlier version saved lora_alpha's
    # default, 16, which a run without lora_r now refuses as given)
    if not values.get("lora_r"):
        for key in ("lora_alpha", "lora_dropout", "lora_targets", "merge_adapter"):
            values.pop(key, None)
    return f"{path} (the run's own config, which a resume starts from)", values


def read_from_store(url: str) -> str | None:
    """A small file on object storage (fsspec), or None where it cannot be read: the checks that
    follow (storage.check_output_dir) say why in their own line."""
    try:
        import fsspec

        with fsspec.open(url, "r") as f:
            return f.read()
    except Exception:  # noqa: BLE001 - any store's failure: nothing to start from
        return None


def shipped_lm_section(values: dict, path: str, known) -> dict:
    """A preset's keys, flat. Its `lm:` section holds the shipped causal LM's own keys (its GPT's
    sizes, its block_size): they apply where model.py and data.py declare them, and a fork whose
    files do not runs without them, saying so in one line, so the presets work after any fork. Any
    other key in the section is refused as an unknown key would be."""
    section = values.pop(SHIPPED_SECTION, None) or {}
    if not isinstance(section, dict):
        raise ConfigError(
            f"config: {path}'s {SHIPPED_SECTION}: section must be a mapping of key: value"
        )
    shipped = {key for keys in SHIPPED_KEYS.values() for key in keys}
    left_out = [key for key in section if key not in known and key in shipped]
    if left_out and os.environ.get("RANK", "0") == "0":
        print(  # noqa: T201 - said once, before anything starts
            f"note: {path}'s {SHIPPED_SECTION}: section ({', '.join(left_out)}) is the shipped causal "
            f"LM's; this train/model.py and data.py do not declare those keys, so they are left out",
            file=sys.stderr,
        )
    applied = {key: value for key, value in section.items() if key not in left_out}
    return {**values, **applied}


def unknown_key_hint(key: str, known) -> str:
    """Where a key went (a renamed one), whose it is (the shipped LM's, after a fork), or the
    closest known key."""
    renamed = dict(RENAMED)
    for settings in fork_settings().values():
        renamed.update(getattr(settings, "RENAMED", {}))
    if key in renamed:
        return f" (renamed {renamed[key]})"
    for module_name, keys in SHIPPED_KEYS.items():
        if key in keys:
            file = f"train/{module_name}.py"
            return (
                f": a key of the shipped causal LM ({file}'s {SETTINGS[module_name]} as the template "
                f"ships it), which this {file} does not declare (a preset keeps such keys in its "
                f"{SHIPPED_SECTION}: section)"
            )
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


@functools.cache
def config_class() -> type:
    """The run's config: TrainConfig's keys and the fork's own, the fields of model.py's
    ModelConfig and data.py's DataConfig (task.py finds them), as one frozen dataclass. Every key
    is then the same: a YAML key, a --flag, a --help line, saved in config.yaml and compared on
    resume."""
    settings = fork_settings()
    if not settings:
        return TrainConfig
    taken = {f.name: "TrainConfig" for f in fields(TrainConfig)}
    added = []
    for module_name, declared in settings.items():
        where = f"{module_name}.py's {declared.__name__}"
        if not dataclasses.is_dataclass(declared):
            raise ConfigError(f"train/{where} must be a @dataclass of the task's own config keys")
        for f in fields(declared):
            if f.name in taken:
                raise ConfigError(
                    f"train/{where}: key '{f.name}' is already {taken[f.name]}'s: name it otherwise"
                )
            type_name = type_name_of(f)
            if type_name not in ("int", "float", "str", "bool"):
                raise ConfigError(
                    f"train/{where}: key '{f.name}' must be an int, float, str or bool (got {f.type})"
                )
            taken[f.name] = where
            added.append((f.name, type_name, dataclasses.field(default=f.default)))
    return dataclasses.make_dataclass("RunConfig", added, bases=(TrainConfig,), frozen=True)


def saved_config(path) -> TrainConfig:
    """The config a run saved (its config.yaml), unchecked: its data need not exist where the
    weights are used. Keys this version does not know are left out."""
    values = _read_yaml(str(path))
    run_config = config_class()
    known = {f.name for f in fields(run_config)}
    values = {key: value for key, value in values.items() if key in known}
    if "dataset" in values:
        values["dataset"] = parse_dataset(values["dataset"])
    return run_config(**values)


def _split_argv(argv: list[str]) -> tuple[str | None, dict[str, str]]:
    config_file = None
    overrides = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}' (flags look like --key value)")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                given = f"; got the next flag {argv[i + 1]}" if i + 1 < len(argv) else ""
                raise ConfigError(f"{key} needs a value (--{key} VALUE{given})")
            value, i = argv[i + 1], i + 1
        if key == "config":
            config_file = value
        else:
            overrides[key] = value
        i += 1
    return config_file, overrides


def _read_yaml(path: str) -> dict:
    try:
        with open(path) as f:
            values = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"config: cannot read '{path}': {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config: {where}: invalid YAML: {problem}") from None
    if not isinstance(values, (dict, type(None))):  # None: an empty file
        raise ConfigError(
            f"config: {path} must hold a mapping of key: value, not {type(values).__name__}"
        )
    return values or {}


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def coerce(key: str, raw, type_name: str):
    """Turn a YAML value or a CLI string into the field's type, or raise ConfigError naming the
    key."""
    if key == "dataset":
        return parse_dataset(raw)
    exact = not isinstance(raw, bool)  # YAML's true is no number, and no string either
    if type_name == "bool" and (not exact or str(raw).lower() in _TRUE + _FALSE):
        return raw if not exact else str(raw).lower() in _TRUE
    if (
        type_name == "int"
        and exact
        and not isinstance(raw, float)
        and re.fullmatch(r"[+-]?\d+", str(raw).strip())
    ):
        return int(raw)
    if type_name == "float" and exact and isinstance(raw, (int, float, str)):
        try:
            return float(raw)
        except ValueError:
            pass
    if type_name == "str" and isinstance(raw, bool):  # YAML's true, for a key like compile
        return str(raw).lower()
    if type_name == "str" and (raw is None or exact and isinstance(raw, (str, int, float))):
        return "" if raw is None else str(raw)
    raise ConfigError(
        f"{key} must be {'an' if type_name == 'int' else 'a'} {type_name} (got {raw!r})"
    )


def usage() -> str:
    """--help text: each key with its type, default and the comment above it in TrainConfig, then
    the fork's own keys (model.py's ModelConfig, data.py's DataConfig) the same way."""
    program = (
        os.path.relpath(sys.argv[0])
        if sys.argv and sys.argv[0].endswith(".py")
        else "train/main.py"
    )
    lines = [f"usage: {program} [--config FILE.yaml] [--key value ...]", ""]
    for module_name, declared in {"config": TrainConfig, **fork_settings()}.items():
        if declared is not TrainConfig:
            lines += ["", f"  train/{module_name}.py's {declared.__name__}:"]
        comments = comments_above_fields(declared)
        for f in fields(declared):
            lines.append(
                f"  --{f.name:<17} {type_name_of(f):<5} default {f.default!r:<24} "
                f"{comments.get(f.name, '')}"
            )
    return "\n".join(lines)


def type_name_of(field: dataclasses.Field) -> str:
    """A field's type as written: "int" (a name, under `from __future__ import annotations`, or
    the class itself)."""
    if isinstance(field.type, str):
        return field.type
    return getattr(field.type, "__name__", str(field.type))


def comments_above_fields(declared: type) -> dict[str, str]:
    """{key: the comment lines right above its field in the class's source}."""
    comments = {}
    above = []
    for line in inspect.getsource(declared).splitlines():
        comment = re.match(r"^\s+# (?!----)(.*)$", line)  # not a "# ---- section" rule
        field = re.match(r"^\s+(\w+): \w+ = ", line)
        if comment:
            above.append(comment[1])
        elif field:
            comments[field[1]] = " ".join(above)
            above = []
        else:
            above = []
    return comments
