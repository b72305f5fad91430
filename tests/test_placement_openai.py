"""OpenAIInference on several replicas and with whole groups: where each call goes under
each ``routing`` (group stickiness and its margin, the seeded tie-break, placement
replayed alike, calls outside any group placed by load), and ``agenerate_group``: one
request with ``n`` on the chat, completions and vLLM native routes (a response per
choice, usage per choice, logprobs, epochs), the fallback to separate requests for a
server that answers one choice or refuses ``n``, a pause-aborted choice continued alone,
cancellation, and bad ``n``.

The fakes (``tests/_placement_server.py``) speak real HTTP on loopback; a request whose
prompt the test lists in ``holds.prompts`` is held there until released, so which
replica is loaded is known. Tests run on Trio's ``autojump_clock`` and wait for events,
never for time.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest
import trio
import trio.testing
from _openai_server import DEFAULT_LOGPROB, FakeOpenAIServer, Reply
from _placement_server import GroupServer, GroupVLLM, serving
from _vllm_native_server import NATIVE_LOGPROB, token_at

from trio_rollouts import ChatMessage, GenerationArgs
from trio_rollouts._context import calling
from trio_rollouts.inference import (
    BadRequestError,
    GeneratesGroups,
    InferenceRequest,
    InferenceResponse,
    MalformedResponseError,
    OpenAIInference,
    RetryBackoff,
)
from trio_rollouts.inference._sampling import choice_seed, continuation_seed
from trio_rollouts.inference.http._transport import LeanTransport

NO_WAIT = RetryBackoff(initial=0.0, maximum=0.0, jitter=0.0)
DEFAULTS: dict[str, Any] = {
    "model": "test-model",
    "api_key": "sk-test",
    "backoff": NO_WAIT,
    "transport": "lean",
}


def make(servers: Sequence[FakeOpenAIServer], **kwargs: Any) -> OpenAIInference:
    return OpenAIInference(base_url=[s.base_url for s in servers], **{**DEFAULTS, **kwargs})


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


async def eventually(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await trio.testing.wait_all_tasks_blocked(cushion=0.001)


def replica_of(response: InferenceResponse) -> str:
    """The fake that answered (its name starts the completion: ``"a: hello"``)."""
    return response.response.content.split(":")[0]


async def call(
    interface: OpenAIInference,
    text: str = "hello",
    group: tuple[int, int, int] | None = None,
    episode: int | None = None,
) -> str:
    """One call made as the pipeline makes it for ``group`` (and an agent for
    ``episode``); the replica that answered."""
    with calling(group=group, episode=episode):
        return replica_of(await interface.agenerate(ask(text)))


class Held:
    """Calls held on the fakes (their prompts listed there), started in the background."""

    def __init__(self, nursery: trio.Nursery, servers: Sequence[GroupServer]) -> None:
        self.nursery = nursery
        self.servers = servers
        self.count = 0  # held now
        self.started = 0

    async def start(
        self, interface: OpenAIInference, group: tuple[int, int, int] | None = None
    ) -> None:
        """Start a call that the fakes hold; return once it is held on a replica."""
        self.count += 1
        self.started += 1
        text = f"held-{self.started}"
        for server in self.servers:
            server.holds.prompts.add(text)
        self.nursery.start_soon(call, interface, text, group)
        await eventually(lambda: sum(s.holds.count for s in self.servers) == self.count)

    def release(self) -> None:
        for server in self.servers:
            server.holds.release()


def group_servers(n: int) -> list[GroupServer]:
    return [GroupServer(name=name) for name in "abcd"[:n]]


@pytest.fixture
async def three() -> AsyncIterator[list[GroupServer]]:
    servers = group_servers(3)
    async with serving(*servers):
        yield servers


@pytest.fixture
async def two() -> AsyncIterator[list[GroupServer]]:
    servers = group_servers(2)
    async with serving(*servers):
        yield servers


# --------------------------------------------------------------------------- configuration


def test_routing_defaults_to_group_with_a_margin_of_two() -> None:
    interface = OpenAIInference("http://127.0.0.1:1/v1", "m")
    assert (interface.routing, interface.routing_margin) == ("group", 2)
    assert isinstance(interface, GeneratesGroups)


@pytest.mark.parametrize(
    ("options", "error", "text"),
    [
        ({"routing": "nearest"}, ValueError, "routing must be one of"),
        ({"routing_margin": -1}, ValueError, "routing_margin"),
        ({"extra_body": {"n": 2}}, ValueError, "agenerate_group"),
    ],
)
def test_a_bad_routing_option_names_the_field(
    options: dict[str, Any], error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=text):
        OpenAIInference("http://127.0.0.1:1/v1", "m", **options)


# --------------------------------------------------------------------------- routing


async def test_least_loaded_sends_each_call_to_the_replica_with_fewest_in_flight(
    three: list[GroupServer], autojump_clock: trio.testing.MockClock
) -> None:
    interface = make(three, routing="least_loaded")
    async with trio.open_nursery() as nursery:
        held = Held(nursery, three)
        await held.start(interface)  # a (idle pool: in turn)
        await held.start(interface)  # b
        assert interface.statistics().in_flight == (1, 1, 0)
        assert [await call(interface) for _ in range(3)] == ["c", "c", "c"]
        held.release()
    assert [s.holds.count for s in three] == [0, 0, 0]


async def test_round_robin_takes_each_replica_in_turn_whatever_its_load(
    three: list[GroupServer], autojump_clock: trio.testing.MockClock
) -> None:
    interface = make(three, routing="round_robin")
    async with trio.open_nursery() as nursery:
        held = Held(nursery, three)
        await held.start(interface)  # a, held
        replicas = [await call(interface, group=(0, 0, 0)) for _ in range(4)]
        held.release()
    assert replicas == ["b", "c", "a", "b"]


async def test_calls_outside_any_group_are_placed_least_loaded(
    three: list[GroupServer], autojump_clock: trio.testing.MockClock
) -> None:
    interface = make(three)  # routing="group", no group in the call context
    async with trio.open_nursery() as nursery:
        held = Held(nursery, three)
        await held.start(interface)
        await held.start(interface)
        assert interface.statistics().in_flight == (1, 1, 0)
        assert await call(interface) == "c"
        held.release()
    # An idle pool alternates.
    assert [await call(interface) for _ in range(3)] == ["a", "b", "c"]


async def load_replica(
    held: Held, interface: OpenAIInference, servers: Sequence[GroupServer], name: str, k: int
) -> None:
    """Hold calls outside any group until replica ``name`` has ``k`` held, and let the
    others go: the load is ``k`` there and 0 elsewhere."""
    (target,) = [s for s in servers if s.name == name]
    while target.holds.count < k:
        await held.start(interface)
    for server in servers:
        if server is not target:
            server.holds.release()
    held.count = target.holds.count
    await eventually(lambda: sum(interface.statistics().in_flight) == k)


def other_than(servers: Sequence[GroupServer], name: str) -> str:
    return next(s.name for s in servers if s.name != name)


async def test_a_group_stays_on_its_replica_within_the_margin_then_moves(
    two: list[GroupServer], autojump_clock: trio.testing.MockClock
) -> None:
    interface = make(two)  # routing="group", routing_margin=2
    key = (7, 0, 0)
    home = await call(interface, group=key)
    other = other_than(two, home)
    async with trio.open_nursery() as nursery:
        held = Held(nursery, two)
        await load_replica(held, interface, two, home, 2)
        assert await call(interface, group=key) == home  # two above the other: within
        await load_replica(held, interface, two, home, 3)
        assert await call(interface, group=key) == other  # three above: moved...
        await load_replica(held, interface, two, other, 1)
        assert await call(interface, group=key) == other  # ...and it is the group's now
        held.release()
    assert await call(interface, group=key) == other


async def test_routing_margin_zero_keeps_a_group_only_while_its_replica_is_least_loaded(
    two: list[GroupServer], autojump_clock: trio.testing.MockClock
) -> None:
    interface = make(two, routing_margin=0)
    key = (7, 0, 1)
    home = await call(interface, group=key)
    async with trio.open_nursery() as nursery:
        held = Held(nursery, two)
        await load_replica(held, interface, two, home, 1)
        assert await call(interface, group=key) == other_than(two, home)
        held.release()


async def test_a_groups_own_calls_in_flight_do_not_push_it_away(
    two: list[GroupServer], autojump_clock: trio.testing.MockClock
) -> None:
    interface = make(two, routing_margin=0)
    key = (7, 0, 2)
    async with trio.open_nursery() as nursery:
        held = Held(nursery, two)
        for _ in range(4):  # siblings sent together stay together
            await held.start(interface, key)
        assert sorted(interface.statistics().in_flight) == [0, 4]
        held.release()


async def test_every_turn_of_an_episode_goes_to_its_replica(
    two: list[GroupServer], autojump_clock: trio.testing.MockClock
) -> None:
    interface = make(two, routing_margin=0)
    key = (3, 1, 0)
    first = await call(interface, group=key, episode=0)
    async with trio.open_nursery() as nursery:
        held = Held(nursery, two)
        # The group's replica is busy with another call: the next episode goes elsewhere...
        await load_replica(held, interface, two, first, 1)
        second = await call(interface, group=key, episode=1)
        assert second == other_than(two, first)
        held.release()
    # ...and keeps that replica for its later turns, as the first keeps its own.
    assert [await call(interface, group=key, episode=1) for _ in range(2)] == [second] * 2
    assert await call(interface, group=key, episode=0) == first


async def test_the_first_call_of_each_group_is_not_always_the_first_replica(
    autojump_clock: trio.testing.MockClock,
) -> None:
    servers = group_servers(4)
    async with serving(*servers):
        interface = make(servers)
        first = [await call(interface, group=(11, batch, 0)) for batch in range(12)]
    # Idle replicas all tie: the seeded hash of each key picks among them.
    assert len(set(first)) > 1
    assert first != ["a"] * 12


async def _placements(servers: list[GroupServer]) -> list[str]:
    """A fixed workload: 6 groups of 3 calls in a fixed order, some held (loads)."""
    interface = make(servers)
    placed: list[str] = []
    async with trio.open_nursery() as nursery:
        held = Held(nursery, servers)
        for index in range(6):
            key = (5, 0, index)
            placed.append(await call(interface, group=key))
            await held.start(interface, key)
            placed.append(await call(interface, group=key))
        held.release()
    return placed


async def test_two_runs_of_one_seed_place_alike(
    three: list[GroupServer], autojump_clock: trio.testing.MockClock
) -> None:
    first = await _placements(three)
    second = await _placements(three)  # a new interface: a new placement
    assert first == second
    assert len(set(first)) > 1


# --------------------------------------------------------------------------- groups


def choice_text(base: str, i: int) -> str:
    return base if i == 0 else f"{base} #{i}"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_a_group_is_one_request_with_n_and_a_response_per_choice(
    endpoint: str, autojump_clock: trio.testing.MockClock
) -> None:
    server = GroupServer(name="a")
    async with serving(server):
        interface = make([server], endpoint=endpoint)
        responses = await interface.agenerate_group(ask("hi", max_tokens=9), 3)
    (received,) = server.received
    assert received.body["n"] == 3
    assert received.path == f"/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
    base = responses[0].response.content
    assert base.startswith("a: ")
    for i, response in enumerate(responses):
        text = choice_text(base, i)
        assert response.response.content == text
        assert generated(response) == [ord(c) for c in text]
        assert response.logprobs == [DEFAULT_LOGPROB] * len(text)
        assert response.finish_reason == "stop"
        assert response.policy_epoch == [(0, 0)]
        prompt = response.prompt_length
        assert prompt is not None
        assert response.token_ids is not None
        assert response.token_ids[:prompt] == responses[0].token_ids[:prompt]  # type: ignore[index]
        assert response.usage == {
            "prompt_tokens": prompt,
            "completion_tokens": len(text),
            "total_tokens": prompt + len(text),
        }
    stats = interface.statistics()
    assert (stats.attempts, stats.choices, stats.in_flight) == ((1,), (3,), (0,))
    assert stats.dropped_fields == ((),)


async def test_n_of_one_is_exactly_a_single_call(autojump_clock: trio.testing.MockClock) -> None:
    server = GroupServer(name="a")
    async with serving(server):
        interface = make([server])
        (response,) = await interface.agenerate_group(ask("hi"), 1)
        single = await interface.agenerate(ask("hi"))
    first, second = server.received
    assert "n" not in first.body
    assert first.body == second.body
    assert response.response.content == single.response.content == "a: hi"


async def test_a_group_in_flight_is_one_request_of_its_replicas_load(
    autojump_clock: trio.testing.MockClock,
) -> None:
    servers = group_servers(2)
    async with serving(*servers):
        interface = make(servers)
        for server in servers:
            server.holds.prompts.add("big")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(interface.agenerate_group, ask("big"), 4)
            await eventually(lambda: sum(s.holds.count for s in servers) == 1)
            loaded = interface.statistics().in_flight
            assert sorted(loaded) == [0, 1]
            assert await call(interface) == "ab"[loaded.index(0)]  # the other replica
            for server in servers:
                server.holds.release()
    stats = interface.statistics()
    assert (sum(stats.attempts), sum(stats.choices)) == (2, 5)


async def test_a_retried_group_request_is_placed_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    servers = group_servers(2)
    async with serving(*servers):
        interface = make(servers, routing="least_loaded")
        servers[0].reply(Reply(status=503))  # the first replica fails the group once
        responses = await interface.agenerate_group(ask("hi"), 3)
    assert [[r.body["n"] for r in s.received] for s in servers] == [[3], [3]]
    assert [replica_of(r) for r in responses] == ["b"] * 3
    assert interface.statistics().retries == 1


async def test_a_group_on_the_native_route_is_one_request_with_sampling_params_n(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = GroupVLLM(name="a")
    async with serving(fake):
        interface = make([fake], server="vllm")
        responses = await interface.agenerate_group(ids([1, 2, 3], max_tokens=5, seed=40), 3)
    (body,) = fake.native_received
    assert body["sampling_params"] == {"max_tokens": 5, "seed": 40, "n": 3, "logprobs": 1}
    for i, response in enumerate(responses):
        # vLLM samples choice i with seed + i: what a call with choice_seed(seed, i) gives.
        assert generated(response) == expected_tokens([1, 2, 3], 5, seed=40 + i)
        assert choice_seed(40, i) == 40 + i
        assert response.prompt_length == 3
        assert response.logprobs == [NATIVE_LOGPROB] * 5
        assert response.finish_reason == "length"
        assert response.policy_epoch == [(0, 0)]
        assert response.usage == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert fake.received == []
    stats = interface.statistics()
    assert (stats.attempts, stats.choices) == ((1,), (3,))


async def test_a_keep_pause_inside_a_native_group_stamps_each_choice(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = GroupVLLM(name="a")
    async with serving(fake):
        interface = make([fake], server="vllm")
        fake.allow(3)
        result: list[InferenceResponse] = []

        async def group() -> None:
            result.extend(await interface.agenerate_group(ids([4, 5], max_tokens=8), 2))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(group)
            await fake.wait_generated(3, count=2)
            await interface.pause("keep")
            fake.allow(None)
            await interface.resume(1)
    assert [r.policy_epoch for r in result] == [[(0, 0), (3, 1)]] * 2
    assert [len(generated(r)) for r in result] == [8, 8]
    assert generated(result[0]) != generated(result[1])


async def test_a_pause_aborted_choice_is_continued_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = GroupVLLM(name="a", choice_tokens=[2, 8])  # choice 0 ends before the pause
    async with serving(fake):
        interface = make([fake], server="vllm")
        fake.allow(4)
        result: list[InferenceResponse] = []

        async def group() -> None:
            result.extend(await interface.agenerate_group(ids([1, 2], max_tokens=8, seed=9), 2))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(group)
            await fake.wait_generated(4)
            await interface.pause("abort")
            await eventually(lambda: interface.statistics().held == 1)
            fake.allow(None)
            await interface.resume(1)
    first, continuation = fake.native_received
    assert first["sampling_params"]["n"] == 2
    partial = expected_tokens([1, 2], 4, seed=9 + 1)
    assert continuation["token_ids"] == [1, 2, *partial]
    assert "n" not in continuation["sampling_params"]
    seed = continuation_seed(choice_seed(9, 1), 1)
    assert continuation["sampling_params"]["seed"] == seed
    assert continuation["sampling_params"]["max_tokens"] == 4
    done, continued = result
    assert generated(done) == expected_tokens([1, 2], 2, seed=9)
    assert (done.finish_reason, done.policy_epoch) == ("length", [(0, 0)])
    assert generated(continued) == partial + expected_tokens([1, 2, *partial], 4, seed=seed)
    assert continued.finish_reason == "length"
    assert continued.policy_epoch == [(0, 0), (4, 1)]
    assert continued.logprobs == [NATIVE_LOGPROB] * 8
    assert continued.usage is not None
    assert continued.usage["completion_tokens"] == 8


async def test_a_server_that_answers_one_choice_gets_its_groups_as_separate_calls(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    server = FakeOpenAIServer(name="a")  # answers one choice, whatever n
    async with serving(server):
        interface = make([server])
        with caplog.at_level(logging.WARNING):
            first = await interface.agenerate_group(ask("hi", seed=100), 4)
            second = await interface.agenerate_group(ask("hi", seed=200), 4)
    bodies = [r.body for r in server.received]
    # Asked once; the one choice answered is kept, the other three are asked alone.
    assert [b.get("n") for b in bodies] == [4] + [None] * 7
    assert sorted(b["seed"] for b in bodies[:4]) == [100, 101, 102, 103]
    assert sorted(b["seed"] for b in bodies[4:]) == [200, 201, 202, 203]
    assert [r.response.content for r in first + second] == ["a: hi"] * 8
    assert [r.policy_epoch for r in first] == [[(0, 0)]] * 4
    warnings = [r.getMessage() for r in caplog.records if "answered one choice" in r.getMessage()]
    assert len(warnings) == 1
    assert "separate requests" in warnings[0]
    stats = interface.statistics()
    assert stats.dropped_fields == (("n",),)
    assert (stats.attempts, stats.choices) == ((8,), (11,))


async def test_every_request_of_a_group_goes_to_one_replica_whatever_the_routing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    servers = [FakeOpenAIServer(name="a"), FakeOpenAIServer(name="b")]  # ignore n
    async with serving(*servers):
        interface = make(servers, routing="least_loaded")
        await interface.agenerate_group(ask("hi"), 4)
        # least_loaded would spread four separate calls; the group keeps them together.
        assert sorted(len(s.received) for s in servers) == [0, 4]
        await interface.agenerate_group(ask("hi"), 4)
    # The next group is placed afresh: the other replica, idle, takes it (and learns).
    assert [len(s.received) for s in servers] == [4, 4]


async def test_a_server_that_refuses_n_gets_the_group_as_separate_calls(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    server = GroupServer(name="a", refuse_n=True)
    async with serving(server):
        interface = make([server])
        with caplog.at_level(logging.WARNING):
            responses = await interface.agenerate_group(ask("hi"), 3)
            again = await interface.agenerate_group(ask("ho"), 3)
    assert [r.body.get("n") for r in server.received] == [3] + [None] * 6
    assert [r.response.content for r in responses] == ["a: hi"] * 3
    assert len(again) == 3
    refusals = [r.getMessage() for r in caplog.records if "refused n" in r.getMessage()]
    assert len(refusals) == 1
    assert "not supported" in refusals[0]
    assert interface.statistics().dropped_fields == (("n",),)


async def test_a_native_replica_refusing_n_above_its_max_num_seqs_falls_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = GroupVLLM(name="a", max_n=2)
    async with serving(fake):
        interface = make([fake], server="vllm")
        responses = await interface.agenerate_group(ids([3], max_tokens=2, seed=1), 3)
    assert [b["sampling_params"].get("n") for b in fake.native_received] == [3, None, None, None]
    assert [generated(r) for r in responses] == [
        expected_tokens([3], 2, seed=1 + i) for i in range(3)
    ]


async def test_a_greedy_group_goes_as_separate_calls_and_is_not_remembered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = GroupServer(name="a")
    async with serving(server):
        interface = make([server])
        await interface.agenerate_group(ask("hi", temperature=0.0), 3)
        await interface.agenerate_group(ask("hi", temperature=0.5), 3)
    assert [r.body.get("n") for r in server.received] == [None, None, None, 3]
    assert interface.statistics().dropped_fields == ((),)


async def test_a_reply_with_more_choices_than_asked_is_malformed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = GroupServer(name="a")
    async with serving(server):
        interface = make([server], max_retries=0)
        choice = {"index": 0, "message": {"role": "assistant", "content": "x"}}
        server.reply(Reply(json={"choices": [choice, {**choice, "index": 1}] * 2}))
        with pytest.raises(MalformedResponseError, match="4 choices to a request for n=2"):
            await interface.agenerate_group(ask("hi"), 2)


async def test_a_failure_of_a_separate_call_is_raised_as_itself(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = GroupServer(name="a", refuse_n=True)
    async with serving(server):
        interface = make([server], max_retries=0)
        server.reply(Reply(), Reply(status=400, json={"error": {"message": "bad prompt"}}))
        with pytest.raises(BadRequestError, match="bad prompt"):
            await interface.agenerate_group(ask("hi"), 3)
    assert interface.statistics().in_flight == (0,)


@pytest.mark.parametrize(("n", "error"), [(0, ValueError), (True, TypeError), ("2", TypeError)])
async def test_a_bad_n_is_refused_before_anything_is_sent(
    n: Any, error: type[Exception], autojump_clock: trio.testing.MockClock
) -> None:
    server = GroupServer(name="a")
    async with serving(server):
        interface = make([server])
        with pytest.raises(error, match="n must be"):
            await interface.agenerate_group(ask("hi"), n)
    assert server.received == []


# --------------------------------------------------------------------------- cancellation


async def test_a_cancelled_native_group_aborts_its_request_on_the_server(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = GroupVLLM(name="a")
    async with serving(fake):
        interface = make([fake], server="vllm")
        fake.allow(2)
        with trio.move_on_after(1000) as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(interface.agenerate_group, ids([1, 2], max_tokens=8), 3)
                await fake.wait_generated(2, count=3)
                scope.cancel()
        assert scope.cancelled_caught
        await fake.wait_aborts(1)
        sent = fake.native_received[0]["request_id"]
        assert fake.aborts_received == [[f"generate-tokens-{sent}"]]  # one id, every choice
        await eventually(lambda: not fake.generating)
        assert interface.statistics().in_flight == (0,)


async def test_a_cancelled_group_of_separate_calls_leaves_nothing_running(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = GroupServer(name="a", refuse_n=True)
    async with serving(server):
        interface = make([server], max_connections=3)
        server.holds.prompts.add("hi")
        with trio.move_on_after(1000) as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(interface.agenerate_group, ask("hi"), 3)
                await server.wait_holding(3)
                assert interface.statistics().in_flight == (3,)
                scope.cancel()
        assert scope.cancelled_caught
        assert interface.statistics().in_flight == (0,)
        state = interface._run_state.get()
        assert state is not None
        assert isinstance(state.transport, LeanTransport)
        pool = state.transport.pool.statistics()
        assert (pool.active, pool.waiting) == (0, 0)
        server.holds.release()
        # Every connection slot is free again: three calls at once go through.
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(interface.agenerate, ask("ho"))
