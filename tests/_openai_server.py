"""A small OpenAI-compatible server for the backend tests: starlette served by hypercorn on
127.0.0.1 with an ephemeral port, inside the test's own Trio nursery (:func:`serving`) or
in a thread with its own Trio loop for synchronous tests (:func:`serving_in_thread`).

A :class:`FakeOpenAIServer` records every request it receives and answers from a script
of :class:`Reply` objects, then with a default reply in the style of vLLM: the
completion is ``"<name>: <last message>"``, with token ids and log-probabilities when the
request asks for them (``return_token_ids``, ``logprobs``), and a ``usage`` object.

Its ``unknown_fields`` setting makes it a server that knows only ``known_fields`` and
refuses any other request field before answering, the way real strict servers do:
``"transformers"`` with ``transformers serve``'s 422 (``{"detail": "Unexpected fields in
the request: {'return_token_ids'}"}``), ``"openai"`` with api.openai.com's 400
(``Unrecognized request argument supplied: return_token_ids``). Such a server returns
token ids or logprobs only for the fields it knows. Nothing here is a mock of the
client: the backend under test speaks real HTTP over loopback.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from typing import Any, Literal

import attrs
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

#: Prompt-token log-probability the default reply reports for every generated token.
DEFAULT_LOGPROB = -0.5

#: The request fields of the core OpenAI API that the backend may send.
CORE_FIELDS = frozenset(
    {"model", "messages", "prompt", "tools", "temperature", "top_p", "max_tokens", "stream"}
)


@attrs.define(kw_only=True)
class Reply:
    """One scripted answer: a status, a JSON body (``None``: the default completion) or a
    raw ``text`` body, headers, a delay before answering, and fields merged into the
    default completion's first choice (``choice_extra``) or top level (``top_extra``)."""

    status: int = 200
    json: Any = None
    text: str | None = None
    headers: dict[str, str] = attrs.field(factory=dict)
    delay: float = 0.0
    choice_extra: dict[str, Any] = attrs.field(factory=dict)
    top_extra: dict[str, Any] = attrs.field(factory=dict)


@attrs.define(kw_only=True)
class Received:
    """A request as the server saw it."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@attrs.define(kw_only=True, eq=False)
class FakeOpenAIServer:
    """The app's state: the script, what arrived, and how many requests are being served."""

    name: str = "server"
    #: When set, a request without ``Authorization: Bearer <api_key>`` gets a 401 whose
    #: message repeats the key it was given (as some servers do).
    api_key: str | None = None
    script: deque[Reply] = attrs.field(factory=deque)
    default: Reply = attrs.field(factory=Reply)
    received: list[Received] = attrs.field(factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    base_url: str = ""
    #: ``None``: accept every field (vLLM). Else refuse fields outside ``known_fields``
    #: like ``transformers serve`` (422) or api.openai.com (400).
    unknown_fields: Literal["transformers", "openai"] | None = None
    known_fields: frozenset[str] = CORE_FIELDS
    #: When set, every request waits for this event before it is answered.
    gate: trio.Event | None = None
    _changed: trio.Event = attrs.field(factory=trio.Event)

    def reply(self, *replies: Reply) -> None:
        """Answer the next requests with ``replies``, in order."""
        self.script.extend(replies)

    async def wait_received(self, n: int) -> None:
        """Return once ``n`` requests have arrived."""
        while len(self.received) < n:
            await self._changed.wait()

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self._handle, methods=["POST"]),
                Route("/v1/completions", self._handle, methods=["POST"]),
            ]
        )

    async def _handle(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ClientDisconnect:
            # The client was cancelled while sending; nobody waits for an answer.
            return Response(status_code=499)
        self.received.append(
            Received(path=request.url.path, headers=dict(request.headers), body=body)
        )
        self._changed.set()
        self._changed = trio.Event()
        reply = self.script.popleft() if self.script else self.default
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            await trio.sleep(reply.delay)
        finally:
            self.in_flight -= 1
        given = request.headers.get("authorization", "")
        if self.api_key is not None and given != f"Bearer {self.api_key}":
            message = f"Incorrect API key provided: {given.removeprefix('Bearer ')}"
            error = {"error": {"message": message, "type": "invalid_request_error"}}
            return JSONResponse(error, status_code=401)
        refusal = self._refusal(body)
        if refusal is not None:
            return refusal
        if reply.text is not None:
            return Response(reply.text, status_code=reply.status, headers=reply.headers)
        payload = reply.json if reply.json is not None else self._completion(request, body, reply)
        return JSONResponse(payload, status_code=reply.status, headers=reply.headers)

    def _refusal(self, body: dict[str, Any]) -> Response | None:
        if self.unknown_fields is None:
            return None
        unknown = sorted(body.keys() - self.known_fields)
        if not unknown:
            return None
        if self.unknown_fields == "transformers":
            listed = "{" + ", ".join(repr(field) for field in unknown) + "}"
            detail = f"Unexpected fields in the request: {listed}"
            return JSONResponse({"detail": detail}, status_code=422)
        noun = "argument" if len(unknown) == 1 else "arguments"
        message = f"Unrecognized request {noun} supplied: {', '.join(unknown)}"
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
        return JSONResponse({"error": error}, status_code=400)

    def _completion(self, request: Request, body: dict[str, Any], reply: Reply) -> Any:
        chat = request.url.path.endswith("/chat/completions")
        if chat:
            last = body["messages"][-1]["content"]
            prompt_ids = [len(m["content"]) for m in body["messages"]]
        else:
            last = body["prompt"].splitlines()[-1] if body["prompt"] else ""
            prompt_ids = [ord(c) for c in body["prompt"]]
        text = f"{self.name}: {last}"
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(text),
            "total_tokens": len(prompt_ids) + len(text),
        }
        top: dict[str, Any] = {"id": "cmpl-test", "model": body.get("model"), "usage": usage}
        if chat:
            top["object"] = "chat.completion"
            choice["message"] = {"role": "assistant", "content": text}
        else:
            top["object"] = "text_completion"
            choice["text"] = text
        if body.get("return_token_ids"):
            choice["token_ids"] = [ord(c) for c in text]
            if chat:
                top["prompt_token_ids"] = prompt_ids
            else:
                choice["prompt_token_ids"] = prompt_ids
        if body.get("logprobs"):
            if chat:
                content = [{"token": c, "logprob": DEFAULT_LOGPROB} for c in text]
                choice["logprobs"] = {"content": content}
            else:
                choice["logprobs"] = {
                    "tokens": list(text),
                    "token_logprobs": [DEFAULT_LOGPROB] * len(text),
                }
        choice.update(reply.choice_extra)
        top.update(reply.top_extra)
        return {**top, "choices": [choice]}


@asynccontextmanager
async def serving(*servers: FakeOpenAIServer) -> AsyncIterator[None]:
    """Serve each server on its own ephemeral port of 127.0.0.1 (setting its
    ``base_url``, ``/v1`` included) until the block exits."""
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        for server in servers:
            config = Config()
            config.bind = ["127.0.0.1:0"]
            # Exit promptly: requests still held by a slow reply are cut off.
            config.graceful_timeout = 0.2
            binds = await nursery.start(
                partial(serve, server.app(), config, shutdown_trigger=shutdown.wait)
            )
            server.base_url = f"{binds[0]}/v1"
        try:
            yield
        finally:
            shutdown.set()


@contextmanager
def serving_in_thread(*servers: FakeOpenAIServer) -> Iterator[None]:
    """:func:`serving` in a background thread with its own Trio loop, for sync tests."""
    ready = threading.Event()
    failure: list[BaseException] = []
    stop: list[tuple[trio.lowlevel.TrioToken, trio.Event]] = []

    async def main() -> None:
        event = trio.Event()
        async with serving(*servers):
            stop.append((trio.lowlevel.current_trio_token(), event))
            ready.set()
            await event.wait()

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:
            failure.append(exc)
            ready.set()

    thread = threading.Thread(target=run, name="fake OpenAI server", daemon=True)
    thread.start()
    if not ready.wait(timeout=10):
        msg = "the fake OpenAI server did not start within 10 s"
        raise RuntimeError(msg)
    if failure:
        raise failure[0]
    try:
        yield
    finally:
        token, event = stop[0]
        trio.from_thread.run_sync(event.set, trio_token=token)
        thread.join(timeout=10)
        if failure:
            raise failure[0]
