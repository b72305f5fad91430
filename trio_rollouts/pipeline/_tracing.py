"""Spans per group (OpenTelemetry), when :func:`trio_rollouts.otel.instrument` is on.

Nothing here imports OpenTelemetry: :data:`state` holds the tracer the public module
(``otel.py``) gave it, or ``None``. A pipeline opened while it is ``None`` pays nothing
but one attribute check per group taken; one opened while a tracer is set wraps its
``group_rollout`` calls (:func:`traced`) and ends each call's span where the group's life
ends (:class:`SampleSpans`).

One span ``rl.sample`` per ``group_rollout`` call, with the events of its lifecycle:
``admitted`` (the call starts), ``first_token`` (the embedded backend's first token of
the group) or ``first_response`` (the first inference call of the group that returned),
``done`` (the call returned), ``reward`` (with the group's mean reward), ``delivered``
(the consumer took it). Its attributes say where it belongs (``rl.batch_id``,
``rl.index``, ``rl.start_epoch``) and how it ended (``rl.outcome``: ``delivered``,
``filtered``, ``stale``, ``failed``, ``cancelled`` or ``not_taken``; ``rl.staleness``
when delivered; ``rl.cuts``).

Threads: the pipeline's Trio thread only.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from trio_rollouts._context import Sample, calling

__all__ = ["SampleSpans", "TracingState", "state", "traced"]


class TracingState:
    """The tracer spans are made with (``None``: tracing is off)."""

    __slots__ = ("tracer",)

    def __init__(self) -> None:
        self.tracer: Any | None = None


#: Set by :func:`trio_rollouts.otel.instrument`.
state = TracingState()


def _mean_reward(result: object) -> float | None:
    rollouts = getattr(result, "rollouts", result)
    if not isinstance(rollouts, list) or not rollouts:
        return None
    rewards = []
    for rollout in rollouts:
        reward = getattr(rollout, "reward", None)
        if reward is None:
            reward = getattr(rollout, "scalar_reward", None)
        if not isinstance(reward, int | float) or not math.isfinite(reward):
            return None
        rewards.append(float(reward))
    return sum(rewards) / len(rewards)


class SampleSpans:
    """A pipeline's spans of calls that returned, by slot, until their group's life ends."""

    __slots__ = ("pending", "tracer")

    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer
        self.pending: dict[tuple[int, int], Any] = {}

    def returned(self, slot: tuple[int, int], span: Any) -> None:
        old = self.pending.pop(slot, None)
        if old is not None:  # pragma: no cover - a slot's group ends before it comes again
            self.ended_span(old, "not_taken")
        self.pending[slot] = span

    def delivered(self, slot: tuple[int, int], staleness: int, cuts: int) -> None:
        span = self.pending.pop(slot, None)
        if span is None:
            return  # taken again after the sync bridge put it back: ended already
        span.add_event("delivered")
        span.set_attribute("rl.staleness", staleness)
        span.set_attribute("rl.cuts", cuts)
        span.set_attribute("rl.outcome", "delivered")
        span.end()

    def ended(self, slot: tuple[int, int], outcome: str) -> None:
        span = self.pending.pop(slot, None)
        if span is not None:
            self.ended_span(span, outcome)

    @staticmethod
    def ended_span(span: Any, outcome: str) -> None:
        span.set_attribute("rl.outcome", outcome)
        span.end()

    def close(self) -> None:
        """The stream closed: the groups nobody took end their spans."""
        for span in self.pending.values():
            self.ended_span(span, "not_taken")
        self.pending.clear()


def traced(
    generate: Callable[[int, int], Awaitable[object]],
    spans: SampleSpans,
    epoch: Callable[[], int],
) -> Callable[[int, int], Awaitable[object]]:
    """``generate`` with a span per call (see the module docstring)."""
    tracer = spans.tracer

    async def call(batch_id: int, index: int) -> object:
        span = tracer.start_span(
            "rl.sample",
            attributes={"rl.batch_id": batch_id, "rl.index": index, "rl.start_epoch": epoch()},
        )
        span.add_event("admitted")
        try:
            with calling(span=Sample(span)):
                result = await generate(batch_id, index)
        except BaseException as exc:
            cancelled = isinstance(exc, trio.Cancelled) or (
                isinstance(exc, BaseExceptionGroup)
                and exc.subgroup(lambda e: not isinstance(e, trio.Cancelled)) is None
            )
            if not cancelled:
                span.record_exception(exc)
            SampleSpans.ended_span(span, "cancelled" if cancelled else "failed")
            raise
        span.add_event("done")
        reward = _mean_reward(result)
        if reward is not None:
            span.add_event("reward", {"rl.reward_mean": reward})
        spans.returned((batch_id, index), span)
        return result

    return call
