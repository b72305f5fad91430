"""The epoch-salted prefix cache: the salt every request carries (vLLM's ``cache_salt``,
SGLang's ``extra_key``), derived from the run and the start epoch of the call's group, a
continuation after an ``abort`` salted with the new epoch, ``kv_cache_epoch`` filled from
it; and the engine model following the same rule, with ``stale_prefix_hits`` counting
blocks reused across epochs (0 by default, more with ``cache_salt="off"``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import trio
import trio.testing
from _openai_server import FakeOpenAIServer, serving

import trio_rollouts as tr
from trio_rollouts import GenerationArgs
from trio_rollouts._context import calling
from trio_rollouts.inference import (
    CacheSaltCall,
    EmbeddedInference,
    EngineModel,
    InferenceRequest,
    InferenceResponse,
    OpenAIInference,
    RetryBackoff,
)
from trio_rollouts.inference._salt import epoch_salt

PROMPT = 5.0
NO_WAIT = RetryBackoff(initial=0.0, maximum=0.0, jitter=0.0)


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


def make(url: str, **kwargs: Any) -> OpenAIInference:
    return OpenAIInference(
        base_url=url, model="test-model", api_key="sk-test", backoff=NO_WAIT, **kwargs
    )


def ask(interface: OpenAIInference, **args: Any) -> InferenceRequest:
    return interface.prepare_request("hello world", GenerationArgs(**args))


@contextmanager
def group_started_under(epoch: int) -> Iterator[None]:
    """What the pipeline's worker sets before a group's call: its start epoch."""
    with calling(start_epoch=epoch):
        yield


# --------------------------------------------------------------------------- the client


async def test_vllm_requests_carry_the_salt_of_the_run_and_the_epoch(
    vllm: FakeOpenAIServer,
) -> None:
    vllm.gate.set()  # type: ignore[union-attr]
    interface = make(vllm.base_url, server="vllm", run_id="run-a")
    other_run = make(vllm.base_url, server="vllm", run_id="run-b")
    with trio.fail_after(PROMPT):
        first = await interface.agenerate(ask(interface))
        await interface.resume(3)
        later = await interface.agenerate(ask(interface))
        await other_run.agenerate(ask(other_run))
    salts = [received.body["cache_salt"] for received in vllm.received]
    assert salts == [epoch_salt("run-a", 0), epoch_salt("run-a", 3), epoch_salt("run-b", 0)]
    assert len(set(salts)) == 3  # an update or another run never shares a salt
    assert "extra_key" not in vllm.received[0].body
    # The KV its tokens attended to was computed under the salt's epoch, or later.
    assert first.kv_cache_epoch == [(0, 0)]
    assert later.kv_cache_epoch == [(0, 3)]


async def test_a_call_is_salted_with_its_groups_start_epoch(vllm: FakeOpenAIServer) -> None:
    """A later turn of an episode whose group started before an update keeps its group's
    salt (it shares the prefix its earlier turns computed), and says so."""
    vllm.gate.set()  # type: ignore[union-attr]
    interface = make(vllm.base_url, server="vllm", run_id="r")
    await interface.resume(2)
    with trio.fail_after(PROMPT), group_started_under(1):
        response = await interface.agenerate(ask(interface))
    assert vllm.received[0].body["cache_salt"] == epoch_salt("r", 1)
    assert response.kv_cache_epoch == [(0, 1)]
    assert response.policy_epoch == [(0, 2)]  # sampled under the weights of epoch 2


async def test_sglang_takes_the_salt_as_extra_key(sglang: FakeOpenAIServer) -> None:
    sglang.gate.set()  # type: ignore[union-attr]
    interface = make(sglang.base_url, server="sglang", run_id="r")
    with trio.fail_after(PROMPT):
        response = await interface.agenerate(ask(interface))
    body = sglang.received[0].body
    assert body["extra_key"] == epoch_salt("r", 0)
    assert "cache_salt" not in body
    assert response.kv_cache_epoch == [(0, 0)]


async def test_a_group_call_salts_every_choice_alike(vllm: FakeOpenAIServer) -> None:
    vllm.gate.set()  # type: ignore[union-attr]
    interface = make(vllm.base_url, server="vllm", run_id="r")
    with trio.fail_after(PROMPT), group_started_under(0):
        responses = await interface.agenerate_group(ask(interface), 3)
    assert {received.body["cache_salt"] for received in vllm.received} == {epoch_salt("r", 0)}
    assert [response.kv_cache_epoch for response in responses] == [[(0, 0)]] * 3


async def test_an_abort_continuation_is_salted_with_the_new_epoch(
    vllm: FakeOpenAIServer,
) -> None:
    interface = make(vllm.base_url, server="vllm", run_id="r")
    request = ask(interface, max_tokens=100)
    with trio.fail_after(PROMPT):
        async with trio.open_nursery() as nursery:
            result: list[InferenceResponse] = []

            async def call() -> None:
                result.append(await interface.agenerate(request))

            nursery.start_soon(call)
            await vllm.wait_running(1)
            await interface.pause("abort")
            while interface.statistics().held != 1:
                await trio.testing.wait_all_tasks_blocked(cushion=0.001)
            vllm.gate.set()  # type: ignore[union-attr]
            await interface.resume(1)
    first, continuation = (received.body for received in vllm.received)
    assert first["cache_salt"] == epoch_salt("r", 0)
    # Its prefix is computed again, under the new weights: a new salt.
    assert continuation["cache_salt"] == epoch_salt("r", 1)
    (response,) = result
    k = len(vllm.token_ids(vllm.aborted[0]))
    assert k > 0
    # Before the abort the tokens attended to epoch 0's KV; after it, to epoch 1's.
    assert response.kv_cache_epoch == [(0, 0), (k, 1)]


async def test_off_sends_no_salt_and_leaves_the_cache_epoch_unknown(
    vllm: FakeOpenAIServer,
) -> None:
    vllm.gate.set()  # type: ignore[union-attr]
    interface = make(vllm.base_url, server="vllm", cache_salt="off")
    with trio.fail_after(PROMPT):
        response = await interface.agenerate(ask(interface))
    assert "cache_salt" not in vllm.received[0].body
    assert response.kv_cache_epoch == []


async def test_a_callable_salt_is_told_about_the_call(vllm: FakeOpenAIServer) -> None:
    vllm.gate.set()  # type: ignore[union-attr]
    calls: list[tuple[str, CacheSaltCall]] = []

    def salt(run_id: str, call: CacheSaltCall) -> str | None:
        calls.append((run_id, call))
        return None if call.start_epoch == 5 else f"mine-{call.epoch}"

    interface = make(vllm.base_url, server="vllm", cache_salt=salt, run_id="r")
    with trio.fail_after(PROMPT):
        with group_started_under(4):
            response = await interface.agenerate(ask(interface))
        with group_started_under(5):
            await interface.agenerate(ask(interface))
    assert calls[0] == ("r", CacheSaltCall(epoch=4, start_epoch=4))
    assert vllm.received[0].body["cache_salt"] == "mine-4"
    assert "cache_salt" not in vllm.received[1].body  # None: no salt
    assert response.kv_cache_epoch == []  # not the epoch salt: unknown


async def test_a_salt_in_extra_body_is_sent_as_given(vllm: FakeOpenAIServer) -> None:
    vllm.gate.set()  # type: ignore[union-attr]
    interface = make(vllm.base_url, server="vllm", extra_body={"cache_salt": "fixed"})
    with trio.fail_after(PROMPT):
        response = await interface.agenerate(ask(interface))
    assert vllm.received[0].body["cache_salt"] == "fixed"
    assert response.kv_cache_epoch == []


async def test_without_a_server_kind_nothing_is_sent(vllm: FakeOpenAIServer) -> None:
    vllm.gate.set()  # type: ignore[union-attr]
    interface = make(vllm.base_url)
    with trio.fail_after(PROMPT):
        response = await interface.agenerate(ask(interface))
    assert not {"cache_salt", "extra_key"} & vllm.received[0].body.keys()
    assert response.kv_cache_epoch == []


@pytest.mark.parametrize("value", ["epochs", "", 3, None])
def test_a_bad_setting_names_the_field_and_what_is_allowed(value: object) -> None:
    with pytest.raises(ValueError, match=r"cache_salt must be 'epoch', 'off' or a callable"):
        OpenAIInference(base_url="http://127.0.0.1:1/v1", model="m", cache_salt=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"cache_salt must be"):
        EmbeddedInference(cache_salt=value)  # type: ignore[arg-type]


def test_the_salt_is_stable_across_processes_and_pickling() -> None:
    import pickle

    interface = OpenAIInference(base_url="http://127.0.0.1:1/v1", model="m")
    copy = pickle.loads(pickle.dumps(interface))
    assert copy.run_id == interface.run_id  # every Ray actor of a run salts alike
    assert epoch_salt("a", 1) == epoch_salt("a", 1) != epoch_salt("a", 2)
    assert OpenAIInference(base_url="http://127.0.0.1:1/v1", model="m").run_id != interface.run_id


# --------------------------------------------------------------------------- the engine model


class Exact(tr.RewardOnlyAgent):
    async def get_reward(self, problem: tr.Problem, response: InferenceResponse) -> float:
        await trio.lowlevel.checkpoint()
        return float(response.response.content == problem.answer)


#: Round numbers; blocks of 4 ids.
MODEL = EngineModel(
    max_num_seqs=8,
    max_num_batched_tokens=1024,
    block_size=4,
    num_blocks=1024,
    base=1.0,
    per_prefill_token=0.01,
    per_decode_seq=0.1,
)
PROMPT_IDS = [65] + [97] * 39  # 40 ids: 9 full blocks can be read from a cache


def engine(**kwargs: Any) -> EmbeddedInference:
    def policy(prompt: list[tr.ChatMessage]) -> tuple[list[str], list[float]]:
        return ["xyz"], [1.0]

    return EmbeddedInference(engine=MODEL, policy=policy, **kwargs)


def ids_request() -> InferenceRequest:
    return InferenceRequest(prompt=[], prompt_ids=list(PROMPT_IDS))


async def across_a_keep_update(interface: EmbeddedInference) -> InferenceResponse:
    """One call under epoch 0, a keep update to epoch 1, then a new group's call of the
    same prompt (started under epoch 1)."""
    await interface.agenerate(ids_request())
    await interface.pause("keep")
    await interface.resume(1)
    with group_started_under(1):
        return await interface.agenerate(ids_request())


@pytest.mark.parametrize("setting", ["epoch", "off"])
async def test_the_engine_never_serves_an_older_policys_kv_by_default(
    autojump_clock: trio.testing.MockClock, setting: Any
) -> None:
    interface = engine(cache_salt=setting)
    response = await across_a_keep_update(interface)
    (stats,) = interface.engine_statistics()
    assert response.policy_epoch == [(0, 1)]
    if setting == "epoch":
        assert stats.stale_prefix_hits == 0
        assert stats.prefix_cache_hits == 0  # the new group computed its prefix again
        assert response.kv_cache_epoch == [(0, 1)]
    else:
        assert stats.stale_prefix_hits == 9  # every full block of the prompt
        assert stats.prefix_cache_hits == 36
        # Sampled under epoch 1, attending to KV computed under epoch 0: on the record.
        assert response.kv_cache_epoch == [(0, 0)]


@pytest.mark.parametrize("setting", ["epoch", "off"])
async def test_a_groups_later_calls_share_its_prefix_across_an_update(
    autojump_clock: trio.testing.MockClock, setting: Any
) -> None:
    """Siblings and later turns of a group that started under epoch 0 hit its prefix
    after a keep update, with either setting: the salt does not cost them the cache."""
    interface = engine(cache_salt=setting)
    with group_started_under(0):
        await interface.agenerate(ids_request())
        await interface.pause("keep")
        await interface.resume(1)
        response = await interface.agenerate(ids_request())
    (stats,) = interface.engine_statistics()
    assert stats.prefix_cache_hits == 36
    assert stats.stale_prefix_hits == 0  # the group's own epoch: not stale
    assert response.kv_cache_epoch == [(0, 0)]
    assert response.policy_epoch == [(0, 1)]


@pytest.mark.parametrize("setting", ["epoch", "off"])
async def test_an_abort_continuation_reads_no_kv_of_the_old_weights_by_default(
    autojump_clock: trio.testing.MockClock, setting: Any
) -> None:
    interface = engine(cache_salt=setting)
    result: list[InferenceResponse] = []

    async def call() -> None:
        result.append(await interface.agenerate(ids_request()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call)
        await trio.sleep(1.4 + 0.5)  # the prefill step (1.4 s) sampled "x"
        await interface.pause("abort")
        k = interface.engine_statistics()[0].generation_tokens
        await interface.resume(1)
    (response,) = result
    (stats,) = interface.engine_statistics()
    assert 0 < k < 3
    assert response.policy_epoch == [(0, 0), (k, 1)]
    if setting == "epoch":
        assert stats.stale_prefix_hits == 0
        assert response.kv_cache_epoch == [(0, 0), (k, 1)]
    else:
        # The continuation read its own blocks, computed under epoch 0, from the cache.
        assert stats.stale_prefix_hits == 10
        assert response.kv_cache_epoch == [(0, 0)]


async def test_the_stale_hits_of_a_pipeline_run_are_zero_by_default(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two streams of groups with one prompt, a keep update between batches: the
    default salt reads no block of an older epoch, ``"off"`` reads many."""
    stale = {}
    shared = "a question whose prompt every group shares " * 3
    problems = [tr.Problem(prompt=shared, answer="xyz", problem_id=f"p{i}") for i in range(8)]
    for setting in ("epoch", "off"):
        interface = engine(cache_salt=setting, seed=1)
        agent = Exact(prompts=tr.PromptSource(problems, seed=0), parallel_generation_tasks=4)
        request = tr.GroupedRolloutRequest(
            num_groups=2,
            rollouts_per_group=2,
            inference_interface=interface,
            streaming=True,
        )
        async with agent.get_grouped_rollouts(request) as stream:
            for _ in range(3):
                await stream.receive()
                await stream.receive()
                async with stream.weight_update("keep"):
                    pass
            metrics = stream.metrics()
        stale[setting] = sum(stats.stale_prefix_hits for stats in interface.engine_statistics())
        assert metrics["inference/0/stale_prefix_hits"] == stale[setting]  # for the dashboard
    assert stale["epoch"] == 0
    assert stale["off"] > 0
