"""Prefill service: chunked prefill and KV push into decode's pages (docs/PD.md)."""
