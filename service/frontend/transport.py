"""The gRPC transport: TLS and mutual TLS, bearer-token authentication, keepalive and
connection limits. server.py calls these where it builds the grpc.aio server and binds its port.
"""

from __future__ import annotations

import hashlib
import hmac
import ssl
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import structlog

from service.common.config import ConfigError, TransportConfig

log = structlog.get_logger(__name__)

# Clients may ping this often, with or without calls in flight. Half the 10 s interval that
# common client keepalive settings use, so timer jitter never counts as a ping strike; gRPC's
# own default (5 minutes, and none while idle) answers a 10 s pinger with GOAWAY too_many_pings.
MIN_CLIENT_PING_INTERVAL_MS = 5_000
# The server's own pings find dead peers (a vanished host sends no RST) and free their slots.
SERVER_KEEPALIVE_TIME_MS = 30_000
SERVER_KEEPALIVE_TIMEOUT_MS = 10_000

# Always open, so that probes and load balancers need no token.
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIXES = (
    "/grpc.reflection.v1.ServerReflection/",
    "/grpc.reflection.v1alpha.ServerReflection/",
)
AUTH_METADATA_KEY = "authorization"


def server_options(config: TransportConfig, api_workers: int) -> list[tuple[str, Any]]:
    """grpc core options of the server: port sharing, message size, keepalive policy,
    connection age."""
    options: list[tuple[str, Any]] = [
        # One front end alone gets the port to itself (so a second server fails to bind);
        # several share it (--api-workers), and the kernel spreads connections over them.
        ("grpc.so_reuseport", 1 if api_workers > 1 else 0),
        ("grpc.max_receive_message_length", config.max_request_bytes),
        ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", SERVER_KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
    ]
    if config.max_connection_age:
        # A GOAWAY after this age makes clients open a new connection (which a load balancer
        # can place elsewhere); streams in flight get the grace to finish.
        options += [
            ("grpc.max_connection_age_ms", round(config.max_connection_age * 1000)),
            (
                "grpc.max_connection_age_grace_ms",
                round(config.max_connection_age_grace * 1000),
            ),
        ]
    return options


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from exc


def server_credentials(config: TransportConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from --tls-cert/--tls-key (and --tls-client-ca: clients must present a
    certificate it signed); None to serve plaintext."""
    if not config.tls_cert:
        return None
    assert config.tls_key is not None  # config.validate() requires both
    cert = _read(config.tls_cert, "--tls-cert")
    key = _read(config.tls_key, "--tls-key")
    client_ca = _read(config.tls_client_ca, "--tls-client-ca") if config.tls_client_ca else None
    _check_pem(config)
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def _check_pem(config: TransportConfig) -> None:
    """Parse the files with the ssl module first: gRPC takes unparsable or mismatched PEM
    without a word and then fails every handshake."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key)
    except ssl.SSLError as exc:
        raise ConfigError(
            f"--tls-cert {config.tls_cert} and --tls-key {config.tls_key} are not a PEM "
            f"certificate and its private key ({exc.reason or exc})"
        ) from exc
    if config.tls_client_ca:
        try:
            context.load_verify_locations(cafile=config.tls_client_ca)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"--tls-client-ca {config.tls_client_ca} holds no PEM CA certificate "
                f"({exc.reason or exc})"
            ) from exc


def read_tokens(path: str) -> list[bytes]:
    """One token per line; blank lines and `#` comments are ignored."""
    try:
        text = _read(path, "--auth-token-file").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--auth-token-file {path} is not UTF-8 text") from exc
    tokens = [line.strip() for line in text.splitlines()]
    tokens = [t for t in tokens if t and not t.startswith("#")]
    if not tokens:
        raise ConfigError(f"--auth-token-file {path} holds no token (one per line)")
    if any(any(c.isspace() for c in t) for t in tokens):
        raise ConfigError(f"--auth-token-file {path}: a token contains whitespace")
    return [t.encode() for t in tokens]


class BearerTokenAuth(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call without `authorization: Bearer <token>` naming
    one of the known tokens, except health (always) and reflection (unless it is protected).
    A refused request is never deserialized."""

    def __init__(self, tokens: Sequence[bytes], *, protect_reflection: bool) -> None:
        # Comparing fixed-length digests leaks neither a token's content nor its length.
        self._digests = [hashlib.sha256(t).digest() for t in tokens]
        open_prefixes = [HEALTH_PREFIX, *([] if protect_reflection else REFLECTION_PREFIXES)]
        self._open = tuple(open_prefixes)

    def refusal(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """Why these call metadata are refused, or None when they carry a known token."""
        values = [v for k, v in metadata or () if k == AUTH_METADATA_KEY]
        if not values:
            return f"missing `{AUTH_METADATA_KEY}` metadata: send `authorization: Bearer <token>`"
        value = values[0] if isinstance(values[0], str) else values[0].decode("latin-1")
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return f"`{AUTH_METADATA_KEY}` metadata must be `Bearer <token>`"
        digest = hashlib.sha256(token.strip().encode()).digest()
        known = False
        for candidate in self._digests:  # no early exit: the time does not say which matched
            known |= hmac.compare_digest(digest, candidate)
        return None if known else f"`{AUTH_METADATA_KEY}`: unknown bearer token"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(self._open):
            return handler
        reason = self.refusal(handler_call_details.invocation_metadata)
        if reason is None:
            return handler
        log.warning("unauthenticated call refused", rpc=method, reason=reason)
        return _refusing_handler(handler, reason)


def _refusing_handler(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED; no deserializer,
    so the request's bytes are never parsed."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    serialize = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, None, serialize)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, None, serialize)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, None, serialize)
    return grpc.unary_unary_rpc_method_handler(refuse, None, serialize)


def auth_interceptor(config: TransportConfig) -> grpc.aio.ServerInterceptor | None:
    """Bearer-token authentication from --auth-token-file; None when it is not set."""
    if not config.auth_token_file:
        return None
    tokens = read_tokens(config.auth_token_file)
    if not config.tls_cert:
        log.warning("bearer tokens are accepted over plaintext: anyone on the path can read them")
    log.info(
        "bearer-token authentication on",
        tokens=len(tokens),
        reflection_requires_auth=config.reflection_requires_auth,
    )
    return BearerTokenAuth(tokens, protect_reflection=config.reflection_requires_auth)


def bind(server: grpc.aio.Server, config: TransportConfig) -> int:
    """Add the listening port (TLS when configured); the port bound, 0 when it could not be."""
    address = f"{config.host}:{config.port}"
    credentials = server_credentials(config)
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError:
        return 0
