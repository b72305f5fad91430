"""One attempt of :class:`~trio_rollouts.inference.OpenAIInference` on one replica
(:class:`Exchange`): the body sent as negotiation has learned it (and sent again at once
without a field the replica refuses), on the server's own route when its dialect takes
it, the reply read and checked against what was asked; and the replica every request of
a group call goes to (:class:`GroupCallReplica`).

Retries, placement and pauses are the client's (:mod:`._client`); an attempt is what
happens between the pick of a replica and its answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs

from trio_rollouts.inference._errors import (
    BadRequestError,
    InferenceError,
    MalformedResponseError,
    TokenMismatchError,
    UnsupportedFieldError,
    redact,
)
from trio_rollouts.inference._interface import InferenceRequest, InferenceResponse
from trio_rollouts.inference._models import model_not_served
from trio_rollouts.inference._placement import Placement, placement_key
from trio_rollouts.inference.http._transport import Response, encode_json
from trio_rollouts.inference.openai._config import OpenAIConfig
from trio_rollouts.inference.openai._continuation import ABORT, generated_tokens
from trio_rollouts.inference.openai._dialect import Dialect, DialectCall
from trio_rollouts.inference.openai._learned import Learned
from trio_rollouts.inference.openai._negotiation import NEGOTIABLE_FIELDS, named_fields
from trio_rollouts.inference.openai._parse import (
    parse_choices,
    parse_completion,
    server_message,
)
from trio_rollouts.inference.openai._refusals import refused_fields, status_error
from trio_rollouts.inference.openai._run import RunState

__all__ = ["Exchange", "GroupCallReplica", "names_n"]

_WHAT = {"return_token_ids": "token ids", "logprobs": "log-probabilities"}


@attrs.frozen(eq=False)
class Exchange:
    """The attempts of one interface: its configuration, what it learned about the
    replicas, and its server's dialect."""

    config: OpenAIConfig
    learned: Learned
    dialect: Dialect

    async def on(
        self,
        state: RunState,
        index: int,
        request: InferenceRequest,
        body: dict[str, Any],
        path: str,
        endpoint: Literal["chat", "completions"],
        call: DialectCall | None = None,
        n: int = 1,
    ) -> list[InferenceResponse]:
        """One attempt: ``body`` to replica ``index``, sent again at once without any
        negotiable field that the replica refuses (not a retry). With ``call``, to the
        server's own route (vLLM's native one) when the replica may serve it (a replica
        that refuses it falls back, in the same attempt).

        One response; for ``n > 1`` (``body`` asks ``n`` choices) one per choice the
        replica answered, none when it does not take ``n``: known before, or learned now
        from a refusal naming ``n``. One choice answered teaches the same (after this
        attempt). More than ``n`` is a :class:`MalformedResponseError`."""
        # Outstanding from the pick to the answer (native first contact, refusals sent
        # again and all): the load the next pick reads.
        state.in_flight[index] += 1
        try:
            capabilities = self.learned.capabilities
            if n > 1 and not capabilities.takes_n[index]:
                return []
            if call is not None and self.dialect.takes(index, body):
                try:
                    answered = await self._route_attempt(state, index, request, body, call, n)
                except BadRequestError as refusal:
                    message = refusal.server_message or ""
                    if n > 1 and refusal.status in (400, 422) and names_n(None, message):
                        capabilities.stop_n(
                            index, self.config.shown_urls[index], f"refused n ({message})"
                        )
                        return []
                    raise
                if answered is not None:
                    return self.choices_answered(index, answered, n)
            url = self.config.base_url[index] + path
            shown = self.config.shown_urls[index] + path
            sent = body

            def content() -> bytes:
                # Built when the transport is about to write it (it holds a connection), so a
                # field that this replica refused while the request waited is left out.
                nonlocal sent
                sent = capabilities.without_dropped(index, body)
                return encode_json(sent)

            while True:
                state.attempts[index] += 1
                state.choices[index] += n
                response = await state.transport.post(url, shown, content)
                if 200 <= response.status_code < 300:
                    mode = self.learned.probes.mode(index)
                    if n == 1:
                        parsed = parse_completion(
                            endpoint, request, sent, response, shown, self.config.api_key
                        )
                        parsed.logprobs_mode = mode
                        self.dialect.stamp(index, response, [parsed])
                        return [self.check_returned(index, sent, parsed)]
                    choices = parse_choices(
                        endpoint, request, sent, response, shown, self.config.api_key
                    )
                    for parsed in choices:
                        parsed.logprobs_mode = mode
                    self.dialect.stamp(index, response, choices)
                    checked = [self.check_returned(index, sent, parsed) for parsed in choices]
                    return self.choices_answered(index, checked, n)
                said = server_message(response)
                refused = refused_fields(self.config, response, sent, said)
                if not refused:
                    message, data = said
                    if n > 1 and response.status_code in (400, 422) and names_n(data, message):
                        why = f"refused n ({redact(message, self.config.api_key)[:200]})"
                        capabilities.stop_n(index, self.config.shown_urls[index], why)
                        return []
                    error = status_error(self.config, request, response, index, path, sent, said)
                    if response.status_code == 404 and "model" in message.lower():
                        error = await self._name_served_models(state, index, shown, response, error)
                    raise error
                # Each pass drops at least one field that was sent, so this loop ends.
                capabilities.drop(index, refused, self.config.shown_urls[index])
        finally:
            state.in_flight[index] -= 1

    def choices_answered(
        self, index: int, answered: list[InferenceResponse], n: int
    ) -> list[InferenceResponse]:
        """The choices replica ``index`` answered to a request for ``n``; one for
        ``n > 1`` means it ignores ``n`` (remembered), more than ``n`` is malformed."""
        if n > 1 and len(answered) == 1:
            self.learned.capabilities.stop_n(
                index, self.config.shown_urls[index], f"answered one choice to a request for n={n}"
            )
        elif len(answered) > n:
            shown = self.config.shown_urls[index]
            msg = f"{shown} answered {len(answered)} choices to a request for n={n}"
            raise MalformedResponseError(msg, url=shown)
        return answered

    async def _route_attempt(
        self,
        state: RunState,
        index: int,
        request: InferenceRequest,
        body: dict[str, Any],
        call: DialectCall,
        n: int = 1,
    ) -> list[InferenceResponse] | None:
        """``body`` on replica ``index``'s own route of the server, counted as an attempt
        (a refusal too: it was sent): a response per choice; ``None`` if the replica does
        not serve it."""
        # Prepared first (vLLM: labelled), outside the counts: not a generation request.
        await self.dialect.prepare(state.transport, index)
        sent = self.learned.capabilities.without_dropped(index, body)
        state.attempts[index] += 1
        state.choices[index] += n
        responses = await self.dialect.route(state.transport, index, request, sent, call)
        if responses is None:
            return None
        # Token ids not asked (return_token_ids=False): the response is what the OpenAI
        # route would give, without them, though the native reply has them.
        strip = not sent.get("return_token_ids") and not isinstance(sent.get("prompt"), list)
        mode = self.learned.probes.mode(index)
        checked = []
        for response in responses:
            if strip:
                response = attrs.evolve(response, token_ids=None, prompt_length=None)
            response.logprobs_mode = mode
            checked.append(self.check_returned(index, sent, response))
        return checked

    def check_returned(
        self, index: int, sent: dict[str, Any], response: InferenceResponse
    ) -> InferenceResponse:
        """What was asked must be in the response: a field sent but answered without
        (a server that ignores it) raises under the strict option (``True``) and is
        warned about once per replica under negotiation (``None``); logprobs that are not
        one per generated token are dropped (strict: raised)."""
        replica = self.config.shown_urls[index]
        generated = generated_tokens(response)
        # Nothing generated (or aborted before the first token): nothing to carry.
        nothing = generated == 0 or (
            generated is None and response.finish_reason == ABORT and not response.response.content
        )
        for field, option, present in (
            ("return_token_ids", self.config.return_token_ids, response.token_ids is not None),
            ("logprobs", self.config.return_logprobs, response.logprobs is not None),
        ):
            if field not in sent or present or nothing or option is False:
                continue
            what = _WHAT[field]
            name, flag = NEGOTIABLE_FIELDS[field]
            if option is True:
                msg = (
                    f"{replica} accepted {field} but returned no {what}: the server ignores "
                    f"the field, and {name}=True (CLI: {flag.replace('--no-', '--')}) requires "
                    f"{what} in every response; use a server that returns them (vLLM, SGLang), "
                    f"or {name}=None to take responses without them (CLI: leave the flag "
                    f"out) or {name}=False to not ask (CLI: {flag})"
                )
                raise UnsupportedFieldError(msg, url=replica, fields=(field,))
            self.learned.capabilities.warn_once(
                index,
                f"ignored {field}",
                "%s accepted the request field %r but returned no %s: rollouts from this "
                "replica carry no %s (set %s=False to not ask, or %s=True to fail instead)",
                replica,
                field,
                what,
                what,
                name,
                name,
            )
        logprobs = response.logprobs
        if logprobs is not None and generated is not None and len(logprobs) != generated:
            counted = "token ids" if response.token_ids is not None else "usage.completion_tokens"
            if self.config.return_logprobs is True:
                msg = (
                    f"{replica} returned {len(logprobs)} log-probabilities for {generated} "
                    f"generated tokens (by its {counted}): they are not one per token (llama.cpp's "
                    "llama-server merges a character's byte tokens into one entry), and "
                    "return_logprobs=True (CLI: --logprobs) requires them; use "
                    "return_logprobs=None to take such responses without logprobs"
                )
                raise MalformedResponseError(msg, url=replica)
            self.learned.capabilities.warn_once(
                index,
                "logprob count",
                "%s returned %d log-probabilities for %d generated tokens (by its %s); they "
                "do not line up with the tokens, so its responses are kept without logprobs",
                replica,
                len(logprobs),
                generated,
                counted,
            )
            response = attrs.evolve(response, logprobs=None)
        return response

    async def _name_served_models(
        self,
        state: RunState,
        index: int,
        shown: str,
        response: Response,
        error: InferenceError,
    ) -> InferenceError:
        """For a 404 about the model: the error naming the models the replica serves
        (``GET {base_url}/models``, once per run and replica), or ``error`` itself when
        they cannot be had or include ``model``. The server's text stays in
        ``server_message``."""
        root = self.config.shown_urls[index]
        served = await state.models.names(
            state.transport, index, self.config.base_url[index] + "/models", root + "/models"
        )
        said = None if served is None else model_not_served(self.config.model, root, served)
        if said is None:
            return error
        status = f"{response.status_code} {response.reason_phrase}".rstrip()
        return type(error)(
            f"POST {shown} returned {status}: {said}",
            url=error.url,
            status=error.status,
            server_message=error.server_message,
            retry_after=error.retry_after,
        )

    def check_echo(self, ids: list[int], segment: InferenceResponse, what: str) -> None:
        """A token-id prompt's echoed ids must be the ids sent: else the rollout would
        claim a context the server did not generate from (:class:`TokenMismatchError`)."""
        if segment.token_ids is None or segment.prompt_length is None:
            return  # no ids back: the merged response has none either
        echoed = segment.token_ids[: segment.prompt_length]
        if echoed != ids:
            first = next(
                (i for i, (a, b) in enumerate(zip(echoed, ids, strict=False)) if a != b),
                min(len(echoed), len(ids)),
            )
            msg = (
                f"{self.config.server or 'the server'} "
                f"({', '.join(self.config.shown_urls)}) {what} "
                "from other tokens than it was sent (it re-tokenized them): its "
                f"prompt_token_ids ({len(echoed)} ids) differ from the {len(ids)} ids sent, "
                "first at index "
                f"{first}; the rollout would not be the tokens the model saw"
            )
            raise TokenMismatchError(msg, sent=list(ids), echoed=echoed, index=first)

    def token_refusal(self, error: BadRequestError) -> UnsupportedFieldError:
        """The error for a server that refused a token-id prompt (``error``)."""
        msg = (
            f"{error.url or self.config.shown_urls[0]} refused a token-id prompt "
            "(InferenceRequest.prompt_ids, sent as /v1/completions 'prompt': [ids]): "
            f"{error}; use a server that takes token prompts (vLLM, SGLang), or send "
            "the request without prompt_ids (OpenAIInference(token_prompts=False) "
            "for a server that renders chats only: MultiTurnAgent then sends it the "
            "conversation)"
        )
        return UnsupportedFieldError(
            msg,
            fields=("prompt",),
            url=error.url,
            status=error.status,
            server_message=error.server_message,
        )

    def check_tokens(self, ids: list[int], responses: list[InferenceResponse]) -> None:
        """Each response to a token-id prompt must carry the token ids, and the prompt ids
        it echoes must be ``ids``."""
        for response in responses:
            if response.token_ids is None or response.prompt_length is None:
                msg = (
                    f"{self.config.shown_urls[0]} returned no token ids for a token-id prompt "
                    "(InferenceRequest.prompt_ids needs the generated ids: the server must "
                    "honour return_token_ids, as vLLM and SGLang do; for a server that does "
                    "not, use OpenAIInference(token_prompts=False))"
                )
                raise UnsupportedFieldError(msg, fields=("return_token_ids",))
            self.check_echo(ids, response, "generated")


@attrs.define(eq=False)
class GroupCallReplica:
    """The replica every request of one group call goes to: picked by its first attempt;
    a retry picks again, and the group's later requests follow it. Its picks are
    released when the group ends."""

    replica: int | None = None
    picks: list[tuple[Placement, tuple[int, int, int] | None, int]] = attrs.field(factory=list)

    def place(self, placement: Placement, load: Sequence[int]) -> int:
        """Pick the group's replica for the calling task's group and episode."""
        if placement.replicas == 1:
            self.replica = 0
            return 0
        key, episode = placement_key()
        self.replica = index = placement.pick(load, key, episode)
        self.picks.append((placement, key, index))
        return index

    def release(self) -> None:
        for placement, key, index in self.picks:
            placement.release(key, index)
        self.picks.clear()


def names_n(data: object, message: str) -> bool:
    """Whether a 400/422 body names the ``n`` field (a refusal of several choices)."""
    return bool(named_fields(data, message, ("n",)))
