"""The Ray stream: :class:`RayRolloutStream`, a :class:`~trio_rollouts.RolloutStream` over
the merge of rollout actors (``_merge.py``), with what only Ray has.

Receiving, iteration, ``try_next``, ``drain``, ``weight_update``, ``policy_epoch`` and
``metrics`` are :class:`~trio_rollouts.RolloutStream`'s own, over the merge as its
:class:`~trio_rollouts.pipeline._stream.GroupSource`; this class adds the actors
(:attr:`~RayRolloutStream.actors`, :attr:`~RayRolloutStream.actor_info`), the merged
counters typed as :class:`RayRolloutStreamStatistics`, :meth:`~RayRolloutStream.fetch_statistics`
and :meth:`~RayRolloutStream.prompts_state_dict`. :func:`open_ray_stream` is its life.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, cast

from trio_rollouts.pipeline._stream import RolloutStream, open_stream, source_of
from trio_rollouts.ray._actor import RolloutActorInfo
from trio_rollouts.ray._actors import Actors
from trio_rollouts.ray._lanes import RayRolloutStreamStatistics
from trio_rollouts.ray._merge import Merge, open_merge

__all__ = ["RayRolloutStream", "open_ray_stream"]


class RayRolloutStream(RolloutStream):
    """The groups of ``num_actors`` rollout actors, merged; :func:`open_ray_rollouts`
    yields it. A :class:`~trio_rollouts.RolloutStream`: async iteration,
    :meth:`receive`, :meth:`try_next`, :meth:`drain`, :meth:`metrics`,
    :attr:`policy_epoch` and :meth:`weight_update` (which pauses every actor's pipeline,
    see ``docs/scaling.md``; its ``backends`` must be ``None``: each actor pauses its own
    request's ``inference_interface``, ``TypeError`` otherwise), plus the actors, merged
    :meth:`statistics`, :meth:`fetch_statistics` and :meth:`prompts_state_dict`. Use it
    inside the ``async with`` that opened it, from one consumer task.
    """

    __slots__ = ()

    def __init__(self) -> None:
        msg = "RayRolloutStream is created by open_ray_rollouts()"
        raise TypeError(msg)

    def _merge(self) -> Merge:
        return cast(Merge, source_of(self))

    @property
    def actors(self) -> tuple[Any, ...]:
        """The Ray actor handles, by actor index."""
        return self._merge().actor_handles

    @property
    def actor_info(self) -> tuple[RolloutActorInfo | None, ...]:
        """Where each actor runs (``None`` for an actor that has not started)."""
        return self._merge().actor_info

    def statistics(self) -> RayRolloutStreamStatistics:
        """The actors' counters summed, and each actor's in ``per_actor``, as of each
        actor's latest reply (see :class:`RayRolloutStreamStatistics`); ``policy_epoch``
        and ``weight_updates`` are the merged stream's own. Never asks an actor; not a
        checkpoint."""
        return self._merge().statistics()

    async def fetch_statistics(self) -> RayRolloutStreamStatistics:
        """Ask every actor for its counters now, wait for the answers, then return
        :meth:`statistics`.

        An actor that has failed or died keeps its previous counters (its failure reaches
        the consumer on its own). An actor answers when its pipeline's Trio loop next
        checkpoints: bound the wait with ``trio.move_on_after`` if a ``group_rollout`` can
        hold the loop. After the ``async with`` has exited, asks nothing.

        Cancellation: cancelling it abandons the questions not yet answered (the actors
        that answered are updated); the stream is unaffected.
        """
        return await self._merge().fetch_statistics()

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
        return await self._merge().prompts_state_dict()


@contextlib.asynccontextmanager
async def open_ray_stream(actors: Actors, prefetch_batches: int) -> AsyncIterator[RayRolloutStream]:
    """The stream of ``actors``, merged, for the duration of an ``async with`` (what
    :func:`open_ray_rollouts` returns). ``actors`` are built, with their arguments
    checked, in any thread; nothing here runs before ``__aenter__``.

    Cancellation: as the merge's (:func:`~trio_rollouts.ray._merge.open_merge`): leaving
    by any route stops and kills every actor, shielded, before ``__aexit__`` returns.
    """
    async with open_merge(actors, prefetch_batches) as merge:
        yield cast(RayRolloutStream, open_stream(merge, cls=RayRolloutStream))
