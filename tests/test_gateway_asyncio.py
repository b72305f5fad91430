"""``GatewayAgent`` members written for asyncio: run in an asyncio loop of their own on a
worker thread (``asyncio=True``, or detected from their code), token-exact as the Trio
route, and cancellation-correct: cancelling a member cancels its asyncio task and waits
for its loop to close, so no tool of a cancelled member runs on afterwards; a sync tool
that blocks the loop past ``asyncio_cancel_timeout`` is reported.

Everything runs for real (a gateway on a loopback socket, the ``openai`` SDK, the OpenAI
Agents SDK when installed) on the embedded backend with a scripted policy. Nothing sleeps
and hopes: a tool cancels the member itself, from its thread, at the point the test is
about (``trio.from_thread.run_sync(scope.cancel, trio_token=...)``), and what ran is
read from an ordered log.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import re
import threading
import time
from typing import Any

import openai
import pytest
import trio

import trio_rollouts as tr
from trio_rollouts import ChatMessage, GroupedRolloutRequest, PlainRenderer, Problem, PromptSource
from trio_rollouts.envs import calculate
from trio_rollouts.gateway import GatewayAgent
from trio_rollouts.gateway._agent import ASYNCIO_CANCEL_TIMEOUT, AsyncioCancelTimeoutError
from trio_rollouts.gateway._asyncio import run_in_asyncio, written_for_asyncio
from trio_rollouts.inference import EmbeddedInference, LatencyModel

SECONDS = 60
PROBLEM = Problem(problem_id="p0", prompt="What is 6 * 7?", answer=42)
PROBLEMS = [
    Problem(problem_id=f"p{a}x{b}", prompt=f"What is {a} * {b}?", answer=a * b)
    for a, b in [(6, 7), (3, 4)]
]
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression such as '17 * (3 + 4)'.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def policy(messages: list[ChatMessage]) -> tuple[list[str], list[float]]:
    """Call the calculator on the user's expression; after a tool message, answer it."""
    if messages[-1].role == "tool":
        return [f"The answer is {messages[-1].content}."], [1.0]
    user = next(m.content for m in messages if m.role == "user")
    expression = user.removeprefix("What is ").removesuffix("?")
    body = {"name": "calculator", "arguments": {"expression": expression}}
    return [f"<tool_call>{json.dumps(body)}</tool_call>"], [1.0]


def request(group: int = 2, groups: int = 1, **changes: Any) -> GroupedRolloutRequest:
    inference = EmbeddedInference(policy=policy, seed=0, latency=LatencyModel(first_token=0.0))
    return GroupedRolloutRequest(
        num_groups=groups, rollouts_per_group=group, inference_interface=inference, **changes
    )


def prompts(*problems: Problem) -> PromptSource:
    return PromptSource(list(problems or [PROBLEM]), seed=0)


async def tool_loop(client: openai.AsyncOpenAI, problem: Problem) -> float:
    """An unmodified tool loop on ``openai.AsyncOpenAI``, on whatever loop runs it."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": problem.prompt}]
    for _ in range(4):
        completion = await client.chat.completions.create(
            model="any", messages=messages, tools=[CALCULATOR]
        )
        message = completion.choices[0].message
        messages.append(message.model_dump(include={"role", "content", "tool_calls"}))
        if not message.tool_calls:
            numbers = re.findall(r"-?\d+", message.content or "")
            return float(bool(numbers) and int(numbers[-1]) == problem.answer)
        for call in message.tool_calls:
            expression = json.loads(call.function.arguments)["expression"]
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": str(calculate(expression))}
            )
    return 0.0


async def trio_agent(base_url: str, problem: Problem) -> float:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        return await tool_loop(client, problem)


#: Where each asyncio member ran: (its thread, the main thread).
THREADS: list[tuple[threading.Thread, threading.Thread]] = []


async def asyncio_agent(base_url: str, problem: Problem) -> float:
    """The same agent, written for asyncio: its calculator runs as an asyncio task."""
    asyncio.get_running_loop()  # raises outside an asyncio loop
    THREADS.append((threading.current_thread(), threading.main_thread()))
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        return await asyncio.create_task(tool_loop(client, problem))


async def one_call(base_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "What is 2 * 3?"}]
        )


# --------------------------------------------------------------------------- detection


async def uses_asyncio(base_url: str, problem: Problem) -> float:
    await asyncio.sleep(0)
    return 1.0


async def uses_trio(base_url: str, problem: Problem) -> float:
    await trio.lowlevel.checkpoint()
    return 1.0


async def imports_asyncio(base_url: str, problem: Problem) -> float:
    import asyncio as aio

    await aio.sleep(0)
    return 1.0


async def gathers(base_url: str, problem: Problem) -> float:
    from asyncio import gather

    await gather(uses_asyncio(base_url, problem))
    return 1.0


async def calls_an_asyncio_helper(base_url: str, problem: Problem) -> float:
    return await uses_asyncio(base_url, problem)


async def nests_asyncio(base_url: str, problem: Problem) -> float:
    async def inner() -> None:
        await asyncio.sleep(0)

    await inner()
    return 1.0


async def uses_both(base_url: str, problem: Problem) -> float:
    await asyncio.sleep(0)
    await trio.lowlevel.checkpoint()
    return 1.0


class CallableAgent:
    async def __call__(self, base_url: str, problem: Problem) -> float:
        await asyncio.sleep(0)
        return 1.0


@pytest.mark.parametrize(
    ("function", "expected"),
    [
        (uses_asyncio, True),
        (imports_asyncio, True),
        (gathers, True),
        (calls_an_asyncio_helper, True),
        (nests_asyncio, True),
        (functools.partial(uses_asyncio, "url"), True),
        (CallableAgent(), True),
        (CallableAgent().__call__, True),
        (asyncio_agent, True),
        (uses_trio, False),
        (trio_agent, False),
        (one_call, False),
        (len, False),
    ],
)
def test_a_function_is_asyncio_when_its_code_uses_asyncio_and_not_trio(
    function: Any, expected: bool
) -> None:
    assert written_for_asyncio(function) is expected


def test_a_function_that_uses_both_must_say_which_naming_it() -> None:
    with pytest.raises(ValueError, match=r"function <function uses_both .* asyncio=True .*False"):
        GatewayAgent(function=uses_both, renderer=PlainRenderer(), prompts=prompts())
    for choice in (True, False):  # said: no detection
        GatewayAgent(
            function=uses_both, renderer=PlainRenderer(), prompts=prompts(), asyncio=choice
        )


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"function": trio_agent, "asyncio": 1}, TypeError, r"asyncio must be True .* got 1"),
        ({"command": "true", "asyncio": True}, ValueError, r"asyncio=True says how a function"),
        ({"command": "true", "asyncio": False}, ValueError, r"asyncio=False says how a function"),
        (
            {"function": trio_agent, "asyncio_cancel_timeout": 0},
            ValueError,
            r"asyncio_cancel_timeout",
        ),
        (
            {"function": trio_agent, "asyncio_cancel_timeout": None},
            TypeError,
            r"asyncio_cancel_timeout",
        ),
    ],
)
def test_construction_errors_name_the_field_and_value(
    changes: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        GatewayAgent(renderer=PlainRenderer(), prompts=prompts(), **changes)


def test_the_default_cancel_timeout_is_a_few_seconds() -> None:
    agent = GatewayAgent(function=trio_agent, renderer=PlainRenderer(), prompts=prompts())
    assert agent.asyncio is None
    assert agent.asyncio_cancel_timeout == ASYNCIO_CANCEL_TIMEOUT == 5.0


# --------------------------------------------------------------------------- the route


async def test_an_asyncio_function_gives_exactly_the_tokens_of_the_trio_route() -> None:
    THREADS.clear()
    on_trio = GatewayAgent(function=trio_agent, renderer=PlainRenderer(), prompts=prompts())
    on_asyncio = GatewayAgent(function=asyncio_agent, renderer=PlainRenderer(), prompts=prompts())
    with trio.fail_after(SECONDS):
        expected = await on_trio.group_rollout(request(group=3, seed=7))
        rollouts = await on_asyncio.group_rollout(request(group=3, seed=7))
    # Detected: each member ran in an asyncio loop of its own, off the Trio thread.
    assert len(THREADS) == 3
    assert all(thread is not main for thread, main in THREADS)
    for got, want in zip(rollouts, expected, strict=True):
        assert got.reward == want.reward == 1.0
        assert got.fidelity == want.fidelity == "exact"
        assert got.trajectory == want.trajectory
        assert got.generation_mask == want.generation_mask
        assert got.logprobs == want.logprobs
        gateway = got.extra["gateway"]
        assert (gateway["calls"], gateway["tool_calls"], gateway["breaks"]) == (2, 1, 0)


async def test_asyncio_true_runs_a_function_without_asyncio_in_its_code_on_asyncio() -> None:
    threads: list[str] = []

    async def member(base_url: str, problem: Problem) -> float:
        threads.append(threading.current_thread().name)
        return await trio_agent(base_url, problem)

    assert not written_for_asyncio(member)
    agent = GatewayAgent(function=member, renderer=PlainRenderer(), prompts=prompts(), asyncio=True)
    with trio.fail_after(SECONDS):
        [rollout] = await agent.group_rollout(request(group=1))
    assert rollout.reward == 1.0
    assert threads == ["trio_rollouts asyncio member 0 of 'p0'"]  # a worker thread


async def test_asyncio_false_runs_it_in_trio_and_the_error_says_to_pass_asyncio_true() -> None:
    agent = GatewayAgent(
        function=asyncio_agent, renderer=PlainRenderer(), prompts=prompts(), asyncio=False
    )
    with trio.fail_after(SECONDS), pytest.raises(RuntimeError, match="no running event loop") as e:
        await agent.group_rollout(request(group=1))
    hint, where = e.value.__notes__
    assert "pass asyncio=True" in hint
    assert where == "in member 0 of 1 of problem 'p0', in its function"


async def test_an_asyncio_members_error_is_raised_as_itself_with_its_note() -> None:
    class Boom(Exception):
        pass

    async def member(base_url: str, problem: Problem) -> float:
        await one_call(base_url)
        await asyncio.sleep(0)
        raise Boom(problem.problem_id)

    agent = GatewayAgent(function=member, renderer=PlainRenderer(), prompts=prompts())
    with trio.fail_after(SECONDS), pytest.raises(Boom, match="p0") as caught:
        await agent.group_rollout(request(group=1))
    assert caught.value.__notes__ == [
        "in member 0 of 1 of problem 'p0', in its function (on asyncio)"
    ]


async def test_a_sync_function_on_asyncio_is_a_type_error() -> None:
    agent = GatewayAgent(
        function=lambda base_url, problem: 1.0,  # type: ignore[arg-type,return-value]
        renderer=PlainRenderer(),
        prompts=prompts(),
        asyncio=True,
    )
    with pytest.raises(TypeError, match=r"must be an async function .* returned a float"):
        await agent.group_rollout(request(group=1))


async def test_a_task_cancelled_by_asyncio_itself_is_a_runtime_error() -> None:
    async def cancels_itself() -> float:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(0)
        return 1.0  # pragma: no cover

    with pytest.raises(RuntimeError, match="cancelled, and not by Trio"):
        await run_in_asyncio(cancels_itself, cancel_timeout=5, name="self-cancelling")


@pytest.mark.skipif(
    importlib.util.find_spec("agents") is None,
    reason="the OpenAI Agents SDK is not installed (pip install openai-agents)",
)
async def test_an_openai_agents_sdk_runner_in_process() -> None:
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression such as '17 * 3'.

        Args:
            expression: the expression.
        """
        return str(calculate(expression))

    # The user's code, as it runs under asyncio.run. The client is closed before the
    # member returns: its loop closes then, and a client left open leaks its sockets.
    async def member(base_url: str, problem: Problem) -> float:
        set_tracing_disabled(True)
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            agent = Agent(
                name="calculator agent",
                tools=[calculator],
                model=OpenAIChatCompletionsModel(model="trio-rollouts", openai_client=client),
            )
            result = await Runner.run(agent, str(problem.prompt), max_turns=4)
        return float(str(problem.answer) in str(result.final_output))

    agent = GatewayAgent(function=member, renderer=PlainRenderer(), prompts=prompts(), asyncio=True)
    with trio.fail_after(SECONDS):
        rollouts = await agent.group_rollout(request(group=2))
    for rollout in rollouts:
        assert rollout.reward == 1.0
        assert rollout.fidelity == "exact"
        gateway = rollout.extra["gateway"]
        assert (gateway["calls"], gateway["tool_calls"], gateway["breaks"]) == (2, 1, 0)


# --------------------------------------------------------------------------- cancellation


async def test_cancelling_a_member_cancels_its_asyncio_tool_and_waits_for_it() -> None:
    log: list[str] = []
    loops: list[asyncio.AbstractEventLoop] = []
    token = trio.lowlevel.current_trio_token()
    scope = trio.CancelScope()

    async def tool() -> str:
        log.append("tool started")
        try:
            # The member is cancelled from here, so the tool is surely asleep when it is.
            trio.from_thread.run_sync(scope.cancel, trio_token=token)
            await asyncio.sleep(3600)
            log.append("tool continued")
            return "done"
        finally:
            log.append("tool's finally")
            await asyncio.shield(asyncio.sleep(0.01))  # cleanup that awaits: waited for
            log.append("tool's cleanup ended")

    async def member(base_url: str, problem: Problem) -> float:
        loops.append(asyncio.get_running_loop())
        await one_call(base_url)
        await asyncio.create_task(tool())
        log.append("member continued")
        return 1.0

    # It uses trio (from_thread) too: it says it is written for asyncio.
    agent = GatewayAgent(function=member, renderer=PlainRenderer(), prompts=prompts(), asyncio=True)
    with trio.fail_after(SECONDS):
        with scope:
            await agent.group_rollout(request(group=1))
        log.append("group returned")
    assert scope.cancelled_caught
    assert log == ["tool started", "tool's finally", "tool's cleanup ended", "group returned"]
    [loop] = loops
    assert loop.is_closed()  # nothing of the member can run any more


async def test_a_cancelled_members_executor_threads_are_waited_for() -> None:
    log: list[str] = []
    token = trio.lowlevel.current_trio_token()
    scope = trio.CancelScope()

    def blocking_tool() -> None:  # in the loop's default executor
        trio.from_thread.run_sync(scope.cancel, trio_token=token)
        time.sleep(0.05)  # the task is cancelled meanwhile; this thread goes on
        log.append("executor tool ended")

    async def member(base_url: str, problem: Problem) -> float:
        await one_call(base_url)
        await asyncio.to_thread(blocking_tool)
        log.append("member continued")  # pragma: no cover
        return 1.0  # pragma: no cover

    agent = GatewayAgent(function=member, renderer=PlainRenderer(), prompts=prompts(), asyncio=True)
    with trio.fail_after(SECONDS):
        with scope:
            await agent.group_rollout(request(group=1))
        log.append("group returned")
    assert scope.cancelled_caught
    assert log == ["executor tool ended", "group returned"]


async def test_a_failing_sibling_cancels_an_asyncio_member_and_waits_for_its_tool() -> None:
    log: list[str] = []
    in_tool = threading.Event()
    lock = threading.Lock()
    arrived: list[str] = []

    class Boom(Exception):
        pass

    async def member(base_url: str, problem: Problem) -> float:
        await one_call(base_url)
        with lock:
            arrived.append(base_url)
            first = len(arrived) == 1
        if first:
            # Fail once the other member is in its tool.
            await asyncio.get_running_loop().run_in_executor(None, in_tool.wait, SECONDS)
            raise Boom("the first member broke")
        try:
            in_tool.set()
            await asyncio.sleep(3600)
            log.append("tool continued")
        finally:
            log.append("tool's finally")
        return 1.0

    agent = GatewayAgent(function=member, renderer=PlainRenderer(), prompts=prompts())
    with trio.fail_after(SECONDS), pytest.raises(Boom) as caught:
        await agent.group_rollout(request(group=2))
    log.append("group raised")
    assert re.fullmatch(
        r"in member [01] of 2 of problem 'p0', in its function \(on asyncio\)",
        caught.value.__notes__[0],
    )
    assert log == ["tool's finally", "group raised"]


async def test_closing_the_stream_cancels_every_asyncio_member_and_waits_for_them() -> None:
    log: list[str] = []
    token = trio.lowlevel.current_trio_token()
    in_tools = trio.Semaphore(0)

    async def member(base_url: str, problem: Problem) -> float:
        await one_call(base_url)
        try:
            trio.from_thread.run_sync(in_tools.release, trio_token=token)
            await asyncio.sleep(3600)
            log.append("tool continued")
        finally:
            log.append("tool's finally")
        return 1.0

    agent = GatewayAgent(
        function=member,
        renderer=PlainRenderer(),
        prompts=prompts(*PROBLEMS),
        asyncio=True,
        parallel_generation_tasks=2,  # one batch: two groups, four members
    )
    with trio.fail_after(SECONDS):
        async with agent.get_grouped_rollouts(request(group=2, groups=2, streaming=True)):
            for _ in range(4):
                await in_tools.acquire()
        log.append("stream left")
    assert log == ["tool's finally"] * 4 + ["stream left"]


async def test_a_sync_tool_blocking_past_the_bound_is_reported_and_its_thread_abandoned() -> None:
    log: list[str] = []
    token = trio.lowlevel.current_trio_token()
    scope = trio.CancelScope()
    woke = threading.Event()
    bound, block = 0.2, 2.0

    def blocking_tool() -> None:
        trio.from_thread.run_sync(scope.cancel, trio_token=token)
        time.sleep(block)  # a sync tool: it blocks the loop and cannot be cancelled
        log.append("tool woke")
        woke.set()

    async def member(base_url: str, problem: Problem) -> float:
        await one_call(base_url)
        blocking_tool()
        await asyncio.sleep(0)  # cancelled here, when the loop runs again
        log.append("member continued")  # pragma: no cover
        return 1.0  # pragma: no cover

    agent = GatewayAgent(
        function=member,
        renderer=PlainRenderer(),
        prompts=prompts(),
        asyncio=True,
        asyncio_cancel_timeout=bound,
    )
    with trio.fail_after(SECONDS):
        with scope, pytest.raises(AsyncioCancelTimeoutError) as caught:
            await agent.group_rollout(request(group=1))
        log.append("group raised")
        # The abandoned thread, left to itself, goes on: what the report warned of.
        await trio.to_thread.run_sync(woke.wait, SECONDS)
    message = str(caught.value)
    assert "ignored cancellation" in message
    assert f"{bound} s after its task was cancelled" in message
    assert "trio_rollouts asyncio member 0 of 'p0'" in message
    assert "in blocking_tool" in message
    assert "time.sleep(block)" in message  # where the thread was stuck
    assert caught.value.__notes__ == [
        "in member 0 of 1 of problem 'p0', in its function (on asyncio)"
    ]
    assert log == ["group raised", "tool woke"]
    assert isinstance(caught.value, RuntimeError)
    assert not isinstance(caught.value, tr.StepTimeoutError)  # not transient
