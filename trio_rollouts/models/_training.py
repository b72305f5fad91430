"""Delivered groups as the padded arrays a trainer feeds a model: :class:`TrainingBatch`.

One row per trajectory element of every ``TokenRollout`` of every group, in order, right
padded to the longest row. The arrays line up with the ids (no shift: the docs page
``training-arrays.md`` shows the shift for next-token prediction). numpy only: the
module never imports torch, and ``torch.from_numpy`` takes every array as it is.

Speed: the arrays are allocated once, padded, and each row is filled with slices. A row's
Python lists are converted in C: ids and logprobs with ``struct.pack`` (about twice as
fast as ``np.fromiter``), the mask with ``bytes()``. A mask that is one run of ``True``
at the end (a single-turn completion) is found with two byte scans and filled as a
slice; other masks are written through as a boolean array. No loop runs per token in
Python.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Any, cast

import attrs
import numpy as np
import numpy.typing as npt

from trio_rollouts.models._rollouts import RolloutGroup, TokenRollout

__all__ = ["TrainingBatch"]

_INT64_MAX = int(np.iinfo(np.int64).max)


# --------------------------------------------------------------------------- validators


def _array(dtype: type[np.generic], ndim: int) -> Any:
    """An attrs validator: the field is a numpy array of ``dtype`` with ``ndim`` axes."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, np.ndarray):
            msg = (
                f"{attribute.name} must be a numpy array of {np.dtype(dtype).name}, got "
                f"{type(value).__name__}"
            )
            raise TypeError(msg)
        if value.dtype != dtype:
            msg = f"{attribute.name} must have dtype {np.dtype(dtype).name}, got {value.dtype}"
            raise TypeError(msg)
        if value.ndim != ndim:
            msg = f"{attribute.name} must have {ndim} axes, got shape {value.shape}"
            raise ValueError(msg)

    return check


def _is_int(value: object) -> bool:
    """A Python or numpy integer that is not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_pad_id(pad_id: object) -> int:
    if not _is_int(pad_id):
        msg = f"pad_id must be an int (a token id), got {type(pad_id).__name__} {pad_id!r:.40}"
        raise TypeError(msg)
    value = int(cast("int", pad_id))
    if not 0 <= value <= _INT64_MAX:
        msg = (
            f"pad_id must be a token id in [0, 2**63), got {value}; padding is found by "
            "attention_mask, and -100 is the labels' convention, not an input id"
        )
        raise ValueError(msg)
    return value


# --------------------------------------------------------------------------- the batch


@attrs.frozen(kw_only=True, eq=False)
class TrainingBatch:
    """Delivered groups of ``TokenRollout`` as padded numpy arrays, one row per trajectory
    element, right-padded to the longest row. Build it with :meth:`from_groups`.

    ``N`` is the number of rows (every element of every rollout of every group, in that
    order) and ``L`` the length of the longest element. Every ``(N, L)`` array lines up
    with ``input_ids``: position ``j`` describes id ``j`` (no shift).

    - ``input_ids`` (int64, ``(N, L)``): each element's ids, then ``pad_id``.
    - ``attention_mask`` (bool, ``(N, L)``): ``True`` on the ids, ``False`` on padding.
    - ``loss_mask`` (bool, ``(N, L)``): ``True`` exactly on the generated ids (the
      ``True`` entries of the rollout's ``generation_mask``; every id of a rollout with
      ``generation_mask=None``, as ``TokenRollout`` defines it); ``False`` on prompts,
      tool results, bridges and padding.
    - ``logprobs`` (float32, ``(N, L)``): the sampled logprob on each generated id (the
      element's ``logprobs`` in order), 0.0 elsewhere; all 0.0 on a row whose rollout has
      ``logprobs=None`` (see ``has_logprobs``).
    - ``policy_epoch`` (int64, ``(N, L)``): the policy epoch in force at each id, from
      each ``(start_index, epoch)`` boundary of the element on (starts are positions in
      the element); the group's ``start_epoch`` before the first boundary and on an
      element without boundaries; -1 on padding.
    - ``advantages`` (float32, ``(N, L)``): on generated ids, the GRPO advantage of the
      row's rollout within its group (``RolloutGroup.advantages()``, eps 1e-6, from the
      rollout's ``scalar_reward``); 0.0 elsewhere.
    - ``rewards`` (float32, ``(N,)``): the row's rollout's ``scalar_reward`` (a list
      reward is summed, as ``RolloutGroup.advantages()`` sums it): the same on every row
      of a rollout.
    - ``rows`` (int64, ``(N, 3)``): per row, the group's index in ``groups``, the
      rollout's index in the group and the element's index in the trajectory.
    - ``has_logprobs`` (bool, ``(N,)``): ``False`` on the rows of a rollout whose
      ``logprobs`` is ``None`` (their ``logprobs`` row is 0.0 and means nothing).

    The instance is frozen (no field can be rebound); the arrays are ordinary writable
    arrays, so ``torch.from_numpy`` shares their memory.
    """

    input_ids: npt.NDArray[np.int64] = attrs.field(validator=_array(np.int64, 2))
    attention_mask: npt.NDArray[np.bool_] = attrs.field(validator=_array(np.bool_, 2))
    loss_mask: npt.NDArray[np.bool_] = attrs.field(validator=_array(np.bool_, 2))
    logprobs: npt.NDArray[np.float32] = attrs.field(validator=_array(np.float32, 2))
    policy_epoch: npt.NDArray[np.int64] = attrs.field(validator=_array(np.int64, 2))
    advantages: npt.NDArray[np.float32] = attrs.field(validator=_array(np.float32, 2))
    rewards: npt.NDArray[np.float32] = attrs.field(validator=_array(np.float32, 1))
    rows: npt.NDArray[np.int64] = attrs.field(validator=_array(np.int64, 2))
    has_logprobs: npt.NDArray[np.bool_] = attrs.field(validator=_array(np.bool_, 1))

    def __attrs_post_init__(self) -> None:
        shape = self.input_ids.shape
        for name in ("attention_mask", "loss_mask", "logprobs", "policy_epoch", "advantages"):
            if getattr(self, name).shape != shape:
                msg = (
                    f"{name} has shape {getattr(self, name).shape} but input_ids has "
                    f"{shape}; every per-token array must have input_ids' shape"
                )
                raise ValueError(msg)
        n_rows = shape[0]
        for name, expected in (
            ("rewards", (n_rows,)),
            ("rows", (n_rows, 3)),
            ("has_logprobs", (n_rows,)),
        ):
            if getattr(self, name).shape != expected:
                msg = (
                    f"{name} must have shape {expected} for {n_rows} rows, got "
                    f"{getattr(self, name).shape}"
                )
                raise ValueError(msg)

    @classmethod
    def from_groups(cls, groups: Iterable[RolloutGroup], *, pad_id: int = 0) -> TrainingBatch:
        """The batch of ``groups`` (delivered ``RolloutGroup`` objects of ``TokenRollout``),
        one row per trajectory element, in order.

        Raises ``TypeError`` when a rollout is a text ``Rollout`` (it has no token ids),
        when ``groups`` holds something that is not a ``RolloutGroup``, or when ``pad_id``
        is not an int; ``ValueError`` when ``groups`` is empty, ``pad_id`` is negative,
        a rollout's lists disagree (a mask's length and its element's, the logprobs'
        count and the mask's ``True`` entries, one list per element), an epoch boundary
        is malformed, or a reward is missing or not finite (from
        ``RolloutGroup.advantages()``). Each message names the group, the rollout and
        the element.
        """
        pad = _check_pad_id(pad_id)
        if isinstance(groups, RolloutGroup):
            msg = "groups must be a list of RolloutGroup, got one RolloutGroup: pass [group]"
            raise TypeError(msg)
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Iterable):
            msg = f"groups must be a list of RolloutGroup, got {type(groups).__name__}"
            raise TypeError(msg)
        groups = list(groups)
        if not groups:
            msg = "groups is empty: a TrainingBatch needs at least one RolloutGroup"
            raise ValueError(msg)

        # Pass 1: check the types, count the rows and find the longest; the advantages.
        plan: list[tuple[int, int, TokenRollout, float, int]] = []
        n_rows = 0
        width = 0
        for g, group in enumerate(groups):
            if not isinstance(group, RolloutGroup):
                msg = f"groups[{g}] must be a RolloutGroup, got {type(group).__name__}"
                raise TypeError(msg)
            rollouts: list[TokenRollout] = []
            for r, rollout in enumerate(group.rollouts):
                if not isinstance(rollout, TokenRollout):
                    msg = (
                        f"group {g}, rollout {r} is a {type(rollout).__name__}: a "
                        "TrainingBatch needs TokenRollout objects (token ids, generation "
                        "mask, logprobs); a text Rollout has no token ids. Generate "
                        "with a backend that returns token ids (ReturnsTokens)"
                    )
                    raise TypeError(msg)
                rollouts.append(rollout)
            if not rollouts:
                continue
            advantages = group.advantages()
            for r, rollout in enumerate(rollouts):
                plan.append((g, r, rollout, float(advantages[r]), group.start_epoch))
                for ids in rollout.trajectory:
                    width = max(width, len(ids))
                n_rows += len(rollout.trajectory)

        input_ids = np.full((n_rows, width), pad, dtype=np.int64)
        attention_mask = np.zeros((n_rows, width), dtype=np.bool_)
        loss_mask = np.zeros((n_rows, width), dtype=np.bool_)
        logprobs = np.zeros((n_rows, width), dtype=np.float32)
        policy_epoch = np.full((n_rows, width), -1, dtype=np.int64)
        advantages_out = np.zeros((n_rows, width), dtype=np.float32)

        # Pass 2: fill each row with slices.
        row_index: list[tuple[int, int, int]] = []
        row_rewards: list[float] = []
        row_has_logprobs: list[bool] = []
        i = 0
        for g, r, rollout, advantage, start_epoch in plan:
            trajectory = rollout.trajectory
            n_elements = len(trajectory)
            masks = rollout.generation_mask
            all_logprobs = rollout.logprobs
            epochs = rollout.policy_epoch
            if masks is not None and len(masks) != n_elements:
                _per_element_error(g, r, "generation_mask", masks, n_elements)
            if all_logprobs is not None and len(all_logprobs) != n_elements:
                _per_element_error(g, r, "logprobs", all_logprobs, n_elements)
            if epochs and len(epochs) != n_elements:
                _per_element_error(g, r, "policy_epoch", epochs, n_elements)
            row_rewards += [rollout.scalar_reward] * n_elements
            row_has_logprobs += [all_logprobs is not None] * n_elements
            for e, ids in enumerate(trajectory):
                row_index.append((g, r, e))
                n = len(ids)
                if n:
                    input_ids[i, :n] = np.frombuffer(_ints((g, r, e), ids), dtype=np.int64)
                    attention_mask[i, :n] = True
                _fill_generated(
                    (g, r, e),
                    n,
                    None if masks is None else masks[e],
                    None if all_logprobs is None else all_logprobs[e],
                    advantage,
                    loss_mask[i],
                    logprobs[i],
                    advantages_out[i],
                )
                boundaries = epochs[e] if epochs else ()
                first = boundaries[0] if len(boundaries) == 1 else None
                if (
                    type(first) is tuple
                    and len(first) == 2
                    and type(first[0]) is int
                    and first[0] == 0
                    and type(first[1]) is int
                    and first[1] >= 0
                ):
                    policy_epoch[i, :n] = first[1]  # (0, epoch): one epoch for the element
                else:
                    _fill_epochs((g, r, e), n, boundaries, start_epoch, policy_epoch[i])
                i += 1
        rewards = np.array(row_rewards, dtype=np.float32)
        rows = np.array(row_index, dtype=np.int64).reshape(n_rows, 3)
        has_logprobs = np.array(row_has_logprobs, dtype=np.bool_)

        return cls(
            input_ids=input_ids,
            attention_mask=attention_mask,
            loss_mask=loss_mask,
            logprobs=logprobs,
            policy_epoch=policy_epoch,
            advantages=advantages_out,
            rewards=rewards,
            rows=rows,
            has_logprobs=has_logprobs,
        )


# --------------------------------------------------------------------------- rows


def _where(g: int, r: int, e: int) -> str:
    return f"group {g}, rollout {r}, element {e}"


def _per_element_error(g: int, r: int, name: str, values: object, n: int) -> None:
    """``values`` does not have one entry per trajectory element."""
    count = len(values) if isinstance(values, list) else type(values).__name__
    msg = (
        f"group {g}, rollout {r}: {name} has {count} entries but the trajectory has "
        f"{n} elements; it must have one per element"
    )
    raise ValueError(msg)


def _fill_generated(
    at: tuple[int, int, int],
    n: int,
    mask: Sequence[bool] | None,
    lps: Sequence[float] | None,
    advantage: float,
    loss_row: npt.NDArray[np.bool_],
    logprob_row: npt.NDArray[np.float32],
    advantage_row: npt.NDArray[np.float32],
) -> None:
    """Mark one row's generated ids and put their logprobs and advantage there. Generated
    ids are the mask's entries equal to ``True`` (``TokenRollout``'s own rule), every id
    when there is no mask."""
    if mask is None:  # every id was generated (TokenRollout's convention)
        raw = b""
        count, start = n, 0
    else:
        if len(mask) != n:
            msg = (
                f"{_where(*at)}: generation_mask has {len(mask)} entries but the element "
                f"has {n} ids; they must be equal"
            )
            raise ValueError(msg)
        raw = _mask_bytes(mask)
        count = raw.count(1)
        start = raw.find(1)
    if lps is not None and len(lps) != count:
        which = "every id: no generation_mask" if mask is None else "True in generation_mask"
        msg = (
            f"{_where(*at)}: logprobs has {len(lps)} entries but there are {count} "
            f"generated ids ({which}); there must be one per generated id"
        )
        raise ValueError(msg)
    if not count:
        return
    if count == n - start:
        # One run of generated ids at the end (a single-turn completion): slices.
        loss_row[start:n] = True
        advantage_row[start:n] = advantage
        if lps is not None:
            logprob_row[start:n] = _floats(at, lps)
        return
    # Several runs (a multi-turn episode): write through the mask, in C. (A boolean
    # mask is faster here than np.flatnonzero's indices, which need three scatters.)
    generated = np.frombuffer(raw, dtype=np.uint8) == 1
    loss_row[:n] = generated
    np.copyto(advantage_row[:n], advantage, where=generated)
    if lps is not None:
        logprob_row[:n][generated] = _floats(at, lps)


def _mask_bytes(mask: Sequence[bool]) -> bytes:
    """One byte per entry, equal to 1 exactly where the entry equals ``True``; in C for
    bools and small ints (each entry's value), by comparison for anything else."""
    try:
        return bytes(mask)
    except (TypeError, ValueError):
        # numpy bools, floats, strings: compare each one, as list.count does.
        return bytes(map(bool, map(operator.eq, mask, repeat(True))))


def _ints(at: tuple[int, int, int], ids: Sequence[int]) -> bytes:
    """The ids as native int64 bytes (``struct`` converts a list about twice as fast as
    ``np.fromiter``)."""
    try:
        return struct.pack(f"{len(ids)}q", *ids)
    except struct.error:
        pass
    for k, value in enumerate(ids):
        if not _is_int(value):
            msg = f"{_where(*at)}: token id {k} is {value!r:.40}; ids must be ints"
            raise TypeError(msg)
    msg = f"{_where(*at)}: a token id is outside int64's range"
    raise ValueError(msg)


def _floats(at: tuple[int, int, int], values: Sequence[float]) -> npt.NDArray[np.float32]:
    """The logprobs as float32 (``struct`` rounds each as numpy's cast does)."""
    try:
        raw = struct.pack(f"{len(values)}f", *values)
    except (struct.error, OverflowError):
        for k, value in enumerate(values):
            if not isinstance(value, (int, float, np.floating, np.integer)):
                msg = f"{_where(*at)}: logprob {k} is {value!r:.40}; logprobs must be floats"
                raise TypeError(msg) from None
        msg = f"{_where(*at)}: a logprob is outside float32's range"
        raise ValueError(msg) from None
    return np.frombuffer(raw, dtype=np.float32)


def _fill_epochs(
    at: tuple[int, int, int],
    n: int,
    boundaries: Sequence[Any],
    start_epoch: int,
    row: npt.NDArray[np.int64],
) -> None:
    """Expand ``(start_index, epoch)`` boundaries over a row's ``n`` ids (checked even
    when ``n`` is 0)."""
    where = _where(*at)
    parsed: list[tuple[int, int]] = []
    previous = -1
    for k, boundary in enumerate(boundaries):
        parsed.append(_boundary(where, k, boundary, previous))
        previous = parsed[-1][0]
    if not n:
        return
    first = parsed[0][0] if parsed else n
    if first > 0:  # before the first boundary: the group's start_epoch
        row[: min(first, n)] = start_epoch
    for k, (start, epoch) in enumerate(parsed):
        if start >= n:
            break
        end = parsed[k + 1][0] if k + 1 < len(parsed) else n
        row[start : min(end, n)] = epoch


def _boundary(where: str, k: int, boundary: object, previous: int) -> tuple[int, int]:
    """One ``(start_index, epoch)`` boundary, checked: ints, ``start >= 0`` and after the
    previous one, ``epoch >= 0``."""
    try:
        first, second = cast("tuple[object, object]", boundary)
    except (TypeError, ValueError):
        msg = (
            f"{where}: policy_epoch[{k}] must be a (start_index, epoch) pair, got {boundary!r:.60}"
        )
        raise ValueError(msg) from None
    if not (_is_int(first) and _is_int(second)):
        msg = f"{where}: policy_epoch[{k}] must be a pair of ints, got {boundary!r:.60}"
        raise ValueError(msg)
    start, epoch = int(cast("int", first)), int(cast("int", second))
    if start <= previous or start < 0 or epoch < 0:
        msg = (
            f"{where}: policy_epoch[{k}] = {boundary!r:.60} is not a boundary: starts must be "
            f">= 0 and strictly increasing (previous start {previous}), epochs >= 0"
        )
        raise ValueError(msg)
    return start, epoch
