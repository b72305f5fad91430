"""Evaluation: the pass@k estimator, sharding prompts across ranks, and a pass@k agent.

:func:`pass_at_k` is the unbiased estimator of Chen et al. (2021), computed in the
numerically stable product form. :func:`shard_indices` gives each rank of an
``EvaluationRequest.rank_info=(rank, world_size)`` a contiguous, gap-free, non-overlapping
block of the prompts, and :func:`merge_evaluation_responses` joins the ranks' responses
into exactly the response of an unsharded run. :class:`PassAtKEvaluationAgent` samples
``n`` completions per prompt (plus a greedy one at ``temperature=0.0``) through the
request's inference interface, with a fixed number of worker tasks in one nursery, and
scores them with a reward function into a :class:`PassAtKEvaluationResponse`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeAlias, TypeVar

import attrs
import numpy as np

from trio_rollouts._checks import int_at_least
from trio_rollouts._concurrency import gather_bounded
from trio_rollouts._messages import GenerationArgs
from trio_rollouts.agents._base import EvaluationAgent
from trio_rollouts.models._evaluation import EvaluationResponse, RewardEvaluationResult
from trio_rollouts.models._problems import Problem, ProblemLike, as_problem
from trio_rollouts.models._requests import EvaluationRequest

__all__ = [
    "PassAtKEvaluationAgent",
    "PassAtKEvaluationResponse",
    "PassAtKResult",
    "merge_evaluation_responses",
    "pass_at_k",
    "shard_indices",
]


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


# --------------------------------------------------------------------------- pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate for a problem with ``c`` correct of ``n`` samples.

    ``1 - C(n - c, k) / C(n, k)``: the probability that at least one of ``k`` samples
    drawn without replacement from the ``n`` is correct. Computed as
    ``1 - prod(1 - k / arange(n - c + 1, n + 1))``, which stays exact enough for large
    ``n`` where the binomials overflow. Needs ints with ``n >= 1``, ``0 <= c <= n`` and
    ``1 <= k <= n``; anything else is a ``ValueError`` naming the argument and value.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if not _is_int(value):
            msg = f"pass_at_k: {name} must be an int, got {type(value).__name__} {value!r:.80}"
            raise ValueError(msg)
    n, c, k = int(n), int(c), int(k)
    if n < 1:
        msg = f"pass_at_k: n (samples per problem) must be >= 1, got n={n}"
        raise ValueError(msg)
    if not 0 <= c <= n:
        msg = f"pass_at_k: c (correct samples) must be in [0, n={n}], got c={c}"
        raise ValueError(msg)
    if not 1 <= k <= n:
        msg = f"pass_at_k: k must be in [1, n={n}], got k={k}"
        raise ValueError(msg)
    if n - c < k:
        return 1.0  # every draw of k samples holds a correct one
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


# --------------------------------------------------------------------------- sharding


def shard_indices(num_prompts: int, rank_info: tuple[int, int] | None) -> range:
    """The prompt indices rank ``rank`` of ``world_size`` evaluates.

    Contiguous blocks in rank order; the first ``num_prompts % world_size`` ranks get one
    prompt more than the others. Over all ranks the blocks cover ``range(num_prompts)``
    exactly once, in order. ``rank_info=None`` means one rank: every prompt. Ranks beyond
    ``num_prompts`` get an empty range.
    """
    if not _is_int(num_prompts) or num_prompts < 0:
        msg = f"num_prompts must be an int >= 0, got {num_prompts!r}"
        raise ValueError(msg)
    if rank_info is None:
        return range(num_prompts)
    if (
        not isinstance(rank_info, tuple)
        or len(rank_info) != 2
        or not all(_is_int(v) for v in rank_info)
    ):
        msg = f"rank_info must be a (rank, world_size) tuple of ints or None, got {rank_info!r}"
        raise ValueError(msg)
    rank, world = int(rank_info[0]), int(rank_info[1])
    if world < 1 or not 0 <= rank < world:
        msg = f"rank_info must have world_size >= 1 and 0 <= rank < world_size, got {rank_info!r}"
        raise ValueError(msg)
    base, extra = divmod(int(num_prompts), world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


ResponseT = TypeVar("ResponseT", bound=EvaluationResponse[Any])


def merge_evaluation_responses(responses: Sequence[ResponseT]) -> ResponseT:
    """Join the responses of all ranks of one sharded evaluation.

    Each response carries its shard's ``rank_info`` (``run_evaluation`` copies it from
    the request): together they must be every rank ``0 .. world_size - 1`` of one world
    size, each once, in any order. Returns a response of the same class whose
    ``results`` are the ranks' results concatenated in rank order, which for shards made
    by :func:`shard_indices` is exactly the response of an unsharded run (``rank_info``
    ``None``). One response without ``rank_info`` (an unsharded run) is returned as it
    is. Every other field (``env_id``, ``k``, ...) must agree across the ranks.

    Raises ``ValueError`` naming what is wrong: a different class, a disagreeing field,
    a response without ``rank_info`` among several, two world sizes, a rank given twice
    or a missing rank.
    """
    if not responses:
        msg = "merge_evaluation_responses needs at least one response, got none"
        raise ValueError(msg)
    first = responses[0]
    cls = type(first)
    for rank, response in enumerate(responses):
        if type(response) is not cls:
            msg = (
                f"responses[{rank}] is a {type(response).__name__} but responses[0] is a "
                f"{cls.__name__}; merge the ranks' responses of one environment"
            )
            raise ValueError(msg)
        for field in attrs.fields(cls):
            if field.name in ("results", "rank_info"):
                continue
            mine, theirs = getattr(first, field.name), getattr(response, field.name)
            if mine != theirs:
                msg = (
                    f"responses disagree on {field.name}: responses[0] has {mine!r:.80}, "
                    f"responses[{rank}] has {theirs!r:.80}; merge the ranks' responses of "
                    "one evaluation"
                )
                raise ValueError(msg)
    if len(responses) == 1 and first.rank_info is None:
        return first
    ordered = _in_rank_order(responses)
    merged = [result for response in ordered for result in response.results]
    return attrs.evolve(first, results=merged, rank_info=None)


def _in_rank_order(responses: Sequence[ResponseT]) -> list[ResponseT]:
    """The responses by rank, checked to be every rank of one world size once."""
    by_rank: dict[int, int] = {}
    world: int | None = None
    for i, response in enumerate(responses):
        info = response.rank_info
        if info is None:
            msg = (
                f"responses[{i}] has no rank_info; the responses of a sharded evaluation "
                "each carry their (rank, world_size) (run_evaluation copies it from "
                "EvaluationRequest.rank_info)"
            )
            raise ValueError(msg)
        rank, size = info
        if world is None:
            world = size
        elif size != world:
            msg = (
                f"responses[{i}] is a rank of world_size {size}, but responses[0] of "
                f"world_size {world}; merge the ranks of one evaluation"
            )
            raise ValueError(msg)
        if rank in by_rank:
            msg = f"responses[{by_rank[rank]}] and responses[{i}] are both rank {rank}"
            raise ValueError(msg)
        by_rank[rank] = i
    if world is None:  # pragma: no cover - responses is never empty here
        msg = "merge_evaluation_responses needs at least one response, got none"
        raise ValueError(msg)
    missing = sorted(set(range(world)) - set(by_rank))
    if missing:
        msg = (
            f"missing rank(s) {', '.join(map(str, missing))} of world_size {world}; merge "
            "the responses of every rank"
        )
        raise ValueError(msg)
    return [responses[by_rank[rank]] for rank in range(world)]


# --------------------------------------------------------------------------- problems


#: Where problems come from: a sequence, or a function from prompt index to problem.
ProblemSource: TypeAlias = Sequence[ProblemLike] | Callable[[int], ProblemLike]
#: Scores one response to a problem: a float (or bool), or an awaitable of one.
RewardFunction: TypeAlias = Callable[[Problem, str], float | Awaitable[float]]


def as_problem_source(value: ProblemSource) -> list[Problem] | Callable[[int], ProblemLike]:
    """A problem source as agents keep it: a checked list of problems, or the function."""
    if callable(value) and not isinstance(value, Sequence):
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        msg = f"problems must be a sequence of problems or a callable, got {value!r:.80}"
        raise TypeError(msg)
    if not value:
        msg = "problems must not be empty"
        raise ValueError(msg)
    return [as_problem(item, f"problems[{i}]") for i, item in enumerate(value)]


def problem_at(source: list[Problem] | Callable[[int], ProblemLike], index: int) -> Problem:
    """Problem ``index`` of a problem source (a list, or a function of the index)."""
    if isinstance(source, list):
        return source[index % len(source)]
    return as_problem(source(index), f"problems({index})")


async def score(reward_fn: RewardFunction, problem: Problem, response: str, env_id: str) -> float:
    """Run a reward function (sync or async) and check that it gave a finite number.

    Cancellation: a checkpoint only if the reward function is async and awaits.
    """
    value: object = reward_fn(problem, response)
    if inspect.isawaitable(value):
        value = await value
    if isinstance(value, (int, float, np.integer, np.floating)) and math.isfinite(value):
        return float(value)
    msg = (
        f"reward function returned {value!r:.80} for problem_id={problem.problem_id!r} "
        f"(env_id={env_id!r}); rewards must be finite numbers"
    )
    raise ValueError(msg)


Scored: TypeAlias = tuple[str, float]


# --------------------------------------------------------------------------- results


@attrs.define(kw_only=True)
class PassAtKResult(RewardEvaluationResult):
    """One prompt's pass@k evaluation.

    ``n`` samples, ``c`` of them correct (reward >= the agent's ``correct_threshold``),
    their rewards and completions' texts in sample order in ``sample_rewards`` and
    ``sample_responses``. With a greedy run, ``response``
    and ``reward`` are the greedy completion's and ``greedy_correct`` says whether it was
    correct; without one, they are the first sample's and ``greedy_correct`` is ``None``.
    """

    n: int = attrs.field(validator=int_at_least(1))
    c: int = attrs.field(validator=int_at_least(0))
    greedy_correct: bool | None = None
    sample_rewards: list[float] = attrs.field(factory=list)
    sample_responses: list[str] = attrs.field(factory=list)

    def pass_at(self, k: int) -> float:
        """This prompt's pass@k estimate (see :func:`pass_at_k`)."""
        return pass_at_k(self.n, self.c, k)


@attrs.define(kw_only=True)
class PassAtKEvaluationResponse(EvaluationResponse[PassAtKResult]):
    """The results of a :class:`PassAtKEvaluationAgent`, with the largest ``k`` reported."""

    k: int = attrs.field(default=1, validator=int_at_least(1))

    def metrics(self) -> dict[str, float]:
        """``pass@1`` .. ``pass@k`` (mean over prompts), ``greedy_accuracy`` (over the
        prompts with a greedy run) and ``num_prompts``. No prompts: only ``num_prompts``.
        """
        out: dict[str, float] = {}
        if self.results:
            for j in range(1, self.k + 1):
                out[f"pass@{j}"] = float(np.mean([r.pass_at(j) for r in self.results]))
            greedy = [r.greedy_correct for r in self.results if r.greedy_correct is not None]
            if greedy:
                out["greedy_accuracy"] = float(np.mean(greedy))
        out["num_prompts"] = float(len(self.results))
        return out


# --------------------------------------------------------------------------- the agent


@attrs.define(kw_only=True)
class PassAtKEvaluationAgent(EvaluationAgent):
    """Evaluate pass@1 .. pass@k and greedy accuracy on a set of problems.

    For each prompt of the request's shard (see :func:`shard_indices`): ``n`` sampled
    completions with ``sampling_args`` updated by the request's ``generation_args``, and
    (``greedy=True``) one more with the same arguments but ``temperature=0.0``. Each
    completion's text is scored by ``reward_fn(problem, text)`` (sync or async; a bool is
    a verdict) and is correct when its reward is >= ``correct_threshold``.

    ``problems`` is a sequence of :class:`Problem` or ``(problem_id, prompt, answer)``
    tuples (prompt ``i`` is ``problems[i]``; ``num_prompts`` may not exceed its length),
    or a function from prompt index to a problem.
    """

    problems: list[Problem] | Callable[[int], ProblemLike] = attrs.field(
        converter=as_problem_source
    )
    reward_fn: RewardFunction
    #: Samples per prompt.
    n: int = attrs.field(default=1, validator=int_at_least(1))
    #: The largest k reported (pass@1 .. pass@k); at most ``n``.
    k: int = attrs.field(default=1, validator=int_at_least(1))
    greedy: bool = True
    correct_threshold: float = 1.0
    #: Sampling defaults; the request's set generation_args override them.
    sampling_args: GenerationArgs = attrs.field(factory=GenerationArgs)
    #: At most this many inference calls run at once.
    max_concurrent_requests: int = attrs.field(default=64, validator=int_at_least(1))
    env_id: str = "pass_at_k"

    def __attrs_post_init__(self) -> None:
        if self.k > self.n:
            msg = f"k must be <= n (pass@k needs k of the n samples), got k={self.k}, n={self.n}"
            raise ValueError(msg)

    async def run_evaluation(self, request: EvaluationRequest) -> PassAtKEvaluationResponse:
        """Evaluate this rank's shard of ``request.num_prompts`` prompts.

        At most ``max_concurrent_requests`` inference calls run at once, in a fixed set
        of worker tasks in one nursery. Results are in prompt order, whatever order the
        calls finish in. The first failure (an inference error, a bad reward) cancels
        every other call and propagates as itself.

        Cancellation: cancelling this cancels every inference call in flight; it returns
        or raises only after all of them have exited, and no task it started is left.
        """
        if not isinstance(request, EvaluationRequest):
            msg = f"run_evaluation takes an EvaluationRequest, got {type(request).__name__}"
            raise TypeError(msg)
        if isinstance(self.problems, list) and request.num_prompts > len(self.problems):
            msg = (
                f"num_prompts ({request.num_prompts}) exceeds the {len(self.problems)} "
                f"problems of {self.env_id!r}"
            )
            raise ValueError(msg)
        problems = [
            problem_at(self.problems, i)
            for i in shard_indices(request.num_prompts, request.rank_info)
        ]
        interface = request.inference_interface
        sample_args = self.sampling_args.add(request.generation_args)
        greedy_args = sample_args.add(GenerationArgs(temperature=0.0))
        calls = self.n + (1 if self.greedy else 0)  # call self.n is the greedy one

        def call(problem: Problem, args: GenerationArgs) -> Callable[[], Awaitable[Scored]]:
            async def run() -> Scored:
                response = await interface.agenerate(
                    interface.prepare_request(problem.prompt, args)
                )
                text = response.response.content
                return text, await score(self.reward_fn, problem, text, self.env_id)

            return run

        scored = await gather_bounded(
            [
                call(problem, greedy_args if s == self.n else sample_args)
                for problem in problems
                for s in range(calls)
            ],
            self.max_concurrent_requests,
        )
        results = []
        for p, problem in enumerate(problems):
            completions = scored[p * calls : (p + 1) * calls]
            sampled = [reward for _, reward in completions[: self.n]]
            shown_text, shown_reward = completions[-1] if self.greedy else completions[0]
            results.append(
                PassAtKResult(
                    prompt=problem.prompt,
                    response=shown_text,
                    reward=shown_reward,
                    problem_id=problem.problem_id,
                    n=self.n,
                    c=sum(reward >= self.correct_threshold for reward in sampled),
                    greedy_correct=shown_reward >= self.correct_threshold if self.greedy else None,
                    sample_rewards=sampled,
                    sample_responses=[text for text, _ in completions[: self.n]],
                )
            )
        return PassAtKEvaluationResponse(
            env_id=self.env_id, results=results, k=self.k, rank_info=request.rank_info
        )
