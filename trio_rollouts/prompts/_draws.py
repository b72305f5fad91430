"""Prompt settlement: how a ``group_rollout`` call's prompt draws reach the pipeline, and
the book that settles them exactly once (see ``_prompts.py`` and invariant 10 of
``_pipeline.py``).

The pipeline sets :data:`current_draws` to a fresh list around each call it makes for an
agent that draws prompts; :meth:`PromptSource.draw` appends a :class:`Draw` to it (child
tasks of the call inherit the variable, so draws made in the call's own nursery count
too). A draw is settled once: *done* (its group was taken or filtered) or *given back*
(drawn again before any new problem). This module has no dependencies, so the pipeline
and the sources import it without a cycle.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["Draw", "DrawBook", "current_draws", "finish", "give_back"]


class Draw(NamedTuple):
    """One draw: how to settle it, the epoch it was drawn for, and the problem's id.
    ``settle(epoch, problem_id, done)`` is the source's own: ``done`` true when the
    problem is done, false when it is to be drawn again."""

    settle: Callable[[int, str, bool], None]
    epoch: int
    problem_id: str
    #: How many times this (epoch, problem) was given back before this draw, in the
    #: source's life in this process (request seeds tell the draws apart by it).
    again: int = 0


#: The draws of the ``group_rollout`` call running in this task (set by the pipeline).
current_draws: contextvars.ContextVar[list[Draw] | None] = contextvars.ContextVar(
    "trio_rollouts prompt draws", default=None
)


def finish(draws: list[Draw]) -> None:
    """The draws' problems are done (taken, or filtered)."""
    for draw in draws:
        draw.settle(draw.epoch, draw.problem_id, True)


def give_back(draws: list[Draw]) -> None:
    """The draws' problems are to be drawn again, before any new one."""
    for draw in draws:
        draw.settle(draw.epoch, draw.problem_id, False)


class DrawBook:
    """The prompt draws of accepted groups that are not settled yet, by slot.

    A group's draws are *done* when its consumer has it: when the stream hands it out,
    or, after :meth:`settle_on_handover` (the sync bridge, a Ray actor), when the caller
    says so with :meth:`settle`. Everything else gives them back.

    Threads: :meth:`settle` may be called from any thread (the bridge's caller, a Ray
    actor's call threads); every other method only from the pipeline's Trio thread. One
    lock guards the slots, so a settle racing the stream's take settles once.
    """

    __slots__ = ("_lock", "_slots", "on_take", "tracking")

    def __init__(self, tracking: bool) -> None:
        #: Whether the agent draws prompts; when false every method is a no-op.
        self.tracking = tracking
        #: Whether taking a group settles its draws (until :meth:`settle_on_handover`).
        self.on_take = True
        self._slots: dict[tuple[int, int], list[Draw]] = {}
        self._lock = threading.Lock()

    def settle_on_handover(self) -> None:
        """From now on, a taken group's draws wait for :meth:`settle`. Trio thread."""
        self.on_take = False

    def accepted(self, slot: tuple[int, int], draws: list[Draw]) -> None:
        """The group of ``slot``, drawn with ``draws``, was accepted. Trio thread."""
        if draws:
            with self._lock:
                self._slots[slot] = draws

    def taken(self, slot: tuple[int, int]) -> None:
        """The stream handed ``slot``'s group out. Trio thread."""
        if self.tracking and self.on_take:
            self.settle(slot)

    def settle(self, slot: tuple[int, int]) -> None:
        """``slot``'s group reached its consumer: its draws are done. Any thread; a slot
        settled twice, or unknown, is ignored."""
        if self.tracking:
            with self._lock:
                draws = self._slots.pop(slot, None)
            if draws:
                finish(draws)

    def give_back(self, slot: tuple[int, int]) -> None:
        """``slot``'s group will not reach a consumer (it went stale): its draws are
        drawn again. Trio thread."""
        if self.tracking:
            with self._lock:
                draws = self._slots.pop(slot, None)
            if draws:
                give_back(draws)

    def give_back_all(self) -> None:
        """At shutdown: the draws of every group nobody has are drawn again. Trio
        thread."""
        with self._lock:
            pending = list(self._slots.values())
            self._slots.clear()
        for draws in pending:
            give_back(draws)
