"""What the server says about a sample: the sampling record, request seeds, the embedded
backend's seeded and processed sampling, replays and resumes, and the check that names
biased combinations when a stream opens (DESIGN.md, "What the server says about a
sample").

Every pipeline run is on Trio's MockClock (``autojump_clock``, or a ``trio.run`` with a
MockClock of its own), so runs are deterministic and take no real time.
"""

from __future__ import annotations

import io
import json
import math
import os
import pathlib
import random
import signal
import subprocess
import sys
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs
import hypothesis.strategies as st
import numpy.typing as npt
import pytest
import trio
import trio.testing
from hypothesis import given, settings

import trio_rollouts as tr
from trio_rollouts import GenerationArgs, SamplingSpan, TokenRollout
from trio_rollouts._context import CallContext, Draw, call_context, current_call
from trio_rollouts.inference import (
    EmbeddedInference,
    InferenceConnectionError,
    InferenceRequest,
    InferenceResponse,
    LatencyModel,
    ReplicaProbe,
    WeightUpdateMode,
    render_plain_chat,
)
from trio_rollouts.inference._sampling import continuation_seed, derive_seed
from trio_rollouts.pipeline._sampling import request_seed

WORKER = pathlib.Path(__file__).with_name("_sampling_worker.py")
STEADY = LatencyModel(first_token=1.0, per_token=1.0, distribution="constant")
PROBLEMS = [
    tr.Problem(problem_id=f"p{i}", prompt=f"question {i}" + "?" * i, answer="A") for i in range(3)
]


def fixed(completions: Sequence[str], probs: Sequence[float]) -> Any:
    """A policy with the same completions and probabilities for every prompt."""

    def policy(prompt: list[tr.ChatMessage]) -> tuple[Sequence[str], npt.ArrayLike]:
        return completions, probs

    return policy


def user(text: str) -> tr.ChatMessage:
    return tr.ChatMessage(role="user", content=text)


def prompt_length(problem: tr.Problem) -> int:
    """The element position of the first generated id (the embedded backend's tokens
    are the characters of the plain rendering)."""
    assert isinstance(problem.prompt, str)
    return len(render_plain_chat([user(problem.prompt)]))


LENGTHS = {problem.problem_id: prompt_length(problem) for problem in PROBLEMS}


@attrs.define(eq=False, kw_only=True)
class Recording(EmbeddedInference):
    """The embedded backend, recording the seed of every request it receives.

    ``fail``: the numbers (from 1) of the requests that fail transiently, after a short
    while. ``continued``: request number -> how many times a weight update aborted it
    and it was continued, each continuation sent with ``continuation_seed`` (what an
    HTTP backend sends; the embedded backend itself continues in place), recorded in
    :attr:`seeds` beside the request's own."""

    fail: frozenset[int] = frozenset()
    continued: dict[int, int] = attrs.field(factory=dict)
    #: Every seed received, continuations included, in arrival order.
    seeds: list[int | None] = attrs.field(factory=list, init=False)
    #: Requests received.
    received: int = attrs.field(default=0, init=False)

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        self.received += 1
        number = self.received
        seed = request.generation_args.seed
        self.seeds.append(seed)
        for continuation in range(1, self.continued.get(number, 0) + 1):
            self.seeds.append(continuation_seed(seed, continuation))
        if number in self.fail:
            await trio.sleep(0.01)
            msg = f"request {number}: the connection dropped"
            raise InferenceConnectionError(msg)
        return await super().base_generate(request)


@attrs.define(kw_only=True)
class Graded(tr.RewardOnlyAgent):
    """1.0 for the completion ``"A"``; keeps the data pass of its draw in ``extra``."""

    async def get_reward(self, problem: tr.Problem, response: InferenceResponse) -> float:
        await trio.lowlevel.checkpoint()
        return float(response.response.content == problem.answer)


@attrs.define(kw_only=True)
class PassGraded(Graded):
    """Graded, and each rollout says which pass over the data drew its problem."""

    def annotate_rollout(self, rollout: tr.Rollout | TokenRollout, response: Any) -> None:
        draws = current_call().draws or []
        rollout.extra["data_pass"] = draws[-1].epoch


def token_rollouts(groups: Sequence[tr.RolloutGroup]) -> list[TokenRollout]:
    out = []
    for group in groups:
        for rollout in group:
            assert isinstance(rollout, TokenRollout)
            out.append(rollout)
    return out


def span_seeds(rollouts: Sequence[TokenRollout]) -> list[int | None]:
    seeds: list[int | None] = []
    for rollout in rollouts:
        assert rollout.sampling is not None
        seeds.extend(span.seed for spans in rollout.sampling for span in spans)
    return seeds


def duplicates(values: Sequence[object]) -> dict[object, int]:
    return {value: n for value, n in Counter(values).items() if n > 1}


def expected_seed(
    request: tr.GroupedRolloutRequest, problem_id: str, data_pass: int, member: int, turn: int = 0
) -> int | None:
    """What ``request_seed`` gives a call that drew ``problem_id`` in pass ``data_pass``
    (at the backend's epoch, first attempt)."""

    def settle(epoch: int, problem_id: str, done: bool) -> None:
        raise AssertionError("not settled here")

    token = call_context.set(CallContext(draws=[Draw(settle, data_pass, problem_id)]))
    try:
        return request_seed(request, request.inference_interface, problem_id, member, turn)
    finally:
        call_context.reset(token)


def to_jsonl(rollouts: Sequence[object]) -> str:
    buffer = io.StringIO()
    tr.dump_jsonl(rollouts, buffer)
    return buffer.getvalue()


# =========================================================================== 1. models


def test_sampling_span_errors_name_the_field_and_the_value() -> None:
    with pytest.raises(ValueError, match=r"SamplingSpan\.start must be an int >= 0.*got -1"):
        SamplingSpan(start=-1)
    with pytest.raises(
        ValueError,
        match=r"SamplingSpan\.logprobs_mode must be one of 'processed', 'raw', 'unknown', "
        r"got 'cooked'",
    ):
        SamplingSpan(start=0, logprobs_mode="cooked")
    with pytest.raises(TypeError, match=r"SamplingSpan\.seed must be an int or None, got '7'"):
        SamplingSpan(start=0, seed="7")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"SamplingSpan\.seed must be an int or None, got 1\.5"):
        SamplingSpan(start=0, seed=1.5)  # type: ignore[arg-type]
    span = SamplingSpan(start=0)
    assert (span.args, span.seed, span.logprobs_mode, span.sampling_mask) == (
        GenerationArgs(),
        None,
        "unknown",
        None,
    )


def test_token_rollout_sampling_needs_one_entry_per_element() -> None:
    span = SamplingSpan(start=1, seed=3, logprobs_mode="processed")
    with pytest.raises(ValueError, match=r"sampling has 2 entries but trajectory has 1 elements"):
        TokenRollout(trajectory=[[1, 2, 3]], reward=1.0, sampling=[[span], [span]])
    with pytest.raises(TypeError, match=r"sampling must be None or a list"):
        TokenRollout(trajectory=[[1, 2, 3]], reward=1.0, sampling=[span])  # type: ignore[list-item]
    ok = TokenRollout(trajectory=[[1, 2, 3], [4]], reward=1.0, sampling=[[span], []])
    assert ok.sampling == [[span], []]


def test_spans_survive_json_and_jsonl_and_none_is_left_out() -> None:
    with_mask = SamplingSpan(
        start=2,
        args=GenerationArgs(temperature=0.7, top_p=0.9, max_tokens=8, seed=2**63 - 1),
        seed=2**63 - 1,
        logprobs_mode="raw",
        sampling_mask=[[5, 9], [1]],
    )
    plain = SamplingSpan(start=4, logprobs_mode="processed")
    rollout = TokenRollout(
        trajectory=[[1, 2, 3, 4, 5], [6, 7]],
        reward=0.5,
        generation_mask=[[False, False, True, True, True], [True, True]],
        logprobs=[[-0.1, -0.2, -0.3], [-0.4, -0.5]],
        sampling=[[with_mask, plain], [SamplingSpan(start=0, seed=0)]],
    )
    data = tr.unstructure(rollout)
    spans = data["sampling"]
    assert spans[0][0]["sampling_mask"] == [[5, 9], [1]]
    assert spans[0][0]["seed"] == 2**63 - 1
    assert "sampling_mask" not in spans[0][1]
    assert "sampling_mask" not in spans[1][0]
    assert json.loads(json.dumps(data)) == data
    back = tr.structure(json.loads(json.dumps(data)), TokenRollout)
    assert back.sampling == rollout.sampling
    assert back == rollout

    unknown = TokenRollout(trajectory=[[1, 2]], reward=0.0)
    assert "sampling" not in tr.unstructure(unknown)

    group = tr.RolloutGroup(rollouts=[rollout, unknown])
    buffer = io.StringIO()
    assert tr.dump_jsonl([group, group], buffer) == 2
    assert '"sampling_mask":null' not in buffer.getvalue()
    buffer.seek(0)
    loaded = list(tr.load_jsonl(buffer, tr.RolloutGroup))
    assert len(loaded) == 2
    for again in loaded:
        first, second = again.rollouts
        assert isinstance(first, TokenRollout)
        assert isinstance(second, TokenRollout)
        assert first.sampling == rollout.sampling
        assert second.sampling is None
    assert to_jsonl(loaded) == buffer.getvalue()

    # A bad span in a file is an error naming where it is.
    bad = {
        "trajectory": [[1, 2]],
        "reward": 0.0,
        "sampling": [[{"start": 1, "logprobs_mode": "x"}]],
    }
    with pytest.raises(
        tr.ValidationError, match=r"logprobs_mode must be one of .*sampling\[0\]\[0\]"
    ):
        list(tr.load_jsonl(io.StringIO(json.dumps(bad) + "\n"), TokenRollout))


def test_generation_args_seed_refuses_bools_negatives_and_int64_overflow() -> None:
    with pytest.raises(TypeError, match=r"seed must be an int in \[0, 2\*\*63\) or None, got True"):
        GenerationArgs(seed=True)
    with pytest.raises(TypeError, match=r"seed must be an int in \[0, 2\*\*63\) or None, got 1\.0"):
        GenerationArgs(seed=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*63\) .*int64.*got -1"):
        GenerationArgs(seed=-1)
    with pytest.raises(ValueError, match=rf"seed must be in \[0, 2\*\*63\) .*got {2**63}"):
        GenerationArgs(seed=2**63)
    assert GenerationArgs(seed=0).seed == 0
    assert GenerationArgs(seed=2**63 - 1).seed == 2**63 - 1
    # A seed is forwarded like every other set field.
    assert GenerationArgs(temperature=0.5, seed=3).set_fields() == {"temperature": 0.5, "seed": 3}
    assert GenerationArgs(seed=3).add(GenerationArgs(seed=4)).seed == 4


def test_grouped_request_sampling_check_and_seed_are_checked() -> None:
    interface = EmbeddedInference()
    default = tr.GroupedRolloutRequest(
        num_groups=1, rollouts_per_group=1, inference_interface=interface
    )
    assert (default.sampling_check, default.seed) == ("warn", None)
    with pytest.raises(
        ValueError, match=r"sampling_check must be one of 'warn', 'raise', 'off', got 'maybe'"
    ):
        tr.GroupedRolloutRequest(
            num_groups=1,
            rollouts_per_group=1,
            inference_interface=interface,
            sampling_check="maybe",
        )
    with pytest.raises(TypeError, match=r"seed must be an int or None \(the run's seed\), got 'x'"):
        tr.GroupedRolloutRequest(
            num_groups=1,
            rollouts_per_group=1,
            inference_interface=interface,
            seed="x",  # type: ignore[arg-type]
        )


# ====================================================================== 2. single turn


async def single_turn_run(
    args: GenerationArgs,
    seed: int | None,
    *,
    groups: int = 5,
    members: int = 3,
    group_calls: bool = True,
) -> tuple[tr.GroupedRolloutRequest, Recording, list[tr.RolloutGroup]]:
    interface = Recording(seed=1, policy=fixed(["A", "BB", "CCC"], [0.5, 0.3, 0.2]))
    agent = PassGraded(prompts=tr.PromptSource(PROBLEMS, seed=4), parallel_generation_tasks=4)
    request = tr.GroupedRolloutRequest(
        num_groups=2,
        rollouts_per_group=members,
        inference_interface=interface,
        generation_args=args,
        streaming=True,
        seed=seed,
        group_calls=group_calls,
    )
    async with agent.get_grouped_rollouts(request) as stream:
        taken = [await stream.receive() for _ in range(groups)]
    return request, interface, taken


@pytest.mark.parametrize("group_calls", [False, True], ids=["member-calls", "group-calls"])
async def test_each_rollout_records_its_span_at_the_prompt_length_with_its_seed(
    autojump_clock: trio.testing.MockClock, group_calls: bool
) -> None:
    """One call per member: each member's own seed. One call per group (n): the call
    is sent member 0's seed s, and member i records s + i, the seed of its choice."""
    args = GenerationArgs(temperature=0.8, max_tokens=10)
    request, interface, groups = await single_turn_run(args, seed=7, group_calls=group_calls)
    rollouts = token_rollouts(groups)
    assert len(rollouts) == 5 * 3
    passes: dict[str, list[int]] = {}
    for group in groups:
        problem_id = group[0].problem_id
        assert problem_id is not None
        data_pass = group[0].extra["data_pass"]
        passes.setdefault(problem_id, []).append(data_pass)
        for member, rollout in enumerate(group):
            assert isinstance(rollout, TokenRollout)
            start = LENGTHS[problem_id]
            seed = expected_seed(request, problem_id, data_pass, 0 if group_calls else member)
            assert seed is not None
            # request_seed is the documented hash (run seed, epoch, problem, data pass,
            # member, turn).
            assert seed == derive_seed(7, 0, problem_id, data_pass, 0 if group_calls else member, 0)
            if group_calls:
                seed += member
            assert rollout.sampling == [
                [
                    SamplingSpan(
                        start=start,
                        args=attrs.evolve(args, seed=seed),
                        seed=seed,
                        logprobs_mode="processed",
                    )
                ]
            ]
            mask = rollout.generation_mask
            assert mask is not None
            assert mask[0].index(True) == start
            assert rollout.policy_epoch == [[(0, 0)]]
    # Every problem is drawn once per pass (5 groups of 3 problems, some running ahead).
    assert sum(len(p) for p in passes.values()) == 5
    assert all(len(set(p)) == len(p) for p in passes.values())
    assert {data_pass for p in passes.values() for data_pass in p} >= {0, 1}
    seeds = span_seeds(rollouts)
    assert duplicates(seeds) == {}
    assert None not in seeds
    # The backend received exactly these seeds: no request went out without one.
    assert Counter(interface.seeds) >= Counter(seeds)
    assert None not in interface.seeds
    assert duplicates(interface.seeds) == {}


async def test_a_run_seed_replaces_the_seed_of_the_generation_args(
    autojump_clock: trio.testing.MockClock,
) -> None:
    _, interface, groups = await single_turn_run(GenerationArgs(seed=5), seed=7, groups=2)
    seeds = span_seeds(token_rollouts(groups))
    assert 5 not in seeds
    assert 5 not in interface.seeds
    assert duplicates(seeds) == {}


async def test_without_a_run_seed_every_span_has_the_args_seed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    args = GenerationArgs(temperature=0.9, seed=5)
    _, interface, groups = await single_turn_run(args, seed=None, groups=3, group_calls=False)
    for rollout in token_rollouts(groups):
        assert rollout.problem_id is not None
        assert rollout.sampling == [
            [
                SamplingSpan(
                    start=LENGTHS[rollout.problem_id], args=args, seed=5, logprobs_mode="processed"
                )
            ]
        ]
    assert set(interface.seeds) == {5}


async def test_without_any_seed_spans_say_none(autojump_clock: trio.testing.MockClock) -> None:
    args = GenerationArgs(top_k=2)
    _, interface, groups = await single_turn_run(args, seed=None, groups=3)
    for rollout in token_rollouts(groups):
        assert rollout.problem_id is not None
        assert rollout.sampling == [
            [
                SamplingSpan(
                    start=LENGTHS[rollout.problem_id],
                    args=args,
                    seed=None,
                    logprobs_mode="processed",
                )
            ]
        ]
    assert set(interface.seeds) == {None}


async def test_groups_of_one_problem_without_a_prompt_source_get_their_own_seeds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An agent that overrides get_prompt (no PromptSource) and is about the same
    problem in two groups: the contract says no two requests of a run share a seed."""

    @attrs.define(kw_only=True)
    class SameProblem(Graded):
        async def get_prompt(self, request: tr.GroupedRolloutRequest) -> tr.Problem:
            return PROBLEMS[0]

    interface = Recording(seed=1, policy=fixed(["A", "BB", "CCC"], [0.5, 0.3, 0.2]))
    request = tr.GroupedRolloutRequest(
        num_groups=2, rollouts_per_group=2, inference_interface=interface, seed=7
    )
    async with SameProblem(parallel_generation_tasks=2).get_grouped_rollouts(request) as stream:
        groups = [group async for group in stream]
    assert len(groups) == 2
    assert len(interface.seeds) == 4
    assert duplicates(interface.seeds) == {}


# ============================================================ 3. the embedded backend


async def one_response(
    interface: EmbeddedInference, args: GenerationArgs, prompt: str = "q"
) -> InferenceResponse:
    return await interface.agenerate(interface.prepare_request(prompt, args))


async def test_a_seed_fixes_the_sample_whatever_came_before(
    autojump_clock: trio.testing.MockClock,
) -> None:
    policy = fixed([f"completion {i}" for i in range(8)], [1 / 8] * 8)

    def fresh() -> EmbeddedInference:
        return EmbeddedInference(seed=3, policy=policy, latency=LatencyModel())

    alone = fresh()
    busy = fresh()
    for other in range(6):  # unseeded requests of the same prompt, other seeds, other prompts
        await one_response(busy, GenerationArgs())
        await one_response(busy, GenerationArgs(seed=100 + other))
        await one_response(busy, GenerationArgs(seed=11), prompt=f"other {other}")
    for seed in (11, 12, 2**63 - 1):
        first = await one_response(alone, GenerationArgs(seed=seed))
        again = await one_response(busy, GenerationArgs(seed=seed))
        third = await one_response(busy, GenerationArgs(seed=seed))
        for response in (again, third):
            assert response.token_ids == first.token_ids
            assert response.logprobs == first.logprobs
            assert response.response.content == first.response.content
    # Seeds do matter: 16 seeds do not all give one completion of eight equal ones.
    contents = {
        (await one_response(fresh(), GenerationArgs(seed=seed))).response.content
        for seed in range(16)
    }
    assert len(contents) > 1
    # A seeded request leaves the unseeded ones' sequence alone.
    plain = fresh()
    mixed = fresh()
    await one_response(mixed, GenerationArgs(seed=5))
    for _ in range(4):
        expected = await one_response(plain, GenerationArgs())
        got = await one_response(mixed, GenerationArgs())
        assert got.token_ids == expected.token_ids


PROBS = {"aa": 0.5, "bbbb": 0.3, "c": 0.2}


def processed(**kwargs: Any) -> dict[str, float]:
    """The processed probability of each completion for PROBS, computed by hand."""
    temperature = kwargs.get("temperature")
    if temperature == 0.5:
        # p ** (1 / T) normalised: 0.25, 0.09, 0.04 over 0.38.
        scaled = {"aa": 0.25 / 0.38, "bbbb": 0.09 / 0.38, "c": 0.04 / 0.38}
    else:
        scaled = dict(PROBS)
    if kwargs.get("top_p") == 0.7:
        # cumulative 0.5, 0.8: "aa" and "bbbb" reach 0.7; renormalised over 0.8.
        assert temperature is None
        return {"aa": 0.5 / 0.8, "bbbb": 0.3 / 0.8}
    if kwargs.get("top_p") == 0.85:
        # at T=0.5, cumulative 0.658, 0.895: "aa" and "bbbb"; over 0.34.
        return {"aa": 0.25 / 0.34, "bbbb": 0.09 / 0.34}
    return scaled


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"temperature": 0.5}, processed(temperature=0.5)),
        ({"top_p": 0.7}, processed(top_p=0.7)),
        ({"temperature": 0.5, "top_p": 0.85}, processed(temperature=0.5, top_p=0.85)),
        ({"top_k": 2}, {"aa": 0.5 / 0.8, "bbbb": 0.3 / 0.8}),
        ({"top_k": 1}, {"aa": 1.0}),
        ({}, PROBS),
        ({"temperature": 1.0, "top_p": 1.0, "top_k": -1}, PROBS),
        # Greedy: the most probable, scored at temperature 1 (as vLLM does).
        ({"temperature": 0.0}, {"aa": 0.5}),
    ],
)
async def test_logprobs_are_those_of_the_distribution_sampled_from(
    kwargs: dict[str, Any], expected: dict[str, float], autojump_clock: trio.testing.MockClock
) -> None:
    interface = EmbeddedInference(seed=0, policy=fixed(list(PROBS), list(PROBS.values())))
    seen = set()
    for seed in range(40):
        response = await one_response(interface, GenerationArgs(seed=seed, **kwargs))
        completion = response.response.content
        assert completion in expected, (kwargs, completion)
        seen.add(completion)
        assert response.logprobs_mode == "processed"
        assert response.logprobs is not None
        assert len(response.logprobs) == len(completion)
        for logprob in response.logprobs:
            assert logprob == pytest.approx(math.log(expected[completion]) / len(completion))
        assert math.fsum(response.logprobs) == pytest.approx(math.log(expected[completion]))
    assert seen == set(expected)  # 40 seeds reach every completion that can be sampled
    if kwargs.get("temperature") == 0.5 or kwargs.get("top_p", 1.0) < 1.0:
        # Processed, not raw: what the policy itself gave differs.
        assert all(not math.isclose(expected[c], PROBS[c]) for c in seen)


# ============================================================== 4. replays and resumes


def replay(run_seed: int, groups: int = 8) -> tuple[str, list[int | None]]:
    """A streaming run on the embedded backend (random latencies, three calls at
    once), on a MockClock: the JSONL of the groups taken, and the seeds sent."""
    interface = Recording(seed=2, policy=fixed(["A", "BB", "CCC", "DDDD"], [0.4, 0.3, 0.2, 0.1]))

    async def main() -> str:
        problems = [tr.Problem(problem_id=f"q{i}", prompt=f"q{i}", answer="A") for i in range(4)]
        agent = Graded(prompts=tr.PromptSource(problems, seed=9), parallel_generation_tasks=3)
        request = tr.GroupedRolloutRequest(
            num_groups=1,
            rollouts_per_group=3,
            inference_interface=interface,
            generation_args=GenerationArgs(temperature=0.7),
            streaming=True,
            seed=run_seed,
        )
        async with agent.get_grouped_rollouts(request) as stream:
            taken = []
            for _ in range(groups):
                taken.append(await stream.receive())
                await trio.sleep(0.01)
        return to_jsonl([rollout for group in taken for rollout in group])

    text = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return text, interface.seeds


def test_two_runs_with_one_seed_give_the_same_jsonl_and_another_seed_other_seeds() -> None:
    first, first_seeds = replay(11)
    second, second_seeds = replay(11)
    assert first == second
    # Calls that start together reach the backend in Trio's (shuffled) order: the same
    # seeds, not necessarily in the same order.
    assert Counter(first_seeds) == Counter(second_seeds)
    other, other_seeds = replay(12)
    records = [json.loads(line) for line in first.splitlines()]
    assert len(records) == 8 * 3
    seeds = [span["seed"] for record in records for span in record["sampling"][0]]
    others = [
        span["seed"] for line in other.splitlines() for span in json.loads(line)["sampling"][0]
    ]
    assert duplicates(seeds) == {}
    assert set(seeds).isdisjoint(others)
    assert set(first_seeds).isdisjoint(other_seeds)


def run_worker(checkpoint: pathlib.Path, total: int, kill_after: int | None) -> str:
    """Run the worker (see ``_sampling_worker.py``) until it finishes, or SIGKILL it
    once it has checkpointed ``kill_after`` groups more; returns its last line."""
    process = subprocess.Popen(
        [sys.executable, str(WORKER), "run", str(checkpoint), str(total)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdin is not None
    assert process.stdout is not None
    took = 0
    last = ""
    try:
        for line in process.stdout:
            last = line.strip()
            if last == "finished":
                break
            assert last.startswith("took ")
            took += 1
            if kill_after is not None and took >= kill_after:
                process.send_signal(signal.SIGKILL)
                break
            process.stdin.write("go\n")
            process.stdin.flush()
    finally:
        process.stdout.close()
        process.stdin.close()
        code = process.wait(timeout=60)
    assert code == (0 if kill_after is None else -signal.SIGKILL), (code, last)
    return last


def test_a_killed_and_resumed_run_writes_the_same_jsonl_as_an_uninterrupted_one(
    tmp_path: pathlib.Path,
) -> None:
    total = 9  # five problems: the first pass and most of the second
    whole = tmp_path / "whole.json"
    assert run_worker(whole, total, None) == "finished"
    resumed = tmp_path / "resumed.json"
    for kill_after in (3, 2, 2):
        run_worker(resumed, total, kill_after)
        # Killed with calls in flight and groups buffered: their problems are pending,
        # to be drawn (and generated) again by the next process.
        assert json.loads(resumed.read_text())["source"]["pending"]
    assert run_worker(resumed, total, None) == "finished"
    expected = json.loads(whole.read_text())["kept"]
    got = json.loads(resumed.read_text())["kept"]
    assert len(expected) == len(got) == total
    assert "".join(got) == "".join(expected)
    # And they are seeded: every request of the run its own seed.
    seeds = [
        span["seed"]
        for text in expected
        for line in text.splitlines()
        for span in json.loads(line)["sampling"][0]
    ]
    assert len(seeds) == total * 3
    assert None not in seeds
    assert duplicates(seeds) == {}


async def stream_some(
    state: dict[str, Any] | None, groups: int
) -> tuple[list[str], dict[str, Any]]:
    """Take ``groups`` groups (four calls at once), starting from a PromptSource state;
    each group's JSONL, and the source's state once they are taken."""
    problems = [tr.Problem(problem_id=f"q{i}", prompt=f"q{i}", answer="A") for i in range(6)]
    source = tr.PromptSource(problems, seed=5)
    if state is not None:
        source.load_state_dict(state)
    interface = EmbeddedInference(seed=2, policy=fixed(["A", "BB", "CCC"], [0.5, 0.3, 0.2]))
    agent = PassGraded(prompts=source, parallel_generation_tasks=4, buffer_size=2)
    request = tr.GroupedRolloutRequest(
        num_groups=2, rollouts_per_group=2, inference_interface=interface, streaming=True, seed=3
    )
    lines = []
    async with agent.get_grouped_rollouts(request) as stream:
        for _ in range(groups):
            lines.append(to_jsonl((await stream.receive()).rollouts))
        checkpoint = source.state_dict()
    return lines, json.loads(json.dumps(checkpoint))


def by_draw(lines: Sequence[str]) -> dict[tuple[str, int], str]:
    """Each group's JSONL by its draw (problem, data pass), checking none repeats."""
    out: dict[tuple[str, int], str] = {}
    for text in lines:
        record = json.loads(text.splitlines()[0])
        key = (record["problem_id"], record["data_pass"])
        assert key not in out, key
        out[key] = text
    return out


async def test_a_resumed_parallel_run_regenerates_each_draw_byte_for_byte(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Four calls at once finish out of order, so the runs deliver in other orders; but
    every draw (problem, pass) a resumed run delivers is byte-identical to that draw in
    an uninterrupted run, and no draw is delivered twice or lost."""
    whole, _ = await stream_some(None, 16)
    first, state = await stream_some(None, 5)
    assert state["pending"]  # calls were in flight, groups buffered
    second, _ = await stream_some(state, 7)
    uninterrupted = by_draw(whole)
    resumed = by_draw(first + second)
    assert len(resumed) == 12
    for key, text in resumed.items():
        assert key in uninterrupted, key
        assert text == uninterrupted[key], key
    # The resumed run drew what was pending first: no pass-0 problem was lost.
    assert {problem for problem, data_pass in resumed if data_pass == 0} == {
        f"q{i}" for i in range(6)
    }


# ====================================================== 5. seeds: unique and stable


@attrs.frozen
class Scenario:
    group: int
    num_groups: int
    per_group_tasks: int
    take: int
    run_seed: int
    fail: frozenset[int]
    continued: dict[int, int]
    update: tuple[WeightUpdateMode, int] | None
    restart_after: int | None


@st.composite
def seed_scenarios(draw: st.DrawFn) -> Scenario:
    num_groups = draw(st.integers(1, 3))
    take = draw(st.integers(1, 6))
    update = draw(
        st.none()
        | st.tuples(st.sampled_from(["keep", "abort", "restart", "drain"]), st.integers(0, take))
    )
    return Scenario(
        group=draw(st.integers(1, 3)),
        num_groups=num_groups,
        per_group_tasks=draw(st.integers(1, 2)),
        take=take,
        run_seed=draw(st.integers(0, 2**62)),
        fail=frozenset(draw(st.sets(st.integers(1, 24), max_size=4))),
        continued=draw(st.dictionaries(st.integers(1, 24), st.integers(1, 3), max_size=3)),
        update=update,  # type: ignore[arg-type]
        restart_after=draw(st.none() | st.integers(1, take)),
    )


def run_scenario(
    scenario: Scenario, state: dict[str, Any] | None, take: int
) -> tuple[Recording, list[tr.RolloutGroup], dict[str, Any]]:
    """One run of ``scenario`` from a PromptSource state: the backend (with every seed
    it received), the groups taken and the source's state at the end."""
    interface = Recording(
        seed=0,
        policy=fixed(["A", "BB", "CCC"], [0.5, 0.3, 0.2]),
        latency=LatencyModel(first_token=0.1, per_token=0.05),
        fail=scenario.fail,
        continued=scenario.continued,
    )
    problems = [tr.Problem(problem_id=f"p{i}", prompt=f"p{i}", answer="A") for i in range(4)]
    source = tr.PromptSource(problems, seed=1)
    if state is not None:
        source.load_state_dict(state)
    agent = Graded(
        prompts=source,
        parallel_generation_tasks=scenario.num_groups * scenario.per_group_tasks,
        failure_policy=tr.FailurePolicy(
            max_attempts=3,
            retry_on=(InferenceConnectionError,),
            wait_initial=0.05,
            wait_jitter=0.0,
            on_failure="skip",
            skip_budget=1000,
        ),
    )
    request = tr.GroupedRolloutRequest(
        num_groups=scenario.num_groups,
        rollouts_per_group=scenario.group,
        inference_interface=interface,
        generation_args=GenerationArgs(temperature=0.9),
        streaming=True,
        seed=scenario.run_seed,
    )
    taken: list[tr.RolloutGroup] = []

    async def main() -> None:
        # Virtual seconds: a hang is an error, not a stuck test.
        with trio.fail_after(10_000):
            async with agent.get_grouped_rollouts(request) as stream:
                for n in range(take):
                    if scenario.update is not None and scenario.update[1] == n:
                        async with stream.weight_update(scenario.update[0]):
                            await trio.sleep(0.2)
                    taken.append(await stream.receive())

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return interface, taken, json.loads(json.dumps(source.state_dict()))


PROPERTY = settings(max_examples=60, deadline=None, derandomize=True, database=None)


@PROPERTY
@given(seed_scenarios())
def test_no_two_requests_of_a_run_share_a_seed(scenario: Scenario) -> None:
    runs = []
    if scenario.restart_after is None:
        runs.append(run_scenario(scenario, None, scenario.take))
    else:
        # A restart: a new run that resumes the first one's PromptSource state.
        first = run_scenario(scenario, None, scenario.restart_after)
        runs.append(first)
        runs.append(run_scenario(scenario, first[2], scenario.take))
    for interface, groups, _ in runs:
        assert None not in interface.seeds
        assert duplicates(interface.seeds) == {}, (
            "requests of one run share seeds",
            interface.seeds,
        )
        # What the rollouts record is what was sent.
        recorded = span_seeds(token_rollouts(groups))
        assert set(recorded) <= set(interface.seeds)
        assert duplicates(recorded) == {}


def test_retrying_a_group_sends_new_seeds() -> None:
    """One call at a time: the retry takes the problem it gave back, with new seeds."""

    async def main() -> tuple[Recording, tr.RolloutGroup]:
        interface = Recording(seed=0, policy=fixed(["A", "BB"], [0.5, 0.5]), fail=frozenset({1}))
        agent = Graded(
            prompts=tr.PromptSource(PROBLEMS, seed=0),
            parallel_generation_tasks=1,
            failure_policy=tr.FailurePolicy(max_attempts=2, wait_initial=0.1, wait_jitter=0.0),
        )
        request = tr.GroupedRolloutRequest(
            num_groups=1,
            rollouts_per_group=2,
            inference_interface=interface,
            seed=7,
            group_calls=False,
        )
        async with agent.get_grouped_rollouts(request) as stream:
            group = await stream.receive()
            assert stream.statistics().retries == 1
        return interface, group

    interface, group = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(interface.seeds) == 4
    assert duplicates(interface.seeds) == {}
    problem_id = group[0].problem_id
    assert problem_id is not None
    # The retry's seeds: the documented hash, with the draw given back once and the
    # attempt appended.
    assert span_seeds(token_rollouts([group])) == [
        derive_seed(7, 0, problem_id, 0, member, 0, "again", 1, "attempt", 2) for member in range(2)
    ]


def test_a_skipped_groups_problem_drawn_again_gets_new_seeds() -> None:
    """``on_failure="skip"``: the failed call's problem is given back and drawn again by
    the next call, a first attempt again, which must not send the failed call's seeds."""

    async def main() -> Recording:
        interface = Recording(seed=0, policy=fixed(["A", "BB"], [0.5, 0.5]), fail=frozenset({1}))
        agent = Graded(
            prompts=tr.PromptSource(PROBLEMS, seed=0),
            parallel_generation_tasks=1,
            failure_policy=tr.FailurePolicy(on_failure="skip", wait_jitter=0.0),
        )
        request = tr.GroupedRolloutRequest(
            num_groups=1, rollouts_per_group=2, inference_interface=interface, seed=7
        )
        async with agent.get_grouped_rollouts(request) as stream:
            await stream.receive()
            assert stream.statistics().skipped == 1
        return interface

    interface = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(interface.seeds) == 4
    assert duplicates(interface.seeds) == {}


def test_a_problem_given_back_by_a_failed_call_and_drawn_by_another_gets_new_seeds() -> None:
    """Two calls at once: the first fails and waits out its backoff, the other slot
    draws the problem it gave back (a first attempt there), which must not send the
    failed call's seeds."""

    async def main() -> Recording:
        interface = Recording(
            seed=0,
            policy=fixed(["A", "BB"], [0.5, 0.5]),
            latency=STEADY,
            fail=frozenset({1}),
        )
        agent = Graded(
            prompts=tr.PromptSource(PROBLEMS, seed=0),
            parallel_generation_tasks=2,
            failure_policy=tr.FailurePolicy(max_attempts=3, wait_initial=10.0, wait_jitter=0.0),
        )
        request = tr.GroupedRolloutRequest(
            num_groups=1,
            rollouts_per_group=1,
            inference_interface=interface,
            streaming=True,
            seed=7,
        )
        async with agent.get_grouped_rollouts(request) as stream:
            for _ in range(3):
                await stream.receive()
        return interface

    interface = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert duplicates(interface.seeds) == {}, interface.seeds


#: derive_seed of a few parts, computed once: the seeds of a run must never change
#: between processes, machines or versions (a resumed run sends the same ones).
DERIVED = [
    ((7, 0, "p0", 0, 0, 0), 1747767442846551306),
    ((7, 0, "p0", 0, 1, 0), 1694025496180544091),
    ((7, 1, "p0", 0, 0, 0), 3500047492215049245),
    ((7, 0, "p0", 0, 0, 0, 2), 6207215475556574005),
    ((0,), 3093616573082300817),
    ((None, "x", -3), 9172293275505306691),
]


def test_seeds_are_stable_constants_and_the_same_in_another_process() -> None:
    for derived, seed in DERIVED:
        assert derive_seed(*derived) == seed, derived
    assert continuation_seed(123, 1) == 4541231462595069401
    assert continuation_seed(123, 2) == 1864975321185280859
    assert continuation_seed(123, 0) == 123
    assert continuation_seed(None, 3) is None
    rng = random.Random(5)
    parts: list[list[int | str | None]] = [list(p) for p, _ in DERIVED]
    for _ in range(40):
        parts.append(
            [
                rng.randrange(2**40),
                rng.randrange(4),
                f"problem-{rng.randrange(1000)}",
                rng.choice([None, rng.randrange(5)]),
                rng.randrange(16),
                rng.randrange(8),
            ]
        )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, str(WORKER), "derive"],
        input=json.dumps(parts),
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=60,
    )
    there = json.loads(out.stdout)
    assert there == [derive_seed(*p) for p in parts]
    assert all(0 <= seed < 2**63 for seed in there)
    assert duplicates(there) == {}


# ======================================================================== 6. boundaries


async def test_a_keep_update_mid_generation_puts_the_boundary_at_the_element_position(
    autojump_clock: trio.testing.MockClock,
) -> None:
    completion = "abcdefghijkl"
    interface = EmbeddedInference(policy=fixed([completion], [1.0]), latency=STEADY)
    problem = PROBLEMS[1]
    start = prompt_length(problem)

    @attrs.define(kw_only=True)
    class One(Graded):
        async def get_prompt(self, request: tr.GroupedRolloutRequest) -> tr.Problem:
            return problem

        async def get_reward(self, problem: tr.Problem, response: InferenceResponse) -> float:
            await trio.lowlevel.checkpoint()
            return 1.0

    request = tr.GroupedRolloutRequest(
        num_groups=1, rollouts_per_group=1, inference_interface=interface, streaming=True, seed=1
    )
    async with One(parallel_generation_tasks=1).get_grouped_rollouts(request) as stream:
        # First token at +1 s, then 1 s per token: token 3 is being generated at 4.5 s.
        await trio.sleep(4.5)
        async with stream.weight_update("keep") as update:
            assert update.held == 1
            await trio.sleep(10)
        group = await stream.receive()
    [rollout] = token_rollouts([group])
    k = 4  # the token being generated is finished under the old epoch
    assert 0 < k < len(completion)
    assert rollout.policy_epoch == [[(0, 0), (start + k, 1)]]
    # The tokens after the boundary attend to the KV computed before it.
    assert rollout.kv_cache_epoch == [[(0, 0)]]
    assert rollout.trajectory == [
        [ord(c) for c in render_plain_chat([user(str(problem.prompt))]) + completion]
    ]
    assert rollout.generation_mask == [[False] * start + [True] * len(completion)]
    assert rollout.sampling is not None
    assert rollout.sampling[0][0].start == start
    batch = tr.TrainingBatch.from_groups([group])
    epochs = batch.policy_epoch[0].tolist()
    assert epochs == [0] * (start + k) + [1] * (len(completion) - k)
    assert batch.loss_mask[0].tolist() == rollout.generation_mask[0]


# =========================================================================== 7. episodes


class Turns(tr.BaseEnvironment):
    """Answers each turn with a user message; done after ``turns`` turns."""

    def __init__(self, problem: tr.Problem, turns: int) -> None:
        super().__init__()
        self.problem = problem
        self.turns = turns
        self.steps = 0

    async def reset(self) -> Sequence[tr.ChatMessage]:
        await trio.lowlevel.checkpoint()
        return [user(str(self.problem.prompt))]

    async def step(self, turn: tr.AssistantTurn) -> tr.EnvironmentStep:
        await trio.sleep(0.1)
        self.steps += 1
        if self.steps >= self.turns:
            return tr.EnvironmentStep(done=True, reward=float(self.steps))
        return tr.EnvironmentStep(messages=[user(f"reply {self.steps}" + "!" * self.steps)])


def turn_policy(messages: list[tr.ChatMessage]) -> tuple[list[str], list[float]]:
    n = sum(message.role == "assistant" for message in messages)
    return [f"turn {n}" + "." * n, f"other {n}"], [0.7, 0.3]


async def test_an_episode_has_one_span_per_turn_at_its_first_sampled_id(
    autojump_clock: trio.testing.MockClock,
) -> None:
    agent = tr.MultiTurnAgent(
        environment=lambda problem: Turns(problem, 3),
        renderer=tr.PlainRenderer(),
        prompts=tr.PromptSource(PROBLEMS, seed=0),
        parallel_generation_tasks=2,
    )
    args = GenerationArgs(temperature=0.9, max_tokens=40)
    interface = Recording(seed=0, policy=turn_policy)
    request = tr.GroupedRolloutRequest(
        num_groups=2,
        rollouts_per_group=2,
        inference_interface=interface,
        generation_args=args,
        seed=7,
    )
    async with agent.get_grouped_rollouts(request) as stream:
        groups = [group async for group in stream]
    rollouts = token_rollouts(groups)
    assert len(rollouts) == 4
    for group in groups:
        for member, rollout in enumerate(group):
            assert isinstance(rollout, TokenRollout)
            assert rollout.problem_id is not None
            assert rollout.sampling is not None
            [spans] = rollout.sampling
            [mask] = rollout.generation_mask or [[]]
            firsts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
            assert [span.start for span in spans] == firsts
            assert len(spans) == rollout.extra["episode"]["turns"] == 3
            assert [span.start for span in spans] == [
                turn["start"] for turn in rollout.extra["episode"]["per_turn"]
            ]
            for turn, span in enumerate(spans):
                if turn == 0:
                    # The first turns are one group call (n), sent member 0's seed s:
                    # member i's choice was sampled with s + i.
                    seed = expected_seed(request, rollout.problem_id, 0, 0, 0)
                    assert seed is not None
                    seed += member
                else:
                    seed = expected_seed(request, rollout.problem_id, 0, member, turn)
                assert span.seed == seed
                assert span.args.seed == seed
                assert span.logprobs_mode == "processed"
                assert span.args.temperature == 0.9
    seeds = span_seeds(rollouts)
    assert len(seeds) == 12
    assert duplicates(seeds) == {}
    assert Counter(interface.seeds) == Counter(seeds)


# ============================================================================ 8. the check


@attrs.define(eq=False, kw_only=True)
class Probed(EmbeddedInference):
    """The embedded backend with a probe that says what ``answers`` says, counting its
    probes and the requests it receives."""

    answers: list[ReplicaProbe] = attrs.field(
        factory=lambda: [
            ReplicaProbe(base_url="http://a", logprobs_mode="raw"),
            ReplicaProbe(base_url="http://b", logprobs_mode="processed"),
        ]
    )
    server: str | None = None
    probes: int = attrs.field(default=0, init=False)
    calls: int = attrs.field(default=0, init=False)

    async def probe(self) -> list[ReplicaProbe]:
        self.probes += 1
        await trio.lowlevel.checkpoint()
        return list(self.answers)

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        self.calls += 1
        return await super().base_generate(request)


def check_request(
    interface: Probed, args: GenerationArgs, check: str = "warn"
) -> tr.GroupedRolloutRequest:
    return tr.GroupedRolloutRequest(
        num_groups=1,
        rollouts_per_group=2,
        inference_interface=interface,
        generation_args=args,
        sampling_check=check,
    )


def check_agent() -> Graded:
    return Graded(prompts=tr.PromptSource(PROBLEMS, seed=0))


async def open_and_take(interface: Probed, request: tr.GroupedRolloutRequest) -> None:
    async with check_agent().get_grouped_rollouts(request) as stream:
        groups = [group async for group in stream]
    assert len(groups) == 1
    assert interface.calls == 2


def bias_warnings(caught: Sequence[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, tr.SamplingBiasWarning)]


async def test_raw_logprobs_with_a_temperature_warn_once_for_the_raw_replica(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = Probed()
    with pytest.warns(tr.SamplingBiasWarning) as caught:
        await open_and_take(interface, check_request(interface, GenerationArgs(temperature=0.7)))
    [message] = bias_warnings(caught.list)
    assert "http://a" in message
    assert "http://b" not in message
    assert "temperature=0.7" in message
    assert "--logprobs-mode processed_logprobs" in message
    assert message.startswith("Graded: ")
    assert interface.probes == 1
    assert issubclass(tr.SamplingBiasWarning, UserWarning)


@pytest.mark.parametrize(
    ("args", "named"),
    [(GenerationArgs(top_p=0.9), "top_p=0.9"), (GenerationArgs(top_k=5), "top_k=5")],
)
async def test_a_cut_without_a_sampling_mask_warns_for_every_replica(
    args: GenerationArgs, named: str, autojump_clock: trio.testing.MockClock
) -> None:
    interface = Probed()
    with pytest.warns(tr.SamplingBiasWarning) as caught:
        await open_and_take(interface, check_request(interface, args))
    messages = bias_warnings(caught.list)
    assert len(messages) == 2
    for message, url in zip(sorted(messages), ["http://a", "http://b"], strict=True):
        assert url in message
        assert named in message
        assert "--return-sampling-mask" in message
    # The raw replica also needs processed logprobs.
    assert "--logprobs-mode processed_logprobs" in sorted(messages)[0]
    assert interface.probes == 1


async def test_a_sampling_mask_removes_the_cut_warning_but_not_the_temperature_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    masked = [
        ReplicaProbe(base_url="http://a", logprobs_mode="raw", sampling_mask=True),
        ReplicaProbe(base_url="http://b", logprobs_mode="processed", sampling_mask=True),
    ]
    interface = Probed(answers=masked)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        await open_and_take(interface, check_request(interface, GenerationArgs(top_p=0.9)))
    assert bias_warnings(caught) == []
    assert interface.probes == 1

    interface = Probed(answers=masked)
    args = GenerationArgs(top_p=0.9, temperature=0.7)
    with pytest.warns(tr.SamplingBiasWarning) as caught_too:
        await open_and_take(interface, check_request(interface, args))
    [message] = bias_warnings(caught_too.list)
    assert "http://a" in message
    assert "temperature=0.7" in message
    assert "top_p" not in message


async def test_raise_refuses_before_any_inference_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = Probed()
    agent = check_agent()
    assert agent.prompts is not None
    request = check_request(interface, GenerationArgs(temperature=0.7), "raise")
    with pytest.raises(tr.SamplingBiasError) as raised:
        async with agent.get_grouped_rollouts(request):
            raise AssertionError("the stream must not open")
    message = str(raised.value)
    assert "http://a" in message
    assert "http://b" not in message
    assert "temperature=0.7" in message
    assert "--logprobs-mode processed_logprobs" in message
    assert "sampling_check='raise'" in message
    assert isinstance(raised.value, ValueError)
    assert interface.calls == 0
    assert interface.probes == 1
    assert agent.prompts.pending() == []  # nothing was drawn


async def test_off_probes_nothing(autojump_clock: trio.testing.MockClock) -> None:
    interface = Probed()
    args = GenerationArgs(temperature=0.7, top_p=0.5, top_k=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        await open_and_take(interface, check_request(interface, args, "off"))
    assert bias_warnings(caught) == []
    assert interface.probes == 0


@pytest.mark.parametrize(
    "args",
    [
        GenerationArgs(),
        GenerationArgs(temperature=1.0),
        GenerationArgs(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=5, seed=3),
    ],
)
async def test_unbiased_args_probe_only_a_vllm_interface(
    args: GenerationArgs, autojump_clock: trio.testing.MockClock
) -> None:
    plain = Probed()
    await open_and_take(plain, check_request(plain, args))
    assert plain.probes == 0
    vllm = Probed(server="vllm")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        await open_and_take(vllm, check_request(vllm, args))
    assert vllm.probes == 1  # the sampling record names vLLM's mode
    assert bias_warnings(caught) == []


async def test_the_probe_is_made_once_per_stream_open(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = Probed(answers=[ReplicaProbe(base_url="http://b", logprobs_mode="processed")])
    request = tr.GroupedRolloutRequest(
        num_groups=2,
        rollouts_per_group=2,
        inference_interface=interface,
        generation_args=GenerationArgs(temperature=0.7),
        streaming=True,
    )
    agent = check_agent()
    for opened in (1, 2):
        async with agent.get_grouped_rollouts(request) as stream:
            for _ in range(5):
                await stream.receive()
        assert interface.probes == opened


def test_sampling_span_wrong_types_are_type_errors_naming_the_field() -> None:
    with pytest.raises(TypeError, match=r"SamplingSpan\.start must be an int >= 0.*'3'"):
        SamplingSpan(start="3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"SamplingSpan\.start"):
        SamplingSpan(start=True)
    with pytest.raises(TypeError, match=r"SamplingSpan\.args must be a GenerationArgs"):
        SamplingSpan(start=0, args={"temperature": 1.0})  # type: ignore[arg-type]
