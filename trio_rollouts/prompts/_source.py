"""A checkpointable source of prompts: every prompt of every epoch taken exactly once.

:class:`PromptSource` hands out :class:`~trio_rollouts.Problem` objects, one per
``draw()``, epoch after epoch: epoch ``e`` is a permutation of the problems seeded by
``(seed, e)``. It keeps which draws are not *done* yet, so that a run killed at any
point and restored from a checkpoint (:meth:`PromptSource.state_dict`,
:meth:`PromptSource.load_state_dict`) neither repeats nor skips a prompt.

The grouped pipeline tells the source what became of each draw (see
``docs/checkpoint-resume.md``). A call's draws are recorded through a context variable
that the pipeline sets around each ``group_rollout`` call (``_draws.py``; child tasks of
the call inherit it):

- done: the consumer took the group, or the group was filtered;
- given back, to be drawn again before any new prompt: the call failed, was cancelled,
  restarted, or dropped as stale, its group was skipped or went stale in the buffer, or
  it was finished but nobody took it before the stream closed.
"""

from __future__ import annotations

import bisect
import hashlib
import threading
from collections.abc import Iterable, Sequence
from typing import Any, Final

import numpy as np

from trio_rollouts._checks import is_int
from trio_rollouts._context import Draw, current_call
from trio_rollouts.models._problems import Problem, ProblemLike, as_problem

__all__ = ["PromptSource"]

_STATE_VERSION: Final = 1


class PromptSource:
    """Problems for a training run, drawn one per group, epoch after epoch, with a
    state that survives a restart.

    ``problems``: :class:`~trio_rollouts.Problem` objects or ``(problem_id, prompt,
    answer)`` tuples, with unique ids (``ValueError`` otherwise). Epoch ``e`` draws them
    in the order of a permutation seeded by ``(seed, e)`` (list order when ``shuffle``
    is false).

    Give it to an agent (``RewardOnlyAgent(prompts=source)``, or any
    ``GroupedRolloutGenerator`` whose ``prompts`` field it is) and the pipeline keeps its
    books: a problem is done when the consumer takes its group (with the sync bridge,
    when the group is returned to the caller) or when its group is filtered; problems
    of calls that failed, were skipped, restarted, cancelled or went stale, and of
    groups nobody took before the stream closed, are drawn again before any new one.

    Every method is thread-safe (the sync bridge's trainer thread may call
    :meth:`state_dict` while the pipeline draws) and none blocks.
    """

    def __init__(
        self, problems: Iterable[ProblemLike], *, shuffle: bool = True, seed: int = 0
    ) -> None:
        if not isinstance(shuffle, bool):
            msg = f"shuffle must be a bool, got {shuffle!r}"
            raise TypeError(msg)
        if not is_int(seed) or seed < 0:
            msg = f"seed must be an int >= 0, got {seed!r}"
            raise (TypeError if not is_int(seed) else ValueError)(msg)
        if isinstance(problems, (str, bytes)) or not isinstance(problems, Iterable):
            msg = f"problems must be a sequence of Problem, got {problems!r:.80}"
            raise TypeError(msg)
        checked = [as_problem(p, f"problems[{i}]") for i, p in enumerate(problems)]
        if not checked:
            msg = "problems must not be empty"
            raise ValueError(msg)
        index: dict[str, int] = {}
        for i, problem in enumerate(checked):
            first = index.setdefault(problem.problem_id, i)
            if first != i:
                msg = (
                    f"problem ids must be unique: problems[{first}] and problems[{i}] are "
                    f"both {problem.problem_id!r}"
                )
                raise ValueError(msg)
        self._problems: tuple[Problem, ...] = tuple(checked)
        self._index = index
        self._shuffle = shuffle
        self._seed = seed
        self._lock = threading.Lock()
        self._epoch = 0
        self._position = 0
        self._order = self._permutation(0)
        # Draws given back, drawn again first, kept in the order they were first drawn
        # ((epoch, rank in that epoch's permutation, id): whatever order the pipeline
        # gave them back in, a seed fixes the order they come again); and draws out (in
        # flight, or groups not yet done), in the order they were drawn.
        self._again: list[tuple[int, int, str]] = []
        # How many times each draw not done yet was given back (not in checkpoints: a
        # resumed run draws it as the first time, as the run it replays did).
        self._given_back: dict[tuple[int, str], int] = {}
        self._out: dict[tuple[int, str], None] = {}
        self._ranks: dict[int, dict[str, int]] = {}

    def __repr__(self) -> str:
        with self._lock:
            return (
                f"<PromptSource {len(self._problems)} problems, epoch {self._epoch}, "
                f"position {self._position}, {len(self._out)} out, {len(self._again)} "
                f"to draw again>"
            )

    # ---------------------------------------------------------------- properties

    @property
    def problems(self) -> tuple[Problem, ...]:
        """The problems, in the order given."""
        return self._problems

    @property
    def shuffle(self) -> bool:
        return self._shuffle

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def epoch(self) -> int:
        """The epoch new problems are drawn from (problems drawn again keep theirs)."""
        with self._lock:
            return self._epoch

    def next_starts_an_epoch(self) -> bool:
        """Whether the next :meth:`draw` starts a new epoch: no draw waits to be drawn
        again and this epoch's permutation has run out (a source used for one pass stops
        drawing here)."""
        with self._lock:
            return not self._again and self._position == len(self._order)

    def pending(self) -> list[tuple[int, str]]:
        """The ``(epoch, problem_id)`` draws not done yet: those to be drawn again first,
        then those out, oldest first."""
        with self._lock:
            return [*((epoch, pid) for epoch, _, pid in self._again), *self._out]

    # ---------------------------------------------------------------- drawing

    def _permutation(self, epoch: int) -> list[int]:
        n = len(self._problems)
        if not self._shuffle:
            return list(range(n))
        rng = np.random.default_rng([self._seed, epoch])
        return [int(i) for i in rng.permutation(n)]

    def draw(self) -> Problem:
        """The next problem: one given back, if any, else the next of this epoch's
        permutation (the next epoch starts when it runs out, whatever is still out).

        Inside a pipeline's ``group_rollout`` call the draw is booked to that call.
        Never blocks; not a checkpoint.
        """
        with self._lock:
            if self._again:
                epoch, _, problem_id = self._again.pop(0)
                key = (epoch, problem_id)
            else:
                if self._position == len(self._order):
                    self._epoch += 1
                    self._position = 0
                    self._order = self._permutation(self._epoch)
                problem = self._problems[self._order[self._position]]
                key = (self._epoch, problem.problem_id)
                self._position += 1
            self._out[key] = None
        draws = current_call().draws
        if draws is not None:
            draws.append(Draw(self._settle, key[0], key[1], self._given_back.get(key, 0)))
        return self._problems[self._index[key[1]]]

    def _settle(self, epoch: int, problem_id: str, done: bool) -> None:
        """A draw of ours is settled: done, or given back to be drawn again first."""
        with self._lock:
            key = (epoch, problem_id)
            if key not in self._out:
                return
            del self._out[key]
            if done:
                self._given_back.pop(key, None)
            else:
                self._given_back[key] = self._given_back.get(key, 0) + 1
                bisect.insort(self._again, (epoch, self._rank(epoch, problem_id), problem_id))

    def _rank(self, epoch: int, problem_id: str) -> int:
        """Where ``problem_id`` comes in epoch ``epoch``'s permutation (lock held)."""
        ranks = self._ranks.get(epoch)
        if ranks is None:
            if len(self._ranks) >= 4:  # draws given back are of recent epochs
                del self._ranks[min(self._ranks)]
            order = self._order if epoch == self._epoch else self._permutation(epoch)
            ranks = {self._problems[i].problem_id: r for r, i in enumerate(order)}
            self._ranks[epoch] = ranks
        return ranks[problem_id]

    # ---------------------------------------------------------------- checkpoints

    def _fingerprint(self) -> dict[str, Any]:
        digest = hashlib.sha256()
        for problem in self._problems:
            digest.update(problem.problem_id.encode())
            digest.update(b"\0")
        return {
            "problems": len(self._problems),
            "ids_sha256": digest.hexdigest(),
            "shuffle": self._shuffle,
            "seed": self._seed,
        }

    def state_dict(self) -> dict[str, Any]:
        """The source's state as plain data (``json.loads(json.dumps(s)) == s``): the
        epoch and position in its permutation, and the draws not done yet (they are
        drawn first after :meth:`load_state_dict`). Never blocks."""
        with self._lock:
            return {
                "version": _STATE_VERSION,
                "source": self._fingerprint(),
                "epoch": self._epoch,
                "position": self._position,
                "pending": [
                    *([epoch, pid] for epoch, _, pid in self._again),
                    *([epoch, pid] for epoch, pid in self._out),
                ],
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (from :meth:`state_dict` of a source with the same
        problems, seed and shuffle: ``ValueError`` otherwise, naming what differs): the
        draws not done are drawn first, then the permutation goes on where it was.

        Load it before the pipeline opens; draws out at that moment are forgotten.
        """
        if not isinstance(state, dict):
            msg = f"state must be a dict from PromptSource.state_dict(), got {state!r:.80}"
            raise TypeError(msg)
        version = state.get("version")
        if version != _STATE_VERSION:
            msg = f"state['version'] must be {_STATE_VERSION}, got {version!r}"
            raise ValueError(msg)
        source = state.get("source")
        mine = self._fingerprint()
        if not isinstance(source, dict):
            msg = f"state['source'] must be a dict, got {source!r:.80}"
            raise ValueError(msg)
        differences = [
            f"{key} is {source.get(key)!r} in the state, {value!r} here"
            for key, value in mine.items()
            if source.get(key) != value
        ]
        if differences:
            msg = (
                "the state belongs to another PromptSource (other problems, seed or "
                "shuffle): " + "; ".join(differences)
            )
            raise ValueError(msg)
        epoch: Any = state.get("epoch")
        position: Any = state.get("position")
        if not is_int(epoch) or epoch < 0:
            msg = f"state['epoch'] must be an int >= 0, got {epoch!r}"
            raise ValueError(msg)
        if not is_int(position) or not 0 <= position <= len(self._problems):
            msg = (
                f"state['position'] must be an int from 0 to {len(self._problems)}, "
                f"got {position!r}"
            )
            raise ValueError(msg)
        pending = state.get("pending")
        if not isinstance(pending, list):
            msg = f"state['pending'] must be a list, got {pending!r:.80}"
            raise ValueError(msg)
        again: list[tuple[int, str]] = []
        for i, item in enumerate(pending):
            if (
                not isinstance(item, (list, tuple))
                or len(item) != 2
                or not is_int(item[0])
                or not isinstance(item[1], str)
                or item[1] not in self._index
            ):
                msg = (
                    f"state['pending'][{i}] must be [epoch, problem_id] with a known "
                    f"problem id, got {item!r:.80}"
                )
                raise ValueError(msg)
            again.append((int(item[0]), item[1]))
        with self._lock:
            self._epoch = epoch
            self._position = position
            self._order = self._permutation(epoch)
            self._ranks = {}
            self._again = sorted((e, self._rank(e, pid), pid) for e, pid in again)
            self._out = {}
            self._given_back = {}

    # ---------------------------------------------------------------- sharding

    def shard(self, index: int, count: int) -> PromptSource:
        """A source over the problems at positions ``index, index + count, ...`` (one
        rank's or actor's disjoint share), with the same seed and shuffle."""
        if not is_int(count) or count < 1:
            msg = f"count must be an int >= 1, got {count!r}"
            raise ValueError(msg)
        if not is_int(index) or not 0 <= index < count:
            msg = f"index must be an int from 0 to {count - 1}, got {index!r}"
            raise ValueError(msg)
        share = self._problems[index::count]
        if not share:
            msg = f"shard {index} of {count} has no problems ({len(self._problems)} in all)"
            raise ValueError(msg)
        return PromptSource(share, shuffle=self._shuffle, seed=self._seed)

    @staticmethod
    def merge_state_dicts(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The states of a source's shards (``source.shard(i, n)`` for ``i`` in
        ``range(n)``, in order) as one plain-data state; :meth:`split_state_dict` undoes
        it."""
        return {"version": _STATE_VERSION, "shards": [dict(s) for s in states]}

    @staticmethod
    def split_state_dict(state: dict[str, Any], count: int) -> list[dict[str, Any]]:
        """The shard states of a merged state, checking that there are ``count``."""
        shards = state.get("shards") if isinstance(state, dict) else None
        if not isinstance(shards, list) or len(shards) != count:
            found = len(shards) if isinstance(shards, list) else None
            msg = f"a merged state of {count} shards is needed, got {found!r} shards"
            raise ValueError(msg)
        return [dict(s) for s in shards]
