"""What the grouped pipeline does when a group fails: deadlines, retries, skip or raise.

A :class:`FailurePolicy` is a declaration; ``_attempts.py`` carries it out. A group
attempt fails when ``group_rollout`` raises or runs past ``group_timeout``
(:class:`GroupTimeoutError`). A *transient* failure (``retry_on``) is retried in the same
slot with exponential backoff and jitter (stamina), up to ``max_attempts`` attempts in
all; an exception group counts as transient when every failure inside it is (see
:meth:`FailurePolicy.is_transient`). What is left after retries either reaches the
consumer (``on_failure="raise"``) or is skipped (``"skip"``): the slot is generated
afresh, and a skipped group never reaches the consumer, as a zero-reward row or
otherwise. More than ``skip_budget`` skipped groups
raise :class:`FailureBudgetExceededError` with the count and the last error. Each
skipped group is logged (:func:`log_skipped`, a warning on ``trio_rollouts.pipeline._failure``),
so that skipping never hides what failed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from trio_rollouts._checks import int_at_least as _int_at_least
from trio_rollouts._checks import is_real as _is_real
from trio_rollouts._checks import seconds as _seconds
from trio_rollouts._concurrency import describe_error, real_leaves
from trio_rollouts.inference._errors import TRANSIENT_ERRORS

__all__ = [
    "FailureBudgetExceededError",
    "FailurePolicy",
    "GroupTimeoutError",
    "RewardTimeoutError",
    "StepTimeoutError",
    "default_transient_errors",
    "log_skipped",
]

#: Where skipped groups are logged.
logger = logging.getLogger(__name__)


class GroupTimeoutError(TimeoutError):
    """A ``group_rollout`` call ran past the policy's ``group_timeout`` and was cancelled."""


class StepTimeoutError(TimeoutError):
    """An environment's ``step`` ran past :attr:`MultiTurnAgent.step_timeout
    <trio_rollouts.MultiTurnAgent.step_timeout>` and was cancelled (a sandbox that hangs,
    a tool that never answers). Transient by default: the whole group is retried when the
    policy allows retries."""


class RewardTimeoutError(TimeoutError):
    """A reward function run by :func:`~trio_rollouts.run_reward` ran past its ``timeout``;
    its worker process was killed (a fresh one replaces it). Transient by default: the
    whole group is retried when the policy allows retries."""


class FailureBudgetExceededError(RuntimeError):
    """More groups were skipped than ``FailurePolicy.skip_budget`` allows.

    ``skipped`` is the count and ``last_error`` (also the ``__cause__``) the last failure.
    """

    def __init__(self, message: str, *, skipped: int, last_error: BaseException) -> None:
        super().__init__(message)
        self.skipped = skipped
        self.last_error = last_error


def default_transient_errors() -> tuple[type[BaseException], ...]:
    """The inference layer's transient errors, the group deadline, the environment step
    deadline and the reward deadline (:func:`~trio_rollouts.run_reward`): a timeout may
    not recur on another attempt, whose completions differ."""
    return (*TRANSIENT_ERRORS, GroupTimeoutError, StepTimeoutError, RewardTimeoutError)


def _non_negative_seconds(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    # Not _checks.non_negative_seconds, whose message reads "a finite number of seconds"
    # and which refuses inf: the wait fields keep their message and accept inf.
    if not _is_real(value):
        msg = f"{attribute.name} must be a number of seconds >= 0, got {value!r}"
        raise TypeError(msg)
    if not value >= 0:  # type: ignore[operator]
        msg = f"{attribute.name} must be a number of seconds >= 0, got {value!r}"
        raise ValueError(msg)


def _check_retry_on(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, tuple) or not all(
        isinstance(t, type) and issubclass(t, Exception) for t in value
    ):
        msg = f"retry_on must be a tuple of Exception subclasses, got {value!r}"
        raise TypeError(msg)


def _check_on_failure(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    msg = f"on_failure must be 'raise' or 'skip', got {value!r}"
    if not isinstance(value, str):
        raise TypeError(msg)
    if value not in ("raise", "skip"):
        raise ValueError(msg)


@attrs.frozen(kw_only=True)
class FailurePolicy:
    """How a grouped pipeline treats failing groups. The default changes nothing: no
    deadline, no retry, and the first failure reaches the consumer.

    - ``group_timeout``: seconds one ``group_rollout`` call may take (a cancel scope
      enforces it); a timed-out call fails with :class:`GroupTimeoutError`.
    - ``max_attempts``: attempts per group, retries included (1: no retry).
    - ``retry_on``: exception types that are transient, hence retried. Default: the
      inference layer's transient errors (connection errors, timeouts, 408/409/429/5xx),
      :class:`GroupTimeoutError`, :class:`StepTimeoutError` and
      :class:`RewardTimeoutError`.
    - ``wait_initial``, ``wait_max``, ``wait_jitter``: the exponential backoff between
      attempts (seconds; stamina's meaning).
    - ``on_failure``: ``"raise"`` or ``"skip"``; see the module docstring.
    - ``skip_budget``: at most this many groups may be skipped over the pipeline's life.
    """

    group_timeout: float | None = attrs.field(default=None, validator=_seconds(positive=True))
    max_attempts: int = attrs.field(default=1, validator=_int_at_least(1))
    retry_on: tuple[type[Exception], ...] = attrs.field(
        factory=default_transient_errors, validator=_check_retry_on
    )
    wait_initial: float = attrs.field(default=0.1, validator=_non_negative_seconds)
    wait_max: float = attrs.field(default=5.0, validator=_non_negative_seconds)
    wait_jitter: float = attrs.field(default=1.0, validator=_non_negative_seconds)
    on_failure: Literal["raise", "skip"] = attrs.field(default="raise", validator=_check_on_failure)
    skip_budget: int = attrs.field(default=100, validator=_int_at_least(0))

    def is_transient(self, exc: BaseException) -> bool:
        """Whether ``exc`` is worth another attempt: it is one of ``retry_on``, or it is
        an exception group (an agent that samples in its own nursery raises one) whose
        every leaf, at any depth, is one of ``retry_on`` or ``trio.Cancelled``, with at
        least one that is not ``Cancelled``. A group mixing a transient and another
        error is not transient, and neither is a failure raised for several at once
        (the first, the others in its note) unless every one of them is."""
        leaves = real_leaves(exc)
        return bool(leaves) and all(isinstance(leaf, self.retry_on) for leaf in leaves)


def log_skipped(
    exc: BaseException,
    where: str,
    *,
    attempts: int,
    skipped: int,
    skip_budget: int,
    problem_ids: Sequence[object] = (),
    env_id: str | None = None,
) -> None:
    """Log, as a warning, that the group of ``where`` (``"Agent.group_rollout (batch_id=3,
    index=1)"``) was skipped after ``attempts`` attempts because of ``exc``; ``skipped``
    groups so far, of at most ``skip_budget``. The problem and environment are named
    when known (``problem_ids``: the last attempt's prompt draws)."""
    about = ""
    if env_id is not None:
        about += f", env_id={env_id!r}"
    if problem_ids:
        about += ", problem " + ", ".join(repr(problem) for problem in problem_ids)
    noun = "attempt" if attempts == 1 else "attempts"
    leaves = real_leaves(exc)
    # The failure itself, not the exception groups of the agent's nurseries.
    failure = leaves[0] if len(leaves) == 1 else exc
    logger.warning(
        "skipped the group of %s%s after %d %s: %s (%d of skip_budget=%d groups skipped; "
        "its slot is generated anew)",
        where,
        about,
        attempts,
        noun,
        describe_error(exc),
        skipped,
        skip_budget,
        extra={
            "attempts": attempts,
            "error_type": type(failure).__name__,
            "problem_ids": tuple(problem_ids),
            "env_id": env_id,
            "skipped": skipped,
        },
    )
