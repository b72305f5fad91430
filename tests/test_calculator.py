"""``envs.CalculatorEnvironment``: the calculator (safe arithmetic, no ``eval``), the
environment's steps (one tool message per call, bad calls as observations, the done and
reward rules, the tool schema), episodes run by ``MultiTurnAgent`` on the embedded
backend, and ``ToolUsePolicy`` (its candidates, its exact rates, its GRPO step)."""

from __future__ import annotations

import ast
import builtins
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

import trio_rollouts as tr
from trio_rollouts import ChatMessage, PlainRenderer, Problem
from trio_rollouts.envs import (
    CALCULATOR_TOOL,
    CalculatorEnvironment,
    CalculatorError,
    ToolUsePolicy,
    calculate,
    make_problems,
)
from trio_rollouts.inference import EmbeddedInference

R = PlainRenderer()
PROBLEM = Problem(problem_id="p", prompt="What is 17 + 25?", answer=42)


def call(arguments: object, name: str = "calculator") -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def turn(text: str) -> tr.AssistantTurn:
    return R.parse(R.encode(text))


# --------------------------------------------------------------------------- calculate


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("17 + 25", 42),
        ("2 * (3 + 4)", 14),
        ("-3 - -2", -1),
        ("+5", 5),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 // 2", -4),
        ("7 % 3", 1),
        ("2 ** 10", 1024),
        ("2 ** -1", 0.5),
        ("(-2) ** 3", -8),
        ("1.5 * 2", 3.0),
        ("  5 ", 5),
        ("((((1))))", 1),
    ],
)
def test_calculate_evaluates_arithmetic(expression: str, value: float) -> None:
    result = calculate(expression)
    assert result == value
    assert type(result) is type(value)


@given(
    st.recursive(
        st.integers(-50, 50).map(str),
        lambda inner: st.tuples(inner, st.sampled_from(["+", "-", "*"]), inner).map(
            lambda t: f"({t[0]} {t[1]} {t[2]})"
        ),
        max_leaves=8,
    )
)
def test_calculate_agrees_with_python_on_integer_arithmetic(expression: str) -> None:
    # Python is the oracle here (on expressions the test built itself).
    assert calculate(expression) == eval(expression)


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("x + 1", "Name is not allowed"),
        ("__import__('os').system('echo hacked')", "Call is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("'a' * 3", "'a' is not a number"),
        ("True + 1", "True is not a number"),
        ("1j * 2", "1j is not a number"),
        ("1 < 2", "Compare is not allowed"),
        ("1 << 2", "BinOp is not allowed"),
        ("~1", "UnaryOp is not allowed"),
        ("not 1", "UnaryOp is not allowed"),
        ("[1, 2]", "List is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("1 +", "invalid syntax"),
        ("1; 2", "invalid syntax"),
        ("", "empty"),
        ("   ", "empty"),
    ],
)
def test_calculate_refuses_anything_but_arithmetic(expression: str, why: str) -> None:
    with pytest.raises(CalculatorError, match=why):
        calculate(expression)


@pytest.mark.parametrize(
    "expression", ["1 / 0", "1 // 0", "1 % 0", "1 / (2 - 2)", "0 ** -1", "1.5 / 0.0"]
)
def test_division_by_zero_is_an_error(expression: str) -> None:
    with pytest.raises(CalculatorError, match="by zero"):
        calculate(expression)


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("2 ** 1000", "exponent 1000 is larger than 100"),
        ("9 ** 9 ** 9", "exponent 387420489 is larger than 100"),
        ("10 ** 100", "too large"),
        ("(10 ** 60) * (10 ** 60)", "too large"),
        ("1e300", "too large"),
        ("1e400 - 1", "not a finite number"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 + " * 100 + "1", "at most 200 are read"),
    ],
)
def test_huge_results_and_exponents_are_refused(expression: str, why: str) -> None:
    with pytest.raises(CalculatorError, match=why):
        calculate(expression)


def test_an_error_is_a_value_error_and_a_non_string_a_type_error() -> None:
    assert issubclass(CalculatorError, ValueError)
    with pytest.raises(TypeError, match="must be a str"):
        calculate(42)  # type: ignore[arg-type]


def test_calculate_never_evals(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("calculate called eval or exec")

    monkeypatch.setattr(builtins, "eval", refused)
    monkeypatch.setattr(builtins, "exec", refused)
    assert calculate("6 * 7") == 42
    source = Path(__import__("trio_rollouts.envs.calculator").envs.calculator.__file__).read_text()
    called = {
        node.func.id
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    assert not called & {"eval", "exec", "compile", "__import__"}


# --------------------------------------------------------------------------- the environment


def test_the_tool_is_one_openai_function_with_a_string_expression() -> None:
    env = CalculatorEnvironment(PROBLEM)
    assert env.tools == [CALCULATOR_TOOL]
    (tool,) = env.tools
    assert tool["type"] == "function"
    function = tool["function"]
    assert function["name"] == "calculator"
    assert isinstance(function["description"], str)
    assert function["description"]
    assert function["parameters"]["type"] == "object"
    assert function["parameters"]["properties"]["expression"]["type"] == "string"
    assert function["parameters"]["required"] == ["expression"]
    assert json.loads(json.dumps(env.tools)) == env.tools
    # Each environment has its own copy.
    function["name"] = "changed"
    assert CalculatorEnvironment(PROBLEM).tools == [CALCULATOR_TOOL]
    assert CALCULATOR_TOOL["function"]["name"] == "calculator"


def test_it_is_an_environment_made_from_a_problem() -> None:
    assert isinstance(CalculatorEnvironment(PROBLEM), tr.Environment)
    with pytest.raises(TypeError, match="needs a Problem"):
        CalculatorEnvironment("What is 1 + 1?")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="numeric answer"):
        CalculatorEnvironment(Problem(problem_id="q", prompt="Name it", answer="Paris"))


async def test_reset_asks_the_problem() -> None:
    assert await CalculatorEnvironment(PROBLEM).reset() == [
        ChatMessage(role="user", content="What is 17 + 25?")
    ]


async def test_each_tool_call_gets_one_tool_message_in_order() -> None:
    env = CalculatorEnvironment(PROBLEM)
    step = await env.step(
        turn("Let me compute. " + call({"expression": "17 + 25"}) + call({"expression": "7/2"}))
    )
    assert not step.done
    assert step.reward is None
    assert [(m.role, m.content) for m in step.messages] == [("tool", "42"), ("tool", "3.5")]
    assert [m.extra["tool_call_id"] for m in step.messages] == ["call_0", "call_1"]


@pytest.mark.parametrize(
    ("text", "observation"),
    [
        ("<tool_call>{calculator: 17+25}</tool_call>", "error: the tool call is not a JSON"),
        ('<tool_call>{"name": "calculator", "arguments"', "error: the tool call is not a JSON"),
        (call({"expression": "1"}, name="python"), "error: there is no tool 'python'"),
        (call({}), 'error: calculator needs the argument "expression"'),
        (call({"expression": 17}), 'error: "expression" must be a string, got 17'),
        (call({"expression": "1", "x": 2}), "error: unexpected arguments ['x']"),
        (call({"expression": "x + 1"}), "error: Name is not allowed"),
        (call({"expression": "5 / (3 - 3)"}), "error: division by zero (5 / 0)"),
        (call({"expression": "2 ** 1000"}), "error: the exponent 1000 is larger than 100"),
    ],
)
async def test_a_bad_call_is_an_observation(text: str, observation: str) -> None:
    env = CalculatorEnvironment(PROBLEM)
    step = await env.step(turn(text))
    assert not step.done
    (message,) = step.messages
    assert message.role == "tool"
    assert message.content.startswith(observation), message.content


async def test_a_bad_call_is_not_repaired_and_good_calls_beside_it_are_answered() -> None:
    env = CalculatorEnvironment(PROBLEM)
    step = await env.step(turn(call({"expression": "17 +"}) + call({"expression": "17 + 25"})))
    assert [m.content for m in step.messages] == [
        "error: invalid syntax in '17 +' (invalid syntax)",
        "42",
    ]


@pytest.mark.parametrize(
    ("text", "reward"),
    [
        ("The answer is 42.", 1.0),
        ("17 + 25 = 42", 1.0),
        ("42.0", 1.0),
        ("The answer is 41.", 0.0),
        ("It is 42, no, 43.", 0.0),
        ("I don't know.", 0.0),
        ("", 0.0),
        ("<think>It is 42</think>Maybe 40.", 0.0),
    ],
)
async def test_a_turn_without_tool_calls_ends_the_episode(text: str, reward: float) -> None:
    step = await CalculatorEnvironment(PROBLEM).step(turn(text))
    assert step.done
    assert step.reward == reward
    assert step.messages == ()


async def test_an_episode_ended_by_a_limit_earns_nothing() -> None:
    assert await CalculatorEnvironment(PROBLEM).final_reward() == 0.0


# --------------------------------------------------------------------------- episodes


def scripted(*completions: str) -> tr.inference.Policy:
    """A policy that writes ``completions[i]`` at turn ``i + 1`` (turns are counted by
    the assistant messages so far); the tool's result is ``{result}``."""

    def policy(prompt: list[ChatMessage]) -> tuple[Sequence[str], npt.ArrayLike]:
        turn_index = sum(m.role == "assistant" for m in prompt)
        text = completions[min(turn_index, len(completions) - 1)]
        return [text.replace("{result}", prompt[-1].content)], [1.0]

    return policy


def agent(max_turns: int = 4) -> tr.MultiTurnAgent:
    return tr.MultiTurnAgent(
        environment=CalculatorEnvironment,
        renderer=R,
        prompts=tr.PromptSource([PROBLEM]),
        max_turns=max_turns,
    )


async def episodes(policy: tr.inference.Policy, max_turns: int = 4) -> list[tr.TokenRollout]:
    request = tr.GroupedRolloutRequest(
        num_groups=1,
        rollouts_per_group=2,
        inference_interface=EmbeddedInference(policy=policy, seed=0),
    )
    return await agent(max_turns).group_rollout(request)


def sampled_texts(rollout: tr.TokenRollout) -> list[str]:
    """The text of each run of sampled ids (mask 1)."""
    (ids,), (mask,) = rollout.trajectory, rollout.generation_mask or [[]]
    runs: list[str] = []
    previous = False
    for token, generated in zip(ids, mask, strict=True):
        if generated and not previous:
            runs.append("")
        if generated:
            runs[-1] += chr(token)
        previous = generated
    return runs


async def test_an_episode_calls_the_calculator_and_answers_with_its_result(
    autojump_clock: trio.testing.MockClock,
) -> None:
    first = call({"expression": "17 + 25"})
    rollouts = await episodes(scripted(first, "The answer is {result}."))
    assert len(rollouts) == 2
    for rollout in rollouts:
        tools = json.dumps([CALCULATOR_TOOL])
        expected = (
            f"<|tools|>\n{tools}\n<|user|>\nWhat is 17 + 25?\n<|assistant|>\n{first}\n"
            "<|tool|>\n42\n<|assistant|>\nThe answer is 42."
        )
        (ids,) = rollout.trajectory
        assert R.decode(ids) == expected
        assert sampled_texts(rollout) == [first, "The answer is 42."]
        (mask,) = rollout.generation_mask or [[]]
        assert sum(mask) == len(first) + len("The answer is 42.")
        assert rollout.reward == 1.0
        assert rollout.problem_id == "p"
        record = dict(rollout.extra["episode"])
        per_turn = record.pop("per_turn")
        assert record == {
            "turns": 2,
            "finish": "done",
            "breaks": 0,
            "tool_calls": 1,
            "parse_errors": 0,
            "truncated_turns": 0,
        }
        # The calls are kept with their turn: id, name, arguments, error.
        assert [t["tool_calls"] for t in per_turn] == [
            [
                {
                    "id": "call_1_0",
                    "name": "calculator",
                    "arguments": {"expression": "17 + 25"},
                    "error": None,
                }
            ],
            [],
        ]


async def test_a_bad_call_is_seen_by_the_model_and_the_episode_goes_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bad = call({"expression": "17 + 25"}, name="calc")
    (rollout, _) = await episodes(scripted(bad, "The answer is 40."))
    text = R.decode(rollout.trajectory[0])
    assert "<|tool|>\nerror: there is no tool 'calc'; the only tool is \"calculator\"\n" in text
    assert rollout.reward == 0.0
    assert rollout.extra["episode"]["turns"] == 2
    assert rollout.extra["episode"]["finish"] == "done"


async def test_an_episode_that_keeps_calling_ends_at_max_turns_with_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    (rollout, _) = await episodes(scripted(call({"expression": "17 + 25"})), max_turns=3)
    assert rollout.extra["episode"]["finish"] == "max_turns"
    assert rollout.extra["episode"]["tool_calls"] == 3
    assert rollout.reward == 0.0
    # The third call was answered too, but nothing is appended after the last turn.
    assert R.decode(rollout.trajectory[0]).count("<|tool|>\n42\n") == 2


# --------------------------------------------------------------------------- ToolUsePolicy

PROBLEMS = make_problems(8, seed=0)


def test_the_policy_starts_near_chance() -> None:
    for seed in range(5):
        policy = ToolUsePolicy.initial(PROBLEMS, num_candidates=4, seed=seed)
        assert abs(policy.tool_call_rate() - 0.25) < 0.08
        assert abs(policy.accuracy() - 1 / 16) < 0.04
    exact = ToolUsePolicy.initial(PROBLEMS, num_candidates=5, seed=0, init_scale=0.0)
    assert exact.tool_call_rate() == pytest.approx(1 / 5)
    assert exact.accuracy() == pytest.approx(1 / 25)


def test_turn_one_offers_the_call_or_wrong_answers() -> None:
    policy = ToolUsePolicy.initial(PROBLEMS, num_candidates=4, seed=0)
    problem = PROBLEMS[3]
    expression = str(problem.prompt).removeprefix("What is ").removesuffix("?")
    candidates, probs = policy([ChatMessage(role="user", content=str(problem.prompt))])
    assert len(candidates) == 4 == len(set(candidates))
    # PlainRenderer's form of a call (json.dumps' defaults), so that the turn bridges.
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    assert candidates[0] == f"<tool_call>{call}</tool_call>"
    parsed = turn(candidates[0]).tool_calls[0]
    assert (parsed.name, parsed.arguments) == ("calculator", {"expression": expression})
    for text in candidates[1:]:
        assert text.startswith("The answer is ")
        assert tr.envs.last_number_reward(problem, text) == 0.0
    assert np.asarray(probs).sum() == pytest.approx(1.0)
    assert np.asarray(probs)[0] == pytest.approx(policy.tool_call_rate())


def test_turn_two_offers_the_result_or_wrong_numbers() -> None:
    policy = ToolUsePolicy.initial(PROBLEMS, num_candidates=3, seed=0)
    problem = PROBLEMS[0]
    conversation = [
        ChatMessage(role="user", content=str(problem.prompt)),
        ChatMessage(role="assistant", content="<tool_call>...</tool_call>"),
        ChatMessage(role="tool", content=str(problem.answer)),
    ]
    candidates, probs = policy(conversation)
    assert candidates[0] == f"The answer is {problem.answer}."
    assert len(set(candidates)) == 3
    assert all(tr.envs.last_number_reward(problem, text) == 0.0 for text in candidates[1:])
    assert policy.accuracy() == pytest.approx(policy.tool_call_rate() * np.asarray(probs)[0])


def test_the_policy_refuses_what_it_was_not_made_for() -> None:
    policy = ToolUsePolicy.initial(PROBLEMS, seed=0)
    with pytest.raises(ValueError, match="knows only the problems"):
        policy([ChatMessage(role="user", content="What is 1000 + 1000?")])
    with pytest.raises(ValueError, match="not after a 'assistant' message"):
        policy(
            [
                ChatMessage(role="user", content=str(PROBLEMS[0].prompt)),
                ChatMessage(role="assistant", content="hm"),
            ]
        )
    with pytest.raises(ValueError, match="What is <expression>"):
        ToolUsePolicy.initial([Problem(problem_id="x", prompt="Add 1 and 2", answer=3)])
    with pytest.raises(ValueError, match="num_candidates must be >= 2"):
        ToolUsePolicy.initial(PROBLEMS, num_candidates=1)


async def batch(policy: ToolUsePolicy, groups: int = 8, size: int = 8) -> list[tr.RolloutGroup]:
    multi = tr.MultiTurnAgent(
        environment=CalculatorEnvironment,
        renderer=R,
        prompts=tr.PromptSource(PROBLEMS, seed=0),
        max_turns=4,
        parallel_generation_tasks=groups,
    )
    request = tr.GroupedRolloutRequest(
        num_groups=groups,
        rollouts_per_group=size,
        inference_interface=EmbeddedInference(policy=policy, seed=0),
    )
    async with multi.get_grouped_rollouts(request) as stream:
        return [group async for group in stream]


async def test_grpo_step_raises_the_tool_call_rate_and_the_accuracy(
    autojump_clock: trio.testing.MockClock,
) -> None:
    policy = ToolUsePolicy.initial(PROBLEMS, num_candidates=4, seed=0)
    groups = await batch(policy)
    assert any(group.rewards().std() > 0 for group in groups)
    rate, accuracy = policy.tool_call_rate(), policy.accuracy()
    for _ in range(3):  # a fixed batch, trained on thrice (the ratio clips the rest)
        policy.grpo_step(groups, learning_rate=2.0, clip=0.2)
    assert policy.tool_call_rate() > rate + 0.05
    assert policy.accuracy() > accuracy + 0.05


async def test_grpo_step_learns_nothing_from_groups_without_signal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    policy = ToolUsePolicy.initial(PROBLEMS, num_candidates=4, seed=0)
    groups = [g for g in await batch(policy) if g.rewards().std() == 0]
    assert groups
    before = (policy.call_logits.copy(), policy.answer_logits.copy())
    policy.grpo_step(groups, learning_rate=2.0, clip=0.2)
    assert np.array_equal(policy.call_logits, before[0])
    assert np.array_equal(policy.answer_logits, before[1])


async def test_the_exact_accuracy_is_what_episodes_earn(
    autojump_clock: trio.testing.MockClock,
) -> None:
    policy = ToolUsePolicy.initial(PROBLEMS, num_candidates=2, seed=0, init_scale=0.0)
    policy.call_logits = np.array([1.0, 0.0])
    policy.answer_logits = np.array([0.5, 0.0])
    groups = await batch(policy, groups=8, size=32)
    rollouts = [r for g in groups for r in g]
    reward = float(np.mean([r.reward for r in rollouts]))
    calls = float(np.mean([r.extra["episode"]["tool_calls"] > 0 for r in rollouts]))
    # 256 episodes: four standard errors at most.
    assert abs(calls - policy.tool_call_rate()) < 4 * math.sqrt(0.25 / 256)
    assert abs(reward - policy.accuracy()) < 4 * math.sqrt(0.25 / 256)
    assert policy.tool_call_rate() == pytest.approx(math.e / (math.e + 1))


async def test_grpo_step_needs_token_rollouts_of_its_own_problems(
    autojump_clock: trio.testing.MockClock,
) -> None:
    policy = ToolUsePolicy.initial(PROBLEMS, num_candidates=4, seed=0)
    groups = [g for g in await batch(policy) if g.rewards().std() > 0]
    other = ToolUsePolicy.initial(make_problems(8, seed=1), num_candidates=4, seed=0)
    with pytest.raises(ValueError, match="none of ToolUsePolicy's candidates"):
        other.grpo_step(groups, learning_rate=1.0, clip=0.2)
    stranger = ToolUsePolicy.initial(PROBLEMS[:1], num_candidates=4, seed=0)
    with pytest.raises(ValueError, match="not made for problem"):
        stranger.grpo_step(groups, learning_rate=1.0, clip=0.2)
    text_only = tr.RolloutGroup(
        rollouts=[
            tr.Rollout(trajectory=["x"], reward=float(i), problem_id="arithmetic-0")
            for i in range(2)
        ]
    )
    with pytest.raises(TypeError, match="needs token rollouts"):
        policy.grpo_step([text_only], learning_rate=1.0, clip=0.2)
