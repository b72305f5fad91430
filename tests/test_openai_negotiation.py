"""Capability negotiation of OpenAIInference against real stub servers on 127.0.0.1.

Three kinds of server (tests/_openai_server.py): a vLLM-like one that accepts
``return_token_ids`` and ``logprobs`` and returns token ids; a text-only one that refuses
unknown request fields with 422 like ``transformers serve`` (with and without logprobs
support); and an OpenAI-like one that refuses them with 400. With the options at ``None``
the backend drops a refused field for that replica only, once, logged once, without
counting a retry; ``True`` is strict; ``False`` never sends the field.
"""

from __future__ import annotations

import logging
import pickle
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
from _openai_server import (
    CORE_FIELDS,
    DEFAULT_LOGPROB,
    FakeOpenAIServer,
    Reply,
    serving,
    serving_in_thread,
)

from trio_rollouts import GenerationArgs
from trio_rollouts.inference import (
    BadRequestError,
    InferenceRequest,
    OpenAIInference,
    RetryBackoff,
    UnsupportedFieldError,
)
from trio_rollouts.inference.openai._negotiation import named_fields

NO_WAIT = RetryBackoff(initial=0.0, maximum=0.0, jitter=0.0)
PROMPT = 5.0
NEGOTIATION_LOGGER = "trio_rollouts.inference.openai._negotiation"

#: A text-only server that returns log-probabilities but knows nothing of token ids.
WITH_LOGPROBS = CORE_FIELDS | {"logprobs"}


def vllm_like() -> FakeOpenAIServer:
    return FakeOpenAIServer(name="vllm")


def transformers_like(known: frozenset[str] = WITH_LOGPROBS) -> FakeOpenAIServer:
    return FakeOpenAIServer(name="hf", unknown_fields="transformers", known_fields=known)


def openai_like(known: frozenset[str] = WITH_LOGPROBS) -> FakeOpenAIServer:
    return FakeOpenAIServer(name="oai", unknown_fields="openai", known_fields=known)


def make(url: str | list[str], **kwargs: Any) -> OpenAIInference:
    options: dict[str, Any] = {"model": "test-model", "api_key": "sk-test", "backoff": NO_WAIT}
    options.update(kwargs)
    return OpenAIInference(url, **options)


def ask(interface: OpenAIInference, text: str = "hello", **args: Any) -> InferenceRequest:
    return interface.prepare_request(text, GenerationArgs(**args))


def warnings_about(caplog: pytest.LogCaptureFixture, field: str) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == NEGOTIATION_LOGGER and repr(field) in record.getMessage()
    ]


@pytest.fixture
async def text_only() -> AsyncIterator[FakeOpenAIServer]:
    server = transformers_like()
    async with serving(server):
        yield server


@pytest.fixture
async def accepting() -> AsyncIterator[FakeOpenAIServer]:
    """A vLLM-like server, for scripted error replies."""
    server = vllm_like()
    async with serving(server):
        yield server


# --------------------------------------------------------------------------- the default


async def test_a_vllm_like_server_is_asked_for_both_and_returns_tokens() -> None:
    server = vllm_like()
    async with serving(server):
        interface = make(server.base_url)
        with trio.fail_after(PROMPT):
            response = await interface.agenerate(ask(interface))
    assert len(server.received) == 1
    body = server.received[0].body
    assert (body["return_token_ids"], body["logprobs"]) == (True, True)
    assert response.token_ids is not None
    assert response.prompt_length == 1
    assert response.logprobs == [DEFAULT_LOGPROB] * len("vllm: hello")
    assert interface.statistics().dropped_fields == ((),)


async def test_a_text_only_server_gets_the_request_again_without_the_refused_field(
    text_only: FakeOpenAIServer,
) -> None:
    interface = make(text_only.base_url, max_retries=0)
    with trio.fail_after(PROMPT):
        response = await interface.agenerate(ask(interface))
    first, second = (received.body for received in text_only.received)
    assert first["return_token_ids"] is True
    assert "return_token_ids" not in second
    assert first["messages"] == second["messages"]
    assert response.response.content == "hf: hello"
    assert (response.token_ids, response.prompt_length) == (None, None)


async def test_logprobs_without_token_ids_are_kept(text_only: FakeOpenAIServer) -> None:
    interface = make(text_only.base_url)
    with trio.fail_after(PROMPT):
        response = await interface.agenerate(ask(interface))
    assert response.token_ids is None
    assert response.logprobs == [DEFAULT_LOGPROB] * len("hf: hello")
    assert response.finish_reason == "stop"


async def test_usage_is_kept_without_token_ids(text_only: FakeOpenAIServer) -> None:
    interface = make(text_only.base_url)
    with trio.fail_after(PROMPT):
        response = await interface.agenerate(ask(interface))
    completion = len("hf: hello")
    assert response.usage == {
        "prompt_tokens": 1,
        "completion_tokens": completion,
        "total_tokens": 1 + completion,
    }


async def test_the_resend_is_not_a_retry(text_only: FakeOpenAIServer) -> None:
    interface = make(text_only.base_url, max_retries=0)
    with trio.fail_after(PROMPT):
        await interface.agenerate(ask(interface))
    statistics = interface.statistics()
    assert statistics.retries == 0
    assert statistics.attempts == (2,)  # both requests went on the wire
    assert statistics.dropped_fields == (("return_token_ids",),)


async def test_once_learned_every_request_is_sent_once_without_the_field(
    text_only: FakeOpenAIServer,
) -> None:
    interface = make(text_only.base_url)
    with trio.fail_after(PROMPT):
        await interface.agenerate(ask(interface))
        for _ in range(3):
            await interface.agenerate(ask(interface))
    later = text_only.received[2:]
    assert len(later) == 3
    assert all("return_token_ids" not in received.body for received in later)
    assert all(received.body["logprobs"] is True for received in later)


async def test_only_the_named_field_is_dropped(text_only: FakeOpenAIServer) -> None:
    interface = make(text_only.base_url)
    with trio.fail_after(PROMPT):
        await interface.agenerate(ask(interface))
    assert text_only.received[1].body["logprobs"] is True
    assert interface.statistics().dropped_fields == (("return_token_ids",),)


async def test_a_server_refusing_both_fields_loses_both_in_one_resend() -> None:
    server = transformers_like(known=CORE_FIELDS)
    async with serving(server):
        interface = make(server.base_url)
        with trio.fail_after(PROMPT):
            response = await interface.agenerate(ask(interface))
    assert len(server.received) == 2
    assert not {"return_token_ids", "logprobs"} & server.received[1].body.keys()
    assert (response.token_ids, response.logprobs) == (None, None)
    assert interface.statistics().dropped_fields == (("logprobs", "return_token_ids"),)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_an_openai_like_400_is_negotiated_too(endpoint: str) -> None:
    server = openai_like(known=CORE_FIELDS)
    async with serving(server):
        interface = make(server.base_url, endpoint=endpoint)
        with trio.fail_after(PROMPT):
            response = await interface.agenerate(ask(interface))
    assert len(server.received) == 2
    assert response.response.content.startswith("oai: ")
    assert interface.statistics().dropped_fields == (("logprobs", "return_token_ids"),)


async def test_negotiation_is_per_replica() -> None:
    vllm, text = vllm_like(), transformers_like()
    async with serving(vllm, text):
        interface = make([vllm.base_url, text.base_url])
        with trio.fail_after(PROMPT):
            # Idle replicas alternate: vllm, text, vllm, text.
            responses = [await interface.agenerate(ask(interface)) for _ in range(4)]
    assert all(received.body["return_token_ids"] is True for received in vllm.received)
    assert len(vllm.received) == 2
    assert [("return_token_ids" in r.body) for r in text.received] == [True, False, False]
    assert [r.token_ids is not None for r in responses] == [True, False, True, False]
    assert interface.statistics().dropped_fields == ((), ("return_token_ids",))


async def test_concurrent_refusals_each_resend_and_log_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    server = transformers_like()
    server.gate = trio.Event()  # hold every answer until all requests have arrived
    async with serving(server):
        interface = make(server.base_url, max_retries=0)
        results: list[Any] = []

        async def one() -> None:
            results.append(await interface.agenerate(ask(interface)))

        with trio.fail_after(PROMPT):
            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(one)
                await server.wait_received(8)
                assert all("return_token_ids" in r.body for r in server.received)
                server.gate.set()
    assert len(results) == 8
    assert len(server.received) == 16
    assert interface.statistics().retries == 0
    messages = warnings_about(caplog, "return_token_ids")
    assert len(messages) == 1
    assert server.base_url in messages[0]


def test_what_was_learned_survives_separate_trio_runs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    server = transformers_like()
    with serving_in_thread(server):
        interface = make(server.base_url)
        first = interface.generate(ask(interface))  # a trio.run of its own
        second = interface.generate(ask(interface))  # another one
    assert first.response.content == second.response.content == "hf: hello"
    assert len(server.received) == 3
    assert "return_token_ids" not in server.received[2].body
    assert len(warnings_about(caplog, "return_token_ids")) == 1


def test_what_was_learned_is_kept_by_a_pickled_copy() -> None:
    server = transformers_like()
    with serving_in_thread(server):
        interface = make(server.base_url)
        interface.generate(ask(interface))
        copy = pickle.loads(pickle.dumps(interface))
        copy.generate(ask(copy))
    assert len(server.received) == 3
    assert copy.statistics().dropped_fields == (("return_token_ids",),)


# --------------------------------------------------------------------------- True and False


@pytest.mark.parametrize(
    ("option", "field", "flag"),
    [
        ("return_token_ids", "return_token_ids", "--no-token-ids"),
        ("return_logprobs", "logprobs", "--no-logprobs"),
    ],
)
async def test_true_is_strict_and_the_error_says_what_to_do(
    option: str, field: str, flag: str
) -> None:
    server = transformers_like(known=CORE_FIELDS)
    async with serving(server):
        interface = make(server.base_url, max_retries=3, **{option: True})
        with trio.fail_after(PROMPT), pytest.raises(UnsupportedFieldError) as caught:
            await interface.agenerate(ask(interface))
    error = caught.value
    assert isinstance(error, BadRequestError)
    assert error.status == 422
    assert field in error.fields
    text = str(error)
    assert f"{server.base_url} refused {field}, which {option}=True requires" in text
    assert f"{option}=None to negotiate" in text
    assert f"{option}=False to not ask" in text
    assert flag in text
    assert field not in sum(interface.statistics().dropped_fields, ())


async def test_a_strict_field_stays_while_a_negotiable_one_is_dropped() -> None:
    server = transformers_like(known=CORE_FIELDS)
    async with serving(server):
        interface = make(server.base_url, return_logprobs=True)
        with trio.fail_after(PROMPT), pytest.raises(UnsupportedFieldError) as caught:
            await interface.agenerate(ask(interface))
    # return_token_ids was dropped and the request sent again; logprobs was kept, and refused.
    assert len(server.received) == 2
    assert server.received[1].body["logprobs"] is True
    assert caught.value.fields == ("logprobs",)
    assert interface.statistics().dropped_fields == (("return_token_ids",),)


async def test_true_against_a_server_that_accepts_works() -> None:
    server = vllm_like()
    async with serving(server):
        interface = make(server.base_url, return_token_ids=True, return_logprobs=True)
        with trio.fail_after(PROMPT):
            response = await interface.agenerate(ask(interface))
    assert response.token_ids is not None
    assert response.logprobs is not None


async def test_false_is_never_sent() -> None:
    vllm, text = vllm_like(), transformers_like(known=CORE_FIELDS)
    async with serving(vllm, text):
        interface = make(
            [vllm.base_url, text.base_url], return_token_ids=False, return_logprobs=False
        )
        with trio.fail_after(PROMPT):
            for _ in range(2):
                await interface.agenerate(ask(interface))
    received = vllm.received + text.received
    assert len(received) == 2  # the text-only replica accepted its request at once
    assert not any({"return_token_ids", "logprobs"} & r.body.keys() for r in received)


@pytest.mark.parametrize("value", ["yes", 1, 0])
def test_an_option_must_be_true_false_or_none(value: object) -> None:
    with pytest.raises(TypeError, match=r"return_token_ids must be None .* True .* False"):
        make("http://127.0.0.1:1/v1", return_token_ids=value)


# --------------------------------------------------------------------------- explicit fields


async def test_a_refused_extra_body_field_is_named_not_dropped() -> None:
    server = transformers_like()
    async with serving(server):
        interface = make(server.base_url, extra_body={"min_p": 0.05})
        with trio.fail_after(PROMPT), pytest.raises(UnsupportedFieldError) as caught:
            await interface.agenerate(ask(interface))
    error = caught.value
    assert error.fields == ("min_p",)
    assert "min_p (from extra_body) is not accepted by this server" in str(error)
    assert "remove it from extra_body" in str(error)
    assert all(r.body["min_p"] == 0.05 for r in server.received)


async def test_a_refused_generation_argument_is_named() -> None:
    server = openai_like()
    async with serving(server):
        interface = make(server.base_url, return_token_ids=False)
        with trio.fail_after(PROMPT), pytest.raises(UnsupportedFieldError) as caught:
            await interface.agenerate(ask(interface, top_k=5))
    error = caught.value
    assert error.status == 400
    assert error.fields == ("top_k",)
    assert "Unrecognized request argument supplied: top_k" in str(error)
    assert "top_k is not accepted by this server: leave GenerationArgs.top_k unset" in str(error)
    assert len(server.received) == 1


async def test_a_negotiable_field_given_in_extra_body_is_strict() -> None:
    server = transformers_like()
    async with serving(server):
        interface = make(server.base_url, extra_body={"return_token_ids": True})
        with trio.fail_after(PROMPT), pytest.raises(UnsupportedFieldError) as caught:
            await interface.agenerate(ask(interface))
    assert caught.value.fields == ("return_token_ids",)
    assert "from extra_body" in str(caught.value)
    assert len(server.received) == 1


async def test_a_refusal_that_names_no_negotiable_field_is_an_error(
    accepting: FakeOpenAIServer,
) -> None:
    message = "max_tokens is too large: 100000 > 2048 (max_model_len)"
    accepting.reply(Reply(status=400, json={"object": "error", "message": message}))
    interface = make(accepting.base_url, max_retries=3)
    with (
        trio.fail_after(PROMPT),
        pytest.raises(BadRequestError, match=re.escape(message)) as caught,
    ):
        await interface.agenerate(ask(interface, max_tokens=100_000))
    assert len(accepting.received) == 1
    assert type(caught.value) is BadRequestError  # the value is wrong, not the field
    # Named, but not as an unknown field: the hint does not claim the server refuses it.
    assert "the server names max_tokens (GenerationArgs.max_tokens=100000)" in str(caught.value)
    assert interface.statistics().dropped_fields == ((),)


async def test_a_validation_list_names_only_the_fields_it_locates(
    accepting: FakeOpenAIServer,
) -> None:
    # FastAPI echoes the whole request as "input": return_token_ids appears, but the
    # problem is elsewhere.
    detail = [
        {
            "type": "missing",
            "loc": ["body", "messages", 0, "content"],
            "msg": "Field required",
            "input": {"role": "user", "return_token_ids": True},
        }
    ]
    accepting.reply(Reply(status=422, json={"detail": detail}))
    interface = make(accepting.base_url)
    with trio.fail_after(PROMPT), pytest.raises(BadRequestError) as caught:
        await interface.agenerate(ask(interface))
    assert len(accepting.received) == 1
    assert "body.messages.0.content: Field required" in str(caught.value)
    assert interface.statistics().dropped_fields == ((),)


async def test_a_validation_list_locating_a_negotiable_field_drops_it(
    accepting: FakeOpenAIServer,
) -> None:
    detail = [
        {
            "type": "extra_forbidden",
            "loc": ["body", "return_token_ids"],
            "msg": "Extra inputs are not permitted",
            "input": True,
        }
    ]
    accepting.reply(Reply(status=422, json={"detail": detail}))
    interface = make(accepting.base_url)
    with trio.fail_after(PROMPT):
        await interface.agenerate(ask(interface))
    assert len(accepting.received) == 2
    assert interface.statistics().dropped_fields == (("return_token_ids",),)


# --------------------------------------------------------------------------- reading a refusal


@pytest.mark.parametrize(
    ("data", "message", "named"),
    [
        (
            None,
            "Unexpected fields in the request: {'return_token_ids', 'logprobs'}",
            {"return_token_ids", "logprobs"},
        ),
        (None, "Unrecognized request argument supplied: return_token_ids", {"return_token_ids"}),
        # Whole words only: a refusal of top_logprobs does not name logprobs.
        (None, "Unrecognized request argument supplied: top_logprobs", set()),
        (None, "return_token_ids_v2 is unknown", set()),
        (
            {"error": {"message": "not supported", "param": "logprobs"}},
            "not supported",
            {"logprobs"},
        ),
        (
            {"detail": [{"loc": ["body", "logprobs"], "msg": "Extra inputs are not permitted"}]},
            "body.logprobs: Extra inputs are not permitted",
            {"logprobs"},
        ),
    ],
)
def test_a_refusal_names_whole_fields_only(data: object, message: str, named: set[str]) -> None:
    assert named_fields(data, message, ["return_token_ids", "logprobs"]) == named


@pytest.mark.parametrize("transport", ["lean", "httpx2"])
async def test_requests_waiting_for_a_connection_learn_from_the_first_refusal(
    transport: str,
) -> None:
    # 32 first requests through 8 connections: the body is built when a request has its
    # connection, so only the 8 sent before the first refusal carry the refused field,
    # about one refusal per connection, not one per request.
    server = transformers_like()
    async with serving(server):
        interface = make(server.base_url, max_connections=8, max_retries=0, transport=transport)
        results: list[Any] = []

        async def one() -> None:
            results.append(await interface.agenerate(ask(interface)))

        with trio.fail_after(PROMPT):
            async with trio.open_nursery() as nursery:
                for _ in range(32):
                    nursery.start_soon(one)
    refusals = sum("return_token_ids" in r.body for r in server.received)
    assert len(results) == 32
    assert 1 <= refusals <= 8
    assert len(server.received) == 32 + refusals
    assert server.max_in_flight <= 8
