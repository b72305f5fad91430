"""trio_rollouts: cancellation-correct RL rollout pipelines (GRPO groups) on Trio."""

from ._agents import Agent as Agent
from ._agents import ContrastiveRolloutGenerator as ContrastiveRolloutGenerator
from ._agents import EvaluationAgent as EvaluationAgent
from ._agents import GroupedRolloutGenerator as GroupedRolloutGenerator
from ._agents import RolloutGenerator as RolloutGenerator
from ._agents import TokenizedRolloutGenerator as TokenizedRolloutGenerator
from ._blocking import BlockingRolloutStream as BlockingRolloutStream
from ._blocking import blocking_grouped_rollouts as blocking_grouped_rollouts
from ._convert import ValidationError as ValidationError
from ._convert import dump_jsonl as dump_jsonl
from ._convert import load_jsonl as load_jsonl
from ._convert import structure as structure
from ._convert import unstructure as unstructure
from ._models import ChatMessage as ChatMessage
from ._models import ContrastiveRollout as ContrastiveRollout
from ._models import EvaluationRequest as EvaluationRequest
from ._models import EvaluationResponse as EvaluationResponse
from ._models import EvaluationResult as EvaluationResult
from ._models import GenerationArgs as GenerationArgs
from ._models import GroupedRolloutRequest as GroupedRolloutRequest
from ._models import Head2HeadRolloutRequest as Head2HeadRolloutRequest
from ._models import LLMChatMessage as LLMChatMessage
from ._models import Request as Request
from ._models import RewardEvaluationResult as RewardEvaluationResult
from ._models import Rollout as Rollout
from ._models import RolloutGroup as RolloutGroup
from ._models import RolloutRequest as RolloutRequest
from ._models import TokenRollout as TokenRollout
from ._stream import EnvironmentStatistics as EnvironmentStatistics
from ._stream import RolloutStream as RolloutStream
from ._stream import RolloutStreamStatistics as RolloutStreamStatistics
from .inference import InferenceInterface as InferenceInterface
from .inference import InferenceRequest as InferenceRequest
from .inference import InferenceResponse as InferenceResponse
from .inference import ReturnsLogProbs as ReturnsLogProbs
from .inference import ReturnsRaw as ReturnsRaw
from .inference import ReturnsTokens as ReturnsTokens

__version__ = "0.1.0.dev0"
