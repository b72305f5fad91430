"""What a gateway dialect is: a request read into the session's terms, a reply written back.

The gateway has one session model (:mod:`._session`): a call is a list of
:class:`~trio_rollouts.ChatMessage` objects, the tools in OpenAI's chat shape and the
sampling; its reply is a ``chat.completion`` object. A :class:`Dialect` translates one
wire API into that model and back, and knows nothing else: not the session, the
renderer or the backend. Three are served:

- ``/chat/completions`` (:class:`~._chat.ChatDialect`, OpenAI Chat Completions);
- ``/responses`` (:class:`~._responses.ResponsesDialect`, OpenAI Responses, the OpenAI
  Agents SDK's default and Codex's only API);
- ``/messages`` (:class:`~._anthropic.MessagesDialect`, Anthropic Messages).

Because every dialect reads into the same conversation, the session's matching, bridging
and breaks are the same whichever API the agent speaks; an agent may even mix them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any, Protocol

import attrs

from trio_rollouts._messages import ChatMessage, GenerationArgs
from trio_rollouts.gateway._http import HTTPResponse, StreamingResponse
from trio_rollouts.gateway._session import GatewayError

__all__ = ["Dialect", "DialectCall", "json_response", "streamed"]


@attrs.frozen
class DialectCall:
    """One call read from a request body.

    - ``messages``: the conversation the model is to answer, in chat messages (for a
      Responses call that names ``previous_response_id``, only what the body adds: the
      gateway puts the recalled conversation before it);
    - ``tools``: OpenAI chat-shape tools (``{"type": "function", "function": {...}}``), or
      ``None``;
    - ``args``: the sampling (the gateway's, with the fields it leaves unset from the body);
    - ``model``: the name the reply echoes;
    - ``stream``: whether the reply is to be streamed; ``options``: what the dialect needs
      again to write the reply (``include_usage``, say);
    - ``system``: a system prompt the API keeps outside its message list (Responses'
      ``instructions``, Anthropic's ``system``), or ``None``: the gateway puts it first
      (in place of the recalled conversation's own, when the call continues one);
    - ``previous``: the id of an earlier reply of the session whose conversation this
      call continues (Responses' ``previous_response_id``), or ``None``: the gateway puts
      that conversation before ``messages`` (a 400 when the session gave no such reply).
    """

    messages: list[ChatMessage]
    tools: list[dict[str, Any]] | None
    args: GenerationArgs
    model: str
    stream: bool = False
    options: Mapping[str, Any] = attrs.field(factory=dict)
    system: str | None = None
    previous: str | None = None


class Dialect(Protocol):
    """One wire API of the gateway (see the module's docstring).

    - ``route``: the path under ``/v1/`` it is served on (``"chat/completions"``);
    - :meth:`read`: the body as a :class:`DialectCall` (a :class:`GatewayError` with 400
      naming the field otherwise); ``generation_args`` and ``model`` are the gateway's;
    - :meth:`answer`: the response to send for ``reply`` (the session's
      ``chat.completion`` object), whole or as server-sent events;
    - :meth:`error`: ``error`` in the dialect's error shape.
    """

    route: str

    def read(
        self, body: Mapping[str, Any], generation_args: GenerationArgs, model: str
    ) -> DialectCall: ...

    def answer(
        self, reply: Mapping[str, Any], call: DialectCall
    ) -> HTTPResponse | StreamingResponse: ...

    def error(self, error: GatewayError) -> HTTPResponse: ...


def json_response(status: int, body: Mapping[str, Any]) -> HTTPResponse:
    """``body`` as a JSON response (UTF-8, non-ASCII kept as it is)."""
    return HTTPResponse(status=status, body=json.dumps(body, ensure_ascii=False).encode())


def streamed(events: Iterable[bytes]) -> StreamingResponse:
    """A 200 server-sent-events response sending ``events`` (complete frames) in order."""
    return StreamingResponse(status=200, chunks=_chunks(list(events)))


async def _chunks(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk
