"""Hooks for attrs classes: records (unknown keys kept in ``extra``) and
``EvaluationResponse`` (the registered class its ``type_name`` names), both ways."""

from __future__ import annotations

import typing
from typing import Any, TypeVar

import attrs
import cattrs

from trio_rollouts._messages import Record
from trio_rollouts.models._convert._errors import DATA_ERRORS, Invalid, Problem, collect, describe
from trio_rollouts.models._convert._fast import MISS, quick_path
from trio_rollouts.models._convert._hooks import PRIMITIVE_HOOKS
from trio_rollouts.models._convert._types import NoneType, StructureHook, UnstructureFn, is_union
from trio_rollouts.models._evaluation import EvaluationResponse, EvaluationResult, ResultT

__all__ = ["is_response", "make_record_hook", "make_record_unstructure", "make_response_hook"]


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


def make_record_hook(
    tp: Any,
    converter: cattrs.Converter,
    *,
    reserved: frozenset[str] = frozenset(),
    typevars: dict[Any, Any] | None = None,
) -> StructureHook:
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
    fields: dict[str, tuple[str, StructureHook, Any, bool, type | None, Any]] = {}
    required: list[str] = []
    for a in attrs.fields(cls):
        if not a.init or (keeps_extra and a.name == "extra"):
            continue
        field_type = field_types[a.name]
        nullable = False
        if is_union(field_type) and NoneType in typing.get_args(field_type):
            others = [m for m in typing.get_args(field_type) if m is not NoneType]
            if len(others) == 1:
                field_type, nullable = others[0], True
        exact = field_type if field_type in PRIMITIVE_HOOKS else None
        hook = converter.get_structure_hook(field_type)
        quick = quick_path(field_type)
        fields[a.name] = (a.alias or a.name, hook, field_type, nullable, exact, quick)
        if a.default is attrs.NOTHING:
            required.append(a.name)
    name = cls.__name__

    def structure_record(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise Invalid.at(f"expected a {name} object (dict), got {describe(value)}")
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        problems: list[Problem] | None = None
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
                if structured is not MISS:
                    kwargs[alias] = structured
                    continue
            try:
                kwargs[alias] = hook(item, field_type)
            except DATA_ERRORS as exc:
                problems = collect(problems, exc, key)
        for key in required:
            if key not in value:
                problems = problems or []
                problems.append(("required field missing", (key,)))
        if problems:
            raise Invalid(problems)
        if keeps_extra:
            kwargs["extra"] = extra
        try:
            return cls(**kwargs)
        except (ValueError, TypeError) as exc:
            raise Invalid.at(str(exc)) from exc

    return structure_record


# --------------------------------------------------------------------------- evaluation


def is_response(tp: Any) -> bool:
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


def make_response_hook(tp: Any, converter: cattrs.Converter) -> StructureHook:
    requested: type[EvaluationResponse[Any]] = typing.get_origin(tp) or tp
    args = typing.get_args(tp)
    registry = EvaluationResponse.type_registry
    # The record hook of each response class with each results type, built once.
    record_hooks: dict[tuple[type, Any], StructureHook] = {}

    def record_hook(cls: type, result_type: Any) -> StructureHook:
        key = (cls, result_type)
        hook = record_hooks.get(key)
        if hook is None:
            hook = make_record_hook(
                cls, converter, reserved=frozenset({"type_name"}), typevars={ResultT: result_type}
            )
            record_hooks[key] = hook
        return hook

    def structure_response(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            msg = f"expected a {requested.__name__} object (dict), got {describe(value)}"
            raise Invalid.at(msg)
        cls: type[EvaluationResponse[Any]] = requested
        # The registry is read per call: subclasses defined after this hook was built
        # register themselves (EvaluationResponse.__init_subclass__) and are found here.
        if "type_name" in value:
            type_name = value["type_name"]
            if not isinstance(type_name, str):
                raise Invalid.at(f"expected str, got {describe(type_name)}", "type_name")
            if type_name != requested.__name__:
                found = registry.get(type_name)
                if found is None:
                    msg = (
                        f"unknown EvaluationResponse type_name {type_name!r}; "
                        f"registered: {', '.join(sorted(registry))}"
                    )
                    raise Invalid.at(msg, "type_name")
                if not issubclass(found, requested):
                    msg = (
                        f"type_name {type_name!r} names a class that is not a "
                        f"{requested.__name__}; structure it as {type_name} or a base of it"
                    )
                    raise Invalid.at(msg, "type_name")
                cls = found
        result_type = args[0] if args and cls is requested else _result_type(cls)
        return record_hook(cls, result_type)(value, cls)

    return structure_response


def _unstructure_fn(tp: Any, converter: cattrs.Converter) -> UnstructureFn | None:
    """How to unstructure a value declared as ``tp``; ``None`` when it is already plain.

    Lists of primitives are copied in C (``list``); records and mixed unions dispatch on
    the value's runtime class, so subclasses keep their own fields.
    """
    if tp in (int, float, str, bool, NoneType):
        return None
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (list, tuple) and args:
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            args = args[:1]
        inners = [_unstructure_fn(arg, converter) for arg in args]
        if all(inner is None for inner in inners):
            return list
        if len(inners) == 1:
            inner = inners[0]
            if inner is list:
                return lambda value: [list(item) for item in value]
            return lambda value: [inner(item) for item in value]  # type: ignore[misc]
    if is_union(tp):
        others = [arg for arg in args if arg is not NoneType]
        if len(others) == 1:
            inner = _unstructure_fn(others[0], converter)
            if inner is None:
                return None
            return lambda value: None if value is None else inner(value)
    return converter.unstructure


def make_record_unstructure(tp: Any, converter: cattrs.Converter) -> UnstructureFn:
    cls, field_types = _field_types(tp)
    keeps_extra = issubclass(cls, Record)
    plan = [
        (a.name, _unstructure_fn(field_types[a.name], converter))
        for a in attrs.fields(cls)
        if a.init and not (keeps_extra and a.name == "extra")
    ]
    # Fields written only when set (a new field that must not change older records).
    omitted_if_none = frozenset(a.name for a in attrs.fields(cls) if a.metadata.get("omit_if_none"))
    type_name = cls.__name__ if issubclass(cls, EvaluationResponse) else None
    written = frozenset(name for name, _ in plan) | ({"type_name"} if type_name else set())

    def unstructure_record(obj: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, fn in plan:
            value = getattr(obj, name)
            if value is None and name in omitted_if_none:
                continue
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
