"""What the trainer knows about how each sample was drawn: request seeds, the sampling
record, and the check that names biased combinations when a stream opens.

- :func:`request_seed`: the seed of one inference request of a run, a stable hash of the
  run's seed, the epoch its group started under, the problem (its id and the pass over
  the data that drew it), the member's index in the group, the turn; and where needed to
  tell requests apart: how many times the draw was given back before (in this process),
  the group's slot in the stream (a problem that no PromptSource drew), the attempt (a
  group retried after a transient failure). A continuation of an aborted call derives
  its own from the request's, in the interface.
- :func:`sampling_span`: the :class:`~trio_rollouts.SamplingSpan` of one response.
- :func:`check_sampling`: the probe and the check made when a stream opens
  (``GroupedRolloutRequest.sampling_check``).
"""

from __future__ import annotations

import warnings
from typing import Protocol, runtime_checkable

from trio_rollouts._context import current_call
from trio_rollouts._messages import GenerationArgs
from trio_rollouts.inference._interface import (
    InferenceInterface,
    InferenceResponse,
    ReturnsLogProbs,
)
from trio_rollouts.inference._pausable import Pausable
from trio_rollouts.inference._sampling import ReplicaProbe, derive_seed
from trio_rollouts.models._requests import GroupedRolloutRequest
from trio_rollouts.models._rollouts import SamplingSpan

__all__ = [
    "SamplingBiasError",
    "SamplingBiasWarning",
    "check_sampling",
    "request_seed",
    "sampling_span",
]


class SamplingBiasWarning(UserWarning):
    """A replica would return log-probabilities that are not those of the distribution
    it sampled from, for the stream's generation arguments: importance ratios computed
    from them are biased. The message names the combination, the replica and the server
    flag that fixes it. Raised instead as :class:`SamplingBiasError` with
    ``GroupedRolloutRequest(sampling_check="raise")``."""


class SamplingBiasError(ValueError):
    """The stream's generation arguments and a replica's log-probabilities give biased
    importance ratios, and ``sampling_check="raise"`` was asked: raised when the stream
    opens, before any work. The message names the combination, the replica and the
    server flag that fixes it."""


@runtime_checkable
class Probes(Protocol):
    """An interface that can say how its replicas sample (``OpenAIInference``)."""

    async def probe(self) -> list[ReplicaProbe]: ...


# --------------------------------------------------------------------------- seeds


def request_seed(
    request: GroupedRolloutRequest,
    interface: InferenceInterface,
    problem_id: str | None,
    member: int,
    turn: int = 0,
) -> int | None:
    """The seed of member ``member``'s request at ``turn`` (0 for a single-turn call):
    ``request.generation_args.seed`` when the request has no run seed (``None`` when
    neither is set), else a stable hash (see the module docstring). Not a checkpoint."""
    if request.seed is None:
        return request.generation_args.seed
    context = current_call()
    epoch = context.start_epoch
    if epoch is None:
        epoch = interface.policy_epoch if isinstance(interface, Pausable) else 0
    found = None
    for draw in reversed(context.draws or ()):
        if draw.problem_id == problem_id:
            found = draw
            break
    parts: list[int | str | None] = [
        request.seed,
        epoch,
        problem_id,
        None if found is None else found.epoch,
        member,
        turn,
    ]
    if found is None:
        # Not drawn from a PromptSource (an agent's own get_prompt): the same problem may
        # come in several groups, told apart by their slot in the stream.
        slot = context.slot
        if slot is not None:
            parts.extend(("slot", *slot))
    elif found.again:
        # Given back (a skipped or dropped group) and drawn again in this process.
        parts.extend(("again", found.again))
    attempt = context.attempt
    if attempt > 1:
        parts.extend(("attempt", attempt))
    return derive_seed(*parts)


def seeded(args: GenerationArgs, seed: int | None) -> GenerationArgs:
    """``args`` with ``seed`` (unchanged when ``seed`` is ``None`` or already theirs)."""
    if seed is None or args.seed == seed:
        return args
    return args.add(GenerationArgs(seed=seed))


def sampling_span(start: int, args: GenerationArgs, response: InferenceResponse) -> SamplingSpan:
    """The record of one response's generated ids, starting at element position
    ``start``, sampled with ``args`` (as sent)."""
    return SamplingSpan(
        start=start,
        args=args,
        seed=args.seed,
        logprobs_mode=response.logprobs_mode,
        sampling_mask=response.sampling_mask,
    )


# --------------------------------------------------------------------------- the check


_PROCESSED_FLAG = "--logprobs-mode processed_logprobs"
_MASK_FLAG = "--return-sampling-mask"


def biased_combinations(args: GenerationArgs, probe: ReplicaProbe) -> list[tuple[str, str]]:
    """The combinations of ``args`` and ``probe`` whose importance ratios are biased,
    each with the server flag(s) that fix it."""
    found: list[tuple[str, str]] = []
    raw = probe.logprobs_mode == "raw"
    if raw and args.temperature is not None and args.temperature != 1.0:
        found.append(
            (
                f"raw logprobs with temperature={args.temperature!r} (they are computed "
                "before the temperature the sampler applied)",
                _PROCESSED_FLAG,
            )
        )
    if probe.sampling_mask:
        return found
    fix = f"{_MASK_FLAG} (and {_PROCESSED_FLAG})" if raw else _MASK_FLAG
    if args.top_p is not None and args.top_p < 1.0:
        found.append(
            (
                f"top_p={args.top_p!r} without a sampling mask (the trainer cannot apply "
                "the same cut to the policy it scores)",
                fix,
            )
        )
    if args.top_k is not None and args.top_k != -1:
        found.append(
            (
                f"top_k={args.top_k!r} without a sampling mask (the trainer cannot apply "
                "the same cut to the policy it scores)",
                fix,
            )
        )
    return found


def _might_be_biased(args: GenerationArgs) -> bool:
    return (
        (args.temperature is not None and args.temperature != 1.0)
        or (args.top_p is not None and args.top_p < 1.0)
        or (args.top_k is not None and args.top_k != -1)
    )


def _wants_probe(interface: InferenceInterface, args: GenerationArgs) -> bool:
    """Whether opening a stream probes ``interface``: it returns logprobs and can be
    probed, and either the arguments could be biased or it is vLLM (whose two modes the
    sampling record should name)."""
    if not isinstance(interface, Probes) or not isinstance(interface, ReturnsLogProbs):
        return False
    if getattr(interface, "return_logprobs", None) is False:
        return False  # it never asks for logprobs: there is nothing to bias
    return _might_be_biased(args) or getattr(interface, "server", None) == "vllm"


async def check_sampling(request: GroupedRolloutRequest, agent_name: str) -> None:
    """Probe the request's interface when it may matter, and warn about (or raise, as
    ``request.sampling_check`` says) each replica and biased combination.

    Nothing is sent when the check is ``"off"``, when the interface cannot be probed
    (the embedded backend, whose logprobs are processed and which has no server flag to
    fix) or returns no logprobs, or when the arguments cannot be biased and the server
    is not vLLM. The probe itself is cached by the interface.

    Cancellation: a checkpoint only when it probes; cancelled while probing, nothing is
    warned or raised.
    """
    interface = request.inference_interface
    args = request.generation_args
    if request.sampling_check == "off" or not _wants_probe(interface, args):
        return  # no checkpoint: opening a stream that probes nothing is as it was
    probes = await interface.probe()  # type: ignore[attr-defined]
    problems = [
        (probe, combination, fix)
        for probe in probes
        for combination, fix in biased_combinations(args, probe)
    ]
    if not problems:
        return
    messages = [
        f"{probe.base_url}: {combination}; run the server with {fix}, or turn the check "
        "off (sampling_check='off'; CLI: --sampling-check off) if the trainer does not use "
        "these logprobs in importance ratios"
        for probe, combination, fix in problems
    ]
    if request.sampling_check == "raise":
        msg = (
            f"{agent_name}: biased importance ratios (GroupedRolloutRequest.sampling_check="
            f"'raise'): " + "; ".join(messages)
        )
        raise SamplingBiasError(msg)
    for message in messages:
        warnings.warn(f"{agent_name}: {message}", SamplingBiasWarning, stacklevel=4)
