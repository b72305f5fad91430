"""``trio-rollouts demo``: an asynchronous GRPO loop that visibly learns, with no server
and no GPU, and its live display (a progress bar, rows of the learning curve, a summary
table, an optional plot). With ``--checkpoint DIR`` it saves checkpoints and, rerun on the
same directory, goes on from the last one. ``--task tool`` runs the tool demo instead
(multi-turn episodes with a calculator, :mod:`._demo_tool`)."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import math
import shlex
import time
import urllib.parse
from pathlib import Path
from typing import IO, Any

import click
import trio
import trio.testing
from click.core import ParameterSource
from rich.console import Console
from rich.table import Table

from trio_rollouts.cli._common import (
    end_live,
    interrupted,
    out_option,
    overwrite_option,
    refuse_existing_out,
    reports_errors,
    run,
    stderr_console,
    stdout_console,
)
from trio_rollouts.cli._demo import (
    DemoCheckpoint,
    DemoCheckpointMismatch,
    DemoConfig,
    DemoResult,
    StepMetrics,
    ToolDemoConfig,
    load_demo_checkpoint,
    run_demo,
)
from trio_rollouts.cli._demo_display import HELD_BY_MODE, TrainingProgress
from trio_rollouts.cli._demo_tool import run_tool_command
from trio_rollouts.inference import WeightUpdateMode

__all__ = ["demo"]


class _DemoDisplay:
    """The demo's live view: a progress bar with the latest step's metrics, and a row
    of the learning curve every ``log_every`` steps."""

    def __init__(self, console: Console, steps: int, log_every: int, clock: str) -> None:
        self.console = console
        self.log_every = log_every
        self.unit = "sim s" if clock == "virtual" else "s"
        self.bar = TrainingProgress(console, steps)
        self.live = self.bar.live

    def on_start(self, initial_accuracy: float) -> None:
        self.console.print(
            "step    reward  accuracy  groups/s  filtered  staleness (max)  paused (ms)"
        )
        self.console.print(f"   0         -  {initial_accuracy:8.3f}")

    def on_resume(self, checkpoint: DemoCheckpoint) -> None:
        self.bar.advance(checkpoint.step)
        self.console.print(
            f"resumed from step {checkpoint.step} (accuracy "
            f"{checkpoint.history[-1].accuracy:.3f}), checkpoint {checkpoint.path}"
        )

    def on_step(self, m: StepMetrics) -> None:
        self.bar.advance(latest=f"reward {m.mean_reward:.3f}  accuracy {m.accuracy:.3f}")
        if m.step % self.log_every == 0 or m.step == self.bar.steps:
            speed = m.groups_per_second
            rate = f"{speed:8.1f}" if math.isfinite(speed) else "     inf"
            self.console.print(
                f"{m.step:4d}    {m.mean_reward:6.3f}  {m.accuracy:8.3f}  {rate}  "
                f"{m.filtered:8d}  {m.staleness_mean:11.2f} ({m.staleness_max})  "
                f"{m.update_seconds * 1000:11.1f}"
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
    config = result.config
    bound = "none" if config.max_staleness is None else f"{config.max_staleness}"
    table.add_row(
        "staleness mean / max",
        f"{result.staleness_mean:.2f} / {result.staleness_max} policy epochs (bound: {bound})",
    )
    held = f"{result.held} calls {HELD_BY_MODE[config.update_mode]}"
    if config.max_staleness is not None and config.update_mode in ("keep", "abort"):
        held += " or cancelled"
    table.add_row(
        "weight updates (mode)", f"{result.weight_updates} ({config.update_mode}), {held}"
    )
    table.add_row("regenerated: stale / restarted", f"{result.stale} / {result.restarted}")
    table.add_row("rollouts spanning an update", f"{sum(m.mixed_epoch for m in steps)}")
    kind = "simulated" if clock == "virtual" else "real"
    share = result.paused_seconds / clock_seconds if clock_seconds > 0 else 0.0
    table.add_row(
        "time paused for updates",
        f"{result.paused_seconds:.2f} s {kind}, {share:.1%} of the run",
    )
    rate = result.groups / clock_seconds if clock_seconds > 0 else math.inf
    table.add_row("throughput", f"{rate:.1f} groups/s ({kind} clock)")
    table.add_row("time", f"{clock_seconds:.1f} s {kind}, {wall:.1f} s wall")
    table.add_row("seed", f"{result.config.seed}")
    if config.checkpoint_dir is not None:
        saved = f"every {config.checkpoint_every} steps to {config.checkpoint_dir}"
        if result.resumed_from is not None:
            saved = f"resumed from step {result.resumed_from}; {saved}"
        table.add_row("checkpoint", saved)
    return table


#: The flag of each DemoConfig field that the command sets.
_FLAGS = {
    "seed": "--seed",
    "groups_per_step": "--groups",
    "group_size": "--group-size",
    "lag": "--lag",
    "num_problems": "--problems",
    "learning_rate": "--lr",
    "filter_groups": "--filter/--no-filter",
    "update_mode": "--update-mode",
    "max_staleness": "--max-staleness",
}


def _load_checkpoint(config: DemoConfig) -> DemoCheckpoint | None:
    """The checkpoint to resume, refused (naming the flags) when its settings differ."""
    try:
        return load_demo_checkpoint(config)
    except DemoCheckpointMismatch as exc:
        shown = "; ".join(
            f"{_FLAGS.get(name, name)} is {saved} in the checkpoint, {mine} in this run"
            for name, saved, mine in exc.differences
        )
        msg = (
            f"{exc.path} was written by a run with other settings: {shown}. Rerun with "
            "the same settings (--steps may differ) to resume it, or choose another "
            "--checkpoint directory"
        )
        raise click.ClickException(msg) from None


def _continue_out(out: Path, checkpoint: DemoCheckpoint) -> None:
    """Keep the first ``checkpoint.groups`` lines of ``out`` (the groups trained on up to
    the checkpoint) and drop the rest (groups whose training the interruption lost)."""
    if not out.exists():
        msg = (
            f"{out} does not exist, but the checkpoint ({checkpoint.path}) is at step "
            f"{checkpoint.step}: pass the --out of the run that wrote it, or --overwrite "
            "to write only this run's groups"
        )
        raise click.UsageError(msg)
    keep = checkpoint.groups
    with open(out, "r+b") as file:
        for _ in range(keep):
            if not file.readline().endswith(b"\n"):
                msg = (
                    f"{out} holds fewer than the {keep} groups trained on up to the "
                    f"checkpoint ({checkpoint.path}, step {checkpoint.step}): is it the "
                    "--out of that run? Pass --overwrite to write only this run's groups"
                )
                raise click.ClickException(msg)
        kept = file.tell()
        rest = file.read()
        # A torn last line (a crash mid-write) counts as a group dropped.
        dropped = rest.count(b"\n") + (1 if rest and not rest.endswith(b"\n") else 0)
        file.truncate(kept)
    if dropped:
        click.echo(
            f"dropped the last {dropped} groups of {out}: trained on after the checkpoint "
            f"of step {checkpoint.step}, they are done again",
            err=True,
        )


def _is_checkout(folder: Path) -> bool:
    """Whether ``folder`` is a source checkout of this project (its ``pyproject.toml``)."""
    try:
        text = (folder / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return False
    return 'name = "trio-rollouts"' in text


def plot_install_hint(package_root: Path, direct_url: str | None) -> str:
    """The command that installs ``--plot``'s matplotlib where the package is: into the
    checkout it runs from (``package_root``, the folder above the package, when that is
    a checkout: an editable install or ``PYTHONPATH``), into the folder pip installed it
    from (``direct_url``: the distribution's ``direct_url.json``), else as the extra."""
    if _is_checkout(package_root):
        return f"pip install -e {shlex.quote(f'{package_root}[plot]')} (or pip install matplotlib)"
    data: Any = None
    if direct_url:
        try:
            data = json.loads(direct_url)
        except json.JSONDecodeError:
            data = None
    if isinstance(data, dict) and isinstance(data.get("dir_info"), dict):
        url = urllib.parse.urlparse(str(data.get("url", "")))
        folder = Path(urllib.parse.unquote(url.path))
        if url.scheme == "file" and _is_checkout(folder):
            editable = "-e " if data["dir_info"].get("editable") else ""
            target = shlex.quote(f"{folder}[plot]")
            return f"pip install {editable}{target} (or pip install matplotlib)"
    return "pip install 'trio-rollouts[plot]' (or pip install matplotlib)"


def _installed_direct_url() -> str | None:
    try:
        return importlib.metadata.distribution("trio-rollouts").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return None


def _require_matplotlib() -> Any:
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        package_root = Path(__file__).resolve().parent.parent.parent
        hint = plot_install_hint(package_root, _installed_direct_url())
        msg = f"--plot needs matplotlib, which is not installed; install it with: {hint}"
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


#: The defaults that depend on --task: (arithmetic, tool).
_TASK_DEFAULTS = {"steps": (36, 16), "groups_per_step": (8, 4)}


@click.command()
@click.option(
    "--task",
    type=click.Choice(["arithmetic", "tool"]),
    default="arithmetic",
    show_default=True,
    help="arithmetic: one-turn answers to arithmetic problems (a table policy per "
    "problem); tool: multi-turn episodes with a calculator tool (CalculatorEnvironment), "
    "where the policy learns to call the tool and answer with its result.",
)
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Seeds the problems, the initial policy and every sample; on the virtual clock "
    "one seed gives the same run, byte for byte.",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=None,
    show_default="36; 16 with --task tool",
    help="Training steps; each takes one batch of --groups groups and publishes a new "
    "policy epoch.",
)
@click.option(
    "--groups",
    "groups_per_step",
    type=click.IntRange(min=1),
    default=None,
    show_default="8; 4 with --task tool",
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
    "--problems",
    "num_problems",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Arithmetic problems the policy learns (at least --groups x --lag).",
)
@click.option(
    "--lr",
    "learning_rate",
    type=click.FloatRange(min=0, min_open=True),
    default=2.0,
    show_default=True,
    help="Learning rate of the policy-gradient step on the policy's logits.",
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
    "--update-mode",
    type=click.Choice(["drain", "restart", "keep", "abort"]),
    default="keep",
    show_default=True,
    help="How each step's weight update (stream.weight_update) treats the calls in "
    "flight: keep holds them and continues them under the new weights; abort stops them "
    "and continues them from their partial output; drain lets them finish under the old "
    "weights first; restart cancels them and generates their groups again.",
)
@click.option(
    "--max-staleness",
    type=click.IntRange(min=0),
    default=None,
    show_default="no bound but --lag",
    help="Regenerate any group that would reach the trainer more than this many policy "
    "epochs after the epoch it started under (0: on-policy only).",
)
@click.option(
    "--checkpoint",
    "checkpoint_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Save a checkpoint (weights, prompt source, metrics) in this directory, created "
    "if missing, every --checkpoint-every steps and at the end; when it holds one, go on "
    "from it (same settings; --steps may be larger). Rerun the same command after Ctrl-C "
    "or a crash to continue. Not with --task tool.",
)
@click.option(
    "--checkpoint-every",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Steps between checkpoints (with --checkpoint).",
)
@out_option(
    "Write every group the trainer took to this JSON-lines file (resuming a "
    "--checkpoint, the file of the interrupted run is continued).",
    required=False,
)
@overwrite_option
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Draw reward and accuracy per step to this image (needs matplotlib).",
)
@reports_errors
def demo(
    task: str,
    seed: int,
    steps: int | None,
    groups_per_step: int | None,
    group_size: int,
    lag: int,
    num_problems: int,
    learning_rate: float,
    filter_groups: bool,
    clock: str,
    update_mode: WeightUpdateMode,
    max_staleness: int | None,
    checkpoint_dir: Path | None,
    checkpoint_every: int,
    out: Path | None,
    overwrite: bool,
    plot: Path | None,
) -> None:
    """Train a tiny policy on arithmetic with asynchronous GRPO (no server, no GPU).

    The policy is a numpy table of logits over candidate answers per problem, served by
    the embedded inference backend; rollouts stream from the grouped pipeline with
    bounded lag while the trainer computes GRPO advantages and applies a policy-gradient
    step inside a weight update of the stream (--update-mode), which pauses generation
    and publishes a new policy epoch. Accuracy is the policy's expected accuracy over all
    problems; it starts near chance (1/8).

    With --checkpoint DIR the run is resumable: interrupted (Ctrl-C, a crash), the same
    command goes on from the last checkpoint, and --out is continued.

    With --task tool the episodes are multi-turn (MultiTurnAgent, CalculatorEnvironment):
    the policy may call a calculator tool, then answers; only an answer with the tool's
    result is right. It starts by calling the tool about 1/4 of the time, and the summary
    shows the tool-call rate and the accuracy rising.
    """
    tool = task == "tool"
    context = click.get_current_context()
    if tool:
        for name in ("checkpoint_dir", "checkpoint_every"):
            if context.get_parameter_source(name) is not ParameterSource.DEFAULT:
                flag = "--" + name.removesuffix("_dir").replace("_", "-")
                msg = f"{flag} is not supported with --task tool (it saves no checkpoints)"
                raise click.UsageError(msg)
    if steps is None:
        steps = _TASK_DEFAULTS["steps"][tool]
    if groups_per_step is None:
        groups_per_step = _TASK_DEFAULTS["groups_per_step"][tool]
    matplotlib = _require_matplotlib() if plot is not None else None
    if groups_per_step * lag > num_problems:
        msg = (
            f"--groups x --lag ({groups_per_step * lag}) exceeds --problems ({num_problems}): "
            "groups generated at the same time would share problems; raise --problems"
        )
        raise click.UsageError(msg)
    # The settings both tasks take from the command line.
    settings: dict[str, Any] = {
        "seed": seed,
        "steps": steps,
        "groups_per_step": groups_per_step,
        "group_size": group_size,
        "lag": lag,
        "num_problems": num_problems,
        "learning_rate": learning_rate,
        "filter_groups": filter_groups,
        "update_mode": update_mode,
        "max_staleness": max_staleness,
    }
    if tool:
        run_tool_command(
            ToolDemoConfig(**settings),
            clock=clock,
            out=out,
            overwrite=overwrite,
            plot=plot,
            matplotlib=matplotlib,
        )
        return
    every_source = context.get_parameter_source("checkpoint_every")
    if checkpoint_dir is None and every_source is not ParameterSource.DEFAULT:
        msg = "--checkpoint-every needs --checkpoint DIR"
        raise click.UsageError(msg)
    config = DemoConfig(
        **settings, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every
    )
    checkpoint = None
    if checkpoint_dir is not None:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        checkpoint = _load_checkpoint(config)
    # Resuming, the groups of --out up to the checkpoint are kept and the run appends.
    appending = out is not None and checkpoint is not None and not overwrite
    if out is not None and not overwrite:
        if checkpoint is None:
            refuse_existing_out(out, resumable=False)
        else:
            _continue_out(out, checkpoint)
    console = stderr_console()
    display = _DemoDisplay(console, steps, max(1, steps // 12), clock)
    out_file: IO[str] | None = None
    start = time.perf_counter()
    try:
        try:
            if out is not None:
                mode = "a" if appending else "w"
                out_file = open(out, mode, encoding="utf-8")  # noqa: SIM115 - closed below
            with display.live:
                result = run(
                    _demo_main,
                    config,
                    display,
                    out_file,
                    clock=trio.testing.MockClock(autojump_threshold=0)
                    if clock == "virtual"
                    else None,
                )
        finally:
            if out_file is not None:
                out_file.close()
            end_live(console)
    except KeyboardInterrupt as exc:
        if checkpoint_dir is None:
            raise
        message = (
            "Interrupted. Run the same command again to go on from the last checkpoint "
            f"in {checkpoint_dir}."
        )
        raise interrupted(exc, message) from None
    wall = time.perf_counter() - start
    stdout_console().print(_demo_summary(result, wall, clock))
    if out is not None:
        before = checkpoint.groups if appending and checkpoint is not None else 0
        also = f" ({result.groups} in all)" if before else ""
        click.echo(f"wrote {result.groups - before} groups to {out}{also}", err=True)
    if plot is not None:
        _plot(matplotlib, result, plot)
        click.echo(f"wrote the learning curve to {plot}", err=True)


async def _demo_main(config: DemoConfig, display: _DemoDisplay, out: IO[str] | None) -> DemoResult:
    return await run_demo(
        config,
        on_start=display.on_start,
        on_step=display.on_step,
        on_resume=display.on_resume,
        out=out,
    )
