"""What every command of the command line shares: running Trio, reporting errors, the
options of the commands that talk to a server, and the rules for ``--out``.

Errors a user can fix end a command with one line, ``Error: ...``, and exit code 1; a bad
flag is click's usage error (exit code 2); Ctrl-C cancels everything in flight and exits
with 130, SIGTERM (what schedulers send) the same way with 143. Set
``TRIO_ROLLOUTS_TRACEBACK=1`` to get the traceback of an error instead.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import click
import stamina
import trio
from rich.console import Console
from stamina.instrumentation import RetryHook

from trio_rollouts._messages import GenerationArgs
from trio_rollouts.agents._reward_only import REWARD_FUNCTIONS
from trio_rollouts.inference import DEFAULT_TIMEOUT, InferenceError, OpenAIInference
from trio_rollouts.inference._retry import logger as retry_logger
from trio_rollouts.models._problems import Problem
from trio_rollouts.prompts._file import PromptFileError, load_problems

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "JSON_OBJECT",
    "Command",
    "JSONObject",
    "Terminated",
    "counting_retries",
    "end_live",
    "generation_args",
    "interrupted",
    "load_prompts",
    "one_line",
    "openai_interface",
    "out_option",
    "overwrite_option",
    "refuse_existing_out",
    "reports_errors",
    "reward_option",
    "run",
    "server_options",
    "sha256",
    "stderr_console",
    "stdout_console",
    "unbounded_completions_note",
    "write_json",
]

#: The exit code of a command stopped by Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130
#: The exit code of a command stopped by SIGTERM (128 + SIGTERM).
EXIT_TERMINATED = 143

P = ParamSpec("P")
T = TypeVar("T")


# --------------------------------------------------------------------------- errors


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived. A ``KeyboardInterrupt``, so every command stops and reports it
    exactly as it does Ctrl-C; only the exit code differs (143)."""


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def _flat(text: str) -> str:
    return " ".join(text.split())


def one_line(exc: BaseException) -> str:
    """An exception as one line: its message and notes, whitespace collapsed.

    A group of several failures (several requests failed at once) shows each distinct
    message once: the first, then ``(and 1 more error: ...)`` or ``(and N more errors:
    ...)`` with up to two more of them.
    """
    notes = [_flat(note) for note in getattr(exc, "__notes__", ())]
    if not isinstance(exc, BaseExceptionGroup):
        return "; ".join([_flat(_describe(exc)), *notes])
    distinct: list[str] = []
    for leaf in _leaves(exc):
        text = "; ".join(
            [_flat(_describe(leaf)), *(_flat(n) for n in getattr(leaf, "__notes__", ()))]
        )
        if text not in distinct:
            distinct.append(text)
    text = distinct[0]
    more = distinct[1:]
    if more:
        shown = " | ".join(more[:2]) + (" | ..." if len(more) > 2 else "")
        noun = "error" if len(more) == 1 else "errors"
        text += f" (and {len(more)} more {noun}: {shown})"
    return "; ".join([text, *notes])


#: Errors whose messages are written for users; others also show their type.
_USER_ERRORS = (ValueError, TypeError, OSError, RuntimeError, InferenceError)


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, _USER_ERRORS):
        return text
    return f"{type(exc).__name__}: {text} (set TRIO_ROLLOUTS_TRACEBACK=1 for the traceback)"


def _interrupt_in(exc: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM an exception (group) holds; SIGTERM wins over Ctrl-C."""
    found = [leaf for leaf in _leaves(exc) if isinstance(leaf, KeyboardInterrupt)]
    for leaf in found:
        if isinstance(leaf, Terminated):
            return leaf
    return found[0] if found else None


def run(
    async_fn: Callable[..., Awaitable[T]],
    *args: Any,
    clock: trio.abc.Clock | None = None,
    beside: Callable[[], Awaitable[None]] | None = None,
) -> T:
    """``trio.run`` that stops on SIGTERM as on Ctrl-C, and turns either, however Trio
    delivered it (in an exception group when it hit a task other than the main one),
    into one ``KeyboardInterrupt`` (:class:`Terminated` for SIGTERM).

    On SIGTERM the work is cancelled (at its next checkpoint, so a line being written is
    finished first), then :class:`Terminated` is raised. ``beside`` (a progress
    heartbeat) runs as a task beside the work and is cancelled when the work ends, however
    it ends; it must not raise.
    """
    terminated = False

    async def main() -> T:
        nonlocal terminated
        work_scope = trio.CancelScope()
        failure: BaseException | None = None
        result: T

        async def watch(signals: AsyncIterator[int]) -> None:
            nonlocal terminated
            async for _ in signals:
                terminated = True
                work_scope.cancel()
                return

        with contextlib.ExitStack() as stack:
            # Signals reach only the main thread; elsewhere, run the work without a watch.
            signals = (
                stack.enter_context(trio.open_signal_receiver(signal.SIGTERM))
                if threading.current_thread() is threading.main_thread()
                else None
            )
            # The receiver outlives the nursery, so the watcher never reads a closed one.
            async with trio.open_nursery() as nursery:
                if signals is not None:
                    nursery.start_soon(watch, signals)
                if beside is not None:
                    nursery.start_soon(beside)
                with work_scope:
                    try:
                        result = await async_fn(*args)
                    except BaseException as exc:
                        # Raised below, outside the nursery, as itself (not in a group).
                        failure = exc
                nursery.cancel_scope.cancel()
        if terminated:
            raise Terminated
        if failure is not None:
            raise failure
        return result

    try:
        return trio.run(main, clock=clock)
    except BaseExceptionGroup as group:
        interrupt = _interrupt_in(group)
        if interrupt is not None:
            raise type(interrupt) from None
        raise


def interrupted(exc: KeyboardInterrupt, message: str = "Interrupted.") -> click.exceptions.Exit:
    """Say ``message`` and return the exit that Ctrl-C (130) or SIGTERM (143) ends a
    command with."""
    click.echo(message, err=True)
    code = EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED
    return click.exceptions.Exit(code)


def reports_errors(command: Callable[P, T]) -> Callable[P, T]:
    """Turn what a command raises into the CLI's exit codes: Ctrl-C exits with 130,
    SIGTERM with 143, an error with one ``Error: ...`` line and 1
    (``TRIO_ROLLOUTS_TRACEBACK=1`` re-raises it instead)."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt as exc:
            raise interrupted(exc) from None
        except (click.ClickException, click.exceptions.Exit):
            raise
        except Exception as exc:
            if os.environ.get("TRIO_ROLLOUTS_TRACEBACK"):
                raise
            raise click.ClickException(one_line(exc)) from exc

    return wrapper


# --------------------------------------------------------------------------- consoles


def stderr_console() -> Console:
    """The progress console. Made per command, so it writes to the streams click (or a
    test) set up."""
    return Console(stderr=True, highlight=False)


def stdout_console() -> Console:
    """The console of summary tables."""
    return Console(highlight=False)


def end_live(console: Console) -> None:
    """End a live display's last line (it does so itself only on a terminal)."""
    if not console.is_terminal:
        console.line()


@contextlib.contextmanager
def counting_retries(on_retry: RetryHook) -> Iterator[None]:
    """Report the inference layer's retries to ``on_retry`` instead of stamina's log
    lines and the library's own (which would tear through the progress display; the
    progress line and the summary count them)."""
    previous = stamina.instrumentation.get_on_retry_hooks()
    stamina.instrumentation.set_on_retry_hooks([on_retry])
    retry_logger.addFilter(_no_record)
    try:
        yield
    finally:
        retry_logger.removeFilter(_no_record)
        stamina.instrumentation.set_on_retry_hooks(previous)


def _no_record(record: object) -> bool:
    return False


# --------------------------------------------------------------------------- files


def sha256(path: Path) -> str:
    """The hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_json(path: Path, data: object) -> None:
    """Write ``data`` as indented JSON, atomically: to a temporary file, then renamed, so
    a reader never sees half of it."""
    text = json.dumps(data, ensure_ascii=False, indent=1) + "\n"
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)


def _check_out_folder(
    ctx: click.Context, param: click.Parameter, value: Path | None
) -> Path | None:
    if value is not None and not value.parent.is_dir():
        msg = f"the folder {str(value.parent)!r} does not exist; create it or choose another path"
        raise click.BadParameter(msg, ctx=ctx, param=param)
    return value


def out_option(help_text: str, *, required: bool) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """``--out PATH``: a file whose folder must exist (a usage error naming ``--out``
    otherwise)."""
    return click.option(
        "--out",
        type=click.Path(dir_okay=False, path_type=Path),
        required=required,
        default=None,
        callback=_check_out_folder,
        help=help_text,
    )


def overwrite_option(command: Callable[P, T]) -> Callable[P, T]:
    """``--overwrite``: replace an existing ``--out``."""
    return click.option("--overwrite", is_flag=True, help="Replace an existing --out.")(command)


def refuse_existing_out(out: Path, *, resumable: bool, also: Sequence[Path] = ()) -> None:
    """The one rule for ``--out`` of every command: a file that exists and is not empty
    (or one of ``also``, files a job keeps beside it) is never replaced unless
    ``--overwrite`` (or continued with ``--resume``) is given."""
    existing = [path for path in (out, *also) if path.exists() and path.stat().st_size > 0]
    if not existing:
        return
    hint = (
        "pass --resume to continue that job or --overwrite to replace it"
        if resumable
        else "pass --overwrite to replace it"
    )
    msg = f"{existing[0]} exists; {hint}"
    raise click.ClickException(msg)


# --------------------------------------------------------------------------- options


class JSONObject(click.ParamType[dict[str, Any]]):
    """A JSON object given on the command line (``--extra-body '{"seed": 1}'``)."""

    name = "JSON"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> dict[str, Any]:
        if isinstance(value, dict):
            return value
        try:
            data = json.loads(value)
        except json.JSONDecodeError as exc:
            self.fail(
                f"{value!r} is not valid JSON ({exc.msg} at character {exc.pos + 1}); "
                """give a JSON object, e.g. '{"seed": 1}'""",
                param,
                ctx,
            )
        if not isinstance(data, dict):
            self.fail(
                f"{value!r} is a JSON {type(data).__name__}, not an object; "
                """give a JSON object, e.g. '{"seed": 1}'""",
                param,
                ctx,
            )
        return data


JSON_OBJECT = JSONObject()

_SERVER_DEFAULT = "[default: unset, the server's default]"


def server_options(*, unless: str | None = None) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """The options of every command that talks to a server: where it is, how requests
    are made, the extensions asked for, and the sampling arguments.

    ``--base-url`` and ``--model`` are required; with ``unless`` (a flag such as
    ``--embedded``) the command checks that itself and the help says ``[required unless
    --embedded]``.
    """
    required = unless is None
    note = "" if required else f"  [required unless {unless}]"
    options = [
        click.option(
            "--base-url",
            multiple=True,
            required=required,
            metavar="URL",
            help="API root of an OpenAI-compatible server, '/v1' included "
            f"(repeat for replicas of one model).{note}",
        ),
        click.option(
            "--model", metavar="NAME", required=required, help=f"The served model's name.{note}"
        ),
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
        click.option(
            "--token-ids/--no-token-ids",
            "token_ids",
            default=None,
            help="Ask for token ids (vLLM's return_token_ids): --token-ids fails if the "
            "server refuses it or returns none, --no-token-ids never asks [default: ask, "
            "and stop asking a server that rejects the field].",
        ),
        click.option(
            "--logprobs/--no-logprobs",
            "logprobs",
            default=None,
            help="Ask for log-probabilities of the generated tokens: --logprobs fails if "
            "the server refuses them or returns none (or not one per token), --no-logprobs "
            "never asks [default: ask, and stop asking a server that rejects the field].",
        ),
        click.option(
            "--extra-body",
            type=JSON_OBJECT,
            default=None,
            help="""A JSON object of more fields for every request's body, e.g. '{"seed": 1, """
            """"repetition_penalty": 1.1}'.""",
        ),
        click.option(
            "--temperature",
            type=click.FloatRange(min=0),
            default=None,
            help=f"Sampling temperature (0 is greedy) {_SERVER_DEFAULT}.",
        ),
        click.option(
            "--top-k",
            type=click.IntRange(min=1),
            default=None,
            help=f"Sample from the K most probable tokens {_SERVER_DEFAULT}.",
        ),
        click.option(
            "--top-p",
            type=click.FloatRange(min=0, min_open=True, max=1),
            default=None,
            help=f"Nucleus sampling: the smallest set of tokens with this much probability "
            f"{_SERVER_DEFAULT}.",
        ),
        click.option(
            "--max-tokens",
            type=click.IntRange(min=1),
            default=None,
            help=f"Most tokens generated per completion {_SERVER_DEFAULT}.",
        ),
    ]

    def decorate(command: Callable[P, T]) -> Callable[P, T]:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


class Command(click.Command):
    """A command whose "No such option" error, for a name that other tools (or another
    command of this one) use for one of its options, names that option:
    ``equivalents`` maps such names (``--group-size``) to the parameter
    (``samples``)."""

    def __init__(self, *args: Any, equivalents: Mapping[str, str] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.equivalents = dict(equivalents or {})

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """click's parsing, with the hint above."""
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            hint = self._equivalent(exc.option_name)
            if hint is None:
                raise
            msg = f"No such option '{exc.option_name}'. {hint}"
            raise click.NoSuchOption(exc.option_name, message=msg, ctx=ctx) from None

    def _equivalent(self, option_name: str) -> str | None:
        name = self.equivalents.get(option_name)
        for param in self.params:
            if param.name == name and isinstance(param, click.Option):
                flags = "/".join(param.opts)
                # The help's first sentence, without its "[default: ...]".
                about = (param.help or "").split(" [")[0].split(". ")[0].rstrip(".")
                text = f"'{self.name}' has {flags} for that"
                return f"{text}: {about[:1].lower()}{about[1:]}." if about else f"{text}."
        return None


def unbounded_completions_note(max_tokens: int | None, timeout: float | None) -> str | None:
    """What to tell a user who talks to a server without ``--max-tokens``: a completion
    may run until the server's own limit, and one that outlasts the read timeout is
    retried from the start. ``None`` when ``--max-tokens`` is set."""
    if max_tokens is not None:
        return None
    read = timeout if timeout is not None else DEFAULT_TIMEOUT.read
    outlasts = (
        f"one that takes longer than the read timeout ({read:g} s, --timeout) fails and is "
        "retried from the start"
        if read is not None
        else "nothing stops it"
    )
    return (
        "note: --max-tokens is not set, so a completion runs until the server's own limit "
        f"(llama.cpp's server has none), and {outlasts}; set --max-tokens to bound completions"
    )


def reward_option(default: str) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """``--reward NAME``: one of :data:`~trio_rollouts.agents._reward_only.REWARD_FUNCTIONS`."""
    return click.option(
        "--reward",
        type=click.Choice(sorted(REWARD_FUNCTIONS)),
        default=default,
        show_default=True,
        help="How a completion scores against the row's answer: exact-match (whole "
        "completion, stripped), contains (answer occurs in it), last-number (its last "
        "number equals the answer).",
    )


def generation_args(
    temperature: float | None, top_k: int | None, top_p: float | None, max_tokens: int | None
) -> GenerationArgs:
    """The sampling flags as :class:`~trio_rollouts.GenerationArgs` (unset stays unset)."""
    return GenerationArgs(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens)


def openai_interface(
    base_url: Sequence[str],
    model: str,
    api_key: str | None,
    endpoint: str,
    *,
    max_connections: int,
    timeout: float | None,
    max_retries: int,
    token_ids: bool | None,
    logprobs: bool | None,
    extra_body: dict[str, Any] | None,
    server: str | None = None,
) -> OpenAIInference:
    """The server options as an :class:`~trio_rollouts.OpenAIInference`; what it refuses
    is a usage error."""
    try:
        return OpenAIInference(
            base_url=list(base_url),
            model=model,
            api_key=api_key,
            endpoint=endpoint,  # type: ignore[arg-type]  # click.Choice checked it
            max_connections=max_connections,
            timeout=timeout if timeout is not None else DEFAULT_TIMEOUT,
            max_retries=max_retries,
            return_token_ids=token_ids,
            return_logprobs=logprobs,
            extra_body=dict(extra_body or {}),
            server=server,  # type: ignore[arg-type]  # click.Choice checked it
        )
    except (TypeError, ValueError) as exc:
        text = one_line(exc)
        hint = "'--extra-body'" if "extra_body" in text else "'--base-url'"
        raise click.BadParameter(text, param_hint=hint) from None


def load_prompts(prompts: Path, reward: str | None, num_prompts: int | None) -> list[Problem]:
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
                msg = f"{prompts}: problem {problem.problem_id!r}: {one_line(exc)}"
                raise PromptFileError(msg) from None
    return problems
