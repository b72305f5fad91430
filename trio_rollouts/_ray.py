"""Scaling out on Ray: rollout actors, each running a grouped pipeline, merged into one stream.

A :class:`RolloutActor` hosts one agent in its own process and runs that agent's grouped
pipeline (``_pipeline.py``, unchanged) in a Trio thread of its own; its methods take groups
from the pipeline's stream. :func:`open_ray_rollouts` starts ``num_actors`` of them and
merges their groups into one :class:`RayRolloutStream`, which has the surface of a
:class:`~trio_rollouts.RolloutStream`; :func:`blocking_ray_rollouts` is its sync twin.

Invariants of the merge (each one is a test):

1. Bounded run-ahead: the merge asks an actor for a batch only when fewer than
   ``prefetch_batches * num_groups`` of that actor's groups wait in the merge, and has at
   most one request out per actor. Taking groups is what frees the actor's own pipeline,
   so an actor holds at most ``W * G`` groups that the consumer has not taken (its
   pipeline's bound) plus ``prefetch_batches * G`` in the merge.
2. ``enforce_order``: every reply is one whole batch of one actor, in the actor's
   ``batch_id`` order, and the merge hands batches out round-robin: actor 0's batch 0,
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

6. Prompts, exactly once (DESIGN.md, "Resumable runs"): each actor's agent owns a
   disjoint shard of the run's :class:`~trio_rollouts.PromptSource`, built in the actor
   by an agent factory::

       source = PromptSource(problems, seed=0)
       agent = lambda i: MyAgent(prompts=source.shard(i, num_actors))

   (a ``prompts`` source pickled to several actors as it is would be drawn by each of
   them: ``ValueError``, as are two actors whose shards have the same problems). A group
   handed to the merge may wait in its prefetch and be lost at a crash, so an actor's
   pipeline does not count a draw done when it serves the group (``done_on_take`` is
   off): the merge tells each actor which of its groups it handed to the consumer
   (``receive``, ``try_next``, ``drain``, iteration; with the sync twin, when a group is
   returned to the caller), by their slot in the actor, in one ``settle`` call sent
   before its next ``serve`` and before any state is fetched; only for actors whose
   agent draws prompts. :meth:`RayRolloutStream.prompts_state_dict` settles, then
   merges every actor's ``agent.prompts.state_dict()`` with
   :meth:`~trio_rollouts.PromptSource.merge_state_dicts`; ``prompts_state=`` of
   :func:`open_ray_rollouts` loads shard ``i`` of such a state into actor ``i``'s
   ``agent.prompts`` before its pipeline opens. Groups in the prefetch that were never
   handed out are not settled: the actors' pipelines give their draws back when they
   stop, and a state fetched meanwhile counts them as not done.

Ray's ``ObjectRef`` is awaitable in asyncio, not in Trio, so every wait for a reply is a
``ray.get`` in a worker thread that Trio abandons on cancellation (the reply, if it ever
comes, is dropped; the actor is stopped and killed at exit in any case).
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import re
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import attrs
import trio

try:
    import ray
    import ray.exceptions
except ImportError as exc:  # pragma: no cover - exercised only without ray
    msg = "trio_rollouts.ray needs Ray; install it with: pip install 'trio-rollouts[ray]'"
    raise ImportError(msg) from exc

from ._agents import GroupedRolloutGenerator
from ._blocking import (
    BlockingRolloutStream,
    _BlockingContext,
    _check_timeout,
    _HeldUpdate,
    _hold_in,
)
from ._concurrency import flatten_exception_groups
from ._ledger import EnvironmentStatistics, RolloutStreamStatistics
from ._models import GroupedRolloutRequest, RolloutGroup
from ._pipeline import check_grouped_request
from ._prompts import PromptSource
from ._stream import RolloutStream, drain_ready, settle_handed, settle_on_handover
from ._weight_update import WeightUpdate, checked_epoch, checked_mode
from .inference import InferenceInterface, WeightUpdateMode

__all__ = [
    "BlockingRayRolloutStream",
    "RayRolloutStream",
    "RayRolloutStreamStatistics",
    "RolloutActor",
    "RolloutActorDiedError",
    "RolloutActorError",
    "RolloutActorInfo",
    "RolloutActorReply",
    "blocking_ray_rollouts",
    "open_ray_rollouts",
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
#: Ray colours the remote traceback it puts in an error message.
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
#: The sequence number of an actor's final counters (returned by stop): newer than any.
FINAL_SEQUENCE = sys.maxsize


# --------------------------------------------------------------------------- errors


class RolloutActorError(RuntimeError):
    """A rollout actor failed in a way that is not an exception of its agent.

    ``actor_index`` is the actor's index (0 .. num_actors - 1), ``actor_id`` Ray's id for it
    (hex), ``pid`` its process id when known.
    """

    def __init__(self, msg: str, *, actor_index: int, actor_id: str, pid: int | None) -> None:
        super().__init__(msg)
        self.actor_index = actor_index
        self.actor_id = actor_id
        self.pid = pid

    def __reduce__(self) -> tuple[Any, ...]:
        args = (type(self), str(self), self.actor_index, self.actor_id, self.pid)
        return (_rebuild_actor_error, args)


class RolloutActorDiedError(RolloutActorError):
    """A rollout actor's process died (killed, crashed, or its node was lost)."""


def _rebuild_actor_error(
    cls: type[RolloutActorError], msg: str, actor_index: int, actor_id: str, pid: int | None
) -> RolloutActorError:
    return cls(msg, actor_index=actor_index, actor_id=actor_id, pid=pid)


# --------------------------------------------------------------------------- the actor


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


def _prompts_of(agent: GroupedRolloutGenerator | None, index: int, what: str) -> PromptSource:
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
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stream: RolloutStream | None = None
        self._agent: GroupedRolloutGenerator | None = None
        # The open pipeline, when its agent draws prompts and the caller settles them.
        self._settled_pipeline: RolloutStream | None = None
        self._caller_settles = False
        self._stop_scope: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None  # holds weight updates open
        self._stop_requested = False
        # The weight update held open, by number, and the highest number ended (a begin
        # that arrives after its end is refused). Actor threads share these.
        self._update_lock = threading.Lock()
        self._update: tuple[int, _HeldUpdate] | None = None
        self._updates_ended = 0
        self._failure: BaseException | None = None
        self._failed_before_stop = False
        self._opened = threading.Event()  # the pipeline is open, or failed to open
        self._stopped = threading.Event()  # the Trio thread has ended
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
        if self._thread is not None:
            msg = "RolloutActor.start() was called twice"
            raise RuntimeError(msg)
        agent = _build_agent(self._agent_source, self._index)
        request = _build_request(self._request_source, self._index)
        pipeline = agent.get_grouped_rollouts(request)  # checks raise here
        if prompts_state is not None:
            _prompts_of(agent, self._index, "prompts_state").load_state_dict(prompts_state)
        self._agent = agent
        self._caller_settles = caller_settles
        self._streaming = request.streaming
        self._num_groups = request.num_groups
        self._thread = threading.Thread(
            target=self._run_trio,
            args=(pipeline,),
            name=f"trio_rollouts:RolloutActor[{self._index}]",
            daemon=True,
        )
        self._thread.start()
        self._opened.wait()
        self._raise_failure()
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
            policy_epoch=cast(RolloutStream, self._stream).policy_epoch,
            tracks_prompts=self._settled_pipeline is not None,
            prompts_fingerprint=(
                str(prompts._fingerprint()["ids_sha256"])
                if isinstance(prompts, PromptSource)
                else None
            ),
        )

    def _run_trio(self, pipeline: contextlib.AbstractAsyncContextManager[RolloutStream]) -> None:
        # Not a method: Ray makes a class with an ``async def`` method an asyncio actor,
        # whose blocking methods would then block each other.
        async def serve_pipeline() -> None:
            self._token = trio.lowlevel.current_trio_token()
            async with pipeline as stream:
                self._stream = stream
                # A group served to the merge may wait there, and be lost at a crash:
                # its draw is done when settle() says it was handed on.
                if (
                    self._caller_settles
                    and isinstance(stream, RolloutStream)
                    and settle_on_handover(stream)
                ):
                    self._settled_pipeline = stream
                # Weight updates are held open by tasks of this nursery: cancelling it
                # (stop) ends them under the old epoch before the pipeline closes.
                with flatten_exception_groups():
                    async with trio.open_nursery() as nursery:
                        self._nursery = nursery
                        scope = nursery.cancel_scope
                        self._stop_scope = scope
                        # stop() sets the flag before it reads the scope; we set the scope
                        # before we read the flag: one of us sees the other.
                        if self._stop_requested:
                            scope.cancel()
                        self._opened.set()
                        await trio.sleep_forever()

        try:
            trio.run(serve_pipeline)
        except BaseException as exc:  # raised by the actor's next call
            self._failed_before_stop = not self._stop_requested
            self._failure = exc
        finally:
            self._stopped.set()
            self._opened.set()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _call(self, afn: Callable[[], Awaitable[T]]) -> T:
        """Run ``afn`` in the Trio thread; a failed pipeline raises its own exception."""
        self._raise_failure()
        token = self._token
        if token is None or self._stopped.is_set():
            msg = f"rollout actor {self._index}: the pipeline is not running"
            raise RuntimeError(msg)
        try:
            return trio.from_thread.run(afn, trio_token=token)
        except (trio.RunFinishedError, trio.Cancelled, trio.ClosedResourceError):
            # The pipeline ended while we waited: its failure, if any, is the news.
            self._stopped.wait()
            self._raise_failure()
            msg = f"rollout actor {self._index}: the pipeline was stopped"
            raise RuntimeError(msg) from None

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

    def serve(self, n: int, whole: bool = True, timeout: float | None = None) -> RolloutActorReply:
        """Take up to ``n`` groups and return them with a statistics snapshot.

        ``whole=True``: wait until ``n`` groups are taken (with ``enforce_order`` and ``n``
        equal to ``num_groups``, that is exactly one whole batch). ``whole=False``: wait for
        one group, then add the groups that are ready now, up to ``n``. Either way fewer
        come back only when the stream ended or ``timeout`` seconds passed; nothing is
        lost (a group not returned stays in the stream). ``n=0`` returns a snapshot only.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            msg = f"serve(n) needs an int n >= 0, got {n!r}"
            raise ValueError(msg)
        _check_timeout(timeout)
        # Set before the pipeline opens; _call refuses to run before that.
        stream = cast(RolloutStream, self._stream)

        async def collect() -> RolloutActorReply:
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

        Never enters the Trio thread: ``_Pipeline.settle_slot`` is thread-safe (one
        atomic pop of the pipeline's record of the group's draws, then the thread-safe
        source's books).
        """
        stream = self._settled_pipeline
        if stream is None:
            return
        for batch_id, index in slots:
            settle_handed(stream, batch_id, index)

    def prompts_state(self, slots: list[tuple[int, int]] | None = None) -> dict[str, Any]:
        """:meth:`settle` ``slots``, then return the agent's ``prompts.state_dict()``
        (``TypeError`` if the agent has no ``prompts``). Never enters the Trio thread."""
        if self._agent is None:
            msg = f"rollout actor {self._index}: start() has not built the agent yet"
            raise RuntimeError(msg)
        prompts = _prompts_of(self._agent, self._index, "prompts_state()")
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
        held = _HeldUpdate(lambda: stream.weight_update(mode, epoch=epoch))
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
        try:
            self._call(lambda: _hold_in(self._nursery, held))
        finally:
            if held.update is None:  # not begun: failed, given up, or the pipeline ended
                self._forget_update(current)
        if held.enter_error is not None:
            raise held.enter_error
        if held.update is None:
            msg = f"rollout actor {self._index}: weight update {number} was given up"
            raise RuntimeError(msg)
        return held.update

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
        token = self._token
        try:
            if not held.finished.is_set() and token is not None:
                with contextlib.suppress(trio.RunFinishedError, trio.Cancelled):
                    trio.from_thread.run(held.finish, body_failed, trio_token=token)
        finally:
            self._forget_update(current)
        if body_failed:
            return held.exit_notes
        if held.exit_error is not None:
            raise held.exit_error
        if held.abandoned:
            msg = f"rollout actor {self._index}: weight update {number} had not begun"
            raise RuntimeError(msg)
        if held.ended is None:
            self._stopped.wait()
            self._raise_failure()
            msg = (
                f"rollout actor {self._index}: the pipeline stopped while weight update "
                f"{number} was held; it ended under the old epoch"
            )
            raise RuntimeError(msg)
        return []

    def _forget_update(self, current: tuple[int, _HeldUpdate]) -> None:
        with self._update_lock:
            if self._update is current:
                self._update = None

    def wait_stopped(self) -> None:
        """Block until the pipeline has ended; raise its exception if it failed before
        :meth:`stop` was called. (A watcher: the merge keeps one of these calls pending on
        every actor, so a failure or the actor's death is seen at once.)"""
        self._opened.wait()
        self._stopped.wait()
        if self._failed_before_stop:
            self._raise_failure()

    def stop(self, timeout: float | None = None) -> RolloutStreamStatistics | None:
        """Cancel the pipeline and wait up to ``timeout`` seconds for its thread to end.

        Returns the pipeline's final counters, or ``None`` if it did not end in time (a
        ``group_rollout`` that ignores cancellation). Raises the pipeline's exception if it
        failed before it was asked to stop. Idempotent.
        """
        _check_timeout(timeout)
        self._stop_requested = True
        scope, token = self._stop_scope, self._token
        if scope is not None and token is not None and not self._stopped.is_set():
            # Scheduled, not waited for: a loop held by a call that ignores cancellation
            # must not hold stop() past its timeout.
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(scope.cancel)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return None
        if self._failed_before_stop:
            self._raise_failure()
        return None if self._stream is None else self._stream.statistics()

    def pid(self) -> int:
        """The actor's process id."""
        return os.getpid()


_RemoteRolloutActor: Any = ray.remote(max_concurrency=ACTOR_CONCURRENCY)(RolloutActor)


# --------------------------------------------------------------------------- statistics


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

    @property
    def actor_id(self) -> str:
        if self.info is not None:
            return self.info.actor_id
        try:
            return str(self.handle._actor_id.hex())  # Ray keeps the id on the handle
        except Exception:  # pragma: no cover - a handle without the private attribute
            return "unknown"

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

    def __init__(self) -> None:
        msg = "RayRolloutStream is created by open_ray_rollouts()"
        raise TypeError(msg)

    @classmethod
    def _new(
        cls,
        agent: AgentSource,
        request: RequestSource,
        num_actors: int,
        prefetch_batches: int,
        actor_options: dict[str, Any],
        start_timeout: float,
        stop_timeout: float,
        prompts_states: list[dict[str, Any]] | None = None,
    ) -> RayRolloutStream:
        self = object.__new__(cls)
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
        self._updating = False
        self._update_number = 0
        self._prompts_states = prompts_states  # shard i is loaded into actor i
        # A group's prompt draw is done when the merge hands it to the consumer; the sync
        # twin turns this off and settles a group when it returns it to its caller.
        self._done_on_take = True
        return self

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
        remote = _RemoteRolloutActor.options(**self._actor_options)
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
        """Ask ``lane``'s actor for a batch whenever the merge has room for one."""
        while not lane.ended:
            while not self._has_room(lane):
                await lane.wanted.park()
            lane.requested = True
            lane.flush_settles()
            ref = lane.handle.serve.remote(self._num_groups, self._enforce_order)
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
        for group in reply.groups:
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
        lane.held += len(reply.groups)
        lane.received += len(reply.groups)
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
            if self._arrivals:
                lane, group = self._arrivals.popleft()
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
        group = self._take(lane, lane.groups.popleft())
        self._taken_in_turn += 1
        if self._taken_in_turn == self._num_groups:
            self._advance_turn()
        return group

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

    # ---------------------------------------------------------------- prompts

    def _settle_handed(self, group: RolloutGroup) -> None:
        """The sync twin returned ``group`` to its caller (``_done_on_take`` off): its
        prompt draw is done. Caller's thread: only an atomic pop and append."""
        lanes = self._lanes
        if lanes:
            lane = lanes[group.batch_id % len(lanes)]
            if lane.tracks:
                lane.handed(group)

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

        Staleness: with ``max_staleness``, each actor checks its groups when it serves
        them to the merge; groups already in the merge (at most ``prefetch_batches``
        batches per actor) are not checked again.

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


def _check_positive(name: str, value: object, *, integer: bool) -> None:
    kind = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        what = "an int >= 1" if integer else "a number of seconds > 0"
        msg = f"{name} must be {what}, got {value!r}"
        raise TypeError(msg)
    if integer and value < 1:
        msg = f"{name} must be >= 1, got {value!r}"
        raise ValueError(msg)
    if not integer and not value > 0:
        msg = f"{name} must be > 0 seconds, got {value!r}"
        raise ValueError(msg)


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
    if isinstance(agent, GroupedRolloutGenerator) and num_actors > 1 and agent._draws_prompts():
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
        _prompts_of(agent, 0, "prompts_state")
    return PromptSource.split_state_dict(prompts_state, num_actors)


@contextlib.asynccontextmanager
async def _open(stream: RayRolloutStream) -> AsyncIterator[RayRolloutStream]:
    stop_failure: BaseException | None = None
    try:
        with flatten_exception_groups():
            await stream._start_actors()
            async with trio.open_nursery() as nursery:
                stream._cancel_scope = nursery.cancel_scope
                for lane in stream._lanes:
                    nursery.start_soon(stream._feed, lane)
                    nursery.start_soon(stream._watch, lane)
                try:
                    yield stream
                finally:
                    stream._closing = True  # what fails from here on is shutdown noise
                    nursery.cancel_scope.cancel()
    finally:
        stream._closing = True
        stream._closed = True
        stream._consumer.unpark_all()
        with trio.CancelScope(shield=True):
            stop_failure = await stream._stop_actors()
    if stream._failure is not None:
        raise stream._failure
    if stop_failure is not None:
        raise stop_failure


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
    invariants in the docstring of ``trio_rollouts._ray``.

    Prompts, each taken exactly once across restarts (invariant 6 in the docstring of
    ``trio_rollouts._ray``): give each actor a disjoint shard of the run's
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
    return _open(
        _checked_stream(
            agent,
            request,
            num_actors,
            prefetch_batches,
            actor_options,
            start_timeout,
            stop_timeout,
            prompts_state,
        )
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
) -> RayRolloutStream:
    _check_sources(agent, request)
    _check_positive("num_actors", num_actors, integer=True)
    _check_positive("prefetch_batches", prefetch_batches, integer=True)
    _check_positive("start_timeout", start_timeout, integer=False)
    _check_positive("stop_timeout", stop_timeout, integer=False)
    options = _checked_actor_options(actor_options)
    states = _checked_prompts_states(agent, num_actors, prompts_state)
    return RayRolloutStream._new(
        agent, request, num_actors, prefetch_batches, options, start_timeout, stop_timeout, states
    )


# --------------------------------------------------------------------------- the sync twin


class _MergedStreamSource:
    """Quacks like an agent for :class:`BlockingRolloutStream`, whose machinery (a Trio
    thread, take/get/drain with timeouts, failures raised in the caller's thread) works for
    any stream with the RolloutStream surface."""

    def __init__(self, open_stream: contextlib.AbstractAsyncContextManager[RayRolloutStream]):
        self._open_stream = open_stream

    def get_grouped_rollouts(
        self, request: object
    ) -> contextlib.AbstractAsyncContextManager[RayRolloutStream]:
        return self._open_stream


class BlockingRayRolloutStream(BlockingRolloutStream):
    """The merged groups of Ray rollout actors, driven from synchronous code; created by
    :func:`blocking_ray_rollouts`. The surface of
    :class:`~trio_rollouts.BlockingRolloutStream` (``take``, ``get``, ``try_next``,
    ``drain``, iteration, ``statistics``, ``policy_epoch``, and ``weight_update`` as a
    plain ``with``, which pauses every actor as :meth:`RayRolloutStream.weight_update`
    does), plus :meth:`fetch_statistics`, :meth:`prompts_state_dict` and the actors.

    Staleness: groups that a timed-out ``take()`` kept are not checked again after a
    weight update (as groups already in the merge are not; see
    :meth:`RayRolloutStream.weight_update`).
    """

    def __init__(
        self, open_stream: contextlib.AbstractAsyncContextManager[RayRolloutStream]
    ) -> None:
        super().__init__(_MergedStreamSource(open_stream), None)  # type: ignore[arg-type]

    def _merged(self) -> RayRolloutStream:
        return cast(RayRolloutStream, self._require_stream())

    def _handed(self, group: RolloutGroup) -> RolloutGroup:
        """``group`` is returned to the caller: its prompt draw is done (the merge is
        told, and tells the actor before its next batch or any state fetch)."""
        stream: object = self._opened
        if isinstance(stream, RayRolloutStream) and not stream._done_on_take:
            stream._settle_handed(group)
        return group

    def prompts_state_dict(self) -> dict[str, Any]:
        """The state of the run's prompts (see :meth:`RayRolloutStream.prompts_state_dict`):
        every group returned to the caller so far is done in it; groups kept by a
        timed-out ``take()`` are not, nor groups not returned yet."""
        return self._call(self._merged().prompts_state_dict)

    def statistics(self) -> RayRolloutStreamStatistics:
        """The actors' counters as of their latest replies (see
        :meth:`RayRolloutStream.statistics`)."""
        return cast(RayRolloutStreamStatistics, super().statistics())

    def fetch_statistics(self, timeout: float | None = 10.0) -> RayRolloutStreamStatistics:
        """Ask every actor for its counters now and return :meth:`statistics` (see
        :meth:`RayRolloutStream.fetch_statistics`); actors that have not answered within
        ``timeout`` seconds keep their previous counters."""
        _check_timeout(timeout)
        stream = self._merged()

        async def fetch() -> RayRolloutStreamStatistics:
            with trio.move_on_after(math.inf if timeout is None else timeout):
                return await stream.fetch_statistics()
            return stream.statistics()

        return self._call(fetch)

    @property
    def actors(self) -> tuple[Any, ...]:
        """The Ray actor handles, by actor index."""
        return self._merged().actors

    @property
    def actor_info(self) -> tuple[RolloutActorInfo | None, ...]:
        """Where each actor runs."""
        return self._merged().actor_info


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
    stream._done_on_take = False  # the bridge settles what it returns (_handed)
    return _BlockingContext(BlockingRayRolloutStream(_open(stream)))
