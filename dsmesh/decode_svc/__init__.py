"""Decode service: page pre-allocation, continuous batching, token streaming (docs/PD.md)."""
