"""A stub of vLLM 0.32 with ``--enable-scale-out`` for the native-route tests: the OpenAI
routes and the dev-mode control endpoints of :class:`FakeOpenAIServer` (``/pause``,
``/resume``), plus what the native path uses, modelled on the shapes measured on the
real server (``tools/vllm/native_probe.py``):

- ``POST /inference/v1/generate`` ``{"request_id", "model", "token_ids",
  "sampling_params", "return_token_ids", "output_mode"}``: generates ``min(max_tokens,
  tokens)`` tokens, one per ``token_time`` seconds (Trio's clock: tests run on
  ``autojump_clock``) and no more than ``budget`` (which the test raises), each labelled with the weight version in force when it is
  sampled; held while paused (``keep`` freezes it between tokens, ``abort`` ends it with
  its partial output and ``finish_reason: "abort"``). The reply's ``request_id`` is
  ``"generate-tokens-<id>"``, as vLLM rewrites it; ``weight_versions`` are its spans.
  With ``scale_out=False`` every native route answers vLLM's 403.
- ``POST /inference/v1/abort_requests {"request_ids"}``: aborts running requests by
  their *rewritten* id (the id as sent aborts nothing); ``abort_hangs`` makes it never
  answer.
- ``POST /update_weight_version {"new_version"}`` (``label_status`` refuses it);
  a fresh server labels ``"default"``.
- ``POST /tokenize`` (chat: one id per message, its length, then :data:`GENERATION_PROMPT`;
  text: its code points) and ``POST /detokenize``.

A generated token is ``(sum of the context + position + seed) % 26 + 97``: its text is
that letter, so a continuation from the context so far goes on exactly. ``/v1/completions``
with ``logprobs`` > 1 also answers top logprobs, ``logprobs_mode`` saying how they move
with the temperature (``"raw"``: not at all; ``"processed"``: divided by it; ``"none"``:
no top logprobs).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Literal

import attrs
import trio
from _openai_server import FakeOpenAIServer, Reply
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

#: The id ``/tokenize`` ends a chat's ids with (the generation prompt).
GENERATION_PROMPT = 7
#: The logprob of every generated token.
NATIVE_LOGPROB = -0.25
#: The top logprobs ``/v1/completions`` reports at temperature 1.
TOP_LOGPROBS = (-0.1, -1.0, -2.0, -3.0, -4.0)

DISABLED = (
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
)


def token_at(context: list[int], position: int, seed: int | None) -> int:
    """The id the stub samples after ``context`` at output ``position``."""
    return (sum(context) + position + (seed or 0)) % 26 + 97


@attrs.define(kw_only=True, eq=False)
class FakeVLLM(FakeOpenAIServer):
    """The stub's state (see the module docstring)."""

    control: Literal["vllm", "sglang"] | None = "vllm"
    scale_out: bool = True
    tokens: int = 8
    token_time: float = 0.0
    #: When set, no request generates more than this many tokens until it is raised
    #: (:meth:`allow`): a test holds a generation at a known token, deterministically.
    budget: int | None = None
    weight_version: str = "default"
    label_status: int | None = None
    tokenize_status: int | None = None
    abort_hangs: bool = False
    sampling_mask: bool = False
    text_mode: bool = True  # honours output_mode: "text" (vLLM 0.32 does)
    logprobs_mode: Literal["raw", "processed", "none"] = "raw"
    #: What arrived: native bodies, labels, abort id lists, tokenize bodies, in order;
    #: ``order`` has every native-side and control path as it arrived.
    native_received: list[dict[str, Any]] = attrs.field(factory=list)
    labels_received: list[str] = attrs.field(factory=list)
    aborts_received: list[list[str]] = attrs.field(factory=list)
    tokenize_received: list[dict[str, Any]] = attrs.field(factory=list)
    order: list[str] = attrs.field(factory=list)
    #: Native requests being generated, by rewritten id, with the tokens so far.
    generating: dict[str, list[int]] = attrs.field(factory=dict)
    _native_scopes: dict[str, trio.CancelScope] = attrs.field(factory=dict)
    _progress: trio.Event = attrs.field(factory=trio.Event)

    def app(self) -> Starlette:
        app = super().app()
        app.router.routes.extend(
            [
                Route("/inference/v1/generate", self._generate, methods=["POST"]),
                Route("/inference/v1/abort_requests", self._abort_requests, methods=["POST"]),
                Route("/update_weight_version", self._label, methods=["POST"]),
                Route("/tokenize", self._tokenize, methods=["POST"]),
                Route("/detokenize", self._detokenize, methods=["POST"]),
            ]
        )
        return app

    async def _control(self, request: Request) -> Response:
        self.order.append(request.url.path)
        return await super()._control(request)

    def _moved(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    def allow(self, budget: int | None) -> None:
        """Let every request generate up to ``budget`` tokens (``None``: no limit)."""
        self.budget = budget
        self._moved()

    async def wait_generated(self, n: int, count: int = 1) -> None:
        """Return once ``count`` native requests have generated ``n`` tokens or more."""
        while sum(len(ids) >= n for ids in self.generating.values()) < count:
            await self._progress.wait()

    async def wait_aborts(self, n: int) -> None:
        while len(self.aborts_received) < n:
            await self._progress.wait()

    # ------------------------------------------------------------------ native routes

    @staticmethod
    def _disabled() -> Response:
        error = {"message": DISABLED, "type": "PermissionDeniedError", "param": None, "code": 403}
        return JSONResponse({"error": error}, status_code=403)

    async def _generate(self, request: Request) -> Response:
        body = await request.json()
        self.order.append(request.url.path)
        self.native_received.append(body)
        self._moved()
        if not self.scale_out:
            return self._disabled()
        rewritten = f"generate-tokens-{body['request_id']}"
        context = list(body["token_ids"])
        params: dict[str, Any] = body["sampling_params"]
        wanted = min(params.get("max_tokens", self.tokens), self.tokens)
        seed = params.get("seed")
        generated: list[int] = []
        versions: list[str] = []
        scope = trio.CancelScope()
        self.generating[rewritten] = generated
        self._native_scopes[rewritten] = scope
        try:
            with scope:
                await self._held_while_paused()
                self._running_scopes.add(scope)
                self.running += 1
                self._notify()
                try:
                    while len(generated) < wanted:
                        while self.budget is not None and len(generated) >= self.budget:
                            await self._progress.wait()
                        await trio.sleep(self.token_time)
                        await self._held_while_paused()  # keep: frozen between tokens
                        generated.append(token_at(context + generated, len(generated), seed))
                        versions.append(self.weight_version)
                        self._moved()
                finally:
                    self._running_scopes.discard(scope)
                    self.running -= 1
        finally:
            del self.generating[rewritten]
            del self._native_scopes[rewritten]
        finish = "abort" if scope.cancelled_caught else "length"
        return JSONResponse(self._native_reply(body, rewritten, generated, versions, finish))

    def _native_reply(
        self,
        body: dict[str, Any],
        rewritten: str,
        generated: list[int],
        versions: list[str],
        finish: str,
    ) -> dict[str, Any]:
        prompt = body["token_ids"]
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": generated,
            "routed_experts": None,
            "sampling_mask": [[token] for token in generated] if self.sampling_mask else None,
            "weight_versions": spans(versions),
            "logprobs": None,
        }
        text_mode = self.text_mode and body.get("output_mode") == "text"
        if body["sampling_params"].get("logprobs") is not None:
            content = [
                {"token_id": token, "logprob": NATIVE_LOGPROB, "rank": 1, "top_logprobs": []}
                for token in generated
            ]
            if text_mode:
                content = [
                    {"token": chr(token), "logprob": NATIVE_LOGPROB, "bytes": [token]}
                    for token in generated
                ]
            choice["logprobs"] = {"content": content}
        if text_mode:
            choice["text"] = "".join(chr(token) for token in generated)
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(generated),
            "total_tokens": len(prompt) + len(generated),
        }
        return {
            "request_id": rewritten,
            "model": body.get("model"),
            "usage": usage,
            "prompt_token_ids": prompt if body.get("return_token_ids") else None,
            "output_mode": "text" if text_mode else "tokens",
            "choices": [choice],
        }

    async def _abort_requests(self, request: Request) -> Response:
        body = await request.json()
        self.order.append(request.url.path)
        if not self.scale_out:
            return self._disabled()
        ids = list(body["request_ids"])
        self.aborts_received.append(ids)
        self._moved()
        if self.abort_hangs:
            await trio.sleep_forever()
        for request_id in ids:
            scope = self._native_scopes.get(request_id)
            if scope is not None:
                scope.cancel()
        return Response(status_code=200)

    async def _label(self, request: Request) -> Response:
        body = await request.json()
        self.order.append(request.url.path)
        if self.label_status is not None:
            return JSONResponse({"detail": "Not Found"}, status_code=self.label_status)
        self.labels_received.append(body["new_version"])
        self.weight_version = body["new_version"]
        return JSONResponse({"success": True, "new_version": body["new_version"]})

    async def _tokenize(self, request: Request) -> Response:
        body = await request.json()
        self.order.append(request.url.path)
        self.tokenize_received.append(body)
        if self.tokenize_status is not None:
            return JSONResponse({"detail": "Not Found"}, status_code=self.tokenize_status)
        if "messages" in body:
            ids = [len(message["content"]) for message in body["messages"]]
            if body.get("add_generation_prompt", True):
                ids.append(GENERATION_PROMPT)
        else:
            ids = [ord(char) for char in body["prompt"]]
        return JSONResponse({"count": len(ids), "max_model_len": 1024, "tokens": ids})

    async def _detokenize(self, request: Request) -> Response:
        body = await request.json()
        self.order.append(request.url.path)
        return JSONResponse({"prompt": "".join(chr(token) for token in body["tokens"])})

    # ------------------------------------------------------------------ the probe

    def _completion(
        self, request: Request, body: dict[str, Any], reply: Reply, text: str, finish: str
    ) -> Any:
        payload = super()._completion(request, body, reply, text, finish)
        asked = body.get("logprobs")
        top = body.get("top_logprobs")
        wanted = top if isinstance(top, int) else asked
        if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 2:
            return payload
        if self.logprobs_mode == "none":
            return payload
        temperature = body.get("temperature", 1.0)
        scale = 1.0 if self.logprobs_mode == "raw" else 1.0 / temperature
        values = [value * scale for value in TOP_LOGPROBS[:wanted]]
        choice = payload["choices"][0]
        if "message" in choice:  # chat shape
            first = {
                "token": "a",
                "logprob": values[0],
                "top_logprobs": [
                    {"token": chr(97 + i), "logprob": value} for i, value in enumerate(values)
                ],
            }
            choice["logprobs"] = {"content": [first]}
        else:
            choice["logprobs"] = {
                "tokens": ["a"],
                "token_logprobs": [values[0]],
                "top_logprobs": [{chr(97 + i): value for i, value in enumerate(values)}],
            }
        return payload


def spans(versions: list[str]) -> list[dict[str, Any]]:
    """vLLM's ``weight_versions``: contiguous spans of equal labels."""
    result: list[dict[str, Any]] = []
    for index, version in enumerate(versions):
        if result and result[-1]["version"] == version:
            result[-1]["end"] = index + 1
        else:
            result.append({"version": version, "start": index, "end": index + 1})
    return result


@asynccontextmanager
async def serving(*servers: FakeVLLM) -> AsyncIterator[None]:
    """Serve each stub on an ephemeral port of 127.0.0.1 (``base_url`` with ``/v1``).
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
