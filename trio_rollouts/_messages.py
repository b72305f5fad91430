"""The ground floor of the data model: the record base, chat messages and generation arguments.

These are what the inference layer and the models both speak, so they live below both,
beside ``_checks``: ``inference/`` imports them from here, and ``models/`` re-exports
them with the records that build on the inference contract (a request holds its
inference interface). Inside ``models/`` they could not be: importing any module of a
package runs its ``__init__``, so ``inference/`` would load ``models/``, whose requests
load ``inference/``. This module imports nothing of the package but the validators.

:class:`Record` is the base of every record that keeps unknown keys, with the field
checks the records share. Every value is checked where it is made (``TypeError`` for a
wrong type, ``ValueError`` for one out of range, naming the field and the value).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, ClassVar, Final

import attrs

from trio_rollouts._checks import check_str as _check_str
from trio_rollouts._checks import is_int as _is_int
from trio_rollouts._checks import is_real as _is_real

__all__ = [
    "CHAT_ROLES",
    "ChatMessage",
    "GenerationArgs",
    "LLMChatMessage",
    "Record",
    "check_list",
    "check_optional_float",
]


# --------------------------------------------------------------------------- base record


@attrs.define(kw_only=True)
class Record:
    """A record that keeps unknown keys (``extra``) through a round trip."""

    #: Keys this library does not know, preserved verbatim by structure/unstructure.
    extra: dict[str, Any] = attrs.field(factory=dict, repr=False)


def check_optional_float(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """An attrs validator: the field is a real number (a bool is not) or ``None``."""
    if value is None:
        return
    if not _is_real(value):
        msg = f"{attribute.name} must be a float or None, got {value!r}"
        raise TypeError(msg)


def check_list(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """An attrs validator: the field is a ``list`` (its items are the record's to check)."""
    if not isinstance(value, list):
        msg = f"{attribute.name} must be a list, got {type(value).__name__} {value!r:.80}"
        raise TypeError(msg)


# --------------------------------------------------------------------------- messages


#: The roles every chat template renders.
CHAT_ROLES: Final = ("system", "user", "assistant", "tool")
#: The roles a message may have: :data:`CHAT_ROLES` and those renderers declared
#: (:meth:`ChatMessage.declare_roles`), in the order they were declared.
_roles: dict[str, None] = dict.fromkeys(CHAT_ROLES)


def _check_role(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, str) and value in _roles:
        return
    _check_str(instance, attribute, value)
    allowed = ", ".join(map(repr, _roles))
    msg = (
        f"role must be one of {allowed} (or a role a renderer declares in its extra_roles), "
        f"got {value!r:.40}"
    )
    if value == "function":
        msg += ": OpenAI's deprecated name for a tool result, which is a 'tool' message"
    raise ValueError(msg)


@attrs.define(kw_only=True)
class ChatMessage(Record):
    """One message of a chat: ``role`` and its text ``content``. Extra keys
    (``tool_calls``, ``tool_call_id``, ``name``) are kept in :attr:`extra`.

    ``role`` is one of :attr:`ROLES` (``"system"``, ``"user"``, ``"assistant"``,
    ``"tool"``), which every chat template renders, or a role that a renderer declares
    (its ``extra_roles``: Llama 3's ``"ipython"``, gpt-oss's ``"developer"``); any other
    is a ``ValueError`` naming the roles allowed. A template drops a message whose role
    it does not know, silently (Qwen2.5's drops a ``"function"`` message): the model
    would never see it.
    """

    #: The roles every chat template renders.
    ROLES: ClassVar[tuple[str, ...]] = CHAT_ROLES

    role: str = attrs.field(validator=_check_role)
    content: str = attrs.field(validator=_check_str)

    @staticmethod
    def declare_roles(roles: Iterable[str]) -> None:
        """Let messages have ``roles`` besides :attr:`ROLES`, from now on, in this
        process: what a renderer does for its ``extra_roles`` when it is made (so make
        the renderer before the messages). Each role must be a non-empty string
        (``TypeError``/``ValueError`` otherwise). Idempotent."""
        if isinstance(roles, str):
            msg = f"roles must be an iterable of role names, not one string: got {roles!r:.40}"
            raise TypeError(msg)
        checked = []
        for role in roles:
            if not isinstance(role, str):
                msg = f"a role must be a str, got {role!r:.40}"
                raise TypeError(msg)
            if not role.strip():
                msg = f"a role must be a non-empty name, got {role!r}"
                raise ValueError(msg)
            checked.append(role)
        _roles.update(dict.fromkeys(checked))

    @staticmethod
    def allowed_roles() -> tuple[str, ...]:
        """The roles a message may have now: :attr:`ROLES`, then those declared."""
        return tuple(_roles)


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
