"""Cutting the sample, not the group: members over-provisioned and members cut at the
staleness bound, in the library's agents (``RewardOnlyAgent``, ``MultiTurnAgent``).

A group waits for its slowest member, and generation times are heavy-tailed. Two rules
act on members rather than on whole groups:

- **Over-provisioning** (``GroupedRolloutRequest.extra_rollouts``): start
  ``rollouts_per_group + extra`` members, keep the first ``rollouts_per_group`` to
  finish, cancel the rest.
- **The cut at the bound** (``max_staleness=K``): a group started under epoch ``s`` is
  dropped (``stale``) at the update to ``s + K + 1``. At the update to ``s + K`` (a
  ``keep`` or ``abort`` update, the only ones that leave calls in flight) the members
  still running are cancelled and generated again under the new epoch: a redrawn
  heavy-tailed sample is usually shorter than what is left of the one that ran long.
  Members already finished are kept, so the group's ``start_epoch`` stays the oldest
  start among its kept members; when none had finished, every member is new and the
  group starts again under ``s + K`` (its call's epoch moves with it, so the bound
  measures it from there).

Every member cancelled by either rule is a :class:`Cut`: the ledger counts it (``cut``,
``wasted_tokens``) when it happens and the group that is delivered lists its own
(``RolloutGroup.cuts``), so a trainer can measure the bias towards short answers.

How the pieces meet: each call the pipeline makes has a
:class:`~trio_rollouts._context.CallCuts` in its call context (``CallContext.cuts``);
:func:`run_members` (the agents' member runner) books cuts on it and waits on it for the
pipeline's cut signal, which ``Pipeline.advance_epoch`` gives (``CallCuts.cut_at``).
Custom agents keep the group-level rule: nothing here acts unless an agent calls
:func:`run_members`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import attrs
import trio

from trio_rollouts._concurrency import flatten_exception_groups
from trio_rollouts._context import CallCuts, CallProgress, calling, current_call
from trio_rollouts.inference import Pausable
from trio_rollouts.models._rollouts import Cut

__all__ = ["cuts_possible", "run_members"]

T = TypeVar("T")


@attrs.define(eq=False)
class _Attempt:
    """One member's run: which draw it is, under which epoch it started, and its scope."""

    draw: int
    epoch: int
    started: float
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    progress: CallProgress = attrs.field(factory=CallProgress)
    #: When it was cut (``None``: it was not).
    cut_at: float | None = None


async def run_members(
    size: int,
    extra: int,
    member: Callable[[int], Awaitable[T]],
) -> list[tuple[int, T]]:
    """Run ``size + extra`` members of one group concurrently; return the first ``size``
    to finish as ``(draw, result)`` pairs in member order.

    ``member(draw)`` runs one member: ``draw`` is ``0 .. size + extra - 1`` for the first
    members and counts on from there for members generated again after a cut (an agent
    derives its seed and episode number from it). The members not kept are cut
    (:class:`Cut`, booked on the worker's :class:`CallCuts`). In a pipeline, the members
    still running at its cut signal (the staleness bound) are cut and started again,
    under the new epoch, in member order.

    The first failure (not a cut) cancels the other members and propagates as itself.

    Cancellation: cancelling this cancels every member; it returns or raises only after
    all of them have exited.
    """
    context = current_call()
    call = context.cuts
    total = size + extra
    kept: dict[int, tuple[int, int, T]] = {}  # member -> (draw, epoch, result)
    running: dict[int, _Attempt] = {}
    first_epoch = 0 if context.start_epoch is None else context.start_epoch
    next_draw = total

    async def run(
        position: int,
        attempt: _Attempt,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        # Started one at a time (see launch): each member runs to its first checkpoint
        # (where a backend fixes its sample) before the next starts.
        task_status.started()
        with calling(progress=attempt.progress, start_epoch=attempt.epoch), attempt.scope:
            result = await member(attempt.draw)
        # Only cut_all cancels the scope, and it marks the attempt cut first.
        if attempt.cut_at is not None:
            generated = attempt.progress.total()
            elapsed = attempt.cut_at - attempt.started
            if call is not None:
                call.book(Cut(generated, elapsed, attempt.epoch))
            return
        del running[position]
        kept[position] = (attempt.draw, attempt.epoch, result)
        if len(kept) == size:
            cut_all()
            watching.cancel()

    async def launch(position: int, draw: int, epoch: int) -> None:
        # Not start_soon: Trio runs the tasks started together in a random order, and a
        # backend that numbers the requests of a prompt as they arrive (the embedded
        # one, without seeds) would sample differently from run to run.
        attempt = _Attempt(draw, epoch, trio.current_time())
        running[position] = attempt
        await nursery.start(run, position, attempt)

    def cut_all() -> list[int]:
        now = trio.current_time()
        positions = sorted(running)
        for position in positions:
            attempt = running.pop(position)
            attempt.cut_at = now
            attempt.scope.cancel()
        return positions

    async def watch_for_cuts(group_call: CallCuts) -> None:
        """Until enough members are kept (``watching``): at each cut signal, cut the
        members running and start them again under the signal's epoch."""
        nonlocal next_draw
        with watching:
            while True:
                event = group_call.watch()
                try:
                    await event.wait()
                finally:
                    group_call.unwatch(event)
                epoch = group_call.cut_epoch
                for position in cut_all():
                    await launch(position, next_draw, epoch)
                    next_draw += 1
                group_call.started_again(min([epoch, *(e for _, e, _ in kept.values())]))

    watching = trio.CancelScope()
    with flatten_exception_groups():
        async with trio.open_nursery() as nursery:
            for position in range(total):
                await launch(position, position, first_epoch)
            if call is not None:
                nursery.start_soon(watch_for_cuts, call)
    return [(draw, result) for _, (draw, _, result) in sorted(kept.items())]


def cuts_possible(max_staleness: int | None, interface: object) -> bool:
    """Whether members of a call may be cut at the bound: there is a bound, the call runs
    in a pipeline, and the backend can hold calls through an update (``keep`` or
    ``abort``), the only updates that leave calls in flight."""
    if max_staleness is None or current_call().cuts is None:
        return False
    return isinstance(interface, Pausable) and bool({"keep", "abort"} & interface.supported_modes)
