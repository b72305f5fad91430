"""vLLM's native RL route on the wire: its paths and flags, the request built from an
OpenAI body, and the reply read back (:class:`NativeReply`). Nothing here sends; the
route's life (first contact, labels, aborts) is :mod:`._vllm`'s.

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
"""

from __future__ import annotations

import uuid
from typing import Any, Final, TypeGuard

import attrs

from trio_rollouts.inference.openai._parse import (
    BadField,
    all_choices,
    choice_usage,
    first_choice,
)
from trio_rollouts.inference.openai._versions import Span

__all__ = [
    "ABORT_PATH",
    "ABORT_TIMEOUT",
    "DETOKENIZE_PATH",
    "GENERATE_PATH",
    "LABEL_PATH",
    "NOT_SERVED",
    "OPENAI_ROUTE_ONLY",
    "REQUEST_ID_PREFIX",
    "REWRITTEN_PREFIX",
    "SCALE_OUT_FLAG",
    "TOKENIZE_PATH",
    "NativeReply",
    "native_body",
    "new_request_id",
    "read_replies",
    "read_reply",
    "token_list",
    "tokenize_body",
]

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


def token_list(value: object, path: str) -> list[int]:
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
        prompt_ids=None if prompt_ids is None else token_list(prompt_ids, "$.prompt_token_ids"),
        token_ids=token_list(choice.get("token_ids"), f"{where}.token_ids"),
        text=text,
        logprobs=_logprobs(choice, where),
        finish_reason=finish if isinstance(finish, str) else None,
        usage=usage if isinstance(usage, dict) else None,
        spans=_spans(choice, where),
        sampling_mask=choice.get("sampling_mask"),
    )
