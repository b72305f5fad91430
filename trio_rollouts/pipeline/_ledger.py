"""The ledger: every counter of a grouped pipeline, and the statistics built from them.

Invariant 7 (``docs/reference-design.md``): every started ``group_rollout`` call ends delivered,
filtered, retried, skipped, raised, cancelled, restarted or stale, or is still in flight,
waiting to be retried, or pending, so :attr:`RolloutStreamStatistics.unaccounted` is 0 at
every instant. The workers book what happens through :class:`Ledger`'s counters and
methods; :meth:`Ledger.statistics` takes the snapshot the stream returns.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import attrs

from trio_rollouts._concurrency import describe_error
from trio_rollouts.pipeline._failure import GroupTimeoutError

__all__ = [
    "LAST_ERRORS_KEPT",
    "EnvironmentCounters",
    "EnvironmentStatistics",
    "Ledger",
    "RolloutStreamStatistics",
]

#: How many of the most recent errors statistics() reports.
LAST_ERRORS_KEPT = 5


@attrs.frozen(kw_only=True)
class EnvironmentStatistics:
    """One environment's share of a multi-task pipeline's counters (same meanings as in
    :class:`RolloutStreamStatistics`)."""

    started: int
    delivered: int
    filtered: int
    failed: int


@attrs.frozen(kw_only=True)
class RolloutStreamStatistics:
    """A snapshot of a pipeline's counters, as :meth:`RolloutStream.statistics` returns.

    - ``started``: ``group_rollout`` calls started (regenerations included).
    - ``completed``: calls that returned a group.
    - ``filtered``: completed groups dropped by ``filter_groups_with_same_reward``.
    - ``delivered``: groups the consumer has taken.
    - ``in_flight``: calls running now (never more than ``parallel_generation_tasks``).
    - ``oldest_in_flight_s``: seconds since the oldest call running now started (Trio's
      clock; time held by a weight update included), 0.0 when none is: a pipeline whose
      calls are slow keeps it near their latency, a hung call makes it grow. Not a count
      (a Ray stream's merged statistics leave it 0.0; see ``per_actor``).
    - ``buffered``: finished groups waiting in the stream's buffer (at most
      ``buffer_size``).
    - ``reordering``: groups taken out of the buffer but held back by ``enforce_order``
      until their batch is next and complete.
    - ``failed``: calls that raised or broke the group contract (timeouts included;
      cancellations at shutdown are not failures).
    - ``retries``: failed calls that were retried in their slot, counted when the next
      attempt starts (never when a retry was merely expected).
    - ``waiting_to_retry``: failed calls whose slot waits out a backoff before the next
      attempt; each ends as retried, or, when no attempt follows, as skipped, raised or
      cancelled.
    - ``timeouts``: failed calls that ran past ``group_timeout``.
    - ``skipped``: failed calls whose group was given up (``on_failure="skip"``).
    - ``raised``: failed calls whose error left the pipeline (neither retried nor
      skipped).
    - ``cancelled``: calls cancelled in flight at shutdown, failed calls whose retry was
      cancelled at shutdown, and finished groups that nobody took before the stream
      closed.
    - ``pending``: finished groups not yet taken (buffered, waiting to enter the buffer,
      or reordering).
    - ``last_errors``: the most recent failures, as ``"Type: message"``.
    - ``outstanding_batches``: submitted batches whose last group is not yet taken.
    - ``per_env``: for agents that route groups to environments (``WeightedMultiTask``),
      the counters of each environment by ``env_id``; empty otherwise.
    - ``policy_epoch``: the stream's policy epoch (see :meth:`RolloutStream.weight_update`).
    - ``weight_updates``: weight updates whose body returned.
    - ``restarted``: calls cancelled by a ``restart`` update, their slots generated again.
    - ``stale``: calls cancelled by an update because they would exceed
      ``max_staleness``, and finished groups found too old when they were taken; their
      slots are generated again.
    - ``mixed``: groups whose generation spanned a keep/abort update on a backend that
      does not stamp where the epoch changed (not a ledger term).
    - ``cut``: members of groups cancelled by the library's agents and not kept: beyond
      ``rollouts_per_group`` with ``extra_rollouts``, or still running when their group
      reached the staleness bound (see ``RolloutGroup.cuts``; members, not calls, so
      not a ledger term).
    - ``wasted_tokens``: the tokens those cut members had generated, as far as their
      backends reported them (the embedded backend does; an HTTP server's cancelled
      request does not, and adds nothing).
    """

    started: int
    completed: int
    filtered: int
    delivered: int
    in_flight: int
    buffered: int
    reordering: int
    failed: int
    outstanding_batches: int
    retries: int = 0
    timeouts: int = 0
    skipped: int = 0
    raised: int = 0
    waiting_to_retry: int = 0
    cancelled: int = 0
    pending: int = 0
    last_errors: tuple[str, ...] = ()
    per_env: dict[str, EnvironmentStatistics] = attrs.field(factory=dict)
    policy_epoch: int = 0
    weight_updates: int = 0
    restarted: int = 0
    stale: int = 0
    mixed: int = 0
    cut: int = 0
    wasted_tokens: int = 0
    oldest_in_flight_s: float = 0.0

    @property
    def attempts(self) -> int:
        """How many ``group_rollout`` calls started (first attempts, retries and
        regenerations), the same count as ``started``."""
        return self.started

    @property
    def unaccounted(self) -> int:
        """The ledger's remainder, which is always 0 (every started call is delivered,
        filtered, retried, skipped, raised, cancelled, restarted, stale, still in flight,
        waiting to retry, or pending)."""
        return self.started - (
            self.delivered
            + self.filtered
            + self.retries
            + self.skipped
            + self.raised
            + self.cancelled
            + self.restarted
            + self.stale
            + self.in_flight
            + self.waiting_to_retry
            + self.pending
        )


class EnvironmentCounters:
    """Per-environment counters of a multi-task pipeline (see EnvironmentStatistics)."""

    __slots__ = ("delivered", "failed", "filtered", "started")

    def __init__(self) -> None:
        self.started = 0
        self.delivered = 0
        self.filtered = 0
        self.failed = 0


class Ledger:
    """The pipeline's counters (see :class:`RolloutStreamStatistics` for their meaning).

    The workers and the stream add to the counters directly (an attribute write is the
    cheapest book-keeping there is, and the hot path does it a few times per group);
    what takes more than one write has a method. ``pending`` is the ledger's name for
    accepted groups the consumer has not taken: buffered, in a sender's hands, handed
    to a consumer that has not run yet, or reordering.

    Threads: the pipeline's Trio thread only.
    """

    __slots__ = (
        "cancelled",
        "completed",
        "cut",
        "delivered",
        "env_counters",
        "env_of_slot",
        "failed",
        "filtered",
        "in_flight",
        "last_errors",
        "mixed",
        "pending",
        "raised",
        "restarted",
        "retries",
        "skipped",
        "stale",
        "started",
        "timeouts",
        "waiting_to_retry",
        "wasted_tokens",
        "weight_updates",
    )

    def __init__(self, env_of_slot: Callable[[int, int], str] | None) -> None:
        self.started = 0
        self.completed = 0
        self.filtered = 0
        self.delivered = 0
        self.in_flight = 0
        self.failed = 0
        self.retries = 0
        self.timeouts = 0
        self.skipped = 0
        self.raised = 0
        self.waiting_to_retry = 0
        self.cancelled = 0
        self.restarted = 0
        self.stale = 0
        self.mixed = 0
        self.cut = 0
        self.wasted_tokens = 0
        self.weight_updates = 0
        self.pending = 0
        self.last_errors: collections.deque[str] = collections.deque(maxlen=LAST_ERRORS_KEPT)
        # Agents that route slots to environments (multi-task) name each slot's
        # environment; the ledger then keeps per-environment counters.
        self.env_of_slot = env_of_slot
        self.env_counters: dict[str, EnvironmentCounters] = {}

    def env(self, batch_id: int, index: int) -> EnvironmentCounters | None:
        """The counters of the slot's environment (``None`` without environments)."""
        if self.env_of_slot is None:
            return None
        env_id = self.env_of_slot(batch_id, index)
        counters = self.env_counters.get(env_id)
        if counters is None:
            counters = self.env_counters[env_id] = EnvironmentCounters()
        return counters

    def failure(self, exc: BaseException, env: EnvironmentCounters | None) -> None:
        """A call failed (raised, timed out, or broke the group contract)."""
        self.failed += 1
        if env is not None:
            env.failed += 1
        if isinstance(exc, GroupTimeoutError):
            self.timeouts += 1
        self.last_errors.append(describe_error(exc))

    def taken(self, batch_id: int, index: int) -> None:
        """The consumer took the slot's group."""
        self.delivered += 1
        self.pending -= 1
        if self.env_of_slot is not None:
            self.env(batch_id, index).delivered += 1  # type: ignore[union-attr]

    def untaken(self, batch_id: int, index: int) -> None:
        """Undo :meth:`taken`: the group is pending again."""
        self.delivered -= 1
        self.pending += 1
        if self.env_of_slot is not None:
            self.env(batch_id, index).delivered -= 1  # type: ignore[union-attr]

    def discarded(self, count: int) -> None:
        """At shutdown: ``count`` finished groups nobody took end as cancelled."""
        self.pending -= count
        self.cancelled += count

    def statistics(
        self,
        *,
        buffered: int,
        reordering: int,
        outstanding_batches: int,
        policy_epoch: int,
        oldest_in_flight_s: float = 0.0,
    ) -> RolloutStreamStatistics:
        """A snapshot, with what the ledger does not keep itself."""
        return RolloutStreamStatistics(
            started=self.started,
            completed=self.completed,
            filtered=self.filtered,
            delivered=self.delivered,
            in_flight=self.in_flight,
            buffered=buffered,
            reordering=reordering,
            failed=self.failed,
            outstanding_batches=outstanding_batches,
            retries=self.retries,
            timeouts=self.timeouts,
            skipped=self.skipped,
            raised=self.raised,
            waiting_to_retry=self.waiting_to_retry,
            cancelled=self.cancelled,
            pending=self.pending,
            last_errors=tuple(self.last_errors),
            per_env={
                env_id: EnvironmentStatistics(
                    started=c.started, delivered=c.delivered, filtered=c.filtered, failed=c.failed
                )
                for env_id, c in self.env_counters.items()
            },
            policy_epoch=policy_epoch,
            weight_updates=self.weight_updates,
            restarted=self.restarted,
            stale=self.stale,
            mixed=self.mixed,
            cut=self.cut,
            wasted_tokens=self.wasted_tokens,
            oldest_in_flight_s=oldest_in_flight_s,
        )
