"""The grouped pipeline: the reference core.

How a group flows (``docs/reference-design.md`` tells it with the invariants and the
tests that hold each):

- ``_run.py``: the life. :func:`open_pipeline` runs a fixed set of workers in a nursery;
  each claims a slot, generates its group and sends it into a bounded
  ``trio.open_memory_channel``; leaving the ``async with`` cancels the workers before the
  channel closes. :class:`Pipeline` keeps its state private and offers verbs (take, take
  back, settle, weight update, statistics).
- ``_attempts.py``: one slot's group: each attempt in a cancel scope of its own;
  retries (stamina), skipping and filtering, written once.
- ``_groups.py``: what a call returned, checked and made into its slot's group.
- ``_slots.py``: free slots (a queue with a semaphore) and outstanding batches.
- ``_order.py``: ``enforce_order``, whole batches in ``batch_id`` order.
- ``_epochs.py``: the policy epoch, the calls in flight, the weight-update gate,
  ``weight_update`` and admission inside the staleness bound.
- ``_stream.py``: :class:`RolloutStream`, one stream over a :class:`GroupSource` (the
  local pipeline, or the Ray merge).
- ``_ledger.py``: the counters, and :class:`RolloutStreamStatistics`.
- ``_metrics.py``: ``stream.metrics()``.
- ``_failure.py``: :class:`FailurePolicy` and the failures it names.
- ``_cuts.py``: members cut at the staleness bound or over-provisioned (the library's
  agents).
- ``_sampling.py``: request seeds, the sampling record, the check for biased sampling.
- ``_tracing.py``: a span per call, when OpenTelemetry is on.

The context of each call (slot, attempt, start epoch, draws, cuts, span) is one frozen
:class:`~trio_rollouts._context.CallContext`, in ``trio_rollouts/_context.py``.
"""

from trio_rollouts.pipeline._epochs import WeightUpdate as WeightUpdate
from trio_rollouts.pipeline._failure import FailureBudgetExceededError as FailureBudgetExceededError
from trio_rollouts.pipeline._failure import FailurePolicy as FailurePolicy
from trio_rollouts.pipeline._failure import GroupTimeoutError as GroupTimeoutError
from trio_rollouts.pipeline._failure import RewardTimeoutError as RewardTimeoutError
from trio_rollouts.pipeline._failure import StepTimeoutError as StepTimeoutError
from trio_rollouts.pipeline._ledger import EnvironmentStatistics as EnvironmentStatistics
from trio_rollouts.pipeline._ledger import RolloutStreamStatistics as RolloutStreamStatistics
from trio_rollouts.pipeline._run import PipelineConfig as PipelineConfig
from trio_rollouts.pipeline._run import open_pipeline as open_pipeline
from trio_rollouts.pipeline._sampling import SamplingBiasError as SamplingBiasError
from trio_rollouts.pipeline._sampling import SamplingBiasWarning as SamplingBiasWarning
from trio_rollouts.pipeline._stream import GroupSource as GroupSource
from trio_rollouts.pipeline._stream import RolloutStream as RolloutStream

__all__ = [
    "EnvironmentStatistics",
    "FailureBudgetExceededError",
    "FailurePolicy",
    "GroupSource",
    "GroupTimeoutError",
    "PipelineConfig",
    "RewardTimeoutError",
    "RolloutStream",
    "RolloutStreamStatistics",
    "SamplingBiasError",
    "SamplingBiasWarning",
    "StepTimeoutError",
    "WeightUpdate",
    "open_pipeline",
]
