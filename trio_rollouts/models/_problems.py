"""Problems: what a prompt source draws and an agent turns into a group.

:class:`Problem` is one problem (its id, its prompt and the reference answer a reward
checks against); :data:`ProblemLike` and :func:`as_problem` accept the
``(problem_id, prompt, answer)`` tuples that users write by hand.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import attrs

from trio_rollouts._messages import ChatMessage

__all__ = ["Problem", "ProblemLike", "as_problem"]


def _check_problem_id(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        msg = f"problem_id must be a str, got {value!r:.80}"
        raise TypeError(msg)


def _check_prompt(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, str):
        return
    if isinstance(value, list) and value and all(isinstance(m, ChatMessage) for m in value):
        return
    msg = f"prompt must be a str or a non-empty list of ChatMessage, got {value!r:.80}"
    raise TypeError(msg)


@attrs.frozen(kw_only=True)
class Problem:
    """One problem: its id, the prompt (a string is one user message) and the reference
    ``answer`` the reward function checks against (any value)."""

    problem_id: str = attrs.field(validator=_check_problem_id)
    prompt: str | list[ChatMessage] = attrs.field(validator=_check_prompt)
    answer: Any = None


#: A problem, or a ``(problem_id, prompt, answer)`` tuple.
ProblemLike: TypeAlias = Problem | tuple[str, str | list[ChatMessage], Any]


def as_problem(value: object, where: str) -> Problem:
    """A :class:`Problem` from a problem or a ``(problem_id, prompt, answer)`` tuple."""
    if isinstance(value, Problem):
        return value
    if isinstance(value, tuple) and len(value) == 3:
        problem_id, prompt, answer = value
        return Problem(problem_id=problem_id, prompt=prompt, answer=answer)
    msg = f"{where} must be a Problem or a (problem_id, prompt, answer) tuple, got {value!r:.80}"
    raise TypeError(msg)
