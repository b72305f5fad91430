"""One rollout actor as the merge sees it: its :class:`Lane`, and the merged counters.

A lane holds what the merge knows of one actor (``_actor.py``): its Ray handle and where
it runs, the groups it served that wait in the merge, its counters as of its latest
reply, the prompt books of invariant 6 and the groups to give back to it under invariant
7 (the invariants are numbered in ``_merge.py``). It also turns Ray's view of the actor's
failures into what the consumer sees (:meth:`Lane.translate`).
:class:`RayRolloutStreamStatistics` and :func:`sum_statistics` merge the lanes' counters;
:class:`RayReplies` waits for the actors' replies, in worker threads.

Threads: a lane is touched by the Trio tasks of one stream, except :meth:`Lane.handed`,
which the sync bridge calls from its caller's thread.
"""

from __future__ import annotations

import collections
import contextlib
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import ray
import ray.exceptions
import trio

from trio_rollouts.models._rollouts import RolloutGroup
from trio_rollouts.pipeline._ledger import EnvironmentStatistics, RolloutStreamStatistics
from trio_rollouts.ray._actor import RolloutActorInfo
from trio_rollouts.ray._errors import RolloutActorDiedError, RolloutActorError

__all__ = ["Lane", "RayReplies", "RayRolloutStreamStatistics", "sum_statistics"]

T = TypeVar("T")

#: Ray colours the remote traceback it puts in an error message.
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
#: Settle calls kept to wait on before the merge forgets those that have run.
_SETTLES_KEPT = 16


@attrs.frozen(kw_only=True)
class RayRolloutStreamStatistics(RolloutStreamStatistics):
    """The counters of a :class:`~trio_rollouts.ray.RayRolloutStream`: the sum over its
    actors, with each actor's own counters in ``per_actor`` (by actor index).

    Actor counters are as of each actor's latest reply (or
    :meth:`RayRolloutStream.fetch_statistics`), so ``in_flight`` and ``buffered`` may lag.
    The merge's own counts are exact: ``delivered`` counts groups the consumer has taken,
    and ``pending`` includes groups on their way from an actor or waiting in the merge
    (``prefetched`` of them are in the merge now). After the stream closes, groups nobody
    took count as ``cancelled``. ``last_errors`` entries start with ``"actor N: "``.
    """

    per_actor: tuple[RolloutStreamStatistics, ...] = ()
    prefetched: int = 0


def _zero_statistics() -> RolloutStreamStatistics:
    return RolloutStreamStatistics(
        started=0,
        completed=0,
        filtered=0,
        delivered=0,
        in_flight=0,
        buffered=0,
        reordering=0,
        failed=0,
        outstanding_batches=0,
    )


def _int_fields() -> tuple[str, ...]:
    return tuple(a.name for a in attrs.fields(RolloutStreamStatistics) if a.type in (int, "int"))


#: Integer fields that are not counts of calls or groups: the merge takes the greatest
#: actor's (the merge then puts in its own, see ``Merge.statistics``).
_NOT_SUMMED = frozenset({"policy_epoch", "weight_updates"})
_COUNTERS = tuple(name for name in _int_fields() if name not in _NOT_SUMMED)


def sum_statistics(
    per_actor: Sequence[RolloutStreamStatistics], prefetched: int
) -> RayRolloutStreamStatistics:
    """The actors' counters summed (the greatest for ``policy_epoch`` and
    ``weight_updates``), their environments merged, their errors named by actor."""
    totals = {name: sum(getattr(s, name) for s in per_actor) for name in _COUNTERS}
    for name in _NOT_SUMMED:
        totals[name] = max((getattr(s, name) for s in per_actor), default=0)
    per_env: dict[str, EnvironmentStatistics] = {}
    for s in per_actor:
        for env_id, e in s.per_env.items():
            seen = per_env.get(env_id)
            per_env[env_id] = (
                e
                if seen is None
                else EnvironmentStatistics(
                    started=seen.started + e.started,
                    delivered=seen.delivered + e.delivered,
                    filtered=seen.filtered + e.filtered,
                    failed=seen.failed + e.failed,
                )
            )
    last_errors = tuple(
        f"actor {i}: {error}" for i, s in enumerate(per_actor) for error in s.last_errors
    )
    return RayRolloutStreamStatistics(
        **totals,
        last_errors=last_errors,
        per_env=per_env,
        per_actor=tuple(per_actor),
        prefetched=prefetched,
    )


class RayReplies:
    """Waits for the actors' replies. Ray's ``ObjectRef`` is awaitable in asyncio, not in
    Trio, so each wait is a ``ray.get`` in a worker thread.

    Threads blocked in ``ray.get``: a feeder and a watcher per actor, plus start, stop,
    statistics polls and a weight update's begin and end; a thread abandoned on
    cancellation holds its token until Ray answers. Built in any thread; used in the
    stream's Trio thread.
    """

    def __init__(self, num_actors: int) -> None:
        self._limiter = trio.CapacityLimiter(max(8, 6 * num_actors))

    async def get(self, ref: Any) -> Any:
        """``ray.get(ref)`` in a worker thread.

        Cancellation: the thread is abandoned (the reply, if it ever comes, is dropped).
        """
        return await trio.to_thread.run_sync(
            ray.get, ref, abandon_on_cancel=True, limiter=self._limiter
        )

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` in a worker thread, which is never abandoned: a cancellation waits
        for it to return."""
        return await trio.to_thread.run_sync(fn, limiter=self._limiter)


class Lane:
    """The merge's state for one actor. Only Trio tasks of one stream touch it, except
    :meth:`handed` (any thread)."""

    def __init__(self, index: int, num_actors: int, handle: Any) -> None:
        self.index = index
        self.num_actors = num_actors
        self.handle = handle
        self.info: RolloutActorInfo | None = None
        self.groups: collections.deque[RolloutGroup] = collections.deque()  # enforce_order
        self.held = 0  # received, not taken by the consumer
        self.received = 0
        self.taken = 0
        self.requested = False
        self.ended = False  # the actor sends no more groups
        self.closed = False  # the stream has closed: untaken groups count as cancelled
        self.snapshot = _zero_statistics()
        self.sequence = -1
        self.wanted = trio.lowlevel.ParkingLot()  # the feeder waits here for room
        # Prompt books (invariant 6), only when the actor's agent draws prompts: the
        # actor's own slot of each group received and not handed out, by its merged
        # slot; slots handed out and not sent yet (a deque: the sync bridge's caller
        # thread appends); settle calls sent and not known to have run.
        self.tracks = False
        self.unhanded: dict[tuple[int, int], tuple[int, int]] = {}
        self.to_settle: collections.deque[tuple[int, int]] = collections.deque()
        self.settling: list[Any] = []
        # Staleness (invariant 7): the actor's max_staleness, and the groups to give
        # back to it with its next serve call (with its own batch ids): too old, and with
        # enforce_order the groups after the first too old one.
        self.bound: int | None = None
        self.stale: list[RolloutGroup] = []
        self.given_back: list[RolloutGroup] = []

    def started(self, info: RolloutActorInfo) -> None:
        """The actor's pipeline is open: keep where it runs, whether its prompts are
        tracked and its staleness bound."""
        self.info = info
        self.tracks = info.tracks_prompts
        self.bound = info.max_staleness

    def own(self, group: RolloutGroup) -> RolloutGroup:
        """``group`` as the actor served it (its own ``batch_id``), to give it back; it
        leaves the prompt books (the actor gives back or keeps its draw)."""
        self.unhanded.pop((group.batch_id, group.index_in_batch), None)
        return attrs.evolve(group, batch_id=group.batch_id // self.num_actors)

    @property
    def actor_id(self) -> str:
        # Known once the actor has started (its own runtime context reports it).
        return "not known yet" if self.info is None else self.info.actor_id

    @property
    def pid(self) -> int | None:
        return None if self.info is None else self.info.pid

    def describe(self) -> str:
        where = "" if self.info is None else f", pid {self.info.pid}"
        return f"rollout actor {self.index} of {self.num_actors} (actor_id={self.actor_id}{where})"

    def handed(self, slot: tuple[int, int]) -> None:
        """The group of merged ``slot`` reached the consumer: settle its slot in the actor
        (lazily). Any thread: one atomic pop, one atomic append."""
        own = self.unhanded.pop(slot, None)
        if own is not None:
            self.to_settle.append(own)

    def take_to_settle(self) -> list[tuple[int, int]]:
        """The actor's slots handed out since the last call."""
        slots: list[tuple[int, int]] = []
        with contextlib.suppress(IndexError):
            while self.to_settle:
                slots.append(self.to_settle.popleft())
        return slots

    def flush_settles(self) -> None:
        """Send the slots handed out since the last call, in one ``settle`` call that is
        not waited for (its reference is kept, for a prompt state to wait on). Trio
        thread; never blocks."""
        if not self.to_settle:
            return
        self.settling.append(self.handle.settle.remote(self.take_to_settle()))
        if len(self.settling) > _SETTLES_KEPT:  # forget the calls that have run
            _, self.settling = ray.wait(
                self.settling, num_returns=len(self.settling), timeout=0, fetch_local=False
            )

    def update_snapshot(self, statistics: RolloutStreamStatistics, sequence: int) -> None:
        """The actor's counters, if newer than those the lane has."""
        if sequence > self.sequence:
            self.snapshot, self.sequence = statistics, sequence

    def statistics(self) -> RolloutStreamStatistics:
        """The actor's counters as the consumer sees them."""
        s = self.snapshot
        # The actor counts a group as delivered when it left the actor; the consumer has
        # taken only `taken` of them. The rest are on their way or in the merge.
        untaken = s.delivered - self.taken
        return attrs.evolve(
            s,
            delivered=self.taken,
            pending=s.pending + (0 if self.closed else untaken),
            cancelled=s.cancelled + (untaken if self.closed else 0),
        )

    def translate(self, exc: BaseException) -> BaseException:
        """Ray's view of a failure, turned into what the consumer should see: the agent's
        own exception with notes naming the actor, or a :class:`RolloutActorError`."""
        if isinstance(exc, ray.exceptions.RayTaskError):
            cause = exc.cause
            if isinstance(cause, BaseException) and not isinstance(cause, ray.exceptions.RayError):
                # str() of Ray's envelope is the remote traceback (the cause, unpickled,
                # has none of its own).
                cause.add_note(f"raised in {self.describe()}; the actor's traceback:")
                cause.add_note(_ANSI_ESCAPE.sub("", str(exc)).rstrip())
                return cause
            msg = f"{self.describe()} failed: {exc}"
            return RolloutActorError(
                msg, actor_index=self.index, actor_id=self.actor_id, pid=self.pid
            )
        if isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError)):
            msg = f"{self.describe()} died: {exc}"
            error: RolloutActorError = RolloutActorDiedError(
                msg, actor_index=self.index, actor_id=self.actor_id, pid=self.pid
            )
        elif isinstance(exc, ray.exceptions.RayError):
            msg = f"{self.describe()} failed in Ray: {type(exc).__name__}: {exc}"
            error = RolloutActorError(
                msg, actor_index=self.index, actor_id=self.actor_id, pid=self.pid
            )
        else:
            return exc
        error.__cause__ = exc
        return error

    def stopped_error(self) -> RolloutActorError:
        """The actor's pipeline ended on its own while the stream was open."""
        msg = f"{self.describe()} stopped its pipeline while the stream was open"
        return RolloutActorError(msg, actor_index=self.index, actor_id=self.actor_id, pid=self.pid)
