"""How a ``group_rollout`` call's prompt draws reach the pipeline (see ``_prompts.py``).

The pipeline sets :data:`current_draws` to a fresh list around each call it makes for an
agent that draws prompts; :meth:`PromptSource.draw` appends to it (child tasks of the
call inherit the variable, so draws made in the call's own nursery count too). This
module has no dependencies, so the pipeline can import it without a cycle.
"""

from __future__ import annotations

import contextvars
from typing import Protocol

__all__ = ["Draw", "DrawOwner", "current_draws", "finish", "give_back"]


class DrawOwner(Protocol):
    """What a draw's source must do when the pipeline settles it."""

    def _done(self, epoch: int, problem_id: str) -> None: ...

    def _give_back(self, epoch: int, problem_id: str) -> None: ...


#: One draw: its source, the epoch it was drawn for, and the problem's id.
Draw = tuple[DrawOwner, int, str]

#: The draws of the ``group_rollout`` call running in this task (set by the pipeline).
current_draws: contextvars.ContextVar[list[Draw] | None] = contextvars.ContextVar(
    "trio_rollouts prompt draws", default=None
)


def finish(draws: list[Draw]) -> None:
    """The draws' problems are done (taken, or filtered)."""
    for source, epoch, problem_id in draws:
        source._done(epoch, problem_id)


def give_back(draws: list[Draw]) -> None:
    """The draws' problems are to be drawn again, before any new one."""
    for source, epoch, problem_id in draws:
        source._give_back(epoch, problem_id)
