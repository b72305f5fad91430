"""The embedded backend: a simulated inference engine that needs no server.

:class:`EmbeddedInference` answers like a model server, on Trio's clock, with token ids,
logprobs and policy epochs, for demos, docs and tests (``docs/embedded.md``). One concern
a module:

- ``_backend``: :class:`EmbeddedInference`, sampling, generation and pausing;
- ``_policy``: what the simulated model says and how long it takes (:data:`Policy`,
  :class:`HashedPromptPolicy`, :class:`LatencyModel`) and its code-point tokens;
- ``_pause``: the pause state of one backend in one Trio run;
- ``_engine``: the engine model (:class:`EngineModel`), a simulated cluster of replicas
  with continuous batching and a prefix cache, and its :class:`EngineStatistics`.

The names are also importable from :mod:`trio_rollouts.inference`.
"""

from trio_rollouts.inference.embedded._backend import EmbeddedInference as EmbeddedInference
from trio_rollouts.inference.embedded._engine import EngineModel as EngineModel
from trio_rollouts.inference.embedded._engine import EngineStatistics as EngineStatistics
from trio_rollouts.inference.embedded._policy import HashedPromptPolicy as HashedPromptPolicy
from trio_rollouts.inference.embedded._policy import LatencyModel as LatencyModel
from trio_rollouts.inference.embedded._policy import Policy as Policy

__all__ = [
    "EmbeddedInference",
    "EngineModel",
    "EngineStatistics",
    "HashedPromptPolicy",
    "LatencyModel",
    "Policy",
]
