"""Agents written for asyncio, run from Trio in an asyncio loop of their own on a worker
thread: :func:`run_in_asyncio`, :func:`written_for_asyncio`, for
:class:`~trio_rollouts.GatewayAgent`.

An asyncio harness (the OpenAI Agents SDK's ``Runner.run``, a verifiers environment, code
that calls ``asyncio.gather``) awaited in a Trio run fails with ``RuntimeError: no running
event loop``. :func:`run_in_asyncio` runs it in a fresh loop (:class:`asyncio.Runner`) on a
thread of its own and maps Trio cancellation onto asyncio's: the task is cancelled from the
Trio side (``loop.call_soon_threadsafe(task.cancel)``) and waited for, up to a bound, until
the loop has closed: its other tasks cancelled, its async generators closed, its default
executor's threads joined. So nothing the function started is still running when the call
returns. A function that has not ended within the bound (a sync call blocking the loop, a
task that swallows ``CancelledError``, an executor thread still at work) is reported with
:class:`AsyncioCancelTimeoutError`, which shows where its thread is, and the thread is
abandoned.
"""

from __future__ import annotations

import asyncio
import contextlib
import dis
import functools
import inspect
import sys
import threading
import traceback
import types
from collections.abc import Awaitable, Callable, Iterator
from typing import Final, Generic, TypeVar

import trio

__all__ = [
    "AsyncioCancelTimeoutError",
    "asyncio_error_hint",
    "run_in_asyncio",
    "written_for_asyncio",
]

T = TypeVar("T")

#: Frames of a stuck thread's stack that :class:`AsyncioCancelTimeoutError` shows.
_STACK_FRAMES: Final = 8
#: The modules whose use marks a function as written for Trio (trio-asyncio runs asyncio
#: code inside Trio, so a function that uses it is a Trio function).
_TRIO_MODULES: Final = ("trio", "trio_asyncio")


class AsyncioCancelTimeoutError(RuntimeError):
    """An asyncio function run by :func:`run_in_asyncio` (a
    :class:`~trio_rollouts.GatewayAgent` member with ``asyncio=True`` or detected) was
    cancelled and its loop had not ended ``asyncio_cancel_timeout`` seconds later: a sync
    call blocking the loop (``time.sleep``, a blocking HTTP client), a task that swallows
    ``CancelledError``, or a thread of the loop's executor still running. Its thread is
    abandoned, so what it runs may still finish. The message names the function and the
    bound and shows the thread's stack. Raised in place of ``trio.Cancelled``; not
    transient by default."""


# --------------------------------------------------------------------------- detection


def written_for_asyncio(function: Callable[..., object]) -> bool:
    """Whether ``function``'s own code uses asyncio and not Trio.

    Read are the names its bytecode loads as globals (in its module's namespace), the
    variables of its closure and the modules it imports, in its own code, in the functions
    and lambdas defined in it, and in the plain functions of its own module that it calls
    by name (recursively). Something from ``asyncio`` (the module, or an object defined in
    it such as ``asyncio.gather``) marks it as asyncio; something from ``trio`` or
    ``trio_asyncio`` as Trio. A callable whose code cannot be read (a builtin) is Trio.
    What libraries do inside is not seen: a function that only calls the Agents SDK's
    ``Runner.run`` reads as Trio (say ``asyncio=True``).

    ``ValueError`` when it uses both, naming the function: say which it is."""
    uses = _modules_used(function)
    if "asyncio" in uses and uses & set(_TRIO_MODULES):
        msg = (
            f"function {function!r:.80} uses both asyncio and Trio; say which it is "
            "written for: asyncio=True (its own asyncio loop on a worker thread) or "
            "asyncio=False (in this Trio run)"
        )
        raise ValueError(msg)
    return "asyncio" in uses


def _modules_used(function: Callable[..., object]) -> set[str]:
    """The top-level modules (``asyncio``, ``trio``, ...) ``function``'s code uses."""
    uses: set[str] = set()
    pending = [_python_function(function)]
    seen: set[int] = set()
    while pending:
        target = pending.pop()
        if target is None or id(target) in seen:
            continue
        seen.add(id(target))
        namespace = target.__globals__
        closure = dict(
            zip(
                target.__code__.co_freevars,
                (_cell_value(cell) for cell in target.__closure__ or ()),
                strict=True,
            )
        )
        for code in _codes(target.__code__):
            for instruction in dis.get_instructions(code):
                if instruction.opname == "IMPORT_NAME":
                    uses.add(str(instruction.argval).partition(".")[0])
                    continue
                if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                    found = namespace.get(str(instruction.argval))
                elif instruction.opname == "LOAD_DEREF" and code is target.__code__:
                    found = closure.get(str(instruction.argval))
                else:
                    continue
                module = _module_of(found)
                if module:
                    uses.add(module)
                if (
                    inspect.isfunction(found)
                    and found.__module__ == target.__module__
                    and id(found) not in seen
                ):
                    pending.append(found)
    return uses


def _python_function(function: object) -> types.FunctionType | None:
    """The Python function behind ``function`` (through decorators that set
    ``__wrapped__``, ``functools.partial``, bound methods and ``__call__``), or ``None``."""
    target = function
    for _ in range(16):  # a chain of wrappers; a cycle ends here
        if isinstance(target, functools.partial):
            target = target.func
        elif inspect.ismethod(target):
            target = target.__func__
        elif hasattr(target, "__wrapped__"):
            target = target.__wrapped__
        elif inspect.isfunction(target):
            return target
        else:
            # An object with a __call__ method (a class's own code is its __init__'s).
            call = None
            if not isinstance(target, type):
                call = inspect.getattr_static(type(target), "__call__", None)
            return call if inspect.isfunction(call) else None
    return None


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and the code objects defined in it (nested functions, lambdas,
    comprehensions), depth first."""
    yield code
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _codes(constant)


def _cell_value(cell: types.CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a variable not yet assigned)
        return None


def _module_of(value: object) -> str:
    """The top-level module ``value`` is or comes from (``""`` when none is known)."""
    if isinstance(value, types.ModuleType):
        name = value.__name__
    else:
        name = getattr(value, "__module__", None) or ""
        if not isinstance(name, str):
            return ""
    return name.partition(".")[0]


def asyncio_error_hint(error: BaseException) -> str | None:
    """A note for an error that an asyncio call raises under Trio (``no running event
    loop``, Trio's ``unrecognized yield message``), anywhere in ``error``'s groups; else
    ``None``."""
    if isinstance(error, BaseExceptionGroup):
        hints = (asyncio_error_hint(sub) for sub in error.exceptions)
        return next((hint for hint in hints if hint), None)
    text = str(error)
    if (isinstance(error, RuntimeError) and "no running event loop" in text) or (
        isinstance(error, TypeError) and "unrecognized yield message" in text
    ):
        return (
            "the function looks written for asyncio (an asyncio call found no asyncio "
            "loop in this Trio run): pass asyncio=True to run it in an asyncio loop of its "
            "own on a worker thread"
        )
    return None


# --------------------------------------------------------------------------- running


async def run_in_asyncio(
    function: Callable[[], Awaitable[T]], *, cancel_timeout: float, name: str
) -> T:
    """Await ``function()`` in an asyncio loop of its own (:class:`asyncio.Runner`) on a new
    worker thread named ``name``; return its value, or raise its error, once the loop has
    closed (its other tasks cancelled, its async generators closed, its default executor
    joined).

    Cancellation: the asyncio task is cancelled (``loop.call_soon_threadsafe(task.cancel)``;
    before the loop has started, ``function`` is never called), then this waits, shielded,
    up to ``cancel_timeout`` seconds for the loop to close, and raises ``trio.Cancelled``
    once it has: nothing ``function`` started runs after that. If the loop has not closed
    by then, :class:`AsyncioCancelTimeoutError` is raised instead and the thread is
    abandoned (a daemon thread: it does not keep the process alive)."""
    loop_thread: _LoopThread[T] = _LoopThread(function)
    token = trio.lowlevel.current_trio_token()
    ended = trio.Event()

    def deliver(result: object) -> None:  # in the worker thread, when it has ended
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(ended.set)

    # Not trio.to_thread.run_sync: its default limiter (40 threads) would queue members
    # beyond it behind the others, and a cancellation before its thread starts could not
    # be told from a loop that will not end.
    trio.lowlevel.start_thread_soon(loop_thread.run, deliver, name=name)
    try:
        await ended.wait()
    except BaseException:
        loop_thread.cancel()
        with trio.move_on_after(cancel_timeout, shield=True):
            await ended.wait()
        if not ended.is_set():
            msg = (
                f"the asyncio function in thread {name!r} ignored cancellation: its loop "
                f"was still running {cancel_timeout} s after its task was cancelled (a sync "
                "call blocking the loop, a task that swallows CancelledError, or an "
                "executor thread still at work), so its thread is abandoned and what it "
                "runs may still finish; give blocking calls a timeout shorter than "
                f"{cancel_timeout} s, let CancelledError propagate, or raise "
                f"asyncio_cancel_timeout. Where the thread is:\n{loop_thread.stack()}"
            )
            raise AsyncioCancelTimeoutError(msg) from None
        raise
    return loop_thread.result()


class _LoopThread(Generic[T]):
    """One function's asyncio loop, on the worker thread that calls :meth:`run`;
    :meth:`cancel` and :meth:`stack` may be called from any thread, :meth:`result` once
    :meth:`run` has returned."""

    def __init__(self, function: Callable[[], Awaitable[T]]) -> None:
        self._function = function
        self._lock = threading.Lock()
        self._cancelled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[T] | None = None
        self._thread_id: int | None = None
        self._value: T | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        """Run the function's loop to its end; keep its value or error."""
        self._thread_id = threading.get_ident()
        try:
            with asyncio.Runner() as runner:
                self._value = runner.run(self._main())
        except BaseException as error:  # re-raised in Trio by result()
            self._error = error

    async def _main(self) -> T:
        with self._lock:
            if self._cancelled:
                raise asyncio.CancelledError
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
        return await self._function()

    def cancel(self) -> None:
        """Cancel the function's task (before it has started: never start it)."""
        with self._lock:
            self._cancelled = True
            loop, task = self._loop, self._task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to cancel
                loop.call_soon_threadsafe(task.cancel)

    def result(self) -> T:
        if self._error is None:
            return self._value  # type: ignore[return-value]  # run() returned it
        error, self._error = self._error, None
        if isinstance(error, asyncio.CancelledError):
            msg = (
                "the asyncio function's task was cancelled, and not by Trio (asyncio code "
                "cancelled it): it returned no value"
            )
            raise RuntimeError(msg) from error
        raise error

    def stack(self) -> str:
        """The innermost frames of the worker thread's stack, as a traceback."""
        frame = sys._current_frames().get(self._thread_id or -1)
        if frame is None:
            return "  (the thread has no Python frame)"
        return "".join(traceback.format_stack(frame)[-_STACK_FRAMES:]).rstrip("\n")
