"""The demo: asynchronous GRPO on arithmetic, on the embedded backend.

:func:`run_demo` is an end-to-end reinforcement-learning loop with nothing to install and
no GPU. The *model* is :class:`AnswerTablePolicy`, a numpy table of logits served through
:class:`~trio_rollouts.inference.EmbeddedInference`; the *environment* is
:class:`~trio_rollouts.envs.ArithmeticEnvironment`; rollouts stream from the grouped
pipeline with bounded lag (``lag`` batches outstanding); the *trainer* takes one
batch per step, computes GRPO advantages with :meth:`RolloutGroup.advantages`, and
applies one clipped policy-gradient step to the logits (using the rollouts'
log-probabilities) inside :meth:`RolloutStream.weight_update`, which pauses generation
as ``DemoConfig.update_mode`` says and moves the stream to the next policy epoch. Groups
carry the epoch they started under (``start_epoch``) and rollouts real ``policy_epoch``
boundaries, so the trainer measures how stale they are, and
``DemoConfig.max_staleness`` bounds it. On a virtual clock (trio's ``MockClock``) the
simulated latency costs no real time and a seed fixes every number; on the real clock
the loop is the same, but which weights a group is sampled with depends on timing.

With ``DemoConfig.checkpoint_dir`` the run is resumable: the problems come from a
:class:`~trio_rollouts.PromptSource` (seeded, shuffled epochs), and every
``checkpoint_every`` steps (and at the last) the trainer saves, in one file replaced
atomically, the policy's logits, the step, the stream's policy epoch, the source's state,
the metrics so far and the settings; a run started on a directory holding a checkpoint
goes on from it (see :func:`run_demo`).

The package, one idea a module (the model and its GRPO step are public, in
:mod:`trio_rollouts.envs`): ``_environment``
(arithmetic with seeded dispatch delays), ``_config`` (:class:`DemoConfig`), ``_trainer``
(one training step and its :class:`StepMetrics`), ``_checkpoint`` (the checkpoint format:
written atomically, read back checked) and ``_run`` (:func:`run_demo`, the whole run).
``_tool`` is ``--task tool``: :func:`run_tool_demo` trains
:class:`~trio_rollouts.envs.ToolUsePolicy` to call the calculator of
:class:`~trio_rollouts.envs.CalculatorEnvironment`, with the same trainer.
"""

from trio_rollouts.cli._demo._checkpoint import CHECKPOINT_FILE as CHECKPOINT_FILE
from trio_rollouts.cli._demo._checkpoint import DemoCheckpoint as DemoCheckpoint
from trio_rollouts.cli._demo._checkpoint import DemoCheckpointMismatch as DemoCheckpointMismatch
from trio_rollouts.cli._demo._checkpoint import load_demo_checkpoint as load_demo_checkpoint
from trio_rollouts.cli._demo._config import DemoConfig as DemoConfig
from trio_rollouts.cli._demo._run import DemoResult as DemoResult
from trio_rollouts.cli._demo._run import run_demo as run_demo
from trio_rollouts.cli._demo._tool import ToolDemoConfig as ToolDemoConfig
from trio_rollouts.cli._demo._tool import ToolDemoResult as ToolDemoResult
from trio_rollouts.cli._demo._tool import ToolStepMetrics as ToolStepMetrics
from trio_rollouts.cli._demo._tool import run_tool_demo as run_tool_demo
from trio_rollouts.cli._demo._trainer import StepMetrics as StepMetrics
from trio_rollouts.envs import AnswerTablePolicy as AnswerTablePolicy

__all__ = [
    "AnswerTablePolicy",
    "DemoCheckpoint",
    "DemoCheckpointMismatch",
    "DemoConfig",
    "DemoResult",
    "StepMetrics",
    "ToolDemoConfig",
    "ToolDemoResult",
    "ToolStepMetrics",
    "load_demo_checkpoint",
    "run_demo",
    "run_tool_demo",
]
