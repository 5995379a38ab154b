"""Transport security for every gRPC hop (TLS, mTLS) and API keys for the gateway.

:class:`TLSConfig` says which PEM files a process uses; flags win over the environment
(``DSMESH_TLS_CERT``, ``DSMESH_TLS_KEY``, ``DSMESH_TLS_CA``, ``DSMESH_TLS_CLIENT_AUTH``,
``DSMESH_TLS_SERVER_NAME``). One process holds one identity: its servers present
``cert_file``/``key_file``, its channels present the same pair (mTLS) and verify servers against
``ca_file``. ``dsmesh.runtime.grpc_server`` applies it: explicitly per server and channel, or
through the process-wide default each service sets at start-up (docs/SECURITY.md).

Each file, the switch and the name is an option (dsmesh/options/fields.py): a flag of every
command that takes :class:`SecurityOptions`, with its environment variable as the fallback.

API keys (``--api-key``, ``DSMESH_API_KEYS``: the gateway's ``api_keys`` option) guard the
gateway's public front doors: :class:`ApiKeyInterceptor` on gRPC, ``dsmesh.gateway.http_app``
on HTTP. Keys are compared in constant time.
"""

from __future__ import annotations

import argparse
import hmac
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from dsmesh.options.fields import from_args, nested, option

ENV_CERT = "DSMESH_TLS_CERT"
ENV_KEY = "DSMESH_TLS_KEY"
ENV_CA = "DSMESH_TLS_CA"
ENV_CLIENT_AUTH = "DSMESH_TLS_CLIENT_AUTH"
ENV_SERVER_NAME = "DSMESH_TLS_SERVER_NAME"
ENV_API_KEYS = "DSMESH_API_KEYS"

# Largest gRPC message sent or received (gRPC's own receive default is 4 MiB). A bigger one is
# refused with RESOURCE_EXHAUSTED; no KV byte travels over gRPC, so messages stay small.
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20

SECURITY = "security (docs/SECURITY.md)"  # the help group of these options


@dataclass(frozen=True)
class TLSConfig:
    """PEM files of one process; all empty = plaintext (the default).

    A server needs ``cert_file`` and ``key_file``; ``client_auth`` (mTLS) also needs
    ``ca_file``, which then verifies client certificates. A channel verifies the server against
    ``ca_file`` (the system roots when empty) and presents ``cert_file``/``key_file`` when set.
    ``server_name`` overrides the name checked in the server's certificate (default: the host
    of the address dialled).
    """

    cert_file: str = option("", "certificate chain", flag="--tls-cert", metavar="PEM", env=ENV_CERT)
    key_file: str = option("", "its key", flag="--tls-key", metavar="PEM", env=ENV_KEY)
    ca_file: str = option("", "CA that verifies peers", flag="--tls-ca", metavar="PEM", env=ENV_CA)
    client_auth: bool = option(
        False,
        "servers require client certificates: mTLS",
        flag="--tls-client-auth",
        env=ENV_CLIENT_AUTH,
    )
    server_name: str = option(
        "",
        "name expected in servers' certificates instead of the dialled host",
        flag="--tls-server-name",
        metavar="NAME",
        env=ENV_SERVER_NAME,
    )

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.client_auth and not (self.cert_file and self.ca_file):
            raise ValueError("--tls-client-auth needs --tls-cert, --tls-key and --tls-ca")
        if self.server_name and not self.enabled:
            raise ValueError("--tls-server-name needs TLS (--tls-cert/--tls-key or --tls-ca)")

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file or self.ca_file)

    @classmethod
    def from_env_and_args(
        cls, args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None
    ) -> TLSConfig:
        """Flags (``args`` parsed with these options) win over the environment (``env``,
        default ``os.environ``); the files must exist."""
        config = from_args(cls, args or argparse.Namespace(), env=env)
        for flag, path in (
            ("--tls-cert", config.cert_file),
            ("--tls-key", config.key_file),
            ("--tls-ca", config.ca_file),
        ):
            if path and not Path(path).is_file():
                raise FileNotFoundError(f"{flag} {path}: no such file")
        return config

    def server_credentials(self) -> grpc.ServerCredentials:
        if not (self.cert_file and self.key_file):
            raise ValueError("a TLS server needs --tls-cert and --tls-key")
        return grpc.ssl_server_credentials(
            [(_read(self.key_file), _read(self.cert_file))],
            root_certificates=_read(self.ca_file) if self.ca_file else None,
            require_client_auth=self.client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        own = self.cert_file and self.key_file
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file) if self.ca_file else None,
            private_key=_read(self.key_file) if own else None,
            certificate_chain=_read(self.cert_file) if own else None,
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def to_args(self) -> tuple[str, ...]:
        """The same config as ``dsmesh`` flags, for a child process (none when off)."""
        if not self.enabled:
            return ()
        flags: list[str] = []
        for flag, path in (
            ("--tls-cert", self.cert_file),
            ("--tls-key", self.key_file),
            ("--tls-ca", self.ca_file),
        ):
            if path:
                flags += [flag, str(Path(path).resolve())]  # a child may start elsewhere
        if self.server_name:
            flags += ["--tls-server-name", self.server_name]
        flags.append("--tls-client-auth" if self.client_auth else "--no-tls-client-auth")
        return tuple(flags)


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


@dataclass(frozen=True, kw_only=True)
class SecurityOptions:
    """TLS for every gRPC server and channel of a process, and its message size limit."""

    tls: TLSConfig = nested(TLSConfig, group=SECURITY)  # off by default
    max_message_bytes: int = option(
        DEFAULT_MAX_MESSAGE_BYTES,
        "largest gRPC message sent or received; beyond it RESOURCE_EXHAUSTED",
        metavar="N",
        group=SECURITY,
    )


# ---- API keys -----------------------------------------------------------------------------


def api_key(text: str) -> str:
    """One API key (``--api-key``, an item of ``DSMESH_API_KEYS``), stripped."""
    key = text.strip()
    if any(ch.isspace() for ch in key) or not key.isprintable():
        raise argparse.ArgumentTypeError("an API key must not contain spaces or control characters")
    return key


def bearer_matches(authorization: str | None, keys: Sequence[str]) -> bool:
    """Whether ``authorization`` is ``Bearer <one of keys>``. Every key is compared, each in
    constant time, so the time taken says nothing about the keys."""
    if not authorization:
        return False
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    given = token.strip().encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key.encode())
    return matched


# Probes and discovery stay open: orchestrators and grpcurl need no key.
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without metadata ``authorization: Bearer <key>`` (UNAUTHENTICATED),
    except health and reflection."""

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        self.keys = tuple(keys)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if bearer_matches(metadata.get("authorization"), self.keys):
            return handler
        return _denying(handler)


async def _deny(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        "missing or invalid API key: send metadata 'authorization: Bearer <key>'",
    )


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that only aborts with UNAUTHENTICATED."""
    codec = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_deny, **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_deny, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny, **codec)
    return grpc.unary_unary_rpc_method_handler(_deny, **codec)
