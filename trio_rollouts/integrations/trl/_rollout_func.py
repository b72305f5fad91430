"""``GRPOTrainer(rollout_func=...)``: one step's prompts generated as groups by an agent.

TRL calls a rollout function with the prompts of a generation batch, each repeated
``num_generations`` times in a row, and the trainer. :class:`RolloutFunction` turns each
run of equal prompts (at most ``num_generations`` long) into one group request, runs the
agent's grouped pipeline on them through the sync bridge, and returns the groups' rollouts
in the prompts' order, as TRL takes them. See :func:`rollout_func`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from trio_rollouts import (
    GroupedRolloutGenerator,
    GroupedRolloutRequest,
    Problem,
    PromptSource,
    RolloutGroup,
    blocking_grouped_rollouts,
)
from trio_rollouts._checks import check_seconds
from trio_rollouts.integrations.trl._common import (
    chat_prompt,
    completion_of,
    finish_reason,
    problem_id_of,
    prompt_key,
    trainer_generation_args,
)

__all__ = ["Answers", "RolloutFunction", "agent_reward", "rollout_func"]

#: How a rollout function finds a prompt's answer: a mapping by :func:`prompt_key`
#: (:func:`answers_from` builds one from a dataset), a callable of the prompt, or
#: ``None`` (no answers: ``Problem.answer`` is ``None``).
Answers = Mapping[str, Any] | Callable[[Any], Any] | None


def agent_reward(
    prompts: list[Any] | None = None,
    completions: list[Any] | None = None,
    trio_reward: list[float] | None = None,
    **kwargs: Any,
) -> list[float]:
    """A TRL reward function that returns the agent's reward of each completion, as
    :class:`RolloutFunction` passes it (``trio_reward``). TRL logs it as
    ``rewards/agent_reward/mean``. Other reward functions may stand beside it; they get
    ``trio_reward`` and ``trio_rollout`` (the :class:`~trio_rollouts.TokenRollout`) too."""
    if trio_reward is None:
        msg = (
            "agent_reward needs the trio_reward column that "
            "trio_rollouts.integrations.trl.rollout_func returns: pass "
            "rollout_func=rollout_func(agent, request) to GRPOTrainer"
        )
        raise TypeError(msg)
    return [float(reward) for reward in trio_reward]


def _step_seed(seed: int, step: int, mode: str) -> int:
    """A run seed per trainer step, so that a seeded request samples each step anew and
    a resumed step the same way."""
    digest = hashlib.blake2b(f"{seed}:{step}:{mode}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 2**63


@attrs.define(eq=False)
class RolloutFunction:
    """A TRL ``RolloutFunc`` (``(prompts, trainer) -> dict``) over ``agent``'s grouped
    pipeline; made by :func:`rollout_func`, whose docstring says what it returns."""

    agent: GroupedRolloutGenerator
    request: GroupedRolloutRequest
    answers: Answers = None
    timeout: float | None = None
    #: The groups of the last call, in the order of its prompts.
    last_groups: list[RolloutGroup] = attrs.field(factory=list, init=False)
    #: Completions that ended on a stop id TRL does not count as EOS, given TRL's EOS id
    #: (``env_mask`` 0) so that TRL does not count them clipped, over all calls.
    eos_appended: int = attrs.field(default=0, init=False)
    #: Calls so far.
    calls: int = attrs.field(default=0, init=False)

    def _answer(self, prompt: Any, key: str) -> Any:
        answers = self.answers
        if answers is None:
            return None
        if isinstance(answers, Mapping):
            if key not in answers:
                msg = (
                    f"answers has no answer for the prompt {key!r:.80} ({len(answers)} prompts "
                    "known): build it from the dataset the trainer draws from, "
                    "answers=answers_from(train_dataset, 'answer')"
                )
                raise LookupError(msg)
            return answers[key]
        return answers(prompt)

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        """One generation batch: see :func:`rollout_func`."""
        self.calls += 1
        training = bool(getattr(getattr(trainer, "model", None), "training", True))
        size_name = "num_generations" if training else "num_generations_eval"
        most = getattr(trainer, size_name, None) or getattr(trainer, "num_generations", None)
        # Runs of equal prompts, cut at num_generations: one group each.
        runs: list[tuple[Any, str, int]] = []
        for prompt in prompts:
            key = prompt_key(prompt)
            if runs and runs[-1][1] == key and (not isinstance(most, int) or runs[-1][2] < most):
                runs[-1] = (runs[-1][0], key, runs[-1][2] + 1)
            else:
                runs.append((prompt, key, 1))
        seen: dict[str, int] = {}
        problems: list[Problem] = []
        for prompt, key, _ in runs:
            again = seen[key] = seen.get(key, 0) + 1
            problem_id = problem_id_of(key) + (f"#{again}" if again > 1 else "")
            answer = self._answer(prompt, key)
            problems.append(
                Problem(problem_id=problem_id, prompt=chat_prompt(prompt), answer=answer)
            )
        step = getattr(getattr(trainer, "state", None), "global_step", 0)
        groups: dict[str, RolloutGroup] = {}
        for size in sorted({count for _, _, count in runs}):
            chosen = [p for p, (_, _, count) in zip(problems, runs, strict=True) if count == size]
            groups.update(self._generate(chosen, size, trainer, step, training))
        self.last_groups = [groups[problem.problem_id] for problem in problems]
        return self._output(trainer)

    def _generate(
        self, problems: list[Problem], size: int, trainer: Any, step: int, training: bool
    ) -> dict[str, RolloutGroup]:
        """The groups of ``problems``, ``size`` rollouts each, by problem id: one
        non-streaming pipeline of the agent drawing exactly these problems."""
        request = self.request
        args = trainer_generation_args(
            getattr(trainer, "args", None), request.generation_args, "rollout_func"
        )
        seed = request.seed
        if seed is not None:
            seed = _step_seed(seed, step, "train" if training else "eval")
        request = attrs.evolve(
            request,
            num_groups=len(problems),
            rollouts_per_group=size,
            streaming=False,
            generation_args=args,
            seed=seed,
        )
        agent = attrs.evolve(
            self.agent,
            prompts=PromptSource(problems, shuffle=False),
            parallel_generation_tasks=len(problems),
        )
        with blocking_grouped_rollouts(agent, request) as stream:
            taken = stream.take(len(problems), timeout=self.timeout)
        wanted = {problem.problem_id for problem in problems}
        found: dict[str, RolloutGroup] = {}
        for group in taken:
            ids = {rollout.problem_id for rollout in group}
            problem_id = next(iter(ids)) if len(ids) == 1 else None
            if problem_id is None or problem_id not in wanted or problem_id in found:
                msg = (
                    f"the agent {type(self.agent).__name__} returned a group for problem ids "
                    f"{sorted(map(str, ids))}, not one of the prompts TRL gave it: an agent "
                    "used as a rollout_func must draw its problems from self.prompts (leave "
                    "get_prompt/get_problem as they are)"
                )
                raise ValueError(msg)
            found[problem_id] = group
        missing = sorted(wanted - found.keys())
        if missing:
            msg = (
                f"no group came back for {len(missing)} of {len(problems)} prompts "
                f"({missing[:3]}): a failure policy with on_failure='skip' drops groups, which "
                "a rollout function cannot (TRL needs every prompt's completions); use "
                "on_failure='raise'"
            )
            raise RuntimeError(msg)
        return found

    def _output(self, trainer: Any) -> dict[str, Any]:
        """TRL's dict from :attr:`last_groups`."""
        eos_ids = getattr(trainer, "eos_token_ids", None)
        tokenizer = getattr(trainer, "processing_class", None)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        if not isinstance(eos_ids, list) or not eos_ids:
            eos = getattr(tokenizer, "eos_token_id", None)
            eos_ids = [eos] if isinstance(eos, int) else []
        ends = {*eos_ids, getattr(tokenizer, "pad_token_id", None)}
        out: dict[str, list[Any]] = {
            "prompt_ids": [],
            "completion_ids": [],
            "logprobs": [],
            "env_mask": [],
            "trio_reward": [],
            "trio_rollout": [],
        }
        all_logprobs = True
        for group in self.last_groups:
            for i, rollout in enumerate(group):
                where = f"rollout {i} of problem {rollout.problem_id!r}"
                completion = completion_of(rollout, where)
                ids, mask = completion.completion_ids, completion.env_mask
                logprobs = completion.logprobs
                if finish_reason(rollout) == "stop" and ids[-1] not in ends and eos_ids:
                    # Ended on a stop id TRL does not know (or the server left it out):
                    # TRL's EOS after it, not trained on, so TRL sees the end.
                    ids, mask = [*ids, eos_ids[0]], [*mask, 0]
                    logprobs = None if logprobs is None else [*logprobs, 0.0]
                    self.eos_appended += 1
                all_logprobs = all_logprobs and logprobs is not None
                out["prompt_ids"].append(completion.prompt_ids)
                out["completion_ids"].append(ids)
                out["env_mask"].append(mask)
                out["logprobs"].append(logprobs)
                out["trio_reward"].append(completion.reward)
                out["trio_rollout"].append(rollout)
        result: dict[str, Any] = dict(out)
        if not all_logprobs:
            # TRL takes logprobs for every completion or for none.
            result["logprobs"] = None
        return result


def rollout_func(
    agent: GroupedRolloutGenerator,
    request: GroupedRolloutRequest,
    *,
    answers: Answers = None,
    timeout: float | None = None,
) -> RolloutFunction:
    """A ``rollout_func`` for TRL's ``GRPOTrainer``: each generation batch is generated
    by ``agent``'s grouped pipeline.

    ::

        trainer = GRPOTrainer(
            model=path,
            reward_funcs=agent_reward,
            args=GRPOConfig(num_generations=8, ...),
            train_dataset=dataset,
            rollout_func=rollout_func(agent, request, answers=answers_from(dataset)),
        )

    - **Groups.** TRL passes each prompt ``num_generations`` times in a row; each run of
      equal prompts (cut at ``num_generations``) is one group of that many rollouts, all
      the groups of a call one non-streaming pipeline (``request`` with ``num_groups``
      and ``rollouts_per_group`` set to fit, ``parallel_generation_tasks`` to the number
      of groups). The agent draws them from a :class:`~trio_rollouts.PromptSource` of
      this call's problems (its ``prompts`` field is replaced; it must not override
      ``get_prompt``/``get_problem``). Each problem's id is ``"trl:"`` and a hash of
      its prompt, its prompt the TRL prompt (a string, or messages), and its answer
      from ``answers``: a mapping by :func:`prompt_key` (``answers_from(dataset)``), a
      callable of the prompt, or ``None``. A prompt the mapping lacks is a
      ``LookupError``.
    - **Sampling.** ``request.generation_args`` over the trainer's: ``max_tokens``
      defaults to ``max_completion_length``, ``temperature`` to the config's (another
      set temperature is a ``ValueError``: TRL scores at its own). A request ``seed`` is
      mixed with the trainer's step, so each step samples anew.
    - **What TRL gets**, per completion in the prompts' order: ``prompt_ids`` (the ids
      before the first generated id), ``completion_ids`` (the rest, exactly the
      rollout's), ``env_mask`` (1 on sampled ids, 0 on tool results and template ids),
      ``logprobs`` (one per completion id, 0.0 where ``env_mask`` is 0; ``None`` for the
      whole batch when a backend gave none), and for the reward functions
      ``trio_reward`` (the agent's reward, returned by :func:`agent_reward`) and
      ``trio_rollout`` (the :class:`~trio_rollouts.TokenRollout`).
    - **EOS.** TRL counts a completion as clipped unless its last id is an EOS id of the
      trainer (``trainer.eos_token_ids``) or the pad id. A completion whose last turn
      ended (``finish_reason == "stop"``) on an id TRL does not count gets TRL's first
      EOS id appended with ``env_mask`` 0 (so ``mask_truncated_completions`` keeps it and
      nothing is trained on the added id); a completion cut by ``max_tokens`` stays
      clipped.
    - **Errors.** A rollout of several token sequences (a broken episode) is a
      :class:`BrokenEpisodeError` naming the fix; a text rollout a ``TypeError``; the
      pipeline's own errors propagate as themselves. ``timeout`` (seconds, ``None``:
      none) bounds each call's wait for its groups (``TimeoutError``).

    ``filter_groups_with_same_reward`` cannot be honoured (TRL chooses the prompts, and a
    filtered group would be drawn from another): a ``ValueError`` here.
    """
    if not isinstance(agent, GroupedRolloutGenerator):
        msg = f"agent must be a GroupedRolloutGenerator, got {type(agent).__name__}"
        raise TypeError(msg)
    if not isinstance(request, GroupedRolloutRequest):
        msg = f"request must be a GroupedRolloutRequest, got {type(request).__name__}"
        raise TypeError(msg)
    if request.filter_groups_with_same_reward:
        msg = (
            "request.filter_groups_with_same_reward=True cannot be honoured by a rollout_func: "
            "TRL chooses the prompts of each step, and a filtered group would be redrawn from "
            "another prompt. Set it to False (TRL's groups of one reward have advantage 0), or "
            "stream with RolloutWorker and AsyncGRPOTrainer"
        )
        raise ValueError(msg)
    if answers is not None and not isinstance(answers, Mapping) and not callable(answers):
        msg = (
            "answers must be a mapping by prompt_key (answers_from(dataset)), a callable of "
            f"the prompt, or None, got {type(answers).__name__}"
        )
        raise TypeError(msg)
    check_seconds("timeout", timeout)
    return RolloutFunction(agent, request, answers, timeout)
