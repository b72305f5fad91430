"""The gateway: an OpenAI-compatible server whose sessions are token-exact rollouts.

``serve(inference, renderer)`` runs the HTTP server (:mod:`._http`) for an ``async with``
block and yields the :class:`Gateway`; ``gw.session(problem)`` opens a
:class:`GatewaySession` whose ``base_url`` an unmodified agent is pointed at. Routes,
under ``{gw.url}/sessions/<id>/v1``: ``POST /chat/completions``, ``POST /responses``
(OpenAI Responses) and ``POST /messages`` (Anthropic Messages), each read and answered
by its dialect (:mod:`._dialect`; ``stream: true`` too), and ``GET /models``. The same
routes under ``{gw.url}/v1`` serve the session an ``X-Session-ID`` header names, exactly
as its path would (one base URL for a whole run, as verifiers uses); a path and a header
that name different sessions are a 400, and ``/v1/...`` without the header is a 404. The
API key, when one is set, is checked before routing, so a caller without it learns
nothing about session ids; errors are in the dialect's shape (OpenAI's, Anthropic's for
``/messages``).
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import json
import logging
import secrets
from collections.abc import AsyncIterator, Mapping
from typing import Any, Final

import attrs
import trio

from trio_rollouts._concurrency import flatten_exception_groups
from trio_rollouts._messages import ChatMessage, GenerationArgs
from trio_rollouts.episodes import (
    TemplateBreakError,
    check_min_fidelity,
    check_renderer,
    check_vocabulary,
    takes_messages,
)
from trio_rollouts.gateway._anthropic import CountTokensDialect, MessagesDialect
from trio_rollouts.gateway._chat import ChatDialect
from trio_rollouts.gateway._dialect import Dialect, DialectCall, json_response
from trio_rollouts.gateway._http import HTTPRequest, HTTPResponse, StreamingResponse, serve_http
from trio_rollouts.gateway._responses import ResponsesDialect
from trio_rollouts.gateway._session import GatewayError, SessionState
from trio_rollouts.inference import InferenceError, InferenceInterface
from trio_rollouts.models._problems import Problem
from trio_rollouts.models._rollouts import TokenRollout
from trio_rollouts.renderers import Renderer

__all__ = ["Gateway", "GatewaySession", "serve"]

logger = logging.getLogger("trio_rollouts.gateway")

#: Closed session ids remembered (a call to one gets 409; beyond, 404).
CLOSED_REMEMBERED: Final = 65_536
#: Seconds leaving a session waits, shielded, for its cancelled calls to end.
LEAVE_GRACE: Final = 5.0
#: The key the clients of a gateway without one are given (the SDKs want a key).
NO_KEY: Final = "trio-rollouts"
#: Replies whose conversation a session remembers for a call that continues one by id.
REPLIES_REMEMBERED: Final = 256
#: The header that names a call's session on the shared base URL ``{gw.url}/v1``.
SESSION_HEADER: Final = "X-Session-ID"
_ON_BREAK = ("split", "raise")


_CHAT: Final = ChatDialect()
#: The dialects served, by their route under ``/v1/``.
_DIALECTS: Final[dict[str, Dialect]] = {
    dialect.route: dialect
    for dialect in (_CHAT, ResponsesDialect(), MessagesDialect(), CountTokensDialect())
}


@attrs.define(eq=False)
class _Call:
    """A call in flight in a session: its cancel scope, and whether leaving cut it off."""

    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)


class GatewaySession:
    """One agent run behind the gateway: point the agent's OpenAI client at
    :attr:`base_url` with :attr:`api_key`, and after leaving ``gw.session(...)`` take
    :meth:`rollout`.

    - ``id``: unguessable (``secrets.token_urlsafe``) unless the caller named it;
    - ``base_url``: ``{gw.url}/sessions/{id}/v1``, what ``OPENAI_BASE_URL`` gets (or
      ``{gw.url}/v1`` with an ``X-Session-ID: {id}`` header, for a client that shares
      one base URL among sessions);
    - ``anthropic_base_url``: ``{gw.url}/sessions/{id}``, what Anthropic's SDKs take
      (they add ``/v1/messages``; ``ANTHROPIC_BASE_URL`` for a command);
    - ``api_key``: the gateway's key, or ``"trio-rollouts"`` when it has none (sent as
      ``Authorization: Bearer`` or Anthropic's ``X-Api-Key``);
    - ``problem``: the problem given to ``gw.session``;
    - ``messages``: the conversation of the session's current element, the replies it
      gave included (what a ``reward_fn`` reads);
    - ``calls``: the calls committed; ``breaks``: the breaks counted.
    """

    def __init__(
        self, gateway: Gateway, session_id: str, problem: Problem | None, seed: int | None = None
    ) -> None:
        self.id = session_id
        self.problem = problem
        self.anthropic_base_url = f"{gateway.url}/sessions/{session_id}"
        self.base_url = f"{self.anthropic_base_url}/v1"
        self.api_key = gateway.api_key or NO_KEY
        self._gateway = gateway
        self._state = SessionState.open(
            gateway.inference,
            gateway.renderer,
            gateway.generation_args,
            gateway.on_break,
            gateway.model,
            takes=gateway._takes_messages,
            seed=seed,
        )
        # Calls run one at a time, in arrival order (trio.Lock is fair).
        self._lock = trio.Lock()
        self._calls: set[_Call] = set()
        self._replies: collections.OrderedDict[str, list[ChatMessage]] = collections.OrderedDict()
        self._closed = False
        self._left = False
        self._idle = trio.Event()
        self._idle.set()

    def __repr__(self) -> str:
        return f"<GatewaySession {self.id!r} calls={self.calls} closed={self._closed}>"

    @property
    def messages(self) -> list[ChatMessage]:
        return self._state.messages

    @property
    def calls(self) -> int:
        return self._state.calls

    @property
    def breaks(self) -> int:
        return self._state.breaks

    def rollout(self, reward: float, *, env_id: str = "") -> TokenRollout:
        """The session's :class:`~trio_rollouts.TokenRollout`: one trajectory element per
        stretch of calls that extended one another (a break starts the next), the sampled
        ids verbatim with their logprobs, epochs and sampling record, ``fidelity`` as for
        episodes, ``extra["gateway"]`` (``session``, ``calls``, ``breaks``,
        ``tool_calls``, ``parse_errors``, ``truncated_turns``, ``per_turn``).

        A ``RuntimeError`` before the session is left (calls may still come) or when it
        committed no call; ``reward`` must be a finite number."""
        if not self._left:
            msg = (
                f"session {self.id!r} is still open: leave `async with gw.session(...)` "
                "before taking its rollout (calls may still come)"
            )
            raise RuntimeError(msg)
        return self._state.rollout(reward, env_id, self.problem, self.id)

    # ------------------------------------------------------------------- calls

    async def call(self, call: DialectCall) -> dict[str, Any]:
        """One model call of the session, whatever dialect it came in: its
        ``chat.completion`` reply (which the dialect writes in its own shape).

        Raises :class:`GatewayError` (400 for a bad call or an unknown ``previous``, 409
        when the session is closed or is left while the call waits or runs, 500 when the
        model call fails).

        Cancellation: cancelled when the session is left (then a 409); otherwise not
        cancelled by the client going away: a call the backend answered is committed."""
        if self._closed:
            raise self._closed_error()
        entry = _Call()
        self._calls.add(entry)
        self._idle = trio.Event() if len(self._calls) == 1 else self._idle
        try:
            with entry.scope:
                async with self._lock:
                    messages = self._conversation(call)
                    state = self._state
                    try:
                        state.prepare(messages, call.tools)
                    except GatewayError:
                        raise
                    except Exception as exc:  # a renderer's or a break's error
                        raise GatewayError(400, f"{type(exc).__name__}: {exc}") from exc
                    try:
                        response, sampled, _, start = await state.generate(messages, call.args)
                    except (InferenceError, TemplateBreakError, ValueError) as exc:
                        msg = f"the model call failed: {type(exc).__name__}: {exc}"
                        raise GatewayError(500, msg, "server_error") from exc
                    reply = state.reply(response, sampled, start, call.model)
                    self._remember(reply["id"])
                    return reply
            raise self._closed_error(during=True)
        finally:
            self._calls.discard(entry)
            if not self._calls:
                self._idle.set()

    async def chat(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """One ``/chat/completions`` call from its body: :meth:`call` of what the chat
        dialect reads (same errors, same cancellation)."""
        gateway = self._gateway
        return await self.call(_CHAT.read(body, gateway.generation_args, gateway.model))

    def count_tokens(self, call: DialectCall) -> int:
        """How many ids the renderer makes of the conversation ``call`` asks the model to
        answer (its tools and the generation prompt included), as a full render: what
        ``/messages/count_tokens`` answers. Nothing is generated or committed; a
        conversation the renderer refuses is a 400. Not a checkpoint."""
        if self._closed:
            raise self._closed_error()
        messages = self._conversation(call)
        try:
            return len(self._gateway.renderer.render(messages, tools=call.tools))
        except Exception as exc:  # the renderer's refusal
            raise GatewayError(400, f"{type(exc).__name__}: {exc}") from exc

    def _conversation(self, call: DialectCall) -> list[ChatMessage]:
        """The whole conversation ``call`` asks the model to answer: the recalled one
        before its messages (with ``previous``), its system prompt first."""
        messages = list(call.messages)
        if call.previous is not None:
            recalled = self._replies.get(call.previous)
            if recalled is None:
                msg = (
                    f"previous response {call.previous!r} is not one this session gave "
                    f"(it remembers its last {REPLIES_REMEMBERED})"
                )
                raise GatewayError(400, msg)
            if call.system is not None and recalled and recalled[0].role == "system":
                recalled = recalled[1:]
            messages = recalled + messages
        if call.system is not None:
            messages.insert(0, ChatMessage(role="system", content=call.system))
        return messages

    def _remember(self, reply_id: str) -> None:
        """Keep the conversation the reply ``reply_id`` ended, for a call that continues
        it by id (the last :data:`REPLIES_REMEMBERED`)."""
        self._replies[reply_id] = self._state.messages
        if len(self._replies) > REPLIES_REMEMBERED:
            self._replies.popitem(last=False)

    def _closed_error(self, *, during: bool = False) -> GatewayError:
        if during:
            msg = f"session {self.id!r} was closed while this call waited or ran"
        else:
            msg = f"session {self.id!r} is closed"
        return GatewayError(409, msg, "conflict")

    async def _leave(self) -> None:
        """Refuse new calls, cancel those in flight and wait for them (shielded, at most
        :data:`LEAVE_GRACE` seconds)."""
        self._closed = True
        for call in list(self._calls):
            call.scope.cancel()
        with trio.move_on_after(LEAVE_GRACE, shield=True):
            await self._idle.wait()
        self._left = True


@attrs.define(eq=False, kw_only=True)
class Gateway:
    """A running gateway (from :func:`serve`): ``url`` is its root
    (``http://127.0.0.1:PORT``); :meth:`session` opens a session. A client may also
    call ``{url}/v1/...`` with an ``X-Session-ID`` header naming a session."""

    url: str
    inference: InferenceInterface
    renderer: Renderer
    generation_args: GenerationArgs
    api_key: str | None
    on_break: str
    model: str
    # What every session needs and costs to work out (inspect.signature): once.
    _takes_messages: bool = attrs.field(
        init=False,
        repr=False,
        default=attrs.Factory(lambda self: takes_messages(self.renderer), takes_self=True),
    )
    _live: dict[str, GatewaySession] = attrs.field(factory=dict, repr=False)
    _closed: collections.OrderedDict[str, None] = attrs.field(
        factory=collections.OrderedDict, repr=False
    )

    @contextlib.asynccontextmanager
    async def session(
        self,
        problem: Problem | None = None,
        *,
        session_id: str | None = None,
        seed: int | None = None,
    ) -> AsyncIterator[GatewaySession]:
        """A session for the block: its calls are the agent's, and leaving cancels those
        still in flight (waiting for them, shielded, at most 5 s). ``session_id`` names
        it (a ``ValueError`` if that id is in use or was used); by default it is
        unguessable. ``seed``: the session's seed; call ``k`` of the session is then sent
        a seed of its own derived from it (stable across processes), which wins over a
        seed in the request body (``GatewayAgent`` derives it from
        ``GroupedRolloutRequest.seed``, as episodes do).

        Cancellation: entering is not a checkpoint; leaving waits as said, even when
        cancelled."""
        if session_id is None:
            session_id = secrets.token_urlsafe(16)
        elif not isinstance(session_id, str) or not session_id or "/" in session_id:
            msg = f"session_id must be a non-empty string without '/', got {session_id!r:.40}"
            raise ValueError(msg)
        if session_id in self._live or session_id in self._closed:
            msg = f"session_id {session_id!r} is already used in this gateway"
            raise ValueError(msg)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            msg = f"seed must be an int or None, got {seed!r:.40}"
            raise TypeError(msg)
        session = GatewaySession(self, session_id, problem, seed)
        self._live[session_id] = session
        try:
            yield session
        finally:
            try:
                await session._leave()
            finally:
                del self._live[session_id]
                self._closed[session_id] = None
                if len(self._closed) > CLOSED_REMEMBERED:
                    self._closed.popitem(last=False)

    # ------------------------------------------------------------------- HTTP

    async def handle(self, request: HTTPRequest) -> HTTPResponse | StreamingResponse:
        """Route one HTTP request (the key first, then the path) to its dialect."""
        dialect = _dialect_of(request.path)
        try:
            self._check_key(request)
            session, routed = self._route(request)
            if routed is None:
                return json_response(200, self._models())
            dialect = routed
            call = dialect.read(_body(request), self.generation_args, self.model)
            if isinstance(dialect, CountTokensDialect):
                return dialect.answer_count(session.count_tokens(call))
            reply = await session.call(call)
        except GatewayError as error:
            return dialect.error(error)
        return dialect.answer(reply, call)

    def _check_key(self, request: HTTPRequest) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer":
            # Anthropic's clients send the key as X-Api-Key.
            token = request.headers.get("x-api-key", "")
        if not token or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            msg = "missing or wrong API key (Authorization: Bearer ..., or X-Api-Key)"
            raise GatewayError(401, msg, "authentication_error")

    def _route(self, request: HTTPRequest) -> tuple[GatewaySession, Dialect | None]:
        """The session and dialect a request is for (``None``: ``GET /models``): the
        session from the path (``/sessions/<id>/v1/...``) or from the ``X-Session-ID``
        header (``/v1/...``)."""
        path_id, rest = _split_path(request.path)
        header_id = request.headers.get(SESSION_HEADER.lower())
        if header_id is not None:
            if not header_id:
                msg = f"the {SESSION_HEADER} header is empty: give it a session id, or leave it out"
                raise GatewayError(400, msg)
            if path_id is not None and path_id != header_id:
                msg = (
                    f"the path names session {path_id!r} but the {SESSION_HEADER} header "
                    f"names session {header_id!r}: send one of them, or the same id in both"
                )
                raise GatewayError(400, msg)
        session_id = path_id if path_id is not None else header_id
        if rest is None or session_id is None:
            msg = (
                f"no route {request.path!r}: use /sessions/<id>/v1/..., "
                f"or /v1/... with an {SESSION_HEADER} header"
            )
            raise GatewayError(404, msg)
        route = _DIALECTS.get(rest)
        if route is None and rest != "models":
            raise GatewayError(404, f"no route {request.path!r}")
        method = "GET" if route is None else "POST"
        session = self._live.get(session_id)
        if session is None:
            if session_id in self._closed:
                raise GatewayError(409, f"session {session_id!r} is closed", "conflict")
            raise GatewayError(404, f"no session {session_id!r}", "not_found_error")
        if request.method != method:
            raise GatewayError(405, f"{request.method} {request.path}: use {method}")
        return session, route

    def _models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": self.model, "object": "model", "created": 0, "owned_by": "trio-rollouts"}
            ],
        }


def _split_path(path: str) -> tuple[str | None, str | None]:
    """``(session id, route)`` of a request path: ``/sessions/<id>/v1/<route>`` gives
    both, ``/v1/<route>`` only the route (the session comes from the header), anything
    else neither."""
    parts = path.split("/")
    # "", "sessions", <id>, "v1", route...
    if len(parts) >= 5 and not parts[0] and parts[1] == "sessions" and parts[3] == "v1":
        return parts[2], "/".join(parts[4:])
    # "", "v1", route...
    if len(parts) >= 3 and not parts[0] and parts[1] == "v1":
        return None, "/".join(parts[2:])
    return None, None


def _dialect_of(path: str) -> Dialect:
    """The dialect a path is for, by its last part (chat's for anything else): what its
    errors are written in, even before the path is routed."""
    for route, dialect in _DIALECTS.items():
        if path.endswith("/" + route):
            return dialect
    return _CHAT


def _body(request: HTTPRequest) -> dict[str, Any]:
    try:
        body = json.loads(request.body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise GatewayError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise GatewayError(400, f"the body must be a JSON object, got {type(body).__name__}")
    return body


@contextlib.asynccontextmanager
async def serve(
    inference: InferenceInterface,
    renderer: Renderer,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    generation_args: GenerationArgs | None = None,
    min_fidelity: str = "retokenized",
    on_break: str = "split",
    model: str = "trio-rollouts",
) -> AsyncIterator[Gateway]:
    """Serve the gateway for the block and yield it (see the module docstring).

    - ``inference``: the backend the sessions generate with (token-in where it
      :func:`~trio_rollouts.inference.accepts_tokens`); ``renderer``: the model's chat
      template in ids (:class:`~trio_rollouts.HFRenderer`, say).
    - ``host``/``port``: where to listen (loopback and a free port by default);
      ``api_key``: when set, every call must carry ``Authorization: Bearer <key>``.
    - ``generation_args``: the trainer's sampling; a request body fills only the fields
      it leaves unset (``temperature``, ``top_p``, ``max_tokens``, ...).
    - ``min_fidelity``: a backend whose turns would be less faithful is refused here,
      with :class:`~trio_rollouts.TokenFidelityError`, before any session; so is one
      whose token ids are not the renderer's (``TypeError``: ``HFRenderer`` over the
      embedded backend's code points), as :class:`~trio_rollouts.MultiTurnAgent` does.
    - ``on_break``: ``"split"`` (a new element, counted) or ``"raise"`` (the call gets a
      400 naming the break).
    - ``model``: the name ``/models`` lists (replies echo the request's ``model``).

    Cancellation: leaving the block (or cancelling it) stops the server and every call
    in flight; sessions still open are left first.
    """
    check_min_fidelity(None, None, min_fidelity)
    if on_break not in _ON_BREAK:
        msg = f"on_break must be one of {_ON_BREAK}, got {on_break!r:.40}"
        raise ValueError(msg)
    check_renderer(None, None, renderer)
    if not isinstance(inference, InferenceInterface):
        msg = f"inference must be an InferenceInterface, got {type(inference).__name__}"
        raise TypeError(msg)
    check_vocabulary(renderer, inference, "serve()")
    if generation_args is None:
        generation_args = GenerationArgs()
    SessionState.open(inference, renderer, generation_args, on_break, model).check_fidelity(
        min_fidelity
    )
    gateway = Gateway(
        url="",  # known once the server listens, before any call can arrive
        inference=inference,
        renderer=renderer,
        generation_args=generation_args,
        api_key=api_key,
        on_break=on_break,
        model=model,
    )
    # What the body raises leaves as itself, not inside the server nursery's group.
    body_errors: list[BaseException] = []
    with flatten_exception_groups(body_errors):
        async with trio.open_nursery() as nursery:
            bound_host, bound_port = await nursery.start(serve_http, gateway.handle, host, port)
            shown = f"[{bound_host}]" if ":" in bound_host else bound_host
            gateway.url = f"http://{shown}:{bound_port}"
            try:
                yield gateway
            except BaseException as exc:
                body_errors.append(exc)
                raise
            finally:
                nursery.cancel_scope.cancel()
