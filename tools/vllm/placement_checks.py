"""Placement and group calls, checked on the two real vLLM servers as two replicas.

``run.py`` starts both (``scale_out`` serves vLLM's RL route, ``processed`` only the
OpenAI routes); here they are the two replicas of one ``OpenAIInference(server="vllm")``:
the first takes the native route, the second falls back to ``/v1/completions`` (one
warning). Each call carries its group's key as the pipeline sets it (the call context's ``group``).

- **routing**: for ``routing`` in group / least_loaded / round_robin, the same workload:
  8 groups of 8 calls at once, each prompt a 256-token prefix shared by every group and a
  question of its group's own (144 to 256 tokens), 16 generated tokens (``ignore_eos``);
  fresh random ids every time, so no run reads what another left in the cache. Each server's
  ``/metrics`` before and after (read once settled: the counters lag under load):
  prefix-cache queries and hits and prompt tokens. Printed per routing: the hits, and
  the prompt tokens computed (queries - hits); "group" must compute fewer than both
  others (a group's prompt is prefilled once per replica it lands on).
- **n**: 8 groups of 8 as 8 group calls with ``n=8`` (``agenerate_group``: one request
  per group) against 64 separate calls, all groups at once, three times each after a
  warm-up, fresh prompts every time: the wall time of each and the ratio of the medians;
  every group call returns 8 choices with token ids, a logprob per generated token and
  its own usage.
- **seeds**: on the native replica, a seeded group with ``n=4`` samples the same ids as
  four calls with ``seed + i`` (vLLM's seeds for the choices, which the interface's
  fallback sends).
- **cancel**: a cancelled group of 8 long choices on the native route: the server runs
  none of them a moment later (its request is aborted by id, all choices with it).
- **priority** (:func:`check_priority`, run by ``run.py`` on a server of its own, with
  ``--scheduling-policy priority``): the server takes ``priority=True``'s field, and the
  order two waiting calls of epochs 2 and 1 finished in is reported.
"""

from __future__ import annotations

import random
import re
import statistics
import time
from typing import Any

import trio
from checks import VLLM, in_thread
from run import CheckFailed, check
from sampling_checks import wait_for_tokens

import trio_rollouts as tr
from trio_rollouts._context import CallContext, call_context

#: The workload: groups, calls per group, shared prefix, question lengths, tokens.
GROUPS = 8
#: The servers' --max-num-seqs (SCHEDULER_FLAGS of this folder's run.py; the ``run``
#: imported here is real_server's).
MAX_NUM_SEQS = 16
SIZE = 8
PREFIX = 256
QUESTIONS = tuple(256 - 16 * g for g in range(GROUPS))  # 256 ... 144 tokens
TOKENS = 16
#: Byte-token ids of the tiny model (its specials are 256 and up).
VOCAB = 256
COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:request_success_total",
)
#: Timed rounds of the n-against-separate comparison (after one to warm up).
ROUNDS = 3
#: Generated tokens of the cancelled group's choices.
LONG = 900


def counters(vllm: VLLM) -> dict[str, float]:
    """Every counter of :data:`COUNTERS` from one read of ``/metrics``."""
    text = vllm.get_text("/metrics")
    found = {}
    for name in COUNTERS:
        pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$"
        found[name] = sum(float(value) for value in re.findall(pattern, text, re.MULTILINE))
    return found


async def settled(servers: list[VLLM]) -> list[dict[str, float]]:
    """Each server's counters once two reads half a second apart agree."""
    previous = [await in_thread(counters, vllm) for vllm in servers]
    with trio.fail_after(30):
        while True:
            await trio.sleep(0.5)
            now = [await in_thread(counters, vllm) for vllm in servers]
            if now == previous:
                return now
            previous = now


def block_size(vllm: VLLM) -> int:
    """The server's KV block size (its ``cache_config_info``; 128 on this CPU build)."""
    found = re.search(
        r'^vllm:cache_config_info\{[^}]*block_size="(\d+)"', vllm.get_text("/metrics"), re.M
    )
    return int(found.group(1)) if found else 16


def floor_tokens(prompts: list[list[int]], block: int) -> int:
    """The prompt tokens every call computes even when all its earlier blocks are cached:
    vLLM reads whole blocks from the cache and computes at least the prompt's last token,
    so a prompt of ``L`` tokens computes ``L - ((L - 1) // block) * block`` at best."""
    return SIZE * sum(len(p) - ((len(p) - 1) // block) * block for p in prompts)


def workload(rng: random.Random) -> list[list[int]]:
    """The prompts of :data:`GROUPS` groups: a shared prefix, then each group's question."""
    prefix = [rng.randrange(VOCAB) for _ in range(PREFIX)]
    return [prefix + [rng.randrange(VOCAB) for _ in range(length)] for length in QUESTIONS]


def interface(servers: list[VLLM], **options: Any) -> tr.OpenAIInference:
    return tr.OpenAIInference(
        [vllm.base_url for vllm in servers],
        servers[0].model,
        server="vllm",
        extra_body={"ignore_eos": True},
        **options,
    )


def request(prompt: list[int], **args: Any) -> tr.InferenceRequest:
    return tr.InferenceRequest(
        prompt=[], prompt_ids=prompt, generation_args=tr.GenerationArgs(max_tokens=TOKENS, **args)
    )


async def separate_calls(
    backend: tr.OpenAIInference, prompts: list[list[int]], run: int
) -> list[list[tr.InferenceResponse]]:
    """Every group's calls at once, one request per call, each group's key set as the
    pipeline sets it."""
    groups: list[list[tr.InferenceResponse]] = [[] for _ in prompts]

    async def member(index: int) -> None:
        groups[index].append(await backend.agenerate(request(prompts[index])))

    async def group(index: int) -> None:
        call_context.set(CallContext(group=(run, 0, index)))
        async with trio.open_nursery() as nursery:
            for _ in range(SIZE):
                nursery.start_soon(member, index)

    async with trio.open_nursery() as nursery:
        for index in range(len(prompts)):
            nursery.start_soon(group, index)
    return groups


async def group_calls(
    backend: tr.OpenAIInference, prompts: list[list[int]], run: int
) -> list[list[tr.InferenceResponse]]:
    """Every group at once, one ``agenerate_group`` call (``n``) each."""
    groups: list[list[tr.InferenceResponse]] = [[] for _ in prompts]

    async def group(index: int) -> None:
        call_context.set(CallContext(group=(run, 0, index)))
        groups[index] = await backend.agenerate_group(request(prompts[index]), SIZE)

    async with trio.open_nursery() as nursery:
        for index in range(len(prompts)):
            nursery.start_soon(group, index)
    return groups


def check_choices(groups: list[list[tr.InferenceResponse]], prompts: list[list[int]]) -> None:
    for prompt, responses in zip(prompts, groups, strict=True):
        check(len(responses) == SIZE, f"{len(responses)} responses for a group of {SIZE}")
        for response in responses:
            ids, start = response.token_ids, response.prompt_length
            if ids is None or start is None or response.logprobs is None:
                raise CheckFailed(f"a choice without token ids or logprobs: {response!r:.300}")
            check(ids[:start] == prompt, "a choice echoed another prompt")
            check(len(ids) - start == TOKENS, f"{len(ids) - start} tokens, not {TOKENS}")
            check(len(response.logprobs) == TOKENS, f"{len(response.logprobs)} logprobs")
            usage = response.usage or {}
            check(
                (usage.get("prompt_tokens"), usage.get("completion_tokens"))
                == (len(prompt), TOKENS),
                f"usage {usage} for a choice of {len(prompt)} + {TOKENS} tokens",
            )


async def check_routing(servers: list[VLLM]) -> str:
    block = await in_thread(block_size, servers[0])
    rows = []
    computed = {}
    floor = 0
    before = await settled(servers)
    for run, routing in enumerate(tr.inference.ROUTINGS):
        prompts = workload(random.Random())
        floor = floor_tokens(prompts, block)
        backend = interface(servers, routing=routing)
        groups = await separate_calls(backend, prompts, run)
        check_choices(groups, prompts)
        await backend.aclose()
        after = await settled(servers)
        delta = [
            {name: now[name] - then[name] for name in COUNTERS}
            for then, now in zip(before, after, strict=True)
        ]
        before = after

        def each(name: str, delta: list[dict[str, float]] = delta) -> str:
            return "/".join(f"{d[name]:.0f}" for d in delta)

        hits = sum(d["vllm:prefix_cache_hits_total"] for d in delta)
        computed[routing] = sum(d["vllm:prefix_cache_queries_total"] for d in delta) - hits
        rows.append(
            f"  {routing:<13} {each('vllm:request_success_total'):>9} "
            f"{each('vllm:prompt_tokens_total'):>13} {each('vllm:prefix_cache_hits_total'):>13} "
            f"{hits:>7.0f} {computed[routing]:>9.0f} {computed[routing] - floor:>9.0f}"
        )
    header = (
        f"  {'routing':<13} {'requests':>9} {'prompt tok':>13} {'hits':>13} "
        f"{'hits':>7} {'computed':>9} {'above min':>9}"
    )
    print(
        f"routing: {GROUPS} groups of {SIZE}, prompts {PREFIX} shared + {QUESTIONS[-1]}-"
        f"{QUESTIONS[0]} own ids, {TOKENS} tokens; per replica scale-out/processed, then "
        f"both; computed = queries - hits; min = {floor} (what every call computes even "
        f"with its earlier {block}-token blocks cached)\n" + header + "\n" + "\n".join(rows),
        flush=True,
    )
    group = computed["group"]
    for routing in ("least_loaded", "round_robin"):
        check(
            group < computed[routing],
            f"group routing computed {group:.0f} prompt tokens, {routing} {computed[routing]:.0f}",
        )
    return ", ".join(f"{routing} computes {tokens:.0f}" for routing, tokens in computed.items())


async def check_n(servers: list[VLLM]) -> str:
    backend = interface(servers)
    rng = random.Random()
    seconds: dict[str, list[float]] = {"separate": [], "n": []}
    for round_ in range(-1, ROUNDS):  # round -1 warms up: first contacts, the fallback
        for arm, run_arm in (("separate", separate_calls), ("n", group_calls)):
            prompts = workload(rng)
            started = time.perf_counter()
            groups = await run_arm(backend, prompts, 100 + 2 * round_ + (arm == "n"))
            if round_ >= 0:
                seconds[arm].append(time.perf_counter() - started)
            check_choices(groups, prompts)
    stats = backend.statistics()
    await backend.aclose()
    check(stats.dropped_fields == ((), ()), f"a replica refused n: {stats.dropped_fields}")
    separate, grouped = statistics.median(seconds["separate"]), statistics.median(seconds["n"])
    rounds = "; ".join(
        f"{s:.2f} s / {n:.2f} s" for s, n in zip(seconds["separate"], seconds["n"], strict=True)
    )
    print(
        f"n: {GROUPS} groups of {SIZE}, separate calls / n={SIZE} group calls: {rounds}; "
        f"median ratio {separate / grouped:.2f} (attempts {stats.attempts}, choices "
        f"{stats.choices}, warm-up included)",
        flush=True,
    )
    return f"separate / n wall time {separate / grouped:.2f}"


async def check_seeds(scale_out: VLLM) -> str:
    backend = interface([scale_out])
    prompt = workload(random.Random())[0]
    group = await backend.agenerate_group(request(prompt, seed=1234), 4)
    alone: list[tr.InferenceResponse | None] = [None] * 4

    async def one(i: int) -> None:
        alone[i] = await backend.agenerate(request(prompt, seed=1234 + i))

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(one, i)
    same = sum(
        single is not None and single.token_ids == choice.token_ids
        for choice, single in zip(group, alone, strict=True)
    )
    await backend.aclose()
    check(same == 4, f"{same} of 4 choices sampled as calls with seed + i")
    distinct = len({tuple(choice.token_ids or ()) for choice in group})
    check(distinct == 4, f"the seeded choices are not all different ({distinct} distinct)")
    return "n=4 with seed s samples what 4 calls with s + i do, choice for choice"


async def check_cancel(scale_out: VLLM) -> str:
    backend = tr.OpenAIInference(
        scale_out.base_url, scale_out.model, server="vllm", extra_body={"ignore_eos": True}
    )
    prompt = workload(random.Random())[0]
    before = await in_thread(scale_out.metric, "vllm:generation_tokens_total")
    with trio.move_on_after(120) as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                backend.agenerate_group,
                tr.InferenceRequest(
                    prompt=[], prompt_ids=prompt, generation_args=tr.GenerationArgs(max_tokens=LONG)
                ),
                SIZE,
            )
            await wait_for_tokens(scale_out, before, 100)
            scope.cancel()
    check(scope.cancelled_caught, "the long group ended before it was cancelled")
    cancelled_at = time.perf_counter()
    with trio.fail_after(10):  # polling: nothing else says what the server runs
        while True:
            if await in_thread(scale_out.metric, "vllm:num_requests_running") == 0:
                break
            await trio.sleep(0.05)
    gone = time.perf_counter() - cancelled_at
    generated = await in_thread(scale_out.metric, "vllm:generation_tokens_total") - before
    await backend.aclose()
    check(generated < SIZE * LONG / 2, f"{generated:.0f} tokens generated after the cancel")
    return (
        f"nothing running {gone:.2f} s after the cancel ({generated:.0f} of {SIZE * LONG} tokens)"
    )


async def check_priority(vllm: VLLM) -> str:
    """Older epochs first, observed. ``--max-num-seqs`` long calls of epoch 0 fill the
    server (each 16 tokens longer than the last, so one slot frees at a time); then a
    one-token call of epoch 2 arrives and waits, and after it one of epoch 1, both sent
    with ``priority=True`` (distinct prompts: nothing shared in the prefix cache). The
    server must take the field; the order the two waiting calls finished in is reported,
    not asserted: on vLLM 0.32's CPU build, run with ``--scheduling-policy priority``,
    it was first come, first served in our runs (and with one shared prompt, epoch 1
    first on a first-come server too), so this cannot show the policy at work here. The
    server's own gauges say when the calls run and wait (polling: nothing else does)."""
    backend = interface([vllm], priority=True)
    rng = random.Random()
    finished: list[int] = []

    async def call(epoch: int, tokens: int) -> None:
        call_context.set(CallContext(start_epoch=epoch))
        prompt = [rng.randrange(VOCAB) for _ in range(64)]  # nothing shared in the cache
        await backend.agenerate(
            tr.InferenceRequest(
                prompt=[], prompt_ids=prompt, generation_args=tr.GenerationArgs(max_tokens=tokens)
            )
        )
        finished.append(epoch)

    async def until(gauge: str, value: int) -> None:
        with trio.fail_after(60):  # polling: nothing else says what the server runs
            while True:
                if await in_thread(vllm.metric, gauge) >= value:
                    return
                await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        for i in range(MAX_NUM_SEQS):
            nursery.start_soon(call, 0, 256 + 16 * i)
        await until("vllm:num_requests_running", MAX_NUM_SEQS)
        nursery.start_soon(call, 2, 1)
        await until("vllm:num_requests_waiting", 1)
        nursery.start_soon(call, 1, 1)
        await until("vllm:num_requests_waiting", 2)
        # The gauges lag: when a call of epoch 0 had already ended, the two may not both
        # have waited for the same slot.
        clean = not finished
    await backend.aclose()
    late = tuple(epoch for epoch in finished if epoch)
    check(sorted(late) == [1, 2], f"the waiting calls did not both finish: {finished}")
    first = "epoch 1, sent last" if late == (1, 2) else "epoch 2, sent first"
    caveat = "" if clean else "; inconclusive: a call of epoch 0 had ended before both waited"
    return (
        f"the server took priority; of two calls waiting for a slot, the one of {first} "
        f"finished first (reported, not asserted{caveat})"
    )


async def run_placement_checks(scale_out: VLLM, processed: VLLM) -> None:
    servers = [scale_out, processed]
    for name, run_check in (
        ("routing", lambda: check_routing(servers)),
        ("n", lambda: check_n(servers)),
        ("seeds", lambda: check_seeds(scale_out)),
        ("cancel", lambda: check_cancel(scale_out)),
    ):
        with trio.fail_after(300):
            print(f"{name}: {await run_check()}", flush=True)
