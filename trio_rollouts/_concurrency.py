"""Small structured-concurrency building blocks shared by the agents and the pipeline.

Trio's strict exception groups nest one group per nursery. At the library's public
boundary we flatten them: the caller gets one failure as itself (so ``except ValueError``
works), with its traceback. When several failed at once (the same bug in every episode of
a group, every group of a batch), the first is raised, the others are named in a note on
it and kept with it (:func:`real_leaves` returns them too, so the failure policy still
classifies by all of them): one bug, one exception type, run after run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TypeVar

import trio

__all__ = [
    "describe_error",
    "first_of",
    "flatten_exception_groups",
    "gather",
    "gather_bounded",
    "real_leaves",
]

T = TypeVar("T")

#: The attribute where a failure raised for several keeps the others.
_ALSO = "_trio_rollouts_also"
#: How many of the other failures the note on the raised one names.
_NOTE_NAMES = 5


def real_leaves(exc: BaseException) -> list[BaseException]:
    """The failures inside ``exc``: the leaves of its exception groups, however deeply
    nested (``exc`` itself when it is not a group), and the failures raised with it at
    the same time (see :func:`flatten_exception_groups`), without ``trio.Cancelled``
    leaves, which are consequences of a failure or of a shutdown, never failures."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in real_leaves(sub)]
    if isinstance(exc, trio.Cancelled):
        return []
    also: tuple[BaseException, ...] = getattr(exc, _ALSO, ())
    return [exc, *(leaf for other in also for leaf in real_leaves(other))]


def first_of(failures: Sequence[BaseException]) -> BaseException:
    """``failures[0]``, with a note naming the others and the others kept with it."""
    first, others = failures[0], list(failures[1:])
    if others:
        names = "; ".join(_one(other) for other in others[:_NOTE_NAMES])
        more = f"; and {len(others) - _NOTE_NAMES} more" if len(others) > _NOTE_NAMES else ""
        first.add_note(f"{len(others)} other failure(s) at the same time: {names}{more}")
        setattr(first, _ALSO, (*getattr(first, _ALSO, ()), *others))
    return first


def describe_error(exc: BaseException) -> str:
    """``"Type: message"`` of the failure inside ``exc``; several failures are listed,
    so a wrapper such as ``ExceptionGroup: Exceptions from Trio nursery`` never hides
    what happened."""
    leaves = real_leaves(exc) or [exc]
    text = "; ".join(_one(leaf) for leaf in leaves)
    return text if len(leaves) == 1 else f"{len(leaves)} errors: {text}"


def _one(exc: BaseException) -> str:
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _leaves(
    group: BaseExceptionGroup[BaseException], keep: Sequence[BaseException]
) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        if not isinstance(exc, BaseExceptionGroup):
            out.append(exc)
        elif (kept := _kept_original(exc, keep)) is not None:
            out.append(kept)
        else:
            out.extend(_leaves(exc, keep))
    return out


def _kept_original(
    group: BaseExceptionGroup[BaseException], keep: Sequence[BaseException]
) -> BaseException | None:
    """The kept group that ``group`` is, or is a copy of (cancel scopes re-derive the
    groups they pass on, but keep the leaves)."""
    if not keep:
        return None
    leaves = {id(leaf) for leaf in _leaves(group, ())}
    for k in keep:
        if k is group or (
            isinstance(k, BaseExceptionGroup)
            and type(k) is type(group)
            and k.message == group.message
            and {id(leaf) for leaf in _leaves(k, ())} == leaves
        ):
            return k
    return None


def _collapse(
    group: BaseExceptionGroup[BaseException], keep: Sequence[BaseException]
) -> BaseException:
    leaves = _leaves(group, keep)
    if len(leaves) == 1:
        return leaves[0]
    # Cancelled leaves next to a real error are its consequence (the nursery cancelled
    # the siblings); the real error is what the caller must see.
    real = [exc for exc in leaves if not isinstance(exc, trio.Cancelled)]
    if len(real) == 1:
        return real[0]
    if not real:
        return leaves[0]
    # Several at once: the caller's own exception if there is one, else the first.
    own = [exc for exc in real if any(exc is k for k in keep)]
    return first_of([*own, *(exc for exc in real if exc not in own)])


@contextlib.contextmanager
def flatten_exception_groups(keep: Sequence[BaseException] = ()) -> Iterator[None]:
    """Re-raise an exception group as the one failure inside it.

    Several failures at once leave as the first (the caller's own, from ``keep``, before
    the library's), with the others named in a note and kept for :func:`real_leaves`.
    Groups in ``keep`` (compared by identity, read when the group arrives) are the
    caller's own exceptions and stay whole.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        collapsed = _collapse(group, keep)
        context = collapsed.__context__
        try:
            raise collapsed
        finally:
            # Raising inside ``except`` would make the envelope the failure's context.
            collapsed.__context__ = context
            del collapsed, group, context


async def gather(calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run ``calls`` concurrently in a nursery; return their results in call order.

    The first failure cancels the others and is raised as itself (see
    :func:`flatten_exception_groups`). Cancellation: cancelling the caller cancels every
    call, and this returns only after all of them have exited.
    """
    results: list[T | None] = [None] * len(calls)

    async def run(i: int, call: Callable[[], Awaitable[T]]) -> None:
        results[i] = await call()

    with flatten_exception_groups():
        async with trio.open_nursery() as nursery:
            for i, call in enumerate(calls):
                nursery.start_soon(run, i, call)
    return results  # type: ignore[return-value]  # every slot was filled


async def gather_bounded(calls: Sequence[Callable[[], Awaitable[T]]], limit: int) -> list[T]:
    """Run ``calls`` with at most ``limit`` running at once; return results in call order.

    A fixed set of ``min(limit, len(calls))`` worker tasks takes the calls in order (a task
    per call costs more in Trio and would hold every pending call's frame at once). The
    first failure cancels the rest and is raised as itself (see :func:`gather`).

    Cancellation: cancelling the caller cancels every call in flight; this returns only
    after all of them have exited.
    """
    results: list[T | None] = [None] * len(calls)
    pending = iter(enumerate(calls))

    async def worker() -> None:
        # Workers share one iterator: taking a call is synchronous, so each runs once.
        for i, call in pending:
            results[i] = await call()

    with flatten_exception_groups():
        async with trio.open_nursery() as nursery:
            for _ in range(min(limit, len(calls))):
                nursery.start_soon(worker)
    return results  # type: ignore[return-value]  # every slot was filled
