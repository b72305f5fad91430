"""Weight updates on EmbeddedInference: the four modes side by side, and what each costs.

Usage: python benchmarks/weight_update.py [--every 16,32,64] [--groups 640]
       [--push-seconds 0.2] [--train-seconds 0] [--jobs N] [--json PATH]
       [--variants none,drain,restart,keep,abort,keep:1,abort:1]

The work. A streaming grouped pipeline (``num_groups=1``, ``parallel_generation_tasks``
P=32 calls of ``rollouts_per_group`` R=4 requests each: 128 generation *slots*) on
``EmbeddedInference`` with a constant-speed ``LatencyModel``: first token after 30 ms,
then 6 ms per token. Completion lengths vary: each request samples one of 256
completions whose lengths are the quantiles of a log-normal (median 48 tokens, sigma 0.8,
clipped to 6-288; mean 65), so a request takes 0.07-1.8 s and a group waits for the
slowest of its 4. The trainer takes groups as they come (training takes no time unless
``--train-seconds``) and, after every N groups (``--every``), runs one
``stream.weight_update(mode)`` whose body sleeps ``--push-seconds`` (the simulated
weight push), until it has taken ``--groups`` groups (so ``U = groups / N - 1``
updates).

Time is simulated: each run is ``trio.run`` on a ``trio.testing.MockClock`` with
autojump, and the embedded backend's latency is ``trio.sleep``, so every time reported
is exact simulated time, independent of the machine and its load. (Trio's scheduler
breaks ties at random, so a rerun may differ in the last digits.) Each variant runs in
a process of its own, ``--jobs`` at once; wall and CPU time are only what the
simulation cost.

Variants: ``none`` (no update and no push: the baseline, run once), the four modes, and
``mode:K``, a mode under ``GroupedRolloutRequest(max_staleness=K)``.

The figures, for ``T`` = simulated seconds from opening the stream until the trainer
took its last group:

- ``groups/s`` = groups / T, and its ratio to ``none``.
- ``utilization`` = useful slot-seconds / (slots x T). A request's useful time is what
  an uninterrupted request of its length takes (first token + tokens x per token),
  summed over the requests of the groups the trainer took. It is below 1 without
  updates too: a call's 4 slots wait for its slowest request.
- ``lost per update`` = ``T * (1 - utilization / utilization(none)) / U``: how much
  longer than ``none`` the run took to generate the same useful work, per update, in
  seconds. The push is included: a pause that costs nothing but the push loses exactly
  ``--push-seconds``; the row below gives the rest. ``idle slot-s per update`` is the
  same loss in slot-seconds, ``(utilization(none) - utilization) * slots * T / U``.
- ``pause_seconds`` (``WeightUpdate.pause_seconds``: from entering the block until the
  body started), p50 / p90 / max; ``held``: ``WeightUpdate.held`` (calls held, aborted,
  or cancelled by restart or the bound), mean per update.
- staleness of the delivered groups, ``stream.policy_epoch - group.start_epoch`` when
  the trainer took them: how many groups had each value; ``spanning``: delivered groups
  with a rollout generated under two epochs (the embedded backend stamps the boundary).
- tokens delivered (in the groups taken), and thrown away: the tokens of calls
  cancelled by ``restart`` or by the staleness bound, plus those of finished groups
  evicted as too old. Finished requests count exactly; a cancelled request's partial
  output is **estimated** from its generating time, ``floor((time since it started -
  time held in keep/abort bodies - first token - one re-prefill per abort) /
  per_token)``, because the backend keeps no token counters. The same estimate is
  checked on every finished request and its error printed. ``abort`` throws no token
  away, but each request it stops pays a new first-token wait (prefill of the prompt
  and the partial output): that shows in the utilization, not in the tokens.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import math
import multiprocessing
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import trio
import trio.testing
from _report import Report, machine_lines, progress

import trio_rollouts as tr
from trio_rollouts.inference import EmbeddedInference, LatencyModel

HERE = Path(__file__).resolve()

#: Group calls in flight, and rollouts (requests) per group: P * R generation slots.
PARALLEL = 32
ROLLOUTS = 4
FIRST_TOKEN = 0.030
PER_TOKEN = 0.006
LATENCY = LatencyModel(first_token=FIRST_TOKEN, per_token=PER_TOKEN, distribution="constant")
#: The completion lengths (tokens): 256 quantiles of a clipped log-normal.
LENGTH_MEDIAN = 48
LENGTH_SIGMA = 0.8
LENGTH_RANGE = (6, 288)
CANDIDATES = 256
#: Finished groups may wait in the buffer: enough that a worker never blocks on it.
BUFFER = 4 * PARALLEL
DEFAULT_VARIANTS = "none,drain,restart,keep,abort,keep:1,abort:1"
MODES = ("drain", "restart", "keep", "abort")


def completion_lengths() -> list[int]:
    """The candidates' lengths: quantiles of the log-normal, so the run needs no seed."""
    from statistics import NormalDist

    normal = NormalDist()
    lengths = []
    for i in range(CANDIDATES):
        z = normal.inv_cdf((i + 0.5) / CANDIDATES)
        length = round(LENGTH_MEDIAN * math.exp(LENGTH_SIGMA * z))
        lengths.append(min(max(length, LENGTH_RANGE[0]), LENGTH_RANGE[1]))
    return lengths


LENGTHS = completion_lengths()
COMPLETIONS = tuple("x" * n for n in LENGTHS)
PROBABILITIES = np.full(CANDIDATES, 1.0 / CANDIDATES)


def policy(prompt: list[tr.ChatMessage]) -> tuple[Sequence[str], np.ndarray]:
    """Every prompt: one of the completions, uniformly."""
    return COMPLETIONS, PROBABILITIES


def request_seconds(tokens: int) -> float:
    """What an uninterrupted request of ``tokens`` tokens takes (the useful time)."""
    return FIRST_TOKEN + tokens * PER_TOKEN


# ----------------------------------------------------------------------------- one run


@attrs.define(eq=False)
class Ledger:
    """What the agent and the trainer record during one run."""

    abort: bool
    #: (body start, body end) of each keep/abort update: requests in flight are held.
    holds: list[tuple[float, float]] = attrs.Factory(list)
    #: Counting stops when the trainer has its last group (shutdown cancels the rest).
    recording: bool = True
    calls: int = 0
    active_requests: int = 0
    #: The completion lengths of each finished call's requests, by problem_id.
    lengths: dict[str, list[int]] = attrs.Factory(dict)
    cancelled_calls: int = 0
    #: Tokens of the finished requests of cancelled calls (exact).
    cancelled_finished_tokens: int = 0
    #: Tokens of the cancelled requests (estimated; see generated_tokens).
    cancelled_partial_tokens: int = 0
    cancelled_requests: int = 0
    #: The estimator's error (estimate - true length) on every finished request.
    estimator_errors: collections.Counter[int] = attrs.Factory(collections.Counter)

    def generated_tokens(self, start: float, end: float) -> int:
        """Tokens a request generated from ``start`` to ``end``, from its generating time:
        the time held by keep/abort bodies is not generating; under abort, a request
        stopped after its first token pays a new first-token wait, and one stopped
        before it starts over."""
        active = 0.0
        overhead = 0.0
        cursor = start
        for begin, finish in self.holds:
            if finish <= start or begin >= end:
                continue
            active += max(0.0, begin - cursor)
            cursor = max(cursor, finish)
            if self.abort:
                if active < FIRST_TOKEN:
                    active = 0.0
                else:
                    overhead += FIRST_TOKEN
        active += max(0.0, end - cursor)
        # A small epsilon: the sleeps' sum may round just below a whole token.
        return max(0, math.floor((active - overhead - FIRST_TOKEN) / PER_TOKEN + 1e-6))


@attrs.define
class LengthAgent(tr.GroupedRolloutGenerator):
    """One prompt per call (``problem <n>``), ``R`` requests at once; records what each
    request generated, and what cancelled calls threw away."""

    ledger: Ledger = attrs.field(kw_only=True)

    async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        ledger = self.ledger
        call = f"call-{ledger.calls}"
        ledger.calls += 1
        iface = request.inference_interface
        prompt = iface.prepare_request(f"problem {call}", request.generation_args)
        rollouts: list[tr.Rollout | None] = [None] * request.rollouts_per_group
        lengths = [0] * request.rollouts_per_group

        async def one(i: int) -> None:
            start = trio.current_time()
            ledger.active_requests += 1
            try:
                response = await iface.agenerate(prompt)
            except trio.Cancelled:
                if ledger.recording:
                    ledger.cancelled_requests += 1
                    ledger.cancelled_partial_tokens += ledger.generated_tokens(
                        start, trio.current_time()
                    )
                raise
            finally:
                ledger.active_requests -= 1
            length = len(response.response.content or "")
            estimate = ledger.generated_tokens(start, trio.current_time())
            ledger.estimator_errors[estimate - length] += 1
            lengths[i] = length
            rollouts[i] = tr.Rollout(
                trajectory=[response.raw_text or ""],
                reward=float(length % 2),
                problem_id=call,
                policy_epoch=[list(response.policy_epoch)],
            )

        done = False
        try:
            async with trio.open_nursery() as nursery:
                for i in range(request.rollouts_per_group):
                    nursery.start_soon(one, i)
            done = True
        finally:
            if not done and ledger.recording:
                ledger.cancelled_calls += 1
                ledger.cancelled_finished_tokens += sum(lengths)
        ledger.lengths[call] = lengths
        return [r for r in rollouts if r is not None]


def parse_variant(variant: str) -> tuple[str, int | None]:
    mode, _, bound = variant.partition(":")
    if mode != "none" and mode not in MODES:
        msg = f"unknown variant {variant!r}: a mode of {MODES}, 'none', or mode:K"
        raise ValueError(msg)
    if bound and mode == "none":
        msg = "'none' takes no staleness bound"
        raise ValueError(msg)
    if not bound:
        return mode, None
    if not bound.isdigit():
        msg = f"variant {variant!r}: the staleness bound must be an int >= 0"
        raise ValueError(msg)
    return mode, int(bound)


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


async def measure(
    variant: str, every: int, groups: int, push: float, train: float, seed: int
) -> dict[str, Any]:
    mode, bound = parse_variant(variant)
    ledger = Ledger(abort=mode == "abort")
    iface = EmbeddedInference(seed=seed, policy=policy, latency=LATENCY)
    agent = LengthAgent(parallel_generation_tasks=PARALLEL, buffer_size=BUFFER, ledger=ledger)
    request = tr.GroupedRolloutRequest(
        num_groups=1,
        rollouts_per_group=ROLLOUTS,
        inference_interface=iface,
        streaming=True,
        max_staleness=bound,
    )
    staleness: collections.Counter[int] = collections.Counter()
    pauses: list[float] = []
    held_calls: list[int] = []
    held_requests: list[int] = []
    delivered_ids: set[str] = set()
    delivered_tokens = 0
    useful = 0.0
    spanning = 0
    taken = 0
    async with agent.get_grouped_rollouts(request) as stream:
        start = trio.current_time()
        while taken < groups:
            group = await stream.receive()
            taken += 1
            staleness[stream.policy_epoch - group.start_epoch] += 1
            delivered_ids.add(group[0].problem_id or "")
            lengths = ledger.lengths[group[0].problem_id or ""]
            delivered_tokens += sum(lengths)
            useful += sum(request_seconds(n) for n in lengths)
            if any(len(stamps) > 1 for r in group for stamps in r.policy_epoch):
                spanning += 1
            if mode == "none" or taken % every or taken >= groups:
                continue
            if train:
                await trio.sleep(train)  # training; generation goes on
            async with stream.weight_update(mode) as update:
                body = trio.current_time()
                held_requests.append(ledger.active_requests)
                await trio.sleep(push)  # the weight push
                if mode in ("keep", "abort"):
                    ledger.holds.append((body, trio.current_time()))
            pauses.append(update.pause_seconds)
            held_calls.append(update.held)
        seconds = trio.current_time() - start
        ledger.recording = False
        stats = stream.statistics()
        # Finished groups not taken: those still fresh are left over (not thrown away);
        # pulling them evicts the ones that went stale, which are thrown away.
        leftover = {g[0].problem_id or "" for g in stream.drain(10 * BUFFER)}
        pending_after = stream.statistics().pending
    evicted = [
        sum(lengths)
        for call, lengths in ledger.lengths.items()
        if call not in delivered_ids and call not in leftover
    ]
    updates = len(pauses)
    slots = PARALLEL * ROLLOUTS
    return {
        "variant": variant,
        "mode": mode,
        "max_staleness": bound,
        "every": every,
        "groups": taken,
        "seconds": seconds,
        "groups_per_second": taken / seconds,
        "slots": slots,
        "useful_slot_seconds": useful,
        "utilization": useful / (slots * seconds),
        "updates": updates,
        "pause_seconds": pauses,
        "held_calls": held_calls,
        "held_requests": held_requests,
        "staleness": dict(sorted(staleness.items())),
        "spanning": spanning,
        "delivered_tokens": delivered_tokens,
        "cancelled_calls": ledger.cancelled_calls,
        "cancelled_requests": ledger.cancelled_requests,
        "cancelled_finished_tokens": ledger.cancelled_finished_tokens,
        "cancelled_partial_tokens": ledger.cancelled_partial_tokens,
        "evicted_groups": len(evicted),
        "evicted_tokens": sum(evicted),
        "thrown_away_tokens": (
            ledger.cancelled_finished_tokens + ledger.cancelled_partial_tokens + sum(evicted)
        ),
        "estimator_errors": dict(sorted(ledger.estimator_errors.items())),
        "pending_after_drain": pending_after,
        "statistics": {
            key: getattr(stats, key)
            for key in (
                "started",
                "delivered",
                "policy_epoch",
                "weight_updates",
                "restarted",
                "stale",
                "mixed",
                "unaccounted",
            )
        },
    }


def run_one(
    variant: str, every: int, groups: int, push: float, train: float, seed: int
) -> dict[str, Any]:
    """One variant in this process, on a MockClock; adds the wall and CPU it cost."""
    cpu = time.process_time()
    wall = time.perf_counter()
    clock = trio.testing.MockClock(autojump_threshold=0)
    result = trio.run(measure, variant, every, groups, push, train, seed, clock=clock)
    result["wall_seconds"] = time.perf_counter() - wall
    result["cpu_seconds"] = time.process_time() - cpu
    return result


# ----------------------------------------------------------------------------- parent


def machine() -> list[str]:
    return machine_lines(f"numpy {np.__version__}")


def derive(result: dict[str, Any], baseline: dict[str, Any], push: float) -> dict[str, Any]:
    """The figures against the baseline (see the module docstring)."""
    updates = result["updates"]
    ratio = result["utilization"] / baseline["utilization"]
    lost = result["seconds"] * (1 - ratio) / updates if updates else 0.0
    generated = result["delivered_tokens"] + result["thrown_away_tokens"]
    pauses = result["pause_seconds"]
    idle = (
        (baseline["utilization"] - result["utilization"])
        * result["slots"]
        * result["seconds"]
        / updates
        if updates
        else 0.0
    )
    return {
        "throughput_vs_none": result["groups_per_second"] / baseline["groups_per_second"],
        "lost_seconds_per_update": lost,
        "idle_slot_seconds_per_update": idle,
        "lost_beyond_push": lost - push if updates else 0.0,
        "pause_p50": percentile(pauses, 0.5),
        "pause_p90": percentile(pauses, 0.9),
        "pause_max": max(pauses, default=0.0),
        "held_mean": statistics.fmean(result["held_calls"]) if updates else 0.0,
        "thrown_away_share": result["thrown_away_tokens"] / generated if generated else 0.0,
    }


def staleness_cell(counts: dict[Any, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted((int(k), v) for k, v in counts.items()))


def table_rows(results: list[dict[str, Any]], derived: list[dict[str, Any]]) -> list[list[str]]:
    """One row per figure, one column per variant (``results[i]`` with ``derived[i]``)."""
    runs = [{**r, **d} for r, d in zip(results, derived, strict=True)]

    def row(label: str, cell: Any, *, per_update: bool = False) -> list[str]:
        return [label, *("-" if per_update and not x["updates"] else cell(x) for x in runs)]

    def k(tokens: int) -> str:
        return f"{tokens / 1000:,.1f}k"

    def pauses(x: dict[str, Any]) -> str:
        return " / ".join(f"{x[key] * 1e3:.0f}" for key in ("pause_p50", "pause_p90", "pause_max"))

    return [
        row("updates", lambda x: str(x["updates"])),
        row("groups/s (simulated)", lambda x: f"{x['groups_per_second']:.2f}"),
        row("throughput vs none", lambda x: f"{x['throughput_vs_none']:.2f}x"),
        row("utilization (useful slot-s / slot-s)", lambda x: f"{x['utilization']:.3f}"),
        row(
            "lost per update, s (push included)",
            lambda x: f"{x['lost_seconds_per_update']:.3f}",
            per_update=True,
        ),
        row(
            "  of which beyond the push, s",
            lambda x: f"{round(x['lost_beyond_push'], 3) + 0.0:.3f}",
            per_update=True,
        ),
        row(
            "idle slot-s per update (vs none)",
            lambda x: f"{x['idle_slot_seconds_per_update']:.1f}",
            per_update=True,
        ),
        row("pause_seconds p50 / p90 / max, ms", pauses, per_update=True),
        row("held per update (calls, mean)", lambda x: f"{x['held_mean']:.1f}", per_update=True),
        row("staleness at take (value:groups)", lambda x: staleness_cell(x["staleness"])),
        row("groups spanning an update", lambda x: str(x["spanning"])),
        row(
            "restarted / stale (calls)",
            lambda x: f"{x['statistics']['restarted']} / {x['statistics']['stale']}",
        ),
        row("tokens delivered", lambda x: k(x["delivered_tokens"])),
        row(
            "tokens thrown away (share)",
            lambda x: f"{k(x['thrown_away_tokens'])} ({x['thrown_away_share']:.0%})",
        ),
        row("  of which partial (estimated)", lambda x: k(x["cancelled_partial_tokens"])),
        row("simulation CPU, s", lambda x: f"{x['cpu_seconds']:.1f}"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--every", default="16,32,64", help="update after every N groups; comma-separated"
    )
    parser.add_argument("--groups", type=int, default=640, help="groups the trainer takes")
    parser.add_argument(
        "--push-seconds", type=float, default=0.2, help="the simulated weight push (body)"
    )
    parser.add_argument(
        "--train-seconds",
        type=float,
        default=0.0,
        help="training time before each update, while generation goes on",
    )
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated")
    parser.add_argument("--seed", type=int, default=0, help="EmbeddedInference's seed")
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="runs at once (processes)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write every result as JSON")
    args = parser.parse_args()
    try:
        everies = [int(x) for x in args.every.split(",") if x.strip()]
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        for variant in variants:
            parse_variant(variant)
    except ValueError as exc:
        parser.error(str(exc))
    if not everies or any(not 1 <= n < args.groups for n in everies):
        parser.error("--every values must be in [1, --groups)")
    if args.push_seconds < 0 or args.train_seconds < 0 or args.jobs < 1:
        parser.error("--push-seconds and --train-seconds must be >= 0, --jobs >= 1")
    if "none" not in variants:
        variants.insert(0, "none")

    report = Report(width=160)
    for line in machine():
        report.line(line)
    report.line(
        f"work: P={PARALLEL} calls x R={ROLLOUTS} requests = {PARALLEL * ROLLOUTS} slots; "
        f"latency: first token {FIRST_TOKEN * 1e3:g} ms, {PER_TOKEN * 1e3:g} ms per token "
        f"(constant speed); lengths: log-normal median {LENGTH_MEDIAN}, sigma "
        f"{LENGTH_SIGMA:g}, clipped to {LENGTH_RANGE[0]}-{LENGTH_RANGE[1]} tokens (mean "
        f"{statistics.fmean(LENGTHS):.0f}); {args.groups} groups; push "
        f"{args.push_seconds:g} s; training {args.train_seconds:g} s per update"
    )
    report.line(
        "time: simulated (trio.testing.MockClock, autojump): exact, and independent of "
        "the machine's load"
    )
    report.line()

    # The baseline does not depend on N: run it once.
    jobs = [("none", everies[0])] + [(v, n) for n in everies for v in variants if v != "none"]
    context = multiprocessing.get_context("spawn")
    results: dict[tuple[str, int], dict[str, Any]] = {}
    started = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        futures = {
            pool.submit(
                run_one, v, n, args.groups, args.push_seconds, args.train_seconds, args.seed
            ): (v, n)
            for v, n in jobs
        }
        for future in concurrent.futures.as_completed(futures):
            v, n = futures[future]
            results[v, n] = future.result()
            progress(
                f"  {v} every {n}: {results[v, n]['groups_per_second']:.2f} groups/s "
                f"(simulation {results[v, n]['wall_seconds']:.1f} s)"
            )
    baseline = results["none", everies[0]]
    out: dict[str, Any] = {
        "machine": machine(),
        "settings": {
            "parallel_generation_tasks": PARALLEL,
            "rollouts_per_group": ROLLOUTS,
            "first_token": FIRST_TOKEN,
            "per_token": PER_TOKEN,
            "lengths": LENGTHS,
            "groups": args.groups,
            "push_seconds": args.push_seconds,
            "train_seconds": args.train_seconds,
            "seed": args.seed,
        },
        "runs": [],
    }
    for n in everies:
        row_results = [baseline] + [results[v, n] for v in variants if v != "none"]
        derived = [derive(r, baseline, args.push_seconds) for r in row_results]
        for r, d in zip(row_results, derived, strict=True):
            out["runs"].append({**r, "every": n if r is not baseline else None, **d})
        updates = row_results[-1]["updates"]
        report.table(
            f"One update every {n} groups ({updates} updates), push {args.push_seconds:g} s; "
            "simulated time",
            ["", *(r["variant"] for r in row_results)],
            table_rows(row_results, derived),
        )
    errors: collections.Counter[int] = collections.Counter()
    for r in results.values():
        errors.update({int(k): v for k, v in r["estimator_errors"].items()})
    total = sum(errors.values())
    report.line(
        "The partial-token estimate checked on the finished requests (estimate - true "
        "length: requests): "
        + ", ".join(f"{k:+d}: {v} ({v / total:.1%})" for k, v in sorted(errors.items()))
    )
    leftovers = sum(r["pending_after_drain"] for r in results.values())
    unaccounted = sum(r["statistics"]["unaccounted"] for r in results.values())
    report.line(
        f"ledgers: unaccounted {unaccounted} (summed over the runs); finished groups still "
        f"pending after the final drain: {leftovers}"
    )
    report.line(f"wall time: {time.perf_counter() - started:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        report.line(f"results written to {args.json}")


if __name__ == "__main__":
    main()
