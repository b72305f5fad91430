"""What a new user of ``MultiTurnAgent`` meets: bounded live environments, one bug one
exception, loud misuse, and the per-turn record.

Each test fails without its fix (see the changelog): the environments alive at once, the
exception type of a deterministic bug (a group of N before), the notes naming problem,
episode and turn, the per-step reward and ``info`` kept, the misuse refused at once.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import trio_rollouts as tr
from trio_rollouts import (
    AssistantTurn,
    BaseEnvironment,
    ChatMessage,
    EnvironmentStep,
    GroupedRolloutRequest,
    MultiTurnAgent,
    PlainRenderer,
    Problem,
    PromptSource,
    TokenRollout,
)
from trio_rollouts._concurrency import real_leaves
from trio_rollouts.inference import EmbeddedInference, LatencyModel

R = PlainRenderer()
PROBLEMS = [Problem(problem_id=f"p{i}", prompt=f"question {i}") for i in range(64)]


def backend(*turns: str, first_token: float = 0.5) -> EmbeddedInference:
    def policy(messages: list[ChatMessage]) -> tuple[list[str], list[float]]:
        n = sum(message.role == "assistant" for message in messages)
        return [turns[min(n, len(turns) - 1)]], [1.0]

    latency = LatencyModel(first_token=first_token, per_token=0.0, distribution="constant")
    return EmbeddedInference(policy=policy, seed=0, latency=latency)


@attrs.define(eq=False)
class Census:
    """How many environments exist at once (from the factory call until aclose returns)."""

    alive: int = 0
    peak: int = 0
    made: int = 0

    def born(self) -> None:
        self.alive += 1
        self.made += 1
        self.peak = max(self.peak, self.alive)


class Sandbox(BaseEnvironment):
    """Holds a sandbox from construction until aclose: two turns, then done."""

    def __init__(self, problem: Problem, census: Census, *, fail: str | None = None) -> None:
        super().__init__()
        self.problem, self.census, self.fail = problem, census, fail
        self.steps = 0
        census.born()

    async def reset(self) -> Sequence[ChatMessage]:
        await trio.sleep(0.1)
        if self.fail == "reset":
            raise LookupError("the sandbox image is missing")
        return [ChatMessage(role="user", content=str(self.problem.prompt))]

    async def step(self, turn: AssistantTurn) -> EnvironmentStep:
        self.steps += 1
        await trio.sleep(0.1)
        if self.fail == "step" and self.steps == 2:
            raise KeyError("the tool crashed")
        if self.steps >= 2:
            return EnvironmentStep(done=True, reward=1.0, info={"exit_code": 0})
        return EnvironmentStep(
            messages=[ChatMessage(role="user", content="again")],
            reward=0.25,
            info={"tests_passed": 3, "log": ["ok"]},
        )

    async def aclose(self) -> None:
        await trio.sleep(0.2)
        self.census.alive -= 1


def agent(census: Census, **fields: Any) -> MultiTurnAgent:
    fail = fields.pop("fail", None)
    return MultiTurnAgent(
        environment=lambda problem: Sandbox(problem, census, fail=fail),
        renderer=R,
        prompts=PromptSource(PROBLEMS, seed=0),
        **fields,
    )


def streaming(**fields: Any) -> GroupedRolloutRequest:
    defaults: dict[str, Any] = {
        "num_groups": 4,
        "rollouts_per_group": 4,
        "inference_interface": backend("a", "b"),
        "streaming": True,
    }
    return GroupedRolloutRequest(**{**defaults, **fields})


async def take(agent: MultiTurnAgent, request: GroupedRolloutRequest, groups: int) -> list[Any]:
    taken = []
    async with agent.get_grouped_rollouts(request) as stream:
        async for group in stream:
            taken.append(group)
            if len(taken) == groups:
                break
    return taken


# --------------------------------------------------------------------------- live environments


async def test_with_defaults_every_outstanding_episode_holds_an_environment(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The new user's settings: streaming, 4 groups of 4, defaults (P = 512): 128 batches
    # outstanding, 2,048 episodes, each holding its sandbox while the model generates.
    census = Census()
    await take(agent(census), streaming(), groups=8)
    assert census.peak == 2048


async def test_live_environments_bounds_the_environments_alive_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    census = Census()
    groups = await take(agent(census, live_environments=16), streaming(), groups=8)
    assert len(groups) == 8
    assert census.peak == 16
    assert census.alive == 0  # every environment closed when the stream has closed


async def test_environment_concurrency_alone_does_not_bound_live_environments(
    autojump_clock: trio.testing.MockClock,
) -> None:
    census = Census()
    await take(agent(census, environment_concurrency=4), streaming(), groups=8)
    assert census.peak > 16


async def test_waiting_for_a_live_environment_does_not_count_against_step_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    census = Census()
    fields = {"live_environments": 1, "step_timeout": 0.5}
    request = streaming(num_groups=1, rollouts_per_group=8, streaming=False)
    (group,) = await take(agent(census, **fields), request, groups=1)
    assert len(group) == 8  # 8 episodes one after the other: several seconds of waiting
    assert census.peak == 1


def test_live_environments_is_checked_at_construction() -> None:
    with pytest.raises(ValueError, match="live_environments"):
        agent(Census(), live_environments=0)


# --------------------------------------------------------------------------- one bug, one exception


@pytest.mark.parametrize("seed", range(5))
async def test_a_bug_in_every_episode_is_one_exception_of_its_type(
    seed: int, autojump_clock: trio.testing.MockClock
) -> None:
    # Every episode's step raises at the same turn: the same instant for all of them.
    census = Census()
    request = streaming(inference_interface=backend("a", "b", first_token=0.0))
    with pytest.raises(KeyError, match="the tool crashed") as info:
        await take(agent(census, fail="step"), request, groups=1)
    notes = info.value.__notes__
    assert any(
        re.fullmatch(r"in episode \d of 4 of problem 'p\d+', turn 2, in step\(\)", n) for n in notes
    ), notes
    assert census.alive == 0


async def test_a_failing_reset_in_every_episode_is_one_exception(
    autojump_clock: trio.testing.MockClock,
) -> None:
    census = Census()
    with pytest.raises(LookupError, match="image is missing") as info:
        await take(agent(census, fail="reset"), streaming(), groups=1)
    notes = info.value.__notes__
    assert any(
        re.fullmatch(r"in episode \d of 4 of problem 'p\d+', in reset\(\)", n) for n in notes
    )
    assert any(re.match(r"\d+ other failure\(s\) at the same time: LookupError", n) for n in notes)
    assert census.alive == 0


def test_under_the_sync_bridge_one_bug_is_one_exception() -> None:
    census = Census()
    a = agent(census, fail="step")
    request = streaming(inference_interface=backend("a", "b", first_token=0.0))
    with (
        pytest.raises(KeyError, match="the tool crashed"),
        tr.blocking_grouped_rollouts(a, request) as stream,
    ):
        stream.take(1, timeout=30)
    assert census.alive == 0


async def test_the_failure_policy_classifies_a_group_by_all_its_failures(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # One episode's step times out (transient), the others raise KeyError at the same
    # instant: the group is not transient, so it is not retried.
    class Mixed(Sandbox):
        transient = False

        async def step(self, turn: AssistantTurn) -> EnvironmentStep:
            await trio.sleep(0.1)
            if self.transient:
                raise tr.StepTimeoutError("too slow")
            raise KeyError("the tool crashed")

    def make(problem: Problem) -> Mixed:
        env = Mixed(problem, census)
        env.transient = census.made % 4 == 1  # one episode of each group of 4
        return env

    census = Census()
    mixed = MultiTurnAgent(
        environment=make,
        renderer=R,
        prompts=PromptSource(PROBLEMS, seed=0),
        failure_policy=tr.FailurePolicy(max_attempts=3),
        parallel_generation_tasks=1,  # one group at a time: episodes 1 to 4, 1 transient
    )
    request = streaming(inference_interface=backend("a", first_token=0.0), num_groups=1)
    with pytest.raises((KeyError, tr.StepTimeoutError)) as info:
        async with mixed.get_grouped_rollouts(request) as stream:
            await stream.receive()
    assert stream.statistics().retries == 0
    kinds = {type(leaf) for leaf in real_leaves(info.value)}
    assert kinds == {KeyError, tr.StepTimeoutError}


# --------------------------------------------------------------------------- loud misuse


def test_an_assistant_message_in_a_step_is_refused() -> None:
    with pytest.raises(ValueError, match=r"messages\[1\] is an assistant message"):
        EnvironmentStep(
            messages=[
                ChatMessage(role="tool", content="4"),
                ChatMessage(role="assistant", content="x"),
            ],
            done=True,
            reward=1.0,
        )


def test_a_dict_message_points_at_chat_message() -> None:
    with pytest.raises(
        TypeError, match=r"messages\[0\] must be a ChatMessage, got dict .*ChatMessage\(role="
    ):
        EnvironmentStep(messages=[{"role": "tool", "content": "4"}])  # type: ignore[list-item]


def test_info_must_be_json_ready() -> None:
    with pytest.raises(TypeError, match="info must be JSON-ready"):
        EnvironmentStep(info={"when": object()})
    with pytest.raises(TypeError, match="info must be a dict with str keys"):
        EnvironmentStep(info={1: "x"})  # type: ignore[dict-item]


async def test_max_episode_tokens_at_or_below_the_first_render_is_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    first = len(R.render([ChatMessage(role="user", content="question 10")]))  # p10 to p63
    a = agent(Census(), max_episode_tokens=first)
    request = streaming(num_groups=1, rollouts_per_group=1, streaming=False)
    with pytest.raises(
        ValueError, match=rf"max_episode_tokens={first} leaves no room .* is {first} ids"
    ):
        await take(a, request, groups=1)


def test_a_renderer_class_is_refused_at_construction() -> None:
    with pytest.raises(
        TypeError, match=r"got the class PlainRenderer: call it \(PlainRenderer\(...\)\)"
    ):
        MultiTurnAgent(
            environment=lambda problem: Sandbox(problem, Census()),
            renderer=PlainRenderer,  # type: ignore[arg-type]
            prompts=PromptSource(PROBLEMS),
        )


# --------------------------------------------------------------------------- the per-turn record


async def test_the_per_turn_record_keeps_spans_rewards_and_info(
    autojump_clock: trio.testing.MockClock,
) -> None:
    census = Census()
    request = streaming(num_groups=1, rollouts_per_group=1, streaming=False)
    ((rollout,),) = await take(agent(census), request, groups=1)
    assert isinstance(rollout, TokenRollout)
    episode = rollout.extra["episode"]
    assert episode["tool_calls"] == 0  # a count
    first, second = episode["per_turn"]
    assert (first["reward"], first["info"]) == (0.25, {"tests_passed": 3, "log": ["ok"]})
    assert (second["reward"], second["info"]) == (None, {"exit_code": 0})  # done: the rollout's
    assert rollout.reward == 1.0
    ids = rollout.trajectory[0]
    assert [R.decode(ids[t["start"] : t["end"]]) for t in (first, second)] == ["a", "b"]
    assert [t["finish_reason"] for t in (first, second)] == ["stop", "stop"]
    # It survives JSONL.
    (back,) = tr.load_jsonl(io.StringIO(json.dumps(tr.unstructure(rollout)) + "\n"), TokenRollout)
    assert back.extra["episode"]["per_turn"] == episode["per_turn"]


async def test_each_tool_call_is_kept_with_its_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    calls = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 1"}}</tool_call>'
        "<tool_call>{'name': 'calculator'}</tool_call>"
    )
    census = Census()
    request = streaming(
        num_groups=1, rollouts_per_group=1, streaming=False, inference_interface=backend(calls, "b")
    )
    ((rollout,),) = await take(agent(census), request, groups=1)
    assert isinstance(rollout, TokenRollout)
    (first, _) = rollout.extra["episode"]["per_turn"]
    good, bad = first["tool_calls"]
    assert good == {
        "id": "call_1_0",
        "name": "calculator",
        "arguments": {"expression": "1 + 1"},
        "error": None,
    }
    assert bad["id"] == "call_1_1"
    assert bad["arguments"] is None
    assert bad["error"].startswith("not JSON")
