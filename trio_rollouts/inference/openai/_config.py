"""What an :class:`~trio_rollouts.inference.OpenAIInference` is configured with: its
constructor arguments, their checks and defaults, and what follows from them alone
(:class:`OpenAIConfig`, the frozen base of the client).

Nothing here sends a request or learns anything; the client (:mod:`._client`) adds the
request's life, and the modules it drives read the configuration through this class, so
none of them needs the client's type.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal

import attrs
import httpx2

from trio_rollouts._checks import check_bool, int_at_least, is_real
from trio_rollouts._messages import ChatMessage
from trio_rollouts.inference._config import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_TIMEOUT,
    KEEPALIVE_EXPIRY,
    Limits,
    Timeout,
)
from trio_rollouts.inference._interface import render_plain_chat
from trio_rollouts.inference._placement import DEFAULT_ROUTING_MARGIN, Routing, check_routing
from trio_rollouts.inference._retry import RetryBackoff
from trio_rollouts.inference._salt import CacheSalt, check_cache_salt, new_run_id
from trio_rollouts.inference.http._transport import proxied

__all__ = [
    "DEFAULT_MAX_RETRIES",
    "ENDPOINT_PATHS",
    "SERVER_KINDS",
    "OpenAIConfig",
    "ServerKind",
    "display_url",
]

#: Retries after the first attempt, on :data:`TRANSIENT_ERRORS` only.
DEFAULT_MAX_RETRIES: Final = 3

#: The servers whose dialects :class:`OpenAIInference` speaks (``server=``).
ServerKind = Literal["vllm", "sglang"]
SERVER_KINDS: Final[tuple[ServerKind, ...]] = ("vllm", "sglang")

#: The path of each endpoint below ``base_url``.
ENDPOINT_PATHS: Final = {"chat": "/chat/completions", "completions": "/completions"}


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
            msg = f"base_url {display_url(url)!r} is not a valid URL: {exc}"
            raise ValueError(msg) from exc
        if parsed.scheme not in ("http", "https") or not parsed.host:
            msg = (
                f"base_url must be an http(s) URL including the API prefix, such as "
                f"'http://127.0.0.1:8000/v1', got {display_url(url)!r}"
            )
            raise ValueError(msg)
        normalized = url.rstrip("/")
        _refuse_endpoint_url(normalized)
        if normalized in result:
            msg = f"base_url lists {display_url(url)!r} twice; give each replica once"
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
            root = display_url(url.removesuffix(suffix))
            with_endpoint = "" if endpoint == "chat" else ", endpoint='completions'"
            msg = (
                f"base_url {display_url(url)!r} is the URL of an endpoint, not the API root: "
                f"use base_url={root!r}{with_endpoint} (the client posts to "
                f"base_url + {suffix!r} for endpoint={endpoint!r})"
            )
            raise ValueError(msg)


def display_url(url: str) -> str:
    """The URL without user credentials, for messages."""
    try:
        return str(httpx2.URL(url).copy_with(username=None, password=None))
    except (httpx2.InvalidURL, TypeError, ValueError):
        return "<unparsable URL>"


def _repr_urls(urls: tuple[str, ...]) -> str:
    return repr(tuple(display_url(url) for url in urls))


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


def _check_priority(instance: OpenAIConfig, attribute: attrs.Attribute[Any], value: object) -> None:
    check_bool(instance, attribute, value)
    if value and instance.server != "vllm":
        msg = (
            f"priority=True needs server='vllm' (got server={instance.server!r}): only vLLM "
            "takes a request priority (with --scheduling-policy priority)"
        )
        raise ValueError(msg)


@attrs.frozen(kw_only=True, eq=False)
class OpenAIConfig:
    """The configuration of an :class:`~trio_rollouts.inference.OpenAIInference`: its
    constructor arguments, checked, and what follows from them alone. Frozen.

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
    #: The replicas as shown in errors and statistics (no credentials), parsed once.
    shown_urls: tuple[str, ...] = attrs.field(
        init=False,
        repr=False,
        default=attrs.Factory(
            lambda self: tuple(display_url(url) for url in self.base_url), takes_self=True
        ),
    )

    @property
    def limits(self) -> Limits:
        """The connection :class:`Limits`: ``limits`` as given, else ``max_connections``
        in total, as many kept alive, idle ones closed after 5 s."""
        if self._given_limits is not None:
            return self._given_limits
        return Limits(max_connections=self.max_connections, keepalive_expiry=KEEPALIVE_EXPIRY)

    @property
    def uses_lean_transport(self) -> bool:
        """Whether requests go through the lean HTTP/1.1 pool (``transport="lean"``, or
        ``"auto"`` with no proxy configured for the replicas) rather than httpx2."""
        if self.transport == "auto":
            return not proxied(self.base_url)
        return self.transport == "lean"
