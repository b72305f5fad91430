"""The grouped pipeline's life: a nursery of workers, a memory channel to the stream, and
shutdown.

:func:`open_pipeline` is what :meth:`GroupedRolloutGenerator.get_grouped_rollouts`
returns. It runs a fixed set of worker tasks in a nursery; each worker loops:

1. claim a free slot (``_slots.py``; with ``max_staleness``, wait for admission:
   ``_epochs.py``),
2. generate the slot's group (``_attempts.py``: each attempt in a cancel scope of its
   own; retries, skips and filtering),
3. send it into a ``trio.open_memory_channel(buffer_size)``: at most ``buffer_size``
   finished groups wait there, and a worker holding one more waits in ``send``.

The :class:`~trio_rollouts.RolloutStream` (``_stream.py``) takes groups from the other
end through :class:`Pipeline`'s verbs: taking a group is what frees generation capacity
(a batch's last take submits the next batch). Leaving the ``async with`` by any route
cancels the workers *before* the channel closes (so no worker blocked in ``send`` sees a
closed channel), waits for them in the nursery, then closes both ends synchronously (a
close cannot be interrupted) and books the groups nobody took. See
``docs/reference-design.md`` for the invariants and the tests that hold each.

The pipeline never sees the agent: it takes a :class:`PipelineConfig` (the request, the
settings, and ``generate(batch_id, index_in_batch)``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import attrs
import trio

from trio_rollouts._concurrency import flatten_exception_groups
from trio_rollouts.inference import InferenceInterface, Pausable
from trio_rollouts.models._requests import GroupedRolloutRequest
from trio_rollouts.models._rollouts import RolloutGroup
from trio_rollouts.pipeline._attempts import Attempts
from trio_rollouts.pipeline._epochs import (
    Admission,
    Epochs,
    WeightUpdate,
    open_weight_update,
    warn_epoch_ahead,
)
from trio_rollouts.pipeline._failure import FailurePolicy
from trio_rollouts.pipeline._groups import RewardWatch
from trio_rollouts.pipeline._ledger import Ledger, RolloutStreamStatistics
from trio_rollouts.pipeline._metrics import MetricsBook
from trio_rollouts.pipeline._order import BatchOrder
from trio_rollouts.pipeline._sampling import check_sampling
from trio_rollouts.pipeline._slots import Slot, Slots
from trio_rollouts.pipeline._stream import RolloutStream, open_stream
from trio_rollouts.pipeline._tracing import SampleSpans, traced
from trio_rollouts.pipeline._tracing import state as tracing
from trio_rollouts.prompts._draws import DrawBook

__all__ = ["Pipeline", "PipelineConfig", "open_pipeline"]


@attrs.frozen(kw_only=True)
class PipelineConfig:
    """Everything a pipeline runs on. The agent builds it
    (:meth:`~trio_rollouts.GroupedRolloutGenerator.get_grouped_rollouts`), after checking
    it."""

    #: The request: sizes, streaming, order, filtering, the staleness bound, seeds, and
    #: the inference interface (paused by weight updates, read for metrics).
    request: GroupedRolloutRequest
    #: Makes the ``group_rollout`` call for slot ``(batch_id, index_in_batch)``.
    generate: Callable[[int, int], Awaitable[object]]
    #: Who makes the calls, for messages (``"MyAgent"``).
    name: str
    #: ``parallel_generation_tasks // num_groups``: batches outstanding at most.
    batches_ahead: int
    #: Finished groups that may wait for the consumer.
    buffer_size: int
    max_consecutive_filtered: int
    failure_policy: FailurePolicy
    #: The environment (``env_id``) of each slot, or ``None``: no per-environment
    #: counters.
    env_of_slot: Callable[[int, int], str] | None = None
    #: Whether the calls draw prompts (their draws are recorded and settled once).
    draws_prompts: bool = False
    #: Whether every call must draw exactly one prompt (the agent has a source).
    prompts_required: bool = False


class Pipeline:
    """One run of the grouped pipeline: its mechanisms and the workers' loop, and the
    verbs its stream, weight updates, the sync bridge and the Ray actor use.

    Threads: the run's Trio thread only, except :meth:`handed` and :attr:`closed`, which
    any thread may use.
    """

    def __init__(self, config: PipelineConfig, epoch: int) -> None:
        request = config.request
        self._config = config
        self._request = request
        self._num_groups = request.num_groups
        self._streaming = request.streaming
        self._closed = False
        self._ledger = Ledger(config.env_of_slot)
        self._metrics = MetricsBook()
        self._epochs = Epochs(epoch, request.max_staleness)
        self._slots = Slots(request.num_groups, request.streaming)
        self._order = BatchOrder(request.num_groups) if request.enforce_order else None
        self._draws = DrawBook(config.draws_prompts)
        self._rewards = RewardWatch(request.rollouts_per_group)
        self._send, self._receive = trio.open_memory_channel[RolloutGroup](config.buffer_size)
        # Admission inside the staleness bound (streaming: a batch at a time otherwise).
        self._admission = (
            Admission(
                lambda: self._ledger.delivered,
                request.max_staleness,
                request.num_groups,
                self._slots.oldest_batch if request.enforce_order else None,
            )
            if request.streaming and request.max_staleness is not None
            else None
        )
        # OpenTelemetry spans per call, when trio_rollouts.otel is instrumented.
        tracer = tracing.tracer
        self._spans = None if tracer is None else SampleSpans(tracer)
        generate = config.generate
        if self._spans is not None:
            generate = traced(generate, self._spans, lambda: self._epochs.epoch)
        self._attempts = Attempts(
            name=config.name,
            request=request,
            generate=generate,
            policy=config.failure_policy,
            max_consecutive_filtered=config.max_consecutive_filtered,
            prompts_required=config.prompts_required,
            ledger=self._ledger,
            epochs=self._epochs,
            draws=self._draws,
            admission=self._admission,
            spans=self._spans,
            rewards=self._rewards,
        )
        # The request's backend while it is Pausable and has not been seen ahead of the
        # stream's epoch (a take then warns, once).
        interface = request.inference_interface
        self._epoch_source = interface if isinstance(interface, Pausable) else None

    # ---------------------------------------------------------------- the life

    def start(self, nursery: trio.Nursery) -> None:
        """Submit the first batches and start the workers in ``nursery``."""
        self._metrics.opened()
        batches = self._config.batches_ahead if self._streaming else 1
        for _ in range(batches):
            self._slots.submit_batch()
        for _ in range(batches * self._num_groups):
            nursery.start_soon(self._worker)

    async def _worker(self) -> None:
        """Claim slots, generate their groups and send them to the stream, until
        cancelled.

        Cancellation: a group in hand that was not sent ends as cancelled.
        """
        slots = self._slots
        admission = self._admission
        ledger = self._ledger
        while True:
            slot = await slots.claim()
            if admission is not None and not admission.may_start(slot):
                await self._admit(admission, slot)
            group = await self._attempts.group(slot)
            ledger.pending += 1
            try:
                await self._send.send(group)
            except BaseException:
                ledger.pending -= 1
                ledger.cancelled += 1  # a finished group nobody took
                raise

    async def _admit(self, admission: Admission, slot: Slot) -> None:
        """Wait until ``slot``'s first call may start inside the staleness bound, and no
        weight update holds calls."""
        while True:
            await self._epochs.wait_for_gate(slot)
            if admission.may_start(slot):
                return
            await admission.wait(slot)

    def close(self) -> None:
        """After the workers are gone: close both ends of the channel, and book the
        finished groups nobody took as cancelled (their prompts are drawn again).
        Synchronous, so it cannot be interrupted."""
        self._closed = True
        discarded = 0 if self._order is None else self._order.clear()
        while True:
            try:
                self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            discarded += 1
        # The receiving end first: a consumer still waiting (in another task, outside the
        # nursery) gets ClosedResourceError, not the EndOfChannel of a finished stream.
        self._receive.close()
        self._send.close()
        self._ledger.discarded(discarded)
        self._draws.give_back_all()
        self._metrics.closed()
        if self._spans is not None:
            self._spans.close()

    # ---------------------------------------------------------------- the stream's verbs

    @property
    def closed(self) -> bool:
        """Whether the ``async with`` has exited. Any thread."""
        return self._closed

    @property
    def policy_epoch(self) -> int:
        return self._epochs.epoch

    @property
    def max_staleness(self) -> int | None:
        return self._epochs.max_staleness

    @property
    def enforce_order(self) -> bool:
        return self._order is not None

    def take_ready(self) -> RolloutGroup | None:
        """Take the next group that is ready now, or return ``None``. Raises
        ``trio.EndOfChannel`` when a non-streaming batch has been wholly taken, and
        ``trio.ClosedResourceError`` after close. Not a checkpoint."""
        order = self._order
        if order is None:
            group = self._pull()
            return None if group is None else self._taken(group)
        while not order.ready:
            group = self._pull()
            if group is None:
                return None
            order.hold(group)
        return self._taken(order.ready.popleft())

    async def take_waiting(self) -> RolloutGroup:
        """Wait for the next group and take it (after :meth:`take_ready` found none).

        Cancellation: a cancelled wait takes nothing; no group is lost.
        """
        waited = trio.current_time()
        try:
            while True:
                group = await self._receive.receive()
                if self._epochs.too_old(group.start_epoch):
                    self._regenerate(group)
                elif self._order is None:
                    return self._taken(group)
                else:
                    self._order.hold(group)
                # The wait yielded: whatever is ready now comes first.
                ready = self.take_ready()
                if ready is not None:
                    return ready
        finally:
            self._metrics.wait_seconds += trio.current_time() - waited

    def _pull(self) -> RolloutGroup | None:
        """The next group sent that is not too old (those are generated again)."""
        if not self._streaming and not self._closed and self._ledger.delivered >= self._num_groups:
            raise trio.EndOfChannel
        while True:
            try:
                group = self._receive.receive_nowait()
            except trio.WouldBlock:
                return None
            if not self._epochs.too_old(group.start_epoch):
                return group
            self._regenerate(group)

    def _taken(self, group: RolloutGroup) -> RolloutGroup:
        """Book the consumer's take of ``group`` (invariant 2); return it."""
        slot = (group.batch_id, group.index_in_batch)
        self._ledger.taken(*slot)
        self._draws.taken(slot)
        self._slots.taken(group.batch_id)
        staleness = self._epochs.epoch - group.start_epoch
        if staleness:
            self._metrics.taken(staleness)
        if self._spans is not None:
            self._spans.delivered(slot, staleness, len(group.cuts))
        if self._admission is not None:
            self._admission.wake()
        self._rewards.seen(group)
        source = self._epoch_source
        if source is not None and source.policy_epoch > self._epochs.epoch:
            self._epoch_source = None
            warn_epoch_ahead(source, self._epochs.epoch)
        return group

    def _regenerate(self, group: RolloutGroup) -> None:
        """A finished, untaken group is too old to hand over: drop it and generate its
        slot again, before any other free slot."""
        slot = (group.batch_id, group.index_in_batch)
        self._ledger.pending -= 1
        self._ledger.stale += 1
        if self._spans is not None:
            self._spans.ended(slot, "stale")
        self._draws.give_back(slot)
        self._slots.put_first(slot)
        if self._admission is not None:
            self._admission.again.add(slot)
            self._admission.wake()

    def take_back(self, groups: Sequence[RolloutGroup], *, regenerate: bool) -> None:
        """Undo the takes of ``groups`` (handed out in this order, never consumed): they
        are pending again, their batches outstanding again (whose next completion
        submits no second batch). With ``regenerate`` they are too old (booked
        ``stale``, their prompts drawn again) and their slots are generated again before
        any other; with ``enforce_order`` the order goes back to the first of their
        batches, so it stays gap-free. Without ``regenerate`` they go back first in line
        (``enforce_order`` only), checked for staleness like every group the stream
        holds."""
        order = self._order
        if not regenerate and order is None:
            msg = "take_back(regenerate=False) needs a stream with enforce_order"
            raise RuntimeError(msg)
        for group in reversed(groups):
            self._ledger.untaken(group.batch_id, group.index_in_batch)
            self._slots.untake(group.batch_id)
        if not regenerate:
            order.put_back(groups)  # type: ignore[union-attr]
            return
        if order is not None:
            order.rewind(groups)
        for group in reversed(groups):  # each slot goes first: the first group ends first
            self._regenerate(group)

    def settle_on_handover(self) -> bool:
        """From now on a taken group's prompt draws are done only when the caller says
        its own consumer has the group (:meth:`handed`): the sync bridge and the Ray
        actor hand groups on. Returns whether the calls draw prompts at all."""
        self._draws.settle_on_handover()
        return self._draws.tracking

    def handed(self, slot: Slot) -> None:
        """The group of ``slot`` reached its consumer: its prompt draws are done. Any
        thread; a slot settled twice, or unknown, is ignored."""
        self._draws.settle(slot)

    def weight_update(
        self, mode: object, epoch: object, backends: Sequence[InferenceInterface] | None
    ) -> contextlib.AbstractAsyncContextManager[WeightUpdate]:
        return open_weight_update(self, mode, epoch, backends)

    def statistics(self) -> RolloutStreamStatistics:
        """A snapshot of the counters. Not a checkpoint."""
        ledger = self._ledger
        return ledger.statistics(
            buffered=self._receive.statistics().current_buffer_used,
            reordering=0 if self._order is None else len(self._order),
            outstanding_batches=self._slots.outstanding,
            policy_epoch=self._epochs.epoch,
            oldest_in_flight_s=self._epochs.oldest_call_age() if ledger.in_flight else 0.0,
        )

    def metrics(self) -> dict[str, float]:
        return self._metrics.report(self.statistics(), self._request.inference_interface)

    # ---------------------------------------------------------------- weight updates' verbs

    @property
    def epochs(self) -> Epochs:
        return self._epochs

    @property
    def interface(self) -> InferenceInterface:
        return self._request.inference_interface

    def calls_in_flight(self) -> int:
        return self._ledger.in_flight

    def paused_for(self, seconds: float) -> None:
        self._metrics.pause_seconds += seconds

    def advance_epoch(self, epoch: int, *, stamped: bool) -> None:
        """A weight update's body returned: calls start under ``epoch`` from now on; calls
        now as old as the bound allows get the cut signal (their agents cut the members
        still running); groups held for ordering that are now too old go back to their
        slots (groups in the channel are checked when they are taken)."""
        epochs = self._epochs
        epochs.advance(epoch, stamped)
        self._ledger.weight_updates += 1
        if self._admission is not None:
            self._admission.updated()
        bound = epochs.max_staleness
        if bound is None:
            return
        for in_flight in epochs.in_flight:
            cuts = in_flight.cuts
            if cuts.watchers and cuts.start_epoch == epoch - bound:
                cuts.cut_at(epoch)
        if self._order is not None:
            self._order.evict(epochs.too_old, self._regenerate)


@contextlib.asynccontextmanager
async def open_pipeline(config: PipelineConfig) -> AsyncIterator[RolloutStream]:
    """Run a pipeline for the duration of an ``async with``; see the module docstring.

    Cancellation: leaving the ``async with`` by any route cancels every call in flight;
    it returns only after every task the pipeline started has ended. An exception in a
    worker cancels the body and leaves the ``async with`` as itself when it is the only
    failure.
    """
    request = config.request
    interface = request.inference_interface
    if request.initial_epoch is None:
        epoch = interface.policy_epoch if isinstance(interface, Pausable) else 0
    else:
        epoch = request.initial_epoch
        if isinstance(interface, Pausable):
            await interface.resume(request.initial_epoch)
    await check_sampling(request, config.name)
    pipeline = Pipeline(config, epoch)
    stream = open_stream(pipeline)
    consumer_errors: list[BaseException] = []  # the body's own exception is not flattened
    with flatten_exception_groups(consumer_errors):
        try:
            async with trio.open_nursery() as nursery:
                pipeline.start(nursery)
                try:
                    yield stream
                except BaseException as exc:
                    consumer_errors.append(exc)
                    raise
                finally:
                    # Cancel the producers before the channel closes.
                    nursery.cancel_scope.cancel()
        finally:
            pipeline.close()
