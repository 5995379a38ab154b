"""How a call to a prefill, decode or unified instance fails, as plain Python: a status code
named as gRPC names it, and the message. The handoff logic raises :class:`CallFailed`; the
handlers (dsmesh/instance/rpc.py) answer it as that status. No gRPC here.
"""

from __future__ import annotations

import enum

from dsmesh.v1 import kv_broker_pb2 as kb


class Code(enum.Enum):
    """A gRPC status code other than OK; each name equals its ``grpc.StatusCode`` name."""

    CANCELLED = enum.auto()
    UNKNOWN = enum.auto()
    INVALID_ARGUMENT = enum.auto()
    DEADLINE_EXCEEDED = enum.auto()
    NOT_FOUND = enum.auto()
    ALREADY_EXISTS = enum.auto()
    PERMISSION_DENIED = enum.auto()
    RESOURCE_EXHAUSTED = enum.auto()
    FAILED_PRECONDITION = enum.auto()
    ABORTED = enum.auto()
    OUT_OF_RANGE = enum.auto()
    UNIMPLEMENTED = enum.auto()
    INTERNAL = enum.auto()
    UNAVAILABLE = enum.auto()
    DATA_LOSS = enum.auto()
    UNAUTHENTICATED = enum.auto()


class CallFailed(Exception):
    """The call ends with status ``code`` and ``message``."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def already_active(request_id: str) -> CallFailed:
    return CallFailed(Code.ALREADY_EXISTS, f"request {request_id} is already active")


# A handoff that ended other than DONE, as the status of the call that waited on it: from its
# cause, else from its state. A layout mismatch is a deployment error, not an outage.
_CODE_OF_CAUSE = {
    kb.CAUSE_LAYOUT_MISMATCH: Code.FAILED_PRECONDITION,
    kb.CAUSE_TIMED_OUT: Code.DEADLINE_EXCEEDED,
    kb.CAUSE_CLIENT_ABORTED: Code.CANCELLED,
}
_CODE_OF_STATE = {
    kb.HANDOFF_TIMED_OUT: Code.DEADLINE_EXCEEDED,
    kb.HANDOFF_ABORTED: Code.CANCELLED,
}


def handoff_failed(state: int, cause: int, message: str) -> CallFailed:
    """The failure of a call whose handoff ended in ``state`` (a ``kb.HandoffState`` other
    than DONE) for ``cause`` (``kb.HandoffCause``): "KV handoff HANDOFF_FAILED: <message>"."""
    code = _CODE_OF_CAUSE.get(cause) or _CODE_OF_STATE.get(state, Code.UNAVAILABLE)
    name = kb.HandoffState.Name(state)
    return CallFailed(code, f"KV handoff {name}: {message}".strip(": "))
