"""The HTTP backend: any OpenAI-compatible server (vLLM, SGLang, Megatron, OpenAI,
``transformers serve``, llama.cpp, Ollama).

:class:`OpenAIInference` is configuration only; everything mutable (the run's
:class:`~._transport.Transport`, in-flight counts, the :class:`~._placement.Placement` of
calls on replicas) lives in a per-Trio-run state held in a
:class:`trio.lowlevel.RunVar`. The transport is made lazily by the first request of a
run and closed when that run ends, by a system task that Trio cancels after the main
task returns; so a pipeline never manages it, a sync :meth:`generate` (its own
``trio.run``) leaves nothing behind, and no connection outlives the loop it is bound to.
``async with interface:`` / :meth:`OpenAIInference.aclose` close it earlier.

What this module does is the request's life: place it on a replica (:mod:`._placement`),
build the body from what negotiation learned (:mod:`._negotiation`) when the transport is
about to write it, send it again without a refused field, retry transient failures
(:mod:`._retry`), hold calls during a weight update and continue the ones a pause
aborted (:mod:`._control`); and a group's life: one request for ``n`` choices where the
replica takes it, else ``n`` requests, each choice continued on its own. The transports
(:mod:`._transport`) own the HTTP and its error map, :mod:`._parse` reads responses,
:mod:`._config` holds :class:`Timeout` and :class:`Limits`.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs
import httpx2
import trio

from trio_rollouts._checks import check_bool, int_at_least, is_real
from trio_rollouts._concurrency import flatten_exception_groups
from trio_rollouts._context import call_start_epoch
from trio_rollouts.inference._config import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_TIMEOUT,
    KEEPALIVE_EXPIRY,
    Limits,
    Timeout,
)
from trio_rollouts.inference._errors import (
    BadRequestError,
    InferenceError,
    MalformedResponseError,
    TokenMismatchError,
    UnsupportedFieldError,
)
from trio_rollouts.inference._interface import (
    AcceptsTokens,
    GeneratesGroups,
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    ReturnsLogProbs,
    ReturnsRaw,
    render_plain_chat,
)
from trio_rollouts.inference._models import ServedModels, model_not_served
from trio_rollouts.inference._pausable import Pausable, WeightUpdateMode
from trio_rollouts.inference._placement import (
    DEFAULT_ROUTING_MARGIN,
    Placement,
    Routing,
    check_routing,
    current_call,
)
from trio_rollouts.inference._retry import RetryBackoff, call_with_retries
from trio_rollouts.inference._salt import CacheSalt, check_cache_salt, new_run_id, salt_of
from trio_rollouts.inference._sampling import LogprobsMode, ReplicaProbe, choice_seed
from trio_rollouts.inference.http._transport import (
    Transport,
    TransportKind,
    encode_json,
    open_transport,
    proxied,
)
from trio_rollouts.inference.openai._control import (
    ABORT,
    RESUME_TIMEOUT,
    SERVER_KINDS,
    VERSION_SEGMENT,
    ControlEndpoints,
    PauseState,
    ServerKind,
    continuation_body,
    control_root,
    generated_tokens,
    merge_continuation,
    seed_continuation,
    token_continuation_body,
)
from trio_rollouts.inference.openai._negotiation import (
    NEGOTIABLE_FIELDS,
    Capabilities,
    named_fields,
    refused_negotiable,
    says_unknown,
)
from trio_rollouts.inference.openai._parse import (
    Response,
    error_for_status,
    parse_choices,
    parse_completion,
    redact,
    server_message,
)
from trio_rollouts.inference.openai._sglang import SGLangVersions, reply_spans
from trio_rollouts.inference.openai._vllm import (
    NativeCall,
    NativeReplicas,
    NativeRun,
    ProbeCache,
    ProbeKind,
    ProbeRun,
    Unreachable,
    VLLMNative,
    probe_logprobs_mode,
)
from trio_rollouts.models._messages import ChatMessage

__all__ = [
    "DEFAULT_MAX_RETRIES",
    "OpenAIInference",
    "OpenAIStatistics",
    "RetryReason",
]

logger = logging.getLogger(__name__)

#: Retries after the first attempt, on :data:`TRANSIENT_ERRORS` only.
DEFAULT_MAX_RETRIES = 3

#: How long closing the transport at the end of a run may take before it is abandoned.
_CLOSE_GRACE = 5.0

_ENDPOINT_PATHS = {"chat": "/chat/completions", "completions": "/completions"}
#: The request field each server takes a prefix-cache salt in (vLLM: the OpenAI routes
#: and the native one; SGLang: its OpenAI routes).
_SALT_FIELDS: dict[str, str] = {"vllm": "cache_salt", "sglang": "extra_key"}

#: What a weight update may ask of an interface without, and with, a server's control
#: endpoints; and the modes that need them.
_CLIENT_MODES: frozenset[WeightUpdateMode] = frozenset({"drain", "restart"})
_SERVER_MODES: frozenset[WeightUpdateMode] = frozenset({"drain", "restart", "keep", "abort"})
_SERVER_ONLY_MODES = _SERVER_MODES - _CLIENT_MODES


# --------------------------------------------------------------------------- configuration


@attrs.frozen(kw_only=True)
class RetryReason:
    """Why requests were retried: ``count`` retries followed an error of the class named
    ``error`` (``"InferenceTimeoutError"``) whose message, without the request's method
    and URL, is ``message`` (at most 200 characters: ``"timed out: http://10.0.0.7:8000
    sent nothing for the read timeout of 600.0 s; ..."``)."""

    error: str
    message: str
    count: int


@attrs.frozen(kw_only=True)
class OpenAIStatistics:
    """Counters of one :class:`OpenAIInference`, per replica (in ``base_urls`` order,
    shown without credentials).

    Counted over the interface's life, every Trio run together (each sync
    :meth:`~OpenAIInference.generate` is a run of its own): requests sent (``attempts``,
    counting a request sent again without a refused field), the completions they asked
    for (``choices``: a group call's request for ``n`` choices is one attempt and ``n``
    choices, so ``choices`` above ``attempts`` shows groups sent as one request; a group
    sent as separate requests counts ``n`` of each), retries made across all replicas
    (``retries``), the calls that were retried at least once (``retried_requests``), and
    why (``retry_reasons``: one :class:`RetryReason` per error class and message, most
    frequent first); per replica, the retries after a request to it failed
    (``retries_by_replica``) and their error classes (``retry_errors_by_replica``: per
    replica, ``(class name, retries)`` pairs, most frequent first). These are retries of
    single requests (``max_retries``), not the pipeline's retries of whole groups under a
    ``FailurePolicy`` (``RolloutStream.statistics().retries``). A run's counts are added
    when it ends; while it runs,
    :meth:`~OpenAIInference.statistics` called in it includes them, one called in another
    thread does not yet. A pickled copy starts from zero.

    Of the current run only: requests in progress now (``in_flight``: placed on the
    replica and not answered yet, a request for ``n`` choices counting one; the load
    placement reads) and calls waiting for a weight update's
    :meth:`~OpenAIInference.resume` (``held``). What negotiation learned, per
    replica, over the interface's life: the request fields that replica refused and that
    are no longer sent to it (``dropped_fields``, sorted), ``n`` among them for a replica
    that refused ``n`` or answered one choice to it (its groups go as separate requests).
    """

    base_urls: tuple[str, ...]
    in_flight: tuple[int, ...]
    attempts: tuple[int, ...]
    retries: int
    dropped_fields: tuple[tuple[str, ...], ...] = ()
    held: int = 0
    retried_requests: int = 0
    retry_reasons: tuple[RetryReason, ...] = ()
    choices: tuple[int, ...] = ()
    retries_by_replica: tuple[int, ...] = ()
    retry_errors_by_replica: tuple[tuple[tuple[str, int], ...], ...] = ()


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
        _refuse_endpoint_url(normalized)
        if normalized in result:
            msg = f"base_url lists {_display_url(url)!r} twice; give each replica once"
            raise ValueError(msg)
        result.append(normalized)
    return tuple(result)


def _refuse_endpoint_url(url: str) -> None:
    """A base_url that is an endpoint's URL (``.../v1/chat/completions``), not the API root,
    is refused with the root to give instead: accepting it would post to
    ``.../chat/completions/chat/completions``, and quietly rewriting it would make the
    URL in errors and statistics differ from the one given."""
    path = httpx2.URL(url).path
    for endpoint, suffix in (("chat", "/chat/completions"), ("completions", "/completions")):
        if path.endswith(suffix):
            root = _display_url(url.removesuffix(suffix))
            with_endpoint = "" if endpoint == "chat" else ", endpoint='completions'"
            msg = (
                f"base_url {_display_url(url)!r} is the URL of an endpoint, not the API root: "
                f"use base_url={root!r}{with_endpoint} (the client posts to "
                f"base_url + {suffix!r} for endpoint={endpoint!r})"
            )
            raise ValueError(msg)


def _display_url(url: str) -> str:
    """The URL without user credentials, for messages."""
    try:
        return str(httpx2.URL(url).copy_with(username=None, password=None))
    except (httpx2.InvalidURL, TypeError, ValueError):
        return "<unparsable URL>"


def _repr_urls(urls: tuple[str, ...]) -> str:
    return repr(tuple(_display_url(url) for url in urls))


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


def _to_timeout(value: Timeout | httpx2.Timeout | float | None) -> Timeout:
    if isinstance(value, Timeout):
        return value
    if isinstance(value, httpx2.Timeout):  # accepted as before the library had its own
        return Timeout(connect=value.connect, read=value.read, write=value.write, pool=value.pool)
    if value is None or is_real(value):
        return Timeout.every_phase(value)
    msg = (
        "timeout must be a trio_rollouts.inference.Timeout, a number of seconds (every "
        f"phase) or None (no limit), got {value!r}"
    )
    raise TypeError(msg)


def _check_limits(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if not isinstance(value, Limits):
        msg = f"limits must be a trio_rollouts.inference.Limits or None, got {value!r}"
        raise TypeError(msg)
    if value.max_connections != instance.max_connections:
        msg = (
            f"max_connections={instance.max_connections!r} and limits.max_connections="
            f"{value.max_connections!r} disagree: give one of them"
        )
        raise ValueError(msg)


def _default_max_connections(self: Any) -> int:
    # (Runs before the validators: a given limits that is not a Limits is refused there.)
    given = self._given_limits
    return given.max_connections if isinstance(given, Limits) else DEFAULT_MAX_CONNECTIONS


#: Request fields that ``extra_body`` may not carry: the client sets them from the
#: interface and the request, or cannot honour them; each with what to use instead.
_FROM_THE_PROMPT = "the client sets it from the request's prompt (InferenceRequest.prompt)"
_RESERVED_EXTRA_BODY = {
    "model": "the client sets it: give it as OpenAIInference(model=...)",
    "messages": _FROM_THE_PROMPT,
    "prompt": _FROM_THE_PROMPT,
    "tools": "the client sets it: give tools with the request (InferenceRequest(tools=...))",
    "stream": "the client reads whole responses, it does not stream",
    "n": (
        "the client sets it: agenerate_group(request, n) asks n completions of one prompt "
        "in one request (agenerate makes one request per sample)"
    ),
}


def _check_extra_body(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        msg = f"extra_body must be a dict with str keys, got {value!r:.80}"
        raise TypeError(msg)
    for key in value:
        instead = _RESERVED_EXTRA_BODY.get(key)
        if instead is not None:
            msg = f"extra_body may not set {key!r}: {instead}"
            raise ValueError(msg)


def _check_ask(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, bool):
        msg = (
            f"{attribute.name} must be None (ask, and stop asking a replica that refuses), "
            f"True (ask, and fail if refused) or False (never ask), got {value!r:.80}"
        )
        raise TypeError(msg)


# --------------------------------------------------------------------------- per-run state


#: Distinct retry reasons kept; later new ones are counted as one "other" reason.
_MAX_RETRY_REASONS = 32
_REASON_LENGTH = 200


def _retry_reason(error: InferenceError) -> tuple[str, str]:
    """``(class name, message without "POST <url> [failed: ]")`` of an error retried."""
    message = str(error)
    if error.url is not None:
        _, found, rest = message.partition(f"{error.url} ")
        if found:
            message = rest.removeprefix("failed: ")
    return type(error).__name__, message[:_REASON_LENGTH]


@functools.lru_cache(maxsize=64)
def _url_prefixes(base_urls: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """``(URL prefix, replica)`` of each replica as errors show its requests' URLs: its
    ``base_url`` and its server root (vLLM's native and control routes), without
    credentials, longest first."""
    prefixes = [(_display_url(url), index) for index, url in enumerate(base_urls)]
    prefixes += [(_display_url(control_root(url)), index) for index, url in enumerate(base_urls)]
    return tuple(sorted(prefixes, key=lambda prefix: -len(prefix[0])))


def _replica_of(url: str | None, base_urls: tuple[str, ...]) -> int | None:
    """The replica a failed request's ``url`` (an error's) went to, or ``None``."""
    if len(base_urls) == 1:
        return 0
    if url is None:
        return None
    for prefix, index in _url_prefixes(base_urls):
        if url == prefix or (url.startswith(prefix) and url[len(prefix)] in "/?"):
            return index
    return None


class _Counts:
    """Retries of one Trio run, or the counts of the runs that have ended (the interface's
    totals: runs end in any thread, hence the lock)."""

    def __init__(self, replicas: int) -> None:
        self._lock = threading.Lock()
        self.attempts = [0] * replicas
        self.choices = [0] * replicas
        self.retries = 0
        self.retried_requests = 0
        self.reasons: dict[tuple[str, str], int] = {}
        # Retries by the URL that failed and the error's class; statistics() finds the
        # replica of each URL (few: a replica's URLs are its routes).
        self.by_url: dict[tuple[str | None, str], int] = {}

    def count_retry(self, error: InferenceError, first: bool) -> None:
        self.retries += 1
        self.retried_requests += first
        reason = _retry_reason(error)
        if reason not in self.reasons and len(self.reasons) >= _MAX_RETRY_REASONS:
            reason = (reason[0], "(other messages)")
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        key = (error.url, reason[0])
        self.by_url[key] = self.by_url.get(key, 0) + 1

    def by_replica(self, base_urls: tuple[str, ...]) -> list[dict[str, int]]:
        """The retries of each replica of ``base_urls``, by error class."""
        counts: list[dict[str, int]] = [{} for _ in base_urls]
        for (url, error), count in self.by_url.items():
            index = _replica_of(url, base_urls)
            if index is not None:
                errors = counts[index]
                errors[error] = errors.get(error, 0) + count
        return counts

    def add(self, attempts: Sequence[int], choices: Sequence[int], other: _Counts) -> None:
        """Add a run's ``attempts``, ``choices`` and retries (thread-safe)."""
        with self._lock:
            self.attempts = [a + b for a, b in zip(self.attempts, attempts, strict=True)]
            self.choices = [a + b for a, b in zip(self.choices, choices, strict=True)]
            self.retries += other.retries
            self.retried_requests += other.retried_requests
            for reason, count in other.reasons.items():
                self.reasons[reason] = self.reasons.get(reason, 0) + count
            for key, count in other.by_url.items():
                self.by_url[key] = self.by_url.get(key, 0) + count

    def copy(self) -> _Counts:
        copy = _Counts(len(self.attempts))
        with self._lock:
            copy.add(self.attempts, self.choices, self)
        return copy

    def __getstate__(self) -> dict[str, Any]:
        return {"replicas": len(self.attempts)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["replicas"])  # type: ignore[misc]


@attrs.define(eq=False)
class _RunState:
    """What one Trio run holds for one interface; its counts are added to ``totals`` when
    the run ends (or aclose() closes it)."""

    transport: Transport
    in_flight: list[int]  # requests placed and not answered, per replica: the load
    attempts: list[int]
    choices: list[int]
    placement: Placement
    pause: PauseState
    totals: _Counts
    counts: _Counts
    native: NativeRun
    models: ServedModels = attrs.field(factory=ServedModels)
    probes: ProbeRun = attrs.field(factory=ProbeRun)
    keeper_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    closed: trio.Event = attrs.field(factory=trio.Event)
    added: bool = False

    def add_to_totals(self) -> None:
        if not self.added:
            self.added = True
            self.totals.add(self.attempts, self.choices, self.counts)


async def _close_at_run_exit(state: _RunState) -> None:
    """System task: keeps the transport open until aclose() or the end of the Trio run."""
    try:
        with state.keeper_scope:
            await trio.sleep_forever()
    finally:
        state.add_to_totals()
        # Trio cancels system tasks once the main task has returned; the shield lets the
        # sockets close anyway, and the grace bound keeps a stuck close from hanging exit.
        with trio.move_on_after(_CLOSE_GRACE, shield=True):
            try:
                await state.transport.aclose()
            except Exception:
                # An exception escaping a system task would crash the whole run.
                logger.warning("closing the inference HTTP transport failed", exc_info=True)
        state.closed.set()


@attrs.define(eq=False)
class _EpochBox:
    value: int = 0


# --------------------------------------------------------------------------- the backend


def _check_priority(
    instance: OpenAIInference, attribute: attrs.Attribute[Any], value: object
) -> None:
    check_bool(instance, attribute, value)
    if value and instance.server != "vllm":
        msg = (
            f"priority=True needs server='vllm' (got server={instance.server!r}): only vLLM "
            "takes a request priority (with --scheduling-policy priority)"
        )
        raise ValueError(msg)


@attrs.frozen(kw_only=True, eq=False)
class OpenAIInference(
    InferenceInterface, GeneratesGroups, ReturnsRaw, ReturnsLogProbs, AcceptsTokens, Pausable
):
    """An OpenAI-compatible HTTP server (vLLM, SGLang, Megatron, OpenAI, ``transformers
    serve``, llama.cpp's server, Ollama) as an inference interface. Frozen: it is
    configuration; what changes lives with each Trio run, except what negotiation learns
    about the replicas (below), which the interface keeps for its whole life.

    - ``base_url``: the API root including ``/v1`` (as in the OpenAI SDK), or a list of
      them: replicas serving the same model, over which ``routing`` spreads the calls.
    - ``model``: the served model's name. ``api_key``: sent as ``Authorization: Bearer``;
      ``None`` reads ``OPENAI_API_KEY`` (no header when neither is set). It never
      appears in a repr, a log line or an error.
    - ``endpoint``: ``"chat"`` (``/chat/completions``) or ``"completions"``
      (``/completions``, with the prompt rendered by ``render_prompt``; no tools). A
      ``base_url`` that ends in either path is an endpoint's URL, not the API root: a
      ``ValueError`` names the root to give.
    - ``max_connections``: connections to all replicas together (:data:`DEFAULT_MAX_CONNECTIONS`);
      requests beyond it queue. Or ``limits``: a :class:`Limits` (connections, idle ones
      kept, their expiry); :attr:`limits` is what is used. ``timeout``: a :class:`Timeout`
      per attempt (:data:`DEFAULT_TIMEOUT`), or seconds for every phase (``None``: no
      limit); an ``httpx2.Timeout`` is accepted too. Both mean the same on either
      transport. Bound a whole request, retries included, with a Trio cancel scope around
      the call.
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
        no token ids or logprobs: the response's fields stay ``None``, and a warning
        naming the replica is logged once (not for a response that generated nothing).
      - ``True``: strict. A refusal raises :class:`UnsupportedFieldError` (a
        :class:`BadRequestError`) naming the server and the field, and so does a
        response without them (a server that ignores the field).
      - ``False``: never sent.

      Chat requests send ``top_logprobs: 1`` with ``logprobs`` (llama-cpp-python's
      server returns none without it); it is dropped with ``logprobs``. Logprobs are
      read in the chat shape (``logprobs.content``) or the completions one
      (``token_logprobs``) on either endpoint (``llama-server`` answers
      ``/v1/completions`` in the chat shape). Logprobs not one per generated token
      (``llama-server`` merges a character's byte tokens) are dropped with a warning
      once per replica, or raise :class:`MalformedResponseError` with
      ``return_logprobs=True``.
    - ``extra_body``: more top-level JSON fields for every request (e.g.
      ``{"min_p": 0.05}``); they override the two options above but never the model, the
      prompt, the tools or a set generation argument. A key the client sets itself
      (``model``, ``messages``, ``prompt``, ``tools``, ``n``: :meth:`agenerate_group`) or
      cannot honour (``stream``) is a ``ValueError`` saying what to use instead. They
      are explicit, never negotiated: a refusal naming one raises
      :class:`UnsupportedFieldError`, as does one naming a set generation argument.

    - ``token_prompts``: whether a request with ``prompt_ids`` is sent as an id prompt
      (``/v1/completions``, ``"prompt": [ids]``, the form vLLM and SGLang take; the
      default). ``False`` for a server that renders chats only (``llama-server``,
      ``transformers serve``, api.openai.com): the instance is then not
      :func:`~trio_rollouts.inference.accepts_tokens`, a request with ``prompt_ids`` is a
      ``TypeError``, and :class:`~trio_rollouts.MultiTurnAgent` sends such a server the
      conversation as a chat (turns of fidelity ``"server_tokens"`` when it returns the
      ids it rendered and sampled, else ``"retokenized"``).
    - ``server``: ``"vllm"`` or ``"sglang"`` to pause through that server's control
      endpoints for a weight update (all four modes), or ``None`` (the default): pauses
      hold calls client-side only (``drain`` and ``restart``). See :meth:`pause` and
      ``docs/pausing-servers.md``.

      With ``"vllm"``, requests without tools (or an ``extra_body`` option only the
      OpenAI routes honour, such as ``response_format``) go to vLLM's native RL route,
      ``{root}/inference/v1/generate`` (``root``: ``base_url`` without ``/v1``; served
      with ``--enable-scale-out``): id prompts as they are, text prompts rendered to ids
      by the server's ``/tokenize`` (chat messages with the chat template and the
      generation prompt; a completions prompt as text), the sampling fields (generation
      arguments, ``seed``, ``extra_body``) as ``sampling_params``. The response is the
      same as on the OpenAI routes (the text comes in the reply, ``output_mode:
      "text"``), plus exact ``policy_epoch`` boundaries: each replica is labelled with
      the epoch (``POST /update_weight_version``) at its first contact and at every
      :meth:`resume`, and the reply's ``weight_versions`` spans become the boundaries
      (see :attr:`stamps_policy_epoch`). A cancelled call's request is aborted on the
      server by its id. Whether a replica serves the route is learned once per replica
      for the interface's life: one that answers 403 (vLLM without
      ``--enable-scale-out``), 404, 405 or 501 is sent the OpenAI routes from then on,
      with one warning naming it and the flag. ``kv_cache_epoch`` stays as on the OpenAI
      routes: vLLM does not say which KV blocks a continuation read from a prefix cache
      computed under older weights.
    - ``routing``: which replica each call goes to. The load of a replica is its
      requests in flight from this interface (a request for ``n`` choices is one); the
      pipeline names each call's group (and the library's agents its episode) as it
      names the epoch.

      - ``"group"`` (the default): the first call of a group goes to the least loaded
        replica, ties broken by a seeded hash of the group's key (not "the first
        replica"); the group's later calls, and every turn of each of its episodes, go to
        the same replica unless it has more than ``routing_margin`` calls in flight above
        the least loaded, not counting the group's own (siblings sent together stay
        together), and then to that one (which becomes the group's). A group is
        ``G`` requests with one prompt, and an episode sends its growing context every
        turn: the prompt is prefilled once per replica it lands on, and every later call
        there reads it from the prefix cache, so keeping a group on one replica computes
        the prompt once instead of up to once per replica (``tools/vllm/placement_checks.py``
        measures it on two vLLM servers). Calls outside any group (outside the pipeline)
        are placed as ``"least_loaded"``.
      - ``"least_loaded"``: the replica with the fewest requests in flight, ties taken in
        turn (an idle pool alternates).
      - ``"round_robin"``: each replica in turn, whatever their load.

      Placement is a pure function of the group keys and the order of calls, so two
      seeded runs place alike; it is per Trio run (each sync :meth:`generate` starts
      afresh). A retry picks again. A group call (:meth:`agenerate_group`) is placed
      once: every request of it goes to one replica (a retry picks again, and the rest
      of the group follows).
    - ``routing_margin``: how many calls in flight a group's replica may have above the
      least loaded one before the group's next call goes elsewhere
      (:data:`DEFAULT_ROUTING_MARGIN`; ``0``: only while it is among the least loaded).
    - ``priority``: with ``server="vllm"`` only, send each call's start epoch (its
      group's ``start_epoch`` in a pipeline, else :attr:`policy_epoch`) as vLLM's
      ``priority`` (lower first), for a server run with ``--scheduling-policy
      priority``: calls of older epochs, nearest the staleness bound, are to leave the
      queue first. vLLM 0.32 takes the field on any server; on its CPU build we could
      not observe it reorder waiting requests (``tools/vllm/placement_checks.py``
      reports the order). Off by default.
    - ``cache_salt``: the prefix-cache salt each request carries, so that no request
      reuses KV computed under older weights (``docs/pausing-servers.md``).
      ``"epoch"`` (the default): a hash of ``run_id`` and the start epoch of the call's
      group (its ``start_epoch`` in a pipeline, else :attr:`policy_epoch` when the call
      starts), so a group's siblings and its episodes' later turns share their prefix
      while a group started after an update never reads an older policy's KV; a
      continuation after an ``abort`` pause is salted with the epoch it continues under
      (its prefix is computed again, under the new weights). Sent as vLLM's
      ``cache_salt`` (chat, completions and the native route) with ``server="vllm"``
      and as SGLang's ``extra_key`` with ``server="sglang"``; each response's
      ``kv_cache_epoch`` is then the salt's epoch, the oldest weights any KV its tokens
      attended to can come from (no boundary at a ``keep`` pause: the tokens after it
      still attend to the KV before it; a boundary where an ``abort`` continuation
      starts). ``"off"``: no salt, and ``kv_cache_epoch`` stays unknown (``[]``). Or a
      callable ``(run_id, call: CacheSaltCall) -> str | None``: its salt (``None``: none)
      on every request; ``kv_cache_epoch`` unknown. With ``server=None`` nothing is
      sent (the server's field is not known; a salt in ``extra_body`` is sent as given,
      and so with any ``server``: it wins over this setting).
    - ``run_id``: what the salt hashes beside the epoch (random per interface by default,
      kept by a pickled copy, so every Ray actor of a run salts alike; two runs, whose
      epochs name different weights, never share a salt).

    **Groups.** :meth:`agenerate_group` (the interface is
    :class:`~trio_rollouts.inference.GeneratesGroups`) sends one request for ``n``
    completions (``"n": n``) on the route a call takes (chat, completions, or vLLM's
    native route, which takes ``sampling_params.n``): the server prefills the prompt once
    and schedules the choices together. It returns one response per choice, each with its
    own ``token_ids``, ``logprobs``, ``finish_reason`` and ``policy_epoch``, and ``usage``
    split per choice (the prompt's tokens in each, the choice's own completion tokens); a
    choice that a pause aborted is continued on its own. A replica that refuses ``n`` (a
    400 or 422 naming it: vLLM's native route refuses ``n`` above ``--max-num-seqs``) or
    answers one choice for ``n > 1`` gets its groups as ``n`` concurrent requests from
    then on, for the interface's life (one warning per replica; :meth:`statistics` lists
    ``n`` among its ``dropped_fields``); so does a greedy request (``temperature`` 0,
    which vLLM refuses with ``n > 1``). Those requests of a seeded group carry ``seed +
    i``, the seed vLLM gives choice ``i`` of a request with ``n``: the same ids either
    way. In :meth:`statistics`, a request for ``n`` choices is one of ``attempts`` (and
    of ``in_flight`` while it runs) and ``n`` of ``choices``.

    Every set field of the request's ``GenerationArgs`` is forwarded as is
    (``temperature``, ``top_p``, ``max_tokens``, ``seed``, and ``top_k`` as a top-level
    key, which vLLM and SGLang accept); unset ones are left out, so the server's defaults
    apply. The ``k``-th continuation of an aborted seeded call is sent
    ``continuation_seed(seed, k)`` instead (no two requests share a seed).

    The response fills ``raw_text`` (the server's ``raw_text`` when it sends one, as
    Megatron's does; else the prompt sent to ``/completions``, or
    ``render_plain_chat(prompt)``, followed by the completion), ``token_ids`` and
    ``prompt_length`` when the server returns prompt and generated ids, ``logprobs``
    (with or without token ids), ``finish_reason``, ``usage``, and Megatron's
    ``policy_epoch``, ``kv_cache_epoch`` and ``num_evictions`` when present (without
    Megatron's stamps, ``policy_epoch`` is ``[(0, e)]``, ``e`` the :attr:`policy_epoch`
    the call started under). See ``docs/pausing-servers.md``.
    """

    base_url: tuple[str, ...] = attrs.field(converter=_to_base_urls, repr=_repr_urls, kw_only=False)
    model: str = attrs.field(validator=_check_model, kw_only=False)
    api_key: str | None = attrs.field(
        factory=_api_key_from_environment, validator=_check_api_key, repr=_mask_api_key
    )
    endpoint: Literal["chat", "completions"] = attrs.field(
        default="chat", validator=attrs.validators.in_(("chat", "completions"))
    )
    # ``limits=`` as given (None: derived from max_connections); read it as ``limits``.
    _given_limits: Limits | None = attrs.field(
        default=None, alias="limits", validator=_check_limits, repr=False
    )
    max_connections: int = attrs.field(
        default=attrs.Factory(_default_max_connections, takes_self=True),
        validator=int_at_least(1),
    )
    timeout: Timeout = attrs.field(default=DEFAULT_TIMEOUT, converter=_to_timeout)
    max_retries: int = attrs.field(default=DEFAULT_MAX_RETRIES, validator=int_at_least(0))
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
    token_prompts: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    routing: Routing = attrs.field(default="group", validator=check_routing)
    routing_margin: int = attrs.field(default=DEFAULT_ROUTING_MARGIN, validator=int_at_least(0))
    priority: bool = attrs.field(default=False, validator=_check_priority)
    cache_salt: CacheSalt = attrs.field(default="epoch", validator=check_cache_salt)
    run_id: str = attrs.field(factory=new_run_id, validator=attrs.validators.instance_of(str))
    # The replicas as shown in errors (no credentials), parsed once, not per attempt.
    _shown_urls: tuple[str, ...] = attrs.field(
        init=False,
        repr=False,
        default=attrs.Factory(
            lambda self: tuple(_display_url(url) for url in self.base_url), takes_self=True
        ),
    )
    # The control endpoints of the replicas (None without a server to pause).
    _control: ControlEndpoints | None = attrs.field(
        init=False,
        repr=False,
        default=attrs.Factory(lambda self: self._control_endpoints(), takes_self=True),
    )
    # The replicas that may be paused server-side (a pause was sent and no resume has
    # succeeded since): a server's pause outlives the Trio run that made it, so this is
    # kept across runs, and a resume in any later run resumes them.
    _server_paused: set[int] = attrs.field(init=False, repr=False, factory=set)
    # The policy epoch: mutable, and kept across runs (resume() in one, generate() in
    # the next); the client-side hold lives with each run.
    _epoch: _EpochBox = attrs.field(init=False, repr=False, factory=lambda: _EpochBox())
    _pause_var: trio.lowlevel.RunVar[PauseState | None] = attrs.field(
        init=False,
        repr=False,
        factory=lambda: trio.lowlevel.RunVar("trio_rollouts.OpenAIInference.pause"),
    )
    _run_state: trio.lowlevel.RunVar[_RunState | None] = attrs.field(
        init=False,
        repr=False,
        factory=lambda: trio.lowlevel.RunVar("trio_rollouts.OpenAIInference"),
    )
    # The counts of the runs that have ended (statistics() adds the current run's).
    _totals: _Counts = attrs.field(
        init=False,
        repr=False,
        default=attrs.Factory(lambda self: _Counts(len(self.base_url)), takes_self=True),
    )
    # What negotiation learned per replica: mutable, and deliberately not per run.
    _capabilities: Capabilities = attrs.field(
        init=False,
        repr=False,
        default=attrs.Factory(
            lambda self: Capabilities.for_replicas(len(self.base_url)), takes_self=True
        ),
    )

    # vLLM's native route (None unless server="vllm"): what it learns about each replica
    # (served or not, labelled, the labels set) is kept for the interface's life.
    _native: VLLMNative | None = attrs.field(
        init=False,
        repr=False,
        default=attrs.Factory(lambda self: self._native_route(), takes_self=True),
    )
    # SGLang's weight versions (None unless server="sglang"): the labels this interface
    # set and which replicas stamp with them, kept for the interface's life.
    _sglang: SGLangVersions | None = attrs.field(
        init=False,
        repr=False,
        default=attrs.Factory(
            lambda self: (
                SGLangVersions.for_replicas(len(self.base_url)) if self.server == "sglang" else None
            ),
            takes_self=True,
        ),
    )
    # What probe() learned per replica, over the interface's life.
    _probe_cache: ProbeCache = attrs.field(init=False, repr=False, factory=ProbeCache)

    def _native_route(self) -> VLLMNative | None:
        if self.server != "vllm":
            return None
        roots = tuple(control_root(url) for url in self.base_url)
        return VLLMNative(
            roots=roots,
            shown_roots=tuple(_display_url(root) for root in roots),
            api_key=self.api_key,
            model=self.model,
            max_retries=self.max_retries,
            backoff=self.backoff,
            capabilities=self._capabilities,
            state=NativeReplicas.for_replicas(len(self.base_url)),
        )

    def _control_endpoints(self) -> ControlEndpoints | None:
        if self.server is None:
            return None
        roots = tuple(control_root(url) for url in self.base_url)
        return ControlEndpoints(
            server=self.server,
            roots=roots,
            shown_roots=tuple(_display_url(root) for root in roots),
            api_key=self.api_key,
            max_retries=self.max_retries,
            backoff=self.backoff,
        )

    @property
    def limits(self) -> Limits:
        """The connection :class:`Limits`: ``limits`` as given, else ``max_connections``
        in total, as many kept alive, idle ones closed after 5 s."""
        if self._given_limits is not None:
            return self._given_limits
        return Limits(max_connections=self.max_connections, keepalive_expiry=KEEPALIVE_EXPIRY)

    # ----------------------------------------------------------------------- lifetime

    @property
    def uses_lean_transport(self) -> bool:
        """Whether requests go through the lean HTTP/1.1 pool (``transport="lean"``, or
        ``"auto"`` with no proxy configured for the replicas) rather than httpx2."""
        if self.transport == "auto":
            return not proxied(self.base_url)
        return self.transport == "lean"

    def _make_transport(self) -> Transport:
        kind: TransportKind = "lean" if self.uses_lean_transport else "httpx2"
        return open_transport(kind, timeout=self.timeout, limits=self.limits, api_key=self.api_key)

    def _state(self) -> _RunState:
        state = self._run_state.get(None)
        if state is None:
            n = len(self.base_url)
            state = _RunState(
                transport=self._make_transport(),
                in_flight=[0] * n,
                attempts=[0] * n,
                choices=[0] * n,
                placement=Placement(replicas=n, routing=self.routing, margin=self.routing_margin),
                pause=self._pause_state(),
                totals=self._totals,
                counts=_Counts(n),
                native=NativeRun.for_replicas(n),
            )
            self._run_state.set(state)
            trio.lowlevel.spawn_system_task(
                _close_at_run_exit, state, name=f"{type(self).__name__} transport keeper"
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
        state.add_to_totals()
        state.keeper_scope.cancel()
        await state.closed.wait()

    def statistics(self) -> OpenAIStatistics:
        """Counters over the interface's life, every Trio run together (a sync
        :meth:`generate` is a run of its own), plus the current run's so far; requests on
        the wire and held calls of the current run; and the fields each replica refused.
        See :class:`OpenAIStatistics`. Callable from any thread, in a run or not."""
        try:
            state = self._run_state.get(None)
        except RuntimeError:  # outside a Trio run
            state = None
        n = len(self.base_url)
        capabilities = self._capabilities
        dropped = tuple(
            tuple(sorted(fields if takes_n else fields | {"n"}))
            for fields, takes_n in zip(capabilities.dropped, capabilities.takes_n, strict=True)
        )
        counts = self._totals.copy()
        in_flight, held = (0,) * n, 0
        if state is not None:
            in_flight, held = tuple(state.in_flight), state.pause.held
            if not state.added:
                counts.add(state.attempts, state.choices, state.counts)
        reasons = sorted(counts.reasons.items(), key=lambda item: (-item[1], item[0]))
        by_replica = counts.by_replica(self.base_url)
        return OpenAIStatistics(
            base_urls=self._shown_urls,
            in_flight=in_flight,
            attempts=tuple(counts.attempts),
            retries=counts.retries,
            dropped_fields=dropped,
            held=held,
            retried_requests=counts.retried_requests,
            retry_reasons=tuple(
                RetryReason(error=error, message=message, count=count)
                for (error, message), count in reasons
            ),
            choices=tuple(counts.choices),
            retries_by_replica=tuple(sum(errors.values()) for errors in by_replica),
            retry_errors_by_replica=tuple(
                tuple(sorted(errors.items(), key=lambda item: (-item[1], item[0])))
                for errors in by_replica
            ),
        )

    # ----------------------------------------------------------------------- the probe

    async def probe(self) -> list[ReplicaProbe]:
        """What each replica says about how it samples, one :class:`ReplicaProbe` per
        replica (in ``base_url`` order), probed concurrently.

        Per replica: two one-token requests with the same short prompt and seed, at
        ``temperature=1`` and ``temperature=0.5``, asking the top 5 logprobs
        (``/v1/completions`` ``logprobs: 5``; for ``endpoint="chat"`` with
        ``token_prompts=False``, a server that renders chats only, ``/v1/chat/completions``
        ``logprobs: true, top_logprobs: 5``). Equal top logprobs (within 1e-5) mean the
        server returns ``"raw"`` logprobs (before temperature: vLLM's default), different
        ones ``"processed"`` (``--logprobs-mode processed_logprobs``); none, a refusal or
        an error status, ``"unknown"``. With ``server="vllm"``, ``native_generate`` says
        whether the replica serves vLLM's native route (asked with a one-token native
        request if no call has asked yet; its first contact labels the replica with the
        current epoch, as a call's would) and ``sampling_mask`` whether a native reply
        carried one.

        Answers are cached per replica for the interface's life (across Trio runs);
        concurrent callers share one probe. An answer for a replica that could not be
        reached (a connection error or a timeout), or whose native route is still
        unknown, is returned but not cached. Probe requests are not counted in
        :meth:`statistics` and never raise server or HTTP errors (they give
        ``"unknown"``); they do not wait for a paused interface. Responses of later calls
        carry the cached ``logprobs_mode`` of the replica that served them.

        Cancellation: cancellable; nothing is cached for a replica whose probe was
        cancelled midway: the next :meth:`probe`, or a caller that was sharing it, asks
        again.
        """
        state = self._state()
        results: dict[int, ReplicaProbe] = {}

        async def one(index: int) -> None:
            results[index] = await self._probe_cache.get(
                state.probes, index, functools.partial(self._probe_replica, state, index)
            )

        async with trio.open_nursery() as nursery:
            for index in range(len(self.base_url)):
                nursery.start_soon(one, index)
        return [results[index] for index in range(len(self.base_url))]

    async def _probe_replica(self, state: _RunState, index: int) -> tuple[ReplicaProbe, bool]:
        """The probe of one replica and whether it is final (worth caching)."""
        kind: ProbeKind = (
            "chat" if self.endpoint == "chat" and not self.token_prompts else "completions"
        )
        path = _ENDPOINT_PATHS[kind]
        mode: LogprobsMode = "unknown"
        final = True

        async def logprobs() -> None:
            nonlocal mode, final
            url, shown = self.base_url[index] + path, self._shown_urls[index] + path
            try:
                mode = await probe_logprobs_mode(state.transport, url, shown, kind, self.model)
            except Unreachable:
                final = False

        async def negotiate(native: VLLMNative) -> None:
            nonlocal final
            try:
                await native.negotiate(state.transport, state.native, index)
            except InferenceError as exc:
                # A connection error, a timeout, a 5xx: asked again by the next call.
                logger.debug("probing %s's native route failed: %s", self._shown_urls[index], exc)
            if native.replica(index).native is None:
                final = False

        async with trio.open_nursery() as nursery:
            nursery.start_soon(logprobs)
            if self._native is not None:
                nursery.start_soon(negotiate, self._native)
        replica = None if self._native is None else self._native.replica(index)
        probe = ReplicaProbe(
            base_url=self._shown_urls[index],
            logprobs_mode=mode,
            native_generate=replica is not None and replica.native is True,
            sampling_mask=replica is not None and replica.sampling_mask,
        )
        return probe, final

    # ----------------------------------------------------------------------- weight updates

    @property
    def supported_modes(self) -> frozenset[WeightUpdateMode]:
        """``drain`` and ``restart`` (held client-side) always; ``keep`` and ``abort``
        through the control endpoints of ``server="vllm"`` or ``"sglang"``."""
        return _SERVER_MODES if self.server is not None else _CLIENT_MODES

    @property
    def accepts_token_prompts(self) -> bool:
        """``token_prompts``: whether requests with ``prompt_ids`` are sent as id
        prompts."""
        return self.token_prompts

    @property
    def policy_epoch(self) -> int:
        """The epoch last given to :meth:`resume` (0 before any), kept across runs."""
        return self._epoch.value

    @property
    def stamps_policy_epoch(self) -> bool:
        """Whether every response records the token at which its epoch changed.

        ``True`` only with ``server="vllm"`` once every replica is known to serve vLLM's
        native route and to stamp: it answered a native request, took this interface's
        weight-version label, and no reply carried a label the interface did not set.
        So it is ``False`` until each replica's first call (or :meth:`probe`), which is
        fine: the pipeline reads it at a weight update, to decide whether the calls in
        flight are stamped exactly, and a replica not contacted yet has none in flight.
        Otherwise ``False``: the OpenAI routes do not say where the weights changed, and
        a call is stamped ``[(0, e)]`` with the epoch it started under (unless the
        server returns its own ``policy_epoch`` stamps, as Megatron's does)."""
        if self._sglang is not None:
            return self._sglang.stamps
        return self._native is not None and self._native.stamps

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
        ``POST /pause?mode=keep&clear_cache=false``, SGLang ``POST /pause_generation
        {"mode": "in_place"}``: requests in flight stay on the server with their KV
        cache and go on after :meth:`resume`. ``abort``: vLLM ``POST
        /pause?mode=abort&clear_cache=false``, SGLang ``{"mode": "abort"}``: the server
        ends requests in flight with their partial output (``finish_reason "abort"``),
        and each call continues from it after :meth:`resume`, exactly from its token ids
        when it has them. When it returns, no replica is generating: vLLM answers
        ``/pause`` only once its engine is idle with the pause state set
        (``docs/pausing-servers.md``).

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
        control = self._control
        if mode not in _SERVER_ONLY_MODES or control is None:
            await trio.lowlevel.checkpoint()
            return
        pause.server_pauses += 1
        error = await control.pause(state.transport, mode, self._server_paused)
        if error is None:
            return
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
        "abort_all_requests": false}``). With vLLM, every replica that serves the native
        route gets ``POST /update_weight_version {"new_version": "<epoch>"}`` first (while
        still paused, so that the tokens sampled after ``/resume`` carry it); a replica
        whose label fails only stops stamping (a warning, not an error). Idempotent: when
        nothing is paused it only sets the epoch (and labels native replicas whose label
        differs).

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
        control = self._control
        paused = pause.hold is not None
        error = None
        try:
            # While still paused: the tokens generated after /resume carry the new label.
            await self._relabel(state, epoch)
            if control is not None and (paused or self._server_paused):
                new_version = epoch if paused and epoch != self._epoch.value else None
                error = await control.resume(state.transport, self._server_paused, new_version)
                if self._sglang is not None and new_version is not None and error is None:
                    self._sglang.labelled_all(new_version)
        finally:
            self._epoch.value = epoch
            pause.release()
        if error is not None:
            raise error

    async def _relabel(self, state: _RunState, epoch: int) -> None:
        """Label the native vLLM replicas with ``epoch`` (shielded, bounded by the
        resume's timeout; a failure only stops that replica stamping)."""
        native = self._native
        if native is None:
            return
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + RESUME_TIMEOUT
            await native.relabel(state.transport, state.native, epoch)

    # ----------------------------------------------------------------------- requests

    def _salt(self, body: dict[str, Any], epoch: int, continuation: int = 0) -> int | None:
        """Put the request's prefix-cache salt in ``body`` (see ``cache_salt``), for a
        call that starts (``continuation`` 0) or continues under the interface's
        ``epoch``; return the epoch ``kv_cache_epoch`` records, or ``None`` when it is
        unknown (no salt, or not the epoch salt)."""
        key = _SALT_FIELDS.get(self.server) if self.server is not None else None
        if key is None or key in self.extra_body:
            return None
        start = call_start_epoch.get(epoch)
        salt, kv_epoch = salt_of(self.cache_salt, self.run_id, start, epoch, continuation)
        if salt is None:
            body.pop(key, None)
        else:
            body[key] = salt
        return kv_epoch

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        """Send ``request`` to the replica :attr:`routing` picks, retrying transient
        failures (each retry picks again).

        Raises an :class:`InferenceError` subclass naming the URL, the status and the
        server's message; after retries, the last attempt's error, with a note counting
        the attempts. ``ValueError`` for tools with ``endpoint="completions"``. A replica
        that refuses a negotiated field gets the request again without it, within the
        same attempt (see the class docstring).

        While a weight update has paused the interface (:meth:`pause`), the call waits
        before sending anything; a call whose request the server aborted for the pause
        (``finish_reason == "abort"``) waits for :meth:`resume` and is continued from its
        partial output, and returns one response. The response's ``policy_epoch`` is the
        server's stamps when it sends them (vLLM's native route: its ``weight_versions``),
        else ``[(0, e)]`` with ``e`` the :attr:`policy_epoch` when the call started
        (after any wait). Its ``logprobs_mode`` is what :meth:`probe` found for the
        replica that served it (``"unknown"`` if never probed; a call never probes).

        Cancellation: cancellable at any point, including during a backoff wait and while
        held by a pause. A cancelled request releases its connection slot and its
        in-flight count before ``trio.Cancelled`` propagates; the server may still finish
        the generation, except on vLLM's native route, where the request is aborted by
        its id from a system task (best effort, without delaying the cancellation).
        """
        # The hot path, written out (a group's separate calls take _generate_one).
        if request.prompt_ids is None:
            body = self._request_body(request)
            path = _ENDPOINT_PATHS[self.endpoint]
        else:
            body = self._token_request_body(request)
            path = _ENDPOINT_PATHS["completions"]
        if self.priority:
            body["priority"] = call_start_epoch.get(self._epoch.value)
        state = self._state()
        pause = state.pause
        if pause.hold is not None:
            await pause.wait_resumed()
            state = self._state()  # aclose() during the pause closed the old transport
        epoch = self._epoch.value
        kv_epoch = self._salt(body, epoch)
        call = NativeCall(start_epoch=epoch) if self._native is not None else None
        server_pauses = pause.server_pauses
        if request.prompt_ids is None:
            (response,) = await self._attempt_with_retries(state, request, body, path, call=call)
        else:
            (response,) = await self._token_attempt(
                state, request, request.prompt_ids, body, path, call
            )
        _stamp_kv(response, kv_epoch)
        if response.finish_reason == ABORT and pause.server_pauses != server_pauses:
            response = await self._continue_aborted(state, request, body, path, response, call)
        if not response.policy_epoch:
            response.policy_epoch = [(0, epoch)]
        return response

    async def base_generate_group(
        self, request: InferenceRequest, n: int
    ) -> list[InferenceResponse]:
        """``n`` completions of ``request``, one response per choice, in choice order,
        from one replica (placed once for the whole group, see :attr:`routing`).

        With ``n == 1``, exactly :meth:`base_generate`. Else one request asking ``n``
        choices (``"n": n``) on the route the call takes (chat, completions, or vLLM's
        native route): the server prefills the prompt once. Each response is as
        :meth:`base_generate` returns one: its own ``token_ids``, ``logprobs``,
        ``finish_reason``, ``logprobs_mode`` and ``policy_epoch``, and ``usage`` for
        the choice alone (the prompt's tokens, the choice's completion tokens). A choice
        that a pause aborted waits for :meth:`resume` and is continued on its own (its
        own seed, as :meth:`base_generate` continues a call); the others are returned
        as they are.

        The group goes as ``n`` concurrent requests instead (each as
        :meth:`base_generate` makes one, on the group's replica) to a replica known not
        to take ``n``, and for a greedy request (``temperature`` 0: vLLM refuses ``n > 1``
        for greedy sampling). A replica that refuses ``n`` (400 or 422 naming it) or
        answers one choice is known from then on, for the interface's life (logged once
        per replica): this group's missing choices are sent separately (an answered
        choice is kept), and so are its later groups. The separate requests of a seeded
        group carry ``seed + i`` (:func:`~._sampling.choice_seed`), the seed vLLM gives
        choice ``i`` of a request with ``n``: the same ids either way.

        Raises as :meth:`base_generate`: the first failure of the group's requests, as
        itself (the others cancelled, and named in a note if they failed at once);
        :class:`MalformedResponseError` for a reply with more than ``n`` choices.

        Cancellation: cancellable at any point; a cancelled group leaves none of its
        requests running here (one nursery holds them all) and releases their
        connection slots and in-flight counts; on vLLM's native route each request is
        aborted by its id (one id for all the choices of a request), as by
        :meth:`base_generate`.
        """
        if n == 1:
            return [await self.base_generate(request)]
        body, path = self._body_and_path(request)
        group = _GroupCall()
        try:
            return await self._generate_group(request, body, path, n, group)
        finally:
            group.release()

    async def _generate_group(
        self,
        request: InferenceRequest,
        body: dict[str, Any],
        path: str,
        n: int,
        group: _GroupCall,
    ) -> list[InferenceResponse]:
        state = self._state()
        pause = state.pause
        if pause.hold is not None:
            await pause.wait_resumed()
            state = self._state()  # aclose() during the pause closed the old transport
        epoch = self._epoch.value
        kv_epoch = self._salt(body, epoch)
        server_pauses = pause.server_pauses
        answered: list[InferenceResponse] = []
        if body.get("temperature") != 0:
            call = NativeCall(start_epoch=epoch) if self._native is not None else None
            answered = await self._send(state, request, {**body, "n": n}, path, call, group, n)
            for response in answered:
                _stamp_kv(response, kv_epoch)
        responses: list[InferenceResponse | None] = [None] * n
        if group.replica is None:  # nothing sent yet: the separate requests go together
            group.place(state.placement, state.in_flight)

        async def continue_choice(choice: int, response: InferenceResponse) -> None:
            call = NativeCall(start_epoch=epoch) if self._native is not None else None
            body_of_choice = _choice_body(body, choice)
            response = await self._continue_aborted(
                state, request, body_of_choice, path, response, call, group
            )
            responses[choice] = _stamped(response, epoch)

        async def separate(choice: int) -> None:
            body_of_choice = _choice_body(body, choice)
            responses[choice] = await self._generate_one(request, body_of_choice, path, group)

        with flatten_exception_groups():  # a failure is raised as itself
            async with trio.open_nursery() as nursery:
                for choice, response in enumerate(answered):
                    if response.finish_reason == ABORT and pause.server_pauses != server_pauses:
                        nursery.start_soon(continue_choice, choice, response)
                    else:
                        responses[choice] = _stamped(response, epoch)
                for choice in range(len(answered), n):
                    nursery.start_soon(separate, choice)
        return [response for response in responses if response is not None]

    def _body_and_path(self, request: InferenceRequest) -> tuple[dict[str, Any], str]:
        """The request's body and path: its endpoint's, or ``/completions`` for an id
        prompt."""
        if request.prompt_ids is None:
            body, path = self._request_body(request), _ENDPOINT_PATHS[self.endpoint]
        else:
            body, path = self._token_request_body(request), _ENDPOINT_PATHS["completions"]
        if self.priority:
            body["priority"] = call_start_epoch.get(self._epoch.value)
        return body, path

    async def _generate_one(
        self,
        request: InferenceRequest,
        body: dict[str, Any],
        path: str,
        group: _GroupCall | None = None,
    ) -> InferenceResponse:
        """One completion of ``body`` as :meth:`base_generate` makes it (held while paused,
        continued after a pause's abort, stamped with the epoch it started under unless
        the server stamped it), on ``group``'s replica."""
        state = self._state()
        pause = state.pause
        if pause.hold is not None:
            await pause.wait_resumed()
            state = self._state()  # aclose() during the pause closed the old transport
        epoch = self._epoch.value
        kv_epoch = self._salt(body, epoch)
        call = NativeCall(start_epoch=epoch) if self._native is not None else None
        server_pauses = pause.server_pauses
        (response,) = await self._send(state, request, body, path, call, group)
        _stamp_kv(response, kv_epoch)
        if response.finish_reason == ABORT and pause.server_pauses != server_pauses:
            response = await self._continue_aborted(
                state, request, body, path, response, call, group
            )
        return _stamped(response, epoch)

    async def _send(
        self,
        state: _RunState,
        request: InferenceRequest,
        body: dict[str, Any],
        path: str,
        call: NativeCall | None,
        group: _GroupCall | None = None,
        n: int = 1,
    ) -> list[InferenceResponse]:
        """``body`` sent with its retries: one response, or for ``n > 1`` one per choice
        the replica answered (none if it does not take ``n``)."""
        if request.prompt_ids is None:
            return await self._attempt_with_retries(
                state, request, body, path, call=call, group=group, n=n
            )
        return await self._token_attempt(
            state, request, request.prompt_ids, body, path, call, group, n
        )

    async def _continue_aborted(
        self,
        state: _RunState,
        request: InferenceRequest,
        body: dict[str, Any],
        path: str,
        response: InferenceResponse,
        call: NativeCall | None = None,
        group: _GroupCall | None = None,
    ) -> InferenceResponse:
        """Continue a response that a pause aborted, after :meth:`resume`, from its
        partial output, until it finishes for another reason (each pause that aborts it
        again adds a segment); one response. (A group's aborted choice: ``body`` is the
        choice's, without ``n``, and the continuation goes to the group's replica.)

        With token ids (the default with vLLM and SGLang) the continuation is exact: a
        ``/v1/completions`` request whose prompt is the ids so far
        (:func:`token_continuation_body`), checked against the prompt ids the server
        echoes. Without them, it resends the text (:func:`continuation_body`). The
        ``k``-th continuation of a seeded request gets its own seed
        (:func:`~._sampling.continuation_seed`)."""
        pause = state.pause
        server = self.server
        merged = response
        continuations = 0
        while merged.finish_reason == ABORT:
            await pause.wait_resumed()
            state = self._state()  # aclose() during the pause closed the old client
            if server is None:  # pragma: no cover - only a server-side pause aborts
                break
            server_pauses = pause.server_pauses
            if merged.token_ids is not None:
                continued = token_continuation_body(body, merged)
                endpoint: Literal["chat", "completions"] = "completions"
            else:
                continued = continuation_body(
                    server, self.endpoint, body, merged, merged.response.content
                )
                endpoint = self.endpoint
            if continued is None:  # max_tokens used up before the abort
                return attrs.evolve(merged, finish_reason="length")
            continuations += 1
            continued = seed_continuation(continued, body, continuations)
            epoch = self._epoch.value
            # Salted with the epoch it continues under: its prefix is computed again.
            kv_epoch = self._salt(continued, epoch, continuations)
            (segment,) = await self._attempt_with_retries(
                state,
                request,
                continued,
                _ENDPOINT_PATHS[endpoint],
                endpoint,
                call=call,
                group=group,
            )
            _stamp_kv(segment, kv_epoch)
            if merged.policy_epoch and not segment.policy_epoch and generated_tokens(segment):
                # A stamped call continued on a replica that does not stamp: its new
                # tokens were sampled after the resume, under the epoch it set.
                segment.policy_epoch = [(0, epoch)]
            if merged.token_ids is not None:
                self._check_echo(merged.token_ids, segment, "continued an aborted request")
            merged = merge_continuation(merged, segment)
            if merged.finish_reason == ABORT and pause.server_pauses == server_pauses:
                break  # aborted by something else than a pause: the caller sees it
        return merged

    def _check_echo(self, ids: list[int], segment: InferenceResponse, what: str) -> None:
        """A token-id prompt's echoed ids must be the ids sent: else the rollout would
        claim a context the server did not generate from (:class:`TokenMismatchError`)."""
        if segment.token_ids is None or segment.prompt_length is None:
            return  # no ids back: the merged response has none either
        echoed = segment.token_ids[: segment.prompt_length]
        if echoed != ids:
            first = next(
                (i for i, (a, b) in enumerate(zip(echoed, ids, strict=False)) if a != b),
                min(len(echoed), len(ids)),
            )
            msg = (
                f"{self.server or 'the server'} ({', '.join(self._shown_urls)}) {what} "
                "from other tokens than it was sent (it re-tokenized them): its "
                f"prompt_token_ids ({len(echoed)} ids) differ from the {len(ids)} ids sent, "
                "first at index "
                f"{first}; the rollout would not be the tokens the model saw"
            )
            raise TokenMismatchError(msg, sent=list(ids), echoed=echoed, index=first)

    async def _token_attempt(
        self,
        state: _RunState,
        request: InferenceRequest,
        ids: list[int],
        body: dict[str, Any],
        path: str,
        call: NativeCall | None = None,
        group: _GroupCall | None = None,
        n: int = 1,
    ) -> list[InferenceResponse]:
        """Send a token-id prompt to ``/v1/completions`` (``path``), or vLLM's native route;
        each response must carry the token ids, and the prompt ids it echoes must be the
        ones sent."""
        try:
            responses = await self._attempt_with_retries(
                state, request, body, path, "completions", call=call, group=group, n=n
            )
        except BadRequestError as error:
            if isinstance(error, UnsupportedFieldError):
                raise
            msg = (
                f"{error.url or self._shown_urls[0]} refused a token-id prompt "
                "(InferenceRequest.prompt_ids, sent as /v1/completions 'prompt': [ids]): "
                f"{error}; use a server that takes token prompts (vLLM, SGLang), or send "
                "the request without prompt_ids (OpenAIInference(token_prompts=False) "
                "for a server that renders chats only: MultiTurnAgent then sends it the "
                "conversation)"
            )
            raise UnsupportedFieldError(
                msg,
                fields=("prompt",),
                url=error.url,
                status=error.status,
                server_message=error.server_message,
            ) from error
        for response in responses:
            if response.token_ids is None or response.prompt_length is None:
                msg = (
                    f"{self._shown_urls[0]} returned no token ids for a token-id prompt "
                    "(InferenceRequest.prompt_ids needs the generated ids: the server must "
                    "honour return_token_ids, as vLLM and SGLang do; for a server that does "
                    "not, use OpenAIInference(token_prompts=False))"
                )
                raise UnsupportedFieldError(msg, fields=("return_token_ids",))
            self._check_echo(ids, response, "generated")
        return responses

    def _token_request_body(self, request: InferenceRequest) -> dict[str, Any]:
        """A ``/v1/completions`` body whose prompt is ``request.prompt_ids``, exactly: no
        chat template, no tools (they are in the ids). Token ids are always asked for:
        the response must carry the generated ids."""
        flags: dict[str, Any] = {"return_token_ids": True}
        if self.return_logprobs is not False:
            flags["logprobs"] = 1
        return {
            **flags,
            **self.extra_body,
            "model": self.model,
            "prompt": list(request.prompt_ids or []),
            **request.generation_args.set_fields(),
        }

    async def _attempt_with_retries(
        self,
        state: _RunState,
        request: InferenceRequest,
        body: dict[str, Any],
        path: str,
        endpoint: Literal["chat", "completions"] | None = None,
        *,
        call: NativeCall | None = None,
        group: _GroupCall | None = None,
        n: int = 1,
    ) -> list[InferenceResponse]:
        """One request and its retries (counted in the run's statistics): its responses
        (see :meth:`_attempt`). With ``call`` (``server="vllm"``), an attempt may go to
        the replica's native route. With ``group``, to the group's replica; a retry
        chooses again, and the group's later requests follow it."""

        retried = False

        def count_retry(error: InferenceError) -> None:
            nonlocal retried
            state.counts.count_retry(error, first=not retried)
            retried = True
            if group is not None:
                group.replica = None

        endpoint = endpoint or self.endpoint
        if group is None and state.placement.replicas == 1:  # nothing to place
            attempt = functools.partial(
                self._attempt_on, state, 0, request, body, path, endpoint, call, n
            )
        else:
            attempt = functools.partial(
                self._attempt, state, request, body, path, endpoint, call, group, n
            )
        return await call_with_retries(
            attempt,
            max_retries=self.max_retries,
            backoff=self.backoff,
            on_retry=count_retry,
        )

    def _request_body(self, request: InferenceRequest) -> dict[str, Any]:
        flags: dict[str, Any] = {}
        required: dict[str, Any] = {"model": self.model}
        if self.endpoint == "chat":
            if self.return_logprobs is not False:
                # top_logprobs too: llama-cpp-python's server answers null logprobs without
                # it; 1, not 0, as its completions path treats 0 as "no logprobs". It goes
                # with logprobs: dropped for a replica that refuses logprobs.
                flags["logprobs"] = True
                flags["top_logprobs"] = 1
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

    async def _attempt(
        self,
        state: _RunState,
        request: InferenceRequest,
        body: dict[str, Any],
        path: str,
        endpoint: Literal["chat", "completions"],
        call: NativeCall | None = None,
        group: _GroupCall | None = None,
        n: int = 1,
    ) -> list[InferenceResponse]:
        """One attempt on the replica :attr:`routing` picks for the calling task's group
        and episode (:func:`~._placement.current_call`), given the requests in flight on
        each; the pick is released when the attempt ends. With ``group``: on the group's
        replica, picked by its first attempt and released when the group ends."""
        placement = state.placement
        if group is not None:
            index = group.replica
            if index is None:
                index = group.place(placement, state.in_flight)
        elif placement.replicas == 1:
            index = 0
        else:
            key, episode = current_call()
            index = placement.pick(state.in_flight, key, episode)
            try:
                return await self._attempt_on(state, index, request, body, path, endpoint, call, n)
            finally:
                placement.release(key, index)
        return await self._attempt_on(state, index, request, body, path, endpoint, call, n)

    async def _attempt_on(
        self,
        state: _RunState,
        index: int,
        request: InferenceRequest,
        body: dict[str, Any],
        path: str,
        endpoint: Literal["chat", "completions"],
        call: NativeCall | None = None,
        n: int = 1,
    ) -> list[InferenceResponse]:
        """One attempt: ``body`` to replica ``index``, sent again at once without any
        negotiable field that the replica refuses (not a retry). With ``call``, to the
        replica's native vLLM route when it may serve it (a replica that refuses it falls
        back, in the same attempt).

        One response; for ``n > 1`` (``body`` asks ``n`` choices) one per choice the
        replica answered, none when it does not take ``n``: known before, or learned now
        from a refusal naming ``n``. One choice answered teaches the same (after this
        attempt). More than ``n`` is a :class:`MalformedResponseError`."""
        # Outstanding from the pick to the answer (native first contact, refusals sent
        # again and all): the load the next pick reads.
        state.in_flight[index] += 1
        try:
            capabilities = self._capabilities
            if n > 1 and not capabilities.takes_n[index]:
                return []
            native = self._native
            if native is not None and call is not None and native.takes(index, body):
                try:
                    answered = await self._native_attempt(
                        state, native, index, request, body, call, n
                    )
                except BadRequestError as refusal:
                    message = refusal.server_message or ""
                    if n > 1 and refusal.status in (400, 422) and _names_n(None, message):
                        capabilities.stop_n(
                            index, self._shown_urls[index], f"refused n ({message})"
                        )
                        return []
                    raise
                if answered is not None:
                    return self._choices_answered(index, answered, n)
            url = self.base_url[index] + path
            shown = self._shown_urls[index] + path
            sent = body

            def content() -> bytes:
                # Built when the transport is about to write it (it holds a connection), so a
                # field that this replica refused while the request waited is left out.
                nonlocal sent
                sent = capabilities.without_dropped(index, body)
                return encode_json(sent)

            while True:
                state.attempts[index] += 1
                state.choices[index] += n
                response = await state.transport.post(url, shown, content)
                if 200 <= response.status_code < 300:
                    mode = self._probe_cache.mode(index)
                    if n == 1:
                        parsed = parse_completion(
                            endpoint, request, sent, response, shown, self.api_key
                        )
                        parsed.logprobs_mode = mode
                        self._sglang_stamps(index, response, [parsed])
                        return [self._check_returned(index, sent, parsed)]
                    choices = parse_choices(endpoint, request, sent, response, shown, self.api_key)
                    for parsed in choices:
                        parsed.logprobs_mode = mode
                    self._sglang_stamps(index, response, choices)
                    checked = [self._check_returned(index, sent, parsed) for parsed in choices]
                    return self._choices_answered(index, checked, n)
                said = server_message(response)
                refused = self._refused_negotiable(response, sent, said)
                if not refused:
                    message, data = said
                    if n > 1 and response.status_code in (400, 422) and _names_n(data, message):
                        why = f"refused n ({redact(message, self.api_key)[:200]})"
                        capabilities.stop_n(index, self._shown_urls[index], why)
                        return []
                    error = self._status_error(request, response, index, path, sent, said)
                    if response.status_code == 404 and "model" in message.lower():
                        error = await self._name_served_models(state, index, shown, response, error)
                    raise error
                # Each pass drops at least one field that was sent, so this loop ends.
                capabilities.drop(index, refused, self._shown_urls[index])
        finally:
            state.in_flight[index] -= 1

    def _sglang_stamps(
        self, index: int, response: Response, parsed: list[InferenceResponse]
    ) -> None:
        """With ``server="sglang"``: each choice's ``policy_epoch`` from the weight
        versions SGLang stamped on its tokens (``_sglang.py``), unless the server sent
        its own stamps."""
        versions = self._sglang
        if versions is None:
            return
        spans = reply_spans(response.json(), len(parsed))
        for choice, spans_of_choice in zip(parsed, spans, strict=True):
            if not choice.policy_epoch and generated_tokens(choice) != 0:
                choice.policy_epoch = versions.boundaries(index, spans_of_choice)

    def _choices_answered(
        self, index: int, answered: list[InferenceResponse], n: int
    ) -> list[InferenceResponse]:
        """The choices replica ``index`` answered to a request for ``n``; one for
        ``n > 1`` means it ignores ``n`` (remembered), more than ``n`` is malformed."""
        if n > 1 and len(answered) == 1:
            self._capabilities.stop_n(
                index, self._shown_urls[index], f"answered one choice to a request for n={n}"
            )
        elif len(answered) > n:
            shown = self._shown_urls[index]
            msg = f"{shown} answered {len(answered)} choices to a request for n={n}"
            raise MalformedResponseError(msg, url=shown)
        return answered

    async def _native_attempt(
        self,
        state: _RunState,
        native: VLLMNative,
        index: int,
        request: InferenceRequest,
        body: dict[str, Any],
        call: NativeCall,
        n: int = 1,
    ) -> list[InferenceResponse] | None:
        """``body`` on replica ``index``'s native route, counted as an attempt (a refusal
        too: it was sent): a response per choice; ``None`` if the replica does not serve
        it."""
        # Labelled first, outside the counts: the label is not a generation request.
        await native.first_contact(state.transport, state.native, index)
        sent = self._capabilities.without_dropped(index, body)
        state.attempts[index] += 1
        state.choices[index] += n
        responses = await native.generate(state.transport, state.native, index, request, sent, call)
        if responses is None:
            return None
        # Token ids not asked (return_token_ids=False): the response is what the OpenAI
        # route would give, without them, though the native reply has them.
        strip = not sent.get("return_token_ids") and not isinstance(sent.get("prompt"), list)
        mode = self._probe_cache.mode(index)
        checked = []
        for response in responses:
            if strip:
                response = attrs.evolve(response, token_ids=None, prompt_length=None)
            response.logprobs_mode = mode
            checked.append(self._check_returned(index, sent, response))
        return checked

    def _check_returned(
        self, index: int, sent: dict[str, Any], response: InferenceResponse
    ) -> InferenceResponse:
        """What was asked must be in the response: a field sent but answered without
        (a server that ignores it) raises under the strict option (``True``) and is
        warned about once per replica under negotiation (``None``); logprobs that are not
        one per generated token are dropped (strict: raised)."""
        replica = self._shown_urls[index]
        generated = generated_tokens(response)
        # Nothing generated (or aborted before the first token): nothing to carry.
        nothing = generated == 0 or (
            generated is None and response.finish_reason == ABORT and not response.response.content
        )
        for field, option, present in (
            ("return_token_ids", self.return_token_ids, response.token_ids is not None),
            ("logprobs", self.return_logprobs, response.logprobs is not None),
        ):
            if field not in sent or present or nothing or option is False:
                continue
            what = _WHAT[field]
            name, flag = NEGOTIABLE_FIELDS[field]
            if option is True:
                msg = (
                    f"{replica} accepted {field} but returned no {what}: the server ignores "
                    f"the field, and {name}=True (CLI: {flag.replace('--no-', '--')}) requires "
                    f"{what} in every response; use a server that returns them (vLLM, SGLang), "
                    f"or {name}=None to take responses without them (CLI: leave the flag "
                    f"out) or {name}=False to not ask (CLI: {flag})"
                )
                raise UnsupportedFieldError(msg, url=replica, fields=(field,))
            self._capabilities.warn_once(
                index,
                f"ignored {field}",
                "%s accepted the request field %r but returned no %s: rollouts from this "
                "replica carry no %s (set %s=False to not ask, or %s=True to fail instead)",
                replica,
                field,
                what,
                what,
                name,
                name,
            )
        logprobs = response.logprobs
        if logprobs is not None and generated is not None and len(logprobs) != generated:
            counted = "token ids" if response.token_ids is not None else "usage.completion_tokens"
            if self.return_logprobs is True:
                msg = (
                    f"{replica} returned {len(logprobs)} log-probabilities for {generated} "
                    f"generated tokens (by its {counted}): they are not one per token (llama.cpp's "
                    "llama-server merges a character's byte tokens into one entry), and "
                    "return_logprobs=True (CLI: --logprobs) requires them; use "
                    "return_logprobs=None to take such responses without logprobs"
                )
                raise MalformedResponseError(msg, url=replica)
            self._capabilities.warn_once(
                index,
                "logprob count",
                "%s returned %d log-probabilities for %d generated tokens (by its %s); they "
                "do not line up with the tokens, so its responses are kept without logprobs",
                replica,
                len(logprobs),
                generated,
                counted,
            )
            response = attrs.evolve(response, logprobs=None)
        return response

    async def _name_served_models(
        self,
        state: _RunState,
        index: int,
        shown: str,
        response: Response,
        error: InferenceError,
    ) -> InferenceError:
        """For a 404 about the model: the error naming the models the replica serves
        (``GET {base_url}/models``, once per run and replica), or ``error`` itself when
        they cannot be had or include ``model``. The server's text stays in
        ``server_message``."""
        root = self._shown_urls[index]
        served = await state.models.names(
            state.transport, index, self.base_url[index] + "/models", root + "/models"
        )
        said = None if served is None else model_not_served(self.model, root, served)
        if said is None:
            return error
        status = f"{response.status_code} {response.reason_phrase}".rstrip()
        return type(error)(
            f"POST {shown} returned {status}: {said}",
            url=error.url,
            status=error.status,
            server_message=error.server_message,
            retry_after=error.retry_after,
        )

    def _options(self) -> dict[str, bool | None]:
        """Each negotiable field's option; a field given in ``extra_body`` is explicit."""
        options = {"return_token_ids": self.return_token_ids, "logprobs": self.return_logprobs}
        return {
            field: True if field in self.extra_body else option for field, option in options.items()
        }

    def _refused_negotiable(
        self, response: Response, sent: dict[str, Any], said: tuple[str, object]
    ) -> set[str]:
        """The negotiable fields that ``sent`` carried and this 400/422 names."""
        if response.status_code not in (400, 422):
            return set()
        candidates = {
            field for field, option in self._options().items() if option is None
        } & sent.keys()
        if not candidates:
            return set()
        message, data = said
        return refused_negotiable(data, message, candidates, sent)

    def _status_error(
        self,
        request: InferenceRequest,
        response: Response,
        index: int,
        path: str,
        sent: dict[str, Any],
        said: tuple[str, object],
    ) -> InferenceError:
        shown = self._shown_urls[index] + path
        status = response.status_code
        message, data = said
        if status in (400, 422):
            named = self._named_explicit(request, message, data, sent, index)
            refused = tuple(sorted(field for field, (_, is_refused) in named.items() if is_refused))
            hint = ""
            if named:
                hint = "; " + redact("; ".join(hint for hint, _ in named.values()), self.api_key)
            if refused:
                return error_for_status(
                    response,
                    shown,
                    self.api_key,
                    hint,
                    said=said,
                    cls=UnsupportedFieldError,
                    fields=refused,
                )
            return error_for_status(response, shown, self.api_key, hint, said=said)
        if status in (401, 403):
            hint = " (check api_key or OPENAI_API_KEY)"
        elif status in (404, 405):
            hint = self._api_root_hint(index, path, message)
        elif status < 400:
            hint = " (an unexpected status: is base_url the API root, such as '.../v1'?)"
        else:
            hint = ""
        return error_for_status(response, shown, self.api_key, hint, said=said)

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
        segments = httpx2.URL(self.base_url[index]).path.strip("/").split("/")
        if not VERSION_SEGMENT.fullmatch(segments[-1]):
            versions = [
                i for i, segment in enumerate(segments) if VERSION_SEGMENT.fullmatch(segment)
            ]
            if versions:  # '.../v1/models': the root is the URL up to its version segment
                cut = "/" + "/".join(segments[versions[-1] + 1 :])
                suggested = root.removesuffix(cut)
            else:
                suggested = f"{root}/v1"
            return (
                f" (is base_url the API root, such as '{suggested}'? {root!r} does not end "
                "in a version segment)"
            )
        if "model" in message.lower():
            return ""  # api.openai.com answers 404 for an unknown model: its message says so
        return (
            f" (is base_url the API root of an OpenAI-compatible server, and does it serve "
            f"{path} (endpoint={self.endpoint!r})?)"
        )


# --------------------------------------------------------------------------- helpers


_WHAT = {"return_token_ids": "token ids", "logprobs": "log-probabilities"}


def _message_json(message: ChatMessage) -> dict[str, Any]:
    # Extra keys (tool_calls, tool_call_id, name) pass through; role and content win.
    return {**message.extra, "role": message.role, "content": message.content}


@attrs.define(eq=False)
class _GroupCall:
    """The replica every request of one group call goes to: picked by its first attempt;
    a retry picks again, and the group's later requests follow it. Its picks are
    released when the group ends."""

    replica: int | None = None
    picks: list[tuple[Placement, tuple[int, int, int] | None, int]] = attrs.field(factory=list)

    def place(self, placement: Placement, load: Sequence[int]) -> int:
        """Pick the group's replica for the calling task's group and episode."""
        if placement.replicas == 1:
            self.replica = 0
            return 0
        key, episode = current_call()
        self.replica = index = placement.pick(load, key, episode)
        self.picks.append((placement, key, index))
        return index

    def release(self) -> None:
        for placement, key, index in self.picks:
            placement.release(key, index)
        self.picks.clear()


def _choice_body(body: dict[str, Any], choice: int) -> dict[str, Any]:
    """The body of a group's choice ``choice`` sent on its own: ``body`` with the
    choice's seed (:func:`~._sampling.choice_seed`) when it has one."""
    seed = body.get("seed")
    if choice == 0 or not isinstance(seed, int) or isinstance(seed, bool):
        return body
    return {**body, "seed": choice_seed(seed, choice)}


def _stamp_kv(response: InferenceResponse, epoch: int | None) -> None:
    """Record that the KV ``response``'s tokens attended to was computed at or after
    ``epoch`` (the epoch of its salt; ``None``: unknown), unless the server said."""
    if epoch is not None and not response.kv_cache_epoch:
        response.kv_cache_epoch = [(0, epoch)]


def _stamped(response: InferenceResponse, epoch: int) -> InferenceResponse:
    """``response`` stamped ``[(0, epoch)]`` (the epoch its call started under) when the
    server stamped nothing."""
    if not response.policy_epoch:
        response.policy_epoch = [(0, epoch)]
    return response


def _names_n(data: object, message: str) -> bool:
    """Whether a 400/422 body names the ``n`` field (a refusal of several choices)."""
    return bool(named_fields(data, message, ("n",)))
