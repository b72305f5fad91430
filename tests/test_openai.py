"""OpenAIInference against a real HTTP server on 127.0.0.1 (tests/_openai_server.py).

Real sockets need real time: every test bounds its waits with ``trio.fail_after`` and keeps
delays to fractions of a second. Backoff is zero unless a test is about backoff.
"""

from __future__ import annotations

import logging
import pickle
import random
import re
import socket
from collections.abc import AsyncIterator
from typing import Any

import attrs
import httpx2
import pytest
import stamina
import trio
import trio.testing
from _openai_server import (
    DEFAULT_LOGPROB,
    FakeOpenAIServer,
    Reply,
    failures_of_concurrent_calls,
    serving,
    serving_in_thread,
)
from _raw_http_server import ScriptedResolver

from trio_rollouts import ChatMessage, GenerationArgs
from trio_rollouts.inference import (
    DEFAULT_TIMEOUT,
    TRANSIENT_ERRORS,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InferenceConnectionError,
    InferenceError,
    InferenceRequest,
    InferenceTimeoutError,
    Limits,
    MalformedResponseError,
    OpenAIInference,
    RateLimitError,
    RetryBackoff,
    RetryReason,
    ReturnsLogProbs,
    ReturnsRaw,
    ServerError,
    Timeout,
    render_plain_chat,
)
from trio_rollouts.inference.http._transport import HTTPXTransport, LeanTransport, Transport
from trio_rollouts.inference.openai._parse import retry_after as _retry_after

#: No waiting between attempts: these tests count attempts, not seconds.
NO_WAIT = RetryBackoff(initial=0.0, maximum=0.0, jitter=0.0)

#: Upper bound for anything that should be quick on loopback.
PROMPT = 5.0


@pytest.fixture
async def server() -> AsyncIterator[FakeOpenAIServer]:
    fake = FakeOpenAIServer(name="a")
    async with serving(fake):
        yield fake


@pytest.fixture
async def replicas() -> AsyncIterator[tuple[FakeOpenAIServer, FakeOpenAIServer]]:
    first, second = FakeOpenAIServer(name="a"), FakeOpenAIServer(name="b")
    async with serving(first, second):
        yield first, second


#: Options of every interface make() builds; the transport fixture sets "transport".
DEFAULTS: dict[str, Any] = {"model": "test-model", "api_key": "sk-test", "backoff": NO_WAIT}


@pytest.fixture(autouse=True, params=["lean", "httpx2"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test of this module runs on both transports: the lean HTTP/1.1 pool (the
    default) and httpx2 (kept for proxies)."""
    monkeypatch.setitem(DEFAULTS, "transport", request.param)
    return str(request.param)


def make(url: str | list[str], **kwargs: Any) -> OpenAIInference:
    options = {**DEFAULTS, **kwargs}
    return OpenAIInference(base_url=url, **options)


def ask(interface: OpenAIInference, text: str = "hello", **args: Any) -> InferenceRequest:
    return interface.prepare_request(text, GenerationArgs(**args))


def closed_port_url() -> str:
    # Bind then close: nothing listens there, so connecting is refused at once.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


# --------------------------------------------------------------------------- configuration


def test_is_an_inference_interface_with_raw_text_and_logprobs() -> None:
    interface = make("http://127.0.0.1:1/v1")
    assert isinstance(interface, ReturnsRaw)
    assert isinstance(interface, ReturnsLogProbs)


def test_defaults_are_explicit_timeout_and_limits() -> None:
    interface = make("http://127.0.0.1:1/v1", max_connections=7)
    assert interface.timeout == DEFAULT_TIMEOUT
    assert interface.timeout.pool is None
    assert interface.limits == httpx2.Limits(
        max_connections=7, max_keepalive_connections=7, keepalive_expiry=5.0
    )


def test_timeout_accepts_seconds() -> None:
    interface = make("http://127.0.0.1:1/v1", timeout=2.5)
    assert interface.timeout == httpx2.Timeout(2.5)


def test_timeout_and_limits_are_the_librarys_own_types() -> None:
    timeout = Timeout(connect=1.0, read=2.0, write=3.0, pool=None)
    interface = make(
        "http://127.0.0.1:1/v1",
        timeout=timeout,
        limits=Limits(max_connections=3, keepalive_expiry=1),
    )
    assert interface.timeout == timeout
    assert interface.limits == Limits(
        max_connections=3, max_keepalive_connections=3, keepalive_expiry=1
    )
    assert interface.max_connections == 3


def test_default_timeout_is_the_documented_one() -> None:
    assert DEFAULT_TIMEOUT == Timeout() == Timeout(connect=5.0, read=600.0, write=600.0, pool=None)
    assert httpx2.Timeout(600.0, connect=5.0, pool=None) == DEFAULT_TIMEOUT


def test_an_httpx2_timeout_is_still_accepted_and_converted() -> None:
    interface = make("http://127.0.0.1:1/v1", timeout=httpx2.Timeout(9.0, connect=1.0))
    assert type(interface.timeout) is Timeout
    assert interface.timeout == Timeout(connect=1.0, read=9.0, write=9.0, pool=9.0)


def test_none_is_no_limit_for_every_phase() -> None:
    interface = make("http://127.0.0.1:1/v1", timeout=None)
    assert interface.timeout == Timeout(connect=None, read=None, write=None, pool=None)


def test_limits_and_max_connections_must_agree() -> None:
    with pytest.raises(ValueError, match="disagree"):
        make("http://127.0.0.1:1/v1", max_connections=7, limits=Limits(max_connections=3))


@pytest.mark.parametrize(
    ("build", "error", "name"),
    [
        (lambda: Timeout(read=-1.0), ValueError, "Timeout.read"),
        (lambda: Timeout(connect=float("nan")), ValueError, "Timeout.connect"),
        (lambda: Timeout(pool="5"), TypeError, "Timeout.pool"),
        (lambda: Limits(max_connections=0), ValueError, "max_connections"),
        (lambda: Limits(max_keepalive_connections=1.5), TypeError, "max_keepalive_connections"),
        (lambda: Limits(keepalive_expiry=-1), ValueError, "Limits.keepalive_expiry"),
        (lambda: make("http://127.0.0.1:1/v1", timeout="5"), TypeError, "Timeout"),
        (lambda: make("http://127.0.0.1:1/v1", timeout=-2), ValueError, "Timeout.connect"),
        (lambda: make("http://127.0.0.1:1/v1", limits=8), TypeError, "Limits"),
    ],
)
def test_a_bad_timeout_or_limit_names_the_field(
    build: Any, error: type[Exception], name: str
) -> None:
    with pytest.raises(error, match=re.escape(name)):
        build()


def test_base_url_list_is_normalized() -> None:
    interface = make(["http://127.0.0.1:1/v1/", "http://127.0.0.1:2/v1"])
    assert interface.base_url == ("http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1")


@pytest.mark.parametrize("url", ["127.0.0.1:8000/v1", "ftp://host/v1", ""])
def test_base_url_must_be_http(url: str) -> None:
    with pytest.raises(ValueError, match="http"):
        make(url)


@pytest.mark.parametrize(
    ("url", "advice"),
    [
        (
            "http://10.0.0.7:8000/v1/chat/completions",
            "use base_url='http://10.0.0.7:8000/v1' (the client posts to base_url + "
            "'/chat/completions' for endpoint='chat')",
        ),
        (
            "http://10.0.0.7:8000/v1/completions/",
            "use base_url='http://10.0.0.7:8000/v1', endpoint='completions' (",
        ),
    ],
)
def test_an_endpoint_url_as_base_url_is_refused_with_the_root_to_give(
    url: str, advice: str
) -> None:
    with pytest.raises(ValueError, match="is the URL of an endpoint, not the API root") as caught:
        make(url)
    assert advice in str(caught.value)


@pytest.mark.parametrize(
    ("key", "advice"),
    [
        ("model", "give it as OpenAIInference(model=...)"),
        ("messages", "request's prompt"),
        ("prompt", "request's prompt"),
        ("tools", "InferenceRequest(tools=...)"),
        ("stream", "does not stream"),
        ("n", "one request per sample"),
    ],
)
def test_extra_body_may_not_set_what_the_client_sets_or_cannot_honour(
    key: str, advice: str
) -> None:
    with pytest.raises(ValueError, match=f"extra_body may not set '{key}'") as caught:
        make("http://127.0.0.1:1/v1", extra_body={key: "x"})
    assert advice in str(caught.value)


def test_duplicate_replicas_are_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        make(["http://127.0.0.1:1/v1", "http://127.0.0.1:1/v1/"])


def test_api_key_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    interface = OpenAIInference(base_url="http://127.0.0.1:1/v1", model="m")
    assert interface.api_key == "sk-from-env"


def test_repr_hides_the_api_key() -> None:
    interface = make("http://127.0.0.1:1/v1", api_key="sk-very-secret")
    assert "sk-very-secret" not in repr(interface)
    assert "***" in repr(interface)


def test_repr_hides_credentials_in_the_url() -> None:
    interface = make("http://user:hunter2@127.0.0.1:1/v1")
    assert "hunter2" not in repr(interface)
    assert "hunter2" not in str(interface.statistics().base_urls)


def test_model_must_be_named() -> None:
    with pytest.raises(ValueError, match="model"):
        make("http://127.0.0.1:1/v1", model="")


def test_the_configuration_is_frozen() -> None:
    interface = make("http://127.0.0.1:1/v1")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        interface.max_retries = 9  # type: ignore[misc]


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({"retry-after": "2"}, 2.0),
        ({"retry-after": "0.25"}, 0.25),
        ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),
        ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, 0.0),
        ({"retry-after": "soon"}, None),
        ({}, None),
    ],
)
def test_retry_after_header_forms(headers: dict[str, str], seconds: float | None) -> None:
    assert _retry_after(httpx2.Headers(headers)) == seconds


def test_interfaces_hash_by_identity() -> None:
    first, second = make("http://127.0.0.1:1/v1"), make("http://127.0.0.1:1/v1")
    assert first != second
    assert len({first, second}) == 2


# --------------------------------------------------------------------------- requests


async def test_every_set_generation_arg_is_forwarded_exactly(server: FakeOpenAIServer) -> None:
    interface = make(server.base_url)
    with trio.fail_after(PROMPT):
        await interface.agenerate(ask(interface, temperature=0.0, top_p=0.5, top_k=7, max_tokens=9))
    body = server.received[0].body
    assert body["temperature"] == 0.0
    assert isinstance(body["temperature"], float)
    assert (body["top_p"], body["top_k"], body["max_tokens"]) == (0.5, 7, 9)


async def test_unset_generation_args_are_left_out(server: FakeOpenAIServer) -> None:
    interface = make(server.base_url)
    with trio.fail_after(PROMPT):
        await interface.agenerate(ask(interface))
    assert not {"temperature", "top_p", "top_k", "max_tokens"} & server.received[0].body.keys()


async def test_chat_request_names_model_and_asks_for_tokens(server: FakeOpenAIServer) -> None:
    interface = make(server.base_url)
    with trio.fail_after(PROMPT):
        await interface.agenerate(ask(interface))
    received = server.received[0]
    assert received.path == "/v1/chat/completions"
    assert received.body["model"] == "test-model"
    assert received.body["return_token_ids"] is True
    assert received.body["logprobs"] is True
    assert received.headers["authorization"] == "Bearer sk-test"


async def test_token_and_logprob_flags_can_be_turned_off(server: FakeOpenAIServer) -> None:
    interface = make(server.base_url, return_token_ids=False, return_logprobs=False)
    with trio.fail_after(PROMPT):
        response = await interface.agenerate(ask(interface))
    assert not {"return_token_ids", "logprobs"} & server.received[0].body.keys()
    assert response.token_ids is None
    assert response.logprobs is None


async def test_extra_body_is_sent_but_cannot_replace_set_args(server: FakeOpenAIServer) -> None:
    interface = make(server.base_url, extra_body={"min_p": 0.1, "temperature": 1.0})
    with trio.fail_after(PROMPT):
        await interface.agenerate(ask(interface, temperature=0.0))
    body = server.received[0].body
    assert body["min_p"] == 0.1
    assert body["temperature"] == 0.0


async def test_multi_message_prompts_and_tools_pass_through(server: FakeOpenAIServer) -> None:
    interface = make(server.base_url)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]
    prompt = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Add."),
        ChatMessage(role="assistant", content="", extra={"tool_calls": call}),
        ChatMessage(role="tool", content="3", extra={"tool_call_id": "c1"}),
    ]
    with trio.fail_after(PROMPT):
        await interface.agenerate(InferenceRequest(prompt=prompt, tools=tools))
    body = server.received[0].body
    assert body["tools"] == tools
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add."},
        {"role": "assistant", "content": "", "tool_calls": call},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]


async def test_chat_response_fills_text_tokens_and_logprobs(server: FakeOpenAIServer) -> None:
    interface = make(server.base_url)
    request = ask(interface, "hello")
    with trio.fail_after(PROMPT):
        response = await interface.agenerate(request)
    completion = "a: hello"
    assert response.response == ChatMessage(role="assistant", content=completion)
    assert response.raw_text == render_plain_chat(request.prompt) + completion
    # The fake server reports one prompt token per message: its length.
    assert response.token_ids == [5, *map(ord, completion)]
    assert response.prompt_length == 1
    assert response.logprobs == [DEFAULT_LOGPROB] * len(completion)
    assert response.finish_reason == "stop"
    # No stamps from the server: the call is stamped with the epoch it started under.
    assert response.policy_epoch == [(0, 0)]
    assert (response.kv_cache_epoch, response.num_evictions) == ([], 0)


async def test_tool_calls_are_kept_on_the_reply(server: FakeOpenAIServer) -> None:
    call = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]
    message = {"role": "assistant", "content": None, "tool_calls": call}
    server.reply(Reply(choice_extra={"message": message, "finish_reason": "tool_calls"}))
    interface = make(server.base_url)
    with trio.fail_after(PROMPT):
        response = await interface.agenerate(ask(interface))
    assert response.response.content == ""
    assert response.response.extra == {"tool_calls": call}
    assert response.finish_reason == "tool_calls"


async def test_megatron_fields_are_parsed(server: FakeOpenAIServer) -> None:
    server.reply(
        Reply(
            choice_extra={
                "raw_text": "<s>[INST] hello [/INST] hi",
                "prompt_token_ids": [1, 2, 3],
                "generation_token_ids": [7, 8],
                "generation_log_probs": [-0.25, -1.0],
                "policy_epoch": [[0, 3], [1, 4]],
                "kv_cache_epoch": [[0, 3]],
                "num_evictions": 2,
                "finish_reason": "length",
            }
        )
    )
    interface = make(server.base_url, return_token_ids=False, return_logprobs=False)
    with trio.fail_after(PROMPT):
        response = await interface.agenerate(ask(interface))
    assert response.raw_text == "<s>[INST] hello [/INST] hi"
    assert (response.token_ids, response.prompt_length) == ([1, 2, 3, 7, 8], 3)
    assert response.logprobs == [-0.25, -1.0]
    assert response.policy_epoch == [(0, 3), (1, 4)]
    assert response.kv_cache_epoch == [(0, 3)]
    assert response.num_evictions == 2
    assert response.finish_reason == "length"


async def test_a_bare_epoch_number_means_from_the_first_token(server: FakeOpenAIServer) -> None:
    server.reply(Reply(choice_extra={"policy_epoch": 5}))
    interface = make(server.base_url)
    with trio.fail_after(PROMPT):
        response = await interface.agenerate(ask(interface))
    assert response.policy_epoch == [(0, 5)]


async def test_completions_endpoint_sends_the_rendered_prompt(server: FakeOpenAIServer) -> None:
    interface = make(server.base_url, endpoint="completions")
    request = ask(interface, "hello")
    with trio.fail_after(PROMPT):
        response = await interface.agenerate(request)
    received = server.received[0]
    prompt = render_plain_chat(request.prompt)
    assert received.path == "/v1/completions"
    assert received.body["prompt"] == prompt
    assert received.body["logprobs"] == 1
    completion = "a: <|assistant|>"
    assert response.response.content == completion
    assert response.raw_text == prompt + completion
    assert response.token_ids == [ord(c) for c in prompt + completion]
    assert response.prompt_length == len(prompt)
    assert response.logprobs == [DEFAULT_LOGPROB] * len(completion)


async def test_completions_endpoint_refuses_tools() -> None:
    interface = make("http://127.0.0.1:1/v1", endpoint="completions")
    request = InferenceRequest(
        prompt=[ChatMessage(role="user", content="x")], tools=[{"type": "function"}]
    )
    with pytest.raises(ValueError, match="endpoint='chat'"):
        await interface.agenerate(request)


# --------------------------------------------------------------------------- errors and retries


@pytest.mark.parametrize("status", [500, 502, 503, 408, 409, 429])
async def test_transient_statuses_are_retried(server: FakeOpenAIServer, status: int) -> None:
    server.reply(Reply(status=status, json={"error": {"message": "busy"}}))
    interface = make(server.base_url, max_retries=2)
    with trio.fail_after(PROMPT):
        response = await interface.agenerate(ask(interface))
    assert response.response.content == "a: hello"
    assert len(server.received) == 2
    assert interface.statistics().retries == 1


async def test_retries_stop_after_max_retries(server: FakeOpenAIServer) -> None:
    server.default = Reply(status=503, json={"error": {"message": "overloaded"}})
    interface = make(server.base_url, max_retries=3)
    with trio.fail_after(PROMPT), pytest.raises(ServerError) as caught:
        await interface.agenerate(ask(interface))
    assert len(server.received) == 4
    assert caught.value.status == 503
    assert "gave up after 4 attempts" in "".join(caught.value.__notes__)


async def test_max_retries_zero_makes_one_attempt(server: FakeOpenAIServer) -> None:
    server.default = Reply(status=500)
    interface = make(server.base_url, max_retries=0)
    with trio.fail_after(PROMPT), pytest.raises(ServerError):
        await interface.agenerate(ask(interface))
    assert len(server.received) == 1


@pytest.mark.parametrize("mode", ["inactive", "testing"])
async def test_stamina_decides_the_retries_after_a_first_failure(
    server: FakeOpenAIServer, mode: str
) -> None:
    """The first attempt runs outside stamina, but stamina's switches still govern
    whether a retry follows (and set_testing(attempts=n) how many attempts in all)."""
    server.default = Reply(status=503, json={"error": {"message": "overloaded"}})
    interface = make(server.base_url, max_retries=3)
    active = stamina.is_active()
    try:
        if mode == "inactive":
            stamina.set_active(False)
        else:
            stamina.set_testing(True, attempts=2)
        with trio.fail_after(PROMPT), pytest.raises(ServerError):
            await interface.agenerate(ask(interface))
    finally:
        stamina.set_testing(False)
        stamina.set_active(active)
    expected = 1 if mode == "inactive" else 2
    assert len(server.received) == expected
    assert interface.statistics().retries == expected - 1


async def test_a_retried_error_is_not_chained_to_the_first(server: FakeOpenAIServer) -> None:
    server.reply(Reply(status=503, json={"error": {"message": "first"}}))
    server.default = Reply(status=400, json={"error": {"message": "second"}})
    interface = make(server.base_url, max_retries=2)
    with trio.fail_after(PROMPT), pytest.raises(BadRequestError) as caught:
        await interface.agenerate(ask(interface))
    assert caught.value.__context__ is None
    assert len(server.received) == 2


@pytest.mark.parametrize("status", [400, 404, 422])
async def test_other_client_errors_are_not_retried(server: FakeOpenAIServer, status: int) -> None:
    message = "max_tokens must be at least 1"
    server.reply(Reply(status=status, json={"error": {"message": message}}))
    interface = make(server.base_url, max_retries=3)
    with trio.fail_after(PROMPT), pytest.raises(BadRequestError) as caught:
        await interface.agenerate(ask(interface))
    assert len(server.received) == 1
    text = str(caught.value)
    assert f"{server.base_url}/chat/completions" in text
    assert str(status) in text
    assert message in text
    assert caught.value.server_message == message


async def test_vllm_style_error_message_is_reported(server: FakeOpenAIServer) -> None:
    server.reply(Reply(status=400, json={"object": "error", "message": "bad top_k", "code": 400}))
    interface = make(server.base_url)
    with trio.fail_after(PROMPT), pytest.raises(BadRequestError, match="bad top_k"):
        await interface.agenerate(ask(interface))


async def test_plain_text_error_body_is_reported(server: FakeOpenAIServer) -> None:
    server.reply(Reply(status=500, text="Inference request(s) failed: boom"))
    interface = make(server.base_url, max_retries=0)
    with trio.fail_after(PROMPT), pytest.raises(ServerError, match="failed: boom"):
        await interface.agenerate(ask(interface))


async def test_unauthorized_error_never_shows_the_key(
    server: FakeOpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    server.api_key = "sk-the-right-one"
    secret = "sk-wrong-and-secret"
    interface = make(server.base_url, api_key=secret, max_retries=3)
    caplog.set_level(logging.DEBUG)
    with trio.fail_after(PROMPT), pytest.raises(AuthenticationError) as caught:
        await interface.agenerate(ask(interface))
    error = caught.value
    assert len(server.received) == 1
    assert error.status == 401
    assert "Incorrect API key provided: ***" in str(error)
    shown = [str(error), repr(error), str(error.server_message), *getattr(error, "__notes__", [])]
    assert not [text for text in shown if secret in text]
    assert secret not in caplog.text


async def test_retry_after_is_honoured(server: FakeOpenAIServer) -> None:
    server.reply(Reply(status=429, headers={"retry-after-ms": "300"}))
    # Were Retry-After ignored, the 30 s backoff would trip fail_after.
    backoff = RetryBackoff(initial=30.0, maximum=30.0, jitter=0.0)
    interface = make(server.base_url, backoff=backoff)
    start = trio.current_time()
    with trio.fail_after(PROMPT):
        await interface.agenerate(ask(interface))
    assert trio.current_time() - start >= 0.3
    assert len(server.received) == 2


async def test_retry_after_is_capped(server: FakeOpenAIServer) -> None:
    server.reply(Reply(status=503, headers={"retry-after": "3600"}))
    backoff = RetryBackoff(initial=0.0, maximum=0.0, jitter=0.0, max_retry_after=0.05)
    interface = make(server.base_url, backoff=backoff)
    with trio.fail_after(PROMPT):
        await interface.agenerate(ask(interface))
    assert len(server.received) == 2


async def test_backoff_grows_exponentially_with_bounded_jitter(server: FakeOpenAIServer) -> None:
    server.reply(*[Reply(status=500) for _ in range(3)])
    waits: list[float] = []
    stamina.instrumentation.set_on_retry_hooks([lambda details: waits.append(details.wait_for)])
    try:
        backoff = RetryBackoff(initial=0.01, maximum=1.0, jitter=0.005)
        interface = make(server.base_url, backoff=backoff, max_retries=3)
        with trio.fail_after(PROMPT):
            await interface.agenerate(ask(interface))
    finally:
        stamina.instrumentation.set_on_retry_hooks(None)
    assert len(waits) == 3
    for n, wait in enumerate(waits):
        assert 0.01 * 2**n <= wait <= 0.01 * 2**n + 0.005


async def test_connection_refused_is_retried_then_raised() -> None:
    url = closed_port_url()
    interface = make(url, max_retries=2)
    with trio.fail_after(PROMPT), pytest.raises(InferenceConnectionError) as caught:
        await interface.agenerate(ask(interface))
    assert interface.statistics().attempts == (3,)
    assert url in str(caught.value)


async def test_connection_refused_says_so_on_one_line() -> None:
    url = closed_port_url()
    interface = make(url, max_retries=0)
    with trio.fail_after(PROMPT), pytest.raises(InferenceConnectionError) as caught:
        await interface.agenerate(ask(interface))
    host_port = url.removeprefix("http://").removesuffix("/v1")
    assert str(caught.value) == (
        f"POST {url}/chat/completions failed: connection refused: is a server listening on "
        f"{host_port}?"
    )


async def test_a_host_name_that_does_not_exist_is_final_and_named() -> None:
    resolver = ScriptedResolver().install()
    url = "http://no-such-host.invalid:8000/v1"
    interface = make(url, max_retries=3)
    errors = await failures_of_concurrent_calls(interface, ask(interface), 512)  # the CLI's default
    assert interface.statistics().attempts == (512,)  # none retried
    assert {type(error) for error in errors} == {InferenceError}
    assert not isinstance(errors[0], TRANSIENT_ERRORS)
    assert str(errors[0]) == (
        f"POST {url}/chat/completions failed: cannot resolve host 'no-such-host.invalid' "
        "(Name or service not known): check the host name"
    )
    if interface.uses_lean_transport:  # connects share lookups: a few, not one per request
        assert resolver.calls < 10


async def test_a_temporary_lookup_failure_stays_transient() -> None:
    class TryAgain(ScriptedResolver):
        async def getaddrinfo(self, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            await trio.lowlevel.checkpoint()
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    TryAgain().install()
    interface = make("http://flaky.invalid:8000/v1", max_retries=1)
    with trio.fail_after(PROMPT), pytest.raises(InferenceConnectionError) as caught:
        await interface.agenerate(ask(interface))
    assert "cannot resolve host 'flaky.invalid' (Temporary failure" in str(caught.value)
    assert interface.statistics().attempts == (2,)


async def test_a_lookup_stuck_behind_busy_threads_is_not_read_as_a_timeout(
    transport: str,
) -> None:
    # The first lookups never answer, as when they queue behind Trio's busy resolver
    # threads; a name that does not exist must still come out as such, not as timeouts.
    ScriptedResolver(hang_first=4 if transport == "httpx2" else 1).install()
    interface = make(
        "http://no-such-host.invalid:8000/v1",
        max_connections=4,
        timeout=Timeout(connect=0.2),
        max_retries=3,
    )
    errors = await failures_of_concurrent_calls(interface, ask(interface), 4)
    assert {type(error) for error in errors} == {InferenceError}
    assert all("cannot resolve host 'no-such-host.invalid'" in str(e) for e in errors)


async def test_slow_server_raises_timeout_error(server: FakeOpenAIServer) -> None:
    server.default = Reply(delay=10.0)
    interface = make(server.base_url, timeout=httpx2.Timeout(10.0, read=0.2), max_retries=1)
    with trio.fail_after(PROMPT), pytest.raises(InferenceTimeoutError) as caught:
        await interface.agenerate(ask(interface))
    assert len(server.received) == 2
    assert "timed out" in str(caught.value)
    assert f"{server.base_url}/chat/completions" in str(caught.value)


async def test_a_timeout_error_names_the_field_to_raise(server: FakeOpenAIServer) -> None:
    server.default = Reply(delay=10.0)
    interface = make(server.base_url, timeout=Timeout(read=0.2), max_retries=0)
    with trio.fail_after(PROMPT), pytest.raises(InferenceTimeoutError) as caught:
        await interface.agenerate(ask(interface))
    assert "read timeout of 0.2 s; raise Timeout.read" in str(caught.value)


async def test_a_pool_timeout_names_the_pool_field(server: FakeOpenAIServer) -> None:
    server.gate = trio.Event()
    interface = make(server.base_url, max_connections=1, timeout=Timeout(pool=0.2), max_retries=0)
    with trio.fail_after(PROMPT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(interface.agenerate, ask(interface))
            await server.wait_received(1)
            with pytest.raises(InferenceTimeoutError) as caught:
                await interface.agenerate(ask(interface))
            server.gate.set()
    assert "pool timeout of 0.2 s; raise Timeout.pool or Limits.max_connections" in str(
        caught.value
    )
    assert len(server.received) == 1


async def test_malformed_json_is_a_clear_error(server: FakeOpenAIServer) -> None:
    server.reply(Reply(text="{'choices': oops"))
    interface = make(server.base_url, max_retries=3)
    with trio.fail_after(PROMPT), pytest.raises(MalformedResponseError) as caught:
        await interface.agenerate(ask(interface))
    assert len(server.received) == 1
    assert "not JSON" in str(caught.value)
    assert "oops" in str(caught.value)


@pytest.mark.parametrize(
    ("payload", "path"),
    [
        ({"choices": []}, "$.choices"),
        ({"choices": [{"message": "hi"}]}, "$.choices[0].message"),
        (["not", "an", "object"], "list"),
    ],
)
async def test_unexpected_json_names_the_field(
    server: FakeOpenAIServer, payload: Any, path: str
) -> None:
    server.reply(Reply(json=payload))
    interface = make(server.base_url)
    with trio.fail_after(PROMPT), pytest.raises(MalformedResponseError) as caught:
        await interface.agenerate(ask(interface))
    assert path in str(caught.value)


async def test_bad_token_ids_are_a_clear_error(server: FakeOpenAIServer) -> None:
    server.reply(Reply(choice_extra={"token_ids": ["a", "b"]}))
    interface = make(server.base_url)
    with trio.fail_after(PROMPT), pytest.raises(MalformedResponseError, match="token_ids"):
        await interface.agenerate(ask(interface))


def test_transient_errors_are_the_retryable_ones() -> None:
    assert set(TRANSIENT_ERRORS) == {
        InferenceConnectionError,
        InferenceTimeoutError,
        ConflictError,
        RateLimitError,
        ServerError,
    }
    assert all(issubclass(cls, InferenceError) for cls in TRANSIENT_ERRORS)
    assert not {AuthenticationError, BadRequestError, MalformedResponseError} & set(
        TRANSIENT_ERRORS
    )


def test_errors_survive_pickling() -> None:
    error = RateLimitError(
        "slow down", url="http://h/v1", status=429, server_message="busy", retry_after=2.0
    )
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is RateLimitError
    assert str(copy) == "slow down"
    assert (copy.url, copy.status, copy.server_message, copy.retry_after) == (
        "http://h/v1",
        429,
        "busy",
        2.0,
    )


# --------------------------------------------------------------------------- replicas


async def test_two_replicas_share_the_load(
    replicas: tuple[FakeOpenAIServer, FakeOpenAIServer],
) -> None:
    first, second = replicas
    first.default = second.default = Reply(delay=0.05)
    interface = make([first.base_url, second.base_url])
    with trio.fail_after(PROMPT):
        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(interface.agenerate, ask(interface))
    assert (len(first.received), len(second.received)) == (10, 10)
    assert interface.statistics().attempts == (10, 10)


async def test_requests_go_to_the_least_loaded_replica(
    replicas: tuple[FakeOpenAIServer, FakeOpenAIServer],
) -> None:
    first, second = replicas
    first.reply(Reply(delay=30.0))  # held until the test ends it
    interface = make([first.base_url, second.base_url])
    with trio.fail_after(PROMPT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(interface.agenerate, ask(interface))
            await first.wait_received(1)
            for _ in range(3):
                response = await interface.agenerate(ask(interface))
                assert response.response.content == "b: hello"
            assert interface.statistics().in_flight == (1, 0)
            nursery.cancel_scope.cancel()
    assert (len(first.received), len(second.received)) == (1, 3)


async def test_ties_between_replicas_go_round_robin(
    replicas: tuple[FakeOpenAIServer, FakeOpenAIServer],
) -> None:
    first, second = replicas
    interface = make([first.base_url, second.base_url])
    with trio.fail_after(PROMPT):
        contents = [(await interface.agenerate(ask(interface))).response.content for _ in range(4)]
    assert contents == ["a: hello", "b: hello", "a: hello", "b: hello"]


# --------------------------------------------------------------------------- cancellation


def _assert_no_slot_leaked(interface: OpenAIInference, max_connections: int) -> None:
    state = interface._run_state.get()
    assert state is not None
    if isinstance(state.transport, LeanTransport):
        stats = state.transport.pool.statistics()
        assert (stats.active, stats.waiting) == (0, 0)
        assert stats.connections <= max_connections
        return
    assert isinstance(state.transport, HTTPXTransport)
    # Private httpx2/httpcore2 internals, read only to prove that no slot leaked.
    pool = state.transport.client._transport._pool
    assert len(pool.connections) <= max_connections
    assert pool._requests == []


def _is_closed(client: Transport) -> bool:
    if isinstance(client, LeanTransport):
        return client.pool.statistics().connections == 0
    assert isinstance(client, HTTPXTransport)
    return client.client.is_closed


async def test_cancellation_storm_leaks_no_connection_slot(server: FakeOpenAIServer) -> None:
    # 300 requests through 4 connections, each cancelled at a random instant: while
    # queued for a connection, connecting, sending, or waiting for the reply.
    server.default = Reply(delay=0.01)
    interface = make(server.base_url, max_connections=4, max_retries=0)
    rng = random.Random(4)
    outcomes = {"cancelled": 0, "completed": 0}

    async def doomed(deadline: float) -> None:
        with trio.move_on_after(deadline) as scope:
            await interface.agenerate(ask(interface))
        outcomes["cancelled" if scope.cancelled_caught else "completed"] += 1

    with trio.fail_after(2 * PROMPT):
        async with trio.open_nursery() as nursery:
            for _ in range(300):
                nursery.start_soon(doomed, rng.uniform(0.0, 0.3))
    assert outcomes["cancelled"] + outcomes["completed"] == 300
    assert outcomes["cancelled"] > 0
    assert interface.statistics().in_flight == (0,)
    _assert_no_slot_leaked(interface, 4)
    # Four at once: were a slot lost, one of them would wait forever.
    with trio.fail_after(PROMPT):
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(interface.agenerate, ask(interface))


async def test_cancelling_a_backoff_wait_ends_it_at_once(server: FakeOpenAIServer) -> None:
    server.default = Reply(status=503)
    backoff = RetryBackoff(initial=60.0, maximum=60.0, jitter=0.0)
    interface = make(server.base_url, backoff=backoff)
    retry_scheduled = trio.Event()
    stamina.instrumentation.set_on_retry_hooks([lambda details: retry_scheduled.set()])
    try:
        with trio.fail_after(PROMPT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(interface.agenerate, ask(interface))
                await retry_scheduled.wait()
                nursery.cancel_scope.cancel()
    finally:
        stamina.instrumentation.set_on_retry_hooks(None)
    assert len(server.received) == 1


# --------------------------------------------------------------------------- client lifetime


async def test_requests_in_one_run_share_one_client(
    server: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    clients = _record_clients(monkeypatch)
    interface = make(server.base_url)
    with trio.fail_after(PROMPT):
        for _ in range(3):
            await interface.agenerate(ask(interface))
    assert len(clients) == 1


async def test_aclose_closes_the_client_and_a_later_request_reopens(
    server: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    clients = _record_clients(monkeypatch)
    interface = make(server.base_url)
    with trio.fail_after(PROMPT):
        await interface.agenerate(ask(interface))
        await interface.aclose()
        assert _is_closed(clients[0])
        await interface.aclose()  # idempotent
        await interface.agenerate(ask(interface))
    assert len(clients) == 2


async def test_async_with_closes_the_client(
    server: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    clients = _record_clients(monkeypatch)
    with trio.fail_after(PROMPT):
        async with make(server.base_url) as interface:
            await interface.agenerate(ask(interface))
    assert _is_closed(clients[0])


def _keeper_tasks() -> list[str]:
    """The names of the running tasks that keep an interface's transport (system tasks)."""
    names: list[str] = []
    pending = [trio.lowlevel.current_root_task()]
    while pending:
        task = pending.pop()
        if task.name.endswith("transport keeper"):
            names.append(task.name)
        for nursery in task.child_nurseries:
            pending.extend(nursery.child_tasks)
    return names


async def test_async_with_owns_the_client_without_a_system_task(
    server: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    clients = _record_clients(monkeypatch)
    with trio.fail_after(PROMPT):
        async with make(server.base_url) as interface:
            assert len(clients) == 1  # opened on entry, before any request
            await interface.agenerate(ask(interface))
            await interface.agenerate(ask(interface))
            assert _keeper_tasks() == []
            assert not _is_closed(clients[0])
    assert len(clients) == 1
    assert _is_closed(clients[0])
    assert interface.statistics().attempts == (2,)  # the block's counts are kept


async def test_a_request_without_async_with_keeps_its_client_in_a_system_task(
    server: FakeOpenAIServer,
) -> None:
    interface = make(server.base_url)
    with trio.fail_after(PROMPT):
        await interface.agenerate(ask(interface))
        assert _keeper_tasks() == ["OpenAIInference transport keeper"]
        await interface.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert _keeper_tasks() == []


async def test_nested_async_with_closes_the_client_at_the_outermost_exit(
    server: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    clients = _record_clients(monkeypatch)
    interface = make(server.base_url)
    with trio.fail_after(PROMPT):
        async with interface:
            async with interface:
                await interface.agenerate(ask(interface))
            assert not _is_closed(clients[0])
            await interface.agenerate(ask(interface))
        assert _is_closed(clients[0])
    assert len(clients) == 1


async def test_async_with_closes_the_client_when_the_block_is_cancelled(
    server: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    clients = _record_clients(monkeypatch)
    server.default = Reply(delay=10.0)
    interface = make(server.base_url, max_retries=0)
    with trio.fail_after(PROMPT):
        with trio.move_on_after(0.2) as scope:
            async with interface:
                await interface.agenerate(ask(interface))
    assert scope.cancelled_caught
    assert _is_closed(clients[0])
    assert interface.statistics().in_flight == (0,)


async def test_async_with_takes_over_a_client_a_request_opened(
    server: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    clients = _record_clients(monkeypatch)
    interface = make(server.base_url)
    with trio.fail_after(PROMPT):
        await interface.agenerate(ask(interface))
        async with interface:
            await interface.agenerate(ask(interface))
        assert _is_closed(clients[0])
        await trio.testing.wait_all_tasks_blocked()
        assert _keeper_tasks() == []
    assert len(clients) == 1


def test_sync_generate_works_twice_and_closes_each_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clients = _record_clients(monkeypatch)
    fake = FakeOpenAIServer(name="t")
    with serving_in_thread(fake):
        interface = make(fake.base_url)
        first = interface.generate(ask(interface))
        second = interface.generate(ask(interface))
    assert first.response.content == second.response.content == "t: hello"
    assert len(clients) == 2
    assert all(_is_closed(client) for client in clients)


# --------------------------------------------------------------------------- statistics


def test_statistics_count_every_sync_generate() -> None:
    fake = FakeOpenAIServer(name="t")
    with serving_in_thread(fake):
        interface = make(fake.base_url)
        interface.generate(ask(interface))  # a Trio run of its own
        interface.generate(ask(interface))  # another
    statistics = interface.statistics()  # outside any run
    assert (statistics.attempts, statistics.in_flight) == ((2,), (0,))


async def test_statistics_in_a_run_add_its_counts_to_those_of_ended_runs(
    server: FakeOpenAIServer,
) -> None:
    interface = make(server.base_url)
    await trio.to_thread.run_sync(interface.generate, ask(interface))  # a run that ended
    with trio.fail_after(PROMPT):
        await interface.agenerate(ask(interface))
        assert interface.statistics().attempts == (2,)
        await interface.aclose()  # this run's counts so far are kept
        assert interface.statistics().attempts == (2,)
        await interface.agenerate(ask(interface))
    assert interface.statistics().attempts == (3,)


def test_a_pickled_copy_counts_from_zero() -> None:
    fake = FakeOpenAIServer(name="t")
    with serving_in_thread(fake):
        interface = make(fake.base_url)
        interface.generate(ask(interface))
    copy = pickle.loads(pickle.dumps(interface))
    assert (interface.statistics().attempts, copy.statistics().attempts) == ((1,), (0,))


async def test_statistics_say_how_many_requests_were_retried_and_why(
    server: FakeOpenAIServer,
) -> None:
    busy = {"error": {"message": "the engine is busy"}}
    server.reply(
        Reply(status=503, json=busy),
        Reply(status=503, json=busy),
        Reply(),  # the first call succeeds at its third attempt
        Reply(status=429, json={"error": {"message": "slow down"}}),
        Reply(),  # the second at its second
        Reply(),  # the third at once
    )
    interface = make(server.base_url, max_retries=3)
    with trio.fail_after(PROMPT):
        for _ in range(3):
            await interface.agenerate(ask(interface))
    statistics = interface.statistics()
    assert (statistics.retries, statistics.retried_requests) == (3, 2)
    # (hypercorn sends no reason phrase: "returned 503 : ...")
    reasons = [(r.error, r.message.split(": ", 1)[-1], r.count) for r in statistics.retry_reasons]
    assert reasons == [("ServerError", "the engine is busy", 2), ("RateLimitError", "slow down", 1)]
    assert all(r.message.startswith("returned 5") for r in statistics.retry_reasons[:1])


async def test_a_retry_reason_is_the_message_without_the_request() -> None:
    url = closed_port_url()
    interface = make(url, max_retries=2)
    with trio.fail_after(PROMPT), pytest.raises(InferenceConnectionError):
        await interface.agenerate(ask(interface))
    host_port = url.removeprefix("http://").removesuffix("/v1")
    assert interface.statistics().retry_reasons == (
        RetryReason(
            error="InferenceConnectionError",
            message=f"connection refused: is a server listening on {host_port}?",
            count=2,
        ),
    )


def test_a_client_is_closed_when_its_trio_run_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clients = _record_clients(monkeypatch)
    fake = FakeOpenAIServer(name="t")

    async def pipeline() -> None:
        interface = make(fake.base_url)
        await interface.agenerate(ask(interface))
        assert not _is_closed(clients[0])

    with serving_in_thread(fake):
        trio.run(pipeline)
    assert _is_closed(clients[0])


def _record_clients(
    monkeypatch: pytest.MonkeyPatch,
) -> list[Transport]:
    clients: list[Transport] = []
    make_client = OpenAIInference._make_transport

    def recording(self: OpenAIInference) -> Transport:
        client = make_client(self)
        clients.append(client)
        return client

    monkeypatch.setattr(OpenAIInference, "_make_transport", recording)
    return clients
