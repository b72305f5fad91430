"""The rollout actors of one Ray stream: creating and starting them, stopping and killing
them, and the questions asked of all of them at once.

:class:`Actors` owns the actors' life (invariants 4 and 6 of ``_merge.py``): it pickles
the agent and request once, creates one :class:`~trio_rollouts.ray.RolloutActor` per
index with a :class:`~trio_rollouts.ray._lanes.Lane` for each, starts every pipeline
(loading each actor's shard of a prompt state first) and checks that the actors agree on
the request's shape and draw from disjoint prompt sources; at the end it stops every
pipeline, waiting up to ``stop_timeout``, and kills every actor. Between the two it asks
every actor for its counters (:meth:`Actors.fetch_statistics`) or its prompt state
(:meth:`Actors.prompts_state_dict`).

Threads: built in any thread, with no Trio call (the sync bridge builds it in its
caller's thread); used in the stream's Trio thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, cast

import attrs
import ray
import trio

from trio_rollouts._concurrency import flatten_exception_groups
from trio_rollouts.prompts._source import PromptSource
from trio_rollouts.ray._actor import (
    FINAL_SEQUENCE,
    AgentSource,
    RemoteRolloutActor,
    RequestSource,
    RolloutActorInfo,
)
from trio_rollouts.ray._lanes import Lane, RayReplies

__all__ = ["Actors", "ActorsShape"]


@attrs.frozen(kw_only=True)
class ActorsShape:
    """What every actor's request agrees on, and the actors' greatest epoch at start."""

    num_groups: int
    streaming: bool
    enforce_order: bool
    policy_epoch: int


class Actors:
    """The rollout actors of one stream, one :class:`Lane` each; see the module
    docstring. Arguments are checked by the caller (``_open.py``)."""

    def __init__(
        self,
        agent: AgentSource,
        request: RequestSource,
        *,
        num_actors: int,
        actor_options: dict[str, Any],
        start_timeout: float,
        stop_timeout: float,
        prompts_states: list[dict[str, Any]] | None,
    ) -> None:
        self._agent_source = agent
        self._request_source = request
        self._num_actors = num_actors
        self._actor_options = actor_options
        self._start_timeout = start_timeout
        self._stop_timeout = stop_timeout
        self._prompts_states = prompts_states  # shard i is loaded into actor i
        self._lanes: list[Lane] = []
        self._replies = RayReplies(num_actors)

    @property
    def lanes(self) -> Sequence[Lane]:
        """The lanes, by actor index (empty until the actors are created)."""
        return self._lanes

    @property
    def replies(self) -> RayReplies:
        """Where the stream waits for the actors' replies."""
        return self._replies

    @property
    def handles(self) -> tuple[Any, ...]:
        """The Ray actor handles, by actor index."""
        return tuple(lane.handle for lane in self._lanes)

    @property
    def infos(self) -> tuple[RolloutActorInfo | None, ...]:
        """Where each actor runs (``None`` for an actor that has not started)."""
        return tuple(lane.info for lane in self._lanes)

    def lane_of(self, batch_id: int) -> Lane:
        """The lane of the actor that made merged batch ``batch_id`` (invariant 2's
        numbering)."""
        return self._lanes[batch_id % len(self._lanes)]

    # ---------------------------------------------------------------- life

    def _create(self) -> None:
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
            self._lanes.append(Lane(index, self._num_actors, handle))

    async def start(self) -> ActorsShape:
        """Create every actor and open its pipeline (the caller settles its prompt draws,
        invariant 6); check that the actors agree.

        Raises what an actor's start raised (translated by its lane), ``TimeoutError``
        naming the actors not started within ``start_timeout``, and ``ValueError`` for
        actors whose requests differ in shape or whose prompt sources overlap.

        Cancellation: creating the actors is not abandoned (every actor created must be
        known, to be killed by :meth:`stop`); a cancelled start leaves the actors created
        so far for :meth:`stop`.
        """
        await self._replies.run(self._create)
        errors: list[BaseException] = []
        states = self._prompts_states

        async def start(lane: Lane, cancel_scope: trio.CancelScope) -> None:
            state = None if states is None else states[lane.index]
            try:
                info = await self._replies.get(lane.handle.start.remote(state, True))
            except Exception as exc:
                errors.append(lane.translate(exc))
                cancel_scope.cancel()  # one failed start fails them all: stop waiting
            else:
                lane.started(info)

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
        return self._checked_shape([cast(RolloutActorInfo, lane.info) for lane in self._lanes])

    @staticmethod
    def _checked_shape(infos: list[RolloutActorInfo]) -> ActorsShape:
        shapes = {(i.num_groups, i.streaming, i.enforce_order) for i in infos}
        if len(shapes) > 1:
            msg = (
                "every actor's request must have the same num_groups, streaming and "
                f"enforce_order; the request factory gave {sorted(shapes)}"
            )
            raise ValueError(msg)
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
        num_groups, streaming, enforce_order = shapes.pop()
        return ActorsShape(
            num_groups=num_groups,
            streaming=streaming,
            enforce_order=enforce_order,
            policy_epoch=max(info.policy_epoch for info in infos),
        )

    async def stop(self) -> BaseException | None:
        """Stop every pipeline (waiting up to ``stop_timeout``), then kill every actor;
        the lanes close (untaken groups count as cancelled).

        Returns the first failure an actor reported while stopping, for the caller to
        raise when nothing else is being raised. Call it shielded: it must run to the end.
        """
        failures: list[BaseException] = []

        async def stop(lane: Lane) -> None:
            try:
                final = await self._replies.get(lane.handle.stop.remote(self._stop_timeout))
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

    # ---------------------------------------------------------------- questions to all

    async def fetch_statistics(self) -> None:
        """Ask every actor for its counters now and wait for the answers (the prompts
        handed out are settled first). An actor that has failed or died keeps its previous
        counters: its failure reaches the consumer through its watcher.

        Cancellation: the questions not yet answered are abandoned; the lanes that
        answered are updated.
        """

        async def fetch(lane: Lane) -> None:
            with contextlib.suppress(Exception):
                lane.flush_settles()
                reply = await self._replies.get(lane.handle.serve.remote(0))
                lane.update_snapshot(reply.statistics, reply.sequence)

        async with trio.open_nursery() as nursery:
            for lane in self._lanes:
                nursery.start_soon(fetch, lane)

    async def prompts_state_dict(self) -> dict[str, Any]:
        """Every actor's ``agent.prompts.state_dict()``, merged by actor index, once the
        groups handed out so far are settled in each actor (invariant 6).

        Raises ``TypeError`` if an actor's agent has no ``prompts``, and what an actor
        raised (translated by its lane).

        Cancellation: the answers not yet given are abandoned; settles already sent still
        run in the actors.
        """
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

        async def fetch(lane: Lane, cancel_scope: trio.CancelScope) -> None:
            lane.flush_settles()
            sent = list(lane.settling)
            try:
                if sent:
                    await self._replies.get(sent)
                slots = lane.take_to_settle()
                ref = lane.handle.prompts_state.remote(slots)
                if slots:
                    lane.settling.append(ref)
                states[lane.index] = await self._replies.get(ref)
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
