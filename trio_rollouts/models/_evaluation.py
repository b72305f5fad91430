"""Evaluation records: results, and the responses that collect them per environment.

:class:`EvaluationResult` is one evaluated prompt and its response,
:class:`RewardEvaluationResult` one scored with a reward. :class:`EvaluationResponse` is
an environment's results with :meth:`~EvaluationResponse.metrics`; every subclass is
registered under its class name in :attr:`EvaluationResponse.type_registry`, which the
converter uses to structure a dict into the subclass its ``type_name`` names.
"""

from __future__ import annotations

from typing import Any, ClassVar, Generic, TypeVar

import attrs

from trio_rollouts._checks import check_optional_str as _check_optional_str
from trio_rollouts._checks import check_str as _check_str
from trio_rollouts._messages import ChatMessage, Record, check_list, check_optional_float
from trio_rollouts.models._requests import check_rank_info, to_rank_info

__all__ = [
    "EvaluationResponse",
    "EvaluationResult",
    "ResultT",
    "RewardEvaluationResult",
]


@attrs.define(kw_only=True)
class EvaluationResult(Record):
    """One evaluated prompt and the model's response."""

    prompt: str | list[ChatMessage]
    response: str | ChatMessage


@attrs.define(kw_only=True)
class RewardEvaluationResult(EvaluationResult):
    """An evaluation result scored with a reward."""

    reward: float = attrs.field(validator=check_optional_float)
    problem_id: str | None = attrs.field(default=None, validator=_check_optional_str)


ResultT = TypeVar("ResultT", bound=EvaluationResult)

#: Every EvaluationResponse subclass by class name (for structuring by ``type_name``).
_RESPONSE_TYPES: dict[str, type[EvaluationResponse[Any]]] = {}


@attrs.define(kw_only=True)
class EvaluationResponse(Record, Generic[ResultT]):
    """An environment's evaluation results. Subclasses implement :meth:`metrics`.

    Every subclass is registered under its class name: ``unstructure`` writes it as
    ``type_name`` and structuring a dict as ``EvaluationResponse`` returns the subclass
    the dict names. A later class with the same name replaces the earlier one.
    """

    env_id: str = attrs.field(validator=_check_str)
    results: list[ResultT] = attrs.field(validator=check_list)
    #: ``(rank, world_size)`` of the shard these results are, as the request's
    #: ``rank_info`` said (``None``: the whole evaluation). A merge of the ranks'
    #: responses checks it: each rank once, one world size.
    rank_info: tuple[int, int] | None = attrs.field(
        default=None, converter=to_rank_info, validator=check_rank_info
    )

    type_registry: ClassVar[dict[str, type[EvaluationResponse[Any]]]] = _RESPONSE_TYPES

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # attrs builds a new class for slotted classes; the last one built wins.
        _RESPONSE_TYPES[cls.__name__] = cls

    def metrics(self) -> dict[str, float]:
        """Aggregate the results into named metrics."""
        msg = f"{type(self).__name__} did not provide metric aggregation (override metrics())"
        raise NotImplementedError(msg)


_RESPONSE_TYPES["EvaluationResponse"] = EvaluationResponse
