"""Decode service: page pre-allocation, continuous batching, token streaming (PD-services issue)."""
