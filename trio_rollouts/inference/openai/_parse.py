"""Reading what an OpenAI-compatible server answered: the error an HTTP status maps to and
what the server said about it, ``Retry-After``, and the completion's JSON (text, token ids,
log-probabilities, Megatron's epoch stamps) as an :class:`InferenceResponse`, or one per
choice of a request for ``n`` (:func:`parse_choices`, usage split by :func:`choice_usage`).

Everything here is a function of a response (either transport's, through the
:class:`~trio_rollouts.inference.http._transport.Response` protocol) and of what was sent;
nothing sends. Every message passes through :func:`~trio_rollouts.inference._errors.redact`
before it goes into an error, so no error carries a credential.
"""

from __future__ import annotations

import email.utils
import html
import math
import re
import time
from typing import Any, Literal

from trio_rollouts._messages import ChatMessage
from trio_rollouts.inference._errors import (
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InferenceError,
    InferenceTimeoutError,
    MalformedResponseError,
    NotSupportedError,
    RateLimitError,
    ServerError,
    redact,
)
from trio_rollouts.inference._interface import (
    InferenceRequest,
    InferenceResponse,
    render_plain_chat,
)
from trio_rollouts.inference.http._transport import Headers, Response

__all__ = [
    "MAX_SERVER_MESSAGE",
    "choice_usage",
    "error_for_status",
    "parse_choices",
    "parse_completion",
    "read_json",
    "retry_after",
    "server_message",
    "status_class",
]

#: Server messages are cut to this many characters in errors.
MAX_SERVER_MESSAGE = 500

#: Keys of a returned chat message kept in ``ChatMessage.extra`` (others, such as the
#: token-id copies Megatron's server puts in the message, are dropped).
_MESSAGE_EXTRA_KEYS = ("tool_calls", "function_call", "refusal", "reasoning", "reasoning_content")


# --------------------------------------------------------------------------- errors


def status_class(status: int) -> type[InferenceError]:
    """The error class for an HTTP error status (the table in ``_errors``)."""
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


def error_for_status(
    response: Response,
    shown: str,
    api_key: str | None,
    hint: str = "",
    *,
    said: tuple[str, object] | None = None,
    cls: type[InferenceError] | None = None,
    fields: tuple[str, ...] = (),
) -> InferenceError:
    """The error for a non-2xx ``response`` to ``POST shown``: ``POST <url> returned <status>
    <reason>: <what the server said>`` followed by ``hint``, of the class the status maps
    to (or ``cls``), with the status, the redacted server message and ``Retry-After``.
    ``said`` is :func:`server_message` of the response when the caller has it already."""
    status = response.status_code
    message, _ = said if said is not None else server_message(response)
    shown_message = redact(message, api_key)[:MAX_SERVER_MESSAGE] or None
    msg = f"POST {shown} returned {status} {response.reason_phrase}"
    if shown_message and shown_message != response.reason_phrase:
        msg += f": {shown_message}"
    msg += hint
    kwargs: dict[str, Any] = {"fields": fields} if fields else {}
    return (cls or status_class(status))(
        msg,
        url=shown,
        status=status,
        server_message=shown_message,
        retry_after=retry_after(response.headers),
        **kwargs,
    )


def server_message(response: Response) -> tuple[str, object]:
    """What a server said about an error, on one line, and its parsed JSON (or ``None``).

    OpenAI's ``error.message``, vLLM's ``message``, FastAPI's ``detail`` (a validation
    list as ``body.field: msg; ...``), a summary of an HTML page (never its markup), or
    else the body itself.
    """
    try:
        text = response.text
    except (UnicodeDecodeError, LookupError):
        return "", None
    if is_html(response):
        return html_summary(text), None
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


_HTML_TITLE = re.compile(r"<title[^>]*>(.*?)</title", re.IGNORECASE | re.DOTALL)


def is_html(response: Response) -> bool:
    if "html" in (response.headers.get("content-type") or "").lower():
        return True
    try:
        return response.text.lstrip().startswith("<")
    except (UnicodeDecodeError, LookupError):
        return False


def html_summary(text: str) -> str:
    """``an HTML page titled '...'``: what a web page is, without its markup."""
    match = _HTML_TITLE.search(text)
    title = _one_line(html.unescape(match.group(1))) if match else ""
    if not title:
        return "an HTML page (no title)"
    return f"an HTML page titled {title[:80]!r}"


def retry_after(headers: Headers) -> float | None:
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


# --------------------------------------------------------------------------- completions


def parse_completion(
    endpoint: Literal["chat", "completions"],
    request: InferenceRequest,
    sent: dict[str, Any],
    response: Response,
    shown: str,
    api_key: str | None,
) -> InferenceResponse:
    """The :class:`InferenceResponse` of a 2xx ``response`` to ``sent`` (its first choice);
    a body that is not the JSON the API promises is a :class:`MalformedResponseError`
    naming the field."""
    data = read_json(response, shown, api_key)
    try:
        data, choice = first_choice(data)
        return _completion(endpoint, request, sent, data, choice, _CHOICE)
    except BadField as exc:
        msg = f"POST {shown} returned {response.status_code} but {exc}"
        raise MalformedResponseError(msg, url=shown, status=response.status_code) from None


def parse_choices(
    endpoint: Literal["chat", "completions"],
    request: InferenceRequest,
    sent: dict[str, Any],
    response: Response,
    shown: str,
    api_key: str | None,
) -> list[InferenceResponse]:
    """One :class:`InferenceResponse` per choice of a 2xx ``response`` to ``sent`` (a
    request for ``n`` choices), in ``index`` order, each with its usage
    (:func:`choice_usage`); malformed JSON as :func:`parse_completion`."""
    data = read_json(response, shown, api_key)
    try:
        data, choices = all_choices(data)
        usage = data.get("usage")
        responses = []
        for i, choice in enumerate(choices):
            parsed = _completion(endpoint, request, sent, data, choice, f"$.choices[{i}]")
            parsed.usage = choice_usage(usage, _choice_tokens(parsed))
            responses.append(parsed)
        return responses
    except BadField as exc:
        msg = f"POST {shown} returned {response.status_code} but {exc}"
        raise MalformedResponseError(msg, url=shown, status=response.status_code) from None


#: Usage keys that count the completions of all the choices together.
_GROUP_USAGE_KEYS = frozenset({"completion_tokens", "total_tokens", "completion_tokens_details"})


def choice_usage(
    usage: dict[str, Any] | None, completion_tokens: int | None
) -> dict[str, Any] | None:
    """The usage of one choice of a reply with several: the prompt's counts as the server
    gave them (every choice has the whole prompt), the choice's own ``completion_tokens``
    and ``total_tokens`` (left out when ``completion_tokens`` is unknown), and no
    ``completion_tokens_details`` (the server's are the choices' together)."""
    if usage is None:
        return None
    split = {key: value for key, value in usage.items() if key not in _GROUP_USAGE_KEYS}
    if completion_tokens is not None:
        split["completion_tokens"] = completion_tokens
        prompt = usage.get("prompt_tokens")
        if isinstance(prompt, int) and not isinstance(prompt, bool):
            split["total_tokens"] = prompt + completion_tokens
    return split


def _choice_tokens(response: InferenceResponse) -> int | None:
    """A choice's generated tokens: by its token ids, else its logprobs (one each)."""
    if response.token_ids is not None and response.prompt_length is not None:
        return len(response.token_ids) - response.prompt_length
    if response.logprobs is not None:
        return len(response.logprobs)
    return None


def read_json(response: Response, shown: str, api_key: str | None) -> Any:
    """The JSON of a 2xx ``response`` to ``POST shown``; a body that is not JSON (an HTML
    page, text) is a :class:`MalformedResponseError` saying what it is."""
    try:
        return response.json()
    except ValueError as exc:
        if is_html(response):
            msg = (
                f"POST {shown} returned {response.status_code} with "
                f"{html_summary(response.text)}, not JSON: is base_url the API root of an "
                "OpenAI-compatible server, such as 'http://127.0.0.1:8000/v1'?"
            )
            raise MalformedResponseError(msg, url=shown, status=response.status_code) from None
        start = redact(response.text[:200], api_key)
        msg = f"POST {shown} returned {response.status_code} but its body is not JSON ({exc})"
        msg += f"; it starts {start!r}"
        raise MalformedResponseError(msg, url=shown, status=response.status_code) from exc


def _completion(
    endpoint: Literal["chat", "completions"],
    request: InferenceRequest,
    sent: dict[str, Any],
    data: dict[str, Any],
    choice: dict[str, Any],
    where: str,
) -> InferenceResponse:
    """The response of one ``choice`` of the reply ``data`` (``where``: its JSON path)."""
    if endpoint == "chat":
        message = choice.get("message")
        if not isinstance(message, dict):
            msg = f"{where}.message is not an object"
            raise BadField(msg)
        # A reply that only calls tools has null content.
        content = _optional_str(message, "content", f"{where}.message") or ""
        role = _optional_str(message, "role", f"{where}.message") or "assistant"
        if role != "assistant" and role not in ChatMessage.allowed_roles():
            msg = f"{where}.message.role is {role!r:.40}, not a chat role"
            raise BadField(msg)
        extra = {key: message[key] for key in _MESSAGE_EXTRA_KEYS if message.get(key)}
        reply = ChatMessage(role=role, content=content, extra=extra)
        prompt_text = render_plain_chat(request.prompt)
        # vLLM puts the prompt's ids at the top level, Megatron on the choice.
        prompt_ids = _int_list(choice, "prompt_token_ids", where)
        if prompt_ids is None:
            prompt_ids = _int_list(data, "prompt_token_ids", "$")
        logprobs = _any_logprobs(choice, where)
    else:
        text = _optional_str(choice, "text", where)
        if text is None:
            msg = f"{where}.text is missing"
            raise BadField(msg)
        reply = ChatMessage(role="assistant", content=text)
        prompt = sent["prompt"]
        # A prompt of token ids (an exact continuation) has no text of its own here.
        prompt_text = prompt if isinstance(prompt, str) else ""
        prompt_ids = _int_list(choice, "prompt_token_ids", where)
        logprobs = _any_logprobs(choice, where)

    generated_ids = _int_list(choice, "token_ids", where)  # vLLM
    if generated_ids is None:
        generated_ids = _int_list(choice, "generation_token_ids", where)  # Megatron
    megatron_logprobs = _float_list(choice, "generation_log_probs", where)
    if megatron_logprobs is not None:
        logprobs = megatron_logprobs
    token_ids = prompt_length = None
    if prompt_ids is not None and generated_ids is not None:
        token_ids = prompt_ids + generated_ids
        prompt_length = len(prompt_ids)
    raw_text = _optional_str(choice, "raw_text", where)  # Megatron: what the model saw
    usage = data.get("usage")
    if usage is not None and not isinstance(usage, dict):
        msg = f"$.usage is a {type(usage).__name__}, not an object"
        raise BadField(msg)
    return InferenceResponse(
        response=reply,
        raw_text=raw_text if raw_text is not None else prompt_text + reply.content,
        token_ids=token_ids,
        prompt_length=prompt_length,
        logprobs=logprobs,
        policy_epoch=_epochs(choice, "policy_epoch", where),
        kv_cache_epoch=_epochs(choice, "kv_cache_epoch", where),
        num_evictions=_optional_int(choice, "num_evictions", where) or 0,
        finish_reason=_optional_str(choice, "finish_reason", where),
        usage=usage,
    )


def first_choice(data: object) -> tuple[dict[str, Any], dict[str, Any]]:
    """A reply's JSON object and its first choice (``BadField`` if it has none)."""
    if not isinstance(data, dict):
        msg = f"its JSON is a {type(data).__name__}, not an object"
        raise BadField(msg)
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        msg = "$.choices is not a non-empty list of objects"
        raise BadField(msg)
    return data, choices[0]


def all_choices(data: object) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A reply's JSON object and its choices, in ``index`` order when every choice has an
    int ``index`` (else as listed); ``BadField`` if it has none."""
    data, _ = first_choice(data)
    choices = data["choices"]
    if not all(isinstance(choice, dict) for choice in choices):
        msg = "$.choices is not a list of objects"
        raise BadField(msg)
    indexes = [choice.get("index") for choice in choices]
    if all(isinstance(i, int) and not isinstance(i, bool) for i in indexes):
        choices = sorted(choices, key=lambda choice: int(choice["index"]))
    return data, list(choices)


class BadField(Exception):
    """A field of a 2xx response body has the wrong shape (the message names its path)."""


_CHOICE = "$.choices[0]"


def _optional_str(obj: dict[str, Any], key: str, where: str = _CHOICE) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        msg = f"{where}.{key} is a {type(value).__name__}, not a string"
        raise BadField(msg)
    return value


def _optional_int(obj: dict[str, Any], key: str, where: str = _CHOICE) -> int | None:
    value = obj.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        msg = f"{where}.{key} is {value!r:.40}, not an int"
        raise BadField(msg)
    return value


def _int_list(obj: dict[str, Any], key: str, where: str = _CHOICE) -> list[int] | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    ):
        msg = f"{where}.{key} is not a list of ints"
        raise BadField(msg)
    return list(value)


def _numbers(value: object, path: str) -> list[float]:
    if not isinstance(value, list) or not all(
        isinstance(item, (int, float)) and not isinstance(item, bool) for item in value
    ):
        msg = f"{path} is not a list of numbers, one per generated token"
        raise BadField(msg)
    return [float(item) for item in value]


def _float_list(obj: dict[str, Any], key: str, where: str = _CHOICE) -> list[float] | None:
    value = obj.get(key)
    return None if value is None else _numbers(value, f"{where}.{key}")


def _logprobs_object(choice: dict[str, Any], where: str = _CHOICE) -> dict[str, Any] | None:
    logprobs = choice.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, dict):
        msg = f"{where}.logprobs is not an object"
        raise BadField(msg)
    return logprobs


def _any_logprobs(choice: dict[str, Any], where: str = _CHOICE) -> list[float] | None:
    """The log-probabilities of a choice in either shape, on either endpoint: the chat
    shape (``logprobs.content[i].logprob``, which llama.cpp's ``llama-server`` also
    answers on ``/v1/completions``) or the legacy completions shape
    (``logprobs.token_logprobs``)."""
    logprobs = _logprobs_object(choice, where)
    if logprobs is None:
        return None
    if logprobs.get("content") is not None:
        return _chat_logprobs(logprobs, where)
    return _float_list(logprobs, "token_logprobs", f"{where}.logprobs")


def _chat_logprobs(logprobs: dict[str, Any], where: str = _CHOICE) -> list[float]:
    """``logprobs.content[i].logprob``."""
    content = logprobs.get("content")
    path = f"{where}.logprobs.content"
    if not isinstance(content, list) or not all(isinstance(item, dict) for item in content):
        msg = f"{path} is not a list of objects"
        raise BadField(msg)
    return _numbers([item.get("logprob") for item in content], f"{path}[*].logprob")


def _epochs(obj: dict[str, Any], key: str, where: str = _CHOICE) -> list[tuple[int, int]]:
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
            msg = f"{where}.{key} is not a list of [start_token_index, epoch] pairs"
            raise BadField(msg)
        pairs.append((item[0], item[1]))
    return pairs
