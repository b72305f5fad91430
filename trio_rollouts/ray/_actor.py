"""A rollout actor: one agent's grouped pipeline in a Ray actor's process.

The pipeline (``trio_rollouts.pipeline``, unchanged) runs in a Trio thread of the actor
(:class:`~trio_rollouts.bridge._thread.TrioThread`, the sync bridge's runner); the actor's
methods are called by Ray in threads of their own and block them, never the pipeline.
The merge (``_merge.py``) drives the actors: :meth:`RolloutActor.serve` takes groups and
takes back the groups the merge gives back (too old for ``max_staleness`` when the
consumer took them, and with ``enforce_order`` what the merge held after them),
:meth:`RolloutActor.settle` settles the prompt draws of groups that reached the consumer,
and a weight update is held open in the Trio thread between
:meth:`RolloutActor.begin_weight_update` and :meth:`RolloutActor.end_weight_update`.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import attrs
import ray
import trio

from trio_rollouts._checks import check_seconds
from trio_rollouts.agents._base import GroupedRolloutGenerator
from trio_rollouts.bridge._thread import ContextGivenUp, HeldContext, TrioThread, TrioThreadStopped
from trio_rollouts.inference import WeightUpdateMode
from trio_rollouts.models._requests import GroupedRolloutRequest
from trio_rollouts.models._rollouts import RolloutGroup
from trio_rollouts.pipeline._epochs import WeightUpdate
from trio_rollouts.pipeline._ledger import RolloutStreamStatistics
from trio_rollouts.pipeline._stream import RolloutStream, source_of
from trio_rollouts.prompts._source import PromptSource

__all__ = [
    "ACTOR_CONCURRENCY",
    "FINAL_SEQUENCE",
    "AgentSource",
    "RemoteRolloutActor",
    "RequestSource",
    "RolloutActor",
    "RolloutActorInfo",
    "RolloutActorReply",
    "prompts_of",
]

T = TypeVar("T")

#: An agent, or a function that builds one inside the actor from the actor's index.
AgentSource = GroupedRolloutGenerator | Callable[[int], GroupedRolloutGenerator]
#: A request, or a function that builds one inside the actor from the actor's index.
RequestSource = GroupedRolloutRequest | Callable[[int], GroupedRolloutRequest]

#: Concurrent calls an actor must serve: a take, the watcher, a statistics poll, a weight
#: update's begin and its end (which can give up a begin still waiting), a prompt settle
#: or state fetch (quick: they never wait for the pipeline), and stop.
ACTOR_CONCURRENCY = 7
#: The sequence number of an actor's final counters (returned by stop): newer than any.
FINAL_SEQUENCE = sys.maxsize


@attrs.frozen(kw_only=True)
class RolloutActorInfo:
    """Where a started :class:`RolloutActor` runs, and the shape of its request."""

    index: int
    actor_id: str
    pid: int
    node_id: str
    num_groups: int
    streaming: bool
    enforce_order: bool
    #: The policy epoch of the actor's stream when its pipeline opened.
    policy_epoch: int = 0
    #: Whether the actor's agent draws prompts and the caller settles them (see
    #: :meth:`RolloutActor.settle`): only then does the merge settle the groups it hands
    #: out.
    tracks_prompts: bool = False
    #: The ``ids_sha256`` of the agent's ``prompts`` source (``None``: the agent has no
    #: ``prompts``): two actors drawing the same problems are refused.
    prompts_fingerprint: str | None = None
    #: The request's ``max_staleness``: the merge checks the groups it hands out against it.
    max_staleness: int | None = None


@attrs.frozen(kw_only=True)
class RolloutActorReply:
    """What :meth:`RolloutActor.serve` returns: the groups taken, whether the actor's stream
    has ended, and a snapshot of its pipeline's counters taken right after the groups were
    (``sequence`` orders the snapshots of one actor)."""

    groups: list[RolloutGroup]
    ended: bool
    statistics: RolloutStreamStatistics
    sequence: int


def _build_agent(source: AgentSource, index: int) -> GroupedRolloutGenerator:
    if isinstance(source, GroupedRolloutGenerator):
        return source
    return _checked_product(source(index), GroupedRolloutGenerator, "agent")


def _build_request(source: RequestSource, index: int) -> GroupedRolloutRequest:
    if isinstance(source, GroupedRolloutRequest):
        return source
    return _checked_product(source(index), GroupedRolloutRequest, "request")


def prompts_of(agent: GroupedRolloutGenerator | None, index: int, what: str) -> PromptSource:
    prompts = getattr(agent, "prompts", None)
    if not isinstance(prompts, PromptSource):
        msg = (
            f"rollout actor {index}: {what} needs the actor's agent to have a PromptSource "
            f"in its prompts field, got {type(prompts).__name__}"
        )
        raise TypeError(msg)
    return prompts


def _checked_product(built: T, cls: type, what: str) -> T:
    if not isinstance(built, cls):
        msg = f"the {what} factory must return a {cls.__name__}, got {type(built).__name__}"
        raise TypeError(msg)
    return built


class RolloutActor:
    """A grouped pipeline in a Ray actor: the agent and its pipeline live in the actor's
    process, in a Trio thread of their own.

    :func:`open_ray_rollouts` creates and drives these actors; use the class directly only
    to drive actors yourself. It is a plain class: make it an actor with
    ``ray.remote(RolloutActor).options(max_concurrency=7)`` (its methods block, so
    :meth:`stop`, :meth:`statistics` and a weight update need threads of their own while
    a :meth:`take` waits). ``agent`` and ``request`` are the objects themselves (pickled to
    the actor) or functions that build them in the actor, called with ``index``.

    Methods (each one blocks the calling thread of the actor, never the pipeline):
    :meth:`start`, :meth:`take`, :meth:`drain`, :meth:`serve`, :meth:`statistics`,
    :meth:`settle`, :meth:`prompts_state`, :meth:`begin_weight_update`,
    :meth:`end_weight_update`, :meth:`wait_stopped`, :meth:`stop`.
    """

    def __init__(self, agent: AgentSource, request: RequestSource, index: int = 0) -> None:
        self._agent_source = agent
        self._request_source = request
        self._index = index
        self._runner: TrioThread[tuple[RolloutStream, bool]] = TrioThread(
            f"trio_rollouts:RolloutActor[{index}]"
        )
        self._started = False
        # Set once the pipeline is open (the stream stays readable after it stopped).
        self._stream: RolloutStream | None = None
        self._agent: GroupedRolloutGenerator | None = None
        # Whether the caller settles prompt draws (settle) and the agent draws them.
        self._caller_settles = False
        # The weight update held open, by number, and the highest number ended (a begin
        # that arrives after its end is refused). Actor threads share these.
        self._update_lock = threading.Lock()
        self._update: tuple[int, HeldContext[WeightUpdate]] | None = None
        self._updates_ended = 0
        self._sequence = 0
        self._streaming = False
        self._num_groups = 0

    # ---------------------------------------------------------------- the Trio thread

    def start(
        self, prompts_state: dict[str, Any] | None = None, caller_settles: bool = False
    ) -> RolloutActorInfo:
        """Build the agent and request, check them, and open the pipeline.

        ``prompts_state``: a :meth:`~trio_rollouts.PromptSource.state_dict` to load into
        the agent's ``prompts`` before the pipeline opens (``TypeError`` if the agent has
        no ``prompts``; what ``load_state_dict`` raises for a state of another source).
        ``caller_settles``: a group's prompt draw is not done when :meth:`serve` returns
        the group, but when the caller says so with :meth:`settle` (the merge does: a
        group it holds is not handed to the consumer yet); groups never settled are given
        back when the pipeline stops.

        Raises what the checks raise (``ValueError``, ``TypeError``) or what opening the
        pipeline raises; returns where the actor runs once its pipeline is open.
        """
        if self._started:
            msg = "RolloutActor.start() was called twice"
            raise RuntimeError(msg)
        self._started = True
        agent = _build_agent(self._agent_source, self._index)
        request = _build_request(self._request_source, self._index)
        pipeline = agent.get_grouped_rollouts(request)  # checks raise here
        if prompts_state is not None:
            prompts_of(agent, self._index, "prompts_state").load_state_dict(prompts_state)
        self._agent = agent
        self._streaming = request.streaming
        self._num_groups = request.num_groups
        stream, self._caller_settles = self._runner.start(_opened(pipeline, caller_settles))
        self._stream = stream
        prompts = getattr(agent, "prompts", None)
        context = ray.get_runtime_context()
        return RolloutActorInfo(
            index=self._index,
            actor_id=str(context.get_actor_id() or ""),
            pid=os.getpid(),
            node_id=str(context.get_node_id() or ""),
            num_groups=request.num_groups,
            streaming=request.streaming,
            enforce_order=request.enforce_order,
            policy_epoch=stream.policy_epoch,
            tracks_prompts=self._caller_settles,
            prompts_fingerprint=(
                str(prompts.state_dict()["source"]["ids_sha256"])
                if isinstance(prompts, PromptSource)
                else None
            ),
            max_staleness=source_of(stream).max_staleness,
        )

    def _call(self, afn: Callable[[], Awaitable[T]]) -> T:
        """Run ``afn`` in the Trio thread; a failed pipeline raises its own exception."""
        try:
            return self._runner.call(afn)
        except TrioThreadStopped:
            pass
        msg = f"rollout actor {self._index}: the pipeline is not running"
        raise RuntimeError(msg)

    def _reply(self, groups: list[RolloutGroup], ended: bool) -> RolloutActorReply:
        """Runs in the Trio thread, right after the groups were taken (no checkpoint
        between), so the snapshot counts exactly these groups as delivered."""
        stream = cast(RolloutStream, self._stream)
        statistics = stream.statistics()
        if not self._streaming and statistics.delivered >= self._num_groups:
            ended = True
        self._sequence += 1
        return RolloutActorReply(
            groups=groups, ended=ended, statistics=statistics, sequence=self._sequence
        )

    # ---------------------------------------------------------------- the surface

    def serve(
        self,
        n: int,
        whole: bool = True,
        timeout: float | None = None,
        given_back: Sequence[RolloutGroup] = (),
        stale: Sequence[RolloutGroup] = (),
    ) -> RolloutActorReply:
        """Take up to ``n`` groups and return them with a statistics snapshot.

        ``whole=True``: wait until ``n`` groups are taken (with ``enforce_order``, and the
        stream at a batch's start, ``n == num_groups`` is exactly one whole batch).
        ``whole=False``: wait for one group, then add the groups that are ready now, up
        to ``n``. Either way fewer come back only when the stream ended or ``timeout``
        seconds passed; nothing is lost (a group not returned stays in the stream).
        ``n=0`` returns a snapshot only.

        First, groups that earlier calls returned and the caller gives back (as served,
        in the order served, never handed on): ``stale`` ones were too old for
        ``max_staleness`` when the consumer took them, and their slots are generated
        again first (``statistics().stale``); with ``enforce_order``, ``given_back`` are
        the groups the caller had after the first stale one, which go back to the front
        of the stream, so that the order stays gap-free.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            msg = f"serve(n) needs an int n >= 0, got {n!r}"
            raise ValueError(msg)
        check_seconds("timeout", timeout)
        # Set before the pipeline opens; _call refuses to run before that.
        stream = cast(RolloutStream, self._stream)

        async def collect() -> RolloutActorReply:
            if given_back:
                source_of(stream).take_back(given_back, regenerate=False)
            if stale:
                source_of(stream).take_back(stale, regenerate=True)
            groups: list[RolloutGroup] = []
            ended = False
            with trio.move_on_after(math.inf if timeout is None else timeout):
                try:
                    groups.extend(stream.drain(n))
                    while len(groups) < n and (whole or not groups):
                        groups.append(await stream.receive())
                    groups.extend(stream.drain(n - len(groups)))
                except trio.EndOfChannel:
                    ended = True
            return self._reply(groups, ended)

        return self._call(collect)

    def take(self, n: int, timeout: float | None = None) -> list[RolloutGroup]:
        """Wait until ``n`` groups are taken and return them in stream order; fewer only if
        the stream ended or ``timeout`` seconds passed (nothing is lost)."""
        return self.serve(n, whole=True, timeout=timeout).groups

    def drain(self, n: int) -> list[RolloutGroup]:
        """Take up to ``n`` groups that are ready now; never waits for generation."""
        return self.serve(n, whole=True, timeout=0).groups

    def statistics(self) -> RolloutStreamStatistics:
        """A snapshot of the pipeline's counters."""
        return self.serve(0).statistics

    def settle(self, slots: list[tuple[int, int]]) -> None:
        """The groups served from these slots (``(batch_id, index_in_batch)`` as
        :meth:`serve` returned them) were handed to the consumer: their prompt draws are
        done. Only with ``start(caller_settles=True)`` and an agent that draws prompts
        (otherwise a no-op); a slot settled twice, or unknown, is ignored.

        Never enters the Trio thread: settling a slot is thread-safe.
        """
        stream = self._stream
        if not self._caller_settles or stream is None:
            return
        for batch_id, index in slots:
            source_of(stream).handed((batch_id, index))

    def prompts_state(self, slots: list[tuple[int, int]] | None = None) -> dict[str, Any]:
        """:meth:`settle` ``slots``, then return the agent's ``prompts.state_dict()``
        (``TypeError`` if the agent has no ``prompts``). Never enters the Trio thread."""
        if self._agent is None:
            msg = f"rollout actor {self._index}: start() has not built the agent yet"
            raise RuntimeError(msg)
        prompts = prompts_of(self._agent, self._index, "prompts_state()")
        self.settle(slots or [])
        return prompts.state_dict()

    def begin_weight_update(self, number: int, mode: WeightUpdateMode, epoch: int) -> WeightUpdate:
        """Begin weight update ``number``: enter the stream's ``weight_update(mode,
        epoch=epoch)`` (pausing the request's ``inference_interface``) in the Trio thread,
        hold it open, and return once its body may run.

        Raises what entering raises, as itself (``ValueError``, ``TypeError``,
        ``RuntimeError``, ``WeightUpdateError``; nothing is left paused then), the
        pipeline's exception if it failed, and ``RuntimeError`` when update ``number``
        was already ended by :meth:`end_weight_update` (a begin that ran late) or one is
        already held. ``number`` must grow from one update to the next.
        """
        stream = cast(RolloutStream, self._stream)
        held = HeldContext(lambda: stream.weight_update(mode, epoch=epoch))
        with self._update_lock:
            if number <= self._updates_ended:
                msg = f"rollout actor {self._index}: weight update {number} was ended already"
                raise RuntimeError(msg)
            if self._update is not None:
                msg = (
                    f"rollout actor {self._index}: weight update {self._update[0]} is "
                    "already in progress (one at a time)"
                )
                raise RuntimeError(msg)
            current = self._update = (number, held)
        given_up = False
        try:
            return self._runner.enter(held)
        except ContextGivenUp:
            given_up = True
        except TrioThreadStopped:
            pass
        finally:
            if not held.entered:  # not begun: failed, given up, or the pipeline ended
                self._forget_update(current)
        what = f"weight update {number} was given up" if given_up else "the pipeline is not running"
        msg = f"rollout actor {self._index}: {what}"
        raise RuntimeError(msg)

    def end_weight_update(self, number: int, body_failed: bool) -> list[str]:
        """End weight update ``number``: resume under its new epoch, or under the old
        one when ``body_failed``; an update still beginning is given up (old epoch).
        Returns once the backends have resumed.

        Returns the notes of a failed body's exit (backends that failed to resume too).
        Raises ``WeightUpdateError`` when a backend fails to resume after a returned body,
        the pipeline's exception (or ``RuntimeError``) when the pipeline stopped while the
        update was held and the body had returned, and ``RuntimeError`` when a returned
        body ends an update that had not begun (it is given up). Idempotent: ending an update
        that is not held returns ``[]``, and a later :meth:`begin_weight_update` of it is
        refused.
        """
        with self._update_lock:
            self._updates_ended = max(self._updates_ended, number)
            current = self._update
            if current is None or current[0] != number:
                return []
        held = current[1]
        try:
            self._runner.exit(held, body_failed)
        finally:
            self._forget_update(current)
        if body_failed:
            return held.exit_notes
        if held.exit_error is not None:
            raise held.exit_error
        if held.abandoned:
            msg = f"rollout actor {self._index}: weight update {number} had not begun"
            raise RuntimeError(msg)
        if not held.exited:
            self._runner.wait_stopped()
            if self._runner.failure is not None:
                raise self._runner.failure
            msg = (
                f"rollout actor {self._index}: the pipeline stopped while weight update "
                f"{number} was held; it ended under the old epoch"
            )
            raise RuntimeError(msg)
        return []

    def _forget_update(self, current: tuple[int, HeldContext[WeightUpdate]]) -> None:
        with self._update_lock:
            if self._update is current:
                self._update = None

    def wait_stopped(self) -> None:
        """Block until the pipeline has ended; raise its exception if it failed before
        :meth:`stop` was called. (A watcher: the merge keeps one of these calls pending on
        every actor, so a failure or the actor's death is seen at once.)"""
        self._runner.wait_stopped()
        if self._runner.failed_before_stop:
            raise cast(BaseException, self._runner.failure)

    def stop(self, timeout: float | None = None) -> RolloutStreamStatistics | None:
        """Cancel the pipeline and wait up to ``timeout`` seconds for its thread to end.

        Returns the pipeline's final counters, or ``None`` if it did not end in time (a
        ``group_rollout`` that ignores cancellation). Raises the pipeline's exception if it
        failed before it was asked to stop. Idempotent.
        """
        check_seconds("timeout", timeout)
        if not self._runner.stop(timeout):
            return None
        if self._runner.failed_before_stop:
            raise cast(BaseException, self._runner.failure)
        return None if self._stream is None else self._stream.statistics()

    def pid(self) -> int:
        """The actor's process id."""
        return os.getpid()


#: The class as a Ray actor class (``.options(...).remote(agent, request, index)``).
RemoteRolloutActor: Any = ray.remote(max_concurrency=ACTOR_CONCURRENCY)(RolloutActor)


@contextlib.asynccontextmanager
async def _opened(
    pipeline: contextlib.AbstractAsyncContextManager[RolloutStream], caller_settles: bool
) -> AsyncIterator[tuple[RolloutStream, bool]]:
    """The actor's pipeline, open; and whether the caller settles its prompt draws (only
    when asked to and the agent draws prompts). Not a method: Ray makes a class with an
    ``async def`` method an asyncio actor, whose blocking methods would block each
    other."""
    async with pipeline as stream:
        # A group served to the merge may wait there, and be lost at a crash: its draw
        # is done when settle() says it was handed on.
        yield stream, caller_settles and source_of(stream).settle_on_handover()
