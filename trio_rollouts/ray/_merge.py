"""The merge: the groups of ``num_actors`` rollout actors as one :class:`RayRolloutStream`.

For each actor (a :class:`~trio_rollouts.ray.RolloutActor`, ``_actor.py``) the merge keeps
a *lane*: a feeder task that asks the actor for a batch whenever there is room, a watcher
task that keeps a call pending on the actor to see its failure or death at once, and the
groups that wait in the merge. The consumer takes groups from the lanes in arrival order,
or round-robin by whole batches with ``enforce_order``. :func:`open_merged` is the merge's
life: start the actors, run the feeders and watchers, and stop and kill every actor on
the way out.

Invariants of the merge (each one is a test):

1. Bounded run-ahead: the merge asks an actor for a batch only when fewer than
   ``prefetch_batches * num_groups`` of that actor's groups wait in the merge, and has at
   most one request out per actor. Taking groups is what frees the actor's own pipeline,
   so an actor holds at most ``W * G`` groups that the consumer has not taken (its
   pipeline's bound) plus ``prefetch_batches * G`` in the merge.
2. ``enforce_order``: every reply is one actor's groups in its ``batch_id`` order (one
   whole batch, unless a stale group sent the actor back into one, invariant 7), and the
   merge hands batches out round-robin: actor 0's batch 0,
   actor 1's batch 0, ..., actor 0's batch 1, ... Without it, groups come in the order
   their replies arrived. Either way, a group's ``batch_id`` is renumbered
   ``local_batch_id * num_actors + actor_index``: unique, and with ``enforce_order``
   exactly 0, 1, 2, ... in delivery order.
3. An exception in any actor's pipeline reaches the consumer as that exception (Ray's
   ``RayTaskError`` envelope removed, a note naming the actor added), by cancelling the
   consumer's body as a failing worker does in a local pipeline. An actor process that
   dies is a :class:`RolloutActorDiedError` naming the actor.
4. Leaving the ``async with`` by any route stops every actor's pipeline (each one waits
   for its ``group_rollout`` calls to exit), then kills every actor; an actor that does not
   stop within ``stop_timeout`` seconds is killed anyway.
5. ``weight_update``: every actor's pipeline is paused (each actor holds its own stream's
   ``weight_update`` open in its Trio thread) before the body runs, and every actor is
   resumed at the exit: under the new epoch when the body returned, under the old one
   when it raised, was cancelled, or an actor could not pause. Updates are numbered; an
   actor refuses to begin an update that was already ended, so a begin that Ray runs late
   (actor threads run calls in any order) never leaves an actor paused.
6. Prompts, exactly once (``docs/checkpoint-resume.md``): each actor's agent owns a
   disjoint shard of the run's :class:`~trio_rollouts.PromptSource`, built in the actor by
   an agent factory::

       source = PromptSource(problems, seed=0)
       agent = lambda i: MyAgent(prompts=source.shard(i, num_actors))

   (a ``prompts`` source pickled to several actors as it is would be drawn by each of them:
   ``ValueError``, as are two actors whose shards have the same problems). A group handed to
   the merge may wait in its prefetch and be lost at a crash, so an actor's pipeline does
   not count a draw done when it serves the group (the actor opens it with
   ``settle_on_handover``): the merge tells each actor which of its groups it handed to the
   consumer (``receive``, ``try_next``, ``drain``, iteration; with the sync twin, when a
   group is returned to the caller), by their slot in the actor, in one ``settle`` call sent
   before its next ``serve`` and before any state is fetched; only for actors whose agent
   draws prompts. :meth:`RayRolloutStream.prompts_state_dict` settles, then merges every
   actor's ``agent.prompts.state_dict()`` with
   :meth:`~trio_rollouts.PromptSource.merge_state_dicts`; ``prompts_state=`` of
   :func:`open_ray_rollouts` loads shard ``i`` of such a state into actor ``i``'s
   ``agent.prompts`` before its pipeline opens. Groups in the prefetch that were never
   handed out are not settled: the actors' pipelines give their draws back when they stop,
   and a state fetched meanwhile counts them as not done.
7. Staleness (``docs/weight-updates.md``): with ``max_staleness`` ``K``,
   no group is handed to the consumer with ``policy_epoch - start_epoch > K``, where it
   waited does not matter: the merge checks each group when the consumer takes it (from
   the prefetch, or given back by the sync twin: :func:`put_back`). A group too old is
   given back to its actor with its next ``serve`` call, whose pipeline undoes the take
   and generates the slot again first (ledger: ``stale``; its prompt draw is given back,
   not settled). With ``enforce_order`` the groups the merge held after it from that
   actor go back too, and the consumer waits at the same place in the round-robin, so
   the order stays gap-free.

Ray's ``ObjectRef`` is awaitable in asyncio, not in Trio, so every wait for a reply is a
``ray.get`` in a worker thread that Trio abandons on cancellation (the reply, if it ever
comes, is dropped; the actor is stopped and killed at exit in any case).
"""

from __future__ import annotations

import collections
import contextlib
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

import attrs
import ray
import ray.exceptions
import trio

from trio_rollouts._concurrency import flatten_exception_groups
from trio_rollouts.inference import InferenceInterface, WeightUpdateMode
from trio_rollouts.models._records import RolloutGroup
from trio_rollouts.pipeline._epochs import (
    WeightUpdate,
    checked_epoch,
    checked_mode,
    exceeds_bound,
)
from trio_rollouts.pipeline._ledger import EnvironmentStatistics, RolloutStreamStatistics
from trio_rollouts.pipeline._metrics import MetricsBook
from trio_rollouts.pipeline._stream import drain_ready
from trio_rollouts.prompts._source import PromptSource
from trio_rollouts.ray._actor import (
    FINAL_SEQUENCE,
    AgentSource,
    RemoteRolloutActor,
    RequestSource,
    RolloutActorInfo,
    RolloutActorReply,
)
from trio_rollouts.ray._errors import RolloutActorDiedError, RolloutActorError

__all__ = [
    "RayRolloutStream",
    "RayRolloutStreamStatistics",
    "new_merged_stream",
    "open_merged",
    "put_back",
    "settle_handed",
    "settle_on_handover",
]

#: Ray colours the remote traceback it puts in an error message.
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


@attrs.frozen(kw_only=True)
class RayRolloutStreamStatistics(RolloutStreamStatistics):
    """The counters of a :class:`RayRolloutStream`: the sum over its actors, with each
    actor's own counters in ``per_actor`` (by actor index).

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
#: actor's (the stream itself then puts in its own, see RayRolloutStream.statistics).
_NOT_SUMMED = frozenset({"policy_epoch", "weight_updates"})
_COUNTERS = tuple(name for name in _int_fields() if name not in _NOT_SUMMED)


def _sum_statistics(
    per_actor: Sequence[RolloutStreamStatistics], prefetched: int
) -> RayRolloutStreamStatistics:
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


# --------------------------------------------------------------------------- the merge


class _Lane:
    """The merge's state for one actor. Only Trio tasks of one run touch it."""

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
        # slot; slots handed out and not sent yet (a deque: the sync twin's caller
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

    def own(self, group: RolloutGroup) -> RolloutGroup:
        """``group`` as the actor served it (its own ``batch_id``), to give it back; it
        leaves the prompt books (the actor gives back or keeps its draw)."""
        self.unhanded.pop((group.batch_id, group.index_in_batch), None)
        return attrs.evolve(group, batch_id=group.batch_id // self.num_actors)

    @property
    def actor_id(self) -> str:
        # Known once the actor has started (its own runtime context reports it).
        return "not known yet" if self.info is None else self.info.actor_id

    def describe(self) -> str:
        where = "" if self.info is None else f", pid {self.info.pid}"
        return f"rollout actor {self.index} of {self.num_actors} (actor_id={self.actor_id}{where})"

    def handed(self, group: RolloutGroup) -> None:
        """``group`` reached the consumer: settle its slot in the actor (lazily). Safe
        from the sync twin's caller thread: one atomic pop, one atomic append."""
        slot = self.unhanded.pop((group.batch_id, group.index_in_batch), None)
        if slot is not None:
            self.to_settle.append(slot)

    def take_to_settle(self) -> list[tuple[int, int]]:
        slots: list[tuple[int, int]] = []
        with contextlib.suppress(IndexError):
            while self.to_settle:
                slots.append(self.to_settle.popleft())
        return slots

    def flush_settles(self) -> None:
        """Send the slots handed out since the last call, in one ``settle`` call that is
        not waited for (its reference is kept for :meth:`RayRolloutStream.prompts_state_dict`
        to wait on). Trio thread; never blocks."""
        if not self.to_settle:
            return
        self.settling.append(self.handle.settle.remote(self.take_to_settle()))
        if len(self.settling) > 16:  # forget the calls that have run
            _, self.settling = ray.wait(
                self.settling, num_returns=len(self.settling), timeout=0, fetch_local=False
            )

    def update_snapshot(self, statistics: RolloutStreamStatistics, sequence: int) -> None:
        if sequence > self.sequence:
            self.snapshot, self.sequence = statistics, sequence

    def statistics(self) -> RolloutStreamStatistics:
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
        """Ray's view of a failure, turned into what the consumer should see."""
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

    @property
    def pid(self) -> int | None:
        return None if self.info is None else self.info.pid


class RayRolloutStream:
    """The groups of ``num_actors`` rollout actors, merged; :func:`open_ray_rollouts`
    yields it. Same surface as :class:`~trio_rollouts.RolloutStream`: async iteration,
    :meth:`receive`, :meth:`try_next`, :meth:`drain`, :meth:`statistics`; use it inside the
    ``async with`` that opened it, from one consumer task.
    """

    _agent_source: AgentSource
    _request_source: RequestSource
    _num_actors: int
    _prefetch_batches: int
    _actor_options: dict[str, Any]
    _start_timeout: float
    _stop_timeout: float
    _lanes: list[_Lane]
    _limiter: trio.CapacityLimiter
    _arrivals: collections.deque[tuple[_Lane, RolloutGroup]]
    _consumer: trio.lowlevel.ParkingLot
    _turn: int
    _taken_in_turn: int
    _num_groups: int
    _enforce_order: bool
    _streaming: bool
    _closing: bool
    _closed: bool
    _failure: BaseException | None
    _cancel_scope: trio.CancelScope | None
    _policy_epoch: int
    _weight_updates: int
    _updating: bool
    _update_number: int
    _prompts_states: list[dict[str, Any]] | None
    _done_on_take: bool
    _metrics: MetricsBook

    def __init__(self) -> None:
        msg = "RayRolloutStream is created by open_ray_rollouts()"
        raise TypeError(msg)

    def __repr__(self) -> str:
        return f"<RayRolloutStream of {self._num_actors} actors {self.statistics()}>"

    # ---------------------------------------------------------------- actors

    @property
    def actors(self) -> tuple[Any, ...]:
        """The Ray actor handles, by actor index."""
        return tuple(lane.handle for lane in self._lanes)

    @property
    def actor_info(self) -> tuple[RolloutActorInfo | None, ...]:
        """Where each actor runs (``None`` for an actor that has not started)."""
        return tuple(lane.info for lane in self._lanes)

    async def _ray_get(self, ref: Any) -> Any:
        return await trio.to_thread.run_sync(
            ray.get, ref, abandon_on_cancel=True, limiter=self._limiter
        )

    def _create_actors(self) -> None:
        """In a worker thread: pickle the agent and request once, create the actors."""
        sources = []
        for what, source in (("agent", self._agent_source), ("request", self._request_source)):
            try:
                sources.append(ray.put(source))
            except Exception as exc:
                exc.add_note(
                    f"the {what} is pickled to every actor; if it holds something that "
                    f"cannot be pickled, pass a function that builds the {what} in the "
                    "actor instead (it is called with the actor's index)"
                )
                raise
        remote = RemoteRolloutActor.options(**self._actor_options)
        for index in range(self._num_actors):
            handle = remote.remote(sources[0], sources[1], index)
            self._lanes.append(_Lane(index, self._num_actors, handle))

    async def _start_actors(self) -> None:
        # Not abandoned: every actor created must be known, to be killed at exit.
        await trio.to_thread.run_sync(self._create_actors, limiter=self._limiter)
        errors: list[BaseException] = []

        states = self._prompts_states

        async def start(lane: _Lane, cancel_scope: trio.CancelScope) -> None:
            state = None if states is None else states[lane.index]
            try:
                lane.info = await self._ray_get(lane.handle.start.remote(state, True))
            except Exception as exc:
                errors.append(lane.translate(exc))
                cancel_scope.cancel()  # one failed start fails them all: stop waiting

        with trio.move_on_after(self._start_timeout) as deadline:
            async with trio.open_nursery() as nursery:
                for lane in self._lanes:
                    nursery.start_soon(start, lane, nursery.cancel_scope)
        if errors:
            raise errors[0]
        if deadline.cancelled_caught:
            late = [lane.index for lane in self._lanes if lane.info is None]
            msg = (
                f"rollout actors {late} did not start within start_timeout="
                f"{self._start_timeout} s; can the cluster place {self._num_actors} actors "
                f"with {self._actor_options}? (ray.available_resources() tells)"
            )
            raise TimeoutError(msg)
        infos = [cast(RolloutActorInfo, lane.info) for lane in self._lanes]
        shapes = {(i.num_groups, i.streaming, i.enforce_order) for i in infos}
        if len(shapes) > 1:
            msg = (
                "every actor's request must have the same num_groups, streaming and "
                f"enforce_order; the request factory gave {sorted(shapes)}"
            )
            raise ValueError(msg)
        self._num_groups, self._streaming, self._enforce_order = shapes.pop()
        self._policy_epoch = max(info.policy_epoch for info in infos)
        owners: dict[str, int] = {}
        for info in infos:
            if info.prompts_fingerprint is None:
                continue
            first = owners.setdefault(info.prompts_fingerprint, info.index)
            if first != info.index:
                msg = (
                    f"rollout actors {first} and {info.index} draw from prompt sources with "
                    "the same problems: each actor must own a disjoint shard; build the "
                    "agent in each actor from a shard, agent=lambda i: "
                    "MyAgent(prompts=source.shard(i, num_actors))"
                )
                raise ValueError(msg)
        for lane, info in zip(self._lanes, infos, strict=True):
            lane.tracks = info.tracks_prompts
            lane.bound = info.max_staleness

    async def _stop_actors(self) -> BaseException | None:
        """Stop every pipeline (waiting up to stop_timeout), then kill every actor.

        Returns the first failure an actor reported while stopping, for the caller to raise
        when nothing else is being raised.
        """
        failures: list[BaseException] = []

        async def stop(lane: _Lane) -> None:
            try:
                final = await self._ray_get(lane.handle.stop.remote(self._stop_timeout))
            except Exception as exc:
                failures.append(lane.translate(exc))
            else:
                if final is not None:
                    lane.update_snapshot(final, FINAL_SEQUENCE)

        with trio.move_on_after(self._stop_timeout + 1.0):
            async with trio.open_nursery() as nursery:
                for lane in self._lanes:
                    # An actor that has not started (not placed yet, or still building its
                    # pipeline) would only answer after that: it is killed at once.
                    if lane.info is not None:
                        nursery.start_soon(stop, lane)
        for lane in self._lanes:
            lane.closed = True
            with contextlib.suppress(Exception):
                ray.kill(lane.handle, no_restart=True)
        return failures[0] if failures else None

    def _fail(self, exc: BaseException) -> None:
        """The first failure wins; it cancels the feeders, the watchers and the consumer's
        body, and is raised from the ``async with``."""
        if self._failure is None and not self._closing:
            self._failure = exc
            if self._cancel_scope is not None:
                self._cancel_scope.cancel()

    # ---------------------------------------------------------------- feeders and watchers

    def _has_room(self, lane: _Lane) -> bool:
        cap = self._prefetch_batches * self._num_groups
        return not lane.ended and lane.held + self._num_groups <= cap

    async def _feed(self, lane: _Lane) -> None:
        """Ask ``lane``'s actor for a batch whenever the merge has room for one, and give
        it back the groups found too old (with no room: a call that takes none)."""
        while True:
            while not (self._has_room(lane) or lane.stale):
                await lane.wanted.park()
            n = self._num_groups if self._has_room(lane) else 0
            given_back, stale = lane.given_back, lane.stale
            lane.given_back, lane.stale = [], []
            lane.requested = True
            lane.flush_settles()
            ref = lane.handle.serve.remote(n, self._enforce_order, None, given_back, stale)
            try:
                reply: RolloutActorReply = await self._ray_get(ref)
            except Exception as exc:
                self._fail(lane.translate(exc))
                return
            finally:
                lane.requested = False
            self._accept(lane, reply)

    def _accept(self, lane: _Lane, reply: RolloutActorReply) -> None:
        lane.update_snapshot(reply.statistics, reply.sequence)
        tracks = lane.tracks
        groups = reply.groups
        if self._enforce_order and lane.stale:
            # Served after a group now going back: they go back with it (invariant 7).
            lane.given_back.extend(groups)
            groups = []
        for group in groups:
            own = group.batch_id
            group.batch_id = own * self._num_actors + lane.index
            if tracks:
                lane.unhanded[(group.batch_id, group.index_in_batch)] = (
                    own,
                    group.index_in_batch,
                )
            if self._enforce_order:
                lane.groups.append(group)
            else:
                self._arrivals.append((lane, group))
        lane.held += len(groups)
        lane.received += len(groups)
        if reply.ended or (not self._streaming and lane.received >= self._num_groups):
            lane.ended = True
        self._consumer.unpark_all()

    async def _watch(self, lane: _Lane) -> None:
        """Keep a ``wait_stopped`` call pending on the actor: it returns or fails when the
        actor's pipeline ends, and fails at once when the actor's process dies."""
        try:
            await self._ray_get(lane.handle.wait_stopped.remote())
        except Exception as exc:
            self._fail(lane.translate(exc))
            return
        msg = f"{lane.describe()} stopped its pipeline while the stream was open"
        self._fail(
            RolloutActorError(msg, actor_index=lane.index, actor_id=lane.actor_id, pid=lane.pid)
        )

    # ---------------------------------------------------------------- taking groups

    def _pop_ready(self) -> RolloutGroup | None:
        """The next group in merge order if it is here; ``None`` if it is still to come."""
        if self._closed:
            raise trio.ClosedResourceError("the stream's 'async with' has exited")
        if not self._enforce_order:
            while self._arrivals:
                lane, group = self._arrivals.popleft()
                if not self._give_back_if_stale(lane, group):
                    return self._take(lane, group)
            if all(lane.ended for lane in self._lanes):
                raise trio.EndOfChannel
            return None
        # Round-robin by whole batch, skipping actors whose stream has ended and is empty.
        for _ in range(len(self._lanes)):
            lane = self._lanes[self._turn]
            if lane.groups or not lane.ended:
                break
            self._advance_turn()
        else:
            raise trio.EndOfChannel
        if not lane.groups:
            return None
        group = lane.groups.popleft()
        if self._give_back_if_stale(lane, group):
            return None  # its slot comes again, in its place
        self._take(lane, group)
        self._taken_in_turn += 1
        if self._taken_in_turn == self._num_groups:
            self._advance_turn()
        return group

    def _give_back_if_stale(self, lane: _Lane, group: RolloutGroup) -> bool:
        """Invariant 7: ``group``, about to be taken from ``lane``, is too old: give it
        back to its actor, and with ``enforce_order`` the lane's groups after it (the
        actor holds back what comes after the slot until it is filled again). Returns
        whether it was given back."""
        if not exceeds_bound(group.start_epoch, self._policy_epoch, lane.bound):
            return False
        back = [group]
        if self._enforce_order:
            back.extend(lane.groups)
            lane.groups.clear()
        lane.held -= len(back)
        lane.received -= len(back)
        if not self._streaming:
            lane.ended = False  # the slot comes again
        lane.stale.append(lane.own(group))
        lane.given_back.extend(lane.own(g) for g in back[1:])
        lane.wanted.unpark_all()
        return True

    def _advance_turn(self) -> None:
        self._turn = (self._turn + 1) % len(self._lanes)
        self._taken_in_turn = 0

    def _take(self, lane: _Lane, group: RolloutGroup) -> RolloutGroup:
        lane.held -= 1
        lane.taken += 1
        if lane.tracks and self._done_on_take:
            lane.handed(group)
        if not lane.requested and self._has_room(lane):
            lane.wanted.unpark_all()
        return group

    async def receive(self) -> RolloutGroup:
        """Wait for the next group and take it.

        Raises ``trio.EndOfChannel`` when a non-streaming request's batches (one per actor)
        have all been taken, and ``trio.ClosedResourceError`` after the ``async with`` has
        exited.

        Cancellation: always a cancellation point; a schedule point only when it has to
        wait. If it is cancelled, no group is lost and no actor is disturbed: the group
        arrives on a later call.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            group = self._pop_ready()
            if group is not None:
                return group
            await self._consumer.park()

    def try_next(self) -> RolloutGroup | None:
        """Take a group that is in the merge now, or return ``None`` at once.

        Never blocks, never asks an actor (a take frees room, which wakes the actor's
        feeder), never loses work. Not a checkpoint.
        """
        try:
            return self._pop_ready()
        except trio.EndOfChannel:
            return None

    def drain(self, n: int) -> list[RolloutGroup]:
        """Take up to ``n`` groups that are in the merge now; never blocks. Not a
        checkpoint."""
        return drain_ready(self.try_next, n)

    def __aiter__(self) -> RayRolloutStream:
        return self

    async def __anext__(self) -> RolloutGroup:
        """Async iteration: :meth:`receive` until the stream ends. Cancellation: as
        :meth:`receive`."""
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    # ---------------------------------------------------------------- statistics

    def statistics(self) -> RayRolloutStreamStatistics:
        """The actors' counters summed, and each actor's in ``per_actor``, as of each
        actor's latest reply (see :class:`RayRolloutStreamStatistics`); ``policy_epoch``
        and ``weight_updates`` are the merged stream's own. Never asks an actor; not a
        checkpoint."""
        prefetched = sum(lane.held for lane in self._lanes if not lane.closed)
        merged = _sum_statistics([lane.statistics() for lane in self._lanes], prefetched)
        return attrs.evolve(
            merged, policy_epoch=self._policy_epoch, weight_updates=self._weight_updates
        )

    def metrics(self) -> dict[str, float]:
        """As :meth:`RolloutStream.metrics <trio_rollouts.RolloutStream.metrics>`, from
        the merged counters of :meth:`statistics` (as of each actor's latest reply):
        the deltas, the gauges, the loop's lag and the process's RSS of this (the
        trainer's) process; no staleness percentiles or waits, which the actors keep.
        The first call's interval starts when the stream opened (every actor had
        started); the loop-lag probe the first call starts stops when the stream closes.
        Not a checkpoint. Works after the ``async with`` has exited too (the last
        interval)."""
        return self._metrics.report(self.statistics(), None)

    # ---------------------------------------------------------------- prompts

    async def prompts_state_dict(self) -> dict[str, Any]:
        """The state of the run's prompts, to checkpoint with the trainer:
        :meth:`PromptSource.merge_state_dicts <trio_rollouts.PromptSource.merge_state_dicts>`
        of every actor's ``agent.prompts.state_dict()``, by actor index. Give it back as
        ``open_ray_rollouts(..., prompts_state=state)`` to go on from here.

        Every group handed to the consumer so far (by :meth:`receive`, :meth:`try_next`,
        :meth:`drain`, iteration) is done in it; groups still in the merge's prefetch, on
        their way, or in the actors' pipelines are not (they are drawn first after a
        restore). The actors settle the groups handed out first, and this waits for that.

        Errors: ``TypeError`` if an actor's agent has no ``prompts`` (a
        :class:`~trio_rollouts.PromptSource`), ``RuntimeError`` after the ``async with``
        has exited, an actor that died is a :class:`RolloutActorDiedError`. The actors
        answer from a thread of their own, without waiting for their pipelines.

        Cancellation: the stream is unaffected; settles already sent still run.
        """
        if self._closed:
            msg = "prompts_state_dict() on a stream whose async with has exited"
            raise RuntimeError(msg)
        missing = [
            lane.index
            for lane in self._lanes
            if lane.info is None or lane.info.prompts_fingerprint is None
        ]
        if missing:
            msg = (
                f"prompts_state_dict() needs every actor's agent to have a PromptSource in "
                f"its prompts field; actors {missing} have none"
            )
            raise TypeError(msg)
        states: list[dict[str, Any]] = [{} for _ in self._lanes]
        failures: list[BaseException] = []

        async def fetch(lane: _Lane, cancel_scope: trio.CancelScope) -> None:
            lane.flush_settles()
            sent = list(lane.settling)
            try:
                if sent:
                    await self._ray_get(sent)
                slots = lane.take_to_settle()
                ref = lane.handle.prompts_state.remote(slots)
                if slots:
                    lane.settling.append(ref)
                states[lane.index] = await self._ray_get(ref)
            except Exception as exc:
                failures.append(lane.translate(exc))
                cancel_scope.cancel()
                return
            ran = {*sent, ref}
            lane.settling = [r for r in lane.settling if r not in ran]

        with flatten_exception_groups():
            async with trio.open_nursery() as nursery:
                for lane in self._lanes:
                    nursery.start_soon(fetch, lane, nursery.cancel_scope)
        if failures:
            raise failures[0]
        return PromptSource.merge_state_dicts(states)

    # ---------------------------------------------------------------- weight updates

    @property
    def policy_epoch(self) -> int:
        """The merged stream's policy epoch: the greatest of the actors' epochs when they
        started, then the epoch of each :meth:`weight_update` whose body returned.
        Readable after the stream has closed."""
        return self._policy_epoch

    def weight_update(
        self,
        mode: WeightUpdateMode = "drain",
        *,
        epoch: int | None = None,
        backends: Sequence[InferenceInterface] | None = None,
    ) -> contextlib.AbstractAsyncContextManager[WeightUpdate]:
        """Pause every actor's pipeline for a weight update, as an async context
        manager::

            async with stream.weight_update(mode="drain") as update:
                await push_weights(update.epoch)   # to every actor's backend

        Each actor enters its own stream's
        :meth:`~trio_rollouts.RolloutStream.weight_update` with ``mode`` and ``epoch``
        (default ``policy_epoch + 1``), pausing its request's ``inference_interface``;
        the body runs once every actor has paused. ``update.held`` is the actors' total,
        ``update.pause_seconds`` the time until the last one had paused. At the exit
        every actor resumes: under the new epoch when the body returned (then
        :attr:`policy_epoch` moves), under the old one when the body raised or was
        cancelled. Groups already in the merge, or finished in an actor, can be taken
        during the body.

        ``backends`` must be ``None`` (``TypeError`` otherwise): backends in this process
        cannot reach the actors' copies, which are built or unpickled in each actor;
        each actor pauses its own request's ``inference_interface``. To pause another
        backend, make it the request's interface (a request factory can give each actor
        its own), or drive :class:`RolloutActor`'s ``begin_weight_update`` yourself.

        Errors: ``ValueError`` for an unknown mode or an epoch not above
        :attr:`policy_epoch`, ``RuntimeError`` for a second update while one is in
        progress (these before any actor is asked). An actor that cannot pause raises,
        in that actor, what its stream raises (``TypeError`` for a mode its backend does
        not support, :class:`~trio_rollouts.inference.WeightUpdateError` when a pause
        failed), with a note naming the actor: every actor is then resumed under the old
        epoch (the others may have paused already) and that error is raised. An actor
        that dies during the update is a :class:`RolloutActorDiedError` (and fails the
        stream); the other actors are resumed. A backend that fails to resume after a
        returned body is a ``WeightUpdateError`` raised at the exit (the epoch has
        moved), after every actor was told; after a failed body, such failures are
        notes on the body's exception.

        Staleness: with ``max_staleness``, no group is handed out too old for the
        epoch, wherever it waited: the merge checks each group when the consumer takes
        it, and gives one too old back to its actor, which generates its slot again
        first (``statistics().stale``; with ``enforce_order`` the order stays gap-free).

        Cancellation: entering waits for every actor to pause (a drain waits for the
        actors' calls in flight); cancelling it, or the body, resumes every actor under
        the old epoch, shielded from cancellation. The exit waits, shielded, for every
        actor to resume. Nothing is left paused on any route; an actor whose Trio loop
        is blocked (a ``group_rollout`` that never yields) holds the wait.
        """
        return _open_ray_weight_update(self, mode, epoch, backends)

    async def _begin_update(
        self, number: int, mode: WeightUpdateMode, epoch: int
    ) -> list[WeightUpdate]:
        """Begin update ``number`` in every actor at once; raise the first failure (the
        others as notes) once every begin has answered or been abandoned."""
        updates: list[WeightUpdate] = []
        failures: list[BaseException] = []

        async def begin(lane: _Lane, cancel_scope: trio.CancelScope) -> None:
            try:
                ref = lane.handle.begin_weight_update.remote(number, mode, epoch)
                updates.append(await self._ray_get(ref))
            except Exception as exc:
                failures.append(lane.translate(exc))
                cancel_scope.cancel()  # one actor cannot pause: stop waiting for the rest

        with flatten_exception_groups():
            async with trio.open_nursery() as nursery:
                for lane in self._lanes:
                    nursery.start_soon(begin, lane, nursery.cancel_scope)
        if failures:
            error = failures[0]
            for other in failures[1:]:
                error.add_note(f"another actor failed too: {type(other).__name__}: {other}")
            raise error
        return updates

    async def _end_update(self, number: int, body_failed: bool) -> list[BaseException]:
        """End update ``number`` in every actor (each one gives up a begin still waiting
        and refuses a late one), shielded from cancellation; return the failures, the
        notes of a failed body's exit among them as ``_ActorNotes``."""
        failures: list[BaseException] = []

        async def end(lane: _Lane) -> None:
            try:
                ref = lane.handle.end_weight_update.remote(number, body_failed)
                notes: list[str] = await self._ray_get(ref)
            except Exception as exc:
                failures.append(lane.translate(exc))
            else:
                if notes:
                    failures.append(_ActorNotes(lane.describe(), notes))

        with trio.CancelScope(shield=True), flatten_exception_groups():
            async with trio.open_nursery() as nursery:
                for lane in self._lanes:
                    nursery.start_soon(end, lane)
        return failures

    async def fetch_statistics(self) -> RayRolloutStreamStatistics:
        """Ask every actor for its counters now, wait for the answers, then return
        :meth:`statistics`.

        An actor that has failed or died keeps its previous counters (its failure reaches
        the consumer on its own). An actor answers when its pipeline's Trio loop next
        checkpoints: bound the wait with ``trio.move_on_after`` if a ``group_rollout`` can
        hold the loop.

        Cancellation: cancelling it abandons the questions not yet answered (the actors
        that answered are updated); the stream is unaffected.
        """

        async def fetch(lane: _Lane) -> None:
            with contextlib.suppress(Exception):
                lane.flush_settles()
                reply = await self._ray_get(lane.handle.serve.remote(0))
                lane.update_snapshot(reply.statistics, reply.sequence)

        if not self._closed:
            async with trio.open_nursery() as nursery:
                for lane in self._lanes:
                    nursery.start_soon(fetch, lane)
        return self.statistics()


class _ActorNotes(Exception):
    """The notes an actor's update added on its way out of a failed body (resume
    failures), carried back to the merge as a failure of that actor's exit."""

    def __init__(self, actor: str, notes: list[str]) -> None:
        super().__init__(f"{actor}: " + "; ".join(notes))


@contextlib.asynccontextmanager
async def _open_ray_weight_update(
    stream: RayRolloutStream,
    mode: object,
    epoch: object,
    backends: Sequence[InferenceInterface] | None,
) -> AsyncIterator[WeightUpdate]:
    """What :meth:`RayRolloutStream.weight_update` returns."""
    if stream._closed:
        msg = "weight_update() on a stream whose async with has exited"
        raise RuntimeError(msg)
    if backends is not None:
        msg = (
            "RayRolloutStream.weight_update() takes no backends: each actor pauses its own "
            "request's inference_interface (backends in this process cannot reach the "
            "actors' copies); make the backend to pause the request's inference_interface, "
            "or drive RolloutActor.begin_weight_update yourself"
        )
        raise TypeError(msg)
    checked = checked_mode(mode)
    new_epoch = checked_epoch(epoch, stream._policy_epoch)
    if stream._updating:
        msg = "a weight update is already in progress on this stream (one at a time)"
        raise RuntimeError(msg)
    stream._updating = True
    stream._update_number += 1
    number = stream._update_number
    entered = trio.current_time()
    try:
        try:
            updates = await stream._begin_update(number, checked, new_epoch)
        except BaseException as exc:
            # An actor could not pause, or the wait was cancelled (or the stream failed):
            # every actor resumes under the old epoch.
            for failure in await stream._end_update(number, body_failed=True):
                exc.add_note(f"ending the update failed too: {_describe(failure)}")
            raise
        update = WeightUpdate(
            epoch=new_epoch,
            mode=checked,
            held=sum(u.held for u in updates),
            pause_seconds=trio.current_time() - entered,
        )
        try:
            yield update
        except BaseException as exc:
            for failure in await stream._end_update(number, body_failed=True):
                exc.add_note(f"ending the update failed too: {_describe(failure)}")
            raise
        stream._policy_epoch = new_epoch
        stream._weight_updates += 1
        failures = await stream._end_update(number, body_failed=False)
    finally:
        stream._updating = False
    if failures:
        error = failures[0]
        for other in failures[1:]:
            error.add_note(f"ending the update failed too: {_describe(other)}")
        raise error


def _describe(exc: BaseException) -> str:
    if isinstance(exc, _ActorNotes):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def new_merged_stream(
    agent: AgentSource,
    request: RequestSource,
    num_actors: int,
    prefetch_batches: int,
    actor_options: dict[str, Any],
    start_timeout: float,
    stop_timeout: float,
    prompts_states: list[dict[str, Any]] | None = None,
) -> RayRolloutStream:
    """A merged stream, not opened yet (:func:`open_merged` runs it); arguments checked.

    Any thread, and no Trio call: the sync twin builds it in its caller's thread, and an
    ``open_ray_rollouts(...)`` may be made outside ``trio.run``. What needs Trio's run
    (the metrics' first interval) starts in :func:`open_merged`."""
    self = object.__new__(RayRolloutStream)
    self._agent_source = agent
    self._request_source = request
    self._num_actors = num_actors
    self._prefetch_batches = prefetch_batches
    self._actor_options = actor_options
    self._start_timeout = start_timeout
    self._stop_timeout = stop_timeout
    self._lanes = []
    # Threads blocked in ray.get: a feeder and a watcher per actor, plus start, stop,
    # statistics polls and a weight update's begin and end (abandoned threads hold
    # their token until Ray answers).
    self._limiter = trio.CapacityLimiter(max(8, 6 * num_actors))
    self._arrivals = collections.deque()
    self._consumer = trio.lowlevel.ParkingLot()  # the consumer waits here for groups
    self._turn = 0  # enforce_order: the actor whose batch is next
    self._taken_in_turn = 0
    self._num_groups = 0
    self._enforce_order = False
    self._streaming = False
    self._closing = False
    self._closed = False
    self._failure = None
    self._cancel_scope = None
    self._policy_epoch = 0  # the actors' greatest, once they have started
    self._weight_updates = 0
    self._metrics = MetricsBook()  # used in the Trio thread only
    self._updating = False
    self._update_number = 0
    self._prompts_states = prompts_states  # shard i is loaded into actor i
    # A group's prompt draw is done when the merge hands it to the consumer; the sync
    # twin turns this off and settles a group when it returns it to its caller.
    self._done_on_take = True
    return self


@contextlib.asynccontextmanager
async def open_merged(stream: RayRolloutStream) -> AsyncIterator[RayRolloutStream]:
    """The merge's life (invariants 3 and 4): start the actors, feed and watch each one
    while the consumer's body runs, then stop and kill every actor, shielded."""
    stop_failure: BaseException | None = None
    try:
        with flatten_exception_groups():
            await stream._start_actors()
            async with trio.open_nursery() as nursery:
                stream._cancel_scope = nursery.cancel_scope
                for lane in stream._lanes:
                    nursery.start_soon(stream._feed, lane)
                    nursery.start_soon(stream._watch, lane)
                stream._metrics.opened()  # the first interval of metrics() starts now
                try:
                    yield stream
                finally:
                    stream._closing = True  # what fails from here on is shutdown noise
                    nursery.cancel_scope.cancel()
    finally:
        stream._closing = True
        stream._closed = True
        stream._metrics.closed()  # the loop-lag probe, if metrics() started it, stops
        stream._consumer.unpark_all()
        with trio.CancelScope(shield=True):
            stop_failure = await stream._stop_actors()
    if stream._failure is not None:
        raise stream._failure
    if stop_failure is not None:
        raise stop_failure


# --------------------------------------------------------------------------- for the sync twin


def settle_on_handover(stream: RayRolloutStream) -> None:
    """For the sync twin: a group's prompt draw is not done when the merge hands it out,
    but when the twin returns it to its caller (:func:`settle_handed`). Before the stream
    opens."""
    stream._done_on_take = False


def settle_handed(stream: RayRolloutStream, group: RolloutGroup) -> None:
    """For the sync twin: ``group`` was returned to its caller; its prompt draw is done
    (the merge tells the actor before its next batch or any state fetch). Caller's thread:
    only an atomic pop and append."""
    lanes = stream._lanes
    if lanes:
        lane = lanes[group.batch_id % len(lanes)]
        if lane.tracks:
            lane.handed(group)


def put_back(stream: RayRolloutStream, groups: Sequence[RolloutGroup]) -> None:
    """For the sync twin: undo the takes of ``groups`` (taken from the merge in this
    order, the last ones it took, none returned to its caller) and put them back at the
    front of the merge, in order; they are checked for staleness again when taken
    (invariant 7). Trio thread."""
    if stream._closed or not groups:
        return
    lanes = stream._lanes
    for group in reversed(groups):
        lane = lanes[group.batch_id % len(lanes)]
        lane.held += 1
        lane.taken -= 1
        if stream._enforce_order:
            lane.groups.appendleft(group)
        else:
            stream._arrivals.appendleft((lane, group))
    if stream._enforce_order:
        # Back to the first group's place in the round-robin: the groups of its batch
        # before it were taken, in index order.
        first = groups[0]
        stream._turn = first.batch_id % len(lanes)
        stream._taken_in_turn = first.index_in_batch
    stream._consumer.unpark_all()
