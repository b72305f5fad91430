"""The ``trio-rollouts`` command line: the group, what every command shares (exit codes,
error lines, the ``--out`` rule, SIGTERM), and ``demo``.

Commands run in-process through click's ``CliRunner`` (each runs its own ``trio.run``);
``generate`` and ``eval`` have their own modules (``test_cli_generate``,
``test_cli_eval``).
"""

from __future__ import annotations

import io
import json
import re
import signal
import sys
from pathlib import Path

import pytest
import trio
import trio.testing
from _cli_helpers import error_lines, invoke, signal_when
from click.testing import Result
from rich.console import Console

import trio_rollouts as tr
from trio_rollouts.cli import EXIT_TERMINATED, main
from trio_rollouts.cli._common import Terminated, one_line, run
from trio_rollouts.cli._demo import DemoConfig, run_demo
from trio_rollouts.cli._progress import RetryReasons, RunProgress, rate_text
from trio_rollouts.cli.demo import plot_install_hint
from trio_rollouts.inference import InferenceTimeoutError, ServerError

#: A demo that learns in a fraction of a second (the default one takes ~2.5 s).
SMALL_DEMO = ["--problems", "8", "--groups", "4", "--lag", "2", "--steps", "20"]


def summary_accuracy(result: Result) -> tuple[float, float]:
    found = re.search(r"accuracy\W+([\d.]+) -> ([\d.]+)", result.stdout)
    assert found, result.output
    return float(found[1]), float(found[2])


# --------------------------------------------------------------------------- main


def test_version_and_help_name_the_commands() -> None:
    assert tr.__version__ in invoke("--version").stdout
    help_text = invoke("--help").stdout
    for command in ("demo", "generate", "eval", "eval-merge"):
        assert command in help_text


def test_each_command_lives_in_its_own_module() -> None:
    modules = {name: command.callback.__module__ for name, command in main.commands.items()}
    assert modules == {
        "demo": "trio_rollouts.cli.demo",
        "generate": "trio_rollouts.cli.generate",
        "eval": "trio_rollouts.cli.evaluate",
        "eval-merge": "trio_rollouts.cli.eval_merge",
    }


@pytest.mark.parametrize("command", ["demo", "generate", "eval", "eval-merge"])
def test_every_option_has_help_text(command: str) -> None:
    without = [
        param.name
        for param in main.commands[command].params
        if param.param_type_name == "option" and not getattr(param, "help", None)
    ]
    assert without == []


# --------------------------------------------------------------------------- errors


def test_an_error_is_one_line_with_its_notes() -> None:
    error = ValueError("bad\n  thing")
    error.add_note("o.jsonl holds 2 complete groups")
    assert one_line(error) == "bad thing; o.jsonl holds 2 complete groups"


def test_a_group_of_one_error_repeated_shows_it_once() -> None:
    group = ExceptionGroup("x", [OSError("connection refused")] * 3)
    assert one_line(group) == "connection refused"


@pytest.mark.parametrize(
    ("errors", "expected"),
    [
        (["a", "b"], "a (and 1 more error: b)"),
        (["a", "b", "a", "c"], "a (and 2 more errors: b | c)"),
        (["a", "b", "c", "d"], "a (and 3 more errors: b | c | ...)"),
    ],
)
def test_a_group_of_different_errors_counts_the_others_in_good_grammar(
    errors: list[str], expected: str
) -> None:
    group = ExceptionGroup("x", [ValueError(e) for e in errors])
    assert one_line(group) == expected


def test_an_unexpected_error_type_is_named() -> None:
    assert one_line(KeyError("k")).startswith("KeyError: 'k' (set TRIO_ROLLOUTS_TRACEBACK=1")


def test_run_raises_what_the_work_raised_as_itself() -> None:
    async def fails() -> None:
        await trio.lowlevel.checkpoint()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        run(fails)


def test_run_turns_sigterm_into_terminated_after_cancelling_the_work() -> None:
    cancelled = []

    async def work() -> None:
        try:
            signal.raise_signal(signal.SIGTERM)
            await trio.sleep_forever()
        finally:
            cancelled.append(True)

    with pytest.raises(Terminated):
        run(work, clock=trio.testing.MockClock(autojump_threshold=0))
    assert cancelled == [True]


def test_run_restores_the_sigterm_handler() -> None:
    before = signal.getsignal(signal.SIGTERM)

    async def work() -> int:
        await trio.lowlevel.checkpoint()
        return 7

    assert run(work) == 7
    assert signal.getsignal(signal.SIGTERM) == before


# --------------------------------------------------------------------------- progress


def plain_console() -> tuple[Console, io.StringIO]:
    """A console on a file that is not a terminal, as a Slurm log or ``2> log``."""
    file = io.StringIO()
    return Console(file=file, force_terminal=False, width=200), file


def test_progress_lines_keep_coming_while_nothing_finishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRIO_ROLLOUTS_PROGRESS_SECONDS", "30")
    console, file = plain_console()
    progress = RunProgress(console, verb="generating", unit="group", total=4)

    async def stuck() -> None:
        progress.advance()
        await trio.sleep(95)  # the other groups never finish

    with progress:
        run(stuck, clock=trio.testing.MockClock(autojump_threshold=0), beside=progress.heartbeat)
    assert file.getvalue().splitlines() == [
        "generating: 4 groups (a line every 30 s; $TRIO_ROLLOUTS_PROGRESS_SECONDS sets it)",
        "generating: 1/4 groups (25%), 30.0 s/group, retries 0, 30 s elapsed",
        "generating: 1/4 groups (25%), 60.0 s/group, retries 0, 60 s elapsed",
        "generating: 1/4 groups (25%), 90.0 s/group, retries 0, 90 s elapsed",
        "generating: 1/4 groups (25%), 95.0 s/group, retries 0, 95 s elapsed",
    ]


def test_progress_interval_0_writes_a_line_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIO_ROLLOUTS_PROGRESS_SECONDS", "0")
    console, file = plain_console()
    progress = RunProgress(console, verb="evaluating", unit="request", total=2)

    async def work() -> None:
        for _ in range(2):
            await trio.sleep(2)
            progress.advance(detail="prompts 0/1")
        progress.retried(ServerError("503 busy"))

    with progress:
        run(work, clock=trio.testing.MockClock(autojump_threshold=0), beside=progress.heartbeat)
    assert file.getvalue().splitlines()[1:] == [
        "evaluating: 1/2 requests (50%), 2.0 s/request, retries 0, 2.0 s elapsed, prompts 0/1",
        "evaluating: 2/2 requests (100%), 2.0 s/request, retries 0, 4.0 s elapsed, prompts 0/1",
        "evaluating: 2/2 requests (100%), 2.0 s/request, retries 1, 4.0 s elapsed, prompts 0/1",
    ]


def test_a_bad_progress_interval_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TRIO_ROLLOUTS_PROGRESS_SECONDS", "soon")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a", "answer": "a"}\n')
    result = invoke("eval", "--embedded", "--prompts", prompts, "--out", tmp_path / "o.json")
    assert result.exit_code == 2
    assert "$TRIO_ROLLOUTS_PROGRESS_SECONDS is 'soon'" in result.stderr


def test_on_a_terminal_progress_is_a_bar_not_lines() -> None:
    file = io.StringIO()
    console = Console(file=file, force_terminal=True, width=100)
    progress = RunProgress(console, verb="generating", unit="group", total=2)

    async def work() -> None:
        progress.advance()
        await trio.sleep(100)
        progress.advance()

    with progress:
        run(work, clock=trio.testing.MockClock(autojump_threshold=0), beside=progress.heartbeat)
    assert "generating: " not in file.getvalue()
    assert "2/2" in file.getvalue()


@pytest.mark.parametrize(
    ("count", "seconds", "expected"),
    [
        (10, 4.0, "2.5 groups/s"),
        (10, 535.0, "53.5 s/group"),  # not "0.0 groups/s"
        (1, 1.0, "1.0 groups/s"),
        (0, 12.0, "0 groups/s"),
        (3, 0.0, "inf groups/s"),
    ],
)
def test_a_rate_reads_well_slow_and_fast(count: int, seconds: float, expected: str) -> None:
    assert rate_text(count, seconds, "group") == expected


def test_retry_reasons_count_each_error_type_with_its_first_message() -> None:
    reasons = RetryReasons()
    assert reasons.summary() == ""
    reasons.add(ServerError("returned 503: busy"))
    reasons.add(InferenceTimeoutError("read timeout after 600 s"))
    reasons.add(InferenceTimeoutError("read timeout after 600 s (another)"))
    assert reasons.summary() == (
        "requests were retried 3 times: InferenceTimeoutError x2 (read timeout after 600 s), "
        "ServerError x1 (returned 503: busy)"
    )


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["eval", "--group-size", "8"],
         "No such option '--group-size'. 'eval' has -n/--samples for that: sampled "
         "completions per prompt."),
        (["generate", "-n", "8"],
         "No such option '-n'. 'generate' has --group-size for that: completions (rollouts) "
         "per prompt."),
        (["generate", "--samples=8"],
         "No such option '--samples'. 'generate' has --group-size for that"),
        (["eval", "--max-new-tokens", "8"],
         "No such option '--max-new-tokens'. 'eval' has --max-tokens for that: most tokens "
         "generated per completion."),
    ],
)  # fmt: skip
def test_an_unknown_option_with_a_known_equivalent_names_it(args: list[str], expected: str) -> None:
    result = invoke(*args)
    assert result.exit_code == 2
    assert expected in " ".join(result.stderr.split())


def test_other_unknown_options_keep_clicks_suggestions() -> None:
    result = invoke("generate", "--group_size", "8")
    assert result.exit_code == 2
    assert "No such option '--group_size'. Did you mean '--group-size'?" in result.stderr


def test_help_says_when_base_url_and_model_are_required() -> None:
    generate_help = " ".join(invoke("generate", "--help").stdout.split())
    assert "(repeat for replicas of one model). [required] --model" in generate_help
    assert "--model NAME The served model's name. [required]" in generate_help
    eval_help = " ".join(invoke("eval", "--help").stdout.split())
    assert "replicas of one model). [required unless --embedded]" in eval_help
    assert "--model NAME The served model's name. [required unless --embedded]" in eval_help


# --------------------------------------------------------------------------- --out


@pytest.mark.parametrize(
    "args",
    [
        ["demo", *SMALL_DEMO],
        ["generate", "--base-url", "http://127.0.0.1:1/v1", "--model", "m", "--prompts", "P"],
        ["eval", "--embedded", "--prompts", "P"],
        ["eval-merge", "P"],
    ],
)
def test_out_in_a_missing_folder_is_a_usage_error_naming_out(
    tmp_path: Path, args: list[str]
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a", "answer": "a"}\n')
    args = [str(prompts) if a == "P" else a for a in args]
    result = invoke(*args, "--out", tmp_path / "nope" / "o.jsonl")
    assert result.exit_code == 2
    assert "Invalid value for '--out'" in result.stderr
    assert f"the folder '{tmp_path / 'nope'}' does not exist" in result.stderr


def test_demo_refuses_an_existing_out_unless_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    out.write_text("keep me\n")
    result = invoke("demo", *SMALL_DEMO, "--out", out)
    assert result.exit_code == 1
    assert error_lines(result) == [f"Error: {out} exists; pass --overwrite to replace it"]
    assert out.read_text() == "keep me\n"
    assert "training" not in result.stderr  # refused before any work
    assert invoke("demo", *SMALL_DEMO, "--out", out, "--overwrite").exit_code == 0
    assert out.read_text() != "keep me\n"


# --------------------------------------------------------------------------- demo


def test_demo_learns_from_near_chance_to_above_0_9() -> None:
    result = invoke("demo")
    assert result.exit_code == 0, result.output
    start, final = summary_accuracy(result)
    assert start < 0.2  # chance is 1/8
    assert final >= 0.9
    assert "staleness" in result.stdout
    assert "filtered groups" in result.stdout
    assert re.search(r"weight updates \(mode\)\W+36 \(keep\)", result.stdout)
    assert "time paused for updates" in result.stdout


async def test_the_demo_loop_learns_on_a_mock_clock(autojump_clock: trio.testing.MockClock) -> None:
    result = await run_demo(DemoConfig(num_problems=8, groups_per_step=4, steps=20))
    assert result.initial_accuracy < 0.2
    assert result.final_accuracy >= 0.9
    assert all(m.staleness_max <= 2 for m in result.steps)
    assert result.weight_updates == 20
    assert result.config.update_mode == "keep"


def test_demo_is_reproducible_for_a_seed(tmp_path: Path) -> None:
    runs = [
        invoke("demo", *SMALL_DEMO, "--seed", 3, "--out", tmp_path / f"{i}.jsonl") for i in range(2)
    ]
    assert all(run.exit_code == 0 for run in runs)
    assert summary_accuracy(runs[0]) == summary_accuracy(runs[1])
    assert (tmp_path / "0.jsonl").read_bytes() == (tmp_path / "1.jsonl").read_bytes()
    other = invoke("demo", *SMALL_DEMO, "--seed", 4, "--out", tmp_path / "other.jsonl")
    assert (tmp_path / "other.jsonl").read_bytes() != (tmp_path / "0.jsonl").read_bytes()
    assert other.exit_code == 0


def test_demo_out_holds_every_group_with_its_policy_epochs(tmp_path: Path) -> None:
    out = tmp_path / "rollouts.jsonl"
    assert invoke("demo", *SMALL_DEMO, "--out", out).exit_code == 0
    groups = list(tr.load_jsonl(out, tr.RolloutGroup))
    assert len(groups) == 20 * 4
    spanning = 0
    for number, group in enumerate(groups):
        trainer_epoch = number // 4  # the trainer took batch s at policy epoch s
        assert group.batch_id == trainer_epoch
        assert 0 <= trainer_epoch - group.start_epoch <= 2  # --lag 2
        for rollout in group:
            boundaries = rollout.policy_epoch[0]
            starts = [start for start, _ in boundaries]
            assert starts == sorted(set(starts))
            assert group.start_epoch <= boundaries[0][1] <= trainer_epoch
            spanning += len(boundaries) > 1
    # Some rollouts were generated across a weight update (the default --update-mode
    # keep holds them and continues them under the new weights).
    assert spanning > 0


def test_demo_on_the_real_clock() -> None:
    result = invoke("demo", "--problems", "8", "--groups", "2", "--steps", "2", "--clock", "real")
    assert result.exit_code == 0, result.output
    assert "real clock" in result.stdout


def test_demo_plot_without_matplotlib_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    result = invoke("demo", *SMALL_DEMO, "--plot", tmp_path / "curve.png")
    assert result.exit_code == 1
    # The tests run from a checkout: the command installs into it.
    checkout = Path(tr.__file__).resolve().parent.parent
    assert error_lines(result) == [
        "Error: --plot needs matplotlib, which is not installed; install it with: "
        f"pip install -e '{checkout}[plot]' (or pip install matplotlib)"
    ]
    assert "training" not in result.stderr  # it failed before training


def checkout(folder: Path) -> Path:
    folder.mkdir()
    (folder / "pyproject.toml").write_text('[project]\nname = "trio-rollouts"\n')
    return folder


def direct_url(folder: Path, *, editable: bool) -> str:
    return json.dumps({"url": folder.as_uri(), "dir_info": {"editable": editable}})


def test_plot_hint_from_a_checkout_installs_into_it(tmp_path: Path) -> None:
    root = checkout(tmp_path / "my checkout")
    assert plot_install_hint(root, None) == (
        f"pip install -e '{root}[plot]' (or pip install matplotlib)"
    )


def test_plot_hint_for_an_install_from_a_folder_names_the_folder(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    site.mkdir()
    root = checkout(tmp_path / "src")
    assert plot_install_hint(site, direct_url(root, editable=False)) == (
        f"pip install '{root}[plot]' (or pip install matplotlib)"
    )
    assert plot_install_hint(site, direct_url(root, editable=True)).startswith(
        f"pip install -e '{root}[plot]'"
    )


def test_plot_hint_for_an_installed_package_is_the_extra(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    site.mkdir()
    gone = tmp_path / "deleted checkout"
    for url in (None, "not json", direct_url(gone, editable=True)):
        assert plot_install_hint(site, url) == (
            "pip install 'trio-rollouts[plot]' (or pip install matplotlib)"
        )


def test_demo_plot_draws_the_learning_curve(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "curve.png"
    result = invoke("demo", *SMALL_DEMO, "--plot", plot)
    assert result.exit_code == 0, result.output
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_demo_refuses_more_groups_in_flight_than_problems() -> None:
    result = invoke("demo", "--problems", "8", "--groups", "8", "--lag", "2")
    assert result.exit_code == 2
    assert "raise --problems" in result.stderr


def test_sigterm_stops_the_demo_with_143(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    # On the real clock the demo runs for about 15 s; stop it once a group is written.
    code, stderr, took = signal_when(
        ["demo", "--clock", "real", "--out", str(out)],
        lambda: out.exists() and out.read_bytes().count(b"\n") >= 1,
        signal.SIGTERM,
    )
    assert code == EXIT_TERMINATED, stderr
    assert took < 1.5
    assert "Interrupted." in stderr
    assert "Traceback" not in stderr
    assert out.read_text().endswith("\n")
