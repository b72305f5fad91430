"""The ``trio-rollouts`` command line, end to end: demo, generate, eval and eval-merge.

Commands run in-process through click's ``CliRunner`` (each runs its own ``trio.run``),
against a real OpenAI-compatible server on loopback (``_openai_server``) where they need
one. The Ctrl-C test runs the command as a subprocess and sends it a real SIGINT.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from _openai_server import FakeOpenAIServer, Reply, serving_in_thread
from click.testing import CliRunner, Result

import trio_rollouts as tr
from trio_rollouts._demo import DemoConfig, run_demo
from trio_rollouts.cli import main

#: A demo that learns in a fraction of a second (the default one takes ~2.5 s).
SMALL_DEMO = ["--problems", "8", "--groups", "4", "--lag", "2", "--steps", "20"]


def invoke(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def error_lines(result: Result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("Error")]


def write_prompts(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def groups_in(path: Path) -> list[tr.RolloutGroup]:
    return list(tr.load_jsonl(path, tr.RolloutGroup))


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    fake = FakeOpenAIServer(name="server")
    with serving_in_thread(fake):
        yield fake


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    # The fake server answers "server: <last message>".
    return write_prompts(
        tmp_path / "prompts.jsonl",
        [
            {"problem_id": "p1", "prompt": "2+2", "answer": "2+2"},
            {
                "problem_id": "p2",
                "prompt": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Capital of France?"},
                ],
                "answer": "Paris",
            },
            {"prompt": "hello", "answer": "hello"},
        ],
    )


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


# --------------------------------------------------------------------------- demo


def test_demo_learns_from_near_chance_to_above_0_9() -> None:
    result = invoke("demo")
    assert result.exit_code == 0, result.output
    start, final = summary_accuracy(result)
    assert start < 0.2  # chance is 1/8
    assert final >= 0.9
    assert "staleness" in result.stdout
    assert "filtered groups" in result.stdout


async def test_the_demo_loop_learns_on_a_mock_clock(autojump_clock: trio.testing.MockClock) -> None:
    result = await run_demo(DemoConfig(num_problems=8, groups_per_step=4, steps=20))
    assert result.initial_accuracy < 0.2
    assert result.final_accuracy >= 0.9
    assert all(m.staleness_max <= 2 for m in result.steps)


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
    groups = groups_in(out)
    assert len(groups) == 20 * 4
    spanning = 0
    for number, group in enumerate(groups):
        trainer_epoch = number // 4  # the trainer took batch s at policy epoch s
        assert group.batch_id == trainer_epoch
        for rollout in group:
            boundaries = rollout.policy_epoch[0]
            starts = [start for start, _ in boundaries]
            assert starts == sorted(set(starts))
            assert 0 <= trainer_epoch - boundaries[0][1] <= 2  # --lag 2
            spanning += len(boundaries) > 1
    assert spanning > 0  # some rollouts were generated across a weight update


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
    assert error_lines(result) == [
        "Error: --plot needs matplotlib, which is not installed; install it with: "
        "pip install 'trio-rollouts[plot]'"
    ]
    assert "training" not in result.stderr  # it failed before training


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


# --------------------------------------------------------------------------- generate


def test_generate_writes_one_scored_group_per_prompt(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "rollouts.jsonl"
    result = invoke(
        "generate", "--base-url", server.base_url, "--model", "m", "--prompts", prompts,
        "--out", out, "--group-size", 3, "--reward", "contains",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    groups = {g[0].problem_id: g for g in groups_in(out)}
    assert set(groups) == {"p1", "p2", "line-3"}
    assert [r.reward for r in groups["p1"]] == [1.0] * 3
    assert [r.reward for r in groups["p2"]] == [0.0] * 3
    for group in groups.values():
        assert len(group) == 3
        assert all(isinstance(r, tr.TokenRollout) and r.env_id == "prompts" for r in group)
    assert len(server.received) == 9
    assert {r.body["model"] for r in server.received} == {"m"}
    assert "groups written" in result.stdout


def test_generate_sends_the_generation_flags(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    result = invoke(
        "generate", "--base-url", server.base_url, "--model", "m", "--prompts", prompts,
        "--out", tmp_path / "o.jsonl", "--group-size", 1, "--reward", "contains",
        "--temperature", 0.7, "--top-p", 0.9, "--max-tokens", 5, "--num-prompts", 1,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    [received] = server.received
    assert (received.body["temperature"], received.body["top_p"]) == (0.7, 0.9)
    assert received.body["max_tokens"] == 5


def test_generate_filters_groups_whose_rewards_are_all_equal(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    prompts = write_prompts(
        tmp_path / "p.jsonl",
        [{"problem_id": "mixed", "prompt": "q1", "answer": "yes"},
         {"problem_id": "same", "prompt": "q2", "answer": "yes"}],
    )  # fmt: skip
    yes = {"message": {"role": "assistant", "content": "yes"}}
    server.reply(Reply(choice_extra=yes), Reply())  # the first group: one right, one wrong
    out = tmp_path / "o.jsonl"
    result = invoke(
        "generate", "--base-url", server.base_url, "--model", "m", "--prompts", prompts,
        "--out", out, "--group-size", 2, "--filter-same-reward", "--concurrency", 1,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert [g[0].problem_id for g in groups_in(out)] == ["mixed"]
    assert re.search(r"groups filtered\W+1", result.stdout)


def test_generate_resume_skips_problems_already_written(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o.jsonl"
    common = ["generate", "--base-url", server.base_url, "--model", "m", "--prompts", prompts,
              "--out", out, "--group-size", 2, "--reward", "contains"]  # fmt: skip
    assert invoke(*common, "--num-prompts", 2).exit_code == 0
    assert len(server.received) == 4
    result = invoke(*common, "--resume")
    assert result.exit_code == 0, result.output
    assert "resuming: 2 of 3 problems are done" in result.stderr
    assert len(server.received) == 6  # only the third prompt was sent
    assert sorted(g[0].problem_id or "" for g in groups_in(out)) == ["line-3", "p1", "p2"]


def test_generate_resume_removes_a_torn_last_line(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o.jsonl"
    common = ["generate", "--base-url", server.base_url, "--model", "m", "--prompts", prompts,
              "--out", out, "--group-size", 2, "--reward", "contains"]  # fmt: skip
    assert invoke(*common, "--num-prompts", 1).exit_code == 0
    whole = out.read_bytes()
    out.write_bytes(whole + whole[:50])  # a second line cut off mid-write
    result = invoke(*common, "--resume")
    assert result.exit_code == 0, result.output
    assert "removed a torn last line (50 bytes" in result.stderr
    assert out.read_bytes().startswith(whole)
    assert sorted(g[0].problem_id or "" for g in groups_in(out)) == ["line-3", "p1", "p2"]


def test_generate_does_not_replace_an_output_unless_told(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o.jsonl"
    out.write_text("keep me\n")
    common = ["generate", "--base-url", server.base_url, "--model", "m", "--prompts", prompts,
              "--out", out, "--reward", "contains"]  # fmt: skip
    result = invoke(*common)
    assert result.exit_code == 1
    assert error_lines(result) == [
        f"Error: {out} exists; pass --resume to continue that job or --overwrite to replace it"
    ]
    assert out.read_text() == "keep me\n"
    assert invoke(*common, "--overwrite").exit_code == 0
    assert len(groups_in(out)) == 3


def test_generate_resume_refuses_a_file_it_did_not_write(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o.jsonl"
    out.write_text('{"not": "a group"}\n')
    result = invoke("generate", "--base-url", server.base_url, "--model", "m", "--prompts",
                    prompts, "--out", out, "--resume")  # fmt: skip
    assert result.exit_code == 1
    assert "line 1 is not a rollout group" in error_lines(result)[0]


def test_a_missing_prompt_file_is_a_usage_error(tmp_path: Path) -> None:
    result = invoke("generate", "--base-url", "http://127.0.0.1:1/v1", "--model", "m",
                    "--prompts", tmp_path / "nope.jsonl", "--out", tmp_path / "o.jsonl")  # fmt: skip
    assert result.exit_code == 2
    assert "does not exist" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("rows", "reward", "message"),
    [
        (['{"prompt": "a", "answer": 1}', '{"prompt": "b", "answer": 2'], "exact-match",
         "line 2: not valid JSON"),
        (['{"answer": 1}'], "exact-match", "line 1: no 'prompt'"),
        (['{"prompt": 3, "answer": 1}'], "exact-match", "line 1: 'prompt' must be a string"),
        (['{"prompt": [{"role": "user"}], "answer": 1}'], "exact-match",
         "line 1: 'prompt' is not a list of {role, content} messages"),
        (['{"prompt": "a"}'], "exact-match", "line 1: no 'answer'"),
        (['{"problem_id": "x", "prompt": "a", "answer": 1}',
          '{"problem_id": "x", "prompt": "b", "answer": 1}'], "exact-match",
         "line 2: problem_id 'x' is already used on line 1"),
        (['{"problem_id": "x", "prompt": "a", "answer": "Paris"}'], "last-number",
         "problem 'x': last-number reward needs a numeric answer"),
        ([], "exact-match", "no prompts (the file is empty)"),
    ],
)  # fmt: skip
def test_a_bad_prompt_file_is_a_one_line_error_naming_the_line(
    tmp_path: Path, rows: list[str], reward: str, message: str
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(row + "\n" for row in rows))
    result = invoke("generate", "--base-url", "http://127.0.0.1:1/v1", "--model", "m",
                    "--prompts", prompts, "--out", tmp_path / "o.jsonl", "--reward", reward)  # fmt: skip
    assert result.exit_code == 1
    [line] = error_lines(result)
    assert message in line
    assert str(prompts) in line
    assert "Traceback" not in result.output


def lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_an_unreachable_server_is_a_one_line_error(prompts: Path, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"
    result = invoke("generate", "--base-url", url, "--model", "m", "--prompts", prompts,
                    "--out", tmp_path / "o.jsonl", "--max-retries", 0)  # fmt: skip
    assert result.exit_code == 1
    [line] = error_lines(result)
    assert f"POST {url}/chat/completions failed" in line
    assert "0 complete groups; --resume continues the job" in line
    assert "Traceback" not in result.output


def test_a_server_that_rejects_the_request_is_a_one_line_error(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    server.default = Reply(status=400, json={"error": {"message": "unknown model 'm'"}})
    result = invoke("generate", "--base-url", server.base_url, "--model", "m", "--prompts",
                    prompts, "--out", tmp_path / "o.jsonl")  # fmt: skip
    assert result.exit_code == 1
    [line] = error_lines(result)
    assert "returned 400" in line
    assert "unknown model 'm'" in line


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--group-size", "0"], "Invalid value for '--group-size'"),
        (["--concurrency", "x"], "Invalid value for '--concurrency'"),
        (["--model", "m", "--base-url", "ftp://x"], "Invalid value for '--base-url'"),
        (["--model", "m"], "Missing option '--base-url'"),
        (["--base-url", "http://127.0.0.1:1/v1"], "Missing option '--model'"),
        (["--model", "m", "--base-url", "http://x/v1", "--resume", "--overwrite"],
         "exclude each other"),
    ],
)  # fmt: skip
def test_a_bad_flag_is_a_usage_error(
    prompts: Path, tmp_path: Path, flags: list[str], message: str
) -> None:
    result = invoke("generate", "--prompts", prompts, "--out", tmp_path / "o.jsonl", *flags)
    assert result.exit_code == 2
    assert message in result.stderr
    assert "Traceback" not in result.output


def test_ctrl_c_stops_generate_at_once_and_leaves_whole_lines(tmp_path: Path) -> None:
    server = FakeOpenAIServer(default=Reply(delay=60))  # requests after the first six hang
    server.reply(*[Reply() for _ in range(6)])
    prompts = write_prompts(
        tmp_path / "p.jsonl",
        [{"problem_id": f"q{i}", "prompt": f"q{i}", "answer": "q"} for i in range(12)],
    )
    out = tmp_path / "o.jsonl"
    with serving_in_thread(server):
        args = ["generate", "--base-url", server.base_url, "--model", "m", "--prompts",
                str(prompts), "--out", str(out), "--group-size", "2", "--concurrency", "4",
                "--reward", "contains"]  # fmt: skip
        process = subprocess.Popen(
            [sys.executable, "-m", "trio_rollouts.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            # The six fast replies finish at least two groups (of two requests each);
            # every request after them hangs.
            deadline = time.monotonic() + 30
            while server.script or server.in_flight == 0 or lines(out) < 2:
                assert process.poll() is None, process.communicate()
                assert time.monotonic() < deadline, "the requests did not arrive"
                time.sleep(0.02)
            interrupted = time.monotonic()
            process.send_signal(signal.SIGINT)
            _, stderr = process.communicate(timeout=10)
            took = time.monotonic() - interrupted
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
        assert process.returncode == 130, stderr
        assert took < 1.5
        assert "Traceback" not in stderr
        reported = re.search(
            r"holds (\d+) complete groups; run the same command with --resume", stderr
        )
        assert reported, stderr
        assert out.read_text().endswith("\n")
        assert len(groups_in(out)) == int(reported[1]) >= 2  # every line parses

        server.default = Reply()
        result = invoke(*args, "--resume")
    assert result.exit_code == 0, result.output
    assert sorted(g[0].problem_id or "" for g in groups_in(out)) == sorted(
        f"q{i}" for i in range(12)
    )


# --------------------------------------------------------------------------- eval


@pytest.fixture
def letter_prompts(tmp_path: Path) -> Path:
    # The embedded backend answers "The answer is A." (or B, C, "I am not sure.").
    return write_prompts(
        tmp_path / "letters.jsonl",
        [{"problem_id": f"q{i}", "prompt": f"question {i}", "answer": "A"} for i in range(10)],
    )


def test_eval_reports_pass_at_k(letter_prompts: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    result = invoke("eval", "--embedded", "--prompts", letter_prompts, "--reward", "contains",
                    "-n", 4, "-k", 2, "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data["metrics"]) == {"pass@1", "pass@2", "greedy_accuracy", "num_prompts"}
    assert data["metrics"]["num_prompts"] == 10
    assert 0 < data["metrics"]["pass@1"] <= data["metrics"]["pass@2"] <= 1
    assert data["response"]["type_name"] == "PassAtKEvaluationResponse"
    assert "pass@2" in result.stdout


@pytest.mark.parametrize(("world", "num_prompts"), [(3, 10), (4, 3)])
def test_eval_merge_reproduces_the_unsharded_result(
    letter_prompts: Path, tmp_path: Path, world: int, num_prompts: int
) -> None:
    common = ["eval", "--embedded", "--prompts", letter_prompts, "--reward", "contains",
              "-n", 3, "--num-prompts", num_prompts]  # fmt: skip
    assert invoke(*common, "--out", tmp_path / "full.json").exit_code == 0
    shards = []
    for rank in range(world):
        shards.append(tmp_path / f"rank{rank}.json")
        result = invoke(*common, "--rank", rank, "--world", world, "--out", shards[-1])
        assert result.exit_code == 0, result.output
    merged = tmp_path / "merged.json"
    result = invoke("eval-merge", *reversed(shards), "--out", merged)  # any order
    assert result.exit_code == 0, result.output
    assert json.loads(merged.read_text()) == json.loads((tmp_path / "full.json").read_text())


def test_eval_against_a_server(server: FakeOpenAIServer, tmp_path: Path) -> None:
    prompts = write_prompts(
        tmp_path / "p.jsonl",
        [{"problem_id": "right", "prompt": "a", "answer": "server: a"},
         {"problem_id": "wrong", "prompt": "b", "answer": "nope"}],
    )  # fmt: skip
    out = tmp_path / "eval.json"
    result = invoke("eval", "--base-url", server.base_url, "--model", "m", "--prompts",
                    prompts, "-n", 2, "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics == {"pass@1": 0.5, "pass@2": 0.5, "greedy_accuracy": 0.5, "num_prompts": 2}
    assert [r.body.get("temperature") for r in server.received].count(0.0) == 2  # greedy


def test_eval_merge_needs_every_rank_once(letter_prompts: Path, tmp_path: Path) -> None:
    common = ["eval", "--embedded", "--prompts", letter_prompts, "--world", 3, "--out"]
    for rank in range(2):
        assert invoke(*common, tmp_path / f"r{rank}.json", "--rank", rank).exit_code == 0
    missing = invoke("eval-merge", tmp_path / "r0.json", tmp_path / "r1.json")
    assert missing.exit_code == 1
    assert error_lines(missing) == ["Error: missing rank(s) 2 of --world 3"]
    twice = invoke("eval-merge", tmp_path / "r0.json", tmp_path / "r0.json")
    assert twice.exit_code == 1
    assert "are both rank 0" in error_lines(twice)[0]


def test_eval_merge_refuses_ranks_of_different_runs(letter_prompts: Path, tmp_path: Path) -> None:
    common = ["eval", "--embedded", "--prompts", letter_prompts, "--world", 2]
    assert invoke(*common, "--rank", 0, "-n", 2, "--out", tmp_path / "a.json").exit_code == 0
    assert invoke(*common, "--rank", 1, "-n", 3, "--out", tmp_path / "b.json").exit_code == 0
    result = invoke("eval-merge", tmp_path / "a.json", tmp_path / "b.json")
    assert result.exit_code == 1
    assert "disagree on settings" in error_lines(result)[0]


def test_eval_merge_refuses_a_file_that_is_not_an_eval_result(tmp_path: Path) -> None:
    bogus = tmp_path / "x.json"
    bogus.write_text("[1, 2]")
    result = invoke("eval-merge", bogus)
    assert result.exit_code == 1
    assert "not a result file of 'trio-rollouts eval'" in error_lines(result)[0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--embedded", "--rank", "2", "--world", "2"], "2 is not below --world 2"),
        (["--embedded", "-n", "2", "-k", "3"], "3 exceeds --samples 2"),
        ([], "Give either --embedded or --base-url"),
        (["--embedded", "--base-url", "http://x/v1"], "Give either --embedded or --base-url"),
    ],
)
def test_eval_usage_errors(
    letter_prompts: Path, tmp_path: Path, flags: list[str], message: str
) -> None:
    result = invoke("eval", "--prompts", letter_prompts, "--out", tmp_path / "o.json", *flags)
    assert result.exit_code == 2
    assert message in result.stderr
