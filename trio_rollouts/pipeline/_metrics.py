"""Metrics a trainer logs: :meth:`RolloutStream.metrics`, deltas since the last call.

``statistics()`` is a snapshot of counters; a trainer logs, at each step, what happened
since the last one (prime-rl's ``time/wait_for_batch``, SkyRL's prefix-cache rate). The
pipeline keeps the few figures counters cannot give, cheaply, as they happen:

- the staleness of each group taken (``policy_epoch - start_epoch`` when it is taken):
  a count per staleness above 0, one comparison per group (groups taken at staleness 0
  are the rest);
- the time the consumer waited for a group (only when it had to wait: a full buffer is
  taken without a clock read);
- the time weight updates spent before their body (``WeightUpdate.pause_seconds``).

:class:`MetricsBook` turns those, the ledger and the inference backend's counters into
one flat ``dict[str, float]`` per call, for any logger. The event loop's lag is sampled
by a task started at the first call (nothing runs for metrics before anyone asks), every
:data:`LAG_PERIOD` seconds: how late a ``trio.sleep`` wakes, as percentiles per interval.

Threads: the pipeline's Trio thread only (the sync bridge reaches it through a call it
runs there).
"""

from __future__ import annotations

import os
import resource
import sys
from typing import TYPE_CHECKING, Final

import numpy as np
import trio

if TYPE_CHECKING:
    from trio_rollouts.pipeline._ledger import RolloutStreamStatistics

__all__ = ["LAG_PERIOD", "MetricsBook"]

#: How often the loop-lag probe sleeps and measures how late it wakes (seconds).
LAG_PERIOD: Final = 0.05
#: Lag samples kept per interval (the oldest are dropped past this: about 14 minutes).
_LAG_SAMPLES: Final = 16384

#: Ledger counters reported as deltas: (statistics field, metric name).
_COUNTERS: Final = (
    ("started", "rollout/groups_started"),
    ("completed", "rollout/groups_completed"),
    ("delivered", "rollout/groups_delivered"),
    ("filtered", "rollout/groups_filtered"),
    ("failed", "rollout/failed"),
    ("retries", "rollout/retries"),
    ("timeouts", "rollout/timeouts"),
    ("skipped", "rollout/skipped"),
    ("cancelled", "rollout/cancelled"),
    ("restarted", "rollout/restarted"),
    ("stale", "rollout/stale"),
    ("mixed", "rollout/mixed"),
    ("cut", "rollout/cut"),
    ("wasted_tokens", "rollout/wasted_tokens"),
    ("weight_updates", "rollout/weight_updates"),
)


def rss_bytes() -> int:
    """The process's resident set size now (Linux: ``/proc/self/statm``), else its peak
    (``getrusage``)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


class MetricsBook:
    """What :meth:`RolloutStream.metrics` reports, and the state between two calls.

    The pipeline writes :attr:`stale_counts`, :attr:`wait_seconds` and
    :attr:`pause_seconds` as things happen; :meth:`report` reads and resets them.
    """

    __slots__ = (
        "_backend_before",
        "_before",
        "_lag",
        "_lag_started",
        "_last",
        "_probe_scope",
        "pause_seconds",
        "stale_counts",
        "wait_seconds",
    )

    def __init__(self) -> None:
        #: Groups taken since the last report, by staleness (above 0 only).
        self.stale_counts: dict[int, int] = {}
        #: Seconds the consumer waited for a group since the last report.
        self.wait_seconds = 0.0
        #: Seconds weight updates spent before their body since the last report.
        self.pause_seconds = 0.0
        self._before: dict[str, int] = {}
        self._backend_before: dict[str, float] = {}
        self._last: float | None = None
        self._lag: list[float] = []
        self._lag_started = False
        self._probe_scope = trio.CancelScope()

    def opened(self) -> None:
        """The stream opened: the first interval starts now."""
        self._last = trio.current_time()

    def taken(self, staleness: int) -> None:
        """A group was taken ``staleness`` epochs old (called only when above 0)."""
        counts = self.stale_counts
        counts[staleness] = counts.get(staleness, 0) + 1

    def report(self, statistics: RolloutStreamStatistics, backend: object) -> dict[str, float]:
        """The metrics since the last report (see :meth:`RolloutStream.metrics`)."""
        now = trio.current_time()
        interval = now - (self._last if self._last is not None else now)
        self._last = now
        metrics: dict[str, float] = {"rollout/interval_s": interval}
        before = self._before
        for field, name in _COUNTERS:
            value = getattr(statistics, field)
            metrics[name] = float(value - before.get(field, 0))
            before[field] = value
        delivered = metrics["rollout/groups_delivered"]
        metrics["rollout/groups_per_s"] = delivered / interval if interval > 0 else 0.0
        metrics["rollout/in_flight"] = float(statistics.in_flight)
        metrics["rollout/oldest_in_flight_s"] = statistics.oldest_in_flight_s
        metrics["rollout/buffered"] = float(statistics.buffered + statistics.reordering)
        metrics["rollout/pending"] = float(statistics.pending)
        metrics["rollout/policy_epoch"] = float(statistics.policy_epoch)
        metrics.update(self._staleness(int(delivered)))
        metrics["rollout/wait_for_batch_s"] = self.wait_seconds
        metrics["rollout/weight_update_pause_s"] = self.pause_seconds
        self.wait_seconds = 0.0
        self.pause_seconds = 0.0
        metrics["process/rss_mb"] = rss_bytes() / 2**20
        metrics.update(self._loop_lag())
        metrics.update(self._backend(backend))
        return metrics

    def _staleness(self, delivered: int) -> dict[str, float]:
        """Mean, p50, p99 and max staleness of the groups taken in the interval."""
        counts = self.stale_counts
        self.stale_counts = {}
        zeros = delivered - sum(counts.values())
        if delivered <= 0:
            return {
                "rollout/staleness_mean": 0.0,
                "rollout/staleness_p50": 0.0,
                "rollout/staleness_p99": 0.0,
                "rollout/staleness_max": 0.0,
            }
        values = np.array([0, *sorted(counts)], dtype=np.float64)
        weights = np.array([max(zeros, 0), *(counts[k] for k in sorted(counts))])
        cumulative = np.cumsum(weights) / weights.sum()

        def quantile(q: float) -> float:
            return float(values[int(np.searchsorted(cumulative, q))])

        return {
            "rollout/staleness_mean": float((values * weights).sum() / weights.sum()),
            "rollout/staleness_p50": quantile(0.5),
            "rollout/staleness_p99": quantile(0.99),
            "rollout/staleness_max": float(max(counts, default=0)),
        }

    def _loop_lag(self) -> dict[str, float]:
        """The lag percentiles of the interval (none before the probe's first samples);
        the first call starts the probe."""
        if not self._lag_started:
            self._lag_started = True
            trio.lowlevel.spawn_system_task(self._probe, name="trio_rollouts loop-lag probe")
            return {}
        samples, self._lag = self._lag, []
        if not samples:
            return {}
        p50, p99 = np.percentile(samples, [50, 99])
        return {
            "loop/lag_p50_ms": float(p50) * 1e3,
            "loop/lag_p99_ms": float(p99) * 1e3,
            "loop/lag_max_ms": max(samples) * 1e3,
        }

    async def _probe(self) -> None:
        """System task: sleep :data:`LAG_PERIOD` and note how late it woke, until the
        stream closes (:meth:`closed`)."""
        with self._probe_scope:
            while True:
                due = trio.current_time() + LAG_PERIOD
                await trio.sleep_until(due)
                samples = self._lag
                if len(samples) >= _LAG_SAMPLES:
                    del samples[: len(samples) // 2]
                samples.append(max(0.0, trio.current_time() - due))

    def closed(self) -> None:
        """The stream closed: the probe stops (synchronous, for the pipeline's exit)."""
        self._probe_scope.cancel()

    def _backend(self, backend: object) -> dict[str, float]:
        """Per replica of the request's backend: the embedded engine model's counters
        (prefix-cache hit rate, tokens, preemptions, queues) or the HTTP client's
        (attempts, in flight, retries of single requests)."""
        values: dict[str, float] = {}
        engine_statistics = getattr(backend, "engine_statistics", None)
        if callable(engine_statistics):
            for i, stats in enumerate(engine_statistics()):
                prefix = f"inference/{i}"
                prompt = self._delta(f"{prefix}/prompt_tokens", stats.prompt_tokens)
                hits = self._delta(f"{prefix}/prefix_cache_hits", stats.prefix_cache_hits)
                values[f"{prefix}/prefix_cache_hit_rate"] = hits / prompt if prompt else 0.0
                values[f"{prefix}/stale_prefix_hits"] = self._delta(
                    f"{prefix}/stale_prefix_hits", stats.stale_prefix_hits
                )
                values[f"{prefix}/generation_tokens"] = self._delta(
                    f"{prefix}/generation_tokens", stats.generation_tokens
                )
                values[f"{prefix}/preemptions"] = self._delta(
                    f"{prefix}/preemptions", stats.preemptions
                )
                values[f"{prefix}/busy_s"] = self._delta(f"{prefix}/busy_s", stats.busy_seconds)
                values[f"{prefix}/running"] = float(stats.running)
                values[f"{prefix}/waiting"] = float(stats.waiting)
            return values
        statistics = getattr(backend, "statistics", None)
        if callable(statistics):
            stats = statistics()
            attempts = getattr(stats, "attempts", None)
            in_flight = getattr(stats, "in_flight", None)
            if isinstance(attempts, tuple) and isinstance(in_flight, tuple):
                for i, (sent, going) in enumerate(zip(attempts, in_flight, strict=False)):
                    prefix = f"inference/{i}"
                    values[f"{prefix}/requests"] = self._delta(f"{prefix}/requests", sent)
                    values[f"{prefix}/in_flight"] = float(going)
            values.update(self._client_retries(stats))
        return values

    def _client_retries(self, stats: object) -> dict[str, float]:
        """The HTTP client's retries of single requests since the last report, per
        replica (``inference/<i>/retries``) and by error class
        (``inference/<i>/retries/<ErrorClass>``): not the pipeline's retries of whole
        groups (``rollout/retries``)."""
        values: dict[str, float] = {}
        retries = getattr(stats, "retries_by_replica", None)
        errors = getattr(stats, "retry_errors_by_replica", None)
        if not isinstance(retries, tuple) or not isinstance(errors, tuple):
            return values
        for i, (count, by_error) in enumerate(zip(retries, errors, strict=False)):
            key = f"inference/{i}/retries"
            values[key] = self._delta(key, count)
            for error, times in by_error:
                key = f"inference/{i}/retries/{error}"
                values[key] = self._delta(key, times)
        return values

    def _delta(self, key: str, value: float) -> float:
        before = self._backend_before.get(key, 0.0)
        self._backend_before[key] = float(value)
        return float(value) - before
