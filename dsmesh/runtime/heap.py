"""Start-up objects out of the garbage collector's way.

After start-up a serving process holds hundreds of thousands of long-lived objects: modules,
parameters, graph runners, the tokenizer, protobuf descriptors, the gRPC server. CPython's
full (generation 2) collection walks every one of them, and it runs inside whatever the
process is doing when enough new objects have survived: on the engine thread, that is a
decode step. With the tiny V3 model's MTP engine at batch 128 on a CPU (about 209,000
objects), one such collection took 95 ms, inside one step of 25 ms.

:func:`freeze_startup_heap` collects once, then moves every live object to the permanent
generation (``gc.freeze``), which collections skip, as SGLang and vLLM do after warm-up. The
engine instances (``serve_attached``) and the gateway call it once they serve. Objects made
later (requests, outputs) are collected as before; frozen ones are still freed by reference
counting when they die, only a frozen cycle is never collected.

Before that, :func:`imports_unscanned` keeps the collector off while a command's modules
load: an engine process's imports (torch, the engine, gRPC) make about 280,000 objects, and
the collector would walk the growing heap about 400 times on the way, three of them full
collections (0.1 to 0.25 s of every engine process's start on a CPU, docs/RELIABILITY.md,
Restart time).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect, then freeze every live object; returns how many are frozen in all."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("garbage collector: %d start-up objects frozen", frozen)
    return frozen


@contextmanager
def imports_unscanned(freeze: bool) -> Iterator[None]:
    """Run the block (a command's imports) with the cyclic collector off, then turn it back
    on as it was. ``freeze``: first move every live object to the permanent generation
    (``gc.freeze``): modules, classes and functions live as long as the process, so no
    collection needs to walk them. Only a process's own command should freeze (a caller that
    runs a command in-process, a test, keeps its objects collectable). Nothing in the block
    may depend on a collection: no device memory is allocated while the collector is off."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if enabled:
            gc.enable()
