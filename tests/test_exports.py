"""The public API: every name DESIGN.md promises is importable from the package."""

from __future__ import annotations

import trio_rollouts
import trio_rollouts.inference
import trio_rollouts.testing

DESIGN_NAMES = """
ChatMessage LLMChatMessage GenerationArgs Request RolloutRequest GroupedRolloutRequest
Head2HeadRolloutRequest EvaluationRequest Rollout TokenRollout RolloutGroup ContrastiveRollout
EvaluationResult RewardEvaluationResult EvaluationResponse structure unstructure ValidationError
dump_jsonl load_jsonl Agent RolloutGenerator TokenizedRolloutGenerator ContrastiveRolloutGenerator
EvaluationAgent GroupedRolloutGenerator blocking_grouped_rollouts WeightedTask WeightedMultiTask
pass_at_k SamplingSpan SamplingBiasWarning SamplingBiasError
InferenceInterface ReturnsRaw ReturnsTokens ReturnsLogProbs InferenceRequest InferenceResponse
""".split()

INFERENCE_NAMES = """
InferenceInterface InferenceRequest InferenceResponse ReturnsRaw ReturnsTokens ReturnsLogProbs
ReplicaProbe
""".split()

TESTING_NAMES = """
ScriptedAgent GroupScript NullInference NullChatInference ScriptedPausable rollouts
VocabularyInference
""".split()


def test_design_names_are_exported() -> None:
    missing = [name for name in DESIGN_NAMES if not hasattr(trio_rollouts, name)]
    assert missing == []


def test_inference_names_are_exported() -> None:
    missing = [name for name in INFERENCE_NAMES if not hasattr(trio_rollouts.inference, name)]
    assert missing == []


def test_llm_chat_message_is_an_alias() -> None:
    assert trio_rollouts.LLMChatMessage is trio_rollouts.ChatMessage


def test_top_level_reexports_are_the_inference_objects() -> None:
    for name in INFERENCE_NAMES:
        assert getattr(trio_rollouts, name) is getattr(trio_rollouts.inference, name)


def test_testing_names_are_exported() -> None:
    assert sorted(trio_rollouts.testing.__all__) == sorted(TESTING_NAMES)
    missing = [name for name in TESTING_NAMES if not hasattr(trio_rollouts.testing, name)]
    assert missing == []
