"""Opening a Ray stream: :func:`open_ray_rollouts` (Trio) and :func:`blocking_ray_rollouts`
(synchronous code, through the sync bridge: :class:`BlockingRayRolloutStream`, which adds
only what is Ray's to :class:`~trio_rollouts.BlockingRolloutStream`), with every check
that can run before an actor starts."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any, cast

import trio

from trio_rollouts._checks import check_natural, check_seconds
from trio_rollouts.agents._base import GroupedRolloutGenerator, check_grouped_request, draws_prompts
from trio_rollouts.bridge._blocking import (
    BlockingContext,
    BlockingRolloutStream,
    call_in_trio,
    current_stream,
    drive,
)
from trio_rollouts.models._requests import GroupedRolloutRequest
from trio_rollouts.prompts._source import PromptSource
from trio_rollouts.ray._actor import (
    ACTOR_CONCURRENCY,
    AgentSource,
    RequestSource,
    RolloutActorInfo,
    prompts_of,
)
from trio_rollouts.ray._actors import Actors
from trio_rollouts.ray._lanes import RayRolloutStreamStatistics
from trio_rollouts.ray._stream import RayRolloutStream, open_ray_stream

__all__ = ["BlockingRayRolloutStream", "blocking_ray_rollouts", "open_ray_rollouts"]


def _checked_actor_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    merged: dict[str, Any] = {"num_cpus": 1, **(options or {})}
    concurrency = merged.setdefault("max_concurrency", ACTOR_CONCURRENCY)
    if not isinstance(concurrency, int) or concurrency < ACTOR_CONCURRENCY:
        msg = (
            f"actor_options max_concurrency must be >= {ACTOR_CONCURRENCY} (a take, the "
            "watcher, a statistics poll, a weight update's begin and end, a prompt settle "
            f"and stop run at once), got {concurrency!r}"
        )
        raise ValueError(msg)
    if merged.get("max_restarts", 0) != 0:
        msg = (
            "rollout actors cannot be restarted (a restarted actor has lost its pipeline "
            f"and its place in the merge); got max_restarts={merged['max_restarts']!r}"
        )
        raise ValueError(msg)
    return merged


def _check_sources(agent: object, request: object) -> None:
    if not isinstance(agent, GroupedRolloutGenerator) and not callable(agent):
        msg = (
            "agent must be a GroupedRolloutGenerator or a function that builds one from the "
            f"actor's index, got {type(agent).__name__}"
        )
        raise TypeError(msg)
    if not isinstance(request, GroupedRolloutRequest) and not callable(request):
        msg = (
            "request must be a GroupedRolloutRequest or a function that builds one from the "
            f"actor's index, got {type(request).__name__}"
        )
        raise TypeError(msg)
    if isinstance(agent, GroupedRolloutGenerator) and isinstance(request, GroupedRolloutRequest):
        check_grouped_request(agent, request)  # before any actor starts


def _checked_prompts_states(
    agent: object, num_actors: int, prompts_state: object
) -> list[dict[str, Any]] | None:
    """Invariant 6's checks, before any actor starts: an agent object that draws prompts
    would be pickled to every actor with the same source; a state must have one shard per
    actor. Returns the shard states, by actor index."""
    if isinstance(agent, GroupedRolloutGenerator) and num_actors > 1 and draws_prompts(agent):
        msg = (
            f"the agent draws prompts and would be pickled to each of the {num_actors} "
            "actors, every copy drawing the same problems; give each actor a disjoint "
            "shard with an agent factory: agent=lambda i: "
            "MyAgent(prompts=source.shard(i, num_actors))"
        )
        raise ValueError(msg)
    if prompts_state is None:
        return None
    if not isinstance(prompts_state, dict):
        msg = (
            "prompts_state must be a dict from RayRolloutStream.prompts_state_dict(), got "
            f"{type(prompts_state).__name__}"
        )
        raise TypeError(msg)
    if isinstance(agent, GroupedRolloutGenerator):
        prompts_of(agent, 0, "prompts_state")
    return PromptSource.split_state_dict(prompts_state, num_actors)


def open_ray_rollouts(
    agent: AgentSource,
    request: RequestSource,
    *,
    num_actors: int,
    prefetch_batches: int = 1,
    actor_options: Mapping[str, Any] | None = None,
    start_timeout: float = 120.0,
    stop_timeout: float = 10.0,
    prompts_state: dict[str, Any] | None = None,
) -> contextlib.AbstractAsyncContextManager[RayRolloutStream]:
    """Run ``agent``'s grouped pipeline in ``num_actors`` Ray actors and merge their groups;
    use as ``async with ... as stream``.

    ::

        async with open_ray_rollouts(agent, request, num_actors=4) as stream:
            async for group in stream:
                ...

    ``agent`` and ``request`` are pickled to every actor, or are functions that build them
    inside each actor, called with the actor's index (for what cannot be pickled, or to
    give each actor its own seed or inference replica, or its own shard of the prompts).
    Every actor runs the whole request:
    ``num_groups`` is per actor, so a non-streaming request yields ``num_actors`` batches.
    Given as objects, they are checked at once, before any actor starts (as
    :meth:`~trio_rollouts.GroupedRolloutGenerator.get_grouped_rollouts` checks); factories
    are checked in the actors, before their pipelines start.

    ``prefetch_batches``: how many batches of each actor may wait in the merge, requested
    but not taken. ``actor_options`` go to Ray's ``.options()`` (default ``num_cpus=1``).
    Ray is used as it is set up (``ray.init()`` first to choose a cluster). Ordering,
    ``batch_id`` numbering, run-ahead and failures: see docs/scaling.md and the
    invariants in the docstring of ``trio_rollouts.ray._merge``. The stream is a
    :class:`~trio_rollouts.RolloutStream` over the merge, with Ray's extras.

    Prompts, each taken exactly once across restarts (invariant 6 in the docstring of
    ``trio_rollouts.ray._merge``): give each actor a disjoint shard of the run's
    :class:`~trio_rollouts.PromptSource` with an agent factory, checkpoint
    :meth:`RayRolloutStream.prompts_state_dict` with the trainer, and restore it as
    ``prompts_state``::

        source = PromptSource(problems, seed=0)
        agent = lambda i: MyAgent(prompts=source.shard(i, 4))
        async with open_ray_rollouts(agent, request, num_actors=4,
                                     prompts_state=checkpoint) as stream:
            ...
            checkpoint = await stream.prompts_state_dict()   # with the model's weights

    Shard ``i`` of ``prompts_state`` (:meth:`~trio_rollouts.PromptSource.split_state_dict`)
    is loaded into actor ``i``'s ``agent.prompts`` before its pipeline opens: a state of
    another number of actors is a ``ValueError`` (at once), an actor whose agent has no
    ``prompts`` a ``TypeError``, a shard of another source the ``ValueError`` of
    :meth:`~trio_rollouts.PromptSource.load_state_dict`. An agent object that draws prompts
    with ``num_actors > 1`` (each actor would get a copy of the same source), and two
    actors whose sources have the same problems, are a ``ValueError``.

    Errors: an exception in any actor's ``group_rollout`` leaves the ``async with`` as that
    exception, with a note naming the actor; an actor that dies is a
    :class:`RolloutActorDiedError`; actors that do not start within ``start_timeout``
    seconds are a ``TimeoutError``.

    Cancellation: leaving the ``async with`` by any route (break, return, exception, an
    outer cancel scope) stops every actor's pipeline, waiting up to ``stop_timeout``
    seconds for its ``group_rollout`` calls to exit, then kills every actor; ``__aexit__``
    returns after that, and is shielded from cancellation while it waits. Cancelling
    ``__aenter__`` while the actors start kills the actors started so far.
    """
    return _checked_stream(
        agent,
        request,
        num_actors,
        prefetch_batches,
        actor_options,
        start_timeout,
        stop_timeout,
        prompts_state,
    )


def _checked_stream(
    agent: AgentSource,
    request: RequestSource,
    num_actors: int,
    prefetch_batches: int,
    actor_options: Mapping[str, Any] | None,
    start_timeout: float,
    stop_timeout: float,
    prompts_state: dict[str, Any] | None,
) -> contextlib.AbstractAsyncContextManager[RayRolloutStream]:
    """The Ray stream's ``async with``, not entered yet; arguments checked. Any thread,
    and no Trio call: the sync bridge builds it in its caller's thread, and an
    ``open_ray_rollouts(...)`` may be made outside ``trio.run``."""
    _check_sources(agent, request)
    check_natural("num_actors", num_actors, 1)
    check_natural("prefetch_batches", prefetch_batches, 1)
    check_seconds("start_timeout", start_timeout, positive=True, optional=False)
    check_seconds("stop_timeout", stop_timeout, positive=True, optional=False)
    options = _checked_actor_options(actor_options)
    states = _checked_prompts_states(agent, num_actors, prompts_state)
    actors = Actors(
        agent,
        request,
        num_actors=num_actors,
        actor_options=options,
        start_timeout=start_timeout,
        stop_timeout=stop_timeout,
        prompts_states=states,
    )
    return open_ray_stream(actors, prefetch_batches)


# --------------------------------------------------------------------------- the sync twin


class BlockingRayRolloutStream(BlockingRolloutStream):
    """The merged groups of Ray rollout actors, driven from synchronous code; created by
    :func:`blocking_ray_rollouts`. A :class:`~trio_rollouts.BlockingRolloutStream` over a
    :class:`RayRolloutStream` (``take``, ``get``, ``try_next``, ``drain``, iteration,
    ``metrics``, ``policy_epoch``, and ``weight_update`` as a plain ``with``, which pauses
    every actor as :meth:`RayRolloutStream.weight_update` does), plus what is Ray's:
    :meth:`statistics` as :class:`RayRolloutStreamStatistics`, :meth:`fetch_statistics`,
    :meth:`prompts_state_dict` and the actors. Every call that needs the stream runs in
    the bridge's Trio thread; the caller's thread makes no Trio call.

    Staleness: as on :class:`RayRolloutStream`, no group is returned too old for
    ``max_staleness``, groups that a timed-out ``take()`` kept included (those a weight
    update makes too old go back to the merge when its body returns, and are generated
    again in their actors).
    """

    def __init__(self, stream: contextlib.AbstractAsyncContextManager[RayRolloutStream]) -> None:
        drive(self, stream, "trio_rollouts:ray")

    def _ray_stream(self) -> RayRolloutStream:
        return cast(RayRolloutStream, current_stream(self))

    def prompts_state_dict(self) -> dict[str, Any]:
        """The state of the run's prompts (see :meth:`RayRolloutStream.prompts_state_dict`):
        every group returned to the caller so far is done in it; groups kept by a
        timed-out ``take()`` are not, nor groups not returned yet."""
        return call_in_trio(self, self._ray_stream().prompts_state_dict)

    def statistics(self) -> RayRolloutStreamStatistics:
        """The actors' counters as of their latest replies (see
        :meth:`RayRolloutStream.statistics`)."""
        return cast(RayRolloutStreamStatistics, super().statistics())

    def fetch_statistics(self, timeout: float | None = 10.0) -> RayRolloutStreamStatistics:
        """Ask every actor for its counters now and return :meth:`statistics` (see
        :meth:`RayRolloutStream.fetch_statistics`); actors that have not answered within
        ``timeout`` seconds keep their previous counters."""
        check_seconds("timeout", timeout)
        stream = self._ray_stream()

        async def fetch() -> RayRolloutStreamStatistics:
            with trio.move_on_after(math.inf if timeout is None else timeout):
                return await stream.fetch_statistics()
            return stream.statistics()

        return call_in_trio(self, fetch)

    @property
    def actors(self) -> tuple[Any, ...]:
        """The Ray actor handles, by actor index."""
        return self._ray_stream().actors

    @property
    def actor_info(self) -> tuple[RolloutActorInfo | None, ...]:
        """Where each actor runs."""
        return self._ray_stream().actor_info


def blocking_ray_rollouts(
    agent: AgentSource,
    request: RequestSource,
    *,
    num_actors: int,
    prefetch_batches: int = 1,
    actor_options: Mapping[str, Any] | None = None,
    start_timeout: float = 120.0,
    stop_timeout: float = 10.0,
    prompts_state: dict[str, Any] | None = None,
) -> contextlib.AbstractContextManager[BlockingRayRolloutStream]:
    """:func:`open_ray_rollouts` for synchronous trainers, as
    :func:`~trio_rollouts.blocking_grouped_rollouts` is for one pipeline::

        with blocking_ray_rollouts(agent, request, num_actors=4) as stream:
            groups = stream.take(16, timeout=60)   # blocks
            more = stream.drain(4)                 # never blocks

    Arguments are checked at once, in the caller's thread; ``__enter__`` returns once every
    actor has started. An actor's exception is raised in the caller's thread at its next
    call, and at the exit of the ``with`` at the latest. Leaving the block stops and kills
    every actor and joins the Trio thread.

    Prompts: as for :func:`open_ray_rollouts` (a sharding agent factory,
    ``prompts_state``, :meth:`BlockingRayRolloutStream.prompts_state_dict`), except that a
    group's prompt is done when the group is returned to the caller (by ``get``,
    ``take``, ``try_next``, ``drain`` or iteration), not when the bridge takes it from
    the merge.
    """
    stream = _checked_stream(
        agent,
        request,
        num_actors,
        prefetch_batches,
        actor_options,
        start_timeout,
        stop_timeout,
        prompts_state,
    )
    return BlockingContext(BlockingRayRolloutStream(stream))
