"""The data model (DESIGN.md, "Public names"): every model, and every bad input it refuses
with an error that names the field and the value."""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest

from trio_rollouts import (
    ChatMessage,
    ContrastiveRollout,
    EvaluationRequest,
    EvaluationResponse,
    EvaluationResult,
    GenerationArgs,
    GroupedRolloutRequest,
    Head2HeadRolloutRequest,
    LLMChatMessage,
    Request,
    RewardEvaluationResult,
    Rollout,
    RolloutGroup,
    RolloutRequest,
    TokenRollout,
)
from trio_rollouts.testing import NullInference


@pytest.fixture
def interface() -> NullInference:
    return NullInference()


def token_rollout(**kwargs: object) -> TokenRollout:
    fields: dict[str, object] = {"trajectory": [[1, 2, 3]], "reward": 1.0}
    fields.update(kwargs)
    return TokenRollout(**fields)  # type: ignore[arg-type]


def group(*rewards: float | None, **kwargs: object) -> RolloutGroup:
    rollouts: list[Rollout | TokenRollout] = [
        Rollout(trajectory=["t"], reward=r, env_id="math", problem_id=f"p{i}")
        for i, r in enumerate(rewards)
    ]
    return RolloutGroup(rollouts=rollouts, **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- ChatMessage


def test_chat_message_keeps_role_and_content() -> None:
    message = ChatMessage(role="user", content="hi")
    assert (message.role, message.content, message.extra) == ("user", "hi", {})


def test_chat_message_refuses_a_non_str_content() -> None:
    with pytest.raises(TypeError, match=r"content must be a str, got 3"):
        ChatMessage(role="user", content=3)  # type: ignore[arg-type]


def test_chat_message_fields_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        ChatMessage("user", "hi")  # type: ignore[call-arg, arg-type]


def test_llm_chat_message_is_chat_message() -> None:
    assert LLMChatMessage is ChatMessage


def test_extra_is_not_in_the_repr() -> None:
    message = ChatMessage(role="user", content="hi", extra={"secret": 1})
    assert "secret" not in repr(message)


# --------------------------------------------------------------------------- GenerationArgs


def test_generation_args_default_to_not_set() -> None:
    assert GenerationArgs().set_fields() == {}


def test_generation_args_are_frozen() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        GenerationArgs().temperature = 1.0  # type: ignore[misc]


def test_zero_temperature_is_a_set_value() -> None:
    assert GenerationArgs(temperature=0.0).set_fields() == {"temperature": 0.0}


def test_negative_temperature_is_refused() -> None:
    with pytest.raises(ValueError, match=r"temperature must be a finite float >= 0.*-0\.5"):
        GenerationArgs(temperature=-0.5)


def test_infinite_temperature_is_refused() -> None:
    with pytest.raises(ValueError, match=r"temperature must be a finite float.*inf"):
        GenerationArgs(temperature=math.inf)


def test_str_temperature_is_refused() -> None:
    with pytest.raises(TypeError, match=r"temperature must be a float >= 0 or None, got '1.0'"):
        GenerationArgs(temperature="1.0")  # type: ignore[arg-type]


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.5])
def test_top_p_outside_zero_one_is_refused(top_p: float) -> None:
    with pytest.raises(ValueError, match=rf"top_p must be in \(0, 1\], got {top_p}"):
        GenerationArgs(top_p=top_p)


def test_top_p_of_one_is_accepted() -> None:
    assert GenerationArgs(top_p=1.0).top_p == 1.0


def test_top_k_zero_is_refused() -> None:
    with pytest.raises(ValueError, match=r"top_k must be >= 1, or -1 for no limit, got 0"):
        GenerationArgs(top_k=0)


def test_top_k_minus_one_means_no_limit() -> None:
    assert GenerationArgs(top_k=-1).top_k == -1


def test_bool_top_k_is_refused() -> None:
    with pytest.raises(TypeError, match=r"top_k must be an int .* got True"):
        GenerationArgs(top_k=True)


def test_max_tokens_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_tokens must be >= 1, got 0"):
        GenerationArgs(max_tokens=0)


def test_float_max_tokens_is_refused() -> None:
    with pytest.raises(TypeError, match=r"max_tokens must be an int >= 1 or None, got 1\.5"):
        GenerationArgs(max_tokens=1.5)  # type: ignore[arg-type]


def test_add_applies_the_set_fields_of_the_other() -> None:
    base = GenerationArgs(temperature=1.0, top_k=5, max_tokens=100)
    combined = base.add(GenerationArgs(top_k=10, top_p=0.9))
    assert combined == GenerationArgs(temperature=1.0, top_k=10, top_p=0.9, max_tokens=100)


def test_add_keeps_a_zero_temperature() -> None:
    assert GenerationArgs(temperature=1.0).add(GenerationArgs(temperature=0.0)).temperature == 0.0


def test_add_does_not_replace_a_zero_temperature_with_an_unset_one() -> None:
    assert GenerationArgs(temperature=0.0).add(GenerationArgs()).temperature == 0.0


def test_add_returns_a_copy() -> None:
    base = GenerationArgs(temperature=1.0)
    base.add(GenerationArgs(temperature=0.5))
    assert base.temperature == 1.0


def test_add_refuses_a_non_generation_args() -> None:
    with pytest.raises(TypeError, match=r"add\(\) takes a GenerationArgs, got \{'top_k': 3\}"):
        GenerationArgs().add({"top_k": 3})  # type: ignore[arg-type]


# --------------------------------------------------------------------------- requests


def test_request_defaults_to_unset_generation_args() -> None:
    assert Request().generation_args == GenerationArgs()


def test_request_refuses_generation_args_of_another_type() -> None:
    with pytest.raises(TypeError, match=r"generation_args must be a GenerationArgs, got \{\}"):
        Request(generation_args={})  # type: ignore[arg-type]


def test_rollout_request_needs_at_least_one_rollout(interface: NullInference) -> None:
    with pytest.raises(ValueError, match=r"num_rollouts must be >= 1, got 0"):
        RolloutRequest(num_rollouts=0, inference_interface=interface)


def test_rollout_request_refuses_a_non_interface() -> None:
    with pytest.raises(
        TypeError, match=r"inference_interface must be an InferenceInterface, got str"
    ):
        RolloutRequest(num_rollouts=1, inference_interface="http://x")  # type: ignore[arg-type]


def test_grouped_request_defaults(interface: NullInference) -> None:
    request = GroupedRolloutRequest(
        num_groups=2, rollouts_per_group=4, inference_interface=interface
    )
    assert (
        request.validation,
        request.filter_groups_with_same_reward,
        request.streaming,
        request.enforce_order,
    ) == (False, False, False, False)


def test_grouped_request_refuses_zero_groups(interface: NullInference) -> None:
    with pytest.raises(ValueError, match=r"num_groups must be >= 1, got 0"):
        GroupedRolloutRequest(num_groups=0, rollouts_per_group=4, inference_interface=interface)


def test_grouped_request_refuses_zero_rollouts_per_group(interface: NullInference) -> None:
    with pytest.raises(ValueError, match=r"rollouts_per_group must be >= 1, got 0"):
        GroupedRolloutRequest(num_groups=1, rollouts_per_group=0, inference_interface=interface)


def test_grouped_request_refuses_a_bool_count(interface: NullInference) -> None:
    with pytest.raises(TypeError, match=r"num_groups must be an int >= 1, got True"):
        GroupedRolloutRequest(num_groups=True, rollouts_per_group=4, inference_interface=interface)


def test_grouped_request_refuses_a_non_bool_flag(interface: NullInference) -> None:
    with pytest.raises(TypeError, match=r"streaming must be a bool, got 1"):
        GroupedRolloutRequest(
            num_groups=1,
            rollouts_per_group=4,
            inference_interface=interface,
            streaming=1,  # type: ignore[arg-type]
        )


def test_head2head_request_takes_a_list_of_interfaces(interface: NullInference) -> None:
    request = Head2HeadRolloutRequest(
        num_rollouts=1, inference_interface=[interface, NullInference()]
    )
    assert len(request.inference_interface) == 2


def test_head2head_request_refuses_an_empty_list() -> None:
    with pytest.raises(TypeError, match=r"inference_interface must be a non-empty list.*got \[\]"):
        Head2HeadRolloutRequest(num_rollouts=1, inference_interface=[])


def test_head2head_request_names_the_bad_interface(interface: NullInference) -> None:
    with pytest.raises(TypeError, match=r"inference_interface\[1\] must be an InferenceInterface"):
        Head2HeadRolloutRequest(num_rollouts=1, inference_interface=[interface, "x"])  # type: ignore[list-item]


def test_evaluation_request_validates_by_default(interface: NullInference) -> None:
    request = EvaluationRequest(inference_interface=interface, num_prompts=0)
    assert (request.validation, request.rank_info) == (True, None)


def test_evaluation_request_refuses_negative_num_prompts(interface: NullInference) -> None:
    with pytest.raises(ValueError, match=r"num_prompts must be >= 0, got -1"):
        EvaluationRequest(inference_interface=interface, num_prompts=-1)


@pytest.mark.parametrize("rank", [-1, 2])
def test_evaluation_request_refuses_a_rank_outside_the_world(
    interface: NullInference, rank: int
) -> None:
    with pytest.raises(ValueError, match=rf"rank_info rank must be in \[0, 2\), got {rank}"):
        EvaluationRequest(inference_interface=interface, num_prompts=4, rank_info=(rank, 2))


def test_evaluation_request_refuses_an_empty_world(interface: NullInference) -> None:
    with pytest.raises(ValueError, match=r"world_size must be >= 1, got 0"):
        EvaluationRequest(inference_interface=interface, num_prompts=4, rank_info=(0, 0))


def test_evaluation_request_takes_rank_info_as_a_list(interface: NullInference) -> None:
    request = EvaluationRequest(inference_interface=interface, num_prompts=4, rank_info=[1, 2])
    assert request.rank_info == (1, 2)


def test_evaluation_request_refuses_a_malformed_rank_info(interface: NullInference) -> None:
    with pytest.raises(TypeError, match=r"rank_info must be a \(rank, world_size\) tuple.*'01'"):
        EvaluationRequest(inference_interface=interface, num_prompts=4, rank_info="01")


# --------------------------------------------------------------------------- Rollout


def test_rollout_defaults() -> None:
    rollout = Rollout(trajectory=["a"])
    assert (rollout.reward, rollout.env_id, rollout.problem_id, rollout.policy_epoch) == (
        None,
        "",
        None,
        [],
    )


def test_rollout_refuses_a_str_trajectory() -> None:
    with pytest.raises(TypeError, match=r"trajectory must be a list, got str 'abc'"):
        Rollout(trajectory="abc")  # type: ignore[arg-type]


def test_rollout_refuses_a_str_reward() -> None:
    with pytest.raises(TypeError, match=r"reward must be a float or None, got '1.0'"):
        Rollout(trajectory=["a"], reward="1.0")  # type: ignore[arg-type]


def test_rollout_refuses_a_non_str_problem_id() -> None:
    with pytest.raises(TypeError, match=r"problem_id must be a str or None, got 7"):
        Rollout(trajectory=["a"], problem_id=7)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["prompt_length", "num_evictions"])
def test_rollout_refuses_a_per_element_list_of_the_wrong_length(field: str) -> None:
    with pytest.raises(ValueError, match=rf"{field} has 1 entries but trajectory has 2 elements"):
        Rollout(trajectory=["a", "b"], **{field: [0]})  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["policy_epoch", "kv_cache_epoch"])
def test_rollout_refuses_epochs_of_the_wrong_length(field: str) -> None:
    with pytest.raises(ValueError, match=rf"{field} has 1 entries but trajectory has 2 elements"):
        Rollout(trajectory=["a", "b"], **{field: [[(0, 1)]]})  # type: ignore[arg-type]


def test_rollout_accepts_empty_per_element_lists() -> None:
    rollout = Rollout(trajectory=["a", "b"], policy_epoch=[], num_evictions=[])
    assert rollout.policy_epoch == []


def test_rollout_keeps_one_epoch_list_per_element() -> None:
    rollout = Rollout(trajectory=["a", "b"], policy_epoch=[[(0, 1)], [(0, 1), (5, 2)]])
    assert rollout.policy_epoch[1] == [(0, 1), (5, 2)]


# --------------------------------------------------------------------------- TokenRollout


def test_token_rollout_needs_a_reward() -> None:
    with pytest.raises(TypeError, match=r"reward"):
        TokenRollout(trajectory=[[1]])  # type: ignore[call-arg]


def test_token_rollout_refuses_a_str_reward() -> None:
    with pytest.raises(TypeError, match=r"reward must be a float or a list of floats, got 'x'"):
        token_rollout(reward="x")


def test_token_rollout_list_reward_sums_to_its_scalar_reward() -> None:
    assert token_rollout(reward=[0.5, 0.25]).scalar_reward == 0.75


def test_generation_mask_needs_one_entry_per_element() -> None:
    with pytest.raises(ValueError, match=r"generation_mask has 2 entries but trajectory has 1"):
        token_rollout(generation_mask=[[True, True, True], [True]])


def test_generation_mask_names_the_element_of_the_wrong_length() -> None:
    with pytest.raises(
        ValueError, match=r"generation_mask\[1\] has 2 entries but trajectory\[1\] has 3 tokens"
    ):
        token_rollout(trajectory=[[1], [1, 2, 3]], generation_mask=[[True], [True, False]])


def test_logprobs_need_one_entry_per_element() -> None:
    with pytest.raises(ValueError, match=r"logprobs has 0 entries but trajectory has 1 elements"):
        token_rollout(logprobs=[])


def test_logprobs_count_the_true_entries_of_the_mask() -> None:
    with pytest.raises(
        ValueError,
        match=r"logprobs\[0\] has 3 entries but there are 2 generated tokens "
        r"\(True entries of generation_mask\[0\]\)",
    ):
        token_rollout(generation_mask=[[False, True, True]], logprobs=[[-0.1, -0.2, -0.3]])


def test_logprobs_match_the_true_entries_of_the_mask() -> None:
    rollout = token_rollout(generation_mask=[[False, True, True]], logprobs=[[-0.1, -0.2]])
    assert rollout.logprobs == [[-0.1, -0.2]]


def test_logprobs_without_a_mask_count_every_token() -> None:
    with pytest.raises(
        ValueError, match=r"logprobs\[0\] has 1 entries but there are 3 tokens in trajectory\[0\]"
    ):
        token_rollout(logprobs=[[-0.1]])


@pytest.mark.parametrize("field", ["policy_epoch", "kv_cache_epoch", "num_evictions"])
def test_token_rollout_refuses_per_element_lists_of_the_wrong_length(field: str) -> None:
    with pytest.raises(ValueError, match=rf"{field} has 2 entries but trajectory has 1 elements"):
        token_rollout(**{field: [[], []]})


def test_token_rollout_refuses_a_non_str_env_id() -> None:
    with pytest.raises(TypeError, match=r"env_id must be a str, got None"):
        token_rollout(env_id=None)


# --------------------------------------------------------------------------- RolloutGroup


def test_group_iterates_over_its_rollouts() -> None:
    g = group(0.0, 1.0)
    assert list(g) == g.rollouts


def test_group_has_the_length_of_its_rollouts() -> None:
    assert len(group(0.0, 1.0, 2.0)) == 3


def test_group_is_indexable() -> None:
    g = group(0.0, 1.0)
    assert g[1] is g.rollouts[1]


def test_group_is_sliceable() -> None:
    g = group(0.0, 1.0, 2.0)
    assert g[1:] == g.rollouts[1:]


def test_group_places_default_to_zero() -> None:
    g = group(1.0)
    assert (g.batch_id, g.index_in_batch) == (0, 0)


def test_empty_group_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rollouts must not be empty"):
        RolloutGroup(rollouts=[])


def test_group_names_a_rollout_of_the_wrong_type() -> None:
    with pytest.raises(
        TypeError, match=r"rollouts\[1\] must be a Rollout or TokenRollout, got dict"
    ):
        RolloutGroup(rollouts=[Rollout(trajectory=[]), {"trajectory": []}])  # type: ignore[list-item]


def test_group_refuses_a_negative_batch_id() -> None:
    with pytest.raises(ValueError, match=r"batch_id must be >= 0, got -1"):
        group(1.0, batch_id=-1)


def test_group_rewards_are_a_float_array() -> None:
    rewards = group(0.0, 1.0).rewards()
    assert rewards.dtype == np.float64
    assert rewards.tolist() == [0.0, 1.0]


def test_group_rewards_sum_a_token_rollout_list_reward() -> None:
    g = RolloutGroup(
        rollouts=[token_rollout(reward=[0.5, 0.5]), Rollout(trajectory=[], reward=0.0)]
    )
    assert g.rewards().tolist() == [1.0, 0.0]


def test_group_reward_mean_and_population_std() -> None:
    g = group(0.0, 2.0)
    assert (g.reward_mean(), g.reward_std()) == (1.0, 1.0)


def test_group_advantages_are_normalized_rewards() -> None:
    advantages = group(0.0, 2.0).advantages(eps=0.0)
    assert advantages.tolist() == [-1.0, 1.0]


def test_group_advantages_refuse_a_negative_eps() -> None:
    with pytest.raises(ValueError, match=r"eps must be >= 0, got -1"):
        group(0.0, 1.0).advantages(eps=-1)


def test_none_reward_is_an_error_naming_env_and_problem() -> None:
    with pytest.raises(
        ValueError, match=r"rollout 1 .* has reward None \(env_id='math', problem_id='p1'\)"
    ):
        group(0.0, None).rewards()


def test_nan_reward_is_an_error_naming_env_and_problem() -> None:
    with pytest.raises(
        ValueError, match=r"rollout 0 .* has reward nan \(env_id='math', problem_id='p0'\)"
    ):
        group(math.nan, 1.0).advantages()


def test_infinite_reward_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"has reward inf"):
        group(math.inf).reward_mean()


def test_reward_error_names_the_group_place() -> None:
    with pytest.raises(ValueError, match=r"batch_id=3, index_in_batch=2"):
        group(None, batch_id=3, index_in_batch=2).reward_std()


# --------------------------------------------------------------------------- other records


def test_contrastive_rollout_keeps_both_trajectories() -> None:
    pair = ContrastiveRollout(chosen_trajectory=["good"], rejected_trajectory=["bad"])
    assert (pair.chosen_trajectory, pair.rejected_trajectory) == (["good"], ["bad"])


def test_contrastive_rollout_refuses_a_str_trajectory() -> None:
    with pytest.raises(TypeError, match=r"chosen_trajectory must be a list, got str 'good'"):
        ContrastiveRollout(chosen_trajectory="good", rejected_trajectory=[])  # type: ignore[arg-type]


def test_evaluation_result_takes_a_chat_prompt() -> None:
    prompt = [ChatMessage(role="user", content="2+2?")]
    result = EvaluationResult(prompt=prompt, response=ChatMessage(role="assistant", content="4"))
    assert result.prompt == prompt


def test_reward_evaluation_result_refuses_a_str_reward() -> None:
    with pytest.raises(TypeError, match=r"reward must be a float or None, got 'high'"):
        RewardEvaluationResult(prompt="p", response="r", reward="high")  # type: ignore[arg-type]


@attrs.define(kw_only=True)
class ModelsTestResponse(EvaluationResponse[RewardEvaluationResult]):
    def metrics(self) -> dict[str, float]:
        return {"mean_reward": float(np.mean([r.reward for r in self.results]))}


def test_evaluation_response_metrics_are_not_implemented_by_default() -> None:
    response: EvaluationResponse[EvaluationResult] = EvaluationResponse(env_id="e", results=[])
    with pytest.raises(
        NotImplementedError, match=r"EvaluationResponse did not provide metric aggregation"
    ):
        response.metrics()


def test_evaluation_response_subclass_provides_metrics() -> None:
    results = [RewardEvaluationResult(prompt="p", response="r", reward=r) for r in (0.0, 1.0)]
    assert ModelsTestResponse(env_id="e", results=results).metrics() == {"mean_reward": 0.5}


def test_evaluation_response_subclass_is_registered_by_name() -> None:
    assert EvaluationResponse.type_registry["ModelsTestResponse"] is ModelsTestResponse


def test_evaluation_response_refuses_non_list_results() -> None:
    with pytest.raises(TypeError, match=r"results must be a list, got tuple"):
        EvaluationResponse(env_id="e", results=())  # type: ignore[arg-type]
