"""The engine-core loop: the one thread that runs the scheduler and the model runner.

Each turn it takes what arrived (requests, cancellations, stats queries) without blocking,
asks the scheduler for a plan, has the runner execute it, hands the result back to the scheduler
and delivers the tick's outputs: one message per front end. With nothing running and nothing
waiting it blocks until something arrives (no busy loop, no fixed delay).

Steps are pipelined: while step N runs, step N+1 is planned and built when the scheduler says
it is nothing but decode steps (`decode_only`), and N's tokens are read only once N+1 is queued
(or, where the storage's writes are not in place, right before N+1 is dispatched). So the
scheduler's and the runner's Python for N+1 overlaps the device's work on N. Where the engine
says so (`update_beside_dispatch`: a device whose dispatch is long host work that releases the
GIL), N is read, handed to the scheduler and delivered on a second thread while this one is
inside N+1's dispatch; the two never touch the scheduler at once (this thread waits for the
other before it goes on).

Rows with a response format sample under token masks that depend on their last token. A
decode step with such rows stops at its logits when it is built; once the step before it is
read and the rows' grammars have advanced over its tokens, their masks start filling on a
thread of their own while this thread finishes the update, queues the forward and delivers the
tick's outputs; then it joins the fill and the runner samples under them (`_sample_masked`).
Read beside the dispatch, the step before is taken by the grammars and their fill begins on the
second thread while this one is inside the forward's dispatch up to its logits; that thread then
waits for the fill and copies the masks to the device (`stage_masks`), so neither waits for the
other on a host-bound device.

Everything per request lives on this thread: the table of running requests by front end and
rid, the scheduler's rows, the outbox. Other threads only put messages into the inbox, LoRA
adapters to load or unload too: a load runs here between steps (the step in flight read
first), an unload once the adapter's last request has ended (service.core.scheduler.adapters).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from service.common.model_source import ModelLoadError
from service.common.os_thread import UPDATE_THREAD, named_executor
from service.core.scheduler.adapters import AdapterUnavailableError
from service.core.scheduler.plan import RowMasks, StepPlan, StepResult
from service.core.scheduler.request import Request, SequenceStatus
from service.core.scheduler.scheduler import QueueFullError, Scheduler
from service.protocol import AdapterDescription, AdapterReply, SlotView, StepCounters

log = structlog.get_logger(__name__)


class Runner(Protocol):
    """What the loop calls on the model runner (`ModelRunner`, or service.core.tensor_parallel's
    `ReplicatedRunner` under tensor parallel)."""

    def submit(self, plan: StepPlan, dispatch: bool = True) -> Any: ...
    def dispatch(self, pending: Any) -> Any: ...
    def sample(self, pending: Any, masks: RowMasks) -> Any: ...
    def stage_masks(self, pending: Any, masks: RowMasks) -> None: ...
    def take_prefill(self, pending: Any) -> StepResult: ...
    def collect(self, pending: Any) -> StepResult: ...
    def read_beside(self, pending: Any) -> StepResult | None: ...
    def load_adapter(self, name: str, path: str, slot: int) -> AdapterDescription: ...


@dataclass
class _Cancel:
    """Cancel this sequence object, not "whatever now has its rid": a front end may reuse a
    request_id before the loop has ended the cancelled one."""

    seq: Request


@dataclass
class _Abort:
    frontend: Hashable
    rid: int


@dataclass
class _LoadAdapter:
    name: str
    path: str
    reply: Callable[[AdapterReply], None]


@dataclass
class _UnloadAdapter:
    name: str
    reply: Callable[[AdapterReply], None]


_STOP = object()


class CoreLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        *,
        overlap_steps: bool,
        update_beside_dispatch: bool = False,
        on_turn: Callable[[Scheduler], None] | None = None,
        on_finished: Callable[[Request], None] | None = None,
        fatal_errors: bool = False,
        on_rejected: Callable[[Request, str], None] | None = None,
        on_adapters_changed: Callable[[], None] | None = None,
    ) -> None:
        """overlap_steps: step N+1 may be dispatched before N is read (in-place pool writes);
        update_beside_dispatch: N is read and handed to the scheduler on a second thread while
        N+1 is dispatched (needs overlap_steps);
        on_turn: told after each turn, before its outputs go out (where the state other threads
        read is published: whoever saw a token finds its request there);
        on_finished: told of each request whose final output was delivered;
        fatal_errors: an error outside the runner's containment ends the loop (tensor
        parallel: the other ranks could not follow); on_rejected: told of a request refused
        because its adapter is not served (with the reason); on_adapters_changed: told when
        an adapter was loaded or began to unload."""
        self.scheduler = scheduler
        self.runner = runner
        self._overlap = overlap_steps
        if update_beside_dispatch and not overlap_steps:
            raise ValueError("reading a step beside the next one's dispatch needs overlap_steps")
        self._beside = named_executor(1, UPDATE_THREAD) if update_beside_dispatch else None
        self._on_turn = on_turn
        # Steps planned while the step before ran, and after it was read (the metrics').
        self.steps = StepCounters()
        self._fatal = fatal_errors
        self._on_finished = on_finished
        self._on_rejected = on_rejected
        self._on_adapters_changed = on_adapters_changed
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._undrained = 0  # submitted, not yet handed to the scheduler
        self._requests: dict[tuple[Hashable, int], Request] = {}
        self._inflight: tuple[StepPlan, Any] | None = None
        # A decode step's masks, taken (and made ready) beside its dispatch: (step, masks).
        self._staged: tuple[int, RowMasks | None] | None = None

    # -- called from other threads ------------------------------------------------------
    def submit(self, seq: Request) -> None:
        """Queue a request; raises QueueFullError at once when the queue is full. Requests
        that free slots will take at the next step are not waiting: a burst that fits the
        batch is never refused."""
        sched = self.scheduler
        with self._lock:
            waiting = self._undrained + sched.num_waiting
            if waiting >= sched.config.max_queue_depth + max(0, sched.free_slots):
                raise QueueFullError("Server is busy. Retry later.")
            self._undrained += 1
        self._inbox.put(seq)

    def cancel(self, seq: Request) -> None:
        self._inbox.put(_Cancel(seq))

    def abort(self, frontend: Hashable, rid: int) -> None:
        """End the request a front end knows as `rid` (its client left, a stop string)."""
        self._inbox.put(_Abort(frontend, rid))

    def load_adapter(self, name: str, path: str, reply: Callable[[AdapterReply], None]) -> None:
        """`reply` is called on this loop's thread once the adapter is loaded or refused."""
        self._inbox.put(_LoadAdapter(name, path, reply))

    def unload_adapter(self, name: str, reply: Callable[[AdapterReply], None]) -> None:
        """`reply` is called on this loop's thread: how many requests still use it."""
        self._inbox.put(_UnloadAdapter(name, reply))

    def stop(self) -> None:
        self._inbox.put(_STOP)

    @property
    def queue_depth(self) -> int:
        return self._undrained + self.scheduler.num_waiting

    # -- the loop ---------------------------------------------------------------------
    def run(self) -> None:
        while True:
            idle = not self.scheduler.busy and self._inflight is None
            if not self._drain(block=idle):
                break
            try:
                self.turn()
            except Exception:
                if self._fatal:
                    raise
                log.exception("engine step failed")
                self._inflight = None
                self.scheduler.fail_running()
            self._deliver()
        self._finish_inflight()
        self.scheduler.cancel_all()
        self._deliver()
        if self._beside is not None:
            self._beside.shutdown()

    def turn(self) -> None:
        """One step: plan, run, read. A plain decode step's successor is planned and queued
        before its tokens are read."""
        sched, runner = self.scheduler, self.runner
        if self._inflight is not None and sched.decode_only():
            plan = sched.schedule()
            if plan is not None and plan.has_forward:
                self.steps.overlapped += 1
            if plan is not None and self._beside is not None:
                # Step N's update (its constrained rows' grammars take their tokens and begin
                # filling N+1's masks) runs beside N+1's dispatch; N+1 then samples under them.
                self._step_beside(plan)
                assert self._inflight is not None
                self._sample_masked(*self._inflight)
                return
            pending = runner.submit(plan, dispatch=self._overlap) if plan is not None else None
            self._finish_inflight()
            if pending is not None:
                assert plan is not None
                if not self._overlap:
                    runner.dispatch(pending)
                self._sample_masked(plan, pending)
                self._inflight = (plan, pending)
            return
        self._finish_inflight()
        plan = sched.schedule()
        if plan is None:
            return
        if plan.has_forward:
            self.steps.serial += 1
        pending = runner.submit(plan)
        if plan.prefill and plan.decode:
            # The prompts' first tokens go out now; the decode forward runs on meanwhile.
            sched.update(plan, runner.take_prefill(pending))
            self._deliver()
        if plan.decode:
            self._sample_masked(plan, pending)
            self._inflight = (plan, pending)
        else:
            sched.update(plan, runner.collect(pending))

    def _step_beside(self, plan: StepPlan) -> None:
        """Build step N+1, then dispatch it while the other thread reads step N, updates the
        scheduler and delivers the tick's outputs (it holds the GIL while this thread is inside
        `mx.async_eval`)."""
        assert self._beside is not None and self._inflight is not None
        pending = self.runner.submit(plan, dispatch=False)
        update = self._beside.submit(self._update_beside, plan, pending)
        try:
            self.runner.dispatch(pending)
        finally:
            read = update.result()  # the scheduler is this thread's again; raises its error
        if not read:
            self._finish_inflight()
        self._inflight = (plan, pending)

    def _update_beside(self, following: StepPlan, queued: Any) -> bool:
        """On the other thread: step N's tokens to the scheduler and out, then step N+1's
        (`following`) masks once filled, made ready for its sample; False when N must be read
        on the loop thread (see ModelRunner.read_beside)."""
        assert self._inflight is not None
        plan, pending = self._inflight
        result = self.runner.read_beside(pending)
        if result is None:
            return False
        self._inflight = None
        self.scheduler.update(plan, result)
        self._deliver()
        if self.scheduler.masks_due(following):
            masks = self.scheduler.decode_masks(following)
            self._staged = (following.step, masks)
            if masks is not None:
                self.runner.stage_masks(queued, masks)
        return True

    def _sample_masked(self, plan: StepPlan, pending: Any) -> None:
        """A decode step's constrained rows: their masks now (the tokens they depend on are
        read), filled while the step's forward runs, then sampled. They started filling when
        those tokens were taken: the tick's outputs go out meanwhile."""
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] == plan.step:
            masks = staged[1]
        elif not self.scheduler.masks_due(plan):
            return
        else:
            self._deliver()
            masks = self.scheduler.decode_masks(plan)
        if masks is not None:
            self.runner.sample(pending, masks)

    def _finish_inflight(self) -> None:
        if self._inflight is not None:
            plan, pending = self._inflight
            self._inflight = None
            self.scheduler.update(plan, self.runner.collect(pending))

    def _drain(self, block: bool) -> bool:
        """Hand what arrived to the scheduler; False when asked to stop."""
        try:
            item = self._inbox.get(block=block)
        except queue.Empty:
            return True
        while True:
            if item is _STOP:
                return False
            if isinstance(item, Request):
                with self._lock:
                    self._undrained -= 1
                self._add(item)
            elif isinstance(item, _Cancel):
                self.scheduler.cancel(item.seq)
            elif isinstance(item, _Abort):
                seq = self._requests.get((item.frontend, item.rid))
                if seq is not None:
                    self.scheduler.cancel(seq)
            elif isinstance(item, _LoadAdapter):
                item.reply(self._load_adapter(item.name, item.path))
            elif isinstance(item, _UnloadAdapter):
                item.reply(self._unload_adapter(item.name))
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        return True

    def _add(self, seq: Request) -> None:
        try:
            self.scheduler.add(seq)
        except AdapterUnavailableError as exc:
            # Unloaded after its front end took it: refused as the front end would have.
            if self._on_rejected is not None:
                self._on_rejected(seq, str(exc))
            return
        self._requests[(seq.sink.batch_key, seq.rid)] = seq

    def _load_adapter(self, name: str, path: str) -> AdapterReply:
        table = self.scheduler.adapters
        if name in table:
            return AdapterReply(0, error=f"adapter {name!r} is already loaded", reason="exists")
        # The step in flight was built with the stacks as they are: read it before they change.
        self._finish_inflight()
        slot = table.free_slot()
        try:
            description = self.runner.load_adapter(name, path, slot)
        except ModelLoadError as exc:
            return AdapterReply(0, error=str(exc), reason="refused")
        except Exception as exc:
            if self._fatal:
                raise
            log.exception("loading an adapter failed", adapter=name, path=path)
            return AdapterReply(0, error=f"adapter {name!r} ({path}): {exc}", reason="refused")
        table.add(name, slot)
        log.info(
            "adapter loaded",
            adapter=name,
            path=path,
            slot=slot,
            rank=description.rank,
            memory_bytes=description.memory_bytes,
        )
        if self._on_adapters_changed is not None:
            self._on_adapters_changed()
        return AdapterReply(0, adapter=description)

    def _unload_adapter(self, name: str) -> AdapterReply:
        try:
            pending = self.scheduler.adapters.unload(name)
        except AdapterUnavailableError as exc:
            return AdapterReply(0, error=str(exc), reason="not_found")
        log.info("adapter unloading", adapter=name, pending_requests=pending)
        if self._on_adapters_changed is not None:
            self._on_adapters_changed()
        return AdapterReply(0, pending_requests=pending)

    def _deliver(self) -> None:
        """The tick's outputs, one `deliver` per sink; finished requests leave the table."""
        if self._on_turn is not None:
            self._on_turn(self.scheduler)
        for sink, outputs in self.scheduler.outbox.take():
            for rid in outputs.finals:
                seq = self._requests.pop((sink.batch_key, rid), None)
                if seq is not None and self._on_finished is not None:
                    self._on_finished(seq)
            try:
                sink.deliver(outputs)
            except Exception:
                log.exception("delivering outputs failed")


def slot_views(running: list[Request], context: Callable[[Request], int]) -> list[SlotView]:
    """The per-slot view of a stats reply: every running request's state (built when asked)."""
    live = (SequenceStatus.PREFILLING, SequenceStatus.DECODING)
    return [
        SlotView(
            seq.request_id,
            seq.status.value,
            seq.num_generated,
            context(seq),
            seq.request.priority,
            seq.request.adapter,
        )
        for seq in running
        if seq.status in live
    ]
