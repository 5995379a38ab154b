"""dsmesh.bench.shared_prefix's ``--caches``: ``both`` runs the cache on and off."""

from __future__ import annotations

import pytest

from dsmesh.bench.shared_prefix import cache_runs


def test_both_means_on_then_off() -> None:
    assert cache_runs("both") == ["on", "off"]
    assert cache_runs("on,off") == ["on", "off"]
    assert cache_runs("off") == ["off"]


@pytest.mark.parametrize("text", ["", "yes", "on,maybe"])
def test_anything_else_is_refused(text: str) -> None:
    with pytest.raises(SystemExit, match="--caches"):
        cache_runs(text)
