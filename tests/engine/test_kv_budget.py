"""dsmesh/engine/kv/budget.py: the KV pool sized from a memory fraction (fake memory numbers)."""

from __future__ import annotations

import pytest

from dsmesh.engine.kv.budget import GIB, KVBudget, KVBudgetError, kv_pool_tokens
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine

# DeepSeek-V2-Lite in bf16: 27 layers x (512 + 64) values x 2 bytes
V2_LITE_BYTES_PER_TOKEN = 27 * 576 * 2
H200 = 140 * GIB


def budget(fraction: float, used: int, total: int = H200, page: int = 16) -> KVBudget:
    return KVBudget(total, fraction, used, V2_LITE_BYTES_PER_TOKEN, page)


def test_pool_is_what_the_fraction_leaves_after_the_weights() -> None:
    b = budget(0.425, used=30 * GIB)  # one of two processes on an H200
    assert b.budget_bytes == int(H200 * 0.425) - 30 * GIB
    tokens = kv_pool_tokens(b, min_tokens=163840, max_tokens=1 << 40)
    assert tokens == b.budget_bytes // V2_LITE_BYTES_PER_TOKEN // 16 * 16
    assert tokens == 1_018_368  # 29.5 GiB / 31,104 bytes, rounded down to 16-token pages
    assert tokens % 16 == 0 and tokens * V2_LITE_BYTES_PER_TOKEN <= b.budget_bytes


def test_rounds_down_to_whole_pages() -> None:
    b = KVBudget(total_bytes=1000, mem_fraction=1.0, used_bytes=0, bytes_per_token=10, page_size=16)
    assert kv_pool_tokens(b, min_tokens=1, max_tokens=10_000) == 96  # 100 tokens -> 6 pages


def test_capped_at_what_the_engine_can_hold() -> None:
    b = budget(0.85, used=1 * GIB)
    assert kv_pool_tokens(b, min_tokens=4096, max_tokens=64 * 4096) == 64 * 4096
    assert kv_pool_tokens(b, min_tokens=10, max_tokens=1001) == 1008  # cap rounded up to pages


def test_refuses_a_budget_below_one_full_context_request() -> None:
    # 0.2 x 140 GiB = 28 GiB < 30 GiB of weights: nothing left
    with pytest.raises(KVBudgetError) as err:
        kv_pool_tokens(budget(0.2, used=30 * GIB), min_tokens=163840, max_tokens=1 << 40)
    msg = str(err.value)
    assert "--mem-fraction 0.2 of 140.0 GiB" in msg
    assert "one full-context request (163840 tokens) needs 4.75 GiB" in msg
    assert "--max-total-tokens" in msg
    # a little left, but less than one request of the model's context
    tight = budget(0.22, used=30 * GIB)  # 0.8 GiB left
    with pytest.raises(KVBudgetError, match="leaves 0.80 GiB for the KV pool"):
        kv_pool_tokens(tight, min_tokens=163840, max_tokens=1 << 40)
    assert kv_pool_tokens(tight, min_tokens=4096, max_tokens=1 << 40) > 4096


def test_rejects_a_fraction_outside_zero_to_one() -> None:
    for fraction in (0.0, 1.5):
        with pytest.raises(ValueError, match="mem_fraction"):
            kv_pool_tokens(budget(fraction, used=0), min_tokens=1, max_tokens=10)
        with pytest.raises(ValueError, match="mem_fraction"):
            EngineConfig(mem_fraction=fraction).validate()
    with pytest.raises(ValueError, match="max_total_tokens must be > 0"):
        EngineConfig(max_total_tokens=0).validate()


def test_cpu_keeps_its_default_pool_and_a_given_size() -> None:
    engine = LLMEngine(EngineConfig(device="cpu", mem_fraction=0.1))
    assert engine.kv_pool.num_pages * engine.config.page_size == 65536
    engine = LLMEngine(EngineConfig(device="cpu", page_size=16, max_total_tokens=1000))
    assert engine.kv_pool.num_pages == 63  # rounded up to pages, as before
