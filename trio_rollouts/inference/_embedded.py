"""The embedded backend: a simulated inference engine that needs no server.

:class:`EmbeddedInference` is a simulation for demos, docs and tests, not a language
model. A *policy* maps a prompt to a distribution over whole completions; the backend
samples one (respecting temperature, top-k, top-p and max_tokens) with a numpy
``Generator`` derived from its seed, and "generates" it token by token, sleeping as its
:class:`LatencyModel` says with ``trio.sleep``, so a ``MockClock`` (pytest-trio's
``autojump_clock``) makes it instant and deterministic. Tokens are characters (token id =
Unicode code point), so token ids decode back to ``raw_text``. Like Megatron's engine it
stamps ``policy_epoch``: :meth:`EmbeddedInference.set_generation_epoch` takes effect at
the next token step of every request in flight.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt
import trio

from .._models import ChatMessage, GenerationArgs
from ._interface import (
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    ReturnsLogProbs,
    ReturnsRaw,
    render_plain_chat,
)

__all__ = ["EmbeddedInference", "HashedPromptPolicy", "LatencyModel", "Policy"]

#: A policy: from the prompt's messages to candidate completions and their
#: probabilities (non-negative weights, normalized by the backend).
Policy: TypeAlias = Callable[[list[ChatMessage]], tuple[Sequence[str], npt.ArrayLike]]


def _check_non_negative(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        msg = f"{attribute.name} must be a number >= 0, got {value!r}"
        raise TypeError(msg)
    if not math.isfinite(value) or value < 0:
        msg = f"{attribute.name} must be a finite number >= 0, got {value!r}"
        raise ValueError(msg)


@attrs.frozen(kw_only=True)
class LatencyModel:
    """How long a simulated generation takes.

    A request waits ``first_token * s`` seconds (queueing and prefill), then
    ``per_token * s`` per generated token, where ``s`` is a per-request speed factor
    with mean 1 drawn from ``distribution``: ``"constant"`` (always 1),
    ``"exponential"``, or ``"lognormal"`` (shape ``sigma``).
    """

    first_token: float = attrs.field(default=0.05, validator=_check_non_negative)
    per_token: float = attrs.field(default=0.002, validator=_check_non_negative)
    distribution: Literal["constant", "exponential", "lognormal"] = attrs.field(
        default="lognormal",
        validator=attrs.validators.in_(("constant", "exponential", "lognormal")),
    )
    sigma: float = attrs.field(default=0.5, validator=_check_non_negative)

    def speed_factor(self, rng: np.random.Generator) -> float:
        """Draw a request's speed factor (mean 1)."""
        if self.distribution == "exponential":
            return float(rng.exponential(1.0))
        if self.distribution == "lognormal":
            # mean exp(mu + sigma**2 / 2) is 1 for this mu.
            return float(rng.lognormal(-(self.sigma**2) / 2, self.sigma))
        return 1.0


def _prompt_digest(text: str) -> bytes:
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
        digest = _prompt_digest(render_plain_chat(prompt))
        rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
        return self.completions, rng.dirichlet([self.concentration] * len(self.completions))


def _check_natural(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"{name} must be an int >= 0, got {value!r}"
        raise TypeError(msg)
    if value < 0:
        msg = f"{name} must be >= 0, got {value!r}"
        raise ValueError(msg)


def _check_seed(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    _check_natural("seed", value)


@attrs.define(kw_only=True, eq=False)
class EmbeddedInference(InferenceInterface, ReturnsRaw, ReturnsLogProbs):
    """A simulated inference engine (no model, no server) for demos, docs and tests.

    - ``policy``: maps the prompt's messages to ``(completions, probabilities)``
      (:data:`Policy`); the default is :class:`HashedPromptPolicy`. Swap or mutate it to
      "train" the simulated model.
    - ``seed``: with the policy, fixes every sample. Request ``n`` for a given prompt
      text draws from its own stream (seed, prompt, ``n``), so the completions a group
      of identical prompts gets do not depend on how Trio interleaves other requests
      (one counter is kept per distinct prompt).
    - ``latency``: a :class:`LatencyModel`; all waiting is ``trio.sleep``.

    Sampling follows ``GenerationArgs`` as engines do: ``temperature`` scales the
    policy's log-probabilities (``0.0`` picks the most probable completion, the first on
    ties), then ``top_k`` and ``top_p`` cut the candidates; ``max_tokens`` truncates the
    completion (``finish_reason="length"``, else ``"stop"``).

    The response: ``raw_text`` is ``render_plain_chat(prompt) + completion``; tokens are
    characters, ``token_ids`` the code points of ``raw_text`` and ``prompt_length`` the
    length of the rendered prompt; ``logprobs`` gives each generated token
    ``log(p) / len(completion)``, where ``p`` is the policy's probability of the chosen
    completion (before temperature and cuts, as vLLM reports raw log-probabilities), so a
    complete completion's logprobs sum to ``log(p)``. ``policy_epoch`` starts at
    ``[(0, e)]`` with the epoch current at admission; see
    :meth:`set_generation_epoch`. There is no KV cache to evict: ``kv_cache_epoch``
    mirrors ``policy_epoch`` and ``num_evictions`` is 0.
    """

    seed: int = attrs.field(default=0, validator=_check_seed)
    policy: Policy = attrs.field(
        factory=HashedPromptPolicy, validator=attrs.validators.is_callable()
    )
    latency: LatencyModel = attrs.field(
        factory=LatencyModel, validator=attrs.validators.instance_of(LatencyModel)
    )
    _generation_epoch: int = attrs.field(init=False, default=0)
    _requests_per_prompt: dict[bytes, int] = attrs.field(init=False, factory=dict, repr=False)

    @property
    def generation_epoch(self) -> int:
        """The policy epoch new tokens are generated with."""
        return self._generation_epoch

    def set_generation_epoch(self, epoch: int) -> None:
        """Declare that the policy's weights changed to ``epoch``, as a trainer does after
        an update.

        A request admitted later starts with ``policy_epoch == [(0, epoch)]``. A request
        in flight sees the change at its next token step and appends ``(k, epoch)``, ``k``
        being the number of tokens it had generated by then; when it had generated none
        under the previous epoch, that empty segment is replaced instead, so start
        indices strictly increase. Safe to call from any thread (one attribute write).
        """
        _check_natural("epoch", epoch)
        self._generation_epoch = epoch

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        """Sample a completion and simulate its generation.

        Raises ``ValueError`` when the policy returns no candidates or bad
        probabilities.

        Cancellation: a checkpoint at least once (the first-token wait); cancellable at
        every token step, leaving nothing behind.
        """
        prompt_text = render_plain_chat(request.prompt)
        completions, probs = self._distribution(request.prompt)
        rng = self._request_rng(prompt_text)
        index = _sample(probs, request.generation_args, rng)
        completion = completions[index]
        max_tokens = request.generation_args.max_tokens
        generated = completion if max_tokens is None else completion[:max_tokens]
        speed = self.latency.speed_factor(rng)

        policy_epoch = [(0, self._generation_epoch)]
        await trio.sleep(self.latency.first_token * speed)
        for k in range(len(generated)):
            _stamp(policy_epoch, k, self._generation_epoch)
            await trio.sleep(self.latency.per_token * speed)

        token_logprob = math.log(probs[index]) / len(completion) if completion else 0.0
        raw_text = prompt_text + generated
        return InferenceResponse(
            response=ChatMessage(role="assistant", content=generated),
            raw_text=raw_text,
            token_ids=[ord(character) for character in raw_text],
            prompt_length=len(prompt_text),
            logprobs=[token_logprob] * len(generated),
            policy_epoch=policy_epoch,
            kv_cache_epoch=list(policy_epoch),
            num_evictions=0,
            finish_reason="length" if len(generated) < len(completion) else "stop",
        )

    def _distribution(self, prompt: list[ChatMessage]) -> tuple[list[str], npt.NDArray[np.float64]]:
        completions, weights = self.policy(prompt)
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

    def _request_rng(self, prompt_text: str) -> np.random.Generator:
        digest = _prompt_digest(prompt_text)
        occurrence = self._requests_per_prompt.get(digest, 0)
        self._requests_per_prompt[digest] = occurrence + 1
        words = [int.from_bytes(digest[i : i + 8], "little") for i in (0, 8)]
        return np.random.default_rng([self.seed, *words, occurrence])


def _stamp(policy_epoch: list[tuple[int, int]], k: int, epoch: int) -> None:
    """Record that token ``k`` onwards is generated under ``epoch``."""
    start, current = policy_epoch[-1]
    if epoch == current:
        return
    if start == k:
        policy_epoch[-1] = (k, epoch)
    else:
        policy_epoch.append((k, epoch))


def _sample(probs: npt.NDArray[np.float64], args: GenerationArgs, rng: np.random.Generator) -> int:
    """Pick a completion index as an engine samples a token: temperature, top-k, top-p."""
    # Most probable first; a stable sort breaks ties by index.
    order = np.argsort(-probs, kind="stable")
    order = order[probs[order] > 0]
    if args.temperature == 0.0:
        return int(order[0])
    if args.top_k is not None and args.top_k != -1:
        order = order[: args.top_k]
    logits = np.log(probs[order])
    if args.temperature is not None:
        logits = logits / args.temperature
    kept = np.exp(logits - logits.max())
    kept /= kept.sum()
    if args.top_p is not None:
        # The smallest prefix whose mass reaches top_p (at least one candidate).
        cut = int(np.searchsorted(np.cumsum(kept), args.top_p, side="left")) + 1
        kept = kept[:cut] / kept[:cut].sum()
        order = order[:cut]
    return int(order[rng.choice(len(order), p=kept)])
