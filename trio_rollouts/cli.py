"""The ``trio-rollouts`` command line: ``demo``, ``generate``, ``eval`` and ``eval-merge``.

Each command builds the library's objects (an agent, an inference interface, a request),
runs them in one ``trio.run``, shows progress with rich on stderr and a summary table on
stdout. Errors a user can fix (a missing file, a bad row, an unreachable server) end the
command with one line, ``Error: ...``, and exit code 1; a bad flag is click's usage error
(exit code 2); Ctrl-C cancels everything in flight and exits with 130. Set
``TRIO_ROLLOUTS_TRACEBACK=1`` to get the traceback of an error instead. The prompt file
format is documented in :mod:`trio_rollouts._prompt_file`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, ParamSpec, TypeVar

import attrs
import click
import numpy as np
import stamina
import trio
import trio.testing
from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from stamina.instrumentation import RetryDetails, RetryHook

from . import __version__
from ._convert import structure, unstructure
from ._demo import DemoConfig, DemoResult, StepMetrics, run_demo
from ._evaluation import (
    PassAtKEvaluationAgent,
    PassAtKEvaluationResponse,
    Problem,
    merge_evaluation_responses,
    shard_indices,
)
from ._models import EvaluationRequest, EvaluationResponse, GenerationArgs, GroupedRolloutRequest
from ._prompt_file import (
    PromptFileError,
    load_problems,
    scan_output,
    truncate_torn_line,
    write_groups,
)
from ._reward_only import REWARD_FUNCTIONS, RewardOnlyAgent
from .inference import (
    DEFAULT_TIMEOUT,
    EmbeddedInference,
    InferenceError,
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    OpenAIInference,
)

__all__ = ["main"]

#: The exit code of a command stopped by Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130

#: The format tag of ``eval`` output files.
EVAL_FORMAT = "trio-rollouts.eval/1"

P = ParamSpec("P")
T = TypeVar("T")


# --------------------------------------------------------------------------- plumbing


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def _one_line(exc: BaseException) -> str:
    """An exception as one line: its message and notes, whitespace collapsed. A group
    of several failures (several groups failed at once) shows the first of them."""
    notes = list(getattr(exc, "__notes__", ()))
    if isinstance(exc, BaseExceptionGroup):
        leaves = _leaves(exc)
        first = leaves[0]
        text = _describe(first)
        if len(leaves) > 1:
            text += f" (and {len(leaves) - 1} more errors)"
        notes = [*getattr(first, "__notes__", ()), *notes]
    else:
        text = _describe(exc)
    return "; ".join(" ".join(part.split()) for part in [text, *notes])


#: Errors whose messages are written for users; others also show their type.
_USER_ERRORS = (ValueError, TypeError, OSError, RuntimeError, InferenceError)


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, _USER_ERRORS):
        return text
    return f"{type(exc).__name__}: {text} (set TRIO_ROLLOUTS_TRACEBACK=1 for the traceback)"


def _holds_interrupt(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return any(_holds_interrupt(e) for e in exc.exceptions)
    return isinstance(exc, KeyboardInterrupt)


def _run(
    async_fn: Callable[..., Awaitable[T]], *args: Any, clock: trio.abc.Clock | None = None
) -> T:
    """``trio.run`` that turns a Ctrl-C, however Trio delivered it (in an exception
    group when it hit a task other than the main one), into one ``KeyboardInterrupt``."""
    try:
        return trio.run(async_fn, *args, clock=clock)
    except BaseExceptionGroup as group:
        if _holds_interrupt(group):
            raise KeyboardInterrupt from None
        raise


def _interrupted(message: str = "Interrupted.") -> click.exceptions.Exit:
    """Say ``message`` and return the exit that Ctrl-C ends a command with."""
    click.echo(message, err=True)
    return click.exceptions.Exit(EXIT_INTERRUPTED)


def _reports_errors(command: Callable[P, T]) -> Callable[P, T]:
    """Turn what a command raises into the CLI's exit codes: Ctrl-C exits with 130,
    an error with one ``Error: ...`` line and 1 (``TRIO_ROLLOUTS_TRACEBACK=1`` re-raises
    it instead)."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt:
            raise _interrupted() from None
        except (click.ClickException, click.exceptions.Exit):
            raise
        except Exception as exc:
            if os.environ.get("TRIO_ROLLOUTS_TRACEBACK"):
                raise
            raise click.ClickException(_one_line(exc)) from exc

    return wrapper


def _stderr() -> Console:
    # Made per command, so the console writes to the streams click (or a test) set up.
    return Console(stderr=True, highlight=False)


def _end_live(console: Console) -> None:
    # A live display ends its last line only on a terminal.
    if not console.is_terminal:
        console.line()


def _stdout() -> Console:
    return Console(highlight=False)


def _generation_args(
    temperature: float | None, top_p: float | None, max_tokens: int | None
) -> GenerationArgs:
    return GenerationArgs(temperature=temperature, top_p=top_p, max_tokens=max_tokens)


def _openai_interface(
    base_url: Sequence[str],
    model: str,
    api_key: str | None,
    endpoint: str,
    max_connections: int,
    timeout: float | None,
    max_retries: int,
) -> OpenAIInference:
    try:
        return OpenAIInference(
            base_url=list(base_url),
            model=model,
            api_key=api_key,
            endpoint=endpoint,  # type: ignore[arg-type]  # click.Choice checked it
            max_connections=max_connections,
            timeout=timeout if timeout is not None else DEFAULT_TIMEOUT,
            max_retries=max_retries,
        )
    except (TypeError, ValueError) as exc:
        raise click.BadParameter(_one_line(exc), param_hint="'--base-url'") from None


def _load(prompts: Path, reward: str | None, num_prompts: int | None) -> list[Problem]:
    """The first ``num_prompts`` problems of a prompt file, checked against the reward."""
    problems = load_problems(prompts, need_answer=reward is not None)
    if num_prompts is not None:
        problems = problems[:num_prompts]
    if reward is not None:
        score = REWARD_FUNCTIONS[reward]
        for problem in problems:
            try:
                score(problem, "")
            except ValueError as exc:
                msg = f"{prompts}: problem {problem.problem_id!r}: {_one_line(exc)}"
                raise PromptFileError(msg) from None
    return problems


# Options shared by the commands that talk to a server.
def _server_options(command: Callable[P, T]) -> Callable[P, T]:
    options = [
        click.option(
            "--base-url",
            multiple=True,
            metavar="URL",
            help="API root of an OpenAI-compatible server, '/v1' included "
            "(repeat for replicas of one model).",
        ),
        click.option("--model", metavar="NAME", help="The served model's name."),
        click.option(
            "--api-key",
            metavar="KEY",
            default=None,
            help="Bearer token [default: $OPENAI_API_KEY, else none].",
        ),
        click.option(
            "--endpoint",
            type=click.Choice(["chat", "completions"]),
            default="chat",
            show_default=True,
            help="/chat/completions, or /completions with a plain-text rendering of the chat.",
        ),
        click.option(
            "--timeout",
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            metavar="SECONDS",
            help="Per attempt of a request [default: 5 s to connect, 600 s to read].",
        ),
        click.option(
            "--max-retries",
            type=click.IntRange(min=0),
            default=3,
            show_default=True,
            help="Retries of a request on connection errors, timeouts, 408/409/429/5xx.",
        ),
        click.option("--temperature", type=click.FloatRange(min=0), default=None),
        click.option("--top-p", type=click.FloatRange(min=0, min_open=True, max=1), default=None),
        click.option("--max-tokens", type=click.IntRange(min=1), default=None),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _reward_option(default: str) -> Callable[[Callable[P, T]], Callable[P, T]]:
    return click.option(
        "--reward",
        type=click.Choice(sorted(REWARD_FUNCTIONS)),
        default=default,
        show_default=True,
        help="How a completion scores against the row's answer: exact-match (whole "
        "completion, stripped), contains (answer occurs in it), last-number (its last "
        "number equals the answer).",
    )


# --------------------------------------------------------------------------- the group


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="trio-rollouts")
def main() -> None:
    """Generate and evaluate grouped RL rollouts with trio_rollouts.

    Exit codes: 0 done, 1 error, 2 bad usage, 130 interrupted (Ctrl-C).
    """


# --------------------------------------------------------------------------- demo


class _DemoDisplay:
    """The demo's live view: a progress bar with the latest step's metrics, and a row
    of the learning curve every ``log_every`` steps."""

    def __init__(self, console: Console, steps: int, log_every: int, clock: str) -> None:
        self.console = console
        self.log_every = log_every
        self.unit = "sim s" if clock == "virtual" else "s"
        self.progress = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[latest]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self.task = self.progress.add_task("steps", total=steps, latest="")
        self.live = Live(Group(self.progress), console=console, refresh_per_second=8)

    def on_start(self, initial_accuracy: float) -> None:
        self.console.print("step    reward  accuracy  groups/s  filtered  staleness (max)")
        self.console.print(f"   0         -  {initial_accuracy:8.3f}")

    def on_step(self, m: StepMetrics) -> None:
        self.progress.update(
            self.task,
            advance=1,
            latest=f"reward {m.mean_reward:.3f}  accuracy {m.accuracy:.3f}",
        )
        if m.step % self.log_every == 0 or m.step == self.progress.tasks[0].total:
            speed = m.groups_per_second
            rate = f"{speed:8.1f}" if math.isfinite(speed) else "     inf"
            self.console.print(
                f"{m.step:4d}    {m.mean_reward:6.3f}  {m.accuracy:8.3f}  {rate}  "
                f"{m.filtered:8d}  {m.staleness_mean:5.2f} ({m.staleness_max})"
            )


def _demo_summary(result: DemoResult, wall: float, clock: str) -> Table:
    steps = result.steps
    last = steps[-1]
    clock_seconds = result.elapsed
    table = Table(title="trio-rollouts demo: summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("accuracy", f"{result.initial_accuracy:.3f} -> {result.final_accuracy:.3f}")
    table.add_row("mean reward (last step)", f"{last.mean_reward:.3f}")
    table.add_row("steps (policy epochs)", f"{len(steps)}")
    table.add_row("groups / rollouts trained on", f"{result.groups} / {result.rollouts}")
    table.add_row("filtered groups (regenerated)", f"{result.filtered}")
    table.add_row(
        "staleness mean / max",
        f"{np.mean([m.staleness_mean for m in steps]):.2f} / "
        f"{max(m.staleness_max for m in steps)} policy epochs",
    )
    table.add_row("rollouts spanning an update", f"{sum(m.mixed_epoch for m in steps)}")
    kind = "simulated" if clock == "virtual" else "real"
    rate = result.groups / clock_seconds if clock_seconds > 0 else math.inf
    table.add_row("throughput", f"{rate:.1f} groups/s ({kind} clock)")
    table.add_row("time", f"{clock_seconds:.1f} s {kind}, {wall:.1f} s wall")
    table.add_row("seed", f"{result.config.seed}")
    return table


def _require_matplotlib() -> Any:
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        msg = (
            "--plot needs matplotlib, which is not installed; "
            "install it with: pip install 'trio-rollouts[plot]'"
        )
        raise click.ClickException(msg) from None
    return matplotlib


def _plot(matplotlib: Any, result: DemoResult, path: Path) -> None:
    matplotlib.use("Agg")
    pyplot = importlib.import_module("matplotlib.pyplot")
    steps = [0, *(m.step for m in result.steps)]
    figure, axes = pyplot.subplots(figsize=(7, 4))
    axes.plot(steps[1:], [m.mean_reward for m in result.steps], label="mean reward (groups kept)")
    axes.plot(
        steps, [result.initial_accuracy, *(m.accuracy for m in result.steps)], label="accuracy"
    )
    axes.set_xlabel("training step")
    axes.set_ylim(0.0, 1.02)
    axes.set_title(f"trio-rollouts demo (seed {result.config.seed})")
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)


@main.command()
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=36, show_default=True)
@click.option(
    "--groups",
    "groups_per_step",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Groups per training step (one batch).",
)
@click.option(
    "--group-size",
    type=click.IntRange(min=2),
    default=8,
    show_default=True,
    help="Rollouts per group.",
)
@click.option(
    "--lag",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Batches generated while the trainer works; a rollout is at most this many updates old.",
)
@click.option(
    "--problems", "num_problems", type=click.IntRange(min=1), default=32, show_default=True
)
@click.option(
    "--lr",
    "learning_rate",
    type=click.FloatRange(min=0, min_open=True),
    default=2.0,
    show_default=True,
)
@click.option(
    "--filter/--no-filter",
    "filter_groups",
    default=True,
    show_default=True,
    help="Drop and regenerate groups whose rewards are all equal (no GRPO signal).",
)
@click.option(
    "--clock",
    type=click.Choice(["virtual", "real"]),
    default="virtual",
    show_default=True,
    help="virtual: simulated latency costs no real time and a seed fixes every number; "
    "real: generation waits for real (about 15 s), results vary slightly run to run.",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write every group the trainer took to this JSON-lines file.",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Draw reward and accuracy per step to this image (needs matplotlib).",
)
@_reports_errors
def demo(
    seed: int,
    steps: int,
    groups_per_step: int,
    group_size: int,
    lag: int,
    num_problems: int,
    learning_rate: float,
    filter_groups: bool,
    clock: str,
    out: Path | None,
    plot: Path | None,
) -> None:
    """Train a tiny policy on arithmetic with asynchronous GRPO (no server, no GPU).

    The policy is a numpy table of logits over candidate answers per problem, served by
    the embedded inference backend; rollouts stream from the grouped pipeline with
    bounded lag while the trainer computes GRPO advantages, takes a policy-gradient
    step and publishes a new policy epoch. Accuracy is the policy's expected accuracy
    over all problems; it starts near chance (1/8).
    """
    matplotlib = _require_matplotlib() if plot is not None else None
    if groups_per_step * lag > num_problems:
        msg = (
            f"--groups x --lag ({groups_per_step * lag}) exceeds --problems ({num_problems}): "
            "groups generated at the same time would share problems; raise --problems"
        )
        raise click.UsageError(msg)
    config = DemoConfig(
        seed=seed,
        steps=steps,
        groups_per_step=groups_per_step,
        group_size=group_size,
        lag=lag,
        num_problems=num_problems,
        learning_rate=learning_rate,
        filter_groups=filter_groups,
    )
    console = _stderr()
    display = _DemoDisplay(console, steps, max(1, steps // 12), clock)
    out_file: IO[str] | None = None
    start = time.perf_counter()
    try:
        if out is not None:
            out_file = open(out, "w", encoding="utf-8")  # noqa: SIM115 - closed below
        with display.live:
            result = _run(
                _demo_main,
                config,
                display,
                out_file,
                clock=trio.testing.MockClock(autojump_threshold=0) if clock == "virtual" else None,
            )
    finally:
        if out_file is not None:
            out_file.close()
        _end_live(console)
    wall = time.perf_counter() - start
    _stdout().print(_demo_summary(result, wall, clock))
    if out is not None:
        click.echo(f"wrote {result.groups} groups to {out}", err=True)
    if plot is not None:
        _plot(matplotlib, result, plot)
        click.echo(f"wrote the learning curve to {plot}", err=True)


async def _demo_main(config: DemoConfig, display: _DemoDisplay, out: IO[str] | None) -> DemoResult:
    return await run_demo(config, on_start=display.on_start, on_step=display.on_step, out=out)


# --------------------------------------------------------------------------- generate


@attrs.define(kw_only=True)
class _PromptListAgent(RewardOnlyAgent):
    """One group per problem of a list, in list order, scored by a named reward
    function. A call after the last problem waits until the pipeline is shut down."""

    problems: list[Problem]
    reward_fn: Callable[[Problem, str], float]
    _next: int = attrs.field(default=0, init=False)

    async def get_prompt(self, request: GroupedRolloutRequest) -> Problem:
        """The next problem; after the last, wait (until cancelled)."""
        if self._next >= len(self.problems):
            await trio.sleep_forever()
        problem = self.problems[self._next]
        self._next += 1
        return problem

    async def get_reward(self, problem: Problem, response: InferenceResponse) -> float:
        """The reward function of the completion's text. Not a checkpoint."""
        return self.reward_fn(problem, response.response.content)


@attrs.define(kw_only=True)
class _GenerateTally:
    """What a generate job has done so far."""

    retries: int = 0
    written: int = 0
    filtered: int = 0
    rollouts: int = 0
    reward_sum: float = 0.0
    mixed_groups: int = 0


async def _generate_main(
    agent: _PromptListAgent,
    request: GroupedRolloutRequest,
    out: IO[str],
    filter_same_reward: bool,
    tally: _GenerateTally,
    progress: Progress,
    task: TaskID,
) -> None:
    async with agent.get_grouped_rollouts(request) as stream:
        for _ in range(len(agent.problems)):
            group = await stream.receive()
            rewards = group.rewards()
            same = float(rewards.std()) <= 1e-6
            if filter_same_reward and same:
                tally.filtered += 1
            else:
                write_groups(out, [group])
                tally.written += 1
                tally.rollouts += len(group)
                tally.reward_sum += float(rewards.sum())
                tally.mixed_groups += not same
            progress.update(task, advance=1, detail=_tally_line(tally))


def _tally_line(tally: _GenerateTally) -> str:
    mean = f"{tally.reward_sum / tally.rollouts:.3f}" if tally.rollouts else "-"
    retries = f"  retries {tally.retries}" if tally.retries else ""
    return f"filtered {tally.filtered}  mean reward {mean}{retries}"


@contextlib.contextmanager
def _counting_retries(on_retry: RetryHook) -> Iterator[None]:
    """Report the inference layer's retries to ``on_retry`` instead of stamina's log
    lines (which would tear through the progress display)."""
    previous = stamina.instrumentation.get_on_retry_hooks()
    stamina.instrumentation.set_on_retry_hooks([on_retry])
    try:
        yield
    finally:
        stamina.instrumentation.set_on_retry_hooks(previous)


@main.command()
@_server_options
@click.option(
    "--prompts",
    type=click.Path(exists=True, dir_okay=False, readable=True, path_type=Path),
    required=True,
    help="JSON lines: {'problem_id', 'prompt' (string or chat messages), 'answer'}.",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Output: one rollout group per line (JSON lines).",
)
@click.option(
    "--group-size",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Completions (rollouts) per prompt.",
)
@_reward_option("exact-match")
@click.option(
    "--filter-same-reward",
    is_flag=True,
    help="Do not write groups whose rollouts all got the same reward (no GRPO signal); "
    "--resume tries their prompts again.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Groups generated at once (each sends --group-size requests).",
)
@click.option(
    "--num-prompts",
    type=click.IntRange(min=1),
    default=None,
    help="Use the first N prompts of the file [default: all].",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Append to --out, skipping problem ids it already holds.",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing --out.")
@click.option(
    "--env-id",
    default=None,
    help="env_id stamped on the rollouts [default: the prompt file's name].",
)
@_reports_errors
def generate(
    base_url: tuple[str, ...],
    model: str | None,
    api_key: str | None,
    endpoint: str,
    timeout: float | None,
    max_retries: int,
    temperature: float | None,
    top_p: float | None,
    max_tokens: int | None,
    prompts: Path,
    out: Path,
    group_size: int,
    reward: str,
    filter_same_reward: bool,
    concurrency: int,
    num_prompts: int | None,
    resume: bool,
    overwrite: bool,
    env_id: str | None,
) -> None:
    """Grouped rollouts from an OpenAI-compatible server to a JSON-lines file.

    Every prompt gets --group-size completions, each scored by --reward against the
    row's answer; each group is one line of --out, written whole as soon as it is done,
    so Ctrl-C (exit code 130) leaves only complete lines and --resume continues the job.
    """
    if not base_url:
        raise click.UsageError("Missing option '--base-url'.")
    if model is None:
        raise click.UsageError("Missing option '--model'.")
    if resume and overwrite:
        raise click.UsageError("--resume and --overwrite exclude each other.")
    if filter_same_reward and group_size < 2:
        raise click.UsageError("--filter-same-reward needs --group-size >= 2.")
    problems = _load(prompts, reward, num_prompts)
    stderr = _stderr()
    skipped = 0
    if out.exists() and out.stat().st_size > 0:
        if not (resume or overwrite):
            msg = f"{out} exists; pass --resume to continue that job or --overwrite to replace it"
            raise click.ClickException(msg)
        if resume:
            state = scan_output(out)
            if state.torn_bytes:
                click.echo(
                    f"{out}: removed a torn last line ({state.torn_bytes} bytes, an "
                    "interrupted write); its problem will be generated again",
                    err=True,
                )
            truncate_torn_line(out, state)
            todo = [p for p in problems if p.problem_id not in state.problem_ids]
            skipped = len(problems) - len(todo)
            click.echo(
                f"resuming: {skipped} of {len(problems)} problems are done in {out}", err=True
            )
            problems = todo
    interface = _openai_interface(
        base_url,
        model,
        api_key,
        endpoint,
        max_connections=max(1, min(concurrency, len(problems)) * group_size),
        timeout=timeout,
        max_retries=max_retries,
    )
    tally = _GenerateTally()
    start = time.perf_counter()
    mode = "a" if resume else "w"
    with open(out, mode, encoding="utf-8") as file:
        if problems:
            agent = _PromptListAgent(
                problems=problems,
                reward_fn=REWARD_FUNCTIONS[reward],
                env_id=env_id if env_id is not None else prompts.stem,
                parallel_generation_tasks=min(concurrency, len(problems)),
                buffer_size=min(concurrency, len(problems)),
            )
            request = GroupedRolloutRequest(
                num_groups=1,
                rollouts_per_group=group_size,
                inference_interface=interface,
                streaming=True,
                generation_args=_generation_args(temperature, top_p, max_tokens),
            )
            progress = Progress(
                TextColumn("[bold]generating"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[detail]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=stderr,
            )
            task = progress.add_task("groups", total=len(problems), detail="")

            def on_retry(details: RetryDetails) -> None:
                tally.retries += 1
                progress.update(task, detail=_tally_line(tally))

            try:
                with progress, _counting_retries(on_retry):
                    _run(
                        _generate_main,
                        agent,
                        request,
                        file,
                        filter_same_reward,
                        tally,
                        progress,
                        task,
                    )
            except KeyboardInterrupt:
                done = skipped + tally.written
                raise _interrupted(
                    f"Interrupted: {out} holds {done} complete groups; run the same "
                    "command with --resume to continue."
                ) from None
            except Exception as exc:
                exc.add_note(
                    f"{out} holds {skipped + tally.written} complete groups; "
                    "--resume continues the job"
                )
                raise
            finally:
                _end_live(stderr)
    elapsed = time.perf_counter() - start
    table = Table(title="trio-rollouts generate: summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("prompts", f"{len(problems) + skipped} ({skipped} already done)")
    table.add_row("groups written", f"{tally.written} ({tally.rollouts} rollouts)")
    table.add_row("groups filtered", f"{tally.filtered}")
    table.add_row("retried requests", f"{tally.retries}")
    mean = f"{tally.reward_sum / tally.rollouts:.3f}" if tally.rollouts else "-"
    table.add_row("mean reward", mean)
    table.add_row("groups with mixed rewards", f"{tally.mixed_groups}")
    rate = (tally.written + tally.filtered) / elapsed if elapsed > 0 else math.inf
    table.add_row("time", f"{elapsed:.1f} s ({rate:.1f} groups/s)")
    table.add_row("output", str(out))
    _stdout().print(table)


# --------------------------------------------------------------------------- eval


@attrs.define(kw_only=True, eq=False)
class _CountingInterface(InferenceInterface):
    """Delegates to ``inner`` and calls ``on_done`` after every completed request."""

    inner: InferenceInterface
    on_done: Callable[[], None]

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        """``inner.agenerate(request)``. Cancellation: as the inner interface's."""
        response = await self.inner.agenerate(request)
        self.on_done()
        return response

    async def aclose(self) -> None:
        """Closes the inner interface. Cancellation: as the inner interface's."""
        await self.inner.aclose()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _metrics_table(title: str, metrics: dict[str, float]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left", min_width=len(title))
    table.add_column(style="bold")
    table.add_column(justify="right")
    for name, value in metrics.items():
        table.add_row(name, f"{int(value)}" if name == "num_prompts" else f"{value:.4f}")
    return table


def _write_json(path: Path, data: object) -> None:
    text = json.dumps(data, ensure_ascii=False, indent=1) + "\n"
    # Written to a temporary file and renamed, so a reader never sees half a result.
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)


async def _eval_main(
    agent: PassAtKEvaluationAgent, request: EvaluationRequest
) -> PassAtKEvaluationResponse:
    return await agent.run_evaluation(request)


@main.command(name="eval")
@_server_options
@click.option(
    "--embedded",
    is_flag=True,
    help="Use the embedded simulated backend (no server; canned answers) instead of "
    "--base-url/--model.",
)
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Seed of the embedded backend.",
)
@click.option(
    "--prompts",
    type=click.Path(exists=True, dir_okay=False, readable=True, path_type=Path),
    required=True,
    help="JSON lines: {'problem_id', 'prompt' (string or chat messages), 'answer'}.",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Result file (JSON); merge the ranks' files with eval-merge.",
)
@_reward_option("exact-match")
@click.option(
    "-n",
    "--samples",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Sampled completions per prompt.",
)
@click.option(
    "-k",
    type=click.IntRange(min=1),
    default=None,
    help="Report pass@1 .. pass@k [default: --samples].",
)
@click.option(
    "--greedy/--no-greedy",
    default=True,
    show_default=True,
    help="Also generate one completion at temperature 0 (greedy accuracy).",
)
@click.option(
    "--num-prompts",
    type=click.IntRange(min=0),
    default=None,
    help="Evaluate the first N prompts of the file [default: all].",
)
@click.option("--rank", type=click.IntRange(min=0), default=0, show_default=True)
@click.option(
    "--world",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Number of ranks; this rank evaluates its contiguous share of the prompts.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Requests in flight at once.",
)
@_reports_errors
def eval_command(
    base_url: tuple[str, ...],
    model: str | None,
    api_key: str | None,
    endpoint: str,
    timeout: float | None,
    max_retries: int,
    temperature: float | None,
    top_p: float | None,
    max_tokens: int | None,
    embedded: bool,
    seed: int,
    prompts: Path,
    out: Path,
    reward: str,
    samples: int,
    k: int | None,
    greedy: bool,
    num_prompts: int | None,
    rank: int,
    world: int,
    concurrency: int,
) -> None:
    """pass@k of a prompt file, against a server or the embedded backend.

    With --rank/--world, this process evaluates its share of the prompts; run every
    rank, then 'trio-rollouts eval-merge' their result files to get exactly the result
    of one unsharded run.
    """
    if embedded == bool(base_url):
        raise click.UsageError("Give either --embedded or --base-url (with --model).")
    if base_url and model is None:
        raise click.UsageError("Missing option '--model'.")
    if rank >= world:
        raise click.BadParameter(f"{rank} is not below --world {world}", param_hint="'--rank'")
    k = samples if k is None else k
    if k > samples:
        raise click.BadParameter(f"{k} exceeds --samples {samples}", param_hint="'-k'")
    problems = _load(prompts, reward, None)
    count = len(problems) if num_prompts is None else min(num_prompts, len(problems))
    settings: dict[str, Any] = {
        "reward": reward,
        "samples": samples,
        "k": k,
        "greedy": greedy,
        "temperature": temperature,
        "top_p": top_p,
        "max_tokens": max_tokens,
    }
    inner: InferenceInterface
    if embedded:
        inner = EmbeddedInference(seed=seed)
        settings.update(backend="embedded", seed=seed)
    else:
        inner = _openai_interface(
            base_url, str(model), api_key, endpoint, concurrency, timeout, max_retries
        )
        settings.update(backend="openai", base_url=list(base_url), model=model, endpoint=endpoint)
    shard = shard_indices(count, (rank, world))
    stderr = _stderr()
    progress = Progress(
        TextColumn("[bold]evaluating"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=stderr,
    )
    task = progress.add_task("requests", total=len(shard) * (samples + greedy))
    interface = _CountingInterface(inner=inner, on_done=lambda: progress.advance(task))
    retries: list[RetryDetails] = []

    def on_retry(details: RetryDetails) -> None:
        retries.append(details)

    agent = PassAtKEvaluationAgent(
        problems=problems[:count],
        reward_fn=REWARD_FUNCTIONS[reward],
        n=samples,
        k=k,
        greedy=greedy,
        max_concurrent_requests=concurrency,
        env_id=prompts.stem,
    )
    request = EvaluationRequest(
        inference_interface=interface,
        num_prompts=count,
        rank_info=(rank, world),
        generation_args=_generation_args(temperature, top_p, max_tokens),
    )
    try:
        with progress, _counting_retries(on_retry):
            # The embedded backend's latency is simulated: a virtual clock skips it.
            clock = trio.testing.MockClock(autojump_threshold=0) if embedded else None
            response = _run(_eval_main, agent, request, clock=clock)
    finally:
        _end_live(stderr)
    if retries:
        click.echo(f"{len(retries)} requests were retried", err=True)
    metrics = response.metrics()
    _write_json(
        out,
        {
            "format": EVAL_FORMAT,
            "rank": rank,
            "world_size": world,
            "num_prompts": count,
            "prompts_sha256": _sha256(prompts),
            "settings": settings,
            "metrics": metrics,
            "response": unstructure(response),
        },
    )
    title = "trio-rollouts eval"
    if world > 1:
        share = f"prompts {shard.start}..{shard.stop - 1}" if shard else "no prompts"
        title = f"trio-rollouts eval: rank {rank} of {world}, {share}"
    _stdout().print(_metrics_table(title, metrics))
    click.echo(f"wrote {out}", err=True)


# --------------------------------------------------------------------------- eval-merge


def _read_eval(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        msg = f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})"
        raise click.ClickException(msg) from None
    if not isinstance(data, dict) or data.get("format") != EVAL_FORMAT:
        msg = f"{path}: not a result file of 'trio-rollouts eval' (no format {EVAL_FORMAT!r})"
        raise click.ClickException(msg)
    return data


@main.command(name="eval-merge")
@click.argument(
    "shards",
    nargs=-1,
    required=True,
    type=click.Path(exists=True, dir_okay=False, readable=True, path_type=Path),
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the merged result here (the format of an unsharded 'eval').",
)
@_reports_errors
def eval_merge(shards: tuple[Path, ...], out: Path | None) -> None:
    """Merge the result files of every rank of one sharded 'eval' run.

    The files may come in any order; together they must hold each rank of the run once,
    with the same prompts and settings. The merged result is exactly what one unsharded
    run writes.
    """
    files = [(path, _read_eval(path)) for path in shards]
    first_path, first = files[0]
    for path, data in files[1:]:
        for key in ("world_size", "num_prompts", "prompts_sha256", "settings"):
            if data.get(key) != first.get(key):
                msg = (
                    f"{path} and {first_path} disagree on {key} ({data.get(key)!r:.60} vs "
                    f"{first.get(key)!r:.60}); merge the ranks of one run"
                )
                raise click.ClickException(msg)
    world = first["world_size"]
    by_rank: dict[int, Path] = {}
    for path, data in files:
        rank = data["rank"]
        if rank in by_rank:
            msg = f"{path} and {by_rank[rank]} are both rank {rank}"
            raise click.ClickException(msg)
        by_rank[rank] = path
    missing = sorted(set(range(world)) - set(by_rank))
    if missing:
        msg = f"missing rank(s) {', '.join(map(str, missing))} of --world {world}"
        raise click.ClickException(msg)
    ordered = sorted(files, key=lambda item: int(item[1]["rank"]))
    responses = [structure(data["response"], EvaluationResponse) for _, data in ordered]
    merged = merge_evaluation_responses(responses)
    metrics = merged.metrics()
    result = {
        **first,
        "rank": 0,
        "world_size": 1,
        "metrics": metrics,
        "response": unstructure(merged),
    }
    _stdout().print(_metrics_table(f"trio-rollouts eval-merge: {world} ranks", metrics))
    if out is not None:
        _write_json(out, result)
        click.echo(f"wrote {out}", err=True)


if __name__ == "__main__":
    main()
