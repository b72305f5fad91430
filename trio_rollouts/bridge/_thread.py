"""Trio in a background thread, driven from other threads: the sync bridge's and the Ray
actor's machinery.

A :class:`TrioThread` runs ``trio.run`` in a thread of its own for the life of one async
context manager (a pipeline, or the Ray merge): :meth:`TrioThread.start` enters it there
and returns what it yields; :meth:`TrioThread.call` runs an async function in the Trio
thread and returns its result in the caller's thread, raising what it raised as itself;
:meth:`TrioThread.stop` cancels the run and joins the thread. A run that fails ends the
thread; the failure is kept (:attr:`TrioThread.failure`) and raised, as itself, by the
call that was waiting when it happened and by every later one: never chained to the
``trio.RunFinishedError`` or closed channel through which the news arrived.

A :class:`HeldContext` is an async context manager (a weight update) entered by a task of
the Trio thread and held open while its body runs in another thread:
:meth:`TrioThread.enter` returns once the body may begin, :meth:`TrioThread.exit` ends it.
Held contexts end on every route: when the body's thread exits them, when it gives up
(a ``KeyboardInterrupt`` while it waits: :meth:`TrioThread.abandon`), and when the run is
stopped or fails (the task holding it is cancelled). On every route but a returned body,
the context manager sees its body fail (an internal exception, or ``Cancelled``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Generic, NoReturn, TypeVar

import trio

from trio_rollouts._concurrency import flatten_exception_groups

__all__ = ["ContextGivenUp", "HeldContext", "TrioThread", "TrioThreadStopped"]

T = TypeVar("T")
V = TypeVar("V")


class TrioThreadStopped(RuntimeError):
    """The Trio thread is not running: it was never started, or it was stopped without
    a failure. (A run that failed raises its failure instead.)"""


class ContextGivenUp(RuntimeError):
    """A :class:`HeldContext` was given up (:meth:`TrioThread.abandon`, or ended from
    another thread) before its body could begin."""


class _BodyFailed(Exception):
    """Raised in the Trio thread into a held context whose body, running in another
    thread, raised. Caught where it is raised; never seen outside this module."""


class HeldContext(Generic[V]):
    """An async context manager held open by a task of a :class:`TrioThread` while its
    body runs in another thread.

    ``open_context`` makes the context manager (called in the Trio thread);
    ``before_exit``, if given, runs in the Trio thread when the body has returned, before
    the context manager exits. Once :attr:`finished` is set (any thread): :attr:`value`,
    :attr:`entered`, :attr:`abandoned`, :attr:`exited` and the errors say how it went.
    """

    def __init__(
        self,
        open_context: Callable[[], contextlib.AbstractAsyncContextManager[V]],
        before_exit: Callable[[V], None] | None = None,
    ) -> None:
        self._open_context = open_context
        self._before_exit = before_exit
        self._scope = trio.CancelScope()
        self._entered_event = trio.Event()
        self._exit = trio.Event()
        self._done = trio.Event()
        self._body_failed = False
        self._leaving_normally = False
        #: Whether the body may begin (``value`` is what the context manager yielded).
        self.entered = False
        self.value: V | None = None
        #: Given up before it began (see :meth:`request_exit`).
        self.abandoned = False
        #: Why the context could not be entered; raise it as itself.
        self.enter_error: Exception | None = None
        #: What the exit after a returned body raised.
        self.exit_error: Exception | None = None
        #: Notes the context manager added on its way out of a failed body.
        self.exit_notes: list[str] = []
        #: The context manager exited after its body (returned or failed); ``False`` when
        #: it never began, or when it was cancelled (the run stopped or failed).
        self.exited = False
        self.finished = threading.Event()

    async def hold(self) -> None:
        """The task (Trio thread): enter, wait for the body's end, exit."""
        try:
            with self._scope:
                try:
                    async with self._open_context() as value:
                        self.value = value
                        self.entered = True
                        self._entered_event.set()
                        await self._exit.wait()
                        if self._body_failed:
                            raise _BodyFailed
                        if self._before_exit is not None:
                            self._before_exit(value)
                        self._leaving_normally = True
                except _BodyFailed as marker:
                    self.exited = True
                    self.exit_notes = list(getattr(marker, "__notes__", ()))
                except Exception as exc:
                    if not self.entered:
                        self.enter_error = exc
                    else:
                        self.exit_error = exc
                        self.exited = True
                else:
                    self.exited = True
        finally:
            self._entered_event.set()
            self._done.set()
            self.finished.set()

    def request_exit(self, body_failed: bool) -> None:
        """End the context: the body returned, or failed when ``body_failed``. A context
        still being entered is given up (its waits are cancelled). Trio thread; never
        blocks, and is harmless once the context has ended."""
        if not self.entered:
            self.abandoned = True
            self._scope.cancel()
        else:
            self._body_failed = self._body_failed or body_failed
        self._exit.set()

    async def finish(self, body_failed: bool) -> None:
        """:meth:`request_exit`, then wait until the task has ended."""
        self.request_exit(body_failed)
        await self._done.wait()

    async def wait_entered(self) -> None:
        await self._entered_event.wait()


class TrioThread(Generic[T]):
    """``trio.run`` in a background thread named ``name``, for the life of one async
    context manager; see the module docstring.

    :meth:`start` and :meth:`stop` are for the thread that owns the runner; :meth:`call`,
    :meth:`enter`, :meth:`exit`, :meth:`abandon` and :meth:`run_sync_soon` may be called
    from any thread but the Trio thread, also concurrently.
    """

    def __init__(self, name: str) -> None:
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._resource: contextlib.AbstractAsyncContextManager[T] | None = None
        self._value: T | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop_scope: trio.CancelScope | None = None
        # Held contexts are held open by tasks of this nursery: stopping cancels them
        # before the resource exits.
        self._nursery: trio.Nursery | None = None
        self._stop_requested = False
        self._failure: BaseException | None = None
        self._failed_before_stop = False
        self._opened = threading.Event()  # the resource is entered, or the run ended
        self._stopped = threading.Event()  # the run has ended

    # ---------------------------------------------------------------- the Trio thread

    def _run(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # raised in the callers' threads
            self._failed_before_stop = not self._stop_requested
            self._failure = exc
        finally:
            self._stopped.set()
            self._opened.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        if self._resource is None:  # pragma: no cover - start() sets it first
            raise TrioThreadStopped("TrioThread.start() gave no resource")
        async with self._resource as value:
            self._value = value
            # A group of Cancelled is passed on as one, as a plain body would raise it.
            with flatten_exception_groups():
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    self._stop_scope = nursery.cancel_scope
                    # stop() sets the flag before it reads the scope; we set the scope
                    # before we read the flag: one of us sees the other.
                    if self._stop_requested:
                        nursery.cancel_scope.cancel()
                    self._opened.set()
                    await trio.sleep_forever()

    # ---------------------------------------------------------------- life

    def start(self, resource: contextlib.AbstractAsyncContextManager[T]) -> T:
        """Start the thread, enter ``resource`` in it, and return what it yields.

        Raises what entering raised, as itself (the thread has ended then).
        ``RuntimeError`` when called twice.
        """
        if self._resource is not None:
            msg = "TrioThread.start() was called twice"
            raise RuntimeError(msg)
        self._resource = resource
        self._thread.start()
        self._opened.wait()
        if self._stopped.is_set():
            self._raise_stopped()
        return self._value  # type: ignore[return-value]  # set before _opened

    def stop(self, timeout: float | None = None) -> bool:
        """Cancel the run (held contexts end first, then the resource exits) and wait up
        to ``timeout`` seconds for the thread to end; return whether it has ended.

        The cancel is scheduled, not waited for, so a loop blocked by code that ignores
        cancellation does not hold this past ``timeout``. Idempotent; any thread.
        """
        self._stop_requested = True
        scope = self._stop_scope
        if scope is not None:
            self.run_sync_soon(scope.cancel)
        if not self._thread.is_alive() and self._resource is None:
            return True  # never started
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def failure(self) -> BaseException | None:
        """What the run raised (``None`` while it runs, or when it ended cleanly)."""
        return self._failure

    @property
    def failed_before_stop(self) -> bool:
        """Whether the run failed on its own, before :meth:`stop` was called."""
        return self._failure is not None and self._failed_before_stop

    @property
    def stopped(self) -> bool:
        """Whether the run has ended."""
        return self._stopped.is_set()

    def wait_stopped(self) -> None:
        """Block until the run has ended (and the thread with it)."""
        self._stopped.wait()
        self._thread.join()

    def _raise_stopped(self) -> NoReturn:
        """The run has ended, or is ending: wait for it, then raise its failure as itself,
        or :class:`TrioThreadStopped`."""
        if self._resource is None:
            msg = "the Trio thread has not been started"
            raise TrioThreadStopped(msg)
        self.wait_stopped()
        if self._failure is not None:
            raise self._failure
        msg = "the Trio thread has stopped"
        raise TrioThreadStopped(msg)

    # ---------------------------------------------------------------- calls

    def call(self, afn: Callable[[], Awaitable[V]]) -> V:
        """Run ``afn`` in the Trio thread and return its result.

        What ``afn`` raises is raised here as itself. When the run ends before ``afn``
        returns (a failure, or :meth:`stop`), or has ended, this waits for the thread to
        end and raises the run's failure as itself, or :class:`TrioThreadStopped`.
        ``trio.ClosedResourceError`` from ``afn`` counts as the run ending (a stream that
        closes under a call is the pipeline stopping). A ``KeyboardInterrupt`` in this
        thread interrupts the wait, not ``afn``.
        """
        token = self._token
        if token is None or self._stopped.is_set():
            self._raise_stopped()
        try:
            return trio.from_thread.run(afn, trio_token=token)
        except (trio.RunFinishedError, trio.Cancelled, trio.ClosedResourceError):
            pass
        # Raised outside the ``except`` block: raising the failure inside it would chain it
        # to how the news arrived, and overwrite the ``__context__`` it had in the run.
        return self._raise_stopped()

    def run_sync_soon(self, fn: Callable[[], object]) -> None:
        """Schedule ``fn`` in the Trio thread; never waits; nothing if the run is over."""
        token = self._token
        if token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(fn)

    # ---------------------------------------------------------------- held contexts

    def enter(self, held: HeldContext[V]) -> V:
        """Enter ``held`` in a task of the Trio thread and return its value once its body
        may begin.

        Raises what entering raised, as itself; :class:`ContextGivenUp` when it was given
        up first; the run's failure (or :class:`TrioThreadStopped`) when the run ended.
        When this thread is interrupted while it waits (``KeyboardInterrupt``), the
        context is given up (:meth:`abandon`) and the interrupt propagates.
        """
        try:
            self.call(lambda: self._hold_in_nursery(held))
        except BaseException:
            self.abandon(held)
            raise
        if held.enter_error is not None:
            raise held.enter_error
        if not held.entered:
            msg = "the held context was given up before it began"
            raise ContextGivenUp(msg)
        return held.value  # type: ignore[return-value]  # set with entered

    async def _hold_in_nursery(self, held: HeldContext[V]) -> None:
        nursery = self._nursery
        if nursery is None or nursery.cancel_scope.cancel_called:
            raise trio.ClosedResourceError("the Trio thread is stopping")
        try:
            nursery.start_soon(held.hold)
        except RuntimeError:  # "Nursery is closed to new arrivals"
            raise trio.ClosedResourceError("the Trio thread is stopping") from None
        await held.wait_entered()
        if not held.entered and held.enter_error is None and not held.abandoned:
            # Cancelled while entering: the run is stopping or failing.
            raise trio.ClosedResourceError("the Trio thread is stopping")

    def exit(self, held: HeldContext[V], body_failed: bool) -> None:
        """End ``held`` (its body returned, or failed when ``body_failed``; a context still
        being entered is given up) and wait until its context manager has exited.

        Returns also when the run ended meanwhile (then ``held.exited`` is ``False``);
        read ``held``'s errors and notes after. When this thread is interrupted while it
        waits, the context is given up and the interrupt propagates.
        """
        token = self._token
        if held.finished.is_set() or token is None:
            return
        try:
            trio.from_thread.run(held.finish, body_failed, trio_token=token)
        except (trio.RunFinishedError, trio.Cancelled):
            pass  # the run ended, and the context with it
        except BaseException:
            self.abandon(held)
            raise

    def abandon(self, held: HeldContext[V]) -> None:
        """Ask the Trio thread to end ``held`` as after a failed body (give it up if it
        has not begun); never waits."""
        self.run_sync_soon(lambda: held.request_exit(True))
