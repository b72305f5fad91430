"""``MultiTurnAgent``: the rules of a token-exact episode, one test per rule (the random
episodes are in ``test_episode_properties.py``)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from trio_rollouts import (
    AssistantTurn,
    BaseEnvironment,
    ChatMessage,
    Environment,
    EnvironmentStep,
    FailurePolicy,
    GenerationArgs,
    GroupedRolloutRequest,
    MultiTurnAgent,
    PlainRenderer,
    Problem,
    PromptSource,
    StepTimeoutError,
    TemplateBreakError,
    TokenFidelityError,
    TokenMismatchError,
    TokenRollout,
    blocking_grouped_rollouts,
)
from trio_rollouts.inference import (
    EmbeddedInference,
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    LatencyModel,
    ReturnsRaw,
    ReturnsTokens,
)

R = PlainRenderer()
PROBLEMS = [Problem(problem_id=f"p{i}", prompt=f"task {i}", answer=i) for i in range(4)]
TOOLS = [{"type": "function", "function": {"name": "calculator"}}]


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=text)


def scripted(*turns: str) -> Any:
    """A policy that answers the n-th assistant turn of a conversation with ``turns[n]``
    (the last one from then on)."""

    def policy(messages: list[ChatMessage]) -> tuple[list[str], list[float]]:
        n = sum(message.role == "assistant" for message in messages)
        return [turns[min(n, len(turns) - 1)]], [1.0]

    return policy


def embedded(*turns: str, **kwargs: Any) -> EmbeddedInference:
    return EmbeddedInference(policy=scripted(*turns), seed=0, **kwargs)


@attrs.define(eq=False)
class Log:
    """What the environments of a test did."""

    made: int = 0
    closed: list[str] = attrs.field(factory=list)
    turns: list[AssistantTurn] = attrs.field(factory=list)
    running_steps: int = 0
    most_steps: int = 0


class Echo(BaseEnvironment):
    """Answers every turn with a user message; done at ``done_after`` turns."""

    def __init__(
        self,
        problem: Problem,
        log: Log,
        *,
        done_after: int | None = None,
        reward: float = 1.0,
        step_seconds: float = 0.0,
        fail_on: int | None = None,
    ) -> None:
        super().__init__()
        self.problem = problem
        self.log = log
        self.done_after = done_after
        self.reward = reward
        self.step_seconds = step_seconds
        self.fail_on = fail_on
        self.steps = 0
        log.made += 1

    async def reset(self) -> Sequence[ChatMessage]:
        await trio.lowlevel.checkpoint()
        return [user(str(self.problem.prompt))]

    async def step(self, turn: AssistantTurn) -> EnvironmentStep:
        self.steps += 1
        self.log.turns.append(turn)
        self.log.running_steps += 1
        self.log.most_steps = max(self.log.most_steps, self.log.running_steps)
        try:
            await trio.sleep(self.step_seconds)
        finally:
            self.log.running_steps -= 1
        if self.fail_on == self.steps:
            raise KeyError("the tool crashed")
        if self.done_after is not None and self.steps >= self.done_after:
            return EnvironmentStep(done=True, reward=self.reward)
        return EnvironmentStep(messages=[user(f"reply {self.steps}")])

    async def final_reward(self) -> float:
        await trio.lowlevel.checkpoint()
        return 0.25

    async def aclose(self) -> None:
        await trio.sleep(0.5)  # a bounded, shielded cleanup that takes time
        self.log.closed.append(self.problem.problem_id)


def agent_for(log: Log, *, env: dict[str, Any] | None = None, **kwargs: Any) -> MultiTurnAgent:
    settings = env or {}
    return MultiTurnAgent(
        environment=lambda problem: Echo(problem, log, **settings),
        renderer=kwargs.pop("renderer", R),
        prompts=PromptSource(PROBLEMS, seed=0),
        **kwargs,
    )


def request(
    interface: InferenceInterface, *, group: int = 2, max_tokens: int | None = None, **kw: Any
) -> GroupedRolloutRequest:
    return GroupedRolloutRequest(
        num_groups=1,
        rollouts_per_group=group,
        inference_interface=interface,
        generation_args=GenerationArgs(max_tokens=max_tokens),
        **kw,
    )


async def one_group(agent: MultiTurnAgent, req: GroupedRolloutRequest) -> list[TokenRollout]:
    async with agent.get_grouped_rollouts(req) as stream:
        group = await stream.receive()
    return [r for r in group if isinstance(r, TokenRollout)]


def sampled_text(rollout: TokenRollout, element: int = 0) -> str:
    ids = rollout.trajectory[element]
    mask = rollout.generation_mask[element]  # type: ignore[index]
    return "".join(chr(t) for t, m in zip(ids, mask, strict=True) if m)


# ------------------------------------------------------------------------- the episode


async def test_an_episode_is_one_token_stream_with_the_sampled_ids_masked_in(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    agent = agent_for(log, env={"done_after": 2, "reward": 0.75})
    [rollout, other] = await one_group(agent, request(embedded("first", "second")))
    text = R.decode(rollout.trajectory[0])
    problem = next(p for p in PROBLEMS if p.problem_id == rollout.problem_id)
    assert text == (
        f"<|user|>\n{problem.prompt}\n<|assistant|>\nfirst\n<|user|>\nreply 1\n"
        "<|assistant|>\nsecond"
    )
    assert sampled_text(rollout) == "firstsecond"
    assert rollout.logprobs is not None
    assert len(rollout.logprobs[0]) == len("firstsecond")
    assert math.isclose(sum(rollout.logprobs[0][:5]), 0.0, abs_tol=1e-12)  # p = 1
    assert rollout.reward == 0.75
    assert rollout.fidelity == "exact"
    record = dict(rollout.extra["episode"])
    per_turn = record.pop("per_turn")
    assert record == {
        "turns": 2,
        "finish": "done",
        "breaks": 0,
        "tool_calls": 0,
        "parse_errors": 0,
        "truncated_turns": 0,
    }
    # One record per turn: its span in the element, how it ended, its calls, the step's.
    first = len(f"<|user|>\n{problem.prompt}\n<|assistant|>\n")
    second = first + len("first\n<|user|>\nreply 1\n<|assistant|>\n")
    assert per_turn == [
        {
            "element": 0,
            "start": start,
            "end": start + len(text),
            "finish_reason": "stop",
            "tool_calls": [],
            "reward": None,  # the done step's reward is the episode's
            "info": {},
        }
        for start, text in ((first, "first"), (second, "second"))
    ]
    assert [R.decode(rollout.trajectory[0][t["start"] : t["end"]]) for t in per_turn] == [
        "first",
        "second",
    ]
    assert rollout.policy_epoch == [[(0, 0)]]
    assert other.problem_id == rollout.problem_id
    # Every environment made was closed once, after its episode.
    assert log.made == 2
    assert log.closed == [rollout.problem_id] * 2


async def test_each_turn_generates_from_exactly_the_elements_ids(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen: list[list[int]] = []

    @attrs.define(eq=False)
    class Recording(EmbeddedInference):
        async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
            assert request.prompt_ids is not None
            seen.append(list(request.prompt_ids))
            # The policy sees the conversation so far, the assistant turns decoded.
            assert request.prompt[-1].role == "user"
            return await super().base_generate(request)

    log = Log()
    agent = agent_for(log, max_turns=3)
    [rollout] = await one_group(
        agent, request(Recording(policy=scripted("a", "bb"), seed=0), group=1)
    )
    assert len(seen) == 3
    ids = rollout.trajectory[0]
    for prompt in seen:
        assert ids[: len(prompt)] == prompt  # the extension property
    assert rollout.extra["episode"]["finish"] == "max_turns"
    assert rollout.reward == 0.25  # final_reward: a limit ended it


async def test_step_is_called_on_the_last_turn_and_done_wins_over_max_turns(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    agent = agent_for(log, env={"done_after": 2, "reward": 1.0}, max_turns=2)
    [rollout] = await one_group(agent, request(embedded("x"), group=1))
    assert len(log.turns) == 2
    assert rollout.extra["episode"]["finish"] == "done"
    assert rollout.reward == 1.0


async def test_tool_calls_and_parse_errors_are_counted_from_the_parsed_turns(
    autojump_clock: trio.testing.MockClock,
) -> None:
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    broken = "<tool_call>{not json}</tool_call>"
    log = Log()
    agent = agent_for(log, max_turns=3)
    [rollout] = await one_group(agent, request(embedded(call + call, broken, "done"), group=1))
    assert [len(t.tool_calls) for t in log.turns] == [2, 1, 0]
    assert log.turns[1].parse_error is not None
    assert log.turns[1].tool_calls[0].raw == "{not json}"
    episode = rollout.extra["episode"]
    assert (episode["tool_calls"], episode["parse_errors"]) == (3, 1)


# ---------------------------------------------------------------- max_episode_tokens


async def test_max_episode_tokens_caps_each_turn_and_ends_the_episode(
    autojump_clock: trio.testing.MockClock,
) -> None:
    asked: list[int | None] = []

    @attrs.define(eq=False)
    class Recording(EmbeddedInference):
        async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
            asked.append(request.generation_args.max_tokens)
            return await super().base_generate(request)

    log = Log()
    prompt_length = len(R.render([user("task 0")]))
    budget = prompt_length + 30
    agent = agent_for(log, max_turns=8, max_episode_tokens=budget)
    interface = Recording(policy=scripted("y" * 12), seed=0)
    [rollout] = await one_group(agent, request(interface, group=1, max_tokens=20))
    ids = rollout.trajectory[0]
    assert len(ids) <= budget
    # Turn 1: min(20, 30 left); after it and its bridge, fewer ids are left than asked.
    assert asked[0] == 20
    assert all(a is not None and a <= 20 for a in asked)
    assert rollout.extra["episode"]["finish"] == "max_tokens"
    assert rollout.reward == 0.25
    assert len(log.turns) == rollout.extra["episode"]["turns"]


async def test_a_turn_that_fills_the_budget_still_gets_its_step_and_its_done_wins(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    prompt_length = len(R.render([user("task 0")]))
    agent = agent_for(
        log, env={"done_after": 1, "reward": 0.5}, max_episode_tokens=prompt_length + 4
    )
    [rollout] = await one_group(agent, request(embedded("longer than four"), group=1))
    assert len(rollout.trajectory[0]) == prompt_length + 4
    assert sampled_text(rollout) == "long"
    assert len(log.turns) == 1
    assert rollout.extra["episode"]["finish"] == "done"
    assert rollout.reward == 0.5


# ------------------------------------------------------------- truncation and breaks


@attrs.frozen
class Closing(PlainRenderer):
    """PlainRenderer with an end-of-turn id (``\\x04``) and a bridge that, like
    HFRenderer's, refuses to bridge a turn that did not end with it; ``refuse`` makes
    it refuse on the given call numbers."""

    refuse: frozenset[int] = frozenset()
    calls: list[int] = attrs.field(factory=list)

    @property
    def stop_token_ids(self) -> list[int]:
        return [4]

    @property
    def close_ids(self) -> list[int]:
        return [4]

    def bridge(
        self,
        previous_ids: Sequence[int],
        new_messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int] | None:
        self.calls.append(len(self.calls) + 1)
        if len(self.calls) in self.refuse or not previous_ids or previous_ids[-1] != 4:
            return None
        return super().bridge(previous_ids, new_messages, tools=tools)

    def parse(self, completion_ids: Sequence[int]) -> AssistantTurn:
        return super().parse([i for i in completion_ids if i != 4])


async def test_a_truncated_turn_is_closed_with_close_ids_at_mask_0(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    agent = agent_for(log, renderer=Closing(), max_turns=2)
    # "abcdef\x04" cut at 3 ids: the close id follows with mask 0, then the bridge.
    [rollout] = await one_group(agent, request(embedded("abcdef\x04"), group=1, max_tokens=3))
    ids, mask = rollout.trajectory[0], rollout.generation_mask[0]  # type: ignore[index]
    problem = next(p for p in PROBLEMS if p.problem_id == rollout.problem_id)
    start = len(R.render([user(str(problem.prompt))]))
    assert ids[start : start + 4] == [ord("a"), ord("b"), ord("c"), 4]
    assert mask[start : start + 4] == [True, True, True, False]
    assert len(rollout.trajectory) == 1  # no break: the bridge accepted the closed turn
    assert rollout.extra["episode"]["truncated_turns"] == 1
    # The last turn was cut too, but the episode did not go on after it.
    assert rollout.extra["episode"]["finish"] == "max_turns"


async def test_a_bridge_the_renderer_cannot_prove_splits_the_episode(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    renderer = Closing(refuse=frozenset({1}))
    agent = agent_for(log, renderer=renderer, max_turns=3)
    [rollout] = await one_group(agent, request(embedded("one\x04", "two\x04"), group=1))
    assert len(rollout.trajectory) == 2
    assert rollout.extra["episode"]["breaks"] == 1
    # The new element is a full render of the conversation so far (mask 0), then turns.
    second, mask = rollout.trajectory[1], rollout.generation_mask[1]  # type: ignore[index]
    problem = next(p for p in PROBLEMS if p.problem_id == rollout.problem_id)
    conversation = [
        user(str(problem.prompt)),
        ChatMessage(role="assistant", content="one"),  # decoded without its stop id
        user("reply 1"),
    ]
    head = R.render(conversation)
    assert second[: len(head)] == head
    assert not any(mask[: len(head)])
    assert sampled_text(rollout, 0) == "one\x04"
    assert sampled_text(rollout, 1) == "two\x04two\x04"
    assert rollout.logprobs is not None
    assert [len(lp) for lp in rollout.logprobs] == [4, 8]
    assert len(rollout.policy_epoch) == 2


async def test_on_break_raise_raises_template_break_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    agent = agent_for(log, renderer=Closing(refuse=frozenset({1})), on_break="raise")
    with pytest.raises(TemplateBreakError, match="could not prove a bridge"):
        await one_group(agent, request(embedded("one\x04"), group=1))
    assert log.closed == [log.closed[0]]  # closed on the failing route too


class ToolSwitch(Echo):
    """Offers the calculator after its first step."""

    @property  # type: ignore[override]
    def tools(self) -> list[dict[str, Any]] | None:
        return TOOLS if self.steps >= 1 else None


async def test_a_changed_tool_set_is_a_break(autojump_clock: trio.testing.MockClock) -> None:
    log = Log()
    agent = MultiTurnAgent(
        environment=lambda problem: ToolSwitch(problem, log),
        renderer=R,
        prompts=PromptSource(PROBLEMS, seed=0),
        max_turns=3,
    )
    [rollout] = await one_group(agent, request(embedded("a"), group=1))
    assert rollout.extra["episode"]["breaks"] == 1
    assert len(rollout.trajectory) == 2
    assert R.decode(rollout.trajectory[1]).startswith("<|tools|>\n")
    assert not R.decode(rollout.trajectory[0]).startswith("<|tools|>")


# ----------------------------------------------------------------------------- fidelity


@attrs.define(eq=False)
class ChatServer(InferenceInterface, ReturnsRaw):
    """A chat server that renders with PlainRenderer (``prefix`` before it, to make it
    disagree) and returns text only."""

    text: str = "hi"
    #: Put before the prompts of later turns, to make the server's template disagree.
    prefix: str = ""

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        await trio.lowlevel.checkpoint()
        assert request.prompt_ids is None
        prefix = self.prefix if len(request.prompt) > 1 else ""
        prompt = R.encode(prefix) + R.render(request.prompt, tools=request.tools)
        return self.respond(prompt)

    def respond(self, prompt: list[int]) -> InferenceResponse:
        return InferenceResponse(
            response=ChatMessage(role="assistant", content=self.text),
            raw_text=R.decode(prompt) + self.text,
            finish_reason="stop",
        )


@attrs.define(eq=False)
class TokenChatServer(ChatServer, ReturnsTokens):
    """The same, returning the ids it rendered and sampled."""

    def respond(self, prompt: list[int]) -> InferenceResponse:
        response = super().respond(prompt)
        response.token_ids = prompt + R.encode(self.text)
        response.prompt_length = len(prompt)
        return response


async def test_a_text_only_backend_is_below_the_default_min_fidelity(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    with pytest.raises(TokenFidelityError, match=r"ChatServer returns text only.*min_fidelity"):
        await one_group(agent_for(log), request(ChatServer(), group=1))
    assert log.made == 0  # refused before any work


async def test_retokenized_turns_when_allowed(autojump_clock: trio.testing.MockClock) -> None:
    log = Log()
    agent = agent_for(log, min_fidelity="retokenized", max_turns=2)
    [rollout] = await one_group(agent, request(ChatServer(text="hey"), group=1))
    assert rollout.fidelity == "retokenized"
    assert rollout.logprobs is None
    assert sampled_text(rollout) == "heyhey"  # mask 1 exactly on encode(text)


async def test_server_tokens_are_checked_against_the_stream(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    agent = agent_for(log, max_turns=2)
    [rollout] = await one_group(agent, request(TokenChatServer(text="ok"), group=1))
    assert rollout.fidelity == "server_tokens"
    assert len(rollout.trajectory) == 1
    assert rollout.extra["episode"]["breaks"] == 0
    # A server whose template differs: the element starts from what the model saw.
    log = Log()
    agent = agent_for(log, max_turns=2)
    [rollout] = await one_group(agent, request(TokenChatServer(text="ok", prefix="#"), group=1))
    assert rollout.extra["episode"]["breaks"] == 1
    assert len(rollout.trajectory) == 2
    assert R.decode(rollout.trajectory[1]).startswith("#<|user|>")
    assert sampled_text(rollout, 0) == "ok"
    assert sampled_text(rollout, 1) == "ok"


@attrs.define(eq=False)
class Retokenizing(EmbeddedInference):
    """An AcceptsTokens backend that says it generated from other ids."""

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        response = await super().base_generate(request)
        assert response.token_ids is not None
        response.token_ids[3] += 1
        return response


async def test_an_accepts_tokens_backend_that_changes_the_prompt_is_a_mismatch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    with pytest.raises(TokenMismatchError) as caught:
        await one_group(agent_for(log), request(Retokenizing(seed=0), group=1))
    assert caught.value.index == 3


# ------------------------------------------------------------ concurrency and deadlines


async def test_a_step_past_step_timeout_fails_the_group_and_is_transient(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    agent = agent_for(log, env={"step_seconds": 10.0}, step_timeout=1.0)
    with pytest.raises(StepTimeoutError, match=r"step_timeout=1\.0 s on turn 1"):
        await one_group(agent, request(embedded("x"), group=1))
    assert FailurePolicy().is_transient(StepTimeoutError("late"))
    assert len(log.closed) == 1
    assert log.running_steps == 0


async def test_a_step_timeout_is_retried_as_a_whole_group(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    slow_first = iter([10.0, 10.0])

    class SlowOnce(Echo):
        async def step(self, turn: AssistantTurn) -> EnvironmentStep:
            self.step_seconds = next(slow_first, 0.0)
            return await super().step(turn)

    agent = MultiTurnAgent(
        environment=lambda problem: SlowOnce(problem, log, done_after=1),
        renderer=R,
        prompts=PromptSource(PROBLEMS, seed=0),
        step_timeout=1.0,
        failure_policy=FailurePolicy(max_attempts=2, wait_initial=0, wait_jitter=0),
    )
    async with agent.get_grouped_rollouts(request(embedded("x"))) as stream:
        group = await stream.receive()
        statistics = stream.statistics()
    assert len(group) == 2
    assert statistics.retries == 1
    assert log.made == 4
    assert len(log.closed) == 4


async def test_environment_concurrency_bounds_steps_and_waiting_does_not_time_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    agent = agent_for(
        log,
        env={"step_seconds": 0.9, "done_after": 1},
        environment_concurrency=2,
        step_timeout=1.0,  # 8 steps of 0.9 s through 2 slots: most wait > 1 s
    )
    [*rollouts] = await one_group(agent, request(embedded("x"), group=8))
    assert len(rollouts) == 8
    assert log.most_steps == 2


async def test_a_failing_episode_cancels_its_siblings_and_every_environment_is_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    made: list[Echo] = []

    def factory(problem: Problem) -> Echo:
        env = Echo(problem, log, step_seconds=5.0, fail_on=1 if not made else None)
        if not made:
            env.step_seconds = 1.0
        made.append(env)
        return env

    agent = MultiTurnAgent(environment=factory, renderer=R, prompts=PromptSource(PROBLEMS, seed=0))
    with pytest.raises(KeyError, match="the tool crashed"):
        await one_group(agent, request(embedded("x"), group=3))
    assert len(log.closed) == 3
    assert log.running_steps == 0


async def test_cancelling_the_stream_closes_every_environment_before_exit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    agent = agent_for(log, env={"step_seconds": 100.0})
    req = GroupedRolloutRequest(
        num_groups=2,
        rollouts_per_group=2,
        inference_interface=embedded("x"),
        streaming=True,
    )
    with trio.move_on_after(3):
        async with agent.get_grouped_rollouts(req) as stream:
            await stream.receive()
    assert log.made > 4  # streaming: many groups were running
    assert len(log.closed) == log.made  # shielded: each aclose finished despite the cancel
    assert log.running_steps == 0


class StuckClose(Echo):
    async def aclose(self) -> None:
        await trio.sleep_forever()


async def test_an_aclose_that_hangs_is_abandoned_after_five_seconds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    agent = MultiTurnAgent(
        environment=lambda problem: StuckClose(problem, log, done_after=1),
        renderer=R,
        prompts=PromptSource(PROBLEMS, seed=0),
    )
    start = trio.current_time()
    with pytest.warns(RuntimeWarning, match=r"aclose\(\) did not finish within 5.0 s"):
        [rollout] = await one_group(agent, request(embedded("x"), group=1))
    assert rollout.reward == 1.0
    assert 5.0 <= trio.current_time() - start < 6.0


# ---------------------------------------------------------------------- policy epochs


async def test_a_keep_update_between_turns_shows_at_the_next_turns_first_sampled_id(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    interface = embedded(
        "abc", latency=LatencyModel(first_token=0.0, per_token=1.0, distribution="constant")
    )
    agent = agent_for(log, env={"step_seconds": 10.0, "done_after": 2})
    req = request(interface, group=1, streaming=True)
    async with agent.get_grouped_rollouts(req) as stream:
        await trio.sleep(5)  # the first turn is done, its step runs
        async with stream.weight_update("keep"):
            pass
        group = await stream.receive()
    [rollout] = group
    assert isinstance(rollout, TokenRollout)
    ids = rollout.trajectory[0]
    mask = rollout.generation_mask[0]  # type: ignore[index]
    second_turn = [i for i, m in enumerate(mask) if m][3]
    assert rollout.policy_epoch == [[(0, 0), (second_turn, 1)]]
    assert group.start_epoch == 0
    assert len(ids) == len(mask)


async def test_a_keep_update_inside_a_turn_shows_where_the_turn_went_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    interface = embedded(
        "abcdef", latency=LatencyModel(first_token=0.0, per_token=1.0, distribution="constant")
    )
    agent = agent_for(log, env={"done_after": 1})
    req = request(interface, group=1, streaming=True)
    async with agent.get_grouped_rollouts(req) as stream:
        await trio.sleep(2.5)  # two ids sampled under epoch 0
        async with stream.weight_update("keep"):
            pass
        group = await stream.receive()
    [rollout] = group
    assert isinstance(rollout, TokenRollout)
    first = rollout.generation_mask[0].index(True)  # type: ignore[index]
    assert rollout.policy_epoch == [[(0, 0), (first + 3, 1)]]


# ---------------------------------------------------------------------- construction


def test_environment_step_needs_a_reward_when_done() -> None:
    with pytest.raises(ValueError, match="reward is required when done=True"):
        EnvironmentStep(done=True)
    with pytest.raises(ValueError, match="finite"):
        EnvironmentStep(done=True, reward=math.nan)
    with pytest.raises(TypeError, match=r"messages\[0\] must be a ChatMessage"):
        EnvironmentStep(messages=["hi"])  # type: ignore[list-item]
    step = EnvironmentStep(messages=[user("x")])
    assert step.messages == (user("x"),)
    assert not step.done
    assert step.reward is None


async def test_base_environment_defaults() -> None:
    class Minimal(BaseEnvironment):
        async def reset(self) -> Sequence[ChatMessage]:
            return [user("x")]

        async def step(self, turn: AssistantTurn) -> EnvironmentStep:
            return EnvironmentStep(done=True, reward=1.0)

    env = Minimal()
    assert isinstance(env, Environment)
    assert env.tools is None
    assert await env.final_reward() == 0.0
    await env.aclose()
    with pytest.raises(NotImplementedError, match="must implement step"):
        await BaseEnvironment().step(AssistantTurn(content=""))


def test_construction_checks() -> None:
    def factory(problem: Problem) -> Echo:
        return Echo(problem, Log())

    with pytest.raises(TypeError, match="needs problems: pass prompts="):
        MultiTurnAgent(environment=factory, renderer=R)
    with pytest.raises(TypeError, match="renderer must be a Renderer"):
        MultiTurnAgent(environment=factory, renderer="chatml", prompts=PromptSource(PROBLEMS))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="environment must be a callable"):
        MultiTurnAgent(environment=3, renderer=R, prompts=PromptSource(PROBLEMS))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_break must be 'split' or 'raise'"):
        MultiTurnAgent(
            environment=factory, renderer=R, prompts=PromptSource(PROBLEMS), on_break="skip"
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_fidelity must be one of"):
        MultiTurnAgent(
            environment=factory, renderer=R, prompts=PromptSource(PROBLEMS), min_fidelity="best"
        )
    with pytest.raises(ValueError, match="max_turns"):
        MultiTurnAgent(environment=factory, renderer=R, prompts=PromptSource(PROBLEMS), max_turns=0)

    class OwnProblems(MultiTurnAgent):
        async def get_problem(self, request: GroupedRolloutRequest) -> Problem:
            return PROBLEMS[0]

    OwnProblems(environment=factory, renderer=R)  # no prompts needed


async def test_a_factory_that_makes_no_environment_is_a_type_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    agent = MultiTurnAgent(
        environment=lambda problem: object(),  # type: ignore[arg-type,return-value]
        renderer=R,
        prompts=PromptSource(PROBLEMS, seed=0),
    )
    with pytest.raises(TypeError, match="not an Environment"):
        await one_group(agent, request(embedded("x"), group=1))


@attrs.define(eq=False)
class NoIds(EmbeddedInference):
    """An AcceptsTokens backend that returns text only."""

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        response = await super().base_generate(request)
        response.token_ids = response.prompt_length = None
        return response


async def test_a_token_backend_that_returns_no_ids_is_retokenized_not_exact(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    with pytest.raises(TokenFidelityError, match="returned no token ids for this turn"):
        await one_group(agent_for(log), request(NoIds(policy=scripted("ab"), seed=0), group=1))
    log = Log()
    agent = agent_for(log, min_fidelity="retokenized", env={"done_after": 1})
    [rollout] = await one_group(agent, request(NoIds(policy=scripted("ab"), seed=0), group=1))
    assert rollout.fidelity == "retokenized"
    assert rollout.logprobs is None
    assert sampled_text(rollout) == "ab"


class BadClose(Echo):
    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
        raise OSError("the sandbox would not stop")


def bad_close_agent(**env: Any) -> MultiTurnAgent:
    log = Log()
    return MultiTurnAgent(
        environment=lambda problem: BadClose(problem, log, **env),
        renderer=R,
        prompts=PromptSource(PROBLEMS, seed=0),
    )


async def test_an_aclose_error_is_raised_noted_or_warned_by_route(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The episode succeeded: the error is the episode's.
    with pytest.raises(OSError, match="would not stop"):
        await one_group(bad_close_agent(done_after=1), request(embedded("x"), group=1))
    # The episode failed: a note on its error.
    with pytest.raises(KeyError) as caught:
        await one_group(bad_close_agent(fail_on=1), request(embedded("x"), group=1))
    assert any("would not stop" in note for note in caught.value.__notes__)
    # The episode was cancelled: a warning, since a note would vanish with the Cancelled;
    # one for the group, however many of its episodes were cancelled.
    agent = bad_close_agent(step_seconds=100.0)
    with pytest.warns(RuntimeWarning) as warned:
        with trio.move_on_after(1):
            await one_group(agent, request(embedded("x"), group=3))
    (warning,) = warned
    assert re.match(
        r"3 episode\(s\) of problem '.*' were cancelled and then their environment's "
        r"aclose\(\) raised; the first: BadClose.aclose\(\) raised OSError",
        str(warning.message),
    )


def test_episodes_through_the_sync_bridge_close_every_environment() -> None:
    """A synchronous trainer: the episodes run in the bridge's Trio thread, with the
    start epoch of each call and every environment closed when the block exits."""
    log = Log()
    agent = agent_for(log, env={"done_after": 2, "step_seconds": 0.001})
    req = GroupedRolloutRequest(
        num_groups=2,
        rollouts_per_group=2,
        inference_interface=embedded("a", latency=LatencyModel(first_token=0.0, per_token=0.0)),
        streaming=True,
        initial_epoch=3,
    )
    with blocking_grouped_rollouts(agent, req) as stream:
        groups = stream.take(4, timeout=30)
    rollouts = [r for group in groups for r in group]
    assert all(isinstance(r, TokenRollout) and r.fidelity == "exact" for r in rollouts)
    assert {r.policy_epoch[0][0][1] for r in rollouts if isinstance(r, TokenRollout)} == {3}
    assert log.made == len(log.closed)
    assert log.running_steps == 0


async def test_turns_a_backend_does_not_stamp_get_the_groups_start_epoch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    agent = agent_for(log, env={"done_after": 1}, parallel_generation_tasks=1, buffer_size=0)
    req = request(TokenChatServer(text="ok"), group=1, streaming=True, initial_epoch=5)
    async with agent.get_grouped_rollouts(req) as stream:
        before = await stream.receive()
        async with stream.weight_update("drain"):
            pass
        after = [await stream.receive() for _ in range(2)]
    [first] = before
    assert isinstance(first, TokenRollout)
    assert first.policy_epoch == [[(0, before.start_epoch)]]
    assert before.start_epoch == 5
    late = after[-1]
    [rollout] = late
    assert isinstance(rollout, TokenRollout)
    assert late.start_epoch == 6
    assert rollout.policy_epoch == [[(0, 6)]]


async def test_a_retokenized_turn_is_closed_with_close_ids_when_the_episode_goes_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    agent = agent_for(log, renderer=Closing(), min_fidelity="retokenized", max_turns=2)
    [rollout] = await one_group(agent, request(ChatServer(text="hey"), group=1))
    assert len(rollout.trajectory) == 1  # the bridge accepted the closed turn: no break
    ids, mask = rollout.trajectory[0], rollout.generation_mask[0]  # type: ignore[index]
    first = mask.index(True)
    assert ids[first : first + 4] == [*R.encode("hey"), 4]
    assert mask[first : first + 4] == [True, True, True, False]
    assert rollout.extra["episode"]["truncated_turns"] == 0  # "stop", not cut


@attrs.define(eq=False)
class NoCacheEpochs(EmbeddedInference):
    """Stamps policy epochs but reports no cache epochs (as OpenAIInference)."""

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        response = await super().base_generate(request)
        response.kv_cache_epoch = []
        return response


async def test_no_cache_epochs_at_all_are_written_as_for_a_single_turn_rollout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    agent = agent_for(log, env={"done_after": 2})
    [rollout] = await one_group(
        agent, request(NoCacheEpochs(policy=scripted("a"), seed=0), group=1)
    )
    assert rollout.kv_cache_epoch == []
    assert rollout.policy_epoch == [[(0, 0)]]
    [with_cache] = await one_group(agent, request(embedded("a"), group=1))
    assert with_cache.kv_cache_epoch == [[(0, 0)]]
