"""KV handoff state machine between prefill and decode (PD-services issue)."""
