"""Multi-turn episodes, token-exact: :class:`MultiTurnAgent`.

An episode is a token stream, not a message list. Its ids start as the renderer's render
of the environment's first messages; each turn generates from exactly those ids
(``prompt_ids``) and appends the ids the model sampled *verbatim* (mask 1, with their
logprobs); the environment answers the parsed turn; and only what comes between two
assistant turns (the environment's messages and the next generation prompt, the
renderer's :meth:`~trio_rollouts.Renderer.bridge`) is rendered, with mask 0. So every
turn's prompt is a prefix of the element's ids (the *extension property*), and the
trainer gets the ids the model saw and sampled, never a re-tokenization of them.

When a bridge cannot be proved (the renderer says ``None``) or the tool set changes,
the episode either starts a new trajectory element from a full render
(``on_break="split"``) or raises :class:`TemplateBreakError`. How faithful each turn's
ids are (``fidelity``) follows from the backend: ``"exact"`` when it generates from ids
(:class:`~trio_rollouts.inference.AcceptsTokens`), ``"server_tokens"`` when it renders
the chat itself but returns the ids (:class:`~trio_rollouts.inference.ReturnsTokens`),
``"retokenized"`` when it returns text only.

Concurrency: a group's episodes run in one nursery (the first failure cancels the
others and the group fails as one, for :class:`~trio_rollouts.FailurePolicy` to retry
or skip); ``environment_concurrency`` bounds the ``reset``/``step`` calls in flight
across the agent; ``step_timeout`` bounds each ``step``; every environment is closed
exactly once, on every route, shielded and bounded.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

import attrs
import trio

from trio_rollouts._checks import int_at_least as _int_at_least
from trio_rollouts._checks import optional_int_at_least as _optional_int_at_least
from trio_rollouts._checks import seconds as _seconds
from trio_rollouts._concurrency import gather, real_leaves
from trio_rollouts._context import call_start_epoch
from trio_rollouts.agents._base import GroupedRolloutGenerator
from trio_rollouts.agents._environment import (
    BaseEnvironment,
    Environment,
    EnvironmentStep,
    check_reward,
    checked_messages,
)
from trio_rollouts.inference._errors import TokenMismatchError
from trio_rollouts.inference._interface import (
    CODE_POINTS,
    GeneratesGroups,
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    ReturnsLogProbs,
    ReturnsTokens,
    accepts_tokens,
    token_vocabulary,
)
from trio_rollouts.inference._pausable import Pausable
from trio_rollouts.inference._placement import call_episode
from trio_rollouts.inference._sampling import choice_seed
from trio_rollouts.models._messages import ChatMessage, GenerationArgs
from trio_rollouts.models._records import (
    FIDELITY_LEVELS,
    GroupedRolloutRequest,
    Problem,
    Rollout,
    RolloutGroup,
    SamplingSpan,
    TokenRollout,
)
from trio_rollouts.pipeline._cuts import cuts_possible, run_members
from trio_rollouts.pipeline._failure import StepTimeoutError
from trio_rollouts.pipeline._sampling import request_seed, sampling_span, seeded
from trio_rollouts.renderers import AssistantTurn, Renderer
from trio_rollouts.renderers._base import check_roles

__all__ = [
    "ACLOSE_SECONDS",
    "DEFAULT_MAX_EPISODE_TOKENS",
    "DEFAULT_STEP_TIMEOUT",
    "MultiTurnAgent",
    "TemplateBreakError",
    "TokenFidelityError",
    "check_vocabulary",
]

#: How long :meth:`Environment.aclose` may take (shielded) before it is abandoned.
ACLOSE_SECONDS = 5.0
#: ``MultiTurnAgent.step_timeout`` by default: five minutes. A tool call (a sandboxed
#: run, a test suite, a web request) still running after that is almost always hung, and
#: a hung step holds its group, and the group's slot in the pipeline, forever; past it
#: the step fails with the transient ``StepTimeoutError`` and the failure policy retries
#: the group.
DEFAULT_STEP_TIMEOUT = 300.0
#: ``MultiTurnAgent.max_episode_tokens`` by default: 32,768 ids, the context most RL
#: models are served with (Qwen2.5's and Qwen3's native length, vLLM's
#: ``max_model_len`` for them; Llama 3.1's 128k holds it too). No model generates past
#: its context, and without a bound each verbose tool result grows every later prompt.
DEFAULT_MAX_EPISODE_TOKENS = 32_768

#: What an Environment has (see ``_Episode.run``).
_ENVIRONMENT_PARTS = ("reset", "step", "final_reward", "aclose", "tools")

#: Each fidelity level's rank: higher is more faithful.
RANK = {level: len(FIDELITY_LEVELS) - i for i, level in enumerate(FIDELITY_LEVELS)}


class TemplateBreakError(RuntimeError):
    """An episode could not be continued as one token stream (the renderer could not
    prove a bridge, the tool set changed, or the server rendered another prompt than the
    episode's ids) and the agent's ``on_break`` is ``"raise"``. Not transient: the same
    conversation breaks the same way again."""


class TokenFidelityError(RuntimeError):
    """A turn's ids would be less faithful than the agent's ``min_fidelity`` allows: the
    message names the backend, what it lacked, and the fix. Not transient."""


def check_renderer(instance: object, attribute: attrs.Attribute[Any] | None, value: Any) -> None:
    if isinstance(value, type):
        msg = (
            f"renderer must be a Renderer instance, got the class {value.__name__}: "
            f"call it ({value.__name__}(...))"
        )
        raise TypeError(msg)
    if not isinstance(value, Renderer):
        msg = (
            f"renderer must be a Renderer (PlainRenderer, HFRenderer or one of your own), "
            f"got {type(value).__name__} {value!r:.60}"
        )
        raise TypeError(msg)


def _check_environment(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not callable(value):
        msg = (
            "environment must be a callable that makes one Environment per episode "
            f"(problem -> Environment, such as an Environment class), got {value!r:.60}"
        )
        raise TypeError(msg)


def check_on_break(instance: object, attribute: attrs.Attribute[Any] | None, value: Any) -> None:
    if value not in ("split", "raise"):
        msg = f"on_break must be 'split' or 'raise', got {value!r:.40}"
        raise ValueError(msg)


def check_min_fidelity(
    instance: object, attribute: attrs.Attribute[Any] | None, value: Any
) -> None:
    if value not in FIDELITY_LEVELS:
        allowed = ", ".join(repr(level) for level in FIDELITY_LEVELS)
        msg = f"min_fidelity must be one of {allowed}, got {value!r:.40}"
        raise ValueError(msg)


def check_vocabulary(renderer: object, interface: object, who: str) -> None:
    """Refuse a renderer whose ids ``interface`` cannot take: the backend says what its
    token ids are (:func:`~trio_rollouts.inference.token_vocabulary`) and the
    renderer's ``token_vocabulary`` is not that. A ``TypeError`` naming ``who``, the
    renderer, the backend, both vocabularies and the fix. A backend that does not know
    its vocabulary (a server's model) is taken on trust."""
    theirs = token_vocabulary(interface)
    if theirs is None:
        return
    ours = getattr(renderer, "token_vocabulary", None)
    if ours == theirs:
        return
    msg = (
        f"{who}: the renderer {type(renderer).__name__} writes {_vocabulary(ours)}, but "
        f"{describe_backend(interface)} takes and returns {_vocabulary(theirs)}: it would "
        "read every prompt as other tokens, and its sampled ids would decode to garbage. "
        "Pair them by vocabulary: PlainRenderer() with EmbeddedInference (code points); "
        "HFRenderer(tokenizer) with a backend that serves that tokenizer's model "
        "(OpenAIInference against vLLM or SGLang, or offline "
        "trio_rollouts.testing.VocabularyInference(tokenizer))"
    )
    if ours is None and theirs == CODE_POINTS:
        msg += (
            f". If {type(renderer).__name__}'s ids are Unicode code points, say so: "
            f"token_vocabulary = {CODE_POINTS!r}"
        )
    raise TypeError(msg)


def _vocabulary(vocabulary: str | None) -> str:
    if vocabulary is None:
        return "ids of no declared vocabulary (its token_vocabulary is None)"
    if vocabulary == CODE_POINTS:
        return "Unicode code points as token ids"
    return f"the token ids of the vocabulary {vocabulary!r}"


def turn_message(renderer: Renderer, turn: AssistantTurn, sampled: Sequence[int]) -> ChatMessage:
    """The turn as the conversation keeps it: the structured message
    (:meth:`AssistantTurn.to_message`), or, when a tool call could not be read, the
    text the model wrote (its ids less trailing stop ids, decoded): structured, a broken
    call would be written back as a call the model never wrote (no name, its raw text
    as a string of arguments)."""
    if all(call.arguments is not None for call in turn.tool_calls):
        return turn.to_message()
    ids = list(sampled)
    stops = set(renderer.stop_token_ids)
    while ids and ids[-1] in stops:
        ids.pop()
    return ChatMessage(role="assistant", content=renderer.decode(ids))


def backend_fidelity(interface: object) -> str:
    """The fidelity a backend's markers promise for each turn."""
    if accepts_tokens(interface):
        return "exact"
    if isinstance(interface, ReturnsTokens):
        return "server_tokens"
    return "retokenized"


def describe_backend(interface: object) -> str:
    urls = getattr(interface, "base_url", None)  # OpenAIInference's replicas
    name = type(interface).__name__
    if isinstance(urls, tuple) and urls:
        return f"{name} ({', '.join(map(str, urls))})"
    return name


def fidelity_error(interface: object, fidelity: str, minimum: str, lacked: str) -> str:
    return (
        f"{describe_backend(interface)} {lacked}, so the turn's ids would be {fidelity!r}, below "
        f"min_fidelity={minimum!r}. Use a backend that generates from token ids "
        "(AcceptsTokens: OpenAIInference against vLLM or SGLang, EmbeddedInference) or "
        "one that returns the ids it rendered and sampled (ReturnsTokens), or lower "
        f"min_fidelity to {fidelity!r} to train on these ids knowingly"
    )


def what_lacked(fidelity: str) -> str:
    if fidelity == "server_tokens":
        return "renders the chat itself (it does not generate from token ids)"
    return "returns text only (no token ids)"


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


def read_turn(
    interface: InferenceInterface,
    renderer: Renderer,
    expected: list[int],
    response: InferenceResponse,
    kind: str,
) -> tuple[str, list[int], list[float] | None, list[int] | None]:
    """A turn's ``(fidelity, sampled ids, logprobs, server prompt)`` from ``response``
    to a request for the ids ``expected``: the returned ids when there are any (checked
    against ``expected``: a token-in turn that differs is a :class:`TokenMismatchError`;
    a chat turn's different prompt is returned as the server prompt, a break), else the
    text encoded again (``"retokenized"``). Logprobs that are not one per sampled id are
    a ``ValueError`` from a backend that promises them, else dropped."""
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


@attrs.define(kw_only=True)
class MultiTurnAgent(GroupedRolloutGenerator):
    """Runs ``rollouts_per_group`` episodes of one problem concurrently and returns one
    :class:`~trio_rollouts.TokenRollout` per episode, token-exact (see the module
    docstring and the docs page "Multi-turn agents and tools").

    Problems come from ``prompts`` (a :class:`~trio_rollouts.PromptSource`, one draw
    per group), or from an override of :meth:`get_problem`.

    An episode: ``ids = renderer.render(env.reset(), tools=env.tools)``; each turn
    generates from ``prompt_ids=ids`` with the request's generation arguments
    (``max_tokens`` capped by what ``max_episode_tokens`` leaves), appends the sampled ids
    with mask 1, parses them (:meth:`Renderer.parse`), calls ``env.step``, and appends
    the bridge with mask 0 (after ``close_ids`` when the turn was cut by ``max_tokens``).
    It ends when a step is ``done`` (finish ``"done"``, its reward), at ``max_turns``
    (``"max_turns"``) or when ``max_episode_tokens`` is reached (``"max_tokens"``); an
    episode ended by a limit gets ``env.final_reward()``. ``env.step`` is called for
    every turn, the last included, and its ``done`` wins over the limits.

    The rollout: one trajectory element per segment (normally one); ``generation_mask``
    True exactly on sampled ids; ``logprobs`` one per sampled id (``None`` when any turn
    has none); ``policy_epoch``/``kv_cache_epoch`` boundaries at positions in the element
    (the backend's stamps per turn, else the group's ``start_epoch``); ``fidelity`` the
    lowest of the turns'; ``extra["episode"]``: ``turns``, ``finish``, ``breaks``,
    ``tool_calls`` (a count), ``parse_errors``, ``truncated_turns`` and ``per_turn`` (one
    record per turn: its span, finish reason, calls, a non-final step's reward and
    ``info``).

    Cancellation: :meth:`group_rollout` runs the episodes in one nursery; cancelling it
    cancels every model call and environment step, closes every environment (shielded,
    at most 5 seconds each) and returns only when all of that has ended.
    """

    #: Makes one environment per episode: ``problem -> Environment`` (sync).
    environment: Callable[[Problem], Environment] = attrs.field(validator=_check_environment)
    #: The model family's chat template, in ids.
    renderer: Renderer = attrs.field(validator=check_renderer)
    #: At most this many assistant turns per episode.
    max_turns: int = attrs.field(default=8, validator=_int_at_least(1))
    #: At most this many ids per trajectory element; by default
    #: :data:`DEFAULT_MAX_EPISODE_TOKENS` (32,768, the context most RL models are served
    #: with: set your server's ``max_model_len`` when it is another); ``None``: no bound.
    max_episode_tokens: int | None = attrs.field(
        default=DEFAULT_MAX_EPISODE_TOKENS, validator=_optional_int_at_least(1)
    )
    #: Seconds one ``env.step`` may take; by default :data:`DEFAULT_STEP_TIMEOUT` (five
    #: minutes: a step still running then is almost always hung, and holds its group
    #: forever); ``None``: no deadline. Past it the step is cancelled and the episode
    #: fails with :class:`StepTimeoutError` (transient: the group is retried).
    step_timeout: float | None = attrs.field(
        default=DEFAULT_STEP_TIMEOUT, validator=_seconds(positive=True)
    )
    #: At most this many ``reset``/``step`` calls at once across the agent (``None``: no
    #: bound). Waiting for one does not count against ``step_timeout``.
    environment_concurrency: int | None = attrs.field(
        default=None, validator=_optional_int_at_least(1)
    )
    #: At most this many environments alive at once across the agent (``None``: no
    #: bound), each counted from the factory call until its ``aclose`` has returned:
    #: sandboxes held while the model generates count. An episode waits for one before
    #: its environment is made; the wait counts against no deadline of the episode's.
    live_environments: int | None = attrs.field(default=None, validator=_optional_int_at_least(1))
    #: What a template break does: ``"split"`` (a new trajectory element from a full
    #: render) or ``"raise"`` (:class:`TemplateBreakError`).
    on_break: Literal["split", "raise"] = attrs.field(default="split", validator=check_on_break)
    #: The least faithful ids a turn may have (:class:`TokenFidelityError` below it).
    min_fidelity: str = attrs.field(default="server_tokens", validator=check_min_fidelity)
    #: The environment's name, stamped on every rollout (``env_id``).
    env_id: str = attrs.field(default="", validator=attrs.validators.instance_of(str))
    # Whether renderer.bridge takes the conversation at hand (messages=).
    _bridge_takes_messages: bool = attrs.field(init=False, default=False, repr=False)
    # The environment_concurrency and live_environments limiters of the current Trio
    # run, and that run.
    _limiter: trio.CapacityLimiter | None = attrs.field(init=False, default=None, repr=False)
    _live: trio.CapacityLimiter | None = attrs.field(init=False, default=None, repr=False)
    _limiter_run: object = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        self._bridge_takes_messages = takes_messages(self.renderer)
        if self.prompts is None and type(self).get_problem is MultiTurnAgent.get_problem:
            msg = (
                f"{type(self).__name__} needs problems: pass prompts= (a PromptSource) or "
                "override get_problem(request)"
            )
            raise TypeError(msg)

    def _slot_generator(
        self, request: GroupedRolloutRequest
    ) -> Callable[[int, int], Awaitable[Sequence[Rollout | TokenRollout] | RolloutGroup]]:
        """As every agent's, once the renderer is checked against the request's backend
        (:func:`check_vocabulary`): when the stream opens, before any work."""
        check_vocabulary(self.renderer, request.inference_interface, type(self).__name__)
        return super()._slot_generator(request)

    async def get_problem(self, request: GroupedRolloutRequest) -> Problem:
        """The problem of one group: the next draw from ``prompts``. Override it to take
        problems from elsewhere.

        Cancellation: a schedule point after the draw, never cancelled (so the groups
        of one run draw their problems in the order the pipeline starts them, whatever
        order Trio runs their tasks in, and a drawn problem is never lost)."""
        if self.prompts is None:
            msg = f"{type(self).__name__} has no prompts; pass prompts= or override get_problem"
            raise ValueError(msg)
        problem = self.prompts.draw()
        await trio.lowlevel.cancel_shielded_checkpoint()
        return problem

    async def group_rollout(self, request: GroupedRolloutRequest) -> list[TokenRollout]:
        """Run ``request.rollouts_per_group`` episodes of one problem concurrently.

        Raises :class:`TokenFidelityError` before any work when the backend cannot give
        ``min_fidelity``, and ``TypeError`` when its token ids are not the renderer's
        (:func:`check_vocabulary`). The first failing episode cancels the others and is
        raised as itself, with a note naming the problem, the episode and the turn;
        episodes that failed at the same instant (the same bug in each) are named in a
        note on it and kept with it, so the failure policy classifies the group by all
        of them.

        Cancellation: cancels every model call and environment step; returns (or
        raises) only when every episode has ended and every environment was closed.
        """
        interface = request.inference_interface
        check_vocabulary(self.renderer, interface, type(self).__name__)
        fidelity = backend_fidelity(interface)
        if RANK[fidelity] < RANK[self.min_fidelity]:
            message = fidelity_error(interface, fidelity, self.min_fidelity, what_lacked(fidelity))
            raise TokenFidelityError(message)
        problem = await self.get_problem(request)
        if not isinstance(problem, Problem):
            msg = f"get_problem must return a Problem, got {type(problem).__name__}"
            raise TypeError(msg)
        start_epoch = call_start_epoch.get(None)
        if start_epoch is None:
            # Called outside the pipeline: the epoch the stream would start under.
            if request.initial_epoch is not None:
                start_epoch = request.initial_epoch
            elif isinstance(interface, Pausable):
                start_epoch = interface.policy_epoch
            else:
                start_epoch = 0
        episode = _Episode(self, problem, request, start_epoch, fidelity)
        size = request.rollouts_per_group
        extra = request.extra_rollouts
        cuttable = not request.group_calls and cuts_possible(request.max_staleness, interface)
        if (
            request.group_calls
            and size + extra > 1
            and isinstance(interface, GeneratesGroups)
            # live_environments is shared by every group: siblings waiting for each
            # other while holding slots could wait forever.
            and self.live_environments is None
        ):
            episode.first_turns = FirstTurns(interface, size + extra)
        try:
            if extra or cuttable:
                # Episodes that may be cut (see _cuts.py): the first to finish are kept.
                kept = await run_members(size, extra, episode.run)
                return [rollout for _, rollout in kept]
            return await gather(
                [
                    functools.partial(episode.run, member)
                    for member in range(request.rollouts_per_group)
                ]
            )
        finally:
            episode.warn_closes_that_failed()

    def _environment_limiter(self) -> trio.CapacityLimiter | None:
        """The limiter of ``environment_concurrency`` for the current Trio run (a new
        one per run: the sync bridge and Ray run the agent in runs of their own)."""
        self._limiters_of_this_run()
        return self._limiter

    def _live_limiter(self) -> trio.CapacityLimiter | None:
        """The limiter of ``live_environments`` for the current Trio run."""
        self._limiters_of_this_run()
        return self._live

    def _limiters_of_this_run(self) -> None:
        run = trio.lowlevel.current_root_task()
        if self._limiter_run is not run:
            self._limiter_run = run
            self._limiter = self._live = None
            if self.environment_concurrency is not None:
                self._limiter = trio.CapacityLimiter(self.environment_concurrency)
            if self.live_environments is not None:
                self._live = trio.CapacityLimiter(self.live_environments)


@attrs.define(eq=False)
class _Episode:
    """What the episodes of one group share; :meth:`run` is one episode."""

    agent: MultiTurnAgent
    problem: Problem
    request: GroupedRolloutRequest
    start_epoch: int
    #: What the backend's markers promise for every turn (a turn may still come back
    #: less faithful: see ``_Run.generate``).
    fidelity: str
    #: What aclose() raised in episodes cancelled by a sibling's failure or a shutdown:
    #: one warning for the group, not one per episode.
    closes_that_failed: list[str] = attrs.field(factory=list)
    #: The episodes' first turns as one group call (``None``: one call per episode).
    first_turns: FirstTurns | None = None

    def warn_closes_that_failed(self) -> None:
        if self.closes_that_failed:
            count, first = len(self.closes_that_failed), self.closes_that_failed[0]
            msg = (
                f"{count} episode(s) of problem {self.problem.problem_id!r} were cancelled "
                f"and then their environment's aclose() raised; the first: {first}"
            )
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    async def run(self, member: int) -> TokenRollout:
        """One episode: wait for a live environment (``live_environments``), make the
        environment, run it, close it on every route; an error gets a note naming the
        problem, the episode and where it happened."""
        limiter = self.agent._live_limiter()
        if limiter is None:
            return await self.live(member)
        async with limiter:
            return await self.live(member)

    async def live(self, member: int) -> TokenRollout:
        try:
            env = self.agent.environment(self.problem)
        except Exception as exc:
            exc.add_note(self.note(member, "making its environment"))
            raise
        # A BaseEnvironment needs no look; for anything else, a plain attribute check
        # rather than isinstance(env, Environment), a runtime protocol check that costs
        # as much as the rest of a one-turn episode's bookkeeping.
        if not isinstance(env, BaseEnvironment):
            missing = [name for name in _ENVIRONMENT_PARTS if not hasattr(env, name)]
            if missing:
                msg = (
                    f"environment({self.problem.problem_id!r}) returned a "
                    f"{type(env).__name__}, not an Environment: it has no "
                    f"{', '.join(missing)} (subclass BaseEnvironment)"
                )
                raise TypeError(msg)
        run = _Run(self, env, member)
        call_episode.set(member)  # this task's calls: the episode's turns
        try:
            try:
                rollout = await run.episode()
            finally:
                if self.first_turns is not None:
                    self.first_turns.withdraw(member)
        except BaseException as exc:
            if isinstance(exc, Exception):
                exc.add_note(self.note(member, run.where))
            await self.close(env, exc)
            raise
        try:
            await self.close(env, None)
        except Exception as exc:
            exc.add_note(self.note(member, "closing its environment"))
            raise
        return rollout

    def note(self, member: int, where: str) -> str:
        return (
            f"in episode {member} of {self.request.rollouts_per_group} of problem "
            f"{self.problem.problem_id!r}, {where}"
        )

    async def close(self, env: Environment, failure: BaseException | None) -> None:
        """``env.aclose()``, shielded and bounded by :data:`ACLOSE_SECONDS`. Its own
        error is raised when the episode succeeded, noted on the episode's error when
        it failed, and warned of once per group when it was cancelled."""
        with trio.move_on_after(ACLOSE_SECONDS, shield=True) as scope:
            try:
                await env.aclose()
            except Exception as error:
                if failure is None:
                    raise
                message = f"{type(env).__name__}.aclose() raised {error!r}"
                if real_leaves(failure):
                    failure.add_note(f"then {message}")
                else:
                    # A cancellation's note would vanish with it when its scope catches it.
                    self.closes_that_failed.append(message)
        if scope.cancelled_caught:
            msg = (
                f"{type(env).__name__}.aclose() did not finish within {ACLOSE_SECONDS} s "
                "and was cancelled; what it holds may not have been released"
            )
            warnings.warn(msg, RuntimeWarning, stacklevel=2)


@attrs.define(eq=False)
class FirstTurns:
    """The first turns of a group's episodes as one group call (``n``), when they are the
    same request.

    Each episode hands in its first request (:meth:`generate`) and waits. Once every
    episode still running has (an episode that ends before its first turn withdraws),
    the lowest-numbered one makes the call: one
    :meth:`~trio_rollouts.inference.GeneratesGroups.agenerate_group` with its request
    when all are the same but for their seed, else nothing, and each episode then makes
    its own call. With seeds, choice ``i`` was sampled with ``seed + i`` (vLLM's rule),
    ``seed`` being the lowest episode's.
    """

    interface: InferenceInterface
    expected: int
    requests: dict[int, InferenceRequest] = attrs.field(factory=dict)
    responses: dict[int, tuple[InferenceResponse, int | None]] = attrs.field(factory=dict)
    ready: trio.Event = attrs.field(factory=trio.Event)
    done: trio.Event = attrs.field(factory=trio.Event)
    separate: bool = False
    withdrawn: set[int] = attrs.field(factory=set)

    def withdraw(self, member: int) -> None:
        """Episode ``member`` has ended (or failed): it will hand in no first request."""
        if member in self.requests or member in self.withdrawn:
            return
        self.withdrawn.add(member)
        self.expected -= 1
        if self.requests and len(self.requests) >= self.expected:
            self.ready.set()

    async def generate(
        self, member: int, request: InferenceRequest
    ) -> tuple[InferenceResponse, int | None]:
        """Episode ``member``'s first turn: its response, and the seed its choice was
        sampled with when that is not its request's (``None``: its own).

        Cancellation: the group's episodes are cancelled together; a cancelled leader
        cancels the group call.
        """
        self.requests[member] = request
        if len(self.requests) >= self.expected:
            self.ready.set()
        try:
            await self.ready.wait()
        except BaseException:
            # Cut (or cancelled) before the call was made: it hands in nothing.
            del self.requests[member]
            self.withdrawn.add(member)
            self.expected -= 1
            if self.requests and len(self.requests) >= self.expected:
                self.ready.set()
            raise
        if member == min(self.requests) and not self.done.is_set():
            try:
                await self._call()
            finally:
                self.done.set()
        else:
            await self.done.wait()
        if self.separate or member not in self.responses:
            return await self.interface.agenerate(request), None
        return self.responses[member]

    async def _call(self) -> None:
        members = sorted(self.requests)
        first = self.requests[members[0]]
        interface = self.interface
        if (
            not isinstance(interface, GeneratesGroups)
            or len(members) == 1
            or not all(_same_but_seed(first, self.requests[m]) for m in members[1:])
        ):
            self.separate = True
            return
        token = call_episode.set(None)  # placed for the group, not for one episode
        try:
            responses = await interface.agenerate_group(first, len(members))
        finally:
            call_episode.reset(token)
        seed = first.generation_args.seed
        for i, (m, response) in enumerate(zip(members, responses, strict=True)):
            self.responses[m] = (response, choice_seed(seed, i))


def _same_but_seed(a: InferenceRequest, b: InferenceRequest) -> bool:
    return (
        a.prompt_ids == b.prompt_ids
        and a.tools == b.tools
        and a.prompt == b.prompt
        and attrs.evolve(a.generation_args, seed=None) == attrs.evolve(b.generation_args, seed=None)
    )


@attrs.define(eq=False)
class _Run:
    """The state of one episode while it runs."""

    shared: _Episode
    env: Environment
    member: int
    elements: list[Element] = attrs.field(factory=list)
    conversation: list[ChatMessage] = attrs.field(factory=list)
    tools: list[dict[str, Any]] | None = None
    fidelity: str = "exact"
    turns: int = 0
    breaks: int = 0
    parse_errors: int = 0
    truncated_turns: int = 0
    #: Where the episode is (for the note on an error).
    where: str = "in reset()"
    #: One record per assistant turn (``extra["episode"]["per_turn"]``).
    per_turn: list[dict[str, Any]] = attrs.field(factory=list)
    #: The epoch the episode started under: its group's, or a later one for an episode
    #: generated again after a cut (``_cuts.py``).
    start_epoch: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.start_epoch = call_start_epoch.get(self.shared.start_epoch)

    async def episode(self) -> TokenRollout:
        agent = self.shared.agent
        renderer = agent.renderer
        budget = agent.max_episode_tokens
        interface = self.shared.request.inference_interface
        self.fidelity = self.shared.fidelity
        messages = checked_messages(await self.limited(self.env.reset), "reset()")
        check_roles(renderer, messages, "reset()")
        self.conversation = list(messages)
        self.tools = self.env.tools
        self.where = "rendering reset()'s messages"
        first = renderer.render(messages, tools=self.tools)
        if budget is not None and len(first) >= budget:
            msg = (
                f"max_episode_tokens={budget} leaves no room for a turn: the first render "
                f"of problem {self.shared.problem.problem_id!r} is {len(first)} ids (it must "
                "be more than that)"
            )
            raise ValueError(msg)
        self.elements.append(Element.scaffold(first))
        finish: str
        reward: float | None = None
        while True:
            element = self.elements[-1]
            if budget is not None and budget - len(element.ids) < 1:
                finish = "max_tokens"
                break
            self.where = f"turn {self.turns + 1}, generating"
            response, sampled, kind = await self.generate(interface, element, budget)
            self.turns += 1
            start = len(self.elements[-1].ids) - len(sampled)
            self.where = f"turn {self.turns}, parsing"
            turn = numbered(renderer, renderer.parse(sampled), self.turns)
            self.parse_errors += turn.parse_error is not None
            self.where = f"turn {self.turns}, in step()"
            step = await self.step(turn)
            self.record(turn, response, start, step)
            self.where = f"turn {self.turns}, bridging to the next"
            if step.done:
                finish, reward = "done", step.reward
                break
            if budget is not None and len(self.elements[-1].ids) >= budget:
                finish = "max_tokens"
                break
            if self.turns >= agent.max_turns:
                finish = "max_turns"
                break
            cut = response.finish_reason == "length"
            if not self.go_on(sampled, turn, cut, kind == "retokenized", step):
                finish = "max_tokens"
                break
        if reward is None:
            self.where = "in final_reward()"
            reward = check_reward(await self.env.final_reward(), "final_reward()")
        return self.rollout(float(reward), finish)

    def record(
        self, turn: AssistantTurn, response: InferenceResponse, start: int, step: EnvironmentStep
    ) -> None:
        """The turn's entry in ``extra["episode"]["per_turn"]``."""
        entry = turn_record(
            turn, response, len(self.elements) - 1, start, len(self.elements[-1].ids)
        )
        entry["reward"] = None if step.done else step.reward
        entry["info"] = step.info
        self.per_turn.append(entry)

    async def generate(
        self, interface: InferenceInterface, element: Element, budget: int | None
    ) -> tuple[InferenceResponse, list[int], str]:
        """One turn: generate, check the ids, append the sampled ones; return the
        response, the sampled ids and the turn's fidelity."""
        request = self.shared.request
        args = request.generation_args
        if budget is not None:
            left = budget - len(element.ids)
            args = attrs.evolve(
                args, max_tokens=left if args.max_tokens is None else min(args.max_tokens, left)
            )
        kind = self.shared.fidelity
        if request.seed is not None:
            seed = request_seed(
                request, interface, self.shared.problem.problem_id, self.member, self.turns
            )
            args = seeded(args, seed)
        inference_request = InferenceRequest(
            prompt=list(self.conversation),
            tools=self.tools,
            generation_args=args,
            prompt_ids=list(element.ids) if kind == "exact" else None,
        )
        first = self.shared.first_turns
        if first is not None and self.turns == 0:
            response, choice_seed = await first.generate(self.member, inference_request)
            if choice_seed is not None:
                args = seeded(args, choice_seed)
        else:
            response = await interface.agenerate(inference_request)
        token_ids = response.token_ids
        if token_ids is None:
            kind = "retokenized"  # whatever the markers promised: the text is all there is
        agent = self.shared.agent
        if RANK[kind] < RANK[agent.min_fidelity]:
            lacked = "returned no token ids for this turn"
            raise TokenFidelityError(fidelity_error(interface, kind, agent.min_fidelity, lacked))
        kind, sampled, logprobs, server_prompt = read_turn(
            interface, agent.renderer, element.ids, response, kind
        )
        if server_prompt is not None:
            element = self.server_break(server_prompt)
        if kind != "exact":
            self.fidelity = min(self.fidelity, kind, key=RANK.__getitem__)
        element.take(sampled, logprobs, response, args, self.start_epoch)
        return response, sampled, kind

    def server_break(self, server_prompt: list[int]) -> Element:
        """The server rendered another prompt than the episode's ids: a break. The new
        element starts from what the model saw (an element with no sampled ids yet is
        replaced)."""
        self.broke(
            "the server rendered a prompt that differs from the episode's ids (its chat "
            "template is not the renderer's, or it re-tokenized the conversation)"
        )
        element = Element.scaffold(server_prompt)
        if any(self.elements[-1].mask):
            self.elements.append(element)
        else:
            self.elements[-1] = element
        return element

    def broke(self, why: str) -> None:
        """Count a template break, or raise it (``on_break="raise"``)."""
        if self.shared.agent.on_break == "raise":
            msg = f"turn {self.turns + 1} of problem {self.shared.problem.problem_id!r}: {why}"
            raise TemplateBreakError(msg)
        self.breaks += 1

    async def step(self, turn: AssistantTurn) -> EnvironmentStep:
        """``env.step(turn)``, within ``environment_concurrency`` and ``step_timeout``
        (waiting for a slot does not count against the deadline)."""
        step = await self.limited(functools.partial(self.timed_step, turn))
        if not isinstance(step, EnvironmentStep):
            msg = (
                f"{type(self.env).__name__}.step() returned a {type(step).__name__}, not an "
                "EnvironmentStep"
            )
            raise TypeError(msg)
        return step

    async def timed_step(self, turn: AssistantTurn) -> EnvironmentStep:
        timeout = self.shared.agent.step_timeout
        if timeout is None:
            return await self.env.step(turn)
        with trio.move_on_after(timeout):
            return await self.env.step(turn)
        msg = (
            f"{type(self.env).__name__}.step() ran past step_timeout={timeout} s on turn "
            f"{self.turns} of problem {self.shared.problem.problem_id!r} and was cancelled"
        )
        raise StepTimeoutError(msg)

    async def limited(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """Call and await ``call`` (``reset``, a timed ``step``) within
        ``environment_concurrency``: the coroutine is made only once a slot is held, so an
        episode cancelled while it waits for one leaves no coroutine that was never
        awaited."""
        limiter = self.shared.agent._environment_limiter()
        if limiter is None:
            return await call()
        async with limiter:
            return await call()

    def go_on(
        self,
        sampled: list[int],
        turn: AssistantTurn,
        truncated: bool,
        retokenized: bool,
        step: EnvironmentStep,
    ) -> bool:
        """Append what comes before the next turn (close ids after a truncated turn, or a
        retokenized one, whose text never shows the stop token; then the bridge, or a new
        element after a break); ``False`` when that would leave no room for a turn within
        ``max_episode_tokens`` (then nothing is appended)."""
        agent = self.shared.agent
        renderer = agent.renderer
        budget = agent.max_episode_tokens
        element = self.elements[-1]
        stops = renderer.stop_token_ids
        # The turn as a structured message (content, tool calls, reasoning): what every
        # template renders, and what a chat server is sent; as written if a call broke.
        self.conversation.append(turn_message(renderer, turn, sampled))
        new_messages = list(step.messages)
        check_roles(renderer, new_messages, "step().messages")
        tools = self.env.tools
        closed = bool(sampled) and sampled[-1] in stops
        close = list(renderer.close_ids) if (truncated or retokenized) and not closed else []
        bridge = None
        if tools != self.tools:
            why = "the environment's tools changed"
        else:
            if agent._bridge_takes_messages:
                bridge = renderer.bridge(  # type: ignore[call-arg]
                    element.ids + close, new_messages, tools=tools, messages=self.conversation
                )
            else:
                bridge = renderer.bridge(element.ids + close, new_messages, tools=tools)
            why = (
                "the renderer could not prove a bridge: the template's render of the "
                "conversation does not extend the episode's ids (it rewrites history)"
            )
        self.conversation.extend(new_messages)
        if bridge is None:
            # No room for a turn after the full render: the episode ends here, so no new
            # element starts and nothing broke (no break counted, none raised).
            ids = renderer.render(self.conversation, tools=tools)
            if budget is not None and len(ids) >= budget:
                return False
            if new_messages and tools == self.tools:
                before = self.conversation[: len(self.conversation) - len(new_messages)]
                if renderer.render(before, tools=tools) == ids:
                    roles = ", ".join(sorted({repr(m.role) for m in new_messages}))
                    why = (
                        f"the step's messages (roles {roles}) render to no text: the "
                        "template drops them, so the model would never see them (send them "
                        "in a role the template renders)"
                    )
            self.broke(why)
            self.tools = tools
            self.elements.append(Element.scaffold(ids))
        else:
            if budget is not None and len(element.ids) + len(close) + len(bridge) >= budget:
                return False
            element.extend(close)
            element.extend(bridge)
        self.truncated_turns += truncated
        return True

    def rollout(self, reward: float, finish: str) -> TokenRollout:
        elements = self.elements
        for element in elements:
            if not element.policy_epoch:
                element.unstamped(self.start_epoch, 0)
        has_logprobs = all(element.logprobs is not None for element in elements)
        return TokenRollout(
            trajectory=[element.ids for element in elements],
            reward=reward,
            generation_mask=[element.mask for element in elements],
            logprobs=[element.logprobs or [] for element in elements] if has_logprobs else None,
            env_id=self.shared.agent.env_id,
            problem_id=self.shared.problem.problem_id,
            policy_epoch=[element.policy_epoch for element in elements],
            # None at all (a backend that reports no cache epochs) is written as for a
            # single-turn rollout: an empty list, not one empty list per element.
            kv_cache_epoch=[element.kv_cache_epoch for element in elements]
            if any(element.kv_cache_epoch for element in elements)
            else [],
            num_evictions=[element.evictions for element in elements],
            fidelity=self.fidelity,
            sampling=[element.sampling for element in elements],
            extra={
                "episode": {
                    "turns": self.turns,
                    "finish": finish,
                    "breaks": self.breaks,
                    "tool_calls": sum(len(t["tool_calls"]) for t in self.per_turn),
                    "parse_errors": self.parse_errors,
                    "truncated_turns": self.truncated_turns,
                    "per_turn": self.per_turn,
                }
            },
        )


def takes_messages(renderer: Renderer) -> bool:
    """Whether ``renderer.bridge`` takes the conversation at hand (``messages=``): a
    renderer written before it existed is called without."""
    try:
        parameters = inspect.signature(renderer.bridge).parameters
    except (TypeError, ValueError):
        return False
    return "messages" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


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


def token_mismatch(interface: object, sent: list[int], echoed: list[int]) -> TokenMismatchError:
    index = next(
        (i for i, (a, b) in enumerate(zip(sent, echoed, strict=False)) if a != b),
        min(len(sent), len(echoed)),
    )
    msg = (
        f"{describe_backend(interface)} generated from other ids than the episode's: they differ "
        f"first at index {index} (sent {len(sent)} ids, it echoed {len(echoed)})"
    )
    return TokenMismatchError(msg, sent=sent, echoed=echoed, index=index)
