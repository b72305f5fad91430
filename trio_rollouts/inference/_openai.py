"""The HTTP backend: any OpenAI-compatible server (vLLM, SGLang, Megatron, OpenAI,
``transformers serve``, llama.cpp, Ollama) over httpx2.

:class:`OpenAIInference` is configuration only; everything mutable (the httpx2
``AsyncClient``, in-flight counts, the round-robin cursor) lives in a per-Trio-run state
held in a :class:`trio.lowlevel.RunVar`. The client is made lazily by the first request
of a run and closed when that run ends, by a system task that Trio cancels after the
main task returns; so a pipeline never manages it, a sync :meth:`generate` (its own
``trio.run``) leaves nothing behind, and no client outlives the loop it is bound to.
``async with interface:`` / :meth:`OpenAIInference.aclose` close it earlier. Each request
goes to the least-loaded replica and is retried, through stamina, on
:data:`TRANSIENT_ERRORS` only. httpx2 (not httpx 0.x with httpcore 1.x, which loses
pool slots when Trio cancels a queued request) keeps cancellation from leaking
connections: a cancelled request releases its slot before ``Cancelled`` propagates.
What each replica accepts of the extension fields (token ids, log-probabilities) is
negotiated per replica and remembered on the interface itself, across runs
(:mod:`._negotiation`).
"""

from __future__ import annotations

import email.utils
import functools
import html
import json
import logging
import math
import os
import re
import ssl
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import attrs
import httpx2
import stamina
import trio

from .._checks import int_at_least as _int_at_least
from .._messages import ChatMessage
from ._control import (
    ABORT,
    SERVER_KINDS,
    PauseState,
    ServerKind,
    continuation_body,
    control_root,
    merge_continuation,
    missing_endpoint_hint,
    pause_call,
    resume_calls,
)
from ._errors import (
    TRANSIENT_ERRORS,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InferenceConnectionError,
    InferenceError,
    InferenceTimeoutError,
    MalformedResponseError,
    NotSupportedError,
    RateLimitError,
    ServerError,
    UnsupportedFieldError,
)
from ._interface import (
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    ReturnsLogProbs,
    ReturnsRaw,
    render_plain_chat,
)
from ._lean_http import (
    ConnectionPool,
    HTTPTimeouts,
    LeanHTTPError,
    LeanTimeout,
    NetworkError,
    RemoteProtocolError,
)
from ._negotiation import NEGOTIABLE_FIELDS, Capabilities, named_fields, says_unknown
from ._pausable import Pausable, WeightUpdateError, WeightUpdateMode

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_TIMEOUT",
    "OpenAIInference",
    "OpenAIStatistics",
    "RetryBackoff",
]

logger = logging.getLogger(__name__)

#: Per attempt: 5 s to connect, 600 s to read or write (a long generation is normal),
#: and no pool timeout: a request waits for a free connection as long as its caller's
#: cancel scope allows, because the pipeline, not the pool, bounds concurrency.
DEFAULT_TIMEOUT = httpx2.Timeout(600.0, connect=5.0, pool=None)

#: Connections to all replicas together. Keep it below ``ulimit -n``.
DEFAULT_MAX_CONNECTIONS = 256

#: Retries after the first attempt, on :data:`TRANSIENT_ERRORS` only.
DEFAULT_MAX_RETRIES = 3

#: Idle keep-alive connections are closed after this many seconds.
_KEEPALIVE_EXPIRY = 5.0

#: How long closing the client at the end of a run may take before it is abandoned.
_CLOSE_GRACE = 5.0

#: The request body's JSON, compact (one encoder: ``json.dumps`` with options makes one
#: per call).
_encode_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

#: Server messages are cut to this many characters in errors.
_MAX_SERVER_MESSAGE = 500

_ENDPOINT_PATHS = {"chat": "/chat/completions", "completions": "/completions"}

#: What a weight update may ask of an interface without, and with, a server's control
#: endpoints; and the modes that need them.
_CLIENT_MODES: frozenset[WeightUpdateMode] = frozenset({"drain", "restart"})
_SERVER_MODES: frozenset[WeightUpdateMode] = frozenset({"drain", "restart", "keep", "abort"})
_SERVER_ONLY_MODES = _SERVER_MODES - _CLIENT_MODES

#: How long resume() may take, all replicas together, before it gives up (shielded).
_RESUME_TIMEOUT = 60.0

#: The control paths that end a server-side pause.
_RESUME_PATHS = frozenset({"/resume", "/continue_generation"})

#: Keys of a returned chat message kept in ``ChatMessage.extra`` (others, such as the
#: token-id copies Megatron's server puts in the message, are dropped).
_MESSAGE_EXTRA_KEYS = ("tool_calls", "function_call", "refusal", "reasoning", "reasoning_content")


# --------------------------------------------------------------------------- configuration


def _check_non_negative(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        msg = f"{attribute.name} must be a number of seconds >= 0, got {value!r}"
        raise TypeError(msg)
    if not math.isfinite(value) or value < 0:
        msg = f"{attribute.name} must be a finite number of seconds >= 0, got {value!r}"
        raise ValueError(msg)


@attrs.frozen(kw_only=True)
class RetryBackoff:
    """How long to wait between attempts.

    Before retry ``n`` (1-based) the wait is ``min(maximum, initial * 2 ** (n - 1) +
    uniform(0, jitter))`` seconds (stamina's exponential backoff with jitter). When the
    failed response carries ``Retry-After`` (or ``retry-after-ms``), that wait is used
    instead, capped at ``max_retry_after``.
    """

    initial: float = attrs.field(default=0.5, validator=_check_non_negative)
    maximum: float = attrs.field(default=8.0, validator=_check_non_negative)
    jitter: float = attrs.field(default=1.0, validator=_check_non_negative)
    max_retry_after: float = attrs.field(default=60.0, validator=_check_non_negative)


@attrs.frozen(kw_only=True)
class OpenAIStatistics:
    """Counters of one :class:`OpenAIInference` in the current Trio run, per replica
    (in ``base_urls`` order, shown without credentials): requests on the wire now
    (``in_flight``), requests sent (``attempts``, counting a request sent again without
    a refused field), and retries made across all replicas (``retries``). Also what
    negotiation learned, per replica, over the interface's life (not only this run):
    the request fields that replica refused and that are no longer sent to it
    (``dropped_fields``, sorted). And the calls of this run waiting for a weight
    update's :meth:`~OpenAIInference.resume` (``held``)."""

    base_urls: tuple[str, ...]
    in_flight: tuple[int, ...]
    attempts: tuple[int, ...]
    retries: int
    dropped_fields: tuple[tuple[str, ...], ...] = ()
    held: int = 0


def _to_base_urls(value: str | Sequence[str]) -> tuple[str, ...]:
    urls = [value] if isinstance(value, str) else value
    if not isinstance(urls, (list, tuple)) or not urls:
        msg = f"base_url must be a URL string or a non-empty list of them, got {value!r}"
        raise TypeError(msg)
    result: list[str] = []
    for url in urls:
        if not isinstance(url, str):
            msg = f"base_url entries must be strings, got {type(url).__name__} {url!r}"
            raise TypeError(msg)
        try:
            parsed = httpx2.URL(url)
        except httpx2.InvalidURL as exc:
            msg = f"base_url {_display_url(url)!r} is not a valid URL: {exc}"
            raise ValueError(msg) from exc
        if parsed.scheme not in ("http", "https") or not parsed.host:
            msg = (
                f"base_url must be an http(s) URL including the API prefix, such as "
                f"'http://127.0.0.1:8000/v1', got {_display_url(url)!r}"
            )
            raise ValueError(msg)
        normalized = url.rstrip("/")
        if normalized in result:
            msg = f"base_url lists {_display_url(url)!r} twice; give each replica once"
            raise ValueError(msg)
        result.append(normalized)
    return tuple(result)


def _display_url(url: str) -> str:
    """The URL without user credentials, for messages."""
    try:
        return str(httpx2.URL(url).copy_with(username=None, password=None))
    except (httpx2.InvalidURL, TypeError, ValueError):
        return "<unparsable URL>"


def _repr_urls(urls: tuple[str, ...]) -> str:
    return repr(tuple(_display_url(url) for url in urls))


@functools.cache
def _default_ssl_context() -> ssl.SSLContext:
    # Loading the CA bundle takes tens of milliseconds; a client is made per Trio run
    # (per sync generate() call), and SSLContext objects can be shared.
    return httpx2.create_ssl_context()


def _api_key_from_environment() -> str | None:
    return os.environ.get("OPENAI_API_KEY") or None


def _mask_api_key(value: str | None) -> str:
    return "None" if value is None else "'***'"


def _check_api_key(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, str):
        msg = f"api_key must be a str or None, got {type(value).__name__}"
        raise TypeError(msg)


def _check_model(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        msg = f"model must be a str (the served model's name), got {value!r}"
        raise TypeError(msg)
    if not value:
        msg = "model must not be empty: give the served model's name"
        raise ValueError(msg)


def _to_timeout(value: httpx2.Timeout | float | None) -> httpx2.Timeout:
    if isinstance(value, httpx2.Timeout):
        return value
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return httpx2.Timeout(value)
    msg = f"timeout must be an httpx2.Timeout, a number of seconds or None, got {value!r}"
    raise TypeError(msg)


def _check_extra_body(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        msg = f"extra_body must be a dict with str keys, got {value!r:.80}"
        raise TypeError(msg)


def _check_ask(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, bool):
        msg = (
            f"{attribute.name} must be None (ask, and stop asking a replica that refuses), "
            f"True (ask, and fail if refused) or False (never ask), got {value!r:.80}"
        )
        raise TypeError(msg)


class _Headers(Protocol):
    def get(self, key: str, /) -> str | None: ...


class _Response(Protocol):
    """What this module reads of a response, from httpx2 or from the lean pool."""

    @property
    def status_code(self) -> int: ...
    @property
    def reason_phrase(self) -> str: ...
    @property
    def headers(self) -> _Headers: ...
    @property
    def text(self) -> str: ...
    def json(self) -> Any: ...


def _proxied(urls: Sequence[str]) -> bool:
    """Whether the environment routes any of ``urls`` through a proxy (``HTTP_PROXY``,
    ``HTTPS_PROXY``, ``ALL_PROXY``, less ``NO_PROXY``), as httpx2 would honour."""
    proxies = urllib.request.getproxies()
    if not proxies:
        return False
    for url in urls:
        parsed = httpx2.URL(url)
        if (parsed.scheme in proxies or "all" in proxies) and not urllib.request.proxy_bypass(
            parsed.host
        ):
            return True
    return False


# --------------------------------------------------------------------------- per-run state


@attrs.define(eq=False)
class _RunState:
    """What one Trio run holds for one interface."""

    client: httpx2.AsyncClient | ConnectionPool
    in_flight: list[int]
    attempts: list[int]
    pause: PauseState
    retries: int = 0
    next_replica: int = 0
    keeper_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    closed: trio.Event = attrs.field(factory=trio.Event)


async def _close_at_run_exit(state: _RunState) -> None:
    """System task: keeps the client open until aclose() or the end of the Trio run."""
    try:
        with state.keeper_scope:
            await trio.sleep_forever()
    finally:
        # Trio cancels system tasks once the main task has returned; the shield lets the
        # sockets close anyway, and the grace bound keeps a stuck close from hanging exit.
        with trio.move_on_after(_CLOSE_GRACE, shield=True):
            try:
                await state.client.aclose()
            except Exception:
                # An exception escaping a system task would crash the whole run.
                logger.warning("closing the inference HTTP client failed", exc_info=True)
        state.closed.set()


@attrs.define(eq=False)
class _EpochBox:
    value: int = 0


# --------------------------------------------------------------------------- the backend


@attrs.frozen(kw_only=True, eq=False)
class OpenAIInference(InferenceInterface, ReturnsRaw, ReturnsLogProbs, Pausable):
    """An OpenAI-compatible HTTP server (vLLM, SGLang, Megatron, OpenAI, ``transformers
    serve``, llama.cpp's server, Ollama) as an inference interface. Frozen: it is
    configuration; what changes lives with each Trio run, except what negotiation learns
    about the replicas (below), which the interface keeps for its whole life.

    - ``base_url``: the API root including ``/v1`` (as in the OpenAI SDK), or a list of
      them: replicas serving the same model. Each attempt goes to the replica with the
      fewest attempts in flight, ties broken round-robin.
    - ``model``: the served model's name. ``api_key``: sent as ``Authorization: Bearer``;
      ``None`` reads ``OPENAI_API_KEY`` (no header when neither is set). It never
      appears in a repr, a log line or an error.
    - ``endpoint``: ``"chat"`` (``/chat/completions``) or ``"completions"``
      (``/completions``, with the prompt rendered by ``render_prompt``; no tools).
    - ``max_connections``: connections to all replicas together (:data:`DEFAULT_MAX_CONNECTIONS`);
      requests beyond it queue. ``timeout``: an ``httpx2.Timeout`` or seconds, per attempt
      (:data:`DEFAULT_TIMEOUT`). Bound a whole request, retries included, with a Trio
      cancel scope around the call.
    - ``max_retries``: retries after the first attempt on :data:`TRANSIENT_ERRORS` only
      (:data:`DEFAULT_MAX_RETRIES`), waiting as ``backoff`` says.
    - ``return_token_ids`` / ``return_logprobs``: whether to ask for token ids (vLLM's
      ``return_token_ids`` field) and log-probabilities (the ``logprobs`` field).

      - ``None`` (the default): negotiate. The field is sent; when a replica refuses a
        request with a 400 or 422 whose error names the field (``transformers serve``:
        ``Unexpected fields in the request: {'return_token_ids'}``; api.openai.com:
        ``Unrecognized request argument supplied: return_token_ids``), the field is
        dropped for that replica, the same request is sent again at once without it
        (not a retry: it neither uses ``max_retries`` nor counts in
        ``statistics().retries``), and a warning naming the replica and the field is
        logged once. The interface remembers it, across Trio runs (each sync
        :meth:`generate` is one), so later requests to that replica never carry the
        field and cost nothing extra. Servers that ignore unknown fields simply return
        no token ids or logprobs: the response's fields stay ``None``.
      - ``True``: strict. A refusal raises :class:`UnsupportedFieldError` (a
        :class:`BadRequestError`) naming the server and the field.
      - ``False``: never sent.
    - ``extra_body``: more top-level JSON fields for every request (e.g.
      ``{"min_p": 0.05}``); they override the two options above but never the model, the
      prompt, the tools or a set generation argument. They are explicit, never
      negotiated: a refusal naming one raises :class:`UnsupportedFieldError`, as does
      one naming a set generation argument.

    - ``server``: ``"vllm"`` or ``"sglang"`` to pause through that server's control
      endpoints for a weight update (all four modes), or ``None`` (the default): pauses
      hold calls client-side only (``drain`` and ``restart``). See :meth:`pause` and
      ``docs/backends.md``, "Pausing for weight updates".

    Every set field of the request's ``GenerationArgs`` is forwarded as is
    (``temperature``, ``top_p``, ``max_tokens``, and ``top_k`` as a top-level key, which
    vLLM and SGLang accept); unset ones are left out, so the server's defaults apply.

    The response fills ``raw_text`` (the server's ``raw_text`` when it sends one, as
    Megatron's does; else the prompt sent to ``/completions``, or
    ``render_plain_chat(prompt)``, followed by the completion), ``token_ids`` and
    ``prompt_length`` when the server returns prompt and generated ids, ``logprobs``
    (with or without token ids), ``finish_reason``, ``usage``, and Megatron's
    ``policy_epoch``, ``kv_cache_epoch`` and ``num_evictions`` when present (without
    Megatron's stamps, ``policy_epoch`` is ``[(0, e)]``, ``e`` the :attr:`policy_epoch`
    the call started under). See ``docs/backends.md``.
    """

    base_url: tuple[str, ...] = attrs.field(converter=_to_base_urls, repr=_repr_urls, kw_only=False)
    model: str = attrs.field(validator=_check_model, kw_only=False)
    api_key: str | None = attrs.field(
        factory=_api_key_from_environment, validator=_check_api_key, repr=_mask_api_key
    )
    endpoint: Literal["chat", "completions"] = attrs.field(
        default="chat", validator=attrs.validators.in_(("chat", "completions"))
    )
    max_connections: int = attrs.field(default=DEFAULT_MAX_CONNECTIONS, validator=_int_at_least(1))
    timeout: httpx2.Timeout = attrs.field(default=DEFAULT_TIMEOUT, converter=_to_timeout)
    max_retries: int = attrs.field(default=DEFAULT_MAX_RETRIES, validator=_int_at_least(0))
    backoff: RetryBackoff = attrs.field(
        factory=RetryBackoff, validator=attrs.validators.instance_of(RetryBackoff)
    )
    return_token_ids: bool | None = attrs.field(default=None, validator=_check_ask)
    return_logprobs: bool | None = attrs.field(default=None, validator=_check_ask)
    extra_body: dict[str, Any] = attrs.field(factory=dict, validator=_check_extra_body)
    render_prompt: Callable[[list[ChatMessage]], str] = attrs.field(
        default=render_plain_chat, validator=attrs.validators.is_callable(), repr=False
    )
    transport: Literal["auto", "lean", "httpx2"] = attrs.field(
        default="auto", validator=attrs.validators.in_(("auto", "lean", "httpx2"))
    )
    server: ServerKind | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(SERVER_KINDS))
    )
    # Each replica's root, where the control endpoints are (base_url less "/v1").
    _control_roots: tuple[str, ...] = attrs.field(
        init=False,
        repr=False,
        default=attrs.Factory(
            lambda self: tuple(control_root(url) for url in self.base_url), takes_self=True
        ),
    )
    # The policy epoch: mutable, and kept across runs (resume() in one, generate() in
    # the next); the client-side hold lives with each run.
    # The replicas that may be paused server-side (a pause was sent and no resume has
    # succeeded since): a server's pause outlives the Trio run that made it, so this is
    # kept across runs, and a resume in any later run resumes them.
    _server_paused: set[int] = attrs.field(init=False, repr=False, factory=set)
    _epoch: _EpochBox = attrs.field(init=False, repr=False, factory=lambda: _EpochBox())
    _pause_var: trio.lowlevel.RunVar[PauseState | None] = attrs.field(
        init=False,
        repr=False,
        factory=lambda: trio.lowlevel.RunVar("trio_rollouts.OpenAIInference.pause"),
    )
    # The replicas as shown in errors (no credentials), parsed once, not per attempt.
    _shown_urls: tuple[str, ...] = attrs.field(
        init=False,
        repr=False,
        default=attrs.Factory(
            lambda self: tuple(_display_url(url) for url in self.base_url), takes_self=True
        ),
    )
    _run_state: trio.lowlevel.RunVar[_RunState | None] = attrs.field(
        init=False,
        repr=False,
        factory=lambda: trio.lowlevel.RunVar("trio_rollouts.OpenAIInference"),
    )
    # The lean transport's request headers, built once.
    _lean_headers: tuple[tuple[str, str], ...] = attrs.field(
        init=False,
        repr=False,
        default=attrs.Factory(
            lambda self: (
                ("accept", "application/json"),
                ("content-type", "application/json"),
                *(() if self.api_key is None else (("authorization", f"Bearer {self.api_key}"),)),
            ),
            takes_self=True,
        ),
    )
    # What negotiation learned per replica: mutable, and deliberately not per run.
    _capabilities: Capabilities = attrs.field(
        init=False,
        repr=False,
        default=attrs.Factory(
            lambda self: Capabilities.for_replicas(len(self.base_url)), takes_self=True
        ),
    )

    @property
    def limits(self) -> httpx2.Limits:
        """The ``httpx2.Limits`` the client uses (``max_connections`` in total, as many
        kept alive, idle ones closed after 5 s)."""
        return httpx2.Limits(
            max_connections=self.max_connections,
            max_keepalive_connections=self.max_connections,
            keepalive_expiry=_KEEPALIVE_EXPIRY,
        )

    # ----------------------------------------------------------------------- lifetime

    @property
    def uses_lean_transport(self) -> bool:
        """Whether requests go through the lean HTTP/1.1 pool (``transport="lean"``, or
        ``"auto"`` with no proxy configured for the replicas) rather than httpx2."""
        if self.transport == "auto":
            return not _proxied(self.base_url)
        return self.transport == "lean"

    def _make_client(self) -> httpx2.AsyncClient | ConnectionPool:
        if self.uses_lean_transport:
            return ConnectionPool(
                max_connections=self.max_connections,
                keepalive_expiry=_KEEPALIVE_EXPIRY,
                timeouts=HTTPTimeouts(
                    connect=self.timeout.connect,
                    read=self.timeout.read,
                    write=self.timeout.write,
                    pool=self.timeout.pool,
                ),
                ssl_context=_default_ssl_context(),
            )
        headers = {"Accept": "application/json"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return httpx2.AsyncClient(
            timeout=self.timeout,
            limits=self.limits,
            headers=headers,
            verify=_default_ssl_context(),
        )

    def _state(self) -> _RunState:
        state = self._run_state.get(None)
        if state is None:
            n = len(self.base_url)
            state = _RunState(
                client=self._make_client(),
                in_flight=[0] * n,
                attempts=[0] * n,
                pause=self._pause_state(),
            )
            self._run_state.set(state)
            trio.lowlevel.spawn_system_task(
                _close_at_run_exit, state, name=f"{type(self).__name__} client keeper"
            )
        return state

    async def aclose(self) -> None:
        """Close this run's HTTP client and its connections. Idempotent; a later request
        in the same run opens a new client. Requests still in flight on the old client
        fail with :class:`InferenceConnectionError`.

        You rarely need it: the client of a Trio run is closed when the run ends.

        Cancellation: a checkpoint. If cancelled while waiting, the close still completes
        (it runs shielded, in the task that owns the client).
        """
        state = self._run_state.get(None)
        if state is None:
            await trio.lowlevel.checkpoint()
            return
        self._run_state.set(None)
        state.keeper_scope.cancel()
        await state.closed.wait()

    def statistics(self) -> OpenAIStatistics:
        """Counters for the current Trio run (zeros outside a run and before its first
        request; restarted by :meth:`aclose`), and the fields each replica refused."""
        try:
            state = self._run_state.get(None)
        except RuntimeError:  # outside a Trio run
            state = None
        n = len(self.base_url)
        dropped = tuple(tuple(sorted(fields)) for fields in self._capabilities.dropped)
        if state is None:
            return OpenAIStatistics(
                base_urls=self._shown_urls,
                in_flight=(0,) * n,
                attempts=(0,) * n,
                retries=0,
                dropped_fields=dropped,
            )
        return OpenAIStatistics(
            base_urls=self._shown_urls,
            in_flight=tuple(state.in_flight),
            attempts=tuple(state.attempts),
            retries=state.retries,
            dropped_fields=dropped,
            held=state.pause.held,
        )

    # ----------------------------------------------------------------------- weight updates

    @property
    def supported_modes(self) -> frozenset[WeightUpdateMode]:
        """``drain`` and ``restart`` (held client-side) always; ``keep`` and ``abort``
        through the control endpoints of ``server="vllm"`` or ``"sglang"``."""
        return _SERVER_MODES if self.server is not None else _CLIENT_MODES

    @property
    def policy_epoch(self) -> int:
        """The epoch last given to :meth:`resume` (0 before any), kept across runs."""
        return self._epoch.value

    @property
    def stamps_policy_epoch(self) -> bool:
        """``False``: neither server reports the token at which the weights changed, so
        a call is stamped ``[(0, e)]`` with the epoch it started under (unless the
        server returns its own ``policy_epoch`` stamps, as Megatron's does)."""
        return False

    def _pause_state(self) -> PauseState:
        pause = self._pause_var.get(None)
        if pause is None:
            pause = PauseState()
            self._pause_var.set(pause)
        return pause

    async def pause(self, mode: WeightUpdateMode) -> None:
        """Hold new calls, and for ``keep`` / ``abort`` pause every replica, concurrently,
        through its control endpoint; return once every replica has acknowledged.

        ``drain`` / ``restart``: nothing is sent (the caller pauses once no call is in
        flight, and every call of this interface waits client-side). ``keep``: vLLM
        ``POST /pause?mode=keep``, SGLang ``POST /pause_generation {"mode": "in_place"}``:
        requests in flight stay on the server with their KV cache and go on after
        :meth:`resume`. ``abort``: vLLM ``POST /pause?mode=abort``, SGLang ``{"mode":
        "abort"}``: the server ends requests in flight with their partial output
        (``finish_reason "abort"``), and each call continues from it after
        :meth:`resume`.

        Raises ``TypeError`` for a mode outside :attr:`supported_modes`. If a replica's
        pause fails, every replica it was sent to is resumed under the current epoch,
        held calls are released, and :class:`WeightUpdateError` is raised from the
        failure (a missing endpoint, vLLM's 404 without ``VLLM_SERVER_DEV_MODE=1``, says
        so); failures to resume are added as notes.

        Cancellation: if cancelled, the replicas may be paused; call :meth:`resume`.
        """
        if mode not in self.supported_modes:
            msg = (
                f"{type(self).__name__}(server={self.server!r}) cannot pause for mode "
                f"{mode!r}; it supports {sorted(self.supported_modes)}"
            )
            if self.server is None and mode in _SERVER_MODES:
                msg += " (pass server='vllm' or server='sglang' for keep and abort)"
            raise TypeError(msg)
        state = self._state()
        pause = state.pause
        if pause.hold is None:
            pause.hold = trio.Event()
        pause.mode = mode
        server = self.server
        if mode not in _SERVER_ONLY_MODES or server is None:
            await trio.lowlevel.checkpoint()
            return
        pause.server_pauses += 1
        path, body = pause_call(server, mode)
        failures: dict[int, InferenceError] = {}

        server_paused = self._server_paused

        async def pause_one(index: int) -> None:
            paused_before = index in server_paused
            server_paused.add(index)
            try:
                await self._control(state, index, path, body)
            except InferenceError as exc:
                failures[index] = exc
                if exc.status is not None and 400 <= exc.status < 500 and not paused_before:
                    server_paused.discard(index)  # refused: this pause did not pause it

        async with trio.open_nursery() as nursery:
            for index in range(len(self.base_url)):
                nursery.start_soon(pause_one, index)
        if not failures:
            return
        index = min(failures)
        cause = failures[index]
        msg = (
            f"pausing {self.server} for mode {mode!r} failed at "
            f"{self._shown_urls[index]} ({len(failures)} of {len(self.base_url)} "
            f"replicas failed): {cause}"
        )
        error = WeightUpdateError(msg)
        error.__cause__ = cause
        for other, exc in sorted(failures.items())[1:]:
            error.add_note(f"{self._shown_urls[other]} failed too: {exc}")
        try:
            await self.resume(self._epoch.value)
        except InferenceError as exc:
            error.add_note(f"resuming after the failed pause failed too: {exc}")
            for note in getattr(exc, "__notes__", ()):
                error.add_note(note)
        raise error

    async def resume(self, epoch: int) -> None:
        """Set :attr:`policy_epoch` to ``epoch``, resume every replica that may be
        paused (vLLM ``POST /resume``; SGLang ``POST /continue_generation``), and release
        the held calls. With SGLang, a new epoch is first sent as its weight version
        (``POST /update_weight_version {"new_version": "<epoch>",
        "abort_all_requests": false}``). Idempotent: when nothing is paused it only sets
        the epoch.

        A replica that fails to resume (within 60 s, retrying transient errors) stays
        marked paused, so that the next :meth:`resume` tries it again; the epoch is set
        and held calls are released anyway, and the first failure is raised (the others
        as notes).

        Cancellation: runs shielded, bounded by 60 s.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            msg = f"epoch must be an int, got {epoch!r}"
            raise TypeError(msg)
        state = self._state()
        pause = state.pause
        server = self.server
        paused = pause.hold is not None
        failures: dict[int, InferenceError] = {}
        try:
            if server is not None and (paused or self._server_paused):
                new_version = epoch if paused and epoch != self._epoch.value else None
                with trio.CancelScope(shield=True) as scope:
                    scope.deadline = trio.current_time() + _RESUME_TIMEOUT
                    async with trio.open_nursery() as nursery:
                        for index in range(len(self.base_url)):
                            calls = resume_calls(
                                server,
                                paused=index in self._server_paused,
                                new_version=new_version,
                            )
                            if calls:
                                nursery.start_soon(self._resume_one, state, index, calls, failures)
                if scope.cancelled_caught:
                    for index in self._server_paused - failures.keys():
                        shown = self._shown_urls[index]
                        failures[index] = InferenceTimeoutError(
                            f"resuming {shown} did not finish within {_RESUME_TIMEOUT} s",
                            url=shown,
                        )
        finally:
            self._epoch.value = epoch
            pause.release()
        if failures:
            index = min(failures)
            error = failures[index]
            error.add_note(f"{self.server} replica {self._shown_urls[index]} may still be paused")
            for other, exc in sorted(failures.items())[1:]:
                error.add_note(f"{self._shown_urls[other]} failed to resume too: {exc}")
            raise error

    async def _resume_one(
        self,
        state: _RunState,
        index: int,
        calls: list[tuple[str, dict[str, Any] | None]],
        failures: dict[int, InferenceError],
    ) -> None:
        first: InferenceError | None = None
        for path, body in calls:  # every call is made, even after one fails
            try:
                await self._control(state, index, path, body, retries=self.max_retries)
            except InferenceError as exc:
                first = first or exc
            else:
                if path in _RESUME_PATHS:
                    self._server_paused.discard(index)
        if first is not None:
            failures[index] = first

    async def _control(
        self,
        state: _RunState,
        index: int,
        path: str,
        body: dict[str, Any] | None,
        *,
        retries: int = 0,
    ) -> None:
        """POST a control request to replica ``index``'s root through this run's client
        (not counted in the statistics); transient failures are retried ``retries``
        times, after the backoff's waits."""
        url = self._control_roots[index] + path
        shown = _display_url(self._control_roots[index]) + path
        for attempt in range(retries + 1):
            try:
                response = await self._send(state.client, url, shown, body)
                if 200 <= response.status_code < 300:
                    return
                message, _ = _server_message(response)
                server_message = self._redact(message)[:_MAX_SERVER_MESSAGE] or None
                status = response.status_code
                msg = f"POST {shown} returned {status} {response.reason_phrase}"
                if server_message and server_message != response.reason_phrase:
                    msg += f": {server_message}"
                if status in (404, 405) and self.server is not None:
                    msg += missing_endpoint_hint(self.server, path)
                cls = _status_class(status)
                raise cls(
                    msg,
                    url=shown,
                    status=status,
                    server_message=server_message,
                    retry_after=_retry_after(response.headers),
                )
            except TRANSIENT_ERRORS:
                if attempt == retries:
                    raise
            wait = min(self.backoff.maximum, self.backoff.initial * 2**attempt)
            await trio.sleep(wait)

    async def _send(
        self,
        client: httpx2.AsyncClient | ConnectionPool,
        url: str,
        shown: str,
        body: dict[str, Any] | None,
    ) -> _Response:
        content = b"" if body is None else _encode_json(body).encode()
        try:
            if isinstance(client, ConnectionPool):
                return await client.request(
                    "POST", url, headers=self._lean_headers, content=content
                )
            headers = {"content-type": "application/json"}
            return await client.post(url, content=content, headers=headers)
        except (LeanHTTPError, httpx2.HTTPError) as exc:
            raise self._transport_error(exc, shown) from exc

    # ----------------------------------------------------------------------- requests

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        """Send ``request`` to the least-loaded replica, retrying transient failures.

        Raises an :class:`InferenceError` subclass naming the URL, the status and the
        server's message; after retries, the last attempt's error, with a note counting
        the attempts. ``ValueError`` for tools with ``endpoint="completions"``. A replica
        that refuses a negotiated field gets the request again without it, within the
        same attempt (see the class docstring).

        While a weight update has paused the interface (:meth:`pause`), the call waits
        before sending anything; a call whose request the server aborted for the pause
        (``finish_reason == "abort"``) waits for :meth:`resume` and is continued from its
        partial output, and returns one response. The response's ``policy_epoch`` is the
        server's stamps when it sends them, else ``[(0, e)]`` with ``e`` the
        :attr:`policy_epoch` when the call started (after any wait).

        Cancellation: cancellable at any point, including during a backoff wait and while
        held by a pause. A cancelled request releases its connection slot and its
        in-flight count before ``trio.Cancelled`` propagates; the server may still finish
        the generation.
        """
        body = self._request_body(request)
        path = _ENDPOINT_PATHS[self.endpoint]
        state = self._state()
        pause = state.pause
        if pause.hold is not None:
            await pause.wait_resumed()
            state = self._state()  # aclose() during the pause closed the old client
        epoch = self._epoch.value
        server_pauses = pause.server_pauses
        response = await self._attempt_with_retries(state, request, body, path)
        if response.finish_reason == ABORT and pause.server_pauses != server_pauses:
            response = await self._continue_aborted(state, request, body, path, response)
        if not response.policy_epoch:
            response.policy_epoch = [(0, epoch)]
        return response

    async def _continue_aborted(
        self,
        state: _RunState,
        request: InferenceRequest,
        body: dict[str, Any],
        path: str,
        response: InferenceResponse,
    ) -> InferenceResponse:
        """Continue a response that a pause aborted, after :meth:`resume`, from its
        partial output, until it finishes for another reason (each pause that aborts it
        again adds a segment); one response."""
        pause = state.pause
        server = self.server
        merged = response
        while merged.finish_reason == ABORT:
            await pause.wait_resumed()
            state = self._state()  # aclose() during the pause closed the old client
            if server is None:  # pragma: no cover - only a server-side pause aborts
                break
            server_pauses = pause.server_pauses
            continued = continuation_body(
                server, self.endpoint, body, merged, merged.response.content
            )
            if continued is None:  # max_tokens used up before the abort
                return attrs.evolve(merged, finish_reason="length")
            segment = await self._attempt_with_retries(state, request, continued, path)
            merged = merge_continuation(merged, segment)
            if merged.finish_reason == ABORT and pause.server_pauses == server_pauses:
                break  # aborted by something else than a pause: the caller sees it
        return merged

    async def _attempt_with_retries(
        self, state: _RunState, request: InferenceRequest, body: dict[str, Any], path: str
    ) -> InferenceResponse:
        """One request and its retries. The first attempt runs outside stamina: a request
        that succeeds at once (nearly all of them) costs no retry machinery; only a
        transient failure enters it (see ``_retried``)."""
        try:
            return await self._attempt(state, request, body, path)
        except TRANSIENT_ERRORS as exc:
            if self.max_retries == 0:
                raise
            first = exc
        # Outside the except block, so that a later failure is not chained to the first.
        return await self._retried(first, state, request, body, path)

    async def _retried(
        self,
        first: InferenceError,
        state: _RunState,
        request: InferenceRequest,
        body: dict[str, Any],
        path: str,
    ) -> InferenceResponse:
        """Attempts 2, 3, ... after a first attempt that failed transiently with ``first``,
        replayed as stamina's first attempt: stamina decides everything from there as if it
        had made it (whether to retry at all under ``stamina.set_active`` and
        ``set_testing``, the backoff and its jitter, ``Retry-After``, its hooks)."""
        attempt_number = 0
        try:
            async for attempt in stamina.retry_context(
                on=self._retry_wait,
                attempts=self.max_retries + 1,
                timeout=None,
                wait_initial=self.backoff.initial,
                wait_max=self.backoff.maximum,
                wait_jitter=self.backoff.jitter,
            ):
                with attempt:
                    attempt_number = attempt.num
                    if attempt_number == 1:
                        raise first
                    state.retries += 1
                    return await self._attempt(state, request, body, path)
        except InferenceError as exc:
            if attempt_number > 1:
                exc.add_note(
                    f"gave up after {attempt_number} attempts (max_retries={self.max_retries})"
                )
            raise
        msg = "stamina.retry_context ended without an outcome"  # pragma: no cover
        raise RuntimeError(msg)  # pragma: no cover

    def _retry_wait(self, exc: Exception) -> bool | float:
        """stamina's hook: retry transient errors, after ``Retry-After`` when given."""
        if not isinstance(exc, TRANSIENT_ERRORS):
            return False
        if exc.retry_after is not None:
            return min(exc.retry_after, self.backoff.max_retry_after)
        return True

    def _request_body(self, request: InferenceRequest) -> dict[str, Any]:
        flags: dict[str, Any] = {}
        required: dict[str, Any] = {"model": self.model}
        if self.endpoint == "chat":
            if self.return_logprobs is not False:
                flags["logprobs"] = True
            required["messages"] = [_message_json(message) for message in request.prompt]
            if request.tools:
                required["tools"] = request.tools
        else:
            if request.tools:
                msg = (
                    f"{type(self).__name__} with endpoint='completions' cannot send tools; "
                    "use endpoint='chat'"
                )
                raise ValueError(msg)
            if self.return_logprobs is not False:
                # 1, not 0: some servers treat 0 as "no logprobs".
                flags["logprobs"] = 1
            required["prompt"] = self.render_prompt(request.prompt)
        if self.return_token_ids is not False:
            flags["return_token_ids"] = True
        return {
            **flags,
            **self.extra_body,
            **required,
            **request.generation_args.set_fields(),
        }

    def _pick_replica(self, state: _RunState) -> int:
        n = len(state.in_flight)
        if n == 1:
            return 0
        start = state.next_replica
        index = min(range(n), key=lambda i: (state.in_flight[i], (i - start) % n))
        state.next_replica = (index + 1) % n
        return index

    async def _attempt(
        self, state: _RunState, request: InferenceRequest, body: dict[str, Any], path: str
    ) -> InferenceResponse:
        index = self._pick_replica(state)
        while True:
            sent = self._capabilities.without_dropped(index, body)
            response = await self._post(state, index, path, sent)
            if 200 <= response.status_code < 300:
                return self._parse(request, sent, response, self._shown_urls[index] + path)
            refused = self._refused_negotiable(response, sent)
            if not refused:
                raise self._status_error(request, response, index, path, sent)
            # Each pass drops at least one field that was sent, so this loop ends.
            self._capabilities.drop(index, refused, self._shown_urls[index])

    def _options(self) -> dict[str, bool | None]:
        """Each negotiable field's option; a field given in ``extra_body`` is explicit."""
        options = {"return_token_ids": self.return_token_ids, "logprobs": self.return_logprobs}
        return {
            field: True if field in self.extra_body else option for field, option in options.items()
        }

    def _refused_negotiable(self, response: _Response, sent: dict[str, Any]) -> set[str]:
        """The negotiable fields that ``sent`` carried and this 400/422 names."""
        if response.status_code not in (400, 422):
            return set()
        candidates = {
            field for field, option in self._options().items() if option is None
        } & sent.keys()
        if not candidates:
            return set()
        message, data = _server_message(response)
        return named_fields(data, message, candidates)

    async def _post(
        self, state: _RunState, index: int, path: str, body: dict[str, Any]
    ) -> _Response:
        url = self.base_url[index] + path
        shown = self._shown_urls[index] + path
        state.in_flight[index] += 1
        state.attempts[index] += 1
        client = state.client
        try:
            if isinstance(client, ConnectionPool):
                content = _encode_json(body).encode()
                return await client.request(
                    "POST", url, headers=self._lean_headers, content=content
                )
            return await client.post(url, json=body)
        except (LeanHTTPError, httpx2.HTTPError) as exc:
            raise self._transport_error(exc, shown) from exc
        finally:
            state.in_flight[index] -= 1

    def _transport_error(self, exc: Exception, shown: str) -> InferenceError:
        """The :class:`InferenceError` for a request to ``shown`` that got no response."""
        if isinstance(exc, (LeanTimeout, httpx2.TimeoutException)):
            msg = f"POST {shown} timed out ({self._redact(_describe(exc))})"
            return InferenceTimeoutError(msg, url=shown)
        if isinstance(
            exc,
            (NetworkError, RemoteProtocolError, httpx2.NetworkError, httpx2.RemoteProtocolError),
        ):
            msg = f"POST {shown} failed: {self._redact(_describe(exc))}"
            return InferenceConnectionError(msg, url=shown)
        msg = f"POST {shown} failed: {self._redact(_describe(exc))}"
        return InferenceError(msg, url=shown)

    def _redact(self, text: str) -> str:
        return _redact(text, self.api_key)

    def _status_error(
        self,
        request: InferenceRequest,
        response: _Response,
        index: int,
        path: str,
        sent: dict[str, Any],
    ) -> InferenceError:
        shown = self._shown_urls[index] + path
        status = response.status_code
        message, data = _server_message(response)
        server_message = self._redact(message)[:_MAX_SERVER_MESSAGE] or None
        retry_after = _retry_after(response.headers)
        msg = f"POST {shown} returned {status} {response.reason_phrase}"
        if server_message and server_message != response.reason_phrase:
            msg += f": {server_message}"
        if status in (400, 422):
            named = self._named_explicit(request, message, data, sent, index)
            if named:
                msg += "; " + self._redact("; ".join(hint for hint, _ in named.values()))
            refused = tuple(sorted(field for field, (_, is_refused) in named.items() if is_refused))
            if refused:
                return UnsupportedFieldError(
                    msg, fields=refused, url=shown, status=status, server_message=server_message
                )
        cls = _status_class(status)
        if status in (401, 403):
            msg += " (check api_key or OPENAI_API_KEY)"
        elif status in (404, 405):
            msg += self._api_root_hint(index, path, message)
        elif status < 400:
            msg += " (an unexpected status: is base_url the API root, such as '.../v1'?)"
        return cls(
            msg, url=shown, status=status, server_message=server_message, retry_after=retry_after
        )

    def _named_explicit(
        self,
        request: InferenceRequest,
        message: str,
        data: object,
        sent: dict[str, Any],
        index: int,
    ) -> dict[str, tuple[str, bool]]:
        """The fields asked for explicitly that a 400/422 names, each with a hint and
        whether the server refused the field itself (rather than, say, its value)."""
        strict = {
            field
            for field, option in self._options().items()
            if option is True and field in sent and field not in self.extra_body
        }
        generation_args = request.generation_args.set_fields()
        candidates = strict | self.extra_body.keys() | generation_args.keys()
        named = named_fields(data, message, candidates)
        unknown = says_unknown(message)
        replica = self._shown_urls[index]
        hints: dict[str, tuple[str, bool]] = {}
        for field in sorted(named):
            if field in strict:
                option, flag = NEGOTIABLE_FIELDS[field]
                hint = (
                    f"{replica} refused {field}, which {option}=True requires: use "
                    f"{option}=None to negotiate (ask, and stop asking a server that refuses) "
                    f"or {option}=False to not ask (CLI: {flag})"
                )
                hints[field] = (hint, True)
            elif field in self.extra_body:
                if unknown:
                    hint = (
                        f"{field} (from extra_body) is not accepted by this server: remove "
                        "it from extra_body"
                    )
                else:
                    shown_value = f"{self.extra_body[field]!r:.40}"
                    hint = f"the server names {field} (extra_body[{field!r}]={shown_value})"
                    hint += ": check its value"
                hints[field] = (hint, unknown)
            else:
                value = generation_args[field]
                if unknown:
                    hint = (
                        f"{field} is not accepted by this server: leave GenerationArgs.{field} "
                        f"unset for it (it is {value!r})"
                    )
                else:
                    hint = (
                        f"the server names {field} (GenerationArgs.{field}={value!r}): check "
                        "its value, or leave it unset"
                    )
                hints[field] = (hint, unknown)
        return hints

    def _api_root_hint(self, index: int, path: str, message: str) -> str:
        """For a 404 or 405: a base_url without its API prefix, or not an API at all?"""
        root = self._shown_urls[index]
        last_segment = httpx2.URL(self.base_url[index]).path.rstrip("/").rsplit("/", 1)[-1]
        if not _VERSION_SEGMENT.fullmatch(last_segment):
            return (
                f" (is base_url the API root, such as '{root}/v1'? {root!r} does not end "
                "in a version segment)"
            )
        if "model" in message.lower():
            return ""  # api.openai.com answers 404 for an unknown model: its message says so
        return (
            f" (is base_url the API root of an OpenAI-compatible server, and does it serve "
            f"{path} (endpoint={self.endpoint!r})?)"
        )

    # ----------------------------------------------------------------------- parsing

    def _parse(
        self,
        request: InferenceRequest,
        body: dict[str, Any],
        response: _Response,
        shown: str,
    ) -> InferenceResponse:
        try:
            data = response.json()
        except ValueError as exc:
            if _is_html(response):
                msg = (
                    f"POST {shown} returned {response.status_code} with "
                    f"{_html_summary(response.text)}, not JSON: is base_url the API root of an "
                    "OpenAI-compatible server, such as 'http://127.0.0.1:8000/v1'?"
                )
                raise MalformedResponseError(msg, url=shown, status=response.status_code) from None
            start = self._redact(response.text[:200])
            msg = f"POST {shown} returned {response.status_code} but its body is not JSON ({exc})"
            msg += f"; it starts {start!r}"
            raise MalformedResponseError(msg, url=shown, status=response.status_code) from exc
        try:
            return self._parse_json(request, body, data)
        except _BadField as exc:
            msg = f"POST {shown} returned {response.status_code} but {exc}"
            raise MalformedResponseError(msg, url=shown, status=response.status_code) from None

    def _parse_json(
        self, request: InferenceRequest, body: dict[str, Any], data: object
    ) -> InferenceResponse:
        if not isinstance(data, dict):
            msg = f"its JSON is a {type(data).__name__}, not an object"
            raise _BadField(msg)
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            msg = "$.choices is not a non-empty list of objects"
            raise _BadField(msg)
        choice: dict[str, Any] = choices[0]

        if self.endpoint == "chat":
            message = choice.get("message")
            if not isinstance(message, dict):
                msg = "$.choices[0].message is not an object"
                raise _BadField(msg)
            # A reply that only calls tools has null content.
            content = _optional_str(message, "content", "$.choices[0].message") or ""
            role = _optional_str(message, "role", "$.choices[0].message") or "assistant"
            extra = {key: message[key] for key in _MESSAGE_EXTRA_KEYS if message.get(key)}
            reply = ChatMessage(role=role, content=content, extra=extra)
            prompt_text = render_plain_chat(request.prompt)
            # vLLM puts the prompt's ids at the top level, Megatron on the choice.
            prompt_ids = _int_list(choice, "prompt_token_ids")
            if prompt_ids is None:
                prompt_ids = _int_list(data, "prompt_token_ids", "$")
            logprobs = _chat_logprobs(choice)
        else:
            text = _optional_str(choice, "text")
            if text is None:
                msg = "$.choices[0].text is missing"
                raise _BadField(msg)
            reply = ChatMessage(role="assistant", content=text)
            prompt_text = body["prompt"]
            prompt_ids = _int_list(choice, "prompt_token_ids")
            logprobs = _completion_logprobs(choice)

        generated_ids = _int_list(choice, "token_ids")  # vLLM
        if generated_ids is None:
            generated_ids = _int_list(choice, "generation_token_ids")  # Megatron
        megatron_logprobs = _float_list(choice, "generation_log_probs")
        if megatron_logprobs is not None:
            logprobs = megatron_logprobs
        token_ids = prompt_length = None
        if prompt_ids is not None and generated_ids is not None:
            token_ids = prompt_ids + generated_ids
            prompt_length = len(prompt_ids)
        raw_text = _optional_str(choice, "raw_text")  # Megatron: what the model saw
        usage = data.get("usage")
        if usage is not None and not isinstance(usage, dict):
            msg = f"$.usage is a {type(usage).__name__}, not an object"
            raise _BadField(msg)
        return InferenceResponse(
            response=reply,
            raw_text=raw_text if raw_text is not None else prompt_text + reply.content,
            token_ids=token_ids,
            prompt_length=prompt_length,
            logprobs=logprobs,
            policy_epoch=_epochs(choice, "policy_epoch"),
            kv_cache_epoch=_epochs(choice, "kv_cache_epoch"),
            num_evictions=_optional_int(choice, "num_evictions") or 0,
            finish_reason=_optional_str(choice, "finish_reason"),
            usage=usage,
        )


# --------------------------------------------------------------------------- helpers


def _status_class(status: int) -> type[InferenceError]:
    """The error class for an HTTP error status."""
    if status in (401, 403):
        return AuthenticationError
    if status == 408:
        return InferenceTimeoutError
    if status == 409:
        return ConflictError
    if status == 429:
        return RateLimitError
    if 400 <= status < 500:
        return BadRequestError
    if status in (501, 505):
        return NotSupportedError
    if status >= 500:
        return ServerError
    return InferenceError


def _message_json(message: ChatMessage) -> dict[str, Any]:
    # Extra keys (tool_calls, tool_call_id, name) pass through; role and content win.
    return {**message.extra, "role": message.role, "content": message.content}


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _server_message(response: _Response) -> tuple[str, object]:
    """What a server said about an error, on one line, and its parsed JSON (or ``None``).

    OpenAI's ``error.message``, vLLM's ``message``, FastAPI's ``detail`` (a validation
    list as ``body.field: msg; ...``), a summary of an HTML page (never its markup), or
    else the body itself.
    """
    try:
        text = response.text
    except (UnicodeDecodeError, LookupError):
        return "", None
    if _is_html(response):
        return _html_summary(text), None
    try:
        data = response.json()
    except ValueError:
        return _one_line(text), None
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return _one_line(error["message"]), data
        detail = data.get("detail")
        for value in (error, data.get("message"), detail):
            if isinstance(value, str):
                return _one_line(value), data
        if isinstance(detail, list) and detail and all(isinstance(d, dict) for d in detail):
            items = [
                f"{'.'.join(map(str, d.get('loc') or ['?']))}: {d.get('msg', '?')}" for d in detail
            ]
            return _one_line("; ".join(items)), data
    return _one_line(text), data


def _one_line(text: str) -> str:
    return " ".join(text.split())


#: The last path segment of an API root: "v1", "v2", "v1beta".
_VERSION_SEGMENT = re.compile(r"v\d+[a-z0-9]*", re.IGNORECASE)

_HTML_TITLE = re.compile(r"<title[^>]*>(.*?)</title", re.IGNORECASE | re.DOTALL)


def _is_html(response: _Response) -> bool:
    if "html" in (response.headers.get("content-type") or "").lower():
        return True
    try:
        return response.text.lstrip().startswith("<")
    except (UnicodeDecodeError, LookupError):
        return False


def _html_summary(text: str) -> str:
    """``an HTML page titled '...'``: what a web page is, without its markup."""
    match = _HTML_TITLE.search(text)
    title = _one_line(html.unescape(match.group(1))) if match else ""
    if not title:
        return "an HTML page (no title)"
    return f"an HTML page titled {title[:80]!r}"


#: Where a credential can appear in what a server echoes: an Authorization (or API-key)
#: header's value, a bearer token, a URL's query parameter or its password.
_SECRET_PATTERNS = (
    (
        re.compile(
            r"\b((?:proxy-)?authorization|x-api-key|api-key)([\"']?\s*[:=]\s*[\"']?)"
            r"(?:[A-Za-z]+\s+)?[^\s\"',;}]+",
            re.IGNORECASE,
        ),
        r"\1\2***",
    ),
    (re.compile(r"\b(bearer\s+)[^\s\"',;}]+", re.IGNORECASE), r"\1***"),
    (
        re.compile(
            r"([?&;](?:api[_-]?key|key|token|access[_-]?token|auth)=)[^&\s\"'#]+",
            re.IGNORECASE,
        ),
        r"\1***",
    ),
    (re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/\s:@]*:)[^@\s/]+@", re.IGNORECASE), r"\1***@"),
)


@functools.lru_cache(maxsize=8)
def _standalone(api_key: str) -> re.Pattern[str]:
    # The key as a whole token: not part of a longer word, so a short key never turns
    # "return_token_ids" into "return_to***en_ids".
    return re.compile(rf"(?<![A-Za-z0-9_-]){re.escape(api_key)}(?![A-Za-z0-9_-])")


def _redact(text: str, api_key: str | None) -> str:
    """``text`` without credentials: header values, bearer tokens, URL query keys and
    passwords, and ``api_key`` wherever it stands as a token of its own."""
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    if api_key:
        text = _standalone(api_key).sub("***", text)
    return text


def _retry_after(headers: _Headers) -> float | None:
    """Seconds from ``retry-after-ms`` (OpenAI) or ``Retry-After`` (seconds or a date)."""
    milliseconds = headers.get("retry-after-ms")
    if milliseconds is not None:
        try:
            seconds = float(milliseconds) / 1000
        except ValueError:
            seconds = math.nan
        if math.isfinite(seconds):
            return max(0.0, seconds)
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


class _BadField(Exception):
    """A field of a 2xx response body has the wrong shape (the message names its path)."""


_CHOICE = "$.choices[0]"


def _optional_str(obj: dict[str, Any], key: str, where: str = _CHOICE) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        msg = f"{where}.{key} is a {type(value).__name__}, not a string"
        raise _BadField(msg)
    return value


def _optional_int(obj: dict[str, Any], key: str, where: str = _CHOICE) -> int | None:
    value = obj.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        msg = f"{where}.{key} is {value!r:.40}, not an int"
        raise _BadField(msg)
    return value


def _int_list(obj: dict[str, Any], key: str, where: str = _CHOICE) -> list[int] | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    ):
        msg = f"{where}.{key} is not a list of ints"
        raise _BadField(msg)
    return list(value)


def _numbers(value: object, path: str) -> list[float]:
    if not isinstance(value, list) or not all(
        isinstance(item, (int, float)) and not isinstance(item, bool) for item in value
    ):
        msg = f"{path} is not a list of numbers, one per generated token"
        raise _BadField(msg)
    return [float(item) for item in value]


def _float_list(obj: dict[str, Any], key: str, where: str = _CHOICE) -> list[float] | None:
    value = obj.get(key)
    return None if value is None else _numbers(value, f"{where}.{key}")


def _chat_logprobs(choice: dict[str, Any]) -> list[float] | None:
    """``logprobs.content[i].logprob`` of a chat choice."""
    logprobs = choice.get("logprobs")
    if logprobs is None:
        return None
    if not isinstance(logprobs, dict):
        msg = f"{_CHOICE}.logprobs is not an object"
        raise _BadField(msg)
    content = logprobs.get("content")
    if content is None:
        return None
    path = f"{_CHOICE}.logprobs.content"
    if not isinstance(content, list) or not all(isinstance(item, dict) for item in content):
        msg = f"{path} is not a list of objects"
        raise _BadField(msg)
    return _numbers([item.get("logprob") for item in content], f"{path}[*].logprob")


def _completion_logprobs(choice: dict[str, Any]) -> list[float] | None:
    """``logprobs.token_logprobs`` of a completions choice."""
    logprobs = choice.get("logprobs")
    if logprobs is None:
        return None
    if not isinstance(logprobs, dict):
        msg = f"{_CHOICE}.logprobs is not an object"
        raise _BadField(msg)
    return _float_list(logprobs, "token_logprobs", f"{_CHOICE}.logprobs")


def _epochs(obj: dict[str, Any], key: str) -> list[tuple[int, int]]:
    """Megatron's ``(start_token_index, epoch)`` pairs; a bare int ``e`` means
    ``[(0, e)]``; absent means ``[]``."""
    value = obj.get(key)
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [(0, value)]
    pairs: list[tuple[int, int]] = []
    for item in value if isinstance(value, list) else [None]:
        if (
            not isinstance(item, (list, tuple))
            or len(item) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in item)
        ):
            msg = f"{_CHOICE}.{key} is not a list of [start_token_index, epoch] pairs"
            raise _BadField(msg)
        pairs.append((item[0], item[1]))
    return pairs
