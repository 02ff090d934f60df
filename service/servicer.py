"""GenerationService: translates between gRPC messages and the scheduler. No policy here."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import structlog

from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from service.runtime import Runtime
from service.scheduler.request import FinishReason, Sequence, StepOutput
from service.scheduler.scheduler import QueueFullError
from service.validation import InvalidRequestError, generation_request, prompt_token_ids

log = structlog.get_logger(__name__)

_FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
BACKEND_ERROR = "inference backend error"
T = TypeVar("T")


class LoopSink:
    """Hands a request's outputs from the scheduler thread to its RPC task's queue. The
    scheduler delivers all sinks of one event loop together (`deliver_all`): one thread-safe
    wake-up of the loop per tick, not one per request."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.batch_key = loop
        self.queue = queue

    def __call__(self, outputs: list[StepOutput]) -> None:
        self.batch_key.call_soon_threadsafe(self.queue.put_nowait, outputs)

    @staticmethod
    def deliver_all(items: list[tuple[LoopSink, list[StepOutput]]]) -> None:
        items[0][0].batch_key.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[LoopSink, list[StepOutput]]]) -> None:
    for sink, outputs in items:
        sink.queue.put_nowait(outputs)


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self._active_ids: set[str] = set()
        # Tokenization (and validation, which walks every token id) runs here, never on the
        # event loop: a big prompt would stall every stream and health check meanwhile. The
        # tokenizers library releases the GIL while it encodes.
        self._prompt_pool = ThreadPoolExecutor(
            max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="tokenize"
        )

    def close(self) -> None:
        self._prompt_pool.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._prompt_pool, functools.partial(fn, *args, **kwargs))

    # -- RPCs -----------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: Any) -> pb.GenerateResponse:
        response = pb.GenerateResponse()
        async for out in self._run(request, context):
            response.request_id = out.request_id
            response.text += out.text
            response.token_ids.extend(out.token_ids)
            self._fill_extras(response, out)
        return response

    async def StreamGenerate(
        self, request: pb.StreamGenerateRequest, context: Any
    ) -> AsyncIterator[pb.StreamGenerateResponse]:
        async for out in self._run(request, context):
            message = pb.StreamGenerateResponse(
                request_id=out.request_id, text=out.text, token_ids=out.token_ids
            )
            self._fill_extras(message, out)
            yield message

    async def CacheStats(
        self, request: pb.CacheStatsRequest, context: Any
    ) -> pb.CacheStatsResponse:
        return self.rt.cache_stats()

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: Any
    ) -> pb.GetModelInfoResponse:
        return self.rt.model_info()

    async def Tokenize(self, request: pb.TokenizeRequest, context: Any) -> pb.TokenizeResponse:
        if not self.rt.serving:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.rt.unavailable_reason())
        try:
            return await self._off_loop(self._tokenize, request)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def _tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        tok = self.rt.tokenizer
        ids = prompt_token_ids(
            request,
            tok,
            slot_context=self.rt.slot_context,
            allow_special_tokens_in_content=self.rt.config.allow_special_tokens_in_content,
        )
        return pb.TokenizeResponse(token_ids=ids, tokens=[tok.id_to_token(i) for i in ids])

    # -- the request path -------------------------------------------------------------
    async def _run(self, message: Any, context: Any) -> AsyncIterator[StepOutput]:
        """Validate, queue and follow one request; yields its outputs; aborts with a status."""
        rt = self.rt
        if not rt.serving:
            rt.metrics_rejected("unavailable")
            await context.abort(grpc.StatusCode.UNAVAILABLE, rt.unavailable_reason())
        try:
            req = await self._off_loop(
                generation_request,
                message,
                rt.tokenizer,
                slot_context=rt.slot_context,
                default_max_tokens=rt.config.default_max_tokens,
                prompt_cache_enabled=not rt.config.no_prompt_cache,
                allow_special_tokens_in_content=rt.config.allow_special_tokens_in_content,
            )
        except InvalidRequestError as exc:
            rt.metrics_rejected("invalid_argument")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # Nothing awaits from here to `_active_ids.add` but an abort: the ALREADY_EXISTS check
        # and the add are one step for the event loop.
        too_big = rt.check_fits(len(req.prompt_token_ids), req.max_tokens)
        if too_big is not None:
            rt.metrics_rejected("kv_budget")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, too_big)
        if req.request_id in self._active_ids:
            rt.metrics_rejected("already_exists")
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {req.request_id!r} is already running"
            )
        bound = log.bind(request_id=req.request_id)
        outputs: asyncio.Queue[list[StepOutput]] = asyncio.Queue()
        sink = LoopSink(asyncio.get_running_loop(), outputs)

        seq = Sequence(req, sink)
        telemetry = rt.telemetry
        telemetry.request_started(seq, rt.scheduler.queue_depth)  # the RPC span, trace ids
        try:
            rt.scheduler.submit(seq)
        except QueueFullError as exc:
            rt.metrics_rejected("queue_full")
            bound.warning("rejected: queue full")
            telemetry.request_ended(seq, submitted=False)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        self._active_ids.add(req.request_id)
        bound.info(
            "request queued",
            prompt_tokens=len(req.prompt_token_ids),
            max_tokens=req.max_tokens,
            priority=req.priority,
        )
        finished = False
        try:
            while not finished:
                batch = await outputs.get()
                telemetry.request_outputs(seq, batch)
                for out in batch:
                    if out.finish_reason is FinishReason.ERROR:
                        finished = True
                        bound.error("request failed", error=out.error)
                        await context.abort(grpc.StatusCode.INTERNAL, BACKEND_ERROR)
                    finished = out.finished
                    yield out
        finally:
            self._active_ids.discard(req.request_id)
            if not finished:
                # Cancelled, deadline passed or the client went away: free its slot now.
                bound.info("request cancelled by the client")
                rt.scheduler.cancel(seq)
            telemetry.request_ended(seq)

    def _fill_extras(self, message: Any, out: StepOutput) -> None:
        """Logprobs and, on the last output, the final fields (skipped cheaply when absent:
        this runs once per token of every stream)."""
        if out.logprobs:
            message.logprobs.extend(self._logprobs(out))
        if out.finish_reason is not None:
            self._fill_final(message, out)

    def _logprobs(self, out: StepOutput) -> list[pb.TokenLogprob]:
        tok = self.rt.tokenizer
        return [
            pb.TokenLogprob(
                token_id=lp.token_id,
                token=tok.id_to_token(lp.token_id),
                logprob=lp.logprob,
                top_logprobs=[
                    pb.TopLogprob(token_id=t, token=tok.id_to_token(t), logprob=v)
                    for t, v in lp.top
                ],
            )
            for lp in out.logprobs
        ]

    @staticmethod
    def _fill_final(message: Any, out: StepOutput) -> None:
        message.finish_reason = _FINISH[out.finish_reason]
        message.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=out.prompt_tokens,
                completion_tokens=out.completion_tokens,
                cached_tokens=out.cached_tokens,
            )
        )
        message.timing.CopyFrom(
            pb.Timing(
                queue_seconds=out.queue_seconds,
                time_to_first_token_seconds=out.ttft_seconds,
                total_seconds=out.total_seconds,
            )
        )
