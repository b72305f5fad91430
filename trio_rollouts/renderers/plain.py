"""``PlainRenderer``: the plain layout in code points, with no dependency."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import attrs

from trio_rollouts._messages import ChatMessage
from trio_rollouts.inference._interface import CODE_POINTS
from trio_rollouts.renderers import hermes
from trio_rollouts.renderers._base import (
    AssistantTurn,
    assemble_turn,
    declared_roles,
    refuse_assistant_messages,
    remainder,
)
from trio_rollouts.renderers._think import split

__all__ = ["PlainRenderer"]


@attrs.frozen
class PlainRenderer:
    """The plain layout in code points, with no dependency.

    A message is ``"<|role|>\\ncontent\\n"``; the generation prompt is
    ``"<|assistant|>\\n"`` (as :func:`~trio_rollouts.inference.render_plain_chat`). Tools,
    when given, come first as one ``"<|tools|>\\n<JSON list>\\n"`` block. The model writes
    tool calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` and may open
    its turn with a ``<think>...</think>`` block. An assistant message with structured
    fields (:meth:`~trio_rollouts.AssistantTurn.to_message`) renders as
    ``<think>reasoning</think>`` (when it has reasoning), then its content, then each call
    as ``<tool_call>`` + ``json.dumps({"name": ..., "arguments": {...}})`` +
    ``</tool_call>``: a turn the model wrote in that form bridges, any other is a break.
    No token ends a turn (``stop_token_ids == close_ids == []``): the bridge after a turn
    is ``"\\n"``, the new messages, and the generation prompt.

    ``extra_roles``: roles to render besides ``system``, ``user``, ``assistant`` and
    ``tool`` (the layout writes any role as ``<|role|>``); they are declared to
    :class:`~trio_rollouts.ChatMessage` when the renderer is made.
    :attr:`token_vocabulary` is :data:`~trio_rollouts.inference.CODE_POINTS` (unless a
    subclass encodes otherwise), as :class:`~trio_rollouts.inference.EmbeddedInference`'s.
    """

    extra_roles: tuple[str, ...] = attrs.field(default=(), kw_only=True, converter=declared_roles)

    @property
    def token_vocabulary(self) -> str | None:
        """:data:`~trio_rollouts.inference.CODE_POINTS`; ``None`` (not declared) for a
        subclass whose ``encode`` or ``decode`` is its own (a tokenizer's ids in this
        layout): such a subclass declares its own."""
        cls = type(self)
        if cls.encode is PlainRenderer.encode and cls.decode is PlainRenderer.decode:
            return CODE_POINTS
        return None

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
        return self.encode(self._text(messages, tools, add_generation_prompt))

    def bridge(
        self,
        previous_ids: Sequence[int],
        new_messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None = None,
        messages: Sequence[ChatMessage] | None = None,
    ) -> list[int] | None:
        """The ids after a finished turn. With ``messages`` (the conversation that
        ``previous_ids`` holds) they are proved on it: the render of ``messages`` and
        ``new_messages`` must start with ``previous_ids``' text (else ``None``). Without,
        the layout's own guarantee: every message renders alone, so the bridge is
        ``"\\n"``, the new messages and the generation prompt."""
        refuse_assistant_messages(new_messages)
        if messages is None:
            text = "\n" + "".join(_message_text(message) for message in new_messages)
            return self.encode(text + "<|assistant|>\n")
        full = self._text([*messages, *new_messages], tools, True)
        rest = remainder(self.decode(previous_ids), full)
        return None if rest is None else self.encode(rest)

    def parse(self, completion_ids: Sequence[int]) -> AssistantTurn:
        text = self.decode(completion_ids)
        reasoning, text = split(text, "<think>", "</think>", opened=False, strip=False)
        content, calls = hermes.parse(text)
        return assemble_turn(content, calls, reasoning)

    def decode(self, ids: Sequence[int]) -> str:
        try:
            return "".join(map(chr, ids))
        except (ValueError, TypeError, OverflowError):
            for i, token in enumerate(ids):
                if not isinstance(token, int) or not 0 <= token <= sys.maxunicode:
                    msg = (
                        f"ids[{i}] = {token!r} is not a PlainRenderer token: its tokens are "
                        f"Unicode code points, 0 to {sys.maxunicode}"
                    )
                    raise ValueError(msg) from None
            raise

    def encode(self, text: str) -> list[int]:
        return [ord(character) for character in text]

    def _text(
        self,
        messages: Sequence[ChatMessage],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> str:
        parts = [f"<|tools|>\n{json.dumps(tools)}\n"] if tools else []
        parts += [_message_text(message) for message in messages]
        if add_generation_prompt:
            parts.append("<|assistant|>\n")
        return "".join(parts)


def _message_text(message: ChatMessage) -> str:
    extra = message.extra
    if message.role != "assistant" or not ("tool_calls" in extra or "reasoning_content" in extra):
        return f"<|{message.role}|>\n{message.content}\n"
    reasoning = extra.get("reasoning_content")
    parts = [f"<|{message.role}|>\n"]
    if isinstance(reasoning, str):
        parts.append(f"<think>{reasoning}</think>")
    parts.append(message.content)
    for call in extra.get("tool_calls") or ():
        function = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments")
        try:
            decoded = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            parts.append(f"<tool_call>{arguments}</tool_call>")
            continue
        body = {"name": function.get("name"), "arguments": decoded}
        parts.append(f"<tool_call>{json.dumps(body, ensure_ascii=False)}</tool_call>")
    parts.append("\n")
    return "".join(parts)
