"""Rollouts and the groups they come in: what the pipeline delivers to a trainer.

:class:`Rollout` (text) and :class:`TokenRollout` (token ids, generation mask,
log-probabilities, the epochs and :class:`SamplingSpan` records the backend stamped) are
one sample each; :class:`RolloutGroup` is GRPO's unit, the rollouts of one prompt with
their place in the batch, the :class:`Cut` members the library's agents did not keep and
numpy reward helpers; :class:`ContrastiveRollout` is a preference pair.
:func:`checked_group` builds a group without its validators for the pipeline's hot path.
Every value is checked where it is made, naming the field and the value; unknown keys are
kept in ``extra`` (see ``Record`` in ``trio_rollouts._messages``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, overload

import attrs
import numpy as np
import numpy.typing as npt

from trio_rollouts._checks import check_optional_str as _check_optional_str
from trio_rollouts._checks import check_str as _check_str
from trio_rollouts._checks import int_at_least as _int_at_least
from trio_rollouts._checks import is_int as _is_int
from trio_rollouts._checks import is_real as _is_real
from trio_rollouts._messages import (
    GenerationArgs,
    Record,
    check_list,
    check_optional_float,
)
from trio_rollouts.inference._sampling import LOGPROBS_MODES

__all__ = [
    "FIDELITY_LEVELS",
    "ContrastiveRollout",
    "Cut",
    "Rollout",
    "RolloutGroup",
    "SamplingSpan",
    "TokenRollout",
    "checked_group",
]


def _per_element(name: str, values: Sequence[Any], n: int) -> None:
    """A non-empty per-trajectory-element list has exactly one entry per element."""
    if values and len(values) != n:
        msg = (
            f"{name} has {len(values)} entries but trajectory has {n} elements; "
            f"it must be empty or have one entry per trajectory element"
        )
        raise ValueError(msg)


@attrs.define(kw_only=True)
class Rollout(Record):
    """A text rollout: the trajectory's strings and its reward.

    ``policy_epoch[i]`` / ``kv_cache_epoch[i]`` list the ``(start_token_index, epoch)``
    boundaries the inference engine stamped on trajectory element ``i``.
    """

    trajectory: list[str] = attrs.field(validator=check_list)
    prompt_length: list[int] | None = None
    reward: float | None = attrs.field(default=None, validator=check_optional_float)
    env_id: str = attrs.field(default="", validator=_check_str)
    problem_id: str | None = attrs.field(default=None, validator=_check_optional_str)
    policy_epoch: list[list[tuple[int, int]]] = attrs.field(factory=list, validator=check_list)
    kv_cache_epoch: list[list[tuple[int, int]]] = attrs.field(factory=list, validator=check_list)
    num_evictions: list[int] = attrs.field(factory=list, validator=check_list)

    def __attrs_post_init__(self) -> None:
        n = len(self.trajectory)
        if self.prompt_length is not None:
            _per_element("prompt_length", self.prompt_length, n)
        _per_element("policy_epoch", self.policy_epoch, n)
        _per_element("kv_cache_epoch", self.kv_cache_epoch, n)
        _per_element("num_evictions", self.num_evictions, n)


def _check_token_reward(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if _is_real(value):
        return
    if isinstance(value, list) and all(_is_real(v) for v in value):
        return
    msg = f"reward must be a float or a list of floats, got {value!r:.80}"
    raise TypeError(msg)


#: How faithfully a multi-turn rollout's ids are the ids the model sampled, best first.
FIDELITY_LEVELS = ("exact", "server_tokens", "retokenized")


def _check_fidelity(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and value not in FIDELITY_LEVELS:
        allowed = ", ".join(repr(level) for level in FIDELITY_LEVELS)
        msg = f"fidelity must be None or one of {allowed}, got {value!r:.40}"
        raise ValueError(msg)


def _check_span_start(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not _is_int(value):
        msg = f"SamplingSpan.start must be an int >= 0 (an element position), got {value!r:.40}"
        raise TypeError(msg)
    if value < 0:  # type: ignore[operator]
        msg = f"SamplingSpan.start must be an int >= 0 (an element position), got {value!r}"
        raise ValueError(msg)


def _check_span_args(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, GenerationArgs):
        msg = f"SamplingSpan.args must be a GenerationArgs, got {value!r:.80}"
        raise TypeError(msg)


def _check_span_seed(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not _is_int(value):
        msg = f"SamplingSpan.seed must be an int or None, got {value!r:.40}"
        raise TypeError(msg)


def _check_logprobs_mode(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in LOGPROBS_MODES:
        allowed = ", ".join(repr(mode) for mode in LOGPROBS_MODES)
        msg = f"SamplingSpan.logprobs_mode must be one of {allowed}, got {value!r:.40}"
        raise ValueError(msg)


@attrs.frozen(kw_only=True)
class SamplingSpan:
    """How a run of generated ids was sampled: from element position ``start`` on (the
    position of its first generated id, prompt included), with ``args`` (the request's
    :class:`GenerationArgs`, as sent), the request's ``seed`` (``None``: none was sent)
    and the server's ``logprobs_mode`` (``"processed"``, ``"raw"`` or ``"unknown"``; see
    :class:`~trio_rollouts.inference.ReplicaProbe`). ``sampling_mask``: the server's
    record of the tokens its sampler kept, when it sent one (vLLM's
    ``--return-sampling-mask``), else ``None`` and left out of JSON."""

    start: int = attrs.field(validator=_check_span_start)
    args: GenerationArgs = attrs.field(factory=GenerationArgs, validator=_check_span_args)
    seed: int | None = attrs.field(default=None, validator=_check_span_seed)
    logprobs_mode: str = attrs.field(default="unknown", validator=_check_logprobs_mode)
    sampling_mask: Any = attrs.field(default=None, metadata={"omit_if_none": True})


def _check_sampling(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if not isinstance(value, list) or not all(
        isinstance(spans, list) and all(isinstance(span, SamplingSpan) for span in spans)
        for spans in value
    ):
        msg = (
            "sampling must be None or a list (one per trajectory element) of lists of "
            f"SamplingSpan, got {value!r:.80}"
        )
        raise TypeError(msg)


@attrs.define(kw_only=True)
class TokenRollout(Record):
    """A tokenized rollout: token ids per trajectory element, which of them the policy
    generated (``generation_mask``) and their log-probabilities.

    ``fidelity`` (multi-turn episodes): ``"exact"`` when every turn's ids are the ones the
    backend sampled from ids it was given, ``"server_tokens"`` when the server rendered
    the chat and returned its ids, ``"retokenized"`` when the text was tokenized again;
    ``None`` elsewhere, and then left out of :func:`~trio_rollouts.unstructure`'s output.

    ``sampling``: per trajectory element, the :class:`SamplingSpan` of each run of
    generated ids sampled alike (one per turn; a single-turn rollout has one at its
    prompt length): the generation arguments, seed and log-probability mode the ids were
    sampled with; ``None`` when unknown (and then left out of JSON).

    ``logprobs[i]`` holds one value per *generated* token of element ``i`` (the ``True``
    entries of ``generation_mask[i]``; every token when there is no mask), as inference
    engines return them.
    """

    trajectory: list[list[int]] = attrs.field(validator=check_list)
    reward: list[float] | float = attrs.field(validator=_check_token_reward)
    generation_mask: list[list[bool]] | None = None
    logprobs: list[list[float]] | None = None
    env_id: str = attrs.field(default="", validator=_check_str)
    problem_id: str | None = attrs.field(default=None, validator=_check_optional_str)
    policy_epoch: list[list[tuple[int, int]]] = attrs.field(factory=list, validator=check_list)
    kv_cache_epoch: list[list[tuple[int, int]]] = attrs.field(factory=list, validator=check_list)
    num_evictions: list[int] = attrs.field(factory=list, validator=check_list)
    fidelity: str | None = attrs.field(
        default=None, validator=_check_fidelity, metadata={"omit_if_none": True}
    )
    sampling: list[list[SamplingSpan]] | None = attrs.field(
        default=None, validator=_check_sampling, metadata={"omit_if_none": True}
    )

    def __attrs_post_init__(self) -> None:
        n = len(self.trajectory)
        if self.sampling is not None:
            _per_element("sampling", self.sampling, n)
        if self.generation_mask is not None:
            if len(self.generation_mask) != n:
                msg = (
                    f"generation_mask has {len(self.generation_mask)} entries but trajectory "
                    f"has {n} elements; it must have one entry per trajectory element"
                )
                raise ValueError(msg)
            for i, (tokens, mask) in enumerate(
                zip(self.trajectory, self.generation_mask, strict=True)
            ):
                if len(mask) != len(tokens):
                    msg = (
                        f"generation_mask[{i}] has {len(mask)} entries but trajectory[{i}] "
                        f"has {len(tokens)} tokens; they must be equal"
                    )
                    raise ValueError(msg)
        if self.logprobs is not None:
            if len(self.logprobs) != n:
                msg = (
                    f"logprobs has {len(self.logprobs)} entries but trajectory has {n} "
                    f"elements; it must have one entry per trajectory element"
                )
                raise ValueError(msg)
            for i, lps in enumerate(self.logprobs):
                if self.generation_mask is not None:
                    # count() runs in C; sum() over a 1,024-entry mask is several times slower.
                    expected = self.generation_mask[i].count(True)
                    what = f"generated tokens (True entries of generation_mask[{i}])"
                else:
                    expected = len(self.trajectory[i])
                    what = f"tokens in trajectory[{i}] (no generation_mask)"
                if len(lps) != expected:
                    msg = f"logprobs[{i}] has {len(lps)} entries but there are {expected} {what}"
                    raise ValueError(msg)
        _per_element("policy_epoch", self.policy_epoch, n)
        _per_element("kv_cache_epoch", self.kv_cache_epoch, n)
        _per_element("num_evictions", self.num_evictions, n)

    @property
    def scalar_reward(self) -> float:
        """The reward as one number (a list reward is summed into the trajectory's return)."""
        if isinstance(self.reward, list):
            return float(sum(self.reward))
        return float(self.reward)


def _rollout_reward(rollout: Rollout | TokenRollout) -> float | None:
    if isinstance(rollout, TokenRollout):
        return rollout.scalar_reward
    return rollout.reward


def _check_rollouts(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, list):
        msg = f"rollouts must be a list of Rollout or TokenRollout, got {value!r:.80}"
        raise TypeError(msg)
    if not value:
        msg = "rollouts must not be empty: a group needs at least one rollout"
        raise ValueError(msg)
    for i, r in enumerate(value):
        if not isinstance(r, (Rollout, TokenRollout)):
            msg = f"rollouts[{i}] must be a Rollout or TokenRollout, got {type(r).__name__}"
            raise TypeError(msg)


class Cut(NamedTuple):
    """A member of a group that the library's agents cancelled and did not keep (see
    :attr:`RolloutGroup.cuts`)."""

    #: Tokens it had generated when it was cancelled, as its backend reported them
    #: (``None``: the backend cannot tell, as for an HTTP server's cancelled request).
    generated_tokens: int | None
    #: How long it had run, in seconds of Trio's clock.
    elapsed_seconds: float
    #: The policy epoch it started under.
    epoch: int


def _cuts(value: object) -> object:
    # JSON gives lists; a list of cuts is kept as a tuple of Cut.
    if isinstance(value, list | tuple) and not isinstance(value, Cut):
        return tuple(
            Cut(*item) if isinstance(item, list | tuple) and not isinstance(item, Cut) else item
            for item in value
        )
    return value


def _is_cut(cut: object) -> bool:
    if not isinstance(cut, Cut):
        return False
    tokens, elapsed, epoch = cut
    return (
        (tokens is None or (_is_int(tokens) and tokens >= 0))
        and _is_real(elapsed)
        and elapsed >= 0
        and _is_int(epoch)
        and epoch >= 0
    )


def _check_cuts(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, tuple) or not all(_is_cut(cut) for cut in value):
        msg = (
            "cuts must be a list of (generated_tokens: int >= 0 or None, "
            f"elapsed_seconds: number >= 0, epoch: int >= 0), got {value!r:.120}"
        )
        raise TypeError(msg)


@attrs.define(kw_only=True)
class RolloutGroup(Record):
    """A group of rollouts for one prompt (GRPO's unit), with its place in the batch.

    Iterable, sized and indexable like the list of rollouts it wraps. The reward helpers
    use numpy and refuse missing or non-finite rewards with an error naming the rollout's
    environment and problem, instead of producing NaN.
    """

    rollouts: list[Rollout | TokenRollout] = attrs.field(validator=_check_rollouts)
    batch_id: int = attrs.field(default=0, validator=_int_at_least(0))
    index_in_batch: int = attrs.field(default=0, validator=_int_at_least(0))
    #: The stream's policy epoch when the ``group_rollout`` call that made the group
    #: started (see ``GroupedRolloutRequest.max_staleness``).
    start_epoch: int = attrs.field(default=0, validator=_int_at_least(0))
    #: The members the library's agents started for this group and did not keep, one
    #: :class:`Cut` ``(generated_tokens, elapsed_seconds, epoch)`` each: beyond
    #: ``rollouts_per_group`` with ``extra_rollouts``, or still running when the group
    #: reached the staleness bound (``docs/weight-updates.md``, "The long tail").
    cuts: tuple[Cut, ...] = attrs.field(default=(), converter=_cuts, validator=_check_cuts)

    def __iter__(self) -> Iterator[Rollout | TokenRollout]:
        return iter(self.rollouts)

    def __len__(self) -> int:
        return len(self.rollouts)

    @overload
    def __getitem__(self, index: int) -> Rollout | TokenRollout: ...
    @overload
    def __getitem__(self, index: slice) -> list[Rollout | TokenRollout]: ...
    def __getitem__(
        self, index: int | slice
    ) -> Rollout | TokenRollout | list[Rollout | TokenRollout]:
        return self.rollouts[index]

    def rewards(self) -> npt.NDArray[np.float64]:
        """The group's rewards as a float64 array.

        Raises ``ValueError`` naming the rollout (index, ``env_id``, ``problem_id``) when a
        reward is missing (``None``) or not finite.
        """
        out = np.empty(len(self.rollouts), dtype=np.float64)
        for i, rollout in enumerate(self.rollouts):
            reward = _rollout_reward(rollout)
            if reward is None or not math.isfinite(reward):
                msg = (
                    f"rollout {i} of group (batch_id={self.batch_id}, "
                    f"index_in_batch={self.index_in_batch}) has reward {reward!r} "
                    f"(env_id={rollout.env_id!r}, problem_id={rollout.problem_id!r}); "
                    f"rewards must be finite floats"
                )
                raise ValueError(msg)
            out[i] = reward
        return out

    def reward_mean(self) -> float:
        """Mean reward of the group."""
        return float(self.rewards().mean())

    def reward_std(self) -> float:
        """Population standard deviation of the group's rewards (what filtering uses)."""
        return float(self.rewards().std())

    def advantages(self, eps: float = 1e-6) -> npt.NDArray[np.float64]:
        """GRPO advantages ``(r - mean) / (std + eps)``, with the population std."""
        if not eps >= 0:
            msg = f"eps must be >= 0, got {eps!r}"
            raise ValueError(msg)
        rewards = self.rewards()
        advantages: npt.NDArray[np.float64] = (rewards - rewards.mean()) / (rewards.std() + eps)
        return advantages


@attrs.define(kw_only=True)
class ContrastiveRollout(Record):
    """A preference pair: the chosen and the rejected trajectory."""

    chosen_trajectory: list[str] = attrs.field(validator=check_list)
    rejected_trajectory: list[str] = attrs.field(validator=check_list)


def _slot_setter(name: str) -> Callable[[RolloutGroup, object], None]:
    """The ``__set__`` of RolloutGroup's slot ``name``: setting a slot through its own
    descriptor is about 40% cheaper than ``object.__setattr__`` by name, which looks the
    descriptor up on every call."""
    setter: Callable[[RolloutGroup, object], None] = getattr(RolloutGroup, name).__set__
    return setter


_new_group = object.__new__
_set_extra = _slot_setter("extra")
_set_rollouts = _slot_setter("rollouts")
_set_batch_id = _slot_setter("batch_id")
_set_index_in_batch = _slot_setter("index_in_batch")
_set_start_epoch = _slot_setter("start_epoch")
_set_cuts = _slot_setter("cuts")


def checked_group(
    rollouts: list[Rollout | TokenRollout],
    batch_id: int,
    index_in_batch: int,
    start_epoch: int = 0,
    cuts: tuple[Cut, ...] = (),
) -> RolloutGroup:
    """A :class:`RolloutGroup` built without running its validators: for the pipeline's
    hot path, which has checked the rollouts and makes the slot numbers itself."""
    group = _new_group(RolloutGroup)
    _set_extra(group, {})
    _set_rollouts(group, rollouts)
    _set_batch_id(group, batch_id)
    _set_index_in_batch(group, index_in_batch)
    _set_start_epoch(group, start_epoch)
    _set_cuts(group, cuts)
    return group
