"""GenerationService on a front end: translates between gRPC messages and the engine core.

Validation and tokenization (off the event loop), the first compile of a response format (on
the grammar cache's threads: a format the engine refuses is refused here, before the request is
queued), detokenization and stop strings (service.frontend.stream), streaming and telemetry
live here; scheduling and forwards live in the engine-core process, reached through
`CoreClient`. No policy here: how a request ended is
its RequestStream's to say; this module turns that into messages and statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc
import structlog

from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from service import protocol
from service.common import grammar
from service.common.config import ADAPTER_NAME, FrontendProcessConfig, StructuredOutputConfig
from service.common.grammar import GrammarCache, GrammarError, format_field
from service.common.tokenizer import Tokenizer
from service.frontend import errors
from service.frontend.core_client import CoreClient
from service.frontend.messages import adapter_info, cache_stats_response, model_info_response
from service.frontend.stream import Delta, Failure, RequestStream
from service.frontend.telemetry.telemetry import Telemetry
from service.frontend.validation import (
    InvalidRequestError,
    UnknownAdapterError,
    generation_request,
    kv_budget_refusal,
    prompt_token_ids,
)
from service.protocol import Final, FinishReason, GenerationRequest

log = structlog.get_logger(__name__)

_FINISH = {
    FinishReason.STOP.value: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH.value: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED.value: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR.value: pb.FINISH_REASON_ERROR,
}
BACKEND_ERROR = "inference backend error"
CORE_GONE_MESSAGE = "the engine core exited; the server is restarting"
T = TypeVar("T")
Code = grpc.StatusCode


@dataclass(frozen=True)
class ServedModel:
    """What a front end knows of the loaded model (from the core's Ready message)."""

    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    slot_context: int
    capacity_tokens: int | None
    prompt_cache: bool  # the core keeps a prompt-prefix cache
    info: pb.GetModelInfoResponse
    grammar: GrammarCache | None = None  # response formats (None: not available)
    adapters: tuple[str, ...] = ()  # the LoRA adapters requests may name

    def with_adapters(self, adapters: list[protocol.AdapterDescription]) -> ServedModel:
        """The same model, serving these adapters now."""
        info = pb.GetModelInfoResponse()
        info.CopyFrom(self.info)
        del info.adapters[:]
        info.adapters.extend(adapter_info(a) for a in adapters)
        return dataclasses.replace(self, info=info, adapters=tuple(a.name for a in adapters))


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(
        self, config: FrontendProcessConfig, client: CoreClient, telemetry: Telemetry
    ) -> None:
        self.config = config
        self.client = client
        self.telemetry = telemetry
        self.model: ServedModel | None = None  # set once the core's model is loaded (set_model)
        self._adapters: list[protocol.AdapterDescription] | None = None  # changed since Ready
        client.on_adapters = self._adapters_changed
        self.draining = False
        # Tokenization (and validation, which walks every token id) runs here, never on the
        # event loop: a big prompt would stall every stream and health check meanwhile. The
        # tokenizers library releases the GIL while it encodes.
        self._prompt_pool = ThreadPoolExecutor(
            max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="tokenize"
        )

    def set_model(self, model: ServedModel) -> None:
        """The core's model is loaded (with any adapter change that arrived meanwhile)."""
        self.model = model if self._adapters is None else model.with_adapters(self._adapters)

    def _adapters_changed(self, adapters: list[protocol.AdapterDescription]) -> None:
        """An adapter was loaded or began to unload (on any front end)."""
        self._adapters = adapters
        if self.model is not None:
            self.model = self.model.with_adapters(adapters)

    @property
    def serving(self) -> bool:
        return self.model is not None and not self.draining and not self.client.gone.is_set()

    def unavailable_reason(self) -> str:
        if self.client.gone.is_set():
            return CORE_GONE_MESSAGE
        return "server is draining" if self.draining else "model is loading"

    def close(self) -> None:
        self._prompt_pool.shutdown(wait=False, cancel_futures=True)
        if self.model is not None and self.model.grammar is not None:
            self.model.grammar.close()

    def _unavailable(self) -> grpc.Status:
        """UNAVAILABLE with RetryInfo: loading, draining (another replica can take the call)
        or the engine core gone (the server restarts)."""
        if self.client.gone.is_set():
            reason = errors.ENGINE_GONE
        else:
            reason = errors.DRAINING if self.draining else errors.MODEL_LOADING
        return errors.rich_status(
            Code.UNAVAILABLE,
            self.unavailable_reason(),
            reason=reason,
            retry_after_s=errors.RETRY_AFTER_S,
        )

    async def _reject(
        self,
        context: Any,
        status: grpc.Status,
        *,
        metric: str,
        field: str | None = None,
        request_id: str | None = None,
    ) -> NoReturn:
        """Refuse a request before it runs: one log line, the rejection metric, the status."""
        level = log.info if status.code is Code.INVALID_ARGUMENT else log.warning
        level(
            "request rejected",
            code=status.code.name,
            field=field,
            request_id=request_id or None,
            reason=status.details,
            frontend=self.client.name,
        )
        self.telemetry.rejected(metric)
        await errors.abort(context, status)

    async def _invalid(
        self, context: Any, exc: InvalidRequestError, request_id: str | None
    ) -> NoReturn:
        status = errors.rich_status(
            Code.INVALID_ARGUMENT, str(exc), reason=errors.INVALID_REQUEST, field=exc.field
        )
        await self._reject(
            context, status, metric="invalid_argument", field=exc.field, request_id=request_id
        )

    async def _not_found(
        self, context: Any, message: str, name: str, served: Any, request_id: str | None
    ) -> NoReturn:
        """A request (or an UnloadAdapter) names an adapter the server does not serve."""
        status = errors.rich_status(
            Code.NOT_FOUND,
            message,
            reason=errors.ADAPTER_NOT_FOUND,
            metadata={"adapter": name, "served": ",".join(served)},
        )
        await self._reject(
            context, status, metric="adapter_not_found", field="adapter", request_id=request_id
        )

    async def _off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._prompt_pool, functools.partial(fn, *args, **kwargs))

    # -- RPCs -----------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: Any) -> pb.GenerateResponse:
        response = pb.GenerateResponse()
        async with contextlib.aclosing(self._run(request, context, streaming=False)) as run:
            async for request_id, delta in run:
                response.request_id = request_id
                response.text += delta.text
                response.token_ids.extend(delta.token_ids)
                self._fill_extras(response, delta)
        return response

    async def StreamGenerate(
        self, request: pb.StreamGenerateRequest, context: Any
    ) -> AsyncIterator[pb.StreamGenerateResponse]:
        # Closed with this stream, however it ends: the request's cleanup (abort in the core,
        # telemetry) runs then, not whenever the generator is collected.
        async with contextlib.aclosing(self._run(request, context, streaming=True)) as run:
            async for request_id, delta in run:
                message = pb.StreamGenerateResponse(
                    request_id=request_id, text=delta.text, token_ids=delta.token_ids
                )
                self._fill_extras(message, delta)
                yield message

    async def CacheStats(
        self, request: pb.CacheStatsRequest, context: Any
    ) -> pb.CacheStatsResponse:
        if self.model is None or self.client.gone.is_set():
            return pb.CacheStatsResponse()
        try:
            return cache_stats_response(await self.client.stats())
        except TimeoutError:
            status = errors.rich_status(
                Code.UNAVAILABLE,
                "the engine core did not answer",
                reason=errors.ENGINE_NOT_ANSWERING,
                retry_after_s=errors.RETRY_AFTER_S,
            )
            await errors.abort(context, status)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: Any
    ) -> pb.GetModelInfoResponse:
        if self.model is None:
            await errors.abort(context, self._unavailable())
        return self.model.info

    async def Tokenize(self, request: pb.TokenizeRequest, context: Any) -> pb.TokenizeResponse:
        if self.model is None:
            await errors.abort(context, self._unavailable())
        try:
            return await self._off_loop(self._tokenize, request, self.model)
        except InvalidRequestError as exc:
            await self._invalid(context, exc, None)

    async def LoadAdapter(
        self, request: pb.LoadAdapterRequest, context: Any
    ) -> pb.LoadAdapterResponse:
        if not self.serving:
            await self._reject(context, self._unavailable(), metric="unavailable")
        if not ADAPTER_NAME.fullmatch(request.name):
            message = (
                f"name {request.name!r}: use letters, digits, '.', '_' and '-' (at most 64, "
                "starting with a letter or digit)"
            )
            await self._invalid(context, InvalidRequestError(message, field="name"), None)
        if not request.path:
            message = "path is required: an mlx-lm adapter directory on the server"
            await self._invalid(context, InvalidRequestError(message, field="path"), None)
        reply = await self._adapter_reply(
            context, self.client.load_adapter(request.name, request.path)
        )
        if reply.error is not None:
            if reply.reason == "exists":
                status = errors.rich_status(
                    Code.ALREADY_EXISTS, reply.error, reason=errors.ADAPTER_EXISTS
                )
                await self._reject(context, status, metric="already_exists", field="name")
            status = errors.rich_status(
                Code.INVALID_ARGUMENT, reply.error, reason=errors.ADAPTER_REFUSED, field="path"
            )
            await self._reject(context, status, metric="invalid_argument", field="path")
        assert reply.adapter is not None
        log.info(
            "adapter loaded", adapter=request.name, path=request.path, frontend=self.client.name
        )
        return pb.LoadAdapterResponse(adapter=adapter_info(reply.adapter))

    async def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest, context: Any
    ) -> pb.UnloadAdapterResponse:
        if not self.serving:
            await self._reject(context, self._unavailable(), metric="unavailable")
        reply = await self._adapter_reply(context, self.client.unload_adapter(request.name))
        if reply.error is not None:
            assert self.model is not None
            await self._not_found(context, reply.error, request.name, self.model.adapters, None)
        log.info(
            "adapter unloading",
            adapter=request.name,
            pending_requests=reply.pending_requests,
            frontend=self.client.name,
        )
        return pb.UnloadAdapterResponse(pending_requests=reply.pending_requests)

    async def _adapter_reply(self, context: Any, command: Any) -> protocol.AdapterReply:
        try:
            return await command
        except ConnectionError:
            await errors.abort(context, self._unavailable())

    def _tokenize(self, request: pb.TokenizeRequest, model: ServedModel) -> pb.TokenizeResponse:
        tok = model.tokenizer
        ids = prompt_token_ids(
            request,
            tok,
            slot_context=None,  # counted whatever its size
            allow_special_tokens_in_content=self.config.frontend.allow_special_tokens_in_content,
        )
        response = pb.TokenizeResponse(
            token_count=len(ids),
            fits_slot_context=len(ids) < model.slot_context,
            slot_context_tokens=model.slot_context,
        )
        if not request.count_only:
            response.token_ids.extend(ids)
            response.tokens.extend(tok.id_to_token(i) for i in ids)
        return response

    # -- the request path -------------------------------------------------------------
    async def _run(
        self, message: Any, context: Any, *, streaming: bool
    ) -> AsyncIterator[tuple[str, Delta]]:
        """Validate, queue and follow one request; yields (request_id, delta) as the engine
        produces tokens (several steps in one delta when this RPC fell behind); aborts with a
        status on failure."""
        received = time.monotonic()
        self.telemetry.rpc_request(message, streaming=streaming)
        req = await self._admit(message, context)
        model = self.model
        assert model is not None
        state = self.telemetry.request_started(req, received, streaming=streaming)
        stream = self.client.submit(
            req, model.tokenizer, model.eos_token_ids, state.ids if state is not None else None
        )
        bound = log.bind(request_id=req.request_id, frontend=self.client.name)
        bound.info(
            "request queued",
            prompt_tokens=len(req.prompt_token_ids),
            max_tokens=req.max_tokens,
            priority=req.priority,
            adapter=req.adapter or None,
        )
        try:
            while True:
                delta = await stream.next_delta()
                if stream.failure is not None:
                    await self._failed(context, stream)
                self.telemetry.request_events(state, delta.events)
                self.telemetry.request_tokens(state, len(delta.token_ids))
                if delta.final is not None:
                    self.telemetry.request_finished(state, delta.final)
                    await self._ended(context, bound, delta)
                if delta:
                    yield req.request_id, delta
                if delta.final is not None:
                    return
        finally:
            self.client.close(stream)
            self.telemetry.request_ended(state, stream.final is not None, len(stream.token_ids))
            if not stream.ended:
                bound.info("request cancelled by the client")

    async def _admit(self, message: Any, context: Any) -> GenerationRequest:
        """The validated request, or the RPC ends here with the reason."""
        if not self.serving:
            await self._reject(
                context, self._unavailable(), metric="unavailable", request_id=message.request_id
            )
        model = self.model
        assert model is not None
        try:
            req = await self._off_loop(
                generation_request,
                message,
                model.tokenizer,
                slot_context=model.slot_context,
                default_max_tokens=self.config.frontend.default_max_tokens,
                prompt_cache_enabled=model.prompt_cache,
                allow_special_tokens_in_content=self.config.frontend.allow_special_tokens_in_content,
                adapters=model.adapters,
            )
        except InvalidRequestError as exc:
            await self._invalid(context, exc, message.request_id)
        except UnknownAdapterError as exc:
            await self._not_found(
                context, str(exc), exc.name, exc.served, message.request_id or None
            )
        if req.response_format is not None:
            await self._compile_format(context, req, model)
        # Nothing awaits from here to the submit but an abort: the ALREADY_EXISTS check and the
        # submit are one step for the event loop.
        prompt_tokens = len(req.prompt_token_ids)
        too_big = kv_budget_refusal(model.capacity_tokens, prompt_tokens, req.max_tokens)
        if too_big is not None:
            # It could never fit: no RetryInfo.
            status = errors.rich_status(
                Code.RESOURCE_EXHAUSTED,
                too_big,
                reason=errors.KV_BUDGET_EXCEEDED,
                metadata={
                    "capacity_tokens": str(model.capacity_tokens),
                    "needed_tokens": str(prompt_tokens + req.max_tokens),
                },
            )
            await self._reject(context, status, metric="kv_budget", request_id=req.request_id)
        if self.client.running(req.request_id):
            status = errors.rich_status(
                Code.ALREADY_EXISTS,
                f"request_id {req.request_id!r} is already running",
                reason=errors.REQUEST_ID_IN_USE,
            )
            await self._reject(
                context,
                status,
                metric="already_exists",
                field="request_id",
                request_id=req.request_id,
            )
        if not self.serving:  # the core died or a drain began while we tokenized
            await self._reject(
                context, self._unavailable(), metric="unavailable", request_id=req.request_id
            )
        return req

    async def _compile_format(
        self, context: Any, req: GenerationRequest, model: ServedModel
    ) -> None:
        """Compile the request's response format (cached; on the grammar cache's threads, the
        event loop only awaits) or refuse the request: INVALID_ARGUMENT naming the format's
        field, with the engine's reason."""
        fmt = req.response_format
        assert fmt is not None
        if model.grammar is None:
            refusal = GrammarError(
                "structured output is not available: the model's tokenizer cannot drive the "
                "grammar engine",
                grammar.UNSUPPORTED,
            )
        else:
            try:
                await asyncio.wrap_future(model.grammar.submit(fmt))
                return
            except GrammarError as exc:
                refusal = exc
        await self._refuse_format(context, req.request_id, fmt.kind, refusal.reason, refusal.code)

    async def _refuse_format(
        self, context: Any, request_id: str, kind: str, reason: str, code: str
    ) -> NoReturn:
        self.telemetry.format_refused(kind, code)
        field = format_field(kind)
        status = errors.rich_status(
            Code.INVALID_ARGUMENT,
            reason,
            reason=errors.INVALID_REQUEST,
            field=field,
            metadata={"engine": grammar.ENGINE, "refusal": code},
        )
        await self._reject(
            context, status, metric="invalid_argument", field=field, request_id=request_id
        )

    async def _failed(self, context: Any, stream: RequestStream) -> NoReturn:
        """The request could not run: the queue was full, the core refused its response
        format, its adapter was unloaded, or the core is gone."""
        request = stream.request
        if stream.failure is Failure.INVALID_FORMAT and request.response_format is not None:
            kind = request.response_format.kind
            await self._refuse_format(
                context, request.request_id, kind, stream.failure_message, stream.failure_code
            )
        if stream.failure is Failure.ADAPTER_NOT_FOUND:
            served = self.model.adapters if self.model is not None else ()
            await self._not_found(
                context, stream.failure_message, request.adapter, served, request.request_id
            )
        if stream.failure is Failure.QUEUE_FULL:
            status = errors.rich_status(
                Code.RESOURCE_EXHAUSTED,
                stream.failure_message,
                reason=errors.QUEUE_FULL,
                retry_after_s=errors.RETRY_AFTER_S,
            )
            await self._reject(
                context, status, metric="queue_full", request_id=stream.request.request_id
            )
        await errors.abort(context, self._unavailable())

    async def _ended(self, context: Any, bound: Any, delta: Delta) -> None:
        """The request ended: an engine error ends the RPC with INTERNAL; a drain's cancel
        is logged; anything else is the last message."""
        final = delta.final
        assert final is not None
        if final.reason == FinishReason.ERROR.value:
            bound.error("request failed", error=final.error)
            status = errors.rich_status(Code.INTERNAL, BACKEND_ERROR, reason=errors.ENGINE_ERROR)
            await errors.abort(context, status)
        if self.draining and final.reason == FinishReason.CANCELLED.value:
            bound.info("request cancelled by shutdown")

    def _fill_extras(self, message: Any, delta: Delta) -> None:
        """Logprobs and, on the last output, the final fields (skipped cheaply when absent:
        this runs once per step of every stream)."""
        if delta.logprobs:
            message.logprobs.extend(self._logprobs(delta))
        if delta.final is not None:
            _fill_final(message, delta.final)
            message.stop_string = delta.stop_string

    def _logprobs(self, delta: Delta) -> list[pb.TokenLogprob]:
        assert self.model is not None
        tok = self.model.tokenizer

        def spelled(token_id: int) -> dict[str, Any]:
            data = tok.token_bytes(token_id)
            return {
                "token_id": token_id,
                "token": tok.id_to_token(token_id),
                "text": data.decode("utf-8", errors="replace"),
                "bytes": data,
            }

        return [
            pb.TokenLogprob(
                **spelled(lp.token_id),
                logprob=lp.logprob,
                top_logprobs=[pb.TopLogprob(**spelled(t), logprob=v) for t, v in lp.top],
            )
            for lp in delta.logprobs
        ]


def _fill_final(message: Any, final: Final) -> None:
    message.finish_reason = _FINISH[final.reason]
    message.usage.CopyFrom(
        pb.Usage(
            prompt_tokens=final.prompt_tokens,
            completion_tokens=final.completion_tokens,
            cached_tokens=final.cached_tokens,
            drafted_tokens=final.drafted_tokens,
            accepted_tokens=final.accepted_tokens,
        )
    )
    message.timing.CopyFrom(
        pb.Timing(
            queue_seconds=final.queue_seconds,
            time_to_first_token_seconds=final.ttft_seconds,
            total_seconds=final.total_seconds,
        )
    )


def served_model(
    ready: protocol.Ready,
    structured: StructuredOutputConfig | None = None,
    observer: grammar.CompileObserver | None = None,
    tokenizer: Tokenizer | None = None,
) -> ServedModel:
    """The front end's view of the core's model (with the tokenizer the core saved, loaded here
    unless given), with a cache of compiled response formats when the core serves them."""
    from pathlib import Path

    if tokenizer is None:
        tokenizer = Tokenizer.load(Path(ready.tokenizer_dir))
    return ServedModel(
        tokenizer=tokenizer,
        eos_token_ids=frozenset(ready.eos_token_ids),
        slot_context=ready.slot_context,
        capacity_tokens=ready.capacity_tokens,
        prompt_cache=ready.prompt_cache,
        info=model_info_response(ready.model_info),
        grammar=_grammar_cache(ready, tokenizer, structured or StructuredOutputConfig(), observer),
        adapters=tuple(a.name for a in ready.model_info.adapters),
    )


def _grammar_cache(
    ready: protocol.Ready,
    tokenizer: Tokenizer,
    structured: StructuredOutputConfig,
    observer: grammar.CompileObserver | None,
) -> GrammarCache | None:
    """The same engine over the same tokenizer as the core's (it says whether it has one):
    a format compiles here exactly when it compiles there, so refusals come before queuing."""
    if not ready.model_info.structured_output.engine:
        return None
    return grammar.cache_for(
        tokenizer,
        ready.model_info.vocab_size,
        structured,
        compile_threads=2,  # requests with different new formats need not queue behind one
        observer=observer,
    )
