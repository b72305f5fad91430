"""Conversion (DESIGN.md, "Conversion"): strict structuring with every problem reported at
its path, lossless unknown keys, the Rollout/TokenRollout union, the EvaluationResponse
registry, and JSON-lines streaming."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from trio_rollouts import (
    ChatMessage,
    ContrastiveRollout,
    EvaluationResponse,
    EvaluationResult,
    GenerationArgs,
    RewardEvaluationResult,
    Rollout,
    RolloutGroup,
    TokenRollout,
)
from trio_rollouts.models._convert import (
    ValidationError,
    dump_jsonl,
    load_jsonl,
    structure,
    unstructure,
)

SETTINGS = settings(max_examples=100, deadline=None)


def token_data(**overrides: Any) -> dict[str, Any]:
    """A complete, valid unstructured TokenRollout."""
    data: dict[str, Any] = {
        "trajectory": [[5, 6, 7]],
        "reward": 1.0,
        "generation_mask": [[False, True, True]],
        "logprobs": [[-0.5, -0.25]],
        "env_id": "math",
        "problem_id": "p1",
        "policy_epoch": [[[0, 3], [2, 4]]],
        "kv_cache_epoch": [[[0, 3]]],
        "num_evictions": [0],
    }
    data.update(overrides)
    return data


def text_data(**overrides: Any) -> dict[str, Any]:
    """A complete, valid unstructured Rollout."""
    data: dict[str, Any] = {
        "trajectory": ["2+2=", "4"],
        "prompt_length": None,
        "reward": 0.5,
        "env_id": "math",
        "problem_id": None,
        "policy_epoch": [],
        "kv_cache_epoch": [],
        "num_evictions": [],
    }
    data.update(overrides)
    return data


def errors_of(data: object, cls: Any) -> list[tuple[str, str]]:
    with pytest.raises(ValidationError) as info:
        structure(data, cls)
    return info.value.errors


# --------------------------------------------------------------------------- strictness


@pytest.mark.parametrize(
    ("data", "cls", "message"),
    [
        ("1.0", float, "expected float, got str '1.0'"),
        (True, int, "expected int, got bool True"),
        (1.5, int, "expected int, got float 1.5"),
        ("3", int, "expected int, got str '3'"),
        ("ab", list[str], "expected list, got str 'ab'"),
        (True, float, "expected float, got bool True"),
        (1, bool, "expected bool, got int 1"),
        (None, str, "expected str, got None"),
    ],
)
def test_no_silent_coercion(data: object, cls: Any, message: str) -> None:
    assert errors_of(data, cls) == [(message, "$")]


def test_an_int_is_accepted_as_a_float_and_becomes_one() -> None:
    value = structure(1, float)
    assert (value, type(value)) == (1.0, float)


def test_int_logprobs_become_floats() -> None:
    rollout = structure(token_data(logprobs=[[0, -1]]), TokenRollout)
    assert rollout.logprobs is not None
    assert [type(v) for v in rollout.logprobs[0]] == [float, float]


def test_an_int_reward_becomes_a_float() -> None:
    rollout = structure(text_data(reward=1), Rollout)
    assert type(rollout.reward) is float


def test_an_int_too_large_for_a_float_is_refused() -> None:
    ((message, path),) = errors_of(token_data(logprobs=[[-0.5, 10**400]]), TokenRollout)
    assert (message.startswith("expected float, got int 1000"), path) == (True, "$.logprobs[0][1]")


def test_a_bool_token_id_is_refused_at_its_path() -> None:
    errors = errors_of(token_data(trajectory=[[5, True, 7]]), TokenRollout)
    assert errors == [("expected int, got bool True", "$.trajectory[0][1]")]


def test_a_float_token_id_is_refused() -> None:
    errors = errors_of(token_data(trajectory=[[5, 6.0, 7]]), TokenRollout)
    assert errors == [("expected int, got float 6.0", "$.trajectory[0][1]")]


def test_large_token_ids_are_accepted() -> None:
    rollout = structure(token_data(trajectory=[[2**31, 2**40, -(2**33)]]), TokenRollout)
    assert rollout.trajectory == [[2**31, 2**40, -(2**33)]]


def test_an_int_in_the_generation_mask_is_refused() -> None:
    errors = errors_of(token_data(generation_mask=[[0, True, True]]), TokenRollout)
    assert errors == [("expected bool, got int 0", "$.generation_mask[0][0]")]


def test_a_bool_logprob_is_refused() -> None:
    errors = errors_of(token_data(logprobs=[[-0.5, False]]), TokenRollout)
    assert errors == [("expected float, got bool False", "$.logprobs[0][1]")]


def test_a_str_is_not_a_trajectory() -> None:
    errors = errors_of(text_data(trajectory="2+2=4"), Rollout)
    assert errors == [("expected list, got str '2+2=4'", "$.trajectory")]


def test_a_missing_required_field_is_reported_at_its_path() -> None:
    data = token_data()
    del data["reward"]
    assert errors_of(data, TokenRollout) == [("required field missing", "$.reward")]


def test_a_non_dict_record_is_refused() -> None:
    assert errors_of(["user", "hi"], ChatMessage) == [
        ("expected a ChatMessage object (dict), got list ['user', 'hi']", "$")
    ]


def test_converted_lists_are_new() -> None:
    data = token_data(logprobs=[[0, -1]])
    rollout = structure(data, TokenRollout)
    assert rollout.logprobs is not None
    assert rollout.logprobs[0] is not data["logprobs"][0]


def test_unstructured_lists_are_copies_of_the_object() -> None:
    rollout = structure(token_data(), TokenRollout)
    data = unstructure(rollout)
    data["trajectory"][0].append(8)
    data["policy_epoch"][0].clear()
    assert (rollout.trajectory, rollout.policy_epoch) == ([[5, 6, 7]], [[(0, 3), (2, 4)]])


# --------------------------------------------------------------------------- error reports


def test_validation_error_lists_every_problem_with_its_path() -> None:
    data = {
        "rollouts": [
            text_data(),
            token_data(reward="high"),
            token_data(trajectory=[[5, 6, "7"]], env_id=3),
        ],
        "batch_id": -1.5,
    }
    assert sorted(errors_of(data, RolloutGroup)) == sorted(
        [
            ("expected list[float] | float, got str 'high'", "$.rollouts[1].reward"),
            ("expected int, got str '7'", "$.rollouts[2].trajectory[0][2]"),
            ("expected str, got int 3", "$.rollouts[2].env_id"),
            ("expected int, got float -1.5", "$.batch_id"),
        ]
    )


def test_validation_error_message_shows_each_problem_as_message_at_path() -> None:
    with pytest.raises(ValidationError) as info:
        structure({"rollouts": [token_data(trajectory=[[1, "3"]])], "batch_id": "0"}, RolloutGroup)
    message = str(info.value)
    assert message.splitlines()[0] == "2 validation errors for RolloutGroup"
    assert "  expected int, got str '3' @ $.rollouts[0].trajectory[0][1]" in message
    assert "  expected int, got str '0' @ $.batch_id" in message


def test_validation_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"expected int"):
        structure("x", int)


def test_a_constructor_check_is_reported_at_the_object_path() -> None:
    bad = token_data(generation_mask=[[True, True, True]])  # 3 generated tokens, 2 logprobs
    errors = errors_of({"rollouts": [text_data(), bad]}, RolloutGroup)
    assert errors == [
        (
            "logprobs[0] has 2 entries but there are 3 generated tokens "
            "(True entries of generation_mask[0])",
            "$.rollouts[1]",
        )
    ]


def test_a_top_level_constructor_check_is_reported_at_the_root() -> None:
    assert errors_of({"temperature": -1.0}, GenerationArgs) == [
        ("temperature must be a finite float >= 0 (0.0 is greedy), got -1.0", "$")
    ]


def test_validation_error_survives_pickling() -> None:
    with pytest.raises(ValidationError) as info:
        structure({"rollouts": []}, RolloutGroup)
    copy = pickle.loads(pickle.dumps(info.value))
    assert (copy.errors, str(copy)) == (info.value.errors, str(info.value))


def test_a_long_bad_value_is_shortened_in_the_message() -> None:
    ((message, _),) = errors_of(list(range(1000)), str)
    assert len(message) < 100


# --------------------------------------------------------------------------- unknown keys


def test_unknown_keys_go_to_extra() -> None:
    rollout = structure(text_data(sampler="v2", seed=7), Rollout)
    assert rollout.extra == {"sampler": "v2", "seed": 7}


def test_unknown_keys_come_back_at_top_level() -> None:
    data = text_data(sampler="v2", nested={"a": [1, 2]})
    assert unstructure(structure(data, Rollout)) == data


def test_a_literal_extra_key_is_an_unknown_key() -> None:
    data = token_data(extra={"kept": True})
    rollout = structure(data, TokenRollout)
    assert rollout.extra == {"extra": {"kept": True}}
    assert unstructure(rollout) == data


def test_unstructure_writes_no_extra_key_of_its_own() -> None:
    assert "extra" not in unstructure(Rollout(trajectory=["a"], extra={"k": 1}))


def test_unknown_keys_of_nested_records_survive_a_round_trip() -> None:
    data = {
        "rollouts": [text_data(a=1), token_data(b=[2])],
        "batch_id": 3,
        "index_in_batch": 1,
        "start_epoch": 2,
        "cuts": [[7, 0.5, 1]],
        "c": None,
    }
    assert unstructure(structure(data, RolloutGroup)) == data


def test_extra_that_shadows_a_field_is_refused_on_unstructure() -> None:
    rollout = Rollout(trajectory=["a"], extra={"reward": 5.0})
    with pytest.raises(ValueError, match=r"extra has keys \['reward'\]"):
        unstructure(rollout)


def test_unknown_keys_of_generation_args_are_refused() -> None:
    assert errors_of({"temperature": 0.0, "temprature": 1.0}, GenerationArgs) == [
        ("unknown field of GenerationArgs", "$.temprature")
    ]


def test_generation_args_round_trip_keeps_zero_temperature() -> None:
    args = GenerationArgs(temperature=0.0, top_k=-1)
    assert structure(unstructure(args), GenerationArgs) == args


# --------------------------------------------------------------------------- Rollout | TokenRollout


def test_text_trajectory_structures_to_rollout() -> None:
    assert type(structure(text_data(), Rollout | TokenRollout)) is Rollout


def test_token_trajectory_structures_to_token_rollout() -> None:
    assert type(structure(token_data(), Rollout | TokenRollout)) is TokenRollout


def test_union_order_does_not_matter() -> None:
    assert type(structure(token_data(), TokenRollout | Rollout)) is TokenRollout


def test_a_group_mixing_both_kinds_round_trips() -> None:
    group = RolloutGroup(
        rollouts=[
            Rollout(trajectory=["q", "a"], reward=1.0),
            TokenRollout(trajectory=[[1, 2]], reward=[0.5], logprobs=[[-0.1, -0.2]]),
        ]
    )
    back = structure(unstructure(group), RolloutGroup)
    assert back == group
    assert [type(r) for r in back] == [Rollout, TokenRollout]


def test_empty_trajectory_with_prompt_length_is_a_rollout() -> None:
    assert type(structure(text_data(trajectory=[]), Rollout | TokenRollout)) is Rollout


def test_empty_trajectory_with_logprobs_is_a_token_rollout() -> None:
    data = token_data(trajectory=[], generation_mask=None, logprobs=None)
    data.update(policy_epoch=[], kv_cache_epoch=[], num_evictions=[])
    assert type(structure(data, Rollout | TokenRollout)) is TokenRollout


def test_empty_trajectory_without_markers_is_ambiguous() -> None:
    ((message, path),) = errors_of({"rollouts": [{"trajectory": [], "reward": 1.0}]}, RolloutGroup)
    assert message.startswith("cannot tell Rollout from TokenRollout: trajectory is empty")
    assert path == "$.rollouts[0]"


def test_a_trajectory_of_numbers_is_neither_kind() -> None:
    errors = errors_of({"rollouts": [text_data(), {"trajectory": [1, 2]}]}, RolloutGroup)
    assert errors == [
        (
            "expected str (a Rollout) or a list of token ids (a TokenRollout), got int 1",
            "$.rollouts[1].trajectory[0]",
        )
    ]


def test_a_non_dict_rollout_is_refused_at_its_path() -> None:
    errors = errors_of({"rollouts": [text_data(), "rollout"]}, RolloutGroup)
    assert errors == [
        ("expected a Rollout or TokenRollout object (dict), got str 'rollout'", "$.rollouts[1]")
    ]


# --------------------------------------------------------------------------- epochs


def test_epoch_pairs_structure_to_tuples() -> None:
    rollout = structure(token_data(), TokenRollout)
    assert rollout.policy_epoch == [[(0, 3), (2, 4)]]
    assert type(rollout.policy_epoch[0][0]) is tuple


def test_epoch_pairs_unstructure_to_lists() -> None:
    rollout = Rollout(trajectory=["a"], kv_cache_epoch=[[(0, 1), (9, 2)]])
    assert unstructure(rollout)["kv_cache_epoch"] == [[[0, 1], [9, 2]]]


def test_epoch_pairs_may_be_given_as_tuples() -> None:
    rollout = structure(text_data(trajectory=["a"], policy_epoch=[[(0, 1)]]), Rollout)
    assert rollout.policy_epoch == [[(0, 1)]]


def test_an_epoch_triple_is_refused() -> None:
    errors = errors_of(token_data(policy_epoch=[[[0, 3, 1]]]), TokenRollout)
    assert errors == [
        ("expected a 2-element list (tuple[int, int]), got list [0, 3, 1]", "$.policy_epoch[0][0]")
    ]


def test_a_str_epoch_is_refused_at_its_path() -> None:
    errors = errors_of(token_data(kv_cache_epoch=[[[0, "3"]]]), TokenRollout)
    assert errors == [("expected int, got str '3'", "$.kv_cache_epoch[0][0][1]")]


# --------------------------------------------------------------------------- other records


def test_chat_message_round_trips_with_extra_keys() -> None:
    data = {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}
    assert unstructure(structure(data, ChatMessage)) == data


def test_evaluation_result_takes_a_str_prompt_and_response() -> None:
    result = structure({"prompt": "2+2?", "response": "4"}, EvaluationResult)
    assert (result.prompt, result.response) == ("2+2?", "4")


def test_evaluation_result_takes_a_chat_prompt_and_message_response() -> None:
    data = {
        "prompt": [{"role": "user", "content": "2+2?"}],
        "response": {"role": "assistant", "content": "4"},
    }
    result = structure(data, EvaluationResult)
    assert result.prompt == [ChatMessage(role="user", content="2+2?")]
    assert result.response == ChatMessage(role="assistant", content="4")
    assert unstructure(result) == data


def test_evaluation_result_refuses_a_number_prompt() -> None:
    assert errors_of({"prompt": 4, "response": "4"}, EvaluationResult) == [
        ("expected str | list[ChatMessage], got int 4", "$.prompt")
    ]


def test_reward_evaluation_result_round_trips() -> None:
    result = RewardEvaluationResult(prompt="p", response="r", reward=0.5, problem_id="7")
    assert structure(unstructure(result), RewardEvaluationResult) == result


def test_contrastive_rollout_round_trips() -> None:
    pair = ContrastiveRollout(chosen_trajectory=["a"], rejected_trajectory=["b"], extra={"m": 1})
    assert structure(unstructure(pair), ContrastiveRollout) == pair


def test_a_list_reports_the_index_of_the_bad_item() -> None:
    errors = errors_of([text_data(), text_data(reward=None, env_id=None)], list[Rollout])
    assert errors == [("expected str, got None", "$[1].env_id")]


def test_a_list_of_models_converts() -> None:
    rollouts = [Rollout(trajectory=["a"]), Rollout(trajectory=["b"], reward=1.0)]
    assert structure(unstructure(rollouts), list[Rollout]) == rollouts


# --------------------------------------------------------------------------- EvaluationResponse


@attrs.define(kw_only=True)
class ConvertTestResponse(EvaluationResponse[RewardEvaluationResult]):
    accuracy: float = 0.0

    def metrics(self) -> dict[str, float]:
        return {"accuracy": self.accuracy}


@attrs.define(kw_only=True)
class ConvertTestOtherResponse(EvaluationResponse[EvaluationResult]):
    pass


class ConvertTestChildResponse(ConvertTestResponse):
    """Inherits its results type from its parent."""


def response() -> ConvertTestResponse:
    results = [RewardEvaluationResult(prompt="p", response="r", reward=1.0)]
    return ConvertTestResponse(env_id="math", results=results, accuracy=0.5)


def test_unstructure_writes_the_type_name() -> None:
    assert unstructure(response())["type_name"] == "ConvertTestResponse"


def test_structuring_as_the_base_returns_the_named_subclass() -> None:
    back = structure(unstructure(response()), EvaluationResponse)
    assert type(back) is ConvertTestResponse
    assert back == response()


def test_subclass_results_get_the_declared_type() -> None:
    back = structure(unstructure(response()), EvaluationResponse)
    assert type(back.results[0]) is RewardEvaluationResult


def test_a_subclass_inherits_the_results_type_of_its_parent() -> None:
    child = ConvertTestChildResponse(
        env_id="e", results=[RewardEvaluationResult(prompt="p", response="r", reward=0.0)]
    )
    back = structure(unstructure(child), EvaluationResponse)
    assert type(back) is ConvertTestChildResponse
    assert type(back.results[0]) is RewardEvaluationResult


def test_structuring_as_a_middle_class_returns_the_named_subclass() -> None:
    child = ConvertTestChildResponse(env_id="e", results=[])
    assert type(structure(unstructure(child), ConvertTestResponse)) is ConvertTestChildResponse


def test_an_unknown_type_name_is_refused_and_the_known_ones_listed() -> None:
    data = {**unstructure(response()), "type_name": "Nope"}
    ((message, path),) = errors_of(data, EvaluationResponse)
    assert path == "$.type_name"
    assert "unknown EvaluationResponse type_name 'Nope'" in message
    assert "ConvertTestResponse" in message
    assert "ConvertTestOtherResponse" in message


def test_a_mismatching_type_name_is_refused() -> None:
    data = {"env_id": "e", "results": [], "type_name": "ConvertTestOtherResponse"}
    ((message, path),) = errors_of(data, ConvertTestResponse)
    assert path == "$.type_name"
    assert "'ConvertTestOtherResponse' names a class that is not a ConvertTestResponse" in message


def test_a_non_str_type_name_is_refused() -> None:
    data = {"env_id": "e", "results": [], "type_name": 3}
    assert errors_of(data, EvaluationResponse) == [("expected str, got int 3", "$.type_name")]


def test_without_a_type_name_the_requested_class_is_built() -> None:
    back = structure(
        {"env_id": "e", "results": [{"prompt": "p", "response": "r"}]}, EvaluationResponse
    )
    assert type(back) is EvaluationResponse
    assert type(back.results[0]) is EvaluationResult


@attrs.define(kw_only=True)
class ConvertTestUntypedResponse(EvaluationResponse):  # type: ignore[type-arg]
    pass


def test_a_subclass_without_a_results_type_gets_evaluation_results() -> None:
    data = {"env_id": "e", "results": [{"prompt": "p", "response": "r", "reward": 1.0}]}
    back = structure({**data, "type_name": "ConvertTestUntypedResponse"}, EvaluationResponse)
    assert type(back.results[0]) is EvaluationResult
    assert back.results[0].extra == {"reward": 1.0}


def test_a_parametrized_base_gives_its_results_type() -> None:
    data = {
        "env_id": "e",
        "results": [{"prompt": "p", "response": "r", "reward": 1.0}],
        "type_name": "EvaluationResponse",
    }
    back = structure(data, EvaluationResponse[RewardEvaluationResult])
    assert type(back.results[0]) is RewardEvaluationResult


def test_a_subclass_defined_after_first_use_is_found() -> None:
    structure({"env_id": "e", "results": []}, EvaluationResponse)

    class ConvertTestLateResponse(EvaluationResponse[RewardEvaluationResult]):
        pass

    late = ConvertTestLateResponse(
        env_id="e", results=[RewardEvaluationResult(prompt="p", response="r", reward=2.0)]
    )
    back = structure(unstructure(late), EvaluationResponse)
    assert type(back) is ConvertTestLateResponse
    assert back.results == late.results


def test_results_problems_are_reported_at_their_path() -> None:
    data = {**unstructure(response()), "results": [{"prompt": "p", "response": "r"}]}
    assert errors_of(data, EvaluationResponse) == [
        ("required field missing", "$.results[0].reward")
    ]


# --------------------------------------------------------------------------- JSON lines


def rollouts(n: int) -> list[Rollout]:
    return [Rollout(trajectory=[f"q{i}", "a"], reward=float(i), extra={"i": i}) for i in range(n)]


def test_jsonl_round_trips_through_a_path(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    dump_jsonl(rollouts(3), path)
    assert list(load_jsonl(path, Rollout)) == rollouts(3)


def test_jsonl_round_trips_through_a_str_path(tmp_path: Path) -> None:
    path = str(tmp_path / "rollouts.jsonl")
    dump_jsonl(rollouts(2), path)
    assert list(load_jsonl(path, Rollout)) == rollouts(2)


def test_jsonl_round_trips_through_open_files() -> None:
    file = io.StringIO()
    dump_jsonl(rollouts(2), file)
    file.seek(0)
    assert list(load_jsonl(file, Rollout)) == rollouts(2)


def test_dump_jsonl_returns_the_number_of_lines() -> None:
    assert dump_jsonl(rollouts(4), io.StringIO()) == 4


def test_dump_jsonl_writes_one_compact_line_per_object() -> None:
    file = io.StringIO()
    dump_jsonl(rollouts(2), file)
    lines = file.getvalue().split("\n")
    assert lines[2] == ""
    assert lines[0] == json.dumps(unstructure(rollouts(1)[0]), separators=(",", ":"))


def test_dump_jsonl_flushes_each_line(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    with path.open("w", encoding="utf-8") as file:
        dump_jsonl(rollouts(1), file)
        assert path.read_text(encoding="utf-8").count("\n") == 1


def test_load_jsonl_is_lazy() -> None:
    lines = io.StringIO(json.dumps(unstructure(rollouts(1)[0])) + "\nnot json\n")
    loaded = load_jsonl(lines, Rollout)
    assert next(loaded) == rollouts(1)[0]


def test_a_bad_row_names_its_line() -> None:
    rows = [unstructure(r) for r in rollouts(3)]
    rows[1]["reward"] = "high"
    file = io.StringIO("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValidationError, match=r"^line 2: 1 validation error for Rollout") as info:
        list(load_jsonl(file, Rollout))
    assert info.value.line == 2
    assert info.value.errors == [("expected float, got str 'high'", "$.reward")]


def test_invalid_json_names_its_line() -> None:
    file = io.StringIO('{"trajectory": []}\n{"trajectory": [}\n')
    with pytest.raises(ValueError, match=r"^line 2, column 17: invalid JSON: Expecting value"):
        list(load_jsonl(file, Rollout))


def test_invalid_json_names_the_file_and_the_column_within_the_line(tmp_path: Path) -> None:
    # json reports an error at a line's end as "line 2 column 1" of its document (the
    # newline's far side); the column within the line is the one a user can find.
    path = tmp_path / "rollouts.jsonl"
    path.write_text('{"trajectory": ["a"]}\n{"trajectory":\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"rollouts\.jsonl, line 2, column 16: invalid JSON") as e:
        list(load_jsonl(path, Rollout))
    assert str(e.value).endswith('  {"trajectory":\n                 ^')


def test_a_byte_order_mark_is_read_as_utf8(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(text_data()).encode() + b"\n")
    assert list(load_jsonl(path, Rollout)) == [structure(text_data(), Rollout)]


def test_a_validation_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    path.write_text('{"trajectory": [1]}\n', encoding="utf-8")
    with pytest.raises(ValidationError, match=r"rollouts\.jsonl, line 1: 1 validation error") as e:
        list(load_jsonl(path, Rollout))
    assert e.value.line == 1
    assert e.value.source == str(path)


def test_swapped_arguments_are_a_clear_type_error(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    with pytest.raises(TypeError, match=r"takes the objects first and the file second"):
        dump_jsonl(path, rollouts(1))  # type: ignore[arg-type]
    assert not path.exists()
    with pytest.raises(TypeError, match=r"the arguments look swapped: the file comes first"):
        load_jsonl(Rollout, path)  # type: ignore[call-overload]


def test_a_missing_cls_is_a_type_error_that_says_what_it_is(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    dump_jsonl(rollouts(1), path)
    for file in (path, io.StringIO(path.read_text(encoding="utf-8"))):
        with pytest.raises(TypeError) as e:
            load_jsonl(file)  # type: ignore[call-overload]
        message = str(e.value)
        assert "needs cls, the class each line is read as" in message
        assert "load_jsonl(f, tr.RolloutGroup)" in message
        assert "load_jsonl(f, tr.Rollout | tr.TokenRollout)" in message
    # The examples it names work.
    assert list(load_jsonl(path, Rollout | TokenRollout)) == rollouts(1)
    # A class alone is still the swapped-arguments error, not the missing-cls one.
    with pytest.raises(TypeError, match=r"needs a path or an open text file first"):
        load_jsonl(Rollout)  # type: ignore[call-overload]


def test_an_empty_file_is_zero_records(tmp_path: Path) -> None:
    # What dump_jsonl writes for no objects reads back as no objects.
    path = tmp_path / "rollouts.jsonl"
    assert dump_jsonl([], path) == 0
    assert list(load_jsonl(path, Rollout)) == []


def test_a_truncated_last_line_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    dump_jsonl(rollouts(3), path)
    path.write_text(path.read_text(encoding="utf-8")[:-10], encoding="utf-8")
    with pytest.raises(
        ValueError,
        match=r"rollouts\.jsonl, line 3 is truncated: the file does not end with a newline",
    ):
        list(load_jsonl(path, Rollout))


def test_a_complete_last_line_without_newline_is_read() -> None:
    file = io.StringIO(json.dumps(text_data()))
    assert list(load_jsonl(file, Rollout)) == [structure(text_data(), Rollout)]


def test_blank_lines_are_skipped_and_still_counted() -> None:
    file = io.StringIO(f"\n{json.dumps(text_data())}\n   \n{json.dumps(text_data(reward='x'))}\n")
    with pytest.raises(ValidationError, match=r"^line 4:"):
        list(load_jsonl(file, Rollout))


def test_load_jsonl_closes_a_file_it_opened(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    dump_jsonl(rollouts(2), path)
    loaded = load_jsonl(path, Rollout)
    next(loaded)
    loaded.close()  # type: ignore[attr-defined]
    assert list(load_jsonl(path, Rollout)) == rollouts(2)


def test_jsonl_streams_groups_of_both_kinds(tmp_path: Path) -> None:
    groups = [
        RolloutGroup(rollouts=[Rollout(trajectory=["a"], reward=1.0)], batch_id=0),
        RolloutGroup(
            rollouts=[TokenRollout(trajectory=[[1, 2]], reward=0.0, policy_epoch=[[(0, 1)]])],
            batch_id=1,
        ),
    ]
    path = tmp_path / "groups.jsonl"
    dump_jsonl(groups, path)
    assert list(load_jsonl(path, RolloutGroup)) == groups


# --------------------------------------------------------------------------- properties

RESERVED_KEYS = {f.name for cls in (Rollout, TokenRollout, RolloutGroup) for f in attrs.fields(cls)}
RESERVED_KEYS -= {"extra"}  # a literal "extra" key is an ordinary unknown key

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)
extras = st.dictionaries(
    st.text(max_size=8).filter(lambda key: key not in RESERVED_KEYS), json_values, max_size=3
)
floats = st.floats(allow_nan=False)
token_ids = st.integers(min_value=0, max_value=2**31 - 1) | st.integers(-(2**63), 2**63)
epochs = st.lists(st.tuples(st.integers(), st.integers()), max_size=3)


@st.composite
def per_element(draw: st.DrawFn, n: int, element: st.SearchStrategy[Any]) -> list[Any]:
    """Empty, or one entry per trajectory element (as the models require)."""
    if draw(st.booleans()):
        return []
    return [draw(element) for _ in range(n)]


@st.composite
def text_rollouts(draw: st.DrawFn) -> Rollout:
    trajectory = draw(st.lists(st.text(max_size=10), max_size=3))
    n = len(trajectory)
    return Rollout(
        trajectory=trajectory,
        prompt_length=draw(st.none() | st.lists(st.integers(), min_size=n, max_size=n)),
        reward=draw(st.none() | floats),
        env_id=draw(st.text(max_size=5)),
        problem_id=draw(st.none() | st.text(max_size=5)),
        policy_epoch=draw(per_element(n, epochs)),
        kv_cache_epoch=draw(per_element(n, epochs)),
        num_evictions=draw(per_element(n, st.integers(min_value=0))),
        extra=draw(extras),
    )


@st.composite
def token_rollouts(draw: st.DrawFn) -> TokenRollout:
    trajectory = draw(st.lists(st.lists(token_ids, max_size=8), max_size=3))
    n = len(trajectory)
    mask = None
    if draw(st.booleans()):
        mask = [draw(st.lists(st.booleans(), min_size=len(t), max_size=len(t))) for t in trajectory]
    logprobs = None
    if draw(st.booleans()):
        counts = [m.count(True) for m in mask] if mask is not None else [len(t) for t in trajectory]
        logprobs = [draw(st.lists(floats, min_size=c, max_size=c)) for c in counts]
    return TokenRollout(
        trajectory=trajectory,
        reward=draw(floats | st.lists(floats, max_size=3)),
        generation_mask=mask,
        logprobs=logprobs,
        env_id=draw(st.text(max_size=5)),
        problem_id=draw(st.none() | st.text(max_size=5)),
        policy_epoch=draw(per_element(n, epochs)),
        kv_cache_epoch=draw(per_element(n, epochs)),
        num_evictions=draw(per_element(n, st.integers(min_value=0))),
        extra=draw(extras),
    )


groups = st.builds(
    RolloutGroup,
    rollouts=st.lists(text_rollouts() | token_rollouts(), min_size=1, max_size=4),
    batch_id=st.integers(min_value=0),
    index_in_batch=st.integers(min_value=0),
    extra=extras,
)


@SETTINGS
@given(text_rollouts())
def test_rollout_round_trips(rollout: Rollout) -> None:
    assert structure(unstructure(rollout), Rollout) == rollout


@SETTINGS
@given(token_rollouts())
def test_token_rollout_round_trips(rollout: TokenRollout) -> None:
    assert structure(unstructure(rollout), TokenRollout) == rollout


@SETTINGS
@given(groups)
def test_group_round_trips_through_json(group: RolloutGroup) -> None:
    data = json.loads(json.dumps(unstructure(group)))
    assert structure(data, RolloutGroup) == group


@SETTINGS
@given(groups, extras)
def test_dict_with_unknown_keys_round_trips(group: RolloutGroup, more: dict[str, Any]) -> None:
    data = {**unstructure(group), **more}
    assert unstructure(structure(data, RolloutGroup)) == data


@SETTINGS
@given(token_rollouts(), st.data())
def test_a_str_token_id_is_reported_at_its_path(rollout: TokenRollout, data: st.DataObject) -> None:
    elements = [i for i, tokens in enumerate(rollout.trajectory) if tokens]
    assume(elements)
    i = data.draw(st.sampled_from(elements))
    j = data.draw(st.integers(min_value=0, max_value=len(rollout.trajectory[i]) - 1))
    unstructured = unstructure(rollout)
    token = unstructured["trajectory"][i][j]
    unstructured["trajectory"][i][j] = str(token)
    errors = errors_of(unstructured, TokenRollout)
    assert errors == [(f"expected int, got str '{token}'", f"$.trajectory[{i}][{j}]")]
