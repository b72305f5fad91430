"""What OpenAIInference's errors say: hints for a wrong base_url, HTML pages summarised,
501/505 not retried, and the API key redacted only where it can appear."""

from __future__ import annotations

import pickle
from collections.abc import AsyncIterator
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from _openai_server import (
    CORE_FIELDS,
    FakeOpenAIServer,
    Reply,
    failures_of_concurrent_calls,
    serving,
)
from _raw_http_server import RawConnection, raw_server, response

from trio_rollouts import GenerationArgs
from trio_rollouts.inference import (
    TRANSIENT_ERRORS,
    AuthenticationError,
    BadRequestError,
    InferenceError,
    InferenceRequest,
    MalformedResponseError,
    NotSupportedError,
    OpenAIInference,
    RetryBackoff,
    ServerError,
    UnsupportedFieldError,
)
from trio_rollouts.inference._errors import redact as _redact

NO_WAIT = RetryBackoff(initial=0.0, maximum=0.0, jitter=0.0)
PROMPT = 5.0

NGINX_404 = (
    "<html>\r\n<head><title>404 Not Found</title></head>\r\n<body>\r\n"
    "<center><h1>404 Not Found</h1></center>\r\n<hr><center>nginx/1.25.3</center>\r\n"
    "</body>\r\n</html>\r\n"
)


@pytest.fixture
async def server() -> AsyncIterator[FakeOpenAIServer]:
    fake = FakeOpenAIServer(name="a")
    async with serving(fake):
        yield fake


def make(url: str, **kwargs: Any) -> OpenAIInference:
    options: dict[str, Any] = {"model": "test-model", "api_key": "sk-test", "backoff": NO_WAIT}
    options.update(kwargs)
    return OpenAIInference(url, **options)


def ask(interface: OpenAIInference, **args: Any) -> InferenceRequest:
    return interface.prepare_request("hello", GenerationArgs(**args))


# --------------------------------------------------------------------------- base_url hints


async def test_a_base_url_without_v1_gets_a_hint(server: FakeOpenAIServer) -> None:
    root = server.base_url.removesuffix("/v1")
    interface = make(root, max_retries=3)
    with trio.fail_after(PROMPT), pytest.raises(BadRequestError) as caught:
        await interface.agenerate(ask(interface))
    assert caught.value.status == 404
    assert f"is base_url the API root, such as '{root}/v1'?" in str(caught.value)
    assert server.received == []  # starlette's own 404: the route was never reached


async def test_a_base_url_past_the_api_root_gets_the_root_as_the_hint(
    server: FakeOpenAIServer,
) -> None:
    interface = make(f"{server.base_url}/models")
    with trio.fail_after(PROMPT), pytest.raises(BadRequestError) as caught:
        await interface.agenerate(ask(interface))
    assert f"is base_url the API root, such as '{server.base_url}'?" in str(caught.value)


async def test_a_404_under_v1_asks_whether_the_server_serves_the_endpoint(
    server: FakeOpenAIServer,
) -> None:
    server.reply(Reply(status=404, text="Not Found"))
    interface = make(server.base_url)
    with trio.fail_after(PROMPT), pytest.raises(BadRequestError) as caught:
        await interface.agenerate(ask(interface))
    assert "does it serve /chat/completions (endpoint='chat')?" in str(caught.value)


async def test_an_unknown_model_404_gets_no_base_url_hint(server: FakeOpenAIServer) -> None:
    message = "The model `gpt-9` does not exist or you do not have access to it."
    server.reply(Reply(status=404, json={"error": {"message": message, "code": "model_not_found"}}))
    interface = make(server.base_url)
    with trio.fail_after(PROMPT), pytest.raises(BadRequestError) as caught:
        await interface.agenerate(ask(interface))
    assert str(caught.value).endswith(message)


async def test_a_model_that_is_not_served_is_named_with_the_models_served() -> None:
    fake = FakeOpenAIServer(name="a", models=("Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B"))
    async with serving(fake):
        interface = make(fake.base_url, model="qwen3-8b", max_retries=3)
        errors = await failures_of_concurrent_calls(interface, ask(interface), 20)
        assert {type(error) for error in errors} == {BadRequestError}
        with trio.fail_after(PROMPT):
            served = attrs.evolve(interface, model="Qwen/Qwen3-8B")
            await served.agenerate(ask(served))
    assert str(errors[0]) == (
        f"POST {fake.base_url}/chat/completions returned 404: model 'qwen3-8b' is not served "
        f"by {fake.base_url}; it serves: 'Qwen/Qwen3-8B', 'Qwen/Qwen3-0.6B'"
    )
    assert errors[0].server_message == "The model `qwen3-8b` does not exist."
    assert fake.models_received == 1  # asked once for the run, not per failed request
    assert len(fake.received) == 21  # a wrong model is not retried


@pytest.mark.parametrize("models_status", [500, 404])
async def test_a_failing_models_list_leaves_the_servers_message(models_status: int) -> None:
    fake = FakeOpenAIServer(name="a", models=("Qwen/Qwen3-8B",), models_status=models_status)
    async with serving(fake):
        interface = make(fake.base_url, model="qwen3-8b")
        with trio.fail_after(PROMPT), pytest.raises(BadRequestError) as caught:
            await interface.agenerate(ask(interface))
    assert str(caught.value).endswith(": The model `qwen3-8b` does not exist.")
    assert fake.models_received == 1


async def test_a_models_list_that_does_not_answer_leaves_the_servers_message(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # /models is a raw server that never answers: the error waits for it MODELS_TIMEOUT.
    async def handler(conn: RawConnection) -> None:
        while (request := await conn.receive_request()) is not None:
            if request.method == "GET":
                await trio.sleep_forever()
            body = b'{"error": {"message": "The model `x` does not exist."}}'
            await conn.send(response(body, status=404, reason=b"Not Found"))

    async with raw_server(handler) as server:
        interface = make(server.url("/v1").rstrip("/"), model="x", transport="lean")
        with pytest.raises(BadRequestError) as caught:
            await interface.agenerate(ask(interface))
    assert str(caught.value).endswith(": The model `x` does not exist.")


async def test_a_405_gets_a_hint(server: FakeOpenAIServer) -> None:
    server.reply(Reply(status=405, json={"detail": "Method Not Allowed"}))
    interface = make(server.base_url)
    with trio.fail_after(PROMPT), pytest.raises(BadRequestError, match="API root"):
        await interface.agenerate(ask(interface))


# --------------------------------------------------------------------------- HTML pages


async def test_an_html_error_page_is_summarised_never_pasted(server: FakeOpenAIServer) -> None:
    server.reply(Reply(status=404, text=NGINX_404, headers={"content-type": "text/html"}))
    interface = make(server.base_url)
    with trio.fail_after(PROMPT), pytest.raises(BadRequestError) as caught:
        await interface.agenerate(ask(interface))
    text = str(caught.value)
    assert "an HTML page titled '404 Not Found'" in text
    assert "<" not in text
    assert "\n" not in text
    assert caught.value.server_message == "an HTML page titled '404 Not Found'"


async def test_markup_without_an_html_content_type_is_summarised_too(
    server: FakeOpenAIServer,
) -> None:
    page = "<!DOCTYPE html><html><body><p>It works!</p></body></html>"
    server.reply(Reply(status=502, text=page, headers={"content-type": "text/plain"}))
    interface = make(server.base_url, max_retries=0)
    with trio.fail_after(PROMPT), pytest.raises(ServerError) as caught:
        await interface.agenerate(ask(interface))
    assert "an HTML page (no title)" in str(caught.value)
    assert "<" not in str(caught.value)


async def test_an_html_page_with_status_200_is_malformed_with_a_hint(
    server: FakeOpenAIServer,
) -> None:
    page = "<html><head><title>Open WebUI &amp; friends</title></head><body>app</body></html>"
    server.reply(Reply(text=page, headers={"content-type": "text/html; charset=utf-8"}))
    interface = make(server.base_url, max_retries=3)
    with trio.fail_after(PROMPT), pytest.raises(MalformedResponseError) as caught:
        await interface.agenerate(ask(interface))
    text = str(caught.value)
    assert "an HTML page titled 'Open WebUI & friends', not JSON" in text
    assert "is base_url the API root" in text
    assert "<" not in text
    assert len(server.received) == 1


async def test_a_multiline_server_message_is_one_line(server: FakeOpenAIServer) -> None:
    server.reply(Reply(status=500, text="Traceback (most recent call last):\n  boom\n"))
    interface = make(server.base_url, max_retries=0)
    with trio.fail_after(PROMPT), pytest.raises(ServerError) as caught:
        await interface.agenerate(ask(interface))
    assert "Traceback (most recent call last): boom" in str(caught.value)


# --------------------------------------------------------------------------- 501 and 505


@pytest.mark.parametrize("status", [501, 505])
async def test_not_implemented_is_not_retried(server: FakeOpenAIServer, status: int) -> None:
    message = "This server does not support embeddings. Start it with `--embeddings`"
    error_json = {"error": {"code": status, "message": message, "type": "not_supported_error"}}
    server.reply(Reply(status=status, json=error_json))
    interface = make(server.base_url, max_retries=3)
    with trio.fail_after(PROMPT), pytest.raises(NotSupportedError) as caught:
        await interface.agenerate(ask(interface))
    assert len(server.received) == 1
    assert interface.statistics().retries == 0
    assert caught.value.status == status
    assert message in str(caught.value)
    assert not isinstance(caught.value, ServerError)


def test_not_supported_is_not_transient() -> None:
    assert issubclass(NotSupportedError, InferenceError)
    assert not issubclass(NotSupportedError, TRANSIENT_ERRORS)


def test_unsupported_field_error_is_a_bad_request_and_pickles() -> None:
    error = UnsupportedFieldError(
        "refused", fields=("top_k",), url="http://h/v1", status=400, server_message="no"
    )
    assert isinstance(error, BadRequestError)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is UnsupportedFieldError
    assert (str(copy), copy.fields, copy.status) == ("refused", ("top_k",), 400)


# --------------------------------------------------------------------------- API key redaction

KEY = "sk-proj-4fG7hJ2kL9mN3pQ8rS1tU6vW"


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        # A short key never mangles words that happen to contain it.
        (
            "Unrecognized request argument supplied: return_token_ids",
            "k",
            "Unrecognized request argument supplied: return_token_ids",
        ),
        ("top_k must be -1 or at least 1, got k", "k", "top_k must be -1 or at least 1, got ***"),
        (f"Incorrect API key provided: {KEY}.", KEY, "Incorrect API key provided: ***."),
        (f"key {KEY} is not valid", KEY, "key *** is not valid"),
        (f"the token {KEY}suffix is unknown", KEY, f"the token {KEY}suffix is unknown"),
        (f"Invalid header Authorization: Bearer {KEY}", None, "Invalid header Authorization: ***"),
        (f"bad credentials: bearer {KEY}", None, "bad credentials: bearer ***"),
        (
            f'headers: {{"authorization": "Bearer {KEY}"}}',
            None,
            'headers: {"authorization": "***"}',
        ),
        (f"x-api-key: {KEY} refused", None, "x-api-key: *** refused"),
        (
            f"GET https://h/v1/models?api_key={KEY}&x=1 failed",
            None,
            "GET https://h/v1/models?api_key=***&x=1 failed",
        ),
        (f"see https://h/v1?key={KEY}", None, "see https://h/v1?key=***"),
        (
            f"proxy https://user:{KEY}@proxy:3128 down",
            None,
            "proxy https://user:***@proxy:3128 down",
        ),
    ],
)
def test_the_key_is_redacted_where_it_can_appear(text: str, key: str | None, expected: str) -> None:
    assert _redact(text, key) == expected


async def test_a_one_character_key_leaves_the_server_message_intact() -> None:
    server = FakeOpenAIServer(unknown_fields="openai", known_fields=CORE_FIELDS)
    async with serving(server):
        interface = make(server.base_url, api_key="k", return_token_ids=True, return_logprobs=False)
        with trio.fail_after(PROMPT), pytest.raises(UnsupportedFieldError) as caught:
            await interface.agenerate(ask(interface))
    assert "Unrecognized request argument supplied: return_token_ids" in str(caught.value)
    assert caught.value.server_message == (
        "Unrecognized request argument supplied: return_token_ids"
    )


async def test_a_realistic_key_echoed_by_the_server_is_redacted(server: FakeOpenAIServer) -> None:
    message = f"Invalid Authorization header 'Bearer {KEY}'; key {KEY} revoked"
    server.reply(Reply(status=403, json={"error": {"message": message}}))
    interface = make(server.base_url, api_key=KEY)
    with trio.fail_after(PROMPT), pytest.raises(AuthenticationError) as caught:
        await interface.agenerate(ask(interface))
    error = caught.value
    assert KEY not in str(error)
    assert KEY not in str(error.server_message)
    assert "key *** revoked" in str(error)
