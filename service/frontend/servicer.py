"""GenerationService on a front end: translates between gRPC messages and the engine core.

Validation and tokenization (off the event loop), detokenization and stop strings
(service.frontend.stream), streaming and telemetry live here; scheduling and forwards live in
the engine-core process, reached through `EngineClient`. No policy here.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from service.common.config import FrontendProcessConfig
from service.common.tokenizer import Tokenizer
from service.frontend import errors
from service.frontend.core_client import CORE_GONE, EngineClient, drain
from service.frontend.stream import Delta, RequestStream
from service.frontend.telemetry.telemetry import Telemetry
from service.frontend.validation import (
    InvalidRequestError,
    generation_request,
    kv_budget_refusal,
    prompt_token_ids,
)
from service.protocol import Final, FinishReason

log = structlog.get_logger(__name__)

_FINISH = {
    FinishReason.STOP.value: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH.value: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED.value: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR.value: pb.FINISH_REASON_ERROR,
}
BACKEND_ERROR = "inference backend error"
CORE_GONE_MESSAGE = "the engine core exited; the server is restarting"
SHUTDOWN = object()  # put in a request's queue when the drain timeout has passed
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


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(
        self, config: FrontendProcessConfig, client: EngineClient, telemetry: Telemetry
    ) -> None:
        self.config = config
        self.client = client
        self.telemetry = telemetry
        self.model: ServedModel | None = None  # set once the core's model is loaded
        self.draining = False
        self._active_ids: set[str] = set()
        self._queues: dict[str, asyncio.Queue[Any]] = {}  # rid -> its outputs, while running
        self.idle = asyncio.Event()  # set whenever no request is running
        self.idle.set()
        # Tokenization (and validation, which walks every token id) runs here, never on the
        # event loop: a big prompt would stall every stream and health check meanwhile. The
        # tokenizers library releases the GIL while it encodes.
        self._prompt_pool = ThreadPoolExecutor(
            max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="tokenize"
        )

    @property
    def serving(self) -> bool:
        return self.model is not None and not self.draining and not self.client.gone.is_set()

    def unavailable_reason(self) -> str:
        if self.client.gone.is_set():
            return CORE_GONE_MESSAGE
        return "server is draining" if self.draining else "model is loading"

    def close(self) -> None:
        self._prompt_pool.shutdown(wait=False, cancel_futures=True)

    def end_all(self) -> None:
        """The drain timeout passed: every running request ends now, as cancelled."""
        for outputs in self._queues.values():
            outputs.put_nowait(SHUTDOWN)

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
            return await self.client.stats()
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

    def _tokenize(self, request: pb.TokenizeRequest, model: ServedModel) -> pb.TokenizeResponse:
        tok = model.tokenizer
        ids = prompt_token_ids(
            request,
            tok,
            slot_context=model.slot_context,
            allow_special_tokens_in_content=self.config.frontend.allow_special_tokens_in_content,
        )
        return pb.TokenizeResponse(token_ids=ids, tokens=[tok.id_to_token(i) for i in ids])

    # -- the request path -------------------------------------------------------------
    async def _run(
        self, message: Any, context: Any, *, streaming: bool
    ) -> AsyncIterator[tuple[str, Delta]]:
        """Validate, queue and follow one request; yields (request_id, delta) as the engine
        produces tokens (several steps in one delta when this RPC fell behind); aborts with a
        status on failure."""
        received = time.monotonic()
        self.telemetry.rpc_request(message, streaming=streaming)
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
            )
        except InvalidRequestError as exc:
            await self._invalid(context, exc, message.request_id)
        # Nothing awaits from here to `_active_ids.add` but an abort: the ALREADY_EXISTS check
        # and the add are one step for the event loop.
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
        if req.request_id in self._active_ids:
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
        bound = log.bind(request_id=req.request_id, frontend=self.client.name)
        stream = RequestStream(req, model.tokenizer, model.eos_token_ids)
        state = self.telemetry.request_started(req, received, streaming=streaming)
        rid, outputs = self.client.submit(req, state.ids if state is not None else None)
        self._active_ids.add(req.request_id)
        self._queues[rid] = outputs
        self.idle.clear()
        started = time.monotonic()
        bound.info(
            "request queued",
            prompt_tokens=len(req.prompt_token_ids),
            max_tokens=req.max_tokens,
            priority=req.priority,
        )
        try:
            while not stream.done:
                items = [await outputs.get(), *drain(outputs)]
                delta = Delta()
                for item in items:
                    if isinstance(item, protocol.Rejected):
                        stream.done = True
                        status = errors.rich_status(
                            Code.RESOURCE_EXHAUSTED,
                            item.message,
                            reason=errors.QUEUE_FULL,
                            retry_after_s=errors.RETRY_AFTER_S,
                        )
                        await self._reject(
                            context, status, metric="queue_full", request_id=req.request_id
                        )
                    if item is CORE_GONE:
                        stream.done = True
                        await errors.abort(context, self._unavailable())
                    if item is SHUTDOWN:
                        bound.info("request cancelled by shutdown")
                        self.client.abort(rid)
                        _merge(
                            delta,
                            stream.end(
                                Final(
                                    FinishReason.CANCELLED.value,
                                    None,
                                    len(req.prompt_token_ids),
                                    len(stream.token_ids),
                                    0,
                                    0.0,
                                    0.0,
                                    time.monotonic() - started,
                                )
                            ),
                        )
                        break
                    self.telemetry.request_events(state, item.events)
                    stopped = stream.stopped
                    step = stream.push(item)
                    if stream.stopped and not stopped:
                        self.client.abort(rid)  # a stop string matched: end it in the core
                    _merge(delta, step)
                self.telemetry.request_tokens(state, len(delta.token_ids))
                if delta.final is not None:
                    self.telemetry.request_finished(state, delta.final)
                    if delta.final.reason == FinishReason.ERROR.value:
                        bound.error("request failed", error=delta.final.error)
                        status = errors.rich_status(
                            Code.INTERNAL, BACKEND_ERROR, reason=errors.ENGINE_ERROR
                        )
                        await errors.abort(context, status)
                if delta.token_ids or delta.text or delta.final is not None:
                    yield req.request_id, delta
        finally:
            self._active_ids.discard(req.request_id)
            self._queues.pop(rid, None)
            if not self._queues:
                self.idle.set()
            self.telemetry.request_ended(state, stream.done, len(stream.token_ids))
            self.client.release(rid)
            if not stream.done:
                # Cancelled, deadline passed or the client went away: free its slot now.
                bound.info("request cancelled by the client")
                self.client.abort(rid)

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


def _merge(into: Delta, step: Delta) -> None:
    into.token_ids.extend(step.token_ids)
    into.text += step.text
    into.logprobs.extend(step.logprobs)
    if step.final is not None:
        into.final = step.final
        into.stop_string = step.stop_string


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


def served_model(ready: protocol.Ready) -> ServedModel:
    """The front end's view of the core's model (loads the tokenizer the core saved)."""
    from pathlib import Path

    return ServedModel(
        tokenizer=Tokenizer.load(Path(ready.tokenizer_dir)),
        eos_token_ids=frozenset(ready.eos_token_ids),
        slot_context=ready.slot_context,
        capacity_tokens=ready.capacity_tokens,
        prompt_cache=ready.prompt_cache,
        info=pb.GetModelInfoResponse.FromString(ready.model_info),
    )
