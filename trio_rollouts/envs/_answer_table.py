"""A policy that learns: :class:`AnswerTablePolicy`, a numpy table of logits over
candidate answers to arithmetic problems that
:class:`~trio_rollouts.inference.EmbeddedInference` serves as its
:data:`~trio_rollouts.inference.Policy`, and the clipped GRPO step that trains it. It is
the model of ``trio-rollouts demo``, and the way to build that loop yourself."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

from trio_rollouts._messages import ChatMessage
from trio_rollouts.models._problems import Problem
from trio_rollouts.models._rollouts import RolloutGroup, TokenRollout

__all__ = ["AnswerTablePolicy", "FloatArray"]

_CANDIDATE_STREAM = 0x43414E44

FloatArray = npt.NDArray[np.float64]


def _softmax(logits: FloatArray) -> FloatArray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs: FloatArray = shifted / shifted.sum(axis=-1, keepdims=True)
    return probs


def _completion(answer: int) -> str:
    # Terse, as a model trained to answer with the number: the embedded engine spends a
    # token step (a scheduler round) per character.
    return str(answer)


def _distractors(problem: Problem, rng: np.random.Generator, count: int) -> list[int]:
    """``count`` plausible wrong answers: off by one, two or ten, the wrong operation,
    then random numbers near the answer."""
    answer = int(problem.answer)
    a, _, b = str(problem.prompt).removeprefix("What is ").removesuffix("?").split()
    x, y = int(a), int(b)
    plausible = [answer + d for d in (1, -1, 2, -2, 10, -10)] + [x + y, x - y, y - x, x * y]
    pool = list(dict.fromkeys(v for v in plausible if v != answer))
    rng.shuffle(pool)
    chosen = pool[:count]
    spread = max(10, abs(answer))
    while len(chosen) < count:
        value = answer + int(rng.integers(-spread, spread + 1))
        if value != answer and value not in chosen:
            chosen.append(value)
    return chosen


@attrs.define(kw_only=True, eq=False)
class AnswerTablePolicy:
    """A learnable policy for :class:`~trio_rollouts.envs.ArithmeticEnvironment` on the
    embedded backend (the model of ``trio-rollouts demo``): a lookup table, not a
    language model.

    For each problem it holds ``K`` candidate completions, the number ``N`` written out,
    for the right ``N`` and for ``K - 1`` plausible mistakes (off by one, two or ten, the
    wrong operation), and one logit per candidate; a candidate's probability is the softmax of
    its problem's logits. Called with a prompt, it returns the candidates and their
    probabilities, as :data:`~trio_rollouts.inference.Policy` says. Training moves the
    logits, so it learns which candidate is right *for each problem in its table*; it
    does not learn arithmetic and has nothing to say about any other prompt (a
    ``ValueError`` naming it).

    Make one with :meth:`initial` for the environment's problems, serve it with
    ``EmbeddedInference(policy=policy, ...)`` (which then samples the candidates and
    returns token ids and log-probabilities), and train it with :meth:`grpo_step` on the
    groups you take, inside ``stream.weight_update(...)``::

        env = ArithmeticEnvironment(num_problems=16, seed=0)
        policy = AnswerTablePolicy.initial(env.problems, num_candidates=4, seed=0)
        interface = EmbeddedInference(policy=policy, seed=0)
        ...
        async with stream.weight_update("keep"):
            policy.grpo_step(groups, learning_rate=2.0, clip=0.2)
    """

    problems: list[Problem]
    candidates: list[list[str]]
    #: Index of the right candidate of each problem.
    correct: npt.NDArray[np.int64]
    #: ``(num_problems, K)`` logits.
    logits: FloatArray
    _row_of_prompt: dict[str, int] = attrs.field(init=False, repr=False)
    _row_of_problem_id: dict[str, int] = attrs.field(init=False, repr=False)
    _column_of: list[dict[str, int]] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self._row_of_prompt = {str(p.prompt): row for row, p in enumerate(self.problems)}
        self._row_of_problem_id = {p.problem_id: row for row, p in enumerate(self.problems)}
        self._column_of = [{text: col for col, text in enumerate(c)} for c in self.candidates]

    @classmethod
    def initial(
        cls, problems: Sequence[Problem], num_candidates: int, seed: int, init_scale: float = 0.5
    ) -> AnswerTablePolicy:
        """A fresh table: seeded candidates in a seeded order, logits drawn from
        ``Normal(0, init_scale)``, so the policy starts near chance, ``1 / K``."""
        if num_candidates < 2:
            msg = f"num_candidates must be >= 2, got {num_candidates}"
            raise ValueError(msg)
        rng = np.random.default_rng([seed, _CANDIDATE_STREAM])
        candidates = []
        correct = []
        for problem in problems:
            answers = [int(problem.answer), *_distractors(problem, rng, num_candidates - 1)]
            order = rng.permutation(num_candidates)
            candidates.append([_completion(answers[i]) for i in order])
            correct.append(int(np.flatnonzero(order == 0)[0]))
        logits = rng.normal(0.0, init_scale, size=(len(problems), num_candidates))
        return cls(
            problems=list(problems),
            candidates=candidates,
            correct=np.asarray(correct, dtype=np.int64),
            logits=logits,
        )

    def __call__(self, prompt: list[ChatMessage]) -> tuple[Sequence[str], npt.ArrayLike]:
        row = self._row_of_prompt.get(prompt[-1].content)
        if row is None:
            msg = (
                "AnswerTablePolicy knows only the problems it was made for, not "
                f"{prompt[-1].content!r:.80}"
            )
            raise ValueError(msg)
        return self.candidates[row], _softmax(self.logits[row])

    def probabilities(self) -> FloatArray:
        """``(num_problems, K)``: every candidate's probability."""
        return _softmax(self.logits)

    def accuracy(self) -> float:
        """The probability that a sampled answer is right, averaged over the problems:
        the expected accuracy at temperature 1, computed exactly (no sampling noise)."""
        probs = self.probabilities()
        return float(probs[np.arange(len(self.problems)), self.correct].mean())

    def grpo_step(self, groups: Sequence[RolloutGroup], learning_rate: float, clip: float) -> None:
        """One policy-gradient step on the logits from a batch of groups.

        Per rollout: the GRPO advantage ``A`` (:meth:`RolloutGroup.advantages`), the
        candidate it chose, and the importance ratio ``rho = p_now / p_then`` of that
        candidate, ``p_then`` being the probability the rollout's log-probabilities
        record (the weights it was sampled with, possibly some updates ago). The
        gradient of the clipped surrogate ``min(rho * A, clip(rho, 1 +- clip) * A)`` is
        ``rho * A * (onehot - p_now)`` on the problem's logits, or nothing once the
        ratio is clipped; it is averaged over the group and added (ascent).
        """
        probs = self.probabilities()
        gradient = np.zeros_like(self.logits)
        for group in groups:
            advantages = group.advantages()
            for rollout, advantage in zip(group, advantages, strict=True):
                if advantage == 0.0:
                    continue
                if not isinstance(rollout, TokenRollout):
                    msg = (
                        "AnswerTablePolicy.grpo_step needs token rollouts (an interface "
                        f"that returns tokens and logprobs), got {type(rollout).__name__}"
                    )
                    raise TypeError(msg)
                row = self._row_of_problem_id[str(rollout.problem_id)]
                column = self._column_of[row][_generated_text(rollout)]
                ratio = probs[row, column] / math.exp(_logprob(rollout))
                if (advantage > 0 and ratio > 1 + clip) or (advantage < 0 and ratio < 1 - clip):
                    continue
                step = ratio * advantage / len(group)
                gradient[row] -= step * probs[row]
                gradient[row, column] += step
        self.logits += learning_rate * gradient


def _generated_text(rollout: TokenRollout) -> str:
    tokens = rollout.trajectory[0]
    mask = rollout.generation_mask[0] if rollout.generation_mask else [True] * len(tokens)
    # The embedded backend's tokens are characters: token id = code point.
    return "".join(chr(t) for t, generated in zip(tokens, mask, strict=True) if generated)


def _logprob(rollout: TokenRollout) -> float:
    return float(sum(rollout.logprobs[0])) if rollout.logprobs else 0.0
