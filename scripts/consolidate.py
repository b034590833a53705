"""Turn a sharded (FSDP/HSDP) checkpoint's weights into one model.safetensors, on any machine, in one process:

    python scripts/consolidate.py runs/run_001/checkpoints/step_00001000 model_step_1000.safetensors

The file is the one an unsharded run exports (the same bytes for the same weights): load it with build_model and
safetensors' load_model, sample from it, or start a new run from it with --init_from. The model is rebuilt from
the checkpoint's own config.yaml, so shapes are checked as the shards are read. A LoRA run's checkpoint
(--lora_r) holds the adapters alone: the file is those, as an unsharded LoRA run's checkpoint holds them.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))

from adapters import trainable_weights  # noqa: E402
from checkpoint import save_safetensors  # noqa: E402
from run_config import saved_config  # noqa: E402
from task import training_model  # noqa: E402 - model.py's, through the seam


def consolidate(checkpoint: Path, out: Path) -> None:
    import torch.distributed.checkpoint as dcp

    if not (checkpoint / "model" / ".metadata").is_file():
        sys.exit(
            f"error: {checkpoint} holds no sharded model (model/.metadata); an unsharded checkpoint's "
            f"model.safetensors is already one file"
        )
    cfg = saved_config(checkpoint / "config.yaml")
    # a Hugging Face model: its architecture; the shards hold the weights
    cfg = replace(cfg, model_weights="config")
    model = training_model(cfg)  # with its adapters, if the run had some
    # the keys the shards were saved under; read into the model in place
    state = {"model": trainable_weights(model) if cfg.lora_r else model.state_dict()}
    # "no process group: loading in a single process", which is the point
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=checkpoint / "model")
    save_safetensors(state["model"] if cfg.lora_r else model, out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "checkpoint", type=Path, help="a checkpoint folder (checkpoints/step_N) of a sharded run"
    )
    parser.add_argument("out", type=Path, help="the .safetensors file to write")
    args = parser.parse_args()
    consolidate(args.checkpoint, args.out)
    print(f"model: {args.out}")
