"""``trio-rollouts generate`` end to end, against a real OpenAI-compatible server on
loopback (``_openai_server``): a vLLM-like one, and text-only ones that refuse unknown
request fields (``transformers serve``'s 422, api.openai.com's 400). Signals are tested
on a subprocess that gets a real SIGINT or SIGTERM."""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
from _cli_helpers import (
    closed_port,
    error_lines,
    groups_in,
    invoke,
    lines,
    serving,
    signal_when,
    standard_prompts,
    write_prompts,
)
from _openai_server import CORE_FIELDS, FakeOpenAIServer, Reply, serving_in_thread

import trio_rollouts as tr

IDENTICAL = "all completions were identical within each of the"


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    yield from serving(FakeOpenAIServer(name="server"))


@pytest.fixture
def text_only() -> Iterator[FakeOpenAIServer]:
    """Like ``transformers serve``: no token ids, no logprobs, 422 for unknown fields."""
    yield from serving(FakeOpenAIServer(name="server", unknown_fields="transformers"))


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    return standard_prompts(tmp_path / "prompts.jsonl")


def generate(server: FakeOpenAIServer, prompts: Path, out: Path, *flags: object) -> list[object]:
    return ["generate", "--base-url", server.base_url, "--model", "m", "--prompts", prompts,
            "--out", out, "--reward", "contains", *flags]  # fmt: skip


def distinct_replies(n: int) -> list[Reply]:
    return [
        Reply(choice_extra={"message": {"role": "assistant", "content": f"c{i}"}}) for i in range(n)
    ]


# --------------------------------------------------------------------------- output


def test_generate_writes_one_scored_group_per_prompt(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "rollouts.jsonl"
    result = invoke(*generate(server, prompts, out, "--group-size", 3))
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


def test_token_rollouts_keep_completion_finish_reason_and_usage(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o.jsonl"
    assert (
        invoke(*generate(server, prompts, out, "--group-size", 1, "--num-prompts", 1)).exit_code
        == 0
    )
    [[rollout]] = groups_in(out)
    assert isinstance(rollout, tr.TokenRollout)
    assert rollout.extra["completion"] == "server: 2+2"
    assert rollout.extra["finish_reason"] == "stop"
    assert rollout.extra["usage"]["completion_tokens"] == len("server: 2+2")
    assert rollout.logprobs == [[-0.5] * len("server: 2+2")]
    assert "logprobs" not in rollout.extra  # TokenRollout has its own field


def test_a_text_only_server_works_with_default_flags(
    text_only: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o.jsonl"
    result = invoke(*generate(text_only, prompts, out, "--group-size", 2))
    assert result.exit_code == 0, result.output
    groups = groups_in(out)
    assert len(groups) == 3
    for group in groups:
        for rollout in group:
            assert isinstance(rollout, tr.Rollout)
            completion = rollout.extra["completion"]
            assert completion.startswith("server: ")
            assert rollout.prompt_length is not None
            # prompt_length: the prompt's characters in the text trajectory.
            assert rollout.trajectory[0][rollout.prompt_length[0] :] == completion
            assert rollout.extra["finish_reason"] == "stop"
            assert rollout.extra["usage"]["prompt_tokens"] >= 1
            assert rollout.extra["logprobs"] is None


def test_logprobs_without_token_ids_are_kept(tmp_path: Path, prompts: Path) -> None:
    # Like api.openai.com: logprobs yes, return_token_ids no (a 400 naming it).
    fake = FakeOpenAIServer(unknown_fields="openai", known_fields=CORE_FIELDS | {"logprobs"})
    with serving_in_thread(fake):
        out = tmp_path / "o.jsonl"
        result = invoke(*generate(fake, prompts, out, "--group-size", 1, "--num-prompts", 1))
    assert result.exit_code == 0, result.output
    [[rollout]] = groups_in(out)
    assert isinstance(rollout, tr.Rollout)
    assert rollout.extra["logprobs"] == [-0.5] * len(rollout.extra["completion"])


@pytest.mark.parametrize("fields", [None, "transformers"], ids=["tokens", "text-only"])
def test_the_output_schema_example_in_the_docs_runs(
    fields: Literal["transformers"] | None,
    prompts: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    docs = (Path(__file__).parent.parent / "docs" / "cli.md").read_text(encoding="utf-8")
    [example] = re.findall(r"```python\n(.*?)```", docs, flags=re.DOTALL)
    fake = FakeOpenAIServer(unknown_fields=fields)
    with serving_in_thread(fake):
        out = tmp_path / "rollouts.jsonl"
        assert invoke(*generate(fake, prompts, out, "--group-size", 2)).exit_code == 0
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    exec(compile(example, "docs/cli.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 6
    assert "p1 1.0 stop server: 2+2" in printed  # groups are written as they finish


# --------------------------------------------------------------------------- flags


def test_generate_sends_the_generation_flags(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    result = invoke(*generate(
        server, prompts, tmp_path / "o.jsonl", "--group-size", 1, "--temperature", 0.7,
        "--top-p", 0.9, "--top-k", 20, "--max-tokens", 5, "--num-prompts", 1,
        "--extra-body", '{"seed": 3, "repetition_penalty": 1.1}', "--sampling-check", "off",
    ))  # fmt: skip
    assert result.exit_code == 0, result.output
    [received] = server.received
    assert (received.body["temperature"], received.body["top_p"]) == (0.7, 0.9)
    assert (received.body["max_tokens"], received.body["top_k"]) == (5, 20)
    assert (received.body["seed"], received.body["repetition_penalty"]) == (3, 1.1)


def test_unset_sampling_flags_are_not_sent(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    result = invoke(*generate(server, prompts, tmp_path / "o.jsonl", "--group-size", 1,
                              "--num-prompts", 1))  # fmt: skip
    assert result.exit_code == 0, result.output
    [received] = server.received
    assert not {"temperature", "top_p", "top_k", "max_tokens"} & received.body.keys()
    assert received.body["return_token_ids"] is True  # negotiated: asked for by default


def test_no_token_ids_and_no_logprobs_never_ask(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o.jsonl"
    result = invoke(*generate(server, prompts, out, "--group-size", 1, "--num-prompts", 1,
                              "--no-token-ids", "--no-logprobs"))  # fmt: skip
    assert result.exit_code == 0, result.output
    [received] = server.received
    assert "return_token_ids" not in received.body
    assert not received.body.get("logprobs")
    [[rollout]] = groups_in(out)
    assert isinstance(rollout, tr.Rollout)


def test_token_ids_flag_is_strict_against_a_server_that_refuses_it(
    text_only: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    result = invoke(*generate(text_only, prompts, tmp_path / "o.jsonl", "--token-ids",
                              "--max-retries", 0))  # fmt: skip
    assert result.exit_code == 1
    [line] = error_lines(result)
    assert "return_token_ids" in line


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            '{"seed": 1',
            "'{\"seed\": 1' is not valid JSON (Expecting ',' delimiter at character 11)",
        ),
        ("[1, 2]", "'[1, 2]' is a JSON list, not an object"),
        ("seed=1", "'seed=1' is not valid JSON (Expecting value at character 1)"),
    ],
)
def test_bad_extra_body_is_a_usage_error_naming_the_option(
    prompts: Path, tmp_path: Path, value: str, message: str
) -> None:
    result = invoke("generate", "--base-url", "http://127.0.0.1:1/v1", "--model", "m",
                    "--prompts", prompts, "--out", tmp_path / "o.jsonl", "--extra-body", value)  # fmt: skip
    assert result.exit_code == 2
    text = " ".join(result.stderr.split())
    assert "Invalid value for '--extra-body'" in text
    assert message in text
    assert "give a JSON object, e.g. '{\"seed\": 1}'" in text


def test_help_says_unset_sampling_flags_mean_the_servers_defaults() -> None:
    text = " ".join(invoke("generate", "--help").stdout.split())
    for flag in ("--temperature", "--top-k", "--top-p", "--max-tokens"):
        assert re.search(re.escape(flag) + r" [^-]*?the server's default", text), flag


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--group-size", "0"], "Invalid value for '--group-size'"),
        (["--concurrency", "x"], "Invalid value for '--concurrency'"),
        (["--top-k", "0"], "Invalid value for '--top-k'"),
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
    result = invoke(*generate(server, prompts, out, "--group-size", 2, "--filter-same-reward",
                              "--concurrency", 1, "--reward", "exact-match"))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert [g[0].problem_id for g in groups_in(out)] == ["mixed"]
    assert re.search(r"groups filtered\W+1", result.stdout)


# --------------------------------------------------------------------------- identical


def test_warns_once_when_every_group_has_identical_completions(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    result = invoke(*generate(server, prompts, tmp_path / "o.jsonl", "--group-size", 2))
    assert result.exit_code == 0, result.output
    assert result.stderr.count(IDENTICAL) == 1
    assert "each of the 3 groups so far" in result.stderr


def test_no_identical_warning_when_a_group_varies(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    server.reply(*distinct_replies(2))
    result = invoke(*generate(server, prompts, tmp_path / "o.jsonl", "--group-size", 2,
                              "--concurrency", 1))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert IDENTICAL not in result.stderr


def test_no_identical_warning_at_temperature_0(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    result = invoke(*generate(server, prompts, tmp_path / "o.jsonl", "--group-size", 2,
                              "--temperature", 0))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert IDENTICAL not in result.stderr


def test_identical_warning_comes_early_in_a_long_job(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    prompts = write_prompts(
        tmp_path / "p.jsonl", [{"prompt": f"q{i}", "answer": "x"} for i in range(20)]
    )
    result = invoke(*generate(server, prompts, tmp_path / "o.jsonl", "--group-size", 2))
    assert result.exit_code == 0, result.output
    assert result.stderr.count(IDENTICAL) == 1
    assert "each of the 16 groups so far" in result.stderr


# --------------------------------------------------------------------------- --out, --resume


def test_generate_does_not_replace_an_output_unless_told(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o.jsonl"
    out.write_text("keep me\n")
    result = invoke(*generate(server, prompts, out))
    assert result.exit_code == 1
    assert error_lines(result) == [
        f"Error: {out} exists; pass --resume to continue that job or --overwrite to replace it"
    ]
    assert out.read_text() == "keep me\n"
    assert invoke(*generate(server, prompts, out, "--overwrite")).exit_code == 0
    assert len(groups_in(out)) == 3


def test_generate_records_its_job_beside_the_output(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o.jsonl"
    common = generate(server, prompts, out, "--group-size", 2, "--top-k", 5)
    assert invoke(*common, "--sampling-check", "off").exit_code == 0
    record = json.loads((tmp_path / "o.jsonl.job.json").read_text())
    assert record["command"] == "generate"
    settings = record["settings"]
    assert (settings["group_size"], settings["model"], settings["top_k"]) == (2, "m", 5)
    assert len(settings["prompts_sha256"]) == 64
    assert not {"base_url", "concurrency", "timeout", "max_retries"} & settings.keys()


def test_generate_resume_skips_problems_already_written(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o.jsonl"
    common = generate(server, prompts, out, "--group-size", 2)
    assert invoke(*common, "--num-prompts", 2).exit_code == 0
    assert len(server.received) == 4
    result = invoke(*common, "--resume", "--concurrency", 3, "--timeout", 9)
    assert result.exit_code == 0, result.output
    assert "resuming: 2 of 3 problems are done" in result.stderr
    assert len(server.received) == 6  # only the third prompt was sent
    assert sorted(g[0].problem_id or "" for g in groups_in(out)) == ["line-3", "p1", "p2"]


def test_resume_against_another_replica_spelling_is_the_same_job(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o.jsonl"
    assert invoke(*generate(server, prompts, out, "--num-prompts", 1)).exit_code == 0
    other = server.base_url.replace("127.0.0.1", "localhost")
    result = invoke("generate", "--base-url", other, "--model", "m", "--prompts", prompts,
                    "--out", out, "--reward", "contains", "--resume")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert len(groups_in(out)) == 3


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--group-size", "3"], "group_size is 2 in the record, 3 in this run"),
        (["--group-size", "2", "--model", "other"],
         'model is "m" in the record, "other" in this run'),
        (["--group-size", "2", "--temperature", "0.5"],
         "temperature is null in the record, 0.5 in this run"),
        (["--group-size", "2", "--extra-body", '{"seed": 1}'],
         'extra_body is null in the record, {"seed": 1} in this run'),
    ],
)  # fmt: skip
def test_resume_refuses_another_jobs_output_naming_each_difference(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path, flags: list[str], expected: str
) -> None:
    out = tmp_path / "o.jsonl"
    assert (
        invoke(*generate(server, prompts, out, "--group-size", 2, "--num-prompts", 1)).exit_code
        == 0
    )
    before = out.read_bytes()
    model = flags[flags.index("--model") + 1] if "--model" in flags else "m"
    flags = [f for f in flags if f not in ("--model", model)]
    result = invoke("generate", "--base-url", server.base_url, "--model", model, "--prompts",
                    prompts, "--out", out, "--reward", "contains", "--resume", *flags)  # fmt: skip
    assert result.exit_code == 1
    [line] = error_lines(result)
    assert f"{out} belongs to another job" in line
    assert expected in line
    assert "pass --overwrite to replace it" in line
    assert out.read_bytes() == before


def test_resume_refuses_another_prompt_file_with_both_hashes(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o.jsonl"
    assert invoke(*generate(server, prompts, out, "--num-prompts", 1)).exit_code == 0
    old = json.loads((tmp_path / "o.jsonl.job.json").read_text())["settings"]["prompts_sha256"]
    with prompts.open("a") as file:
        file.write('{"prompt": "more", "answer": "x"}\n')
    result = invoke(*generate(server, prompts, out, "--resume"))
    assert result.exit_code == 1
    [line] = error_lines(result)
    assert re.search(
        rf'prompts_sha256 is "{old}" in the record, "[0-9a-f]{{64}}" in this run', line
    )


def test_resume_of_an_output_without_a_record_warns_and_records_one(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o.jsonl"
    assert invoke(*generate(server, prompts, out, "--num-prompts", 1)).exit_code == 0
    (tmp_path / "o.jsonl.job.json").unlink()
    result = invoke(*generate(server, prompts, out, "--resume"))
    assert result.exit_code == 0, result.output
    assert "has no job record (o.jsonl.job.json); its settings cannot be checked" in result.stderr
    assert (tmp_path / "o.jsonl.job.json").exists()


def test_generate_resume_removes_a_torn_last_line(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o.jsonl"
    common = generate(server, prompts, out, "--group-size", 2)
    assert invoke(*common, "--num-prompts", 1).exit_code == 0
    whole = out.read_bytes()
    out.write_bytes(whole + whole[:50])  # a second line cut off mid-write
    result = invoke(*common, "--resume")
    assert result.exit_code == 0, result.output
    assert "removed a torn last line (50 bytes" in result.stderr
    assert out.read_bytes().startswith(whole)
    assert sorted(g[0].problem_id or "" for g in groups_in(out)) == ["line-3", "p1", "p2"]


def test_generate_resume_refuses_a_file_it_did_not_write(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o.jsonl"
    out.write_text('{"not": "a group"}\n')
    result = invoke(*generate(server, prompts, out, "--resume"))
    assert result.exit_code == 1
    assert "line 1 is not a rollout group" in error_lines(result)[0]


# --------------------------------------------------------------------------- errors


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
         "line 2: not valid JSON (Expecting ',' delimiter, at the end of the line (column 28))"),
        (['{"prompt": "a" "answer": 1}'], "exact-match",
         "line 1: not valid JSON (Expecting ',' delimiter, column 16)"),
        (['  {"prompt": "a", "answer": 1,}'], "exact-match",
         "column 31)"),
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


def test_an_unreachable_server_is_a_one_line_error_and_leaves_nothing_behind(
    prompts: Path, tmp_path: Path
) -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"
    result = invoke("generate", "--base-url", url, "--model", "m", "--prompts", prompts,
                    "--out", tmp_path / "o.jsonl", "--max-retries", 0)  # fmt: skip
    assert result.exit_code == 1
    [line] = error_lines(result)
    assert f"POST {url}/chat/completions failed" in line
    assert (
        "no group was written, so there is nothing to resume: run the same command once the "
        "cause is fixed" in line
    )
    assert "more error" not in line  # the same failure of every request, shown once
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]  # no empty output


def test_a_failure_before_any_group_leaves_an_overwritten_output_as_it_was(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o.jsonl"
    assert invoke(*generate(server, prompts, out, "--num-prompts", 1)).exit_code == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    server.default = Reply(status=400, json={"error": {"message": "no such model"}})
    result = invoke(*generate(server, prompts, out, "--overwrite", "--group-size", 3))
    assert result.exit_code == 1
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_failure_after_some_groups_keeps_them_for_resume(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o.jsonl"
    server.reply(Reply(), Reply())  # the first group (of two requests) is answered
    server.default = Reply(status=400, json={"error": {"message": "the server broke"}})
    common = generate(server, prompts, out, "--group-size", 2, "--concurrency", 1)
    result = invoke(*common)
    assert result.exit_code == 1
    assert f"{out} holds 1 complete groups; once the cause is fixed" in error_lines(result)[0]
    assert len(groups_in(out)) == 1
    assert (tmp_path / "o.jsonl.job.json").exists()
    server.default = Reply()
    resumed = invoke(*common, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert "resuming: 1 of 3 problems are done" in resumed.stderr
    assert len(groups_in(out)) == 3


def test_a_job_that_writes_no_group_still_has_an_output(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", [{"prompt": "q", "answer": "nope"}])
    out = tmp_path / "o.jsonl"
    result = invoke(*generate(server, prompts, out, "--group-size", 2, "--filter-same-reward"))
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == b""
    assert (tmp_path / "o.jsonl.job.json").exists()


def test_a_server_that_rejects_the_request_is_a_one_line_error(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    server.default = Reply(status=400, json={"error": {"message": "unknown model 'm'"}})
    result = invoke(*generate(server, prompts, tmp_path / "o.jsonl"))
    assert result.exit_code == 1
    [line] = error_lines(result)
    assert "returned 400" in line
    assert "unknown model 'm'" in line


# --------------------------------------------------------------------------- progress


def test_generate_writes_progress_lines_to_a_non_terminal_stderr(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRIO_ROLLOUTS_PROGRESS_SECONDS", "0")  # a line per finished group
    result = invoke(*generate(server, prompts, tmp_path / "o.jsonl", "--concurrency", 1))
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("generating")]
    assert (
        lines[0]
        == "generating: 3 groups (a line per step; $TRIO_ROLLOUTS_PROGRESS_SECONDS sets it)"
    )
    counts = [re.match(r"generating: (\d)/3 groups \(\d+%\), \S+ \S+, retries 0, ", line)
              for line in lines[1:]]  # fmt: skip
    assert [int(found[1]) for found in counts if found] == [1, 2, 3]
    assert lines[-1].endswith("filtered 0, mean reward 0.667")


def test_the_summary_shows_a_slow_rate_in_seconds_per_group(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    server.default = Reply(delay=1.05)  # one group of one request: below 1 group/s
    result = invoke(*generate(server, prompts, tmp_path / "o.jsonl", "--num-prompts", 1,
                              "--group-size", 1))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert re.search(r"time\W+[\d.]+ s \([\d.]+ s/group\)", result.stdout)


def test_without_max_tokens_a_note_says_what_can_happen(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    result = invoke(*generate(server, prompts, tmp_path / "a.jsonl", "--timeout", 90))
    assert result.exit_code == 0, result.output
    assert (
        "note: --max-tokens is not set, so a completion runs until the server's own limit "
        "(llama.cpp's server has none), and one that takes longer than the read timeout "
        "(90 s, --timeout) fails and is retried from the start; set --max-tokens to bound "
        "completions" in " ".join(result.stderr.split())
    )
    bounded = invoke(*generate(server, prompts, tmp_path / "b.jsonl", "--max-tokens", 64))
    assert bounded.exit_code == 0, bounded.output
    assert "--max-tokens is not set" not in bounded.stderr


def test_retries_are_explained_by_error_type(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    busy = Reply(status=503, headers={"retry-after": "0"}, json={"error": {"message": "busy"}})
    server.reply(busy, busy)
    result = invoke(*generate(server, prompts, tmp_path / "o.jsonl", "--concurrency", 1))
    assert result.exit_code == 0, result.output
    [line] = [line for line in result.stderr.splitlines() if "were retried" in line]
    assert re.fullmatch(r"requests were retried 2 times: ServerError x2 \(.*503.*busy\)", line)
    assert re.search(r"retried requests\W+2", result.stdout)


# --------------------------------------------------------------------------- signals


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_generate_at_once_and_leaves_whole_lines(
    tmp_path: Path, signum: int, code: int
) -> None:
    server = FakeOpenAIServer(default=Reply(delay=60))  # requests after the first six hang
    server.reply(*[Reply() for _ in range(6)])
    prompts = write_prompts(
        tmp_path / "p.jsonl",
        [{"problem_id": f"q{i}", "prompt": f"q{i}", "answer": "q"} for i in range(12)],
    )
    out = tmp_path / "o.jsonl"
    with serving_in_thread(server):
        args = [str(a) for a in generate(server, prompts, out, "--group-size", 2,
                                          "--concurrency", 4)]  # fmt: skip
        # The six fast replies finish at least two groups (of two requests each);
        # every request after them hangs.
        returncode, stderr, took = signal_when(
            args[:],
            lambda: not server.script and server.in_flight > 0 and lines(out) >= 2,
            signum,
        )
        assert returncode == code, stderr
        assert took < 1.5
        assert "Traceback" not in stderr
        reported = re.search(
            r"Interrupted: .* holds (\d+) complete groups; run the same command with --resume",
            stderr,
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


def test_strict_token_ids_fail_against_a_server_that_ignores_them(
    tmp_path: Path, prompts: Path
) -> None:
    # Like llama-cpp-python's server: return_token_ids accepted, and ignored.
    fake = FakeOpenAIServer(ignored_fields=frozenset({"return_token_ids"}))
    with serving_in_thread(fake):
        out = tmp_path / "o.jsonl"
        result = invoke(*generate(fake, prompts, out, "--num-prompts", 1, "--token-ids"))
    assert result.exit_code != 0
    assert "returned no token ids" in result.output
    assert "--token-ids" in result.output
    help_text = " ".join(invoke("generate", "--help").output.split())
    assert "refuses it or returns none" in help_text


def test_generate_sampling_check_raise_names_the_flag_and_sends_no_group(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o.jsonl"
    common = generate(server, prompts, out, "--group-size", 2, "--top-p", 0.5)
    result = invoke(*common, "--sampling-check", "raise")
    assert result.exit_code != 0
    assert "top_p=0.5 without a sampling mask" in result.stderr
    assert "--return-sampling-mask" in result.stderr
    assert not out.exists()
    # Only the probe's requests reached the server: no group was generated.
    assert all(request.body.get("max_tokens") == 1 for request in server.received)


def test_generate_seed_gives_each_request_its_own_replayable_seed(
    server: FakeOpenAIServer, prompts: Path, tmp_path: Path
) -> None:
    for name in ("a.jsonl", "b.jsonl"):
        common = generate(server, prompts, tmp_path / name, "--group-size", 2, "--seed", 3)
        assert invoke(*common).exit_code == 0
    seeds = [request.body["seed"] for request in server.received]
    half = len(seeds) // 2
    assert len(set(seeds[:half])) == half  # every request of a run has its own
    assert sorted(seeds[:half]) == sorted(seeds[half:])  # and a rerun sends the same
