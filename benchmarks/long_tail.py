"""The long tail: trainer idle time against model calls thrown away, inside the bound.

How long an asynchronous GRPO loop waits for its groups, and how much work the staleness
bound throws away, when generation times are heavy-tailed.

Usage: python benchmarks/long_tail.py [--quick] [--steps N] [--warmup N] [--seeds N]
       [--seed N] [--engine-steps N] [--no-engine] [--train-outside]

Everything runs in virtual time (``trio.run(..., clock=MockClock(autojump_threshold=0))``):
the figures are simulated seconds and the stream's counters, the same on any machine
(wall time, on stderr, only says what the simulation cost: about 100 s on 2 cores, 10 s
with ``--quick``). Trio breaks scheduling ties at random, so a rerun with the same seeds
may differ by a few hundredths in a column; each setting therefore runs ``--seeds`` times
(default 3, run seeds ``--seed``, ``--seed + 1``, ...; 1 with ``--quick``), and the table
pools the runs (sums of times and counters), with the range over the runs in
parentheses. The scenario is issue 33's (``DESIGN.md``, "The long tail"):

- Backend: ``EmbeddedInference(seed=..., latency=LatencyModel(first_token=0.2,
  per_token=0.02, distribution="lognormal", sigma=1.5))`` with its default policy
  (``HashedPromptPolicy``: 4 answers of 14-16 characters; 1 token = 1 character). Each
  request draws a speed factor (lognormal, mean 1, sigma 1.5) that scales its whole
  time: a request takes about 0.5 s on average, one in a hundred more than 5 s, and a
  group of 8 waits for its slowest.
- Loop: a ``RewardOnlyAgent`` (problems from a ``PromptSource``; the reward is beside the
  point) with ``parallel_generation_tasks=P`` and the default ``buffer_size``;
  ``GroupedRolloutRequest(num_groups=8, rollouts_per_group=8, streaming=True,
  max_staleness=K, seed=...)``. Each step takes 8 groups with ``stream.receive()``, then
  runs ``async with stream.weight_update("keep"): await trio.sleep(0.5)``: 0.5 s of
  training and weight push during which the backend holds every call (keep: no token is
  generated and no call starts). With ``--train-outside`` the 0.5 s is slept before the
  block instead, and the body is empty: training overlaps generation. ``--warmup`` steps
  (default 5; 2 with ``--quick``) fill the pipeline; the next ``--steps`` steps (default
  40; 8 with ``--quick``) are measured.
- Settings ``(K, P)``: (1, 8), (1, 32), (1, 64), (2, 32), (2, 64), each three ways
  (column ``calls``): ``group``, a group as one call (``group_calls=True``, the default:
  its members end together, so only admission acts); ``member``, one call per member
  (``group_calls=False``: admission, and members cut at the bound); and ``member`` with
  ``extra_rollouts=2``.

The columns, over the measured steps (counters are differences of ``stream.statistics()``
between the start of the first measured step and the end of the last update):

- ``trainer idle``: 1 - training seconds / loop seconds: the share of the loop's virtual
  time not spent in the 0.5 s of training. It is ``in receive`` (the time spent waiting
  in ``stream.receive()``) plus the updates' pause: ``pause ms/update`` is
  ``WeightUpdate.pause_seconds`` per update, the time from entering the block to its
  body (calls the bound cancels must exit; a keep pause waits for the token steps in
  flight, and on the latency model a slow request's step is long).
- ``calls thrown``: model calls whose work was discarded / model calls that ended in
  the window, a ``group_rollout`` call of 8 members counting as one: ``(stale +
  restarted) / (stale + restarted + delivered)``. The bound cancels a call in flight that
  an update makes too old, and generates a finished group found too old when it is taken
  again: both are ``stale``. In a steady state this is thrown / started; counting the
  calls that ended keeps it a fraction in a short window too (the calls started before
  it, or still running after it, do not skew it).
- ``member calls thrown``: the same in member requests: ``(8 + extra) * (stale +
  restarted) + cut`` over that plus ``8 * delivered``: a delivered group kept 8 members,
  and ``statistics().cut`` counts both its extras that lost the race and its members cut
  at the bound (each generated again: one more member call). Without extras and cuts it
  equals ``calls thrown``.
- ``run: 1 - delivered/started``: issue 33's count of calls thrown: over the whole run
  (warm-up included), read after the last update, so the calls still in flight or
  pending then (about P, cancelled at shutdown) count as thrown. It depends on the
  run's length; ``calls thrown`` does not.
- ``issue: idle, thrown``: what issue 33 measured (first table). Its figures are
  reproduced, within the runs' spread, by ``--train-outside`` with ``--warmup 0``,
  ``trainer idle`` and ``run: 1 - delivered/started``: that loop trained while
  generating.
- ``max age``: the largest ``stream.policy_epoch - group.start_epoch`` of a delivered
  group, when it was taken, over warm-up and measured steps. Above K, the script fails.
- ``delivered len``: mean generated tokens of the delivered rollouts (the completion's
  characters); ``policy len``: the mean length the policy gives for the same prompts
  (the expectation under each delivered prompt's distribution, which the backend samples
  from as is: no temperature, top-k, top-p or max_tokens); ``bias``: delivered / policy
  minus 1, over the pooled runs. Thrown calls, cuts and over-provisioning favour fast
  answers. On the latency model a request's time is its speed factor times ``0.2 + 0.02
  * length`` and the lengths differ by 2 characters, so the first table's bias is near 0
  by construction; the engine table's lengths are heavy-tailed.
- ``s/step``: virtual seconds per measured step.
- When the library has them: ``cut / group`` (``statistics().cut`` per delivered group),
  ``wasted tokens`` (``statistics().wasted_tokens`` / generated tokens delivered) and
  ``mean cut len`` (the generated tokens of ``RolloutGroup.cuts`` of delivered groups).

A second table (skip it with ``--no-engine``): the same loop on
``EmbeddedInference(engine=EngineModel(), replicas=4)`` (the simulated vLLM cluster,
routing ``group``) with a policy whose completion lengths are heavy-tailed: 16 equally
likely completions per prompt, lengths lognormal (median 64 ids, sigma 1.5, capped at
2,048), drawn from a generator seeded by a hash of the prompt. Its ``tokens thrown`` is
one minus the generated tokens of the delivered rollouts over the tokens the replicas
sampled (``EngineStatistics.generation_tokens``) during the measured steps
(``--engine-steps``, default 20; 4 with ``--quick``): a steady-state rate too, which
tokens sampled on either side of the window's ends can move by a few hundredths either
way (it reads 0.03 or -0.01 where no call is thrown).

Exit status 1 when a delivered group is older than its bound, or when
``statistics().unaccounted`` is not 0 at the end of a run.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import time
from collections.abc import Sequence
from typing import Any, Final

import attrs
import numpy as np
import trio
import trio.testing
from _report import machine_lines, progress

import trio_rollouts as tr
from trio_rollouts.inference import (
    EmbeddedInference,
    EngineModel,
    InferenceResponse,
    LatencyModel,
    render_plain_chat,
)

GROUPS: Final = 8
GROUP_SIZE: Final = 8
TRAIN_SECONDS: Final = 0.5
LATENCY: Final = LatencyModel(first_token=0.2, per_token=0.02, distribution="lognormal", sigma=1.5)
SETTINGS: Final = ((1, 8), (1, 32), (1, 64), (2, 32), (2, 64))
#: ``extra_rollouts`` of the extra rows, when the library has the field.
EXTRA: Final = 2
RUN_SEED: Final = 1234
BACKEND_SEED: Final = 7
PROBLEMS: Final = 4096
#: The engine table's policy.
REPLICAS: Final = 4
CANDIDATES: Final = 16
MEDIAN_LENGTH: Final = 64
SIGMA: Final = 1.5
MAX_LENGTH: Final = 2048
#: What issue 33 measured, for the "issue" columns: (idle, thrown) by (K, P).
ISSUE: Final = {
    (1, 8): (0.92, 0.02),
    (1, 32): (0.65, 0.37),
    (1, 64): (0.48, 0.59),
    (2, 32): (0.63, 0.24),
    (2, 64): (0.41, 0.44),
}


# ----------------------------------------------------------------------------- the work


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def make_problems(count: int) -> list[tr.Problem]:
    return [
        tr.Problem(problem_id=f"q{i}", prompt=f"Question {i}: pick A, B or C.", answer="A")
        for i in range(count)
    ]


@attrs.frozen
class LognormalPolicy:
    """``CANDIDATES`` equally likely completions per prompt, their lengths lognormal
    (median ``MEDIAN_LENGTH``, ``SIGMA``, at most ``MAX_LENGTH``), fixed by a hash of the
    prompt's plain rendering."""

    def __call__(self, prompt: list[tr.ChatMessage]) -> tuple[Sequence[str], list[float]]:
        rng = np.random.default_rng(_digest(render_plain_chat(prompt)))
        lengths = np.minimum(
            np.maximum(1, np.rint(rng.lognormal(math.log(MEDIAN_LENGTH), SIGMA, CANDIDATES))),
            MAX_LENGTH,
        )
        completions = [
            (f"{k}" + "answer " * (int(n) // 7 + 1))[: int(n)] for k, n in enumerate(lengths)
        ]
        return completions, [1.0] * CANDIDATES


@attrs.define(kw_only=True)
class LongTailAgent(tr.RewardOnlyAgent):
    """Draws problems from its ``PromptSource``; a completion scores 1 when it says B or
    has an odd length (the reward is beside the point here, but groups whose rewards
    all agree would make the pipeline warn)."""

    async def get_reward(self, problem: tr.Problem, response: InferenceResponse) -> float:
        content = response.response.content or ""
        return float("B" in content or len(content) % 2 == 1)


def has_extra_rollouts() -> bool:
    return "extra_rollouts" in attrs.fields_dict(tr.GroupedRolloutRequest)


@attrs.frozen
class Setting:
    max_staleness: int
    parallel: int
    extra: int = 0
    engine: bool = False
    #: ``GroupedRolloutRequest.group_calls``: a group as one call (``n``), whose members
    #: end together and so cannot be cut one by one.
    group_calls: bool = False


@attrs.frozen
class Result:
    setting: Setting
    steps: int
    loop_seconds: float
    receive_seconds: float
    pause_seconds: float
    counters: dict[str, int]
    max_age: int
    delivered_lengths: list[int]
    policy_lengths: list[float]
    cut_lengths: list[int] | None
    generated_tokens: int | None
    #: ``statistics().unaccounted`` at the end (the ledger's remainder: must be 0).
    unaccounted: int
    #: ``started`` and ``delivered`` over the whole run (warm-up included), at the end.
    run_started: int
    run_delivered: int
    wall_seconds: float

    @property
    def idle(self) -> float:
        return 1.0 - self.steps * TRAIN_SECONDS / self.loop_seconds

    @property
    def thrown(self) -> float:
        """Group calls thrown away / group calls that ended (thrown or delivered)."""
        c = self.counters
        thrown = c["stale"] + c["restarted"]
        ended = thrown + c["delivered"]
        return thrown / ended if ended else 0.0

    @property
    def member_thrown(self) -> float:
        """The same in member requests (see the module docstring)."""
        c = self.counters
        extra = self.setting.extra
        cut = c.get("cut", 0)
        dropped = (GROUP_SIZE + extra) * (c["stale"] + c["restarted"])
        # A delivered group kept GROUP_SIZE members; its extras that lost the race and
        # its members cut at the bound are both in ``cut``.
        ended = dropped + GROUP_SIZE * c["delivered"] + cut
        return (dropped + cut) / ended if ended else 0.0

    @property
    def run_thrown(self) -> float:
        """Issue 33's count: 1 - delivered / started over the whole run, the calls still
        in flight or pending at the end (cancelled at shutdown) counted as thrown."""
        return 1.0 - self.run_delivered / self.run_started if self.run_started else 0.0

    @property
    def delivered_mean(self) -> float:
        return float(np.mean(self.delivered_lengths))

    @property
    def policy_mean(self) -> float:
        return float(np.mean(self.policy_lengths))

    @property
    def tokens_thrown(self) -> float | None:
        if not self.generated_tokens:
            return None
        return 1.0 - sum(self.delivered_lengths) / self.generated_tokens


def pooled(runs: Sequence[Result]) -> Result:
    """The runs of one setting (one per run seed) as one: times, counters and tokens
    summed, lengths put together, the largest age."""
    first = runs[0]
    cuts = [r.cut_lengths for r in runs if r.cut_lengths is not None]
    tokens = [r.generated_tokens for r in runs if r.generated_tokens is not None]
    return Result(
        setting=first.setting,
        steps=sum(r.steps for r in runs),
        loop_seconds=sum(r.loop_seconds for r in runs),
        receive_seconds=sum(r.receive_seconds for r in runs),
        pause_seconds=sum(r.pause_seconds for r in runs),
        counters={name: sum(r.counters[name] for r in runs) for name in first.counters},
        max_age=max(r.max_age for r in runs),
        delivered_lengths=[n for r in runs for n in r.delivered_lengths],
        policy_lengths=[n for r in runs for n in r.policy_lengths],
        cut_lengths=[n for lengths in cuts for n in lengths] if cuts else None,
        generated_tokens=sum(tokens) if tokens else None,
        unaccounted=sum(abs(r.unaccounted) for r in runs),
        run_started=sum(r.run_started for r in runs),
        run_delivered=sum(r.run_delivered for r in runs),
        wall_seconds=sum(r.wall_seconds for r in runs),
    )


COUNTERS: Final = (
    "started",
    "delivered",
    "stale",
    "restarted",
    "cut",
    "wasted_tokens",
)


def counters(stats: tr.RolloutStreamStatistics) -> dict[str, int]:
    return {name: int(getattr(stats, name)) for name in COUNTERS if hasattr(stats, name)}


def cut_tokens(cut: Any) -> int:
    """The generated tokens of one of ``RolloutGroup.cuts``: a ``(generated_tokens,
    elapsed_seconds, epoch)`` tuple in the contract, or an object with that field."""
    tokens = getattr(cut, "generated_tokens", None)
    return int(cut[0] if tokens is None else tokens)


def make_backend(engine: bool) -> EmbeddedInference:
    if engine:
        return EmbeddedInference(
            seed=BACKEND_SEED, policy=LognormalPolicy(), engine=EngineModel(), replicas=REPLICAS
        )
    return EmbeddedInference(seed=BACKEND_SEED, latency=LATENCY)


async def run_loop(
    setting: Setting,
    backend: EmbeddedInference,
    warmup: int,
    steps: int,
    seed: int,
    train_outside: bool,
) -> Result:
    problems = make_problems(PROBLEMS)
    prompts = {p.problem_id: p.prompt for p in problems}
    agent = LongTailAgent(
        prompts=tr.PromptSource(problems, seed=seed),
        parallel_generation_tasks=setting.parallel,
        env_id="long_tail",
    )
    # Member calls: the members of a group call (``n``) finish together, so only
    # members sent one by one can be cut at the bound (see docs/weight-updates.md).
    options: dict[str, Any] = {"group_calls": setting.group_calls}
    if setting.extra:
        options["extra_rollouts"] = setting.extra
    request = tr.GroupedRolloutRequest(
        num_groups=GROUPS,
        rollouts_per_group=GROUP_SIZE,
        inference_interface=backend,
        streaming=True,
        max_staleness=setting.max_staleness,
        seed=seed,
        **options,
    )
    expected: dict[str, float] = {}

    def policy_length(problem_id: str) -> float:
        if problem_id not in expected:
            messages = backend.prepare_request(prompts[problem_id], request.generation_args).prompt
            completions, weights = backend.policy(messages)
            probs = np.asarray(weights, dtype=np.float64)
            lengths = np.array([len(c) for c in completions], dtype=np.float64)
            expected[problem_id] = float(lengths @ probs / probs.sum())
        return expected[problem_id]

    def generated_tokens() -> int:
        return sum(s.generation_tokens for s in backend.engine_statistics())

    receive = pause = 0.0
    max_age = 0
    delivered: list[int] = []
    policy: list[float] = []
    cuts: list[int] | None = None
    start = 0.0
    before: dict[str, int] = {}
    tokens_before = 0
    async with agent.get_grouped_rollouts(request) as stream:
        for step in range(warmup + steps):
            measuring = step >= warmup
            if step == warmup:
                start = trio.current_time()
                before = counters(stream.statistics())
                tokens_before = generated_tokens() if setting.engine else 0
            for _ in range(GROUPS):
                waited = trio.current_time()
                group = await stream.receive()
                age = stream.policy_epoch - group.start_epoch
                max_age = max(max_age, age)
                if not measuring:
                    continue
                receive += trio.current_time() - waited
                for rollout in group:
                    delivered.append(len(rollout.extra["completion"] or ""))
                    policy.append(policy_length(rollout.problem_id or ""))
                group_cuts = getattr(group, "cuts", None)
                if group_cuts is not None:
                    cuts = (cuts or []) + [cut_tokens(cut) for cut in group_cuts]
            if train_outside:
                await trio.sleep(TRAIN_SECONDS)  # training while the backend generates
            async with stream.weight_update("keep") as update:
                if not train_outside:
                    await trio.sleep(TRAIN_SECONDS)  # training and the push; nothing generates
            if measuring:
                pause += update.pause_seconds
        loop_seconds = trio.current_time() - start
        final = stream.statistics()
        after = counters(final)
        unaccounted = final.unaccounted
        tokens = generated_tokens() - tokens_before if setting.engine else None
    return Result(
        setting=setting,
        steps=steps,
        loop_seconds=loop_seconds,
        receive_seconds=receive,
        pause_seconds=pause,
        counters={name: after[name] - before[name] for name in after},
        max_age=max_age,
        delivered_lengths=delivered,
        policy_lengths=policy,
        cut_lengths=cuts,
        generated_tokens=tokens,
        unaccounted=unaccounted,
        run_started=final.started,
        run_delivered=final.delivered,
        wall_seconds=0.0,
    )


def measure(setting: Setting, warmup: int, steps: int, seed: int, train_outside: bool) -> Result:
    wall = time.perf_counter()
    result = trio.run(
        run_loop,
        setting,
        make_backend(setting.engine),
        warmup,
        steps,
        seed,
        train_outside,
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    result = attrs.evolve(result, wall_seconds=time.perf_counter() - wall)
    progress(
        f"  K={setting.max_staleness} P={setting.parallel} extra={setting.extra}"
        f"{' group calls' if setting.group_calls else ''}"
        f"{' engine' if setting.engine else ''} seed {seed}: idle {result.idle:.2f}, thrown "
        f"{result.thrown:.2f}, max age {result.max_age}, {result.loop_seconds:.1f} virtual s; "
        f"wall {result.wall_seconds:.1f} s"
    )
    return result


# ----------------------------------------------------------------------------- the tables


def markdown(header: list[str], rows: list[list[str]], left: int = 3) -> list[str]:
    """A markdown table: the first ``left`` columns aligned left, the others right."""
    align = "|" + "|".join("---" if i < left else "---:" for i in range(len(header))) + "|"
    lines = ["| " + " | ".join(header) + " |", align]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def spread(value: float, values: Sequence[float]) -> str:
    """``value`` and, over several runs, the range of ``values``."""
    if len(values) < 2:
        return f"{value:.2f}"
    return f"{value:.2f} ({min(values):.2f}-{max(values):.2f})"


def table(settings: list[list[Result]], engine: bool, train_outside: bool) -> list[str]:
    results = [pooled(runs) for runs in settings]
    has_cut = any("cut" in r.counters for r in results)
    has_wasted = any("wasted_tokens" in r.counters for r in results)
    has_cut_lengths = any(r.cut_lengths is not None for r in results)
    header = ["max_staleness", "parallel_generation_tasks", "calls", "extra_rollouts"]
    header += ["trainer idle", "in receive", "pause ms/update"]
    header += ["calls thrown", "member calls thrown", "run: 1 - delivered/started"]
    if engine:
        header.append("tokens thrown")
    elif not train_outside:
        header.append("issue: idle, thrown")
    header += ["max age", "delivered len", "policy len", "bias", "s/step"]
    if has_cut:
        header.append("cut / group")
    if has_wasted:
        header.append("wasted tokens")
    if has_cut_lengths:
        header.append("mean cut len")
    rows = []
    for runs, r in zip(settings, results, strict=True):
        s = r.setting
        calls = "group" if s.group_calls else "member"
        row = [str(s.max_staleness), str(s.parallel), calls, str(s.extra)]
        row += [
            spread(r.idle, [run.idle for run in runs]),
            f"{r.receive_seconds / r.loop_seconds:.2f}",
            f"{r.pause_seconds / r.steps * 1e3:.0f}",
            spread(r.thrown, [run.thrown for run in runs]),
            f"{r.member_thrown:.2f}",
            f"{r.run_thrown:.2f}",
        ]
        if engine:
            thrown = r.tokens_thrown
            row.append("-" if thrown is None else f"{thrown:.2f}")
        elif not train_outside:
            issue = ISSUE.get((s.max_staleness, s.parallel)) if s.group_calls else None
            row.append("-" if issue is None else f"{issue[0]:.2f}, {issue[1]:.2f}")
        row += [
            str(r.max_age),
            f"{r.delivered_mean:.1f}",
            f"{r.policy_mean:.1f}",
            f"{r.delivered_mean / r.policy_mean - 1:+.1%}",
            f"{r.loop_seconds / r.steps:.2f}",
        ]
        delivered_groups = r.counters["delivered"]
        if has_cut:
            row.append(f"{r.counters.get('cut', 0) / delivered_groups:.2f}")
        if has_wasted:
            total = sum(r.delivered_lengths)
            row.append(f"{r.counters.get('wasted_tokens', 0) / total:.2f}" if total else "-")
        if has_cut_lengths:
            lengths = r.cut_lengths
            row.append(f"{np.mean(lengths):.1f}" if lengths else "-")
        rows.append(row)
    return markdown(header, rows, left=4)


def settings(engine: bool) -> list[Setting]:
    # Group calls (the default; admission alone), member calls (admission and cuts),
    # member calls with extras.
    kinds = [(True, 0), (False, 0)] + ([(False, EXTRA)] if has_extra_rollouts() else [])
    return [
        Setting(max_staleness=k, parallel=p, extra=extra, engine=engine, group_calls=group)
        for group, extra in kinds
        for k, p in SETTINGS
    ]


def check(settings: list[list[Result]]) -> list[str]:
    """What broke: a delivered group older than its bound, or a ledger that does not add up."""
    failures = []
    for r in [run for runs in settings for run in runs]:
        s = r.setting
        where = (
            f"K={s.max_staleness} P={s.parallel} extra={s.extra}"
            f"{' group calls' if s.group_calls else ''}{' (engine)' if s.engine else ''}"
        )
        if r.max_age > s.max_staleness:
            failures.append(
                f"{where}: a delivered group was {r.max_age} updates old, above the bound "
                f"{s.max_staleness}"
            )
        if r.unaccounted:
            failures.append(f"{where}: statistics().unaccounted is {r.unaccounted}, not 0")
    return failures


def features() -> list[str]:
    """The long-tail names of the contract that the library has now."""
    statistics = attrs.fields_dict(tr.RolloutStreamStatistics)
    present = (
        ("GroupedRolloutRequest.extra_rollouts", has_extra_rollouts()),
        ("statistics().cut", "cut" in statistics),
        ("statistics().wasted_tokens", "wasted_tokens" in statistics),
        ("RolloutGroup.cuts", "cuts" in attrs.fields_dict(tr.RolloutGroup)),
    )
    return [name for name, here in present if here]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    parser.add_argument("--steps", type=int, help="measured steps (default 40; 8 --quick)")
    parser.add_argument("--warmup", type=int, help="warm-up steps (default 5; 2 --quick)")
    parser.add_argument(
        "--engine-steps", type=int, help="measured steps on the engine (default 20; 4 --quick)"
    )
    parser.add_argument("--no-engine", action="store_true", help="skip the engine table")
    parser.add_argument("--seed", type=int, default=RUN_SEED, help="the first run seed")
    parser.add_argument(
        "--seeds",
        type=int,
        help="runs per setting, run seeds seed, seed+1, ... (default 3; 1 --quick)",
    )
    parser.add_argument(
        "--train-outside",
        action="store_true",
        help="train before the update block (generation goes on) and leave its body empty",
    )
    options = parser.parse_args()
    steps = options.steps or (8 if options.quick else 40)
    warmup = options.warmup if options.warmup is not None else (2 if options.quick else 5)
    engine_steps = options.engine_steps or (4 if options.quick else 20)
    seeds = options.seeds or (1 if options.quick else 3)
    if steps < 1 or warmup < 0 or engine_steps < 1 or seeds < 1:
        parser.error("--steps, --engine-steps and --seeds must be >= 1, --warmup >= 0")
    run_seeds = [options.seed + i for i in range(seeds)]
    outside = options.train_outside
    for line in machine_lines(f"numpy {np.__version__}, embedded backend"):
        print(line)
    print(f"long-tail features present: {', '.join(features()) or 'none'}")
    print()
    loop = (
        f"{GROUPS} groups of {GROUP_SIZE} a step, then "
        + (
            f"{TRAIN_SECONDS} s of training and an empty keep update"
            if outside
            else f"a keep update whose body takes {TRAIN_SECONDS} s"
        )
        + f"; run seeds {', '.join(map(str, run_seeds))} (pooled); virtual time"
    )
    started = time.perf_counter()
    progress(f"latency model: {warmup} + {steps} steps per setting")
    results = [
        [measure(s, warmup, steps, seed, outside) for seed in run_seeds]
        for s in settings(engine=False)
    ]
    print(
        f"Latency model ({LATENCY.first_token} s + {LATENCY.per_token} s/token, lognormal "
        f"speed sigma {LATENCY.sigma}), HashedPromptPolicy; {loop}; {steps} steps measured "
        f"after {warmup}"
    )
    print()
    for line in table(results, engine=False, train_outside=outside):
        print(line)
    print()
    failures = check(results)
    if not options.no_engine:
        progress(f"engine model: {warmup} + {engine_steps} steps per setting")
        engine = [
            [measure(s, warmup, engine_steps, seed, outside) for seed in run_seeds]
            for s in settings(engine=True)
        ]
        model = EngineModel()
        print(
            f"Engine model: {REPLICAS} replicas of the default EngineModel() (max_num_seqs "
            f"{model.max_num_seqs}), routing group; completions lognormal, median "
            f"{MEDIAN_LENGTH} ids, sigma {SIGMA}, cap {MAX_LENGTH}; {loop}; {engine_steps} "
            f"steps measured after {warmup}"
        )
        print()
        for line in table(engine, engine=True, train_outside=outside):
            print(line)
        print()
        failures += check(engine)
    for failure in failures:
        print(f"FAILED: {failure}")
    progress(f"total wall time {time.perf_counter() - started:.1f} s")
    sys.stdout.flush()
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
