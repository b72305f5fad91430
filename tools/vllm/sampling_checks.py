"""What the server says about each sample, checked on two real vLLM servers.

``run.py`` starts both: ``scale_out`` with ``--enable-scale-out`` (vLLM's RL interface:
``/inference/v1/generate`` with per-token ``weight_versions``; raw logprobs, vLLM's
default) and ``processed`` with ``--logprobs-mode processed_logprobs`` (no RL interface).

- **probe**: ``OpenAIInference.probe()`` over both as replicas tells them apart: raw and
  native on the first, processed and not native on the second;
- **boundary**: a long call through the native path with a ``keep`` update in the middle
  gets a ``policy_epoch`` boundary inside its generated ids, at the token where the
  server's weight version changed;
- **stream**: a stream with ``keep`` updates while long completions generate: groups
  that spanned an update carry exact boundaries and ``statistics().mixed == 0``;
- **fallback**: ``server="vllm"`` on the server without the RL interface falls back to
  ``/v1/completions`` with one warning, and stamps no boundary (``mixed`` counts there);
- **flags**: the biased combinations are flagged, each naming the replica and the flag,
  and ``sampling_check="raise"`` refuses before any request;
- **seeds**: two runs with the same ``GroupedRolloutRequest.seed`` send the same seeds
  and (vLLM seeds each request's sampler) sample the same ids;
- **leave**: leaving a stream with long calls in flight ends them on the server.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import trio
from checks import VLLM, HasAnswer, in_thread
from run import PROBLEMS, CheckFailed, check

import trio_rollouts as tr

#: Generated tokens of a long call (with ``ignore_eos``).
LONG = 300
#: Generated tokens of the call a pause must land in (a 300-token call finished before
#: the pause once, on an idle machine).
LONGER = 900
#: Tries of a call the boundary check pauses (see check_boundary).
TRIES = 3
#: Seconds watched after a stream is left: longer than its four 900-token calls take to
#: finish on this machine (about 5 s) had they not been aborted.
LEAVE_HOLD = 8.0


def native(vllm: VLLM, **options: Any) -> tr.OpenAIInference:
    return tr.OpenAIInference(vllm.base_url, vllm.model, server="vllm", **options)


async def check_probe(scale_out: VLLM, processed: VLLM) -> str:
    interface = tr.OpenAIInference(
        [scale_out.base_url, processed.base_url], scale_out.model, server="vllm"
    )
    first, second = await interface.probe()
    check(
        (first.logprobs_mode, first.native_generate) == ("raw", True),
        f"the scale-out server probed as {first}",
    )
    check(
        (second.logprobs_mode, second.native_generate) == ("processed", False),
        f"the processed-logprobs server probed as {second}",
    )
    again = await interface.probe()
    check(again == [first, second], "a second probe answered differently (it is cached)")
    await interface.aclose()
    return (
        f"{first.base_url}: {first.logprobs_mode}, native {first.native_generate}; "
        f"{second.base_url}: {second.logprobs_mode}, native {second.native_generate}"
    )


async def settled(vllm: VLLM, name: str, label: str = "") -> float:
    """A ``/metrics`` counter once two reads half a second apart agree: the server
    updates its counters a little after the fact, so a baseline read right after other
    work can miss some of it."""
    previous = await in_thread(vllm.metric, name, label)
    with trio.fail_after(30):
        while True:
            await trio.sleep(0.5)
            now = await in_thread(vllm.metric, name, label)
            if now == previous:
                return now
            previous = now


async def wait_for_tokens(vllm: VLLM, before: float, tokens: int) -> None:
    """Poll ``/metrics`` until the server has generated ``tokens`` more tokens (nothing
    client-side says how far a call has come)."""
    with trio.fail_after(60):
        while True:
            if await in_thread(vllm.metric, "vllm:generation_tokens_total") - before >= tokens:
                return
            await trio.sleep(0.02)


async def paused_call(
    vllm: VLLM, interface: tr.OpenAIInference, mode: tr.WeightUpdateMode, prompt: str
) -> tr.InferenceResponse:
    """A 900-token call with a ``mode`` update once the server has counted 40 more
    tokens; resumed under the next epoch."""
    request = interface.prepare_request(prompt, tr.GenerationArgs(max_tokens=LONGER, seed=11))
    responses: list[tr.InferenceResponse] = []

    async def one() -> None:
        responses.append(await interface.agenerate(request))

    before = await settled(vllm, "vllm:generation_tokens_total")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        await wait_for_tokens(vllm, before, 40)
        await interface.pause(mode)
        await interface.resume(interface.policy_epoch + 1)
    (response,) = responses
    return response


async def check_boundary(vllm: VLLM) -> str:
    """A ``keep`` and an ``abort`` update inside a 900-token call. The server counts its
    tokens late under load, so a pause can land after the call has ended: such a try
    (stamped with one epoch, no boundary) is made again, at most ``TRIES`` times, and
    counted."""
    interface = native(vllm, extra_body={"ignore_eos": True})
    boundaries = []
    for mode in ("keep", "abort"):
        for attempt in range(1, TRIES + 1):
            epoch = interface.policy_epoch
            response = await paused_call(vllm, interface, mode, f"A long story ({mode}).")
            ids, start = response.token_ids or [], response.prompt_length or 0
            check(len(ids) - start == LONGER, f"{mode}: {len(ids) - start} tokens")
            stamps = response.policy_epoch
            if stamps in ([(0, epoch)], [(0, epoch + 1)]) and attempt < TRIES:
                # The call ended before the pause, or (abort) the server's reply to the
                # aborted request held none of its tokens, so all of them were sampled
                # again after the resume: nothing to stamp either way.
                continue
            check(
                len(stamps) == 2 and stamps[0] == (0, epoch) and stamps[1][1] == epoch + 1,
                f"{mode}: policy_epoch {stamps}",
            )
            check(0 < stamps[1][0] < LONGER, f"{mode}: the boundary {stamps[1]} is not inside")
            boundaries.append(
                f"{mode} at generated token {stamps[1][0]} of {LONGER} (try {attempt})"
            )
            break
    check(interface.stamps_policy_epoch, "the interface does not say it stamps epochs")
    await interface.aclose()
    return "; ".join(boundaries)


def long_request(
    interface: tr.OpenAIInference, **options: Any
) -> tuple[HasAnswer, tr.GroupedRolloutRequest]:
    source = tr.PromptSource([tr.Problem(**row) for row in PROBLEMS], seed=0)
    agent = HasAnswer(prompts=source, env_id="arithmetic", parallel_generation_tasks=4)
    request = tr.GroupedRolloutRequest(
        num_groups=2,
        rollouts_per_group=2,
        inference_interface=interface,
        generation_args=tr.GenerationArgs(max_tokens=LONG),
        streaming=True,
        **options,
    )
    return agent, request


async def stream_with_updates(vllm: VLLM, interface: tr.OpenAIInference) -> tuple[int, int]:
    """A stream of 900-token completions (four groups of two start at once) with one
    ``keep`` update once they decode; the first four groups are taken. The stream's
    ``mixed`` count and how many rollouts carry a boundary inside their generated ids."""
    agent, request = long_request(interface, max_staleness=4)
    request.generation_args = tr.GenerationArgs(max_tokens=LONGER)
    spanned = 0
    async with agent.get_grouped_rollouts(request) as stream:
        await calls_decoding(vllm, interface)
        async with stream.weight_update("keep"):
            pass
        for _ in range(4):
            for rollout in await stream.receive():
                if not isinstance(rollout, tr.TokenRollout):
                    raise CheckFailed(f"a {type(rollout).__name__}, not a TokenRollout")
                prompt = (rollout.generation_mask or [[]])[0].count(False)
                inside = [s for s, _ in rollout.policy_epoch[0][1:] if s > prompt]
                spanned += bool(inside)
        mixed = stream.statistics().mixed
    return mixed, spanned


async def calls_decoding(vllm: VLLM, interface: tr.OpenAIInference) -> None:
    """Wait until the interface has calls on the wire and the server has decoded 100 more
    tokens (polling: nothing else says so)."""
    with trio.fail_after(60):
        while True:
            if sum(interface.statistics().in_flight) > 0:
                break
            await trio.sleep(0.02)
    await wait_for_tokens(vllm, await in_thread(vllm.metric, "vllm:generation_tokens_total"), 100)


async def check_stream(vllm: VLLM) -> str:
    interface = native(vllm, extra_body={"ignore_eos": True})
    # The server's token counter, which says when the calls decode, sometimes moves only
    # when they end (seen here: 4.3 s late): then the update lands after them and no
    # rollout spans it. Such a try is made again, at most TRIES times, and counted.
    tries = 0
    spanned = 0
    while not spanned and tries < TRIES:
        tries += 1
        mixed, spanned = await stream_with_updates(vllm, interface)
        check(mixed == 0, f"{mixed} groups counted as mixed on the native path")
    check(spanned > 0, f"no rollout spanned an update in {TRIES} tries")
    await interface.aclose()
    return (
        f"a keep update: {spanned} of 8 rollouts stamped across it exactly, mixed {mixed} "
        f"(try {tries})"
    )


async def check_fallback(vllm: VLLM) -> str:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.WARNING)
    logger = logging.getLogger("trio_rollouts")
    logger.addHandler(handler)
    try:
        interface = native(vllm)
        for _ in range(3):
            request = interface.prepare_request("Hello", tr.GenerationArgs(max_tokens=8))
            response = await interface.agenerate(request)
            check(response.token_ids is not None, "no token ids on the fallback path")
            check(response.logprobs_mode == "unknown", "a mode without a probe")
        check(not interface.stamps_policy_epoch, "the fallback claims to stamp epochs")
        await interface.aclose()
    finally:
        logger.removeHandler(handler)
    said = [r.getMessage() for r in records if "enable-scale-out" in r.getMessage()]
    check(len(said) == 1, f"{len(said)} fallback warnings: {said}")
    return f"3 calls through /v1/completions, one warning: {said[0][:120]}"


async def flagged(interface: tr.OpenAIInference, **args: Any) -> list[str]:
    agent, request = long_request(interface)
    request.generation_args = tr.GenerationArgs(max_tokens=4, **args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with agent.get_grouped_rollouts(request) as stream:
            await stream.receive()
    return [str(w.message) for w in caught if issubclass(w.category, tr.SamplingBiasWarning)]


async def check_flags(scale_out: VLLM, processed: VLLM) -> str:
    raw = native(scale_out)
    cooked = native(processed)
    hot = await flagged(raw, temperature=0.7)
    check(
        len(hot) == 1 and "--logprobs-mode processed_logprobs" in hot[0] and "0.7" in hot[0],
        f"raw logprobs at temperature 0.7: {hot}",
    )
    check(await flagged(cooked, temperature=0.7) == [], "processed logprobs were flagged")
    nucleus = await flagged(cooked, top_p=0.9)
    check(
        len(nucleus) == 1 and "--return-sampling-mask" in nucleus[0],
        f"top_p on processed logprobs: {nucleus}",
    )
    check(await flagged(raw, temperature=1.0) == [], "temperature 1 was flagged")
    agent, request = long_request(raw, sampling_check="raise")
    request.generation_args = tr.GenerationArgs(max_tokens=4, temperature=0.7)
    attempts = sum(raw.statistics().attempts)
    try:
        async with agent.get_grouped_rollouts(request):
            raise CheckFailed("sampling_check='raise' opened the stream")
    except tr.SamplingBiasError as error:
        check("processed_logprobs" in str(error), f"the error does not name the flag: {error}")
    check(sum(raw.statistics().attempts) == attempts, "a request was sent before the error")
    await raw.aclose()
    await cooked.aclose()
    return f"flagged: {hot[0][:100]}...; {nucleus[0][:80]}...; 'raise' sent nothing"


async def seeded_run(vllm: VLLM, seed: int) -> list[tuple[str | None, list[int], int | None]]:
    interface = native(vllm)
    agent, request = long_request(interface, seed=seed)
    request.generation_args = tr.GenerationArgs(max_tokens=16, temperature=1.0)
    request.streaming = False
    rows = []
    async with agent.get_grouped_rollouts(request) as stream:
        for _ in range(2):
            group = await stream.receive()
            for rollout in group:
                if not isinstance(rollout, tr.TokenRollout):
                    raise CheckFailed(f"a {type(rollout).__name__}, not a TokenRollout")
                (span,) = (rollout.sampling or [[]])[0]
                rows.append((rollout.problem_id, rollout.trajectory[0], span.seed))
    await interface.aclose()
    return sorted(rows, key=lambda row: (row[0] or "", row[2] or 0))


async def check_seeds(vllm: VLLM) -> str:
    first = await seeded_run(vllm, 5)
    second = await seeded_run(vllm, 5)
    seeds = [row[2] for row in first]
    check(None not in seeds and len(set(seeds)) == len(seeds), f"seeds {seeds}")
    check([row[2] for row in second] == seeds, "a rerun sent other seeds")
    same = sum(a[1] == b[1] for a, b in zip(first, second, strict=True))
    check(same == len(first), f"only {same} of {len(first)} samples replayed")
    other = await seeded_run(vllm, 6)
    check({row[2] for row in other}.isdisjoint(seeds), "another run seed gave the same seeds")
    return f"{len(first)} requests, distinct seeds, replayed id for id"


async def check_leave(vllm: VLLM) -> str:
    """Leave a stream while four 900-token calls decode: none of them finishes on the
    server afterwards (its ``length`` finishes do not move over a hold longer than the
    calls would take, and the token counter stands still)."""
    interface = native(vllm, extra_body={"ignore_eos": True})
    agent, request = long_request(interface)
    request.generation_args = tr.GenerationArgs(max_tokens=900)
    finished = '"length"'
    # The stream probes the interface when it opens (three 1-token requests that end
    # with "length"): probed now, before the baseline, it does not then.
    await interface.probe()
    lengths = await settled(vllm, "vllm:request_success_total", finished)
    before = await settled(vllm, "vllm:generation_tokens_total")
    async with agent.get_grouped_rollouts(request):
        await wait_for_tokens(vllm, before, 40)
        in_flight = sum(interface.statistics().in_flight)
    check(in_flight > 0, "no call was in flight when the stream was left")
    await trio.sleep(LEAVE_HOLD)  # a real server: how long the calls would have run
    stood = await in_thread(vllm.metric, "vllm:generation_tokens_total")
    await trio.sleep(1.0)
    moved = await in_thread(vllm.metric, "vllm:generation_tokens_total") - stood
    ended = await in_thread(vllm.metric, "vllm:request_success_total", finished) - lengths
    check(ended == 0, f"{ended:.0f} calls ran to their length after the stream was left")
    check(moved == 0, f"{moved:.0f} tokens generated {LEAVE_HOLD:.0f} s after leaving")
    await interface.aclose()
    return (
        f"left with {in_flight} calls in flight: none ran to its 900 tokens in the "
        f"{LEAVE_HOLD:.0f} s after, and the token counter stood still"
    )


async def run_sampling_checks(scale_out: VLLM, processed: VLLM) -> None:
    for name, run_check in (
        ("probe", lambda: check_probe(scale_out, processed)),
        ("boundary", lambda: check_boundary(scale_out)),
        ("stream", lambda: check_stream(scale_out)),
        ("fallback", lambda: check_fallback(processed)),
        ("flags", lambda: check_flags(scale_out, processed)),
        ("seeds", lambda: check_seeds(scale_out)),
        ("leave", lambda: check_leave(scale_out)),
    ):
        with trio.fail_after(300):
            print(f"{name}: {await run_check()}", flush=True)
