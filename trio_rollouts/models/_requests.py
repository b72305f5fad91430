"""Requests: what a trainer asks an agent for, and with which inference interface.

:class:`Request` carries the generation arguments; :class:`RolloutRequest`,
:class:`GroupedRolloutRequest` (GRPO groups, the pipeline's request),
:class:`Head2HeadRolloutRequest` and :class:`EvaluationRequest` add what each kind of
work needs. Every field is checked where the request is made (``TypeError`` for a wrong
type, ``ValueError`` for one out of range, naming the field and the value). The
``rank_info`` checks live here and are shared with
:class:`~trio_rollouts.models.EvaluationResponse`, which records the shard it answers.
"""

from __future__ import annotations

from typing import Any

import attrs

from trio_rollouts._checks import check_bool as _check_bool
from trio_rollouts._checks import int_at_least as _int_at_least
from trio_rollouts._checks import is_int as _is_int
from trio_rollouts._checks import optional_int_at_least as _optional_int_at_least
from trio_rollouts._messages import GenerationArgs
from trio_rollouts.inference._interface import InferenceInterface

__all__ = [
    "SAMPLING_CHECKS",
    "EvaluationRequest",
    "GroupedRolloutRequest",
    "Head2HeadRolloutRequest",
    "Request",
    "RolloutRequest",
    "check_rank_info",
    "to_rank_info",
]


def _check_interface(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, InferenceInterface):
        msg = (
            f"{attribute.name} must be an InferenceInterface, got "
            f"{type(value).__name__} {value!r:.80}"
        )
        raise TypeError(msg)


def _check_generation_args(
    instance: object, attribute: attrs.Attribute[Any], value: object
) -> None:
    if not isinstance(value, GenerationArgs):
        msg = f"generation_args must be a GenerationArgs, got {value!r}"
        raise TypeError(msg)


#: What :attr:`GroupedRolloutRequest.sampling_check` may say.
SAMPLING_CHECKS = ("warn", "raise", "off")


def _check_sampling_check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in SAMPLING_CHECKS:
        allowed = ", ".join(repr(check) for check in SAMPLING_CHECKS)
        msg = f"sampling_check must be one of {allowed}, got {value!r:.40}"
        raise ValueError(msg)


def _check_run_seed(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if not _is_int(value):
        msg = f"seed must be an int or None (the run's seed), got {value!r:.40}"
        raise TypeError(msg)


@attrs.define(kw_only=True)
class Request:
    """Base of every request to an agent: the generation arguments to use."""

    generation_args: GenerationArgs = attrs.field(
        factory=GenerationArgs, validator=_check_generation_args
    )


@attrs.define(kw_only=True)
class RolloutRequest(Request):
    """Ask an agent for ``num_rollouts`` independent rollouts."""

    num_rollouts: int = attrs.field(validator=_int_at_least(1))
    inference_interface: InferenceInterface = attrs.field(validator=_check_interface)
    validation: bool = attrs.field(default=False, validator=_check_bool)


@attrs.define(kw_only=True)
class GroupedRolloutRequest(Request):
    """Ask an agent for groups of rollouts (GRPO): ``num_groups`` groups per batch, each of
    ``rollouts_per_group`` rollouts. See :meth:`GroupedRolloutGenerator.get_grouped_rollouts`
    for what ``streaming``, ``enforce_order`` and ``filter_groups_with_same_reward`` do.

    Weight updates (see :meth:`RolloutStream.weight_update`): ``initial_epoch`` is the
    stream's first policy epoch (``None``: the interface's ``policy_epoch`` when it is
    :class:`~trio_rollouts.inference.Pausable`, else 0; an explicit value is given to a
    Pausable interface when the stream opens). ``max_staleness`` bounds how many epochs
    older than the stream's a delivered group's ``start_epoch`` may be (``None``: no
    bound).

    What the server says about each sample: ``sampling_check`` (``"warn"``, the
    default, ``"raise"`` or ``"off"``) says what to do when the stream opens and a
    replica would return log-probabilities that are not those of the distribution it
    sampled from (raw logprobs with ``temperature != 1``; ``top_p < 1`` or ``top_k``
    without a sampling mask): one :class:`~trio_rollouts.SamplingBiasWarning` per replica
    and combination, or :class:`~trio_rollouts.SamplingBiasError` before any work.
    ``seed``: the run's seed; when set, every inference request gets a seed of its own,
    a stable hash of (``seed``, the epoch it starts under, the problem's id, the member's
    index in its group, the turn, the continuation), so a replayed or resumed run sends
    the same seeds and no two requests of a run share one (``None``: no seed is sent,
    unless ``generation_args.seed`` sets one for every request).

    ``group_calls`` (default ``True``): when the interface is
    :class:`~trio_rollouts.inference.GeneratesGroups`, :class:`~trio_rollouts.RewardOnlyAgent`
    asks for a group's completions in one call (vLLM's ``n``: the prompt is prefilled
    once), and :class:`~trio_rollouts.MultiTurnAgent` its episodes' first turns when they
    are the same request; ``False`` sends one call per member.

    The long tail (``docs/weight-updates.md``, "The long tail"), in the library's agents:
    ``extra_rollouts`` (default 0) starts ``rollouts_per_group + extra_rollouts`` members,
    one call each, and keeps the first ``rollouts_per_group`` to finish (the others are
    cut: it favours fast, often short, answers); with ``max_staleness`` and one call per
    member (``group_calls=False``, or extras), members still running when their group
    reaches the bound at a ``keep``/``abort`` update are cut and sampled again under the
    new epoch. Every cut is in ``RolloutGroup.cuts`` and ``statistics().cut``. Custom
    agents see ``extra_rollouts`` as a field only."""

    num_groups: int = attrs.field(validator=_int_at_least(1))
    rollouts_per_group: int = attrs.field(validator=_int_at_least(1))
    inference_interface: InferenceInterface = attrs.field(validator=_check_interface)
    validation: bool = attrs.field(default=False, validator=_check_bool)
    filter_groups_with_same_reward: bool = attrs.field(default=False, validator=_check_bool)
    streaming: bool = attrs.field(default=False, validator=_check_bool)
    enforce_order: bool = attrs.field(default=False, validator=_check_bool)
    initial_epoch: int | None = attrs.field(default=None, validator=_optional_int_at_least(0))
    max_staleness: int | None = attrs.field(default=None, validator=_optional_int_at_least(0))
    sampling_check: str = attrs.field(default="warn", validator=_check_sampling_check)
    seed: int | None = attrs.field(default=None, validator=_check_run_seed)
    group_calls: bool = attrs.field(default=True, validator=_check_bool)
    extra_rollouts: int = attrs.field(default=0, validator=_int_at_least(0))


def _check_interface_list(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, list) or not value:
        msg = f"inference_interface must be a non-empty list of InferenceInterface, got {value!r}"
        raise TypeError(msg)
    for i, item in enumerate(value):
        if not isinstance(item, InferenceInterface):
            msg = (
                f"inference_interface[{i}] must be an InferenceInterface, got "
                f"{type(item).__name__} {item!r:.80}"
            )
            raise TypeError(msg)


@attrs.define(kw_only=True)
class Head2HeadRolloutRequest(Request):
    """Send the same prompts to several interfaces and compare their rewards."""

    num_rollouts: int = attrs.field(validator=_int_at_least(1))
    inference_interface: list[InferenceInterface] = attrs.field(validator=_check_interface_list)
    validation: bool = attrs.field(default=False, validator=_check_bool)


def check_rank_info(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """An attrs validator: ``None`` or a ``(rank, world_size)`` tuple of ints with
    ``0 <= rank < world_size``."""
    if value is None:
        return
    if not isinstance(value, tuple) or len(value) != 2 or not all(_is_int(v) for v in value):
        msg = f"rank_info must be a (rank, world_size) tuple of ints or None, got {value!r}"
        raise TypeError(msg)
    rank, world = value
    if world < 1:
        msg = f"rank_info world_size must be >= 1, got {world!r} in rank_info={value!r}"
        raise ValueError(msg)
    if not 0 <= rank < world:
        msg = f"rank_info rank must be in [0, {world}), got {rank!r} in rank_info={value!r}"
        raise ValueError(msg)


def to_rank_info(value: object) -> object:
    """An attrs converter for ``rank_info``: a list (from JSON or argparse) becomes a tuple
    (which :func:`check_rank_info` then checks); anything else is left as it is."""
    if isinstance(value, list):
        return tuple(value)
    return value


@attrs.define(kw_only=True)
class EvaluationRequest(Request):
    """Evaluate ``num_prompts`` prompts; ``rank_info=(rank, world_size)`` evaluates this
    rank's shard only (``None``: all of them)."""

    inference_interface: InferenceInterface = attrs.field(validator=_check_interface)
    num_prompts: int = attrs.field(validator=_int_at_least(0))
    rank_info: tuple[int, int] | None = attrs.field(
        default=None, converter=to_rank_info, validator=check_rank_info
    )
    validation: bool = attrs.field(default=True, validator=_check_bool)
