"""``openai``: gpt-oss's harmony format, read from its text.

A turn is a run of messages, each ``<|channel|>NAME[ to=RECIPIENT][ <|constrain|>FMT]
<|message|>BODY`` ended by ``<|end|>``, ``<|call|>`` or ``<|return|>``, the later ones
opened by ``<|start|>assistant`` (the generation prompt opened the first). The
``analysis`` channel is the reasoning (:func:`reasoning`); a message to
``functions.NAME`` is a tool call whose body is its JSON arguments; ``final`` (and
``commentary`` addressed to no one) is the content.

OpenAI's ``openai-harmony`` reads this format from token ids of its own vocabulary, which
it downloads at first use: :class:`~trio_rollouts.renderers.HarmonyRenderer` renders and
parses with it; here the text is read, which works offline on any tokenizer's ids (and
is :class:`~trio_rollouts.renderers.HarmonyRenderer`'s fallback for ids harmony cannot
parse).
"""

from __future__ import annotations

import re

from trio_rollouts.renderers._base import ToolCall
from trio_rollouts.renderers._calls import call_from_parts

_START = "<|start|>"
_ENDS = re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def _messages(text: str) -> list[tuple[str, str, str]]:
    """``(header, body, whole)`` of each message in the turn."""
    messages = []
    for piece in text.split(_START):
        if not piece.strip():
            continue
        header, found, rest = piece.partition("<|message|>")
        if not found:
            messages.append(("", piece, piece))
            continue
        end = _ENDS.search(rest)
        body = rest[: end.start()] if end else rest
        messages.append((header, body, piece))
    return messages


def _channel(header: str) -> str:
    _, found, rest = header.partition("<|channel|>")
    return rest.split()[0] if found and rest.split() else ""


def reasoning(text: str, *, opened: bool) -> tuple[str | None, str]:
    """The ``analysis`` messages' text, and the turn without them."""
    thoughts: list[str] = []
    kept: list[str] = []
    for header, body, whole in _messages(text):
        if _channel(header) == "analysis" and not _RECIPIENT.search(header):
            thoughts.append(body)
        else:
            kept.append(whole)
    if not thoughts:
        return None, text
    return "\n".join(thoughts), "".join(_START + whole for whole in kept)


def parse(text: str) -> tuple[str, list[ToolCall]]:
    content: list[str] = []
    calls: list[ToolCall] = []
    for header, body, _whole in _messages(text):
        recipient = _RECIPIENT.search(header)
        if recipient is None:
            if _channel(header) in ("final", "commentary", ""):
                content.append(body)
            continue
        target = recipient.group(1)
        name = target.removeprefix("functions.")
        calls.append(call_from_parts(f"call_{len(calls)}", body, name, body))
    return "".join(content), calls
