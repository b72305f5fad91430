"""Renderers: one model family's chat template, in token ids.

A multi-turn episode is a token stream, not a message list: the ids the model sampled are
kept verbatim, and only what comes between two assistant turns (the environment's
messages and the next generation prompt) is rendered. A :class:`Renderer` renders a
conversation to ids, gives the ids to append after a finished assistant turn
(:meth:`Renderer.bridge`), and parses a turn's ids into an :class:`AssistantTurn`
without ever rendering it again.

:class:`PlainRenderer` needs no dependency: its ids are Unicode code points and its layout
is :func:`~trio_rollouts.inference.render_plain_chat`'s, so it matches
:class:`~trio_rollouts.inference.EmbeddedInference`'s tokens exactly.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from ._messages import ChatMessage

__all__ = ["AssistantTurn", "PlainRenderer", "Renderer", "ToolCall"]

_TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_THINK = re.compile(r"^\s*<think>(.*?)</think>", re.DOTALL)


@attrs.frozen(kw_only=True)
class ToolCall:
    """A tool call the model wrote, as parsed from its ids.

    ``arguments`` is ``None`` when the call is not a JSON object with a string ``name``
    and object ``arguments``; ``name`` is then whatever could be read (or ``None``), and
    ``raw`` is always the text between the tags, as sampled. Nothing is repaired: a
    broken call is an observation for the environment.
    """

    id: str
    name: str | None
    arguments: dict[str, Any] | None
    raw: str


@attrs.frozen(kw_only=True)
class AssistantTurn:
    """One assistant turn parsed from its ids: the text outside tool calls and reasoning
    (``content``), the tool calls in order, the reasoning (``<think>`` block) if any, and
    ``parse_error`` naming each call that could not be parsed (``None`` if all could)."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    parse_error: str | None = None


@runtime_checkable
class Renderer(Protocol):
    """One model family's chat template, in ids.

    - ``render(messages, *, tools=None, add_generation_prompt=True)``: the ids of a
      conversation, ending with the generation prompt when asked;
    - ``bridge(previous_ids, new_messages, *, tools=None)``: the ids to append after a
      finished assistant turn so that ``previous_ids + bridge`` is what ``render`` of the
      whole conversation gives, ending with the generation prompt; ``None`` when that
      cannot be proved; an assistant message in ``new_messages`` is a ``ValueError``;
    - ``parse(completion_ids)``: the turn, parsed from the ids;
    - ``decode(ids)`` and ``encode(text)`` (no template, no special tokens);
    - ``stop_token_ids``: the ids that end generation; ``close_ids``: what ends an
      assistant turn (appended after a turn cut by ``max_tokens``).
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


@attrs.frozen
class PlainRenderer:
    """The plain layout in code points, with no dependency.

    A message is ``"<|role|>\\ncontent\\n"``; the generation prompt is
    ``"<|assistant|>\\n"`` (as :func:`~trio_rollouts.inference.render_plain_chat`). Tools,
    when given, come first as one ``"<|tools|>\\n<JSON list>\\n"`` block. The model writes
    tool calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` and may open
    its turn with a ``<think>...</think>`` block. No token ends a turn
    (``stop_token_ids == close_ids == []``): the bridge after a turn is ``"\\n"``, the new
    messages, and the generation prompt.
    """

    @property
    def stop_token_ids(self) -> list[int]:
        return []

    @property
    def close_ids(self) -> list[int]:
        return []

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        parts = [f"<|tools|>\n{json.dumps(tools)}\n"] if tools else []
        parts += [_message_text(message) for message in messages]
        if add_generation_prompt:
            parts.append("<|assistant|>\n")
        return self.encode("".join(parts))

    def bridge(
        self,
        previous_ids: Sequence[int],
        new_messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int] | None:
        for i, message in enumerate(new_messages):
            if message.role == "assistant":
                msg = (
                    f"new_messages[{i}] is an assistant message: a bridge holds what comes "
                    "between assistant turns (the turns themselves are the sampled ids)"
                )
                raise ValueError(msg)
        text = "\n" + "".join(_message_text(message) for message in new_messages)
        return self.encode(text + "<|assistant|>\n")

    def parse(self, completion_ids: Sequence[int]) -> AssistantTurn:
        return _parse_turn(self.decode(completion_ids))

    def decode(self, ids: Sequence[int]) -> str:
        for i, token in enumerate(ids):
            if not 0 <= token <= sys.maxunicode:
                msg = (
                    f"ids[{i}] = {token} is not a PlainRenderer token: its tokens are "
                    f"Unicode code points, 0 to {sys.maxunicode}"
                )
                raise ValueError(msg)
        return "".join(map(chr, ids))

    def encode(self, text: str) -> list[int]:
        return [ord(character) for character in text]


def _parse_turn(text: str) -> AssistantTurn:
    """An assistant turn parsed from its text: an opening ``<think>...</think>`` block is the
    reasoning, each ``<tool_call>{JSON}</tool_call>`` a :class:`ToolCall` (an unclosed one
    runs to the end), and what is left, stripped, the content."""
    reasoning = None
    thought = _THINK.match(text)
    if thought is not None:
        reasoning = thought.group(1)
        text = text[thought.end() :]
    calls: list[ToolCall] = []
    errors: list[str] = []
    for number, found in enumerate(_TOOL_CALL.finditer(text)):
        raw, closed = found.group(1), bool(found.group(2))
        call, error = _tool_call(f"call_{number}", raw, closed)
        calls.append(call)
        if error is not None:
            errors.append(f"tool call {number}: {error}")
    content = _TOOL_CALL.sub("", text).strip()
    return AssistantTurn(
        content=content,
        tool_calls=tuple(calls),
        reasoning=reasoning,
        parse_error="; ".join(errors) or None,
    )


def _message_text(message: ChatMessage) -> str:
    return f"<|{message.role}|>\n{message.content}\n"


def _tool_call(call_id: str, raw: str, closed: bool) -> tuple[ToolCall, str | None]:
    """The call written between the tags, and why it is broken (``None`` if it is not)."""
    if not closed:
        return ToolCall(id=call_id, name=None, arguments=None, raw=raw), "no </tool_call>"
    try:
        data = json.loads(raw)
    except ValueError as error:
        return ToolCall(id=call_id, name=None, arguments=None, raw=raw), f"not JSON ({error})"
    if not isinstance(data, dict):
        kind = type(data).__name__
        return ToolCall(id=call_id, name=None, arguments=None, raw=raw), f"a {kind}, not an object"
    name = data.get("name")
    arguments = data.get("arguments", {})
    readable = name if isinstance(name, str) else None
    if readable is None:
        why = f"'name' is {name!r}, not a string"
        return ToolCall(id=call_id, name=None, arguments=None, raw=raw), why
    if not isinstance(arguments, dict):
        why = f"'arguments' is a {type(arguments).__name__}, not an object"
        return ToolCall(id=call_id, name=readable, arguments=None, raw=raw), why
    return ToolCall(id=call_id, name=readable, arguments=arguments, raw=raw), None
