"""The demo publishes its weights with ``stream.weight_update``: every mode learns, the
staleness bound holds, the summary reports staleness and the time spent paused, and a
seed fixes every number in every mode.

``run_demo`` runs on pytest-trio's ``autojump_clock``; the CLI on its own virtual clock.
Nothing here depends on wall time.
"""

from __future__ import annotations

import io
import math
import re
from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing
from _cli_helpers import invoke
from click.testing import Result

import trio_rollouts as tr
from trio_rollouts.cli._demo import AnswerTablePolicy, DemoConfig, DemoResult, run_demo
from trio_rollouts.inference import WeightUpdateMode

MODES: list[WeightUpdateMode] = ["drain", "restart", "keep", "abort"]
SMALL = {"num_problems": 8, "groups_per_step": 4, "steps": 20}


def small(**changes: object) -> DemoConfig:
    """The small demo (it learns in 20 steps), with ``changes``."""
    return DemoConfig(**{**SMALL, **changes})  # type: ignore[arg-type]


def groups_written(out: io.StringIO) -> list[tr.RolloutGroup]:
    return list(tr.load_jsonl(io.StringIO(out.getvalue()), tr.RolloutGroup))


SMALL_DEMO = ["--problems", "8", "--groups", "4", "--lag", "2", "--steps", "20"]


def summary_row(result: Result, label: str) -> str:
    found = re.search(rf"{re.escape(label)}\s*│\s*(.*?)\s*│", result.stdout)
    assert found, result.output
    return found[1]


def staleness(result: Result) -> tuple[float, int]:
    found = re.fullmatch(
        r"([\d.]+) / (\d+) policy epochs.*", summary_row(result, "staleness mean / max")
    )
    assert found, result.output
    return float(found[1]), int(found[2])


def paused(result: Result) -> float:
    found = re.fullmatch(
        r"([\d.]+) s simulated, .* of the run", summary_row(result, "time paused for updates")
    )
    assert found, result.output
    return float(found[1])


# --------------------------------------------------------------------------- run_demo


@pytest.mark.parametrize("mode", MODES)
async def test_each_mode_updates_every_step_and_learns(
    autojump_clock: trio.testing.MockClock, mode: WeightUpdateMode
) -> None:
    result = await run_demo(small(update_mode=mode))
    assert result.initial_accuracy < 0.2
    assert result.final_accuracy >= 0.9
    assert result.weight_updates == len(result.steps) == 20
    assert [m.epoch for m in result.steps] == list(range(1, 21))
    assert result.staleness_max <= 2  # --lag 2
    assert result.stale == 0  # no bound
    assert result.mixed == 0  # the embedded backend stamps where the epoch changed
    spanning = sum(m.mixed_epoch for m in result.steps)
    assert all(m.pause_seconds >= 0 and m.update_seconds >= m.pause_seconds for m in result.steps)
    assert result.paused_seconds == pytest.approx(math.fsum(m.update_seconds for m in result.steps))
    if mode == "drain":
        # Calls in flight finish under the old weights: nothing held, nothing spans an
        # update, and waiting for them is time paused.
        assert (result.held, result.restarted, spanning) == (0, 0, 0)
        assert result.paused_seconds > 0
    elif mode == "restart":
        # Calls in flight are cancelled and generated again: no waiting.
        assert result.held == result.restarted > 0
        assert spanning == 0
        assert result.paused_seconds == 0
    else:
        # keep / abort: calls in flight are held and go on under the new weights.
        assert result.held > 0
        assert result.restarted == 0
        assert spanning > 0


async def test_keep_pauses_much_less_than_drain(autojump_clock: trio.testing.MockClock) -> None:
    keep = await run_demo(small(update_mode="keep"))
    drain = await run_demo(small(update_mode="drain"))
    # keep waits at most for the token steps in progress; drain for whole calls.
    assert keep.paused_seconds < drain.paused_seconds / 2


@pytest.mark.parametrize("mode", MODES)
async def test_max_staleness_0_trains_on_groups_of_the_current_epoch_only(
    autojump_clock: trio.testing.MockClock, mode: WeightUpdateMode
) -> None:
    out = io.StringIO()
    config = small(update_mode=mode, max_staleness=0, steps=6)
    result = await run_demo(config, out=out)
    assert result.staleness_max == 0
    assert all(m.staleness_mean == 0 and m.mixed_epoch == 0 for m in result.steps)
    # What was generated ahead under older weights was regenerated.
    assert result.stale + result.restarted > 0
    groups = groups_written(out)
    assert len(groups) == 6 * 4
    for number, group in enumerate(groups):
        trainer_epoch = number // 4
        assert group.start_epoch == trainer_epoch
        for rollout in group:
            assert [tuple(b) for b in rollout.policy_epoch[0]] == [(0, trainer_epoch)]


async def test_max_staleness_1_bounds_the_staleness_at_1(
    autojump_clock: trio.testing.MockClock,
) -> None:
    result = await run_demo(small(max_staleness=1))
    assert result.staleness_max == 1
    assert result.final_accuracy >= 0.9


async def test_the_weights_change_only_inside_the_update(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under drain every rollout was sampled with the weights of the epoch it is stamped
    with: the trainer never changes the table while a call could be sampling."""
    logits: list[np.ndarray] = []
    grpo_step = AnswerTablePolicy.grpo_step

    def recording(self: AnswerTablePolicy, *args: object) -> None:
        logits.append(self.logits.copy())  # the weights of epoch len(logits) - 1
        grpo_step(self, *args)

    monkeypatch.setattr(AnswerTablePolicy, "grpo_step", recording)
    out = io.StringIO()
    await run_demo(small(update_mode="drain", steps=8), out=out)
    checked = 0
    for group in groups_written(out):
        for rollout in group:
            [(_, epoch)] = rollout.policy_epoch[0]  # drain: no rollout spans an update
            row = logits[epoch][int(str(rollout.problem_id).removeprefix("arithmetic-"))]
            probabilities = np.exp(row) / np.exp(row).sum()
            sampled = math.exp(sum(rollout.logprobs[0]))
            assert np.isclose(probabilities, sampled, rtol=1e-9, atol=0).any()
            checked += 1
    assert checked == 8 * 4 * 8


@pytest.mark.parametrize(("mode", "bound"), [(m, None) for m in MODES] + [("keep", 1)])
def test_a_seed_fixes_every_number_in_every_mode(mode: WeightUpdateMode, bound: int | None) -> None:
    def once() -> tuple[DemoResult, str]:
        out = io.StringIO()
        config = small(update_mode=mode, max_staleness=bound, seed=3)
        result = trio.run(
            lambda: run_demo(config, out=out), clock=trio.testing.MockClock(autojump_threshold=0)
        )
        return result, out.getvalue()

    # Trio schedules tasks that are ready together in a varying order; several runs give
    # that a chance to show.
    first, *others = [once() for _ in range(3)]
    assert all(other == first for other in others)


def test_the_config_refuses_a_bad_mode_or_bound() -> None:
    with pytest.raises(ValueError, match=r"update_mode must be one of 'drain'.*got 'pause'"):
        DemoConfig(update_mode="pause")
    with pytest.raises(ValueError, match=r"max_staleness must be None or an int >= 0, got -1"):
        DemoConfig(max_staleness=-1)
    assert DemoConfig().update_mode == "keep"
    assert DemoConfig().max_staleness is None


# --------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("mode", MODES)
def test_the_cli_runs_each_mode_and_shows_it(mode: WeightUpdateMode) -> None:
    result = invoke("demo", *SMALL_DEMO, "--update-mode", mode)
    assert result.exit_code == 0, result.output
    start, final = (float(x) for x in summary_row(result, "accuracy").split(" -> "))
    assert start < 0.2
    assert final >= 0.9
    assert summary_row(result, "weight updates (mode)").startswith(f"20 ({mode}), ")
    assert staleness(result)[1] <= 2
    assert paused(result) >= 0


def test_the_cli_default_mode_is_keep_and_the_summary_shows_the_time_paused() -> None:
    result = invoke("demo", *SMALL_DEMO)
    assert result.exit_code == 0, result.output
    assert summary_row(result, "weight updates (mode)").startswith("20 (keep), ")
    assert paused(result) > 0
    assert "paused (ms)" in result.stderr  # the learning-curve rows show it per step
    drained = invoke("demo", *SMALL_DEMO, "--update-mode", "drain")
    assert paused(drained) > paused(result)


def test_the_cli_max_staleness_0_gives_staleness_0() -> None:
    result = invoke("demo", *SMALL_DEMO, "--steps", "6", "--max-staleness", "0")
    assert result.exit_code == 0, result.output
    assert staleness(result) == (0.0, 0)
    assert "(bound: 0)" in summary_row(result, "staleness mean / max")
    stale, restarted = (
        int(x) for x in summary_row(result, "regenerated: stale / restarted").split(" / ")
    )
    assert stale > 0
    assert restarted == 0


def test_the_cli_refuses_a_negative_max_staleness() -> None:
    result = invoke("demo", *SMALL_DEMO, "--max-staleness", "-1")
    assert result.exit_code == 2
    assert "Invalid value for '--max-staleness': -1 is not in the range x>=0." in result.stderr
    assert "training" not in result.stderr  # refused before any work


def test_the_cli_refuses_an_unknown_update_mode() -> None:
    result = invoke("demo", *SMALL_DEMO, "--update-mode", "pause")
    assert result.exit_code == 2
    assert "Invalid value for '--update-mode'" in result.stderr


def test_the_cli_out_is_the_same_for_a_seed_with_a_bound(tmp_path: Path) -> None:
    args = [*SMALL_DEMO, "--seed", "3", "--update-mode", "abort", "--max-staleness", "1"]
    for i in range(2):
        assert invoke("demo", *args, "--out", tmp_path / f"{i}.jsonl").exit_code == 0
    assert (tmp_path / "0.jsonl").read_bytes() == (tmp_path / "1.jsonl").read_bytes()
