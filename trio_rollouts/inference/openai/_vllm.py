"""vLLM's RL interface: the native generate route, weight-version labels, aborts by request
id, and the probe of how a replica samples.

With ``--enable-scale-out``, vLLM (0.32) serves ``POST /inference/v1/generate`` at the
server's root (``base_url`` without ``/v1``)::

    {"request_id": "trio-rollouts-<hex>", "model": "...", "token_ids": [...],
     "sampling_params": {"temperature": 1.0, "max_tokens": 64, "seed": 7, "logprobs": 1},
     "return_token_ids": true, "output_mode": "text"}

and answers with the rewritten request id (``"generate-tokens-<the id sent>"``), the
prompt's ids (``prompt_token_ids``, with ``return_token_ids``), ``usage`` and one choice
per sample: ``token_ids``, ``text`` (with ``output_mode: "text"``), ``logprobs.content[*]``
(``logprob`` per generated token), ``finish_reason``, ``sampling_mask`` (GPU model runner
with ``--return-sampling-mask`` only) and ``weight_versions``: ``[{"version", "start",
"end"}]`` spans over the generated tokens, labelled by ``POST /update_weight_version
{"new_version": "<str>"}`` (mounted with ``VLLM_SERVER_DEV_MODE=1``; accepted while
paused; a fresh server labels ``"default"``, and a label outlives its clients). Without
``--enable-scale-out`` the route answers **403** ("Scale-out endpoints are disabled").
``POST /inference/v1/abort_requests {"request_ids": [...]}`` aborts requests by their
*rewritten* id (the id as sent aborts nothing). Unknown ``sampling_params`` keys are
ignored silently.

``sampling_params.n`` works there as on the OpenAI routes (measured on 0.32): the reply
has ``n`` choices (``index`` 0 to ``n - 1``), each with its own ``token_ids``, ``text``,
``logprobs``, ``finish_reason`` and ``weight_versions``; ``prompt_token_ids`` once, and
``usage`` for the whole request (the prompt once, the choices' completion tokens added).
A seeded request samples choice ``i`` with ``seed + i``, the same ids as a request of
its own with that seed. The engine schedules the choices as ``n`` sequences sharing the
prompt's KV blocks; aborting the rewritten id aborts them all, and a pause with
``mode=abort`` ends each with its partial output. It answers 400 for ``n`` above the
server's ``--max-num-seqs`` (``"sampling_params.n must be at most the server's
max_num_seqs (16), got 17."``) and, like every route, for ``n > 1`` with greedy
sampling (``"n must be 1 when using greedy sampling, got 3."``).

:class:`VLLMNative` is what :class:`~trio_rollouts.inference.OpenAIInference` with
``server="vllm"`` uses: it turns the body the interface built for an OpenAI route into a
native request (the prompt as ids, text prompts rendered by the server's ``/tokenize``),
labels each replica with the interface's epoch at first contact and at every resume,
turns ``weight_versions`` into ``policy_epoch`` boundaries, and sends ``abort_requests``
from a system task when a call is cancelled. What it learns about each replica is kept on
the interface for its life (:class:`NativeReplicas`), like what negotiation learns
(:mod:`._negotiation`); what belongs to one Trio run (locks, pending aborts) is in
:class:`NativeRun`.

:class:`ProbeCache` and :func:`probe_logprobs_mode` are the probe
(:meth:`OpenAIInference.probe`): which log-probabilities a replica returns.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Final, Literal, TypeGuard

import attrs
import trio

from trio_rollouts.inference._errors import (
    TRANSIENT_ERRORS,
    InferenceConnectionError,
    InferenceError,
    InferenceTimeoutError,
    MalformedResponseError,
)
from trio_rollouts.inference._interface import (
    InferenceRequest,
    InferenceResponse,
    render_plain_chat,
)
from trio_rollouts.inference._retry import RetryBackoff, call_with_retries
from trio_rollouts.inference._sampling import LogprobsMode, ReplicaProbe
from trio_rollouts.inference.http._transport import Transport, encode_json
from trio_rollouts.inference.openai._negotiation import Capabilities
from trio_rollouts.inference.openai._parse import (
    BadField,
    Response,
    all_choices,
    choice_usage,
    error_for_status,
    first_choice,
    read_json,
    server_message,
)
from trio_rollouts.models._messages import ChatMessage

__all__ = [
    "ABORT_PATH",
    "GENERATE_PATH",
    "LABEL_PATH",
    "OPENAI_ROUTE_ONLY",
    "NativeCall",
    "NativeReplicas",
    "NativeRun",
    "ProbeCache",
    "ProbeKind",
    "ProbeRun",
    "Unreachable",
    "VLLMNative",
    "policy_boundaries",
    "probe_logprobs_mode",
]

logger = logging.getLogger(__name__)

#: The native routes, below the server's root.
GENERATE_PATH: Final = "/inference/v1/generate"
ABORT_PATH: Final = "/inference/v1/abort_requests"
LABEL_PATH: Final = "/update_weight_version"
TOKENIZE_PATH: Final = "/tokenize"
DETOKENIZE_PATH: Final = "/detokenize"

#: The server flag that mounts the native routes.
SCALE_OUT_FLAG: Final = "--enable-scale-out"
#: What vLLM 0.32 puts before the request id it was sent (the id ``abort_requests`` takes).
REWRITTEN_PREFIX: Final = "generate-tokens-"
#: Statuses that mean "this route is not served here": vLLM's 403 without
#: ``--enable-scale-out``, a 404 or 405 from a server without the route, a 501.
NOT_SERVED: Final = frozenset({403, 404, 405, 501})
#: How long the abort of a cancelled request may take; it never delays the cancellation.
ABORT_TIMEOUT: Final = 5.0
#: Prefix of the request ids sent.
REQUEST_ID_PREFIX: Final = "trio-rollouts-"

#: Fields of an OpenAI body that are not sampling parameters: the prompt in its OpenAI
#: forms, what the client asks of the reply (the native reply always has token ids;
#: logprobs become ``sampling_params.logprobs``) and options of the OpenAI routes only.
#: (``n``, which only a group call sets, is one: ``sampling_params.n``.)
_NOT_SAMPLING: Final = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "tools",
        "tool_choice",
        "stream",
        "stream_options",
        "return_token_ids",
        "logprobs",
        "top_logprobs",
        "echo",
        "user",
    }
)
#: Fields that say how a text prompt becomes ids: they go to ``/tokenize``.
_RENDER_FIELDS: Final = frozenset(
    {
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "chat_template_kwargs",
        "add_special_tokens",
        "mm_processor_kwargs",
        "media_io_kwargs",
    }
)
#: Fields of vLLM's generate request itself, beside ``sampling_params``.
_REQUEST_FIELDS: Final = frozenset({"priority", "cache_salt", "kv_transfer_params"})
#: Options of the OpenAI routes that change what is generated but that vLLM's
#: ``SamplingParams`` does not take under that name (it would ignore them silently): a
#: request with one keeps the OpenAI route, where it is honoured.
OPENAI_ROUTE_ONLY: Final = frozenset(
    {
        "response_format",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
        "structural_tag",
        "max_completion_tokens",
        "logits_processors",
        "vllm_xargs",
        "reasoning_effort",
        "use_beam_search",
        "best_of",
        "length_penalty",
        "echo",
        "suffix",
    }
)


def new_request_id() -> str:
    """A request id unique to one request (each attempt and continuation gets its own)."""
    return f"{REQUEST_ID_PREFIX}{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- the record


@attrs.define(eq=False)
class ReplicaState:
    """What the interface knows about one replica's native route, over its life.

    ``native``: ``None`` until a native request was answered or refused. ``labelled``:
    ``None`` until the first-contact label was answered; ``False`` when the replica does
    not take labels (no ``VLLM_SERVER_DEV_MODE=1``). ``labels``: every label this
    interface set on it, with its epoch. ``stale``: a later label failed, so the server
    may carry an old one. ``foreign``: a reply carried a label this interface did not set.
    """

    native: bool | None = None
    renders: bool = True  # serves /tokenize (text prompts go native)
    contacted: bool = False
    labelled: bool | None = None
    label: str | None = None
    labels: dict[str, int] = attrs.field(factory=dict)
    stale: bool = False
    foreign: bool = False
    unstamped: bool = False  # replies without weight_versions
    id_prefix: str = REWRITTEN_PREFIX
    sampling_mask: bool = False

    @property
    def stamps(self) -> bool:
        """Whether its replies give exact ``policy_epoch`` boundaries."""
        return (
            self.native is True
            and self.labelled is True
            and not (self.stale or self.foreign or self.unstamped)
        )

    @property
    def trusted_labels(self) -> dict[str, int] | None:
        """The labels its spans map through (``None``: its labels cannot be trusted)."""
        if self.labelled is not True or self.stale:
            return None
        return self.labels


@attrs.define(eq=False)
class NativeReplicas:
    """The native state of every replica (index = replica) and the epoch the labels
    follow (``label_epoch``: set by ``resume`` before it labels, so that a first contact
    racing a resume labels the new epoch). A pickled copy starts afresh, keeping only the
    epoch: another process learns its replicas again."""

    replicas: tuple[ReplicaState, ...]
    label_epoch: int = 0

    @classmethod
    def for_replicas(cls, n: int) -> NativeReplicas:
        return cls(tuple(ReplicaState() for _ in range(n)))

    def __getstate__(self) -> dict[str, Any]:
        return {"n": len(self.replicas), "label_epoch": self.label_epoch}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.replicas = tuple(ReplicaState() for _ in range(state["n"]))
        self.label_epoch = state["label_epoch"]


@attrs.define(eq=False)
class _Aborts:
    """Rewritten ids waiting to be aborted on one replica, and whether a sender runs."""

    pending: list[str] = attrs.field(factory=list)
    sending: bool = False


@attrs.define(eq=False)
class NativeRun:
    """What one Trio run holds for the native route: a lock per replica that orders its
    label requests, and the aborts waiting to be sent."""

    locks: tuple[trio.Lock, ...]
    aborts: tuple[_Aborts, ...]

    @classmethod
    def for_replicas(cls, n: int) -> NativeRun:
        return cls(tuple(trio.Lock() for _ in range(n)), tuple(_Aborts() for _ in range(n)))


@attrs.define(eq=False)
class NativeCall:
    """One call on the native route: the epoch it started under (what spans labelled by
    someone else are stamped with) and its prompts rendered to ids (keyed by the body's
    identity, so a retry does not render it again)."""

    start_epoch: int
    rendered: dict[int, list[int]] = attrs.field(factory=dict)  # id(prompt) -> ids


# --------------------------------------------------------------------------- bodies


def native_body(
    request_id: str, token_ids: list[int], body: dict[str, Any], model: str
) -> dict[str, Any]:
    """The native request for an OpenAI ``body``: its sampling fields (generation
    arguments, ``extra_body``, ``seed``, a group call's ``n``) as ``sampling_params``,
    logprobs asked as ``sampling_params.logprobs = 1`` when the body asks for them, the
    text of the generated ids in the reply (``output_mode: "text"``) and the prompt's ids
    echoed."""
    skipped = _NOT_SAMPLING | _RENDER_FIELDS | _REQUEST_FIELDS
    # None is "unset" (a continuation's max_tokens when the first left it unset): the
    # server's default applies, as on the OpenAI routes.
    params = {key: value for key, value in body.items() if key not in skipped and value is not None}
    if body.get("logprobs"):
        params["logprobs"] = 1
    native: dict[str, Any] = {
        "request_id": request_id,
        "model": model,
        "token_ids": token_ids,
        "sampling_params": params,
        "return_token_ids": True,
        "output_mode": "text",
    }
    native.update({key: body[key] for key in _REQUEST_FIELDS if key in body})
    return native


def tokenize_body(body: dict[str, Any], model: str) -> dict[str, Any]:
    """The ``/tokenize`` request that renders an OpenAI body's text prompt as the OpenAI
    route would: chat messages with the chat template and the generation prompt (or
    continuing the final message), a completions prompt as text with special tokens."""
    rendered: dict[str, Any] = {"model": model}
    if "messages" in body:
        rendered["messages"] = body["messages"]
        continuing = bool(body.get("continue_final_message"))
        rendered["continue_final_message"] = continuing
        rendered["add_generation_prompt"] = body.get("add_generation_prompt", not continuing)
        for key in ("chat_template", "chat_template_kwargs", "mm_processor_kwargs"):
            if key in body:
                rendered[key] = body[key]
    else:
        rendered["prompt"] = body["prompt"]
        if "add_special_tokens" in body:
            rendered["add_special_tokens"] = body["add_special_tokens"]
    return rendered


# --------------------------------------------------------------------------- replies


@attrs.frozen
class Span:
    """Generated tokens ``[start, end)`` were sampled under weights labelled ``version``."""

    version: str
    start: int
    end: int


@attrs.frozen(kw_only=True)
class NativeReply:
    """What a native reply says about one of its choices."""

    request_id: str | None
    prompt_ids: list[int] | None
    token_ids: list[int]
    text: str | None
    logprobs: list[float] | None
    finish_reason: str | None
    usage: dict[str, Any] | None
    spans: list[Span] | None
    sampling_mask: Any


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _ids(value: object, path: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(item) and item >= 0 for item in value):
        msg = f"{path} is not a list of token ids"
        raise BadField(msg)
    return list(value)


def _logprobs(choice: dict[str, Any], where: str) -> list[float] | None:
    logprobs = choice.get("logprobs")
    if logprobs is None:
        return None
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    path = f"{where}.logprobs.content"
    if not isinstance(content, list) or not all(isinstance(item, dict) for item in content):
        msg = f"{path} is not a list of objects"
        raise BadField(msg)
    values = [item.get("logprob") for item in content]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        msg = f"{path}[*].logprob is not a number for every generated token"
        raise BadField(msg)
    return [float(v) for v in values]


def _spans(choice: dict[str, Any], where: str) -> list[Span] | None:
    value = choice.get("weight_versions")
    if value is None:
        return None
    path = f"{where}.weight_versions"
    if not isinstance(value, list):
        msg = f"{path} is not a list of spans"
        raise BadField(msg)
    spans = []
    for item in value:
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("version"), str)
            or not _is_int(item.get("start"))
            or not _is_int(item.get("end"))
        ):
            msg = f'{path} is not a list of {{"version": str, "start": int, "end": int}}'
            raise BadField(msg)
        spans.append(Span(item["version"], item["start"], item["end"]))
    return spans


def read_reply(data: object) -> NativeReply:
    """The :class:`NativeReply` of a native reply's first choice (``BadField`` if
    malformed)."""
    data, choice = first_choice(data)
    return _read_choice(data, choice, "$.choices[0]")


def read_replies(data: object) -> list[NativeReply]:
    """A :class:`NativeReply` per choice of a native reply (a request with
    ``sampling_params.n``), in ``index`` order, each with its own usage
    (:func:`~._parse.choice_usage`); ``BadField`` if malformed."""
    data, choices = all_choices(data)
    replies = []
    for i, choice in enumerate(choices):
        reply = _read_choice(data, choice, f"$.choices[{i}]")
        usage = choice_usage(reply.usage, len(reply.token_ids))
        replies.append(attrs.evolve(reply, usage=usage))
    return replies


def _read_choice(data: dict[str, Any], choice: dict[str, Any], where: str) -> NativeReply:
    prompt_ids = data.get("prompt_token_ids")
    text = choice.get("text")
    if text is not None and not isinstance(text, str):
        msg = f"{where}.text is not a string"
        raise BadField(msg)
    finish = choice.get("finish_reason")
    usage = data.get("usage")
    request_id = data.get("request_id")
    return NativeReply(
        request_id=request_id if isinstance(request_id, str) else None,
        prompt_ids=None if prompt_ids is None else _ids(prompt_ids, "$.prompt_token_ids"),
        token_ids=_ids(choice.get("token_ids"), f"{where}.token_ids"),
        text=text,
        logprobs=_logprobs(choice, where),
        finish_reason=finish if isinstance(finish, str) else None,
        usage=usage if isinstance(usage, dict) else None,
        spans=_spans(choice, where),
        sampling_mask=choice.get("sampling_mask"),
    )


def policy_boundaries(
    spans: list[Span], labels: dict[str, int], start_epoch: int
) -> tuple[list[tuple[int, int]], list[str]]:
    """``policy_epoch`` boundaries ``(index into the generated tokens, epoch)`` from a
    reply's ``weight_versions``, the first at 0, one where the epoch changes; and the
    labels that are not in ``labels`` (the interface did not set them: their spans keep
    ``start_epoch``, the epoch the call started under, rather than a guess)."""
    boundaries: list[tuple[int, int]] = []
    foreign: list[str] = []
    for span in spans:
        epoch = labels.get(span.version)
        if epoch is None:
            epoch = start_epoch
            if span.version not in foreign:
                foreign.append(span.version)
        if span.end <= span.start:
            continue
        if not boundaries:
            boundaries.append((0, epoch))
        elif boundaries[-1][1] != epoch:
            boundaries.append((span.start, epoch))
    return boundaries, foreign


# --------------------------------------------------------------------------- the route


@attrs.frozen(kw_only=True, eq=False)
class VLLMNative:
    """The native route of one interface's vLLM replicas (index = replica)."""

    roots: tuple[str, ...]  # each replica's root (base_url less "/v1")
    shown_roots: tuple[str, ...]  # the same without credentials, for messages
    api_key: str | None
    model: str
    max_retries: int
    backoff: RetryBackoff
    capabilities: Capabilities  # for warnings once per replica
    state: NativeReplicas

    def replica(self, index: int) -> ReplicaState:
        return self.state.replicas[index]

    @property
    def stamps(self) -> bool:
        """Whether every replica is known to serve the native route and stamp."""
        return all(replica.stamps for replica in self.state.replicas)

    def takes(self, index: int, body: dict[str, Any]) -> bool:
        """Whether ``body`` goes to replica ``index``'s native route: it may serve it, and
        the body has no tools and no option only the OpenAI routes honour
        (:data:`OPENAI_ROUTE_ONLY`); its prompt is ids, or text the replica can render."""
        replica = self.replica(index)
        if replica.native is False or body.get("tools") or not OPENAI_ROUTE_ONLY.isdisjoint(body):
            return False
        if isinstance(body.get("prompt"), list):
            return True
        return replica.renders and ("messages" in body or isinstance(body.get("prompt"), str))

    # ------------------------------------------------------------------- generate

    async def generate(
        self,
        transport: Transport,
        run: NativeRun,
        index: int,
        request: InferenceRequest,
        body: dict[str, Any],
        call: NativeCall,
    ) -> list[InferenceResponse] | None:
        """One native request for ``body`` (an OpenAI body) to replica ``index``, after its
        first contact (:meth:`first_contact`, a no-op once made): a response per choice
        (one, unless ``body`` asks ``n`` choices: then as many as the reply has, each with
        its own usage). ``None`` when the replica turns out not to serve the route (or
        ``/tokenize``, for a text prompt): the caller sends ``body`` to the OpenAI route,
        and so do later calls. Raises :class:`InferenceError` like the OpenAI routes.

        Cancellation: cancellable; a request cancelled (or timed out) on the wire is
        aborted on the server from a system task, without delaying the cancellation (one
        id for all the choices of a request: vLLM aborts them together)."""
        await self.first_contact(transport, run, index)
        prompt_ids = await self._prompt_ids(transport, index, body, call)
        if prompt_ids is None:
            return None
        request_id = new_request_id()
        sent = native_body(request_id, prompt_ids, body, self.model)
        url = self.roots[index] + GENERATE_PATH
        shown = self.shown_roots[index] + GENERATE_PATH
        try:
            response = await transport.post(url, shown, lambda: encode_json(sent))
        except (trio.Cancelled, InferenceTimeoutError):
            # The server may still be generating it: free its slot (vLLM also aborts a
            # request whose client disconnects; this covers proxies that do not pass the
            # disconnect on, and timeouts).
            self.abort_later(transport, run, index, request_id)
            raise
        if not 200 <= response.status_code < 300:
            if self._refused(index, response):
                return None
            hint = f" (vLLM's native generate route, {SCALE_OUT_FLAG})"
            raise error_for_status(response, shown, self.api_key, hint)
        try:
            data = read_json(response, shown, self.api_key)
            replies = read_replies(data) if body.get("n", 1) > 1 else [read_reply(data)]
        except BadField as exc:
            msg = f"POST {shown} returned {response.status_code} but {exc}"
            raise MalformedResponseError(msg, url=shown, status=response.status_code) from None
        return [
            await self._response(transport, index, request, body, call, prompt_ids, reply)
            for reply in replies
        ]

    async def _response(
        self,
        transport: Transport,
        index: int,
        request: InferenceRequest,
        body: dict[str, Any],
        call: NativeCall,
        sent_ids: list[int],
        reply: NativeReply,
    ) -> InferenceResponse:
        replica = self.replica(index)
        if replica.native is not True:
            replica.native = True
            if replica.labelled is False:
                self.capabilities.warn_once(
                    index,
                    "weight version",
                    "%s serves vLLM's native generate route but does not take "
                    "/update_weight_version (start it with VLLM_SERVER_DEV_MODE=1): its "
                    "calls are stamped with the epoch they started under, not per token",
                    self.shown_roots[index],
                )
        self._learn_prefix(index, reply.request_id)
        if reply.sampling_mask is not None:
            replica.sampling_mask = True
        text = reply.text
        if text is None:  # a server without output_mode: the text of the ids
            text = await self._detokenize(transport, index, reply.token_ids)
        prompt_ids = reply.prompt_ids if reply.prompt_ids is not None else sent_ids
        prompt = body.get("prompt")
        if "messages" in body:
            prompt_text = render_plain_chat(request.prompt)
        else:
            prompt_text = prompt if isinstance(prompt, str) else ""
        return InferenceResponse(
            response=ChatMessage(role="assistant", content=text),
            raw_text=prompt_text + text,
            token_ids=prompt_ids + reply.token_ids,
            prompt_length=len(prompt_ids),
            logprobs=reply.logprobs,
            policy_epoch=self._policy_epoch(index, reply, call.start_epoch),
            finish_reason=reply.finish_reason,
            usage=reply.usage,
            sampling_mask=reply.sampling_mask,
        )

    def _policy_epoch(
        self, index: int, reply: NativeReply, start_epoch: int
    ) -> list[tuple[int, int]]:
        """The reply's boundaries (``[]``: the caller stamps the start epoch)."""
        replica = self.replica(index)
        labels = replica.trusted_labels
        if labels is None or not reply.token_ids:
            return []
        if reply.spans is None:  # a vLLM without weight_versions
            replica.unstamped = True
            return []
        boundaries, foreign = policy_boundaries(reply.spans, labels, start_epoch)
        if foreign:
            replica.foreign = True
            self.capabilities.warn_once(
                index,
                "foreign weight version",
                "%s labelled generated tokens with weight version(s) %s, which this "
                "interface did not set (another client or the trainer calls "
                "/update_weight_version): those tokens are stamped with the epoch their "
                "call started under, and the replica no longer counts as stamping "
                "(stamps_policy_epoch is False)",
                self.shown_roots[index],
                ", ".join(repr(label) for label in foreign),
            )
        return boundaries

    def _learn_prefix(self, index: int, rewritten: str | None) -> None:
        """What the server puts before the ids it is sent, from a reply (so that an abort
        names the id it knows; ``generate-tokens-`` in vLLM 0.32)."""
        if rewritten is None:
            return
        head, found, tail = rewritten.rpartition(REQUEST_ID_PREFIX)
        if found and len(tail) == 32:  # a uuid4 hex
            self.replica(index).id_prefix = head

    def _refused(self, index: int, response: Response) -> bool:
        """Whether a non-2xx answer means the replica does not serve the route; if so, the
        replica falls back to the OpenAI routes for good (warned once)."""
        status = response.status_code
        if status not in NOT_SERVED:
            return False
        message, _ = server_message(response)
        if status == 404 and "model" in message.lower():
            return False  # the route exists; the model does not
        self.replica(index).native = False
        self.capabilities.warn_once(
            index,
            "native generate",
            "%s does not serve vLLM's native %s (%d: %s): start vLLM with %s for exact "
            "per-token policy_epoch boundaries; this replica uses /v1/completions and "
            "/v1/chat/completions",
            self.shown_roots[index],
            GENERATE_PATH,
            status,
            message[:200] or response.reason_phrase,
            SCALE_OUT_FLAG,
        )
        return True

    # ------------------------------------------------------------------- rendering

    async def _prompt_ids(
        self, transport: Transport, index: int, body: dict[str, Any], call: NativeCall
    ) -> list[int] | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            return prompt
        # Keyed by the prompt object, which a body's copies (without a dropped field)
        # share with it, and which lives as long as the call.
        key = id(body.get("messages", prompt))
        rendered = call.rendered.get(key)
        if rendered is None:
            rendered = await self._tokenize(transport, index, body)
            if rendered is None:
                return None
            call.rendered[key] = rendered
        return rendered

    async def _tokenize(
        self, transport: Transport, index: int, body: dict[str, Any]
    ) -> list[int] | None:
        """The ids of ``body``'s text prompt as the replica renders it (``/tokenize``), or
        ``None`` if it does not serve ``/tokenize`` (its text prompts then fall back)."""
        url = self.roots[index] + TOKENIZE_PATH
        shown = self.shown_roots[index] + TOKENIZE_PATH
        content = encode_json(tokenize_body(body, self.model))
        response = await transport.post(url, shown, lambda: content)
        if response.status_code in NOT_SERVED:
            replica = self.replica(index)
            replica.renders = False
            if replica.native is True:  # else its id prompts will say whether it is vLLM's
                self.capabilities.warn_once(
                    index,
                    "tokenize",
                    "%s serves vLLM's native generate route but not %s (%d): its text "
                    "prompts use the OpenAI routes",
                    self.shown_roots[index],
                    TOKENIZE_PATH,
                    response.status_code,
                )
            return None
        data = self._json(response, shown)
        tokens = data.get("tokens") if isinstance(data, dict) else None
        try:
            return _ids(tokens, "$.tokens")
        except BadField as exc:
            msg = f"POST {shown} returned {response.status_code} but {exc}"
            raise MalformedResponseError(msg, url=shown, status=response.status_code) from None

    async def _detokenize(self, transport: Transport, index: int, ids: list[int]) -> str:
        url = self.roots[index] + DETOKENIZE_PATH
        shown = self.shown_roots[index] + DETOKENIZE_PATH
        content = encode_json({"model": self.model, "tokens": ids})
        response = await transport.post(url, shown, lambda: content)
        data = self._json(response, shown)
        text = data.get("prompt") if isinstance(data, dict) else None
        if not isinstance(text, str):
            msg = f"POST {shown} returned {response.status_code} but $.prompt is not a string"
            raise MalformedResponseError(msg, url=shown, status=response.status_code)
        return text

    def _json(self, response: Response, shown: str) -> Any:
        if not 200 <= response.status_code < 300:
            raise error_for_status(response, shown, self.api_key)
        return read_json(response, shown, self.api_key)

    # ------------------------------------------------------------------- labels

    async def first_contact(self, transport: Transport, run: NativeRun, index: int) -> None:
        """Label replica ``index`` with the current epoch before its first native request,
        once per interface (concurrent first calls share it). A replica that refuses the
        label (no ``VLLM_SERVER_DEV_MODE=1``) is used unlabelled and does not stamp; a
        transient failure is raised (the call retries it).

        Cancellation: cancellable; a cancelled first contact is made again by the next
        call."""
        replica = self.replica(index)
        if replica.labelled is not None:
            return
        async with run.locks[index]:
            if replica.labelled is not None:
                return
            replica.contacted = True
            replica.labelled = await self._label(transport, index, self.state.label_epoch)

    async def relabel(self, transport: Transport, run: NativeRun, epoch: int) -> None:
        """Label every replica that serves (or may serve) the native route with ``epoch``,
        concurrently, retrying transient failures. A replica whose label fails keeps an
        old one: it is marked stale (no longer stamping) and warned about, never raised.

        Cancellation: the caller shields it and bounds its time (``resume``)."""
        self.state.label_epoch = epoch
        targets = [
            index
            for index, replica in enumerate(self.state.replicas)
            if replica.contacted and replica.native is not False and replica.labelled is not False
        ]
        async with trio.open_nursery() as nursery:
            for index in targets:
                nursery.start_soon(self._relabel_one, transport, run, index, epoch)

    async def _relabel_one(
        self, transport: Transport, run: NativeRun, index: int, epoch: int
    ) -> None:
        replica = self.replica(index)
        async with run.locks[index]:
            if replica.labelled is not True or replica.label == str(epoch):
                return
            failure = "it did not finish in time"  # cancelled by the resume's deadline
            try:
                if await call_with_retries(
                    lambda: self._label(transport, index, epoch),
                    max_retries=self.max_retries,
                    backoff=self.backoff,
                ):
                    return
                failure = "it refused it"
            except InferenceError as exc:
                failure = str(exc)
            finally:
                # Not labelled (refused, failed or cancelled): the server may carry the
                # old label on tokens of the new weights, so its labels are not trusted.
                if replica.label != str(epoch):
                    replica.stale = True
                    self.capabilities.warn_once(
                        index,
                        "stale weight version",
                        "labelling %s with weight version %r failed (%s): its tokens may "
                        "carry an older label, so its calls are stamped with the epoch they "
                        "started under from now on (stamps_policy_epoch is False)",
                        self.shown_roots[index],
                        str(epoch),
                        failure,
                    )

    async def _label(self, transport: Transport, index: int, epoch: int) -> bool:
        """``POST /update_weight_version {"new_version": str(epoch)}``: ``True`` once set,
        ``False`` if refused (4xx); a transient failure is raised."""
        label = str(epoch)
        url = self.roots[index] + LABEL_PATH
        shown = self.shown_roots[index] + LABEL_PATH
        content = encode_json({"new_version": label})
        response = await transport.post(url, shown, lambda: content)
        replica = self.replica(index)
        if 200 <= response.status_code < 300:
            replica.label = label
            replica.labels[label] = epoch
            return True
        hint = ""
        if response.status_code in (404, 405):
            hint = f"; vLLM serves {LABEL_PATH} only with VLLM_SERVER_DEV_MODE=1"
        error = error_for_status(response, shown, self.api_key, hint)
        if isinstance(error, TRANSIENT_ERRORS):
            raise error
        logger.debug("%s: not labelling this replica: %s", self.shown_roots[index], error)
        return False

    # ------------------------------------------------------------------- aborts

    def abort_later(
        self, transport: Transport, run: NativeRun, index: int, request_id: str
    ) -> None:
        """Have the server abort ``request_id`` (sent to replica ``index``), from a system
        task: best effort, bounded by :data:`ABORT_TIMEOUT`, never raising into the run.
        Ids cancelled together go in one request."""
        aborts = run.aborts[index]
        aborts.pending.append(self.replica(index).id_prefix + request_id)
        if aborts.sending:
            return  # the running sender takes it with the next batch
        aborts.sending = True
        try:
            trio.lowlevel.spawn_system_task(
                self._send_aborts, transport, index, aborts, name="vLLM abort_requests"
            )
        except RuntimeError:  # the run is ending: vLLM aborts on the disconnect anyway
            aborts.sending = False
            aborts.pending.clear()

    async def _send_aborts(self, transport: Transport, index: int, aborts: _Aborts) -> None:
        try:
            while aborts.pending:
                ids = list(aborts.pending)
                aborts.pending.clear()
                await self._abort(transport, index, ids)
        finally:
            aborts.sending = False

    async def _abort(self, transport: Transport, index: int, ids: list[str]) -> None:
        url = self.roots[index] + ABORT_PATH
        shown = self.shown_roots[index] + ABORT_PATH
        content = encode_json({"request_ids": ids})
        with trio.move_on_after(ABORT_TIMEOUT):
            try:
                response = await transport.post(url, shown, lambda: content)
            except InferenceError as exc:
                logger.debug("aborting %d request(s) failed: %s", len(ids), exc)
            except Exception:  # an exception escaping a system task would crash the run
                logger.warning(
                    "aborting %d request(s) at %s failed", len(ids), shown, exc_info=True
                )
            else:
                if not 200 <= response.status_code < 300:
                    logger.debug("%s answered %d to an abort", shown, response.status_code)
            return
        logger.debug("%s did not answer an abort within %s s", shown, ABORT_TIMEOUT)

    # ------------------------------------------------------------------- probe

    async def negotiate(self, transport: Transport, run: NativeRun, index: int) -> bool:
        """Whether replica ``index`` serves the native route, asked with a one-token
        native request if not known yet (its first contact labels it). Errors are
        raised as by :meth:`generate`; cancellation as there."""
        replica = self.replica(index)
        if replica.native is None:
            body = {"prompt": PROBE_PROMPT, "max_tokens": 1, "seed": PROBE_SEED}
            request = InferenceRequest(prompt=[ChatMessage(role="user", content=PROBE_PROMPT)])
            call = NativeCall(start_epoch=self.state.label_epoch)
            await self.generate(transport, run, index, request, body, call)
        return replica.native is True


# --------------------------------------------------------------------------- the probe

#: The probe: a short text prompt, one token, two temperatures, the top 5 logprobs.
PROBE_PROMPT: Final = "The quick brown fox"
PROBE_SEED: Final = 20_240_601
PROBE_TEMPERATURES: Final = (1.0, 0.5)
PROBE_TOP: Final = 5
#: Top logprobs this close are equal (the same numbers, serialised twice).
PROBE_TOLERANCE: Final = 1e-5

ProbeKind = Literal["chat", "completions"]


def probe_body(kind: ProbeKind, model: str, temperature: float) -> dict[str, Any]:
    """One probe request: one token at ``temperature``, the top logprobs asked."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": 1,
        "temperature": temperature,
        "seed": PROBE_SEED,
    }
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": PROBE_PROMPT}]
        body["logprobs"] = True
        body["top_logprobs"] = PROBE_TOP
    else:
        body["prompt"] = PROBE_PROMPT
        body["logprobs"] = PROBE_TOP
    return body


def top_logprobs(data: object) -> list[float] | None:
    """The first generated position's top logprobs, highest first, in either shape
    (completions: ``logprobs.top_logprobs[0]`` a ``{token: logprob}`` object; chat:
    ``logprobs.content[0].top_logprobs`` a list); ``None`` if the reply has none."""
    try:
        logprobs = data["choices"][0]["logprobs"]  # type: ignore[index]
        if logprobs.get("content") is not None:
            values = [item["logprob"] for item in logprobs["content"][0]["top_logprobs"]]
        else:
            values = list(logprobs["top_logprobs"][0].values())
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    if len(values) < 2 or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values
    ):
        return None
    return sorted((float(v) for v in values), reverse=True)


def compare_tops(first: list[float] | None, second: list[float] | None) -> LogprobsMode:
    """Equal top logprobs at two temperatures: ``"raw"`` (taken before temperature);
    different: ``"processed"``; missing: ``"unknown"``."""
    if first is None or second is None or len(first) != len(second):
        return "unknown"
    same = all(abs(a - b) <= PROBE_TOLERANCE for a, b in zip(first, second, strict=True))
    return "raw" if same else "processed"


class Unreachable(Exception):
    """The probe could not reach a replica (its answer is not cached)."""


async def probe_logprobs_mode(
    transport: Transport, url: str, shown: str, kind: ProbeKind, model: str
) -> LogprobsMode:
    """Which logprobs the server at ``url`` (an OpenAI route) returns: one request per
    :data:`PROBE_TEMPERATURES`, concurrently, compared by :func:`compare_tops`. A
    refusal, an error status or a malformed reply is ``"unknown"``; a connection error or
    a timeout raises :class:`Unreachable`.

    Cancellation: cancellable."""
    tops: list[list[float] | None] = [None] * len(PROBE_TEMPERATURES)
    unreachable: list[InferenceError] = []

    async def ask(i: int, temperature: float) -> None:
        content = encode_json(probe_body(kind, model, temperature))
        try:
            response = await transport.post(url, shown, lambda: content)
        except (InferenceConnectionError, InferenceTimeoutError) as exc:
            unreachable.append(exc)
            return
        except InferenceError as exc:  # e.g. a host name that does not exist
            logger.debug("probing %s failed: %s", shown, exc)
            return
        if 200 <= response.status_code < 300:
            try:
                tops[i] = top_logprobs(response.json())
            except ValueError:
                tops[i] = None

    async with trio.open_nursery() as nursery:
        for i, temperature in enumerate(PROBE_TEMPERATURES):
            nursery.start_soon(ask, i, temperature)
    if unreachable:
        raise Unreachable(str(unreachable[0])) from unreachable[0]
    return compare_tops(tops[0], tops[1])


@attrs.define(eq=False)
class _Probing:
    done: trio.Event = attrs.field(factory=trio.Event)
    result: ReplicaProbe | None = None


@attrs.define(eq=False)
class ProbeRun:
    """The probes under way in one Trio run (index = replica)."""

    probing: dict[int, _Probing] = attrs.field(factory=dict)


@attrs.define(eq=False)
class ProbeCache:
    """The probe's answers per replica, over the interface's life (a pickled copy starts
    empty: another process probes again)."""

    probes: dict[int, ReplicaProbe] = attrs.field(factory=dict)

    def mode(self, index: int) -> LogprobsMode:
        """The replica's logprobs mode, ``"unknown"`` if never probed."""
        probe = self.probes.get(index)
        return "unknown" if probe is None else probe.logprobs_mode

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.probes = {}

    async def get(
        self,
        run: ProbeRun,
        index: int,
        probe: Callable[[], Awaitable[tuple[ReplicaProbe, bool]]],
    ) -> ReplicaProbe:
        """The cached probe of replica ``index``, or ``probe()``'s answer (``(answer,
        reached)``: cached only if the replica was reached). Concurrent callers share one
        probe. Cancellation: cancellable; if the caller probing is cancelled, the next
        caller probes again."""
        while True:
            cached = self.probes.get(index)
            if cached is not None:
                return cached
            under_way = run.probing.get(index)
            if under_way is None:
                break
            await under_way.done.wait()
            if under_way.result is not None:
                return under_way.result
        probing = run.probing[index] = _Probing()
        try:
            answer, reached = await probe()
            probing.result = answer
            if reached:
                self.probes[index] = answer
            return answer
        finally:
            del run.probing[index]
            probing.done.set()
