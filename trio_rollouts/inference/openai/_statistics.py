"""What an :class:`~trio_rollouts.inference.OpenAIInference` counts: requests, choices
and retries per Trio run and over the interface's life (:class:`Counts`), and the
snapshot :meth:`~trio_rollouts.inference.OpenAIInference.statistics` returns
(:class:`OpenAIStatistics`, with :class:`RetryReason`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import attrs

from trio_rollouts.inference._errors import InferenceError
from trio_rollouts.inference.openai._config import display_url
from trio_rollouts.inference.openai._control import control_root
from trio_rollouts.inference.openai._negotiation import Capabilities

__all__ = ["Counts", "OpenAIStatistics", "RetryReason", "statistics_of"]


@attrs.frozen(kw_only=True)
class RetryReason:
    """Why requests were retried: ``count`` retries followed an error of the class named
    ``error`` (``"InferenceTimeoutError"``) whose message, without the request's method
    and URL, is ``message`` (at most 200 characters: ``"timed out: http://10.0.0.7:8000
    sent nothing for the read timeout of 600.0 s; ..."``)."""

    error: str
    message: str
    count: int


@attrs.frozen(kw_only=True)
class OpenAIStatistics:
    """Counters of one :class:`OpenAIInference`, per replica (in ``base_urls`` order,
    shown without credentials).

    Counted over the interface's life, every Trio run together (each sync
    :meth:`~OpenAIInference.generate` is a run of its own): requests sent (``attempts``,
    counting a request sent again without a refused field), the completions they asked
    for (``choices``: a group call's request for ``n`` choices is one attempt and ``n``
    choices, so ``choices`` above ``attempts`` shows groups sent as one request; a group
    sent as separate requests counts ``n`` of each), retries made across all replicas
    (``retries``), the calls that were retried at least once (``retried_requests``), and
    why (``retry_reasons``: one :class:`RetryReason` per error class and message, most
    frequent first); per replica, the retries after a request to it failed
    (``retries_by_replica``) and their error classes (``retry_errors_by_replica``: per
    replica, ``(class name, retries)`` pairs, most frequent first). These are retries of
    single requests (``max_retries``), not the pipeline's retries of whole groups under a
    ``FailurePolicy`` (``RolloutStream.statistics().retries``). A run's counts are added
    when it ends; while it runs,
    :meth:`~OpenAIInference.statistics` called in it includes them, one called in another
    thread does not yet. A pickled copy starts from zero.

    Of the current run only: requests in progress now (``in_flight``: placed on the
    replica and not answered yet, a request for ``n`` choices counting one; the load
    placement reads) and calls waiting for a weight update's
    :meth:`~OpenAIInference.resume` (``held``). What negotiation learned, per
    replica, over the interface's life: the request fields that replica refused and that
    are no longer sent to it (``dropped_fields``, sorted), ``n`` among them for a replica
    that refused ``n`` or answered one choice to it (its groups go as separate requests).
    """

    base_urls: tuple[str, ...]
    in_flight: tuple[int, ...]
    attempts: tuple[int, ...]
    retries: int
    dropped_fields: tuple[tuple[str, ...], ...] = ()
    held: int = 0
    retried_requests: int = 0
    retry_reasons: tuple[RetryReason, ...] = ()
    choices: tuple[int, ...] = ()
    retries_by_replica: tuple[int, ...] = ()
    retry_errors_by_replica: tuple[tuple[tuple[str, int], ...], ...] = ()


#: Distinct retry reasons kept; later new ones are counted as one "other" reason.
_MAX_RETRY_REASONS = 32
_REASON_LENGTH = 200


def _retry_reason(error: InferenceError) -> tuple[str, str]:
    """``(class name, message without "POST <url> [failed: ]")`` of an error retried."""
    message = str(error)
    if error.url is not None:
        _, found, rest = message.partition(f"{error.url} ")
        if found:
            message = rest.removeprefix("failed: ")
    return type(error).__name__, message[:_REASON_LENGTH]


@functools.lru_cache(maxsize=64)
def _url_prefixes(base_urls: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """``(URL prefix, replica)`` of each replica as errors show its requests' URLs: its
    ``base_url`` and its server root (vLLM's native and control routes), without
    credentials, longest first."""
    prefixes = [(display_url(url), index) for index, url in enumerate(base_urls)]
    prefixes += [(display_url(control_root(url)), index) for index, url in enumerate(base_urls)]
    return tuple(sorted(prefixes, key=lambda prefix: -len(prefix[0])))


def _replica_of(url: str | None, base_urls: tuple[str, ...]) -> int | None:
    """The replica a failed request's ``url`` (an error's) went to, or ``None``."""
    if len(base_urls) == 1:
        return 0
    if url is None:
        return None
    for prefix, index in _url_prefixes(base_urls):
        if url == prefix or (url.startswith(prefix) and url[len(prefix)] in "/?"):
            return index
    return None


class Counts:
    """Retries of one Trio run, or the counts of the runs that have ended (the interface's
    totals: runs end in any thread, hence the lock)."""

    def __init__(self, replicas: int) -> None:
        self._lock = threading.Lock()
        self.attempts = [0] * replicas
        self.choices = [0] * replicas
        self.retries = 0
        self.retried_requests = 0
        self.reasons: dict[tuple[str, str], int] = {}
        # Retries by the URL that failed and the error's class; statistics() finds the
        # replica of each URL (few: a replica's URLs are its routes).
        self.by_url: dict[tuple[str | None, str], int] = {}

    def count_retry(self, error: InferenceError, first: bool) -> None:
        self.retries += 1
        self.retried_requests += first
        reason = _retry_reason(error)
        if reason not in self.reasons and len(self.reasons) >= _MAX_RETRY_REASONS:
            reason = (reason[0], "(other messages)")
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        key = (error.url, reason[0])
        self.by_url[key] = self.by_url.get(key, 0) + 1

    def by_replica(self, base_urls: tuple[str, ...]) -> list[dict[str, int]]:
        """The retries of each replica of ``base_urls``, by error class."""
        counts: list[dict[str, int]] = [{} for _ in base_urls]
        for (url, error), count in self.by_url.items():
            index = _replica_of(url, base_urls)
            if index is not None:
                errors = counts[index]
                errors[error] = errors.get(error, 0) + count
        return counts

    def add(self, attempts: Sequence[int], choices: Sequence[int], other: Counts) -> None:
        """Add a run's ``attempts``, ``choices`` and retries (thread-safe)."""
        with self._lock:
            self.attempts = [a + b for a, b in zip(self.attempts, attempts, strict=True)]
            self.choices = [a + b for a, b in zip(self.choices, choices, strict=True)]
            self.retries += other.retries
            self.retried_requests += other.retried_requests
            for reason, count in other.reasons.items():
                self.reasons[reason] = self.reasons.get(reason, 0) + count
            for key, count in other.by_url.items():
                self.by_url[key] = self.by_url.get(key, 0) + count

    def copy(self) -> Counts:
        copy = Counts(len(self.attempts))
        with self._lock:
            copy.add(self.attempts, self.choices, self)
        return copy

    def __getstate__(self) -> dict[str, Any]:
        return {"replicas": len(self.attempts)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["replicas"])  # type: ignore[misc]


def statistics_of(
    base_urls: tuple[str, ...],
    shown_urls: tuple[str, ...],
    capabilities: Capabilities,
    totals: Counts,
    run: tuple[Sequence[int], Sequence[int], Counts] | None,
    in_flight: tuple[int, ...],
    held: int,
) -> OpenAIStatistics:
    """The snapshot of an interface: ``totals`` (the runs that ended) plus ``run`` (the
    current run's ``(attempts, choices, counts)`` when they are not added yet), what
    ``capabilities`` learned, and the current run's ``in_flight`` and ``held``."""
    dropped = tuple(
        tuple(sorted(fields if takes_n else fields | {"n"}))
        for fields, takes_n in zip(capabilities.dropped, capabilities.takes_n, strict=True)
    )
    counts = totals.copy()
    if run is not None:
        counts.add(*run)
    reasons = sorted(counts.reasons.items(), key=lambda item: (-item[1], item[0]))
    by_replica = counts.by_replica(base_urls)
    return OpenAIStatistics(
        base_urls=shown_urls,
        in_flight=in_flight,
        attempts=tuple(counts.attempts),
        retries=counts.retries,
        dropped_fields=dropped,
        held=held,
        retried_requests=counts.retried_requests,
        retry_reasons=tuple(
            RetryReason(error=error, message=message, count=count)
            for (error, message), count in reasons
        ),
        choices=tuple(counts.choices),
        retries_by_replica=tuple(sum(errors.values()) for errors in by_replica),
        retry_errors_by_replica=tuple(
            tuple(sorted(errors.items(), key=lambda item: (-item[1], item[0])))
            for errors in by_replica
        ),
    )
