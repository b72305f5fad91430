"""``trio-rollouts demo --task tool``: the tool demo's run, live display (a progress bar
and rows of the learning curve), summary table and optional plot."""

from __future__ import annotations

import importlib
import math
import time
from pathlib import Path
from typing import IO, Any

import click
import trio
import trio.testing
from rich.console import Console
from rich.table import Table

from trio_rollouts.cli._common import (
    end_live,
    refuse_existing_out,
    run,
    stderr_console,
    stdout_console,
)
from trio_rollouts.cli._demo import ToolDemoConfig, ToolDemoResult, ToolStepMetrics, run_tool_demo
from trio_rollouts.cli._demo_display import HELD_BY_MODE, TrainingProgress

__all__ = ["run_tool_command"]


class _ToolDisplay:
    """The live view: a progress bar with the latest step's metrics, and a row of the
    learning curve for step 1, every ``log_every`` steps and the last step (the summary
    quotes steps 0, 1 and the last, so each of its numbers is in a row)."""

    def __init__(self, console: Console, steps: int, log_every: int) -> None:
        self.console = console
        self.log_every = log_every
        self.bar = TrainingProgress(console, steps)
        self.live = self.bar.live

    def on_start(self, tool_call_rate: float, accuracy: float) -> None:
        self.console.print(
            "step  reward  tool calls seen  tool calls policy  accuracy  turns  filtered"
        )
        self.console.print(
            f"   0       -                -  {tool_call_rate:17.3f}  {accuracy:8.3f}"
        )

    def on_step(self, m: ToolStepMetrics) -> None:
        self.bar.advance(
            latest=f"tool calls {m.policy_tool_call_rate:.3f}  accuracy {m.accuracy:.3f}"
        )
        if m.step == 1 or m.step % self.log_every == 0 or m.step == self.bar.steps:
            self.console.print(
                f"{m.step:4d}  {m.mean_reward:6.3f}  {m.tool_call_rate:15.3f}  "
                f"{m.policy_tool_call_rate:17.3f}  {m.accuracy:8.3f}  {m.mean_turns:5.2f}  "
                f"{m.training.filtered:8d}"
            )


def _summary(result: ToolDemoResult, wall: float, clock: str) -> Table:
    steps = result.steps
    first, last = steps[0], steps[-1]
    config = result.config
    table = Table(
        title="trio-rollouts demo --task tool: summary", show_header=False, title_justify="left"
    )
    table.add_column(style="bold")
    table.add_column()
    table.add_row(
        "tool-call rate (policy)",
        f"{result.initial_tool_call_rate:.3f} -> {result.final_tool_call_rate:.3f}",
    )
    table.add_row(
        "accuracy (policy)", f"{result.initial_accuracy:.3f} -> {result.final_accuracy:.3f}"
    )
    table.add_row(
        "tool-call rate seen (step 1 -> last)",
        f"{first.tool_call_rate:.3f} -> {last.tool_call_rate:.3f}",
    )
    table.add_row(
        "mean reward (step 1 -> last)", f"{first.mean_reward:.3f} -> {last.mean_reward:.3f}"
    )
    table.add_row("mean turns (step 1 -> last)", f"{first.mean_turns:.2f} -> {last.mean_turns:.2f}")
    table.add_row("steps (policy epochs)", f"{len(steps)}")
    table.add_row("groups / episodes trained on", f"{result.groups} / {result.rollouts}")
    table.add_row("filtered groups (regenerated)", f"{result.filtered}")
    bound = "none" if config.max_staleness is None else f"{config.max_staleness}"
    table.add_row(
        "staleness mean / max",
        f"{result.staleness_mean:.2f} / {result.staleness_max} policy epochs (bound: {bound})",
    )
    held = f"{sum(m.training.held for m in steps)} calls {HELD_BY_MODE[config.update_mode]}"
    updates = f"{result.weight_updates} ({config.update_mode}), {held}"
    table.add_row("weight updates (mode)", updates)
    kind = "simulated" if clock == "virtual" else "real"
    rate = result.groups / result.elapsed if result.elapsed > 0 else math.inf
    table.add_row("throughput", f"{rate:.1f} groups/s ({kind} clock)")
    table.add_row("time", f"{result.elapsed:.1f} s {kind}, {wall:.1f} s wall")
    table.add_row("seed", f"{config.seed}")
    return table


def _plot(matplotlib: Any, result: ToolDemoResult, path: Path) -> None:
    matplotlib.use("Agg")
    pyplot = importlib.import_module("matplotlib.pyplot")
    steps = [0, *(m.step for m in result.steps)]
    figure, axes = pyplot.subplots(figsize=(7, 4))
    axes.plot(
        steps,
        [result.initial_tool_call_rate, *(m.policy_tool_call_rate for m in result.steps)],
        label="tool-call rate (policy)",
    )
    axes.plot(
        steps, [result.initial_accuracy, *(m.accuracy for m in result.steps)], label="accuracy"
    )
    axes.plot(
        steps[1:],
        [m.tool_call_rate for m in result.steps],
        linestyle="--",
        label="tool-call rate (seen)",
    )
    axes.plot(steps[1:], [m.mean_reward for m in result.steps], linestyle="--", label="mean reward")
    axes.set_xlabel("training step")
    axes.set_ylim(0.0, 1.02)
    axes.set_title(f"trio-rollouts demo --task tool (seed {result.config.seed})")
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)


def run_tool_command(
    config: ToolDemoConfig,
    *,
    clock: str,
    out: Path | None,
    overwrite: bool,
    plot: Path | None,
    matplotlib: Any,
) -> None:
    """Run the tool demo as ``trio-rollouts demo --task tool`` does: the live display on
    stderr, the summary on stdout, ``--out`` and ``--plot`` written at the end."""
    if out is not None and not overwrite:
        refuse_existing_out(out, resumable=False)
    console = stderr_console()
    display = _ToolDisplay(console, config.steps, max(1, config.steps // 8))
    out_file: IO[str] | None = None
    start = time.perf_counter()
    try:
        if out is not None:
            out_file = open(out, "w", encoding="utf-8")  # noqa: SIM115 - closed below
        with display.live:
            result = run(
                _main,
                config,
                display,
                out_file,
                clock=trio.testing.MockClock(autojump_threshold=0) if clock == "virtual" else None,
            )
    finally:
        if out_file is not None:
            out_file.close()
        end_live(console)
    wall = time.perf_counter() - start
    stdout_console().print(_summary(result, wall, clock))
    if out is not None:
        click.echo(f"wrote {result.groups} groups to {out}", err=True)
    if plot is not None:
        _plot(matplotlib, result, plot)
        click.echo(f"wrote the learning curve to {plot}", err=True)


async def _main(
    config: ToolDemoConfig, display: _ToolDisplay, out: IO[str] | None
) -> ToolDemoResult:
    return await run_tool_demo(config, on_start=display.on_start, on_step=display.on_step, out=out)
