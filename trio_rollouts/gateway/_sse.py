"""Server-sent events for the gateway: a finished chat completion replayed as a stream.

The gateway generates a reply whole, then answers a ``stream: true`` request with the chunks
:func:`chat_completion_chunks` makes of it: the ``chat.completion.chunk`` sequence OpenAI
sends, which the openai SDK (``stream=True``, ``ChatCompletionStreamState``,
``client.chat.completions.stream``) and the OpenAI Agents SDK accumulate back into the same
message. In order:

1. a role chunk, ``delta: {"role": "assistant", "content": ""}`` (``"content": null`` when the
   message has no content, as OpenAI sends before tool calls, so accumulating gives
   ``None`` back, not ``""``);
2. the content, if not empty, in one chunk;
3. per tool call, a chunk opening it (``index``, ``id``, ``type: "function"``,
   ``function: {"name", "arguments": ""}``), then one with its arguments, if not empty;
4. a chunk with an empty delta and the ``finish_reason``;
5. with ``include_usage`` (the request's ``stream_options.include_usage``), a chunk with
   ``choices: []`` and the ``usage``;
6. ``data: [DONE]``.

Every chunk carries the reply's ``id``, ``created`` and ``model`` (and its
``system_fingerprint``, if it has one), ``object: "chat.completion.chunk"``, and
``usage: null`` except the usage chunk, as OpenAI does when usage is asked for.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["SSE_DONE", "chat_completion_chunks", "sse_event"]

#: The event that ends an OpenAI stream.
SSE_DONE = b"data: [DONE]\n\n"


def sse_event(data: Mapping[str, Any]) -> bytes:
    """One server-sent event: ``data: `` and ``data`` as compact JSON (UTF-8), then a blank line."""
    return (
        b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
    )


def chat_completion_chunks(reply: Mapping[str, Any], *, include_usage: bool) -> list[bytes]:
    """The SSE events streaming ``reply``, a ``chat.completion`` with one choice, would send.

    See the module's docstring for the sequence; the last event is :data:`SSE_DONE`. Raises
    ``KeyError`` if ``reply`` lacks ``id``, ``created``, ``model`` or ``choices[0]``'s
    ``message`` and ``finish_reason`` (and ``usage``, with ``include_usage``).
    """
    common: dict[str, Any] = {
        "id": reply["id"],
        "object": "chat.completion.chunk",
        "created": reply["created"],
        "model": reply["model"],
    }
    if reply.get("system_fingerprint") is not None:
        common["system_fingerprint"] = reply["system_fingerprint"]
    choice = reply["choices"][0]
    message = choice["message"]

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        return sse_event({**common, "choices": choices, "usage": None})

    content = message.get("content")
    events = [chunk({"role": "assistant", "content": None if content is None else ""})]
    if content:
        events.append(chunk({"content": content}))
    for index, call in enumerate(message.get("tool_calls") or ()):
        function = call["function"]
        opening = {
            "index": index,
            "id": call["id"],
            "type": "function",
            "function": {"name": function["name"], "arguments": ""},
        }
        events.append(chunk({"tool_calls": [opening]}))
        if function.get("arguments"):
            arguments = {"index": index, "function": {"arguments": function["arguments"]}}
            events.append(chunk({"tool_calls": [arguments]}))
    events.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        events.append(sse_event({**common, "choices": [], "usage": reply["usage"]}))
    events.append(SSE_DONE)
    return events
