"""The merge: the groups of ``num_actors`` rollout actors as one
:class:`~trio_rollouts.pipeline._stream.GroupSource`, under one
:class:`~trio_rollouts.ray.RayRolloutStream` (``_stream.py``).

For each actor (a :class:`~trio_rollouts.ray.RolloutActor`, ``_actor.py``) the merge keeps
a *lane* (``_lanes.py``): a feeder task that asks the actor for a batch whenever there is
room, a watcher task that keeps a call pending on the actor to see its failure or death
at once, and the groups that wait in the merge. The consumer takes groups from the lanes
in arrival order, or round-robin by whole batches with ``enforce_order``. :func:`open_merge`
is the merge's life: start the actors (``_actors.py``), run the feeders and watchers, and
stop and kill every actor on the way out. Weight updates across the actors are
``_update.py``'s.

Invariants of the merge (each one is a test in ``tests/test_ray*.py``):

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
   dies is a :class:`~trio_rollouts.ray.RolloutActorDiedError` naming the actor.
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
   consumer (``receive``, ``try_next``, ``drain``, iteration; through the sync bridge, when
   the bridge returns a group to its caller: :meth:`Merge.settle_on_handover`,
   :meth:`Merge.handed`), by their slot in the actor, in one ``settle`` call sent before
   its next ``serve`` and before any state is fetched; only for actors whose agent draws
   prompts. ``RayRolloutStream.prompts_state_dict`` settles, then merges every actor's
   ``agent.prompts.state_dict()`` with
   :meth:`~trio_rollouts.PromptSource.merge_state_dicts`; ``prompts_state=`` of
   ``open_ray_rollouts`` loads shard ``i`` of such a state into actor ``i``'s
   ``agent.prompts`` before its pipeline opens. Groups in the prefetch that were never
   handed out are not settled: the actors' pipelines give their draws back when they stop,
   and a state fetched meanwhile counts them as not done.
7. Staleness (``docs/weight-updates.md``): with ``max_staleness`` ``K``,
   no group is handed to the consumer with ``policy_epoch - start_epoch > K``, where it
   waited does not matter: the merge checks each group when the consumer takes it (from
   the prefetch, or given back by the sync bridge: :meth:`Merge.take_back`). A group too
   old is given back to its actor with its next ``serve`` call, whose pipeline undoes the
   take and generates the slot again first (ledger: ``stale``; its prompt draw is given
   back, not settled). With ``enforce_order`` the groups the merge held after it from that
   actor go back too, and the consumer waits at the same place in the round-robin, so
   the order stays gap-free.

Ray's ``ObjectRef`` is awaitable in asyncio, not in Trio, so every wait for a reply is a
``ray.get`` in a worker thread that Trio abandons on cancellation (``RayReplies``; the
reply, if it ever comes, is dropped; the actor is stopped and killed at exit in any case).

Threads: the stream's Trio thread, except :attr:`Merge.closed`, :attr:`Merge.enforce_order`
and :meth:`Merge.handed` (any thread).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import attrs
import trio

from trio_rollouts._concurrency import flatten_exception_groups
from trio_rollouts.inference import InferenceInterface
from trio_rollouts.models._rollouts import RolloutGroup
from trio_rollouts.pipeline._epochs import WeightUpdate, exceeds_bound
from trio_rollouts.pipeline._metrics import MetricsBook
from trio_rollouts.ray._actor import RolloutActorInfo, RolloutActorReply
from trio_rollouts.ray._actors import Actors, ActorsShape
from trio_rollouts.ray._lanes import Lane, RayRolloutStreamStatistics, sum_statistics
from trio_rollouts.ray._update import ActorUpdates

__all__ = ["Merge", "open_merge"]


class Merge:
    """The groups of a set of rollout actors, merged: the
    :class:`~trio_rollouts.pipeline._stream.GroupSource` of a
    :class:`~trio_rollouts.ray.RayRolloutStream`. Made and run by :func:`open_merge`;
    see the module docstring for its invariants."""

    def __init__(self, actors: Actors, prefetch_batches: int) -> None:
        self._actors = actors
        self._prefetch_batches = prefetch_batches
        self._arrivals: collections.deque[tuple[Lane, RolloutGroup]] = collections.deque()
        self._consumer = trio.lowlevel.ParkingLot()  # the consumer waits here for groups
        self._turn = 0  # enforce_order: the actor whose batch is next
        self._taken_in_turn = 0
        self._num_groups = 0
        self._enforce_order = False
        self._streaming = False
        self._closing = False
        self._closed = False
        self._failure: BaseException | None = None
        self._cancel_scope: trio.CancelScope | None = None
        self._metrics = MetricsBook()
        self._updates = ActorUpdates(
            actors, closed=lambda: self._closed, paused_for=self._paused_for
        )
        # A group's prompt draw is done when the merge hands it to the consumer, until
        # the sync bridge says it hands groups on (settle_on_handover).
        self._done_on_take = True

    def __repr__(self) -> str:
        return f"<Merge of {len(self._actors.lanes)} actors>"

    # ---------------------------------------------------------------- Ray's own

    @property
    def actor_handles(self) -> tuple[Any, ...]:
        """The Ray actor handles, by actor index."""
        return self._actors.handles

    @property
    def actor_info(self) -> tuple[RolloutActorInfo | None, ...]:
        """Where each actor runs (``None`` for an actor that has not started)."""
        return self._actors.infos

    async def fetch_statistics(self) -> RayRolloutStreamStatistics:
        """Ask every actor for its counters now (not after the stream closed), then
        return :meth:`statistics`.

        Cancellation: the questions not yet answered are abandoned; the stream is
        unaffected.
        """
        if not self._closed:
            await self._actors.fetch_statistics()
        return self.statistics()

    async def prompts_state_dict(self) -> dict[str, Any]:
        """The actors' prompt states, merged, once the groups handed out are settled
        (invariant 6). ``RuntimeError`` after the stream closed.

        Cancellation: the stream is unaffected; settles already sent still run.
        """
        if self._closed:
            msg = "prompts_state_dict() on a stream whose async with has exited"
            raise RuntimeError(msg)
        return await self._actors.prompts_state_dict()

    # ---------------------------------------------------------------- the source's state

    @property
    def closed(self) -> bool:
        """Whether the stream's ``async with`` has exited. Any thread."""
        return self._closed

    @property
    def policy_epoch(self) -> int:
        """The merged stream's policy epoch: the greatest of the actors' epochs when they
        started, then the epoch of each weight update whose body returned."""
        return self._updates.epoch

    @property
    def max_staleness(self) -> int | None:
        """The strictest of the actors' staleness bounds (``None`` when no actor has
        one). The merge checks each group against its own actor's bound; a caller that
        checks groups itself (the sync bridge) errs on the side of the fresher."""
        bounds = [lane.bound for lane in self._actors.lanes if lane.bound is not None]
        return min(bounds, default=None)

    @property
    def enforce_order(self) -> bool:
        """Whether batches are handed out round-robin, whole and in order. Any thread."""
        return self._enforce_order

    def _started(self, shape: ActorsShape) -> None:
        self._num_groups = shape.num_groups
        self._streaming = shape.streaming
        self._enforce_order = shape.enforce_order
        self._updates.started(shape.policy_epoch)

    def _fail(self, exc: BaseException) -> None:
        """The first failure wins; it cancels the feeders, the watchers and the consumer's
        body, and is raised from the ``async with``."""
        if self._failure is None and not self._closing:
            self._failure = exc
            if self._cancel_scope is not None:
                self._cancel_scope.cancel()

    # ---------------------------------------------------------------- feeders and watchers

    def _has_room(self, lane: Lane) -> bool:
        cap = self._prefetch_batches * self._num_groups
        return not lane.ended and lane.held + self._num_groups <= cap

    async def _feed(self, lane: Lane) -> None:
        """Ask ``lane``'s actor for a batch whenever the merge has room for one, and give
        it back the groups found too old (with no room: a call that takes none)."""
        while True:
            while not (self._has_room(lane) or lane.stale or lane.given_back):
                await lane.wanted.park()
            n = self._num_groups if self._has_room(lane) else 0
            given_back, stale = lane.given_back, lane.stale
            lane.given_back, lane.stale = [], []
            lane.requested = True
            lane.flush_settles()
            ref = lane.handle.serve.remote(n, self._enforce_order, None, given_back, stale)
            try:
                reply: RolloutActorReply = await self._actors.replies.get(ref)
            except Exception as exc:
                self._fail(lane.translate(exc))
                return
            finally:
                lane.requested = False
            self._accept(lane, reply)

    def _accept(self, lane: Lane, reply: RolloutActorReply) -> None:
        lane.update_snapshot(reply.statistics, reply.sequence)
        groups = reply.groups
        if self._enforce_order and lane.stale:
            # Served after a group now going back: they go back with it (invariant 7).
            lane.given_back.extend(groups)
            groups = []
        for group in groups:
            own = group.batch_id
            group.batch_id = own * lane.num_actors + lane.index
            if lane.tracks:
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

    async def _watch(self, lane: Lane) -> None:
        """Keep a ``wait_stopped`` call pending on the actor: it returns or fails when the
        actor's pipeline ends, and fails at once when the actor's process dies."""
        try:
            await self._actors.replies.get(lane.handle.wait_stopped.remote())
        except Exception as exc:
            self._fail(lane.translate(exc))
            return
        self._fail(lane.stopped_error())

    # ---------------------------------------------------------------- taking groups

    def take_ready(self) -> RolloutGroup | None:
        """The next group in merge order if it is here; ``None`` if it is still to come.
        Raises ``trio.EndOfChannel`` once every actor's non-streaming batch is taken, and
        ``trio.ClosedResourceError`` after close. Never asks an actor (a take frees room,
        which wakes the actor's feeder). Not a checkpoint."""
        if self._closed:
            raise trio.ClosedResourceError("the stream's 'async with' has exited")
        lanes = self._actors.lanes
        if not self._enforce_order:
            while self._arrivals:
                lane, group = self._arrivals.popleft()
                if not self._give_back_if_stale(lane, group):
                    return self._taken(lane, group)
            if all(lane.ended for lane in lanes):
                raise trio.EndOfChannel
            return None
        # Round-robin by whole batch, skipping actors whose stream has ended and is empty.
        for _ in range(len(lanes)):
            lane = lanes[self._turn]
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
        self._taken(lane, group)
        self._taken_in_turn += 1
        if self._taken_in_turn == self._num_groups:
            self._advance_turn()
        return group

    async def take_waiting(self) -> RolloutGroup:
        """Wait for the next group in merge order and take it.

        Cancellation: a cancelled wait takes nothing and disturbs no actor: the group
        arrives on a later call.
        """
        waited = trio.current_time()
        try:
            while True:
                group = self.take_ready()
                if group is not None:
                    return group
                await self._consumer.park()
        finally:
            self._metrics.wait_seconds += trio.current_time() - waited

    def _give_back_if_stale(self, lane: Lane, group: RolloutGroup) -> bool:
        """Invariant 7: ``group``, about to be taken from ``lane``, is too old: give it
        back to its actor (:meth:`_give_back`). Returns whether it was given back."""
        if not exceeds_bound(group.start_epoch, self._updates.epoch, lane.bound):
            return False
        self._give_back(lane, group)
        return True

    def _give_back(self, lane: Lane, group: RolloutGroup) -> None:
        """``group``, the next of ``lane`` in merge order, goes back to its actor to be
        generated again first, and with ``enforce_order`` the lane's groups after it (the
        actor holds back what comes after the slot until it is filled again)."""
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

    def _advance_turn(self) -> None:
        self._turn = (self._turn + 1) % len(self._actors.lanes)
        self._taken_in_turn = 0

    def _taken(self, lane: Lane, group: RolloutGroup) -> RolloutGroup:
        """Book the consumer's take of ``group``; return it."""
        lane.held -= 1
        lane.taken += 1
        if lane.tracks and self._done_on_take:
            lane.handed((group.batch_id, group.index_in_batch))
        staleness = self._updates.epoch - group.start_epoch
        if staleness > 0:
            self._metrics.taken(staleness)
        if not lane.requested and self._has_room(lane):
            lane.wanted.unpark_all()
        return group

    def take_back(self, groups: Sequence[RolloutGroup], *, regenerate: bool) -> None:
        """Undo the takes of ``groups`` (taken from the merge in this order, the last ones
        it handed out, none handed on by the caller).

        Without ``regenerate`` they go back to the front of the merge, in order (with
        ``enforce_order``, the round-robin goes back to the first one's place), and are
        checked for staleness again when taken (invariant 7). With ``regenerate`` they
        are too old: each goes back to its actor with its next ``serve``, whose pipeline
        generates the slot again first (ledger: ``stale``); with ``enforce_order`` they go
        back to the front first, and the first of each actor goes back to it with the
        groups the merge holds after it, so the order stays gap-free. Nothing after close.
        """
        if self._closed or not groups:
            return
        actors = self._actors
        if regenerate and not self._enforce_order:
            for group in groups:
                lane = actors.lane_of(group.batch_id)
                lane.taken -= 1
                lane.received -= 1
                if not self._streaming:
                    lane.ended = False  # the slot comes again
                lane.stale.append(lane.own(group))
                lane.wanted.unpark_all()
            return
        for group in reversed(groups):
            lane = actors.lane_of(group.batch_id)
            lane.held += 1
            lane.taken -= 1
            if self._enforce_order:
                lane.groups.appendleft(group)
            else:
                self._arrivals.appendleft((lane, group))
        if self._enforce_order:
            # Back to the first group's place in the round-robin: the groups of its batch
            # before it were taken, in index order.
            first = groups[0]
            self._turn = first.batch_id % len(actors.lanes)
            self._taken_in_turn = first.index_in_batch
            if regenerate:
                firsts: dict[int, Lane] = {}
                for group in groups:
                    lane = actors.lane_of(group.batch_id)
                    firsts.setdefault(lane.index, lane)
                for lane in firsts.values():
                    self._give_back(lane, lane.groups.popleft())
        self._consumer.unpark_all()

    def settle_on_handover(self) -> bool:
        """From now on a group's prompt draw is done when the caller says it handed the
        group on (:meth:`handed`), not when the merge hands it out (invariant 6); returns
        whether any actor's agent draws prompts."""
        self._done_on_take = False
        return any(lane.tracks for lane in self._actors.lanes)

    def handed(self, slot: tuple[int, int]) -> None:
        """The group of merged ``slot`` reached the caller's consumer: its prompt draw is
        done (the merge tells the actor before its next batch or any state fetch). Any
        thread: only an atomic pop and append; a slot settled twice, or unknown, is
        ignored."""
        lanes = self._actors.lanes
        if lanes:
            lane = lanes[slot[0] % len(lanes)]
            if lane.tracks:
                lane.handed(slot)

    # ---------------------------------------------------------------- weight updates, counters

    def weight_update(
        self, mode: object, epoch: object, backends: Sequence[InferenceInterface] | None
    ) -> contextlib.AbstractAsyncContextManager[WeightUpdate]:
        """A weight update across every actor (invariant 5; ``_update.py``)."""
        return self._updates.open(mode, epoch, backends)

    def _paused_for(self, seconds: float) -> None:
        self._metrics.pause_seconds += seconds

    def statistics(self) -> RayRolloutStreamStatistics:
        """The actors' counters summed, and each actor's in ``per_actor``, as of each
        actor's latest reply; ``policy_epoch`` and ``weight_updates`` are the merged
        stream's own. Never asks an actor; not a checkpoint."""
        lanes = self._actors.lanes
        prefetched = sum(lane.held for lane in lanes if not lane.closed)
        merged = sum_statistics([lane.statistics() for lane in lanes], prefetched)
        return attrs.evolve(
            merged,
            policy_epoch=self._updates.epoch,
            weight_updates=self._updates.weight_updates,
        )

    def metrics(self) -> dict[str, float]:
        """What happened since the last call, from the merged counters (the actors'
        backends are in their processes: no ``inference/`` keys). Not a checkpoint."""
        return self._metrics.report(self.statistics(), None)


@contextlib.asynccontextmanager
async def open_merge(actors: Actors, prefetch_batches: int) -> AsyncIterator[Merge]:
    """The merge's life (invariants 3 and 4): start the actors, feed and watch each one
    while the consumer's body runs, then stop and kill every actor, shielded.

    Cancellation: leaving the ``async with`` by any route stops and kills every actor
    (shielded) before ``__aexit__`` returns; cancelling ``__aenter__`` while the actors
    start kills those started so far. An actor's failure cancels the body and is raised
    from the ``async with``.
    """
    merge = Merge(actors, prefetch_batches)
    stop_failure: BaseException | None = None
    try:
        with flatten_exception_groups():
            merge._started(await actors.start())
            async with trio.open_nursery() as nursery:
                merge._cancel_scope = nursery.cancel_scope
                for lane in actors.lanes:
                    nursery.start_soon(merge._feed, lane)
                    nursery.start_soon(merge._watch, lane)
                merge._metrics.opened()  # the first interval of metrics() starts now
                try:
                    yield merge
                finally:
                    merge._closing = True  # what fails from here on is shutdown noise
                    nursery.cancel_scope.cancel()
    finally:
        merge._closing = True
        merge._closed = True
        merge._metrics.closed()  # the loop-lag probe, if metrics() started it, stops
        merge._consumer.unpark_all()
        with trio.CancelScope(shield=True):
            stop_failure = await actors.stop()
    if merge._failure is not None:
        raise merge._failure
    if stop_failure is not None:
        raise stop_failure
