"""The sync bridge: any :class:`~trio_rollouts.RolloutStream` driven from synchronous code
(PyTorch-style trainers).

A :class:`BlockingRolloutStream` runs Trio in a background thread for the duration of a
``with`` block (a :class:`~trio_rollouts.bridge._thread.TrioThread`), and enters there the
async context manager that opens its stream: a grouped pipeline
(:func:`blocking_grouped_rollouts`), or the Ray merge (``trio_rollouts.ray``, whose
:class:`~trio_rollouts.ray.BlockingRayRolloutStream` adds only what is Ray's). Every call
of the bridge is one round trip into that thread, to the stream's own methods; one code
path serves every stream. An exception from the stream ends the Trio thread and is raised
in the caller's thread at its next call, and at the exit of the ``with`` at the latest, as
itself: its traceback, ``__cause__`` and ``__context__`` are the ones it had in the Trio
thread, never chained to the closed stream through which the news arrived. Leaving the
block cancels the stream and joins the thread.

``stream.weight_update(...)`` is the async stream's weight update as a plain ``with``: a
task of the Trio thread enters the async context manager and holds it open while the
body runs in the caller's thread (a :class:`~trio_rollouts.bridge._thread.HeldContext`).

Prompts and kept groups go through the stream's source
(:func:`~trio_rollouts.pipeline._stream.source_of`, a
:class:`~trio_rollouts.pipeline._stream.GroupSource`). A prompt is done when the caller
gets its group, not when the Trio thread takes it from the stream
(``GroupSource.settle_on_handover``, then ``GroupSource.handed``). ``take()`` takes groups
as they arrive (taking is what frees generation capacity, so a take of more groups than
the stream may hold must take as it goes); when it times out, the groups it took are kept
and handed out first by the next call. A weight update can make a kept group too old for
``max_staleness``; the stream's own check saw it when it was fresh, so the bridge checks
the kept groups again as the update's body returns (the only moment the epoch moves) and
gives those too old back to the source (``GroupSource.take_back``), which generates them
again in their slots, exactly as it does with a group it finds too old itself.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Generic, TypeVar

import trio

from trio_rollouts._checks import check_seconds
from trio_rollouts.agents._base import GroupedRolloutGenerator
from trio_rollouts.bridge._thread import HeldContext, TrioThread
from trio_rollouts.models._requests import GroupedRolloutRequest
from trio_rollouts.models._rollouts import RolloutGroup
from trio_rollouts.pipeline._epochs import WeightUpdate, exceeds_bound
from trio_rollouts.pipeline._ledger import RolloutStreamStatistics
from trio_rollouts.pipeline._stream import GroupSource, RolloutStream, source_of

if TYPE_CHECKING:
    from trio_rollouts.inference import InferenceInterface, WeightUpdateMode

__all__ = [
    "BlockingContext",
    "BlockingRolloutStream",
    "blocking_grouped_rollouts",
    "call_in_trio",
    "current_stream",
    "drive",
]

T = TypeVar("T")


@contextlib.contextmanager
def _deadline_for_waiting(timeout: float | None) -> Iterator[trio.CancelScope]:
    """A cancel scope whose deadline is set once entered: it only fires at a point where
    the task has to wait, so a ready group, or the end of the stream, is always seen,
    even with ``timeout=0``."""
    with trio.CancelScope() as scope:
        if timeout is not None:
            scope.deadline = trio.current_time() + timeout
        yield scope


# --------------------------------------------------------------------------- kept groups


def _give_back_stale(
    source: GroupSource, kept: list[RolloutGroup], epoch: int
) -> list[RolloutGroup]:
    """The groups of ``kept`` (taken from ``source``, in order, not handed on yet) that
    ``epoch`` makes too old go back to ``source`` to be generated again; return those the
    caller keeps. With ``enforce_order`` every kept group goes back, first in line: the
    stale ones are regenerated when the epoch moves, and the order stays gap-free. Trio
    thread."""
    bound = source.max_staleness
    if not any(exceeds_bound(group.start_epoch, epoch, bound) for group in kept):
        return kept
    if source.enforce_order:
        source.take_back(kept, regenerate=False)
        return []
    source.take_back(
        [group for group in kept if exceeds_bound(group.start_epoch, epoch, bound)],
        regenerate=True,
    )
    return [group for group in kept if not exceeds_bound(group.start_epoch, epoch, bound)]


# --------------------------------------------------------------------------- weight updates


class _BlockingWeightUpdate:
    """What :meth:`BlockingRolloutStream.weight_update` returns: a ``with`` around the
    async stream's weight update, entered once."""

    def __init__(
        self,
        bridge: BlockingRolloutStream,
        mode: WeightUpdateMode,
        epoch: int | None,
        backends: Sequence[InferenceInterface] | None,
    ) -> None:
        self._bridge = bridge
        self._mode = mode
        self._epoch = epoch
        self._backends = backends
        self._held: HeldContext[WeightUpdate] | None = None

    def __enter__(self) -> WeightUpdate:
        if self._held is not None:
            msg = (
                "this weight_update() context manager was entered already; call "
                "stream.weight_update() again for each update"
            )
            raise RuntimeError(msg)
        self._held, update = self._bridge._enter_update(self._mode, self._epoch, self._backends)
        return update

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._held is not None:
            self._bridge._exit_update(self._held, exc)


# --------------------------------------------------------------------------- the bridge


class BlockingRolloutStream:
    """The groups of a stream running in a background Trio thread: ``agent``'s grouped
    pipeline for ``request`` (checked at once, in the caller's thread).

    Created by :func:`blocking_grouped_rollouts`; use it only inside its ``with`` block,
    from one thread. Iterating blocks per group and ends with the stream. Weight updates:
    ``with stream.weight_update(mode) as update: ...`` (:meth:`weight_update`) and
    :attr:`policy_epoch`.
    """

    _opener: contextlib.AbstractAsyncContextManager[RolloutStream]
    _runner: TrioThread[RolloutStream]
    _stream: RolloutStream | None
    _opened: RolloutStream | None
    _source: GroupSource | None
    _settles: bool
    _failure_raised: bool
    _held: collections.deque[RolloutGroup]

    def __init__(self, agent: GroupedRolloutGenerator, request: GroupedRolloutRequest) -> None:
        # Checks run here, in the caller's thread, before a thread is started.
        drive(self, agent.get_grouped_rollouts(request), f"trio_rollouts:{type(agent).__name__}")

    # ---------------------------------------------------------------- the Trio thread

    @contextlib.asynccontextmanager
    async def _open(self) -> AsyncIterator[RolloutStream]:
        """The stream, for the life of the Trio thread: its prompt draws are done when
        the bridge hands a group to its caller (:meth:`_handed`), not when the bridge
        takes it. Trio thread."""
        async with self._opener as stream:
            source = source_of(stream)
            self._settles = source.settle_on_handover()
            self._source = source
            yield stream

    def _start(self) -> None:
        try:
            self._stream = self._opened = self._runner.start(self._open())
        except BaseException as exc:
            # The pipeline failed before the block began: the thread has ended.
            self._failure_raised = exc is self._runner.failure
            raise

    def _stop(self) -> None:
        self._runner.stop()
        self._stream = None  # later calls get a clear error

    def _raise_failure(self) -> None:
        failure = self._runner.failure
        if failure is not None and not self._failure_raised:
            self._failure_raised = True
            raise failure

    def _call(self, afn: Callable[[], Awaitable[T]]) -> T:
        """Run ``afn`` in the Trio thread; a dead pipeline raises its own exception."""
        return self._through(lambda: self._runner.call(afn))

    def _through(self, op: Callable[[], T]) -> T:
        """Run ``op`` (a call into the Trio thread); the pipeline's failure, raised by it
        or pending, is raised once, as itself."""
        self._raise_failure()
        if self._failure_raised:
            msg = "the rollout pipeline has stopped after an error (raised earlier)"
            raise RuntimeError(msg)
        try:
            return op()
        except BaseException as exc:
            if exc is self._runner.failure:
                self._failure_raised = True
            raise

    # ---------------------------------------------------------------- the surface

    def get(self, timeout: float | None = None) -> RolloutGroup:
        """Block until the next group, and take it.

        Raises ``TimeoutError`` when ``timeout`` seconds pass first (nothing is lost: the
        group arrives on a later call), and ``trio.EndOfChannel`` when a non-streaming
        request's batch has been fully taken.
        """
        check_seconds("timeout", timeout)
        if self._held:
            return self._handed(self._held.popleft())
        stream = self._require_stream()

        async def get_one() -> RolloutGroup | None:
            with _deadline_for_waiting(timeout):
                return await stream.receive()
            return None

        group = self._call(get_one)
        if group is None:
            msg = f"no rollout group arrived within {timeout} s"
            raise TimeoutError(msg)
        return self._handed(group)

    def take(self, n: int, timeout: float | None = None) -> list[RolloutGroup]:
        """Block until ``n`` groups are taken, and return them in stream order.

        Returns fewer only when the stream ends. Raises ``TimeoutError`` when ``timeout``
        seconds pass first; the groups received so far are kept and returned first by
        the next call, so nothing is lost. With ``max_staleness``, a kept group that a
        :meth:`weight_update` makes too old is not returned: it is generated again in
        its slot, as the stream does with a group found too old when it is taken.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            msg = f"take(n) needs an int n >= 0, got {n!r}"
            raise ValueError(msg)
        check_seconds("timeout", timeout)
        groups: list[RolloutGroup] = []
        while self._held and len(groups) < n:
            groups.append(self._held.popleft())
        if len(groups) == n:
            return self._handed_all(groups)
        stream = self._require_stream()
        timed_out = False

        async def take_rest() -> None:
            nonlocal timed_out
            with _deadline_for_waiting(timeout) as scope:
                try:
                    while len(groups) < n:
                        groups.append(await stream.receive())
                except trio.EndOfChannel:
                    return
            timed_out = scope.cancelled_caught

        try:
            self._call(take_rest)
        except BaseException:
            self._held.extendleft(reversed(groups))
            raise
        if timed_out:
            self._held.extendleft(reversed(groups))
            msg = f"only {len(groups)} of {n} rollout groups arrived within {timeout} s"
            raise TimeoutError(msg)
        return self._handed_all(groups)

    def try_next(self) -> RolloutGroup | None:
        """Take a group that is ready now, or return ``None`` at once."""
        if self._held:
            return self._handed(self._held.popleft())
        stream = self._require_stream()

        async def try_one() -> RolloutGroup | None:
            return stream.try_next()

        group = self._call(try_one)
        return None if group is None else self._handed(group)

    def drain(self, n: int) -> list[RolloutGroup]:
        """Take up to ``n`` groups that are ready now; never waits for generation."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            msg = f"drain(n) needs an int n >= 0, got {n!r}"
            raise ValueError(msg)
        groups: list[RolloutGroup] = []
        while self._held and len(groups) < n:
            groups.append(self._held.popleft())
        if len(groups) == n:
            return self._handed_all(groups)
        stream = self._require_stream()
        wanted = n - len(groups)

        async def drain_ready() -> list[RolloutGroup]:
            return stream.drain(wanted)

        return self._handed_all(groups + self._call(drain_ready))

    def _handed(self, group: RolloutGroup) -> RolloutGroup:
        """``group`` is returned to the caller: its prompt draw is done (see
        :class:`~trio_rollouts.PromptSource`). Caller's thread; settling is
        thread-safe."""
        source = self._source
        if self._settles and source is not None:
            source.handed((group.batch_id, group.index_in_batch))
        return group

    def _handed_all(self, groups: list[RolloutGroup]) -> list[RolloutGroup]:
        for group in groups:
            self._handed(group)
        return groups

    def statistics(self) -> RolloutStreamStatistics:
        """A snapshot of the pipeline's counters."""
        stream = self._require_stream()

        async def snapshot() -> RolloutStreamStatistics:
            return stream.statistics()

        return self._call(snapshot)

    def metrics(self) -> dict[str, float]:
        """What happened since the last call, as one flat dict of floats for any logger
        (see :meth:`RolloutStream.metrics <trio_rollouts.RolloutStream.metrics>`; the
        consumer's waits are those of the bridge's Trio thread)."""
        stream = self._require_stream()

        async def report() -> dict[str, float]:
            return stream.metrics()

        return self._call(report)

    def __iter__(self) -> Iterator[RolloutGroup]:
        while True:
            try:
                yield self.get()
            except trio.EndOfChannel:
                return

    # ---------------------------------------------------------------- weight updates

    @property
    def policy_epoch(self) -> int:
        """The stream's policy epoch (see :attr:`RolloutStream.policy_epoch`); it moves
        when a :meth:`weight_update` body returns, and stays readable after the block."""
        if self._opened is None:
            msg = "use the stream inside its 'with blocking_grouped_rollouts(...)' block"
            raise RuntimeError(msg)
        return self._opened.policy_epoch

    def weight_update(
        self,
        mode: WeightUpdateMode = "drain",
        *,
        epoch: int | None = None,
        backends: Sequence[InferenceInterface] | None = None,
    ) -> contextlib.AbstractContextManager[WeightUpdate]:
        """Pause generation for a weight update, as a ``with`` block::

            with stream.weight_update("keep") as update:
                push_weights(update.epoch)
            # calls that start now start under update.epoch

        The same update as the async :meth:`RolloutStream.weight_update` (modes, epochs,
        ``backends``, the staleness bound, ``statistics()``), with its body in the
        caller's thread: a task of the Trio thread enters the async context manager and
        holds it open until the ``with`` exits.

        Blocking: entering blocks until the body may begin (calls in flight drained or
        settled, every backend paused), and raises what entering raises, as itself:
        ``ValueError`` (mode, epoch), ``TypeError`` (a backend that cannot pause for the
        mode), ``RuntimeError`` (an update already in progress),
        :class:`~trio_rollouts.inference.WeightUpdateError` (a pause failed; what was
        paused is resumed first). A drain waits for the calls in flight however long
        they take (``group_timeout`` bounds them). Exiting blocks until every backend
        has resumed. During the body, groups already finished can be taken (``drain``,
        ``try_next``, ``take`` with a timeout); no new call starts, so a ``take`` that
        needs more waits until its timeout.

        Exit: when the body returns, generation resumes under the new epoch (a resume
        that fails is a ``WeightUpdateError`` raised here), and with ``max_staleness``
        the groups a timed-out :meth:`take` kept that are now too old are generated
        again in their slots. When the body raises (``KeyboardInterrupt`` included),
        generation resumes under the **old** epoch and the exception propagates
        unchanged (notes are added only when a backend also failed to resume).

        Failures and shutdown: the update ends on every route, nothing is left paused.
        If the pipeline fails during the body, the update ends under the old epoch and
        the pipeline's exception is raised at the exit (or, when the body raised too,
        the body's exception propagates and the pipeline's is raised by the next call).
        A ``KeyboardInterrupt`` that interrupts a blocked enter or exit gives the update
        up under the old epoch. Leaving the ``blocking_grouped_rollouts`` block while an
        update is open ends it under the old epoch; its exit then raises
        ``RuntimeError``.
        """
        return _BlockingWeightUpdate(self, mode, epoch, backends)

    def _enter_update(
        self,
        mode: WeightUpdateMode,
        epoch: int | None,
        backends: Sequence[InferenceInterface] | None,
    ) -> tuple[HeldContext[WeightUpdate], WeightUpdate]:
        stream = self._require_stream()

        def before_exit(update: WeightUpdate) -> None:
            # Trio thread; the caller's thread waits in the update's exit.
            self._held = collections.deque(self._kept_after_update(update.epoch))

        held = HeldContext(
            lambda: stream.weight_update(mode, epoch=epoch, backends=backends), before_exit
        )
        # Interrupted (KeyboardInterrupt) or failed while it entered, the update is
        # given up: it never stays open.
        update = self._through(lambda: self._runner.enter(held))
        return held, update

    def _exit_update(self, held: HeldContext[WeightUpdate], exc: BaseException | None) -> None:
        # Interrupted while it exits, the update still ends, under the old epoch if it
        # had not got that far.
        self._runner.exit(held, body_failed=exc is not None)
        if exc is not None:
            for note in held.exit_notes:
                exc.add_note(note)
            return  # the body's exception propagates; a pipeline failure stays pending
        if held.exit_error is not None:
            raise held.exit_error
        if not held.exited:
            # The stream closed, or its pipeline failed, while the body ran.
            self._raise_lost()

    def _raise_lost(self) -> None:
        """A weight update ended under the old epoch because the pipeline stopped under
        it: raise the pipeline's failure, or say what happened."""
        self._runner.wait_stopped()
        self._raise_failure()
        if self._failure_raised:
            msg = (
                "the rollout pipeline stopped after an error (raised earlier) while the "
                "weight update was open; it ended under the old epoch"
            )
        else:
            msg = "the stream closed while the weight update was open; it ended under the old epoch"
        raise RuntimeError(msg)

    def _kept_after_update(self, epoch: int) -> list[RolloutGroup]:
        """A weight update's body returned, and its exit moves the epoch to ``epoch``: the
        kept groups it makes too old go back to the source; return those the bridge
        keeps. Trio thread."""
        kept = list(self._held)
        source = self._source
        if source is None or not kept or source.closed:
            return kept
        return _give_back_stale(source, kept, epoch)

    def _require_stream(self) -> RolloutStream:
        self._raise_failure()
        if self._stream is None:
            msg = "use the stream inside its 'with blocking_grouped_rollouts(...)' block"
            raise RuntimeError(msg)
        return self._stream


# --------------------------------------------------------------------------- for subclasses


def drive(
    bridge: BlockingRolloutStream,
    opener: contextlib.AbstractAsyncContextManager[RolloutStream],
    thread_name: str,
) -> None:
    """Set ``bridge`` (a :class:`BlockingRolloutStream` or a subclass, from its
    ``__init__``) up to drive the stream that ``opener`` yields, entered in a Trio thread
    named ``thread_name`` when the block begins. ``opener`` must make no Trio call before
    it is entered. Caller's thread, before the block begins."""
    bridge._opener = opener
    bridge._runner = TrioThread(thread_name)
    bridge._stream = None
    # The stream's source, once open (settling, take-backs), and whether it settles.
    bridge._source = None
    bridge._settles = False
    # The stream once opened, kept after the block (policy_epoch stays readable).
    bridge._opened = None
    bridge._failure_raised = False
    # Groups received for a take() that then timed out: handed out first next time.
    bridge._held = collections.deque()


def call_in_trio(bridge: BlockingRolloutStream, afn: Callable[[], Awaitable[T]]) -> T:
    """Run ``afn`` in ``bridge``'s Trio thread, as the bridge's own calls do (its
    stream's failure raised once, as itself). Caller's thread."""
    return bridge._call(afn)


def current_stream(bridge: BlockingRolloutStream) -> RolloutStream:
    """The stream ``bridge`` drives; ``RuntimeError`` outside its block (or its
    stream's failure, once). Caller's thread."""
    return bridge._require_stream()


StreamT = TypeVar("StreamT", bound=BlockingRolloutStream)


class BlockingContext(Generic[StreamT]):
    """Start a bridge's Trio thread on enter; stop and join it on exit, raising the
    pipeline's failure unless the block is already leaving with its own exception."""

    def __init__(self, stream: StreamT) -> None:
        self._stream = stream

    def __enter__(self) -> StreamT:
        self._stream._start()
        return self._stream

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stream._stop()
        if exc is None:
            self._stream._raise_failure()


def blocking_grouped_rollouts(
    agent: GroupedRolloutGenerator, request: GroupedRolloutRequest
) -> contextlib.AbstractContextManager[BlockingRolloutStream]:
    """Run ``agent``'s grouped pipeline in a background Trio thread for a ``with`` block.

    ::

        with trio_rollouts.blocking_grouped_rollouts(agent, request) as stream:
            groups = stream.take(16, timeout=60)   # blocks
            more = stream.drain(4)                 # never blocks
            with stream.weight_update("drain") as update:
                push_weights(update.epoch)         # generation is paused meanwhile

    The request is checked at once, in the caller's thread. An exception from the
    pipeline is raised in the caller's thread at its next call, and at the exit of the
    ``with`` at the latest (unless the block is already leaving with an exception of its
    own), as itself: with the ``__cause__`` and ``__context__`` it had in the pipeline,
    and nothing chained to it by the way it crossed threads. Leaving the block, by any
    route, cancels the pipeline and joins its thread: when ``__exit__`` returns, every
    ``group_rollout`` call has exited and the thread is gone.
    """
    if not isinstance(agent, GroupedRolloutGenerator):
        msg = f"agent must be a GroupedRolloutGenerator, got {type(agent).__name__}"
        raise TypeError(msg)
    return BlockingContext(BlockingRolloutStream(agent, request))
