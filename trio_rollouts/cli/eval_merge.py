"""``trio-rollouts eval-merge``: join the result files of every rank of one sharded
``eval`` run into exactly the result of one unsharded run.

Ranks must agree on what changes results (the prompt file, the number of prompts, the
reward, the sampling arguments, the model); where and how fast requests went (replicas,
``127.0.0.1`` or ``localhost``, concurrency, timeouts) is not compared, and files written
before it was left out of ``settings`` (``base_url``) merge too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import click

from trio_rollouts.agents._evaluation import merge_evaluation_responses
from trio_rollouts.cli._common import (
    out_option,
    overwrite_option,
    refuse_existing_out,
    reports_errors,
    stdout_console,
    write_json,
)
from trio_rollouts.cli._job import describe_differences, differences
from trio_rollouts.cli.evaluate import (
    EVAL_FORMAT,
    NOT_RESULTS,
    RESULT_KEYS,
    flat_job,
    metrics_table,
)
from trio_rollouts.models._convert import structure, unstructure
from trio_rollouts.models._evaluation import EvaluationResponse

__all__ = ["eval_merge"]


def _read_eval(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        msg = f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})"
        raise click.ClickException(msg) from None
    if not isinstance(data, dict) or data.get("format") != EVAL_FORMAT:
        msg = f"{path}: not a result file of 'trio-rollouts eval' (no format {EVAL_FORMAT!r})"
        raise click.ClickException(msg)
    missing = [key for key in RESULT_KEYS if key not in data]
    if missing:
        msg = (
            f"{path}: a result file of 'trio-rollouts eval' without "
            f"{', '.join(repr(key) for key in missing)}; it was cut short or edited: "
            "run that rank's eval again"
        )
        raise click.ClickException(msg)
    for key in ("rank", "world_size"):
        value = data[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            msg = f"{path}: {key!r} must be an integer >= 0, got {json.dumps(value)}"
            raise click.ClickException(msg)
    if not isinstance(data["settings"], dict):
        msg = f"{path}: 'settings' must be an object, got {json.dumps(data['settings'])}"
        raise click.ClickException(msg)
    return data


def _run_of(data: dict[str, Any]) -> dict[str, Any]:
    """What the ranks of one run share: their job without the rank."""
    return {key: value for key, value in flat_job(data).items() if key != "rank"}


@click.command(name="eval-merge")
@click.argument(
    "shards",
    nargs=-1,
    required=True,
    type=click.Path(exists=True, dir_okay=False, readable=True, path_type=Path),
)
@out_option("Write the merged result here (the format of an unsharded 'eval').", required=False)
@overwrite_option
@reports_errors
def eval_merge(shards: tuple[Path, ...], out: Path | None, overwrite: bool) -> None:
    """Merge the result files of every rank of one sharded 'eval' run.

    The files may come in any order; together they must hold each rank of the run once,
    with the same prompts and settings (replicas, concurrency and timeouts may differ).
    The merged result is exactly what one unsharded run writes.
    """
    if out is not None and not overwrite:
        refuse_existing_out(out, resumable=False)
    files = [(path, _read_eval(path)) for path in shards]
    first_path, first = files[0]
    for path, data in files[1:]:
        found = differences(_run_of(first), _run_of(data))
        if found:
            shown = describe_differences(found, f"in {first_path.name}", f"in {path.name}")
            msg = (
                f"{path} and {first_path} are not ranks of one run: {shown}; merge the ranks "
                "of one run"
            )
            raise click.ClickException(msg)
    world = first["world_size"]
    by_rank: dict[int, Path] = {}
    for path, data in files:
        rank = data["rank"]
        if rank in by_rank:
            msg = f"{path} and {by_rank[rank]} are both rank {rank}"
            raise click.ClickException(msg)
        by_rank[rank] = path
    missing = sorted(set(range(world)) - set(by_rank))
    if missing:
        msg = (
            f"missing rank(s) {', '.join(map(str, missing))} of world_size {world} (the "
            f"eval run had --world {world}): give eval-merge every rank's file"
        )
        raise click.ClickException(msg)
    ordered = sorted(files, key=lambda item: int(item[1]["rank"]))
    # Files written before responses carried their rank get it from the file.
    responses = [
        attrs.evolve(response, rank_info=response.rank_info or (int(data["rank"]), int(world)))
        for response, data in (
            (structure(data["response"], EvaluationResponse), data) for _, data in ordered
        )
    ]
    merged = merge_evaluation_responses(responses)
    metrics = merged.metrics()
    settings = {k: v for k, v in first["settings"].items() if k not in NOT_RESULTS}
    result = {
        **first,
        "rank": 0,
        "world_size": 1,
        "settings": settings,
        "metrics": metrics,
        "response": unstructure(merged),
    }
    stdout_console().print(metrics_table(f"trio-rollouts eval-merge: {world} ranks", metrics))
    if out is not None:
        write_json(out, result)
        click.echo(f"wrote {out}", err=True)
