"""Preference environments: best-versus-worst pairs, and head-to-head matches.

Two small examples of agents that talk to inference interfaces directly.
:class:`BestWorstContrastiveGenerator` samples several completions per prompt, scores them
with a reward function and pairs the best (chosen) with the worst (rejected), as DPO-style
training wants; a prompt whose completions all score the same gives no pair.
:class:`HeadToHeadRolloutGenerator` sends the same prompt to every interface of a
:class:`~trio_rollouts.Head2HeadRolloutRequest` at once and says which one won. Both run
their inference calls in one nursery with a bound on the calls in flight, so cancelling
them leaves no call running.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs

from trio_rollouts._checks import int_at_least
from trio_rollouts._concurrency import gather_bounded
from trio_rollouts.agents._base import Agent, ContrastiveRolloutGenerator
from trio_rollouts.agents._evaluation import RewardFunction, as_problem_source, problem_at, score
from trio_rollouts.inference import InferenceInterface, InferenceResponse, ReturnsRaw
from trio_rollouts.models._problems import Problem, ProblemLike
from trio_rollouts.models._requests import Head2HeadRolloutRequest, RolloutRequest
from trio_rollouts.models._rollouts import ContrastiveRollout, Rollout

__all__ = ["BestWorstContrastiveGenerator", "HeadToHeadResult", "HeadToHeadRolloutGenerator"]


def _require_raw(interface: InferenceInterface, where: str) -> None:
    if not isinstance(interface, ReturnsRaw):
        msg = (
            f"{where} must return raw text (ReturnsRaw) to build trajectories; "
            f"{type(interface).__name__} does not"
        )
        raise TypeError(msg)


def _raw_text(response: InferenceResponse, interface: InferenceInterface) -> str:
    if response.raw_text is None:
        msg = f"{type(interface).__name__} is ReturnsRaw but returned raw_text=None"
        raise ValueError(msg)
    return response.raw_text


Completion = tuple[InferenceResponse, str, float]  # response, raw text, reward


def _completion_call(
    interface: InferenceInterface,
    problem: Problem,
    request: RolloutRequest | Head2HeadRolloutRequest,
    reward_fn: RewardFunction,
    env_id: str,
) -> Callable[[], Awaitable[Completion]]:
    async def run() -> Completion:
        inference_request = interface.prepare_request(problem.prompt, request.generation_args)
        response = await interface.agenerate(inference_request)
        reward = await score(reward_fn, problem, response.response.content, env_id)
        return response, _raw_text(response, interface), reward

    return run


class _Cursor:
    """Which problem comes next: consecutive calls take consecutive problems."""

    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next = 0

    def take(self, count: int) -> range:
        # Taken synchronously at the call's start, so concurrent calls never share problems.
        taken = range(self.next, self.next + count)
        self.next += count
        return taken


# --------------------------------------------------------------------------- contrastive


@attrs.define(kw_only=True)
class BestWorstContrastiveGenerator(ContrastiveRolloutGenerator):
    """Preference pairs from a reward: best versus worst of ``samples_per_prompt``.

    Each call takes the next ``request.num_rollouts`` problems (a sequence cycles; a
    function is called with the running prompt index) and samples
    ``samples_per_prompt`` completions of each through ``request.inference_interface``
    with ``request.generation_args``. The completion with the highest reward is chosen,
    the one with the lowest rejected (the earliest sample wins a tie for either place);
    if they score the same the prompt gives no pair, so a call returns at most
    ``num_rollouts`` pairs. Trajectories are the interface's ``raw_text`` (it must be
    ``ReturnsRaw``). ``problem_id``, ``env_id`` and both rewards are kept in each pair's
    ``extra``.
    """

    problems: list[Problem] | Callable[[int], ProblemLike] = attrs.field(
        converter=as_problem_source
    )
    reward_fn: RewardFunction
    samples_per_prompt: int = attrs.field(default=4, validator=int_at_least(2))
    #: At most this many inference calls run at once.
    max_concurrent_requests: int = attrs.field(default=64, validator=int_at_least(1))
    env_id: str = "contrastive"
    _cursor: _Cursor = attrs.field(factory=_Cursor, init=False, repr=False, eq=False)

    async def get_contrastive_rollouts(self, request: RolloutRequest) -> list[ContrastiveRollout]:
        """Sample, score and pair; pairs come in prompt order.

        The first failure (inference or reward) cancels the other calls and propagates
        as itself. Cancellation: cancelling this cancels every inference call in flight;
        it returns or raises only after all of them have exited.
        """
        interface = request.inference_interface
        _require_raw(interface, "the inference interface")
        problems = [problem_at(self.problems, i) for i in self._cursor.take(request.num_rollouts)]
        size = self.samples_per_prompt
        completions = await gather_bounded(
            [
                _completion_call(interface, problem, request, self.reward_fn, self.env_id)
                for problem in problems
                for _ in range(size)
            ],
            self.max_concurrent_requests,
        )
        pairs = []
        for p, problem in enumerate(problems):
            samples = completions[p * size : (p + 1) * size]
            rewards = [reward for _, _, reward in samples]
            best = max(range(size), key=rewards.__getitem__)
            worst = min(range(size), key=rewards.__getitem__)
            if rewards[best] == rewards[worst]:
                continue  # every completion scored the same: no preference to learn
            pairs.append(
                ContrastiveRollout(
                    chosen_trajectory=[samples[best][1]],
                    rejected_trajectory=[samples[worst][1]],
                    extra={
                        "problem_id": problem.problem_id,
                        "env_id": self.env_id,
                        "chosen_reward": rewards[best],
                        "rejected_reward": rewards[worst],
                    },
                )
            )
        return pairs


# --------------------------------------------------------------------------- head to head


def _check_winner(
    instance: HeadToHeadResult, attribute: attrs.Attribute[Any], value: object
) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        msg = f"winner must be an interface index or None (a tie), got {value!r}"
        raise TypeError(msg)
    if not 0 <= value < len(instance.rollouts):
        msg = f"winner must be in [0, {len(instance.rollouts)}), got {value}"
        raise ValueError(msg)


@attrs.define(kw_only=True)
class HeadToHeadResult:
    """One prompt played by every interface of a head-to-head request.

    ``rollouts[i]`` is interface ``i``'s completion with its reward; ``winner`` is the
    index of the interface with the single highest reward, or ``None`` when two or more
    share it (a tie).
    """

    problem_id: str
    rollouts: list[Rollout]
    winner: int | None = attrs.field(validator=_check_winner)

    @property
    def rewards(self) -> list[float | None]:
        """Each interface's reward, in interface order."""
        return [rollout.reward for rollout in self.rollouts]


def _rollout(completion: Completion, env_id: str, problem_id: str) -> Rollout:
    response, raw_text, reward = completion
    return Rollout(
        trajectory=[raw_text],
        prompt_length=None if response.prompt_length is None else [response.prompt_length],
        reward=reward,
        env_id=env_id,
        problem_id=problem_id,
        policy_epoch=[list(response.policy_epoch)] if response.policy_epoch else [],
        kv_cache_epoch=[list(response.kv_cache_epoch)] if response.kv_cache_epoch else [],
        num_evictions=[response.num_evictions],
    )


def _winner(rewards: Sequence[float]) -> int | None:
    best = max(rewards)
    leaders = [i for i, reward in enumerate(rewards) if reward == best]
    return leaders[0] if len(leaders) == 1 else None


@attrs.define(kw_only=True)
class HeadToHeadRolloutGenerator(Agent):
    """Play the same prompts on several interfaces and compare their rewards.

    Each call takes the next ``request.num_rollouts`` problems (as
    :class:`BestWorstContrastiveGenerator` does) and sends each, with
    ``request.generation_args``, to every interface of ``request.inference_interface``
    at once; every interface must be ``ReturnsRaw``.
    """

    problems: list[Problem] | Callable[[int], ProblemLike] = attrs.field(
        converter=as_problem_source
    )
    reward_fn: RewardFunction
    #: At most this many inference calls run at once (over all interfaces).
    max_concurrent_requests: int = attrs.field(default=64, validator=int_at_least(1))
    env_id: str = "head_to_head"
    _cursor: _Cursor = attrs.field(factory=_Cursor, init=False, repr=False, eq=False)

    async def get_head2head_rollouts(
        self, request: Head2HeadRolloutRequest
    ) -> list[HeadToHeadResult]:
        """One :class:`HeadToHeadResult` per prompt, in prompt order.

        The first failure (inference or reward) cancels the other calls and propagates
        as itself. Cancellation: cancelling this cancels every inference call in flight;
        it returns or raises only after all of them have exited.
        """
        if not isinstance(request, Head2HeadRolloutRequest):
            msg = f"get_head2head_rollouts takes a Head2HeadRolloutRequest, got {request!r:.80}"
            raise TypeError(msg)
        interfaces = request.inference_interface
        for i, interface in enumerate(interfaces):
            _require_raw(interface, f"inference_interface[{i}]")
        problems = [problem_at(self.problems, i) for i in self._cursor.take(request.num_rollouts)]
        size = len(interfaces)
        completions = await gather_bounded(
            [
                _completion_call(interface, problem, request, self.reward_fn, self.env_id)
                for problem in problems
                for interface in interfaces
            ],
            self.max_concurrent_requests,
        )
        results = []
        for p, problem in enumerate(problems):
            played = completions[p * size : (p + 1) * size]
            results.append(
                HeadToHeadResult(
                    problem_id=problem.problem_id,
                    rollouts=[_rollout(c, self.env_id, problem.problem_id) for c in played],
                    winner=_winner([reward for _, _, reward in played]),
                )
            )
        return results
