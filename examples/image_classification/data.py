"""The data of an image classifier: a folder of images kept the way people keep them, one subfolder per
class, or a Hugging Face image dataset by name. Copy this file over train/data.py, and its model.py over
train/model.py (examples/README.md).

    photos/                      --dataset photos        (or a hub dataset: --dataset uoft-cs/cifar10)
        cat/0001.jpg ...         the class names are the subfolders', sorted
        dog/0001.png ...
    photos/train/cat/..., photos/validation/cat/...      with split folders: validation (or test) is the
                                                         eval set; without: eval_fraction of the images

Images are read through `datasets`' image folder loader (any format Pillow reads), decoded when a batch is
read (in the DataLoader workers with --num_workers), converted to RGB, resized to --image_size and
normalised. No random augmentation: a sample is a function of its index, so a resume continues bitwise
(add one seeded by the index if you need it). The image files' content is the data's identity
(batches.data_identity): a resume on changed images is refused.
"""

from __future__ import annotations

import functools
import io
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from errors import ConfigError, first_line

MEAN, STD = 0.5, 0.25  # per channel, after scaling to [0, 1]
SPLIT_FOLDERS = ("train", "validation", "test")  # photos/train/cat/...: the split folders


@dataclass
class DataConfig:
    """The image data's own keys (the template joins them to its own: YAML, --flags, --help)."""

    # pixels a side, after resizing
    image_size: int = 32


def check_config(cfg) -> None:
    """The data's keys, at start-up: one line naming the key."""
    if not cfg.dataset:
        raise ConfigError(
            "dataset: pass --dataset, a folder of images with one subfolder per class (or a hub name)"
        )
    if cfg.image_size <= 0:
        raise ConfigError(f"image_size must be > 0 (got {cfg.image_size!r})")


def build_datasets(cfg):
    """(train, eval): map-style datasets of {"pixels": (3, image_size, image_size), "labels": class}."""
    import datasets

    splits = load_images(cfg)
    train = splits[cfg.dataset_split]
    held_out = next((splits[s] for s in ("validation", "test") if s in splits), None)
    image, label = columns_of(train, cfg.dataset)
    if held_out is None:
        train, held_out = hold_out(train, label, cfg.eval_fraction)
    say_missing_classes(held_out, label)
    as_tensors = functools.partial(
        to_tensors, image_column=image, label_column=label, size=cfg.image_size
    )
    # decoded here (to_tensors), so that a file that cannot be read is named
    train, held_out = (
        part.cast_column(image, datasets.Image(decode=False)) for part in (train, held_out)
    )
    return train.with_transform(as_tensors), held_out.with_transform(as_tensors)


def hold_out(train, label: str, fraction: float) -> tuple:
    """(train, eval): `fraction` of the images held out, every class in the same share (stratified),
    and at least one image of each. A fixed split seed: changing `seed` must not move images
    between the two."""
    classes = len(train.features[label].names)
    eval_images = max(round(fraction * len(train)), classes)
    try:
        split = train.train_test_split(test_size=eval_images, seed=0, stratify_by_column=label)
    except ValueError:  # a class of one image cannot be in both: the images drawn as they come
        split = train.train_test_split(test_size=eval_images, seed=0)
    return split["train"], split["test"]


def say_missing_classes(held_out, label: str) -> None:
    """A class with no eval image has no accuracy/<class>: one warning line naming them."""
    names = held_out.features[label].names
    missing = sorted(set(names) - {names[index] for index in held_out[label]})
    if missing and os.environ.get("RANK", "0") == "0":
        print(  # noqa: T201 - the data's warning, from the first process
            f"warning: the eval set holds no image of class {', '.join(missing)}: no "
            "accuracy/<class> for it (add images to its validation folder, or raise eval_fraction)",
            file=sys.stderr,
        )


def collate(samples: list[dict]) -> dict:
    """The model's keyword arguments: pixels (batch, 3, H, W) and labels (batch,)."""
    return {
        "pixels": torch.stack([sample["pixels"] for sample in samples]),
        "labels": torch.tensor([sample["labels"] for sample in samples]),
    }


def class_names(cfg) -> list[str]:
    """The classes, in label order (model.py sizes its head by them and names its per-class metrics)."""
    train = load_images(cfg)[cfg.dataset_split]
    _, label = columns_of(train, cfg.dataset)
    return list(train.features[label].names)


def to_tensors(rows: dict, image_column: str, label_column: str, size: int) -> dict:
    """A batch of rows (datasets' transform) to float pixels, resized and normalised, and labels."""
    pixels = []
    for stored in rows[image_column]:
        image = open_image(stored).convert("RGB").resize((size, size))
        array = np.asarray(image, dtype=np.float32) / 255.0
        pixels.append(torch.from_numpy((array - MEAN) / STD).permute(2, 0, 1))
    return {"pixels": pixels, "labels": list(rows[label_column])}


def open_image(stored: dict):
    """An image as datasets stores it ({"bytes", "path"}), decoded in full now: a truncated or
    unreadable file is one line naming it (in a loader worker too), never a bare decoder error."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(stored["bytes"]) if stored["bytes"] else stored["path"])
        image.load()  # a truncated file fails here, not in a later resize
    except Exception as e:
        name = stored.get("path") or "an image stored in the dataset"
        raise ConfigError(f"image {name} cannot be read: {first_line(e)}") from None
    return image


@functools.cache
def load_images(cfg):
    """The splits of an image folder or a hub image dataset (cached: class_names asks again)."""
    import datasets

    if os.path.isdir(cfg.dataset):
        check_class_folders(cfg.dataset)
    try:
        if os.path.isdir(cfg.dataset):
            with datasets_bars_off():
                splits = datasets.load_dataset("imagefolder", data_dir=cfg.dataset)
        else:  # a hub dataset: its download's progress bars are real
            splits = datasets.load_dataset(cfg.dataset, cfg.dataset_config or None)
    except Exception as e:  # no images, unreadable files, offline, a wrong name
        raise ConfigError(
            f"dataset '{cfg.dataset}' could not be read as images: {first_line(e)}"
        ) from None
    if cfg.dataset_split not in splits:
        raise ConfigError(
            f"dataset_split '{cfg.dataset_split}' is not a split of '{cfg.dataset}' (splits: {', '.join(splits)})"
        )
    return splits


@contextmanager
def datasets_bars_off():
    """datasets' progress bars off meanwhile, as they were after. Reading a local folder, its download
    step "downloads" each image file to its own path and draws a bar of them ("Downloading data: 90
    files"); nothing comes from anywhere, and the split is generated from the paths in a moment."""
    import datasets

    were_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not were_off:
            datasets.enable_progress_bars()


def check_class_folders(folder: str) -> None:
    """One subfolder per class, at least two (in each split folder, where there are some). A class
    folder without images is said in a warning line, not refused: the run trains on the classes that
    have images (a class only added later is another run's data: a resume refuses it)."""
    root = Path(folder)
    splits = [root / name for name in SPLIT_FOLDERS if (root / name).is_dir()]
    for parent in splits or [root]:
        classes = sorted(p for p in parent.iterdir() if p.is_dir() and not p.name.startswith("."))
        holding = [c for c in classes if any(f.is_file() for f in c.rglob("*"))]
        for empty in sorted(set(classes) - set(holding)):
            if os.environ.get("RANK", "0") == "0":
                print(  # noqa: T201 - the data's one warning, from the first process
                    f"warning: class folder {empty} holds no image: it is not a class of this run",
                    file=sys.stderr,
                )
        if len(holding) == 1:
            raise ConfigError(
                f"dataset '{folder}': {parent} has one class folder ({holding[0].name}); a "
                "classifier needs two or more, one subfolder per class"
            )


def columns_of(dataset, name: str) -> tuple[str, str]:
    """The image column and the class label column, found by their types."""
    import datasets

    features = dataset.features
    images = [c for c, f in features.items() if isinstance(f, datasets.Image)]
    labels = [c for c, f in features.items() if isinstance(f, datasets.ClassLabel)]
    if not images or not labels:
        raise ConfigError(
            f"dataset '{name}' has no image column and class label column (columns: {', '.join(features)}): "
            f"keep one subfolder per class"
        )
    return images[0], labels[0]
