"""trio_rollouts: cancellation-correct RL rollout pipelines (GRPO groups) on Trio."""

# The gateway subpackage, as ``tr.gateway`` (``tr.gateway.serve``).
from trio_rollouts import gateway as gateway
from trio_rollouts.agents._base import Agent as Agent
from trio_rollouts.agents._base import ContrastiveRolloutGenerator as ContrastiveRolloutGenerator
from trio_rollouts.agents._base import EvaluationAgent as EvaluationAgent
from trio_rollouts.agents._base import GroupedRolloutGenerator as GroupedRolloutGenerator
from trio_rollouts.agents._base import RolloutGenerator as RolloutGenerator
from trio_rollouts.agents._base import TokenizedRolloutGenerator as TokenizedRolloutGenerator
from trio_rollouts.agents._environment import BaseEnvironment as BaseEnvironment
from trio_rollouts.agents._environment import Environment as Environment
from trio_rollouts.agents._environment import EnvironmentStep as EnvironmentStep
from trio_rollouts.agents._evaluation import PassAtKEvaluationAgent as PassAtKEvaluationAgent
from trio_rollouts.agents._evaluation import PassAtKEvaluationResponse as PassAtKEvaluationResponse
from trio_rollouts.agents._evaluation import PassAtKResult as PassAtKResult
from trio_rollouts.agents._evaluation import (
    merge_evaluation_responses as merge_evaluation_responses,
)
from trio_rollouts.agents._evaluation import pass_at_k as pass_at_k
from trio_rollouts.agents._evaluation import shard_indices as shard_indices
from trio_rollouts.agents._multitask import (
    MultiTaskEvaluationResponse as MultiTaskEvaluationResponse,
)
from trio_rollouts.agents._multitask import WeightedMultiTask as WeightedMultiTask
from trio_rollouts.agents._multitask import WeightedTask as WeightedTask
from trio_rollouts.agents._reward_only import RewardOnlyAgent as RewardOnlyAgent
from trio_rollouts.agents._rewards import current_reward_limiter as current_reward_limiter
from trio_rollouts.agents._rewards import run_reward as run_reward
from trio_rollouts.bridge._blocking import BlockingRolloutStream as BlockingRolloutStream
from trio_rollouts.bridge._blocking import blocking_grouped_rollouts as blocking_grouped_rollouts
from trio_rollouts.episodes import MultiTurnAgent as MultiTurnAgent
from trio_rollouts.episodes import TemplateBreakError as TemplateBreakError
from trio_rollouts.episodes import TokenFidelityError as TokenFidelityError
from trio_rollouts.gateway import GatewayAgent as GatewayAgent
from trio_rollouts.inference import TRANSIENT_ERRORS as TRANSIENT_ERRORS
from trio_rollouts.inference import AcceptsTokens as AcceptsTokens
from trio_rollouts.inference import EmbeddedInference as EmbeddedInference
from trio_rollouts.inference import InferenceError as InferenceError
from trio_rollouts.inference import InferenceInterface as InferenceInterface
from trio_rollouts.inference import InferenceRequest as InferenceRequest
from trio_rollouts.inference import InferenceResponse as InferenceResponse
from trio_rollouts.inference import LatencyModel as LatencyModel
from trio_rollouts.inference import OpenAIInference as OpenAIInference
from trio_rollouts.inference import ReturnsLogProbs as ReturnsLogProbs
from trio_rollouts.inference import ReturnsRaw as ReturnsRaw
from trio_rollouts.inference import ReturnsTokens as ReturnsTokens
from trio_rollouts.inference import TokenMismatchError as TokenMismatchError
from trio_rollouts.inference import WeightUpdateError as WeightUpdateError
from trio_rollouts.inference._sampling import ReplicaProbe as ReplicaProbe
from trio_rollouts.models import ChatMessage as ChatMessage
from trio_rollouts.models import ContrastiveRollout as ContrastiveRollout
from trio_rollouts.models import Cut as Cut
from trio_rollouts.models import EvaluationRequest as EvaluationRequest
from trio_rollouts.models import EvaluationResponse as EvaluationResponse
from trio_rollouts.models import EvaluationResult as EvaluationResult
from trio_rollouts.models import GenerationArgs as GenerationArgs
from trio_rollouts.models import GroupedRolloutRequest as GroupedRolloutRequest
from trio_rollouts.models import Head2HeadRolloutRequest as Head2HeadRolloutRequest
from trio_rollouts.models import LLMChatMessage as LLMChatMessage
from trio_rollouts.models import Problem as Problem
from trio_rollouts.models import Request as Request
from trio_rollouts.models import RewardEvaluationResult as RewardEvaluationResult
from trio_rollouts.models import Rollout as Rollout
from trio_rollouts.models import RolloutGroup as RolloutGroup
from trio_rollouts.models import RolloutRequest as RolloutRequest
from trio_rollouts.models import SamplingSpan as SamplingSpan
from trio_rollouts.models import TokenRollout as TokenRollout
from trio_rollouts.models import TrainingBatch as TrainingBatch
from trio_rollouts.models import ValidationError as ValidationError
from trio_rollouts.models import dump_jsonl as dump_jsonl
from trio_rollouts.models import load_jsonl as load_jsonl
from trio_rollouts.models import structure as structure
from trio_rollouts.models import unstructure as unstructure
from trio_rollouts.pipeline._epochs import WeightUpdate as WeightUpdate
from trio_rollouts.pipeline._failure import FailureBudgetExceededError as FailureBudgetExceededError
from trio_rollouts.pipeline._failure import FailurePolicy as FailurePolicy
from trio_rollouts.pipeline._failure import GroupTimeoutError as GroupTimeoutError
from trio_rollouts.pipeline._failure import RewardTimeoutError as RewardTimeoutError
from trio_rollouts.pipeline._failure import StepTimeoutError as StepTimeoutError
from trio_rollouts.pipeline._ledger import EnvironmentStatistics as EnvironmentStatistics
from trio_rollouts.pipeline._ledger import RolloutStreamStatistics as RolloutStreamStatistics
from trio_rollouts.pipeline._sampling import SamplingBiasError as SamplingBiasError
from trio_rollouts.pipeline._sampling import SamplingBiasWarning as SamplingBiasWarning
from trio_rollouts.pipeline._stream import RolloutStream as RolloutStream
from trio_rollouts.prompts._source import PromptSource as PromptSource
from trio_rollouts.renderers import AssistantTurn as AssistantTurn
from trio_rollouts.renderers import HFRenderer as HFRenderer
from trio_rollouts.renderers import PlainRenderer as PlainRenderer
from trio_rollouts.renderers import Renderer as Renderer
from trio_rollouts.renderers import ToolCall as ToolCall

__version__ = "0.1.0.dev0"

#: The names most programs need. Every other name imported above stays importable from
#: here (DESIGN.md lists them), and has its home in a subpackage: ``models``,
#: ``inference``, ``agents``, ``prompts``, ``pipeline``, ``episodes``, ``renderers``,
#: ``bridge``, ``gateway``, ``ray``, ``envs``.
__all__ = [
    "Agent",
    "ChatMessage",
    "ContrastiveRollout",
    "ContrastiveRolloutGenerator",
    "EmbeddedInference",
    "Environment",
    "EvaluationAgent",
    "EvaluationRequest",
    "EvaluationResponse",
    "EvaluationResult",
    "FailurePolicy",
    "GenerationArgs",
    "GroupedRolloutGenerator",
    "GroupedRolloutRequest",
    "Head2HeadRolloutRequest",
    "InferenceInterface",
    "InferenceRequest",
    "InferenceResponse",
    "MultiTurnAgent",
    "OpenAIInference",
    "PromptSource",
    "Request",
    "RewardEvaluationResult",
    "Rollout",
    "RolloutGenerator",
    "RolloutGroup",
    "RolloutRequest",
    "RolloutStream",
    "TokenRollout",
    "TokenizedRolloutGenerator",
    "ValidationError",
    "WeightUpdate",
    "WeightedMultiTask",
    "WeightedTask",
    "blocking_grouped_rollouts",
    "dump_jsonl",
    "load_jsonl",
    "pass_at_k",
    "structure",
    "unstructure",
]
