"""``trio_rollouts.integrations.verifiers``: classic verifiers environments (real
``vf.SingleTurnEnv``, ``vf.MultiTurnEnv``, ``vf.ToolEnv`` and ``vf.Rubric``) run unmodified
by ``VerifiersAgent`` behind the gateway, on the embedded backend with a scripted policy
and the plain renderer (which parses ``<tool_call>`` tool calls), offline: datasets are
built in memory.

Everything runs for real: a gateway on a loopback socket, verifiers' own rollout loop in an
asyncio loop on a worker thread with its ``OpenAIChatCompletionsClient`` over the openai
SDK, the pipeline around it; each test bounded by ``trio.fail_after``. Nothing waits a
fixed time: the cancellation test's tool cancels the group itself, from its thread, at
the point the test is about, and what ran is read from lists the tool appends to.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

import datasets
import pytest
import trio

# Imported plainly, never skipped: `nox -s integrations` installs verifiers for this file
# (the main test run does not collect tests/integrations/).
import verifiers as vf

from trio_rollouts import (
    ChatMessage,
    GenerationArgs,
    GroupedRolloutRequest,
    PlainRenderer,
    Problem,
    PromptSource,
    TokenRollout,
)
from trio_rollouts.inference import EmbeddedInference, InferenceRequest, LatencyModel
from trio_rollouts.integrations.verifiers import (
    VerifiersAgent,
    VerifiersRolloutError,
    verifiers_problems,
    verifiers_prompts,
)

datasets.disable_progress_bars()

R = PlainRenderer()
SECONDS = 60
Policy = Callable[[list[ChatMessage]], tuple[list[str], list[float]]]


def dataset(*rows: tuple[str, str]) -> datasets.Dataset:
    return datasets.Dataset.from_list([{"question": q, "answer": a} for q, a in rows])


def backend(policy: Policy) -> EmbeddedInference:
    return EmbeddedInference(policy=policy, seed=0, latency=LatencyModel(first_token=0.0))


def request(
    policy: Policy, group: int = 2, groups: int = 1, **changes: Any
) -> GroupedRolloutRequest:
    return GroupedRolloutRequest(
        num_groups=groups, rollouts_per_group=group, inference_interface=backend(policy), **changes
    )


async def run(agent: VerifiersAgent, req: GroupedRolloutRequest) -> list[list[TokenRollout]]:
    """Every group of one batch, through the pipeline."""
    with trio.fail_after(SECONDS):
        async with agent.get_grouped_rollouts(req) as stream:
            return [list(group) async for group in stream]


def call_text(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def tool_policy(name: str) -> Policy:
    """Call ``name`` with the two numbers of the question; after its result, answer it."""

    def policy(messages: list[ChatMessage]) -> tuple[list[str], list[float]]:
        if messages[-1].role == "tool":
            return [f"The answer is {messages[-1].content}."], [1.0]
        question = next(m.content for m in messages if m.role == "user")
        a, b = (int(word) for word in question.rstrip("?").split()[-1].split("+"))
        return [call_text(name, a=a, b=b)], [1.0]

    return policy


def sampled_text(rollout: TokenRollout) -> str:
    """The rollout's sampled ids (mask 1) as text (the plain renderer's ids are code points)."""
    (ids,), (mask,) = rollout.trajectory, rollout.generation_mask or [[]]
    return "".join(chr(i) for i, m in zip(ids, mask, strict=True) if m)


def chat_message(message: dict[str, Any]) -> ChatMessage:
    """A verifiers message (``extra["verifiers"]["completion"]`` or a row's prompt) in the
    OpenAI shape the gateway renders."""
    extra: dict[str, Any] = {}
    if message.get("tool_calls"):
        extra["tool_calls"] = [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]},
            }
            for call in message["tool_calls"]
        ]
    if "tool_call_id" in message:
        extra["tool_call_id"] = message["tool_call_id"]
    return ChatMessage(role=message["role"], content=message.get("content") or "", extra=extra)


def assert_token_exact(
    rollout: TokenRollout, problem_row: dict[str, Any], turns: Sequence[str]
) -> None:
    """One element, no break; the sampled ids are the policy's ``turns``, one logprob
    each; the assistant messages verifiers recorded are what the rollout's ids of each
    turn parse to; and the whole stream is the template's render of the conversation
    verifiers recorded (its prompt and completion), exactly."""
    record = rollout.extra["verifiers"]
    assert rollout.fidelity == "exact"
    assert len(rollout.trajectory) == 1
    assert rollout.extra["gateway"]["breaks"] == 0
    assert rollout.extra["gateway"]["calls"] == len(turns)
    assert sampled_text(rollout) == "".join(turns)
    assert rollout.logprobs is not None
    assert len(rollout.logprobs[0]) == len(sampled_text(rollout))
    (ids,) = rollout.trajectory
    recorded = [m for m in record["completion"] if m["role"] == "assistant"]
    per_turn = rollout.extra["gateway"]["per_turn"]
    assert len(recorded) == len(per_turn) == len(turns)
    for message, turn in zip(recorded, per_turn, strict=True):
        parsed = R.parse(ids[turn["start"] : turn["end"]])
        assert (message.get("content") or "") == parsed.content
        calls = [(c["name"], json.loads(c["arguments"])) for c in message.get("tool_calls", [])]
        assert calls == [(c.name, c.arguments) for c in parsed.tool_calls]
    conversation = [chat_message(m) for m in [*problem_row["prompt"], *record["completion"]]]
    text = "".join(map(chr, ids))
    if text.startswith("<|tools|>\n"):  # the tools block: the env's schemas, as sent
        text = text.split("\n", 2)[2]
    assert text == R.decode(R.render(conversation, add_generation_prompt=False)).removesuffix("\n")


#: The calls verifiers made to the ``add`` tool (from the groups' asyncio threads).
ADDED: list[tuple[int, int]] = []


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    ADDED.append((a, b))
    return a + b


def correct(completion: Any, answer: str) -> float:
    """1.0 when the last message states the answer."""
    return float(answer in str(completion[-1].content or ""))


# --------------------------------------------------------------------------- problems


def test_verifiers_problems_are_the_env_rows_in_its_format() -> None:
    env = vf.SingleTurnEnv(
        dataset=dataset(("What is 2+3?", "5"), ("What is 4+4?", "8")),
        eval_dataset=dataset(("What is 1+1?", "2")),
        system_prompt="Be brief.",
        rubric=vf.Rubric(funcs=[correct]),
    )
    first, second = verifiers_problems(env)
    assert (first.problem_id, second.problem_id) == ("0", "1")
    assert first.prompt == [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="What is 2+3?"),
    ]
    assert first.answer["answer"] == "5"
    assert first.answer["example_id"] == 0
    assert first.answer["prompt"][0] == {"role": "system", "content": "Be brief."}
    (evaluation,) = verifiers_problems(env, split="eval")
    assert evaluation.answer["answer"] == "2"
    assert [p.problem_id for p in verifiers_problems(env, n=1)] == ["0"]
    source = verifiers_prompts(env, shuffle=False)
    assert [source.draw().problem_id for _ in range(2)] == ["0", "1"]


def test_a_missing_split_is_a_value_error_naming_it_and_the_fix() -> None:
    env = vf.SingleTurnEnv(
        dataset=dataset(("What is 2+3?", "5")), rubric=vf.Rubric(funcs=[correct])
    )
    with pytest.raises(ValueError, match=r"no eval dataset.*split='train'"):
        verifiers_problems(env, split="eval")
    evaluation_only = vf.SingleTurnEnv(
        eval_dataset=dataset(("What is 2+3?", "5")), rubric=vf.Rubric(funcs=[correct])
    )
    with pytest.raises(
        ValueError, match=r"no train dataset.*verifiers_prompts\(env, split='eval'\)"
    ):
        VerifiersAgent(env=evaluation_only, renderer=R)
    agent = VerifiersAgent(
        env=evaluation_only, renderer=R, prompts=verifiers_prompts(evaluation_only, split="eval")
    )
    assert agent.prompts is not None


def test_construction_errors_name_the_field_and_value() -> None:
    env = vf.SingleTurnEnv(
        dataset=dataset(("What is 2+3?", "5")), rubric=vf.Rubric(funcs=[correct])
    )
    with pytest.raises(TypeError, match="env must be a classic verifiers environment"):
        VerifiersAgent(env=object(), renderer=R)
    with pytest.raises(ValueError, match=r"on_error must be .raise.*.maybe."):
        VerifiersAgent(env=env, renderer=R, on_error="maybe")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sampling_args must be a mapping"):
        VerifiersAgent(env=env, renderer=R, sampling_args=[("max_tokens", 5)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="asyncio_cancel_timeout"):
        VerifiersAgent(env=env, renderer=R, asyncio_cancel_timeout="5")  # type: ignore[arg-type]


def test_the_env_may_be_given_by_position_once() -> None:
    env = vf.SingleTurnEnv(
        dataset=dataset(("What is 2+3?", "5")), rubric=vf.Rubric(funcs=[correct])
    )
    assert VerifiersAgent(env, renderer=R).env is env
    assert VerifiersAgent(env=env, renderer=R).env is env
    with pytest.raises(TypeError, match="takes the env once"):
        VerifiersAgent(env, env=env, renderer=R)
    with pytest.raises(TypeError, match="takes the env once"):
        VerifiersAgent(env, R)


async def test_a_problem_whose_answer_is_not_a_row_is_a_type_error() -> None:
    env = vf.SingleTurnEnv(
        dataset=dataset(("What is 2+3?", "5")), rubric=vf.Rubric(funcs=[correct])
    )
    prompts = PromptSource([Problem(problem_id="q", prompt="What is 2+3?", answer="5")])
    agent = VerifiersAgent(env=env, renderer=R, prompts=prompts)
    with pytest.raises(TypeError, match=r"problem 'q': answer must be the verifiers dataset row"):
        await agent.group_rollout(request(tool_policy("add")))


# --------------------------------------------------------------------------- environments


async def test_a_tool_env_runs_end_to_end_through_the_pipeline() -> None:
    ADDED.clear()
    env = vf.ToolEnv(
        dataset=dataset(("What is 2+3?", "5"), ("What is 12+30?", "42")),
        tools=[add],
        rubric=vf.Rubric(funcs=[correct]),
        max_turns=4,
    )
    agent = VerifiersAgent(env=env, renderer=R, env_id="adder")
    groups = await run(agent, request(tool_policy("add"), group=2, groups=2))
    assert sorted(ADDED) == [(2, 3), (2, 3), (12, 30), (12, 30)]  # verifiers ran the tool
    rows = {p.problem_id: p.answer for p in verifiers_problems(env)}
    assert sorted(g[0].problem_id or "" for g in groups) == ["0", "1"]
    for group in groups:
        for rollout in group:
            row = rows[rollout.problem_id or ""]
            a, b = (int(x) for x in row["question"].rstrip("?").split()[-1].split("+"))
            assert_token_exact(
                rollout, row, [call_text("add", a=a, b=b), f"The answer is {a + b}."]
            )
            record = rollout.extra["verifiers"]
            assert rollout.reward == record["reward"] == 1.0
            assert rollout.env_id == "adder"
            assert record["metrics"] == {
                "correct": 1.0,
                "num_turns": 2.0,
                "total_tool_calls": 1.0,
                "add_calls": 1.0,
            }
            assert record["stop_condition"] == "no_tools_called"
            assert (record["error"], record["is_truncated"]) == (None, False)
            assert record["completion"][1] == {
                "role": "tool",
                "tool_call_id": "call_1_0",
                "content": str(a + b),
            }


async def test_group_reward_functions_score_every_member_at_once() -> None:
    """A relative ranking (shorter answers rank higher) needs all members: verifiers'
    rubric gets them together, and each reward is its weighted sum of the functions'."""
    candidates = ["8", "It is 8.", "The answer is eight.", "The sum of four and four is 8."]
    calls: list[list[str]] = []

    def brevity_rank(completions: list[Any]) -> list[float]:
        texts = [str(c[-1].content) for c in completions]
        calls.append(texts)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        ranks = [0.0] * len(texts)
        for rank, i in enumerate(order):
            ranks[i] = 1.0 - rank / (len(texts) - 1)
        return ranks

    def policy(messages: list[ChatMessage]) -> tuple[list[str], list[float]]:
        return candidates, [0.25] * 4

    rubric = vf.Rubric(funcs=[correct, brevity_rank], weights=[1.0, 0.5])
    env = vf.SingleTurnEnv(dataset=dataset(("What is 4+4?", "8")), rubric=rubric)
    agent = VerifiersAgent(env=env, renderer=R)
    (group,) = await run(agent, request(policy, group=4, seed=3))
    texts = [sampled_text(rollout) for rollout in group]
    assert len(set(texts)) > 1  # the seeded members sampled different answers
    assert calls == [texts]  # once, with every member, in member order
    row = verifiers_problems(env)[0].answer
    # What verifiers computes for these completions, scored by its rubric on its own.
    states = [vf.State(input={**row, "info": {}}) for _ in texts]
    for state, text in zip(states, texts, strict=True):
        state.update(completion=[vf.AssistantMessage(content=text)], trajectory=[])
    await trio.to_thread.run_sync(asyncio.run, rubric.score_group(states))
    ranks = brevity_rank([[vf.AssistantMessage(content=t)] for t in texts])
    for rollout, text, rank, state in zip(group, texts, ranks, states, strict=True):
        assert_token_exact(rollout, row, [text])
        exact = float("8" in text)
        assert rollout.reward == state["reward"] == pytest.approx(exact + 0.5 * rank)
        assert rollout.extra["verifiers"]["metrics"] == {**state["metrics"], "num_turns": 1.0}
        assert state["metrics"] == {"correct": exact, "brevity_rank": pytest.approx(rank)}


async def test_a_single_turn_env_with_a_system_prompt() -> None:
    env = vf.SingleTurnEnv(
        dataset=dataset(("What is 2+3?", "5")),
        system_prompt="Answer with a number.",
        rubric=vf.Rubric(funcs=[correct]),
    )
    agent = VerifiersAgent(env=env, renderer=R)
    group = await agent.group_rollout(request(lambda messages: (["5"], [1.0]), group=3))
    row = verifiers_problems(env)[0].answer
    for rollout in group:
        assert_token_exact(rollout, row, ["5"])
        assert "".join(map(chr, rollout.trajectory[0])).startswith("<|system|>\nAnswer with")
        assert rollout.reward == 1.0
        assert rollout.extra["verifiers"]["stop_condition"] == "max_turns_reached"
        assert rollout.extra["verifiers"]["example_id"] == 0


class Guess(vf.MultiTurnEnv):  # type: ignore[misc]
    """A guessing game: the env answers each guess with "higher", "lower" or "correct"."""

    async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
        guess, target = int(str(messages[-1].content)), int(state["answer"])
        word = "correct" if guess == target else "higher" if guess < target else "lower"
        return [{"role": "user", "content": word}]

    @vf.stop
    async def guessed(self, state: Any) -> bool:
        trajectory = state["trajectory"]
        return bool(trajectory) and str(trajectory[-1]["completion"][-1].content) == state["answer"]


async def test_a_multi_turn_env_is_one_token_stream_across_its_turns() -> None:
    def policy(messages: list[ChatMessage]) -> tuple[list[str], list[float]]:
        return (["7"] if messages[-1].content == "higher" else ["5"]), [1.0]

    env = Guess(dataset=dataset(("Guess my number.", "7")), rubric=vf.Rubric(funcs=[correct]))
    agent = VerifiersAgent(env=env, renderer=R)
    (group,) = await run(agent, request(policy, group=2))
    row = verifiers_problems(env)[0].answer
    for rollout in group:
        assert_token_exact(rollout, row, ["5", "7"])
        assert "<|user|>\nhigher\n<|assistant|>\n7" in "".join(map(chr, rollout.trajectory[0]))
        assert rollout.reward == 1.0
        assert rollout.extra["verifiers"]["stop_condition"] == "guessed"


async def test_sampling_args_fill_what_the_trainer_leaves_unset() -> None:
    seen: list[GenerationArgs] = []

    class Recording(EmbeddedInference):
        async def base_generate(self, request: InferenceRequest) -> Any:
            seen.append(request.generation_args)
            return await super().base_generate(request)

    env = vf.SingleTurnEnv(
        dataset=dataset(("What is 2+3?", "5")),
        rubric=vf.Rubric(funcs=[correct]),
        sampling_args={"max_tokens": 64, "temperature": 0.9},
    )
    agent = VerifiersAgent(env=env, renderer=R, sampling_args={"top_p": 0.5})
    interface = Recording(
        policy=lambda m: (["5"], [1.0]), seed=0, latency=LatencyModel(first_token=0.0)
    )
    req = GroupedRolloutRequest(
        num_groups=1,
        rollouts_per_group=1,
        inference_interface=interface,
        generation_args=GenerationArgs(temperature=0.3),
    )
    await agent.group_rollout(req)
    ((args),) = seen
    assert (args.temperature, args.max_tokens, args.top_p) == (0.3, 64, 0.5)


# --------------------------------------------------------------------------- errors


def failing(turn: int) -> Policy:
    """The tool policy, with the backend failing at assistant turn ``turn`` (from 0)."""
    tools = tool_policy("add")

    def policy(messages: list[ChatMessage]) -> tuple[list[str], list[float]]:
        if sum(m.role == "assistant" for m in messages) == turn:
            msg = "the model is down"
            raise ValueError(msg)
        return tools(messages)

    return policy


async def test_an_error_verifiers_records_fails_the_group_naming_the_member() -> None:
    env = vf.ToolEnv(
        dataset=dataset(("What is 2+3?", "5")), tools=[add], rubric=vf.Rubric(funcs=[correct])
    )
    agent = VerifiersAgent(env=env, renderer=R)
    with trio.fail_after(SECONDS), pytest.raises(VerifiersRolloutError) as caught:
        await agent.group_rollout(request(failing(turn=0), group=2))
    error = caught.value
    assert error.problem_id == "0"
    assert error.stop_condition == "has_error"
    assert "member 0 of 2 of problem '0'" in str(error)
    assert "ModelError" in str(error)
    assert "the model is down" in str(error)  # the gateway's 500, as verifiers got it
    assert isinstance(error.__cause__, vf.Error)


async def test_on_error_keep_keeps_the_rollout_scored_with_the_error_in_extra() -> None:
    env = vf.ToolEnv(
        dataset=dataset(("What is 2+3?", "5")), tools=[add], rubric=vf.Rubric(funcs=[correct])
    )
    agent = VerifiersAgent(env=env, renderer=R, on_error="keep")
    with trio.fail_after(SECONDS):
        group = await agent.group_rollout(request(failing(turn=1), group=2))
    for rollout in group:
        record = rollout.extra["verifiers"]
        assert rollout.extra["gateway"]["calls"] == 1
        assert sampled_text(rollout) == call_text("add", a=2, b=3)
        assert record["stop_condition"] == "has_error"
        assert record["error"].startswith("ModelError")
        assert rollout.reward == record["reward"] == 0.0


async def test_a_rollout_that_raises_fails_the_group_as_itself_with_its_note() -> None:
    class Broken(vf.MultiTurnEnv):  # type: ignore[misc]
        async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
            raise KeyError("no such door")

    env = Broken(dataset=dataset(("Open a door.", "x")), rubric=vf.Rubric(funcs=[correct]))
    agent = VerifiersAgent(env=env, renderer=R)
    with trio.fail_after(SECONDS), pytest.raises(KeyError, match="no such door") as caught:
        await agent.group_rollout(request(lambda m: (["left"], [1.0]), group=2))
    notes = getattr(caught.value, "__notes__", [])
    assert any("of 2 of problem '0', in Broken.rollout" in note for note in notes)


async def test_a_member_without_a_model_call_fails_the_group() -> None:
    class Done(vf.MultiTurnEnv):  # type: ignore[misc]
        async def setup_state(self, state: Any) -> Any:
            state["final_env_response"] = [{"role": "user", "content": "nothing to do"}]
            return state

        async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
            return []

    env = Done(dataset=dataset(("Rest.", "x")), rubric=vf.Rubric(funcs=[correct]))
    agent = VerifiersAgent(env=env, renderer=R)
    with (
        trio.fail_after(SECONDS),
        pytest.raises(RuntimeError, match="made no model call") as caught,
    ):
        await agent.group_rollout(request(lambda m: (["x"], [1.0]), group=2))
    assert any("member 0 of 2" in note for note in caught.value.__notes__)


# --------------------------------------------------------------------------- cancellation


async def test_cancelling_a_group_mid_tool_cancels_its_asyncio_tasks() -> None:
    """The tool cancels the group from its thread, then sleeps; cancellation reaches it
    (asyncio's ``CancelledError``), it never finishes, and when ``group_rollout`` has
    returned the group's asyncio loop is closed with no task left."""
    token = trio.lowlevel.current_trio_token()
    scope = trio.CancelScope()
    entered: list[int] = []
    cancelled: list[int] = []
    finished: list[int] = []
    loops: list[asyncio.AbstractEventLoop] = []

    async def slow_add(a: int, b: int) -> int:
        """Add two integers, slowly.

        Args:
            a: The first integer.
            b: The second integer.
        """
        loops.append(asyncio.get_running_loop())
        entered.append(a)
        trio.from_thread.run_sync(scope.cancel, trio_token=token)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(a)
            raise
        finished.append(a)
        return a + b

    env = vf.ToolEnv(
        dataset=dataset(("What is 2+3?", "5")), tools=[slow_add], rubric=vf.Rubric(funcs=[correct])
    )
    agent = VerifiersAgent(env=env, renderer=R)
    with trio.fail_after(SECONDS):
        with scope:
            await agent.group_rollout(request(tool_policy("slow_add"), group=2))
    assert scope.cancelled_caught
    assert entered  # a tool ran, and cancelled the group
    assert cancelled == entered  # every tool that started was cancelled
    assert finished == []  # no tool finished, then or later: its loop is closed
    (loop,) = set(loops)
    assert loop.is_closed()
    assert not asyncio.all_tasks(loop)
