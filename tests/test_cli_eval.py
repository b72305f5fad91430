"""``trio-rollouts eval`` and ``eval-merge`` end to end: pass@k on the embedded backend
(a virtual clock makes it instant and deterministic) and against a server on loopback;
progress on disk, ``--resume``, sharding and merging."""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cli_helpers import (
    closed_port,
    error_lines,
    invoke,
    lines,
    serving,
    signal_when,
    write_prompts,
)
from _openai_server import FakeOpenAIServer, Reply, serving_in_thread

import trio_rollouts as tr


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    yield from serving(FakeOpenAIServer(name="server"))


@pytest.fixture
def letter_prompts(tmp_path: Path) -> Path:
    # The embedded backend answers "The answer is A." (or B, C, "I am not sure.").
    return write_prompts(
        tmp_path / "letters.jsonl",
        [{"problem_id": f"q{i}", "prompt": f"question {i}", "answer": "A"} for i in range(10)],
    )


@pytest.fixture
def server_prompts(tmp_path: Path) -> Path:
    # The fake server answers "server: <prompt>".
    return write_prompts(
        tmp_path / "p.jsonl",
        [
            {"problem_id": f"q{i}", "prompt": f"a{i}", "answer": f"server: a{i % 2}"}
            for i in range(4)
        ],
    )


def progress_of(out: Path) -> Path:
    return out.with_name(out.name + ".progress.jsonl")


# --------------------------------------------------------------------------- eval


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
    assert [r["problem_id"] for r in data["response"]["results"]] == [f"q{i}" for i in range(10)]
    assert "pass@2" in result.stdout
    # The side files of a run in progress are gone once the result is written.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json", "letters.jsonl"]


def test_eval_is_reproducible(letter_prompts: Path, tmp_path: Path) -> None:
    for name in ("a.json", "b.json"):
        args = [
            "eval",
            "--embedded",
            "--prompts",
            letter_prompts,
            "-n",
            3,
            "--out",
            tmp_path / name,
        ]
        assert invoke(*args).exit_code == 0
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_eval_against_a_server(server: FakeOpenAIServer, tmp_path: Path) -> None:
    prompts = write_prompts(
        tmp_path / "p.jsonl",
        [{"problem_id": "right", "prompt": "a", "answer": "server: a"},
         {"problem_id": "wrong", "prompt": "b", "answer": "nope"}],
    )  # fmt: skip
    out = tmp_path / "eval.json"
    result = invoke("eval", "--base-url", server.base_url, "--model", "m", "--prompts",
                    prompts, "-n", 2, "--top-k", 7, "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["metrics"] == {
        "pass@1": 0.5,
        "pass@2": 0.5,
        "greedy_accuracy": 0.5,
        "num_prompts": 2,
    }
    assert [r.body.get("temperature") for r in server.received].count(0.0) == 2  # greedy
    assert {r.body.get("top_k") for r in server.received} == {7}
    assert "base_url" not in data["settings"]
    # The fake server ignores sampling: every sample of a prompt is the same text.
    assert "all 2 sampled completions were identical for each of the 2 prompts" in result.stderr


def test_eval_num_prompts_0_is_a_usage_error(letter_prompts: Path, tmp_path: Path) -> None:
    result = invoke("eval", "--embedded", "--prompts", letter_prompts, "--num-prompts", 0,
                    "--out", tmp_path / "o.json")  # fmt: skip
    assert result.exit_code == 2
    assert "Invalid value for '--num-prompts': 0 is not in the range x>=1" in result.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--embedded", "--rank", "2", "--world", "2"], "2 is not below --world 2"),
        (["--embedded", "-n", "2", "-k", "3"], "3 exceeds --samples 2"),
        ([], "Give either --embedded or --base-url"),
        (["--embedded", "--base-url", "http://x/v1"], "Give either --embedded or --base-url"),
        (["--embedded", "--extra-body", "{}"], "--extra-body is for a server (--base-url)"),
        (["--embedded", "--no-token-ids"], "--token-ids/--no-token-ids is for a server"),
        (["--embedded", "--resume", "--overwrite"], "exclude each other"),
    ],
)
def test_eval_usage_errors(
    letter_prompts: Path, tmp_path: Path, flags: list[str], message: str
) -> None:
    result = invoke("eval", "--prompts", letter_prompts, "--out", tmp_path / "o.json", *flags)
    assert result.exit_code == 2
    assert message in result.stderr


def test_eval_refuses_an_existing_out_unless_told(letter_prompts: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    out.write_text("keep me\n")
    common = ["eval", "--embedded", "--prompts", letter_prompts, "--out", out]
    result = invoke(*common)
    assert result.exit_code == 1
    assert error_lines(result) == [
        f"Error: {out} exists; pass --resume to continue that job or --overwrite to replace it"
    ]
    assert out.read_text() == "keep me\n"
    assert invoke(*common, "--overwrite").exit_code == 0
    assert json.loads(out.read_text())["metrics"]["num_prompts"] == 10


def test_eval_refuses_to_start_over_an_interrupted_run(
    letter_prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "eval.json"
    progress_of(out).write_text('{"problem_id": "q0"}\n')
    result = invoke("eval", "--embedded", "--prompts", letter_prompts, "--out", out)
    assert result.exit_code == 1
    assert error_lines(result) == [
        f"Error: {progress_of(out)} exists; pass --resume to continue that job or "
        "--overwrite to replace it"
    ]


def test_a_dead_server_leaves_whole_lines_that_resume_continues(
    server: FakeOpenAIServer, server_prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "eval.json"
    common = ["eval", "--base-url", server.base_url, "--model", "m", "--prompts", server_prompts,
              "-n", 2, "--concurrency", 1, "--out", out]  # fmt: skip
    assert invoke(*common, "--out", tmp_path / "whole.json").exit_code == 0
    server.received.clear()
    # Two prompts (three requests each) are answered; then the server fails.
    server.reply(*[Reply() for _ in range(6)])
    server.default = Reply(status=400, json={"error": {"message": "the server broke"}})
    result = invoke(*common)
    assert result.exit_code == 1
    [line] = error_lines(result)
    assert "the server broke" in line
    assert (
        f"{progress_of(out)} holds 2 of 4 prompts' results; once the cause is fixed (the base URL may change), --resume continues the run"
        in line
    )
    assert not out.exists()
    done = list(tr.load_jsonl(progress_of(out), tr.PassAtKResult))
    assert [r.problem_id for r in done] == ["q0", "q1"]

    server.default = Reply()
    server.received.clear()
    result = invoke(*common, "--resume")
    assert result.exit_code == 0, result.output
    assert "resuming: 2 of 4 prompts are done" in result.stderr
    assert len(server.received) == 6  # only the two missing prompts
    assert json.loads(out.read_text()) == json.loads((tmp_path / "whole.json").read_text())
    assert not progress_of(out).exists()


def test_eval_writes_progress_lines_during_the_run(
    letter_prompts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The embedded backend's latency runs on a virtual clock: a line every simulated
    # second, however fast the machine.
    monkeypatch.setenv("TRIO_ROLLOUTS_PROGRESS_SECONDS", "1")
    result = invoke("eval", "--embedded", "--prompts", letter_prompts, "--concurrency", 1,
                    "--out", tmp_path / "eval.json")  # fmt: skip
    assert result.exit_code == 0, result.output
    found = re.findall(
        r"^evaluating: (\d+)/50 requests \(\d+%\), \S+ \S+, retries 0, in flight (\d+)"
        r"(?: \(oldest ([\d.]+) s\))?, ([\d.]+) s simulated elapsed, prompts (\d+)/10$",
        result.stderr,
        flags=re.MULTILINE,
    )
    requests = [int(r) for r, _, _, _, _ in found]
    elapsed = [float(e) for _, _, _, e, _ in found]
    assert len(found) >= 4
    # Lines came every simulated second while requests were still being made (one at a
    # time, younger than the line's interval)...
    assert elapsed[:3] == [1.0, 2.0, 3.0]
    assert 0 < requests[0] < requests[1] < requests[2] < 50
    assert all(f[1] == "1" and 0 <= float(f[2]) < 1 for f in found[:3])
    # ... and the last one when the run ended, with nothing in flight.
    assert (requests[-1], found[-1][1], found[-1][4]) == (50, "0", "10")


def test_a_dead_server_before_any_result_leaves_nothing_behind(
    letter_prompts: Path, tmp_path: Path
) -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"
    result = invoke("eval", "--base-url", url, "--model", "m", "--prompts", letter_prompts,
                    "--max-retries", 0, "--out", tmp_path / "eval.json")  # fmt: skip
    assert result.exit_code == 1
    assert "no prompt's result was written, so there is nothing to resume" in error_lines(result)[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["letters.jsonl"]


def test_eval_notes_an_unset_max_tokens_only_against_a_server(
    server: FakeOpenAIServer, server_prompts: Path, tmp_path: Path
) -> None:
    common = ["eval", "--prompts", server_prompts, "-n", 1]
    served = invoke(*common, "--base-url", server.base_url, "--model", "m",
                    "--out", tmp_path / "a.json")  # fmt: skip
    assert served.exit_code == 0, served.output
    assert "note: --max-tokens is not set" in served.stderr
    embedded = invoke(*common, "--embedded", "--out", tmp_path / "b.json")
    assert embedded.exit_code == 0, embedded.output
    assert "--max-tokens is not set" not in embedded.stderr


def test_eval_says_why_requests_were_retried(
    server: FakeOpenAIServer, server_prompts: Path, tmp_path: Path
) -> None:
    busy = Reply(status=503, headers={"retry-after": "0"}, json={"error": {"message": "busy"}})
    server.reply(busy)
    result = invoke("eval", "--base-url", server.base_url, "--model", "m", "--prompts",
                    server_prompts, "-n", 1, "--max-tokens", 8, "--out", tmp_path / "e.json")  # fmt: skip
    assert result.exit_code == 0, result.output
    [line] = [line for line in result.stderr.splitlines() if "were retried" in line]
    assert re.fullmatch(r"requests were retried 1 time: ServerError x1 \(.*503.*busy\)", line)


def test_eval_resume_refuses_other_settings(letter_prompts: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    progress_of(out).write_text("")
    common = ["eval", "--embedded", "--prompts", letter_prompts, "--out", out]
    # A run that wrote its job record and one result, then died.
    assert invoke(*common, "-n", 2, "--num-prompts", 1, "--overwrite").exit_code == 0
    result = json.loads(out.read_text())
    record = {k: result[k] for k in ("rank", "world_size", "num_prompts", "prompts_sha256")}
    record["num_prompts"] = 10
    record.update({f"settings.{k}": v for k, v in result["settings"].items()})
    (tmp_path / "eval.json.job.json").write_text(
        json.dumps({"format": "trio-rollouts.job/1", "command": "eval", "settings": record})
    )
    progress_of(out).write_text(json.dumps(result["response"]["results"][0]) + "\n")
    out.unlink()
    refused = invoke(*common, "-n", 3, "--resume")
    assert refused.exit_code == 1
    [line] = error_lines(refused)
    assert f"{out} belongs to another job" in line
    assert "settings.samples is 2 in the record, 3 in this run" in line
    resumed = invoke(*common, "-n", 2, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert "resuming: 1 of 10 prompts are done" in resumed.stderr
    assert json.loads(out.read_text())["metrics"]["num_prompts"] == 10


def test_eval_resume_of_a_finished_run_does_nothing(letter_prompts: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    common = ["eval", "--embedded", "--prompts", letter_prompts, "--out", out]
    assert invoke(*common).exit_code == 0
    before = out.read_bytes()
    again = invoke(*common, "--resume")
    assert again.exit_code == 0, again.output
    assert f"{out} is complete: nothing to resume" in again.stderr
    assert out.read_bytes() == before
    other = invoke(*common, "--resume", "-n", 2)
    assert other.exit_code == 1
    assert "settings.samples is 4 in eval.json, 2 in this run" in error_lines(other)[0]


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_eval_and_resume_finishes_it(
    server_prompts: Path, tmp_path: Path, signum: int, code: int
) -> None:
    server = FakeOpenAIServer(default=Reply(delay=60))  # requests after the first three hang
    server.reply(*[Reply() for _ in range(3)])
    out = tmp_path / "eval.json"
    with serving_in_thread(server):
        args = [str(a) for a in ["eval", "--base-url", server.base_url, "--model", "m",
                "--prompts", server_prompts, "-n", 2, "--concurrency", 3, "--out", out]]  # fmt: skip
        returncode, stderr, took = signal_when(
            args, lambda: server.in_flight > 0 and lines(progress_of(out)) >= 1, signum
        )
        assert returncode == code, stderr
        assert took < 1.5
        assert "Traceback" not in stderr
        reported = re.search(r"Interrupted: .* holds (\d+) of 4 prompts' results; run the same "
                             "command with --resume to continue", stderr)  # fmt: skip
        assert reported, stderr
        assert len(list(tr.load_jsonl(progress_of(out), tr.PassAtKResult))) == int(reported[1])
        server.default = Reply()
        result = invoke(*args, "--resume")
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["metrics"]["num_prompts"] == 4


# --------------------------------------------------------------------------- eval-merge


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


def test_eval_merge_ignores_replicas_and_their_spelling(
    server: FakeOpenAIServer, server_prompts: Path, tmp_path: Path
) -> None:
    local = server.base_url.replace("127.0.0.1", "localhost")
    runs = [
        ["--base-url", server.base_url, "--rank", 0, "--concurrency", 2, "--timeout", 30],
        ["--base-url", local, "--base-url", server.base_url, "--rank", 1],
    ]
    for i, flags in enumerate(runs):
        result = invoke("eval", "--model", "m", "--prompts", server_prompts, "-n", 2,
                        "--world", 2, "--out", tmp_path / f"r{i}.json", *flags)  # fmt: skip
        assert result.exit_code == 0, result.output
    # A file of an older version recorded the replicas in its settings.
    old = json.loads((tmp_path / "r1.json").read_text())
    old["settings"]["base_url"] = [local, server.base_url]
    (tmp_path / "r1.json").write_text(json.dumps(old))
    result = invoke("eval-merge", tmp_path / "r0.json", tmp_path / "r1.json")
    assert result.exit_code == 0, result.output


def test_eval_merge_needs_every_rank_once(letter_prompts: Path, tmp_path: Path) -> None:
    common = ["eval", "--embedded", "--prompts", letter_prompts, "--world", 3, "--out"]
    for rank in range(2):
        assert invoke(*common, tmp_path / f"r{rank}.json", "--rank", rank).exit_code == 0
    missing = invoke("eval-merge", tmp_path / "r0.json", tmp_path / "r1.json")
    assert missing.exit_code == 1
    assert error_lines(missing) == [
        "Error: missing rank(s) 2 of world_size 3 (the eval run had --world 3): give "
        "eval-merge every rank's file"
    ]
    twice = invoke("eval-merge", tmp_path / "r0.json", tmp_path / "r0.json")
    assert twice.exit_code == 1
    assert "are both rank 0" in error_lines(twice)[0]


def test_eval_merge_names_each_difference_with_full_values(
    letter_prompts: Path, tmp_path: Path
) -> None:
    common = ["eval", "--embedded", "--prompts", letter_prompts, "--world", 2]
    assert invoke(*common, "--rank", 0, "-n", 2, "--out", tmp_path / "a.json").exit_code == 0
    assert invoke(*common, "--rank", 1, "-n", 3, "--out", tmp_path / "b.json").exit_code == 0
    long_value = "x" * 100
    data = json.loads((tmp_path / "b.json").read_text())
    data["settings"]["note"] = long_value
    (tmp_path / "b.json").write_text(json.dumps(data))
    result = invoke("eval-merge", tmp_path / "a.json", tmp_path / "b.json")
    assert result.exit_code == 1
    [line] = error_lines(result)
    assert "are not ranks of one run" in line
    assert "settings.samples is 2 in a.json, 3 in b.json" in line
    assert f'settings.note is not set in a.json, "{long_value}" in b.json' in line


@pytest.mark.parametrize("key", ["world_size", "rank", "response"])
def test_eval_merge_names_a_missing_key_and_the_file(
    letter_prompts: Path, tmp_path: Path, key: str
) -> None:
    shard = tmp_path / "r0.json"
    assert invoke("eval", "--embedded", "--prompts", letter_prompts, "--out", shard).exit_code == 0
    data = json.loads(shard.read_text())
    del data[key]
    shard.write_text(json.dumps(data))
    result = invoke("eval-merge", shard)
    assert result.exit_code == 1
    assert error_lines(result) == [
        f"Error: {shard}: a result file of 'trio-rollouts eval' without '{key}'; it was cut "
        "short or edited: run that rank's eval again"
    ]


def test_eval_merge_refuses_a_file_that_is_not_an_eval_result(tmp_path: Path) -> None:
    bogus = tmp_path / "x.json"
    bogus.write_text("[1, 2]")
    result = invoke("eval-merge", bogus)
    assert result.exit_code == 1
    assert "not a result file of 'trio-rollouts eval'" in error_lines(result)[0]


def test_eval_merge_refuses_an_existing_out_unless_overwrite(
    letter_prompts: Path, tmp_path: Path
) -> None:
    shard, out = tmp_path / "r0.json", tmp_path / "merged.json"
    assert invoke("eval", "--embedded", "--prompts", letter_prompts, "--out", shard).exit_code == 0
    out.write_text("keep me\n")
    result = invoke("eval-merge", shard, "--out", out)
    assert result.exit_code == 1
    assert error_lines(result) == [f"Error: {out} exists; pass --overwrite to replace it"]
    assert invoke("eval-merge", shard, "--out", out, "--overwrite").exit_code == 0
    assert json.loads(out.read_text())["metrics"] == json.loads(shard.read_text())["metrics"]


def test_eval_resume_never_replaces_a_file_it_did_not_write(
    letter_prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "eval.json"
    out.write_text("my notes\n")
    result = invoke("eval", "--embedded", "--prompts", letter_prompts, "--out", out, "--resume")
    assert result.exit_code == 1
    assert error_lines(result) == [
        f"Error: {out} is not a result file of 'trio-rollouts eval' and there is no "
        "eval.json.progress.jsonl to resume; pass --overwrite to replace it"
    ]
    assert out.read_text() == "my notes\n"


def test_eval_resume_refuses_a_progress_line_of_another_prompt(
    letter_prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "eval.json"
    common = ["eval", "--embedded", "--prompts", letter_prompts, "--out", out, "--num-prompts", 2]
    assert invoke(*common).exit_code == 0
    result = json.loads(out.read_text())["response"]["results"][0]
    out.unlink()  # as if the run had stopped with one (edited) line of progress
    progress_of(out).write_text(json.dumps({**result, "problem_id": "elsewhere"}) + "\n")
    resumed = invoke(*common, "--resume")
    assert resumed.exit_code == 1
    assert (
        "holds a result for problem 'elsewhere', which is not among this rank's 2 prompts"
        in (error_lines(resumed)[0])
    )
