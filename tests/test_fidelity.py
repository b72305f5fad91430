"""``TokenRollout.fidelity``: checked where it is made, written only when set, so that
single-turn records are unchanged."""

from __future__ import annotations

import io

import pytest

import trio_rollouts as tr


def rollout(**kwargs: object) -> tr.TokenRollout:
    return tr.TokenRollout(trajectory=[[1, 2, 3]], reward=1.0, **kwargs)  # type: ignore[arg-type]


def test_it_is_none_by_default_and_left_out_of_the_data() -> None:
    data = tr.unstructure(rollout())
    assert "fidelity" not in data
    assert tr.structure(data, tr.TokenRollout).fidelity is None


@pytest.mark.parametrize("level", ["exact", "server_tokens", "retokenized"])
def test_a_set_level_round_trips_through_jsonl(level: str) -> None:
    buffer = io.StringIO()
    tr.dump_jsonl([rollout(fidelity=level)], buffer)
    assert f'"fidelity": "{level}"' in buffer.getvalue() or f'"fidelity":"{level}"' in (
        buffer.getvalue()
    )
    [back] = tr.load_jsonl(io.StringIO(buffer.getvalue()), tr.TokenRollout)
    assert back.fidelity == level


def test_an_unknown_level_names_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="fidelity must be None or one of 'exact', "):
        rollout(fidelity="bitwise")
    data = {**tr.unstructure(rollout()), "fidelity": "bitwise"}
    with pytest.raises(tr.ValidationError, match="got 'bitwise'"):
        tr.structure(data, tr.TokenRollout)
