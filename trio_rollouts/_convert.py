"""Conversion between the models and JSON-ready data, through one configured cattrs Converter.

Everything that turns a model into plain ``dict``/``list``/``str``/number data and back goes
through :data:`_converter`, which is built once, at the bottom of this module, from hooks
registered by type. Structuring is strict (JSON's ``1`` is accepted for a float field and
becomes ``1.0``; nothing else is coerced: ``"1.0"`` is not a float, ``True`` is not an int)
and reports *every* problem at once as a :class:`ValidationError` whose lines read
``message @ $.path``. Unknown keys of a record go to its ``extra`` dict and come back at top
level on unstructure, so ``unstructure(structure(d, cls)) == d`` for a complete ``d``.
``Rollout | TokenRollout`` is decided by the data's shape (see :func:`_rollout_class`);
``EvaluationResponse`` is decided by the registered class its ``type_name`` names. The
large homogeneous lists of a :class:`TokenRollout` (token ids, masks, log-probabilities) are
type-checked in one C-speed pass rather than element by element, because a rollout holds
thousands of them, and are taken over rather than copied. :func:`dump_jsonl` and
:func:`load_jsonl` stream records as JSON lines.
"""

from __future__ import annotations

import json
import marshal
import os
import reprlib
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO, Any, TypeVar, overload

import attrs
import cattrs
from cattrs.errors import BaseValidationError, ClassValidationError, IterableValidationError

from ._messages import Record
from ._models import (
    EvaluationResponse,
    EvaluationResult,
    ResultT,
    Rollout,
    TokenRollout,
)

__all__ = ["ValidationError", "dump_jsonl", "load_jsonl", "structure", "unstructure"]

T = TypeVar("T")

#: A location inside the data being structured: attribute names and list indices.
_Path = tuple[str | int, ...]
_Problem = tuple[str, _Path]
_StructureHook = Callable[[Any, Any], Any]
_UnstructureFn = Callable[[Any], Any]

_NoneType = type(None)

# --------------------------------------------------------------------------- errors


class ValidationError(ValueError):
    """Data that does not fit the model it is structured as.

    ``errors`` lists every problem found as ``(message, path)`` pairs, the path written
    as ``$.rollouts[2].trajectory[0][5]`` (``$`` is the value passed to ``structure``).
    ``target`` names the type structured to, and ``line`` is the 1-based line number
    when the data came from :func:`load_jsonl` (else ``None``).
    """

    def __init__(
        self,
        errors: Sequence[tuple[str, str]],
        target: str | None = None,
        line: int | None = None,
    ) -> None:
        self.errors: list[tuple[str, str]] = list(errors)
        self.target = target
        self.line = line
        count = len(self.errors)
        head = f"{count} validation error{'' if count == 1 else 's'}"
        if target is not None:
            head = f"{head} for {target}"
        if line is not None:
            head = f"line {line}: {head}"
        body = "".join(f"\n  {message} @ {path}" for message, path in self.errors)
        super().__init__(head + body)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.errors, self.target, self.line))


class _Invalid(Exception):
    """Problems found while structuring, with paths relative to the value at hand.

    Hooks raise this instead of :class:`ValidationError` so that each enclosing list or
    record only prepends its own path segment; :func:`structure` formats once, at the top.
    """

    def __init__(self, problems: list[_Problem]) -> None:
        super().__init__(problems)
        self.problems = problems

    @classmethod
    def at(cls, message: str, *path: str | int) -> _Invalid:
        return cls([(message, path)])


#: What a hook may raise for bad data: ours, cattrs' trees, and the model constructors'
#: ValueError/TypeError (attrs validators, ``__attrs_post_init__``).
_DATA_ERRORS = (_Invalid, BaseValidationError, ValueError, TypeError)


def _problems_of(exc: BaseException) -> list[_Problem]:
    if isinstance(exc, _Invalid):
        return exc.problems
    if isinstance(exc, IterableValidationError):
        problems: list[_Problem] = []
        indexed, unplaced = exc.group_exceptions()
        for sub, index_note in indexed:
            problems += _prefixed(_problems_of(sub), index_note.index)
        for sub in unplaced:
            problems += _problems_of(sub)
        return problems
    if isinstance(exc, ClassValidationError):
        problems = []
        named, unplaced = exc.group_exceptions()
        for sub, name_note in named:
            problems += _prefixed(_problems_of(sub), name_note.name)
        for sub in unplaced:
            problems += _problems_of(sub)
        return problems
    if isinstance(exc, KeyError):
        # cattrs' generated structuring code signals a missing field with a KeyError.
        return [("required field missing", ())]
    return [(str(exc) or type(exc).__name__, ())]


def _prefixed(problems: list[_Problem], segment: str | int) -> list[_Problem]:
    return [(message, (segment, *path)) for message, path in problems]


def _collect(
    problems: list[_Problem] | None, exc: BaseException, segment: str | int
) -> list[_Problem]:
    if problems is None:
        problems = []
    problems += _prefixed(_problems_of(exc), segment)
    return problems


def _format_path(path: _Path) -> str:
    return "$" + "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in path)


_short_repr = reprlib.Repr()
_short_repr.maxstring = 40
_short_repr.maxother = 40
_short_repr.maxlist = 4
_short_repr.maxdict = 4


def _describe(value: object) -> str:
    """``str '3'``, ``list [1, 2, ...]``: a value's type and a bounded repr of it."""
    if value is None:
        return "None"
    return f"{type(value).__name__} {_short_repr.repr(value)}"


def _type_name(tp: Any) -> str:
    """``list[int]``, ``Rollout | TokenRollout``: a type as a user would write it."""
    if tp is _NoneType:
        return "None"
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if _is_union(tp):
        return " | ".join(_type_name(arg) for arg in args)
    if origin is not None and args:
        return f"{_type_name(origin)}[{', '.join(_type_name(arg) for arg in args)}]"
    return str(getattr(tp, "__name__", tp))


# --------------------------------------------------------------------------- primitives


def _structure_int(value: Any, _: Any) -> int:
    if type(value) is int:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    raise _Invalid.at(f"expected int, got {_describe(value)}")


def _structure_float(value: Any, _: Any) -> float:
    if type(value) is float:
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            pass
    raise _Invalid.at(f"expected float, got {_describe(value)}")


def _structure_str(value: Any, _: Any) -> str:
    if type(value) is str:
        return value
    if isinstance(value, str):
        return str(value)
    raise _Invalid.at(f"expected str, got {_describe(value)}")


def _structure_bool(value: Any, _: Any) -> bool:
    if value is True or value is False:
        return value
    raise _Invalid.at(f"expected bool, got {_describe(value)}")


_PRIMITIVE_HOOKS: dict[Any, _StructureHook] = {
    int: _structure_int,
    float: _structure_float,
    str: _structure_str,
    bool: _structure_bool,
}


# --------------------------------------------------------------------------- fast lists
#
# A TokenRollout carries thousands of token ids, mask bits and log-probabilities; checking
# them element by element in Python would dominate structuring. ``marshal`` (format 2, no
# back-references) serializes a list in C with one type code per element at a fixed
# stride when all elements have the same fixed-size type: ``i`` + 4 bytes for an int that
# fits 32 bits, ``g`` + 8 bytes for a float, ``T``/``F`` alone for booleans. Reading the
# codes back with one slice tells whether *every* element has exactly that type (bool is
# not int, int is not float, subclasses are refused). Anything else falls back to the
# per-element path, which is exact and reports each bad element;
# :func:`_self_check_quick_lists` disables the shortcut if this Python's marshal ever
# disagrees.
#
# Well-formed lists of primitives are taken as they are, not copied: structuring is meant
# for freshly decoded data (``json.loads``), which nothing else holds, and a copy would
# cost as much as the check. Lists that need converting (ints in a float list) are new.

_MARSHAL_HEADER = 5  # "[" and a 4-byte length

#: Returned by a quick path that does not apply; the full hook then decides and reports.
_MISS: Any = object()


def _quick_numbers(
    code: bytes, width: int, kinds: frozenset[type], convert: Callable[[list[Any]], Any]
) -> Callable[[Any], Any]:
    def quick(value: Any) -> Any:
        if type(value) is not list:
            return _MISS
        try:
            data = marshal.dumps(value, 2)
        except ValueError:  # an element marshal cannot serialize: not a plain number
            return _MISS
        n = len(value)
        if len(data) == _MARSHAL_HEADER + width * n and data[_MARSHAL_HEADER::width] == code * n:
            return value
        # Ints beyond 32 bits, or ints among floats (some encoders write 0.0 as 0): one
        # more pass over the element types, still in C, settles it.
        if set(map(type, value)) <= kinds:
            return convert(value)
        return _MISS

    return quick


def _as_floats(values: list[Any]) -> Any:
    try:
        return list(map(float, values))
    except OverflowError:  # an int too large for a float: the full hook reports it
        return _MISS


def _quick_bools(value: Any) -> Any:
    if type(value) is not list:
        return _MISS
    try:
        data = marshal.dumps(value, 2)
    except ValueError:
        return _MISS
    if len(data) == _MARSHAL_HEADER + len(value) and not data[_MARSHAL_HEADER:].translate(
        None, b"TF"
    ):
        return value
    return _MISS


def _quick_strs(value: Any) -> Any:
    if type(value) is list and all(type(item) is str for item in value):
        return value
    return _MISS


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
        if (_QUICK_PRIMITIVE_LISTS[elem](values) is not _MISS) is not expected:
            for kind in (int, float, bool):
                _QUICK_PRIMITIVE_LISTS[kind] = lambda value: _MISS
            return


_self_check_quick_lists()


def _primitive_pair(tp: Any) -> tuple[type, type] | None:
    """``(int, int)`` for ``tuple[int, int]``: a pair of primitives, as epochs are."""
    origin: Any = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is tuple and len(args) == 2 and all(arg in (int, float, str) for arg in args):
        return args[0], args[1]
    return None


def _quick_path(tp: Any) -> Callable[[Any], Any] | None:
    """A shortcut for well-formed values of ``tp``: the structured value, or ``_MISS``.

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
                return _MISS
            out = []
            for item in value:
                if (type(item) is list or type(item) is tuple) and len(item) == 2:
                    a, b = item
                    if type(a) is first and type(b) is second:
                        out.append((a, b))
                        continue
                return _MISS
            return out

        return quick_pairs
    inner = _quick_path(elem)
    if inner is None:
        return None

    def quick_lists(value: Any) -> Any:
        if type(value) is not list:
            return _MISS
        out = []
        for item in value:
            structured = inner(item)
            if structured is _MISS:
                return _MISS
            out.append(structured)
        return out

    return quick_lists


def _structure_items(values: list[Any], hook: _StructureHook, elem: Any) -> list[Any]:
    out = []
    problems: list[_Problem] | None = None
    for i, value in enumerate(values):
        try:
            out.append(hook(value, elem))
        except _DATA_ERRORS as exc:
            problems = _collect(problems, exc, i)
    if problems:
        raise _Invalid(problems)
    return out


def _make_list_hook(tp: Any) -> _StructureHook:
    (elem,) = typing.get_args(tp) or (Any,)
    quick = _quick_path(tp)
    hook = _converter.get_structure_hook(elem)

    def structure_list(value: Any, _: Any) -> list[Any]:
        if quick is not None:
            structured = quick(value)
            if structured is not _MISS:
                return structured  # type: ignore[no-any-return]
        if not isinstance(value, list):
            raise _Invalid.at(f"expected list, got {_describe(value)}")
        return _structure_items(value, hook, elem)

    return structure_list


def _make_tuple_hook(tp: Any) -> _StructureHook:
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
        items_hook = _make_list_hook(list[args[0]])  # type: ignore[valid-type]

        def structure_var_tuple(value: Any, _: Any) -> tuple[Any, ...]:
            if isinstance(value, tuple):
                value = list(value)
            return tuple(items_hook(value, list))

        return structure_var_tuple

    hooks = [(_converter.get_structure_hook(arg), arg) for arg in args]
    size = len(hooks)
    expected = f"a {size}-element list ({_type_name(tp)})"

    def structure_tuple(value: Any, _: Any) -> tuple[Any, ...]:
        # JSON has no tuples: a pair such as (start_token_index, epoch) arrives as a list.
        if not isinstance(value, (list, tuple)) or len(value) != size:
            raise _Invalid.at(f"expected {expected}, got {_describe(value)}")
        out = []
        problems: list[_Problem] | None = None
        for i, ((hook, arg), item) in enumerate(zip(hooks, value, strict=True)):
            try:
                out.append(hook(item, arg))
            except _DATA_ERRORS as exc:
                problems = _collect(problems, exc, i)
        if problems:
            raise _Invalid(problems)
        return tuple(out)

    return structure_tuple


# --------------------------------------------------------------------------- unions


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _is_list(tp: Any) -> bool:
    origin: Any = typing.get_origin(tp)
    return origin is list


def _is_tuple(tp: Any) -> bool:
    origin: Any = typing.get_origin(tp)
    return origin is tuple


def _json_kind(value: object) -> type | None:
    """The JSON kind of a value: which member of a union it can be."""
    for kind in (bool, int, float, str, list, dict):
        if isinstance(value, kind):
            return kind
    return _NoneType if value is None else None


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
            f"got {_describe(first)}"
        )
        raise _Invalid.at(msg, "trajectory", 0)
    text = "prompt_length" in value
    tokens = "generation_mask" in value or "logprobs" in value
    if text != tokens:
        return Rollout if text else TokenRollout
    if "trajectory" not in value:
        raise _Invalid.at("required field missing", "trajectory")
    shape = "empty" if trajectory == [] else f"not a list ({_describe(trajectory)})"
    markers = "both" if text else "neither"
    msg = (
        f"cannot tell Rollout from TokenRollout: trajectory is {shape} and the object has "
        f"{markers} prompt_length (Rollout) {'and' if text else 'nor'} "
        f"generation_mask/logprobs (TokenRollout)"
    )
    raise _Invalid.at(msg)


def _make_union_hook(tp: Any) -> _StructureHook:
    members = typing.get_args(tp)
    if set(members) == {Rollout, TokenRollout}:
        rollout_hooks = {cls: _converter.get_structure_hook(cls) for cls in members}

        def structure_rollout(value: Any, _: Any) -> Rollout | TokenRollout:
            if not isinstance(value, dict):
                msg = f"expected a Rollout or TokenRollout object (dict), got {_describe(value)}"
                raise _Invalid.at(msg)
            cls = _rollout_class(value)
            return rollout_hooks[cls](value, cls)  # type: ignore[no-any-return]

        return structure_rollout

    others = [m for m in members if m is not _NoneType]
    if len(others) == 1:
        inner, hook = others[0], _converter.get_structure_hook(others[0])

        def structure_optional(value: Any, _: Any) -> Any:
            return None if value is None else hook(value, inner)

        return structure_optional

    # Every other union is decided by the JSON kind of the value; records (dicts) are
    # tried in declaration order when several record types are members.
    by_kind: dict[type, list[Any]] = {}
    for member in members:
        origin = typing.get_origin(member) or member
        if member in (bool, int, float, str, _NoneType):
            kind = member
        elif origin in (list, tuple):
            kind = list
        else:
            kind = dict
        by_kind.setdefault(kind, []).append(member)
    if float in by_kind and int not in by_kind:
        by_kind[int] = by_kind[float]  # JSON writes 1.0 as 1
    candidates = {
        kind: [(_converter.get_structure_hook(m), m) for m in ms] for kind, ms in by_kind.items()
    }
    expected = _type_name(tp)
    plain = frozenset(m for m in members if m in _PRIMITIVE_HOOKS or m is _NoneType)

    def structure_union(value: Any, _: Any) -> Any:
        if type(value) in plain:
            return value
        options = candidates.get(type(value))
        if options is None:
            kind = _json_kind(value)
            options = candidates.get(kind) if kind is not None else None
        if options is None:
            raise _Invalid.at(f"expected {expected}, got {_describe(value)}")
        first_failure: BaseException | None = None
        for hook, member in options:
            try:
                return hook(value, member)
            except _DATA_ERRORS as exc:
                first_failure = first_failure or exc
        raise _Invalid(_problems_of(first_failure))  # type: ignore[arg-type]

    return structure_union


# --------------------------------------------------------------------------- records


def _substitute(tp: Any, typevars: dict[Any, Any]) -> Any:
    """``list[ResultT]`` -> ``list[RewardEvaluationResult]``, given ``{ResultT: ...}``."""
    if isinstance(tp, TypeVar):
        return typevars.get(tp, tp.__bound__ if tp.__bound__ is not None else Any)
    params = getattr(tp, "__parameters__", ())
    if params:
        return tp[tuple(_substitute(p, typevars) for p in params)]
    return tp


def _field_types(cls: Any, typevars: dict[Any, Any] | None = None) -> tuple[type, dict[str, Any]]:
    """The attrs class behind ``cls`` and its fields' resolved types.

    ``cls`` may be a parametrized generic (``EvaluationResponse[RewardEvaluationResult]``):
    its arguments, then ``typevars``, replace the class's type variables.
    """
    origin = typing.get_origin(cls) or cls
    params = getattr(origin, "__parameters__", ())
    typevars = {**dict(zip(params, typing.get_args(cls), strict=False)), **(typevars or {})}
    hints = typing.get_type_hints(origin)
    types_by_name = {
        a.name: _substitute(hints.get(a.name, a.type), typevars)
        for a in attrs.fields(origin)
        if a.init
    }
    return origin, types_by_name


def _make_record_hook(
    tp: Any, *, reserved: frozenset[str] = frozenset(), typevars: dict[Any, Any] | None = None
) -> _StructureHook:
    """Structure a dict into the attrs class ``tp`` (through its constructor).

    Unknown keys go to ``extra`` for records (``Record``), and are errors for other attrs
    classes; keys in ``reserved`` (``type_name``) are skipped. A field's problems are all
    collected before the constructor runs; the constructor's own checks then report at the
    object's path.
    """
    cls, field_types = _field_types(tp, typevars)
    keeps_extra = issubclass(cls, Record)
    # Per field: init name, hook, type, whether None is allowed, the primitive type whose
    # exact instances need no hook (str/float fields), and the quick path (list fields).
    fields: dict[str, tuple[str, _StructureHook, Any, bool, type | None, Any]] = {}
    required: list[str] = []
    for a in attrs.fields(cls):
        if not a.init or (keeps_extra and a.name == "extra"):
            continue
        field_type = field_types[a.name]
        nullable = False
        if _is_union(field_type) and _NoneType in typing.get_args(field_type):
            others = [m for m in typing.get_args(field_type) if m is not _NoneType]
            if len(others) == 1:
                field_type, nullable = others[0], True
        exact = field_type if field_type in _PRIMITIVE_HOOKS else None
        hook = _converter.get_structure_hook(field_type)
        quick = _quick_path(field_type)
        fields[a.name] = (a.alias or a.name, hook, field_type, nullable, exact, quick)
        if a.default is attrs.NOTHING:
            required.append(a.name)
    name = cls.__name__

    def structure_record(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise _Invalid.at(f"expected a {name} object (dict), got {_describe(value)}")
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        problems: list[_Problem] | None = None
        for key, item in value.items():
            field = fields.get(key)
            if field is None:
                if key in reserved:
                    continue
                if keeps_extra:
                    extra[key] = item
                else:
                    problems = problems or []
                    problems.append((f"unknown field of {name}", (key,)))
                continue
            alias, hook, field_type, nullable, exact, quick = field
            if type(item) is exact or (item is None and nullable):
                kwargs[alias] = item
                continue
            if quick is not None:
                structured = quick(item)
                if structured is not _MISS:
                    kwargs[alias] = structured
                    continue
            try:
                kwargs[alias] = hook(item, field_type)
            except _DATA_ERRORS as exc:
                problems = _collect(problems, exc, key)
        for key in required:
            if key not in value:
                problems = problems or []
                problems.append(("required field missing", (key,)))
        if problems:
            raise _Invalid(problems)
        if keeps_extra:
            kwargs["extra"] = extra
        try:
            return cls(**kwargs)
        except (ValueError, TypeError) as exc:
            raise _Invalid.at(str(exc)) from exc

    return structure_record


# --------------------------------------------------------------------------- evaluation


def _is_response(tp: Any) -> bool:
    origin = typing.get_origin(tp) or tp
    return isinstance(origin, type) and issubclass(origin, EvaluationResponse)


def _result_type(cls: type) -> Any:
    """The results type a response class declares: ``R`` in ``class X(EvaluationResponse[R])``
    (or in a generic ancestor's parametrization); :class:`EvaluationResult` if none."""
    for klass in cls.__mro__:
        for base in klass.__dict__.get("__orig_bases__", ()):
            origin = typing.get_origin(base)
            args = typing.get_args(base)
            if (
                isinstance(origin, type)
                and issubclass(origin, EvaluationResponse)
                and args
                and not isinstance(args[0], TypeVar)
            ):
                return args[0]
    return EvaluationResult


_response_hooks: dict[tuple[type, Any], _StructureHook] = {}


def _response_hook(cls: type, result_type: Any) -> _StructureHook:
    """The record hook of one response class with one results type (built once)."""
    key = (cls, result_type)
    hook = _response_hooks.get(key)
    if hook is None:
        hook = _make_record_hook(
            cls, reserved=frozenset({"type_name"}), typevars={ResultT: result_type}
        )
        _response_hooks[key] = hook
    return hook


def _make_response_hook(tp: Any) -> _StructureHook:
    requested: type[EvaluationResponse[Any]] = typing.get_origin(tp) or tp
    args = typing.get_args(tp)
    registry = EvaluationResponse.type_registry

    def structure_response(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            msg = f"expected a {requested.__name__} object (dict), got {_describe(value)}"
            raise _Invalid.at(msg)
        cls: type[EvaluationResponse[Any]] = requested
        # The registry is read per call: subclasses defined after this hook was built
        # register themselves (EvaluationResponse.__init_subclass__) and are found here.
        if "type_name" in value:
            type_name = value["type_name"]
            if not isinstance(type_name, str):
                raise _Invalid.at(f"expected str, got {_describe(type_name)}", "type_name")
            if type_name != requested.__name__:
                found = registry.get(type_name)
                if found is None:
                    msg = (
                        f"unknown EvaluationResponse type_name {type_name!r}; "
                        f"registered: {', '.join(sorted(registry))}"
                    )
                    raise _Invalid.at(msg, "type_name")
                if not issubclass(found, requested):
                    msg = (
                        f"type_name {type_name!r} names a class that is not a "
                        f"{requested.__name__}; structure it as {type_name} or a base of it"
                    )
                    raise _Invalid.at(msg, "type_name")
                cls = found
        result_type = args[0] if args and cls is requested else _result_type(cls)
        return _response_hook(cls, result_type)(value, cls)

    return structure_response


# --------------------------------------------------------------------------- unstructure


def _unstructure_fn(tp: Any) -> _UnstructureFn | None:
    """How to unstructure a value declared as ``tp``; ``None`` when it is already plain.

    Lists of primitives are copied in C (``list``); records and mixed unions dispatch on
    the value's runtime class, so subclasses keep their own fields.
    """
    if tp in (int, float, str, bool, _NoneType):
        return None
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (list, tuple) and args:
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            args = args[:1]
        inners = [_unstructure_fn(arg) for arg in args]
        if all(inner is None for inner in inners):
            return list
        if len(inners) == 1:
            inner = inners[0]
            if inner is list:
                return lambda value: [list(item) for item in value]
            return lambda value: [inner(item) for item in value]  # type: ignore[misc]
    if _is_union(tp):
        others = [arg for arg in args if arg is not _NoneType]
        if len(others) == 1:
            inner = _unstructure_fn(others[0])
            if inner is None:
                return None
            return lambda value: None if value is None else inner(value)
    return _converter.unstructure


def _make_record_unstructure(tp: Any) -> _UnstructureFn:
    cls, field_types = _field_types(tp)
    keeps_extra = issubclass(cls, Record)
    plan = [
        (a.name, _unstructure_fn(field_types[a.name]))
        for a in attrs.fields(cls)
        if a.init and not (keeps_extra and a.name == "extra")
    ]
    type_name = cls.__name__ if issubclass(cls, EvaluationResponse) else None
    written = frozenset(name for name, _ in plan) | ({"type_name"} if type_name else set())

    def unstructure_record(obj: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, fn in plan:
            value = getattr(obj, name)
            out[name] = value if fn is None else fn(value)
        if type_name is not None:
            out["type_name"] = type_name
        if keeps_extra and obj.extra:
            clash = written.intersection(obj.extra)
            if clash:
                msg = (
                    f"{cls.__name__}.extra has keys {sorted(clash)} that are also written by "
                    f"the {cls.__name__} itself; extra holds only keys the model does not know"
                )
                raise ValueError(msg)
            out.update(obj.extra)
        return out

    return unstructure_record


# --------------------------------------------------------------------------- the converter


def _build_converter() -> cattrs.Converter:
    converter = cattrs.Converter()
    for tp, hook in _PRIMITIVE_HOOKS.items():
        converter.register_structure_hook(tp, hook)
    # Later registrations are consulted first: the most specific predicate goes last.
    converter.register_structure_hook_factory(attrs.has, _make_record_hook)
    converter.register_structure_hook_factory(_is_union, _make_union_hook)
    converter.register_structure_hook_factory(_is_tuple, _make_tuple_hook)
    converter.register_structure_hook_factory(_is_list, _make_list_hook)
    converter.register_structure_hook_factory(_is_response, _make_response_hook)
    converter.register_unstructure_hook_factory(attrs.has, _make_record_unstructure)
    return converter


_converter = _build_converter()


# --------------------------------------------------------------------------- public API


@overload
def structure(data: object, cls: type[T]) -> T: ...
@overload
def structure(data: object, cls: Any) -> Any: ...
def structure(data: object, cls: Any) -> Any:
    """Build ``cls`` (a model, ``list[Model]``, ``Rollout | TokenRollout``, ...) from plain
    data, checking every value. Raises :class:`ValidationError` listing every problem.

    Well-formed lists of primitives (token ids, masks, log-probabilities) are taken from
    ``data`` as they are, not copied: the result may share them with ``data``, which is
    meant to be freshly decoded (``json.loads``) and not used afterwards.
    """
    try:
        return _converter.structure(data, cls)
    except _DATA_ERRORS as exc:
        problems = _problems_of(exc)
    errors = [(message, _format_path(path)) for message, path in problems]
    raise ValidationError(errors, target=_type_name(cls))


def unstructure(obj: object) -> Any:
    """Turn a model (or a list of them) into JSON-ready ``dict``/``list`` data.

    Unknown keys kept in ``extra`` come back at top level; an ``EvaluationResponse`` also
    gets ``"type_name"``; ``(start, epoch)`` pairs become 2-lists.
    """
    return _converter.unstructure(obj)


_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

_PathOrFile = str | os.PathLike[str] | IO[str]


def dump_jsonl(objs: Iterable[object], path_or_file: _PathOrFile) -> int:
    """Write each object as one compact JSON line; return how many were written.

    A path is created or overwritten (UTF-8); an open text file is written to (and left
    open). The file is flushed after every line, so a reader (or a crash) sees whole
    records, except at most a last, truncated one, which :func:`load_jsonl` reports.
    """
    if isinstance(path_or_file, (str, os.PathLike)):
        with open(path_or_file, "w", encoding="utf-8") as file:
            return _write_lines(objs, file)
    return _write_lines(objs, path_or_file)


def _write_lines(objs: Iterable[object], file: IO[str]) -> int:
    count = 0
    for obj in objs:
        file.write(_encode(unstructure(obj)) + "\n")
        file.flush()
        count += 1
    return count


@overload
def load_jsonl(path_or_file: _PathOrFile, cls: type[T]) -> Iterator[T]: ...
@overload
def load_jsonl(path_or_file: _PathOrFile, cls: Any) -> Iterator[Any]: ...
def load_jsonl(path_or_file: _PathOrFile, cls: Any) -> Iterator[Any]:
    """Yield one ``cls`` per line of a JSON-lines file, reading one line at a time.

    Lines holding only whitespace are skipped. A line that is not valid JSON raises
    ``ValueError("line N: ...")``; a line that does not fit ``cls`` raises
    :class:`ValidationError` with ``line=N``. A last line without its newline that does
    not parse is reported as truncated (a writer interrupted mid-write), never dropped.
    A path is opened (UTF-8) on the first ``next()`` and closed when the iterator ends or
    is closed; an open text file is read from its current position and left open.
    """
    if isinstance(path_or_file, (str, os.PathLike)):
        with open(path_or_file, encoding="utf-8") as file:
            yield from _read_lines(file, cls)
    else:
        yield from _read_lines(path_or_file, cls)


def _read_lines(file: IO[str], cls: Any) -> Iterator[Any]:
    for number, line in enumerate(file, start=1):
        if line.isspace():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            if line.endswith("\n"):
                msg = f"line {number}: invalid JSON: {exc.msg} (column {exc.colno})"
            else:
                msg = (
                    f"line {number} is truncated: the file does not end with a newline and "
                    f"the line is not valid JSON ({exc.msg}); the writer was probably "
                    f"interrupted mid-write"
                )
            raise ValueError(msg) from None
        try:
            obj = structure(data, cls)
        except ValidationError as exc:
            raise ValidationError(exc.errors, exc.target, number) from None
        yield obj
