"""What an interface knows about its vLLM replicas' native route: per replica, over the
interface's life (:class:`ReplicaState`, all of them in :class:`NativeReplicas`, part of
the interface's :class:`~._learned.Learned`), and per Trio run (:class:`NativeRun`: the
locks that order label requests, the aborts waiting to be sent).
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from trio_rollouts.inference.openai._vllm_wire import REWRITTEN_PREFIX

__all__ = ["NativeReplicas", "NativeRun", "PendingAborts", "ReplicaState"]


@attrs.define(eq=False)
class ReplicaState:
    """What the interface knows about one replica's native route, over its life.

    ``native``: ``None`` until a native request was answered or refused. ``labelled``:
    ``None`` until the first-contact label was answered; ``False`` when the replica does
    not take labels (no ``VLLM_SERVER_DEV_MODE=1``). ``labels``: every label this
    interface set on it, with its epoch. ``stale``: a later label failed, so the server
    may carry an old one. ``foreign``: a reply carried a label this interface did not set.
    """

    native: bool | None = None
    renders: bool = True  # serves /tokenize (text prompts go native)
    contacted: bool = False
    labelled: bool | None = None
    label: str | None = None
    labels: dict[str, int] = attrs.field(factory=dict)
    stale: bool = False
    foreign: bool = False
    unstamped: bool = False  # replies without weight_versions
    id_prefix: str = REWRITTEN_PREFIX
    sampling_mask: bool = False

    @property
    def stamps(self) -> bool:
        """Whether its replies give exact ``policy_epoch`` boundaries."""
        return (
            self.native is True
            and self.labelled is True
            and not (self.stale or self.foreign or self.unstamped)
        )

    @property
    def trusted_labels(self) -> dict[str, int] | None:
        """The labels its spans map through (``None``: its labels cannot be trusted)."""
        if self.labelled is not True or self.stale:
            return None
        return self.labels


@attrs.define(eq=False)
class NativeReplicas:
    """The native state of every replica (index = replica) and the epoch the labels
    follow (``label_epoch``: set by ``resume`` before it labels, so that a first contact
    racing a resume labels the new epoch). A pickled copy starts afresh, keeping only the
    epoch: another process learns its replicas again."""

    replicas: tuple[ReplicaState, ...]
    label_epoch: int = 0

    @classmethod
    def for_replicas(cls, n: int) -> NativeReplicas:
        return cls(tuple(ReplicaState() for _ in range(n)))

    def __getstate__(self) -> dict[str, Any]:
        return {"n": len(self.replicas), "label_epoch": self.label_epoch}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.replicas = tuple(ReplicaState() for _ in range(state["n"]))
        self.label_epoch = state["label_epoch"]


@attrs.define(eq=False)
class PendingAborts:
    """Rewritten ids waiting to be aborted on one replica, and whether a sender runs."""

    pending: list[str] = attrs.field(factory=list)
    sending: bool = False


@attrs.define(eq=False)
class NativeRun:
    """What one Trio run holds for the native route: a lock per replica that orders its
    label requests, and the aborts waiting to be sent."""

    locks: tuple[trio.Lock, ...]
    aborts: tuple[PendingAborts, ...]

    @classmethod
    def for_replicas(cls, n: int) -> NativeRun:
        return cls(tuple(trio.Lock() for _ in range(n)), tuple(PendingAborts() for _ in range(n)))
