"""Placement on the engine model: how routing spreads GRPO groups over simulated replicas.

Usage: python benchmarks/placement.py [--quick] [--groups N] [--episodes N] [--no-multiturn]

Everything runs in virtual time (``trio.run(..., clock=MockClock(autojump_threshold=0))``)
on ``EmbeddedInference(engine=EngineModel(), replicas=4, routing=...)``: the figures are
simulated time and engine counters, the same on any machine (wall time, on stderr, only
says what the run cost: about 80 s on 2 cores, 30 s with ``--quick``). The workload:

- A ``RewardOnlyAgent`` streams groups of 8 (``streaming=True``, ``num_groups=1``,
  ``parallel_generation_tasks=32``: 256 requests in flight over 4 replicas) with a run
  seed (``GroupedRolloutRequest(seed=...)``: every member's sample is fixed) until the
  consumer has taken ``--groups`` groups (default 256; 64 with ``--quick``); the engine's
  statistics and the virtual time are read at that moment. The ``PromptSource`` holds
  twice as many problems, so none is drawn twice.
- Each prompt is a 256-character prefix shared by every problem and a 256-character
  question of its own; the engine sees ``render_plain_chat`` of it (536 ids: 1 id = 1
  character).
- A policy (:class:`LognormalPolicy`) offers 8 equally likely completions per prompt whose
  lengths are lognormal (median 100 ids, sigma 1, capped at 1,024), drawn from a
  generator seeded by a hash of the prompt: heavy-tailed, reproducible outputs.

One row per setting: ``routing`` in ``group``, ``least_loaded``, ``round_robin`` with
``group_calls=False`` (each member is its own call: the case where routing decides
whether the siblings share a prefix cache), then ``group`` and ``least_loaded`` with
``group_calls=True`` (one ``agenerate_group(request, 8)`` call per group: the siblings
always land together). The columns:

- ``prefill ids``: ids computed in prefill, summed over the replicas
  (``EngineStatistics.prefill_tokens``; recomputation after a preemption included);
- ``prefix hit rate``: prompt ids served from the prefix cache / prompt ids admitted;
- ``groups/s``: groups taken / virtual seconds;
- ``busy max/min``: the busiest replica's ``busy_seconds`` over the idlest's. A replica
  steps whenever it holds a request, so under this load it reads about 1.00 whatever the
  routing: it says no replica sat idle, not that the work was even;
- ``generated max/min``: the same for ``generation_tokens``: how evenly the decoding work
  was spread;
- ``preemptions``: requests preempted (their KV cache dropped), over all replicas;
- ``placed alike``: each setting runs twice with the same seeds; ``yes`` when the
  per-replica statistics and the virtual time of the two runs are equal and so is the
  sequence of placement decisions ``(group, episode, replica)`` (recorded through a
  ``Placement`` subclass put in ``trio_rollouts.inference.embedded._backend``, a private hook:
  when the library moves it, only the statistics are compared). The ways two runs
  differ are printed under the table.

The goal, checked (exit status 1 when missed): with member calls, ``group`` computes at
least 50% fewer prefill ids than ``least_loaded``, with at least its groups/s, and a
busy max/min of at most 1.5.

A second table (skip it with ``--no-multiturn``): ``MultiTurnAgent`` with
``PlainRenderer`` and an environment that answers each turn with a short tool message,
3 turns per episode, groups of 8 episodes, 16 groups at once, until ``--episodes`` groups
are taken (default 48; 16 with ``--quick``); same prompts and policy. Each turn resends
the whole context, so an episode that stays on its replica finds its earlier turns
cached. Rows: the three routings with ``group_calls=False`` (every turn is the episode's
own call), ``group`` with ``routing_margin=8``, and ``group`` with ``group_calls=True``
(the default: the episodes' first turns as one group call).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import time
from collections.abc import Hashable, Sequence
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
    EngineStatistics,
    InferenceResponse,
    render_plain_chat,
)
from trio_rollouts.inference.embedded import _backend as _embedded

REPLICAS: Final = 4
GROUP_SIZE: Final = 8
PARALLEL: Final = 32
MULTITURN_PARALLEL: Final = 16
TURNS: Final = 3
PREFIX_CHARS: Final = 256
QUESTION_CHARS: Final = 256
CANDIDATES: Final = 8
MEDIAN_LENGTH: Final = 100
SIGMA: Final = 1.0
MAX_LENGTH: Final = 1024
RUN_SEED: Final = 1234
BACKEND_SEED: Final = 7
#: What the multi-turn environment answers each turn.
REPLY: Final = "tool: 3 results found"
#: The goal: group routing (member calls) against least_loaded (member calls).
GOAL_PREFILL_SAVING: Final = 0.5
GOAL_BUSY_RATIO: Final = 1.5


# ----------------------------------------------------------------------------- the work


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def _text(seed: int, length: int) -> str:
    """``length`` characters of lowercase words, fixed by ``seed``."""
    rng = np.random.default_rng(seed)
    letters = rng.integers(ord("a"), ord("z") + 1, size=length)
    spaces = rng.random(length) < 0.18
    return "".join(
        " " if space else chr(letter) for letter, space in zip(letters, spaces, strict=True)
    )


PREFIX: Final = ("Solve the problem below. " + _text(1, PREFIX_CHARS))[:PREFIX_CHARS]


def make_problems(count: int) -> list[tr.Problem]:
    """``count`` problems: the shared prefix and a distinct question each."""
    problems = []
    for i in range(count):
        question = (f"Question {i}: " + _text(1000 + i, QUESTION_CHARS))[:QUESTION_CHARS]
        problems.append(tr.Problem(problem_id=f"q{i}", prompt=PREFIX + question, answer="0"))
    return problems


@attrs.frozen
class LognormalPolicy:
    """``CANDIDATES`` equally likely completions per prompt, their lengths lognormal
    (median ``MEDIAN_LENGTH``, ``SIGMA``, at most ``MAX_LENGTH``), fixed by a hash of the
    prompt's plain rendering."""

    median: float = MEDIAN_LENGTH
    sigma: float = SIGMA
    cap: int = MAX_LENGTH

    def __call__(self, prompt: list[tr.ChatMessage]) -> tuple[Sequence[str], list[float]]:
        rng = np.random.default_rng(_digest(render_plain_chat(prompt)))
        lengths = np.minimum(
            np.maximum(1, np.rint(rng.lognormal(math.log(self.median), self.sigma, CANDIDATES))),
            self.cap,
        )
        completions = [
            (f"{k}" + "answer " * (int(n) // 7 + 1))[: int(n)] for k, n in enumerate(lengths)
        ]
        return completions, [1.0] * CANDIDATES


@attrs.define(kw_only=True)
class LengthParityAgent(tr.RewardOnlyAgent):
    """Draws problems from its ``PromptSource``; a completion scores its length's parity
    (the reward is beside the point here)."""

    async def get_reward(self, problem: tr.Problem, response: InferenceResponse) -> float:
        return float(len(response.response.content or "") % 2)


class ReplyEnvironment(tr.BaseEnvironment):
    """Starts with the problem's prompt, answers every turn with ``REPLY``, done after
    ``TURNS`` turns (reward: the last answer's length's parity)."""

    def __init__(self, problem: tr.Problem) -> None:
        super().__init__()
        assert isinstance(problem.prompt, str)
        self.messages = [tr.ChatMessage(role="user", content=problem.prompt)]
        self.taken = 0

    async def reset(self) -> list[tr.ChatMessage]:
        return self.messages

    async def step(self, turn: tr.AssistantTurn) -> tr.EnvironmentStep:
        self.taken += 1
        done = self.taken >= TURNS
        return tr.EnvironmentStep(
            messages=(tr.ChatMessage(role="tool", content=REPLY),),
            done=done,
            reward=float(len(turn.content) % 2) if done else None,
        )


# ----------------------------------------------------------------------------- recording


Decision = tuple[Hashable, int | None, int]


def recording_hook() -> tuple[Any, list[list[Decision]]] | None:
    """A ``Placement`` subclass that records each decision, and the list it appends each
    run's decisions to, when the library's private placement hook is where this script
    expects it (``trio_rollouts.inference.embedded._backend.Placement``); ``None`` otherwise."""
    try:
        from trio_rollouts.inference._placement import Placement
    except ImportError:
        return None
    if getattr(_embedded, "Placement", None) is not Placement:
        return None
    runs: list[list[Decision]] = []

    class RecordingPlacement(Placement):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.decisions: list[Decision] = []
            runs.append(self.decisions)

        def pick(
            self, load: Sequence[int], group: Hashable | None = None, episode: int | None = None
        ) -> int:
            index: int = super().pick(load, group, episode)
            self.decisions.append((group, episode, index))
            return index

    return RecordingPlacement, runs


@attrs.frozen
class Setting:
    routing: str
    group_calls: bool
    multiturn: bool = False
    #: ``routing_margin`` (``None``: the default).
    margin: int | None = None

    @property
    def label(self) -> str:
        calls = "group call" if self.group_calls else "member calls"
        margin = "" if self.margin is None else f", margin {self.margin}"
        return f"{'multi-turn ' if self.multiturn else ''}{self.routing}, {calls}{margin}"


@attrs.frozen
class Result:
    statistics: tuple[EngineStatistics, ...]
    virtual_seconds: float
    groups: int
    wall_seconds: float
    decisions: tuple[Decision, ...] | None

    @property
    def prefill(self) -> int:
        return sum(s.prefill_tokens for s in self.statistics)

    @property
    def hit_rate(self) -> float:
        prompt = sum(s.prompt_tokens for s in self.statistics)
        return sum(s.prefix_cache_hits for s in self.statistics) / prompt if prompt else 0.0

    @property
    def groups_per_second(self) -> float:
        return self.groups / self.virtual_seconds

    @property
    def busy_ratio(self) -> float:
        busy = [s.busy_seconds for s in self.statistics]
        return max(busy) / min(busy) if min(busy) > 0 else math.inf

    @property
    def generated_ratio(self) -> float:
        generated = [s.generation_tokens for s in self.statistics]
        return max(generated) / min(generated) if min(generated) > 0 else math.inf

    @property
    def preemptions(self) -> int:
        return sum(s.preemptions for s in self.statistics)

    def comparable(self) -> tuple[Any, ...]:
        """What two runs of one setting must share to have placed alike."""
        return (self.statistics, self.virtual_seconds)


def make_backend(setting: Setting) -> EmbeddedInference:
    options: dict[str, Any] = {}
    if setting.margin is not None:
        options["routing_margin"] = setting.margin
    return EmbeddedInference(
        seed=BACKEND_SEED,
        policy=LognormalPolicy(),
        engine=EngineModel(),
        replicas=REPLICAS,
        routing=setting.routing,  # type: ignore[arg-type]
        **options,
    )


async def run_workload(
    setting: Setting, backend: EmbeddedInference, groups: int
) -> tuple[tuple[EngineStatistics, ...], float]:
    """Stream groups until ``groups`` are taken; each replica's statistics and the virtual
    time at that moment (the calls still in flight are then cancelled)."""
    # Twice as many problems as groups taken: none is drawn twice (a repeat would find
    # its whole prompt cached), whatever is in flight when the last group is taken.
    source = tr.PromptSource(make_problems(2 * groups), seed=RUN_SEED)
    agent: tr.GroupedRolloutGenerator
    if setting.multiturn:
        agent = tr.MultiTurnAgent(
            environment=ReplyEnvironment,
            renderer=tr.PlainRenderer(),
            max_turns=TURNS,
            env_id="placement",
            prompts=source,
            parallel_generation_tasks=MULTITURN_PARALLEL,
        )
    else:
        agent = LengthParityAgent(
            prompts=source, parallel_generation_tasks=PARALLEL, env_id="placement"
        )
    request = tr.GroupedRolloutRequest(
        num_groups=1,
        rollouts_per_group=GROUP_SIZE,
        inference_interface=backend,
        streaming=True,
        seed=RUN_SEED,
        group_calls=setting.group_calls,
    )
    start = trio.current_time()
    taken = 0
    async with agent.get_grouped_rollouts(request) as stream:
        async for group in stream:
            assert len(group) == GROUP_SIZE
            taken += 1
            if taken == groups:
                break
    # Read before leaving would count the same: nothing runs between the last take and
    # here but the cancellation of the calls in flight, which computes nothing.
    return backend.engine_statistics(), trio.current_time() - start


def measure(setting: Setting, groups: int, hook: tuple[Any, list[list[Decision]]] | None) -> Result:
    """One run of ``setting`` in a fresh Trio run on a mock clock, with a fresh backend."""
    backend = make_backend(setting)
    before = None
    if hook is not None:
        before = getattr(_embedded, "Placement")  # noqa: B009 - not exported, on purpose
        setattr(_embedded, "Placement", hook[0])  # noqa: B010
    wall = time.perf_counter()
    try:
        statistics, seconds = trio.run(
            run_workload,
            setting,
            backend,
            groups,
            clock=trio.testing.MockClock(autojump_threshold=0),
        )
    finally:
        if before is not None:
            setattr(_embedded, "Placement", before)  # noqa: B010
    wall = time.perf_counter() - wall
    decisions = None
    if hook is not None and hook[1]:
        decisions = tuple(hook[1].pop())
        hook[1].clear()
    return Result(statistics, seconds, groups, wall, decisions)


def placed_alike(first: Result, second: Result) -> str:
    same = first.comparable() == second.comparable()
    if first.decisions is not None and second.decisions is not None:
        same = same and first.decisions == second.decisions
    return "yes" if same else "NO"


def difference(first: Result, second: Result) -> str:
    """Where two runs of a setting differ, in short."""
    notes = []
    fields = sorted(
        {
            field.name
            for a, b in zip(first.statistics, second.statistics, strict=True)
            for field in attrs.fields(EngineStatistics)
            if getattr(a, field.name) != getattr(b, field.name)
        }
    )
    if fields:
        notes.append(
            f"prefill ids {first.prefill:,} vs {second.prefill:,} (per replica: "
            f"{', '.join(fields)} differ)"
        )
    if first.virtual_seconds != second.virtual_seconds:
        notes.append(f"{first.virtual_seconds:.6f} vs {second.virtual_seconds:.6f} virtual s")
    if (
        first.decisions is not None
        and second.decisions is not None
        and first.decisions != second.decisions
    ):
        pairs = zip(first.decisions, second.decisions, strict=False)
        at = next(
            (i for i, (x, y) in enumerate(pairs) if x != y),
            min(len(first.decisions), len(second.decisions)),
        )
        notes.append(
            f"placement decisions differ from #{at} on (of {len(first.decisions):,} "
            f"and {len(second.decisions):,})"
        )
    return "; ".join(notes)


# ----------------------------------------------------------------------------- the tables


def markdown(header: list[str], rows: list[list[str]], left: int = 2) -> list[str]:
    """A markdown table: the first ``left`` columns aligned left, the others right."""
    align = "|" + "|".join("---" if i < left else "---:" for i in range(len(header))) + "|"
    lines = ["| " + " | ".join(header) + " |", align]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def run_settings(
    settings: list[Setting], groups: int, hook: tuple[Any, list[list[Decision]]] | None
) -> dict[Setting, tuple[Result, Result]]:
    results = {}
    for setting in settings:
        first = measure(setting, groups, hook)
        second = measure(setting, groups, hook)
        progress(
            f"  {setting.label}: "
            f"{first.prefill:,} prefill ids, {first.groups_per_second:.2f} groups/s virtual; "
            f"wall {first.wall_seconds:.1f} s + {second.wall_seconds:.1f} s"
        )
        results[setting] = (first, second)
    return results


def table(results: dict[Setting, tuple[Result, Result]]) -> list[str]:
    header = [
        "routing",
        "calls",
        "prefill ids",
        "prefix hit rate",
        "groups/s",
        "busy max/min",
        "generated max/min",
        "preemptions",
        "placed alike",
    ]
    rows = []
    for setting, (first, second) in results.items():
        routing = setting.routing
        if setting.margin is not None:
            routing += f" (margin {setting.margin})"
        if setting.multiturn:
            calls = "1st turn per group" if setting.group_calls else "1 per turn"
        else:
            calls = "1 per group" if setting.group_calls else "1 per member"
        rows.append(
            [
                routing,
                calls,
                f"{first.prefill:,}",
                f"{first.hit_rate:.1%}",
                f"{first.groups_per_second:.2f}",
                f"{first.busy_ratio:.2f}",
                f"{first.generated_ratio:.2f}",
                f"{first.preemptions:,}",
                placed_alike(first, second),
            ]
        )
    return markdown(header, rows)


def check_goal(results: dict[Setting, tuple[Result, Result]]) -> tuple[bool, str]:
    group = results[Setting("group", group_calls=False)][0]
    least = results[Setting("least_loaded", group_calls=False)][0]
    saving = 1 - group.prefill / least.prefill
    parts = [
        (
            saving >= GOAL_PREFILL_SAVING,
            f"prefill {saving:.1%} fewer ids than least_loaded (goal >= {GOAL_PREFILL_SAVING:.0%})",
        ),
        (
            group.groups_per_second >= least.groups_per_second,
            f"{group.groups_per_second:.2f} groups/s against {least.groups_per_second:.2f} "
            "(goal: at least as many)",
        ),
        (
            group.busy_ratio <= GOAL_BUSY_RATIO,
            f"busy max/min {group.busy_ratio:.2f} (goal <= {GOAL_BUSY_RATIO})",
        ),
    ]
    met = all(ok for ok, _ in parts)
    text = "; ".join(f"{what} [{'met' if ok else 'MISSED'}]" for ok, what in parts)
    return met, f"goal ({'met' if met else 'NOT met'}), group routing with member calls: {text}"


SINGLE_TURN: Final = [
    Setting("group", group_calls=False),
    Setting("least_loaded", group_calls=False),
    Setting("round_robin", group_calls=False),
    Setting("group", group_calls=True),
    Setting("least_loaded", group_calls=True),
]
MULTI_TURN: Final = [
    Setting("group", group_calls=False, multiturn=True),
    Setting("least_loaded", group_calls=False, multiturn=True),
    Setting("round_robin", group_calls=False, multiturn=True),
    Setting("group", group_calls=False, multiturn=True, margin=8),
    Setting("group", group_calls=True, multiturn=True),
]


def print_differences(results: dict[Setting, tuple[Result, Result]]) -> None:
    for setting, (first, second) in results.items():
        if placed_alike(first, second) != "yes":
            print(f"- {setting.label}: the two seeded runs differ: {difference(first, second)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer groups (a smoke run)")
    parser.add_argument("--groups", type=int, help="single-turn groups (default 256; 64 --quick)")
    parser.add_argument(
        "--episodes", type=int, help="multi-turn groups of 8 episodes (default 48; 16 --quick)"
    )
    parser.add_argument("--no-multiturn", action="store_true", help="skip the multi-turn table")
    options = parser.parse_args()
    groups = options.groups or (64 if options.quick else 256)
    episodes = options.episodes or (16 if options.quick else 48)
    if groups < 1 or episodes < 1:
        parser.error("--groups and --episodes must be >= 1")
    for line in machine_lines(f"numpy {np.__version__}, embedded engine model"):
        print(line)
    print()
    hook = recording_hook()
    if hook is None:
        progress("the placement hook moved: 'placed alike' compares the statistics only")
    started = time.perf_counter()
    progress(f"single turn: {groups} groups of {GROUP_SIZE}, each setting run twice")
    results = run_settings(SINGLE_TURN, groups, hook)
    model = EngineModel()
    rendered = len(render_plain_chat([tr.ChatMessage(role="user", content="x" * 512)]))
    print(
        f"Single turn: {REPLICAS} replicas of the default EngineModel() (max_num_seqs "
        f"{model.max_num_seqs}, {model.max_num_batched_tokens} ids a step, {model.block_size}-id "
        f"blocks), {groups} groups of {GROUP_SIZE}, parallel_generation_tasks={PARALLEL}; "
        f"prompts of {PREFIX_CHARS} shared + {QUESTION_CHARS} own characters ({rendered} ids "
        f"rendered); completions lognormal, median {MEDIAN_LENGTH}, sigma {SIGMA}, cap "
        f"{MAX_LENGTH}; virtual time"
    )
    print()
    for line in table(results):
        print(line)
    print()
    print_differences(results)
    met, goal_line = check_goal(results)
    print(goal_line)
    print()
    if not options.no_multiturn:
        progress(f"multi-turn: {episodes} groups of {GROUP_SIZE} episodes, {TURNS} turns each")
        multi = run_settings(MULTI_TURN, episodes, hook)
        print(
            f"Multi-turn: {episodes} groups of {GROUP_SIZE} episodes of {TURNS} turns "
            f"(MultiTurnAgent, PlainRenderer), parallel_generation_tasks={MULTITURN_PARALLEL}; "
            "the same replicas, prompts and policy; virtual time"
        )
        print()
        for line in table(multi):
            print(line)
        print()
        print_differences(multi)
    progress(f"total wall time {time.perf_counter() - started:.1f} s")
    sys.stdout.flush()
    if not met:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
