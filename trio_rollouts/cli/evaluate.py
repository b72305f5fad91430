"""``trio-rollouts eval``: pass@k of a prompt file, against a server or the embedded
backend, sharded over ranks with ``--rank``/``--world`` (``eval-merge`` joins the ranks).

Each prompt's result is appended to ``OUT.progress.jsonl`` as one whole line as soon as
its completions are scored, so Ctrl-C, SIGTERM or a dead server leaves every finished
prompt on disk and ``--resume`` evaluates only the others; the job's settings are kept in
``OUT.job.json`` meanwhile. When every prompt is done, ``OUT`` is written (atomically) and
both side files are removed.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import click
import trio
import trio.testing
from rich.table import Table
from stamina.instrumentation import RetryDetails

from trio_rollouts._concurrency import gather_bounded
from trio_rollouts.agents._evaluation import (
    PassAtKEvaluationAgent,
    PassAtKEvaluationResponse,
    PassAtKResult,
    shard_indices,
)
from trio_rollouts.agents._reward_only import REWARD_FUNCTIONS
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
    write_json,
)
from trio_rollouts.cli._job import (
    OutputFile,
    check_job,
    describe_differences,
    differences,
    job_path,
    write_job,
)
from trio_rollouts.cli._progress import RunProgress
from trio_rollouts.inference import (
    EmbeddedInference,
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    render_plain_chat,
)
from trio_rollouts.models._convert import load_jsonl, unstructure
from trio_rollouts.models._problems import Problem
from trio_rollouts.models._requests import EvaluationRequest
from trio_rollouts.prompts._file import (
    result_problem_id,
    scan_output,
    truncate_torn_line,
    write_groups,
)

__all__ = [
    "EVAL_FORMAT",
    "NOT_RESULTS",
    "RESULT_KEYS",
    "eval_command",
    "flat_job",
    "metrics_table",
    "progress_path",
]

#: The format tag of ``eval`` output files.
EVAL_FORMAT = "trio-rollouts.eval/1"

#: The keys of a result file; all but ``metrics`` and ``response`` identify its job.
RESULT_KEYS = (
    "format",
    "rank",
    "world_size",
    "num_prompts",
    "prompts_sha256",
    "settings",
    "metrics",
    "response",
)


#: Settings that do not change results; older result files recorded some of them.
NOT_RESULTS = frozenset({"base_url", "concurrency", "timeout", "max_retries", "max_connections"})


def flat_job(data: dict[str, Any]) -> dict[str, Any]:
    """What identifies the job of a result file (or of a run), flattened so that a
    difference names one setting (``settings.samples``), without the settings that do
    not change results."""
    job = {key: data.get(key) for key in ("rank", "world_size", "num_prompts", "prompts_sha256")}
    for key, value in dict(data.get("settings") or {}).items():
        if key not in NOT_RESULTS:
            job[f"settings.{key}"] = value
    return job


def progress_path(out: Path) -> Path:
    """Where ``eval`` keeps the results of finished prompts until ``out`` is written."""
    return out.with_name(out.name + ".progress.jsonl")


@attrs.define(kw_only=True, eq=False)
class _CountingInterface(InferenceInterface):
    """Delegates to ``inner``, calls ``on_done`` after every completed request, notes
    whether the sampled (temperature not 0) completions of each prompt varied, and knows
    the requests in flight (:meth:`calls_in_flight`)."""

    inner: InferenceInterface
    on_done: Callable[[], None]
    #: Per sampled prompt (by hash): the hash of its first completion while every
    #: completion was the same, ``None`` once two differed. Hashes keep it small.
    sampled: dict[int, int | None] = attrs.field(factory=dict)
    #: When each request in flight started (Trio's clock), by a number that grows: the
    #: first entry is the oldest.
    started: dict[int, float] = attrs.field(init=False, factory=dict)
    requests: int = attrs.field(init=False, default=0)

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        """``inner.agenerate(request)``. Cancellation: as the inner interface's."""
        number = self.requests
        self.requests += 1
        self.started[number] = trio.current_time()
        try:
            response = await self.inner.agenerate(request)
        finally:
            del self.started[number]
        self.on_done()
        if request.generation_args.temperature != 0:
            prompt, text = hash(render_plain_chat(request.prompt)), hash(response.response.content)
            if self.sampled.setdefault(prompt, text) != text:
                self.sampled[prompt] = None
        return response

    def calls_in_flight(self) -> tuple[int, float]:
        """The requests in flight, and the seconds since the oldest of them started."""
        if not self.started:
            return 0, 0.0
        return len(self.started), trio.current_time() - next(iter(self.started.values()))

    def all_samples_identical(self) -> bool:
        """Whether some prompt was sampled and every prompt's samples were identical."""
        return bool(self.sampled) and None not in self.sampled.values()

    async def aclose(self) -> None:
        """Closes the inner interface. Cancellation: as the inner interface's."""
        await self.inner.aclose()


def metrics_table(title: str, metrics: dict[str, float]) -> Table:
    """A result's metrics as a table."""
    table = Table(title=title, show_header=False, title_justify="left", min_width=len(title))
    table.add_column(style="bold")
    table.add_column(justify="right")
    for name, value in metrics.items():
        table.add_row(name, f"{int(value)}" if name == "num_prompts" else f"{value:.4f}")
    return table


async def _eval_main(
    evaluate: Callable[[Problem], Awaitable[PassAtKResult]],
    todo: list[Problem],
    prompts_at_once: int,
    output: OutputFile,
    on_result: Callable[[PassAtKResult], None],
) -> None:
    def call(problem: Problem) -> Callable[[], Awaitable[None]]:
        async def one() -> None:
            result = await evaluate(problem)
            write_groups(output.file(), [result])
            on_result(result)

        return one

    await gather_bounded([call(problem) for problem in todo], prompts_at_once)


def _has_data(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 0


def _resumed_results(
    out: Path, progress_file: Path, job: dict[str, Any], shard: list[Problem]
) -> list[PassAtKResult]:
    """The results an interrupted run of this job left in its progress file (a torn last
    line is cut off); another job's progress, or a result of a prompt this rank does not
    evaluate, is a ``ClickException``."""
    check_job(out, "eval", job)
    state = scan_output(
        progress_file,
        problem_id_of=result_problem_id,
        expected="a pass@k result; resume only the progress of 'trio-rollouts eval'",
    )
    truncate_torn_line(progress_file, state)
    done = list(load_jsonl(progress_file, PassAtKResult))
    ids = {problem.problem_id for problem in shard}
    for result in done:
        if result.problem_id not in ids:
            msg = (
                f"{progress_file} holds a result for problem {result.problem_id!r}, which is "
                f"not among this rank's {len(shard)} prompts; it was edited: remove that line "
                "or pass --overwrite to start again"
            )
            raise click.ClickException(msg)
    click.echo(
        f"resuming: {len(done)} of {len(shard)} prompts are done in {progress_file}", err=True
    )
    return done


def _finished_result(out: Path, progress_file: Path, job: dict[str, Any]) -> dict[str, Any]:
    """The result file of a finished run of this job; anything else is a
    ``ClickException``."""
    try:
        data = json.loads(out.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        data = None
    if not isinstance(data, dict) or data.get("format") != EVAL_FORMAT:
        msg = (
            f"{out} is not a result file of 'trio-rollouts eval' and there is no "
            f"{progress_file.name} to resume; pass --overwrite to replace it"
        )
        raise click.ClickException(msg)
    found = differences(flat_job(data), job)
    if found:
        shown = describe_differences(found, f"in {out.name}", "in this run")
        msg = (
            f"{out} is the result of another job; its settings differ from this run's: "
            f"{shown}. Pass --overwrite to replace it, or choose another --out"
        )
        raise click.ClickException(msg)
    return data


@click.command(
    name="eval",
    cls=Command,
    equivalents={
        "--group-size": "samples",
        "--num-samples": "samples",
        "--n-samples": "samples",
        "--rollouts-per-group": "samples",
        "--max-new-tokens": "max_tokens",
    },
)
@server_options(unless="--embedded")
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
@out_option(
    "Result file (JSON); merge the ranks' files with eval-merge. Until it is written, "
    "finished prompts are kept in OUT.progress.jsonl.",
    required=True,
)
@reward_option("exact-match")
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
    help="Also generate one completion per prompt at temperature 0 (greedy accuracy); "
    "on by default.",
)
@click.option(
    "--num-prompts",
    type=click.IntRange(min=1),
    default=None,
    help="Evaluate the first N prompts of the file (N >= 1) [default: all].",
)
@click.option(
    "--rank",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="This process's rank, 0 .. --world - 1; it evaluates its share of the prompts.",
)
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
@click.option(
    "--resume",
    is_flag=True,
    help="Continue an interrupted run with the same settings: evaluate only the prompts "
    "missing from OUT.progress.jsonl.",
)
@overwrite_option
@reports_errors
def eval_command(
    base_url: tuple[str, ...],
    model: str | None,
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
    resume: bool,
    overwrite: bool,
) -> None:
    """pass@k of a prompt file, against a server or the embedded backend.

    With --rank/--world, this process evaluates its share of the prompts; run every
    rank, then 'trio-rollouts eval-merge' their result files to get exactly the result
    of one unsharded run. Finished prompts are on disk as the run goes: after Ctrl-C
    (exit code 130), SIGTERM (143) or an error, --resume continues it.
    """
    if embedded == bool(base_url):
        raise click.UsageError("Give either --embedded or --base-url (with --model).")
    if base_url and model is None:
        raise click.UsageError("Missing option '--model'.")
    if embedded:
        for flag, value in [
            ("--token-ids/--no-token-ids", token_ids),
            ("--logprobs/--no-logprobs", logprobs),
            ("--extra-body", extra_body),
        ]:
            if value is not None:
                msg = f"{flag} is for a server (--base-url); the embedded backend has none"
                raise click.UsageError(msg)
    if rank >= world:
        raise click.BadParameter(f"{rank} is not below --world {world}", param_hint="'--rank'")
    if resume and overwrite:
        raise click.UsageError("--resume and --overwrite exclude each other.")
    k = samples if k is None else k
    if k > samples:
        raise click.BadParameter(f"{k} exceeds --samples {samples}", param_hint="'-k'")
    problems = load_prompts(prompts, reward, None)
    count = len(problems) if num_prompts is None else min(num_prompts, len(problems))
    # Only what changes results: not replicas, concurrency or timeouts.
    settings: dict[str, Any] = {
        "reward": reward,
        "samples": samples,
        "k": k,
        "greedy": greedy,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "max_tokens": max_tokens,
    }
    inner: InferenceInterface
    if embedded:
        inner = EmbeddedInference(seed=seed)
        settings.update(backend="embedded", seed=seed)
    else:
        inner = openai_interface(
            base_url,
            str(model),
            api_key,
            endpoint,
            max_connections=concurrency,
            timeout=timeout,
            max_retries=max_retries,
            token_ids=token_ids,
            logprobs=logprobs,
            extra_body=extra_body,
        )
        settings.update(backend="openai", model=model, endpoint=endpoint, extra_body=extra_body)
    job: dict[str, Any] = {
        "rank": rank,
        "world_size": world,
        "num_prompts": count,
        "prompts_sha256": sha256(prompts),
        "settings": settings,
    }
    shard = [problems[i] for i in shard_indices(count, (rank, world))]
    progress_file = progress_path(out)
    done: list[PassAtKResult] = []
    if not (resume or overwrite):
        refuse_existing_out(out, resumable=True, also=[progress_file])
    fresh = True
    if resume and _has_data(progress_file):
        done = _resumed_results(out, progress_file, flat_job(job), shard)
        fresh = False
    elif resume and _has_data(out):
        finished = _finished_result(out, progress_file, flat_job(job))
        click.echo(f"{out} is complete: nothing to resume", err=True)
        stdout_console().print(metrics_table("trio-rollouts eval", finished["metrics"]))
        return
    finished_ids = {result.problem_id for result in done}
    todo = [problem for problem in shard if problem.problem_id not in finished_ids]

    def start_fresh() -> None:
        # The old result goes when the first new one is written, so that the files on
        # disk always belong to one job, and a run that writes none leaves them as they were.
        out.unlink(missing_ok=True)
        write_job(out, "eval", flat_job(job))

    output = OutputFile(
        progress_file, append=not fresh, prepare=start_fresh if fresh else lambda: None
    )
    if not embedded and todo:
        note = unbounded_completions_note(max_tokens, timeout)
        if note is not None:
            click.echo(note, err=True)

    calls_per_prompt = samples + greedy
    progress = RunProgress(
        stderr_console(),
        verb="evaluating",
        unit="request",
        total=len(todo) * calls_per_prompt,
        simulated=embedded,
    )
    interface = _CountingInterface(inner=inner, on_done=progress.advance)
    progress.watch(interface.calls_in_flight)
    args = generation_args(temperature, top_k, top_p, max_tokens)

    async def evaluate(problem: Problem) -> PassAtKResult:
        # One agent per prompt, so each prompt's result is on disk as soon as it is done.
        agent = PassAtKEvaluationAgent(
            problems=[problem],
            reward_fn=REWARD_FUNCTIONS[reward],
            n=samples,
            k=k,
            greedy=greedy,
            max_concurrent_requests=min(concurrency, calls_per_prompt),
            env_id=prompts.stem,
        )
        request = EvaluationRequest(
            inference_interface=interface, num_prompts=1, generation_args=args
        )
        response = await agent.run_evaluation(request)
        return response.results[0]

    def on_retry(details: RetryDetails) -> None:
        progress.retried(details.caused_by)

    new: list[PassAtKResult] = []

    def on_result(result: PassAtKResult) -> None:
        new.append(result)
        progress.set_detail(f"prompts {len(done) + len(new)}/{len(shard)}")

    try:
        with output, progress, counting_retries(on_retry):
            # The embedded backend's latency is simulated: a virtual clock skips it.
            clock = trio.testing.MockClock(autojump_threshold=0) if embedded else None
            run(
                _eval_main,
                evaluate,
                todo,
                max(1, concurrency // calls_per_prompt),
                output,
                on_result,
                clock=clock,
                beside=progress.heartbeat,
            )
    except KeyboardInterrupt as exc:
        if fresh and not output.created:
            message = (
                "Interrupted before any prompt's result was written; there is nothing to resume."
            )
        else:
            message = (
                f"Interrupted: {progress_file} holds {len(done) + len(new)} of {len(shard)} "
                "prompts' results; run the same command with --resume to continue."
            )
        raise interrupted(exc, message) from None
    except Exception as exc:
        if fresh and not output.created:
            exc.add_note(
                "no prompt's result was written, so there is nothing to resume: run the same "
                "command once the cause is fixed"
            )
        else:
            exc.add_note(
                f"{progress_file} holds {len(done) + len(new)} of {len(shard)} prompts' "
                "results; once the cause is fixed (the base URL may change), --resume "
                "continues the run"
            )
        raise
    finally:
        if progress.retries.count:
            click.echo(progress.retries.summary(), err=True)
    if samples > 1 and interface.all_samples_identical():
        click.echo(
            f"warning: all {samples} sampled completions were identical for each of the "
            f"{len(interface.sampled)} prompts; the server may be ignoring the sampling arguments "
            "(check --temperature, --top-p, --top-k and the server's generation config)",
            err=True,
        )
    position = {problem.problem_id: i for i, problem in enumerate(shard)}
    results = sorted([*done, *new], key=lambda result: position[str(result.problem_id)])
    response = PassAtKEvaluationResponse(
        env_id=prompts.stem, results=results, k=k, rank_info=(rank, world) if world > 1 else None
    )
    metrics = response.metrics()
    write_json(
        out, {"format": EVAL_FORMAT, **job, "metrics": metrics, "response": unstructure(response)}
    )
    progress_file.unlink(missing_ok=True)
    job_path(out).unlink(missing_ok=True)
    title = "trio-rollouts eval"
    if world > 1:
        indices = shard_indices(count, (rank, world))
        share = f"prompts {indices.start}..{indices.stop - 1}" if indices else "no prompts"
        title = f"trio-rollouts eval: rank {rank} of {world}, {share}"
    stdout_console().print(metrics_table(title, metrics))
    click.echo(f"wrote {out}", err=True)
