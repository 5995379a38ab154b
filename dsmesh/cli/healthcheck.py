"""``python -m dsmesh.cli.healthcheck TARGET...``: exit 0 when every target is healthy, else 1.

For container healthchecks (compose, Kubernetes ``exec`` probes when gRPC runs over TLS, which
the kubelet's native ``grpc:`` probe cannot speak). A target is ``HOST:PORT`` (standard
``grpc.health.v1`` Check of the whole server: SERVING) or an ``http(s)://`` URL (status 200,
e.g. the gateway's ``/health``). gRPC goes over TLS when ``DSMESH_TLS_*`` says so, exactly as
the services' own channels do (docs/SECURITY.md). Several targets check every rank of an
expert-parallel node (ports ``--port`` .. ``--port + ranks - 1``). Prints one line per
unhealthy target, naming it and why.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dsmesh.runtime.grpc_server import sync_channel
from dsmesh.runtime.security import TLSConfig


def check_grpc(address: str, timeout_s: float, tls: TLSConfig) -> str | None:
    """None when ``address`` answers SERVING, else why not."""
    with sync_channel(address, tls) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return None


def check_http(url: str, timeout_s: float) -> str | None:
    """None when ``url`` answers 200, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return None if resp.status == 200 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return str(getattr(exc, "reason", exc))


def check(target: str, timeout_s: float, tls: TLSConfig) -> str | None:
    if target.startswith(("http://", "https://")):
        return check_http(target, timeout_s)
    if ":" not in target:
        return "expected HOST:PORT or an http(s):// URL"
    return check_grpc(target, timeout_s, tls)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dsmesh.cli.healthcheck",
        description="Exit 0 when every target is healthy: gRPC health SERVING (HOST:PORT) "
        "or HTTP 200 (URL). TLS from DSMESH_TLS_* like the services.",
    )
    parser.add_argument("targets", nargs="+", metavar="TARGET", help="HOST:PORT or URL")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds per target (default 3)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        tls = TLSConfig.from_env_and_args()
    except (ValueError, FileNotFoundError) as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1
    failed = 0
    for target in args.targets:
        reason = check(target, args.timeout, tls)
        if reason is not None:
            print(f"healthcheck: {target}: {reason}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
