"""The consumer's side: :class:`RolloutStream`, one stream over any :class:`GroupSource`.

A stream hands out groups, one consumer task at a time, from a *source*: the local
pipeline (``_run.py``), whose groups come through a memory channel from its workers, or
the Ray merge (``trio_rollouts.ray``), whose groups come from rollout actors. The source
decides which group is next (completion order, or whole batches in ``batch_id`` order
with ``enforce_order``), never hands out a group too old for ``max_staleness``, and books
each take; the stream is the one surface users see: receiving, iteration, ``try_next``,
``drain``, ``weight_update``, ``statistics`` and ``metrics``. The sync bridge drives any
stream from another thread, through :func:`source_of`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import trio

from trio_rollouts.models._rollouts import RolloutGroup
from trio_rollouts.pipeline._ledger import RolloutStreamStatistics

if TYPE_CHECKING:
    import trio_rollouts.inference
    from trio_rollouts.inference import InferenceInterface, WeightUpdateMode
    from trio_rollouts.pipeline._epochs import WeightUpdate

__all__ = ["GroupSource", "RolloutStream", "drain_ready", "open_stream", "source_of"]


class GroupSource(Protocol):
    """Where a :class:`RolloutStream`'s groups come from: the local pipeline, or the Ray
    merge. Every method runs in the stream's Trio thread unless it says otherwise."""

    @property
    def closed(self) -> bool:
        """Whether the stream's ``async with`` has exited. Any thread."""

    @property
    def policy_epoch(self) -> int:
        """The stream's policy epoch."""

    @property
    def max_staleness(self) -> int | None:
        """The request's staleness bound."""

    @property
    def enforce_order(self) -> bool:
        """Whether whole batches are handed out in ``batch_id`` order. Any thread."""

    def take_ready(self) -> RolloutGroup | None:
        """Take the next group that is ready now, or return ``None``. Raises
        ``trio.EndOfChannel`` at the end of a non-streaming stream and
        ``trio.ClosedResourceError`` once closed. Not a checkpoint."""

    async def take_waiting(self) -> RolloutGroup:
        """Wait for the next group and take it; a cancelled wait takes nothing."""

    def take_back(self, groups: Sequence[RolloutGroup], *, regenerate: bool) -> None:
        """Undo the takes of ``groups`` (handed out in this order, never consumed): too
        old (``regenerate``: their slots are generated again first), or back first in
        line (``enforce_order``)."""

    def settle_on_handover(self) -> bool:
        """A taken group's prompt draws are done only once :meth:`handed` says so (the
        caller hands groups on); returns whether the calls draw prompts at all."""

    def handed(self, slot: tuple[int, int]) -> None:
        """The group of ``slot`` (``(batch_id, index_in_batch)`` as handed out) reached the
        caller's consumer: its prompt draws are done. Any thread."""

    def weight_update(
        self,
        mode: object,
        epoch: object,
        backends: Sequence[trio_rollouts.inference.InferenceInterface] | None,
    ) -> contextlib.AbstractAsyncContextManager[WeightUpdate]:
        """The stream's :meth:`RolloutStream.weight_update`."""

    def statistics(self) -> RolloutStreamStatistics:
        """A snapshot of the counters. Not a checkpoint."""

    def metrics(self) -> dict[str, float]:
        """What happened since the last call. Not a checkpoint."""


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

    __slots__ = ("_source",)

    _source: GroupSource

    def __init__(self) -> None:
        msg = "RolloutStream is created by GroupedRolloutGenerator.get_grouped_rollouts()"
        raise TypeError(msg)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.statistics()}>"

    async def receive(self) -> RolloutGroup:
        """Wait for the next group and take it.

        Raises ``trio.EndOfChannel`` when a non-streaming request's batch has been fully
        taken, and ``trio.ClosedResourceError`` after the ``async with`` has exited.

        Cancellation: always a cancellation point; a schedule point only when it has to
        wait for a group (so a consumer can take a full buffer without a task switch per
        group). If it is cancelled, no group is lost: a group that was not returned stays
        in the stream for the next call.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        group = self._source.take_ready()
        return group if group is not None else await self._source.take_waiting()

    def try_next(self) -> RolloutGroup | None:
        """Take a group that is ready now, or return ``None`` at once.

        Never blocks, never cancels or loses work: when nothing is ready (or a
        non-streaming batch has been fully taken) it returns ``None`` and the pipeline
        runs on. Raises ``trio.ClosedResourceError`` after the ``async with`` has exited.
        Not a checkpoint.
        """
        try:
            return self._source.take_ready()
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
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    @property
    def policy_epoch(self) -> int:
        """The stream's policy epoch: calls that start now start under it, and each group
        records it as ``start_epoch``. It moves when a :meth:`weight_update` body returns,
        and stays readable after the stream has closed."""
        return self._source.policy_epoch

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
        return self._source.weight_update(mode, epoch, backends)

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
        return self._source.metrics()

    def statistics(self) -> RolloutStreamStatistics:
        """A snapshot of the pipeline's counters. Not a checkpoint."""
        return self._source.statistics()


def open_stream(source: GroupSource, cls: type[RolloutStream] = RolloutStream) -> RolloutStream:
    """The stream (of class ``cls``) of ``source``."""
    stream = object.__new__(cls)
    stream._source = source
    return stream


def source_of(stream: RolloutStream) -> GroupSource:
    """Where ``stream``'s groups come from: what the sync bridge and the Ray actor drive
    (take-backs, settling prompts on handover). Any thread."""
    return stream._source
