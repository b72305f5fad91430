"""The consumer's side of the grouped pipeline: :class:`RolloutStream`.

A stream hands out the groups the pipeline's workers finished, in completion order or,
with ``enforce_order``, as whole batches in ``batch_id`` order (``_order.py``), taking
each through the pipeline's books (``Pipeline.taken``): taking a group is what frees
generation capacity. A group too old for ``max_staleness`` when it is taken is never
handed out: its slot is generated again.

The functions after the class are the stream's side for the sync bridge and the Ray
actor, which hold a stream in the Trio thread they run and reach it only through them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import trio

from trio_rollouts.models._records import RolloutGroup
from trio_rollouts.pipeline._epochs import exceeds_bound
from trio_rollouts.pipeline._handoff import Handoff
from trio_rollouts.pipeline._ledger import RolloutStreamStatistics
from trio_rollouts.pipeline._order import BatchOrder
from trio_rollouts.pipeline._weight_update import WeightUpdate, open_weight_update

if TYPE_CHECKING:
    from trio_rollouts.inference import InferenceInterface, WeightUpdateMode
    from trio_rollouts.pipeline._run import Pipeline

__all__ = [
    "RolloutStream",
    "discard_untaken",
    "drain_ready",
    "enforces_order",
    "is_closed",
    "is_too_old",
    "open_stream",
    "put_back",
    "return_stale",
    "settle_handed",
    "settle_on_handover",
    "staleness_bound",
]


def drain_ready(try_next: Callable[[], RolloutGroup | None], n: int) -> list[RolloutGroup]:
    """Up to ``n`` groups from ``try_next`` until it has nothing ready (every stream's
    ``drain``)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        msg = f"drain(n) needs an int n >= 0, got {n!r}"
        raise ValueError(msg)
    groups: list[RolloutGroup] = []
    while len(groups) < n and (group := try_next()) is not None:
        groups.append(group)
    return groups


class RolloutStream:
    """The groups of a running pipeline, as :meth:`get_grouped_rollouts` yields it.

    Use it inside the ``async with`` that opened it, from one consumer task::

        async with agent.get_grouped_rollouts(request) as stream:
            async for group in stream:
                ...

    A stream cannot be created directly; it belongs to its pipeline.
    """

    __slots__ = ("_ends_by_count", "_handoff", "_order", "_pipeline")

    _pipeline: Pipeline
    _handoff: Handoff
    _order: BatchOrder | None
    _ends_by_count: bool

    def __init__(self) -> None:
        msg = "RolloutStream is created by GroupedRolloutGenerator.get_grouped_rollouts()"
        raise TypeError(msg)

    def __repr__(self) -> str:
        return f"<RolloutStream {self.statistics()}>"

    # ---------------------------------------------------------------- pulling

    def _pull_nowait(self) -> RolloutGroup | None:
        """The next group ready, or ``None``."""
        p = self._pipeline
        if self._ends_by_count and not p.closed and p.ledger.delivered >= p.num_groups:
            raise trio.EndOfChannel
        group = self._handoff.take()
        if group is None:
            return None
        gate = p.gate
        if gate.max_staleness is not None and gate.too_old(group.start_epoch):
            # Too old to hand over: its slot is generated again; look further.
            p.regenerate_stale(group)
            return self._pull_nowait()
        return group

    async def _wait(self) -> RolloutGroup:
        """The next group, when :meth:`_pull_nowait` found none ready."""
        p = self._pipeline
        gate = p.gate
        waited = trio.current_time()
        try:
            while True:
                group = await self._handoff.wait()
                if gate.max_staleness is None or not gate.too_old(group.start_epoch):
                    return group
                p.regenerate_stale(group)
                ready = self._pull_nowait()
                if ready is not None:
                    return ready
        finally:
            p.metrics.wait_seconds += trio.current_time() - waited

    # ---------------------------------------------------------------- receiving

    async def receive(self) -> RolloutGroup:
        """Wait for the next group and take it.

        Raises ``trio.EndOfChannel`` when a non-streaming request's batch has been fully
        taken, and ``trio.ClosedResourceError`` after the ``async with`` has exited.

        Cancellation: always a cancellation point; a schedule point only when it has to
        wait for a group (so a consumer can take a full buffer without a task switch per
        group). If it is cancelled, no group is lost: a group that was not returned stays
        in the stream for the next call.
        """
        # A cancellation point always; a schedule point only when it has to wait, so a
        # consumer takes a full buffer in one go instead of one task switch per group.
        await trio.lowlevel.checkpoint_if_cancelled()
        group = self._take_ready()
        return group if group is not None else await self._take_waiting()

    def _take_ready(self) -> RolloutGroup | None:
        """Take the next group if one is ready now, or return ``None``; raises as
        :meth:`receive` does. Not a checkpoint."""
        order = self._order
        if order is None:
            group = self._pull_nowait()
            return None if group is None else self._pipeline.taken(group)
        while not order.ready:
            group = self._pull_nowait()
            if group is None:
                return None
            order.hold(group)
        return self._pipeline.taken(order.ready.popleft())

    async def _take_waiting(self) -> RolloutGroup:
        """Take the next group when none was ready: wait for it."""
        order = self._order
        if order is None:
            return self._pipeline.taken(await self._wait())
        while True:
            order.hold(await self._wait())
            if order.ready:
                return self._pipeline.taken(order.ready.popleft())
            # The wait yielded: a cancellation point again before pulling on.
            await trio.lowlevel.checkpoint_if_cancelled()
            group = self._take_ready()
            if group is not None:
                return group

    def try_next(self) -> RolloutGroup | None:
        """Take a group that is ready now, or return ``None`` at once.

        Never blocks, never cancels or loses work: when nothing is ready (or a
        non-streaming batch has been fully taken) it returns ``None`` and the pipeline
        runs on. Raises ``trio.ClosedResourceError`` after the ``async with`` has exited.
        Not a checkpoint.
        """
        try:
            return self._take_ready()
        except trio.EndOfChannel:
            return None

    def drain(self, n: int) -> list[RolloutGroup]:
        """Take up to ``n`` groups that are ready now; never blocks (see :meth:`try_next`).

        Not a checkpoint.
        """
        return drain_ready(self.try_next, n)

    def __aiter__(self) -> RolloutStream:
        return self

    async def __anext__(self) -> RolloutGroup:
        """Async iteration: :meth:`receive` until the stream ends.

        Cancellation: as :meth:`receive`.
        """
        # receive(), inline: a coroutine layer less per group.
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            group = self._take_ready()
            return group if group is not None else await self._take_waiting()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    # ---------------------------------------------------------------- weight updates

    @property
    def policy_epoch(self) -> int:
        """The stream's policy epoch: calls that start now start under it, and each group
        records it as ``start_epoch``. It moves when a :meth:`weight_update` body returns,
        and stays readable after the stream has closed."""
        return self._pipeline.gate.epoch

    def weight_update(
        self,
        mode: WeightUpdateMode = "drain",
        *,
        epoch: int | None = None,
        backends: Sequence[InferenceInterface] | None = None,
    ) -> contextlib.AbstractAsyncContextManager[WeightUpdate]:
        """Pause generation for a weight update, as an async context manager::

            async with stream.weight_update(mode="drain") as update:
                await push_weights(update.epoch)
            # calls that start now start under update.epoch

        ``mode`` says what becomes of the calls in flight when the block is entered:
        ``"drain"`` lets them finish; ``"restart"`` cancels them and generates their
        slots again after the update (``statistics().restarted``); ``"keep"`` has the
        backend hold them, and ``"abort"`` has it stop them with their partial output,
        both continued under the new weights after the block (these two need
        :class:`~trio_rollouts.inference.Pausable` backends that support them). With
        ``GroupedRolloutRequest.max_staleness`` set, calls the new epoch makes too old
        are cancelled too (``stale``).

        ``epoch`` (default ``policy_epoch + 1``) must be greater than
        :attr:`policy_epoch`. ``backends`` (default: the request's
        ``inference_interface``) are the interfaces to pause; those that are not
        Pausable are told nothing. Each Pausable one gets ``pause(mode)`` before the
        body and ``resume(epoch)`` after it.

        Raises ``ValueError`` for an unknown mode or an epoch not above the current one,
        ``TypeError`` for a backend that cannot pause for ``mode`` (before anything
        pauses), ``RuntimeError`` for a second update while one is in progress, and
        :class:`~trio_rollouts.inference.WeightUpdateError` when a pause fails (every
        backend paused so far is resumed under the old epoch first).

        While the block runs no ``group_rollout`` call starts, and the body starts only
        once that holds and every backend has paused; groups already finished can be
        taken meanwhile. Time a kept or aborted call spends held does not count against
        ``group_timeout``.

        Cancellation: entering is a checkpoint (it waits for drains, cancelled calls and
        pauses). If the wait or the body is cancelled, or the body raises, the backends
        are resumed under the **old** epoch, shielded from cancellation, and the
        exception propagates; after a normal exit they are resumed (shielded) under the
        new one. The gate is opened on every route: nothing is left paused.
        """
        return open_weight_update(self._pipeline, mode, epoch, backends)

    # ---------------------------------------------------------------- statistics

    def metrics(self) -> dict[str, float]:
        """What happened since the last call (or since the stream opened), as one flat
        dict of floats for any logger (W&B, TensorBoard, MLflow; see
        ``docs/logging.md``): the ledger's counters as deltas (``rollout/groups_delivered``,
        ``rollout/stale``, ``rollout/cut``, ...), ``rollout/groups_per_s``, the staleness
        of the groups taken (``rollout/staleness_mean``, ``_p50``, ``_p99``, ``_max``),
        the time the consumer waited for groups (``rollout/wait_for_batch_s``) and weight
        updates spent pausing (``rollout/weight_update_pause_s``), gauges
        (``rollout/in_flight``, ``rollout/oldest_in_flight_s``, ``rollout/buffered``,
        ``rollout/pending``, ``rollout/policy_epoch``, ``process/rss_mb``), the event
        loop's lag (``loop/lag_p50_ms``, ``_p99_ms``, ``_max_ms``: sampled from the first
        call on, so from the second call's dict), and per replica of the request's backend
        (``inference/<i>/...``: the engine model's ``prefix_cache_hit_rate``,
        ``generation_tokens``, ``preemptions``, ``busy_s``, ``running``, ``waiting``;
        the HTTP client's ``requests``, ``in_flight``, and ``retries`` of single requests,
        also by error class as ``retries/<ErrorClass>``: not ``rollout/retries``, which
        counts retries of whole groups under the failure policy). Times are on Trio's
        clock.

        Not a checkpoint. Works after the ``async with`` has exited too (the last
        interval).
        """
        p = self._pipeline
        return p.metrics.report(self.statistics(), p.request.inference_interface)

    def statistics(self) -> RolloutStreamStatistics:
        """A snapshot of the pipeline's counters. Not a checkpoint."""
        p = self._pipeline
        return p.ledger.statistics(
            buffered=len(self._handoff),
            reordering=0 if self._order is None else len(self._order),
            outstanding_batches=p.slots.outstanding,
            policy_epoch=p.gate.epoch,
            oldest_in_flight_s=p.gate.oldest_call_age(p.call_epoch) if p.ledger.in_flight else 0.0,
        )


# --------------------------------------------------------------------------- the pipeline's side


def open_stream(pipeline: Pipeline) -> RolloutStream:
    """The stream of ``pipeline`` (which owns the handoff, the order and the books the
    stream takes through)."""
    stream = object.__new__(RolloutStream)
    stream._pipeline = pipeline
    stream._handoff = pipeline.handoff
    stream._order = pipeline.order
    # A non-streaming stream whose workers outlive its batch (a staleness bound may send
    # a slot back to them) ends when its groups are taken, not when sending closes.
    stream._ends_by_count = pipeline.park_when_idle and not pipeline.streaming
    return stream


def discard_untaken(stream: RolloutStream) -> int:
    """At shutdown, after the workers are gone: drop the finished groups nobody took,
    and return how many there were. Trio thread."""
    count = 0 if stream._order is None else stream._order.clear()
    while True:
        try:
            if stream._handoff.take() is None:
                return count
        except trio.EndOfChannel:
            return count
        count += 1


# --------------------------------------------------------------------------- the bridge's side
#
# For the sync bridge and the Ray actor, which run a stream in a Trio thread of their own
# and hand its groups to a caller in another thread. Unless a function says otherwise,
# call it in the stream's Trio thread.


def settle_on_handover(stream: RolloutStream) -> bool:
    """From now on a taken group's prompt draws are not done when the stream hands it
    out: the caller settles them with :func:`settle_handed` when its own consumer has
    the group. Returns whether the agent draws prompts at all."""
    draws = stream._pipeline.draws
    draws.settle_on_handover()
    return draws.tracking


def settle_handed(stream: RolloutStream, batch_id: int, index: int) -> None:
    """The group of slot ``(batch_id, index)`` reached its consumer: its prompt draws are
    done. Any thread; a slot settled twice, or unknown, is ignored."""
    stream._pipeline.draws.settle((batch_id, index))


def put_back(stream: RolloutStream, groups: Sequence[RolloutGroup]) -> None:
    """Undo the takes of ``groups`` (handed out in this order and kept by a caller that
    timed out) and put them first in the stream again, with ``enforce_order``. They are
    checked for staleness like every group the stream holds."""
    order = stream._order
    if order is None:
        msg = "put_back() needs a stream with enforce_order"
        raise RuntimeError(msg)
    for group in reversed(groups):
        stream._pipeline.untake(group)
    order.put_back(groups)


def return_stale(stream: RolloutStream, groups: Sequence[RolloutGroup]) -> None:
    """Undo the takes of ``groups`` (taken from this stream and found too old by the
    caller) and generate their slots again before any other slot, booked as ``stale``;
    their prompt draws are given back.

    With ``enforce_order``, the stream goes back to the first batch of ``groups``: what it
    holds after them waits until their slots are filled again, so the order it hands out
    stays gap-free. Every group the stream handed out after the first of ``groups`` must
    be among them or have been given back with :func:`put_back` first."""
    p = stream._pipeline
    for group in reversed(groups):
        p.untake(group)
    if stream._order is not None:
        stream._order.rewind(groups)
    for group in reversed(groups):  # each slot goes first: the first group ends first
        p.regenerate_stale(group)


def staleness_bound(stream: RolloutStream) -> int | None:
    """The request's ``max_staleness``."""
    return stream._pipeline.gate.max_staleness


def is_too_old(group: RolloutGroup, epoch: int, bound: int | None) -> bool:
    """Whether ``group`` may not be handed to a consumer under ``epoch`` with
    ``max_staleness`` ``bound`` (the Ray merge's epoch, or an update's new one before it
    moves). Any thread."""
    return exceeds_bound(group.start_epoch, epoch, bound)


def is_closed(stream: RolloutStream) -> bool:
    """Whether the stream's ``async with`` has exited. Any thread."""
    return stream._pipeline.closed


def enforces_order(stream: RolloutStream) -> bool:
    """Whether the stream hands out whole batches in order. Any thread."""
    return stream._order is not None
