"""Unified instance: prefill and decode in one engine, behind the same gateway and API."""
