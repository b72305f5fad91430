"""The OpenAI-compatible HTTP backend: :class:`OpenAIInference`, configuration and one
request's life.

The configuration is :class:`~._config.OpenAIConfig`'s (the frozen base: constructor
arguments and their checks), the interface's life besides requests (its state, ``async
with``, statistics, probe, pause and resume) :class:`~._lifetime.OpenAILifetime`'s (the
next base). This module adds the life of a request: place it on a replica
(:mod:`~trio_rollouts.inference._placement`), build its body (:mod:`._bodies`), hold it
during a weight update, send it with its retries (:mod:`~trio_rollouts.inference._retry`)
as one attempt after another (:mod:`._attempt`: negotiation, the server's own route, the
reply checked), and continue it when a pause aborted it (:mod:`._continuation`); and a
group's life: one request for ``n`` choices where the replica takes it, else ``n``
requests, each choice continued on its own.

What differs between servers is the dialect chosen once from ``server``
(:mod:`._dialect`: :class:`~._dialect.OpenAIDialect`, :class:`~._vllm.VLLMDialect`,
:class:`~._sglang.SGLangDialect`); what the interface learns about its replicas is one
mutable :class:`~._learned.Learned` object; what one Trio run holds (the transport, the
counts, the placement) is a :class:`~._run.RunState` in a :class:`trio.lowlevel.RunVar`,
opened by the caller's ``async with`` or, without one, by the first request of the run.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import attrs
import trio

from trio_rollouts._concurrency import flatten_exception_groups
from trio_rollouts.inference._errors import BadRequestError, InferenceError, UnsupportedFieldError
from trio_rollouts.inference._interface import (
    AcceptsTokens,
    GeneratesGroups,
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    ReturnsLogProbs,
    ReturnsRaw,
)
from trio_rollouts.inference._pausable import Pausable
from trio_rollouts.inference._placement import placement_key
from trio_rollouts.inference._retry import call_with_retries
from trio_rollouts.inference.openai._attempt import GroupCallReplica
from trio_rollouts.inference.openai._bodies import choice_body, request_body, token_request_body
from trio_rollouts.inference.openai._config import ENDPOINT_PATHS
from trio_rollouts.inference.openai._continuation import (
    ABORT,
    continuation_body,
    generated_tokens,
    merge_continuation,
    seed_continuation,
    token_continuation_body,
)
from trio_rollouts.inference.openai._dialect import DialectCall
from trio_rollouts.inference.openai._lifetime import OpenAILifetime, call_start_epoch_or
from trio_rollouts.inference.openai._run import RunState

__all__ = ["OpenAIInference"]


@attrs.frozen(kw_only=True, eq=False)
class OpenAIInference(
    OpenAILifetime,
    InferenceInterface,
    GeneratesGroups,
    ReturnsRaw,
    ReturnsLogProbs,
    AcceptsTokens,
    Pausable,
):
    """An OpenAI-compatible HTTP server (vLLM, SGLang, Megatron, OpenAI, ``transformers
    serve``, llama.cpp's server, Ollama) as an inference interface. Frozen: it is
    configuration (its arguments are documented on :class:`~._config.OpenAIConfig`, a
    base); what changes lives with each Trio run, except what the interface learns about
    its replicas (negotiated fields, the server's own route, weight-version labels, the
    probe, the epoch), which it keeps for its whole life.

    **Lifetime.** ``async with OpenAIInference(...) as inference:`` opens the run's HTTP
    transport in the calling task and closes it on exit: nothing runs in the background
    to keep it, and the connections are closed when the block is left by any route.
    Without it, the first request of a Trio run opens the transport and a system task
    closes it when the run ends (a sync :meth:`generate` is a run of its own), or
    :meth:`aclose` earlier.

    **Groups.** :meth:`agenerate_group` (the interface is
    :class:`~trio_rollouts.inference.GeneratesGroups`) sends one request for ``n``
    completions (``"n": n``) on the route a call takes (chat, completions, or vLLM's
    native route, which takes ``sampling_params.n``): the server prefills the prompt once
    and schedules the choices together. It returns one response per choice, each with its
    own ``token_ids``, ``logprobs``, ``finish_reason`` and ``policy_epoch``, and ``usage``
    split per choice (the prompt's tokens in each, the choice's own completion tokens); a
    choice that a pause aborted is continued on its own. A replica that refuses ``n`` (a
    400 or 422 naming it: vLLM's native route refuses ``n`` above ``--max-num-seqs``) or
    answers one choice for ``n > 1`` gets its groups as ``n`` concurrent requests from
    then on, for the interface's life (one warning per replica; :meth:`statistics` lists
    ``n`` among its ``dropped_fields``); so does a greedy request (``temperature`` 0,
    which vLLM refuses with ``n > 1``). Those requests of a seeded group carry ``seed +
    i``, the seed vLLM gives choice ``i`` of a request with ``n``: the same ids either
    way. In :meth:`statistics`, a request for ``n`` choices is one of ``attempts`` (and
    of ``in_flight`` while it runs) and ``n`` of ``choices``.

    Every set field of the request's ``GenerationArgs`` is forwarded as is
    (``temperature``, ``top_p``, ``max_tokens``, ``seed``, and ``top_k`` as a top-level
    key, which vLLM and SGLang accept); unset ones are left out, so the server's defaults
    apply. The ``k``-th continuation of an aborted seeded call is sent
    ``continuation_seed(seed, k)`` instead (no two requests share a seed).

    The response fills ``raw_text`` (the server's ``raw_text`` when it sends one, as
    Megatron's does; else the prompt sent to ``/completions``, or
    ``render_plain_chat(prompt)``, followed by the completion), ``token_ids`` and
    ``prompt_length`` when the server returns prompt and generated ids, ``logprobs``
    (with or without token ids), ``finish_reason``, ``usage``, and Megatron's
    ``policy_epoch``, ``kv_cache_epoch`` and ``num_evictions`` when present (without
    Megatron's stamps, ``policy_epoch`` is ``[(0, e)]``, ``e`` the :attr:`policy_epoch`
    the call started under). See ``docs/pausing-servers.md``.
    """

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        """Send ``request`` to the replica :attr:`routing` picks, retrying transient
        failures (each retry picks again).

        Raises an :class:`InferenceError` subclass naming the URL, the status and the
        server's message; after retries, the last attempt's error, with a note counting
        the attempts. ``ValueError`` for tools with ``endpoint="completions"``. A replica
        that refuses a negotiated field gets the request again without it, within the
        same attempt (see the class docstring).

        While a weight update has paused the interface (:meth:`pause`), the call waits
        before sending anything; a call whose request the server aborted for the pause
        (``finish_reason == "abort"``) waits for :meth:`resume` and is continued from its
        partial output, and returns one response. The response's ``policy_epoch`` is the
        server's stamps when it sends them (vLLM's native route: its ``weight_versions``),
        else ``[(0, e)]`` with ``e`` the :attr:`policy_epoch` when the call started
        (after any wait). Its ``logprobs_mode`` is what :meth:`probe` found for the
        replica that served it (``"unknown"`` if never probed; a call never probes).

        Cancellation: cancellable at any point, including during a backoff wait and while
        held by a pause. A cancelled request releases its connection slot and its
        in-flight count before ``trio.Cancelled`` propagates; the server may still finish
        the generation, except on vLLM's native route, where the request is aborted by
        its id from a system task (best effort, without delaying the cancellation).
        """
        # The hot path, written out (a group's separate calls take _generate_one).
        if request.prompt_ids is None:
            body = request_body(self, request)
            path = ENDPOINT_PATHS[self.endpoint]
        else:
            body = token_request_body(self, request)
            path = ENDPOINT_PATHS["completions"]
        learned = self._learned
        if self.priority:
            body["priority"] = call_start_epoch_or(learned.epoch)
        state = self._state()
        pause = state.pause
        if pause.hold is not None:
            await pause.wait_resumed()
            state = self._state()  # aclose() during the pause closed the old transport
        epoch = learned.epoch
        kv_epoch = self._salt(body, epoch)
        call = DialectCall(start_epoch=epoch) if self._dialect.own_route else None
        server_pauses = pause.server_pauses
        if request.prompt_ids is None:
            (response,) = await self._attempt_with_retries(state, request, body, path, call=call)
        else:
            (response,) = await self._token_attempt(
                state, request, request.prompt_ids, body, path, call
            )
        if kv_epoch is not None and not response.kv_cache_epoch:
            response.kv_cache_epoch = [(0, kv_epoch)]
        if response.finish_reason == ABORT and pause.server_pauses != server_pauses:
            response = await self._continue_aborted(state, request, body, path, response, call)
        if not response.policy_epoch:
            response.policy_epoch = [(0, epoch)]
        return response

    async def base_generate_group(
        self, request: InferenceRequest, n: int
    ) -> list[InferenceResponse]:
        """``n`` completions of ``request``, one response per choice, in choice order,
        from one replica (placed once for the whole group, see :attr:`routing`).

        With ``n == 1``, exactly :meth:`base_generate`. Else one request asking ``n``
        choices (``"n": n``) on the route the call takes (chat, completions, or vLLM's
        native route): the server prefills the prompt once. Each response is as
        :meth:`base_generate` returns one: its own ``token_ids``, ``logprobs``,
        ``finish_reason``, ``logprobs_mode`` and ``policy_epoch``, and ``usage`` for
        the choice alone (the prompt's tokens, the choice's completion tokens). A choice
        that a pause aborted waits for :meth:`resume` and is continued on its own (its
        own seed, as :meth:`base_generate` continues a call); the others are returned
        as they are.

        The group goes as ``n`` concurrent requests instead (each as
        :meth:`base_generate` makes one, on the group's replica) to a replica known not
        to take ``n``, and for a greedy request (``temperature`` 0: vLLM refuses ``n > 1``
        for greedy sampling). A replica that refuses ``n`` (400 or 422 naming it) or
        answers one choice is known from then on, for the interface's life (logged once
        per replica): this group's missing choices are sent separately (an answered
        choice is kept), and so are its later groups. The separate requests of a seeded
        group carry ``seed + i`` (:func:`~._sampling.choice_seed`), the seed vLLM gives
        choice ``i`` of a request with ``n``: the same ids either way.

        Raises as :meth:`base_generate`: the first failure of the group's requests, as
        itself (the others cancelled, and named in a note if they failed at once);
        :class:`MalformedResponseError` for a reply with more than ``n`` choices.

        Cancellation: cancellable at any point; a cancelled group leaves none of its
        requests running here (one nursery holds them all) and releases their
        connection slots and in-flight counts; on vLLM's native route each request is
        aborted by its id (one id for all the choices of a request), as by
        :meth:`base_generate`.
        """
        if n == 1:
            return [await self.base_generate(request)]
        body, path = self._body_and_path(request)
        group = GroupCallReplica()
        try:
            return await self._generate_group(request, body, path, n, group)
        finally:
            group.release()

    async def _generate_group(
        self,
        request: InferenceRequest,
        body: dict[str, Any],
        path: str,
        n: int,
        group: GroupCallReplica,
    ) -> list[InferenceResponse]:
        state = self._state()
        pause = state.pause
        if pause.hold is not None:
            await pause.wait_resumed()
            state = self._state()  # aclose() during the pause closed the old transport
        epoch = self._learned.epoch
        kv_epoch = self._salt(body, epoch)
        server_pauses = pause.server_pauses
        own_route = self._dialect.own_route
        answered: list[InferenceResponse] = []
        if body.get("temperature") != 0:
            call = DialectCall(start_epoch=epoch) if own_route else None
            answered = await self._send(state, request, {**body, "n": n}, path, call, group, n)
            for response in answered:
                _stamp_kv(response, kv_epoch)
        responses: list[InferenceResponse | None] = [None] * n
        if group.replica is None:  # nothing sent yet: the separate requests go together
            group.place(state.placement, state.in_flight)

        async def continue_choice(choice: int, response: InferenceResponse) -> None:
            call = DialectCall(start_epoch=epoch) if own_route else None
            body_of_choice = choice_body(body, choice)
            response = await self._continue_aborted(
                state, request, body_of_choice, path, response, call, group
            )
            responses[choice] = _stamped(response, epoch)

        async def separate(choice: int) -> None:
            body_of_choice = choice_body(body, choice)
            responses[choice] = await self._generate_one(request, body_of_choice, path, group)

        with flatten_exception_groups():  # a failure is raised as itself
            async with trio.open_nursery() as nursery:
                for choice, response in enumerate(answered):
                    if response.finish_reason == ABORT and pause.server_pauses != server_pauses:
                        nursery.start_soon(continue_choice, choice, response)
                    else:
                        responses[choice] = _stamped(response, epoch)
                for choice in range(len(answered), n):
                    nursery.start_soon(separate, choice)
        return [response for response in responses if response is not None]

    def _body_and_path(self, request: InferenceRequest) -> tuple[dict[str, Any], str]:
        """The request's body and path: its endpoint's, or ``/completions`` for an id
        prompt."""
        if request.prompt_ids is None:
            body, path = request_body(self, request), ENDPOINT_PATHS[self.endpoint]
        else:
            body, path = token_request_body(self, request), ENDPOINT_PATHS["completions"]
        if self.priority:
            body["priority"] = call_start_epoch_or(self._learned.epoch)
        return body, path

    async def _generate_one(
        self,
        request: InferenceRequest,
        body: dict[str, Any],
        path: str,
        group: GroupCallReplica | None = None,
    ) -> InferenceResponse:
        """One completion of ``body`` as :meth:`base_generate` makes it (held while paused,
        continued after a pause's abort, stamped with the epoch it started under unless
        the server stamped it), on ``group``'s replica."""
        state = self._state()
        pause = state.pause
        if pause.hold is not None:
            await pause.wait_resumed()
            state = self._state()  # aclose() during the pause closed the old transport
        epoch = self._learned.epoch
        kv_epoch = self._salt(body, epoch)
        call = DialectCall(start_epoch=epoch) if self._dialect.own_route else None
        server_pauses = pause.server_pauses
        (response,) = await self._send(state, request, body, path, call, group)
        _stamp_kv(response, kv_epoch)
        if response.finish_reason == ABORT and pause.server_pauses != server_pauses:
            response = await self._continue_aborted(
                state, request, body, path, response, call, group
            )
        return _stamped(response, epoch)

    async def _send(
        self,
        state: RunState,
        request: InferenceRequest,
        body: dict[str, Any],
        path: str,
        call: DialectCall | None,
        group: GroupCallReplica | None = None,
        n: int = 1,
    ) -> list[InferenceResponse]:
        """``body`` sent with its retries: one response, or for ``n > 1`` one per choice
        the replica answered (none if it does not take ``n``)."""
        if request.prompt_ids is None:
            return await self._attempt_with_retries(
                state, request, body, path, call=call, group=group, n=n
            )
        return await self._token_attempt(
            state, request, request.prompt_ids, body, path, call, group, n
        )

    async def _continue_aborted(
        self,
        state: RunState,
        request: InferenceRequest,
        body: dict[str, Any],
        path: str,
        response: InferenceResponse,
        call: DialectCall | None = None,
        group: GroupCallReplica | None = None,
    ) -> InferenceResponse:
        """Continue a response that a pause aborted, after :meth:`resume`, from its
        partial output, until it finishes for another reason (each pause that aborts it
        again adds a segment); one response. (A group's aborted choice: ``body`` is the
        choice's, without ``n``, and the continuation goes to the group's replica.)

        With token ids (the default with vLLM and SGLang) the continuation is exact: a
        ``/v1/completions`` request whose prompt is the ids so far
        (:func:`token_continuation_body`), checked against the prompt ids the server
        echoes. Without them, it resends the text (:func:`continuation_body`). The
        ``k``-th continuation of a seeded request gets its own seed
        (:func:`~._sampling.continuation_seed`)."""
        pause = state.pause
        dialect = self._dialect
        merged = response
        continuations = 0
        while merged.finish_reason == ABORT:
            await pause.wait_resumed()
            state = self._state()  # aclose() during the pause closed the old client
            if not dialect.pauses_servers:  # pragma: no cover - only a server's pause aborts
                break
            server_pauses = pause.server_pauses
            if merged.token_ids is not None:
                continued = token_continuation_body(body, merged)
                endpoint: Literal["chat", "completions"] = "completions"
            else:
                continued = continuation_body(
                    self.endpoint,
                    body,
                    merged,
                    merged.response.content,
                    dialect.continuation_fields,
                )
                endpoint = self.endpoint
            if continued is None:  # max_tokens used up before the abort
                return attrs.evolve(merged, finish_reason="length")
            continuations += 1
            continued = seed_continuation(continued, body, continuations)
            epoch = self._learned.epoch
            # Salted with the epoch it continues under: its prefix is computed again.
            kv_epoch = self._salt(continued, epoch, continuations)
            (segment,) = await self._attempt_with_retries(
                state,
                request,
                continued,
                ENDPOINT_PATHS[endpoint],
                endpoint,
                call=call,
                group=group,
            )
            _stamp_kv(segment, kv_epoch)
            if merged.policy_epoch and not segment.policy_epoch and generated_tokens(segment):
                # A stamped call continued on a replica that does not stamp: its new
                # tokens were sampled after the resume, under the epoch it set.
                segment.policy_epoch = [(0, epoch)]
            if merged.token_ids is not None:
                self._exchange.check_echo(merged.token_ids, segment, "continued an aborted request")
            merged = merge_continuation(merged, segment)
            if merged.finish_reason == ABORT and pause.server_pauses == server_pauses:
                break  # aborted by something else than a pause: the caller sees it
        return merged

    async def _token_attempt(
        self,
        state: RunState,
        request: InferenceRequest,
        ids: list[int],
        body: dict[str, Any],
        path: str,
        call: DialectCall | None = None,
        group: GroupCallReplica | None = None,
        n: int = 1,
    ) -> list[InferenceResponse]:
        """Send a token-id prompt to ``/v1/completions`` (``path``), or the server's own
        route; each response must carry the token ids, and the prompt ids it echoes must
        be the ones sent."""
        try:
            responses = await self._attempt_with_retries(
                state, request, body, path, "completions", call=call, group=group, n=n
            )
        except BadRequestError as error:
            if isinstance(error, UnsupportedFieldError):
                raise
            raise self._exchange.token_refusal(error) from error
        self._exchange.check_tokens(ids, responses)
        return responses

    async def _attempt_with_retries(
        self,
        state: RunState,
        request: InferenceRequest,
        body: dict[str, Any],
        path: str,
        endpoint: Literal["chat", "completions"] | None = None,
        *,
        call: DialectCall | None = None,
        group: GroupCallReplica | None = None,
        n: int = 1,
    ) -> list[InferenceResponse]:
        """One request and its retries (counted in the run's statistics): its responses
        (see :meth:`~._attempt.Exchange.on`). With ``call``, an attempt may go to the
        server's own route. With ``group``, to the group's replica; a retry chooses
        again, and the group's later requests follow it."""

        retried = False

        def count_retry(error: InferenceError) -> None:
            nonlocal retried
            state.counts.count_retry(error, first=not retried)
            retried = True
            if group is not None:
                group.replica = None

        endpoint = endpoint or self.endpoint
        if group is None and state.placement.replicas == 1:  # nothing to place
            attempt = functools.partial(
                self._exchange.on, state, 0, request, body, path, endpoint, call, n
            )
        else:
            attempt = functools.partial(
                self._attempt, state, request, body, path, endpoint, call, group, n
            )
        return await call_with_retries(
            attempt,
            max_retries=self.max_retries,
            backoff=self.backoff,
            on_retry=count_retry,
        )

    async def _attempt(
        self,
        state: RunState,
        request: InferenceRequest,
        body: dict[str, Any],
        path: str,
        endpoint: Literal["chat", "completions"],
        call: DialectCall | None = None,
        group: GroupCallReplica | None = None,
        n: int = 1,
    ) -> list[InferenceResponse]:
        """One attempt on the replica :attr:`routing` picks for the calling task's group
        and episode (:func:`~trio_rollouts.inference._placement.current_call`), given the
        requests in flight on each; the pick is released when the attempt ends. With
        ``group``: on the group's replica, picked by its first attempt and released when
        the group ends."""
        placement = state.placement
        exchange = self._exchange
        if group is not None:
            index = group.replica
            if index is None:
                index = group.place(placement, state.in_flight)
        elif placement.replicas == 1:
            index = 0
        else:
            key, episode = placement_key()
            index = placement.pick(state.in_flight, key, episode)
            try:
                return await exchange.on(state, index, request, body, path, endpoint, call, n)
            finally:
                placement.release(key, index)
        return await exchange.on(state, index, request, body, path, endpoint, call, n)


def _stamp_kv(response: InferenceResponse, epoch: int | None) -> None:
    """Record that the KV ``response``'s tokens attended to was computed at or after
    ``epoch`` (the epoch of its salt; ``None``: unknown), unless the server said."""
    if epoch is not None and not response.kv_cache_epoch:
        response.kv_cache_epoch = [(0, epoch)]


def _stamped(response: InferenceResponse, epoch: int) -> InferenceResponse:
    """``response`` stamped ``[(0, epoch)]`` (the epoch its call started under) when the
    server stamped nothing."""
    if not response.policy_epoch:
        response.policy_epoch = [(0, epoch)]
    return response
