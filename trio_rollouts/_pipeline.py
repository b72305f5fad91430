"""The grouped rollout pipeline: its whole life, from checks to shutdown, in one module.

``open_grouped_rollouts(agent, request)`` is what
:meth:`GroupedRolloutGenerator.get_grouped_rollouts` returns: an async context manager
that runs a fixed set of worker tasks in a nursery and hands finished groups to a
:class:`~trio_rollouts.RolloutStream` through a bounded memory channel.

Vocabulary. ``G = num_groups``, ``P = parallel_generation_tasks``, ``B = buffer_size``,
``W = P // G``. A *slot* is a ``(batch_id, index_in_batch)`` pair; a *batch* is ``G``
slots sharing a ``batch_id``, numbered 0, 1, 2, ... in submission order.

Invariants (each one is a test):

1. Checks happen before any work: a bad request raises before a task starts.
2. A batch is *outstanding* from its submission until the consumer has *taken* its last
   group. At most ``W`` batches are outstanding (one in non-streaming mode), so at most
   ``W * G <= P`` slots exist that are not taken, and ``group_rollout`` calls in flight
   never exceed ``P``. New batches are submitted only when the consumer takes a batch's
   last group: a stalled consumer stalls generation, nothing runs ahead.
3. At most ``B`` finished groups wait in the channel's buffer; a worker holding a finished
   group beyond that waits in ``send``.
4. Filtering regenerates a group in its own slot, so ``batch_id`` and ``index_in_batch``
   are never reused or skipped. More than ``max_consecutive_filtered`` filtered groups in
   a row is an error, not an endless loop.
5. An exception in a worker cancels the nursery, which cancels every in-flight call and
   the consumer's body; it leaves the ``async with`` as itself when it is the only
   failure.
6. Leaving the ``async with`` by any route cancels the workers first, then closes the
   channels (synchronously, so closing cannot be interrupted); when ``__aexit__``
   returns, no task the pipeline started is alive.
7. The ledger: every started call ends delivered, filtered, retried, skipped, raised or
   cancelled, or is still in flight, waiting to be retried, or pending;
   ``statistics().unaccounted`` is 0 at every instant and after every exit. A counter
   counts what happened: a failure is retried when its next attempt starts.

Workers are a fixed set of tasks (``W * G`` of them): a task per group or per batch would
cost about twice the throughput in Trio. Idle workers park on a ``ParkingLot`` and are
woken when the consumer's take submits a new batch, so submission costs no task either.
Ordering (``enforce_order``) happens in the stream, where groups are taken.

Failures (see ``_failure.py``). Without filtering or mixing, a worker makes a slot's
first attempt itself (the *fast path*); everything else goes through
``accepted_group``. A first attempt runs outside stamina, which is entered only after a
transient failure. Its ``group_timeout`` is enforced by one watchdog task rather than by
a cancel scope per call: each worker runs inside a long-lived *timer* scope, notes when
its call started, and the watchdog cancels the timer of a call that comes due. The
worker then leaves that timer, books a :class:`GroupTimeoutError`, and goes on in a new
one. Retries, and attempts on the slow path, get a cancel scope each.
"""

from __future__ import annotations

import collections
import contextlib
import math
import warnings
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import stamina
import trio

from ._concurrency import describe_error, flatten_exception_groups, real_leaves
from ._draws import Draw, current_draws, finish, give_back
from ._failure import FailureBudgetExceededError, GroupTimeoutError
from ._models import GroupedRolloutRequest, Rollout, RolloutGroup, TokenRollout
from ._stream import RolloutStream
from .inference import Pausable
from .inference._interface import require_raw

if TYPE_CHECKING:
    from ._agents import GroupedRolloutGenerator

__all__ = ["FILTER_STD_THRESHOLD", "check_grouped_request", "open_grouped_rollouts"]

#: A group whose rewards have a population std at or below this is "all the same".
FILTER_STD_THRESHOLD = 1e-6
_ROLLOUT_TYPES = frozenset({Rollout, TokenRollout})
#: How many of the most recent errors statistics() reports.
LAST_ERRORS_KEPT = 5


def check_grouped_request(agent: GroupedRolloutGenerator, request: GroupedRolloutRequest) -> None:
    """Every check that must pass before any work starts (invariant 1)."""
    if not isinstance(request, GroupedRolloutRequest):
        msg = f"request must be a GroupedRolloutRequest, got {type(request).__name__}"
        raise TypeError(msg)
    require_raw(request.inference_interface, type(agent).__name__)
    groups = request.num_groups
    tasks = agent.parallel_generation_tasks
    if groups < 1:
        msg = f"num_groups must be >= 1, got {groups}"
        raise ValueError(msg)
    if request.rollouts_per_group < 1:
        msg = f"rollouts_per_group must be >= 1, got {request.rollouts_per_group}"
        raise ValueError(msg)
    if tasks < groups:
        msg = (
            f"parallel_generation_tasks ({tasks}) must be >= num_groups ({groups}): "
            f"one batch of {groups} groups must fit in flight"
        )
        raise ValueError(msg)
    if agent.buffer_size < 0:
        msg = f"buffer_size must be >= 0, got {agent.buffer_size}"
        raise ValueError(msg)
    if request.filter_groups_with_same_reward and request.rollouts_per_group < 2:
        msg = (
            "filter_groups_with_same_reward needs rollouts_per_group >= 2 (a group of one "
            f"rollout always has the same reward), got {request.rollouts_per_group}"
        )
        raise ValueError(msg)
    if tasks % groups:
        msg = (
            f"parallel_generation_tasks ({tasks}) is not a multiple of num_groups "
            f"({groups}); {tasks % groups} generation task(s) will be unused"
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _is_cancellation(exc: BaseException) -> bool:
    """``Cancelled``, or a group of nothing but (a nursery inside group_rollout)."""
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(trio.Cancelled)
        return rest is None
    return isinstance(exc, trio.Cancelled)


def _without_cancelled(exc: BaseException) -> BaseException:
    """``exc`` less its ``Cancelled`` leaves (which belong to a cancel scope that is
    gone once the worker leaves its timer); ``exc`` must hold another failure."""
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(trio.Cancelled)
        if rest is not None:
            return rest
    return exc


#: What a worker was doing when its timer was cancelled: the slot and the call's
#: failure (a GroupTimeoutError, or what the call raised as it was cancelled), not yet
#: booked; or ``None`` for a call that a weight update dropped (booked already), whose
#: slot is generated again.
_Resume = tuple[int, int, BaseException | None]


class _Dropped(BaseException):
    """A call that a weight update cancelled (restart, or the staleness bound), booked as
    restarted or stale: it carries the slot out of the worker's cancelled timer, to be
    generated again. Never leaves the worker."""

    def __init__(self, batch_id: int, index: int) -> None:
        super().__init__(batch_id, index)
        self.batch_id = batch_id
        self.index = index


class EnvironmentCounters:
    """Per-environment counters of a multi-task pipeline (see EnvironmentStatistics)."""

    __slots__ = ("delivered", "failed", "filtered", "started")

    def __init__(self) -> None:
        self.started = 0
        self.delivered = 0
        self.filtered = 0
        self.failed = 0


class _Pipeline:
    """The state shared by the workers and the stream. Only Trio tasks of one run touch
    it, so plain attributes need no lock: every update happens between checkpoints."""

    # Slots: attribute reads on the hot path are measurably faster than through a dict.
    __slots__ = (
        "agent",
        "blocked_senders",
        "call_draws",
        "call_epoch",
        "call_started",
        "cancelled",
        "closed",
        "coming_to_claim",
        "completed",
        "consecutive_filtered",
        "deadlines",
        "delivered",
        "done_on_take",
        "drop_reason",
        "env_counters",
        "env_of_slot",
        "epoch",
        "failed",
        "fast",
        "filtered",
        "filtering",
        "free_slots",
        "frozen_at",
        "gate_queue",
        "gate_waiters",
        "generate",
        "group_draws",
        "group_timeout",
        "groups_left_to_send",
        "idle_workers",
        "in_flight",
        "last_errors",
        "max_consecutive_filtered",
        "max_outstanding",
        "max_staleness",
        "may_retry",
        "mixed",
        "next_batch_id",
        "num_groups",
        "outstanding_batches",
        "park_when_idle",
        "policy",
        "policy_is_trivial",
        "prompts",
        "raised",
        "receive_channel",
        "request",
        "restarted",
        "result_epoch",
        "retries",
        "send_channel",
        "skipped",
        "skipping",
        "stale",
        "started",
        "streaming",
        "taken_in_batch",
        "thawed",
        "timed",
        "timeouts",
        "timers",
        "tracking",
        "unstamped_epochs",
        "untaken",
        "untaken_batches",
        "update_progress",
        "updating",
        "waiting_to_retry",
        "watchdog_nap",
        "watching",
        "weight_updates",
        "woken_senders",
    )

    def __init__(self, agent: GroupedRolloutGenerator, request: GroupedRolloutRequest) -> None:
        self.agent = agent
        self.request = request
        self.num_groups = request.num_groups
        self.streaming = request.streaming
        self.filtering = request.filter_groups_with_same_reward
        self.max_outstanding = agent.parallel_generation_tasks // request.num_groups
        self.max_consecutive_filtered = agent.max_consecutive_filtered
        self.generate = agent._slot_generator(request)
        # Agents that route slots to environments (multi-task) name each slot's
        # environment; the pipeline then keeps per-environment counters.
        self.env_of_slot = agent._slot_environment(request)
        self.env_counters: dict[str, EnvironmentCounters] = {}
        self.send_channel, self.receive_channel = trio.open_memory_channel[RolloutGroup](
            agent.buffer_size
        )
        self.free_slots: collections.deque[tuple[int, int]] = collections.deque()
        self.idle_workers = trio.lowlevel.ParkingLot()
        self.next_batch_id = 0
        self.outstanding_batches = 0
        self.taken_in_batch: dict[int, int] = {}
        # Batches whose completing take was undone (untake): their next completion
        # submits no batch.
        self.untaken_batches: set[int] = set()
        # Non-streaming: the worker that sends the batch's last group closes the channel.
        self.groups_left_to_send = request.num_groups
        self.consecutive_filtered = 0
        self.policy = agent.failure_policy
        self.policy_is_trivial = self.policy.is_trivial
        # Prompt sources (see _prompts.py): each call's draws are recorded, and settled
        # as done (taken, filtered) or given back (anything else). group_draws holds
        # the draws of accepted groups not taken yet, by slot; with done_on_take false
        # (the sync bridge) the consumer settles them when it hands a group over.
        self.prompts = agent.prompts
        self.tracking = agent._draws_prompts()
        self.group_draws: dict[tuple[int, int], list[Draw]] = {}
        self.done_on_take = True
        # The fast path: the first attempt inlined in the worker (see work).
        self.fast = not self.filtering and self.env_of_slot is None and not self.tracking
        self.group_timeout = self.policy.group_timeout
        self.may_retry = self.policy.max_attempts > 1
        self.skipping = self.policy.on_failure == "skip"
        # Deadlines of the fast path's first attempts: each worker's loop runs in a
        # timer (a cancel scope) that the watchdog cancels when the call it is making
        # has run for group_timeout; call_started holds when that call started (inf
        # when the worker is not making one).
        self.timed = self.fast and self.group_timeout is not None
        workers = self.worker_count()
        self.timers: list[trio.CancelScope] = [trio.CancelScope() for _ in range(workers)]
        self.call_started: list[float] = [math.inf] * workers
        # Weight updates (see _weight_update.py). ``epoch`` is the stream's policy epoch;
        # while ``updating``, no call starts (workers wait in wait_for_update).
        # call_epoch[n] is the epoch of worker n's call in flight (None when it makes
        # none); drop_reason[n] is set when an update cancels that call's timer to drop
        # it ("restart" or "stale"); result_epoch[n] is the epoch of its last call that
        # returned (the slow path's start_epoch).
        self.epoch = 0
        self.max_staleness = request.max_staleness
        self.updating = False
        # Whether calls that end must be reported to an update (``updating``, or calls
        # it dropped have not all exited).
        self.watching = False
        # Calls held by an update wait in gate_waiters; when it ends they start one at a
        # time in slot order (gate_queue), each releasing the next, so that the order in
        # which they reach the backend is fixed (a seeded backend gives the same
        # samples on every run of the same schedule).
        self.gate_waiters: list[tuple[tuple[int, int], trio.Event]] = []
        self.gate_queue: collections.deque[trio.Event] = collections.deque()
        self.update_progress = trio.lowlevel.ParkingLot()
        self.call_epoch: list[int | None] = [None] * workers
        self.drop_reason: list[str | None] = [None] * workers
        self.result_epoch: list[int] = [0] * workers
        self.call_draws: list[list[Draw]] = [[] for _ in range(workers)]
        # The epochs of keep/abort updates with a backend that does not stamp where the
        # epoch changed: a call that went on through one is counted in ``mixed``.
        self.unstamped_epochs: list[int] = []
        # While a keep/abort update holds calls, deadlines stand still: frozen_at is when
        # they stopped; deadlines maps each slow-path attempt's scope to its remaining
        # time while frozen.
        self.frozen_at: float | None = None
        self.thawed = trio.Event()
        self.deadlines: dict[trio.CancelScope, float] = {}
        self.watchdog_nap = trio.CancelScope()
        self.closed = False
        # With a staleness bound, a group found too old when it is taken is generated
        # again in its slot: workers must outlive a non-streaming batch's last send.
        self.park_when_idle = self.streaming or self.max_staleness is not None
        # Wake-up accounting (see wake_workers): workers that are runnable and will look
        # for a free slot before they next block.
        self.coming_to_claim = 0
        self.blocked_senders = 0
        self.woken_senders = 0
        # Counters for statistics(); see RolloutStreamStatistics for their meaning.
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
        self.weight_updates = 0
        # Accepted groups the consumer has not taken (buffered, in a sender's hands, handed
        # to a consumer that has not run yet, or reordering): the ledger's "pending".
        self.untaken = 0
        self.last_errors: collections.deque[str] = collections.deque(maxlen=LAST_ERRORS_KEPT)

    # ---------------------------------------------------------------- submission

    def submit_batch(self) -> None:
        batch_id = self.next_batch_id
        self.next_batch_id += 1
        self.outstanding_batches += 1
        self.free_slots.extend((batch_id, index) for index in range(self.num_groups))
        self.wake_workers()

    def wake_workers(self) -> None:
        """Unpark as many idle workers as there are free slots nobody is coming for.

        Waking a worker is the dominant per-group cost, so a slot that a runnable worker
        will claim anyway (one just woken from ``send``, or already unparked) wakes no
        one. Every worker calls this after claiming, so a shortfall heals itself.
        """
        needed = len(self.free_slots) - self.coming_to_claim
        if needed > 0:
            self.coming_to_claim += len(self.idle_workers.unpark(count=needed))

    def channel_received(self) -> None:
        """Called by the stream after each receive from the channel: a receive from a full
        buffer wakes one worker blocked in ``send``, and that worker will claim next."""
        if self.blocked_senders > self.woken_senders:
            self.woken_senders += 1
            self.coming_to_claim += 1

    def group_taken(self, group: RolloutGroup) -> None:
        """Called by the stream for every group it hands to the consumer (invariant 2)."""
        self.delivered += 1
        self.untaken -= 1
        if self.tracking and self.done_on_take:
            finish(self.group_draws.pop((group.batch_id, group.index_in_batch), []))
        if self.env_of_slot is not None:
            self.env_counters_of(group.batch_id, group.index_in_batch).delivered += 1
        if self.num_groups > 1:
            taken = self.taken_in_batch.get(group.batch_id, 0) + 1
            if taken < self.num_groups:
                self.taken_in_batch[group.batch_id] = taken
                return
            del self.taken_in_batch[group.batch_id]
        self.outstanding_batches -= 1
        if self.streaming:
            if self.untaken_batches and group.batch_id in self.untaken_batches:
                # Its first completion, which untake() undid, submitted the next batch.
                self.untaken_batches.discard(group.batch_id)
                return
            self.submit_batch()

    def untake(self, group: RolloutGroup) -> None:
        """Undo ``group_taken(group)``: the group is pending again, as if the stream had
        never handed it over (the sync bridge, for a group a timed-out ``take()`` kept
        and a weight update made too old). A batch whose completion is undone is
        outstanding again; its next completion submits no batch, since the first did."""
        self.delivered -= 1
        self.untaken += 1
        batch_id = group.batch_id
        if self.env_of_slot is not None:
            self.env_counters_of(batch_id, group.index_in_batch).delivered -= 1
        if self.num_groups > 1 and batch_id in self.taken_in_batch:
            left = self.taken_in_batch[batch_id] - 1
            if left:
                self.taken_in_batch[batch_id] = left
            else:
                del self.taken_in_batch[batch_id]
            return
        if self.num_groups > 1:
            self.taken_in_batch[batch_id] = self.num_groups - 1
        self.outstanding_batches += 1
        if self.streaming:
            self.untaken_batches.add(batch_id)

    # ---------------------------------------------------------------- weight updates

    async def wait_for_update(self, batch_id: int, index: int) -> None:
        """Hold the call of slot ``(batch_id, index)``, about to start, until the weight
        update is over (see ``open_gate``)."""
        while self.updating:
            released = trio.Event()
            self.gate_waiters.append(((batch_id, index), released))
            await released.wait()
            # Before this call starts (and runs to its first checkpoint), let the next
            # one go: it runs only once this one has yielded.
            self.release_next_call()

    def open_gate(self) -> None:
        """End an update's hold: the held calls start one by one, in slot order."""
        self.updating = False
        self.gate_waiters.sort(key=lambda waiter: waiter[0])
        self.gate_queue.extend(released for _, released in self.gate_waiters)
        self.gate_waiters.clear()
        self.release_next_call()

    def release_next_call(self) -> None:
        if self.gate_queue:
            self.gate_queue.popleft().set()

    def drop_calls(self, reason: str, older_than: int | None) -> int:
        """Cancel the calls in flight (those that started before epoch ``older_than``,
        or all of them when it is ``None``) to be generated again; return how many."""
        dropped = 0
        for number, epoch in enumerate(self.call_epoch):
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

    def call_ended_in_update(self, number: int) -> bool:
        """Worker ``number``'s call ended while an update waits for calls to end: wake
        the update, and book the call if the update dropped it (returns True)."""
        self.update_progress.unpark_all()
        reason = self.drop_reason[number]
        if reason is None:
            return False
        self.drop_reason[number] = None
        if reason == "restart":
            self.restarted += 1
        else:
            self.stale += 1
        if not self.updating and not self.dropping():
            self.watching = False  # an update cancelled before its body left drops
        return True

    def count_spanning(self, start_epoch: int) -> None:
        """A call that started under ``start_epoch`` returned under a later epoch: it went
        on through a keep/abort update. When a backend of such an update does not stamp
        where the epoch changed, its group is counted in ``mixed``."""
        if any(start_epoch < epoch <= self.epoch for epoch in self.unstamped_epochs):
            self.mixed += 1

    def calls_in_flight(self) -> list[int]:
        return [number for number, epoch in enumerate(self.call_epoch) if epoch is not None]

    def freeze_deadlines(self) -> None:
        """Stop the clocks of the calls in flight (a keep/abort update holds them)."""
        now = trio.current_time()
        self.frozen_at = now
        self.thawed = trio.Event()
        self.watchdog_nap.cancel()
        for scope in self.deadlines:
            self.deadlines[scope] = scope.deadline - now
            scope.deadline = math.inf

    def thaw_deadlines(self) -> None:
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

    def is_stale(self, group: RolloutGroup) -> bool:
        bound = self.max_staleness
        return bound is not None and self.epoch - group.start_epoch > bound

    def settle_handed(self, group: RolloutGroup) -> None:
        """A consumer that settles draws itself (``done_on_take`` false: the sync
        bridge) handed ``group`` over: its prompt draws are done. Thread-safe: one
        atomic pop."""
        self.settle_slot(group.batch_id, group.index_in_batch)

    def settle_slot(self, batch_id: int, index: int) -> None:
        """The group taken from slot ``(batch_id, index)`` reached its consumer (a Ray
        actor's driver): its prompt draws are done. Thread-safe; a slot settled twice
        or unknown is ignored."""
        if self.tracking:
            finish(self.group_draws.pop((batch_id, index), []))

    def regenerate_stale(self, group: RolloutGroup) -> None:
        """A finished group that is too old to hand over: drop it and generate its slot
        again, before any other free slot."""
        self.untaken -= 1
        self.stale += 1
        if self.tracking:
            give_back(self.group_draws.pop((group.batch_id, group.index_in_batch), []))
        self.free_slots.appendleft((group.batch_id, group.index_in_batch))
        self.wake_workers()

    # ---------------------------------------------------------------- workers

    async def worker(self, number: int) -> None:
        """Worker ``number``'s life: its loop runs inside its timer (see ``watchdog``),
        and starts again in a new timer each time the watchdog, or a weight update, has
        cancelled one."""
        resume: _Resume | None = None
        while True:
            timer = self.timers[number] = trio.CancelScope()
            try:
                with timer:
                    resume = await self.work(number, timer, resume)
            except _Dropped as dropped:
                # A weight update cancelled the call (restart, or the staleness bound):
                # the slot is generated again, after the update.
                resume = (dropped.batch_id, dropped.index, None)
                continue
            if resume is None:
                return

    async def work(
        self, number: int, timer: trio.CancelScope, resume: _Resume | None
    ) -> _Resume | None:
        """Claim slots, generate their groups and hand them over, until there is nothing
        left to claim (``None``) or ``timer`` was cancelled (what the worker was doing
        when it was, to be finished in a new timer)."""
        while True:
            if resume is not None:
                batch_id, index, late = resume
                resume = None
                if late is None:
                    # A call dropped by a weight update (booked as restarted or stale):
                    # its slot is generated again (by the general path), unless the
                    # pipeline is shutting down.
                    await trio.lowlevel.checkpoint_if_cancelled()
                    group = await self.accepted_group(batch_id, index, number)
                else:
                    # The pipeline may be shutting down: then the call ended in the
                    # shutdown (as a call under a cancel scope of its own would), not in
                    # a failure to retry, skip or raise. It is booked as cancelled while
                    # the checkpoint may yield, so that the ledger adds up meanwhile.
                    self.cancelled += 1
                    await trio.lowlevel.checkpoint_if_cancelled()
                    self.cancelled -= 1
                    self.call_raised(late, None)
                    group = await self.after_failure(batch_id, index, late, number)
            else:
                # A worker released from send during shutdown must not start a new call
                # (this does not yield unless cancelled).
                await trio.lowlevel.checkpoint_if_cancelled()
                if not self.free_slots:
                    if not self.park_when_idle:
                        return None
                    await self.idle_workers.park()
                    self.coming_to_claim -= 1
                    continue
                batch_id, index = self.free_slots.popleft()
                self.wake_workers()
                if not self.fast:
                    group = await self.accepted_group(batch_id, index, number)
                else:
                    # The common case (no filtering, one environment): the first attempt
                    # inlined, since every coroutine layer between the worker and
                    # group_rollout costs on each resume, and timed by the watchdog
                    # rather than by a cancel scope of its own, which costs more than
                    # the rest of a group's trip through the pipeline.
                    if self.updating:
                        await self.wait_for_update(batch_id, index)
                    epoch = self.epoch
                    self.started += 1
                    self.in_flight += 1
                    self.call_epoch[number] = epoch
                    if self.timed:
                        self.call_started[number] = trio.current_time()
                    failure: BaseException | None = None
                    try:
                        result = await self.generate(batch_id, index)
                    except BaseException as exc:
                        self.in_flight -= 1
                        self.call_epoch[number] = None
                        if self.timed:
                            self.call_started[number] = math.inf
                        if self.watching and self.call_ended_in_update(number):
                            return (batch_id, index, None)  # dropped by the update
                        if timer.cancel_called:
                            # The watchdog's deadline: leave the timer before anything
                            # that could checkpoint, and go on in a new one.
                            outcome = (
                                self.timeout_error(batch_id, index)
                                if _is_cancellation(exc)
                                else _without_cancelled(exc)
                            )
                            return (batch_id, index, outcome)
                        if not self.call_raised(exc, None):
                            raise  # cancelled at shutdown
                        failure = exc
                    else:
                        self.in_flight -= 1
                        self.call_epoch[number] = None
                        if self.watching and self.call_ended_in_update(number):
                            # Returned after the update cancelled it: dropped all the
                            # same.
                            if self.timed:
                                self.call_started[number] = math.inf
                            return (batch_id, index, None)
                        if self.timed and self.overdue(number, timer):
                            # Returned at or after its deadline: a timeout, as under a
                            # cancel scope of its own (see attempt).
                            failure = self.timeout_error(batch_id, index)
                            if timer.cancel_called:
                                return (batch_id, index, failure)
                            self.call_raised(failure, None)
                        else:
                            self.completed += 1
                            if epoch != self.epoch:
                                self.count_spanning(epoch)
                    if failure is None:
                        group = self.checked_group(result, batch_id, index, None, epoch)
                    else:
                        # Outside the except block, so that a later failure is not
                        # chained to this one.
                        group = await self.after_failure(batch_id, index, failure, number)
                        del failure
            self.untaken += 1
            if self.blocked_senders > self.woken_senders:
                full = True  # senders already wait: the buffer has no room
            else:
                # The buffer may have room: skip send's schedule point, a measurable share
                # of the per-group cost in Trio. The loop still cannot spin: it claims only
                # slots the consumer's takes submitted, and parks when there are none.
                try:
                    self.send_channel.send_nowait(group)
                    full = False
                except trio.WouldBlock:
                    full = True
            if full:
                self.blocked_senders += 1
                try:
                    await self.send_channel.send(group)
                except trio.Cancelled:
                    self.untaken -= 1
                    self.cancelled += 1  # a finished group nobody took
                    raise
                finally:
                    self.blocked_senders -= 1
                # Woken by a receive (counted in channel_received), not cancelled.
                self.woken_senders -= 1
                self.coming_to_claim -= 1
            if not self.park_when_idle:
                self.groups_left_to_send -= 1
                if self.groups_left_to_send == 0:
                    self.send_channel.close()

    def overdue(self, number: int, timer: trio.CancelScope) -> bool:
        """Whether worker ``number``'s call, which just returned, ran into its deadline
        (and end its timing)."""
        due = self.call_started[number] + self.group_timeout  # type: ignore[operator]
        self.call_started[number] = math.inf
        # While a keep/abort update holds calls, their clocks stand still.
        now = trio.current_time() if self.frozen_at is None else self.frozen_at
        return timer.cancel_called or now >= due

    async def watchdog(self) -> None:
        """Enforce ``group_timeout`` on the first attempts of the fast path: cancel the
        timer of every worker whose call has run for ``group_timeout`` seconds.

        A cancel scope per call would cost more than the rest of a group's trip through
        the pipeline; this costs a clock read per call and one scan of the workers per
        deadline that comes due (at least one per ``group_timeout`` seconds). A worker
        whose timer was cancelled leaves it at once and books the call as a
        :class:`GroupTimeoutError`, as ``attempt`` does under its own deadline.
        """
        timeout = self.group_timeout
        if timeout is None:  # pragma: no cover - started only with a deadline
            return
        started = self.call_started
        while True:
            if self.frozen_at is not None:
                # A keep/abort update holds the calls: their time does not count.
                await self.thawed.wait()
                continue
            now = trio.current_time()
            wake = now + timeout
            for number, start in enumerate(started):
                due = start + timeout
                if due <= now:
                    started[number] = math.inf
                    self.timers[number].cancel()
                elif due < wake:
                    wake = due
            with trio.CancelScope() as self.watchdog_nap:
                await trio.sleep_until(wake)

    async def after_failure(
        self, batch_id: int, index: int, failure: BaseException, number: int
    ) -> RolloutGroup:
        """The slow path of a slot whose first attempt failed (booked as failed already):
        retry it, skip it or raise, as the policy says."""
        if not isinstance(failure, Exception):
            self.raised += 1
            raise failure
        try:
            if not self.may_retry or not self.policy.is_transient(failure):
                raise failure
            result = await self.retried(failure, batch_id, index, None, number)
        except Exception as exc:
            if not self.skipping:
                self.raised += 1
                raise
            self.skip(exc, batch_id, index)
        else:
            return self.checked_group(result, batch_id, index, None, self.result_epoch[number])
        # A loop of instantly failing calls must stay cancellable.
        await trio.lowlevel.checkpoint()
        return await self.accepted_group(batch_id, index, number)

    def timeout_error(self, batch_id: int, index: int) -> GroupTimeoutError:
        msg = (
            f"{self.where(batch_id, index)} took longer than group_timeout="
            f"{self.group_timeout} s and was cancelled"
        )
        return GroupTimeoutError(msg)

    async def accepted_group(self, batch_id: int, index: int, number: int) -> RolloutGroup:
        """Generate the group of one slot: regenerate it while it is filtered or skipped,
        retry it while it fails transiently (see FailurePolicy)."""
        env = None if self.env_of_slot is None else self.env_counters_of(batch_id, index)
        while True:
            try:
                if self.policy_is_trivial:
                    result = await self.attempt(batch_id, index, env, number)
                else:
                    result = await self.attempts(batch_id, index, env, number)
            except Exception as exc:
                if not self.skipping:
                    self.raised += 1
                    raise
                self.skip(exc, batch_id, index)
                # A loop of instantly failing calls must stay cancellable.
                await trio.lowlevel.checkpoint()
                continue
            draws = self.call_draws[number] if self.tracking else None
            group = self.checked_group(
                result, batch_id, index, env, self.result_epoch[number], draws
            )
            if not self.filtering or group.reward_std() > FILTER_STD_THRESHOLD:
                self.consecutive_filtered = 0
                if draws:
                    self.group_draws[(batch_id, index)] = draws
                return group
            if draws:
                finish(draws)  # filtered: done for this epoch, not trained
            self.filtered += 1
            if env is not None:
                env.filtered += 1
            self.consecutive_filtered += 1
            if self.consecutive_filtered > self.max_consecutive_filtered:
                msg = (
                    f"{self.consecutive_filtered} groups in a row had identical rewards and "
                    f"were filtered (max_consecutive_filtered={self.max_consecutive_filtered}); "
                    f"last group: env_id={group[0].env_id!r}, problem_id="
                    f"{group[0].problem_id!r}, reward={float(group.rewards()[0])!r}. Every group "
                    "looks the same: check the reward function, or turn filtering off"
                )
                raise RuntimeError(msg)
            # A filtering loop over instant group_rollout calls must stay cancellable.
            await trio.lowlevel.checkpoint()

    async def attempt(
        self, batch_id: int, index: int, env: EnvironmentCounters | None, number: int
    ) -> object:
        """``untracked_attempt``, recording the call's prompt draws (in
        ``call_draws[number]``) when the agent draws prompts: they are given back unless
        the call returned."""
        if not self.tracking:
            return await self.untracked_attempt(batch_id, index, env, number)
        draws: list[Draw] = []
        token = current_draws.set(draws)
        try:
            result = await self.untracked_attempt(batch_id, index, env, number)
        except BaseException:
            give_back(draws)
            raise
        finally:
            current_draws.reset(token)
        self.call_draws[number] = draws
        return result

    async def untracked_attempt(
        self, batch_id: int, index: int, env: EnvironmentCounters | None, number: int
    ) -> object:
        """One ``group_rollout`` call by worker ``number``, under the group deadline if
        there is one; the epoch it started under is left in ``result_epoch[number]``.

        A failure is booked as failed; what becomes of it (retried, skipped, raised) is
        the caller's to book, except for a failure that is not an ``Exception`` (an
        exception group holding ``Cancelled`` beside an error, at shutdown), which can
        only propagate and is booked as raised here. A call that a weight update drops
        is booked as restarted or stale and raises :class:`_Dropped`.
        """
        if self.updating:
            await self.wait_for_update(batch_id, index)
        epoch = self.epoch
        self.started += 1
        self.in_flight += 1
        self.call_epoch[number] = epoch
        if env is not None:
            env.started += 1
        try:
            if self.group_timeout is None:
                result = await self.generate(batch_id, index)
            else:
                with trio.move_on_after(self.group_timeout) as deadline:
                    self.deadlines[deadline] = math.inf
                    try:
                        result = await self.generate(batch_id, index)
                    finally:
                        del self.deadlines[deadline]
                # A call still running at its deadline is cancelled, and one that
                # returns at or after it (running without a checkpoint) is late too.
                if deadline.cancelled_caught or trio.current_time() >= deadline.deadline:
                    raise self.timeout_error(batch_id, index)
        except BaseException as exc:
            self.in_flight -= 1
            self.call_epoch[number] = None
            if self.watching and self.call_ended_in_update(number):
                raise _Dropped(batch_id, index) from None
            if self.call_raised(exc, env) and not isinstance(exc, Exception):
                self.raised += 1
            raise
        self.in_flight -= 1
        self.call_epoch[number] = None
        if self.watching and self.call_ended_in_update(number):
            raise _Dropped(batch_id, index)
        self.completed += 1
        self.result_epoch[number] = epoch
        if epoch != self.epoch:
            self.count_spanning(epoch)
        return result

    async def attempts(
        self, batch_id: int, index: int, env: EnvironmentCounters | None, number: int
    ) -> object:
        """The attempts of one group until one succeeds or a failure is final.

        The first attempt runs outside stamina, so a group that succeeds at once costs
        no retry machinery; only a transient failure enters it (see ``retried``).
        """
        try:
            return await self.attempt(batch_id, index, env, number)
        except Exception as exc:
            if not self.may_retry or not self.policy.is_transient(exc):
                raise
            first = exc
        # Outside the except block, so that a later failure is not chained to the first.
        return await self.retried(first, batch_id, index, env, number)

    async def retried(
        self,
        first: Exception,
        batch_id: int,
        index: int,
        env: EnvironmentCounters | None,
        number: int,
    ) -> object:
        """Attempts 2, 3, ... of a group whose first attempt failed transiently with
        ``first``.

        ``first`` is replayed as stamina's first attempt, so stamina decides everything
        from there exactly as if it had made that attempt: whether to retry at all
        (``stamina.set_active``, ``stamina.set_testing``), the backoff and its jitter,
        its instrumentation hooks. A failure counts as retried only when the next
        attempt starts; while its backoff runs it is ``waiting_to_retry``, and if the
        pipeline shuts down then, ``cancelled``.
        """
        policy = self.policy
        self.waiting_to_retry += 1
        waiting = True
        try:
            async for attempt in stamina.retry_context(
                on=policy.is_transient,
                attempts=policy.max_attempts,
                timeout=None,
                wait_initial=policy.wait_initial,
                wait_max=policy.wait_max,
                wait_jitter=policy.wait_jitter,
            ):
                with attempt:
                    if attempt.num == 1:
                        raise first
                    waiting = False
                    self.waiting_to_retry -= 1
                    self.retries += 1
                    try:
                        return await self.attempt(batch_id, index, env, number)
                    except Exception:
                        waiting = True
                        self.waiting_to_retry += 1
                        raise
        except BaseException as exc:
            if waiting and not isinstance(exc, Exception):
                # Cancelled while waiting out the backoff: the slot is abandoned at
                # shutdown, as a call in flight would be.
                self.cancelled += 1
            raise
        finally:
            if waiting:
                self.waiting_to_retry -= 1
        msg = "stamina ended the attempts without a result or an error"  # pragma: no cover
        raise RuntimeError(msg)  # pragma: no cover

    def call_raised(self, exc: BaseException, env: EnvironmentCounters | None) -> bool:
        """Book a call that raised: cancelled at shutdown, or failed (returns True)."""
        if _is_cancellation(exc):
            self.cancelled += 1
            return False
        self.count_failure(exc, env)
        if isinstance(exc, GroupTimeoutError):
            self.timeouts += 1
        return True

    def checked_group(
        self,
        result: object,
        batch_id: int,
        index: int,
        env: EnvironmentCounters | None,
        start_epoch: int,
        draws: list[Draw] | None = None,
    ) -> RolloutGroup:
        """make_group (and check the call's prompt draws), booking a broken contract as
        a failed call."""
        try:
            group = self.make_group(result, batch_id, index, start_epoch)
            if draws is not None:
                self.check_draws(group, draws, batch_id, index)
            return group
        except Exception as exc:
            if draws:
                give_back(draws)
            self.count_failure(exc, env)
            self.raised += 1  # a broken contract is never retried or skipped
            raise

    def check_draws(
        self, group: RolloutGroup, draws: list[Draw], batch_id: int, index: int
    ) -> None:
        """A call draws one prompt (from an agent's ``prompts``), and its rollouts are
        about that problem."""
        if len(draws) > 1:
            ids = ", ".join(repr(problem_id) for _, _, problem_id in draws)
            msg = (
                f"{self.where(batch_id, index)} drew {len(draws)} prompts ({ids}); a call "
                "must draw exactly one (self.prompts.draw() once per group)"
            )
            raise ValueError(msg)
        if not draws:
            if self.prompts is not None:
                msg = (
                    f"{self.where(batch_id, index)} drew no prompt from its prompts "
                    "source; a call must draw exactly one (self.prompts.draw() once per "
                    "group)"
                )
                raise ValueError(msg)
            return
        problem_id = draws[0][2]
        for i, rollout in enumerate(group):
            if rollout.problem_id is not None and rollout.problem_id != problem_id:
                msg = (
                    f"{self.where(batch_id, index)} drew problem {problem_id!r}, but its "
                    f"rollout {i} has problem_id={rollout.problem_id!r}"
                )
                raise ValueError(msg)

    def count_failure(self, exc: BaseException, env: EnvironmentCounters | None) -> None:
        self.failed += 1
        if env is not None:
            env.failed += 1
        self.last_errors.append(describe_error(exc))

    def skip(self, exc: Exception, batch_id: int, index: int) -> None:
        """Give up on the slot's current group (on_failure="skip"); it is generated anew."""
        self.skipped += 1
        if self.skipped > self.policy.skip_budget:
            # The failure itself, not the exception groups of the agent's nurseries.
            leaves = real_leaves(exc)
            last = leaves[0] if len(leaves) == 1 else exc
            msg = (
                f"{self.skipped} groups failed and were skipped, more than skip_budget="
                f"{self.policy.skip_budget}; last error, at {self.where(batch_id, index)}: "
                f"{describe_error(exc)}"
            )
            raise FailureBudgetExceededError(msg, skipped=self.skipped, last_error=last) from last

    def make_group(
        self, result: object, batch_id: int, index: int, start_epoch: int
    ) -> RolloutGroup:
        """Check what ``group_rollout`` returned and wrap it in its slot's RolloutGroup."""
        rollouts = result.rollouts if isinstance(result, RolloutGroup) else result
        if type(rollouts) is not list:
            if not isinstance(rollouts, Sequence) or isinstance(rollouts, (str, bytes)):
                where = self.where(batch_id, index)
                msg = f"{where} must return a list of rollouts, got {result!r:.80}"
                raise TypeError(msg)
            rollouts = list(rollouts)
        if not rollouts:
            where = self.where(batch_id, index)
            msg = f"{where} returned an empty group; a group needs at least one rollout"
            raise ValueError(msg)
        if not self.filtering and set(map(type, rollouts)) <= _ROLLOUT_TYPES:
            return RolloutGroup._checked_by_caller(rollouts, batch_id, index, start_epoch)
        for i, rollout in enumerate(rollouts):
            if not isinstance(rollout, (Rollout, TokenRollout)):
                msg = (
                    f"{self.where(batch_id, index)} returned a group whose item {i} is a "
                    f"{type(rollout).__name__}, not a Rollout or TokenRollout"
                )
                raise TypeError(msg)
            if self.filtering:
                reward = rollout.reward if isinstance(rollout, Rollout) else rollout.scalar_reward
                if reward is None or not math.isfinite(reward):
                    msg = (
                        f"{self.where(batch_id, index)}: rollout {i} has reward {reward!r} "
                        f"(env_id={rollout.env_id!r}, problem_id={rollout.problem_id!r}); "
                        "filtering groups by reward needs finite float rewards"
                    )
                    raise ValueError(msg)
        return RolloutGroup._checked_by_caller(rollouts, batch_id, index, start_epoch)

    def where(self, batch_id: int, index: int) -> str:
        return f"{type(self.agent).__name__}.group_rollout (batch_id={batch_id}, index={index})"

    def env_counters_of(self, batch_id: int, index: int) -> EnvironmentCounters:
        env_id = self.env_of_slot(batch_id, index)  # type: ignore[misc]  # checked by callers
        counters = self.env_counters.get(env_id)
        if counters is None:
            counters = self.env_counters[env_id] = EnvironmentCounters()
        return counters

    def worker_count(self) -> int:
        return self.max_outstanding * self.num_groups if self.streaming else self.num_groups


@contextlib.asynccontextmanager
async def open_grouped_rollouts(
    agent: GroupedRolloutGenerator, request: GroupedRolloutRequest
) -> AsyncIterator[RolloutStream]:
    """Run the pipeline for the duration of an ``async with``; see the module docstring."""
    pipeline = _Pipeline(agent, request)
    stream = RolloutStream._from_pipeline(pipeline)
    interface = request.inference_interface
    if request.initial_epoch is None:
        pipeline.epoch = interface.policy_epoch if isinstance(interface, Pausable) else 0
    else:
        pipeline.epoch = request.initial_epoch
        if isinstance(interface, Pausable):
            await interface.resume(request.initial_epoch)
    consumer_errors: list[BaseException] = []  # the body's own exception is not flattened
    with flatten_exception_groups(consumer_errors), pipeline.send_channel, pipeline.receive_channel:
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(pipeline.max_outstanding if request.streaming else 1):
                    pipeline.submit_batch()
                for number in range(pipeline.worker_count()):
                    nursery.start_soon(pipeline.worker, number)
                if pipeline.timed:
                    nursery.start_soon(pipeline.watchdog)
                try:
                    yield stream
                except BaseException as exc:
                    consumer_errors.append(exc)
                    raise
                finally:
                    # Invariant 6: cancel the producers before the channels close.
                    nursery.cancel_scope.cancel()
        finally:
            pipeline.closed = True
            # Prompts of finished groups nobody took are drawn again.
            for draws in list(pipeline.group_draws.values()):
                give_back(draws)
            pipeline.group_draws.clear()
            # The ledger: finished groups nobody took end as cancelled at shutdown.
            discarded = stream._discard_untaken()
            pipeline.untaken -= discarded
            pipeline.cancelled += discarded
