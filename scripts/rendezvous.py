"""What scripts/torchrun_job.sh tells while torchrun waits for the job's nodes: one line every 30 s (or
a third of the timeout) saying how many nodes have joined, out of how many, and at which address, until
all have; the count, taken every second, is kept in STATE_FILE for the script's last line if they never
do, or if the job is stopped while it waits.

    python scripts/rendezvous.py STATE_FILE       (the job's shape from PET_NNODES, PET_NODE_RANK,
                                                   PET_MASTER_ADDR, PET_MASTER_PORT; RDZV_TIMEOUT_S)

Each node's watcher leaves a key of its own in the store torchrun's rendezvous runs on node 0 (keys of
its own, outside torchrun's), and counts the keys it finds there: the nodes whose job script runs and
reaches the main node. A node that cannot reach the main node's address counts none.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import time

KEY = "torchrun_job/joined/"  # + a node's rank
# how often the nodes are counted (said less often): the count a stop finds is at most this old, so
# a job stopped just after the last node joined is not said to have been waiting for it
COUNT_EVERY_S = 1.0


def main(state_file: str) -> int:
    nodes = int(os.environ.get("PET_NNODES", "1"))
    rank = int(os.environ.get("PET_NODE_RANK", "0"))
    address = f"{os.environ.get('PET_MASTER_ADDR', '127.0.0.1')}:{os.environ.get('PET_MASTER_PORT', '29500')}"
    timeout = float(os.environ.get("RDZV_TIMEOUT_S", "600"))
    every = min(30.0, timeout / 3)
    # none counted yet, before torch's import (seconds): a torchrun that gives up before the first
    # count still ends the job with its line
    with open(state_file, "w") as state:
        state.write(f"0 {nodes} {address}\n")
    from torch.distributed import TCPStore

    started = time.monotonic()
    said_at = -math.inf
    store = None
    joined = (
        0  # the last count taken: torchrun closes its store when it gives up, and that count stays
    )
    while nodes > 1:
        try:
            if store is None:
                host, port = address.rsplit(":", 1)
                store = TCPStore(
                    host,
                    int(port),
                    None,
                    False,
                    # short tries: the first line comes well inside a short RDZV_TIMEOUT_S
                    datetime.timedelta(seconds=min(5.0, every / 2)),
                    wait_for_workers=False,
                )
                store.set(f"{KEY}{rank}", "1")
            joined = sum(store.check([f"{KEY}{i}"]) for i in range(nodes))
            with open(state_file, "w") as state:
                state.write(f"{joined} {nodes} {address}\n")
        except Exception:  # the main node's store is not up (yet), or went away
            store = None
        if joined == nodes:
            break
        waited = time.monotonic() - started
        if waited - said_at >= every:
            print(
                f"waiting for the job's nodes: {joined} of {nodes} joined at {address} (this is node "
                f"{rank}; {waited:.0f} s so far, torchrun gives up after RDZV_TIMEOUT_S={timeout:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            said_at = waited
        time.sleep(COUNT_EVERY_S)
    with open(state_file, "w") as state:
        state.write(f"{nodes} {nodes} {address}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
