"""SGLang's dialect (``server="sglang"``): its per-token weight versions, exact
``policy_epoch`` boundaries on its OpenAI routes as vLLM's native route gives them, and
pausing through its control endpoints (:class:`SGLangDialect`, see :mod:`._dialect`).

SGLang stamps the weight version of each generated token (sglang#32660): ``weight_versions``
in a native ``/generate`` reply's ``meta_info``, and in the ``sglext`` object of a reply on
its OpenAI routes (per choice when the request asked ``n``). The version is the label last
set by ``POST /update_weight_version``, which :meth:`OpenAIInference.resume` sends with the
new epoch. Two shapes are read: spans, ``[{"version", "start", "end"}]`` over the generated
tokens (vLLM's form), and one label per generated token.

A label the interface set becomes its epoch; any other (``"default"`` before the first
update, or a label set by someone else) is not guessed into an epoch: the response keeps
the epoch its call started under. A replica counts as stamping once the interface has
labelled it and as long as its replies carry labels it set.

Pausing (``docs/pausing-servers.md``): ``POST /pause_generation {"mode": "in_place" |
"abort"}``, ``POST /continue_generation {}``, and ``POST /update_weight_version
{"new_version": ..., "abort_all_requests": false}`` (its default, ``true``, aborts every
request in flight).
"""

from __future__ import annotations

from typing import Final

import attrs

from trio_rollouts.inference._errors import InferenceError
from trio_rollouts.inference._interface import InferenceResponse
from trio_rollouts.inference._pausable import WeightUpdateError, WeightUpdateMode
from trio_rollouts.inference.http._transport import Response, Transport
from trio_rollouts.inference.openai._continuation import generated_tokens
from trio_rollouts.inference.openai._control import ControlCall, ControlEndpoints
from trio_rollouts.inference.openai._dialect import SERVER_MODES, OpenAIRoutes
from trio_rollouts.inference.openai._versions import Span, policy_boundaries

__all__ = ["SGLangDialect", "SGLangVersions", "missing_endpoint_hint", "reply_spans"]

#: The field SGLang takes a prefix-cache salt in (its OpenAI routes).
SALT_FIELD: Final = "extra_key"


def _spans_of(value: object) -> list[Span] | None:
    """Spans from either shape (``None`` if ``value`` is neither)."""
    if not isinstance(value, list):
        return None
    if all(isinstance(item, str) for item in value):  # one label per token
        spans: list[Span] = []
        for position, label in enumerate(value):
            if spans and spans[-1].version == label:
                spans[-1] = Span(label, spans[-1].start, position + 1)
            else:
                spans.append(Span(label, position, position + 1))
        return spans
    spans = []
    for item in value:
        if not isinstance(item, dict):
            return None
        version, start, end = item.get("version"), item.get("start"), item.get("end")
        if not isinstance(version, str) or type(start) is not int or type(end) is not int:
            return None
        spans.append(Span(version, start, end))
    return spans


def reply_spans(data: object, n: int) -> list[list[Span] | None]:
    """The weight-version spans of each of the ``n`` choices of an SGLang reply (``None``
    for a choice it does not stamp): from a choice's ``meta_info`` or ``sglext``, else the
    reply's ``sglext`` / ``meta_info`` (a list per choice, or one list for a single
    choice)."""
    found: list[list[Span] | None] = [None] * n
    if not isinstance(data, dict):
        return found
    choices = data.get("choices")
    for index in range(n):
        choice = choices[index] if isinstance(choices, list) and index < len(choices) else None
        for holder in ("meta_info", "sglext"):
            part = choice.get(holder) if isinstance(choice, dict) else None
            if isinstance(part, dict) and (spans := _spans_of(part.get("weight_versions"))):
                found[index] = spans
                break
    for holder in ("sglext", "meta_info"):
        part = data.get(holder)
        value = part.get("weight_versions") if isinstance(part, dict) else None
        if not isinstance(value, list) or not value:
            continue
        per_choice = value if isinstance(value[0], list) else [value]
        for index, each in enumerate(per_choice[:n]):
            if found[index] is None:
                found[index] = _spans_of(each)
    return found


@attrs.define(eq=False)
class SGLangVersions:
    """What one interface knows of its SGLang replicas' weight versions (index =
    replica), kept for the interface's life."""

    #: The labels this interface set (``str(epoch)``), and their epochs.
    labels: dict[str, int]
    #: Replicas this interface labelled (a resume sent them a version).
    labelled: list[bool]
    #: Replicas that, once labelled, replied without versions or with one it did not set.
    unstamped: list[bool]

    @classmethod
    def for_replicas(cls, n: int) -> SGLangVersions:
        return cls(labels={}, labelled=[False] * n, unstamped=[False] * n)

    @property
    def stamps(self) -> bool:
        """Every replica labelled by this interface and stamping with its labels."""
        return all(self.labelled) and not any(self.unstamped)

    def labelled_all(self, epoch: int) -> None:
        """Every replica took ``str(epoch)`` as its version."""
        self.labels[str(epoch)] = epoch
        self.labelled = [True] * len(self.labelled)

    def boundaries(self, index: int, spans: list[Span] | None) -> list[tuple[int, int]]:
        """``policy_epoch`` boundaries from replica ``index``'s spans, or ``[]`` (the
        caller stamps the start epoch) when they are missing or carry a label this
        interface did not set."""
        if spans is None or any(span.version not in self.labels for span in spans):
            if self.labelled[index]:
                self.unstamped[index] = True
            return []
        boundaries, _ = policy_boundaries(spans, self.labels, 0)
        return boundaries


# --------------------------------------------------------------------------- the dialect


def missing_endpoint_hint(path: str) -> str:
    """Why an SGLang control endpoint answers 404, and what to do."""
    return (
        f"; this SGLang does not serve {path}: upgrade SGLang, or pass server=None to pause "
        "client-side only (drain, restart)"
    )


@attrs.frozen(eq=False)
class SGLangDialect(OpenAIRoutes):
    """SGLang: the OpenAI routes, epoch stamps from the weight versions in its replies,
    and ``keep`` (``in_place``) / ``abort`` pauses through its control endpoints (see the
    module docstring and :class:`~._dialect.Dialect`)."""

    versions: SGLangVersions
    control: ControlEndpoints

    supported_modes = SERVER_MODES
    pauses_servers = True
    own_route = False
    salt_field: str | None = SALT_FIELD

    @property
    def stamps(self) -> bool:
        """Whether every replica was labelled by this interface and stamps with its labels."""
        return self.versions.stamps

    def stamp(self, index: int, reply: Response, parsed: list[InferenceResponse]) -> None:
        """Each choice's ``policy_epoch`` from the weight versions SGLang stamped on its
        tokens, unless the server sent its own stamps."""
        spans = reply_spans(reply.json(), len(parsed))
        for choice, spans_of_choice in zip(parsed, spans, strict=True):
            if not choice.policy_epoch and generated_tokens(choice) != 0:
                choice.policy_epoch = self.versions.boundaries(index, spans_of_choice)

    async def pause(
        self, transport: Transport, mode: WeightUpdateMode, paused: set[int]
    ) -> WeightUpdateError | None:
        call: ControlCall = (
            "/pause_generation",
            {"mode": "in_place" if mode == "keep" else "abort"},
        )
        return await self.control.pause(transport, mode, call, paused)

    async def resume(
        self,
        transport: Transport,
        epoch: int,
        *,
        held: bool,
        previous_epoch: int,
        paused: set[int],
    ) -> InferenceError | None:
        """A new epoch is first sent as each replica's weight version (never aborting:
        ``abort_all_requests`` is always sent, ``false``), then ``/continue_generation``
        to each replica in ``paused``."""
        if not (held or paused):
            return None
        new_version = epoch if held and epoch != previous_epoch else None

        def calls(replica_paused: bool) -> list[ControlCall]:
            calls: list[ControlCall] = []
            if new_version is not None:
                body = {"new_version": str(new_version), "abort_all_requests": False}
                calls.append(("/update_weight_version", body))
            if replica_paused:
                calls.append(("/continue_generation", {}))
            return calls

        error = await self.control.resume(transport, paused, calls)
        if new_version is not None and error is None:
            self.versions.labelled_all(new_version)
        return error
