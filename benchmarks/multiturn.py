"""Multi-turn episodes: the client's cost per turn of ``MultiTurnAgent``, beside a single-turn call.

Usage: python benchmarks/multiturn.py [--quick] [--repeats N] [--contexts 256,2048,8192]
       [--turns 1,4,8,32] [--calls N] [--profile PATH]
       python benchmarks/multiturn.py --vllm http://127.0.0.1:8013/v1 [--model NAME]
       [--tokenizer DIR] [--contexts 128] [--turns 1,4,8] [--max-tokens 8]

What is timed: the process's CPU time (``time.process_time``) and wall time from before
the first ``get_grouped_rollouts`` of a cell until after the last, divided by the number
of model calls (``agenerate``) made. Every cell runs ``--in-flight`` episodes at once
(``num_groups`` groups of ``rollouts_per_group`` rollouts, non-streaming, one batch per
stream, as many streams as it takes to make ``--calls`` calls).

The arms, for each initial context ``C`` (the ids of the first render):

- ``single``: a minimal ``GroupedRolloutGenerator`` that renders the problem once per
  group (``PlainRenderer``) and makes one ``agenerate`` per rollout from those
  ``prompt_ids``, then builds ``TokenRollout`` objects (``build_rollouts``, as
  ``RewardOnlyAgent`` does): one model call per rollout.
- ``multi T``: ``MultiTurnAgent`` with ``PlainRenderer`` and an environment whose
  ``reset`` returns the problem's prompt and whose ``step`` returns one short ``tool``
  message, ``done`` after ``T`` turns: ``T`` model calls per rollout. The context grows
  each turn by the sampled ids and the bridge, and each turn sends all of it
  (``prompt_ids``), so the mean context per call is printed beside each row.
- ``multi T +limits``: the same with ``environment_concurrency`` (larger than the
  episodes in flight: never waited for) and ``step_timeout=60`` (never reached): what
  the limiter and the cancel scope around each step cost when they are not needed.
- ``backend alone`` (embedded only): ``EmbeddedInference.agenerate`` called directly,
  by as many tasks at once, cycling through the very prompts one episode of the arm
  sends (requests built before timing). The embedded backend runs in this process, so
  every arm's CPU includes its own; ``client`` = the arm's CPU per call minus this, the
  library's and Trio's share, and ``client / single`` compares that per turn with a
  single-turn call at the same ``C``.

The embedded backend has zero latency (``LatencyModel(first_token=0, per_token=0)``) and
a policy with one fixed completion of ``--completion`` characters, so what is timed is
CPU: the library's, the backend's and Trio's. Ratios are to ``single`` at the same ``C``,
measured in the same run: each repeat measures every cell once (each backend-alone cell
next to the agent cells it serves), ratios and differences are formed within a repeat,
and the table shows their median over ``--repeats`` repeats; a cell's own figures are
its median, and the spread is (max - min) / median of its CPU per call.

With ``--vllm URL``: the same arms (no ``backend alone``) against a running vLLM server
through ``OpenAIInference`` (``AcceptsTokens``: token-id prompts on ``/v1/completions``),
with a renderer that is ``PlainRenderer``'s layout (the tiny test model's chat template
is that layout) encoded by the model's own tokenizer (``tokenizer.json``, read with
``tokenizers``), ``max_tokens`` small and ``ignore_eos`` so every turn samples the same
number of ids. The server runs in another process: the CPU column is the client's
alone; wall per call includes the server's work (on a shared CPU).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import json
import pstats
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio
from _report import Report, busy_cpu_seconds, machine_lines, progress

import trio_rollouts as tr
from trio_rollouts.envs import build_rollouts
from trio_rollouts.inference import (
    EmbeddedInference,
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    LatencyModel,
    OpenAIInference,
)

#: Rollouts per group, in every arm.
GROUP_SIZE = 8
#: What the environment answers each turn (one "tool" message).
REPLY = "ok: 3 results"
#: The embedded backend's one completion is this text, cut or repeated to the length.
COMPLETION_TEXT = "The answer is 42, as the tool said. "
#: Problems per cell (distinct prompts of the same length).
PROBLEMS = 16
ZERO_LATENCY = LatencyModel(first_token=0.0, per_token=0.0, distribution="constant")


# ----------------------------------------------------------------------------- the work


def completion(length: int) -> str:
    return (COMPLETION_TEXT * (length // len(COMPLETION_TEXT) + 1))[:length]


@attrs.frozen
class FixedPolicy:
    """The embedded backend's policy: one completion, probability 1."""

    text: str

    def __call__(self, prompt: list[tr.ChatMessage]) -> tuple[Sequence[str], list[float]]:
        return (self.text,), [1.0]


class ReplyEnvironment(tr.BaseEnvironment):
    """Starts with the problem's prompt; answers every turn with one short tool message
    and is done after ``turns`` turns (reward 1.0)."""

    def __init__(self, problem: tr.Problem, turns: int) -> None:
        super().__init__()
        prompt = problem.prompt
        self.messages = (
            [tr.ChatMessage(role="user", content=prompt)]
            if isinstance(prompt, str)
            else list(prompt)
        )
        self.turns = turns
        self.taken = 0

    async def reset(self) -> list[tr.ChatMessage]:
        return self.messages

    async def step(self, turn: tr.AssistantTurn) -> tr.EnvironmentStep:
        self.taken += 1
        done = self.taken >= self.turns
        return tr.EnvironmentStep(
            messages=(tr.ChatMessage(role="tool", content=REPLY),),
            done=done,
            reward=1.0 if done else None,
        )


@attrs.define(kw_only=True)
class SingleTurnAgent(tr.GroupedRolloutGenerator):
    """One model call per rollout from the problem's rendered ids: the single-turn
    baseline (``RewardOnlyAgent``'s shape, with ``prompt_ids`` as ``MultiTurnAgent``
    sends them)."""

    renderer: tr.Renderer

    async def group_rollout(
        self, request: tr.GroupedRolloutRequest
    ) -> list[tr.Rollout] | list[tr.TokenRollout]:
        assert self.prompts is not None
        problem = self.prompts.draw()
        assert isinstance(problem.prompt, str)
        messages = [tr.ChatMessage(role="user", content=problem.prompt)]
        interface = request.inference_interface
        inference_request = InferenceRequest(
            prompt=messages,
            generation_args=request.generation_args,
            prompt_ids=self.renderer.render(messages),
        )
        responses: list[InferenceResponse] = []

        async def one() -> None:
            responses.append(await interface.agenerate(inference_request))

        async with trio.open_nursery() as nursery:
            for _ in range(request.rollouts_per_group):
                nursery.start_soon(one)
        return build_rollouts(interface, problem, [(r, 0.0) for r in responses], "single")


def problems(context: int, renderer: tr.Renderer) -> list[tr.Problem]:
    """``PROBLEMS`` one-message problems whose render is ``context`` ids (or as close as
    the tokenizer allows: the renderer's template takes some of them)."""
    overhead = len(renderer.render([tr.ChatMessage(role="user", content="")]))
    words = "the quick brown fox jumps over the lazy dog and keeps running far away "
    result = []
    for i in range(PROBLEMS):
        head = f"problem {i}: "
        size = max(1, context - overhead - len(head))
        body = (words * (size // len(words) + 1))[:size]
        result.append(tr.Problem(problem_id=f"p{i}", prompt=head + body))
    return result


@attrs.frozen
class Arm:
    """One cell of the table: an agent at one context (``turns`` 0: single-turn), or,
    with ``floor``, the backend alone fed the prompts that agent's calls send."""

    name: str
    context: int
    turns: int
    limits: bool = False
    floor: bool = False

    def floor_arm(self) -> Arm:
        """The backend-alone cell with this arm's prompts (shared by single and T=1)."""
        turns = max(1, self.turns)
        return Arm(f"backend alone T={turns}", self.context, turns, floor=True)


def make_agent(
    arm: Arm, renderer: tr.Renderer, source: tr.PromptSource, groups: int
) -> tr.GroupedRolloutGenerator:
    options: dict[str, Any] = {
        "prompts": source,
        "parallel_generation_tasks": groups,
    }
    if arm.turns == 0:
        return SingleTurnAgent(renderer=renderer, **options)
    # Without limits unless the arm measures them (the agent's defaults bound steps and
    # episode length).
    extra: dict[str, Any] = {"step_timeout": None, "max_episode_tokens": None}
    if arm.limits:
        extra = {"environment_concurrency": 1_000_000, "step_timeout": 60.0}
    return tr.MultiTurnAgent(
        environment=functools.partial(ReplyEnvironment, turns=arm.turns),
        renderer=renderer,
        max_turns=arm.turns,
        env_id="multi",
        **extra,
        **options,
    )


@attrs.define
class Measured:
    calls: int
    context_ids: int  # summed over calls: the prompt ids each call sent
    cpu: float
    wall: float
    others: float | None  # cores other processes used meanwhile

    @property
    def cpu_us(self) -> float:
        return self.cpu / self.calls * 1e6

    @property
    def wall_us(self) -> float:
        return self.wall / self.calls * 1e6

    @property
    def mean_context(self) -> float:
        return self.context_ids / self.calls


async def timed(run: Callable[[], Awaitable[None]]) -> Measured:
    """Time ``run``; the caller fills in the calls it made and the ids they sent."""
    gc.collect()
    busy = busy_cpu_seconds()
    cpu = time.process_time()
    wall = time.perf_counter()
    await run()
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    busy_after = busy_cpu_seconds()
    others = None
    if busy is not None and busy_after is not None and wall > 0:
        others = max(0.0, (busy_after - busy - cpu) / wall)
    return Measured(0, 0, cpu, wall, others)


async def run_agent(
    arm: Arm,
    interface: InferenceInterface,
    renderer: tr.Renderer,
    args: tr.GenerationArgs,
    in_flight: int,
    calls: int,
) -> Measured:
    groups = max(1, in_flight // GROUP_SIZE)
    agent = make_agent(arm, renderer, tr.PromptSource(problems(arm.context, renderer)), groups)
    request = tr.GroupedRolloutRequest(
        num_groups=groups,
        rollouts_per_group=GROUP_SIZE,
        inference_interface=interface,
        generation_args=args,
    )
    per_stream = groups * GROUP_SIZE * max(1, arm.turns)
    streams = max(1, -(-calls // per_stream))

    groups_made: list[tr.RolloutGroup] = []

    async def run() -> None:
        for _ in range(streams):
            async with agent.get_grouped_rollouts(request) as stream:
                async for group in stream:
                    groups_made.append(group)

    measured = await timed(run)
    # Counted after the timed region: calls and ids sent, from the rollouts' masks.
    for group in groups_made:
        for rollout in group:
            assert isinstance(rollout, tr.TokenRollout)
            calls, sent = context_of(rollout)
            measured.calls += calls
            measured.context_ids += sent
    return measured


def context_of(rollout: tr.TokenRollout) -> tuple[int, int]:
    """The model calls a rollout took and the prompt ids they sent in all: each call's
    prompt is every id before the start of one run of sampled ids (mask 1)."""
    calls = 0
    sent = 0
    for mask in rollout.generation_mask:
        previous = False
        for index, sampled in enumerate(mask):
            if sampled and not previous:
                calls += 1
                sent += index
            previous = sampled
    return calls, sent


def episode_prompts(
    arm: Arm, renderer: tr.Renderer, sampled: list[int], reply: list[tr.ChatMessage]
) -> list[list[int]]:
    """The prompt ids of each call of one of ``arm``'s episodes (its first problem):
    the first render, then each turn's sampled ids and bridge appended."""
    prompt = problems(arm.context, renderer)[0].prompt
    assert isinstance(prompt, str)
    ids = renderer.render([tr.ChatMessage(role="user", content=prompt)])
    step = sampled + (renderer.bridge(ids + sampled, reply) or [])
    return [ids + step * turn for turn in range(max(1, arm.turns))]


async def run_backend(
    arm: Arm,
    interface: InferenceInterface,
    renderer: tr.Renderer,
    args: tr.GenerationArgs,
    in_flight: int,
    calls: int,
    sampled: list[int],
) -> Measured:
    """``interface.agenerate`` called directly by ``in_flight`` tasks, each cycling
    through the prompts of one episode of ``arm`` (requests built before timing)."""
    reply = [tr.ChatMessage(role="tool", content=REPLY)]
    requests = [
        InferenceRequest(prompt=[], generation_args=args, prompt_ids=ids)
        for ids in episode_prompts(arm, renderer, sampled, reply)
    ]
    each = max(1, -(-calls // (in_flight * len(requests)))) * len(requests)

    async def worker(offset: int) -> None:
        for i in range(each):
            await interface.agenerate(requests[(offset + i) % len(requests)])

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            for offset in range(in_flight):
                nursery.start_soon(worker, offset)

    measured = await timed(run)
    measured.calls = each * in_flight
    measured.context_ids = sum(len(r.prompt_ids or []) for r in requests) * (
        measured.calls // len(requests)
    )
    return measured


# ----------------------------------------------------------------------------- the vLLM arm


@attrs.frozen
class TokenizerRenderer(tr.PlainRenderer):
    """``PlainRenderer``'s layout, encoded by a model's tokenizer (``tokenizers``).
    Only for tokenizers that encode text piece by piece (byte-level without merges, as
    the tiny test model's), so that the bridge is the render's suffix."""

    tokenizer: Any
    eos: int

    @property
    def stop_token_ids(self) -> list[int]:
        return [self.eos]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))


def tokenizer_renderer(directory: Path) -> TokenizerRenderer:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    eos = tokenizer.token_to_id(config["eos_token"])
    renderer = TokenizerRenderer(tokenizer=tokenizer, eos=eos)
    probe = [tr.ChatMessage(role="user", content="héllo, wörld")]
    reply = [tr.ChatMessage(role="tool", content=REPLY)]
    whole = renderer.render([*probe, tr.ChatMessage(role="assistant", content="x"), *reply])
    head = renderer.render(probe) + renderer.encode("x")
    if head + (renderer.bridge(head, reply) or []) != whole:
        msg = f"{directory}'s tokenizer does not encode piece by piece: no exact bridge"
        raise SystemExit(msg)
    return renderer


# ----------------------------------------------------------------------------- the table


def arms(contexts: list[int], turns: list[int], floors: bool) -> list[Arm]:
    """The agent cells, each context's in a row, and (``floors``) after each context's
    agent cells the backend-alone cells they are compared with."""
    result: list[Arm] = []
    limits_turns = 8 if 8 in turns else max(turns)
    for context in contexts:
        cells = [Arm("single", context, 0)]
        for t in turns:
            cells.append(Arm(f"multi T={t}", context, t))
            if t == limits_turns:
                cells.append(Arm(f"multi T={t} +limits", context, t, limits=True))
        for arm in cells:
            # Each backend-alone cell just before the first agent cell it serves, so
            # that the two are measured close in time.
            if floors and arm.floor_arm() not in result:
                result.append(arm.floor_arm())
            result.append(arm)
    return result


def only(cells: list[Arm], names: str | None) -> list[Arm]:
    """The cells whose arm is named in ``names`` (comma-separated), and the single-turn
    baseline they are compared with; all of them when ``names`` is ``None``."""
    if names is None:
        return cells
    wanted = {name.strip() for name in names.split(",")} | {"single"}
    kept = [arm for arm in cells if arm.name in wanted]
    floors = {arm.floor_arm() for arm in kept}
    return [arm for arm in cells if arm in kept or arm in floors]


def fmt_spread(values: list[float]) -> str:
    middle = statistics.median(values)
    return f"{(max(values) - min(values)) / middle:.0%}" if middle else "n/a"


def per_repeat(values: list[float | None]) -> float | None:
    """The median of a figure formed within each repeat (from cells measured close in
    time); ``None`` values (undefined in that repeat) are left out."""
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def fmt_ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def report_table(
    report: Report, title: str, cells: list[Arm], raw: dict[Arm, list[Measured]]
) -> None:
    """One row per agent cell: its cost per call (median over repeats), and (when
    measured) the backend's alone on the same prompts and the difference, the client's
    cost. Ratios to ``single`` at the same context are formed within each repeat, then
    their median is shown."""
    floors = any(arm.floor for arm in cells)
    header = ["C", "arm", "ids sent/call", "CPU µs/call", "spread", "wall µs/call"]
    if floors:
        header += ["backend alone", "client µs/call", "client / single"]
    header += ["CPU / single", "wall / single"]
    rows = []
    agents = [arm for arm in cells if not arm.floor]
    for arm in agents:
        base = next(a for a in agents if a.context == arm.context and a.name == "single")
        results, singles = raw[arm], raw[base]
        row = [
            f"{arm.context:,}",
            arm.name,
            f"{statistics.median(m.mean_context for m in results):,.0f}",
            f"{statistics.median(m.cpu_us for m in results):,.1f}",
            fmt_spread([m.cpu_us for m in results]),
            f"{statistics.median(m.wall_us for m in results):,.1f}",
        ]
        if floors:
            floor, base_floor = raw[arm.floor_arm()], raw[base.floor_arm()]
            clients = [m.cpu_us - f.cpu_us for m, f in zip(results, floor, strict=True)]
            base_clients = [m.cpu_us - f.cpu_us for m, f in zip(singles, base_floor, strict=True)]
            ratios = [c / b if b > 0 else None for c, b in zip(clients, base_clients, strict=True)]
            row += [
                f"{statistics.median(m.cpu_us for m in floor):,.1f}",
                f"{statistics.median(clients):,.1f}",
                fmt_ratio(per_repeat(ratios)),
            ]
        pairs = list(zip(results, singles, strict=True))
        row += [
            fmt_ratio(per_repeat([m.cpu_us / b.cpu_us for m, b in pairs])),
            fmt_ratio(per_repeat([m.wall_us / b.wall_us for m, b in pairs])),
        ]
        rows.append(row)
    report.table(title, header, rows)


def print_raw(report: Report, cells: list[Arm], raw: dict[Arm, list[Measured]]) -> None:
    report.line("Raw: CPU µs/call per repeat (other load in cores)")
    for arm in cells:
        values = ", ".join(
            f"{m.cpu_us:.1f} ({'?' if m.others is None else f'{m.others:.2f}'})" for m in raw[arm]
        )
        report.line(f"  C={arm.context} {arm.name}: {values}  [{raw[arm][0].calls} calls]")
    report.line()


async def measure(
    cells: list[Arm],
    make_interface: Callable[[], InferenceInterface],
    renderer: tr.Renderer,
    args: tr.GenerationArgs,
    in_flight: int,
    calls: int,
    repeats: int,
    sampled: list[int],
) -> dict[Arm, list[Measured]]:
    raw: dict[Arm, list[Measured]] = {arm: [] for arm in cells}
    # One untimed pass to warm caches, imports and the connection pool.
    warm = Arm("warm-up", cells[0].context, 1)
    interface = make_interface()
    await run_agent(warm, interface, renderer, args, in_flight, in_flight)
    for repeat in range(repeats):
        for arm in cells:
            interface = make_interface()
            if arm.floor:
                result = await run_backend(
                    arm, interface, renderer, args, in_flight, calls, sampled
                )
            else:
                result = await run_agent(arm, interface, renderer, args, in_flight, calls)
            await interface.aclose()
            raw[arm].append(result)
            progress(
                f"  repeat {repeat + 1}/{repeats} C={arm.context} {arm.name}: "
                f"{result.cpu_us:.1f} µs CPU, {result.wall_us:.1f} µs wall per call "
                f"({result.calls} calls)"
            )
    return raw


def embedded(options: argparse.Namespace, report: Report) -> None:
    renderer = tr.PlainRenderer()
    text = completion(options.completion)
    cells = only(arms(options.contexts, options.turns, floors=True), options.only)

    def make_interface() -> InferenceInterface:
        return EmbeddedInference(policy=FixedPolicy(text), latency=ZERO_LATENCY)

    args = tr.GenerationArgs()
    if options.profile:
        arm = Arm("multi T=8", options.contexts[-1], 8)
        profiler = cProfile.Profile()
        profiler.enable()
        trio.run(run_agent, arm, make_interface(), renderer, args, options.in_flight, options.calls)
        profiler.disable()
        profiler.dump_stats(options.profile)
        stats = pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime")
        stats.print_stats(25)
        return
    raw = trio.run(
        measure,
        cells,
        make_interface,
        renderer,
        args,
        options.in_flight,
        options.calls,
        options.repeats,
        renderer.encode(text),
    )
    report_table(
        report,
        f"Embedded backend, zero latency: µs per model call, median of {options.repeats} "
        f"repeats; {options.in_flight} episodes in flight, groups of {GROUP_SIZE}, "
        f"completion {options.completion} ids, bridge "
        f"{len(renderer.bridge([], [tr.ChatMessage(role='tool', content=REPLY)]) or [])} ids",
        cells,
        raw,
    )
    print_raw(report, cells, raw)


def vllm(options: argparse.Namespace, report: Report) -> None:
    directory = Path(options.tokenizer or options.model)
    renderer = tokenizer_renderer(directory)
    cells = only(arms(options.contexts, options.turns, floors=False), options.only)
    longest = max(options.contexts) + max(options.turns) * (
        options.max_tokens
        + len(renderer.bridge([], [tr.ChatMessage(role="tool", content=REPLY)]) or [])
    )
    progress(f"longest episode: about {longest} ids")

    def make_interface() -> InferenceInterface:
        return OpenAIInference(options.vllm, options.model, extra_body={"ignore_eos": True})

    args = tr.GenerationArgs(max_tokens=options.max_tokens, temperature=1.0)
    raw = trio.run(
        measure,
        cells,
        make_interface,
        renderer,
        args,
        options.in_flight,
        options.calls,
        options.repeats,
        [],
    )
    report_table(
        report,
        f"vLLM ({options.vllm}): client µs per model call, median of {options.repeats} "
        f"repeats; {options.in_flight} episodes in flight, groups of {GROUP_SIZE}, "
        f"max_tokens={options.max_tokens} (ignore_eos)",
        cells,
        raw,
    )
    print_raw(report, cells, raw)


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls, one repeat")
    parser.add_argument("--repeats", type=int, help="repeats per cell (default 7; 1 --quick)")
    parser.add_argument("--calls", type=int, help="model calls per cell (at least)")
    parser.add_argument("--contexts", type=int_list, help="ids of the first render")
    parser.add_argument("--turns", type=int_list, help="turns per episode")
    parser.add_argument("--in-flight", type=int, help="episodes (rollouts) at once")
    parser.add_argument("--completion", type=int, default=16, help="embedded: ids per turn")
    parser.add_argument(
        "--only", help="these arms only, comma-separated (e.g. 'multi T=8'); with single"
    )
    parser.add_argument(
        "--profile", metavar="PATH", help="embedded: cProfile 'multi T=8' at the last --contexts"
    )
    parser.add_argument("--vllm", metavar="URL", help="a vLLM server's /v1 URL")
    parser.add_argument("--model", default="/work/tiny2", help="vLLM: the served model")
    parser.add_argument("--tokenizer", help="vLLM: the tokenizer's folder (default --model)")
    parser.add_argument("--max-tokens", type=int, default=8, help="vLLM: ids per turn")
    options = parser.parse_args()
    if options.repeats is None:
        options.repeats = 1 if options.quick else 7
    if options.vllm:
        options.contexts = options.contexts or [128]
        options.turns = options.turns or [1, 4, 8]
        options.in_flight = options.in_flight or 16
        options.calls = options.calls or (64 if options.quick else 256)
    else:
        options.contexts = options.contexts or ([256, 2048] if options.quick else [256, 2048, 8192])
        options.turns = options.turns or ([1, 8] if options.quick else [1, 4, 8, 32])
        options.in_flight = options.in_flight or 128
        options.calls = options.calls or (512 if options.quick else 1024)
    if options.repeats < 1 or options.calls < 1 or options.in_flight < GROUP_SIZE:
        parser.error(f"--repeats and --calls must be >= 1, --in-flight >= {GROUP_SIZE}")
    report = Report()
    versions = f"vLLM at {options.vllm}" if options.vllm else "embedded backend"
    for line in machine_lines(versions):
        report.line(line)
    report.line()
    if options.vllm:
        vllm(options, report)
    else:
        embedded(options, report)


if __name__ == "__main__":
    main()
