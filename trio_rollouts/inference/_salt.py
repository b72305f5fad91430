"""The epoch-salted prefix cache: the salt each request carries, and the epoch whose
weights computed the KV its tokens attend to.

A pause that keeps the cache (vLLM ``keep``, SGLang ``in_place``), or a weight reload the
server is not told about, leaves KV blocks computed under old weights in the server's
prefix cache, and the server reuses them for *new* requests that share a prefix: the
trainer then learns from tokens sampled on a context the current policy never computed
(NeMo-RL saw requests served from KV up to 17 updates old). A prefix-cache salt (vLLM's
``cache_salt``, SGLang's ``extra_key``) enters the hash of a request's first block, so
requests share cached blocks only when their salts are equal.

With ``cache_salt="epoch"`` (the default) a request's salt is a hash of the run and one
epoch: the *start epoch of the call's group* (the epoch the pipeline started it under),
so a group's siblings and every turn of its episodes share their prefix, and a new
group never reads KV computed before its own start. A continuation after an ``abort``
pause is salted with the new epoch: its prefix is computed again, under the new weights.

That makes the record exact: ``kv_cache_epoch`` stamps each sampled token with the
salt's epoch, the oldest weights any KV it attended to can come from (a salt's blocks
are computed at or after its epoch). For a ``keep`` pause the tokens after the boundary
still attend to the KV computed before it, so ``kv_cache_epoch`` has no boundary there;
an ``abort`` continuation starts a new one (its prefix was computed again).
"""

from __future__ import annotations

import functools
import hashlib
import secrets
from collections.abc import Callable
from typing import Any, Literal, TypeAlias

import attrs

from trio_rollouts.inference._placement import placement_key

__all__ = [
    "CACHE_SALTS",
    "CacheSalt",
    "CacheSaltCall",
    "check_cache_salt",
    "epoch_salt",
    "new_run_id",
    "salt_of",
]


@attrs.frozen(kw_only=True)
class CacheSaltCall:
    """What a ``cache_salt`` callable is told about one request.

    - ``epoch``: the epoch the default salt would name: the start epoch of the call's
      group (in a pipeline; else the interface's epoch when the call started), or, for a
      continuation after an ``abort`` pause, the epoch it continues under;
    - ``start_epoch``: the start epoch of the call's group (the same as ``epoch`` except
      for a continuation);
    - ``group``: the call's group, ``(run seed or 0, batch id, index in the batch)``, or
      ``None`` outside a pipeline; ``episode``: the member of the group (the library's
      agents set it), else ``None``;
    - ``continuation``: 0 for the call's first request, ``k`` for its ``k``-th
      continuation after an ``abort`` pause.
    """

    epoch: int
    start_epoch: int
    group: tuple[int, int, int] | None = None
    episode: int | None = None
    continuation: int = 0


#: ``"epoch"``, ``"off"``, or ``(run_id, call) -> salt or None`` (``None``: no salt).
CacheSalt: TypeAlias = Literal["epoch", "off"] | Callable[[str, CacheSaltCall], "str | None"]

#: The named settings of ``cache_salt``.
CACHE_SALTS = ("epoch", "off")


def new_run_id() -> str:
    """A run id for an interface that was given none: random, so that two runs (whose
    epochs name different weights) never share a salt."""
    return secrets.token_hex(8)


@functools.lru_cache(maxsize=256)
def epoch_salt(run_id: str, epoch: int) -> str:
    """The salt of ``epoch`` in run ``run_id``: a short hash of both (stable across
    processes, so every Ray actor and a resumed run salt alike)."""
    digest = hashlib.blake2b(f"{run_id}\x00{epoch}".encode(), digest_size=12).hexdigest()
    return f"trio-rollouts-{digest}"


def salt_of(
    setting: CacheSalt,
    run_id: str,
    start_epoch: int,
    epoch: int,
    continuation: int,
) -> tuple[str | None, int | None]:
    """The salt of a request under ``setting`` (``None``: none), for a call whose group
    started under ``start_epoch``, sent (``continuation`` 0) or continued (the
    ``continuation``-th time) under ``epoch``; and the epoch ``kv_cache_epoch`` records
    for it (``None``: unknown, unless it is the epoch salt)."""
    salted_epoch = epoch if continuation else start_epoch
    if setting == "epoch":
        return epoch_salt(run_id, salted_epoch), salted_epoch
    if setting == "off":
        return None, None
    group, episode = placement_key()
    call = CacheSaltCall(
        epoch=salted_epoch,
        start_epoch=start_epoch,
        group=group,
        episode=episode,
        continuation=continuation,
    )
    salt = setting(run_id, call)
    if salt is not None and not isinstance(salt, str):
        msg = f"the cache_salt callable must return a str or None, got {salt!r:.80}"
        raise TypeError(msg)
    return salt, None


def check_cache_salt(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """An attrs validator: ``"epoch"``, ``"off"`` or a callable."""
    if value in CACHE_SALTS or (callable(value) and not isinstance(value, str)):
        return
    msg = (
        f"{attribute.name} must be 'epoch', 'off' or a callable (run_id, call) -> str | None, "
        f"got {value!r:.80}"
    )
    raise ValueError(msg)
