"""The KV layout signature that prefill and decode must share, and the pool description."""

from __future__ import annotations

import hashlib
import json

from dsmesh.engine.llm_engine import LLMEngine
from dsmesh.v1 import kv_broker_pb2 as kb

_DTYPE_NAMES = {
    "torch.float32": "float32",
    "torch.bfloat16": "bfloat16",
    "torch.float16": "float16",
    "torch.float8_e4m3fn": "fp8_e4m3",  # --kv-cache-dtype fp8_e4m3: codes + scales per page
}


def model_fingerprint(engine: LLMEngine) -> str:
    """Short hash of the model's architecture (not its weights)."""
    text = json.dumps(engine.model_config.to_official_dict(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def layout_of(engine: LLMEngine, transport: str = "") -> kb.KVLayout:
    """The layout of ``engine``'s pool, moved by ``transport`` (its signature, e.g.
    "mooncake/nvlink_intra")."""
    pool = engine.kv_pool
    dtype = str(pool.dtype)  # the cache's values: a bf16 and an FP8 pool never match
    return kb.KVLayout(
        dtype=_DTYPE_NAMES.get(dtype, dtype),
        page_size=pool.page_size,
        kv_dim=pool.kv_dim,
        num_layers=pool.num_layers,
        model=model_fingerprint(engine),
        transport=transport,
    )
