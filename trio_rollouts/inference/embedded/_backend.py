"""The embedded backend: a simulated inference engine that needs no server.

:class:`EmbeddedInference` is a simulation for demos, docs and tests, not a language
model. A *policy* maps a prompt to a distribution over whole completions; the backend
samples one (respecting temperature, top-k, top-p and max_tokens) with a numpy
``Generator`` derived from its seed, and "generates" it token by token, sleeping as its
:class:`LatencyModel` says with ``trio.sleep``, so a ``MockClock`` (pytest-trio's
``autojump_clock``) makes it instant and deterministic. Tokens are characters (token id =
Unicode code point), so token ids decode back to ``raw_text``. Like Megatron's engine it
stamps ``policy_epoch``: :meth:`EmbeddedInference.set_generation_epoch` takes effect at
the next token step of every request in flight. It is
:class:`~trio_rollouts.inference.Pausable` in all four weight-update modes (see
:meth:`EmbeddedInference.pause`).

This module holds the backend itself: sampling a request, generating it on the latency
model or on the engine model's cluster, and pausing. The policies and the latency model
are in ``_policy``, the pause state of a Trio run in ``_pause``, the engine model in
``_engine``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar, Final

import attrs
import numpy as np
import trio

from trio_rollouts._checks import check_natural, int_at_least
from trio_rollouts._context import current_call
from trio_rollouts._messages import ChatMessage, GenerationArgs
from trio_rollouts.inference._interface import (
    CODE_POINTS,
    AcceptsTokens,
    GeneratesGroups,
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    ReturnsLogProbs,
    ReturnsRaw,
    render_plain_chat,
)
from trio_rollouts.inference._pausable import WEIGHT_UPDATE_MODES, Pausable, WeightUpdateMode
from trio_rollouts.inference._placement import (
    DEFAULT_ROUTING_MARGIN,
    Placement,
    Routing,
    check_routing,
    placement_key,
)
from trio_rollouts.inference._salt import CacheSalt, check_cache_salt, new_run_id, salt_of
from trio_rollouts.inference._sampling import choice_seed, sample_index
from trio_rollouts.inference.embedded._engine import (
    Call,
    Cluster,
    Counters,
    EngineModel,
    EngineRequest,
    EngineStatistics,
    Replica,
    admission_order,
    settle,
    stamp,
)
from trio_rollouts.inference.embedded._pause import ALL_MODES, HOLDING_MODES, Pause, RunState
from trio_rollouts.inference.embedded._policy import (
    HashedPromptPolicy,
    LatencyModel,
    Policy,
    decode_code_points,
    distribution,
    prompt_digest,
)

__all__ = ["EmbeddedInference"]


@attrs.define(kw_only=True, eq=False)
class EmbeddedInference(
    InferenceInterface, ReturnsRaw, ReturnsLogProbs, AcceptsTokens, GeneratesGroups, Pausable
):
    """A simulated inference engine (no model, no server) for demos, docs and tests.

    - ``policy``: maps the prompt's messages to ``(completions, probabilities)``
      (:data:`Policy`); the default is :class:`HashedPromptPolicy`. Swap or mutate it to
      "train" the simulated model.
    - ``seed``: with the policy, fixes every sample. Request ``n`` for a given prompt
      text draws from its own stream (seed, prompt, ``n``), so the completions a group
      of identical prompts gets do not depend on how Trio interleaves other requests
      (one counter is kept per distinct prompt).
    - ``latency``: a :class:`LatencyModel`; all waiting is ``trio.sleep``.

    Sampling follows ``GenerationArgs`` as engines do: ``temperature`` scales the
    policy's log-probabilities (``0.0`` picks the most probable completion, the first on
    ties), then ``top_k`` and ``top_p`` cut the candidates; ``max_tokens`` truncates the
    completion (``finish_reason="length"``, else ``"stop"``).

    The response: ``raw_text`` is ``render_plain_chat(prompt) + completion``; tokens are
    characters, ``token_ids`` the code points of ``raw_text`` and ``prompt_length`` the
    length of the rendered prompt. It :class:`~trio_rollouts.inference.AcceptsTokens`: with
    ``prompt_ids`` (code points) the prompt text is their characters, exactly, the policy
    sees ``request.prompt`` if it is not empty and else one user message holding that text,
    and ``token_ids`` is ``prompt_ids`` followed by the generated code points. ``logprobs``
    gives each generated token
    ``log(p) / len(completion)``, where ``p`` is the chosen completion's probability in
    the distribution it was sampled from (after temperature, top-k and top-p: processed
    log-probabilities, as vLLM's ``--logprobs-mode processed_logprobs`` reports them;
    greedy decoding is scored at temperature 1, as vLLM does), so a complete
    completion's logprobs sum to ``log(p)``; ``logprobs_mode`` is ``"processed"``. A
    request's ``GenerationArgs.seed`` fixes its sample exactly, whatever other requests
    came before. ``policy_epoch`` starts at ``[(0, e)]`` with the epoch current at
    admission; see
    :meth:`set_generation_epoch`. ``kv_cache_epoch`` is, per sampled token, the oldest
    epoch whose weights computed the KV it attended to: the epoch of admission, with no
    boundary at a ``keep`` pause (the tokens after it attend to the cache computed
    before it) and one where an ``abort`` continuation starts (its cache is computed
    again; see :meth:`pause`); with ``engine``, the oldest epoch of the cached blocks
    and computed ids it attends to. ``num_evictions`` is 0.

    ``cache_salt`` and ``run_id`` salt the engine's prefix cache as
    :class:`~trio_rollouts.inference.OpenAIInference` salts a server's (``"epoch"``, the
    default: by the start epoch of the call's group, so no group reads KV computed before
    its start; ``"off"``: one cache for all epochs, whose stale reuse shows in
    ``EngineStatistics.stale_prefix_hits`` and ``kv_cache_epoch``; or a callable). They
    change nothing without ``engine`` (no prefix cache is simulated then).

    It is :class:`~trio_rollouts.inference.Pausable` in all four modes and stamps epochs
    exactly (:meth:`pause`, :meth:`resume`); ``policy_epoch`` is
    :attr:`generation_epoch`.
    """

    #: A cancelled call adds the tokens it had generated to its member's progress.
    reports_cancelled_progress: ClassVar[bool] = True
    #: Its token ids are Unicode code points (PlainRenderer's ids).
    token_vocabulary: ClassVar[str] = CODE_POINTS

    seed: int = attrs.field(default=0, validator=int_at_least(0))
    policy: Policy = attrs.field(
        factory=HashedPromptPolicy, validator=attrs.validators.is_callable()
    )
    latency: LatencyModel = attrs.field(
        factory=LatencyModel, validator=attrs.validators.instance_of(LatencyModel)
    )
    engine: EngineModel | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.instance_of(EngineModel)),
    )
    replicas: int = attrs.field(default=1, validator=int_at_least(1))
    routing: Routing = attrs.field(default="group", validator=check_routing)
    routing_margin: int = attrs.field(default=DEFAULT_ROUTING_MARGIN, validator=int_at_least(0))
    cache_salt: CacheSalt = attrs.field(default="epoch", validator=check_cache_salt)
    run_id: str = attrs.field(factory=new_run_id, validator=attrs.validators.instance_of(str))
    _counters: list[Counters] = attrs.field(
        init=False,
        repr=False,
        default=attrs.Factory(
            lambda self: [Counters() for _ in range(self.replicas)], takes_self=True
        ),
    )
    _generation_epoch: int = attrs.field(init=False, default=0)
    _requests_per_prompt: dict[bytes, int] = attrs.field(init=False, factory=dict, repr=False)
    # The pause state is per Trio run: Trio objects belong to one run, and the sync
    # generate() runs its own. Each interface has its own RunVar (a key into the run).
    _run_states: trio.lowlevel.RunVar[RunState | None] = attrs.field(
        init=False,
        repr=False,
        factory=lambda: trio.lowlevel.RunVar("EmbeddedInference pause state", None),
    )

    @property
    def generation_epoch(self) -> int:
        """The policy epoch new tokens are generated with."""
        return self._generation_epoch

    # ------------------------------------------------------------------ Pausable

    @property
    def supported_modes(self) -> frozenset[WeightUpdateMode]:
        """All four: ``drain``, ``restart``, ``keep`` and ``abort``."""
        return ALL_MODES

    @property
    def policy_epoch(self) -> int:
        """The epoch generation runs under now: :attr:`generation_epoch`."""
        return self._generation_epoch

    @property
    def stamps_policy_epoch(self) -> bool:
        """``True``: every response records the token where its epoch changed."""
        return True

    async def pause(self, mode: WeightUpdateMode) -> None:
        """Stop generating as ``mode`` says; return once no token is being generated.

        From the moment of the call, requests that arrive are held before admission
        (nothing sampled, no latency spent) until :meth:`resume`; they are then admitted
        under the new epoch (``policy_epoch == [(0, e)]``). Requests in flight:

        - ``"keep"``: a request in its first-token wait (queueing and prefill) is held at
          once and, after :meth:`resume`, waits only the rest of it. A token step is
          never cut: ``pause`` waits for the steps in progress to end (at most one
          ``per_token`` wait), and each request holds before its next token. After
          ``resume(e)`` it goes on from token ``k``: ``policy_epoch`` gets ``(k, e)``
          (or its empty last segment becomes ``(k, e)``); ``kv_cache_epoch`` does not
          move: the cache of tokens ``< k`` is kept as it was computed, under the old
          epoch, and the tokens after the boundary attend to it.
        - ``"abort"``: as ``keep``, but a held request is stopped: after ``resume(e)`` it
          is continued from its partial output (the caller sees one call and the final
          ``finish_reason``), which costs a new first-token wait (prefill of the prompt
          and the ``k`` tokens so far), then goes on from token ``k`` with ``(k, e)`` in
          ``policy_epoch``. The continuation recomputes the whole cache, so
          ``kv_cache_epoch`` gets ``(k, e)`` too. A request stopped before its first
          token starts over: ``[(0, e)]`` for both.
        - ``"drain"`` / ``"restart"``: requests in flight are left alone and finish
          under the old epoch; ``pause`` returns when none is left (the pipeline calls
          it once no call is in flight, so at once).

        Pausing never changes the tokens a request generates, only their stamps and
        timing: a request's random stream is fixed when it arrives.

        A pause belongs to the Trio run that calls it: it holds the requests of that run
        only, is ended by :meth:`resume` in that run, and ends with the run (a later
        run, such as a sync :meth:`generate`, starts unpaused). The epoch is shared.

        Raises ``TypeError`` for an unknown mode, ``RuntimeError`` when already paused
        in this run (naming the mode in force). A :meth:`resume` that comes while
        ``pause`` still waits ends the pause, and ``pause`` returns.

        Cancellation: a cancelled ``pause`` undoes itself: the backend is not paused
        and what it held goes on under the current epoch as if it had not been called
        (a following ``resume`` then only sets the epoch).
        """
        if not isinstance(mode, str) or mode not in ALL_MODES:
            allowed = ", ".join(repr(m) for m in WEIGHT_UPDATE_MODES)
            msg = f"unknown weight-update mode {mode!r}: EmbeddedInference supports {allowed}"
            raise TypeError(msg)
        state = self._run_state()
        if state.pause is not None:
            msg = (
                f"EmbeddedInference is already paused (mode {state.pause.mode!r}); "
                "resume() it before pausing again"
            )
            raise RuntimeError(msg)
        await trio.lowlevel.checkpoint_if_cancelled()
        pause = Pause(mode)
        state.pause = pause
        if mode in HOLDING_MODES:
            state.prefilling.unpark_all()
        try:
            waited = False
            while state.pause is pause and state.busy(mode) > 0:
                waited = True
                await state.quiet.park()
        except BaseException:
            if state.pause is pause:
                state.release(undone=True)
            raise
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def resume(self, epoch: int) -> None:
        """Generate under ``epoch`` from now on and release what the pause held (see
        :meth:`pause`). When this run is not paused it only sets the epoch, like
        :meth:`set_generation_epoch`.

        Raises ``TypeError`` / ``ValueError`` unless ``epoch`` is an int >= 0 (nothing
        changes then: a paused backend stays paused).

        Cancellation: never interrupted; the state changes before its only schedule
        point, which cannot raise ``Cancelled``.
        """
        check_natural("epoch", epoch)
        self._generation_epoch = epoch
        state = self._run_states.get()
        if state is not None and state.pause is not None:
            state.release(undone=False)
        await trio.lowlevel.cancel_shielded_checkpoint()

    def set_generation_epoch(self, epoch: int) -> None:
        """Declare that the policy's weights changed to ``epoch``, as a trainer does after
        an update.

        A request admitted later starts with ``policy_epoch == [(0, epoch)]``. A request
        in flight sees the change at its next token step and appends ``(k, epoch)``, ``k``
        being the number of tokens it had generated by then; when it had generated none
        under the previous epoch, that empty segment is replaced instead, so start
        indices strictly increase. Safe to call from any thread (one attribute write).

        This is the way to change the epoch without pausing; a weight update uses
        :meth:`pause` and :meth:`resume` (whose epoch is the one held requests go on
        under).
        """
        check_natural("epoch", epoch)
        self._generation_epoch = epoch

    def __attrs_post_init__(self) -> None:
        if self.replicas > 1 and self.engine is None:
            msg = (
                f"replicas={self.replicas} needs engine=EngineModel(...): without an engine "
                "model each request's time is drawn alone, so replicas would change nothing"
            )
            raise ValueError(msg)

    def engine_statistics(self) -> tuple[EngineStatistics, ...]:
        """Each replica's :class:`EngineStatistics` over the interface's life (``running``
        and ``waiting``: now, in the calling Trio run; 0 outside one). Empty without
        ``engine``. Not a checkpoint; safe from any thread between runs."""
        if self.engine is None:
            return ()
        replicas: list[Replica] | None = None
        try:
            state = self._run_states.get()
        except RuntimeError:  # outside a Trio run
            state = None
        if state is not None and state.cluster is not None:
            replicas = state.cluster.replicas
        stats = []
        for number, counters in enumerate(self._counters):
            replica = replicas[number] if replicas is not None else None
            stats.append(
                EngineStatistics(
                    replica=number,
                    prompt_tokens=counters.prompt_tokens,
                    prefix_cache_hits=counters.prefix_cache_hits,
                    stale_prefix_hits=counters.stale_prefix_hits,
                    prefill_tokens=counters.prefill_tokens,
                    generation_tokens=counters.generation_tokens,
                    preemptions=counters.preemptions,
                    running=len(replica.running) if replica is not None else 0,
                    waiting=len(replica.waiting) if replica is not None else 0,
                    busy_seconds=counters.busy_seconds,
                    steps=counters.steps,
                )
            )
        return tuple(stats)

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        """Sample a completion and simulate its generation.

        Raises ``ValueError`` when the policy returns no candidates or bad
        probabilities, or (with ``engine``) when the prompt and completion cannot fit in
        a replica's KV cache.

        Cancellation: a checkpoint at least once (the first-token wait); cancellable at
        every token step and while held by a pause, leaving nothing behind (with
        ``engine``, the request leaves its replica's queue or batch, and its blocks are
        freed, at once).
        """
        prompt_text, messages = self._prompt(request)
        # The random stream is fixed on arrival, so a pause never changes the sample.
        rng = self._request_rng(prompt_text, request.generation_args.seed)
        if self.engine is not None:
            (response,) = await self._engine_generate(request, prompt_text, messages, [rng])
            return response
        return await self._latency_generate(request, prompt_text, messages, rng)

    async def base_generate_group(
        self, request: InferenceRequest, n: int
    ) -> list[InferenceResponse]:
        """``n`` completions of ``request``, as ``n`` calls of :meth:`base_generate` made
        one after the other would sample them: choice 0 is what one call samples, and
        choice ``i`` of a request with ``GenerationArgs.seed`` is what one call with the
        seed ``seed + i`` samples (as vLLM seeds the choices of an ``n`` request).

        With ``engine``, the choices go to one replica together (placed as one call), so
        the prompt is prefilled once and its blocks shared; without it, each choice waits
        its own latency. A subclass that overrides :meth:`base_generate` gets ``n`` calls
        of it.

        Cancellation: as :meth:`base_generate`, for every choice: none is left running.
        """
        seed = request.generation_args.seed
        choices = [request]
        for i in range(1, n):
            if seed is None:
                choices.append(request)
            else:
                args = attrs.evolve(request.generation_args, seed=choice_seed(seed, i))
                choices.append(attrs.evolve(request, generation_args=args))
        responses: list[InferenceResponse | None] = [None] * n
        if type(self).base_generate is not EmbeddedInference.base_generate:

            async def overridden(i: int) -> None:
                responses[i] = await self.base_generate(choices[i])

            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(overridden, i)
            return [response for response in responses if response is not None]
        prompt_text, messages = self._prompt(request)
        # Drawn in choice order, before any waiting: choice i is the i-th sample.
        rngs = [self._request_rng(prompt_text, choice.generation_args.seed) for choice in choices]
        if self.engine is not None:
            return await self._engine_generate(request, prompt_text, messages, rngs)

        async def choice(i: int) -> None:
            responses[i] = await self._latency_generate(choices[i], prompt_text, messages, rngs[i])

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(choice, i)
        return [response for response in responses if response is not None]

    def _prompt(self, request: InferenceRequest) -> tuple[str, list[ChatMessage]]:
        messages = request.prompt
        if request.prompt_ids is None:
            return render_plain_chat(messages), messages
        prompt_text = decode_code_points(request.prompt_ids)
        if not messages:
            messages = [ChatMessage(role="user", content=prompt_text)]
        return prompt_text, messages

    def _sampled(
        self,
        messages: list[ChatMessage],
        args: GenerationArgs,
        rng: np.random.Generator,
    ) -> tuple[str, str, float]:
        """``(completion, generated, probability)``: the completion drawn, the part of
        it generated (``max_tokens``), and its probability as sampled."""
        completions, probs = distribution(self.policy, messages)
        index, probability = sample_index(probs, args, rng)
        completion = completions[index]
        max_tokens = args.max_tokens
        generated = completion if max_tokens is None else completion[:max_tokens]
        return completion, generated, probability

    def _response(
        self,
        prompt_text: str,
        completion: str,
        generated: str,
        probability: float,
        policy_epoch: list[tuple[int, int]],
        kv_cache_epoch: list[tuple[int, int]],
        num_evictions: int = 0,
    ) -> InferenceResponse:
        token_logprob = math.log(probability) / len(completion) if completion else 0.0
        raw_text = prompt_text + generated
        return InferenceResponse(
            response=ChatMessage(role="assistant", content=generated),
            raw_text=raw_text,
            token_ids=[ord(character) for character in raw_text],
            prompt_length=len(prompt_text),  # the code points of prompt_ids when given
            logprobs=[token_logprob] * len(generated),
            policy_epoch=policy_epoch,
            kv_cache_epoch=kv_cache_epoch,
            num_evictions=num_evictions,
            finish_reason="length" if len(generated) < len(completion) else "stop",
            logprobs_mode="processed",
        )

    async def _latency_generate(
        self,
        request: InferenceRequest,
        prompt_text: str,
        messages: list[ChatMessage],
        rng: np.random.Generator,
    ) -> InferenceResponse:
        """One request whose time the :class:`LatencyModel` draws (no engine)."""
        state = self._run_state()
        await state.hold(admission=True)
        completion, generated, probability = self._sampled(messages, request.generation_args, rng)
        speed = self.latency.speed_factor(rng)
        first_token = self.latency.first_token * speed
        per_token = self.latency.per_token * speed

        state.admitted += 1
        k = 0
        try:
            policy_epoch = [(0, self._generation_epoch)]
            kv_cache_epoch = list(policy_epoch)
            await state.prefill(first_token)
            sample = current_call().span
            if sample is not None:
                sample.first_event("first_token")
            recomputed = False
            while k < len(generated):
                if state.holds_in_flight():
                    if await state.hold(admission=False):
                        # Aborted: continued from token k after a new prefill of the
                        # prompt and the k tokens, whose cache is computed again.
                        await state.prefill(first_token)
                        recomputed = True
                    continue
                epoch = self._generation_epoch
                stamp(policy_epoch, k, epoch)
                if recomputed or k == 0:
                    # The prompt's cache is computed by the first token (held with it
                    # by a pause), and all of it again for an abort's continuation:
                    # from token k on, the tokens attend to KV of these weights. (After
                    # a keep pause they attend to the cache computed before it.)
                    stamp(kv_cache_epoch, k, epoch)
                    recomputed = False
                state.decoding += 1
                try:
                    await trio.sleep(per_token)
                finally:
                    state.decoding -= 1
                    state.wake_pause()
                k += 1
        except BaseException:
            progress = current_call().progress
            if progress is not None:
                progress.generated_tokens += k  # a cut member's work
            raise
        finally:
            state.admitted -= 1
            state.wake_pause()
        return self._response(
            prompt_text, completion, generated, probability, policy_epoch, kv_cache_epoch
        )

    # ------------------------------------------------------------------ the engine

    async def _engine_generate(
        self,
        request: InferenceRequest,
        prompt_text: str,
        messages: list[ChatMessage],
        rngs: list[np.random.Generator],
    ) -> list[InferenceResponse]:
        """The choices of one call, generated by the engine model on one replica."""
        engine = self.engine
        if engine is None:  # pragma: no cover - callers check
            raise RuntimeError("no engine model")
        state = self._run_state()
        await state.hold(admission=True)
        sampled = [self._sampled(messages, request.generation_args, rng) for rng in rngs]
        prompt_ids = [ord(character) for character in prompt_text]
        capacity = engine.num_blocks * engine.block_size
        longest = len(prompt_ids) + max(len(generated) for _, generated, _ in sampled)
        if longest > capacity:
            msg = (
                f"a request of {len(prompt_ids)} prompt ids and up to "
                f"{longest - len(prompt_ids)} generated ones needs {longest} ids of KV "
                f"cache, more than a replica holds (EngineModel num_blocks * block_size = "
                f"{capacity}); raise num_blocks or lower max_tokens"
            )
            raise ValueError(msg)
        cluster = self._cluster(state, engine)
        group, episode = placement_key()
        cluster.arrived += 1
        order = admission_order(group, episode, cluster.arrived)
        start_epoch = current_call().start_epoch
        priority = self._generation_epoch if start_epoch is None else start_epoch
        salt = self._engine_salt(priority)
        sequences = [
            EngineRequest(
                tokens=prompt_ids + [ord(character) for character in generated],
                prompt_length=len(prompt_ids),
                target=len(generated),
                order=order,
                priority=priority,
                salt=salt(priority),
                resalt=salt,
                kv_floor=priority,
            )
            for _, generated, _ in sampled
        ]
        call = Call(sequences, group, episode)
        cluster.submit(call)
        state.admitted += 1
        try:
            for sequence in sequences:
                await sequence.done.wait()
        except BaseException:
            progress = current_call().progress
            if progress is not None:
                # A cut member's work (read before the replica lets the call go).
                progress.generated_tokens += sum(sequence.generated for sequence in sequences)
            raise
        finally:
            state.admitted -= 1
            state.wake_pause()
            cluster.end(call)
        responses = []
        for sequence, (completion, generated, probability) in zip(sequences, sampled, strict=True):
            if sequence.error is not None:
                msg = "the simulated engine failed"
                raise RuntimeError(msg) from sequence.error
            policy_epoch = sequence.policy_epoch or [(0, self._generation_epoch)]
            kv_cache_epoch = sequence.kv_cache_epoch or list(policy_epoch)[:1]
            responses.append(
                self._response(
                    prompt_text,
                    completion,
                    generated,
                    probability,
                    policy_epoch,
                    kv_cache_epoch,
                    sequence.preemptions,
                )
            )
        return responses

    def _engine_salt(self, start: int) -> Callable[[int], tuple[str, ...]]:
        """The salt of a call started under ``start``, as a function of the epoch it
        runs under (its start, or the epoch an ``abort`` continuation resumes under): the
        root of its requests' block hashes. No salt is one root shared by all."""
        continuations = 0

        def salt(epoch: int) -> tuple[str, ...]:
            nonlocal continuations
            value, _ = salt_of(self.cache_salt, self.run_id, start, epoch, continuations)
            continuations += 1
            return ("unsalted",) if value is None else ("salt", value)

        return salt

    def _cluster(self, state: RunState, engine: EngineModel) -> Cluster:
        cluster = state.cluster
        if cluster is None:
            placement = Placement(
                replicas=self.replicas, routing=self.routing, margin=self.routing_margin
            )
            replicas = [
                Replica(number, engine, counters) for number, counters in enumerate(self._counters)
            ]
            cluster = state.cluster = Cluster(engine, placement, replicas)
            trio.lowlevel.spawn_system_task(
                self._run_cluster, state, cluster, name=f"{type(self).__name__} engine"
            )
        return cluster

    async def _run_cluster(self, state: RunState, cluster: Cluster) -> None:
        """System task: runs the replicas' steps for this Trio run (until it ends)."""
        try:
            await self._cluster_loop(state, cluster)
        except Exception as error:  # an error here would crash the whole run
            cluster.fail(error)

    async def _cluster_loop(self, state: RunState, cluster: Cluster) -> None:
        replicas = cluster.replicas
        while True:
            holding = state.holds_in_flight()
            if holding and cluster.steps_in_progress() == 0:
                # A keep or abort pause, and no step left: hold until resume().
                if await state.hold(admission=False):
                    for replica in replicas:
                        replica.preempt_all(self._generation_epoch)
            elif holding or not cluster.arrivals:
                with trio.move_on_at(cluster.next_step_end()):
                    await cluster.wake.park()
            now = trio.current_time()
            epoch = self._generation_epoch
            for replica in replicas:
                if replica.step_end is not None and replica.step_end <= now:
                    replica.finish_step(epoch)
                    state.decoding -= 1
            state.wake_pause()
            if state.holds_in_flight():
                # Hold before the pause can return and a resume come: without a
                # checkpoint, so an abort stops what ran, whenever resume() comes.
                continue
            # Every task that runs at this instant runs (the calls that arrive now
            # arrive, a pause starts) before anything is placed or scheduled.
            await settle()
            if state.holds_in_flight():
                continue
            cluster.dispatch()
            now = trio.current_time()
            epoch = self._generation_epoch
            for replica in replicas:
                if replica.step_end is None and replica.has_work and replica.start_step(now, epoch):
                    state.decoding += 1

    def _run_state(self) -> RunState:
        state = self._run_states.get()
        if state is None:
            state = RunState()
            self._run_states.set(state)
        return state

    def _request_rng(self, prompt_text: str, seed: int | None) -> np.random.Generator:
        digest = prompt_digest(prompt_text)
        words = [int.from_bytes(digest[i : i + 8], "little") for i in (0, 8)]
        if seed is not None:
            # A request's own seed fixes its sample, whatever came before (as vLLM's
            # per-request seed does); the per-prompt counter is left alone.
            return np.random.default_rng([self.seed, *words, _SEEDED, seed])
        occurrence = self._requests_per_prompt.get(digest, 0)
        self._requests_per_prompt[digest] = occurrence + 1
        return np.random.default_rng([self.seed, *words, occurrence])


#: Marks a request's own seed in the entropy of its random stream (an unseeded
#: request's stream has the per-prompt counter in that place instead).
_SEEDED: Final = 0x5EED
