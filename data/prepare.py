"""Download and pack a run's data into the Hugging Face cache ahead of training; see data/README.md.

python data/prepare.py --config train/configs/gpt2_small.yaml     # same flags as train/main.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))

from config import load_config
from data import build_datasets  # noqa: E402
from errors import ConfigError  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    try:
        cfg = load_config(argv)
        train_set, eval_set = build_datasets(cfg)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    tokens = (len(train_set) + len(eval_set)) * cfg.block_size
    print(
        f"{cfg.dataset}: {len(train_set):,} train and {len(eval_set):,} eval blocks of {cfg.block_size} "
        f"tokens ({tokens:,} tokens), cached for training"
    )


if __name__ == "__main__":
    main()
