"""vLLM's dialect (``server="vllm"``): its native RL route, weight-version labels, aborts
by request id, and pausing through its control endpoints.

:class:`VLLMDialect` is what :class:`~trio_rollouts.inference.OpenAIInference` with
``server="vllm"`` speaks (see :mod:`._dialect`). Its route, :class:`VLLMNative`, turns the
body the interface built for an OpenAI route into a native request (the prompt as ids,
text prompts rendered by the server's ``/tokenize``; the wire format is
:mod:`._vllm_wire`'s), labels each replica with the interface's epoch at first contact
and at every resume, turns ``weight_versions`` into ``policy_epoch`` boundaries, and
sends ``abort_requests`` from a system task when a call is cancelled. What it learns
about each replica (:class:`NativeReplicas`) is part of the interface's
:class:`~._learned.Learned`, kept for its life; what belongs to one Trio run (locks,
pending aborts) is in :class:`NativeRun`, which the dialect keeps per run.

Pausing (``docs/pausing-servers.md``; the router is mounted only with
``VLLM_SERVER_DEV_MODE=1``): ``POST /pause?mode=keep&clear_cache=false`` or
``?mode=abort&clear_cache=false`` (query parameters, no body), ``POST /resume``.
Requests that arrive while it is paused are admitted and held until resume.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import attrs
import trio

from trio_rollouts._messages import ChatMessage
from trio_rollouts.inference._errors import (
    TRANSIENT_ERRORS,
    InferenceError,
    InferenceTimeoutError,
    MalformedResponseError,
)
from trio_rollouts.inference._interface import (
    InferenceRequest,
    InferenceResponse,
    render_plain_chat,
)
from trio_rollouts.inference._pausable import WeightUpdateError, WeightUpdateMode
from trio_rollouts.inference._retry import RetryBackoff, call_with_retries
from trio_rollouts.inference.http._transport import Response, Transport, encode_json
from trio_rollouts.inference.openai._control import (
    RESUME_TIMEOUT,
    ControlCall,
    ControlEndpoints,
)
from trio_rollouts.inference.openai._dialect import SERVER_MODES, DialectCall, RouteProbe
from trio_rollouts.inference.openai._negotiation import Capabilities
from trio_rollouts.inference.openai._parse import (
    BadField,
    error_for_status,
    read_json,
    server_message,
)
from trio_rollouts.inference.openai._probe import PROBE_PROMPT, PROBE_SEED
from trio_rollouts.inference.openai._versions import policy_boundaries
from trio_rollouts.inference.openai._vllm_state import (
    NativeReplicas,
    NativeRun,
    PendingAborts,
    ReplicaState,
)
from trio_rollouts.inference.openai._vllm_wire import (
    ABORT_PATH,
    ABORT_TIMEOUT,
    DETOKENIZE_PATH,
    GENERATE_PATH,
    LABEL_PATH,
    NOT_SERVED,
    OPENAI_ROUTE_ONLY,
    REQUEST_ID_PREFIX,
    SCALE_OUT_FLAG,
    TOKENIZE_PATH,
    NativeReply,
    native_body,
    new_request_id,
    read_replies,
    read_reply,
    token_list,
    tokenize_body,
)

__all__ = [
    "VLLMDialect",
    "VLLMNative",
    "pause_call",
]

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- the route


@attrs.frozen(kw_only=True, eq=False)
class VLLMNative:
    """The native route of one interface's vLLM replicas (index = replica)."""

    roots: tuple[str, ...]  # each replica's root (base_url less "/v1")
    shown_roots: tuple[str, ...]  # the same without credentials, for messages
    api_key: str | None
    model: str
    max_retries: int
    backoff: RetryBackoff
    capabilities: Capabilities  # for warnings once per replica
    state: NativeReplicas

    def replica(self, index: int) -> ReplicaState:
        return self.state.replicas[index]

    @property
    def stamps(self) -> bool:
        """Whether every replica is known to serve the native route and stamp."""
        return all(replica.stamps for replica in self.state.replicas)

    def takes(self, index: int, body: dict[str, Any]) -> bool:
        """Whether ``body`` goes to replica ``index``'s native route: it may serve it, and
        the body has no tools and no option only the OpenAI routes honour
        (:data:`OPENAI_ROUTE_ONLY`); its prompt is ids, or text the replica can render."""
        replica = self.replica(index)
        if replica.native is False or body.get("tools") or not OPENAI_ROUTE_ONLY.isdisjoint(body):
            return False
        if isinstance(body.get("prompt"), list):
            return True
        return replica.renders and ("messages" in body or isinstance(body.get("prompt"), str))

    # ------------------------------------------------------------------- generate

    async def generate(
        self,
        transport: Transport,
        run: NativeRun,
        index: int,
        request: InferenceRequest,
        body: dict[str, Any],
        call: DialectCall,
    ) -> list[InferenceResponse] | None:
        """One native request for ``body`` (an OpenAI body) to replica ``index``, after its
        first contact (:meth:`first_contact`, a no-op once made): a response per choice
        (one, unless ``body`` asks ``n`` choices: then as many as the reply has, each with
        its own usage). ``None`` when the replica turns out not to serve the route (or
        ``/tokenize``, for a text prompt): the caller sends ``body`` to the OpenAI route,
        and so do later calls. Raises :class:`InferenceError` like the OpenAI routes.

        Cancellation: cancellable; a request cancelled (or timed out) on the wire is
        aborted on the server from a system task, without delaying the cancellation (one
        id for all the choices of a request: vLLM aborts them together)."""
        await self.first_contact(transport, run, index)
        prompt_ids = await self._prompt_ids(transport, index, body, call)
        if prompt_ids is None:
            return None
        request_id = new_request_id()
        sent = native_body(request_id, prompt_ids, body, self.model)
        url = self.roots[index] + GENERATE_PATH
        shown = self.shown_roots[index] + GENERATE_PATH
        try:
            response = await transport.post(url, shown, lambda: encode_json(sent))
        except (trio.Cancelled, InferenceTimeoutError):
            # The server may still be generating it: free its slot (vLLM also aborts a
            # request whose client disconnects; this covers proxies that do not pass the
            # disconnect on, and timeouts).
            self.abort_later(transport, run, index, request_id)
            raise
        if not 200 <= response.status_code < 300:
            if self._refused(index, response):
                return None
            hint = f" (vLLM's native generate route, {SCALE_OUT_FLAG})"
            raise error_for_status(response, shown, self.api_key, hint)
        try:
            data = read_json(response, shown, self.api_key)
            replies = read_replies(data) if body.get("n", 1) > 1 else [read_reply(data)]
        except BadField as exc:
            msg = f"POST {shown} returned {response.status_code} but {exc}"
            raise MalformedResponseError(msg, url=shown, status=response.status_code) from None
        return [
            await self._response(transport, index, request, body, call, prompt_ids, reply)
            for reply in replies
        ]

    async def _response(
        self,
        transport: Transport,
        index: int,
        request: InferenceRequest,
        body: dict[str, Any],
        call: DialectCall,
        sent_ids: list[int],
        reply: NativeReply,
    ) -> InferenceResponse:
        replica = self.replica(index)
        if replica.native is not True:
            replica.native = True
            if replica.labelled is False:
                self.capabilities.warn_once(
                    index,
                    "weight version",
                    "%s serves vLLM's native generate route but does not take "
                    "/update_weight_version (start it with VLLM_SERVER_DEV_MODE=1): its "
                    "calls are stamped with the epoch they started under, not per token",
                    self.shown_roots[index],
                )
        self._learn_prefix(index, reply.request_id)
        if reply.sampling_mask is not None:
            replica.sampling_mask = True
        text = reply.text
        if text is None:  # a server without output_mode: the text of the ids
            text = await self._detokenize(transport, index, reply.token_ids)
        prompt_ids = reply.prompt_ids if reply.prompt_ids is not None else sent_ids
        prompt = body.get("prompt")
        if "messages" in body:
            prompt_text = render_plain_chat(request.prompt)
        else:
            prompt_text = prompt if isinstance(prompt, str) else ""
        return InferenceResponse(
            response=ChatMessage(role="assistant", content=text),
            raw_text=prompt_text + text,
            token_ids=prompt_ids + reply.token_ids,
            prompt_length=len(prompt_ids),
            logprobs=reply.logprobs,
            policy_epoch=self._policy_epoch(index, reply, call.start_epoch),
            finish_reason=reply.finish_reason,
            usage=reply.usage,
            sampling_mask=reply.sampling_mask,
        )

    def _policy_epoch(
        self, index: int, reply: NativeReply, start_epoch: int
    ) -> list[tuple[int, int]]:
        """The reply's boundaries (``[]``: the caller stamps the start epoch)."""
        replica = self.replica(index)
        labels = replica.trusted_labels
        if labels is None or not reply.token_ids:
            return []
        if reply.spans is None:  # a vLLM without weight_versions
            replica.unstamped = True
            return []
        boundaries, foreign = policy_boundaries(reply.spans, labels, start_epoch)
        if foreign:
            replica.foreign = True
            self.capabilities.warn_once(
                index,
                "foreign weight version",
                "%s labelled generated tokens with weight version(s) %s, which this "
                "interface did not set (another client or the trainer calls "
                "/update_weight_version): those tokens are stamped with the epoch their "
                "call started under, and the replica no longer counts as stamping "
                "(stamps_policy_epoch is False)",
                self.shown_roots[index],
                ", ".join(repr(label) for label in foreign),
            )
        return boundaries

    def _learn_prefix(self, index: int, rewritten: str | None) -> None:
        """What the server puts before the ids it is sent, from a reply (so that an abort
        names the id it knows; ``generate-tokens-`` in vLLM 0.32)."""
        if rewritten is None:
            return
        head, found, tail = rewritten.rpartition(REQUEST_ID_PREFIX)
        if found and len(tail) == 32:  # a uuid4 hex
            self.replica(index).id_prefix = head

    def _refused(self, index: int, response: Response) -> bool:
        """Whether a non-2xx answer means the replica does not serve the route; if so, the
        replica falls back to the OpenAI routes for good (warned once)."""
        status = response.status_code
        if status not in NOT_SERVED:
            return False
        message, _ = server_message(response)
        if status == 404 and "model" in message.lower():
            return False  # the route exists; the model does not
        self.replica(index).native = False
        self.capabilities.warn_once(
            index,
            "native generate",
            "%s does not serve vLLM's native %s (%d: %s): start vLLM with %s for exact "
            "per-token policy_epoch boundaries; this replica uses /v1/completions and "
            "/v1/chat/completions",
            self.shown_roots[index],
            GENERATE_PATH,
            status,
            message[:200] or response.reason_phrase,
            SCALE_OUT_FLAG,
        )
        return True

    # ------------------------------------------------------------------- rendering

    async def _prompt_ids(
        self, transport: Transport, index: int, body: dict[str, Any], call: DialectCall
    ) -> list[int] | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            return prompt
        # Keyed by the prompt object, which a body's copies (without a dropped field)
        # share with it, and which lives as long as the call.
        key = id(body.get("messages", prompt))
        rendered = call.rendered.get(key)
        if rendered is None:
            rendered = await self._tokenize(transport, index, body)
            if rendered is None:
                return None
            call.rendered[key] = rendered
        return rendered

    async def _tokenize(
        self, transport: Transport, index: int, body: dict[str, Any]
    ) -> list[int] | None:
        """The ids of ``body``'s text prompt as the replica renders it (``/tokenize``), or
        ``None`` if it does not serve ``/tokenize`` (its text prompts then fall back)."""
        url = self.roots[index] + TOKENIZE_PATH
        shown = self.shown_roots[index] + TOKENIZE_PATH
        content = encode_json(tokenize_body(body, self.model))
        response = await transport.post(url, shown, lambda: content)
        if response.status_code in NOT_SERVED:
            replica = self.replica(index)
            replica.renders = False
            if replica.native is True:  # else its id prompts will say whether it is vLLM's
                self.capabilities.warn_once(
                    index,
                    "tokenize",
                    "%s serves vLLM's native generate route but not %s (%d): its text "
                    "prompts use the OpenAI routes",
                    self.shown_roots[index],
                    TOKENIZE_PATH,
                    response.status_code,
                )
            return None
        data = self._json(response, shown)
        tokens = data.get("tokens") if isinstance(data, dict) else None
        try:
            return token_list(tokens, "$.tokens")
        except BadField as exc:
            msg = f"POST {shown} returned {response.status_code} but {exc}"
            raise MalformedResponseError(msg, url=shown, status=response.status_code) from None

    async def _detokenize(self, transport: Transport, index: int, ids: list[int]) -> str:
        url = self.roots[index] + DETOKENIZE_PATH
        shown = self.shown_roots[index] + DETOKENIZE_PATH
        content = encode_json({"model": self.model, "tokens": ids})
        response = await transport.post(url, shown, lambda: content)
        data = self._json(response, shown)
        text = data.get("prompt") if isinstance(data, dict) else None
        if not isinstance(text, str):
            msg = f"POST {shown} returned {response.status_code} but $.prompt is not a string"
            raise MalformedResponseError(msg, url=shown, status=response.status_code)
        return text

    def _json(self, response: Response, shown: str) -> Any:
        if not 200 <= response.status_code < 300:
            raise error_for_status(response, shown, self.api_key)
        return read_json(response, shown, self.api_key)

    # ------------------------------------------------------------------- labels

    async def first_contact(self, transport: Transport, run: NativeRun, index: int) -> None:
        """Label replica ``index`` with the current epoch before its first native request,
        once per interface (concurrent first calls share it). A replica that refuses the
        label (no ``VLLM_SERVER_DEV_MODE=1``) is used unlabelled and does not stamp; a
        transient failure is raised (the call retries it).

        Cancellation: cancellable; a cancelled first contact is made again by the next
        call."""
        replica = self.replica(index)
        if replica.labelled is not None:
            return
        async with run.locks[index]:
            if replica.labelled is not None:
                return
            replica.contacted = True
            replica.labelled = await self._label(transport, index, self.state.label_epoch)

    async def relabel(self, transport: Transport, run: NativeRun, epoch: int) -> None:
        """Label every replica that serves (or may serve) the native route with ``epoch``,
        concurrently, retrying transient failures. A replica whose label fails keeps an
        old one: it is marked stale (no longer stamping) and warned about, never raised.

        Cancellation: the caller shields it and bounds its time (``resume``)."""
        self.state.label_epoch = epoch
        targets = [
            index
            for index, replica in enumerate(self.state.replicas)
            if replica.contacted and replica.native is not False and replica.labelled is not False
        ]
        async with trio.open_nursery() as nursery:
            for index in targets:
                nursery.start_soon(self._relabel_one, transport, run, index, epoch)

    async def _relabel_one(
        self, transport: Transport, run: NativeRun, index: int, epoch: int
    ) -> None:
        replica = self.replica(index)
        async with run.locks[index]:
            if replica.labelled is not True or replica.label == str(epoch):
                return
            failure = "it did not finish in time"  # cancelled by the resume's deadline
            try:
                if await call_with_retries(
                    lambda: self._label(transport, index, epoch),
                    max_retries=self.max_retries,
                    backoff=self.backoff,
                ):
                    return
                failure = "it refused it"
            except InferenceError as exc:
                failure = str(exc)
            finally:
                # Not labelled (refused, failed or cancelled): the server may carry the
                # old label on tokens of the new weights, so its labels are not trusted.
                if replica.label != str(epoch):
                    replica.stale = True
                    self.capabilities.warn_once(
                        index,
                        "stale weight version",
                        "labelling %s with weight version %r failed (%s): its tokens may "
                        "carry an older label, so its calls are stamped with the epoch they "
                        "started under from now on (stamps_policy_epoch is False)",
                        self.shown_roots[index],
                        str(epoch),
                        failure,
                    )

    async def _label(self, transport: Transport, index: int, epoch: int) -> bool:
        """``POST /update_weight_version {"new_version": str(epoch)}``: ``True`` once set,
        ``False`` if refused (4xx); a transient failure is raised."""
        label = str(epoch)
        url = self.roots[index] + LABEL_PATH
        shown = self.shown_roots[index] + LABEL_PATH
        content = encode_json({"new_version": label})
        response = await transport.post(url, shown, lambda: content)
        replica = self.replica(index)
        if 200 <= response.status_code < 300:
            replica.label = label
            replica.labels[label] = epoch
            return True
        hint = ""
        if response.status_code in (404, 405):
            hint = f"; vLLM serves {LABEL_PATH} only with VLLM_SERVER_DEV_MODE=1"
        error = error_for_status(response, shown, self.api_key, hint)
        if isinstance(error, TRANSIENT_ERRORS):
            raise error
        logger.debug("%s: not labelling this replica: %s", self.shown_roots[index], error)
        return False

    # ------------------------------------------------------------------- aborts

    def abort_later(
        self, transport: Transport, run: NativeRun, index: int, request_id: str
    ) -> None:
        """Have the server abort ``request_id`` (sent to replica ``index``), from a system
        task: best effort, bounded by :data:`ABORT_TIMEOUT`, never raising into the run.
        Ids cancelled together go in one request."""
        aborts = run.aborts[index]
        aborts.pending.append(self.replica(index).id_prefix + request_id)
        if aborts.sending:
            return  # the running sender takes it with the next batch
        aborts.sending = True
        try:
            trio.lowlevel.spawn_system_task(
                self._send_aborts, transport, index, aborts, name="vLLM abort_requests"
            )
        except RuntimeError:  # the run is ending: vLLM aborts on the disconnect anyway
            aborts.sending = False
            aborts.pending.clear()

    async def _send_aborts(self, transport: Transport, index: int, aborts: PendingAborts) -> None:
        try:
            while aborts.pending:
                ids = list(aborts.pending)
                aborts.pending.clear()
                await self._abort(transport, index, ids)
        finally:
            aborts.sending = False

    async def _abort(self, transport: Transport, index: int, ids: list[str]) -> None:
        url = self.roots[index] + ABORT_PATH
        shown = self.shown_roots[index] + ABORT_PATH
        content = encode_json({"request_ids": ids})
        with trio.move_on_after(ABORT_TIMEOUT):
            try:
                response = await transport.post(url, shown, lambda: content)
            except InferenceError as exc:
                logger.debug("aborting %d request(s) failed: %s", len(ids), exc)
            except Exception:  # an exception escaping a system task would crash the run
                logger.warning(
                    "aborting %d request(s) at %s failed", len(ids), shown, exc_info=True
                )
            else:
                if not 200 <= response.status_code < 300:
                    logger.debug("%s answered %d to an abort", shown, response.status_code)
            return
        logger.debug("%s did not answer an abort within %s s", shown, ABORT_TIMEOUT)

    # ------------------------------------------------------------------- probe

    async def negotiate(self, transport: Transport, run: NativeRun, index: int) -> bool:
        """Whether replica ``index`` serves the native route, asked with a one-token
        native request if not known yet (its first contact labels it). Errors are
        raised as by :meth:`generate`; cancellation as there."""
        replica = self.replica(index)
        if replica.native is None:
            body = {"prompt": PROBE_PROMPT, "max_tokens": 1, "seed": PROBE_SEED}
            request = InferenceRequest(prompt=[ChatMessage(role="user", content=PROBE_PROMPT)])
            call = DialectCall(start_epoch=self.state.label_epoch)
            await self.generate(transport, run, index, request, body, call)
        return replica.native is True


# --------------------------------------------------------------------------- the dialect


def pause_call(mode: WeightUpdateMode) -> ControlCall:
    """The request that pauses vLLM for ``mode`` (``keep`` or ``abort``)."""
    # clear_cache defaults to true in vLLM 0.32 and then, whatever the route's docstring
    # says, resets the caches with every running request preempted: keep would lose the KV
    # cache it exists to keep, and abort would empty the prefix cache its continuations
    # reuse.
    return f"/pause?mode={mode}&clear_cache=false", None


def missing_endpoint_hint(path: str) -> str:
    """Why a vLLM control endpoint answers 404, and what to do."""
    return (
        f"; vLLM serves {path.split('?', 1)[0]} only when started with "
        "VLLM_SERVER_DEV_MODE=1 (set it in the server's environment; pause modes need "
        "vLLM >= 0.16), or pass server=None to pause client-side only (drain, restart)"
    )


def _resume_calls(paused: bool) -> list[ControlCall]:
    return [("/resume", None)] if paused else []


#: The field vLLM takes a prefix-cache salt in (its OpenAI routes and the native one).
SALT_FIELD: Final = "cache_salt"


@attrs.frozen(eq=False)
class VLLMDialect:
    """vLLM: its native route for requests it takes, exact epoch stamps from its weight
    versions, and ``keep`` / ``abort`` pauses through its control endpoints (see the module
    docstring and :class:`~._dialect.Dialect`)."""

    native: VLLMNative
    control: ControlEndpoints
    _runs: trio.lowlevel.RunVar[NativeRun | None] = attrs.field(
        factory=lambda: trio.lowlevel.RunVar("trio_rollouts.VLLMDialect"), repr=False
    )

    supported_modes = SERVER_MODES
    pauses_servers = True
    own_route = True
    salt_field: str | None = SALT_FIELD

    @property
    def stamps(self) -> bool:
        """Whether every replica is known to serve the native route and to stamp."""
        return self.native.stamps

    @property
    def continuation_fields(self) -> dict[str, Any]:
        # vLLM renders a generation prompt after the continued message unless told not to.
        return {"add_generation_prompt": False}

    def _run(self) -> NativeRun:
        run = self._runs.get(None)
        if run is None:
            run = NativeRun.for_replicas(len(self.native.roots))
            self._runs.set(run)
        return run

    def takes(self, index: int, body: dict[str, Any]) -> bool:
        return self.native.takes(index, body)

    async def prepare(self, transport: Transport, index: int) -> None:
        await self.native.first_contact(transport, self._run(), index)

    async def route(
        self,
        transport: Transport,
        index: int,
        request: InferenceRequest,
        body: dict[str, Any],
        call: DialectCall,
    ) -> list[InferenceResponse] | None:
        return await self.native.generate(transport, self._run(), index, request, body, call)

    def stamp(self, index: int, reply: Response, parsed: list[InferenceResponse]) -> None:
        return  # the OpenAI routes carry no weight versions; the native route stamps itself

    async def pause(
        self, transport: Transport, mode: WeightUpdateMode, paused: set[int]
    ) -> WeightUpdateError | None:
        return await self.control.pause(transport, mode, pause_call(mode), paused)

    async def resume(
        self,
        transport: Transport,
        epoch: int,
        *,
        held: bool,
        previous_epoch: int,
        paused: set[int],
    ) -> InferenceError | None:
        """Label the native replicas with ``epoch`` first, while still paused, so that the
        tokens sampled after ``/resume`` carry it (shielded, bounded by the resume's
        timeout; a failure only stops that replica stamping), then ``POST /resume`` every
        replica in ``paused``."""
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + RESUME_TIMEOUT
            await self.native.relabel(transport, self._run(), epoch)
        if not (held or paused):
            return None
        return await self.control.resume(transport, paused, _resume_calls)

    async def probe_route(self, transport: Transport, index: int) -> RouteProbe:
        """Whether replica ``index`` serves the native route (asked with a one-token
        native request if no call has asked yet; its first contact labels the replica);
        not final while that is unknown (a connection error, a timeout, a 5xx)."""
        try:
            await self.native.negotiate(transport, self._run(), index)
        except InferenceError as exc:
            # Asked again by the next call or probe.
            shown = self.native.shown_roots[index]
            logger.debug("probing %s's native route failed: %s", shown, exc)
        replica = self.native.replica(index)
        return RouteProbe(
            serves=replica.native is True,
            sampling_mask=replica.sampling_mask,
            final=replica.native is not None,
        )
