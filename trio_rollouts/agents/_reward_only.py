"""Reward-only agents: one prompt per group, sampled completions, a verifiable reward.

:class:`RewardOnlyAgent` is the Trio form of Megatron's ``reward_only_agent``: a subclass
says which problem comes next (:meth:`~RewardOnlyAgent.get_prompt`) and how a completion
scores (:meth:`~RewardOnlyAgent.get_reward`); the base samples ``rollouts_per_group``
completions concurrently through the request's inference interface, scores each, and
builds :class:`~trio_rollouts.TokenRollout` objects when the interface returns tokens
(``ReturnsTokens``) and :class:`~trio_rollouts.Rollout` objects otherwise, carrying the
engine's ``policy_epoch``, ``kv_cache_epoch`` and ``num_evictions``. The module also holds
the reward functions for answers that can be checked by rule (:data:`REWARD_FUNCTIONS`),
which the arithmetic environment and the command line use.
"""

from __future__ import annotations

import abc
import math
import re
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import numpy as np

from trio_rollouts._concurrency import gather_bounded
from trio_rollouts._messages import GenerationArgs
from trio_rollouts.agents._base import GroupedRolloutGenerator
from trio_rollouts.inference import (
    GeneratesGroups,
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    ReturnsTokens,
)
from trio_rollouts.inference._interface import require_raw
from trio_rollouts.inference._sampling import choice_seed
from trio_rollouts.models._problems import Problem
from trio_rollouts.models._requests import GroupedRolloutRequest
from trio_rollouts.models._rollouts import Rollout, TokenRollout
from trio_rollouts.pipeline._cuts import cuts_possible, run_members
from trio_rollouts.pipeline._sampling import request_seed, sampling_span, seeded

__all__ = [
    "REWARD_FUNCTIONS",
    "RewardOnlyAgent",
    "build_rollouts",
    "contains_reward",
    "exact_match_reward",
    "last_number_reward",
]


# --------------------------------------------------------------------------- rewards


def exact_match_reward(problem: Problem, completion: str) -> float:
    """1.0 when the completion, stripped, equals ``str(problem.answer)`` stripped."""
    return 1.0 if completion.strip() == str(problem.answer).strip() else 0.0


def contains_reward(problem: Problem, completion: str) -> float:
    """1.0 when ``str(problem.answer)`` occurs in the completion (case-sensitive)."""
    return 1.0 if str(problem.answer) in completion else 0.0


_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*)?\.?\d+(?:[eE][-+]?\d+)?")


def _as_number(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip().replace(",", ""))
        except ValueError:
            return None
    return None


def last_number_reward(problem: Problem, completion: str) -> float:
    """1.0 when the last number written in the completion equals the answer numerically.

    Math-style grading: ``"so 17 + 25 = 42."`` scores 1.0 for the answer ``42`` (or
    ``"42"``, ``42.0``); thousands separators are ignored. A completion without a number
    scores 0.0. An answer that is not a number is a ``ValueError``.
    """
    expected = _as_number(problem.answer)
    if expected is None:
        msg = (
            f"last-number reward needs a numeric answer, problem {problem.problem_id!r} "
            f"has {problem.answer!r:.80}"
        )
        raise ValueError(msg)
    found = _NUMBER.findall(completion)
    if not found:
        return 0.0
    value = _as_number(found[-1])
    return 1.0 if value is not None and math.isclose(value, expected, abs_tol=1e-9) else 0.0


#: Reward functions by their command-line name; each takes ``(problem, completion)``.
REWARD_FUNCTIONS: dict[str, Callable[[Problem, str], float]] = {
    "exact-match": exact_match_reward,
    "contains": contains_reward,
    "last-number": last_number_reward,
}


# --------------------------------------------------------------------------- rollouts


def _check_reward(value: object, problem: Problem, env_id: str) -> float:
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        reward = float(value)
        if math.isfinite(reward):
            return reward
    msg = (
        f"get_reward returned {value!r:.80} for problem_id={problem.problem_id!r} "
        f"(env_id={env_id!r}); rewards must be finite numbers"
    )
    raise ValueError(msg)


def _returns_tokens(interface: InferenceInterface, responses: list[InferenceResponse]) -> bool:
    return isinstance(interface, ReturnsTokens) and all(
        r.token_ids is not None and r.prompt_length is not None for r in responses
    )


def _element_boundaries(
    boundaries: list[tuple[int, int]], prompt_length: int
) -> list[list[tuple[int, int]]]:
    """A response's ``(generated index, epoch)`` boundaries as element positions: the
    first covers the prompt (position 0), the others move by the prompt's length."""
    if not boundaries:
        return []
    return [
        [
            (0 if i == 0 else prompt_length + start, epoch)
            for i, (start, epoch) in enumerate(boundaries)
        ]
    ]


def _token_rollout(
    response: InferenceResponse,
    reward: float,
    env_id: str,
    problem_id: str,
    args: GenerationArgs | None = None,
) -> TokenRollout:
    token_ids = list(response.token_ids or [])
    prompt_length = response.prompt_length or 0
    if not 0 <= prompt_length <= len(token_ids):
        msg = (
            f"the inference interface returned prompt_length={prompt_length} for "
            f"{len(token_ids)} token ids (problem_id={problem_id!r})"
        )
        raise ValueError(msg)
    generated = len(token_ids) - prompt_length
    logprobs = None
    if response.logprobs is not None:
        if len(response.logprobs) != generated:
            msg = (
                f"the inference interface returned {len(response.logprobs)} logprobs for "
                f"{generated} generated tokens (problem_id={problem_id!r}); it must return "
                "one per generated token"
            )
            raise ValueError(msg)
        logprobs = [list(response.logprobs)]
    return TokenRollout(
        trajectory=[token_ids],
        reward=reward,
        generation_mask=[[False] * prompt_length + [True] * generated],
        logprobs=logprobs,
        env_id=env_id,
        problem_id=problem_id,
        policy_epoch=_element_boundaries(response.policy_epoch, prompt_length),
        kv_cache_epoch=_element_boundaries(response.kv_cache_epoch, prompt_length),
        num_evictions=[response.num_evictions],
        sampling=None if args is None else [[sampling_span(prompt_length, args, response)]],
        extra=_response_extra(response),
    )


def _text_rollout(
    response: InferenceResponse, reward: float, env_id: str, problem_id: str
) -> Rollout:
    if response.raw_text is None:
        msg = (
            f"the inference interface returned raw_text=None (problem_id={problem_id!r}); "
            "text rollouts need an interface that returns raw text (ReturnsRaw)"
        )
        raise ValueError(msg)
    return Rollout(
        trajectory=[response.raw_text],
        prompt_length=None if response.prompt_length is None else [response.prompt_length],
        reward=reward,
        env_id=env_id,
        problem_id=problem_id,
        policy_epoch=[list(response.policy_epoch)] if response.policy_epoch else [],
        kv_cache_epoch=[list(response.kv_cache_epoch)] if response.kv_cache_epoch else [],
        num_evictions=[response.num_evictions],
        extra=_response_extra(response),
    )


def _response_extra(response: InferenceResponse) -> dict[str, Any]:
    """What a rollout keeps of its response beyond the trajectory, in ``extra`` (as the
    CLI's output rows do): the completion's text, why it stopped, the server's usage."""
    return {
        "completion": response.response.content,
        "finish_reason": response.finish_reason,
        "usage": response.usage,
    }


def build_rollouts(
    interface: InferenceInterface,
    problem: Problem,
    scored: list[tuple[InferenceResponse, float]],
    env_id: str,
    args: list[GenerationArgs] | None = None,
) -> list[Rollout] | list[TokenRollout]:
    """The rollouts of one group from its scored responses, in order.

    :class:`TokenRollout` objects when ``interface`` is ``ReturnsTokens`` and every
    response carries ``token_ids`` and ``prompt_length`` (the ``generation_mask`` marks
    the tokens after the prompt, ``logprobs`` are the response's, ``policy_epoch``
    boundaries are element positions, and with ``args``, each response's generation
    arguments as sent, ``sampling`` records them); otherwise :class:`Rollout` objects
    whose trajectory is the response's ``raw_text``. A group is never a mix of the two.
    """
    responses = [response for response, _ in scored]
    if _returns_tokens(interface, responses):
        return [
            _token_rollout(r, reward, env_id, problem.problem_id, None if args is None else args[i])
            for i, (r, reward) in enumerate(scored)
        ]
    return [_text_rollout(r, reward, env_id, problem.problem_id) for r, reward in scored]


# --------------------------------------------------------------------------- the agent


@attrs.define(kw_only=True)
class RewardOnlyAgent(GroupedRolloutGenerator):
    """A grouped agent whose groups are sampled completions of one problem, each scored
    by a reward function (Megatron's ``reward_only_agent``).

    Subclasses implement :meth:`get_reward` (how one completion scores) and say which
    problem a group is about: with ``prompts=PromptSource(...)`` the default
    :meth:`get_prompt` draws one per group (and the pipeline keeps the source's books
    for checkpoints), or they override :meth:`get_prompt` (with neither, construction is
    a ``TypeError``). :meth:`group_rollout` then asks the
    request's inference interface for ``rollouts_per_group`` completions of the problem
    with ``request.generation_args``, all at once, scores each as it arrives and returns
    them in request order (see :func:`build_rollouts` for their type). The interface
    must return raw text (``ReturnsRaw``); the pipeline checks that before any work.
    """

    #: The environment's name, stamped on every rollout.
    env_id: str = attrs.field(default="", validator=attrs.validators.instance_of(str))

    def __attrs_post_init__(self) -> None:
        if self.prompts is None and type(self).get_prompt is RewardOnlyAgent.get_prompt:
            msg = (
                f"{type(self).__name__} needs prompts: pass prompts=PromptSource(...) or "
                "override get_prompt()"
            )
            raise TypeError(msg)

    async def get_prompt(self, request: GroupedRolloutRequest) -> Problem:
        """The problem the next group is about (``request.validation`` may select a
        split). The default draws one from ``self.prompts``.

        Cancellation: implementations must let ``trio.Cancelled`` propagate (the
        default is not a checkpoint).
        """
        if self.prompts is None:  # pragma: no cover - refused at construction
            msg = f"{type(self).__name__} has no prompts and does not override get_prompt()"
            raise TypeError(msg)
        return self.prompts.draw()

    @abc.abstractmethod
    async def get_reward(self, problem: Problem, response: InferenceResponse) -> float:
        """The reward of one completion (``response.response.content``) of ``problem``:
        a finite number. The response's ``finish_reason`` says whether it was cut off.

        Cancellation: implementations must let ``trio.Cancelled`` propagate.
        """

    def annotate_rollout(
        self, rollout: Rollout | TokenRollout, response: InferenceResponse
    ) -> None:
        """Called with each rollout of a group and the response it was built from, before
        the group is returned; the default does nothing. Override it to keep more of
        what the server returned (say, ``finish_reason`` in ``rollout.extra``, which a
        JSON round trip keeps). Not a checkpoint; it must not block.
        """

    async def group_rollout(
        self, request: GroupedRolloutRequest
    ) -> list[Rollout] | list[TokenRollout]:
        """One group: :meth:`get_prompt`, then :meth:`rollouts_for` that problem.

        Cancellation: as :meth:`rollouts_for`.
        """
        return await self.rollouts_for(await self.get_prompt(request), request)

    async def rollouts_for(
        self, problem: Problem, request: GroupedRolloutRequest
    ) -> list[Rollout] | list[TokenRollout]:
        """Sample ``request.rollouts_per_group`` completions of ``problem`` concurrently,
        score each with :meth:`get_reward`, and build the group's rollouts (then
        :meth:`annotate_rollout` each).

        Completion ``i`` is requested ``i``-th (a seeded backend gives it the ``i``-th
        sample of the prompt). When the interface is
        :class:`~trio_rollouts.inference.GeneratesGroups` and ``request.group_calls``
        allows (the default), the completions come from one
        :meth:`~trio_rollouts.inference.GeneratesGroups.agenerate_group` call (with a run
        seed, the call is sent member 0's seed ``s`` and member ``i``'s sampling record
        shows ``s + i``, the seed vLLM samples choice ``i`` of an ``n`` request with); the
        rewards are computed concurrently as the choices come back together. With
        ``request.extra_rollouts``, or with ``max_staleness`` and ``group_calls=False`` on
        a backend that can hold calls through an update, each member is a call of its
        own, and members may be cut (the first to finish are kept; members still running
        when the group reaches the bound are sampled again: see
        ``GroupedRolloutRequest``). The first failure
        (inference or reward) cancels the other calls and propagates as itself; a reward
        that is not a finite number is a ``ValueError`` naming the problem and
        environment.

        Cancellation: cancelling this cancels every inference call of the group; it
        returns or raises only after all of them have exited.
        """
        interface = request.inference_interface
        require_raw(interface, type(self).__name__)
        inference_request = interface.prepare_request(problem.prompt, request.generation_args)
        if request.extra_rollouts or (
            not request.group_calls and cuts_possible(request.max_staleness, interface)
        ):
            # Members that may be cut: one call each (see _cuts.py).
            return await self._members(problem, request, interface, inference_request)
        size = request.rollouts_per_group
        if request.seed is None:
            requests = [inference_request] * size
        else:
            # One seed per member: the same prompt, sampled differently and replayably.
            requests = [
                attrs.evolve(
                    inference_request,
                    generation_args=seeded(
                        request.generation_args,
                        request_seed(request, interface, problem.problem_id, member),
                    ),
                )
                for member in range(size)
            ]

        if request.group_calls and size > 1 and isinstance(interface, GeneratesGroups):
            sent = requests[0]
            seed = sent.generation_args.seed
            if seed is not None:
                # What each choice was sampled with: seed + i, as vLLM seeds them.
                requests = [
                    attrs.evolve(
                        sent,
                        generation_args=attrs.evolve(
                            sent.generation_args, seed=choice_seed(seed, i)
                        ),
                    )
                    for i in range(size)
                ]
            else:
                requests = [sent] * size
            responses = await interface.agenerate_group(sent, size)

            def score(response: InferenceResponse) -> Callable[[], Awaitable[float]]:
                async def call() -> float:
                    return _check_reward(
                        await self.get_reward(problem, response), problem, self.env_id
                    )

                return call

            rewards = await gather_bounded([score(response) for response in responses], size)
            scored = list(zip(responses, rewards, strict=True))
            return self._built(interface, problem, scored, requests)

        def one(sent: InferenceRequest) -> Callable[[], Awaitable[tuple[InferenceResponse, float]]]:
            async def call() -> tuple[InferenceResponse, float]:
                response = await interface.agenerate(sent)
                reward = _check_reward(
                    await self.get_reward(problem, response), problem, self.env_id
                )
                return response, reward

            return call

        calls = [one(sent) for sent in requests]
        scored = await gather_bounded(calls, size)
        return self._built(interface, problem, scored, requests)

    async def _members(
        self,
        problem: Problem,
        request: GroupedRolloutRequest,
        interface: InferenceInterface,
        inference_request: InferenceRequest,
    ) -> list[Rollout] | list[TokenRollout]:
        """One call per member, ``rollouts_per_group + extra_rollouts`` of them, the
        first ``rollouts_per_group`` to finish (and be scored) kept; members still
        running when the group reaches the staleness bound are cut and sampled again
        (see ``_cuts.py``)."""

        async def member(draw: int) -> tuple[InferenceResponse, float, InferenceRequest]:
            sent = inference_request
            if request.seed is not None:
                seed = request_seed(request, interface, problem.problem_id, draw)
                sent = attrs.evolve(sent, generation_args=seeded(request.generation_args, seed))
            response = await interface.agenerate(sent)
            reward = _check_reward(await self.get_reward(problem, response), problem, self.env_id)
            return response, reward, sent

        kept = await run_members(request.rollouts_per_group, request.extra_rollouts, member)
        scored = [(response, reward) for _, (response, reward, _) in kept]
        return self._built(interface, problem, scored, [sent for _, (_, _, sent) in kept])

    def _built(
        self,
        interface: InferenceInterface,
        problem: Problem,
        scored: list[tuple[InferenceResponse, float]],
        requests: list[InferenceRequest],
    ) -> list[Rollout] | list[TokenRollout]:
        rollouts = build_rollouts(
            interface, problem, scored, self.env_id, [sent.generation_args for sent in requests]
        )
        for index, (response, _) in enumerate(scored):
            self.annotate_rollout(rollouts[index], response)
        return rollouts
