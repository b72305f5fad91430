"""What a refusal means: the error a non-2xx reply becomes, with a hint naming what to
change (an explicit field the server refused, a ``base_url`` that is not the API root, a
missing key), and which negotiable fields a 400/422 refused
(:func:`refused_fields`, read with :mod:`._negotiation`).

Functions of the configuration, the request and the reply; nothing sends.
"""

from __future__ import annotations

from typing import Any

import httpx2

from trio_rollouts.inference._errors import InferenceError, UnsupportedFieldError, redact
from trio_rollouts.inference._interface import InferenceRequest
from trio_rollouts.inference.http._transport import Response
from trio_rollouts.inference.openai._config import OpenAIConfig
from trio_rollouts.inference.openai._control import VERSION_SEGMENT
from trio_rollouts.inference.openai._negotiation import (
    NEGOTIABLE_FIELDS,
    named_fields,
    refused_negotiable,
    says_unknown,
)
from trio_rollouts.inference.openai._parse import error_for_status

__all__ = ["options", "refused_fields", "status_error"]


def options(config: OpenAIConfig) -> dict[str, bool | None]:
    """Each negotiable field's option; a field given in ``extra_body`` is explicit."""
    options = {"return_token_ids": config.return_token_ids, "logprobs": config.return_logprobs}
    return {
        field: True if field in config.extra_body else option for field, option in options.items()
    }


def refused_fields(
    config: OpenAIConfig, response: Response, sent: dict[str, Any], said: tuple[str, object]
) -> set[str]:
    """The negotiable fields that ``sent`` carried and this 400/422 names."""
    if response.status_code not in (400, 422):
        return set()
    candidates = {
        field for field, option in options(config).items() if option is None
    } & sent.keys()
    if not candidates:
        return set()
    message, data = said
    return refused_negotiable(data, message, candidates, sent)


def status_error(
    config: OpenAIConfig,
    request: InferenceRequest,
    response: Response,
    index: int,
    path: str,
    sent: dict[str, Any],
    said: tuple[str, object],
) -> InferenceError:
    shown = config.shown_urls[index] + path
    status = response.status_code
    message, data = said
    if status in (400, 422):
        named = _named_explicit(config, request, message, data, sent, index)
        refused = tuple(sorted(field for field, (_, is_refused) in named.items() if is_refused))
        hint = ""
        if named:
            hint = "; " + redact("; ".join(hint for hint, _ in named.values()), config.api_key)
        if refused:
            return error_for_status(
                response,
                shown,
                config.api_key,
                hint,
                said=said,
                cls=UnsupportedFieldError,
                fields=refused,
            )
        return error_for_status(response, shown, config.api_key, hint, said=said)
    if status in (401, 403):
        hint = " (check api_key or OPENAI_API_KEY)"
    elif status in (404, 405):
        hint = _api_root_hint(config, index, path, message)
    elif status < 400:
        hint = " (an unexpected status: is base_url the API root, such as '.../v1'?)"
    else:
        hint = ""
    return error_for_status(response, shown, config.api_key, hint, said=said)


def _named_explicit(
    config: OpenAIConfig,
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
        for field, option in options(config).items()
        if option is True and field in sent and field not in config.extra_body
    }
    generation_args = request.generation_args.set_fields()
    candidates = strict | config.extra_body.keys() | generation_args.keys()
    named = named_fields(data, message, candidates)
    unknown = says_unknown(message)
    replica = config.shown_urls[index]
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
        elif field in config.extra_body:
            if unknown:
                hint = (
                    f"{field} (from extra_body) is not accepted by this server: remove "
                    "it from extra_body"
                )
            else:
                shown_value = f"{config.extra_body[field]!r:.40}"
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


def _api_root_hint(config: OpenAIConfig, index: int, path: str, message: str) -> str:
    """For a 404 or 405: a base_url without its API prefix, or not an API at all?"""
    root = config.shown_urls[index]
    segments = httpx2.URL(config.base_url[index]).path.strip("/").split("/")
    if not VERSION_SEGMENT.fullmatch(segments[-1]):
        versions = [i for i, segment in enumerate(segments) if VERSION_SEGMENT.fullmatch(segment)]
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
        f"{path} (endpoint={config.endpoint!r})?)"
    )
