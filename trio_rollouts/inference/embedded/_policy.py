"""What the simulated model says and how long it says it: policies, latency, tokens.

A :data:`Policy` maps a prompt's messages to candidate completions and their
probabilities (:func:`distribution` checks and normalizes what it says);
:class:`HashedPromptPolicy` is the default (a fixed distribution per prompt, seeded by a
hash of its plain rendering). :class:`LatencyModel` draws how long a request takes when
no engine model is simulated. The backend's tokens are Unicode code points:
:func:`decode_code_points` reads ``prompt_ids`` back into text.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Sequence
from typing import Literal, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from trio_rollouts._checks import non_negative
from trio_rollouts._messages import ChatMessage
from trio_rollouts.inference._interface import render_plain_chat

__all__ = [
    "HashedPromptPolicy",
    "LatencyModel",
    "Policy",
    "decode_code_points",
    "distribution",
    "prompt_digest",
]

#: probabilities (non-negative weights, normalized by the backend).
Policy: TypeAlias = Callable[[list[ChatMessage]], tuple[Sequence[str], npt.ArrayLike]]


@attrs.frozen(kw_only=True)
class LatencyModel:
    """How long a simulated generation takes.

    A request waits ``first_token * s`` seconds (queueing and prefill), then
    ``per_token * s`` per generated token, where ``s`` is a per-request speed factor
    with mean 1 drawn from ``distribution``: ``"constant"`` (always 1),
    ``"exponential"``, or ``"lognormal"`` (shape ``sigma``).
    """

    first_token: float = attrs.field(default=0.05, validator=non_negative)
    per_token: float = attrs.field(default=0.002, validator=non_negative)
    distribution: Literal["constant", "exponential", "lognormal"] = attrs.field(
        default="lognormal",
        validator=attrs.validators.in_(("constant", "exponential", "lognormal")),
    )
    sigma: float = attrs.field(default=0.5, validator=non_negative)

    def speed_factor(self, rng: np.random.Generator) -> float:
        """Draw a request's speed factor (mean 1)."""
        if self.distribution == "exponential":
            return float(rng.exponential(1.0))
        if self.distribution == "lognormal":
            # mean exp(mu + sigma**2 / 2) is 1 for this mu.
            return float(rng.lognormal(-(self.sigma**2) / 2, self.sigma))
        return 1.0


def prompt_digest(text: str) -> bytes:
    """The SHA-256 of ``text``: what seeds a prompt's distribution and random stream."""
    return hashlib.sha256(text.encode("utf-8")).digest()


@attrs.frozen(kw_only=True)
class HashedPromptPolicy:
    """The default policy: the same few ``completions`` for every prompt, with
    probabilities drawn once per prompt from a Dirichlet(``concentration``) seeded by a
    hash of the prompt's plain rendering. Deterministic, and it never learns."""

    completions: tuple[str, ...] = (
        "The answer is A.",
        "The answer is B.",
        "The answer is C.",
        "I am not sure.",
    )
    concentration: float = 1.0

    def __call__(self, prompt: list[ChatMessage]) -> tuple[Sequence[str], npt.ArrayLike]:
        digest = prompt_digest(render_plain_chat(prompt))
        rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
        return self.completions, rng.dirichlet([self.concentration] * len(self.completions))


def decode_code_points(ids: list[int]) -> str:
    """The text of token ids that are code points (the embedded backend's tokens)."""
    for i, token in enumerate(ids):
        if token > sys.maxunicode:
            msg = (
                f"prompt_ids[{i}] = {token} is not a token of EmbeddedInference: its tokens "
                f"are Unicode code points, 0 to {sys.maxunicode}"
            )
            raise ValueError(msg)
    return "".join(map(chr, ids))


def distribution(
    policy: Policy, prompt: list[ChatMessage]
) -> tuple[list[str], npt.NDArray[np.float64]]:
    """What ``policy`` says for ``prompt``: its completions and their probabilities,
    normalized. Raises ``ValueError`` when it returns no candidates, candidates that are
    not strings, or probabilities that do not fit them (one each, finite, ``>= 0``, with
    a positive sum)."""
    completions, weights = policy(prompt)
    completions = list(completions)
    if not completions or not all(isinstance(c, str) for c in completions):
        msg = f"the policy must return a non-empty sequence of str, got {completions!r:.80}"
        raise ValueError(msg)
    probs = np.asarray(weights, dtype=np.float64)
    if probs.shape != (len(completions),):
        msg = (
            f"the policy returned {len(completions)} completions but probabilities of "
            f"shape {probs.shape}; give one probability per completion"
        )
        raise ValueError(msg)
    total = float(probs.sum())
    if not np.all(np.isfinite(probs)) or np.any(probs < 0) or not total > 0:
        msg = f"the policy's probabilities must be finite, >= 0, with a positive sum: {probs}"
        raise ValueError(msg)
    return completions, probs / total
