"""What every renderer shares: the parsed turn, the protocol, and the bridge proof.

A renderer proves a bridge on the conversation at hand: the template's render of every
message so far (the sampled assistant turns as structured messages: content, tool calls,
reasoning) must start with the text of the ids the episode holds, and the bridge is what
follows. A template that rewrites history (drops earlier reasoning, re-serialises a tool
call, moves the system prompt) fails that check, and the turn is a break, never a drift.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from trio_rollouts._messages import CHAT_ROLES, ChatMessage

__all__ = [
    "AssistantTurn",
    "Renderer",
    "ToolCall",
    "assemble_turn",
    "check_roles",
    "checked_ids",
    "declared_roles",
    "refuse_assistant_messages",
    "renderer_roles",
]


@attrs.frozen(kw_only=True)
class ToolCall:
    """A tool call the model wrote, as parsed from its ids.

    ``arguments`` is the call's arguments as an object, whether the model wrote them as a
    JSON object or as a JSON string holding one (the OpenAI wire form). ``None`` means
    the call could not be read: ``parse_error`` then says why, ``name`` is whatever could
    be read (or ``None``), and ``raw`` is always the call's text as sampled. Nothing is
    repaired: a broken call is an observation for the environment.

    ``id`` is the model's own call id where its format has one (Mistral, Kimi-K2), else
    ``call_<index>`` within the turn (:class:`~trio_rollouts.MultiTurnAgent` makes those
    unique within the episode as ``call_<turn>_<index>``), or, for Mistral's formats,
    nine letters and digits derived from the call (its templates refuse other ids).
    """

    id: str
    name: str | None
    arguments: dict[str, Any] | None
    raw: str
    parse_error: str | None = None


@attrs.frozen(kw_only=True)
class AssistantTurn:
    """One assistant turn parsed from its ids: the text outside tool calls and reasoning
    (``content``: stripped when there are tool calls, as sampled otherwise, so a plain
    answer re-renders as the model wrote it), the tool calls in order, the reasoning if
    any, and
    ``parse_error`` naming each call that could not be parsed (``None`` if all could;
    each call's own reason is on :attr:`ToolCall.parse_error`)."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    parse_error: str | None = None

    def to_message(self) -> ChatMessage:
        """The turn as a structured assistant message, in the OpenAI shape that chat
        templates and servers read: ``content``, ``tool_calls`` (``id``, ``type``,
        ``function.name``, ``function.arguments`` as a JSON string; a broken call's
        arguments are its raw text) and ``reasoning_content`` when there is reasoning."""
        extra: dict[str, Any] = {}
        if self.tool_calls:
            extra["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.name or "",
                        "arguments": call.raw
                        if call.arguments is None
                        else json.dumps(call.arguments, ensure_ascii=False),
                    },
                }
                for call in self.tool_calls
            ]
        if self.reasoning is not None:
            extra["reasoning_content"] = self.reasoning
        return ChatMessage(role="assistant", content=self.content, extra=extra)


@runtime_checkable
class Renderer(Protocol):
    """One model family's chat template, in ids.

    - ``render(messages, *, tools=None, add_generation_prompt=True)``: the ids of a
      conversation, ending with the generation prompt when asked;
    - ``bridge(previous_ids, new_messages, *, tools=None, messages=None)``: the ids to
      append after a finished assistant turn so that ``previous_ids + bridge`` is what
      ``render`` of the whole conversation gives, ending with the generation prompt;
      ``None`` when that cannot be proved. ``messages`` is the conversation that
      ``previous_ids`` holds (assistant turns as :meth:`AssistantTurn.to_message`): with
      it the proof is made on that conversation; an assistant message in
      ``new_messages`` is a ``ValueError``;
    - ``parse(completion_ids)``: the turn, parsed from the ids;
    - ``decode(ids)`` and ``encode(text)`` (no template, no special tokens);
    - ``stop_token_ids``: the ids that end generation; ``close_ids``: what ends an
      assistant turn (appended after a turn cut by ``max_tokens``; may be empty when
      the template closes a turn with the next message's opening, as GLM's does).

    A bridge whose new messages render to no text at all (a template that drops a role
    it does not know) proves nothing the model will see: it is ``None``.

    A renderer of your own may leave out the ``messages`` keyword of ``bridge``:
    :class:`~trio_rollouts.MultiTurnAgent` then calls it without, and the proof is
    whatever that renderer makes. It may also have

    - ``call_id(turn, index) -> str``, the id of a call the model wrote without one
      (default ``call_<turn>_<index>``);
    - ``extra_roles``, the roles its template renders besides
      :attr:`ChatMessage.ROLES <trio_rollouts.ChatMessage.ROLES>` (default none: a
      message of another role is refused where an episode renders it);
    - ``token_vocabulary``, what its ids are
      (:data:`~trio_rollouts.inference.CODE_POINTS`, a tokenizer's vocabulary; default
      ``None``, not declared): an agent refuses it over a backend whose
      :attr:`~trio_rollouts.inference.ReturnsTokens.token_vocabulary` is another.
    """

    @property
    def stop_token_ids(self) -> list[int]: ...

    @property
    def close_ids(self) -> list[int]: ...

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]: ...

    def bridge(
        self,
        previous_ids: Sequence[int],
        new_messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int] | None: ...

    def parse(self, completion_ids: Sequence[int]) -> AssistantTurn: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode(self, text: str) -> list[int]: ...


def checked_ids(value: Iterable[object], what: str) -> list[int]:
    """``value`` as a list of token ids (``TypeError`` naming ``what[i]`` otherwise)."""
    ids: list[int] = []
    for i, token in enumerate(value):
        if not isinstance(token, int) or isinstance(token, bool):
            msg = f"{what}[{i}] = {token!r} is not a token id (an int)"
            raise TypeError(msg)
        ids.append(token)
    return ids


def declared_roles(value: object) -> tuple[str, ...]:
    """A renderer's ``extra_roles`` as a tuple, declared to
    :meth:`ChatMessage.declare_roles` so that messages may have them (``TypeError`` or
    ``ValueError`` naming ``extra_roles`` for anything but role names)."""
    if isinstance(value, str) or not isinstance(value, Iterable):
        msg = f"extra_roles must be a sequence of role names (str), got {value!r:.60}"
        raise TypeError(msg)
    roles = tuple(value)
    try:
        ChatMessage.declare_roles(roles)
    except (TypeError, ValueError) as error:
        msg = f"extra_roles: {error}"
        raise type(error)(msg) from None
    return roles


def renderer_roles(renderer: object) -> tuple[str, ...]:
    """The roles ``renderer`` renders: :attr:`ChatMessage.ROLES
    <trio_rollouts.ChatMessage.ROLES>` and its ``extra_roles`` (none when it declares
    none)."""
    extra = getattr(renderer, "extra_roles", None) or ()
    return CHAT_ROLES + tuple(role for role in extra if role not in CHAT_ROLES)


def check_roles(renderer: object, messages: Sequence[ChatMessage], where: str) -> None:
    """Every message has a role ``renderer`` renders (:func:`renderer_roles`): a
    ``ValueError`` naming ``where[i].role``, the role, the renderer and its roles
    otherwise."""
    roles = renderer_roles(renderer)
    for i, message in enumerate(messages):
        if message.role not in roles:
            allowed = ", ".join(map(repr, roles))
            msg = (
                f"{where}[{i}].role is {message.role!r}, which the renderer "
                f"{type(renderer).__name__} does not render (its roles: {allowed}): its "
                "template would drop the message or write it as something else. Send it "
                "in one of those roles, or declare the role in the renderer's extra_roles "
                "if its template renders it"
            )
            raise ValueError(msg)


def refuse_assistant_messages(new_messages: Sequence[ChatMessage]) -> None:
    """A bridge holds what comes between assistant turns: an assistant message in it is a
    ``ValueError`` naming its index."""
    for i, message in enumerate(new_messages):
        if message.role == "assistant":
            msg = (
                f"new_messages[{i}] is an assistant message: a bridge holds what comes "
                "between assistant turns (the turns themselves are the sampled ids)"
            )
            raise ValueError(msg)


def assemble_turn(content: str, calls: Sequence[ToolCall], reasoning: str | None) -> AssistantTurn:
    """The turn of a parse: each broken call named in ``parse_error``; the content
    stripped when the turn has tool calls (templates write their own separators around
    calls), verbatim otherwise (templates write a plain answer as it is)."""
    errors = [
        f"tool call {index}: {call.parse_error}"
        for index, call in enumerate(calls)
        if call.parse_error is not None
    ]
    return AssistantTurn(
        content=content.strip() if calls else content,
        tool_calls=tuple(calls),
        reasoning=reasoning,
        parse_error="; ".join(errors) or None,
    )


def remainder(prefix: str, full: str) -> str | None:
    """What ``full`` has after ``prefix``, or ``None`` when it does not start with it: the
    bridge proof, in text."""
    if not full.startswith(prefix):
        return None
    return full[len(prefix) :]
