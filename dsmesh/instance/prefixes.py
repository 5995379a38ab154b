"""What an instance tells routers about its prefix cache: the page names cached and evicted
since the reader's cursor, answered with ``GetLoad`` (docs/GATEWAY.md, KV-aware routing)."""

from __future__ import annotations

from dsmesh.engine.llm_engine import LLMEngine
from dsmesh.v1 import prefill_pb2


def prefix_digest(
    engine: LLMEngine, request: prefill_pb2.LoadRequest
) -> prefill_pb2.PrefixDigest | None:
    """Engine thread (inside ``worker.call``): the changes of ``engine``'s prefix cache since
    the request's cursor; None when the request asks for none or the cache is off."""
    cache = engine.scheduler.prefix_cache
    if cache is None or not request.HasField("prefixes"):
        return None
    changes = cache.changes_since(request.prefixes.epoch, request.prefixes.seq)
    return prefill_pb2.PrefixDigest(
        epoch=changes.epoch,
        seq=changes.seq,
        reset=changes.reset,
        page_size=cache.page_size,
        stored=changes.stored,
        removed=changes.removed,
    )
