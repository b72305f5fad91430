"""The demo's environment: arithmetic whose calls reach the engine after a short seeded
delay, which keeps a virtual-clock run reproducible across weight updates."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import attrs
import numpy as np
import trio

from trio_rollouts.envs.arithmetic import ArithmeticEnvironment
from trio_rollouts.models._requests import GroupedRolloutRequest
from trio_rollouts.models._rollouts import Rollout, RolloutGroup, TokenRollout

__all__ = ["DemoEnvironment", "dispatch_delayed"]

T = TypeVar("T")

_DISPATCH_STREAM = 0x44495350
#: The longest delay between a call's start and its requests reaching the engine.
_DISPATCH_SECONDS = 0.001


@attrs.define(kw_only=True)
class DemoEnvironment(ArithmeticEnvironment):
    """The arithmetic environment, each of whose calls reaches the engine after a short
    seeded delay (up to ``_DISPATCH_SECONDS``, drawn from the seed, the slot and the
    slot's call count), as a request's trip to a server takes.

    It keeps a virtual-clock run reproducible across weight updates. The embedded engine
    gives the ``n``-th request of a prompt text its ``n``-th random stream, and when a
    weight update ends the calls it held back all start at the same virtual instant
    (one by one in slot order, but each call sends its requests from tasks of its own,
    which Trio runs in an order it varies from run to run); two groups of the same
    problem (a regenerated slot draws its problem at random) started together would
    then swap samples. Delayed by distinct amounts, their requests arrive in an order
    that the seed fixes.

    With ``prompts`` (a resumable run), each call draws its problem from the source
    (:meth:`group_rollout`, after the delay, so the seed fixes the order of the draws
    too) instead of taking its slot's problem.
    """

    def _slot_generator(
        self, request: GroupedRolloutRequest
    ) -> Callable[[int, int], Awaitable[list[Rollout] | list[TokenRollout] | RolloutGroup]]:
        generate = super()._slot_generator(request)
        if self.prompts is not None:
            # ArithmeticEnvironment's slot schedule never calls get_prompt, so it would
            # never draw from the source: one group_rollout (one draw) per call instead.
            group_rollout = self.group_rollout
            generate = lambda batch_id, index_in_batch: group_rollout(request)  # noqa: E731
        window = max(1, self.parallel_generation_tasks // request.num_groups)
        return dispatch_delayed(generate, seed=self.seed, window=window)


def dispatch_delayed(
    generate: Callable[[int, int], Awaitable[T]], *, seed: int, window: int
) -> Callable[[int, int], Awaitable[T]]:
    """``generate`` (what the pipeline calls for slot ``(batch_id, index_in_batch)``),
    each call of which waits first a delay of up to ``_DISPATCH_SECONDS`` drawn from
    ``seed``, the slot and the slot's call count (see :class:`DemoEnvironment`).
    ``window`` is how many batches may be generating at once
    (``parallel_generation_tasks // num_groups``): the call counts of older batches are
    forgotten."""
    # Calls per slot, for the batches that may still be generating (as the base
    # class counts attempts): each slot's calls run one after the other.
    calls: dict[int, dict[int, int]] = {}

    async def dispatched(batch_id: int, index_in_batch: int) -> T:
        of_batch = calls.setdefault(batch_id, {})
        call = of_batch.get(index_in_batch, 0)
        of_batch[index_in_batch] = call + 1
        for old in [b for b in calls if b <= batch_id - window]:
            del calls[old]
        rng = np.random.default_rng([seed, _DISPATCH_STREAM, batch_id, index_in_batch, call])
        await trio.sleep(_DISPATCH_SECONDS * float(rng.random()))
        return await generate(batch_id, index_in_batch)

    return dispatched
