"""Download and pack a run's data into the Hugging Face cache ahead of training; see data/README.md.

python data/prepare.py --config train/configs/gpt2_small.yaml     # same flags as train/main.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))

from data import build_datasets  # noqa: E402
from errors import ConfigError  # noqa: E402
from mixture import build_data  # noqa: E402
from run_config import load_config  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    try:
        cfg = load_config(argv)
        train_set, eval_sets = build_data(cfg, build_datasets)  # a mixture: each of its sources
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if cfg.streaming:
        print(
            f"streaming: nothing to pack ahead; {len(eval_sets)} eval set(s) of held-out blocks read"
        )
        return
    parts = getattr(train_set, "parts", {"": train_set})
    for (name, train), eval_set in zip(parts.items(), eval_sets.values(), strict=True):
        tokens = (len(train) + len(eval_set)) * cfg.block_size
        print(
            f"{name or cfg.dataset}: {len(train):,} train and {len(eval_set):,} eval blocks of "
            f"{cfg.block_size} tokens ({tokens:,} tokens), cached for training"
        )


if __name__ == "__main__":
    main()
