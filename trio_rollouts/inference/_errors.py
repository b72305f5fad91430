"""The errors an inference backend raises, as one family under :class:`InferenceError`.

Each error says which URL failed, with which HTTP status and what the server said, so a
log line is enough to act on. :data:`TRANSIENT_ERRORS` lists the ones worth retrying
(connection failures, timeouts, 408, 409, 429, 5xx other than 501 and 505); the HTTP
backend retries exactly these, and callers that add their own retry layer should use the
same tuple. No error ever carries the API key: the backend redacts it from the server's
message before the error is built.

Where they come from: an HTTP status maps to its class in ``openai._parse.status_class``,
and a request that got no response (either transport's exception) in
``http._transport.transport_error``; nothing else maps errors. Both pass every message
through :func:`redact` first, which lives here, with the errors it keeps clean.
"""

from __future__ import annotations

import functools
import re
from typing import Any

__all__ = [
    "TRANSIENT_ERRORS",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "InferenceConnectionError",
    "InferenceError",
    "InferenceTimeoutError",
    "MalformedResponseError",
    "NotSupportedError",
    "RateLimitError",
    "ServerError",
    "TokenMismatchError",
    "UnsupportedFieldError",
    "redact",
]


def _rebuild(cls: type[InferenceError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class InferenceError(Exception):
    """Base of every error an inference backend raises.

    Attributes:
        url: the URL of the failed request (without credentials), or ``None``.
        status: the HTTP status code, or ``None`` when no response arrived.
        server_message: what the server said about the error (its JSON ``message`` or
            the start of its body), with any API key redacted; ``None`` if nothing.
        retry_after: seconds the server asked us to wait (``Retry-After``), or ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        status: int | None = None,
        server_message: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.url = url
        self.status = status
        self.server_message = server_message
        self.retry_after = retry_after

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only attributes do not survive Exception's default pickling.
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


class AuthenticationError(InferenceError):
    """The server refused the credentials (HTTP 401 or 403). Not retried."""


class BadRequestError(InferenceError):
    """The server rejected the request (a 4xx other than 401, 403, 408, 409 and 429).
    Not retried: sending it again would fail again."""


class UnsupportedFieldError(BadRequestError):
    """The server refused a request field that was asked for explicitly: a
    ``return_token_ids=True`` or ``return_logprobs=True`` option, an ``extra_body`` key, or
    a set ``GenerationArgs`` field (a 400 or 422 whose message names it). Not retried; the
    message says which server refused which field and how to stop sending it.

    Attributes:
        fields: the refused request fields, sorted (``("return_token_ids",)``).
    """

    def __init__(
        self,
        message: str,
        *,
        fields: tuple[str, ...] = (),
        url: str | None = None,
        status: int | None = None,
        server_message: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(
            message,
            url=url,
            status=status,
            server_message=server_message,
            retry_after=retry_after,
        )
        self.fields = fields


class ConflictError(InferenceError):
    """HTTP 409: the server could not serve the request now (e.g. a lock). Transient."""


class RateLimitError(InferenceError):
    """HTTP 429: too many requests. Transient; ``retry_after`` says how long to wait."""


class ServerError(InferenceError):
    """HTTP 5xx other than 501 and 505: the server failed. Transient."""


class NotSupportedError(InferenceError):
    """HTTP 501 Not Implemented or 505 HTTP Version Not Supported: the server does not
    implement what the request asks (an endpoint, a feature). Not retried: asking again
    gets the same answer. Not a :class:`ServerError`, so ``except ServerError`` and
    :data:`TRANSIENT_ERRORS` leave it out."""


class InferenceTimeoutError(InferenceError):
    """A connect, read, write or pool timeout, or HTTP 408. Transient."""


class InferenceConnectionError(InferenceError):
    """The connection failed or broke before a complete response arrived. Transient."""


class MalformedResponseError(InferenceError):
    """The server answered 2xx with a body that is not the JSON the API promises. Not
    retried: a server that returns garbage usually keeps doing so."""


class TokenMismatchError(MalformedResponseError):
    """The server generated from other token ids than it was sent: the
    ``prompt_token_ids`` it echoes for a token-id prompt (``InferenceRequest.prompt_ids``, or
    the exact continuation of an aborted call) differ from the ids sent, because it
    re-tokenized them. A rollout built from the response would claim a context the model
    never saw. Not retried.

    Attributes:
        sent: the ids sent; ``echoed``: the ids the server says it used; ``index``: the
        first position where they differ.
    """

    def __init__(
        self,
        message: str,
        *,
        sent: list[int] | None = None,
        echoed: list[int] | None = None,
        index: int = 0,
        url: str | None = None,
    ) -> None:
        super().__init__(message, url=url)
        self.sent = sent or []
        self.echoed = echoed or []
        self.index = index


#: The errors worth retrying: the server or the network may recover. The HTTP backend
#: retries these (at most ``max_retries`` times) and nothing else.
TRANSIENT_ERRORS: tuple[type[InferenceError], ...] = (
    InferenceConnectionError,
    InferenceTimeoutError,
    ConflictError,
    RateLimitError,
    ServerError,
)


# --------------------------------------------------------------------------- redaction


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


def redact(text: str, api_key: str | None) -> str:
    """``text`` without credentials: header values, bearer tokens, URL query keys and
    passwords, and ``api_key`` wherever it stands as a token of its own."""
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    if api_key:
        text = _standalone(api_key).sub("***", text)
    return text
