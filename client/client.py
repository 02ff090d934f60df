"""Sync and asyncio clients for mlxserve's GenerationService.

Only grpcio, grpcio-health-checking and the generated stubs are imported here, so the
client runs anywhere (no MLX, no server code). When opentelemetry is installed, calls made inside
an active span carry its trace context (see `with_trace_context`); it is imported lazily.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeAlias

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc

DEFAULT_TARGET = "localhost:50051"
SERVICE_NAME = "mlxserve.v1.GenerationService"
TOKEN_ENV = "MLXSERVE_TOKEN"

ChatLike: TypeAlias = Sequence[tuple[str, str]] | Sequence[Mapping[str, str]]
RequestLike: TypeAlias = pb.GenerateRequest | pb.StreamGenerateRequest | str
Metadata: TypeAlias = Sequence[tuple[str, str]] | None

# Generations are long-lived and the bench sends many at once: lift gRPC's small defaults.
_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]


@dataclass(frozen=True)
class TLSConfig:
    """TLS to the server. `ca_file`: PEM certificate(s) of the CA that signed the server's
    certificate (None: the system's trust roots). `cert_file` and `key_file`: this client's
    certificate and key, for a server that requires mutual TLS."""

    ca_file: str | Path | None = None
    cert_file: str | Path | None = None
    key_file: str | Path | None = None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a client certificate needs both cert_file and key_file")
        return grpc.ssl_channel_credentials(
            root_certificates=_read_pem(self.ca_file),
            private_key=_read_pem(self.key_file),
            certificate_chain=_read_pem(self.cert_file),
        )


def _read_pem(path: str | Path | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


@dataclass(frozen=True)
class Balancing:
    """Client-side load balancing over several replicas, for a target that names them all:
    `ipv4:10.0.0.1:50051,10.0.0.2:50051` or a DNS name with one address per replica
    (`dns:///mlxserve-headless.default.svc.cluster.local:50051`: a headless Kubernetes Service).

    Each call goes to the next replica in turn (`round_robin`). With `health_service` set, the
    channel watches each replica's grpc.health.v1 status for that service and sends calls only
    to the SERVING ones: a replica loading its model or draining gets none. A call that a
    replica refuses with UNAVAILABLE before answering anything (it began draining, or went
    away, between the pick and the call) is sent again, to another replica, up to
    `max_attempts` in all; once a reply has started, a call is never resent."""

    health_service: str | None = SERVICE_NAME
    max_attempts: int = 3
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if not 2 <= self.max_attempts <= 5:  # gRPC caps a retry policy at 5 attempts
            raise ValueError("max_attempts must be within [2, 5]")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("need 0 < initial_backoff_s <= max_backoff_s")

    def service_config(self) -> dict[str, Any]:
        """The gRPC service config (https://github.com/grpc/grpc/blob/master/doc/service_config.md)."""
        config: dict[str, Any] = {
            "loadBalancingConfig": [{"round_robin": {}}],
            "methodConfig": [
                {
                    "name": [{"service": SERVICE_NAME}],
                    "retryPolicy": {
                        "maxAttempts": self.max_attempts,
                        "initialBackoff": f"{self.initial_backoff_s}s",
                        "maxBackoff": f"{self.max_backoff_s}s",
                        "backoffMultiplier": 2,
                        "retryableStatusCodes": ["UNAVAILABLE"],
                    },
                }
            ],
        }
        if self.health_service is not None:
            config["healthCheckConfig"] = {"serviceName": self.health_service}
        return config

    def channel_options(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.service_config", json.dumps(self.service_config())),
            # Ours, not one a DNS TXT record might carry.
            ("grpc.service_config_disable_resolution", 1),
            ("grpc.enable_retries", 1),
        ]


def _channel(
    target: str,
    options: Sequence[tuple[str, Any]],
    tls: TLSConfig | None,
    balancing: Balancing | None,
    *,
    aio: bool,
) -> Any:
    balanced = balancing.channel_options() if balancing is not None else []
    options = [*_CHANNEL_OPTIONS, *balanced, *options]
    module: Any = grpc.aio if aio else grpc
    if tls is None:
        return module.insecure_channel(target, options=options)
    return module.secure_channel(target, tls.channel_credentials(), options=options)


def _auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    if token is None:
        return ()
    token = token.strip()
    if not token or any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError("the token must be non-empty printable text without spaces")
    return (("authorization", f"Bearer {token}"),)


def _call_metadata(auth: tuple[tuple[str, str], ...], metadata: Metadata) -> Metadata:
    """The token's `authorization`, the caller's metadata, then the trace context."""
    return with_trace_context([*auth, *metadata] if metadata else auth or None)


def _chat_messages(chat: ChatLike) -> list[pb.ChatMessage]:
    messages = []
    for turn in chat:
        if isinstance(turn, Mapping):
            messages.append(pb.ChatMessage(role=turn["role"], content=turn["content"]))
        else:
            role, content = turn
            messages.append(pb.ChatMessage(role=role, content=content))
    return messages


def response_format(
    *,
    json_schema: str | Mapping[str, Any] | None = None,
    json_object: bool = False,
    regex: str | None = None,
    grammar: str | None = None,
    choice: Sequence[str] | None = None,
) -> pb.ResponseFormat:
    """A ResponseFormat of exactly one kind (structured output). `json_schema`: the schema as
    JSON text or as a dict (sent as its JSON text); `grammar`: llguidance's Lark-like syntax;
    `choice`: the reply is exactly one of these strings."""
    given = {
        "json_schema": json_schema is not None,
        "json_object": json_object,
        "regex": regex is not None,
        "grammar": grammar is not None,
        "choice": choice is not None,
    }
    if sum(given.values()) != 1:
        raise ValueError("give exactly one of json_schema, json_object, regex, grammar, choice")
    if json_schema is not None:
        text = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        return pb.ResponseFormat(json_schema=text)
    if json_object:
        return pb.ResponseFormat(json_object=True)
    if regex is not None:
        return pb.ResponseFormat(regex=regex)
    if grammar is not None:
        return pb.ResponseFormat(grammar=grammar)
    return pb.ResponseFormat(choice=pb.ChoiceList(options=list(choice or ())))


def build_request(
    prompt: str | None = None,
    *,
    chat: ChatLike | None = None,
    token_ids: Sequence[int] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    seed: int | None = None,
    logit_bias: Mapping[int, float] | None = None,
    stop: Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    priority: int = 0,
    logprobs: bool = False,
    top_logprobs: int = 0,
    request_id: str = "",
    cache_prompt: bool | None = None,
    response_format: pb.ResponseFormat | None = None,
    adapter: str = "",
) -> pb.GenerateRequest:
    """A GenerateRequest from exactly one input (raw `prompt`, `chat` or `token_ids`).

    Parameters left as None stay unset, so the server applies its defaults. `response_format`
    (see `response_format()`) constrains the reply to a JSON Schema, a regex, a grammar or a
    choice. `adapter`: a LoRA adapter the server serves (GetModelInfo lists them); empty for
    the base model.
    """
    inputs_given = sum(x is not None for x in (prompt, chat, token_ids))
    if inputs_given != 1:
        raise ValueError("give exactly one of prompt, chat or token_ids")
    req = pb.GenerateRequest(
        request_id=request_id,
        priority=priority,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        adapter=adapter,
    )
    if prompt is not None:
        req.text = prompt
    elif chat is not None:
        req.chat.messages.extend(_chat_messages(chat))
    else:
        req.token_ids.ids.extend(token_ids or [])

    sampling = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "repetition_penalty": repetition_penalty,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "seed": seed,
    }
    for name, value in sampling.items():
        if value is not None:
            setattr(req.sampling, name, value)
    if logit_bias:
        for token_id, bias in logit_bias.items():
            req.sampling.logit_bias[int(token_id)] = float(bias)

    if max_tokens is not None:
        req.stopping.max_tokens = max_tokens
    if stop:
        req.stopping.stop.extend(stop)
    if stop_token_ids:
        req.stopping.stop_token_ids.extend(stop_token_ids)
    if ignore_eos:
        req.stopping.ignore_eos = True
    if cache_prompt is not None:
        req.cache_prompt = cache_prompt
    if response_format is not None:
        req.response_format.CopyFrom(response_format)
    return req


def to_stream_request(request: pb.GenerateRequest) -> pb.StreamGenerateRequest:
    """The same request for StreamGenerate (the two messages share field names and numbers)."""
    return pb.StreamGenerateRequest.FromString(request.SerializeToString())


def to_generate_request(request: pb.StreamGenerateRequest) -> pb.GenerateRequest:
    return pb.GenerateRequest.FromString(request.SerializeToString())


def _unary_request(request: RequestLike, params: dict[str, Any]) -> pb.GenerateRequest:
    if isinstance(request, str):
        return build_request(request, **params)
    if params:
        raise TypeError("request parameters are only accepted together with a prompt string")
    if isinstance(request, pb.StreamGenerateRequest):
        return to_generate_request(request)
    return request


def _stream_request(request: RequestLike, params: dict[str, Any]) -> pb.StreamGenerateRequest:
    if isinstance(request, pb.StreamGenerateRequest):
        if params:
            raise TypeError("request parameters are only accepted together with a prompt string")
        return request
    return to_stream_request(_unary_request(request, params))


def _tokenize_request(text: str | None, chat: ChatLike | None) -> pb.TokenizeRequest:
    if (text is None) == (chat is None):
        raise ValueError("give exactly one of text or chat")
    if text is not None:
        return pb.TokenizeRequest(text=text)
    return pb.TokenizeRequest(chat=pb.ChatInput(messages=_chat_messages(chat or [])))


_propagate: Any = None  # opentelemetry.propagate once looked up; False when not installed


def with_trace_context(metadata: Metadata) -> Metadata:
    """`metadata` plus the W3C trace context (`traceparent`, `tracestate`, `baggage`) of the
    caller's active OpenTelemetry span, injected with the global propagator. Unchanged when
    opentelemetry is not installed, when no span is active, or when the caller already sends a
    `traceparent` (e.g. the CLI's --traceparent)."""
    global _propagate
    if _propagate is None:
        try:
            from opentelemetry import propagate
        except ImportError:
            propagate = False
        _propagate = propagate
    if _propagate is False or (metadata and any(k == "traceparent" for k, _ in metadata)):
        return metadata
    carrier: dict[str, str] = {}
    _propagate.inject(carrier)
    if not carrier:
        return metadata
    return [*(metadata or ()), *carrier.items()]


def _is_serving(response: health_pb2.HealthCheckResponse) -> bool:
    return response.status == health_pb2.HealthCheckResponse.SERVING


class GenerationClient:
    """Blocking client. `request` arguments take a GenerateRequest, or a raw prompt string
    plus `build_request` keyword arguments (e.g. `client.generate("Hi", max_tokens=8)`).
    `tls` connects with TLS (plaintext without it); `token` is sent on every call as
    `authorization: Bearer <token>`; `balancing` spreads calls over the replicas a target
    names (see Balancing)."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        options: Sequence[tuple[str, Any]] = (),
        tls: TLSConfig | None = None,
        token: str | None = None,
        balancing: Balancing | None = None,
    ) -> None:
        self.target = target
        self._auth = _auth_metadata(token)
        self._channel = _channel(target, options, tls, balancing, aio=False)
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _metadata(self, metadata: Metadata) -> Metadata:
        return _call_metadata(self._auth, metadata)

    def generate(
        self,
        request: RequestLike,
        *,
        timeout: float | None = None,
        metadata: Metadata = None,
        **params: Any,
    ) -> pb.GenerateResponse:
        return self._stub.Generate(
            _unary_request(request, params), timeout=timeout, metadata=self._metadata(metadata)
        )

    def stream(
        self,
        request: RequestLike,
        *,
        timeout: float | None = None,
        metadata: Metadata = None,
        **params: Any,
    ) -> Iterator[pb.StreamGenerateResponse]:
        """Yields one message per decode step (several steps a message under load); leaving the
        loop early cancels the RPC."""
        call = self._stub.StreamGenerate(
            _stream_request(request, params), timeout=timeout, metadata=self._metadata(metadata)
        )
        try:
            yield from call
        finally:
            call.cancel()  # a no-op once the stream has ended; frees the server's slot otherwise

    def cache_stats(
        self, *, timeout: float | None = None, metadata: Metadata = None
    ) -> pb.CacheStatsResponse:
        return self._stub.CacheStats(
            pb.CacheStatsRequest(), timeout=timeout, metadata=self._metadata(metadata)
        )

    def model_info(
        self, *, timeout: float | None = None, metadata: Metadata = None
    ) -> pb.GetModelInfoResponse:
        return self._stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata(metadata)
        )

    def tokenize(
        self,
        text: str | None = None,
        *,
        chat: ChatLike | None = None,
        timeout: float | None = None,
        metadata: Metadata = None,
    ) -> pb.TokenizeResponse:
        return self._stub.Tokenize(
            _tokenize_request(text, chat), timeout=timeout, metadata=self._metadata(metadata)
        )

    def load_adapter(
        self, name: str, path: str, *, timeout: float | None = None, metadata: Metadata = None
    ) -> pb.AdapterInfo:
        """Serve the mlx-lm adapter directory `path` (on the server) as `name`."""
        request = pb.LoadAdapterRequest(name=name, path=path)
        response = self._stub.LoadAdapter(
            request, timeout=timeout, metadata=self._metadata(metadata)
        )
        return response.adapter

    def unload_adapter(
        self, name: str, *, timeout: float | None = None, metadata: Metadata = None
    ) -> int:
        """Stop serving `name`; returns how many running requests still use it (it goes
        once they have finished)."""
        response = self._stub.UnloadAdapter(
            pb.UnloadAdapterRequest(name=name), timeout=timeout, metadata=self._metadata(metadata)
        )
        return response.pending_requests

    def wait_ready(self, timeout: float = 120.0, *, service: str = "") -> None:
        """Block until grpc.health reports SERVING for `service` ("" = the whole server).

        Raises TimeoutError if it does not within `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        last_error = "no answer"
        while (left := deadline - time.monotonic()) > 0:
            try:
                response = self._health.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=min(left, 5.0)
                )
                if _is_serving(response):
                    return
                last_error = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
            except grpc.RpcError as err:  # not listening yet, or the service not registered yet
                last_error = f"{err.code().name}: {err.details()}"
            time.sleep(min(0.25, max(deadline - time.monotonic(), 0)))
        raise TimeoutError(f"{self.target} not SERVING after {timeout:.0f}s ({last_error})")


class AsyncGenerationClient:
    """asyncio client (grpc.aio); the same methods and arguments as GenerationClient,
    awaitable."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        options: Sequence[tuple[str, Any]] = (),
        tls: TLSConfig | None = None,
        token: str | None = None,
        balancing: Balancing | None = None,
    ) -> None:
        self.target = target
        self._auth = _auth_metadata(token)
        self._channel = _channel(target, options, tls, balancing, aio=True)
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def __aenter__(self) -> AsyncGenerationClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def _metadata(self, metadata: Metadata) -> Metadata:
        return _call_metadata(self._auth, metadata)

    async def generate(
        self,
        request: RequestLike,
        *,
        timeout: float | None = None,
        metadata: Metadata = None,
        **params: Any,
    ) -> pb.GenerateResponse:
        return await self._stub.Generate(
            _unary_request(request, params), timeout=timeout, metadata=self._metadata(metadata)
        )

    async def stream(
        self,
        request: RequestLike,
        *,
        timeout: float | None = None,
        metadata: Metadata = None,
        **params: Any,
    ) -> AsyncIterator[pb.StreamGenerateResponse]:
        """Yields one message per decode step (several steps a message under load); closing the
        iterator early cancels the RPC."""
        call = self._stub.StreamGenerate(
            _stream_request(request, params), timeout=timeout, metadata=self._metadata(metadata)
        )
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()

    async def cache_stats(
        self, *, timeout: float | None = None, metadata: Metadata = None
    ) -> pb.CacheStatsResponse:
        return await self._stub.CacheStats(
            pb.CacheStatsRequest(), timeout=timeout, metadata=self._metadata(metadata)
        )

    async def model_info(
        self, *, timeout: float | None = None, metadata: Metadata = None
    ) -> pb.GetModelInfoResponse:
        return await self._stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata(metadata)
        )

    async def tokenize(
        self,
        text: str | None = None,
        *,
        chat: ChatLike | None = None,
        timeout: float | None = None,
        metadata: Metadata = None,
    ) -> pb.TokenizeResponse:
        return await self._stub.Tokenize(
            _tokenize_request(text, chat), timeout=timeout, metadata=self._metadata(metadata)
        )

    async def load_adapter(
        self, name: str, path: str, *, timeout: float | None = None, metadata: Metadata = None
    ) -> pb.AdapterInfo:
        request = pb.LoadAdapterRequest(name=name, path=path)
        response = await self._stub.LoadAdapter(
            request, timeout=timeout, metadata=self._metadata(metadata)
        )
        return response.adapter

    async def unload_adapter(
        self, name: str, *, timeout: float | None = None, metadata: Metadata = None
    ) -> int:
        response = await self._stub.UnloadAdapter(
            pb.UnloadAdapterRequest(name=name), timeout=timeout, metadata=self._metadata(metadata)
        )
        return response.pending_requests

    async def wait_ready(self, timeout: float = 120.0, *, service: str = "") -> None:
        """Wait until grpc.health reports SERVING; raises TimeoutError otherwise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last_error = "no answer"
        while (left := deadline - loop.time()) > 0:
            try:
                response = await self._health.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=min(left, 5.0)
                )
                if _is_serving(response):
                    return
                last_error = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
            except grpc.RpcError as err:
                last_error = f"{err.code().name}: {err.details()}"
            await asyncio.sleep(min(0.25, max(deadline - loop.time(), 0)))
        raise TimeoutError(f"{self.target} not SERVING after {timeout:.0f}s ({last_error})")
