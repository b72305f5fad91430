"""The probe of how a replica samples (:meth:`OpenAIInference.probe`): which
log-probabilities it returns (:func:`probe_logprobs_mode`), and the answers kept per
replica (:class:`ProbeCache`) with the probes under way in a run (:class:`ProbeRun`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, Final, Literal

import attrs
import trio

from trio_rollouts.inference._errors import (
    InferenceConnectionError,
    InferenceError,
    InferenceTimeoutError,
)
from trio_rollouts.inference._sampling import LogprobsMode, ReplicaProbe
from trio_rollouts.inference.http._transport import Transport, encode_json

__all__ = [
    "PROBE_PROMPT",
    "PROBE_SEED",
    "ProbeCache",
    "ProbeKind",
    "ProbeRun",
    "Unreachable",
    "probe_logprobs_mode",
]

logger = logging.getLogger(__name__)


#: The probe: a short text prompt, one token, two temperatures, the top 5 logprobs.
PROBE_PROMPT: Final = "The quick brown fox"
PROBE_SEED: Final = 20_240_601
PROBE_TEMPERATURES: Final = (1.0, 0.5)
PROBE_TOP: Final = 5
#: Top logprobs this close are equal (the same numbers, serialised twice).
PROBE_TOLERANCE: Final = 1e-5

ProbeKind = Literal["chat", "completions"]


def probe_body(kind: ProbeKind, model: str, temperature: float) -> dict[str, Any]:
    """One probe request: one token at ``temperature``, the top logprobs asked."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": 1,
        "temperature": temperature,
        "seed": PROBE_SEED,
    }
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": PROBE_PROMPT}]
        body["logprobs"] = True
        body["top_logprobs"] = PROBE_TOP
    else:
        body["prompt"] = PROBE_PROMPT
        body["logprobs"] = PROBE_TOP
    return body


def top_logprobs(data: object) -> list[float] | None:
    """The first generated position's top logprobs, highest first, in either shape
    (completions: ``logprobs.top_logprobs[0]`` a ``{token: logprob}`` object; chat:
    ``logprobs.content[0].top_logprobs`` a list); ``None`` if the reply has none."""
    try:
        logprobs = data["choices"][0]["logprobs"]  # type: ignore[index]
        if logprobs.get("content") is not None:
            values = [item["logprob"] for item in logprobs["content"][0]["top_logprobs"]]
        else:
            values = list(logprobs["top_logprobs"][0].values())
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    if len(values) < 2 or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values
    ):
        return None
    return sorted((float(v) for v in values), reverse=True)


def compare_tops(first: list[float] | None, second: list[float] | None) -> LogprobsMode:
    """Equal top logprobs at two temperatures: ``"raw"`` (taken before temperature);
    different: ``"processed"``; missing: ``"unknown"``."""
    if first is None or second is None or len(first) != len(second):
        return "unknown"
    same = all(abs(a - b) <= PROBE_TOLERANCE for a, b in zip(first, second, strict=True))
    return "raw" if same else "processed"


class Unreachable(Exception):
    """The probe could not reach a replica (its answer is not cached)."""


async def probe_logprobs_mode(
    transport: Transport, url: str, shown: str, kind: ProbeKind, model: str
) -> LogprobsMode:
    """Which logprobs the server at ``url`` (an OpenAI route) returns: one request per
    :data:`PROBE_TEMPERATURES`, concurrently, compared by :func:`compare_tops`. A
    refusal, an error status or a malformed reply is ``"unknown"``; a connection error or
    a timeout raises :class:`Unreachable`.

    Cancellation: cancellable."""
    tops: list[list[float] | None] = [None] * len(PROBE_TEMPERATURES)
    unreachable: list[InferenceError] = []

    async def ask(i: int, temperature: float) -> None:
        content = encode_json(probe_body(kind, model, temperature))
        try:
            response = await transport.post(url, shown, lambda: content)
        except (InferenceConnectionError, InferenceTimeoutError) as exc:
            unreachable.append(exc)
            return
        except InferenceError as exc:  # e.g. a host name that does not exist
            logger.debug("probing %s failed: %s", shown, exc)
            return
        if 200 <= response.status_code < 300:
            try:
                tops[i] = top_logprobs(response.json())
            except ValueError:
                tops[i] = None

    async with trio.open_nursery() as nursery:
        for i, temperature in enumerate(PROBE_TEMPERATURES):
            nursery.start_soon(ask, i, temperature)
    if unreachable:
        raise Unreachable(str(unreachable[0])) from unreachable[0]
    return compare_tops(tops[0], tops[1])


@attrs.define(eq=False)
class _Probing:
    done: trio.Event = attrs.field(factory=trio.Event)
    result: ReplicaProbe | None = None


@attrs.define(eq=False)
class ProbeRun:
    """The probes under way in one Trio run (index = replica)."""

    probing: dict[int, _Probing] = attrs.field(factory=dict)


@attrs.define(eq=False)
class ProbeCache:
    """The probe's answers per replica, over the interface's life (a pickled copy starts
    empty: another process probes again)."""

    probes: dict[int, ReplicaProbe] = attrs.field(factory=dict)

    def mode(self, index: int) -> LogprobsMode:
        """The replica's logprobs mode, ``"unknown"`` if never probed."""
        probe = self.probes.get(index)
        return "unknown" if probe is None else probe.logprobs_mode

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.probes = {}

    async def get(
        self,
        run: ProbeRun,
        index: int,
        probe: Callable[[], Awaitable[tuple[ReplicaProbe, bool]]],
    ) -> ReplicaProbe:
        """The cached probe of replica ``index``, or ``probe()``'s answer (``(answer,
        reached)``: cached only if the replica was reached). Concurrent callers share one
        probe. Cancellation: cancellable; if the caller probing is cancelled, the next
        caller probes again."""
        while True:
            cached = self.probes.get(index)
            if cached is not None:
                return cached
            under_way = run.probing.get(index)
            if under_way is None:
                break
            await under_way.done.wait()
            if under_way.result is not None:
                return under_way.result
        probing = run.probing[index] = _Probing()
        try:
            answer, reached = await probe()
            probing.result = answer
            if reached:
                self.probes[index] = answer
            return answer
        finally:
            del run.probing[index]
            probing.done.set()
