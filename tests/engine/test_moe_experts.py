"""The grouped-GEMM expert path equals the per-expert reference loop."""

from __future__ import annotations

import pytest
import torch

from dsmesh.engine.model.moe import RoutedExperts, grouped_mm_supported


@pytest.mark.parametrize("counts", [[3, 0, 2, 4], [0, 0, 0, 5], [1, 1, 1, 1], [0, 0, 0, 0]])
def test_grouped_equals_reference(counts: list[int]) -> None:
    g = torch.Generator().manual_seed(0)
    experts = RoutedExperts(4, hidden_size=16, intermediate_size=8)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(experts.w13.shape, generator=g))
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=g))
    tokens = torch.tensor(counts)
    x = torch.randn(int(tokens.sum()), 16, generator=g)
    with torch.no_grad():
        ref = experts.forward_reference(x, tokens)
        out = experts(x, tokens)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-5)


def test_grouped_mm_probe_is_cached_and_boolean() -> None:
    assert grouped_mm_supported(torch.float32, "cpu") in (True, False)
    assert grouped_mm_supported.cache_info().currsize >= 1
