"""What a replica says about how it samples: the probe's answer, and stable request seeds.

:class:`ReplicaProbe` is what :meth:`OpenAIInference.probe` learns about one replica:
which log-probabilities it returns (``"processed"``: from the distribution it sampled
from, after temperature, top-k and top-p; ``"raw"``: before them, vLLM's default;
``"unknown"``), whether it serves vLLM's native ``/inference/v1/generate`` and whether its
responses carry a sampling mask. :func:`derive_seed` makes the per-request seeds of a run
from its parts, the same in every process; :func:`choice_seed` and
:func:`continuation_seed` the seeds of a group's choices and of a call's continuations.
"""

from __future__ import annotations

import hashlib
import json
from typing import Final, Literal, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from trio_rollouts._messages import GenerationArgs

__all__ = [
    "LOGPROBS_MODES",
    "LogprobsMode",
    "ReplicaProbe",
    "choice_seed",
    "continuation_seed",
    "derive_seed",
    "sample_index",
]

#: Which log-probabilities a server returns: ``"processed"`` (what the sampler drew
#: from), ``"raw"`` (before temperature, top-k and top-p) or ``"unknown"``.
LogprobsMode: TypeAlias = Literal["processed", "raw", "unknown"]
LOGPROBS_MODES: Final[tuple[LogprobsMode, ...]] = ("processed", "raw", "unknown")

#: Seeds are 63-bit non-negative ints: vLLM checks a seed against int64, and 63 bits
#: make a collision among a run's requests negligible (about n**2 / 2**64).
_SEED_MASK: Final = (1 << 63) - 1


@attrs.frozen(kw_only=True)
class ReplicaProbe:
    """What one replica answered to :meth:`~trio_rollouts.inference.OpenAIInference.probe`.

    - ``base_url``: the replica, as shown in errors (no credentials).
    - ``logprobs_mode``: ``"processed"``, ``"raw"`` or ``"unknown"`` (the replica
      returned no top log-probabilities, refused the probe or could not be reached).
    - ``native_generate``: whether it serves vLLM's ``/inference/v1/generate``
      (``--enable-scale-out``), which the interface then uses for id prompts.
    - ``sampling_mask``: whether its responses carry the set of tokens the sampler
      kept (vLLM's ``--return-sampling-mask``, GPU model runner only).
    """

    base_url: str
    logprobs_mode: LogprobsMode = attrs.field(
        default="unknown", validator=attrs.validators.in_(LOGPROBS_MODES)
    )
    native_generate: bool = False
    sampling_mask: bool = False


def derive_seed(*parts: int | str | None) -> int:
    """A seed from ``parts`` (ints, strings, ``None``), stable across processes and
    Python versions (BLAKE2b of their JSON, not ``hash()``): a 63-bit non-negative int."""
    data = json.dumps(parts, separators=(",", ":"), ensure_ascii=True).encode()
    digest = hashlib.blake2b(data, digest_size=8, person=b"trio-rollouts").digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


def continuation_seed(seed: int | None, continuation: int) -> int | None:
    """The seed of a request's ``continuation``-th continuation (0: the request itself,
    its seed unchanged): a call that a weight update aborted goes on with a seed of its
    own, so that no two requests of a run share one."""
    if seed is None or continuation == 0:
        return seed
    return derive_seed("continuation", seed, continuation)


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice ``choice`` (0-based) of a seeded group sent as separate requests:
    ``seed + choice`` (modulo 2**63), the seed vLLM gives choice ``choice`` of a request
    with ``n`` (its ``ParentRequest`` seeds child ``i`` with ``seed + i``). So a seeded
    group samples the same ids whether a replica takes ``n`` or gets the group as ``n``
    calls, each choice from a stream of its own, and choice 0 is a plain call with
    ``seed``. Stable across processes (arithmetic, not ``hash()``)."""
    if seed is None or choice == 0:
        return seed
    return (seed + choice) & _SEED_MASK


def sample_index(
    probs: npt.NDArray[np.float64], args: GenerationArgs, rng: np.random.Generator
) -> tuple[int, float]:
    """Pick a completion index as an engine samples a token: temperature, top-k, top-p;
    with the probability it had in the distribution sampled from (processed)."""
    # Most probable first; a stable sort breaks ties by index.
    order = np.argsort(-probs, kind="stable")
    order = order[probs[order] > 0]
    if args.temperature == 0.0:
        # Greedy: vLLM scores greedy requests at temperature 1 in either logprobs mode.
        return int(order[0]), float(probs[order[0]])
    if args.top_k is not None and args.top_k != -1:
        order = order[: args.top_k]
    logits = np.log(probs[order])
    if args.temperature is not None:
        logits = logits / args.temperature
    kept = np.exp(logits - logits.max())
    kept /= kept.sum()
    if args.top_p is not None:
        # The smallest prefix whose mass reaches top_p (at least one candidate).
        cut = int(np.searchsorted(np.cumsum(kept), args.top_p, side="left")) + 1
        kept = kept[:cut] / kept[:cut].sum()
        order = order[:cut]
    chosen = int(rng.choice(len(order), p=kept))
    index = int(order[chosen])
    if args.temperature in (None, 1.0) and args.top_k in (None, -1) and args.top_p in (None, 1.0):
        return index, float(probs[index])  # nothing processed: the policy's own, exactly
    return index, float(kept[chosen])
