"""The token-stream element: the shared core of episodes and gateway sessions.

A conversation with a model is kept as a token stream, not a message list. An
:class:`Element` holds the ids of one trajectory element: it starts as a render of the
conversation's first messages (mask 0); each model turn is generated from exactly those
ids and appends the ids the model sampled *verbatim* (mask 1, with their logprobs, the
epochs they were generated under and how they were sampled); and only what comes between
two turns (the new messages and the next generation prompt, the renderer's
:meth:`~trio_rollouts.Renderer.bridge`) is rendered, with mask 0. So every turn's prompt
is a prefix of the element's ids (the *extension property*), and the trainer gets the ids
the model saw and sampled, never a re-tokenization of them. When no bridge can be proved,
a new element starts from a full render (a *break*).

The helpers here are what both runners of such streams need:
:class:`~trio_rollouts.MultiTurnAgent` (an environment answers each turn) and the
gateway's sessions (an agent's HTTP calls make the turns): how faithful a backend's ids
are (:data:`RANK`, :func:`backend_fidelity`), reading a turn's ids off a response
(:func:`read_turn`), closing a cut turn and bridging to the next (:func:`close_ids`,
:func:`bridge_ids`), starting a new element (:func:`start_element`), the per-turn record
(:func:`numbered`, :func:`turn_record`), the rollout (:func:`token_rollout`) and the
epoch a call started under (:func:`call_start_epoch_or`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, TypeVar

import attrs

from trio_rollouts._context import current_call
from trio_rollouts._messages import ChatMessage, GenerationArgs
from trio_rollouts.episodes._errors import describe_backend, token_mismatch
from trio_rollouts.inference._interface import (
    InferenceInterface,
    InferenceResponse,
    ReturnsLogProbs,
    ReturnsTokens,
    accepts_tokens,
)
from trio_rollouts.inference._pausable import Pausable
from trio_rollouts.models._requests import GroupedRolloutRequest
from trio_rollouts.models._rollouts import FIDELITY_LEVELS, SamplingSpan, TokenRollout
from trio_rollouts.pipeline._sampling import sampling_span
from trio_rollouts.renderers import AssistantTurn, Renderer

__all__ = [
    "RANK",
    "Element",
    "backend_fidelity",
    "bridge_ids",
    "call_start_epoch_or",
    "close_ids",
    "numbered",
    "read_turn",
    "start_element",
    "takes_messages",
    "token_rollout",
    "turn_record",
]

_Default = TypeVar("_Default", int, None)

#: Each fidelity level's rank: higher is more faithful.
RANK = {level: len(FIDELITY_LEVELS) - i for i, level in enumerate(FIDELITY_LEVELS)}


def backend_fidelity(interface: object) -> str:
    """The fidelity a backend's markers promise for each turn: ``"exact"`` when it
    generates from ids, ``"server_tokens"`` when it returns the ids it rendered and
    sampled, else ``"retokenized"``."""
    if accepts_tokens(interface):
        return "exact"
    if isinstance(interface, ReturnsTokens):
        return "server_tokens"
    return "retokenized"


def call_start_epoch_or(default: _Default) -> int | _Default:
    """The policy epoch the running call (or this member of it, generated again after a
    cut) started under, from the pipeline's call context; ``default`` outside a
    pipeline."""
    epoch = current_call().start_epoch
    return default if epoch is None else epoch


def request_start_epoch(request: GroupedRolloutRequest) -> int:
    """The policy epoch a group of ``request`` starts under: the pipeline's, for a call
    it runs; called outside a pipeline, the epoch its stream would start under
    (``request.initial_epoch``, else a pausable backend's current epoch, else 0)."""
    epoch = call_start_epoch_or(None)
    if epoch is not None:
        return epoch
    if request.initial_epoch is not None:
        return request.initial_epoch
    interface = request.inference_interface
    return interface.policy_epoch if isinstance(interface, Pausable) else 0


@attrs.define(eq=False)
class Element:
    """One trajectory element being built: its ids, which were sampled, their logprobs,
    and the epoch boundaries."""

    ids: list[int]
    mask: list[bool]
    logprobs: list[float] | None = attrs.field(factory=list)
    policy_epoch: list[tuple[int, int]] = attrs.field(factory=list)
    kv_cache_epoch: list[tuple[int, int]] = attrs.field(factory=list)
    evictions: int = 0
    #: How each turn's ids were sampled (one span per turn that sampled ids).
    sampling: list[SamplingSpan] = attrs.field(factory=list)

    @classmethod
    def scaffold(cls, ids: list[int]) -> Element:
        """A new element of rendered ids (mask 0), nothing sampled yet."""
        return cls(ids=list(ids), mask=[False] * len(ids))

    def extend(self, ids: Sequence[int]) -> None:
        """Append ids that were not sampled (mask 0)."""
        self.ids.extend(ids)
        self.mask.extend([False] * len(ids))

    def sampled(
        self, ids: Sequence[int], logprobs: Sequence[float] | None, response: InferenceResponse
    ) -> None:
        """Append one turn's sampled ids (mask 1), their logprobs and epochs."""
        offset = len(self.ids)
        self.ids.extend(ids)
        self.mask.extend([True] * len(ids))
        if logprobs is None:
            self.logprobs = None
        elif self.logprobs is not None:
            self.logprobs.extend(logprobs)
        self.evictions += response.num_evictions
        if ids:
            last = len(self.ids) - 1
            for start, epoch in response.policy_epoch:
                _boundary(self.policy_epoch, min(offset + start, last), epoch)
            for start, epoch in response.kv_cache_epoch:
                _boundary(self.kv_cache_epoch, min(offset + start, last), epoch)

    def take(
        self,
        sampled: list[int],
        logprobs: list[float] | None,
        response: InferenceResponse,
        args: GenerationArgs,
        start_epoch: int,
    ) -> int:
        """Append one turn's sampled ids with their record (:meth:`sampled`, the
        sampling span, and ``start_epoch`` where the backend stamped no epoch); return
        the position of the first one."""
        offset = len(self.ids)
        self.sampled(sampled, logprobs, response)
        if sampled:
            self.sampling.append(sampling_span(offset, args, response))
        if not response.policy_epoch and sampled:
            self.unstamped(start_epoch, offset)
        elif not self.policy_epoch:
            self.unstamped(start_epoch, 0)
        return offset

    def unstamped(self, epoch: int, offset: int) -> None:
        """A turn whose backend stamped no epoch, from ``offset``: generated under
        ``epoch`` (the group's ``start_epoch``)."""
        _boundary(self.policy_epoch, offset, epoch)
        _boundary(self.kv_cache_epoch, offset, epoch)


def _boundary(boundaries: list[tuple[int, int]], index: int, epoch: int) -> None:
    """Add an ``(index, epoch)`` boundary: the first is at 0; later ones only where the
    epoch changes, at strictly increasing indices."""
    if not boundaries:
        boundaries.append((0, epoch))
        return
    start, current = boundaries[-1]
    if current == epoch:
        return
    if start >= index:
        boundaries[-1] = (start, epoch)
        if len(boundaries) > 1 and boundaries[-2][1] == epoch:
            boundaries.pop()
    else:
        boundaries.append((index, epoch))


def start_element(elements: list[Element], ids: list[int]) -> Element:
    """A new element of the rendered ``ids`` at the end of ``elements``: it replaces the
    last one when that has no sampled id yet (a scaffold that no turn was taken from),
    else it is appended."""
    element = Element.scaffold(ids)
    if elements and not any(elements[-1].mask):
        elements[-1] = element
    else:
        elements.append(element)
    return element


def read_turn(
    interface: InferenceInterface,
    renderer: Renderer,
    expected: list[int],
    response: InferenceResponse,
    kind: str,
) -> tuple[str, list[int], list[float] | None, list[int] | None]:
    """A turn's ``(fidelity, sampled ids, logprobs, server prompt)`` from ``response``
    to a request for the ids ``expected``: the returned ids when there are any (checked
    against ``expected``: a token-in turn that differs is a
    :class:`~trio_rollouts.inference.TokenMismatchError`; a chat turn's different prompt
    is returned as the server prompt, a break), else the text encoded again
    (``"retokenized"``). Logprobs that are not one per sampled id are a ``ValueError``
    from a backend that promises them, else dropped."""
    token_ids = response.token_ids
    if token_ids is None or kind == "retokenized":
        return "retokenized", renderer.encode(response.response.content), None, None
    prompt_length = response.prompt_length
    if prompt_length is None or not 0 <= prompt_length <= len(token_ids):
        msg = (
            f"{describe_backend(interface)} returned token_ids with prompt_length="
            f"{prompt_length!r}; it must be the number of prompt ids in token_ids"
        )
        raise ValueError(msg)
    prompt, sampled = token_ids[:prompt_length], token_ids[prompt_length:]
    server_prompt = None
    if prompt != expected:
        if kind == "exact":
            raise token_mismatch(interface, expected, prompt)
        server_prompt = prompt
    logprobs = response.logprobs
    if logprobs is not None and len(logprobs) != len(sampled):
        if isinstance(interface, ReturnsLogProbs):
            msg = (
                f"{describe_backend(interface)} returned {len(logprobs)} logprobs for "
                f"{len(sampled)} sampled ids; it must return one per sampled id"
            )
            raise ValueError(msg)
        logprobs = None
    return kind, sampled, logprobs, server_prompt


def close_ids(renderer: Renderer, sampled: Sequence[int], may_be_open: bool) -> list[int]:
    """The ids that close the last turn before the bridge: the renderer's ``close_ids``
    when the turn may lack its stop id (``may_be_open``: cut by ``max_tokens``, or
    retokenized, whose text never shows the stop token) and its sampled ids do not end
    on one; else none."""
    if may_be_open and not (sampled and sampled[-1] in renderer.stop_token_ids):
        return list(renderer.close_ids)
    return []


def takes_messages(renderer: Renderer) -> bool:
    """Whether ``renderer.bridge`` takes the conversation at hand (``messages=``): a
    renderer written before it existed is called without. It costs an
    ``inspect.signature``: work it out once per renderer and runner."""
    try:
        parameters = inspect.signature(renderer.bridge).parameters
    except (TypeError, ValueError):
        return False
    return "messages" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def bridge_ids(
    renderer: Renderer,
    ids: list[int],
    new_messages: list[ChatMessage],
    *,
    tools: list[dict[str, Any]] | None,
    conversation: list[ChatMessage],
    with_messages: bool,
) -> list[int] | None:
    """``renderer.bridge(ids, new_messages, tools=tools)``: the ids that carry the
    stream ``ids`` (the element, closed) on to the next generation prompt after
    ``new_messages``, or ``None`` when the renderer cannot prove them. The conversation
    so far is passed as ``messages=`` when the renderer takes it (``with_messages``,
    from :func:`takes_messages`)."""
    if with_messages:
        return renderer.bridge(  # type: ignore[call-arg]
            ids, new_messages, tools=tools, messages=conversation
        )
    return renderer.bridge(ids, new_messages, tools=tools)


def numbered(renderer: Renderer, turn: AssistantTurn, number: int) -> AssistantTurn:
    """The turn with the call ids a parser made up (``call_<index>``) made unique within
    the episode: the renderer's ``call_id(turn, index)`` where it has one (Mistral's
    templates take only nine letters and digits), else ``call_<turn>_<index>``; ids the
    model wrote are kept."""
    if not turn.tool_calls:
        return turn
    make = getattr(renderer, "call_id", None)
    calls = tuple(
        attrs.evolve(
            call,
            id=make(number, index) if callable(make) else f"call_{number}_{index}",
        )
        if call.id == f"call_{index}"
        else call
        for index, call in enumerate(turn.tool_calls)
    )
    return attrs.evolve(turn, tool_calls=calls)


def turn_record(
    turn: AssistantTurn, response: InferenceResponse, element: int, start: int, end: int
) -> dict[str, Any]:
    """A turn's entry in a rollout's ``per_turn`` record: where its ids are, why it
    stopped, its tool calls."""
    return {
        "element": element,
        "start": start,
        "end": end,
        "finish_reason": response.finish_reason,
        "tool_calls": [
            {
                "id": call.id,
                "name": call.name,
                "arguments": call.arguments,
                "error": call.parse_error,
            }
            for call in turn.tool_calls
        ],
    }


def token_rollout(
    elements: list[Element],
    *,
    start_epoch: int,
    reward: float,
    fidelity: str,
    env_id: str,
    problem_id: str | None,
    extra: dict[str, Any],
) -> TokenRollout:
    """The :class:`~trio_rollouts.TokenRollout` of ``elements``, one trajectory element
    each: an element no backend stamped an epoch on is stamped ``start_epoch`` from 0;
    ``logprobs`` is ``None`` when any element lacks them."""
    for element in elements:
        if not element.policy_epoch:
            element.unstamped(start_epoch, 0)
    has_logprobs = all(element.logprobs is not None for element in elements)
    return TokenRollout(
        trajectory=[element.ids for element in elements],
        reward=reward,
        generation_mask=[element.mask for element in elements],
        logprobs=[element.logprobs or [] for element in elements] if has_logprobs else None,
        env_id=env_id,
        problem_id=problem_id,
        policy_epoch=[element.policy_epoch for element in elements],
        # None at all (a backend that reports no cache epochs) is written as for a
        # single-turn rollout: an empty list, not one empty list per element.
        kv_cache_epoch=[element.kv_cache_epoch for element in elements]
        if any(element.kv_cache_epoch for element in elements)
        else [],
        num_evictions=[element.evictions for element in elements],
        fidelity=fidelity,
        sampling=[element.sampling for element in elements],
        extra=extra,
    )
