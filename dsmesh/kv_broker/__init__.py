"""KV handoff state machine between prefill and decode (docs/PD.md)."""
