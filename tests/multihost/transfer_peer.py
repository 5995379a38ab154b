"""The receiving side of tests/multihost/test_transfer_stall.py, run inside a host:
``python -m tests.multihost.transfer_peer HOST``. It registers a KV pool with its own Mooncake
transfer engine on HOST, prints the pool's RemotePool as one JSON line, then answers each
line on stdin with one JSON line: every page's distinct values (``[[...], ...]``, page 0
first), so the test sees which writes landed."""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from dsmesh.engine.kv.pool import MLAKVPool
from dsmesh.runtime.transfer.mooncake import MooncakeTransport

NUM_LAYERS, NUM_PAGES, PAGE_SIZE, KV_DIM = 2, 4, 16, 64


def pool() -> MLAKVPool:
    return MLAKVPool(NUM_LAYERS, NUM_PAGES, PAGE_SIZE, KV_DIM, torch.float32)


def main() -> None:
    transport = MooncakeTransport(hostname=sys.argv[1])
    kv = pool()
    print(json.dumps(dataclasses.asdict(transport.register_pool(kv))), flush=True)
    for _ in sys.stdin:
        pages = [kv.buffer[:, p].unique().tolist() for p in range(NUM_PAGES)]
        print(json.dumps(pages), flush=True)
    transport.close()


if __name__ == "__main__":
    main()
