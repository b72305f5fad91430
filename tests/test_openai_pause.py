"""OpenAIInference as a Pausable backend, against stub vLLM and SGLang servers that serve
their control endpoints as documented (tests/_openai_server.py): pausing for each mode,
requests held during a pause, aborted requests continued from their partial output,
failing or missing control endpoints, and epoch stamps. Every test runs on both
transports, as in test_openai.py: control requests use the run's client too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import stamina
import trio
import trio.testing
from _openai_server import FakeOpenAIServer, Reply, serving, serving_in_thread

from trio_rollouts import GenerationArgs, GroupedRolloutRequest, Rollout
from trio_rollouts.inference import (
    BadRequestError,
    InferenceError,
    InferenceRequest,
    InferenceResponse,
    MalformedResponseError,
    OpenAIInference,
    RetryBackoff,
    ServerError,
)
from trio_rollouts.inference._pausable import Pausable, WeightUpdateError
from trio_rollouts.testing import ScriptedAgent

PROMPT = 5.0
NO_WAIT = RetryBackoff(initial=0.0, maximum=0.0, jitter=0.0)
DEFAULTS: dict[str, Any] = {"model": "test-model", "api_key": "sk-test", "backoff": NO_WAIT}


@pytest.fixture(autouse=True, params=["lean", "httpx2"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(DEFAULTS, "transport", request.param)
    return str(request.param)


@pytest.fixture
async def vllm() -> AsyncIterator[FakeOpenAIServer]:
    fake = FakeOpenAIServer(name="a", control="vllm", gate=trio.Event())
    async with serving(fake):
        yield fake


@pytest.fixture
async def sglang() -> AsyncIterator[FakeOpenAIServer]:
    fake = FakeOpenAIServer(name="a", control="sglang", gate=trio.Event())
    async with serving(fake):
        yield fake


def make(url: str | list[str], **kwargs: Any) -> OpenAIInference:
    return OpenAIInference(base_url=url, **{**DEFAULTS, **kwargs})


def ask(interface: OpenAIInference, text: str = "hello", **args: Any) -> InferenceRequest:
    return interface.prepare_request(text, GenerationArgs(**args))


async def eventually(predicate: Callable[[], bool]) -> None:
    """Wait until ``predicate()`` holds (bounded by the test's fail_after): each pass
    lets every task run until all are blocked, the loopback sockets included."""
    while not predicate():
        await trio.testing.wait_all_tasks_blocked(cushion=0.001)


class Call:
    """A call started in the background; ``result`` once it returned."""

    def __init__(self) -> None:
        self.result: InferenceResponse | None = None
        self.error: InferenceError | None = None
        self.scope = trio.CancelScope()

    async def run(self, interface: OpenAIInference, request: InferenceRequest) -> None:
        with self.scope:
            try:
                self.result = await interface.agenerate(request)
            except InferenceError as error:
                self.error = error


def start(nursery: trio.Nursery, interface: OpenAIInference, request: InferenceRequest) -> Call:
    call = Call()
    nursery.start_soon(call.run, interface, request)
    return call


async def aborted_once(
    server: FakeOpenAIServer,
    interface: OpenAIInference,
    request: InferenceRequest,
    while_held: Callable[[], None] = lambda: None,
) -> Call:
    """Run ``request`` through one ``abort`` update: paused once the server runs it,
    ``while_held()`` once the call is held, then let go and resumed under epoch 1."""
    async with trio.open_nursery() as nursery:
        call = start(nursery, interface, request)
        await server.wait_running(1)
        await interface.pause("abort")
        await eventually(lambda: interface.statistics().held == 1)
        while_held()
        server.gate.set()  # type: ignore[union-attr]
        await interface.resume(1)
    return call


# --------------------------------------------------------------------------- the contract


def test_modes_epoch_and_stamping_per_server() -> None:
    plain = make("http://127.0.0.1:1/v1")
    assert isinstance(plain, Pausable)
    assert plain.supported_modes == {"drain", "restart"}
    for server in ("vllm", "sglang"):
        interface = make("http://127.0.0.1:1/v1", server=server)
        assert interface.supported_modes == {"drain", "restart", "keep", "abort"}
        assert interface.stamps_policy_epoch is False
    assert plain.stamps_policy_epoch is False
    assert plain.policy_epoch == 0
    with pytest.raises(ValueError, match="server"):
        make("http://127.0.0.1:1/v1", server="tgi")


async def test_unsupported_mode_is_a_type_error_and_pauses_nothing(
    vllm: FakeOpenAIServer,
) -> None:
    interface = make(vllm.base_url)
    with pytest.raises(TypeError, match="server='vllm'"):
        await interface.pause("keep")
    vllm.gate.set()  # type: ignore[union-attr]
    with trio.fail_after(PROMPT):
        response = await interface.agenerate(ask(interface))
    assert response.response.content == "a: hello"
    assert vllm.control_received == []


async def test_without_a_server_a_pause_holds_new_calls_client_side(
    vllm: FakeOpenAIServer,
) -> None:
    vllm.gate.set()  # type: ignore[union-attr]
    interface = make(vllm.base_url)
    with trio.fail_after(PROMPT):
        async with trio.open_nursery() as nursery:
            await interface.pause("drain")
            call = start(nursery, interface, ask(interface))
            await eventually(lambda: interface.statistics().held == 1)
            await trio.testing.wait_all_tasks_blocked()
            assert vllm.received == []
            assert call.result is None
            await interface.resume(1)
    assert call.result is not None
    assert call.result.response.content == "a: hello"
    assert call.result.policy_epoch == [(0, 1)]
    assert interface.policy_epoch == 1
    assert vllm.control_received == []  # nothing server-side
    assert interface.statistics().held == 0


async def test_calls_are_stamped_with_the_epoch_they_started_under(
    vllm: FakeOpenAIServer,
) -> None:
    vllm.gate.set()  # type: ignore[union-attr]
    interface = make(vllm.base_url, server="vllm")
    with trio.fail_after(PROMPT):
        assert (await interface.agenerate(ask(interface))).policy_epoch == [(0, 0)]
        await interface.pause("restart")
        await interface.resume(7)
        assert (await interface.agenerate(ask(interface))).policy_epoch == [(0, 7)]
        # The server's own stamps (Megatron's) win.
        vllm.reply(Reply(choice_extra={"policy_epoch": [[0, 6], [3, 7]]}))
        assert (await interface.agenerate(ask(interface))).policy_epoch == [(0, 6), (3, 7)]
        # The epoch belongs to the interface, not to the Trio run: a sync generate() in
        # its own run (a thread here) stamps it too.
        response = await trio.to_thread.run_sync(interface.generate, ask(interface))
    assert response.policy_epoch == [(0, 7)]


# --------------------------------------------------------------------------- keep


async def test_vllm_keep_holds_calls_in_flight_and_new_ones_until_resume(
    vllm: FakeOpenAIServer,
) -> None:
    interface = make(vllm.base_url, server="vllm")
    with trio.fail_after(PROMPT):
        async with trio.open_nursery() as nursery:
            first = start(nursery, interface, ask(interface, "one"))
            await vllm.wait_running(1)
            await interface.pause("keep")
            assert vllm.paused == "keep"
            # vLLM 0.32 resets its caches on a keep pause unless told not to, preempting
            # the running request (its KV cache recomputed at resume) and emptying the
            # prefix cache: the pause must keep both.
            assert (vllm.preempted, vllm.cache_resets) == (0, 0)
            vllm.gate.set()  # type: ignore[union-attr]  # its generation could end now...
            second = start(nursery, interface, ask(interface, "two"))
            await eventually(lambda: interface.statistics().held == 1)
            await trio.testing.wait_all_tasks_blocked()
            # ... but the server keeps it frozen, and the new call waits client-side.
            assert first.result is None
            assert second.result is None
            assert len(vllm.received) == 1
            await interface.resume(1)
    assert first.result is not None
    assert second.result is not None
    assert (first.result.response.content, first.result.finish_reason) == ("a: one", "stop")
    assert first.result.policy_epoch == [(0, 0)]  # started under 0: no boundary known
    assert second.result.policy_epoch == [(0, 1)]
    assert vllm.control_received == [
        ("/pause?mode=keep&clear_cache=false", None),
        ("/resume", None),
    ]
    assert vllm.aborted == []


async def test_sglang_keep_is_in_place_and_the_version_update_never_aborts(
    sglang: FakeOpenAIServer,
) -> None:
    interface = make(sglang.base_url, server="sglang")
    with trio.fail_after(PROMPT):
        async with trio.open_nursery() as nursery:
            call = start(nursery, interface, ask(interface))
            await sglang.wait_running(1)
            await interface.pause("keep")
            sglang.gate.set()  # type: ignore[union-attr]
            await trio.testing.wait_all_tasks_blocked()
            assert call.result is None
            await interface.resume(3)
    assert call.result is not None
    assert (call.result.response.content, call.result.finish_reason) == ("a: hello", "stop")
    assert sglang.control_received == [
        ("/pause_generation", {"mode": "in_place"}),
        ("/update_weight_version", {"new_version": "3", "abort_all_requests": False}),
        ("/continue_generation", {}),
    ]
    assert sglang.aborted == []  # the stub aborts everything if abort_all_requests is not false


async def test_sglang_sends_the_weight_version_without_aborting_for_drain_too(
    sglang: FakeOpenAIServer,
) -> None:
    interface = make(sglang.base_url, server="sglang")
    with trio.fail_after(PROMPT):
        await interface.pause("drain")
        await interface.resume(2)
    assert sglang.control_received == [
        ("/update_weight_version", {"new_version": "2", "abort_all_requests": False})
    ]


# --------------------------------------------------------------------------- abort


async def test_vllm_abort_continues_a_chat_call_exactly_from_its_token_ids(
    vllm: FakeOpenAIServer,
) -> None:
    # Every 3rd generated token is followed by a special token that the text leaves out,
    # as vLLM's text does: a continuation sent as text would be retokenized without
    # them, and the merged ids would claim a context the model never continued from.
    vllm.special_every = 3
    interface = make(vllm.base_url, server="vllm")
    request = ask(interface, "hello world", max_tokens=100)

    def while_held() -> None:
        assert vllm.aborted == ["a: hell"]  # half of "a: hello world"
        assert vllm.cache_resets == 0  # the prefix cache the continuation reuses
        assert len(vllm.received) == 1  # the continuation waits for resume

    with trio.fail_after(PROMPT):
        call = await aborted_once(vllm, interface, request, while_held)
    full, partial = "a: hello world", "a: hell"
    assert call.result is not None
    result = call.result
    assert (result.response.content, result.finish_reason) == (full, "stop")
    assert result.token_ids is not None
    assert result.prompt_length is not None
    first = vllm.received[0].body
    prompt_ids = [len(message["content"]) for message in first["messages"]]
    continuation = vllm.received[1]
    # The continuation is a completions request whose prompt is the exact ids so far:
    # the prompt's and the partial output's, special tokens included.
    assert continuation.path == "/v1/completions"
    sent = continuation.body
    assert sent["prompt"] == prompt_ids + vllm.token_ids(partial)
    assert "messages" not in sent
    assert "continue_final_message" not in sent
    assert sent["max_tokens"] == 100 - len(vllm.token_ids(partial))
    assert sent["return_token_ids"] is True
    assert sent["logprobs"] == 1
    # The merged ids are the context the server continued from, then what it generated.
    assert result.token_ids == sent["prompt"] + vllm.token_ids(full[len(partial) :])
    assert result.prompt_length == len(prompt_ids)
    assert result.logprobs is not None
    assert len(result.logprobs) == len(result.token_ids) - result.prompt_length
    assert result.usage is not None
    assert result.usage["completion_tokens"] == len(result.token_ids) - result.prompt_length
    assert result.policy_epoch == [(0, 0)]
    assert vllm.control_received == [
        ("/pause?mode=abort&clear_cache=false", None),
        ("/resume", None),
    ]


async def test_an_exact_continuation_without_max_tokens_asks_for_the_rest_of_the_context(
    vllm: FakeOpenAIServer,
) -> None:
    # /v1/completions defaults to 16 tokens; the chat request it continues had no limit.
    interface = make(vllm.base_url, server="vllm")
    with trio.fail_after(PROMPT):
        call = await aborted_once(vllm, interface, ask(interface, "hello world"))
    assert call.result is not None
    sent = vllm.received[1].body
    assert "max_tokens" in sent
    assert sent["max_tokens"] is None


async def test_a_continuation_that_echoes_other_prompt_ids_is_an_error(
    vllm: FakeOpenAIServer,
) -> None:
    interface = make(vllm.base_url, server="vllm")
    vllm.reply(Reply(), Reply(top_extra={}, choice_extra={"prompt_token_ids": [1, 2, 3]}))
    with trio.fail_after(PROMPT):
        call = await aborted_once(vllm, interface, ask(interface, "hello world"))
    assert isinstance(call.error, MalformedResponseError)
    assert "from other tokens than it was sent" in str(call.error)
    assert "first at index 0" in str(call.error)


async def test_vllm_abort_without_token_ids_continues_a_chat_call_from_its_text(
    vllm: FakeOpenAIServer,
) -> None:
    interface = make(vllm.base_url, server="vllm", return_token_ids=False)
    request = ask(interface, "hello world", max_tokens=100)

    def while_held() -> None:
        assert vllm.aborted == ["a: hell"]  # half of "a: hello world"

    with trio.fail_after(PROMPT):
        call = await aborted_once(vllm, interface, request, while_held)
    full = "a: hello world"
    assert call.result is not None
    result = call.result
    assert (result.response.content, result.finish_reason) == (full, "stop")
    assert result.usage is not None
    assert result.usage["completion_tokens"] == len(full)  # summed over both segments
    assert result.token_ids is None
    assert result.logprobs is not None
    assert len(result.logprobs) == len(full)
    continuation = vllm.received[1].body
    assert vllm.received[1].path == "/v1/chat/completions"
    assert continuation["messages"][-1] == {"role": "assistant", "content": "a: hell"}
    assert continuation["continue_final_message"] is True
    assert continuation["add_generation_prompt"] is False
    assert continuation["max_tokens"] == 100 - len("a: hell")


async def test_sglang_abort_continues_a_completions_call_from_prompt_and_partial_text(
    sglang: FakeOpenAIServer,
) -> None:
    sglang.abort_after = 0  # aborted before its first token: an empty partial output
    interface = make(
        sglang.base_url, server="sglang", endpoint="completions", return_token_ids=False
    )
    with trio.fail_after(PROMPT):
        async with trio.open_nursery() as nursery:
            call = start(nursery, interface, ask(interface))
            await sglang.wait_running(1)
            await interface.pause("abort")
            await eventually(lambda: interface.statistics().held == 1)
            sglang.abort_after = 3
            await interface.resume(1)
            # The continuation is aborted again by a second update, and continued again.
            await sglang.wait_running(1)
            await interface.pause("abort")
            await eventually(lambda: interface.statistics().held == 1)
            sglang.gate.set()  # type: ignore[union-attr]
            await interface.resume(2)
    assert call.result is not None
    prompt = sglang.received[0].body["prompt"]
    assert call.result.response.content == "a: <|assistant|>"
    assert call.result.finish_reason == "stop"
    assert call.result.raw_text == prompt + "a: <|assistant|>"
    assert sglang.aborted == ["", "a: "]
    assert [r.body["prompt"] for r in sglang.received] == [prompt, prompt, prompt + "a: "]
    assert "continue_final_message" not in sglang.received[2].body
    assert ("/pause_generation", {"mode": "abort"}) in sglang.control_received


async def test_an_abort_not_caused_by_a_pause_is_returned_as_it_is(
    vllm: FakeOpenAIServer,
) -> None:
    vllm.gate.set()  # type: ignore[union-attr]
    vllm.reply(Reply(choice_extra={"finish_reason": "abort"}))
    interface = make(vllm.base_url, server="vllm")
    with trio.fail_after(PROMPT):
        response = await interface.agenerate(ask(interface))
    assert response.finish_reason == "abort"
    assert len(vllm.received) == 1


# --------------------------------------------------------------------------- failures


async def test_a_missing_vllm_pause_endpoint_names_the_dev_mode_flag(transport: str) -> None:
    fake = FakeOpenAIServer(name="a", control="vllm", dev_mode=False)
    async with serving(fake):
        interface = make(fake.base_url, server="vllm")
        with trio.fail_after(PROMPT):
            with pytest.raises(WeightUpdateError, match="VLLM_SERVER_DEV_MODE=1") as info:
                await interface.pause("keep")
            assert isinstance(info.value.__cause__, BadRequestError)
            assert info.value.__cause__.status == 404
            # Nothing is left paused: a new call goes through at once.
            response = await interface.agenerate(ask(interface))
    assert response.response.content == "a: hello"
    assert interface.statistics().held == 0


async def test_a_failed_pause_resumes_the_replicas_that_paused(transport: str) -> None:
    good = FakeOpenAIServer(name="a", control="vllm", gate=trio.Event())
    bad = FakeOpenAIServer(name="b", control="vllm", control_status={"/pause": 500})
    async with serving(good, bad):
        interface = make([good.base_url, bad.base_url], server="vllm")
        with trio.fail_after(PROMPT):
            async with trio.open_nursery() as nursery:
                call = start(nursery, interface, ask(interface))
                await good.wait_running(1)
                with pytest.raises(WeightUpdateError, match="500") as info:
                    await interface.pause("keep")
                good.gate.set()  # type: ignore[union-attr]
    assert isinstance(info.value.__cause__, ServerError)
    assert (good.paused, bad.paused) == (None, None)
    assert good.control_received == [
        ("/pause?mode=keep&clear_cache=false", None),
        ("/resume", None),
    ]
    # A 500 leaves the replica's state unknown, so it is resumed too.
    assert bad.control_received == [("/pause?mode=keep&clear_cache=false", None), ("/resume", None)]
    assert interface.policy_epoch == 0
    assert call.result is not None
    assert call.result.response.content == "a: hello"


async def test_a_failed_resume_is_raised_and_retried_by_the_next_resume(
    vllm: FakeOpenAIServer,
) -> None:
    vllm.gate.set()  # type: ignore[union-attr]
    interface = make(vllm.base_url, server="vllm", max_retries=0)
    with trio.fail_after(PROMPT):
        await interface.pause("keep")
        vllm.control_status["/resume"] = 503
        with pytest.raises(ServerError, match="503") as info:
            await interface.resume(1)
        assert any("may still be paused" in note for note in info.value.__notes__)
        # The epoch is set and held calls are released anyway...
        assert interface.policy_epoch == 1
        assert interface.statistics().held == 0
        # ...and the next resume, idempotent otherwise, tries the replica again.
        del vllm.control_status["/resume"]
        await interface.resume(1)
    assert vllm.paused is None
    assert [path for path, _ in vllm.control_received] == [
        "/pause?mode=keep&clear_cache=false",
        "/resume",
        "/resume",
    ]


async def test_control_calls_are_retried_through_stamina_as_requests_are(
    vllm: FakeOpenAIServer,
) -> None:
    vllm.gate.set()  # type: ignore[union-attr]
    backoff = RetryBackoff(initial=0.01, maximum=0.01, jitter=0.0)
    interface = make(vllm.base_url, server="vllm", max_retries=2, backoff=backoff)
    waits: list[float] = []
    stamina.instrumentation.set_on_retry_hooks([lambda details: waits.append(details.wait_for)])
    try:
        with trio.fail_after(PROMPT):
            await interface.pause("keep")
            vllm.control_status["/resume"] = 503
            with pytest.raises(ServerError, match="503") as info:
                await interface.resume(1)
    finally:
        stamina.instrumentation.set_on_retry_hooks(None)
    assert [path for path, _ in vllm.control_received] == ["/pause?mode=keep&clear_cache=false"] + [
        "/resume"
    ] * 3
    assert waits == [0.01, 0.01]
    assert "gave up after 3 attempts (max_retries=2)" in info.value.__notes__


async def test_resume_is_idempotent(vllm: FakeOpenAIServer) -> None:
    interface = make(vllm.base_url, server="vllm")
    with trio.fail_after(PROMPT):
        await interface.resume(4)  # not paused: only sets the epoch
        assert vllm.control_received == []
        await interface.pause("keep")
        await interface.resume(5)
        await interface.resume(5)
    assert interface.policy_epoch == 5
    assert vllm.control_received == [
        ("/pause?mode=keep&clear_cache=false", None),
        ("/resume", None),
    ]


async def test_resume_is_shielded_from_cancellation(vllm: FakeOpenAIServer) -> None:
    interface = make(vllm.base_url, server="vllm")
    with trio.fail_after(PROMPT):
        await interface.pause("keep")
        with trio.CancelScope() as scope:
            scope.cancel()
            await interface.resume(1)
    assert vllm.paused is None
    assert interface.policy_epoch == 1


# --------------------------------------------------------------------------- cancellation


async def test_cancelling_held_calls_releases_everything(vllm: FakeOpenAIServer) -> None:
    interface = make(vllm.base_url, server="vllm")
    with trio.fail_after(PROMPT):
        async with trio.open_nursery() as nursery:
            aborted = start(nursery, interface, ask(interface, "one"))
            await vllm.wait_running(1)
            await interface.pause("abort")
            held = start(nursery, interface, ask(interface, "two"))
            # One waits for its continuation, the other to be sent.
            await eventually(lambda: interface.statistics().held == 2)
            aborted.scope.cancel()
            held.scope.cancel()
        stats = interface.statistics()
        assert (stats.held, stats.in_flight) == (0, (0,))
        await interface.resume(1)
        vllm.gate.set()  # type: ignore[union-attr]
        response = await interface.agenerate(ask(interface, "three"))
    assert (aborted.result, held.result) == (None, None)
    assert response.response.content == "a: three"
    assert len(vllm.received) == 2  # the cancelled calls sent nothing more


# --------------------------------------------------------------------------- the stub


async def test_the_server_holds_a_request_that_arrives_during_its_pause(
    vllm: FakeOpenAIServer,
) -> None:
    # Another client of the same server (another actor's interface) is not paused
    # client-side: vLLM admits its request and holds it until resume.
    vllm.gate.set()  # type: ignore[union-attr]
    pausing = make(vllm.base_url, server="vllm")
    other = make(vllm.base_url)
    with trio.fail_after(PROMPT):
        await pausing.pause("keep")
        async with trio.open_nursery() as nursery:
            call = start(nursery, other, ask(other))
            await vllm.wait_received(1)
            await trio.testing.wait_all_tasks_blocked()
            assert vllm.running == 0
            assert call.result is None
            await pausing.resume(1)
    assert call.result is not None
    assert call.result.response.content == "a: hello"


# --------------------------------------------------------------------------- review fixes


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_server_pause_left_by_one_run_is_resumed_by_the_next() -> None:
    """A server's pause outlives the Trio run that made it: when that run's resume
    failed, a resume in a later run (a new trio.run, or a sync generate()) must still
    resume the replica, or every call to it would wait forever."""
    fake = FakeOpenAIServer(name="a", control="vllm", control_status={"/resume": 400})
    with serving_in_thread(fake):
        interface = make(fake.base_url, server="vllm", max_retries=0)

        async def first_run() -> None:
            await interface.pause("keep")
            with pytest.raises(InferenceError):
                await interface.resume(1)

        trio.run(first_run)
        del fake.control_status["/resume"]

        async def second_run() -> bool:
            await interface.resume(2)
            with trio.move_on_after(5) as scope:
                await interface.agenerate(ask(interface))
            return scope.cancelled_caught

        assert not trio.run(second_run)
    assert [path for path, _ in fake.control_received] == [
        "/pause?mode=keep&clear_cache=false",
        "/resume",
        "/resume",
    ]


async def test_a_chat_call_aborted_before_its_first_token_is_sent_again() -> None:
    """Without token ids, an empty final assistant message would be rendered as a closed
    turn: a call aborted before any text is sent again as it was."""
    fake = FakeOpenAIServer(name="b", control="vllm", gate=trio.Event(), abort_after=0)
    async with serving(fake):
        interface = make(fake.base_url, server="vllm", return_token_ids=False)
        call = Call()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call.run, interface, ask(interface, max_tokens=50))
                await fake.wait_running(1)
                await interface.pause("abort")
                fake.gate.set()
                await interface.resume(1)
    first, second = (request.body for request in fake.received[:2])
    assert second["messages"] == first["messages"]
    assert "continue_final_message" not in second
    assert call.result is not None
    assert call.result.finish_reason != "abort"


async def test_a_continued_call_reports_the_usage_of_one_call(vllm: FakeOpenAIServer) -> None:
    interface = make(vllm.base_url, server="vllm")
    call = Call()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call.run, interface, ask(interface))
            await vllm.wait_running(1)
            await interface.pause("abort")
            assert vllm.gate is not None
            vllm.gate.set()
            await interface.resume(1)
    result = call.result
    assert result is not None
    assert result.usage is not None
    assert len(vllm.received) == 2  # the request and its continuation
    usage = result.usage
    # The stub counts a chat prompt's messages: 1 for the call's own prompt, 2 for the
    # continuation's (the prompt and the partial answer), which must not be added.
    assert usage["prompt_tokens"] == 1
    assert usage["completion_tokens"] == len(result.response.content)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_aclose_during_a_pause_leaves_held_calls_working(vllm: FakeOpenAIServer) -> None:
    vllm.gate = None
    interface = make(vllm.base_url, server="vllm", max_retries=0)
    with trio.fail_after(10):
        await interface.agenerate(ask(interface))
        call = Call()
        async with trio.open_nursery() as nursery:
            await interface.pause("drain")
            nursery.start_soon(call.run, interface, ask(interface))
            await eventually(lambda: interface.statistics().held == 1)
            await interface.aclose()
            await interface.resume(1)
    assert call.result is not None


# --------------------------------------------------------------------------- the pipeline


async def one_call(agent: ScriptedAgent, request: GroupedRolloutRequest) -> list[Rollout]:
    """A group of one rollout per call, keeping the call's finish reason and stamps."""
    iface = request.inference_interface
    response = await iface.agenerate(iface.prepare_request("hello"))
    return [
        Rollout(
            trajectory=[response.raw_text or ""],
            reward=1.0,
            policy_epoch=[list(response.policy_epoch)],
            extra={"finish_reason": response.finish_reason},
        )
    ]


@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_a_stream_update_pauses_the_vllm_server_and_continues_its_calls(
    vllm: FakeOpenAIServer, mode: str
) -> None:
    interface = make(vllm.base_url, server="vllm")
    agent = ScriptedAgent(script=one_call, parallel_generation_tasks=2)
    # No sampling probe at the stream's opening: the stub holds every request until its
    # gate opens, the probe's too, and this test counts the calls the server runs.
    request = GroupedRolloutRequest(
        num_groups=2,
        rollouts_per_group=1,
        inference_interface=interface,
        streaming=True,
        sampling_check="off",
    )
    with trio.fail_after(PROMPT):
        async with agent.get_grouped_rollouts(request) as stream:
            await vllm.wait_running(2)
            async with stream.weight_update(mode) as update:  # type: ignore[arg-type]
                assert update.held == 2
                assert vllm.paused == mode
                vllm.gate.set()  # type: ignore[union-attr]
                await trio.testing.wait_all_tasks_blocked()
                assert stream.statistics().completed == 0  # the server holds them
            groups = [await stream.receive(), await stream.receive()]
            stats = stream.statistics()
    assert [g.start_epoch for g in groups] == [0, 0]
    assert all(g[0].extra["finish_reason"] == "stop" for g in groups)
    # one call each, its text whole (raw_text is the prompt and the completion)
    assert all(g[0].trajectory[0].endswith("<|assistant|>\na: hello") for g in groups)
    # vLLM does not say at which token the weights changed: counted, never guessed.
    assert stats.mixed == 2
    assert all(g[0].policy_epoch == [[(0, 0)]] for g in groups)
    assert stats.unaccounted == 0
    assert vllm.control_received[:2] == [
        (f"/pause?mode={mode}&clear_cache=false", None),
        ("/resume", None),
    ]
    assert interface.policy_epoch == 1
