"""The gateway: an unmodified openai-SDK agent against ``trio_rollouts.gateway.serve``,
on the embedded backend (token-in, code points) with the plain renderer.

Real sockets on 127.0.0.1 and the real clock (the SDK's HTTP client runs on Trio through
anyio); everything that waits is bounded by ``trio.fail_after`` and ordered by events,
never by sleeping.
"""

from __future__ import annotations

import gc
import json
import socket
from typing import Any

import httpx2 as httpx
import openai
import pytest
import trio
import trio.testing

import trio_rollouts as tr
import trio_rollouts.testing
from trio_rollouts import ChatMessage, PlainRenderer, Problem
from trio_rollouts.gateway import serve
from trio_rollouts.inference import EmbeddedInference, LatencyModel

R = PlainRenderer()
PROBLEM = Problem(problem_id="p1", prompt="What is 2+3?", answer=5)
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
LIMIT = 30.0
FAST = LatencyModel(first_token=0.0, per_token=0.0)


def agentic(messages: list[ChatMessage]) -> tuple[list[str], list[float]]:
    """Calls the calculator first, answers with the tool's result after."""
    last = messages[-1]
    if last.role == "tool":
        return [f"The answer is {last.content}."], [1.0]
    return [CALL], [1.0]


def backend(latency: LatencyModel = FAST) -> EmbeddedInference:
    return EmbeddedInference(policy=agentic, seed=0, latency=latency)


class Gated(EmbeddedInference):
    """The embedded backend, whose calls say when they arrive and wait for ``gate``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(policy=agentic, seed=0, latency=FAST, **kwargs)
        self.entered = trio.Event()
        self.gate = trio.Event()
        self.returned = trio.Event()

    async def base_generate(self, request: tr.InferenceRequest) -> tr.InferenceResponse:
        self.entered.set()
        await self.gate.wait()
        response = await super().base_generate(request)
        # The session commits before its next checkpoint: a waiter woken by this event
        # runs after the commit.
        self.returned.set()
        return response


def client(session: tr.gateway.GatewaySession) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)


async def tool_agent(base_url: str, api_key: str, *, stream: bool = False) -> list[Any]:
    """An agent as people write them: the SDK, a tool loop, nothing of trio_rollouts."""
    sdk = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[Any] = [{"role": "user", "content": PROBLEM.prompt}]
    replies = []
    for _ in range(4):
        completion: Any
        if stream:
            async with sdk.chat.completions.stream(
                model="policy", messages=messages, tools=TOOLS
            ) as events:
                completion = await events.get_final_completion()
        else:
            completion = await sdk.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS
            )
        choice = completion.choices[0]
        replies.append(choice)
        messages.append(choice.message.model_dump(exclude_none=True))
        if not choice.message.tool_calls:
            break
        for call in choice.message.tool_calls:
            arguments = json.loads(call.function.arguments)
            result = str(sum(int(term) for term in arguments["expression"].split("+")))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    await sdk.close()
    if stream:
        # The SDK's unclosed stream generators are finalized here, under this test's
        # warning filter, not in a later test.
        gc.collect()
    return replies


# --------------------------------------------------------------------------- happy path


#: The openai SDK breaks out of its SSE generators at ``[DONE]`` (and out of its HTTP
#: client's byte streams under them) without closing them, and Trio warns when it
#: finalizes an unexhausted async generator: the SDK's generators, not the gateway's.
SDK_STREAM_GENERATORS = [
    pytest.mark.filterwarnings(f"ignore:Async generator '{module}:ResourceWarning")
    for module in ("openai._streaming", "httpx2._models", "httpcore2._async")
]


@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=SDK_STREAM_GENERATORS)])
async def test_an_sdk_tool_agent_gives_one_exact_element(stream: bool) -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            replies = await tool_agent(session.base_url, session.api_key, stream=stream)
    first, last = replies
    assert first.finish_reason == "tool_calls"
    (call,) = first.message.tool_calls or []
    assert (call.id, call.function.name) == ("call_1_0", "calculator")
    assert json.loads(call.function.arguments) == {"expression": "2+3"}
    assert last.finish_reason == "stop"
    assert last.message.content == "The answer is 5."
    rollout = session.rollout(reward=1.0, env_id="calc")
    assert rollout.fidelity == "exact"
    assert len(rollout.trajectory) == 1  # one token stream: every call extended the last
    (ids,) = rollout.trajectory
    (mask,) = rollout.generation_mask or [[]]
    sampled = "".join(chr(i) for i, m in zip(ids, mask, strict=True) if m)
    assert sampled == CALL + "The answer is 5."
    assert rollout.logprobs is not None
    assert len(rollout.logprobs[0]) == sum(mask)
    assert rollout.extra["gateway"]["calls"] == 2
    assert rollout.extra["gateway"]["breaks"] == 0
    assert rollout.extra["gateway"]["tool_calls"] == 1
    assert [span.start for span in (rollout.sampling or [[]])[0]] == [
        turn["start"] for turn in rollout.extra["gateway"]["per_turn"]
    ]
    # The ids are the plain template's render of the conversation, exactly.
    text = "".join(map(chr, ids))
    assert text.startswith("<|tools|>\n")
    assert "<|tool|>\n5\n<|assistant|>\nThe answer is 5." in text
    assert (rollout.problem_id, rollout.env_id, rollout.reward) == ("p1", "calc", 1.0)


async def test_the_sync_client_in_a_thread_works_too() -> None:
    def agent(base_url: str, api_key: str) -> str:
        sdk = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        completion = sdk.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}]
        )
        sdk.close()
        return completion.choices[0].finish_reason

    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            finish = await trio.to_thread.run_sync(agent, session.base_url, session.api_key)
    assert finish == "tool_calls"
    assert session.rollout(0.0).extra["gateway"]["calls"] == 1


async def test_models_lists_the_served_name() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R, model="my-policy") as gw, gw.session() as session:
            sdk = client(session)
            models = await sdk.models.list()
            await sdk.close()
    assert [model.id for model in models.data] == ["my-policy"]


# --------------------------------------------------------------------------- breaks


async def test_a_rewritten_history_is_a_counted_break_and_a_new_element() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            sdk = client(session)
            first = await sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "q"}], tools=TOOLS
            )
            # The agent drops the tool call from the history (a summarising harness).
            await sdk.chat.completions.create(
                model="m",
                messages=[
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "I called a tool."},
                    {"role": "user", "content": "go on"},
                ],
                tools=TOOLS,
            )
            await sdk.close()
    assert first.choices[0].message.tool_calls
    rollout = session.rollout(1.0)
    assert rollout.extra["gateway"]["breaks"] == 1
    assert len(rollout.trajectory) == 2
    assert session.breaks == 1


async def test_a_changed_tool_set_is_a_break() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            sdk = client(session)
            messages: list[Any] = [{"role": "user", "content": "q"}]
            reply = await sdk.chat.completions.create(model="m", messages=messages, tools=TOOLS)
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": "call_1_0", "content": "5"})
            await sdk.chat.completions.create(model="m", messages=messages)  # no tools
            await sdk.close()
    assert session.rollout(1.0).extra["gateway"]["breaks"] == 1


async def test_on_break_raise_answers_400_naming_the_break() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R, on_break="raise") as gw, gw.session(PROBLEM) as session:
            sdk = client(session)
            await sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "q"}]
            )
            with pytest.raises(openai.BadRequestError, match="history rewritten"):
                await sdk.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "other"}]
                )
            await sdk.close()


# --------------------------------------------------------------------------- errors


async def raw(
    method: str, url: str, *, body: bytes | None = None, headers: dict[str, str] | None = None
) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.request(method, url, content=body, headers=headers)


def error_of(response: httpx.Response) -> dict[str, Any]:
    data = response.json()
    assert set(data) == {"error"}
    assert {"message", "type", "code"} <= set(data["error"])
    assert data["error"]["code"] == response.status_code
    error: dict[str, Any] = data["error"]
    return error


async def test_errors_are_in_the_openai_shape() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw:
            async with gw.session(PROBLEM) as session:
                url = session.base_url + "/chat/completions"
                bad_json = await raw("POST", url, body=b"{not json")
                not_object = await raw("POST", url, body=b"[1]")
                no_messages = await raw("POST", url, body=b'{"model": "m", "messages": []}')
                bad_role = await raw(
                    "POST", url, body=b'{"messages": [{"role": "robot", "content": "x"}]}'
                )
                two = await raw(
                    "POST", url, body=b'{"n": 2, "messages": [{"role": "user", "content": "x"}]}'
                )
                get = await raw("GET", url)
                unknown = await raw(
                    "POST",
                    f"{gw.url}/sessions/nope/v1/chat/completions",
                    body=b'{"messages": [{"role": "user", "content": "x"}]}',
                )
                no_route = await raw("GET", f"{gw.url}/v1/models")
            closed = await raw(
                "POST", url, body=b'{"messages": [{"role": "user", "content": "x"}]}'
            )
    for response in (bad_json, not_object, no_messages, bad_role, two):
        assert response.status_code == 400, response.text
        error_of(response)
    assert "valid JSON" in error_of(bad_json)["message"]
    assert "messages[0].role" in error_of(bad_role)["message"]
    assert "n must be 1" in error_of(two)["message"]
    assert get.status_code == 405
    assert unknown.status_code == 404
    assert "nope" in error_of(unknown)["message"]
    assert no_route.status_code == 404
    assert closed.status_code == 409
    assert "closed" in error_of(closed)["message"]


async def test_a_developer_message_is_the_system_message_unless_the_renderer_has_the_role() -> None:
    """The openai SDK sends "developer" for the system message to newer models: rendered
    as the system message (not dropped, not an error) by a renderer without the role."""
    body = (
        b'{"messages": [{"role": "developer", "content": "Be brief."},'
        b' {"role": "user", "content": "x"}]}'
    )
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            reply = await raw("POST", session.base_url + "/chat/completions", body=body)
    assert reply.status_code == 200, reply.text
    rollout = session.rollout(reward=1.0)
    assert R.decode(rollout.trajectory[0]).startswith(
        R.decode(
            R.render(
                [
                    ChatMessage(role="system", content="Be brief."),
                    ChatMessage(role="user", content="x"),
                ]
            )
        )
    )


async def test_the_api_key_is_checked_before_routing() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R, api_key="s3cret") as gw, gw.session(PROBLEM) as session:
            assert session.api_key == "s3cret"
            unknown = await raw("GET", f"{gw.url}/sessions/nope/v1/models")
            wrong = await raw(
                "GET", session.base_url + "/models", headers={"authorization": "Bearer x"}
            )
            sdk = openai.AsyncOpenAI(base_url=session.base_url, api_key="x", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await sdk.models.list()
            await sdk.close()
            sdk = client(session)
            good = await sdk.models.list()
            await sdk.close()
    # Without the key, an unknown session is not told apart from a known one.
    assert unknown.status_code == wrong.status_code == 401
    assert error_of(unknown)["type"] == "authentication_error"
    assert good.data


# --------------------------------------------------------------------------- lifetime


async def test_leaving_the_session_cancels_its_calls_and_commits_nothing() -> None:
    outcome: list[BaseException] = []
    inference = Gated()

    async def agent(session: tr.gateway.GatewaySession) -> None:
        sdk = client(session)
        try:
            await sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "q"}]
            )
        except openai.APIStatusError as error:
            outcome.append(error)
        await sdk.close()

    with trio.fail_after(LIMIT):
        async with (
            serve(inference, R) as gw,
            trio.open_nursery() as nursery,
            gw.session(PROBLEM) as session,
        ):
            nursery.start_soon(agent, session)
            await inference.entered.wait()  # the call is at the backend
    (error,) = outcome
    assert isinstance(error, openai.ConflictError)
    assert "closed while this call" in str(error)
    with pytest.raises(RuntimeError, match="committed no model call"):
        session.rollout(1.0)


async def test_the_rollout_is_refused_while_the_session_is_open() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            with pytest.raises(RuntimeError, match="still open"):
                session.rollout(1.0)


async def test_a_call_is_committed_when_the_agent_dies_mid_call() -> None:
    """The client goes away while the model generates: the call still commits."""
    inference = Gated()
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "q"}]}).encode()
    with trio.fail_after(LIMIT):
        async with serve(inference, R) as gw, gw.session(PROBLEM) as session:
            host, port = gw.url.removeprefix("http://").rsplit(":", 1)
            path = f"/sessions/{session.id}/v1/chat/completions"
            sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            await sock.connect((host, int(port)))
            head = (
                f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n"
            ).encode()
            await sock.send(head + body)
            await inference.entered.wait()
            sock.close()  # the agent dies with the call in flight
            inference.gate.set()
            await inference.returned.wait()
            assert session.calls == 1
    rollout = session.rollout(1.0)
    assert rollout.extra["gateway"]["calls"] == 1
    (ids,) = rollout.trajectory
    (mask,) = rollout.generation_mask or [[]]
    assert "".join(chr(i) for i, m in zip(ids, mask, strict=True) if m) == CALL


async def test_concurrent_sessions_are_isolated() -> None:
    results: dict[str, tr.TokenRollout] = {}

    async def member(gw: tr.gateway.Gateway, index: int) -> None:
        problem = Problem(problem_id=f"p{index}", prompt=f"q{index}", answer=index)
        async with gw.session(problem) as session:
            await tool_agent(session.base_url, session.api_key)
        results[problem.problem_id] = session.rollout(float(index))

    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, trio.open_nursery() as nursery:
            for index in range(8):
                nursery.start_soon(member, gw, index)
    assert sorted(results) == [f"p{i}" for i in range(8)]
    for rollout in results.values():
        assert rollout.fidelity == "exact"
        assert rollout.extra["gateway"]["calls"] == 2
        assert rollout.extra["gateway"]["breaks"] == 0


async def test_session_ids_are_unguessable_and_may_be_named() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw:
            async with gw.session() as a, gw.session(session_id="mine") as b:
                assert len(a.id) >= 20
                assert a.id != b.id
                assert b.base_url == f"{gw.url}/sessions/mine/v1"
            with pytest.raises(ValueError, match="already used"):
                async with gw.session(session_id="mine"):
                    pass


async def test_serve_refuses_a_backend_below_min_fidelity() -> None:
    with pytest.raises(tr.TokenFidelityError, match="min_fidelity='exact'"):
        async with serve(tr.testing.NullChatInference(), R, min_fidelity="exact"):
            pass  # pragma: no cover


def test_serve_refuses_bad_settings() -> None:
    async def main(**kwargs: Any) -> None:
        async with serve(backend(), R, **kwargs):
            pass  # pragma: no cover

    with pytest.raises(ValueError, match="on_break must be one of"):
        trio.run(lambda: main(on_break="ignore"))
    with pytest.raises(ValueError, match="min_fidelity must be one of"):
        trio.run(lambda: main(min_fidelity="perfect"))


async def test_what_the_serve_block_raises_leaves_as_itself() -> None:
    with pytest.raises(KeyError, match="mine"):
        async with serve(backend(), R):
            raise KeyError("mine")


async def test_a_seeded_session_gives_each_call_its_own_replayable_seed() -> None:
    async def run(seed: int) -> tr.TokenRollout:
        async with serve(backend(), R) as gw:
            async with gw.session(PROBLEM, seed=seed) as session:
                await tool_agent(session.base_url, session.api_key)
            return session.rollout(1.0)

    with trio.fail_after(LIMIT):
        first, again, other = await run(7), await run(7), await run(8)
    seeds = [span.seed for span in (first.sampling or [[]])[0]]
    assert len(seeds) == 2
    assert None not in seeds
    assert len(set(seeds)) == 2  # each call its own
    assert [span.seed for span in (again.sampling or [[]])[0]] == seeds  # replayed
    assert set(seeds).isdisjoint(span.seed for span in (other.sampling or [[]])[0])
    assert first.trajectory == again.trajectory


async def test_gateway_agent_sessions_take_their_seeds_from_the_run_seed() -> None:
    async def member(base_url: str, problem: Problem) -> float:
        await tool_agent(base_url, "unused")
        return 1.0

    agent = tr.GatewayAgent(function=member, renderer=R, prompts=tr.PromptSource([PROBLEM]))
    request = tr.GroupedRolloutRequest(
        num_groups=1, rollouts_per_group=3, inference_interface=backend(), seed=11
    )
    with trio.fail_after(LIMIT):
        async with agent.get_grouped_rollouts(request) as stream:
            group = await stream.receive()
    seeds = [
        span.seed
        for rollout in group
        if isinstance(rollout, tr.TokenRollout)
        for span in (rollout.sampling or [[]])[0]
    ]
    assert len(seeds) == 6
    assert None not in seeds
    assert len(set(seeds)) == 6
