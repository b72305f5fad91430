"""One slot's group: attempts, each in a cancel scope of its own; retries, skipping and
filtering, written once.

:meth:`Attempts.group` is what a worker awaits for a slot it claimed. It makes
:meth:`~Attempts.attempt` after attempt until one returns a group the slot keeps:

- an **attempt** is one ``group_rollout`` call. It waits at the weight-update gate, then
  runs in a ``trio.CancelScope`` of its own whose deadline is ``group_timeout``: a call
  still running at its deadline is cancelled, and one that returns at or after it is
  late too (:class:`GroupTimeoutError`). A weight update that drops the call (``restart``,
  or the staleness bound) cancels the same scope; the attempt then returns ``None`` and
  the slot is generated again. The call runs in a
  :class:`~trio_rollouts._context.CallContext` that says which call it is.
- a **transient** failure is retried in the same slot by stamina (backoff, jitter,
  ``max_attempts``). The first attempt runs outside stamina and its failure is replayed
  as stamina's first attempt, so stamina decides everything from there.
- a **final** failure is raised, or with ``on_failure="skip"`` logged and the slot
  generated anew (up to ``skip_budget`` skips).
- a group whose rewards are all the same is **filtered** with
  ``filter_groups_with_same_reward`` and the slot generated anew (up to
  ``max_consecutive_filtered`` in a row).

Every outcome is booked in the ledger as it happens (invariant 7: ``unaccounted`` is 0 at
every instant), and every call's prompt draws are settled once (given back unless its
group is accepted).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import cast

import attrs
import stamina
import trio

from trio_rollouts._concurrency import describe_error, real_leaves
from trio_rollouts._context import CallContext, Draw, call_context
from trio_rollouts.models._requests import GroupedRolloutRequest
from trio_rollouts.models._rollouts import Cut, RolloutGroup
from trio_rollouts.pipeline._epochs import Admission, DropReason, Epochs
from trio_rollouts.pipeline._failure import (
    FailureBudgetExceededError,
    FailurePolicy,
    GroupTimeoutError,
    log_skipped,
)
from trio_rollouts.pipeline._groups import (
    FILTER_STD_THRESHOLD,
    RewardWatch,
    check_draws,
    make_group,
)
from trio_rollouts.pipeline._ledger import EnvironmentCounters, Ledger
from trio_rollouts.pipeline._slots import Slot
from trio_rollouts.pipeline._tracing import SampleSpans
from trio_rollouts.prompts._draws import DrawBook, finish, give_back

__all__ = ["Attempts", "Returned", "is_cancellation"]


def is_cancellation(exc: BaseException) -> bool:
    """``Cancelled``, or a group of nothing but (a nursery inside ``group_rollout``)."""
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(trio.Cancelled)
        return rest is None
    return isinstance(exc, trio.Cancelled)


@attrs.frozen
class Returned:
    """An attempt whose call returned: what it returned, the epoch the call counts as
    started under, its prompt draws and the members it cut."""

    result: object
    start_epoch: int
    draws: list[Draw] | None
    cuts: tuple[Cut, ...]


class Attempts:
    """The attempts of one pipeline's slots (see the module docstring).

    Threads: the pipeline's Trio thread only.
    """

    def __init__(
        self,
        *,
        name: str,
        request: GroupedRolloutRequest,
        generate: Callable[[int, int], Awaitable[object]],
        policy: FailurePolicy,
        max_consecutive_filtered: int,
        prompts_required: bool,
        ledger: Ledger,
        epochs: Epochs,
        draws: DrawBook,
        admission: Admission | None,
        spans: SampleSpans | None,
        rewards: RewardWatch,
    ) -> None:
        self.name = name
        self.generate = generate
        self.policy = policy
        self.filtering = request.filter_groups_with_same_reward
        self.run_seed = request.seed or 0
        self.max_consecutive_filtered = max_consecutive_filtered
        self.prompts_required = prompts_required
        self.ledger = ledger
        self.epochs = epochs
        self.draws = draws
        self.admission = admission
        self.spans = spans
        self.rewards = rewards
        self.consecutive_filtered = 0
        # Whether the pipeline's own error (the filter bound, the skip budget) was raised.
        self.failing = False
        # The attempts made by the slots whose retries gave up, until skipped or raised.
        self.final_attempts: dict[Slot, int] = {}
        # The prompt draws of each slot's last failed attempt (the problem a skip names).
        self.failed_draws: dict[Slot, list[Draw]] = {}

    def where(self, slot: Slot) -> str:
        return f"{self.name}.group_rollout (batch_id={slot[0]}, index={slot[1]})"

    # ---------------------------------------------------------------- a slot's group

    async def group(self, slot: Slot) -> RolloutGroup:
        """Generate ``slot``'s group: again while it is dropped, skipped or filtered.

        Cancellation: cancels the call in flight; the slot is abandoned (booked as
        cancelled).
        """
        env = self.ledger.env(*slot)
        while True:
            try:
                outcome = await self.attempts(slot, env)
            except Exception as exc:
                if self.policy.on_failure != "skip":
                    self.ledger.raised += 1
                    raise
                await self.skip(exc, slot)
                # A loop of instantly failing calls must stay cancellable.
                await trio.lowlevel.checkpoint()
                continue
            if outcome is None:
                # Dropped by an update: generated again once it is over (the gate holds
                # it, in slot order), unless the pipeline is shutting down. No schedule
                # point before the gate, or the update could end before it holds the call.
                await trio.lowlevel.checkpoint_if_cancelled()
                continue
            self.failed_draws.pop(slot, None)
            group = self.accepted(outcome, slot, env)
            if not self.filtering or group.reward_std() > FILTER_STD_THRESHOLD:
                self.consecutive_filtered = 0
                if outcome.draws:
                    self.draws.accepted(slot, outcome.draws)
                return group
            await self.filtered(group, slot, env, outcome.draws)

    def accepted(
        self, outcome: Returned, slot: Slot, env: EnvironmentCounters | None
    ) -> RolloutGroup:
        """The group of a call that returned, checked; a broken contract is booked as a
        failed call and raised (never retried or skipped)."""
        where = self.where(slot)
        try:
            group = make_group(
                outcome.result,
                where,
                slot,
                outcome.start_epoch,
                outcome.cuts,
                finite_rewards=self.filtering,
            )
            if outcome.draws is not None:
                check_draws(group, outcome.draws, where, required=self.prompts_required)
        except Exception as exc:
            if outcome.draws:
                give_back(outcome.draws)
            if self.spans is not None:
                self.spans.ended(slot, "failed")
            self.ledger.failure(exc, env)
            self.ledger.raised += 1
            raise
        return group

    async def filtered(
        self,
        group: RolloutGroup,
        slot: Slot,
        env: EnvironmentCounters | None,
        draws: list[Draw] | None,
    ) -> None:
        """``group``'s rewards are all the same: it is dropped and its slot generated
        again, unless that is one filtered group in a row too many."""
        if self.spans is not None:
            self.spans.ended(slot, "filtered")
        if draws:
            finish(draws)  # filtered: done for this epoch, not trained
        self.rewards.seen(group)
        self.ledger.filtered += 1
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

    # ---------------------------------------------------------------- attempts

    async def attempts(self, slot: Slot, env: EnvironmentCounters | None) -> Returned | None:
        """The attempts of one group until one returns, is dropped, or fails for good
        (raised). The first runs outside stamina: a group that succeeds at once costs no
        retry machinery."""
        try:
            return await self.attempt(slot, env, 1)
        except Exception as exc:
            if self.policy.max_attempts == 1 or not self.policy.is_transient(exc):
                raise
            first = exc
        # Outside the except block, so that a later failure is not chained to the first.
        return await self.retried(first, slot, env)

    async def retried(
        self, first: Exception, slot: Slot, env: EnvironmentCounters | None
    ) -> Returned | None:
        """Attempts 2, 3, ... of a group whose first attempt failed transiently with
        ``first``, replayed as stamina's first attempt. A failure counts as retried only
        when the next attempt starts; while its backoff runs it is ``waiting_to_retry``,
        and if the pipeline shuts down then, ``cancelled``."""
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
                    try:
                        return await self.attempt(slot, env, attempt.num)
                    except Exception:
                        waiting = True
                        ledger.waiting_to_retry += 1
                        raise
        except BaseException as exc:
            if waiting and not isinstance(exc, Exception):
                # Cancelled while waiting out the backoff: abandoned at shutdown.
                ledger.cancelled += 1
            if isinstance(exc, Exception):
                self.final_attempts[slot] = tries
            raise
        finally:
            if waiting:
                ledger.waiting_to_retry -= 1
        msg = "stamina ended the attempts without a result or an error"  # pragma: no cover
        raise RuntimeError(msg)  # pragma: no cover

    async def attempt(
        self, slot: Slot, env: EnvironmentCounters | None, number: int
    ) -> Returned | None:
        """One ``group_rollout`` call for ``slot`` (attempt ``number``), in a cancel scope
        of its own: a :class:`Returned`, or ``None`` when a weight update dropped it
        (booked as restarted or stale).

        A failure is booked as failed and raised; what becomes of it (retried, skipped,
        raised) is the caller's to book, except for a failure that is not an
        ``Exception`` (an exception group holding ``Cancelled`` beside an error, at
        shutdown), which can only propagate and is booked as raised here.

        Cancellation: a cancelled call is booked as cancelled and ``Cancelled``
        propagates.
        """
        ledger = self.ledger
        epochs = self.epochs
        await epochs.wait_for_gate(slot)
        ledger.started += 1
        ledger.in_flight += 1
        if self.admission is not None:
            self.admission.wake()
        if env is not None:
            env.started += 1
        in_flight = epochs.start(slot, self.policy.group_timeout, self.book_cut)
        draws: list[Draw] | None = [] if self.draws.tracking else None
        token = call_context.set(
            CallContext(
                slot=slot,
                attempt=number,
                start_epoch=in_flight.cuts.start_epoch,
                group=(self.run_seed, *slot),
                draws=draws,
                cuts=in_flight.cuts,
            )
        )
        scope = in_flight.scope
        try:
            with scope:
                result = await self.generate(*slot)
            # Cancelled at its deadline, or returned at or after it (without a checkpoint).
            late = scope.cancelled_caught or (
                scope.deadline != math.inf and trio.current_time() >= scope.deadline
            )
        except BaseException as exc:
            ledger.in_flight -= 1
            dropped = epochs.end(in_flight)
            if draws:
                give_back(draws)
            if dropped is not None:
                self.book_dropped(dropped)
                return None
            self.failed_draws[slot] = draws or []
            if is_cancellation(exc):
                ledger.cancelled += 1
            else:
                ledger.failure(exc, env)
                if not isinstance(exc, Exception):
                    ledger.raised += 1
            if self.admission is not None:
                self.admission.wake()  # a call that leaves nothing to take (for now)
            raise
        finally:
            call_context.reset(token)
        ledger.in_flight -= 1
        dropped = epochs.end(in_flight)
        if dropped is not None or late:
            if draws:
                give_back(draws)
            if dropped is not None:
                # Dropped by an update (it may have returned after it was cancelled).
                self.book_dropped(dropped)
                return None
            # Cancelled at its deadline; but if the pipeline is shutting down, the call
            # ended in the shutdown, not in a failure to retry, skip or raise. It counts
            # as cancelled while the checkpoint may yield, so the ledger adds up.
            ledger.cancelled += 1
            await trio.lowlevel.checkpoint_if_cancelled()
            ledger.cancelled -= 1
            self.failed_draws[slot] = draws or []
            error = GroupTimeoutError(
                f"{self.where(slot)} took longer than group_timeout="
                f"{self.policy.group_timeout} s and was cancelled"
            )
            ledger.failure(error, env)
            if self.admission is not None:
                self.admission.wake()
            raise error
        ledger.completed += 1
        # The epoch it counts as started under (an agent that cut every member and
        # started them again moved it on).
        start_epoch = in_flight.cuts.start_epoch
        if start_epoch != epochs.epoch and epochs.mixed(start_epoch):
            ledger.mixed += 1
        # book_cut let only Cut records in.
        cuts = cast(tuple[Cut, ...], tuple(in_flight.cuts.cuts))
        return Returned(result, start_epoch, draws, cuts)

    def book_cut(self, cut: object) -> None:
        """A member of a call was cut (``_cuts.py``): count it."""
        if not isinstance(cut, Cut):
            msg = f"CallCuts.book() takes a trio_rollouts.Cut, got {type(cut).__name__}"
            raise TypeError(msg)
        self.ledger.cut += 1
        if cut.generated_tokens is not None:
            self.ledger.wasted_tokens += cut.generated_tokens

    def book_dropped(self, reason: DropReason) -> None:
        """Book a call that a weight update dropped (its slot is generated again)."""
        if reason is DropReason.RESTART:
            self.ledger.restarted += 1
        else:
            self.ledger.stale += 1

    # ---------------------------------------------------------------- skipping, failing

    async def skip(self, exc: Exception, slot: Slot) -> None:
        """Give up on the slot's current group (``on_failure="skip"``), logged; it is
        generated anew, unless that was one skip too many."""
        ledger = self.ledger
        ledger.skipped += 1
        draws = self.failed_draws.pop(slot, [])
        log_skipped(
            exc,
            self.where(slot),
            attempts=self.final_attempts.pop(slot, 1),
            skipped=ledger.skipped,
            skip_budget=self.policy.skip_budget,
            problem_ids=[draw.problem_id for draw in draws],
            env_id=None if ledger.env_of_slot is None else ledger.env_of_slot(*slot),
        )
        if ledger.skipped > self.policy.skip_budget:
            # The failure itself, not the exception groups of the agent's nurseries.
            leaves = real_leaves(exc)
            last = leaves[0] if len(leaves) == 1 else exc
            msg = (
                f"{ledger.skipped} groups failed and were skipped, more than skip_budget="
                f"{self.policy.skip_budget}; last error, at {self.where(slot)}: "
                f"{describe_error(exc)}"
            )
            error = FailureBudgetExceededError(msg, skipped=ledger.skipped, last_error=last)
            await self.fail_once(error, cause=last)

    async def fail_once(self, error: Exception, cause: BaseException | None = None) -> None:
        """Raise the pipeline's own error (the filter bound, the skip budget) once.

        Workers that cross the same bound in the same scheduling batch as the first do
        not raise it again (that would turn the documented error into a group of two):
        the first one's error has cancelled the nursery, so they wait for that.

        Cancellation: a later caller waits until cancelled (which it already is).
        """
        if self.failing:
            await trio.sleep_forever()
        self.failing = True
        if cause is None:
            raise error
        raise error from cause
