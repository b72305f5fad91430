"""The demo resumes from its checkpoints: a run interrupted after step ``k`` and run again
on its checkpoint directory goes on from the last checkpoint and learns as far as a run
never interrupted; counted from the checkpoints, every problem of every epoch is trained
on exactly once (or filtered once); a checkpoint of other settings is refused, naming
them; the checkpoint file is replaced atomically; and the command line's ``--checkpoint``
continues after Ctrl-C.

``run_demo`` runs on pytest-trio's ``autojump_clock`` (or a ``MockClock``); the CLI on
its own virtual clock. Interruptions are cancellations (or Ctrl-C) at a given step, so
nothing depends on wall time, except the one test that sends a real SIGINT.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from _cli_helpers import groups_in, invoke, lines
from click.testing import Result

import trio_rollouts as tr
from trio_rollouts.cli._demo import (
    DemoCheckpointMismatch,
    DemoConfig,
    DemoResult,
    StepMetrics,
    load_demo_checkpoint,
    run_demo,
)
from trio_rollouts.envs.arithmetic import make_problems
from trio_rollouts.inference import WeightUpdateMode

#: The module of the command (``trio_rollouts.cli.demo`` is the command itself).
demo_cli = importlib.import_module("trio_rollouts.cli.demo")
SMALL = {"num_problems": 8, "groups_per_step": 4, "steps": 20}
SMALL_DEMO = ["--problems", "8", "--groups", "4", "--lag", "2", "--steps", "20"]


def small(directory: Path, **changes: object) -> DemoConfig:
    """The small demo (it learns in 20 steps), checkpointing to ``directory``."""
    return DemoConfig(**{**SMALL, "checkpoint_dir": directory, **changes})  # type: ignore[arg-type]


async def interrupted_after(
    config: DemoConfig, step: int, out: io.StringIO | None = None
) -> list[StepMetrics]:
    """Run ``config`` and cancel it once step ``step`` is done (after its checkpoint, if
    it has one): the metrics of the steps it did."""
    seen: list[StepMetrics] = []
    with trio.CancelScope() as scope:

        def on_step(metrics: StepMetrics) -> None:
            seen.append(metrics)
            if metrics.step == step:
                scope.cancel()

        await run_demo(config, on_step=on_step, out=out)
    assert scope.cancelled_caught
    return seen


def checkpoint_data(directory: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((directory / "checkpoint.json").read_text())
    return data


def problem_ids(jsonl: str) -> list[str]:
    return [str(g[0].problem_id) for g in tr.load_jsonl(io.StringIO(jsonl), tr.RolloutGroup)]


def done_by_the_books(config: DemoConfig, state: dict[str, Any]) -> Counter[str]:
    """How many times each problem is done (trained on or filtered) according to the
    PromptSource state of a checkpoint: every draw of the epochs before ``state["epoch"]``
    and the first ``state["position"]`` of that epoch, minus the draws not done."""
    problems = make_problems(config.num_problems, config.seed)
    fresh = tr.PromptSource(problems, seed=config.seed)  # outside a pipeline: no books
    drawn = state["epoch"] * len(problems) + state["position"]
    done = Counter(fresh.draw().problem_id for _ in range(drawn))
    done.subtract(Counter(problem_id for _, problem_id in state["pending"]))
    assert min(done.values()) >= 0
    return done


# --------------------------------------------------------------------------- run_demo


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
async def test_a_resumed_run_learns_as_far_as_an_uninterrupted_one(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, seed: int
) -> None:
    whole = await run_demo(small(tmp_path / "whole", seed=seed))
    assert whole.resumed_from is None
    assert checkpoint_data(tmp_path / "whole")["step"] == 20  # the last step is saved

    config = small(tmp_path / "cut", seed=seed)
    before = await interrupted_after(config, 12)
    # Steps 11 and 12 were done after the checkpoint of step 10: they are lost.
    assert checkpoint_data(tmp_path / "cut")["step"] == 10
    resumed = await run_demo(config)

    assert resumed.resumed_from == 10
    assert [m.step for m in resumed.steps] == list(range(1, 21))
    assert resumed.steps[:10] == tuple(before[:10])  # the history, restored exactly
    assert resumed.steps[10:] != tuple(before[10:12])  # steps 11, 12 done again
    assert [m.epoch for m in resumed.steps] == list(range(1, 21))  # the epoch goes on
    assert resumed.weight_updates == 20
    assert (resumed.groups, resumed.rollouts) == (80, 640)
    assert resumed.initial_accuracy == whole.initial_accuracy < 0.2
    assert resumed.elapsed > resumed.steps[9].elapsed
    message = f"uninterrupted {whole.final_accuracy:.4f}, resumed {resumed.final_accuracy:.4f}"
    assert whole.final_accuracy >= 0.9, message
    assert resumed.final_accuracy >= 0.9, message
    assert resumed.final_accuracy == pytest.approx(whole.final_accuracy, abs=0.03), message


MODES: list[tuple[WeightUpdateMode, int | None]] = [
    ("keep", None),
    ("abort", None),
    ("drain", None),
    ("restart", None),  # calls in flight cancelled: their problems drawn again
    ("keep", 0),  # groups generated ahead regenerated as stale
]


@pytest.mark.parametrize(("mode", "bound"), MODES)
async def test_every_problem_of_each_epoch_is_trained_exactly_once_counted_from_checkpoints(
    autojump_clock: trio.testing.MockClock,
    tmp_path: Path,
    mode: WeightUpdateMode,
    bound: int | None,
) -> None:
    """Without filtering, a problem is done when the trainer takes its group, so the
    groups kept by the checkpoints (the interrupted run's up to its last checkpoint,
    then the resumed run's) are exactly the draws that the source's books say are
    done: each complete epoch once, nothing of the lost steps counted twice."""
    config = small(tmp_path, filter_groups=False, update_mode=mode, max_staleness=bound)
    first, second = io.StringIO(), io.StringIO()
    await interrupted_after(config, 13, out=first)
    saved_at = checkpoint_data(tmp_path)["step"]
    assert saved_at == 10
    assert len(problem_ids(first.getvalue())) == 13 * 4
    resumed = await run_demo(config, out=second)
    assert resumed.resumed_from == 10
    trained = problem_ids(first.getvalue())[: saved_at * 4] + problem_ids(second.getvalue())
    assert len(trained) == 20 * 4
    state = checkpoint_data(tmp_path)["prompts"]
    assert Counter(trained) == done_by_the_books(config, state)
    # The epochs before the oldest draw not done are complete: every problem was
    # trained on once in each, and at most once in each epoch begun since.
    complete = min([state["epoch"], *(epoch for epoch, _ in state["pending"])])
    assert state["epoch"] >= 9  # 80 groups of 8 problems: ten epochs begun at least
    times = Counter(trained).values()
    assert len(times) == 8
    assert complete <= min(times) <= max(times) <= state["epoch"] + 1


async def test_with_filtering_the_groups_trained_and_filtered_are_the_draws_done(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """A filtered group's problem is done for its epoch without being trained on: the
    trained groups are at most the books' count per problem, and the difference is the
    number filtered, as the checkpoints count them."""
    config = small(tmp_path)
    first, second = io.StringIO(), io.StringIO()
    await interrupted_after(config, 12, out=first)
    resumed = await run_demo(config, out=second)
    trained = Counter(problem_ids(first.getvalue())[:40] + problem_ids(second.getvalue()))
    done = done_by_the_books(config, checkpoint_data(tmp_path)["prompts"])
    assert all(trained[problem_id] <= done[problem_id] for problem_id in done)
    assert resumed.filtered > 0
    assert resumed.filtered == sum(m.filtered for m in resumed.steps)
    assert done.total() == trained.total() + resumed.filtered


def test_an_interrupted_and_resumed_run_is_the_same_for_a_seed(tmp_path: Path) -> None:
    def once(index: int) -> tuple[DemoResult, str, str]:
        config = small(tmp_path / str(index), seed=5)
        first, second = io.StringIO(), io.StringIO()
        clock = trio.testing.MockClock(autojump_threshold=0)
        trio.run(lambda: interrupted_after(config, 7, out=first), clock=clock)
        clock = trio.testing.MockClock(autojump_threshold=0)
        result = trio.run(lambda: run_demo(config, out=second), clock=clock)
        return attrs_without_config(result), first.getvalue(), second.getvalue()

    first, *others = [once(i) for i in range(3)]
    assert all(other == first for other in others)


def attrs_without_config(result: DemoResult) -> Any:
    return (result.steps, result.filtered, result.elapsed, result.held, result.resumed_from)


async def test_a_finished_run_resumed_does_nothing_and_reports_the_same(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    config = small(tmp_path, steps=6, checkpoint_every=4)
    whole = await run_demo(config)
    again = await run_demo(config)
    assert again.resumed_from == 6
    assert again.steps == whole.steps
    assert again.final_accuracy == whole.final_accuracy  # the logits, restored exactly
    assert (again.filtered, again.weight_updates, again.held) == (
        whole.filtered,
        whole.weight_updates,
        whole.held,
    )
    # More steps on the same checkpoint go on from it.
    longer = await run_demo(small(tmp_path, steps=8, checkpoint_every=4))
    assert longer.resumed_from == 6
    assert longer.steps[:6] == whole.steps
    assert [m.epoch for m in longer.steps] == list(range(1, 9))


async def test_a_checkpoint_of_other_settings_is_refused_naming_them(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    await run_demo(small(tmp_path, steps=2))
    with pytest.raises(DemoCheckpointMismatch) as caught:
        await run_demo(small(tmp_path, num_problems=12, seed=3))
    assert caught.value.differences == [("seed", "0", "3"), ("num_problems", "8", "12")]
    assert "seed is 0 in the checkpoint, 3 in this run" in str(caught.value)
    assert "num_problems is 8 in the checkpoint, 12 in this run" in str(caught.value)
    with pytest.raises(DemoCheckpointMismatch, match=r"update_mode is \"keep\" in the check"):
        await run_demo(small(tmp_path, update_mode="drain"))
    with pytest.raises(ValueError, match=r"holds step 2, past this run's last step \(1\)"):
        await run_demo(small(tmp_path, steps=1))
    # How long it runs and how often it saves may change.
    result = await run_demo(small(tmp_path, steps=3, checkpoint_every=1))
    assert result.resumed_from == 2


async def test_a_damaged_checkpoint_is_an_error_naming_the_file(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    (tmp_path / "checkpoint.json").write_text('{"format": "trio-rollouts.demo-checkpoint/1"')
    with pytest.raises(ValueError, match=r"checkpoint.json is not a valid demo checkpoint"):
        await run_demo(small(tmp_path))
    await run_demo(small(tmp_path / "good", steps=2))
    data = checkpoint_data(tmp_path / "good")
    data["logits"] = data["logits"][:3]
    (tmp_path / "checkpoint.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"logits must be 8 x 8 finite numbers"):
        await run_demo(small(tmp_path))


async def test_the_checkpoint_is_plain_json_of_one_instant(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    await interrupted_after(small(tmp_path, checkpoint_every=3), 7)
    data = checkpoint_data(tmp_path)
    assert data["format"] == "trio-rollouts.demo-checkpoint/1"
    assert (data["step"], data["policy_epoch"]) == (6, 6)
    assert len(data["history"]) == 6
    assert len(data["logits"]) == 8
    assert data["settings"]["num_problems"] == 8
    assert "steps" not in data["settings"]
    assert data["prompts"]["source"]["seed"] == 0
    assert os.listdir(tmp_path) == ["checkpoint.json"]  # no temporary file left
    loaded = load_demo_checkpoint(small(tmp_path))
    assert loaded is not None
    assert (loaded.step, loaded.groups) == (6, 24)
    assert loaded.history[-1].accuracy == data["history"][-1]["accuracy"]


async def test_a_crash_while_saving_leaves_the_old_checkpoint_whole(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    replace = os.replace
    saves = 0

    def crashing(source: str, destination: Path) -> None:
        nonlocal saves
        saves += 1
        if saves == 2:  # the checkpoint of step 10, written but not renamed
            msg = "the machine went down"
            raise OSError(msg)
        replace(source, destination)

    monkeypatch.setattr(os, "replace", crashing)
    with pytest.raises(OSError, match="the machine went down"):
        await run_demo(small(tmp_path))
    assert os.listdir(tmp_path) == ["checkpoint.json"]
    assert checkpoint_data(tmp_path)["step"] == 5
    monkeypatch.setattr(os, "replace", replace)
    resumed = await run_demo(small(tmp_path))
    assert resumed.resumed_from == 5
    assert resumed.final_accuracy >= 0.9


def test_the_config_checks_the_checkpoint_fields(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"checkpoint_every must be an int >= 1, got 0"):
        DemoConfig(checkpoint_every=0)
    assert DemoConfig(checkpoint_dir=str(tmp_path)).checkpoint_dir == tmp_path
    assert DemoConfig().checkpoint_dir is None
    assert DemoConfig().checkpoint_every == 5


# --------------------------------------------------------------------------- the CLI


def summary_row(result: Result, label: str) -> str:
    found = re.search(rf"{re.escape(label)}\s*│\s*(.*?)\s*│", result.stdout)
    assert found, result.output
    return found[1]


def final_accuracy(result: Result) -> float:
    return float(summary_row(result, "accuracy").split(" -> ")[1])


def test_the_cli_goes_on_from_its_checkpoint(tmp_path: Path) -> None:
    checkpoint, out = tmp_path / "new" / "ckpt", tmp_path / "o.jsonl"
    args = [*SMALL_DEMO, "--checkpoint", checkpoint, "--out", out]
    first = invoke("demo", *args, "--steps", "12")
    assert first.exit_code == 0, first.output
    assert (checkpoint / "checkpoint.json").is_file()  # the folder was created
    assert summary_row(first, "checkpoint").startswith("every 5 steps to")
    assert lines(out) == 48
    second = invoke("demo", *args)  # --steps 20
    assert second.exit_code == 0, second.output
    assert "resumed from step 12" in summary_row(second, "checkpoint")
    assert "resumed from step 12 (accuracy" in second.stderr
    assert summary_row(second, "steps (policy epochs)") == "20"
    assert summary_row(second, "groups / rollouts trained on") == "80 / 640"
    assert f"wrote 32 groups to {out} (80 in all)" in second.stderr
    assert len(groups_in(out)) == 80
    assert final_accuracy(second) >= 0.9


def test_the_cli_continues_after_ctrl_c(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint, out = tmp_path / "ckpt", tmp_path / "o.jsonl"
    args = ["demo", *SMALL_DEMO, "--checkpoint", checkpoint, "--out", out]
    on_step = demo_cli._DemoDisplay.on_step

    def ctrl_c_at_step_8(self: Any, metrics: StepMetrics) -> None:
        on_step(self, metrics)
        if metrics.step == 8:
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(demo_cli._DemoDisplay, "on_step", ctrl_c_at_step_8)
        stopped = invoke(*args)
    assert stopped.exit_code == 130, stopped.output
    assert "Run the same command again to go on from the last checkpoint" in stopped.stderr
    assert lines(out) == 8 * 4
    assert checkpoint_data(checkpoint)["step"] == 5

    again = invoke(*args)  # the same command
    assert again.exit_code == 0, again.output
    assert "dropped the last 12 groups" in again.stderr  # steps 6 to 8, done again
    assert "resumed from step 5" in summary_row(again, "checkpoint")
    assert len(groups_in(out)) == 80
    assert final_accuracy(again) >= 0.9
    uninterrupted = invoke("demo", *SMALL_DEMO, "--checkpoint", tmp_path / "whole")
    assert final_accuracy(again) == pytest.approx(final_accuracy(uninterrupted), abs=0.03)


def test_the_cli_refuses_a_checkpoint_of_other_settings_naming_the_flag(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    assert invoke("demo", *SMALL_DEMO, "--steps", "2", "--checkpoint", checkpoint).exit_code == 0
    result = invoke("demo", *SMALL_DEMO, "--problems", "12", "--checkpoint", checkpoint)
    assert result.exit_code == 1
    assert "--problems is 8 in the checkpoint, 12 in this run" in result.stderr
    assert "training" not in result.stderr  # refused before any work
    result = invoke("demo", *SMALL_DEMO, "--update-mode", "drain", "--checkpoint", checkpoint)
    assert '--update-mode is "keep" in the checkpoint, "drain" in this run' in result.stderr


def test_the_cli_checkpoint_flags_are_checked(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    result = invoke("demo", *SMALL_DEMO, "--checkpoint", a_file)
    assert result.exit_code == 2
    assert "Invalid value for '--checkpoint'" in result.stderr
    assert "is a file" in result.stderr
    result = invoke("demo", *SMALL_DEMO, "--checkpoint-every", "3")
    assert result.exit_code == 2
    assert "--checkpoint-every needs --checkpoint DIR" in result.stderr
    result = invoke("demo", *SMALL_DEMO, "--checkpoint", tmp_path / "c", "--checkpoint-every", "0")
    assert result.exit_code == 2


def test_the_cli_resuming_needs_the_out_of_the_interrupted_run(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    assert invoke("demo", *SMALL_DEMO, "--steps", "5", "--checkpoint", checkpoint).exit_code == 0
    out = tmp_path / "o.jsonl"
    result = invoke("demo", *SMALL_DEMO, "--checkpoint", checkpoint, "--out", out)
    assert result.exit_code == 2
    assert "does not exist, but the checkpoint" in result.stderr
    out.write_text("{}\n")
    result = invoke("demo", *SMALL_DEMO, "--checkpoint", checkpoint, "--out", out)
    assert result.exit_code == 1
    assert "holds fewer than the 20 groups trained on up to the checkpoint" in result.stderr
    # --overwrite writes this run's groups only.
    result = invoke("demo", *SMALL_DEMO, "--checkpoint", checkpoint, "--out", out, "--overwrite")
    assert result.exit_code == 0, result.output
    assert lines(out) == 15 * 4


def test_sigint_then_the_same_command_continues(tmp_path: Path) -> None:
    """A real Ctrl-C (SIGINT) on the real clock, once a checkpoint exists; then the same
    command on the virtual clock (the clock is not a setting) goes on from it."""
    checkpoint, out = tmp_path / "ckpt", tmp_path / "o.jsonl"
    args = [*SMALL_DEMO, "--checkpoint", str(checkpoint), "--checkpoint-every", "2"]
    args += ["--out", str(out)]
    saved = checkpoint / "checkpoint.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "trio_rollouts.cli", "demo", *args, "--clock", "real"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not saved.exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.01)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    step = checkpoint_data(checkpoint)["step"]
    if process.returncode == 0:  # pragma: no cover - it finished before the signal
        assert step == 20
        return
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert step < 20
    assert os.listdir(checkpoint) == ["checkpoint.json"]
    again = invoke("demo", *args)
    assert again.exit_code == 0, again.output
    assert f"resumed from step {step}" in summary_row(again, "checkpoint")
    assert len(groups_in(out)) == 80
