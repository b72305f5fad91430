"""Weight versions as ``policy_epoch`` boundaries: the spans a server stamps on the
tokens it generated (vLLM's native route, SGLang's replies), read through the labels an
interface set (``str(epoch)`` to its epoch).

A label the interface did not set (``"default"``, a trainer's own) is never guessed into
an epoch: its tokens keep the epoch their call started under.
"""

from __future__ import annotations

import attrs

__all__ = ["Span", "policy_boundaries"]


@attrs.frozen
class Span:
    """Generated tokens ``[start, end)`` were sampled under weights labelled ``version``."""

    version: str
    start: int
    end: int


def policy_boundaries(
    spans: list[Span], labels: dict[str, int], start_epoch: int
) -> tuple[list[tuple[int, int]], list[str]]:
    """``policy_epoch`` boundaries ``(index into the generated tokens, epoch)`` from a
    reply's ``weight_versions``, the first at 0, one where the epoch changes; and the
    labels that are not in ``labels`` (the interface did not set them: their spans keep
    ``start_epoch``, the epoch the call started under, rather than a guess)."""
    boundaries: list[tuple[int, int]] = []
    foreign: list[str] = []
    for span in spans:
        epoch = labels.get(span.version)
        if epoch is None:
            epoch = start_epoch
            if span.version not in foreign:
                foreign.append(span.version)
        if span.end <= span.start:
            continue
        if not boundaries:
            boundaries.append((0, epoch))
        elif boundaries[-1][1] != epoch:
            boundaries.append((span.start, epoch))
    return boundaries, foreign
