"""The converter, built once from hooks registered by type, and the two calls that use
it: :func:`structure` and :func:`unstructure`."""

from __future__ import annotations

from typing import Any, TypeVar, overload

import attrs
import cattrs

from trio_rollouts.models._convert._errors import (
    DATA_ERRORS,
    Invalid,
    ValidationError,
    describe,
    format_path,
    problems_of,
    type_name,
)
from trio_rollouts.models._convert._hooks import (
    PRIMITIVE_HOOKS,
    make_list_hook,
    make_tuple_hook,
    make_union_hook,
)
from trio_rollouts.models._convert._records import (
    is_response,
    make_record_hook,
    make_record_unstructure,
    make_response_hook,
)
from trio_rollouts.models._convert._types import is_list, is_tuple, is_union
from trio_rollouts.models._rollouts import Cut

__all__ = ["structure", "unstructure"]

T = TypeVar("T")


def _build_converter() -> cattrs.Converter:
    converter = cattrs.Converter()
    for tp, hook in PRIMITIVE_HOOKS.items():
        converter.register_structure_hook(tp, hook)
    # Later registrations are consulted first: the most specific predicate goes last.
    converter.register_structure_hook_factory(attrs.has, make_record_hook)
    converter.register_structure_hook_factory(is_union, make_union_hook)
    converter.register_structure_hook_factory(is_tuple, make_tuple_hook)
    converter.register_structure_hook_factory(is_list, make_list_hook)
    converter.register_structure_hook_factory(is_response, make_response_hook)
    converter.register_unstructure_hook_factory(attrs.has, make_record_unstructure)
    converter.register_structure_hook(Cut, _structure_cut)
    converter.register_unstructure_hook(Cut, list)
    return converter


def _structure_cut(value: object, _: object) -> Cut:
    """``[generated_tokens, elapsed_seconds, epoch]`` (``RolloutGroup.cuts``); the
    group's validator checks the values."""
    if not isinstance(value, list | tuple) or len(value) != 3:
        message = (
            f"expected [generated_tokens, elapsed_seconds, epoch] (3 items), got {describe(value)}"
        )
        raise Invalid.at(message)
    return Cut(*value)


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
    except DATA_ERRORS as exc:
        problems = problems_of(exc)
    errors = [(message, format_path(path)) for message, path in problems]
    raise ValidationError(errors, target=type_name(cls))


def unstructure(obj: object) -> Any:
    """Turn a model (or a list of them) into JSON-ready ``dict``/``list`` data.

    Unknown keys kept in ``extra`` come back at top level; an ``EvaluationResponse`` also
    gets ``"type_name"``; ``(start, epoch)`` pairs become 2-lists.
    """
    return _converter.unstructure(obj)
