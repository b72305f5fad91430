"""Things that used to happen silently are visible: the HTTP client's retries (per replica,
in ``OpenAIInference.statistics()``, ``stream.metrics()`` and a log record of the
library's own), skipped groups (a warning each), the oldest call in flight
(``statistics().oldest_in_flight_s``) and a backend whose epoch runs ahead of the
stream's (a warning naming ``weight_update``).

The HTTP tests use a real server on loopback (``_openai_server``): real sockets need real
time, so their waits are bounded with ``trio.fail_after`` and kept to fractions of a
second; the pipeline's own tests run on the autojump clock.
"""

from __future__ import annotations

import io
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing
from _cli_helpers import invoke, standard_prompts
from _openai_server import FakeOpenAIServer, Reply, serving, serving_in_thread
from rich.console import Console

import trio_rollouts as tr
from trio_rollouts.cli._common import run
from trio_rollouts.cli._progress import RunProgress
from trio_rollouts.inference import (
    OpenAIInference,
    RetryBackoff,
    ServerError,
    Timeout,
)
from trio_rollouts.testing import ScriptedAgent, rollouts

#: No waiting between attempts: these tests count retries, not seconds.
NO_WAIT = RetryBackoff(initial=0.0, maximum=0.0, jitter=0.0)
#: Upper bound for anything that should be quick on loopback.
PROMPT = 5.0
#: The logger of the client's retries.
RETRY_LOGGER = "trio_rollouts.inference._retry"


@pytest.fixture
async def replicas() -> AsyncIterator[tuple[FakeOpenAIServer, FakeOpenAIServer]]:
    first, second = FakeOpenAIServer(name="a"), FakeOpenAIServer(name="b")
    async with serving(first, second):
        yield first, second


def client(urls: str | list[str], **options: object) -> OpenAIInference:
    settings: dict[str, object] = {"model": "m", "api_key": "sk-secret", "backoff": NO_WAIT}
    return OpenAIInference(base_url=urls, **{**settings, **options})  # type: ignore[arg-type]


def one_request_per_group() -> ScriptedAgent:
    async def script(agent: ScriptedAgent, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        interface = request.inference_interface
        await interface.agenerate(interface.prepare_request("hi", request.generation_args))
        return rollouts([0.0, 1.0])

    return ScriptedAgent(script=script, parallel_generation_tasks=1, buffer_size=4)


# --------------------------------------------------------------------------- client retries


async def test_client_statistics_count_retries_per_replica_and_error(
    replicas: tuple[FakeOpenAIServer, FakeOpenAIServer],
) -> None:
    first, second = replicas
    first.reply(Reply(status=503, json={"error": {"message": "busy"}}))
    # Then a hung replica: it answers long after the read timeout.
    second.reply(Reply(), Reply(delay=1.0))
    interface = client([first.base_url, second.base_url], timeout=Timeout(read=0.2))
    with trio.fail_after(PROMPT):
        # Calls outside a pipeline go to the least loaded replica, ties in turn: replica
        # 0 answers 503, the retry goes to replica 1; then replica 0 answers; then
        # replica 1 hangs (a read timeout), and the retry goes to replica 0.
        for text in ("x", "y", "z"):
            await interface.agenerate(interface.prepare_request(text, tr.GenerationArgs()))
    statistics = interface.statistics()
    assert statistics.retries == 2
    assert statistics.retries_by_replica == (1, 1)
    assert statistics.retry_errors_by_replica == (
        (("ServerError", 1),),
        (("InferenceTimeoutError", 1),),
    )


def test_client_statistics_without_retries_have_a_zero_per_replica() -> None:
    interface = client(["http://10.0.0.7:8000/v1", "http://10.0.0.8:8000/v1"])
    statistics = interface.statistics()
    assert statistics.retries_by_replica == (0, 0)
    assert statistics.retry_errors_by_replica == ((), ())
    record = tr.unstructure(statistics)
    assert tr.structure(record, type(statistics)) == statistics


async def test_each_client_retry_is_logged_with_url_error_group_and_attempt(
    replicas: tuple[FakeOpenAIServer, FakeOpenAIServer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, _ = replicas
    server.reply(Reply(delay=1.0), Reply(status=503, json={"error": {"message": "busy"}}))
    interface = client(server.base_url, timeout=Timeout(read=0.2))
    agent = one_request_per_group()
    request = tr.GroupedRolloutRequest(
        inference_interface=interface, num_groups=1, rollouts_per_group=2, streaming=True
    )
    caplog.set_level(logging.WARNING, logger=RETRY_LOGGER)
    with trio.fail_after(PROMPT):
        async with agent.get_grouped_rollouts(request) as stream:
            await stream.receive()
    records = [r for r in caplog.records if r.name == RETRY_LOGGER]
    assert [(r.levelno, r.attempt, r.max_attempts) for r in records] == [  # type: ignore[attr-defined]
        (logging.WARNING, 2, 4),
        (logging.WARNING, 3, 4),
    ]
    timed_out, busy = records
    url = f"{server.base_url}/chat/completions"
    for record in records:
        assert record.url == url  # type: ignore[attr-defined]
        assert (record.batch_id, record.index_in_batch) == (0, 0)  # type: ignore[attr-defined]
        assert record.backoff_s >= 0  # type: ignore[attr-defined]
        assert "sk-secret" not in record.getMessage()
        assert "for the group of batch_id=0, index=0" in record.getMessage()
    assert timed_out.error_type == "InferenceTimeoutError"  # type: ignore[attr-defined]
    assert url in timed_out.getMessage()
    assert "attempt 2 of 4" in timed_out.getMessage()
    assert "InferenceTimeoutError" in timed_out.getMessage()
    assert busy.error_type == "ServerError"  # type: ignore[attr-defined]
    assert "busy" in busy.getMessage()


async def test_a_retry_outside_a_pipeline_is_logged_without_a_group(
    replicas: tuple[FakeOpenAIServer, FakeOpenAIServer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, _ = replicas
    server.reply(Reply(status=503, json={"error": {"message": "busy"}}))
    interface = client(server.base_url, backoff=RetryBackoff(initial=0.05, maximum=0.05, jitter=0))
    caplog.set_level(logging.WARNING, logger=RETRY_LOGGER)
    with trio.fail_after(PROMPT):
        await interface.agenerate(interface.prepare_request("x", tr.GenerationArgs()))
    [record] = [r for r in caplog.records if r.name == RETRY_LOGGER]
    assert record.batch_id is None  # type: ignore[attr-defined]
    assert "for the group" not in record.getMessage()
    assert record.backoff_s >= 0.05  # type: ignore[attr-defined]


async def test_stream_metrics_show_client_retries_per_replica_as_deltas(
    replicas: tuple[FakeOpenAIServer, FakeOpenAIServer],
) -> None:
    server, _ = replicas
    busy = Reply(status=503, json={"error": {"message": "busy"}})
    server.reply(Reply(delay=1.0), busy)
    interface = client(server.base_url, timeout=Timeout(read=0.2))
    request = tr.GroupedRolloutRequest(
        inference_interface=interface, num_groups=1, rollouts_per_group=2, streaming=True
    )
    with trio.fail_after(PROMPT):
        async with one_request_per_group().get_grouped_rollouts(request) as stream:
            stream.metrics()
            await stream.receive()
            first = stream.metrics()
            server.reply(busy)
            await stream.receive()
            await stream.receive()
            second = stream.metrics()
            third = stream.metrics()
    # The client's retries of single requests, not the pipeline's retries of groups.
    assert first["rollout/retries"] == 0
    assert first["inference/0/retries"] == 2
    assert first["inference/0/retries/InferenceTimeoutError"] == 1
    assert first["inference/0/retries/ServerError"] == 1
    assert second["inference/0/retries"] == 1
    assert second["inference/0/retries/ServerError"] == 1
    assert second["inference/0/retries/InferenceTimeoutError"] == 0
    assert third["inference/0/retries"] == 0
    assert third["inference/0/retries/ServerError"] == 0


async def test_a_pipeline_retry_of_a_group_is_not_a_client_retry(
    autojump_clock: trio.testing.MockClock,
) -> None:
    failed = False

    async def script(agent: ScriptedAgent, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        nonlocal failed
        await trio.sleep(1)
        if not failed:
            failed = True
            raise ServerError("503", status=503)
        return rollouts([0.0, 1.0])

    agent = ScriptedAgent(
        script=script,
        parallel_generation_tasks=1,
        failure_policy=tr.FailurePolicy(max_attempts=2, wait_initial=0, wait_jitter=0),
    )
    request = tr.GroupedRolloutRequest(
        inference_interface=tr.EmbeddedInference(),
        num_groups=1,
        rollouts_per_group=2,
        streaming=True,
    )
    async with agent.get_grouped_rollouts(request) as stream:
        await stream.receive()
        metrics = stream.metrics()
    assert metrics["rollout/retries"] == 1
    assert not any(name.endswith("/retries") for name in metrics if name.startswith("inference/"))


# --------------------------------------------------------------------------- skipped groups

SKIP_LOGGER = "trio_rollouts.pipeline._failure"


def skipped_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == SKIP_LOGGER]


def failing_first(fail: int, error: Exception) -> ScriptedAgent:
    """Its first ``fail`` calls raise ``error``, the others return a group."""

    async def script(agent: ScriptedAgent, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        number = agent.calls
        await trio.sleep(1)
        if number <= fail:
            raise error
        return rollouts([0.0, 1.0])

    return ScriptedAgent(script=script, parallel_generation_tasks=1, buffer_size=4)


def one_group(**options: object) -> tr.GroupedRolloutRequest:
    settings: dict[str, object] = {
        "inference_interface": tr.EmbeddedInference(),
        "num_groups": 1,
        "rollouts_per_group": 2,
        "streaming": True,
    }
    return tr.GroupedRolloutRequest(**{**settings, **options})  # type: ignore[arg-type]


@pytest.mark.parametrize("deadline", [None, 60.0])  # the fast path is timed by the watchdog
async def test_a_skipped_group_is_logged_once_with_its_error_and_attempts(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, deadline: float | None
) -> None:
    agent = failing_first(3, ServerError("POST http://h/v1: 503 overloaded", status=503))
    agent.failure_policy = tr.FailurePolicy(
        group_timeout=deadline, max_attempts=3, wait_initial=0, wait_jitter=0, on_failure="skip"
    )
    caplog.set_level(logging.WARNING, logger=SKIP_LOGGER)
    async with agent.get_grouped_rollouts(one_group()) as stream:
        group = await stream.receive()
        statistics = stream.statistics()
    assert (group.batch_id, group.index_in_batch) == (0, 0)  # the slot generated anew
    assert (statistics.skipped, statistics.retries) == (1, 2)
    [record] = skipped_records(caplog)
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "skipped the group of ScriptedAgent.group_rollout (batch_id=0, index=0) after 3 "
        "attempts: ServerError: POST http://h/v1: 503 overloaded (1 of skip_budget=100 "
        "groups skipped; its slot is generated anew)"
    )
    assert (record.attempts, record.error_type, record.skipped) == (3, "ServerError", 1)  # type: ignore[attr-defined]


async def test_a_group_skipped_at_its_first_failure_says_one_attempt(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    agent = failing_first(2, KeyError("answer"))  # a bug: not transient, never retried
    agent.failure_policy = tr.FailurePolicy(max_attempts=3, on_failure="skip")
    caplog.set_level(logging.WARNING, logger=SKIP_LOGGER)
    async with agent.get_grouped_rollouts(one_group()) as stream:
        await stream.receive()
    messages = [record.getMessage() for record in skipped_records(caplog)]
    assert len(messages) == 2  # one per skipped group
    assert all("after 1 attempt: KeyError: 'answer'" in message for message in messages)
    assert "(2 of skip_budget=100 groups skipped" in messages[1]


async def test_a_skipped_group_names_its_problem(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    calls = 0

    async def script(agent: ScriptedAgent, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        nonlocal calls
        calls += 1
        assert agent.prompts is not None
        problem = agent.prompts.draw()
        await trio.sleep(1)
        if calls == 1:
            raise ExceptionGroup("nursery", [ServerError("503", status=503)])
        return [
            tr.Rollout(trajectory=["x"], reward=float(i), problem_id=problem.problem_id)
            for i in range(2)
        ]

    agent = ScriptedAgent(
        script=script,
        parallel_generation_tasks=1,
        prompts=tr.PromptSource([tr.Problem(problem_id="p7", prompt="q", answer=1)], shuffle=False),
        failure_policy=tr.FailurePolicy(on_failure="skip"),
    )
    caplog.set_level(logging.WARNING, logger=SKIP_LOGGER)
    async with agent.get_grouped_rollouts(one_group()) as stream:
        await stream.receive()
    [record] = skipped_records(caplog)
    assert "(batch_id=0, index=0), problem 'p7' after 1 attempt: ServerError: 503" in (
        record.getMessage()
    )
    assert record.error_type == "ServerError"  # type: ignore[attr-defined]
    assert record.problem_ids == ("p7",)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- calls in flight


def hung_first() -> ScriptedAgent:
    """Its first call never returns; every other takes one second."""

    async def script(agent: ScriptedAgent, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        if agent.calls == 1:
            await trio.sleep_forever()
        await trio.sleep(1)
        return rollouts([0.0, 1.0])

    return ScriptedAgent(script=script, parallel_generation_tasks=2, buffer_size=4)


@pytest.mark.parametrize(
    "options",
    [
        {},  # the fast path
        {"failure_policy": tr.FailurePolicy(group_timeout=100.0)},  # timed by the watchdog
        {"filter": True},  # the slow path
    ],
    ids=["fast", "timed", "slow"],
)
async def test_statistics_say_how_long_the_oldest_call_in_flight_has_run(
    autojump_clock: trio.testing.MockClock, options: dict[str, object]
) -> None:
    agent = hung_first()
    if "failure_policy" in options:
        agent.failure_policy = options["failure_policy"]  # type: ignore[assignment]
    request = one_group(filter_groups_with_same_reward="filter" in options)
    async with agent.get_grouped_rollouts(request) as stream:
        before = stream.statistics()
        metrics = stream.metrics()
        for _ in range(3):
            await stream.receive()
        await trio.sleep(0.5)
        during = stream.statistics()
        gauge = stream.metrics()["rollout/oldest_in_flight_s"]
    after = stream.statistics()
    assert (before.in_flight, before.oldest_in_flight_s) == (0, 0.0)
    assert metrics["rollout/oldest_in_flight_s"] == 0.0
    # The hung call has run since the start; the other call in flight for 0.5 s.
    assert (during.in_flight, during.oldest_in_flight_s) == (2, 3.5)
    assert gauge == 3.5
    assert (after.in_flight, after.oldest_in_flight_s) == (0, 0.0)


async def test_slow_calls_keep_the_oldest_young(autojump_clock: trio.testing.MockClock) -> None:
    async def slow(agent: ScriptedAgent, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await trio.sleep(10)
        return rollouts([0.0, 1.0])

    agent = ScriptedAgent(script=slow, parallel_generation_tasks=1, buffer_size=0)
    async with agent.get_grouped_rollouts(one_group()) as stream:
        ages = []
        for _ in range(3):
            await stream.receive()
            await trio.sleep(4)
            ages.append(stream.statistics().oldest_in_flight_s)
    assert ages == [4.0, 4.0, 4.0]


def plain_console() -> tuple[Console, io.StringIO]:
    """A console on a file that is not a terminal, as a Slurm log or ``2> log``."""
    file = io.StringIO()
    return Console(file=file, force_terminal=False, width=200), file


def test_progress_lines_tell_a_hung_call_from_a_slow_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIO_ROLLOUTS_PROGRESS_SECONDS", "30")
    console, file = plain_console()
    progress = RunProgress(console, verb="generating", unit="group", total=4)

    async def generate() -> None:
        async with hung_first().get_grouped_rollouts(one_group()) as stream:

            def calls() -> tuple[int, float]:
                statistics = stream.statistics()
                return statistics.in_flight, statistics.oldest_in_flight_s

            progress.watch(calls)
            for _ in range(3):
                await stream.receive()
                progress.advance()
            await trio.sleep(58)  # the fourth group never comes

    with progress:
        run(generate, clock=trio.testing.MockClock(autojump_threshold=0), beside=progress.heartbeat)
    # The hung call is the only one in flight once the buffer holds what the consumer
    # does not take.
    assert file.getvalue().splitlines()[1:] == [
        "generating: 3/4 groups (75%), 10.0 s/group, retries 0, in flight 1 (oldest 30 s), "
        "30 s elapsed",
        "generating: 3/4 groups (75%), 20.0 s/group, retries 0, in flight 1 (oldest 60 s), "
        "60 s elapsed",
        "generating: 3/4 groups (75%), 20.3 s/group, retries 0, in flight 0, 61 s elapsed",
    ]


def test_the_progress_bar_shows_the_calls_in_flight() -> None:
    file = io.StringIO()
    console = Console(file=file, force_terminal=True, width=120)
    progress = RunProgress(console, verb="evaluating", unit="request", total=2)

    async def work() -> None:
        started = trio.current_time()
        progress.watch(lambda: (1, trio.current_time() - started))
        await trio.sleep(12.5)

    with progress:
        run(work, clock=trio.testing.MockClock(autojump_threshold=0), beside=progress.heartbeat)
    assert "in flight 1 (oldest 12 s)" in file.getvalue()


def test_generate_shows_the_calls_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRIO_ROLLOUTS_PROGRESS_SECONDS", "0.2")
    prompts = standard_prompts(tmp_path / "prompts.jsonl")
    server = FakeOpenAIServer(name="server", default=Reply(delay=1.0))
    with serving_in_thread(server):
        result = invoke("generate", "--base-url", server.base_url, "--model", "m",
                        "--prompts", prompts, "--num-prompts", 1, "--group-size", 1,
                        "--out", tmp_path / "o.jsonl")  # fmt: skip
    assert result.exit_code == 0, result.output
    calls = re.findall(r"^generating: .*, retries 0, (in flight .*?), ", result.stderr, re.M)
    # A line every 0.2 s while the one call takes a second, and the last when it is done.
    assert any(re.fullmatch(r"in flight 1 \(oldest 0\.\d s\)", text) for text in calls[:-1])
    assert calls[-1] == "in flight 0"


# --------------------------------------------------------------------------- epochs ahead

AHEAD = r"is at policy epoch 3, but the stream is at epoch 0(.|\n)*weight_update\(\)"


def epoch_agent() -> ScriptedAgent:
    async def script(agent: ScriptedAgent, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        interface = request.inference_interface
        prompt = interface.prepare_request("Pick A, B or C.", request.generation_args)
        response = await interface.agenerate(prompt)
        return [
            tr.Rollout(
                trajectory=[response.raw_text or ""],
                reward=float(i),
                policy_epoch=[response.policy_epoch],
            )
            for i in range(2)
        ]

    return ScriptedAgent(script=script, parallel_generation_tasks=2, buffer_size=2)


async def test_weights_pushed_around_weight_update_warn_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    model = tr.EmbeddedInference(seed=0)
    request = one_group(inference_interface=model, max_staleness=0)
    async with epoch_agent().get_grouped_rollouts(request) as stream:
        await stream.receive()
        model.set_generation_epoch(3)  # the backend moves, the stream does not
        with pytest.warns(UserWarning, match=AHEAD):
            await stream.receive()
        for _ in range(4):  # once per stream
            group = await stream.receive()
        # Generated under epoch 3, counted as started under 0, and never stale.
        assert (group.start_epoch, group[0].policy_epoch) == (0, [[(0, 3)]])
        assert (stream.policy_epoch, stream.statistics().stale) == (0, 0)


async def test_weight_update_moves_both_and_does_not_warn(
    autojump_clock: trio.testing.MockClock,
) -> None:
    model = tr.EmbeddedInference(seed=0)
    request = one_group(inference_interface=model, max_staleness=0)
    async with epoch_agent().get_grouped_rollouts(request) as stream:
        await stream.receive()
        async with stream.weight_update() as update:
            pass  # push the weights of update.epoch here
        for _ in range(4):
            group = await stream.receive()
        assert (stream.policy_epoch, model.policy_epoch, update.epoch) == (1, 1, 1)
        assert (group.start_epoch, group[0].policy_epoch) == (1, [[(0, 1)]])


def test_the_sync_bridge_warns_too() -> None:
    model = tr.EmbeddedInference(seed=0)
    request = one_group(inference_interface=model)
    with tr.blocking_grouped_rollouts(epoch_agent(), request) as stream:
        stream.take(1, timeout=60)
        model.set_generation_epoch(3)
        with pytest.warns(UserWarning, match=AHEAD):
            stream.take(2, timeout=60)
