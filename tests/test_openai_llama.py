"""OpenAIInference against stub servers that behave like llama.cpp's: llama-cpp-python's
``python -m llama_cpp.server`` (ignores ``return_token_ids``; chat logprobs ``null``
unless ``top_logprobs`` is set) and the C++ ``llama-server`` (``/v1/completions``
logprobs in the chat shape; chat logprobs merged per character, fewer than tokens).
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
from _openai_server import CORE_FIELDS, DEFAULT_LOGPROB, FakeOpenAIServer, Reply, serving

from trio_rollouts import GenerationArgs
from trio_rollouts.inference import (
    InferenceRequest,
    MalformedResponseError,
    OpenAIInference,
    RetryBackoff,
    UnsupportedFieldError,
)

NO_WAIT = RetryBackoff(initial=0.0, maximum=0.0, jitter=0.0)
PROMPT = 5.0
NEGOTIATION_LOGGER = "trio_rollouts.inference.openai._negotiation"


def make(url: str, **kwargs: Any) -> OpenAIInference:
    options: dict[str, Any] = {"model": "m", "api_key": "sk-test", "backoff": NO_WAIT}
    options.update(kwargs)
    return OpenAIInference(url, **options)


def ask(interface: OpenAIInference, text: str = "hello") -> InferenceRequest:
    return interface.prepare_request(text, GenerationArgs())


def warnings(caplog: pytest.LogCaptureFixture, part: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == NEGOTIATION_LOGGER and part in r.getMessage()
    ]


def llama_cpp_python() -> FakeOpenAIServer:
    return FakeOpenAIServer(
        name="llama", ignored_fields=frozenset({"return_token_ids"}), llama_cpp_python=True
    )


# ----------------------------------------------------------------- ignored fields (6)


async def test_strict_token_ids_fail_when_the_server_ignores_the_field() -> None:
    server = llama_cpp_python()
    async with serving(server):
        interface = make(server.base_url, return_token_ids=True)
        with trio.fail_after(PROMPT), pytest.raises(UnsupportedFieldError) as info:
            await interface.agenerate(ask(interface))
    message = str(info.value)
    assert server.base_url in message
    assert "return_token_ids=True" in message
    assert "--token-ids" in message
    assert "return_token_ids=None" in message
    assert info.value.fields == ("return_token_ids",)


async def test_strict_logprobs_fail_when_the_server_ignores_the_field() -> None:
    server = FakeOpenAIServer(ignored_fields=frozenset({"logprobs"}))
    async with serving(server):
        interface = make(server.base_url, return_logprobs=True)
        with trio.fail_after(PROMPT), pytest.raises(UnsupportedFieldError) as info:
            await interface.agenerate(ask(interface))
    assert "return_logprobs=True" in str(info.value)
    assert "--logprobs" in str(info.value)


async def test_negotiated_fields_ignored_warn_once_per_replica(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = llama_cpp_python()
    async with serving(server):
        interface = make(server.base_url)
        with trio.fail_after(PROMPT):
            first = await interface.agenerate(ask(interface))
            second = await interface.agenerate(ask(interface))
    assert first.token_ids is None
    assert second.token_ids is None
    [warning] = warnings(caplog, "'return_token_ids'")
    assert server.base_url in warning
    assert "carry no token ids" in warning


async def test_nothing_generated_is_not_a_missing_field(caplog: pytest.LogCaptureFixture) -> None:
    # Zero generated tokens: no token ids (nor logprobs) to return, and no error.
    empty = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1},
    }
    server = FakeOpenAIServer()
    server.reply(Reply(json=empty), Reply(json=empty))
    async with serving(server):
        strict = make(server.base_url, return_token_ids=True, return_logprobs=True)
        negotiated = make(server.base_url)
        with trio.fail_after(PROMPT):
            response = await strict.agenerate(ask(strict))
            await negotiated.agenerate(ask(negotiated))
    assert response.response.content == ""
    assert warnings(caplog, "returned no") == []


async def test_empty_lists_are_not_missing() -> None:
    server = FakeOpenAIServer()
    server.reply(Reply(choice_extra={"logprobs": {"content": []}, "token_ids": []}))
    async with serving(server):
        interface = make(server.base_url, return_token_ids=True, return_logprobs=True)
        with trio.fail_after(PROMPT):
            response = await interface.agenerate(ask(interface))
    assert response.logprobs == []
    assert response.token_ids == [len("hello")]


# ----------------------------------------------------------------- top_logprobs (7)


async def test_chat_logprobs_from_llama_cpp_python_by_default() -> None:
    server = llama_cpp_python()
    async with serving(server):
        interface = make(server.base_url)
        with trio.fail_after(PROMPT):
            response = await interface.agenerate(ask(interface))
    assert server.received[0].body["top_logprobs"] == 1
    assert response.logprobs == [DEFAULT_LOGPROB] * len("llama: hello")


async def test_top_logprobs_goes_with_logprobs() -> None:
    refusing = FakeOpenAIServer(unknown_fields="transformers", known_fields=CORE_FIELDS)
    async with serving(refusing):
        interface = make(refusing.base_url)
        with trio.fail_after(PROMPT):
            response = await interface.agenerate(ask(interface))
            await interface.agenerate(ask(interface))
    assert response.logprobs is None
    first, second, third = (r.body for r in refusing.received)
    assert first["top_logprobs"] == 1
    assert "top_logprobs" not in second
    assert "logprobs" not in second
    assert "top_logprobs" not in third


async def test_a_refusal_naming_top_logprobs_drops_logprobs() -> None:
    # Knows logprobs but not top_logprobs: the refusal names only top_logprobs.
    server = FakeOpenAIServer(unknown_fields="openai", known_fields=CORE_FIELDS | {"logprobs"})
    server.reply(
        Reply(
            status=400,
            json={"error": {"message": "Unrecognized request argument supplied: top_logprobs"}},
        )
    )
    async with serving(server):
        interface = make(server.base_url, return_token_ids=False)
        with trio.fail_after(PROMPT):
            await interface.agenerate(ask(interface))
    assert interface.statistics().dropped_fields == (("logprobs",),)


@pytest.mark.parametrize(
    ("options", "endpoint"),
    [({"return_logprobs": False}, "chat"), ({}, "completions")],
)
async def test_no_top_logprobs_on_completions_or_without_logprobs(
    options: dict[str, Any], endpoint: str
) -> None:
    server = FakeOpenAIServer()
    async with serving(server):
        interface = make(server.base_url, endpoint=endpoint, **options)
        with trio.fail_after(PROMPT):
            await interface.agenerate(ask(interface))
    assert "top_logprobs" not in server.received[0].body


# ----------------------------------------------------------------- llama-server (8, 9)


async def test_completions_logprobs_in_the_chat_shape() -> None:
    server = FakeOpenAIServer(name="cpp", completions_chat_shape=True)
    async with serving(server):
        interface = make(server.base_url, endpoint="completions")
        with trio.fail_after(PROMPT):
            response = await interface.agenerate(ask(interface))
    assert response.logprobs == [DEFAULT_LOGPROB] * len(response.response.content)


@pytest.mark.parametrize("token_ids", [True, False], ids=["by-token-ids", "by-usage"])
async def test_merged_logprob_entries_are_dropped_with_a_warning(
    token_ids: bool, caplog: pytest.LogCaptureFixture
) -> None:
    server = FakeOpenAIServer(name="cpp", merge_logprobs=2)
    async with serving(server):
        interface = make(server.base_url, return_token_ids=None if token_ids else False)
        with trio.fail_after(PROMPT):
            first = await interface.agenerate(ask(interface))
            await interface.agenerate(ask(interface))
    assert first.logprobs is None
    generated = len("cpp: hello")
    [warning] = warnings(caplog, "log-probabilities for")
    assert server.base_url in warning
    assert f"returned {(generated + 1) // 2} log-probabilities for {generated}" in warning


async def test_merged_logprob_entries_fail_under_strict_logprobs() -> None:
    server = FakeOpenAIServer(name="cpp", merge_logprobs=2)
    async with serving(server):
        interface = make(server.base_url, return_logprobs=True)
        with trio.fail_after(PROMPT), pytest.raises(MalformedResponseError) as info:
            await interface.agenerate(ask(interface))
    assert server.base_url in str(info.value)
    assert "return_logprobs=True" in str(info.value)
