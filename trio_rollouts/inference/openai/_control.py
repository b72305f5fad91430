"""Pausing OpenAI-compatible servers for weight updates: the control endpoints of vLLM and
SGLang, their fan-out over the replicas, the client-side hold, and the continuation of
aborted requests.

:class:`~trio_rollouts.inference.OpenAIInference` drives these through
:class:`ControlEndpoints`, which sends each step to every replica concurrently through the
run's :class:`~._transport.Transport` (retrying as generation requests are, through
stamina) and reports the replicas that failed; the interface keeps the state (the
epoch, the hold, which replicas may be paused). This module also holds which endpoint each
server has for each step, the per-run pause state, and how an aborted response and its
continuation become one.

The endpoints (``docs/pausing-servers.md``):

- vLLM (the router mounted only with ``VLLM_SERVER_DEV_MODE=1``): ``POST
  /pause?mode=keep&clear_cache=false`` or ``?mode=abort&clear_cache=false`` (query
  parameters, no body), ``POST /resume``. Requests that arrive
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

from trio_rollouts.inference._errors import InferenceError, InferenceTimeoutError
from trio_rollouts.inference._interface import InferenceResponse
from trio_rollouts.inference._pausable import WeightUpdateError, WeightUpdateMode
from trio_rollouts.inference._retry import RetryBackoff, call_with_retries
from trio_rollouts.inference._sampling import continuation_seed
from trio_rollouts.inference.http._transport import Transport, encode_json
from trio_rollouts.inference.openai._parse import error_for_status

__all__ = [
    "SERVER_KINDS",
    "VERSION_SEGMENT",
    "ControlEndpoints",
    "PauseState",
    "ServerKind",
    "continuation_body",
    "control_root",
    "generated_tokens",
    "merge_continuation",
    "missing_endpoint_hint",
    "pause_call",
    "resume_calls",
    "seed_continuation",
    "token_continuation_body",
]

#: The servers whose control endpoints :class:`OpenAIInference` knows.
ServerKind = Literal["vllm", "sglang"]
SERVER_KINDS: Final[tuple[ServerKind, ...]] = ("vllm", "sglang")

#: The finish reason of a request the server stopped (vLLM, SGLang).
ABORT: Final = "abort"

#: A control call: a path below the server's root and a JSON body (``None``: no body).
ControlCall = tuple[str, dict[str, Any] | None]

#: The last path segment of an API root: "v1", "v2", "v1beta".
VERSION_SEGMENT = re.compile(r"v\d+[a-z0-9]*", re.IGNORECASE)

#: How long resuming may take, all replicas together, before it gives up (shielded).
RESUME_TIMEOUT: Final = 60.0

#: The control paths that end a server-side pause.
_RESUME_PATHS = frozenset({"/resume", "/continue_generation"})


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
    if VERSION_SEGMENT.fullmatch(last):
        path = head
    return str(url.copy_with(path=path or "/")).rstrip("/")


def pause_call(server: ServerKind, mode: WeightUpdateMode) -> ControlCall:
    """The request that pauses ``server`` for ``mode`` (``keep`` or ``abort``)."""
    if server == "vllm":
        # clear_cache defaults to true in vLLM 0.32 and then, whatever the route's
        # docstring says, resets the caches with every running request preempted: keep
        # would lose the KV cache it exists to keep, and abort would empty the prefix
        # cache its continuations reuse.
        return f"/pause?mode={mode}&clear_cache=false", None
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
            "vLLM >= 0.16), or pass server=None to pause client-side only (drain, restart)"
        )
    return (
        f"; this SGLang does not serve {path}: upgrade SGLang, or pass server=None to pause "
        "client-side only (drain, restart)"
    )


# --------------------------------------------------------------------------- fan-out


@attrs.frozen(kw_only=True, eq=False)
class ControlEndpoints:
    """The control endpoints of one interface's replicas (index = replica), and the
    fan-out of a pause or a resume to all of them.

    ``paused`` arguments are the interface's set of replicas that may be paused
    server-side (a pause was sent and no resume has succeeded since); these methods
    update it as replies arrive.
    """

    server: ServerKind
    roots: tuple[str, ...]  # each replica's root (base_url less "/v1")
    shown_roots: tuple[str, ...]  # the same without credentials, for messages
    api_key: str | None
    max_retries: int
    backoff: RetryBackoff

    async def pause(
        self, transport: Transport, mode: WeightUpdateMode, paused: set[int]
    ) -> WeightUpdateError | None:
        """Pause every replica for ``mode`` (``keep`` or ``abort``), concurrently, without
        retrying; return once all have answered: ``None`` if all paused, else the
        :class:`WeightUpdateError` to raise (from the first failure, the others as notes),
        once the caller has resumed them. Cancellation: replicas may be left paused."""
        path, body = pause_call(self.server, mode)
        failures: dict[int, InferenceError] = {}

        async def pause_one(index: int) -> None:
            paused_before = index in paused
            paused.add(index)
            try:
                await self.post(transport, index, path, body, retries=0)
            except InferenceError as exc:
                failures[index] = exc
                if exc.status is not None and 400 <= exc.status < 500 and not paused_before:
                    paused.discard(index)  # refused: this pause did not pause it

        async with trio.open_nursery() as nursery:
            for index in range(len(self.roots)):
                nursery.start_soon(pause_one, index)
        if not failures:
            return None
        index = min(failures)
        cause = failures[index]
        msg = (
            f"pausing {self.server} for mode {mode!r} failed at {self.shown_roots[index]} "
            f"({len(failures)} of {len(self.roots)} replicas failed): {cause}"
        )
        error = WeightUpdateError(msg)
        error.__cause__ = cause
        for other, exc in sorted(failures.items())[1:]:
            error.add_note(f"{self.shown_roots[other]} failed too: {exc}")
        return error

    async def resume(
        self, transport: Transport, paused: set[int], new_version: int | None
    ) -> InferenceError | None:
        """Resume every replica in ``paused`` and, with SGLang, send ``new_version`` (if not
        ``None``) to every replica first; concurrently, retrying transient failures, all
        within :data:`RESUME_TIMEOUT`. Returns ``None``, or the error to raise: the first
        replica's failure, with a note that it may still be paused and the others as
        notes. A replica that failed stays in ``paused``.

        Cancellation: runs shielded, bounded by :data:`RESUME_TIMEOUT`.
        """
        failures: dict[int, InferenceError] = {}
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + RESUME_TIMEOUT
            async with trio.open_nursery() as nursery:
                for index in range(len(self.roots)):
                    calls = resume_calls(
                        self.server, paused=index in paused, new_version=new_version
                    )
                    if calls:
                        nursery.start_soon(
                            self._resume_one, transport, index, calls, paused, failures
                        )
        if scope.cancelled_caught:
            for index in paused - failures.keys():
                shown = self.shown_roots[index]
                failures[index] = InferenceTimeoutError(
                    f"resuming {shown} did not finish within {RESUME_TIMEOUT} s", url=shown
                )
        if not failures:
            return None
        index = min(failures)
        error = failures[index]
        error.add_note(f"{self.server} replica {self.shown_roots[index]} may still be paused")
        for other, exc in sorted(failures.items())[1:]:
            error.add_note(f"{self.shown_roots[other]} failed to resume too: {exc}")
        return error

    async def _resume_one(
        self,
        transport: Transport,
        index: int,
        calls: list[ControlCall],
        paused: set[int],
        failures: dict[int, InferenceError],
    ) -> None:
        first: InferenceError | None = None
        for path, body in calls:  # every call is made, even after one fails
            try:
                await self.post(transport, index, path, body, retries=self.max_retries)
            except InferenceError as exc:
                first = first or exc
            else:
                if path in _RESUME_PATHS:
                    paused.discard(index)
        if first is not None:
            failures[index] = first

    async def post(
        self,
        transport: Transport,
        index: int,
        path: str,
        body: dict[str, Any] | None,
        *,
        retries: int,
    ) -> None:
        """POST one control request to replica ``index``'s root; a non-2xx answer is its
        :class:`InferenceError` (a 404 or 405 says how to get the endpoint). Transient
        failures are retried ``retries`` times, waiting as the backoff says."""
        url = self.roots[index] + path
        shown = self.shown_roots[index] + path
        content = b"" if body is None else encode_json(body)

        async def attempt() -> None:
            response = await transport.post(url, shown, lambda: content)
            status = response.status_code
            if 200 <= status < 300:
                return
            hint = missing_endpoint_hint(self.server, path) if status in (404, 405) else ""
            raise error_for_status(response, shown, self.api_key, hint)

        await call_with_retries(attempt, max_retries=retries, backoff=self.backoff)


# --------------------------------------------------------------------------- continuation


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
    server: ServerKind,
    endpoint: Literal["chat", "completions"],
    body: dict[str, Any],
    partial: InferenceResponse,
    generated: str,
) -> dict[str, Any] | None:
    """The request that continues ``body`` from its *text* after the server aborted it,
    when the partial response has no token ids (:func:`token_continuation_body` is the
    exact one): ``generated`` (the text of every segment so far) appended, ``max_tokens``
    reduced by the tokens ``partial`` generated. ``None`` when ``max_tokens`` is already
    used up.

    Chat: the text becomes a final assistant message that the model continues
    (``continue_final_message``, which vLLM and SGLang accept; vLLM also needs
    ``add_generation_prompt: false``). Completions: the prompt followed by the text. The
    server tokenizes the text again, so the context it continues from may differ from
    the tokens it sampled (special tokens are left out of the text, and a boundary may
    tokenize differently).
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
        if server == "vllm":
            new["add_generation_prompt"] = False
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
