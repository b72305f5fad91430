"""Prompt settlement: the book that settles a call's prompt draws exactly once (see
``_source.py``; invariant 11 in ``docs/reference-design.md``).

The pipeline gives each call it makes for an agent that draws prompts a fresh list in
the call's context (``CallContext.draws``); :meth:`PromptSource.draw` appends a
:class:`Draw` to it (child tasks of the call inherit the context, so draws made in the
call's own nursery count too). A draw is settled once: *done* (its group was taken or
filtered) or *given back* (drawn again before any new problem).
"""

from __future__ import annotations

import threading

from trio_rollouts._context import Draw

__all__ = ["Draw", "DrawBook", "finish", "give_back"]


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
