"""The inference contract: requests, responses, markers, and the sync/async entry points."""

from __future__ import annotations

import math

import attrs
import pytest
import trio

from trio_rollouts import ChatMessage, GenerationArgs
from trio_rollouts.inference import (
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    ReturnsLogProbs,
    ReturnsRaw,
    ReturnsTokens,
    render_plain_chat,
)
from trio_rollouts.testing import NullChatInference


@attrs.define(kw_only=True, eq=False)
class EchoInference(InferenceInterface, ReturnsRaw):
    """Replies with the last message's content; counts calls."""

    calls: int = 0

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        self.calls += 1
        await trio.lowlevel.checkpoint()
        content = request.prompt[-1].content
        return InferenceResponse(
            response=ChatMessage(role="assistant", content=content),
            raw_text=render_plain_chat(request.prompt) + content,
        )


def test_prepare_request_turns_a_string_into_one_user_message() -> None:
    request = EchoInference().prepare_request("What is 2 + 2?")
    assert request.prompt == [ChatMessage(role="user", content="What is 2 + 2?")]


def test_prepare_request_keeps_a_message_list_as_a_copy() -> None:
    messages = [ChatMessage(role="system", content="s"), ChatMessage(role="user", content="u")]
    request = EchoInference().prepare_request(messages)
    assert request.prompt == messages
    assert request.prompt is not messages


def test_prepare_request_defaults_to_unset_generation_args() -> None:
    assert EchoInference().prepare_request("x").generation_args == GenerationArgs()


def test_prepare_request_keeps_given_generation_args() -> None:
    args = GenerationArgs(temperature=0.0, max_tokens=3)
    assert EchoInference().prepare_request("x", args).generation_args is args


@pytest.mark.parametrize("prompt", [[], "text", [{"role": "user", "content": "x"}]])
def test_request_prompt_must_be_a_non_empty_message_list(prompt: object) -> None:
    with pytest.raises(TypeError, match="prompt"):
        InferenceRequest(prompt=prompt)  # type: ignore[arg-type]


def test_response_defaults_are_empty() -> None:
    response = InferenceResponse(response=ChatMessage(role="assistant", content="hi"))
    assert response.raw_text is None
    assert response.token_ids is None
    assert response.logprobs is None
    assert (response.policy_epoch, response.kv_cache_epoch, response.num_evictions) == ([], [], 0)


def test_an_interface_without_base_generate_cannot_be_made() -> None:
    with pytest.raises(TypeError, match="abstract"):
        InferenceInterface()  # type: ignore[abstract]


def test_returns_logprobs_implies_returns_tokens() -> None:
    assert issubclass(ReturnsLogProbs, ReturnsTokens)


def test_markers_are_checked_with_isinstance() -> None:
    interface = EchoInference()
    assert isinstance(interface, ReturnsRaw)
    assert not isinstance(interface, ReturnsTokens)


def test_interfaces_compare_by_identity() -> None:
    first, second = EchoInference(), EchoInference()
    assert first != second
    assert len({first, second}) == 2


def test_render_plain_chat_marks_roles_and_opens_the_reply() -> None:
    messages = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Hi"),
    ]
    assert render_plain_chat(messages) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"


async def test_agenerate_delegates_to_base_generate() -> None:
    interface = EchoInference()
    response = await interface.agenerate(interface.prepare_request("ping"))
    assert response.response.content == "ping"
    assert interface.calls == 1


async def test_agenerate_refuses_what_is_not_a_request() -> None:
    with pytest.raises(TypeError, match="InferenceRequest"):
        await EchoInference().agenerate("ping")  # type: ignore[arg-type]


async def test_agenerate_is_cancellable() -> None:
    interface = NullChatInference(latency=math.inf)  # hangs until cancelled
    with trio.move_on_after(1) as scope:
        await interface.agenerate(interface.prepare_request("x"))
    assert scope.cancelled_caught


def test_generate_runs_its_own_trio_loop() -> None:
    interface = EchoInference()
    assert interface.generate(interface.prepare_request("ping")).response.content == "ping"


async def test_generate_inside_a_trio_loop_is_a_clear_error() -> None:
    interface = EchoInference()
    with pytest.raises(RuntimeError, match="agenerate"):
        interface.generate(interface.prepare_request("ping"))
    assert interface.calls == 0


async def test_async_with_gives_the_interface_and_aclose_is_a_no_op() -> None:
    interface = EchoInference()
    async with interface as entered:
        assert entered is interface
    await interface.aclose()
    assert (await interface.agenerate(interface.prepare_request("x"))).response.content == "x"
