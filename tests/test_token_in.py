"""Token-in inference: ``InferenceRequest.prompt_ids`` and ``AcceptsTokens``.

A request with ``prompt_ids`` is generated from exactly those ids, with no chat template;
the response's ``token_ids`` are the ids followed by the generated ones. The embedded
backend's ids are code points; the HTTP backend sends them to ``/v1/completions`` as
``prompt: [ids]`` and checks what the server echoes.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import trio
from _openai_server import FakeOpenAIServer, Reply, serving

import trio_rollouts as tr
from trio_rollouts import ChatMessage, GenerationArgs
from trio_rollouts.inference import (
    AcceptsTokens,
    EmbeddedInference,
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    MalformedResponseError,
    OpenAIInference,
    RetryBackoff,
    TokenMismatchError,
    UnsupportedFieldError,
    accepts_tokens,
)

PROMPT = 5.0
NO_WAIT = RetryBackoff(initial=0.0, maximum=0.0, jitter=0.0)
IDS = [ord(c) for c in "<|user|>\nhi\n<|assistant|>\n"]


def id_request(ids: list[int] | None = None, **kwargs: Any) -> InferenceRequest:
    return InferenceRequest(prompt=[], prompt_ids=list(IDS if ids is None else ids), **kwargs)


def make(url: str, **kwargs: Any) -> OpenAIInference:
    return OpenAIInference(url, model="m", api_key="sk-test", backoff=NO_WAIT, **kwargs)


# ----------------------------------------------------------------- the request


def test_an_empty_prompt_needs_prompt_ids() -> None:
    with pytest.raises(TypeError, match="non-empty list of ChatMessage"):
        InferenceRequest(prompt=[])
    assert InferenceRequest(prompt=[], prompt_ids=[1, 2]).prompt_ids == [1, 2]


@pytest.mark.parametrize(
    ("ids", "says"),
    [
        ([], "non-empty list"),
        ((1, 2), "non-empty list"),
        ([1, -1], r"prompt_ids\[1\] must be a token id .* got -1"),
        ([1, True], r"prompt_ids\[1\] must be a token id .* got True"),
        ([1.0], r"prompt_ids\[0\] must be a token id .* got 1.0"),
    ],
)
def test_bad_prompt_ids_are_refused_with_the_place_and_the_value(ids: Any, says: str) -> None:
    with pytest.raises(TypeError, match=says):
        InferenceRequest(prompt=[], prompt_ids=ids)


def test_names_are_exported_at_both_levels() -> None:
    assert tr.AcceptsTokens is AcceptsTokens
    assert tr.TokenMismatchError is TokenMismatchError
    assert issubclass(TokenMismatchError, MalformedResponseError)


async def test_a_backend_that_does_not_accept_tokens_refuses_before_generating() -> None:
    called: list[InferenceRequest] = []

    class TextOnly(InferenceInterface):
        async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
            called.append(request)
            return InferenceResponse(response=ChatMessage(role="assistant", content="x"))

    with pytest.raises(TypeError, match="TextOnly cannot generate from token ids"):
        await TextOnly().agenerate(id_request())
    assert called == []


# ----------------------------------------------------------------- the embedded backend


async def test_embedded_generates_from_exactly_the_ids() -> None:
    interface = EmbeddedInference(seed=3)
    assert isinstance(interface, AcceptsTokens)
    ids = [ord(c) for c in "any text at all, no template"]
    response = await interface.agenerate(id_request(ids))
    assert response.prompt_length == len(ids)
    assert response.token_ids is not None
    assert response.token_ids[: len(ids)] == ids
    generated = response.token_ids[len(ids) :]
    assert "".join(map(chr, generated)) == response.response.content
    assert response.logprobs is not None
    assert len(response.logprobs) == len(generated)


async def test_embedded_policy_sees_the_prompt_or_else_the_decoded_ids() -> None:
    seen: list[list[ChatMessage]] = []

    def policy(messages: list[ChatMessage]) -> tuple[list[str], list[float]]:
        seen.append(list(messages))
        return ["ok"], [1.0]

    interface = EmbeddedInference(policy=policy)
    await interface.agenerate(id_request([104, 105]))
    conversation = [ChatMessage(role="user", content="what the agent said")]
    await interface.agenerate(InferenceRequest(prompt=conversation, prompt_ids=[104, 105]))
    assert seen == [[ChatMessage(role="user", content="hi")], conversation]


async def test_embedded_refuses_ids_that_are_not_code_points() -> None:
    with pytest.raises(ValueError, match=rf"prompt_ids\[1\] = {sys.maxunicode + 1} is not"):
        await EmbeddedInference().agenerate(id_request([65, sys.maxunicode + 1]))


# ----------------------------------------------------------------- the HTTP backend


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_http_sends_the_ids_to_completions_without_a_template(endpoint: str) -> None:
    server = FakeOpenAIServer(name="srv")
    async with serving(server):
        interface = make(server.base_url, endpoint=endpoint)
        assert isinstance(interface, AcceptsTokens)
        request = id_request(generation_args=GenerationArgs(max_tokens=7))
        request.tools = [{"type": "function", "function": {"name": "f"}}]
        with trio.fail_after(PROMPT):
            response = await interface.agenerate(request)
    [received] = server.received
    assert received.path == "/v1/completions"
    assert received.body["prompt"] == IDS
    assert received.body["return_token_ids"] is True
    assert received.body["logprobs"] == 1
    assert received.body["max_tokens"] == 7
    assert {"messages", "tools", "top_logprobs"}.isdisjoint(received.body)
    assert response.prompt_length == len(IDS)
    assert response.token_ids is not None
    assert response.token_ids[: len(IDS)] == IDS
    assert response.token_ids[len(IDS) :] == server.token_ids(response.response.content)


async def test_http_ids_are_asked_for_even_when_the_option_is_off() -> None:
    server = FakeOpenAIServer(name="srv")
    async with serving(server):
        interface = make(server.base_url, return_token_ids=False, return_logprobs=False)
        with trio.fail_after(PROMPT):
            response = await interface.agenerate(id_request())
    assert server.received[0].body["return_token_ids"] is True
    assert "logprobs" not in server.received[0].body
    assert response.token_ids is not None


async def test_a_server_that_retokenized_the_ids_is_a_token_mismatch() -> None:
    server = FakeOpenAIServer(name="srv")
    echoed = [*IDS[:4], 9999, *IDS[5:]]
    server.reply(Reply(choice_extra={"prompt_token_ids": echoed}))
    async with serving(server):
        interface = make(server.base_url)
        with trio.fail_after(PROMPT), pytest.raises(TokenMismatchError) as info:
            await interface.agenerate(id_request())
    assert info.value.index == 4
    assert info.value.sent == IDS
    assert info.value.echoed == echoed
    assert "re-tokenized" in str(info.value)
    assert "first at index 4" in str(info.value)


async def test_a_server_that_refuses_an_id_prompt_names_the_fix() -> None:
    server = FakeOpenAIServer(name="srv")
    refusal = {"error": {"message": "prompt must be a string", "type": "invalid_request_error"}}
    server.reply(Reply(status=400, json=refusal))
    async with serving(server):
        interface = make(server.base_url)
        with trio.fail_after(PROMPT), pytest.raises(UnsupportedFieldError) as info:
            await interface.agenerate(id_request())
    assert info.value.fields == ("prompt",)
    assert info.value.status == 400
    message = str(info.value)
    assert server.base_url in message
    assert "token-id prompt" in message
    assert "without prompt_ids" in message


async def test_a_server_that_ignores_return_token_ids_cannot_take_an_id_prompt() -> None:
    server = FakeOpenAIServer(name="llama", ignored_fields=frozenset({"return_token_ids"}))
    async with serving(server):
        interface = make(server.base_url)
        with trio.fail_after(PROMPT), pytest.raises(UnsupportedFieldError) as info:
            await interface.agenerate(id_request())
    assert info.value.fields == ("return_token_ids",)
    assert "returned no token ids for a token-id prompt" in str(info.value)


async def test_a_text_request_is_unchanged() -> None:
    server = FakeOpenAIServer(name="srv")
    async with serving(server):
        interface = make(server.base_url)
        with trio.fail_after(PROMPT):
            await interface.agenerate(interface.prepare_request("hello"))
    assert server.received[0].path == "/v1/chat/completions"
    assert "prompt" not in server.received[0].body


# ------------------------------------------------------- token_prompts=False (chat only)


async def test_token_prompts_false_refuses_id_prompts_before_sending() -> None:
    server = FakeOpenAIServer(name="srv")
    async with serving(server):
        interface = make(server.base_url, token_prompts=False)
        assert isinstance(interface, AcceptsTokens)  # the class still can
        assert not accepts_tokens(interface)  # this instance does not
        assert accepts_tokens(make(server.base_url))
        with pytest.raises(TypeError, match="configured not to take them"):
            await interface.agenerate(id_request())
    assert server.received == []


class OneReply(tr.BaseEnvironment):
    """One user message, then done after the first turn."""

    def __init__(self, problem: tr.Problem) -> None:
        super().__init__()
        self.problem = problem

    async def reset(self) -> list[ChatMessage]:
        await trio.lowlevel.checkpoint()
        return [ChatMessage(role="user", content=str(self.problem.prompt))]

    async def step(self, turn: tr.AssistantTurn) -> tr.EnvironmentStep:
        await trio.lowlevel.checkpoint()
        if turn.content.endswith("2"):
            return tr.EnvironmentStep(done=True, reward=1.0)
        return tr.EnvironmentStep(messages=[ChatMessage(role="user", content="more")])


async def one_episode(interface: OpenAIInference, **fields: Any) -> tr.TokenRollout:
    agent = tr.MultiTurnAgent(
        environment=OneReply,
        renderer=tr.PlainRenderer(),
        prompts=tr.PromptSource([tr.Problem(problem_id="q", prompt="go", answer=None)]),
        **fields,
    )
    request = tr.GroupedRolloutRequest(
        num_groups=1, rollouts_per_group=1, inference_interface=interface
    )
    async with agent.get_grouped_rollouts(request) as stream:
        [rollout] = await stream.receive()
    assert isinstance(rollout, tr.TokenRollout)
    return rollout


async def test_a_chat_only_server_runs_episodes_at_the_fidelity_it_gives() -> None:
    # It returns the ids it rendered and sampled: server_tokens. Its "template" (one id
    # per message, the content's length) is not the renderer's, so each turn's prompt
    # differs from the episode's ids (a break at each turn), and the renderer cannot
    # prove a bridge after ids it does not render (a break after the first turn).
    server = FakeOpenAIServer(name="srv")
    server.reply(Reply(json=None), Reply(json=None))
    async with serving(server):
        interface = make(server.base_url, token_prompts=False)
        with trio.fail_after(PROMPT):
            rollout = await one_episode(interface, max_turns=2)
    assert [r.path for r in server.received] == ["/v1/chat/completions"] * 2
    assert "prompt" not in server.received[0].body
    assert [m["role"] for m in server.received[1].body["messages"]] == [
        "user",
        "assistant",
        "user",
    ]
    assert rollout.fidelity == "server_tokens"
    assert rollout.trajectory[0][:1] == [len("go")]  # the server's prompt ids
    assert rollout.extra["episode"]["breaks"] == 3
    # transformers serve refuses return_token_ids: text only, below the default minimum.
    strict = FakeOpenAIServer(name="strict", unknown_fields="transformers")
    async with serving(strict):
        interface = make(strict.base_url, token_prompts=False)
        with trio.fail_after(PROMPT), pytest.raises(tr.TokenFidelityError) as info:
            await one_episode(interface)
        assert f"OpenAIInference ({strict.base_url})" in str(info.value)
        assert "returned no token ids" in str(info.value)
        with trio.fail_after(PROMPT):
            rollout = await one_episode(interface, min_fidelity="retokenized", max_turns=2)
    assert rollout.fidelity == "retokenized"
    assert rollout.logprobs is None
