"""Where a call goes: placement of calls on an interface's replicas.

A GRPO group is ``G`` requests with the same prompt, and a multi-turn episode sends its
growing context every turn. A replica that has served one of them holds its prompt in
its prefix cache, so the group's other calls, and the episode's later turns, are cheaper
there. :class:`Placement` picks a replica for each call (``OpenAIInference`` with several
``base_url``, ``EmbeddedInference(engine=..., replicas=R)``):

- ``"least_loaded"``: the replica with the fewest calls outstanding (ties go round);
- ``"round_robin"``: each replica in turn, whatever their load;
- ``"group"`` (the default): the first call of a group goes to the least loaded replica,
  ties broken by a seeded hash of the group key (never "the first replica"); the group's
  later calls, and every turn of each of its episodes, go to the same replica unless it
  has more than ``margin`` calls outstanding above the least loaded, not counting the
  group's own (siblings that arrive together stay together), and then to that one
  (which becomes the group's, and the episode's, replica). A call outside any group
  (outside the pipeline) is placed as ``"least_loaded"``.

The call context (``trio_rollouts._context.CallContext``) tells the backend which group a
call belongs to (``group``: ``(run seed, batch id, index)``, set by the pipeline) and
which episode (``episode``: the member's index, set by the library's agents). Placement
is a pure function of the keys and the order of calls: two seeded runs place alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from typing import Any, Final, Literal

import attrs

from trio_rollouts._checks import int_at_least
from trio_rollouts._context import call_context

__all__ = [
    "DEFAULT_ROUTING_MARGIN",
    "ROUTINGS",
    "Placement",
    "Routing",
    "check_routing",
    "placement_key",
]

#: How calls are spread over replicas (see the module docstring).
Routing = Literal["group", "least_loaded", "round_robin"]

#: Every routing, the default first.
ROUTINGS: Final[tuple[Routing, ...]] = ("group", "least_loaded", "round_robin")

#: How many calls more than the least loaded replica a group's replica may have before
#: the group's next call goes elsewhere.
DEFAULT_ROUTING_MARGIN: Final = 2


#: Sticky entries kept (oldest forgotten first): far more groups than are ever in flight.
_REMEMBERED: Final = 1 << 16


def placement_key() -> tuple[tuple[int, int, int] | None, int | None]:
    """The group and episode of the calling task's call (from its call context), for
    :meth:`Placement.pick`."""
    context = call_context.get()
    return context.group, context.episode


def check_routing(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """An attrs validator: ``value`` is one of :data:`ROUTINGS`."""
    if not isinstance(value, str) or value not in ROUTINGS:
        allowed = ", ".join(repr(r) for r in ROUTINGS)
        msg = f"{attribute.name} must be one of {allowed}, got {value!r:.80}"
        raise ValueError(msg)


def _tie_hash(key: Hashable) -> int:
    """A hash of a group key that is the same in every process (never ``hash()``)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@attrs.define(kw_only=True, eq=False)
class Placement:
    """Picks a replica for each call (see the module docstring).

    One per interface and Trio run: ``index = pick(load, *placement_key())`` with each
    replica's calls outstanding, and ``release(group, index)`` when that call ends (the
    group's own calls are not held against its replica). Not a checkpoint; not
    thread-safe (one Trio run).
    """

    replicas: int = attrs.field(validator=int_at_least(1))
    routing: Routing = attrs.field(default="group", validator=check_routing)
    margin: int = attrs.field(default=DEFAULT_ROUTING_MARGIN, validator=int_at_least(0))
    _next: int = attrs.field(init=False, default=0)
    _groups: dict[Hashable, int] = attrs.field(init=False, factory=dict, repr=False)
    _episodes: dict[Hashable, int] = attrs.field(init=False, factory=dict, repr=False)
    # Calls outstanding per (group, replica), between pick() and release().
    _own: dict[tuple[Hashable, int], int] = attrs.field(init=False, factory=dict, repr=False)

    def pick(
        self,
        load: Sequence[int],
        group: Hashable | None = None,
        episode: int | None = None,
    ) -> int:
        """The replica for a call of ``group`` (``None``: outside any group) and
        ``episode``, given each replica's ``load`` (calls outstanding). Callers pass
        :func:`placement_key` read in the calling task."""
        n = self.replicas
        if n == 1:
            return 0
        if self.routing == "round_robin":
            index = self._next
            self._next = (index + 1) % n
            return index
        if group is None or self.routing != "group":
            return self._least_loaded(load)
        least = min(load)
        home = None
        if episode is not None:
            home = self._episodes.get((group, episode))
        if home is None:
            home = self._groups.get(group)
        if home is not None and load[home] - self._own.get((group, home), 0) - least <= self.margin:
            index = home
        else:
            tied = [i for i in range(n) if load[i] == least]
            index = tied[_tie_hash(group) % len(tied)] if len(tied) > 1 else tied[0]
        if home != index:
            _remember(self._groups, group, index)
        if episode is not None:
            _remember(self._episodes, (group, episode), index)
        own = (group, index)
        self._own[own] = self._own.get(own, 0) + 1
        return index

    def release(self, group: Hashable | None, index: int) -> None:
        """A call of ``group`` placed on replica ``index`` by :meth:`pick` has ended."""
        if group is None or self.replicas == 1 or self.routing != "group":
            return
        own = (group, index)
        count = self._own.get(own, 0) - 1
        if count > 0:
            self._own[own] = count
        else:
            self._own.pop(own, None)

    def _least_loaded(self, load: Sequence[int]) -> int:
        n = self.replicas
        start = self._next
        index = min(range(n), key=lambda i: (load[i], (i - start) % n))
        self._next = (index + 1) % n
        return index


def _remember(table: dict[Hashable, int], key: Hashable, index: int) -> None:
    table[key] = index
    if len(table) > _REMEMBERED:
        del table[next(iter(table))]
