"""``trio-rollouts demo --task tool``: the policy learns to call the calculator (tool-call
rate and accuracy rise from near chance), a seed fixes every number, and the command shows
the curve and its summary, refusing the options it does not support.

``run_tool_demo`` runs on pytest-trio's ``autojump_clock``; the CLI on its own virtual
clock. Nothing here depends on wall time.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing
from _cli_helpers import error_lines, invoke
from click.testing import Result

import trio_rollouts as tr
from trio_rollouts.cli._demo import ToolDemoConfig, ToolDemoResult, ToolStepMetrics, run_tool_demo

#: A tool demo that learns in about a second of wall time.
SMALL = {"steps": 10, "groups_per_step": 2, "num_problems": 8, "learning_rate": 3.0}
SMALL_TOOL = ["--task", "tool", "--steps", "10", "--groups", "2", "--problems", "8", "--lr", "3"]


def small(**changes: object) -> ToolDemoConfig:
    return ToolDemoConfig(**{**SMALL, **changes})  # type: ignore[arg-type]


def summary_pair(result: Result, label: str) -> tuple[float, float]:
    found = re.search(rf"{re.escape(label)}\s*│\s*([\d.]+) -> ([\d.]+)", result.stdout)
    assert found, result.output
    return float(found[1]), float(found[2])


async def test_the_tool_demo_learns_to_call_the_calculator(
    autojump_clock: trio.testing.MockClock,
) -> None:
    starts: list[tuple[float, float]] = []
    seen: list[int] = []
    result = await run_tool_demo(
        small(),
        on_start=lambda rate, accuracy: starts.append((rate, accuracy)),
        on_step=lambda m: seen.append(m.step),
    )
    assert isinstance(result, ToolDemoResult)
    assert starts == [(result.initial_tool_call_rate, result.initial_accuracy)]
    assert seen == list(range(1, 11))
    # Near chance at first (K = 4): tool calls about 1/4, accuracy about 1/16.
    assert 0.15 < result.initial_tool_call_rate < 0.35
    assert result.initial_accuracy < 0.1
    assert result.final_tool_call_rate > 0.9
    assert result.final_accuracy > 0.85
    steps = result.steps
    assert [m.step for m in steps] == list(range(1, 11))
    # What the episodes did rises too: tool calls seen, reward, turns.
    first, last = steps[:3], steps[-3:]
    assert (
        np.mean([m.tool_call_rate for m in last]) > np.mean([m.tool_call_rate for m in first]) + 0.3
    )
    assert np.mean([m.mean_reward for m in last]) > np.mean([m.mean_reward for m in first]) + 0.3
    assert np.mean([m.mean_turns for m in last]) > np.mean([m.mean_turns for m in first]) + 0.3
    for m in steps:
        assert 1.0 <= m.mean_turns <= 2.0  # it answers after one call at most
        # Only episodes that called the tool can be right.
        assert m.mean_reward <= m.tool_call_rate
        assert m.accuracy <= m.policy_tool_call_rate
        assert m.training.epoch == m.step
    assert result.weight_updates == 10
    assert result.groups == 20
    assert result.rollouts == 160


def learned(m: ToolStepMetrics) -> tuple[object, ...]:
    """Every number of a step but its times."""
    t = m.training
    return (
        m.step,
        m.mean_reward,
        m.tool_call_rate,
        m.policy_tool_call_rate,
        m.accuracy,
        m.mean_turns,
        t.epoch,
        t.filtered,
        t.staleness_mean,
        t.staleness_max,
        t.mixed_epoch,
        t.held,
    )


async def run_small(seed: int) -> tuple[ToolDemoResult, str]:
    out = io.StringIO()
    result = await run_tool_demo(small(steps=4, seed=seed), out=out)
    return result, out.getvalue()


async def test_a_seed_fixes_every_number_and_every_group(
    autojump_clock: trio.testing.MockClock,
) -> None:
    first, first_out = await run_small(seed=3)
    again, again_out = await run_small(seed=3)
    _, other_out = await run_small(seed=4)
    # The clock goes on between the runs, so times agree up to rounding only.
    assert [learned(m) for m in first.steps] == [learned(m) for m in again.steps]
    assert first.elapsed == pytest.approx(again.elapsed, abs=1e-9)
    assert first_out == again_out
    assert other_out != first_out


async def test_out_holds_the_episodes_trained_on(autojump_clock: trio.testing.MockClock) -> None:
    result, text = await run_small(seed=0)
    groups = list(tr.load_jsonl(io.StringIO(text), tr.RolloutGroup))
    assert len(groups) == result.groups
    renderer = tr.PlainRenderer()
    for group in groups:
        assert len(group) == result.config.group_size
        for rollout in group:
            assert isinstance(rollout, tr.TokenRollout)
            assert rollout.env_id == "calculator"
            assert rollout.fidelity == "exact"
            episode = rollout.extra["episode"]
            conversation = renderer.decode(rollout.trajectory[0])
            assert conversation.count("<|tool|>\n") == episode["tool_calls"]
            assert episode["turns"] == episode["tool_calls"] + 1
            assert episode["finish"] == "done"


def test_the_config_is_checked() -> None:
    with pytest.raises(ValueError, match="learning_rate must be > 0"):
        ToolDemoConfig(learning_rate=0.0)
    with pytest.raises(ValueError, match="update_mode must be one of"):
        ToolDemoConfig(update_mode="now")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_candidates"):
        ToolDemoConfig(num_candidates=1)


# --------------------------------------------------------------------------- the command


def test_demo_task_tool_shows_the_curve_rising() -> None:
    result = invoke("demo", *SMALL_TOOL)
    assert result.exit_code == 0, result.output
    rate = summary_pair(result, "tool-call rate (policy)")
    accuracy = summary_pair(result, "accuracy (policy)")
    seen = summary_pair(result, "tool-call rate seen (step 1 -> last)")
    assert rate[0] < 0.35 < 0.9 < rate[1]
    assert accuracy[0] < 0.1 < 0.85 < accuracy[1]
    assert seen[1] > seen[0]
    assert "mean turns (step 1 -> last)" in result.stdout
    header = "step  reward  tool calls seen  tool calls policy  accuracy  turns  filtered"
    assert header in result.stderr
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", result.stderr, re.M)
    assert [int(row[0]) for row in rows] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert float(rows[-1][4]) == accuracy[1]


def test_the_summary_quotes_values_the_table_shows() -> None:
    # 16 steps: a row every 2 steps, and one for step 1, which the summary quotes.
    result = invoke("demo", *SMALL_TOOL, "--steps", "16")
    assert result.exit_code == 0, result.output
    start = re.search(r"^\s+0\s+-\s+-\s+([\d.]+)\s+([\d.]+)\s*$", result.stderr, re.M)
    assert start, result.stderr
    rows = {
        int(row[0]): row[1:]
        for row in re.findall(
            r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+\d+\s*$",
            result.stderr,
            re.M,
        )
    }
    assert list(rows) == [1, 2, 4, 6, 8, 10, 12, 14, 16]
    first, last = rows[1], rows[16]
    # Each summary pair, as printed, and the table's cells it comes from.
    quoted = {
        "tool-call rate (policy)": (start[1], last[2]),
        "accuracy (policy)": (start[2], last[3]),
        "tool-call rate seen (step 1 -> last)": (first[1], last[1]),
        "mean reward (step 1 -> last)": (first[0], last[0]),
        "mean turns (step 1 -> last)": (first[4], last[4]),
    }
    for label, cells in quoted.items():
        found = re.search(rf"{re.escape(label)}\s*│\s*([\d.]+) -> ([\d.]+)", result.stdout)
        assert found, result.stdout
        assert (found[1], found[2]) == cells, label


def test_demo_task_tool_is_reproducible_for_a_seed() -> None:
    runs = [invoke("demo", *SMALL_TOOL, "--steps", "3", "--seed", "5") for _ in range(2)]
    tables = [re.sub(r"[\d.]+ s wall", "", run.stdout) for run in runs]
    assert tables[0] == tables[1]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--checkpoint", "ckpt"], "--checkpoint is not supported with --task tool"),
        (["--checkpoint-every", "3"], "--checkpoint-every is not supported with --task tool"),
    ],
)
def test_demo_task_tool_refuses_checkpoints(flags: list[str], named: str) -> None:
    result = invoke("demo", "--task", "tool", *flags)
    assert result.exit_code == 2
    assert named in result.stderr
    assert "ckpt" not in result.stdout


def test_demo_task_tool_refuses_more_groups_in_flight_than_problems() -> None:
    result = invoke("demo", "--task", "tool", "--problems", "4", "--groups", "4")
    assert result.exit_code == 2
    assert "exceeds --problems" in result.stderr


def test_demo_task_tool_refuses_an_existing_out(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    out.write_text("keep\n")
    result = invoke("demo", *SMALL_TOOL, "--steps", "2", "--out", out)
    assert result.exit_code != 0
    assert error_lines(result)
    assert out.read_text() == "keep\n"
    result = invoke("demo", *SMALL_TOOL, "--steps", "2", "--out", out, "--overwrite")
    assert result.exit_code == 0, result.output
    assert len(list(tr.load_jsonl(out, tr.RolloutGroup))) == 4
    assert f"wrote 4 groups to {out}" in result.stderr


def test_the_default_task_is_still_arithmetic() -> None:
    small_demo = ["--problems", "8", "--groups", "4", "--lag", "2", "--steps", "4"]
    default = invoke("demo", *small_demo)
    arithmetic = invoke("demo", "--task", "arithmetic", *small_demo)
    for result in (default, arithmetic):
        assert result.exit_code == 0, result.output
        assert "trio-rollouts demo: summary" in result.stdout
        assert "tool-call" not in result.stdout
    assert re.sub(r"[\d.]+ s wall", "", default.stdout) == re.sub(
        r"[\d.]+ s wall", "", arithmetic.stdout
    )


def test_the_help_names_the_tasks() -> None:
    help_text = invoke("demo", "--help").stdout
    assert "--task [arithmetic|tool]" in help_text
    assert "16 with --task tool" in help_text
