"""The inference contract: what an agent sends to a model and what comes back.

An :class:`InferenceInterface` turns an :class:`InferenceRequest` (a chat prompt and
generation arguments) into an :class:`InferenceResponse`. Backends subclass it, implement
:meth:`InferenceInterface.base_generate`, and mix in the capability markers for what they
can deliver: :class:`ReturnsRaw` (the full text the model saw plus what it generated),
:class:`ReturnsTokens` (token ids, in the vocabulary its ``token_vocabulary`` names when it
knows) and :class:`ReturnsLogProbs` (token log-probabilities). Agents check the markers,
not the backend's class.
"""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Any, ClassVar, Final, Self

import attrs
import trio

from trio_rollouts._context import current_call
from trio_rollouts._messages import ChatMessage, GenerationArgs
from trio_rollouts.inference._sampling import LogprobsMode

__all__ = [
    "CODE_POINTS",
    "AcceptsTokens",
    "GeneratesGroups",
    "InferenceInterface",
    "InferenceRequest",
    "InferenceResponse",
    "ReturnsLogProbs",
    "ReturnsRaw",
    "ReturnsTokens",
    "accepts_tokens",
    "render_plain_chat",
    "token_vocabulary",
]

#: The token vocabulary whose id ``i`` is the character ``chr(i)``: Unicode code points
#: (:class:`~trio_rollouts.inference.EmbeddedInference`'s tokens,
#: :class:`~trio_rollouts.PlainRenderer`'s ids).
CODE_POINTS: Final = "code_points"


def _check_prompt(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, list):
        msg = f"prompt must be a list of ChatMessage, got {value!r:.80}"
        raise TypeError(msg)
    for i, message in enumerate(value):
        if not isinstance(message, ChatMessage):
            msg = f"prompt[{i}] must be a ChatMessage, got {type(message).__name__}"
            raise TypeError(msg)


def _check_prompt_ids(instance: InferenceRequest, attribute: object, value: Any) -> None:
    if value is None:
        if not instance.prompt:
            msg = (
                "prompt must be a non-empty list of ChatMessage (it may be empty only when "
                f"prompt_ids is set), got {instance.prompt!r:.80}"
            )
            raise TypeError(msg)
        return
    if not isinstance(value, list) or not value:
        msg = f"prompt_ids must be a non-empty list of token ids (int >= 0), got {value!r:.80}"
        raise TypeError(msg)
    # The common case in C (an episode sends its whole context every turn): all plain
    # ints, none negative. Only a list that fails it is walked, to name the culprit.
    if set(map(type, value)) == {int} and min(value) >= 0:
        return
    for i, token in enumerate(value):
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            msg = f"prompt_ids[{i}] must be a token id (an int >= 0), got {token!r:.40}"
            raise TypeError(msg)


@attrs.define(kw_only=True)
class InferenceRequest:
    """A chat prompt to complete, with optional tool definitions (passed through to the
    server as the OpenAI ``tools`` field) and the generation arguments to use.

    ``prompt_ids``: token ids to generate from *exactly*, with no chat template (only
    backends marked :class:`AcceptsTokens` take them). ``prompt`` is then informative (the
    conversation so far) and may be empty. The response's ``token_ids`` are
    ``prompt_ids`` followed by the generated ids, and its ``prompt_length`` is
    ``len(prompt_ids)``.
    """

    prompt: list[ChatMessage] = attrs.field(validator=_check_prompt)
    tools: list[dict[str, Any]] | None = None
    generation_args: GenerationArgs = attrs.field(factory=GenerationArgs)
    prompt_ids: list[int] | None = attrs.field(default=None, validator=_check_prompt_ids)


@attrs.define(kw_only=True)
class InferenceResponse:
    """What the model generated.

    - ``response``: the generated message.
    - ``raw_text``: the full text the model saw plus what it generated (``ReturnsRaw``).
    - ``token_ids``: prompt and generated token ids (``ReturnsTokens``); the first
      ``prompt_length`` of them are the prompt.
    - ``logprobs``: one log-probability per generated token (``ReturnsLogProbs``).
    - ``policy_epoch`` / ``kv_cache_epoch``: ``(start_token_index, epoch)`` boundaries the
      engine stamped while generating; ``num_evictions``: KV-cache evictions suffered.
    - ``finish_reason``: why generation stopped (``"stop"``, ``"length"``, ...), if known.
    - ``usage``: the server's token accounting as it sent it (an OpenAI-compatible
      server's ``usage`` object: ``prompt_tokens``, ``completion_tokens``,
      ``total_tokens``, ...), or ``None``. It is kept even when ``token_ids`` is not.
    - ``logprobs_mode``: which log-probabilities ``logprobs`` are, as far as the backend
      knows: ``"processed"`` (from the distribution sampled from), ``"raw"`` (before
      temperature, top-k and top-p) or ``"unknown"`` (see
      :class:`~trio_rollouts.inference.ReplicaProbe`).
    - ``sampling_mask``: the server's record of the tokens its sampler kept at each
      generated position, as it sent it (vLLM's ``sampling_mask`` with
      ``--return-sampling-mask``), or ``None``.
    """

    response: ChatMessage
    raw_text: str | None = None
    token_ids: list[int] | None = None
    prompt_length: int | None = None
    logprobs: list[float] | None = None
    policy_epoch: list[tuple[int, int]] = attrs.field(factory=list)
    kv_cache_epoch: list[tuple[int, int]] = attrs.field(factory=list)
    num_evictions: int = 0
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    logprobs_mode: LogprobsMode = "unknown"
    sampling_mask: Any = None


def render_plain_chat(messages: list[ChatMessage]) -> str:
    """The documented plain rendering of a chat, for backends that see no chat template.

    Each message becomes ``"<|role|>\\ncontent\\n"``, and ``"<|assistant|>\\n"`` follows,
    opening the reply. So ``raw_text`` is ``render_plain_chat(prompt) + completion``
    when the server does not return the text the model saw.
    """
    parts = [f"<|{message.role}|>\n{message.content}\n" for message in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


class ReturnsRaw:
    """Marker: the interface fills :attr:`InferenceResponse.raw_text`."""

    __slots__ = ()


class ReturnsTokens:
    """Marker: the interface fills :attr:`InferenceResponse.token_ids` and
    :attr:`InferenceResponse.prompt_length`.

    :attr:`token_vocabulary` says what those ids (and the ``prompt_ids`` an
    :class:`AcceptsTokens` backend takes) mean, when the backend knows it; a renderer
    says the same of its ids (``Renderer.token_vocabulary``), and
    :class:`~trio_rollouts.MultiTurnAgent` and the gateway refuse a renderer whose
    vocabulary is not the backend's (:func:`token_vocabulary`)."""

    __slots__ = ()

    @property
    def token_vocabulary(self) -> str | None:
        """What this backend's token ids are: :data:`CODE_POINTS`, a tokenizer's
        vocabulary (``"hf:<digest>"``, see
        :func:`~trio_rollouts.renderers.tokenizer_vocabulary`), or ``None`` (the
        default) when the backend does not know (a server's model has whatever
        tokenizer it was served with)."""
        return None


class ReturnsLogProbs(ReturnsTokens):
    """Marker: the interface also fills :attr:`InferenceResponse.logprobs`."""

    __slots__ = ()


class AcceptsTokens(ReturnsTokens):
    """Marker: the interface generates from token ids
    (:attr:`InferenceRequest.prompt_ids`), exactly, with no chat template. A request with
    ``prompt_ids`` to an interface without it is a ``TypeError`` from
    :meth:`InferenceInterface.agenerate`.

    A backend whose instances may be configured not to take them (an HTTP client in
    front of a server that only renders chats) overrides :attr:`accepts_token_prompts`;
    check an instance with :func:`accepts_tokens`."""

    __slots__ = ()

    @property
    def accepts_token_prompts(self) -> bool:
        """Whether this instance takes ``prompt_ids`` (``True`` unless the backend says
        otherwise)."""
        return True


def token_vocabulary(interface: object) -> str | None:
    """What ``interface``'s token ids are (:attr:`ReturnsTokens.token_vocabulary`), or
    ``None`` when it returns none or does not know."""
    return interface.token_vocabulary if isinstance(interface, ReturnsTokens) else None


def accepts_tokens(interface: object) -> bool:
    """Whether ``interface`` generates from ``prompt_ids``: it is :class:`AcceptsTokens`
    and this instance takes them."""
    return isinstance(interface, AcceptsTokens) and interface.accepts_token_prompts


def generated_tokens(response: InferenceResponse) -> int | None:
    """How many tokens ``response`` generated, as far as it tells: its ids after the
    prompt, its logprobs, or the server's ``completion_tokens``; ``None`` when none
    says."""
    ids, prompt_length = response.token_ids, response.prompt_length
    if ids is not None and prompt_length is not None:
        return len(ids) - prompt_length
    if response.logprobs is not None:
        return len(response.logprobs)
    usage = response.usage
    if usage is not None:
        completion = usage.get("completion_tokens")
        if isinstance(completion, int) and not isinstance(completion, bool):
            return completion
    return None


@attrs.define(kw_only=True, eq=False)
class InferenceInterface(abc.ABC):
    """Base of every inference backend.

    Subclasses implement :meth:`base_generate`. Callers use :meth:`agenerate` from async
    code and :meth:`generate` from synchronous code that has no event loop running.
    Interfaces compare and hash by identity: each is a service, not a value.

    ``async with interface:`` (or :meth:`aclose`) releases what the backend holds for
    the current Trio run (connections, say); backends without such resources inherit
    the no-op.
    """

    #: Whether a cancelled :meth:`base_generate` adds the tokens it had generated to the
    #: member's :class:`~trio_rollouts._context.CallProgress` itself (else a cut member's count is
    #: unknown).
    reports_cancelled_progress: ClassVar[bool] = False

    def prepare_request(
        self,
        prompt: str | list[ChatMessage],
        generation_args: GenerationArgs | None = None,
    ) -> InferenceRequest:
        """Build a request: a string becomes one ``user`` message."""
        if isinstance(prompt, str):
            messages = [ChatMessage(role="user", content=prompt)]
        else:
            messages = list(prompt)
        return InferenceRequest(
            prompt=messages,
            generation_args=generation_args if generation_args is not None else GenerationArgs(),
        )

    @abc.abstractmethod
    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        """Generate one completion for ``request``. Backends implement this.

        Cancellation: implementations must be cancel-safe: when cancelled, they release
        every resource (connection, slot) they hold and raise ``trio.Cancelled``.
        """

    async def agenerate(self, request: InferenceRequest) -> InferenceResponse:
        """Generate one completion for ``request``.

        Cancellation: cancellable at any point; a cancelled call leaves no work running and
        holds no resource (it delegates to :meth:`base_generate`).
        """
        if not isinstance(request, InferenceRequest):
            msg = f"agenerate() takes an InferenceRequest, got {type(request).__name__}"
            raise TypeError(msg)
        if request.prompt_ids is not None and not accepts_tokens(self):
            if isinstance(self, AcceptsTokens):
                why = "this instance is configured not to take them"
            else:
                why = "it is not AcceptsTokens"
            msg = (
                f"{type(self).__name__} cannot generate from token ids ({why}): send a "
                "request without prompt_ids, or use a backend that takes them "
                "(EmbeddedInference, OpenAIInference with token_prompts=True)"
            )
            raise TypeError(msg)
        context = current_call()
        progress = context.progress
        if progress is None:
            response = await self.base_generate(request)
            sample = context.span
            if sample is not None:
                sample.first_event("first_response")
            return response
        try:
            response = await self.base_generate(request)
        except BaseException:
            # A cancelled call's tokens: the embedded backend adds them itself.
            if not self.reports_cancelled_progress:
                progress.known = False
            raise
        generated = generated_tokens(response)
        if generated is None:
            progress.known = False
        else:
            progress.generated_tokens += generated
        return response

    async def aclose(self) -> None:
        """Release what this interface holds in the current Trio run. Idempotent; the
        interface stays usable (resources are made again on the next request).

        Cancellation: the base implementation holds nothing and is only a checkpoint;
        backends document their own.
        """
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    def generate(self, request: InferenceRequest) -> InferenceResponse:
        """Synchronous :meth:`agenerate`: runs its own Trio loop.

        Raises ``RuntimeError`` when called from inside a running Trio loop (use
        ``await agenerate(...)`` there, or ``trio.to_thread.run_sync`` around this call).
        """
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass
        else:
            msg = (
                f"{type(self).__name__}.generate() was called inside a running Trio loop; "
                "use 'await interface.agenerate(request)' instead"
            )
            raise RuntimeError(msg)
        return trio.run(self.agenerate, request)


class GeneratesGroups(abc.ABC):
    """Capability: the interface generates a whole group of completions of one prompt
    in one call (vLLM's ``n``), so the server prefills the prompt once and schedules the
    choices together.

    :meth:`agenerate_group` returns ``n`` responses, one per choice, each as
    :meth:`InferenceInterface.agenerate` would return it: its own ``token_ids``,
    ``logprobs``, ``policy_epoch`` and ``finish_reason``, and usage split per choice
    (the prompt's ids are in every choice's ``token_ids``). A choice that a weight
    update aborts is continued on its own. ``RewardOnlyAgent`` and
    ``MultiTurnAgent``'s first turn use it when the backend has it and
    ``GroupedRolloutRequest.group_calls`` allows.

    A request with ``prompt_ids`` needs an :class:`AcceptsTokens` backend, as for
    :meth:`~InferenceInterface.agenerate`. A request with ``GenerationArgs.seed`` ``s``
    samples choice ``i`` as a separate call with the seed ``s + i`` would (modulo
    2**63): vLLM seeds the choices of an ``n`` request so, and the library's backends
    and fallbacks do the same; choice 0 is a plain call with ``s``.
    """

    __slots__ = ()

    @abc.abstractmethod
    async def base_generate_group(
        self, request: InferenceRequest, n: int
    ) -> list[InferenceResponse]:
        """Generate ``n`` completions of ``request``. Backends implement this; ``n`` is an
        int >= 1, checked by :meth:`agenerate_group`.

        Cancellation: as :meth:`InferenceInterface.base_generate`, for the whole group.
        """

    async def agenerate_group(self, request: InferenceRequest, n: int) -> list[InferenceResponse]:
        """``n`` completions of ``request``, one response per choice, in choice order.

        Raises ``TypeError``/``ValueError`` for a bad request or an ``n`` that is not an
        int >= 1 (before anything is sent), else what the backend's calls raise.

        Cancellation: cancellable at any point; a cancelled group leaves none of its
        choices running and holds no resource.
        """
        if isinstance(n, bool) or not isinstance(n, int):
            msg = f"n must be an int >= 1 (the number of completions), got {n!r:.40}"
            raise TypeError(msg)
        if n < 1:
            msg = f"n must be >= 1 (the number of completions), got {n}"
            raise ValueError(msg)
        if not isinstance(request, InferenceRequest):
            msg = f"agenerate_group() takes an InferenceRequest, got {type(request).__name__}"
            raise TypeError(msg)
        if request.prompt_ids is not None and not accepts_tokens(self):
            msg = (
                f"{type(self).__name__} cannot generate from token ids: send a request "
                "without prompt_ids, or use a backend that takes them"
            )
            raise TypeError(msg)
        return await self.base_generate_group(request, n)


def require_raw(interface: object, needed_by: str) -> None:
    """The one check that ``interface`` returns raw text (:class:`ReturnsRaw`), as the
    grouped pipeline and the agents that build text trajectories need: ``TypeError``
    naming who needs it and what was given."""
    if not isinstance(interface, ReturnsRaw):
        msg = (
            f"{needed_by} needs an inference interface that returns raw text "
            f"(ReturnsRaw); {type(interface).__name__} does not"
        )
        raise TypeError(msg)
