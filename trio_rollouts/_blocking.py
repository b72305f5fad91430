"""The sync bridge: a grouped pipeline driven from synchronous code (PyTorch-style trainers).

:func:`blocking_grouped_rollouts` runs Trio in a background thread for the duration of a
``with`` block. The pipeline lives in that thread; every call of the
:class:`BlockingRolloutStream` is one round trip into it through
``trio.from_thread``. An exception from the pipeline ends the Trio thread and is raised
in the caller's thread at its next call, and at the exit of the ``with`` at the latest,
as itself: its traceback, ``__cause__`` and ``__context__`` are the ones it had in the
Trio thread, never chained to the closed stream through which the news arrived.
Leaving the block cancels the pipeline and joins the thread.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
from collections.abc import Awaitable, Callable, Iterator
from types import TracebackType
from typing import Generic, TypeVar

import trio

from ._agents import GroupedRolloutGenerator
from ._models import GroupedRolloutRequest, RolloutGroup
from ._stream import RolloutStream, RolloutStreamStatistics

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


class BlockingRolloutStream:
    """The groups of a pipeline running in a background Trio thread.

    Created by :func:`blocking_grouped_rollouts`; use it only inside its ``with`` block,
    from one thread. Iterating blocks per group and ends with the stream.
    """

    def __init__(self, agent: GroupedRolloutGenerator, request: GroupedRolloutRequest) -> None:
        # Checks run here, in the caller's thread, before a thread is started.
        self._pipeline_cm = agent.get_grouped_rollouts(request)
        self._stream: RolloutStream | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop_scope: trio.CancelScope | None = None
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
            self._stream = stream
            with trio.CancelScope() as scope:
                self._stop_scope = scope
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
            return self._held.popleft()
        stream = self._require_stream()

        async def get_one() -> RolloutGroup | None:
            with _deadline_for_waiting(timeout):
                return await stream.receive()
            return None

        group = self._call(get_one)
        if group is None:
            msg = f"no rollout group arrived within {timeout} s"
            raise TimeoutError(msg)
        return group

    def take(self, n: int, timeout: float | None = None) -> list[RolloutGroup]:
        """Block until ``n`` groups are taken, and return them in stream order.

        Returns fewer only when the stream ends. Raises ``TimeoutError`` when ``timeout``
        seconds pass first; the groups received so far are kept and returned first by
        the next call, so nothing is lost.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            msg = f"take(n) needs an int n >= 0, got {n!r}"
            raise ValueError(msg)
        _check_timeout(timeout)
        groups: list[RolloutGroup] = []
        while self._held and len(groups) < n:
            groups.append(self._held.popleft())
        if len(groups) == n:
            return groups
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
        return groups

    def try_next(self) -> RolloutGroup | None:
        """Take a group that is ready now, or return ``None`` at once."""
        if self._held:
            return self._held.popleft()
        stream = self._require_stream()

        async def try_one() -> RolloutGroup | None:
            return stream.try_next()

        return self._call(try_one)

    def drain(self, n: int) -> list[RolloutGroup]:
        """Take up to ``n`` groups that are ready now; never waits for generation."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            msg = f"drain(n) needs an int n >= 0, got {n!r}"
            raise ValueError(msg)
        groups: list[RolloutGroup] = []
        while self._held and len(groups) < n:
            groups.append(self._held.popleft())
        if len(groups) == n:
            return groups
        stream = self._require_stream()
        wanted = n - len(groups)

        async def drain_ready() -> list[RolloutGroup]:
            return stream.drain(wanted)

        return groups + self._call(drain_ready)

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
