"""Pausing OpenAI-compatible servers for weight updates: the control endpoints of vLLM and
SGLang, the client-side hold, and the continuation of aborted requests.

:class:`~trio_rollouts.inference.OpenAIInference` drives these; this module holds what
does not need its HTTP client: which endpoint each server has for each step, the
per-run pause state, and how an aborted response and its continuation become one.

The endpoints (``docs/backends.md``, "Pausing for weight updates"):

- vLLM (the router mounted only with ``VLLM_SERVER_DEV_MODE=1``): ``POST /pause?mode=keep``
  or ``?mode=abort`` (query parameters, no body), ``POST /resume``. Requests that arrive
  while it is paused are admitted and held until resume.
- SGLang: ``POST /pause_generation {"mode": "in_place" | "abort"}``, ``POST
  /continue_generation {}``, and ``POST /update_weight_version {"new_version": ...,
  "abort_all_requests": false}`` (its default, ``true``, aborts every request in flight).
"""

from __future__ import annotations

import re
from typing import Any, Final, Literal, TypeGuard

import attrs
import httpx2
import trio

from ._interface import InferenceResponse
from ._pausable import WeightUpdateMode

__all__ = [
    "SERVER_KINDS",
    "PauseState",
    "ServerKind",
    "continuation_body",
    "control_root",
    "merge_continuation",
    "missing_endpoint_hint",
    "pause_call",
    "resume_calls",
]

#: The servers whose control endpoints :class:`OpenAIInference` knows.
ServerKind = Literal["vllm", "sglang"]
SERVER_KINDS: Final[tuple[ServerKind, ...]] = ("vllm", "sglang")

#: The finish reason of a request the server stopped (vLLM, SGLang).
ABORT: Final = "abort"

#: A control call: a path below the server's root and a JSON body (``None``: no body).
ControlCall = tuple[str, dict[str, Any] | None]

_VERSION_SEGMENT = re.compile(r"v\d+[a-z0-9]*", re.IGNORECASE)


@attrs.define(eq=False)
class PauseState:
    """The pause of one interface in one Trio run (it survives ``aclose()``).

    ``hold`` is set while paused: calls wait on it before they send anything, and
    calls whose request the server aborted wait on it before their continuation.
    ``server_pauses`` counts the server-side pauses begun in this run: a call that sees
    ``finish_reason == "abort"`` and a count that moved since it started was aborted by
    a pause, and is continued. (Which replicas may be paused server-side is kept on the
    interface, across runs: a server's pause outlives the run that made it.)"""

    hold: trio.Event | None = None
    mode: WeightUpdateMode | None = None
    server_pauses: int = 0
    held: int = 0

    async def wait_resumed(self) -> None:
        """Wait until no pause holds calls. Cancellable; holds nothing."""
        self.held += 1
        try:
            while self.hold is not None:
                await self.hold.wait()
        finally:
            self.held -= 1

    def release(self) -> None:
        hold, self.hold, self.mode = self.hold, None, None
        if hold is not None:
            hold.set()


def control_root(base_url: str) -> str:
    """The server's root: ``base_url`` without its API version segment (``/v1``), where
    vLLM and SGLang serve their control endpoints."""
    url = httpx2.URL(base_url)
    path = url.path.rstrip("/")
    head, _, last = path.rpartition("/")
    if _VERSION_SEGMENT.fullmatch(last):
        path = head
    return str(url.copy_with(path=path or "/")).rstrip("/")


def pause_call(server: ServerKind, mode: WeightUpdateMode) -> ControlCall:
    """The request that pauses ``server`` for ``mode`` (``keep`` or ``abort``)."""
    if server == "vllm":
        return f"/pause?mode={mode}", None
    return "/pause_generation", {"mode": "in_place" if mode == "keep" else "abort"}


def resume_calls(server: ServerKind, *, paused: bool, new_version: int | None) -> list[ControlCall]:
    """The requests that resume one replica: SGLang's weight version first (never
    aborting: ``abort_all_requests`` is always sent, ``false``), then the resume itself
    if the replica was paused server-side."""
    calls: list[ControlCall] = []
    if server == "sglang":
        if new_version is not None:
            body = {"new_version": str(new_version), "abort_all_requests": False}
            calls.append(("/update_weight_version", body))
        if paused:
            calls.append(("/continue_generation", {}))
    elif paused:
        calls.append(("/resume", None))
    return calls


def missing_endpoint_hint(server: ServerKind, path: str) -> str:
    """Why a control endpoint answers 404, and what to do."""
    if server == "vllm":
        return (
            f"; vLLM serves {path.split('?', 1)[0]} only when started with "
            "VLLM_SERVER_DEV_MODE=1 (set it in the server's environment; pause modes need "
            "vLLM >= 0.15), or pass server=None to pause client-side only (drain, restart)"
        )
    return (
        f"; this SGLang does not serve {path}: upgrade SGLang, or pass server=None to pause "
        "client-side only (drain, restart)"
    )


# --------------------------------------------------------------------------- continuation


def _completion_tokens(response: InferenceResponse) -> int | None:
    usage = response.usage
    if usage is not None:
        value = usage.get("completion_tokens")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    if response.token_ids is not None and response.prompt_length is not None:
        return len(response.token_ids) - response.prompt_length
    return None


def continuation_body(
    server: ServerKind,
    endpoint: Literal["chat", "completions"],
    body: dict[str, Any],
    partial: InferenceResponse,
    generated: str,
) -> dict[str, Any] | None:
    """The request that continues ``body`` after the server aborted it: ``generated``
    (the text of every segment so far) appended, ``max_tokens`` reduced by the tokens
    ``partial`` generated. ``None`` when ``max_tokens`` is already used up.

    Chat: the text becomes a final assistant message that the model continues
    (``continue_final_message``, which vLLM and SGLang accept; vLLM also needs
    ``add_generation_prompt: false``). Completions: the prompt followed by the text.
    """
    new = dict(body)
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        used = _completion_tokens(partial)
        if used is not None:
            if max_tokens - used <= 0:
                return None
            new["max_tokens"] = max_tokens - used
    if not generated:
        # Nothing to continue from (aborted before its first token, or only hidden
        # reasoning so far): an empty final assistant message would be rendered as a
        # closed turn, so the request is sent again as it was.
        return new
    if endpoint == "chat":
        new["messages"] = [*body["messages"], {"role": "assistant", "content": generated}]
        new["continue_final_message"] = True
        if server == "vllm":
            new["add_generation_prompt"] = False
    else:
        new["prompt"] = body["prompt"] + generated
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
    return InferenceResponse(
        response=reply,
        raw_text=raw_text,
        token_ids=token_ids,
        prompt_length=first.prompt_length if token_ids is not None else None,
        logprobs=logprobs,
        policy_epoch=first.policy_epoch,
        kv_cache_epoch=first.kv_cache_epoch,
        num_evictions=first.num_evictions + continuation.num_evictions,
        finish_reason=continuation.finish_reason,
        usage=_merge_usage(first.usage, continuation.usage),
    )
