"""The consumer's side of the grouped pipeline: :class:`RolloutStream`.

A stream hands out the groups the pipeline's workers finished, in completion order or,
with ``enforce_order``, as whole batches in ``batch_id`` order. Reordering happens here,
where groups are taken, so it costs no task. Taking a group is what frees generation
capacity: the pipeline submits a new batch only when the consumer has taken the last
group of an outstanding one.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs
import trio

from ._models import RolloutGroup
from ._weight_update import WeightUpdate, open_weight_update

if TYPE_CHECKING:
    from ._pipeline import _Pipeline
    from .inference import InferenceInterface, WeightUpdateMode

__all__ = ["EnvironmentStatistics", "RolloutStream", "RolloutStreamStatistics"]


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


@attrs.frozen(kw_only=True)
class EnvironmentStatistics:
    """One environment's share of a multi-task pipeline's counters (same meanings as in
    :class:`RolloutStreamStatistics`)."""

    started: int
    delivered: int
    filtered: int
    failed: int


@attrs.frozen(kw_only=True)
class RolloutStreamStatistics:
    """A snapshot of a pipeline's counters, as :meth:`RolloutStream.statistics` returns.

    - ``started``: ``group_rollout`` calls started (regenerations included).
    - ``completed``: calls that returned a group.
    - ``filtered``: completed groups dropped by ``filter_groups_with_same_reward``.
    - ``delivered``: groups the consumer has taken.
    - ``in_flight``: calls running now (never more than ``parallel_generation_tasks``).
    - ``buffered``: finished groups waiting in the stream's buffer (at most
      ``buffer_size``).
    - ``reordering``: groups taken out of the buffer but held back by ``enforce_order``
      until their batch is next and complete.
    - ``failed``: calls that raised or broke the group contract (timeouts included;
      cancellations at shutdown are not failures).
    - ``retries``: failed calls that were retried in their slot, counted when the next
      attempt starts (never when a retry was merely expected).
    - ``waiting_to_retry``: failed calls whose slot waits out a backoff before the next
      attempt; each ends as retried, or, when no attempt follows, as skipped, raised or
      cancelled.
    - ``timeouts``: failed calls that ran past ``group_timeout``.
    - ``skipped``: failed calls whose group was given up (``on_failure="skip"``).
    - ``raised``: failed calls whose error left the pipeline (neither retried nor
      skipped).
    - ``cancelled``: calls cancelled in flight at shutdown, failed calls whose retry was
      cancelled at shutdown, and finished groups that nobody took before the stream
      closed.
    - ``pending``: finished groups not yet taken (buffered, waiting to enter the buffer,
      or reordering).
    - ``last_errors``: the most recent failures, as ``"Type: message"``.
    - ``outstanding_batches``: submitted batches whose last group is not yet taken.
    - ``per_env``: for agents that route groups to environments (``WeightedMultiTask``),
      the counters of each environment by ``env_id``; empty otherwise.
    - ``policy_epoch``: the stream's policy epoch (see :meth:`RolloutStream.weight_update`).
    - ``weight_updates``: weight updates whose body returned.
    - ``restarted``: calls cancelled by a ``restart`` update, their slots generated again.
    - ``stale``: calls cancelled by an update because they would exceed
      ``max_staleness``, and finished groups found too old when they were taken; their
      slots are generated again.
    - ``mixed``: groups whose generation spanned a keep/abort update on a backend that
      does not stamp where the epoch changed (not a ledger term).
    """

    started: int
    completed: int
    filtered: int
    delivered: int
    in_flight: int
    buffered: int
    reordering: int
    failed: int
    outstanding_batches: int
    retries: int = 0
    timeouts: int = 0
    skipped: int = 0
    raised: int = 0
    waiting_to_retry: int = 0
    cancelled: int = 0
    pending: int = 0
    last_errors: tuple[str, ...] = ()
    per_env: dict[str, EnvironmentStatistics] = attrs.field(factory=dict)
    policy_epoch: int = 0
    weight_updates: int = 0
    restarted: int = 0
    stale: int = 0
    mixed: int = 0

    @property
    def attempts(self) -> int:
        """How many ``group_rollout`` calls started (first attempts, retries and
        regenerations), the same count as ``started``."""
        return self.started

    @property
    def unaccounted(self) -> int:
        """The ledger's remainder, which is always 0 (every started call is delivered,
        filtered, retried, skipped, raised, cancelled, restarted, stale, still in flight,
        waiting to retry, or pending)."""
        return self.started - (
            self.delivered
            + self.filtered
            + self.retries
            + self.skipped
            + self.raised
            + self.cancelled
            + self.restarted
            + self.stale
            + self.in_flight
            + self.waiting_to_retry
            + self.pending
        )


class RolloutStream:
    """The groups of a running pipeline, as :meth:`get_grouped_rollouts` yields it.

    Use it inside the ``async with`` that opened it, from one consumer task::

        async with agent.get_grouped_rollouts(request) as stream:
            async for group in stream:
                ...

    A stream cannot be created directly; it belongs to its pipeline.
    """

    __slots__ = (
        "_channel",
        "_ends_by_count",
        "_enforce_order",
        "_next_batch_id",
        "_pipeline",
        "_ready",
        "_released_of_next",
        "_waiting",
    )

    _pipeline: _Pipeline
    _channel: trio.MemoryReceiveChannel[RolloutGroup]
    _enforce_order: bool
    _ready: collections.deque[RolloutGroup]
    _waiting: dict[int, list[RolloutGroup]]
    _next_batch_id: int
    _released_of_next: int
    _ends_by_count: bool

    def __init__(self) -> None:
        msg = "RolloutStream is created by GroupedRolloutGenerator.get_grouped_rollouts()"
        raise TypeError(msg)

    @classmethod
    def _from_pipeline(cls, pipeline: _Pipeline) -> RolloutStream:
        self = object.__new__(cls)
        self._pipeline = pipeline
        self._channel = pipeline.receive_channel
        self._enforce_order = pipeline.request.enforce_order
        self._ready = collections.deque()  # groups whose turn has come (enforce_order)
        self._waiting = {}  # batch_id -> groups of batches not yet complete or not yet next
        self._next_batch_id = 0
        # Groups of batch _next_batch_id already released to _ready when a weight update
        # took one of its groups back as stale (see _evict_stale).
        self._released_of_next = 0
        # A non-streaming stream whose workers outlive its batch (a staleness bound may
        # send a slot back to them) ends when its groups are taken, not when the channel
        # closes.
        self._ends_by_count = pipeline.park_when_idle and not pipeline.streaming
        return self

    def __repr__(self) -> str:
        return f"<RolloutStream {self.statistics()}>"

    # ---------------------------------------------------------------- ordering

    def _hold(self, group: RolloutGroup) -> None:
        """Keep a group until its batch is complete and next in line (enforce_order)."""
        batch = self._waiting.setdefault(group.batch_id, [])
        batch.append(group)
        self._release()

    def _release(self) -> None:
        size = self._pipeline.num_groups
        while len(self._waiting.get(self._next_batch_id, ())) + self._released_of_next == size:
            complete = self._waiting.pop(self._next_batch_id, [])
            complete.sort(key=lambda g: g.index_in_batch)
            self._ready.extend(complete)
            self._next_batch_id += 1
            self._released_of_next = 0

    def _evict_stale(self) -> None:
        """After the policy epoch moved: send the held groups that are now too old back
        to be generated again in their slots (groups in the channel are checked when
        they are pulled). With ``enforce_order``, released groups after the first stale
        one go back to waiting, so that order stays gap-free."""
        p = self._pipeline
        if p.max_staleness is None:
            return
        for batch in self._waiting.values():
            for group in [g for g in batch if p.is_stale(g)]:
                batch.remove(group)
                p.regenerate_stale(group)
        first = next((i for i, g in enumerate(self._ready) if p.is_stale(g)), None)
        if first is None:
            return
        ready = list(self._ready)
        keep, back = ready[:first], ready[first:]
        self._ready = collections.deque(keep)
        batch_id = back[0].batch_id
        # The batch's groups before the stale one (taken, or still in _ready) stay
        # released: all of the batch but what goes back.
        # (A batch already partly sent back by an earlier eviction was not released
        # whole: count from what it had released.)
        released = self._released_of_next if batch_id == self._next_batch_id else p.num_groups
        self._released_of_next = released - sum(1 for g in back if g.batch_id == batch_id)
        self._next_batch_id = batch_id
        for group in back:
            if p.is_stale(group):
                p.regenerate_stale(group)
            else:
                self._waiting.setdefault(group.batch_id, []).append(group)

    def _pull_nowait(self) -> RolloutGroup:
        p = self._pipeline
        if self._ends_by_count and not p.closed and p.delivered >= p.num_groups:
            raise trio.EndOfChannel
        group = self._channel.receive_nowait()
        p.channel_received()
        if p.max_staleness is not None and p.is_stale(group):
            # Too old to hand over: its slot is generated again; look further.
            p.regenerate_stale(group)
            return self._pull_nowait()
        return group

    async def _pull(self) -> RolloutGroup:
        # A cancellation point always; a schedule point only when it has to wait, so a
        # consumer takes a full buffer in one go instead of one task switch per group.
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            return self._pull_nowait()
        except trio.WouldBlock:
            pass
        # Waiting means the buffer was empty: the group comes straight from a sender that
        # never blocked, so no blocked sender is woken (no channel_received()).
        p = self._pipeline
        while True:
            group = await self._channel.receive()
            if p.max_staleness is None or not p.is_stale(group):
                return group
            p.regenerate_stale(group)
            try:
                return self._pull_nowait()
            except trio.WouldBlock:
                pass

    def _discard_untaken(self) -> int:
        """At shutdown, after the workers are gone: drop the finished groups nobody took,
        and return how many there were."""
        count = len(self._ready) + sum(len(batch) for batch in self._waiting.values())
        self._ready.clear()
        self._waiting.clear()
        while True:
            try:
                self._channel.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                return count
            count += 1

    def _take(self, group: RolloutGroup) -> RolloutGroup:
        self._pipeline.group_taken(group)
        return group

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
        if not self._enforce_order:
            return self._take(await self._pull())
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self._ready:
            self._hold(await self._pull())
        return self._take(self._ready.popleft())

    def try_next(self) -> RolloutGroup | None:
        """Take a group that is ready now, or return ``None`` at once.

        Never blocks, never cancels or loses work: when nothing is ready (or a
        non-streaming batch has been fully taken) it returns ``None`` and the pipeline
        runs on. Raises ``trio.ClosedResourceError`` after the ``async with`` has exited.
        Not a checkpoint.
        """
        try:
            if not self._enforce_order:
                return self._take(self._pull_nowait())
            while not self._ready:
                self._hold(self._pull_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return None
        return self._take(self._ready.popleft())

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
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    # ---------------------------------------------------------------- weight updates

    @property
    def policy_epoch(self) -> int:
        """The stream's policy epoch: calls that start now start under it, and each group
        records it as ``start_epoch``. It moves when a :meth:`weight_update` body returns,
        and stays readable after the stream has closed."""
        return self._pipeline.epoch

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
        return open_weight_update(self, self._pipeline, mode, epoch, backends)

    # ---------------------------------------------------------------- statistics

    def statistics(self) -> RolloutStreamStatistics:
        """A snapshot of the pipeline's counters. Not a checkpoint."""
        p = self._pipeline
        buffered = self._channel.statistics().current_buffer_used
        reordering = len(self._ready) + sum(len(b) for b in self._waiting.values())
        return RolloutStreamStatistics(
            started=p.started,
            completed=p.completed,
            filtered=p.filtered,
            delivered=p.delivered,
            in_flight=p.in_flight,
            buffered=buffered,
            reordering=reordering,
            failed=p.failed,
            outstanding_batches=p.outstanding_batches,
            retries=p.retries,
            timeouts=p.timeouts,
            skipped=p.skipped,
            raised=p.raised,
            waiting_to_retry=p.waiting_to_retry,
            cancelled=p.cancelled,
            pending=p.untaken,
            last_errors=tuple(p.last_errors),
            per_env={
                env_id: EnvironmentStatistics(
                    started=c.started, delivered=c.delivered, filtered=c.filtered, failed=c.failed
                )
                for env_id, c in p.env_counters.items()
            },
            policy_epoch=p.epoch,
            weight_updates=p.weight_updates,
            restarted=p.restarted,
            stale=p.stale,
            mixed=p.mixed,
        )


# --------------------------------------------------------------------------- bridge and actor
#
# What the sync bridge (``_blocking.py``) and the Ray rollout actor (``_ray/_actor.py``) need
# of a stream beyond its public surface. Each says which thread may call it: "Trio thread"
# means the thread running the stream's pipeline.


def settle_on_handover(stream: RolloutStream) -> bool:
    """For the sync bridge and the Ray actor. From now on a group's prompt draws are not
    done when the stream hands it out: the caller settles them with
    :func:`settle_handed` once the group has reached its consumer (draws never settled
    are given back when the stream closes). Returns whether the agent draws prompts (if
    not, there is nothing to settle). Trio thread, before the first group is taken."""
    pipeline = stream._pipeline
    pipeline.done_on_take = False
    return pipeline.tracking


def settle_handed(stream: RolloutStream, batch_id: int, index: int) -> None:
    """For the sync bridge and the Ray actor. The group the stream handed out from slot
    ``(batch_id, index)`` reached its consumer: its prompt draws are done (see
    :func:`settle_on_handover`). Any thread; a slot unknown or settled twice is
    ignored."""
    stream._pipeline.settle_slot(batch_id, index)


def put_back(stream: RolloutStream, groups: Sequence[RolloutGroup]) -> None:
    """For the sync bridge and the Ray actor. Undo the takes of ``groups`` (taken from
    this stream, in this order, and not handed on) and put them at the front of the
    stream, in order: they are handed out again before anything else, and a weight update
    checks them as it checks every group the stream holds. Only for a stream with
    ``enforce_order`` (``RuntimeError`` otherwise). Trio thread."""
    if not stream._enforce_order:
        msg = "put_back() needs a stream with enforce_order"
        raise RuntimeError(msg)
    pipeline = stream._pipeline
    for group in reversed(groups):
        pipeline.untake(group)
    stream._ready.extendleft(reversed(groups))


def return_stale(stream: RolloutStream, groups: Sequence[RolloutGroup]) -> None:
    """For the sync bridge and the Ray actor. Undo the takes of ``groups`` (taken from
    this stream and found too old by the caller) and generate their slots again before
    any other slot, booked as ``stale``; their prompt draws are given back.

    With ``enforce_order``, the stream goes back to the first batch of ``groups``: what it
    holds after them waits until their slots are filled again, so the order it hands out
    stays gap-free. Every group the stream handed out after the first of ``groups`` must
    be among them or have been given back with :func:`put_back` first. Trio thread."""
    if not groups:
        return
    pipeline = stream._pipeline
    for group in reversed(groups):
        pipeline.untake(group)
    if stream._enforce_order:
        first = min(group.batch_id for group in groups)
        # What the stream had released of the first batch: all of it once it moved past.
        released = (
            stream._released_of_next if first == stream._next_batch_id else pipeline.num_groups
        )
        held_back = list(stream._ready)
        stream._ready.clear()
        for group in held_back:
            stream._waiting.setdefault(group.batch_id, []).append(group)
        back = [*held_back, *groups]
        stream._released_of_next = released - sum(1 for g in back if g.batch_id == first)
        stream._next_batch_id = first
    for group in reversed(groups):  # each goes first: the first ends up first
        pipeline.regenerate_stale(group)


def staleness_bound(stream: RolloutStream) -> int | None:
    """For the sync bridge and the Ray actor: the request's ``max_staleness``. Any
    thread."""
    return stream._pipeline.max_staleness


def is_closed(stream: RolloutStream) -> bool:
    """For the sync bridge and the Ray actor: whether the stream's ``async with`` is
    exiting or has exited. Any thread."""
    return stream._pipeline.closed


def enforces_order(stream: RolloutStream) -> bool:
    """For the sync bridge and the Ray actor: the request's ``enforce_order``. Any
    thread."""
    return stream._enforce_order


def is_too_old(group: RolloutGroup, epoch: int, bound: int | None) -> bool:
    """For the sync bridge and the Ray merge: whether ``group`` may not be handed to the
    consumer under ``epoch`` with ``max_staleness`` ``bound``. Any thread."""
    return bound is not None and epoch - group.start_epoch > bound
