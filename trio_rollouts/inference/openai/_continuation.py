"""Continuing a call whose request a pause aborted: the request that continues it (from
its token ids, exactly, or from its text), its seed, and how an aborted response and its
continuation become one response.

Everything here is a function of what was sent and answered; nothing sends. What a
server needs beyond this in a text continuation is its dialect's
(:meth:`~._dialect.Dialect.continuation_fields`).
"""

from __future__ import annotations

from typing import Any, Final, Literal, TypeGuard

import attrs

from trio_rollouts.inference._interface import InferenceResponse
from trio_rollouts.inference._sampling import continuation_seed

__all__ = [
    "ABORT",
    "continuation_body",
    "generated_tokens",
    "merge_continuation",
    "seed_continuation",
    "token_continuation_body",
]

#: The finish reason of a request the server stopped (vLLM, SGLang).
ABORT: Final = "abort"


def generated_tokens(response: InferenceResponse) -> int | None:
    """How many tokens ``response`` generated: by its token ids when it has them (what
    logprobs line up with), else by ``usage.completion_tokens``; ``None`` if unknown."""
    if response.token_ids is not None and response.prompt_length is not None:
        return len(response.token_ids) - response.prompt_length
    usage = response.usage
    if usage is not None:
        value = usage.get("completion_tokens")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


#: What ``max_tokens`` becomes in a continuation when the first request left it unset:
#: ``None`` ("the rest of the context"). ``/v1/completions`` defaults to 16 tokens,
#: ``/v1/chat/completions`` to the rest of the context, so leaving it out would cut a
#: chat continuation short.
_REST_OF_CONTEXT: Final = None


def _remaining_max_tokens(body: dict[str, Any], partial: InferenceResponse) -> tuple[bool, Any]:
    """``(used_up, max_tokens)`` for a continuation of ``body`` after ``partial``: the
    first request's ``max_tokens`` less the tokens already generated, or the value as
    it was when the count is unknown."""
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        used = generated_tokens(partial)
        if used is not None:
            if max_tokens - used <= 0:
                return True, None
            return False, max_tokens - used
    return False, max_tokens


def continuation_body(
    endpoint: Literal["chat", "completions"],
    body: dict[str, Any],
    partial: InferenceResponse,
    generated: str,
    chat_fields: dict[str, Any],
) -> dict[str, Any] | None:
    """The request that continues ``body`` from its *text* after the server aborted it,
    when the partial response has no token ids (:func:`token_continuation_body` is the
    exact one): ``generated`` (the text of every segment so far) appended, ``max_tokens``
    reduced by the tokens ``partial`` generated. ``None`` when ``max_tokens`` is already
    used up.

    Chat: the text becomes a final assistant message that the model continues
    (``continue_final_message``, which vLLM and SGLang accept), with the server's own
    ``chat_fields`` (vLLM needs ``add_generation_prompt: false``). Completions: the
    prompt followed by the text. The server tokenizes the text again, so the context it
    continues from may differ from the tokens it sampled (special tokens are left out of
    the text, and a boundary may tokenize differently).
    """
    new = dict(body)
    used_up, max_tokens = _remaining_max_tokens(body, partial)
    if used_up:
        return None
    if max_tokens is not None:
        new["max_tokens"] = max_tokens
    if not generated:
        # Nothing to continue from (aborted before its first token, or only hidden
        # reasoning so far): an empty final assistant message would be rendered as a
        # closed turn, so the request is sent again as it was.
        return new
    if endpoint == "chat":
        new["messages"] = [*body["messages"], {"role": "assistant", "content": generated}]
        new["continue_final_message"] = True
        new.update(chat_fields)
    else:
        new["prompt"] = body["prompt"] + generated
    return new


#: Fields of the first request that a token-id continuation does not carry: the prompt
#: in its chat or text form (the token ids replace it), the tools (rendered into those
#: ids already) and the chat-only options.
_NOT_CONTINUED = frozenset(
    {
        "messages",
        "prompt",
        "tools",
        "tool_choice",
        "top_logprobs",
        "logprobs",
        "continue_final_message",
        "add_generation_prompt",
        "chat_template",
        "chat_template_kwargs",
    }
)


def token_continuation_body(
    body: dict[str, Any], partial: InferenceResponse
) -> dict[str, Any] | None:
    """The request that continues ``body`` *exactly* after the server aborted it: a
    ``/v1/completions`` request whose prompt is the token ids so far (``partial.token_ids``:
    the prompt's and every segment's generated ids), so the server continues from the
    very context the merged rollout reports. ``max_tokens`` is the first request's less
    the tokens generated, or ``None`` (the rest of the context) when the first left it
    unset. ``None`` when ``max_tokens`` is already used up.

    vLLM and SGLang take a list of token ids as a completions prompt, as the OpenAI API
    does. Every other field is the first request's (sampling arguments, ``extra_body``,
    ``return_token_ids``), but for the prompt's chat or text form and the chat-only
    options; logprobs, when the first asked for them, are asked in the completions form
    (``logprobs: 1``).
    """
    if partial.token_ids is None:
        msg = "a token-id continuation needs the partial response's token ids"
        raise ValueError(msg)
    used_up, max_tokens = _remaining_max_tokens(body, partial)
    if used_up:
        return None
    new = {key: value for key, value in body.items() if key not in _NOT_CONTINUED}
    new["prompt"] = list(partial.token_ids)
    new["max_tokens"] = max_tokens if max_tokens is not None else _REST_OF_CONTEXT
    if body.get("logprobs"):
        new["logprobs"] = 1
    return new


def _merge_usage(
    first: dict[str, Any] | None, second: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The usage of one call made of two requests: the first's prompt (the second's
    repeats it, with the partial output), the completion tokens of both."""
    if first is None or second is None:
        return first if second is None else second
    merged = dict(first)
    before, after = first.get("completion_tokens"), second.get("completion_tokens")
    if _is_count(before) and _is_count(after):
        merged["completion_tokens"] = completion = before + after
        prompt = first.get("prompt_tokens")
        if _is_count(prompt):
            merged["total_tokens"] = prompt + completion
    return merged


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def merge_continuation(
    first: InferenceResponse, continuation: InferenceResponse
) -> InferenceResponse:
    """One response from an aborted one and its continuation: the text of both, the
    second's finish reason, the usage of one call (the first prompt, both completions),
    token ids and logprobs concatenated when both have them (the continuation's prompt
    ids, which repeat the first part, are dropped)."""
    content = first.response.content + continuation.response.content
    extra = {**first.response.extra, **continuation.response.extra}
    reply = attrs.evolve(continuation.response, content=content, extra=extra)
    token_ids = None
    if (
        first.token_ids is not None
        and continuation.token_ids is not None
        and continuation.prompt_length is not None
    ):
        token_ids = first.token_ids + continuation.token_ids[continuation.prompt_length :]
    logprobs = None
    if first.logprobs is not None and continuation.logprobs is not None:
        logprobs = first.logprobs + continuation.logprobs
    raw_text = None
    if first.raw_text is not None:
        raw_text = first.raw_text + continuation.response.content
    mode = first.logprobs_mode
    if mode != continuation.logprobs_mode:
        mode = "unknown"  # served by replicas that sample differently: no one mode
    return InferenceResponse(
        response=reply,
        raw_text=raw_text,
        token_ids=token_ids,
        prompt_length=first.prompt_length if token_ids is not None else None,
        logprobs=logprobs,
        policy_epoch=_merge_boundaries(first, continuation, "policy_epoch"),
        kv_cache_epoch=_merge_boundaries(first, continuation, "kv_cache_epoch"),
        num_evictions=first.num_evictions + continuation.num_evictions,
        finish_reason=continuation.finish_reason,
        usage=_merge_usage(first.usage, continuation.usage),
        logprobs_mode=mode,
        sampling_mask=_merge_masks(first.sampling_mask, continuation.sampling_mask),
    )


def _merge_boundaries(
    first: InferenceResponse,
    continuation: InferenceResponse,
    field: Literal["policy_epoch", "kv_cache_epoch"],
) -> list[tuple[int, int]]:
    """The ``policy_epoch`` (or ``kv_cache_epoch``) of an aborted response and its
    continuation: the first's boundaries, then the continuation's moved past the tokens
    the first generated (a boundary only where the epoch changes; one at the same index
    replaces the last). Without the continuation's, the first's (a server that stamps
    only the first segment cannot say more); without the first's and with tokens
    before, none (the caller stamps the epoch the call started under)."""
    first_boundaries: list[tuple[int, int]] = getattr(first, field)
    continued: list[tuple[int, int]] = getattr(continuation, field)
    if not continued:
        return first_boundaries
    before = generated_tokens(first)
    if not first_boundaries:
        # Only a first segment that generated nothing has nothing to stamp.
        return list(continued) if before == 0 else []
    if before is None:
        return first_boundaries
    merged = list(first_boundaries)
    for start, epoch in continued:
        if epoch == merged[-1][1]:
            continue
        if merged[-1][0] == before + start:
            merged[-1] = (before + start, epoch)
            if len(merged) > 1 and merged[-2][1] == epoch:
                merged.pop()
        else:
            merged.append((before + start, epoch))
    return merged


def _merge_masks(first: Any, continuation: Any) -> Any:
    """Sampling masks (one entry per generated token) of both segments, or ``None``."""
    if isinstance(first, list) and isinstance(continuation, list):
        return first + continuation
    return None


def seed_continuation(
    continued: dict[str, Any], body: dict[str, Any], continuation: int
) -> dict[str, Any]:
    """``continued`` (the ``continuation``-th continuation of ``body``, 1-based) with its
    own seed, :func:`~._sampling.continuation_seed` of the first request's, when that
    one has a seed: a continuation must not replay the first request's random stream."""
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        continued["seed"] = continuation_seed(seed, continuation)
    return continued
