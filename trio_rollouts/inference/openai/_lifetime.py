"""What an :class:`~trio_rollouts.inference.OpenAIInference` holds over its life and in
each Trio run, and what it does with the servers besides generating
(:class:`OpenAILifetime`, the base the client builds on).

Over its life: what it learned about the replicas (one :class:`~._learned.Learned`), the
dialect chosen once from ``server`` (:mod:`._dialect`), its attempts
(:class:`~._attempt.Exchange`). Per Trio run: a :class:`~._run.RunState` in a
:class:`trio.lowlevel.RunVar`, opened by the caller's ``async with`` (closed at its exit,
in the caller's task) or, without one, by the first request of the run (closed by a
system task when the run ends, or by :meth:`~OpenAILifetime.aclose`). And the calls that
are not generation: :meth:`~OpenAILifetime.statistics`, :meth:`~OpenAILifetime.probe`,
and a weight update's :meth:`~OpenAILifetime.pause` and :meth:`~OpenAILifetime.resume`
through the dialect's control endpoints.
"""

from __future__ import annotations

import functools
from types import TracebackType
from typing import Any, Self

import attrs
import trio

from trio_rollouts._context import current_call
from trio_rollouts.inference._errors import InferenceError
from trio_rollouts.inference._pausable import WeightUpdateMode
from trio_rollouts.inference._placement import Placement
from trio_rollouts.inference._salt import salt_of
from trio_rollouts.inference._sampling import LogprobsMode, ReplicaProbe
from trio_rollouts.inference.http._transport import Transport, TransportKind, open_transport
from trio_rollouts.inference.openai._attempt import Exchange
from trio_rollouts.inference.openai._config import ENDPOINT_PATHS, OpenAIConfig, display_url
from trio_rollouts.inference.openai._control import ControlEndpoints, PauseState, control_root
from trio_rollouts.inference.openai._dialect import (
    CLIENT_MODES,
    SERVER_MODES,
    Dialect,
    OpenAIDialect,
    RouteProbe,
)
from trio_rollouts.inference.openai._learned import Learned
from trio_rollouts.inference.openai._probe import ProbeKind, Unreachable, probe_logprobs_mode
from trio_rollouts.inference.openai._run import RunState
from trio_rollouts.inference.openai._sglang import SGLangDialect
from trio_rollouts.inference.openai._sglang import missing_endpoint_hint as sglang_hint
from trio_rollouts.inference.openai._statistics import Counts, OpenAIStatistics, statistics_of
from trio_rollouts.inference.openai._vllm import VLLMDialect, VLLMNative
from trio_rollouts.inference.openai._vllm import missing_endpoint_hint as vllm_hint

__all__ = ["OpenAILifetime", "call_start_epoch_or"]

#: The modes that need a server's control endpoints.
_SERVER_ONLY_MODES = SERVER_MODES - CLIENT_MODES


def call_start_epoch_or(default: int) -> int:
    """The start epoch of the calling task's call (its group's, in a pipeline), or
    ``default``: the one place the client reads the call's context for it."""
    epoch = current_call().start_epoch
    return default if epoch is None else epoch


def _choose_dialect(config: OpenAILifetime) -> Dialect:
    """The dialect of ``config.server``, holding the parts of the interface's
    :class:`Learned` that it keeps up to date."""
    learned = config._learned
    if config.server is None:
        return OpenAIDialect()
    roots = tuple(control_root(url) for url in config.base_url)
    shown_roots = tuple(display_url(root) for root in roots)
    control = ControlEndpoints(
        server=config.server,
        roots=roots,
        shown_roots=shown_roots,
        api_key=config.api_key,
        max_retries=config.max_retries,
        backoff=config.backoff,
        missing_hint=vllm_hint if config.server == "vllm" else sglang_hint,
    )
    if learned.native is not None:  # server="vllm"
        native = VLLMNative(
            roots=roots,
            shown_roots=shown_roots,
            api_key=config.api_key,
            model=config.model,
            max_retries=config.max_retries,
            backoff=config.backoff,
            capabilities=learned.capabilities,
            state=learned.native,
        )
        return VLLMDialect(native, control)
    if learned.versions is not None:  # server="sglang"
        return SGLangDialect(learned.versions, control)
    msg = f"server={config.server!r} has no dialect"  # unreachable: server is validated
    raise ValueError(msg)


@attrs.frozen(kw_only=True, eq=False)
class OpenAILifetime(OpenAIConfig):
    """The life of an :class:`~trio_rollouts.inference.OpenAIInference` besides its
    requests (see the module docstring): its state over its life and per Trio run, its
    ``async with``, statistics, probe, and weight-update control."""

    _learned: Learned = attrs.field(
        init=False,
        repr=False,
        default=attrs.Factory(
            lambda self: Learned.for_replicas(len(self.base_url), self.server), takes_self=True
        ),
    )
    # Chosen once from server: what the server does beyond the OpenAI routes.
    _dialect: Dialect = attrs.field(
        init=False, repr=False, default=attrs.Factory(_choose_dialect, takes_self=True)
    )
    _exchange: Exchange = attrs.field(
        init=False,
        repr=False,
        default=attrs.Factory(
            lambda self: Exchange(self, self._learned, self._dialect), takes_self=True
        ),
    )
    # The client-side hold of each run (it survives aclose(): held calls stay held).
    _pause_var: trio.lowlevel.RunVar[PauseState | None] = attrs.field(
        init=False,
        repr=False,
        factory=lambda: trio.lowlevel.RunVar("trio_rollouts.OpenAIInference.pause"),
    )
    _run_state: trio.lowlevel.RunVar[RunState | None] = attrs.field(
        init=False,
        repr=False,
        factory=lambda: trio.lowlevel.RunVar("trio_rollouts.OpenAIInference"),
    )

    # ----------------------------------------------------------------------- lifetime

    def _make_transport(self) -> Transport:
        kind: TransportKind = "lean" if self.uses_lean_transport else "httpx2"
        return open_transport(kind, timeout=self.timeout, limits=self.limits, api_key=self.api_key)

    def _open_state(self) -> RunState:
        n = len(self.base_url)
        state = RunState(
            transport=self._make_transport(),
            in_flight=[0] * n,
            attempts=[0] * n,
            choices=[0] * n,
            placement=Placement(replicas=n, routing=self.routing, margin=self.routing_margin),
            pause=self._pause_state(),
            totals=self._learned.totals,
            counts=Counts(n),
        )
        self._run_state.set(state)
        return state

    def _state(self) -> RunState:
        state = self._run_state.get(None)
        if state is None:
            state = self._open_state()
            state.keep_until_run_exit(f"{type(self).__name__} transport keeper")
        return state

    async def __aenter__(self) -> Self:
        """Open this run's HTTP transport, owned by the ``async with`` (the calling task);
        an implicit one already open is taken over. Blocks of the same interface may
        nest: the outermost exit closes it.

        Cancellation: a checkpoint; if cancelled, nothing is left open by this call.
        """
        await trio.lowlevel.checkpoint()
        state = self._run_state.get(None)
        if state is None:
            state = self._open_state()
        state.owners += 1
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Close the transport the ``async with`` opened (at the outermost exit), its
        connections with it; requests still in flight fail with
        :class:`InferenceConnectionError`. The run's counts are kept.

        Cancellation: the close runs shielded, bounded by 5 s, and completes even when
        the block is left by a cancellation.
        """
        state = self._run_state.get(None)
        if state is not None and state.owners > 1:
            state.owners -= 1
            await trio.lowlevel.checkpoint()
            return
        await self.aclose()

    async def aclose(self) -> None:
        """Close this run's HTTP client and its connections. Idempotent; a later request
        in the same run opens a new client. Requests still in flight on the old client
        fail with :class:`InferenceConnectionError`.

        You rarely need it: the client of a Trio run is closed when the run ends, or when
        the ``async with`` that opened it exits.

        Cancellation: a checkpoint. If cancelled while waiting, the close still completes
        (it runs shielded, in the task that owns the client).
        """
        state = self._run_state.get(None)
        if state is None:
            await trio.lowlevel.checkpoint()
            return
        self._run_state.set(None)
        await state.close()

    def statistics(self) -> OpenAIStatistics:
        """Counters over the interface's life, every Trio run together (a sync
        :meth:`generate` is a run of its own), plus the current run's so far; requests on
        the wire and held calls of the current run; and the fields each replica refused.
        See :class:`OpenAIStatistics`. Callable from any thread, in a run or not."""
        try:
            state = self._run_state.get(None)
        except RuntimeError:  # outside a Trio run
            state = None
        in_flight, held, run = (0,) * len(self.base_url), 0, None
        if state is not None:
            in_flight, held = tuple(state.in_flight), state.pause.held
            if not state.added:
                run = (state.attempts, state.choices, state.counts)
        learned = self._learned
        return statistics_of(
            self.base_url,
            self.shown_urls,
            learned.capabilities,
            learned.totals,
            run,
            in_flight,
            held,
        )

    # ----------------------------------------------------------------------- the probe

    async def probe(self) -> list[ReplicaProbe]:
        """What each replica says about how it samples, one :class:`ReplicaProbe` per
        replica (in ``base_url`` order), probed concurrently.

        Per replica: two one-token requests with the same short prompt and seed, at
        ``temperature=1`` and ``temperature=0.5``, asking the top 5 logprobs
        (``/v1/completions`` ``logprobs: 5``; for ``endpoint="chat"`` with
        ``token_prompts=False``, a server that renders chats only, ``/v1/chat/completions``
        ``logprobs: true, top_logprobs: 5``). Equal top logprobs (within 1e-5) mean the
        server returns ``"raw"`` logprobs (before temperature: vLLM's default), different
        ones ``"processed"`` (``--logprobs-mode processed_logprobs``); none, a refusal or
        an error status, ``"unknown"``. With ``server="vllm"``, ``native_generate`` says
        whether the replica serves vLLM's native route (asked with a one-token native
        request if no call has asked yet; its first contact labels the replica with the
        current epoch, as a call's would) and ``sampling_mask`` whether a native reply
        carried one.

        Answers are cached per replica for the interface's life (across Trio runs);
        concurrent callers share one probe. An answer for a replica that could not be
        reached (a connection error or a timeout), or whose native route is still
        unknown, is returned but not cached. Probe requests are not counted in
        :meth:`statistics` and never raise server or HTTP errors (they give
        ``"unknown"``); they do not wait for a paused interface. Responses of later calls
        carry the cached ``logprobs_mode`` of the replica that served them.

        Cancellation: cancellable; nothing is cached for a replica whose probe was
        cancelled midway: the next :meth:`probe`, or a caller that was sharing it, asks
        again.
        """
        state = self._state()
        results: dict[int, ReplicaProbe] = {}

        async def one(index: int) -> None:
            results[index] = await self._learned.probes.get(
                state.probes, index, functools.partial(self._probe_replica, state, index)
            )

        async with trio.open_nursery() as nursery:
            for index in range(len(self.base_url)):
                nursery.start_soon(one, index)
        return [results[index] for index in range(len(self.base_url))]

    async def _probe_replica(self, state: RunState, index: int) -> tuple[ReplicaProbe, bool]:
        """The probe of one replica and whether it is final (worth caching)."""
        kind: ProbeKind = (
            "chat" if self.endpoint == "chat" and not self.token_prompts else "completions"
        )
        path = ENDPOINT_PATHS[kind]
        mode: LogprobsMode = "unknown"
        reached = True
        routes: list[RouteProbe] = []

        async def logprobs() -> None:
            nonlocal mode, reached
            url, shown = self.base_url[index] + path, self.shown_urls[index] + path
            try:
                mode = await probe_logprobs_mode(state.transport, url, shown, kind, self.model)
            except Unreachable:
                reached = False

        async def own_route() -> None:
            routes.append(await self._dialect.probe_route(state.transport, index))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(logprobs)
            nursery.start_soon(own_route)
        (route,) = routes
        probe = ReplicaProbe(
            base_url=self.shown_urls[index],
            logprobs_mode=mode,
            native_generate=route.serves,
            sampling_mask=route.sampling_mask,
        )
        return probe, reached and route.final

    # ----------------------------------------------------------------------- weight updates

    @property
    def supported_modes(self) -> frozenset[WeightUpdateMode]:
        """``drain`` and ``restart`` (held client-side) always; ``keep`` and ``abort``
        through the control endpoints of ``server="vllm"`` or ``"sglang"``."""
        return self._dialect.supported_modes

    @property
    def accepts_token_prompts(self) -> bool:
        """``token_prompts``: whether requests with ``prompt_ids`` are sent as id
        prompts."""
        return self.token_prompts

    @property
    def policy_epoch(self) -> int:
        """The epoch last given to :meth:`resume` (0 before any), kept across runs."""
        return self._learned.epoch

    @property
    def stamps_policy_epoch(self) -> bool:
        """Whether every response records the token at which its epoch changed.

        ``True`` only with ``server="vllm"`` once every replica is known to serve vLLM's
        native route and to stamp: it answered a native request, took this interface's
        weight-version label, and no reply carried a label the interface did not set.
        So it is ``False`` until each replica's first call (or :meth:`probe`), which is
        fine: the pipeline reads it at a weight update, to decide whether the calls in
        flight are stamped exactly, and a replica not contacted yet has none in flight.
        Otherwise ``False``: the OpenAI routes do not say where the weights changed, and
        a call is stamped ``[(0, e)]`` with the epoch it started under (unless the
        server returns its own ``policy_epoch`` stamps, as Megatron's does)."""
        return self._dialect.stamps

    def _pause_state(self) -> PauseState:
        pause = self._pause_var.get(None)
        if pause is None:
            pause = PauseState()
            self._pause_var.set(pause)
        return pause

    async def pause(self, mode: WeightUpdateMode) -> None:
        """Hold new calls, and for ``keep`` / ``abort`` pause every replica, concurrently,
        through its control endpoint; return once every replica has acknowledged.

        ``drain`` / ``restart``: nothing is sent (the caller pauses once no call is in
        flight, and every call of this interface waits client-side). ``keep``: vLLM
        ``POST /pause?mode=keep&clear_cache=false``, SGLang ``POST /pause_generation
        {"mode": "in_place"}``: requests in flight stay on the server with their KV
        cache and go on after :meth:`resume`. ``abort``: vLLM ``POST
        /pause?mode=abort&clear_cache=false``, SGLang ``{"mode": "abort"}``: the server
        ends requests in flight with their partial output (``finish_reason "abort"``),
        and each call continues from it after :meth:`resume`, exactly from its token ids
        when it has them. When it returns, no replica is generating: vLLM answers
        ``/pause`` only once its engine is idle with the pause state set
        (``docs/pausing-servers.md``).

        Raises ``TypeError`` for a mode outside :attr:`supported_modes`. If a replica's
        pause fails, every replica it was sent to is resumed under the current epoch,
        held calls are released, and :class:`WeightUpdateError` is raised from the
        failure (a missing endpoint, vLLM's 404 without ``VLLM_SERVER_DEV_MODE=1``, says
        so); failures to resume are added as notes.

        Cancellation: if cancelled, the replicas may be paused; call :meth:`resume`.
        """
        if mode not in self.supported_modes:
            msg = (
                f"{type(self).__name__}(server={self.server!r}) cannot pause for mode "
                f"{mode!r}; it supports {sorted(self.supported_modes)}"
            )
            if self.server is None and mode in SERVER_MODES:
                msg += " (pass server='vllm' or server='sglang' for keep and abort)"
            raise TypeError(msg)
        state = self._state()
        pause = state.pause
        if pause.hold is None:
            pause.hold = trio.Event()
        pause.mode = mode
        dialect = self._dialect
        if mode not in _SERVER_ONLY_MODES or not dialect.pauses_servers:
            await trio.lowlevel.checkpoint()
            return
        pause.server_pauses += 1
        error = await dialect.pause(state.transport, mode, self._learned.server_paused)
        if error is None:
            return
        try:
            await self.resume(self._learned.epoch)
        except InferenceError as exc:
            error.add_note(f"resuming after the failed pause failed too: {exc}")
            for note in getattr(exc, "__notes__", ()):
                error.add_note(note)
        raise error

    async def resume(self, epoch: int) -> None:
        """Set :attr:`policy_epoch` to ``epoch``, resume every replica that may be
        paused (vLLM ``POST /resume``; SGLang ``POST /continue_generation``), and release
        the held calls. With SGLang, a new epoch is first sent as its weight version
        (``POST /update_weight_version {"new_version": "<epoch>",
        "abort_all_requests": false}``). With vLLM, every replica that serves the native
        route gets ``POST /update_weight_version {"new_version": "<epoch>"}`` first (while
        still paused, so that the tokens sampled after ``/resume`` carry it); a replica
        whose label fails only stops stamping (a warning, not an error). Idempotent: when
        nothing is paused it only sets the epoch (and labels native replicas whose label
        differs).

        A replica that fails to resume (within 60 s, retrying transient errors) stays
        marked paused, so that the next :meth:`resume` tries it again; the epoch is set
        and held calls are released anyway, and the first failure is raised (the others
        as notes).

        Cancellation: runs shielded, bounded by 60 s.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            msg = f"epoch must be an int, got {epoch!r}"
            raise TypeError(msg)
        state = self._state()
        pause = state.pause
        learned = self._learned
        error = None
        try:
            error = await self._dialect.resume(
                state.transport,
                epoch,
                held=pause.hold is not None,
                previous_epoch=learned.epoch,
                paused=learned.server_paused,
            )
        finally:
            learned.epoch = epoch
            pause.release()
        if error is not None:
            raise error

    def _salt(self, body: dict[str, Any], epoch: int, continuation: int = 0) -> int | None:
        """Put the request's prefix-cache salt in ``body`` (see ``cache_salt``), for a
        call that starts (``continuation`` 0) or continues under the interface's
        ``epoch``; return the epoch ``kv_cache_epoch`` records, or ``None`` when it is
        unknown (no salt, or not the epoch salt)."""
        key = self._dialect.salt_field
        if key is None or key in self.extra_body:
            return None
        start = call_start_epoch_or(epoch)
        salt, kv_epoch = salt_of(self.cache_salt, self.run_id, start, epoch, continuation)
        if salt is None:
            body.pop(key, None)
        else:
            body[key] = salt
        return kv_epoch
