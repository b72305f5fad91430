"""What both TRL routes share: prompts and answers from a TRL dataset, the generation
arguments a TRL config implies, and a rollout's ids cut the way TRL takes them.

- :func:`prompt_key`, :func:`answers_from` and :func:`problems_from`: TRL hands a rollout
  function only the prompt, so a reward that needs the reference answer finds it by the
  prompt (the documented lookup); the streaming route draws the problems itself.
- :func:`trainer_generation_args`: TRL's sampling settings as
  :class:`~trio_rollouts.GenerationArgs` under the request's own (the request wins), and
  the one disagreement that would bias training (the temperature TRL scores at).
- :func:`completion_of`: one single-element :class:`~trio_rollouts.TokenRollout` as TRL's
  ``prompt_ids``, ``completion_ids``, ``env_mask`` and per-token logprobs;
  :class:`BrokenEpisodeError` for an episode that is several sequences.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any, cast

import attrs

from trio_rollouts import ChatMessage, GenerationArgs, Problem, Rollout, TokenRollout

__all__ = [
    "BrokenEpisodeError",
    "Completion",
    "answers_from",
    "chat_prompt",
    "completion_of",
    "finish_reason",
    "problem_id_of",
    "problems_from",
    "prompt_key",
    "trainer_generation_args",
]


class BrokenEpisodeError(ValueError):
    """A rollout is several token sequences (an episode whose template broke, so
    ``MultiTurnAgent`` split it into trajectory elements), and ``GRPOTrainer`` takes one
    prompt and one completion per sample: it has no form for it."""


# --------------------------------------------------------------------------- prompts


def prompt_key(prompt: object) -> str:
    """The key a TRL prompt's answer is looked up by: a standard prompt (a string) is its
    own key; a conversational prompt (a list of ``{"role", "content"}`` messages) is the
    JSON text of its messages (keys sorted). Anything else is a ``TypeError``."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(m, Mapping) for m in prompt):
        messages = [dict(message) for message in prompt]
        return json.dumps(messages, sort_keys=True, ensure_ascii=False, default=str)
    msg = (
        "a TRL prompt must be a str or a non-empty list of message dicts, got "
        f"{type(prompt).__name__} {prompt!r:.80}"
    )
    raise TypeError(msg)


def chat_prompt(prompt: object) -> str | list[ChatMessage]:
    """A TRL prompt as a :class:`~trio_rollouts.Problem` prompt: a string as it is, a
    conversational prompt as :class:`~trio_rollouts.ChatMessage` objects (text content
    only: a ``TypeError`` names a message whose content is not a string)."""
    if isinstance(prompt, str):
        return prompt
    prompt_key(prompt)  # the shape check: a non-empty list of mappings
    items = cast("list[Mapping[str, Any]]", prompt)
    messages = []
    for i, message in enumerate(items):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            msg = (
                f"prompt message {i} must have a str role and str content (text prompts "
                f"only), got {message!r:.80}"
            )
            raise TypeError(msg)
        messages.append(ChatMessage(role=role, content=content))
    return messages


def problem_id_of(key: str) -> str:
    """A stable problem id for a prompt key: ``"trl:"`` and 16 hex digits of its
    SHA-256."""
    return "trl:" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


def _rows(dataset: object, columns: tuple[str, ...]) -> Iterable[tuple[int, Mapping[str, Any]]]:
    if isinstance(dataset, (str, bytes, Mapping)) or not isinstance(dataset, Iterable):
        msg = (
            "dataset must be an iterable of rows (a datasets.Dataset, or a list of dicts), "
            f"got {type(dataset).__name__}"
        )
        raise TypeError(msg)
    for i, row in enumerate(dataset):
        if not isinstance(row, Mapping):
            msg = f"dataset row {i} must be a mapping of columns, got {type(row).__name__}"
            raise TypeError(msg)
        missing = [column for column in columns if column not in row]
        if missing:
            msg = (
                f"dataset row {i} has no column {missing[0]!r} (it has {sorted(row)}); pass "
                "the column names the dataset uses"
            )
            raise ValueError(msg)
        yield i, row


def answers_from(
    dataset: object, column: str = "answer", *, prompt_column: str = "prompt"
) -> dict[str, Any]:
    """The answers of a TRL dataset by prompt: ``{prompt_key(row[prompt_column]):
    row[column]}``, the lookup :func:`~trio_rollouts.integrations.trl.rollout_func`'s
    ``answers=`` takes. Two rows with the same prompt and different answers are a
    ``ValueError`` (a rollout function sees only the prompt, so it could not tell which
    answer a group is about)."""
    answers: dict[str, Any] = {}
    first: dict[str, int] = {}
    for i, row in _rows(dataset, (prompt_column, column)):
        key = prompt_key(row[prompt_column])
        if key in answers and answers[key] != row[column]:
            msg = (
                f"dataset rows {first[key]} and {i} have the same prompt ({key!r:.60}) and "
                f"different answers ({answers[key]!r:.40} and {row[column]!r:.40}); the "
                "answer of a prompt must be unique"
            )
            raise ValueError(msg)
        answers[key] = row[column]
        first.setdefault(key, i)
    return answers


def problems_from(
    dataset: object,
    column: str | None = "answer",
    *,
    prompt_column: str = "prompt",
    id_column: str | None = None,
) -> list[Problem]:
    """A TRL dataset's rows as :class:`~trio_rollouts.Problem` objects (for a
    :class:`~trio_rollouts.PromptSource`, the streaming route's prompts): the prompt
    from ``prompt_column``, the answer from ``column`` (``None``: no answer), the id
    from ``id_column`` (as a string) or else the row's index."""
    columns = tuple(c for c in (prompt_column, column, id_column) if c is not None)
    return [
        Problem(
            problem_id=str(row[id_column]) if id_column is not None else str(i),
            prompt=chat_prompt(row[prompt_column]),
            answer=None if column is None else row[column],
        )
        for i, row in _rows(dataset, columns)
    ]


# --------------------------------------------------------------------------- generation


def trainer_generation_args(args: object, requested: GenerationArgs, where: str) -> GenerationArgs:
    """The generation arguments for a request under a TRL config ``args``: its
    ``max_completion_length`` as ``max_tokens``, its ``temperature``, ``top_p`` (below
    1) and ``top_k`` (above 0), each replaced by the request's own when it sets it.

    A request temperature other than the config's is a ``ValueError``: TRL scores every
    completion at its own temperature, so completions sampled at another one would be
    trained as if the policy had made them."""
    temperature = getattr(args, "temperature", None)
    top_p = getattr(args, "top_p", None)
    top_k = getattr(args, "top_k", None)
    max_tokens = getattr(args, "max_completion_length", None)
    defaults = GenerationArgs(
        temperature=float(temperature) if isinstance(temperature, (int, float)) else None,
        top_p=float(top_p) if isinstance(top_p, (int, float)) and top_p < 1 else None,
        top_k=top_k if isinstance(top_k, int) and top_k > 0 else None,
        max_tokens=max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else None,
    )
    if (
        requested.temperature is not None
        and defaults.temperature is not None
        and requested.temperature != defaults.temperature
    ):
        msg = (
            f"{where}: the request's generation_args.temperature={requested.temperature!r} "
            f"differs from the TRL config's temperature={defaults.temperature!r}, at which TRL "
            "scores the completions; set one of them to the other (or leave the request's "
            "unset)"
        )
        raise ValueError(msg)
    return defaults.add(requested)


# --------------------------------------------------------------------------- rollouts


@attrs.frozen
class Completion:
    """One rollout as ``GRPOTrainer``'s ``rollout_func`` returns a sample."""

    prompt_ids: list[int]
    completion_ids: list[int]
    #: 1 on the ids the model sampled, 0 on the others (tool results, template ids).
    env_mask: list[int]
    #: One per completion id: the sampled logprob, 0.0 where ``env_mask`` is 0.
    logprobs: list[float] | None
    #: The rollout's reward as one number (``TokenRollout.scalar_reward``).
    reward: float


def finish_reason(rollout: Rollout | TokenRollout) -> str | None:
    """Why the rollout's last model turn stopped, as its agent recorded it: a
    ``MultiTurnAgent`` episode's last turn (``extra["episode"]["per_turn"]``), a
    ``RewardOnlyAgent`` rollout's ``extra["finish_reason"]``; ``None`` when unknown."""
    episode = rollout.extra.get("episode")
    if isinstance(episode, Mapping):
        turns = episode.get("per_turn")
        if isinstance(turns, list) and turns and isinstance(turns[-1], Mapping):
            reason = turns[-1].get("finish_reason")
            return reason if isinstance(reason, str) else None
    reason = rollout.extra.get("finish_reason")
    return reason if isinstance(reason, str) else None


def completion_of(rollout: Rollout | TokenRollout, where: str) -> Completion:
    """``rollout`` cut at its first generated id: the ids before it are the prompt, the
    rest the completion, with ``env_mask`` from the rollout's ``generation_mask`` and the
    logprobs spread over the completion.

    Raises ``TypeError`` for a text :class:`~trio_rollouts.Rollout`,
    :class:`BrokenEpisodeError` for a rollout of several elements, ``ValueError`` for one
    without a ``generation_mask`` or without a generated id."""
    if not isinstance(rollout, TokenRollout):
        msg = (
            f"{where} is a text Rollout: TRL trains on token ids, so the agent must make "
            "TokenRollouts (a backend that returns token ids, ReturnsTokens)"
        )
        raise TypeError(msg)
    if len(rollout.trajectory) != 1:
        episode = rollout.extra.get("episode")
        breaks = episode.get("breaks") if isinstance(episode, Mapping) else None
        msg = (
            f"{where} is {len(rollout.trajectory)} token sequences, not one (an episode whose "
            f"chat template broke {breaks if breaks is not None else 'some'} time(s): the "
            "renderer's bridge gave None, or the environment changed its tools, so the "
            "agent started a new trajectory element), and GRPOTrainer takes one prompt and "
            "one completion per sample. Fix: keep the episode one sequence (a renderer "
            "whose template only appends, such as one that keeps earlier reasoning; a fixed "
            "tool set; MultiTurnAgent(on_break='raise') to fail at the break itself), or "
            "train it with AsyncGRPOTrainer and trio_rollouts.integrations.trl.RolloutWorker, "
            "which gives each element its own row, as TRL does with the rows of a forked "
            "conversation"
        )
        raise BrokenEpisodeError(msg)
    ids = rollout.trajectory[0]
    if rollout.generation_mask is None:
        msg = (
            f"{where} has no generation_mask, so its prompt ids are unknown; TRL needs the "
            "prompt and the completion apart (build TokenRollouts with a generation_mask)"
        )
        raise ValueError(msg)
    mask = rollout.generation_mask[0]
    first = next((i for i, generated in enumerate(mask) if generated), None)
    if first is None:
        msg = f"{where} has no generated id: TRL needs at least one completion id per sample"
        raise ValueError(msg)
    env_mask = [int(generated) for generated in mask[first:]]
    logprobs = None
    if rollout.logprobs is not None:
        sampled = iter(rollout.logprobs[0])
        logprobs = [float(next(sampled)) if generated else 0.0 for generated in env_mask]
    return Completion(
        prompt_ids=list(ids[:first]),
        completion_ids=list(ids[first:]),
        env_mask=env_mask,
        logprobs=logprobs,
        reward=rollout.scalar_reward,
    )
