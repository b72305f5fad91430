"""SGLang's per-token weight versions (sglang#32660) on its OpenAI routes: the reply's
``sglext.weight_versions`` (spans, or one label per token; per choice for ``n``) become
exact ``policy_epoch`` boundaries once the interface has labelled the replicas, as on
vLLM's native route; labels it did not set are never guessed into epochs. A stub server
speaks both shapes (no SGLang runs on this CPU).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
from _openai_server import FakeOpenAIServer, Reply, serving

from trio_rollouts import GenerationArgs
from trio_rollouts.inference import InferenceRequest, OpenAIInference, RetryBackoff
from trio_rollouts.inference.openai._sglang import reply_spans
from trio_rollouts.inference.openai._versions import Span

NO_WAIT = RetryBackoff(initial=0.0, maximum=0.0, jitter=0.0)


@pytest.fixture
async def sglang() -> AsyncIterator[FakeOpenAIServer]:
    fake = FakeOpenAIServer(name="a", control="sglang")
    async with serving(fake):
        yield fake


def make(url: str) -> OpenAIInference:
    return OpenAIInference(
        base_url=url, model="test-model", api_key="sk-test", backoff=NO_WAIT, server="sglang"
    )


def ask(interface: OpenAIInference) -> InferenceRequest:
    return interface.prepare_request("hello", GenerationArgs(max_tokens=8))


def versions(value: Any) -> Reply:
    return Reply(top_extra={"sglext": {"weight_versions": value}})


async def labelled(interface: OpenAIInference, *epochs: int) -> None:
    """Weight updates to ``epochs``: each resume sends SGLang the new version."""
    for epoch in epochs:
        await interface.pause("drain")
        await interface.resume(epoch)


async def test_spans_of_labels_the_interface_set_are_exact_boundaries(
    sglang: FakeOpenAIServer,
) -> None:
    interface = make(sglang.base_url)
    with trio.fail_after(5):
        await labelled(interface, 2, 3)
        assert interface.stamps_policy_epoch
        sglang.reply(
            versions(
                [{"version": "2", "start": 0, "end": 3}, {"version": "3", "start": 3, "end": 8}]
            )
        )
        response = await interface.agenerate(ask(interface))
    assert response.policy_epoch == [(0, 2), (3, 3)]
    assert interface.stamps_policy_epoch


async def test_one_label_per_token_is_read_too(sglang: FakeOpenAIServer) -> None:
    interface = make(sglang.base_url)
    with trio.fail_after(5):
        await labelled(interface, 4, 5)
        sglang.reply(versions(["4", "4", "5", "5", "5"]))
        response = await interface.agenerate(ask(interface))
    assert response.policy_epoch == [(0, 4), (2, 5)]


def test_each_choice_of_a_reply_has_its_own_versions() -> None:
    """``n`` choices: a list per choice in ``sglext``, or each choice's own ``meta_info``."""
    per_choice = {"sglext": {"weight_versions": [["1", "2", "2"], ["1", "1"]]}}
    spans = reply_spans({"choices": [{}, {}], **per_choice}, 2)
    assert spans == [[Span("1", 0, 1), Span("2", 1, 3)], [Span("1", 0, 2)]]
    own = {"choices": [{"meta_info": {"weight_versions": ["3"]}}, {}]}
    assert reply_spans(own, 2) == [[Span("3", 0, 1)], None]
    assert reply_spans({"choices": [{}]}, 1) == [None]
    assert reply_spans({"sglext": {"weight_versions": [{"version": 1}]}}, 1) == [None]


async def test_a_label_it_did_not_set_keeps_the_start_epoch(sglang: FakeOpenAIServer) -> None:
    interface = make(sglang.base_url)
    with trio.fail_after(5):
        # A fresh server labels tokens "default": not guessed into an epoch.
        sglang.reply(versions(["default", "default"]))
        first = await interface.agenerate(ask(interface))
        assert first.policy_epoch == [(0, 0)]
        assert not interface.stamps_policy_epoch  # not labelled by this interface yet
        await labelled(interface, 1)
        assert interface.stamps_policy_epoch
        # Someone else relabelled the server: the replica no longer counts as stamping.
        sglang.reply(versions([{"version": "theirs", "start": 0, "end": 4}]))
        second = await interface.agenerate(ask(interface))
    assert second.policy_epoch == [(0, 1)]
    assert not interface.stamps_policy_epoch


async def test_a_reply_without_versions_after_labelling_stops_stamping(
    sglang: FakeOpenAIServer,
) -> None:
    interface = make(sglang.base_url)
    with trio.fail_after(5):
        await labelled(interface, 1)
        response = await interface.agenerate(ask(interface))  # the stub sends none
    assert response.policy_epoch == [(0, 1)]
    assert not interface.stamps_policy_epoch
