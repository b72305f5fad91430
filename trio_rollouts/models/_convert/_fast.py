"""Fast paths: well-formed lists of primitives (token ids, masks, log-probabilities,
``(start, epoch)`` pairs) checked in one C-speed pass and taken over, not copied.

A TokenRollout carries thousands of token ids, mask bits and log-probabilities; checking
them element by element in Python would dominate structuring. ``marshal`` (format 2, no
back-references) serializes a list in C with one type code per element at a fixed
stride when all elements have the same fixed-size type: ``i`` + 4 bytes for an int that
fits 32 bits, ``g`` + 8 bytes for a float, ``T``/``F`` alone for booleans. Reading the
codes back with one slice tells whether *every* element has exactly that type (bool is
not int, int is not float, subclasses are refused). Anything else falls back to the
per-element path, which is exact and reports each bad element;
``_self_check_quick_lists`` disables the shortcut if this Python's marshal ever
disagrees.

Well-formed lists of primitives are taken as they are, not copied: structuring is meant
for freshly decoded data (``json.loads``), which nothing else holds, and a copy would
cost as much as the check. Lists that need converting (ints in a float list) are new.
"""

from __future__ import annotations

import marshal
import typing
from collections.abc import Callable
from typing import Any

__all__ = ["MISS", "quick_path"]

_MARSHAL_HEADER = 5  # "[" and a 4-byte length

#: Returned by a quick path that does not apply; the full hook then decides and reports.
MISS: Any = object()


def _quick_numbers(
    code: bytes, width: int, kinds: frozenset[type], convert: Callable[[list[Any]], Any]
) -> Callable[[Any], Any]:
    def quick(value: Any) -> Any:
        if type(value) is not list:
            return MISS
        try:
            data = marshal.dumps(value, 2)
        except ValueError:  # an element marshal cannot serialize: not a plain number
            return MISS
        n = len(value)
        if len(data) == _MARSHAL_HEADER + width * n and data[_MARSHAL_HEADER::width] == code * n:
            return value
        # Ints beyond 32 bits, or ints among floats (some encoders write 0.0 as 0): one
        # more pass over the element types, still in C, settles it.
        if set(map(type, value)) <= kinds:
            return convert(value)
        return MISS

    return quick


def _as_floats(values: list[Any]) -> Any:
    try:
        return list(map(float, values))
    except OverflowError:  # an int too large for a float: the full hook reports it
        return MISS


def _quick_bools(value: Any) -> Any:
    if type(value) is not list:
        return MISS
    try:
        data = marshal.dumps(value, 2)
    except ValueError:
        return MISS
    if len(data) == _MARSHAL_HEADER + len(value) and not data[_MARSHAL_HEADER:].translate(
        None, b"TF"
    ):
        return value
    return MISS


def _quick_strs(value: Any) -> Any:
    if type(value) is list and all(type(item) is str for item in value):
        return value
    return MISS


#: Quick paths of ``list[int]``, ``list[float]``, ``list[bool]`` and ``list[str]``.
_QUICK_PRIMITIVE_LISTS: dict[Any, Callable[[Any], Any]] = {
    int: _quick_numbers(b"i", 5, frozenset({int}), lambda values: values),
    float: _quick_numbers(b"g", 9, frozenset({int, float}), _as_floats),
    bool: _quick_bools,
    str: _quick_strs,
}


def _self_check_quick_lists() -> None:
    cases: list[tuple[Any, list[Any], bool]] = [
        (int, [0, 1, -(2**31), 2**31 - 1, 7], True),
        (int, [1, True], False),
        (int, [1, 1.0], False),
        (float, [0.5, -1.0, float("inf")], True),
        (float, [0.5, True], False),
        (bool, [True, False, True], True),
        (bool, [True, 1], False),
        (bool, [True, None], False),
    ]
    for elem, values, expected in cases:
        if (_QUICK_PRIMITIVE_LISTS[elem](values) is not MISS) is not expected:
            for kind in (int, float, bool):
                _QUICK_PRIMITIVE_LISTS[kind] = lambda value: MISS
            return


_self_check_quick_lists()


def _primitive_pair(tp: Any) -> tuple[type, type] | None:
    """``(int, int)`` for ``tuple[int, int]``: a pair of primitives, as epochs are."""
    origin: Any = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is tuple and len(args) == 2 and all(arg in (int, float, str) for arg in args):
        return args[0], args[1]
    return None


def quick_path(tp: Any) -> Callable[[Any], Any] | None:
    """A shortcut for well-formed values of ``tp``: the structured value, or ``MISS``.

    Only lists of primitives, lists of primitive pairs and lists of those have one: they
    are the bulk of a rollout (token ids, masks, log-probabilities, ``(start, epoch)``
    pairs). A quick path never reports problems; when it misses, the full hook runs from
    scratch and reports every problem with its path.
    """
    origin: Any = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is not list or len(args) != 1:
        return None
    (elem,) = args
    quick = _QUICK_PRIMITIVE_LISTS.get(elem)
    if quick is not None:
        return quick
    pair = _primitive_pair(elem)
    if pair is not None:
        first, second = pair

        def quick_pairs(value: Any) -> Any:
            if type(value) is not list:
                return MISS
            out = []
            for item in value:
                if (type(item) is list or type(item) is tuple) and len(item) == 2:
                    a, b = item
                    if type(a) is first and type(b) is second:
                        out.append((a, b))
                        continue
                return MISS
            return out

        return quick_pairs
    inner = quick_path(elem)
    if inner is None:
        return None

    def quick_lists(value: Any) -> Any:
        if type(value) is not list:
            return MISS
        out = []
        for item in value:
            structured = inner(item)
            if structured is MISS:
                return MISS
            out.append(structured)
        return out

    return quick_lists
