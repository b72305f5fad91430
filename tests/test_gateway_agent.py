"""``GatewayAgent``: agents the library did not write (an async function with the OpenAI
SDK, a command such as ``examples/gateway/agent.py``, an OpenAI Agents SDK script) run
behind the gateway, one session per member, and give token-exact rollouts.

Everything runs for real: a gateway on a loopback socket, the ``openai`` SDK, commands as
subprocesses, on the real clock, each test bounded by ``trio.fail_after``. The model is
the embedded backend with a scripted policy (call the calculator, then answer its
result), so every rollout is known to the id. Nothing waits a fixed time and hopes:
where a test waits, it waits for a condition (a pid file written, a pid gone).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import trio

import trio_rollouts as tr
from trio_rollouts import ChatMessage, GroupedRolloutRequest, PlainRenderer, Problem, PromptSource
from trio_rollouts.envs import calculate
from trio_rollouts.gateway import (
    AgentCommandError,
    CommandTimeoutError,
    GatewayAgent,
    _agent,
    _command,
)
from trio_rollouts.gateway._command import (
    KILL_GRACE,
    OUTPUT_LIMIT,
    problem_json,
    reward_from_stdout,
)
from trio_rollouts.inference import EmbeddedInference, LatencyModel
from trio_rollouts.testing import NullInference

ROOT = Path(__file__).resolve().parent.parent
AGENT_SCRIPT = ROOT / "examples" / "gateway" / "agent.py"
AGENTS_SDK_SCRIPT = ROOT / "examples" / "gateway" / "agents_sdk_agent.py"
#: Generous bounds: real subprocesses (a Python start and the openai import, ~0.5 s
#: each) on two cores.
SECONDS = 60

PROBLEM = Problem(problem_id="p0", prompt="What is 6 * 7?", answer=42)
PROBLEMS = [
    Problem(problem_id=f"p{a}x{b}", prompt=f"What is {a} * {b}?", answer=a * b)
    for a, b in [(6, 7), (3, 4), (12, 12), (9, 8)]
]
#: The tool of ``examples/gateway/agent.py``, so that both render the same ids.
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


def expression_of(messages: list[ChatMessage]) -> str:
    user = next(m.content for m in messages if m.role == "user")
    return user.removeprefix("What is ").removesuffix("?")


def call_text(expression: str) -> str:
    body = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(body)}</tool_call>"


def answer_text(result: str) -> str:
    return f"The answer is {result}."


def policy(messages: list[ChatMessage]) -> tuple[list[str], list[float]]:
    """Call the calculator on the user's expression; after a tool message, answer it."""
    if messages[-1].role == "tool":
        return [answer_text(messages[-1].content)], [1.0]
    return [call_text(expression_of(messages))], [1.0]


def model() -> EmbeddedInference:
    return EmbeddedInference(policy=policy, seed=0, latency=LatencyModel(first_token=0.0))


def request(group: int = 2, groups: int = 1, **changes: Any) -> GroupedRolloutRequest:
    return GroupedRolloutRequest(
        num_groups=groups, rollouts_per_group=group, inference_interface=model(), **changes
    )


def prompts(*problems: Problem) -> PromptSource:
    return PromptSource(list(problems or [PROBLEM]), seed=0)


def sampled_text(rollout: tr.TokenRollout) -> str:
    """The sampled ids of a rollout (mask 1), as text (the plain renderer's ids are code
    points)."""
    masks = rollout.generation_mask or []
    return "".join(
        chr(i)
        for ids, mask in zip(rollout.trajectory, masks, strict=True)
        for i, m in zip(ids, mask, strict=True)
        if m
    )


def expected_sampled(problem: Problem) -> str:
    expression = str(problem.prompt).removeprefix("What is ").removesuffix("?")
    return call_text(expression) + answer_text(str(calculate(expression)))


async def openai_agent(base_url: str, problem: Problem, api_key: str = "unused") -> float:
    """An unmodified tool loop on ``openai.AsyncOpenAI`` (which runs on Trio)."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
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
                result = str(calculate(expression))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0


def python(source: str) -> list[str]:
    """A command running ``source`` (dedented) with this interpreter."""
    return [sys.executable, "-c", textwrap.dedent(source)]


#: A command's prelude: one chat call to its session with the standard library only
#: (a Python start without the openai import), so a member makes its call fast.
ONE_CALL = """
    import json, os, urllib.request
    def one_call():
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "What is 2 * 3?"}]})
        call = urllib.request.Request(
            os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body.encode(),
            headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                     "Content-Type": "application/json"})
        with urllib.request.urlopen(call) as reply:
            return json.load(reply)
"""


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


async def gone(*pids: int) -> None:
    """Return once every pid has exited: a pidfd becomes readable when its process exits
    (SIGKILL is delivered asynchronously, so a killed pid may live a moment longer)."""
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            await trio.lowlevel.wait_readable(fd)
        finally:
            os.close(fd)
    assert not any(alive(pid) for pid in pids)


class PidPipe:
    """A FIFO that commands write pid lines to, read as they come (no polling)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "pids"
        os.mkfifo(self.path)
        self._stream = trio.lowlevel.FdStream(os.open(self.path, os.O_RDONLY | os.O_NONBLOCK))
        # A writer of our own: without one, a read before a command opens the FIFO is EOF.
        self._writer = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        self._buffer = b""

    async def lines(self, count: int) -> list[list[int]]:
        """The next ``count`` lines, each a list of pids."""
        while self._buffer.count(b"\n") < count:
            self._buffer += await self._stream.receive_some()
        *lines, self._buffer = self._buffer.split(b"\n", count)
        return [[int(pid) for pid in line.split()] for line in lines]

    async def aclose(self) -> None:
        os.close(self._writer)
        await self._stream.aclose()


@pytest.fixture
async def pid_pipe(tmp_path: Path) -> AsyncIterator[PidPipe]:
    pipe = PidPipe(tmp_path)
    try:
        yield pipe
    finally:
        await pipe.aclose()


def spawner(pipe: PidPipe, *, then: str, ignore_sigterm: bool = False) -> list[str]:
    """A command that starts a grandchild which ignores SIGTERM and sleeps (sharing the
    command's stderr), makes one call to its session, ignores SIGTERM itself
    when told, writes ``"<own pid> <grandchild pid>"`` to ``pipe``, then runs ``then``."""
    source = (
        ONE_CALL
        + f"""
    import signal, subprocess, sys, time
    grandchild = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(1000)"], stdout=subprocess.PIPE)
    grandchild.stdout.readline()  # its SIGTERM handler is set
    one_call()
    if {ignore_sigterm!r}:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open({str(pipe.path)!r}, "w") as f:
        f.write(f"{{os.getpid()}} {{grandchild.pid}}\\n")
    {then}
    """
    )
    return python(source)


# --------------------------------------------------------------------------- construction


def test_exactly_one_of_function_and_command() -> None:
    with pytest.raises(ValueError, match=r"exactly one of function= .* and command=.*neither"):
        GatewayAgent(renderer=PlainRenderer(), prompts=prompts())
    with pytest.raises(ValueError, match=r"exactly one .*both was given"):
        GatewayAgent(
            renderer=PlainRenderer(), prompts=prompts(), function=openai_agent, command="true"
        )


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"command": 42}, TypeError, r"command must be a list of arguments .* got 42"),
        ({"command": b"agent"}, TypeError, r"command must be a list of arguments"),
        ({"command": ["python", 3]}, TypeError, r"command\[1\] must be a str .* got 3"),
        ({"command": []}, ValueError, r"command must name a program, got \[\]"),
        ({"command": "   "}, ValueError, r"command must name a program"),
        ({"command": "agent 'unclosed"}, ValueError, r"cannot be split with shlex.split"),
        (
            {"command": "true", "env": {"OPENAI_BASE_URL": "x"}},
            ValueError,
            r"env may not set OPENAI_BASE_URL",
        ),
        ({"command": "true", "env": {"A": 1}}, TypeError, r"env must map str to str, got 'A': 1"),
        ({"command": "true", "env": ["A"]}, TypeError, r"env must be a mapping"),
        ({"command": "true", "command_timeout": 0}, ValueError, r"command_timeout must be > 0"),
        (
            {"function": openai_agent, "command_timeout": 5},
            ValueError,
            r"command_timeout=5 bounds a command",
        ),
        (
            {"function": openai_agent, "env": {"A": "b"}},
            ValueError,
            r"env=.* is a command's environment",
        ),
        ({"function": "agent"}, TypeError, r"function must be an async function .* got 'agent'"),
        (
            {"command": "true", "reward_fn": 1.0},
            TypeError,
            r"reward_fn must be a function .* got 1.0",
        ),
        (
            {"command": "true", "renderer": PlainRenderer},
            TypeError,
            r"renderer must be a Renderer instance",
        ),
        ({"command": "true", "min_fidelity": "best"}, ValueError, r"min_fidelity must be one of"),
        (
            {"command": "true", "on_break": "ignore"},
            ValueError,
            r"on_break must be 'split' or 'raise'",
        ),
        ({"command": "true", "api_key": 1}, TypeError, r"api_key must be a str or None, got 1"),
        (
            {"command": "true", "prompts": None},
            TypeError,
            r"GatewayAgent needs problems: pass prompts=",
        ),
    ],
)
def test_construction_errors_name_the_field_and_value(
    changes: dict[str, Any], error: type[Exception], match: str
) -> None:
    fields: dict[str, Any] = {"renderer": PlainRenderer(), "prompts": prompts(), **changes}
    with pytest.raises(error, match=match):
        GatewayAgent(**fields)


def test_a_command_is_an_argument_list_or_a_string_split_with_shlex() -> None:
    split = GatewayAgent(renderer=PlainRenderer(), prompts=prompts(), command="agent --name 'a b'")
    listed = GatewayAgent(renderer=PlainRenderer(), prompts=prompts(), command=("agent", Path("x")))
    assert split._argv == ("agent", "--name", "a b")
    assert listed._argv == ("agent", "x")


def test_get_problem_may_be_overridden_instead_of_prompts() -> None:
    class Fixed(GatewayAgent):
        async def get_problem(self, request: GroupedRolloutRequest) -> Problem:
            return PROBLEM

    Fixed(renderer=PlainRenderer(), command="true")


# --------------------------------------------------------------------------- rewards


@pytest.mark.parametrize(
    ("stdout", "reward"),
    [
        ('{"reward": 1.0}\n', 1.0),
        ("log line\n0.25\n\n", 0.25),
        ('{"reward": 1}\nnot json\n{"other": 3}\n[1, 2]\n"text"\ntrue\nnull\n', 1.0),
        ('{"reward": 0.5}\n{"reward": 0.75}\n', 0.75),
        ('{"reward": null}\n', None),
        ("no reward here\n", None),
        ("", None),
        ('  {"reward": -2, "turns": 3}  \n', -2.0),
    ],
)
def test_reward_from_stdout_is_its_last_json_reward_line(stdout: str, reward: float | None) -> None:
    assert reward_from_stdout(stdout) == reward


@pytest.mark.parametrize(
    ("stdout", "error", "match"),
    [
        ('{"reward": "high"}', TypeError, r"line '\{\"reward\": \"high\"\}' must be a real number"),
        ('{"reward": true}', TypeError, r"must be a real number"),
        ("NaN", ValueError, r"must be a finite number"),
        ('{"reward": Infinity}', ValueError, r"must be a finite number"),
    ],
)
def test_a_bad_reward_line_is_an_error(stdout: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        reward_from_stdout(stdout)


def test_problem_json() -> None:
    assert json.loads(problem_json(PROBLEM)) == {
        "problem_id": "p0",
        "prompt": "What is 6 * 7?",
        "answer": 42,
    }
    messages = Problem(
        problem_id="m",
        prompt=[
            ChatMessage(role="system", content="Be brief."),
            ChatMessage(role="user", content="Hi", extra={"name": "ann"}),
        ],
        answer=np.int64(3),
    )
    assert json.loads(problem_json(messages)) == {
        "problem_id": "m",
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi", "name": "ann"},
        ],
        "answer": 3,
    }
    no_answer = json.loads(problem_json(Problem(problem_id="n", prompt="x")))
    assert "answer" not in no_answer
    assert json.loads(problem_json(Problem(problem_id="o", prompt="x", answer={1, 2}.__class__)))[
        "answer"
    ] == str(set)


def test_the_output_tail_keeps_the_last_bytes_and_drops_the_cut_line() -> None:
    tail = _command._Tail()
    tail.add(b"x" * (OUTPUT_LIMIT - 3) + b"\nfirst\n")
    tail.add(b'{"reward": 1}\n')
    assert len(tail.data) == OUTPUT_LIMIT
    assert tail.text() == 'first\n{"reward": 1}\n'


# --------------------------------------------------------------------------- functions


def test_the_agent_is_exported() -> None:
    assert tr.GatewayAgent is GatewayAgent is _agent.GatewayAgent


async def test_a_function_member_with_async_openai_gives_token_exact_rollouts() -> None:
    seen: list[str] = []

    async def agent_function(base_url: str, problem: Problem) -> float:
        seen.append(base_url)
        return await openai_agent(base_url, problem, api_key="sekrit")

    agent = GatewayAgent(
        function=agent_function,
        renderer=PlainRenderer(),
        prompts=prompts(),
        env_id="calc",
        api_key="sekrit",
    )
    with trio.fail_after(SECONDS):
        rollouts = await agent.group_rollout(request(group=3))
    assert len(rollouts) == 3
    assert len(set(seen)) == 3  # one session each
    assert all(re.fullmatch(r"http://127\.0\.0\.1:\d+/sessions/[\w-]+/v1", url) for url in seen)
    for rollout in rollouts:
        assert isinstance(rollout, tr.TokenRollout)
        assert rollout.reward == 1.0
        assert rollout.problem_id == "p0"
        assert rollout.env_id == "calc"
        assert rollout.fidelity == "exact"
        assert len(rollout.trajectory) == 1  # no break: one element
        gateway = rollout.extra["gateway"]
        assert (gateway["calls"], gateway["tool_calls"], gateway["breaks"]) == (2, 1, 0)
        # The ids the model sampled, verbatim, and nothing else with mask 1.
        assert sampled_text(rollout) == expected_sampled(PROBLEM)
        text = "".join(map(chr, rollout.trajectory[0]))
        assert text.startswith("<|tools|>\n")
        assert "<|user|>\nWhat is 6 * 7?\n" in text
        assert "<|tool|>\n42\n" in text
        assert rollout.logprobs is not None
        assert len(rollout.logprobs[0]) == len(sampled_text(rollout))


async def test_a_wrong_api_key_fails_the_member_with_a_401() -> None:
    agent = GatewayAgent(
        function=openai_agent, renderer=PlainRenderer(), prompts=prompts(), api_key="sekrit"
    )
    with trio.fail_after(SECONDS), pytest.raises(openai.AuthenticationError) as caught:
        await agent.group_rollout(request(group=1))
    assert "in member 0 of 1 of problem 'p0', in its function" in caught.value.__notes__


async def test_reward_fn_scores_a_member_that_returns_none() -> None:
    calls: list[tuple[Problem, list[ChatMessage]]] = []

    async def no_reward(base_url: str, problem: Problem) -> None:
        await openai_agent(base_url, problem)

    def reward_fn(problem: Problem, messages: list[ChatMessage]) -> float:
        calls.append((problem, messages))
        return 0.5 if messages[-1].content == answer_text("42") else -1.0

    agent = GatewayAgent(
        function=no_reward, renderer=PlainRenderer(), prompts=prompts(), reward_fn=reward_fn
    )
    with trio.fail_after(SECONDS):
        rollouts = await agent.group_rollout(request(group=2))
    assert [r.reward for r in rollouts] == [0.5, 0.5]
    assert len(calls) == 2
    problem, messages = calls[0]
    assert problem == PROBLEM
    # The conversation the session saw, its replies included.
    assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant"]


async def test_reward_fn_may_be_async() -> None:
    async def no_reward(base_url: str, problem: Problem) -> None:
        await openai_agent(base_url, problem)

    async def reward_fn(problem: Problem, messages: list[ChatMessage]) -> float:
        await trio.lowlevel.checkpoint()
        return 0.75

    agent = GatewayAgent(
        function=no_reward, renderer=PlainRenderer(), prompts=prompts(), reward_fn=reward_fn
    )
    with trio.fail_after(SECONDS):
        [rollout] = await agent.group_rollout(request(group=1))
    assert rollout.reward == 0.75


async def test_a_reward_returned_wins_over_reward_fn() -> None:
    agent = GatewayAgent(
        function=openai_agent,
        renderer=PlainRenderer(),
        prompts=prompts(),
        reward_fn=lambda problem, messages: pytest.fail("reward_fn was called"),
    )
    with trio.fail_after(SECONDS):
        rollouts = await agent.group_rollout(request(group=1))
    assert rollouts[0].reward == 1.0


async def test_no_reward_and_no_reward_fn_is_a_value_error_naming_problem_and_member() -> None:
    async def no_reward(base_url: str, problem: Problem) -> None:
        await openai_agent(base_url, problem)

    agent = GatewayAgent(function=no_reward, renderer=PlainRenderer(), prompts=prompts())
    with (
        trio.fail_after(SECONDS),
        pytest.raises(ValueError, match="no reward for problem 'p0'") as caught,
    ):
        await agent.group_rollout(request(group=1))
    assert caught.value.__notes__ == ["in member 0 of 1 of problem 'p0', in reward_fn"]


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (math.nan, ValueError, r"the function's return value must be a finite number .* got nan"),
        (True, TypeError, r"the function's return value must be a real number .* got True"),
        ("1.0", TypeError, r"must be a real number .* got '1.0'"),
    ],
)
async def test_a_bad_reward_is_an_error_naming_problem_and_member(
    value: object, error: type[Exception], match: str
) -> None:
    async def bad(base_url: str, problem: Problem) -> Any:
        await openai_agent(base_url, problem)
        return value

    agent = GatewayAgent(function=bad, renderer=PlainRenderer(), prompts=prompts())
    with trio.fail_after(SECONDS), pytest.raises(error, match=match) as caught:
        await agent.group_rollout(request(group=1))
    assert caught.value.__notes__ == ["in member 0 of 1 of problem 'p0', in its function"]


async def test_numpy_rewards_are_numbers() -> None:
    async def numpy_reward(base_url: str, problem: Problem) -> Any:
        return np.float32(await openai_agent(base_url, problem))

    agent = GatewayAgent(function=numpy_reward, renderer=PlainRenderer(), prompts=prompts())
    with trio.fail_after(SECONDS):
        [rollout] = await agent.group_rollout(request(group=1))
    assert rollout.reward == 1.0


async def test_a_member_that_makes_no_call_fails() -> None:
    async def idle(base_url: str, problem: Problem) -> float:
        await trio.lowlevel.checkpoint()
        return 1.0

    agent = GatewayAgent(function=idle, renderer=PlainRenderer(), prompts=prompts())
    with (
        trio.fail_after(SECONDS),
        pytest.raises(RuntimeError, match="made no call to its session") as caught,
    ):
        await agent.group_rollout(request(group=1))
    assert caught.value.__notes__ == ["in member 0 of 1 of problem 'p0', taking its rollout"]


async def test_a_sync_function_is_a_type_error() -> None:
    agent = GatewayAgent(
        function=lambda base_url, problem: 1.0,  # type: ignore[arg-type,return-value]
        renderer=PlainRenderer(),
        prompts=prompts(),
    )
    with pytest.raises(TypeError, match=r"must be an async function .* returned a float"):
        await agent.group_rollout(request(group=1))


async def test_a_failing_member_cancels_the_group_and_is_raised_as_itself_with_its_note() -> None:
    called: list[str] = []
    cancelled: list[str] = []

    class Boom(Exception):
        pass

    async def member(base_url: str, problem: Problem) -> float:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": problem.prompt}]
            )
            called.append(base_url)
            if len(called) == 1:
                raise Boom("the first member broke")
            try:
                await trio.sleep_forever()
            finally:
                cancelled.append(base_url)
        return 1.0  # pragma: no cover

    agent = GatewayAgent(function=member, renderer=PlainRenderer(), prompts=prompts())
    with trio.fail_after(SECONDS), pytest.raises(Boom) as caught:
        await agent.group_rollout(request(group=3))
    [note] = caught.value.__notes__
    assert re.fullmatch(r"in member [012] of 3 of problem 'p0', in its function", note)
    # Every member that got as far as waiting was cancelled.
    assert cancelled == called[1:]


async def test_a_backend_below_min_fidelity_fails_before_any_member() -> None:
    called: list[str] = []

    async def member(base_url: str, problem: Problem) -> float:  # pragma: no cover
        called.append(base_url)
        return 1.0

    # min_fidelity is "server_tokens" by default, as for MultiTurnAgent; a text-only
    # backend's turns would be retokenized.
    agent = GatewayAgent(function=member, renderer=PlainRenderer(), prompts=prompts())
    text_only = GroupedRolloutRequest(
        num_groups=1, rollouts_per_group=2, inference_interface=NullInference()
    )
    with pytest.raises(tr.TokenFidelityError, match="retokenized"):
        await agent.group_rollout(text_only)
    assert called == []


# --------------------------------------------------------------------------- commands


async def test_the_example_agent_script_as_a_command() -> None:
    agent = GatewayAgent(
        command=[sys.executable, str(AGENT_SCRIPT)],
        renderer=PlainRenderer(),
        prompts=prompts(),
        env_id="calc",
    )
    reference = GatewayAgent(function=openai_agent, renderer=PlainRenderer(), prompts=prompts())
    with trio.fail_after(SECONDS):
        rollouts = await agent.group_rollout(request(group=2))
        [by_function] = await reference.group_rollout(request(group=1))
    for rollout in rollouts:
        assert rollout.reward == 1.0  # printed by the script: {"reward": 1.0}
        assert rollout.fidelity == "exact"
        assert rollout.env_id == "calc"
        gateway = rollout.extra["gateway"]
        assert (gateway["calls"], gateway["tool_calls"], gateway["breaks"]) == (2, 1, 0)
        assert sampled_text(rollout) == expected_sampled(PROBLEM)
        # A command and a function running the same loop give the same ids.
        assert rollout.trajectory == by_function.trajectory
        assert rollout.generation_mask == by_function.generation_mask


async def test_a_command_gets_its_session_the_problem_and_env(tmp_path: Path) -> None:
    record = tmp_path / "seen.json"
    source = (
        ONE_CALL
        + f"""
    import sys
    one_call()
    seen = {{name: os.environ.get(name) for name in
            ("OPENAI_BASE_URL", "OPENAI_API_BASE", "OPENAI_API_KEY", "TRIO_ROLLOUTS_PROBLEM",
             "NO_PROXY", "no_proxy", "EXTRA", "INHERITED")}}
    seen["stdin"] = sys.stdin.read()
    with open({str(record)!r}, "w") as f:
        json.dump(seen, f)
    print("a log line")
    print(json.dumps({{"reward": 0.25}}))
    print("more log, not JSON")
    """
    )
    agent = GatewayAgent(
        command=python(source),
        renderer=PlainRenderer(),
        prompts=prompts(),
        api_key="sekrit",
        env={"EXTRA": "yes"},
    )
    os.environ["INHERITED"] = "from the parent"
    try:
        with trio.fail_after(SECONDS):
            [rollout] = await agent.group_rollout(request(group=1))
    finally:
        del os.environ["INHERITED"]
    assert rollout.reward == 0.25
    seen = json.loads(record.read_text())
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/sessions/[\w-]+/v1", seen["OPENAI_BASE_URL"])
    assert seen["OPENAI_API_BASE"] == seen["OPENAI_BASE_URL"]
    assert seen["OPENAI_API_KEY"] == "sekrit"
    assert json.loads(seen["TRIO_ROLLOUTS_PROBLEM"]) == {
        "problem_id": "p0",
        "prompt": "What is 6 * 7?",
        "answer": 42,
    }
    assert seen["stdin"] == seen["TRIO_ROLLOUTS_PROBLEM"]
    assert "127.0.0.1" in seen["NO_PROXY"].split(",")
    assert "127.0.0.1" in seen["no_proxy"].split(",")
    assert seen["EXTRA"] == "yes"
    assert seen["INHERITED"] == "from the parent"


async def test_a_command_without_a_reward_line_is_scored_by_reward_fn() -> None:
    agent = GatewayAgent(
        command=python(ONE_CALL + "\n    one_call()\n    print('done')\n"),
        renderer=PlainRenderer(),
        prompts=prompts(),
        reward_fn=lambda problem, messages: float(len(messages)),
    )
    with trio.fail_after(SECONDS):
        [rollout] = await agent.group_rollout(request(group=1))
    assert rollout.reward == 2.0  # the user message and the reply


async def test_a_command_without_a_reward_or_reward_fn_is_a_value_error() -> None:
    agent = GatewayAgent(
        command=python(ONE_CALL + "\n    one_call()\n"), renderer=PlainRenderer(), prompts=prompts()
    )
    with (
        trio.fail_after(SECONDS),
        pytest.raises(
            ValueError, match=r"no reward for problem 'p0': its command printed none"
        ) as caught,
    ):
        await agent.group_rollout(request(group=1))
    assert caught.value.__notes__ == ["in member 0 of 1 of problem 'p0', in reward_fn"]


async def test_a_command_that_exits_non_zero_is_an_error_with_its_stderr() -> None:
    source = """
        import sys
        for i in range(30):
            print(f"stderr line {i}", file=sys.stderr)
        print("Traceback: the agent broke", file=sys.stderr)
        sys.exit(3)
    """
    command = python(source)
    agent = GatewayAgent(command=command, renderer=PlainRenderer(), prompts=prompts())
    with trio.fail_after(SECONDS), pytest.raises(AgentCommandError) as caught:
        await agent.group_rollout(request(group=1))
    error = caught.value
    message = str(error)
    assert message.startswith(f"command {shlex.join(command)} exited with status 3; the last lines")
    assert message.endswith("stderr line 29\nTraceback: the agent broke")
    assert "stderr line 10\n" not in message  # the last 20 lines only
    assert error.returncode == 3
    assert error.command == command
    assert "stderr line 0\n" in error.stderr
    [note] = error.__notes__
    assert note == f"in member 0 of 1 of problem 'p0', running its command {shlex.join(command)}"


async def test_a_command_killed_by_a_signal_says_which() -> None:
    agent = GatewayAgent(
        command=python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"),
        renderer=PlainRenderer(),
        prompts=prompts(),
    )
    with (
        trio.fail_after(SECONDS),
        pytest.raises(
            AgentCommandError, match=r"was killed by SIGKILL \(its stderr was empty\)"
        ) as caught,
    ):
        await agent.group_rollout(request(group=1))
    assert caught.value.returncode == -signal.SIGKILL


async def test_a_command_that_does_not_exist_is_raised_as_itself() -> None:
    agent = GatewayAgent(
        command="no-such-agent-command --x", renderer=PlainRenderer(), prompts=prompts()
    )
    with trio.fail_after(SECONDS), pytest.raises(FileNotFoundError) as caught:
        await agent.group_rollout(request(group=1))
    assert caught.value.__notes__ == [
        "in member 0 of 1 of problem 'p0', running its command no-such-agent-command --x"
    ]


async def test_stdout_is_bounded_and_its_last_reward_line_counts() -> None:
    source = (
        ONE_CALL
        + """
    import sys
    one_call()
    sys.stdout.write("0.5\\n" + "x" * (3 * 64 * 1024) + "\\n")
    print(json.dumps({"reward": 0.75}))
    """
    )
    agent = GatewayAgent(command=python(source), renderer=PlainRenderer(), prompts=prompts())
    with trio.fail_after(SECONDS):
        [rollout] = await agent.group_rollout(request(group=1))
    assert rollout.reward == 0.75


# --------------------------------------------------------------------------- no survivors


async def test_cancelling_the_group_kills_the_whole_process_group(pid_pipe: PidPipe) -> None:
    agent = GatewayAgent(
        command=spawner(pid_pipe, then="time.sleep(1000)"),
        renderer=PlainRenderer(),
        prompts=prompts(),
    )
    with trio.fail_after(SECONDS):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(agent.group_rollout, request(group=1))
            [[child, grandchild]] = await pid_pipe.lines(1)
            assert alive(child)
            assert alive(grandchild)
            started = trio.current_time()
            nursery.cancel_scope.cancel()
        # The command died of SIGTERM, and the grandchild, which ignores it, got SIGKILL
        # as soon as the command had exited, not after the grace period.
        assert trio.current_time() - started < KILL_GRACE
        await gone(child, grandchild)


async def test_a_command_that_ignores_sigterm_gets_sigkill_after_the_grace(
    pid_pipe: PidPipe, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_agent, "KILL_GRACE", 0.2)
    agent = GatewayAgent(
        command=spawner(pid_pipe, then="time.sleep(1000)", ignore_sigterm=True),
        renderer=PlainRenderer(),
        prompts=prompts(),
    )
    with trio.fail_after(SECONDS):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(agent.group_rollout, request(group=1))
            [[child, grandchild]] = await pid_pipe.lines(1)
            started = trio.current_time()
            nursery.cancel_scope.cancel()
        assert trio.current_time() - started >= 0.2
        await gone(child, grandchild)


async def test_command_timeout_kills_the_process_group(pid_pipe: PidPipe) -> None:
    agent = GatewayAgent(
        command=spawner(
            pid_pipe, then="print('hanging', file=sys.stderr, flush=True); time.sleep(1000)"
        ),
        renderer=PlainRenderer(),
        prompts=prompts(),
        command_timeout=5,
    )
    errors: list[CommandTimeoutError] = []

    async def group() -> None:
        with pytest.raises(CommandTimeoutError) as caught:
            await agent.group_rollout(request(group=1))
        errors.append(caught.value)

    with trio.fail_after(SECONDS):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(group)
            [[child, grandchild]] = await pid_pipe.lines(1)
        await gone(child, grandchild)
    [error] = errors
    assert isinstance(error, tr.StepTimeoutError)  # transient by default
    message = str(error)
    assert "ran past command_timeout=5 s and was killed with its process group" in message
    assert message.endswith("the last lines of its stderr:\nhanging")
    [note] = error.__notes__
    assert note.startswith("in member 0 of 1 of problem 'p0', running its command")


async def test_what_a_finished_command_left_running_is_killed(pid_pipe: PidPipe) -> None:
    """The grandchild holds the command's stderr open: were it left alive, reading
    stderr to its end would wait for it forever."""
    agent = GatewayAgent(
        command=spawner(pid_pipe, then="print(json.dumps({'reward': 1.0}))"),
        renderer=PlainRenderer(),
        prompts=prompts(),
    )
    with trio.fail_after(SECONDS):
        [rollout] = await agent.group_rollout(request(group=1))
        [[child, grandchild]] = await pid_pipe.lines(1)
        await gone(child, grandchild)
    assert rollout.reward == 1.0


async def test_closing_the_stream_kills_every_member_command(pid_pipe: PidPipe) -> None:
    source = f"""
        import os, time
        with open({str(pid_pipe.path)!r}, "w") as f:
            f.write(f"{{os.getpid()}}\\n")
        time.sleep(1000)
    """
    agent = GatewayAgent(
        command=python(source), renderer=PlainRenderer(), prompts=prompts(*PROBLEMS)
    )
    with trio.fail_after(SECONDS):
        async with agent.get_grouped_rollouts(request(group=2, groups=2, streaming=True)):
            pids = [pid for [pid] in await pid_pipe.lines(4)]
            assert all(alive(pid) for pid in pids)
        await gone(*pids)


# --------------------------------------------------------------------------- the pipeline


async def test_through_the_pipeline() -> None:
    agent = GatewayAgent(
        function=openai_agent, renderer=PlainRenderer(), prompts=prompts(*PROBLEMS), env_id="calc"
    )
    with trio.fail_after(SECONDS):
        async with agent.get_grouped_rollouts(request(group=2, groups=4)) as stream:
            groups = [group async for group in stream]
    assert len(groups) == 4
    assert sorted(group[0].problem_id for group in groups) == sorted(p.problem_id for p in PROBLEMS)
    by_id = {p.problem_id: p for p in PROBLEMS}
    for group in groups:
        assert len(group) == 2
        for rollout in group:
            assert rollout.reward == 1.0
            assert isinstance(rollout, tr.TokenRollout)
            assert sampled_text(rollout) == expected_sampled(by_id[str(rollout.problem_id)])


def test_through_the_sync_bridge_with_command_members() -> None:
    agent = GatewayAgent(
        command=[sys.executable, str(AGENT_SCRIPT)],
        renderer=PlainRenderer(),
        prompts=prompts(*PROBLEMS[:2]),
    )
    with tr.blocking_grouped_rollouts(agent, request(group=2, groups=2)) as stream:
        groups = stream.take(2, timeout=SECONDS)
    assert sorted(group[0].problem_id for group in groups) == sorted(
        p.problem_id for p in PROBLEMS[:2]
    )
    assert [rollout.reward for group in groups for rollout in group] == [1.0] * 4


def test_the_sync_bridge_raises_a_failing_member_with_its_note() -> None:
    agent = GatewayAgent(
        command=python("import sys; sys.exit(7)"), renderer=PlainRenderer(), prompts=prompts()
    )
    with (
        pytest.raises(AgentCommandError, match="exited with status 7") as caught,
        tr.blocking_grouped_rollouts(agent, request(group=1)) as stream,
    ):
        stream.take(1, timeout=SECONDS)
    assert caught.value.__notes__[0].startswith("in member 0 of 1 of problem 'p0'")


def test_the_example_run_script(tmp_path: Path) -> None:
    """``python examples/gateway/run.py`` drives agent.py through the pipeline."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "gateway" / "run.py")],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=SECONDS,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    rows = re.findall(
        r"^arithmetic-\d+: fidelity exact, ([12]) turns, ([01]) tool calls, 0 breaks, "
        r"\d+ sampled ids, reward (0\.0|1\.0)$",
        done.stdout,
        re.M,
    )
    assert len(rows) == 8, done.stdout
    # One turn is an answer without the tool; two, a call and an answer.
    assert all(int(turns) == int(calls) + 1 for turns, calls, _ in rows)
    assert len(re.findall(r"^group of arithmetic-\d+: advantages ", done.stdout, re.M)) == 2


# --------------------------------------------------------------------------- the Agents SDK


@pytest.mark.skipif(
    importlib.util.find_spec("agents") is None,
    reason="the OpenAI Agents SDK is not installed (pip install openai-agents)",
)
async def test_an_openai_agents_sdk_agent_as_a_command() -> None:
    agent = GatewayAgent(
        command=[sys.executable, str(AGENTS_SDK_SCRIPT)],
        renderer=PlainRenderer(),
        prompts=prompts(),
    )
    with trio.fail_after(SECONDS):
        rollouts = await agent.group_rollout(request(group=2))
    for rollout in rollouts:
        assert rollout.reward == 1.0
        assert rollout.fidelity == "exact"
        gateway = rollout.extra["gateway"]
        assert (gateway["calls"], gateway["tool_calls"], gateway["breaks"]) == (2, 1, 0)
        assert sampled_text(rollout) == expected_sampled(PROBLEM)
