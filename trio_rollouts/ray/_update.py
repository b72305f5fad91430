"""Weight updates across rollout actors, and the Ray stream's policy epoch (invariant 5
of ``_merge.py``).

:class:`ActorUpdates` owns the merged stream's policy epoch (the actors' greatest when
they started, then the epoch of each update whose body returned) and runs
``RayRolloutStream.weight_update``: each actor holds its own stream's
``weight_update`` open in its Trio thread, between
:meth:`~trio_rollouts.ray.RolloutActor.begin_weight_update` and
:meth:`~trio_rollouts.ray.RolloutActor.end_weight_update`. The body runs once every actor
has paused; every actor is resumed at the exit, under the new epoch when the body
returned, under the old one otherwise. Updates are numbered: an actor refuses to begin an
update that was already ended, so a begin that Ray runs late (actor threads run calls in
any order) never leaves an actor paused.

Threads: the stream's Trio thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

import trio

from trio_rollouts._concurrency import flatten_exception_groups
from trio_rollouts.inference import InferenceInterface, WeightUpdateMode
from trio_rollouts.pipeline._epochs import WeightUpdate, checked_epoch, checked_mode
from trio_rollouts.ray._actors import Actors
from trio_rollouts.ray._lanes import Lane

__all__ = ["ActorUpdates"]


class _ActorNotes(Exception):
    """The notes an actor's update added on its way out of a failed body (resume
    failures), carried back to the merge as a failure of that actor's exit."""

    def __init__(self, actor: str, notes: list[str]) -> None:
        super().__init__(f"{actor}: " + "; ".join(notes))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, _ActorNotes):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class ActorUpdates:
    """The Ray stream's policy epoch and its weight updates across ``actors``.

    ``closed`` says whether the stream's ``async with`` has exited; ``paused_for`` is
    told how long each update waited before its body (for the stream's metrics).
    """

    def __init__(
        self,
        actors: Actors,
        *,
        closed: Callable[[], bool],
        paused_for: Callable[[float], None],
    ) -> None:
        self._actors = actors
        self._closed = closed
        self._paused_for = paused_for
        self._epoch = 0
        self._weight_updates = 0
        self._updating = False
        self._number = 0

    @property
    def epoch(self) -> int:
        """The merged stream's policy epoch. Any thread."""
        return self._epoch

    @property
    def weight_updates(self) -> int:
        """Updates whose body returned."""
        return self._weight_updates

    def started(self, epoch: int) -> None:
        """Every actor has started; ``epoch`` is their greatest policy epoch."""
        self._epoch = epoch

    @contextlib.asynccontextmanager
    async def open(
        self,
        mode: object,
        epoch: object,
        backends: Sequence[InferenceInterface] | None,
    ) -> AsyncIterator[WeightUpdate]:
        """One update across every actor, as ``RayRolloutStream.weight_update`` documents
        it (see ``docs/scaling.md``).

        Raises, before any actor is asked: ``RuntimeError`` after the stream closed or
        while another update is in progress, ``TypeError`` for ``backends`` (each actor
        pauses its own request's backend), ``ValueError`` for a bad mode or epoch. Then
        what an actor's begin raised (every actor is resumed under the old epoch first),
        and at the exit what an actor's end raised after a returned body.

        Cancellation: entering waits for every actor to pause; cancelling it, or the
        body, resumes every actor under the old epoch, shielded. The exit waits,
        shielded, for every actor to resume.
        """
        if self._closed():
            msg = "weight_update() on a stream whose async with has exited"
            raise RuntimeError(msg)
        if backends is not None:
            msg = (
                "RayRolloutStream.weight_update() takes no backends: each actor pauses its "
                "own request's inference_interface (backends in this process cannot reach "
                "the actors' copies); make the backend to pause the request's "
                "inference_interface, or drive RolloutActor.begin_weight_update yourself"
            )
            raise TypeError(msg)
        checked = checked_mode(mode)
        new_epoch = checked_epoch(epoch, self._epoch)
        if self._updating:
            msg = "a weight update is already in progress on this stream (one at a time)"
            raise RuntimeError(msg)
        self._updating = True
        self._number += 1
        number = self._number
        entered = trio.current_time()
        try:
            try:
                updates = await self._begin(number, checked, new_epoch)
            except BaseException as exc:
                # An actor could not pause, or the wait was cancelled (or the stream
                # failed): every actor resumes under the old epoch.
                for failure in await self._end(number, body_failed=True):
                    exc.add_note(f"ending the update failed too: {_describe(failure)}")
                raise
            update = WeightUpdate(
                epoch=new_epoch,
                mode=checked,
                held=sum(u.held for u in updates),
                pause_seconds=trio.current_time() - entered,
            )
            self._paused_for(update.pause_seconds)
            try:
                yield update
            except BaseException as exc:
                for failure in await self._end(number, body_failed=True):
                    exc.add_note(f"ending the update failed too: {_describe(failure)}")
                raise
            self._epoch = new_epoch
            self._weight_updates += 1
            failures = await self._end(number, body_failed=False)
        finally:
            self._updating = False
        if failures:
            error = failures[0]
            for other in failures[1:]:
                error.add_note(f"ending the update failed too: {_describe(other)}")
            raise error

    async def _begin(self, number: int, mode: WeightUpdateMode, epoch: int) -> list[WeightUpdate]:
        """Begin update ``number`` in every actor at once; raise the first failure (the
        others as notes) once every begin has answered or been abandoned."""
        updates: list[WeightUpdate] = []
        failures: list[BaseException] = []
        replies = self._actors.replies

        async def begin(lane: Lane, cancel_scope: trio.CancelScope) -> None:
            try:
                ref = lane.handle.begin_weight_update.remote(number, mode, epoch)
                updates.append(await replies.get(ref))
            except Exception as exc:
                failures.append(lane.translate(exc))
                cancel_scope.cancel()  # one actor cannot pause: stop waiting for the rest

        with flatten_exception_groups():
            async with trio.open_nursery() as nursery:
                for lane in self._actors.lanes:
                    nursery.start_soon(begin, lane, nursery.cancel_scope)
        if failures:
            error = failures[0]
            for other in failures[1:]:
                error.add_note(f"another actor failed too: {type(other).__name__}: {other}")
            raise error
        return updates

    async def _end(self, number: int, body_failed: bool) -> list[BaseException]:
        """End update ``number`` in every actor (each one gives up a begin still waiting
        and refuses a late one), shielded from cancellation; return the failures, the
        notes of a failed body's exit among them as ``_ActorNotes``."""
        failures: list[BaseException] = []
        replies = self._actors.replies

        async def end(lane: Lane) -> None:
            try:
                ref = lane.handle.end_weight_update.remote(number, body_failed)
                notes: list[str] = await replies.get(ref)
            except Exception as exc:
                failures.append(lane.translate(exc))
            else:
                if notes:
                    failures.append(_ActorNotes(lane.describe(), notes))

        with trio.CancelScope(shield=True), flatten_exception_groups():
            async with trio.open_nursery() as nursery:
                for lane in self._actors.lanes:
                    nursery.start_soon(end, lane)
        return failures
