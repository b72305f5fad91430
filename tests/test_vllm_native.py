"""OpenAIInference(server="vllm") on vLLM's native RL route, against the stub of
tests/_vllm_native_server.py: negotiation and the fallback of a replica without
``--enable-scale-out``, weight-version labels (first contact, resume) turned into exact
``policy_epoch`` boundaries, labels the interface did not set, abort continuations, aborts
by the rewritten request id when a call is cancelled, seeds and ``extra_body`` in
``sampling_params``, text prompts rendered by ``/tokenize``, and the probe.

Tests run on Trio's ``autojump_clock``: the stub generates a token only as far as its
``budget`` allows, so a pause lands at a known token, and waits are for events, never for
time, except where time is what is checked (a hanging abort costs the call nothing).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import trio
import trio.testing
from _openai_server import FakeOpenAIServer
from _openai_server import serving as serving_openai
from _raw_http_server import RawConnection, raw_server
from _vllm_native_server import GENERATION_PROMPT, NATIVE_LOGPROB, FakeVLLM, serving, token_at

from trio_rollouts import ChatMessage, GenerationArgs, GroupedRolloutRequest, Rollout
from trio_rollouts.inference import (
    InferenceRequest,
    InferenceResponse,
    OpenAIInference,
    ReplicaProbe,
    RetryBackoff,
    render_plain_chat,
)
from trio_rollouts.inference._sampling import LogprobsMode, continuation_seed
from trio_rollouts.inference.openai._vllm_wire import ABORT_TIMEOUT
from trio_rollouts.testing import ScriptedAgent

NO_WAIT = RetryBackoff(initial=0.0, maximum=0.0, jitter=0.0)
DEFAULTS: dict[str, Any] = {
    "model": "test-model",
    "api_key": "sk-test",
    "backoff": NO_WAIT,
    "transport": "lean",
    "server": "vllm",
}
GENERATE = "/inference/v1/generate"
LABEL = "/update_weight_version"


@pytest.fixture
async def vllm() -> AsyncIterator[FakeVLLM]:
    fake = FakeVLLM(name="a")
    async with serving(fake):
        yield fake


def make(url: str | list[str], **kwargs: Any) -> OpenAIInference:
    return OpenAIInference(base_url=url, **{**DEFAULTS, **kwargs})


def ask(text: str = "hello", **args: Any) -> InferenceRequest:
    return InferenceRequest(
        prompt=[ChatMessage(role="user", content=text)], generation_args=GenerationArgs(**args)
    )


def ids(prompt: list[int], **args: Any) -> InferenceRequest:
    return InferenceRequest(prompt=[], prompt_ids=prompt, generation_args=GenerationArgs(**args))


def generated(response: InferenceResponse) -> list[int]:
    assert response.token_ids is not None
    assert response.prompt_length is not None
    return response.token_ids[response.prompt_length :]


def expected_tokens(context: list[int], n: int, seed: int | None = None) -> list[int]:
    out: list[int] = []
    for position in range(n):
        out.append(token_at(context + out, position, seed))
    return out


def root(fake: FakeOpenAIServer) -> str:
    return fake.base_url.removesuffix("/v1")


class Call:
    """A call started in the background; ``result`` once it returned."""

    def __init__(self) -> None:
        self.result: InferenceResponse | None = None
        self.scope = trio.CancelScope()
        self.ended_at: float | None = None

    async def run(self, interface: OpenAIInference, request: InferenceRequest) -> None:
        try:
            with self.scope:
                self.result = await interface.agenerate(request)
        finally:
            self.ended_at = trio.current_time()


def start(nursery: trio.Nursery, interface: OpenAIInference, request: InferenceRequest) -> Call:
    call = Call()
    nursery.start_soon(call.run, interface, request)
    return call


async def eventually(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await trio.testing.wait_all_tasks_blocked(cushion=0.001)


def warnings_about(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno == logging.WARNING and text in record.getMessage()
    ]


# --------------------------------------------------------------------------- the route


async def test_an_id_prompt_goes_to_the_native_route(
    vllm: FakeVLLM, autojump_clock: trio.testing.MockClock
) -> None:
    interface = make(vllm.base_url)
    response = await interface.agenerate(ids([1, 2, 3], max_tokens=5))
    assert vllm.received == []  # nothing on the OpenAI routes
    assert vllm.order == [LABEL, GENERATE]
    (body,) = vllm.native_received
    assert body["request_id"].startswith("trio-rollouts-")
    assert body["token_ids"] == [1, 2, 3]
    assert body["model"] == "test-model"
    assert (body["return_token_ids"], body["output_mode"]) == (True, "text")
    assert body["sampling_params"] == {"max_tokens": 5, "logprobs": 1}
    assert body["cache_salt"].startswith("trio-rollouts-")  # salted by epoch (default)
    tokens = expected_tokens([1, 2, 3], 5)
    assert response.token_ids == [1, 2, 3, *tokens]
    assert response.prompt_length == 3
    assert response.response.content == "".join(map(chr, tokens))
    assert response.raw_text == response.response.content  # an id prompt has no text
    assert response.logprobs == [NATIVE_LOGPROB] * 5
    assert response.finish_reason == "length"
    assert response.usage == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert response.policy_epoch == [(0, 0)]
    assert response.kv_cache_epoch == [(0, 0)]  # the salt's epoch
    assert response.logprobs_mode == "unknown"  # never probed
    assert response.sampling_mask is None
    stats = interface.statistics()
    assert (stats.attempts, stats.in_flight) == ((1,), (0,))


async def test_sampling_params_carry_generation_args_seed_and_extra_body(
    vllm: FakeVLLM, autojump_clock: trio.testing.MockClock
) -> None:
    interface = make(
        vllm.base_url,
        extra_body={"min_p": 0.05, "ignore_eos": True, "stop": ["x"], "priority": 2},
    )
    await interface.agenerate(
        ids([1, 2], temperature=0.7, top_p=0.9, top_k=5, max_tokens=4, seed=42)
    )
    (body,) = vllm.native_received
    assert body["sampling_params"] == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "max_tokens": 4,
        "seed": 42,
        "min_p": 0.05,
        "ignore_eos": True,
        "stop": ["x"],
        "logprobs": 1,
    }
    assert body["priority"] == 2  # a field of the generate request itself
    plain = make(vllm.base_url, return_logprobs=False)
    response = await plain.agenerate(ids([1, 2], max_tokens=2))
    assert "logprobs" not in vllm.native_received[-1]["sampling_params"]
    assert response.logprobs is None


async def test_a_chat_prompt_is_rendered_by_tokenize(
    vllm: FakeVLLM, autojump_clock: trio.testing.MockClock
) -> None:
    interface = make(vllm.base_url, extra_body={"chat_template_kwargs": {"think": False}})
    request = ask("hello", max_tokens=3)
    response = await interface.agenerate(request)
    (rendered,) = vllm.tokenize_received
    assert rendered == {
        "model": "test-model",
        "messages": [{"role": "user", "content": "hello"}],
        "continue_final_message": False,
        "add_generation_prompt": True,
        "chat_template_kwargs": {"think": False},
    }
    prompt = [5, GENERATION_PROMPT]
    assert vllm.native_received[0]["token_ids"] == prompt
    assert "chat_template_kwargs" not in vllm.native_received[0]["sampling_params"]
    tokens = expected_tokens(prompt, 3)
    assert response.token_ids == prompt + tokens
    assert response.prompt_length == 2
    assert response.response.content == "".join(map(chr, tokens))
    assert response.raw_text == render_plain_chat(request.prompt) + response.response.content
    assert vllm.received == []


async def test_a_text_prompt_without_token_ids_asked_returns_none(
    vllm: FakeVLLM, autojump_clock: trio.testing.MockClock
) -> None:
    interface = make(vllm.base_url, return_token_ids=False)
    response = await interface.agenerate(ask("hello", max_tokens=3))
    assert len(vllm.native_received) == 1
    assert (response.token_ids, response.prompt_length) == (None, None)
    assert response.logprobs == [NATIVE_LOGPROB] * 3
    assert response.policy_epoch == [(0, 0)]


async def test_a_completions_prompt_is_rendered_as_text(
    vllm: FakeVLLM, autojump_clock: trio.testing.MockClock
) -> None:
    interface = make(vllm.base_url, endpoint="completions")
    request = ask("hi", max_tokens=2)
    response = await interface.agenerate(request)
    text = render_plain_chat(request.prompt)
    assert vllm.tokenize_received == [{"model": "test-model", "prompt": text}]
    assert response.prompt_length == len(text)
    assert response.raw_text == text + response.response.content


async def test_without_text_in_the_reply_the_ids_are_detokenized(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = FakeVLLM(name="a", text_mode=False)  # a vLLM without output_mode
    async with serving(fake):
        interface = make(fake.base_url)
        response = await interface.agenerate(ids([1, 2], max_tokens=3))
    assert "/detokenize" in fake.order
    assert response.response.content == "".join(map(chr, expected_tokens([1, 2], 3)))


async def test_a_request_with_tools_keeps_the_openai_route(
    vllm: FakeVLLM, autojump_clock: trio.testing.MockClock
) -> None:
    interface = make(vllm.base_url)
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    request = InferenceRequest(prompt=[ChatMessage(role="user", content="hi")], tools=[tool])
    response = await interface.agenerate(request)
    assert vllm.native_received == []
    assert [r.path for r in vllm.received] == ["/v1/chat/completions"]
    assert response.response.content == "a: hi"


async def test_an_option_only_the_openai_routes_honour_keeps_them(
    vllm: FakeVLLM, autojump_clock: trio.testing.MockClock
) -> None:
    # SamplingParams has no response_format: vLLM would ignore it silently on the native
    # route, so the request goes where it is honoured.
    interface = make(vllm.base_url, extra_body={"response_format": {"type": "json_object"}})
    await interface.agenerate(ids([1, 2], max_tokens=2))
    assert vllm.native_received == []
    assert vllm.received[0].body["response_format"] == {"type": "json_object"}


async def test_the_sampling_mask_of_a_native_reply_is_kept(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = FakeVLLM(name="a", sampling_mask=True)
    async with serving(fake):
        interface = make(fake.base_url)
        response = await interface.agenerate(ids([1], max_tokens=2))
        (probe,) = await interface.probe()
    assert response.sampling_mask == [[token] for token in generated(response)]
    assert probe.sampling_mask is True


# --------------------------------------------------------------------------- negotiation


@pytest.mark.parametrize("kind", ["no scale-out (403)", "no native route (404)"])
async def test_a_replica_without_the_route_falls_back_with_one_warning(
    kind: str, caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    fake: FakeOpenAIServer
    if kind.startswith("no scale-out"):
        fake = FakeVLLM(name="a", scale_out=False)
        context = serving(fake)
    else:
        fake = FakeOpenAIServer(name="a", control="vllm")
        context = serving_openai(fake)
    async with context:
        interface = make(fake.base_url)
        with caplog.at_level(logging.WARNING):
            first = await interface.agenerate(ids([1, 2, 3]))
            second = await interface.agenerate(ids([4, 5]))
            text = await interface.agenerate(ask("hello"))
    assert [r.path for r in fake.received] == [
        "/v1/completions",
        "/v1/completions",
        "/v1/chat/completions",
    ]
    assert fake.received[0].body["prompt"] == [1, 2, 3]
    assert first.response.content == "a: 3 ids"
    assert second.token_ids is not None
    assert text.response.content == "a: hello"
    assert all(r.policy_epoch == [(0, 0)] for r in (first, second, text))
    (warning,) = warnings_about(caplog, "--enable-scale-out")
    assert root(fake) in warning
    assert "/inference/v1/generate" in warning
    if isinstance(fake, FakeVLLM):
        assert len(fake.native_received) == 1  # asked once; later calls go straight
        assert "403" in warning
    # The refused request was sent: it counts, once per replica for the interface's life.
    assert interface.statistics().attempts == (4,)
    assert interface.stamps_policy_epoch is False
    (probe,) = await interface.probe()
    assert probe.native_generate is False


async def test_one_native_replica_and_one_without_serve_side_by_side(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    native, plain = FakeVLLM(name="a"), FakeVLLM(name="b", scale_out=False)
    async with serving(native, plain):
        interface = make([native.base_url, plain.base_url])
        with caplog.at_level(logging.WARNING):
            async with trio.open_nursery() as nursery:
                calls = [start(nursery, interface, ids([i + 1], max_tokens=2)) for i in range(4)]
    assert all(call.result is not None for call in calls)
    assert len(plain.received) >= 1
    assert len(native.native_received) >= 1
    assert len(warnings_about(caplog, "--enable-scale-out")) == 1
    assert interface.stamps_policy_epoch is False  # one replica cannot stamp


# --------------------------------------------------------------------------- labels


async def test_first_contact_labels_the_current_epoch_once_for_concurrent_calls(
    vllm: FakeVLLM, autojump_clock: trio.testing.MockClock
) -> None:
    interface = make(vllm.base_url)
    await interface.resume(3)  # not paused, no replica contacted: only the epoch
    assert vllm.order == []
    assert interface.stamps_policy_epoch is False  # until first contact
    async with trio.open_nursery() as nursery:
        calls = [start(nursery, interface, ids([i + 1], max_tokens=2)) for i in range(3)]
    assert vllm.labels_received == ["3"]
    assert vllm.order[0] == LABEL
    assert all(call.result is not None and call.result.policy_epoch == [(0, 3)] for call in calls)
    assert interface.stamps_policy_epoch is True
    await interface.agenerate(ids([9], max_tokens=1))
    assert vllm.labels_received == ["3"]


def test_the_first_contact_is_once_per_interface_across_trio_runs() -> None:
    fake = FakeVLLM(name="a")

    async def main() -> None:
        async with serving(fake):
            interface = make(fake.base_url)
            await interface.agenerate(ids([1], max_tokens=1))
            # A sync generate() is a Trio run of its own.
            response = await trio.to_thread.run_sync(interface.generate, ids([2], max_tokens=1))
            assert response.policy_epoch == [(0, 0)]
            assert interface.stamps_policy_epoch is True

    trio.run(main)
    assert fake.labels_received == ["0"]
    assert [path for path in fake.order if path == GENERATE] == [GENERATE] * 2


async def test_a_keep_pause_mid_call_gives_the_exact_boundary(
    vllm: FakeVLLM, autojump_clock: trio.testing.MockClock
) -> None:
    interface = make(vllm.base_url)
    vllm.allow(3)
    async with trio.open_nursery() as nursery:
        call = start(nursery, interface, ids([1, 2, 3], max_tokens=8))
        await vllm.wait_generated(3)
        await interface.pause("keep")
        vllm.allow(None)
        await trio.testing.wait_all_tasks_blocked()
        assert [len(tokens) for tokens in vllm.generating.values()] == [3]  # frozen
        await interface.resume(1)
    assert call.result is not None
    assert call.result.policy_epoch == [(0, 0), (3, 1)]
    assert generated(call.result) == expected_tokens([1, 2, 3], 8)
    # The label goes while still paused, before /resume: token 3 on carry it.
    assert vllm.order == [LABEL, GENERATE, "/pause", LABEL, "/resume"]
    assert vllm.labels_received == ["0", "1"]
    assert interface.stamps_policy_epoch is True
    after = await interface.agenerate(ids([4], max_tokens=2))
    assert after.policy_epoch == [(0, 1)]


async def test_a_label_the_interface_did_not_set_keeps_the_start_epoch(
    vllm: FakeVLLM, caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    interface = make(vllm.base_url)
    vllm.allow(2)
    with caplog.at_level(logging.WARNING):
        async with trio.open_nursery() as nursery:
            call = start(nursery, interface, ids([1], max_tokens=8))
            await vllm.wait_generated(2)
            await interface.pause("keep")
            await interface.resume(1)
            vllm.allow(5)
            await vllm.wait_generated(5)
            vllm.weight_version = "trainer-7"  # a trainer labels the server itself
            vllm.allow(None)
        second = await interface.agenerate(ids([2], max_tokens=2))
    assert call.result is not None
    # "0" and "1" are the interface's labels; "trainer-7" keeps the start epoch, 0.
    assert call.result.policy_epoch == [(0, 0), (2, 1), (5, 0)]
    assert second.policy_epoch == [(0, 1)]  # started under 1: foreign label, start epoch
    assert interface.stamps_policy_epoch is False
    (warning,) = warnings_about(caplog, "did not set")
    assert "'trainer-7'" in warning


async def test_a_replica_that_refuses_labels_is_used_but_does_not_stamp(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    fake = FakeVLLM(name="a", label_status=404)
    async with serving(fake):
        interface = make(fake.base_url)
        with caplog.at_level(logging.WARNING):
            response = await interface.agenerate(ids([1], max_tokens=2))
            await interface.agenerate(ids([2], max_tokens=2))
    assert response.policy_epoch == [(0, 0)]
    assert len(fake.native_received) == 2
    assert interface.stamps_policy_epoch is False
    assert len(warnings_about(caplog, "VLLM_SERVER_DEV_MODE=1")) == 1


async def test_a_failed_relabel_stops_the_replica_stamping_without_raising(
    vllm: FakeVLLM, caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    interface = make(vllm.base_url, max_retries=0)
    await interface.agenerate(ids([1], max_tokens=1))
    assert interface.stamps_policy_epoch is True
    vllm.label_status = 500
    with caplog.at_level(logging.WARNING):
        await interface.pause("keep")
        await interface.resume(1)  # does not raise
        response = await interface.agenerate(ids([2], max_tokens=2))
    assert vllm.paused is None
    assert interface.policy_epoch == 1
    assert interface.stamps_policy_epoch is False
    # The server still says "0": its labels are not trusted, the start epoch is used.
    assert response.policy_epoch == [(0, 1)]
    assert len(warnings_about(caplog, "labelling")) == 1


# --------------------------------------------------------------------------- abort


async def test_an_abort_pause_continues_through_the_native_route(
    vllm: FakeVLLM, autojump_clock: trio.testing.MockClock
) -> None:
    interface = make(vllm.base_url)
    vllm.allow(3)
    async with trio.open_nursery() as nursery:
        call = start(nursery, interface, ids([1, 2, 3], max_tokens=8, seed=11))
        await vllm.wait_generated(3)
        await interface.pause("abort")
        await eventually(lambda: interface.statistics().held == 1)
        vllm.allow(None)
        await interface.resume(1)
    first, second = vllm.native_received
    partial = expected_tokens([1, 2, 3], 3, seed=11)
    assert second["token_ids"] == [1, 2, 3, *partial]
    assert second["request_id"] != first["request_id"]
    assert second["request_id"].startswith("trio-rollouts-")
    assert first["sampling_params"]["seed"] == 11
    assert second["sampling_params"]["seed"] == continuation_seed(11, 1)
    assert second["sampling_params"]["max_tokens"] == 5
    result = call.result
    assert result is not None
    rest = expected_tokens([1, 2, 3, *partial], 5, seed=continuation_seed(11, 1))
    assert result.token_ids == [1, 2, 3, *partial, *rest]
    assert result.prompt_length == 3
    assert result.logprobs == [NATIVE_LOGPROB] * 8
    assert result.finish_reason == "length"
    assert result.policy_epoch == [(0, 0), (3, 1)]
    assert result.usage is not None
    assert result.usage["completion_tokens"] == 8
    assert vllm.received == []


async def test_the_completions_continuation_of_a_seeded_call_has_its_own_seed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = FakeOpenAIServer(name="b", control="vllm", gate=trio.Event())
    async with serving_openai(fake):
        interface = make(fake.base_url)
        async with trio.open_nursery() as nursery:
            call = start(nursery, interface, ids([1, 2, 3], max_tokens=50, seed=5))
            await fake.wait_running(1)
            await interface.pause("abort")
            await eventually(lambda: interface.statistics().held == 1)
            assert fake.gate is not None
            fake.gate.set()
            await interface.resume(1)
    first, second = (r.body for r in fake.received)
    assert first["seed"] == 5
    assert second["seed"] == continuation_seed(5, 1)
    assert isinstance(second["prompt"], list)
    assert call.result is not None
    assert call.result.policy_epoch == [(0, 0)]  # no stamps: the start epoch, as before


async def test_a_cancelled_call_aborts_its_request_by_the_rewritten_id(
    vllm: FakeVLLM, autojump_clock: trio.testing.MockClock
) -> None:
    interface = make(vllm.base_url)
    vllm.allow(2)
    async with trio.open_nursery() as nursery:
        call = start(nursery, interface, ids([1, 2], max_tokens=8))
        await vllm.wait_generated(2)
        call.scope.cancel()
    await vllm.wait_aborts(1)
    sent = vllm.native_received[0]["request_id"]
    assert vllm.aborts_received == [[f"generate-tokens-{sent}"]]
    await eventually(lambda: not vllm.generating)  # the server ended it
    assert call.result is None
    assert interface.statistics().in_flight == (0,)


async def test_a_hanging_abort_never_delays_the_cancellation(
    vllm: FakeVLLM, autojump_clock: trio.testing.MockClock
) -> None:
    vllm.abort_hangs = True
    interface = make(vllm.base_url)
    vllm.allow(1)
    async with trio.open_nursery() as nursery:
        first = start(nursery, interface, ids([1], max_tokens=8))
        second = start(nursery, interface, ids([2], max_tokens=8))
        await vllm.wait_generated(1, count=2)
        cancelled_at = trio.current_time()
        first.scope.cancel()
        second.scope.cancel()
    assert (first.ended_at, second.ended_at) == (cancelled_at, cancelled_at)
    await vllm.wait_aborts(1)
    # The two ids went together; the sender gives up after ABORT_TIMEOUT, never raising.
    assert len(vllm.aborts_received[0]) == 2
    await trio.sleep(ABORT_TIMEOUT + 1)
    vllm.abort_hangs = False
    async with trio.open_nursery() as nursery:
        third = start(nursery, interface, ids([3], max_tokens=8))
        await vllm.wait_generated(1, count=3)  # the first two were never aborted
        third.scope.cancel()
    await vllm.wait_aborts(2)  # a new sender: the stuck one is gone
    assert vllm.aborts_received[1] == [f"generate-tokens-{vllm.native_received[-1]['request_id']}"]


# --------------------------------------------------------------------------- the probe


@pytest.mark.parametrize(
    ("mode", "expected"), [("raw", "raw"), ("processed", "processed"), ("none", "unknown")]
)
async def test_the_probe_tells_raw_from_processed_logprobs(
    mode: str, expected: LogprobsMode, autojump_clock: trio.testing.MockClock
) -> None:
    fake = FakeVLLM(name="a", logprobs_mode=mode)  # type: ignore[arg-type]
    async with serving(fake):
        interface = make(fake.base_url)
        (probe,) = await interface.probe()
        bodies = [r.body for r in fake.received]
        assert sorted(body["temperature"] for body in bodies) == [0.5, 1.0]
        assert {body["seed"] for body in bodies} == {bodies[0]["seed"]}
        assert all(body["logprobs"] == 5 and body["max_tokens"] == 1 for body in bodies)
        assert [r.path for r in fake.received] == ["/v1/completions"] * 2
        response = await interface.agenerate(ids([1], max_tokens=1))
    assert probe == ReplicaProbe(
        base_url=fake.base_url, logprobs_mode=expected, native_generate=True, sampling_mask=False
    )
    assert response.logprobs_mode == expected
    # The probe's native request labelled the replica as a first contact would.
    assert fake.labels_received == ["0"]
    assert len(fake.native_received) == 2  # the probe's, then the call's
    assert interface.statistics().attempts == (1,)  # the probe counts nothing


async def test_the_probe_is_cached_and_shared_by_concurrent_callers(
    vllm: FakeVLLM, autojump_clock: trio.testing.MockClock
) -> None:
    interface = make(vllm.base_url)
    answers: list[list[ReplicaProbe]] = []

    async def probe() -> None:
        answers.append(await interface.probe())

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(probe)
    assert len(vllm.received) == 2
    assert len(vllm.native_received) == 1
    assert answers == [answers[0]] * 3
    assert answers[0][0].logprobs_mode == "raw"
    assert await interface.probe() == answers[0]
    assert len(vllm.received) == 2  # cached
    assert interface.statistics().attempts == (0,)


async def test_the_probe_of_a_chat_only_server_asks_the_chat_route(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = FakeVLLM(name="a", logprobs_mode="processed")
    async with serving(fake):
        interface = make(fake.base_url, server=None, token_prompts=False)
        (probe,) = await interface.probe()
    assert [r.path for r in fake.received] == ["/v1/chat/completions"] * 2
    assert all(r.body["logprobs"] is True and r.body["top_logprobs"] == 5 for r in fake.received)
    assert probe.logprobs_mode == "processed"
    assert probe.native_generate is False  # not asked: server is not "vllm"
    assert fake.native_received == []


async def test_a_probe_that_cannot_reach_a_replica_is_not_cached(
    autojump_clock: trio.testing.MockClock,
) -> None:
    connections = 0

    async def refuse(conn: RawConnection) -> None:
        nonlocal connections
        connections += 1
        conn.reset()

    async with raw_server(refuse) as server:
        interface = make(server.url("/v1"), server=None, max_retries=0)
        (probe,) = await interface.probe()
        assert probe.logprobs_mode == "unknown"
        before = connections
        (again,) = await interface.probe()
    assert again.logprobs_mode == "unknown"
    assert connections > before  # probed again
    assert interface.statistics().attempts == (0,)


async def test_a_refusing_server_gives_unknown_without_raising(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = FakeVLLM(name="a", scale_out=False, unknown_fields="openai")
    async with serving(fake):
        interface = make(fake.base_url)
        (probe,) = await interface.probe()
        (again,) = await interface.probe()
    assert probe.logprobs_mode == "unknown"
    assert probe.native_generate is False
    assert again is probe  # a refusal is an answer: cached


# --------------------------------------------------------------------------- the pipeline


async def test_a_stream_keep_update_is_stamped_exactly_and_counts_nothing_mixed(
    vllm: FakeVLLM, autojump_clock: trio.testing.MockClock
) -> None:
    async def one_call(agent: ScriptedAgent, request: GroupedRolloutRequest) -> list[Rollout]:
        iface = request.inference_interface
        response = await iface.agenerate(iface.prepare_request("hello"))
        return [
            Rollout(
                trajectory=[response.raw_text or ""],
                reward=1.0,
                policy_epoch=[list(response.policy_epoch)],
            )
        ]

    interface = make(vllm.base_url)
    agent = ScriptedAgent(script=one_call, parallel_generation_tasks=2)
    request = GroupedRolloutRequest(
        num_groups=2, rollouts_per_group=1, inference_interface=interface, streaming=True
    )
    vllm.allow(2)  # the stream's probe asks one token of the native route
    async with agent.get_grouped_rollouts(request) as stream:
        await vllm.wait_generated(2, count=2)
        assert interface.stamps_policy_epoch is True
        async with stream.weight_update("keep"):
            vllm.allow(None)
        groups = [await stream.receive(), await stream.receive()]
        stats = stream.statistics()
    assert all(g[0].policy_epoch == [[(0, 0), (2, 1)]] for g in groups)
    assert [g.start_epoch for g in groups] == [0, 0]
    assert stats.mixed == 0  # stamped exactly: nothing to count as mixed
    assert vllm.labels_received == ["0", "1"]
