"""The weight-update gate and the calls' deadlines: which calls may start, under which
policy epoch, which are dropped, and when each one's time is up.

One mechanism, because an update acts on all three: while it is open no call starts
(workers wait in :meth:`UpdateGate.wait`, and go one by one in slot order when it ends,
so a seeded backend samples alike on every run); it may drop calls in flight (a
``restart``, or the staleness bound) by cancelling the cancel scope their worker runs
in, the same *timer* the fast path's watchdog cancels at a deadline; and while a
``keep``/``abort`` update holds calls, their deadlines stand still.

Deadlines. The fast path's first attempts are timed by one watchdog task rather than by
a cancel scope per call (which would cost more than the rest of a group's trip through
the pipeline): each worker runs inside a long-lived timer, :meth:`UpdateGate.start_clock`
notes when its call started, and :meth:`UpdateGate.watchdog` cancels the timer of a call
that comes due. Retries, and attempts on the slow path, run under a ``move_on_after``
scope each, registered here so that a held update can stop its clock.

Ages. Every call notes when it started (:attr:`UpdateGate.call_since`, one clock read per
call, the one the watchdog's clock reuses), so that :meth:`UpdateGate.oldest_call_age`
tells a slow pipeline (calls finish, the oldest is young) from a hung one (the oldest
only ages): ``statistics().oldest_in_flight_s``.
"""

from __future__ import annotations

import collections
import contextvars
import enum
import math
from collections.abc import Sequence

import trio

__all__ = ["DropReason", "UpdateGate", "call_start_epoch", "exceeds_bound"]

#: The policy epoch the current ``group_rollout`` call started under (its group's
#: ``start_epoch``), set by the pipeline's worker before each call. Tasks an agent starts
#: inherit it, so an agent can stamp turns whose backend stamps no epoch (multi-turn
#: episodes). Unset outside the pipeline.
call_start_epoch: contextvars.ContextVar[int] = contextvars.ContextVar(
    "trio_rollouts_call_start_epoch"
)


def exceeds_bound(start_epoch: int, epoch: int, bound: int | None) -> bool:
    """Whether a group generated from ``start_epoch`` is older than ``max_staleness``
    (``bound``; ``None`` is no bound) at ``epoch``: the one place the bound is computed
    (invariant 9 of ``_pipeline.py``)."""
    return bound is not None and epoch - start_epoch > bound


class DropReason(enum.Enum):
    """Why a weight update cancelled a call in flight (its slot is generated again)."""

    #: A ``restart`` update cancels every call in flight.
    RESTART = "restart"
    #: The new epoch would make the call's group older than ``max_staleness``.
    STALE = "stale"


class UpdateGate:
    """The policy epoch, the gate that holds calls during an update, the calls in flight
    (per worker: the epoch each started under, and why an update dropped it) and their
    deadlines.

    Threads: the pipeline's Trio thread only (the sync bridge and Ray actors reach it
    through calls they run in that thread).
    """

    __slots__ = (
        "call_since",
        "call_started",
        "deadlines",
        "drop_reason",
        "epoch",
        "frozen_at",
        "max_staleness",
        "progress",
        "queue",
        "thawed",
        "timers",
        "unstamped_epochs",
        "updating",
        "waiters",
        "watchdog_nap",
        "watching",
    )

    def __init__(self, workers: int, epoch: int, max_staleness: int | None) -> None:
        #: The stream's policy epoch: calls that start now start under it.
        self.epoch = epoch
        self.max_staleness = max_staleness
        #: Whether an update's block is open: no call starts.
        self.updating = False
        #: Whether calls that end must be reported to an update (``updating``, or calls
        #: it dropped have not all exited).
        self.watching = False
        # Calls held by an update wait in ``waiters``; when it ends they start one at a
        # time in slot order (``queue``), each releasing the next.
        self.waiters: list[tuple[tuple[int, int], trio.Event]] = []
        self.queue: collections.deque[trio.Event] = collections.deque()
        #: Unparked whenever a call ends while an update watches.
        self.progress = trio.lowlevel.ParkingLot()
        # Per worker: why an update dropped its call in flight (None when it did not).
        # Which calls are in flight, and under which epoch each started, is the worker
        # loop's own record (``Pipeline.call_epoch``), which the update's methods take.
        self.drop_reason: list[DropReason | None] = [None] * workers
        # The epochs of keep/abort updates with a backend that does not stamp where the
        # epoch changed: a call that went on through one is counted in ``mixed``.
        self.unstamped_epochs: list[int] = []
        # Per worker: the cancel scope its loop runs in, and when its timed call started
        # (inf when it makes none).
        self.timers: list[trio.CancelScope] = [trio.CancelScope() for _ in range(workers)]
        self.call_started: list[float] = [math.inf] * workers
        #: Per worker: when its call in flight started (Trio's clock), held time included;
        #: left as it was when the call ends (``Pipeline.call_epoch`` says which workers
        #: make one). Written by the worker at each call's start.
        self.call_since: list[float] = [0.0] * workers
        # While a keep/abort update holds calls, deadlines stand still: frozen_at is when
        # they stopped; deadlines maps each slow-path attempt's scope to its remaining
        # time while frozen.
        self.frozen_at: float | None = None
        self.thawed = trio.Event()
        self.deadlines: dict[trio.CancelScope, float] = {}
        self.watchdog_nap = trio.CancelScope()

    # ---------------------------------------------------------------- calls

    def new_timer(self, number: int) -> trio.CancelScope:
        """A fresh timer for worker ``number``'s loop (the last one was cancelled)."""
        timer = self.timers[number] = trio.CancelScope()
        return timer

    def start_clock(self, number: int, now: float) -> None:
        """Worker ``number`` starts, ``now``, a call that the watchdog times."""
        self.call_started[number] = now

    def ended(self, number: int) -> DropReason | None:
        """Worker ``number``'s call ended (returned or raised) while an update watches
        (:attr:`watching`): why the update dropped it, or ``None``. Not a checkpoint."""
        self.progress.unpark_all()
        reason = self.drop_reason[number]
        if reason is None:
            return None
        self.drop_reason[number] = None
        if not self.updating and not self.dropping():
            self.watching = False  # an update cancelled before its body left drops
        return reason

    def spans_unstamped(self, start_epoch: int) -> bool:
        """A call that started under ``start_epoch`` returned under a later epoch: it went
        on through a keep/abort update. Whether such an update had a backend that does
        not stamp where the epoch changed (its group is counted in ``mixed``)."""
        return any(start_epoch < epoch <= self.epoch for epoch in self.unstamped_epochs)

    def too_old(self, start_epoch: int) -> bool:
        """Whether a group generated from ``start_epoch`` exceeds ``max_staleness`` now."""
        return exceeds_bound(start_epoch, self.epoch, self.max_staleness)

    def oldest_call_age(self, call_epoch: Sequence[int | None]) -> float:
        """Seconds since the oldest call in flight (``call_epoch``: each worker's, ``None``
        for a worker that makes none) started, time held by an update included; 0.0 when
        none is in flight. A scan of the workers: for statistics, not the hot path."""
        since = self.call_since
        oldest = math.inf
        for number, epoch in enumerate(call_epoch):
            if epoch is not None and since[number] < oldest:
                oldest = since[number]
        if oldest == math.inf:
            return 0.0
        try:
            now = trio.current_time()
        except RuntimeError:  # outside the Trio run (it has ended): nothing runs
            return 0.0
        return max(0.0, now - oldest)

    def calls_in_flight(self, call_epoch: Sequence[int | None]) -> int:
        """How many calls are in flight (``call_epoch``: each worker's, ``None`` for a
        worker that makes none) and not dropped."""
        return sum(
            1
            for epoch, reason in zip(call_epoch, self.drop_reason, strict=True)
            if epoch is not None and reason is None
        )

    # ---------------------------------------------------------------- the gate

    async def wait(self, slot: tuple[int, int]) -> None:
        """Hold the call of ``slot``, about to start, until the update is over.

        Cancellation: a cancellation point; a cancelled waiter starts no call.
        """
        while self.updating:
            released = trio.Event()
            self.waiters.append((slot, released))
            await released.wait()
            # Before this call starts (and runs to its first checkpoint), let the next
            # one go: it runs only once this one has yielded.
            self.release_next()

    async def wait_for_progress(self) -> None:
        """Wait until a call in flight ends (an update waits for drains and drops).

        Cancellation: a cancellation point.
        """
        await self.progress.park()

    def close(self) -> None:
        """An update begins: no call starts, and calls that end are reported."""
        self.updating = True
        self.watching = True

    def drop(
        self, reason: DropReason, older_than: int | None, call_epoch: Sequence[int | None]
    ) -> int:
        """Cancel the calls in flight (``call_epoch``: the epoch each worker's call
        started under, ``None`` for none) that started before epoch ``older_than``, or
        all of them when it is ``None``, to be generated again; return how many."""
        dropped = 0
        for number, epoch in enumerate(call_epoch):
            if epoch is None or self.drop_reason[number] is not None:
                continue
            if older_than is not None and epoch >= older_than:
                continue
            self.drop_reason[number] = reason
            self.timers[number].cancel()
            dropped += 1
        return dropped

    def dropping(self) -> bool:
        """Whether a call that an update dropped has not exited yet."""
        return any(reason is not None for reason in self.drop_reason)

    def advance(self, epoch: int, stamped: bool) -> None:
        """The update's body returned: calls start under ``epoch`` from now on.
        ``stamped`` is false for a keep/abort update with a backend that does not stamp
        where the epoch changed."""
        if not stamped:
            self.unstamped_epochs.append(epoch)
        self.epoch = epoch

    def open(self) -> None:
        """End an update (synchronous, so it cannot be interrupted): the deadlines' clocks
        go on, and the held calls start one by one, in slot order."""
        self.thaw()
        self.watching = self.dropping()
        self.updating = False
        self.waiters.sort(key=lambda waiter: waiter[0])
        self.queue.extend(released for _, released in self.waiters)
        self.waiters.clear()
        self.release_next()

    def release_next(self) -> None:
        if self.queue:
            self.queue.popleft().set()

    # ---------------------------------------------------------------- deadlines

    def register(self, scope: trio.CancelScope) -> None:
        """A slow-path attempt's deadline scope, to stand still while calls are held."""
        self.deadlines[scope] = math.inf

    def unregister(self, scope: trio.CancelScope) -> None:
        del self.deadlines[scope]

    def stop_clock(self, number: int) -> None:
        """Worker ``number``'s timed call ended: the watchdog no longer times it."""
        self.call_started[number] = math.inf

    def overdue(self, number: int, timer: trio.CancelScope, timeout: float) -> bool:
        """Whether worker ``number``'s timed call, which just returned, ran into its
        deadline (and stop timing it)."""
        due = self.call_started[number] + timeout
        self.call_started[number] = math.inf
        # While a keep/abort update holds calls, their clocks stand still.
        now = trio.current_time() if self.frozen_at is None else self.frozen_at
        return timer.cancel_called or now >= due

    def freeze(self) -> None:
        """Stop the clocks of the calls in flight (a keep/abort update holds them)."""
        now = trio.current_time()
        self.frozen_at = now
        self.thawed = trio.Event()
        self.watchdog_nap.cancel()
        for scope in self.deadlines:
            self.deadlines[scope] = scope.deadline - now
            scope.deadline = math.inf

    def thaw(self) -> None:
        """Start the clocks again, less the time they stood still."""
        if self.frozen_at is None:
            return
        now = trio.current_time()
        held = now - self.frozen_at
        self.frozen_at = None
        started = self.call_started
        for number, start in enumerate(started):
            if start != math.inf:
                started[number] = start + held
        for scope, remaining in self.deadlines.items():
            scope.deadline = now + remaining
        self.thawed.set()

    async def watchdog(self, limit: float | None) -> None:
        """Cancel the timer of every worker whose timed call has run for ``limit``
        seconds (the fast path's ``group_timeout``). Costs a clock read per call and one
        scan of the workers per deadline that comes due (at least one per ``limit``
        seconds).

        Cancellation: runs until cancelled (the pipeline's nursery, at shutdown).
        """
        if limit is None:  # pragma: no cover - started only with a deadline
            return
        started = self.call_started
        while True:
            if self.frozen_at is not None:
                # A keep/abort update holds the calls: their time does not count.
                await self.thawed.wait()
                continue
            now = trio.current_time()
            wake = now + limit
            for number, start in enumerate(started):
                due = start + limit
                if due <= now:
                    started[number] = math.inf
                    self.timers[number].cancel()
                elif due < wake:
                    wake = due
            with trio.CancelScope() as self.watchdog_nap:
                await trio.sleep_until(wake)
