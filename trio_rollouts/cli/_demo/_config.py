"""The demo's settings, :class:`DemoConfig`, checked when they are made."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs

from trio_rollouts._checks import int_at_least, is_int, is_real, non_negative_seconds
from trio_rollouts.inference import WEIGHT_UPDATE_MODES, LatencyModel, WeightUpdateMode

__all__ = ["DemoConfig", "check_mode", "check_positive", "count_at_least"]


def check_positive(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    # _checks has no "real > 0" validator (seconds(positive=True) speaks of seconds).
    if not is_real(value):
        msg = f"{attribute.name} must be a number > 0, got {value!r}"
        raise TypeError(msg)
    if not value > 0:  # type: ignore[operator]
        msg = f"{attribute.name} must be > 0, got {value!r}"
        raise ValueError(msg)


def check_mode(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    allowed = ", ".join(repr(m) for m in ("drain", "restart", "keep", "abort"))
    if not isinstance(value, str):
        msg = f"{attribute.name} must be one of {allowed}, got {value!r}"
        raise TypeError(msg)
    if value not in WEIGHT_UPDATE_MODES:
        msg = f"{attribute.name} must be one of {allowed}, got {value!r}"
        raise ValueError(msg)


def count_at_least(minimum: int, *, optional: bool = False) -> Any:
    """``int_at_least`` (``optional``: ``optional_int_at_least``), with the out-of-range
    message that ``checkpoint_every`` and ``max_staleness`` have always given ("must be
    an int >= 1"; the shared validators say "must be >= 1")."""
    allowed = f"None or an int >= {minimum}" if optional else f"an int >= {minimum}"

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is None and optional:
            return
        if not is_int(value):
            msg = f"{attribute.name} must be {allowed}, got {value!r}"
            raise TypeError(msg)
        if value < minimum:  # type: ignore[operator]
            msg = f"{attribute.name} must be {allowed}, got {value!r}"
            raise ValueError(msg)

    return check


def _to_optional_path(value: str | os.PathLike[str] | None) -> Path | None:
    return None if value is None else Path(value)


@attrs.frozen(kw_only=True)
class DemoConfig:
    """The demo's settings; the defaults learn from chance to above 0.9 accuracy.

    ``lag`` is how many batches are outstanding at once
    (``parallel_generation_tasks = lag * groups_per_step``): while the trainer works on
    one batch, the next ``lag`` are being generated, so a rollout is at most ``lag``
    updates old. ``train_seconds`` is how long computing one update "takes" on the run's
    clock: generation goes on meanwhile, with the old weights.

    The trainer then applies the update inside
    ``stream.weight_update(mode=update_mode)`` (see :meth:`RolloutStream.weight_update`):
    ``"keep"`` (the default) holds the calls in flight for the update and continues them
    under the new weights, so generation barely stops and a rollout can span an update,
    as with an engine whose weights are swapped in place; ``"abort"`` stops them with
    their partial output and continues them after it (a new prefill); ``"drain"`` lets
    them finish under the old weights first; ``"restart"`` cancels and regenerates them.
    ``max_staleness`` (``GroupedRolloutRequest.max_staleness``) regenerates any group
    that would reach the trainer more than that many policy epochs after the epoch it
    started under; ``0`` trains on-policy only. ``None``: no bound but ``lag``.

    ``checkpoint_dir`` makes the run resumable (see :func:`run_demo`): the problems are
    drawn from a :class:`~trio_rollouts.PromptSource` over the environment's problems
    (seeded by ``seed``, so the run differs from one without a checkpoint directory),
    and a checkpoint is saved there every ``checkpoint_every`` steps and at the last.
    A run may resume a checkpoint written with other ``steps``, ``checkpoint_dir`` and
    ``checkpoint_every``, never with other values of the other fields. On a virtual
    clock a seed (and the step a run resumed from) still fixes every number, unless
    calls in flight are cancelled (``"restart"``, or ``max_staleness``): the problems
    they drew are drawn again in the order the calls unwind, which Trio varies.
    """

    seed: int = attrs.field(default=0, validator=int_at_least(0))
    steps: int = attrs.field(default=36, validator=int_at_least(1))
    groups_per_step: int = attrs.field(default=8, validator=int_at_least(1))
    group_size: int = attrs.field(default=8, validator=int_at_least(2))
    lag: int = attrs.field(default=2, validator=int_at_least(1))
    num_problems: int = attrs.field(default=32, validator=int_at_least(1))
    num_candidates: int = attrs.field(default=8, validator=int_at_least(2))
    learning_rate: float = attrs.field(default=2.0, validator=check_positive)
    clip: float = attrs.field(default=0.2, validator=check_positive)
    filter_groups: bool = True
    train_seconds: float = attrs.field(default=0.05, validator=non_negative_seconds)
    latency: LatencyModel = attrs.field(
        factory=lambda: LatencyModel(first_token=0.03, per_token=0.01)
    )
    update_mode: WeightUpdateMode = attrs.field(default="keep", validator=check_mode)
    max_staleness: int | None = attrs.field(
        default=None, validator=count_at_least(0, optional=True)
    )
    checkpoint_dir: Path | None = attrs.field(default=None, converter=_to_optional_path)
    checkpoint_every: int = attrs.field(default=5, validator=count_at_least(1))
