"""The ground floor of the data model: chat messages and generation arguments.

These are what the inference layer and the models both speak, so they live below both:
``inference/`` and ``_models.py`` import them from here, and this module imports nothing
of the package but the validators. Every value is checked where it is made (``TypeError``
for a wrong type, ``ValueError`` for one out of range, naming the field and the value).
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from ._checks import check_str as _check_str
from ._checks import is_int as _is_int
from ._checks import is_real as _is_real

__all__ = ["ChatMessage", "GenerationArgs", "LLMChatMessage", "Record"]


# --------------------------------------------------------------------------- base record


@attrs.define(kw_only=True)
class Record:
    """A record that keeps unknown keys (``extra``) through a round trip."""

    #: Keys this library does not know, preserved verbatim by structure/unstructure.
    extra: dict[str, Any] = attrs.field(factory=dict, repr=False)


# --------------------------------------------------------------------------- messages


@attrs.define(kw_only=True)
class ChatMessage(Record):
    """One message of a chat: ``role`` (``"system"``, ``"user"``, ``"assistant"``,
    ``"tool"``, ...) and its text ``content``. Extra keys (``tool_calls``, ``name``) are
    kept in :attr:`extra`."""

    role: str = attrs.field(validator=_check_str)
    content: str = attrs.field(validator=_check_str)


#: The origin's name for :class:`ChatMessage`.
LLMChatMessage = ChatMessage


def _check_temperature(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if not _is_real(value):
        msg = f"temperature must be a float >= 0 or None, got {value!r}"
        raise TypeError(msg)
    if not math.isfinite(value) or value < 0:  # type: ignore[arg-type,operator]
        msg = f"temperature must be a finite float >= 0 (0.0 is greedy), got {value!r}"
        raise ValueError(msg)


def _check_top_p(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if not _is_real(value):
        msg = f"top_p must be a float in (0, 1] or None, got {value!r}"
        raise TypeError(msg)
    if not 0.0 < value <= 1.0:  # type: ignore[operator]
        msg = f"top_p must be in (0, 1], got {value!r}"
        raise ValueError(msg)


def _check_top_k(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if not _is_int(value):
        msg = f"top_k must be an int >= 1 (or -1 for no limit) or None, got {value!r}"
        raise TypeError(msg)
    if value < 1 and value != -1:  # type: ignore[operator]
        msg = f"top_k must be >= 1, or -1 for no limit, got {value!r}"
        raise ValueError(msg)


def _check_max_tokens(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if not _is_int(value):
        msg = f"max_tokens must be an int >= 1 or None, got {value!r}"
        raise TypeError(msg)
    if value < 1:  # type: ignore[operator]
        msg = f"max_tokens must be >= 1, got {value!r}"
        raise ValueError(msg)


def _check_seed(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if not _is_int(value):
        msg = f"seed must be an int in [0, 2**63) or None, got {value!r:.40}"
        raise TypeError(msg)
    if not 0 <= value < 2**63:  # type: ignore[operator]
        msg = f"seed must be in [0, 2**63) (servers take an int64), got {value!r}"
        raise ValueError(msg)


@attrs.frozen(kw_only=True)
class GenerationArgs:
    """Sampling arguments. ``None`` means "not set": the server's default applies.

    ``0.0`` is a set value (greedy decoding), never replaced by a default.

    ``seed``: the request's random seed (an int in ``[0, 2**63)``), sent as the OpenAI
    ``seed`` field (vLLM's per-request seed); the embedded backend honours it exactly.
    Usually left unset and derived per request from
    :attr:`GroupedRolloutRequest.seed <trio_rollouts.GroupedRolloutRequest.seed>`.
    """

    temperature: float | None = attrs.field(default=None, validator=_check_temperature)
    top_k: int | None = attrs.field(default=None, validator=_check_top_k)
    top_p: float | None = attrs.field(default=None, validator=_check_top_p)
    max_tokens: int | None = attrs.field(default=None, validator=_check_max_tokens)
    seed: int | None = attrs.field(default=None, validator=_check_seed)

    def add(self, other: GenerationArgs) -> GenerationArgs:
        """Return a copy of ``self`` with every field that ``other`` sets applied."""
        if not isinstance(other, GenerationArgs):
            msg = f"GenerationArgs.add() takes a GenerationArgs, got {other!r}"
            raise TypeError(msg)
        changes = {
            name: value
            for name, value in attrs.asdict(other, recurse=False).items()
            if value is not None
        }
        return attrs.evolve(self, **changes)

    def set_fields(self) -> dict[str, int | float]:
        """The fields that are set, as a dict (what a backend forwards)."""
        return {
            name: value for name in _GENERATION_FIELDS if (value := getattr(self, name)) is not None
        }


_GENERATION_FIELDS = tuple(field.name for field in attrs.fields(GenerationArgs))
