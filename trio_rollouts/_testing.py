"""Test doubles for code that uses trio_rollouts: a scripted agent, null backends, a
scripted Pausable backend, and a token-in backend over a real tokenizer's vocabulary
(re-exported by :mod:`trio_rollouts.testing`).

They are what the library's own tests and benchmarks use, so they are held to the same
contracts as the real thing: the null backends are ``ReturnsRaw`` as the pipeline
requires, the scripted Pausable backend holds requests while paused, as
:class:`~trio_rollouts.inference.Pausable` says a backend must, and the vocabulary
backend generates from ``prompt_ids`` exactly and says which vocabulary its ids are in.
Every wait is a Trio sleep or event, so tests run on a :class:`trio.testing.MockClock`
with autojump in no real time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import trio

from trio_rollouts import (
    ChatMessage,
    GenerationArgs,
    GroupedRolloutGenerator,
    GroupedRolloutRequest,
    Rollout,
    TokenRollout,
)
from trio_rollouts._checks import int_at_least, non_negative_seconds
from trio_rollouts.inference import (
    WEIGHT_UPDATE_MODES,
    AcceptsTokens,
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    Pausable,
    Policy,
    ReturnsLogProbs,
    ReturnsRaw,
    WeightUpdateMode,
)
from trio_rollouts.inference._sampling import sample_index
from trio_rollouts.renderers import tokenizer_vocabulary

#: What :class:`ScriptedAgent` runs for each group: ``await script(agent, request)``
#: returns the group's rollouts.
GroupScript = Callable[
    ["ScriptedAgent", GroupedRolloutRequest], Awaitable[Sequence[Rollout | TokenRollout]]
]


def rollouts(
    rewards: Iterable[float | None], *, env_id: str = "env", problem_id: str = "p"
) -> list[Rollout]:
    """One text rollout per reward (trajectory ``["x"]``), all of one problem: a group for
    a :class:`ScriptedAgent` to return. ``None`` rewards are kept, for testing how the
    pipeline refuses them."""
    return [
        Rollout(trajectory=["x"], reward=reward, env_id=env_id, problem_id=problem_id)
        for reward in rewards
    ]


# Plain attribute writes: the counters change on every call, and a validating
# __setattr__ (the attrs default) would triple the cost of the fixed-group fast path.
@attrs.define(on_setattr=attrs.setters.NO_OP)
class ScriptedAgent(GroupedRolloutGenerator):
    """A grouped agent that runs a script per group, or returns a fixed group, and counts
    its calls.

    With ``script``, ``group_rollout`` is ``await script(self, request)``: the script
    decides what a group is and how long it takes, and may raise, sleep forever, or read
    the counters (``agent.calls`` is the call's own number, counted from 1, until its
    first checkpoint)::

        async def instant(agent, request):
            await trio.lowlevel.checkpoint()
            return rollouts([0.0, 1.0])

        agent = ScriptedAgent(script=instant, parallel_generation_tasks=4)

    With ``group`` instead, each call checkpoints once and returns a new list of the same
    rollouts: the cheapest agent there is, for benchmarks of the pipeline itself.

    The counters are plain ints, updated without a checkpoint, so a test reads them at
    any point; they cost a few integer updates per call.
    """

    #: Runs once per group; see :data:`GroupScript`. Give this or ``group``.
    script: GroupScript | None = attrs.field(default=None, kw_only=True)
    #: The rollouts every call returns (in a new list), when there is no ``script``.
    group: Sequence[Rollout | TokenRollout] = attrs.field(default=(), kw_only=True, converter=tuple)
    #: ``group_rollout`` calls started.
    calls: int = attrs.field(default=0, init=False)
    #: Calls started and not yet returned or raised.
    in_flight: int = attrs.field(default=0, init=False)
    #: The most calls that were ever in flight at once.
    max_in_flight: int = attrs.field(default=0, init=False)
    #: Calls that have returned or raised (cancelled ones included).
    exited: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        if (self.script is None) == (not self.group):
            msg = (
                "ScriptedAgent needs exactly one of script= (an async function of the agent "
                "and the request) and group= (a non-empty list of rollouts)"
            )
            raise ValueError(msg)

    async def group_rollout(
        self, request: GroupedRolloutRequest
    ) -> Sequence[Rollout | TokenRollout]:
        """Run the script for one group, or checkpoint and return ``group``.

        Cancellation: as cancellation-safe as the script (with ``group``, a checkpoint);
        the counters are right on every route out.
        """
        self.calls += 1
        self.in_flight += 1
        if self.in_flight > self.max_in_flight:
            self.max_in_flight = self.in_flight
        try:
            if self.script is None:
                await trio.lowlevel.checkpoint()
                return list(self.group)
            return await self.script(self, request)
        finally:
            self.in_flight -= 1
            self.exited += 1


@attrs.define(eq=False, kw_only=True)
class NullChatInference(InferenceInterface):
    """A backend that answers every request with ``completion`` after ``latency`` seconds,
    as a chat message only: it is not ``ReturnsRaw``, so the grouped pipeline refuses it
    (use it to test that refusal; :class:`NullInference` is the one that runs)."""

    #: The assistant message's content, for every request.
    completion: str = "ok"
    #: Seconds each request takes (0: a checkpoint only).
    latency: float = attrs.field(
        default=0.0,
        validator=[attrs.validators.instance_of((int, float)), attrs.validators.ge(0)],
    )
    #: Every request received, in arrival order.
    requests: list[InferenceRequest] = attrs.field(factory=list, init=False)

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        """Record ``request``, sleep ``latency`` seconds and answer.

        Cancellation: a checkpoint; cancelled, it answers nothing (the request stays
        recorded).
        """
        self.requests.append(request)
        await trio.sleep(self.latency)
        return self._answer()

    def _answer(self) -> InferenceResponse:
        return InferenceResponse(response=ChatMessage(role="assistant", content=self.completion))


@attrs.define(eq=False, kw_only=True)
class NullInference(NullChatInference, ReturnsRaw):
    """A ``ReturnsRaw`` backend that answers every request with ``completion`` (also as
    ``raw_text``) after ``latency`` seconds. For agents that ignore the model, it is the
    interface a :class:`~trio_rollouts.GroupedRolloutRequest` needs; agents that call it
    get a fixed answer, and :attr:`requests` shows what they asked."""

    def _answer(self) -> InferenceResponse:
        return InferenceResponse(
            response=ChatMessage(role="assistant", content=self.completion),
            raw_text=self.completion,
        )


def _modes(value: Iterable[WeightUpdateMode]) -> frozenset[WeightUpdateMode]:
    modes = frozenset(value)
    unknown = sorted(modes - set(WEIGHT_UPDATE_MODES))
    if unknown:
        msg = f"modes must be among {WEIGHT_UPDATE_MODES}, got {unknown}"
        raise ValueError(msg)
    return modes


def _failure(setting: bool | Exception, default: str) -> Exception:
    return setting if isinstance(setting, Exception) else RuntimeError(default)


@attrs.define(eq=False, kw_only=True)
class ScriptedPausable(NullInference, Pausable):
    """A :class:`NullInference` that a weight update can pause, in the ``modes`` given,
    and that records what it was told.

    - :attr:`log` lists the calls in order, as ``"pause keep"`` and ``"resume 1"``. A
      pause is recorded once it has passed its checkpoint (a pause cancelled at once
      records nothing), a resume when it is called.
    - While paused, arriving requests wait for :meth:`resume`. ``keep`` and ``abort``
      also stop the requests in flight at once and continue them after the resume: a
      request needs ``latency`` seconds of unpaused time, so a pause delays it by exactly
      its length. The two modes differ only in a real engine's memory.
    - A response carries ``policy_epoch=[(0, e)]``, ``e`` the epoch when the request was
      admitted; the backend does not stamp where an epoch changed
      (:attr:`stamps_policy_epoch` is ``False``), so groups that span a ``keep`` or
      ``abort`` update count as ``mixed``.
    - ``fail_pause`` / ``fail_resume``: ``True`` (a ``RuntimeError``) or the exception
      that every later pause / resume raises, after recording the call. A failed pause
      leaves the backend unpaused; a failed resume has resumed all the same (the server
      answered an error after it acted), so nothing stays paused.
    """

    #: The modes :meth:`pause` accepts (all four by default).
    modes: frozenset[WeightUpdateMode] = attrs.field(
        default=frozenset(WEIGHT_UPDATE_MODES), converter=_modes
    )
    #: The epoch generation runs under; :meth:`resume` sets it.
    epoch: int = 0
    #: Make every pause fail: ``True``, or the exception to raise.
    fail_pause: bool | Exception = False
    #: Make every resume fail (after resuming): ``True``, or the exception to raise.
    fail_resume: bool | Exception = False
    #: ``"pause <mode>"`` and ``"resume <epoch>"``, in the order they were called.
    log: list[str] = attrs.field(factory=list, init=False)
    #: The mode of the pause in force, or ``None`` while generating.
    paused: WeightUpdateMode | None = attrs.field(default=None, init=False)
    _resumed: trio.Event = attrs.field(factory=trio.Event, init=False)
    _generating: set[trio.CancelScope] = attrs.field(factory=set, init=False)

    @property
    def supported_modes(self) -> frozenset[WeightUpdateMode]:
        """:attr:`modes`."""
        return self.modes

    @property
    def policy_epoch(self) -> int:
        """:attr:`epoch`."""
        return self.epoch

    @property
    def stamps_policy_epoch(self) -> bool:
        """``False``: a response carries the epoch its request was admitted under."""
        return False

    async def pause(self, mode: WeightUpdateMode) -> None:
        """Stop as ``mode`` says: hold new requests, and with ``keep`` or ``abort`` the
        requests in flight too. Raises ``TypeError`` for a mode outside :attr:`modes`.

        Cancellation: a checkpoint before anything happens; cancelled there, it has
        neither recorded nor paused anything.
        """
        if mode not in self.modes:
            msg = (
                f"{type(self).__name__} cannot pause for {mode!r}; its modes: {sorted(self.modes)}"
            )
            raise TypeError(msg)
        await trio.lowlevel.checkpoint()
        self.log.append(f"pause {mode}")
        if self.fail_pause:
            raise _failure(self.fail_pause, "pause endpoint answered 404")
        if self.paused is None:
            self._resumed = trio.Event()
        self.paused = mode
        if mode in ("keep", "abort"):
            for scope in self._generating:
                scope.cancel()

    async def resume(self, epoch: int) -> None:
        """Generate under ``epoch`` from now on and release what the pause held; only
        sets the epoch when not paused.

        Cancellation: the backend has resumed before the first checkpoint, so a cancelled
        resume leaves nothing paused.
        """
        self.log.append(f"resume {epoch}")
        self.epoch = epoch
        self.paused = None
        self._resumed.set()
        await trio.lowlevel.checkpoint()
        if self.fail_resume:
            raise _failure(self.fail_resume, "resume endpoint answered 500")

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        """Wait while paused, then generate for ``latency`` seconds of unpaused time.

        Cancellation: a checkpoint; cancelled, it answers nothing (the request stays
        recorded).
        """
        self.requests.append(request)
        while self.paused is not None:
            await self._resumed.wait()
        epoch = self.epoch
        remaining = self.latency
        while True:
            with trio.CancelScope() as generating:
                self._generating.add(generating)
                started = trio.current_time()
                try:
                    await trio.sleep(remaining)
                finally:
                    self._generating.discard(generating)
            if not generating.cancelled_caught:
                break
            # Stopped by a keep/abort pause: the time generated so far is kept.
            remaining = max(0.0, remaining - (trio.current_time() - started))
            while self.paused is not None:
                await self._resumed.wait()
        response = self._answer()
        response.policy_epoch = [(0, epoch)]
        return response


#: How many ids may follow each id in :class:`VocabularyInference`'s random bigram model.
_SUCCESSORS = 64


def _stop_ids(value: Iterable[object] | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    ids: list[int] = []
    for i, token in enumerate(value):
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            msg = f"stop_token_ids[{i}] must be a token id (an int >= 0), got {token!r:.40}"
            raise TypeError(msg)
        ids.append(token)
    return tuple(ids)


@attrs.define(eq=False)
class VocabularyInference(InferenceInterface, ReturnsRaw, ReturnsLogProbs, AcceptsTokens):
    """A token-in backend over a real tokenizer's vocabulary, offline and seeded: a
    stand-in for a model served with that tokenizer, to test environments, templates and
    trainers on real BPE ids with :class:`~trio_rollouts.HFRenderer` of the same
    tokenizer (the agent checks that the vocabularies agree). It is no language model.

    - ``tokenizer``: a Hugging Face tokenizer (``get_vocab``, ``encode``, ``decode``:
      a ``PreTrainedTokenizerFast``, or one from ``AutoTokenizer.from_pretrained``).
    - ``seed``: fixes every sample: the same seed and the same requests, in the same
      order, give the same ids. Requests with the same prompt ids draw from streams of
      their own, one after the other (so a group's episodes differ); a request's
      ``GenerationArgs.seed`` fixes its sample exactly, whatever came before.
    - ``policy``: ``None`` (the default) samples every id from the vocabulary, below;
      or a :data:`~trio_rollouts.inference.Policy` as
      :class:`~trio_rollouts.inference.EmbeddedInference` takes (the conversation to
      ``(completions, probabilities)``): the completion drawn is encoded with the
      tokenizer, generated id by id, and ended with the first stop id, so a test can
      script tool calls in the template's own format.
    - ``stop_token_ids``: the ids that end a turn (``finish_reason="stop"``, the stop id
      kept as the last generated id, as engines do); by default the tokenizer's
      ``eos_token_id``. Pass ``HFRenderer(tokenizer).stop_token_ids`` to end turns as the
      template does.
    - ``mean_length``: without a policy, how many ids a turn has on average before its
      stop id, at temperature 1 without top-k or top-p.
    - ``max_tokens``: the most ids a turn generates when the request sets no
      ``max_tokens`` (``finish_reason="length"``), as a server's context would.
    - ``latency``: seconds each call takes (``trio.sleep``: no real time on a
      ``MockClock``).

    **Sampling.** Without a policy, the ids that may follow an id are 64 of the
    vocabulary's ordinary tokens (neither special tokens nor byte fragments that
    decode to no character alone), with logits drawn from ``seed`` and that id (a
    fixed random bigram model), and the first stop id, with the probability that makes
    ``mean_length`` hold. With a policy, the candidates are its completions. Either way
    ``GenerationArgs`` is honoured as engines do: ``temperature`` scales the
    log-probabilities (``0.0`` takes the most probable, the first on ties), then
    ``top_k`` and ``top_p`` cut the candidates, and ``max_tokens`` cuts the turn.
    ``logprobs`` are those of the distribution sampled from
    (``logprobs_mode="processed"``; greedy is scored at temperature 1, as vLLM does);
    with a policy each id of a completion of probability ``p`` gets
    ``log(p) / len(ids)``.

    **The response.** ``token_ids`` is ``prompt_ids`` followed by the generated ids,
    ``prompt_length`` ``len(prompt_ids)``, ``raw_text`` all of them decoded (special
    tokens included), the message's content the generated ids less a trailing stop id,
    decoded. A request without ``prompt_ids`` is rendered with the tokenizer's chat
    template. :attr:`token_vocabulary` is the tokenizer's
    (:func:`~trio_rollouts.renderers.tokenizer_vocabulary`), so
    :class:`~trio_rollouts.HFRenderer` over the same tokenizer is accepted and
    :class:`~trio_rollouts.PlainRenderer` (code points) refused. :attr:`requests` lists
    every request, in arrival order.
    """

    #: The tokenizer whose vocabulary the ids are drawn from.
    tokenizer: Any
    #: Fixes every sample.
    seed: int = attrs.field(default=0, kw_only=True, validator=int_at_least(0))
    #: ``None`` (ids from the vocabulary) or a Policy over whole completions.
    policy: Policy | None = attrs.field(
        default=None,
        kw_only=True,
        validator=attrs.validators.optional(attrs.validators.is_callable()),
    )
    #: The ids that end a turn (``None``: the tokenizer's ``eos_token_id``).
    stop_token_ids: tuple[int, ...] | None = attrs.field(
        default=None, kw_only=True, converter=_stop_ids
    )
    #: Without a policy: the ids of a turn, on average, before its stop id.
    mean_length: int = attrs.field(default=16, kw_only=True, validator=int_at_least(1))
    #: The most ids a turn generates when the request sets no ``max_tokens``.
    max_tokens: int = attrs.field(default=256, kw_only=True, validator=int_at_least(1))
    #: Seconds each call takes.
    latency: float = attrs.field(default=0.0, kw_only=True, validator=non_negative_seconds)
    #: Every request received, in arrival order.
    requests: list[InferenceRequest] = attrs.field(factory=list, init=False)
    _vocabulary: str | None = attrs.field(init=False, default=None, repr=False)
    _stops: tuple[int, ...] = attrs.field(init=False, default=(), repr=False)
    _candidates: npt.NDArray[np.int64] = attrs.field(init=False, repr=False)
    _per_prompt: dict[bytes, int] = attrs.field(init=False, factory=dict, repr=False)

    def __attrs_post_init__(self) -> None:
        tokenizer = self.tokenizer
        get_vocab = getattr(tokenizer, "get_vocab", None)
        vocabulary = get_vocab() if callable(get_vocab) else None
        if (
            not isinstance(vocabulary, Mapping)
            or not vocabulary
            or not all(callable(getattr(tokenizer, name, None)) for name in ("encode", "decode"))
        ):
            msg = (
                "VocabularyInference needs a Hugging Face tokenizer (get_vocab(), encode(), "
                f"decode()), got {type(tokenizer).__name__}"
            )
            raise TypeError(msg)
        self._vocabulary = tokenizer_vocabulary(tokenizer)
        if self.stop_token_ids is not None:
            self._stops = self.stop_token_ids
        else:
            eos = getattr(tokenizer, "eos_token_id", None)
            self._stops = (eos,) if isinstance(eos, int) and not isinstance(eos, bool) else ()
        special = set(getattr(tokenizer, "all_special_ids", None) or ())
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        special.update(i for i, token in added.items() if getattr(token, "special", False))
        special.update(self._stops)
        ids = sorted({i for i in vocabulary.values() if isinstance(i, int)} - special)
        # Byte fragments (a byte-level BPE's pieces of a character) decode to U+FFFD
        # alone: left out, so that turns decode to text.
        batch_decode = getattr(tokenizer, "batch_decode", None)
        singles = [[i] for i in ids]
        texts = batch_decode(singles) if callable(batch_decode) else map(self._decode, singles)
        ids = [i for i, text in zip(ids, texts, strict=True) if text and "\ufffd" not in text]
        if not ids:
            msg = "VocabularyInference: the tokenizer's vocabulary has no ordinary token"
            raise ValueError(msg)
        self._candidates = np.array(ids, dtype=np.int64)

    @property
    def token_vocabulary(self) -> str | None:
        """The tokenizer's vocabulary
        (:func:`~trio_rollouts.renderers.tokenizer_vocabulary`)."""
        return self._vocabulary

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        """Record ``request``, wait ``latency`` seconds, and sample a turn.

        Cancellation: a checkpoint; cancelled, it answers nothing (the request stays
        recorded) and has drawn no sample, so the seeded streams are as before.
        """
        self.requests.append(request)
        await trio.sleep(self.latency)
        prompt_ids = self._prompt_ids(request)
        rng = self._rng(prompt_ids, request.generation_args.seed)
        args = request.generation_args
        limit = self.max_tokens if args.max_tokens is None else args.max_tokens
        if self.policy is None:
            generated, logprobs = self._from_vocabulary(prompt_ids, args, rng, limit)
        else:
            generated, logprobs = self._from_policy(request, prompt_ids, args, rng, limit)
        stopped = bool(generated) and generated[-1] in self._stops
        content = generated[:-1] if stopped else generated
        return InferenceResponse(
            response=ChatMessage(role="assistant", content=self._decode(content)),
            raw_text=self._decode([*prompt_ids, *generated]),
            token_ids=[*prompt_ids, *generated],
            prompt_length=len(prompt_ids),
            logprobs=logprobs,
            finish_reason="stop" if stopped else "length",
            logprobs_mode="processed",
        )

    def _prompt_ids(self, request: InferenceRequest) -> list[int]:
        if request.prompt_ids is not None:
            return list(request.prompt_ids)
        template = getattr(self.tokenizer, "apply_chat_template", None)
        if not callable(template) or not getattr(self.tokenizer, "chat_template", None):
            msg = (
                "VocabularyInference got a chat request (no prompt_ids) and its tokenizer has "
                "no chat template: send prompt_ids (MultiTurnAgent does), or give the "
                "tokenizer a chat_template"
            )
            raise TypeError(msg)
        conversation = [
            {**message.extra, "role": message.role, "content": message.content}
            for message in request.prompt
        ]
        text = template(
            conversation, tools=request.tools, add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _rng(self, prompt_ids: list[int], seed: int | None) -> np.random.Generator:
        digest = hashlib.sha256(np.asarray(prompt_ids, dtype=np.int64).tobytes()).digest()
        words = [int.from_bytes(digest[i : i + 8], "little") for i in (0, 8)]
        if seed is not None:
            return np.random.default_rng([self.seed, *words, 1, seed])
        occurrence = self._per_prompt.get(digest, 0)
        self._per_prompt[digest] = occurrence + 1
        return np.random.default_rng([self.seed, *words, 0, occurrence])

    def _from_vocabulary(
        self, prompt_ids: list[int], args: GenerationArgs, rng: np.random.Generator, limit: int
    ) -> tuple[list[int], list[float]]:
        generated: list[int] = []
        logprobs: list[float] = []
        previous = prompt_ids[-1] if prompt_ids else -1
        stops = self._stops
        while len(generated) < limit:
            ids, probs = self._successors(previous)
            index, probability = sample_index(probs, args, rng)
            previous = int(ids[index])
            generated.append(previous)
            logprobs.append(float(np.log(probability)))
            if previous in stops:
                break
        return generated, logprobs

    def _successors(self, previous: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
        """The ids that may follow ``previous`` and their probabilities at temperature 1:
        drawn from ``seed`` and ``previous`` alone (the model is fixed by its seed)."""
        table = np.random.default_rng([self.seed, previous + 1])
        picks = np.unique(table.integers(0, len(self._candidates), size=_SUCCESSORS))
        logits = table.standard_normal(len(picks)) * 1.5
        weights = np.exp(logits - logits.max())
        ids = self._candidates[picks]
        if not self._stops:
            return ids, weights / weights.sum()
        # The first stop id (a turn's end as the template writes it) has 1 / (mean_length
        # + 1) of the mass: a geometric number of ids before it, mean_length on average.
        stop_mass = 1.0 / (self.mean_length + 1)
        probs = np.append(weights / weights.sum() * (1.0 - stop_mass), stop_mass)
        return np.append(ids, self._stops[0]), probs

    def _from_policy(
        self,
        request: InferenceRequest,
        prompt_ids: list[int],
        args: GenerationArgs,
        rng: np.random.Generator,
        limit: int,
    ) -> tuple[list[int], list[float]]:
        policy = self.policy
        if policy is None:  # pragma: no cover - the caller checks
            raise RuntimeError("no policy")
        messages = request.prompt or [ChatMessage(role="user", content=self._decode(prompt_ids))]
        completions, weights = policy(list(messages))
        probs = np.asarray(weights, dtype=np.float64)
        if len(completions) == 0 or probs.shape != (len(completions),) or probs.sum() <= 0:
            msg = (
                "the policy must return completions and as many non-negative weights, "
                f"not all 0; got {len(completions)} completions and weights {weights!r:.60}"
            )
            raise ValueError(msg)
        index, probability = sample_index(probs / probs.sum(), args, rng)
        ids = list(self.tokenizer.encode(completions[index], add_special_tokens=False))
        ids += self._stops[:1]
        logprob = float(np.log(probability)) / len(ids) if ids else 0.0
        generated = ids[:limit]
        return generated, [logprob] * len(generated)

    def _decode(self, ids: Sequence[int]) -> str:
        text = self.tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return str(text)
