"""The eval metrics of an exported model, computed without the template's evaluation: one process, one
sample at a time (no batching, padding, sharding or gathering), with plain torch. Run from a fork's folder:

    python independent_eval.py FORK_FOLDER RUN_FOLDER    prints {"accuracy": ..., ...} as JSON

Image and text classifiers: the mean loss, accuracy, and per class accuracy/<class> and f1/<class>, the mean of the
F1s (f1_macro) and, for two classes, f1 (the second, positive class's): every metric either example reports, so
that a test compares each reported key. Language models: the mean next-token loss over every predicted token of
the eval blocks.
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

fork, run = Path(sys.argv[1]), Path(sys.argv[2])
sys.path.insert(0, str(fork / "train"))

from safetensors.torch import load_model  # noqa: E402

import data  # noqa: E402
import model as task  # noqa: E402
from run_config import saved_config  # noqa: E402

cfg = saved_config(run / "config.yaml")
_, eval_set = data.build_datasets(cfg)
model = task.build_model(cfg)
load_model(model, str(run / "model.safetensors"), strict=False)  # tied weights are stored once
model.eval()
labels, predicted, token_losses, sample_losses = [], [], [], []
with torch.no_grad():
    for index in range(len(eval_set)):
        batch = data.collate([eval_set[index]])
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
        if logits.dim() == 2:  # a classifier: (1, classes)
            labels.append(int(batch["labels"][0]))
            predicted.append(int(logits[0].argmax()))
            sample_losses.append(F.cross_entropy(logits, batch["labels"]).double().item())
        else:  # a causal LM: position t predicts token t + 1
            token_losses.append(
                F.cross_entropy(logits[0, :-1], batch["labels"][0, 1:], reduction="none")
            )
pairs = list(zip(predicted, labels, strict=True))
if token_losses:
    print(json.dumps({"loss": torch.cat(token_losses).double().mean().item()}))
    sys.exit(0)
metrics = {
    "loss": sum(sample_losses) / len(labels),
    "accuracy": sum(p == y for p, y in pairs) / len(labels),
}
classes = data.class_names(cfg)  # both classifiers' data.py name their classes
for index, name in enumerate(classes):
    of_class = [p == y for p, y in pairs if y == index]
    if of_class:
        metrics[f"accuracy/{name}"] = sum(of_class) / len(of_class)
    tp = sum(p == index and y == index for p, y in pairs)
    wrong = sum((p == index) != (y == index) for p, y in pairs)
    metrics[f"f1/{name}"] = 2 * tp / (2 * tp + wrong) if tp + wrong else 0.0
f1s = [metrics[f"f1/{name}"] for name in classes]
metrics["f1_macro"] = sum(f1s) / len(f1s)
if len(f1s) == 2:
    metrics["f1"] = f1s[1]
print(json.dumps(metrics))
