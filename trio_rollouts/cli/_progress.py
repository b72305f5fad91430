"""Progress of the commands that run for long (``generate``, ``eval``) on stderr, and
what their retries were for.

On a terminal, progress is a rich bar. Anywhere else (a Slurm log, CI, ``2> log``) a bar
would only be drawn once, at the end, so a long run could not be told from a hang:
there it is plain lines instead, one when the run starts, one every
``$TRIO_ROLLOUTS_PROGRESS_SECONDS`` seconds (default 30) whether or not anything
finished meanwhile, and one when it ends. ``TRIO_ROLLOUTS_PROGRESS_SECONDS=0`` writes a
line at every step instead (every finished group or request).

Both show the calls in flight and how long the oldest of them has run (see
:meth:`RunProgress.watch`), so that a slow run (calls finish, the oldest stays young) can
be told from a hung one (the oldest only ages).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from types import TracebackType

import click
import trio
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = [
    "BAR_REFRESH_SECONDS",
    "PROGRESS_SECONDS",
    "PROGRESS_SECONDS_ENV",
    "CallsInFlight",
    "RetryReasons",
    "RunProgress",
    "calls_text",
    "progress_seconds",
    "rate_text",
]

#: Seconds between progress lines on a stderr that is not a terminal.
PROGRESS_SECONDS = 30.0
#: The environment variable that overrides :data:`PROGRESS_SECONDS` (0: a line per step).
PROGRESS_SECONDS_ENV = "TRIO_ROLLOUTS_PROGRESS_SECONDS"

#: How much of a retried error's message a summary shows.
_REASON_CHARS = 120
#: Seconds between refreshes of the bar's calls in flight (on a terminal).
BAR_REFRESH_SECONDS = 1.0

#: What :meth:`RunProgress.watch` asks: the calls in flight now, and the seconds since the
#: oldest of them started (0.0 when none is).
CallsInFlight = Callable[[], tuple[int, float]]


def progress_seconds() -> float:
    """The seconds between progress lines: ``$TRIO_ROLLOUTS_PROGRESS_SECONDS``, else
    :data:`PROGRESS_SECONDS`. A value that is not a number >= 0 is a usage error."""
    text = os.environ.get(PROGRESS_SECONDS_ENV)
    if text is None or not text.strip():
        return PROGRESS_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not (seconds >= 0 and math.isfinite(seconds)):
        msg = (
            f"${PROGRESS_SECONDS_ENV} is {text!r}; give the seconds between progress "
            "lines, a number >= 0 (0: a line per step)"
        )
        raise click.UsageError(msg)
    return seconds


def rate_text(count: float, seconds: float, unit: str) -> str:
    """A speed that reads well both fast and slow: ``"12.5 groups/s"`` at one ``unit``
    per second or more, ``"53.5 s/group"`` below (where ``"0.0 groups/s"`` would say
    nothing)."""
    if count <= 0:
        return f"0 {unit}s/s"
    if seconds <= 0:
        return f"inf {unit}s/s"
    per_second = count / seconds
    if per_second >= 1:
        return f"{per_second:.1f} {unit}s/s"
    return f"{seconds / count:.1f} s/{unit}"


def _seconds(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


def calls_text(count: int, oldest: float) -> str:
    """``"in flight 3 (oldest 12.5 s)"``; ``"in flight 0"`` when none is."""
    if count <= 0:
        return "in flight 0"
    return f"in flight {count} (oldest {_seconds(oldest)})"


def _flat(text: str) -> str:
    return " ".join(text.split())


class RetryReasons:
    """The retries of a run's requests, counted by error type, with the first message
    of each type: what to say when requests were retried."""

    def __init__(self) -> None:
        self.count = 0
        self._counts: dict[str, int] = {}
        self._messages: dict[str, str] = {}

    def add(self, error: BaseException) -> None:
        """Count one retry caused by ``error``."""
        self.count += 1
        name = type(error).__name__
        self._counts[name] = self._counts.get(name, 0) + 1
        self._messages.setdefault(name, _flat(str(error)) or name)

    def summary(self) -> str:
        """``"requests were retried 3 times: InferenceTimeoutError x2 (...), ServerError
        x1 (...)"``, the most frequent error first; ``""`` when nothing was retried."""
        if not self.count:
            return ""
        parts = []
        for name, times in sorted(self._counts.items(), key=lambda item: -item[1]):
            message = self._messages[name]
            if len(message) > _REASON_CHARS:
                message = message[: _REASON_CHARS - 3] + "..."
            parts.append(f"{name} x{times} ({message})")
        noun = "time" if self.count == 1 else "times"
        return f"requests were retried {self.count} {noun}: " + ", ".join(parts)


class RunProgress:
    """A command's progress on stderr: ``done`` of ``total`` units, the retries, the
    calls in flight and the age of the oldest (once :meth:`watch` says where to read
    them), and a ``detail`` text of the command's own.

    On a terminal it is a rich bar. Elsewhere it is plain lines (the module docstring
    says when); the periodic ones come from :meth:`heartbeat`, a task that runs beside
    the work (``run(..., beside=progress.heartbeat)``), so they keep coming while nothing
    finishes. Their times are Trio's clock: on a virtual clock (the embedded backend),
    ``simulated`` seconds. Use it as a context manager around the run; all methods are
    called from the thread that runs Trio.
    """

    def __init__(
        self,
        console: Console,
        *,
        verb: str,
        unit: str,
        total: int,
        simulated: bool = False,
    ) -> None:
        self.console = console
        self.verb = verb
        self.unit = unit
        self.total = total
        self.simulated = simulated
        self.done = 0
        self.detail = ""
        self.retries = RetryReasons()
        self.calls: CallsInFlight | None = None
        self.lines = not console.is_terminal
        self.interval = progress_seconds() if self.lines else PROGRESS_SECONDS
        self._start: float | None = None
        self._last_line: float | None = None
        self._last_shown: tuple[int, int, str] | None = None
        self._bar = Progress(
            TextColumn(f"[bold]{verb}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            disable=self.lines,
        )
        self._task: TaskID = self._bar.add_task(unit, total=total, detail="")

    def __enter__(self) -> RunProgress:
        if self.lines:
            every = (
                "a line per step"
                if self.interval == 0
                else f"a line every {self.interval:g} s{' simulated' if self.simulated else ''}"
            )
            self._write(
                f"{self.verb}: {self.total} {self.unit}s ({every}; ${PROGRESS_SECONDS_ENV} sets it)"
            )
        else:
            self._bar.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self.lines:
            self._bar.stop()

    def advance(self, count: int = 1, *, detail: str | None = None) -> None:
        """``count`` more units are done (and the detail text is now ``detail``)."""
        self.done += count
        self._update(detail)

    def retried(self, error: BaseException) -> None:
        """A request is retried because of ``error``."""
        self.retries.add(error)
        self._update(None)

    def set_detail(self, detail: str) -> None:
        """Show ``detail`` from now on."""
        self._update(detail)

    def watch(self, calls: CallsInFlight) -> None:
        """Show the calls in flight from now on, as ``calls()`` says (read at each line,
        and every :data:`BAR_REFRESH_SECONDS` on a terminal); until then, none is shown."""
        self.calls = calls

    async def heartbeat(self) -> None:
        """Write a line every ``interval`` seconds until cancelled, and a last one then
        (lines mode); on a terminal the bar refreshes itself, and this reads the calls in
        flight again every :data:`BAR_REFRESH_SECONDS`. Cancellation: the way it ends."""
        self._now()
        if not self.lines:
            # The bar redraws itself; its calls in flight age only when read again.
            try:
                while True:
                    await trio.sleep(BAR_REFRESH_SECONDS)
                    if self.calls is not None:
                        self._update(None)
            finally:
                if self.calls is not None:
                    self._update(None)
        try:
            if self.interval == 0:
                await trio.sleep_forever()
            while True:
                await trio.sleep_until(self._next_line())
                self._line()
        finally:
            # The run ended (done, failed or cancelled): say where it got, unless the
            # last line said it (a line per step has said it at the last step).
            moved = self.interval > 0 and self._last_line != trio.current_time()
            if moved or self._last_shown != self._state():
                self._line()

    def _now(self) -> float:
        now = trio.current_time()
        if self._start is None:
            self._start = now
        return now

    def _next_line(self) -> float:
        last = self._last_line if self._last_line is not None else self._start
        return (last if last is not None else self._now()) + self.interval

    def _state(self) -> tuple[int, int, str]:
        return (self.done, self.retries.count, self.detail)

    def _update(self, detail: str | None) -> None:
        if detail is not None:
            self.detail = detail
        if not self.lines:
            self._bar.update(self._task, completed=self.done, detail=self._detail_text())
        elif self.interval == 0:
            self._line()

    def _detail_text(self) -> str:
        retries = f"  retries {self.retries.count}" if self.retries.count else ""
        calls = f"  {self._calls_text()}" if self.calls is not None else ""
        return f"{self.detail}{retries}{calls}"

    def _calls_text(self) -> str:
        if self.calls is None:
            return ""
        return calls_text(*self.calls())

    def _line(self) -> None:
        now = self._now()
        self._last_line = now
        self._last_shown = self._state()
        elapsed = now - (self._start if self._start is not None else now)
        share = f" ({self.done / self.total:.0%})" if self.total else ""
        parts = [
            f"{self.verb}: {self.done}/{self.total} {self.unit}s{share}",
            rate_text(self.done, elapsed, self.unit),
            f"retries {self.retries.count}",
        ]
        if self.calls is not None:
            parts.append(self._calls_text())
        parts.append(f"{_seconds(elapsed)}{' simulated' if self.simulated else ''} elapsed")
        if self.detail:
            parts.append(self.detail)
        self._write(", ".join(parts))

    def _write(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)
