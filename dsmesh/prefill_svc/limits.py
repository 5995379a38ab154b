"""The prefill servicer's limits: one frozen dataclass, which dsmesh/prefill_svc/service.py
builds from the instance's PrefillConfig; both halves of the servicer read it (the request
path in servicer.py, the transfer side in handoff_jobs.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillLimits:
    instance_id: str
    resolve_wait_s: float = 30.0  # how long to wait for decode's reservation
    max_queued_tokens: int = 262144  # prompt tokens admitted and not finished, at most
    broker_rpc_timeout_s: float = 5.0
    # new prompts wait while the KV writes queued would take longer than this to drain
    max_transfer_backlog_s: float = 1.0
    # while writes to a decode complete, a handoff waiting on them reports at this period:
    # its kv_broker deadline follows the lane's pace (docs/PD.md, "Deadlines")
    progress_refresh_s: float = 2.0
