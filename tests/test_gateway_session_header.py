"""Sessions by header: ``X-Session-ID`` on the gateway's shared base URL ``{gw.url}/v1``
routes a call to its session exactly as ``/sessions/<id>/v1`` does.

The real openai SDK is the client (``default_headers`` or ``extra_headers``), on the
embedded backend with the plain renderer; real sockets on 127.0.0.1 and the real clock,
every wait bounded by ``trio.fail_after``, interleavings fixed by the order of awaits.
"""

from __future__ import annotations

import json
from typing import Any

import httpx2 as httpx
import openai
import pytest
import trio

import trio_rollouts as tr
from trio_rollouts import ChatMessage, PlainRenderer, Problem
from trio_rollouts.gateway import serve
from trio_rollouts.inference import EmbeddedInference, LatencyModel

R = PlainRenderer()
LIMIT = 30.0
FAST = LatencyModel(first_token=0.0, per_token=0.0)
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
USER = json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode()


def agentic(messages: list[ChatMessage]) -> tuple[list[str], list[float]]:
    """Calls the calculator first, then answers with what the tool said."""
    last = messages[-1]
    if last.role == "tool":
        return [f"The answer is {last.content}."], [1.0]
    return [CALL], [1.0]


def backend() -> EmbeddedInference:
    return EmbeddedInference(policy=agentic, seed=0, latency=FAST)


def problem(index: int) -> Problem:
    return Problem(problem_id=f"p{index}", prompt=f"question {index}", answer=index)


def sampled_text(rollout: tr.TokenRollout) -> list[str]:
    """Each element's sampled characters (the plain renderer's ids are code points)."""
    return [
        "".join(chr(i) for i, m in zip(ids, mask, strict=True) if m)
        for ids, mask in zip(rollout.trajectory, rollout.generation_mask or [], strict=True)
    ]


class Conversation:
    """One agent's tool loop, a call at a time, so tests can interleave several."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.messages: list[Any] = [{"role": "user", "content": problem(index).prompt}]

    async def step(self, sdk: openai.AsyncOpenAI, **options: Any) -> Any:
        completion = await sdk.chat.completions.create(
            model="policy", messages=self.messages, tools=TOOLS, **options
        )
        message = completion.choices[0].message
        self.messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            # A result of its own per agent: a call landing in another's session shows.
            result = f"{self.index * 100}"
            self.messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return completion


async def raw(
    method: str, url: str, *, body: bytes | None = None, headers: Any = None
) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.request(method, url, content=body, headers=headers)


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == response.status_code
    return error


def assert_own_rollout(rollout: tr.TokenRollout, index: int) -> None:
    """Two calls, no break, one element holding this agent's prompt and tool result only."""
    assert rollout.extra["gateway"]["calls"] == 2
    assert rollout.extra["gateway"]["breaks"] == 0
    assert rollout.fidelity == "exact"
    (ids,) = rollout.trajectory
    text = R.decode(ids)
    assert f"question {index}" in text
    assert sampled_text(rollout) == [CALL + f"The answer is {index * 100}."]
    others = [i for i in range(8) if i != index]
    assert not any(f"question {i}\n" in text for i in others)


# --------------------------------------------------------------------------- routing


async def test_sessions_interleaved_on_one_base_url_each_keep_their_own_calls() -> None:
    """Four clients on ``{gw.url}/v1``, each with its session in ``default_headers``,
    take turns call by call: every call lands in its own session."""
    with trio.fail_after(LIMIT):
        async with (
            serve(backend(), R) as gw,
            gw.session(problem(0)) as s0,
            gw.session(problem(1)) as s1,
            gw.session(problem(2)) as s2,
            gw.session(problem(3)) as s3,
        ):
            sessions = [s0, s1, s2, s3]
            sdks = [
                openai.AsyncOpenAI(
                    base_url=f"{gw.url}/v1",
                    api_key=session.api_key,
                    default_headers={"X-Session-ID": session.id},
                    max_retries=0,
                )
                for session in sessions
            ]
            conversations = [Conversation(i) for i in range(4)]
            for _ in range(2):  # call 1 of every session, then call 2 of every session
                for sdk, conversation in zip(sdks, conversations, strict=True):
                    await conversation.step(sdk)
            for sdk in sdks:
                await sdk.close()
    for index, session in enumerate(sessions):
        assert_own_rollout(session.rollout(1.0), index)


async def test_one_shared_client_routes_by_extra_headers_under_concurrency() -> None:
    """One client for the whole run (as an evaluation harness keeps), the session named
    per request with ``extra_headers``; eight agents at once, streaming or not."""

    async def member(
        gw: tr.gateway.Gateway, sdk: openai.AsyncOpenAI, index: int, out: dict[int, Any]
    ) -> None:
        async with gw.session(problem(index)) as session:
            conversation = Conversation(index)
            headers = {"X-Session-ID": session.id}
            await conversation.step(sdk, extra_headers=headers)
            await trio.lowlevel.checkpoint()  # let the other members' calls in between
            await conversation.step(sdk, extra_headers=headers)
        out[index] = session.rollout(float(index))

    rollouts: dict[int, tr.TokenRollout] = {}
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw:
            sdk = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0)
            async with trio.open_nursery() as nursery:
                for index in range(8):
                    nursery.start_soon(member, gw, sdk, index, rollouts)
            await sdk.close()
    assert sorted(rollouts) == list(range(8))
    for index, rollout in rollouts.items():
        assert_own_rollout(rollout, index)


async def test_the_header_form_gives_the_rollout_the_path_form_gives() -> None:
    rollouts: list[tr.TokenRollout] = []
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw:
            for use_header in (False, True):
                async with gw.session(problem(5)) as session:
                    sdk = openai.AsyncOpenAI(
                        base_url=f"{gw.url}/v1" if use_header else session.base_url,
                        api_key=session.api_key,
                        default_headers={"X-Session-ID": session.id} if use_header else None,
                        max_retries=0,
                    )
                    conversation = Conversation(5)
                    await conversation.step(sdk)
                    await conversation.step(sdk)
                    await sdk.close()
                rollouts.append(session.rollout(1.0))
    by_path, by_header = rollouts
    assert by_header.trajectory == by_path.trajectory
    assert by_header.generation_mask == by_path.generation_mask
    assert by_header.logprobs == by_path.logprobs
    assert by_header.extra["gateway"]["calls"] == by_path.extra["gateway"]["calls"] == 2


async def test_a_rewritten_history_is_a_break_counted_in_the_header_session() -> None:
    with trio.fail_after(LIMIT):
        async with (
            serve(backend(), R) as gw,
            gw.session(problem(0)) as target,
            gw.session(problem(1)) as other,
        ):
            sdk = openai.AsyncOpenAI(
                base_url=f"{gw.url}/v1",
                api_key=target.api_key,
                default_headers={"X-Session-ID": target.id},
                max_retries=0,
            )
            await sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "q"}], tools=TOOLS
            )
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
            other_calls = other.calls
    rollout = target.rollout(1.0)
    assert rollout.extra["gateway"]["breaks"] == target.breaks == 1
    assert len(rollout.trajectory) == 2
    assert other_calls == 0


@pytest.mark.filterwarnings(
    "ignore:Async generator 'openai._streaming:ResourceWarning",
    "ignore:Async generator 'httpx2._models:ResourceWarning",
    "ignore:Async generator 'httpcore2._async:ResourceWarning",
)
async def test_streaming_and_models_work_by_header() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R, model="served") as gw, gw.session(problem(2)) as session:
            sdk = openai.AsyncOpenAI(
                base_url=f"{gw.url}/v1",
                api_key=session.api_key,
                default_headers={"X-Session-ID": session.id},
                max_retries=0,
            )
            models = await sdk.models.list()
            async with sdk.chat.completions.stream(
                model="m", messages=[{"role": "user", "content": "q"}], tools=TOOLS
            ) as events:
                completion = await events.get_final_completion()
            await sdk.close()
    assert [model.id for model in models.data] == ["served"]
    assert completion.choices[0].finish_reason == "tool_calls"
    assert session.rollout(1.0).extra["gateway"]["calls"] == 1


async def test_the_header_name_is_case_insensitive() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(problem(0)) as session:
            url = f"{gw.url}/v1/chat/completions"
            reply = await raw("POST", url, body=USER, headers={"x-session-id": session.id})
    assert reply.status_code == 200, reply.text
    assert session.rollout(1.0).extra["gateway"]["calls"] == 1


# --------------------------------------------------------------------------- errors


async def test_an_unknown_or_closed_header_session_gets_what_the_path_form_gets() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw:
            async with gw.session(session_id="gone"):
                pass
            header_url = f"{gw.url}/v1/chat/completions"
            unknown = [
                await raw("POST", header_url, body=USER, headers={"X-Session-ID": "nope"}),
                await raw("POST", f"{gw.url}/sessions/nope/v1/chat/completions", body=USER),
            ]
            closed = [
                await raw("POST", header_url, body=USER, headers={"X-Session-ID": "gone"}),
                await raw("POST", f"{gw.url}/sessions/gone/v1/chat/completions", body=USER),
            ]
    by_header, by_path = unknown
    assert by_header.status_code == by_path.status_code == 404
    assert error_of(by_header) == error_of(by_path)
    assert "'nope'" in error_of(by_header)["message"]
    by_header, by_path = closed
    assert by_header.status_code == by_path.status_code == 409
    assert error_of(by_header) == error_of(by_path)


async def test_the_sdk_sees_an_unknown_header_session_as_not_found() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw:
            sdk = openai.AsyncOpenAI(
                base_url=f"{gw.url}/v1",
                api_key="k",
                default_headers={"X-Session-ID": "nope"},
                max_retries=0,
            )
            with pytest.raises(openai.NotFoundError, match="no session 'nope'"):
                await sdk.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "q"}]
                )
            await sdk.close()


async def test_a_path_and_a_header_that_disagree_are_a_400_naming_both() -> None:
    with trio.fail_after(LIMIT):
        async with (
            serve(backend(), R) as gw,
            gw.session(session_id="a") as a,
            gw.session(session_id="b") as b,
        ):
            disagree = await raw(
                "POST",
                a.base_url + "/chat/completions",
                body=USER,
                headers={"X-Session-ID": "b"},
            )
            agree = await raw(
                "POST",
                a.base_url + "/chat/completions",
                body=USER,
                headers={"X-Session-ID": "a"},
            )
    assert disagree.status_code == 400
    message = error_of(disagree)["message"]
    assert "'a'" in message
    assert "'b'" in message
    assert "X-Session-ID" in message
    assert agree.status_code == 200, agree.text
    assert (a.calls, b.calls) == (1, 0)


async def test_the_shared_base_url_without_a_header_is_a_404_as_before() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(problem(0)) as session:
            chat = await raw("POST", f"{gw.url}/v1/chat/completions", body=USER)
            models = await raw("GET", f"{gw.url}/v1/models")
            elsewhere = await raw(
                "POST", f"{gw.url}/chat/completions", body=USER, headers={"X-Session-ID": "x"}
            )
    assert chat.status_code == models.status_code == elsewhere.status_code == 404
    assert "X-Session-ID" in error_of(chat)["message"]
    assert session.calls == 0


async def test_an_empty_header_is_a_400() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw:
            empty = await raw(
                "POST", f"{gw.url}/v1/chat/completions", body=USER, headers={"X-Session-ID": ""}
            )
    assert empty.status_code == 400
    assert "X-Session-ID header is empty" in error_of(empty)["message"]


async def test_a_header_sent_twice_names_no_session() -> None:
    """Two ``X-Session-ID`` values are joined (RFC 9110), never one silently chosen."""
    with trio.fail_after(LIMIT):
        async with (
            serve(backend(), R) as gw,
            gw.session(session_id="a") as a,
            gw.session(session_id="b") as b,
        ):
            twice = await raw(
                "POST",
                f"{gw.url}/v1/chat/completions",
                body=USER,
                headers=[("X-Session-ID", "a"), ("X-Session-ID", "b")],
            )
    assert twice.status_code == 404
    assert "'a, b'" in error_of(twice)["message"]
    assert (a.calls, b.calls) == (0, 0)


async def test_the_api_key_is_checked_before_the_header_is_read() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R, api_key="s3cret") as gw, gw.session() as session:
            url = f"{gw.url}/v1/models"
            unknown = await raw("GET", url, headers={"X-Session-ID": "nope"})
            known = await raw("GET", url, headers={"X-Session-ID": session.id})
            good = await raw(
                "GET",
                url,
                headers={"X-Session-ID": session.id, "Authorization": "Bearer s3cret"},
            )
    assert unknown.status_code == known.status_code == 401
    assert error_of(unknown) == error_of(known)
    assert good.status_code == 200, good.text
