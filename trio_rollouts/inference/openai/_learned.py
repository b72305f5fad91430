"""What one :class:`~trio_rollouts.inference.OpenAIInference` learns over its life, in one
mutable object (:class:`Learned`) that the frozen interface holds.

Everything here outlives a Trio run (each sync ``generate`` is one) and is kept by a
pickled copy as it was before the split, part by part: what negotiation learned
(:class:`~._negotiation.Capabilities`), SGLang's labels (:class:`~._sglang.SGLangVersions`),
the policy epoch and the replicas that may be paused server-side are kept; the counts of
ended runs (:class:`~._statistics.Counts`), the probe's answers
(:class:`~._probe.ProbeCache`) and vLLM's per-replica facts
(:class:`~._vllm_state.NativeReplicas`, but for its label epoch) start afresh in another
process, which must learn its replicas again.

Writers: the tasks of the interface's Trio runs; the facts only ever move one way (a
field dropped, a replica found not to stamp), so a reader in another thread sees an
older or a newer fact, never a torn one. :meth:`~OpenAIInference.statistics` reads the
counts under their lock.
"""

from __future__ import annotations

import attrs

from trio_rollouts.inference.openai._config import ServerKind
from trio_rollouts.inference.openai._negotiation import Capabilities
from trio_rollouts.inference.openai._probe import ProbeCache
from trio_rollouts.inference.openai._sglang import SGLangVersions
from trio_rollouts.inference.openai._statistics import Counts
from trio_rollouts.inference.openai._vllm_state import NativeReplicas

__all__ = ["Learned"]


@attrs.define(eq=False)
class Learned:
    """What the interface has learned (index = replica, in ``base_url`` order)."""

    #: The request fields each replica refused, whether it takes ``n``, warnings given.
    capabilities: Capabilities
    #: The counts of the Trio runs that have ended (statistics() adds the current run's).
    totals: Counts
    #: What probe() learned per replica.
    probes: ProbeCache
    #: vLLM's native route per replica (served or not, labelled, the labels set), with
    #: ``server="vllm"``.
    native: NativeReplicas | None = None
    #: The weight versions this interface set on SGLang replicas, with ``server="sglang"``.
    versions: SGLangVersions | None = None
    #: The policy epoch last given to resume() (calls of any run start under it).
    epoch: int = 0
    #: The replicas that may be paused server-side (a pause was sent and no resume has
    #: succeeded since): a server's pause outlives the run that made it, and a resume in
    #: any later run resumes them.
    server_paused: set[int] = attrs.field(factory=set)

    @classmethod
    def for_replicas(cls, n: int, server: ServerKind | None) -> Learned:
        """Nothing learned yet about ``n`` replicas of ``server``."""
        return cls(
            capabilities=Capabilities.for_replicas(n),
            totals=Counts(n),
            probes=ProbeCache(),
            native=NativeReplicas.for_replicas(n) if server == "vllm" else None,
            versions=SGLangVersions.for_replicas(n) if server == "sglang" else None,
        )
