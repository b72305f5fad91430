"""TrainingBatch.from_groups: delivered groups of TokenRollout as a trainer's arrays.

Every field on a hand-made batch with known advantages; padding; the alignment property
over random rollouts (hypothesis) against a per-token reference; the shift the docs show;
the errors; and that the module needs no torch.
"""

from __future__ import annotations

import ast
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import trio_rollouts as tr
from trio_rollouts import Rollout, RolloutGroup, TokenRollout, TrainingBatch

MODULE = Path(tr.__file__).parent / "models" / "_training.py"


def adv(sign: float) -> np.float32:
    """The GRPO advantage of a group of two with rewards one apart: +-0.5/(0.5 + 1e-6)."""
    return np.float32(sign * 0.5 / (0.5 + 1e-6))


# ----------------------------------------------------------------------------- the example


def example_groups() -> list[RolloutGroup]:
    """Two groups. Group 0 (start_epoch 3): a single-turn rollout (reward 1.0) and a
    split episode of two elements (reward 0.0) whose second element has an epoch
    boundary. Group 1 (start_epoch 7): a list reward summing to 0.5, and a rollout
    without logprobs or epoch stamps (reward 1.5)."""
    single = TokenRollout(
        trajectory=[[11, 12, 13, 14, 15]],
        reward=1.0,
        generation_mask=[[False, False, True, True, True]],
        logprobs=[[-0.5, -0.25, -0.125]],
        policy_epoch=[[(0, 3)]],
    )
    episode = TokenRollout(
        trajectory=[[21, 22, 23, 24], [31, 32, 33, 34, 35, 36]],
        reward=0.0,
        generation_mask=[
            [False, True, False, True],
            [False, False, True, True, False, True],
        ],
        logprobs=[[-1.0, -2.0], [-3.0, -4.0, -5.0]],
        policy_epoch=[[(0, 3)], [(0, 3), (3, 4)]],
    )
    listed = TokenRollout(
        trajectory=[[41, 42, 43]],
        reward=[0.25, 0.25],
        generation_mask=[[False, True, True]],
        logprobs=[[-0.75, -1.5]],
        policy_epoch=[[(0, 7)]],
    )
    bare = TokenRollout(
        trajectory=[[51, 52]],
        reward=1.5,
        generation_mask=[[False, True]],
    )
    return [
        RolloutGroup(rollouts=[single, episode], start_epoch=3),
        RolloutGroup(rollouts=[listed, bare], index_in_batch=1, start_epoch=7),
    ]


def test_every_field_of_a_hand_made_batch() -> None:
    batch = TrainingBatch.from_groups(example_groups())
    a, b = adv(1.0), adv(-1.0)
    np.testing.assert_array_equal(
        batch.input_ids,
        [
            [11, 12, 13, 14, 15, 0],
            [21, 22, 23, 24, 0, 0],
            [31, 32, 33, 34, 35, 36],
            [41, 42, 43, 0, 0, 0],
            [51, 52, 0, 0, 0, 0],
        ],
    )
    np.testing.assert_array_equal(
        batch.attention_mask,
        [
            [1, 1, 1, 1, 1, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 1],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
        ],
    )
    np.testing.assert_array_equal(
        batch.loss_mask,
        [
            [0, 0, 1, 1, 1, 0],
            [0, 1, 0, 1, 0, 0],
            [0, 0, 1, 1, 0, 1],
            [0, 1, 1, 0, 0, 0],
            [0, 1, 0, 0, 0, 0],
        ],
    )
    np.testing.assert_array_equal(
        batch.logprobs,
        np.array(
            [
                [0, 0, -0.5, -0.25, -0.125, 0],
                [0, -1, 0, -2, 0, 0],
                [0, 0, -3, -4, 0, -5],
                [0, -0.75, -1.5, 0, 0, 0],
                [0, 0, 0, 0, 0, 0],
            ],
            dtype=np.float32,
        ),
    )
    np.testing.assert_array_equal(
        batch.policy_epoch,
        [
            [3, 3, 3, 3, 3, -1],
            [3, 3, 3, 3, -1, -1],
            [3, 3, 3, 4, 4, 4],
            [7, 7, 7, -1, -1, -1],
            [7, 7, -1, -1, -1, -1],  # no stamps: the group's start_epoch
        ],
    )
    np.testing.assert_array_equal(
        batch.advantages,
        np.array(
            [
                [0, 0, a, a, a, 0],
                [0, b, 0, b, 0, 0],
                [0, 0, b, b, 0, b],
                [0, b, b, 0, 0, 0],  # 0.25 + 0.25 = 0.5 against 1.5
                [0, a, 0, 0, 0, 0],
            ],
            dtype=np.float32,
        ),
    )
    np.testing.assert_array_equal(batch.rewards, np.array([1.0, 0.0, 0.0, 0.5, 1.5], np.float32))
    np.testing.assert_array_equal(
        batch.rows, [[0, 0, 0], [0, 1, 0], [0, 1, 1], [1, 0, 0], [1, 1, 0]]
    )
    np.testing.assert_array_equal(batch.has_logprobs, [True, True, True, True, False])


def test_dtypes_and_shapes() -> None:
    batch = TrainingBatch.from_groups(example_groups())
    dtypes = {
        "input_ids": np.int64,
        "attention_mask": np.bool_,
        "loss_mask": np.bool_,
        "logprobs": np.float32,
        "policy_epoch": np.int64,
        "advantages": np.float32,
        "rewards": np.float32,
        "rows": np.int64,
        "has_logprobs": np.bool_,
    }
    assert {f.name for f in attrs.fields(TrainingBatch)} == set(dtypes)
    for name, dtype in dtypes.items():
        array = getattr(batch, name)
        assert isinstance(array, np.ndarray)
        assert array.dtype == dtype, name
        assert array.flags.c_contiguous, name
        assert array.flags.writeable, name
    assert batch.input_ids.shape == (5, 6)
    assert batch.rewards.shape == batch.has_logprobs.shape == (5,)
    assert batch.rows.shape == (5, 3)


def test_the_advantages_are_the_groups_own() -> None:
    groups = example_groups()
    batch = TrainingBatch.from_groups(groups)
    for i, (g, r, _) in enumerate(batch.rows):
        expected = np.float32(groups[g].advantages()[r])
        row = batch.advantages[i]
        assert np.all(row[batch.loss_mask[i]] == expected)
        assert np.all(row[~batch.loss_mask[i]] == 0.0)


def test_padding_values() -> None:
    batch = TrainingBatch.from_groups(example_groups(), pad_id=99)
    padding = ~batch.attention_mask
    assert padding.sum() == 10
    assert np.all(batch.input_ids[padding] == 99)
    assert not batch.loss_mask[padding].any()
    assert np.all(batch.logprobs[padding] == 0.0)
    assert np.all(batch.advantages[padding] == 0.0)
    assert np.all(batch.policy_epoch[padding] == -1)
    assert np.all(batch.policy_epoch[batch.attention_mask] >= 0)


def test_the_batch_is_frozen_and_checks_its_arrays() -> None:
    batch = TrainingBatch.from_groups(example_groups())
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        batch.input_ids = batch.input_ids  # type: ignore[misc]
    fields = {f.name: getattr(batch, f.name) for f in attrs.fields(TrainingBatch)}
    with pytest.raises(TypeError, match="logprobs must have dtype float32"):
        TrainingBatch(**{**fields, "logprobs": batch.logprobs.astype(np.float64)})
    with pytest.raises(TypeError, match="rows must be a numpy array"):
        TrainingBatch(**{**fields, "rows": batch.rows.tolist()})
    with pytest.raises(ValueError, match="loss_mask has shape"):
        TrainingBatch(**{**fields, "loss_mask": batch.loss_mask[:, :-1]})
    with pytest.raises(ValueError, match="rewards must have shape"):
        TrainingBatch(**{**fields, "rewards": batch.rewards[:-1]})
    assert TrainingBatch(**fields).input_ids is batch.input_ids


# ----------------------------------------------------------------------------- edge cases


def group_of(*rollouts: TokenRollout, start_epoch: int = 0) -> RolloutGroup:
    return RolloutGroup(rollouts=list(rollouts), start_epoch=start_epoch)


def test_without_a_mask_every_id_is_generated() -> None:
    rollout = TokenRollout(trajectory=[[5, 6, 7]], reward=1.0, logprobs=[[-1.0, -2.0, -3.0]])
    batch = TrainingBatch.from_groups([group_of(rollout)])
    np.testing.assert_array_equal(batch.loss_mask, [[True, True, True]])
    np.testing.assert_array_equal(batch.logprobs, np.array([[-1, -2, -3]], np.float32))


def test_without_logprobs_the_row_says_so() -> None:
    rollout = TokenRollout(trajectory=[[5, 6]], reward=1.0, generation_mask=[[False, True]])
    batch = TrainingBatch.from_groups([group_of(rollout)])
    assert not batch.has_logprobs[0]
    assert np.all(batch.logprobs == 0.0)
    np.testing.assert_array_equal(batch.loss_mask, [[False, True]])


def test_epochs_before_the_first_boundary_and_past_the_end() -> None:
    rollout = TokenRollout(
        trajectory=[[1, 2, 3, 4], [5, 6], [7, 8, 9]],
        reward=1.0,
        policy_epoch=[[(2, 5)], [], [(0, 1), (1, 2), (9, 3)]],
    )
    batch = TrainingBatch.from_groups([group_of(rollout, start_epoch=4)])
    np.testing.assert_array_equal(batch.policy_epoch, [[4, 4, 5, 5], [4, 4, -1, -1], [1, 2, 2, -1]])


def test_boundaries_may_be_lists_and_numpy_ints() -> None:
    rollout = TokenRollout(
        trajectory=[[1, 2, 3]], reward=1.0, policy_epoch=[[[0, 1], (np.int64(1), np.int64(2))]]
    )
    batch = TrainingBatch.from_groups([group_of(rollout)])
    np.testing.assert_array_equal(batch.policy_epoch, [[1, 2, 2]])


def test_an_empty_element_is_a_row_of_padding() -> None:
    rollout = TokenRollout(
        trajectory=[[], [1, 2]],
        reward=1.0,
        generation_mask=[[], [False, True]],
        logprobs=[[], [-1.0]],
        policy_epoch=[[(0, 1)], [(0, 1)]],
    )
    batch = TrainingBatch.from_groups([group_of(rollout)], pad_id=3)
    np.testing.assert_array_equal(batch.input_ids, [[3, 3], [1, 2]])
    np.testing.assert_array_equal(batch.policy_epoch, [[-1, -1], [1, 1]])
    assert not batch.attention_mask[0].any()


def test_rollouts_without_elements_make_no_rows() -> None:
    batch = TrainingBatch.from_groups([group_of(TokenRollout(trajectory=[], reward=1.0))])
    assert batch.input_ids.shape == (0, 0)
    assert batch.rows.shape == (0, 3)


def test_mask_entries_that_are_not_bools_count_as_list_count_does() -> None:
    # TokenRollout counts generated ids with ``mask.count(True)``: 1 and np.True_ are
    # generated, 2 and 0 are not.
    mask = [0, 1, 2, np.True_, np.False_, 1]
    rollout = TokenRollout(
        trajectory=[[9] * 6], reward=1.0, generation_mask=[mask], logprobs=[[-1.0, -2.0, -3.0]]
    )
    batch = TrainingBatch.from_groups([group_of(rollout)])
    np.testing.assert_array_equal(batch.loss_mask, [[False, True, False, True, False, True]])
    np.testing.assert_array_equal(batch.logprobs, np.array([[0, -1, 0, -2, 0, -3]], np.float32))


def test_groups_may_be_any_iterable() -> None:
    groups = example_groups()
    batch = TrainingBatch.from_groups(group for group in groups)
    np.testing.assert_array_equal(batch.input_ids, TrainingBatch.from_groups(groups).input_ids)


# ----------------------------------------------------------------------------- errors


def test_a_text_rollout_is_a_type_error_naming_token_rollout() -> None:
    text = Rollout(trajectory=["Q: 1+1? A: 2"], reward=1.0)
    groups = [*example_groups(), RolloutGroup(rollouts=[text])]
    with pytest.raises(TypeError, match=r"group 2, rollout 0 is a Rollout.*TokenRollout"):
        TrainingBatch.from_groups(groups)


def test_no_groups_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="groups is empty"):
        TrainingBatch.from_groups([])


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        (example_groups()[0], r"got one RolloutGroup: pass \[group\]"),
        ([example_groups()[0], "group"], r"groups\[1\] must be a RolloutGroup, got str"),
        ("groups", "must be a list of RolloutGroup, got str"),
        (3, "must be a list of RolloutGroup, got int"),
    ],
)
def test_what_is_not_a_list_of_groups_is_a_type_error(groups: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        TrainingBatch.from_groups(groups)  # type: ignore[arg-type]


@pytest.mark.parametrize("pad_id", [1.0, True, "0", None])
def test_pad_id_must_be_an_int(pad_id: object) -> None:
    with pytest.raises(TypeError, match="pad_id must be an int"):
        TrainingBatch.from_groups(example_groups(), pad_id=pad_id)  # type: ignore[arg-type]


@pytest.mark.parametrize("pad_id", [-1, -100, 2**63])
def test_pad_id_must_be_a_token_id(pad_id: int) -> None:
    with pytest.raises(ValueError, match=r"pad_id must be a token id in \[0, 2\*\*63\)"):
        TrainingBatch.from_groups(example_groups(), pad_id=pad_id)


def test_pad_id_may_be_a_numpy_int() -> None:
    batch = TrainingBatch.from_groups(example_groups(), pad_id=np.int32(7))  # type: ignore[arg-type]
    assert batch.input_ids[0, -1] == 7


def broken(**changes: object) -> list[RolloutGroup]:
    """The example's groups with fields of group 0's episode (rollout 1) changed after
    construction (TokenRollout is mutable, so its own checks ran before)."""
    groups = example_groups()
    episode = groups[0].rollouts[1]
    for name, value in changes.items():
        setattr(episode, name, value)
    return groups


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        (
            {"generation_mask": [[False, True, False], [False] * 6]},
            ValueError,
            r"group 0, rollout 1, element 0: generation_mask has 3 entries but the element "
            r"has 4 ids",
        ),
        (
            {"generation_mask": [[False, True, False, True]]},
            ValueError,
            r"group 0, rollout 1: generation_mask has 1 entries but the trajectory has 2",
        ),
        (
            {"logprobs": [[-1.0, -2.0], [-3.0, -4.0]]},
            ValueError,
            r"group 0, rollout 1, element 1: logprobs has 2 entries but there are 3 "
            r"generated ids",
        ),
        (
            {"logprobs": [[-1.0, -2.0]]},
            ValueError,
            r"group 0, rollout 1: logprobs has 1 entries but the trajectory has 2",
        ),
        (
            {"logprobs": [[-1.0, "x"], [-3.0, -4.0, -5.0]]},
            TypeError,
            r"group 0, rollout 1, element 0: logprob 1 is 'x'",
        ),
        (
            {"trajectory": [[21, 22, 23.0, 24], [31, 32, 33, 34, 35, 36]]},
            TypeError,
            r"group 0, rollout 1, element 0: token id 2 is 23.0; ids must be ints",
        ),
        (
            {"trajectory": [[21, 22, 2**63, 24], [31, 32, 33, 34, 35, 36]]},
            ValueError,
            r"group 0, rollout 1, element 0: a token id is outside int64's range",
        ),
        (
            {"policy_epoch": [[(0, 3)]]},
            ValueError,
            r"group 0, rollout 1: policy_epoch has 1 entries but the trajectory has 2",
        ),
        (
            {"policy_epoch": [[(0, 3)], [(2, 3), (2, 4)]]},
            ValueError,
            r"group 0, rollout 1, element 1: policy_epoch\[1\] = \(2, 4\) is not a boundary",
        ),
        (
            {"policy_epoch": [[(0, 3)], [(0, -1)]]},
            ValueError,
            r"element 1: policy_epoch\[0\] = \(0, -1\) is not a boundary",
        ),
        (
            {"policy_epoch": [[(0, 3)], [(0, 3, 4)]]},
            ValueError,
            r"element 1: policy_epoch\[0\] must be a \(start_index, epoch\) pair",
        ),
        (
            {"policy_epoch": [[(0, 3)], [(0.0, 3)]]},
            ValueError,
            r"element 1: policy_epoch\[0\] must be a pair of ints",
        ),
        (
            {"reward": math.nan},
            ValueError,
            r"rollout 1 of group .* has reward nan",
        ),
    ],
)
def test_inconsistent_rollouts_are_errors_naming_where(
    changes: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        TrainingBatch.from_groups(broken(**changes))


# ----------------------------------------------------------------------------- alignment


@st.composite
def token_rollouts(draw: st.DrawFn) -> TokenRollout:
    """A random TokenRollout: 0-3 elements of 0-12 ids; a mask or none; logprobs or
    none; epoch boundaries per element (possibly none, or none for the rollout); a float
    or a list reward."""
    elements = draw(st.lists(st.lists(st.integers(0, 2**40), max_size=12), max_size=3))
    masked = draw(st.booleans())
    masks = [draw(st.lists(st.booleans(), min_size=len(e), max_size=len(e))) for e in elements]
    counts = [sum(m) for m in masks] if masked else [len(e) for e in elements]
    logprob = st.floats(-30.0, 0.0, allow_nan=False, width=32)
    logprobs = (
        [draw(st.lists(logprob, min_size=c, max_size=c)) for c in counts]
        if draw(st.booleans())
        else None
    )
    epochs: list[list[tuple[int, int]]] = []
    if draw(st.booleans()):
        for _ in elements:
            starts = sorted(draw(st.sets(st.integers(0, 14), max_size=3)))
            epochs.append([(s, draw(st.integers(0, 5))) for s in starts])
    reward = draw(
        st.floats(-10, 10, allow_nan=False)
        | st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=3)
    )
    return TokenRollout(
        trajectory=elements,
        reward=reward,
        generation_mask=masks if masked else None,
        logprobs=logprobs,
        policy_epoch=epochs,
    )


groups_strategy = st.lists(
    st.builds(
        lambda rollouts, start: RolloutGroup(rollouts=rollouts, start_epoch=start),
        st.lists(token_rollouts(), min_size=1, max_size=4),
        st.integers(0, 5),
    ),
    min_size=1,
    max_size=4,
)


def epochs_by_token(boundaries: list[tuple[int, int]], n: int, start_epoch: int) -> list[int]:
    """The reference: each id's epoch, one id at a time."""
    out = []
    for j in range(n):
        epoch = start_epoch
        for start, value in boundaries:
            if start <= j:
                epoch = value
        out.append(epoch)
    return out


@settings(max_examples=200, deadline=None)
@given(groups=groups_strategy, pad_id=st.integers(0, 2**40))
def test_every_row_lines_up_with_its_element(groups: list[RolloutGroup], pad_id: int) -> None:
    batch = TrainingBatch.from_groups(groups, pad_id=pad_id)
    expected_rows = [
        (g, r, e)
        for g, group in enumerate(groups)
        for r, rollout in enumerate(group)
        for e in range(len(rollout.trajectory))
    ]
    assert [tuple(row) for row in batch.rows.tolist()] == expected_rows
    width = max(
        (len(ids) for g, r, e in expected_rows for ids in [groups[g][r].trajectory[e]]), default=0
    )
    assert batch.input_ids.shape == (len(expected_rows), width)
    for i, (g, r, e) in enumerate(expected_rows):
        rollout = groups[g][r]
        assert isinstance(rollout, TokenRollout)
        ids = rollout.trajectory[e]
        n = len(ids)
        assert batch.input_ids[i, :n].tolist() == ids
        assert np.all(batch.input_ids[i, n:] == pad_id)
        assert batch.attention_mask[i].tolist() == [True] * n + [False] * (width - n)
        mask = rollout.generation_mask[e] if rollout.generation_mask is not None else [True] * n
        assert batch.loss_mask[i, :n].tolist() == mask
        assert not batch.loss_mask[i, n:].any()
        generated = np.flatnonzero(batch.loss_mask[i])
        if rollout.logprobs is None:
            assert not batch.has_logprobs[i]
            assert not batch.logprobs[i].any()
        else:
            assert batch.has_logprobs[i]
            np.testing.assert_array_equal(
                batch.logprobs[i, generated], np.array(rollout.logprobs[e], np.float32)
            )
            assert not np.delete(batch.logprobs[i], generated).any()
        boundaries = rollout.policy_epoch[e] if rollout.policy_epoch else []
        assert batch.policy_epoch[i, :n].tolist() == epochs_by_token(
            boundaries, n, groups[g].start_epoch
        )
        assert np.all(batch.policy_epoch[i, n:] == -1)
        advantage = np.float32(groups[g].advantages()[r])
        assert np.all(batch.advantages[i, generated] == advantage)
        assert not np.delete(batch.advantages[i], generated).any()
        assert batch.rewards[i] == np.float32(rollout.scalar_reward)


def test_the_shift_of_the_docs_predicts_the_generated_ids() -> None:
    """``input_ids[:, :-1]`` predicts ``input_ids[:, 1:]``; ``loss_mask[:, 1:]`` selects
    exactly the generated ids past position 0, with their logprobs and advantages."""
    batch = TrainingBatch.from_groups(example_groups())
    inputs = batch.input_ids[:, :-1]
    targets = batch.input_ids[:, 1:]
    loss_mask = batch.loss_mask[:, 1:]
    old_logprobs = batch.logprobs[:, 1:]
    advantages = batch.advantages[:, 1:]
    assert inputs.shape == targets.shape == loss_mask.shape
    # Every generated id (none sits at position 0 here) is a target exactly once.
    assert not batch.loss_mask[:, 0].any()
    assert loss_mask.sum() == batch.loss_mask.sum()
    assert sorted(targets[loss_mask].tolist()) == sorted(batch.input_ids[batch.loss_mask].tolist())
    for i in range(len(batch.rows)):
        for j in np.flatnonzero(loss_mask[i]):
            # The target at j is id j + 1, predicted from ids 0..j, all attended to.
            assert targets[i, j] == batch.input_ids[i, j + 1]
            assert batch.attention_mask[i, : j + 1].all()
            assert old_logprobs[i, j] == batch.logprobs[i, j + 1]
            assert advantages[i, j] == batch.advantages[i, j + 1]
    # The per-token loss of the docs, with numpy in place of torch: finite, masked.
    new_logprobs = old_logprobs.copy()
    ratio = np.exp(new_logprobs - old_logprobs)
    loss = -(ratio * advantages * loss_mask).sum() / loss_mask.sum()
    assert math.isfinite(loss)


# ----------------------------------------------------------------------------- no torch


def test_the_module_imports_only_numpy_attrs_and_the_standard_library() -> None:
    tree = ast.parse(MODULE.read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.add((node.module or "").split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"trio_rollouts"}
    assert third_party == {"attrs", "numpy"}


def test_torch_is_not_needed() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        from trio_rollouts import RolloutGroup, TokenRollout
        from trio_rollouts.models._training import TrainingBatch
        rollout = TokenRollout(
            trajectory=[[1, 2, 3]], reward=1.0, generation_mask=[[False, True, True]]
        )
        batch = TrainingBatch.from_groups([RolloutGroup(rollouts=[rollout])])
        assert batch.loss_mask.sum() == 2
        assert sys.modules["torch"] is None
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_the_public_name_when_exported() -> None:
    exported = getattr(tr, "TrainingBatch", None)
    if exported is None:
        pytest.skip("trio_rollouts does not export TrainingBatch yet")
    assert exported is TrainingBatch
