"""Read a W&B offline run file (run-<id>.wandb) without a server.

wandb 0.31 writes offline runs only as this binary log (no summary or config JSON): a 7-byte `:W&B`
header, then LevelDB-log records in 32 KiB blocks, each a serialized wandb_internal_pb2.Record.
"""

import json
import struct

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path):
    data, pos, pending = open(path, "rb").read(), 7, b""
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        if kind == FULL:
            yield _parse(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield _parse(pending + chunk)


def _parse(raw):
    record = pb.Record()
    record.ParseFromString(raw)
    return record


def read_run(path) -> dict:
    """{'run_id', 'group', 'config': {key: value}, 'history': [{key: value}], 'exit_code'}."""
    run = {"run_id": None, "group": None, "config": {}, "history": [], "exit_code": None}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["run_id"] = record.run.run_id
            run["group"] = record.run.run_group
            for item in record.run.config.update:
                run["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                run["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            run["history"].append(
                {
                    (i.key or ".".join(i.nested_key)): json.loads(i.value_json)
                    for i in record.history.item
                }
            )
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run
