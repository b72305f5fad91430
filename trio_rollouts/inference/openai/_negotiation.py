"""Capability negotiation: which extension fields each replica of an HTTP backend accepts.

:class:`~trio_rollouts.inference.OpenAIInference` asks for two things beyond the core
OpenAI API: token ids (``return_token_ids``, a vLLM extension) and log-probabilities
(``logprobs``). Servers differ: vLLM honours both, most servers ignore what they do not
know, and strict ones (``transformers serve``, api.openai.com) reject the whole request
with a 400 or 422 that names the field. With an option left at ``None`` the backend asks,
and when a replica refuses a request naming such a field, it stops sending that field to
that replica, logs it once, and sends the same request again. This module holds what was
learned (on the interface, so it outlives a Trio run) and reads a refusal: which fields
does a 400/422 body name?

The memory is per interface and per replica, written from whichever task or thread
learns something first. It needs no lock: a replica's set only grows (``set.add``), and
"log once" is ``dict.setdefault``, both atomic in CPython; readers only test membership.
A request's body is filtered by :meth:`Capabilities.without_dropped` when the transport
is about to write it (once it holds a connection), so requests that were waiting for a
connection when the first refusal arrived never carry the field: a burst of first
requests costs at most one refusal per connection. Concurrent requests already on the
wire each hit the refusal and send again, and one logs.

It also holds whether each replica takes a group in one request (``n``, for
:meth:`~trio_rollouts.inference.OpenAIInference.agenerate_group`): ``True`` until the
replica refuses ``n`` or answers one choice for ``n > 1``; from then on its groups go as
separate requests. That too only ever changes one way, and is logged once.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

__all__ = [
    "NEGOTIABLE_FIELDS",
    "Capabilities",
    "named_fields",
    "refused_negotiable",
    "says_unknown",
]

logger = logging.getLogger(__name__)

#: Request fields that may be negotiated, with the option that controls each and the
#: CLI flag that turns it off.
NEGOTIABLE_FIELDS: Mapping[str, tuple[str, str]] = {
    "return_token_ids": ("return_token_ids", "--no-token-ids"),
    "logprobs": ("return_logprobs", "--no-logprobs"),
}

#: Fields sent only with a negotiable one, and dropped with it.
_GROUPS: Mapping[str, tuple[str, ...]] = {"logprobs": ("top_logprobs",)}

# What servers say when they refuse a field they do not know (as opposed to a bad value).
_UNKNOWN_FIELD = re.compile(
    r"unexpected|unrecogni[sz]ed|unknown|not permitted|extra[ _](?:forbidden|inputs?|fields?)"
    r"|not supported|unsupported|not allowed|not accepted|invalid (?:field|argument|parameter|key)",
    re.IGNORECASE,
)


@attrs.define(eq=False)
class Capabilities:
    """What one interface has learned about its replicas (index = replica)."""

    dropped: tuple[set[str], ...]
    _logged: dict[tuple[int, str], object] = attrs.field(factory=dict)
    # Per replica: whether it may be sent a request for n > 1 choices (False once it
    # refused n or answered one choice for it).
    takes_n: list[bool] = attrs.field(factory=list)

    @classmethod
    def for_replicas(cls, n: int) -> Capabilities:
        return cls(tuple(set() for _ in range(n)), takes_n=[True] * n)

    def stop_n(self, replica: int, shown_url: str, why: str) -> None:
        """Send ``replica`` no more requests for several choices: its groups go as
        separate requests from now on (``why``: what it did; logged once)."""
        self.takes_n[replica] = False
        self.warn_once(
            replica,
            "n",
            "%s %s; its groups are sent as separate requests from now on (the prompt is "
            "then shared through its prefix cache only)",
            shown_url,
            why,
        )

    def without_dropped(self, replica: int, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` minus the fields this replica refused (``body`` itself if none)."""
        dropped = self.dropped[replica]
        if not dropped:
            return body
        gone = set(dropped)
        for field in dropped:
            gone.update(_GROUPS.get(field, ()))
        return {key: value for key, value in body.items() if key not in gone}

    def warn_once(self, replica: int, key: str, message: str, *args: object) -> None:
        """Log ``message`` the first time ``key`` is warned about for ``replica``."""
        token = object()
        if self._logged.setdefault((replica, key), token) is token:
            logger.warning(message, *args)

    def drop(self, replica: int, fields: Iterable[str], shown_url: str) -> None:
        """Stop sending ``fields`` to ``replica``; log each the first time it is dropped."""
        for field in sorted(fields):
            self.dropped[replica].add(field)
            token = object()
            if self._logged.setdefault((replica, field), token) is not token:
                continue
            option, flag = NEGOTIABLE_FIELDS[field]
            logger.warning(
                "%s refused the request field %r; not sending it to this replica any more, so "
                "its responses carry no %s (set %s=False to not ask, or %s=True to require it; "
                "CLI: %s)",
                shown_url,
                field,
                "token ids" if field == "return_token_ids" else "log-probabilities",
                option,
                option,
                flag,
            )


def refused_negotiable(
    data: object, message: str, candidates: Iterable[str], sent: Mapping[str, Any]
) -> set[str]:
    """The negotiable ``candidates`` that a 400/422 names, a field sent only with one of
    them (``top_logprobs`` with ``logprobs``) standing for it: refusing it refuses both."""
    leaders = set(candidates)
    followers = {
        follower: leader
        for leader in leaders
        for follower in _GROUPS.get(leader, ())
        if follower in sent
    }
    named = named_fields(data, message, leaders | followers.keys())
    return {followers.get(field, field) for field in named}


def named_fields(data: object, message: str, candidates: Iterable[str]) -> set[str]:
    """The ``candidates`` (request fields) that a 400/422 error body names.

    A FastAPI/pydantic validation body (``{"detail": [{"loc": ["body", "field"], ...}]}``)
    names the top-level fields of its ``loc`` entries and nothing else (its ``input`` echoes
    the request, which names everything). Otherwise a field is named when OpenAI's
    ``error.param`` is that field or the message contains it as a whole word
    (``"Unexpected fields in the request: {'return_token_ids'}"``,
    ``"Unrecognized request argument supplied: return_token_ids"``).
    """
    wanted = set(candidates)
    if isinstance(data, dict):
        detail = data.get("detail")
        if isinstance(detail, list) and detail and all(isinstance(d, dict) for d in detail):
            located = {
                d["loc"][1]
                for d in detail
                if isinstance(d.get("loc"), list)
                and len(d["loc"]) >= 2
                and d["loc"][0] == "body"
                and isinstance(d["loc"][1], str)
            }
            return wanted & located
    named: set[str] = set()
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        param = data["error"].get("param")
        if isinstance(param, str) and param in wanted:
            named.add(param)
    for field in wanted - named:
        if re.search(rf"(?<![A-Za-z0-9_]){re.escape(field)}(?![A-Za-z0-9_])", message):
            named.add(field)
    return named


def says_unknown(message: str) -> bool:
    """Whether a server's error message reads as "I do not know this field"."""
    return _UNKNOWN_FIELD.search(message) is not None
