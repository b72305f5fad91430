"""The grouped rollout pipeline: its whole life, from checks to shutdown, in one module.

``open_grouped_rollouts(agent, request)`` is what
:meth:`GroupedRolloutGenerator.get_grouped_rollouts` returns: an async context manager
that runs a fixed set of worker tasks in a nursery and hands finished groups to a
:class:`~trio_rollouts.RolloutStream` through a bounded buffer. This module holds the
life: the checks, the workers' loop (claim a slot, call ``group_rollout``, book the
outcome, hand the group over) and the shutdown. Each mechanism it drives is a small
class in a module of its own that owns its state:

- ``_slots.py``, :class:`Slots`: free slots, outstanding batches, takes and take-backs,
  and which parked worker to wake (backpressure);
- ``_ledger.py``, :class:`Ledger`: the counters and ``statistics()``;
- ``_gate.py``, :class:`UpdateGate`: the policy epoch, the weight-update gate, the calls
  in flight and why an update dropped one (:class:`DropReason`), and the deadlines
  (the fast path's watchdog, frozen while an update holds calls);
- ``_draws.py``, :class:`DrawBook`: the prompt draws of accepted groups, settled once;
- ``_order.py``, :class:`BatchOrder`: ``enforce_order``;
- ``_handoff.py``, :class:`Handoff`: the buffer between the workers and the stream (a
  memory channel cut to what the pipeline uses), and who waits on it.

The stream (``_stream.py``) takes groups through :meth:`Pipeline.taken`, the update
block (``_weight_update.py``) drives the gate and :meth:`Pipeline.advance_epoch`, and the
sync bridge and the Ray actor reach all of it through the functions at the end of
``_stream.py``. Only this module's workers and those callers change the mechanisms'
state, and only through their methods (the ledger's counters excepted, which the hot
path adds to directly, as the ledger documents).

Vocabulary. ``G = num_groups``, ``P = parallel_generation_tasks``, ``B = buffer_size``,
``W = P // G``. A *slot* is a ``(batch_id, index_in_batch)`` pair; a *batch* is ``G``
slots sharing a ``batch_id``, numbered 0, 1, 2, ... in submission order.

Invariants (each one names tests that check it; files under ``tests/``):

1. Checks happen before any work: a bad request raises before a task starts.
   (``test_pipeline.py``: ``test_checks_run_before_any_work`` and the checks beside
   it.)
2. A batch is *outstanding* from its submission until the consumer has *taken* its last
   group. At most ``W`` batches are outstanding (one in non-streaming mode), so at most
   ``W * G <= P`` slots exist that are not taken, and ``group_rollout`` calls in flight
   never exceed ``P``. New batches are submitted only when the consumer takes a batch's
   last group: a stalled consumer stalls generation, nothing runs ahead.
   (``test_pipeline_properties.py``:
   ``test_calls_in_flight_outstanding_batches_and_buffer_stay_bounded``.)
3. At most ``B`` finished groups wait in the handoff's buffer; a worker holding a
   finished group beyond that waits until a take makes room. (The same property test.)
4. Filtering regenerates a group in its own slot, so ``batch_id`` and ``index_in_batch``
   are never reused or skipped. More than ``max_consecutive_filtered`` filtered groups in
   a row is an error, not an endless loop. (``test_pipeline.py``:
   ``test_filtering_with_enforce_order_keeps_batch_ids_and_finishes``,
   ``test_endless_identical_groups_hit_the_filter_bound``.)
5. An exception in a worker cancels the nursery, which cancels every in-flight call and
   the consumer's body; it leaves the ``async with`` as itself when it is the only
   failure. (``test_failure_groups.py``; ``test_pipeline.py``:
   ``test_an_exception_in_the_consumer_propagates_and_cancels_the_pipeline``.)
6. Leaving the ``async with`` by any route stops the workers first (those waiting with a
   group or parked are woken to return, the others cancelled), then closes the handoff
   (synchronously, so closing cannot be interrupted); when ``__aexit__`` returns, no
   task the pipeline started is alive. (``test_pipeline.py``:
   ``test_no_call_starts_once_shutdown_has_begun`` and the exit tests.)
7. The ledger: every started call ends delivered, filtered, retried, skipped, raised,
   cancelled, restarted or stale, or is still in flight, waiting to be retried, or
   pending; ``statistics().unaccounted`` is 0 at every instant and after every exit. A
   counter counts what happened: a failure is retried when its next attempt starts.
   (``test_failure.py``: ``test_the_ledger_adds_up_while_running_and_after_exit``;
   ``test_pipeline_properties.py``: ``test_statistics_count_exactly_what_happened``;
   ``test_weight_update_properties.py``:
   ``test_the_ledger_adds_up_while_timed_out_calls_shut_down``.)
8. Order: with ``enforce_order`` the consumer gets whole batches in ``batch_id`` order,
   groups by ``index_in_batch``, with no gap, whatever is regenerated (filtered, skipped,
   stale). (``test_pipeline_properties.py``:
   ``test_enforce_order_delivers_whole_batches_in_batch_order``;
   ``test_weight_update_properties.py``:
   ``test_enforce_order_stays_gap_free_through_weight_updates``,
   ``test_a_second_eviction_of_a_partly_released_batch_keeps_its_order``.)
9. Staleness: with ``max_staleness`` set, no group reaches a consumer whose
   ``start_epoch`` is more than ``max_staleness`` below the stream's policy epoch when it
   is taken: on the local stream, through the sync bridge (a group a timed-out ``take()``
   kept is checked again when an update's body returns) and on the Ray stream (groups
   waiting in the merge are checked when the consumer takes them). A call the new epoch
   makes too old is dropped (``stale``); a finished group found too old goes back to its
   own slot, generated again before any other. ``UpdateGate.too_old`` is the one place
   the bound is computed. (``test_weight_update.py``:
   ``test_a_staleness_bound_cancels_calls_that_would_exceed_it``,
   ``test_held_groups_are_taken_back_in_order_when_they_go_stale``;
   ``test_weight_update_properties.py``: ``test_weight_updates_keep_every_invariant``;
   ``test_blocking_weight_update.py``:
   ``test_a_kept_group_that_an_update_makes_too_old_is_generated_again_in_its_slot``;
   ``test_ray_staleness.py``:
   ``test_groups_waiting_in_the_merge_are_never_handed_out_beyond_the_bound``,
   ``test_groups_a_timed_out_take_kept_are_never_handed_out_beyond_the_bound``.)
10. The weight-update gate: while an update's block is open no ``group_rollout`` call
    starts; the body starts only once the calls in flight are settled for its mode and
    every Pausable backend has paused; when the block ends, held calls start one at a
    time in slot order; a ``keep``/``abort`` update's held time does not count against
    ``group_timeout``; every paused backend is resumed on every route (under the new
    epoch when the body returned, the old one otherwise), so nothing is left paused.
    (``test_weight_update.py``: ``test_held_calls_start_in_slot_order``,
    ``test_held_time_does_not_count_against_group_timeout``,
    ``test_a_failing_pause_resumes_everything_under_the_old_epoch``,
    ``test_an_update_cancelled_before_its_body_opens_the_gate``;
    ``test_weight_update_properties.py``: every property.)
11. Prompts, exactly once: a call's prompt draws are settled once, *done* when its group
    is taken (or, with the bridge and Ray, handed to the caller's consumer) or
    filtered, and *given back* (drawn again before any new problem) when the call
    fails, times out, is cancelled, restarted or dropped, when its group goes stale, and
    for finished groups nobody took at shutdown. (``test_prompts.py``:
    ``test_every_prompt_of_every_epoch_is_done_once_across_kills``,
    ``test_restarted_and_stale_calls_give_their_problems_back``,
    ``test_a_run_killed_by_sigkill_and_restarted_takes_each_prompt_once``;
    ``test_ray_prompts.py``.)
12. Take-back: a group handed out and then taken back (:meth:`Pipeline.untake`: the sync
    bridge's kept groups, the Ray merge's stale ones) is booked as if it had never been
    taken: pending again, its batch outstanding again (whose next completion submits no
    second batch), and it is handed out again or regenerated in its own slot.
    (``test_ray_give_back.py``:
    ``test_a_stale_group_given_back_with_enforce_order_comes_again_in_its_place``,
    ``test_a_stale_group_given_back_is_generated_again_in_its_slot_first``;
    ``test_blocking_weight_update.py``:
    ``test_stale_kept_groups_of_completed_batches_keep_the_stream_gap_free``,
    ``test_stale_kept_groups_after_a_returned_group_of_their_batch_stay_in_order``,
    ``test_stale_kept_groups_of_one_group_batches``.)

Workers are a fixed set of tasks (``W * G`` of them): a task per group or per batch would
cost about twice the throughput in Trio. Idle workers park (``Slots.park``) and are woken
when the consumer's take submits a new batch, so submission costs no task either.

Failures (see ``_failure.py``). Without filtering, mixing or prompt sources, a worker
makes a slot's first attempt itself (the *fast path*); everything else goes through
``accepted_group``. A first attempt runs outside stamina, which is entered only after a
transient failure. Its ``group_timeout`` is enforced by the gate's watchdog rather than
by a cancel scope per call: each worker runs inside a long-lived *timer* scope, and the
watchdog cancels the timer of a call that comes due. The worker then leaves that timer,
books a :class:`GroupTimeoutError`, and goes on in a new one. Retries, and attempts on
the slow path, get a cancel scope each.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import attrs
import stamina
import trio
from trio.lowlevel import wait_task_rescheduled

from trio_rollouts._concurrency import describe_error, flatten_exception_groups, real_leaves
from trio_rollouts.inference import Pausable
from trio_rollouts.inference._interface import require_raw
from trio_rollouts.inference._placement import call_group
from trio_rollouts.models._records import (
    Cut,
    GroupedRolloutRequest,
    Rollout,
    RolloutGroup,
    TokenRollout,
)
from trio_rollouts.models._records import checked_group as prechecked_group
from trio_rollouts.pipeline._admission import Admission
from trio_rollouts.pipeline._cuts import GroupCall, current_group_call
from trio_rollouts.pipeline._epochs import DropReason, UpdateGate, call_start_epoch
from trio_rollouts.pipeline._failure import (
    FailureBudgetExceededError,
    GroupTimeoutError,
    log_skipped,
)
from trio_rollouts.pipeline._handoff import Handoff
from trio_rollouts.pipeline._ledger import EnvironmentCounters, Ledger
from trio_rollouts.pipeline._metrics import MetricsBook
from trio_rollouts.pipeline._order import BatchOrder
from trio_rollouts.pipeline._sampling import call_attempt, call_slot, check_sampling
from trio_rollouts.pipeline._slots import Slots
from trio_rollouts.pipeline._stream import RolloutStream, discard_untaken, open_stream
from trio_rollouts.pipeline._tracing import SampleSpans, traced
from trio_rollouts.pipeline._tracing import state as tracing
from trio_rollouts.pipeline._weight_update import warn_epoch_ahead
from trio_rollouts.prompts._draws import Draw, DrawBook, current_draws, finish, give_back

if TYPE_CHECKING:
    from trio_rollouts.agents._base import GroupedRolloutGenerator

__all__ = [
    "FILTER_STD_THRESHOLD",
    "Pipeline",
    "SlotHooks",
    "check_grouped_request",
    "open_grouped_rollouts",
]

#: A group whose rewards have a population std at or below this is "all the same".
FILTER_STD_THRESHOLD = 1e-6
#: After this many groups in a row, from the start, whose rewards were all the same
#: within each group, the pipeline warns: every GRPO advantage is 0.
SAME_REWARD_WARNING_AFTER = 32
_ROLLOUT_TYPES = frozenset({Rollout, TokenRollout})


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


class Pipeline:
    """One run of the grouped pipeline: its settings, its mechanisms, and the workers'
    loop that drives them.

    Threads: the run's Trio thread only, except :attr:`draws`, whose ``settle`` any
    thread may call (see :class:`DrawBook`).
    """

    # Slots: attribute reads on the hot path are measurably faster than through a dict.
    __slots__ = (
        "admission",
        "agent",
        "call_draws",
        "call_epoch",
        "closed",
        "consecutive_filtered",
        "draws",
        "epoch_source",
        "failing",
        "fast",
        "filtering",
        "final_attempts",
        "gate",
        "generate",
        "group_calls",
        "group_timeout",
        "groups_left_to_send",
        "handoff",
        "leaving",
        "ledger",
        "max_consecutive_filtered",
        "max_outstanding",
        "may_retry",
        "metrics",
        "num_groups",
        "order",
        "park_when_idle",
        "policy",
        "policy_is_trivial",
        "prompts",
        "request",
        "result_epoch",
        "run_seed",
        "same_reward_groups",
        "seeded",
        "skipping",
        "slots",
        "spans",
        "streaming",
        "timed",
    )

    def __init__(
        self,
        agent: GroupedRolloutGenerator,
        request: GroupedRolloutRequest,
        hooks: SlotHooks,
        epoch: int,
    ) -> None:
        self.agent = agent
        self.request = request
        self.num_groups = request.num_groups
        self.streaming = request.streaming
        self.filtering = request.filter_groups_with_same_reward
        self.max_outstanding = agent.parallel_generation_tasks // request.num_groups
        self.max_consecutive_filtered = agent.max_consecutive_filtered
        self.generate = hooks.generate
        # OpenTelemetry spans per call, when trio_rollouts.otel is instrumented.
        tracer = tracing.tracer
        self.spans = None if tracer is None else SampleSpans(tracer)
        if self.spans is not None:
            self.generate = traced(hooks.generate, self.spans, self.current_epoch)
        self.closed = False
        # Whether the pipeline is shutting down (see release_workers).
        self.leaving = False
        workers = self.worker_count()
        # The mechanisms (see the module docstring).
        self.slots = Slots(request.num_groups, request.streaming)
        self.handoff = Handoff(agent.buffer_size, self.slots.sender_woken)
        self.ledger = Ledger(hooks.env_of_slot)
        self.metrics = MetricsBook()
        self.gate = UpdateGate(workers, epoch, request.max_staleness)
        self.draws = DrawBook(hooks.draws_prompts)
        self.order = BatchOrder(request.num_groups) if request.enforce_order else None
        # Non-streaming: the worker that sends the batch's last group closes sending.
        self.groups_left_to_send = request.num_groups
        self.consecutive_filtered = 0
        # Whether a worker raised the pipeline's own error (see fail_once).
        self.failing = False
        # Groups from the start whose rewards were all the same (see watch_rewards); -1
        # once a group with different rewards was seen, or the warning was given.
        self.same_reward_groups = 0 if request.rollouts_per_group > 1 else -1
        self.policy = agent.failure_policy
        self.policy_is_trivial = self.policy.is_trivial
        self.prompts = agent.prompts
        # The request's backend while it is Pausable and has not been seen ahead of the
        # stream's epoch (taken() then warns, once).
        interface = request.inference_interface
        self.epoch_source = interface if isinstance(interface, Pausable) else None
        # The fast path: the first attempt inlined in the worker (see work).
        self.fast = (
            not self.filtering and self.ledger.env_of_slot is None and not self.draws.tracking
        )
        self.group_timeout = self.policy.group_timeout
        self.may_retry = self.policy.max_attempts > 1
        # Whether request seeds are derived per group (they need its slot).
        self.seeded = request.seed is not None
        self.run_seed = request.seed or 0
        self.skipping = self.policy.on_failure == "skip"
        # The attempts made by groups whose retries gave up, by id of the final failure,
        # until it is skipped (for its log line) or raised.
        self.final_attempts: dict[int, int] = {}
        # Whether the gate's watchdog times the fast path's first attempts.
        self.timed = self.fast and self.group_timeout is not None
        # Per worker: the epoch of its call in flight (None when it makes none: the
        # workers' own record, which weight updates read through drop_calls), the epoch
        # its last call that returned started under (the slow path's start_epoch), and
        # that call's prompt draws.
        self.call_epoch: list[int | None] = [None] * workers
        self.result_epoch: list[int] = [0] * workers
        self.call_draws: list[list[Draw]] = [[] for _ in range(workers)]
        # Per worker: its call as the library's agents see it (members cut, see _cuts.py).
        self.group_calls = [GroupCall(n, self.call_epoch, self.ledger) for n in range(workers)]
        # With a staleness bound, a group found too old when it is taken is generated
        # again in its slot: workers must outlive a non-streaming batch's last send.
        self.park_when_idle = self.streaming or request.max_staleness is not None
        # Admission inside the staleness bound (streaming: a batch at a time otherwise).
        self.admission = (
            Admission(
                self.ledger,
                request.max_staleness,
                self.num_groups,
                self.oldest_batch if request.enforce_order else None,
            )
            if self.streaming and request.max_staleness is not None
            else None
        )

    def current_epoch(self) -> int:
        """The stream's policy epoch (calls that start now start under it)."""
        return self.gate.epoch

    def worker_count(self) -> int:
        return self.max_outstanding * self.num_groups if self.streaming else self.num_groups

    @property
    def updating(self) -> bool:
        """Whether a weight update's block is open."""
        return self.gate.updating

    # ---------------------------------------------------------------- the consumer's side

    def taken(self, group: RolloutGroup) -> RolloutGroup:
        """The stream hands ``group`` to the consumer (invariant 2); returns it."""
        batch_id = group.batch_id
        ledger = self.ledger
        ledger.delivered += 1
        ledger.pending -= 1
        if ledger.env_of_slot is not None:
            ledger.env(batch_id, group.index_in_batch).delivered += 1  # type: ignore[union-attr]
        if self.draws.tracking:
            self.draws.taken((batch_id, group.index_in_batch))
        self.slots.taken(batch_id)
        staleness = self.gate.epoch - group.start_epoch
        if staleness:
            self.metrics.taken(staleness)
        if self.spans is not None:
            self.spans.delivered((batch_id, group.index_in_batch), staleness, len(group.cuts))
        if self.admission is not None:
            self.admission.wake()
        if self.same_reward_groups >= 0:
            self.watch_rewards(group)
        source = self.epoch_source
        if source is not None and source.policy_epoch > self.gate.epoch:
            self.epoch_source = None
            warn_epoch_ahead(source, self.gate.epoch)
        return group

    def watch_rewards(self, group: RolloutGroup) -> None:
        """Warn early when the groups from the start all have one reward each: every
        advantage is 0 and training learns nothing (a reward function that cannot be
        met, or a policy that cannot meet it). Looks at the first groups only, so the
        hot path pays one comparison per group after that."""
        rewards = [r.reward if isinstance(r, Rollout) else r.scalar_reward for r in group.rollouts]
        if any(reward is None for reward in rewards):
            self.same_reward_groups = -1  # no rewards to judge
            return
        low, high = min(rewards), max(rewards)  # type: ignore[type-var]
        if high - low > FILTER_STD_THRESHOLD:  # type: ignore[operator]
            self.same_reward_groups = -1
            return
        self.same_reward_groups += 1
        if self.same_reward_groups >= SAME_REWARD_WARNING_AFTER:
            self.same_reward_groups = -1
            first = group.rollouts[0]
            msg = (
                f"the first {SAME_REWARD_WARNING_AFTER} groups each had one reward for all "
                f"their rollouts (the last: {low!r}, env_id={first.env_id!r}): every GRPO "
                "advantage is 0 and a trainer learns nothing from them. Check the reward "
                "function against the completions; EmbeddedInference's default policy "
                "(HashedPromptPolicy) answers 'The answer is A.' and the like, which no "
                "task's reward accepts: use a policy that can answer "
                "(trio_rollouts.envs.AnswerTablePolicy for ArithmeticEnvironment) or a "
                "real model"
            )
            warnings.warn(msg, RuntimeWarning, stacklevel=2)

    def untake(self, group: RolloutGroup) -> None:
        """Undo :meth:`taken` (invariant 12): the group is pending again, as if the stream
        had never handed it over."""
        self.ledger.untaken(group.batch_id, group.index_in_batch)
        self.slots.untake(group.batch_id)

    def regenerate_stale(self, group: RolloutGroup) -> None:
        """A finished, untaken group is too old to hand over (invariant 9): drop it and
        generate its slot again, before any other free slot."""
        self.ledger.pending -= 1
        self.ledger.stale += 1
        slot = (group.batch_id, group.index_in_batch)
        if self.spans is not None:
            self.spans.ended(slot, "stale")
        self.draws.give_back(slot)
        self.slots.put_first(*slot)
        if self.admission is not None:
            self.admission.again.add(slot)
            self.admission.wake()

    def drop_calls(self, reason: DropReason, older_than: int | None) -> int:
        """A weight update drops the calls in flight that started before epoch
        ``older_than`` (all of them when ``None``); return how many."""
        return self.gate.drop(reason, older_than, self.call_epoch)

    def calls_going_on(self) -> int:
        """How many calls are in flight and not dropped (a keep/abort update holds
        them)."""
        return self.gate.calls_in_flight(self.call_epoch)

    def advance_epoch(self, epoch: int, *, stamped: bool) -> None:
        """A weight update's body returned: calls start under ``epoch`` from now on, and
        groups held for ordering that are now too old go back to their slots (groups in
        the buffer are checked when they are pulled)."""
        gate = self.gate
        gate.advance(epoch, stamped)
        self.ledger.weight_updates += 1
        if self.admission is not None:
            self.admission.updated()
        bound = gate.max_staleness
        if bound is not None:
            # Calls now as old as the bound allows: their agents cut the members still
            # running (the library's agents; see _cuts.py).
            call_epoch = self.call_epoch
            for group_call in self.group_calls:
                if group_call.watchers and call_epoch[group_call.number] == epoch - bound:
                    group_call.cut_at(epoch)
        if self.order is not None and bound is not None:
            self.order.evict(gate.too_old, self.regenerate_stale)

    # ---------------------------------------------------------------- workers

    async def worker(self, number: int) -> None:
        """Worker ``number``'s life: its loop runs inside its timer (see
        ``UpdateGate.watchdog``), and starts again in a new timer each time the watchdog,
        or a weight update, has cancelled one."""
        resume: _Resume | None = None
        current_group_call.set(self.group_calls[number])
        while True:
            timer = self.gate.new_timer(number)
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
        ledger = self.ledger
        gate = self.gate
        slots = self.slots
        timed = self.timed
        call_epoch = self.call_epoch
        call_since = gate.call_since
        current_time = trio.lowlevel.current_clock().current_time
        set_start_epoch = call_start_epoch.set
        seeded = self.seeded
        run_seed = self.run_seed
        set_group = call_group.set
        admission = self.admission
        group_call = self.group_calls[number]
        handoff = self.handoff
        fast = self.fast
        generate = self.generate
        park_when_idle = self.park_when_idle
        checkpoint_if_cancelled = trio.lowlevel.checkpoint_if_cancelled
        # The call_start_epoch this worker's context holds from its last fast-path call:
        # set again only when the epoch moved (epochs only grow, so a value the slow
        # path set in between differs from the epoch too). A ContextVar.set allocates.
        epoch_set: int | None = None
        # Whether this worker was woken to claim (unparked, or woken from the full
        # buffer), for Slots.claim's books.
        woken = False
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
                    ledger.cancelled += 1
                    await trio.lowlevel.checkpoint_if_cancelled()
                    ledger.cancelled -= 1
                    self.call_raised(late, None)
                    group = await self.after_failure(batch_id, index, late, number)
            else:
                if woken and self.leaving:
                    return None  # woken at shutdown (see release_workers)
                # A worker woken from a full buffer during shutdown must not start a new
                # call (this does not yield unless cancelled).
                await checkpoint_if_cancelled()
                slot = slots.claim(woken)
                woken = False
                if slot is None:
                    if not park_when_idle:
                        return None
                    await slots.idle_workers.park()
                    woken = True
                    continue
                batch_id, index = slot
                if admission is not None and not admission.may_start(slot):
                    await self.admit(slot)
                if not fast:
                    group = await self.accepted_group(batch_id, index, number)
                else:
                    # The common case (no filtering, one environment, no prompt source):
                    # the first attempt inlined, since every coroutine layer between the
                    # worker and group_rollout costs on each resume, and timed by the
                    # watchdog rather than by a cancel scope of its own, which costs
                    # more than the rest of a group's trip through the pipeline.
                    if gate.updating:
                        # Admitted already (the slot counts itself among those ahead
                        # now): it starts under the new epoch, with as much room.
                        await gate.wait(slot)
                    ledger.started += 1
                    ledger.in_flight += 1
                    if admission is not None:
                        admission.wake()  # the next waiting slot, if there is room
                    epoch = call_epoch[number] = gate.epoch
                    started = call_since[number] = current_time()
                    if epoch != epoch_set:
                        set_start_epoch(epoch)
                        epoch_set = epoch
                    set_group((run_seed, batch_id, index))
                    if group_call.cuts:
                        group_call.cuts.clear()  # booked; a call that failed kept them
                    if seeded:
                        call_slot.set(slot)
                    if timed:
                        gate.start_clock(number, started)
                    failure: BaseException | None = None
                    try:
                        result = await generate(batch_id, index)
                    except BaseException as exc:
                        ledger.in_flight -= 1
                        call_epoch[number] = None
                        if timed:
                            gate.stop_clock(number)
                        if gate.watching and (reason := gate.ended(number)) is not None:
                            self.book_dropped(reason)
                            return (batch_id, index, None)
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
                        ledger.in_flight -= 1
                        # The epoch it counts as started under (an agent that cut every
                        # member moved it on: see _cuts.py).
                        epoch = call_epoch[number]  # type: ignore[assignment]
                        call_epoch[number] = None
                        if gate.watching and (reason := gate.ended(number)) is not None:
                            # Returned after the update cancelled it: dropped all the
                            # same.
                            if timed:
                                gate.stop_clock(number)
                            self.book_dropped(reason)
                            return (batch_id, index, None)
                        if timed and gate.overdue(number, timer, self.group_timeout):  # type: ignore[arg-type]
                            # Returned at or after its deadline: a timeout, as under a
                            # cancel scope of its own (see untracked_attempt).
                            failure = self.timeout_error(batch_id, index)
                            if timer.cancel_called:
                                return (batch_id, index, failure)
                            self.call_raised(failure, None)
                        else:
                            ledger.completed += 1
                            if epoch != gate.epoch and gate.spans_unstamped(epoch):
                                ledger.mixed += 1
                    if failure is None:
                        group = self.checked_group(
                            result,
                            batch_id,
                            index,
                            None,
                            epoch,
                            cuts=group_call.taken() if group_call.cuts else (),
                        )
                    else:
                        # Outside the except block, so that a later failure is not
                        # chained to this one.
                        group = await self.after_failure(batch_id, index, failure, number)
                        del failure
            # Hand the group over (invariant 3), without a schedule point while the
            # buffer has room: a measurable share of the per-group cost in Trio. The
            # loop still cannot spin: it claims only slots the consumer's takes
            # submitted, and parks when there are none. A full buffer: wait inline
            # until a take moves the group into it (see _handoff.py).
            ledger.pending += 1
            wait_for_room = handoff.put(group)
            if wait_for_room is not None:
                try:
                    await wait_task_rescheduled(wait_for_room)
                except BaseException as exc:
                    if isinstance(exc, trio.Cancelled):
                        ledger.pending -= 1
                        ledger.cancelled += 1  # a finished group nobody took
                    raise
                woken = True  # booked by the next claim
            if not park_when_idle:
                self.groups_left_to_send -= 1
                if self.groups_left_to_send == 0:
                    handoff.close_sending()

    def release_workers(self) -> None:
        """At shutdown, before the workers are cancelled: wake those waiting with a group
        or parked, to return without starting a call; the groups they held end as
        cancelled (invariant 7). A worker cancelled instead would cost several times as
        much (a Cancelled raised through its frames and collected by the nursery): about
        10 ms for 512 workers, 5% of s1's timed run."""
        self.leaving = True
        released = self.handoff.release_senders()
        self.ledger.pending -= released
        self.ledger.cancelled += released
        self.slots.idle_workers.unpark_all()

    def oldest_batch(self) -> int:
        """With ``enforce_order`` (batches are taken whole, in order): the oldest batch
        not wholly taken."""
        slots = self.slots
        return slots.next_batch_id - slots.outstanding

    async def admit(self, slot: tuple[int, int]) -> None:
        """Wait until ``slot``'s first call may start inside the staleness bound
        (:class:`~._admission.Admission`), and no weight update holds calls."""
        admission = self.admission
        gate = self.gate
        if admission is None:  # pragma: no cover - callers check
            return
        while True:
            if gate.updating:
                await gate.wait(slot)
            if admission.may_start(slot):
                return
            await admission.wait(slot)

    def book_dropped(self, reason: DropReason) -> None:
        """Book a call that a weight update dropped (its slot is generated again)."""
        if reason is DropReason.RESTART:
            self.ledger.restarted += 1
        else:
            self.ledger.stale += 1

    async def after_failure(
        self, batch_id: int, index: int, failure: BaseException, number: int
    ) -> RolloutGroup:
        """The slow path of a slot whose first attempt failed (booked as failed already):
        retry it, skip it or raise, as the policy says."""
        if not isinstance(failure, Exception):
            self.ledger.raised += 1
            raise failure
        try:
            if not self.may_retry or not self.policy.is_transient(failure):
                raise failure
            result = await self.retried(failure, batch_id, index, None, number)
        except Exception as exc:
            if not self.skipping:
                self.ledger.raised += 1
                raise
            await self.skip(exc, batch_id, index, number)
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
        ledger = self.ledger
        env = ledger.env(batch_id, index)
        while True:
            try:
                if self.policy_is_trivial:
                    result = await self.attempt(batch_id, index, env, number)
                else:
                    result = await self.attempts(batch_id, index, env, number)
            except Exception as exc:
                if not self.skipping:
                    ledger.raised += 1
                    raise
                await self.skip(exc, batch_id, index, number)
                # A loop of instantly failing calls must stay cancellable.
                await trio.lowlevel.checkpoint()
                continue
            draws = self.call_draws[number] if self.draws.tracking else None
            call = self.group_calls[number]
            group = self.checked_group(
                result,
                batch_id,
                index,
                env,
                self.result_epoch[number],
                draws,
                cuts=call.taken() if call.cuts else (),
            )
            if not self.filtering or group.reward_std() > FILTER_STD_THRESHOLD:
                self.consecutive_filtered = 0
                if draws:
                    self.draws.accepted((batch_id, index), draws)
                return group
            if self.spans is not None:
                self.spans.ended((batch_id, index), "filtered")
            if draws:
                finish(draws)  # filtered: done for this epoch, not trained
            if self.same_reward_groups >= 0:
                self.watch_rewards(group)
            ledger.filtered += 1
            if self.admission is not None:
                self.admission.wake()  # a call that leaves nothing to take
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
                await self.fail_once(RuntimeError(msg))
            # A filtering loop over instant group_rollout calls must stay cancellable.
            await trio.lowlevel.checkpoint()

    async def attempt(
        self, batch_id: int, index: int, env: EnvironmentCounters | None, number: int
    ) -> object:
        """``untracked_attempt``, recording the call's prompt draws (in
        ``call_draws[number]``) when the agent draws prompts: they are given back unless
        the call returned."""
        if not self.draws.tracking:
            return await self.untracked_attempt(batch_id, index, env, number)
        draws: list[Draw] = []
        token = current_draws.set(draws)
        try:
            result = await self.untracked_attempt(batch_id, index, env, number)
        except BaseException:
            give_back(draws)
            self.call_draws[number] = draws  # the problem a skip names
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
        ledger = self.ledger
        gate = self.gate
        if gate.updating:
            await gate.wait((batch_id, index))
        ledger.started += 1
        ledger.in_flight += 1
        admission = self.admission
        if admission is not None:
            admission.wake()
        epoch = self.call_epoch[number] = gate.epoch
        gate.call_since[number] = trio.current_time()
        call_start_epoch.set(epoch)
        call_group.set((self.run_seed, batch_id, index))
        group_call = self.group_calls[number]
        if group_call.cuts:
            group_call.cuts.clear()  # booked; a call that failed kept them
        if self.seeded:
            call_slot.set((batch_id, index))
        if env is not None:
            env.started += 1
        try:
            if self.group_timeout is None:
                result = await self.generate(batch_id, index)
            else:
                with trio.move_on_after(self.group_timeout) as deadline:
                    gate.register(deadline)
                    try:
                        result = await self.generate(batch_id, index)
                    finally:
                        gate.unregister(deadline)
                # A call still running at its deadline is cancelled, and one that
                # returns at or after it (running without a checkpoint) is late too.
                if deadline.cancelled_caught or trio.current_time() >= deadline.deadline:
                    raise self.timeout_error(batch_id, index)
        except BaseException as exc:
            ledger.in_flight -= 1
            self.call_epoch[number] = None
            if gate.watching and (reason := gate.ended(number)) is not None:
                self.book_dropped(reason)
                raise _Dropped(batch_id, index) from None
            if self.call_raised(exc, env) and not isinstance(exc, Exception):
                ledger.raised += 1
            raise
        ledger.in_flight -= 1
        # The epoch it counts as started under (an agent that cut every member moved it
        # on: see _cuts.py).
        epoch = self.call_epoch[number]  # type: ignore[assignment]
        self.call_epoch[number] = None
        if gate.watching and (reason := gate.ended(number)) is not None:
            self.book_dropped(reason)
            raise _Dropped(batch_id, index)
        ledger.completed += 1
        self.result_epoch[number] = epoch
        if epoch != gate.epoch and gate.spans_unstamped(epoch):
            ledger.mixed += 1
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
        ledger = self.ledger
        ledger.waiting_to_retry += 1
        waiting = True
        tries = 1
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
                    ledger.waiting_to_retry -= 1
                    ledger.retries += 1
                    tries = attempt.num
                    # Seeds derived per request (GroupedRolloutRequest.seed) differ
                    # from the failed attempt's.
                    attempt_number = call_attempt.set(attempt.num)
                    try:
                        return await self.attempt(batch_id, index, env, number)
                    except Exception:
                        waiting = True
                        ledger.waiting_to_retry += 1
                        raise
                    finally:
                        call_attempt.reset(attempt_number)
        except BaseException as exc:
            if waiting and not isinstance(exc, Exception):
                # Cancelled while waiting out the backoff: the slot is abandoned at
                # shutdown, as a call in flight would be.
                ledger.cancelled += 1
            if isinstance(exc, Exception):
                self.final_attempts[id(exc)] = tries
            raise
        finally:
            if waiting:
                ledger.waiting_to_retry -= 1
        msg = "stamina ended the attempts without a result or an error"  # pragma: no cover
        raise RuntimeError(msg)  # pragma: no cover

    def call_raised(self, exc: BaseException, env: EnvironmentCounters | None) -> bool:
        """Book a call that raised: cancelled at shutdown, or failed (returns True)."""
        if self.admission is not None:
            self.admission.wake()  # a call that leaves nothing to take (for now)
        if _is_cancellation(exc):
            self.ledger.cancelled += 1
            return False
        self.ledger.failure(exc, env)
        return True

    def checked_group(
        self,
        result: object,
        batch_id: int,
        index: int,
        env: EnvironmentCounters | None,
        start_epoch: int,
        draws: list[Draw] | None = None,
        cuts: tuple[Cut, ...] = (),
    ) -> RolloutGroup:
        """make_group (and check the call's prompt draws), booking a broken contract as
        a failed call."""
        try:
            group = self.make_group(result, batch_id, index, start_epoch, cuts)
            if draws is not None:
                self.check_draws(group, draws, batch_id, index)
            return group
        except Exception as exc:
            if draws:
                give_back(draws)
            if self.spans is not None:
                self.spans.ended((batch_id, index), "failed")
            self.ledger.failure(exc, env)
            self.ledger.raised += 1  # a broken contract is never retried or skipped
            raise

    def check_draws(
        self, group: RolloutGroup, draws: list[Draw], batch_id: int, index: int
    ) -> None:
        """A call draws one prompt (from an agent's ``prompts``), and its rollouts are
        about that problem."""
        if len(draws) > 1:
            ids = ", ".join(repr(draw.problem_id) for draw in draws)
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
        problem_id = draws[0].problem_id
        for i, rollout in enumerate(group):
            if rollout.problem_id is not None and rollout.problem_id != problem_id:
                msg = (
                    f"{self.where(batch_id, index)} drew problem {problem_id!r}, but its "
                    f"rollout {i} has problem_id={rollout.problem_id!r}"
                )
                raise ValueError(msg)

    async def skip(self, exc: Exception, batch_id: int, index: int, number: int) -> None:
        """Give up on the slot's current group (on_failure="skip"), logged; it is
        generated anew, unless that was one skip too many (``FailureBudgetExceededError``)."""
        ledger = self.ledger
        ledger.skipped += 1
        draws = self.call_draws[number] if self.draws.tracking else ()
        log_skipped(
            exc,
            self.where(batch_id, index),
            attempts=self.final_attempts.pop(id(exc), 1),
            skipped=ledger.skipped,
            skip_budget=self.policy.skip_budget,
            problem_ids=[draw.problem_id for draw in draws],
            env_id=None if ledger.env_of_slot is None else ledger.env_of_slot(batch_id, index),
        )
        if ledger.skipped > self.policy.skip_budget:
            # The failure itself, not the exception groups of the agent's nurseries.
            leaves = real_leaves(exc)
            last = leaves[0] if len(leaves) == 1 else exc
            msg = (
                f"{ledger.skipped} groups failed and were skipped, more than skip_budget="
                f"{self.policy.skip_budget}; last error, at {self.where(batch_id, index)}: "
                f"{describe_error(exc)}"
            )
            error = FailureBudgetExceededError(msg, skipped=ledger.skipped, last_error=last)
            await self.fail_once(error, cause=last)

    async def fail_once(self, error: Exception, cause: BaseException | None = None) -> None:
        """Raise the pipeline's own error (the filter bound, the skip budget) once.

        Workers that cross the same bound in the same scheduling batch as the first do
        not raise it again: that would turn the documented error into a group of two.
        The first one's error has cancelled the nursery by the time another runs, so
        they wait for that cancellation instead.

        Cancellation: a later caller waits until cancelled (which it already is).
        """
        if self.failing:
            await trio.sleep_forever()
        self.failing = True
        if cause is None:
            raise error
        raise error from cause

    def make_group(
        self,
        result: object,
        batch_id: int,
        index: int,
        start_epoch: int,
        cuts: tuple[Cut, ...] = (),
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
        if not self.filtering:
            # A plain loop: cheaper than a set of the types for a group's few rollouts.
            for rollout in rollouts:
                if type(rollout) not in _ROLLOUT_TYPES:
                    break
            else:
                return prechecked_group(rollouts, batch_id, index, start_epoch, cuts)
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
        return prechecked_group(rollouts, batch_id, index, start_epoch, cuts)

    def where(self, batch_id: int, index: int) -> str:
        return f"{type(self.agent).__name__}.group_rollout (batch_id={batch_id}, index={index})"


@attrs.frozen
class SlotHooks:
    """What the pipeline asks of its agent, besides its settings (the agent's own
    methods, which multi-task mixing overrides, compute them)."""

    #: Makes the ``group_rollout`` call for slot ``(batch_id, index_in_batch)``.
    generate: Callable[[int, int], Awaitable[object]]
    #: The environment (``env_id``) each slot belongs to, or ``None``: no
    #: per-environment counters.
    env_of_slot: Callable[[int, int], str] | None
    #: Whether the calls' prompt draws must be recorded (see ``_draws.py``).
    draws_prompts: bool


@contextlib.asynccontextmanager
async def open_grouped_rollouts(
    agent: GroupedRolloutGenerator, request: GroupedRolloutRequest, hooks: SlotHooks
) -> AsyncIterator[RolloutStream]:
    """Run the pipeline for the duration of an ``async with``; see the module docstring."""
    interface = request.inference_interface
    if request.initial_epoch is None:
        epoch = interface.policy_epoch if isinstance(interface, Pausable) else 0
    else:
        epoch = request.initial_epoch
        if isinstance(interface, Pausable):
            await interface.resume(request.initial_epoch)
    await check_sampling(request, type(agent).__name__)
    pipeline = Pipeline(agent, request, hooks, epoch)
    pipeline.metrics.opened()
    stream = open_stream(pipeline)
    consumer_errors: list[BaseException] = []  # the body's own exception is not flattened
    with flatten_exception_groups(consumer_errors), pipeline.handoff:
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(pipeline.max_outstanding if request.streaming else 1):
                    pipeline.slots.submit_batch()
                for number in range(pipeline.worker_count()):
                    nursery.start_soon(pipeline.worker, number)
                if pipeline.timed:
                    nursery.start_soon(pipeline.gate.watchdog, pipeline.group_timeout)
                try:
                    yield stream
                except BaseException as exc:
                    consumer_errors.append(exc)
                    raise
                finally:
                    # Invariant 6: stop the producers before the handoff closes.
                    pipeline.release_workers()
                    nursery.cancel_scope.cancel()
        finally:
            pipeline.closed = True
            pipeline.metrics.closed()
            if pipeline.spans is not None:
                pipeline.spans.close()
            # Prompts of finished groups nobody took are drawn again (invariant 11), and
            # those groups end as cancelled at shutdown (invariant 7).
            pipeline.draws.give_back_all()
            pipeline.ledger.discarded(discard_untaken(stream))
