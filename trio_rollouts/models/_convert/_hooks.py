"""Structure hooks for primitives, lists, tuples and unions; ``Rollout | TokenRollout``
is decided by the data's shape (:func:`_rollout_class`)."""

from __future__ import annotations

import typing
from typing import Any

import cattrs

from trio_rollouts.models._convert._errors import (
    DATA_ERRORS,
    Invalid,
    Problem,
    collect,
    describe,
    problems_of,
    type_name,
)
from trio_rollouts.models._convert._fast import MISS, quick_path
from trio_rollouts.models._convert._types import NoneType, StructureHook
from trio_rollouts.models._rollouts import Rollout, TokenRollout

__all__ = ["PRIMITIVE_HOOKS", "make_list_hook", "make_tuple_hook", "make_union_hook"]


def _structure_int(value: Any, _: Any) -> int:
    if type(value) is int:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    raise Invalid.at(f"expected int, got {describe(value)}")


def _structure_float(value: Any, _: Any) -> float:
    if type(value) is float:
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            pass
    raise Invalid.at(f"expected float, got {describe(value)}")


def _structure_str(value: Any, _: Any) -> str:
    if type(value) is str:
        return value
    if isinstance(value, str):
        return str(value)
    raise Invalid.at(f"expected str, got {describe(value)}")


def _structure_bool(value: Any, _: Any) -> bool:
    if value is True or value is False:
        return value
    raise Invalid.at(f"expected bool, got {describe(value)}")


PRIMITIVE_HOOKS: dict[Any, StructureHook] = {
    int: _structure_int,
    float: _structure_float,
    str: _structure_str,
    bool: _structure_bool,
}


def _structure_items(values: list[Any], hook: StructureHook, elem: Any) -> list[Any]:
    out = []
    problems: list[Problem] | None = None
    for i, value in enumerate(values):
        try:
            out.append(hook(value, elem))
        except DATA_ERRORS as exc:
            problems = collect(problems, exc, i)
    if problems:
        raise Invalid(problems)
    return out


def make_list_hook(tp: Any, converter: cattrs.Converter) -> StructureHook:
    (elem,) = typing.get_args(tp) or (Any,)
    quick = quick_path(tp)
    hook = converter.get_structure_hook(elem)

    def structure_list(value: Any, _: Any) -> list[Any]:
        if quick is not None:
            structured = quick(value)
            if structured is not MISS:
                return structured  # type: ignore[no-any-return]
        if not isinstance(value, list):
            raise Invalid.at(f"expected list, got {describe(value)}")
        return _structure_items(value, hook, elem)

    return structure_list


def make_tuple_hook(tp: Any, converter: cattrs.Converter) -> StructureHook:
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
        items_hook = make_list_hook(list[args[0]], converter)  # type: ignore[valid-type]

        def structure_var_tuple(value: Any, _: Any) -> tuple[Any, ...]:
            if isinstance(value, tuple):
                value = list(value)
            return tuple(items_hook(value, list))

        return structure_var_tuple

    hooks = [(converter.get_structure_hook(arg), arg) for arg in args]
    size = len(hooks)
    expected = f"a {size}-element list ({type_name(tp)})"

    def structure_tuple(value: Any, _: Any) -> tuple[Any, ...]:
        # JSON has no tuples: a pair such as (start_token_index, epoch) arrives as a list.
        if not isinstance(value, (list, tuple)) or len(value) != size:
            raise Invalid.at(f"expected {expected}, got {describe(value)}")
        out = []
        problems: list[Problem] | None = None
        for i, ((hook, arg), item) in enumerate(zip(hooks, value, strict=True)):
            try:
                out.append(hook(item, arg))
            except DATA_ERRORS as exc:
                problems = collect(problems, exc, i)
        if problems:
            raise Invalid(problems)
        return tuple(out)

    return structure_tuple


def _json_kind(value: object) -> type | None:
    """The JSON kind of a value: which member of a union it can be."""
    for kind in (bool, int, float, str, list, dict):
        if isinstance(value, kind):
            return kind
    return NoneType if value is None else None


def _rollout_class(value: dict[str, Any]) -> type[Rollout] | type[TokenRollout]:
    """Tell a Rollout from a TokenRollout by the shape of the data.

    1. A non-empty ``trajectory`` decides by its first element: a ``str`` makes a
       :class:`Rollout`, a list (of token ids) a :class:`TokenRollout`; anything else is
       an error at ``trajectory[0]``.
    2. Otherwise (``trajectory`` empty, missing or not a list) the keys decide:
       ``prompt_length`` marks a Rollout, ``generation_mask`` or ``logprobs`` a
       TokenRollout. Unstructured objects always carry these keys, so round trips are
       decided here; data with neither or both is refused as ambiguous.
    """
    trajectory = value.get("trajectory")
    if isinstance(trajectory, list) and trajectory:
        first = trajectory[0]
        if isinstance(first, str):
            return Rollout
        if isinstance(first, list):
            return TokenRollout
        msg = (
            f"expected str (a Rollout) or a list of token ids (a TokenRollout), "
            f"got {describe(first)}"
        )
        raise Invalid.at(msg, "trajectory", 0)
    text = "prompt_length" in value
    tokens = "generation_mask" in value or "logprobs" in value
    if text != tokens:
        return Rollout if text else TokenRollout
    if "trajectory" not in value:
        raise Invalid.at("required field missing", "trajectory")
    shape = "empty" if trajectory == [] else f"not a list ({describe(trajectory)})"
    markers = "both" if text else "neither"
    msg = (
        f"cannot tell Rollout from TokenRollout: trajectory is {shape} and the object has "
        f"{markers} prompt_length (Rollout) {'and' if text else 'nor'} "
        f"generation_mask/logprobs (TokenRollout)"
    )
    raise Invalid.at(msg)


def make_union_hook(tp: Any, converter: cattrs.Converter) -> StructureHook:
    members = typing.get_args(tp)
    if set(members) == {Rollout, TokenRollout}:
        rollout_hooks = {cls: converter.get_structure_hook(cls) for cls in members}

        def structure_rollout(value: Any, _: Any) -> Rollout | TokenRollout:
            if not isinstance(value, dict):
                msg = f"expected a Rollout or TokenRollout object (dict), got {describe(value)}"
                raise Invalid.at(msg)
            cls = _rollout_class(value)
            return rollout_hooks[cls](value, cls)  # type: ignore[no-any-return]

        return structure_rollout

    others = [m for m in members if m is not NoneType]
    if len(others) == 1:
        inner, hook = others[0], converter.get_structure_hook(others[0])

        def structure_optional(value: Any, _: Any) -> Any:
            return None if value is None else hook(value, inner)

        return structure_optional

    # Every other union is decided by the JSON kind of the value; records (dicts) are
    # tried in declaration order when several record types are members.
    by_kind: dict[type, list[Any]] = {}
    for member in members:
        origin = typing.get_origin(member) or member
        if member in (bool, int, float, str, NoneType):
            kind = member
        elif origin in (list, tuple):
            kind = list
        else:
            kind = dict
        by_kind.setdefault(kind, []).append(member)
    if float in by_kind and int not in by_kind:
        by_kind[int] = by_kind[float]  # JSON writes 1.0 as 1
    candidates = {
        kind: [(converter.get_structure_hook(m), m) for m in ms] for kind, ms in by_kind.items()
    }
    expected = type_name(tp)
    plain = frozenset(m for m in members if m in PRIMITIVE_HOOKS or m is NoneType)

    def structure_union(value: Any, _: Any) -> Any:
        if type(value) in plain:
            return value
        options = candidates.get(type(value))
        if options is None:
            kind = _json_kind(value)
            options = candidates.get(kind) if kind is not None else None
        if options is None:
            raise Invalid.at(f"expected {expected}, got {describe(value)}")
        first_failure: BaseException | None = None
        for hook, member in options:
            try:
                return hook(value, member)
            except DATA_ERRORS as exc:
                first_failure = first_failure or exc
        raise Invalid(problems_of(first_failure))  # type: ignore[arg-type]

    return structure_union
