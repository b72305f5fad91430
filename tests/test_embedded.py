"""EmbeddedInference: seeded sampling, latency on Trio's clock, token ids, logprobs, epochs.

Async tests run on pytest-trio's ``autojump_clock``, so simulated latency costs no real
time and every instant is exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import trio

from trio_rollouts import ChatMessage, GenerationArgs
from trio_rollouts.inference import (
    EmbeddedInference,
    HashedPromptPolicy,
    InferenceResponse,
    LatencyModel,
    ReturnsLogProbs,
    ReturnsRaw,
    render_plain_chat,
)

INSTANT = LatencyModel(first_token=0.0, per_token=0.0, distribution="constant")
#: One second before the first token, then one per token: token k starts at t0 + 1 + k.
STEADY = LatencyModel(first_token=1.0, per_token=1.0, distribution="constant")


def fixed(completions: Sequence[str], probs: Sequence[float]) -> Any:
    """A policy that ignores the prompt."""

    def policy(prompt: list[ChatMessage]) -> tuple[Sequence[str], npt.ArrayLike]:
        return completions, probs

    return policy


async def draw(
    interface: EmbeddedInference, prompt: str = "Q", n: int = 1, **args: Any
) -> list[InferenceResponse]:
    request = interface.prepare_request(prompt, GenerationArgs(**args))
    return [await interface.agenerate(request) for _ in range(n)]


async def texts(
    interface: EmbeddedInference, prompt: str = "Q", n: int = 1, **args: Any
) -> list[str]:
    return [r.response.content for r in await draw(interface, prompt, n, **args)]


def test_is_marked_raw_and_logprobs() -> None:
    interface = EmbeddedInference()
    assert isinstance(interface, ReturnsRaw)
    assert isinstance(interface, ReturnsLogProbs)


# --------------------------------------------------------------------------- sampling


async def test_the_same_seed_gives_the_same_completions(autojump_clock: trio.abc.Clock) -> None:
    first = await texts(EmbeddedInference(seed=3), n=20)
    second = await texts(EmbeddedInference(seed=3), n=20)
    assert first == second


async def test_different_seeds_give_different_completions(
    autojump_clock: trio.abc.Clock,
) -> None:
    assert await texts(EmbeddedInference(seed=0), n=20) != await texts(
        EmbeddedInference(seed=1), n=20
    )


async def test_each_prompt_has_its_own_random_stream(autojump_clock: trio.abc.Clock) -> None:
    alone = EmbeddedInference(seed=5)
    mixed = EmbeddedInference(seed=5)
    expected = await texts(alone, "X", n=5)
    got = []
    for _ in range(5):
        got += await texts(mixed, "X")
        await texts(mixed, "Y")
    assert got == expected


async def test_temperature_zero_picks_the_most_probable(autojump_clock: trio.abc.Clock) -> None:
    interface = EmbeddedInference(policy=fixed(["a", "b", "c"], [0.2, 0.5, 0.3]), latency=INSTANT)
    assert set(await texts(interface, n=30, temperature=0.0)) == {"b"}


async def test_temperature_zero_breaks_ties_by_order(autojump_clock: trio.abc.Clock) -> None:
    interface = EmbeddedInference(policy=fixed(["a", "b"], [0.5, 0.5]), latency=INSTANT)
    assert set(await texts(interface, n=10, temperature=0.0)) == {"a"}


async def test_low_temperature_sharpens_the_distribution(autojump_clock: trio.abc.Clock) -> None:
    interface = EmbeddedInference(policy=fixed(["a", "b"], [0.4, 0.6]), latency=INSTANT)
    assert set(await texts(interface, n=50, temperature=0.02)) == {"b"}


async def test_top_k_keeps_the_k_most_probable(autojump_clock: trio.abc.Clock) -> None:
    interface = EmbeddedInference(
        policy=fixed(["a", "b", "c", "d"], [0.1, 0.4, 0.3, 0.2]), latency=INSTANT
    )
    assert set(await texts(interface, n=200, top_k=2)) == {"b", "c"}


async def test_top_p_keeps_the_smallest_sufficient_prefix(autojump_clock: trio.abc.Clock) -> None:
    interface = EmbeddedInference(policy=fixed(["a", "b", "c"], [0.5, 0.3, 0.2]), latency=INSTANT)
    assert set(await texts(interface, n=200, top_p=0.75)) == {"a", "b"}


async def test_without_args_every_candidate_can_appear(autojump_clock: trio.abc.Clock) -> None:
    interface = EmbeddedInference(policy=fixed(["a", "b", "c"], [0.5, 0.3, 0.2]), latency=INSTANT)
    assert set(await texts(interface, n=200)) == {"a", "b", "c"}


async def test_policy_weights_are_normalized(autojump_clock: trio.abc.Clock) -> None:
    interface = EmbeddedInference(policy=fixed(["a", "b"], [3.0, 1.0]), latency=INSTANT)
    (response,) = await draw(interface, temperature=0.0)
    assert response.logprobs == [math.log(0.75)]


async def test_the_policy_sees_the_prompt_messages(autojump_clock: trio.abc.Clock) -> None:
    seen: list[list[ChatMessage]] = []

    def policy(prompt: list[ChatMessage]) -> tuple[Sequence[str], npt.ArrayLike]:
        seen.append(prompt)
        return ["ok"], [1.0]

    interface = EmbeddedInference(policy=policy, latency=INSTANT)
    messages = [ChatMessage(role="system", content="s"), ChatMessage(role="user", content="u")]
    await interface.agenerate(interface.prepare_request(messages))
    assert seen == [messages]


@pytest.mark.parametrize(
    ("completions", "probs", "match"),
    [
        ([], [], "non-empty"),
        (["a", "b"], [1.0], "one probability per completion"),
        (["a", "b"], [1.0, -0.5], ">= 0"),
        (["a", "b"], [0.0, 0.0], "positive sum"),
        (["a"], [math.nan], "finite"),
    ],
)
async def test_a_bad_policy_output_is_a_clear_error(
    completions: list[str], probs: list[float], match: str
) -> None:
    interface = EmbeddedInference(policy=fixed(completions, probs), latency=INSTANT)
    with pytest.raises(ValueError, match=match):
        await draw(interface)


def test_the_default_policy_is_a_fixed_distribution_per_prompt() -> None:
    policy = HashedPromptPolicy()
    prompt = [ChatMessage(role="user", content="Q")]
    completions, probs = policy(prompt)
    again = policy(prompt)[1]
    other = policy([ChatMessage(role="user", content="R")])[1]
    assert list(completions) == list(HashedPromptPolicy().completions)
    assert np.array_equal(np.asarray(probs), np.asarray(again))
    assert not np.array_equal(np.asarray(probs), np.asarray(other))
    assert math.isclose(float(np.sum(probs)), 1.0)


# --------------------------------------------------------------------------- tokens and logprobs


async def test_token_ids_are_the_code_points_of_raw_text(autojump_clock: trio.abc.Clock) -> None:
    interface = EmbeddedInference(policy=fixed(["héllo"], [1.0]), latency=INSTANT)
    request = interface.prepare_request("Q")
    response = await interface.agenerate(request)
    prompt = render_plain_chat(request.prompt)
    assert response.raw_text == prompt + "héllo"
    assert response.token_ids == [ord(c) for c in prompt + "héllo"]
    assert response.prompt_length == len(prompt)


async def test_logprobs_of_a_full_completion_sum_to_its_log_probability(
    autojump_clock: trio.abc.Clock,
) -> None:
    interface = EmbeddedInference(policy=fixed(["abcd", "xy"], [0.8, 0.2]), latency=INSTANT)
    (response,) = await draw(interface, temperature=0.0)
    assert response.logprobs is not None
    assert len(response.logprobs) == 4
    assert math.isclose(sum(response.logprobs), math.log(0.8))
    assert response.finish_reason == "stop"


async def test_max_tokens_truncates_the_completion(autojump_clock: trio.abc.Clock) -> None:
    interface = EmbeddedInference(policy=fixed(["abcdef"], [1.0]), latency=INSTANT)
    (response,) = await draw(interface, max_tokens=4)
    assert response.response.content == "abcd"
    assert response.finish_reason == "length"
    assert response.logprobs is not None
    assert len(response.logprobs) == 4
    assert response.token_ids is not None
    assert response.prompt_length is not None
    assert len(response.token_ids) == response.prompt_length + 4


async def test_max_tokens_at_the_length_is_a_natural_stop(autojump_clock: trio.abc.Clock) -> None:
    interface = EmbeddedInference(policy=fixed(["abc"], [1.0]), latency=INSTANT)
    (response,) = await draw(interface, max_tokens=3)
    assert (response.response.content, response.finish_reason) == ("abc", "stop")


async def test_an_empty_completion_has_no_tokens(autojump_clock: trio.abc.Clock) -> None:
    interface = EmbeddedInference(policy=fixed([""], [1.0]), latency=INSTANT)
    (response,) = await draw(interface)
    assert response.logprobs == []
    assert response.token_ids is not None
    assert len(response.token_ids) == response.prompt_length


# --------------------------------------------------------------------------- latency


async def test_latency_is_first_token_plus_per_token(autojump_clock: trio.abc.Clock) -> None:
    latency = LatencyModel(first_token=2.0, per_token=0.25, distribution="constant")
    interface = EmbeddedInference(policy=fixed(["abcd"], [1.0]), latency=latency)
    start = trio.current_time()
    await draw(interface)
    assert math.isclose(trio.current_time() - start, 2.0 + 4 * 0.25)


@pytest.mark.parametrize("distribution", ["exponential", "lognormal"])
def test_random_speed_factors_have_mean_one(distribution: Any) -> None:
    latency = LatencyModel(distribution=distribution)
    rng = np.random.default_rng(0)
    factors = [latency.speed_factor(rng) for _ in range(20_000)]
    assert min(factors) > 0
    assert math.isclose(float(np.mean(factors)), 1.0, abs_tol=0.03)
    assert np.std(factors) > 0.1


async def test_concurrent_requests_overlap(autojump_clock: trio.abc.Clock) -> None:
    interface = EmbeddedInference(policy=fixed(["ab"], [1.0]), latency=STEADY)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(draw, interface)
    assert math.isclose(trio.current_time() - start, 3.0)


async def test_a_cancelled_request_leaves_nothing_behind(autojump_clock: trio.abc.Clock) -> None:
    interface = EmbeddedInference(policy=fixed(["abcdef"], [1.0]), latency=STEADY)
    with trio.move_on_after(2.5) as scope:
        await draw(interface)
    assert scope.cancelled_caught
    (response,) = await draw(interface)
    assert response.response.content == "abcdef"


def test_sync_generate_works_without_a_loop() -> None:
    interface = EmbeddedInference(policy=fixed(["ok"], [1.0]), latency=INSTANT)
    assert interface.generate(interface.prepare_request("Q")).response.content == "ok"


# --------------------------------------------------------------------------- policy epochs


async def test_a_new_request_starts_at_the_current_epoch(autojump_clock: trio.abc.Clock) -> None:
    interface = EmbeddedInference(policy=fixed(["abc"], [1.0]), latency=STEADY)
    interface.set_generation_epoch(4)
    (response,) = await draw(interface)
    assert response.policy_epoch == [(0, 4)]
    assert response.kv_cache_epoch == [(0, 4)]
    assert response.num_evictions == 0


async def test_an_epoch_change_mid_flight_is_stamped_at_the_next_token(
    autojump_clock: trio.abc.Clock,
) -> None:
    interface = EmbeddedInference(policy=fixed(["abcdef"], [1.0]), latency=STEADY)
    responses: list[InferenceResponse] = []

    async def generate() -> None:
        responses.extend(await draw(interface))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(generate)
        # Tokens 0, 1, 2 start at t = 1, 2, 3; token 3 starts at t = 4, after the change.
        await trio.sleep(3.5)
        interface.set_generation_epoch(1)
    assert responses[0].policy_epoch == [(0, 0), (3, 1)]
    # The tokens after the change attend to the KV computed before it.
    assert responses[0].kv_cache_epoch == [(0, 0)]


async def test_several_epoch_changes_are_all_stamped(autojump_clock: trio.abc.Clock) -> None:
    interface = EmbeddedInference(policy=fixed(["abcdef"], [1.0]), latency=STEADY)
    responses: list[InferenceResponse] = []

    async def generate() -> None:
        responses.extend(await draw(interface))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(generate)
        await trio.sleep(2.5)
        interface.set_generation_epoch(1)
        await trio.sleep(2.0)
        interface.set_generation_epoch(2)
    assert responses[0].policy_epoch == [(0, 0), (2, 1), (4, 2)]


async def test_a_change_before_the_first_token_replaces_the_start(
    autojump_clock: trio.abc.Clock,
) -> None:
    interface = EmbeddedInference(policy=fixed(["abc"], [1.0]), latency=STEADY)
    responses: list[InferenceResponse] = []

    async def generate() -> None:
        responses.extend(await draw(interface))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(generate)
        await trio.sleep(0.5)
        interface.set_generation_epoch(7)
    assert responses[0].policy_epoch == [(0, 7)]


def test_generation_epoch_must_be_a_natural_number() -> None:
    interface = EmbeddedInference()
    with pytest.raises(ValueError, match=">= 0"):
        interface.set_generation_epoch(-1)
    with pytest.raises(TypeError, match="int"):
        interface.set_generation_epoch(1.5)  # type: ignore[arg-type]
    assert interface.generation_epoch == 0
