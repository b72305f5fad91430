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

Its ``control`` setting serves a server's weight-update control endpoints, modelled on
their documented behaviour (``docs/pausing-servers.md``):

- ``"vllm"``: ``POST /pause?mode=abort|keep|wait&clear_cache=...`` (query parameters;
  ``abort`` and ``clear_cache=true`` by default) and ``POST /resume``; with
  ``dev_mode=False`` they are not mounted (404), as in vLLM >= 0.16 without
  ``VLLM_SERVER_DEV_MODE=1``. As vLLM 0.32 does, a pause without ``clear_cache=false``
  resets the caches, preempting every running request (``preempted``) and emptying the
  prefix cache (``cache_resets``), in keep mode too. A chat request with
  ``continue_final_message`` must also send ``add_generation_prompt: false`` (400).
- ``"sglang"``: ``POST /pause_generation {"mode": "abort"|"in_place"}`` (``abort`` by
  default), ``POST /continue_generation``, ``POST /update_weight_version
  {"new_version", "abort_all_requests"}``, which aborts every request in flight unless
  ``abort_all_requests`` is ``false`` (its default is ``true``).

While paused, a request that arrives is held until resume (both servers); a request in
flight does not finish (keep, ``in_place``); ``abort`` ends every request in flight with
its partial output (the first ``abort_after`` characters of its completion, half by
default) and ``finish_reason: "abort"``. The "model" is deterministic: a request that
continues an aborted one (a final assistant message with ``continue_final_message``,
or a completions prompt followed by the partial text) is answered with the rest of the
completion it was aborted in. A ``/v1/completions`` prompt may be a list of token ids
(vLLM, SGLang): one that is the context of an aborted request (its prompt's ids and the
ids it generated) is answered with the rest too.

Token ids: a generated character is one token (its code point); with
``special_every=k``, every ``k``-th generated token is also followed by
:data:`SPECIAL_ID`, a special token that the text leaves out, as vLLM's
``skip_special_tokens`` does. A chat prompt's ids are its messages' lengths; a text
prompt's, its characters'.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from typing import Any, Literal
from urllib.parse import parse_qs

import attrs
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from trio_rollouts.inference import InferenceError, InferenceInterface, InferenceRequest

#: Prompt-token log-probability the default reply reports for every generated token.
DEFAULT_LOGPROB = -0.5

#: A special token: generated (with ``special_every``) but never in the text.
SPECIAL_ID = 100_000

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
    #: When set, the served models: ``GET /v1/models`` lists them, and a completion
    #: request for another model gets vLLM's 404 (``The model `x` does not exist.``).
    #: ``None``: no ``/v1/models`` route, and any model is served.
    models: tuple[str, ...] | None = None
    #: ``GET /v1/models`` requests received.
    models_received: int = 0
    #: When set, ``GET /v1/models`` answers with this status and no list.
    models_status: int | None = None
    #: When set, every request waits for this event before it is answered.
    gate: trio.Event | None = None
    #: The control endpoints served (module docstring), and whether vLLM's are mounted.
    control: Literal["vllm", "sglang"] | None = None
    dev_mode: bool = True
    #: Control path (without the query) -> a status to answer with, doing nothing.
    control_status: dict[str, int] = attrs.field(factory=dict)
    #: Control requests received: the path with its query, and the JSON body (or None).
    control_received: list[tuple[str, Any]] = attrs.field(factory=list)
    #: How many characters of its completion an aborted request keeps (None: half).
    abort_after: int | None = None
    paused: str | None = None
    #: Requests being generated (admitted, not held, not answered yet).
    running: int = 0
    #: Requests aborted, with the partial text each returned.
    aborted: list[str] = attrs.field(factory=list)
    _resumed: trio.Event = attrs.field(factory=trio.Event)
    _running_scopes: set[trio.CancelScope] = attrs.field(factory=set)
    #: Insert :data:`SPECIAL_ID` after every this many generated tokens (None: never).
    special_every: int | None = None
    #: Running requests preempted, and caches reset, by pauses without clear_cache=false.
    preempted: int = 0
    cache_resets: int = 0
    _continuations: dict[tuple[str, str], str] = attrs.field(factory=dict)
    # An aborted request's context (prompt ids + generated ids) -> the rest of its text.
    _id_continuations: dict[tuple[int, ...], str] = attrs.field(factory=dict)
    _changed: trio.Event = attrs.field(factory=trio.Event)
    #: Fields accepted but ignored, as most servers do with what they do not know: the
    #: response carries nothing for them and no error is raised.
    ignored_fields: frozenset[str] = frozenset()
    #: llama-cpp-python's server: chat logprobs are ``null`` unless ``top_logprobs`` is set.
    llama_cpp_python: bool = False
    #: llama.cpp's ``llama-server``: ``/v1/completions`` logprobs in the chat shape
    #: (``logprobs.content[i]`` with ``token``, ``logprob``, ``bytes``, ``top_logprobs``).
    completions_chat_shape: bool = False
    #: ``llama-server``'s chat logprobs: every this many generated tokens are merged into
    #: one logprob entry (a character spanning several byte tokens). None: one per token.
    merge_logprobs: int | None = None

    def reply(self, *replies: Reply) -> None:
        """Answer the next requests with ``replies``, in order."""
        self.script.extend(replies)

    async def wait_received(self, n: int) -> None:
        """Return once ``n`` requests have arrived."""
        while len(self.received) < n:
            await self._changed.wait()

    async def wait_running(self, n: int) -> None:
        """Return once ``n`` requests are being generated (not held by a pause)."""
        while self.running < n:
            await self._changed.wait()

    async def wait_control(self, n: int) -> None:
        """Return once ``n`` control requests have arrived."""
        while len(self.control_received) < n:
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self._handle, methods=["POST"]),
            Route("/v1/completions", self._handle, methods=["POST"]),
        ]
        if self.models is not None:
            routes.append(Route("/v1/models", self._models, methods=["GET"]))
        if self.control == "vllm" and self.dev_mode:
            routes += [
                Route("/pause", self._control, methods=["POST"]),
                Route("/resume", self._control, methods=["POST"]),
            ]
        elif self.control == "sglang":
            routes += [
                Route(path, self._control, methods=["POST"])
                for path in ("/pause_generation", "/continue_generation", "/update_weight_version")
            ]
        return Starlette(routes=routes)

    async def _models(self, request: Request) -> Response:
        self.models_received += 1
        if self.models_status is not None:
            return JSONResponse({"error": "unavailable"}, status_code=self.models_status)
        data = [{"id": name, "object": "model", "owned_by": "vllm"} for name in self.models or ()]
        return JSONResponse({"object": "list", "data": data})

    # ------------------------------------------------------------------ control endpoints

    async def _control(self, request: Request) -> Response:
        raw = await request.body()
        body = json.loads(raw) if raw else None
        path = request.url.path
        query = f"?{request.url.query}" if request.url.query else ""
        self.control_received.append((path + query, body))
        self._notify()
        status = self.control_status.get(path)
        if status is not None:
            return JSONResponse({"error": f"{path} failed"}, status_code=status)
        if path == "/pause":
            query = parse_qs(request.url.query)
            mode = query.get("mode", ["abort"])[0]
            if query.get("clear_cache", ["true"])[0].lower() != "false":
                # vLLM 0.32: the caches are reset with the running requests preempted,
                # whatever the mode (its docstring says keep ignores the flag).
                self.cache_resets += 1
                if mode == "keep":
                    self.preempted += self.running
            self._pause(mode)
            return JSONResponse({"status": "paused"})
        if path == "/pause_generation":
            self._pause((body or {}).get("mode", "abort"))
            return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})
        if path in ("/resume", "/continue_generation"):
            self.paused = None
            self._resumed.set()
            self._notify()
            if path == "/resume":
                return JSONResponse({"status": "resumed"})
            return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})
        # /update_weight_version: SGLang aborts everything unless told not to.
        if (body or {}).get("abort_all_requests", True):
            self._abort_running()
        return JSONResponse({"success": True, "message": "ok"})

    def _pause(self, mode: str) -> None:
        if self.paused is None:
            self._resumed = trio.Event()
        self.paused = mode
        if mode == "abort":
            self._abort_running()
        self._notify()

    def _abort_running(self) -> None:
        for scope in self._running_scopes:
            scope.cancel()

    async def _held_while_paused(self) -> None:
        while self.paused is not None:
            await self._resumed.wait()

    def _plan(self, chat: bool, body: dict[str, Any]) -> tuple[str, str, str]:
        """What the request generates: (what identifies its prompt, the text already
        generated that it continues, the text it generates)."""
        if chat:
            messages = body["messages"]
            if body.get("continue_final_message") and messages[-1]["role"] == "assistant":
                base, prefix = json.dumps(messages[:-1]), messages[-1]["content"]
                rest = self._continuations.get((base, prefix))
                if rest is not None:
                    return base, prefix, rest
                return base, prefix, f"{self.name}: {messages[-2]['content']}"
            return json.dumps(messages), "", f"{self.name}: {messages[-1]['content']}"
        prompt = body["prompt"]
        if isinstance(prompt, list):  # token ids
            base = json.dumps(prompt)
            rest = self._id_continuations.get(tuple(prompt))
            return base, "", rest if rest is not None else f"{self.name}: {len(prompt)} ids"
        for (base, prefix), rest in self._continuations.items():
            if prefix and base + prefix == prompt:
                return base, prefix, rest
        last = prompt.splitlines()[-1] if prompt else ""
        return prompt, "", f"{self.name}: {last}"

    async def _handle(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ClientDisconnect:
            # The client was cancelled while sending; nobody waits for an answer.
            return Response(status_code=499)
        self.received.append(
            Received(path=request.url.path, headers=dict(request.headers), body=body)
        )
        self._notify()
        if self.models is not None and body.get("model") not in self.models:
            message = f"The model `{body.get('model')}` does not exist."
            error = {"object": "error", "message": message, "type": "NotFoundError", "code": 404}
            return JSONResponse(error, status_code=404)
        reply = self.script.popleft() if self.script else self.default
        chat = request.url.path.endswith("/chat/completions")
        if (
            self.control == "vllm"
            and chat
            and body.get("continue_final_message")
            and body.get("add_generation_prompt", True)
        ):
            message = (
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
            return JSONResponse({"object": "error", "message": message}, status_code=400)
        base, prefix, text = self._plan(chat, body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        generating = trio.CancelScope()
        try:
            await self._held_while_paused()  # arrived while paused: held until resume
            self._running_scopes.add(generating)
            self.running += 1
            self._notify()
            try:
                with generating:  # an abort cancels it
                    if self.gate is not None:
                        await self.gate.wait()
                    await trio.sleep(reply.delay)
                    await self._held_while_paused()  # keep: frozen until resume
            finally:
                self._running_scopes.discard(generating)
                self.running -= 1
        finally:
            self.in_flight -= 1
        if generating.cancelled_caught:
            keep = len(text) // 2 if self.abort_after is None else self.abort_after
            partial = text[:keep]
            self._continuations[(base, prefix + partial)] = text[keep:]
            context = self._prompt_ids(chat, body) + self.token_ids(partial)
            self._id_continuations[tuple(context)] = text[keep:]
            self.aborted.append(partial)
            self._notify()
            return JSONResponse(self._completion(request, body, Reply(), partial, "abort"))
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
        payload = reply.json
        if payload is None:
            payload = self._completion(request, body, reply, text, "stop")
        return JSONResponse(payload, status_code=reply.status, headers=reply.headers)

    def token_ids(self, text: str) -> list[int]:
        """The ids of generated ``text``: a code point per character, and
        :data:`SPECIAL_ID` after every ``special_every``-th (which the text leaves out)."""
        ids: list[int] = []
        for number, char in enumerate(text, 1):
            ids.append(ord(char))
            if self.special_every is not None and number % self.special_every == 0:
                ids.append(SPECIAL_ID)
        return ids

    @staticmethod
    def _prompt_ids(chat: bool, body: dict[str, Any]) -> list[int]:
        if chat:
            return [len(m["content"]) for m in body["messages"]]
        prompt = body["prompt"]
        return list(prompt) if isinstance(prompt, list) else [ord(c) for c in prompt]

    def _refusal(self, body: dict[str, Any]) -> Response | None:
        if self.unknown_fields is None:
            return None
        known = self.known_fields
        if "logprobs" in known:  # a server that knows logprobs knows top_logprobs
            known = known | {"top_logprobs"}
        unknown = sorted(body.keys() - known)
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

    def _completion(
        self, request: Request, body: dict[str, Any], reply: Reply, text: str, finish: str
    ) -> Any:
        chat = request.url.path.endswith("/chat/completions")
        prompt_ids = self._prompt_ids(chat, body)
        generated_ids = self.token_ids(text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(generated_ids),
            "total_tokens": len(prompt_ids) + len(generated_ids),
        }
        top: dict[str, Any] = {"id": "cmpl-test", "model": body.get("model"), "usage": usage}
        if chat:
            top["object"] = "chat.completion"
            choice["message"] = {"role": "assistant", "content": text}
        else:
            top["object"] = "text_completion"
            choice["text"] = text
        body = {key: value for key, value in body.items() if key not in self.ignored_fields}
        if body.get("return_token_ids"):
            choice["token_ids"] = generated_ids
            if chat:
                top["prompt_token_ids"] = prompt_ids
            else:
                choice["prompt_token_ids"] = prompt_ids
        wants_logprobs = bool(body.get("logprobs"))
        if self.llama_cpp_python and chat and body.get("top_logprobs") is None:
            wants_logprobs = False
        if wants_logprobs:
            tokens = [chr(i) if i != SPECIAL_ID else "" for i in generated_ids]
            if chat or self.completions_chat_shape:
                content = [
                    {
                        "token": t,
                        "logprob": DEFAULT_LOGPROB,
                        "bytes": list(t.encode()),
                        "top_logprobs": [],
                    }
                    for t in tokens
                ]
                if self.merge_logprobs is not None:
                    k = self.merge_logprobs
                    content = content[::k]
                choice["logprobs"] = {"content": content}
            else:
                choice["logprobs"] = {
                    "tokens": tokens,
                    "token_logprobs": [DEFAULT_LOGPROB] * len(tokens),
                }
        choice.update(reply.choice_extra)
        top.update(reply.top_extra)
        return {**top, "choices": [choice]}


async def failures_of_concurrent_calls(
    interface: InferenceInterface, request: InferenceRequest, n: int, within: float = 5.0
) -> list[InferenceError]:
    """The errors of ``n`` calls of ``request`` made at once, each of which must fail
    with an :class:`InferenceError`, all within ``within`` seconds."""
    errors: list[InferenceError] = []

    async def one() -> None:
        try:
            await interface.agenerate(request)
        except InferenceError as exc:
            errors.append(exc)
        else:
            raise AssertionError("the call succeeded")

    with trio.fail_after(within):
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(one)
    return errors


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
