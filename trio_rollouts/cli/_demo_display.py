"""What both demos' live displays share: the progress bar (with the latest step's
metrics) inside a ``rich`` live view, and how each weight-update mode treats the calls
in flight, as the summaries word it."""

from __future__ import annotations

from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

__all__ = ["HELD_BY_MODE", "TrainingProgress"]

#: What each mode does to the calls in flight when an update begins (``update.held``;
#: drain cancels only those that the staleness bound makes too old).
HELD_BY_MODE = {"drain": "cancelled", "restart": "cancelled", "keep": "held", "abort": "aborted"}


class TrainingProgress:
    """A bar of ``steps`` training steps with a text field for the latest metrics
    (:meth:`advance`), shown in :attr:`live` (enter it for the run)."""

    def __init__(self, console: Console, steps: int) -> None:
        self.progress = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[latest]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self.steps = steps
        self.task: TaskID = self.progress.add_task("steps", total=steps, latest="")
        self.live = Live(Group(self.progress), console=console, refresh_per_second=8)

    def advance(self, steps: int = 1, latest: str | None = None) -> None:
        """Move the bar ``steps`` on, showing ``latest`` if given."""
        if latest is None:
            self.progress.update(self.task, advance=steps)
        else:
            self.progress.update(self.task, advance=steps, latest=latest)
