"""``trio-rollouts generate``: grouped rollouts from an OpenAI-compatible server to a
JSON-lines file, one scored group per prompt, written whole as each group finishes, and
resumable (``--resume``) after Ctrl-C, SIGTERM or a crash.

Each rollout keeps what the server returned beside the rendered trajectory, in keys that
``load_jsonl`` keeps in ``Rollout.extra``: ``completion``, ``finish_reason``, ``usage``,
and, for a text rollout, ``logprobs``. The schema is documented in ``docs/cli.md``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import click
import trio
from rich.table import Table
from stamina.instrumentation import RetryDetails

from trio_rollouts.agents._reward_only import REWARD_FUNCTIONS, RewardOnlyAgent
from trio_rollouts.cli._common import (
    Command,
    counting_retries,
    generation_args,
    interrupted,
    load_prompts,
    openai_interface,
    out_option,
    overwrite_option,
    refuse_existing_out,
    reports_errors,
    reward_option,
    run,
    server_options,
    sha256,
    stderr_console,
    stdout_console,
    unbounded_completions_note,
)
from trio_rollouts.cli._job import OutputFile, check_job, job_path, write_job
from trio_rollouts.cli._progress import RunProgress, rate_text
from trio_rollouts.inference import InferenceResponse
from trio_rollouts.models._problems import Problem
from trio_rollouts.models._requests import GroupedRolloutRequest
from trio_rollouts.models._rollouts import Rollout, RolloutGroup, TokenRollout
from trio_rollouts.prompts._file import scan_output, truncate_torn_line, write_groups
from trio_rollouts.prompts._source import PromptSource

__all__ = ["generate"]

#: After this many groups whose completions were all identical (and no other), warn
#: without waiting for the job's end.
IDENTICAL_WARNING_AFTER = 16


@attrs.define(kw_only=True)
class _PromptListAgent(RewardOnlyAgent):
    """One group per problem of its ``prompts`` (a one-pass, unshuffled
    :class:`PromptSource`: a failed call's problem is drawn again before the next),
    scored by a named reward function. A call after the last problem waits until the
    pipeline is shut down. Each rollout keeps the server's completion text, finish
    reason, usage and (text rollouts) logprobs in its ``extra``."""

    reward_fn: Callable[[Problem, str], float]

    async def get_prompt(self, request: GroupedRolloutRequest) -> Problem:
        """The next problem; after the last, wait (until cancelled)."""
        source = self.prompts
        if source is None:  # pragma: no cover - generate() always sets it
            msg = "_PromptListAgent needs prompts"
            raise TypeError(msg)
        if source.next_starts_an_epoch():
            await trio.sleep_forever()
        return source.draw()

    async def get_reward(self, problem: Problem, response: InferenceResponse) -> float:
        """The reward function of the completion's text. Not a checkpoint."""
        return self.reward_fn(problem, response.response.content)

    def annotate_rollout(
        self, rollout: Rollout | TokenRollout, response: InferenceResponse
    ) -> None:
        """Keep what the server returned that the rollout's fields and the extra keys of
        ``build_rollouts`` (completion, finish reason, usage) do not hold."""
        completion = response.response.content
        if isinstance(rollout, Rollout):
            # TokenRollout has logprobs and prompt_length (in tokens) of its own.
            rollout.extra["logprobs"] = response.logprobs
            raw = response.raw_text
            if rollout.prompt_length is None and raw is not None and raw.endswith(completion):
                # The prompt's share of the text trajectory, in characters.
                rollout.prompt_length = [len(raw) - len(completion)]


@attrs.define(kw_only=True)
class _GenerateTally:
    """What a generate job has done so far."""

    written: int = 0
    filtered: int = 0
    rollouts: int = 0
    reward_sum: float = 0.0
    mixed_groups: int = 0
    #: Groups of two or more rollouts seen, and how many had one completion text only.
    sampled_groups: int = 0
    identical_groups: int = 0
    #: Whether to warn when they all had: not when sampling was greedy (temperature 0).
    check_identical: bool = True
    warned_identical: bool = False

    def warn_identical(self) -> bool:
        """Whether to warn now that completions were identical in every group."""
        return (
            self.check_identical
            and not self.warned_identical
            and self.sampled_groups > 0
            and self.identical_groups == self.sampled_groups
        )


def _identical_warning(tally: _GenerateTally) -> str:
    return (
        f"warning: all completions were identical within each of the {tally.sampled_groups} "
        "groups so far; the server may be ignoring the sampling arguments (check "
        "--temperature, --top-p, --top-k and the server's generation config)"
    )


async def _generate_main(
    agent: _PromptListAgent,
    problems: list[Problem],
    request: GroupedRolloutRequest,
    out: OutputFile,
    filter_same_reward: bool,
    tally: _GenerateTally,
    progress: RunProgress,
) -> None:
    async with agent.get_grouped_rollouts(request) as stream:

        def calls() -> tuple[int, float]:
            statistics = stream.statistics()
            return statistics.in_flight, statistics.oldest_in_flight_s

        progress.watch(calls)
        for _ in range(len(problems)):
            group = await stream.receive()
            _count_identical(group, tally, progress)
            rewards = group.rewards()
            same = float(rewards.std()) <= 1e-6
            if filter_same_reward and same:
                tally.filtered += 1
            else:
                write_groups(out.file(), [group])
                tally.written += 1
                tally.rollouts += len(group)
                tally.reward_sum += float(rewards.sum())
                tally.mixed_groups += not same
            progress.advance(detail=_tally_line(tally))


def _count_identical(group: RolloutGroup, tally: _GenerateTally, progress: RunProgress) -> None:
    if len(group) < 2:
        return
    tally.sampled_groups += 1
    tally.identical_groups += len({r.extra.get("completion") for r in group}) == 1
    if tally.sampled_groups == IDENTICAL_WARNING_AFTER and tally.warn_identical():
        tally.warned_identical = True
        progress.console.print(_identical_warning(tally), markup=False, highlight=False)


def _tally_line(tally: _GenerateTally) -> str:
    mean = f"{tally.reward_sum / tally.rollouts:.3f}" if tally.rollouts else "-"
    return f"filtered {tally.filtered}, mean reward {mean}"


@click.command(
    cls=Command,
    equivalents={
        "-n": "group_size",
        "--samples": "group_size",
        "--num-samples": "group_size",
        "--n-samples": "group_size",
        "--rollouts-per-group": "group_size",
        "--max-new-tokens": "max_tokens",
    },
)
@server_options()
@click.option(
    "--prompts",
    type=click.Path(exists=True, dir_okay=False, readable=True, path_type=Path),
    required=True,
    help="JSON lines: {'problem_id', 'prompt' (string or chat messages), 'answer'}.",
)
@out_option("Output: one rollout group per line (JSON lines).", required=True)
@click.option(
    "--group-size",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Completions (rollouts) per prompt.",
)
@reward_option("exact-match")
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
    help="Append to --out, skipping problem ids it already holds; refused if --out was "
    "written with other settings (recorded in OUT.job.json).",
)
@overwrite_option
@click.option(
    "--env-id",
    default=None,
    help="env_id stamped on the rollouts [default: the prompt file's name].",
)
@click.option(
    "--server",
    type=click.Choice(["vllm", "sglang"]),
    default=None,
    help="The server's kind: 'vllm' uses vLLM's native /inference/v1/generate where the "
    "server serves it (--enable-scale-out), which stamps the policy version of every token "
    "[default: any OpenAI-compatible server].",
)
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=None,
    help="The run's seed: every request gets a seed of its own derived from it (problem, "
    "member), so a rerun or --resume sends the same seeds [default: no seed].",
)
@click.option(
    "--sampling-check",
    type=click.Choice(["warn", "raise", "off"]),
    default="warn",
    show_default=True,
    help="When the sampling flags and the server's logprobs give biased importance ratios "
    "(raw logprobs with --temperature other than 1; --top-p/--top-k without a sampling "
    "mask): warn, fail before any request, or say nothing.",
)
@reports_errors
def generate(
    base_url: tuple[str, ...],
    model: str,
    api_key: str | None,
    endpoint: str,
    timeout: float | None,
    max_retries: int,
    token_ids: bool | None,
    logprobs: bool | None,
    extra_body: dict[str, Any] | None,
    temperature: float | None,
    top_k: int | None,
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
    server: str | None,
    seed: int | None,
    sampling_check: str,
) -> None:
    """Grouped rollouts from an OpenAI-compatible server to a JSON-lines file.

    Every prompt gets --group-size completions, each scored by --reward against the
    row's answer; each group is one line of --out, written whole as soon as it is done,
    so Ctrl-C (exit code 130) or SIGTERM (143) leaves only complete lines and --resume
    continues the job.
    """
    if resume and overwrite:
        raise click.UsageError("--resume and --overwrite exclude each other.")
    if filter_same_reward and group_size < 2:
        raise click.UsageError("--filter-same-reward needs --group-size >= 2.")
    problems = load_prompts(prompts, reward, num_prompts)
    env = env_id if env_id is not None else prompts.stem
    args = generation_args(temperature, top_k, top_p, max_tokens)
    job = {
        "prompts_sha256": sha256(prompts),
        "model": model,
        "endpoint": endpoint,
        "group_size": group_size,
        "reward": reward,
        "filter_same_reward": filter_same_reward,
        "env_id": env,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "max_tokens": max_tokens,
        "extra_body": extra_body,
        "token_ids": token_ids,
        "logprobs": logprobs,
        "seed": seed,
    }
    stderr = stderr_console()
    skipped = 0
    continuing = resume and out.exists() and out.stat().st_size > 0
    if not (resume or overwrite):
        refuse_existing_out(out, resumable=True)
    if continuing:
        check_job(out, "generate", job)
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
        click.echo(f"resuming: {skipped} of {len(problems)} problems are done in {out}", err=True)
        problems = todo
    interface = openai_interface(
        base_url,
        model,
        api_key,
        endpoint,
        max_connections=max(1, min(concurrency, len(problems)) * group_size),
        timeout=timeout,
        max_retries=max_retries,
        token_ids=token_ids,
        logprobs=logprobs,
        extra_body=extra_body,
        server=server,
    )
    tally = _GenerateTally(check_identical=temperature != 0)
    note = unbounded_completions_note(max_tokens, timeout)
    if note is not None and problems:
        click.echo(note, err=True)
    # Created with its job record at the first group written: a run that fails before
    # that leaves nothing behind (and an --overwrite'n file as it was).
    output = OutputFile(
        out,
        append=continuing,
        prepare=(lambda: None) if continuing else (lambda: write_job(out, "generate", job)),
    )
    progress = RunProgress(stderr, verb="generating", unit="group", total=len(problems))
    start = time.perf_counter()
    with output:
        if problems:
            agent = _PromptListAgent(
                prompts=PromptSource(problems, shuffle=False),
                reward_fn=REWARD_FUNCTIONS[reward],
                env_id=env,
                parallel_generation_tasks=min(concurrency, len(problems)),
                buffer_size=min(concurrency, len(problems)),
            )
            request = GroupedRolloutRequest(
                num_groups=1,
                rollouts_per_group=group_size,
                inference_interface=interface,
                streaming=True,
                generation_args=args,
                seed=seed,
                sampling_check=sampling_check,
            )

            def on_retry(details: RetryDetails) -> None:
                progress.retried(details.caused_by)

            try:
                with progress, counting_retries(on_retry):
                    run(
                        _generate_main,
                        agent,
                        problems,
                        request,
                        output,
                        filter_same_reward,
                        tally,
                        progress,
                        beside=progress.heartbeat,
                    )
            except KeyboardInterrupt as exc:
                message = _interrupted_message(output, not continuing, skipped + tally.written)
                raise interrupted(exc, message) from None
            except Exception as exc:
                exc.add_note(_failed_note(output, not continuing, skipped + tally.written))
                raise
            finally:
                if progress.retries.count:
                    click.echo(progress.retries.summary(), err=True)
        output.file()  # a job that wrote no group has an (empty) output all the same
    if tally.warn_identical():
        click.echo(_identical_warning(tally), err=True)
    elapsed = time.perf_counter() - start
    table = Table(title="trio-rollouts generate: summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("prompts", f"{len(problems) + skipped} ({skipped} already done)")
    table.add_row("groups written", f"{tally.written} ({tally.rollouts} rollouts)")
    table.add_row("groups filtered", f"{tally.filtered}")
    table.add_row("retried requests", f"{progress.retries.count}")
    mean = f"{tally.reward_sum / tally.rollouts:.3f}" if tally.rollouts else "-"
    table.add_row("mean reward", mean)
    table.add_row("groups with mixed rewards", f"{tally.mixed_groups}")
    speed = rate_text(tally.written + tally.filtered, elapsed, "group")
    table.add_row("time", f"{elapsed:.1f} s ({speed})")
    table.add_row("output", str(out))
    table.add_row("job record", str(job_path(out)))
    stdout_console().print(table)


def _interrupted_message(output: OutputFile, fresh: bool, groups: int) -> str:
    if fresh and not output.created:
        return "Interrupted before any group was written; there is nothing to resume."
    return (
        f"Interrupted: {output.path} holds {groups} complete groups; run the same command "
        "with --resume to continue."
    )


def _failed_note(output: OutputFile, fresh: bool, groups: int) -> str:
    if fresh and not output.created:
        return (
            "no group was written, so there is nothing to resume: run the same command once "
            "the cause is fixed"
        )
    return (
        f"{output.path} holds {groups} complete groups; once the cause is fixed (the base "
        "URL may change), --resume continues the job"
    )
