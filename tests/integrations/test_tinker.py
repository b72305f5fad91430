"""``trio_rollouts.integrations.tinker``: tinker-cookbook's ``MessageEnv`` on
``MultiTurnAgent`` (``from_message_env``) and its token-level ``Env`` on ``EnvAgent``,
with real tinker-cookbook classes on the embedded backend, offline."""

from __future__ import annotations

import math
from typing import Any

import pytest

# Imported plainly, never skipped: `nox -s integrations` installs tinker-cookbook for this
# file (the main test run does not collect tests/integrations/).
import tinker
import trio
import trio.testing
from tinker_cookbook.renderers.base import Message
from tinker_cookbook.rl.message_env import MessageEnv, MessageStepResult
from tinker_cookbook.rl.types import ActionExtra, Env, InitialObservationOverflow, StepResult

from trio_rollouts import (
    ChatMessage,
    GenerationArgs,
    GroupedRolloutRequest,
    MultiTurnAgent,
    PlainRenderer,
    Problem,
    PromptSource,
    TemplateBreakError,
    TokenRollout,
)
from trio_rollouts.inference import (
    EmbeddedInference,
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    ReturnsRaw,
    render_plain_chat,
)
from trio_rollouts.integrations.tinker import (
    EnvAgent,
    HistoryRewrittenError,
    MessageEnvironment,
    from_message_env,
)

R = PlainRenderer()
PROBLEMS = [Problem(problem_id=f"p{i}", prompt=f"task {i}", answer=i) for i in range(3)]


def scripted(*turns: str) -> Any:
    """A policy that answers the n-th assistant turn with ``turns[n]`` (the last from
    then on), counting assistant messages, or, for an id prompt (one user message of the
    decoded ids), the assistant headers in it."""

    def policy(messages: list[ChatMessage]) -> tuple[list[str], list[float]]:
        n = sum(message.role == "assistant" for message in messages)
        if len(messages) == 1 and messages[0].role == "user":
            n = messages[0].content.count("<|assistant|>") - 1
        return [turns[min(n, len(turns) - 1)]], [1.0]

    return policy


def embedded(*turns: str) -> EmbeddedInference:
    return EmbeddedInference(policy=scripted(*turns), seed=0)


def request(
    interface: InferenceInterface, *, group: int = 2, max_tokens: int | None = None
) -> GroupedRolloutRequest:
    return GroupedRolloutRequest(
        num_groups=1,
        rollouts_per_group=group,
        inference_interface=interface,
        generation_args=GenerationArgs(max_tokens=max_tokens),
    )


async def one_group(
    agent: MultiTurnAgent | EnvAgent, req: GroupedRolloutRequest
) -> list[TokenRollout]:
    async with agent.get_grouped_rollouts(req) as stream:
        group = await stream.receive()
    return [rollout for rollout in group if isinstance(rollout, TokenRollout)]


def sampled_text(rollout: TokenRollout, element: int = 0) -> str:
    ids, mask = rollout.trajectory[element], rollout.generation_mask[element]  # type: ignore[index]
    return "".join(chr(t) for t, m in zip(ids, mask, strict=True) if m)


# ------------------------------------------------------------------------- MessageEnv


class Quiz(MessageEnv):
    """Asks again after each answer: 0.25 per step, 1.0 at the step that ends it
    (``turns``; ``None``: never ends). ``rewrite``: at step 1, the first message comes
    back changed."""

    def __init__(self, problem: Problem, *, turns: int | None = 3, rewrite: bool = False) -> None:
        self.history: list[Message] = [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": str(problem.prompt)},
        ]
        self.turns = turns
        self.rewrite = rewrite
        self.received: list[Message] = []

    async def initial_observation(self) -> list[Message]:
        return list(self.history)

    async def step(self, message: Message) -> MessageStepResult:
        self.received.append(message)
        self.history.append(message)
        if self.turns is not None and len(self.received) >= self.turns:
            return MessageStepResult(reward=1.0, episode_done=True, next_messages=self.history)
        self.history.append({"role": "user", "content": f"again {len(self.received)}"})
        if self.rewrite:
            self.history[0] = {"role": "system", "content": "Answer at length."}
        return MessageStepResult(
            reward=0.25,
            episode_done=False,
            next_messages=list(self.history),
            metrics={"asked": 1.0},
        )


def quiz_agent(quizzes: list[Quiz], **settings: Any) -> MultiTurnAgent:
    def make(problem: Problem) -> Quiz:
        quizzes.append(Quiz(problem, **settings))
        return quizzes[-1]

    return MultiTurnAgent(
        environment=from_message_env(make), renderer=R, prompts=PromptSource(PROBLEMS, seed=0)
    )


def chat(messages: list[Message]) -> list[ChatMessage]:
    return [ChatMessage(role=m["role"], content=str(m["content"])) for m in messages]


async def test_a_message_env_episode_is_the_whole_conversation_token_exact(
    autojump_clock: trio.testing.MockClock,
) -> None:
    quizzes: list[Quiz] = []
    rollouts = await one_group(quiz_agent(quizzes), request(embedded("one", "two", "three")))
    assert len(rollouts) == len(quizzes) == 2
    # The two episodes of the group play the same problem with the same answers.
    for rollout, quiz in zip(rollouts, quizzes, strict=True):
        assert [m["content"] for m in quiz.received] == ["one", "two", "three"]
        # The stream is one render of the whole conversation, the last answer sampled.
        assert R.decode(rollout.trajectory[0]) == render_plain_chat(chat(quiz.history[:-1])) + (
            "three"
        )
        assert sampled_text(rollout) == "onetwothree"
        assert rollout.fidelity == "exact"
        assert len(rollout.trajectory) == 1


async def test_a_message_env_episode_reward_is_the_sum_of_its_step_rewards(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rollouts = await one_group(quiz_agent([]), request(embedded("a")))
    for rollout in rollouts:
        assert rollout.reward == 0.25 + 0.25 + 1.0
        per_turn = rollout.extra["episode"]["per_turn"]
        assert rollout.extra["episode"]["finish"] == "done"
        # A non-final step's reward is the library's per-turn reward; every step's is in info.
        assert [turn["reward"] for turn in per_turn] == [0.25, 0.25, None]
        assert [turn["info"]["step_reward"] for turn in per_turn] == [0.25, 0.25, 1.0]
        assert per_turn[0]["info"]["metrics"] == {"asked": 1.0}


async def test_a_message_env_ended_by_max_turns_gets_the_sum_so_far(
    autojump_clock: trio.testing.MockClock,
) -> None:
    quizzes: list[Quiz] = []
    agent = quiz_agent(quizzes, turns=None)
    agent.max_turns = 2
    rollouts = await one_group(agent, request(embedded("a")))
    for rollout in rollouts:
        assert rollout.extra["episode"]["finish"] == "max_turns"
        assert rollout.reward == 0.5


async def test_a_message_env_that_rewrites_its_history_is_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    agent = quiz_agent([], rewrite=True)
    with pytest.raises(HistoryRewrittenError, match="rewrote the conversation history") as info:
        await one_group(agent, request(embedded("a")))
    assert "at message 0 of 3" in str(info.value)
    assert "cannot be token-exact" in str(info.value)
    assert isinstance(info.value, TemplateBreakError)


async def test_a_turn_reaches_the_message_env_as_tinker_parses_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    call = '<tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call>'
    quizzes: list[Quiz] = []
    rollouts = await one_group(quiz_agent(quizzes, turns=2), request(embedded(call, "broken")))
    assert rollouts
    message = quizzes[0].received[0]
    assert message["role"] == "assistant"
    [tool_call] = message["tool_calls"]
    assert tool_call.function.name == "add"
    assert tool_call.function.arguments == '{"x": 1}'
    assert quizzes[0].received[1] == {"role": "assistant", "content": "broken"}


async def test_from_message_env_refuses_what_is_not_a_message_env() -> None:
    with pytest.raises(TypeError, match="from_message_env takes a callable"):
        from_message_env(42)  # type: ignore[arg-type]
    factory = from_message_env(lambda problem: "not an env")  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="must return a tinker MessageEnv, got str"):
        factory(PROBLEMS[0])
    with pytest.raises(TypeError, match="message_env must be a tinker_cookbook"):
        MessageEnvironment(object())  # type: ignore[arg-type]


# ------------------------------------------------------------------------- Env


def ids(text: str) -> list[int]:
    return [ord(character) for character in text]


class Dialogue(Env):
    """A token-level env in PlainRenderer's layout: each observation is the previous one,
    the action and a new user turn (``fresh``: a new context each step instead); 0.5 per
    step, 2.0 at the step that ends it (``turns``)."""

    def __init__(self, problem: Problem, *, turns: int = 2, fresh: bool = False) -> None:
        self.context = ids(f"<|user|>\n{problem.prompt}\n<|assistant|>\n")
        self.turns = turns
        self.fresh = fresh
        self.observations: list[list[int]] = []
        self.actions: list[tuple[list[int], ActionExtra | None]] = []

    async def initial_observation(self) -> tuple[Any, list[int]]:
        self.observations.append(list(self.context))
        return tinker.ModelInput.from_ints(self.context), []

    async def step(self, action: list[int], *, extra: ActionExtra | None = None) -> StepResult:
        self.actions.append((list(action), extra))
        done = len(self.actions) >= self.turns
        tail = ids(f"\n<|user|>\nmore {len(self.actions)}\n<|assistant|>\n")
        if self.fresh:
            self.context = ids(f"<|user|>\nfresh {len(self.actions)}\n<|assistant|>\n")
        else:
            self.context = [*self.context, *action, *tail]
        self.observations.append(list(self.context))
        return StepResult(
            reward=2.0 if done else 0.5,
            episode_done=done,
            next_observation=tinker.ModelInput.from_ints(self.context),
            next_stop_condition=[],
            metrics={"stop/completed": 1.0} if done else {},
        )


def env_agent(dialogues: list[Dialogue], **settings: Any) -> EnvAgent:
    def make(problem: Problem) -> Dialogue:
        dialogues.append(Dialogue(problem, **settings))
        return dialogues[-1]

    return EnvAgent(env_factory=make, prompts=PromptSource(PROBLEMS, seed=0))


async def test_an_env_episode_is_its_observations_and_actions_exactly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dialogues: list[Dialogue] = []
    rollouts = await one_group(env_agent(dialogues), request(embedded("first", "second")))
    assert len(rollouts) == len(dialogues) == 2
    for rollout, dialogue in zip(rollouts, dialogues, strict=True):
        assert [action for action, _ in dialogue.actions] == [ids("first"), ids("second")]
        assert [extra for _, extra in dialogue.actions] == [{"stop_reason": "stop"}] * 2
        # One element: the second observation (the first extended by the action) and the
        # second action, the sampled ids masked in.
        assert rollout.trajectory == [dialogue.observations[1] + ids("second")]
        assert sampled_text(rollout) == "firstsecond"
        assert rollout.logprobs is not None
        assert len(rollout.logprobs[0]) == len("firstsecond")
        assert math.isclose(sum(rollout.logprobs[0]), 0.0, abs_tol=1e-9)
        assert rollout.fidelity == "exact"


async def test_an_env_episode_reward_is_the_sum_of_its_step_rewards(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rollouts = await one_group(env_agent([]), request(embedded("a")))
    for rollout in rollouts:
        assert rollout.reward == 0.5 + 2.0
        record = dict(rollout.extra["episode"])
        per_turn = record.pop("per_turn")
        assert record == {"turns": 2, "finish": "done", "breaks": 0, "stop_reason": "completed"}
        assert [turn["reward"] for turn in per_turn] == [0.5, 2.0]
        start = len(f"<|user|>\ntask {rollout.problem_id[1:]}\n<|assistant|>\n")  # type: ignore[index]
        assert (per_turn[0]["start"], per_turn[0]["end"]) == (start, start + 1)


async def test_an_env_observation_that_does_not_extend_starts_a_new_element(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dialogues: list[Dialogue] = []
    rollouts = await one_group(env_agent(dialogues, fresh=True), request(embedded("x")))
    for rollout, dialogue in zip(rollouts, dialogues, strict=True):
        assert rollout.trajectory == [
            dialogue.observations[0] + ids("x"),
            dialogue.observations[1] + ids("x"),
        ]
        assert rollout.generation_mask == [
            [False] * (len(t) - 1) + [True] for t in rollout.trajectory
        ]
        assert rollout.extra["episode"]["breaks"] == 1


async def test_an_env_episode_stops_at_max_turns(autojump_clock: trio.testing.MockClock) -> None:
    dialogues: list[Dialogue] = []
    agent = env_agent(dialogues, turns=10)
    agent.max_turns = 3
    rollouts = await one_group(agent, request(embedded("a")))
    for rollout in rollouts:
        assert rollout.extra["episode"]["finish"] == "max_turns"
        assert rollout.reward == 1.5
    assert all(len(dialogue.actions) == 3 for dialogue in dialogues)


async def test_an_env_turn_cut_by_max_tokens_is_stepped_with_stop_reason_length(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dialogues: list[Dialogue] = []
    req = request(embedded("a long answer"), group=1, max_tokens=4)
    [rollout] = await one_group(env_agent(dialogues), req)
    assert dialogues[0].actions[0] == (ids("a lo"), {"stop_reason": "length"})
    assert rollout.extra["episode"]["per_turn"][0]["finish_reason"] == "length"


class Overflowing(Env):
    async def initial_observation(self) -> InitialObservationOverflow:
        return InitialObservationOverflow(reward=-0.1, metrics={"stop/max_tokens": 1.0})

    async def step(self, action: list[int], *, extra: ActionExtra | None = None) -> StepResult:
        raise AssertionError("never stepped")


async def test_an_env_whose_prompt_overflows_is_an_episode_of_no_turns(
    autojump_clock: trio.testing.MockClock,
) -> None:
    agent = EnvAgent(env_factory=lambda problem: Overflowing(), prompts=PromptSource(PROBLEMS))
    rollouts = await one_group(agent, request(embedded("a")))
    for rollout in rollouts:
        assert rollout.trajectory == [[]]
        assert rollout.reward == -0.1
        assert rollout.extra["episode"]["finish"] == "overflow"
        assert rollout.extra["episode"]["stop_reason"] == "max_tokens"


class TextOnly(ReturnsRaw, InferenceInterface):
    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        raise AssertionError("never called")


async def test_env_agent_needs_a_backend_that_takes_token_ids() -> None:
    agent = env_agent([])
    with pytest.raises(TypeError, match="TextOnly does not generate from them"):
        await agent.group_rollout(request(TextOnly()))


def test_env_agent_refuses_what_is_not_an_env_factory() -> None:
    with pytest.raises(TypeError, match="env_factory must be a callable"):
        EnvAgent(env_factory=42, prompts=PromptSource(PROBLEMS))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs problems"):
        EnvAgent(env_factory=Dialogue)


async def test_env_agent_refuses_a_factory_that_makes_no_env(
    autojump_clock: trio.testing.MockClock,
) -> None:
    agent = EnvAgent(env_factory=lambda problem: object(), prompts=PromptSource(PROBLEMS))  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="env_factory must return a tinker Env, got object"):
        await one_group(agent, request(embedded("a")))
