"""Fakes for the placement and group-call tests of ``OpenAIInference``: the servers of
``tests/_openai_server.py`` and ``tests/_vllm_native_server.py`` taught ``n``, and held
requests that make a replica's load known.

- :class:`GroupServer` (OpenAI routes): answers a request with ``n`` as vLLM does, ``n``
  choices (choice 0 is the fake's usual completion, choice ``i`` that text followed by
  ``" #i"``), the prompt's ids once and ``usage`` for the whole request (the prompt once,
  the choices' completion tokens added). ``refuse_n``: a 400 naming ``n`` in OpenAI's
  shape (``"param": "n"``) instead. A plain :class:`FakeOpenAIServer` answers one choice
  for any ``n``, as servers that ignore the field do.
- :class:`GroupVLLM` (the native stub): ``sampling_params.n`` gives ``n`` choices that
  generate side by side, token by token (choice ``i`` with ``seed + i``, as vLLM seeds
  it; ``choice_tokens`` caps each choice's length), one request id for them all (an
  abort by it ends every choice; a pause with ``mode=abort`` ends each running choice
  with its partial output). ``max_n``: vLLM's 400 for ``n`` above ``--max-num-seqs``.
- Both hold a request whose last message (or text prompt) is in ``holds.prompts``
  until ``holds.release()``: the test knows which calls are in flight where.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import trio
from _openai_server import FakeOpenAIServer, Received, Reply
from _vllm_native_server import FakeVLLM, token_at
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response


def last_prompt(body: dict[str, Any]) -> str:
    """The last message's content of a chat body, or a text prompt ("" for ids)."""
    if "messages" in body:
        return str(body["messages"][-1]["content"])
    prompt = body.get("prompt")
    return prompt.splitlines()[-1] if isinstance(prompt, str) and prompt else ""


def with_choices(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """One reply from the single-choice replies of each choice: their choices numbered,
    the usage of one request (the prompt once, the completion tokens added)."""
    first = payloads[0]
    choices = []
    completion = 0
    for index, payload in enumerate(payloads):
        (choice,) = payload["choices"]
        choices.append({**choice, "index": index})
        completion += payload["usage"]["completion_tokens"]
    prompt = first["usage"]["prompt_tokens"]
    usage = {"prompt_tokens": prompt, "completion_tokens": completion}
    usage["total_tokens"] = prompt + completion
    return {**first, "usage": usage, "choices": choices}


@attrs.define(eq=False)
class Holds:
    """The requests a fake holds: those whose last message (or text prompt) is in
    ``prompts`` wait until :meth:`release`; ``count`` are waiting."""

    prompts: set[str] = attrs.field(factory=set)
    count: int = 0
    released: trio.Event = attrs.field(factory=trio.Event)

    async def hold(self, body: dict[str, Any], notify: Callable[[], None]) -> None:
        if last_prompt(body) not in self.prompts:
            return
        self.count += 1
        notify()
        try:
            await self.released.wait()
        finally:
            self.count -= 1

    def release(self) -> None:
        """Let every held request go on; later requests are held again only for the
        prompts listed after this."""
        released, self.released = self.released, trio.Event()
        self.prompts = set()
        released.set()


def n_completion(
    single: Callable[[Request, dict[str, Any], Reply, str, str], Any],
    request: Request,
    body: dict[str, Any],
    reply: Reply,
    text: str,
    finish: str,
) -> Any:
    """The reply to ``body`` with its ``n`` choices, from the fake's one-choice reply
    (``single``): choice ``i`` is the text followed by ``" #i"``."""
    n = body.get("n", 1)
    payloads = [
        single(request, body, reply, text if i == 0 else f"{text} #{i}", finish) for i in range(n)
    ]
    return payloads[0] if n == 1 else with_choices(payloads)


@attrs.define(kw_only=True, eq=False)
class GroupServer(FakeOpenAIServer):
    """An OpenAI-compatible fake that honours ``n`` (module docstring)."""

    refuse_n: bool = False
    holds: Holds = attrs.field(factory=Holds)

    async def wait_holding(self, n: int) -> None:
        """Return once ``n`` requests are held."""
        while self.holds.count < n:
            await self._changed.wait()

    async def _handle(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ClientDisconnect:
            return Response(status_code=499)
        if self.refuse_n and body.get("n", 1) > 1:
            headers = dict(request.headers)
            self.received.append(Received(path=request.url.path, headers=headers, body=body))
            self._notify()
            message = "n > 1 is not supported by this server"
            error = {"message": message, "type": "invalid_request_error", "param": "n"}
            return JSONResponse({"error": error}, status_code=400)
        await self.holds.hold(body, self._notify)
        return await super()._handle(request)

    def _completion(
        self, request: Request, body: dict[str, Any], reply: Reply, text: str, finish: str
    ) -> Any:
        return n_completion(super()._completion, request, body, reply, text, finish)


@attrs.define(kw_only=True, eq=False)
class GroupVLLM(FakeVLLM):
    """The native stub with ``sampling_params.n`` (module docstring)."""

    #: Tokens each choice generates at most (index = choice; missing: ``tokens``).
    choice_tokens: list[int] = attrs.field(factory=list)
    #: vLLM's ``--max-num-seqs``: a larger ``n`` is refused with its 400.
    max_n: int | None = None
    holds: Holds = attrs.field(factory=Holds)

    async def wait_holding(self, n: int) -> None:
        """Return once ``n`` requests are held."""
        while self.holds.count < n:
            await self._changed.wait()

    async def _generate(self, request: Request) -> Response:
        body = await request.json()
        n = body["sampling_params"].get("n", 1)
        if n == 1:
            return await super()._generate(request)
        self.order.append(request.url.path)
        self.native_received.append(body)
        self._moved()
        if self.max_n is not None and n > self.max_n:
            message = (
                f"sampling_params.n must be at most the server's max_num_seqs "
                f"({self.max_n}), got {n}."
            )
            error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
            return JSONResponse({"error": error}, status_code=400)
        rewritten = f"generate-tokens-{body['request_id']}"
        context = list(body["token_ids"])
        params: dict[str, Any] = body["sampling_params"]
        asked = min(params.get("max_tokens", self.tokens), self.tokens)
        wanted = [
            min(asked, self.choice_tokens[i]) if i < len(self.choice_tokens) else asked
            for i in range(n)
        ]
        seed = params.get("seed") or 0
        generated: list[list[int]] = [[] for _ in range(n)]
        versions: list[list[str]] = [[] for _ in range(n)]
        scope = trio.CancelScope()
        for i in range(n):
            self.generating[f"{rewritten}#{i}"] = generated[i]
        self._native_scopes[rewritten] = scope

        def running() -> list[int]:
            return [i for i in range(n) if len(generated[i]) < wanted[i]]

        try:
            with scope:
                await self._held_while_paused()
                self._running_scopes.add(scope)
                self.running += 1
                self._notify()
                try:
                    while running():
                        while self.budget is not None and all(
                            len(generated[i]) >= self.budget for i in running()
                        ):
                            await self._progress.wait()
                        await trio.sleep(self.token_time)
                        await self._held_while_paused()  # keep: frozen between tokens
                        for i in running():
                            if self.budget is None or len(generated[i]) < self.budget:
                                ids = generated[i]
                                ids.append(token_at(context + ids, len(ids), seed + i))
                                versions[i].append(self.weight_version)
                        self._moved()
                finally:
                    self._running_scopes.discard(scope)
                    self.running -= 1
        finally:
            for i in range(n):
                del self.generating[f"{rewritten}#{i}"]
            del self._native_scopes[rewritten]
        replies = [
            self._native_reply(
                body,
                rewritten,
                generated[i],
                versions[i],
                "abort" if len(generated[i]) < wanted[i] else "length",
            )
            for i in range(n)
        ]
        return JSONResponse(with_choices(replies))

    async def _handle(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ClientDisconnect:
            return Response(status_code=499)
        await self.holds.hold(body, self._notify)
        return await super()._handle(request)

    def _completion(
        self, request: Request, body: dict[str, Any], reply: Reply, text: str, finish: str
    ) -> Any:
        return n_completion(super()._completion, request, body, reply, text, finish)


@asynccontextmanager
async def serving(*servers: FakeOpenAIServer) -> AsyncIterator[None]:
    """Serve each fake on an ephemeral port of 127.0.0.1 (``base_url`` with ``/v1``).
    Keep-alive never expires server-side: the tests run on a mock clock that jumps."""
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        for server in servers:
            config = Config()
            config.bind = ["127.0.0.1:0"]
            config.graceful_timeout = 0.2
            config.keep_alive_timeout = 10**9
            binds = await nursery.start(
                partial(serve, server.app(), config, shutdown_trigger=shutdown.wait)
            )
            server.base_url = f"{binds[0]}/v1"
        try:
            yield
        finally:
            shutdown.set()
