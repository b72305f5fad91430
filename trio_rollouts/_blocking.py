"""The sync bridge: a grouped pipeline driven from synchronous code (PyTorch-style trainers).

:func:`blocking_grouped_rollouts` runs Trio in a background thread for the duration of a
``with`` block. The pipeline lives in that thread; every call of the
:class:`BlockingRolloutStream` is one round trip into it through
``trio.from_thread``. An exception from the pipeline ends the Trio thread and is raised
in the caller's thread at its next call, and at the exit of the ``with`` at the latest,
as itself: its traceback, ``__cause__`` and ``__context__`` are the ones it had in the
Trio thread, never chained to the closed stream through which the news arrived.
Leaving the block cancels the pipeline and joins the thread.

``stream.weight_update(...)`` is the async stream's weight update as a plain ``with``: a
task of the Trio thread enters the async context manager and holds it open while the
body runs in the caller's thread (:class:`_HeldUpdate`).
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Generic, TypeVar

import trio

from ._agents import GroupedRolloutGenerator
from ._concurrency import flatten_exception_groups
from ._ledger import RolloutStreamStatistics
from ._models import GroupedRolloutRequest, RolloutGroup
from ._stream import (
    RolloutStream,
    enforces_order,
    is_closed,
    is_too_old,
    put_back,
    return_stale,
    settle_handed,
    settle_on_handover,
    staleness_bound,
)
from ._weight_update import WeightUpdate

if TYPE_CHECKING:
    from .inference import InferenceInterface, WeightUpdateMode

__all__ = ["BlockingRolloutStream", "blocking_grouped_rollouts"]

T = TypeVar("T")


def _check_timeout(timeout: float | None) -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        msg = f"timeout must be a number of seconds >= 0 or None, got {timeout!r}"
        raise TypeError(msg)
    if math.isnan(timeout) or timeout < 0:
        msg = f"timeout must be >= 0 seconds or None, got {timeout!r}"
        raise ValueError(msg)


@contextlib.contextmanager
def _deadline_for_waiting(timeout: float | None) -> Iterator[trio.CancelScope]:
    """A cancel scope whose deadline is set once entered: it only fires at a point where
    the task has to wait, so a ready group, or the end of the stream, is always seen,
    even with ``timeout=0``."""
    with trio.CancelScope() as scope:
        if timeout is not None:
            scope.deadline = trio.current_time() + timeout
        yield scope


# --------------------------------------------------------------------------- weight updates


class _BodyFailed(Exception):
    """Raised in the Trio thread into a held weight update whose body, running in another
    thread, raised: the update then resumes generation under the old epoch. Caught where
    it is raised; never seen outside this module."""


class _HeldUpdate:
    """``stream.weight_update(...)`` held open by a task of a Trio thread while its body
    runs in another thread (the sync bridge's caller, or a Ray rollout actor's caller).

    In the Trio thread: :meth:`hold` is the task (start it with :func:`_hold_in`),
    :meth:`request_exit` and :meth:`finish` end it. In any thread, once :attr:`finished`
    is set: :attr:`ended` and the errors say how it went.

    The task ends on every route: when the body's thread asks (:meth:`finish`), when it
    gives up (:meth:`request_exit` from ``run_sync_soon``, also while the update is still
    entering), and when the nursery it runs in is cancelled (the stream closes, or its
    pipeline fails). On all but a returned body, the update resumes generation under the
    old epoch, as the async context manager does when its body raises or is cancelled.
    """

    def __init__(
        self,
        open_update: Callable[[], contextlib.AbstractAsyncContextManager[WeightUpdate]],
        before_exit: Callable[[WeightUpdate], None] | None = None,
    ) -> None:
        self._open_update = open_update
        self._before_exit = before_exit
        self._scope = trio.CancelScope()
        self._entered = trio.Event()
        self._exit = trio.Event()
        self._done = trio.Event()
        self._body_failed = False
        self._leaving_normally = False
        #: Set by request_exit before the update began: it is given up, not entered.
        self.abandoned = False
        #: The update, once the body may begin.
        self.update: WeightUpdate | None = None
        #: Why the update could not begin (it never did); raise it as itself.
        self.enter_error: Exception | None = None
        #: What the exit of a returned body raised (a backend that failed to resume).
        self.exit_error: Exception | None = None
        #: Notes the update added on its way out of a failed body (resume failures).
        self.exit_notes: list[str] = []
        #: ``"new"``: the body returned and the epoch moved; ``"old"``: the body failed
        #: and generation resumed under the old epoch; ``None``: the update never began,
        #: or was cancelled (the stream closed or its pipeline failed; old epoch too).
        self.ended: str | None = None
        self.finished = threading.Event()

    async def hold(self) -> None:
        try:
            with self._scope:
                try:
                    async with self._open_update() as update:
                        self.update = update
                        self._entered.set()
                        await self._exit.wait()
                        if self._body_failed:
                            raise _BodyFailed
                        if self._before_exit is not None:
                            self._before_exit(update)
                        self._leaving_normally = True
                except _BodyFailed as marker:
                    self.ended = "old"
                    self.exit_notes = list(getattr(marker, "__notes__", ()))
                except Exception as exc:
                    if self.update is None:
                        self.enter_error = exc
                    else:
                        self.exit_error = exc
                        self.ended = "new" if self._leaving_normally else "old"
                else:
                    self.ended = "new"
        finally:
            self._entered.set()
            self._done.set()
            self.finished.set()

    async def wait_entered(self) -> None:
        await self._entered.wait()

    def request_exit(self, body_failed: bool) -> None:
        """End the update: under the new epoch, or the old one when ``body_failed``. An
        update that is still entering is given up (its waits are cancelled; old epoch).
        Trio thread; never blocks, and is harmless once the update has ended."""
        if self.update is None:
            self.abandoned = True
            self._scope.cancel()
        else:
            self._body_failed = self._body_failed or body_failed
        self._exit.set()

    async def finish(self, body_failed: bool) -> None:
        """:meth:`request_exit`, then wait until the task has ended (the backends have
        resumed)."""
        self.request_exit(body_failed)
        await self._done.wait()


async def _hold_in(nursery: trio.Nursery | None, held: _HeldUpdate) -> None:
    """Trio thread: start ``held``'s task in ``nursery`` and wait until the update has
    begun, failed to begin, or was given up. ``trio.ClosedResourceError`` when the
    nursery is closing: the pipeline is stopping, and its own news is what to raise."""
    if nursery is None or nursery.cancel_scope.cancel_called:
        raise trio.ClosedResourceError("the rollout pipeline is stopping")
    try:
        nursery.start_soon(held.hold)
    except RuntimeError:  # "Nursery is closed to new arrivals"
        raise trio.ClosedResourceError("the rollout pipeline is stopping") from None
    await held.wait_entered()
    if held.update is None and held.enter_error is None and not held.abandoned:
        raise trio.ClosedResourceError("the rollout pipeline is stopping")


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
        self._held: _HeldUpdate | None = None

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


class BlockingRolloutStream:
    """The groups of a pipeline running in a background Trio thread.

    Created by :func:`blocking_grouped_rollouts`; use it only inside its ``with`` block,
    from one thread. Iterating blocks per group and ends with the stream. Weight updates:
    ``with stream.weight_update(mode) as update: ...`` (:meth:`weight_update`) and
    :attr:`policy_epoch`.
    """

    def __init__(self, agent: GroupedRolloutGenerator, request: GroupedRolloutRequest) -> None:
        # Checks run here, in the caller's thread, before a thread is started.
        self._pipeline_cm = agent.get_grouped_rollouts(request)
        self._stream: RolloutStream | None = None
        # The stream once opened, kept after the block (policy_epoch stays readable).
        self._opened: RolloutStream | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop_scope: trio.CancelScope | None = None
        # Weight updates are held open by tasks of this nursery (see _HeldUpdate).
        self._nursery: trio.Nursery | None = None
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._failure_raised = False
        # Groups received for a take() that then timed out: handed out first next time.
        self._held: collections.deque[RolloutGroup] = collections.deque()
        self._thread = threading.Thread(
            target=self._run_trio, name=f"trio_rollouts:{type(agent).__name__}", daemon=True
        )

    # ---------------------------------------------------------------- the Trio thread

    def _run_trio(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # handed to the caller's thread
            self._failure = exc
        finally:
            self._started.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with self._pipeline_cm as stream:
            if isinstance(stream, RolloutStream):
                # A prompt is done when the caller gets its group (see _handed), not
                # when this thread takes it from the stream.
                settle_on_handover(stream)
            self._stream = self._opened = stream
            # Cancelling the nursery (leaving the block) ends the weight update its task
            # holds, under the old epoch, before the pipeline closes. A group of
            # Cancelled is passed on as one, as a plain body would raise it.
            with flatten_exception_groups():
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    self._stop_scope = nursery.cancel_scope
                    self._started.set()
                    await trio.sleep_forever()

    def _start(self) -> None:
        self._thread.start()
        self._started.wait()
        if self._failure is not None:
            # The pipeline failed before the block began: nothing to stop, only to join.
            self._thread.join()
            self._raise_failure()

    def _stop(self) -> None:
        scope, token = self._stop_scope, self._token
        if scope is not None and token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(scope.cancel, trio_token=token)
        self._thread.join()
        self._stream = None  # later calls get a clear error, not RunFinishedError

    def _raise_failure(self) -> None:
        if self._failure is not None and not self._failure_raised:
            self._failure_raised = True
            raise self._failure

    def _call(self, afn: Callable[[], Awaitable[T]]) -> T:
        """Run ``afn`` in the Trio thread; a dead pipeline raises its own exception."""
        self._raise_failure()
        if self._failure_raised or self._token is None:
            msg = "the rollout pipeline has stopped after an error (raised earlier)"
            raise RuntimeError(msg)
        try:
            return trio.from_thread.run(afn, trio_token=self._token)
        except (trio.RunFinishedError, trio.Cancelled, trio.ClosedResourceError) as exc:
            # The pipeline failed while we waited: its error, not ours, is the news.
            interrupted = exc
        # Raised outside the ``except`` block: raising the failure inside it would chain
        # it to ``interrupted`` ("During handling of the above exception, another
        # exception occurred"), which is only how the news arrived, and would overwrite
        # the ``__context__`` the failure had in the Trio thread.
        self._thread.join()
        self._raise_failure()
        raise interrupted

    # ---------------------------------------------------------------- the surface

    def get(self, timeout: float | None = None) -> RolloutGroup:
        """Block until the next group, and take it.

        Raises ``TimeoutError`` when ``timeout`` seconds pass first (nothing is lost: the
        group arrives on a later call), and ``trio.EndOfChannel`` when a non-streaming
        request's batch has been fully taken.
        """
        _check_timeout(timeout)
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
        _check_timeout(timeout)
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
        :class:`~trio_rollouts.PromptSource`). Caller's thread; the source is
        thread-safe and the pipeline's record of the group's draws is only popped."""
        stream = self._opened
        if isinstance(stream, RolloutStream):
            settle_handed(stream, group.batch_id, group.index_in_batch)
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
    ) -> tuple[_HeldUpdate, WeightUpdate]:
        stream = self._require_stream()
        before_exit = None
        if isinstance(stream, RolloutStream):  # not a merged Ray stream

            def before_exit(update: WeightUpdate) -> None:
                self._give_back_stale_kept(stream, update.epoch)

        held = _HeldUpdate(
            lambda: stream.weight_update(mode, epoch=epoch, backends=backends), before_exit
        )
        try:
            self._call(lambda: _hold_in(self._nursery, held))
        except BaseException:
            # The pipeline failed, or this thread was interrupted (KeyboardInterrupt)
            # while the update entered: it must not stay open.
            self._abandon(held)
            raise
        if held.enter_error is not None:
            raise held.enter_error
        if held.update is None:  # pragma: no cover - only an abandoned update has none
            msg = "the weight update was given up before it began"
            raise RuntimeError(msg)
        return held, held.update

    def _exit_update(self, held: _HeldUpdate, exc: BaseException | None) -> None:
        body_failed = exc is not None
        token = self._token
        if not held.finished.is_set() and token is not None:
            try:
                trio.from_thread.run(held.finish, body_failed, trio_token=token)
            except (trio.RunFinishedError, trio.Cancelled):
                pass  # the run ended, and the update with it: see below
            except BaseException:
                # Interrupted while the update exits (KeyboardInterrupt): it still ends,
                # under the old epoch if it had not got that far.
                self._abandon(held)
                raise
        if exc is not None:
            for note in held.exit_notes:
                exc.add_note(note)
            return  # the body's exception propagates; a pipeline failure stays pending
        if held.exit_error is not None:
            raise held.exit_error
        if held.ended is None:
            # The stream closed, or its pipeline failed, while the body ran.
            self._raise_lost()

    def _abandon(self, held: _HeldUpdate) -> None:
        """Ask the Trio thread to give ``held`` up (old epoch); never waits."""
        token = self._token
        if token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(held.request_exit, True)

    def _raise_lost(self) -> None:
        """A weight update ended under the old epoch because the pipeline stopped under
        it: raise the pipeline's failure, or say what happened."""
        self._thread.join()
        self._raise_failure()
        if self._failure_raised:
            msg = (
                "the rollout pipeline stopped after an error (raised earlier) while the "
                "weight update was open; it ended under the old epoch"
            )
        else:
            msg = "the stream closed while the weight update was open; it ended under the old epoch"
        raise RuntimeError(msg)

    # ---------------------------------------------------------------- kept groups and staleness
    #
    # take() takes groups as they arrive (taking is what frees generation capacity, so a
    # take of more groups than the pipeline may hold must take as it goes). When it times
    # out, the groups it took are kept in _held and handed out first by the next call. A
    # weight update can make a kept group too old for max_staleness; the stream's own
    # check saw it when it was fresh, so the bridge checks again as the update's body
    # returns (the only moment the epoch moves). A stale kept group is given back to the
    # pipeline: its take is undone in the books (_Pipeline.untake), then it is generated
    # again in its slot, exactly as the stream regenerates a group it finds too old.

    def _give_back_stale_kept(self, stream: RolloutStream, new_epoch: int) -> None:
        """Trio thread, as a weight update's body returns and before the epoch moves to
        ``new_epoch`` (the caller's thread waits in the update's exit)."""
        if staleness_bound(stream) is None or not self._held or is_closed(stream):
            return
        if not any(is_too_old(stream, group, new_epoch) for group in self._held):
            return
        if enforces_order(stream):
            # Kept groups come first in batch order: all go back to the front of the
            # stream, whose eviction at the update's exit regenerates the stale ones and
            # holds back the groups after them until their slots are filled again.
            kept = list(self._held)
            self._held.clear()
            put_back(stream, kept)
            return
        fresh: collections.deque[RolloutGroup] = collections.deque()
        stale: list[RolloutGroup] = []
        for group in self._held:
            (stale if is_too_old(stream, group, new_epoch) else fresh).append(group)
        self._held = fresh
        return_stale(stream, stale)

    def _require_stream(self) -> RolloutStream:
        self._raise_failure()
        if self._stream is None:
            msg = "use the stream inside its 'with blocking_grouped_rollouts(...)' block"
            raise RuntimeError(msg)
        return self._stream


StreamT = TypeVar("StreamT", bound=BlockingRolloutStream)


class _BlockingContext(Generic[StreamT]):
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
    return _BlockingContext(BlockingRolloutStream(agent, request))
