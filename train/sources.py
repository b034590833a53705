"""The sources of a weighted mixture of datasets, as --dataset lists them, and their checks.

    --dataset python_stdlib                               one source (a string, as always)
    --dataset "data/a.jsonl:0.7,owner/name@config:0.3"    a mixture: PATH[@CONFIG]:WEIGHT, comma-separated
    dataset:                                              in YAML: a list, each with these keys
      - {path: data/a.jsonl, weight: 0.7}
      - {path: owner/name, config: en, split: train, text_column: content, weight: 0.3, name: web}

Weights are relative (7 and 3 is 0.7 and 0.3); a source of weight 0 is only evaluated. Parsed here, with
nothing read: config.py calls parse_dataset; what the mixture does with them is mixture.py's."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import yaml

from errors import ConfigError


@dataclass(frozen=True)
class Source:
    """One dataset of a mixture, as --dataset lists it. "" = the run's own key (dataset_config,
    dataset_split, text_column)."""

    path: str  # a local file or folder, or a hub name
    weight: float  # its share of the training samples, relative to the others'
    name: str  # for its metrics (eval_loss/<name>) and messages; default: the file's or repo's name
    config: str = ""
    split: str = ""
    text_column: str = ""


SOURCE_KEYS = ("path", "weight", "name", "config", "split", "text_column")


def parse_dataset(raw) -> str | tuple[Source, ...]:
    """--dataset's value: one source (a string, as before), or a mixture (a tuple of Source) from a
    YAML list of mappings, a YAML flow list on the command line, or the compact form
    "PATH[@CONFIG]:WEIGHT,...". Raises ConfigError naming `dataset`."""
    if isinstance(raw, str) and raw.lstrip().startswith("["):
        try:
            raw = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"dataset: invalid YAML list: {str(e).splitlines()[0]}") from None
    if isinstance(raw, (list, tuple)):
        sources = tuple(_listed_source(i, entry) for i, entry in enumerate(raw))
    elif isinstance(raw, str) and ("," in raw or ":" in raw):
        sources = tuple(_compact_source(part.strip()) for part in raw.split(","))
    elif isinstance(raw, str) or raw is None:
        return raw or ""
    else:
        raise ConfigError(f"dataset must be a string or a list of sources (got {raw!r})")
    _check_mixture(sources)
    return sources


def _listed_source(index: int, entry) -> Source:
    if isinstance(entry, Source):
        return entry
    if not isinstance(entry, dict) or not entry.get("path"):
        raise ConfigError(
            f"dataset: entry {index + 1} must be a mapping with a path (keys: {', '.join(SOURCE_KEYS)}; "
            f"got {entry!r})"
        )
    unknown = [key for key in entry if key not in SOURCE_KEYS]
    if unknown:
        raise ConfigError(
            f"dataset: entry {index + 1} has unknown key '{unknown[0]}' (keys: {', '.join(SOURCE_KEYS)})"
        )
    values = {key: "" if value is None else value for key, value in entry.items()}
    weight = _weight(values.pop("weight", 1.0), values["path"])
    for key, value in values.items():
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(
                f"dataset: entry {index + 1}'s {key} must be a string (got {value!r})"
            )
        values[key] = str(value)
    name = values.pop("name", "") or _default_name(values["path"], values.get("config", ""))
    return Source(weight=weight, name=name, **values)


def _compact_source(part: str) -> Source:
    """PATH[@CONFIG][:WEIGHT]"""
    where, colon, weight = part.rpartition(":")
    if not colon:
        where, weight = part, "1"
    path, _, config = where.partition("@")
    if not path:
        raise ConfigError(
            f"dataset: '{part}' names no source (the compact form is PATH[@CONFIG]:WEIGHT,...)"
        )
    return Source(path, _weight(weight, path), _default_name(path, config), config)


def _weight(raw, path: str) -> float:
    try:
        weight = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(
            f"dataset: the weight of '{path}' must be a number (got {raw!r})"
        ) from None
    if not weight >= 0 or weight == float("inf"):
        raise ConfigError(f"dataset: the weight of '{path}' must be >= 0 and finite (got {weight})")
    return weight


def _default_name(path: str, config: str) -> str:
    stem = os.path.basename(os.path.normpath(path))
    stem = os.path.splitext(stem)[0] or stem
    return f"{stem}_{config}" if config else stem


def _check_mixture(sources: tuple[Source, ...]) -> None:
    if len(sources) < 2:
        raise ConfigError(
            "dataset: a mixture needs two or more sources (for one, set dataset, dataset_config, "
            "dataset_split and text_column)"
        )
    if not any(source.weight > 0 for source in sources):
        raise ConfigError("dataset: the weights are all 0: at least one source needs a weight > 0")
    names = [source.name for source in sources]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        raise ConfigError(
            f"dataset: two sources are named '{twice}': give them names of their own (name: ...)"
        )


def source_config(cfg, source: Source):
    """The run's config as data.py sees it for one source: its path, configuration, split and
    text column in the keys data.py reads for a single dataset."""
    per_source = {
        "dataset": source.path,
        "dataset_config": source.config,
        "dataset_split": source.split or cfg.dataset_split,
    }
    if source.text_column:  # a key of data.py's (the shipped LM's DataConfig)
        per_source["text_column"] = source.text_column
    return replace(cfg, **per_source)


def describe(sources: tuple[Source, ...]) -> str:
    """The mixture in one line, weights as shares (what a resume must find unchanged)."""
    total = sum(source.weight for source in sources)
    described = []
    for source in sources:
        where = source.path + (f"@{source.config}" if source.config else "")
        if source.split or source.text_column:
            where += f"[{source.split or '-'},{source.text_column or '-'}]"
        described.append(f"{where}:{source.weight / total:.6g}")
    return ",".join(described)
