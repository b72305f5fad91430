"""Retrying HTTP calls: one mechanism, stamina, for generation requests and control calls.

:func:`call_with_retries` makes the first attempt outside stamina, so that a call that
succeeds at once (nearly all of them) costs no retry machinery; only a transient failure
(:data:`TRANSIENT_ERRORS`) enters ``stamina.retry_context``, replayed as its first attempt,
so stamina decides everything from there as if it had made it: whether to retry at all
(``stamina.set_active``, ``set_testing``), the backoff and its jitter, ``Retry-After``
(capped at :attr:`RetryBackoff.max_retry_after`), its instrumentation hooks. Waits are
``trio.sleep`` under Trio, so they are cancellable and follow a ``MockClock``.

Each retry is logged (:data:`logger`, ``trio_rollouts.inference._retry``, at ``WARNING``)
when it starts: the URL that failed (as errors show it, without credentials), the error,
the attempt and the backoff waited, and the pipeline group of the call when it runs in
one (the call context's ``group`` and ``episode``). stamina's own
``stamina.retry_scheduled`` line names none of these. These are retries of one request;
the pipeline's ``rollout/retries`` (``statistics().retries``) counts retries of whole
groups under a ``FailurePolicy``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import attrs
import stamina
import trio

from trio_rollouts._checks import non_negative_seconds
from trio_rollouts._context import current_call
from trio_rollouts.inference._errors import TRANSIENT_ERRORS, InferenceError

__all__ = ["RetryBackoff", "call_with_retries", "logger"]

T = TypeVar("T")

#: Where each retry is logged (see the module docstring).
logger = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class RetryBackoff:
    """How long to wait between attempts.

    Before retry ``n`` (1-based) the wait is ``min(maximum, initial * 2 ** (n - 1) +
    uniform(0, jitter))`` seconds (stamina's exponential backoff with jitter). When the
    failed response carries ``Retry-After`` (or ``retry-after-ms``), that wait is used
    instead, capped at ``max_retry_after``.
    """

    initial: float = attrs.field(default=0.5, validator=non_negative_seconds)
    maximum: float = attrs.field(default=8.0, validator=non_negative_seconds)
    jitter: float = attrs.field(default=1.0, validator=non_negative_seconds)
    max_retry_after: float = attrs.field(default=60.0, validator=non_negative_seconds)


def _retry_wait(backoff: RetryBackoff, exc: Exception) -> bool | float:
    """stamina's ``on`` hook: retry transient errors, after ``Retry-After`` when given."""
    if not isinstance(exc, TRANSIENT_ERRORS):
        return False
    if exc.retry_after is not None:
        return min(exc.retry_after, backoff.max_retry_after)
    return True


async def call_with_retries(
    attempt: Callable[[], Awaitable[T]],
    *,
    max_retries: int,
    backoff: RetryBackoff,
    on_retry: Callable[[InferenceError], object] | None = None,
) -> T:
    """``await attempt()``, and again after a transient failure, at most ``max_retries``
    more times, waiting as ``backoff`` says. ``on_retry`` is called before each retry with
    the error that caused it.

    Raises the last attempt's error; after more than one attempt, with a note counting
    them. Cancellation: cancellable at any point, including during a wait.
    """
    try:
        return await attempt()
    except TRANSIENT_ERRORS as exc:
        if max_retries == 0:
            raise
        first = exc
    # Outside the except block, so that a later failure is not chained to the first.
    return await _retried(first, attempt, max_retries, backoff, on_retry)


async def _retried(
    first: InferenceError,
    attempt: Callable[[], Awaitable[T]],
    max_retries: int,
    backoff: RetryBackoff,
    on_retry: Callable[[InferenceError], object] | None,
) -> T:
    """Attempts 2, 3, ... after a first attempt that failed transiently with ``first``,
    replayed as stamina's first attempt."""
    attempt_number = 0
    last = first
    failed_at = trio.current_time()
    try:
        async for trial in stamina.retry_context(
            on=functools.partial(_retry_wait, backoff),
            attempts=max_retries + 1,
            timeout=None,
            wait_initial=backoff.initial,
            wait_max=backoff.maximum,
            wait_jitter=backoff.jitter,
        ):
            with trial:
                attempt_number = trial.num
                if attempt_number == 1:
                    raise first
                if on_retry is not None:
                    on_retry(last)
                _log_retry(last, attempt_number, max_retries + 1, trio.current_time() - failed_at)
                try:
                    return await attempt()
                except InferenceError as exc:
                    last = exc
                    failed_at = trio.current_time()
                    raise
    except InferenceError as exc:
        if attempt_number > 1:
            exc.add_note(f"gave up after {attempt_number} attempts (max_retries={max_retries})")
        raise
    msg = "stamina.retry_context ended without an outcome"  # pragma: no cover
    raise RuntimeError(msg)  # pragma: no cover


def _log_retry(error: InferenceError, number: int, attempts: int, waited: float) -> None:
    """Log that attempt ``number`` (of at most ``attempts``) starts after ``error`` and a
    backoff of ``waited`` seconds, with the call's pipeline group when there is one."""
    if not logger.isEnabledFor(logging.WARNING):
        return
    context = current_call()
    group, episode = context.group, context.episode
    message = str(error)
    url = error.url
    # The URL once: request errors start with it ("POST http://... timed out: ...").
    to = f" to {url}" if url is not None and url not in message else ""
    where = ""
    batch_id = index = None
    if group is not None:
        _, batch_id, index = group
        where = f" for the group of batch_id={batch_id}, index={index}"
        if episode is not None:
            where += f" (episode {episode})"
    logger.warning(
        "retrying a request%s%s (attempt %d of %d, after %.2f s of backoff) after %s: %s",
        to,
        where,
        number,
        attempts,
        waited,
        type(error).__name__,
        message,
        extra={
            "url": url,
            "error_type": type(error).__name__,
            "attempt": number,
            "max_attempts": attempts,
            "backoff_s": waited,
            "batch_id": batch_id,
            "index_in_batch": index,
            "episode": episode,
        },
    )
